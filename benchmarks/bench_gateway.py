#!/usr/bin/env python3
"""What the production gateway costs and gives: HAProxy (deploy/) in front of embedded replicas.

The deployment is the real one: units and haproxy.cfg rendered by deploy/install_units.sh
(`--backend transformers`, stand-in ports on 127.0.0.1), run by tests/openjev_testsupport/unit_runner.py the way
systemd runs them (socket held by this process and passed as fd 3, Type=notify, replicas through
app/serve_sglang_v100.sh). Two replicas, one CPU thread each (OMP_NUM_THREADS=1).

  latency     added latency of the gateway: one client, one request at a time, requests sent
              alternately direct to replica0 and through the gateway (which is pinned to replica0 by
              putting replica1 in maintenance over the runtime API), same client code (http.client),
              same run. Two request kinds: GET /health (almost no backend work: the proxy's own
              cost) and POST /classify with one row (end to end); two client modes: keep-alive and a
              fresh connection per request. Reports p50/p99/mean of each path and the differences
              gateway - direct. Goal: p99 added < 1 ms on loopback.
  throughput  --requests /classify requests of 1-2 rows from --clients keep-alive clients through
              the gateway, with one replica (replica1 in maintenance) and then with two; requests/s,
              rows/s, latency percentiles; every answer compared bitwise with the reference logits.

The result names the machine (platform, CPU model, CPU count, load average before and after):
figures from one machine are never to be read as another's. This is a CPU machine: the script
refuses to write under results_v100/.

Example (this is how benchmarks/results_cpu/gateway_cpu.json was made):
  .venv/bin/python benchmarks/bench_gateway.py --out benchmarks/results_cpu/gateway_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "app"

from openjev.common import UserError, run_main
from openjev_testsupport.ports import free_port
from openjev_testsupport.loopback_bench import (Client, RequestNumbers, admin, build_tiny, cpu_result_path, find_haproxy,
                                                free_pair, haproxy_version, request_rows, result_head, run,
                                                run_clients, summary_ms, wait_status, work_dir, write_result)
from openjev_testsupport import unit_runner

KIND = "openjev-gateway-bench"
DEFAULT_OUT = REPO / "benchmarks" / "results_cpu" / "gateway_cpu.json"
PY = sys.executable


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON (default: %(default)s)")
    p.add_argument("--work", type=Path, default=None,
                   help="directory for the tiny model, rendered units and logs (default: a temporary one)")
    p.add_argument("--model", type=Path, default=None,
                   help="model overlay for the replicas (default: a tiny random-weight model built under --work); "
                        "with --model, also give --tokens and --reference")
    p.add_argument("--tokens", type=Path, default=None, help="token file (tokenize_nli.py output) for --model")
    p.add_argument("--reference", type=Path, default=None, help="reference dir (score_reference.py output) for --model")
    p.add_argument("--latency-pairs", type=int, default=1000,
                   help="direct/gateway request pairs per request kind and client mode (default: 1000)")
    p.add_argument("--requests", type=int, default=1000, help="requests per throughput run (default: 1000)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients in the throughput runs (default: 8)")
    p.add_argument("--haproxy", default=None, help="HAProxy executable (default: haproxy on PATH)")
    return p


def latency_phase(direct_port: int, gateway_port: int, pairs: int, row: list[int]) -> dict:
    out = {}
    kinds = {"health": ("GET", "/health", None),
             "classify_1_row": ("POST", "/classify", json.dumps({"input_ids": [row]}).encode())}
    for mode in ("keepalive", "fresh"):
        out[mode] = latency_mode(direct_port, gateway_port, pairs, kinds, mode == "fresh")
    return out


def latency_mode(direct_port: int, gateway_port: int, pairs: int, kinds: dict, fresh: bool) -> dict:
    out = {}
    mode = "fresh connection per request" if fresh else "keep-alive"
    for kind, (method, path, body) in kinds.items():
        direct, gateway = Client(direct_port, fresh), Client(gateway_port, fresh)
        for c in (direct, gateway):  # warm the connections (and the gateway's server-side connection)
            for _ in range(20):
                c.call(method, path, body)
        times = {"direct": [], "gateway": []}
        for i in range(pairs):
            order = (("direct", direct), ("gateway", gateway)) if i % 2 == 0 else (("gateway", gateway), ("direct", direct))
            for name, c in order:
                t0 = time.perf_counter()
                status, _, _ = c.call(method, path, body)
                times[name].append(time.perf_counter() - t0)
                if status != 200:
                    raise UserError(f"{kind} via {name}: HTTP {status}")
        d, g = summary_ms(times["direct"]), summary_ms(times["gateway"])
        paired = [(b - a) * 1e3 for a, b in zip(times["direct"], times["gateway"])]
        out[kind] = {"direct": d, "gateway": g,
                     "added_p50_ms": round(g["p50_ms"] - d["p50_ms"], 3),
                     "added_p99_ms": round(g["p99_ms"] - d["p99_ms"], 3),
                     "added_mean_ms": round(g["mean_ms"] - d["mean_ms"], 3),
                     "paired_difference_median_ms": round(statistics.median(paired), 3)}
        print(f"latency {kind}, {mode}: direct p50 {d['p50_ms']} p99 {d['p99_ms']} ms; gateway p50 {g['p50_ms']} "
              f"p99 {g['p99_ms']} ms; added p50 {out[kind]['added_p50_ms']} p99 {out[kind]['added_p99_ms']} ms",
              flush=True)
    return out


def throughput_run(port: int, rows: list[list[int]], ref: np.ndarray, n: int, clients: int) -> dict:
    numbers = RequestNumbers(n)
    lock = numbers.lock
    state = {"rows": 0, "failures": 0, "mismatches": 0}
    lat: list[float] = []
    by_replica: dict[str, int] = {}

    def worker():
        c = Client(port)
        while (i := numbers.take()) is not None:
            idx = request_rows(i, len(rows))
            body = json.dumps({"input_ids": [rows[j] for j in idx]}).encode()
            t0 = time.perf_counter()
            try:
                status, data, headers = c.call("POST", "/classify", body)
            except UserError:
                status, data, headers = 0, b"", {}
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)
                state["rows"] += len(idx)
                if status != 200:
                    state["failures"] += 1
                    continue
                got = np.asarray(json.loads(data)["logits"], dtype=np.float32)
                if not np.array_equal(got, ref[idx]):
                    state["mismatches"] += 1
                name = headers.get("x-openjev-replica") or "?"
                by_replica[name] = by_replica.get(name, 0) + 1

    secs = run_clients(worker, clients)
    return {"requests": n, "rows": state["rows"], "clients": clients, "seconds": round(secs, 3),
            "requests_per_s": round(n / secs, 2), "rows_per_s": round(state["rows"] / secs, 2),
            "latency": summary_ms(lat), "failures": state["failures"], "mismatches": state["mismatches"],
            "served_by": by_replica}


# ---------------------------------------------------------------- main
def main() -> int:
    args = build_parser().parse_args()
    out = cpu_result_path(args.out)
    haproxy = find_haproxy(args.haproxy)
    if args.model and not (args.tokens and args.reference):
        raise UserError("--model needs --tokens and --reference (the reference logits every answer is checked against)")
    if min(args.latency_pairs, args.requests, args.clients) < 1:
        raise UserError("--latency-pairs, --requests and --clients must be >= 1")

    with work_dir(args.work, "openjev-bench-gateway-") as work:
        if args.model:
            model, tokens, refdir = args.model.resolve(), args.tokens.resolve(), args.reference.resolve()
        else:
            model, tokens, refdir = build_tiny(work)
        rows = [json.loads(line)["input_ids"] for line in tokens.read_text().splitlines() if line.strip()]
        ref = np.load(refdir / "reference.npy")

        port, stats_port, base = free_port(), free_port(), free_pair()
        deploy = work / "deploy"
        shutil.rmtree(deploy, ignore_errors=True)
        (deploy / "root").mkdir(parents=True)
        run(["bash", REPO / "deploy" / "install_units.sh", "--root", deploy / "root", "--model", model,
             "--unit-dir", deploy / "units", "--conf-dir", deploy / "conf", "--gpus", "0,1", "--port", port,
             "--stats-port", stats_port, "--replica-port-base", base, "--backend", "transformers",
             "--haproxy", haproxy, "--env", f"OPENJEV_PYTHON={PY}", "--env", "OMP_NUM_THREADS=1", "--no-verify"],
            "install_units.sh")
        runtime = Path(tempfile.mkdtemp(prefix="ojgw-", dir="/tmp"))  # short: AF_UNIX path limit
        adm = runtime / "openjev-gateway" / "admin.sock"
        load_before = os.getloadavg()
        version = haproxy_version(haproxy)
        mgr = unit_runner.Manager(deploy / "units", runtime, deploy / "journal")
        try:
            print(f"starting the gateway on 127.0.0.1:{port} and replicas on {base}, {base + 1} ...", flush=True)
            mgr.start_target("openjev.target")
            wait_status(adm, {"replica0": "UP", "replica1": "UP"})

            admin(adm, "set server openjev/replica1 state maint")
            wait_status(adm, {"replica1": "MAINT"})
            latency = latency_phase(base, port, args.latency_pairs, rows[0])

            print(f"throughput: {args.requests} requests, {args.clients} clients, one replica ...", flush=True)
            one = throughput_run(port, rows, ref, args.requests, args.clients)
            admin(adm, "set server openjev/replica1 state ready")
            wait_status(adm, {"replica0": "UP", "replica1": "UP"})
            print(f"throughput: {args.requests} requests, {args.clients} clients, two replicas ...", flush=True)
            two = throughput_run(port, rows, ref, args.requests, args.clients)
        finally:
            mgr.close()
            shutil.rmtree(runtime, ignore_errors=True)
    load_after = os.getloadavg()
    # A replica whose sockets lack TCP_NODELAY answers keep-alive requests after the first one
    # ~40 ms late (Nagle against the client's delayed ACK); fresh connections are not affected.
    ka, fr = latency["keepalive"]["health"]["direct"]["p50_ms"], latency["fresh"]["health"]["direct"]["p50_ms"]
    stall = {"detected": ka > 30 and fr < 10, "direct_keepalive_health_p50_ms": ka,
             "direct_fresh_health_p50_ms": fr,
             "explanation": "the embedded backend's accepted sockets lack TCP_NODELAY (openjev/common.py "
                            "bind_listen_socket creates the socket with proto 0, so asyncio does not set it): "
                            "uvicorn writes headers and body separately and the body waits for the client's "
                            "delayed ACK. The gateway (option http-server-close) is not affected; direct "
                            "keep-alive clients are."}
    # With the stall, keep-alive "added latency" is negative nonsense: judge the goal on fresh connections.
    goal_mode = "fresh" if stall["detected"] else "keepalive"

    for name, res in (("one replica", one), ("two replicas", two)):
        print(f"{name}: {res['requests_per_s']} req/s, {res['rows_per_s']} rows/s, p50 {res['latency']['p50_ms']} ms, "
              f"p99 {res['latency']['p99_ms']} ms, failures {res['failures']}, mismatches {res['mismatches']}")
    result = {
        **result_head(KIND, load_before, load_after, version),
        "deployment": "deploy/install_units.sh --backend transformers (tiny random-weight Qwen3.5 classifier, "
                      "float32, exact batching, OMP_NUM_THREADS=1 per replica) run by "
                      "tests/openjev_testsupport/unit_runner.py; "
                      "HAProxy master-worker on a socket held by the runner (fd 3)",
        "parameters": {"latency_pairs": args.latency_pairs, "requests": args.requests, "clients": args.clients,
                       "request_rows": "1 (even i) or 2 (odd i) rows of data/nli_sample.jsonl tokens",
                       "model": "tiny random-weight" if not args.model else str(args.model)},
        "latency": latency,
        "goal": {"added_p99_ms_below": 1.0, "evaluated_on": goal_mode,
                 **{f"met_{kind}": latency[goal_mode][kind]["added_p99_ms"] < 1.0 for kind in latency[goal_mode]}},
        "backend_delayed_ack_stall": stall,
        "throughput": {"one_replica": one, "two_replicas": two,
                       "speedup_two_vs_one": round(two["requests_per_s"] / one["requests_per_s"], 3)},
        "notes": [
            "Latency: one client, requests alternating direct/gateway in one run; replica1 in maintenance so the "
            "gateway forwards to the same replica0 the direct requests hit. Two client modes: keep-alive (one "
            "connection per path) and a fresh connection per request; with keep-alive the direct path carries "
            "the backend's delayed-ACK stall when backend_delayed_ack_stall.detected, so compare the fresh mode.",
            "Throughput on CPU: both replicas share this machine's cores (and, on a shared machine, other "
            "people's work: see the load averages), so two replicas cannot double throughput here as two GPUs would.",
        ],
    }
    write_result(out, result)
    return 0


if __name__ == "__main__":
    run_main(main)
