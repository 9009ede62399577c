"""Who holds a GPU: NVML (nvidia-ml-py) for its processes, psutil for their identity (pid + start time).

Used by the bench's exclusivity monitor and the tuner's idle wait and process bookkeeping."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

from openjev.common import UserError, utc_now

MAX_VIOLATING_SAMPLES_KEPT = 10


ProcId = tuple  # (pid: int, create_time: float)


@dataclass(frozen=True)
class GpuProc:
    pid: int
    create_time: float | None  # None: the pid is not visible here (exited, or another PID namespace)
    name: str | None = None


@dataclass(frozen=True)
class Sample:
    t_s: float                               # seconds since the monitor started
    error: str | None = None                 # the NVML query failed
    server_now: ProcId | None = None         # (server pid, its create time now); None: gone
    descendants: frozenset = frozenset()     # {(pid, create_time)} of the server's descendants now
    gpu: tuple = ()                          # GpuProc of every process NVML lists on the GPU


def allowed_processes(server: ProcId, server_now: ProcId | None, descendants: Iterable[ProcId]) -> frozenset:
    """The server and its descendants, but only while the server is the one captured at start."""
    if server_now != server:
        return frozenset()
    return frozenset({tuple(server), *map(tuple, descendants)})


def sample_violations(server: ProcId, sample: Sample, require_server_on_gpu: bool = True) -> list[str]:
    """Everything wrong with one sample (empty: the GPU was exclusive to the server at that moment).

    With `require_server_on_gpu` (the bench's setting) the server or one of its descendants must itself
    be among the GPU's processes: a server that holds no context on the GPU means a wrong GPU index, a
    server on another device, or NVML reporting PIDs of another PID namespace (a container), and in all
    three cases an empty process list proves nothing.
    """
    if sample.error:
        return [f"NVML sample failed: {sample.error}"]
    pid, created = server
    if sample.server_now is None:
        return [f"server pid {pid} is gone"]
    if sample.server_now != tuple(server):
        return [f"server pid {pid} now has start time {sample.server_now[1]} (captured {created}): "
                "the PID was reused, the server is gone"]
    allowed = allowed_processes(server, sample.server_now, sample.descendants)
    out = []
    for g in sample.gpu:
        if g.create_time is None:
            out.append(f"pid {g.pid} on the GPU cannot be identified (exited, or in another PID namespace)")
        elif (g.pid, g.create_time) not in allowed:
            out.append(f"competitor pid {g.pid} ({g.name or '?'}) on the GPU")
    if require_server_on_gpu and not any((g.pid, g.create_time) in allowed for g in sample.gpu):
        out.append(f"neither the server (pid {pid}) nor a descendant is among the GPU's processes "
                   f"(NVML lists {sorted(g.pid for g in sample.gpu) or 'none'}): wrong --exclusive-gpu index, a "
                   "server not on this GPU, or NVML PIDs from another PID namespace; exclusivity cannot be shown")
    return out


def proc_id(pid: int) -> ProcId | None:
    """(pid, create_time) of a live, non-zombie process; None if it does not exist."""
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return (pid, p.create_time())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


def read_tree(server_pid: int) -> tuple[ProcId | None, frozenset]:
    """The server's (pid, create_time) now and its descendants' as read now (psutil)."""
    import psutil

    try:
        p = psutil.Process(server_pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None, frozenset()
        now = (server_pid, p.create_time())
        kids = p.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None, frozenset()
    desc = set()
    for k in kids:
        try:
            desc.add((k.pid, k.create_time()))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass  # exited between listing and reading: it cannot be on the GPU as one of ours
    return now, frozenset(desc)


def identify(pids: Iterable[int]) -> tuple:
    import psutil

    out = []
    for pid in sorted(set(pids)):
        try:
            p = psutil.Process(pid)
            out.append(GpuProc(pid, p.create_time(), p.name()))
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            out.append(GpuProc(pid, None, None))
    return tuple(out)


class NvmlUnavailable(Exception):
    pass


class NvmlGpu:
    """One physical GPU through NVML (nvidia-ml-py): identity and the processes holding it."""

    def __init__(self, index: int):
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from None
        self.nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML cannot start ({exc}): no NVIDIA driver here?") from None
        try:
            count = pynvml.nvmlDeviceGetCount()
            if not 0 <= index < count:
                raise UserError(f"--exclusive-gpu {index}: NVML sees {count} GPU(s) (indices 0..{count - 1})")
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.info = {"index": index, **device_info(pynvml, self.handle, strict=True)}
        except pynvml.NVMLError as exc:
            self.close()
            raise NvmlUnavailable(f"NVML cannot read GPU {index}: {exc}") from None
        except UserError:
            self.close()
            raise
        self.graphics_supported = True

    def pids(self) -> list[int]:
        nv = self.nv
        pids = [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(self.handle)]
        if self.graphics_supported:
            try:
                pids += [p.pid for p in nv.nvmlDeviceGetGraphicsRunningProcesses(self.handle)]
            except nv.NVMLError_NotSupported:
                self.graphics_supported = False  # a compute-only board: recorded, compute is still checked
        return pids

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def device_info(pynvml: Any, handle: Any, strict: bool) -> dict:
    """Name, UUID, PCI bus id and driver of one GPU; without `strict` a field NVML cannot read is left out."""
    out = {}
    for key, get in (("name", pynvml.nvmlDeviceGetName), ("uuid", pynvml.nvmlDeviceGetUUID),
                     ("pci_bus_id", lambda h: pynvml.nvmlDeviceGetPciInfo(h).busId),
                     ("driver", lambda h: pynvml.nvmlSystemGetDriverVersion())):
        try:
            out[key] = _s(get(handle))
        except pynvml.NVMLError:
            if strict:
                raise
    return out


class ExclusivityMonitor:
    """Samples the GPU's processes every `interval` seconds on a daemon thread; keeps the evidence."""

    def __init__(self, gpu_index: int, server: ProcId, interval: float, gpu=None):
        """`gpu`: anything with NvmlGpu's pids()/info/graphics_supported/close() (default: NvmlGpu(gpu_index))."""
        self.gpu_index, self.server, self.interval = gpu_index, tuple(server), interval
        self.gpu = gpu
        self.open_error: str | None = None
        if gpu is None:
            try:
                self.gpu = NvmlGpu(gpu_index)
            except NvmlUnavailable as exc:
                self.open_error = str(exc)
        self.t0 = time.monotonic()
        self.samples = 0
        self.violating = 0
        self.kept: list[dict] = []
        self.seen: dict[tuple, dict] = {}
        self.last_t: float | None = None
        self.max_gap = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> list[str]:
        """Take and record one sample; returns its violations."""
        t = time.monotonic() - self.t0
        if self.gpu is None:
            s = Sample(t, error=self.open_error)
        else:
            try:
                pids = self.gpu.pids()
                now, desc = read_tree(self.server[0])
                s = Sample(t, server_now=now, descendants=desc, gpu=identify(pids))
            except Exception as exc:  # noqa: BLE001 - any failure of a sample invalidates the run
                s = Sample(t, error=f"{type(exc).__name__}: {exc}")
        v = sample_violations(self.server, s)
        with self._lock:
            self.samples += 1
            if self.last_t is not None:
                self.max_gap = max(self.max_gap, t - self.last_t)
            self.last_t = t
            allowed = allowed_processes(self.server, s.server_now, s.descendants)
            for g in s.gpu:
                self.seen.setdefault((g.pid, g.create_time), {
                    "pid": g.pid, "name": g.name, "create_time": g.create_time,
                    "allowed": (g.pid, g.create_time) in allowed, "first_seen_s": round(t, 3)})
            if v:
                self.violating += 1
                if len(self.kept) < MAX_VIOLATING_SAMPLES_KEPT:
                    self.kept.append({"t_s": round(t, 3), "at": utc_now(), "violations": v,
                                      "gpu_processes": [vars(g) for g in s.gpu]})
        return v

    def start(self) -> None:
        def loop():
            while not self._stop.wait(self.interval):
                self.take()

        self._thread = threading.Thread(target=loop, name="exclusive-gpu-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 4 * self.interval))
            self.take()  # the last response has arrived: one more sample closes the window
        if self.gpu is not None:
            self.gpu.close()

    @property
    def valid(self) -> bool:
        with self._lock:
            return self.samples > 0 and self.violating == 0

    def report(self) -> dict:
        with self._lock:
            first = self.kept[0]["violations"][0] if self.kept else None
            return {
                "gpu_index": self.gpu_index,
                "gpu": self.gpu.info if self.gpu else None,
                "graphics_process_query": (None if self.gpu is None
                                           else "ok" if self.gpu.graphics_supported else "not supported"),
                "server": {"pid": self.server[0], "create_time": self.server[1]},
                "interval_s": self.interval, "samples": self.samples, "violating_samples": self.violating,
                "max_gap_s": round(self.max_gap, 3),
                "valid": self.samples > 0 and self.violating == 0,
                "reason": first,
                "violations": list(self.kept),
                "gpu_processes_seen": list(self.seen.values()),
                "note": "sampled evidence every interval_s, not a GPU lease: competition shorter than the "
                        "interval can go unseen",
            }


START_TIME_TOLERANCE = 0.05  # s; process start times come from clock ticks (10 ms)


def process_start_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


def process_alive(pid: int, start_time: float | None) -> bool:
    """True when `pid` is a live (non-zombie) process started at `start_time` (None: any start time)."""
    import psutil

    try:
        p = psutil.Process(pid)
        if start_time is not None and abs(p.create_time() - start_time) > START_TIME_TOLERANCE:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ProcessLookupError):
        return False
    except psutil.AccessDenied:
        return True


def describe_process(pid: int) -> str:
    import psutil

    try:
        p = psutil.Process(pid)
        return f"pid {pid} ({p.name()}: {' '.join(p.cmdline())[:120]})"
    except (psutil.Error, ProcessLookupError):
        return f"pid {pid}"


def port_holders(port: int) -> list[int]:
    """PIDs listening on 127.0.0.1/any :port (where this user may see them)."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    return sorted({c.pid for c in conns if c.pid and c.status == psutil.CONN_LISTEN and c.laddr
                   and c.laddr.port == port})


class Gpu:
    """NVML view of one physical GPU; `available` False (with `reason`) where NVML cannot be used.

    The constructor checks the index and shuts NVML down again, so a daemon opens its own NVML
    session after the fork (`compute_processes` initialises lazily in the process that samples).
    """

    def __init__(self, index: int):
        self.index = index
        self.available = False
        self.reason: str | None = None
        self.info: dict = {"index": index}
        self._handle = None
        self._graphics = True
        try:
            import pynvml
        except ImportError:
            self.reason = "pynvml (nvidia-ml-py) is not installed"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self.reason = f"NVML unavailable: {exc}"
            return
        try:
            count = pynvml.nvmlDeviceGetCount()
            if not 0 <= index < count:
                raise UserError(f"--gpu {index}: NVML sees {count} GPU(s) (indices 0..{count - 1})")
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.available = True
            self.info.update(device_info(pynvml, h, strict=False))
        finally:
            pynvml.nvmlShutdown()

    def compute_processes(self) -> list[dict] | None:
        """Compute processes on the GPU now; None when the sample failed."""
        if not self.available:
            return None
        import pynvml

        try:
            if self._handle is None:
                pynvml.nvmlInit()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            procs = [(p, "compute") for p in pynvml.nvmlDeviceGetComputeRunningProcesses(self._handle)]
            if self._graphics:
                try:  # as the bench's exclusivity monitor: graphics contexts hold the GPU too
                    procs += [(p, "graphics") for p in pynvml.nvmlDeviceGetGraphicsRunningProcesses(self._handle)]
                except pynvml.NVMLError_NotSupported:
                    self._graphics = False
        except pynvml.NVMLError:
            return None
        return [{"pid": p.pid, "kind": kind, "used_gpu_memory": getattr(p, "usedGpuMemory", None)} for p, kind in procs]
