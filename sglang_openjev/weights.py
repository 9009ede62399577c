"""Checkpoint weight names of a Transformers Qwen3.5 classifier -> the SGLang adapter's modules.

Pure functions (no torch, no sglang), so the mapping is tested everywhere.

Transformers' `Qwen3_5ForSequenceClassification` is `GenericForSequenceClassification` over the
multimodal `Qwen3_5Model`, so its state dict reads

    model.language_model.{embed_tokens,layers.N.*,norm}.*   the text backbone
    model.visual.*                                          the vision tower (unused for text)
    score.weight                                            nn.Linear(hidden, num_labels, bias=False)

and `Qwen3_5TextForSequenceClassification` (text-only `Qwen3_5TextModel`) puts the backbone
directly under `model.`. A checkpoint converted from a causal LM may also carry `lm_head.*` and
the multi-token-prediction head `mtp.*`.

The adapter holds SGLang's own text backbone (`sglang.srt.models.qwen3_5.Qwen3_5ForCausalLM`,
which despite its name has no LM head) as `self.model`. Its `load_weights` takes names relative
to itself (`layers.3.self_attn.q_proj.weight`, `embed_tokens.weight`, ...) and does the fused
q/k/v, gate/up and GDN in_proj_{qkv,z,b,a} stacking itself, so the adapter only strips the
prefix and routes the head.
"""

from __future__ import annotations

from typing import NamedTuple

BACKBONE = "backbone"   # hand to the SGLang backbone's load_weights under `name`
HEAD = "head"           # the classification head `score`; `name` is the parameter (weight/bias)
SKIP = "skip"           # not used by a text classifier; `name` says why
UNEXPECTED = "unexpected"  # not a Qwen3.5 classifier weight at all

# Longest prefix first: "model.language_model." must win over "model.".
BACKBONE_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
SKIPPED_PREFIXES = {
    "lm_head.": "the classifier has no language-model head",
    "model.visual.": "the text classifier runs the language backbone only",
    "visual.": "the text classifier runs the language backbone only",
    "mtp.": "multi-token-prediction head, unused by a classifier",
    "model.mtp.": "multi-token-prediction head, unused by a classifier",
}
HEAD_PREFIX = "score."


class Route(NamedTuple):
    kind: str
    name: str


def route_weight(name: str) -> Route:
    """Where checkpoint tensor `name` goes."""
    if name.startswith(HEAD_PREFIX):
        return Route(HEAD, name[len(HEAD_PREFIX):])
    for prefix, why in SKIPPED_PREFIXES.items():
        if name.startswith(prefix):
            return Route(SKIP, why)
    for prefix in BACKBONE_PREFIXES:
        if name.startswith(prefix):
            return Route(BACKBONE, name[len(prefix):])
    return Route(UNEXPECTED, name)


def check_head_weights(loaded: dict[str, tuple[int, ...]], num_labels: int, hidden_size: int) -> None:
    """Refuse a checkpoint whose `score` head is missing, biased or of the wrong shape.

    `loaded` maps the head parameter names seen in the checkpoint to their shapes. Transformers'
    GenericForSequenceClassification head is `nn.Linear(hidden, num_labels, bias=False)`;
    dropping a bias silently would change every logit, so a bias is an error, not a warning.
    """
    if "weight" not in loaded:
        raise ValueError("the checkpoint has no 'score.weight': it is not a sequence-classification "
                         "checkpoint (a causal-LM or base checkpoint has no classifier head)")
    extra = sorted(set(loaded) - {"weight"})
    if extra:
        raise ValueError(f"the checkpoint has score.{', score.'.join(extra)}, but Transformers' "
                         "Qwen3.5 classification head is nn.Linear(hidden, num_labels, bias=False)")
    shape = tuple(loaded["weight"])
    if shape != (num_labels, hidden_size):
        raise ValueError(f"score.weight has shape {list(shape)}, expected [{num_labels}, {hidden_size}] "
                         "(num_labels x hidden_size from the config)")
