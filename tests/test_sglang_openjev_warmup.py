"""The SGLang adapter's warm-up (`sglang_openjev/warmup.py`): the rows it sends, its flag in the
launcher's argv, the run through the runtime /classify uses (against the stand-in tokenizer manager),
and the check that the scheduler runs the server arguments that were asked for.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from _sglang_support import FakeTokenizerManager, server_args_stub

from sglang_openjev import launch_server, routes, warmup


@pytest.mark.parametrize("vocab, context", [(248320, 8192), (512, 32768), (96, 64), (512, 30)])
def test_warmup_rows_share_a_prefix_and_fit_the_model(vocab, context):
    rows = warmup.warmup_rows(vocab, context)
    assert len(rows) == 3 and all(0 < len(r) < context for r in rows)
    assert all(warmup.FIRST_ID <= t < vocab for r in rows for t in r)
    shared = next(i for i, (a, b) in enumerate(zip(rows[0], rows[1])) if a != b)
    assert shared == min(warmup.PREFIX_TOKENS, context - 1 - warmup.SUFFIX_TOKENS) or context <= 64
    assert warmup.warmup_rows(vocab, context) == rows  # deterministic


def test_warmup_flag_joins_the_operators_list_once():
    name = warmup.NAME
    assert launch_server.with_warmup_flag(["--port", "1"], name) == ["--port", "1", "--warmups", name]
    assert launch_server.with_warmup_flag(["--warmups", "a,b"], name) == ["--warmups", f"a,b,{name}"]
    assert launch_server.with_warmup_flag(["--warmups=a"], name) == [f"--warmups=a,{name}"]
    once = launch_server.with_warmup_flag(["--warmups", name], name)
    assert once == ["--warmups", name] and launch_server.with_warmup_flag(once, name) == once


def test_warmup_sends_the_rows_twice_then_flushes(monkeypatch):
    """Through the runtime /classify uses, against the stand-in tokenizer manager; a flush refused while
    the scheduler is busy is retried for FLUSH_WAIT_S."""
    monkeypatch.setattr(warmup, "FLUSH_WAIT_S", 0.3)
    fake = FakeTokenizerManager(server_args_stub(), context_len=2048, vocab_size=96)
    runtime = routes.SGLangRuntime(lambda: None, lambda input_ids: SimpleNamespace(input_ids=input_ids))
    rows = asyncio.run(warmup.run_warmup(runtime, fake))
    assert [r.input_ids for r in fake.requests] == [rows, rows] and fake.flushes == [None]
    fake.flush_ok = False
    with pytest.raises(RuntimeError, match="could not be flushed afterwards within 0.3 s"):
        asyncio.run(warmup.run_warmup(runtime, fake))
    assert len(fake.flushes) > 2  # retried


def test_warmup_refuses_a_scheduler_that_runs_something_else(monkeypatch):
    fake = FakeTokenizerManager(server_args_stub(), context_len=2048, vocab_size=96)

    async def internal_state():
        return [{"attention_backend": "torch_native", "max_running_requests": 16}]

    fake.get_internal_state = internal_state
    monkeypatch.setitem(warmup.ASKED, "attention_backend", "triton")
    runtime = routes.SGLangRuntime(lambda: None, lambda input_ids: SimpleNamespace(input_ids=input_ids))
    with pytest.raises(RuntimeError, match="does not run what was asked: attention_backend: asked 'triton', "
                                           "the scheduler runs 'torch_native'"):
        asyncio.run(warmup.run_warmup(runtime, fake))
    assert fake.requests == []  # refused before any row


def test_asked_server_arguments_are_read_from_the_flags_given():
    argv = ["--attention-backend", "triton", "--dtype=float16", "--disable-radix-cache", "--port", "1",
            "--mamba-radix-cache-strategy", "extra_buffer", "--mamba-radix-cache-strategy", "no_buffer"]
    assert launch_server.asked_by(argv) == {"attention_backend": "triton", "dtype": "float16", "disable_radix_cache": True,
                                     "mamba_radix_cache_strategy": "no_buffer"}


def test_served_state_problems_name_a_fallback_and_too_few_state_slots():
    asked = {"attention_backend": "triton", "linear_attn_prefill_backend": "flashinfer", "dtype": "float16"}
    served = {"attention_backend": "triton", "linear_attn_prefill_backend": "triton", "dtype": "float16",
              "mamba_radix_cache_strategy": "extra_buffer", "disable_radix_cache": False,
              "max_mamba_cache_size": 79, "max_running_requests": 16}
    problems = warmup.served_state_problems(asked, served)
    assert problems[0] == "linear_attn_prefill_backend: asked 'flashinfer', the scheduler runs 'triton'"
    assert problems[1].startswith("79 GDN state slots for 16 running requests: extra_buffer needs 5 per request (80)")
    assert warmup.served_state_problems({**asked, "linear_attn_prefill_backend": "triton"},
                                        {**served, "max_mamba_cache_size": 80}) == []
    assert warmup.served_state_problems({}, {**served, "disable_radix_cache": True}) == []  # no cache: no rule
    assert warmup.served_state_problems({"disable_radix_cache": True}, {"disable_radix_cache": True}) == []
