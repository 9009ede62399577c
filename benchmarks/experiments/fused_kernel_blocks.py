#!/usr/bin/env python3
"""Tile sizes of two fused kernels on this GPU (a benchmark, not a test): the state conv
(openjev.engine.fused CONV_STATE_BLOCK, CONV_STATE_WARPS) and the one-pass variance (SUMSQ_ROWS,
SUMSQ_WARPS), each setting timed on shapes of Qwen3.5-4B's prefix-path forwards (conv: 8192
channels; variance: 2560 columns) and checked bitwise against the module's current setting.
Prints one JSON line per setting and writes them all to --out.

  python3 benchmarks/experiments/fused_kernel_blocks.py --out OUT.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

CONV_SHAPES = ((64, 160, 8192), (16, 1024, 8192), (8, 1600, 8192))  # (rows, positions, channels)
SUMSQ_SHAPES = ((10240, 2560), (25600, 2560), (4096, 2560))  # (tokens, hidden)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file of every setting's timings")
    p.add_argument("--rep-ms", type=int, default=25, help="milliseconds of timed calls a shape (do_bench's rep, default 25)")
    return p


def timed(fn, rep_ms: int) -> float:
    """Median device microseconds of `fn` (triton.testing.do_bench: CUDA events, the L2 cache cleared
    between calls)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=rep_ms, return_mode="median") * 1e3


def main(args) -> int:
    import torch

    from openjev.engine import fused

    if not torch.cuda.is_available() or fused.triton is None:
        print("fused_kernel_blocks.py: needs a CUDA device and Triton", file=sys.stderr)
        return 2
    g = torch.Generator(device="cpu").manual_seed(7)
    results = []
    conv_inputs = []
    for rows, length, ch in CONV_SHAPES:
        x = (torch.randn(rows, length, ch, generator=g) * 2).half().cuda()
        st = (torch.randn(rows, ch, 4, generator=g) * 2).half().cuda()
        w = torch.randn(ch, 4, generator=g).half().cuda()
        conv_inputs.append((x, w, st, fused.conv_silu_blc(x, w, state=st)))
    default = (fused.CONV_STATE_BLOCK, fused.CONV_STATE_WARPS)
    for block, warps in itertools.product(((32, 64), (32, 128), (64, 64), (16, 256), (64, 128)), (4, 8)):
        fused.CONV_STATE_BLOCK, fused.CONV_STATE_WARPS = block, warps
        entry = {"kernel": "conv_silu_state", "block": list(block), "warps": warps, "shapes": []}
        for x, w, st, want in conv_inputs:
            same = torch.equal(fused.conv_silu_blc(x, w, state=st), want)
            us = timed(lambda: fused.conv_silu_blc(x, w, state=st), args.rep_ms)
            gbs = 2 * x.numel() * x.element_size() / us / 1e3
            entry["shapes"].append({"shape": list(x.shape), "us": round(us, 1), "gb_s": round(gbs, 1), "bitwise": same})
        results.append(entry)
        print(json.dumps(entry), flush=True)
    fused.CONV_STATE_BLOCK, fused.CONV_STATE_WARPS = default
    sumsq_inputs = []
    for tokens, hidden in SUMSQ_SHAPES:
        x = (torch.randn(tokens, hidden, generator=g) * 3).half().cuda()
        sumsq_inputs.append((x, x.float().pow(2).mean(-1, keepdim=True)))
    default = (fused.SUMSQ_ROWS, fused.SUMSQ_WARPS)
    for rows, warps in itertools.product((8, 16, 32), (2, 4, 8)):
        fused.SUMSQ_ROWS, fused.SUMSQ_WARPS = rows, warps
        entry = {"kernel": "sumsq", "rows": rows, "warps": warps, "shapes": []}
        for x, want in sumsq_inputs:
            same = torch.equal(fused.mean_square(x), want)
            us = timed(lambda: fused.mean_square(x), args.rep_ms)
            entry["shapes"].append({"shape": list(x.shape), "us": round(us, 1),
                                    "gb_s": round(x.numel() * x.element_size() / us / 1e3, 1), "bitwise_torch_mean": same})
        results.append(entry)
        print(json.dumps(entry), flush=True)
    fused.SUMSQ_ROWS, fused.SUMSQ_WARPS = default
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "triton": fused.triton.__version__, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
