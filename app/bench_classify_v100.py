#!/usr/bin/env python3
"""Agreement-and-timing bench for a `/classify` server (SGLang adapter or embedded backend).

Submits the exact token ids of a token file (truncated at --truncate, as the reference was) to
POST /classify in batches of --batch-size from --workers client threads (one request per batch),
runs one initial pass (JIT/warmup, excluded from the timing) and --repetitions measured passes,
and reports the median pass wall time. Every pass is compared with the saved reference logits and
its option groups are audited. With --cold-cache it POSTs /flush_cache before every pass (the
initial one included); the receipt's figures then live under "cold", otherwise under "warm": one
run is one mode, never both (run the bench twice for both).

Before any request the input set, token file and reference must agree: the sha256 of the input set
and of the token file equal the reference receipt's, the row ids of all three are equal and in the
same order, reference.npy is [rows, 3] and matches its recorded sha256, --truncate equals the
reference's, and the sha256 of the truncated ids equals the reference's `tokens.ids_sha256`.

Outputs (OUT is --out without its .json suffix):
  OUT.json            the receipt (kind "openjev-bench"; schema results_v100/schemas/bench_receipt.schema.json,
                      check it with app/validate_receipts.py)
  OUT.candidate.npy   float32 [rows, 3] logits of the last completed pass
  OUT.passes.npy      float32 [passes, rows, 3] logits of every completed pass, the initial one first
Files are written to a temporary name and renamed; the receipt last, with the arrays' sha256.

Agreement (every pass): p_e = softmax(logits)[entailment] in float64; max / p99 / mean of
|p_e(candidate) - p_e(reference)|, max |logit difference|, NLI argmax changes by row id.

Group audit (every pass, the initial one included):
  * an option group is the rows sharing the same premise AND the same instruction (an absent or
    null instruction is its own value, distinct from any string); groups of one row are singletons,
    counted as "not covered";
  * reference winners W = the rows whose reference p_e equals the group maximum exactly;
  * the candidate's choice set C = the rows whose candidate p_e equals the candidate's group
    maximum exactly (several when the candidate itself ties: "candidate-tied");
  * FAILURE: C contains a row outside W (so a candidate tie between a winner and a non-winner
    fails too: a consumer that breaks ties by position could pick the non-winner);
  * TIE (not a failure): W has several rows, C is inside W, and the candidate's first choice in
    input order differs from the reference's first winner in input order.

Exclusive GPU (--exclusive-gpu INDEX --server-pid PID): a thread samples NVML's compute and graphics
processes on physical GPU INDEX (NVML numbering, as nvidia-smi shows) every --sample-interval
seconds from before the first request until after the last response. Allowed: the server and its
descendants (psutil, re-read every sample), each identified by (pid, create time); the server's
own (pid, create time) is captured at start, so a reused PID is caught. A process of anyone else on
the GPU, a GPU process that cannot be identified, the server gone or its start time changed, the
server (and every descendant) absent from the GPU's process list (wrong index, a server on another
device, or NVML PIDs from another PID namespace: an empty list would prove nothing), or a failed
NVML sample makes the run invalid. The first sample is taken before anything is sent: if it
fails (no NVML driver, e.g.) or already shows a competitor, nothing is sent, the receipt says why
and the exit status is 3. This is sampled evidence, not a GPU lease.

Exit status (the receipt is written for every status >= 2; status 1 writes nothing):
  0  complete and valid: every pass done, no group-audit failure, exclusivity held (if monitored)
  1  bad input or usage, refused before any /classify request: mismatched hashes, ids, shapes,
     truncation, a missing reference, OUT exists without --overwrite, an input too long for the
     server's context length, a batch over its limit, --server-pid not the server
  2  the group audit failed on some pass (a choice outside the reference winners)
  3  the exclusivity monitor invalidated the run
  4  incomplete: the server was unreachable at start (/health), a request still failed after
     --retries retries (connection error, timeout, 5xx), was refused (4xx), or was answered with
     something unusable (wrong shape or label order, non-finite logits), or the run was interrupted
     (SIGINT/SIGTERM); the passes completed before that are kept, a partial pass is dropped
  When several apply: 2 before 4 before 3 (a server that dies also "vanishes" from the monitor).

Examples:
  bench_classify_v100.py --url http://127.0.0.1:31003 --inputs G.jsonl --tokens G.tokens.jsonl \\
      --reference results/ref_G --out results/bench_G_warm.json
  PID=$(curl -s http://127.0.0.1:31003/server_info | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
  bench_classify_v100.py ... --cold-cache --exclusive-gpu 3 --server-pid "$PID" --out results/bench_G_cold.json
  (the server's GPU processes must be PID's descendants: the SGLang HTTP process or its launcher both qualify)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import re
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence
from urllib.parse import urlparse

import numpy as np

from openjev.common import (LABELS, UserError, atomic_write_bytes, atomic_write_json, entailment_prob, environment_receipt,
                     ids_sha256, read_inputs, read_tokens, run_main, sha256_bytes, sha256_file, truncate_rows, utc_now)

KIND = "openjev-bench"
SCHEMA_VERSION = 1

EXIT_OK, EXIT_USAGE, EXIT_AUDIT, EXIT_EXCLUSIVE, EXIT_INCOMPLETE = 0, 1, 2, 3, 4
MAX_VIOLATING_SAMPLES_KEPT = 10
WORST_ROWS_KEPT = 10


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:31003")
    p.add_argument("--inputs", type=Path, required=True, help="input set JSONL {id, premise, hypothesis, instruction?}")
    p.add_argument("--tokens", type=Path, required=True, help="token file JSONL {id, input_ids} made from --inputs")
    p.add_argument("--reference", type=Path, required=True,
                   help="reference directory from score_reference.py (reference.npy + reference.json)")
    p.add_argument("--out", type=Path, required=True,
                   help="receipt path OUT.json; also writes OUT.candidate.npy and OUT.passes.npy")
    p.add_argument("--batch-size", type=int, default=32, help="rows per /classify request (default: 32)")
    p.add_argument("--workers", type=int, default=4, help="concurrent client threads (default: 4)")
    p.add_argument("--repetitions", type=int, default=3,
                   help="measured passes after the initial (warmup) pass; the median is reported (default: 3)")
    p.add_argument("--truncate", type=int, default=4096,
                   help="keep the first N ids of each row; must equal the reference's (default: 4096)")
    p.add_argument("--cold-cache", action="store_true",
                   help="POST /flush_cache before every pass, the initial one included; figures go under 'cold' "
                        "(default: off, figures under 'warm')")
    p.add_argument("--label", default=None, help="free-form run label recorded in the receipt (default: none)")
    p.add_argument("--machine-label", default=None,
                   help="machine the figures come from (default: derived: the server's GPU name, or "
                        "'cpu: <platform> (<cpu model>)' for a CPU server on this host)")
    p.add_argument("--exclusive-gpu", type=int, default=None, metavar="INDEX",
                   help="physical GPU (NVML index) only the server may use during the run (default: not monitored)")
    p.add_argument("--server-pid", type=int, default=None, metavar="PID",
                   help="PID of the server process; it and its descendants are allowed on --exclusive-gpu")
    p.add_argument("--sample-interval", type=float, default=0.5,
                   help="seconds between NVML samples with --exclusive-gpu (default: 0.5)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP request (default: 600)")
    p.add_argument("--retries", type=int, default=2,
                   help="retries of a request after a connection error, timeout or 5xx, with a short backoff "
                        "(0.25 s doubling, at most 2 s); then the run stops incomplete (default: 2)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT.json and its arrays")
    return p


# ================================================================ pure math (unit-tested)
def percentile_summary(values: Sequence[float]) -> dict:
    """p50/p90/p99 (linear interpolation, numpy's default), max, mean and count; nulls when empty."""
    if len(values) == 0:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None, "count": 0}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(a.max()),
            "mean": float(a.mean()), "count": int(a.size)}


def median_or_none(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if len(values) else None


def agreement(candidate: np.ndarray, reference: np.ndarray, row_ids: Sequence[str], full: bool = False) -> dict:
    """Candidate vs reference logits: entailment-probability and logit differences, argmax changes."""
    dpe = np.abs(entailment_prob(candidate) - entailment_prob(reference))
    dlogit = np.abs(candidate.astype(np.float64) - reference.astype(np.float64))
    cand_arg, ref_arg = candidate.argmax(axis=1), reference.argmax(axis=1)
    changed = np.flatnonzero(cand_arg != ref_arg)
    out = {
        "rows": int(len(row_ids)),
        "max_abs_dp_e": float(dpe.max()),
        "p99_abs_dp_e": float(np.percentile(dpe, 99)),
        "mean_abs_dp_e": float(dpe.mean()),
        "max_abs_logit_diff": float(dlogit.max()),
        "argmax_changes_count": int(changed.size),
        "argmax_changes": [{"id": row_ids[i], "reference": LABELS[ref_arg[i]], "candidate": LABELS[cand_arg[i]]}
                           for i in changed],
        "bitwise_equal": bool(np.array_equal(candidate, reference)),
    }
    if full:
        pe_c, pe_r = entailment_prob(candidate), entailment_prob(reference)
        worst = np.argsort(-dpe, kind="stable")[:WORST_ROWS_KEPT]
        out["worst_rows"] = [{"id": row_ids[i], "abs_dp_e": float(dpe[i]), "p_e_reference": float(pe_r[i]),
                              "p_e_candidate": float(pe_c[i])} for i in worst]
    return out


def group_key(row: dict) -> tuple:
    """Option-group key: the premise and the instruction; absent/null instruction is its own value."""
    ins = row.get("instruction")
    return (row["premise"], ins is not None, ins if ins is not None else "")


def option_groups(inputs: Sequence[dict]) -> tuple[list[list[int]], int]:
    """Row indices of every option group (>= 2 rows, in first-appearance order) and the singleton count."""
    by_key: dict[tuple, list[int]] = {}
    for i, row in enumerate(inputs):
        by_key.setdefault(group_key(row), []).append(i)
    groups = [idx for idx in by_key.values() if len(idx) > 1]
    singletons = sum(1 for idx in by_key.values() if len(idx) == 1)
    return groups, singletons


def argmax_set(values: np.ndarray, idx: Sequence[int]) -> list[int]:
    """Every index of `idx` whose value equals the maximum over `idx` exactly (input order kept)."""
    best = max(values[i] for i in idx)
    return [i for i in idx if values[i] == best]


def audit_pass(groups: Sequence[Sequence[int]], ref_pe: np.ndarray, cand_pe: np.ndarray,
               row_ids: Sequence[str]) -> dict:
    """Group audit of one pass (rules in the module docstring)."""
    failures, ties = [], []
    ref_tied = cand_tied = 0
    for g, idx in enumerate(groups):
        winners = argmax_set(ref_pe, idx)
        chosen = argmax_set(cand_pe, idx)
        ref_tied += len(winners) > 1
        cand_tied += len(chosen) > 1
        outside = [i for i in chosen if i not in winners]
        if outside:
            failures.append({
                "group": g, "rows": [row_ids[i] for i in idx],
                "reference_winners": [row_ids[i] for i in winners],
                "candidate_choice": [row_ids[i] for i in chosen],
                "outside_winners": [row_ids[i] for i in outside],
                "p_e_reference": {row_ids[i]: float(ref_pe[i]) for i in idx},
                "p_e_candidate": {row_ids[i]: float(cand_pe[i]) for i in idx},
            })
        elif len(winners) > 1 and chosen[0] != winners[0]:
            ties.append({"group": g, "rows": [row_ids[i] for i in idx],
                         "reference_winners": [row_ids[i] for i in winners],
                         "reference_choice": row_ids[winners[0]], "candidate_choice": row_ids[chosen[0]]})
    return {
        "groups": len(groups), "rows_in_groups": int(sum(len(i) for i in groups)),
        "failures_count": len(failures), "ties_count": len(ties),
        "reference_tied_groups": int(ref_tied), "candidate_tied_groups": int(cand_tied),
        "passed": not failures, "failures": failures, "ties": ties,
    }


def decide_exit(audit_failed: bool, server_failure: bool, exclusive_valid: bool | None) -> int:
    """Exit status from the run's outcome; precedence 2 (audit) > 4 (incomplete) > 3 (exclusivity)."""
    if audit_failed:
        return EXIT_AUDIT
    if server_failure:
        return EXIT_INCOMPLETE
    if exclusive_valid is False:
        return EXIT_EXCLUSIVE
    return EXIT_OK


def backoff_s(attempt: int) -> float:
    """Sleep before retry number `attempt` (0-based): 0.25, 0.5, 1, 2, 2, ... seconds."""
    return min(0.25 * (2 ** attempt), 2.0)


def derive_machine_label(explicit: str | None, server_device: str | None, nvml_gpu_name: str | None,
                         server_is_local: bool, local_platform: str, cpu_model: str | None) -> str:
    """Which machine the figures come from, so that a figure from one GPU is never read as another's."""
    if explicit:
        return explicit
    if nvml_gpu_name:
        return nvml_gpu_name
    dev = (server_device or "").strip()
    m = re.match(r"cuda(?::\d+)?\s*\(([^,)]+)", dev)
    if m:
        return m.group(1).strip()
    if dev.startswith("cuda"):
        return f"gpu: {dev}"
    if dev == "cpu":
        if server_is_local:
            return f"cpu: {local_platform}" + (f" ({cpu_model})" if cpu_model else "")
        return "cpu: remote server"
    return f"unknown (server device {dev!r})" if dev else "unknown (the server's device is not known)"


def cpu_model_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


# ================================================================ exclusivity: pure decision
ProcId = tuple  # (pid: int, create_time: float)


@dataclass(frozen=True)
class GpuProc:
    pid: int
    create_time: float | None  # None: the pid is not visible here (exited, or another PID namespace)
    name: str | None = None


@dataclass(frozen=True)
class Sample:
    t_s: float                               # seconds since the monitor started
    error: str | None = None                 # the NVML query failed
    server_now: ProcId | None = None         # (server pid, its create time now); None: gone
    descendants: frozenset = frozenset()     # {(pid, create_time)} of the server's descendants now
    gpu: tuple = ()                          # GpuProc of every process NVML lists on the GPU


def allowed_processes(server: ProcId, server_now: ProcId | None, descendants: Iterable[ProcId]) -> frozenset:
    """The server and its descendants, but only while the server is the one captured at start."""
    if server_now != server:
        return frozenset()
    return frozenset({tuple(server), *map(tuple, descendants)})


def sample_violations(server: ProcId, sample: Sample, require_server_on_gpu: bool = True) -> list[str]:
    """Everything wrong with one sample (empty: the GPU was exclusive to the server at that moment).

    With `require_server_on_gpu` (the bench's setting) the server or one of its descendants must itself
    be among the GPU's processes: a server that holds no context on the GPU means a wrong GPU index, a
    server on another device, or NVML reporting PIDs of another PID namespace (a container), and in all
    three cases an empty process list proves nothing.
    """
    if sample.error:
        return [f"NVML sample failed: {sample.error}"]
    pid, created = server
    if sample.server_now is None:
        return [f"server pid {pid} is gone"]
    if sample.server_now != tuple(server):
        return [f"server pid {pid} now has start time {sample.server_now[1]} (captured {created}): "
                "the PID was reused, the server is gone"]
    allowed = allowed_processes(server, sample.server_now, sample.descendants)
    out = []
    for g in sample.gpu:
        if g.create_time is None:
            out.append(f"pid {g.pid} on the GPU cannot be identified (exited, or in another PID namespace)")
        elif (g.pid, g.create_time) not in allowed:
            out.append(f"competitor pid {g.pid} ({g.name or '?'}) on the GPU")
    if require_server_on_gpu and not any((g.pid, g.create_time) in allowed for g in sample.gpu):
        out.append(f"neither the server (pid {pid}) nor a descendant is among the GPU's processes "
                   f"(NVML lists {sorted(g.pid for g in sample.gpu) or 'none'}): wrong --exclusive-gpu index, a "
                   "server not on this GPU, or NVML PIDs from another PID namespace; exclusivity cannot be shown")
    return out


# ================================================================ exclusivity: I/O (psutil, NVML)
def proc_id(pid: int) -> ProcId | None:
    """(pid, create_time) of a live, non-zombie process; None if it does not exist."""
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return (pid, p.create_time())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


def read_tree(server_pid: int) -> tuple[ProcId | None, frozenset]:
    """The server's (pid, create_time) now and its descendants' as read now (psutil)."""
    import psutil

    try:
        p = psutil.Process(server_pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None, frozenset()
        now = (server_pid, p.create_time())
        kids = p.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None, frozenset()
    desc = set()
    for k in kids:
        try:
            desc.add((k.pid, k.create_time()))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass  # exited between listing and reading: it cannot be on the GPU as one of ours
    return now, frozenset(desc)


def identify(pids: Iterable[int]) -> tuple:
    import psutil

    out = []
    for pid in sorted(set(pids)):
        try:
            p = psutil.Process(pid)
            out.append(GpuProc(pid, p.create_time(), p.name()))
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            out.append(GpuProc(pid, None, None))
    return tuple(out)


class NvmlUnavailable(Exception):
    pass


class NvmlGpu:
    """One physical GPU through NVML (nvidia-ml-py): identity and the processes holding it."""

    def __init__(self, index: int):
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from None
        self.nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML cannot start ({exc}): no NVIDIA driver here?") from None
        try:
            count = pynvml.nvmlDeviceGetCount()
            if not 0 <= index < count:
                raise UserError(f"--exclusive-gpu {index}: NVML sees {count} GPU(s) (indices 0..{count - 1})")
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.info = {"index": index, "name": _s(pynvml.nvmlDeviceGetName(self.handle)),
                         "uuid": _s(pynvml.nvmlDeviceGetUUID(self.handle)),
                         "pci_bus_id": _s(pynvml.nvmlDeviceGetPciInfo(self.handle).busId),
                         "driver": _s(pynvml.nvmlSystemGetDriverVersion())}
        except pynvml.NVMLError as exc:
            self.close()
            raise NvmlUnavailable(f"NVML cannot read GPU {index}: {exc}") from None
        except UserError:
            self.close()
            raise
        self.graphics_supported = True

    def pids(self) -> list[int]:
        nv = self.nv
        pids = [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(self.handle)]
        if self.graphics_supported:
            try:
                pids += [p.pid for p in nv.nvmlDeviceGetGraphicsRunningProcesses(self.handle)]
            except nv.NVMLError_NotSupported:
                self.graphics_supported = False  # a compute-only board: recorded, compute is still checked
        return pids

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class ExclusivityMonitor:
    """Samples the GPU's processes every `interval` seconds on a daemon thread; keeps the evidence."""

    def __init__(self, gpu_index: int, server: ProcId, interval: float, gpu=None):
        """`gpu`: anything with NvmlGpu's pids()/info/graphics_supported/close() (default: NvmlGpu(gpu_index))."""
        self.gpu_index, self.server, self.interval = gpu_index, tuple(server), interval
        self.gpu = gpu
        self.open_error: str | None = None
        if gpu is None:
            try:
                self.gpu = NvmlGpu(gpu_index)
            except NvmlUnavailable as exc:
                self.open_error = str(exc)
        self.t0 = time.monotonic()
        self.samples = 0
        self.violating = 0
        self.kept: list[dict] = []
        self.seen: dict[tuple, dict] = {}
        self.last_t: float | None = None
        self.max_gap = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> list[str]:
        """Take and record one sample; returns its violations."""
        t = time.monotonic() - self.t0
        if self.gpu is None:
            s = Sample(t, error=self.open_error)
        else:
            try:
                pids = self.gpu.pids()
                now, desc = read_tree(self.server[0])
                s = Sample(t, server_now=now, descendants=desc, gpu=identify(pids))
            except Exception as exc:  # noqa: BLE001 - any failure of a sample invalidates the run
                s = Sample(t, error=f"{type(exc).__name__}: {exc}")
        v = sample_violations(self.server, s)
        with self._lock:
            self.samples += 1
            if self.last_t is not None:
                self.max_gap = max(self.max_gap, t - self.last_t)
            self.last_t = t
            allowed = allowed_processes(self.server, s.server_now, s.descendants)
            for g in s.gpu:
                self.seen.setdefault((g.pid, g.create_time), {
                    "pid": g.pid, "name": g.name, "create_time": g.create_time,
                    "allowed": (g.pid, g.create_time) in allowed, "first_seen_s": round(t, 3)})
            if v:
                self.violating += 1
                if len(self.kept) < MAX_VIOLATING_SAMPLES_KEPT:
                    self.kept.append({"t_s": round(t, 3), "at": utc_now(), "violations": v,
                                      "gpu_processes": [vars(g) for g in s.gpu]})
        return v

    def start(self) -> None:
        def loop():
            while not self._stop.wait(self.interval):
                self.take()

        self._thread = threading.Thread(target=loop, name="exclusive-gpu-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 4 * self.interval))
            self.take()  # the last response has arrived: one more sample closes the window
        if self.gpu is not None:
            self.gpu.close()

    @property
    def valid(self) -> bool:
        with self._lock:
            return self.samples > 0 and self.violating == 0

    def report(self) -> dict:
        with self._lock:
            first = self.kept[0]["violations"][0] if self.kept else None
            return {
                "gpu_index": self.gpu_index,
                "gpu": self.gpu.info if self.gpu else None,
                "graphics_process_query": (None if self.gpu is None
                                           else "ok" if self.gpu.graphics_supported else "not supported"),
                "server": {"pid": self.server[0], "create_time": self.server[1]},
                "interval_s": self.interval, "samples": self.samples, "violating_samples": self.violating,
                "max_gap_s": round(self.max_gap, 3),
                "valid": self.samples > 0 and self.violating == 0,
                "reason": first,
                "violations": list(self.kept),
                "gpu_processes_seen": list(self.seen.values()),
                "note": "sampled evidence every interval_s, not a GPU lease: competition shorter than the "
                        "interval can go unseen",
            }


# ================================================================ inputs and the reference
@dataclass
class RunData:
    row_ids: list[str]
    inputs: list[dict]
    rows: list[list[int]]          # truncated, as sent
    truncated_rows: int
    reference: np.ndarray          # float32 [rows, 3]
    ref_meta: dict
    inputs_sha: str
    tokens_sha: str
    ids_sha: str
    ref_json_sha: str
    ref_npy_sha: str


def load_run_data(args) -> RunData:
    """Everything checked before a request is sent (exit 1 on any mismatch)."""
    ref_json, ref_npy = args.reference / "reference.json", args.reference / "reference.npy"
    if not args.reference.is_dir():
        raise UserError(f"reference directory {args.reference} not found")
    for f in (ref_json, ref_npy):
        if not f.is_file():
            raise UserError(f"reference {args.reference} is incomplete: {f.name} missing")
    try:
        meta = json.loads(ref_json.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{ref_json} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("kind") != "openjev-reference":
        raise UserError(f"{ref_json} is not a reference receipt (kind {meta.get('kind') if isinstance(meta, dict) else None!r}, "
                        "expected 'openjev-reference')")
    inputs = read_inputs(args.inputs)
    row_ids, raw_rows = read_tokens(args.tokens)
    inputs_sha, tokens_sha = sha256_file(args.inputs), sha256_file(args.tokens)
    ref_inputs = meta.get("inputs") or {}
    ref_tokens = meta.get("tokens") or {}
    if not ref_inputs.get("sha256"):
        raise UserError(f"reference {args.reference} records no input set (made without --inputs); "
                        f"its input set cannot be checked against {args.inputs}")
    if inputs_sha != ref_inputs["sha256"]:
        raise UserError(f"input set {args.inputs} sha256 {inputs_sha[:12]}... differs from the reference's "
                        f"{ref_inputs['sha256'][:12]}... (made from {ref_inputs.get('path')})")
    if tokens_sha != ref_tokens.get("sha256"):
        raise UserError(f"token file {args.tokens} sha256 {tokens_sha[:12]}... differs from the reference's "
                        f"{str(ref_tokens.get('sha256'))[:12]}... (made from {ref_tokens.get('path')})")
    if [r["id"] for r in inputs] != row_ids:
        raise UserError(f"token file {args.tokens} rows do not match input set {args.inputs} (ids or order differ)")
    if meta.get("row_ids") != row_ids:
        raise UserError(f"reference {args.reference} row_ids differ from the token file's ids (or their order)")
    if ref_tokens.get("truncate") != args.truncate:
        raise UserError(f"--truncate {args.truncate} differs from the reference's truncation "
                        f"({ref_tokens.get('truncate')}); pass --truncate {ref_tokens.get('truncate')}")
    rows, cut = truncate_rows(raw_rows, args.truncate)
    ids_sha = ids_sha256(rows)
    if ids_sha != ref_tokens.get("ids_sha256"):
        raise UserError(f"sha256 of the truncated ids {ids_sha[:12]}... differs from the reference's "
                        f"tokens.ids_sha256 {str(ref_tokens.get('ids_sha256'))[:12]}...")
    ref_npy_sha = sha256_file(ref_npy)
    if not meta.get("logits_sha256"):
        raise UserError(f"{ref_json} records no logits_sha256; the reference logits cannot be verified")
    if meta["logits_sha256"] != ref_npy_sha:
        raise UserError(f"{ref_npy} sha256 {ref_npy_sha[:12]}... differs from its receipt's logits_sha256 "
                        f"{meta['logits_sha256'][:12]}... (edited or corrupted)")
    sidecar = args.reference / "tokens.sha256"
    if sidecar.is_file() and sidecar.read_text().split()[:1] != [tokens_sha]:
        raise UserError(f"{sidecar} names another token file hash than {args.tokens}")
    try:
        ref = np.load(ref_npy, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise UserError(f"{ref_npy} cannot be read as a .npy array: {exc}") from None
    if ref.ndim != 2 or ref.shape != (len(row_ids), 3):
        raise UserError(f"{ref_npy} has shape {list(ref.shape)}, expected [{len(row_ids)}, 3] (rows, labels)")
    if not np.issubdtype(ref.dtype, np.floating) or not np.isfinite(ref).all():
        raise UserError(f"{ref_npy} must hold finite floating-point logits (dtype {ref.dtype})")
    if meta.get("labels") not in (None, list(LABELS)):
        raise UserError(f"reference label order {meta.get('labels')} is not {list(LABELS)}")
    return RunData(row_ids, inputs, rows, cut, ref.astype(np.float32), meta, inputs_sha, tokens_sha, ids_sha,
                   sha256_file(ref_json), ref_npy_sha)


# ================================================================ HTTP client
class ServerFailure(Exception):
    """The server did not answer usefully after the bounded retries (or refused with a 4xx)."""


class Client:
    """One requests.Session per worker thread (keep-alive), bounded retries with a short backoff."""

    def __init__(self, url: str, timeout: float, retries: int):
        import requests

        self.requests = requests
        self.base = url.rstrip("/")
        self.timeout, self.retries = timeout, retries
        self._local = threading.local()
        self.retried = 0
        self._lock = threading.Lock()

    def session(self):
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = self.requests.Session()
        return s

    def request(self, method: str, path: str, body: bytes | None = None, retry: bool = True):
        """Returns (response, t_first_send, t_last_recv, retries). Raises ServerFailure."""
        attempts = (self.retries if retry else 0) + 1
        t_first, last_err = None, None
        for attempt in range(attempts):
            if attempt:
                with self._lock:
                    self.retried += 1
                time.sleep(backoff_s(attempt - 1))
            t_send = time.perf_counter()
            t_first = t_first if t_first is not None else t_send
            try:
                resp = self.session().request(method, self.base + path, data=body, timeout=self.timeout,
                                              headers={"Content-Type": "application/json"} if body else None)
                _ = resp.content
            except self.requests.RequestException as exc:
                last_err = f"{method} {self.base}{path}: {_describe_request_error(exc)}"
                self._local.session = None  # a broken connection: start a fresh session
                continue
            t_recv = time.perf_counter()
            if resp.status_code >= 500:
                last_err = f"{method} {path} answered {resp.status_code}: {_error_message(resp)}"
                continue
            if resp.status_code >= 400:
                raise ServerFailure(f"{method} {path} was refused with {resp.status_code}: {_error_message(resp)}")
            return resp, t_first, t_recv, attempt
        raise ServerFailure(f"{last_err} (after {attempts} attempt{'s' if attempts > 1 else ''})")

    def get_json(self, path: str, retry: bool = True) -> dict:
        resp, *_ = self.request("GET", path, retry=retry)
        try:
            return resp.json()
        except ValueError:
            raise ServerFailure(f"GET {path} did not answer JSON") from None

    def classify(self, body: bytes, n_rows: int) -> tuple[np.ndarray, float, float, int, str | None]:
        resp, t_send, t_recv, retries = self.request("POST", "/classify", body)
        try:
            data = json.loads(resp.content)
            logits = np.asarray(data["logits"], dtype=np.float32)
        except (ValueError, KeyError, TypeError) as exc:
            raise ServerFailure(f"POST /classify answered an unreadable body: {exc}") from None
        if data.get("labels") != list(LABELS):
            raise ServerFailure(f"server label order {data.get('labels')} is not {list(LABELS)}")
        if logits.shape != (n_rows, 3):
            raise ServerFailure(f"POST /classify answered logits of shape {list(logits.shape)} for {n_rows} rows")
        if not np.isfinite(logits).all():
            raise ServerFailure("POST /classify answered non-finite logits (NaN or infinity); nothing to compare")
        return logits, t_send, t_recv, retries, data.get("model")


def _describe_request_error(exc: Exception) -> str:
    """A short cause for a requests exception: the innermost OSError ("[Errno 111] Connection refused")."""
    import requests

    seen, todo, cause = set(), [exc], None
    while todo:
        e = todo.pop()
        if id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            cause = f"[Errno {e.errno}] {e.strerror}"
        todo += [a for a in e.args if isinstance(a, BaseException)] + [e.__cause__, e.__context__]
        if hasattr(e, "reason"):
            todo.append(getattr(e, "reason"))
    kind = ("timed out" if isinstance(exc, requests.Timeout) else
            "cannot connect" if isinstance(exc, requests.ConnectionError) else type(exc).__name__)
    if cause:
        return f"{kind} ({cause})"
    text = " ".join(str(exc).split())
    return f"{kind} ({text[:160]}{'...' if len(text) > 160 else ''})"


def _error_message(resp) -> str:
    try:
        return str(resp.json()["error"]["message"])[:300]
    except Exception:  # noqa: BLE001
        return (resp.text or "")[:300].strip() or "(empty body)"


# ================================================================ one pass
@dataclass
class PassResult:
    index: int
    kind: str                         # "initial" | "measured"
    started_at: str
    batches: int
    logits: np.ndarray | None = None  # None when the pass did not finish
    wall_s: float | None = None
    latencies_s: list = field(default_factory=list)  # per batch, in batch order (None: not answered)
    client_cpu_s: float | None = None
    retries: int = 0
    flush: dict | None = None
    error: str | None = None
    model: str | None = None


def run_pass(client: Client, pool: ThreadPoolExecutor, bodies: list[bytes], offsets: list[tuple[int, int]],
             n_rows: int, index: int, kind: str, label: str) -> PassResult:
    from tqdm import tqdm

    res = PassResult(index, kind, utc_now(), len(bodies), latencies_s=[None] * len(bodies))
    logits = np.full((n_rows, 3), np.nan, dtype=np.float32)
    sends, recvs = [], []
    cpu0 = time.process_time()
    futures = {pool.submit(client.classify, body, hi - lo): b for b, (body, (lo, hi)) in enumerate(zip(bodies, offsets))}
    pending = set(futures)
    with tqdm(total=len(bodies), unit="batch", desc=label, disable=None, file=sys.stderr, leave=False) as bar:
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    b = futures[fut]
                    out, t_send, t_recv, retries, model = fut.result()
                    lo, hi = offsets[b]
                    logits[lo:hi] = out
                    res.latencies_s[b] = t_recv - t_send
                    res.retries += retries
                    res.model = res.model or model
                    sends.append(t_send)
                    recvs.append(t_recv)
                    bar.update(1)
        except ServerFailure as exc:
            res.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - an unexpected client failure still ends in a receipt
            res.error = f"client error: {type(exc).__name__}: {exc}"
        finally:
            for fut in pending:
                fut.cancel()
    res.client_cpu_s = time.process_time() - cpu0
    if res.error is None:
        res.logits = logits
        res.wall_s = max(recvs) - min(sends)
    return res


# ================================================================ receipt
def pass_entry(p: PassResult, data: RunData, ref_pe: np.ndarray, groups) -> dict:
    entry = {"index": p.index, "kind": p.kind, "started_at": p.started_at, "complete": p.logits is not None,
             "flush_cache": p.flush, "batches": p.batches, "rows": len(data.row_ids),
             "wall_s": p.wall_s, "batch_latencies_s": p.latencies_s,
             "client_cpu_s": p.client_cpu_s,
             "client_overhead_fraction": (p.client_cpu_s / p.wall_s) if p.wall_s else None,
             "retries": p.retries, "error": p.error, "agreement": None, "audit": None}
    if p.logits is not None:
        ag = agreement(p.logits, data.reference, data.row_ids)
        entry["agreement"] = ag
        entry["audit"] = audit_pass(groups, ref_pe, entailment_prob(p.logits), data.row_ids)
    return entry


def timing_summary(entries: list[dict], n_rows: int) -> dict:
    measured = [e for e in entries if e["kind"] == "measured" and e["complete"]]
    walls = [e["wall_s"] for e in measured]
    lat = [x for e in measured for x in e["batch_latencies_s"]]
    med = median_or_none(walls)
    cpu = sum(e["client_cpu_s"] for e in measured)
    initial = next((e for e in entries if e["kind"] == "initial" and e["complete"]), None)
    return {
        "measured_passes": len(measured),
        "wall_s": walls,
        "median_wall_s": med,
        "min_wall_s": min(walls) if walls else None,
        "max_wall_s": max(walls) if walls else None,
        "pairs_per_s": (n_rows / med) if med else None,
        "batch_latency_s": percentile_summary(lat),
        "client_cpu_s": cpu if measured else None,
        "client_overhead_fraction": (cpu / sum(walls)) if walls and sum(walls) > 0 else None,
        "initial_pass_wall_s": initial["wall_s"] if initial else None,
        "retries": sum(e["retries"] for e in entries),
        "retried_passes": [e["index"] for e in entries if e["retries"]],
        "definition": "wall: first request sent -> last response received, per pass; median over the measured "
                      "passes (the initial pass excluded); pairs/s = rows / median wall; batch latency: send -> "
                      "response of each request (retries included), over the measured passes, linear percentiles; "
                      "client overhead: CPU seconds of the bench process during the passes / their wall seconds "
                      "(request bodies are encoded once, before the first pass)",
    }


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def out_paths(out: Path) -> dict[str, Path]:
    base = out.with_suffix("") if out.suffix == ".json" else out
    return {"json": base.with_name(base.name + ".json") if out.suffix != ".json" else out,
            "candidate": base.with_name(base.name + ".candidate.npy"),
            "passes": base.with_name(base.name + ".passes.npy")}


def write_outputs(paths: dict[str, Path], receipt: dict, passes: list[np.ndarray]) -> None:
    """Arrays first (atomic), stale arrays of an overwritten run removed, the receipt last."""
    outputs = {"candidate": None, "passes": None}
    if passes:
        for key, arr in (("candidate", passes[-1]), ("passes", np.stack(passes))):
            blob = npy_bytes(arr.astype(np.float32))
            atomic_write_bytes(paths[key], blob)
            outputs[key] = {"file": paths[key].name, "sha256": sha256_bytes(blob), "shape": list(arr.shape),
                            "dtype": "float32"}
    else:
        for key in ("candidate", "passes"):
            if paths[key].exists():
                paths[key].unlink()  # never leave an earlier run's arrays beside this receipt
    receipt["outputs"] = outputs
    atomic_write_json(paths["json"], receipt)


def pass_name(index: int, total: int) -> str:
    """Human name of pass `index` (0-based, as in the receipt) of `total`: 'pass 1/4 (initial)',
    'pass 3/4 (measured 2/3)'. Progress lines, error lines and the summary all use it."""
    if index == 0:
        return f"pass 1/{total} (initial)"
    return f"pass {index + 1}/{total} (measured {index}/{total - 1})"


def passes_done_text(sec: dict) -> str:
    """'passes 2/4 done (1 initial + 1 of 3 measured)': counts of what completed, never of what was planned."""
    planned = sec.get("passes_planned") or 1
    done = sec.get("passes_done", 0)
    measured = sec.get("measured_passes_done", max(0, done - 1))
    initial = done - measured
    return f"{done}/{planned} done ({initial} initial + {measured} of {planned - 1} measured)"


def print_summary(r: dict, out: Path) -> None:
    mode = r["mode"]
    sec = r.get(mode) or {}
    t = sec.get("timing") or {}
    ag = sec.get("agreement_final") or {}
    au = sec.get("audit") or {}
    ex = r.get("exclusive")

    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    lat = t.get("batch_latency_s") or {}
    if ex is None:
        excl = "not monitored"
    elif ex["valid"]:
        excl = f"valid (GPU {ex['gpu_index']}, {ex['samples']} samples every {ex['interval_s']} s)"
    else:
        excl = f"INVALID: {ex['reason']}"
    rows = [
        ("machine", r["machine"]),
        ("mode", mode + (" (flush before every pass)" if sec.get("flush_cache_before_each_pass") else "")),
        ("passes", passes_done_text(sec)),
        ("median wall", f"{f(t.get('median_wall_s'), '.3f')} s  (initial pass {f(t.get('initial_pass_wall_s'), '.3f')} s)"),
        ("pairs/s", f(t.get("pairs_per_s"), ".2f")),
        ("batch latency", f"p50 {f(lat.get('p50'), '.4f')} s, p99 {f(lat.get('p99'), '.4f')} s, "
                          f"max {f(lat.get('max'), '.4f')} s"),
        ("client overhead", f"{f(t.get('client_overhead_fraction') and 100 * t['client_overhead_fraction'], '.2f')}% of wall"),
        ("max |dp_e|", f"{f(ag.get('max_abs_dp_e'), '.6g')}  (max |dlogit| {f(ag.get('max_abs_logit_diff'), '.6g')})"),
        ("argmax changes", f"{ag.get('argmax_changes_count', 'n/a')}"),
        ("groups", f"{au.get('groups', 'n/a')} ({au.get('rows_in_groups', 'n/a')} rows; "
                   f"{au.get('singletons_not_covered', 'n/a')} singletons not covered)"),
        ("audit", f"failures {au.get('failures_total', 'n/a')}, ties {au.get('ties_total', 'n/a')} over "
                  f"{au.get('passes_audited', 0)} passes"),
        ("exclusive GPU", excl),
        ("retries", str(t.get("retries", 0))),
        ("warnings", "; ".join(r.get("warnings") or []) or "none"),
        ("result", f"{'VALID' if r['valid'] else 'INVALID'}, {'complete' if r['complete'] else 'INCOMPLETE'} "
                   f"(exit {r['exit_code']})"),
        ("receipt", str(out)),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"openjev bench{' ' + r['label'] if r.get('label') else ''}: {r['inputs']['rows']} rows, {r['server']['url']}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


# ================================================================ main
def check_args(args) -> None:
    for name in ("batch_size", "workers", "repetitions", "truncate"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if args.retries < 0:
        raise UserError("--retries must be >= 0")
    if not args.timeout > 0 or not args.sample_interval > 0:
        raise UserError("--timeout and --sample-interval must be > 0")
    if (args.exclusive_gpu is None) != (args.server_pid is None):
        raise UserError("--exclusive-gpu and --server-pid go together")
    parsed = urlparse(args.url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise UserError(f"--url {args.url!r} is not an http(s) URL")


def main() -> int:
    args = build_parser().parse_args()
    check_args(args)
    paths = out_paths(args.out)
    if not args.overwrite:
        for p in paths.values():
            if p.exists():
                raise UserError(f"output {p} already exists; refusing to overwrite it (pass --overwrite to replace it)")
    if not paths["json"].parent.is_dir():
        raise UserError(f"output directory {paths['json'].parent} does not exist")
    data = load_run_data(args)
    server_proc = None
    if args.server_pid is not None:
        server_proc = proc_id(args.server_pid)
        if server_proc is None:
            raise UserError(f"--server-pid {args.server_pid} is not a running process")

    started_at = utc_now()
    mode = "cold" if args.cold_cache else "warm"
    host = urlparse(args.url).hostname or ""
    local = host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
    client = Client(args.url, args.timeout, args.retries)
    reasons: list[str] = []
    warnings: list[str] = []
    receipt: dict = {
        "kind": KIND, "schema_version": SCHEMA_VERSION, "made_by": "app/bench_classify_v100.py",
        "label": args.label, "machine": None, "mode": mode, "valid": False, "complete": False,
        "exit_code": None, "reasons": reasons, "warnings": warnings,
        "started_at": started_at, "finished_at": None,
        "arguments": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()} | {"argv": sys.argv[1:]},
        "environment": environment_receipt(),
        "server": {"url": args.url, "info_before": None, "info_after": None, "model": None,
                   "flush_cache_calls_delta": None},
        "inputs": {"path": str(args.inputs), "sha256": data.inputs_sha, "rows": len(data.row_ids)},
        "tokens": {"path": str(args.tokens), "sha256": data.tokens_sha, "truncate": args.truncate,
                   "truncated_rows": data.truncated_rows, "ids_sha256": data.ids_sha,
                   "total_ids_sent_per_pass": int(sum(len(r) for r in data.rows)),
                   "max_row_length": int(max(len(r) for r in data.rows))},
        "reference": {"path": str(args.reference), "receipt_sha256": data.ref_json_sha,
                      "logits_sha256": data.ref_npy_sha, "made_at": data.ref_meta.get("made_at"),
                      "backend": data.ref_meta.get("backend"), "dtype": data.ref_meta.get("dtype"),
                      "device": data.ref_meta.get("device"), "mode": data.ref_meta.get("mode"),
                      "host": (data.ref_meta.get("environment") or {}).get("host")},
        "exclusive": None,
        "outputs": None,
    }
    groups, singletons = option_groups(data.inputs)
    section: dict = {
        "flush_cache_before_each_pass": args.cold_cache,
        "passes_planned": 1 + args.repetitions, "passes_done": 0, "measured_passes_done": 0,
        "passes": [], "timing": None, "agreement_final": None,
        "audit": {"definition": "option group = rows sharing premise and instruction (absent instruction is its "
                                "own value); reference winners = rows at the group's exact maximum reference p_e; "
                                "candidate choice = rows at the candidate's exact maximum; failure = a choice "
                                "outside the winners; tie = among several winners, the candidate's first choice "
                                "differs from the reference's first winner (input order)",
                  "groups": len(groups), "rows_in_groups": int(sum(map(len, groups))),
                  "singletons_not_covered": singletons,
                  "group_rows": [[data.row_ids[i] for i in g] for g in groups],
                  "passes_audited": 0, "failed": False, "failures_total": 0, "ties_total": 0,
                  "failures": [], "ties": []},
    }
    receipt[mode] = section

    def finish(code: int, stderr_line: str | None, pass_arrays: list[np.ndarray]) -> int:
        receipt["exit_code"] = code
        receipt["valid"] = code == EXIT_OK
        receipt["finished_at"] = utc_now()
        write_outputs(paths, receipt, pass_arrays)
        if section["passes_done"]:
            print_summary(receipt, paths["json"])
        if stderr_line:
            print(f"{Path(sys.argv[0]).name}: error: {stderr_line}; receipt {paths['json']}", file=sys.stderr,
                  flush=True)
        return code

    # ---------------------------------------------------------- the server, before anything is sent
    try:
        client.request("GET", "/health")  # any 2xx is up: SGLang's own /health answers with an empty body
        info = client.get_json("/server_info")
    except ServerFailure as exc:
        receipt["machine"] = derive_machine_label(args.machine_label, None, None, local, platform.platform(),
                                                  cpu_model_name())
        reasons.append(f"server unreachable at start: {exc}")
        return finish(EXIT_INCOMPLETE, reasons[-1], [])
    receipt["server"]["info_before"] = info
    if info.get("dtype") and data.ref_meta.get("dtype") and info["dtype"] != data.ref_meta["dtype"]:
        warnings.append(f"the reference is {data.ref_meta['dtype']} but the server runs {info['dtype']}: the "
                        "differences include the change of precision")
    ctx, cap = info.get("context_length"), info.get("max_batch_size")
    if isinstance(ctx, int) and max(len(r) for r in data.rows) >= ctx:
        raise UserError(f"the longest row has {max(len(r) for r in data.rows)} ids after --truncate {args.truncate}, "
                        f"not below the server's context length {ctx}; it would be rejected")
    if isinstance(cap, int) and args.batch_size > cap:
        raise UserError(f"--batch-size {args.batch_size} is over the server's limit of {cap} rows per request")
    if server_proc is not None and isinstance(info.get("pid"), int):
        now, desc = read_tree(args.server_pid)
        if info["pid"] not in {args.server_pid, *(p for p, _ in desc)}:
            raise UserError(f"the server at {args.url} reports pid {info['pid']}, which is neither --server-pid "
                            f"{args.server_pid} nor one of its descendants")

    monitor = None
    nvml_name = None
    if args.exclusive_gpu is not None:
        monitor = ExclusivityMonitor(args.exclusive_gpu, server_proc, args.sample_interval)
        nvml_name = monitor.gpu.info["name"] if monitor.gpu else None
    receipt["machine"] = derive_machine_label(args.machine_label, info.get("device"), nvml_name, local,
                                              platform.platform(), cpu_model_name())
    if monitor is not None:
        first = monitor.take()
        if first:
            monitor.stop()
            receipt["exclusive"] = monitor.report()
            reasons.append(f"exclusive GPU {args.exclusive_gpu}: {first[0]} (before the first request; nothing sent)")
            return finish(EXIT_EXCLUSIVE, reasons[-1], [])
        monitor.start()

    # ---------------------------------------------------------- the passes
    t_enc = time.perf_counter()
    offsets = [(s, min(s + args.batch_size, len(data.rows))) for s in range(0, len(data.rows), args.batch_size)]
    bodies = [json.dumps({"input_ids": data.rows[lo:hi]}, separators=(",", ":")).encode() for lo, hi in offsets]
    section["request_encode_s"] = time.perf_counter() - t_enc
    ref_pe = entailment_prob(data.reference)
    pass_arrays: list[np.ndarray] = []
    server_failure = False
    current = 0
    intr = _Interrupts()
    old_handlers = {sig: signal.signal(sig, intr.handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    pool = ThreadPoolExecutor(max_workers=args.workers, thread_name_prefix="bench-client")
    try:
        for i in range(1 + args.repetitions):
            current = i
            if intr.requested:
                raise KeyboardInterrupt
            kind = "initial" if i == 0 else "measured"
            flush = None
            if args.cold_cache:
                t0 = time.perf_counter()
                try:
                    resp, *_ = client.request("POST", "/flush_cache")
                except ServerFailure as exc:
                    reasons.append(f"{pass_name(i, 1 + args.repetitions)}: /flush_cache before it failed: {exc}; "
                                   f"passes {passes_done_text(section)}")
                    server_failure = True
                    break
                flush = {"status": resp.status_code, "s": round(time.perf_counter() - t0, 4)}
            intr.armed = True  # a signal now discards the pass in flight; elsewhere it stops before the next
            try:
                if intr.requested:
                    raise KeyboardInterrupt
                p = run_pass(client, pool, bodies, offsets, len(data.rows), i, kind,
                             f"{mode} {pass_name(i, 1 + args.repetitions)}")
            finally:
                intr.armed = False
            p.flush = flush
            entry = pass_entry(p, data, ref_pe, groups)
            section["passes"].append(entry)
            receipt["server"]["model"] = receipt["server"]["model"] or p.model
            if p.logits is None:
                reasons.append(f"{pass_name(i, 1 + args.repetitions)} stopped: {p.error}; passes {passes_done_text(section)}")
                server_failure = True
                break
            pass_arrays.append(p.logits)
            section["passes_done"] += 1
            section["measured_passes_done"] += kind == "measured"
            au = entry["audit"]
            for fl in au["failures"]:
                section["audit"]["failures"].append({"pass": i, **fl})
            for tie in au["ties"]:
                section["audit"]["ties"].append({"pass": i, **tie})
            section["audit"]["passes_audited"] += 1
            _pass_line(entry, 1 + args.repetitions, mode)
    except KeyboardInterrupt:
        name = pass_name(current, 1 + args.repetitions)
        where = (f"during {name} (discarded)" if intr.in_pass else f"before {name}")
        reasons.append(f"interrupted ({intr.signame}) {where}; passes {passes_done_text(section)}")
        server_failure = True
    finally:
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        pool.shutdown(wait=False, cancel_futures=True)
        if monitor is not None:
            monitor.stop()

    # ---------------------------------------------------------- figures, verdict, files
    try:
        receipt["server"]["info_after"] = client.get_json("/server_info", retry=False)
    except ServerFailure as exc:
        warnings.append(f"/server_info after the run: {exc}")
    before, after = receipt["server"]["info_before"], receipt["server"]["info_after"]
    if after is not None:
        if isinstance(before.get("flush_cache_calls"), int) and isinstance(after.get("flush_cache_calls"), int):
            receipt["server"]["flush_cache_calls_delta"] = after["flush_cache_calls"] - before["flush_cache_calls"]
        if before.get("pid") != after.get("pid") or before.get("started_at") != after.get("started_at"):
            warnings.append(f"the server answering {args.url} changed during the run (pid {before.get('pid')} -> "
                            f"{after.get('pid')})")
    section["timing"] = timing_summary(section["passes"], len(data.rows))
    if section["timing"]["retries"]:
        warnings.append(f"{section['timing']['retries']} request(s) were retried (passes "
                        f"{section['timing']['retried_passes']}); those wall times include the backoff")
    if pass_arrays:
        section["agreement_final"] = agreement(pass_arrays[-1], data.reference, data.row_ids, full=True)
        section["agreement_final"]["pass"] = section["passes_done"] - 1
    au = section["audit"]
    au["failures_total"], au["ties_total"] = len(au["failures"]), len(au["ties"])
    au["failed"] = bool(au["failures"])
    receipt["complete"] = section["passes_done"] == section["passes_planned"]
    if monitor is not None:
        receipt["exclusive"] = monitor.report()
        if not receipt["exclusive"]["valid"]:
            reasons.append(f"exclusive GPU {args.exclusive_gpu}: {receipt['exclusive']['reason']} "
                           f"({receipt['exclusive']['violating_samples']} of {receipt['exclusive']['samples']} samples)")
    if au["failed"]:
        fl = au["failures"][0]
        reasons.insert(0, f"group audit failed: {au['failures_total']} choice(s) outside the reference winners; first: "
                          f"{pass_name(fl['pass'], 1 + args.repetitions)} group [{' '.join(fl['rows'])}] chose {' '.join(fl['candidate_choice'])}, "
                          f"outside winners [{' '.join(fl['reference_winners'])}]")
    code = decide_exit(au["failed"], server_failure, receipt["exclusive"]["valid"] if receipt["exclusive"] else None)
    code = finish(code, reasons[0] if code else None, pass_arrays)
    if server_failure:
        # requests of the stopped pass may still hang in worker threads until --timeout; everything is written
        # (fsync'd and renamed), so leave now instead of letting the interpreter join them
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _pass_line(entry: dict, total: int, mode: str) -> None:
    """One line per pass on stderr (the progress bar, on a TTY only, is cleared when its pass ends)."""
    ag, au = entry["agreement"], entry["audit"]
    print(f"{mode} {pass_name(entry['index'], total)}: {entry['rows']} rows in "
          f"{entry['wall_s']:.3f} s, max |dp_e| {ag['max_abs_dp_e']:.3g}, argmax changes "
          f"{ag['argmax_changes_count']}, audit failures {au['failures_count']}, ties {au['ties_count']}",
          file=sys.stderr, flush=True)


class _Interrupts:
    """SIGTERM/SIGINT during the passes: interrupt a pass in flight (it is discarded whole), or, between passes,
    stop before the next one, so the passes kept and their bookkeeping always agree."""

    def __init__(self):
        self.requested = False
        self.armed = False
        self.in_pass = False  # the signal landed inside a pass (that pass is discarded)
        self.signame = "SIGINT/SIGTERM"

    def handler(self, signum, frame):
        if not self.requested:
            self.signame = signal.Signals(signum).name
        self.requested = True
        if self.armed:
            self.in_pass = True
            raise KeyboardInterrupt


if __name__ == "__main__":
    run_main(main)
