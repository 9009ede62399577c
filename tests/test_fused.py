"""openjev/engine/fused.py: the embedded server's fused kernels are used only where they are bitwise
Transformers' modules, and a model with them gives the same logits.

On a CPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, numpy), in a
subprocess of their own because the interpreter is chosen when the kernels are defined. The
interpreter's exp is numpy's, not libdevice's, so pieces with a silu may fail their check here:
the test then sees the refusal path. On a GPU (the H200, results_h200/embedded_gpu/call11-fused)
all four pieces passed and the fused padded forward was bitwise the exact reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, run_py

triton_missing = None
try:
    import triton  # noqa: F401
except ImportError as exc:
    triton_missing = f"triton not importable ({exc}): it is the GPU extra; requirements.txt pins it for these tests"


FUSE_ON_CPU = r"""
import json, sys
import numpy as np, torch
from openjev.engine.classifier import load_classifier, score_exact, score_padded
from openjev.engine import fused as _fused
clf = load_classifier(sys.argv[1], device="cpu", dtype="float16")
rows = [[(7 * i + 3 * j) % clf.vocab_size for i in range(n)] for j, n in enumerate([5, 40, 77, 12])]
before = (score_exact(clf, rows), score_padded(clf, rows))
rec = _fused.apply_fused(clf.model, "cpu")
after = (score_exact(clf, rows), score_padded(clf, rows))
installed = sorted({type(m).__name__ for m in clf.model.modules() if "forward" in m.__dict__})
conv = getattr(sys.modules[type(next(m for m in clf.model.modules() if type(m).__name__.endswith("GatedDeltaNet"))).__module__],
               "causal_conv1d_fn")
wrong = None
if rec["pieces"]["rms_norm"]["used"]:  # a kernel one ulp off must be refused by the check
    _fused.remove_fused(clf.model)
    good = _fused.rms_apply
    _fused.rms_apply = lambda x, r, w1: torch.nextafter(good(x, r, w1), torch.tensor(float("inf"), dtype=x.dtype))
    wrong = _fused.apply_fused(clf.model, "cpu")["pieces"]["rms_norm"]
print(json.dumps({"record": rec, "exact_equal": bool(np.array_equal(before[0], after[0])),
                  "padded_equal": bool(np.array_equal(before[1], after[1])), "installed": installed,
                  "conv_wrapped": bool(getattr(conv, "_openjev_fused", False)), "wrong": wrong}))
"""


@pytest.mark.skipif(triton_missing is not None, reason=triton_missing or "")
def test_pieces_are_used_only_where_bitwise_and_keep_the_logits(tiny_model):
    proc = run_py(FUSE_ON_CPU.replace("sys.argv[1]", repr(str(tiny_model["checkpoint"]))),
                  {"TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rec = out["record"]
    assert rec["requested"] == "auto" and rec["interpret"] is True and set(rec["pieces"]) == {
        "rms_norm", "gated_norm", "swiglu", "conv_silu", "grouped_heads"}
    # the grouped heads need fla's rule; a CPU has Transformers' fallback, which repeats them itself
    grouped = rec["pieces"].pop("grouped_heads")
    assert grouped["used"] is False and "not fla's" in grouped["reason"], grouped
    for piece, r in rec["pieces"].items():
        assert r["used"] == r.get("bitwise_on_check", False), (piece, r)
        if not r["used"]:
            assert "not bitwise equal" in r["reason"] and r["max_abs_diff"] > 0, (piece, r)
    # the norms' arithmetic is multiplications only: bitwise on any device, so it must be used here
    assert rec["pieces"]["rms_norm"]["used"] and rec["pieces"]["rms_norm"]["modules"] > 0
    assert "Qwen3_5RMSNorm" in out["installed"]
    # the one-pass variance sums in PyTorch's CUDA order, not in its CPU kernel's: here the check
    # falls back to x*x + torch.mean (or keeps it for a width that is not a multiple of 128)
    assert rec["pieces"]["rms_norm"]["variance"].startswith("x*x, then torch.mean"), rec["pieces"]["rms_norm"]
    assert out["conv_wrapped"] == rec["pieces"]["conv_silu"]["used"]
    cached = rec["pieces"]["conv_silu"]["cached_layout"]  # the layout of a forward from a prefix state, checked apart
    assert cached["used"] == (cached["bitwise_on_check"] and rec["pieces"]["conv_silu"]["used"]), cached
    assert out["exact_equal"] and out["padded_equal"], "a model with the used pieces changed its logits"
    assert out["wrong"]["used"] is False and "not bitwise equal" in out["wrong"]["reason"]


@pytest.mark.skipif(triton_missing is not None, reason=triton_missing or "")
def test_each_kernel_matches_its_float32_recipe():
    """Kernel by kernel under the interpreter against the same arithmetic written with torch ops
    (numpy's exp for silu, as the interpreter uses): bitwise."""
    code = r"""
import numpy as np, torch
from openjev.engine import fused as _fused
g = torch.Generator().manual_seed(1)
def silu(x):
    x = x.numpy()
    return torch.from_numpy(x / (np.float32(1) + np.exp(-x)))
x = (torch.randn(3, 50, 96, generator=g) * 3).half()
r = torch.rsqrt(_fused.square_f32(x).mean(-1, keepdim=True) + 1e-6)
assert torch.equal(_fused.square_f32(x), x.float().pow(2))
w1 = 1.0 + torch.randn(96, generator=g)
assert torch.equal(_fused.rms_apply(x, r, w1), ((x.float() * r) * w1).half())
z = (torch.randn(3, 50, 96, generator=g) * 2).half()
w = torch.randn(96, generator=g).half()
want = ((w * (x.float() * r).half()).float() * silu(z.float())).half()
assert torch.equal(_fused.gated_apply(x, r, z, w), want)
u = torch.randn(3, 50, 96, generator=g).half()
assert torch.equal(_fused.swiglu(z, u), (silu(z.float()).half().float() * u.float()).half())
cw = torch.randn(96, 4, generator=g).half()
conv = torch.nn.functional.conv1d(x.transpose(1, 2).float(), cw.float().unsqueeze(1), padding=3, groups=96)[:, :, :50]
got = _fused.conv_silu_blc(x.contiguous(), cw)
want = silu(conv.transpose(1, 2).half().float()).half()
assert (got.float() - want.float()).abs().max() <= 2e-3 * want.float().abs().max(), "conv+silu off"
# a [B, C, K - 1 + L] input, as a forward from a cached state concatenates it: the tiled strided
# kernel, bitwise the contiguous kernel on the same values
xb = (torch.randn(3, 96, 53, generator=g) * 3).half()
assert torch.equal(_fused.conv_silu_blc(xb.transpose(1, 2), cw), _fused.conv_silu_blc(xb.transpose(1, 2).contiguous(), cw))
# the wrapper the GDN forward calls takes each layout to the fused kernel where that layout's check
# passed (the uncached one alone: the cached input goes to Transformers' function)
fell_back = []
def original(hidden, *_a, **_k):
    fell_back.append(tuple(hidden.shape))
    return hidden
wrap = _fused.make_conv_wrapper(original)
_fused._CONV_WEIGHTS.add(cw.data_ptr())
assert wrap(xb, cw, None, activation="silu") is xb and fell_back == [tuple(xb.shape)]
_fused._CONV_CACHED_WEIGHTS.add(cw.data_ptr())
for inp in (x.transpose(1, 2), xb):
    got = wrap(inp, cw, None, activation="silu")
    assert got.shape == inp.shape and torch.equal(got.transpose(1, 2), _fused.conv_silu_blc(inp.transpose(1, 2).contiguous(), cw))
assert len(fell_back) == 1
# new inputs handed on apart from a prefix state of K columns (a cache layer's defer_conv_state): the
# state kernel reads the state in place, bitwise the strided kernel on the concatenation, for short
# inputs (every tap of the first outputs in the state) and a state of any strides
for length in (1, 2, 3, 70, 50):  # 70: three tiles of the state kernel; 50 last, for the lines after
    xs, st = (torch.randn(3, length, 96, generator=g) * 3).half(), (torch.randn(3, 4, 96, generator=g) * 3).half()
    st = st.transpose(1, 2)  # [B, C, K], not contiguous
    whole = _fused.conv_silu_blc(torch.cat([st, xs.transpose(1, 2)], -1).transpose(1, 2), cw)[:, 4:]
    assert torch.equal(_fused.conv_silu_blc(xs, cw, state=st), whole), length
    new = xs.transpose(1, 2)  # the GDN forward passes on the very tensor the cache layer handed on
    _fused.defer_conv_state(new, st)
    got = wrap(new, cw, None, activation="silu")
    assert got.shape == (3, 96, length) and torch.equal(got.transpose(1, 2), whole), length
assert len(fell_back) == 1
# offsets in int64 (taken where a row's offsets could pass int32): the same outputs
import triton
wide = torch.empty_like(xs)
_fused._conv_silu_state_kernel[(3 * triton.cdiv(50, 32), triton.cdiv(96, 64))](
    xs, st, cw, wide, 50, 96, 4, *xs.stride(), *st.stride(), K=4, BLOCK_T=32, BLOCK_C=64, WIDE=True)
assert torch.equal(wide, _fused.conv_silu_blc(xs, cw, state=st))
assert wrap(new, cw, None, activation="silu").shape == (3, 96, 50)  # taken once: the next call has no state
_fused._CONV_CACHED_WEIGHTS.discard(cw.data_ptr())  # an unchecked layout: the concatenation goes to Transformers'
_fused.defer_conv_state(new, st)
got = wrap(new, cw, None, activation="silu")
assert fell_back[-1] == (3, 96, 4 + 50) and got.shape == (3, 96, 54), fell_back
assert torch.equal(got[:, :, 4:], torch.cat([st, xs.transpose(1, 2)], -1)[:, :, 4:])
# mean_square: PyTorch's CUDA summation order, written out in numpy float32 (lane t, accumulators
# a_i over j of elements 4t+i+128j; ((a0+a1)+a2)+a3; lane t+16 added to lane t, then t+8, ..., t+1;
# times float32(1/N))
def cuda_order_mean(xs):
    xs = xs.float().numpy().reshape(-1, xs.shape[-1])
    rows, n = xs.shape
    out = np.empty(rows, dtype=np.float32)
    for r in range(rows):
        lanes = []
        for t in range(32):
            acc = [np.float32(0)] * 4
            for j in range(n // 128):
                for i in range(4):
                    e = xs[r, 4 * t + i + 128 * j]
                    acc[i] = np.float32(acc[i] + np.float32(e) * np.float32(e))
            lanes.append(np.float32(np.float32(np.float32(acc[0] + acc[1]) + acc[2]) + acc[3]))
        while len(lanes) > 1:
            half = len(lanes) // 2
            lanes = [np.float32(lanes[k] + lanes[k + half]) for k in range(half)]
        out[r] = np.float32(lanes[0] * (np.float32(1) / np.float32(n)))
    return torch.from_numpy(out)
for shape in ((17, 256), (2, 9, 128), (20, 384)):
    xs = (torch.randn(*shape, generator=g) * 3).half()
    got = _fused.mean_square(xs)
    assert got.shape == xs.shape[:-1] + (1,) and torch.equal(got.reshape(-1), cuda_order_mean(xs)), shape
assert _fused.mean_square(x) is None  # 96 columns: not a multiple of 128, torch's mean is kept
assert _fused.mean_square(torch.randn(15, 256).half()) is None  # < 16 rows: PyTorch sums otherwise
print("ok")
"""
    proc = run_py(code, {"TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_off_and_unknown_modes(tiny_model):
    code = r"""
import json, sys
from openjev.engine.classifier import load_classifier
from openjev.engine import fused as _fused
from openjev.common import UserError
clf = load_classifier(sys.argv[1], device="cpu", dtype="float16")
off = _fused.apply_fused(clf.model, "cpu", "off")
cpu = _fused.apply_fused(clf.model, "cpu")
try:
    _fused.fused_mode("fast")
    bad = None
except UserError as exc:
    bad = str(exc)
print(json.dumps({"off": off, "cpu": cpu, "bad": bad,
                  "installed": [type(m).__name__ for m in clf.model.modules() if "forward" in m.__dict__]}))
""".replace("sys.argv[1]", repr(str(tiny_model["checkpoint"])))
    proc = run_py(code, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["off"]["reason"] == "OPENJEV_FUSED=off" and out["off"]["pieces"] == {}
    assert out["cpu"]["reason"].startswith("device cpu") and out["installed"] == []
    assert "OPENJEV_FUSED='fast'" in out["bad"] and "auto, off" in out["bad"]


@pytest.mark.skipif(triton_missing is not None, reason=triton_missing or "")
def test_a_list_of_pieces_checks_and_uses_those_alone(tiny_model):
    code = r"""
import json, sys
from openjev.engine.classifier import load_classifier
from openjev.engine import fused as _fused
from openjev.common import UserError
clf = load_classifier(sys.argv[1], device="cpu", dtype="float16")
rec = _fused.apply_fused(clf.model, "cpu", "swiglu,rms_norm")
try:
    _fused.fused_mode("rms_norm,fast")
    bad = None
except UserError as exc:
    bad = str(exc)
print(json.dumps({"rec": rec, "bad": bad,
                  "installed": sorted({type(m).__name__ for m in clf.model.modules() if "forward" in m.__dict__})}))
""".replace("sys.argv[1]", repr(str(tiny_model["checkpoint"])))
    proc = run_py(code, {"TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    pieces = out["rec"]["pieces"]
    assert pieces["rms_norm"]["used"] and pieces["swiglu"]["used"], pieces
    for p in ("gated_norm", "conv_silu", "grouped_heads"):
        assert pieces[p] == {"used": False, "reason": "not in OPENJEV_FUSED=swiglu,rms_norm"}, pieces[p]
    assert out["installed"] == ["Qwen3_5MLP", "Qwen3_5RMSNorm"], out["installed"]
    assert "OPENJEV_FUSED='rms_norm,fast'" in out["bad"] and "grouped_heads" in out["bad"]


def test_server_refuses_an_unknown_fused_mode(overlay, tmp_path):
    """A typo in OPENJEV_FUSED fails the load with one clear line instead of serving unfused."""
    from conftest import free_port

    port = free_port()
    proc = subprocess.run([sys.executable, str(REPO / "app" / "serve_transformers.py"), str(overlay), str(port)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OPENJEV_FUSED="fast"))
    assert proc.returncode != 0
    assert "OPENJEV_FUSED='fast': expected one of auto, off" in proc.stderr


@pytest.mark.gpu
def test_fused_padded_forwards_on_a_gpu_are_bitwise_the_reference(overlay, sample_tokens, tmp_path):
    """On a GPU every piece passes its check and the fused padded forwards give the exact
    reference's bits (benchmarks/experiments/embedded_gpu_variants.py in a subprocess, so this process
    keeps its CPU kernel binding)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the fused pieces are Triton GPU kernels; measured on an H200: "
                    "results_h200/embedded_gpu/call11-fused")
    if triton_missing:
        pytest.skip(triton_missing)
    out = tmp_path / "v"
    script = REPO / "benchmarks" / "experiments" / "embedded_gpu_variants.py"
    proc = subprocess.run([sys.executable, str(script), "--model", str(overlay),
                           "--tokens", str(sample_tokens), "--out", str(out), "--device", "cuda", "--rows", "8",
                           "--repeats", "1", "--variants", "exact_async,padded_fused"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    v = json.loads((out / "variants.json").read_text())["variants"]
    fused = v["padded_fused"]["fused"]
    assert all(p["used"] for p in fused["pieces"].values()), fused
    assert v["padded_fused"]["rows8"]["bitwise_equal"], v["padded_fused"]
    assert np.load(out / "exact_baseline.npy").shape[1] == 3


@pytest.mark.skipif(triton_missing is not None, reason=triton_missing or "")
def test_norm_falls_back_to_torch_mean_where_the_one_pass_order_differs():
    """A norm of width 256 on a CPU: the one-pass variance (PyTorch's CUDA order) is not what
    torch's CPU mean gives, so the check keeps the piece with x*x + torch.mean, and the installed
    module is still bitwise Transformers' on new inputs."""
    code = r"""
import json, torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
from openjev.engine import fused as _fused
model = torch.nn.Sequential(Qwen3_5RMSNorm(256)).half()
torch.nn.init.normal_(model[0].weight, std=0.5)
rec = _fused.apply_fused(model, "cpu")
x = (torch.randn(2, 40, 256) * 2).half()
print(json.dumps({"rms": rec["pieces"]["rms_norm"], "one_pass": _fused.ONE_PASS_VARIANCE["rms_norm"],
                  "equal": bool(torch.equal(model(x), type(model[0]).forward(model[0], x)))}))
"""
    proc = run_py(code, {"TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rms"]["used"] and out["rms"]["modules"] == 1 and out["one_pass"] is False, out
    assert out["rms"]["variance"] == "x*x, then torch.mean (the one-pass order was not bitwise here)"
    assert out["equal"]


@pytest.mark.gpu
def test_one_pass_variance_is_torch_mean_on_a_gpu():
    """mean_square against x.float().pow(2).mean(-1) on the GPU, bitwise, over widths of Qwen3.5's
    norms (hidden 2560, attention head 256, GDN value head 128) and others, and row counts from 16."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the one-pass variance reproduces PyTorch's CUDA summation order")
    if triton_missing:
        pytest.skip(triton_missing)
    from openjev.engine import fused as _fused

    g = torch.Generator(device="cpu").manual_seed(3)
    bad = []
    for n in (128, 256, 384, 1024, 2560, 4096):
        for rows in (16, 17, 100, 1000, 24001):
            x = (torch.randn(rows, n, generator=g) * 3).half().cuda()
            want = x.float().pow(2).mean(-1, keepdim=True)
            got = _fused.mean_square(x)
            if not torch.equal(got, want):
                bad.append((rows, n, float((got - want).abs().max())))
    assert not bad, f"not bitwise torch's mean (rows, width, max diff): {bad}"


def test_the_tile_size_benchmark_says_in_one_line_that_it_needs_a_gpu(tmp_path):
    """benchmarks/experiments/fused_kernel_blocks.py times the kernels' tile sizes on a GPU; without one
    it ends at once with one line and writes nothing."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the benchmark would run")
    out = tmp_path / "blocks.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "experiments" / "fused_kernel_blocks.py"),
                           "--out", str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "needs a CUDA device" in proc.stderr and not out.exists()
