"""The GPU-exclusivity decision of bench_classify_v100.py (`openjev/gpu.py`) on real local processes: the
allowed set (the server and its descendants), a competitor, a reused PID, a vanished server, the
monitor's recorded evidence, and NVML's sampling of a real GPU where there is one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from _bench_classify_support import NVML, NVML_WHY
from conftest import PY

from openjev import gpu as gpu_owner


@pytest.mark.skipif(not NVML, reason=f"needs an NVIDIA driver (pynvml.nvmlInit failed: {NVML_WHY})")
def test_nvml_monitor_samples_a_real_gpu():
    me = gpu_owner.proc_id(os.getpid())
    mon = gpu_owner.ExclusivityMonitor(0, me, 0.1)
    assert mon.gpu is not None and mon.gpu.info["name"]
    mon.start()
    time.sleep(0.5)
    pids = set(mon.gpu.pids())  # before stop(): stop() shuts NVML down
    mon.stop()
    rep = mon.report()
    assert rep["samples"] >= 3 and rep["gpu"]["uuid"]
    others = pids - {os.getpid()}
    if os.getpid() in pids:
        # an earlier test of this session made a CUDA context here (run on the H200, this test came after
        # the threaded reference test): this process is the "server", so the GPU is exclusive to it unless
        # someone else is on it
        assert rep["valid"] is (not others), rep["violations"][:2]
    else:
        # this process holds no context on GPU 0, so every sample says the "server" is not there (other
        # users of GPU 0 may be flagged too)
        assert rep["valid"] is False
        assert any("neither the server" in x for v in rep["violations"] for x in v["violations"])
    for v in rep["violations"]:  # what must never happen: a failed NVML sample
        assert not any(x.startswith("NVML sample failed") for x in v["violations"])


# ---------------------------------------------------------------- exclusivity decision on real processes
@pytest.fixture
def process_tree():
    """A server-like parent with one child, and an unrelated competitor: real processes."""
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(c.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    competitor = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    yield parent, child_pid, competitor
    for p in (parent, competitor):
        if p.poll() is None:
            p.kill()
            p.wait()
    try:
        os.kill(child_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def sample_now(server_pid: int, gpu_pids) -> gpu_owner.Sample:
    now, desc = gpu_owner.read_tree(server_pid)
    return gpu_owner.Sample(0.0, server_now=now, descendants=desc, gpu=gpu_owner.identify(gpu_pids))


def test_exclusivity_allowed_set_and_competitor(process_tree):
    parent, child_pid, competitor = process_tree
    server = gpu_owner.proc_id(parent.pid)
    child = gpu_owner.proc_id(child_pid)
    now, desc = gpu_owner.read_tree(parent.pid)
    assert now == server and child in desc
    assert gpu_owner.allowed_processes(server, now, desc) == {server, child}
    # only the server and its child on the GPU: exclusive (the child alone is enough to show the server is there)
    assert gpu_owner.sample_violations(server, sample_now(parent.pid, [parent.pid, child_pid])) == []
    assert gpu_owner.sample_violations(server, sample_now(parent.pid, [child_pid])) == []
    # nobody on the GPU, not even the server: wrong index / another device / PID namespace -> nothing is shown
    v = gpu_owner.sample_violations(server, sample_now(parent.pid, []))
    assert len(v) == 1 and "neither the server" in v[0]
    assert gpu_owner.sample_violations(server, sample_now(parent.pid, []), require_server_on_gpu=False) == []
    # a competitor appears
    v = gpu_owner.sample_violations(server, sample_now(parent.pid, [child_pid, competitor.pid]))
    assert len(v) == 1 and f"competitor pid {competitor.pid}" in v[0]
    # a GPU pid nobody can see (exited, or another PID namespace) is not given the benefit of the doubt
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    v = gpu_owner.sample_violations(server, sample_now(parent.pid, [parent.pid, dead.pid]))
    assert len(v) == 1 and "cannot be identified" in v[0]


def test_exclusivity_reused_pid_and_vanished_server(process_tree):
    parent, child_pid, _ = process_tree
    server = gpu_owner.proc_id(parent.pid)
    # the PID is live but its start time is not the one captured at start: a reused PID, not our server
    reused = (parent.pid, server[1] - 5.0)
    v = gpu_owner.sample_violations(reused, sample_now(parent.pid, [parent.pid]))
    assert len(v) == 1 and "PID was reused" in v[0]
    assert gpu_owner.allowed_processes(reused, server, set()) == frozenset()
    # the server dies
    parent.kill()
    parent.wait()
    s = sample_now(parent.pid, [])
    assert s.server_now is None
    v = gpu_owner.sample_violations(server, s)
    assert len(v) == 1 and "is gone" in v[0]
    # a failed NVML sample invalidates on its own
    assert "NVML sample failed" in gpu_owner.sample_violations(server, gpu_owner.Sample(0.0, error="boom"))[0]


class ProcessListGpu:
    """Stands in for the GPU under the monitor: reports the given real pids as its processes."""

    info = {"index": 0, "name": "stand-in", "uuid": "none", "pci_bus_id": "none", "driver": "none"}
    graphics_supported = True

    def __init__(self, pids):
        self.list = list(pids)

    def pids(self):
        return list(self.list)

    def close(self):
        pass


def test_exclusivity_monitor_records_the_evidence(process_tree):
    parent, child_pid, competitor = process_tree
    gpu = ProcessListGpu([child_pid])
    mon = gpu_owner.ExclusivityMonitor(0, gpu_owner.proc_id(parent.pid), 0.05, gpu=gpu)
    assert mon.take() == []
    mon.start()
    time.sleep(0.3)
    gpu.list.append(competitor.pid)  # a competitor arrives mid-run
    time.sleep(0.3)
    mon.stop()
    rep = mon.report()
    assert rep["valid"] is False and f"competitor pid {competitor.pid}" in rep["reason"]
    assert rep["samples"] >= 6 and 1 <= rep["violating_samples"] < rep["samples"]
    assert 1 <= len(rep["violations"]) <= 10 and rep["interval_s"] == 0.05
    seen = {p["pid"]: p["allowed"] for p in rep["gpu_processes_seen"]}
    assert seen == {child_pid: True, competitor.pid: False}
    assert rep["server"] == {"pid": parent.pid, "create_time": gpu_owner.proc_id(parent.pid)[1]}
