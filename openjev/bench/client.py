"""The bench's /classify client: one request per batch, retries with backoff, one pass over the set."""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from openjev.bench.agreement import agreement, audit_pass
from openjev.bench.inputs import RunData
from openjev.common import LABELS, entailment_prob, utc_now


def add_pass_args(p, help_prefix: str = "") -> None:
    """The flags that shape a bench's passes (the bench's own; the tuner passes them through)."""
    p.add_argument("--batch-size", type=int, default=32, help=f"{help_prefix}rows per /classify request (default: 32)")
    p.add_argument("--workers", type=int, default=4, help=f"{help_prefix}concurrent client threads (default: 4)")
    p.add_argument("--repetitions", type=int, default=3,
                   help=f"{help_prefix}measured passes after the initial (warmup) pass; the median is reported (default: 3)")
    p.add_argument("--truncate", type=int, default=4096,
                   help=f"{help_prefix}keep the first N ids of each row; must equal the reference's (default: 4096)")


def backoff_s(attempt: int) -> float:
    """Sleep before retry number `attempt` (0-based): 0.25, 0.5, 1, 2, 2, ... seconds."""
    return min(0.25 * (2 ** attempt), 2.0)


class ServerFailure(Exception):
    """The server did not answer usefully after the bounded retries (or refused with a 4xx)."""


class Client:
    """One requests.Session per worker thread (keep-alive), bounded retries with a short backoff."""

    def __init__(self, url: str, timeout: float, retries: int):
        import requests

        self.requests = requests
        self.base = url.rstrip("/")
        self.timeout, self.retries = timeout, retries
        self._local = threading.local()
        self.retried = 0
        self._lock = threading.Lock()

    def session(self):
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = self.requests.Session()
        return s

    def request(self, method: str, path: str, body: bytes | None = None, retry: bool = True):
        """Returns (response, t_first_send, t_last_recv, retries). Raises ServerFailure."""
        attempts = (self.retries if retry else 0) + 1
        t_first, last_err = None, None
        for attempt in range(attempts):
            if attempt:
                with self._lock:
                    self.retried += 1
                time.sleep(backoff_s(attempt - 1))
            t_send = time.perf_counter()
            t_first = t_first if t_first is not None else t_send
            try:
                resp = self.session().request(method, self.base + path, data=body, timeout=self.timeout,
                                              headers={"Content-Type": "application/json"} if body else None)
                _ = resp.content
            except self.requests.RequestException as exc:
                last_err = f"{method} {self.base}{path}: {_describe_request_error(exc)}"
                self._local.session = None  # a broken connection: start a fresh session
                continue
            t_recv = time.perf_counter()
            if resp.status_code >= 500:
                last_err = f"{method} {path} answered {resp.status_code}: {_error_message(resp)}"
                continue
            if resp.status_code >= 400:
                raise ServerFailure(f"{method} {path} was refused with {resp.status_code}: {_error_message(resp)}")
            return resp, t_first, t_recv, attempt
        raise ServerFailure(f"{last_err} (after {attempts} attempt{'s' if attempts > 1 else ''})")

    def get_json(self, path: str, retry: bool = True) -> dict:
        resp, *_ = self.request("GET", path, retry=retry)
        try:
            return resp.json()
        except ValueError:
            raise ServerFailure(f"GET {path} did not answer JSON") from None

    def classify(self, body: bytes, n_rows: int) -> tuple[np.ndarray, float, float, int, str | None]:
        resp, t_send, t_recv, retries = self.request("POST", "/classify", body)
        try:
            data = json.loads(resp.content)
            logits = np.asarray(data["logits"], dtype=np.float32)
        except (ValueError, KeyError, TypeError) as exc:
            raise ServerFailure(f"POST /classify answered an unreadable body: {exc}") from None
        if data.get("labels") != list(LABELS):
            raise ServerFailure(f"server label order {data.get('labels')} is not {list(LABELS)}")
        if logits.shape != (n_rows, 3):
            raise ServerFailure(f"POST /classify answered logits of shape {list(logits.shape)} for {n_rows} rows")
        if not np.isfinite(logits).all():
            raise ServerFailure("POST /classify answered non-finite logits (NaN or infinity); nothing to compare")
        return logits, t_send, t_recv, retries, data.get("model")


def _describe_request_error(exc: Exception) -> str:
    """A short cause for a requests exception: the innermost OSError ("[Errno 111] Connection refused")."""
    import requests

    seen, todo, cause = set(), [exc], None
    while todo:
        e = todo.pop()
        if id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            cause = f"[Errno {e.errno}] {e.strerror}"
        todo += [a for a in e.args if isinstance(a, BaseException)] + [e.__cause__, e.__context__]
        if hasattr(e, "reason"):
            todo.append(getattr(e, "reason"))
    kind = ("timed out" if isinstance(exc, requests.Timeout) else
            "cannot connect" if isinstance(exc, requests.ConnectionError) else type(exc).__name__)
    if cause:
        return f"{kind} ({cause})"
    text = " ".join(str(exc).split())
    return f"{kind} ({text[:160]}{'...' if len(text) > 160 else ''})"


def _error_message(resp) -> str:
    try:
        return str(resp.json()["error"]["message"])[:300]
    except Exception:  # noqa: BLE001
        return (resp.text or "")[:300].strip() or "(empty body)"


@dataclass
class PassResult:
    index: int
    kind: str                         # "initial" | "measured"
    started_at: str
    batches: int
    logits: np.ndarray | None = None  # None when the pass did not finish
    wall_s: float | None = None
    latencies_s: list = field(default_factory=list)  # per batch, in batch order (None: not answered)
    client_cpu_s: float | None = None
    retries: int = 0
    flush: dict | None = None
    error: str | None = None
    model: str | None = None


def run_pass(client: Client, pool: ThreadPoolExecutor, bodies: list[bytes], offsets: list[tuple[int, int]],
             n_rows: int, index: int, kind: str, label: str) -> PassResult:
    from tqdm import tqdm

    res = PassResult(index, kind, utc_now(), len(bodies), latencies_s=[None] * len(bodies))
    logits = np.full((n_rows, 3), np.nan, dtype=np.float32)
    sends, recvs = [], []
    cpu0 = time.process_time()
    futures = {pool.submit(client.classify, body, hi - lo): b for b, (body, (lo, hi)) in enumerate(zip(bodies, offsets))}
    pending = set(futures)
    with tqdm(total=len(bodies), unit="batch", desc=label, disable=None, file=sys.stderr, leave=False) as bar:
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    b = futures[fut]
                    out, t_send, t_recv, retries, model = fut.result()
                    lo, hi = offsets[b]
                    logits[lo:hi] = out
                    res.latencies_s[b] = t_recv - t_send
                    res.retries += retries
                    res.model = res.model or model
                    sends.append(t_send)
                    recvs.append(t_recv)
                    bar.update(1)
        except ServerFailure as exc:
            res.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - an unexpected client failure still ends in a receipt
            res.error = f"client error: {type(exc).__name__}: {exc}"
        finally:
            for fut in pending:
                fut.cancel()
    res.client_cpu_s = time.process_time() - cpu0
    if res.error is None:
        res.logits = logits
        res.wall_s = max(recvs) - min(sends)
    return res


def pass_entry(p: PassResult, data: RunData, ref_pe: np.ndarray, groups) -> dict:
    entry = {"index": p.index, "kind": p.kind, "started_at": p.started_at, "complete": p.logits is not None,
             "flush_cache": p.flush, "batches": p.batches, "rows": len(data.row_ids),
             "wall_s": p.wall_s, "batch_latencies_s": p.latencies_s,
             "client_cpu_s": p.client_cpu_s,
             "client_overhead_fraction": (p.client_cpu_s / p.wall_s) if p.wall_s else None,
             "retries": p.retries, "error": p.error, "agreement": None, "audit": None}
    if p.logits is not None:
        ag = agreement(p.logits, data.reference, data.row_ids)
        entry["agreement"] = ag
        entry["audit"] = audit_pass(groups, ref_pe, entailment_prob(p.logits), data.row_ids)
    return entry
