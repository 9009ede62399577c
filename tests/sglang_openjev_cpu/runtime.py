"""Run-time glue for SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`, `--device cpu`).

Which CPU ops (environment, read in every SGLang process):

  OPENJEV_SGL_CPU_OPS=/path/to/common_ops.so   sgl-kernel's CPU ops built from source
                                               (benchmarks/sgl_cpu_ops_build.py)
  OPENJEV_SGL_CPU_OPS=standin                  the project's pure-PyTorch stand-ins, registered under
                                               the same torch.library names and schemas
                                               (openjev_testsupport.sgl_kernel_cpu_standin)
  OPENJEV_SGL_CPU_RECORD=DIR                   with a built library: record real op calls (record.py)
  OPENJEV_SGL_CPU_AMX=0 (default) | 1          0: SGLang's Intel-AMX paths stay off, so every x86
                                               machine runs the same ops (the nine GDN/norm ops; the
                                               linear layers and attention are native torch), with or
                                               without AMX in the processor; 1: SGLang decides (AMX
                                               paths on where the processor has AMX and the library
                                               registers `convert_weight_packed`)

How the ops get in: `import sgl_kernel` (done early by every SGLang process) first tries its CUDA
library, which cannot load without a CUDA driver, then falls back to `import common_ops`
(sgl_kernel/load_utils.py). `configure_environment` puts `ops_shim/` on PYTHONPATH (and the
repository and tests/, for the adapter and this package); its `common_ops` module calls `load_ops()` here.

What SGLang 0.5.23 on CPU needs besides the ops, done here at run time (no installed file is edited):
  * `sglang/kernels/ops/attention/fla/layernorm_gated.py` takes the CPU op `fused_rmsnorm_gated_cpu`
    only when the processor has AMX (`_use_cpu = is_cpu() and cpu_has_amx_support()`), else Triton,
    which fails without a GPU: its `_use_cpu` is set to `is_cpu()`.
  * `sglang/srt/models/qwen3_5.py` calls `fused_sigmoid_mul_cpu(x, gate)`; the kernel's schema (the
    sgl-kernel revision the stand-ins were checked against) has a third argument, `bool inplace`,
    without a default: the module's `_fused_sigmoid_mul_cpu` becomes a call with `inplace=True` (the 0.5.23 caller relies on
    the in-place update), only when the registered schema has that argument.
  * The AMX switch above: `torch.cpu._is_amx_tile_supported` answers False before SGLang reads it.
  * `sgl_kernel/mamba.py` calls `causal_conv1d_fwd_cpu` / `causal_conv1d_update_cpu` with
    `is_vnni=True` always, but SGLang packs the conv weights into that layout only on its AMX path
    (`amx_process_weight_after_loading`); unpacked weights read as packed give wrong convolutions
    (max error 8.7 on a random bf16 case, 0.028 with is_vnni=False): while the weights are unpacked
    (no AMX path), the two ops are called with `is_vnni=False` (the kernel then packs per call).
  * `causal_conv1d_fwd_cpu` with `query_start_loc` (SGLang always passes it) ignores the conv
    history of rows with `has_initial_state` (the second chunk of a chunked prefill, a radix-cache
    continuation): those rows get their history columns put in front (`_conv_fwd_with_history`).
  * SGLang lays the GDN conv-state pool out for the CPU kernels (strides (.., 1, dim),
    `amx_utils._init_amx_conv_state`) only on its AMX path; otherwise the kernel re-strides the
    slot view it is given in place on every call, scrambling the stored history: `MambaPool` gets
    that layout on the non-AMX path too.
  * The multimodal processor for the adapter's architecture comes from the launcher on every device
    (`sglang_openjev.mm_processors`); the checkpoint needs the processor configs
    (preprocessor_config.json, ...) as the base model has.
  * `--max-mamba-cache-size` and the other CPU defaults: serve.py.

`install()` runs in every process: serve.py calls it at import of the `__main__` module, which
multiprocessing's spawn start method (SGLang's) imports again as `__mp_main__` in each child
before anything else. It patches modules already imported and, through an import hook, the
others right after they execute. Each process logs one line saying what it did.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable, MutableMapping, Optional

OPS_ENV = "OPENJEV_SGL_CPU_OPS"
AMX_ENV = "OPENJEV_SGL_CPU_AMX"
STANDIN = "standin"
STANDIN_MODULE = "openjev_testsupport.sgl_kernel_cpu_standin"
SHIM_DIR = Path(__file__).resolve().with_name("ops_shim")
SUPPORT_ROOT = Path(__file__).resolve().parents[1]  # tests/: this package and openjev_testsupport
REPO_ROOT = SUPPORT_ROOT.parent  # the library and the adapter

LAYERNORM_GATED = "sglang.kernels.ops.attention.fla.layernorm_gated"
QWEN3_5 = "sglang.srt.models.qwen3_5"
SGL_UTILS_COMMON = "sglang.srt.utils.common"
MEMORY_POOL = "sglang.srt.mem_cache.memory_pool"
CONV_OPS = ("causal_conv1d_fwd_cpu", "causal_conv1d_update_cpu")



def _say(msg: str) -> None:
    """One stderr line per event (SGLang's logging setup differs between its processes)."""
    print(f"openjev cpu runtime (pid {os.getpid()}): {msg}", file=sys.stderr, flush=True)


class CpuRuntimeError(Exception):
    """A refusal the operator can act on (one line)."""


# ------------------------------------------------------------------ configuration
def ops_choice(environ: MutableMapping[str, str] = os.environ) -> tuple[str, Optional[Path]]:
    """("library", path) or ("standin", None), from OPENJEV_SGL_CPU_OPS; refuses anything else."""
    value = environ.get(OPS_ENV, "").strip()
    if not value:
        raise CpuRuntimeError(
            f"{OPS_ENV} is not set: SGLang's CPU engine needs sgl-kernel's CPU ops; set it to the path of a "
            f"built common_ops.so (benchmarks/sgl_cpu_ops_build.py) or to '{STANDIN}' for the pure-PyTorch stand-ins")
    if value == STANDIN:
        return STANDIN, None
    path = Path(value).expanduser()
    if not path.is_file():
        raise CpuRuntimeError(f"{OPS_ENV}={value}: no such file (expected a built common_ops.so, or '{STANDIN}')")
    return "library", path.resolve()


def amx_enabled(environ: MutableMapping[str, str] = os.environ) -> bool:
    value = environ.get(AMX_ENV, "0").strip()
    if value not in ("0", "1"):
        raise CpuRuntimeError(f"{AMX_ENV}={value!r}: expected 0 (SGLang's AMX paths off) or 1 (SGLang decides)")
    return value == "1"


def configure_environment(environ: MutableMapping[str, str]) -> None:
    """Validate the choice and set what SGLang's processes inherit (call before SGLang starts)."""
    ops_choice(environ)
    amx_enabled(environ)
    environ["SGLANG_USE_CPU_ENGINE"] = "1"
    environ.setdefault(AMX_ENV, "0")
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for entry in (str(REPO_ROOT), str(SUPPORT_ROOT), str(SHIM_DIR)):
        if entry not in parts:
            parts.insert(0, entry)
    environ["PYTHONPATH"] = os.pathsep.join(parts)


# ------------------------------------------------------------------ the ops
_loaded: Optional[str] = None


def load_ops() -> str:
    """Register the chosen CPU ops under torch.ops.sgl_kernel (once per process); returns what."""
    global _loaded
    if _loaded is not None:
        return _loaded
    kind, path = ops_choice(os.environ)
    import torch

    if kind == STANDIN:
        importlib.import_module(STANDIN_MODULE)
        _loaded = f"stand-ins ({STANDIN_MODULE})"
    else:
        torch.ops.load_library(str(path))
        _loaded = f"library {path}"
        if os.environ.get("OPENJEV_SGL_CPU_RECORD"):
            from sglang_openjev_cpu import record

            record.install()  # before SGLang's modules bind the ops (see record.py)
    _install_conv_layout_fix(torch)
    _say(f"CPU ops loaded: {_loaded}")
    return _loaded


class _ConvFix:
    """torch.ops.sgl_kernel.<conv op> as SGLang calls it, with two corrections (see the module docstring):
    is_vnni=False while SGLang left the conv weights unpacked, and (causal_conv1d_fwd_cpu) the
    conv history of rows that continue a cached or chunked prefix put in front of their tokens."""

    def __init__(self, packet, name: str):
        self._packet, self._name = packet, name

    def __getattr__(self, item):
        return getattr(self._packet, item)

    def __call__(self, *args):
        if args and args[-1] is True and not _conv_weights_packed():
            args = (*args[:-1], False)
        if self._name == "causal_conv1d_fwd_cpu":
            return _conv_fwd_with_history(self._packet, *args)
        return self._packet(*args)


def _conv_fwd_with_history(op, x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                           silu_activation, pad_slot_id, is_vnni):
    """The varlen kernel path (query_start_loc given) does not read conv_states for rows with
    has_initial_state (it convolves their first tokens against zeros); the final states it writes are
    right. So each such row gets its width-1 history columns (conv_states[slot], oldest first) in
    front of its tokens, the kernel runs with has_initial_state all False, and those columns'
    outputs are dropped. The state it then writes (the row's last width-1 inputs) is the same."""
    import torch

    if (query_start_loc is None or has_initial_state is None or conv_states is None or cache_indices is None
            or not bool(has_initial_state.any())):
        return op(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                  silu_activation, pad_slot_id, is_vnni)
    starts = query_start_loc.tolist()
    hist_rows = has_initial_state.tolist()
    slots = cache_indices.tolist()
    xt = x.t()  # [tokens, dim]
    pieces, qsl, keep, pos = [], [0], [], 0
    for r in range(len(starts) - 1):
        s, e = starts[r], starts[r + 1]
        if hist_rows[r] and slots[r] != pad_slot_id:
            hist = conv_states[slots[r]].t().to(xt.dtype)  # [width-1, dim]
            pieces.append(hist)
            pos += hist.shape[0]
        pieces.append(xt[s:e])
        keep.extend(range(pos, pos + e - s))
        pos += e - s
        qsl.append(pos)
    x_ext = torch.cat(pieces).contiguous().t()  # [dim, tokens'], the kernel's "transposed" layout
    out = op(x_ext, weight, bias, conv_states, torch.tensor(qsl, dtype=query_start_loc.dtype), cache_indices,
             torch.zeros_like(has_initial_state), silu_activation, pad_slot_id, is_vnni)
    return out.t()[torch.tensor(keep)].t()


_packed: Optional[bool] = None


def _conv_weights_packed() -> bool:
    global _packed
    if _packed is None:
        from sglang.srt.utils.common import cpu_has_amx_support

        _packed = bool(cpu_has_amx_support())
    return _packed


def _install_conv_layout_fix(torch) -> None:
    ns = torch.ops.sgl_kernel
    for name in CONV_OPS:
        setattr(ns, name, _ConvFix(getattr(ns, name), name))
    applied.append("causal_conv1d_*_cpu: is_vnni=False while the conv weights are unpacked; "
                   "varlen conv rows continue their conv history")


# ------------------------------------------------------------------ patches
def _is_cpu_engine() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def _patch_layernorm_gated(module) -> Optional[str]:
    if _is_cpu_engine() and getattr(module, "_use_cpu", None) is False:
        module._use_cpu = True
        return "layernorm_gated._use_cpu=True"
    return None


def _sigmoid_mul_with_inplace(op) -> Callable:
    def fused_sigmoid_mul_cpu(x, gate):
        return op(x, gate, True)

    fused_sigmoid_mul_cpu.openjev_wraps = op
    return fused_sigmoid_mul_cpu


def _patch_qwen3_5(module) -> Optional[str]:
    current = getattr(module, "_fused_sigmoid_mul_cpu", None)
    if current is None or hasattr(current, "openjev_wraps"):
        return None
    import torch

    schema = torch.ops.sgl_kernel.fused_sigmoid_mul_cpu.default._schema
    names = [a.name for a in schema.arguments]
    if len(names) == 3 and names[2] == "inplace" and not schema.arguments[2].has_default_value():
        module._fused_sigmoid_mul_cpu = _sigmoid_mul_with_inplace(current)
        return "qwen3_5._fused_sigmoid_mul_cpu(x, gate) -> (x, gate, inplace=True)"
    return None


def _before_qwen3_5() -> None:
    # qwen3_5.py reads torch.ops.sgl_kernel.fused_sigmoid_mul_cpu at import: the ops must be there.
    importlib.import_module("sgl_kernel")


def _patch_utils_common(module) -> Optional[str]:
    if not amx_enabled(os.environ) and getattr(module, "is_amx_tile_supported", False):
        module.is_amx_tile_supported = False
        return "utils.common.is_amx_tile_supported=False (imported before install)"
    return None


def _patch_memory_pool(module) -> Optional[str]:
    pool_cls = getattr(module, "MambaPool", None)
    if pool_cls is None or hasattr(pool_cls.__init__, "openjev_wraps") or not _is_cpu_engine():
        return None
    original = pool_cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not getattr(module, "_cpu_has_amx_support", False):
            from sglang.srt.layers.amx_utils import _init_amx_conv_state

            conv = getattr(getattr(self, "mamba_cache", None), "conv", None)
            if conv is not None:
                _init_amx_conv_state(conv)  # in place: same tensors, the kernel's strides (.., 1, dim)

    __init__.openjev_wraps = original
    pool_cls.__init__ = __init__
    return "MambaPool conv states laid out for the CPU conv kernels on the non-AMX path too"


# module name -> (before exec, after exec)
PATCHES: dict[str, tuple[Optional[Callable[[], None]], Callable]] = {
    SGL_UTILS_COMMON: (None, _patch_utils_common),
    LAYERNORM_GATED: (None, _patch_layernorm_gated),
    QWEN3_5: (_before_qwen3_5, _patch_qwen3_5),
    MEMORY_POOL: (None, _patch_memory_pool),
}
applied: list[str] = []


def _apply(name: str, module) -> None:
    note = PATCHES[name][1](module)
    if note:
        applied.append(note)
        _say(note)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, name: str, inner):
        self._name, self._inner = name, inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        before = PATCHES[self._name][0]
        if before is not None:
            before()
        self._inner.exec_module(module)
        _apply(self._name, module)

    def __getattr__(self, item):  # get_code, get_source, is_package ... as the real loader
        return getattr(self._inner, item)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Patches the modules of PATCHES as they load, and gives sgl_kernel's fallback `import
    common_ops` the ops shim (ops_shim/common_ops.py) where no other `common_ops` is found."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "common_ops":
            for finder in sys.meta_path:
                spec = finder.find_spec(fullname, path, target) if finder is not self and hasattr(finder, "find_spec") else None
                if spec is not None:
                    return spec
            return importlib.util.spec_from_file_location("common_ops", SHIM_DIR / "common_ops.py")
        if fullname not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(fullname, spec.loader)
                return spec
        return None


_installed = False


def install() -> list[str]:
    """Apply the CPU-engine patches in this process (idempotent); returns what was applied so far."""
    global _installed
    if _installed:
        return applied
    _installed = True
    ops_choice(os.environ)  # refuse early, in the process that reads the environment
    if not amx_enabled(os.environ):
        import torch

        torch.cpu._is_amx_tile_supported = lambda: False
        applied.append("torch.cpu._is_amx_tile_supported=False")
    sys.meta_path.insert(0, _PatchingFinder())
    for name in PATCHES:
        if name in sys.modules:
            _apply(name, sys.modules[name])
    _say(f"installed; ops {os.environ.get(OPS_ENV)}; SGLang's AMX paths "
         f"{'as SGLang decides' if amx_enabled(os.environ) else 'off'}; applied: {', '.join(applied) or 'none yet'}")
    return applied
