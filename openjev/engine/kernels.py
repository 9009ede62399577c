"""Which kernels the Transformers forward runs, chosen before the model module is imported.

Transformers 5.x picks the Gated DeltaNet kernels of Qwen3.5 once, when its modeling module is
imported (`use_kernel_func_from_hub_with_fallback`): flash-linear-attention's Triton
`chunk_gated_delta_rule` if `import fla` works, else its PyTorch reference loop; the short causal
convolution likewise comes from the `causal_conv1d` package or `F.conv1d`. The model code itself
is never changed here: this module only decides whether the optional GPU packages may be
imported (`select_kernels`), checks that their kernels really run and agree with a float64
recurrence on this GPU first, and afterwards reads back what Transformers actually bound
(`kernel_path`), so receipts and /server_info say which path ran.

OPENJEV_KERNELS=auto (default) uses flash-linear-attention where it imports and its check passes
on a CUDA device; OPENJEV_KERNELS=torch forces Transformers' PyTorch fallback (for comparison).
Every fallback is logged with its reason.

fla's Triton autotuning is pinned (`pin_fla_configs`, OPENJEV_FLA_CONFIGS): one configuration per
kernel for every shape, tuned once per machine and kept in a file every process reads, so
forwards of any shape, and the reference scorer and the server, sum in the same order.

Also here: the FLOP count of a pass (linear layers only) and the fp16 matmul peak measured on
the device, for the receipts' "compute_bound" block.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import sys
import time
from pathlib import Path

from openjev.common import UserError
from openjev.engine.binding import bound_implementation, describe

log = logging.getLogger("openjev.kernels")
PADDED_ATTENTION_ENV = "OPENJEV_PADDED_ATTENTION"  # rowwise (default) | shared | masked (Transformers' masked SDPA)
PREFIX_ATTENTION_ENV = "OPENJEV_PREFIX_ATTENTION"  # whole-row (default) | varlen | varlen-tails | varlen-exact
ATTENTION_STREAMS_ENV = "OPENJEV_ATTENTION_STREAMS"  # CUDA streams the rows' own attention calls are spread over
ATTENTION_STREAMS_DEFAULT = 4  # warm steps about 10 % faster on an H100, the same bits (results_h100/prefix_reuse/README.md)

KERNELS_ENV = "OPENJEV_KERNELS"
KERNEL_MODES = ("auto", "torch")
# optional packages Transformers would bind for Qwen3.5's GDN layers, and their distributions
GDN_PACKAGES = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}
_DECISION: dict = {}


def kernel_mode(mode: str | None = None) -> str:
    mode = mode or os.environ.get(KERNELS_ENV) or "auto"
    if mode not in KERNEL_MODES:
        raise UserError(f"{KERNELS_ENV}={mode!r}: expected one of {', '.join(KERNEL_MODES)}")
    return mode


def _block(packages, reason: str) -> None:
    """Make `import <package>` fail, so Transformers binds its PyTorch fallback."""
    for name in packages:
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]
        sys.modules[name] = None  # importlib raises ModuleNotFoundError for a None entry
    log.warning("GDN kernels: PyTorch fallback (%s)", reason)


def _modeling_already_imported() -> str | None:
    return next((m for m in sys.modules if m.startswith("transformers.models.qwen3_5.modeling")), None)


def naive_gated_delta(q, k, v, g, beta):
    """float64 recurrence of the gated delta rule with q/k L2-normalised (the semantics of
    Transformers' `use_qk_l2norm_in_kernel=True`): [B, T, H, K|V] -> [B, T, H, V]."""
    import torch

    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-6) * q.shape[-1] ** -0.5
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    b, t, h, dk = k.shape
    state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float64, device=q.device)
    out = torch.empty(b, t, h, v.shape[-1], dtype=torch.float64, device=q.device)
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        kv = torch.einsum("bhk,bhkv->bhv", k[:, i], state)
        delta = (v[:, i] - kv) * beta[:, i][..., None]
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, i], delta)
        out[:, i] = torch.einsum("bhk,bhkv->bhv", q[:, i], state)
    return out


def check_fla(device: str, heads: int, dk: int, dv: int, dtype: str = "float16") -> float:
    """Run fla's chunk_gated_delta_rule at the model's head shape (which also warms Triton's
    autotune cache for it) and return its max abs error against the float64 recurrence."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    gen = torch.Generator(device="cpu").manual_seed(0)
    t = 80  # more than one 64-token chunk, not a multiple of 16

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=getattr(torch, dtype))

    q, k, v = rnd(1, t, heads, dk), rnd(1, t, heads, dk), rnd(1, t, heads, dv)
    g = -torch.rand(1, t, heads, generator=gen).to(device) * 0.5
    beta = torch.rand(1, t, heads, generator=gen).to(device=device, dtype=getattr(torch, dtype))
    out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    ref = naive_gated_delta(q, k, v, g, beta)
    err = float((out.double() - ref).abs().max())
    if not err < 2e-2:  # fp16 inputs and outputs; NaN fails too
        raise RuntimeError(f"fla chunk_gated_delta_rule disagrees with the float64 recurrence: max abs error {err}")
    return err


BLAS_WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
BLAS_WORKSPACE = ":0:0"  # no cuBLAS workspace: no split-K, so a GEMM's rows do not depend on its row count


def _default_env(var: str, value: str, key: str, reason: str) -> dict:
    """Set an environment variable read later by torch or Triton, unless the operator set it;
    the record says which value is in force and who chose it."""
    chosen = os.environ.get(var)
    if chosen is not None:
        return {key: chosen, "set_by": "environment"}
    os.environ[var] = value
    return {key: value, "set_by": "openjev", "reason": reason}


def batch_invariant_blas() -> dict:
    """Run cuBLAS without a workspace unless the operator chose CUBLAS_WORKSPACE_CONFIG.

    With a workspace cuBLAS may split K of the MLP's down projection for short rows but not for a
    padded batch, so a row's logits would depend on its batch; without one, padded == exact
    (measured on the H200: docs/embedded_backend.md; results_h200/embedded_gpu/call7-divergence,
    call8-blas). PyTorch reads the variable at its first cuBLAS call, so this runs at import; a
    warning is recorded if CUDA was initialised first."""
    out = _default_env(BLAS_WORKSPACE_ENV, BLAS_WORKSPACE, "cublas_workspace_config",
                       "no split-K: GEMM rows independent of the batch (padded == exact arithmetic)")
    torch = sys.modules.get("torch")
    if out["set_by"] == "openjev" and torch is not None and torch.cuda.is_initialized():
        out["warning"] = "CUDA was initialised before openjev/engine/kernels.py was imported: cuBLAS may already have a workspace"
    return out


_BLAS = batch_invariant_blas()

AUTOTUNE_CACHE_ENV = "TRITON_CACHE_AUTOTUNING"


def shared_autotuning() -> dict:
    """Keep Triton's autotuning choices on disk (TRITON_CACHE_AUTOTUNING=1) unless the operator
    chose otherwise, so every process of this machine runs the same fla kernel configurations.

    fla autotunes by timing and a different choice changes the last bits (measured on the H200:
    docs/embedded_backend.md; results_h200/embedded_gpu/call12-autotune). Triton reads the variable when
    fla defines its kernels, so this runs at import, before fla is."""
    out = _default_env(AUTOTUNE_CACHE_ENV, "1", "triton_cache_autotuning",
                       "fla's autotuned configurations shared by every process (same kernels, same bits)")
    if out["set_by"] == "openjev" and "fla" in sys.modules:
        out["warning"] = "fla was imported before openjev/engine/kernels.py: its autotuners may not cache"
    return out


_AUTOTUNE = shared_autotuning()


# ---------------------------------------------------------------- pinned fla configurations
FLA_CONFIGS_ENV = "OPENJEV_FLA_CONFIGS"
FLA_CONFIGS_KIND = "openjev-fla-configs"
_PINS: dict = {}  # what pin_autotuners did in this process: record, tuners, pinned kernel names


def fla_configs_path(device_name: str, shape: str = "") -> Path | None:
    """Where this machine's pinned fla configurations live: $OPENJEV_FLA_CONFIGS, or None when it
    is "off", else ~/.cache/openjev/fla-configs/GPU-flaVER-tritonVER[-SHAPE].json ($XDG_CACHE_HOME
    respected): one file per GPU model, kernel versions and head shape (`shape`, e.g.
    "h32-k128-v128-float16"), since a configuration is tuned for the dimensions it ran at."""
    chosen = os.environ.get(FLA_CONFIGS_ENV, "")
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen).expanduser()
    from importlib.metadata import PackageNotFoundError, version

    def installed(module: str, dist: str) -> str:
        try:
            return getattr(sys.modules.get(module), "__version__", None) or version(dist)
        except PackageNotFoundError:
            return "none"

    gpu = "".join(c if c.isalnum() else "_" for c in device_name).strip("_") or "gpu"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = (f"{gpu}-fla{installed('fla', 'flash-linear-attention')}-triton{installed('triton', 'triton')}"
            + (f"-{shape}" if shape else ""))
    return base / "openjev" / "fla-configs" / f"{name}.json"


def _autotuners(prefix: str) -> dict:
    """Triton autotuners defined in the modules `prefix` and `prefix.*`, by kernel name."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    found = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        for obj in list(vars(mod).values()):
            while isinstance(obj, KernelInterface) and not isinstance(obj, Autotuner):
                obj = getattr(obj, "fn", None)  # a heuristics wrapper around the autotuner
            if isinstance(obj, Autotuner):
                fn = obj.fn
                while not inspect.isfunction(fn) and hasattr(fn, "fn"):
                    fn = fn.fn
                found[f"{fn.__module__}.{fn.__qualname__}"] = obj
    return found


def _config_dict(c) -> dict:
    return {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages,
            "num_ctas": getattr(c, "num_ctas", 1), "maxnreg": getattr(c, "maxnreg", None)}


def _config(d: dict):
    import triton

    extra = {"maxnreg": d["maxnreg"]} if d.get("maxnreg") is not None else {}
    return triton.Config(dict(d["kwargs"]), num_warps=d["num_warps"], num_stages=d["num_stages"],
                         num_ctas=d.get("num_ctas", 1), **extra)


def _read_pins(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        if data.get("kind") != FLA_CONFIGS_KIND or not isinstance(data.get("kernels"), dict):
            raise ValueError(f"kind {data.get('kind')!r}, expected {FLA_CONFIGS_KIND!r} with a kernels table")
        for d in data["kernels"].values():
            _config(d)  # every entry must make a Triton config
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"{path}: not a pinned fla configuration file ({type(exc).__name__}: {exc}); move it "
                        f"away to tune again, or set {FLA_CONFIGS_ENV}=off") from None
    return data


def pin_autotuners(prefix: str, path: Path, tune, meta: dict) -> dict:
    """One Triton configuration per autotuned kernel of `prefix`, the same for every shape and in
    every process that reads `path`.

    If `path` exists its configurations are used; otherwise `tune()` runs the kernels at one
    shape (Triton autotunes them there, by timing), the configuration each kernel chose is
    written to `path` (atomically, under a lock, so concurrent processes agree on one file) and
    used. Each pinned autotuner is left a single configuration, so Triton no longer tunes it
    for new shapes. Returns the record kept in kernel_path()["fla_configs"]."""
    import hashlib

    from filelock import FileLock

    tuners = _autotuners(prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    tuned_here = False
    with FileLock(path.parent / (path.name + ".lock")):
        if path.exists():
            data = _read_pins(path)
        else:
            for at in tuners.values():
                at.cache.clear()
            t0 = time.perf_counter()
            tune()
            chosen = {name: _config_dict(next(iter(at.cache.values()))) for name, at in sorted(tuners.items())
                      if at.cache}
            data = {"kind": FLA_CONFIGS_KIND, "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "made_by": "openjev/engine/kernels.py pin_autotuners", **meta,
                    "tune_seconds": round(time.perf_counter() - t0, 3), "kernels": chosen}
            tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
            tuned_here = True
            log.info("fla configurations tuned in %.1f s for %d kernels and written to %s",
                     data["tune_seconds"], len(chosen), path)
    pinned = [name for name in tuners if name in data["kernels"]]
    for name in pinned:
        tuners[name].configs = [_config(data["kernels"][name])]
        tuners[name].cache.clear()
    record = {"file": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
              "made_at": data.get("made_at"), "tuned_here": tuned_here, "pinned": len(pinned),
              "autotuners": len(tuners)}
    _PINS.update(record=record, tuners=tuners, pinned=set(pinned))
    if not tuned_here:
        log.info("fla configurations pinned from %s (%d kernels)", path, len(pinned))
    return record


def pins_record() -> dict | None:
    """The pinning record, with the kernels that tuned themselves since (autotuners that were not
    pinned but ran: their configuration may depend on the shape)."""
    if "record" not in _PINS:
        return None
    rec = dict(_PINS["record"])
    pinned = _PINS.get("pinned", set())
    rec["autotuned_unpinned"] = sorted(n for n, at in _PINS["tuners"].items() if n not in pinned and at.cache)
    return rec


def pin_fla_configs(device: str, heads: int, dk: int, dv: int, dtype: str = "float16") -> dict:
    """fla's kernels with one configuration each for every shape (see pin_autotuners).

    Why: fla autotunes per key, and some keys hold the shape; l2norm's is NB =
    ceil(rows x length x heads / 65536), so an exact one-row forward (NB 1) and a padded forward
    of 16 long rows (NB 12) ran different configurations, which sum a row in another order.
    Measured on the H200 (results_h200/embedded_gpu/call15-dp-cuts): the least-padding cuts formed forwards
    of up to 24k tokens and the server's logits left the reference's in every pass (max |dp_e|
    0.00226), also within one process. Tuned once per machine and head shape at [4, 1024, heads,
    dk/dv]."""
    import torch

    path = fla_configs_path(torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
                            f"h{heads}-k{dk}-v{dv}-{dtype}")
    if path is None:
        _PINS.update(record={"requested": "off", "reason": f"{FLA_CONFIGS_ENV}=off: fla autotunes per shape"}, tuners={})
        return _PINS["record"]

    def tune():
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        gen = torch.Generator(device="cpu").manual_seed(0)
        dt = getattr(torch, dtype)

        def rnd(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

        b, t = 4, 1024
        with torch.inference_mode():
            chunk_gated_delta_rule(rnd(b, t, heads, dk), rnd(b, t, heads, dk), rnd(b, t, heads, dv),
                                   g=-torch.rand(b, t, heads, generator=gen).to(device),
                                   beta=torch.rand(b, t, heads, generator=gen).to(device=device, dtype=dt),
                                   use_qk_l2norm_in_kernel=True)
            torch.cuda.synchronize(device)

    import fla
    import triton

    meta = {"device": torch.cuda.get_device_name(device), "fla": getattr(fla, "__version__", None),
            "triton": triton.__version__, "torch": torch.__version__,
            "tuned_on": {"batch": 4, "length": 1024, "heads": heads, "dk": dk, "dv": dv, "dtype": dtype}}
    return pin_autotuners("fla", path, tune, meta)


def configure_backends(device: str) -> dict:
    """PyTorch backend switches for varying sequence lengths on a GPU (the model code is untouched).

    Measured on an H200 (results_h200/embedded_gpu/profile): for every new sequence length cuDNN
    builds a new execution plan for the GDN layers' depthwise causal conv1d (5.7 ms of CPU per
    call, 24 calls a forward) and SDPA's cuDNN attention backend builds a new graph (4.8 ms per
    call, 8 calls), so a forward at an unseen length cost 240 ms instead of 55 ms. With cuDNN off
    the conv runs PyTorch's native depthwise kernel and SDPA picks FlashAttention, neither of which
    plans per shape. OPENJEV_CUDNN=1 keeps cuDNN."""
    import torch

    blas, autotune = dict(_BLAS), dict(_AUTOTUNE)
    if not device.startswith("cuda") or os.environ.get("OPENJEV_CUDNN") == "1":
        return {"cudnn": bool(torch.backends.cudnn.enabled), "changed": False, "blas": blas, "autotune": autotune}
    # SDPA then runs FlashAttention for unpadded rows and the memory-efficient kernel for padded
    # batches (a mask). Forcing memory-efficient for both was measured worse on the H200 (reference
    # 12.7 instead of 17.5 rows/s, padded-vs-exact max |dp_e| 0.0027 instead of 0.0024).
    torch.backends.cudnn.enabled = False
    torch.backends.cuda.enable_cudnn_sdp(False)
    log.info("cuDNN disabled for conv1d and SDPA (per-length plan building); OPENJEV_CUDNN=1 keeps PyTorch's defaults")
    return {"cudnn": False, "changed": True, "blas": blas, "autotune": autotune,
            "reason": "cuDNN plans per new sequence length (conv1d 5.7 ms, SDPA 4.8 ms of CPU per call on an H200)"}


def sdp_backends() -> dict:
    import torch

    b = torch.backends.cuda
    return {"flash": b.flash_sdp_enabled(), "mem_efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(), "math": b.math_sdp_enabled()}


def select_kernels(device: str, config: dict | None = None, mode: str | None = None) -> dict:
    """Decide, before Transformers imports the Qwen3.5 modeling module, whether the optional GDN
    kernel packages may be used; returns (and remembers) the decision with its reason."""
    mode = kernel_mode(mode)
    decision: dict = {"requested": mode, "fla_check_max_abs_error": None, "backends": configure_backends(device)}
    already = _modeling_already_imported()
    if already:  # the binding is made; report what it is instead of pretending to choose
        decision["reason"] = f"{already} was imported before the kernel choice; its binding stands"
    elif mode == "torch":
        decision["reason"] = f"{KERNELS_ENV}=torch asked for the PyTorch fallback"
        _block(GDN_PACKAGES, decision["reason"])
    elif not device.startswith("cuda"):
        decision["reason"] = f"device {device}: the flash-linear-attention kernels are Triton GPU kernels"
        _block(GDN_PACKAGES, decision["reason"])
    else:
        try:
            fla = importlib.import_module("fla")
            text = (config or {}).get("text_config", config or {})
            heads = int(text.get("linear_num_value_heads", 4))
            dk, dv = int(text.get("linear_key_head_dim", 64)), int(text.get("linear_value_head_dim", 64))
            t0 = time.perf_counter()
            decision["fla_check_max_abs_error"] = check_fla(device, heads, dk, dv)
            decision["fla_check_seconds"] = round(time.perf_counter() - t0, 3)
            decision["reason"] = (f"flash-linear-attention {getattr(fla, '__version__', '?')} imported and its "
                                  f"chunk_gated_delta_rule matched a float64 recurrence on {device}")
            log.info("GDN kernels: %s", decision["reason"])
        except Exception as exc:  # noqa: BLE001 - ImportError, Triton refusing the GPU, a wrong result
            decision["reason"] = f"flash-linear-attention unusable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            _block(["fla"], decision["reason"])
        else:
            try:
                pin_fla_configs(device, heads, dk, dv)
            except UserError:
                raise
            except Exception as exc:  # noqa: BLE001 - fla still runs, autotuning per shape as before
                log.warning("fla configurations not pinned (%s: %s): fla autotunes per shape", type(exc).__name__, exc)
                _PINS["record"] = {"error": f"{type(exc).__name__}: {exc}"}
                _PINS["tuners"] = {}
    _DECISION.clear()
    _DECISION.update(decision)
    return decision


def padded_attention_mode() -> str:
    mode = os.environ.get(PADDED_ATTENTION_ENV, "rowwise") or "rowwise"
    if mode not in ("rowwise", "shared", "masked"):
        raise UserError(f"{PADDED_ATTENTION_ENV}={mode!r}: expected rowwise, shared or masked")
    return mode


PREFIX_ATTENTION_MODES = ("whole-row", "varlen", "varlen-tails", "varlen-exact")


def prefix_attention_mode() -> str:
    """How forwards of --prefix-reuse attend: whole-row (each row the call its whole row's forward
    makes), varlen (every row of the forward in one variable-length FlashAttention call, GPU only),
    varlen-tails (so only in forwards that keep no state, whose outputs no later row reads) or
    varlen-exact (one such call for the rows whose own calls would not split their keys, where a
    check at load finds it their own calls' bits; the other rows their own calls)."""
    mode = os.environ.get(PREFIX_ATTENTION_ENV, "whole-row") or "whole-row"
    if mode not in PREFIX_ATTENTION_MODES:
        raise UserError(f"{PREFIX_ATTENTION_ENV}={mode!r}: expected whole-row, varlen, varlen-tails or varlen-exact")
    return mode


def attention_streams() -> int:
    """How many CUDA streams a padded forward's own attention calls (one a row and layer) are spread
    over, so that calls too small to fill the GPU run side by side; each call is the same kernel on
    the same inputs on any stream, so its output bits do not change. 1 keeps them on the current stream."""
    raw = os.environ.get(ATTENTION_STREAMS_ENV, "") or str(ATTENTION_STREAMS_DEFAULT)
    if not raw.isdigit() or not 1 <= int(raw) <= 64:
        raise UserError(f"{ATTENTION_STREAMS_ENV}={raw!r}: expected a whole number from 1 to 64")
    return int(raw)


def kernel_path(model) -> dict:
    """What the loaded model's forward runs: GDN chunk kernel, causal conv, attention, versions."""
    import torch

    from openjev.engine.fused import fused_record, gdn_modeling

    info: dict = {"gdn": None, "gdn_chunk_kernel": None, "causal_conv1d": None}
    modeling = gdn_modeling(model)
    if modeling is not None:
        chunk = bound_implementation(getattr(modeling, "torch_chunk_gated_delta_rule", None))
        conv = bound_implementation(getattr(modeling, "causal_conv1d_fn", None))
        info["gdn_chunk_kernel"], info["causal_conv1d"] = describe(chunk), describe(conv)
        name = info["gdn_chunk_kernel"] or ""
        info["gdn"] = "fla" if name.startswith("fla.") else ("torch-fallback" if name.startswith("transformers.")
                                                              else (name or "unknown"))
    cfg = model.config
    info["attn_implementation"] = getattr(cfg, "_attn_implementation", None)
    info["torch"] = torch.__version__
    info["cudnn_enabled"] = bool(torch.backends.cudnn.enabled)
    info["cublas_workspace_config"] = os.environ.get(BLAS_WORKSPACE_ENV)
    info["triton_cache_autotuning"] = os.environ.get(AUTOTUNE_CACHE_ENV)
    info["triton_cache_dir"] = os.environ.get("TRITON_CACHE_DIR") or "~/.triton/cache (Triton's default)"
    info["fla_configs"] = pins_record()
    info["padded_attention"] = padded_attention_mode()
    info["prefix_attention"] = prefix_attention_mode()
    info["attention_streams"] = attention_streams()
    info["sdp_backends"] = sdp_backends()
    info["fused"] = fused_record(model)
    info["compiled_modules"] = sorted({type(m).__name__ for m in model.modules() if getattr(m, "_openjev_compiled", False)})
    for mod, key in (("fla", "fla_version"), ("triton", "triton_version"), ("causal_conv1d", "causal_conv1d_version")):
        m = sys.modules.get(mod)
        info[key] = getattr(m, "__version__", None) if m is not None else None
    info["selection"] = dict(_DECISION) or None
    return info


def path_label(info: dict) -> str:
    """One short string for logs and tables, e.g. 'fla+sdpa' or 'torch-fallback+sdpa'."""
    return f"{info.get('gdn')}+{info.get('attn_implementation')}"


# ---------------------------------------------------------------- compute-bound figures


# ---------------------------------------------------------------- warm-up
def warm_fla_shapes(clf, max_rows: int, max_tokens: int) -> dict:
    """Run fla's kernels for every autotune key a forward of at most `max_rows` rows and
    `max_tokens` padded tokens can produce, so no request pays the autotuning (or, with pinned
    configurations, pin_fla_configs, only the compilation). Measured on an H200: fla 0.6.0's
    l2norm kernel keys its autotune on NB = ceil(rows x length x heads / 65536) (25 configs compiled
    for every new NB, about 10 s) and its chunk cumsum on the batch size, so padded batches of new
    shapes stalled passes by 9 s. Nothing here is kept but Triton's caches."""
    kern = (clf.kernels or {}).get("gdn")
    if kern != "fla" or not clf.device.startswith("cuda"):
        return {"skipped": f"GDN path {kern} on {clf.device}"}
    try:
        return _warm_fla_shapes(clf, max_rows, max_tokens)
    except Exception as exc:  # noqa: BLE001 - a warm-up failure must not stop serving; requests then autotune
        log.warning("fla autotune warm-up failed (%s: %s); first requests of new shapes will pay it",
                    type(exc).__name__, exc)
        return {"error": f"{type(exc).__name__}: {exc}"}


def _warm_fla_shapes(clf, max_rows: int, max_tokens: int) -> dict:
    import torch
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    text = clf.model.config.get_text_config()
    heads, dk, dv = text.linear_num_value_heads, text.linear_key_head_dim, text.linear_value_head_dim
    fused = getattr(clf.model, "_openjev_fused", None) or {}
    grouped = fused.get("pieces", {}).get("grouped_heads", {}).get("used", False)
    qk_heads = text.linear_num_key_heads if grouped else heads  # the query/key heads the forward hands fla
    dt = clf.model.dtype
    t0 = time.perf_counter()
    nbs = list(range(1, -(-max_tokens * heads // 65536) + 1))
    with torch.inference_mode():
        for nb in nbs:
            l2norm_fwd(torch.randn(nb * 65536, dk, device=clf.device, dtype=dt))
        for b in range(1, max_rows + 1):
            q, k = (torch.randn(b, 64, qk_heads, dk, device=clf.device, dtype=dt) for _ in range(2))
            v = torch.randn(b, 64, heads, dv, device=clf.device, dtype=dt)
            g = -torch.rand(b, 64, heads, device=clf.device)
            beta = torch.rand(b, 64, heads, device=clf.device, dtype=dt)
            chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        torch.cuda.synchronize()
    seconds = round(time.perf_counter() - t0, 3)
    log.info("fla autotune warm-up: l2norm NB 1..%d, batch sizes 1..%d in %.1f s", nbs[-1], max_rows, seconds)
    return {"l2norm_nb": [1, nbs[-1]], "batch_sizes": [1, max_rows], "max_tokens": max_tokens, "qk_heads": qk_heads,
            "seconds": seconds}


def compile_pointwise(model) -> int:
    """torch.compile (dynamic shapes) the norm and MLP modules, fusing their casts and pointwise
    work; matmuls stay cuBLAS. For serving only, never for the reference scorer. Returns how many
    modules were wrapped. Their forward is still Transformers' code, compiled by Inductor."""
    import torch

    n = 0
    for m in model.modules():
        name = type(m).__name__
        if name.endswith(("RMSNorm", "RMSNormGated", "MLP")) and "Vision" not in name:
            m.forward = torch.compile(m.forward, dynamic=True)
            m._openjev_compiled = True
            n += 1
    log.info("compiled %d norm/MLP modules (torch.compile, dynamic shapes)", n)
    return n
