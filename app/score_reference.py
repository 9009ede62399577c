#!/usr/bin/env python3
"""Reference scorer: an unmodified Transformers forward over exact token ids.

Writes into the new directory OUT:
  reference.npy      float32 [rows, 3] raw logits, contradiction/entailment/neutral, token-file order
  reference.json     receipt: input and token sha256, the sha256 of the ids actually scored (after
                     truncation), model files' sha256, dtype, device, mode, row ids, environment
  tokens.sha256      `sha256sum -c` compatible line for the token file

FP16 on a GPU (the spec's reference); on a CPU float32, recorded as such. --batch-size 1 (the
default) scores each row alone and unpadded: the purest reference. A larger batch pads rows into
one forward (faster on a GPU, recorded as mode "padded").

Example:
  score_reference.py --model $OPENJEV_V100_ROOT/model --tokens G.tokens.jsonl --inputs G.jsonl --out results/ref_G
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from _common import (LABELS, UserError, atomic_write_bytes, atomic_write_json, environment_receipt, ids_sha256,
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
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.out.exists():
        raise UserError(f"output directory {args.out} already exists; refusing to overwrite it")
    if args.batch_size < 1 or args.truncate < 1:
        raise UserError("--batch-size and --truncate must be positive")
    row_ids, rows = read_tokens(args.tokens)
    inputs_entry = None
    if args.inputs is not None:
        input_ids = [r["id"] for r in read_inputs(args.inputs)]
        if input_ids != row_ids:
            raise UserError(f"token file {args.tokens} rows do not match input set {args.inputs} (ids or order differ)")
        inputs_entry = {"path": str(args.inputs), "sha256": sha256_file(args.inputs)}
    rows, n_cut = truncate_rows(rows, args.truncate)

    import torch  # noqa: F401  (recorded in the environment receipt)
    from _classifier import load_classifier, score_exact, score_padded, weight_files

    clf = load_classifier(args.model, args.device, args.dtype)
    for i, r in enumerate(rows):
        if max(r) >= clf.vocab_size:
            raise UserError(f"row {row_ids[i]}: token id {max(r)} is out of the model's vocabulary ({clf.vocab_size})")
    t0 = time.perf_counter()
    chunks = []
    with tqdm(total=len(rows), unit="row", desc="reference", disable=None, file=sys.stderr) as bar:
        for start in range(0, len(rows), args.batch_size):
            part = rows[start:start + args.batch_size]
            chunks.append(score_exact(clf, part) if args.batch_size == 1 else score_padded(clf, part))
            bar.update(len(part))
    logits = np.concatenate(chunks).astype(np.float32)
    elapsed = time.perf_counter() - t0

    staging = args.out.with_name(f".{args.out.name}.partial")
    staging.mkdir(parents=True, exist_ok=False)
    np.save(staging / "reference.npy", logits)
    tokens_sha = sha256_file(args.tokens)
    atomic_write_bytes(staging / "tokens.sha256", f"{tokens_sha}  {args.tokens.name}\n".encode())
    atomic_write_json(staging / "reference.json", {
        "kind": "openjev-reference", "made_by": "app/score_reference.py", "made_at": utc_now(),
        "labels": list(LABELS), "rows": len(rows), "row_ids": row_ids,
        "inputs": inputs_entry,
        "tokens": {"path": str(args.tokens), "sha256": tokens_sha, "truncate": args.truncate,
                   "truncated_rows": n_cut, "ids_sha256": ids_sha256(rows)},
        "model": {"path": str(args.model), "resolved": str(args.model.resolve()), "files": weight_files(args.model)},
        "backend": "transformers", "dtype": clf.dtype, "device": clf.device,
        "mode": "exact" if args.batch_size == 1 else "padded", "batch_size": args.batch_size,
        "logits_sha256": sha256_file(staging / "reference.npy"), "elapsed_s": round(elapsed, 3),
        "environment": environment_receipt(),
    })
    staging.rename(args.out)
    print(f"wrote {args.out}/reference.npy ({len(rows)} rows, {clf.dtype} on {clf.device}, {elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    run_main(main)
