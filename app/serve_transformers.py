#!/usr/bin/env python3
"""The embedded backend: the unmodified Transformers model behind the `/classify` contract.

For machines without SGLang (CPU CI, a laptop, a GPU that SGLang does not build for) and as the
reference the SGLang path is compared against. Same wire contract as the SGLang adapter
(SPEC section 2, implemented once in `sglang_openjev/contract.py`):

  POST /classify       {"input_ids": [[...], ...]} | {"input_ids": [...]} | {"text": ...} -> raw C/E/N logits
  POST /v1/classify    vLLM / SGLang classify shape (softmax probs; raw with "use_activation": false)
  GET  /health         200 when ready, 503 while the model loads (HEAD too)
  POST /tokenize       vLLM's shape: text -> token ids (the model's tokenizer)
  POST /detokenize     vLLM's shape: token ids -> text
  GET  /metrics        Prometheus text: requests, rows, tokens, steps, queue, errors
  POST /flush_cache    drops the cached prefix states (--prefix-reuse); without them answers 200 and says so
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
import logging
import os
import sys
import threading
from pathlib import Path

from openjev.common import UserError, bind_listen_socket, run_main
from openjev.engine.prefix import DEFAULT_MIN_TOKENS
from openjev.engine.scheduler import Engine

DRAIN_ANSWER_SECONDS = 2  # after the drain window: time to write the 503s before uvicorn cancels handlers
from openjev.http_front import coalescing_h11_protocol, create_app, release_large_allocations_to_the_os
from sglang_openjev import contract

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
                   help="accepted for launcher parity; the embedded scheduler serves the requests served the fewest "
                        "tokens first whatever it says")
    p.add_argument("--max-batch-size", type=int, default=512, help="most inputs in one request; more gets 413 (default: 512)")
    p.add_argument("--batching", default="auto", choices=["auto", "exact", "padded"],
                   help="exact: one unpadded forward per row (bitwise the reference scorer); padded: rows of a step "
                        "padded into one forward; auto: exact on CPU, padded on a GPU (default: auto)")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="accepted for launcher parity; the embedded backend caches prefixes only with --prefix-reuse")
    p.add_argument("--prefix-reuse", action="store_true",
                   help="rows of a step that share a prefix run it once, and the states after prefixes are kept "
                        "across requests (--prefix-cache-mb); logits are close to the exact forward's, not bitwise "
                        "(default: off, every row runs whole)")
    p.add_argument("--prefix-cache-mb", type=int, default=_env_int("OPENJEV_PREFIX_CACHE_MB", 4096),
                   help="with --prefix-reuse: device memory for cached prefix states, least recently used dropped "
                        "first; 0 shares prefixes within a step only (default: 4096, env OPENJEV_PREFIX_CACHE_MB)")
    p.add_argument("--prefix-min-tokens", type=int, default=DEFAULT_MIN_TOKENS,
                   help="with --prefix-reuse: the shortest shared prefix run once for several rows (default: "
                        f"{DEFAULT_MIN_TOKENS})")
    p.add_argument("--served-model-name", default=None, help="model name in responses (default: the checkpoint directory name)")
    p.add_argument("--step-token-budget", type=int, default=_env_int("OPENJEV_STEP_TOKEN_BUDGET", 16384),
                   help="tokens per scheduling step (with --prefix-reuse a row counts the tokens after its cached "
                        "prefix, or after a longer prefix it shares with a row planned before it in the step): a larger request is split over steps, the requests served the fewest tokens go "
                        "first (a small request behind large ones runs in the next step), and a step's rows are grouped by length into forwards of at most --max-running-requests rows "
                        "(default: 16384, env OPENJEV_STEP_TOKEN_BUDGET)")
    p.add_argument("--batch-wait-ms", type=float, default=float(_env_int("OPENJEV_BATCH_WAIT_MS", 0)),
                   help="when a request finds the server idle, wait up to this long, counted from its arrival, for others "
                        "sent with it, so they share the first step (stops early once the step budget is full, counted as "
                        "the step counts it: with --prefix-reuse the tokens after each row's cached prefix or a prefix it "
                        "shares with a row queued before it); each such request waits "
                        "that much longer (default: 0, off; env OPENJEV_BATCH_WAIT_MS)")
    p.add_argument("--max-body-bytes", type=int, default=_env_int("OPENJEV_MAX_BODY_BYTES", contract.DEFAULT_MAX_BODY_BYTES),
                   help="a larger request body gets 413 before it is parsed (default: 32 MiB, env OPENJEV_MAX_BODY_BYTES)")
    p.add_argument("--max-text-chars", type=int, default=_env_int("OPENJEV_MAX_TEXT_CHARS", contract.DEFAULT_MAX_TEXT_CHARS),
                   help="most characters of text in one request, checked before tokenizing; more gets 413 "
                        "(default: 1048576, env OPENJEV_MAX_TEXT_CHARS)")
    p.add_argument("--watchdog-seconds", type=float, default=float(_env_int("OPENJEV_WATCHDOG_SECONDS", 120)),
                   help="/health answers 503 when queued work has made no progress for this long, so a gateway "
                        "routes away; 0 turns it off (default: 120, env OPENJEV_WATCHDOG_SECONDS)")
    p.add_argument("--max-queued-requests", type=int, default=_env_int("OPENJEV_MAX_QUEUED_REQUESTS", 512),
                   help="requests waiting or running at most; one more gets 429 with Retry-After at once instead of "
                        "a growing queue; 0 = no limit (default: 512, env OPENJEV_MAX_QUEUED_REQUESTS)")
    p.add_argument("--drain-seconds", type=float, default=float(_env_int("OPENJEV_DRAIN_SECONDS", 30)),
                   help="on SIGTERM, admitted requests get this long to finish; one that cannot gets 503 with "
                        "Retry-After before the server exits, never a dropped connection; /health answers 503 "
                        "meanwhile (default: 30, env OPENJEV_DRAIN_SECONDS)")
    p.add_argument("--torch-threads", type=int, default=_env_int("OPENJEV_TORCH_THREADS", 0),
                   help="torch intra-op threads; 0 = auto: cores - 1 on a CPU (1 on a 2-core machine), leaving a "
                        "core to the HTTP loop and tokenizer (default: 0, env OPENJEV_TORCH_THREADS)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every request (uvicorn access log)")
    return p


# ---------------------------------------------------------------- metrics


# ---------------------------------------------------------------- HTTP


def main() -> int:
    args = build_parser().parse_args()
    if args.max_running_requests < 1 or args.max_batch_size < 1 or args.context_length < 2:
        raise UserError("--max-running-requests and --max-batch-size must be >= 1, --context-length >= 2")
    if not 0 < args.port < 65536:
        raise UserError(f"port {args.port} is out of range: give a TCP port from 1 to 65535")
    if args.step_token_budget < 1 or args.max_body_bytes < 1 or args.max_text_chars < 1:
        raise UserError("--step-token-budget, --max-body-bytes and --max-text-chars must be >= 1")
    if min(args.watchdog_seconds, args.torch_threads, args.drain_seconds, args.max_queued_requests,
           args.batch_wait_ms) < 0:
        raise UserError("--watchdog-seconds, --drain-seconds, --max-queued-requests, --torch-threads and "
                        "--batch-wait-ms must not be negative")
    if args.prefix_cache_mb < 0 or args.prefix_min_tokens < 1:
        raise UserError("--prefix-cache-mb must not be negative and --prefix-min-tokens must be >= 1")
    if not (args.checkpoint / "config.json").is_file():
        raise UserError(f"{args.checkpoint} is not a model directory (no config.json)")
    from openjev.engine.fused import fused_mode
    from openjev.engine.kernels import kernel_mode, prefix_attention_mode

    kernel_mode(), fused_mode(), prefix_attention_mode()  # a typo in one of these variables fails here, before the port
    sock = bind_listen_socket(args.host, args.port)  # refuse a busy port before anything slow happens
    allocator = release_large_allocations_to_the_os()

    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    engine = Engine(args)
    engine.allocator = allocator
    config = uvicorn.Config(create_app(engine), log_level=args.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=args.drain_seconds + DRAIN_ANSWER_SECONDS, lifespan="off",
                            http=coalescing_h11_protocol())

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.begin_drain(args.drain_seconds)
            super().handle_exit(sig, frame)

    server = DrainingServer(config)

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
