"""What the SGLang adapter's tests share (tests/test_sglang_openjev_*.py, tests/test_sglang_routes_front.py).

- Whether sglang is importable here (SGLANG_ERROR, the `needs_sglang` skip mark); with
  OPENJEV_REQUIRE_SGLANG=1 (`make test-sglang`) importing this module fails instead.
- A random-weight Transformers Qwen3.5 classifier (no download), its config.json as a checkpoint
  holds it, and the config of app/make_tiny_model.py's shapes.
- The one stand-in of the route tests: SGLang's tokenizer manager (the front of the GPU scheduler),
  a ServerArgs-like stub, and a real uvicorn server on 127.0.0.1 for an app.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest


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
    # `make test` runs the adapter's test modules in each real-SGLang venv with this set: no silent skips there.
    raise RuntimeError(f"OPENJEV_REQUIRE_SGLANG=1 but sglang is not importable: {SGLANG_ERROR}")
needs_sglang = pytest.mark.skipif(
    SGLANG_ERROR is not None,
    reason=f"sglang is not importable here ({SGLANG_ERROR}); the project venv and CI do not install it: run "
           "with a venv that has sglang 0.5.13 (`make test-sglang` makes one: tests/README.md)")


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


# ---------------------------------------------------------------- checkpoint configs
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


def tiny_model_config(shape: str, interval: bool = True) -> dict:
    """config.json of app/make_tiny_model.py's SHAPE as save_pretrained writes it (no weights built);
    without INTERVAL, as Transformers writes a config built from layer_types alone."""
    import make_tiny_model
    config = make_tiny_model.build_config(shape, 0, 1).to_dict()
    config["architectures"] = ["Qwen3_5ForSequenceClassification"]
    if not interval:
        config["text_config"].pop("full_attention_interval")
    return config


# ---------------------------------------------------------------- the route tests' stand-ins
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
