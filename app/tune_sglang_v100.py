#!/usr/bin/env python3
"""Compare server profiles (scheduler x running-request cap) on one GPU. Never promotes one.

For each profile, in order:
  1. wait until GPU --gpu has had no process for --idle-seconds (NVML compute processes, and
     graphics processes where the board reports them, sampled every --poll-interval s; a failed
     sample counts as busy; bounded by --max-wait, after which the profile fails "GPU never idle"
     and the next one is tried); without NVML (no driver, no pynvml) the wait is skipped and the
     reason recorded in run.json and the table
  2. launch the server command on that GPU and --port (never the production port 31000):
     `$OPENJEV_TUNE_SERVER_CMD CHECKPOINT PORT [profile flags]` with CUDA_VISIBLE_DEVICES,
     CUDA_DEVICE_ORDER=PCI_BUS_ID, MAX_RUNNING_REQUESTS and SCHEDULE_POLICY in its environment;
     its own session and process group; log in DIR/PROFILE/server.log
  3. wait for GET /health == 200 (bounded by --start-timeout: first-use JIT is slow), save
     GET /server_info, the exact command, the environment given and the server's real argv
  4. run app/bench_classify_v100.py on every --set, cold (--cold-cache) then warm, against the
     same references, with --exclusive-gpu GPU --server-pid PID when NVML is available (unless
     --no-exclusive-gpu); a server that dies ends the profile as failed
  5. stop the server: SIGTERM to its process group, SIGKILL after --stop-timeout, then check
     that no process of its tree (tracked with psutil, PID + start time) is left

Profiles (--profiles): a comma-separated list of  [NAME=]POLICY:N[+MOD[+MOD...]]
  POLICY     a schedule policy of the pinned runtime: lpm fcfs random dfs-weight lof priority routing-key
  N          max running requests (MAX_RUNNING_REQUESTS), a positive integer
  +no-radix  adds --disable-radix-cache (the launcher then uses the no_buffer mamba strategy)
  +--FLAG    adds a server flag; +--FLAG=VALUE a flag with its value (one argv word)
  +KEY=VAL   sets an environment variable for the server (KEY in upper case, e.g.
             +MAMBA_FULL_MEMORY_RATIO=0.9); CUDA_VISIBLE_DEVICES, MAX_RUNNING_REQUESTS and
             SCHEDULE_POLICY are set by the tuner and refused here
  NAME       directory name of the profile ([A-Za-z0-9._-]); default POLICY-N plus its mods,
             e.g. fcfs-8, lpm-16-no-radix
  Values may not contain ',' or '+': for those, give a JSON file instead, a list of
  {"name", "schedule_policy", "max_running_requests", "extra_args": [...], "env": {...}}.
  Default: fcfs:8,fcfs:16,fcfs:32,lpm:16 (the runbook's comparison).

Input sets (--set, repeatable): NAME=INPUTS.jsonl,TOKENS.jsonl,REFDIR; every profile is measured
against the same references. Bench options (--batch-size, --workers, --repetitions, --truncate)
pass through unchanged.

Output (DIR must not exist; nothing is touched when it does):
  DIR/run.json               live record, rewritten atomically after every step: phase
                             (waiting-idle, starting-server, benchmarking, stopping-server; at the
                             end done = every profile completed and every check held, failed =
                             otherwise or a tuner error, interrupted = SIGTERM/SIGINT, tuner-died =
                             set by the watchdog after the tuner was killed), current
                             profile, server PID, tuner PID and start time, measurements so far
  DIR/summary.json           comparison, fastest profiles, every check; nothing promoted
  DIR/comparison.png         cold and warm median pass wall time per profile and input set
  DIR/PROFILE/profile.json   this profile's record (idle wait, server, stop, measurements)
  DIR/PROFILE/server.log     the server's stdout and stderr
  DIR/PROFILE/server_command.json  argv, environment given, the server process's real argv/env
  DIR/PROFILE/server_info.json     GET /server_info once healthy
  DIR/PROFILE/SET.MODE.json  the bench receipt (+ .candidate.npy, .passes.npy, .bench.log)
  DIR.pid                    while running (foreground or --daemon): JSON {"pid", "start_time" (s
                             since the epoch, as psutil's create_time), "host", "started_at",
                             "out", "log", "argv"}; a second run for DIR refuses while that pid
                             lives with that start time; a stale file is reported and replaced;
                             removed at the end
  DIR.log                    the daemon's stdout and stderr (--daemon only)

Children never outlive the tuner, however it ends (SIGKILL included): the server and every bench get a
parent-death signal (server SIGTERM, bench SIGKILL: a bench never writes into a dead run) and
OPENJEV_TUNE_RUN=<run_id> in their environment (inherited by the server's own children); a watchdog
process (own session) ends every process so tagged within a few seconds of the tuner's death and sets
run.json's phase to "tuner-died". `--status DIR` (and the refusal of a later run on DIR, or on a port
that a process of a run holds) says whether the run's tuner is gone (PID + start time), names its
processes still alive and prints the kill command that ends them.

Checks (all must hold for exit 0): every profile completed; every bench exited 0 and wrote an
"openjev-bench" receipt of its mode that is valid and complete, with a median pass wall time and
a passed group audit; GPU exclusivity valid wherever it was monitored (where it was not, the
table and summary.json say so).

Environment: OPENJEV_TUNE_SERVER_CMD (shell words; default app/serve_sglang_v100.sh of this
bundle) is run as `CMD CHECKPOINT PORT [flags]`; everything else (OPENJEV_BACKEND=transformers,
OPENJEV_PYTHON, OPENJEV_V100_ROOT, ...) passes through to it.

Fastest profile rule: per input set and mode, the lowest median pass wall time among
measurements whose checks all held; overall, the lowest sum of warm medians over all sets among
profiles that completed every measurement with every check held (ties: lower cold sum, then
profile order). The cold-sum winner is reported beside it. Nothing is promoted.

Exit status: 0 when every profile completed and every check held; 1 when a profile failed or a
check failed (or on a refusal, with one line on stderr); 130 / 143 after SIGINT / SIGTERM (the
running server is stopped first and run.json says "interrupted").

Example (the runbook's run, on GPU 1 beside the production endpoint):
  venv/bin/python app/tune_sglang_v100.py --gpu 1 --port 31001 --out "$PWD/results/tuning_20260927" \\
    --set G=G.jsonl,G.tokens.jsonl,results/ref_G --set T=T.jsonl,T.tokens.jsonl,results/ref_T --daemon
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from openjev.bench.client import add_pass_args
from openjev.common import PRODUCTION_PORT, UserError, openjev_root, port_is_free, run_main
from openjev.gpu import Gpu
from openjev.tune.processes import (claim_pidfile, daemonize, describe_port_holder, inspect_run, pid_paths,
                                    pidfile_record, release_pidfile, stop_watchdog)
from openjev.tune.profiles import (DEFAULT_PROFILES, InputSet, Profile, check_set_files, parse_profiles,
                                   parse_set)
from openjev.tune.tuner import BENCH_SCRIPT, Tuner, resolve_server_cmd


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # (flag, type, default, help) in the style of SGLang's server_args table
    p.add_argument("--gpu", type=int, default=None,
                   help="required (except with --status): physical GPU index (NVML order; the server gets CUDA_VISIBLE_DEVICES=N, CUDA_DEVICE_ORDER=PCI_BUS_ID)")
    p.add_argument("--port", type=int, default=None, help=f"required (except with --status): port for the candidate servers (never {PRODUCTION_PORT}; must be free)")
    p.add_argument("--out", type=Path, default=None, help="required (except with --status): output directory (must not exist)")
    p.add_argument("--status", type=Path, default=None, metavar="DIR",
                   help="print the state of the run in DIR (live, finished, or tuner gone), name every process of it "
                        "still running and the command that ends them; starts nothing (--gpu/--port/--out not needed)")
    p.add_argument("--model", type=Path, default=None, help="checkpoint / overlay directory (default: $OPENJEV_V100_ROOT/model)")
    p.add_argument("--profiles", default=DEFAULT_PROFILES,
                   help=f"profiles to compare: [NAME=]POLICY:N[+MOD...] list or a JSON file (default: {DEFAULT_PROFILES})")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=INPUTS,TOKENS,REFDIR",
                   help="input set with its token file and reference directory (repeatable; at least one)")
    add_pass_args(p, "bench: ")
    p.add_argument("--idle-seconds", type=float, default=60.0,
                   help="GPU must have had no compute process this long before each launch (default: 60)")
    p.add_argument("--max-wait", type=float, default=3600.0,
                   help="give up on a profile when the GPU is not idle after this many seconds (default: 3600)")
    p.add_argument("--poll-interval", type=float, default=1.0, help="NVML sampling interval of the idle wait, s (default: 1)")
    p.add_argument("--start-timeout", type=float, default=1800.0,
                   help="seconds for the server to answer /health 200 (default: 1800, first-use JIT)")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="seconds between SIGTERM and SIGKILL (default: 60)")
    p.add_argument("--bench-timeout", type=float, default=7200.0,
                   help="seconds one bench invocation may run before it is stopped (default: 7200)")
    p.add_argument("--no-exclusive-gpu", action="store_true",
                   help="do not pass --exclusive-gpu to the bench even where NVML works (recorded; e.g. a container "
                        "whose NVML reports host PIDs that the bench cannot identify)")
    p.add_argument("--daemon", action="store_true",
                   help="detach (setsid + double fork), stdio to DIR.log; DIR.pid holds JSON {pid, start_time, ...}")
    return p


# ================================================================ profiles and input sets (pure)


# ================================================================ idle wait (pure)


# ================================================================ receipts and summary (pure)


# ================================================================ plot


# ================================================================ processes


# ================================================================ children that never outlive the tuner


# ================================================================ NVML


# ================================================================ pid file


# ================================================================ the run


# ================================================================ main


def validate(args: argparse.Namespace) -> tuple[list[Profile], list[InputSet]]:
    """Every refusal that needs no process: one line each, before anything is created."""
    missing = [f"--{k}" for k in ("gpu", "port", "out") if getattr(args, k) is None]
    if missing:
        raise UserError(f"the following arguments are required: {', '.join(missing)} (or --status DIR)")
    if args.port == PRODUCTION_PORT:
        raise UserError(f"--port {PRODUCTION_PORT} is the production endpoint; tune on another port (e.g. 31001)")
    if not 1 <= args.port <= 65535:
        raise UserError(f"--port must be 1..65535, got {args.port}")
    if args.gpu < 0:
        raise UserError(f"--gpu must be a physical GPU index >= 0, got {args.gpu}")
    for flag in ("batch_size", "workers", "repetitions", "truncate"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("idle_seconds", "max_wait"):
        if getattr(args, flag) < 0:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 0")
    for flag in ("poll_interval", "start_timeout", "stop_timeout", "bench_timeout"):
        if getattr(args, flag) <= 0:
            raise UserError(f"--{flag.replace('_', '-')} must be > 0")
    profiles = parse_profiles(args.profiles)
    if not args.sets:
        raise UserError("give at least one input set: --set NAME=INPUTS.jsonl,TOKENS.jsonl,REFDIR (the runbook's G and T)")
    sets = [parse_set(x) for x in args.sets]
    if len({s.name for s in sets}) != len(sets):
        raise UserError("--set names must be unique")
    args.out = args.out.expanduser().absolute()
    args.model = (args.model or openjev_root() / "model").expanduser().absolute()
    return profiles, sets


def status_main(out: Path) -> int:
    out = out.expanduser().absolute()
    if not out.is_dir():
        raise UserError(f"--status {out}: no such directory")
    info = inspect_run(out)
    if info["run"] is None:
        raise UserError(f"--status {out}: {info['text']}")
    run = info["run"]
    print(info["text"])
    print(f"  phase {run.get('phase')!r} since {run.get('phase_since')}; current profile {run.get('current_profile')}")
    for rec in run.get("profiles") or []:
        print(f"  profile {rec.get('name')}: {rec.get('status')}" + (f" ({rec['failure']})" if rec.get("failure") else "")
              + f", {len(rec.get('measurements') or [])} measurement(s)")
    return 0


def main() -> int:
    args = build_parser().parse_args()
    if args.status is not None:
        return status_main(args.status)
    profiles, sets = validate(args)
    pidfile, log_path = pid_paths(args.out)
    stale = claim_pidfile_if_needed(args, pidfile, log_path)
    try:
        if args.out.exists():
            why = inspect_run(args.out)["text"] if (args.out / "run.json").exists() else ""
            raise UserError(f"output directory {args.out} already exists; the tuner only writes a new one"
                            + (f" ({why})" if why else ""))
        if not args.model.is_dir():
            raise UserError(f"model directory {args.model} not found (--model, default $OPENJEV_V100_ROOT/model)")
        if not BENCH_SCRIPT.is_file():
            raise UserError(f"bench script {BENCH_SCRIPT} not found")
        set_checks = {s.name: check_set_files(s, args.truncate) for s in sets}
        server_cmd = resolve_server_cmd()
        if not port_is_free("127.0.0.1", args.port):
            holder = describe_port_holder(args.port)
            raise UserError(f"port {args.port} on 127.0.0.1 is already in use" + (f", {holder}" if holder else "")
                            + "; choose a free port for the candidates")
        gpu = Gpu(args.gpu)
    except BaseException:
        release_pidfile(pidfile)
        raise
    if args.daemon:
        try:
            daemonize(log_path, pidfile, args.out)
        except BaseException:
            release_pidfile(pidfile)
            raise
    tuner = Tuner(args, profiles, sets, gpu, server_cmd, pidfile, log_path if args.daemon else None, stale)
    for entry in tuner.run["config"]["sets"]:
        entry["checked"] = set_checks[entry["name"]]
    signal.signal(signal.SIGTERM, tuner.on_signal)
    signal.signal(signal.SIGINT, tuner.on_signal)
    try:
        return tuner.execute()
    finally:
        release_pidfile(pidfile)
        stop_watchdog(tuner.watchdog)


def claim_pidfile_if_needed(args: argparse.Namespace, pidfile: Path, log_path: Path) -> str | None:
    """The guard runs first, so a second run for a live DIR names the running tuner, not the existing DIR."""
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    return claim_pidfile(pidfile, pidfile_record(args.out, log_path if args.daemon else None))


if __name__ == "__main__":
    run_main(main)
