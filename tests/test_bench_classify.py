"""bench_classify_v100.py end to end against the real embedded backend on 127.0.0.1 (no mocks), its pure
functions (percentiles, softmax, audit, exit status), the exclusivity decision on real local processes, and
validate_receipts.py on the receipts the bench writes.

Speed: a 12-row subset of the bundled sample (option groups g1, g2, g4, one singleton without instruction,
and x1-a/x1-b: same premise, one without instruction, so two singletons) with its own reference made by
score_reference.py at --truncate 52 (three rows are cut, so truncation is exercised on every run). All runs
share the module-scoped embedded server, except the one that kills its server.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import validate_receipts
from conftest import APP, PY, REPO, SAMPLE, error_lines, free_port, run_script, start_server

from openjev import common as common
from openjev import gpu as gpu_owner
from openjev.bench import agreement as bench_agreement
from openjev.bench import client as bench_client
from openjev.bench import receipt as bench_receipt

MINI_IDS = ["g1-a", "g1-b", "g1-c", "g2-a", "g2-b", "g2-c", "g2-d", "g4-a", "g4-b", "s4", "x1-a", "x1-b"]
TRUNCATE = 52
BENCH = "bench_classify_v100.py"


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def mini(sample_tokens, overlay, tmp_path_factory) -> dict:
    """A subset of the sample: input set, token file (lines of the session token file) and its reference."""
    d = tmp_path_factory.mktemp("mini")
    keep = set(MINI_IDS)
    inputs = d / "mini.jsonl"
    tokens = d / "mini.tokens.jsonl"
    inputs.write_text("".join(l + "\n" for l in SAMPLE.read_text().splitlines() if json.loads(l)["id"] in keep))
    tokens.write_text("".join(l + "\n" for l in sample_tokens.read_text().splitlines()
                              if l.strip() and json.loads(l)["id"] in keep))
    ref = d / "reference"
    run_script("score_reference.py", "--model", overlay, "--tokens", tokens, "--inputs", inputs, "--out", ref,
               "--truncate", TRUNCATE, check=True)
    return {"inputs": inputs, "tokens": tokens, "reference": ref, "dir": d}


def run_bench(url, mini, out, *extra, reference=None, inputs=None, tokens=None, truncate=TRUNCATE, timeout=240):
    args = ["--url", url, "--inputs", inputs or mini["inputs"], "--tokens", tokens or mini["tokens"],
            "--reference", reference or mini["reference"], "--out", out]
    if truncate is not None:
        args += ["--truncate", truncate]
    return run_script(BENCH, *args, *extra, timeout=timeout)


def server_info(url) -> dict:
    return requests.get(f"{url}/server_info", timeout=30).json()


def receipt_of(out: Path) -> dict:
    return json.loads(out.read_text())


def validate(*paths) -> subprocess.CompletedProcess:
    return run_script("validate_receipts.py", *paths)


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


def test_server_down_at_start_writes_an_incomplete_receipt(mini, tmp_path):
    out = tmp_path / "down.json"
    # an earlier run's files at OUT: --overwrite replaces the receipt and removes the stale arrays
    out.write_text("{}")
    out.with_name("down.candidate.npy").write_bytes(b"stale")
    out.with_name("down.passes.npy").write_bytes(b"stale")
    port = free_port()
    proc = run_bench(f"http://127.0.0.1:{port}", mini, out, "--retries", 1, "--overwrite")
    assert proc.returncode == 4
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "unreachable" in lines[0] and "Connection refused" in lines[0]
    r = receipt_of(out)
    assert r["complete"] is False and r["valid"] is False and r["exit_code"] == 4
    assert r["warm"]["passes_done"] == 0 and r["outputs"] == {"candidate": None, "passes": None}
    assert not out.with_name("down.candidate.npy").exists() and not out.with_name("down.passes.npy").exists()
    assert validate(out).returncode == 0


def test_server_dying_mid_run_keeps_the_passes_done(overlay, mini, tmp_path):
    srv = start_server(overlay, tmp_path / "dying.log")
    out = tmp_path / "dying.json"
    per_pass = 4  # 12 rows in batches of 3
    try:
        base = server_info(srv.url)["counters"]["requests"]
        cmd = [PY, str(APP / BENCH), "--url", srv.url, "--inputs", mini["inputs"], "--tokens", mini["tokens"],
               "--reference", mini["reference"], "--out", out, "--truncate", TRUNCATE, "--batch-size", 3,
               "--workers", 2, "--repetitions", 200, "--retries", 1]
        bench_proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=REPO)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # watch the server's own counter: kill it inside the measured passes
            if server_info(srv.url)["counters"]["requests"] - base >= 2 * per_pass + 1:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the bench made no progress")
        srv.proc.send_signal(signal.SIGKILL)
        stdout, stderr = bench_proc.communicate(timeout=120)
    finally:
        srv.stop()
    assert bench_proc.returncode == 4, stderr
    assert "stopped" in error_lines(stderr)[0]
    r = receipt_of(out)
    sec = r["warm"]
    assert r["complete"] is False and r["valid"] is False and r["exit_code"] == 4
    assert 2 <= sec["passes_done"] < sec["passes_planned"] == 201
    assert sec["passes"][-1]["complete"] is False and sec["passes"][-1]["error"]
    assert sec["timing"]["measured_passes"] == sec["passes_done"] - 1
    passes = np.load(out.with_name("dying.passes.npy"))
    assert passes.shape == (sec["passes_done"], 12, 3)
    assert np.array_equal(np.load(out.with_name("dying.candidate.npy")), passes[-1])
    assert validate(out).returncode == 0


def test_sigterm_mid_run_writes_a_partial_receipt(server, mini, tmp_path):
    """The tuner stops an overlong bench with SIGTERM: the passes done are kept, the run is incomplete."""
    out = tmp_path / "term.json"
    base = server_info(server.url)["counters"]["requests"]
    cmd = [PY, str(APP / BENCH), "--url", server.url, "--inputs", mini["inputs"], "--tokens", mini["tokens"],
           "--reference", mini["reference"], "--out", out, "--truncate", TRUNCATE, "--batch-size", 12,
           "--repetitions", 500]
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.monotonic() + 120
    while server_info(server.url)["counters"]["requests"] - base < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 4, stderr
    assert "interrupted" in error_lines(stderr)[0]
    r = receipt_of(out)
    assert r["complete"] is False and r["exit_code"] == 4 and r["warm"]["passes_done"] >= 2
    assert np.load(out.with_name("term.passes.npy")).shape[0] == r["warm"]["passes_done"]


def nvml_available() -> tuple[bool, str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True, ""
    except Exception as exc:  # noqa: BLE001
        return False, f"{type(exc).__name__}: {exc}"


NVML, NVML_WHY = nvml_available()


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


@pytest.mark.skipif(not NVML, reason=f"needs an NVIDIA driver (pynvml.nvmlInit failed: {NVML_WHY})")
def test_nvml_monitor_samples_a_real_gpu():
    me = gpu_owner.proc_id(os.getpid())
    mon = gpu_owner.ExclusivityMonitor(0, me, 0.1)
    assert mon.gpu is not None and mon.gpu.info["name"]
    mon.start()
    time.sleep(0.5)
    pids = set(mon.gpu.pids())  # before stop(): stop() shuts NVML down
    mon.stop()
    rep = mon.report()
    assert rep["samples"] >= 3 and rep["gpu"]["uuid"]
    others = pids - {os.getpid()}
    if os.getpid() in pids:
        # an earlier test of this session made a CUDA context here (run on the H200, this test came after
        # the threaded reference test): this process is the "server", so the GPU is exclusive to it unless
        # someone else is on it
        assert rep["valid"] is (not others), rep["violations"][:2]
    else:
        # this process holds no context on GPU 0, so every sample says the "server" is not there (other
        # users of GPU 0 may be flagged too)
        assert rep["valid"] is False
        assert any("neither the server" in x for v in rep["violations"] for x in v["violations"])
    for v in rep["violations"]:  # what must never happen: a failed NVML sample
        assert not any(x.startswith("NVML sample failed") for x in v["violations"])


# ---------------------------------------------------------------- exclusivity decision on real processes
@pytest.fixture
def process_tree():
    """A server-like parent with one child, and an unrelated competitor: real processes."""
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(c.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    competitor = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    yield parent, child_pid, competitor
    for p in (parent, competitor):
        if p.poll() is None:
            p.kill()
            p.wait()
    try:
        os.kill(child_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def sample_now(server_pid: int, gpu_pids) -> gpu_owner.Sample:
    now, desc = gpu_owner.read_tree(server_pid)
    return gpu_owner.Sample(0.0, server_now=now, descendants=desc, gpu=gpu_owner.identify(gpu_pids))


def test_exclusivity_allowed_set_and_competitor(process_tree):
    parent, child_pid, competitor = process_tree
    server = gpu_owner.proc_id(parent.pid)
    child = gpu_owner.proc_id(child_pid)
    now, desc = gpu_owner.read_tree(parent.pid)
    assert now == server and child in desc
    assert gpu_owner.allowed_processes(server, now, desc) == {server, child}
    # only the server and its child on the GPU: exclusive (the child alone is enough to show the server is there)
    assert gpu_owner.sample_violations(server, sample_now(parent.pid, [parent.pid, child_pid])) == []
    assert gpu_owner.sample_violations(server, sample_now(parent.pid, [child_pid])) == []
    # nobody on the GPU, not even the server: wrong index / another device / PID namespace -> nothing is shown
    v = gpu_owner.sample_violations(server, sample_now(parent.pid, []))
    assert len(v) == 1 and "neither the server" in v[0]
    assert gpu_owner.sample_violations(server, sample_now(parent.pid, []), require_server_on_gpu=False) == []
    # a competitor appears
    v = gpu_owner.sample_violations(server, sample_now(parent.pid, [child_pid, competitor.pid]))
    assert len(v) == 1 and f"competitor pid {competitor.pid}" in v[0]
    # a GPU pid nobody can see (exited, or another PID namespace) is not given the benefit of the doubt
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    v = gpu_owner.sample_violations(server, sample_now(parent.pid, [parent.pid, dead.pid]))
    assert len(v) == 1 and "cannot be identified" in v[0]


def test_exclusivity_reused_pid_and_vanished_server(process_tree):
    parent, child_pid, _ = process_tree
    server = gpu_owner.proc_id(parent.pid)
    # the PID is live but its start time is not the one captured at start: a reused PID, not our server
    reused = (parent.pid, server[1] - 5.0)
    v = gpu_owner.sample_violations(reused, sample_now(parent.pid, [parent.pid]))
    assert len(v) == 1 and "PID was reused" in v[0]
    assert gpu_owner.allowed_processes(reused, server, set()) == frozenset()
    # the server dies
    parent.kill()
    parent.wait()
    s = sample_now(parent.pid, [])
    assert s.server_now is None
    v = gpu_owner.sample_violations(server, s)
    assert len(v) == 1 and "is gone" in v[0]
    # a failed NVML sample invalidates on its own
    assert "NVML sample failed" in gpu_owner.sample_violations(server, gpu_owner.Sample(0.0, error="boom"))[0]


class ProcessListGpu:
    """Stands in for the GPU under the monitor: reports the given real pids as its processes."""

    info = {"index": 0, "name": "stand-in", "uuid": "none", "pci_bus_id": "none", "driver": "none"}
    graphics_supported = True

    def __init__(self, pids):
        self.list = list(pids)

    def pids(self):
        return list(self.list)

    def close(self):
        pass


def test_exclusivity_monitor_records_the_evidence(process_tree):
    parent, child_pid, competitor = process_tree
    gpu = ProcessListGpu([child_pid])
    mon = gpu_owner.ExclusivityMonitor(0, gpu_owner.proc_id(parent.pid), 0.05, gpu=gpu)
    assert mon.take() == []
    mon.start()
    time.sleep(0.3)
    gpu.list.append(competitor.pid)  # a competitor arrives mid-run
    time.sleep(0.3)
    mon.stop()
    rep = mon.report()
    assert rep["valid"] is False and f"competitor pid {competitor.pid}" in rep["reason"]
    assert rep["samples"] >= 6 and 1 <= rep["violating_samples"] < rep["samples"]
    assert 1 <= len(rep["violations"]) <= 10 and rep["interval_s"] == 0.05
    seen = {p["pid"]: p["allowed"] for p in rep["gpu_processes_seen"]}
    assert seen == {child_pid: True, competitor.pid: False}
    assert rep["server"] == {"pid": parent.pid, "create_time": gpu_owner.proc_id(parent.pid)[1]}


# ---------------------------------------------------------------- pure functions
def test_percentiles_and_softmax():
    s = bench_agreement.percentile_summary([1.0, 2.0, 3.0, 4.0])
    assert s["p50"] == 2.5 and s["max"] == 4.0 and s["count"] == 4 and s["p99"] == pytest.approx(3.97)
    assert bench_agreement.percentile_summary([])["p50"] is None
    from openjev.common import softmax

    p = softmax(np.array([[1000.0, 1000.0, 1000.0], [0.0, 0.0, np.log(2.0)]]))
    assert np.allclose(p[0], 1 / 3) and np.allclose(p[1], [0.25, 0.25, 0.5])


def test_agreement_lists_argmax_changes():
    ref = np.array([[0, 1, 0], [1, 0, 0]], dtype=np.float32)
    cand = np.array([[0, 1, 0], [0, 0, 2]], dtype=np.float32)
    a = bench_agreement.agreement(cand, ref, ["r0", "r1"], full=True)
    assert a["argmax_changes"] == [{"id": "r1", "reference": "contradiction", "candidate": "neutral"}]
    assert a["max_abs_logit_diff"] == 2.0 and not a["bitwise_equal"] and a["worst_rows"][0]["id"] == "r1"
    assert bench_agreement.agreement(ref, ref, ["r0", "r1"])["max_abs_dp_e"] == 0


def test_option_groups_key_on_premise_and_instruction():
    rows = [{"id": "a", "premise": "P", "instruction": "I"}, {"id": "b", "premise": "P", "instruction": "I"},
            {"id": "c", "premise": "P"}, {"id": "d", "premise": "P", "instruction": None},
            {"id": "e", "premise": "P", "instruction": ""}, {"id": "f", "premise": "Q", "instruction": "I"}]
    groups, singletons = bench_agreement.option_groups(rows)
    assert groups == [[0, 1], [2, 3]] and singletons == 2  # absent == null; "" is a value of its own


def test_audit_rules():
    ids = ["a", "b", "c"]
    g = [[0, 1, 2]]
    pe = lambda *x: np.array(x, dtype=np.float64)  # noqa: E731
    ok = bench_agreement.audit_pass(g, pe(0.1, 0.5, 0.2), pe(0.2, 0.6, 0.1), ids)
    assert ok["passed"] and ok["failures_count"] == ok["ties_count"] == 0
    bad = bench_agreement.audit_pass(g, pe(0.1, 0.5, 0.2), pe(0.1, 0.2, 0.3), ids)
    assert not bad["passed"] and bad["failures"][0]["outside_winners"] == ["c"]
    # how near a tie the failure was: the reference's lead of its winner over the row chosen, and the
    # candidate's lead of that row over the reference's winner (p_e)
    assert bad["failures"][0]["reference_margin"] == pytest.approx(0.3)
    assert bad["failures"][0]["candidate_margin"] == pytest.approx(0.1)
    # a candidate tie between the winner and a non-winner fails (position could pick the non-winner)
    ctie = bench_agreement.audit_pass(g, pe(0.1, 0.5, 0.2), pe(0.1, 0.5, 0.5), ids)
    assert not ctie["passed"] and ctie["failures"][0]["candidate_choice"] == ["b", "c"]
    # the reference ties a and b exactly; the candidate picks b: a tie, not a failure
    tie = bench_agreement.audit_pass(g, pe(0.5, 0.5, 0.2), pe(0.4, 0.6, 0.1), ids)
    assert tie["passed"] and tie["ties_count"] == 1 and tie["ties"][0]["candidate_choice"] == "b"
    assert tie["reference_tied_groups"] == 1
    # ... picks a (the reference's first winner): neither; the candidate tying both winners: candidate-tied only
    assert bench_agreement.audit_pass(g, pe(0.5, 0.5, 0.2), pe(0.6, 0.4, 0.1), ids)["ties_count"] == 0
    both = bench_agreement.audit_pass(g, pe(0.5, 0.5, 0.2), pe(0.5, 0.5, 0.1), ids)
    assert both["passed"] and both["ties_count"] == 0 and both["candidate_tied_groups"] == 1


def test_exit_status_precedence_and_helpers():
    assert bench_agreement.decide_exit(False, False, None) == 0 and bench_agreement.decide_exit(False, False, True) == 0
    assert bench_agreement.decide_exit(True, True, False) == 2
    assert bench_agreement.decide_exit(False, True, False) == 4
    assert bench_agreement.decide_exit(False, False, False) == 3
    assert [bench_client.backoff_s(i) for i in range(5)] == [0.25, 0.5, 1.0, 2.0, 2.0]
    label = bench_receipt.derive_machine_label
    assert label(None, "cuda:0 (Tesla V100-SXM2-32GB, sm_70)", None, True, "Linux", "x") == "Tesla V100-SXM2-32GB"
    assert label(None, "cpu", None, True, "Linux-x", "AMD EPYC") == "cpu: Linux-x (AMD EPYC)"
    assert label(None, "cpu", "NVIDIA H200", True, "Linux", None) == "NVIDIA H200"
    assert label("eva01 V100", "cpu", None, True, "Linux", None) == "eva01 V100"
    assert bench_receipt.out_paths(Path("/r/b.json"))["passes"] == Path("/r/b.passes.npy")


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


# ---------------------------------------------------------------- interruptions: numbering and counts
class DyingFront:
    """A loopback HTTP front of the real embedded server, for interruptions at an exact point of the run.

    Every request is forwarded to the server; at the `die_at`-th POST /classify the front dies like a killed
    server (that request gets no answer, the listening socket closes: later connections are refused). At the
    k-th POST /flush_cache, `on_flush(k)` runs before the request is forwarded (the bench is between passes
    then: the flush comes before each pass with --cold-cache)."""

    def __init__(self, upstream: str, die_at: int | None = None, on_flush=None):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        front = self
        self.upstream, self.die_at, self.on_flush = upstream, die_at, on_flush
        self.classify = self.flushes = 0
        self.dead = False
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _forward(self, method: str):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with front.lock:
                    if not front.dead and method == "POST" and self.path == "/classify":
                        front.classify += 1
                        front.dead = front.classify == front.die_at
                        if front.dead:
                            threading.Thread(target=front.close, daemon=True).start()
                    if method == "POST" and self.path == "/flush_cache":
                        front.flushes += 1
                        if front.on_flush:
                            front.on_flush(front.flushes)
                    dead = front.dead
                if dead:
                    self.close_connection = True
                    return
                r = requests.request(method, front.upstream + self.path, data=body or None, timeout=60,
                                     headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.closed = False

    def close(self):
        if not self.closed:
            self.closed = True
            self.httpd.shutdown()
            self.httpd.server_close()


def run_interrupted_bench(front, mini, out, *extra) -> tuple[subprocess.Popen, str, str]:
    """3 passes (1 initial + 2 measured) of 4 requests each, one worker: request n belongs to pass (n-1)//4 + 1."""
    cmd = [PY, str(APP / BENCH), "--url", front.url, "--inputs", mini["inputs"], "--tokens", mini["tokens"],
           "--reference", mini["reference"], "--out", out, "--truncate", TRUNCATE, "--batch-size", 3, "--workers", 1,
           "--repetitions", 2, "--retries", 1, *extra]
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    front.bench = proc
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        front.close()
    return proc, stdout, stderr


@pytest.mark.parametrize("die_at,stopped,done,measured", [
    (1, "pass 1/3 (initial) stopped", 0, 0),         # the server dies in the initial pass
    (5, "pass 2/3 (measured 1/2) stopped", 1, 0),    # ... in the first measured pass
    (9, "pass 3/3 (measured 2/2) stopped", 2, 1),    # ... in the last pass (the measured defect)
])
def test_server_death_names_the_pass_that_ran_and_counts_what_completed(server, mini, tmp_path, die_at, stopped,
                                                                         done, measured):
    front = DyingFront(server.url, die_at=die_at)
    out = tmp_path / "died.json"
    proc, stdout, stderr = run_interrupted_bench(front, mini, out)
    assert proc.returncode == 4, stderr
    line = error_lines(stderr)[0]
    counts = f"{done}/3 done ({min(done, 1)} initial + {measured} of 2 measured)"
    assert stopped in line and f"passes {counts}" in line, line
    progress = [l.split(":")[0] for l in stderr.splitlines() if l.startswith("warm pass ")]
    assert progress == ["warm pass 1/3 (initial)", "warm pass 2/3 (measured 1/2)"][:done]
    if done:
        assert any(l.split() == ["passes", *counts.split()] for l in stdout.splitlines()), stdout
    r = receipt_of(out)
    assert (r["warm"]["passes_done"], r["warm"]["measured_passes_done"]) == (done, measured)
    assert r["warm"]["timing"]["measured_passes"] == measured
    assert validate(out).returncode == 0


@pytest.mark.parametrize("at_flush,before,done,measured", [
    (2, "before pass 2/3 (measured 1/2)", 1, 0),
    (3, "before pass 3/3 (measured 2/2)", 2, 1),
])
def test_sigterm_between_passes_names_the_next_pass_and_counts_what_completed(server, mini, tmp_path, at_flush, before,
                                                                               done, measured):
    front = DyingFront(server.url)
    front.on_flush = lambda k: k == at_flush and front.bench.send_signal(signal.SIGTERM)
    out = tmp_path / "term.json"
    proc, stdout, stderr = run_interrupted_bench(front, mini, out, "--cold-cache")
    assert proc.returncode == 4, stderr
    line = error_lines(stderr)[0]
    counts = f"{done}/3 done (1 initial + {measured} of 2 measured)"
    assert f"interrupted (SIGTERM) {before}; passes {counts}" in line, line
    assert f"{counts}" in stdout
    r = receipt_of(out)
    assert (r["cold"]["passes_done"], r["cold"]["measured_passes_done"]) == (done, measured)
    assert validate(out).returncode == 0
