"""The pure-PyTorch stand-ins for sgl-kernel's CUDA norm/activation ops
(openjev_testsupport.sgl_kernel_cuda_standin) against float64 references, shape by shape.

The stand-ins let stock SGLang 0.5.23 run on a GPU machine without sglang-kernel's compiled
``common_ops`` library (sgl_kernel's loader falls back to ``import common_ops``, which is the stand-in
shim). Each op must agree with a float64 reference to one unit in the last place of its dtype
(relative) plus a tiny absolute term, change exactly the tensors the kernel changes, carry the
compiled library's schema, refuse to register over the compiled library, and be what sgl_kernel's
own Python wrappers reach. The wrapper test needs the SGLang venv
(``build/sglang-venvs/0.5.23/bin/python -m pytest tests/test_sgl_cuda_standin.py``); the GPU test
needs a CUDA device.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import openjev_testsupport.sgl_kernel_cuda_standin as standin

REPO = Path(__file__).resolve().parents[1]
SHIM = REPO / "tests" / "openjev_testsupport" / "sgl_kernel_cuda_standin" / "shim"


@pytest.fixture(autouse=True, scope="module")
def stand_ins():
    """The stand-ins registered for this module's tests and taken out again after them, so a later test
    in the same process can still load the compiled library."""
    if standin._LIB is not None:  # registered already in this process (the shim was imported)
        yield
        return
    try:
        standin.register()
    except RuntimeError as exc:  # the compiled library is loaded in this process
        pytest.skip(f"the compiled sgl_kernel library is loaded in this process: {exc}")
    yield
    standin._LIB._destroy()
    standin._LIB = None


# The schemas in sgl-kernel's csrc/common_extension.cc, as found in sglang-kernel's common_ops.abi3.so.
KERNEL_SCHEMAS = json.loads((Path(__file__).parent / "data" / "sgl_kernel_schemas.json").read_text())["schemas"]

DTYPES = [torch.float16, torch.bfloat16]
HIDDEN = [256, 2560, 100, 4096]      # 256: Qwen3.5's head_dim (q/k norm), 2560: its hidden size; 100: vec size 4
BATCH = [1, 3, 7]
EPS = 1e-6
ATOL = 2.0 ** -24                    # below float16's smallest subnormal step


def ulp_check(got: torch.Tensor, ref: torch.Tensor, what: str, ulps: float = 1.0) -> None:
    """|got - ref| <= ulps * eps(dtype) * |ref| + ATOL element by element (one ulp relative by default)."""
    rel = ulps * torch.finfo(got.dtype).eps
    diff = (got.double() - ref).abs()
    bound = rel * ref.abs() + ATOL
    bad = diff > bound
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off by more than {ulps:g} ulp; "
                                 f"worst |diff| {float(diff.max()):.3g}")


def ref_norm(x64: torch.Tensor, w: torch.Tensor, gemma: bool) -> torch.Tensor:
    w64 = w.double() + (1.0 if gemma else 0.0)
    return x64 * torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + EPS) * w64


def inputs(batch: int, hidden: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed * 1000 + batch * 10 + hidden)
    x = (torch.randn(batch, hidden, generator=g) * 3).to(dtype)
    r = (torch.randn(batch, hidden, generator=g) * 3).to(dtype)
    w = (torch.randn(hidden, generator=g) * 0.3 + 1.0).to(dtype)
    return x.to(device), r.to(device), w.to(device)


# ---- schemas and registration --------------------------------------------------------------------

def test_the_stand_ins_are_the_ops_named():
    assert set(standin.SCHEMAS) == set(KERNEL_SCHEMAS)


@pytest.mark.parametrize("op", sorted(KERNEL_SCHEMAS))
def test_the_stand_in_has_the_kernels_schema(op):
    registered = getattr(torch.ops.sgl_kernel, op).default._schema
    assert registered == torch._C.parse_schema(f"sgl_kernel::{KERNEL_SCHEMAS[op]}"), str(registered)
    for key in ("CUDA", "CPU"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"sgl_kernel::{op}", key), key


def _installed_binaries() -> list[Path]:
    spec = importlib.util.find_spec("sgl_kernel")  # located, not imported (that would load the library)
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(list(spec.submodule_search_locations)[0])
    return sorted(root.glob("sm*/common_ops.*so")) + sorted(root.glob("common_ops.*so"))


def test_the_schemas_are_those_in_the_installed_binary():
    """In the SGLang venv: the schema strings compiled into sglang-kernel's common_ops library."""
    libs = _installed_binaries()
    if not libs:
        pytest.skip("no sglang-kernel binary installed here (the project .venv lacks sgl_kernel); "
                    "build/sglang-venvs/0.5.23/bin/python runs this")
    for lib in libs:
        blob = lib.read_bytes()
        for op, schema in KERNEL_SCHEMAS.items():
            found, at = set(), blob.find(b"\x00" + op.encode() + b"(Tensor")
            while at >= 0:  # each NUL-terminated string that starts with "<op>(Tensor"
                found.add(blob[at + 1:blob.index(b"\x00", at + 1)].decode())
                at = blob.find(b"\x00" + op.encode() + b"(Tensor", at + 1)
            assert found == {schema}, (lib, op, found)


_REFUSE_THEN_SHIM = r"""
import os, torch
lib = torch.library.Library("sgl_kernel", "FRAGMENT")  # as the compiled library defines it
lib.define(os.environ["SCHEMA"])
import openjev_testsupport.sgl_kernel_cuda_standin as standin
try:
    standin.register()
except RuntimeError as exc:
    print("refused:", exc)
else:
    raise SystemExit("register() did not refuse")
lib._destroy()  # the compiled library gone: the fallback module registers the stand-ins
import common_ops
x = torch.randn(3, 256).to(torch.bfloat16)
out = torch.empty_like(x)
torch.ops.sgl_kernel.rmsnorm(out, x, torch.ones(256, dtype=torch.bfloat16), 1e-6, False)
torch.ops.sgl_kernel.rmsnorm(out, x, torch.ones(256, dtype=torch.bfloat16), 1e-6, False)
torch.ops.sgl_kernel.silu_and_mul(torch.empty(3, 128, dtype=torch.bfloat16), x)
print("shim:", common_ops.__all__)
print(os.getpid())
"""


def test_registering_over_the_compiled_library_is_refused_and_the_shim_registers(tmp_path):
    """With sgl_kernel::rmsnorm already defined (as the compiled library defines it), register() refuses in
    one line naming the op; without it, importing the shim's common_ops registers the stand-ins, and
    OPENJEV_STANDIN_CALL_LOG gets one line per op called (the first call)."""
    log = tmp_path / "calls.log"
    env = {**os.environ, "PYTHONPATH": f"{SHIM}:{REPO / 'tests'}:{REPO}", "SCHEMA": KERNEL_SCHEMAS["rmsnorm"],
           "OPENJEV_STANDIN_CALL_LOG": str(log)}
    proc = subprocess.run([sys.executable, "-c", _REFUSE_THEN_SHIM], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == ("refused: sgl_kernel_cuda_standin: torch.ops.sgl_kernel already defines rmsnorm "
                        "(the compiled library is loaded); use one or the other"), proc.stdout
    assert lines[1] == "shim: " + str(sorted(KERNEL_SCHEMAS)) and len(lines) == 3, proc.stdout
    pid = lines[2]
    assert log.read_text().splitlines() == [f"{pid} rmsnorm", f"{pid} silu_and_mul"]


# ---- arithmetic -----------------------------------------------------------------------------------

def over_norm_inputs(test):
    """Parametrized over every batch, hidden size and dtype of the norm tests."""
    for mark in (pytest.mark.parametrize("batch", BATCH), pytest.mark.parametrize("hidden", HIDDEN),
                 pytest.mark.parametrize("dtype", DTYPES, ids=str)):
        test = mark(test)
    return test


@over_norm_inputs
@pytest.mark.parametrize("gemma", [False, True], ids=["rmsnorm", "gemma_rmsnorm"])
def test_rmsnorm(gemma, batch, hidden, dtype):
    x, _, w = inputs(batch, hidden, dtype)
    x0, w0 = x.clone(), w.clone()
    out = torch.full_like(x, float("nan"))
    op = torch.ops.sgl_kernel.gemma_rmsnorm if gemma else torch.ops.sgl_kernel.rmsnorm
    assert op.default(out, x, w, EPS, False) is None
    ulp_check(out, ref_norm(x.double(), w, gemma), "out")
    assert torch.equal(x, x0) and torch.equal(w, w0)  # only out changes


@over_norm_inputs
@pytest.mark.parametrize("gemma", [False, True], ids=["fused_add_rmsnorm", "gemma_fused_add_rmsnorm"])
def test_fused_add_rmsnorm(gemma, batch, hidden, dtype):
    x, r, w = inputs(batch, hidden, dtype)
    x0, r0, w0 = x.clone(), r.clone(), w.clone()
    op = torch.ops.sgl_kernel.gemma_fused_add_rmsnorm if gemma else torch.ops.sgl_kernel.fused_add_rmsnorm
    assert op.default(x, r, w, EPS, False) is None
    s64 = x0.double() + r0.double()
    # residual <- the float32 sum rounded to the dtype; input <- the normalized float32 sum
    assert torch.equal(r, (x0.float() + r0.float()).to(dtype))
    ulp_check(r, s64, "residual")
    ulp_check(x, ref_norm(s64, w, gemma), "input")
    assert torch.equal(w, w0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_normalizes_the_float_sum_not_the_rounded_residual(dtype):
    """FlashInfer's FusedAddRMSNormKernel keeps x = input + residual in float32 (shared memory) and
    normalizes that; only the residual it stores is rounded. Where normalizing the exact sum and
    normalizing the rounded residual land on different dtype values, the stand-in gives the former."""
    x, r, w = inputs(7, 2560, dtype, seed=1)
    s64 = x.double() + r.double()
    from_sum = ref_norm(s64, w, False).to(dtype)
    from_rounded = ref_norm(s64.to(dtype).double(), w, False).to(dtype)
    differ = from_sum != from_rounded
    assert int(differ.sum()) > 1000  # the case separates the two readings
    torch.ops.sgl_kernel.fused_add_rmsnorm(x, r, w, EPS, False)
    assert float((x[differ] == from_sum[differ]).double().mean()) > 0.99
    assert float((x[differ] == from_rounded[differ]).double().mean()) < 0.01


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norms_honour_row_strides(dtype):
    """The kernels take stride(0) of input/output/residual: rows of a wider buffer work in place."""
    x, r, w = inputs(5, 256, dtype)
    xb, rb = torch.zeros(5, 384, dtype=dtype), torch.zeros(5, 320, dtype=dtype)
    xv, rv = xb[:, 64:320], rb[:, :256]
    xv.copy_(x)
    rv.copy_(r)
    ob = torch.zeros(5, 300, dtype=dtype)
    torch.ops.sgl_kernel.gemma_rmsnorm(ob[:, 44:], xv, w, EPS, False)
    ulp_check(ob[:, 44:], ref_norm(x.double(), w, True), "strided out")
    assert not ob[:, :44].any()
    torch.ops.sgl_kernel.gemma_fused_add_rmsnorm(xv, rv, w, EPS, False)
    ulp_check(xv, ref_norm(x.double() + r.double(), w, True), "strided input")
    assert torch.equal(rv, (x.float() + r.float()).to(dtype))
    assert not xb[:, :64].any() and not xb[:, 320:].any() and not rb[:, 256:].any()


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 9728), (3, 512), (7, 18432), (2, 3, 256)], ids=str)
def test_silu_and_mul(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1] + len(shape))
    inp = (torch.randn(*shape, generator=g) * 4).to(dtype)
    inp0 = inp.clone()
    d = shape[-1] // 2
    out = torch.full(shape[:-1] + (d,), float("nan"), dtype=dtype)
    assert torch.ops.sgl_kernel.silu_and_mul.default(out, inp) is None
    a, b = inp.double()[..., :d], inp.double()[..., d:]
    # float32 output: its own exp, division and products cost up to ~1.5 ulp (measured), so 4
    ulp_check(out, a / (1.0 + torch.exp(-a)) * b, "out", ulps=4.0 if dtype == torch.float32 else 1.0)
    assert torch.equal(inp, inp0)  # only out changes


def test_fused_add_rmsnorm_takes_float32_as_its_binding_does():
    """fused_add_rmsnorm is sgl-kernel's own binding (float32/float16/bfloat16); the Gemma one is
    FlashInfer's (float16/bfloat16)."""
    x, r, w = (t.float() for t in inputs(3, 2560, torch.bfloat16))
    x0, r0 = x.clone(), r.clone()
    torch.ops.sgl_kernel.fused_add_rmsnorm(x, r, w, EPS, False)
    assert torch.equal(r, x0 + r0)
    ulp_check(x, ref_norm(x0.double() + r0.double(), w, False), "input", ulps=4.0)
    with pytest.raises(RuntimeError, match="unsupported data type torch.float32"):
        torch.ops.sgl_kernel.gemma_fused_add_rmsnorm(x, r, w, EPS, False)


def test_the_kernels_refusals_are_kept():
    x, r, w = inputs(2, 256, torch.bfloat16)
    with pytest.raises(RuntimeError, match="unsupported data type torch.float32"):
        torch.ops.sgl_kernel.rmsnorm(torch.empty(2, 256), x.float(), w.float(), EPS, False)
    with pytest.raises(RuntimeError, match="must be 2-D"):
        torch.ops.sgl_kernel.rmsnorm(torch.empty_like(x).view(2, 2, 128), x.view(2, 2, 128), w, EPS, False)
    with pytest.raises(RuntimeError, match="weight must be 1-D of hidden_size 256"):
        torch.ops.sgl_kernel.fused_add_rmsnorm(x, r, w[:128], EPS, False)
    with pytest.raises(RuntimeError, match="residual is torch.float16"):
        torch.ops.sgl_kernel.fused_add_rmsnorm(x, r.half(), w, EPS, False)
    with pytest.raises(RuntimeError, match="contiguous in its last dimension"):
        torch.ops.sgl_kernel.rmsnorm(torch.empty_like(x), x.t().contiguous().t(), w, EPS, False)
    # sgl_fused_add_rmsnorm wants whole tensors contiguous (FlashInfer's binding takes strided rows)
    wide = torch.zeros(2, 512, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fused_add_rmsnorm: input must be contiguous"):
        torch.ops.sgl_kernel.fused_add_rmsnorm(wide[:, :256], r, w, EPS, False)
    with pytest.raises(RuntimeError, match="input and out must be contiguous"):
        torch.ops.sgl_kernel.silu_and_mul(torch.empty(2, 128, dtype=torch.bfloat16), wide[:, :256])


# ---- sgl_kernel's own wrappers --------------------------------------------------------------------

_WRAPPER_RUN = r"""
import os, sys, torch
# without flashinfer, sgl_kernel's norm wrappers call torch.ops.sgl_kernel (with it, they call
# flashinfer.norm for float16/bfloat16 and these ops are not reached)
sys.modules["flashinfer"] = None
import sgl_kernel, common_ops
assert sgl_kernel.common_ops is common_ops, sgl_kernel.common_ops  # the loader fell back to the shim
assert common_ops.__file__.startswith(os.environ["SHIM"]), common_ops.__file__
g = torch.Generator().manual_seed(5)
x = torch.randn(3, 2560, generator=g).to(torch.bfloat16)
r = torch.randn(3, 2560, generator=g).to(torch.bfloat16)
w = (torch.randn(2560, generator=g) * 0.3).to(torch.bfloat16)
def direct(op, *args):
    getattr(torch.ops.sgl_kernel, op)(*args)
for name, gemma in (("rmsnorm", False), ("gemma_rmsnorm", True)):
    want = torch.empty_like(x); direct(name, want, x, w, 1e-6, False)
    got = getattr(sgl_kernel, name)(x, w, 1e-6)
    assert torch.equal(got, want), name
for name in ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm"):
    xi, ri = x.clone(), r.clone(); direct(name, xi, ri, w, 1e-6, False)
    xw, rw = x.clone(), r.clone()
    assert getattr(sgl_kernel, name)(xw, rw, w, 1e-6) is None
    assert torch.equal(xw, xi) and torch.equal(rw, ri), name
h = torch.randn(5, 2 * 9728, generator=g).to(torch.bfloat16)
want = torch.empty(5, 9728, dtype=torch.bfloat16); direct("silu_and_mul", want, h)
assert torch.equal(sgl_kernel.silu_and_mul(h), want)
print("ok", sgl_kernel.__version__)
"""


def test_sgl_kernels_wrappers_call_the_stand_ins(tmp_path):
    """sgl_kernel's package without its compiled libraries (as on the GPU machine) plus the shim: the
    loader falls back to `import common_ops`, and rmsnorm, fused_add_rmsnorm, gemma_rmsnorm,
    gemma_fused_add_rmsnorm and silu_and_mul of sgl_kernel reach the stand-ins (the call log names
    each) with the stand-ins' results."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sgl_kernel is not importable in this venv (the project .venv lacks it); "
                    "build/sglang-venvs/0.5.23/bin/python -m pytest tests/test_sgl_cuda_standin.py runs this")
    src = Path(list(spec.submodule_search_locations)[0])
    pkg = tmp_path / "site" / "sgl_kernel"
    shutil.copytree(src, pkg, ignore=lambda d, names: [n for n in names if n.endswith(".so") or n == "__pycache__"])
    log = tmp_path / "calls.log"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{SHIM}:{REPO / 'tests'}:{REPO}",
           "OPENJEV_STANDIN_CALL_LOG": str(log),
           "CUDA_VISIBLE_DEVICES": "", "SHIM": str(SHIM)}
    proc = subprocess.run([sys.executable, "-c", _WRAPPER_RUN], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().startswith("ok"), proc.stdout
    called = {line.split()[1] for line in log.read_text().splitlines()}
    assert called == set(KERNEL_SCHEMAS), called


# ---- on a GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_ops_on_cuda_tensors(dtype):
    """The CUDA registrations on CUDA tensors, against the same float64 references, and inside a
    captured CUDA graph (SGLang captures its decode forwards)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here; this runs on the GPU machine")
    for batch in BATCH:
        for hidden in (256, 2560):
            x, r, w = inputs(batch, hidden, dtype, device="cuda")
            for gemma, name in ((False, "rmsnorm"), (True, "gemma_rmsnorm")):
                out = torch.empty_like(x)
                getattr(torch.ops.sgl_kernel, name)(out, x, w, EPS, False)
                ulp_check(out.cpu(), ref_norm(x.cpu().double(), w.cpu(), gemma), name)
            for gemma, name in ((False, "fused_add_rmsnorm"), (True, "gemma_fused_add_rmsnorm")):
                xi, ri = x.clone(), r.clone()
                getattr(torch.ops.sgl_kernel, name)(xi, ri, w, EPS, True)
                s64 = x.cpu().double() + r.cpu().double()
                assert torch.equal(ri.cpu(), (x.float() + r.float()).to(dtype).cpu()), name
                ulp_check(xi.cpu(), ref_norm(s64, w.cpu(), gemma), name)
    h = (torch.randn(7, 2 * 9728, device="cuda") * 4).to(dtype)
    out = torch.empty(7, 9728, dtype=dtype, device="cuda")
    torch.ops.sgl_kernel.silu_and_mul(out, h)
    a, b = h.cpu().double()[:, :9728], h.cpu().double()[:, 9728:]
    ulp_check(out.cpu(), a / (1.0 + torch.exp(-a)) * b, "silu_and_mul")

    x, r, w = inputs(3, 2560, dtype, device="cuda")
    xs, rs, out_g = x.clone(), r.clone(), torch.empty_like(x)
    torch.ops.sgl_kernel.gemma_rmsnorm(out_g, x, w, EPS, True)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.sgl_kernel.gemma_fused_add_rmsnorm(xs, rs, w, EPS, True)
        torch.ops.sgl_kernel.gemma_rmsnorm(out_g, xs, w, EPS, True)
    xs.copy_(x)
    rs.copy_(r)
    graph.replay()
    torch.cuda.synchronize()
    want_x, want_r = x.clone(), r.clone()
    torch.ops.sgl_kernel.gemma_fused_add_rmsnorm(want_x, want_r, w, EPS, True)
    want_out = torch.empty_like(x)
    torch.ops.sgl_kernel.gemma_rmsnorm(want_out, want_x, w, EPS, True)
    assert torch.equal(xs, want_x) and torch.equal(rs, want_r) and torch.equal(out_g, want_out)
