"""The stand-in ops, written for this project in plain PyTorch.

Each function has the argument list of the sgl-kernel CUDA op of the same name (schemas in
``__init__.SCHEMAS``), changes the tensors that op changes and returns nothing, as the op does.

Where the arithmetic was read. sgl-kernel vendors FlashInfer (its CMakeLists.txt fetches
flashinfer-ai/flashinfer; read here at bc29697, v0.3.1-22; the kernel bodies below are the same
from late 2024 to FlashInfer's head). sglang-kernel 0.4.10's ``sm90/common_ops.abi3.so`` holds
exactly these instantiations: ``flashinfer::norm::RMSNormKernel`` and ``FusedAddRMSNormKernel``
(``include/flashinfer/norm.cuh``) and ``flashinfer::activation::act_and_mul_kernel<T, silu<float>>``
(``include/flashinfer/activation.cuh`` with the silu of sgl-kernel's
``csrc/elementwise/activation.cu``).

rmsnorm, gemma_rmsnorm (RMSNormKernel, weight_bias 0 and 1):
    sum_sq = sum of float(x)^2 over the row in float32; r = rsqrt(sum_sq / d + eps), eps passed as
    float; out = float(x) * r * (weight_bias + float(w)), multiplied in that order in float32 and
    rounded to the dtype on store. Gemma: the weight is used as (1 + w).
fused_add_rmsnorm, gemma_fused_add_rmsnorm (FusedAddRMSNormKernel, weight_bias 0 and 1):
    x = float(input) + float(residual) in float32; residual <- x rounded to the dtype. The kernel
    keeps the float32 x (in shared memory) and computes both the sum of squares and the output
    from it, NOT from the rounded residual: input <- x * r * (weight_bias + float(w)), rounded on
    store. The stand-ins do the same.
silu_and_mul (act_and_mul_kernel; sgl-kernel's silu on float):
    x = float(input[..., :d]), y = float(input[..., d:]); out = x / (1 + exp(-x)) * y in float32,
    rounded to the dtype on store (no rounding of silu(x) before the product).

What differs, unavoidably. (1) The order of the float32 sum of squares: the kernel has each thread
add its VEC_SIZE-wide chunks with fused multiply-adds, then reduces over the warp and over the
warps by butterfly shuffles; PyTorch's reduction has its own order. (2) sgl-kernel's SM90 build
(the one an H200 loads) is compiled with ``-use_fast_math`` and FlashInfer's ``math::rsqrt`` is
``rsqrt.approx.ftz.f32``: the kernel's rsqrt, division and exp are approximate to a few float32
ulps, and subnormals flush to zero; here they are PyTorch's. Both are float32-level differences,
far below half a unit in the last place of float16/bfloat16 at these sizes, so an element of the
stand-in's output and the kernel's can differ by one such unit (where the float32 value sits next
to a rounding boundary), not more. Measured on an H200 against FlashInfer bc29697's kernels built
with sgl-kernel's SM90 flags (sglang-kernel 0.4.10's own library does not load with the torch
there): residuals bitwise equal; outputs within one unit everywhere, differing in 1e-6 (bfloat16)
to 7e-5 (float16) of the elements.

Checks follow the library's. rmsnorm, gemma_rmsnorm and gemma_fused_add_rmsnorm are bound to
FlashInfer's ``csrc/norm.cu``: float16/bfloat16 only, 2-D input, 1-D weight of matching size, each
contiguous in its last dimension (rows may be strided: the kernel takes stride(0)).
fused_add_rmsnorm is bound to sgl-kernel's own ``sgl_fused_add_rmsnorm``
(``csrc/elementwise/fused_add_rms_norm_kernel.cu``, the same FlashInfer kernel): it also takes
float32 and wants input, residual and weight wholly contiguous. silu_and_mul takes float32, float16
and bfloat16; the kernel indexes dense rows without checking, the stand-in refuses non-contiguous
tensors. The kernels read weight and residual as the input's type without checking; the stand-ins
refuse a differing dtype.
"""

from __future__ import annotations

import struct

import torch

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def _check_norm_args(op: str, x: torch.Tensor, weight: torch.Tensor, others: dict, dtypes=_HALF_DTYPES,
                     whole_contiguous: bool = False) -> None:
    _check(x.dtype in dtypes, f"{op}: unsupported data type {x.dtype} (the kernel takes "
                              f"{'/'.join(str(d).removeprefix('torch.') for d in dtypes)})")
    _check(x.dim() == 2, f"{op}: input must be 2-D (batch_size, hidden_size), got {tuple(x.shape)}")
    _check(weight.dim() == 1 and weight.size(0) == x.size(1),
           f"{op}: weight must be 1-D of hidden_size {x.size(1)}, got {tuple(weight.shape)}")
    for name, t in {"input": x, "weight": weight, **others}.items():
        _check(t.device == x.device, f"{op}: {name} is on {t.device}, input on {x.device}")
        _check(t.dtype == x.dtype,
               f"{op}: {name} is {t.dtype}, input {x.dtype} (the kernel reads it as the input's type)")
        if whole_contiguous:
            _check(t.is_contiguous(), f"{op}: {name} must be contiguous")
        else:
            _check(t.numel() == 0 or t.stride(-1) == 1, f"{op}: {name} must be contiguous in its last dimension")
    for name, t in others.items():
        _check(tuple(t.shape) == tuple(x.shape), f"{op}: {name} has shape {tuple(t.shape)}, input {tuple(x.shape)}")


def _normalize(xf: torch.Tensor, weight: torch.Tensor, eps: float, weight_bias: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (weight_bias + w), all float32, in the kernel's order."""
    d = xf.size(-1)
    sum_sq = (xf * xf).sum(dim=-1, keepdim=True, dtype=torch.float32)
    eps32 = struct.unpack("f", struct.pack("f", eps))[0]  # the kernel takes eps as float
    rms_rcp = torch.rsqrt(sum_sq / float(d) + eps32)
    return xf * rms_rcp * (weight.float() + weight_bias)


def _rmsnorm(op: str, output, input, weight, eps, weight_bias) -> None:
    _check_norm_args(op, input, weight, {"output": output})
    if input.numel():
        output.copy_(_normalize(input.float(), weight, eps, weight_bias))


def _fused_add_rmsnorm(op: str, input, residual, weight, eps, weight_bias, **checks) -> None:
    _check_norm_args(op, input, weight, {"residual": residual}, **checks)
    if not input.numel():
        return
    x = input.float() + residual.float()
    residual.copy_(x)  # rounded to the dtype
    input.copy_(_normalize(x, weight, eps, weight_bias))  # from the float32 sum, as the kernel


def rmsnorm(output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float, enable_pdl: bool) -> None:
    _rmsnorm("rmsnorm", output, input, weight, eps, 0.0)


def gemma_rmsnorm(output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float,
                  enable_pdl: bool) -> None:
    _rmsnorm("gemma_rmsnorm", output, input, weight, eps, 1.0)


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      enable_pdl: bool) -> None:
    # sgl-kernel's own binding: float32 too, whole tensors contiguous
    _fused_add_rmsnorm("fused_add_rmsnorm", input, residual, weight, eps, 0.0, dtypes=_ALL_DTYPES,
                       whole_contiguous=True)


def gemma_fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            enable_pdl: bool) -> None:
    _fused_add_rmsnorm("gemma_fused_add_rmsnorm", input, residual, weight, eps, 1.0)


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    op = "silu_and_mul"
    _check(input.dtype in _ALL_DTYPES, f"{op}: unsupported data type {input.dtype}")
    _check(out.dtype == input.dtype and out.device == input.device, f"{op}: out must match input's dtype and device")
    d = input.size(-1) // 2
    want = tuple(input.shape[:-1]) + (d,)
    _check(tuple(out.shape) == want, f"{op}: out has shape {tuple(out.shape)}, expected {want}")
    # the kernel indexes both as dense rows (token * 2d, token * d); it would misread anything else
    _check(input.is_contiguous() and out.is_contiguous(), f"{op}: input and out must be contiguous")
    if not out.numel():
        return
    x = input[..., :d].float()
    y = input[..., d:2 * d].float()
    out.copy_(x / (1.0 + torch.exp(-x)) * y)
