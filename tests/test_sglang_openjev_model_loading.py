"""The SGLang adapter through SGLang's real classes (skipped without sglang, reason shown by `pytest -rs`).

A fresh process with SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1, gloo, tp=1) discovers the
architecture through SGLANG_EXTERNAL_MODEL_PACKAGE, builds it with SGLang's model loader from a tiny
safetensors checkpoint saved by Transformers, and pools with SGLang's score_and_pool on a real
ForwardBatch. The same loader (get_model -> DefaultModelLoader -> safetensors iterator -> load_weights)
must refuse the five corrupted checkpoints of tests/strict_loading_cases.py (strict loading).
With a CUDA build of torch and no driver, `cpu_only_torch_device_module` makes the probe's torch
answer like a CPU build (see there). Run as `python tests/test_sglang_openjev_model_loading.py --probe OUT_DIR`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

import strict_loading_cases
from _sglang_support import SGLANG_ERROR, TEXT_CONFIG, needs_sglang, save_checkpoint_config, tiny_transformers_classifier

from sglang_openjev import launch_server, pooling, weights


# ================================================================ SGLang's real classes (CPU engine)
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
    for _ in range(3):  # the probe's distributed port is free when picked, but another process may take it first
        proc = subprocess.run([sys.executable, __file__, "--probe", str(out)], capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=600)
        if "EADDRINUSE" not in proc.stderr:
            break
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
