"""app/_kernels.py and benchmarks/compute_bound.py: the kernel choice, its report, the FLOP count."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, error_lines, run_py

sys.path.insert(0, str(REPO / "app"))


def test_float64_recurrence_matches_transformers_gated_delta_rule():
    """The check run against fla on a GPU is only as good as its reference: it must agree with
    Transformers' own PyTorch chunked implementation (same semantics, l2-normalised q/k)."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from _kernels import naive_gated_delta

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 70, 3, 16, generator=gen) for _ in range(3))
    g = -torch.rand(2, 70, 3, generator=gen)
    beta = torch.rand(2, 70, 3, generator=gen)
    out, _ = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert float((out.double() - naive_gated_delta(q, k, v, g, beta)).abs().max()) < 1e-5
    wrong = naive_gated_delta(q, k, v, g * 0.5, beta)  # and it notices a different gate
    assert float((out.double() - wrong).abs().max()) > 1e-2


def test_cpu_load_reports_the_fallback_and_its_reason(overlay):
    proc = run_py(f"import json; from _classifier import load_classifier; "
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
# results_h200/embedded14/call12-autotune); Triton reads it when fla defines its kernels.
SET_AT_IMPORT = [
    ("CUBLAS_WORKSPACE_CONFIG", ":0:0", ":4096:8", "cublas_workspace_config", "blas", "split-K"),
    ("TRITON_CACHE_AUTOTUNING", "1", "0", "triton_cache_autotuning", "autotune", "same bits"),
]


@pytest.mark.parametrize("var,ours,theirs,key,backend,words", SET_AT_IMPORT, ids=[v[0] for v in SET_AT_IMPORT])
def test_set_at_import_unless_the_operator_chose(overlay, var, ours, theirs, key, backend, words):
    """Importing _kernels sets the variable before torch or fla can read it; an operator's value is
    kept; both are recorded in kernel_path and in the selection's backends."""
    code = ("import json, os; import _kernels; from _classifier import load_classifier; "
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
    proc = run_py(f"import json; from _classifier import load_classifier; "
                  f"print(json.dumps(load_classifier({str(overlay)!r}, 'cpu').kernels['padded_attention']))",
                  {"OPENJEV_PADDED_ATTENTION": "masked"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == "masked"


def test_unknown_kernel_mode_is_a_clear_error(overlay):
    proc = run_py(f"from _common import run_main\nfrom _classifier import load_classifier\n"
                  f"run_main(lambda: load_classifier({str(overlay)!r}, 'cpu') and 0)", {"OPENJEV_KERNELS": "fast"})
    assert proc.returncode == 1
    assert "OPENJEV_KERNELS='fast'" in proc.stderr and "auto, torch" in proc.stderr


def test_linear_flops_count_the_text_matmuls_only(overlay):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForSequenceClassification

    from _kernels import linear_weight_elements, model_flops

    model = AutoModelForSequenceClassification.from_pretrained(overlay)
    expect = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "visual" not in n)
    assert linear_weight_elements(overlay) == expect
    assert model_flops(overlay, 10) == 2.0 * expect * 10


def test_compute_bound_keeps_small_fractions_precise():
    """CI measured 0.0018 for 0.00184 (rounding to 4 decimals lost 2% of a CPU figure): the
    figures keep 4 significant digits, whatever their size."""
    from _kernels import compute_bound

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
    assert info["kernel_path"]["fused"]["reason"].startswith("device cpu")  # app/_fused.py: GPU only
