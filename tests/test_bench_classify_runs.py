"""bench_classify_v100.py end to end against the real embedded backend on 127.0.0.1 (no mocks): the
zero-diff warm run, cold cache, an injected disagreement and an exact tie in the group audit, the
refusals that send and write nothing, the checks on the server before anything is sent; then
validate_receipts.py on the receipts the bench writes, and benchmarks/bench_harness_overhead.py.
All runs share the module-scoped embedded server; the input subset is tests/_bench_classify_support.py's.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import validate_receipts
from _bench_classify_support import MINI_IDS, NVML, TRUNCATE, receipt_of, run_bench, server_info, validate
from _bench_classify_support import mini  # noqa: F401 - fixture
from conftest import PY, REPO, error_lines

from openjev import common as common
from openjev.bench import agreement as bench_agreement


def doctor_reference(src: Path, dest: Path, edit, update_hash: bool = True) -> Path:
    """Copy a reference directory and edit its logits; the receipt's hashes stay those of the inputs and
    tokens, and logits_sha256 follows the edited array (unless update_hash is False)."""
    shutil.copytree(src, dest)
    logits = np.load(dest / "reference.npy")
    new = edit(logits.copy())
    np.save(dest / "reference.npy", new)
    if update_hash:
        meta = json.loads((dest / "reference.json").read_text())
        meta["logits_sha256"] = hashlib.sha256((dest / "reference.npy").read_bytes()).hexdigest()
        (dest / "reference.json").write_text(json.dumps(meta, indent=2))
    return dest


def groups_of(mini) -> tuple[list[list[int]], list[str], np.ndarray]:
    inputs = [json.loads(l) for l in mini["inputs"].read_text().splitlines()]
    groups, _ = bench_agreement.option_groups(inputs)
    ref = np.load(mini["reference"] / "reference.npy")
    return groups, [r["id"] for r in inputs], ref


@pytest.fixture(scope="module")
def warm_run(server, mini, tmp_path_factory):
    """One ordinary warm run (3 passes), shared by the zero-diff test and the validator tests."""
    out = tmp_path_factory.mktemp("warm") / "warm.json"
    before = server_info(server.url)
    proc = run_bench(server.url, mini, out, "--batch-size", 5, "--workers", 2, "--repetitions", 2,
                     "--label", "zero-diff")
    after = server_info(server.url)
    return {"proc": proc, "out": out, "before": before, "after": after}


# ---------------------------------------------------------------- end to end over HTTP
def test_zero_diff_against_the_embedded_backend(warm_run, mini):
    proc, out = warm_run["proc"], warm_run["out"]
    assert proc.returncode == 0, proc.stderr
    r = receipt_of(out)
    assert r["kind"] == "openjev-bench" and r["valid"] and r["complete"] and r["exit_code"] == 0
    assert r["mode"] == "warm" and "cold" not in r and r["reasons"] == [] and r["label"] == "zero-diff"
    assert r["machine"].startswith("cpu: ")
    sec = r["warm"]
    assert sec["passes_planned"] == 3 and sec["passes_done"] == 3 and sec["measured_passes_done"] == 2
    assert [p["kind"] for p in sec["passes"]] == ["initial", "measured", "measured"]
    # agreement: the embedded backend is bitwise the reference
    ag = sec["agreement_final"]
    assert ag["bitwise_equal"] and ag["max_abs_dp_e"] == 0 and ag["max_abs_logit_diff"] == 0
    assert ag["argmax_changes"] == [] and all(p["agreement"]["bitwise_equal"] for p in sec["passes"])
    # the audit: three option groups; x1-a/x1-b share a premise but not the instruction (one has none)
    au = sec["audit"]
    assert au["groups"] == 3 and au["rows_in_groups"] == 9 and au["singletons_not_covered"] == 3
    assert au["group_rows"] == [MINI_IDS[0:3], MINI_IDS[3:7], MINI_IDS[7:9]]
    assert au["passes_audited"] == 3 and not au["failed"] and au["failures_total"] == au["ties_total"] == 0
    # hashes and truncation match the reference's
    ref_meta = json.loads((mini["reference"] / "reference.json").read_text())
    assert r["tokens"]["ids_sha256"] == ref_meta["tokens"]["ids_sha256"]
    assert r["tokens"]["truncate"] == TRUNCATE and r["tokens"]["truncated_rows"] == ref_meta["tokens"]["truncated_rows"] > 0
    assert r["inputs"]["sha256"] == ref_meta["inputs"]["sha256"] and r["tokens"]["sha256"] == ref_meta["tokens"]["sha256"]
    # timing figures are what the passes say
    t = sec["timing"]
    walls = [p["wall_s"] for p in sec["passes"][1:]]
    assert t["wall_s"] == walls and t["median_wall_s"] == float(np.median(walls))
    assert t["pairs_per_s"] == pytest.approx(12 / t["median_wall_s"])
    assert t["batch_latency_s"]["count"] == 2 * 3 and t["batch_latency_s"]["max"] <= max(walls)
    assert 0 <= t["client_overhead_fraction"] < 1 and t["initial_pass_wall_s"] == sec["passes"][0]["wall_s"]
    # each batch is one request: 3 passes x 3 batches of <= 5 rows, counted by the server itself
    before, after = r["server"]["info_before"]["counters"], r["server"]["info_after"]["counters"]
    assert after["requests"] - before["requests"] == 9 and after["rows"] - before["rows"] == 36
    assert r["server"]["flush_cache_calls_delta"] == 0
    # arrays: every pass, the final one as the candidate, hashes recorded
    passes = np.load(out.with_name("warm.passes.npy"))
    cand = np.load(out.with_name("warm.candidate.npy"))
    ref = np.load(mini["reference"] / "reference.npy")
    assert passes.dtype == cand.dtype == np.float32 and passes.shape == (3, 12, 3)
    assert np.array_equal(cand, ref) and np.array_equal(passes[-1], cand)
    assert r["outputs"]["passes"]["sha256"] == hashlib.sha256(out.with_name("warm.passes.npy").read_bytes()).hexdigest()
    # operator-facing output: a summary table on stdout, one line per pass on stderr (not a TTY)
    assert "median wall" in proc.stdout and "VALID, complete (exit 0)" in proc.stdout
    assert len([l for l in proc.stderr.splitlines() if l.startswith("warm pass ")]) == 3
    v = validate(out, mini["reference"] / "reference.json")
    assert v.returncode == 0, v.stderr


def test_cold_cache_flushes_before_every_pass(server, mini, tmp_path):
    out = tmp_path / "cold.json"
    before = server_info(server.url)["flush_cache_calls"]
    proc = run_bench(server.url, mini, out, "--cold-cache", "--batch-size", 12, "--repetitions", 2)
    after = server_info(server.url)["flush_cache_calls"]
    assert proc.returncode == 0, proc.stderr
    r = receipt_of(out)
    assert after - before == 3 == r["cold"]["passes_done"]
    assert r["server"]["flush_cache_calls_delta"] == 3
    assert r["mode"] == "cold" and "warm" not in r and r["cold"]["flush_cache_before_each_pass"] is True
    assert all(p["flush_cache"]["status"] == 200 for p in r["cold"]["passes"])
    assert validate(out).returncode == 0


def test_injected_disagreement_fails_the_audit(server, mini, tmp_path):
    groups, ids, ref = groups_of(mini)
    pe = common.entailment_prob(ref)
    g = groups[-1]
    winner = max(g, key=lambda i: pe[i])
    loser = next(i for i in g if i != winner)

    def promote(logits):  # the loser becomes the reference's only winner
        logits[loser] = logits[winner]
        logits[loser, 1] += 1.0
        return logits

    bad_ref = doctor_reference(mini["reference"], tmp_path / "bad_ref", promote)
    out = tmp_path / "disagree.json"
    proc = run_bench(server.url, mini, out, "--reference", bad_ref, "--repetitions", 1)
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "group audit failed" in lines[0] and ids[winner] in lines[0] and ids[loser] in lines[0]
    assert "reference margin" in lines[0]
    r = receipt_of(out)
    assert r["valid"] is False and r["complete"] is True and r["exit_code"] == 2
    au = r["warm"]["audit"]
    assert au["failed"] and au["failures_total"] == 2 and [f["pass"] for f in au["failures"]] == [0, 1]
    f = au["failures"][0]
    assert f["outside_winners"] == [ids[winner]] and f["reference_winners"] == [ids[loser]]
    assert f["rows"] == [ids[i] for i in g]
    assert f["reference_margin"] > 0 and f["candidate_margin"] >= 0
    assert out.with_name("disagree.passes.npy").exists()
    assert validate(out).returncode == 0  # a failed run still has a well-formed receipt


def test_exact_tie_is_recorded_as_a_tie_not_a_failure(server, mini, tmp_path):
    groups, ids, ref = groups_of(mini)
    pe = common.entailment_prob(ref)
    picks = [(g, max(g, key=lambda i: pe[i])) for g in groups]
    usable = [(g, w) for g, w in picks if w != g[0]]
    assert usable, "every group's winner is its first row; the tie case needs another sample subset"
    g, winner = usable[0]
    first = g[0]

    def tie(logits):  # the first row ties the true winner exactly; the reference's first winner is now `first`
        logits[first] = logits[winner]
        return logits

    tie_ref = doctor_reference(mini["reference"], tmp_path / "tie_ref", tie)
    out = tmp_path / "tie.json"
    proc = run_bench(server.url, mini, out, "--reference", tie_ref, "--repetitions", 1, "--batch-size", 12)
    assert proc.returncode == 0, proc.stderr
    r = receipt_of(out)
    au = r["warm"]["audit"]
    assert r["valid"] and au["failures_total"] == 0 and au["ties_total"] == 2
    tie_entry = au["ties"][0]
    assert tie_entry["reference_winners"] == [ids[first], ids[winner]]
    assert tie_entry["reference_choice"] == ids[first] and tie_entry["candidate_choice"] == ids[winner]
    assert all(p["audit"]["reference_tied_groups"] == 1 for p in r["warm"]["passes"])


@pytest.mark.parametrize("case", ["tokens-hash", "inputs-hash", "shape", "missing-reference", "stale-logits",
                                  "truncation", "out-exists", "usage-exclusive"])
def test_refusals_send_nothing_and_write_nothing(server, mini, tmp_path, case):
    out = tmp_path / "refused.json"
    kw, extra, words = {}, [], []
    if case == "tokens-hash":
        kw["tokens"] = tmp_path / "t.jsonl"
        kw["tokens"].write_text(mini["tokens"].read_text() + "\n")  # same rows, other bytes
        words = ["token file", "sha256", "differs"]
    elif case == "inputs-hash":
        kw["inputs"] = tmp_path / "i.jsonl"
        kw["inputs"].write_text(mini["inputs"].read_text() + "\n")
        words = ["input set", "sha256", "differs"]
    elif case == "shape":
        kw["reference"] = doctor_reference(mini["reference"], tmp_path / "r", lambda a: a[:, :2].copy())
        words = ["shape [12, 2]", "expected [12, 3]"]
    elif case == "missing-reference":
        kw["reference"] = tmp_path / "nowhere"
        words = ["reference", "not found"]
    elif case == "stale-logits":
        kw["reference"] = doctor_reference(mini["reference"], tmp_path / "r", lambda a: a + 1, update_hash=False)
        words = ["logits_sha256", "edited or corrupted"]
    elif case == "truncation":
        kw["truncate"] = 4096
        words = ["--truncate 4096", f"({TRUNCATE})"]
    elif case == "out-exists":
        out.write_bytes(b"earlier receipt\n")
        words = ["already exists", "--overwrite"]
    elif case == "usage-exclusive":
        extra = ["--exclusive-gpu", "0"]
        words = ["--server-pid"]
    before = server_info(server.url)["counters"]["requests"]
    proc = run_bench(server.url, mini, out, *extra, **kw)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert server_info(server.url)["counters"]["requests"] == before  # nothing sent
    if case == "out-exists":
        assert out.read_bytes() == b"earlier receipt\n"
    else:
        assert not out.exists()
    assert not out.with_name("refused.candidate.npy").exists() and not out.with_name("refused.passes.npy").exists()


def test_server_pid_must_be_the_server(server, mini, tmp_path):
    out = tmp_path / "x.json"
    other = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])  # alive, but not the server
    try:
        proc = run_bench(server.url, mini, out, "--exclusive-gpu", "0", "--server-pid", other.pid)
    finally:
        other.kill()
        other.wait()
    assert proc.returncode == 1, proc.stderr
    assert "reports pid" in error_lines(proc.stderr)[0] and not out.exists()


def test_empty_health_body_counts_as_up(mini, tmp_path):
    """SGLang's own GET /health answers 200 with an empty body (seen on its CPU engine): the bench stopped there
    with "GET /health did not answer JSON" before sending anything. Any 2xx now counts as up; this
    loopback server has no /server_info, so the run stops at the next step, which names it."""
    from _http_fixtures import LoopbackHTTPServer

    with LoopbackHTTPServer({"/health": b""}) as srv:
        proc = run_bench(srv.url.rstrip("/"), mini, tmp_path / "h.json", "--retries", 0)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 4 and len(lines) == 1, proc.stderr
    assert "/server_info" in lines[0] and "/health" not in lines[0], lines[0]


@pytest.mark.skipif(NVML, reason="NVML works on this machine, so the no-NVML refusal cannot be exercised")
def test_exclusive_gpu_without_nvml_is_invalid_before_sending(server, mini, tmp_path):
    out = tmp_path / "excl.json"
    before = server_info(server.url)["counters"]["requests"]
    proc = run_bench(server.url, mini, out, "--exclusive-gpu", "0", "--server-pid", server.proc.pid)
    assert proc.returncode == 3
    assert "NVML" in error_lines(proc.stderr)[0] and "nothing sent" in error_lines(proc.stderr)[0]
    assert server_info(server.url)["counters"]["requests"] == before
    r = receipt_of(out)
    ex = r["exclusive"]
    assert ex["valid"] is False and "NVML" in ex["reason"] and ex["samples"] >= 1 and r["warm"]["passes_done"] == 0
    assert validate(out).returncode == 0


# ---------------------------------------------------------------- validate_receipts.py
def test_validator_rejects_tampered_receipts(warm_run, tmp_path):
    schemas = validate_receipts.load_schemas(validate_receipts.SCHEMA_DIR)
    assert {"openjev-bench", "openjev-reference"} <= set(schemas)
    src = warm_run["out"]
    for f in src.parent.iterdir():
        shutil.copy(f, tmp_path / f.name)
    good = tmp_path / src.name
    assert validate_receipts.validate_file(good, schemas, True) == ("openjev-bench", None)

    def variant(name, edit):
        doc = json.loads(good.read_text())
        edit(doc)
        p = tmp_path / name
        p.write_text(json.dumps(doc))
        return p

    cases = {
        "claims-valid.json": lambda d: d.update(exit_code=2),                  # valid but a failing exit status
        "mixed.json": lambda d: d.update(cold=d["warm"]),                      # cold and warm in one receipt
        "no-machine.json": lambda d: d.pop("machine"),
        "bad-hash.json": lambda d: d["tokens"].update(sha256="xyz"),
        "other-kind.json": lambda d: d.update(kind="openjev-unknown"),
    }
    bad = [variant(n, e) for n, e in cases.items()]
    for p in bad:
        kind, problem = validate_receipts.validate_file(p, schemas, False)
        assert problem, p.name
    # an array replaced after the receipt was written
    np.save(tmp_path / "warm.candidate.npy", np.zeros((12, 3), dtype=np.float32))
    assert "candidate" in validate_receipts.validate_file(good, schemas, True)[1]
    proc = validate(good, *bad, "--no-check-files")
    assert proc.returncode == 1
    invalid = [l for l in proc.stderr.splitlines() if ": invalid: " in l]
    assert len(invalid) == len(bad) and f"{good}: ok (openjev-bench)" in proc.stdout


def test_validator_picks_up_a_new_schema_by_its_kind(tmp_path):
    d = tmp_path / "schemas"
    shutil.copytree(validate_receipts.SCHEMA_DIR, d)
    (d / "runtime_receipt.schema.json").write_text(json.dumps({
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
        "required": ["kind", "arch_list"], "properties": {"kind": {"const": "openjev-runtime"}}}))
    doc = tmp_path / "runtime_receipt.json"
    doc.write_text(json.dumps({"kind": "openjev-runtime", "arch_list": ["sm_70"]}))
    proc = validate(tmp_path, "--schemas", d)  # a directory: schema files under it are skipped
    assert proc.returncode == 0, proc.stderr
    assert "ok (openjev-runtime)" in proc.stdout
    (d / "dup.schema.json").write_text(json.dumps({"properties": {"kind": {"const": "openjev-runtime"}}}))
    proc = validate(doc, "--schemas", d)
    assert proc.returncode == 1 and "both claim kind" in error_lines(proc.stderr)[0]


def test_results_v100_holds_no_figures():
    root = REPO / "results_v100"
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert "README.md" in files
    assert all(f == "README.md" or f.startswith("schemas/") for f in files), files
    text = (root / "README.md").read_text()
    assert "no V100 measurement" in text


# ---------------------------------------------------------------- benchmarks/bench_harness_overhead.py
def test_harness_overhead_script_smoke(server, mini, tmp_path):
    script = REPO / "benchmarks" / "bench_harness_overhead.py"
    out = tmp_path / "overhead.json"
    normal_set = f"{mini['inputs']},{mini['tokens']},{mini['reference']}"
    proc = subprocess.run([PY, str(script), "--url", server.url, "--normal-set", normal_set, "--out", str(out),
                           "--null-requests", "30", "--trivial-requests", "4", "--trivial-workers", "1,2",
                           "--normal-repetitions", "1"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["machine"]["label"].startswith("cpu: ") and r["machine"]["cpu_count"]
    assert [t["workers"] for t in r["null_server"]] == [1, 2] and r["null_server"][0]["requests"] == 30
    assert r["normal"]["valid"] and r["normal"]["rows"] == 12 and r["normal"]["client_overhead_fraction"] >= 0
    assert validate(out).returncode == 0
    refused = subprocess.run([PY, str(script), "--out", str(REPO / "results_v100" / "x.json")],
                             capture_output=True, text=True, cwd=REPO)
    assert refused.returncode == 1 and "results_v100/" in error_lines(refused.stderr)[0]


def test_recorded_cpu_results_validate():
    results = REPO / "benchmarks" / "results_cpu"
    if not any(results.glob("*.json")):
        pytest.skip("no recorded results in benchmarks/results_cpu/")
    proc = validate(results)
    assert proc.returncode == 0, proc.stderr
