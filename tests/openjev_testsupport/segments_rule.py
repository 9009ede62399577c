"""fla's variable-length chunked rule (`cu_seqlens`, one initial state a segment) over Transformers'
PyTorch rule one segment at a time, for CPU tests of openjev/engine/packed.py."""

from __future__ import annotations


def segments_rule(rule, seen: list | None = None):
    """`rule` (Transformers' torch_chunk_gated_delta_rule) behind fla's call signature with
    `cu_seqlens`; `seen` gets each call's segment count."""

    def call(q, k, v, g, beta, *args, initial_state=None, output_final_state=False, cu_seqlens=None,
             cu_seqlens_cpu=None, **kwargs):
        import torch

        if cu_seqlens is None:
            return rule(q, k, v, g, beta, *args, initial_state=initial_state, output_final_state=output_final_state,
                        **kwargs)
        cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
        assert q.shape[0] == 1 and cu[-1] == q.shape[1]
        if seen is not None:
            seen.append(len(cu) - 1)
        outs, finals = [], []
        for s in range(len(cu) - 1):
            part = (x[:, cu[s]:cu[s + 1]] for x in (q, k, v, g, beta))
            h0 = initial_state[s:s + 1] if initial_state is not None else None
            o, h = rule(*part, *args, initial_state=h0, output_final_state=True, **kwargs)
            outs.append(o)
            finals.append(h)
        return torch.cat(outs, 1), (torch.cat(finals) if output_final_state else None)

    return call
