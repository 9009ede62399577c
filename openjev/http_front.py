"""The embedded server's HTTP front: routes, errors, readiness, metrics and the transport it answers on."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import traceback
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from openjev.engine.scheduler import PARSE_WORKERS, Engine
from sglang_openjev import contract
# the body read (413 past the limit) and the classify pipeline, shared with the SGLang adapter
from sglang_openjev.routes import ClassifyBackend, answer_classify, read_body

log = logging.getLogger("openjev.transformers")

ROUTES = ("/classify", "/v1/classify", "/health", "/flush_cache", "/server_info", "/v1/models", "/tokenize",
          "/detokenize", "/metrics")


class Metrics:
    """Prometheus metrics of one server (its own registry, so tests may run several)."""

    def __init__(self, engine: Engine):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("openjev_http_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.rows = Counter("openjev_rows", "rows (inputs) accepted for scoring", registry=r)
        self.tokens = Counter("openjev_tokens", "tokens of the rows accepted for scoring", registry=r)
        self.errors = Counter("openjev_errors", "error responses by error type", ["type"], registry=r)
        for type_ in (contract.BAD_REQUEST, contract.TOO_LARGE, contract.NOT_FOUND, contract.UNAVAILABLE,
                      contract.OVERLOADED, contract.INTERNAL):
            self.errors.labels(type=type_)  # exported as 0 from the start, so rates work
        self.cancelled_rows = Counter("openjev_cancelled_rows", "queued rows dropped because the client disconnected",
                                      registry=r)
        self.step_seconds = Histogram("openjev_step_seconds", "wall time of one scheduling step", registry=r,
                                      buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.forward_tokens = Counter("openjev_forward_tokens", "tokens the forwards ran, padding included "
                                      "(over openjev_tokens: the padding overhead)", registry=r)
        self.queue_seconds = Histogram("openjev_queue_seconds", "time a request waited from being queued to the "
                                       "step that first took its rows (--batch-wait-ms included)", registry=r,
                                       buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.step_rows = Histogram("openjev_step_rows", "rows in one scheduling step", registry=r,
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.request_seconds = Histogram("openjev_request_seconds", "wall time of classify requests", ["route"],
                                         registry=r, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        q_req = Gauge("openjev_queue_requests", "requests waiting or running", registry=r)
        q_req.set_function(lambda: engine.queue_depth()[0])
        q_rows = Gauge("openjev_queue_rows", "rows waiting or running", registry=r)
        q_rows.set_function(lambda: engine.queue_depth()[1])
        stall = Gauge("openjev_stalled_seconds", "seconds queued work has made no progress", registry=r)
        stall.set_function(engine.stalled_for)
        healthy = Gauge("openjev_healthy", "1 when /health answers 200", registry=r)
        healthy.set_function(lambda: 1.0 if health_problem(engine) is None else 0.0)
        budget = Gauge("openjev_step_token_budget", "tokens per scheduling step", registry=r)
        budget.set(engine.args.step_token_budget)
        self.computed_tokens = Counter("openjev_computed_tokens", "real tokens the forwards ran (with prefix reuse, "
                                       "fewer than openjev_tokens)", registry=r)
        for key, doc in (("entries", "prefix states cached"), ("bytes", "bytes of the prefix states cached"),
                         ("hits", "rows that went on from a cached prefix state"),
                         ("misses", "rows with no cached prefix state"),
                         ("tokens_reused", "tokens rows took from cached prefix states instead of running them")):
            g = Gauge(f"openjev_prefix_cache_{key}", f"{doc} (0 without --prefix-reuse)", registry=r)
            g.set_function(functools.partial(engine.prefix_cache_stat, key))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def health_problem(engine: Engine) -> contract.ContractError | None:
    if engine.state == "loading":
        return contract.ContractError(503, "model is loading; retry shortly", contract.UNAVAILABLE)
    if engine.state == "failed":
        return contract.ContractError(503, engine.error or "model failed to load", contract.UNAVAILABLE)
    if engine.state == "draining":
        return contract.ContractError(503, "server is shutting down", contract.UNAVAILABLE)
    limit = engine.args.watchdog_seconds
    if limit and (stalled := engine.stalled_for()) > limit:
        return contract.ContractError(
            503, f"watchdog: queued work has made no progress for {stalled:.1f} s (limit {limit:g} s)",
            contract.UNAVAILABLE)
    return None


class FrontMiddleware:
    """Outermost of our layers: counts every response by route and status, and turns any exception a
    handler lets escape into the contract's JSON 500 with a request id (traceback in the log)."""

    def __init__(self, app, engine: Engine):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"
        status = {"code": None}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:  # noqa: BLE001 - the catch-all: every failure is a JSON body
            rid = uuid.uuid4().hex[:16]
            log.error("request %s %s %s failed: %s\n%s", rid, scope.get("method"), path, exc, traceback.format_exc())
            self.engine.counters.errors_5xx += 1
            if self.engine.metrics:
                self.engine.metrics.errors.labels(type=f"{contract.INTERNAL}:{type(exc).__name__}").inc()
            if status["code"] is None:
                body = contract.error_body(f"internal error ({type(exc).__name__}); request id {rid}", contract.INTERNAL, 500)
                body["error"]["request_id"] = rid
                status["code"] = 500
                resp = JSONResponse(body, status_code=500, headers={"X-Request-Id": rid})
                await resp(scope, receive, send)
        finally:
            if self.engine.metrics and status["code"] is not None:
                self.engine.metrics.requests.labels(route=route, status=str(status["code"])).inc()




CANCEL_POLL_S = 0.1


class Disconnected(Exception):
    pass


def create_app(engine: Engine) -> FastAPI:
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="openjev embedded backend", docs_url=None, redoc_url=None, openapi_url=None)
    engine.metrics = Metrics(engine)
    pool = ThreadPoolExecutor(PARSE_WORKERS, thread_name_prefix="openjev-parse")

    def error(exc: contract.ContractError) -> JSONResponse:
        # a 503 while loading is a start-up answer, not an error: alerts on errors stay quiet across restarts
        if not (exc.status == 503 and engine.state == "loading"):
            if exc.status >= 500:
                engine.counters.errors_5xx += 1
            else:
                engine.counters.errors_4xx += 1
            engine.metrics.errors.labels(type=exc.type).inc()
        headers = {"Retry-After": "5"} if exc.status == 503 else {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException):
        type_ = contract.NOT_FOUND if exc.status_code == 404 else contract.BAD_REQUEST
        return error(contract.ContractError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type_))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return error(contract.ContractError(400, f"invalid request: {exc}"))

    def require_ready() -> None:
        if engine.state == "loading":
            raise contract.ContractError(503, "model is loading; retry shortly", contract.UNAVAILABLE)
        if engine.state == "failed":
            raise contract.ContractError(503, engine.error or "model failed to load", contract.UNAVAILABLE)

    async def off_loop(fn, *args):
        """JSON parsing, validation and tokenizing run in a worker thread: the event loop (and /health)
        never waits for them."""
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def body_json(request: Request, max_rows: int | None = None):
        raw = await read_body(request, engine.args.max_body_bytes)
        try:
            return await off_loop(contract.parse_json, raw, max_rows)
        finally:
            del raw

    async def score(request: Request, rows: list[list[int]]):
        job = engine.submit(rows)  # refuses with 429 when the queue is full
        engine.counters.requests += 1
        engine.counters.rows += len(rows)
        n_tokens = sum(len(r) for r in rows)
        engine.counters.tokens += n_tokens
        engine.metrics.rows.inc(len(rows))
        engine.metrics.tokens.inc(n_tokens)
        try:
            while True:  # wait for the rows; a client that goes away cancels what is still queued
                done, _ = await asyncio.wait({job.future}, timeout=CANCEL_POLL_S)
                if done:
                    break
                if engine.drain_deadline is not None and time.monotonic() >= engine.drain_deadline:
                    engine.cancel(job)
                    raise contract.ContractError(
                        503, "server is shutting down: this request could not finish within the drain window; "
                             "send it again (to another replica)", contract.UNAVAILABLE)
                if await request.is_disconnected():
                    engine.cancel(job)
                    raise Disconnected()
        except asyncio.CancelledError:
            engine.cancel(job)
            raise
        try:
            return job.future.result()
        except Exception as exc:  # noqa: BLE001
            raise contract.ContractError(500, f"inference failed: {exc}", contract.INTERNAL) from None

    def classify_route(path: str, vllm_only: bool):
        async def handler(request: Request):
            t0 = time.perf_counter()
            try:
                require_ready()
                body = await body_json(request, engine.args.max_batch_size)

                async def score_rows(rows):
                    return (await score(request, rows)).tolist()

                backend = ClassifyBackend(engine.limits(), engine.tokenize(), engine.model_name, score_rows)
                return JSONResponse(await answer_classify(backend, body, off_loop, vllm_only))
            except contract.ContractError as exc:
                return error(exc)
            except Disconnected:
                return Response(status_code=499)
            finally:
                engine.metrics.request_seconds.labels(route=path).observe(time.perf_counter() - t0)
        return handler

    # SGLang registers /classify for POST and PUT; so does this backend.
    app.add_api_route("/classify", classify_route("/classify", False), methods=["POST", "PUT"])
    app.add_api_route("/v1/classify", classify_route("/v1/classify", True), methods=["POST"])

    async def json_answer(request: Request, work) -> Response:
        """work(body) off the event loop once the server is ready and the JSON body is read; a contract
        error answers as such."""
        try:
            require_ready()
            body = await body_json(request)
            return JSONResponse(await off_loop(work, body))
        except contract.ContractError as exc:
            return error(exc)

    def tokenize_work(body) -> dict:
        prompt, add_special, want_strs = contract.parse_tokenize(body, engine.limits(), engine.model_name)
        tok = engine.clf.tokenizer
        if tok is None:
            raise contract.ContractError(400, "this server has no tokenizer")
        ids = contract.tokenize_texts([prompt], engine.tokenize(), add_special)[0] if prompt else []
        strs = tok.convert_ids_to_tokens(ids) if want_strs else None
        return contract.tokenize_response(ids, engine.args.context_length, strs)

    def detokenize_work(body) -> dict:
        ids = contract.parse_detokenize(body, engine.limits(), engine.model_name)
        if engine.clf.tokenizer is None:
            raise contract.ContractError(400, "this server has no tokenizer")
        return {"prompt": engine.clf.tokenizer.decode(ids)}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await json_answer(request, tokenize_work)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await json_answer(request, detokenize_work)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        problem = health_problem(engine)
        if problem is not None:
            return error(problem)
        return JSONResponse({"status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        return JSONResponse(engine.flush_cache())

    @app.get("/server_info")
    async def server_info():
        info = engine.server_info()
        info["queue"] = dict(zip(("requests", "rows"), engine.queue_depth()))
        info["stalled_seconds"] = round(engine.stalled_for(), 3)
        return JSONResponse(info)

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                                         "owned_by": "openjev", "root": str(engine.args.checkpoint),
                                                         "max_model_len": engine.args.context_length}]})

    @app.get("/metrics")
    async def metrics():
        data, ctype = engine.metrics.render()
        return Response(data, media_type=ctype)

    app.add_middleware(FrontMiddleware, engine=engine)
    return app


class CoalescingTransport:
    """An asyncio transport whose writes made in one event-loop turn leave in one write.

    uvicorn's h11 protocol writes a response in two or three pieces (status line and headers,
    body, end of message), each its own send() and, with TCP_NODELAY, its own segment. A replica
    killed between them (SIGKILL, OOM kill) leaves the gateway holding headers without a body, a
    broken response that HAProxy can no longer retry elsewhere (seen as IncompleteRead in the
    failover test). Coalesced, a response is in the kernel whole or not at all; an empty
    response is one HAProxy retries on the other replica.
    """

    def __init__(self, transport: asyncio.Transport):
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def writelines(self, chunks) -> None:
        for chunk in chunks:
            self.write(chunk)

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name):
        return getattr(self._transport, name)


HEADER_TIMEOUT_S = 10.0  # a connection must finish a request's headers this soon after it opens or idles


def coalescing_h11_protocol() -> type:
    """uvicorn's h11 protocol over a CoalescingTransport (uvicorn.Config(http=...)), with a header
    timeout: uvicorn cancels its keep-alive timer at the first byte, so a client that sends part of
    its headers and stops held the connection forever (HAProxy's `timeout http-request`)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class CoalescingH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(CoalescingTransport(transport))
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if getattr(self, "_header_timer", None) is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._header_timeout)

        def _header_timeout(self) -> None:
            self._header_timer = None
            waiting_for_headers = self.cycle is None or self.cycle.response_complete
            if waiting_for_headers and not self.transport.is_closing():
                self.transport.close()

    return CoalescingH11Protocol


def release_large_allocations_to_the_os() -> str:
    """glibc raises its mmap threshold after a large block is freed (up to 32 MiB), so later large
    request bodies land in heap arenas that are not given back: RSS stayed 2-4 GB after a 20 MB body.
    A fixed threshold keeps every block over 1 MiB in its own mapping, returned on free."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold = -3
        return "mmap threshold 1 MiB" if libc.mallopt(m_mmap_threshold, 1 << 20) == 1 else "mallopt refused"
    except (OSError, AttributeError):  # not glibc
        return "default allocator"
