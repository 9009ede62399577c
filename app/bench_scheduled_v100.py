#!/usr/bin/env python3
"""Scheduled benchmark run (cron / systemd timer): one run into a history directory, then a verdict.

No terminal needed. Steps:
  1. take an exclusive lock, HISTORY/.lock (fcntl.flock, non-blocking); when another scheduled run
     holds it, print one line and exit 75 (EX_TEMPFAIL)
  2. make a new run folder HISTORY/runs/<UTC stamp>-<pid> (never reused or overwritten) and write
     run.json: phase, started, finished, complete: false (true only at the very end), the server
     configuration and the command
  3. run app/tune_sglang_v100.py with a single profile ("scheduled": --schedule-policy and
     --max-running-requests, plus --server-arg / --server-env) into RUN/tune: it waits for an idle
     GPU (skipped with a recorded reason where there is no NVML), starts the development server via
     app/serve_sglang_v100.sh (OPENJEV_BACKEND=transformers runs the embedded backend) on --gpu and
     --port (never the production port 31000), runs app/bench_classify_v100.py for every --set cold
     (--cold-cache) and warm, and stops the server; its output goes to RUN/tune.log
  4. mark the run complete and judge it with app/report_bench_history.py's verdict (the rule is in
     that script's --help: a band over the last N complete and valid runs that widens with their
     spread and their own pass noise; timing is judged only from 3 such runs, correctness always;
     argmax changes, max |dp_e|, audit failures and invalid/incomplete runs are regressions)

Killed midway (SIGKILL included), the run stays complete: false and is never a baseline; the tuner
child gets a parent-death SIGTERM and stops its server.

Output: quiet on success (one summary line); on regression or failure a short report. Exit status:
0 no regression; 3 regression; 1 failure (bad input, tuner/bench failure); 75 another run holds the lock.

Example crontab line (03:17 every night, GPU 1, port 31001):
  17 3 * * * cd ~/storage/sglang-openjev-v100 && venv/bin/python app/bench_scheduled_v100.py \\
    --history results/bench_history --checkpoint model --gpu 1 --port 31001 \\
    --set G=G.jsonl,G.tokens.jsonl,results/ref_G --set T=T.jsonl,T.tokens.jsonl,results/ref_T
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import signal
import subprocess
import sys
from pathlib import Path

from openjev import history
from openjev.common import (PRODUCTION_PORT, UserError, atomic_write_json, run_main, try_exclusive_lock,
                            utc_now)
from openjev.tune.processes import child_preexec
from openjev.tune.profiles import ENV_KEY_RE, RESERVED_ENV, check_set_files, make_profile, parse_set

EXIT_LOCKED = 75
TUNE_SCRIPT = Path(__file__).resolve().parent / "tune_sglang_v100.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=Path, required=True, help="history directory (created if missing; holds .lock and runs/)")
    p.add_argument("--checkpoint", type=Path, required=True, help="model / overlay directory")
    p.add_argument("--port", type=int, required=True, help=f"development server port (never {PRODUCTION_PORT}; must be free)")
    p.add_argument("--gpu", type=int, required=True, help="physical GPU index (NVML order)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=INPUTS,TOKENS,REFDIR",
                   help="input set, its token file and reference directory (repeatable; at least one; as the tuner)")
    p.add_argument("--schedule-policy", default="fcfs", help="server schedule policy (default: fcfs)")
    p.add_argument("--max-running-requests", type=int, default=16, help="server running-request cap (default: 16)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra server argv word, e.g. --server-arg=--disable-radix-cache (repeatable)")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VAL",
                   help="extra server environment variable (repeatable)")
    p.add_argument("--batch-size", type=int, default=32, help="bench: inputs per request (default: 32)")
    p.add_argument("--workers", type=int, default=4, help="bench: client workers (default: 4)")
    p.add_argument("--repetitions", type=int, default=3, help="bench: measured passes (default: 3)")
    p.add_argument("--truncate", type=int, default=4096, help="bench: tokens kept per row (default: 4096)")
    p.add_argument("--idle-seconds", type=float, default=60.0, help="GPU idle time required before the launch (default: 60)")
    p.add_argument("--max-wait", type=float, default=3600.0, help="give up when the GPU is not idle after this (default: 3600)")
    p.add_argument("--start-timeout", type=float, default=1800.0, help="seconds for /health 200 (default: 1800)")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="SIGTERM -> SIGKILL delay (default: 60)")
    p.add_argument("--baseline-runs", type=int, default=history.DEFAULTS["baseline_runs"], help="verdict: N (default: 5)")
    p.add_argument("--min-baseline-runs", type=int, default=history.DEFAULTS["min_baseline_runs"],
                   help="verdict: fewer baseline runs than this and timing is not judged (default: 3)")
    p.add_argument("--mad-k", type=float, default=history.DEFAULTS["mad_k"], help="verdict: k (default: 4)")
    p.add_argument("--rel-floor", type=float, default=history.DEFAULTS["rel_floor"], help="verdict: floor (default: 0.10)")
    p.add_argument("--check-only", action="store_true",
                   help="check the arguments and the sets' files as a run would, then exit 0 without running "
                        "(deploy/install_units.sh --bench-timer runs this before it installs the job)")
    p.add_argument("--max-dp-e", type=float, default=history.DEFAULTS["max_dp_e"], help="verdict: |dp_e| bound (default: 0.02)")
    return p


def server_profile(args: argparse.Namespace) -> dict:
    env = {}
    for kv in args.server_env:
        k, sep, v = kv.partition("=")
        if not sep or not ENV_KEY_RE.match(k) or k in RESERVED_ENV:
            raise UserError(f"--server-env {kv!r}: expected KEY=VAL (KEY upper case, not {', '.join(RESERVED_ENV)})")
        env[k] = v
    prof = make_profile(history.PROFILE_NAME, args.schedule_policy, args.max_running_requests, args.server_arg, env)
    return prof.to_json()


def check_arguments(args: argparse.Namespace) -> tuple[list, dict]:
    """The run's arguments checked before anything starts: (input sets, server profile)."""
    if args.port == PRODUCTION_PORT:
        raise UserError(f"--port {PRODUCTION_PORT} is the production endpoint; use a development port")
    if not 1 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: not a TCP port")
    if not args.sets:
        raise UserError("give at least one --set NAME=INPUTS,TOKENS,REFDIR")
    sets = [parse_set(s) for s in args.sets]
    if len({s.name for s in sets}) != len(sets):
        raise UserError("--set names must be distinct")
    if not args.checkpoint.is_dir():
        raise UserError(f"--checkpoint {args.checkpoint}: not a directory")
    return sets, server_profile(args)


def main() -> int:
    args = build_parser().parse_args()
    sets, profile = check_arguments(args)
    if args.check_only:
        for s in sets:
            check_set_files(s, args.truncate)
        print(f"bench arguments OK: {len(sets)} set(s), checkpoint {args.checkpoint}, port {args.port}, GPU {args.gpu}")
        return 0
    args.history.mkdir(parents=True, exist_ok=True)
    fd, holder = try_exclusive_lock(args.history / ".lock")
    if fd is None:
        print(f"bench_scheduled_v100.py: another scheduled run (pid {holder}) holds {args.history}/.lock; not started")
        return EXIT_LOCKED

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    run_dir = args.history / "runs" / f"{stamp}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=False)
    record = {"kind": "openjev-scheduled-run", "schema_version": 1, "phase": "benchmarking", "started": utc_now(),
              "finished": None, "complete": False, "pid": os.getpid(), "argv": sys.argv, "tune_exit": None,
              "server_config": {"checkpoint": str(args.checkpoint.absolute()), "gpu": args.gpu, "port": args.port,
                                "profile": profile, "sets": [s.to_json() for s in sets],
                                "backend": os.environ.get("OPENJEV_BACKEND", "sglang"),
                                "bench": {"batch_size": args.batch_size, "workers": args.workers,
                                          "repetitions": args.repetitions, "truncate": args.truncate}}}
    atomic_write_json(run_dir / "run.json", record)
    atomic_write_json(run_dir / "profile.json", [profile])
    cmd = [sys.executable, str(TUNE_SCRIPT), "--gpu", str(args.gpu), "--port", str(args.port),
           "--out", str(run_dir / "tune"), "--model", str(args.checkpoint.absolute()),
           "--profiles", str(run_dir / "profile.json"), "--batch-size", str(args.batch_size),
           "--workers", str(args.workers), "--repetitions", str(args.repetitions), "--truncate", str(args.truncate),
           "--idle-seconds", str(args.idle_seconds), "--max-wait", str(args.max_wait),
           "--start-timeout", str(args.start_timeout), "--stop-timeout", str(args.stop_timeout)]
    for s in args.sets:
        cmd += ["--set", s]
    with open(run_dir / "tune.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=child_preexec(signal.SIGTERM, os.getpid()))
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait()
    record.update(phase="done", finished=utc_now(), complete=True, tune_exit=rc)
    atomic_write_json(run_dir / "run.json", record)

    runs = history.load_history(args.history)
    idx = [r["name"] for r in runs].index(run_dir.name)
    v = history.verdict(runs, idx, baseline_runs=args.baseline_runs, min_baseline_runs=args.min_baseline_runs,
                        mad_k=args.mad_k, rel_floor=args.rel_floor, max_dp_e=args.max_dp_e)
    atomic_write_json(run_dir / "verdict.json", v)
    meds = ", ".join(f"{k} {h['median_pass_s']:.3f} s" for k, h in runs[idx]["measurements"].items()
                     if isinstance(h.get("median_pass_s"), (int, float)))
    if not v["regression"]:
        what = "insufficient baseline, timing not judged" if v["status"] == "insufficient baseline" else "no regression"
        print(f"scheduled bench {run_dir.name}: {what} ({meds}; baseline {len(v['baseline'])} run(s))")
        return 0
    print(f"scheduled bench {run_dir.name}: {'FAILED' if rc else 'REGRESSION'} (tuner exit {rc}; {meds or 'no medians'})")
    for r in v["reasons"]:
        print(f"  - {r}")
    if rc:
        print(f"  tuner log: {run_dir / 'tune.log'}")
    return 1 if (rc or not runs[idx]["valid"]) else history.EXIT_REGRESSION


if __name__ == "__main__":
    run_main(main)
