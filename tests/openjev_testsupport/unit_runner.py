#!/usr/bin/env python3
"""Run the rendered OpenJEV units the way systemd runs them, where systemd is not PID 1.

For CI containers and CPU machines (tests/test_deployment_*.py, benchmarks/bench_gateway.py, a
local demo). Production uses systemd itself; this module reads the same rendered unit files and
reproduces only the parts of systemd's behaviour that the deployment relies on:

  socket unit    this process binds ListenStream (SO_REUSEADDR, no SO_REUSEPORT, Backlog=) and
                 holds the listening socket for its whole life, as PID 1 does: gateway restarts
                 and crashes never close it, connections wait in the kernel's accept queue.
                 While the service is not running, a pending connection starts it (activation).
  socket passing the service's ExecStart gets the socket as fd 3 with LISTEN_FDS=1,
                 LISTEN_PID=<its own pid> and LISTEN_FDNAMES (sd_listen_fds(3) protocol).
  Type=notify    NOTIFY_SOCKET; the start completes on READY=1 from the main PID (credentials
                 checked), as with NotifyAccess=main. Type=exec completes at exec.
  environment    a clean manager environment (PATH, HOME, USER, LANG, XDG_RUNTIME_DIR), then
                 Environment= and EnvironmentFile=; specifiers %i %I %n %N %t %h %u %%;
                 ${VAR} and $VAR in ExecStart as systemd expands them; WorkingDirectory=;
                 RuntimeDirectory= under the runtime directory (%t), removed on stop.
  stop           KillSignal= to the main PID (KillMode=mixed), repeated every 2 s while it runs (a
                 signal landing in HAProxy's post-READY re-exec is lost), TimeoutStopSec=, then SIGKILL to
                 the rest of the unit's processes (a process group stands in for the cgroup).
  restart policy Restart=always / on-failure with RestartSec= (clean exit: 0, SuccessExitStatus=,
                 SIGHUP/SIGINT/SIGTERM/SIGPIPE).
  reload         ExecReload= with $MAINPID.
  logs           stdout and stderr of each unit appended to LOG_DIR/<unit>.log (the journal).

Not modelled: cgroups, dependencies and ordering beyond "socket first", StartLimit*, sandboxing,
User= (everything runs as the caller).

usage: unit_runner.py UNIT_DIR [--runtime-dir DIR] [--log-dir DIR] [--target openjev.target]
  Starts the target's units in the foreground until SIGINT/SIGTERM, then stops them all.
"""

from __future__ import annotations

import argparse
import os
import pwd
import select
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from openjev_testsupport.unit_files import (Unit, UnitError, expand_command, parse_duration,
                                            read_environment_file)

SD_LISTEN_FDS_START = 3
CLEAN_SIGNALS = {signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE}
MANAGER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The exec shim: put the held socket on fd 3, say LISTEN_PID=<this pid> (exec keeps the pid).
_SHIM = (
    "import os, sys\n"
    "fd = int(sys.argv[1])\n"
    "os.dup2(fd, 3)\n"
    "os.close(fd) if fd != 3 else None\n"
    "os.environ['LISTEN_PID'] = str(os.getpid())\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


# ---------------------------------------------------------------- unit files


# ---------------------------------------------------------------- the socket (held like PID 1)
class SocketUnit:
    def __init__(self, unit: Unit):
        self.unit = unit
        listens = unit.all("Socket", "ListenStream")
        if len(listens) != 1:
            raise UnitError(f"{unit.name}: exactly one ListenStream= is modelled, found {len(listens)}")
        host, _, port = listens[0].rpartition(":")
        self.address = (host.strip("[]") or "0.0.0.0", int(port))
        if unit.get("Socket", "Accept", "no") not in ("no", "false", "0"):
            raise UnitError(f"{unit.name}: only Accept=no is modelled")
        backlog = int(unit.get("Socket", "Backlog", str(socket.SOMAXCONN)))
        family = socket.AF_INET6 if ":" in self.address[0] else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # systemd does this too
        if unit.get("Socket", "ReusePort", "no") in ("yes", "true", "1"):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if unit.get("Socket", "NoDelay", "no") in ("yes", "true", "1"):
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.sock.bind(self.address)
            self.sock.listen(backlog)
        except OSError:
            self.sock.close()
            raise
        self.service_name = unit.get("Socket", "Service") or unit.name.rsplit(".", 1)[0] + ".service"

    @property
    def port(self) -> int:
        return self.address[1]

    def readable(self, timeout: float) -> bool:
        r, _, _ = select.select([self.sock], [], [], timeout)
        return bool(r)

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------- services
@dataclass
class Event:
    t: float
    what: str
    detail: str = ""


@dataclass
class ServiceUnit:
    manager: "Manager"
    unit: Unit
    socket: SocketUnit | None = None
    proc: subprocess.Popen | None = None
    events: list[Event] = field(default_factory=list)
    _wanted: bool = False          # the "job": should this service be running?
    _stopping: bool = False
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _ready: threading.Event = field(default_factory=threading.Event)
    _supervisor: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self.unit.name

    @property
    def main_pid(self) -> int | None:
        return self.proc.pid if self.proc and self.proc.poll() is None else None

    @property
    def log_path(self) -> Path:
        return self.manager.log_dir / f"{self.name}.log"

    def record(self, what: str, detail: str = "") -> None:
        self.events.append(Event(time.monotonic(), what, detail))
        with open(self.log_path, "a") as fh:
            fh.write(f"-- unit_runner {time.strftime('%H:%M:%S')} {self.name}: {what} {detail}\n")

    # ------------------------------------------------------------ environment and command
    def environment(self) -> dict[str, str]:
        u, rt = self.unit, self.manager.runtime_dir
        user = pwd.getpwuid(os.getuid())
        env = {"PATH": MANAGER_PATH, "HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name,
               "SHELL": user.pw_shell, "XDG_RUNTIME_DIR": str(rt), "LANG": os.environ.get("LANG", "C.UTF-8"),
               "INVOCATION_ID": os.urandom(16).hex()}
        for assignment in u.all("Service", "Environment"):
            for word in shlex.split(u.specifiers(assignment, rt)):
                k, _, v = word.partition("=")
                env[k] = v
        for spec in u.all("Service", "EnvironmentFile"):
            optional = spec.startswith("-")
            path = Path(u.specifiers(spec.lstrip("-"), rt))
            if not path.exists():
                if optional:
                    continue
                raise UnitError(f"{self.name}: EnvironmentFile {path} does not exist")
            env.update(read_environment_file(path))
        return env

    def command(self, key: str, env: dict[str, str], mainpid: int | None = None) -> list[list[str]]:
        cmds = []
        for line in self.unit.all("Service", key):
            line = self.unit.specifiers(line, self.manager.runtime_dir)
            cmds.append(expand_command(line, {**env, "MAINPID": str(mainpid or "")}))
        return cmds

    # ------------------------------------------------------------ lifecycle
    def start(self, wait: bool = True, timeout: float | None = None) -> None:
        with self._lock:
            self._wanted = True
            if self.main_pid is None:
                self._spawn()
        if wait:
            self.wait_started(timeout)

    def _spawn(self) -> None:
        u, rt = self.unit, self.manager.runtime_dir
        env = self.environment()
        for d in u.all("Service", "RuntimeDirectory"):
            for name in d.split():
                p = rt / name
                p.mkdir(parents=True, exist_ok=True)
                p.chmod(int(u.get("Service", "RuntimeDirectoryMode", "0755"), 8))
        cmd = self.command("ExecStart", env)
        if len(cmd) != 1:
            raise UnitError(f"{self.name}: exactly one ExecStart= is modelled")
        cmd = shown = cmd[0]
        pass_fds: tuple[int, ...] = ()
        if self.socket is not None:
            env.update(LISTEN_FDS="1", LISTEN_FDNAMES=self.socket.unit.name)
            held = self.socket.sock.fileno()
            cmd = [sys.executable, "-I", "-S", "-c", _SHIM, str(held), *cmd]
            pass_fds = (held,)
        self._ready.clear()
        stype = u.get("Service", "Type", "simple")
        if stype == "notify":
            env["NOTIFY_SOCKET"] = str(self.manager.notify_path)
        elif stype not in ("exec", "simple"):
            raise UnitError(f"{self.name}: Type={stype} is not modelled")
        cwd = self.working_directory()
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, pass_fds=pass_fds, start_new_session=True)
        except OSError as exc:  # as systemd's 203/EXEC: one line naming the unit, never a traceback
            raise UnitError(f"{self.name}: cannot run {shown[0]}: {exc.strerror or exc}") from None
        finally:
            log.close()
        self.record("started", f"pid {self.proc.pid}: {shlex.join(shown)}")
        if stype != "notify":
            self._ready.set()
        self.manager.expect_notify(self.proc.pid, self)
        self._supervisor = threading.Thread(target=self._supervise, args=(self.proc,), daemon=True,
                                            name=f"supervise-{self.name}")
        self._supervisor.start()

    def working_directory(self) -> str | None:
        """WorkingDirectory= (a leading '-' makes a missing directory acceptable, as in systemd; '~' is HOME).
        A missing one fails the start with one line, as systemd's status 200/CHDIR does."""
        raw = self.unit.get("Service", "WorkingDirectory")
        if not raw:
            return None
        optional = raw.startswith("-")
        path = self.unit.specifiers(raw[1:] if optional else raw, self.manager.runtime_dir)
        if path == "~":
            path = pwd.getpwuid(os.getuid()).pw_dir
        if os.path.isdir(path):
            return path
        if optional:
            return None
        raise UnitError(f"{self.name}: WorkingDirectory={path} does not exist (systemd fails the unit with "
                        "200/CHDIR); create it (deploy/install_units.sh creates its --root) and start again")

    def wait_started(self, timeout: float | None = None) -> None:
        limit = timeout or min(parse_duration(self.unit.get("Service", "TimeoutStartSec", "90s")), 600)
        deadline = time.monotonic() + limit
        while not self._ready.wait(0.05):
            proc = self.proc
            if proc is not None and proc.poll() is not None:
                raise UnitError(f"{self.name} exited with {proc.returncode} before it was started; see {self.log_path}")
            if time.monotonic() > deadline:
                raise UnitError(f"{self.name} did not report READY=1 within {limit:.0f} s; see {self.log_path}")

    def notified(self, message: dict[str, str]) -> None:
        if message.get("READY") == "1":
            self.record("ready", "READY=1")
            self._ready.set()

    def _clean_exit(self, rc: int) -> bool:
        success = {"0"} | set(" ".join(self.unit.all("Service", "SuccessExitStatus")).split())
        if rc < 0:
            sig = signal.Signals(-rc)
            return sig in CLEAN_SIGNALS or sig.name in success or sig.name[3:] in success
        return str(rc) in success

    def _supervise(self, proc: subprocess.Popen) -> None:
        rc = proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the rest of the "cgroup"
        except ProcessLookupError:
            pass
        with self._lock:
            self.record("exited", f"status {rc}")
            if self.proc is not proc or self._stopping or not self._wanted:
                return
            policy = self.unit.get("Service", "Restart", "no")
            restart = policy == "always" or (policy == "on-failure" and not self._clean_exit(rc))
            if not restart:
                self._wanted = False
                return
        delay = parse_duration(self.unit.get("Service", "RestartSec", "100ms"))
        self.record("scheduled restart", f"in {delay:g} s (Restart={policy})")
        time.sleep(delay)
        with self._lock:
            if self._wanted and not self._stopping and self.proc is proc:
                try:
                    self._spawn()
                except UnitError as exc:  # systemd: the unit enters "failed"; no traceback from this thread
                    self._wanted = False
                    self.record("restart failed", str(exc))
                    print(f"unit_runner.py: error: {exc}", file=sys.stderr, flush=True)

    def stop(self) -> int | None:
        """systemctl stop: KillSignal= to the main PID, TimeoutStopSec=, then SIGKILL everything."""
        with self._lock:
            self._wanted = False
            self._stopping = True
            proc = self.proc
        try:
            if proc is None or proc.poll() is not None:
                return proc.returncode if proc else None
            sig = signal.Signals[self.unit.get("Service", "KillSignal", "SIGTERM")]
            mode = self.unit.get("Service", "KillMode", "control-group")

            def send(again: str = "") -> None:  # KillSignal= to the main PID (mixed) or the whole group
                self.record("stopping", f"{sig.name} {again}to {'pid' if mode == 'mixed' else 'group'} {proc.pid}")
                try:
                    if mode == "mixed":
                        os.kill(proc.pid, sig)
                    else:
                        os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

            send()
            # The signal is repeated every 2 s while the main process runs: HAProxy's master re-executes
            # itself right after READY=1 (master-worker wait mode), and a KillSignal that lands in
            # that window is lost (seen: SIGUSR1 0.1 s after READY, no soft stop in 60 s). Repeating
            # KillSignal is harmless for both services (a soft stop or a graceful exit already begun).
            deadline = time.monotonic() + parse_duration(self.unit.get("Service", "TimeoutStopSec", "90s"))
            while True:
                try:
                    proc.wait(max(0.0, min(2.0, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    pass
                if time.monotonic() >= deadline:
                    self.record("stop timed out", "SIGKILL")
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(30)
                    break
                send("again ")
            if self._supervisor is not None:
                self._supervisor.join(10)
            for d in self.unit.all("Service", "RuntimeDirectory"):
                for name in d.split():
                    _rmtree(self.manager.runtime_dir / name)
            return proc.returncode
        finally:
            with self._lock:
                self._stopping = False

    def restart(self, wait: bool = True) -> None:
        """systemctl restart: stop (as above), then start."""
        self.stop()
        self.start(wait=wait)

    def reload(self) -> None:
        """systemctl reload: run ExecReload= with $MAINPID."""
        pid = self.main_pid
        if pid is None:
            raise UnitError(f"{self.name} is not running")
        for cmd in self.command("ExecReload", self.environment(), mainpid=pid):
            self.record("reload", shlex.join(cmd))
            subprocess.run(cmd, check=True, env={"PATH": MANAGER_PATH})

    def kill(self, sig: int = signal.SIGKILL, whole: bool = True) -> None:
        """systemctl kill / a crash: signal the process group (or only the main PID)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        self.record("killed", f"{signal.Signals(sig).name} to {'group' if whole else 'pid'} {proc.pid}")
        (os.killpg if whole else os.kill)(proc.pid, sig)

    def restarts(self) -> list[Event]:
        return [e for e in self.events if e.what == "scheduled restart"]


def _rmtree(path: Path) -> None:
    if not path.exists():
        return
    for p in sorted(path.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
    path.rmdir()


# ---------------------------------------------------------------- the manager
class Manager:
    """A stand-in for the systemd manager over one directory of rendered units."""

    def __init__(self, unit_dir: Path, runtime_dir: Path, log_dir: Path):
        self.unit_dir = Path(unit_dir)
        self.runtime_dir = Path(runtime_dir)
        self.log_dir = Path(log_dir)
        self.runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.sockets: dict[str, SocketUnit] = {}
        self.services: dict[str, ServiceUnit] = {}
        self._closed = threading.Event()
        self._shutting_down = False
        self._notify_pids: dict[int, ServiceUnit] = {}
        self.notify_path = self.runtime_dir / "unit_runner.notify"
        if self.notify_path.exists():
            self.notify_path.unlink()
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(str(self.notify_path))
        self._notify.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._threads = [threading.Thread(target=self._notify_loop, daemon=True, name="notify"),
                         threading.Thread(target=self._activation_loop, daemon=True, name="activation")]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ units
    def service(self, name: str) -> ServiceUnit:
        if name not in self.services:
            unit = Unit.load(self.unit_dir, name)
            sock = next((s for s in self.sockets.values() if s.service_name == name), None)
            self.services[name] = ServiceUnit(self, unit, socket=sock)
        return self.services[name]

    def listen(self, name: str) -> SocketUnit:
        """systemctl start X.socket: bind and hold the socket."""
        if name not in self.sockets:
            sock = SocketUnit(Unit.load(self.unit_dir, name))
            self.sockets[name] = sock
            if sock.service_name in self.services:
                self.services[sock.service_name].socket = sock
        return self.sockets[name]

    def start_target(self, target: str = "openjev.target", wait: bool = True) -> list[str]:
        """Start what the target Wants=: sockets first, then services (gateway before replicas)."""
        wants = " ".join(Unit.load(self.unit_dir, target).all("Unit", "Wants")).split()
        for name in wants:
            if name.endswith(".socket"):
                self.listen(name)
        for name in wants:
            if name.endswith(".service"):
                self.service(name).start(wait=wait)
        return wants

    def stop_all(self) -> None:
        for svc in reversed(list(self.services.values())):
            try:
                svc.stop()
            except Exception as exc:  # noqa: BLE001 - stop everything we can
                print(f"unit_runner: stopping {svc.name}: {exc}", file=sys.stderr)

    def close(self) -> None:
        self._shutting_down = True
        self.stop_all()
        self._closed.set()
        for sock in self.sockets.values():
            sock.close()
        self._notify.close()
        for t in self._threads:
            t.join(2)
        if self.notify_path.exists():
            self.notify_path.unlink()

    # ------------------------------------------------------------ sd_notify
    def expect_notify(self, pid: int, svc: ServiceUnit) -> None:
        self._notify_pids[pid] = svc

    def _notify_loop(self) -> None:
        ucred = struct.calcsize("3i")
        while not self._closed.is_set():
            try:
                r, _, _ = select.select([self._notify], [], [], 0.2)
                if not r:
                    continue
                data, ancdata, _, _ = self._notify.recvmsg(4096, socket.CMSG_SPACE(ucred))
            except (OSError, ValueError):
                return
            pid = None
            for level, typ, cdata in ancdata:
                if level == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", cdata[:ucred])[0]
            svc = self._notify_pids.get(pid)
            if svc is None or svc.main_pid != pid:  # NotifyAccess=main
                continue
            message = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            svc.notified(message)

    # ------------------------------------------------------------ socket activation
    def _activation_loop(self) -> None:
        while not self._closed.is_set():
            for sock in list(self.sockets.values()):
                if self._shutting_down:
                    break
                try:
                    svc = self.service(sock.service_name)
                except UnitError:
                    continue
                if svc.main_pid is not None or svc._stopping:
                    continue
                try:
                    pending = sock.readable(0)
                except (OSError, ValueError):
                    continue
                if pending:
                    svc.record("activated", f"connection pending on {sock.address[0]}:{sock.address[1]}")
                    try:
                        svc.start(wait=False)
                    except Exception as exc:  # noqa: BLE001
                        svc.record("activation failed", str(exc))
            time.sleep(0.02)


# ---------------------------------------------------------------- CLI (a local demo without systemd)
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("unit_dir", type=Path, help="directory of units rendered by deploy/install_units.sh")
    p.add_argument("--runtime-dir", type=Path, default=None, help="stands in for %%t (default: UNIT_DIR/../run)")
    p.add_argument("--log-dir", type=Path, default=None, help="one log per unit (default: UNIT_DIR/../log)")
    p.add_argument("--target", default="openjev.target")
    args = p.parse_args()
    if not (args.unit_dir / args.target).is_file():
        print(f"unit_runner.py: error: no {args.target} in {args.unit_dir}", file=sys.stderr)
        return 1
    try:
        mgr = Manager(args.unit_dir, args.runtime_dir or args.unit_dir.parent / "run",
                      args.log_dir or args.unit_dir.parent / "log")
    except OSError as exc:
        print(f"unit_runner.py: error: cannot prepare the runtime or log directory: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        wants = mgr.start_target(args.target)
        for s in mgr.sockets.values():
            print(f"holding {s.address[0]}:{s.address[1]} for {s.service_name}")
        print(f"started {' '.join(wants)}; logs in {mgr.log_dir}; Ctrl-C stops", flush=True)
        stop.wait()
    except (UnitError, OSError) as exc:
        print(f"unit_runner.py: error: {exc}", file=sys.stderr)
        return 1
    finally:
        mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
