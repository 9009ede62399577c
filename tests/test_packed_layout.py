"""The prefix path's forwards in the packed layout (openjev/engine/packed.py, OPENJEV_PACKED_LAYOUT=on):
the rows' tokens one after another, each token mixer row by row. On a CPU in float32 the logits and
kept states agree with the padded forwards and the exact ones within the CPU tolerance (matrix
products of other row counts round differently here; on a GPU without a cuBLAS workspace they do
not); the rule's variable-length branch, over Transformers' rule a segment at a time, is bitwise the
call-a-segment branch; the segments conv kernel is bitwise each row's own conv (FP16, Triton's
interpreter); the load checks refuse what is not bitwise."""

from __future__ import annotations

import random

import numpy as np
import pytest

from openjev.common import UserError
from openjev.engine import packed
from openjev.engine.prefix import PrefixEngine, packed_groups

TOL = 1e-5  # float32 on a CPU, as tests/test_prefix_reuse.py


@pytest.fixture(scope="module")
def clf(tiny_model):
    from openjev.engine.classifier import load_classifier

    return load_classifier(tiny_model["checkpoint"], "cpu", "float32")


def _rows(vocab: int, seed: int = 0) -> list[list[int]]:
    """tests/test_prefix_reuse.py's option groups and singles, and rows whose tails cross a chunk
    boundary or that end on one."""
    from test_prefix_reuse import _rows as option_groups

    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    rows = option_groups(vocab, seed)
    return rows + [rows[0][:150] + toks(90), rows[0][:150] + toks(75), toks(64), toks(128)]


def _engine(clf, budget_mb: int, mode: str, monkeypatch) -> PrefixEngine:
    monkeypatch.setenv("OPENJEV_PACKED_LAYOUT", mode)
    return PrefixEngine(clf, budget_mb << 20, min_tokens=16)


def _unwrapped(modeling):
    """The modeling module's rule without the padded path's wrapper (a new engine wraps it again)."""
    rule = modeling.torch_chunk_gated_delta_rule
    return rule.__wrapped__ if getattr(rule, "_openjev_per_row", False) else rule


def _states(engine) -> dict:
    return {k: v for k, v in engine.cache.entries.items()} if engine.cache is not None else {}


@pytest.mark.parametrize("budget_mb", [0, 64])
def test_packed_forwards_agree_with_padded_ones_and_keep_the_same_states(clf, budget_mb, monkeypatch):
    import torch

    from openjev.engine.classifier import score_exact

    rows = _rows(clf.vocab_size)
    ref = score_exact(clf, rows)
    runs = {}
    for mode in ("off", "on"):
        engine = _engine(clf, budget_mb, mode, monkeypatch)
        assert engine.stats()["packed_layout"]["used"] == (mode == "on")
        runs[mode] = engine, engine.run_step(rows, max_rows=8), engine.run_step(rows, max_rows=8)
    for mode, (engine, cold, warm) in runs.items():
        assert np.abs(cold.logits - ref).max() <= TOL and np.abs(warm.logits - ref).max() <= TOL, mode
    (_, cold_a, warm_a), (packed_engine, cold_b, warm_b) = runs["off"], runs["on"]
    assert cold_b.computed_tokens == cold_a.computed_tokens and warm_b.computed_tokens == warm_a.computed_tokens
    assert cold_b.padded_tokens == cold_b.computed_tokens < cold_a.padded_tokens  # no padding
    assert cold_b.forwards <= cold_a.forwards
    padded_states, packed_states = _states(runs["off"][0]), _states(packed_engine)
    assert set(padded_states) == set(packed_states) and (len(packed_states) > 0) == (budget_mb > 0)
    for key, a in padded_states.items():
        b = packed_states[key]
        assert a.length == b.length
        for name in ("conv", "recurrent", "keys", "values"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.shape == y.shape and x.dtype == y.dtype and torch.allclose(x, y, rtol=0, atol=1e-5), name


def test_the_rules_segment_call_is_bitwise_a_call_a_segment(clf, monkeypatch):
    """fla's branch of run_rule (one variable-length call, a second for the rest after a kept state)
    over a stand-in that runs Transformers' rule a segment at a time: the same logits and states,
    bit for bit, as the call-a-segment branch; and the load check passes it."""
    import torch

    from openjev.engine.fused import gdn_modeling
    from openjev_testsupport.segments_rule import segments_rule

    rows = _rows(clf.vocab_size, seed=2)
    modeling = gdn_modeling(clf.model)
    want_engine = _engine(clf, 64, "on", monkeypatch)
    want = [want_engine.run_step(rows, max_rows=8).logits, want_engine.run_step(rows, max_rows=8).logits]
    seen: list = []
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", segments_rule(_unwrapped(modeling), seen))
    monkeypatch.setattr(packed, "rule_takes_segments", lambda _rule: True)
    engine = _engine(clf, 64, "on", monkeypatch)
    assert engine.stats()["packed_layout"]["rule"] == {"kind": "fla varlen", "bitwise": True}
    seen.clear()
    got = [engine.run_step(rows, max_rows=8).logits, engine.run_step(rows, max_rows=8).logits]
    assert seen and max(seen) > 1  # segments in one call
    for a, b in zip(want, got):
        assert np.array_equal(a, b)
    for key, a in _states(want_engine).items():
        b = _states(engine)[key]
        assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("conv", "recurrent", "keys", "values"))


def test_the_load_check_refuses_a_segment_rule_a_bit_off(clf, monkeypatch):
    import torch

    from openjev.engine.fused import gdn_modeling
    from openjev_testsupport.segments_rule import segments_rule

    modeling = gdn_modeling(clf.model)
    inner = segments_rule(_unwrapped(modeling))

    def off(*args, cu_seqlens=None, **kwargs):
        out, state = inner(*args, cu_seqlens=cu_seqlens, **kwargs)
        if cu_seqlens is not None:
            out = torch.nextafter(out, torch.full_like(out, float("inf")))
        return out, state

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", off)
    monkeypatch.setattr(packed, "rule_takes_segments", lambda _rule: True)
    engine = _engine(clf, 64, "on", monkeypatch)
    record = engine.stats()["packed_layout"]
    assert not record["used"] and "not bitwise a call a segment" in record["reason"]
    rows = _rows(clf.vocab_size)
    step = engine.run_step(rows, max_rows=8)
    assert step.padded_tokens > step.computed_tokens  # padded forwards


def test_by_default_only_a_rule_that_takes_segments_packs_and_a_typo_is_one_line(clf, monkeypatch):
    """auto (the default): Transformers' PyTorch rule (this CPU) keeps padded forwards, a rule that takes
    segments packs; off never packs."""
    from openjev.engine.fused import gdn_modeling
    from openjev_testsupport.segments_rule import segments_rule

    monkeypatch.delenv("OPENJEV_PACKED_LAYOUT", raising=False)
    record = PrefixEngine(clf, 0).stats()["packed_layout"]
    assert record["requested"] == "auto" and not record["used"] and "takes no segments here" in record["reason"]
    monkeypatch.setattr(gdn_modeling(clf.model), "torch_chunk_gated_delta_rule", segments_rule(_unwrapped(gdn_modeling(clf.model))))
    monkeypatch.setattr(packed, "rule_takes_segments", lambda _rule: True)
    assert PrefixEngine(clf, 0).stats()["packed_layout"]["used"]
    monkeypatch.setenv("OPENJEV_PACKED_LAYOUT", "off")
    record = PrefixEngine(clf, 0).stats()["packed_layout"]
    assert not record["used"] and "OPENJEV_PACKED_LAYOUT=off" in record["reason"]
    monkeypatch.setenv("OPENJEV_PACKED_LAYOUT", "yes")
    with pytest.raises(UserError, match="OPENJEV_PACKED_LAYOUT='yes': expected one of auto, off, on"):
        PrefixEngine(clf, 0)


def test_the_masked_attention_mode_keeps_padded_forwards(clf, monkeypatch):
    from openjev.engine import attention

    monkeypatch.setattr(attention, "rowwise_in_force", lambda _model: False)
    record = _engine(clf, 0, "on", monkeypatch).stats()["packed_layout"]
    assert not record["used"] and "row by row" in record["reason"]


def test_packed_groups_cut_by_rows_and_tokens():
    assert packed_groups([5, 5, 5], 2, 100) == [[0, 1], [2]]
    assert packed_groups([60, 30, 20, 200], 8, 100) == [[0, 1], [2], [3]]
    assert packed_groups([], 8, 100) == []


def test_pool_positions_follow_transformers():
    assert packed.pool_positions([[5, 6, 0], [0, 0], [7]], 0) == [1, 0, 0]
    assert packed.pool_positions([[5, 6, 0]], None) == [2]


CONV_CHECK = r"""
import sys, torch
from openjev.engine import fused, packed
from openjev.engine.fused import conv_silu_blc, conv_silu_segments

def rows(x, w, state):
    return conv_silu_blc(x, w, state=state if state is not None else torch.zeros_like(w)[None])

same, worst = packed.check_segment_conv(conv_silu_segments, rows, "cpu", torch.float16)
assert same, worst
# split outputs: the whole output cut in three
forward = packed.PackedForward([37, 200, 64], [0, 64, 64], [37, 264, 128], None, [0], [])
g = torch.Generator().manual_seed(1)
x = torch.randn(301, 40, generator=g).half()
w = torch.randn(40, 4, generator=g).half()
s = torch.randn(4, 40, 4, generator=g).half()
tiles = forward.conv_tiles("cpu")
whole = conv_silu_segments(x, w, tiles, s)
q, k, v = conv_silu_segments(x, w, tiles, s, split=12)
assert torch.equal(torch.cat([q, k, v], 1), whole) and q.is_contiguous() and v.shape == (301, 16)
# a kernel a tap off is refused
def off(x, w, tiles, states):
    y = conv_silu_segments(x, w, tiles, states)
    y[5] = torch.nextafter(y[5], torch.full_like(y[5], 1e4))
    return y
print(packed.check_segment_conv(off, rows, "cpu", torch.float16)[0])
"""


@pytest.mark.slow
def test_the_segments_conv_is_each_rows_own_conv_under_tritons_interpreter():
    pytest.importorskip("triton")
    from conftest import run_py

    proc = run_py(CONV_CHECK, {"TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "False"


@pytest.mark.gpu
def test_on_a_gpu_flas_segment_call_and_the_segments_conv_are_bitwise_each_rows_calls():
    """At Qwen3.5-4B's GDN shape in FP16 (16 key heads handed once, 32 value heads, 128 dims; 8192
    conv channels): the load checks of the packed layout pass."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: fla's kernels and the fused conv are Triton GPU kernels")
    chunk = pytest.importorskip("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    from openjev.engine.fused import conv_silu_blc, conv_silu_segments

    assert packed.rule_takes_segments(chunk)
    same, worst = packed.check_packed_rule(chunk, "cuda", torch.float16, 32, 16, 128, 128)
    assert same, worst

    def rows(x, w, state):
        return conv_silu_blc(x, w, state=state if state is not None else torch.zeros_like(w)[None])

    same, worst = packed.check_segment_conv(conv_silu_segments, rows, "cuda", torch.float16, channels=8192)
    assert same, worst


def test_a_segment_rule_that_fails_at_load_keeps_padded_forwards(clf, monkeypatch):
    from openjev.engine.fused import gdn_modeling

    def broken(*args, cu_seqlens=None, **kwargs):
        raise RuntimeError("no varlen here\nmore")

    monkeypatch.setattr(gdn_modeling(clf.model), "torch_chunk_gated_delta_rule", broken)
    monkeypatch.setattr(packed, "rule_takes_segments", lambda _rule: True)
    record = _engine(clf, 0, "on", monkeypatch).stats()["packed_layout"]
    assert not record["used"] and record["reason"].startswith("the fla varlen check failed on cpu (no varlen here)")


def test_with_varlen_exact_unsplit_rows_share_a_varlen_call_where_the_check_finds_it_bitwise(clf, monkeypatch):
    """OPENJEV_PREFIX_ATTENTION=varlen-exact with the packed layout, on a CPU with the varlen kernel
    replaced by a stand-in that makes each row's own call and a GPU whose calls never split: the load
    check passes, the rows share one varlen call a layer, and cold and warm steps give the logits and
    states of each row's own calls bit for bit. A check that finds a difference keeps own calls."""
    import torch

    from openjev.engine import attention
    from openjev_testsupport.varlen_reference import varlen_by_own_calls

    text = clf.model.config.get_text_config()
    module = attention._CheckModule(text.num_attention_heads // text.num_key_value_heads)
    monkeypatch.setattr(attention, "packed_calls_allowed", lambda *_: True)
    monkeypatch.setattr(attention, "device_sms", lambda _device: 1)
    monkeypatch.setattr(attention, "packed_varlen_is_exact", attention.packed_varlen_is_exact.__wrapped__)
    monkeypatch.setattr(attention, "varlen_flash", varlen_by_own_calls(attention._INNER[0], module))
    shared = []
    real = attention.PackedCalls._build
    monkeypatch.setattr(attention.PackedCalls, "_build",
                        lambda self, q: shared.append(len(self.varlen_rows(q))) or real(self, q))
    rows = _rows(clf.vocab_size)
    runs = {}
    for mode in ("whole-row", "varlen-exact"):
        monkeypatch.setenv("OPENJEV_PREFIX_ATTENTION", mode)
        engine = _engine(clf, 64, "on", monkeypatch)
        record = engine.stats()["packed_layout"]
        assert record["used"] and record["attention"]["varlen"] == (mode == "varlen-exact"), record
        shared.clear()
        runs[mode] = engine, engine.run_step(rows, max_rows=8), engine.run_step(rows, max_rows=8)
        assert (max(shared) > 1) == (mode == "varlen-exact"), shared
    (own, cold_a, warm_a), (varlen, cold_b, warm_b) = runs["whole-row"], runs["varlen-exact"]
    assert np.array_equal(cold_a.logits, cold_b.logits) and np.array_equal(warm_a.logits, warm_b.logits)
    a, b = _states(own), _states(varlen)
    assert set(a) == set(b) and a
    for key in a:
        for name in ("conv", "recurrent", "keys", "values"):
            assert torch.equal(getattr(a[key], name), getattr(b[key], name)), name
    monkeypatch.setattr(attention, "varlen_flash", lambda *args: varlen_by_own_calls(attention._INNER[0], module)(*args) * (1 + 2 ** -20))
    record = _engine(clf, 0, "on", monkeypatch).stats()["packed_layout"]
    assert record["used"] and not record["attention"]["varlen"] and "not the rows' own calls' bits" in record["attention"]["reason"]
