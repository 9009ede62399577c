"""What a forward costs: the model's FLOPs per token from its weights, the device's measured matmul peak, and
the share of that peak a measured pass reached (compute_bound in receipts)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from openjev.common import UserError


def linear_weight_elements(model_dir: Path) -> int:
    """Elements of the 2-D weights that run as matmuls per token (no embedding, no vision tower),
    read from the safetensors headers without loading the weights."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir}: no .safetensors files to count parameters from")
    total = 0
    for f in files:
        with open(f.resolve(), "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__" or len(meta.get("shape", [])) != 2:
                continue
            if "embed_tokens" in name or "visual" in name or "lm_head" in name:
                continue
            total += meta["shape"][0] * meta["shape"][1]
    return total


def model_flops(model_dir: Path, tokens: int) -> float:
    """Matmul FLOPs of one pass over `tokens` real tokens: 2 x linear weight elements x tokens
    (attention scores and the GDN recurrence are not counted, so the fraction is a lower bound)."""
    return 2.0 * linear_weight_elements(model_dir) * tokens


def measure_matmul_peak(device: str, dtype: str = "float16", n: int = 8192, repeats: int = 10) -> float:
    """Median TFLOP/s of an n x n x n matmul on random data (3 warm-ups first)."""
    import torch

    tdt = getattr(torch, dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)
    if not device.startswith("cuda"):
        n = min(n, 1024)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=tdt)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=tdt)
    times = []
    for i in range(3 + repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        (a @ b)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    times.sort()
    return 2.0 * n ** 3 / times[len(times) // 2] / 1e12


def _sig(x: float, digits: int = 4) -> float:
    """Round to significant digits, so small CPU figures keep their precision (0.00184, not 0.0018)."""
    return float(f"{x:.{digits}g}")


def compute_bound(peak_tflops: float, peak_dtype: str, flops: float, seconds: float) -> dict:
    achieved = flops / seconds / 1e12 if seconds > 0 else None
    return {
        "peak_fp16_tflops": _sig(peak_tflops) if peak_dtype == "float16" else None,
        "peak_dtype": peak_dtype, "peak_tflops": _sig(peak_tflops),
        "peak_method": "median of 10 square matmuls of random data after 3 warm-ups, same run",
        "model_flops_per_pass": flops, "pass_seconds": round(seconds, 4),
        "achieved_tflops": _sig(achieved) if achieved else None,
        "fraction_of_peak": _sig(achieved / peak_tflops) if achieved else None,
        "flops_counted": "2 x linear-layer weight elements x real tokens (no padding, attention or GDN recurrence)",
    }
