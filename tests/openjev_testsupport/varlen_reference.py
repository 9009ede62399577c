"""FlashAttention's variable-length call (openjev.engine.attention.varlen_flash) one row at a time in
PyTorch, for CPU tests: SDPA with the causal mask aligned to the bottom right of each row."""

from __future__ import annotations


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    import torch
    from torch.nn.attention.bias import causal_lower_right

    outs = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = (x[int(c[i]): int(c[i + 1])].transpose(0, 1)[None] for x, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        assert qs.shape[2] <= max_q and ks.shape[2] <= max_k
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=causal_lower_right(qs.shape[2], ks.shape[2]), scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)
