"""openjev/engine/kernels.py and benchmarks/compute_bound.py: the kernel choice, its report, the FLOP count."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, error_lines, run_py

triton_missing = None
try:
    import triton  # noqa: F401
except ImportError as exc:
    triton_missing = f"triton not importable ({exc}): it is the GPU extra; requirements.txt pins it for these tests"



def test_float64_recurrence_matches_transformers_gated_delta_rule():
    """The check run against fla on a GPU is only as good as its reference: it must agree with
    Transformers' own PyTorch chunked implementation (same semantics, l2-normalised q/k)."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from openjev.engine.kernels import naive_gated_delta

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 70, 3, 16, generator=gen) for _ in range(3))
    g = -torch.rand(2, 70, 3, generator=gen)
    beta = torch.rand(2, 70, 3, generator=gen)
    out, _ = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert float((out.double() - naive_gated_delta(q, k, v, g, beta)).abs().max()) < 1e-5
    wrong = naive_gated_delta(q, k, v, g * 0.5, beta)  # and it notices a different gate
    assert float((out.double() - wrong).abs().max()) > 1e-2


def test_cpu_load_reports_the_fallback_and_its_reason(overlay):
    proc = run_py(f"import json; from openjev.engine.classifier import load_classifier; "
                  f"print(json.dumps(load_classifier({str(overlay)!r}, 'cpu').kernels))")
    assert proc.returncode == 0, proc.stderr
    kp = json.loads(proc.stdout.splitlines()[-1])
    assert kp["gdn"] == "torch-fallback" and kp["causal_conv1d"].endswith("causal_conv1d_fn")
    assert kp["selection"]["requested"] == "auto" and "Triton GPU kernels" in kp["selection"]["reason"]
    assert "PyTorch fallback" in proc.stderr  # the reason is logged too
    assert kp["cublas_workspace_config"] == ":0:0" and kp["padded_attention"] == "rowwise"


# (variable, what importing _kernels sets, an operator's value, kernel_path key, selection.backends key,
#  words of the reason). CUBLAS_WORKSPACE_CONFIG: without a workspace cuBLAS cannot split K, which keeps
# a GEMM's rows independent of the row count (padded == exact on a GPU); torch reads it at its first
# cuBLAS call. TRITON_CACHE_AUTOTUNING: fla autotunes by timing and a different pick changes the last
# bits (the reference and the server of one H200 differed in every row,
# results_h200/embedded_gpu/call12-autotune); Triton reads it when fla defines its kernels.
SET_AT_IMPORT = [
    ("CUBLAS_WORKSPACE_CONFIG", ":0:0", ":4096:8", "cublas_workspace_config", "blas", "split-K"),
    ("TRITON_CACHE_AUTOTUNING", "1", "0", "triton_cache_autotuning", "autotune", "same bits"),
]


@pytest.mark.parametrize("var,ours,theirs,key,backend,words", SET_AT_IMPORT, ids=[v[0] for v in SET_AT_IMPORT])
def test_set_at_import_unless_the_operator_chose(overlay, var, ours, theirs, key, backend, words):
    """Importing _kernels sets the variable before torch or fla can read it; an operator's value is
    kept; both are recorded in kernel_path and in the selection's backends."""
    code = ("import json, os; from openjev.engine import kernels as _kernels; from openjev.engine.classifier import load_classifier; "
            f"k = load_classifier({str(overlay)!r}, 'cpu').kernels; "
            f"print(json.dumps([os.environ[{var!r}], k[{key!r}], k['selection']['backends'][{backend!r}]]))")
    env = {k: v for k, v in os.environ.items() if k != var}
    env["PYTHONPATH"] = f"{REPO / 'app'}:{REPO}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    env_value, recorded, record = json.loads(proc.stdout.splitlines()[-1])
    assert env_value == recorded == ours and record["set_by"] == "openjev" and words in record["reason"]
    proc = run_py(code, {var: theirs})
    assert proc.returncode == 0, proc.stderr
    env_value, recorded, record = json.loads(proc.stdout.splitlines()[-1])
    assert env_value == recorded == theirs and record == {key: theirs, "set_by": "environment"}

def test_masked_padded_attention_is_recorded(overlay):
    proc = run_py(f"import json; from openjev.engine.classifier import load_classifier; "
                  f"print(json.dumps(load_classifier({str(overlay)!r}, 'cpu').kernels['padded_attention']))",
                  {"OPENJEV_PADDED_ATTENTION": "masked"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == "masked"


def test_unknown_kernel_mode_is_a_clear_error(overlay):
    proc = run_py(f"from openjev.common import run_main\nfrom openjev.engine.classifier import load_classifier\n"
                  f"run_main(lambda: load_classifier({str(overlay)!r}, 'cpu') and 0)", {"OPENJEV_KERNELS": "fast"})
    assert proc.returncode == 1
    assert "OPENJEV_KERNELS='fast'" in proc.stderr and "auto, torch" in proc.stderr


def test_linear_flops_count_the_text_matmuls_only(overlay):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForSequenceClassification

    from openjev.engine.flops import linear_weight_elements, model_flops

    model = AutoModelForSequenceClassification.from_pretrained(overlay)
    expect = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "visual" not in n)
    assert linear_weight_elements(overlay) == expect
    assert model_flops(overlay, 10) == 2.0 * expect * 10


def test_compute_bound_keeps_small_fractions_precise():
    """CI measured 0.0018 for 0.00184 (rounding to 4 decimals lost 2% of a CPU figure): the
    figures keep 4 significant digits, whatever their size."""
    from openjev.engine.flops import compute_bound

    cb = compute_bound(0.1234567, "float32", flops=0.5 * 0.1234567e12 * 0.0183964, seconds=0.5)
    assert cb["peak_tflops"] == 0.1235 and cb["fraction_of_peak"] == 0.0184
    assert compute_bound(752.73, "float16", 2.5e14, 1.0)["fraction_of_peak"] == 0.3321
    assert compute_bound(752.73, "float16", 2.5e14, 1.0)["peak_fp16_tflops"] == 752.7


def test_compute_bound_augments_a_bench_receipt(tmp_path, overlay):
    receipt = {"kind": "openjev-bench", "tokens": {"total_ids_sent_per_pass": 1000},
               "warm": {"timing": {"median_wall_s": 0.5}},
               "server": {"info_after": {"kernel_path": {"gdn": "torch-fallback"}}}, "other": [1, 2]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(receipt))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compute_bound.py"), str(path), "--model",
                           str(overlay), "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(path.read_text())
    assert out["other"] == [1, 2] and out["kernel_path"] == {"gdn": "torch-fallback"}
    cb = out["compute_bound"]
    assert cb["timing_mode"] == "warm" and cb["pass_seconds"] == 0.5 and cb["peak_dtype"] == "float32"
    assert cb["fraction_of_peak"] == pytest.approx(cb["model_flops_per_pass"] / 0.5 / 1e12 / cb["peak_tflops"], rel=0.02)


@pytest.mark.parametrize("content,words", [
    ({"kind": "openjev-reference"}, "not a bench receipt"),
    ({"kind": "openjev-bench", "tokens": {"total_ids_sent_per_pass": 5}, "warm": None, "cold": None}, "no measured pass"),
])
def test_compute_bound_refuses_what_it_cannot_use(tmp_path, overlay, content, words):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(content))
    before = path.read_text()
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compute_bound.py"), str(path), "--model",
                           str(overlay), "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and words in error_lines(proc.stderr)[0] and path.read_text() == before


def test_server_reports_kernel_path_and_warmup(server):
    import requests

    info = requests.get(f"{server.url}/server_info", timeout=10).json()
    assert info["kernel_path"]["gdn"] == "torch-fallback" and info["kernel_path"]["attn_implementation"]
    assert info["warmup"]["forwards"] >= 2 and "skipped" in info["warmup"]["fla_shapes"]
    assert info["kernel_path"]["fused"]["reason"].startswith("device cpu")  # openjev/engine/fused.py: GPU only
    # the load's attention checks survive the warm-up's second reading of the kernel path (null on a CPU)
    assert info["kernel_path"]["padded_attention_shared_calls"] is None
    assert info["kernel_path"]["prefix_attention_varlen"] is None


# ---------------------------------------------------------------- pinned autotuner configurations
PIN_KERNELS = '''
import os
import triton, triton.language as tl

TIMES = []


def bench(fn, quantiles=None):
    """Triton's autotuner times each configuration with this: in process A later configurations
    are faster, with PINTEST_FAVOUR_FIRST=1 earlier ones."""
    fn()
    TIMES.append(1)
    t = float(len(TIMES)) if os.environ.get("PINTEST_FAVOUR_FIRST") else float(10 - len(TIMES))
    return [t, t, t]


@triton.autotune(configs=[triton.Config({"B": 16}, num_warps=1), triton.Config({"B": 32}, num_warps=2)],
                 key=["n"], do_bench=bench)
@triton.jit
def double(X, Y, n, B: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    m = o < n
    tl.store(Y + o, tl.load(X + o, mask=m) * 2, mask=m)


@triton.autotune(configs=[triton.Config({"B": 16}), triton.Config({"B": 64})], key=["n"], do_bench=bench)
@triton.jit
def triple(X, Y, n, B: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    m = o < n
    tl.store(Y + o, tl.load(X + o, mask=m) * 3, mask=m)
'''

PIN_RUN = r'''
import json, sys
from pathlib import Path
import torch, triton
import pintest_k as k
from openjev.engine import kernels as _kernels
from openjev.common import UserError


def run(fn, n):
    x = torch.randn(n)
    y = torch.empty(n)
    fn[lambda m: (triton.cdiv(n, m["B"]),)](x, y, n)
    return bool(torch.equal(y, x * (2 if fn is k.double else 3)))


try:
    rec = _kernels.pin_autotuners("pintest_k", Path(sys.argv[1]), lambda: run(k.double, 100), {"device": "test"})
except UserError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(0)
timed = len(k.TIMES)
ok = run(k.double, 333) and run(k.double, 5000)  # new keys: no tuning, the pinned configuration
run(k.triple, 50)  # not pinned (tune() never ran it): it tunes, and the record says so
print(json.dumps({"record": _kernels.pins_record(), "timed_while_pinning": timed, "timed_after": len(k.TIMES) - timed,
                  "double": [c.kwargs["B"] for c in k.double.configs], "ok": ok}))
'''


def pin_env(tmp_path, extra=None) -> dict:
    """Triton's interpreter, and app/ plus the test's kernel module (pintest_k) on the path."""
    return {"TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO / 'app'}:{tmp_path}", **(extra or {})}


@pytest.mark.skipif(triton_missing is not None, reason=triton_missing or "")
def test_autotuners_are_pinned_to_one_configuration_shared_through_a_file(tmp_path):
    """pin_autotuners on a two-configuration kernel under Triton's interpreter (timings from a
    stand-in benchmarker, since the interpreter cannot time): the first process tunes once and
    writes the file; later shapes run the pinned configuration without tuning; a second process
    whose own timing would choose the other configuration takes the file's."""
    (tmp_path / "pintest_k.py").write_text(PIN_KERNELS)
    pins = tmp_path / "cache" / "pins.json"

    def process(extra=None):
        proc = run_py(PIN_RUN, pin_env(tmp_path, extra), args=[pins])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    a = process()
    assert a["ok"] and a["double"] == [32] and a["timed_while_pinning"] == 2 and a["timed_after"] == 2
    rec = a["record"]
    assert rec["tuned_here"] and rec["pinned"] == 1 and rec["autotuners"] == 2 and rec["file"] == str(pins)
    assert rec["autotuned_unpinned"] == ["pintest_k.triple"]
    data = json.loads(pins.read_text())
    assert data["kind"] == "openjev-fla-configs" and data["device"] == "test"
    assert data["kernels"] == {"pintest_k.double": {"kwargs": {"B": 32}, "num_warps": 2, "num_stages": 3,
                                                    "num_ctas": 1, "maxnreg": None}}
    check = subprocess.run([sys.executable, str(REPO / "app" / "validate_receipts.py"), str(pins)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and "ok (openjev-fla-configs)" in check.stdout, check.stdout + check.stderr
    b = process({"PINTEST_FAVOUR_FIRST": "1"})
    assert b["double"] == [32] and b["timed_while_pinning"] == 0 and b["ok"]
    assert not b["record"]["tuned_here"] and b["record"]["sha256"] == rec["sha256"]
    assert pins.read_text() == json.dumps(data, indent=1, sort_keys=True) + "\n"  # not rewritten
    assert not list(pins.parent.glob(".*.tmp"))


@pytest.mark.skipif(triton_missing is not None, reason=triton_missing or "")
def test_a_damaged_pins_file_is_a_clear_error_and_is_kept(tmp_path):
    (tmp_path / "pintest_k.py").write_text(PIN_KERNELS)
    pins = tmp_path / "pins.json"
    for text in ("{not json", json.dumps({"kind": "something-else", "kernels": {}}),
                 json.dumps({"kind": "openjev-fla-configs", "kernels": {"pintest_k.double": {"kwargs": {}}}})):
        pins.write_text(text)
        proc = run_py(PIN_RUN, pin_env(tmp_path), args=[pins])
        assert proc.returncode == 0, proc.stderr[-3000:]
        err = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
        assert err.startswith(f"{pins}: not a pinned fla configuration file") and "OPENJEV_FLA_CONFIGS=off" in err
        assert pins.read_text() == text


def test_pins_path_from_the_environment(tmp_path):
    code = """
from openjev.engine import kernels as _kernels
print(_kernels.fla_configs_path("NVIDIA H200", "h32-k128-v128-float16"))
"""
    assert run_py(code, {"OPENJEV_FLA_CONFIGS": "off"}).stdout.strip() == "None"
    assert run_py(code, {"OPENJEV_FLA_CONFIGS": str(tmp_path / "p.json")}).stdout.strip() == str(tmp_path / "p.json")
    # the default names the GPU, the fla and Triton versions (fla: "none" where it is not installed)
    # and the head shape
    out = run_py(code, {"OPENJEV_FLA_CONFIGS": "", "XDG_CACHE_HOME": str(tmp_path)}).stdout.strip()
    fla = importlib.metadata.version("flash-linear-attention") if importlib.util.find_spec("fla") else "none"
    assert out == (f"{tmp_path}/openjev/fla-configs/NVIDIA_H200-fla{fla}-triton{importlib.metadata.version('triton')}"
                   "-h32-k128-v128-float16.json"), out


@pytest.mark.gpu
def test_fla_configs_pinned_on_a_gpu_keep_padded_forwards_bitwise_exact(overlay, tmp_path):
    """On a GPU with fla: the first process tunes fla once and writes the pins, the second reads
    them; in both, no fla kernel tunes itself for a new shape, and a padded forward whose l2norm
    key (NB) differs from the one-row forwards' gives the exact forwards' bits."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: fla's Triton kernels need a GPU (measured on an H200: "
                    "results_h200/embedded_gpu/call15-dp-cuts)")
    pytest.importorskip("fla", reason="flash-linear-attention is the GPU extra (requirements-gpu-embedded.txt)")
    code = """
import json, sys
import numpy as np
from openjev.engine.classifier import load_classifier, score_exact, score_padded
from openjev.engine.kernels import kernel_path
clf = load_classifier(sys.argv[1], device="cuda")
rows = [[(11 * i + 5 * j) % clf.vocab_size for i in range(1100 + 7 * j)] for j in range(16)]
ex, pd = score_exact(clf, rows), score_padded(clf, rows)
kp = kernel_path(clf.model)
print(json.dumps({"equal": bool(np.array_equal(ex, pd)), "rec": kp["fla_configs"], "gdn": kp["gdn"]}))
"""
    pins = tmp_path / "pins.json"
    outs = []
    for _ in range(2):
        proc = run_py(code, {"OPENJEV_FLA_CONFIGS": str(pins)}, timeout=600, args=[overlay])
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = outs
    assert first["gdn"] == "fla" and first["rec"]["tuned_here"] and first["rec"]["pinned"] > 0
    assert not second["rec"]["tuned_here"] and second["rec"]["sha256"] == first["rec"]["sha256"]
    for out in outs:
        assert out["rec"]["autotuned_unpinned"] == [] and out["equal"], out
