#!/usr/bin/env python3
"""Add "compute_bound" and "kernel_path" to a bench receipt of app/bench_classify_v100.py.

Run on the same machine right after the bench (the server idle, the GPU otherwise unused): it
measures the fp16 matmul peak (float32 on a CPU) here and now, counts the matmul FLOPs of one pass
from the checkpoint's safetensors headers (2 x linear-layer weight elements x the real tokens the
bench sent per pass), and divides by the receipt's median wall time (warm, else cold); where the
server counts the tokens its forwards really ran (the embedded backend, fewer with --prefix-reuse),
also on those ("on_computed_tokens"). The kernel
path is copied from the receipt's own /server_info snapshot (server.info_after, else info_before).
The receipt is rewritten atomically; every other field stays as the bench wrote it.

Example:
  benchmarks/compute_bound.py results/bench.json --model W/model-qwen3.5-4b --device cuda
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from openjev.bench.receipt import server_snapshot
from openjev.common import UserError, atomic_write_json, run_main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("receipt", type=Path, help="bench receipt (kind openjev-bench), rewritten in place")
    p.add_argument("--model", type=Path, required=True, help="the served checkpoint (for the FLOP count)")
    p.add_argument("--device", default="cuda", help="where to measure the matmul peak (default: cuda)")
    return p


def median_wall(receipt: dict) -> tuple[str, float]:
    for mode in ("warm", "cold"):
        timing = (receipt.get(mode) or {}).get("timing") or {}
        if timing.get("median_wall_s"):
            return mode, float(timing["median_wall_s"])
    raise UserError("receipt has no measured pass (warm/cold timing.median_wall_s)")


def computed_share(server: dict) -> float | None:
    """Real tokens the server's forwards ran over the tokens it was sent, between the bench's /server_info
    snapshots; None where the server does not count them (SGLang, older receipts) or nothing was sent."""
    before = (server.get("info_before") or {}).get("counters") or {}
    after = (server.get("info_after") or {}).get("counters") or {}
    if "computed_tokens" not in before or "computed_tokens" not in after:
        return None
    sent = after.get("tokens", 0) - before.get("tokens", 0)
    return (after["computed_tokens"] - before["computed_tokens"]) / sent if sent > 0 else None


def main() -> int:
    args = build_parser().parse_args()
    try:
        receipt = json.loads(args.receipt.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read receipt {args.receipt}: {exc}") from None
    if receipt.get("kind") != "openjev-bench":
        raise UserError(f"{args.receipt} is not a bench receipt (kind {receipt.get('kind')!r})")
    mode, wall = median_wall(receipt)
    tokens = int(receipt["tokens"]["total_ids_sent_per_pass"])
    from openjev.engine.flops import compute_bound, measure_matmul_peak, model_flops

    dtype = "float32" if args.device == "cpu" else "float16"
    peak = measure_matmul_peak(args.device, dtype)
    bound = compute_bound(peak, dtype, model_flops(args.model, tokens), wall)
    bound["timing_mode"] = mode
    bound["measured_by"] = "benchmarks/compute_bound.py, right after the bench on the same machine"
    server = receipt.get("server") or {}
    info = server_snapshot(server)
    share = computed_share(server)
    if share is not None:  # with prefix reuse the forwards run fewer tokens than the set holds
        computed = round(tokens * share)
        bound["on_computed_tokens"] = {
            **compute_bound(peak, dtype, model_flops(args.model, computed), wall),
            "tokens_computed_per_pass": computed, "computed_share": round(share, 4),
            "how": "the server's counters (computed_tokens over tokens) between the bench's two /server_info "
                   "snapshots, so an average over every pass the bench sent"}
    receipt["compute_bound"] = bound
    receipt["kernel_path"] = info.get("kernel_path")
    atomic_write_json(args.receipt, receipt)
    print(f"{args.receipt}: {bound['achieved_tflops']} TFLOP/s of {bound['peak_tflops']} ({dtype} peak) = "
          f"{bound['fraction_of_peak']} of peak; kernels {(receipt['kernel_path'] or {}).get('gdn')}")
    return 0


if __name__ == "__main__":
    run_main(main)
