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
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from _common import UserError, bind_listen_socket, git_revision, run_main, utc_now
from sglang_openjev import contract

log = logging.getLogger("openjev.transformers")


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
                   help="rows per forward pass (default: 16, as the SGLang launcher)")
    p.add_argument("--schedule-policy", default="lpm", choices=["lpm", "fcfs"],
                   help="accepted for launcher parity; with no prefix cache both mean first-come-first-served")
    p.add_argument("--max-batch-size", type=int, default=512, help="most inputs in one request; more gets 413 (default: 512)")
    p.add_argument("--batching", default="auto", choices=["auto", "exact", "padded"],
                   help="exact: one unpadded forward per row (bitwise the reference scorer); padded: rows of a step "
                        "padded into one forward; auto: exact on CPU, padded on a GPU (default: auto)")
    p.add_argument("--disable-radix-cache", action="store_true", help="accepted for launcher parity (no cache here)")
    p.add_argument("--served-model-name", default=None, help="model name in responses (default: the checkpoint directory name)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every request (uvicorn access log)")
    return p


@dataclass
class Job:
    rows: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class Counters:
    requests: int = 0
    rows: int = 0
    forward_passes: int = 0
    steps: int = 0
    flush_cache_calls: int = 0
    errors_4xx: int = 0
    errors_5xx: int = 0


@dataclass
class Engine:
    """Model state and the inference thread. HTTP handlers only validate, enqueue and await."""

    args: argparse.Namespace
    state: str = "loading"  # loading | ready | failed
    error: str | None = None
    clf: object | None = None
    batching: str = "exact"
    counters: Counters = field(default_factory=Counters)
    jobs: "queue.Queue[Job | None]" = field(default_factory=queue.Queue)
    started_at: str = field(default_factory=utc_now)
    load_seconds: float | None = None

    # ------------------------------------------------------------ loading
    def load(self, on_failure) -> None:
        t0 = time.perf_counter()
        try:
            from _classifier import load_classifier

            self.clf = load_classifier(self.args.checkpoint, self.args.device, self.args.dtype)
            self.batching = self.args.batching if self.args.batching != "auto" else (
                "exact" if self.clf.device == "cpu" else "padded")
        except Exception as exc:  # noqa: BLE001 - any load failure ends the process with one line
            self.state, self.error = "failed", f"model failed to load from {self.args.checkpoint}: {exc}"
            log.error(self.error)
            on_failure()
            return
        self.load_seconds = round(time.perf_counter() - t0, 3)
        threading.Thread(target=self._run, name="openjev-inference", daemon=True).start()
        self.state = "ready"
        log.info("model ready: %s (%s on %s, batching %s) in %.1f s", self.args.checkpoint, self.clf.dtype,
                 self.clf.device, self.batching, self.load_seconds)

    def limits(self) -> contract.Limits:
        return contract.Limits(self.clf.vocab_size, self.args.context_length, self.args.max_batch_size)

    def tokenize(self):
        tok = self.clf.tokenizer
        return None if tok is None else (lambda texts: tok(list(texts), add_special_tokens=True)["input_ids"])

    # ------------------------------------------------------------ inference thread
    def submit(self, rows: list[list[int]]) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.jobs.put(Job(rows, loop, fut))
        return fut

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            step = [job]
            while True:  # drain what is queued now into the same scheduling step
                try:
                    nxt = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.jobs.put(None)
                    break
                step.append(nxt)
            self._run_step(step)

    def _run_step(self, step: list[Job]) -> None:
        from _classifier import score_exact, score_padded

        rows = [r for job in step for r in job.rows]
        try:
            if self.batching == "exact":
                logits = score_exact(self.clf, rows)
                self.counters.forward_passes += len(rows)
            else:  # similar lengths together keep padding small; results go back in input order
                order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
                cap = self.args.max_running_requests
                import numpy as np

                logits = np.empty((len(rows), 3), dtype=np.float32)
                for s in range(0, len(order), cap):
                    idx = order[s:s + cap]
                    logits[idx] = score_padded(self.clf, [rows[i] for i in idx])
                    self.counters.forward_passes += 1
        except Exception as exc:  # noqa: BLE001 - every job of the failed step gets the error
            log.exception("forward failed")
            for job in step:
                job.loop.call_soon_threadsafe(_set_exception, job.future, exc)
            return
        self.counters.steps += 1
        start = 0
        for job in step:
            part = logits[start:start + len(job.rows)]
            start += len(job.rows)
            job.loop.call_soon_threadsafe(_set_result, job.future, part)

    def stop(self) -> None:
        self.jobs.put(None)

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


# ---------------------------------------------------------------- HTTP
def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="openjev embedded backend", docs_url=None, redoc_url=None)

    def error(exc: contract.ContractError) -> JSONResponse:
        if exc.status >= 500:
            engine.counters.errors_5xx += 1
        else:
            engine.counters.errors_4xx += 1
        headers = {"Retry-After": "5"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def require_ready() -> None:
        if engine.state == "loading":
            raise contract.ContractError(503, "model is loading; retry shortly", contract.UNAVAILABLE)
        if engine.state == "failed":
            raise contract.ContractError(503, engine.error or "model failed to load", contract.UNAVAILABLE)

    async def score(rows: list[list[int]]):
        engine.counters.requests += 1
        engine.counters.rows += len(rows)
        try:
            return await engine.submit(rows)
        except Exception as exc:  # noqa: BLE001
            raise contract.ContractError(500, f"inference failed: {exc}", contract.INTERNAL) from None

    @app.post("/classify")
    async def classify(request: Request):
        try:
            require_ready()
            body = contract.parse_json(await request.body())
            rows = contract.parse_classify(body, engine.limits(), engine.tokenize())
            logits = await score(rows)
        except contract.ContractError as exc:
            return error(exc)
        return JSONResponse(contract.classify_response(logits.tolist(), engine.model_name))

    @app.post("/v1/classify")
    async def v1_classify(request: Request):
        try:
            require_ready()
            body = contract.parse_json(await request.body())
            rows, use_activation = contract.parse_v1_classify(body, engine.limits(), engine.tokenize())
            logits = await score(rows)
        except contract.ContractError as exc:
            return error(exc)
        return JSONResponse(contract.v1_classify_response(logits.tolist(), rows, engine.model_name, use_activation))

    @app.get("/health")
    async def health():
        try:
            require_ready()
        except contract.ContractError as exc:
            return error(exc)
        return JSONResponse({"status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        engine.counters.flush_cache_calls += 1
        return JSONResponse({"flushed": False, "message": "the transformers backend has no prefix cache; nothing to flush",
                             "flush_cache_calls": engine.counters.flush_cache_calls})

    @app.get("/server_info")
    async def server_info():
        return JSONResponse(engine.server_info())

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                                         "owned_by": "openjev", "root": str(engine.args.checkpoint)}]})

    return app


def main() -> int:
    args = build_parser().parse_args()
    if args.max_running_requests < 1 or args.max_batch_size < 1 or args.context_length < 2:
        raise UserError("--max-running-requests and --max-batch-size must be >= 1, --context-length >= 2")
    if not (args.checkpoint / "config.json").is_file():
        raise UserError(f"{args.checkpoint} is not a model directory (no config.json)")
    sock = bind_listen_socket(args.host, args.port)  # refuse a busy port before anything slow happens

    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    engine = Engine(args)
    config = uvicorn.Config(create_app(engine), log_level=args.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=30, lifespan="off")
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
