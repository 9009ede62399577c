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
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

try:
    import orjson
except ImportError:  # the json module then; same answers, slower on large bodies
    orjson = None

LABELS = ("contradiction", "entailment", "neutral")

# Error types, following the OpenAI-style names SGLang and vLLM use in their error bodies.
BAD_REQUEST = "invalid_request_error"
TOO_LARGE = "request_too_large"
NOT_FOUND = "not_found_error"
UNAVAILABLE = "service_unavailable"
OVERLOADED = "overloaded"  # 429: the queue is full; retry after Retry-After
INTERNAL = "internal_error"

# Bounded work before any parsing. The body limit admits the largest id batch the
# contract allows (512 rows x 8191 ids is ~30 MB of JSON); the text limit counts characters of all
# texts of one request and is checked before anything is tokenized (8192 tokens at ~4 characters a
# token, times 32 rows).
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_TEXT_CHARS = 1024 * 1024

# tokenize(texts) or tokenize(texts, add_special_tokens=False) -> one id list per text
Tokenize = Callable[..., list]


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
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS

    @property
    def max_tokens(self) -> int:
        """The longest input accepted, in tokens."""
        cap = self.context_length - 1
        return min(cap, self.max_input_tokens) if self.max_input_tokens is not None else cap


def check_body_size(n_bytes: int, max_body_bytes: int) -> None:
    if n_bytes > max_body_bytes:
        raise ContractError(413, f"request body of {n_bytes} bytes or more is over this server's limit of "
                                 f"{max_body_bytes} bytes; split the request", TOO_LARGE)


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


_THIRD_LEVEL = re.compile(rb"\[\s*\[\s*\[")


def count_lists(raw: bytes) -> int | None:
    """JSON arrays in a body, counted on the bytes (strings blanked first): no objects are built.
    None when lists nest three deep, which no request of rows does (the parser says what is wrong)."""
    if raw.count(b"[") == 0:
        return 0
    bare = _JSON_STRING.sub(b'""', raw)
    return None if _THIRD_LEVEL.search(bare) else bare.count(b"[")


def parse_json(raw: bytes, max_rows: int | None = None) -> Any:
    """Request JSON, by orjson where installed (SGLang depends on it). With max_rows, a body holding
    more lists than a request of that many rows can (the rows and the one around them) is a 413
    before it is parsed: 1.5 M tiny rows would take about a second of parsing, holding the interpreter."""
    if max_rows is not None and raw.count(b"[") > max_rows + 1 and (n := count_lists(raw) or 0) > max_rows + 1:
        raise ContractError(413, f"batch of {n - 1} inputs exceeds this server's limit of {max_rows} per request "
                                 "(counted before parsing); split the request", TOO_LARGE)
    if orjson is not None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            if "depth limit" in str(exc) or "recursion" in str(exc).lower():
                raise ContractError(400, "request body is not valid JSON for this server: nested too deeply "
                                         "(the parser's recursion limit)") from None
            raise ContractError(400, f"request body is not valid JSON: {exc}") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ContractError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ContractError(400, "request body is not valid JSON for this server: nested too deeply "
                                 "(the parser's recursion limit)") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _plain_token_ids(row: list, vocab_size: int) -> bool:
    """Whether every element of a non-empty `row` is an int (not a bool) in [0, vocab_size), checked by
    C-level passes (about a third of the per-token loop's time); False sends the row to that loop,
    which names the first bad token."""
    return set(map(type, row)) == {int} and min(row) >= 0 and max(row) < vocab_size


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
        if not _plain_token_ids(row, limits.vocab_size):  # the loop names the first bad token
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
                f"the pinned SGLang runtime does); {_truncation_advice(field)}")
        if limits.max_input_tokens is not None and len(row) > limits.max_input_tokens:
            raise ContractError(
                400, f"row {i} has {len(row)} tokens, over this server's input limit of {limits.max_input_tokens} "
                f"tokens (context length {limits.context_length} less the tokens the runtime reserves); "
                f"{_truncation_advice(field)}")
        out.append(row)
    return out


def _truncation_advice(field: str) -> str:
    if field == "input":  # the vLLM-style body, which may ask for truncation
        return "send 'truncate_prompt_tokens' (-1: this server's limit) or truncate client-side"
    return "this route never truncates, so truncate client-side (or use /v1/classify with 'truncate_prompt_tokens')"


def _texts(value: Any, field: str, limits: Limits | None = None) -> list[str]:
    """Check texts before any tokenizing: type, emptiness, total length, encodability."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts:
        raise ContractError(400, f"'{field}' is empty: send a string or a list of strings")
    if limits is not None:
        if len(texts) > limits.max_batch_size:
            raise ContractError(413, f"batch of {len(texts)} inputs exceeds this server's limit of "
                                     f"{limits.max_batch_size} per request; split the request", TOO_LARGE)
        total = sum(len(t) for t in texts if isinstance(t, str))
        if total > limits.max_text_chars:
            raise ContractError(413, f"'{field}' holds {total} characters, over this server's limit of "
                                     f"{limits.max_text_chars} characters per request; split the request or "
                                     "send token ids", TOO_LARGE)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ContractError(400, f"item {i} of '{field}' is not a string")
        if not t:
            raise ContractError(400, f"item {i} of '{field}' is an empty string")
        if t.isspace():
            raise ContractError(400, f"item {i} of '{field}' is only whitespace")
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ContractError(400, f"item {i} of '{field}' is not valid Unicode text: {exc.reason} at "
                                     f"character {exc.start} (a lone surrogate escape such as \\ud800)") from None
    return texts


def _call_tokenize(tokenize: Tokenize, texts: list[str], add_special_tokens: bool) -> list:
    return tokenize(texts) if add_special_tokens else tokenize(texts, add_special_tokens=False)


def tokenize_texts(texts: list[str], tokenize: Tokenize | None, add_special_tokens: bool = True) -> list[list[int]]:
    if tokenize is None:
        raise ContractError(400, "this server has no tokenizer; send token ids in 'input_ids'")
    try:
        out = _call_tokenize(tokenize, texts, add_special_tokens)
    except (TypeError, ValueError, UnicodeError) as exc:  # the tokenizer refused the text itself
        raise ContractError(400, f"the tokenizer refused the text: {type(exc).__name__}: {exc}") from None
    return [list(map(int, ids)) for ids in out]


def _tokenize(texts: list[str], tokenize: Tokenize | None, limits: Limits, field: str,
              add_special_tokens: bool = True, truncate: int | None = None) -> list[list[int]]:
    rows = tokenize_texts(texts, tokenize, add_special_tokens)
    if truncate is not None:
        rows = truncate_rows(rows, truncate)
    return validate_rows(rows, limits, field)


def truncate_rows(rows: list[list[int]], keep: int) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: keep the last `keep` tokens of each row."""
    return [r[-keep:] if len(r) > keep else r for r in rows]


def parse_classify(body: Any, limits: Limits, tokenize: Tokenize | None = None) -> list[list[int]]:
    """`POST /classify` body -> token-id rows (in input order)."""
    if not isinstance(body, dict):
        raise ContractError(400, "request body must be a JSON object with 'input_ids' (or 'text')")
    has_ids, has_text = "input_ids" in body, "text" in body
    if has_ids == has_text:
        raise ContractError(400, "send exactly one of 'input_ids' or 'text' (or vLLM's 'input')")
    if has_ids:
        return validate_rows(body["input_ids"], limits)
    return _tokenize(_texts(body["text"], "text", limits), tokenize, limits, "text")


def is_vllm_request(body: Any) -> bool:
    """vLLM's own route is POST /classify with {"model", "input"}: such a body gets vLLM's shape."""
    return (isinstance(body, dict) and ("input" in body or "messages" in body) and "input_ids" not in body
            and "text" not in body)


def classify_response(logits: Sequence[Sequence[float]], model: str) -> dict:
    """Raw float32 logits, one [c, e, n] row per input, in input order."""
    return {"logits": [[float(x) for x in row] for row in logits], "labels": list(LABELS), "model": model}


# ---------------------------------------------------------------- /v1/classify (vLLM / SGLang shape)
@dataclass
class V1Request:
    rows: list[list[int]]
    use_activation: bool
    truncate_prompt_tokens: int | None = None  # as the request said (-1 kept as -1)
    truncated_rows: int = 0


def check_model(body: dict, served: str | None) -> None:
    """vLLM answers 404 for a model it does not serve; no "model" (or null) means the served one."""
    name = body.get("model")
    if name is None or served is None:
        return
    if name != served:
        raise ContractError(404, f"The model `{name}` does not exist (this server serves `{served}`).", NOT_FOUND)


def _flag(body: dict, key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise ContractError(400, f"'{key}' must be true or false")
    return value


def parse_vllm_classify(body: Any, limits: Limits, tokenize: Tokenize | None = None,
                        served_model: str | None = None) -> V1Request:
    """vLLM/SGLang classify body -> V1Request. `input` is a string, a list of strings, a list of token
    ids or a list of token-id lists; softmax unless `use_activation` (or vLLM's deprecated
    `activation` / `softmax`) is false; `truncate_prompt_tokens` keeps the last k tokens (-1: the
    server's limit); `add_special_tokens` (default true) applies to text."""
    if not isinstance(body, dict):
        raise ContractError(400, "request body must be a JSON object with 'input'")
    if "input" not in body:
        if "messages" in body:
            raise ContractError(400, "chat-style classify ('messages') is not served: the classifier scores exact "
                                     "inputs and this server applies no chat template; send 'input' (text or token ids)")
        raise ContractError(400, "missing 'input'")
    check_model(body, served_model)
    use_activation = True
    for key in ("use_activation", "activation", "softmax"):  # the last two: vLLM's deprecated names
        value = _flag(body, key)
        if value is not None:
            use_activation = use_activation and value
    add_special = _flag(body, "add_special_tokens")
    add_special = True if add_special is None else add_special
    truncate = body.get("truncate_prompt_tokens")
    keep = None
    if truncate is not None:
        if not _is_int(truncate) or truncate == 0 or truncate < -1:
            raise ContractError(400, f"'truncate_prompt_tokens' must be a positive integer or -1, got {truncate!r}")
        keep = limits.max_tokens if truncate == -1 else truncate
        if keep > limits.max_tokens:
            raise ContractError(400, f"truncate_prompt_tokens value ({truncate}) is greater than the longest input "
                                     f"this server accepts ({limits.max_tokens} tokens); use -1 for that limit")
    value = body["input"]
    is_text = isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value))
    if is_text:
        texts = _texts(value, "input", limits)
        full = tokenize_texts(texts, tokenize, add_special)
    else:
        if not isinstance(value, list) or not value:
            raise ContractError(400, "'input' is empty: send a string, a list of strings, token ids or lists of token ids")
        full = [value] if all(_is_int(x) for x in value) else value
        if not all(isinstance(r, list) for r in full):
            raise ContractError(400, "'input' must be a string, a list of strings, a list of token ids or a list "
                                     "of such lists")
    rows = truncate_rows(full, keep) if keep is not None else full
    n_truncated = sum(len(a) != len(b) for a, b in zip(full, rows))
    return V1Request(validate_rows(rows, limits, field="input"), use_activation, truncate, n_truncated)


def parse_v1_classify(body: Any, limits: Limits, tokenize: Tokenize | None = None) -> tuple[list[list[int]], bool]:
    """`POST /v1/classify` body -> (rows, use_activation) (see parse_vllm_classify)."""
    req = parse_vllm_classify(body, limits, tokenize)
    return req.rows, req.use_activation


def softmax(row: Sequence[float]) -> list[float]:
    m = max(row)
    exps = [math.exp(x - m) for x in row]
    s = sum(exps)
    return [e / s for e in exps]


def v1_classify_response(logits: Sequence[Sequence[float]], rows: Sequence[Sequence[int]], model: str,
                         use_activation: bool, labels: Sequence[str] = LABELS, request: V1Request | None = None) -> dict:
    data = []
    for i, row in enumerate(logits):
        row = [float(x) for x in row]
        best = max(range(len(row)), key=row.__getitem__)
        data.append({"index": i, "label": labels[best], "probs": softmax(row) if use_activation else row,
                     "num_classes": len(row)})
    n_tokens = sum(len(r) for r in rows)
    usage = {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0,
             "prompt_tokens_details": None}  # vLLM's UsageInfo, nothing else
    extra = {}
    if request is not None and request.truncate_prompt_tokens is not None:
        extra["truncation"] = {"truncate_prompt_tokens": request.truncate_prompt_tokens,
                               "truncated_inputs": request.truncated_rows}
    return {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage,
        **extra,
    }


# ---------------------------------------------------------------- /tokenize, /detokenize (vLLM shapes)
def parse_tokenize(body: Any, limits: Limits, served_model: str | None = None) -> tuple[str, bool, bool]:
    """vLLM's TokenizeCompletionRequest {model, prompt, add_special_tokens, return_token_strs}."""
    if not isinstance(body, dict):
        raise ContractError(400, "request body must be a JSON object with 'prompt'")
    check_model(body, served_model)
    if "messages" in body:
        raise ContractError(400, "chat-style tokenize ('messages') is not served here: this model has no chat "
                                 "template; send 'prompt'")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ContractError(400, "'prompt' must be a string")
    if len(prompt) > limits.max_text_chars:
        raise ContractError(413, f"'prompt' holds {len(prompt)} characters, over this server's limit of "
                                 f"{limits.max_text_chars}", TOO_LARGE)
    if prompt:
        _texts(prompt, "prompt")  # encodability (whitespace-only is refused as everywhere)
    add_special = _flag(body, "add_special_tokens")
    return prompt, True if add_special is None else add_special, bool(_flag(body, "return_token_strs"))


def tokenize_response(tokens: list[int], max_model_len: int, token_strs: list[str] | None = None) -> dict:
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": token_strs}


def parse_detokenize(body: Any, limits: Limits, served_model: str | None = None) -> list[int]:
    """vLLM's DetokenizeRequest {model, tokens}."""
    if not isinstance(body, dict):
        raise ContractError(400, "request body must be a JSON object with 'tokens'")
    check_model(body, served_model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise ContractError(400, "'tokens' must be a list of integer token ids")
    for p, tok in enumerate(tokens):
        if tok < 0 or tok >= limits.vocab_size:
            raise ContractError(400, f"position {p}: token id {tok} is out of vocabulary (vocab size {limits.vocab_size})")
    return tokens


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
