"""Stand-ins for sgl-kernel's CUDA norm and activation ops, as ``torch.ops.sgl_kernel.<name>``.

For running stock SGLang 0.5.23's GPU engine without sglang-kernel's compiled ``common_ops``
library: put ``shim/`` on PYTHONPATH and sgl_kernel's loader, finding no compiled library, falls
back to ``import common_ops``, which calls ``register()`` here. sgl_kernel's Python wrappers then
call these unchanged.

The ops are those SGLang 0.5.23's Qwen3.5 path calls on CUDA (``gemma_rmsnorm``,
``gemma_fused_add_rmsnorm``, ``rmsnorm``, ``silu_and_mul``) plus ``fused_add_rmsnorm`` of the same
family, registered with the schemas the compiled library registers (``sgl-kernel/csrc/
common_extension.cc``; the strings are those in sglang-kernel 0.4.10's ``sm90`` and ``sm100``
``common_ops.abi3.so``), for the CUDA and CPU dispatch keys (CPU so tests run without a GPU). Their
arithmetic, and what differs from the kernels, is in ``ops.py``. Importing this package registers
nothing; ``register()`` (or importing the shim) does.

Note: sgl_kernel's ``rmsnorm``/``fused_add_rmsnorm``/``gemma_*`` wrappers call ``flashinfer.norm``
instead of these ops for float16/bfloat16 whenever ``import flashinfer.norm`` succeeds.

Set ``OPENJEV_STANDIN_CALL_LOG=/path/file`` to have each process append ``<pid> <op>`` there on the
first call of each op, so a test can show which stand-ins an engine ran.
"""

from __future__ import annotations

from openjev_testsupport import op_library

from . import ops

NAMESPACE = "sgl_kernel"

SCHEMAS = {
    "rmsnorm": "rmsnorm(Tensor! output, Tensor input, Tensor weight, float eps, bool enable_pdl) -> ()",
    "fused_add_rmsnorm":
        "fused_add_rmsnorm(Tensor! input, Tensor! residual, Tensor weight, float eps, bool enable_pdl) -> ()",
    "gemma_rmsnorm": "gemma_rmsnorm(Tensor! output, Tensor input, Tensor weight, float eps, bool enable_pdl) -> ()",
    "gemma_fused_add_rmsnorm":
        "gemma_fused_add_rmsnorm(Tensor! input, Tensor! residual, Tensor weight, float eps, bool enable_pdl) -> ()",
    "silu_and_mul": "silu_and_mul(Tensor! out, Tensor input) -> ()",
}

DISPATCH_KEYS = ("CUDA", "CPU")

_LIB = None


def register() -> None:
    """Define and implement the ops under torch.ops.sgl_kernel (once per process); refuses, naming the
    ops, when the namespace already holds one of them (the compiled library is loaded)."""
    global _LIB
    if _LIB is None:
        _LIB = op_library.define_ops(NAMESPACE, SCHEMAS, ops, DISPATCH_KEYS, "sgl_kernel_cuda_standin")
