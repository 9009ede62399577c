"""The project's own GPU kernels and their CPU references.

``openjev.paged.dynamic_paged``: TileLang ragged causal prefill over a paged KV cache with batch,
physical page count and block-table width as runtime dimensions (TileLang is imported lazily,
so this package imports on CPU-only machines). ``openjev.paged.reference``: the dense reference and
the test-case generator used by ``app/check_dynamic_paged.py`` and the tests.
"""

from .dynamic_paged import (
    QWEN35_4B_ATTENTION,
    TileConfig,
    compiled_kernel_count,
    dynamic_paged_prefill,
    get_kernel,
    lower_for_arch,
    make_runtime_kernel,
    runtime_paged_prefill,
    tile_config_for_arch,
)
from .reference import (
    KNOWN_BUG_MASKS,
    PagedPrefillCase,
    causal_flops,
    causal_visibility,
    check_cases,
    make_case,
    random_case,
    reference_paged_prefill,
)

__all__ = [
    "QWEN35_4B_ATTENTION",
    "TileConfig",
    "compiled_kernel_count",
    "dynamic_paged_prefill",
    "get_kernel",
    "lower_for_arch",
    "make_runtime_kernel",
    "runtime_paged_prefill",
    "tile_config_for_arch",
    "KNOWN_BUG_MASKS",
    "PagedPrefillCase",
    "causal_flops",
    "causal_visibility",
    "check_cases",
    "make_case",
    "random_case",
    "reference_paged_prefill",
]
