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
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from openjev.common import (PRODUCTION_PORT, REPO_ROOT, UserError, atomic_write_json, environment_receipt, openjev_root,
                     port_is_free, run_main, utc_now)

APP_DIR = Path(__file__).resolve().parent
BENCH_SCRIPT = APP_DIR / "bench_classify_v100.py"
SERVER_CMD_ENV = "OPENJEV_TUNE_SERVER_CMD"
DEFAULT_SERVER_CMD = APP_DIR / "serve_sglang_v100.sh"
DEFAULT_PROFILES = "fcfs:8,fcfs:16,fcfs:32,lpm:16"
SCHEDULE_POLICIES = ("lpm", "fcfs", "random", "dfs-weight", "lof", "priority", "routing-key")
MODES = ("cold", "warm")
PHASES = ("waiting-idle", "starting-server", "benchmarking", "stopping-server", "done", "failed", "interrupted",
          "tuner-died")
RESERVED_ENV = ("CUDA_VISIBLE_DEVICES", "MAX_RUNNING_REQUESTS", "SCHEDULE_POLICY")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ENV_KEY_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
# Environment keys of the server process worth keeping in server_command.json (never the whole env).
RECORDED_ENV_PREFIXES = ("CUDA_", "SGLANG_", "OPENJEV_", "TILELANG_", "TRITON_", "FLASHINFER_", "TORCH_", "NCCL_",
                         "PYTORCH_", "HF_", "TRANSFORMERS_")
RECORDED_ENV_KEYS = ("MAX_RUNNING_REQUESTS", "SCHEDULE_POLICY", "CONTEXT_LENGTH", "MEM_FRACTION_STATIC",
                     "MAMBA_FULL_MEMORY_RATIO", "PYTHONPATH", "PATH", "CC", "CXX", "CUDAHOSTCXX", "LD_LIBRARY_PATH")
START_TIME_TOLERANCE = 0.05  # s; process start times come from clock ticks (10 ms)


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
    p.add_argument("--batch-size", type=int, default=32, help="bench: inputs per request (default: 32)")
    p.add_argument("--workers", type=int, default=4, help="bench: client workers (default: 4)")
    p.add_argument("--repetitions", type=int, default=3, help="bench: measured passes after the initial one (default: 3)")
    p.add_argument("--truncate", type=int, default=4096, help="bench: tokens kept per row (default: 4096)")
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
@dataclass
class Profile:
    name: str
    schedule_policy: str
    max_running_requests: int
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "schedule_policy": self.schedule_policy,
                "max_running_requests": self.max_running_requests, "extra_args": list(self.extra_args),
                "env": dict(self.env)}


def _slug(text: str) -> str:
    return re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9.]+", "-", text.lower())).strip("-.")


def default_profile_name(policy: str, n: int, extra_args: Sequence[str], env: dict[str, str]) -> str:
    parts = [policy, str(n)]
    for a in extra_args:
        parts.append("no-radix" if a == "--disable-radix-cache" else _slug(a))
    parts += [_slug(f"{k}-{v}") for k, v in env.items()]
    return "-".join(p for p in parts if p)[:64].rstrip("-.")


def make_profile(name: str | None, policy: Any, n: Any, extra_args: Any = (), env: Any = None, where: str = "") -> Profile:
    where = where or "profile"
    if not isinstance(policy, str) or policy not in SCHEDULE_POLICIES:
        raise UserError(f"{where}: schedule policy must be one of {', '.join(SCHEDULE_POLICIES)}, got {policy!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserError(f"{where}: max running requests must be a positive integer, got {n!r}")
    if not isinstance(extra_args, (list, tuple)) or not all(isinstance(a, str) and a for a in extra_args):
        raise UserError(f"{where}: extra_args must be a list of non-empty strings")
    env = {} if env is None else env
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise UserError(f"{where}: env must be an object of string values")
    for k in env:
        if not ENV_KEY_RE.match(k):
            raise UserError(f"{where}: environment variable name {k!r} is not valid")
        if k in RESERVED_ENV:
            raise UserError(f"{where}: {k} is set by the tuner (--gpu, the profile's policy and cap); remove it")
    name = name if name is not None else default_profile_name(policy, n, extra_args, env)
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise UserError(f"{where}: profile name {name!r} must match {NAME_RE.pattern} (it names a directory)")
    return Profile(name, policy, n, list(extra_args), dict(env))


def parse_profile_item(item: str) -> Profile:
    """One `[NAME=]POLICY:N[+MOD...]` item of --profiles (syntax in the module docstring)."""
    text = item.strip()
    name = None
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)=(.*)$", text)
    if m:
        name, text = m.group(1), m.group(2)
    head, *mods = text.split("+")
    m = re.match(r"^([a-z][a-z-]*):(\d+)$", head.strip())
    if not m:
        raise UserError(f"profile {item!r}: expected [NAME=]POLICY:N[+MOD...], e.g. fcfs:8 or lpm:16+no-radix")
    extra_args: list[str] = []
    env: dict[str, str] = {}
    for mod in (x.strip() for x in mods):
        if mod == "no-radix":
            extra_args.append("--disable-radix-cache")
        elif mod.startswith("--") and len(mod) > 2:
            extra_args.append(mod)
        elif "=" in mod and ENV_KEY_RE.match(mod.split("=", 1)[0]):
            k, v = mod.split("=", 1)
            env[k] = v
        else:
            raise UserError(f"profile {item!r}: modifier {mod!r} is not no-radix, --FLAG[=VALUE] or KEY=VALUE")
    return make_profile(name, m.group(1), int(m.group(2)), extra_args, env, where=f"profile {item!r}")


def parse_profiles(spec: str) -> list[Profile]:
    """--profiles: the compact list syntax, or the path of a JSON file (a list of profile objects)."""
    spec = spec.strip()
    if not spec:
        raise UserError("--profiles is empty")
    path = Path(spec).expanduser()
    if spec.endswith(".json") or path.is_file():
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"profiles file {path} not found") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"profiles file {path} is not readable JSON: {exc}") from None
        if not isinstance(data, list) or not data:
            raise UserError(f"profiles file {path} must hold a non-empty JSON list of profile objects")
        profiles = []
        allowed = {"name", "schedule_policy", "max_running_requests", "extra_args", "env"}
        for i, obj in enumerate(data):
            where = f"profiles file {path} entry {i}"
            if not isinstance(obj, dict):
                raise UserError(f"{where} is not an object")
            if unknown := sorted(set(obj) - allowed):
                raise UserError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")
            profiles.append(make_profile(obj.get("name"), obj.get("schedule_policy"), obj.get("max_running_requests"),
                                         obj.get("extra_args", []), obj.get("env"), where))
    else:
        profiles = [parse_profile_item(x) for x in spec.split(",") if x.strip()]
    seen: set[str] = set()
    for p in profiles:
        if p.name in seen:
            raise UserError(f"profile name {p.name!r} appears twice; give one a name (NAME=POLICY:N...)")
        seen.add(p.name)
    return profiles


@dataclass(frozen=True)
class InputSet:
    name: str
    inputs: Path
    tokens: Path
    reference: Path

    def to_json(self) -> dict:
        return {"name": self.name, "inputs": str(self.inputs), "tokens": str(self.tokens), "reference": str(self.reference)}


def parse_set(text: str) -> InputSet:
    """--set NAME=INPUTS.jsonl,TOKENS.jsonl,REFDIR (paths made absolute; existence checked later)."""
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,31})=([^,]+),([^,]+),([^,]+)$", text.strip())
    if not m:
        raise UserError(f"--set {text!r}: expected NAME=INPUTS.jsonl,TOKENS.jsonl,REFDIR (NAME of [A-Za-z0-9._-])")
    name, *paths = m.groups()
    inputs, tokens, ref = (Path(p.strip()).expanduser().absolute() for p in paths)
    return InputSet(name, inputs, tokens, ref)


def check_set_files(s: InputSet, truncate: int) -> dict:
    """The bench's own pre-request checks (hashes, ids, shapes, truncation), before any server starts."""
    import bench_classify_v100 as bench

    ns = argparse.Namespace(inputs=s.inputs, tokens=s.tokens, reference=s.reference, truncate=truncate)
    try:
        data = bench.load_run_data(ns)
    except UserError as exc:
        raise UserError(f"--set {s.name}: {exc}") from None
    return {"rows": len(data.row_ids), "inputs_sha256": data.inputs_sha, "tokens_sha256": data.tokens_sha,
            "ids_sha256": data.ids_sha, "reference_logits_sha256": data.ref_npy_sha}


# ================================================================ idle wait (pure)
@dataclass(frozen=True)
class IdleDecision:
    state: str  # "idle" (waited enough) | "waiting" | "timeout"
    idle_for: float  # seconds the GPU has been seen without compute processes, up to now
    waited: float  # seconds since the wait began


def idle_decision(samples: Sequence[tuple[float, int | None]], *, start: float, now: float,
                  idle_seconds: float, max_wait: float) -> IdleDecision:
    """Decide the idle wait from NVML samples [(time, number of compute processes or None)].

    A sample of None (NVML failed) counts as busy: only observed idleness counts. The GPU has
    been idle since the first idle sample after the last busy one; it is idle enough when that
    lasted `idle_seconds` (0: one idle sample suffices). Timeout when `max_wait` has passed and
    it is not idle enough; an idle verdict wins over a timeout at the same instant.
    """
    waited = max(0.0, now - start)
    idle_since = None
    for t, n in samples:
        if n is None or n > 0:
            idle_since = None
        elif idle_since is None:
            idle_since = t
    idle_for = max(0.0, now - idle_since) if idle_since is not None else 0.0
    if idle_since is not None and idle_for >= idle_seconds:
        return IdleDecision("idle", idle_for, waited)
    if waited >= max_wait:
        return IdleDecision("timeout", idle_for, waited)
    return IdleDecision("waiting", idle_for, waited)


# ================================================================ receipts and summary (pure)
def headline(receipt: dict | None, mode: str) -> dict:
    """Headline figures of one receipt of app/bench_classify_v100.py (kind "openjev-bench").

    Its figures live under receipt[mode] ("cold" with --cold-cache, else "warm"): timing.median_wall_s
    (median measured pass wall time), timing.pairs_per_s, timing.batch_latency_s.{p50,p99},
    agreement_final, audit.failed; top level: valid, complete, exit_code, exclusive.valid, outputs.
    """
    if not isinstance(receipt, dict):
        return {}
    sec = receipt.get(mode) if isinstance(receipt.get(mode), dict) else {}
    timing = sec.get("timing") or {}
    lat = timing.get("batch_latency_s") or {}
    ag = sec.get("agreement_final") or {}
    audit = sec.get("audit") or {}
    excl = receipt.get("exclusive")
    outputs = receipt.get("outputs") or {}
    out = {
        "receipt_kind": receipt.get("kind"),
        "receipt_mode": receipt.get("mode"),
        "machine": receipt.get("machine"),
        "valid": receipt.get("valid"),
        "complete": receipt.get("complete"),
        "receipt_exit_code": receipt.get("exit_code"),
        "reasons": receipt.get("reasons") or [],
        "rows": (receipt.get("inputs") or {}).get("rows"),
        "passes_done": sec.get("passes_done"),
        "passes_planned": sec.get("passes_planned"),
        "median_pass_s": timing.get("median_wall_s"),
        "initial_pass_s": timing.get("initial_pass_wall_s"),
        "pass_walls_s": timing.get("wall_s"),
        "pairs_per_s": timing.get("pairs_per_s"),
        "batch_latency_p50_s": lat.get("p50"),
        "batch_latency_p99_s": lat.get("p99"),
        "max_abs_dp_e": ag.get("max_abs_dp_e"),
        "argmax_changes": ag.get("argmax_changes_count"),
        "audit_passed": (not audit["failed"]) if isinstance(audit.get("failed"), bool) else None,
        "audit_failures": audit.get("failures_total"),
        "audit_ties": audit.get("ties_total"),
        "audit_groups": audit.get("groups"),
        "exclusivity_valid": excl.get("valid") if isinstance(excl, dict) else None,
        "outputs": {k: v.get("file") for k, v in outputs.items() if isinstance(v, dict)},
    }
    return {k: v for k, v in out.items() if v is not None}


def measurement_failures(m: dict) -> list[str]:
    """Every check of one measurement that did not hold (empty: all held)."""
    where = f"{m['profile']}/{m['set']}/{m['mode']}"
    bad = []
    if m.get("exit_code") != 0:
        bad.append(f"{where}: bench exit {m.get('exit_code')}{' (' + m['error'] + ')' if m.get('error') else ''}")
    if not m.get("receipt_found"):
        bad.append(f"{where}: no bench receipt")
        return bad
    if m.get("receipt_kind") != "openjev-bench" or m.get("receipt_mode") != m["mode"]:
        bad.append(f"{where}: receipt is not an openjev-bench {m['mode']} receipt")
    if m.get("valid") is not True:
        bad.append(f"{where}: receipt not valid" + (f" ({m['reasons'][0]})" if m.get("reasons") else ""))
    if m.get("complete") is not True:
        bad.append(f"{where}: receipt incomplete")
    if m.get("audit_passed") is False:
        bad.append(f"{where}: group audit failed")
    if m.get("exclusivity_valid") is False or (m.get("exclusivity_checked") and m.get("exclusivity_valid") is not True):
        bad.append(f"{where}: GPU exclusivity invalid or not recorded")
    if not isinstance(m.get("median_pass_s"), (int, float)):
        bad.append(f"{where}: no median pass wall time in the receipt")
    return bad


def summarize(profiles: Sequence[dict], set_names: Sequence[str], *, exclusivity_checked: bool,
              exclusivity_note: str | None = None) -> dict:
    """Comparison table, fastest profiles and every check, from the profile records of run.json."""
    order = [p["name"] for p in profiles]
    rows, failures = [], []
    cell: dict[tuple[str, str, str], dict] = {}
    for p in profiles:
        if p.get("status") != "done":
            failures.append(f"{p['name']}: {p.get('status', 'pending')}" + (f" ({p['failure']})" if p.get("failure") else ""))
        for m in p.get("measurements", []):
            bad = measurement_failures(m)
            failures += bad
            row = {"profile": p["name"], "set": m["set"], "mode": m["mode"], "median_pass_s": m.get("median_pass_s"),
                   "pairs_per_s": m.get("pairs_per_s"), "exit_code": m.get("exit_code"), "checks_ok": not bad,
                   "receipt": m.get("receipt")}
            rows.append(row)
            cell[(p["name"], m["set"], m["mode"])] = row

    def ok_median(name: str, s: str, mode: str) -> float | None:
        r = cell.get((name, s, mode))
        return r["median_pass_s"] if r and r["checks_ok"] and isinstance(r["median_pass_s"], (int, float)) else None

    per_set: dict[str, dict[str, Any]] = {}
    for s in set_names:
        per_set[s] = {}
        for mode in MODES:
            cands = [(ok_median(n, s, mode), i, n) for i, n in enumerate(order) if ok_median(n, s, mode) is not None]
            per_set[s][mode] = ({"profile": min(cands)[2], "median_pass_s": min(cands)[0]} if cands else None)

    eligible, ineligible = [], {}
    for i, p in enumerate(profiles):
        medians = {mode: [ok_median(p["name"], s, mode) for s in set_names] for mode in MODES}
        if p.get("status") != "done":
            ineligible[p["name"]] = f"profile {p.get('status', 'pending')}"
        elif any(v is None for mode in MODES for v in medians[mode]):
            ineligible[p["name"]] = "a measurement is missing or failed a check"
        else:
            eligible.append((sum(medians["warm"]), sum(medians["cold"]), i, p["name"]))
    overall = None
    if eligible:
        warm_sum, cold_sum, _, name = min(eligible)
        cold_best = min(eligible, key=lambda e: (e[1], e[0], e[2]))
        overall = {"profile": name, "warm_sum_s": warm_sum, "cold_sum_s": cold_sum,
                   "cold_rule_profile": cold_best[3], "cold_rule_cold_sum_s": cold_best[1]}
    checks_ok = not failures
    return {
        "kind": "openjev-tune-summary",
        "schema_version": 1,
        "promoted": None,
        "note": "comparison only: no profile is promoted; the production endpoint is unchanged",
        "profiles": [{"name": p["name"], "status": p.get("status"), "failure": p.get("failure"),
                      "config": p.get("profile")} for p in profiles],
        "sets": list(set_names),
        "table": rows,
        "fastest": {
            "rule": ("per set and mode: lowest median pass wall time among measurements whose checks held; overall: "
                     "lowest sum of warm medians over all sets among profiles with every measurement present and "
                     "every check held (ties: lower cold sum, then profile order); cold_rule_profile: the same by "
                     "the sum of cold medians"),
            "per_set": per_set,
            "overall": overall,
            "ineligible": ineligible,
        },
        "checks": {"all_passed": checks_ok, "failures": failures, "exclusivity_checked": exclusivity_checked,
                   "exclusivity_note": exclusivity_note},
    }


def format_table(summary: dict) -> str:
    """The comparison table printed at the end (plain text, fixed width)."""
    sets = summary["sets"]
    cols = [f"{s} {mode}" for s in sets for mode in MODES]
    cell = {(r["profile"], r["set"], r["mode"]): r for r in summary["table"]}
    header = ["profile", "status", *cols, "warm sum", "checks"]
    lines = []
    for p in summary["profiles"]:
        vals, warm, all_ok, missing = [], 0.0, p["status"] == "done", False
        for s in sets:
            for mode in MODES:
                r = cell.get((p["name"], s, mode))
                if r is None or not isinstance(r["median_pass_s"], (int, float)):
                    vals.append("-")
                    missing = True
                    all_ok = False
                    continue
                vals.append(f"{r['median_pass_s']:.3f}" + ("" if r["checks_ok"] else "!"))
                all_ok &= r["checks_ok"]
                if mode == "warm":
                    warm += r["median_pass_s"]
        warm_txt = "-" if missing else f"{warm:.3f}"
        lines.append([p["name"], p["status"] or "pending", *vals, warm_txt, "ok" if all_ok else "FAILED"])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    fmt = lambda row: "  ".join(str(x).ljust(w) if i < 2 else str(x).rjust(w) for i, (x, w) in enumerate(zip(row, widths)))  # noqa: E731
    out = ["median pass wall time, seconds (lower is better; '!' = a check failed, '-' = not measured)",
           fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in lines), ""]
    fastest = summary["fastest"]
    for s in sets:
        for mode in MODES:
            f = fastest["per_set"][s][mode]
            out.append(f"fastest {s} {mode}: " + (f"{f['profile']} ({f['median_pass_s']:.3f} s)" if f else "none (no valid measurement)"))
    ov = fastest["overall"]
    if ov:
        out.append(f"fastest overall (sum of warm medians): {ov['profile']} ({ov['warm_sum_s']:.3f} s); "
                   f"by sum of cold medians: {ov['cold_rule_profile']} ({ov['cold_rule_cold_sum_s']:.3f} s)")
    else:
        out.append("fastest overall: none (no profile completed every measurement with every check held)")
    checks = summary["checks"]
    if not checks["exclusivity_checked"]:
        out.append(f"GPU exclusivity: NOT checked ({checks.get('exclusivity_note') or 'NVML unavailable'})")
    if checks["all_passed"]:
        out.append("every correctness check held (bench exits 0, receipts valid and complete, group audits passed"
                   + (", GPU exclusive)" if checks["exclusivity_checked"] else ")"))
    else:
        out.append(f"CHECKS FAILED ({len(checks['failures'])}):")
        out += [f"  - {f}" for f in checks["failures"]]
    out.append("nothing was promoted: choose a profile by hand, from these receipts")
    return "\n".join(out)


# ================================================================ plot
def write_plot(summary: dict, path: Path, title: str) -> None:
    """Grouped bars: one panel per mode, input sets on x, one bar per profile, values annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets, profiles = summary["sets"], [p["name"] for p in summary["profiles"]]
    cell = {(r["profile"], r["set"], r["mode"]): r for r in summary["table"]}
    fig, axes = plt.subplots(1, len(MODES), figsize=(max(9.0, 4 + 0.9 * len(sets) * len(profiles)), 5.5),
                             squeeze=False)
    width = 0.8 / max(1, len(profiles))
    for ax, mode in zip(axes[0], MODES):
        top = max([r["median_pass_s"] for r in summary["table"]
                   if r["mode"] == mode and isinstance(r["median_pass_s"], (int, float))] or [1.0])
        for j, name in enumerate(profiles):
            for i, s in enumerate(sets):
                x = i - 0.4 + width * (j + 0.5)
                r = cell.get((name, s, mode))
                v = r["median_pass_s"] if r and isinstance(r["median_pass_s"], (int, float)) else None
                if v is None:
                    ax.text(x, top * 0.02, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
                    continue
                ok = r["checks_ok"]
                ax.bar(x, v, width, color=f"C{j}", hatch=None if ok else "//", edgecolor="black" if not ok else None,
                       label=name if i == 0 else None)
                ax.text(x, v, f"{v:.2f}" + ("" if ok else "!"), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(sets)))
        ax.set_xticklabels(sets)
        ax.set_title("cold: prefix cache cleared before each pass" if mode == "cold"
                     else "warm: repeated inputs, warm prefix cache", fontsize=10)
        ax.set_ylabel("median pass wall time (s), lower is better")
        ax.set_ylim(0, top * 1.18)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        h, lab = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lab):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8)
    fig.suptitle(title + "\n('!' / hatched: a correctness check failed; nothing promoted)", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 0.93))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


# ================================================================ processes
def process_start_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


def process_alive(pid: int, start_time: float | None) -> bool:
    """True when `pid` is a live (non-zombie) process started at `start_time` (None: any start time)."""
    import psutil

    try:
        p = psutil.Process(pid)
        if start_time is not None and abs(p.create_time() - start_time) > START_TIME_TOLERANCE:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ProcessLookupError):
        return False
    except psutil.AccessDenied:
        return True


def describe_process(pid: int) -> str:
    import psutil

    try:
        p = psutil.Process(pid)
        return f"pid {pid} ({p.name()}: {' '.join(p.cmdline())[:120]})"
    except (psutil.Error, ProcessLookupError):
        return f"pid {pid}"


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    log_path: Path
    tree: dict[int, float] = field(default_factory=dict)  # pid -> start time, every process seen in its tree

    @property
    def pid(self) -> int:
        return self.proc.pid

    def track(self) -> None:
        """Add the server's current descendants (kept after they are reparented)."""
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                self.tree.setdefault(p.pid, p.create_time())
            except psutil.Error:
                pass

    def alive_tree(self) -> list[int]:
        return [pid for pid, st in self.tree.items() if process_alive(pid, st)]


def log_tail(path: Path, lines: int = 40, max_chars: int = 6000) -> str:
    try:
        data = path.read_bytes()[-64 * 1024:].decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])[-max_chars:]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process_tree(handle: ServerHandle, timeout: float) -> dict:
    """SIGTERM the server's process group, SIGKILL after `timeout`; report what (if anything) is left."""
    t0 = time.monotonic()
    handle.track()
    already = handle.proc.poll()
    sent = []
    if already is None or handle.alive_tree():
        _signal_group(handle.pid, signal.SIGTERM)
        sent.append("SIGTERM")
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        handle.proc.poll()
        if handle.proc.returncode is not None and not handle.alive_tree():
            break
        time.sleep(0.1)
    else:
        _signal_group(handle.pid, signal.SIGKILL)
        for pid in handle.alive_tree():  # members that left the group (setsid) are killed one by one
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        sent.append("SIGKILL")
        end = time.monotonic() + 15
        while time.monotonic() < end and (handle.proc.poll() is None or handle.alive_tree()):
            time.sleep(0.1)
    try:
        code = handle.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        code = None
    left = handle.alive_tree()
    return {"signals": sent, "exit_code": code, "exited_before_stop": already is not None,
            "seconds": round(time.monotonic() - t0, 3), "tree_pids": sorted(handle.tree),
            "left_running": [describe_process(p) for p in left], "clean": not left and code is not None}


# ================================================================ children that never outlive the tuner
# Three layers, so that no server or bench of a run survives its tuner, however the tuner ends:
#  1. each child (server launcher, bench) asks the kernel for a parent-death signal (PR_SET_PDEATHSIG, set in
#     the child between fork and exec; it survives the launcher's exec): SIGTERM for the server (it shuts down
#     its own children), SIGKILL for the bench (a bench must never write a receipt into a dead run);
#  2. every child gets RUN_ENV=<run id> and OUT_ENV=<DIR> in its environment, inherited by every process it
#     starts (SGLang's scheduler and detokenizer, a setsid'd helper...), which is how a process of a run is
#     recognised later, by the watchdog, by --status and by the port check of a later invocation;
#  3. a watchdog process (its own session) holds the read end of a pipe whose write end only the tuner holds:
#     EOF without the tuner's "done" means the tuner died (SIGKILL, OOM killer...). It then SIGTERMs every
#     process carrying the run id, SIGKILLs what is left after WATCHDOG_GRACE s, and records the death in
#     run.json (phase "tuner-died").
RUN_ENV = "OPENJEV_TUNE_RUN"
OUT_ENV = "OPENJEV_TUNE_OUT"
WATCHDOG_FLAG = "--internal-watchdog"
WATCHDOG_GRACE = 3.0
FINAL_PHASES = ("done", "failed", "interrupted", "tuner-died")
PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child_preexec(sig: int, parent_pid: int):
    """preexec_fn of a child: parent-death signal `sig`; if the parent already died (before prctl), die now."""
    def preexec() -> None:
        _set_parent_death_signal(sig)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sig)
    return preexec


def run_processes(run_id: str | None, recorded: Sequence[dict] = ()) -> list[dict]:
    """Live processes of a run: every process whose environment carries RUN_ENV=run_id, and every recorded
    child {"pid", "start_time", "role"} still alive with that start time. [{pid, role, cmdline}], by pid."""
    import psutil

    found: dict[int, dict] = {}
    me = os.getpid()
    if run_id:
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            if p.pid == me or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                if p.environ().get(RUN_ENV) != run_id:
                    continue
            except (psutil.Error, OSError):
                continue
            found[p.pid] = {"pid": p.pid, "role": "process of the run", "cmdline": " ".join(p.info["cmdline"] or [])}
    for c in recorded:
        pid = c.get("pid")
        if isinstance(pid, int) and process_alive(pid, c.get("start_time")):
            cmd = describe_process(pid)
            found[pid] = {"pid": pid, "role": c.get("role") or "process of the run", "cmdline": cmd}
    return [found[k] for k in sorted(found)]


def kill_command(pids: Sequence[int]) -> str:
    ids = " ".join(str(p) for p in pids)
    return f"kill -TERM {ids}; sleep 5; kill -KILL {ids} 2>/dev/null"


def inspect_run(out: Path) -> dict:
    """What DIR/run.json says and what is true now: {"run", "tuner_alive", "finished", "processes", "text"}."""
    try:
        run = json.loads((out / "run.json").read_text())
        if not isinstance(run, dict):
            raise ValueError("not an object")
    except FileNotFoundError:
        return {"run": None, "text": f"{out} holds no run.json (not a tuner run)"}
    except (OSError, ValueError) as exc:
        return {"run": None, "text": f"{out}/run.json is unreadable ({exc})"}
    tuner = run.get("tuner") or {}
    pid, st = tuner.get("pid"), tuner.get("start_time")
    same_host = tuner.get("host") in (None, socket.gethostname())
    alive = isinstance(pid, int) and same_host and process_alive(pid, st)
    finished = run.get("exit_code") is not None or run.get("phase") in FINAL_PHASES
    procs = run_processes(run.get("run_id"), run.get("children") or []) if same_host else []
    procs = [p for p in procs if p["pid"] != pid]
    phase = run.get("phase")
    if not same_host:
        state = f"run {out} was started on host {tuner.get('host')}; its processes cannot be checked from here"
    elif alive:
        state = f"run {out} is live: tuner pid {pid} (started {tuner.get('started_at')}) is running, phase {phase!r}"
    elif finished and phase != "tuner-died":
        state = (f"run {out} finished: phase {phase!r}, exit code {run.get('exit_code')} at {run.get('finished_at')}; "
                 f"tuner pid {pid} has ended")
    else:
        died = run.get("tuner_died") or {}
        state = (f"run {out}: its tuner pid {pid} (started {tuner.get('started_at')}) is gone"
                 + (f" (seen by the watchdog at {died.get('detected_at')})" if died.get("detected_at") else
                    f" without finishing (run.json still says phase {phase!r}, last update {run.get('updated_at')})"))
    if procs:
        state += ("; still running: " + ", ".join(f"pid {p['pid']} ({p['role']}: {p['cmdline'][:100]})" for p in procs)
                  + f"; end them with: {kill_command([p['pid'] for p in procs])}")
    elif not alive:
        state += "; no process of this run is running"
    return {"run": run, "tuner_alive": alive, "finished": finished, "processes": procs, "text": state}


def port_holders(port: int) -> list[int]:
    """PIDs listening on 127.0.0.1/any :port (where this user may see them)."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    return sorted({c.pid for c in conns if c.pid and c.status == psutil.CONN_LISTEN and c.laddr
                   and c.laddr.port == port})


def describe_port_holder(port: int) -> str:
    """`port P ... is in use` plus, for a process of a tuner run, that run's state and the command that ends it."""
    import psutil

    parts = []
    for pid in port_holders(port):
        try:
            env = psutil.Process(pid).environ()
        except (psutil.Error, OSError):
            env = {}
        if env.get(OUT_ENV):
            info = inspect_run(Path(env[OUT_ENV]))
            parts.append(f"held by {describe_process(pid)}, a process of tuner run {env[OUT_ENV]}: {info['text']}"
                         + ("" if "end them with" in info["text"] else f"; end it with: {kill_command([pid])}"))
        else:
            parts.append(f"held by {describe_process(pid)}")
    return "; ".join(parts)


def start_watchdog(out: Path, run_id: str, pidfile: Path) -> tuple[subprocess.Popen, int] | None:
    """The watchdog of layer 3; returns (process, write end of its pipe) or None if it cannot start."""
    r, w = os.pipe()  # both ends close-on-exec: no server or bench inherits the write end
    try:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), WATCHDOG_FLAG, str(out), run_id,
                                 str(os.getpid()), str(pidfile)], stdin=r, stdout=subprocess.DEVNULL,
                                start_new_session=True, cwd=REPO_ROOT)
    except OSError as exc:
        os.close(w)
        say(f"warning: no watchdog ({exc}); children still get a parent-death signal")
        return None
    finally:
        os.close(r)
    return proc, w


def stop_watchdog(wd: tuple[subprocess.Popen, int] | None) -> None:
    """Tell the watchdog the tuner ended normally (its cleanup is done) and let it exit."""
    if wd is None:
        return
    proc, w = wd
    try:
        os.write(w, b"done")
    except OSError:
        pass
    os.close(w)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def watchdog_main(argv: Sequence[str]) -> int:
    """Layer 3: wait for the tuner's end; after an abnormal one, end every process of the run and record it."""
    out, run_id, tuner_pid, pidfile = Path(argv[0]), argv[1], int(argv[2]), Path(argv[3])
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    data = b""
    while chunk := os.read(0, 64):
        data += chunk
    if data == b"done":
        return 0
    t0 = utc_now()
    procs = run_processes(run_id)
    for p in procs:
        try:
            os.kill(p["pid"], signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + WATCHDOG_GRACE
    while time.monotonic() < deadline and run_processes(run_id):
        time.sleep(0.1)
    killed = run_processes(run_id)
    for p in killed:
        try:
            os.kill(p["pid"], signal.SIGKILL)
        except OSError:
            pass
    end = time.monotonic() + 5
    while time.monotonic() < end and run_processes(run_id):
        time.sleep(0.1)
    left = run_processes(run_id)
    try:
        run = json.loads((out / "run.json").read_text())
        if run.get("exit_code") is None and run.get("phase") not in FINAL_PHASES:
            run["tuner_died"] = {"detected_at": t0, "by": f"watchdog pid {os.getpid()}", "phase_at_death": run["phase"],
                                 "stopped": procs, "needed_sigkill": [p["pid"] for p in killed], "left_running": left}
            for rec in run.get("profiles") or []:
                if rec.get("status") == "running":
                    rec.update(status="interrupted", failure=f"tuner pid {tuner_pid} died (seen by the watchdog)")
            run.update(phase="tuner-died", phase_since=t0, server_pid=None, finished_at=utc_now(), updated_at=utc_now(),
                       error=f"tuner pid {tuner_pid} died without finishing (no exit status; e.g. SIGKILL)")
            atomic_write_json(out / "run.json", run)
    except (OSError, ValueError):
        pass
    try:
        if (read_pidfile(pidfile) or {}).get("pid") == tuner_pid:
            pidfile.unlink(missing_ok=True)
    except UserError:
        pass
    print(f"[tune watchdog] tuner pid {tuner_pid} died; stopped {len(procs)} process(es) of run {out}"
          + (f"; LEFT RUNNING: {[p['pid'] for p in left]}" if left else ""), file=sys.stderr, flush=True)
    return 0


# ================================================================ NVML
class Gpu:
    """NVML view of one physical GPU; `available` False (with `reason`) where NVML cannot be used.

    The constructor checks the index and shuts NVML down again, so a daemon opens its own NVML
    session after the fork (`compute_processes` initialises lazily in the process that samples).
    """

    def __init__(self, index: int):
        self.index = index
        self.available = False
        self.reason: str | None = None
        self.info: dict = {"index": index}
        self._handle = None
        self._graphics = True
        try:
            import pynvml
        except ImportError:
            self.reason = "pynvml (nvidia-ml-py) is not installed"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self.reason = f"NVML unavailable: {exc}"
            return
        try:
            count = pynvml.nvmlDeviceGetCount()
            if not 0 <= index < count:
                raise UserError(f"--gpu {index}: NVML sees {count} GPU(s) (indices 0..{count - 1})")
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.available = True
            for key, get in (("name", pynvml.nvmlDeviceGetName), ("uuid", pynvml.nvmlDeviceGetUUID),
                             ("pci_bus_id", lambda h: pynvml.nvmlDeviceGetPciInfo(h).busId),
                             ("driver", lambda h: pynvml.nvmlSystemGetDriverVersion())):
                try:
                    self.info[key] = _s(get(h))
                except pynvml.NVMLError:
                    pass
        finally:
            pynvml.nvmlShutdown()

    def compute_processes(self) -> list[dict] | None:
        """Compute processes on the GPU now; None when the sample failed."""
        if not self.available:
            return None
        import pynvml

        try:
            if self._handle is None:
                pynvml.nvmlInit()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            procs = [(p, "compute") for p in pynvml.nvmlDeviceGetComputeRunningProcesses(self._handle)]
            if self._graphics:
                try:  # as the bench's exclusivity monitor: graphics contexts hold the GPU too
                    procs += [(p, "graphics") for p in pynvml.nvmlDeviceGetGraphicsRunningProcesses(self._handle)]
                except pynvml.NVMLError_NotSupported:
                    self._graphics = False
        except pynvml.NVMLError:
            return None
        return [{"pid": p.pid, "kind": kind, "used_gpu_memory": getattr(p, "usedGpuMemory", None)} for p, kind in procs]


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# ================================================================ pid file
def pid_paths(out: Path) -> tuple[Path, Path]:
    return out.with_name(out.name + ".pid"), out.with_name(out.name + ".log")


def read_pidfile(path: Path) -> dict | None:
    """The pid file as {"pid", "start_time", ...}: JSON, or two lines `pid` / `start_time`. None if absent."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        if isinstance(data, dict) and isinstance(data.get("pid"), int):
            return data
    except json.JSONDecodeError:
        pass
    lines = text.split()
    try:
        return {"pid": int(lines[0]), "start_time": float(lines[1])}
    except (IndexError, ValueError):
        raise UserError(f"pid file {path} is unreadable (neither JSON nor 'pid' and 'start_time' lines); "
                        "remove it if no tuner is running for this directory") from None


def pidfile_record(out: Path, log: Path | None) -> dict:
    return {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "host": socket.gethostname(),
            "started_at": utc_now(), "out": str(out), "log": str(log) if log else None, "argv": sys.argv}


def claim_pidfile(path: Path, record: dict) -> str | None:
    """Create the pid file atomically; refuse while its process lives. Returns a note on a replaced stale file."""
    note = None
    for _ in range(3):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        try:
            os.link(tmp, path)  # atomic create-if-absent
            return note
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        old = read_pidfile(path)
        if old is None:
            continue
        if old.get("host") not in (None, socket.gethostname()):
            raise UserError(f"pid file {path} was written on host {old['host']}; cannot check its process from here "
                            "(remove it if no tuner is running)")
        if process_alive(old["pid"], old.get("start_time")):
            raise UserError(f"another tuner is running for {path.with_suffix('')} (pid {old['pid']}, started "
                            f"{old.get('started_at', 'at ' + str(old.get('start_time')))}; pid file {path}); "
                            "wait for it or stop it with SIGTERM")
        why = "is gone" if process_start_time(old["pid"]) is None else "belongs to another process (start time differs)"
        note = f"stale pid file {path}: pid {old['pid']} {why}; replacing it"
        print(f"{Path(sys.argv[0]).name}: warning: {note}", file=sys.stderr, flush=True)
        path.unlink(missing_ok=True)
    raise UserError(f"could not create pid file {path} (another tuner keeps creating it?)")


def release_pidfile(path: Path) -> None:
    try:
        rec = read_pidfile(path)
    except UserError:
        return
    if rec and rec.get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def rewrite_pidfile(path: Path, record: dict) -> None:
    atomic_write_json(path, record)


def daemonize(log_path: Path, pidfile: Path, out: Path) -> None:
    """Double fork; the parent prints where the daemon logs and exits 0 once the pid file names it."""
    r, w = os.pipe()
    first = os.fork()
    if first > 0:  # the invoking process
        os.close(w)
        with os.fdopen(r) as pipe:
            msg = pipe.read().strip()
        os.waitpid(first, 0)
        if not msg.startswith("ok "):
            raise UserError(f"the daemon did not start: {msg or 'no word from it'}; see {log_path}")
        print(f"tuner daemon pid {msg[3:]}; log {log_path}; pid file {pidfile}; live record {out / 'run.json'}",
              flush=True)
        os._exit(0)
    os.close(r)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    try:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(null_fd)
        os.close(log_fd)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        rewrite_pidfile(pidfile, pidfile_record(out, log_path))
        os.write(w, f"ok {os.getpid()}\n".encode())
    except Exception as exc:  # noqa: BLE001 - told to the waiting parent, then the daemon ends
        os.write(w, f"error {exc}\n".encode())
        os._exit(1)
    finally:
        os.close(w)


# ================================================================ the run
class Interrupted(BaseException):  # not an Exception: no `except Exception` may swallow it
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def say(msg: str) -> None:
    print(f"[tune {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Tuner:
    def __init__(self, args: argparse.Namespace, profiles: list[Profile], sets: list[InputSet], gpu: Gpu,
                 server_cmd: list[str], pidfile: Path, log_path: Path | None, stale_note: str | None):
        self.args, self.profiles, self.sets, self.gpu = args, profiles, sets, gpu
        self.server_cmd = server_cmd
        self.out: Path = args.out
        self.exclusive = gpu.available and not args.no_exclusive_gpu
        self.exclusive_note = (None if self.exclusive else "--no-exclusive-gpu given" if gpu.available
                               else gpu.reason)
        self.server: ServerHandle | None = None
        self.bench: subprocess.Popen | None = None
        self.interrupted: Interrupted | None = None
        self.run_id = uuid.uuid4().hex
        self.pidfile = pidfile
        self.watchdog: tuple[subprocess.Popen, int] | None = None
        self.records = [{"name": p.name, "profile": p.to_json(), "status": "pending", "failure": None,
                         "dir": p.name, "measurements": []} for p in profiles]
        self.run = {
            "kind": "openjev-tune-run",
            "schema_version": 1,
            "run_id": self.run_id,
            "phase": "waiting-idle",
            "phase_since": utc_now(),
            "current_profile": None,
            "server_pid": None,
            "updated_at": utc_now(),
            "tuner": {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "started_at": utc_now(),
                      "host": socket.gethostname(), "argv": sys.argv, "daemon": bool(args.daemon),
                      "pid_file": str(pidfile), "log": str(log_path) if log_path else None,
                      "stale_pid_file_replaced": stale_note},
            "config": {
                "gpu": gpu.info, "port": args.port, "model": str(args.model), "server_cmd": server_cmd,
                "server_cmd_source": SERVER_CMD_ENV if os.environ.get(SERVER_CMD_ENV) else "default",
                "bench": {"script": str(BENCH_SCRIPT), "batch_size": args.batch_size, "workers": args.workers,
                          "repetitions": args.repetitions, "truncate": args.truncate},
                "sets": [s.to_json() for s in sets], "profiles": [p.to_json() for p in profiles],
                "idle_seconds": args.idle_seconds, "max_wait": args.max_wait, "poll_interval": args.poll_interval,
                "start_timeout": args.start_timeout, "stop_timeout": args.stop_timeout,
                "bench_timeout": args.bench_timeout,
                "nvml": {"available": gpu.available, "reason": gpu.reason},
                "idle_wait": "NVML compute processes" if gpu.available else f"skipped: {gpu.reason}",
                "exclusivity": ("bench --exclusive-gpu with the server PID" if gpu.available and not args.no_exclusive_gpu
                                else "not checked: --no-exclusive-gpu given" if gpu.available
                                else f"not checked: {gpu.reason}"),
            },
            "profiles": self.records,
            "measurements": [],
            # every server and bench started: {"role", "profile", "pid", "start_time"}; each also carries
            # OPENJEV_TUNE_RUN=run_id in its environment, inherited by its own children
            "children": [],
            "finished_at": None,
            "exit_code": None,
            "error": None,
            "environment": environment_receipt(),
        }

    # ------------------------------------------------------------ record keeping
    def save(self) -> None:
        self.run["updated_at"] = utc_now()
        atomic_write_json(self.out / "run.json", self.run)

    def phase(self, phase: str, profile: str | None = None) -> None:
        assert phase in PHASES, phase
        self.run.update(phase=phase, phase_since=utc_now())
        if profile is not None or phase == "done":
            self.run["current_profile"] = profile
        self.save()

    def save_profile(self, rec: dict) -> None:
        atomic_write_json(self.out / rec["dir"] / "profile.json", rec)
        self.save()

    def check_interrupt(self) -> None:
        if self.interrupted:
            raise self.interrupted

    # ------------------------------------------------------------ signals
    def on_signal(self, signum: int, _frame) -> None:
        """Only note the signal: every wait loop checks it within a second (check_interrupt), so no
        exception ever lands between starting a process and recording it."""
        if self.interrupted is None:
            self.interrupted = Interrupted(signum)
            say(f"{signal.Signals(signum).name} received: stopping at the next step")
        else:
            say(f"{signal.Signals(signum).name} again: already stopping")

    # ------------------------------------------------------------ main loop
    def child_env(self, extra: dict) -> dict:
        return {**os.environ, **extra, RUN_ENV: self.run_id, OUT_ENV: str(self.out)}

    def note_child(self, role: str, profile: str, pid: int) -> None:
        self.run["children"].append({"role": role, "profile": profile, "pid": pid, "start_time": process_start_time(pid)})

    def execute(self) -> int:
        self.out.mkdir(parents=True)
        self.save()
        self.watchdog = start_watchdog(self.out, self.run_id, self.pidfile)
        self.run["tuner"]["watchdog_pid"] = self.watchdog[0].pid if self.watchdog else None
        say(f"{len(self.profiles)} profile(s) on GPU {self.args.gpu}, port {self.args.port}; record {self.out / 'run.json'}")
        if not self.gpu.available:
            say(f"NVML not available ({self.gpu.reason}): idle wait skipped and GPU exclusivity NOT checked")
        elif not self.exclusive:
            say("--no-exclusive-gpu: GPU exclusivity during the bench NOT checked")
        try:
            for rec, prof in zip(self.records, self.profiles):
                self.run_profile(rec, prof)
        except Interrupted as sig:
            say(f"{sig}: stopping")
            self.cleanup_processes(reason=f"tuner received {sig}")
            for rec in self.records:
                if rec["status"] in ("running", "pending"):
                    rec["status"] = "interrupted" if rec["status"] == "running" else "not-run"
                    if rec["status"] == "interrupted":
                        rec["failure"] = f"tuner received {sig}"
                        self._write_profile_quietly(rec)
            code = 128 + sig.signum
            self.finish("interrupted", code)
            return code
        except BaseException as exc:
            self.cleanup_processes(reason=f"tuner error: {exc}")
            self.run["error"] = f"{type(exc).__name__}: {exc}"
            self.finish("failed", 1)
            raise
        summary = self.write_summary()
        code = 0 if summary["checks"]["all_passed"] else 1
        self.finish("done" if code == 0 else "failed", code)
        return code

    def _write_profile_quietly(self, rec: dict) -> None:
        try:
            atomic_write_json(self.out / rec["dir"] / "profile.json", rec)
        except OSError:
            pass

    def finish(self, phase: str, code: int) -> None:
        self.run["server_pid"] = None
        self.run["finished_at"] = utc_now()
        self.run["exit_code"] = code
        if phase == "interrupted":
            try:
                self.write_summary()
            except Exception as exc:  # noqa: BLE001 - a partial summary is a convenience
                say(f"no summary after the interruption: {exc}")
        self.phase(phase)

    def cleanup_processes(self, reason: str) -> None:
        """Stop a running bench and server (used on interruption and on tuner errors)."""
        self._stop_bench()
        self.bench = None
        if self.server is not None:
            rec = next((r for r in self.records if r["status"] == "running"), None)
            self.phase("stopping-server")
            stop = stop_process_tree(self.server, self.args.stop_timeout)
            stop["reason"] = reason
            say(f"server pid {self.server.pid} stopped ({', '.join(stop['signals']) or 'already gone'}); "
                + ("nothing left running" if stop["clean"] else f"LEFT RUNNING: {stop['left_running']}"))
            if rec is not None:
                rec.setdefault("server", {})["stop"] = stop
            self.server = None
            self.run["server_pid"] = None

    # ------------------------------------------------------------ one profile
    def fail(self, rec: dict, why: str, tail_from: Path | None = None) -> None:
        rec["status"], rec["failure"] = "failed", why
        if tail_from is not None:
            rec["server_log_tail"] = log_tail(tail_from)
        say(f"[{rec['name']}] FAILED: {why}")
        self.save_profile(rec)

    def run_profile(self, rec: dict, prof: Profile) -> None:
        self.check_interrupt()
        pdir = self.out / rec["dir"]
        pdir.mkdir()
        rec["status"] = "running"
        rec["started_at"] = utc_now()
        self.run["current_profile"] = prof.name
        say(f"[{prof.name}] policy {prof.schedule_policy}, max running requests {prof.max_running_requests}"
            + (f", flags {' '.join(prof.extra_args)}" if prof.extra_args else "")
            + (f", env {prof.env}" if prof.env else ""))

        self.phase("waiting-idle", prof.name)
        rec["idle_wait"] = self.wait_idle(prof.name)
        self.save_profile(rec)
        if rec["idle_wait"]["result"] == "timeout":
            return self.fail(rec, f"GPU never idle: GPU {self.args.gpu} had compute processes within every "
                                  f"{self.args.idle_seconds:g} s window for {self.args.max_wait:g} s")

        self.check_interrupt()
        self.phase("starting-server", prof.name)
        log_path = pdir / "server.log"
        if not port_is_free("127.0.0.1", self.args.port):
            return self.fail(rec, f"port {self.args.port} is in use before launch")
        try:
            self.start_server(rec, prof, pdir, log_path)
        except OSError as exc:
            return self.fail(rec, f"cannot run the server command: {exc}", log_path)
        ready = self.wait_healthy(rec, prof.name)
        if ready is not True:
            self.cleanup_processes(reason="server did not become healthy")
            return self.fail(rec, ready, log_path)
        self.save_server_config(rec, pdir)

        self.phase("benchmarking", prof.name)
        died = None
        for s in self.sets:
            for mode in MODES:
                self.check_interrupt()
                if self.server.proc.poll() is not None:
                    died = self.server.proc.returncode
                    break
                self.run_bench(rec, pdir, s, mode)
                self.server.track()
                if self.server.proc.poll() is not None:
                    died = self.server.proc.returncode
                    break
            if died is not None:
                break

        self.phase("stopping-server", prof.name)
        code_before = self.server.proc.poll()
        self.cleanup_processes(reason="profile finished")
        stop = rec["server"]["stop"]
        if died is not None or code_before is not None:
            code = died if died is not None else code_before
            return self.fail(rec, f"server exited unexpectedly (exit code {code}) during benchmarking; "
                                  f"{len(rec['measurements'])} of {len(self.sets) * len(MODES)} measurements ran",
                             log_path)
        if not stop["clean"]:
            return self.fail(rec, f"processes of the server tree left running after SIGKILL: {stop['left_running']}")
        rec["status"] = "done"
        rec["finished_at"] = utc_now()
        say(f"[{prof.name}] done")
        self.save_profile(rec)

    def wait_idle(self, name: str) -> dict:
        a = self.args
        if not self.gpu.available:
            return {"result": "skipped", "reason": self.gpu.reason, "seconds": 0.0}
        start = time.monotonic()
        samples: list[tuple[float, int | None]] = []
        last_report, seen_busy = 0.0, {}
        failed_samples = 0
        while True:
            self.check_interrupt()
            now = time.monotonic()
            procs = self.gpu.compute_processes()
            if procs is None:
                failed_samples += 1
            for p in procs or []:
                seen_busy.setdefault(p["pid"], describe_process(p["pid"]))
            n = None if procs is None else len(procs)
            # only the idle run since the last busy (or failed) sample matters: keep the list short
            samples = [(now, n)] if n is None or n > 0 else [*samples, (now, n)]
            d = idle_decision(samples, start=start, now=now, idle_seconds=a.idle_seconds, max_wait=a.max_wait)
            if d.state != "waiting":
                result = {"result": d.state, "seconds": round(d.waited, 3), "idle_for": round(d.idle_for, 3),
                          "idle_seconds": a.idle_seconds, "failed_samples": failed_samples,
                          "processes_seen": list(seen_busy.values())[:20]}
                say(f"[{name}] GPU {a.gpu} " + (f"idle for {d.idle_for:.1f} s" if d.state == "idle"
                                                 else f"never idle for {a.idle_seconds:g} s within {a.max_wait:g} s"))
                return result
            if now - last_report >= 10 or last_report == 0.0:
                busy = (f"{samples[-1][1]} GPU process(es), as seen from here: " + ", ".join(
                    describe_process(p["pid"]) for p in (procs or [])[:3])) if samples[-1][1] else (
                    "NVML sample failed" if procs is None else "no compute process")
                say(f"[{name}] waiting for GPU {a.gpu} to be idle {a.idle_seconds:g} s: idle {d.idle_for:.0f} s, "
                    f"waited {d.waited:.0f}/{a.max_wait:g} s ({busy})")
                last_report = now
            time.sleep(a.poll_interval)

    def start_server(self, rec: dict, prof: Profile, pdir: Path, log_path: Path) -> None:
        argv = [*self.server_cmd, str(self.args.model), str(self.args.port), *prof.extra_args]
        given = {**prof.env, "CUDA_VISIBLE_DEVICES": str(self.args.gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                 "MAX_RUNNING_REQUESTS": str(prof.max_running_requests), "SCHEDULE_POLICY": prof.schedule_policy,
                 "PYTHONUNBUFFERED": "1"}
        inherited = {k: v for k, v in os.environ.items() if _recorded_env_key(k) and k not in given}
        rec["server"] = {"argv": argv, "command": shlex.join(argv), "env_given": given, "env_inherited": inherited,
                         "cwd": str(REPO_ROOT), "log": str(log_path.relative_to(self.out)), "started_at": utc_now()}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=self.child_env(given), cwd=REPO_ROOT, start_new_session=True,
                                    preexec_fn=child_preexec(signal.SIGTERM, os.getpid()))
        self.note_child(f"server of profile {prof.name}", prof.name, proc.pid)
        self.server = ServerHandle(proc, log_path)
        self.server.track()
        rec["server"]["pid"] = proc.pid
        self.run["server_pid"] = proc.pid
        say(f"[{prof.name}] server pid {proc.pid}: {shlex.join(argv)} (log {log_path})")
        self.save_profile(rec)

    def wait_healthy(self, rec: dict, name: str) -> bool | str:
        import requests

        url = f"http://127.0.0.1:{self.args.port}/health"
        t0 = time.monotonic()
        last_report = t0
        while True:
            self.check_interrupt()
            self.server.track()
            code = self.server.proc.poll()
            if code is not None:
                return f"server exited with code {code} before /health answered 200"
            try:
                if requests.get(url, timeout=5).status_code == 200:
                    rec["server"]["ready_seconds"] = round(time.monotonic() - t0, 3)
                    say(f"[{name}] server healthy after {time.monotonic() - t0:.1f} s")
                    return True
            except requests.RequestException:
                pass
            elapsed = time.monotonic() - t0
            if elapsed >= self.args.start_timeout:
                return f"server not healthy after --start-timeout {self.args.start_timeout:g} s"
            if time.monotonic() - last_report >= 30:
                say(f"[{name}] waiting for {url}: {elapsed:.0f}/{self.args.start_timeout:g} s")
                last_report = time.monotonic()
            time.sleep(0.5)

    def save_server_config(self, rec: dict, pdir: Path) -> None:
        import psutil
        import requests

        srv = rec["server"]
        try:
            resp = requests.get(f"http://127.0.0.1:{self.args.port}/server_info", timeout=30)
            info = resp.json() if resp.status_code == 200 else {"error": f"HTTP {resp.status_code}", "body": resp.text[:2000]}
        except (requests.RequestException, ValueError) as exc:
            info = {"error": f"GET /server_info failed: {exc}"}
        atomic_write_json(pdir / "server_info.json", info)
        srv["server_info"] = "server_info.json"
        try:  # the launcher execs the server, so this PID's argv/env is the real server command
            p = psutil.Process(self.server.pid)
            srv["process_argv"] = p.cmdline()
            srv["process_env"] = {k: v for k, v in sorted(p.environ().items()) if _recorded_env_key(k)}
        except psutil.Error as exc:
            srv["process_argv_error"] = str(exc)
        srv["tree_at_ready"] = sorted(self.server.tree)
        atomic_write_json(pdir / "server_command.json", {k: srv.get(k) for k in (
            "argv", "command", "env_given", "env_inherited", "cwd", "pid", "started_at", "process_argv", "process_env")})
        self.save_profile(rec)

    def run_bench(self, rec: dict, pdir: Path, s: InputSet, mode: str) -> dict:
        """One bench invocation; its measurement is recorded even when the tuner is interrupted during it."""
        a, name = self.args, rec["name"]
        stem = f"{s.name}.{mode}"
        out_json = pdir / f"{stem}.json"
        argv = [sys.executable, str(BENCH_SCRIPT), "--url", f"http://127.0.0.1:{a.port}", "--inputs", str(s.inputs),
                "--tokens", str(s.tokens), "--reference", str(s.reference), "--out", str(out_json),
                "--batch-size", str(a.batch_size), "--workers", str(a.workers), "--repetitions", str(a.repetitions),
                "--truncate", str(a.truncate), "--label", f"{name}/{s.name}/{mode}"]
        if mode == "cold":
            argv.append("--cold-cache")
        if self.exclusive:
            argv += ["--exclusive-gpu", str(a.gpu), "--server-pid", str(self.server.pid)]
        m: dict[str, Any] = {"profile": name, "set": s.name, "mode": mode, "receipt": str(out_json.relative_to(self.out)),
                             "log": str((pdir / f"{stem}.bench.log").relative_to(self.out)), "argv": argv,
                             "exclusivity_checked": self.exclusive, "started_at": utc_now()}
        say(f"[{name}] bench {s.name} {mode}")
        t0 = time.monotonic()
        with open(pdir / f"{stem}.bench.log", "ab") as log:
            self.bench = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=REPO_ROOT, start_new_session=True,
                                          env=self.child_env({"PYTHONUNBUFFERED": "1"}),
                                          preexec_fn=child_preexec(signal.SIGKILL, os.getpid()))
        self.note_child(f"bench {name}/{s.name}/{mode}", name, self.bench.pid)
        interrupted = None
        try:
            code = self._wait_bench(m, t0)
        except Interrupted as exc:  # the bench writes its receipt on SIGTERM (exit 4); keep it
            interrupted = exc
            m["error"] = f"tuner received {exc}"
            code = self._stop_bench()
        self.bench = None
        m["exit_code"] = code
        m["seconds"] = round(time.monotonic() - t0, 3)
        m["finished_at"] = utc_now()
        receipt = None
        try:
            receipt = json.loads(out_json.read_text())
        except (OSError, json.JSONDecodeError):
            pass
        m["receipt_found"] = isinstance(receipt, dict)
        m.update(headline(receipt, mode))
        m["arrays"] = sorted(str(p.relative_to(self.out)) for p in pdir.glob(f"{stem}.*.npy"))  # candidate, passes
        m["checks_ok"] = not measurement_failures(m)
        rec["measurements"].append(m)
        self.run["measurements"].append(m)
        self.save_profile(rec)
        say(f"[{name}] bench {s.name} {mode}: exit {code}"
            + (f", median pass {m['median_pass_s']:.3f} s" if isinstance(m.get("median_pass_s"), (int, float)) else "")
            + ("" if m["checks_ok"] else " (CHECK FAILED)"))
        if interrupted is not None:
            raise interrupted
        return m

    def _wait_bench(self, m: dict, t0: float) -> int:
        server_gone_at = None
        while True:
            self.check_interrupt()
            try:
                return self.bench.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            self.server.track()
            if self.server.proc.poll() is not None and server_gone_at is None:
                server_gone_at = time.monotonic()
            too_long = time.monotonic() - t0 > self.args.bench_timeout
            orphaned = server_gone_at is not None and time.monotonic() - server_gone_at > 120
            if too_long or orphaned:
                m["error"] = ("exceeded --bench-timeout" if too_long else "server gone for 120 s; bench still running")
                return self._stop_bench()

    def _stop_bench(self) -> int | None:
        """SIGTERM the bench's process group (it then writes an incomplete receipt), SIGKILL after 15 s."""
        if self.bench is None:
            return None
        if self.bench.poll() is None:
            _signal_group(self.bench.pid, signal.SIGTERM)
            try:
                self.bench.wait(15)
            except subprocess.TimeoutExpired:
                _signal_group(self.bench.pid, signal.SIGKILL)
                self.bench.wait(15)
        return self.bench.returncode

    # ------------------------------------------------------------ the end
    def write_summary(self) -> dict:
        summary = summarize(self.records, [s.name for s in self.sets], exclusivity_checked=self.exclusive,
                            exclusivity_note=self.exclusive_note)
        summary.update(created_at=utc_now(), run="run.json", gpu=self.gpu.info, host=socket.gethostname(),
                       plot="comparison.png", interrupted=self.interrupted is not None)
        title = (f"OpenJEV profile comparison on {socket.gethostname()}, GPU {self.args.gpu}"
                 + (f" ({self.gpu.info['name']})" if self.gpu.info.get("name") else "")
                 + f"; {self.args.repetitions} repetition(s), batch {self.args.batch_size}, {self.args.workers} workers")
        try:
            write_plot(summary, self.out / "comparison.png", title)
        except Exception as exc:  # noqa: BLE001 - the table and summary matter more than the picture
            summary["plot"] = None
            summary["plot_error"] = f"{type(exc).__name__}: {exc}"
        table = format_table(summary)
        summary["table_text"] = table
        atomic_write_json(self.out / "summary.json", summary)
        print(table, flush=True)
        self.run["summary"] = "summary.json"
        return summary


def _recorded_env_key(k: str) -> bool:
    return k in RECORDED_ENV_KEYS or k.startswith(RECORDED_ENV_PREFIXES)


# ================================================================ main
def resolve_server_cmd() -> list[str]:
    raw = os.environ.get(SERVER_CMD_ENV)
    cmd = shlex.split(raw) if raw else [str(DEFAULT_SERVER_CMD)]
    if not cmd:
        raise UserError(f"{SERVER_CMD_ENV} is set but empty")
    prog = cmd[0]
    found = shutil.which(prog) if os.sep not in prog else (prog if Path(prog).is_file() else None)
    if not found:
        raise UserError(f"server command {prog!r} not found" + (f" (from {SERVER_CMD_ENV})" if raw else ""))
    if found.endswith(".sh") and not os.access(found, os.X_OK):
        cmd = ["bash", found, *cmd[1:]]
    else:
        cmd[0] = str(Path(found).absolute()) if os.sep in prog else prog
    return cmd


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
    if len(sys.argv) > 1 and sys.argv[1] == WATCHDOG_FLAG:
        return watchdog_main(sys.argv[2:])
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
