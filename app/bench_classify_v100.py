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
    fails too: a consumer that breaks ties by position could pick the non-winner); each failure
    records reference_margin (the reference's p_e lead of its winner over the row chosen) and
    candidate_margin (the candidate's lead of that row over the winner): a near tie shows as a
    margin below the run's max |dp_e|;
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
import json
import os
import platform
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from openjev.bench.agreement import (EXIT_EXCLUSIVE, EXIT_INCOMPLETE, EXIT_OK, agreement, decide_exit,
                                     option_groups, timing_summary)
from openjev.bench.client import Client, ServerFailure, add_pass_args, pass_entry, run_pass
from openjev.bench.inputs import load_run_data
from openjev.bench.receipt import (KIND, SCHEMA_VERSION, cpu_model_name, derive_machine_label, out_paths,
                                   pass_name, passes_done_text, print_summary, write_outputs)
from openjev.common import UserError, entailment_prob, environment_receipt, run_main, utc_now
from openjev.gpu import ExclusivityMonitor, proc_id, read_tree


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:31003")
    p.add_argument("--inputs", type=Path, required=True, help="input set JSONL {id, premise, hypothesis, instruction?}")
    p.add_argument("--tokens", type=Path, required=True, help="token file JSONL {id, input_ids} made from --inputs")
    p.add_argument("--reference", type=Path, required=True,
                   help="reference directory from score_reference.py (reference.npy + reference.json)")
    p.add_argument("--out", type=Path, required=True,
                   help="receipt path OUT.json; also writes OUT.candidate.npy and OUT.passes.npy")
    add_pass_args(p)
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


# ================================================================ exclusivity: pure decision


# ================================================================ exclusivity: I/O (psutil, NVML)


# ================================================================ inputs and the reference


# ================================================================ HTTP client


# ================================================================ one pass


# ================================================================ receipt


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
                          f"outside winners [{' '.join(fl['reference_winners'])}] (reference margin "
                          f"{fl['reference_margin']:.5f}, candidate's {fl['candidate_margin']:.5f} in p_e)")
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
