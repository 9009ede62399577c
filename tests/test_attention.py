"""Padded forwards' attention (openjev/engine/attention.py): with OPENJEV_PADDED_ATTENTION=shared, rows
that share one call get the output of their own calls; on a GPU bit for bit."""

from __future__ import annotations

import pytest

# (row lengths, prefix lengths, offset of the cached keys, per-row states) and the rows that keep their
# own call: a call of a whole number of 64-token tiles
CASES = [
    ([70, 5, 130, 64], None, 0, False, [3]),
    ([3, 70, 64], [64, 0, 128], 128, True, []),   # 64 + 128 = 192 tokens: one unseen zero token more
    ([1, 30, 64], [128, 64, 0], 128, False, [2]),
]


def _attend(torch, layout_args, query, key, value, module, dim):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from openjev.engine.attention import current_layout, padded_layout

    lengths, starts, offset, states = layout_args
    with padded_layout(lengths, starts, offset, per_row_states=states):
        out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, None, scaling=dim ** -0.5)
        plans = list(current_layout().plans.values())
    return out, plans[0] if plans else None


def _rows(torch, lengths, offset, heads, kv_heads, dim, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    width = max(lengths)
    query = torch.randn((len(lengths), heads, width, dim), dtype=dtype, device=device, generator=gen)
    key, value = (torch.randn((len(lengths), kv_heads, offset + width, dim), dtype=dtype, device=device, generator=gen)
                  for _ in range(2))
    return query, key, value


@pytest.mark.parametrize("lengths,starts,offset,states,alone", CASES)
def test_rows_sharing_a_call_get_their_own_calls_output(monkeypatch, lengths, starts, offset, states, alone):
    """The shared call's plumbing on a CPU (float64, where a shared call is allowed for the test):
    each row's queries, keys and values placed from the padded layout, its outputs put back, padding
    positions zero; rows of a whole number of tiles keep their own call."""
    torch = pytest.importorskip("torch")
    from openjev.engine import attention

    monkeypatch.delenv("OPENJEV_PADDED_ATTENTION", raising=False)
    assert attention.rowwise_attention() == "rowwise"
    monkeypatch.setenv("OPENJEV_PADDED_ATTENTION", "shared")
    heads, kv_heads, dim = 4, 2, 8
    module = attention._CheckModule(heads // kv_heads)
    query, key, value = _rows(torch, lengths, offset, heads, kv_heads, dim, torch.float64, "cpu")
    args = (lengths, starts, offset, states)
    monkeypatch.setattr(attention, "shared_call_sms", lambda *_: 1)
    shared, plan = _attend(torch, args, query, key, value, module, dim)
    assert plan is not None and plan.batch is not None and plan.alone == alone
    monkeypatch.setenv("OPENJEV_PADDED_ATTENTION", "rowwise")  # the default: one call a row
    each, plan = _attend(torch, args, query, key, value, module, dim)
    assert plan.batch is None and plan.alone == list(range(len(lengths)))
    torch.testing.assert_close(shared, each, rtol=0, atol=1e-12)
    for j, n in enumerate(lengths):
        assert not shared[j, n:].any()


def test_no_shared_calls_on_a_cpu():
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig

    from openjev.engine.attention import check_batching

    cfg = AutoConfig.for_model("qwen3_5_text", num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64)
    assert check_batching(cfg, "cpu", torch.float32) is None


@pytest.mark.gpu
def test_rows_sharing_a_call_on_a_gpu_are_bitwise_their_own_calls():
    """At Qwen3.5-4B's attention shape (16 query / 4 key-value heads of 256, FP16), rows long enough
    that FlashAttention keeps their own calls whole share one call and keep their bits; shorter rows
    and rows of whole tiles keep their own calls."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: FlashAttention is a GPU kernel")
    from openjev.engine import attention

    assert attention.rowwise_attention() in ("rowwise", "shared")
    heads, kv_heads, dim = 16, 4, 256
    module = attention._CheckModule(heads // kv_heads)
    cases = [([900, 1217, 300, 1024, 1500], None, 0, False),
             ([37, 300, 1, 64], [1280, 640, 896, 1408], 1408, True),
             ([37, 300, 1, 700], [1280, 640, 896, 0], 1280, False)]
    for lengths, starts, offset, states in cases:
        query, key, value = _rows(torch, lengths, offset, heads, kv_heads, dim, torch.float16, "cuda")
        args = (lengths, starts, offset, states)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OPENJEV_PADDED_ATTENTION", "shared")
            shared, plan = _attend(torch, args, query, key, value, module, dim)
        assert plan is not None and plan.batch is not None, "no rows shared a call on this GPU"
        each, plan = _attend(torch, args, query, key, value, module, dim)
        assert plan.batch is None
        for j, n in enumerate(lengths):
            assert torch.equal(shared[j, :n], each[j, :n]), (args, j, float((shared[j, :n] - each[j, :n]).abs().max()))
