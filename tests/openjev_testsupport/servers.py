"""A real embedded server (app/serve_transformers.py) on 127.0.0.1 for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]  # tests/openjev_testsupport/ -> the repository
SERVE = REPO / "app" / "serve_transformers.py"


class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time (the message ends with its log's tail)."""


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def wait_healthy(srv: Server, timeout: float = 180) -> None:
    """Until GET /health is 200; a server that exits or stays unhealthy raises ServerStartError (and is stopped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise ServerStartError(f"server exited with {srv.proc.returncode}:\n{srv.log.read_text()[-2000:]}")
        try:
            if requests.get(f"{srv.url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    srv.stop()
    raise ServerStartError(f"server not healthy after {timeout} s:\n{srv.log.read_text()[-2000:]}")


def start_server(model: Path, log: Path, *extra, port: int | None = None, wait: bool = True,
                 timeout: float = 180, env: dict | None = None) -> Server:
    """serve_transformers.py MODEL PORT EXTRA..., stdout and stderr to `log`; healthy on return unless wait=False."""
    from openjev_testsupport.ports import free_port

    port = port or free_port()
    cmd = [sys.executable, str(SERVE), str(model), str(port), *map(str, extra)]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    srv = Server(proc, port, log)
    if wait:
        wait_healthy(srv, timeout)
    return srv
