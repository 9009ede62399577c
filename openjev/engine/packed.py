"""The prefix path's forwards in a packed layout (OPENJEV_PACKED_LAYOUT: auto, the default, packs where
fla's variable-length rule runs, a GPU; on also elsewhere; off never).

A padded forward (openjev/engine/prefix.py ContinuationForwards) runs every module on every
position of a [rows, width] batch, padding included (the MLPs excepted, openjev/engine/packing.py).
A packed forward puts the rows' tokens one after another in one [1, tokens] sequence and runs each
decoder layer on them as Transformers does, but for the two token mixers, which keep the rows
apart: each Gated DeltaNet layer's convolution runs segment by segment from each row's start state
(fused.conv_silu_segments) and its chunked rule is fla's variable-length call (`cu_seqlens`, one
initial state a row; a row that keeps a state after fewer tokens than it runs is two segments, the
second run again from the first's final state, as the padded path's _after_kept_state does); each
full-attention layer gives every row its own call (attention.PackedCalls), its prefix keys from
its start state. The classification head runs on every token and each row is pooled where
Transformers pools it (its rightmost token that is not the pad id).

Nothing reads another row's tokens, and each kernel runs the arithmetic of the padded forward's
row: the matrix products are row-independent (cuBLAS without a workspace), the conv the same taps,
the rule the same chunks from the same states. Whether fla's variable-length call gives each
segment the bits of its own call is checked on the device at load (`check_packed_rule`); the
layout is used only where it does. With Transformers' PyTorch rule (a CPU) the rule runs a call a
segment, which is each row's own call (slower there than one padded call: only with `on`)."""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field

from openjev.common import UserError
from openjev.engine.attention import PackedCalls, packed_forward
from openjev.engine.bitwise import Bitwise
from openjev.engine.transfer import to_device

log = logging.getLogger("openjev.packed")

PACKED_LAYOUT_ENV = "OPENJEV_PACKED_LAYOUT"
PACKED_LAYOUT_MODES = ("auto", "off", "on")
GDN_CHUNK = 64
# (length, start state?, kept tokens or None) of the check's segments: from scratch and from a state,
# whole and keeping a state a chunk boundary before their end
CHECK_SEGMENTS = ((37, False, None), (200, True, 192), (129, False, 128), (64, True, None), (300, True, 256))


def packed_layout_mode(mode: str | None = None) -> str:
    mode = mode or os.environ.get(PACKED_LAYOUT_ENV) or "auto"
    if mode not in PACKED_LAYOUT_MODES:
        raise UserError(f"{PACKED_LAYOUT_ENV}={mode!r}: expected one of {', '.join(PACKED_LAYOUT_MODES)}")
    return mode


def text_model(model):
    """The decoder stack of a sequence classifier (Qwen3.5's text model inside its multimodal one)."""
    base = getattr(model, model.base_model_prefix)
    return getattr(base, "language_model", base)


def pool_positions(rows: list, pad_token_id) -> list[int]:
    """Where Transformers pools each row of a forward: its rightmost token that is not the pad id
    (position 0 where all are), the last one without a pad id."""
    out = []
    for tokens in rows:
        last = len(tokens) - 1
        if pad_token_id is not None:
            last = next((i for i in range(len(tokens) - 1, -1, -1) if tokens[i] != pad_token_id), 0)
        out.append(last)
    return out


@dataclass
class RuleSegments:
    """The chunked rule's segments of a packed forward: each row, or where it keeps a state after
    `keep` < its tokens, its first `keep` tokens and then the rest (run again from the kept state in
    a call of their own); on the device."""

    cu: object              # [segments + 1] int64 on the device
    cu_cpu: object          # ... on the host (fla reads chunk counts from it without a sync)
    init: list              # per segment: the row whose start state it begins from, None for zeros
    kept: object            # [kept rows] the segment whose final state a row keeps
    tails: tuple | None     # (gather index, cu, cu on the host, the heads' segments) of the second call


@dataclass
class PackedForward:
    """One packed forward: the rows' tokens, prefix lengths, whole-row attention calls and kept
    counts, their start states, and what the layers keep for the states after them."""

    lengths: list
    starts: list
    calls: list
    keep: list | None            # per row: tokens the kept state covers, None for no state
    linear: list                 # layer index of each GDN layer
    attention_layers: list       # ... of each full-attention layer
    conv_start: object = None    # [GDN layers, rows + 1, conv_dim, kernel] (the last row zeros), or None
    rec_start: object = None     # [GDN layers, rule segments, heads, k, v] (zeros where none), or None
    keys: tuple = ()             # ([attention layers, kv, keys, dim] keys, values)
    attention: PackedCalls = None
    conv_states: list = field(default_factory=list)   # per GDN layer: [kept rows, conv_dim, kernel]
    rec_states: list = field(default_factory=list)    # per GDN layer: [kept rows, heads, k, v]
    plans: dict = field(default_factory=dict)
    varlen_rule: bool = False       # the GDN rule takes segments (fla's variable-length call): decided once a forward
    varlen_attention: bool = False  # unsplit rows share a varlen attention call (packed_attention_record)

    def __post_init__(self):
        self.attention = PackedCalls(self.lengths, self.starts, self.calls, varlen=self.varlen_attention)
        self.gdn_order = {li: k for k, li in enumerate(self.linear)}
        self.attention_order = {li: k for k, li in enumerate(self.attention_layers)}
        self.bos = [0, *itertools.accumulate(self.lengths)][:-1]

    @property
    def kept_rows(self) -> list[int]:
        return [b for b, k in enumerate(self.keep or ()) if k is not None]

    def key_buffers(self, layer_idx: int):
        k = self.attention_order[layer_idx]
        return self.keys[0][k], self.keys[1][k]

    def has_state(self, b: int) -> bool:
        return self.starts[b] > 0

    def segment_rows(self) -> tuple:
        """(tokens of each rule segment, the row whose start state it begins from or None, the segments
        whose final states rows keep, (segment, first packed token, tokens) of each kept state's rest)."""
        sizes, init, kept, tails = [], [], [], []
        for b, n in enumerate(self.lengths):
            k = self.keep[b] if self.keep else None
            start = b if self.has_state(b) else None
            if k is not None and k < n:
                kept.append(len(sizes))
                tails.append((len(sizes), self.bos[b] + k, n - k))
                sizes += [k, n - k]
                init += [start, None]
            else:
                if k is not None:
                    kept.append(len(sizes))
                sizes.append(n)
                init.append(start)
        return sizes, init, kept, tails

    def segments(self, device) -> RuleSegments:
        """The rule's segments (built once a forward)."""
        if "rule" in self.plans:
            return self.plans["rule"]
        import torch

        sizes, init, kept, tails = self.segment_rows()

        def cu(parts):
            cpu = torch.tensor([0] + parts, dtype=torch.long).cumsum(0)
            return to_device(cpu, device), cpu

        cu_dev, cu_cpu = cu(sizes)
        tail = None
        if tails:
            index = torch.cat([torch.arange(a, a + n) for _, a, n in tails])
            t_dev, t_cpu = cu([n for _, _, n in tails])
            tail = (to_device(index, device), t_dev, t_cpu, to_device(torch.tensor([s for s, _, _ in tails]), device))
        plan = RuleSegments(cu_dev, cu_cpu, init, to_device(torch.tensor(kept), device), tail)
        self.plans["rule"] = plan
        return plan

    def conv_tiles(self, device):
        if "conv" not in self.plans:
            from openjev.engine.fused import conv_segment_tiles

            self.plans["conv"] = conv_segment_tiles(
                self.lengths, [b if self.has_state(b) else None for b in range(len(self.lengths))], device)
        return self.plans["conv"]

    def conv_capture_index(self, kernel: int, device):
        """Packed positions of each kept row's last `kernel` conv inputs before its kept state, and
        where a position falls before the row's first token, the start state's column instead."""
        if "conv_capture" not in self.plans:
            import torch

            rows = self.kept_rows
            pos = torch.tensor([[self.keep[b] - kernel + j for j in range(kernel)] for b in rows])
            bos = torch.tensor([self.bos[b] for b in rows])[:, None]
            before = pos < 0
            state = None
            if bool(before.any()):
                state = (to_device(before, device), to_device(torch.tensor(rows), device),
                         to_device((pos + kernel).clamp(min=0), device))
            self.plans["conv_capture"] = (to_device((bos + pos.clamp(min=0)).reshape(-1), device), state)
        return self.plans["conv_capture"]


def gdn_forward(m, x, forward: PackedForward, modeling, grouped: bool, segment_conv):
    """Transformers' Qwen3.5 GatedDeltaNet forward on a packed [1, tokens, hidden] input, each row on
    its own: the conv from each row's start state (segment_conv: fused.conv_segments_qkv, where it
    runs; else a call a row), the chunked rule
    by segments (run_rule); the kept rows' conv inputs and final states go to `forward`.
    `grouped`: the key heads handed to the rule once (fla's layout, the grouped_heads piece)."""
    import torch
    import torch.nn.functional as F

    tokens = x.shape[1]
    k_ord = forward.gdn_order[m.layer_idx]
    mixed = m.in_proj_qkv(x)[0]  # [tokens, conv_dim]
    z = m.in_proj_z(x).reshape(1, tokens, -1, m.head_v_dim)
    b = m.in_proj_b(x)
    a = m.in_proj_a(x)
    weight = m.conv1d.weight.squeeze(1)
    start = forward.conv_start[k_ord] if forward.conv_start is not None else None
    if forward.keep is not None and forward.kept_rows:
        forward.conv_states.append(_conv_inputs_kept(forward, mixed, start, weight.shape[-1]))
    split = segment_conv(mixed, m, forward.conv_tiles(x.device), start) if segment_conv is not None else None
    query, key, value = split if split is not None else _conv_by_rows(m, modeling, forward, mixed, start, weight)
    query = query.reshape(1, tokens, -1, m.head_k_dim)
    key = key.reshape(1, tokens, -1, m.head_k_dim)
    value = value.reshape(1, tokens, -1, m.head_v_dim)
    if not grouped and m.num_v_heads // m.num_k_heads > 1:
        query = query.repeat_interleave(m.num_v_heads // m.num_k_heads, dim=2)
        key = key.repeat_interleave(m.num_v_heads // m.num_k_heads, dim=2)
    beta = b.sigmoid()
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
    rec = forward.rec_start[k_ord] if forward.rec_start is not None else None
    out = run_rule(modeling.torch_chunk_gated_delta_rule, (query, key, value, g, beta), rec, forward, x.device)
    out = m.norm(out.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
    return m.out_proj(out.reshape(1, tokens, -1))


def _conv_inputs_kept(forward: PackedForward, mixed, start, kernel: int):
    """[kept rows, conv_dim, kernel]: each kept row's last conv inputs before its kept state."""
    import torch

    index, state = forward.conv_capture_index(kernel, mixed.device)
    got = mixed.index_select(0, index).view(-1, kernel, mixed.shape[1]).transpose(1, 2)
    if state is not None:
        before, rows, cols = state
        from_state = start[rows].gather(2, cols[:, None, :].expand(-1, mixed.shape[1], -1))
        got = torch.where(before[:, None, :], from_state, got)
    return got.contiguous()


def _conv_by_rows(m, modeling, forward: PackedForward, mixed, start, weight):
    """The modeling module's conv a row at a time (where the segments kernel does not run), each row
    after its start state as a forward from a cache concatenates it."""
    import torch

    parts = []
    for b, (n, bos) in enumerate(zip(forward.lengths, forward.bos)):
        x = mixed[bos:bos + n].T[None]  # [1, conv_dim, n]
        if forward.has_state(b):
            x = torch.cat([start[b][None], x], dim=-1)
        y = modeling.causal_conv1d_fn(x, weight, m.conv1d.bias, activation=m.activation)
        parts.append(y[0, :, -n:].T)
    y = torch.cat(parts)
    return torch.split(y, [m.key_dim, m.key_dim, m.value_dim], dim=-1)


def rule_takes_segments(rule) -> bool:
    """Whether the chunked rule the GDN layers call is fla's (which takes `cu_seqlens`)."""
    from openjev.engine.binding import bound_implementation, describe

    return (describe(bound_implementation(rule) or rule) or "").startswith("fla.")


def run_rule(rule, inputs, rec, forward: PackedForward, device):
    """The chunked rule on the packed rows: fla's variable-length call over the forward's segments
    and, for kept states short of a row's end, a second call of the rest from them; elsewhere a call a
    segment. Keeps the kept rows' final states in `forward`; returns the output [1, tokens, heads, v]."""
    import torch

    seg = forward.segments(device)
    want = bool(forward.kept_rows)
    has_states = any(forward.starts)
    if forward.varlen_rule:
        out, final = rule(*inputs, initial_state=rec if has_states else None, output_final_state=want or seg.tails is not None,
                          use_qk_l2norm_in_kernel=True, cu_seqlens=seg.cu, cu_seqlens_cpu=seg.cu_cpu)
        if seg.tails is not None:
            index, cu, cu_cpu, heads = seg.tails
            rest, _ = rule(*(t.index_select(1, index) for t in inputs), initial_state=final.index_select(0, heads),
                           output_final_state=False, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
            out.index_copy_(1, index, rest)
        if want:
            forward.rec_states.append(final.index_select(0, seg.kept))
        return out
    cu = seg.cu_cpu.tolist()
    goes_on = {int(h) + 1 for h in seg.tails[3].tolist()} if seg.tails is not None else set()
    outs, finals = [], []
    prev = None
    for s in range(len(cu) - 1):
        part = tuple(t[:, cu[s]:cu[s + 1]] for t in inputs)
        h0 = rec[s][None] if has_states and seg.init[s] is not None else None
        if s in goes_on:  # a kept state's rest, from it
            h0 = prev
        o, h = rule(*part, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o)
        finals.append(h)
        prev = h
    if want:
        forward.rec_states.append(torch.cat([finals[s] for s in seg.kept.tolist()]))
    return torch.cat(outs, dim=1)


def run_packed(clf, linear: list, attention_layers: list, items: list, keep: list | None, starts_states: list,
               segment_conv, grouped: bool, varlen_attention: bool = False):
    """One packed forward of `items` ((start PrefixState or None, tokens to run, whole row's length)):
    (logits [rows, labels] on the device, the PackedForward with what its layers kept)."""
    import torch

    from openjev.engine.fused import gdn_modeling

    model, dev = clf.model, clf.device
    lengths = [len(t) for _, t, _ in items]
    starts = [s.length if s is not None else 0 for s, _, _ in items]
    modeling = gdn_modeling(model)
    forward = PackedForward(lengths, starts, [c for _, _, c in items], keep, linear, attention_layers,
                            varlen_rule=rule_takes_segments(modeling.torch_chunk_gated_delta_rule),
                            varlen_attention=varlen_attention)
    _start_states(forward, clf, starts_states)
    ids = torch.tensor([t for _, tokens, _ in items for t in tokens], dtype=torch.long)[None]
    pos = torch.cat([torch.arange(p, p + n) for p, n in zip(starts, lengths)])[None]
    pools = torch.tensor([bos + i for bos, i in zip(forward.bos, pool_positions([t for _, t, _ in items],
                                                                                clf.pad_token_id))])
    ids, pos, pools = (to_device(t, dev) for t in (ids, pos, pools))
    text = text_model(model)
    with torch.inference_mode(), packed_forward(forward):
        h = text.embed_tokens(ids)
        position_embeddings = text.rotary_emb(h, pos[None].expand(3, -1, -1))
        for i, layer in enumerate(text.layers[: text.config.num_hidden_layers]):
            if layer.block_type == "linear_attention":
                residual = h
                x = gdn_forward(layer.linear_attn, layer.input_layernorm(h), forward, modeling, grouped, segment_conv)
                h = residual + x
                residual = h
                h = residual + layer.mlp(layer.post_attention_layernorm(h))
            else:
                h = layer(h, position_embeddings=position_embeddings, attention_mask=None, position_ids=pos,
                          past_key_values=None)
        h = text.norm(h)
        logits = model.score(h)[0].index_select(0, pools)
    return logits, forward


def _start_states(forward: PackedForward, clf, states: list) -> None:
    """The rows' start states stacked for the layers (a zero row last), and the key buffers with each
    row's prefix keys in place."""
    import torch

    dev, dtype = clf.device, clf.model.dtype
    known = [s for s in states if s is not None]
    if known:
        zc, zr = torch.zeros_like(known[0].conv), torch.zeros_like(known[0].recurrent)
        forward.conv_start = torch.stack([s.conv if s is not None else zc for s in states] + [zc], 1)
        init = forward.segment_rows()[1]  # in the rule's segment order: fla's initial states as they stand
        forward.rec_start = torch.stack([states[b].recurrent if b is not None else zr for b in init], 1)
    text = clf.model.config.get_text_config()
    kv = text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    shape = (len(forward.attention_layers), kv, sum(forward.attention.key_spans()), head_dim)
    make = torch.zeros if forward.attention.zero_keys() else torch.empty
    keys, values = make(shape, dtype=dtype, device=dev), make(shape, dtype=dtype, device=dev)
    for s, k0 in zip(states, forward.attention.key_starts()):
        if s is not None:
            keys[:, :, k0:k0 + s.length].copy_(s.keys)
            values[:, :, k0:k0 + s.length].copy_(s.values)
    forward.keys = (keys, values)


def kept_states(forward: PackedForward, state_type) -> list:
    """The state after each row's kept tokens (None for rows that keep none)."""
    import torch

    out: list = [None] * len(forward.lengths)
    if not forward.kept_rows:
        return out
    conv = torch.stack(forward.conv_states, 1)   # [kept rows, GDN layers, conv_dim, kernel]
    rec = torch.stack(forward.rec_states, 1)     # [kept rows, GDN layers, heads, k, v]
    ks = forward.attention.key_starts()
    keys, values = forward.keys
    for i, b in enumerate(forward.kept_rows):
        end = ks[b] + forward.starts[b] + forward.keep[b]
        out[b] = state_type(forward.starts[b] + forward.keep[b], conv[i].clone(), rec[i].clone(),
                            keys[:, :, ks[b]:end].clone(), values[:, :, ks[b]:end].clone())
    return out


def check_packed_rule(rule, device, dtype, heads: int, k_heads: int, k_dim: int, v_dim: int) -> tuple[bool, float]:
    """fla's variable-length rule (run_rule) against a call a segment, from the same start states, on
    random inputs in CHECK_SEGMENTS's layout: outputs and kept final states bitwise?"""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(11)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    lengths = [n for n, _, _ in CHECK_SEGMENTS]
    starts = [GDN_CHUNK if has else 0 for _, has, _ in CHECK_SEGMENTS]
    keep = [k for _, _, k in CHECK_SEGMENTS]
    forward = PackedForward(lengths, starts, [p + n for p, n in zip(starts, lengths)], keep, [0], [], varlen_rule=True)
    total = sum(lengths)
    q, k = rnd(1, total, k_heads, k_dim).to(dtype), rnd(1, total, k_heads, k_dim).to(dtype)
    v = rnd(1, total, heads, v_dim).to(dtype)
    g = -torch.rand(1, total, heads, generator=gen).to(device)
    beta = torch.rand(1, total, heads, generator=gen).to(device).to(dtype)
    rows = rnd(len(lengths), heads, k_dim, v_dim, scale=0.1)
    rec = torch.stack([rows[b] if b is not None else torch.zeros_like(rows[0]) for b in forward.segment_rows()[1]])
    compare = Bitwise()
    with torch.inference_mode():
        out = run_rule(rule, (q, k, v, g, beta), rec, forward, device)
        finals = forward.rec_states[0]
        kept = 0
        for b, (n, bos) in enumerate(zip(lengths, forward.bos)):
            part = [t[:, bos:bos + n] for t in (q, k, v, g, beta)]
            h0 = rows[b][None] if starts[b] else None
            cut = keep[b] if keep[b] is not None else n
            want, h = rule(*(t[:, :cut] for t in part), initial_state=h0, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
            compare(want, out[:, bos:bos + cut])
            if cut < n:
                rest, _ = rule(*(t[:, cut:] for t in part), initial_state=h, output_final_state=False,
                               use_qk_l2norm_in_kernel=True)
                compare(rest, out[:, bos + cut:bos + n])
            if keep[b] is not None:
                compare(h[0], finals[kept])
                kept += 1
    return compare.result


def check_segment_conv(conv_segments, conv_rows, device, dtype, channels: int = 96, kernel: int = 4) -> tuple[bool, float]:
    """The segments conv against each row's own conv (conv_rows(x [1, n, C], w, state [1, C, K] or
    None)) on random inputs in CHECK_SEGMENTS's layout: bitwise?"""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(12)
    lengths = [n for n, _, _ in CHECK_SEGMENTS]
    has = [h for _, h, _ in CHECK_SEGMENTS]
    x = torch.randn(sum(lengths), channels, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(channels, kernel, generator=gen) * 0.5).to(device=device, dtype=dtype)
    states = torch.randn(len(lengths) + 1, channels, kernel, generator=gen).to(device=device, dtype=dtype)
    forward = PackedForward(lengths, [GDN_CHUNK if h else 0 for h in has], lengths, None, [0], [])
    compare = Bitwise()
    with torch.inference_mode():
        got = conv_segments(x, w, forward.conv_tiles(device), states)
        for b, (n, bos) in enumerate(zip(lengths, forward.bos)):
            compare(conv_rows(x[None, bos:bos + n], w, states[b:b + 1] if has[b] else None)[0], got[bos:bos + n])
    return compare.result


def packed_layout_record(clf, modeling, grouped: bool, conv_segments) -> dict:
    """Whether the prefix path's forwards run packed (OPENJEV_PACKED_LAYOUT=on and every check here
    passes), and why; kept in the prefix path's stats."""
    import torch

    from openjev.engine.attention import rowwise_in_force
    from openjev.engine.kernels import PREFIX_ATTENTION_ENV, prefix_attention_mode

    mode = packed_layout_mode()
    record: dict = {"requested": mode, "used": False}
    if mode == "off":
        record["reason"] = f"{PACKED_LAYOUT_ENV}=off: forwards from prefix states are padded"
        return record
    if not rowwise_in_force(clf.model):
        record["reason"] = "attention does not run row by row (OPENJEV_PADDED_ATTENTION=masked): padded forwards"
        return record
    if prefix_attention_mode() not in ("whole-row", "varlen-exact"):
        record["reason"] = f"{PREFIX_ATTENTION_ENV}={prefix_attention_mode()} packs its own calls: padded forwards"
        return record
    rule = modeling.torch_chunk_gated_delta_rule
    if mode == "auto" and not rule_takes_segments(rule):
        record["reason"] = (f"{PACKED_LAYOUT_ENV}=auto: the GDN rule takes no segments here (Transformers' PyTorch "
                            "rule would run a call a row): padded forwards")
        return record
    m = next(x for x in clf.model.modules() if type(x).__name__.endswith("GatedDeltaNet"))
    dtype = next(clf.model.parameters()).dtype

    def conv_rows(x, w, state):
        from openjev.engine.fused import conv_silu_blc

        return conv_silu_blc(x, w, state=state if state is not None else torch.zeros_like(w)[None])

    # (record key, kind, what must hold, its check or None where nothing needs checking)
    checks = (
        ("rule", "fla varlen", "fla's variable-length rule is not bitwise a call a segment",
         (lambda: check_packed_rule(rule, clf.device, dtype, m.num_v_heads, m.num_k_heads if grouped else m.num_v_heads,
                                    m.head_k_dim, m.head_v_dim)) if rule_takes_segments(rule) else None,
         "a call a segment (the rule takes no segments)"),
        ("conv", "fused segments kernel", "the segments conv is not bitwise each row's conv",
         (lambda: check_segment_conv(conv_segments, conv_rows, clf.device, dtype)) if conv_segments is not None else None,
         "the modeling module's conv, a call a row"),
    )
    for key, kind, failed, check, otherwise in checks:
        if check is None:
            record[key] = {"kind": otherwise}
            continue
        try:
            same, worst = check()
        except Exception as exc:  # noqa: BLE001 - a kernel that does not run here: padded forwards
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return _refused(record, f"the {kind} check failed on {clf.device} ({first}): padded forwards")
        record[key] = {"kind": kind, "bitwise": same}
        if not same:
            return _refused(record, f"{failed} on {clf.device} (max abs diff {worst:.3g}): padded forwards")
    record["attention"] = packed_attention_record(clf)
    record.update(used=True, reason="forwards from prefix states run the rows' tokens one after another, "
                                    "each token mixer row by row (checked bitwise on this device where it applies)")
    return record


def packed_attention_record(clf) -> dict:
    """How a packed forward's attention layers call FlashAttention: each row its own whole-row call
    or, with OPENJEV_PREFIX_ATTENTION=varlen-exact where the check finds it their bits, the rows whose
    own calls do not split in one varlen call a layer (attention.PackedCalls)."""
    from openjev.engine.attention import check_packed_varlen
    from openjev.engine.kernels import PREFIX_ATTENTION_ENV, prefix_attention_mode

    own = "each row's own call"
    if prefix_attention_mode() != "varlen-exact":
        return {"kind": own, "varlen": False}
    if check_packed_varlen(clf.model.config.get_text_config(), clf.device, clf.model.dtype):
        return {"kind": "one varlen call a layer for the rows whose own calls do not split", "varlen": True,
                "bitwise_on_check": True}
    reason = (f"{PREFIX_ATTENTION_ENV}=varlen-exact: a packed forward's varlen call is not the rows' own calls' "
              f"bits on {clf.device}: each row's own call")
    log.warning("%s", reason)
    return {"kind": own, "varlen": False, "bitwise_on_check": False, "reason": reason}


def _refused(record: dict, reason: str) -> dict:
    record["reason"] = reason
    log.warning("packed layout not used: %s", reason)
    return record
