#!/usr/bin/env python3
"""How much the bench harness itself costs: app/bench_classify_v100.py's client against a /classify server.

Three measurements, all through the bench's own code (its Client, thread pool and pass loop):

  null     --null-requests requests of one 1-token row each (batch size 1) in one pass, for each
           --trivial-workers value, against a null /classify server (a separate process on uvicorn
           that answers constant logits without a model): the harness's own ceiling in requests/s,
           and the client CPU per request (CPU seconds of this process during the pass / requests).
  trivial  the same against the real embedded backend (--trivial-requests requests): requests/s the
           harness sustains there; the server's forward of one token dominates.
  normal   an ordinary bench run (the CLI, as an operator or the tuner runs it: --batch-size 32
           --workers 4 --repetitions 3) on a synthetic input set made by app/make_synthetic_inputs.py
           with its reference made by app/score_reference.py; reports the receipt's
           client_overhead_fraction (client CPU / wall over the measured passes). Target: < 2 %.

Without --url it starts the embedded backend (app/serve_transformers.py) on a free 127.0.0.1 port over
--model, or over a tiny random-weight model it builds in a temporary directory. The result names the
machine (platform, CPU model, CPU count, load average before and after): figures from one machine are
never to be read as another's. It refuses to write under results_v100/ (V100 receipts only).

Example (this is how benchmarks/results_cpu/harness_overhead_cpu.json was made):
  .venv/bin/python benchmarks/bench_harness_overhead.py --out benchmarks/results_cpu/harness_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "app"

from openjev.bench import agreement as bench_agreement
from openjev.bench import client as bench_client
from openjev.bench import receipt as bench_receipt
from openjev_testsupport.ports import free_port
from openjev.common import UserError, atomic_write_json, environment_receipt, run_main, utc_now

KIND = "openjev-harness-overhead"
DEFAULT_OUT = REPO / "benchmarks" / "results_cpu" / "harness_overhead_cpu.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="result JSON (default: benchmarks/results_cpu/harness_overhead_cpu.json)")
    p.add_argument("--url", default=None, help="use this running server instead of starting the embedded backend")
    p.add_argument("--model", type=Path, default=None,
                   help="model directory for the embedded backend (default: a tiny random-weight model built here)")
    p.add_argument("--null-requests", type=int, default=2000, help="requests per null-server pass (default: 2000)")
    p.add_argument("--trivial-requests", type=int, default=200,
                   help="requests per trivial pass against the embedded backend (default: 200)")
    p.add_argument("--trivial-workers", default="1,4", help="client threads of the trivial passes (default: 1,4)")
    p.add_argument("--normal-rows", type=int, default=96, help="rows of the synthetic normal set (default: 96)")
    p.add_argument("--normal-premise-tokens", default="50:200",
                   help="premise length range of the normal set (default: 50:200)")
    p.add_argument("--normal-repetitions", type=int, default=3,
                   help="measured passes of the normal run (default: 3, the bench's default)")
    p.add_argument("--normal-set", default=None, metavar="INPUTS,TOKENS,REFDIR",
                   help="use this input set, token file and reference for the normal run instead of a synthetic set "
                        "(its truncation is taken from the reference)")
    p.add_argument("--machine-label", default=None, help="machine label (default: 'cpu: <platform> (<cpu model>)')")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--serve-null", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    return p


def serve_null(port: int) -> None:
    """The null /classify server: constant logits, one row per input row, no model (a separate process)."""
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        if scope["path"] == "/health":
            out = b'{"status":"ok"}'
        elif scope["path"] == "/server_info":
            out = b'{"backend":"null","device":"none","dtype":null,"batching":null}'
        else:
            rows = json.loads(body)["input_ids"]
            n = len(rows) if rows and isinstance(rows[0], list) else 1
            out = json.dumps({"logits": [[0.25, 0.5, -0.125]] * n, "labels": ["contradiction", "entailment", "neutral"],
                              "model": "null"}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": out})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)




def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=REPO, **kw)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise UserError(f"{Path(str(cmd[1])).name} failed ({proc.returncode}): {tail}")
    return proc


def start_server(model: Path | None, log: Path) -> tuple[subprocess.Popen, str]:
    """The embedded backend over `model`, or the null server when `model` is None; waits for /health."""
    port = free_port()
    fh = open(log, "wb")
    cmd = ([sys.executable, str(APP / "serve_transformers.py"), str(model), str(port)] if model is not None
           else [sys.executable, str(Path(__file__).resolve()), "--serve-null", str(port)])
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    import requests

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UserError(f"the server exited with {proc.returncode}; see {log}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise UserError("the server did not become healthy in 300 s")


def trivial_pass(url: str, workers: int, n: int) -> dict:
    """n one-row, one-token requests through the bench's own pass loop."""
    client = bench_client.Client(url, timeout=60, retries=0)
    body = json.dumps({"input_ids": [[5]]}, separators=(",", ":")).encode()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="overhead") as pool:
        k = min(20, n)
        warm = bench_client.run_pass(client, pool, [body] * k, [(i, i + 1) for i in range(k)], k, 0, "initial", "warmup")
        if warm.error:
            raise UserError(f"warmup failed: {warm.error}")
        res = bench_client.run_pass(client, pool, [body] * n, [(i, i + 1) for i in range(n)], n, 1, "measured",
                             f"trivial x{workers}")
    if res.error:
        raise UserError(f"trivial pass failed: {res.error}")
    lat = bench_agreement.percentile_summary(res.latencies_s)
    return {"workers": workers, "requests": n, "rows_per_request": 1, "tokens_per_row": 1,
            "wall_s": res.wall_s, "requests_per_s": n / res.wall_s,
            "client_cpu_s": res.client_cpu_s, "client_cpu_per_request_ms": 1000 * res.client_cpu_s / n,
            "client_overhead_fraction": res.client_cpu_s / res.wall_s,
            "latency_s": {k: lat[k] for k in ("p50", "p90", "p99", "max", "mean")}}


def normal_run(url: str, model: Path | None, tmp: Path, rows: int, premise: str, machine_label: str,
               given: str | None, repetitions: int) -> dict:
    if given:
        try:
            inputs, tokens, ref = (Path(x) for x in given.split(","))
        except ValueError:
            raise UserError(f"--normal-set {given!r}: expected INPUTS.jsonl,TOKENS.jsonl,REFDIR") from None
    else:
        syn = tmp / "normal"
        run([sys.executable, APP / "make_synthetic_inputs.py", syn, "--rows", rows, "--premise-tokens", premise,
             "--vocab", 512])
        inputs, tokens = syn.with_name("normal.jsonl"), syn.with_name("normal.tokens.jsonl")
        ref = tmp / "normal_ref"
        run([sys.executable, APP / "score_reference.py", "--model", model, "--tokens", tokens, "--inputs", inputs,
             "--out", ref])
    try:
        truncate = json.loads((ref / "reference.json").read_text())["tokens"]["truncate"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{ref}/reference.json is missing or not a reference receipt") from None
    out = tmp / "normal_bench.json"
    argv = [sys.executable, APP / "bench_classify_v100.py", "--url", url, "--inputs", inputs, "--tokens", tokens,
            "--reference", ref, "--out", out, "--batch-size", 32, "--workers", 4, "--repetitions", repetitions,
            "--truncate", truncate, "--machine-label", machine_label, "--label", "harness-overhead-normal"]
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=REPO)
    if not out.exists():
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise UserError(f"the normal bench run wrote no receipt (exit {proc.returncode}): {tail}")
    r = json.loads(out.read_text())
    t = r["warm"]["timing"]
    return {"bench_exit_code": proc.returncode, "valid": r["valid"], "rows": r["inputs"]["rows"],
            "total_ids_per_pass": r["tokens"]["total_ids_sent_per_pass"],
            "batch_size": 32, "workers": 4, "repetitions": repetitions,
            "median_wall_s": t["median_wall_s"], "pass_walls_s": t["wall_s"], "pairs_per_s": t["pairs_per_s"],
            "batch_latency_s": t["batch_latency_s"], "client_cpu_s": t["client_cpu_s"],
            "client_overhead_fraction": t["client_overhead_fraction"],
            "per_pass_client_overhead_fraction": [p["client_overhead_fraction"] for p in r["warm"]["passes"]],
            "request_encode_s": r["warm"].get("request_encode_s"),
            "max_abs_dp_e": r["warm"]["agreement_final"]["max_abs_dp_e"],
            "command": " ".join(str(a) if a != sys.executable else "python" for a in argv[1:])}


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    args = build_parser().parse_args()
    if args.serve_null is not None:
        serve_null(args.serve_null)
        return 0
    out = args.out.resolve()
    if (REPO / "results_v100") in out.parents:
        raise UserError("results_v100/ holds V100 receipts only; write CPU or other-GPU figures elsewhere")
    if out.exists() and not args.overwrite:
        raise UserError(f"output {args.out} already exists; refusing to overwrite it (pass --overwrite to replace it)")
    try:
        workers = [int(w) for w in args.trivial_workers.split(",")]
    except ValueError:
        raise UserError(f"--trivial-workers {args.trivial_workers!r}: expected integers separated by commas") from None
    if min(args.null_requests, args.trivial_requests, args.normal_rows, args.normal_repetitions, *workers) < 1:
        raise UserError("--null-requests, --trivial-requests, --normal-rows, --normal-repetitions and every "
                        "--trivial-workers value must be >= 1")
    cpu_model = bench_receipt.cpu_model_name()
    label = args.machine_label or f"cpu: {platform.platform()}" + (f" ({cpu_model})" if cpu_model else "")
    load_before = os.getloadavg()
    started = utc_now()
    server = null = None
    with tempfile.TemporaryDirectory(prefix="harness-overhead-") as tmpdir:
        tmp = Path(tmpdir)
        print("null server ...", file=sys.stderr)
        try:
            null, null_url = start_server(None, tmp / "null.log")
            null_passes = []
            for w in workers:
                print(f"null pass: {args.null_requests} requests, {w} worker(s) ...", file=sys.stderr)
                null_passes.append(trivial_pass(null_url, w, args.null_requests))
        finally:
            stop(null)
        model = args.model
        if args.url is None and model is None:
            print("building a tiny random-weight model ...", file=sys.stderr)
            run([sys.executable, APP / "make_tiny_model.py", tmp / "model"])
            model = tmp / "model"
        try:
            url = args.url
            if url is None:
                print("starting the embedded backend ...", file=sys.stderr)
                server, url = start_server(model, tmp / "server.log")
            info = bench_client.Client(url, 30, 2).get_json("/server_info")
            trivial = []
            for w in workers:
                print(f"trivial pass: {args.trivial_requests} requests, {w} worker(s) ...", file=sys.stderr)
                trivial.append(trivial_pass(url, w, args.trivial_requests))
            normal = None
            if model is not None or args.normal_set:
                print("normal run ...", file=sys.stderr)
                normal = normal_run(url, model, tmp, args.normal_rows, args.normal_premise_tokens, label,
                                    args.normal_set, args.normal_repetitions)
        finally:
            stop(server)
    frac = normal["client_overhead_fraction"] if normal else None
    result = {
        "kind": KIND, "schema_version": 1, "made_by": "benchmarks/bench_harness_overhead.py",
        "started_at": started, "finished_at": utc_now(),
        "machine": {"label": label, "platform": platform.platform(), "cpu_model": cpu_model,
                    "cpu_count": os.cpu_count(), "host": socket.gethostname(),
                    "load_average_before": list(load_before), "load_average_after": list(os.getloadavg())},
        "command": "python " + " ".join([str(Path(sys.argv[0]).resolve().relative_to(REPO))] + sys.argv[1:]),
        "server": {"url": url if args.url else "embedded backend on 127.0.0.1 (started by this script)",
                   "backend": info.get("backend"), "device": info.get("device"), "dtype": info.get("dtype"),
                   "batching": info.get("batching"), "model_path": info.get("model_path") if args.model else
                   "tiny random-weight model (app/make_tiny_model.py)"},
        "null_server": null_passes,
        "trivial": trivial,
        "normal": normal,
        "target": {"client_overhead_fraction_max": 0.02,
                   "met": (frac is not None and frac < 0.02) if normal else None},
        "definitions": {
            "client_cpu_s": "CPU seconds (time.process_time) of the client process during a pass: HTTP client, "
                            "JSON parsing, thread pool, progress bar",
            "client_overhead_fraction": "client_cpu_s / pass wall time; an upper bound on what the client adds to "
                                        "the wall time, since part of it overlaps server work",
            "note": "client and server share this machine's CPUs; on a GPU server the client competes for the host "
                    "CPU only",
        },
        "environment": environment_receipt(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    for t in null_passes:
        print(f"null server, {t['workers']} worker(s): {t['requests_per_s']:.0f} requests/s, client CPU "
              f"{t['client_cpu_per_request_ms']:.3f} ms/request, latency p50 {1000 * t['latency_s']['p50']:.2f} ms")
    for t in trivial:
        print(f"trivial, {t['workers']} worker(s): {t['requests_per_s']:.0f} requests/s, client CPU "
              f"{t['client_cpu_per_request_ms']:.3f} ms/request, latency p50 {1000 * t['latency_s']['p50']:.2f} ms")
    if normal:
        print(f"normal run ({normal['rows']} rows, batch 32, 4 workers, {normal['repetitions']} measured passes): median wall {normal['median_wall_s']:.3f} s, "
              f"client overhead {100 * normal['client_overhead_fraction']:.3f}% of wall (target < 2%)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    run_main(main)
