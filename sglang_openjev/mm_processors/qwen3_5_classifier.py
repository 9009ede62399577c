"""The classifier's architecture served by SGLang's own Qwen3.5 processor (text requests never reach
its image or video paths; /classify sends token ids)."""

from sglang.srt.multimodal.processors.qwen_vl import QwenVLImageProcessor

from sglang_openjev.qwen3_5_classification import Qwen3_5ForSequenceClassification


class Qwen3_5ClassifierProcessor(QwenVLImageProcessor):
    models = [Qwen3_5ForSequenceClassification]
