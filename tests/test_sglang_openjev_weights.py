"""The SGLang adapter's weight routing and strict-loading checks (`sglang_openjev/weights.py`), pure: every
tensor name of a real Transformers Qwen3.5 classifier's state dict routes to the backbone, the head or a
stated skip; the head checks; unexpected, duplicated, missing or misshapen tensors are refused with the
list. The same refusals through SGLang's own loader: tests/test_sglang_openjev_model_loading.py.
"""

from __future__ import annotations

import pytest
from _sglang_support import TEXT_CONFIG, tiny_transformers_classifier

from sglang_openjev import weights


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
