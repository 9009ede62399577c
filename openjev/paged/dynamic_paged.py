"""Ragged causal prefill over a paged KV cache, as one TileLang kernel with runtime shapes.

Every request in a batch is one prefill chunk: its ``q_len`` new tokens sit at the end of its
``kv_len`` keys, the first ``prefix_len = kv_len - q_len`` of which may already be cached. Keys
live in a paged cache ``[num_pages, page_size, heads_kv, dim]``; ``block_table[b, p]`` names the
physical page that holds logical page ``p`` of sequence ``b``. The causal mask is aligned
bottom-right: key ``j`` is visible to query ``i`` of the chunk iff ``j <= prefix_len + i``.

Compile-time (factory) parameters: heads, heads_kv, head dim, page size and the tile
configuration. Runtime dimensions (``T.dynamic``): batch, physical page count, block-table
width and total query tokens, so one compiled kernel serves every batch the scheduler forms.
The tile configuration depends only on the GPU architecture, never on those sizes.

Importing this module needs neither TileLang nor CUDA: TileLang is imported inside the
functions that build or run the kernel, so CPU-only tooling can import the package.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# refer to closure variables (the T.dynamic sizes), at decoration time.
import math
import threading
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = [
    "QWEN35_4B_ATTENTION",
    "TileConfig",
    "PASS_CONFIG_NAMES",
    "tile_config_for_arch",
    "get_kernel",
    "compiled_kernel_count",
    "dynamic_paged_prefill",
    "runtime_paged_prefill",
    "make_runtime_kernel",
    "RuntimePagedKernel",
    "lower_for_arch",
    "validate_inputs",
]

# Qwen3.5-4B full-attention layers: 16 query heads, 4 KV heads (GQA 4), head dim 256.
QWEN35_4B_ATTENTION = {"heads": 16, "heads_kv": 4, "dim": 256}

# Pass configuration shared by every target: no TMA lowering and no warp specialization
# (SM70 has neither; the paged row gather cannot use TMA descriptors anyway), and no
# fast-math so exp2 stays IEEE on every architecture.
PASS_CONFIG_NAMES = {
    "TL_DISABLE_TMA_LOWER": True,
    "TL_DISABLE_WARP_SPECIALIZED": True,
    "TL_ENABLE_FAST_MATH": False,
}

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class TileConfig:
    """Tiling of one CTA: block_M query rows of one head against block_N keys per step."""

    block_M: int
    block_N: int
    threads: int
    num_stages: int

    def shared_memory_bytes(self, dim: int) -> int:
        # Q tile + one K and one V tile + the fp16 probability tile (TileLang's one-stage
        # pipeline reuses the single K/V buffers).
        return 2 * (self.block_M * dim + 2 * self.block_N * dim + self.block_M * self.block_N)


# SM70 (V100): 96 KiB of shared memory per CTA, Volta mma.sync m16n16k4 through TileLang's
# mma_sm70 path, no cp.async, so no software pipelining. 64x32 tiles at head dim 256 use
# 68 KiB. This is the runtime's own D256 tiling (block_M=64, block_N=32, 256 threads).
_SM70_CONFIG = TileConfig(block_M=64, block_N=32, threads=256, num_stages=0)
# SM80 and newer (checking and benchmarking on A100/H100/H200): larger tiles, and a one-stage
# software pipeline that issues the next K/V page copies as cp.async while the current tile
# computes (TileLang 0.1.15 cannot emit the cp.async wait counts of deeper pipelines over a
# runtime trip count). 128x64 tiles at head dim 256 use 144 KiB of shared memory.
_SM80_PLUS_CONFIG = TileConfig(block_M=128, block_N=64, threads=256, num_stages=1)


def tile_config_for_arch(arch: int | str) -> TileConfig:
    """Tile configuration for a compute capability given as 70, "70", "sm_70" or "9.0"."""
    cc = _parse_arch(arch)
    if cc < 70:
        raise ValueError(f"sm_{cc} is not supported: the kernel needs tensor cores (sm_70 or newer)")
    return _SM70_CONFIG if cc < 80 else _SM80_PLUS_CONFIG


def _parse_arch(arch: int | str) -> int:
    if isinstance(arch, int):
        return arch
    text = str(arch).strip().lower().removeprefix("sm_").removeprefix("sm")
    if "." in text:
        major, minor = text.split(".", 1)
        return int(major) * 10 + int(minor)
    return int(text)


# --------------------------------------------------------------------------------------------
# Kernel factory (TileLang imported lazily)
# --------------------------------------------------------------------------------------------
_FACTORY = None
_FACTORY_LOCK = threading.Lock()


def _pass_configs() -> dict:
    import tilelang

    configs = {}
    for name, value in PASS_CONFIG_NAMES.items():
        key = getattr(tilelang.PassConfigKey, name, None)
        if key is not None:
            configs[key] = value
    return configs


def _build_factory():
    """Create the ``@tilelang.jit`` factory once per process.

    The decorator's own kernel cache is keyed on the factory arguments only (heads, heads_kv,
    dim, page_size and the tile configuration). Batch, page count, block-table width and
    total query tokens are ``T.dynamic`` and bind from the tensors at call time, so they
    never reach the cache key and never cause a recompile.
    """
    import tilelang
    import tilelang.language as T

    @tilelang.jit(pass_configs=_pass_configs())
    def paged_prefill(heads, heads_kv, dim, page_size, block_M, block_N, threads, num_stages):
        if heads % heads_kv:
            raise ValueError(f"heads ({heads}) must be a multiple of heads_kv ({heads_kv})")
        if block_N % page_size and page_size % block_N:
            raise ValueError(f"page_size ({page_size}) and block_N ({block_N}) must divide one another")
        groups = heads // heads_kv
        rows_per_copy = min(block_N, page_size)  # a key tile is copied page by page
        copies_per_tile = block_N // rows_per_copy
        dynamic = getattr(T, "dynamic", None) or T.symbolic  # T.symbolic before TileLang 0.1.15
        batch = dynamic("batch")
        num_pages = dynamic("num_pages")
        width = dynamic("width")
        total_q = dynamic("total_q")
        dtype = T.float16
        accum = T.float32

        @T.macro
        def load_full_tile(cache, tile, block_table, bz, kv_head, kb):
            # Every row of this tile is < kv_len: plain (cp.async-able) page copies.
            for c in T.serial(copies_per_tile):
                t0 = kb * block_N + c * rows_per_copy
                page = block_table[bz, t0 // page_size]
                T.copy(
                    cache[page, t0 % page_size:t0 % page_size + rows_per_copy, kv_head, :],
                    tile[c * rows_per_copy:(c + 1) * rows_per_copy, :],
                )

        @T.macro
        def load_tail_tile(cache, tile, block_table, bz, kv_head, kv_len, kb):
            # The last tile may run past kv_len: rows there are zero and their page index is
            # clamped, so neither the block table nor the cache is read past the sequence.
            for j, d in T.Parallel(block_N, dim):
                pos = T.min(kb * block_N + j, kv_len - 1)
                tile[j, d] = T.if_then_else(
                    kb * block_N + j < kv_len,
                    cache[block_table[bz, pos // page_size], pos % page_size, kv_head, d],
                    T.cast(0, dtype),
                )

        @T.macro
        def scores_and_softmax(Q_shared, K_shared, P_shared, acc_s, acc_o, m_i, m_prev, alpha, row_sum, l_i,
                               kb, row0, prefix_len, kv_len, scale_log2):
            T.clear(acc_s)
            T.gemm(Q_shared, K_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(block_M, block_N):
                acc_s[i, j] = T.if_then_else(
                    (kb * block_N + j <= prefix_len + row0 + i) & (kb * block_N + j < kv_len),
                    acc_s[i, j],
                    -T.infinity(accum),
                )
            T.copy(m_i, m_prev)
            T.reduce_max(acc_s, m_i, dim=1, clear=False)
            for i in T.Parallel(block_M):
                # A row with no visible key so far keeps m = -inf and rescales by 1.
                alpha[i] = T.if_then_else(
                    m_i[i] == -T.infinity(accum), T.cast(1, accum), T.exp2((m_prev[i] - m_i[i]) * scale_log2)
                )
            for i, j in T.Parallel(block_M, block_N):
                acc_s[i, j] = T.if_then_else(
                    acc_s[i, j] == -T.infinity(accum), T.cast(0, accum), T.exp2((acc_s[i, j] - m_i[i]) * scale_log2)
                )
            T.reduce_sum(acc_s, row_sum, dim=1)
            for i in T.Parallel(block_M):
                l_i[i] = l_i[i] * alpha[i] + row_sum[i]
            for i, d in T.Parallel(block_M, dim):
                acc_o[i, d] *= alpha[i]
            T.copy(acc_s, P_shared)

        @T.prim_func
        def main(
            Q: T.Tensor([total_q, heads, dim], dtype),
            K_cache: T.Tensor([num_pages, page_size, heads_kv, dim], dtype),
            V_cache: T.Tensor([num_pages, page_size, heads_kv, dim], dtype),
            block_table: T.Tensor([batch, width], T.int32),
            cu_seqlens_q: T.Tensor([batch + 1], T.int32),
            kv_lens: T.Tensor([batch], T.int32),
            Output: T.Tensor([total_q, heads, dim], dtype),
            max_seqlen_q: T.int32,
            sm_scale: T.float32,
        ):
            with T.Kernel(T.ceildiv(max_seqlen_q, block_M), heads, batch, threads=threads) as (bx, by, bz):
                Q_shared = T.alloc_shared([block_M, dim], dtype)
                K_shared = T.alloc_shared([block_N, dim], dtype)
                V_shared = T.alloc_shared([block_N, dim], dtype)
                P_shared = T.alloc_shared([block_M, block_N], dtype)
                acc_s = T.alloc_fragment([block_M, block_N], accum)
                acc_o = T.alloc_fragment([block_M, dim], accum)
                m_i = T.alloc_fragment([block_M], accum)
                m_prev = T.alloc_fragment([block_M], accum)
                alpha = T.alloc_fragment([block_M], accum)
                row_sum = T.alloc_fragment([block_M], accum)
                l_i = T.alloc_fragment([block_M], accum)

                q_start = cu_seqlens_q[bz]
                q_len = cu_seqlens_q[bz + 1] - q_start
                kv_len = kv_lens[bz]
                prefix_len = kv_len - q_len  # bottom-right alignment: the chunk ends the sequence
                kv_head = by // groups
                row0 = bx * block_M  # first query row of this tile, relative to the chunk
                scale_log2 = sm_scale * _LOG2E

                if row0 < q_len:
                    for i, d in T.Parallel(block_M, dim):
                        Q_shared[i, d] = T.if_then_else(row0 + i < q_len, Q[q_start + row0 + i, by, d], T.cast(0, dtype))
                    T.fill(acc_o, 0)
                    T.fill(l_i, 0)
                    T.fill(m_i, -T.infinity(accum))

                    # Keys after the last key visible to the tile's last real row are never read.
                    kv_end = T.min(kv_len, prefix_len + T.min(q_len, row0 + block_M))
                    full_tiles = kv_end // block_N
                    for kb in T.Pipelined(full_tiles, num_stages=num_stages):
                        load_full_tile(K_cache, K_shared, block_table, bz, kv_head, kb)
                        scores_and_softmax(Q_shared, K_shared, P_shared, acc_s, acc_o, m_i, m_prev, alpha, row_sum,
                                           l_i, kb, row0, prefix_len, kv_len, scale_log2)
                        load_full_tile(V_cache, V_shared, block_table, bz, kv_head, kb)
                        T.gemm(P_shared, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)
                    if full_tiles * block_N < kv_end:
                        load_tail_tile(K_cache, K_shared, block_table, bz, kv_head, kv_len, full_tiles)
                        scores_and_softmax(Q_shared, K_shared, P_shared, acc_s, acc_o, m_i, m_prev, alpha, row_sum,
                                           l_i, full_tiles, row0, prefix_len, kv_len, scale_log2)
                        load_tail_tile(V_cache, V_shared, block_table, bz, kv_head, kv_len, full_tiles)
                        T.gemm(P_shared, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)

                    # Fully masked rows (none under bottom-right alignment) are defined as 0.
                    for i, d in T.Parallel(block_M, dim):
                        if row0 + i < q_len:
                            Output[q_start + row0 + i, by, d] = T.if_then_else(
                                l_i[i] > 0, T.cast(acc_o[i, d] / l_i[i], dtype), T.cast(0, dtype)
                            )

        return main

    return paged_prefill


def _factory():
    global _FACTORY
    with _FACTORY_LOCK:
        if _FACTORY is None:
            _FACTORY = _build_factory()
        return _FACTORY


def _factory_args(heads: int, heads_kv: int, dim: int, page_size: int, config: TileConfig) -> dict:
    return dict(heads=int(heads), heads_kv=int(heads_kv), dim=int(dim), page_size=int(page_size), **asdict(config))


def get_kernel(heads: int, heads_kv: int, dim: int, page_size: int, config: TileConfig | None = None,
               device: torch.device | int | None = None):
    """The compiled kernel object for these compile-time parameters (compiled on first use).

    The tile configuration defaults to the one for the current CUDA device's architecture.
    """
    if config is None:
        major, minor = torch.cuda.get_device_capability(device)
        config = tile_config_for_arch(major * 10 + minor)
    return _factory()(**_factory_args(heads, heads_kv, dim, page_size, config))


def compiled_kernel_count() -> int:
    """Entries in the ``@tilelang.jit`` factory's in-process kernel cache (0 before first use)."""
    if _FACTORY is None:
        return 0
    return len(_FACTORY._kernel_cache)


def kernel_cache_keys() -> list:
    """The factory's cache keys: only compile-time parameters, never batch or page counts."""
    if _FACTORY is None:
        return []
    return list(_FACTORY._kernel_cache.keys())


# --------------------------------------------------------------------------------------------
# Python entry points
# --------------------------------------------------------------------------------------------
def _require_contiguous(dtype: torch.dtype, **tensors: torch.Tensor) -> None:
    """Each tensor, by name, is contiguous and of dtype."""
    for name, t in tensors.items():
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {str(dtype).removeprefix('torch.')}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def validate_inputs(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens) -> None:
    """Shape/dtype/device checks that need no device synchronisation."""
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q, heads, dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_pages, page_size, heads_kv, dim]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    total_q, heads, dim = q.shape
    _, _, heads_kv, kdim = k_cache.shape
    if kdim != dim:
        raise ValueError(f"head dim of q ({dim}) and of the cache ({kdim}) differ")
    if heads % heads_kv:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({heads_kv})")
    _require_contiguous(torch.float16, q=q, k_cache=k_cache, v_cache=v_cache)
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [batch, width], got shape {tuple(block_table.shape)}")
    batch = block_table.shape[0]
    if tuple(cu_seqlens_q.shape) != (batch + 1,):
        raise ValueError(f"cu_seqlens_q must have batch+1 = {batch + 1} entries, got {tuple(cu_seqlens_q.shape)}")
    if tuple(kv_lens.shape) != (batch,):
        raise ValueError(f"kv_lens must have batch = {batch} entries, got {tuple(kv_lens.shape)}")
    _require_contiguous(torch.int32, block_table=block_table, cu_seqlens_q=cu_seqlens_q, kv_lens=kv_lens)
    devices = {t.device for t in (q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")


def dynamic_paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, sm_scale=None,
                          *, max_seqlen_q: int | None = None, out=None, config: TileConfig | None = None):
    """Ragged causal prefill with cached prefixes over a paged KV cache.

    Args:
        q: fp16 ``[total_q, heads, dim]``, the new tokens of every sequence, packed.
        k_cache, v_cache: fp16 ``[num_pages, page_size, heads_kv, dim]``.
        block_table: int32 ``[batch, width]``; entry ``[b, p]`` is the physical page of logical
            page ``p`` of sequence ``b``. Entries past a sequence's last page are never read.
        cu_seqlens_q: int32 ``[batch + 1]``, prefix sums of the query lengths.
        kv_lens: int32 ``[batch]``, total keys per sequence (cached prefix + new tokens), so
            ``prefix_len = kv_len - q_len``; ``kv_len >= q_len`` is required.
        sm_scale: softmax scale, default ``1/sqrt(dim)``.
        max_seqlen_q: longest query chunk; computed from ``cu_seqlens_q`` (one device sync)
            when omitted.
        out: optional fp16 ``[total_q, heads, dim]`` output buffer.

    Returns:
        fp16 ``[total_q, heads, dim]``.
    """
    validate_inputs(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens)
    total_q, heads, dim = q.shape
    heads_kv, page_size = k_cache.shape[2], k_cache.shape[1]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(dim)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if block_table.shape[0] else 0
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous fp16 tensor shaped like q")
    if total_q == 0 or max_seqlen_q == 0:
        return out
    kernel = get_kernel(heads, heads_kv, dim, page_size, config=config, device=q.device)
    kernel(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, out, int(max_seqlen_q), float(sm_scale))
    return out


def runtime_paged_prefill(q, k_cache, v_cache, block_table, cache_seqlens, query_start_loc, prefix_kv_lens,
                          max_tokens, sm_scale, out=None):
    """Integration point for the pinned runtime's TileLang backend (``tilelang_fa_v100``).

    Same arguments, in the same order, as the runtime's compiled static paged kernel
    (``kernel(q, k_cache, v_cache, block_table, cache_seqlens, query_start_loc,
    prefix_kv_lens, max_tokens, sm_scale)``), so ``get_paged_kernel`` can hand this back for
    the causal case (see ``patches/dynamic-paged.patch``). Returns ``[total_q, heads, dim]``.

    * ``prefix_kv_lens`` is accepted for signature compatibility only: the kernel derives every
      prefix as ``cache_seqlens - q_len``. The runtime builds it from ``extend_prefix_lens``,
      which is the same number; deriving it also rules out the known trap of passing
      ``kv_len`` as the prefix, which lets new tokens see later keys.
    * ``max_tokens`` is the runtime's total token count, an upper bound on the longest chunk.
      Outside CUDA-graph capture the longest chunk is read from ``query_start_loc`` (one
      device sync, as the runtime's adapter already does for ``seq_lens``) so the grid is not
      ``batch`` times larger than needed.
    """
    del prefix_kv_lens
    if block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)
    if cache_seqlens.dtype != torch.int32:
        cache_seqlens = cache_seqlens.to(torch.int32)
    if query_start_loc.dtype != torch.int32:
        query_start_loc = query_start_loc.to(torch.int32)
    block_table, cache_seqlens, query_start_loc = (
        block_table.contiguous(), cache_seqlens.contiguous(), query_start_loc.contiguous())
    max_seqlen_q = int(max_tokens)
    if block_table.shape[0] > 1 and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        max_seqlen_q = min(max_seqlen_q, int((query_start_loc[1:] - query_start_loc[:-1]).max().item()))
    return dynamic_paged_prefill(q.contiguous(), k_cache, v_cache, block_table, query_start_loc, cache_seqlens,
                                 sm_scale, max_seqlen_q=max_seqlen_q, out=out)


class RuntimePagedKernel:
    """What the patched ``get_paged_kernel`` returns: a callable with the runtime kernel's
    signature, bound to one (heads, heads_kv, dim, page_size). Compiles on first call; every
    later batch, page count and block-table width reuses that compile."""

    def __init__(self, heads: int, heads_kv: int, dim: int, page_size: int):
        self.heads, self.heads_kv, self.dim, self.page_size = heads, heads_kv, dim, page_size

    def __call__(self, q, k_cache, v_cache, block_table, cache_seqlens, query_start_loc, prefix_kv_lens,
                 max_tokens, sm_scale):
        got = (q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1])
        if got != (self.heads, self.heads_kv, self.dim, self.page_size):
            raise ValueError(f"kernel bound to (heads, heads_kv, dim, page_size)="
                             f"{(self.heads, self.heads_kv, self.dim, self.page_size)} called with {got}")
        return runtime_paged_prefill(q, k_cache, v_cache, block_table, cache_seqlens, query_start_loc,
                                     prefix_kv_lens, max_tokens, sm_scale)

    def __repr__(self) -> str:
        return (f"RuntimePagedKernel(heads={self.heads}, heads_kv={self.heads_kv}, dim={self.dim}, "
                f"page_size={self.page_size})")


_RUNTIME_KERNELS: dict[tuple[int, int, int, int], RuntimePagedKernel] = {}


def make_runtime_kernel(heads: int, heads_kv: int, dim: int, page_size: int) -> RuntimePagedKernel:
    """The runtime integration point: one callable per compile-time key, whatever the batch."""
    key = (int(heads), int(heads_kv), int(dim), int(page_size))
    with _FACTORY_LOCK:
        if key not in _RUNTIME_KERNELS:
            _RUNTIME_KERNELS[key] = RuntimePagedKernel(*key)
        return _RUNTIME_KERNELS[key]


# --------------------------------------------------------------------------------------------
# Code generation for another architecture (no GPU needed)
# --------------------------------------------------------------------------------------------
def lower_for_arch(arch: str = "sm_70", heads: int = 16, heads_kv: int = 4, dim: int = 256, page_size: int = 16,
                   config: TileConfig | None = None) -> dict[str, Any]:
    """Lower the kernel to CUDA C++ for ``arch`` without compiling or running it.

    Returns the kernel source and facts read from it (which MMA instructions it uses, whether
    it contains cp.async / TMA / wgmma). Runs on any machine with TileLang; no GPU needed.
    """
    import tilelang
    from tilelang import tvm
    from tvm.target import Target

    cc = _parse_arch(arch)
    config = config or tile_config_for_arch(cc)
    target = Target({"kind": "cuda", "arch": f"sm_{cc}"})
    tir = _factory().get_tir(**_factory_args(heads, heads_kv, dim, page_size, config))
    with tvm.transform.PassContext(opt_level=3, config=_pass_configs()), target:
        artifact = tilelang.lower(tir, target=target)
    source = artifact.kernel_source
    return {
        "arch": f"sm_{cc}",
        "config": asdict(config),
        "shared_memory_bytes": config.shared_memory_bytes(dim),
        "source": source,
        "source_chars": len(source),
        "uses_sm70_mma": "m16n16k4" in source or "mma_sync_sm70" in source or ".m8n8k4" in source,
        "uses_cp_async": "cp.async" in source or "cp_async" in source,
        "uses_tma": "cp.async.bulk.tensor" in source or "tma_load" in source,
        "uses_wgmma": "wgmma" in source,
    }
