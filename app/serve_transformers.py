#!/usr/bin/env python3
"""The embedded backend: the unmodified Transformers model behind the `/classify` contract.

For machines without SGLang (CPU CI, a laptop, a GPU that SGLang does not build for) and as the
reference the SGLang path is compared against. Same wire contract as the SGLang adapter
(SPEC section 2, implemented once in `sglang_openjev/contract.py`):

  POST /classify       {"input_ids": [[...], ...]} | {"input_ids": [...]} | {"text": ...} -> raw C/E/N logits
  POST /v1/classify    vLLM / SGLang classify shape (softmax probs; raw with "use_activation": false)
  GET  /health         200 when ready, 503 while the model loads
  POST /flush_cache    no prefix cache here: answers 200 and says so (counted in /server_info)
  GET  /server_info    backend, model, dtype, device, limits, counters, bundle git revision
  GET  /v1/models      the served model, for OpenAI-style clients

Framework: FastAPI on uvicorn, the stack SGLang's own HTTP server uses, so the adapter and this
backend share routes, error bodies and operational behaviour (graceful SIGTERM, keep-alive).
Concurrent requests are batched: an inference thread drains every queued request into one
scheduling step and runs it in forwards of at most --max-running-requests rows. Each request is
validated completely before it is queued, so a bad row gets its own 400 and never reaches a
batch shared with other requests.

The port is bound before the model loads (so a port in use fails at once and /health answers
503 while loading); it binds 127.0.0.1 unless --host says otherwise.

Example:
  serve_transformers.py $OPENJEV_V100_ROOT/model 31003
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from openjev.common import UserError, bind_listen_socket, git_revision, run_main, utc_now
from sglang_openjev import contract
from sglang_openjev.routes import read_body  # the body, refused with 413 past the limit (shared with the adapter)

log = logging.getLogger("openjev.transformers")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"{name} must be an integer, got {raw!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="model (or overlay) directory")
    p.add_argument("port", type=int, help="TCP port to listen on")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"],
                   help="auto = float16 on a GPU, float32 on a CPU (default: auto)")
    p.add_argument("--context-length", type=int, default=8192,
                   help="inputs must be shorter than this (default: 8192, as the SGLang launcher)")
    p.add_argument("--max-running-requests", type=int, default=16,
                   help="most rows per forward pass; a padded step is cut into fewer rows a forward where that "
                        "pads less (default: 16, as the SGLang launcher)")
    p.add_argument("--schedule-policy", default="lpm", choices=["lpm", "fcfs"],
                   help="accepted for launcher parity; with no prefix cache both mean first-come-first-served")
    p.add_argument("--max-batch-size", type=int, default=512, help="most inputs in one request; more gets 413 (default: 512)")
    p.add_argument("--batching", default="auto", choices=["auto", "exact", "padded"],
                   help="exact: one unpadded forward per row (bitwise the reference scorer); padded: rows of a step "
                        "padded into one forward; auto: exact on CPU, padded on a GPU (default: auto)")
    p.add_argument("--disable-radix-cache", action="store_true", help="accepted for launcher parity (no cache here)")
    p.add_argument("--served-model-name", default=None, help="model name in responses (default: the checkpoint directory name)")
    p.add_argument("--step-token-budget", type=int, default=_env_int("OPENJEV_STEP_TOKEN_BUDGET", 16384),
                   help="tokens per scheduling step: a larger request is split over steps, rows of queued requests "
                        "take turns, and a step's rows are grouped by length into forwards of at most "
                        "--max-running-requests rows (default: 16384, env OPENJEV_STEP_TOKEN_BUDGET)")
    p.add_argument("--max-body-bytes", type=int, default=_env_int("OPENJEV_MAX_BODY_BYTES", contract.DEFAULT_MAX_BODY_BYTES),
                   help="a larger request body gets 413 before it is parsed (default: 32 MiB, env OPENJEV_MAX_BODY_BYTES)")
    p.add_argument("--max-text-chars", type=int, default=_env_int("OPENJEV_MAX_TEXT_CHARS", contract.DEFAULT_MAX_TEXT_CHARS),
                   help="most characters of text in one request, checked before tokenizing; more gets 413 "
                        "(default: 1048576, env OPENJEV_MAX_TEXT_CHARS)")
    p.add_argument("--watchdog-seconds", type=float, default=float(_env_int("OPENJEV_WATCHDOG_SECONDS", 120)),
                   help="/health answers 503 when queued work has made no progress for this long, so a gateway "
                        "routes away; 0 turns it off (default: 120, env OPENJEV_WATCHDOG_SECONDS)")
    p.add_argument("--torch-threads", type=int, default=_env_int("OPENJEV_TORCH_THREADS", 0),
                   help="torch intra-op threads; 0 = auto: cores - 1 on a CPU (1 on a 2-core machine), leaving a "
                        "core to the HTTP loop and tokenizer (default: 0, env OPENJEV_TORCH_THREADS)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every request (uvicorn access log)")
    return p


@dataclass
class Job:
    """One accepted request: its rows, where they stand, and the future its handler awaits."""

    rows: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    results: object = None          # np.ndarray [n, 3], filled step by step
    cursor: int = 0                 # next row to schedule
    done_rows: int = 0
    cancelled: bool = False


@dataclass
class Counters:
    requests: int = 0
    rows: int = 0
    tokens: int = 0
    forward_passes: int = 0
    padded_tokens: int = 0          # tokens the forwards ran, padding included
    steps: int = 0
    flush_cache_calls: int = 0
    errors_4xx: int = 0
    errors_5xx: int = 0
    rows_cancelled: int = 0
    requests_cancelled: int = 0
    rows_dropped_after_step: int = 0


def plan_step(jobs: "list[Job]", token_budget: int) -> list[tuple[Job, int]]:
    """Pick the rows of one scheduling step: round-robin over the queued requests in arrival order,
    one row per request per turn, until the step's token budget is spent (a step always takes at
    least one row, so a row longer than the budget still runs, alone). A large request is thereby
    split over several steps and a small one queued behind it is served in the next step.
    Returns (job, row index) pairs; advances each job's cursor."""
    picked: list[tuple[Job, int]] = []
    used = 0
    active = [j for j in jobs if not j.cancelled and j.cursor < len(j.rows)]
    while active:
        nxt = []
        for job in active:
            n = len(job.rows[job.cursor])
            if picked and used + n > token_budget:
                return picked
            picked.append((job, job.cursor))
            used += n
            job.cursor += 1
            if job.cursor < len(job.rows):
                nxt.append(job)
        active = nxt
    return picked


# What one more padded forward costs, in padded tokens, when a step's rows are cut into forwards
# (kernel launches and part-filled waves that do not grow with the rows). With 1024 the 128-row
# H200 set served as batches of 32 from 4 clients, --max-running-requests 16, step budget 65536,
# is padded by 6 % in 12 forwards instead of 16 % in 9 with fixed-size cuts (default budget 16384:
# 11 % instead of 43 %).
FORWARD_COST_TOKENS = 1024


def length_groups(lengths: list[int], max_rows: int, forward_cost: int = FORWARD_COST_TOKENS) -> list[list[int]]:
    """Indices of a step cut into padded forwards of at most max_rows rows, shortest rows first.

    The rows are sorted by length and cut into consecutive runs so that the padded tokens (each
    run's longest row times its row count) plus `forward_cost` per run are least: dynamic
    programming over the sorted lengths, O(rows x max_rows). forward_cost 0 gives runs of equal
    lengths; a large one gives the fewest forwards. Ties keep the earlier cut."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0] + [None] * n  # best[j]: least cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(max(0, j - max_rows), j):
            cost = best[i] + longest * (j - i) + forward_cost
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    groups = []
    while n > 0:
        groups.append(order[cut[n]:n])
        n = cut[n]
    return groups[::-1]


def auto_torch_threads(cores: int, device: str) -> int:
    """Intra-op threads for torch: the inference thread gets every core but one, which stays with the
    event loop, JSON parsing and tokenizing (2 cores -> 1 thread). Measured on the 2-core CPU machine:
    torch's default (2 threads) gave p99 4-17 s with 16 clients, 1 thread p99 149 ms."""
    if device != "cpu":
        return max(1, min(4, cores - 1))  # a GPU forward needs few CPU threads
    return max(1, cores - 1)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class Engine:
    """Model state and the inference thread. HTTP handlers only validate, enqueue and await."""

    args: argparse.Namespace
    state: str = "loading"  # loading | ready | failed
    error: str | None = None
    clf: object | None = None
    batching: str = "exact"
    counters: Counters = field(default_factory=Counters)
    started_at: str = field(default_factory=utc_now)
    load_seconds: float | None = None
    torch_threads: int | None = None
    metrics: object | None = None
    _pending: "list[Job]" = field(default_factory=list)
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _stopping: bool = False
    last_progress: float = field(default_factory=time.monotonic)
    step_running_since: float | None = None

    # ------------------------------------------------------------ loading
    def load(self, on_failure) -> None:
        t0 = time.perf_counter()
        try:
            import torch

            from openjev.engine.classifier import load_classifier, resolve_device

            device = resolve_device(self.args.device)
            self.torch_threads = self.args.torch_threads or auto_torch_threads(available_cores(), device)
            torch.set_num_threads(self.torch_threads)
            self.clf = load_classifier(self.args.checkpoint, self.args.device, self.args.dtype)
            self.batching = self.args.batching if self.args.batching != "auto" else (
                "exact" if self.clf.device == "cpu" else "padded")
            from openjev.engine.warmup import prepare_serving  # compile GDN kernels before the first request

            self.warmup = prepare_serving(self.clf, self.batching, self.args.max_running_requests)
        except Exception as exc:  # noqa: BLE001 - any load failure ends the process with one line
            self.state, self.error = "failed", f"model failed to load from {self.args.checkpoint}: {exc}"
            log.error(self.error)
            on_failure()
            return
        self.load_seconds = round(time.perf_counter() - t0, 3)
        threading.Thread(target=self._run, name="openjev-inference", daemon=True).start()
        self.state = "ready"
        log.info("model ready: %s (%s on %s, batching %s, %d torch threads, step budget %d tokens) in %.1f s",
                 self.args.checkpoint, self.clf.dtype, self.clf.device, self.batching, self.torch_threads,
                 self.args.step_token_budget, self.load_seconds)

    def limits(self) -> contract.Limits:
        return contract.Limits(self.clf.vocab_size, self.args.context_length, self.args.max_batch_size,
                               max_text_chars=self.args.max_text_chars)

    def tokenize(self):
        tok = self.clf.tokenizer
        if tok is None:
            return None
        return lambda texts, add_special_tokens=True: tok(list(texts), add_special_tokens=add_special_tokens)["input_ids"]

    # ------------------------------------------------------------ queue
    def submit(self, rows: list[list[int]]) -> Job:
        import numpy as np

        loop = asyncio.get_running_loop()
        job = Job(rows, loop, loop.create_future(), results=np.empty((len(rows), 3), dtype=np.float32))
        with self._cv:
            if not self._pending:
                self.last_progress = time.monotonic()  # the watchdog counts from when work arrives
            self._pending.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: its queued rows are dropped; a running step's rows are discarded."""
        with self._cv:
            if job.cancelled or job.future.done():
                return
            job.cancelled = True
            dropped = len(job.rows) - job.cursor
            self.counters.rows_cancelled += dropped
            self.counters.requests_cancelled += 1
            if job in self._pending:
                self._pending.remove(job)
        if self.metrics:
            self.metrics.cancelled_rows.inc(dropped)
        log.info("client disconnected: dropped %d queued rows of a %d-row request", dropped, len(job.rows))

    def queue_depth(self) -> tuple[int, int]:
        """(requests, rows) waiting or running."""
        with self._cv:
            return len(self._pending), sum(len(j.rows) - j.done_rows for j in self._pending)

    def stalled_for(self) -> float:
        """Seconds queued work has made no progress (0 with nothing queued)."""
        with self._cv:
            if not self._pending:
                return 0.0
            return time.monotonic() - self.last_progress

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                picked = plan_step(self._pending, self.args.step_token_budget)
                self.step_running_since = time.monotonic()
            if picked:
                self._run_step(picked)
            with self._cv:
                self.step_running_since = None
                self.last_progress = time.monotonic()
                self._pending = [j for j in self._pending if not j.cancelled and j.done_rows < len(j.rows)]

    def _run_step(self, picked: list[tuple[Job, int]]) -> None:
        import numpy as np

        from openjev.engine.classifier import padded_logits, score_exact

        rows = [job.rows[i] for job, i in picked]
        t0 = time.perf_counter()
        try:
            logits = np.empty((len(rows), 3), dtype=np.float32)
            queued = []  # padded forwards of this step, their logits still on the device
            forwards = padded_tokens = 0
            for idx in length_groups([len(r) for r in rows], self.args.max_running_requests):
                group = [rows[i] for i in idx]
                if self.batching == "exact" or self.clf.pad_token_id is None:
                    logits[idx] = score_exact(self.clf, group)
                    forwards += len(group)
                    padded_tokens += sum(map(len, group))
                else:  # similar lengths together keep padding small; one host copy per step
                    queued.append((idx, padded_logits(self.clf, group)))
                    forwards += 1
                    padded_tokens += max(map(len, group)) * len(group)
            self.counters.forward_passes += forwards
            self.counters.padded_tokens += padded_tokens
            if queued:
                import torch

                with torch.inference_mode():
                    host = torch.cat([t for _, t in queued]).float().cpu().numpy()
                logits[[i for idx, _ in queued for i in idx]] = host
        except Exception as exc:  # noqa: BLE001 - every request of the failed step gets the error
            log.exception("forward failed")
            with self._cv:
                for job in {id(j): j for j, _ in picked}.values():
                    job.cancelled = True
                    job.loop.call_soon_threadsafe(_set_exception, job.future, exc)
            return
        elapsed = time.perf_counter() - t0
        self.counters.steps += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d rows of %d requests, %d tokens, %d forwards, %d padded tokens, %.1f ms",
                      self.counters.steps, len(rows), len({id(j) for j, _ in picked}), sum(map(len, rows)),
                      forwards, padded_tokens, elapsed * 1e3)
        if self.metrics:
            self.metrics.step_seconds.observe(elapsed)
            self.metrics.step_rows.observe(len(rows))
            self.metrics.forward_tokens.inc(padded_tokens)
        with self._cv:
            for k, (job, i) in enumerate(picked):
                if job.cancelled:
                    self.counters.rows_dropped_after_step += 1
                    continue
                job.results[i] = logits[k]
                job.done_rows += 1
                if job.done_rows == len(job.rows):
                    job.loop.call_soon_threadsafe(_set_result, job.future, job.results)

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    # ------------------------------------------------------------ /server_info
    def server_info(self) -> dict:
        clf = self.clf
        return contract.server_info(
            backend="transformers", model=self.model_name, model_path=str(self.args.checkpoint),
            dtype=clf.dtype if clf else None, device=_describe_device(clf.device) if clf else None,
            context_length=self.args.context_length,
            schedule_policy="fcfs", requested_schedule_policy=self.args.schedule_policy,
            max_running_requests=self.args.max_running_requests, max_batch_size=self.args.max_batch_size,
            radix_cache=False, mamba_scheduler_strategy=None, mamba_full_memory_ratio=None,
            attention_backend=f"transformers-{clf.model.config._attn_implementation}" if clf else None,
            batching=self.batching if clf else None,
            scheduler={"kind": "token-budget round-robin, rows grouped by length inside a step",
                       "step_token_budget": self.args.step_token_budget,
                       "rows_per_forward": self.args.max_running_requests,
                       "watchdog_seconds": self.args.watchdog_seconds},
            step_token_budget=self.args.step_token_budget,
            limits={"max_body_bytes": self.args.max_body_bytes, "max_text_chars": self.args.max_text_chars,
                    "max_batch_size": self.args.max_batch_size, "max_input_tokens": self.args.context_length - 1},
            threads={"torch_intra_op": self.torch_threads, "cores": available_cores(),
                     "requested": self.args.torch_threads or "auto",
                     "parse_workers": PARSE_WORKERS},
            allocator=getattr(self, "allocator", None),
            kernel_path=clf.kernels if clf else None, warmup=getattr(self, "warmup", None),
            bundle_git=git_revision(), pid=os.getpid(), state=self.state, started_at=self.started_at,
            load_seconds=self.load_seconds, flush_cache_calls=self.counters.flush_cache_calls,
            counters=vars(self.counters).copy(),
            note="embedded Transformers backend: no prefix cache, no SGLang scheduler",
        )

    @property
    def model_name(self) -> str:
        return self.args.served_model_name or self.args.checkpoint.name


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _describe_device(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    idx = torch.device(device).index or 0
    major, minor = torch.cuda.get_device_capability(idx)
    return f"{device} ({torch.cuda.get_device_name(idx)}, sm_{major}{minor})"


# ---------------------------------------------------------------- metrics
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
                      contract.INTERNAL):
            self.errors.labels(type=type_)  # exported as 0 from the start, so rates work
        self.cancelled_rows = Counter("openjev_cancelled_rows", "queued rows dropped because the client disconnected",
                                      registry=r)
        self.step_seconds = Histogram("openjev_step_seconds", "wall time of one scheduling step", registry=r,
                                      buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.forward_tokens = Counter("openjev_forward_tokens", "tokens the forwards ran, padding included "
                                      "(over openjev_tokens: the padding overhead)", registry=r)
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

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def health_problem(engine: Engine) -> contract.ContractError | None:
    if engine.state == "loading":
        return contract.ContractError(503, "model is loading; retry shortly", contract.UNAVAILABLE)
    if engine.state == "failed":
        return contract.ContractError(503, engine.error or "model failed to load", contract.UNAVAILABLE)
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


# ---------------------------------------------------------------- HTTP
PARSE_WORKERS = 2
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
        if exc.status >= 500:
            engine.counters.errors_5xx += 1
        else:
            engine.counters.errors_4xx += 1
        engine.metrics.errors.labels(type=exc.type).inc()
        headers = {"Retry-After": "5"} if exc.status == 503 else None
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

    async def body_json(request: Request):
        raw = await read_body(request, engine.args.max_body_bytes)
        try:
            return await off_loop(contract.parse_json, raw)
        finally:
            del raw

    async def score(request: Request, rows: list[list[int]]):
        engine.counters.requests += 1
        engine.counters.rows += len(rows)
        n_tokens = sum(len(r) for r in rows)
        engine.counters.tokens += n_tokens
        engine.metrics.rows.inc(len(rows))
        engine.metrics.tokens.inc(n_tokens)
        job = engine.submit(rows)
        try:
            while True:  # wait for the rows; a client that goes away cancels what is still queued
                done, _ = await asyncio.wait({job.future}, timeout=CANCEL_POLL_S)
                if done:
                    break
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

    def parse_native(body):
        return contract.parse_classify(body, engine.limits(), engine.tokenize())

    def parse_vllm(body):
        return contract.parse_vllm_classify(body, engine.limits(), engine.tokenize(), engine.model_name)

    async def vllm_classify(request: Request, body) -> JSONResponse:
        req = await off_loop(parse_vllm, body)
        logits = await score(request, req.rows)
        return JSONResponse(contract.v1_classify_response(logits.tolist(), req.rows, engine.model_name,
                                                          req.use_activation, request=req))

    def classify_route(path: str, vllm_only: bool):
        async def handler(request: Request):
            t0 = time.perf_counter()
            try:
                require_ready()
                body = await body_json(request)
                if vllm_only or contract.is_vllm_request(body):
                    return await vllm_classify(request, body)
                rows = await off_loop(parse_native, body)
                logits = await score(request, rows)
                return JSONResponse(contract.classify_response(logits.tolist(), engine.model_name))
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

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            require_ready()
            body = await body_json(request)

            def work():
                prompt, add_special, want_strs = contract.parse_tokenize(body, engine.limits(), engine.model_name)
                tok = engine.clf.tokenizer
                if tok is None:
                    raise contract.ContractError(400, "this server has no tokenizer")
                ids = contract.tokenize_texts([prompt], engine.tokenize(), add_special)[0] if prompt else []
                strs = tok.convert_ids_to_tokens(ids) if want_strs else None
                return contract.tokenize_response(ids, engine.args.context_length, strs)
            return JSONResponse(await off_loop(work))
        except contract.ContractError as exc:
            return error(exc)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            require_ready()
            body = await body_json(request)

            def work():
                ids = contract.parse_detokenize(body, engine.limits(), engine.model_name)
                if engine.clf.tokenizer is None:
                    raise contract.ContractError(400, "this server has no tokenizer")
                return {"prompt": engine.clf.tokenizer.decode(ids)}
            return JSONResponse(await off_loop(work))
        except contract.ContractError as exc:
            return error(exc)

    @app.get("/health")
    async def health():
        problem = health_problem(engine)
        if problem is not None:
            return error(problem)
        return JSONResponse({"status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        engine.counters.flush_cache_calls += 1
        return JSONResponse({"flushed": False, "message": "the transformers backend has no prefix cache; nothing to flush",
                             "flush_cache_calls": engine.counters.flush_cache_calls})

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


def coalescing_h11_protocol() -> type:
    """uvicorn's h11 protocol over a CoalescingTransport (uvicorn.Config(http=...))."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class CoalescingH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(CoalescingTransport(transport))

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


def main() -> int:
    args = build_parser().parse_args()
    if args.max_running_requests < 1 or args.max_batch_size < 1 or args.context_length < 2:
        raise UserError("--max-running-requests and --max-batch-size must be >= 1, --context-length >= 2")
    if args.step_token_budget < 1 or args.max_body_bytes < 1 or args.max_text_chars < 1:
        raise UserError("--step-token-budget, --max-body-bytes and --max-text-chars must be >= 1")
    if args.watchdog_seconds < 0 or args.torch_threads < 0:
        raise UserError("--watchdog-seconds and --torch-threads must not be negative")
    if not (args.checkpoint / "config.json").is_file():
        raise UserError(f"{args.checkpoint} is not a model directory (no config.json)")
    from openjev.engine.fused import fused_mode
    from openjev.engine.kernels import kernel_mode

    kernel_mode(), fused_mode()  # a typo in OPENJEV_KERNELS / OPENJEV_FUSED fails here, before the port
    sock = bind_listen_socket(args.host, args.port)  # refuse a busy port before anything slow happens
    allocator = release_large_allocations_to_the_os()

    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    engine = Engine(args)
    engine.allocator = allocator
    config = uvicorn.Config(create_app(engine), log_level=args.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=30, lifespan="off", http=coalescing_h11_protocol())
    server = uvicorn.Server(config)

    def failed() -> None:
        server.should_exit = True

    loader = threading.Thread(target=engine.load, args=(failed,), name="openjev-loader", daemon=True)
    loader.start()
    log.info("listening on http://%s:%d (pid %d); loading %s", args.host, args.port, os.getpid(), args.checkpoint)
    server.run(sockets=[sock])
    engine.stop()
    if engine.state == "failed":
        raise UserError(engine.error or "model failed to load")
    return 0


if __name__ == "__main__":
    run_main(main)
