"""The SGLang adapter's launcher (`sglang_openjev/launch_server.py`, `sglang_openjev/checkpoint.py`), its pure
steps: the environment it sets, argv edits, the checkpoint-config preflight and the layer-layout
override, the serving and conv-state dtypes, the tree-core backend, the server-argument refusals, and
the module run as a process. What SGLang itself does with the result:
tests/test_sglang_openjev_launcher_in_sglang.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _sglang_support import tiny_model_config

from sglang_openjev import checkpoint, launch_server

REPO = Path(__file__).resolve().parents[1]


# ================================================================ launcher steps (pure)
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
