"""openjev-serving's library: what the step scripts in app/ and the benchmarks share.

``openjev.common`` (contract constants, one-line errors, atomic writes, receipts' environment),
``openjev.env_vars`` (every OPENJEV_* variable), ``openjev.engine`` (the embedded backend's
classifier, kernels and warm-up), ``openjev.paged`` (the dynamic paged-prefill kernel and its reference),
``openjev.receipts`` (one pydantic model per receipt kind, the source of results_v100/schemas/).
"""
