"""The GDN forward that hands the chunked rule each key head once (openjev/engine/gdn.py): on a CPU
with Transformers' PyTorch rule behind a stand-in that takes fla's grouped layout (value head i reads
key head i // (HV / H)), the tiny model's logits, exact, padded and from prefix states, are bitwise
those of Transformers' own forward, and the load check refuses a rule that is not bitwise."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from openjev.engine.fused import _text_modules, gdn_modeling
from openjev.engine.gdn import check_grouped_heads, grouped_heads_forward, kernel_takes_grouped_heads


@pytest.fixture(scope="module")
def clf(tiny_model):
    from openjev.engine.classifier import load_classifier

    return load_classifier(tiny_model["checkpoint"], "cpu", "float32")


def grouped_rule(rule, seen: list):
    """`rule` (which needs as many key heads as value heads) behind fla's grouped call."""

    @functools.wraps(rule)
    def call(q, k, v, *args, **kwargs):
        seen.append(q.shape[2])
        r = v.shape[2] // q.shape[2]
        return rule(q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2), v, *args, **kwargs)

    return call


def _rows(vocab: int, premise: int = 150, singles=(1, 66, 200)) -> list[list[int]]:
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(3, vocab, premise)]
    rows = [shared + [int(t) for t in rng.integers(3, vocab, n)] for n in (4, 9, 17)]
    return rows + [[int(t) for t in rng.integers(3, vocab, n)] for n in singles]


def _scores(clf, rows):
    from openjev.engine.classifier import score_exact, score_padded
    from openjev.engine.prefix import PrefixEngine

    engine = PrefixEngine(clf, 64 << 20, min_tokens=16)
    return [score_exact(clf, rows), score_padded(clf, rows), engine.run_step(rows, max_rows=8).logits,
            engine.run_step(rows, max_rows=8).logits]


def test_forward_without_the_repeat_keeps_every_bit(clf, monkeypatch):
    modeling = gdn_modeling(clf.model)
    text = clf.model.config.get_text_config()
    assert text.linear_num_value_heads > text.linear_num_key_heads  # the tiny model repeats its key heads
    rows = _rows(clf.vocab_size)
    want = _scores(clf, rows)
    seen: list = []
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", grouped_rule(modeling.torch_chunk_gated_delta_rule, seen))
    for m in _text_modules(clf.model, "GatedDeltaNet"):
        monkeypatch.setattr(m, "forward", functools.partial(grouped_heads_forward, m), raising=False)
    got = _scores(clf, rows)
    assert seen and set(seen) == {text.linear_num_key_heads}  # every call got the key heads once
    for name, a, b in zip(("exact", "padded", "prefix cold", "prefix warm"), want, got):
        assert np.array_equal(a, b), name


def test_the_check_passes_a_grouped_rule_and_refuses_one_a_bit_off(clf, monkeypatch):
    import torch

    modeling = gdn_modeling(clf.model)
    m = next(_text_modules(clf.model, "GatedDeltaNet"))
    gen = torch.Generator().manual_seed(3)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    shapes = ((1, 37), (2, 70))
    takes, why = kernel_takes_grouped_heads(modeling)
    assert not takes and "not fla's" in why and "torch_chunk_gated_delta_rule" in why
    rule = modeling.torch_chunk_gated_delta_rule
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", grouped_rule(rule, []))
    with torch.inference_mode():  # as apply_fused runs the checks
        assert check_grouped_heads(m, modeling, rnd, shapes) == (True, 0.0)

    def off_by_one_ulp(q, k, v, *args, **kwargs):
        out, state = grouped_rule(rule, [])(q, k, v, *args, **kwargs)
        if q.shape[2] == v.shape[2]:
            return out, state
        return torch.nextafter(out, torch.full_like(out, float("inf"))), state

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", off_by_one_ulp)
    with torch.inference_mode():
        same, worst = check_grouped_heads(m, modeling, rnd, shapes)
    assert not same and 0 < worst < 1e-3


SPLIT_CONV = r"""
import functools, sys
import numpy as np, torch
sys.path.insert(0, sys.argv[2])
from test_grouped_heads import _rows, grouped_rule
from openjev.engine import fused as _fused
from openjev.engine.classifier import load_classifier, score_padded
from openjev.engine.prefix import PrefixEngine

g = torch.Generator().manual_seed(2)
w = torch.randn(40, 4, generator=g).half()
for length in (1, 40):  # 40: two tiles of the state kernel
    x = (torch.randn(2, length, 40, generator=g) * 3).half()
    st = (torch.randn(2, 40, 4, generator=g) * 3).half()
    for state in (None, st):
        parts = _fused.conv_silu_blc(x, w, state=state, split=12)
        assert [tuple(p.shape) for p in parts] == [(2, length, 12), (2, length, 12), (2, length, 16)]
        assert all(p.is_contiguous() for p in parts)
        assert torch.equal(torch.cat(parts, -1), _fused.conv_silu_blc(x, w, state=state)), (length, state is None)

clf = load_classifier(sys.argv[1], device="cpu", dtype="float16")
modeling = _fused.gdn_modeling(clf.model)
_fused._install(clf.model, modeling, {"conv_silu"}, cached_conv=True)  # its check: test_fused.py
rows = _rows(clf.vocab_size, premise=80, singles=(1, 70))  # short: Triton's interpreter runs every kernel
def scores():
    engine = PrefixEngine(clf, 64 << 20, min_tokens=16)
    return [score_padded(clf, rows), engine.run_step(rows, max_rows=8).logits, engine.run_step(rows, max_rows=8).logits]
want = scores()
modeling.torch_chunk_gated_delta_rule = grouped_rule(modeling.torch_chunk_gated_delta_rule, [])
splits = []
def counted(x, *a):
    state = getattr(_fused._DEFERRED, "pair", None)
    out = _fused.conv_silu_qkv(x, *a)
    splits.append((out is not None, state is not None))
    return out
for m in _fused._text_modules(clf.model, "GatedDeltaNet"):
    m.forward = functools.partial(_fused.grouped_heads_forward, m, conv_qkv=counted)
got = scores()
for name, a, b in zip(("padded", "prefix cold", "prefix warm"), want, got):
    assert np.array_equal(a, b), name
# the load check as it runs where fla's rule is bound: with the conv's outputs written apart
_fused.kernel_takes_grouped_heads = lambda modeling: (True, "a grouped stand-in")
conv_used = {"conv_silu": {"used": True, "cached_layout": {"used": True}}}
checked = _fused._check_piece("grouped_heads", clf.model, modeling, "cpu", torch.float16, conv_used)
assert checked["used"] and checked["bitwise_on_check"], checked
print(sum(s for s, _ in splits), sum(s and st for s, st in splits), len(splits))
"""


def test_the_conv_writes_query_key_and_value_apart_and_keeps_every_bit(tiny_model):
    """conv_silu_blc's split outputs are its whole output cut in three (with and without a prefix
    state), and the tiny model in FP16 under Triton's interpreter, the fused conv installed, gives the same
    logits, padded and from prefix states, with the grouped forward writing the conv apart; the load
    check passes that forward."""
    pytest.importorskip("triton")
    from conftest import REPO, run_py

    proc = run_py(SPLIT_CONV, {"TRITON_INTERPRET": "1"}, timeout=900, args=(tiny_model["checkpoint"], REPO / "tests"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    split, from_state, calls = map(int, proc.stdout.split()[-3:])
    assert calls > 0 and split == calls and 0 < from_state < calls, (split, from_state, calls)
