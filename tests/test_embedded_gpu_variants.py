"""benchmarks/experiments/embedded_gpu_variants.py on the CPU: the variants run and are judged against the
baseline exact loop (on a GPU the same script wrote results_h200/embedded_gpu/call5-variants/)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "experiments" / "embedded_gpu_variants.py"
KIND = "openjev-embedded-gpu-variants"


def variants(overlay, sample_tokens, out, names, *extra):
    return subprocess.run([sys.executable, str(SCRIPT), "--model", str(overlay),
                           "--tokens", str(sample_tokens), "--out", str(out), "--device", "cpu", "--rows", "4",
                           "--repeats", "1", "--variants", names, *extra], capture_output=True, text=True, timeout=600)


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
    assert res["kind"] == KIND and "not a V100" in res["machine"] and res["environment"]["torch_version"]
    assert res["made_by"] == "benchmarks/experiments/embedded_gpu_variants.py"
    check = subprocess.run([sys.executable, str(REPO / "app" / "validate_receipts.py"), str(out / "variants.json")],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and f"ok ({KIND})" in check.stdout, check.stdout + check.stderr


def test_server_cuts_and_a_profile(overlay, sample_tokens, tmp_path):
    """--grouping dp forms the forwards as the embedded server cuts a step (least padding over the
    whole set); --profile adds torch.profiler tables of one pass."""
    from openjev.common import read_tokens
    from openjev.engine.batching import length_groups

    out = tmp_path / "v"
    proc = variants(overlay, sample_tokens, out, "exact_async,padded_nocache", "--grouping", "dp", "--profile")
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "variants.json").read_text())
    entry = res["variants"]["padded_nocache"]
    _, rows = read_tokens(sample_tokens)
    assert res["grouping"] == "dp" and entry["rows4"]["forwards"] == len(length_groups([len(r) for r in rows], 4))
    assert entry["rows4"]["max_abs_dp_e"] < 1e-5 and entry["rows4"]["argmax_changes"] == 0
    assert entry["profile"]["rows"] == 4 and entry["profile"]["events"] > 0
    assert entry["profile"]["host_syncs_in_one_forward"] is None  # counted on a GPU only
    assert "self CPU" in (out / "profile_padded_nocache.txt").read_text()


def test_unknown_variants_and_a_used_output_are_refused_before_loading(overlay, sample_tokens, tmp_path):
    proc = variants(overlay, sample_tokens, tmp_path / "v", "exact,exact_threadsX,fast")
    assert proc.returncode == 2 and "unknown variant(s) exact_threadsX, fast" in proc.stderr
    assert not (tmp_path / "v").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "variants.json").write_text("{}")
    proc = variants(overlay, sample_tokens, tmp_path / "used", "exact")
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert (tmp_path / "used" / "variants.json").read_text() == "{}"


def test_receipts_recorded_under_the_old_kind_still_validate():
    """Receipts written before the script's rename keep the kind they were written with; the schema
    accepts it beside the new one."""
    schema = json.loads((REPO / "results_v100" / "schemas" / "embedded_gpu_variants.schema.json").read_text())
    kinds = schema["properties"]["kind"]["enum"]
    recorded = [REPO / "benchmarks" / "results_cpu" / "embedded_cpu" / "variants_tiny_cpu.json",
                REPO / "results_h200" / "embedded_gpu" / "call17-one-pass-variance" / "variants" / "variants.json"]
    old = {json.loads(p.read_text())["kind"] for p in recorded}
    assert kinds[0] == KIND and len(old) == 1 and old < set(kinds) and KIND not in old
    check = subprocess.run([sys.executable, str(REPO / "app" / "validate_receipts.py"), *map(str, recorded)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and check.stdout.count(f"ok ({old.pop()})") == 2, check.stdout + check.stderr
