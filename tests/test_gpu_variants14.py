"""benchmarks/gpu_variants14.py on the CPU: the issue-14 variants run and are judged against the
baseline exact loop (on a GPU the same script wrote results_h200/embedded14/call5-variants/)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def variants(overlay, sample_tokens, out, names):
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_variants14.py"), "--model", str(overlay),
                           "--tokens", str(sample_tokens), "--out", str(out), "--device", "cpu", "--rows", "4",
                           "--repeats", "1", "--variants", names], capture_output=True, text=True, timeout=600)


def test_variants_agree_with_the_baseline(overlay, sample_tokens, tmp_path):
    out = tmp_path / "v"
    proc = variants(overlay, sample_tokens, out, "exact,exact_nocache,exact_async,exact_threads2,padded,padded_nocache")
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "variants.json").read_text())
    v = res["variants"]
    for name in ("exact", "exact_nocache", "exact_async", "exact_threads2"):
        assert v[name]["bitwise_equal"] and v[name]["rows_per_s"] > 0, (name, v[name])
    for name in ("padded", "padded_nocache"):
        assert v[name]["rows4"]["argmax_changes"] == 0 and v[name]["rows4"]["max_abs_dp_e"] < 1e-5
    # the cache object changes nothing in a padded forward either
    assert v["padded"]["rows4"]["max_abs_logit_diff"] == v["padded_nocache"]["rows4"]["max_abs_logit_diff"]
    assert res["kernel_path"]["gdn"] == "torch-fallback" and res["tokens"] > 0
    assert res["kind"] == "openjev-variants14" and "not a V100" in res["machine"] and res["environment"]["torch_version"]
    check = subprocess.run([sys.executable, str(REPO / "app" / "validate_receipts.py"), str(out / "variants.json")],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and "ok (openjev-variants14)" in check.stdout, check.stdout + check.stderr


def test_unknown_variants_and_a_used_output_are_refused_before_loading(overlay, sample_tokens, tmp_path):
    proc = variants(overlay, sample_tokens, tmp_path / "v", "exact,exact_threadsX,fast")
    assert proc.returncode == 2 and "unknown variant(s) exact_threadsX, fast" in proc.stderr
    assert not (tmp_path / "v").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "variants.json").write_text("{}")
    proc = variants(overlay, sample_tokens, tmp_path / "used", "exact")
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert (tmp_path / "used" / "variants.json").read_text() == "{}"
