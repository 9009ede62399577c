"""What the production-deployment tests share (tests/test_deployment_*.py): the tools they need, the
installer (deploy/install_units.sh), HAProxy's runtime API, and a checked /classify load.

Everything runs as real processes on 127.0.0.1; nothing is mocked. The units and haproxy.cfg
are rendered by deploy/install_units.sh exactly as on eva01, except for stand-in ports (never
31000) and the embedded Transformers backend (`--backend transformers`, tiny model, CPU).

What plays the part of systemd (PID 1 is not systemd here):
  * systemd-socket-activate (Debian package systemd): the activation test. It binds the socket,
    waits for the first connection and execs the gateway with LISTEN_FDS=1 on fd 3, exactly the
    protocol of a socket unit. It exits with its child, so it cannot model restarts.
  * tests/openjev_testsupport/unit_runner.py: everything else. It reads the rendered unit files and runs them as
    systemd does: it binds the socket unit's ListenStream and holds it for its whole life (as
    PID 1 does across service restarts), passes it as fd 3 with LISTEN_FDS/LISTEN_PID, waits for
    READY=1 over NOTIFY_SOCKET (Type=notify), stops with KillSignal= to the main PID
    (KillMode=mixed) and TimeoutStopSec=, restarts per Restart=/RestartSec=, reloads with
    ExecReload=, and starts the replicas' ExecStart= (app/serve_sglang_v100.sh) with the unit's
    Environment=/EnvironmentFile= in a clean manager environment.
Not exercised: PID-1 systemd itself, cgroups, journald, GPUs, SGLang replicas.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from conftest import PY, REPO, token_rows

from openjev_testsupport.loopback_bench import RequestNumbers, request_rows

INSTALL = REPO / "deploy" / "install_units.sh"
LAUNCHER = REPO / "app" / "serve_sglang_v100.sh"


def _which(name: str, *fallbacks: str) -> str | None:
    found = shutil.which(name)
    return found or next((f for f in fallbacks if os.access(f, os.X_OK)), None)


HAPROXY = _which("haproxy", "/usr/sbin/haproxy")
SSA = _which("systemd-socket-activate", "/usr/bin/systemd-socket-activate")
ANALYZE = _which("systemd-analyze", "/usr/bin/systemd-analyze")

needs_haproxy = pytest.mark.skipif(
    HAPROXY is None, reason="haproxy is not installed: the gateway needs Debian's haproxy package (apt-get install -y haproxy)")
needs_ssa = pytest.mark.skipif(
    SSA is None, reason="systemd-socket-activate is not installed (Debian package systemd: apt-get install -y systemd)")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze is not installed (Debian package systemd: apt-get install -y systemd)")

CLIENTS = 8


# ---------------------------------------------------------------- helpers


def install(*args, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(INSTALL), *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"install_units.sh failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def render(base: Path, model: Path, port: int, stats_port: int, replica_base: int, *extra) -> dict:
    """Render units + haproxy.cfg with install_units.sh for the embedded backend, stand-in ports."""
    root, units, conf = base / "root", base / "units", base / "conf"
    root.mkdir(parents=True, exist_ok=True)
    install("--root", root, "--model", model, "--unit-dir", units, "--conf-dir", conf, "--gpus", "0,1",
            "--port", port, "--stats-port", stats_port, "--replica-port-base", replica_base,
            "--backend", "transformers", "--env", f"OPENJEV_PYTHON={PY}", "--env", "OMP_NUM_THREADS=1",
            "--no-verify", *extra)
    return {"root": root, "units": units, "conf": conf, "port": port, "stats_port": stats_port,
            "replica_ports": [replica_base, replica_base + 1]}


def admin(socket_path: Path, command: str) -> str:
    """One command on HAProxy's runtime API (the unix socket of `stats socket`)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(socket_path))
        s.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def replica_stats(socket_path: Path) -> dict[str, dict]:
    """`show stat` rows of the replicas: status (UP/DOWN/DRAIN/MAINT), stot (requests), wretr, wredis..."""
    text = admin(socket_path, "show stat").lstrip("# ")
    rows = csv.DictReader(io.StringIO(text))
    return {r["svname"]: r for r in rows if r["pxname"] == "openjev" and r["svname"].startswith("replica")}


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except (OSError, requests.RequestException) as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


class Load(RequestNumbers):
    """Bounded /classify load from CLIENTS keep-alive clients; every answer checked bitwise.

    Request i carries the rows request_rows(i, n) names (1-2 rows each).
    """

    def __init__(self, url: str, rows: list[list[int]], ref: np.ndarray, n: int, clients: int = CLIENTS):
        super().__init__(n)
        self.url, self.rows, self.ref, self.clients = url, rows, ref, clients
        self.failures: list[tuple[float, int, str]] = []
        self.mismatches: list[int] = []
        self.latencies: list[float] = []
        self.by_replica: dict[str, int] = {}
        self.threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(clients)]

    def request(self, i: int) -> tuple[dict, np.ndarray]:
        idx = request_rows(i, len(self.rows))
        return {"input_ids": [self.rows[j] for j in idx]}, self.ref[idx]

    def _worker(self) -> None:
        session = requests.Session()
        while (i := self.take()) is not None:
            body, expected = self.request(i)
            t0 = time.perf_counter()
            try:
                r = session.post(f"{self.url}/classify", json=body, timeout=120)
                error = None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"
                if error is None:
                    got = np.asarray(r.json()["logits"], dtype=np.float32)
                    replica = r.headers.get("X-OpenJEV-Replica", "?")
            except requests.RequestException as exc:
                error = repr(exc)
            with self.lock:
                self.in_flight -= 1
                self.done += 1
                self.latencies.append(time.perf_counter() - t0)
                if error is not None:
                    self.failures.append((time.monotonic(), i, error))
                else:
                    self.by_replica[replica] = self.by_replica.get(replica, 0) + 1
                    if got.shape != expected.shape or not np.array_equal(got, expected):
                        self.mismatches.append(i)

    def start(self) -> "Load":
        self.t0 = time.monotonic()
        for t in self.threads:
            t.start()
        return self

    def wait_done(self, count: int, timeout: float = 300) -> None:
        wait_for(lambda: self.done >= count or not any(t.is_alive() for t in self.threads), timeout,
                 f"{count} completed requests")

    def join(self, timeout: float = 600) -> "Load":
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "load did not finish"
        self.seconds = time.monotonic() - self.t0
        return self


# ---------------------------------------------------------------- fixtures (imported by the test modules that use them)
@pytest.fixture(scope="module")
def data(sample_tokens, reference):
    _, rows = token_rows(sample_tokens)
    return rows, np.load(reference / "reference.npy")
