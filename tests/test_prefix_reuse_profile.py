"""benchmarks/experiments/prefix_reuse_profile.py on the CPU: the padded path and prefix reuse over a
synthetic set of option groups, steps as the server forms them, and the sweep of the cost one more
forward is counted as, and the host profile (on a GPU the same script wrote results_h100/prefix_reuse/f8f0032/)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

from conftest import REPO, run_script

SCRIPT = REPO / "benchmarks" / "experiments" / "prefix_reuse_profile.py"


def test_a_forward_cost_sweep_cuts_the_same_rows_into_more_or_fewer_forwards(overlay, tmp_path):
    run_script("make_synthetic_inputs.py", tmp_path / "set", "--rows", "24", "--premise-tokens", "100:260",
               "--vocab", "512", "--seed", "5", check=True)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(overlay), "--tokens",
                           str(tmp_path / "set.tokens.jsonl"), "--out", str(out), "--device", "cpu",
                           "--modes", "padded,prefix_flushed,prefix_warm", "--passes", "1", "--no-profile",
                           "--batch", "8", "--workers", "2", "--max-rows", "4", "--step-tokens", "4096",
                           "--forward-costs", "1,100000", "--host-profile"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "prefix_reuse_profile.json").read_text())
    modes = res["modes"]
    from openjev.engine.prefix import PREFIX_FORWARD_COST_TOKENS

    assert res["prefix_forward_cost_tokens"] == PREFIX_FORWARD_COST_TOKENS  # the engine's, recorded
    assert res["packed_layout"]["requested"] == "auto" and not res["packed_layout"]["used"]  # a CPU: padded
    assert set(modes) == {"padded", "prefix_flushed@1", "prefix_warm@1", "prefix_flushed@100000", "prefix_warm@100000"}
    cheap, dear = modes["prefix_flushed@1"]["passes"][-1], modes["prefix_flushed@100000"]["passes"][-1]
    # the same rows and tokens computed either way; a cheap forward buys less padding with more forwards
    assert cheap["computed_tokens"] == dear["computed_tokens"] < res["tokens"]
    assert cheap["padded_tokens"] < dear["padded_tokens"] and cheap["forwards"] > dear["forwards"]
    assert cheap["padded_tokens"] >= cheap["computed_tokens"]
    warm = modes["prefix_warm@100000"]["passes"][-1]
    assert warm["computed_tokens"] < dear["computed_tokens"]
    for name, m in modes.items():
        if name != "padded":  # against the padded path's logits: float32 rounding on the CPU
            assert m["max_abs_dp_e"] < 1e-5 and m["argmax_changes"] == 0, (name, m)
    for name in ("flushed", "warm"):  # the host's time by Python function, the steps' own code among it
        text = (out / f"host_profile_{name}.txt").read_text()
        assert res[f"host_profile_{name}"]["calls"] > 0 and "# callers of the synchronising methods" in text
        assert "(run_step)" in text and "(forward)" in text, text[:2000]
        assert (out / f"device_syncs_{name}.txt").read_text() == "# cpu: no device to wait for\n"


def test_a_malformed_forward_cost_list_is_one_line_before_any_work(tmp_path):
    for value in ("1,abc", "0", "", "4096,-1"):
        proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path / "none"), "--tokens",
                               str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "out"), "--forward-costs", value],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.splitlines()[-1] == (f"prefix_reuse_profile.py: error: argument --forward-costs: {value!r}: "
                                                "expected a comma list of positive integers, e.g. 1024,4096")
        assert not (tmp_path / "out").exists()


def test_profile_tables_sum_operator_time_by_call_site(overlay, tmp_path):
    """--stacks adds to each profile table the operators' time summed by their innermost call site in
    openjev, Transformers or fla (one line however many module instances pass through it); --trace
    writes each profiled pass's Chrome trace, gzipped, with the prefix path's phases in it."""
    run_script("make_synthetic_inputs.py", tmp_path / "set", "--rows", "8", "--premise-tokens", "100:200",
               "--vocab", "512", "--seed", "6", check=True)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(overlay), "--tokens",
                           str(tmp_path / "set.tokens.jsonl"), "--out", str(out), "--device", "cpu",
                           "--modes", "prefix_flushed", "--passes", "1", "--batch", "4", "--workers", "2",
                           "--max-rows", "4", "--step-tokens", "4096", "--stacks", "8", "--trace"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (out / "profile_prefix_flushed.txt").read_text()
    sites = text.split("# by call site", 1)[1].split("# by calling Python stack", 1)[0].splitlines()[2:]
    assert len(sites) == 8 and all(" @ " in line for line in sites), sites
    assert any("@ transformers/" in line or "@ openjev/" in line for line in sites), sites
    for name in ("flushed", "warm"):
        with gzip.open(out / f"trace_prefix_{name}.json.gz", "rt") as f:
            events = json.load(f)["traceEvents"]
        assert any(e.get("name", "").startswith("openjev.prefix.") for e in events), name
        assert not (out / f"trace_prefix_{name}.json").exists()
