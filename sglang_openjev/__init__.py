"""OpenJEV on SGLang: the Qwen3.5 sequence-classification adapter and the `/classify` contract.

Modules
  contract                 the SPEC section-2 wire contract as pure functions (no torch, no sglang)
  weights, pooling         pure helpers: checkpoint weight-name routing, pooled-position rules
  qwen3_5_classification   the SGLang model (`EntryClass = [Qwen3_5ForSequenceClassification]`)
  routes                   /classify, /v1/classify, /flush_cache, /server_info on SGLang's app
  launch_server            the entry point: `python -m sglang_openjev.launch_server SGLANG_FLAGS...`

SGLang imports every module of this package (`SGLANG_EXTERNAL_MODEL_PACKAGE=sglang_openjev`,
`models/registry.py`), in the scheduler processes too, so no module has import-time side effects
and only `qwen3_5_classification` imports sglang at module level.
"""
