#!/usr/bin/env python3
"""Send a token file to a running `/classify` server and print the logits table.

An operator's quick look (the timed, audited run is bench_classify_v100.py): posts the exact ids
of a token file in batches, prints one line per row (id, raw logits C/E/N, argmax label) and, with
--reference, the reference label and the largest absolute logit difference per row, then an
agreement summary. Exit status 0 when every row was scored (and, with --reference, every argmax
agrees); 1 otherwise.

Example:
  classify_tokens.py --url http://127.0.0.1:31000 --tokens build/sample.tokens.jsonl --reference results/ref_sample
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import requests

from openjev.common import LABELS, UserError, read_inputs, read_tokens, run_main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:31000")
    p.add_argument("--tokens", type=Path, required=True, help="token file (JSONL {id, input_ids})")
    p.add_argument("--inputs", type=Path, default=None, help="input set, to show premise/hypothesis snippets")
    p.add_argument("--reference", type=Path, default=None, help="reference directory (reference.npy + reference.json)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per request (default: 32)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    return p


def post_rows(url: str, rows: list[list[int]], timeout: float) -> np.ndarray:
    try:
        resp = requests.post(f"{url.rstrip('/')}/classify", json={"input_ids": rows}, timeout=timeout)
    except requests.RequestException as exc:
        raise UserError(f"POST {url}/classify failed: {exc}") from None
    if resp.status_code != 200:
        raise UserError(f"POST {url}/classify answered {resp.status_code}: {resp.text[:300]}")
    body = resp.json()
    if body.get("labels") != list(LABELS):
        raise UserError(f"server label order {body.get('labels')} is not {list(LABELS)}")
    return np.asarray(body["logits"], dtype=np.float32)


def load_reference(ref_dir: Path, row_ids: list[str]) -> np.ndarray:
    try:
        meta = json.loads((ref_dir / "reference.json").read_text())
        ref = np.load(ref_dir / "reference.npy")
    except FileNotFoundError as exc:
        raise UserError(f"reference {ref_dir} is incomplete: {exc.filename} missing") from None
    if meta.get("row_ids") != row_ids:
        raise UserError(f"reference {ref_dir} was made for other rows (row ids differ from the token file)")
    return ref


def main() -> int:
    args = build_parser().parse_args()
    row_ids, rows = read_tokens(args.tokens)
    snippets = {}
    if args.inputs:
        snippets = {r["id"]: r["hypothesis"] for r in read_inputs(args.inputs)}
    ref = load_reference(args.reference, row_ids) if args.reference else None
    logits = np.concatenate([post_rows(args.url, rows[s:s + args.batch_size], args.timeout)
                             for s in range(0, len(rows), args.batch_size)])
    width = max(len(i) for i in row_ids)
    head = f"{'id':<{width}}  {'contradiction':>13} {'entailment':>11} {'neutral':>9}  {'label':<13}"
    print(head + ("  reference      max|diff|" if ref is not None else "") + ("  hypothesis" if snippets else ""))
    for i, rid in enumerate(row_ids):
        c, e, n = logits[i]
        line = f"{rid:<{width}}  {c:>13.6f} {e:>11.6f} {n:>9.6f}  {LABELS[int(np.argmax(logits[i]))]:<13}"
        if ref is not None:
            line += f"  {LABELS[int(np.argmax(ref[i]))]:<13}  {np.abs(logits[i] - ref[i]).max():.3e}"
        if snippets:
            line += f"  {snippets.get(rid, '')[:48]}"
        print(line)
    if ref is None:
        return 0
    changed = [row_ids[i] for i in np.flatnonzero(np.argmax(logits, 1) != np.argmax(ref, 1))]
    print(f"\n{len(rows)} rows; argmax agreement {len(rows) - len(changed)}/{len(rows)}; "
          f"max |logit diff| {np.abs(logits - ref).max():.3e}; bitwise equal: {np.array_equal(logits, ref)}")
    if changed:
        print("argmax changed: " + ", ".join(changed))
        return 1
    return 0


if __name__ == "__main__":
    run_main(main)
