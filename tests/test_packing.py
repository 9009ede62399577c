"""openjev/engine/packing.py: a padded forward's MLPs run on the real tokens only, give every real
row the padded forward's bits, and are installed only where the device check finds that."""

from __future__ import annotations

import random

import numpy as np
import pytest

from openjev.common import UserError


@pytest.fixture(scope="module")
def clf(tiny_model):
    from openjev.engine.classifier import load_classifier

    return load_classifier(tiny_model["checkpoint"], "cpu", "float32")


def _rows(vocab: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    premise = [rng.randrange(3, vocab) for _ in range(150)]
    rows = [premise + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    return rows + [[rng.randrange(3, vocab) for _ in range(n)] for n in (7, 90, 211)]


def test_real_token_index_names_each_rows_real_tokens():
    from openjev.engine.packing import real_token_index

    assert real_token_index([3, 1, 4], 4, "cpu").tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    assert real_token_index([4, 4], 4, "cpu") is None  # nothing padded: nothing to pack


def test_packed_mlp_keeps_padded_and_prefix_logits_and_runs_fewer_rows(clf):
    """Padded forwards and prefix reuse (cold and warm) give the same logits with the MLPs packed,
    and the MLPs' matrix products see only the real tokens."""
    import torch

    from openjev.engine.classifier import score_padded
    from openjev.engine.packing import install_packed_mlp, remove_packed_mlp
    from openjev.engine.prefix import PrefixEngine

    rows = _rows(clf.vocab_size)
    plain = score_padded(clf, rows)
    engine = PrefixEngine(clf, 64 << 20, min_tokens=16)
    prefix = [engine.run_step(rows, max_rows=8).logits for _ in range(2)]

    seen = []
    mlp = next(m for m in clf.model.modules() if type(m).__name__.endswith("MLP") and hasattr(m, "gate_proj"))
    hook = mlp.gate_proj.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[:-1].numel()))
    try:
        rec = install_packed_mlp(clf.model, clf.device, "on")
        assert rec["used"] and rec["modules"] == clf.model.config.get_text_config().num_hidden_layers
        assert seen == [900, 538, 4400, 2847]  # the check: padded, then packed, of both shapes
        seen.clear()
        assert np.array_equal(score_padded(clf, rows), plain)
        assert seen == [sum(map(len, rows))]  # one forward, its real tokens only
        engine = PrefixEngine(clf, 64 << 20, min_tokens=16)
        for want in prefix:
            assert np.array_equal(engine.run_step(rows, max_rows=8).logits, want)
        with torch.inference_mode():  # outside a padded forward: the MLP as it was
            x = torch.randn(2, 9, mlp.down_proj.out_features)
            assert torch.equal(mlp(x), type(mlp).forward(mlp, x))
    finally:
        hook.remove()
        remove_packed_mlp(clf.model)
    assert not any("forward" in m.__dict__ for m in clf.model.modules() if type(m).__name__.endswith("MLP"))


def test_a_packed_mlp_that_changes_bits_is_refused(clf, monkeypatch):
    """Where the packed product would round a real row differently, the check refuses and nothing is
    wrapped; off and a typo as the operator would set them."""
    import torch

    from openjev.engine import packing

    good = packing.packed_call

    def one_ulp_off(inner, x, index):
        out = good(inner, x, index)
        return torch.nextafter(out, torch.tensor(float("inf"), dtype=out.dtype)) if index is not None else out

    monkeypatch.setattr(packing, "packed_call", one_ulp_off)
    rec = packing.install_packed_mlp(clf.model, clf.device, "on")
    assert not rec["used"] and "not bitwise" in rec["reason"] and rec["modules"] == 0
    assert not any("forward" in m.__dict__ for m in clf.model.modules() if type(m).__name__.endswith("MLP"))
    off = packing.install_packed_mlp(clf.model, clf.device, "off")
    assert not off["used"] and "OPENJEV_PACKED_MLP=off" in off["reason"]
    monkeypatch.setenv("OPENJEV_PACKED_MLP", "yes")
    with pytest.raises(UserError, match="OPENJEV_PACKED_MLP='yes': expected one of off, on"):
        packing.install_packed_mlp(clf.model, clf.device)


def test_serving_preparation_reports_the_packed_mlp(tiny_model, monkeypatch):
    """prepare_serving installs it from the environment and the kernel path (/server_info) says so."""
    from openjev.engine.classifier import load_classifier
    from openjev.engine.warmup import prepare_serving

    monkeypatch.setenv("OPENJEV_PACKED_MLP", "on")
    served = load_classifier(tiny_model["checkpoint"], "cpu", "float32")
    prepare_serving(served, "padded", max_rows=4, max_tokens=256)
    assert served.kernels["packed_mlp"]["used"] and served.kernels["packed_mlp"]["requested"] == "on"


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(300, 201, 37), (1500, 901, 64, 3), tuple(range(1500, 0, -94))])
def test_packed_mlp_is_bitwise_the_padded_rows_on_a_gpu(lengths):
    """Qwen3.5-4B's MLP shape in FP16 (hidden 2560, intermediate 9216): the packed products give every
    real row the padded forward's bits, up to 16 rows of up to 1500 tokens."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from openjev.engine.packing import packed_call, real_token_index

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(2560, 9216, bias=False), nn.Linear(2560, 9216, bias=False)
            self.down_proj = nn.Linear(9216, 2560, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    torch.manual_seed(0)
    mlp = MLP().to("cuda", torch.float16)
    width = max(lengths)
    with torch.inference_mode():
        x = torch.randn(len(lengths), width, 2560, device="cuda", dtype=torch.float16)
        want = mlp(x)
        got = packed_call(mlp, x, real_token_index(lengths, width, x.device))
    for b, n in enumerate(lengths):
        assert torch.equal(want[b, :n], got[b, :n]), (b, n)
