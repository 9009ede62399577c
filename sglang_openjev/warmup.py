"""A warm-up SGLang runs before its HTTP server listens (`--warmups openjev_classifier`, added by the launcher).

SGLang compiles its Triton kernels (Gated DeltaNet chunks, the causal conv, the attention extend) at
their first use; without a warm-up the first /classify paid that (10-30 s on an H200) after /health
already said ready. The warm-up sends the same rows twice through the tokenizer manager, as /classify
does: a long and a short row and two rows that share a long prefix (the prefix-cache continuation,
with initial states and conv history, runs on the second send when the cache is on), then flushes the
cache so no warm-up row is ever served from it. A failure stops the start with its error.

Before the rows, the scheduler's own state (SGLang's internal state, what it actually runs with) is
held against what the command line asked (`ASKED`, set by the launcher: `launch_server.asked_by`): the
attention and linear-attention backends, the mamba strategy, the radix cache and the dtype must be
what was asked (no silent fallback), and with extra_buffer the GDN state pool must hold at least
SLOTS_PER_REQUEST slots per running request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Mapping

NAME = "openjev_classifier"
PREFIX_TOKENS = 600
SUFFIX_TOKENS = 40
SHORT_TOKENS = 20
FIRST_ID = 3  # ids below are special tokens in Qwen3.5's tokenizer and in the tiny test models'
FLUSH_WAIT_S = 30.0
SLOTS_PER_REQUEST = 5  # extra_buffer: the working state, its snapshots and a cached prefix per request
ASKED: dict[str, Any] = {}

logger = logging.getLogger(__name__)


def warmup_rows(vocab_size: int, context_len: int) -> list[list[int]]:
    """Token-id rows of the warm-up: two rows sharing a PREFIX_TOKENS prefix, and a short one; each
    shorter than the context and within the vocabulary."""
    span = max(1, vocab_size - FIRST_ID)
    limit = max(2, context_len - 1)

    def ids(n: int, seed: int) -> list[int]:
        return [FIRST_ID + (seed * 7919 + i * 31) % span for i in range(n)]

    prefix = ids(min(PREFIX_TOKENS, limit - SUFFIX_TOKENS), 1) if limit > SUFFIX_TOKENS else []
    rows = [prefix + ids(SUFFIX_TOKENS, 2), prefix + ids(SUFFIX_TOKENS, 3), ids(SHORT_TOKENS, 4)]
    return [row[:limit] for row in rows]


async def classifier_warmup(disaggregation_mode: str, tokenizer_manager: Any) -> None:
    """SGLang's custom-warmup signature (`sglang.srt.entrypoints.warmup`)."""
    from sglang_openjev.routes import SGLangRuntime

    await run_warmup(SGLangRuntime.from_sglang(), tokenizer_manager)


def served_state_problems(asked: Mapping[str, Any], served: Mapping[str, Any]) -> list[str]:
    """What the scheduler runs with that differs from what was asked, or falls short of it."""
    problems = [f"{key}: asked {value!r}, the scheduler runs {served[key]!r}" for key, value in asked.items()
                if key in served and str(served[key]).lower() != str(value).lower()]
    strategy = served.get("mamba_radix_cache_strategy") or served.get("mamba_scheduler_strategy")
    slots, running = served.get("max_mamba_cache_size"), served.get("max_running_requests")
    if (strategy == "extra_buffer" and not served.get("disable_radix_cache") and isinstance(slots, int)
            and isinstance(running, int) and slots < SLOTS_PER_REQUEST * running):
        problems.append(f"{slots} GDN state slots for {running} running requests: extra_buffer needs "
                        f"{SLOTS_PER_REQUEST} per request ({SLOTS_PER_REQUEST * running}); lower "
                        "--max-running-requests or raise --mamba-full-memory-ratio / --max-mamba-cache-size")
    return problems


async def check_served_state(tokenizer_manager: Any) -> None:
    getter = getattr(tokenizer_manager, "get_internal_state", None)
    server_args = getattr(tokenizer_manager, "server_args", None)
    if getter is None or server_args is None:
        logger.warning("openjev warm-up: this SGLang reports no internal state; served backends not checked")
        return
    states = await getter()
    served = states[0] if isinstance(states, list) and states else {}
    served = served if isinstance(served, dict) else {}
    if "max_running_requests" not in served:
        served = {**served, "max_running_requests": getattr(server_args, "max_running_requests", None)}
    problems = served_state_problems(ASKED, served)
    if problems:
        raise RuntimeError("the server does not run what was asked: " + "; ".join(problems))


async def run_warmup(runtime: Any, tokenizer_manager: Any) -> list[list[int]]:
    """The served-state check and the warm-up through RUNTIME (routes.SGLangRuntime); returns the rows sent."""
    await check_served_state(tokenizer_manager)
    vocab = int(getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", 0) or 512)
    rows = warmup_rows(vocab, int(getattr(tokenizer_manager, "context_len", 0) or 8192))
    started = time.monotonic()
    for _ in range(2):  # cold, then again: prefix-cache hits where the cache is on
        await runtime.logits(tokenizer_manager, rows, None)
    # SGLang flushes only when idle; the scheduler frees the last rows' slots just after answering
    deadline = time.monotonic() + FLUSH_WAIT_S
    while not getattr(result := await tokenizer_manager.flush_cache(), "success", True):
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm-up: the cache could not be flushed afterwards within {FLUSH_WAIT_S:g} s: "
                               f"{getattr(result, 'message', '') or 'the scheduler stayed busy'}")
        await asyncio.sleep(0.1)
    logger.info("openjev warm-up: %d rows (%d tokens) sent twice and the cache flushed in %.1f s", len(rows),
                sum(map(len, rows)), time.monotonic() - started)
    return rows


def register() -> bool:
    """Add the warm-up to SGLang's registry (this process: the one whose server runs warm-ups).
    False where this SGLang has no custom warm-ups."""
    try:
        from sglang.srt.entrypoints import warmup as sglang_warmup
    except ImportError:
        return False
    registry = getattr(sglang_warmup, "_warmup_registry", None)
    if registry is None:
        return False
    registry.setdefault(NAME, classifier_warmup)
    return True
