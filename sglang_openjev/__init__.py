"""OpenJEV on SGLang: the Qwen3.5 sequence-classification adapter and the `/classify` contract.

`sglang_openjev.contract` is importable anywhere (no torch, no sglang). The SGLang model and
route modules import sglang and are loaded by SGLang itself through
`SGLANG_EXTERNAL_MODEL_PACKAGE=sglang_openjev` (see V100.md).
"""
