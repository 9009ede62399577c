"""Launch SGLang with the OpenJEV classifier adapter: `python -m sglang_openjev.launch_server ARGS`.

ARGS are SGLang's own server flags (`python -m sglang.launch_server --help` lists them; so does
`--help` here). This entry point does what `sglang.launch_server` does, plus, before SGLang
parses its arguments:

1. sets `SGLANG_EXTERNAL_MODEL_PACKAGE=sglang_openjev` (refusing another value) and puts this
   bundle on PYTHONPATH, so the scheduler processes SGLang spawns register the
   `Qwen3_5ForSequenceClassification` architecture from this package;
2. checks the checkpoint's config.json (local directories): architecture
   `Qwen3_5ForSequenceClassification`, model_type `qwen3_5`, 3 labels in
   contradiction/entailment/neutral order, a text_config.full_attention_interval that agrees
   with layer_types (SGLang builds the hybrid layout from the interval);
3. adds `--is-embedding` when missing (the architecture is not in SGLang's hard-coded list of
   embedding models, so SGLang would otherwise treat it as a generator);
4. registers the architecture in SGLang's linear-attention model registry, so `ServerArgs`
   applies the same mamba radix-cache handling as for `Qwen3_5ForConditionalGeneration`
   (extra_buffer/no_buffer checks, page size, overlap schedule);
5. installs the contract routes (`sglang_openjev.routes`) on SGLang's FastAPI app;

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
git checkout). Exit status: SGLang's; 1 with one line on stderr when this launcher refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import re
import logging
import os
import sys
from pathlib import Path
from typing import Any, Mapping, MutableMapping, Optional, Sequence

from sglang_openjev import contract

PROG = "sglang_openjev.launch_server"
PACKAGE = "sglang_openjev"
PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
ARCHITECTURES = ("Qwen3_5ForSequenceClassification",)
MODEL_TYPE = "qwen3_5"
GDN_BACKEND = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend"
EXTERNAL_PACKAGE_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"
RUNTIME_ENV = "OPENJEV_SGLANG_RUNTIME"        # e.g. stock-0.5.14 or fork-0.5.13 (set by serve_sglang_v100.sh)
ADAPTATIONS_ENV = "OPENJEV_LAUNCH_ADAPTATIONS"  # JSON list of what was adapted to this version
FORK_MARKER = "tilelang_fa_v100"              # the fork's SM70 attention backend, absent in stock SGLang
OLDEST_STOCK = (0, 5, 13)
NEWEST_CHECKED = (0, 5, 23)
CHECKED_STOCK = ("0.5.13", "0.5.14", "0.5.23")
# The GDN model whose extra_buffer support SGLang states and whose text backbone the adapter reuses.
EXTRA_BUFFER_TWIN = "Qwen3_5ForConditionalGeneration"

logger = logging.getLogger(__name__)


class LaunchError(Exception):
    """A refusal the operator can act on: one line on stderr, exit status 1."""


# ---------------------------------------------------------------- pure steps
def prepare_environment(environ: MutableMapping[str, str]) -> None:
    current = environ.get(EXTERNAL_PACKAGE_ENV)
    if current and current != PACKAGE:
        raise LaunchError(f"{EXTERNAL_PACKAGE_ENV}={current}, but this launcher serves the {PACKAGE} package; "
                          "unset it or set it to sglang_openjev")
    environ[EXTERNAL_PACKAGE_ENV] = PACKAGE
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


def check_checkpoint_config(config: Mapping) -> None:
    """Refuse a config this adapter cannot serve, with the reason."""
    archs = list(config.get("architectures") or [])
    if not archs or archs[0] not in ARCHITECTURES:
        raise LaunchError(f"config.json architectures is {archs}; this adapter serves {list(ARCHITECTURES)} "
                          "(a Transformers Qwen3.5 sequence-classification checkpoint)")
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE:
        raise LaunchError(
            f"config.json model_type is {model_type!r}, expected {MODEL_TYPE!r} (the multimodal Qwen3.5 config "
            "with text_config); SGLang registers no 'qwen3_5_text' config class, so a text-only checkpoint would "
            "not get the hybrid GDN state pools")
    check_hybrid_layout(config.get("text_config") or {})
    num_labels = config.get("num_labels", len(config.get("id2label") or {}) or None)
    try:
        contract.check_label_order(config.get("id2label"), num_labels)
    except ValueError as exc:
        raise LaunchError(f"config.json: {exc}") from None


def check_hybrid_layout(text_config: Mapping) -> None:
    """SGLang (0.5.12-0.5.14, `configs/qwen3_next.py`) derives which layers are full attention from
    text_config.full_attention_interval alone and ignores layer_types; a config without the
    interval fails at model construction, one whose layer_types disagree builds the wrong model."""
    interval = text_config.get("full_attention_interval")
    layer_types = text_config.get("layer_types")
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        hint = ""
        if layer_types and "full_attention" in layer_types:
            first = layer_types.index("full_attention") + 1
            hint = f" (layer_types suggests {first})"
        raise LaunchError("config.json text_config has no full_attention_interval, from which SGLang derives the "
                          f"hybrid layer layout{hint}; the base Qwen/Qwen3.5 config carries it, add it back")
    if layer_types:
        derived = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(layer_types))]
        if list(layer_types) != derived:
            raise LaunchError(f"config.json text_config.layer_types does not follow full_attention_interval={interval}; "
                              "SGLang would build a different layer layout than Transformers")


def preflight_checkpoint(model_path: Optional[str]) -> None:
    if not model_path:
        return  # SGLang reports the missing --model-path itself
    path = Path(model_path).expanduser()
    if not path.is_dir():
        logger.warning("%s is not a local directory; skipping the label-order preflight", model_path)
        return
    cfg = path / "config.json"
    try:
        config = json.loads(cfg.read_text())
    except FileNotFoundError:
        raise LaunchError(f"{cfg} not found: CHECKPOINT must be a Transformers model directory") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise LaunchError(f"cannot read {cfg}: {exc}") from None
    check_checkpoint_config(config)


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


def strategy_flag(argv: Sequence[str]) -> tuple[Optional[int], Optional[str]]:
    """(index of the strategy's value in argv, value) for --mamba-radix-cache-strategy or
    --mamba-scheduler-strategy (either spelling, `FLAG VALUE` or `FLAG=VALUE`)."""
    found: tuple[Optional[int], Optional[str]] = (None, None)
    for i, arg in enumerate(argv):
        for flag in ("--mamba-radix-cache-strategy", "--mamba-scheduler-strategy"):
            if arg == flag and i + 1 < len(argv):
                found = (i + 1, argv[i + 1])
            elif arg.startswith(flag + "="):
                found = (i, arg.split("=", 1)[1])
    return found


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


def adapt_to_runtime(argv: Sequence[str], environ: MutableMapping[str, str]
                     ) -> tuple[list[str], list[str], Optional[Runtime]]:
    """Step 4 and the version adaptations, in the process that builds ServerArgs (imports sglang).

    Returns (argv, adaptations, runtime); sets RUNTIME_ENV to the installed runtime and
    ADAPTATIONS_ENV to the JSON list of adaptations, which /server_info shows.
    """
    register_hybrid_architectures()
    from sglang.srt.configs.linear_attn_model_registry import LinearAttnModelSpec
    from sglang.srt.server_args import ServerArgs

    adaptations: list[str] = []
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
    try:
        prepare_environment(os.environ)
        if not wants_help(argv):
            preflight_checkpoint(model_path_from_argv(argv))
            argv = with_embedding_flag(argv)
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)

    try:
        from sglang.srt.plugins import load_plugins
    except ImportError:  # older SGLang: no plugin framework
        load_plugins = None
    if load_plugins is not None:
        load_plugins()
    argv, adaptations, runtime = adapt_to_runtime(argv, os.environ)
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
