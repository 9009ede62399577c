#!/usr/bin/env python3
"""Turn an NLI input set into exact token ids with the model's own tokenizer.

Input set (JSONL, one object per line): {"id", "premise", "hypothesis", "instruction"?, "group"?}.
Output token file (JSONL): {"id", "input_ids"} in input order, plus OUT.receipt.json recording
the input sha256, the tokenizer files' sha256, the template and the length statistics.
Every later step (reference scorer, bench) reads these exact ids, so a tokenizer or template
change shows up as a token-hash mismatch instead of a silent drift.

The pair is rendered with --template, a Python format string over {instruction}, {premise}
and {hypothesis} (a missing instruction renders as ""; leading blank lines are stripped).
The default must match how the checkpoint was trained; set it explicitly for a real checkpoint.

Example:
  tokenize_nli.py --model $OPENJEV_V100_ROOT/model --inputs data/nli_sample.jsonl --out build/sample.tokens.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from openjev.common import (UserError, atomic_write_bytes, atomic_write_json, read_inputs, refuse_existing, run_main,
                     sha256_file, utc_now)

DEFAULT_TEMPLATE = "{instruction}\nPremise: {premise}\nHypothesis: {hypothesis}"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="model (or overlay) directory holding the tokenizer")
    p.add_argument("--inputs", type=Path, required=True, help="input set JSONL")
    p.add_argument("--out", type=Path, required=True, help="token file to write (JSONL; must not exist)")
    p.add_argument("--template", default=DEFAULT_TEMPLATE, help=f"pair template (default: {DEFAULT_TEMPLATE!r})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return p


def render(row: dict, template: str) -> str:
    try:
        text = template.format(instruction=row.get("instruction") or "", premise=row["premise"],
                               hypothesis=row["hypothesis"])
    except (KeyError, IndexError) as exc:
        raise UserError(f"--template refers to an unknown field {exc}; use {{instruction}}, {{premise}}, {{hypothesis}}") from None
    return text.lstrip("\n")


def main() -> int:
    args = build_parser().parse_args()
    refuse_existing(args.out, args.overwrite, "token file")
    rows = read_inputs(args.inputs)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load a tokenizer from {args.model}: {str(exc).splitlines()[0]}") from None
    encoded = tok([render(r, args.template) for r in rows], add_special_tokens=True)["input_ids"]
    body = "".join(json.dumps({"id": r["id"], "input_ids": ids}, separators=(",", ":")) + "\n"
                   for r, ids in zip(rows, encoded))
    lengths = sorted(len(x) for x in encoded)
    atomic_write_bytes(args.out, body.encode())
    try:
        write_receipt(args, rows, lengths)
    except BaseException:
        args.out.unlink(missing_ok=True)  # tokens without their receipt would look complete
        raise
    print(f"wrote {args.out}: {len(rows)} rows, {sum(lengths)} tokens (max {lengths[-1]})")
    return 0


def write_receipt(args, rows, lengths) -> None:
    atomic_write_json(args.out.with_name(args.out.name + ".receipt.json"), {
        "made_by": "app/tokenize_nli.py", "made_at": utc_now(),
        "inputs": {"path": str(args.inputs), "sha256": sha256_file(args.inputs), "rows": len(rows)},
        "tokens": {"path": str(args.out), "sha256": sha256_file(args.out)},
        "tokenizer": {n: sha256_file(args.model / n) for n in TOKENIZER_FILES if (args.model / n).is_file()},
        "template": args.template,
        "lengths": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1]},
    })


if __name__ == "__main__":
    run_main(main)
