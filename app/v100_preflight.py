#!/usr/bin/env python3
"""V100 preflight and runtime receipt for app/install_v100_runtime.sh.

    v100_preflight.py            check that this Python's torch can run FP16 on an SM70 GPU
    v100_preflight.py receipt    write runtime_receipt.json after an install (atomically)

The check prints ONE JSON line on stdout (arch list, device, FP16 matmul error, pass/fail) and
exits 0 when it passes. On failure it also prints one line `v100_preflight.py: error: REASON`
on stderr and exits 1. It writes nothing anywhere: the installer runs it before it touches
anything.

The matmul check multiplies seeded random FP16 matrices of shape (256x384)@(384x320) on the GPU
and compares the result with a float32 CPU matmul of the same FP16 inputs. It passes when every
value is finite and max|gpu - cpu| <= 2**-8 * max|cpu| (FP16 has an 11-bit significand: the
output rounding alone is about 2**-11 relative, so a correct kernel is well inside; a wrong
kernel, a broken driver or a missing SM70 build is far outside).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

SHAPE = (256, 384, 320)  # m, k, n: non-square so a transposed result cannot pass
REL_TOLERANCE = 2.0**-8
SEED = 0


def preflight() -> dict:
    """Every fact gathered; `ok` is True only when all checks pass, else `reason` says why."""
    result: dict = {
        "ok": False, "reason": None, "python": sys.executable, "torch": None, "torch_cuda": None,
        "arch_list": [], "cuda_available": False, "device": None, "capability": None, "matmul": None,
    }
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure is a preflight failure
        result["reason"] = f"torch is not importable in {sys.executable} ({type(exc).__name__}: {exc})"
        return result
    result["torch"] = torch.__version__
    result["torch_cuda"] = torch.version.cuda
    result["arch_list"] = list(torch.cuda.get_arch_list())
    if "sm_70" not in result["arch_list"]:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        result["reason"] = (f"torch {torch.__version__} ({build}) has no sm_70 kernels "
                            f"(torch.cuda.get_arch_list() = {result['arch_list']}); install the cu126 wheels")
        return result
    result["cuda_available"] = torch.cuda.is_available()
    if not result["cuda_available"]:
        result["reason"] = "torch.cuda.is_available() is False: no usable GPU or driver for this process"
        return result
    device = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(device)
    result["device"] = torch.cuda.get_device_name(device)
    result["capability"] = f"{major}.{minor}"
    if major != 7 or minor >= 5:
        result["reason"] = (f"GPU {device} ({result['device']}) has compute capability {major}.{minor}; "
                            "this installer builds the SM70 (Volta) runtime")
        return result
    m, k, n = SHAPE
    gen = torch.Generator().manual_seed(SEED)
    a = torch.randn(m, k, generator=gen).to(torch.float16)
    b = torch.randn(k, n, generator=gen).to(torch.float16)
    reference = a.float() @ b.float()
    out = (a.to(f"cuda:{device}") @ b.to(f"cuda:{device}"))
    torch.cuda.synchronize(device)
    out = out.float().cpu()
    finite = bool(torch.isfinite(out).all())
    max_err = float((out - reference).abs().max()) if finite else float("inf")
    scale = float(reference.abs().max())
    tolerance = REL_TOLERANCE * scale
    result["matmul"] = {
        "shape": [m, k, n], "dtype": "float16", "seed": SEED,
        "reference": "float32 CPU matmul of the same float16 inputs",
        "max_abs_err": max_err, "max_abs_reference": scale, "tolerance": tolerance,
        "tolerance_rule": "max_abs_err <= 2**-8 * max_abs_reference", "finite": finite,
        "passed": finite and max_err <= tolerance,
    }
    if not result["matmul"]["passed"]:
        result["reason"] = (f"FP16 GPU matmul disagrees with the CPU float32 result: max abs error {max_err:.6g} "
                            f"> tolerance {tolerance:.6g}" + ("" if finite else " (non-finite output)"))
        return result
    result["ok"] = True
    return result


# ---------------------------------------------------------------- receipt
def _first_line(cmd: list[str], last: bool = False) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    if out.returncode != 0 or not lines:
        return None
    return lines[-1] if last else lines[0]


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.decode(errors="replace").strip() if out.returncode == 0 else None


def _checkout(repo: Path, pinned: str | None, url: str | None) -> dict:
    import hashlib

    diff = subprocess.run(["git", "-C", str(repo), "diff", "HEAD"], capture_output=True).stdout
    return {"url": url, "path": str(repo), "pinned_revision": pinned, "head": _git(repo, "rev-parse", "HEAD"),
            "head_matches_pin": _git(repo, "rev-parse", "HEAD") == pinned,
            "working_tree_diff_sha256": hashlib.sha256(diff).hexdigest()}


def _distribution_versions(names: list[str]) -> dict:
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _elf_list(path: str | None) -> dict | None:
    """The kernel-arch step's file: '# LIBRARY', then `cuobjdump --list-elf LIBRARY` (lines naming cubins)."""
    if not path or not Path(path).exists():
        return None
    lines = Path(path).read_text().splitlines()
    library = lines[0][2:] if lines and lines[0].startswith("# ") else None
    cubins = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("ELF file") and ":" in ln]
    return {"library": library, "cubins": cubins,
            "sm": sorted({m for c in cubins for m in re.findall(r"sm_\d+[a-z]?", c)})}


def write_receipt(args: argparse.Namespace) -> int:
    import openjev.common as _common

    before = json.loads(os.environ.get("OPENJEV_PREFLIGHT_JSON") or "null")
    steps = []
    if args.steps and Path(args.steps).exists():
        for line in Path(args.steps).read_text().splitlines():
            number, stage, status, command = line.split("\t", 3)
            steps.append({"step": int(number), "stage": stage, "status": status, "command": command})
    receipt = {
        "schema_version": 1,
        "recorded_at": _common.utc_now(),
        "allow_unpinned": args.allow_unpinned,
        "runtime": _checkout(Path(args.runtime_src), args.runtime_rev, args.runtime_url),
        "flashinfer": {**_checkout(Path(args.flashinfer_src), args.flashinfer_rev, args.flashinfer_url),
                       "patch": {"path": args.flashinfer_patch, "sha256": _common.sha256_file(args.flashinfer_patch)}},
        "patches": [{"name": Path(p).name, "path": p, "sha256": _common.sha256_file(p)} for p in args.patch],
        "versions": _distribution_versions(["torch", "torchvision", "sglang", "sglang-kernel", "sgl-kernel",
                                            "flashinfer-python", "tilelang", "transformers", "triton",
                                            "nvidia-nccl-cu12"]),
        "toolchain": {
            "cc": args.cc, "cc_version": _first_line([args.cc, "--version"]),
            "cxx": args.cxx, "cxx_version": _first_line([args.cxx, "--version"]),
            "nvcc": args.nvcc, "nvcc_version": _first_line([args.nvcc, "--version"], last=True),
            "rustc_version": _first_line(["rustc", "--version"]),
            "cargo_version": _first_line(["cargo", "--version"]),
            "protoc_version": _first_line(["protoc", "--version"]),
            "pinned": {"rust": args.rust_version, "protoc": args.protoc_version},
        },
        "sgl_kernel_code": _elf_list(args.elf_list),
        "preflight": before,
        "preflight_after_install": preflight(),
        "steps": steps,
        "environment": _common.environment_receipt(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _common.atomic_write_json(out, receipt)
    print(out)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="v100_preflight.py",
        description="Preflight for install_v100_runtime.sh: torch has sm_70 kernels and an FP16 GPU matmul "
                    "matches a float32 CPU matmul of the same inputs (max|gpu-cpu| <= 2**-8 * max|cpu|). "
                    "Prints one JSON line; exit 0 on pass, 1 with one stderr line on failure. Writes nothing.")
    sub = parser.add_subparsers(dest="command")
    rec = sub.add_parser("receipt", help="write runtime_receipt.json (atomically) after an install")
    rec.add_argument("--out", required=True)
    rec.add_argument("--runtime-src", required=True)
    rec.add_argument("--runtime-rev", required=True)
    rec.add_argument("--runtime-url", default=None)
    rec.add_argument("--flashinfer-src", required=True)
    rec.add_argument("--flashinfer-rev", required=True)
    rec.add_argument("--flashinfer-url", default=None)
    rec.add_argument("--flashinfer-patch", required=True)
    rec.add_argument("--patch", action="append", default=[], help="a project patch applied to the runtime (repeat)")
    rec.add_argument("--cc", required=True)
    rec.add_argument("--cxx", required=True)
    rec.add_argument("--nvcc", required=True)
    rec.add_argument("--rust-version", default=None)
    rec.add_argument("--protoc-version", default=None)
    rec.add_argument("--steps", default=None, help="tab-separated step log of the install")
    rec.add_argument("--elf-list", default=None,
                     help="the kernel-arch step's file: '# LIBRARY' then cuobjdump --list-elf LIBRARY")
    rec.add_argument("--allow-unpinned", action="store_true")
    args = parser.parse_args()
    if args.command == "receipt":
        return write_receipt(args)
    result = preflight()
    print(json.dumps(result), flush=True)
    if not result["ok"]:
        print(f"v100_preflight.py: error: {result['reason']}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
