"""A real loopback HTTP server for tests (no mocks): static bytes per path, Range, injected faults.

    with LoopbackHTTPServer({"/a.bin": b"..."}) as srv:
        srv.url                      # "http://127.0.0.1:<port>/"
        srv.put("/b.json", b"{}")    # add or replace a route at any time
        srv.put("/i/", b"<html>", content_type="text/html")   # Content-Type of a route (default octet-stream)
        srv.fault("/a.bin", cut_after=100, times=1)   # next GET sends 100 body bytes, then drops
        srv.fault("/a.bin", stall_after=100)          # ... sends 100 bytes, then goes silent
        srv.requests                 # [Request(method, path, headers), ...] in arrival order
        srv.requests_for("/a.bin")

It binds 127.0.0.1 on an ephemeral port (port 0), serves from a daemon thread
(`http.server.ThreadingHTTPServer`), speaks HTTP/1.1 with Content-Length, and implements single
`Range: bytes=START-[END]` requests (206 + Content-Range, 416 when unsatisfiable) unless
`range_support=False`, in which case Range is ignored (200 with the whole body), as many servers do.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Mapping

__all__ = ["Fault", "LoopbackHTTPServer", "Request"]


@dataclasses.dataclass
class Fault:
    """A misbehaviour applied to the next `times` GETs of one path (None: every GET)."""

    cut_after: int | None = None   # announce the full Content-Length, send this many body bytes, drop
    stall_after: int | None = None  # ... send this many body bytes, then stall until stall_seconds pass
    stall_seconds: float = 30.0     #     (or the server stops), then drop
    status: int | None = None      # answer with this status and an empty body instead
    corrupt: bool = False          # flip one byte in the middle of the body (length unchanged)
    times: int | None = 1


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]

    @property
    def range(self) -> str | None:
        return self.headers.get("range")


OCTET_STREAM = "application/octet-stream"
_RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")


class LoopbackHTTPServer:
    def __init__(self, routes: Mapping[str, bytes] | None = None, *, range_support: bool = True,
                 content_types: Mapping[str, str] | None = None):
        self._routes: dict[str, bytes] = {_norm(k): v for k, v in (routes or {}).items()}
        self._types: dict[str, str] = {_norm(k): v for k, v in (content_types or {}).items()}
        self._faults: dict[str, Fault] = {}
        self._lock = threading.Lock()
        self.range_support = range_support
        self.requests: list[Request] = []
        self._server: ThreadingHTTPServer | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ configuration
    def put(self, path: str, data: bytes, content_type: str | None = None) -> None:
        with self._lock:
            self._routes[_norm(path)] = bytes(data)
            if content_type is not None:
                self._types[_norm(path)] = content_type

    def fault(self, path: str, **kwargs) -> Fault:
        f = Fault(**kwargs)
        with self._lock:
            self._faults[_norm(path)] = f
        return f

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def requests_for(self, path: str) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.path == _norm(path)]

    @property
    def url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/"

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "LoopbackHTTPServer":
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # noqa: A002 - keep test output quiet
                pass

            def do_HEAD(self):
                owner._serve(self, head=True)

            def do_GET(self):
                owner._serve(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="loopback-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "LoopbackHTTPServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ request handling
    def _take_fault(self, path: str) -> Fault | None:
        with self._lock:
            f = self._faults.get(path)
            if f is None:
                return None
            if f.times is not None:
                f.times -= 1
                if f.times <= 0:
                    del self._faults[path]
            return f

    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = _norm(h.path.split("?", 1)[0])
        with self._lock:
            self.requests.append(Request(h.command, path, {k.lower(): v for k, v in h.headers.items()}))
            body = self._routes.get(path)
            ctype = self._types.get(path, OCTET_STREAM)
        if body is None:
            return _send(h, 404, b"not found\n", head=head)
        fault = None if head else self._take_fault(path)
        if fault and fault.status is not None:
            return _send(h, fault.status, b"", head=head)
        if fault and fault.corrupt and body:
            mid = len(body) // 2
            body = body[:mid] + bytes([body[mid] ^ 0xFF]) + body[mid + 1:]

        status, headers, payload = 200, {"Accept-Ranges": "bytes" if self.range_support else "none"}, body
        rng = h.headers.get("Range")
        if rng and self.range_support:
            m = _RANGE_RE.match(rng.strip())
            if not m:
                return _send(h, 416, b"", {"Content-Range": f"bytes */{len(body)}"}, head=head)
            start = int(m.group(1))
            end = int(m.group(2)) if m.group(2) else len(body) - 1
            if start >= len(body) or end < start:
                return _send(h, 416, b"", {"Content-Range": f"bytes */{len(body)}"}, head=head)
            end = min(end, len(body) - 1)
            status, payload = 206, body[start:end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{len(body)}"

        cut = fault.cut_after if fault else None
        if fault and fault.stall_after is not None:
            cut = fault.stall_after
        if cut is not None and not head:
            # Promise the whole payload, deliver part of it, (stall,) then drop the connection.
            h.send_response(status)
            for k, v in headers.items():
                h.send_header(k, v)
            h.send_header("Content-Type", ctype)
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload[:cut])
            h.wfile.flush()
            if fault.stall_after is not None:
                self._stopping.wait(fault.stall_seconds)
            h.close_connection = True
            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        _send(h, status, payload, headers, head=head, content_type=ctype)


def _norm(path: str) -> str:
    return "/" + path.lstrip("/")


def _send(h: BaseHTTPRequestHandler, status: int, body: bytes, headers: Mapping[str, str] | None = None,
          head: bool = False, content_type: str = "application/octet-stream") -> None:
    h.send_response(status)
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.send_header("Content-Type", content_type)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if not head and body:
        h.wfile.write(body)
