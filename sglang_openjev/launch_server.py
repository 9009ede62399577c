"""Launch SGLang with the OpenJEV classifier adapter: `python -m sglang_openjev.launch_server ARGS`.

ARGS are SGLang's own server flags (`python -m sglang.launch_server --help` lists them; so does
`--help` here). This entry point does what `sglang.launch_server` does, plus, before SGLang
parses its arguments:

1. sets `SGLANG_EXTERNAL_MODEL_PACKAGE=sglang_openjev` (refusing another value) and puts this
   bundle on PYTHONPATH, so the scheduler processes SGLang spawns register the
   `Qwen3_5ForSequenceClassification` architecture from this package;
2. checks the checkpoint's config.json (local directories): architecture
   `Qwen3_5ForSequenceClassification`, model_type `qwen3_5`, 3 labels in
   contradiction/entailment/neutral order, a hybrid layout SGLang builds as Transformers does.
   SGLang derives the layout from text_config.full_attention_interval alone; a config that has
   only layer_types (as Transformers writes one built from keyword arguments) gets the interval
   that layer_types follows through `--json-model-override-args` on SGLang >= 0.5.23, which
   merges a text_config override; older versions refuse it with the key to add;
3. adds `--is-embedding` when missing (the architecture is not in SGLang's hard-coded list of
   embedding models, so SGLang would otherwise treat it as a generator), and sets, for every
   SGLang process:
   - `SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE=sglang_openjev.mm_processors`: SGLang counts the
     Qwen3.5 config as multimodal and looks up a processor by architecture; the package maps the
     adapter's architecture to SGLang's Qwen3.5 processor;
   - `SGLANG_MAMBA_CONV_DTYPE` to the serving dtype (SGLang's default conv-state pool is
     bfloat16 whatever --dtype says; a float16 model then fails on its first cached request);
   - `SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python` where SGLang's bundled Rust tree core was
     built for another torch than the one installed (it crashes the scheduler, not refuses);
4. registers the architecture in SGLang's linear-attention model registry, so `ServerArgs`
   applies the same mamba radix-cache handling as for `Qwen3_5ForConditionalGeneration`
   (extra_buffer/no_buffer checks, page size, overlap schedule);
5. installs the contract routes (`sglang_openjev.routes`) on SGLang's FastAPI app;
6. registers the classifier's warm-up (`sglang_openjev.warmup`) and adds it to `--warmups`, so
   SGLang compiles its kernels on the classifier's path before the server listens, after the
   scheduler's own state was checked against the flags given (backends, mamba strategy, radix cache,
   dtype, GDN state slots): a silent fallback stops the start;

then runs SGLang's own `run_server(ServerArgs)`. It refuses modes whose HTTP workers would not
carry the routes (several tokenizer workers, HTTP/2 via Granian, gRPC, Ray, encoder-only).

Runtime versions. `detect_runtime()` tells the pinned V100 fork (its server_args.py has the
`tilelang_fa_v100` backend) from stock SGLang and reads the version without importing sglang;
`app/serve_sglang_v100.sh` composes the flags of that version's dialect from it
(`python -m sglang_openjev.launch_server --openjev-runtime` prints it). Where the version checks
extra_buffer against a hard-coded architecture list (stock 0.5.14: `ServerArgs.
_support_mamba_cache_extra_buffer`), this process answers for the adapter's architecture what
SGLang answers for `Qwen3_5ForConditionalGeneration`, whose text backbone the adapter reuses
(0.5.13 and 0.5.23 read the registry spec registered in step 4). If a version admits it neither
way, the launch falls back to the closest setting (no_buffer with the overlap schedule off, the
prefix cache still on). Every such step is one WARNING/INFO line in the log and listed in
/server_info (`launch_adaptations`, with `sglang_runtime`).

Environment read: OPENJEV_MAX_BATCH_SIZE (default 512), OPENJEV_ARCH_PROFILE (shown in
/server_info), OPENJEV_BUNDLE_REVISION (optional, shown in /server_info when the bundle is no
git checkout); an operator's own SGLANG_MAMBA_CONV_DTYPE or SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND
is kept where it can run and refused where it cannot. Exit status: SGLang's; 1 with one line on
stderr when this launcher refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping, MutableMapping, Optional, Sequence

from sglang_openjev.checkpoint import ARCHITECTURES, LaunchError, preflight_checkpoint

PROG = "sglang_openjev.launch_server"
PACKAGE = "sglang_openjev"
PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
GDN_BACKEND = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend"
EXTERNAL_PACKAGE_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"
MM_PROCESSOR_ENV = "SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE"
MM_PROCESSOR_PACKAGE = "sglang_openjev.mm_processors"
CONV_DTYPE_ENV = "SGLANG_MAMBA_CONV_DTYPE"
TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
RUST_BUILD_MODE_ENV = "SGLANG_RUST_BUILD_MODE"
OVERRIDE_FLAG = "--json-model-override-args"
# Stock SGLang from this release merges a text_config override into the sub-config; older ones
# replace the sub-config with the dict.
NESTED_OVERRIDE_SINCE = (0, 5, 23)
RUNTIME_ENV = "OPENJEV_SGLANG_RUNTIME"        # e.g. stock-0.5.14 or fork-0.5.13 (set by serve_sglang_v100.sh)
ADAPTATIONS_ENV = "OPENJEV_LAUNCH_ADAPTATIONS"  # JSON list of what was adapted to this version
FORK_MARKER = "tilelang_fa_v100"              # the fork's SM70 attention backend, absent in stock SGLang
OLDEST_STOCK = (0, 5, 13)
NEWEST_CHECKED = (0, 5, 23)
CHECKED_STOCK = ("0.5.13", "0.5.14", "0.5.23")
# The GDN model whose extra_buffer support SGLang states and whose text backbone the adapter reuses.
EXTRA_BUFFER_TWIN = "Qwen3_5ForConditionalGeneration"

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- pure steps
def prepare_environment(environ: MutableMapping[str, str]) -> None:
    for name, value in ((EXTERNAL_PACKAGE_ENV, PACKAGE), (MM_PROCESSOR_ENV, MM_PROCESSOR_PACKAGE)):
        current = environ.get(name)
        if current and current != value:
            raise LaunchError(f"{name}={current}, but this launcher serves the {PACKAGE} package; "
                              f"unset it or set it to {value}")
        environ[name] = value
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if PACKAGE_ROOT not in parts:
        environ["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT, *parts])


def wants_help(argv: Sequence[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def model_path_from_argv(argv: Sequence[str]) -> Optional[str]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model-path", "--model", dest="model_path")
    known, _ = parser.parse_known_args(list(argv))
    return known.model_path


def with_embedding_flag(argv: Sequence[str]) -> list[str]:
    argv = list(argv)
    if "--is-embedding" not in argv:
        argv.append("--is-embedding")
    return argv


def check_server_args(server_args) -> None:
    refusals = []
    if not server_args.is_embedding:
        refusals.append("--is-embedding is off")
    if getattr(server_args, "tokenizer_worker_num", 1) != 1:
        refusals.append("--tokenizer-worker-num > 1 (worker processes import a fresh app without the routes)")
    for flag, attr in (("--enable-http2", "enable_http2"), ("--grpc-mode", "grpc_mode"), ("--use-ray", "use_ray"),
                       ("--encoder-only", "encoder_only")):
        if getattr(server_args, attr, False):
            refusals.append(f"{flag} (the /classify routes live on the single-process uvicorn app)")
    if refusals:
        raise LaunchError("cannot serve the /classify contract with " + "; ".join(refusals))


# ---------------------------------------------------------------- runtime versions
@dataclasses.dataclass(frozen=True)
class Runtime:
    """Which SGLang serves: flavor `fork` (haohervchb/sglang-V100) or `stock`, its version, and the
    flag dialect: `legacy` (fork, stock <= 0.5.13: --mamba-scheduler-strategy, --disable-cuda-graph,
    --disable-piecewise-cuda-graph) or `0.5.14` (stock >= 0.5.14: --mamba-radix-cache-strategy,
    --cuda-graph-backend-{decode,prefill} disabled)."""

    flavor: str
    version: str
    dialect: str
    note: str = ""

    @property
    def label(self) -> str:
        return f"{self.flavor}-{self.version}"


def _release(version: str) -> Optional[tuple[int, int, int]]:
    match = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(x) for x in match.groups()) if match else None  # type: ignore[return-value]


def runtime_from(flavor: str, version: str) -> Runtime:
    """The dialect and any note for FLAVOR (fork|stock) at VERSION; LaunchError when unsupported."""
    if flavor == "fork":
        return Runtime("fork", version, "legacy")
    if flavor != "stock":
        raise LaunchError(f"unknown SGLang flavor {flavor!r} (fork or stock)")
    release = _release(version)
    if release is None:
        raise LaunchError(f"cannot read the SGLang version {version!r}")
    if release < OLDEST_STOCK:
        raise LaunchError(f"stock SGLang {version} is older than 0.5.13, the oldest version the adapter supports")
    note = ""
    if release > NEWEST_CHECKED:
        note = (f"stock SGLang {version} is newer than the newest version checked ({'.'.join(map(str, NEWEST_CHECKED))}); "
                "flags as for 0.5.23")
    return Runtime("stock", version, "legacy" if release < (0, 5, 14) else "0.5.14", note)


def parse_runtime(value: str) -> Runtime:
    """OPENJEV_SGLANG_RUNTIME: `fork`, `fork-VERSION` or `stock-VERSION` (what the launcher exports)."""
    flavor, _, version = value.strip().partition("-")
    if flavor == "fork":
        return runtime_from("fork", version or "unknown")
    if flavor == "stock" and version:
        return runtime_from("stock", version)
    raise LaunchError(f"{RUNTIME_ENV} must be fork, fork-VERSION or stock-VERSION (e.g. stock-0.5.14), got {value!r}")


def detect_runtime() -> Runtime:
    """The SGLang this interpreter would import, found without importing it (no torch, no CUDA)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise LaunchError(f"sglang is not importable with {sys.executable}; install the runtime "
                          f"(install_v100_runtime.sh), point OPENJEV_PYTHON at its venv, or set {RUNTIME_ENV}")
    package = Path(list(spec.submodule_search_locations)[0])
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    try:
        fork = FORK_MARKER in (package / "srt" / "server_args.py").read_text(errors="replace")
    except OSError as exc:
        raise LaunchError(f"cannot read SGLang's server_args.py under {package}: {exc}") from None
    return runtime_from("fork" if fork else "stock", version)


def runtime_line(value: str = "") -> str:
    """`LABEL DIALECT [NOTE]` for serve_sglang_v100.sh (VALUE: OPENJEV_SGLANG_RUNTIME, else detected)."""
    runtime = parse_runtime(value) if value else detect_runtime()
    return " ".join(x for x in (runtime.label, runtime.dialect, runtime.note) if x)


def flag_value(argv: Sequence[str], flag: str) -> tuple[Optional[int], Optional[str]]:
    """(index of the argument holding FLAG's value, value) for `FLAG VALUE` or `FLAG=VALUE`, the last one given."""
    found: tuple[Optional[int], Optional[str]] = (None, None)
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            found = (i + 1, argv[i + 1])
        elif arg.startswith(flag + "="):
            found = (i, arg.split("=", 1)[1])
    return found


def with_flag_value(argv: Sequence[str], flag: str, value: str) -> list[str]:
    """argv with FLAG's (last) value replaced by VALUE in the spelling given, or FLAG VALUE appended."""
    argv = list(argv)
    index, given = flag_value(argv, flag)
    if index is None:
        return [*argv, flag, value]
    argv[index] = value if argv[index] == given else f"{flag}={value}"
    return argv


def with_layout_override(argv: Sequence[str], interval: int, runtime: Optional[Runtime]) -> tuple[list[str], str]:
    """argv with text_config.full_attention_interval=INTERVAL in --json-model-override-args (merged
    into an operator's own override). Returns (argv, note)."""
    release = _release(runtime.version) if runtime is not None else None
    if runtime is None or runtime.flavor != "stock" or release is None or release < NESTED_OVERRIDE_SINCE:
        which = runtime.label if runtime is not None else "this SGLang"
        raise LaunchError(f"config.json text_config has layer_types but no full_attention_interval; {which} builds "
                          f"the hybrid layout from that key alone: add \"full_attention_interval\": {interval} to "
                          "text_config (the base Qwen/Qwen3.5 config carries it), or serve with stock SGLang >= "
                          f"{'.'.join(map(str, NESTED_OVERRIDE_SINCE))}, where this launcher passes it")
    _, value = flag_value(argv, OVERRIDE_FLAG)
    try:
        override = json.loads(value) if value else {}
    except json.JSONDecodeError as exc:
        raise LaunchError(f"{OVERRIDE_FLAG} is not valid JSON: {exc}") from None
    if not isinstance(override, dict) or not isinstance(override.get("text_config", {}), dict):
        raise LaunchError(f"{OVERRIDE_FLAG} must be a JSON object whose text_config is an object")
    text = dict(override.get("text_config", {}))
    given = text.get("full_attention_interval", interval)
    if given != interval:
        raise LaunchError(f"{OVERRIDE_FLAG} sets text_config.full_attention_interval={given}, but the checkpoint's "
                          f"layer_types follow {interval}")
    text["full_attention_interval"] = interval
    encoded = json.dumps({**override, "text_config": text}, separators=(",", ":"))
    note = (f"text_config.full_attention_interval={interval} passed in {OVERRIDE_FLAG}: the checkpoint has "
            "layer_types only, and SGLang builds the hybrid layout from the interval")
    return with_flag_value(argv, OVERRIDE_FLAG, encoded), note


DTYPE_NAMES = {"float16": "float16", "half": "float16", "fp16": "float16", "bfloat16": "bfloat16",
               "float32": "float32", "float": "float32", "fp32": "float32"}


def serving_dtype(argv: Sequence[str], config: Optional[Mapping]) -> Optional[str]:
    """The dtype SGLang will run the model in: --dtype, or for `auto` the checkpoint's dtype with
    float32 (or none) served as float16, as SGLang's `_get_and_verify_dtype` does. None when unknown."""
    _, given = flag_value(argv, "--dtype")
    given = (given or "auto").lower()
    if given != "auto":
        return DTYPE_NAMES.get(given)
    if config is None:
        return None
    text = config.get("text_config") or {}
    stored = DTYPE_NAMES.get(str(config.get("dtype") or config.get("torch_dtype") or text.get("dtype")
                                 or text.get("torch_dtype") or "float32").lower())
    return "float16" if stored in (None, "float32") else stored


def state_dtype_environment(environ: MutableMapping[str, str], dtype: Optional[str]) -> Optional[str]:
    """SGLANG_MAMBA_CONV_DTYPE = the serving dtype: SGLang's conv-state pool defaults to bfloat16 and
    is written with the model's activations. Refuses an operator's value that differs. Returns a note."""
    current = environ.get(CONV_DTYPE_ENV)
    if dtype is None:
        return None if current else f"{CONV_DTYPE_ENV} left to SGLang: the serving dtype is not known before start"
    if current:
        if DTYPE_NAMES.get(current.lower()) != dtype:
            raise LaunchError(f"{CONV_DTYPE_ENV}={current}, but the model is served in {dtype}: SGLang writes the "
                              f"conv states with the model's activations, so they must match; unset it or set {dtype}")
        return None
    environ[CONV_DTYPE_ENV] = dtype
    return f"{CONV_DTYPE_ENV}={dtype}: the conv-state pool in the serving dtype (SGLang's default is bfloat16)"


def _torch_release(version: str) -> Optional[tuple[int, int]]:
    match = re.match(r"^(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def bundled_tree_core_torch() -> tuple[Optional[str], Optional[str]]:
    """(torch version the installed SGLang pins, i.e. the one its bundled Rust tree core was built
    against; installed torch version), read without importing either. (None, _) when this SGLang
    bundles no Rust tree core or pins no exact torch."""
    try:
        torch_version: Optional[str] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None, torch_version
    folder = Path(list(spec.submodule_search_locations)[0]) / "srt" / "mem_cache" / "rust_tree_core"
    if not any(folder.glob("mem_cache*.so")):
        return None, torch_version
    try:
        requires = importlib.metadata.requires("sglang") or []
    except importlib.metadata.PackageNotFoundError:
        return None, torch_version
    for line in requires:
        match = re.match(r"^torch\s*==\s*([0-9][^;\s]*)\s*(;.*)?$", line.strip())
        if match and not match.group(2):
            return match.group(1), torch_version
    return None, torch_version


def tree_core_environment(environ: MutableMapping[str, str], built_for: Optional[str],
                          installed: Optional[str]) -> Optional[str]:
    """Choose SGLang's Python radix tree core where its bundled Rust one was built for another torch
    (loading it under a different torch crashes the scheduler at the first cached request).
    Refuses an explicit rust choice then. Returns a note."""
    if built_for is None or installed is None or environ.get(RUST_BUILD_MODE_ENV) == "force":
        return None  # nothing bundled, or SGLang rebuilds it against the installed torch
    if _torch_release(built_for) == _torch_release(installed):
        return None
    chosen = environ.get(TREE_CORE_ENV)
    if chosen == "rust":
        raise LaunchError(f"{TREE_CORE_ENV}=rust, but SGLang's bundled Rust tree core was built for torch {built_for} "
                          f"and torch {installed} is installed (it would crash, not refuse): unset it, set python, or "
                          f"install torch {built_for}")
    if chosen:
        return None
    environ[TREE_CORE_ENV] = "python"
    return (f"{TREE_CORE_ENV}=python: SGLang's bundled Rust radix tree core was built for torch {built_for}, "
            f"torch {installed} is installed")


def prepare_launch(argv: Sequence[str], environ: MutableMapping[str, str]) -> tuple[list[str], list[str]]:
    """Everything before SGLang is imported: environment, checkpoint preflight, --is-embedding, the
    layout override and the state and tree-core choices. Returns (argv, notes)."""
    prepare_environment(environ)
    config, interval = preflight_checkpoint(model_path_from_argv(argv))
    argv = with_embedding_flag(argv)
    notes: list[str] = []
    if interval is not None:
        try:
            runtime: Optional[Runtime] = detect_runtime()
        except LaunchError:
            runtime = None
        argv, note = with_layout_override(argv, interval, runtime)
        notes.append(note)
    for note in (state_dtype_environment(environ, serving_dtype(argv, config)),
                 tree_core_environment(environ, *bundled_tree_core_torch())):
        if note:
            notes.append(note)
    return argv, notes


def adapt_extra_buffer(server_args_cls: Any, spec_fields: Sequence[str]) -> tuple[bool, Optional[str]]:
    """Make this SGLang admit extra_buffer for the adapter's architecture where it can.

    Returns (admitted, note): note None when SGLang's own mechanism admits it. Versions that consult the linear-attention registry (0.5.13, the fork,
    0.5.23) admit it through the spec of `register_hybrid_architectures`; 0.5.14 checks a hard-coded
    list in `ServerArgs._support_mamba_cache_extra_buffer`, answered here (this process only, where
    ServerArgs is built and checked) as for EXTRA_BUFFER_TWIN. Nothing installed is edited.
    """
    method = getattr(server_args_cls, "_support_mamba_cache_extra_buffer", None)
    if method is not None:
        if getattr(method, "_openjev_admits", False):
            return True, None
        original = method

        def _support_mamba_cache_extra_buffer(self, model_arch: str):
            return original(self, EXTRA_BUFFER_TWIN if model_arch in ARCHITECTURES else model_arch)

        _support_mamba_cache_extra_buffer._openjev_admits = True  # type: ignore[attr-defined]
        server_args_cls._support_mamba_cache_extra_buffer = _support_mamba_cache_extra_buffer
        return True, (f"extra_buffer admitted for {ARCHITECTURES[0]} as for {EXTRA_BUFFER_TWIN} (same SGLang Qwen3.5 "
                      "backbone and GDN backend): ServerArgs._support_mamba_cache_extra_buffer has a hard-coded "
                      "architecture list in this version")
    if "support_mamba_cache_extra_buffer" in spec_fields:
        return True, None
    return False, None


def with_warmup_flag(argv: Sequence[str], name: str) -> list[str]:
    """argv with NAME in --warmups (appended to an operator's list; once)."""
    names = [n for n in (flag_value(argv, "--warmups")[1] or "").split(",") if n]
    return list(argv) if name in names else with_flag_value(argv, "--warmups", ",".join([*names, name]))


# flag -> the server argument SGLang reports it under
ASKED_FLAGS = {"--attention-backend": "attention_backend", "--linear-attn-backend": "linear_attn_backend",
               "--linear-attn-prefill-backend": "linear_attn_prefill_backend",
               "--linear-attn-decode-backend": "linear_attn_decode_backend",
               "--mamba-radix-cache-strategy": "mamba_radix_cache_strategy",
               "--mamba-scheduler-strategy": "mamba_scheduler_strategy", "--dtype": "dtype"}


def asked_by(argv: Sequence[str]) -> dict[str, Any]:
    """The server arguments ARGV sets explicitly (the last value of a flag given twice), as SGLang
    reports them, for the warm-up's served-state check."""
    asked: dict[str, Any] = {key: value for flag, key in ASKED_FLAGS.items()
                             if (value := flag_value(argv, flag)[1]) is not None}
    if "--disable-radix-cache" in argv:
        asked["disable_radix_cache"] = True
    return asked


def strategy_flag(argv: Sequence[str]) -> tuple[Optional[int], Optional[str]]:
    """(index of the strategy's value in argv, value) for --mamba-radix-cache-strategy or
    --mamba-scheduler-strategy (either spelling, `FLAG VALUE` or `FLAG=VALUE`), the last one given."""
    given = [flag_value(argv, f) for f in ("--mamba-radix-cache-strategy", "--mamba-scheduler-strategy")]
    return max((g for g in given if g[0] is not None), key=lambda g: g[0], default=(None, None))


def closest_without_extra_buffer(argv: Sequence[str]) -> tuple[list[str], Optional[str]]:
    """When extra_buffer cannot be admitted: no_buffer (the prefix cache stays on) with the overlap
    schedule off, which SGLang's no_buffer requires. Returns (argv, note or None when unchanged)."""
    argv = list(argv)
    index, value = strategy_flag(argv)
    if value not in ("extra_buffer", "extra_buffer_lazy") or "--disable-radix-cache" in argv:
        return argv, None
    argv[index] = argv[index].replace(value, "no_buffer") if "=" in argv[index] else "no_buffer"
    if "--disable-overlap-schedule" not in argv:
        argv.append("--disable-overlap-schedule")
    return argv, (f"{value} is not admitted for {ARCHITECTURES[0]} by this SGLang: closest setting used, no_buffer "
                  "(prefix cache on, mamba states cached without the extra buffer) with --disable-overlap-schedule")


# ---------------------------------------------------------------- SGLang steps
def register_hybrid_architectures() -> list[str]:
    """Declare the adapter's architectures as hybrid GDN models to SGLang's ServerArgs.

    SGLang applies its mamba radix-cache handling by architecture name: a hard-coded list
    (Qwen3_5ForConditionalGeneration, ...) or `configs/linear_attn_model_registry.py`, which is
    there for external models. Registered in this (the main) process only, where ServerArgs is
    built; the scheduler picks the GDN pools and backend from the config class anyway.
    """
    from sglang.srt.configs import linear_attn_model_registry as registry
    from sglang.srt.configs.qwen3_5 import Qwen3_5Config

    wanted = [a for a in ARCHITECTURES if registry.get_linear_attn_spec_by_arch(a) is None]
    if not wanted:
        return []
    fields = {f.name for f in dataclasses.fields(registry.LinearAttnModelSpec)}
    spec = dict(config_class=Qwen3_5Config, backend_class_name=GDN_BACKEND, arch_names=wanted,
                uses_mamba_radix_cache=True, support_mamba_cache=True, support_mamba_cache_extra_buffer=True)
    registry.register_linear_attn_model(registry.LinearAttnModelSpec(**{k: v for k, v in spec.items() if k in fields}))
    return wanted


def adapt_to_runtime(argv: Sequence[str], environ: MutableMapping[str, str], earlier: Sequence[str] = ()
                     ) -> tuple[list[str], list[str], Optional[Runtime]]:
    """Step 4 and the version adaptations, in the process that builds ServerArgs (imports sglang).

    Returns (argv, adaptations, runtime); sets RUNTIME_ENV to the installed runtime and
    ADAPTATIONS_ENV to the JSON list of adaptations, which /server_info shows.
    """
    register_hybrid_architectures()
    from sglang.srt.configs.linear_attn_model_registry import LinearAttnModelSpec
    from sglang.srt.server_args import ServerArgs

    adaptations: list[str] = list(earlier)
    runtime: Optional[Runtime] = None
    try:
        runtime = detect_runtime()
    except LaunchError as exc:  # sglang imported above, so only its version could not be read
        adaptations.append(f"version not detected: {exc}")
    if runtime is not None:
        if runtime.note:
            adaptations.append(runtime.note)
        given = environ.get(RUNTIME_ENV, "")
        flavor, _, version = given.partition("-")
        if given and (flavor != runtime.flavor or version not in ("", "unknown", runtime.version)):
            adaptations.append(f"{RUNTIME_ENV}={given}, but the installed SGLang is {runtime.label}")
        environ[RUNTIME_ENV] = runtime.label
    admitted, note = adapt_extra_buffer(ServerArgs, [f.name for f in dataclasses.fields(LinearAttnModelSpec)])
    argv = list(argv)
    if not admitted:
        argv, note = closest_without_extra_buffer(argv)
    if note:
        adaptations.append(note)
    from sglang_openjev import warmup

    if warmup.register():
        argv = with_warmup_flag(argv, warmup.NAME)
        warmup.ASKED.update(asked_by(argv))
    else:
        adaptations.append("no custom warm-ups in this SGLang: the first request compiles the kernels")
    environ[ADAPTATIONS_ENV] = json.dumps(adaptations)
    return argv, adaptations, runtime


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--openjev-runtime"]:  # for serve_sglang_v100.sh: no SGLang import, no launch
        try:
            print(runtime_line(argv[1] if len(argv) > 1 else os.environ.get(RUNTIME_ENV, "")))
        except LaunchError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
            sys.exit(1)
        return
    notes: list[str] = []
    try:
        if wants_help(argv):
            prepare_environment(os.environ)
        else:
            argv, notes = prepare_launch(argv, os.environ)
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)

    try:
        from sglang.srt.plugins import load_plugins
    except ImportError:  # older SGLang: no plugin framework
        load_plugins = None
    if load_plugins is not None:
        load_plugins()
    argv, adaptations, runtime = adapt_to_runtime(argv, os.environ, notes)
    # Plain stderr lines (SGLang configures logging itself later): the journal shows them at start.
    print(f"{PROG}: SGLang {runtime.label if runtime else 'of unknown version'}, "
          f"{runtime.dialect if runtime else 'unknown'} flag dialect", file=sys.stderr, flush=True)
    for line in adaptations:
        print(f"{PROG}: adapted: {line}", file=sys.stderr, flush=True)

    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(argv)  # --help prints SGLang's flags and exits here
    try:
        check_server_args(server_args)
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)

    from sglang.srt.entrypoints.http_server import app

    from sglang_openjev.routes import install_routes

    install_routes(app)

    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree

    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
