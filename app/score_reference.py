#!/usr/bin/env python3
"""Reference scorer: an unmodified Transformers forward over exact token ids.

Writes into the new directory OUT:
  reference.npy      float32 [rows, 3] raw logits, contradiction/entailment/neutral, token-file order
  reference.json     receipt: input and token sha256, the sha256 of the ids actually scored (after
                     truncation), model files' sha256, dtype, device, mode, row ids, environment
  tokens.sha256      `sha256sum -c` compatible line for the token file

FP16 on a GPU (the spec's reference); on a CPU float32, recorded as such. --batch-size 1 (the
default) scores each row alone and unpadded: the purest reference. A larger batch pads rows of
similar length into one forward (recorded as mode "padded"); its full-attention layers attend
row by row and cuBLAS runs without split-K (openjev/engine/classifier.py, openjev/engine/kernels.py), so on a GPU the
padded logits are bitwise the unpadded ones (H200: 128 rows, 41.6 rows/s with --batch-size 8
against 18.5 unpadded, results_h200/embedded_gpu/call9-rowwise). --verify-rows N checks that on
the machine at hand: N rows are scored again unpadded and must match bit for bit, else nothing is
written. On a CPU the PyTorch GDN fallback is not batch-invariant: padded differs in the last bits.

The forward is Transformers' own, with Transformers' own kernel choice: on a GPU with the extra of
requirements-gpu-embedded.txt installed, flash-linear-attention's Triton kernels for the GDN
layers (checked against a float64 recurrence first), else its PyTorch fallback, the reason
logged; --kernels torch forces the fallback. The receipt records the path that ran
("kernel_path"), the untimed warm-up forwards (--warmup) that compile those kernels before the
clock starts, and "compute_bound": the matmul FLOPs of the pass against the matmul peak measured
in the same run (fp16 on a GPU, float32 on a CPU).

Example:
  score_reference.py --model $OPENJEV_V100_ROOT/model --tokens G.tokens.jsonl --inputs G.jsonl --out results/ref_G
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from openjev.common import (LABELS, UserError, atomic_write_bytes, atomic_write_json, environment_receipt, ids_sha256,
                     read_inputs, read_tokens, run_main, sha256_file, truncate_rows, utc_now)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="model (or overlay) directory")
    p.add_argument("--tokens", type=Path, required=True, help="token file (JSONL {id, input_ids})")
    p.add_argument("--inputs", type=Path, default=None, help="the input set the tokens came from (its sha256 is recorded; ids must match)")
    p.add_argument("--out", type=Path, required=True, help="output directory (must not exist)")
    p.add_argument("--truncate", type=int, default=4096, help="keep the first N tokens of each row (default: 4096, as the bench)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"],
                   help="auto = float16 on a GPU, float32 on a CPU (default: auto)")
    p.add_argument("--batch-size", type=int, default=1, help="rows per forward; >1 pads (default: 1, unpadded)")
    p.add_argument("--kernels", choices=["auto", "torch"], default=None,
                   help="GDN kernels: auto = flash-linear-attention where it runs, torch = Transformers' PyTorch "
                        "fallback (default: $OPENJEV_KERNELS or auto)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed forwards before the timed pass, compiling the kernels (default: 2)")
    p.add_argument("--no-peak", action="store_true", help="skip the matmul-peak measurement of compute_bound")
    p.add_argument("--threads", type=int, default=0,
                   help="exact mode on a GPU: threads sharing the model, a CUDA stream each (a warm exact forward "
                        "is launch-bound; the logits do not depend on it); 0 = auto: 2 on a GPU, 1 on a CPU "
                        "(default: 0)")
    p.add_argument("--verify-rows", type=int, default=0,
                   help="with --batch-size > 1: score N rows (shortest to longest) again unpadded after the timed "
                        "pass and refuse to write anything unless their logits are bitwise the padded ones "
                        "(default: 0, no check)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes sharing the device, each loading the model and scoring a share of the rows "
                        "with the same forwards (one forward is launch-bound on a GPU: 2 keep it busy); the "
                        "logits do not depend on it (default: 1)")
    return p


def load_checked(args, rows, row_ids):
    from openjev.engine.classifier import load_classifier
    from openjev.engine.kernels import path_label

    clf = load_classifier(args.model, args.device, args.dtype)
    for i, r in enumerate(rows):
        if max(r) >= clf.vocab_size:
            raise UserError(f"row {row_ids[i]}: token id {max(r)} is out of the model's vocabulary ({clf.vocab_size})")
    print(f"kernel path: {path_label(clf.kernels)} ({clf.kernels['selection']['reason']})", file=sys.stderr)
    return clf


def resolve_threads(requested: int, device: str, batch_size: int) -> int:
    """--threads: 0 = 2 on a GPU in exact mode, else 1; a CPU or padded batches run one."""
    if batch_size > 1 or not str(device).startswith("cuda"):
        return 1
    return requested or 2


def score_units(clf, rows, units, out, threads=1, bar=None) -> None:
    from openjev.engine.classifier import score_exact, score_padded

    singles = [u[0] for u in units if len(u) == 1]
    if singles:  # exact rows in one call: deferred copies, and threads where asked
        out[singles] = score_exact(clf, [rows[i] for i in singles], threads,
                                   progress=bar.update if bar is not None else None)
    for unit in (u for u in units if len(u) > 1):
        out[unit] = score_padded(clf, [rows[i] for i in unit])
        if bar is not None:
            bar.update(len(unit))


def verify_picks(rows: list[list[int]], n: int) -> list[int]:
    """n row indices spread from the shortest row to the longest (each at most once)."""
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]), i))
    n = min(n, len(order))
    if n <= 0:
        return []
    return sorted({order[round(k * (len(order) - 1) / max(1, n - 1))] for k in range(n)})


def verify_padded(clf, rows, logits, n: int) -> dict | None:
    """--verify-rows: the picked rows' unpadded logits against the padded pass's, bit for bit."""
    from openjev.engine.classifier import score_exact

    picks = verify_picks(rows, n)
    if not picks:
        return None
    exact = score_exact(clf, [rows[i] for i in picks])
    diff = np.abs(exact - logits[picks])
    unequal = int((diff.max(axis=1) > 0).sum() + (~np.isfinite(diff)).any(axis=1).sum())
    result = {"rows": len(picks), "row_indices": picks, "lengths": [len(rows[i]) for i in picks],
              "bitwise_equal": bool(np.array_equal(exact, logits[picks])), "unequal_rows": unequal,
              "max_abs_logit_diff": float(np.nanmax(diff)) if diff.size else 0.0}
    if not result["bitwise_equal"]:
        raise UserError(f"--verify-rows: the padded logits of {unequal} of {len(picks)} rows are not bitwise their "
                        f"unpadded logits (max |dlogit| {result['max_abs_logit_diff']:.3g}) on {clf.device}, "
                        f"kernels {(clf.kernels or {}).get('gdn')}; this padded reference is not exact here: "
                        "use --batch-size 1 (nothing written)")
    return result


def score_here(args, rows, row_ids, units):
    from openjev.engine.warmup import warm_up

    clf = load_checked(args, rows, row_ids)
    warm = warm_up(clf, rows, args.warmup, padded=args.batch_size > 1)
    logits = np.empty((len(rows), len(LABELS)), dtype=np.float32)
    t0 = time.perf_counter()
    threads = resolve_threads(args.threads, clf.device, args.batch_size)
    with tqdm(total=len(rows), unit="row", desc="reference", disable=None, file=sys.stderr) as bar:
        score_units(clf, rows, units, logits, threads, bar)
    elapsed = time.perf_counter() - t0
    verify = verify_padded(clf, rows, logits, args.verify_rows) if args.batch_size > 1 else None
    return ({"dtype": clf.dtype, "device": clf.device, "kernels": clf.kernels, "warmup": warm, "threads": threads,
             "verify": verify}, logits, elapsed)


def _worker(args, rows, row_ids, units, ready, go, results) -> None:
    """One scoring process: load, warm up, report ready, wait for the common start, score."""
    try:
        from openjev.engine.warmup import warm_up

        clf = load_checked(args, rows, row_ids)
        warm = warm_up(clf, rows, args.warmup, padded=args.batch_size > 1)
        threads = resolve_threads(args.threads, clf.device, args.batch_size)
        ready.put({"dtype": clf.dtype, "device": clf.device, "kernels": clf.kernels, "warmup": warm, "threads": threads})
        go.wait()
        out = np.empty((len(rows), len(LABELS)), dtype=np.float32)
        score_units(clf, rows, units, out, threads)
        if clf.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        idx = [i for u in units for i in u]
        results.put((idx, out[idx]))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it as one line
        msg = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
        ready.put({"error": msg})
        results.put(({"error": msg}, None))


def score_in_workers(args, rows, row_ids, units):
    """--workers N processes on one device; units dealt longest first to the least-loaded worker.
    The clock runs from the common start (all loaded and warmed) to the last result."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    shares: list[list[list[int]]] = [[] for _ in range(args.workers)]
    load = [0] * args.workers
    for unit in sorted(units, key=lambda u: -sum(len(rows[i]) for i in u)):
        k = load.index(min(load))
        shares[k].append(unit)
        load[k] += sum(len(rows[i]) for i in unit)
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(args, rows, row_ids, share, ready, go, results), daemon=True)
             for share in shares]
    for p in procs:
        p.start()
    try:
        infos = [ready.get(timeout=1800) for _ in procs]
        errors = [i["error"] for i in infos if "error" in i]
        if errors:
            raise UserError(errors[0])
        print(f"{args.workers} workers loaded and warmed; scoring", file=sys.stderr)
        logits = np.full((len(rows), len(LABELS)), np.nan, dtype=np.float32)
        t0 = time.perf_counter()
        go.set()
        for _ in procs:
            idx, part = results.get(timeout=7200)
            if isinstance(idx, dict):
                raise UserError(idx["error"])
            logits[idx] = part
        elapsed = time.perf_counter() - t0
    finally:
        go.set()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if np.isnan(logits).any():
        raise UserError("a worker returned no logits for some rows")
    info = dict(infos[0])
    info["warmup"] = {"per_worker": [i["warmup"] for i in infos]}
    return info, logits, elapsed


def main() -> int:
    args = build_parser().parse_args()
    if args.out.exists():
        raise UserError(f"output directory {args.out} already exists; refusing to overwrite it")
    if args.batch_size < 1 or args.truncate < 1 or args.warmup < 0 or args.workers < 1 or args.threads < 0:
        raise UserError("--batch-size, --truncate and --workers must be positive, --warmup and --threads not negative")
    if args.verify_rows < 0:
        raise UserError("--verify-rows must not be negative")
    if args.verify_rows and args.batch_size == 1:
        raise UserError("--verify-rows checks padded batches against unpadded rows; with --batch-size 1 every row "
                        "is already unpadded")
    if args.verify_rows and args.workers > 1:
        raise UserError("--verify-rows runs in the scoring process: use it with --workers 1")
    if args.kernels:
        os.environ["OPENJEV_KERNELS"] = args.kernels
    row_ids, rows = read_tokens(args.tokens)
    inputs_entry = None
    if args.inputs is not None:
        input_ids = [r["id"] for r in read_inputs(args.inputs)]
        if input_ids != row_ids:
            raise UserError(f"token file {args.tokens} rows do not match input set {args.inputs} (ids or order differ)")
        inputs_entry = {"path": str(args.inputs), "sha256": sha256_file(args.inputs)}
    rows, n_cut = truncate_rows(rows, args.truncate)

    import torch  # noqa: F401  (recorded in the environment receipt)
    from openjev.engine.flops import compute_bound, measure_matmul_peak, model_flops
    from openjev.engine.kernels import path_label

    # units of work: single rows (exact), or batches of rows of similar length (the rows sorted by
    # length, then cut every --batch-size), the same whatever --workers is
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]), i)) if args.batch_size > 1 else list(range(len(rows)))
    units = [order[s:s + args.batch_size] for s in range(0, len(order), args.batch_size)]
    if args.workers == 1:
        info, logits, elapsed = score_here(args, rows, row_ids, units)
    else:
        info, logits, elapsed = score_in_workers(args, rows, row_ids, units)
    clf_dtype, clf_device, kernels = info["dtype"], info["device"], info["kernels"]
    bound = None
    if not args.no_peak:
        peak_dtype = "float32" if clf_device == "cpu" else "float16"
        bound = compute_bound(measure_matmul_peak(clf_device, peak_dtype), peak_dtype,
                              model_flops(args.model, sum(len(r) for r in rows)), elapsed)

    staging = args.out.with_name(f".{args.out.name}.partial")
    if staging.is_dir():  # left by a run killed while writing: never complete, never read
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        write_reference(staging, args, logits, rows, row_ids, inputs_entry, n_cut, info, elapsed, bound)
        staging.rename(args.out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a full disk or a read-only folder leaves nothing
        raise
    print(f"wrote {args.out}/reference.npy ({len(rows)} rows, {clf_dtype} on {clf_device}, {elapsed:.1f} s, "
          f"{len(rows) / elapsed:.2f} rows/s, {args.workers} worker(s) x {info['threads']} thread(s), kernels {path_label(kernels)}"
          + (f", {bound['fraction_of_peak']:.3f} of the {bound['peak_dtype']} matmul peak" if bound else "") + ")")
    return 0


def write_reference(staging: Path, args, logits, rows, row_ids, inputs_entry, n_cut, info, elapsed, bound) -> None:
    """Into `staging`: reference.npy, tokens.sha256, and reference.json once it fits its model (else UserError)."""
    from openjev.engine.classifier import weight_files
    from openjev.receipts import ReferenceReceipt, check_receipt

    np.save(staging / "reference.npy", logits)
    tokens_sha = sha256_file(args.tokens)
    atomic_write_bytes(staging / "tokens.sha256", f"{tokens_sha}  {args.tokens.name}\n".encode())
    receipt = {
        "kind": "openjev-reference", "made_by": "app/score_reference.py", "made_at": utc_now(),
        "labels": list(LABELS), "rows": len(rows), "row_ids": row_ids,
        "inputs": inputs_entry,
        "tokens": {"path": str(args.tokens), "sha256": tokens_sha, "truncate": args.truncate,
                   "truncated_rows": n_cut, "ids_sha256": ids_sha256(rows)},
        "model": {"path": str(args.model), "resolved": str(args.model.resolve()), "files": weight_files(args.model)},
        "backend": "transformers", "dtype": info["dtype"], "device": info["device"],
        "mode": "exact" if args.batch_size == 1 else "padded", "batch_size": args.batch_size, "workers": args.workers,
        "threads": {"requested": args.threads, "ran": info["threads"]}, "verify": info.get("verify"),
        "logits_sha256": sha256_file(staging / "reference.npy"), "elapsed_s": round(elapsed, 3),
        "rows_per_s": round(len(rows) / elapsed, 3) if elapsed > 0 else None,
        "warmup": info["warmup"], "kernel_path": info["kernels"], "compute_bound": bound,
        "environment": environment_receipt(),
    }
    check_receipt(ReferenceReceipt, receipt, args.out / "reference.json")
    atomic_write_json(staging / "reference.json", receipt)


if __name__ == "__main__":
    run_main(main)
