#!/usr/bin/env python3
"""The adapter inside SGLang's real CPU engine with sgl-kernel's real CPU ops, against the reference.

Given a local copy of the public sgl-kernel source folder, this:
  1. builds its CPU ops (`csrc/cpu/*.cpp`) outside the repository (benchmarks/sgl_cpu_ops_build.py;
     a matching earlier build is reused) with the real-SGLang venv's torch;
  2. makes a tiny random-weight checkpoint the kernels accept (app/make_tiny_model.py --shape
     tiny-gdn64, plus the base model's processor configs), the demo rows' token file
     (app/tokenize_nli.py on data/nli_sample.jsonl) and a synthetic set in option groups
     (app/make_synthetic_inputs.py), the synthetic rows with each option group's shared prefix as a row of
     its own before it ("prefix", for radix-cache hits), and their Transformers reference
     (app/score_reference.py, float32 for the bench; bfloat16 too, compared in the summary);
  3. for each --dtypes and each option group of the engine (radix cache off; radix cache on, cold
     through /flush_cache and warm; a --chunked-prefill-size so that rows span chunks), starts
     `python -m sglang_openjev_cpu.serve` on 127.0.0.1 with OPENJEV_SGL_CPU_OPS=<the build> and runs
     app/bench_classify_v100.py (/classify over HTTP, several requests in flight) on both sets;
  4. writes to --out: every bench receipt, the server logs, the build log and build.json (flags,
     seconds, sources' sha256), the kernel source revision, and summary.json: per dtype and case
     every row's argmax equal or not, max |logit diff|, startup seconds and the server's RSS.

Nothing fetched or built enters the repository: --work and --build-dir must lie outside it or
under its ignored build/ folder.

    .venv/bin/python benchmarks/sglang_cpu_engine.py --sgl-kernel-src /tmp/sgl-kernel \\
        --kernel-revision "github:mingfeima/sglang 2f14d6c (sgl-kernel)" \\
        --build-dir /tmp/sgl-cpu-build/out --work /tmp/sgl-cpu-engine

Exit status: 0 every case started, every bench complete and every row's argmax equal to the
reference; 1 otherwise (the summary says which: a dtype the kernels lack fails to start); 2 bad usage.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "app"
DEFAULT_VENV_PY = REPO / "build" / "sglang-venvs" / "0.5.23" / "bin" / "python"
DEFAULT_REF_PY = REPO / ".venv" / "bin" / "python"

# (case name, extra server flags, bench modes)
CASES = [
    ("radix_off", ["--disable-radix-cache"], ["warm"]),
    ("radix_on", [], ["cold", "warm"]),
    ("radix_on_chunked16", ["--chunked-prefill-size", "16"], ["cold", "warm"]),
]


def log(msg: str) -> None:
    print(f"[sglang_cpu_engine {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def outside_repo_or_build(path: Path, what: str) -> Path:
    path = path.resolve()
    if (path == REPO or REPO in path.parents) and (REPO / "build") not in (path, *path.parents):
        raise SystemExit(f"sglang_cpu_engine: error: {what} {path} is inside the repository (use a folder "
                         "outside it, or under its ignored build/)")
    return path


def rss_tree_mb(pid: int, field: str = "rss") -> float:
    """Sum over the server's process tree of RSS (shared pages counted once per process) or, with
    field="pss", of the proportional set size (shared pages split between the processes)."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for q in procs:
        try:
            total += getattr(q.memory_full_info() if field == "pss" else q.memory_info(), field)
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            pass
    return round(total / 2**20, 1)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    t_end = time.time() + timeout
    while time.time() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before /health answered")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1)
    raise RuntimeError(f"/health did not answer within {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def make_prefix_set(work: Path, inputs: Path, tokens: Path) -> tuple[Path, Path]:
    """The synthetic rows, each option group (of 2+ rows) preceded by a row holding only the group's
    shared prefix (instruction + premise ids). With the radix cache on and the rows sent one at a
    time in order, the group's rows then extend a cached prefix that ends where a request ended, the
    one place SGLang's CPU engine (mamba no_buffer: no intermediate GDN states) stores a state to
    resume from. The prefix rows get their own option group ("/prefix" appended to the premise)."""
    out_in, out_tok = work / "prefix.jsonl", work / "prefix.tokens.jsonl"
    if out_tok.exists():
        return out_in, out_tok
    rows = [json.loads(x) for x in inputs.read_text().splitlines() if x.strip()]
    toks = {r["id"]: r["input_ids"] for r in (json.loads(x) for x in tokens.read_text().splitlines() if x.strip())}
    groups: dict = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    lines_in, lines_tok = [], []
    for g, members in groups.items():
        if len(members) >= 2:
            ids = [toks[m["id"]] for m in members]
            n = 0
            while all(len(x) > n for x in ids) and len({x[n] for x in ids}) == 1:
                n += 1
            if n:
                head = dict(members[0], id=f"{g}-prefix", premise=f"{members[0]['premise']}/prefix", hypothesis="(shared prefix only)",
                            group=f"{g}-prefix")
                lines_in.append(head)
                lines_tok.append({"id": head["id"], "input_ids": ids[0][:n]})
        for m in members:
            lines_in.append(m)
            lines_tok.append({"id": m["id"], "input_ids": toks[m["id"]]})
    out_in.write_text("".join(json.dumps(x) + "\n" for x in lines_in))
    out_tok.write_text("".join(json.dumps(x) + "\n" for x in lines_tok))
    return out_in, out_tok


def prepare_inputs(work: Path, ref_py: Path, model: Path) -> dict:
    sets = {}
    demo_in = REPO / "data" / "nli_sample.jsonl"
    demo_tok = work / "demo.tokens.jsonl"
    if not demo_tok.exists():
        run([ref_py, APP / "tokenize_nli.py", "--model", model, "--inputs", demo_in, "--out", demo_tok])
    sets["demo"] = (demo_in, demo_tok)
    synth = work / "synthetic"
    if not Path(f"{synth}.tokens.jsonl").exists():
        run([ref_py, APP / "make_synthetic_inputs.py", synth, "--rows", "24", "--max-group", "4",
             "--premise-tokens", "20:90", "--hypothesis-tokens", "4:16", "--instruction-tokens", "12",
             "--vocab", "512", "--seed", "17"])
    sets["synthetic"] = (Path(f"{synth}.jsonl"), Path(f"{synth}.tokens.jsonl"))
    sets["prefix"] = make_prefix_set(work, *sets["synthetic"])
    for name, (inp, tok) in sets.items():
        for dtype, suffix in (("float32", ""), ("bfloat16", "_bf16")):
            ref = work / f"ref_{name}{suffix}"
            if not (ref / "reference.json").exists():
                shutil.rmtree(ref, ignore_errors=True)
                run([ref_py, APP / "score_reference.py", "--model", model, "--tokens", tok, "--inputs", inp,
                     "--out", ref, "--device", "cpu", "--dtype", dtype, "--no-peak"])
    # the bench compares with the float32 reference; the summary also with the bfloat16 one
    return {name: (inp, tok, work / f"ref_{name}") for name, (inp, tok) in sets.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sgl-kernel-src", type=Path, default=None, help="local sgl-kernel source folder")
    ap.add_argument("--ops-lib", type=Path, default=None, help="use this built common_ops.so (no build)")
    ap.add_argument("--kernel-revision", default=None, help="where the source came from (recorded)")
    ap.add_argument("--build-dir", type=Path, default=Path("/tmp/openjev-sgl-cpu-build"))
    ap.add_argument("--work", type=Path, default=REPO / "build" / "sglang_cpu_engine")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results_cpu" / "sglang_cpu_engine")
    ap.add_argument("--python", type=Path, default=DEFAULT_VENV_PY, help="the real-SGLang 0.5.23 venv's python")
    ap.add_argument("--ref-python", type=Path, default=DEFAULT_REF_PY, help="python of the reference (Transformers)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES))
    ap.add_argument("--sets", default="demo,synthetic,prefix")
    ap.add_argument("--port", type=int, default=31240)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--record-ops", type=Path, default=None,
                    help="also record real op calls (case radix_on_chunked16) into this folder "
                         "(tests/sglang_openjev_cpu/record.py)")
    a = ap.parse_args(argv)
    if not (a.sgl_kernel_src or a.ops_lib):
        ap.error("give --sgl-kernel-src (to build) or --ops-lib")
    work = outside_repo_or_build(a.work, "--work")
    work.mkdir(parents=True, exist_ok=True)
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"kind": "openjev-sglang-cpu-engine", "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "machine": {"processor": _cpu_model(), "nproc": os.cpu_count(), "platform": platform.platform(),
                                 "amx_in_processor": _has_flag("amx_bf16")},
                     "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]), "cases": []}

    # 1. the ops
    if a.ops_lib:
        lib = a.ops_lib.resolve()
        build_dir = lib.parent
    else:
        build_dir = outside_repo_or_build(a.build_dir, "--build-dir")
        cp = subprocess.run([str(a.python), str(REPO / "benchmarks" / "sgl_cpu_ops_build.py"), "--src",
                             str(a.sgl_kernel_src), "--build-dir", str(build_dir)], capture_output=True, text=True)
        sys.stderr.write(cp.stderr)
        if cp.returncode != 0:
            print("sglang_cpu_engine: error: the build failed (see above)", file=sys.stderr)
            return 1
        lib = Path(cp.stdout.strip().splitlines()[-1])
    for name in ("build.json", "build.log"):
        if (build_dir / name).exists():
            shutil.copy(build_dir / name, out / name)
    meta = json.loads((build_dir / "build.json").read_text()) if (build_dir / "build.json").exists() else {}
    revision = a.kernel_revision or meta.get("source_revision")
    (out / "kernel_source_revision.txt").write_text(f"{revision}\n")
    summary["ops"] = {"library_sha256": _sha256(lib), "build_seconds": meta.get("seconds"),
                      "cflags": meta.get("cflags"), "ldflags": meta.get("ldflags"), "torch": meta.get("torch"),
                      "source_revision": revision, "sources_sha256": meta.get("sources_sha256")}

    # 2. model, inputs, reference
    model = work / "model-tiny-gdn64"
    if not (model / "config.json").exists():
        shutil.rmtree(model, ignore_errors=True)
        run([a.ref_python, APP / "make_tiny_model.py", model, "--shape", "tiny-gdn64",
             "--processor-out", work / "processor"])
        for f in (work / "processor").iterdir():
            shutil.copy(f, model / f.name)
        shutil.rmtree(work / "processor")
    sets = prepare_inputs(work, a.ref_python, model)
    summary["model"] = json.loads((model / "openjev_random_model.json").read_text())

    # 3. the engine, case by case
    ok = True
    port = a.port
    wanted = set(a.cases.split(","))
    for dtype in a.dtypes.split(","):
        for case, flags, modes in (c for c in CASES if c[0] in wanted):
            tag = f"{dtype}_{case}"
            port += 1
            url = f"http://127.0.0.1:{port}"
            # the real-SGLang venv has no install of this checkout: the glue (sglang_openjev_cpu) and the
            # stand-ins live under tests/, the adapter in the repository
            path = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")) if p)
            env = dict(os.environ, OPENJEV_SGL_CPU_OPS=str(lib), PYTHONPYCACHEPREFIX=str(work / "pycache"),
                       PYTHONPATH=path)
            if a.record_ops and case == "radix_on_chunked16":  # chunked rows: calls with initial states
                env["OPENJEV_SGL_CPU_RECORD"] = str(a.record_ops / dtype)
            cmd = [str(a.python), "-m", "sglang_openjev_cpu.serve", "--model-path", str(model), "--host", "127.0.0.1",
                   "--port", str(port), "--dtype", dtype, *flags]
            entry: dict = {"dtype": dtype, "case": case, "server_flags": flags, "server_command": " ".join(cmd[1:])}
            server_log = out / f"server_{tag}.log"
            t0 = time.time()
            with open(server_log, "w") as fh:
                proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            try:
                wait_healthy(url, proc, a.startup_timeout)
                entry["startup_seconds"] = round(time.time() - t0, 1)
                entry["rss_mb_after_start"] = rss_tree_mb(proc.pid)
                entry["pss_mb_after_start"] = rss_tree_mb(proc.pid, "pss")
                log(f"{tag}: up in {entry['startup_seconds']} s, RSS {entry['rss_mb_after_start']} MB")
                entry["benches"] = []
                for set_name, (inp, tok, ref) in ((k, v) for k, v in sets.items() if k in a.sets.split(",")):
                    for mode in modes:
                        receipt = out / f"bench_{tag}_{set_name}_{mode}.json"
                        cmd_b = [a.ref_python, REPO / "app" / "bench_classify_v100.py", "--url", url, "--inputs", inp,
                                 "--tokens", tok, "--reference", ref, "--out", receipt,
                                 # prefix rows first, one request at a time; else 4 rows a request, 4 in flight
                                 *(["--batch-size", "1", "--workers", "1"] if set_name == "prefix" else
                                   ["--batch-size", "4", "--workers", "4"]), "--repetitions", "2", "--overwrite",
                                 "--label", f"sglang 0.5.23 CPU engine, real sgl-kernel CPU ops, {tag}",
                                 "--machine-label", "dev machine (CPU)"]
                        if mode == "cold":
                            cmd_b.append("--cold-cache")
                        rc = subprocess.run([str(c) for c in cmd_b], cwd=REPO).returncode
                        entry["benches"].append(_bench_figures(receipt, set_name, mode, rc, ref, tok))
                        entry["benches"][-1]["cached_tokens_in_server_log"] = _cached_tokens(server_log)
                entry["rss_mb_after_benches"] = rss_tree_mb(proc.pid)
                entry["pss_mb_after_benches"] = rss_tree_mb(proc.pid, "pss")
            except Exception as exc:  # noqa: BLE001 - recorded in the summary, the run goes on
                entry["error"] = f"{type(exc).__name__}: {exc}"
                tail = server_log.read_text(errors="replace").splitlines()[-3:]
                entry["server_log_tail"] = tail
                log(f"{tag}: {entry['error']}")
            finally:
                stop(proc)
            summary["cases"].append(entry)
            (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    by_dtype: dict = {}
    for e in summary["cases"]:
        d = by_dtype.setdefault(e["dtype"], {"ran": 0, "failed_to_start": 0, "max_abs_logit_diff": 0.0,
                                              "argmax_changes": 0, "rows_compared": 0})
        if "error" in e and not e.get("benches"):
            d["failed_to_start"] += 1
            continue
        d["ran"] += 1
        for b in e.get("benches", []):
            if b.get("max_abs_logit_diff") is not None:
                d["max_abs_logit_diff"] = max(d["max_abs_logit_diff"], b["max_abs_logit_diff"])
                d["argmax_changes"] += b["argmax_changes_total"]
                d["rows_compared"] += b["rows_compared"]
            if b["exit_status"] != 0:
                ok = False
    summary["per_dtype"] = by_dtype
    ran = any(d["ran"] for d in by_dtype.values())
    summary["all_argmax_equal"] = ran and all(d["argmax_changes"] == 0 for d in by_dtype.values() if d["ran"])
    summary["every_case_ran"] = all(not d["failed_to_start"] for d in by_dtype.values())
    ok = ok and summary["all_argmax_equal"] and summary["every_case_ran"]
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"summary: {json.dumps(by_dtype)}")
    return 0 if ok else 1


def _bench_figures(receipt: Path, set_name: str, mode: str, rc: int, ref_dir: Path, tokens: Path) -> dict:
    """Every pass of the bench (its .passes.npy) against the reference logits."""
    import numpy as np

    fig = {"set": set_name, "mode": mode, "exit_status": rc, "receipt": receipt.name}
    stem = receipt.with_suffix("")
    if not receipt.exists() or not Path(f"{stem}.passes.npy").exists():
        fig["error"] = "no receipt"
        return fig
    r = json.loads(receipt.read_text())
    passes = np.load(f"{stem}.passes.npy").astype(np.float64)
    ref = np.load(ref_dir / "reference.npy").astype(np.float64)
    ids = [json.loads(line)["id"] for line in tokens.read_text().splitlines() if line.strip()]
    diff = np.abs(passes - ref[None])
    eq = passes.argmax(-1) == ref.argmax(-1)[None]
    fig.update(passes=int(passes.shape[0]), rows=int(ref.shape[0]), rows_compared=int(eq.size),
               max_abs_logit_diff=float(diff.max()), argmax_changes_total=int((~eq).sum()),
               argmax_equal_every_pass={rid: bool(eq[:, k].all()) for k, rid in enumerate(ids)},
               median_pass_seconds=_dig(r, "median_pass_seconds"))
    bf16 = Path(f"{ref_dir}_bf16") / "reference.npy"
    if bf16.exists():
        refb = np.load(bf16).astype(np.float64)
        eqb = passes.argmax(-1) == refb.argmax(-1)[None]
        fig.update(max_abs_logit_diff_vs_bf16_reference=float(np.abs(passes - refb[None]).max()),
                   argmax_changes_vs_bf16_reference=int((~eqb).sum()))
    return fig


def _cached_tokens(server_log: Path) -> int:
    """Sum of SGLang's '#cached-token: N' over the server log so far (prefix-cache hits)."""
    import re

    return sum(int(m) for m in re.findall(r"#cached-token: (\d+)", server_log.read_text(errors="replace")))


def _dig(r, key):
    if isinstance(r, dict):
        if key in r:
            return r[key]
        for v in r.values():
            x = _dig(v, key)
            if x is not None:
                return x
    return None


def _sha256(p: Path) -> str:
    import hashlib

    return hashlib.sha256(p.read_bytes()).hexdigest()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _has_flag(flag: str) -> bool:
    try:
        return f" {flag}" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
