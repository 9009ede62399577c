#!/usr/bin/env python3
"""Make a synthetic NLI input set and its token file, for benchmarks on random-weight models.

Real text means nothing to a random-weight model, but lengths and shared prefixes do: they set
the work and what a prefix cache can reuse. Rows come in option groups (1 to --max-group rows
sharing an instruction and a premise, so their token prefixes are identical, as in a real input
set) with lengths drawn uniformly from the given ranges. Writes:

  OUT.jsonl          input set rows {id, premise, hypothesis, instruction, group}
  OUT.tokens.jsonl   token file rows {id, input_ids}: instruction + premise + hypothesis ids

Example (about the shape of the runbook's larger set):
  make_synthetic_inputs.py build/T --rows 564 --premise-tokens 300:2500 --vocab 512
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from openjev.common import UserError, atomic_write_bytes, refuse_existing, run_main


def span(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="output prefix: writes OUT.jsonl and OUT.tokens.jsonl (must not exist)")
    p.add_argument("--rows", type=int, required=True, help="number of rows")
    p.add_argument("--max-group", type=int, default=4, help="largest option group (default: 4; 1 = all singletons)")
    p.add_argument("--premise-tokens", type=span, default=(200, 1500), help="premise length range (default: 200:1500)")
    p.add_argument("--hypothesis-tokens", type=span, default=(8, 40), help="hypothesis length range (default: 8:40)")
    p.add_argument("--instruction-tokens", type=int, default=24, help="instruction length (default: 24)")
    p.add_argument("--instructions", type=int, default=2, help="distinct instructions (default: 2)")
    p.add_argument("--vocab", type=int, default=512, help="ids are drawn from [3, VOCAB) (default: 512)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    return p


def synthesize(args) -> tuple[list[dict], list[dict]]:
    rng = random.Random(args.seed)
    ids = lambda n: [rng.randrange(3, args.vocab) for _ in range(n)]  # noqa: E731
    instructions = [ids(args.instruction_tokens) for _ in range(args.instructions)]
    inputs, tokens, g = [], [], 0
    while len(inputs) < args.rows:
        size = min(rng.randint(1, args.max_group), args.rows - len(inputs))
        ins = rng.randrange(args.instructions)
        premise = ids(rng.randint(*args.premise_tokens))
        for k in range(size):
            rid = f"syn{g:05d}-{k}"
            inputs.append({"id": rid, "premise": f"synthetic premise {g}", "hypothesis": f"synthetic hypothesis {g}-{k}",
                           "instruction": f"synthetic instruction {ins}", "group": f"syn{g:05d}"})
            tokens.append({"id": rid, "input_ids": instructions[ins] + premise + ids(rng.randint(*args.hypothesis_tokens))})
        g += 1
    return inputs, tokens


def main() -> int:
    args = build_parser().parse_args()
    if args.rows < 1 or args.max_group < 1 or args.vocab < 4 or args.instructions < 1:
        raise UserError("--rows, --max-group, --instructions must be >= 1 and --vocab >= 4")
    paths = (args.out.with_name(args.out.name + ".jsonl"), args.out.with_name(args.out.name + ".tokens.jsonl"))
    for path in paths:
        refuse_existing(path, flag=None)
    inputs, tokens = synthesize(args)
    for path, rows in zip(paths, (inputs, tokens)):
        atomic_write_bytes(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode())
    n_tok = sum(len(t["input_ids"]) for t in tokens)
    print(f"wrote {paths[0]} and {paths[1]}: {len(inputs)} rows, {n_tok} tokens, "
          f"max {max(len(t['input_ids']) for t in tokens)}")
    return 0


if __name__ == "__main__":
    run_main(main)
