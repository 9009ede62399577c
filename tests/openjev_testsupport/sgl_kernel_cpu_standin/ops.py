"""The stand-in ops, written for this project in plain PyTorch.

Each function has the argument list of the sgl-kernel CPU op of the same name (schemas in
``__init__.SCHEMAS``) and computes what that op computes, as read from the kernel source
(github:mingfeima/sglang at 2f14d6c, ``sgl-kernel/csrc/cpu/``: ``activation.cpp``, ``norm.cpp``,
``model/qwen3.cpp``, ``mamba/conv.cpp``, ``mamba/fla.cpp``). Arithmetic is float32 with the results
rounded to the input's dtype at the points where the kernel stores a reduced-precision tensor; the
kernel's own refusals (dtypes, shapes, head sizes) are kept, with its messages, so a call the real
library refuses is refused here too. Semantics the kernel has and a caller may not expect are kept
as well, because these stand in for the library and must agree with it:

* ``causal_conv1d_*``: ``is_vnni=True`` means the weight is in the kernel's packed layout
  ([dim/32, 2, 32, 2] per 32 channels); the varlen form of ``causal_conv1d_fwd_cpu``
  (``query_start_loc`` given) convolves every sequence from zeros, whatever ``has_initial_state``
  says (the kernel's varlen path does not read the previous window); ``conv_states`` is re-laid in
  place to strides (width-1)*dim, 1, dim on first use.
* ``chunk_gated_delta_rule_cpu`` always starts from ``initial_state[initial_state_indices[i]]`` and
  writes the final state back there; the state is [slots, Hv, Dk, Dv] float32.
"""

from __future__ import annotations

import math

import torch

_REDUCED = (torch.bfloat16, torch.float16)
_BLOCK_N = 32  # block_size_n() in csrc/cpu/gemm.h: the conv weight packing block
_CHUNK = 64    # CHUNK_SIZE of chunk_gated_delta_rule_cpu


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def _check_reduced(dtype: torch.dtype, what: str) -> None:
    _check(dtype in _REDUCED, f"{what}: unsupported data type {dtype} (the CPU kernel takes bfloat16/float16)")


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float32) as the kernel stores it in dtype, back in float32 for further float32 arithmetic."""
    return x.to(dtype).float()


def _fresh(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new tensor with contiguous strides, as the kernel's at::empty({...}) gives (clone() would keep
    a view's strides where a dimension has size 1, and callers check strides exactly)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype).copy_(t)


def _like(template: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """value in a tensor allocated like at::empty_like(template)."""
    return torch.empty_like(template).copy_(value)


def _sigmoid_scalar(b: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-b)) as the kernel's scalar code evaluates it on a reduced-precision b: c10's exp,
    + and / on BFloat16/Half round each result to that type. Returned in float32."""
    dt = b.dtype
    e = torch.exp(-b.float()).to(dt).float()
    return (1.0 / (1.0 + e).to(dt).float()).to(dt).float()


def _softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    return torch.where(x > threshold, x, torch.where(x < -threshold, torch.exp(x), torch.log1p(torch.exp(x))))


# ------------------------------------------------------------------------------------- activation
def fused_sigmoid_mul_cpu(input: torch.Tensor, gate: torch.Tensor, inplace: bool) -> torch.Tensor:
    """input[t, h*hd + d] * sigmoid(gate[t, (h,) d]); written into input when inplace."""
    _check(input.dim() == 2, "input must be a 2D tensor")
    _check(gate.dim() in (2, 3), "gate must be a 2D or 3D tensor")
    _check(input.is_contiguous(), "input must be contiguous")
    _check(gate.stride(-1) == 1, "gatemust be contiguous at last dimension")
    _check(gate.dtype == input.dtype, "gate and input dtypes differ")
    _check_reduced(input.dtype, "fused_sigmoid_mul")
    tokens, dim = input.shape
    heads = gate.shape[1] if gate.dim() == 3 else 1
    head_dim = gate.shape[-1]
    _check(gate.shape[0] == tokens, f"CHECK_EQ(gate.size(0), num_tokens) failed. {gate.shape[0]} vs {tokens}")
    _check(dim == heads * head_dim, f"CHECK_EQ(d, num_heads * head_dim) failed. {dim} vs {heads * head_dim}")
    x = input.float().view(tokens, heads, head_dim)
    g = gate.float().reshape(tokens, heads, head_dim)
    out = (x * torch.sigmoid(g)).reshape(tokens, dim)
    if inplace:
        input.copy_(out)
        return input
    return _like(input, out)


# ------------------------------------------------------------------------------------------- norms
def _rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def fused_rmsnorm_gated_cpu(input: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight * silu(gate), per row of a 2D input."""
    _check(input.stride(-1) == 1, "inputmust be contiguous at last dimension")
    _check(input.dim() == 2, f"Expected input dim to match template constraints, got {input.dim()}")
    batch, hidden = input.shape
    st = input.dtype
    _check(tuple(weight.shape) == (hidden,) and weight.dtype == st and weight.is_contiguous(),
           f"Input tensor shape mismatch: expected [{hidden}], got {list(weight.shape)}")
    _check(tuple(gate.shape) == (batch, hidden) and gate.dtype == st and gate.is_contiguous(),
           f"Input tensor shape mismatch: expected [{batch}, {hidden}], got {list(gate.shape)}")
    _check_reduced(st, "fused_rmsnorm_gated")
    x = input.float()
    g = gate.float()
    return _like(input, x * _rms_scale(x, eps) * weight.float() * (g * torch.sigmoid(g)))


def _gemma_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int) -> torch.Tensor:
    """[rows, heads, head_dim] float32: per-head x / rms(x) * (1 + weight)."""
    return x * _rms_scale(x, eps) * (weight.float() + 1.0)


def _check_qk(q: torch.Tensor, k: torch.Tensor, q_weight, k_weight, head_dim: int) -> None:
    for name, t in (("q", q), ("k", k)):
        _check(t.stride(-1) == 1, f"{name}must be contiguous at last dimension")
        _check(t.dim() == 2, f"Expected input dim to match template constraints, got {t.dim()}")
    st = q.dtype
    _check(k.shape[0] == q.shape[0], f"CHECK_EQ(k.size(0), batch_size) failed. {k.shape[0]} vs {q.shape[0]}")
    _check(k.dtype == st, "k and q dtypes differ")
    for w in (q_weight, k_weight):
        _check(tuple(w.shape) == (head_dim,) and w.dtype == st and w.is_contiguous(),
               f"Input tensor shape mismatch: expected [{head_dim}], got {list(w.shape)}")
    _check_reduced(st, "fused_qk_gemma_rmsnorm")


def fused_qk_gemma_rmsnorm_cpu(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                               eps: float, head_dim: int):
    """Gemma RMSNorm (weight + 1) over each head of q [B, Hq*D] and k [B, Hk*D]; outputs keep the shapes."""
    _check_qk(q, k, q_weight, k_weight, head_dim)
    batch = q.shape[0]
    nq, nk = q.shape[1] // head_dim, k.shape[1] // head_dim
    qf = q[:, : nq * head_dim].float().reshape(batch, nq, head_dim)
    kf = k[:, : nk * head_dim].float().reshape(batch, nk, head_dim)
    q_out = torch.empty_like(q)
    k_out = torch.empty_like(k)
    q_out[:, : nq * head_dim] = _gemma_heads(qf, q_weight, eps, head_dim).reshape(batch, -1).to(q.dtype)
    k_out[:, : nk * head_dim] = _gemma_heads(kf, k_weight, eps, head_dim).reshape(batch, -1).to(k.dtype)
    return q_out, k_out


def fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                                         k_weight: torch.Tensor, eps: float, head_dim: int, num_head: int):
    """q_gate [B, H*2*D] holds [q_h, gate_h] per head: returns normed q [B*H, D], normed k [B*Hk, D], gate [B*H, D]."""
    _check_qk(q_gate, k, q_weight, k_weight, head_dim)
    _check(q_gate.shape[1] == num_head * head_dim * 2,
           f"CHECK_EQ(q_gate.size(1), num_head * head_dim * 2) failed. {q_gate.shape[1]} vs {num_head * head_dim * 2}")
    batch = q_gate.shape[0]
    nk = k.shape[1] // head_dim
    qg = q_gate.reshape(batch, num_head, 2, head_dim)
    q_out = _gemma_heads(qg[:, :, 0].float(), q_weight, eps, head_dim).reshape(batch * num_head, head_dim)
    k_out = _gemma_heads(k[:, : nk * head_dim].float().reshape(batch, nk, head_dim), k_weight, eps, head_dim)
    gate = qg[:, :, 1].reshape(batch * num_head, head_dim)
    return _fresh(q_out, q_gate.dtype), _fresh(k_out.reshape(batch * nk, head_dim), k.dtype), _fresh(gate)


# ------------------------------------------------------------------------------- projection split
def fused_qkvzba_split_reshape_cat_contiguous_cpu(mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor,
                                                  num_heads_qk: int, num_heads_v: int, head_qk: int, head_v: int):
    """[q|k|v|z] rows -> (q|k|v [B, qkv], z [B, Hv, Dv], b [B, Hv], a [B, Hv]); mixed_ba rows are [b|a]."""
    batch = mixed_qkvz.shape[0]
    k_tp, v_tp = num_heads_qk * head_qk, num_heads_v * head_v
    qkv_dim = 2 * k_tp + v_tp
    st = mixed_qkvz.dtype
    for t, shape in ((mixed_qkvz, (batch, qkv_dim + v_tp)), (mixed_ba, (batch, 2 * num_heads_v))):
        _check(tuple(t.shape) == shape, f"Input tensor shape mismatch: expected {list(shape)}, got {list(t.shape)}")
        _check(t.dtype == st, "Input tensor dtype mismatch")
        _check(t.is_contiguous(), "tensor must be contiguous")
    _check_reduced(st, "fused_qkvzba_split_reshape_cat_contiguous")
    mixed_qkv = _fresh(mixed_qkvz[:, :qkv_dim])
    z = _fresh(mixed_qkvz[:, qkv_dim:].reshape(batch, num_heads_v, head_v))
    return mixed_qkv, z, _fresh(mixed_ba[:, :num_heads_v]), _fresh(mixed_ba[:, num_heads_v:])


# ---------------------------------------------------------------------------------------- gating
def fused_gdn_gating_cpu(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor):
    """g = -exp(A_log) * softplus(a + dt_bias) (float32 [1, B, H]); beta = sigmoid(b) ([1, B, H], b's dtype)."""
    _check(A_log.dim() == 1, "A_log must be a 1D tensor")
    _check(a.dim() == 2, "a must be a 2D tensor")
    _check(b.dim() == 2, "b must be a 2D tensor")
    _check(dt_bias.dim() == 1, "dt_bias must be a 1D tensor")
    _check(a.is_contiguous(), "a must be contiguous")
    _check(A_log.shape[0] == a.shape[1], f"CHECK_EQ(A_log.size(0), a.size(1)) failed. {A_log.shape[0]} vs {a.shape[1]}")
    _check(A_log.shape[0] == dt_bias.shape[0], "CHECK_EQ(A_log.size(0), dt_bias.size(0)) failed.")
    batch, heads = a.shape
    _check(tuple(b.shape) == (batch, heads), "CHECK_EQ(b.size(0), batch) failed.")
    _check_reduced(a.dtype, "fused_gdn_gating")
    _check(A_log.dtype == torch.float32 or A_log.dtype == a.dtype, "Unsupported floating data type.")
    _check(b.dtype == a.dtype and dt_bias.dtype == a.dtype, "expected scalar type of b and dt_bias to be a's")
    g = -torch.exp(A_log.float()) * _softplus(a.float() + dt_bias.float())
    # the vectorized part (whole vectors of 32 heads) uses a float32 sigmoid, the rest the scalar code
    vec = heads - heads % 32
    beta = torch.cat([torch.sigmoid(b[:, :vec].float()), _sigmoid_scalar(b[:, vec:])], dim=1).to(b.dtype)
    return _fresh(g.reshape(1, batch, heads)), _fresh(beta.reshape(1, batch, heads))


# ----------------------------------------------------------------------------- gated delta rule
def _l2_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    return 1.0 / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
                                               softplus_beta=1.0, softplus_threshold=20.0):
    """Recurrent (decode) gated delta rule with the gate computed from A_log/a/dt_bias and beta = sigmoid(b).

    q, k [S, B, H, D]; v [S, B, Hv, Dv]; a, b [B, Hv]; state [slots, Hv, D, Dv] float32 updated in place at
    initial_state_indices[B]; returns [B, S, Hv, Dv]. softplus_beta is accepted and unused, as in the kernel.
    """
    _check(q.dim() == 4, "q must be a 4D tensor")
    _check(v.dim() == 4, "v must be a 4D tensor")
    _check(q.stride(-1) == 1, "qmust be contiguous at last dimension")
    seq_len, batch, heads, head_dim = q.shape
    v_heads, v_head_dim = v.shape[2], v.shape[3]
    st = q.dtype

    def shape_ok(t, shape, dtype, name):
        _check(tuple(t.shape) == tuple(shape), f"Input tensor shape mismatch: expected {list(shape)}, got {list(t.shape)}")
        _check(t.dtype == dtype, "Input tensor dtype mismatch")
        _check(t.stride(-1) == 1, f"{name}must be contiguous at last dimension")

    shape_ok(k, (seq_len, batch, heads, head_dim), st, "k")
    shape_ok(v, (seq_len, batch, v_heads, v_head_dim), st, "v")
    shape_ok(a, (batch, v_heads), st, "a")
    shape_ok(dt_bias, (v_heads,), st, "dt_bias")
    shape_ok(b, (batch, v_heads), st, "b")
    shape_ok(initial_state_indices, (batch,), torch.int32, "initial_state_indices")
    shape_ok(cu_seqlens, (batch + 1,), torch.int32, "cu_seqlens")
    state = initial_state_source
    shape_ok(state, (state.shape[0], v_heads, head_dim, v_head_dim), torch.float32, "initial_state_source")
    _check(state.shape[0] >= batch, "initial_state_source.size(0) >= batch_size")
    _check(v_heads % heads == 0, f"CHECK_EQ(v_num_heads % num_heads, 0) failed. {v_heads % heads} vs 0")
    _check(tuple(A_log.shape) == (v_heads,), f"Input tensor shape mismatch: expected [{v_heads}], got {list(A_log.shape)}")
    _check_reduced(st, "fused_sigmoid_gating_delta_rule_update")
    _check(A_log.dtype == torch.float32 or A_log.dtype == st, "Unsupported floating data type.")

    group = v_heads // heads
    scale = 1.0 / math.sqrt(head_dim)
    qf, kf, vf = q.float(), k.float(), v.float()
    if use_qk_l2norm_in_kernel:
        qf = qf * _l2_scale(qf, 1e-5)
        kf = kf * _l2_scale(kf, 1e-5)
    qf = qf.repeat_interleave(group, dim=2)  # [S, B, Hv, D]
    kf = kf.repeat_interleave(group, dim=2)
    g = -torch.exp(A_log.float()) * _softplus(a.float() + dt_bias.float(), softplus_threshold)  # [B, Hv]
    decay = torch.exp(g)[..., None, None]
    beta = _sigmoid_scalar(b)[..., None]                                                         # [B, Hv, 1]
    idx = initial_state_indices.long()
    s = state[idx].clone()                                                                       # [B, Hv, D, Dv]
    out = torch.empty(batch, seq_len, v_heads, v_head_dim, dtype=st)
    for t in range(seq_len):
        kt, qt = kf[t], qf[t]                                                                    # [B, Hv, D]
        s = s * decay
        kv_mem = torch.einsum("bhkv,bhk->bhv", s, kt)
        delta = (vf[t] - kv_mem) * beta
        s = s + kt[..., :, None] * delta[..., None, :]
        out[:, t] = (torch.einsum("bhkv,bhk->bhv", s, qt) * scale).to(st)
    state[idx] = s
    return out


def _check_head_dim(d: int) -> None:
    _check(d in (64, 128), f"Unexpected head dim size, {d}")


def chunk_gated_delta_rule_cpu(query, key, value, g, beta, initial_state, output_final_state, cu_seqlens,
                               head_first, use_qk_l2norm_in_kernel, initial_state_indices, eps=1e-6):
    """Chunked (64-token) gated delta rule over varlen sequences packed in batch 1.

    query, key [1, T, H, D] bf16; value [1, T, Hv, Dv] bf16; g [1, T, Hv] float32 (log decay);
    beta [1, T, Hv] bf16; initial_state [slots, Hv, D, Dv] float32, read and overwritten at
    initial_state_indices[i] for sequence i of cu_seqlens. Returns (out [1, T, Hv, Dv], initial_state).
    Rounding to bf16 follows the kernel's stored intermediates (normed q/k, w, u, the solved
    block, the corrected values, the state as matmul operand); accumulation is float32.
    """
    _check(not head_first, "chunk_gated_delta_rule_cpu: does not support head first")
    B, T, H, D = query.shape
    Hv, Dv = value.shape[2], value.shape[3]
    num_seqs = initial_state_indices.shape[0]
    name = "chunk_gated_delta_rule_cpu"
    _check(B == 1, f"{name}: expect batch size to be 1")
    _check(Hv % H == 0, f"{name}: expect num_heads_kv multiple of num_heads.")
    _check(D % 32 == 0, f"{name}: expect head_dim to be multiples of 32.")
    _check(Dv % 32 == 0, f"{name}: expect head_dim_v to be multiples of 32.")
    _check(D == Dv, f"{name}: expect head_dim to be equal to head_dim_v.")

    def shape_ok(t, shape, dtype, last_only):
        _check(tuple(t.shape) == tuple(shape), f"Input tensor shape mismatch: expected {list(shape)}, got {list(t.shape)}")
        _check(t.dtype == dtype, "Input tensor dtype mismatch")
        _check(t.stride(-1) == 1 if last_only else t.is_contiguous(), "tensor must be contiguous")

    bf = torch.bfloat16
    shape_ok(query, (B, T, H, D), bf, True)
    shape_ok(key, (B, T, H, D), bf, True)
    shape_ok(value, (B, T, Hv, Dv), bf, True)
    shape_ok(g, (B, T, Hv), torch.float32, False)
    shape_ok(beta, (B, T, Hv), bf, False)
    shape_ok(cu_seqlens, (num_seqs + 1,), torch.int32, False)
    shape_ok(initial_state, (initial_state.shape[0], Hv, Dv, D), torch.float32, False)
    shape_ok(initial_state_indices, (num_seqs,), torch.int32, False)
    _check_head_dim(D)

    scale = 1.0 / math.sqrt(D)
    if use_qk_l2norm_in_kernel:
        qf, kf = query[0].float(), key[0].float()
        q_n = _round(qf * _l2_scale(qf, eps) * scale, bf)
        k_n = _round(kf * _l2_scale(kf, eps), bf)
    else:
        q_n = query[0].mul(scale).float()
        k_n = key[0].float()
    group = Hv // H
    q_n = q_n.repeat_interleave(group, dim=1).transpose(0, 1)   # [Hv, T, D]
    k_n = k_n.repeat_interleave(group, dim=1).transpose(0, 1)
    v_f = value[0].float().transpose(0, 1)                      # [Hv, T, Dv]
    g_f = g[0].transpose(0, 1)                                   # [Hv, T]
    b_f = beta[0].float().transpose(0, 1)                        # [Hv, T]
    out = torch.empty(Hv, T, Dv, dtype=torch.float32)
    offsets = cu_seqlens.tolist()
    slots = initial_state_indices.tolist()
    for i in range(num_seqs):
        s = initial_state[slots[i]].clone()                      # [Hv, D, Dv]
        for c0 in range(offsets[i], offsets[i + 1], _CHUNK):
            c1 = min(c0 + _CHUNK, offsets[i + 1])
            q, k, v = q_n[:, c0:c1], k_n[:, c0:c1], v_f[:, c0:c1]
            gc = torch.cumsum(g_f[:, c0:c1], dim=-1)             # [Hv, C]
            bc = b_f[:, c0:c1]
            n = c1 - c0
            diff = gc[:, :, None] - gc[:, None, :]
            lower = torch.ones(n, n, dtype=torch.bool).tril()
            decay = torch.where(lower, torch.exp(torch.where(lower, diff, 0.0)), 0.0)
            # (I + L)^-1 with L = strictly lower beta_i * decay_ij * k_i.k_j, then w and u
            kk = k @ k.transpose(-1, -2)
            neg_l = _round(torch.where(lower.tril(-1), -kk * bc[:, :, None] * decay, 0.0), bf)
            eye = torch.eye(n).expand(Hv, n, n)
            solved = _round(torch.linalg.solve_triangular(eye - neg_l, eye, upper=False, unitriangular=True), bf)
            w = _round(solved @ _round(k * (bc * torch.exp(gc))[..., None], bf), bf)
            u = _round(solved @ _round(v * bc[..., None], bf), bf)
            # output and state update
            s_op = _round(s, bf)
            v_new = _round(u - w @ s_op, bf)
            qk = _round((q @ k.transpose(-1, -2)) * decay, bf)
            o = _round(q * torch.exp(gc)[..., None], bf) @ s_op + qk @ v_new
            out[:, c0:c1] = o
            g_last = gc[:, -1]
            k_decayed = _round(k * torch.exp(g_last[:, None] - gc)[..., None], bf)
            s = s * torch.exp(g_last)[:, None, None] + k_decayed.transpose(-1, -2) @ v_new
        initial_state[slots[i]] = s
    return _fresh(out.transpose(0, 1).unsqueeze(0), bf), initial_state


# ------------------------------------------------------------------------------------ causal conv
def _check_bf16_conv(dtype: torch.dtype) -> None:
    _check_reduced(dtype, "causal_conv1d")
    # the kernel's float16 instantiation is its unimplemented scalar path
    _check(dtype == torch.bfloat16, "tinygemm_kernel_nn: scalar path not implemented!")


def _unpack_conv_weight(weight: torch.Tensor, is_vnni: bool) -> torch.Tensor:
    """[dim, width] float32 in natural order; a packed weight holds w[nb*32+n, 2*k2+p] at [nb, k2, n, p]."""
    dim, width = weight.shape
    _check(width == 4, "causal_conv1d_weight_pack: support only width of 4")
    if not is_vnni:
        _check(dim % _BLOCK_N == 0, f"causal_conv1d_weight_pack: invalid dim size {dim}")
        return weight.float()
    return weight.reshape(dim // _BLOCK_N, width // 2, _BLOCK_N, 2).permute(0, 2, 1, 3).reshape(dim, width).float()


def _relayout_conv_states(conv_states: torch.Tensor, dim: int, width: int) -> None:
    """The kernel's in-place re-layout of conv_states to [slots, dim, width-1] with strides ((w-1)*dim, 1, dim)."""
    if conv_states.stride(-2) != 1:
        slots = conv_states.shape[0]
        copy = conv_states.clone()
        conv_states.as_strided_((slots, dim, width - 1), ((width - 1) * dim, 1, dim))
        conv_states.copy_(copy)


def _conv(window: torch.Tensor, w: torch.Tensor, bias, silu: bool, dtype) -> torch.Tensor:
    """window [dim, n + 3] float32 -> [dim, n] causal depthwise conv output in dtype."""
    n = window.shape[1] - (w.shape[1] - 1)
    acc = sum(window[:, j:j + n] * w[:, j:j + 1] for j in range(w.shape[1]))
    if bias is not None:
        acc = acc + bias.float()[:, None]
    if silu:
        acc = acc * torch.sigmoid(acc)
    return acc.to(dtype)


def causal_conv1d_fwd_cpu(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                          silu_activation, pad_slot_id, is_vnni):
    """Depthwise causal conv (width 4) over x [dim, T] (varlen, query_start_loc) or [B, dim, L]."""
    _check(weight.is_contiguous(), "weight must be contiguous")
    varlen = query_start_loc is not None
    ndim = 2 if varlen else 3
    _check(x.dim() == ndim, f"causal_conv1d_fwd_cpu: expect x to be {ndim}D tensor.")
    _check(x.stride(-2) == 1 and x.stride(-1) == x.shape[-2],
           f"causal_conv1d_fwd_cpu: expect x to be transposed. (x {tuple(x.shape)}, strides {x.stride()})")
    batch = query_start_loc.shape[0] - 1 if varlen else x.shape[0]
    dim, seqlen, width = x.shape[-2], x.shape[-1], weight.shape[-1]
    st = x.dtype
    _check(weight.dtype == st, "weight dtype differs from x")
    for t, size, dtype in ((bias, dim, st), (query_start_loc, batch + 1, torch.int32),
                           (cache_indices, batch, torch.int32), (has_initial_state, batch, torch.bool)):
        if t is not None:
            _check(t.is_contiguous() and t.shape[0] == size and t.dtype == dtype, "optional input shape/dtype mismatch")
    if conv_states is not None:
        _check(conv_states.dtype == st and conv_states.shape[0] >= batch and conv_states.shape[1] == dim
               and conv_states.shape[2] == width - 1, "conv_states shape/dtype mismatch")
    _check_bf16_conv(st)
    w = _unpack_conv_weight(weight, is_vnni)
    if conv_states is not None:
        _relayout_conv_states(conv_states, dim, width)
    _check(dim % _BLOCK_N == 0, f"Unexpected block size, {width} x {dim % 64 or 64}")
    out = torch.empty_like(x)
    hist = width - 1
    if varlen:
        offs = query_start_loc.tolist()
        for i in range(batch):
            seq = x[:, offs[i]:offs[i + 1]].float()
            # the varlen path never reads the previous window: every sequence starts from zeros
            window = torch.cat([seq.new_zeros(dim, hist), seq], dim=1)
            out[:, offs[i]:offs[i + 1]] = _conv(window, w, bias, silu_activation, st)
            if conv_states is not None:
                slot = cache_indices[i].item() if cache_indices is not None else i
                conv_states[slot] = window[:, -hist:].to(st)
        return out
    _check(conv_states is None or has_initial_state is not None,
           "causal_conv1d_fwd_cpu: the fixed-length path reads has_initial_state when conv_states is given")
    new_states = []
    for i in range(batch):
        seq = x[i].float()
        has_init = conv_states is not None and bool(has_initial_state[i])
        slot = cache_indices[i].item() if cache_indices is not None else i
        prev = conv_states[slot].float() if has_init else seq.new_zeros(dim, hist)
        out[i] = _conv(torch.cat([prev, seq], dim=1), w, bias, silu_activation, st)
        if conv_states is not None:
            # the kernel shifts and writes the window of batch row i in slot i, whatever cache_indices says
            own = conv_states[i].float() if has_init else seq.new_zeros(dim, hist)
            new_states.append(torch.cat([own, seq], dim=1)[:, -hist:].to(st))
    for i, state in enumerate(new_states):
        conv_states[i] = state
    return out


def causal_conv1d_update_cpu(x, conv_states, weight, bias, silu_activation, cache_seqlens, conv_state_indices,
                             pad_slot_id, is_vnni):
    """One decode step: x [B, dim] after the window in conv_states[slot] ([dim, 3]), which then shifts by one."""
    _check(x.is_contiguous(), "x must be contiguous")
    _check(weight.is_contiguous(), "weight must be contiguous")
    w = _unpack_conv_weight(weight, is_vnni)
    _check(x.dim() == 2, "causal_conv1d_update_cpu: expect x to be 2D tensor.")
    _check(cache_seqlens is None, "causal_conv1d_update_cpu: don't support cache_seqlens.")
    batch, dim = x.shape
    width = weight.shape[-1]
    st = x.dtype
    _check(weight.dtype == st, "weight dtype differs from x")
    if bias is not None:
        _check(bias.is_contiguous() and bias.shape[0] == dim and bias.dtype == st, "bias shape/dtype mismatch")
    if conv_state_indices is not None:
        _check(conv_state_indices.is_contiguous() and conv_state_indices.shape[0] == batch
               and conv_state_indices.dtype == torch.int32, "conv_state_indices shape/dtype mismatch")
    _check(conv_states.dtype == st and conv_states.shape[1] == dim and conv_states.shape[2] == width - 1,
           "conv_states shape/dtype mismatch")
    _check_bf16_conv(st)
    _relayout_conv_states(conv_states, dim, width)
    _check(dim % _BLOCK_N == 0, f"Unexpected block size, {width} x {dim % 64 or 64}")
    slots = conv_state_indices.long() if conv_state_indices is not None else torch.arange(batch)
    window = torch.cat([conv_states[slots].float(), x.float()[:, :, None]], dim=2)  # [B, dim, width]
    acc = (window * w).sum(-1)
    if bias is not None:
        acc = acc + bias.float()
    if silu_activation:
        acc = acc * torch.sigmoid(acc)
    conv_states[slots] = window[:, :, 1:].to(st)
    return _like(x, acc)
