"""benchmarks/bench_replicas_gpu.py: its math and its refusals. The whole run needs
haproxy and two replicas; it ran on the GPU machine (results_h200/two_gpu/) and, with --device
cpu, on this machine while it was written. The failover it measures is tested on CPU replicas in
tests/test_deployment_gateway.py."""

from __future__ import annotations

import subprocess
import sys

import bench_replicas_gpu as bench
import numpy as np
from conftest import REPO, error_lines

SCRIPT = REPO / "benchmarks" / "bench_replicas_gpu.py"


def test_compare_bitwise_and_with_a_probability_bound():
    ref = np.array([[0.5, 2.0, -1.0], [1.0, 0.0, 0.25]], dtype=np.float32)
    assert bench.compare(ref.copy(), ref, 0) == (True, 0.0, True)
    near = ref + np.float32(1e-4)  # every logit shifted alike: same probabilities, not bitwise
    ok, diff, bitwise = bench.compare(near, ref, 0)
    assert not ok and not bitwise and diff < 1e-6
    ok, diff, bitwise = bench.compare(near, ref, 2e-3)
    assert ok and not bitwise
    flipped = ref.copy()
    flipped[0] = [2.0, 0.5, -1.0]  # argmax changes
    assert bench.compare(flipped, ref, 0.5)[0] is False
    assert bench.compare(ref[:1], ref, 2e-3) == (False, float("inf"), False)  # wrong row count


def test_request_rows_and_placement_verdict():
    assert [bench.request_rows(i, 10) for i in range(4)] == [[0], [1, 8], [2], [3, 0]]
    assert bench.replica_placement({"replica0": [0], "replica1": [1]}, {"replica0": 0, "replica1": 1})["each_on_its_gpu_only"]
    v = bench.replica_placement({"replica0": [0], "replica1": [0, 1]}, {"replica0": 0, "replica1": 1})
    assert not v["each_on_its_gpu_only"] and v["per_replica"] == {"replica0": True, "replica1": False}


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_refuses_an_existing_receipt_a_v100_path_and_missing_inputs(tmp_path):
    model, inputs, tokens, ref = tmp_path / "m", tmp_path / "i.jsonl", tmp_path / "t.jsonl", tmp_path / "ref"
    for d in (model, ref):
        d.mkdir()
    for f in (inputs, tokens):
        f.write_text("{}\n")
    np.save(ref / "reference.npy", np.zeros((1, 3), np.float32))
    common = ["--model", model, "--inputs", inputs, "--tokens", tokens, "--reference", ref]
    out = tmp_path / "r.json"
    out.write_text("{}")
    r = _run(*common, "--out", out)
    assert r.returncode == 1 and len(error_lines(r.stderr)) == 1 and "exists" in r.stderr
    assert out.read_text() == "{}"  # untouched
    r = _run(*common, "--out", tmp_path / "results_v100" / "x.json")
    assert r.returncode == 1 and "results_v100" in r.stderr and not (tmp_path / "results_v100").exists()
    r = _run(*common[:-2], "--reference", tmp_path / "nowhere", "--out", tmp_path / "n.json")
    assert r.returncode == 1 and "--reference" in r.stderr and not (tmp_path / "n.json").exists()
    r = _run(*common, "--gpus", "0,0", "--out", tmp_path / "g.json")
    assert r.returncode == 1 and "two different GPUs" in r.stderr
