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


def _rows(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    premise = [int(t) for t in rng.integers(3, vocab, 150)]
    rows = [premise + [int(t) for t in rng.integers(3, vocab, n)] for n in (4, 9, 17)]
    return rows + [[int(t) for t in rng.integers(3, vocab, n)] for n in (1, 66, 200)]


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
