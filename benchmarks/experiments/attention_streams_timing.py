#!/usr/bin/env python3
"""Device time of a forward's own attention calls (one a row and layer) spread over CUDA streams, on a CUDA GPU.

The embedded backend makes each row's own FlashAttention call in a padded forward
(openjev/engine/attention.py OwnCalls); OPENJEV_ATTENTION_STREAMS spreads those calls over streams.
At Qwen3.5-4B's attention shape (16 query / 4 key-value heads of 256, FP16), for layouts like a warm
prefix-reuse step (rows going on from prefix states of 200-1500 tokens with tails of up to 64) and a
flushed one (rows of 200-1500 tokens from the start), this times a forward's attention: 8 calls (its layers) of
Transformers' attention function in one padded layout, which builds its plan at the first call as a
forward does at its first attention layer (median of --reps, CUDA events), at each stream count, and
checks that every row's output is bitwise the one-stream output. A benchmark, not a test.

  python3 benchmarks/experiments/attention_streams_timing.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LAYERS = 8  # Qwen3.5-4B's full-attention layers


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write (must not exist)")
    p.add_argument("--streams", default="1,2,4,8", help="comma list of stream counts (default 1,2,4,8)")
    p.add_argument("--reps", type=int, default=20)
    return p


def layouts(gen):
    """(name, lengths, starts, offset) of a warm-like and a flushed-like forward."""
    import torch

    def ints(n, lo, hi):
        return [int(x) for x in torch.randint(lo, hi, (n,), generator=gen)]

    prefixes = [p // 64 * 64 for p in ints(128, 200, 1500)]
    tails = ints(128, 1, 65)
    rows = ints(16, 200, 1500)
    return [("warm_128_tails", tails, prefixes, max(prefixes)), ("flushed_16_rows", rows, None, 0)]


def main() -> int:
    args = build_parser().parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} already exists; refusing to overwrite it")
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from openjev.engine import attention

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (FlashAttention)")
    os.environ.pop("OPENJEV_PREFIX_ATTENTION", None)
    os.environ.pop("OPENJEV_PADDED_ATTENTION", None)
    attention.rowwise_attention()
    heads, kv_heads, dim = 16, 4, 256
    module = attention._CheckModule(heads // kv_heads)
    gen = torch.Generator().manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layouts": {}}
    for name, lengths, starts, offset in layouts(gen):
        width = max(lengths)
        q = torch.randn((len(lengths), heads, width, dim), generator=gen).to("cuda", torch.float16)
        k, v = (torch.randn((len(lengths), kv_heads, offset + width, dim), generator=gen).to("cuda", torch.float16)
                for _ in range(2))
        entry, first = {"rows": len(lengths), "width": width, "offset": offset, "layers": LAYERS}, None
        for count in (int(c) for c in args.streams.split(",")):
            os.environ["OPENJEV_ATTENTION_STREAMS"] = str(count)
            times = []
            with torch.inference_mode():
                for _ in range(args.reps + 2):
                    with attention.padded_layout(lengths, starts, offset):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        for _ in range(LAYERS):
                            out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, None, scaling=dim ** -0.5)
                        end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end))
            if first is None:
                first = out
            same = all(torch.equal(out[j, :n], first[j, :n]) for j, n in enumerate(lengths))
            entry[f"streams_{count}"] = {"median_ms_a_forward": round(statistics.median(times[2:]), 3),
                                         "min_ms": round(min(times[2:]), 3), "bitwise_one_stream": same}
            print(name, count, entry[f"streams_{count}"], flush=True)
        res["layouts"][name] = entry
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
