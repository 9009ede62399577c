"""make_tiny_model.py builds a real Transformers Qwen3.5 3-label classifier, offline."""

from __future__ import annotations

import json

import torch

from conftest import error_lines, run_script


def test_checkpoint_is_a_qwen3_5_classifier_with_ordered_labels(tiny_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = json.loads((tiny_model["checkpoint"] / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and cfg["architectures"] == ["Qwen3_5ForSequenceClassification"]
    assert cfg["id2label"] == {"0": "contradiction", "1": "entailment", "2": "neutral"}
    assert cfg["text_config"]["layer_types"].count("full_attention") == 1  # hybrid: GDN + full attention
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model["checkpoint"]).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model["checkpoint"])
    assert tok.pad_token_id == cfg["text_config"]["pad_token_id"]
    ids = tok("Premise: a dog runs. Hypothesis: an animal moves.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 3) and torch.isfinite(logits).all()
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        assert json.loads((tiny_model["processor"] / name).read_text())["processor_class"]


def test_same_seed_same_weights(tmp_path, tiny_model):
    run_script("make_tiny_model.py", tmp_path / "again", check=True)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == \
        (tiny_model["checkpoint"] / "model.safetensors").read_bytes()


def test_refuses_existing_output(tmp_path):
    (tmp_path / "out").mkdir()
    proc = run_script("make_tiny_model.py", tmp_path / "out")
    assert proc.returncode == 1 and len(error_lines(proc.stderr)) == 1 and "already exists" in proc.stderr
    assert list((tmp_path / "out").iterdir()) == []
