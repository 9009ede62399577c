"""The checkpoint's config.json as the launcher checks it before SGLang starts: the architecture this adapter
serves, and the hybrid layer layout (full_attention_interval, or derived from layer_types as Transformers does)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Mapping, Optional

from sglang_openjev import contract

logger = logging.getLogger("sglang_openjev.launch_server")  # the launcher's log, where these checks run

ARCHITECTURES = ("Qwen3_5ForSequenceClassification",)
MODEL_TYPE = "qwen3_5"


class LaunchError(Exception):
    """A refusal the operator can act on: one line on stderr, exit status 1."""


def check_checkpoint_config(config: Mapping) -> Optional[int]:
    """Refuse a config this adapter cannot serve, with the reason. Returns the full-attention
    interval SGLang must be given when the config has layer_types only, else None."""
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
    interval = check_hybrid_layout(config.get("text_config") or {})
    num_labels = config.get("num_labels", len(config.get("id2label") or {}) or None)
    try:
        contract.check_label_order(config.get("id2label"), num_labels)
    except ValueError as exc:
        raise LaunchError(f"config.json: {exc}") from None
    return interval


def interval_layout(interval: int, layers: int) -> list[str]:
    """The layer layout SGLang builds from full_attention_interval (`configs/qwen3_next.py`)."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def check_hybrid_layout(text_config: Mapping) -> Optional[int]:
    """SGLang derives which layers are full attention from text_config.full_attention_interval alone
    and ignores layer_types; Transformers reads layer_types. Returns the interval SGLang must be
    given when the config has layer_types only (None when it has the interval); refuses a layout
    SGLang cannot build."""
    interval = text_config.get("full_attention_interval")
    layer_types = list(text_config.get("layer_types") or [])
    if interval is None and layer_types:
        first = layer_types.index("full_attention") + 1 if "full_attention" in layer_types else 0
        if first and layer_types == interval_layout(first, len(layer_types)):
            return first
        raise LaunchError("config.json text_config has no full_attention_interval and its layer_types is not a "
                          "full-attention layer every N layers, the only layout SGLang builds")
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise LaunchError("config.json text_config has neither layer_types nor a positive integer "
                          "full_attention_interval, from which SGLang derives the hybrid layer layout")
    if layer_types and layer_types != interval_layout(interval, len(layer_types)):
        raise LaunchError(f"config.json text_config.layer_types does not follow full_attention_interval={interval}; "
                          "SGLang would build a different layer layout than Transformers")
    return None


def preflight_checkpoint(model_path: Optional[str]) -> tuple[Optional[dict], Optional[int]]:
    """The checkpoint's config.json, checked, and the interval check_checkpoint_config returns
    ((None, None) when the model is not a local directory)."""
    if not model_path:
        return None, None  # SGLang reports the missing --model-path itself
    path = Path(model_path).expanduser()
    if not path.is_dir():
        logger.warning("%s is not a local directory; skipping the label-order preflight", model_path)
        return None, None
    cfg = path / "config.json"
    try:
        config = json.loads(cfg.read_text())
    except FileNotFoundError:
        raise LaunchError(f"{cfg} not found: CHECKPOINT must be a Transformers model directory") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise LaunchError(f"cannot read {cfg}: {exc}") from None
    if not isinstance(config, dict):
        raise LaunchError(f"{cfg} is not a JSON object")
    return config, check_checkpoint_config(config)
