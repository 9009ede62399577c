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

Environment read: OPENJEV_MAX_BATCH_SIZE (default 512), OPENJEV_ARCH_PROFILE (shown in
/server_info), OPENJEV_BUNDLE_REVISION (optional, shown in /server_info when the bundle is no
git checkout). Exit status: SGLang's; 1 with one line on stderr when this launcher refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Mapping, MutableMapping, Optional, Sequence

from sglang_openjev import contract

PROG = "sglang_openjev.launch_server"
PACKAGE = "sglang_openjev"
PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
ARCHITECTURES = ("Qwen3_5ForSequenceClassification",)
MODEL_TYPE = "qwen3_5"
GDN_BACKEND = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend"
EXTERNAL_PACKAGE_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"

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


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
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
    register_hybrid_architectures()

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
