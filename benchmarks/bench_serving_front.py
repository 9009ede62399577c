#!/usr/bin/env python3
"""Serving-front benchmark of the embedded backend, on the machine it runs on.

Starts app/serve_transformers.py with its default settings on a free 127.0.0.1 port and measures:
  1. load: C concurrent clients x N single-row POST /classify requests each (default 16 x 50), rows
     cycled from the tokenized sample; latency p50/p90/p99/max, throughput, errors, and every
     returned row compared bitwise with the reference scorer's logits (mismatches counted);
  2. /health latency (polled every 20 ms) while one 20 MB `text` request is in flight, with that
     request's status and wall time, and the server's RSS before and after it;
  3. mixed load: T tries of three big requests (R rows x 8191 tokens each) and, once they are
     being served, one 1-row request: how many scheduling steps and seconds the 1-row request
     took, and the big requests' tokens per second.
`--phases` picks among load, big-text and mixed (default: all).
`--also-threads K` repeats the load phase on a second server started with OPENJEV_TORCH_THREADS=K
(e.g. 2: torch's own default on a 2-core machine) for comparison.

Without --model it builds the tiny random-weight model with app/make_tiny_model.py (as the tests do),
tokenizes data/nli_sample.jsonl and scores the reference with app/score_reference.py. The JSON
receipt names the machine and the load average before and after (other work on a shared machine
shows there). Not a V100 figure: receipts go under benchmarks/results_<machine>/.

Example:
  .venv/bin/python benchmarks/bench_serving_front.py --out benchmarks/results_cpu/serving_front_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import requests

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "app"
SAMPLE = REPO / "data" / "nli_sample.jsonl"

from openjev_testsupport.loopback_bench import machine as machine_facts
from openjev_testsupport.servers import Server, ServerStartError, start_server
from openjev.common import UserError, run_main, utc_now


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="receipt JSON to write (refused under results_v100/)")
    p.add_argument("--model", type=Path, default=None, help="model overlay directory (default: build the tiny model)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default: 16)")
    p.add_argument("--requests", type=int, default=50, help="single-row requests per client (default: 50)")
    p.add_argument("--big-mb", type=float, default=20.0, help="size of the big text request in MB (default: 20)")
    p.add_argument("--also-threads", type=int, default=None,
                   help="repeat the load phase with OPENJEV_TORCH_THREADS=K on a second server")
    p.add_argument("--phases", default="load,big-text,mixed", help="comma-separated phases to run (default: all)")
    p.add_argument("--mixed-tries", type=int, default=20, help="tries of the mixed phase (default: 20)")
    p.add_argument("--mixed-big-rows", type=int, default=4, help="rows of each big request in the mixed phase (default: 4)")
    p.add_argument("--machine-label", default=None, help="machine label (default: CPU model and count)")
    return p


def machine(label: str | None) -> dict:
    """bench_gateway's machine facts under this receipt's label (--machine-label, or CPU model and count)."""
    m = machine_facts()
    cpu = m["cpu_model"] or platform.processor() or "unknown CPU"
    return {**m, "label": label or f"cpu: {cpu}, {m['cpu_count']} logical CPUs (no GPU; not a V100)"}




def run(*cmd) -> None:
    proc = subprocess.run([sys.executable, *map(str, cmd)], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise UserError(f"{Path(str(cmd[0])).name} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")


def prepare(tmp: Path, model: Path | None) -> tuple[Path, list[list[int]], np.ndarray]:
    if model is None:
        print("building the tiny model ...", file=sys.stderr)
        run(APP / "make_tiny_model.py", tmp / "checkpoint", "--processor-out", tmp / "processor")
        model = tmp / "model"
        run(APP / "prepare_v100_model.py", tmp / "checkpoint", model, "--processor-dir", tmp / "processor",
            "--allow-unpinned")
    tokens = tmp / "sample.tokens.jsonl"
    run(APP / "tokenize_nli.py", "--model", model, "--inputs", SAMPLE, "--out", tokens)
    print("scoring the reference ...", file=sys.stderr)
    run(APP / "score_reference.py", "--model", model, "--tokens", tokens, "--inputs", SAMPLE, "--out", tmp / "ref")
    rows = [json.loads(line)["input_ids"] for line in tokens.read_text().splitlines() if line.strip()]
    return model, rows, np.load(tmp / "ref" / "reference.npy")


def serve(model: Path, log: Path, env: dict | None = None) -> Server:
    try:
        return start_server(model, log, timeout=300, env=env)
    except ServerStartError as e:
        raise UserError(f"{str(e).splitlines()[0]} (log: {log})") from None


def pct(values, q) -> float:
    return round(float(np.percentile(np.asarray(values), q)), 6)


def load_phase(url: str, rows: list[list[int]], ref: np.ndarray, clients: int, per_client: int) -> dict:
    for i in range(min(8, len(rows))):  # warm-up, not measured
        requests.post(f"{url}/classify", json={"input_ids": [rows[i]]}, timeout=60)
    lat, errors, mismatches = [], [], 0
    lock = threading.Lock()

    def client(c: int) -> None:
        nonlocal mismatches
        s = requests.Session()
        for k in range(per_client):
            i = (c * per_client + k) % len(rows)
            t0 = time.perf_counter()
            try:
                r = s.post(f"{url}/classify", json={"input_ids": [rows[i]]}, timeout=120)
                dt = time.perf_counter() - t0
                ok = r.status_code == 200
                got = np.asarray(r.json()["logits"], dtype=np.float32) if ok else None
            except (requests.RequestException, ValueError, KeyError) as exc:
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with lock:
                lat.append(dt)
                if not ok:
                    errors.append(f"HTTP {r.status_code}")
                elif not np.array_equal(got, ref[i:i + 1]):
                    mismatches += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - t0
    info = requests.get(f"{url}/server_info", timeout=10).json()
    n = clients * per_client
    return {"clients": clients, "requests_per_client": per_client, "requests": n, "ok": len(lat) - sum(
        e.startswith("HTTP") for e in errors), "errors": len(errors), "error_examples": errors[:5],
            "logit_mismatches": mismatches, "wall_s": round(wall, 3), "requests_per_s": round(n / wall, 2),
            "latency_s": {"p50": pct(lat, 50), "p90": pct(lat, 90), "p99": pct(lat, 99), "max": round(max(lat), 6)},
            "p99_over_p50": round(pct(lat, 99) / pct(lat, 50), 3),
            "server_threads": info.get("threads"), "step_token_budget": info.get("step_token_budget"),
            "server_steps": info["counters"]["steps"]}


def health_under_big_text(url: str, pid: int, mb: float) -> dict:
    proc = psutil.Process(pid)
    for _ in range(3):
        requests.post(f"{url}/classify", json={"text": ["a cat sleeps"] * 4}, timeout=60)
    rss_before = proc.memory_info().rss
    body = json.dumps({"text": "x" * int(mb * 1024 * 1024)}).encode()
    result: dict = {}

    def big():
        t0 = time.perf_counter()
        r = requests.post(f"{url}/classify", data=body, headers={"Content-Type": "application/json"}, timeout=300)
        result.update(status=r.status_code, wall_s=round(time.perf_counter() - t0, 4),
                      message=r.json().get("error", {}).get("message"))

    t = threading.Thread(target=big)
    lat, statuses = [], []
    t.start()
    while t.is_alive():
        t0 = time.perf_counter()
        r = requests.get(f"{url}/health", timeout=30)
        lat.append(time.perf_counter() - t0)
        statuses.append(r.status_code)
        time.sleep(0.02)
    t.join()
    time.sleep(0.5)
    rss_after = proc.memory_info().rss
    return {"body_bytes": len(body), "big_request": result, "health_polls": len(lat),
            "health_statuses": sorted(set(statuses)),
            "health_latency_s": {"p50": pct(lat, 50), "p99": pct(lat, 99), "max": round(max(lat), 6)} if lat else None,
            "rss_mb_before": round(rss_before / 2**20, 1), "rss_mb_after": round(rss_after / 2**20, 1),
            "rss_after_over_before": round(rss_after / rss_before, 4)}


LONG = 8191  # the longest input at the default 8192 context


def mixed_phase(url: str, tries: int, big_rows: int) -> dict:
    """The 1-row request's wait, in scheduling steps (/server_info's step counter just before it is
    sent and just after its answer) and seconds, while three big requests fill every step."""
    steps = lambda: requests.get(f"{url}/server_info", timeout=30).json()["counters"]["steps"]  # noqa: E731
    small_steps, small_s, big_tok_s, errors = [], [], [], []
    for t in range(tries):
        done: list[float] = []

        def big(k: int) -> None:
            r = requests.post(f"{url}/classify", json={"input_ids": [[5 + k] * LONG] * big_rows}, timeout=1200)
            done.append(time.perf_counter())
            if r.status_code != 200:
                errors.append(f"big HTTP {r.status_code}")

        start = steps()
        t0 = time.perf_counter()
        threads = [threading.Thread(target=big, args=(k,)) for k in range(3)]
        for th in threads:
            th.start()
            time.sleep(0.05)
        while steps() < start + 1:
            time.sleep(0.01)
        before = steps()
        s0 = time.perf_counter()
        r = requests.post(f"{url}/classify", json={"input_ids": [[1, 2, 3]]}, timeout=1200)
        small_s.append(time.perf_counter() - s0)
        small_steps.append(steps() - before)
        if r.status_code != 200:
            errors.append(f"small HTTP {r.status_code}")
        for th in threads:
            th.join()
        big_tok_s.append(3 * big_rows * LONG / (max(done) - t0))
        print(f"  try {t + 1}/{tries}: 1-row request {small_steps[-1]} steps, {small_s[-1]:.3f} s", file=sys.stderr)
    return {"tries": tries, "big_requests": 3, "big_rows": big_rows, "big_row_tokens": LONG, "errors": errors,
            "small_steps": {"p50": pct(small_steps, 50), "p99": pct(small_steps, 99), "max": max(small_steps)},
            "small_seconds": {"p50": pct(small_s, 50), "p99": pct(small_s, 99), "max": round(max(small_s), 6)},
            "big_tokens_per_s": {"median": pct(big_tok_s, 50), "min": round(min(big_tok_s), 2),
                                 "max": round(max(big_tok_s), 2)},
            "small_steps_each": small_steps}


def main() -> int:
    args = build_parser().parse_args()
    out = args.out.resolve()
    if (REPO / "results_v100") in out.parents:
        raise UserError("results_v100/ holds V100 figures only; write CPU receipts under benchmarks/results_cpu/")
    if args.clients < 1 or args.requests < 1 or args.big_mb <= 0 or args.mixed_tries < 1 or args.mixed_big_rows < 1:
        raise UserError("--clients, --requests, --mixed-tries and --mixed-big-rows must be >= 1, --big-mb > 0")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or set(phases) - {"load", "big-text", "mixed"}:
        raise UserError(f"--phases: expected a comma-separated subset of load,big-text,mixed, got {args.phases!r}")
    receipt = {"kind": "openjev-serving-front-bench", "schema_version": 1, "made_by": "benchmarks/bench_serving_front.py",
               "started_at": utc_now(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
               "machine": {**machine(args.machine_label), "load_average_before": list(os.getloadavg())}}
    with tempfile.TemporaryDirectory(prefix="openjev-front-") as tmp:
        tmp = Path(tmp)
        model, rows, ref = prepare(tmp, args.model)
        srv = serve(model, tmp / "server.log")
        try:
            if "load" in phases:
                print(f"load: {args.clients} clients x {args.requests} requests ...", file=sys.stderr)
                receipt["load_default"] = load_phase(srv.url, rows, ref, args.clients, args.requests)
            if "big-text" in phases:
                print(f"/health while a {args.big_mb:g} MB text request is in flight ...", file=sys.stderr)
                receipt["health_under_big_text"] = health_under_big_text(srv.url, srv.proc.pid, args.big_mb)
            if "mixed" in phases:
                print(f"mixed: {args.mixed_tries} tries of 3 big requests and a 1-row one ...", file=sys.stderr)
                receipt["mixed_load"] = mixed_phase(srv.url, args.mixed_tries, args.mixed_big_rows)
            receipt["server_info"] = requests.get(f"{srv.url}/server_info", timeout=10).json()
        finally:
            srv.stop()
        if args.also_threads and "load" in phases:
            srv = serve(model, tmp / "server2.log", env={"OPENJEV_TORCH_THREADS": str(args.also_threads)})
            try:
                print(f"load with OPENJEV_TORCH_THREADS={args.also_threads} ...", file=sys.stderr)
                receipt["load_torch_threads"] = {"OPENJEV_TORCH_THREADS": args.also_threads,
                                                 **load_phase(srv.url, rows, ref, args.clients, args.requests)}
            finally:
                srv.stop()
    acceptance = {}
    if (load := receipt.get("load_default")) is not None:
        acceptance.update(p99_at_most_3x_p50=load["p99_over_p50"] <= 3.0, zero_errors=load["errors"] == 0,
                          zero_logit_mismatches=load["logit_mismatches"] == 0)
    if (mixed := receipt.get("mixed_load")) is not None:
        acceptance.update(small_request_p99_at_most_2_steps=mixed["small_steps"]["p99"] <= 2,
                          mixed_zero_errors=not mixed["errors"])
    receipt["acceptance"] = acceptance
    receipt["machine"]["load_average_after"] = list(os.getloadavg())
    receipt["finished_at"] = utc_now()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(receipt, indent=2) + "\n")
    tmp_out.replace(out)
    summary = {"out": str(out), "acceptance": acceptance}
    if load is not None:
        summary["load_default"] = {k: load[k] for k in ("requests_per_s", "latency_s", "p99_over_p50", "errors",
                                                        "logit_mismatches")}
    if "health_under_big_text" in receipt:
        summary["health_latency_s"] = receipt["health_under_big_text"]["health_latency_s"]
    if mixed is not None:
        summary["mixed_load"] = {k: mixed[k] for k in ("small_steps", "small_seconds", "big_tokens_per_s")}
    print(json.dumps(summary, indent=1))
    return 0 if all(receipt["acceptance"].values()) else 1


if __name__ == "__main__":
    run_main(main)
