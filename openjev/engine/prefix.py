"""Prefix reuse for the embedded backend: rows that share a prefix run it once, and the states after
prefixes are kept across requests in a bounded LRU cache (opt-in, `--prefix-reuse`).

The state after P tokens is what a Qwen3.5 forward needs to go on from there: per Gated DeltaNet layer
the short convolution's last inputs and the recurrent state, per full-attention layer the keys and
values of the P tokens. A continuation runs the unmodified model through Transformers' own cache
object (DynamicCache of the model's config), 2-D attention mask and per-row position ids. While a
continuation forward runs, two functions the model calls know the padded layout (see
attention.padded_layout): attention runs row by row, the whole row's causal call with the queries
the forward does not hold left out (the exact forward's attention, see attention.attend_after_prefix)
and, where a row's end state is kept, the chunked gated delta rule sees the right padding as inert
tokens (decay 1, no write), so padding never runs into a state. A state is shared only between rows
whose whole attention calls give its positions the same arithmetic (attention.attention_class: on a
GPU, FlashAttention splits the keys of a short row's call by the row's length). Arithmetic: the
agreement goal applies; the default path stays the exact one.

A step: (1) every row looks up the longest cached prefix of itself; (2) rows of the step that share
at least `min_tokens` tokens beyond that run the shared part once, in the forwards of the rows that
do not go on from it; (3) each row runs from its best state to its end, and where that passes its
last chunk boundary (a multiple of 64 tokens) the state there is cached: the GDN rule runs to the
boundary, then the rest (at most a chunk) from the state it kept, as a later forward from the cached
state would. Every state sits on a chunk boundary of the GDN kernels, so the chunks a continuation
runs are those of the exact forward.

Where fla's variable-length rule runs (OPENJEV_PACKED_LAYOUT=auto, the default), the forwards are
packed instead of padded: the rows' tokens one after another, each token mixer row by row
(openjev/engine/packed.py); the same states at the same boundaries, no padding to make inert."""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np

from openjev.engine.attention import attention_class, current_layout, device_sms, padded_layout, rowwise_in_force
from openjev.engine.batching import StepResult, length_groups
from openjev.engine.transfer import to_device

log = logging.getLogger("openjev.prefix")
DEFAULT_MIN_TOKENS = 32
COUNTS = ("hits", "misses", "inserted", "evicted", "tokens_reused", "flushes")
# Prefix states are taken only at multiples of the GDN kernels' chunk (64 tokens in fla and in
# Transformers' fallback), so a continuation's chunks are the exact forward's chunks and its state
# the one the exact forward carries across that boundary.
GDN_CHUNK = 64
# Rows a forward of the prefix path may hold (at least --max-running-requests): its forwards are
# shorter than the plain path's, so fewer, wider ones keep the fixed cost of a forward down.
PREFIX_FORWARD_ROWS = 64
# Rows a tail forward may hold: tails are 1 to 64 tokens, so even this many is a small forward, and
# one forward instead of two took a warm pass of the 128-row set from 0.35-0.39 s to 0.31 s in
# process on an H100 (results_h100/prefix_reuse/3618537).
PREFIX_TAIL_FORWARD_ROWS = 128
# Rows and tokens a packed forward may hold (openjev/engine/packed.py): no padding, so a phase's rows
# go in as few forwards as these allow.
PACKED_FORWARD_ROWS = 128
PACKED_FORWARD_TOKENS = 65536
# Rows whose cached-prefix lookups a PrefixEngine keeps between the scheduler's questions and the step.
LOOKUP_MEMO_ROWS = 16384
# What one more prefix-path forward costs, in padded tokens, when a phase's rows are cut into forwards
# (batching.length_groups): its host time barely grows with its rows, so fewer, fuller forwards win
# where the plain path's 1024 would cut the short tails apart. 2048 was faster in process on an H100
# but slower through the server in the next lease (a warm step of two forwards 425-533 ms against one
# of 258-417 ms; results_h100/prefix_reuse/README.md).
PREFIX_FORWARD_COST_TOKENS = 4096
# The same for tail forwards (rows from their states to their ends, at most a chunk a row), set apart
# so that the other phases' cost can change without splitting a warm step's tails.
PREFIX_TAIL_FORWARD_COST_TOKENS = 4096


@dataclass
class PrefixState:
    """The model's state after `length` tokens: one tensor of each kind on the model's device, its
    first dimension the layers of that kind (GDN layers, full-attention layers)."""

    length: int
    conv: object        # [GDN layers, conv_dim, kernel]
    recurrent: object   # [GDN layers, heads, k_dim, v_dim]
    keys: object        # [attention layers, kv_heads, length, head_dim]
    values: object

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent, self.keys, self.values))


def prefix_key(tokens, group: bytes = b"") -> bytes:
    """The cache key of a prefix of rows of one attention `group` (see PrefixEngine.group)."""
    arr = np.asarray(tokens, dtype=np.int64)
    return hashlib.blake2b(arr.tobytes(), digest_size=16).digest() + len(arr).to_bytes(4, "little") + group


def zero_counts() -> Counter:
    """A PrefixCache's counts before anything happened."""
    return Counter(dict.fromkeys(COUNTS, 0))


@dataclass
class PrefixCache:
    """Prefix states by their token ids and attention group, least recently used evicted first, within
    `budget_bytes`."""

    budget_bytes: int
    entries: OrderedDict = field(default_factory=OrderedDict)
    lengths: dict = field(default_factory=dict)  # length -> entries of that length
    bytes: int = 0
    version: int = 0  # changes whenever an entry comes or goes (find)
    # hits, misses, inserted, evicted, tokens_reused, flushes
    counts: Counter = field(default_factory=zero_counts)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def find(self, row, limit: int, group: bytes = b"") -> tuple:
        """(key, length, version) of the longest cached prefix of `row` within `limit` ((None, 0, version)
        if none), counted nowhere; `version` changes whenever an entry comes or goes, so a caller may keep
        the answer while it stays the same."""
        with self._lock:
            found = self._find(row, limit, group)
            return (found or (None, 0)) + (self.version,)

    def claim(self, key, n: int):
        """The state under `key` (from find), counted as a hit and made the most recent; None, counted as
        a miss, where `key` is None or no longer cached."""
        with self._lock:
            state = self.entries.get(key) if key is not None else None
            if state is None:
                self.counts["misses"] += 1
                return None
            self.entries.move_to_end(key)
            self.counts.update(hits=1, tokens_reused=n)
            return state

    def _find(self, row, limit: int, group: bytes):
        """(key, length) of the longest cached prefix within `limit`, or None; one pass over the row,
        hashing each cached length's prefix, shortest first. Called with the lock held."""
        arr = np.asarray(row, dtype=np.int64)
        h, done, found = hashlib.blake2b(digest_size=16), 0, None
        for n in sorted(n for n in self.lengths if n <= limit):
            h.update(arr[done:n].tobytes())
            done = n
            key = h.copy().digest() + n.to_bytes(4, "little") + group
            if key in self.entries:
                found = key, n
        return found

    def put(self, tokens, state: PrefixState, group: bytes = b"") -> None:
        size = state.nbytes
        if size > self.budget_bytes:
            return
        key = prefix_key(tokens, group)
        with self._lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return
            while self.entries and self.bytes + size > self.budget_bytes:
                self._drop(next(iter(self.entries)))
                self.counts["evicted"] += 1
            self.entries[key] = state
            self.version += 1
            self.lengths[state.length] = self.lengths.get(state.length, 0) + 1
            self.bytes += size
            self.counts["inserted"] += 1

    def _drop(self, key) -> None:
        state = self.entries.pop(key)
        self.version += 1
        self.bytes -= state.nbytes
        self.lengths[state.length] -= 1
        if not self.lengths[state.length]:
            del self.lengths[state.length]

    def clear(self) -> int:
        with self._lock:
            n = len(self.entries)
            self.entries.clear()
            self.version += 1
            self.lengths.clear()
            self.bytes = 0
            self.counts["flushes"] += 1
            return n

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self.entries), "bytes": self.bytes, "budget_bytes": self.budget_bytes,
                    **{k: self.counts[k] for k in COUNTS}}


def shared_prefixes(rows: list[list[int]], floors: list[int], limits: list[int], min_tokens: int,
                    groups: list[bytes] | None = None, arrays: list | None = None) -> dict:
    """Prefixes worth one forward for several rows of a step: row index -> prefix length.

    Rows are sorted by attention group (see PrefixEngine.group) and token ids, so rows that may share
    a prefix stand together; a row's shared prefix is the longer of its common prefixes with its two
    neighbours of its group, cut to a multiple of GDN_CHUNK and to `limits`, taken when at least two
    rows share it and it is `min_tokens` longer than what the row already has (`floors`, its cached
    prefix); `arrays`: the rows as int64 arrays, where the caller has them."""
    groups = groups or [b""] * len(rows)
    arrays = arrays or [np.asarray(r, dtype=np.int64) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: (groups[i], rows[i]))
    lcp = [0] * max(len(order) - 1, 0)
    for k in range(len(order) - 1):
        if groups[order[k]] != groups[order[k + 1]]:
            continue
        a, b = arrays[order[k]], arrays[order[k + 1]]
        n = min(len(a), len(b))
        diff = np.flatnonzero(a[:n] != b[:n])
        lcp[k] = int(diff[0]) if diff.size else n
    chosen: dict[int, int] = {}
    for k, i in enumerate(order):
        best = max(lcp[k - 1] if k > 0 else 0, lcp[k] if k < len(lcp) else 0)
        best = min(best, limits[i])
        best = best // GDN_CHUNK * GDN_CHUNK
        if best - floors[i] >= min_tokens:
            chosen[i] = best
    # a prefix only one row chose is no saving: that row runs from what it has
    by_key: dict[bytes, list[int]] = {}
    for i, n in chosen.items():
        by_key.setdefault(prefix_key(arrays[i][:n], groups[i]), []).append(i)
    return {i: chosen[i] for members in by_key.values() if len(members) > 1 for i in members}


def packed_groups(lengths: list[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Indices of a phase's rows cut into packed forwards in their order, each at most `max_rows` rows
    and `max_tokens` tokens (a longer row alone)."""
    groups: list[list[int]] = [[]]
    tokens = 0
    for i, n in enumerate(lengths):
        if groups[-1] and (len(groups[-1]) >= max_rows or tokens + n > max_tokens):
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += n
    return [g for g in groups if g]


class ContinuationForwards:
    """Forwards of rows that go on from prefix states, through Transformers' cache object."""

    def __init__(self, clf):
        import torch

        self.clf = clf
        self.torch = torch
        text = clf.model.config.get_text_config()
        self.text = text
        types = list(text.layer_types)
        self.linear = [i for i, t in enumerate(types) if t == "linear_attention"]
        self.attention = [i for i, t in enumerate(types) if t == "full_attention"]
        if len(self.linear) + len(self.attention) != len(types):
            raise ValueError(f"layer types {sorted(set(types))}: prefix reuse knows linear_attention and full_attention")
        self.kernel = int(text.linear_conv_kernel_dim)
        key_dim = text.linear_num_key_heads * text.linear_key_head_dim
        self.conv_dim = 2 * key_dim + text.linear_num_value_heads * text.linear_value_head_dim
        self.rec_shape = (text.linear_num_value_heads, text.linear_key_head_dim, text.linear_value_head_dim)
        self.kv_heads = text.num_key_value_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        install_per_row_gdn(clf.model)
        from openjev.engine.fused import (conv_segments_qkv, conv_silu_segments, gdn_modeling, grouped_heads_fused_forward,
                                          segments_conv_in_use)
        from openjev.engine.packed import packed_layout_record

        self.modeling = gdn_modeling(clf.model)
        gdn = next(m for m in clf.model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
        fwd = gdn.__dict__.get("forward")
        self.grouped = getattr(fwd, "func", None) is grouped_heads_fused_forward
        self.segment_conv = conv_segments_qkv if segments_conv_in_use(clf.model) else None
        self.packed = packed_layout_record(clf, self.modeling, self.grouped,
                                           conv_silu_segments if self.segment_conv else None)

    def run(self, items: list, want_states: bool, keep: list | None = None):
        """items: (start PrefixState or None, tokens to run, the whole row's length). Returns (logits
        [n, 3] on the device, the state after each row, or None). With `keep` (per row: how many of its
        tokens the kept state covers, or None for no state), the states are taken there and the rows'
        other tokens still run in this forward (padding_inert_chunk)."""
        torch = self.torch
        if self.packed["used"]:
            return self._run_packed(items, want_states, keep)
        dev = self.clf.device
        starts = [s.length if s is not None else 0 for s, _, _ in items]
        lengths = [len(t) for _, t, _ in items]
        calls = [c for _, _, c in items]
        kept = [n if k is None else k for k, n in zip(keep, lengths)] if keep is not None else lengths
        want_states = want_states or (keep is not None and any(k is not None for k in keep))
        width, offset = max(lengths), max(starts)
        n = len(items)
        ids = torch.full((n, width), self.clf.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, offset + width), dtype=torch.long)
        pos = torch.zeros((n, width), dtype=torch.long)
        for b, (start, tokens) in enumerate(zip(starts, (t for _, t, _ in items))):
            ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[b, offset - start: offset + len(tokens)] = 1
            pos[b] = torch.arange(start, start + width)
        with torch.profiler.record_function("openjev.prefix.cache_build"):
            cache = self._cache([s for s, _, _ in items], offset, want_states, width)
        valid = None
        if want_states:
            valid = torch.arange(width)[None, :] < torch.tensor(kept)[:, None]
        ids, mask, pos = (to_device(t, dev) for t in (ids, mask, pos))
        valid = to_device(valid, dev) if valid is not None else None
        with torch.inference_mode(), padded_layout(lengths, starts, offset, per_row_states=want_states, valid=valid,
                                                   calls=calls, keep=kept if kept != lengths else None):
            out = self.clf.model(input_ids=ids, attention_mask=self._masks(mask, offset), position_ids=pos,
                                 past_key_values=cache, use_cache=True)
            with torch.profiler.record_function("openjev.prefix.states"):
                states = None
                if want_states:
                    wanted = [b for b in range(n) if keep is None or keep[b] is not None]
                    states = self._states(cache, starts, kept, offset, wanted)
        return out.logits, states

    def _run_packed(self, items: list, want_states: bool, keep: list | None):
        """run() in the packed layout (openjev/engine/packed.py)."""
        from openjev.engine.packed import kept_states, run_packed

        if keep is None and want_states:
            keep = [len(t) for _, t, _ in items]
        logits, forward = run_packed(self.clf, self.linear, self.attention, items, keep,
                                     [s for s, _, _ in items], self.segment_conv, self.grouped,
                                     self.packed["attention"]["varlen"])
        if keep is None or not any(k is not None for k in keep):
            return logits, None
        with self.torch.profiler.record_function("openjev.prefix.states"):
            return logits, kept_states(forward, PrefixState)

    def _masks(self, mask, offset: int):
        """The model's masks by layer type, made here where attention runs row by row: Transformers'
        own mask functions read the padding mask back to the host (a synchronisation a forward, which
        left the host idle while the device caught up). Full attention reads no mask under the padded
        layout (attention.rowwise_attention); the GDN layers get the new tokens' padding mask, the
        trimmed mask Transformers would give them. Elsewhere (OPENJEV_PADDED_ATTENTION=masked) the
        2-D mask, for Transformers' masks."""
        if not rowwise_in_force(self.clf.model):
            return mask
        return {"full_attention": None, "linear_attention": mask[:, offset:].contiguous()}

    def _cache(self, starts: list, offset: int, record: bool, width: int):
        """A DynamicCache holding the rows' start states: GDN conv and recurrent states stacked by row,
        attention keys and values left-padded with zeros to `offset` (a few large copies, not one a
        row and layer) in buffers with room for the forward's `width` new ones, which each layer
        writes there instead of concatenating."""
        from transformers import DynamicCache

        torch = self.torch
        dev, dtype = self.clf.device, self.clf.model.dtype
        cache = DynamicCache(config=self.text)
        known = next((s for s in starts if s is not None), None)  # zeros in the dtypes the kernels left
        conv_zero = torch.zeros((len(self.linear), self.conv_dim, self.kernel),
                                dtype=known.conv.dtype if known else dtype, device=dev)
        rec_zero = torch.zeros((len(self.linear),) + self.rec_shape,
                               dtype=known.recurrent.dtype if known else torch.float32, device=dev)
        conv_all = torch.stack([s.conv if s is not None else conv_zero for s in starts], 1)  # [layers, rows, ...]
        rec_all = torch.stack([s.recurrent if s is not None else rec_zero for s in starts], 1)
        defer = getattr(getattr(self.modeling, "causal_conv1d_fn", None), "_openjev_fused", False)
        for k, li in enumerate(self.linear):
            layer = cache.layers[li]
            if defer:
                layer.update_conv_state = _conv_state_handed_on(layer, record)
            layer.conv_states[0], layer.recurrent_states[0] = conv_all[k], rec_all[k]
            layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
            layer.has_previous_state[0] = True
            layer.conv_kernel_size[0] = self.kernel
            layer.device, layer.dtype = conv_all.device, conv_all.dtype
            layer.record_past = record  # keep every conv input, so each row's own last inputs can be cut out
        shape = (len(self.attention), len(starts), self.kv_heads, offset + width, self.head_dim)
        k_all, v_all = torch.empty(shape, dtype=dtype, device=dev), torch.empty(shape, dtype=dtype, device=dev)
        k_all[..., :offset, :].zero_()
        v_all[..., :offset, :].zero_()
        for b, s in enumerate(starts):
            if s is not None:
                k_all[:, b, :, offset - s.length:offset].copy_(s.keys)
                v_all[:, b, :, offset - s.length:offset].copy_(s.values)
        for k, li in enumerate(self.attention):
            layer = cache.layers[li]
            layer.lazy_initialization(k_all[k], v_all[k])
            layer.keys, layer.values = k_all[k, ..., :offset, :], v_all[k, ..., :offset, :]
            layer.update = _keys_written_in_place(layer, k_all[k], v_all[k])
        return cache

    def _states(self, cache, starts, lengths, offset, wanted: list[int]) -> list:
        """The state of each row in `wanted` after its first `lengths` tokens (None for the other
        rows), one allocation per row and kind."""
        torch = self.torch
        ends = torch.tensor(lengths, dtype=torch.long)[:, None] + torch.arange(self.kernel)  # a row's last inputs
        ends = to_device(ends, self.clf.device)
        convs = []
        for li in self.linear:
            layer = cache.layers[li]
            recorded = layer.conv_states[0]  # [rows, conv_dim, kernel + width], or the start state alone
            new = layer.__dict__.get("openjev_new_inputs")  # ... and the new inputs apart
            at = ends[:, None, :].expand(-1, recorded.shape[1], -1)
            if new is None:
                convs.append(recorded.gather(2, at))
                continue
            s = recorded.shape[-1]
            convs.append(torch.where(at < s, recorded.gather(2, at.clamp(max=s - 1)), new.gather(2, (at - s).clamp(min=0))))
        conv_all = torch.stack(convs, 1)  # [rows, layers, conv_dim, kernel]
        rec_all = torch.stack([cache.layers[li].recurrent_states[0] for li in self.linear], 1)
        states: list = [None] * len(starts)
        for b in wanted:
            start, n = starts[b], lengths[b]
            span = slice(offset - start, offset + n)
            keys = torch.stack([cache.layers[li].keys[b, :, span] for li in self.attention])
            values = torch.stack([cache.layers[li].values[b, :, span] for li in self.attention])
            states[b] = PrefixState(start + n, conv_all[b].clone(), rec_all[b].clone(), keys, values)
        return states


def _conv_state_handed_on(layer, record: bool):
    """A cache layer's update_conv_state that does not concatenate the new conv inputs to the start
    state: it hands both to the model's conv call (openjev.engine.fused.defer_conv_state, where the
    fused conv is installed) and, with `record`, keeps the new inputs for _states."""
    from openjev.engine.fused import defer_conv_state

    ref = weakref.ref(layer)  # the layer holds this function: a strong reference would keep both alive

    def update_conv_state(conv_states, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        owner = ref()
        defer_conv_state(conv_states, owner.conv_states[state_idx])
        if record:
            owner.openjev_new_inputs = conv_states
        return conv_states

    return update_conv_state


def _keys_written_in_place(layer, keys, values):
    """A cache layer's update that writes the new keys and values after the cached ones in the
    buffers `keys` and `values` [rows, heads, room, dim] (the layer's own are views of their start)
    and returns the views that end with them: DynamicLayer.update's result without its concatenation.
    New keys beyond the room go to DynamicLayer.update."""
    ref = weakref.ref(layer)  # the layer holds this function: a strong reference would keep both alive

    def update_in_place(key_states, value_states, *args, **kwargs):
        owner = ref()
        start = owner.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > keys.shape[-2]:
            return type(owner).update(owner, key_states, value_states, *args, **kwargs)
        keys[..., start:end, :].copy_(key_states)
        values[..., start:end, :].copy_(value_states)
        owner.keys, owner.values = keys[..., :end, :], values[..., :end, :]
        return owner.keys, owner.values

    return update_in_place


def attention_classes(device, heads: int, head_dim: int):
    """length -> the attention group key of rows of that length (see PrefixEngine.group)."""
    if not str(device).startswith("cuda"):
        return lambda _n: b""
    sms = device_sms(device)

    @functools.lru_cache(maxsize=None)
    def key(n: int) -> bytes:
        return repr(attention_class(n, heads, head_dim, sms)).encode()

    return key


def install_per_row_gdn(model) -> bool:
    """Wrap the chunked gated delta rule the model's Gated DeltaNet layers call (a module-level name
    of Transformers' modeling module, fla's kernel or its PyTorch fallback) so that, while a padded
    layout asks for per-row states, each row's final state is its own, not one that ran on into the
    padding (see padding_inert_chunk). Otherwise the wrapper passes the call through."""
    from openjev.engine.fused import gdn_modeling

    modeling = gdn_modeling(model)
    inner = getattr(modeling, "torch_chunk_gated_delta_rule", None)
    if inner is None or getattr(inner, "_openjev_per_row", False):
        return inner is not None
    modeling.torch_chunk_gated_delta_rule = padding_inert_chunk(inner)
    return True


def padding_inert_chunk(inner):
    """`inner` (the chunked gated delta rule) made to carry each row's state unchanged through its right
    padding while the padded layout asks for per-row states: one call for the batch with the decay
    gate g and the write strength beta set to 0 on padded tokens. A token with g = 0 and beta = 0
    multiplies the state by exp(0) = 1 and adds beta * k * (...) = 0, so the final state is the one
    after the row's last real token; where the padding is whole 64-token chunks (every forward that
    keeps states runs from chunk boundary to chunk boundary) the kernels' chunk arithmetic keeps it
    bit for bit. Real tokens' outputs are those of the unmasked call (the rule is causal)."""

    @functools.wraps(inner)
    def chunk_with_inert_padding(query, key, value, g, beta, *args, initial_state=None,
                                 output_final_state=False, **kwargs):
        layout = current_layout()
        if layout is None or not layout.per_row_states or query.shape[0] != len(layout.lengths):
            return inner(query, key, value, g, beta, *args, initial_state=initial_state,
                         output_final_state=output_final_state, **kwargs)
        import torch

        width = query.shape[1]
        kept = layout.keep or layout.lengths
        valid = layout.valid
        if valid is None or tuple(valid.shape) != (query.shape[0], width):
            valid = torch.arange(width, device=query.device)[None, :] < torch.tensor(kept, device=query.device)[:, None]
        real = valid.reshape(valid.shape + (1,) * (g.dim() - 2))
        inert_g, inert_beta = torch.where(real, g, torch.zeros_like(g)), torch.where(real, beta, torch.zeros_like(beta))
        out, state = inner(query, key, value, inert_g, inert_beta, *args, initial_state=initial_state,
                           output_final_state=True, **kwargs)
        if layout.keep is not None and any(k < n for k, n in zip(layout.keep, layout.lengths)):
            after = _after_kept_state(inner, (query, key, value, g, beta), args, kwargs, state, layout)
            out[after[0]] = after[1]
        return out, state

    chunk_with_inert_padding._openjev_per_row = True
    return chunk_with_inert_padding


def _after_kept_state(inner, inputs, args, kwargs, state, layout):
    """The tokens each row runs after the state it keeps (layout.keep; at most a chunk), gathered to
    the front of a call of their own that starts from the kept states: the call the row's tail
    forward would make from the cached state. Returns (index of those tokens in the padded call,
    their outputs)."""
    rows, take, place, pick = _after_kept_index(layout, inputs[0].shape[1], inputs[0].device)
    out, _ = inner(*(x[rows, take] for x in inputs), *args, initial_state=state, output_final_state=False, **kwargs)
    return place, out[pick]


def _after_kept_index(layout, width: int, device):
    """The gather and scatter indices of _after_kept_state on the device, built once a forward (every
    GDN layer of it uses the same; kept in the layout's plans): row and position of each gathered
    token [rows, span], and where the real ones sit in the padded call and in the gathered one."""
    import torch

    key = ("after_kept", str(device), width)
    if key not in layout.plans:
        after = [n - k for k, n in zip(layout.keep, layout.lengths)]
        span = max(after)
        pos = torch.tensor(layout.keep)[:, None] + torch.arange(span)[None, :]  # [rows, span]
        real_rows, real_cols = (torch.arange(span)[None, :] < torch.tensor(after)[:, None]).nonzero(as_tuple=True)
        rows = torch.arange(len(layout.lengths))[:, None].expand(-1, span).contiguous()
        real_rows_dev = to_device(real_rows, device)
        layout.plans[key] = (to_device(rows, device), to_device(pos.clamp(max=width - 1), device),
                             (real_rows_dev, to_device(pos[real_rows, real_cols], device)),
                             (real_rows_dev, to_device(real_cols, device)))
    return layout.plans[key]


@dataclass
class RowLookup:
    """A row's int64 array and, as of cache `version`, its longest cached prefix (`key`, `cached` tokens)."""

    row: list
    array: object
    version: int | None = None
    key: bytes | None = None
    cached: int = 0
    marks: list | None = None  # digests of its prefixes at each chunk boundary within its state limit


class PrefixEngine:
    """One scheduling step with shared prefixes and the cross-request prefix cache."""

    def __init__(self, clf, budget_bytes: int, min_tokens: int = DEFAULT_MIN_TOKENS):
        self.forwards = ContinuationForwards(clf)
        self.clf = clf
        self.cache = PrefixCache(budget_bytes) if budget_bytes > 0 else None
        self.min_tokens = min_tokens
        self.forward_cost = PREFIX_FORWARD_COST_TOKENS  # padded tokens one more forward is counted as
        self.tail_forward_cost = PREFIX_TAIL_FORWARD_COST_TOKENS  # ... in a tail phase
        self.classes = attention_classes(clf.device, self.forwards.text.num_attention_heads, self.forwards.head_dim)
        # id(row) -> its RowLookup: the scheduler asks for a queued row's cost while it waits for arrivals
        # and again as it plans, and the step then looks it up once more; while the cache is unchanged the
        # first answer stands. A step drops its rows.
        self._looked_up: dict[int, RowLookup] = {}

    def group(self, row) -> bytes:
        """The rows that may share `row`'s prefix states: those whose whole attention calls give the
        prefix's positions the same arithmetic (attention.attention_class of the row's length on a
        GPU; every row on a CPU)."""
        return self.classes(len(row))

    def stats(self) -> dict:
        return {"min_shared_tokens": self.min_tokens, "cache": self.cache.stats() if self.cache is not None else None,
                "packed_layout": self.forwards.packed}

    def warm_up(self, max_rows: int) -> dict:
        """Before the first request: a cold step of rows sharing a prefix beside rows that do not, then the
        same rows again (tails from their cached states), so the prefix path's kernels are compiled
        before /health says ready (on an H100 a first flushed pass paid 1.7-3 s of compilation without
        it); the cache is emptied and its counts start from zero afterwards."""
        from openjev.engine.warmup import synthetic_rows

        vocab = self.clf.vocab_size
        premise = synthetic_rows(vocab, lengths=(320,), count=1)[0]
        rows = [premise + r for r in synthetic_rows(vocab, lengths=(40, 70), count=4)]
        rows += synthetic_rows(vocab, lengths=(200, 500), count=2)
        t0 = time.perf_counter()
        cold = self.run_step(rows, max_rows)
        warm = self.run_step(rows, max_rows)
        if self.cache is not None:  # the steps dropped their rows' lookups; the cache goes too
            self.cache.clear()
            self.cache.counts = zero_counts()
        seconds = round(time.perf_counter() - t0, 3)
        log.info("prefix path warm-up: %d rows, a cold and a warm step in %.1f s", len(rows), seconds)
        return {"rows": len(rows), "forwards": cold.forwards + warm.forwards, "seconds": seconds}

    def state_limit(self, row) -> int:
        """The longest prefix of `row` a state may hold: the last chunk boundary before its last token
        (its tail, 1 to 64 tokens, always runs); 0 for a row ending in the pad id, which runs whole, so
        that Transformers pools the same token as for the exact forward (its rightmost non-pad token)."""
        return (len(row) - 1) // GDN_CHUNK * GDN_CHUNK if row[-1] != self.clf.pad_token_id else 0

    def step_cost(self):
        """A cost of rows for one step plan (the scheduler's `plan_step`, what its step budget counts): the
        tokens the step computes for a row given the rows costed before it in the same plan, those after
        the longer of its cached prefix (as SGLang's budget counts the tokens after a prefix match) and
        the longest prefix it shares with them (at chunk boundaries, within its attention group, at least
        min_tokens beyond the cached one), as run_step shares prefixes: the first row of a shared prefix
        pays for it, the others for their own tokens only. So a cold step of option groups counts its
        premises once against the step budget, as it runs them."""
        seen: set[bytes] = set()

        def cost(row) -> int:
            limit = self.state_limit(row)
            if limit == 0:
                return len(row)
            entry = self._lookup(row, limit)  # entry.cached stays 0 without a cache
            marks = self._marks(entry, limit)
            shared = next((GDN_CHUNK * (k + 1) for k in range(len(marks) - 1, -1, -1) if marks[k] in seen), 0)
            seen.update(marks)
            return len(row) - (shared if shared - entry.cached >= self.min_tokens else entry.cached)
        return cost

    def _marks(self, entry: "RowLookup", limit: int) -> list:
        """Digests of `entry`'s prefixes of 1, 2, ... chunks up to `limit`, salted with its attention group."""
        if entry.marks is None:
            h = hashlib.blake2b(self.group(entry.row), digest_size=16)
            raw, step, entry.marks = entry.array.tobytes(), GDN_CHUNK * entry.array.itemsize, []
            for end in range(step, limit // GDN_CHUNK * step + 1, step):
                h.update(raw[end - step:end])
                entry.marks.append(h.digest())
        return entry.marks

    def _lookup(self, row, limit: int) -> "RowLookup":
        """`row`'s RowLookup, its longest cached prefix within `limit` found again only where the cache
        changed since."""
        entry = self._looked_up.get(id(row))
        if entry is None or entry.row is not row:
            if len(self._looked_up) >= LOOKUP_MEMO_ROWS:  # rows of requests that went away without a step
                self._looked_up.clear()
            entry = self._looked_up[id(row)] = RowLookup(row, np.asarray(row, dtype=np.int64))
        if self.cache is not None and limit > 0 and entry.version != self.cache.version:
            entry.key, entry.cached, entry.version = self.cache.find(entry.array, limit, self.group(row))
        return entry

    def run_step(self, rows: list[list[int]], max_rows: int) -> StepResult:
        n = len(rows)
        limits = [self.state_limit(r) for r in rows]
        looked = [self._lookup(r, limit) for r, limit in zip(rows, limits)]
        for r in rows:
            self._looked_up.pop(id(r), None)
        arrays = [e.array for e in looked]  # prefix keys hash their bytes
        groups = [self.group(r) for r in rows]
        best = [self.cache.claim(e.key, e.cached) if self.cache is not None and limit > 0 else None
                for e, limit in zip(looked, limits)]

        def have(i: int) -> int:  # tokens of row i its best state already holds
            return best[i].length if best[i] is not None else 0

        floors = [have(i) for i in range(n)]
        stats = {"forwards": 0, "computed": 0, "padded": 0}

        torch = self.forwards.torch

        def forward(phase, items, want_states, keep=None):
            logits_all, states_all = [None] * len(items), [None] * len(items)
            tail = phase == "tail"
            rows_cap = max(max_rows, PREFIX_TAIL_FORWARD_ROWS if tail else PREFIX_FORWARD_ROWS)
            cost = self.tail_forward_cost if tail else self.forward_cost
            lengths = [len(t) for _, t, _ in items]
            if self.forwards.packed["used"]:
                cuts = packed_groups(lengths, max(rows_cap, PACKED_FORWARD_ROWS), PACKED_FORWARD_TOKENS)
            else:
                cuts = length_groups(lengths, rows_cap, cost)
            for idx in cuts:
                group = [items[i] for i in idx]
                with torch.profiler.record_function(f"openjev.prefix.{phase}"):
                    logits, states = self.forwards.run(group, want_states, [keep[i] for i in idx] if keep else None)
                stats["forwards"] += 1
                stats["computed"] += sum(len(t) for _, t, _ in group)
                stats["padded"] += (sum(len(t) for _, t, _ in group) if self.forwards.packed["used"]
                                    else max(len(t) for _, t, _ in group) * len(group))
                for k, i in enumerate(idx):
                    logits_all[i] = logits[k]
                    if states is not None:
                        states_all[i] = states[k]
            return logits_all, states_all

        # shared prefixes of this step, each run once from the longest cached state of it
        shared = shared_prefixes(rows, floors, limits, self.min_tokens, groups, arrays)
        keys = {i: prefix_key(arrays[i][:length], groups[i]) for i, length in shared.items()}
        prefixes: dict[bytes, tuple[int, int]] = {}  # key -> (a row holding it, its length)
        for i, length in shared.items():
            prefixes.setdefault(keys[i], (i, length))
        plan = list(prefixes.values())  # each from its row's cached state, shorter than the prefix
        if self.cache is None:
            if plan:
                _, states = forward("shared", [(best[i], rows[i][have(i):length], len(rows[i])) for i, length in plan],
                                    True)
                made = dict(zip(prefixes, states))
                for i in shared:
                    best[i] = made[keys[i]]
            out, _ = forward("rows", [(best[i], rows[i][have(i):], len(rows[i])) for i in range(n)], False)
        else:
            # every row runs from its best state to its end; a row short of its last chunk boundary
            # keeps the state there. Where no row keeps a state, the step is tails only (at most a
            # chunk a row).
            out = [None] * n

            def keep(i: int):  # tokens of row i to run before the state it keeps, from its best state
                return limits[i] - have(i) if have(i) < limits[i] else None

            def run(phase, now, plan=()):
                """The prefixes `plan` (each keeping the state at its end) and the rows `now` (from their
                best states to their ends) in one set of forwards cut by length: the rows' logits to
                `out`, every kept state to the cache; the prefixes' states returned."""
                items = [(best[i], rows[i][have(i):length], len(rows[i])) for i, length in plan]
                items += [(best[i], rows[i][have(i):], len(rows[i])) for i in now]
                marks = [length - have(i) for i, length in plan] + [keep(i) for i in now]
                if not items:
                    return []
                if any(m is not None for m in marks):
                    logits, states = forward(phase, items, False, marks)
                else:
                    logits, states = forward("tail", items, False)
                for (i, length), st in zip(plan, states):
                    self.cache.put(arrays[i][:length], st, groups[i])
                for k, i in enumerate(now, len(plan)):
                    out[i] = logits[k]
                    if marks[k] is not None:
                        self.cache.put(arrays[i][:limits[i]], states[k], groups[i])
                return states[:len(plan)]

            # the shared prefixes run beside the rows that do not go on from them, then the rows that do
            made = dict(zip(prefixes, run("body", [i for i in range(n) if i not in shared], plan)))
            for i in shared:
                best[i] = made[keys[i]]
            run("continued", sorted(shared))
        with torch.inference_mode():
            logits = torch.stack(out).float().cpu().numpy().astype(np.float32, copy=False)
        return StepResult(logits, stats["forwards"], stats["computed"], stats["padded"],
                          max(0, sum(map(len, rows)) - stats["computed"]))
