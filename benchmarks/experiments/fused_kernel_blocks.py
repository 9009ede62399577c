#!/usr/bin/env python3
"""Tile sizes of three fused kernels on this GPU (a benchmark, not a test): the state conv
(openjev.engine.fused CONV_STATE_BLOCK, CONV_STATE_WARPS), the packed layout's segments conv
(CONV_SEGMENT_BLOCK, CONV_SEGMENT_WARPS) and the one-pass variance (SUMSQ_ROWS, SUMSQ_WARPS), each
setting timed on shapes of Qwen3.5-4B's prefix-path forwards (conv: 8192 channels, the segments conv
split into query, key and value as the GDN layers call it; variance: 2560 columns) and checked
bitwise against the module's current setting. Prints one JSON line per setting and writes them all
to --out.

  python3 benchmarks/experiments/fused_kernel_blocks.py --out OUT.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

CONV_SHAPES = ((64, 160, 8192), (16, 1024, 8192), (8, 1600, 8192))  # (rows, positions, channels)
SUMSQ_SHAPES = ((10240, 2560), (25600, 2560), (4096, 2560))  # (tokens, hidden)
# packed segments (lengths, whether each starts from a state): a flushed pass's forward of premises and
# rows of 200-1500 tokens, half from prefix states; a warm pass's 128 tails of 10-60 tokens, all from states
SEGMENT_SETS = (("flushed", 48, (200, 1500), 2), ("warm", 128, (10, 60), 1))
SEGMENT_BLOCKS = ((32, 64), (32, 128), (64, 64), (16, 256), (64, 128), (32, 256), (8, 512))


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
    results += segment_conv_settings(torch, fused, g, args.rep_ms)
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


def segment_conv_settings(torch, fused, g, rep_ms: int) -> list:
    """conv_silu_segments at each of SEGMENT_BLOCKS x (4, 8) warps on SEGMENT_SETS, 8192 channels split
    2048/2048/4096, against the module's current setting."""
    import random

    rng = random.Random(11)
    ch, split = 8192, 2048
    w = torch.randn(ch, 4, generator=g).half().cuda()
    inputs = []
    for name, rows, (lo, hi), every in SEGMENT_SETS:
        lengths = [rng.randrange(lo, hi + 1) for _ in range(rows)]
        states = [b if b % every == 0 else None for b in range(rows)]
        x = (torch.randn(sum(lengths), ch, generator=g) * 2).half().cuda()
        st = (torch.randn(rows + 1, ch, 4, generator=g) * 2).half().cuda()
        want = torch.cat(fused.conv_silu_segments(x, w, fused.conv_segment_tiles(lengths, states, "cuda"), st, split), 1)
        inputs.append((name, lengths, states, x, st, want))
    default = (fused.CONV_SEGMENT_BLOCK, fused.CONV_SEGMENT_WARPS)
    out = []
    try:
        for block, warps in itertools.product(SEGMENT_BLOCKS, (4, 8)):
            fused.CONV_SEGMENT_BLOCK, fused.CONV_SEGMENT_WARPS = block, warps
            entry = {"kernel": "conv_silu_segments", "block": list(block), "warps": warps, "shapes": []}
            for name, lengths, states, x, st, want in inputs:
                tiles = fused.conv_segment_tiles(lengths, states, "cuda")
                same = torch.equal(torch.cat(fused.conv_silu_segments(x, w, tiles, st, split), 1), want)
                us = timed(lambda: fused.conv_silu_segments(x, w, tiles, st, split), rep_ms)
                entry["shapes"].append({"set": name, "tokens": x.shape[0], "us": round(us, 1),
                                        "gb_s": round(2 * x.numel() * x.element_size() / us / 1e3, 1), "bitwise": same})
            out.append(entry)
            print(json.dumps(entry), flush=True)
    finally:
        fused.CONV_SEGMENT_BLOCK, fused.CONV_SEGMENT_WARPS = default
    return out


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
