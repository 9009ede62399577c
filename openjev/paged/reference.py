"""Dense reference and test cases for ragged causal prefill over a paged KV cache.

Pure PyTorch, runs on CPU or GPU, no TileLang. Conventions (shared with the kernel):

* ``q`` is packed ragged ``[total_q, heads, dim]`` with ``cu_seqlens_q`` (int32 ``[batch + 1]``).
* ``k_cache``/``v_cache`` are ``[num_pages, page_size, heads_kv, dim]``; ``block_table[b, p]``
  (int32 ``[batch, width]``) is the physical page of logical page ``p`` of sequence ``b``.
* ``kv_lens[b] = prefix_len + q_len``: the chunk's new tokens are the last ``q_len`` keys.
* Causal mask aligned bottom-right: key ``j`` is visible to query ``i`` of the chunk iff
  ``j <= prefix_len + i``, with ``prefix_len = kv_len - q_len``.
* A fully masked query row (impossible under bottom-right alignment with ``kv_len >= q_len``,
  but defined so every mask function has a defined result) has output exactly 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

MaskFn = Callable[[int, int, torch.device], torch.Tensor]

__all__ = [
    "PagedPrefillCase",
    "causal_visibility",
    "KNOWN_BUG_MASKS",
    "dense_attention",
    "gather_sequence_kv",
    "reference_paged_prefill",
    "make_case",
    "random_case",
    "check_cases",
    "causal_flops",
]


# --------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------
def causal_visibility(q_len: int, kv_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``[q_len, kv_len]``: key j visible to query i iff ``j <= (kv_len - q_len) + i``."""
    if kv_len < q_len:
        raise ValueError(f"kv_len ({kv_len}) must be >= q_len ({q_len}): the chunk's tokens are keys too")
    prefix = kv_len - q_len
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    return j <= prefix + i


def _bug_prefix_is_kv_len(q_len: int, kv_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    # Known bug: prefix length taken as kv_len instead of kv_len - q_len.
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    return j <= kv_len + i


def _bug_no_causal_with_prefix(q_len: int, kv_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    # Known bug: causal masking switched off whenever a cached prefix exists.
    if kv_len > q_len:
        return torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    return causal_visibility(q_len, kv_len, device)


# Masks of the public V100 paged-attention trap; a correct check must fail them.
KNOWN_BUG_MASKS: dict[str, MaskFn] = {
    "prefix_len=kv_len": _bug_prefix_is_kv_len,
    "causal_off_with_prefix": _bug_no_causal_with_prefix,
}


# --------------------------------------------------------------------------------------------
# Dense math
# --------------------------------------------------------------------------------------------
def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    sm_scale: float) -> torch.Tensor:
    """Softmax attention of one sequence in the dtype of its inputs.

    q ``[q_len, heads, dim]``, k/v ``[kv_len, heads_kv, dim]`` (GQA: query head h reads KV head
    ``h // (heads // heads_kv)``), visible bool ``[q_len, kv_len]``. Returns ``[q_len, heads, dim]``;
    rows with no visible key are 0.
    """
    heads, heads_kv = q.shape[1], k.shape[1]
    if heads % heads_kv:
        raise ValueError(f"heads ({heads}) must be a multiple of heads_kv ({heads_kv})")
    group = heads // heads_kv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    any_visible = visible.any(dim=1)  # [q_len]
    # softmax of an all -inf row is NaN; replace those rows' logits first, zero them after.
    scores = torch.where(any_visible[None, :, None], scores, torch.zeros((), dtype=scores.dtype, device=scores.device))
    probs = torch.softmax(scores, dim=-1)
    probs = probs * any_visible[None, :, None].to(probs.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


def gather_sequence_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table_row: torch.Tensor,
                       kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``kv_len`` keys/values of one sequence as dense ``[kv_len, heads_kv, dim]``."""
    page_size = k_cache.shape[1]
    pages = math.ceil(kv_len / page_size)
    if pages > block_table_row.numel():
        raise ValueError(f"kv_len {kv_len} needs {pages} pages but the block-table row has {block_table_row.numel()}")
    phys = block_table_row[:pages].long()
    k = k_cache[phys].reshape(pages * page_size, *k_cache.shape[2:])[:kv_len]
    v = v_cache[phys].reshape(pages * page_size, *v_cache.shape[2:])[:kv_len]
    return k, v


def reference_paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor,
                            sm_scale: float | None = None, *, compute_dtype: torch.dtype = torch.float64,
                            mask_fn: MaskFn = causal_visibility) -> torch.Tensor:
    """Dense reference: per sequence, gather its pages, run masked softmax attention.

    Computes in ``compute_dtype`` (FP64 by default) and returns that dtype,
    ``[total_q, heads, dim]``. ``mask_fn`` exists so tests can evaluate known-bug masks.
    """
    dim = q.shape[-1]
    scale = 1.0 / math.sqrt(dim) if sm_scale is None else float(sm_scale)
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    lens = [int(x) for x in kv_lens.tolist()]
    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    for b, kv_len in enumerate(lens):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0:
            continue
        k, v = gather_sequence_kv(k_cache, v_cache, block_table[b], kv_len)
        visible = mask_fn(q1 - q0, kv_len, q.device)
        out[q0:q1] = dense_attention(q[q0:q1].to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype),
                                     visible, scale)
    return out


def causal_flops(q_lens: Sequence[int], kv_lens: Sequence[int], heads: int, dim: int) -> int:
    """FLOPs of causal prefill: 4 * sum over queries of visible keys * dim * heads (QK^T and PV)."""
    total = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        prefix = kv_len - q_len
        # query i sees prefix + i + 1 keys
        total += q_len * (prefix + 1) + q_len * (q_len - 1) // 2
    return 4 * total * dim * heads


# --------------------------------------------------------------------------------------------
# Test cases
# --------------------------------------------------------------------------------------------
@dataclass
class PagedPrefillCase:
    """One ragged batch in a shuffled paged cache (inputs only; the reference computes the rest)."""

    name: str
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    kv_lens: torch.Tensor
    q_lens: list[int]
    prefix_lens: list[int]
    poisoned: bool
    # what the tensors' shapes fix: block_table is [batch, width], the caches [num_pages, page_size, heads_kv, dim]
    batch: int = field(init=False, repr=False)
    width: int = field(init=False, repr=False)
    num_pages: int = field(init=False, repr=False)
    page_size: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.batch, self.width = map(int, self.block_table.shape)
        self.num_pages, self.page_size = map(int, self.k_cache.shape[:2])

    @property
    def max_seqlen_q(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def shape_triple(self) -> tuple[int, int, int]:
        """(batch, physical pages, block-table width): the kernel's runtime dimensions."""
        return (self.batch, self.num_pages, self.width)

    def to(self, device: torch.device | str) -> "PagedPrefillCase":
        moved = {f: getattr(self, f).to(device) for f in
                 ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "kv_lens")}
        return PagedPrefillCase(name=self.name, q_lens=list(self.q_lens), prefix_lens=list(self.prefix_lens),
                                poisoned=self.poisoned, **moved)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "batch": self.batch,
            "num_pages": self.num_pages,
            "block_table_width": self.width,
            "page_size": self.page_size,
            "q_lens": list(self.q_lens),
            "prefix_lens": list(self.prefix_lens),
            "kv_lens": [p + q for p, q in zip(self.prefix_lens, self.q_lens)],
            "total_q": int(self.q.shape[0]),
            "heads": int(self.q.shape[1]),
            "heads_kv": int(self.k_cache.shape[2]),
            "dim": int(self.q.shape[2]),
            "unused_cache_slots_are_nan": self.poisoned,
        }


def make_case(name: str, q_lens: Sequence[int], prefix_lens: Sequence[int], *, heads: int = 16,
              heads_kv: int = 4, dim: int = 256, page_size: int = 16, spare_pages: int = 0,
              extra_width: int = 0, seed: int = 0, poison: bool = True,
              dtype: torch.dtype = torch.float16) -> PagedPrefillCase:
    """Build one case on the CPU.

    Physical pages come from ``torch.randperm`` over the whole cache, so logical pages are
    scattered and out of order. Inputs are ``randn``. With ``poison`` every cache slot that no
    sequence may read (spare pages, the padding page that unused block-table entries name, and
    the slots past ``kv_len`` in each sequence's last page) holds NaN, so a kernel that reads
    outside a sequence's keys produces NaN instead of a plausible number.
    """
    if len(q_lens) != len(prefix_lens) or not q_lens:
        raise ValueError("q_lens and prefix_lens must be non-empty and of equal length")
    if any(q < 0 for q in q_lens) or any(p < 0 for p in prefix_lens):
        raise ValueError("lengths must be >= 0")
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    pages_per_seq = [math.ceil(kv / page_size) for kv in kv_lens]
    width = max(1, max(pages_per_seq) + extra_width)
    used = sum(pages_per_seq)
    num_pages = used + spare_pages + 1  # + 1: the page that padding table entries point at
    gen = torch.Generator().manual_seed(seed)

    perm = torch.randperm(num_pages, generator=gen)
    pad_page = int(perm[-1])
    block_table = torch.full((len(q_lens), width), pad_page, dtype=torch.int32)
    offset = 0
    for b, n in enumerate(pages_per_seq):
        block_table[b, :n] = perm[offset:offset + n].to(torch.int32)
        offset += n

    shape = (num_pages, page_size, heads_kv, dim)
    k_cache = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    v_cache = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    q = torch.randn((sum(q_lens), heads, dim), generator=gen, dtype=torch.float32).to(dtype)

    if poison:
        readable = torch.zeros(num_pages, page_size, dtype=torch.bool)
        for b, kv in enumerate(kv_lens):
            for p in range(pages_per_seq[b]):
                rows = min(page_size, kv - p * page_size)
                readable[int(block_table[b, p]), :rows] = True
        k_cache[~readable] = float("nan")
        v_cache[~readable] = float("nan")

    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    return PagedPrefillCase(
        name=name, q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, cu_seqlens_q=cu,
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32), q_lens=list(q_lens), prefix_lens=list(prefix_lens),
        poisoned=poison,
    )


def random_case(name: str, batch: int, *, seed: int, max_q: int, max_prefix: int, prefix_probability: float = 0.7,
                **kwargs) -> PagedPrefillCase:
    """Random ragged batch: each sequence has 1..max_q new tokens and, with the given
    probability, a cached prefix of 1..max_prefix tokens. At least one sequence is guaranteed
    to have both a cached prefix and several (>= 2) new tokens, the chunk shape that exposes
    the known prefix/causal bugs."""
    gen = torch.Generator().manual_seed(seed + 7919)
    q_lens = [int(torch.randint(1, max_q + 1, (1,), generator=gen)) for _ in range(batch)]
    prefix_lens = [
        int(torch.randint(1, max_prefix + 1, (1,), generator=gen))
        if float(torch.rand((), generator=gen)) < prefix_probability else 0
        for _ in range(batch)
    ]
    if not any(p > 0 and q >= 2 for p, q in zip(prefix_lens, q_lens)):
        prefix_lens[0] = max(1, max_prefix // 2)
        q_lens[0] = max(2, q_lens[0])
    return make_case(name, q_lens, prefix_lens, seed=seed, **kwargs)


def check_cases(*, heads: int = 16, heads_kv: int = 4, dim: int = 256, page_size: int = 16, seed: int = 0,
                poison: bool = True) -> list[PagedPrefillCase]:
    """The standard cases of app/check_dynamic_paged.py: four (batch, pages, width) triples,
    all different, covering no prefix, cached prefixes with one and with many new tokens,
    lengths that are not multiples of the page or tile sizes, spare pages and padded tables."""
    common = dict(heads=heads, heads_kv=heads_kv, dim=dim, page_size=page_size, poison=poison)
    return [
        make_case("no_prefix", q_lens=[37, 128, 201], prefix_lens=[0, 0, 0], spare_pages=3, seed=seed + 1,
                  **common),
        make_case("cached_prefix_chunks", q_lens=[1, 17, 64, 130, 7, 300], prefix_lens=[5, 16, 100, 333, 1000, 47],
                  spare_pages=11, extra_width=2, seed=seed + 2, **common),
        random_case("random_mixed", batch=9, seed=seed + 3, max_q=260, max_prefix=700, spare_pages=29,
                    extra_width=5, **common),
        make_case("long_prefix_single", q_lens=[333], prefix_lens=[2500], spare_pages=0, seed=seed + 4, **common),
    ]
