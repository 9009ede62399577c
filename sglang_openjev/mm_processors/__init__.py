"""Multimodal-processor package for SGLang (`SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE`, set by the launcher).

SGLang counts a Qwen3.5 config (it has a vision_config) as multimodal, and its tokenizer manager then
looks up a processor class by the checkpoint's architecture; SGLang registers one for
Qwen3_5ForConditionalGeneration only. SGLang imports every module of this package and registers the
processor classes it finds there.
"""
