"""benchmarks/experiments/embedded_gpu_divergence.py on the CPU: every part runs on the tiny model and reports
what it measured (on the H200 the same script wrote results_h200/embedded_gpu/call7-divergence .. call9-rowwise)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "experiments" / "embedded_gpu_divergence.py"


def divergence(overlay, sample_tokens, out, *extra):
    return subprocess.run([sys.executable, str(SCRIPT), "--model", str(overlay),
                           "--tokens", str(sample_tokens), "--out", str(out), "--device", "cpu", "--rows", "4", *extra],
                          capture_output=True, text=True, timeout=600)


def test_every_part_reports_on_a_cpu(overlay, sample_tokens, tmp_path):
    out = tmp_path / "d"
    proc = divergence(overlay, sample_tokens, out)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "divergence.json").read_text())
    parts = res["parts"]
    assert res["kind"] == "openjev-embedded-gpu-divergence" and "not a V100" in res["machine"]
    assert res["made_by"] == "benchmarks/experiments/embedded_gpu_divergence.py"
    assert not any("error" in p for p in parts.values()), parts
    assert parts["candidates"]["exact"]["bitwise_equal"] and parts["candidates"]["padded4"]["argmax_changes"] == 0
    chain = parts["chain"]["modules"]
    assert chain[0]["module"].endswith("layers.0.input_layernorm") and chain[-1]["module"].endswith("layers.3")
    assert parts["chain"]["first_divergent"] in [m["module"] for m in chain] + [None]
    iso = {m["module"]: m for m in parts["isolated"]["default"]}
    assert any(n.endswith("layers.0.mlp.down_proj") for n in iso) and list(iso)[-1] == "score"
    assert all(m["bitwise_equal"] == (m["max_abs_diff"] == 0.0) for m in iso.values())
    assert parts["overhead"]["enqueue_ms"] > 0 and (out / "cprofile.txt").read_text().count("function calls") == 2
    truth = parts["truth"]
    assert truth["dtype"] == "float64" and set(truth["against_truth"]) == {"exact", "padded4"}
    assert truth["against_truth"]["exact"]["max_abs_dp_e"] < 1e-5  # float32 vs float64 on the tiny model
    assert (out / "exact.npy").exists() and (out / "truth_float64.npy").exists()


def test_unknown_parts_and_a_used_output_are_refused(overlay, sample_tokens, tmp_path):
    proc = divergence(overlay, sample_tokens, tmp_path / "d", "--parts", "chain,speed")
    assert proc.returncode == 2 and "unknown part(s) speed" in proc.stderr and not (tmp_path / "d").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "divergence.json").write_text("{}")
    proc = divergence(overlay, sample_tokens, tmp_path / "used")
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert (tmp_path / "used" / "divergence.json").read_text() == "{}"
