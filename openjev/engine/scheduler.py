"""The embedded backend's engine: requests become jobs, each step packs rows from every job under a token
budget into least-padding forwards, on one engine thread."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from openjev.common import git_revision, utc_now
from openjev.engine.batching import StepResult, forward_rows
from sglang_openjev import contract

log = logging.getLogger("openjev.transformers")
PARSE_WORKERS = 2  # threads of the HTTP front that parse request bodies (reported in /server_info)


@dataclass
class Job:
    """One accepted request: its rows, where they stand, and the future its handler awaits."""

    rows: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    results: object = None          # np.ndarray [n, 3], filled step by step
    cursor: int = 0                 # next row to schedule
    served_tokens: int = 0          # what its scheduled rows cost (plan_step; the fair-share clock)
    done_rows: int = 0
    cancelled: bool = False
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class Counters:
    requests: int = 0
    rows: int = 0
    tokens: int = 0
    forward_passes: int = 0
    padded_tokens: int = 0          # tokens the forwards ran, padding included
    computed_tokens: int = 0        # real tokens the forwards ran (fewer than tokens with prefix reuse)
    reused_tokens: int = 0          # tokens of rows taken from prefix states instead of run
    steps: int = 0
    flush_cache_calls: int = 0
    errors_4xx: int = 0
    errors_5xx: int = 0
    rows_cancelled: int = 0
    requests_cancelled: int = 0
    rows_dropped_after_step: int = 0


def plan_step(jobs: "list[Job]", token_budget: int, cost=len) -> list[tuple[Job, int]]:
    """Pick the rows of one scheduling step under the token budget, fairly across requests: the
    requests that have been served the fewest tokens go first (arrival order among equals), then
    they take turns, one row per request per turn (a step always takes at least one row, so a row
    longer than the budget still runs, alone). A request that arrives behind large ones has been
    served nothing, so it is served in the next step, and large requests share the steps instead
    of the oldest ones taking all of them. `cost(row)` is what a row counts against the budget and
    the clock: its length, or with prefix reuse the tokens it computes after its cached prefix.
    Returns (job, row index) pairs; advances each job."""
    picked: list[tuple[Job, int]] = []
    used = 0
    active = sorted((j for j in jobs if not j.cancelled and j.cursor < len(j.rows)), key=lambda j: j.served_tokens)
    while active:
        nxt = []
        for job in active:
            n = cost(job.rows[job.cursor])
            if picked and used + n > token_budget:
                return picked
            picked.append((job, job.cursor))
            used += n
            job.cursor += 1
            job.served_tokens += n
            if job.cursor < len(job.rows):
                nxt.append(job)
        active = nxt
    return picked


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
    state: str = "loading"  # loading | ready | failed | draining
    error: str | None = None
    clf: object | None = None
    batching: str = "exact"
    counters: Counters = field(default_factory=Counters)
    started_at: str = field(default_factory=utc_now)
    load_seconds: float | None = None
    torch_threads: int | None = None
    metrics: object | None = None
    prefix: object | None = None    # openjev/engine/prefix.py PrefixEngine with --prefix-reuse
    _pending: "list[Job]" = field(default_factory=list)
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _stopping: bool = False
    last_progress: float = field(default_factory=time.monotonic)
    step_running_since: float | None = None
    drain_deadline: float | None = None  # monotonic time by which a draining server answers everything

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
            if getattr(self.args, "prefix_reuse", False):
                from openjev.engine.prefix import PrefixEngine

                if self.clf.pad_token_id is None:
                    raise ValueError("--prefix-reuse pads continuations and needs a pad_token_id in config.json")
                self.prefix = PrefixEngine(self.clf, self.args.prefix_cache_mb << 20, self.args.prefix_min_tokens)
                self.warmup["prefix_path"] = self.prefix.warm_up(self.args.max_running_requests)
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

    def begin_drain(self, seconds: float) -> None:
        """SIGTERM: stop being ready; admitted requests have until the deadline to finish."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + seconds
            if self.state == "ready":
                self.state = "draining"
            log.info("draining: %d queued requests have %.0f s to finish", self.queue_depth()[0], seconds)

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
            limit = getattr(self.args, "max_queued_requests", 0)
            if limit and len(self._pending) >= limit:
                raise contract.ContractError(
                    429, f"server is overloaded: {len(self._pending)} requests are queued (--max-queued-requests "
                         f"{limit}); retry shortly", contract.OVERLOADED)
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

    def _retire(self, job: Job) -> None:
        """A finished request leaves the queue when its answer is handed over (not at the step's end),
        so that no one who has the answer sees it still queued."""
        if job in self._pending:
            self._pending.remove(job)

    def stalled_for(self) -> float:
        """Seconds queued work has made no progress (0 with nothing queued)."""
        with self._cv:
            if not self._pending:
                return 0.0
            return time.monotonic() - self.last_progress

    def _run(self) -> None:
        while True:
            with self._cv:
                idle = not self._pending
                while not self._pending and not self._stopping:
                    self._cv.wait()
                if idle:
                    self._gather_arrivals()
                if self._stopping:
                    return
                picked = plan_step(self._pending, self.args.step_token_budget, self._step_cost())
                self.step_running_since = time.monotonic()
                self._note_first_steps(picked, self.step_running_since)
            if picked:
                self._run_step(picked)
            with self._cv:
                self.step_running_since = None
                self.last_progress = time.monotonic()
                self._pending = [j for j in self._pending if not j.cancelled and j.done_rows < len(j.rows)]

    def _step_cost(self):
        """A cost of rows for one step plan (plan_step's `cost`): a row's length, or with prefix reuse the
        tokens the step computes for it (PrefixEngine.step_cost: after its cached prefix or a prefix it
        shares with the rows before it in the plan)."""
        return self.prefix.step_cost() if self.prefix is not None else len

    def _note_first_steps(self, picked, now: float) -> None:
        """A request's queue time ends when a step first takes its rows: the step that takes its row 0
        (openjev_queue_seconds)."""
        if self.metrics:
            for job, i in picked:
                if i == 0:
                    self.metrics.queue_seconds.observe(now - job.queued_at)

    def _gather_arrivals(self) -> None:
        """Woken from idle (lock held): wait up to --batch-wait-ms, counted from the first queued
        request's arrival, for requests sent together to arrive, so that they share the first step
        instead of the first one running alone; stop waiting as soon as the queued rows fill the step
        budget, counted as a step plan counts them (_step_cost)."""
        wait = getattr(self.args, "batch_wait_ms", 0) / 1000
        deadline = min((j.queued_at for j in self._pending), default=time.monotonic()) + wait
        cost, total = self._step_cost(), 0
        # id of a queued job -> the job, its rows counted once in arrival order; holding the job keeps its
        # id from being reused by a later one while this waits
        counted: dict[int, Job] = {}
        while not self._stopping and wait > 0:
            for j in self._pending:
                if id(j) not in counted:
                    counted[id(j)] = j
                    total += sum(cost(r) for r in j.rows[j.cursor:])
            left = deadline - time.monotonic()  # after the counting, which takes milliseconds a request
            if left <= 0 or total >= self.args.step_token_budget:
                return
            self._cv.wait(left)

    def _run_step(self, picked: list[tuple[Job, int]]) -> None:
        rows = [job.rows[i] for job, i in picked]
        queued_s = time.monotonic() - min(job.queued_at for job, _ in picked)
        t0 = time.perf_counter()
        try:
            if self.prefix is not None:
                done = self.prefix.run_step(rows, self.args.max_running_requests)
            else:
                done = forward_rows(self.clf, rows, self.batching, self.args.max_running_requests)
        except Exception as exc:  # noqa: BLE001 - every request of the failed step gets the error
            log.exception("forward failed")
            with self._cv:
                for job in {id(j): j for j, _ in picked}.values():
                    job.cancelled = True
                    job.loop.call_soon_threadsafe(_set_exception, job.future, exc)
            return
        self._finish_step(picked, rows, done, time.perf_counter() - t0, queued_s)

    def _finish_step(self, picked, rows, done: StepResult, elapsed: float, queued_s: float) -> None:
        c = self.counters
        c.steps += 1
        c.forward_passes += done.forwards
        c.padded_tokens += done.padded_tokens
        c.computed_tokens += done.computed_tokens
        c.reused_tokens += done.reused_tokens
        logits = done.logits
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d rows of %d requests, %d tokens, %d forwards, %d padded tokens, %d computed "
                      "tokens, %.1f ms (started %.1f ms after its oldest request was queued)", c.steps, len(rows),
                      len({id(j) for j, _ in picked}), sum(map(len, rows)), done.forwards, done.padded_tokens,
                      done.computed_tokens, elapsed * 1e3, queued_s * 1e3)
        if self.metrics:
            self.metrics.step_seconds.observe(elapsed)
            self.metrics.step_rows.observe(len(rows))
            self.metrics.forward_tokens.inc(done.padded_tokens)
            self.metrics.computed_tokens.inc(done.computed_tokens)
        with self._cv:
            for k, (job, i) in enumerate(picked):
                if job.cancelled:
                    self.counters.rows_dropped_after_step += 1
                    continue
                job.results[i] = logits[k]
                job.done_rows += 1
                if job.done_rows == len(job.rows):
                    self._retire(job)
                    job.loop.call_soon_threadsafe(_set_result, job.future, job.results)

    @property
    def prefix_cache(self):
        """The cross-request prefix cache (openjev/engine/prefix.py PrefixCache), or None."""
        return self.prefix.cache if self.prefix is not None else None

    def flush_cache(self) -> dict:
        """POST /flush_cache: drop the cached prefix states (with --prefix-reuse); counted either way."""
        self.counters.flush_cache_calls += 1
        cache = self.prefix_cache
        if cache is None:
            why = ("prefix reuse runs without a cache (--prefix-cache-mb 0)" if self.prefix is not None
                   else "no prefix cache without --prefix-reuse")
            return {"flushed": False, "message": f"{why}; nothing to flush",
                    "flush_cache_calls": self.counters.flush_cache_calls}
        dropped = cache.clear()
        log.info("prefix cache flushed: %d states dropped", dropped)
        return {"flushed": True, "message": f"{dropped} cached prefix states dropped", "states_dropped": dropped,
                "flush_cache_calls": self.counters.flush_cache_calls}

    def prefix_cache_stat(self, key: str) -> float:
        cache = self.prefix_cache
        return float(cache.stats()[key]) if cache is not None else 0.0

    def serving_path(self) -> str:
        """Which forwards answer: prefix-reuse with its forwards packed or padded (openjev/engine/packed.py),
        or exact / padded (docs/embedded_backend.md says which are bitwise where)."""
        if self.prefix is None:
            return self.batching
        return f"prefix-reuse ({'packed' if self.prefix.forwards.packed['used'] else 'padded'})"

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
            radix_cache=self.prefix_cache is not None, mamba_scheduler_strategy=None, mamba_full_memory_ratio=None,
            attention_backend=f"transformers-{clf.model.config._attn_implementation}" if clf else None,
            batching=self.batching if clf else None,
            scheduler={"kind": "token-budget fair share (fewest tokens served first), rows grouped by length "
                               "inside a step",
                       "step_token_budget": self.args.step_token_budget,
                       "batch_wait_ms": getattr(self.args, "batch_wait_ms", 0),
                       "rows_per_forward": self.args.max_running_requests,
                       "watchdog_seconds": self.args.watchdog_seconds},
            step_token_budget=self.args.step_token_budget,
            limits={"max_body_bytes": self.args.max_body_bytes, "max_text_chars": self.args.max_text_chars,
                    "max_batch_size": self.args.max_batch_size, "max_input_tokens": self.args.context_length - 1,
                    "max_queued_requests": getattr(self.args, "max_queued_requests", 0)},
            threads={"torch_intra_op": self.torch_threads, "cores": available_cores(),
                     "requested": self.args.torch_threads or "auto",
                     "parse_workers": PARSE_WORKERS},
            allocator=getattr(self, "allocator", None),
            kernel_path=clf.kernels if clf else None, warmup=getattr(self, "warmup", None),
            bundle_git=git_revision(), pid=os.getpid(), state=self.state, started_at=self.started_at,
            load_seconds=self.load_seconds, flush_cache_calls=self.counters.flush_cache_calls,
            counters=vars(self.counters).copy(), serving_path=self.serving_path() if clf else None,
            prefix_reuse=self.prefix.stats() if self.prefix is not None else None,
            note="embedded Transformers backend: no SGLang scheduler; prefix states cached only with --prefix-reuse",
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
