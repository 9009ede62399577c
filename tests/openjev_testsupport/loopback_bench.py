"""What the loopback CPU benchmarks share: a subprocess step with a one-line failure, the tiny model
with its tokens and reference, free ports, HAProxy (its executable, version and admin socket), the
work directory, the machine's facts, millisecond summaries, the request load of several client threads,
a keep-alive HTTP client and the result's head and writing."""

from __future__ import annotations

import contextlib
import http.client
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from openjev.common import UserError, atomic_write_json, git_revision, utc_now
from openjev_testsupport.ports import free_port

REPO = Path(__file__).resolve().parents[2]  # tests/openjev_testsupport/ -> the repository
APP = REPO / "app"
PY = sys.executable


def cpu_result_path(out: Path) -> Path:
    """--out resolved; refused under results_v100/ (V100 receipts only)."""
    out = out.resolve()
    if "results_v100" in out.parts:
        raise UserError(f"{out} is under results_v100/, which holds V100 receipts only; this is a CPU benchmark")
    return out


def find_haproxy(name: str | None) -> str:
    """--haproxy, else haproxy on PATH, else /usr/sbin/haproxy."""
    haproxy = shutil.which(name or "haproxy") or ("/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None)
    if haproxy is None:
        raise UserError("haproxy is not installed (Debian: apt-get install haproxy)")
    return haproxy


def haproxy_version(haproxy: str) -> str:
    return subprocess.run([haproxy, "-v"], capture_output=True, text=True).stdout.split()[2]


@contextlib.contextmanager
def work_dir(work: Path | None, prefix: str):
    """--work (made if missing), or a temporary directory removed on leaving."""
    if work is not None:
        work = work.resolve()
        work.mkdir(parents=True, exist_ok=True)
        yield work
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp).resolve()


def run(cmd: list, what: str) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"{what} failed ({proc.returncode}): {tail[0]}")
    return proc.stdout


def build_tiny(work: Path) -> tuple[Path, Path, Path]:
    model, tokens, ref = work / "model", work / "tokens.jsonl", work / "reference"
    if not (ref / "reference.npy").exists():
        print("building the tiny model, its tokens and reference logits ...", flush=True)
        run([PY, APP / "make_tiny_model.py", work / "checkpoint", "--processor-out", work / "processor"], "make_tiny_model")
        run([PY, APP / "prepare_v100_model.py", work / "checkpoint", model, "--processor-dir", work / "processor",
             "--allow-unpinned"], "prepare_v100_model")
        run([PY, APP / "tokenize_nli.py", "--model", model, "--inputs", REPO / "data" / "nli_sample.jsonl",
             "--out", tokens], "tokenize_nli")
        run([PY, APP / "score_reference.py", "--model", model, "--tokens", tokens, "--inputs",
             REPO / "data" / "nli_sample.jsonl", "--out", ref], "score_reference")
    return model, tokens, ref


def free_pair() -> int:
    for _ in range(200):
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
                return base
            except OSError:
                continue
    raise UserError("no two consecutive free ports on 127.0.0.1")


def admin(path: Path, command: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(command.encode() + b"\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out.decode()


def server_status(path: Path) -> dict[str, str]:
    lines = admin(path, "show stat").lstrip("# ").splitlines()
    head = lines[0].split(",")
    rows = [dict(zip(head, line.split(","))) for line in lines[1:] if line]
    return {r["svname"]: r["status"] for r in rows if r.get("pxname") == "openjev" and r["svname"].startswith("replica")}


def wait_status(path: Path, want: dict[str, str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            st = server_status(path)
            if all(st.get(k) == v for k, v in want.items()):
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise UserError(f"replicas did not reach {want} within {timeout:.0f} s")


def machine() -> dict:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"label": f"CPU machine: {cpu or platform.processor() or 'unknown CPU'}, {os.cpu_count()} logical CPUs "
                     "(no GPU; not eva01)",
            "platform": platform.platform(), "cpu_model": cpu, "cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)), "host": socket.gethostname(),
            "python": platform.python_version()}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def summary_ms(values: list[float]) -> dict:
    ms = [v * 1e3 for v in values]
    return {"n": len(ms), "p50_ms": round(pct(ms, 50), 3), "p90_ms": round(pct(ms, 90), 3),
            "p99_ms": round(pct(ms, 99), 3), "mean_ms": round(statistics.fmean(ms), 3), "max_ms": round(max(ms), 3)}


def request_rows(i: int, n_rows: int) -> list[int]:
    """The rows request i of a load carries: row k = i mod n, and for odd i also row (k + 7) mod n."""
    k = i % n_rows
    return [k] if i % 2 == 0 else [k, (k + 7) % n_rows]


class RequestNumbers:
    """Request numbers 0..n-1 that client threads take in turn; counts those in flight and done (under lock)."""

    def __init__(self, n: int):
        self.n = n
        self.lock = threading.Lock()
        self.next = self.done = self.in_flight = 0

    def take(self) -> int | None:
        """The next number (now in flight), or None when all n are taken."""
        with self.lock:
            if self.next >= self.n:
                return None
            self.next += 1
            self.in_flight += 1
            return self.next - 1


def run_clients(worker, clients: int) -> float:
    """worker() in each of `clients` threads at once; the seconds until the last one ends."""
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def result_head(kind: str, load_before: tuple, load_after: tuple, version: str) -> dict:
    """The first keys of a loopback benchmark's result: what, when, where, at which revision."""
    return {
        "kind": kind,
        "created": utc_now(),
        "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "bundle_git": git_revision(),
        "haproxy_version": version,
    }


def write_result(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    print(f"wrote {out}")


class Client:
    """HTTP/1.1 over http.client (the least client overhead in Python): one keep-alive connection, or with
    fresh=True a new connection per request (Connection: close). Answers (status, body, lower-cased headers)."""

    def __init__(self, port: int, fresh: bool = False, addr: str = "127.0.0.1"):
        self.addr, self.port, self.fresh = addr, port, fresh
        self.conn = http.client.HTTPConnection(addr, port, timeout=120)

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes, dict]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self.fresh:
            conn = http.client.HTTPConnection(self.addr, self.port, timeout=120)
            try:
                conn.request(method, path, body=body, headers={**headers, "Connection": "close"})
                r = conn.getresponse()
                return r.status, r.read(), {k.lower(): v for k, v in r.getheaders()}
            except (http.client.HTTPException, ConnectionError) as exc:
                raise UserError(f"request to {self.addr}:{self.port} failed: {exc!r}") from None
            finally:
                conn.close()
        for attempt in (0, 1):
            try:
                self.conn.request(method, path, body=body, headers=headers)
                r = self.conn.getresponse()
                return r.status, r.read(), {k.lower(): v for k, v in r.getheaders()}
            except (http.client.HTTPException, ConnectionError) as exc:
                self.conn.close()  # a keep-alive connection closed by the peer between requests: reconnect once
                self.conn = http.client.HTTPConnection(self.addr, self.port, timeout=120)
                if attempt:
                    raise UserError(f"request to {self.addr}:{self.port} failed: {exc!r}") from None
        raise AssertionError("unreachable")
