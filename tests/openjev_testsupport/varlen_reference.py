"""FlashAttention's variable-length call (openjev.engine.attention.varlen_flash) one row at a time in
PyTorch, for CPU tests: SDPA with the causal mask aligned to the bottom right of each row
(varlen_reference), or each row's own whole call (varlen_by_own_calls)."""

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


def varlen_by_own_calls(inner, module):
    """A stand-in for the varlen kernel that makes each sequence's own whole call with `inner`
    (Transformers' SDPA function): its queries at the end of its keys, zeros before them, as
    openjev.engine.attention.PackedCalls makes a row's own call; the own calls' bits by construction."""
    import torch

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        outs = []
        for i in range(len(cu_q) - 1):
            n, k0, k1 = int(cu_q[i + 1] - cu_q[i]), int(cu_k[i]), int(cu_k[i + 1])
            if not n:
                continue
            qs = q.new_zeros((k1 - k0, q.shape[1], q.shape[2]))
            qs[k1 - k0 - n:] = q[int(cu_q[i]):int(cu_q[i + 1])]
            res = inner(module, qs.transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None], v[k0:k1].transpose(0, 1)[None],
                        None, scaling=scale)[0]
            outs.append(res[0, k1 - k0 - n:])
        return torch.cat(outs)
    return varlen
