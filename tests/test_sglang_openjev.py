"""The SGLang adapter (`sglang_openjev/`): weight routing, pooling, launcher steps, routes, and,
where sglang is importable, registration and weight loading through SGLang's real classes.

Three layers:
- Pure tests (always run, CI included): weight-name routing against a real Transformers
  Qwen3.5 classifier's state dict, Transformers' vs SGLang's pooled position on a real tiny
  Transformers model, the launcher's pure steps.
- Route tests (always run): the adapter's routes on a real FastAPI app served by uvicorn on
  127.0.0.1; SGLang's tokenizer manager (the GPU scheduler's front) is the one stand-in. With
  sglang importable the app is SGLang's own `http_server.app` with SGLang's /server_info merged
  and the request object is SGLang's `EmbeddingReqInput`.
- SGLang tests (skipped without sglang, reason shown by `pytest -rs`): a fresh process with
  SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1, gloo, tp=1) discovers the architecture through
  SGLANG_EXTERNAL_MODEL_PACKAGE, builds it with SGLang's model loader from a tiny safetensors
  checkpoint saved by Transformers, and pools with SGLang's score_and_pool on a real ForwardBatch.
  The same loader (get_model -> DefaultModelLoader -> safetensors iterator -> load_weights) must
  refuse the five corrupted checkpoints of tests/strict_loading_cases.py (strict loading).
  With a CUDA build of torch and no driver, `cpu_only_torch_device_module` makes the probe's torch
  answer like a CPU build (see there). Run as `python tests/test_sglang_openjev.py --probe OUT_DIR`.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]

import strict_loading_cases

from sglang_openjev import checkpoint, contract, launch_server, pooling, routes, warmup, weights

LABELS = {0: "contradiction", 1: "entailment", 2: "neutral"}
TEXT_CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                   linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2,
                   max_position_embeddings=512, pad_token_id=0, eos_token_id=1)
VISION_CONFIG = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)


def _sglang_import_error() -> str | None:
    try:
        import sglang.srt.entrypoints.http_server  # noqa: F401
        import sglang.srt.models.qwen3_5  # noqa: F401
        import sglang.srt.models.registry  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means: not importable here
        return f"{type(exc).__name__}: {exc}"
    return None


SGLANG_ERROR = _sglang_import_error()
if SGLANG_ERROR is not None and os.environ.get("OPENJEV_REQUIRE_SGLANG") == "1":
    # `make test` runs this module in each real-SGLang venv with this set: no silent skips there.
    raise RuntimeError(f"OPENJEV_REQUIRE_SGLANG=1 but sglang is not importable: {SGLANG_ERROR}")
needs_sglang = pytest.mark.skipif(
    SGLANG_ERROR is not None,
    reason=f"sglang is not importable here ({SGLANG_ERROR}); the project venv and CI do not install it: run "
           "with a venv that has sglang 0.5.13 (the adapter section of V100.md says how)")


def tiny_transformers_classifier(text: bool = False):
    """A random-weight Transformers Qwen3.5 classifier (no download)."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    torch.manual_seed(0)
    label2id = {v: k for k, v in LABELS.items()}
    if text:
        cfg = Qwen3_5TextConfig(**TEXT_CONFIG, num_labels=3, id2label=LABELS, label2id=label2id)
        model = m.Qwen3_5TextForSequenceClassification(cfg)
    else:
        cfg = Qwen3_5Config(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, num_labels=3, id2label=LABELS,
                            label2id=label2id)
        try:
            model = m.Qwen3_5ForSequenceClassification(cfg)
        except AttributeError:
            # transformers 5.8.1 (the pinned runtime's) sizes the head from config.hidden_size and pools
            # with config.pad_token_id, which the multimodal config lacks; later releases read
            # get_text_config(). Same modules and pooling rule either way.
            cfg.hidden_size = TEXT_CONFIG["hidden_size"]
            cfg.pad_token_id = TEXT_CONFIG["pad_token_id"]
            model = m.Qwen3_5ForSequenceClassification(cfg)
    with torch.no_grad():  # Transformers may initialise the head to zeros; make every logit informative
        model.score.weight.normal_(0.0, 0.5)
    return model.eval()


# ================================================================ weight routing (pure)
def test_every_transformers_weight_routes_to_backbone_head_or_a_stated_skip():
    model = tiny_transformers_classifier()
    routes = {name: weights.route_weight(name) for name in model.state_dict()}
    assert routes["score.weight"] == (weights.HEAD, "weight")
    backbone = {name: r.name for name, r in routes.items() if r.kind == weights.BACKBONE}
    assert backbone["model.language_model.embed_tokens.weight"] == "embed_tokens.weight"
    assert backbone["model.language_model.norm.weight"] == "norm.weight"
    assert backbone["model.language_model.layers.1.self_attn.q_proj.weight"] == "layers.1.self_attn.q_proj.weight"
    assert backbone["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"] == \
        "layers.0.linear_attn.in_proj_qkv.weight"
    visual = [n for n in routes if n.startswith("model.visual.")]
    assert visual and all(routes[n].kind == weights.SKIP for n in visual)
    assert not [n for n, r in routes.items() if r.kind == weights.UNEXPECTED]
    assert len(backbone) + len(visual) + 1 == len(routes)


def test_text_variant_names_and_causal_lm_leftovers():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    if hasattr(modeling_qwen3_5, "Qwen3_5TextForSequenceClassification"):
        names = list(tiny_transformers_classifier(text=True).state_dict())
    else:  # Transformers 5.8.1 (the 0.5.13/0.5.14 venvs) lacks the class: same names from its text backbone + head
        from transformers import Qwen3_5TextConfig

        backbone = modeling_qwen3_5.Qwen3_5TextModel(Qwen3_5TextConfig(**TEXT_CONFIG))
        names = [f"model.{n}" for n in backbone.state_dict()] + ["score.weight"]
    routes = {name: weights.route_weight(name) for name in names}
    assert routes["model.embed_tokens.weight"] == (weights.BACKBONE, "embed_tokens.weight")
    assert routes["model.layers.3.self_attn.o_proj.weight"] == (weights.BACKBONE, "layers.3.self_attn.o_proj.weight")
    assert routes["score.weight"].kind == weights.HEAD
    assert weights.route_weight("lm_head.weight").kind == weights.SKIP
    assert weights.route_weight("mtp.layers.0.mlp.up_proj.weight").kind == weights.SKIP
    assert weights.route_weight("something.else").kind == weights.UNEXPECTED


@pytest.mark.parametrize("loaded, message", [
    ({}, "no 'score.weight'"),
    ({"weight": (3, 32), "bias": (3,)}, "score.bias"),
    ({"weight": (2, 32)}, "shape [2, 32], expected [3, 32]"),
])
def test_head_checks_refuse_missing_biased_or_misshapen_heads(loaded, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        weights.check_head_weights(loaded, num_labels=3, hidden_size=32)
    weights.check_head_weights({"weight": (3, 32)}, num_labels=3, hidden_size=32)


# ================================================================ pooling (pure + real Transformers)
def test_sglang_last_token_indices_in_a_packed_batch():
    assert pooling.sglang_last_token_indices([3, 1, 4]) == [2, 3, 7]
    with pytest.raises(ValueError):
        pooling.sglang_last_token_indices([2, 0])


def test_pooled_position_matches_transformers_except_when_the_input_ends_with_pad():
    import torch

    model = tiny_transformers_classifier()
    pad = model.config.get_text_config().pad_token_id
    for ids in ([5, 9, 17, 4], [pad, 7, 8], [5, 9, pad], [5, pad, pad], [pad, pad]):
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0]
        by_transformers = model.score(hidden[pooling.transformers_pool_index(ids, pad)])
        by_sglang = model.score(hidden[len(ids) - 1])
        torch.testing.assert_close(out.logits[0], by_transformers)  # the helper states Transformers' rule
        assert pooling.pooling_agrees(ids, pad) == (ids[-1] != pad)
        if ids[-1] != pad:
            torch.testing.assert_close(out.logits[0], by_sglang)
        elif set(ids) != {pad}:  # (an all-pad row embeds to zeros: both reads give zero logits)
            assert not torch.allclose(out.logits[0], by_sglang)
    assert pooling.transformers_pool_index([pad, pad], pad) == 0
    assert pooling.transformers_pool_index([3, 4], None) == 1


# ================================================================ launcher steps (pure)
def save_checkpoint_config(model, directory: Path) -> None:
    """config.json as a current Transformers writes it for the classifier (no top-level hidden_size)."""
    config = model.config.to_dict()
    config["architectures"] = ["Qwen3_5ForSequenceClassification"]
    config["torch_dtype"] = "float32"
    if "text_config" in config:
        config.pop("hidden_size", None)
        # A fine-tuned checkpoint inherits this from the base Qwen/Qwen3.5 config.json; a config built
        # from kwargs drops it (layer_types only), and SGLang derives the hybrid layout from it.
        config["text_config"]["full_attention_interval"] = TEXT_CONFIG["full_attention_interval"]
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def good_config() -> dict:
    return {"architectures": ["Qwen3_5ForSequenceClassification"], "model_type": "qwen3_5",
            "id2label": {"0": "contradiction", "1": "entailment", "2": "neutral"},
            "text_config": {"full_attention_interval": 2,
                            "layer_types": ["linear_attention", "full_attention"] * 2}}


def test_environment_sets_the_external_package_and_pythonpath():
    env = {"PYTHONPATH": "/x"}
    launch_server.prepare_environment(env)
    assert env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "sglang_openjev"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/x"]
    launch_server.prepare_environment(env)  # idempotent
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/x"]
    with pytest.raises(launch_server.LaunchError, match="SGLANG_EXTERNAL_MODEL_PACKAGE=other"):
        launch_server.prepare_environment({"SGLANG_EXTERNAL_MODEL_PACKAGE": "other"})


def test_argv_steps():
    argv = ["--model-path", "/m", "--port", "1"]
    assert launch_server.model_path_from_argv(argv) == "/m"
    assert launch_server.model_path_from_argv(["--model=/n"]) == "/n"
    assert launch_server.with_embedding_flag(argv) == [*argv, "--is-embedding"]
    assert launch_server.with_embedding_flag([*argv, "--is-embedding"]).count("--is-embedding") == 1
    assert launch_server.wants_help(["-h"]) and not launch_server.wants_help(argv)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["Qwen3_5ForConditionalGeneration"]}, "architectures"),
    ({"model_type": "qwen3_5_text"}, "qwen3_5_text"),
    ({"id2label": {"0": "entailment", "1": "neutral", "2": "contradiction"}}, "expected id2label"),
    ({"id2label": {"0": "a", "1": "b"}}, "3-label"),
    ({"text_config": {"layer_types": ["linear_attention", "full_attention", "full_attention"]}},
     "no full_attention_interval and its layer_types is not"),
    ({"text_config": {"layer_types": ["linear_attention"] * 4}}, "no full_attention_interval and its layer_types"),
    ({"text_config": {}}, "neither layer_types nor"),
    ({"text_config": {"full_attention_interval": 4, "layer_types": ["linear_attention", "full_attention"] * 2}},
     "does not follow full_attention_interval=4"),
])
def test_checkpoint_config_refusals(change, message):
    checkpoint.check_checkpoint_config(good_config())
    with pytest.raises(launch_server.LaunchError, match=message):
        checkpoint.check_checkpoint_config({**good_config(), **change})


def tiny_model_config(shape: str, interval: bool = True) -> dict:
    """config.json of app/make_tiny_model.py's SHAPE as save_pretrained writes it (no weights built);
    without INTERVAL, as Transformers writes a config built from layer_types alone."""
    import make_tiny_model
    config = make_tiny_model.build_config(shape, 0, 1).to_dict()
    config["architectures"] = ["Qwen3_5ForSequenceClassification"]
    if not interval:
        config["text_config"].pop("full_attention_interval")
    return config


def tiny_model_shapes() -> list[str]:
    import make_tiny_model
    return sorted(make_tiny_model.SHAPES)


STOCK_0_5_23 = launch_server.Runtime("stock", "0.5.23", "0.5.14")


@pytest.mark.parametrize("shape", tiny_model_shapes())
def test_every_tiny_model_shape_passes_the_launcher_preflight(shape):
    """make_tiny_model writes the interval as the published configs do; without it (Transformers keeps only
    layer_types for a config built from keyword arguments) the launcher derives it and passes it on."""
    config = tiny_model_config(shape)
    assert checkpoint.check_checkpoint_config(config) is None
    layer_types = config["text_config"]["layer_types"]
    assert checkpoint.interval_layout(config["text_config"]["full_attention_interval"], len(layer_types)) == layer_types
    interval = checkpoint.check_checkpoint_config(tiny_model_config(shape, interval=False))
    assert checkpoint.interval_layout(interval, len(layer_types)) == layer_types
    argv, note = launch_server.with_layout_override(["--model-path", "/m"], interval, STOCK_0_5_23)
    assert json.loads(argv[argv.index("--json-model-override-args") + 1]) == {
        "text_config": {"full_attention_interval": interval}}
    assert "layer_types only" in note


def test_layout_override_merges_with_the_operators_and_refuses_a_conflict():
    given = ["--json-model-override-args", '{"max_position_embeddings": 4096, "text_config": {"rms_norm_eps": 1e-5}}']
    argv, _ = launch_server.with_layout_override(given, 4, STOCK_0_5_23)
    assert json.loads(argv[1]) == {"max_position_embeddings": 4096,
                                   "text_config": {"rms_norm_eps": 1e-5, "full_attention_interval": 4}}
    argv, _ = launch_server.with_layout_override(['--json-model-override-args={"a": 1}'], 4, STOCK_0_5_23)
    assert argv == ['--json-model-override-args={"a":1,"text_config":{"full_attention_interval":4}}']
    for bad, message in (('{"text_config": {"full_attention_interval": 2}}', "layer_types follow 4"),
                         ("[1]", "JSON object"), ("{", "not valid JSON")):
        with pytest.raises(launch_server.LaunchError, match=message):
            launch_server.with_layout_override(["--json-model-override-args", bad], 4, STOCK_0_5_23)


@pytest.mark.parametrize("runtime", [launch_server.Runtime("stock", "0.5.14", "0.5.14"),
                                     launch_server.Runtime("fork", "0.5.13", "legacy"), None])
def test_layout_override_is_refused_with_the_key_where_sglang_replaces_sub_configs(runtime):
    with pytest.raises(launch_server.LaunchError, match=r'add "full_attention_interval": 4 to text_config'):
        launch_server.with_layout_override(["--model-path", "/m"], 4, runtime)


@pytest.mark.parametrize("argv, config, expected", [
    (["--dtype", "float16"], None, "float16"),
    (["--dtype=half"], None, "float16"),
    (["--dtype", "bfloat16"], {"dtype": "float16"}, "bfloat16"),
    ([], {"dtype": "bfloat16"}, "bfloat16"),
    (["--dtype", "auto"], {"torch_dtype": "float32"}, "float16"),
    ([], {"text_config": {"dtype": "bfloat16"}}, "bfloat16"),
    ([], {}, "float16"),
    ([], None, None),
])
def test_serving_dtype_as_sglang_chooses_it(argv, config, expected):
    assert launch_server.serving_dtype(argv, config) == expected


def test_conv_state_dtype_follows_the_serving_dtype_on_every_gpu():
    env: dict = {}
    assert "bfloat16" in launch_server.state_dtype_environment(env, "float16")
    assert env == {"SGLANG_MAMBA_CONV_DTYPE": "float16"}
    assert launch_server.state_dtype_environment(env, "float16") is None  # the operator's (or ours) kept
    with pytest.raises(launch_server.LaunchError, match="SGLANG_MAMBA_CONV_DTYPE=bfloat16, but the model is served in float16"):
        launch_server.state_dtype_environment({"SGLANG_MAMBA_CONV_DTYPE": "bfloat16"}, "float16")
    assert launch_server.state_dtype_environment({}, None).startswith("SGLANG_MAMBA_CONV_DTYPE left to SGLang")


def test_tree_core_is_python_where_the_bundled_rust_core_was_built_for_another_torch():
    env: dict = {}
    note = launch_server.tree_core_environment(env, "2.14.1", "2.11.0+cu130")
    assert env == {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"} and "built for torch 2.14.1" in note
    for same in ("2.14.1", "2.14.0+cu130"):
        env = {}
        assert launch_server.tree_core_environment(env, "2.14.1", same) is None and env == {}
    for untouched in ({"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}, {"SGLANG_RUST_BUILD_MODE": "force"}):
        env = dict(untouched)
        assert launch_server.tree_core_environment(env, "2.14.1", "2.11.0") is None and env == untouched
    assert launch_server.tree_core_environment({}, None, "2.11.0") is None  # no bundled Rust core
    with pytest.raises(launch_server.LaunchError, match="=rust, but SGLang's bundled Rust tree core was built for torch 2.14.1"):
        launch_server.tree_core_environment({"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "rust"}, "2.14.1", "2.11.0")


def test_environment_maps_the_processor_package_and_refuses_another():
    env: dict = {}
    launch_server.prepare_environment(env)
    assert env["SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE"] == "sglang_openjev.mm_processors"
    with pytest.raises(launch_server.LaunchError, match="SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE=x.y"):
        launch_server.prepare_environment({"SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE": "x.y"})


@pytest.mark.parametrize("vocab, context", [(248320, 8192), (512, 32768), (96, 64), (512, 30)])
def test_warmup_rows_share_a_prefix_and_fit_the_model(vocab, context):
    rows = warmup.warmup_rows(vocab, context)
    assert len(rows) == 3 and all(0 < len(r) < context for r in rows)
    assert all(warmup.FIRST_ID <= t < vocab for r in rows for t in r)
    shared = next(i for i, (a, b) in enumerate(zip(rows[0], rows[1])) if a != b)
    assert shared == min(warmup.PREFIX_TOKENS, context - 1 - warmup.SUFFIX_TOKENS) or context <= 64
    assert warmup.warmup_rows(vocab, context) == rows  # deterministic


def test_warmup_flag_joins_the_operators_list_once():
    name = warmup.NAME
    assert launch_server.with_warmup_flag(["--port", "1"], name) == ["--port", "1", "--warmups", name]
    assert launch_server.with_warmup_flag(["--warmups", "a,b"], name) == ["--warmups", f"a,b,{name}"]
    assert launch_server.with_warmup_flag(["--warmups=a"], name) == [f"--warmups=a,{name}"]
    once = launch_server.with_warmup_flag(["--warmups", name], name)
    assert once == ["--warmups", name] and launch_server.with_warmup_flag(once, name) == once


def test_warmup_sends_the_rows_twice_then_flushes(monkeypatch):
    """Through the runtime /classify uses, against the stand-in tokenizer manager; a flush refused while
    the scheduler is busy is retried for FLUSH_WAIT_S."""
    monkeypatch.setattr(warmup, "FLUSH_WAIT_S", 0.3)
    fake = FakeTokenizerManager(server_args_stub(), context_len=2048, vocab_size=96)
    runtime = routes.SGLangRuntime(lambda: None, lambda input_ids: SimpleNamespace(input_ids=input_ids))
    rows = asyncio.run(warmup.run_warmup(runtime, fake))
    assert [r.input_ids for r in fake.requests] == [rows, rows] and fake.flushes == [None]
    fake.flush_ok = False
    with pytest.raises(RuntimeError, match="could not be flushed afterwards within 0.3 s"):
        asyncio.run(warmup.run_warmup(runtime, fake))
    assert len(fake.flushes) > 2  # retried


def test_warmup_refuses_a_scheduler_that_runs_something_else(monkeypatch):
    fake = FakeTokenizerManager(server_args_stub(), context_len=2048, vocab_size=96)

    async def internal_state():
        return [{"attention_backend": "torch_native", "max_running_requests": 16}]

    fake.get_internal_state = internal_state
    monkeypatch.setitem(warmup.ASKED, "attention_backend", "triton")
    runtime = routes.SGLangRuntime(lambda: None, lambda input_ids: SimpleNamespace(input_ids=input_ids))
    with pytest.raises(RuntimeError, match="does not run what was asked: attention_backend: asked 'triton', "
                                           "the scheduler runs 'torch_native'"):
        asyncio.run(warmup.run_warmup(runtime, fake))
    assert fake.requests == []  # refused before any row


def test_asked_server_arguments_are_read_from_the_flags_given():
    argv = ["--attention-backend", "triton", "--dtype=float16", "--disable-radix-cache", "--port", "1",
            "--mamba-radix-cache-strategy", "extra_buffer", "--mamba-radix-cache-strategy", "no_buffer"]
    assert launch_server.asked_by(argv) == {"attention_backend": "triton", "dtype": "float16", "disable_radix_cache": True,
                                     "mamba_radix_cache_strategy": "no_buffer"}


def test_served_state_problems_name_a_fallback_and_too_few_state_slots():
    asked = {"attention_backend": "triton", "linear_attn_prefill_backend": "flashinfer", "dtype": "float16"}
    served = {"attention_backend": "triton", "linear_attn_prefill_backend": "triton", "dtype": "float16",
              "mamba_radix_cache_strategy": "extra_buffer", "disable_radix_cache": False,
              "max_mamba_cache_size": 79, "max_running_requests": 16}
    problems = warmup.served_state_problems(asked, served)
    assert problems[0] == "linear_attn_prefill_backend: asked 'flashinfer', the scheduler runs 'triton'"
    assert problems[1].startswith("79 GDN state slots for 16 running requests: extra_buffer needs 5 per request (80)")
    assert warmup.served_state_problems({**asked, "linear_attn_prefill_backend": "triton"},
                                        {**served, "max_mamba_cache_size": 80}) == []
    assert warmup.served_state_problems({}, {**served, "disable_radix_cache": True}) == []  # no cache: no rule
    assert warmup.served_state_problems({"disable_radix_cache": True}, {"disable_radix_cache": True}) == []


def test_preflight_reads_a_local_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(good_config()))
    launch_server.preflight_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(launch_server.LaunchError, match="cannot read"):
        launch_server.preflight_checkpoint(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(launch_server.LaunchError, match="not found"):
        launch_server.preflight_checkpoint(str(empty))
    launch_server.preflight_checkpoint("org/hub-id")  # not local: SGLang resolves it, no preflight


def test_launcher_refuses_modes_without_the_routes():
    ok = SimpleNamespace(is_embedding=True, tokenizer_worker_num=1)
    launch_server.check_server_args(ok)
    for bad, message in ((dict(is_embedding=False), "--is-embedding"), (dict(tokenizer_worker_num=2), "worker"),
                         (dict(enable_http2=True), "--enable-http2"), (dict(grpc_mode=True), "--grpc-mode")):
        with pytest.raises(launch_server.LaunchError, match=message):
            launch_server.check_server_args(SimpleNamespace(**{**vars(ok), **bad}))


def test_launcher_help_and_refusal_run_as_a_module(tmp_path):
    bad = tmp_path / "ckpt"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**good_config(), "model_type": "qwen3_5_text"}))
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_EXTERNAL_MODEL_PACKAGE"}
    proc = subprocess.run([sys.executable, "-m", "sglang_openjev.launch_server", "--model-path", str(bad)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("sglang_openjev.launch_server: error: config.json model_type")


# ================================================================ routes on a real HTTP server
class FakeTokenizerManager:
    """Stand-in for SGLang's TokenizerManager, the front of the GPU scheduler (the one stand-in).

    Logits are a deterministic function of the row, so order and row independence show.
    """

    def __init__(self, server_args, context_len=64, vocab_size=96):
        self.server_args = server_args
        self.served_model_name = "openjev-tiny"
        self.context_len = context_len
        self.num_reserved_tokens = 0
        self.model_config = SimpleNamespace(vocab_size=vocab_size)
        self.server_status = SimpleNamespace(name="Up")
        self.startup_time = time.time()  # 0.5.23's own /server_info reports it
        self.gracefully_exit = False
        self.tokenizer = lambda texts: {"input_ids": [[min(ord(c), vocab_size - 1) for c in t] for t in texts]}
        self.requests, self.flushes, self.flush_ok = [], [], True
        self.fail_with: Exception | None = None

    @staticmethod
    def logits_for(row):
        return [float(len(row)), float(sum(row) % 7) - 3.0, float(row[0]) / 8.0]

    def generate_request(self, obj, request=None):
        self.requests.append(obj)

        async def gen():
            if self.fail_with is not None:
                raise self.fail_with
            ids = obj.input_ids
            if ids and isinstance(ids[0], int):
                yield {"embedding": self.logits_for(ids), "meta_info": {}}
            else:
                yield [{"embedding": self.logits_for(r), "meta_info": {}} for r in ids]

        return gen()

    async def flush_cache(self, timeout_s=None):
        self.flushes.append(timeout_s)
        return SimpleNamespace(success=self.flush_ok, message="" if self.flush_ok else "busy: requests running")

    async def get_internal_state(self):
        return [{"fake_internal": True}]


def server_args_stub():
    return SimpleNamespace(model_path="/models/openjev", dtype="float16", device="cpu", schedule_policy="lpm",
                           max_running_requests=16, disable_radix_cache=False, mamba_scheduler_strategy="extra_buffer",
                           mamba_full_memory_ratio=3.0, attention_backend="tilelang_fa_v100",
                           linear_attn_prefill_backend="tilelang", linear_attn_decode_backend="triton",
                           disable_cuda_graph=True)


class LiveServer:
    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, lifespan="off",
                                                    log_level="warning", loop="asyncio"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise AssertionError("uvicorn did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def live():
    """The adapter's routes on a real uvicorn server; SGLang's app and request class when importable."""
    from sglang_openjev import routes

    state = SimpleNamespace(tokenizer_manager=None, template_manager=None,
                            scheduler_info={"max_req_input_len": 58, "max_total_num_tokens": 4096})
    env = {"OPENJEV_MAX_BATCH_SIZE": "4", "OPENJEV_ARCH_PROFILE": "sm70-tilelang"}
    if SGLANG_ERROR is None:
        from sglang.srt.entrypoints import http_server
        from sglang.srt.managers.io_struct import EmbeddingReqInput

        app, request_cls = http_server.app, EmbeddingReqInput
        previous = http_server.get_global_state()
        http_server.set_global_state(state)  # SGLang's own /server_info reads the same state
        get_state = http_server.get_global_state
    else:
        from fastapi import FastAPI

        app, request_cls, previous, get_state = FastAPI(), SimpleNamespace, None, (lambda: state)

        @app.post("/classify")
        async def sglang_style_classify():  # what install_routes must replace
            return {"embedding": "not the contract"}

    counters = routes.install_routes(app, routes.SGLangRuntime(get_state, request_cls), environ=env)
    server = LiveServer(app)
    yield SimpleNamespace(url=server.url, state=state, counters=counters, app=app)
    server.stop()
    if SGLANG_ERROR is None:
        http_server.set_global_state(previous)


@pytest.fixture
def tm(live):
    if SGLANG_ERROR is None:
        sa = sglang_server_args()
    else:
        sa = server_args_stub()
    fake = FakeTokenizerManager(sa)
    live.state.tokenizer_manager = fake
    yield fake
    live.state.tokenizer_manager = None


def post(live, path, payload=None, raw=None):
    import requests

    data = raw if raw is not None else json.dumps(payload)
    return requests.post(live.url + path, data=data, headers={"content-type": "application/json"}, timeout=30)


def test_classify_batch_and_single_rows_in_order(live, tm):
    rows = [[5, 6, 7], [9], [40, 41]]
    r = post(live, "/classify", {"input_ids": rows})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["labels"] == ["contradiction", "entailment", "neutral"]
    assert body["model"] == "openjev-tiny"
    assert body["logits"] == [FakeTokenizerManager.logits_for(x) for x in rows]
    sent = tm.requests[-1]
    assert sent.input_ids == rows and type(sent).__name__ in ("EmbeddingReqInput", "SimpleNamespace")
    r = post(live, "/classify", {"input_ids": [5, 6, 7]})
    assert r.json()["logits"] == [FakeTokenizerManager.logits_for([5, 6, 7])]
    assert tm.requests[-1].input_ids == [[5, 6, 7]]


def test_sglang_route_was_replaced(live):
    paths = [(getattr(r, "path", None), tuple(sorted(getattr(r, "methods", None) or ()))) for r in live.app.router.routes]
    classify_routes = [m for p, m in paths if p == "/classify"]
    # one route, with SGLang's own methods kept (SGLang registers POST and PUT; the fake app POST only)
    assert len(classify_routes) == 1 and set(classify_routes[0]) == ({"POST", "PUT"} if SGLANG_ERROR is None else {"POST"})
    assert sum(p == "/server_info" for p, _ in paths) == 1


@pytest.mark.parametrize("payload, raw, status, message", [
    (None, b"{not json", 400, "not valid JSON"),
    ({"input_ids": []}, None, 400, "empty"),
    ({"input_ids": [[1, 2], []]}, None, 400, "row 1 of 'input_ids' is empty"),
    ({"input_ids": [[1, 2.5]]}, None, 400, "not an integer"),
    ({"input_ids": [[1, 96]]}, None, 400, "out of vocabulary (vocab size 96)"),
    ({"input_ids": [[1] * 64]}, None, 400, "not below the server context length 64"),
    ({"input_ids": [[1] * 58]}, None, 400, "over this server's input limit of 57"),
    ({"input_ids": [[1]] * 5}, None, 413, "limit of 4"),
    ({"input_ids": [1], "text": "x"}, None, 400, "exactly one"),
])
def test_classify_errors(live, tm, payload, raw, status, message):
    r = post(live, "/classify", payload, raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["code"] == status
    assert err["type"] == (contract.TOO_LARGE if status == 413 else contract.BAD_REQUEST)
    assert tm.requests == []  # refused before anything reached the scheduler


def test_longest_accepted_input_reaches_the_runtime(live, tm):
    r = post(live, "/classify", {"input_ids": [[1] * 57]})
    assert r.status_code == 200, r.text


def test_runtime_validation_error_is_a_400_and_503_while_starting(live, tm):
    tm.fail_with = ValueError("The input (70 tokens) is longer than the model's context length (64 tokens).")
    r = post(live, "/classify", {"input_ids": [[1, 2]]})
    assert r.status_code == 400 and "rejected by the runtime" in r.json()["error"]["message"]
    tm.fail_with = None
    tm.server_status = SimpleNamespace(name="Starting")
    r = post(live, "/classify", {"input_ids": [[1, 2]]})
    assert r.status_code == 503 and r.json()["error"]["type"] == contract.UNAVAILABLE


def test_503_before_sglang_sets_its_state(live):
    assert live.state.tokenizer_manager is None
    for path in ("/classify", "/v1/classify"):
        assert post(live, path, {"input_ids": [[1]]}).status_code == 503
    import requests

    assert requests.get(live.url + "/server_info", timeout=10).status_code == 503


def test_text_input_uses_the_tokenizer(live, tm):
    r = post(live, "/classify", {"text": ["ab", "c"]})
    assert r.status_code == 200
    assert tm.requests[-1].input_ids == [[95, 95], [95]]  # ord() capped to the vocab by the fake tokenizer
    tm.tokenizer = None
    r = post(live, "/classify", {"text": "ab"})
    assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]


def test_v1_classify_softmax_by_default_and_raw_on_request(live, tm):
    rows = [[5, 6, 7], [9, 9]]
    soft = post(live, "/v1/classify", {"model": "openjev-tiny", "input": rows}).json()
    raw = post(live, "/v1/classify", {"model": "openjev-tiny", "input": rows, "use_activation": False}).json()
    assert soft["object"] == "list" and soft["model"] == "openjev-tiny"
    assert soft["usage"]["prompt_tokens"] == 5
    for i, row in enumerate(rows):
        logits = FakeTokenizerManager.logits_for(row)
        assert raw["data"][i]["probs"] == logits
        assert math.isclose(sum(soft["data"][i]["probs"]), 1.0, rel_tol=1e-9)
        assert soft["data"][i]["label"] == contract.LABELS[logits.index(max(logits))]
        assert soft["data"][i]["num_classes"] == 3 and soft["data"][i]["index"] == i
    assert post(live, "/v1/classify", {"model": "openjev-tiny", "input": [[1]] * 5}).status_code == 413


def test_flush_cache_counts_and_reports_failure(live, tm):
    import requests

    before = live.counters.flush_cache_calls
    r = requests.post(live.url + "/flush_cache", timeout=10)
    assert r.status_code == 200 and r.json()["flushed"] is True
    assert requests.get(live.url + "/flush_cache?timeout=2.5", timeout=10).status_code == 200
    assert tm.flushes == [None, 2.5]
    tm.flush_ok = False
    r = requests.post(live.url + "/flush_cache", timeout=10)
    assert r.status_code == 400 and "busy" in r.json()["error"]["message"]
    assert requests.post(live.url + "/flush_cache?timeout=x", timeout=10).status_code == 400
    assert live.counters.flush_cache_calls == before + 3
    info = requests.get(live.url + "/server_info", timeout=10).json()
    assert info["flush_cache_calls"] == before + 3 and info["flush_cache_failures"] >= 1


def test_server_info_has_the_contract_keys(live, tm):
    import requests

    info = requests.get(live.url + "/server_info", timeout=10).json()
    missing = [k for k in contract.SERVER_INFO_KEYS if k not in info]
    assert not missing
    assert info["backend"] == "sglang" and info["arch_profile"] == "sm70-tilelang"
    assert info["context_length"] == 64 and info["max_input_tokens"] == 57 and info["max_batch_size"] == 4
    from sglang_openjev.routes import mamba_strategy

    # --mamba-scheduler-strategy (fork, 0.5.13) is ServerArgs.mamba_radix_cache_strategy from 0.5.14 on
    assert info["mamba_scheduler_strategy"] == mamba_strategy(tm.server_args) is not None
    assert info["radix_cache"] is (not tm.server_args.disable_radix_cache)
    assert info["pid"] == os.getpid()
    assert set(info["bundle_git"]) >= {"commit", "dirty"}
    if SGLANG_ERROR is None:  # merged with SGLang's own /server_info
        assert info.get("internal_states") == [{"fake_internal": True}], info.get("sglang_server_info_error")
        assert "version" in info and "max_total_num_tokens" in info


def test_max_batch_size_env():
    from sglang_openjev import routes

    assert routes.max_batch_size({}) == 512
    assert routes.max_batch_size({"OPENJEV_MAX_BATCH_SIZE": "32"}) == 32
    for bad in ("0", "-1", "x"):
        with pytest.raises(ValueError, match="OPENJEV_MAX_BATCH_SIZE"):
            routes.max_batch_size({"OPENJEV_MAX_BATCH_SIZE": bad})


# ================================================================ SGLang's real classes (CPU engine)
_SGLANG_ARGS_CACHE: dict = {}


def sglang_server_args():
    """A real ServerArgs for a tiny local config (sglang venv only)."""
    if "sa" not in _SGLANG_ARGS_CACHE:
        import tempfile

        from sglang.srt.server_args import ServerArgs

        d = Path(tempfile.mkdtemp(prefix="openjev-sa-"))
        save_checkpoint_config(tiny_transformers_classifier(), d)
        sa = ServerArgs(model_path=str(d), device="cpu", is_embedding=True, skip_tokenizer_init=True,
                        dtype="float32", schedule_policy="lpm", max_running_requests=16)
        if hasattr(sa, "resolve_once"):  # 0.5.23 resolves on demand; its /server_info reads the result
            sa.resolve_once()
        _SGLANG_ARGS_CACHE["sa"] = sa
    return _SGLANG_ARGS_CACHE["sa"]


def published_runtime_context() -> bool:
    """SGLang >= 0.5.23: process-wide config published from ServerArgs (sglang/srt/runtime_context.py)
    and parallel groups built by sglang/srt/distributed/bootstrap.py. Looked up as a file, so
    nothing of SGLang is imported in the test process."""
    spec = importlib.util.find_spec("sglang")
    return bool(spec and spec.submodule_search_locations and
                any((Path(d) / "srt" / "distributed" / "bootstrap.py").is_file() for d in spec.submodule_search_locations))


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """Run the CPU-engine probe below in a fresh process and return its JSON report."""
    if SGLANG_ERROR is not None:
        pytest.skip(needs_sglang.kwargs["reason"])
    out = tmp_path_factory.mktemp("probe")
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_EXTERNAL_MODEL_PACKAGE": "sglang_openjev",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), str(REPO / "app"),
                                          os.environ.get("PYTHONPATH", "")])}
    if published_runtime_context():
        # sgl_kernel 0.4.10 (SGLang 0.5.23) cannot import without libcuda and falls back to a
        # `common_ops` module, which sglang_openjev_cpu provides (the project's stand-ins unless
        # OPENJEV_SGL_CPU_OPS names a built library); older releases import sgl_kernel without it.
        from sglang_openjev_cpu import runtime as cpu_runtime

        env.setdefault("OPENJEV_SGL_CPU_OPS", "standin")
        cpu_runtime.configure_environment(env)
    proc = subprocess.run([sys.executable, __file__, "--probe", str(out)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    report = out / "report.json"
    assert proc.returncode == 0 and report.exists(), f"probe failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(report.read_text())


@needs_sglang
def test_registry_discovers_the_architecture_from_the_package(probe):
    assert probe["registry"] == {"module": "sglang_openjev.qwen3_5_classification",
                                 "class": "Qwen3_5ForSequenceClassification",
                                 "arch": "Qwen3_5ForSequenceClassification"}
    assert probe["strict_import"] == ["Qwen3_5ForSequenceClassification"]  # every package module imports
    assert probe["is_generation"] is False and probe["hybrid_gdn"] is True


@needs_sglang
def test_sglang_loader_puts_the_checkpoint_in_place(probe):
    assert probe["model_class"] == "Qwen3_5ForSequenceClassification"
    assert probe["vision_params"] == 0 and probe["lm_head_params"] == 0
    assert probe["score_equal"] is True
    assert probe["backbone_mismatches"] == []
    assert probe["backbone_checked"] >= 20


@needs_sglang
def test_head_bias_in_the_checkpoint_is_refused(probe):
    assert "score.bias" in probe["bias_refusal"]


@needs_sglang
@pytest.mark.parametrize("case", strict_loading_cases.CASES)
def test_sglang_loader_refuses_a_corrupted_checkpoint_with_the_list(probe, case):
    """Through SGLang's real get_model/DefaultModelLoader: the start fails with every bad name."""
    result = probe["strict"][case]
    assert result["error"] is not None, f"SGLang's loader accepted the {case} checkpoint"
    assert result["error"].startswith("ValueError: refusing the checkpoint: ")
    for fragment in result["expect"]:
        assert fragment in result["error"]


@needs_sglang
def test_sglang_backbone_alone_would_take_an_oversized_tensor(probe):
    # why the adapter compares shapes itself: SGLang's sharded loader narrows the tensor silently
    assert probe["sglang_backbone_takes_oversized"] is True


@needs_sglang
def test_last_token_pooling_through_score_and_pool(probe):
    assert probe["pooled_indices"] == pooling.sglang_last_token_indices(probe["seq_lens"])
    assert probe["pooled_max_abs_err"] < 1e-6
    assert probe["pooled_shape"] == [len(probe["seq_lens"]), 3]


@needs_sglang
def test_server_args_treat_the_architecture_as_hybrid_gdn(probe):
    assert probe["server_args_before"]["uses_mamba_radix_cache"] is False
    after = probe["server_args_after"]
    assert after["uses_mamba_radix_cache"] is True
    # no_buffer + radix cache: SGLang's Qwen3.5 handling forces page size 1 and no overlap schedule
    assert after["page_size"] == 1 and after["disable_overlap_schedule"] is True


LAUNCH_PROBE = r"""
import json, os, sys
from pathlib import Path
from sglang_openjev import launch_server as ls

work = Path(sys.argv[1])
clean = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
out = {"layout": {}, "conv": {}}


def launch(argv):
    os.environ.clear()
    os.environ.update(clean)
    return ls.prepare_launch(argv, os.environ)


from sglang.srt.utils.hf_transformers.config import get_config

for shape in ("tiny", "qwen3.5-4b"):
    ckpt = str(work / f"{shape}-layer-types-only")
    try:
        argv, notes = launch(["--model-path", ckpt])
    except ls.LaunchError as exc:
        out["layout"][shape] = {"refused": str(exc)}
        continue
    i = argv.index("--json-model-override-args")
    cfg = get_config(ckpt, trust_remote_code=False, model_override_args=json.loads(argv[i + 1]))
    try:
        bare = get_config(ckpt, trust_remote_code=False).text_config.full_attention_layer_ids
    except AttributeError as exc:
        bare = f"AttributeError: {exc}"
    out["layout"][shape] = {"full_attention_ids": cfg.text_config.full_attention_layer_ids, "bare": bare,
                            "vision": type(cfg.vision_config).__name__}

from sglang.srt.configs.mamba_utils import mamba2_state_dtype

for dtype in ("float16", "bfloat16"):
    launch(["--model-path", str(work / "tiny"), "--dtype", dtype])
    d = mamba2_state_dtype(None)
    out["conv"][dtype] = {"conv": str(d.conv), "ssm": str(d.temporal)}

from sglang.srt.environ import envs
from sglang.srt.managers import multimodal_processor as mp

launch(["--model-path", str(work / "tiny"), "--dtype", "float16"])
mp.import_processors("sglang.srt.multimodal.processors")  # as SGLang's tokenizer manager does
stock = {c.__name__ for c in mp.PROCESSOR_MAPPING}
mp.import_processors(envs.SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE.get(), overwrite=True)
by = {c.__name__: p for c, p in mp.PROCESSOR_MAPPING.items()}
cls = by.get("Qwen3_5ForSequenceClassification")
out["processor"] = {"stock_has_it": "Qwen3_5ForSequenceClassification" in stock, "cls": cls and cls.__name__, "base": by["Qwen3_5ForConditionalGeneration"].__name__,
                    "subclass": bool(cls) and issubclass(cls, by["Qwen3_5ForConditionalGeneration"])}
import argparse
from sglang_openjev import warmup
from sglang.srt.entrypoints import warmup as sglang_warmup
from sglang.srt.server_args import ServerArgs

argv, _, _ = ls.adapt_to_runtime(["--model-path", str(work / "tiny")], os.environ)
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)  # SGLang's own flags (its checks past parsing need a GPU for extra_buffer)
out["warmup"] = {"registered": sglang_warmup._warmup_registry.get(warmup.NAME) is warmup.classifier_warmup,
                 "argv": argv, "parsed": parser.parse_args(argv).warmups}
print(json.dumps(out))
"""


def write_tiny_config(shape: str, directory: Path, interval: bool = True) -> dict:
    config = tiny_model_config(shape, interval)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return config


@pytest.fixture(scope="module")
def launch_probe(tmp_path_factory):
    """One fresh process of this interpreter: the launcher's pre-SGLang phase (prepare_launch), then what
    SGLang itself does with its result: the config and layer layout (get_config), the conv-state dtype
    (mamba2_state_dtype) and the multimodal-processor lookup of its tokenizer manager."""
    if SGLANG_ERROR is not None:
        pytest.skip(needs_sglang.kwargs["reason"])
    work = tmp_path_factory.mktemp("launch_probe")
    configs = {shape: write_tiny_config(shape, work / f"{shape}-layer-types-only", interval=False)
               for shape in ("tiny", "qwen3.5-4b")}
    write_tiny_config("tiny", work / "tiny")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", LAUNCH_PROBE, str(work)], capture_output=True, text=True, cwd=work,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), configs


@needs_sglang
@pytest.mark.parametrize("shape", ["tiny", "qwen3.5-4b"])
def test_a_layer_types_only_checkpoint_builds_sglangs_layout(launch_probe, shape):
    """Through SGLang's own get_config with the launcher's arguments: the hybrid layout SGLang builds is
    the checkpoint's layer_types. Without the interval SGLang's config has no layout at all; SGLang
    before 0.5.23 replaces a text_config override instead of merging it, so the launcher refuses there."""
    probe, configs = launch_probe
    got = probe["layout"][shape]
    if launch_server._release(launch_server.detect_runtime().version) < launch_server.NESTED_OVERRIDE_SINCE:
        assert 'add "full_attention_interval": 4 to text_config' in got["refused"]
        return
    layer_types = configs[shape]["text_config"]["layer_types"]
    assert got["full_attention_ids"] == [i for i, t in enumerate(layer_types) if t == "full_attention"]
    assert str(got["bare"]).startswith("AttributeError")  # what SGLang alone does with this checkpoint
    assert got["vision"] != "dict"  # the override merged into the sub-config, not replaced it


@needs_sglang
def test_the_classifier_architecture_has_sglangs_qwen3_5_processor(launch_probe):
    got = launch_probe[0]["processor"]
    assert got["stock_has_it"] is False  # SGLang alone: "No processor registered for architecture"
    assert got["cls"] == "Qwen3_5ClassifierProcessor" and got["subclass"] is True, got


@needs_sglang
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sglangs_conv_state_pool_takes_the_serving_dtype(launch_probe, dtype):
    assert launch_probe[0]["conv"][dtype] == {"conv": f"torch.{dtype}", "ssm": "torch.float32"}


@needs_sglang
def test_sglang_runs_the_classifier_warmup_before_listening(launch_probe):
    got = launch_probe[0]["warmup"]
    assert got["registered"] is True
    assert got["parsed"] == warmup.NAME and got["argv"][-2:] == ["--warmups", warmup.NAME]


@needs_sglang
def test_the_installed_sglangs_rust_tree_core_and_torch_are_read():
    """What the launcher reads of the installed SGLang: 0.5.23 bundles a Rust tree core built for the
    torch it pins (2.14.1, which its venv installs: no change); older versions bundle none."""
    built_for, installed = launch_server.bundled_tree_core_torch()
    import torch

    assert installed == importlib.metadata.version("torch") and installed.split("+")[0] == torch.__version__.split("+")[0]
    has_core = any((Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt" / "mem_cache"
                    / "rust_tree_core").glob("mem_cache*.so"))
    assert (built_for is not None) == has_core
    if built_for is not None:
        assert built_for in [r.split("==")[1] for r in importlib.metadata.requires("sglang") if r.startswith("torch==")]
        env: dict = {}
        expect_change = built_for.split(".")[:2] != installed.split(".")[:2]
        assert (launch_server.tree_core_environment(env, built_for, installed) is not None) == expect_change


def cpu_only_torch_device_module(torch) -> None:
    """Make a CUDA build of torch on a machine without an NVIDIA driver answer like a CPU build.

    SGLang's Qwen3.5 GDN layer places a norm on `torch.get_device_module().current_device()`. A CPU
    build of torch returns torch.cpu there ("cpu"); a CUDA build returns torch.cuda even with no
    driver (torch._C._accelerator_getAccelerator is the compiled-in accelerator), and the model
    build fails with "Found no NVIDIA driver". Only the no-argument call is redirected, in this
    process only; no installed file is touched. Nothing when a GPU is usable.
    """
    if torch.cuda.is_available() or getattr(torch.get_device_module, "_openjev_cpu", False):
        return
    original = torch.get_device_module

    def get_device_module(device=None):
        return original("cpu" if device is None else device)

    get_device_module._openjev_cpu = True
    torch.get_device_module = get_device_module


def _probe(out_dir: str) -> None:  # pragma: no cover - runs in a subprocess
    """SGLang CPU engine, tp=1, gloo: registry, model loader, pooling. Writes out_dir/report.json."""
    import dataclasses

    if published_runtime_context():
        from sglang_openjev_cpu import runtime as cpu_runtime

        cpu_runtime.install()  # before sgl_kernel is imported (the fixture chose the ops)
    import torch
    from safetensors.torch import save_file

    cpu_only_torch_device_module(torch)
    report: dict = {}
    out = Path(out_dir)
    ckpt = out / "checkpoint"  # under the test's tmp dir
    ckpt.mkdir(exist_ok=True)
    model = tiny_transformers_classifier()
    save_checkpoint_config(model, ckpt)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = torch.randn(TEXT_CONFIG["vocab_size"], TEXT_CONFIG["hidden_size"])
    state["mtp.fc.weight"] = torch.randn(4, 4)
    save_file(state, str(ckpt / "model.safetensors"))

    from sglang.srt.configs import linear_attn_model_registry
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_loader import get_model
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt.models.registry import ModelRegistry, import_model_classes
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    def args_view(sa):
        view = sa
        if published_runtime_context():  # 0.5.23 resolves on demand, never mutating ServerArgs: read what
            from sglang.srt.arg_groups.model_override_base import resolved_view  # resolution declared

            sa.resolve_once()
            view = resolved_view(sa)
        return {k: getattr(view, k, None) for k in ("uses_mamba_radix_cache", "page_size", "disable_overlap_schedule",
                                                   "mamba_scheduler_strategy", "disable_radix_cache")}

    base = dict(model_path=str(ckpt), device="cpu", is_embedding=True, skip_tokenizer_init=True, dtype="float32")
    if published_runtime_context():
        # 0.5.23's argument pipeline: "auto" picks extra_buffer for an admitted hybrid architecture
        # (GPU state snapshots, refused on CPU), and an explicit no_buffer must come with the overlap
        # schedule off (older releases switch it off themselves, which the test checks there)
        base.update(mamba_radix_cache_strategy="no_buffer", disable_overlap_schedule=True)
    report["server_args_before"] = args_view(ServerArgs(**base))
    launch_server.register_hybrid_architectures()
    assert linear_attn_model_registry.get_linear_attn_spec_by_arch("Qwen3_5ForSequenceClassification") is not None
    sa = ServerArgs(**base)
    report["server_args_after"] = args_view(sa)
    set_global_server_args_for_scheduler(sa)

    cls, arch = ModelRegistry.resolve_model_cls(["Qwen3_5ForSequenceClassification"])
    report["registry"] = {"module": cls.__module__, "class": cls.__name__, "arch": arch}
    report["strict_import"] = sorted(import_model_classes.__wrapped__("sglang_openjev", strict=True))

    mc = ModelConfig.from_server_args(sa)
    report["is_generation"] = mc.is_generation
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig
    report["hybrid_gdn"] = isinstance(mc.hf_config.get_text_config(), Qwen3NextConfig)
    load_config = LoadConfig(load_format=sa.load_format)
    mc = adjust_config_with_unaligned_cpu_tp(mc, load_config, 1)  # what ModelRunner does on CPU
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if published_runtime_context():  # what 0.5.23's scheduler process does before it loads the model
        from sglang.srt.distributed import bootstrap
        from sglang.srt.runtime_context import SpawnRanks, publish

        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
        bootstrap.init_parallel_runtime(server_args=sa, device="cpu", dist_port=port)
        bootstrap.init_layer_runtime(model_config=mc)
    else:
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1)
        initialize_dp_attention(sa, mc)
    model_cls, _ = get_model_architecture(mc)
    assert model_cls is cls
    sg = get_model(model_config=mc, load_config=load_config, device_config=DeviceConfig("cpu"))
    report["model_class"] = type(sg).__name__
    params = dict(sg.named_parameters())
    report["vision_params"] = sum("visual" in n for n in params)
    report["lm_head_params"] = sum("lm_head" in n for n in params)
    report["score_equal"] = bool(torch.equal(params["score.weight"], state["score.weight"]))

    # Every backbone tensor of the checkpoint, compared with the slice of SGLang's (fused) parameter.
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
             "in_proj_qkv": ("in_proj_qkvz", 0), "in_proj_z": ("in_proj_qkvz", 1),
             "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)}
    groups: dict = {}
    mismatches, checked = [], 0
    for name, tensor in state.items():
        kind, inner = weights.route_weight(name)
        if kind != weights.BACKBONE:
            continue
        inner = inner.replace(".self_attn.", ".")
        parts = inner.split(".")
        if len(parts) >= 2 and parts[-2] in fused:
            target, slot = fused[parts[-2]]
            key = "model." + ".".join([*parts[:-2], target, parts[-1]])
            groups.setdefault(key, {})[slot] = tensor
            continue
        key = "model." + inner
        got = params.get(key)
        checked += 1
        if got is not None and key.endswith("embed_tokens.weight"):
            got = got[: tensor.shape[0]]  # VocabParallelEmbedding pads the vocabulary to a multiple of 64
        if got is None or got.numel() != tensor.numel() or not torch.equal(got.reshape(tensor.shape), tensor):
            mismatches.append(key)
    for key, slots in groups.items():
        expected = torch.cat([slots[i] for i in sorted(slots)], dim=0)
        checked += 1
        if key not in params or not torch.equal(params[key], expected):
            mismatches.append(key)
    report["backbone_mismatches"], report["backbone_checked"] = mismatches, checked

    try:
        sg.load_weights(iter([("score.weight", state["score.weight"]), ("score.bias", torch.zeros(3))]))
        report["bias_refusal"] = ""
    except ValueError as exc:
        report["bias_refusal"] = str(exc)

    # Strict loading through SGLang's real DefaultModelLoader (file discovery, index filtering,
    # safetensors iterator, load_weights): each corrupted checkpoint must be refused with its list.
    from strict_loading_cases import CASES, RESHAPED, write_case

    report["strict"] = {}
    for case in CASES:
        case_dir = out / f"strict-{case}"
        expect = write_case(ckpt, case_dir, case)
        case_mc = adjust_config_with_unaligned_cpu_tp(
            ModelConfig.from_server_args(ServerArgs(**{**base, "model_path": str(case_dir)})), load_config, 1)
        try:
            get_model(model_config=case_mc, load_config=load_config, device_config=DeviceConfig("cpu"))
            report["strict"][case] = {"expect": expect, "error": None}
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            report["strict"][case] = {"expect": expect, "error": f"{type(exc).__name__}: {exc}"}
    # Why the adapter checks shapes itself: SGLang's own backbone loader takes an oversized tensor.
    good = state[RESHAPED]
    try:
        sg.model.load_weights(iter([(weights.route_weight(RESHAPED).name, torch.cat([good, good[:8]]))]))
        report["sglang_backbone_takes_oversized"] = True
    except Exception:  # noqa: BLE001
        report["sglang_backbone_takes_oversized"] = False

    seq_lens = [3, 1, 4]
    total = sum(seq_lens)
    hidden = torch.randn(total, TEXT_CONFIG["hidden_size"])
    fields = {f.name for f in dataclasses.fields(ForwardBatch)}
    fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=len(seq_lens),
                      input_ids=torch.arange(total), req_pool_indices=torch.arange(len(seq_lens)),
                      seq_lens=torch.tensor(seq_lens), out_cache_loc=torch.arange(total), seq_lens_sum=total,
                      **{k: v for k, v in dict(extend_seq_lens=torch.tensor(seq_lens),
                                               extend_seq_lens_cpu=seq_lens).items() if k in fields})
    from sglang.srt.layers.pooler import score_and_pool

    with torch.no_grad():
        pooled = score_and_pool(sg.score, sg.pooler, hidden, fb, fb.input_ids).embeddings
    idx = pooling.sglang_last_token_indices(seq_lens)
    expected = hidden[idx] @ state["score.weight"].T
    report.update(seq_lens=seq_lens, pooled_indices=idx, pooled_shape=list(pooled.shape),
                  pooled_max_abs_err=float((pooled - expected).abs().max()))
    (out / "report.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        _probe(sys.argv[2])
        os._exit(0)  # skip torch.distributed teardown noise
    sys.exit(f"usage: {sys.argv[0]} --probe OUT_DIR (run by the tests)")


# ---------------------------------------------------------------- strict loading
def test_unexpected_or_duplicated_checkpoint_tensors_are_refused_with_the_list():
    weights.check_checkpoint_names([], [])  # a clean checkpoint passes
    with pytest.raises(ValueError, match=r"1 unexpected tensor\(s\): backbone\.layers\.0\.x"):
        weights.check_checkpoint_names(["backbone.layers.0.x"], [])
    with pytest.raises(ValueError, match=r"given more than once: model\.norm\.weight"):
        weights.check_checkpoint_names([], ["model.norm.weight"])
    # the documented ignored prefixes are SKIP routes, never "unexpected"
    for name in ("lm_head.weight", "mtp.layers.0.w", "model.visual.blocks.0.w"):
        assert weights.route_weight(name).kind == weights.SKIP
    # a renamed backbone key is unexpected
    assert weights.route_weight("backbone.layers.0.mlp.up_proj.weight").kind == weights.UNEXPECTED


def test_expected_backbone_shapes_are_what_transformers_saves():
    """The adapter's table of checkpoint tensors equals a real Transformers Qwen3.5 state dict."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    model = tiny_transformers_classifier()
    text = model.config.get_text_config()
    got = {r.name: tuple(t.shape) for name, t in model.state_dict().items()
           if (r := weights.route_weight(name)).kind == weights.BACKBONE}
    assert weights.compare_shapes(got, weights.expected_backbone_shapes(text, text.layer_types)) == ([], [], [])
    sglang_layout = ["attention" if t == "full_attention" else t for t in text.layer_types]  # layers_block_type
    assert weights.expected_backbone_shapes(text, sglang_layout) == weights.expected_backbone_shapes(
        text, text.layer_types)
    biased = Qwen3_5TextConfig(**TEXT_CONFIG, attention_bias=True)
    got = {k: tuple(v.shape) for k, v in m.Qwen3_5TextModel(biased).state_dict().items()}
    assert weights.compare_shapes(got, weights.expected_backbone_shapes(biased, biased.layer_types)) == ([], [], [])
    with pytest.raises(ValueError, match="layer 0 has type 'mamba'"):
        weights.expected_backbone_shapes(text, ["mamba"])


def test_loading_problems_list_every_kind_with_exact_counts():
    many = [f"backbone.layers.{i}.w" for i in range(25)]
    problems = weights.loading_problems(missing=["a"], unexpected=many, duplicated=["b"], mismatched=["c [2] (expected [3])"])
    assert problems[0] == "1 missing tensor(s): a"
    assert problems[1].startswith("25 unexpected tensor(s): backbone.layers.0.w,") and problems[1].endswith("... and 5 more")
    assert problems[2:] == ["1 tensor name(s) given more than once: b", "1 tensor(s) of the wrong shape: c [2] (expected [3])"]
    with pytest.raises(ValueError, match="^refusing the checkpoint: 1 missing tensor"):
        weights.refuse_if_problems(problems)
    weights.refuse_if_problems([])  # nothing to refuse
    assert weights.is_ignored("lm_head.weight") and weights.is_ignored("mtp.fc.weight")
    assert not weights.is_ignored("model.language_model.norm.weight")
