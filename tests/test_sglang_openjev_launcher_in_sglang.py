"""The SGLang adapter's launcher as SGLang takes its result (skipped without sglang, reason shown by
`pytest -rs`): in a fresh process, the launcher's pre-SGLang phase (prepare_launch), then SGLang's own
config and layer layout (get_config), conv-state dtype (mamba2_state_dtype), multimodal-processor
lookup and warm-up registry; and the installed SGLang's bundled Rust tree core and torch as the
launcher reads them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _sglang_support import SGLANG_ERROR, needs_sglang, tiny_model_config

from sglang_openjev import launch_server, warmup

REPO = Path(__file__).resolve().parents[1]


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
