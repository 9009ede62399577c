"""The `/classify` wire contract of SPEC section 2, as pure functions.

Both servers speak it: the SGLang adapter (`sglang_openjev.http`) and the embedded Transformers
backend (`app/serve_transformers.py`). Nothing here imports torch or sglang, so the contract is
testable on any machine and the two backends cannot drift apart.

Request  `POST /classify`  {"input_ids": [[int, ...], ...]} | {"input_ids": [int, ...]} | {"text": str | [str]}
Response                   {"logits": [[c, e, n], ...], "labels": [...], "model": str}
Errors                     {"error": {"message": str, "type": str, "code": int}}
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

LABELS = ("contradiction", "entailment", "neutral")

# Error types, following the OpenAI-style names SGLang and vLLM use in their error bodies.
BAD_REQUEST = "invalid_request_error"
TOO_LARGE = "request_too_large"
UNAVAILABLE = "service_unavailable"
INTERNAL = "internal_error"

Tokenize = Callable[[Sequence[str]], list]


class ContractError(Exception):
    """A request the server refuses; carries the HTTP status and the JSON error body."""

    def __init__(self, status: int, message: str, type_: str = BAD_REQUEST):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_

    def body(self) -> dict:
        return error_body(self.message, self.type, self.status)


def error_body(message: str, type_: str, status: int) -> dict:
    return {"error": {"message": message, "type": type_, "code": status}}


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context_length: int
    max_batch_size: int
    # The longest input the runtime schedules, where that is below context_length - 1 (SGLang's
    # scheduler refuses len >= max_req_input_len, a few tokens under the context length).
    # None: context_length alone bounds the input.
    max_input_tokens: int | None = None


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ContractError(400, f"request body is not valid JSON: {exc}") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_rows(rows: Any, limits: Limits, field: str = "input_ids") -> list[list[int]]:
    """Check a batch of token-id rows against the vocabulary, context length and batch limit.

    Every row is checked before any is scored, so one bad row rejects its own request and
    never reaches a batch shared with other requests.
    """
    if not isinstance(rows, list) or not rows:
        raise ContractError(400, f"'{field}' is empty: send a list of token ids or a list of such lists")
    if all(_is_int(x) for x in rows):
        rows = [rows]
    if len(rows) > limits.max_batch_size:
        raise ContractError(
            413, f"batch of {len(rows)} inputs exceeds this server's limit of {limits.max_batch_size} per request; "
            "split the request", TOO_LARGE)
    out: list[list[int]] = []
    for i, row in enumerate(rows):
        if not isinstance(row, list):
            raise ContractError(400, f"row {i} of '{field}' is not a list of token ids")
        if not row:
            raise ContractError(400, f"row {i} of '{field}' is empty")
        for p, tok in enumerate(row):
            if not _is_int(tok):
                raise ContractError(400, f"row {i} position {p}: token id {tok!r} is not an integer")
            if tok < 0 or tok >= limits.vocab_size:
                raise ContractError(
                    400, f"row {i} position {p}: token id {tok} is out of vocabulary (vocab size {limits.vocab_size})")
        if len(row) >= limits.context_length:
            raise ContractError(
                400, f"row {i} has {len(row)} tokens, not below the server context length {limits.context_length}: "
                "inputs must be shorter than the context length (an input exactly equal to it is rejected too, as "
                "the pinned SGLang runtime does); the server never truncates, so truncate client-side")
        if limits.max_input_tokens is not None and len(row) > limits.max_input_tokens:
            raise ContractError(
                400, f"row {i} has {len(row)} tokens, over this server's input limit of {limits.max_input_tokens} "
                f"tokens (context length {limits.context_length} less the tokens the runtime reserves); the server "
                "never truncates, so truncate client-side")
        out.append(row)
    return out


def _texts(value: Any, field: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts:
        raise ContractError(400, f"'{field}' is empty: send a string or a list of strings")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ContractError(400, f"item {i} of '{field}' is not a string")
        if not t:
            raise ContractError(400, f"item {i} of '{field}' is an empty string")
    return texts


def _tokenize(texts: list[str], tokenize: Tokenize | None, limits: Limits, field: str) -> list[list[int]]:
    if tokenize is None:
        raise ContractError(400, "this server has no tokenizer; send token ids in 'input_ids'")
    if len(texts) > limits.max_batch_size:
        raise ContractError(413, f"batch of {len(texts)} inputs exceeds this server's limit of "
                                 f"{limits.max_batch_size} per request; split the request", TOO_LARGE)
    return validate_rows([list(map(int, ids)) for ids in tokenize(texts)], limits, field)


def parse_classify(body: Any, limits: Limits, tokenize: Tokenize | None = None) -> list[list[int]]:
    """`POST /classify` body -> token-id rows (in input order)."""
    if not isinstance(body, dict):
        raise ContractError(400, "request body must be a JSON object with 'input_ids' (or 'text')")
    has_ids, has_text = "input_ids" in body, "text" in body
    if has_ids == has_text:
        raise ContractError(400, "send exactly one of 'input_ids' or 'text'")
    if has_ids:
        return validate_rows(body["input_ids"], limits)
    return _tokenize(_texts(body["text"], "text"), tokenize, limits, "text")


def classify_response(logits: Sequence[Sequence[float]], model: str) -> dict:
    """Raw float32 logits, one [c, e, n] row per input, in input order."""
    return {"logits": [[float(x) for x in row] for row in logits], "labels": list(LABELS), "model": model}


# ---------------------------------------------------------------- /v1/classify (vLLM / SGLang shape)
def parse_v1_classify(body: Any, limits: Limits, tokenize: Tokenize | None = None) -> tuple[list[list[int]], bool]:
    """`POST /v1/classify` body -> (rows, use_activation). `input` is a string, a list of strings,
    a list of token ids or a list of token-id lists; `use_activation` defaults to true (softmax)."""
    if not isinstance(body, dict):
        raise ContractError(400, "request body must be a JSON object with 'input'")
    if "input" not in body:
        raise ContractError(400, "missing 'input'")
    use_activation = body.get("use_activation", True)
    if use_activation is None:
        use_activation = True
    if not isinstance(use_activation, bool):
        raise ContractError(400, "'use_activation' must be true or false")
    value = body["input"]
    is_text = isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value))
    if is_text:
        return _tokenize(_texts(value, "input"), tokenize, limits, "input"), use_activation
    return validate_rows(value, limits, field="input"), use_activation


def softmax(row: Sequence[float]) -> list[float]:
    m = max(row)
    exps = [math.exp(x - m) for x in row]
    s = sum(exps)
    return [e / s for e in exps]


def v1_classify_response(logits: Sequence[Sequence[float]], rows: Sequence[Sequence[int]], model: str,
                         use_activation: bool, labels: Sequence[str] = LABELS) -> dict:
    data = []
    for i, row in enumerate(logits):
        row = [float(x) for x in row]
        best = max(range(len(row)), key=row.__getitem__)
        data.append({"index": i, "label": labels[best], "probs": softmax(row) if use_activation else row,
                     "num_classes": len(row)})
    n_tokens = sum(len(r) for r in rows)
    return {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    }


# ---------------------------------------------------------------- label order of a checkpoint
def check_label_order(id2label: dict | None, num_labels: int | None) -> None:
    """Refuse a checkpoint whose head is not contradiction/entailment/neutral in that order."""
    if num_labels != 3:
        raise ValueError(f"expected a 3-label classifier, the config has num_labels={num_labels}")
    got = [str((id2label or {}).get(i, (id2label or {}).get(str(i), ""))).lower() for i in range(3)]
    if got != list(LABELS):
        raise ValueError(f"expected id2label {dict(enumerate(LABELS))}, the config has {id2label}")


# ---------------------------------------------------------------- GET /server_info
# Keys every backend reports (SPEC section 2). Backends may add more; these may not be missing.
SERVER_INFO_KEYS = (
    "backend",                   # "sglang" | "transformers"
    "model",                     # served model name
    "model_path",
    "dtype",
    "device",                    # e.g. "cuda:0 (NVIDIA H200, sm_90)" or "cpu"
    "context_length",
    "schedule_policy",
    "max_running_requests",
    "radix_cache",               # prefix cache on/off
    "mamba_scheduler_strategy",  # "extra_buffer" | "no_buffer" | None where not applicable
    "mamba_full_memory_ratio",
    "attention_backend",
    "bundle_git",                # {"commit": ..., "dirty": ...} of this bundle
    "pid",
    "flush_cache_calls",         # how many POST /flush_cache this process answered
)


def server_info(**fields: Any) -> dict:
    missing = [k for k in SERVER_INFO_KEYS if k not in fields]
    if missing:
        raise KeyError(f"server_info is missing {missing}")
    return dict(fields)
