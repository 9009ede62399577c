"""Full attention in padded forwards, each row with the arithmetic of its own unpadded call.

A right-padded forward (classifier.padded_logits, prefix.ContinuationForwards) declares its layout
(`padded_layout`); Transformers' "sdpa" attention function, wrapped once (`rowwise_attention`), then
gives every row the output of the call an unpadded forward of that row makes: causal, no mask,
FlashAttention on a GPU. A row that goes on from a prefix state runs the whole row's call with the
prefix's queries zeroed (`attend_after_prefix`).

With OPENJEV_PADDED_ATTENTION=shared (opt-in: not yet run on a GPU), rows whose own call
FlashAttention does not split (PyTorch's FA2 splits a call's keys when batch x heads x 64-query blocks
stays under 0.8 x twice the SM count) and whose call length is not a multiple of 64 (the kernel's
whole-tiles variant rounds differently) share one call, padded with zeros to the longest: each query
block then reads the same key blocks in the same order as in its own call. That is checked once per
device against separate calls (`batched_rows_are_exact`); where it fails, or on a CPU, every row gets
its own call.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from dataclasses import dataclass, field

from openjev.engine.transfer import to_device

log = logging.getLogger("openjev.attention")

# FlashAttention's query and key blocks for the model's head size (256) on SM80/SM90; prefix states
# sit on multiples of it (openjev/engine/prefix.py GDN_CHUNK).
FLASH_QUERY_TILE = 64
# PyTorch's FA2 keeps a call whole (no split of its keys) from this many (batch x heads x 64-query
# blocks) per SM: 0.8 of its 2 x SMs.
FLASH_WHOLE_CALL_PER_SM = 1.6


@dataclass(frozen=True)
class PaddedLayout:
    """The right-padded forward running in this thread: each row's real length, and for rows that go
    on from a prefix state (openjev/engine/prefix.py) the prefix length and where the cached keys end
    (prefixes are left-padded to `offset`); per_row_states asks for each row's own final GDN state,
    `valid` (optional, [rows, width] bool on the device) marks the real tokens."""

    lengths: tuple
    starts: tuple | None = None
    offset: int = 0
    per_row_states: bool = False
    valid: object = None
    plans: dict = field(default_factory=dict, compare=False, repr=False)  # per device: the attention plan

    def call_lengths(self) -> list[int]:
        """Each row's own attention call (see call_length)."""
        starts = self.starts or (0,) * len(self.lengths)
        return [call_length(p, n, self.per_row_states) for n, p in zip(self.lengths, starts)]


def call_length(prefix: int, n: int, keep_odd: bool) -> int:
    """The length of the attention call for `n` queries after `prefix` tokens: prefix and row, and one
    unseen zero token where a state-keeping forward's call would be a whole number of tiles (see
    attend_after_prefix)."""
    total = prefix + n
    return total + int(keep_odd and total % FLASH_QUERY_TILE == 0)


_LAYOUT: contextvars.ContextVar = contextvars.ContextVar("openjev_padded_layout", default=None)


def current_layout() -> PaddedLayout | None:
    return _LAYOUT.get()


@contextlib.contextmanager
def padded_layout(lengths, starts=None, offset: int = 0, per_row_states: bool = False, valid=None):
    """Declare the right-padded forward about to run in this thread (see PaddedLayout)."""
    token = _LAYOUT.set(PaddedLayout(tuple(int(n) for n in lengths), tuple(int(p) for p in starts) if starts else None,
                                     int(offset), per_row_states, valid))
    try:
        yield
    finally:
        _LAYOUT.reset(token)


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
        layout = _LAYOUT.get()
        off = layout.offset if layout is not None else 0
        if layout is None or query.shape[0] != len(layout.lengths) or key.shape[2] != off + query.shape[2]:
            return inner(module, query, key, value, attention_mask, **kwargs)
        starts = layout.starts or (0,) * len(layout.lengths)
        out = query.new_zeros((query.shape[0], query.shape[2], query.shape[1], value.shape[-1]))
        plan = _plan(layout, query, key.shape[1], inner)
        alone = plan.alone
        odd = layout.per_row_states  # a state-keeping forward stops on a 64-token boundary inside the row
        for j in alone:
            n, p = layout.lengths[j], starts[j]
            q, k, v = query[j:j + 1, :, :n], key[j:j + 1, :, off - p: off + n], value[j:j + 1, :, off - p: off + n]
            if call_length(p, n, odd) == n:  # the row's own unpadded call
                row = inner(module, q, k, v, None, **kwargs)[0]
            else:
                row = attend_after_prefix(inner, module, q, k, v, p, keep_odd=odd, **kwargs)
            out[j:j + 1, :n] = row
        if plan is not None and plan.batch is not None:
            plan.batch.attend(inner, module, query, key, value, out, **kwargs)
        return out, None

    sdpa_rowwise._openjev_rowwise = True
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_rowwise
    return mode


def attend_after_prefix(inner, module, query, key, value, prefix: int, keep_odd: bool = False, **kwargs):
    """One row's queries after `prefix` tokens over the prefix's keys and its own, in [1, n, heads, dim]
    as Transformers' SDPA function returns it: the call an unpadded forward of the whole row makes
    (`inner`, causal, FlashAttention on a GPU), with zeros for the prefix's queries, whose outputs are
    dropped. Prefixes end on 64-token boundaries, FlashAttention's query tiles, so each real query
    tile is computed as in the whole row's forward: the same bits, at the cost of the prefix queries'
    attention. With keep_odd (a forward that stops on a tile boundary inside the row) a call whose
    length is a whole number of tiles gets one zero token more, which no real query sees: the
    kernel's whole-tiles variant rounds differently from the one the whole row's call runs."""
    import torch

    total = prefix + query.shape[2]
    length = call_length(prefix, query.shape[2], keep_odd)
    queries = query.new_zeros(query.shape[:2] + (length, query.shape[3]))
    queries[:, :, prefix:total] = query
    if length > total:
        key = torch.cat([key, key.new_zeros(key.shape[:2] + (1, key.shape[3]))], dim=2)
        value = torch.cat([value, value.new_zeros(value.shape[:2] + (1, value.shape[3]))], dim=2)
    return inner(module, queries, key, value, None, **kwargs)[0][:, prefix:total]


@dataclass
class RowPlan:
    alone: list          # rows that get their own call
    batch: "BatchedRows | None"


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

        starts = layout.starts or (0,) * len(layout.lengths)
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
    from openjev.engine.kernels import padded_attention_mode

    rows = list(range(len(layout.lengths)))
    sms = shared_call_sms(query, kv_heads, inner) if len(rows) > 1 and padded_attention_mode() == "shared" else None
    batched = [] if sms is None else [
        j for j, c in enumerate(layout.call_lengths())
        if c % FLASH_QUERY_TILE and query.shape[1] * math.ceil(c / FLASH_QUERY_TILE) >= FLASH_WHOLE_CALL_PER_SM * sms]
    if len(batched) < 2:
        batched = []
    shared = set(batched)
    alone = [j for j in rows if j not in shared]
    plan = RowPlan(alone, BatchedRows.build(layout, batched, query.shape[2], query.device) if batched else None)
    layout.plans[key] = plan
    return plan


def shared_call_sms(query, kv_heads: int, inner) -> int | None:
    """The SM count that decides which rows' own calls FlashAttention keeps whole, where rows may
    share calls on this device (checked, see batched_rows_are_exact); None where they may not."""
    if not query.is_cuda or not batched_rows_are_exact(query, kv_heads, inner):
        return None
    import torch

    return torch.cuda.get_device_properties(query.device).multi_processor_count


_EXACT: dict = {}
_INNER: list = []  # Transformers' own SDPA function, once wrapped


def check_batching(text_config, device, dtype) -> bool | None:
    """At load: whether padded forwards on `device` may share attention calls between rows (the
    check of batched_rows_are_exact, on the model's head shape); None where it does not apply (a CPU,
    OPENJEV_PADDED_ATTENTION other than shared)."""
    import torch

    from openjev.engine.kernels import padded_attention_mode

    if not str(device).startswith("cuda") or padded_attention_mode() != "shared" or not _INNER:
        return None
    heads, kv_heads = text_config.num_attention_heads, text_config.num_key_value_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    probe = torch.empty((1, heads, 1, head_dim), device=device, dtype=dtype)
    return batched_rows_are_exact(probe, kv_heads, _INNER[0])


def batched_rows_are_exact(query, kv_heads, inner) -> bool:
    """Whether, on this device, rows sharing one zero-padded call get their own calls' bits: checked
    once per (device, dtype, heads, head size) on random rows whose calls FlashAttention keeps whole."""
    import torch

    key = (str(query.device), query.dtype, query.shape[1], kv_heads, query.shape[3])
    if key in _EXACT:
        return _EXACT[key]
    sms = torch.cuda.get_device_properties(query.device).multi_processor_count
    first = math.ceil(FLASH_WHOLE_CALL_PER_SM * sms / query.shape[1]) * FLASH_QUERY_TILE - 37
    lengths = [first, first + 100, first + 301]
    gen = torch.Generator(device=query.device).manual_seed(0)

    def rand(heads, n):
        return torch.randn((1, heads, n, query.shape[3]), device=query.device, dtype=query.dtype, generator=gen)

    module = _CheckModule(query.shape[1] // kv_heads)
    rows = [(rand(query.shape[1], n), rand(kv_heads, n), rand(kv_heads, n)) for n in lengths]
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
    _EXACT[key] = ok
    return ok


class _CheckModule:
    """What Transformers' SDPA function reads from an attention module."""

    def __init__(self, groups: int):
        self.num_key_value_groups = groups
        self.is_causal = True
        self.training = False

