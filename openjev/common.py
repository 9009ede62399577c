"""Helpers shared by more than one script in app/.

Only logic that two or more scripts really share lives here: hashing, atomic writes, the
one-line error convention, the environment receipt, HF_SOURCE.json access and the loopback
port check. Every script stays runnable on its own (`python app/<script>.py --help`).
"""

from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any, NoReturn

REPO_ROOT = Path(__file__).resolve().parents[1]

HF_SOURCE_PATH = REPO_ROOT / "HF_SOURCE.json"
DEFAULT_ROOT = "~/storage/sglang-openjev-v100"
PRODUCTION_PORT = 31000
LABELS = ("contradiction", "entailment", "neutral")
ENTAILMENT = LABELS.index("entailment")


class UserError(Exception):
    """A failure the operator can act on; reported as one line on stderr, exit status 1."""


def die(message: str, code: int = 1) -> NoReturn:
    prog = Path(sys.argv[0]).name or "openjev"
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def run_main(main) -> None:
    """Run `main()` and turn UserError into the one-line stderr convention of SPEC section 1."""
    try:
        code = main()
    except UserError as exc:
        die(str(exc))
    except KeyboardInterrupt:
        die("interrupted", 130)
    except OSError as exc:  # a full disk, a read-only or missing folder: the operator's to fix, in one line
        where = f" ({exc.filename})" if exc.filename else ""
        die(f"{exc.strerror or exc}{where}")
    sys.exit(code or 0)


def openjev_root() -> Path:
    return Path(os.environ.get("OPENJEV_V100_ROOT") or DEFAULT_ROOT).expanduser()


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- hashing and atomic files
def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def softmax(logits):
    """Row-wise softmax in float64 (max-subtracted), a numpy array."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def entailment_prob(logits):
    """p_e of each row of [..., 3] logits in LABELS order."""
    return softmax(logits)[..., ENTAILMENT]


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write via a temporary file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def refuse_existing(path: str | os.PathLike, overwrite: bool = False, what: str = "output",
                    flag: str | None = "--overwrite") -> None:
    if Path(path).exists() and not overwrite:
        hint = f" (pass {flag} to replace it)" if flag else ""
        raise UserError(f"{what} {path} already exists; refusing to overwrite it{hint}")


# ---------------------------------------------------------------- pinned sources
def read_json(path: str | os.PathLike, what: str) -> Any:
    """The JSON document in path; a one-line UserError naming `what` when it is missing, unreadable or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{what} {path} not found") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{what} {path} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc}") from None


def load_sources(path: str | os.PathLike | None = None) -> dict:
    return read_json(Path(path) if path else HF_SOURCE_PATH, "pinned-source file")


def require_pin(value: str | None, what: str, allow_unpinned: bool,
                source: str | os.PathLike | None = None) -> str | None:
    """Return the pinned value, or refuse on null unless the operator passed --allow-unpinned."""
    if value is None and not allow_unpinned:
        raise UserError(
            f"{what} has no pinned sha256 in {Path(source).name if source else 'HF_SOURCE.json'} (null); "
            "refusing to use it unverified "
            "(pass --allow-unpinned to override; the override is recorded in the receipt)"
        )
    return value


# ---------------------------------------------------------------- environment receipt
def git_revision(repo: Path = REPO_ROOT) -> dict:
    from sglang_openjev.provenance import git_revision as _git_revision

    return _git_revision(repo)


def gpu_inventory() -> list[dict]:
    """GPUs as NVML reports them (name, index, driver); empty where NVML has no driver."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            gpus.append({"index": i, "name": pynvml.nvmlDeviceGetName(h), "uuid": pynvml.nvmlDeviceGetUUID(h),
                         "compute_capability": f"{major}.{minor}", "driver": driver,
                         "memory_total_bytes": pynvml.nvmlDeviceGetMemoryInfo(h).total})
        return gpus
    finally:
        pynvml.nvmlShutdown()


def environment_receipt() -> dict:
    env: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "recorded_at": utc_now(),
        "bundle_git": git_revision(),
        "openjev_v100_root": str(openjev_root()),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    for mod in ("torch", "transformers", "numpy", "sglang", "tilelang"):
        m = sys.modules.get(mod)
        env[f"{mod}_version"] = getattr(m, "__version__", None) if m else None
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch_cuda"] = getattr(torch.version, "cuda", None)
        if torch.cuda.is_available():
            env["torch_arch_list"] = torch.cuda.get_arch_list()
    env["gpus"] = gpu_inventory()
    return env


# ---------------------------------------------------------------- loopback ports
def bind_listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """Bind and listen, refusing a port that another process is already listening on.

    SO_REUSEADDR only lets us reuse TIME_WAIT ports; Linux still refuses an address that has a
    live listener, which is exactly the refusal the launcher needs.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit TCP_NODELAY: without it every keep-alive response after the first
    # waits ~40 ms for the client's delayed ACK (Nagle), measured through the gateway benchmark.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is already in use{_port_owner(port)}; refusing to start a second server there") from None
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def port_is_free(host: str, port: int) -> bool:
    try:
        bind_listen_socket(host, port, backlog=1).close()
        return True
    except UserError:
        return False


def _port_owner(port: int) -> str:
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return f" (listening process pid {conn.pid}: {psutil.Process(conn.pid).name()})"
    except Exception:  # noqa: BLE001 - owner lookup is best-effort decoration of the message
        pass
    return ""


# ---------------------------------------------------------------- input sets (docs: V100.md "Input sets")
def read_jsonl(path: str | os.PathLike, what: str = "file") -> list[dict]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{what} {path} line {n} is not valid JSON: {exc.msg}") from None
                if not isinstance(row, dict):
                    raise UserError(f"{what} {path} line {n} is not a JSON object")
                rows.append(row)
    except FileNotFoundError:
        raise UserError(f"{what} {path} not found") from None
    if not rows:
        raise UserError(f"{what} {path} is empty")
    return rows


def read_inputs(path: str | os.PathLike) -> list[dict]:
    """Input set rows {id, premise, hypothesis, instruction?, group?}, ids unique."""
    rows = read_jsonl(path, "input set")
    seen: set[str] = set()
    for n, row in enumerate(rows, 1):
        for key in ("id", "premise", "hypothesis"):
            if not isinstance(row.get(key), str) or not row[key]:
                raise UserError(f"input set {path} row {n}: '{key}' must be a non-empty string")
        for key in ("instruction", "group"):
            if key in row and row[key] is not None and not isinstance(row[key], str):
                raise UserError(f"input set {path} row {n}: '{key}' must be a string")
        if row["id"] in seen:
            raise UserError(f"input set {path} row {n}: duplicate id {row['id']!r}")
        seen.add(row["id"])
    return rows


def read_tokens(path: str | os.PathLike) -> tuple[list[str], list[list[int]]]:
    """Token file rows {id, input_ids}: returns (ids, token rows) in file order."""
    rows = read_jsonl(path, "token file")
    ids, toks = [], []
    for n, row in enumerate(rows, 1):
        tid, seq = row.get("id"), row.get("input_ids")
        if not isinstance(tid, str) or not tid:
            raise UserError(f"token file {path} row {n}: 'id' must be a non-empty string")
        if (not isinstance(seq, list) or not seq
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in seq)):
            raise UserError(f"token file {path} row {n} ({tid}): 'input_ids' must be a non-empty list of "
                            "non-negative integers")
        ids.append(tid)
        toks.append(seq)
    if len(set(ids)) != len(ids):
        raise UserError(f"token file {path} has duplicate ids")
    return ids, toks


def truncate_rows(rows: list[list[int]], limit: int) -> tuple[list[list[int]], int]:
    """Keep the first `limit` tokens of each row; returns (rows, how many were cut)."""
    cut = sum(len(r) > limit for r in rows)
    return [r[:limit] for r in rows], cut


def ids_sha256(rows: list[list[int]]) -> str:
    """Digest of exactly the token ids sent: one compact JSON list per row, newline-terminated."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps(r, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def try_exclusive_lock(path: Path) -> tuple[int | None, str]:
    """A non-blocking flock on PATH that records this process's pid in it: (fd, "") when taken,
    (None, holder pid) when another process holds it. filelock is not used here: it truncates the
    file on every attempt, so a refused run could not name the holder."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        return None, holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd, ""
