"""Full attention in padded forwards, each row with the arithmetic of its own unpadded call.

A right-padded forward (classifier.padded_logits, prefix.ContinuationForwards) declares its layout
(`padded_layout`); Transformers' "sdpa" attention function, wrapped once (`rowwise_attention`), then
gives every row the output of the call an unpadded forward of that row makes: causal, no mask,
FlashAttention on a GPU, its op called directly where SDPA's dispatcher picks it (`OwnCalls`). A
row that goes on from a prefix state runs the call its whole row's forward makes, with zeros for
the queries the forward does not hold, whose outputs are dropped, and for the keys it has not
reached (`attend_after_prefix`): where a call's query blocks do not fill the GPU, FlashAttention
splits its keys by the call's length, so only the whole row's length gives every query its bits,
and a prefix state is shared only between rows whose calls agree on that (`attention_class`).
With OPENJEV_PREFIX_ATTENTION=varlen (opt-in, GPU only), forwards from prefix states instead attend
in one variable-length FlashAttention call a layer (`PackedRows`): within about one unit in the
last place of each output, not bit for bit; varlen-tails does so only in forwards that keep no
state, so no cached state carries the difference. varlen-exact puts in that call only the rows whose own calls would not split their keys
(a varlen call never splits them, so it gives those rows their own calls' bits, measured on an H100),
where a check at load finds it so on the device; the other rows keep their own calls.

With OPENJEV_PADDED_ATTENTION=shared (opt-in), rows whose call length is not a multiple of 64 (the
kernel's whole-tiles variant rounds differently) share one call, padded with zeros to the longest:
each query block then reads the same key blocks in the same order as in its own call (measured on
the H200 for rows of 130 to 1601 tokens, benchmarks/experiments/attention_batching_check.py). Rows
with no prefix state run as the padded forward holds them (`DirectRows`, no gather); rows that go on
from prefix states are gathered into place (`BatchedRows`). That rows keep their bits is checked once
per device against separate calls (`batched_rows_are_exact`); where it fails, or on a CPU, every row
gets its own call.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import logging
import threading
from dataclasses import dataclass, field

from openjev.engine.transfer import to_device

log = logging.getLogger("openjev.attention")

# FlashAttention's query and key blocks for the model's head size (256) on SM80/SM90; prefix states
# sit on multiples of it (openjev/engine/prefix.py GDN_CHUNK).
FLASH_QUERY_TILE = 64
# Row lengths the device check of shared calls runs (none a multiple of 64): short rows, whose own
# calls FlashAttention may split along the keys, and rows past the longest of the sets.
CHECK_LENGTHS = (37, 130, 300, 700, 1100, 1601)


@dataclass(frozen=True)
class PaddedLayout:
    """The right-padded forward running in this thread: each row's real length, and for rows that go
    on from a prefix state (openjev/engine/prefix.py) the prefix length, where the cached keys end
    (prefixes are left-padded to `offset`) and the length of the row's whole attention call (`calls`,
    at least prefix and tokens: the whole row's length); per_row_states asks for each row's own final
    GDN state, `valid` (optional, [rows, width] bool on the device) marks the tokens the kept state
    covers; `keep` (optional) is each row's count of them where a row keeps the state after fewer
    tokens than it runs (openjev/engine/prefix.py padding_inert_chunk)."""

    lengths: tuple
    starts: tuple | None = None
    offset: int = 0
    per_row_states: bool = False
    valid: object = None
    calls: tuple | None = None
    keep: tuple | None = None
    plans: dict = field(default_factory=dict, compare=False, repr=False)  # per device: the attention plan

    def prefixes(self) -> tuple:
        """Each row's prefix length (0 for every row where no `starts` were given)."""
        return self.starts or (0,) * len(self.lengths)

    def call_lengths(self) -> list[int]:
        """Each row's own attention call: `calls`, else its prefix and tokens."""
        if self.calls:
            return list(self.calls)
        return [p + n for n, p in zip(self.lengths, self.prefixes())]


def attention_class(length: int, heads: int, head_dim: int, sms: int) -> tuple:
    """What torch's FlashAttention (2) computes the first positions of a causal call of `length`
    tokens with, besides their own queries, keys and values: where heads x 64-query blocks do not
    reach 0.8 x 2 x the GPU's `sms` (torch's flash_api.cpp), over how many key blocks the keys split
    (the number of splits follows from it). Two calls of one class give a query the same bits
    (measured on an H100, benchmarks/experiments/attention_batching_check.py). Calls of whole 64- and
    128-token tiles, for which the kernel has another variant, are kept apart too: that cost little
    and was not measured to matter (whole-tile rows matched a varlen call there)."""
    block_n = 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)
    m_blocks = -(-length // FLASH_QUERY_TILE)
    split = heads * m_blocks < 1.6 * sms
    return (length % 64 == 0, length % 128 == 0, -(-length // block_n) if split else 0)


_LAYOUT: contextvars.ContextVar = contextvars.ContextVar("openjev_padded_layout", default=None)


def current_layout() -> PaddedLayout | None:
    return _LAYOUT.get()


@contextlib.contextmanager
def padded_layout(lengths, starts=None, offset: int = 0, per_row_states: bool = False, valid=None, calls=None,
                  keep=None):
    """Declare the right-padded forward about to run in this thread (see PaddedLayout)."""
    token = _LAYOUT.set(PaddedLayout(tuple(int(n) for n in lengths), tuple(int(p) for p in starts) if starts else None,
                                     int(offset), per_row_states, valid,
                                     tuple(int(c) for c in calls) if calls else None,
                                     tuple(int(k) for k in keep) if keep else None))
    try:
        yield
    finally:
        _LAYOUT.reset(token)


_PACKED: contextvars.ContextVar = contextvars.ContextVar("openjev_packed_forward", default=None)


@contextlib.contextmanager
def packed_forward(forward):
    """Declare the packed forward about to run in this thread (see PackedCalls)."""
    token = _PACKED.set(forward)
    try:
        yield forward
    finally:
        _PACKED.reset(token)


def padded_rows(lengths: list[int]):
    """The real lengths of a right-padded forward, for rowwise_attention, in this thread."""
    return padded_layout(lengths)


def rowwise_attention() -> str:
    """Make padded forwards attend row by row (once per process; returns the mode in force):
    Transformers' "sdpa" attention function is wrapped, through its AttentionInterface, by one that
    changes nothing unless a padded layout is declared in this thread. The masked padded call runs a
    different kernel (memory-efficient, with a mask) whose rounding differs: on the H200 the first
    difference between a padded and an exact forward was the first full-attention layer
    (results_h200/embedded_gpu/call8-blas). Padding positions get zeros; with right padding no real
    token reads them. OPENJEV_PADDED_ATTENTION=masked keeps Transformers' masked call."""
    from openjev.engine.kernels import padded_attention_mode

    mode = padded_attention_mode()
    if mode == "masked":
        return mode
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(inner, "_openjev_rowwise", False):
        return mode
    _INNER.append(inner)

    def sdpa_rowwise(module, query, key, value, attention_mask, **kwargs):
        packed = _PACKED.get()
        if packed is not None and query.shape[0] == 1:
            return packed.attention.attend(inner, module, query, key, value, packed, **kwargs), None
        layout = _LAYOUT.get()
        off = layout.offset if layout is not None else 0
        if layout is None or query.shape[0] != len(layout.lengths) or key.shape[2] != off + query.shape[2]:
            return inner(module, query, key, value, attention_mask, **kwargs)
        out = query.new_zeros((query.shape[0], query.shape[2], query.shape[1], value.shape[-1]))
        plan = _plan(layout, query, key.shape[1], inner)
        if plan.packed is not None:
            plan.packed.attend(query, key, value, out, kwargs.get("scaling"))
            if not plan.alone:
                return out, None
        if plan.batch is not None:  # first: a direct call writes every row, the rows alone then their own
            plan.batch.attend(inner, module, query, key, value, out, **kwargs)
        if plan.alone:
            plan.own.attend(inner, module, query, key, value, out, **kwargs)
        return out, None

    sdpa_rowwise._openjev_rowwise = True
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_rowwise
    return mode


def rowwise_in_force(model) -> bool:
    """Whether `model`'s attention layers call the row-by-row function (rowwise_attention installed
    and the model on Transformers' "sdpa" implementation)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return (getattr(model.config, "_attn_implementation", None) == "sdpa"
            and getattr(ALL_ATTENTION_FUNCTIONS.get("sdpa"), "_openjev_rowwise", False))


def attend_after_prefix(inner, module, query, key, value, prefix: int, call: int | None = None, **kwargs):
    """One row's queries after `prefix` tokens over the prefix's keys and its own, in [1, n, heads, dim]
    as Transformers' SDPA function returns it: the call an unpadded forward of the whole row makes
    (`inner`, causal, FlashAttention on a GPU), `call` tokens long (default: prefix and queries),
    with zeros for the prefix's queries and for the positions after the queries, whose outputs are
    dropped and whose keys no real query sees. Prefixes end on 64-token boundaries, FlashAttention's
    query tiles, so with the whole row's length each real query is computed as in the whole row's
    forward: the same bits, at the cost of the other positions' attention."""
    import torch

    total = prefix + query.shape[2]
    length = max(call or total, total)
    queries = query.new_zeros(query.shape[:2] + (length, query.shape[3]))
    queries[:, :, prefix:total] = query
    if length > total:
        grow = key.shape[:2] + (length - total, key.shape[3])
        key = torch.cat([key, key.new_zeros(grow)], dim=2)
        value = torch.cat([value, value.new_zeros(grow)], dim=2)
    return inner(module, queries, key, value, None, **kwargs)[0][:, prefix:total]


@dataclass
class RowPlan:
    alone: list          # rows that get their own call
    batch: "BatchedRows | DirectRows | None"
    packed: "PackedRows | None" = None  # every row in one variable-length call (OPENJEV_PREFIX_ATTENTION=varlen)
    own: "OwnCalls | None" = None       # how the rows in `alone` make their calls

    def __post_init__(self):
        if self.own is None:
            self.own = OwnCalls(list(self.alone))


@dataclass
class OwnCalls:
    """Each row's own call (RowPlan.alone) with few host operations a row, where a forward makes up to
    a thousand of them. Keys and values are views of the cache. The queries of the rows that go on
    from a prefix are placed after their prefixes in one zeroed buffer a forward (one gather a layer;
    each row's call a view of it), and every row's outputs go back in one copy a layer. On a GPU
    where SDPA's dispatcher picks FlashAttention for the call, its op is called directly, without the
    dispatcher's and Transformers' work a call. The same kernel on the same call as the row's
    unpadded forward: the same bits. A row whose call is longer than its prefix and tokens (an unseen
    zero token, see attend_after_prefix) makes its call that way."""

    rows: list
    flash: bool | None = None   # decided at the first call of the forward
    plan: tuple | None = None   # built at the forward's first attention layer (_build)
    buffer: object = None       # [heads, tokens, dim]: each prefix row's call's queries, one after another

    def _build(self, layout, width: int, device):
        """(rows of direct calls: row, tokens, prefix, buffer start; rows of longer calls: row, tokens,
        prefix, call; buffer tokens; query gather and scatter index; output index), the indices on the
        device."""
        import torch

        starts, calls = layout.prefixes(), layout.call_lengths()
        direct, longer, total = [], [], 0
        q_src, q_dst, o_idx = [], [], []
        for j in self.rows:
            n, p, c = layout.lengths[j], starts[j], calls[j]
            if c > p + n:
                longer.append((j, n, p, c))
                continue
            direct.append((j, n, p, total))
            o_idx.append(torch.arange(j * width, j * width + n))
            if p:
                q_src.append(torch.arange(j * width, j * width + n))
                q_dst.append(torch.arange(total + p, total + p + n))
                total += c

        def index(parts):
            return to_device(torch.cat(parts), device) if parts else None

        return direct, longer, total, index(q_src), index(q_dst), index(o_idx)

    def attend(self, inner, module, query, key, value, out, **kwargs) -> None:
        """query [rows, heads, width, dim], key/value [rows, kv heads, offset + width, dim] as
        Transformers' SDPA function gets them; out [rows, width, heads, dim] gets each row's queries."""
        import torch

        layout = _LAYOUT.get()
        rows, heads, width, dim = query.shape
        if self.plan is None:
            self.plan = self._build(layout, width, query.device)
        direct, longer, total, q_src, q_dst, o_idx = self.plan
        off = layout.offset
        if total:  # token-major, as the layer's queries are laid out: whole rows of heads copied
            if self.buffer is None:
                self.buffer = query.new_zeros((total, heads, dim))
            self.buffer[q_dst] = query.transpose(1, 2).reshape(rows * width, heads, dim)[q_src]
        scale = kwargs.get("scaling")

        def call(j, n, p, at):  # -> [n, heads, dim], as the kernels lay it out
            q = self.buffer[at:at + p + n].transpose(0, 1)[None] if p else query[j:j + 1, :, :n]
            k, v = key[j:j + 1, :, off - p: off + n], value[j:j + 1, :, off - p: off + n]
            if self.flash is None:
                self.flash = _flash_is_chosen(q, k, v, scale)
            if self.flash:
                out = torch._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]
                return out[0].transpose(0, 1)[p:]
            return inner(module, q, k, v, None, **kwargs)[0][0, p:]

        parts = [call(*direct[0])] if direct else []  # the first call decides self.flash
        streams = side_streams(query.device) if self.flash and len(direct) > 2 else ()
        if streams:
            parts += spread_over_streams(streams, call, direct[1:])
        else:
            parts += [call(*d) for d in direct[1:]]
        if parts:
            out.view(rows * width, heads, out.shape[-1]).index_copy_(0, o_idx, torch.cat(parts))
        for j, n, p, c in longer:
            q, k, v = query[j:j + 1, :, :n], key[j:j + 1, :, off - p: off + n], value[j:j + 1, :, off - p: off + n]
            out[j:j + 1, :n] = attend_after_prefix(inner, module, q, k, v, p, call=c, **kwargs)


@dataclass
class PackedCalls:
    """Each row's own call in a packed forward (openjev/engine/packed.py): the rows' tokens one after
    another in [1, heads, tokens, dim] queries, keys and values, the calls OwnCalls makes from the
    padded tensors. Each attention layer writes its new keys and values after each row's prefix keys
    in the forward's key buffers ([kv heads, keys, dim] a layer; a row's prefix, its tokens, then zeros
    to its whole call's length where that is longer), and every row's call reads a view of them. The
    queries of rows that go on from a prefix or whose call is longer are placed in one zeroed
    token-major buffer a forward, each at its place in its call. Outputs come back in the rows' order,
    token-major as the kernels write them: the packed [1, tokens, heads, dim] output, contiguous, no
    scatter."""

    lengths: list
    starts: list
    calls: list
    flash: bool | None = None
    plan: tuple | None = None
    buffer: object = None
    varlen: bool = False  # rows whose own calls do not split share one varlen call (checked at load)

    def key_spans(self) -> list[int]:
        """Each row's room in the key buffers: its whole call (its prefix and tokens, then zeros where
        the call is longer than what this forward holds of the row)."""
        return [max(c, p + n) for n, p, c in zip(self.lengths, self.starts, self.calls)]

    def key_starts(self) -> list[int]:
        """Where each row's keys begin in the key buffers."""
        return [0, *itertools.accumulate(self.key_spans())][:-1]

    def zero_keys(self) -> bool:
        """Whether some row's call runs past its tokens (its room's tail must be zeros)."""
        return any(c > p + n for n, p, c in zip(self.lengths, self.starts, self.calls))

    def varlen_rows(self, query) -> list[int]:
        """The rows that share the varlen call (with `varlen`, on a GPU): those whose own calls do not
        split their keys and are their prefix and tokens, no zeros after them; none if under two."""
        if not (self.varlen and packed_calls_allowed(query)):
            return []
        unsplit = set(unsplit_rows(self.calls, query))
        rows = [b for b, (n, p, c) in enumerate(zip(self.lengths, self.starts, self.calls))
                if b in unsplit and c == p + n]
        return rows if len(rows) > 1 else []

    def _build(self, query):
        """(new keys' places in the key buffers; query gather and scatter index, query buffer tokens;
        per row: tokens, prefix, call, its first packed query, its first key, its query buffer start
        or None where its call reads the packed queries as they stand, its first output of the varlen
        call or None where it makes its own call; the varlen call's query index (None: every token),
        cu_q, cu_k, max_q, max_k, or None)"""
        import torch

        device = query.device
        shared = set(self.varlen_rows(query))
        spans = self.key_spans()
        dst, q_src, q_dst, rows, bos, total, at_var = [], [], [], [], 0, 0, 0
        for b, (n, p, k0, span) in enumerate(zip(self.lengths, self.starts, [0, *itertools.accumulate(spans)], spans)):
            dst.append(torch.arange(k0 + p, k0 + p + n))
            at, var = None, None
            if b in shared:
                var, at_var = at_var, at_var + n
            elif span > n:  # queries after a prefix or before zeros: in the buffer, zeros around them
                q_src.append(torch.arange(bos, bos + n))
                q_dst.append(torch.arange(total + p, total + p + n))
                at, total = total, total + span
            rows.append((n, p, span, bos, k0, at, var))
            bos += n

        def index(parts):
            return to_device(torch.cat(parts), device) if parts else None

        varlen = None
        if shared:  # every row a sequence of the call, its keys its room; the others' no queries
            def cu(sizes):
                return to_device(torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int32), device)

            q_index = None if len(shared) == len(rows) else index(
                [torch.arange(r[3], r[3] + r[0]) for r in rows if r[6] is not None])
            varlen = (q_index, cu(n if b in shared else 0 for b, n in enumerate(self.lengths)), cu(spans),
                      max(self.lengths[b] for b in shared), max(spans))
        return index(dst), index(q_src), index(q_dst), total, rows, varlen

    def attend(self, inner, module, query, key, value, forward, **kwargs):
        """query [1, heads, tokens, dim], key/value [1, kv heads, tokens, dim] as Transformers' SDPA
        function gets them; returns [1, tokens, heads, dim]. A row whose call is longer than its prefix
        and tokens makes it from zeros around them (attend_after_prefix's call)."""
        import torch

        _, heads, tokens, dim = query.shape
        if self.plan is None:
            self.plan = self._build(query)
        dst, q_src, q_dst, total, rows, varlen = self.plan
        kbuf, vbuf = forward.key_buffers(module.layer_idx)
        kbuf.index_copy_(1, dst, key[0])
        vbuf.index_copy_(1, dst, value[0])
        if total:  # token-major, as the layer's queries are laid out: whole rows of heads copied
            if self.buffer is None:
                self.buffer = query.new_zeros((total, heads, dim))
            self.buffer[q_dst] = query[0].transpose(0, 1)[q_src]
        scale = kwargs.get("scaling")
        shared = None
        if varlen is not None:
            q_index, cu_q, cu_k, max_q, max_k = varlen
            q = query[0].transpose(0, 1)
            shared = varlen_flash(q if q_index is None else q[q_index], kbuf.transpose(0, 1), vbuf.transpose(0, 1),
                                  cu_q, cu_k, max_q, max_k, scale)

        def call(n, p, span, bos, k0, at):  # -> [n, heads, dim], as the kernels lay it out
            k, v = kbuf[None, :, k0:k0 + span], vbuf[None, :, k0:k0 + span]
            q = self.buffer[at:at + span].transpose(0, 1)[None] if at is not None else query[:, :, bos:bos + n]
            if self.flash is None:
                self.flash = _flash_is_chosen(q, k, v, scale)
            if self.flash:
                out = torch._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]
                return out[0].transpose(0, 1)[p:p + n]
            return inner(module, q, k, v, None, **kwargs)[0][0, p:p + n]

        own = [r[:6] for r in rows if r[6] is None]
        parts = [call(*own[0])] if own else []  # the first call decides self.flash
        streams = side_streams(query.device) if self.flash and len(own) > 2 else ()
        parts += spread_over_streams(streams, call, own[1:]) if streams else [call(*r) for r in own[1:]]
        if shared is not None:
            made = iter(parts)
            parts = [shared[r[6]:r[6] + r[0]] if r[6] is not None else next(made) for r in rows]
        return torch.cat(parts)[None]  # token-major: the layer's reshape to [1, tokens, heads * dim] is a view


_THREAD = threading.local()  # this thread's side streams, by (device, count)


def side_streams(device) -> tuple:
    """The CUDA streams OPENJEV_ATTENTION_STREAMS asks for on `device`, made once a thread (see
    spread_over_streams: a side stream is ordered after one thread's current stream only); none for 1
    or off CUDA."""
    from openjev.engine.kernels import attention_streams

    count = attention_streams()
    if count < 2 or getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return ()
    made = _THREAD.__dict__.setdefault("streams", {})
    key = (str(device), count)
    if key not in made:
        import torch

        made[key] = tuple(torch.cuda.Stream(device=key[0]) for _ in range(count))
    return made[key]


def spread_over_streams(streams: tuple, fn, args: list) -> list:
    """[fn(*a) for a in args] (each a tensor), made in turn on `streams` after everything already queued
    on the current stream, which then waits for them all. A result is allocated on its side stream and
    read on the current one; its memory may go back to that stream's pool as soon as the caller drops
    it, and the next use of the pool is work queued after the side stream next waits on the current
    one (as here, first thing; the streams are this thread's, side_streams), so no record_stream is
    needed (it cost host time on a thousand calls)."""
    import torch

    main = torch.cuda.current_stream()
    ready = main.record_event()
    out = [None] * len(args)
    for s, stream in enumerate(streams):
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            for i in range(s, len(args), len(streams)):
                out[i] = fn(*args[i])
    for stream in streams:
        main.wait_stream(stream)
    return out


def _flash_is_chosen(q, k, v, scale) -> bool:
    """Whether SDPA's dispatcher runs a causal call of these [1, heads, tokens, dim] rows (as Transformers
    makes it: no mask, key-value heads grouped) on FlashAttention, the one backend whose op is called
    directly."""
    if not q.is_cuda or q.shape[-1] % 8:  # SDPA pads other head sizes before the op
        return False
    import torch
    from torch.nn.attention import SDPBackend

    choice = torch._fused_sdp_choice(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return int(choice) == int(SDPBackend.FLASH_ATTENTION)


def varlen_flash(query, key, value, cu_q, cu_k, max_q: int, max_k: int, scale):
    """FlashAttention over packed rows ([tokens, heads, dim]; keys may have fewer heads), causal aligned
    to the bottom right of each row, through torch.nn.attention.varlen (a CUDA build of torch 2.10 or
    later)."""
    from torch.nn.attention.varlen import varlen_attn

    extra = {"enable_gqa": True} if key.shape[1] != query.shape[1] and _varlen_takes_gqa_flag() else {}
    return varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), **extra)


@functools.lru_cache(maxsize=1)
def _varlen_takes_gqa_flag() -> bool:  # torch 2.11 takes fewer key heads without the flag
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


@dataclass
class PackedRows:
    """Every row of a forward from prefix states in one variable-length call: row j's queries after its
    prefix over the prefix's keys and its own (left-padded in the cache to `offset`), gathered by index
    tensors made once a forward and used by every attention layer. Not the whole row's call's bits
    (FlashAttention's varlen kernel rounds its own way; about one unit in the last place of an output,
    measured on an H100), so only for prefix reuse and only where asked for."""

    q_rows: object   # [tokens] the row of each packed query
    q_pos: object    # [tokens] its position in the forward's queries
    k_rows: object   # [keys] the row of each packed key
    k_pos: object    # [keys] its position in the cache's keys
    cu_q: object     # [rows + 1] int32
    cu_k: object     # [rows + 1] int32
    max_q: int
    max_k: int

    @classmethod
    def build(cls, layout: PaddedLayout, device, rows: list[int] | None = None) -> "PackedRows":
        import torch

        rows = list(range(len(layout.lengths))) if rows is None else rows
        prefixes = layout.prefixes()
        starts = [prefixes[j] for j in rows]
        lengths = [layout.lengths[j] for j in rows]
        off = layout.offset
        q_rows, q_pos, k_rows, k_pos = [], [], [], []
        for j, n, p in zip(rows, lengths, starts):
            q_rows.append(torch.full((n,), j, dtype=torch.long))
            q_pos.append(torch.arange(n))
            k_rows.append(torch.full((p + n,), j, dtype=torch.long))
            k_pos.append(torch.arange(off - p, off + n))

        def cu(sizes):
            return torch.tensor([0] + list(sizes), dtype=torch.int32).cumsum(0, dtype=torch.int32)

        tensors = dict(q_rows=torch.cat(q_rows), q_pos=torch.cat(q_pos), k_rows=torch.cat(k_rows),
                       k_pos=torch.cat(k_pos), cu_q=cu(lengths), cu_k=cu(p + n for n, p in zip(lengths, starts)))
        return cls(**{k: to_device(v, device) for k, v in tensors.items()}, max_q=max(lengths),
                   max_k=max(p + n for n, p in zip(lengths, starts)))

    def attend(self, query, key, value, out, scale) -> None:
        """query [rows, heads, width, dim], key/value [rows, kv heads, offset + width, dim] as
        Transformers' SDPA function gets them; out [rows, width, heads, dim] gets every real query."""
        q = query[self.q_rows, :, self.q_pos]  # [tokens, heads, dim]
        k, v = key[self.k_rows, :, self.k_pos], value[self.k_rows, :, self.k_pos]
        res = varlen_flash(q, k, v, self.cu_q, self.cu_k, self.max_q, self.max_k, scale)
        out[self.q_rows, self.q_pos] = res.to(out.dtype)


@dataclass
class DirectRows:
    """Every row of a forward with no prefix state in one call of the padded tensors as they stand,
    `width` wide (the longest shared call: one zero token past a row where a state-keeping call needs
    it); values past each row's tokens zeroed, padding outputs zero. Rows that keep their own
    call are written over afterwards."""

    width: int
    real: object   # [rows, width] bool: a real token of the row

    @classmethod
    def build(cls, layout: PaddedLayout, rows: list[int], device) -> "DirectRows":
        import torch

        calls = layout.call_lengths()
        width = max(calls[j] for j in rows)
        real = torch.arange(width)[None, :] < torch.tensor(layout.lengths)[:, None]
        return cls(width, to_device(real, device))

    def attend(self, inner, module, query, key, value, out, **kwargs) -> None:
        import torch

        w = self.width
        if w > query.shape[2]:  # one unseen zero token past the tensors
            grow = (0, 0, 0, w - query.shape[2])
            query, key, value = (torch.nn.functional.pad(x, grow) for x in (query, key, value))
        pad = ~self.real
        # no real query sees a key past its row (causal), but a value there is multiplied by 0, and a
        # padding position's value need not be finite
        v = value[:, :, :w].masked_fill(pad[:, None, :, None], 0)
        res = inner(module, query[:, :, :w], key[:, :, :w], v, None, **kwargs)[0]  # [rows, w, heads, dim]
        n = min(w, out.shape[1])
        out[:, :n] = res[:, :n].masked_fill(pad[:, :n, None, None], 0)


@dataclass
class BatchedRows:
    """Rows of a padded forward in one call: row j's call (prefix queries zeroed, its keys from the
    left-padded cache) placed at the start of a zero-padded [rows, heads, width, dim] batch by index
    tensors made once a forward and used by every attention layer."""

    rows: object        # [g] the rows, as indices of the forward
    src_rows: object    # [g, width]
    q_index: object     # [g, width] query position of each call position (clamped)
    q_valid: object     # [g, width] bool: a real query
    k_index: object     # [g, width] key position in the padded keys
    k_valid: object     # [g, width] bool: a key the row's own call sees
    out_rows: object    # [g, real width]
    out_index: object   # [g, real width] call position of each output position (clamped)
    out_valid: object   # [g, real width] bool

    @classmethod
    def build(cls, layout: PaddedLayout, rows: list[int], width_q: int, device) -> "BatchedRows":
        import torch

        starts = layout.prefixes()
        calls = layout.call_lengths()
        width = max(calls[j] for j in rows)
        t = torch.arange(width)[None, :]
        p = torch.tensor([starts[j] for j in rows])[:, None]
        n = torch.tensor([layout.lengths[j] for j in rows])[:, None]
        src = torch.tensor(rows)[:, None]
        q_pos = t - p
        k_pos = layout.offset - p + t
        o = torch.arange(width_q)[None, :]
        tensors = dict(
            rows=torch.tensor(rows), src_rows=src.expand(-1, width),
            q_index=q_pos.clamp(0, width_q - 1), q_valid=(q_pos >= 0) & (q_pos < n),
            k_index=k_pos.clamp(0, layout.offset + width_q - 1), k_valid=t < p + n,
            out_rows=torch.arange(len(rows))[:, None].expand(-1, width_q),
            out_index=(o + p).clamp(0, width - 1), out_valid=o < n)
        return cls(**{k: to_device(v.contiguous(), device) for k, v in tensors.items()})

    def attend(self, inner, module, query, key, value, out, **kwargs) -> None:
        def place(x, index, valid):  # [b, h, s, d] -> [g, h, width, d], zeros where not valid
            picked = x[self.src_rows, :, index]  # [g, width, h, d]
            return picked.masked_fill(~valid[:, :, None, None], 0).transpose(1, 2)

        q = place(query, self.q_index, self.q_valid)
        k, v = place(key, self.k_index, self.k_valid), place(value, self.k_index, self.k_valid)
        res = inner(module, q, k, v, None, **kwargs)[0]  # [g, width, h, d]
        rows = res[self.out_rows, self.out_index].masked_fill(~self.out_valid[:, :, None, None], 0)
        out[self.rows] = rows


def _plan(layout: PaddedLayout, query, kv_heads: int, inner) -> RowPlan:
    key = (str(query.device), query.shape[1], query.shape[2])
    plan = layout.plans.get(key)
    if plan is not None:
        return plan
    from openjev.engine.kernels import padded_attention_mode, prefix_attention_mode

    packed = prefix_attention_mode() if layout.starts is not None else "whole-row"
    if (packed == "varlen" or (packed == "varlen-tails" and not layout.per_row_states)) and packed_calls_allowed(query):
        plan = RowPlan([], None, packed=PackedRows.build(layout, query.device))
        layout.plans[key] = plan
        return plan
    if packed == "varlen-exact" and packed_calls_allowed(query) and unsplit_varlen_allowed(query, kv_heads, inner):
        whole = unsplit_rows(layout.call_lengths(), query)
        if len(whole) > 1:
            plan = RowPlan(sorted(set(range(len(layout.lengths))) - set(whole)), None,
                           packed=PackedRows.build(layout, query.device, whole))
            layout.plans[key] = plan
            return plan
    rows = list(range(len(layout.lengths)))
    may_share = len(rows) > 1 and padded_attention_mode() == "shared" and shared_calls_allowed(query, kv_heads, inner)
    batched = [j for j, c in enumerate(layout.call_lengths()) if c % FLASH_QUERY_TILE] if may_share else []
    if len(batched) < 2:
        batched = []
    shared = set(batched)
    alone = [j for j in rows if j not in shared]
    batch = None
    if batched and layout.offset == 0 and not any(layout.starts or ()):
        batch = DirectRows.build(layout, batched, query.device)
    elif batched:
        batch = BatchedRows.build(layout, batched, query.shape[2], query.device)
    plan = RowPlan(alone, batch)
    layout.plans[key] = plan
    return plan


def device_sms(device) -> int:
    """The GPU's multiprocessor count (what FlashAttention's key split is decided against)."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def unsplit_rows(calls, query) -> list[int]:
    """The rows whose own calls of `calls` tokens would not split their keys on query's GPU."""
    sms = device_sms(query.device)
    return [j for j, c in enumerate(calls) if attention_class(c, query.shape[1], query.shape[3], sms)[2] == 0]


def unsplit_varlen_allowed(query, kv_heads: int, inner) -> bool:
    """Whether rows whose own calls do not split may share one varlen call on this device (checked,
    see unsplit_varlen_is_exact)."""
    return bool(query.is_cuda) and unsplit_varlen_is_exact(query, kv_heads, inner)


def check_packed_calls(text_config, device, dtype) -> bool | None:
    """At load: with a varlen mode of OPENJEV_PREFIX_ATTENTION, that the variable-length call runs on
    `device` at the model's head shape (one small call), else a one-line UserError instead of every
    later forward failing; with varlen-exact, also whether it is the rows' own calls' bits there
    (unsplit_varlen_is_exact); None with the default whole-row."""
    from openjev.common import UserError
    from openjev.engine.kernels import PREFIX_ATTENTION_ENV, prefix_attention_mode

    mode = prefix_attention_mode()
    if mode == "whole-row":
        return None
    if not str(device).startswith("cuda"):
        raise UserError(f"{PREFIX_ATTENTION_ENV}={mode} needs a CUDA device (FlashAttention's varlen call); "
                        f"this model runs on {device}: unset it")
    try:
        _probe_varlen(*_head_probe(text_config, device, dtype))
    except Exception as exc:  # noqa: BLE001 - an old torch, a GPU FlashAttention does not support
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{PREFIX_ATTENTION_ENV}={mode}: FlashAttention's varlen call does not run here "
                        f"({first}); unset it") from None
    if mode == "varlen-exact":
        return unsplit_varlen_is_exact(*_head_probe(text_config, device, dtype), _INNER[0]) if _INNER else False
    return True


def _probe_varlen(query, kv_heads: int) -> None:
    """One varlen call of two short rows at the model's head shape."""
    import torch

    heads, dim = query.shape[1], query.shape[3]
    q = torch.zeros((5, heads, dim), device=query.device, dtype=query.dtype)
    kv = torch.zeros((9, kv_heads, dim), device=query.device, dtype=query.dtype)
    cu_q = torch.tensor([0, 2, 5], device=query.device, dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9], device=query.device, dtype=torch.int32)
    varlen_flash(q, kv, kv, cu_q, cu_k, 3, 5, dim ** -0.5)


def packed_calls_allowed(query) -> bool:
    """Whether forwards from prefix states may attend in one variable-length call (a GPU: the varlen
    kernel is FlashAttention's)."""
    return bool(query.is_cuda)


def shared_calls_allowed(query, kv_heads: int, inner) -> bool:
    """Whether rows may share attention calls on this device (checked, see batched_rows_are_exact)."""
    return bool(query.is_cuda) and batched_rows_are_exact(query, kv_heads, inner)


_INNER: list = []  # Transformers' own SDPA function, once wrapped


def check_batching(text_config, device, dtype) -> bool | None:
    """At load: whether padded forwards on `device` may share attention calls between rows (the
    check of batched_rows_are_exact, on the model's head shape); None where it does not apply (a CPU,
    OPENJEV_PADDED_ATTENTION other than shared)."""
    from openjev.engine.kernels import padded_attention_mode

    if not str(device).startswith("cuda") or padded_attention_mode() != "shared" or not _INNER:
        return None
    return batched_rows_are_exact(*_head_probe(text_config, device, dtype), _INNER[0])


def check_packed_varlen(text_config, device, dtype) -> bool:
    """At load, with OPENJEV_PREFIX_ATTENTION=varlen-exact and the packed layout: whether a packed
    forward's varlen call is the rows' own calls' bits on `device` (packed_varlen_is_exact, on the
    model's head shape)."""
    return bool(_INNER) and packed_varlen_is_exact(*_head_probe(text_config, device, dtype), _INNER[0])


def _head_probe(text_config, device, dtype):
    """An empty [1, heads, 1, head size] query of the model's attention shape, and its key-value heads."""
    import torch

    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return torch.empty((1, heads, 1, head_dim), device=device, dtype=dtype), text_config.num_key_value_heads


def once_per_shape(check):
    """`check(query, kv_heads, inner)` run once per (device, dtype, heads, key-value heads, head size),
    its answer kept for the process."""
    answers: dict = {}

    @functools.wraps(check)
    def cached(query, kv_heads, inner) -> bool:
        key = (str(query.device), query.dtype, query.shape[1], kv_heads, query.shape[3])
        if key not in answers:
            answers[key] = check(query, kv_heads, inner)
        return answers[key]

    return cached


def _random_rows(query, kv_heads: int, lengths) -> list:
    """(query, key, value) of random [1, heads, n, head size] rows of each length, in query's device
    and dtype, from one seeded generator."""
    import torch

    gen = torch.Generator(device=query.device).manual_seed(0)

    def rand(heads, n):
        return torch.randn((1, heads, n, query.shape[3]), device=query.device, dtype=query.dtype, generator=gen)

    return [(rand(query.shape[1], n), rand(kv_heads, n), rand(kv_heads, n)) for n in lengths]


@once_per_shape
def batched_rows_are_exact(query, kv_heads, inner) -> bool:
    """Whether, on this device, rows sharing one zero-padded call get their own calls' bits: checked
    on random rows of CHECK_LENGTHS tokens."""
    import torch

    lengths = list(CHECK_LENGTHS)
    module = _CheckModule(query.shape[1] // kv_heads)
    rows = _random_rows(query, kv_heads, lengths)
    width = max(lengths)

    def pad(x):
        return torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[2]))

    with torch.inference_mode():
        batch = inner(module, *(torch.cat([pad(r[i]) for r in rows]) for i in range(3)), None,
                      scaling=query.shape[3] ** -0.5)[0]
        ok = all(torch.equal(inner(module, *r, None, scaling=query.shape[3] ** -0.5)[0][0], batch[b, :n])
                 for b, (r, n) in enumerate(zip(rows, lengths)))
    if not ok:
        log.warning("rows sharing one padded attention call do not get their own calls' bits on %s: "
                    "one call a row", torch.cuda.get_device_name(query.device))
    return ok


@once_per_shape
def unsplit_varlen_is_exact(query, kv_heads, inner) -> bool:
    """Whether, on this device, one varlen call gives rows whose own calls do not split their keys
    the bits of those calls (attend_after_prefix with the whole row's length): checked on random rows
    in the layouts of a warm pass's tails, of longer tails and of a state-keeping forward, each row
    from the shortest length whose call does not split to 1601 tokens."""
    import torch

    module = _CheckModule(query.shape[1] // kv_heads)
    scaling = query.shape[3] ** -0.5
    t0 = _shortest_unsplit_call(query)
    forwards = []  # (whole lengths, prefixes, tokens run, per-row states)
    for whole, prefixes, keep in (([t0 + 1, 1100, 1601, 1500, t0 + 127], [None] * 5, False),
                                  ([t0, 1217, 1409], [128, 576, 704], False),
                                  ([1100, 1601, t0 + 100], [0, 768, 64], True)):
        prefixes = [p if p is not None else (n - 1) // 64 * 64 for n, p in zip(whole, prefixes)]
        ends = [(n - 1) // 64 * 64 if keep else n for n in whole]
        forwards.append((whole, prefixes, [e - p for e, p in zip(ends, prefixes)], keep))
    gen = torch.Generator(device=query.device).manual_seed(0)
    ok = True
    try:
        with torch.inference_mode():
            for whole, starts, lengths, keep in forwards:
                off, width = max(starts), max(lengths)

                def rand(heads, n):
                    return torch.randn((len(lengths), heads, n, query.shape[3]), device=query.device,
                                       dtype=query.dtype, generator=gen)

                q, k, v = rand(query.shape[1], width), rand(kv_heads, off + width), rand(kv_heads, off + width)
                layout = PaddedLayout(tuple(lengths), tuple(starts), off, keep, calls=tuple(whole))
                out = q.new_zeros((len(lengths), width, q.shape[1], q.shape[3]))
                PackedRows.build(layout, q.device).attend(q, k, v, out, scaling)
                for j, (n, p, c) in enumerate(zip(lengths, starts, whole)):
                    own = attend_after_prefix(inner, module, q[j:j + 1, :, :n], k[j:j + 1, :, off - p: off + n],
                                              v[j:j + 1, :, off - p: off + n], p, call=c, scaling=scaling)
                    ok = ok and torch.equal(out[j:j + 1, :n], own)
    except Exception as exc:  # noqa: BLE001 - no varlen call here
        log.info("varlen calls for unsplit rows not available: %s", str(exc).splitlines()[0] if str(exc) else exc)
        ok = False
    if not ok:
        log.warning("OPENJEV_PREFIX_ATTENTION=varlen-exact: one varlen call is not the rows' own calls' bits "
                    "on this GPU: each row keeps its own call")
    return ok


def _shortest_unsplit_call(query) -> int:
    """Just past the longest call of whole 64-token tiles that splits its keys on query's GPU at its
    head shape: the shortest call length the checks use for rows that do not split."""
    sms = device_sms(query.device)
    return 1 + next(n for n in range(64, 1 << 16, 64) if attention_class(n + 1, query.shape[1], query.shape[3], sms)[2] == 0)


@once_per_shape
def packed_varlen_is_exact(query, kv_heads, inner) -> bool:
    """Whether, on this device, the varlen call of a packed forward (PackedCalls with `varlen`) gives
    the rows it takes their own calls' bits: random rows of a warm pass's tails, of longer tails and of
    rows from no prefix, rows whose calls split (their own calls, no queries in the varlen call) among
    them, each compared with the same forward's own calls."""
    import torch

    if not packed_calls_allowed(query):  # no varlen kernel here (a CPU): nothing to share
        return False
    heads, dim = query.shape[1], query.shape[3]
    module = _CheckModule(heads // kv_heads)
    module.layer_idx = 0
    t0 = _shortest_unsplit_call(query)
    gen = torch.Generator(device=query.device).manual_seed(0)
    ok, shared = True, False
    try:
        with torch.inference_mode():
            for whole, starts in (([t0 + 1, 300, 1100, 1601, 90, t0 + 127], None),
                                  ([t0, 1217, 1409, 640], [128, 576, 704, 0]),
                                  ([1100, 1601, t0 + 100], [0, 0, 0])):
                starts = [min(p, (n - 1) // 64 * 64) for n, p in zip(whole, starts or whole)]
                lengths = [c - p for c, p in zip(whole, starts)]

                def rand(*shape):
                    return torch.randn(shape, device=query.device, dtype=query.dtype, generator=gen)

                q, k, v = rand(sum(lengths), heads, dim), rand(sum(lengths), kv_heads, dim), rand(sum(lengths), kv_heads, dim)
                buffers = (rand(kv_heads, sum(whole), dim), rand(kv_heads, sum(whole), dim))
                outs = []
                for varlen in (True, False):
                    calls = PackedCalls(list(lengths), list(starts), list(whole), varlen=varlen)
                    bufs = tuple(b.clone() for b in buffers)
                    forward = _CheckBuffers(bufs)
                    outs.append(calls.attend(inner, module, *(x.transpose(0, 1)[None] for x in (q, k, v)), forward,
                                             scaling=dim ** -0.5))
                    shared = shared or (varlen and calls.plan[5] is not None)
                ok = ok and torch.equal(*outs)
    except Exception as exc:  # noqa: BLE001 - no varlen call here
        log.info("a packed forward's varlen call is not available: %s", str(exc).splitlines()[0] if str(exc) else exc)
        ok = False
    return ok and shared


@dataclass
class _CheckBuffers:
    """What PackedCalls reads from a packed forward: its key buffers."""

    keys: tuple

    def key_buffers(self, layer_idx: int):
        return self.keys


class _CheckModule:
    """What Transformers' SDPA function reads from an attention module."""

    def __init__(self, groups: int):
        self.num_key_value_groups = groups
        self.is_causal = True
        self.training = False

