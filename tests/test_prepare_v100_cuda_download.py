"""app/prepare_v100_cuda.py's downloads against the fake release of tests/_prepare_v100_cuda_support.py with
injected faults: a corrupted archive, a truncated transfer, a resumed run (Range), SIGTERM mid-download,
a dropped connection retried, and a server without Range support.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from _http_fixtures import LoopbackHTTPServer
from _prepare_v100_cuda_support import (BIG, REPO, Release, assert_failed_one_line, assert_nothing_half_made, command,
                                        relative_path, run, top_dir, tree_entries, write_sources)
from _prepare_v100_cuda_support import pinned, release, server  # noqa: F401 - fixtures


# ---------------------------------------------------------------- downloads with injected faults
def test_corrupted_archive_fails_before_unpacking(tmp_path: Path, release: Release, server, pinned: Path):
    server.fault("/" + relative_path("cuda_cudart", "12.6.77"), corrupt=True, times=None)
    root = tmp_path / "root"
    assert_failed_one_line(run(root, server, pinned), "cuda_cudart", "sha256 mismatch",
                           "deleted")
    assert_nothing_half_made(root)
    downloads = {p.name for p in (root / ".cuda126-download").iterdir()}
    assert f"{top_dir('cuda_cudart', '12.6.77')}.tar.xz" not in downloads  # the bad file is gone
    assert not any(n.endswith(".part") for n in downloads)


def test_truncated_download_fails_cleanly(tmp_path: Path, release: Release, server, pinned: Path):
    server.fault("/" + relative_path("cuda_nvcc", "12.6.85"), cut_after=BIG // 3, times=None)
    root = tmp_path / "root"
    assert_failed_one_line(run(root, server, pinned), "cuda_nvcc", "re-run to resume")
    assert_nothing_half_made(root)


def test_interrupted_run_resumes_with_a_range_request(tmp_path: Path, release: Release, server, pinned):
    path = "/" + relative_path("cuda_nvcc", "12.6.85")
    cut = BIG // 2
    server.fault(path, cut_after=cut, times=1)
    root = tmp_path / "root"
    assert_failed_one_line(run(root, server, pinned), "re-run to resume")
    assert_nothing_half_made(root)
    part = root / ".cuda126-download" / f"{top_dir('cuda_nvcc', '12.6.85')}.tar.xz.part"
    assert part.stat().st_size == cut

    proc = run(root, server, pinned)
    assert proc.returncode == 0, proc.stderr
    assert [r.range for r in server.requests_for(path)] == [None, f"bytes={cut}-"]
    assert "resumed from" in proc.stdout
    assert tree_entries(root / "cuda126") == release.expected_files()


def test_sigterm_mid_download_stops_cleanly_and_keeps_the_part(tmp_path: Path, release: Release, server, pinned):
    server.fault("/" + relative_path("cuda_nvcc", "12.6.85"), stall_after=BIG // 2)
    root = tmp_path / "root"
    part = root / ".cuda126-download" / f"{top_dir('cuda_nvcc', '12.6.85')}.tar.xz.part"
    proc = subprocess.Popen(command(root, server, pinned), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not (part.exists() and part.stat().st_size >= BIG // 2 - 65536):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert err.strip() == "prepare_v100_cuda.py: error: interrupted"
    assert_nothing_half_made(root)
    assert part.stat().st_size == BIG // 2  # everything that arrived was kept for the resume


def test_dropped_connection_is_retried_within_one_run(tmp_path: Path, release: Release, server, pinned):
    path = "/" + relative_path("cuda_nvcc", "12.6.85")
    server.fault(path, cut_after=BIG // 2, times=1)
    root = tmp_path / "root"
    proc = run(root, server, pinned, "--retries", "1")
    assert proc.returncode == 0, proc.stderr
    assert [r.range for r in server.requests_for(path)] == [None, f"bytes={BIG // 2}-"]
    assert "retry 1/1" in proc.stdout


def test_server_without_range_support_restarts_the_download(tmp_path: Path, release: Release, pinned: Path):
    with LoopbackHTTPServer(range_support=False) as srv:
        sources = write_sources(tmp_path / "norange.json", release.publish(srv))
        path = "/" + relative_path("cuda_nvcc", "12.6.85")
        srv.fault(path, cut_after=BIG // 2, times=1)
        root = tmp_path / "root"
        assert run(root, srv, sources).returncode != 0
        proc = run(root, srv, sources)
        assert proc.returncode == 0, proc.stderr
        assert "ignored the Range request; restarting" in proc.stdout
        assert tree_entries(root / "cuda126") == release.expected_files()
