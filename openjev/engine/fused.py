"""Fused Triton kernels for the embedded server's forward, used only where they give, on this
GPU, bit for bit what the Transformers modules they replace give (docs/embedded_backend.md,
"Fused kernels"):

  rms_norm    Qwen3_5RMSNorm: variance in the order of PyTorch's CUDA mean, then (x * rsqrt) * (1 + w)
  gated_norm  Qwen3_5RMSNormGated: the same variance, the weight, silu(gate) and the product
  swiglu      Qwen3_5MLP: silu(gate) rounded to FP16, times up, rounded
  conv_silu   the GDN causal conv1d + silu in the projection's own layout (the q/k/v reshapes are views)
  grouped_heads  Qwen3_5GatedDeltaNet: its forward without the key-head repeat, fla reading each key
              head for its value heads (openjev/engine/gdn.py)

`apply_fused` checks each piece against the module it replaces on this device (`torch.equal` on
random inputs of several shapes) and uses only those that pass; the reference scorer never calls
this. OPENJEV_FUSED=auto (default) | off | a comma list of pieces. With TRITON_INTERPRET=1 the kernels run on a CPU
(tests/test_fused.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from openjev.common import UserError
from openjev.engine.bitwise import Bitwise
from openjev.engine.gdn import check_grouped_heads, grouped_heads_forward, kernel_takes_grouped_heads

log = logging.getLogger("openjev.fused")

FUSED_ENV = "OPENJEV_FUSED"
FUSED_MODES = ("auto", "off")
PIECES = ("rms_norm", "gated_norm", "swiglu", "conv_silu", "grouped_heads")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

try:  # Triton is the GPU extra's; without it every piece stays Transformers' code
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError as exc:  # noqa: F841 - the reason is reported by apply_fused
    triton = None
    _TRITON_ERROR = f"{type(exc).__name__}: {exc}"
else:
    _TRITON_ERROR = None


def fused_mode(mode: str | None = None) -> str:
    """auto (every piece), off (none), or a comma list of the pieces to check and use."""
    mode = mode or os.environ.get(FUSED_ENV) or "auto"
    if mode not in FUSED_MODES and not set(mode.split(",")) <= set(PIECES):
        raise UserError(f"{FUSED_ENV}={mode!r}: expected one of {', '.join(FUSED_MODES)}, "
                        f"or a comma list of pieces from {', '.join(PIECES)}")
    return mode


BLOCK = 1024

if triton is not None:

    _LIBDEVICE = tl.constexpr(not INTERPRET)  # Triton's interpreter has no libdevice

    @triton.jit
    def _silu_f32(x):
        # PyTorch's CUDA silu: x / (1 + exp(-x)) in float32 (IEEE division, accurate expf)
        if _LIBDEVICE:
            e = libdevice.exp(-x)
        else:
            e = tl.exp(-x)
        return tl.math.div_rn(x, 1.0 + e)

    @triton.jit
    def _square_kernel(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + offs, x * x, mask=m)

    @triton.jit
    def _sumsq_kernel(X, OUT, rows, factor, N: tl.constexpr, ROWS: tl.constexpr):
        # mean(x.float() ** 2, -1) of [rows, N] contiguous (N a multiple of 128), summed in the
        # order of PyTorch's CUDA reduce kernel for an inner reduction of >= 128 elements with
        # >= 16 outputs (block 32 x 16, input vectorized by 4): a warp per row; lane t keeps 4
        # accumulators a_i over j = 0, 1, ... of elements 4t + i + 128j; the lane's value is
        # ((a_0 + a_1) + a_2) + a_3; the warp adds lane t + 16 to lane t, then t + 8, 4, 2, 1
        # (shfl_down from the high offset); the mean is sum * factor (float32 of 1/N, MeanOps).
        # Each step loads 128 contiguous elements a row as [ROWS, 32, 4] (lane t's elements 4t..4t+3):
        # a_i is [..., i] of one [ROWS, 32, 4] accumulator.
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rm = r < rows
        within = 4 * tl.arange(0, 32)[:, None] + tl.arange(0, 4)[None, :]  # [32, 4]: 4t + i
        base = X + r[:, None, None] * N + within[None, :, :]
        acc = tl.zeros([ROWS, 32, 4], dtype=tl.float32)
        for j in tl.static_range(N // 128):
            x = tl.load(base + 128 * j, mask=rm[:, None, None], other=0.0).to(tl.float32)
            acc += x * x
        even, odd = tl.split(tl.reshape(acc, [ROWS, 32, 2, 2]))  # i = 2p + q: q = 0 gives a_0, a_2
        a0, a2 = tl.split(even)
        a1, a3 = tl.split(odd)
        v = ((a0 + a1) + a2) + a3
        v = _add_halves(v, ROWS, 16)  # lane t + lane t+16, t < 16
        v = _add_halves(v, ROWS, 8)
        v = _add_halves(v, ROWS, 4)
        v = _add_halves(v, ROWS, 2)
        v = _add_halves(v, ROWS, 1)
        tl.store(OUT + r, tl.reshape(v, [ROWS]) * factor, mask=rm)

    @triton.jit
    def _add_halves(v, ROWS: tl.constexpr, HALF: tl.constexpr):
        # [ROWS, 2*HALF] -> [ROWS, HALF]: column t plus column t + HALF
        low, high = tl.split(tl.permute(tl.reshape(v, [ROWS, 2, HALF]), (0, 2, 1)))
        return low + high

    @triton.jit
    def _rms_apply_kernel(X, R, W1, Y, n, cols, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        r = tl.load(R + offs // cols, mask=m, other=0.0)
        w1 = tl.load(W1 + offs % cols, mask=m, other=0.0)
        tl.store(Y + offs, ((x * r) * w1).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _gated_apply_kernel(X, R, Z, W, Y, n, cols, W_LOWP: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        r = tl.load(R + offs // cols, mask=m, other=0.0)
        h = (x * r).to(Y.dtype.element_ty).to(tl.float32)  # hidden_states.to(input_dtype)
        p = tl.load(W + offs % cols, mask=m, other=0.0).to(tl.float32) * h
        if W_LOWP:  # weight * h in the input dtype rounds; a float32 weight promotes instead
            p = p.to(Y.dtype.element_ty).to(tl.float32)
        z = tl.load(Z + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + offs, (p * _silu_f32(z)).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _swiglu_kernel(G, U, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
        s = _silu_f32(g).to(Y.dtype.element_ty).to(tl.float32)
        u = tl.load(U + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + offs, (s * u).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _conv_out(Y, row, c, channels, rows, SPLIT: tl.constexpr):
        # where output (row, channel c) goes: Y [rows, channels], or with SPLIT = s > 0 three
        # contiguous matrices one after the other, [rows, s], [rows, s] and [rows, channels - 2 s]
        # (the GDN layer's query, key and value channels)
        if SPLIT > 0:
            in_k = c >= SPLIT
            in_v = c >= 2 * SPLIT
            start = tl.where(in_v, 2 * SPLIT, tl.where(in_k, SPLIT, 0))
            width = tl.where(in_v, channels - 2 * SPLIT, SPLIT)
            return Y + start.to(tl.int64) * rows + row.to(tl.int64) * width + (c - start)
        return Y + row * channels + c

    @triton.jit
    def _conv_silu_kernel(X, W, Y, length, channels, K: tl.constexpr, BLOCK_C: tl.constexpr,
                          SPLIT: tl.constexpr = 0):
        # one (row, position) per program along axis 0, BLOCK_C channels along axis 1;
        # X and Y are [batch, length, channels] contiguous, W is [channels, K]
        bt = tl.program_id(0).to(tl.int64)
        t = bt % length
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < channels
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for k in tl.static_range(K):
            back = K - 1 - k  # input position t - back, as PyTorch's kernel walks the taps
            ok = cm & (t >= back)
            x = tl.load(X + (bt - back) * channels + c, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(W + c * K + k, mask=cm, other=0.0).to(tl.float32)
            acc = tl.fma(w, x, acc)
        y = acc.to(Y.dtype.element_ty).to(tl.float32)  # the conv's output tensor, then silu on it
        out = _conv_out(Y, bt, c, channels, tl.num_programs(0).to(tl.int64), SPLIT)
        tl.store(out, _silu_f32(y).to(Y.dtype.element_ty), mask=cm)


    @triton.jit
    def _conv_silu_strided_kernel(X, W, Y, length, channels, sxb, sxt, sxc, K: tl.constexpr,
                                  BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        # _conv_silu_kernel's arithmetic on a [BLOCK_T, BLOCK_C] tile of an X of any strides (the
        # [batch, channels, length] tensor a cached forward concatenates); Y [batch, length, channels]
        tiles = tl.cdiv(length, BLOCK_T)
        b = (tl.program_id(0) // tiles).to(tl.int64)
        t = (tl.program_id(0) % tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        tm, cm = t < length, c < channels
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for k in tl.static_range(K):
            src = t - (K - 1 - k)
            ok = (tm & (src >= 0))[:, None] & cm[None, :]
            x = tl.load(X + b * sxb + src[:, None].to(tl.int64) * sxt + c[None, :].to(tl.int64) * sxc,
                        mask=ok, other=0.0).to(tl.float32)
            w = tl.load(W + c * K + k, mask=cm, other=0.0).to(tl.float32)
            acc = tl.fma(w[None, :], x, acc)
        y = acc.to(Y.dtype.element_ty).to(tl.float32)
        out = (b * length + t[:, None].to(tl.int64)) * channels + c[None, :]
        tl.store(Y + out, _silu_f32(y).to(Y.dtype.element_ty), mask=tm[:, None] & cm[None, :])

    @triton.jit
    def _conv_taps_inside(x_at, sxt, W, c, m, cm, acc, K: tl.constexpr):
        # acc + the conv's taps at positions whose K - 1 inputs before them are all the row's own
        # (x_at: each position's input; sxt: a position's stride): the taps of _conv_taps_after_state
        # in the same order, without the state's loads
        for k in tl.static_range(K):
            x = tl.load(x_at - (K - 1 - k) * sxt, mask=m, other=0.0).to(tl.float32)
            w = tl.load(W + c * K + k, mask=cm, other=0.0).to(tl.float32)
            acc = tl.fma(w[None, :], x, acc)
        return acc

    @triton.jit
    def _conv_taps_after_state(XR, sxt, sxc, SR, ssc, sst, state_len, W, t, c, tm, cm, has_state, acc,
                               K: tl.constexpr):
        # acc + the conv's taps at positions t of one row whose inputs before its first are the last
        # columns of its state (XR, SR: the row's inputs and state; a state column where has_state,
        # zero otherwise): the state kernel's and the segments kernel's arithmetic, one code
        cc = c[None, :].to(tl.int64)
        for k in tl.static_range(K):
            src = t - (K - 1 - k)
            from_x = (tm & (src >= 0))[:, None] & cm[None, :]
            from_s = (tm & (src < 0) & has_state)[:, None] & cm[None, :]
            xs = tl.load(XR + tl.maximum(src, 0)[:, None].to(tl.int64) * sxt + cc * sxc, mask=from_x, other=0.0)
            ss = tl.load(SR + cc * ssc + (state_len + tl.minimum(src, -1))[:, None].to(tl.int64) * sst,
                         mask=from_s, other=0.0)
            x = tl.where(from_s, ss, xs).to(tl.float32)
            w = tl.load(W + c * K + k, mask=cm, other=0.0).to(tl.float32)
            acc = tl.fma(w[None, :], x, acc)
        return acc

    @triton.jit
    def _conv_silu_state_kernel(X, S, W, Y, length, channels, state_len, sxb, sxt, sxc, ssb, ssc, sst,
                                K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr,
                                SPLIT: tl.constexpr = 0):
        # _conv_silu_strided_kernel's arithmetic on the prefix state S [batch, channels, state_len] followed
        # by the new inputs X [batch, length, channels] (any strides), without concatenating them:
        # a tap before the first new input reads the state's last columns; Y [batch, length, channels].
        # Only the first tile of a row reaches into the state; the others read X alone, their
        # offsets formed once (within a row in int32 unless WIDE, the row's base in int64).
        tiles = tl.cdiv(length, BLOCK_T)
        b = (tl.program_id(0) // tiles).to(tl.int64)
        t0 = (tl.program_id(0) % tiles) * BLOCK_T
        t = t0 + tl.arange(0, BLOCK_T)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        tm, cm = t < length, c < channels
        if WIDE:
            t, c = t.to(tl.int64), c.to(tl.int64)
        m = tm[:, None] & cm[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        if t0 >= K - 1:
            acc = _conv_taps_inside(X + b * sxb + (t[:, None] * sxt + c[None, :] * sxc), sxt, W, c, m, cm, acc, K)
        else:
            acc = _conv_taps_after_state(X + b * sxb, sxt, sxc, S + b * ssb, ssc, sst, state_len, W, t, c, tm, cm,
                                         True, acc, K)
        y = acc.to(Y.dtype.element_ty).to(tl.float32)
        if SPLIT > 0:
            rows = (tl.num_programs(0) // tiles).to(tl.int64) * length
            out = _conv_out(Y, b * length + t[:, None], c[None, :], channels, rows, SPLIT)
        else:
            out = Y + b * length * channels + (t[:, None] * channels + c[None, :])
        tl.store(out, _silu_f32(y).to(Y.dtype.element_ty), mask=m)


    @triton.jit
    def _conv_silu_segments_kernel(X, S, W, Y, TILES, channels, tokens, state_len, ssb, ssc, sst,
                                   K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                                   SPLIT: tl.constexpr = 0):
        # _conv_silu_state_kernel's arithmetic on the segments of a packed X [tokens, channels]
        # (contiguous): TILES [tiles, 4] int32 holds each program's segment, first position in it,
        # the segment's first packed token and length; a tap before a segment's first token reads
        # the segment's start state S [segments, channels, state_len] (any strides) where it has one
        # (its row of S non-negative), zero otherwise. Y [tokens, channels], or split as _conv_out's.
        tile = tl.program_id(0)
        seg = tl.load(TILES + tile * 4)
        t0 = tl.load(TILES + tile * 4 + 1)
        bos = tl.load(TILES + tile * 4 + 2).to(tl.int64)
        n = tl.load(TILES + tile * 4 + 3)
        t = t0 + tl.arange(0, BLOCK_T)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        tm, cm = t < n, c < channels
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        if t0 >= K - 1:  # the segment's own inputs alone
            m = tm[:, None] & cm[None, :]
            acc = _conv_taps_inside(X + (bos + t[:, None].to(tl.int64)) * channels + c[None, :], channels, W, c, m, cm,
                                    acc, K)
        else:
            acc = _conv_taps_after_state(X + bos * channels, channels, 1, S + tl.maximum(seg, 0).to(tl.int64) * ssb,
                                         ssc, sst, state_len, W, t, c, tm, cm, seg >= 0, acc, K)
        y = acc.to(Y.dtype.element_ty).to(tl.float32)
        out = _conv_out(Y, bos + t[:, None].to(tl.int64), c[None, :], channels, tokens.to(tl.int64), SPLIT)
        tl.store(out, _silu_f32(y).to(Y.dtype.element_ty), mask=tm[:, None] & cm[None, :])


def _grid(n: int):
    return (triton.cdiv(n, BLOCK),)


def square_f32(x):
    import torch

    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _square_kernel[_grid(x.numel())](x, y, x.numel(), BLOCK=BLOCK)
    return y


SUMSQ_ROWS = 8  # rows a program of the one-pass variance (fastest bitwise setting on an H100, fused_kernel_blocks.py)
SUMSQ_WARPS = 4
MEAN_MIN_ROWS = 16  # below this PyTorch's reduce uses wider blocks (another order): keep torch's mean


def mean_square(x):
    """x.float().pow(2).mean(-1, keepdim=True) for a contiguous half-precision x, in the order
    PyTorch's CUDA mean sums, in one pass over x (no float32 copy of x*x); None where that order
    is not the one _sumsq_kernel reproduces (fewer than 16 rows, a last dimension that is not a
    multiple of 128), so the caller keeps torch's mean."""
    import numpy as np
    import torch

    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    if n == 0 or n % 128 or rows < MEAN_MIN_ROWS or not x.is_contiguous():
        return None
    out = torch.empty(x.shape[:-1] + (1,), dtype=torch.float32, device=x.device)
    _sumsq_kernel[(triton.cdiv(rows, SUMSQ_ROWS),)](x, out, rows, float(np.float32(1.0) / np.float32(n)), N=n,
                                                    ROWS=SUMSQ_ROWS, num_warps=SUMSQ_WARPS)
    return out


def rms_apply(x, r, w1):
    import torch

    y = torch.empty_like(x)
    _rms_apply_kernel[_grid(x.numel())](x, r, w1, y, x.numel(), x.shape[-1], BLOCK=BLOCK)
    return y


def gated_apply(x, r, z, w):
    import torch

    y = torch.empty_like(x)
    _gated_apply_kernel[_grid(x.numel())](x, r, z, w, y, x.numel(), x.shape[-1],
                                          W_LOWP=w.dtype == x.dtype, BLOCK=BLOCK)
    return y


def swiglu(g, u):
    import torch

    y = torch.empty_like(g)
    _swiglu_kernel[_grid(g.numel())](g, u, y, g.numel(), BLOCK=BLOCK)
    return y


CONV_STATE_BLOCK = (32, 64)  # (positions, channels) a program of the state kernel
CONV_STATE_WARPS = 4


def conv_silu_blc(x, w, state=None, split: int = 0):
    """x [B, L, C] (any strides), w [C, K] -> silu(causal depthwise conv) as [B, L, C] contiguous. With
    `state` [B, C, S] (S >= K - 1, any strides), the inputs before x's first are the state's last
    columns: the conv of the concatenation [state, x], its first S outputs left out. With `split` s
    (x contiguous or a state given), the same outputs as three contiguous tensors [B, L, s], [B, L, s]
    and [B, L, C - 2 s] (the GDN layer's query, key and value channels)."""
    import torch

    b, length, channels = x.shape
    if split:
        if state is None and not x.is_contiguous():
            raise ValueError("conv_silu_blc: split outputs need a contiguous input or a state")
        buf = torch.empty(b * length * channels, dtype=x.dtype, device=x.device)
        n = b * length * split
        y = buf
        parts = (buf[:n].view(b, length, split), buf[n:2 * n].view(b, length, split),
                 buf[2 * n:].view(b, length, channels - 2 * split))
    else:
        y = torch.empty((b, length, channels), dtype=x.dtype, device=x.device)
    if state is not None:
        block_t, block_c = CONV_STATE_BLOCK
        # the largest offset within a row, of an input or an output (whose position stride is channels)
        wide = (length + block_t) * max(abs(x.stride(1)), channels) + (channels + block_c) * max(abs(x.stride(2)), 1) >= 2**31
        _conv_silu_state_kernel[(b * triton.cdiv(length, block_t), triton.cdiv(channels, block_c))](
            x, state, w.contiguous(), y, length, channels, state.shape[-1], *x.stride(), *state.stride(),
            K=w.shape[-1], BLOCK_T=block_t, BLOCK_C=block_c, WIDE=wide, num_warps=CONV_STATE_WARPS, SPLIT=split)
        return parts if split else y
    if x.is_contiguous():
        block_c = 256
        _conv_silu_kernel[(b * length, triton.cdiv(channels, block_c))](
            x, w.contiguous(), y, length, channels, K=w.shape[-1], BLOCK_C=block_c, SPLIT=split)
        return parts if split else y
    block_t, block_c = 32, 64
    _conv_silu_strided_kernel[(b * triton.cdiv(length, block_t), triton.cdiv(channels, block_c))](
        x, w.contiguous(), y, length, channels, *x.stride(), K=w.shape[-1], BLOCK_T=block_t, BLOCK_C=block_c)
    return y


CONV_SEGMENT_BLOCK = (32, 64)  # (positions, channels) a program of the segments kernel
CONV_SEGMENT_WARPS = 4


def conv_segment_tiles(lengths, states, device):
    """The [tiles, 4] int32 table of conv_silu_segments for segments of `lengths` packed one after the
    other, `states[i]` the row of the start-state tensor segment i reads before its first token (or
    None: zeros); built once a forward, shared by its GDN layers, for the CONV_SEGMENT_BLOCK in force."""
    import torch

    block_t = CONV_SEGMENT_BLOCK[0]
    table, bos = [], 0
    for n, s in zip(lengths, states):
        table += [(-1 if s is None else s, t0, bos, n) for t0 in range(0, n, block_t)]
        bos += n
    return torch.tensor(table, dtype=torch.int32).to(device, non_blocking=True)


def conv_silu_segments(x, w, tiles, states=None, split: int = 0):
    """x [T, C] contiguous (segments packed one after the other), w [C, K] -> silu(causal depthwise
    conv) of each segment on its own, after the last columns of its start state (`states` [N, C, S],
    any strides, S >= K - 1; the row `tiles` names, see conv_segment_tiles), as [T, C], or with
    `split` s as three contiguous tensors [T, s], [T, s], [T, C - 2 s]. Each output is the one the
    state kernel (conv_silu_blc with a state) or, for a segment without one, the plain kernel gives
    its row alone: the same taps in the same order."""
    import torch

    tokens, channels = x.shape
    if not x.is_contiguous():
        raise ValueError("conv_silu_segments: a contiguous [tokens, channels] input")
    y = torch.empty((tokens, channels) if not split else (tokens * channels,), dtype=x.dtype, device=x.device)
    block_t, block_c = CONV_SEGMENT_BLOCK
    s = states if states is not None else x.new_zeros((1, channels, w.shape[-1]))
    _conv_silu_segments_kernel[(tiles.shape[0], triton.cdiv(channels, block_c))](
        x, s, w.contiguous(), y, tiles, channels, tokens, s.shape[-1], *s.stride(),
        K=w.shape[-1], BLOCK_T=block_t, BLOCK_C=block_c, num_warps=CONV_SEGMENT_WARPS, SPLIT=split)
    if not split:
        return y
    n = tokens * split
    return y[:n].view(tokens, split), y[n:2 * n].view(tokens, split), y[2 * n:].view(tokens, channels - 2 * split)


# ---------------------------------------------------------------- module forwards
def _lowp(x, contiguous: bool = True) -> bool:
    import torch

    return (x.dtype in (torch.float16, torch.bfloat16) and (x.is_cuda or INTERPRET)
            and (x.is_contiguous() or not contiguous))


# per norm piece: whether its variance is summed by mean_square (one pass; set by the start-up
# check, which falls back to x*x + torch's mean when that is not bitwise here)
ONE_PASS_VARIANCE = {"rms_norm": True, "gated_norm": True}


def _variance(x, piece: str):
    v = mean_square(x) if ONE_PASS_VARIANCE[piece] else None
    return v if v is not None else square_f32(x).mean(-1, keepdim=True)


def rms_norm_forward(m, x):
    """Qwen3_5RMSNorm.forward, fused; other inputs go to Transformers' code."""
    import torch

    if not _lowp(x):
        return type(m).forward(m, x)
    r = torch.rsqrt(_variance(x, "rms_norm") + m.eps)
    w1 = m.__dict__.get("_openjev_w1")
    if w1 is None or w1.device != x.device:
        w1 = 1.0 + m.weight.float()
        m.__dict__["_openjev_w1"] = w1
    return rms_apply(x, r, w1)


def gated_norm_forward(m, hidden_states, gate):
    """Qwen3_5RMSNormGated.forward (silu gate), fused."""
    import torch

    w = m.weight
    if not (_lowp(hidden_states) and gate.dtype == hidden_states.dtype and gate.shape == hidden_states.shape
            and gate.is_contiguous() and w.dtype in (hidden_states.dtype, torch.float32)
            and getattr(m, "activation", "silu") == "silu"):
        return type(m).forward(m, hidden_states, gate)
    r = torch.rsqrt(_variance(hidden_states, "gated_norm") + m.variance_epsilon)
    return gated_apply(hidden_states, r, gate, w)


def swiglu_forward(m, x):
    """Qwen3_5MLP.forward with silu: down_proj(silu(gate_proj(x)) * up_proj(x)), the middle fused."""
    g, u = m.gate_proj(x), m.up_proj(x)
    if not (_lowp(g) and u.dtype == g.dtype and u.is_contiguous() and _is_silu(m.act_fn)):
        return m.down_proj(m.act_fn(g) * u)
    return m.down_proj(swiglu(g, u))


_CONV_WEIGHTS: set[int] = set()  # data_ptr of the conv weights whose module passed its check
_CONV_CACHED_WEIGHTS: set[int] = set()  # ... and also its check on the cached [B, C, L] layout
_DEFERRED = threading.local()  # the (new inputs, prefix state) a cache layer handed to the next conv call


def defer_conv_state(x, state) -> None:
    """Hand the conv call that comes next with input `x` [B, C, L] the prefix state [B, C, S] that a
    cache would have concatenated in front of it (see make_conv_wrapper)."""
    _DEFERRED.pair = (x, state)


def _take_deferred(x):
    pair = getattr(_DEFERRED, "pair", None)
    if pair is None or pair[0] is not x:
        return None
    _DEFERRED.pair = None
    return pair[1]


def _fusable_conv(hidden_states, weight, bias, activation, checked: set) -> bool:
    """Whether the fused conv computes this call of the modeling module's causal_conv1d_fn: a
    registered weight of a layout whose check passed (`checked`), silu, no bias, FP16/BF16 throughout."""
    return (weight.data_ptr() in checked and bias is None and activation == "silu" and hidden_states.dim() == 3
            and _lowp(hidden_states, contiguous=False) and weight.dtype == hidden_states.dtype)


def conv_silu_qkv(hidden_states, weight, bias, activation, key_dim: int):
    """For the GDN forward (openjev/engine/gdn.py): the causal conv + silu of `hidden_states` [B, C, L]
    (as Transformers passes it, with a prefix state a cache layer handed on) as contiguous query, key
    and value tensors [B, L, key_dim], [B, L, key_dim], [B, L, C - 2 key_dim], where make_conv_wrapper
    would run the fused kernel on that layout; None elsewhere (the caller then calls the modeling
    module's causal_conv1d_fn, which takes any handed-on state)."""
    pair = getattr(_DEFERRED, "pair", None)
    state = pair[1] if pair is not None and pair[0] is hidden_states else None
    blc = hidden_states.transpose(1, 2)
    if state is not None:
        if not (_fusable_conv(hidden_states, weight, bias, activation, _CONV_CACHED_WEIGHTS)
                and state.dtype == hidden_states.dtype):
            return None
        _DEFERRED.pair = None
        return conv_silu_blc(blc, weight, state=state, split=key_dim)
    if not (blc.is_contiguous() and _fusable_conv(hidden_states, weight, bias, activation, _CONV_WEIGHTS)):
        return None
    return conv_silu_blc(blc, weight, split=key_dim)


def conv_segments_qkv(x, m, tiles, states):
    """For the packed GDN forward (openjev/engine/packed.py): the conv + silu of the GDN layer `m` on
    packed segments x [T, C] (see conv_silu_segments) as contiguous query, key and value tensors,
    where the state kernel passed its check for this layer's weight; None elsewhere (the caller then
    runs the modeling module's conv a row at a time)."""
    weight = m.conv1d.weight.squeeze(1)
    if not (x.is_contiguous() and _fusable_conv(x[None], weight, m.conv1d.bias, m.activation, _CONV_CACHED_WEIGHTS)
            and (states is None or states.dtype == x.dtype)):
        return None
    return conv_silu_segments(x, weight, tiles, states, split=m.key_dim)


def segments_conv_in_use(model) -> bool:
    """Whether the packed GDN forward of `model` runs the segments kernel (its conv weights passed the
    state kernel's check)."""
    m = _first(model, "GatedDeltaNet")
    return m is not None and triton is not None and m.conv1d.weight.data_ptr() in _CONV_CACHED_WEIGHTS


def grouped_heads_fused_forward(m, *args, **kwargs):
    """The grouped-heads GDN forward (openjev/engine/gdn.py) with the conv's outputs written apart
    where the fused conv runs."""
    return grouped_heads_forward(m, *args, conv_qkv=conv_silu_qkv, **kwargs)


def make_conv_wrapper(original):
    """A stand-in for the modeling module's causal_conv1d_fn: fused for the registered GDN conv
    weights, whether the input is the transposed view of a contiguous [B, L, C] projection (as the
    GDN forward passes it without a cache) or a contiguous [B, C, L] tensor (the cached inputs and
    the new ones concatenated, as a forward from a prefix state passes it), each layout where its
    check passed; Transformers' function otherwise. Returns [B, C, L] as a transposed view of a
    contiguous [B, L, C] tensor, so the GDN forward's transpose back is contiguous. An input that a
    cache layer handed on with its prefix state (defer_conv_state) is not concatenated where the
    cached layout passed its check: the state kernel reads the state in place and the output is
    the new inputs' alone (the GDN forward keeps the last L outputs either way)."""

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        state = _take_deferred(hidden_states)
        if state is not None:
            if (_fusable_conv(hidden_states, weight, bias, activation, _CONV_CACHED_WEIGHTS)
                    and state.dtype == hidden_states.dtype):
                return conv_silu_blc(hidden_states.transpose(1, 2), weight, state=state).transpose(1, 2)
            import torch

            hidden_states = torch.cat([state, hidden_states], dim=-1)
        blc = hidden_states.transpose(1, 2)
        checked = _CONV_WEIGHTS if blc.is_contiguous() else _CONV_CACHED_WEIGHTS
        if _fusable_conv(hidden_states, weight, bias, activation, checked):
            return conv_silu_blc(blc, weight).transpose(1, 2)
        return original(hidden_states, weight, bias, activation=activation, **kwargs)

    causal_conv1d_fn.__wrapped__ = original
    causal_conv1d_fn._openjev_fused = True
    return causal_conv1d_fn


# ---------------------------------------------------------------- checks and patching
# the pieces that replace a module's forward: class-name suffix, fused forward, an attribute the
# module must have ("RMSNorm" does not match "RMSNormGated": the suffix is the name's end)
MODULE_PIECES = {
    "rms_norm": ("RMSNorm", rms_norm_forward, "weight"),
    "gated_norm": ("RMSNormGated", gated_norm_forward, "weight"),
    "swiglu": ("MLP", swiglu_forward, "gate_proj"),
    "grouped_heads": ("GatedDeltaNet", grouped_heads_fused_forward, "in_proj_qkv"),
}
CHECK_SHAPES = ((1, 37), (3, 129), (2, 300))  # (rows, length) of the random inputs


def _text_modules(model, suffix: str):
    """The model's modules whose class name ends with `suffix`, the vision tower's left out."""
    return (m for m in model.modules() if type(m).__name__.endswith(suffix) and "Vision" not in type(m).__name__)


def _first(model, suffix: str):
    return next(_text_modules(model, suffix), None)


def gdn_modeling(model):
    """The Transformers modeling module whose module-level kernels (torch_chunk_gated_delta_rule,
    causal_conv1d_fn) the model's Gated DeltaNet layers call; None without such layers."""
    gdn = _first(model, "GatedDeltaNet")
    return sys.modules.get(type(gdn).__module__) if gdn is not None else None


def _is_silu(act) -> bool:
    """nn.SiLU or Transformers' SiLUActivation (both call F.silu)."""
    import torch.nn as nn

    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _equal_on(fn_a, fn_b, inputs) -> tuple[bool, float]:
    """Whether two callables give bitwise equal outputs on every input tuple; the largest
    absolute difference seen (0.0 when equal)."""
    compare = Bitwise()
    for args in inputs:
        compare(fn_a(*args), fn_b(*args))
    return compare.result


def _check_variance(piece: str, width: int, check) -> tuple[bool, float, str]:
    """A norm piece's check with the one-pass variance and, if that is not bitwise here, again
    with x*x + torch's mean (ONE_PASS_VARIANCE[piece] left as the check found it); returns the
    check's (same, worst) and how the variance is summed."""
    ONE_PASS_VARIANCE[piece] = True
    same, worst = check()
    if width % 128:  # mean_square declines this width: the check ran torch's mean
        return same, worst, f"x*x, then torch.mean (width {width} is not a multiple of 128)"
    if same:
        return same, worst, "one pass (PyTorch's CUDA summation order)"
    ONE_PASS_VARIANCE[piece] = False
    same, worst = check()
    return same, worst, "x*x, then torch.mean (the one-pass order was not bitwise here)"


def _check_piece(piece: str, model, modeling, device, dtype, done: dict | None = None) -> dict:
    """One piece against what it replaces on random inputs; `done`: the pieces checked before it."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(14)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    variance = None  # how a norm piece sums its variance
    if piece == "grouped_heads":
        m = _first(model, "GatedDeltaNet")
        if m is None or not hasattr(m, "in_proj_qkv") or m.num_v_heads == m.num_k_heads:
            return {"used": False, "reason": "no GatedDeltaNet module with fewer key heads than value heads"}
        takes, why = kernel_takes_grouped_heads(modeling)
        if not takes:
            return {"used": False, "reason": why}
        conv = (done or {}).get("conv_silu", {})
        w = m.conv1d.weight.squeeze(1)
        cached = bool(conv.get("cached_layout", {}).get("used"))
        registered = ([_CONV_WEIGHTS] if conv.get("used") else []) + ([_CONV_CACHED_WEIGHTS] if cached else [])
        for weights in registered:  # the fused conv as it will run, its outputs written apart
            weights.add(w.data_ptr())
        try:
            same, worst = check_grouped_heads(m, modeling, rnd, CHECK_SHAPES, forward=grouped_heads_fused_forward)
            if cached:  # from a prefix state: apart, and as one tensor
                ins = [(rnd(b, t, w.shape[0], scale=2.0), rnd(b, w.shape[0], w.shape[1], scale=2.0))
                       for b, t in CHECK_SHAPES]
                split_same, split_worst = _equal_on(
                    lambda x, state: conv_silu_blc(x, w, state=state),
                    lambda x, state: torch.cat(conv_silu_blc(x, w, state=state, split=m.key_dim), dim=-1), ins)
                same, worst = same and split_same, max(worst, split_worst)
        finally:
            for weights in registered:
                weights.discard(w.data_ptr())
    elif piece in MODULE_PIECES:
        suffix, forward, _ = MODULE_PIECES[piece]
        m = _first(model, suffix)
        if m is None or (piece == "swiglu" and not _is_silu(getattr(m, "act_fn", None))):
            return {"used": False, "reason": f"no {suffix} module" + (" with a silu activation" if piece == "swiglu" else "")}
        if piece == "rms_norm":
            ins = [(rnd(b, t, m.weight.shape[0], scale=3.0),) for b, t in CHECK_SHAPES]
        elif piece == "gated_norm":
            h = m.weight.shape[0]
            ins = [(rnd(b * t * 4, h), rnd(b * t * 4, h, scale=2.0)) for b, t in CHECK_SHAPES]
        else:
            ins = [(rnd(b, t, m.gate_proj.in_features),) for b, t in CHECK_SHAPES]
        def check():
            return _equal_on(lambda *x: type(m).forward(m, *x), lambda *x: forward(m, *x), ins)

        if piece in ONE_PASS_VARIANCE:
            same, worst, variance = _check_variance(piece, ins[0][0].shape[-1], check)
        else:
            same, worst = check()
    elif piece == "conv_silu":
        m = _first(model, "GatedDeltaNet")
        original = getattr(modeling, "causal_conv1d_fn", None)
        if m is None or original is None:
            return {"used": False, "reason": "no GatedDeltaNet module or no causal_conv1d_fn in its module"}
        original = getattr(original, "__wrapped__", original) if getattr(original, "_openjev_fused", False) else original
        w = m.conv1d.weight.squeeze(1)
        # as the GDN forward passes its input: the projection's transposed view, and with a cache the
        # cached inputs concatenated with it ([B, C, K - 1 + L] contiguous), each layout checked apart
        ins = [(rnd(b, t, w.shape[0], scale=2.0).transpose(1, 2),) for b, t in CHECK_SHAPES]
        cached_ins = [(rnd(b, w.shape[0], w.shape[1] - 1 + t, scale=2.0),) for b, t in CHECK_SHAPES]
        # and the new inputs apart from a prefix state of K columns, as a cache layer hands them on
        state_ins = [(rnd(b, w.shape[0], w.shape[1], scale=2.0), rnd(b, t, w.shape[0], scale=2.0).transpose(1, 2))
                     for b, t in CHECK_SHAPES]
        wrapper = make_conv_wrapper(original)
        _CONV_WEIGHTS.add(w.data_ptr())
        _CONV_CACHED_WEIGHTS.add(w.data_ptr())

        def want(x):
            return original(x, w, None, activation="silu")

        def got(x):
            return wrapper(x, w, None, activation="silu")

        def want_after_state(state, x):
            return want(torch.cat([state, x], dim=-1))[..., -x.shape[-1]:]

        def got_after_state(state, x):
            defer_conv_state(x, state)
            return got(x)

        try:
            same, worst = _equal_on(want, got, ins)
            cached_same, cached_worst = _equal_on(want, got, cached_ins)
            state_same, state_worst = _equal_on(want_after_state, got_after_state, state_ins)
        finally:
            _CONV_WEIGHTS.discard(w.data_ptr())
            _CONV_CACHED_WEIGHTS.discard(w.data_ptr())
        cached_same, cached_worst = cached_same and state_same, max(cached_worst, state_worst)
        cached = {"used": same and cached_same, "bitwise_on_check": cached_same}
        if not cached_same:
            cached["max_abs_diff"] = cached_worst
    else:
        raise ValueError(piece)
    out = {"used": same, "bitwise_on_check": same, "check_shapes": [list(s) for s in CHECK_SHAPES]}
    if piece == "conv_silu":
        out["cached_layout"] = cached  # the input of a forward from a prefix state (--prefix-reuse)
    if variance is not None and same:
        out["variance"] = variance
    if not same:
        out["reason"] = f"not bitwise equal to Transformers' module on this device (max abs diff {worst:.3g})"
        out["max_abs_diff"] = worst
    return out


def apply_fused(model, device: str, mode: str | None = None) -> dict:
    """Check every piece on this device and install the ones that are bitwise equal; returns the
    record kept in kernel_path["fused"]."""
    import torch

    mode = fused_mode(mode)
    record: dict = {"requested": mode, "pieces": {}, "triton": getattr(triton, "__version__", None),
                    "interpret": INTERPRET}
    if mode == "off":
        record["reason"] = f"{FUSED_ENV}=off"
        return _remember(model, record)
    if not (str(device).startswith("cuda") or INTERPRET):
        record["reason"] = f"device {device}: Triton GPU kernels (TRITON_INTERPRET=1 runs them on a CPU, for tests)"
        return _remember(model, record)
    if triton is None:
        record["reason"] = f"Triton not importable ({_TRITON_ERROR})"
        log.warning("fused kernels: none (%s)", record["reason"])
        return _remember(model, record)
    modeling = gdn_modeling(model)
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float16, torch.bfloat16):
        record["reason"] = f"model dtype {dtype}: the pieces round to FP16/BF16 as the half-precision forward does"
        return _remember(model, record)
    t0 = time.perf_counter()
    asked = PIECES if mode == "auto" else mode.split(",")
    with torch.inference_mode():
        for piece in PIECES:
            if piece not in asked:
                record["pieces"][piece] = {"used": False, "reason": f"not in {FUSED_ENV}={mode}"}
                continue
            try:
                record["pieces"][piece] = _check_piece(piece, model, modeling, device, dtype, record["pieces"])
            except Exception as exc:  # noqa: BLE001 - a kernel that does not compile or run here
                record["pieces"][piece] = {"used": False, "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    record["check_seconds"] = round(time.perf_counter() - t0, 3)
    counts = _install(model, modeling, {p for p, r in record["pieces"].items() if r["used"]},
                      cached_conv=record["pieces"]["conv_silu"].get("cached_layout", {}).get("used", False))
    for piece, n in counts.items():
        record["pieces"][piece]["modules"] = n
    used = [p for p in PIECES if record["pieces"][p]["used"]]
    record["reason"] = (f"{len(used)} of {len(PIECES)} pieces bitwise equal to Transformers' modules on {device}: "
                        f"{', '.join(used) or 'none'}")
    for p in PIECES:
        if not record["pieces"][p]["used"]:
            log.warning("fused %s not used: %s", p, record["pieces"][p]["reason"])
    log.info("fused kernels: %s", record["reason"])
    return _remember(model, record)


def _remember(model, record: dict) -> dict:
    model._openjev_fused = record
    return record


def _install(model, modeling, pieces: set[str], cached_conv: bool = False) -> dict:
    import functools

    counts = {p: 0 for p in pieces}
    for piece, (suffix, forward, needs) in MODULE_PIECES.items():
        if piece in pieces:
            for m in _text_modules(model, suffix):
                if hasattr(m, needs):
                    m.forward = functools.partial(forward, m)
                    counts[piece] += 1
    if "conv_silu" in pieces:
        for m in _text_modules(model, "GatedDeltaNet"):
            _CONV_WEIGHTS.add(m.conv1d.weight.data_ptr())
            if cached_conv:
                _CONV_CACHED_WEIGHTS.add(m.conv1d.weight.data_ptr())
            counts["conv_silu"] += 1
        if modeling is not None and not getattr(modeling.causal_conv1d_fn, "_openjev_fused", False):
            modeling.causal_conv1d_fn = make_conv_wrapper(modeling.causal_conv1d_fn)
    return counts


def fused_record(model) -> dict | None:
    return getattr(model, "_openjev_fused", None)


def remove_fused(model) -> None:
    """Give every module back Transformers' forward (benchmarks compare both in one process); a packed
    MLP (openjev/engine/packing.py remove_packed_mlp) is taken off first."""
    for m in model.modules():
        fwd = m.__dict__.get("forward")
        if getattr(fwd, "func", None) in [forward for _, forward, _ in MODULE_PIECES.values()]:
            del m.forward
        conv = getattr(m, "conv1d", None)
        if conv is not None:
            _CONV_WEIGHTS.discard(conv.weight.data_ptr())
            _CONV_CACHED_WEIGHTS.discard(conv.weight.data_ptr())
    model.__dict__.pop("_openjev_fused", None)
