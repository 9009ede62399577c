"""bench_classify_v100.py interrupted, against the real embedded backend on 127.0.0.1 (no mocks): a server
down at the start, a server killed mid-run, SIGTERM mid-run, and a loopback front that dies at an exact
request or signals the bench between passes: what the receipt and the error line count and name.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import requests
from _bench_classify_support import BENCH, TRUNCATE, receipt_of, run_bench, server_info, validate
from _bench_classify_support import mini  # noqa: F401 - fixture
from conftest import APP, PY, REPO, error_lines, free_port, start_server


def test_server_down_at_start_writes_an_incomplete_receipt(mini, tmp_path):
    out = tmp_path / "down.json"
    # an earlier run's files at OUT: --overwrite replaces the receipt and removes the stale arrays
    out.write_text("{}")
    out.with_name("down.candidate.npy").write_bytes(b"stale")
    out.with_name("down.passes.npy").write_bytes(b"stale")
    port = free_port()
    proc = run_bench(f"http://127.0.0.1:{port}", mini, out, "--retries", 1, "--overwrite")
    assert proc.returncode == 4
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "unreachable" in lines[0] and "Connection refused" in lines[0]
    r = receipt_of(out)
    assert r["complete"] is False and r["valid"] is False and r["exit_code"] == 4
    assert r["warm"]["passes_done"] == 0 and r["outputs"] == {"candidate": None, "passes": None}
    assert not out.with_name("down.candidate.npy").exists() and not out.with_name("down.passes.npy").exists()
    assert validate(out).returncode == 0


def test_server_dying_mid_run_keeps_the_passes_done(overlay, mini, tmp_path):
    srv = start_server(overlay, tmp_path / "dying.log")
    out = tmp_path / "dying.json"
    per_pass = 4  # 12 rows in batches of 3
    try:
        base = server_info(srv.url)["counters"]["requests"]
        cmd = [PY, str(APP / BENCH), "--url", srv.url, "--inputs", mini["inputs"], "--tokens", mini["tokens"],
               "--reference", mini["reference"], "--out", out, "--truncate", TRUNCATE, "--batch-size", 3,
               "--workers", 2, "--repetitions", 200, "--retries", 1]
        bench_proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=REPO)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # watch the server's own counter: kill it inside the measured passes
            if server_info(srv.url)["counters"]["requests"] - base >= 2 * per_pass + 1:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the bench made no progress")
        srv.proc.send_signal(signal.SIGKILL)
        stdout, stderr = bench_proc.communicate(timeout=120)
    finally:
        srv.stop()
    assert bench_proc.returncode == 4, stderr
    assert "stopped" in error_lines(stderr)[0]
    r = receipt_of(out)
    sec = r["warm"]
    assert r["complete"] is False and r["valid"] is False and r["exit_code"] == 4
    assert 2 <= sec["passes_done"] < sec["passes_planned"] == 201
    assert sec["passes"][-1]["complete"] is False and sec["passes"][-1]["error"]
    assert sec["timing"]["measured_passes"] == sec["passes_done"] - 1
    passes = np.load(out.with_name("dying.passes.npy"))
    assert passes.shape == (sec["passes_done"], 12, 3)
    assert np.array_equal(np.load(out.with_name("dying.candidate.npy")), passes[-1])
    assert validate(out).returncode == 0


def test_sigterm_mid_run_writes_a_partial_receipt(server, mini, tmp_path):
    """The tuner stops an overlong bench with SIGTERM: the passes done are kept, the run is incomplete."""
    out = tmp_path / "term.json"
    base = server_info(server.url)["counters"]["requests"]
    cmd = [PY, str(APP / BENCH), "--url", server.url, "--inputs", mini["inputs"], "--tokens", mini["tokens"],
           "--reference", mini["reference"], "--out", out, "--truncate", TRUNCATE, "--batch-size", 12,
           "--repetitions", 500]
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.monotonic() + 120
    while server_info(server.url)["counters"]["requests"] - base < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 4, stderr
    assert "interrupted" in error_lines(stderr)[0]
    r = receipt_of(out)
    assert r["complete"] is False and r["exit_code"] == 4 and r["warm"]["passes_done"] >= 2
    assert np.load(out.with_name("term.passes.npy")).shape[0] == r["warm"]["passes_done"]


# ---------------------------------------------------------------- interruptions: numbering and counts
class DyingFront:
    """A loopback HTTP front of the real embedded server, for interruptions at an exact point of the run.

    Every request is forwarded to the server; at the `die_at`-th POST /classify the front dies like a killed
    server (that request gets no answer, the listening socket closes: later connections are refused). At the
    k-th POST /flush_cache, `on_flush(k)` runs before the request is forwarded (the bench is between passes
    then: the flush comes before each pass with --cold-cache)."""

    def __init__(self, upstream: str, die_at: int | None = None, on_flush=None):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        front = self
        self.upstream, self.die_at, self.on_flush = upstream, die_at, on_flush
        self.classify = self.flushes = 0
        self.dead = False
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _forward(self, method: str):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with front.lock:
                    if not front.dead and method == "POST" and self.path == "/classify":
                        front.classify += 1
                        front.dead = front.classify == front.die_at
                        if front.dead:
                            threading.Thread(target=front.close, daemon=True).start()
                    if method == "POST" and self.path == "/flush_cache":
                        front.flushes += 1
                        if front.on_flush:
                            front.on_flush(front.flushes)
                    dead = front.dead
                if dead:
                    self.close_connection = True
                    return
                r = requests.request(method, front.upstream + self.path, data=body or None, timeout=60,
                                     headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.closed = False

    def close(self):
        if not self.closed:
            self.closed = True
            self.httpd.shutdown()
            self.httpd.server_close()


def run_interrupted_bench(front, mini, out, *extra) -> tuple[subprocess.Popen, str, str]:
    """3 passes (1 initial + 2 measured) of 4 requests each, one worker: request n belongs to pass (n-1)//4 + 1."""
    cmd = [PY, str(APP / BENCH), "--url", front.url, "--inputs", mini["inputs"], "--tokens", mini["tokens"],
           "--reference", mini["reference"], "--out", out, "--truncate", TRUNCATE, "--batch-size", 3, "--workers", 1,
           "--repetitions", 2, "--retries", 1, *extra]
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    front.bench = proc
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        front.close()
    return proc, stdout, stderr


@pytest.mark.parametrize("die_at,stopped,done,measured", [
    (1, "pass 1/3 (initial) stopped", 0, 0),         # the server dies in the initial pass
    (5, "pass 2/3 (measured 1/2) stopped", 1, 0),    # ... in the first measured pass
    (9, "pass 3/3 (measured 2/2) stopped", 2, 1),    # ... in the last pass (the measured defect)
])
def test_server_death_names_the_pass_that_ran_and_counts_what_completed(server, mini, tmp_path, die_at, stopped,
                                                                         done, measured):
    front = DyingFront(server.url, die_at=die_at)
    out = tmp_path / "died.json"
    proc, stdout, stderr = run_interrupted_bench(front, mini, out)
    assert proc.returncode == 4, stderr
    line = error_lines(stderr)[0]
    counts = f"{done}/3 done ({min(done, 1)} initial + {measured} of 2 measured)"
    assert stopped in line and f"passes {counts}" in line, line
    progress = [l.split(":")[0] for l in stderr.splitlines() if l.startswith("warm pass ")]
    assert progress == ["warm pass 1/3 (initial)", "warm pass 2/3 (measured 1/2)"][:done]
    if done:
        assert any(l.split() == ["passes", *counts.split()] for l in stdout.splitlines()), stdout
    r = receipt_of(out)
    assert (r["warm"]["passes_done"], r["warm"]["measured_passes_done"]) == (done, measured)
    assert r["warm"]["timing"]["measured_passes"] == measured
    assert validate(out).returncode == 0


@pytest.mark.parametrize("at_flush,before,done,measured", [
    (2, "before pass 2/3 (measured 1/2)", 1, 0),
    (3, "before pass 3/3 (measured 2/2)", 2, 1),
])
def test_sigterm_between_passes_names_the_next_pass_and_counts_what_completed(server, mini, tmp_path, at_flush, before,
                                                                               done, measured):
    front = DyingFront(server.url)
    front.on_flush = lambda k: k == at_flush and front.bench.send_signal(signal.SIGTERM)
    out = tmp_path / "term.json"
    proc, stdout, stderr = run_interrupted_bench(front, mini, out, "--cold-cache")
    assert proc.returncode == 4, stderr
    line = error_lines(stderr)[0]
    counts = f"{done}/3 done (1 initial + {measured} of 2 measured)"
    assert f"interrupted (SIGTERM) {before}; passes {counts}" in line, line
    assert f"{counts}" in stdout
    r = receipt_of(out)
    assert (r["cold"]["passes_done"], r["cold"]["measured_passes_done"]) == (done, measured)
    assert validate(out).returncode == 0
