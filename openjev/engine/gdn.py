"""The Gated DeltaNet layer's forward with its key heads handed to fla once (fused piece
`grouped_heads`, openjev/engine/fused.py).

Qwen3.5's GDN layers have half as many query/key heads as value heads. Transformers' forward
repeats each query and key head (`repeat_interleave`) before the chunked rule, a copy of both on
every token of every GDN layer, and the rule then normalises every copy. fla's
`chunk_gated_delta_rule` takes the grouped layout itself (value head i reads key head
i // (HV / H)), the head `repeat_interleave` puts there. `grouped_heads_forward` is Transformers'
forward of the installed version, step for step, without that repeat; `check_grouped_heads` runs
both forwards on this device, and the rule alone from a start state, and the piece is used only
where every output is bitwise equal. With Transformers' PyTorch fallback (which needs the repeated
heads) the piece is not used."""

from __future__ import annotations

import sys


def grouped_heads_forward(m, hidden_states, cache_params=None, attention_mask=None, *, conv_qkv=None, **kwargs):
    """Transformers' Qwen3.5 GatedDeltaNet.forward without the query/key head repeat. `conv_qkv`
    (openjev/engine/fused.py conv_silu_qkv) may give the conv's query, key and value as tensors of
    their own, or None for the modeling module's conv. A one-token step from a cached state
    (decoding, never a classifier's call) keeps Transformers' forward."""
    import torch
    import torch.nn.functional as F

    modeling = sys.modules[type(m).__module__]
    batch, seq_len, _ = hidden_states.shape
    cached = cache_params is not None and cache_params.has_previous_state(m.layer_idx, state_idx=0)
    if cached and seq_len == 1:
        return type(m).forward(m, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
    mixed_qkv = m.in_proj_qkv(hidden_states).transpose(1, 2)
    z = m.in_proj_z(hidden_states).reshape(batch, seq_len, -1, m.head_v_dim)
    b = m.in_proj_b(hidden_states)
    a = m.in_proj_a(hidden_states)
    if cache_params is not None:
        mixed_qkv = cache_params.update_conv_state(mixed_qkv, m.layer_idx, conv_kernel_size=m.conv_kernel_size)
    weight = m.conv1d.weight.squeeze(1)
    split = None
    if conv_qkv is not None:  # it reads no kwargs, as the modeling module's fused conv (make_conv_wrapper)
        split = conv_qkv(mixed_qkv, weight, m.conv1d.bias, m.activation, m.key_dim)
    if split is not None:  # the fused conv writes them apart: fla's rule copies none of them
        query, key, value = split
    else:
        mixed_qkv = modeling.causal_conv1d_fn(mixed_qkv, weight, m.conv1d.bias, activation=m.activation, **kwargs)
        if cache_params is not None:
            mixed_qkv = mixed_qkv[:, :, -seq_len:]
        query, key, value = torch.split(mixed_qkv.transpose(1, 2), [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    query = query.reshape(batch, seq_len, -1, m.head_k_dim)
    key = key.reshape(batch, seq_len, -1, m.head_k_dim)
    value = value.reshape(batch, seq_len, -1, m.head_v_dim)
    beta = b.sigmoid()
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
    state = cache_params.layers[m.layer_idx].recurrent_states[0] if cached else None
    out, last_state = modeling.torch_chunk_gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=state, output_final_state=cache_params is not None,
        use_qk_l2norm_in_kernel=True, cu_seqlens=kwargs.pop("cu_seq_lens_q", None), **kwargs)
    if cache_params is not None:
        cache_params.update_recurrent_state(last_state, m.layer_idx)
    out = m.norm(out.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
    return m.out_proj(out.reshape(batch, seq_len, -1))


def kernel_takes_grouped_heads(modeling) -> tuple[bool, str]:
    """Whether the chunked rule the GDN layers call is fla's (which takes the grouped layout)."""
    from openjev.engine.binding import bound_implementation, describe

    name = describe(bound_implementation(getattr(modeling, "torch_chunk_gated_delta_rule", None))) or ""
    if name.startswith("fla."):
        return True, name
    return False, f"the GDN rule is {name or 'unknown'}, not fla's: it needs the repeated key heads"


def check_grouped_heads(m, modeling, rnd, shapes, forward=grouped_heads_forward) -> tuple[bool, float]:
    """Transformers' forward against `forward` (grouped_heads_forward, or fused.py's with its conv) on
    random hidden states of `shapes` ((rows, length) pairs), and the rule alone from a random start
    state with its final state, repeated heads against grouped ones; (bitwise everywhere, the
    largest difference)."""
    import torch

    from openjev.engine.bitwise import Bitwise

    compare = Bitwise()
    for b, t in shapes:
        x = rnd(b, t, m.hidden_size)
        compare(type(m).forward(m, x), forward(m, x))
    heads, k_heads = m.num_v_heads, m.num_k_heads
    rule = modeling.torch_chunk_gated_delta_rule
    for b, t in shapes:
        q, k = rnd(b, t, k_heads, m.head_k_dim), rnd(b, t, k_heads, m.head_k_dim)
        v = rnd(b, t, heads, m.head_v_dim)
        g = -torch.rand(b, t, heads, device=v.device)
        beta = torch.rand(b, t, heads, device=v.device).to(v.dtype)
        h0 = rnd(b, heads, m.head_k_dim, m.head_v_dim).float()
        r = heads // k_heads
        want = rule(q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2), v, g=g, beta=beta,
                    initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        got = rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        for x, y in zip(want, got):
            compare(x, y)
    return compare.result
