"""The `/classify` contract (SPEC section 2) on SGLang's own FastAPI app.

`install_routes(app)` replaces four of SGLang's routes on `sglang.srt.entrypoints.http_server.app`
(before the server starts) and keeps the rest, `/health` included:

  POST /classify        {"input_ids": ...} | {"text": ...} -> raw [c, e, n] logits (SGLang's own
                        /classify answers EmbeddingReqInput with {"embedding", "meta_info"} dicts
                        and has no batch limit, vocabulary check or contract errors)
  POST /v1/classify     the vLLM/SGLang wire shape, softmax by default, raw with use_activation=false
  GET|POST /flush_cache SGLang's flush, answered in JSON and counted for /server_info
  GET  /server_info     SGLang's server info with the contract's keys merged on top

Requests still go through SGLang's plumbing: each accepted batch becomes one
`EmbeddingReqInput(input_ids=[[...], ...])` handed to the tokenizer manager, which schedules
every row as its own request (prefix cache, LPM scheduling) and returns the rows in order.

This module imports no sglang at import time (SGLang's model registry imports every module of
the package, and CI tests the wiring without sglang); `SGLangRuntime` binds to SGLang lazily.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sglang_openjev import contract, provenance

logger = logging.getLogger(__name__)

MAX_BATCH_ENV = "OPENJEV_MAX_BATCH_SIZE"
MAX_BODY_ENV = "OPENJEV_MAX_BODY_BYTES"
MAX_TEXT_ENV = "OPENJEV_MAX_TEXT_CHARS"
ARCH_PROFILE_ENV = "OPENJEV_ARCH_PROFILE"
BUNDLE_REVISION_ENV = "OPENJEV_BUNDLE_REVISION"
DEFAULT_MAX_BATCH_SIZE = 512

# path -> methods this adapter serves there; SGLang's routes on these paths are removed.
ADAPTER_ROUTES: Mapping[str, tuple[str, ...]] = {
    "/classify": ("POST",),
    "/v1/classify": ("POST",),
    "/flush_cache": ("GET", "POST"),
    "/server_info": ("GET",),
}

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- settings
def _positive_env(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


def max_batch_size(environ: Mapping[str, str] = os.environ) -> int:
    return _positive_env(environ, MAX_BATCH_ENV, DEFAULT_MAX_BATCH_SIZE)


def max_body_bytes(environ: Mapping[str, str] = os.environ) -> int:
    return _positive_env(environ, MAX_BODY_ENV, contract.DEFAULT_MAX_BODY_BYTES)


def max_text_chars(environ: Mapping[str, str] = os.environ) -> int:
    return _positive_env(environ, MAX_TEXT_ENV, contract.DEFAULT_MAX_TEXT_CHARS)


@functools.lru_cache(maxsize=None)
def bundle_git_revision(root: Path = PACKAGE_ROOT) -> dict:
    """{"commit", "dirty"} of the bundle checkout this package runs from (None where not a checkout)."""
    return provenance.git_revision(root)


def bundle_revision(environ: Mapping[str, str] = os.environ) -> dict:
    pinned = environ.get(BUNDLE_REVISION_ENV)
    if pinned:  # a deployed copy that is no git checkout: the launcher may say which revision it is
        return {"commit": pinned, "dirty": None, "source": BUNDLE_REVISION_ENV}
    return dict(bundle_git_revision())


def input_limits(tokenizer_manager: Any, scheduler_info: Mapping[str, Any], batch_limit: int,
                 text_limit: int = contract.DEFAULT_MAX_TEXT_CHARS) -> contract.Limits:
    """The contract's limits from SGLang's runtime values.

    The tokenizer manager refuses len + reserved >= context_len; the scheduler then refuses
    len >= max_req_input_len (min(context_len - 1, token pool - 1) - 5 in SGLang 0.5.12-0.5.14),
    which is the tighter bound. Both are checked here so that a bad row is refused with the
    contract's 400 before any row of the batch is scheduled.
    """
    context_len = int(tokenizer_manager.context_len)
    reserved = int(getattr(tokenizer_manager, "num_reserved_tokens", 0) or 0)
    candidates = [context_len - 1 - reserved]
    scheduler_cap = scheduler_info.get("max_req_input_len") or getattr(tokenizer_manager, "max_req_input_len", None)
    if scheduler_cap:
        candidates.append(int(scheduler_cap) - 1)
    max_input = min(candidates)
    return contract.Limits(
        vocab_size=int(tokenizer_manager.model_config.vocab_size),
        context_length=context_len,
        max_batch_size=batch_limit,
        max_input_tokens=max_input if max_input < context_len - 1 else None,
        max_text_chars=text_limit,
    )


def describe_device(server_args: Any) -> str:
    device = getattr(server_args, "device", None) or "cuda"
    if device != "cuda":
        return str(device)
    gpu = int(getattr(server_args, "base_gpu_id", 0) or 0)
    try:
        import torch

        name = torch.cuda.get_device_name(gpu)
        major, minor = torch.cuda.get_device_capability(gpu)
        return f"cuda:{gpu} ({name}, sm_{major}{minor})"
    except Exception:  # noqa: BLE001 - description only; never fail /server_info on it
        return f"cuda:{gpu}"


def mamba_strategy(server_args: Any) -> Optional[str]:
    # --mamba-scheduler-strategy (fork, <= 0.5.14); --mamba-radix-cache-strategy (0.5.23).
    for name in ("mamba_scheduler_strategy", "mamba_radix_cache_strategy"):
        value = getattr(server_args, name, None)
        if value is not None:
            return value
    return None


def adapter_server_info(tokenizer_manager: Any, limits: contract.Limits, counters: "Counters",
                        environ: Mapping[str, str] = os.environ) -> dict:
    sa = tokenizer_manager.server_args
    info = contract.server_info(
        backend="sglang",
        model=tokenizer_manager.served_model_name,
        model_path=sa.model_path,
        dtype=sa.dtype,
        device=describe_device(sa),
        context_length=limits.context_length,
        schedule_policy=sa.schedule_policy,
        max_running_requests=sa.max_running_requests,
        radix_cache=not sa.disable_radix_cache,
        mamba_scheduler_strategy=mamba_strategy(sa),
        mamba_full_memory_ratio=getattr(sa, "mamba_full_memory_ratio", None),
        attention_backend=sa.attention_backend,
        bundle_git=bundle_revision(environ),
        pid=os.getpid(),
        flush_cache_calls=counters.flush_cache_calls,
    )
    info.update(
        arch_profile=environ.get(ARCH_PROFILE_ENV),
        # set by launch_server.adapt_to_runtime: the installed SGLang and what was adapted to it
        sglang_runtime=environ.get("OPENJEV_SGLANG_RUNTIME"),
        launch_adaptations=_json_list(environ.get("OPENJEV_LAUNCH_ADAPTATIONS")),
        flush_cache_failures=counters.flush_cache_failures,
        max_batch_size=limits.max_batch_size,
        max_input_tokens=limits.max_input_tokens or limits.context_length - 1,
        vocab_size=limits.vocab_size,
        labels=list(contract.LABELS),
        pooling="last token (SGLang PoolingType.LAST), raw logits",
        linear_attn_prefill_backend=getattr(sa, "linear_attn_prefill_backend", None),
        linear_attn_decode_backend=getattr(sa, "linear_attn_decode_backend", None),
        disable_cuda_graph=getattr(sa, "disable_cuda_graph", None),
        adapter="sglang_openjev",
    )
    return info


def _json_list(raw: Optional[str]) -> list:
    try:
        value = json.loads(raw) if raw else []
    except ValueError:
        return [raw]
    return value if isinstance(value, list) else [value]


# ---------------------------------------------------------------- SGLang binding
@dataclass
class Counters:
    flush_cache_calls: int = 0
    flush_cache_failures: int = 0


class SGLangRuntime:
    """The adapter's handle on SGLang's per-process HTTP state.

    `get_state()` returns SGLang's `_GlobalState` (tokenizer_manager, template_manager,
    scheduler_info), or None before `launch_server` has set it. `embedding_request` builds
    SGLang's `EmbeddingReqInput`.
    """

    def __init__(self, get_state: Callable[[], Any], embedding_request: Callable[..., Any]):
        self.get_state = get_state
        self.embedding_request = embedding_request

    @classmethod
    def from_sglang(cls) -> "SGLangRuntime":
        from sglang.srt.entrypoints import http_server
        from sglang.srt.managers.io_struct import EmbeddingReqInput

        get_state = getattr(http_server, "get_global_state", None) or (lambda: http_server._global_state)
        return cls(get_state, EmbeddingReqInput)

    def ready(self) -> tuple[Any, Mapping[str, Any]]:
        """(tokenizer manager, scheduler info), or a 503 ContractError while loading or stopping."""
        state = self.get_state()
        tm = getattr(state, "tokenizer_manager", None)
        if tm is None:
            raise contract.ContractError(503, "model is loading; retry shortly", contract.UNAVAILABLE)
        if getattr(tm, "gracefully_exit", False):
            raise contract.ContractError(503, "server is shutting down", contract.UNAVAILABLE)
        status = getattr(getattr(tm, "server_status", None), "name", None)
        if status == "Starting":
            raise contract.ContractError(503, "model is loading (warming up); retry shortly", contract.UNAVAILABLE)
        return tm, dict(getattr(state, "scheduler_info", None) or {})

    @staticmethod
    def tokenizer(tm: Any) -> Optional[contract.Tokenize]:
        tok = getattr(tm, "tokenizer", None)
        if tok is None:  # --skip-tokenizer-init
            return None

        def tokenize(texts: Sequence[str], add_special_tokens: bool = True) -> list:
            if add_special_tokens:  # the tokenizer's default, as SGLang calls it
                return list(tok(list(texts))["input_ids"])
            return list(tok(list(texts), add_special_tokens=False)["input_ids"])

        return tokenize

    async def logits(self, tm: Any, rows: list[list[int]], request: Optional[Request],
                     num_labels: int = len(contract.LABELS)) -> list[list[float]]:
        obj = self.embedding_request(input_ids=rows)
        try:
            out = await tm.generate_request(obj, request).__anext__()
        except ValueError as exc:  # SGLang's own request validation
            raise contract.ContractError(400, f"rejected by the runtime: {exc}") from None
        outputs = out if isinstance(out, list) else [out]
        if len(outputs) != len(rows):
            raise contract.ContractError(500, f"runtime returned {len(outputs)} results for {len(rows)} inputs",
                                         contract.INTERNAL)
        logits = []
        for i, item in enumerate(outputs):
            row = item.get("embedding") if isinstance(item, dict) else None
            if not isinstance(row, list) or len(row) != num_labels:
                raise contract.ContractError(
                    500, f"runtime returned {row!r:.80} for row {i}, not {num_labels} logits: is the served "
                    "architecture Qwen3_5ForSequenceClassification?", contract.INTERNAL)
            if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in row):
                raise contract.ContractError(500, f"runtime returned non-finite logits for row {i}: {row}",
                                             contract.INTERNAL)
            logits.append(row)
        return logits


# ---------------------------------------------------------------- routes
def _error(exc: contract.ContractError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _internal_error(exc: BaseException, path: str) -> JSONResponse:
    """The catch-all: an unexpected exception is the contract's 500 with a request id (traceback logged)."""
    rid = uuid.uuid4().hex[:16]
    logger.error("request %s %s failed: %s\n%s", rid, path, exc, traceback.format_exc())
    body = contract.error_body(f"internal error ({type(exc).__name__}); request id {rid}", contract.INTERNAL, 500)
    body["error"]["request_id"] = rid
    return JSONResponse(body, status_code=500, headers={"X-Request-Id": rid})


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it passes `limit` bytes (the Content-Length header first)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit():
        contract.check_body_size(int(declared), limit)
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            contract.check_body_size(len(buf), limit)
    return bytes(buf)


@dataclass
class ClassifyBackend:
    """What the classify pipeline needs from an engine for one request: its input limits, its
    tokenizer (for text inputs), the model name to answer with, and `score(rows)` -> logits rows."""

    limits: contract.Limits
    tokenize: Any
    model_name: str
    score: Callable[[list], Any]


async def answer_classify(backend: ClassifyBackend, body: Any, offload: Callable, vllm_only: bool = False) -> dict:
    """The one /classify and /v1/classify pipeline of both servers (this adapter and the embedded
    backend, openjev/http_front.py): the request parsed off the event loop (`offload(fn, *args)`),
    as vLLM's classify request where it is one (vLLM's own route is POST /classify {"model",
    "input"}) or `vllm_only`, else as the native one; the rows scored; the matching response body."""
    if vllm_only or contract.is_vllm_request(body):
        req = await offload(contract.parse_vllm_classify, body, backend.limits, backend.tokenize, backend.model_name)
        logits = await backend.score(req.rows)
        return contract.v1_classify_response(logits, req.rows, backend.model_name, req.use_activation, request=req)
    rows = await offload(contract.parse_classify, body, backend.limits, backend.tokenize)
    return contract.classify_response(await backend.score(rows), backend.model_name)


def _find_route(app: FastAPI, path: str) -> list:
    return [r for r in app.router.routes if getattr(r, "path", None) == path]


def adopt_route_traits(app: FastAPI, path: str, endpoint: Callable, methods: Sequence[str]) -> list[str]:
    """Make our endpoint for `path` carry what SGLang's own one had: its methods (SGLang's /classify
    takes PUT as well as POST) and the attributes its decorators set on the function, such as the
    auth level SGLang's API-key middleware reads (its /flush_cache needs the admin key when
    --admin-api-key is set). Returns the union of methods."""
    union = list(methods)
    for route in _find_route(app, path):
        for m in sorted(getattr(route, "methods", None) or ()):
            if m not in union and m != "HEAD":
                union.append(m)
        original = getattr(route, "endpoint", None)
        for key, value in (getattr(original, "__dict__", None) or {}).items():
            if not key.startswith("__") and key not in ("__wrapped__",):
                setattr(endpoint, key, value)
    return union


def _find_endpoint(app: FastAPI, path: str, method: str) -> Optional[Callable]:
    for route in app.router.routes:
        if getattr(route, "path", None) == path and method in (getattr(route, "methods", None) or ()):
            return getattr(route, "endpoint", None)
    return None


def remove_routes(app: FastAPI, paths: Sequence[str]) -> list[str]:
    """Drop every route on `paths` (all methods); returns what was removed, for the log."""
    removed, kept = [], []
    for route in app.router.routes:
        if getattr(route, "path", None) in paths:
            removed.append(f"{','.join(sorted(getattr(route, 'methods', None) or ()))} {route.path}")
        else:
            kept.append(route)
    app.router.routes[:] = kept
    return removed


def install_routes(app: FastAPI, runtime: Optional[SGLangRuntime] = None,
                   environ: Mapping[str, str] = os.environ) -> Counters:
    """Serve the contract's routes on `app` (SGLang's FastAPI app unless a test passes its own)."""
    runtime = runtime or SGLangRuntime.from_sglang()
    batch_limit = max_batch_size(environ)
    body_limit = max_body_bytes(environ)
    text_limit = max_text_chars(environ)
    counters = Counters()
    sglang_server_info = _find_endpoint(app, "/server_info", "GET")

    def model_name(tm: Any) -> str:
        return str(getattr(tm, "served_model_name", None) or tm.server_args.model_path)

    async def body_json(request: Request, max_rows: Optional[int] = None) -> Any:
        raw = await read_body(request, body_limit)
        return await asyncio.to_thread(contract.parse_json, raw, max_rows)  # off the event loop

    def classify_route(path: str, vllm_only: bool):
        async def handler(request: Request) -> JSONResponse:
            try:
                tm, sched = runtime.ready()
                limits = input_limits(tm, sched, batch_limit, text_limit)
                body = await body_json(request, limits.max_batch_size)
                backend = ClassifyBackend(limits, runtime.tokenizer(tm), model_name(tm),
                                          functools.partial(runtime.logits, tm, request=request))
                return JSONResponse(await answer_classify(backend, body, asyncio.to_thread, vllm_only))
            except contract.ContractError as exc:
                return _error(exc)
            except Exception as exc:  # noqa: BLE001 - catch-all, JSON with a request id
                return _internal_error(exc, path)
        return handler

    async def flush_cache(request: Request) -> JSONResponse:
        try:
            tm, _ = runtime.ready()
            raw = request.query_params.get("timeout", "0") or "0"
            try:
                timeout = float(raw)
            except ValueError:
                raise contract.ContractError(400, f"timeout must be a number of seconds, got {raw!r}") from None
            if timeout < 0:
                raise contract.ContractError(400, "timeout must not be negative")
        except contract.ContractError as exc:
            return _error(exc)
        counters.flush_cache_calls += 1
        ret = await tm.flush_cache(timeout_s=timeout) if timeout > 0 else await tm.flush_cache()
        if not getattr(ret, "success", False):
            counters.flush_cache_failures += 1
            message = getattr(ret, "message", "") or ("prefix cache not flushed: the runtime flushes only when "
                                                      "no request is running or waiting; retry when idle or "
                                                      "pass ?timeout=SECONDS")
            return _error(contract.ContractError(400, message))
        return JSONResponse({"flushed": True, "flush_cache_calls": counters.flush_cache_calls})

    async def server_info(request: Request) -> JSONResponse:
        try:
            tm, sched = runtime.ready()
            limits = input_limits(tm, sched, batch_limit)
        except contract.ContractError as exc:
            return _error(exc)
        base: dict = {}
        if sglang_server_info is not None:
            try:
                base = dict(await sglang_server_info())
            except Exception as exc:  # noqa: BLE001 - SGLang's half is extra detail, ours must answer
                base = {"sglang_server_info_error": f"{type(exc).__name__}: {exc}"}
        ours = adapter_server_info(tm, limits, counters, environ)
        return JSONResponse(_jsonable({**base, **ours}))

    endpoints = {"/classify": classify_route("/classify", False), "/v1/classify": classify_route("/v1/classify", True),
                 "/flush_cache": flush_cache,
                 "/server_info": server_info}
    methods = {path: adopt_route_traits(app, path, fn, ADAPTER_ROUTES[path]) for path, fn in endpoints.items()}
    removed = remove_routes(app, list(ADAPTER_ROUTES))
    if removed:
        logger.info("sglang_openjev replaces SGLang routes: %s", "; ".join(removed))
    for path, fn in endpoints.items():
        app.add_api_route(path, fn, methods=methods[path])
    return counters


def _jsonable(value: Any) -> Any:
    """SGLang's server info holds a few non-JSON values (enums, paths, classes): stringify them."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
