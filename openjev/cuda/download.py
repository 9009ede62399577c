"""Downloads of the manifest and the archives: resumable (HTTP Range), size- and sha256-checked, with progress."""

from __future__ import annotations

import http.client
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterator

import requests
import urllib3

from openjev.common import UserError, sha256_file
from openjev.cuda.manifest import MANIFEST_MAX_BYTES, ComponentPlan

CHUNK = 1 << 20


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class Console:
    """Per-component lines on stdout; tqdm bars on stderr only when it is a terminal."""

    def __init__(self, quiet: bool):
        self.bars = not quiet and sys.stderr.isatty()

    @staticmethod
    def line(text: str) -> None:
        print(text, flush=True)

    def bar(self, desc: str, total: int, initial: int):
        from tqdm import tqdm  # only a terminal run draws bars; keeps --help and cron runs light

        return tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                    file=sys.stderr, leave=False, disable=not self.bars, dynamic_ncols=True)


class Interrupted(Exception):
    """A transfer that stopped early; the .part file keeps what arrived."""


def new_session() -> requests.Session:
    session = requests.Session()
    session.headers.update({"User-Agent": "openjev-prepare-v100-cuda/1", "Accept-Encoding": "identity"})
    return session


def fetch_manifest(session: requests.Session, url: str, timeout: float) -> bytes:
    try:
        with session.get(url, stream=True, timeout=timeout) as resp:
            if resp.status_code != 200:
                raise UserError(f"cannot fetch manifest {url}: HTTP {resp.status_code}")
            data = bytearray()
            for chunk in resp.iter_content(chunk_size=65536):
                data += chunk
                if len(data) > MANIFEST_MAX_BYTES:
                    raise UserError(f"manifest {url} is larger than {format_bytes(MANIFEST_MAX_BYTES)}; refusing it")
            return bytes(data)
    except requests.RequestException as exc:
        raise UserError(f"cannot fetch manifest {url}: {one_line(exc)}") from None


def _content_range_start(header: str | None) -> tuple[int, int | None] | None:
    m = re.match(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", header or "")
    if not m:
        return None
    return int(m.group(1)), (None if m.group(3) == "*" else int(m.group(3)))


def iter_body(resp: requests.Response) -> Iterator[bytes]:
    """Body bytes as they arrive, undecoded.

    urllib3's read1() hands over every byte received before a connection drops; read(amt), which
    iter_content uses, holds back the partial last chunk, which a resume would then fetch again.
    """
    read1 = getattr(resp.raw, "read1", None)
    if read1 is None:  # urllib3 < 2.3
        yield from resp.iter_content(chunk_size=64 * 1024)
        return
    while chunk := read1(CHUNK, decode_content=False):
        yield chunk


_TRANSFER_ERRORS = (requests.RequestException, urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)


def transfer_reason(exc: BaseException) -> str:
    """A short cause for a broken transfer (urllib3's messages nest the whole exception chain)."""
    if isinstance(exc, (urllib3.exceptions.ReadTimeoutError, requests.Timeout, TimeoutError)):
        return "read timed out"
    if isinstance(exc, (urllib3.exceptions.ProtocolError, requests.exceptions.ChunkedEncodingError,
                        http.client.IncompleteRead, ConnectionError)):
        return "connection broken"
    return one_line(exc)


def transfer(session: requests.Session, plan: ComponentPlan, part: Path, timeout: float,
             console: Console) -> tuple[int, bool]:
    """One HTTP attempt that appends to `part`. Returns (bytes now in part, whether it resumed).

    Raises Interrupted for a dropped or short transfer (retryable), UserError for anything else.
    """
    offset = part.stat().st_size if part.exists() else 0
    if offset > plan.size:
        part.unlink()
        offset = 0
    if offset == plan.size:
        return offset, False
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    try:
        resp = session.get(plan.url, stream=True, timeout=timeout, headers=headers)
    except requests.RequestException as exc:
        raise Interrupted(f"cannot reach {plan.url}: {one_line(exc)}") from None
    with resp:
        if offset and resp.status_code == 416:
            part.unlink()  # the server cannot serve our .part's continuation: start from byte 0
            console.line(f"      {plan.name}: server refused to resume (HTTP 416); restarting from byte 0")
            return transfer(session, plan, part, timeout, console)
        if offset and resp.status_code == 206:
            cr = _content_range_start(resp.headers.get("Content-Range"))
            if cr is None or cr[0] != offset:
                raise UserError(f"{plan.url}: server answered a resume from byte {offset} with "
                                f"Content-Range {resp.headers.get('Content-Range')!r}")
            if cr[1] is not None and cr[1] != plan.size:
                raise UserError(f"{plan.url}: server has {cr[1]} bytes, the manifest says {plan.size}")
            mode, resumed = "ab", True
        elif resp.status_code == 200:
            if offset:
                console.line(f"      {plan.name}: server ignored the Range request; restarting from byte 0")
            offset, mode, resumed = 0, "wb", False
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) != plan.size:
                raise UserError(f"{plan.url}: server announces {length} bytes, the manifest says {plan.size}")
        elif 500 <= resp.status_code < 600:
            raise Interrupted(f"{plan.url}: HTTP {resp.status_code}")
        else:
            raise UserError(f"cannot download {plan.url}: HTTP {resp.status_code}")

        written = 0
        bar = console.bar(plan.name, plan.size, offset)
        try:
            with open(part, mode) as f:
                chunks = iter_body(resp)
                try:
                    while True:
                        try:
                            chunk = next(chunks, b"")
                        except _TRANSFER_ERRORS as exc:
                            raise Interrupted(f"download of {plan.filename} broke off after "
                                              f"{format_bytes(offset + written)} of {format_bytes(plan.size)} "
                                              f"({transfer_reason(exc)})") from None
                        if not chunk:
                            break
                        if offset + written + len(chunk) > plan.size:
                            f.close()
                            part.unlink()
                            raise UserError(f"{plan.url}: server sent more than the manifest's {plan.size} bytes; "
                                            "the partial file was deleted")
                        f.write(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
                finally:
                    if not f.closed:
                        f.flush()
                        os.fsync(f.fileno())
        finally:
            bar.close()
    total = offset + written
    if total < plan.size:
        raise Interrupted(f"download of {plan.filename} stopped after {format_bytes(total)} of "
                          f"{format_bytes(plan.size)} (the server closed the transfer early)")
    return total, resumed


def download_component(session: requests.Session, plan: ComponentPlan, download_dir: Path, index: str,
                       retries: int, timeout: float, console: Console) -> Path:
    """Reuse a verified archive, or download/resume it; verify its sha256 before returning it."""
    final = download_dir / plan.filename
    part = download_dir / (plan.filename + ".part")
    if final.exists():
        if final.stat().st_size == plan.size and sha256_file(final) == plan.sha256:
            console.line(f"{index} {plan.name} {plan.version}: reusing verified download "
                         f"({format_bytes(plan.size)}, sha256 ok)")
            return final
        console.line(f"{index} {plan.name}: the earlier download failed re-verification; deleting it")
        final.unlink()
    start_offset = part.stat().st_size if part.exists() else 0
    resumed_any = False
    attempt = 0
    while True:
        try:
            _, resumed = transfer(session, plan, part, timeout, console)
            resumed_any = resumed_any or resumed
            break
        except Interrupted as exc:
            have = part.stat().st_size if part.exists() else 0
            if attempt >= retries:
                hint = f"re-run to resume from {part.name}" if have else "re-run to try again"
                raise UserError(f"{exc}; {hint}") from None
            attempt += 1
            console.line(f"      {plan.name}: {exc}; retry {attempt}/{retries} from byte {have}")
            time.sleep(min(0.5 * attempt, 5.0))
    os.replace(part, final)
    actual = sha256_file(final)
    if actual != plan.sha256:
        final.unlink()
        raise UserError(f"{plan.name}: sha256 mismatch for {plan.filename} (expected {plan.sha256}, "
                        f"got {actual}); the bad download was deleted")
    how = f"resumed from {format_bytes(start_offset)}" if resumed_any and start_offset else "downloaded"
    console.line(f"{index} {plan.name} {plan.version}: {format_bytes(plan.size)} {how}, sha256 ok")
    return final
