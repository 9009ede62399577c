# Out-of-tree SGLang model: Qwen3.5 (hybrid Gated-DeltaNet + full attention) sequence classifier.
#
# Loaded by SGLang itself: with SGLANG_EXTERNAL_MODEL_PACKAGE=sglang_openjev,
# `sglang.srt.models.registry` imports every module of this package and registers each
# `EntryClass` under its class name, which must equal the checkpoint's `architectures[0]`.
# Modelled on SGLang's own `models/qwen3_classification.py`.
"""Qwen3.5 sequence classification for SGLang (Transformers' GenericForSequenceClassification head)."""

import logging
from typing import Iterable, Optional, Tuple

import torch
from torch import nn

from sglang.srt.layers.pooler import (
    EmbeddingPoolerOutput,
    Pooler,
    PoolingType,
    score_and_pool,
)
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.qwen3_5 import Qwen3_5ForCausalLM
from sglang.srt.layers.utils import get_layer_id
from sglang.srt.utils import add_prefix

from sglang_openjev.weights import (
    BACKBONE,
    HEAD,
    SKIP,
    check_head_weights,
    expected_backbone_shapes,
    loading_problems,
    refuse_if_problems,
    route_weight,
)

logger = logging.getLogger(__name__)


class Qwen3_5ForSequenceClassification(nn.Module):
    """SGLang's Qwen3.5 text backbone + `score` head on the last token's final hidden state.

    `config` is SGLang's multimodal `Qwen3_5Config` (model_type "qwen3_5"); the labels live on
    it (`num_labels`, `id2label`), the backbone reads `config.text_config`. Hybrid GDN state
    pools and the hybrid attention backend are chosen by SGLang from the config class
    (`ModelRunner.hybrid_gdn_config`), so this architecture gets them like
    `Qwen3_5ForConditionalGeneration` does. The vision tower is not built.

    Runs as an embedding model (`--is-embedding`): the scheduler calls `forward(...,
    get_embedding=True)` once per prefill and returns `EmbeddingPoolerOutput.embeddings`, the
    raw `num_labels` logits of every request, to the tokenizer manager.
    """

    packed_modules_mapping = Qwen3_5ForCausalLM.packed_modules_mapping

    def __init__(
        self,
        config,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.config = config
        self.text_config = config.get_text_config()
        self.quant_config = quant_config
        self.num_labels = config.num_labels
        self.model = Qwen3_5ForCausalLM(
            self.text_config,
            quant_config=quant_config,
            prefix=add_prefix("model", prefix),
        )
        # GenericForSequenceClassification: nn.Linear(hidden, num_labels, bias=False), applied
        # in the model dtype (FP16 on V100), like the Transformers reference.
        self.score = nn.Linear(self.text_config.hidden_size, self.num_labels, bias=False)
        # Raw logits: never L2-normalise a classifier's output.
        self.pooler = Pooler(pooling_type=PoolingType.LAST, normalize=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def start_layer(self) -> int:
        return self.model.start_layer

    @property
    def end_layer(self) -> int:
        return self.model.end_layer

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: Optional[torch.Tensor] = None,
        get_embedding: bool = True,
    ) -> EmbeddingPoolerOutput:
        assert get_embedding, f"{self.__class__.__name__} is only used for embedding"
        # Text-only input: the 1-D positions equal every M-RoPE section's positions, so the
        # backbone's rotary embedding matches Transformers' M-RoPE on text.
        hidden_states = self.model(input_ids, positions, forward_batch, input_embeds)
        if isinstance(hidden_states, tuple):  # (hidden, aux hidden states) when capturing layers
            hidden_states = hidden_states[0]
        return score_and_pool(
            self.score, self.pooler, hidden_states, forward_batch, input_ids
        )

    def expected_backbone_shapes(self) -> dict:
        """Checkpoint name (relative to the backbone) -> full shape, for the layers this rank holds."""
        layer_types = getattr(self.text_config, "layers_block_type", None) or self.text_config.layer_types
        expected = expected_backbone_shapes(self.text_config, layer_types)
        held = range(getattr(self.model, "start_layer", 0), getattr(self.model, "end_layer", len(layer_types)))
        return {name: shape for name, shape in expected.items()
                if get_layer_id(name) is None or get_layer_id(name) in held}

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        """Strict: every backbone tensor and score.weight exactly once with its shape, nothing else
        but the documented ignored tensors (lm_head.*, mtp.*, the vision tower); otherwise a
        ValueError lists every problem and SGLang's start fails (the server never reports healthy).
        """
        expected = self.expected_backbone_shapes()
        head_shapes: dict = {}
        skipped: dict = {}
        seen: dict = {}          # backbone-relative name -> shape
        prefixes: dict = {}      # the backbone prefix the checkpoint uses (to name missing tensors)
        names: set = set()
        unexpected: list = []
        duplicated: list = []
        mismatched: list = []

        def backbone_weights():
            for name, loaded_weight in weights:
                if name in names:
                    duplicated.append(name)
                    continue
                names.add(name)
                kind, target = route_weight(name)
                shape = tuple(loaded_weight.shape)
                if kind == BACKBONE:
                    prefix = name[: len(name) - len(target)]
                    prefixes[prefix] = prefixes.get(prefix, 0) + 1
                    if target not in expected:
                        unexpected.append(name)
                        continue
                    seen[target] = shape
                    if shape != expected[target]:
                        # SGLang's sharded loaders would narrow an oversized tensor silently
                        mismatched.append(f"{name} {list(shape)} (expected {list(expected[target])})")
                        continue
                    yield target, loaded_weight
                elif kind == HEAD:
                    head_shapes[target] = shape
                    if target == "weight" and shape == tuple(self.score.weight.shape):
                        default_weight_loader(self.score.weight, loaded_weight)
                elif kind == SKIP:
                    skipped[target] = skipped.get(target, 0) + 1
                else:
                    unexpected.append(name)

        # Streamed: the backbone loads each tensor as it arrives, nothing is held back.
        loaded = set(self.model.load_weights(backbone_weights()) or ())
        prefix = max(prefixes, key=prefixes.get) if prefixes else "model.language_model."
        missing = [prefix + name for name in sorted(set(expected) - set(seen))]
        # Model side: every parameter of the backbone was written by SGLang's loader (fused
        # q/k/v, gate/up and GDN projections count once each). Buffers are derived, not loaded.
        unfilled = sorted(set(dict(self.model.named_parameters())) - loaded)
        other = []
        try:
            check_head_weights(head_shapes, self.num_labels, self.text_config.hidden_size)
        except ValueError as exc:
            other.append(str(exc))
        if unfilled and not (missing or mismatched):
            other.append(f"{len(unfilled)} model parameter(s) not filled by the checkpoint: "
                         f"{', '.join(unfilled[:20])}")
        problems = loading_problems(missing, unexpected, duplicated, mismatched, other)
        refuse_if_problems(problems)  # SGLang's scheduler logs it and ends the server
        for why, count in skipped.items():
            logger.info(f"Skipped {count} checkpoint tensors: {why}")
        logger.info(f"Strict loading: {len(seen)} backbone tensors and score.weight loaded, each exactly once")
        loaded_params = {add_prefix(name, "model") for name in loaded}
        loaded_params.add("score.weight")
        return loaded_params


EntryClass = [Qwen3_5ForSequenceClassification]
