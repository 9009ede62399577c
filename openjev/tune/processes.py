"""Processes a tuner run owns: the server's process group, children that never outlive the tuner (parent-death
signal, a run tag, a watchdog), the run's pid file and the daemon."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from openjev.common import REPO_ROOT, UserError, atomic_write_json, utc_now
from openjev.gpu import describe_process, port_holders, process_alive, process_start_time


def say(msg: str) -> None:
    print(f"[tune {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    log_path: Path
    tree: dict[int, float] = field(default_factory=dict)  # pid -> start time, every process seen in its tree

    @property
    def pid(self) -> int:
        return self.proc.pid

    def track(self) -> None:
        """Add the server's current descendants (kept after they are reparented)."""
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                self.tree.setdefault(p.pid, p.create_time())
            except psutil.Error:
                pass

    def alive_tree(self) -> list[int]:
        return [pid for pid, st in self.tree.items() if process_alive(pid, st)]


def log_tail(path: Path, lines: int = 40, max_chars: int = 6000) -> str:
    try:
        data = path.read_bytes()[-64 * 1024:].decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])[-max_chars:]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process_tree(handle: ServerHandle, timeout: float) -> dict:
    """SIGTERM the server's process group, SIGKILL after `timeout`; report what (if anything) is left."""
    t0 = time.monotonic()
    handle.track()
    already = handle.proc.poll()
    sent = []
    if already is None or handle.alive_tree():
        _signal_group(handle.pid, signal.SIGTERM)
        sent.append("SIGTERM")
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        handle.proc.poll()
        if handle.proc.returncode is not None and not handle.alive_tree():
            break
        time.sleep(0.1)
    else:
        _signal_group(handle.pid, signal.SIGKILL)
        for pid in handle.alive_tree():  # members that left the group (setsid) are killed one by one
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        sent.append("SIGKILL")
        end = time.monotonic() + 15
        while time.monotonic() < end and (handle.proc.poll() is None or handle.alive_tree()):
            time.sleep(0.1)
    try:
        code = handle.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        code = None
    left = handle.alive_tree()
    return {"signals": sent, "exit_code": code, "exited_before_stop": already is not None,
            "seconds": round(time.monotonic() - t0, 3), "tree_pids": sorted(handle.tree),
            "left_running": [describe_process(p) for p in left], "clean": not left and code is not None}


# Three layers, so that no server or bench of a run survives its tuner, however the tuner ends:
#  1. each child (server launcher, bench) asks the kernel for a parent-death signal (PR_SET_PDEATHSIG, set in
#     the child between fork and exec; it survives the launcher's exec): SIGTERM for the server (it shuts down
#     its own children), SIGKILL for the bench (a bench must never write a receipt into a dead run);
#  2. every child gets RUN_ENV=<run id> and OUT_ENV=<DIR> in its environment, inherited by every process it
#     starts (SGLang's scheduler and detokenizer, a setsid'd helper...), which is how a process of a run is
#     recognised later, by the watchdog, by --status and by the port check of a later invocation;
#  3. a watchdog process (its own session) holds the read end of a pipe whose write end only the tuner holds:
#     EOF without the tuner's "done" means the tuner died (SIGKILL, OOM killer...). It then SIGTERMs every
#     process carrying the run id, SIGKILLs what is left after WATCHDOG_GRACE s, and records the death in
#     run.json (phase "tuner-died").
RUN_ENV = "OPENJEV_TUNE_RUN"


OUT_ENV = "OPENJEV_TUNE_OUT"


WATCHDOG_FLAG = "--internal-watchdog"


WATCHDOG_GRACE = 3.0


FINAL_PHASES = ("done", "failed", "interrupted", "tuner-died")


PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child_preexec(sig: int, parent_pid: int):
    """preexec_fn of a child: parent-death signal `sig`; if the parent already died (before prctl), die now."""
    def preexec() -> None:
        _set_parent_death_signal(sig)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sig)
    return preexec


def run_processes(run_id: str | None, recorded: Sequence[dict] = ()) -> list[dict]:
    """Live processes of a run: every process whose environment carries RUN_ENV=run_id, and every recorded
    child {"pid", "start_time", "role"} still alive with that start time. [{pid, role, cmdline}], by pid."""
    import psutil

    found: dict[int, dict] = {}
    me = os.getpid()
    if run_id:
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            if p.pid == me or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                if p.environ().get(RUN_ENV) != run_id:
                    continue
            except (psutil.Error, OSError):
                continue
            found[p.pid] = {"pid": p.pid, "role": "process of the run", "cmdline": " ".join(p.info["cmdline"] or [])}
    for c in recorded:
        pid = c.get("pid")
        if isinstance(pid, int) and process_alive(pid, c.get("start_time")):
            cmd = describe_process(pid)
            found[pid] = {"pid": pid, "role": c.get("role") or "process of the run", "cmdline": cmd}
    return [found[k] for k in sorted(found)]


def kill_command(pids: Sequence[int]) -> str:
    ids = " ".join(str(p) for p in pids)
    return f"kill -TERM {ids}; sleep 5; kill -KILL {ids} 2>/dev/null"


def inspect_run(out: Path) -> dict:
    """What DIR/run.json says and what is true now: {"run", "tuner_alive", "finished", "processes", "text"}."""
    try:
        run = json.loads((out / "run.json").read_text())
        if not isinstance(run, dict):
            raise ValueError("not an object")
    except FileNotFoundError:
        return {"run": None, "text": f"{out} holds no run.json (not a tuner run)"}
    except (OSError, ValueError) as exc:
        return {"run": None, "text": f"{out}/run.json is unreadable ({exc})"}
    tuner = run.get("tuner") or {}
    pid, st = tuner.get("pid"), tuner.get("start_time")
    same_host = tuner.get("host") in (None, socket.gethostname())
    alive = isinstance(pid, int) and same_host and process_alive(pid, st)
    finished = run.get("exit_code") is not None or run.get("phase") in FINAL_PHASES
    procs = run_processes(run.get("run_id"), run.get("children") or []) if same_host else []
    procs = [p for p in procs if p["pid"] != pid]
    phase = run.get("phase")
    if not same_host:
        state = f"run {out} was started on host {tuner.get('host')}; its processes cannot be checked from here"
    elif alive:
        state = f"run {out} is live: tuner pid {pid} (started {tuner.get('started_at')}) is running, phase {phase!r}"
    elif finished and phase != "tuner-died":
        state = (f"run {out} finished: phase {phase!r}, exit code {run.get('exit_code')} at {run.get('finished_at')}; "
                 f"tuner pid {pid} has ended")
    else:
        died = run.get("tuner_died") or {}
        state = (f"run {out}: its tuner pid {pid} (started {tuner.get('started_at')}) is gone"
                 + (f" (seen by the watchdog at {died.get('detected_at')})" if died.get("detected_at") else
                    f" without finishing (run.json still says phase {phase!r}, last update {run.get('updated_at')})"))
    if procs:
        state += ("; still running: " + ", ".join(f"pid {p['pid']} ({p['role']}: {p['cmdline'][:100]})" for p in procs)
                  + f"; end them with: {kill_command([p['pid'] for p in procs])}")
    elif not alive:
        state += "; no process of this run is running"
    return {"run": run, "tuner_alive": alive, "finished": finished, "processes": procs, "text": state}


def describe_port_holder(port: int) -> str:
    """`port P ... is in use` plus, for a process of a tuner run, that run's state and the command that ends it."""
    import psutil

    parts = []
    for pid in port_holders(port):
        try:
            env = psutil.Process(pid).environ()
        except (psutil.Error, OSError):
            env = {}
        if env.get(OUT_ENV):
            info = inspect_run(Path(env[OUT_ENV]))
            parts.append(f"held by {describe_process(pid)}, a process of tuner run {env[OUT_ENV]}: {info['text']}"
                         + ("" if "end them with" in info["text"] else f"; end it with: {kill_command([pid])}"))
        else:
            parts.append(f"held by {describe_process(pid)}")
    return "; ".join(parts)


def start_watchdog(out: Path, run_id: str, pidfile: Path) -> tuple[subprocess.Popen, int] | None:
    """The watchdog of layer 3; returns (process, write end of its pipe) or None if it cannot start."""
    r, w = os.pipe()  # both ends close-on-exec: no server or bench inherits the write end
    try:
        proc = subprocess.Popen([sys.executable, "-m", __name__, WATCHDOG_FLAG, str(out), run_id,
                                 str(os.getpid()), str(pidfile)], stdin=r, stdout=subprocess.DEVNULL,
                                start_new_session=True, cwd=REPO_ROOT)
    except OSError as exc:
        os.close(w)
        say(f"warning: no watchdog ({exc}); children still get a parent-death signal")
        return None
    finally:
        os.close(r)
    return proc, w


def stop_watchdog(wd: tuple[subprocess.Popen, int] | None) -> None:
    """Tell the watchdog the tuner ended normally (its cleanup is done) and let it exit."""
    if wd is None:
        return
    proc, w = wd
    try:
        os.write(w, b"done")
    except OSError:
        pass
    os.close(w)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _signal_run(run_id: str, sig: int, wait: float) -> list[dict]:
    """Send sig to every process of the run, then wait up to `wait` s for them to end; the processes signalled."""
    procs = run_processes(run_id)
    for p in procs:
        try:
            os.kill(p["pid"], sig)
        except OSError:
            pass
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and run_processes(run_id):
        time.sleep(0.1)
    return procs


def watchdog_main(argv: Sequence[str]) -> int:
    """Layer 3: wait for the tuner's end; after an abnormal one, end every process of the run and record it."""
    out, run_id, tuner_pid, pidfile = Path(argv[0]), argv[1], int(argv[2]), Path(argv[3])
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    data = b""
    while chunk := os.read(0, 64):
        data += chunk
    if data == b"done":
        return 0
    t0 = utc_now()
    procs = _signal_run(run_id, signal.SIGTERM, WATCHDOG_GRACE)
    killed = _signal_run(run_id, signal.SIGKILL, 5)
    left = run_processes(run_id)
    try:
        run = json.loads((out / "run.json").read_text())
        if run.get("exit_code") is None and run.get("phase") not in FINAL_PHASES:
            run["tuner_died"] = {"detected_at": t0, "by": f"watchdog pid {os.getpid()}", "phase_at_death": run["phase"],
                                 "stopped": procs, "needed_sigkill": [p["pid"] for p in killed], "left_running": left}
            for rec in run.get("profiles") or []:
                if rec.get("status") == "running":
                    rec.update(status="interrupted", failure=f"tuner pid {tuner_pid} died (seen by the watchdog)")
            run.update(phase="tuner-died", phase_since=t0, server_pid=None, finished_at=utc_now(), updated_at=utc_now(),
                       error=f"tuner pid {tuner_pid} died without finishing (no exit status; e.g. SIGKILL)")
            atomic_write_json(out / "run.json", run)
    except (OSError, ValueError):
        pass
    try:
        if (read_pidfile(pidfile) or {}).get("pid") == tuner_pid:
            pidfile.unlink(missing_ok=True)
    except UserError:
        pass
    print(f"[tune watchdog] tuner pid {tuner_pid} died; stopped {len(procs)} process(es) of run {out}"
          + (f"; LEFT RUNNING: {[p['pid'] for p in left]}" if left else ""), file=sys.stderr, flush=True)
    return 0


def pid_paths(out: Path) -> tuple[Path, Path]:
    return out.with_name(out.name + ".pid"), out.with_name(out.name + ".log")


def read_pidfile(path: Path) -> dict | None:
    """The pid file as {"pid", "start_time", ...}: JSON, or two lines `pid` / `start_time`. None if absent."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        if isinstance(data, dict) and isinstance(data.get("pid"), int):
            return data
    except json.JSONDecodeError:
        pass
    lines = text.split()
    try:
        return {"pid": int(lines[0]), "start_time": float(lines[1])}
    except (IndexError, ValueError):
        raise UserError(f"pid file {path} is unreadable (neither JSON nor 'pid' and 'start_time' lines); "
                        "remove it if no tuner is running for this directory") from None


def pidfile_record(out: Path, log: Path | None) -> dict:
    return {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "host": socket.gethostname(),
            "started_at": utc_now(), "out": str(out), "log": str(log) if log else None, "argv": sys.argv}


def claim_pidfile(path: Path, record: dict) -> str | None:
    """Create the pid file atomically; refuse while its process lives. Returns a note on a replaced stale file."""
    note = None
    for _ in range(3):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        try:
            os.link(tmp, path)  # atomic create-if-absent
            return note
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        old = read_pidfile(path)
        if old is None:
            continue
        if old.get("host") not in (None, socket.gethostname()):
            raise UserError(f"pid file {path} was written on host {old['host']}; cannot check its process from here "
                            "(remove it if no tuner is running)")
        if process_alive(old["pid"], old.get("start_time")):
            raise UserError(f"another tuner is running for {path.with_suffix('')} (pid {old['pid']}, started "
                            f"{old.get('started_at', 'at ' + str(old.get('start_time')))}; pid file {path}); "
                            "wait for it or stop it with SIGTERM")
        why = "is gone" if process_start_time(old["pid"]) is None else "belongs to another process (start time differs)"
        note = f"stale pid file {path}: pid {old['pid']} {why}; replacing it"
        print(f"{Path(sys.argv[0]).name}: warning: {note}", file=sys.stderr, flush=True)
        path.unlink(missing_ok=True)
    raise UserError(f"could not create pid file {path} (another tuner keeps creating it?)")


def release_pidfile(path: Path) -> None:
    try:
        rec = read_pidfile(path)
    except UserError:
        return
    if rec and rec.get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def rewrite_pidfile(path: Path, record: dict) -> None:
    atomic_write_json(path, record)


def daemonize(log_path: Path, pidfile: Path, out: Path) -> None:
    """Double fork; the parent prints where the daemon logs and exits 0 once the pid file names it.

    Why not `systemd-run --user`: the runbook's tuner runs over ssh on hosts where a user's systemd
    instance exists only with lingering enabled, and its record (pid file with start time, live
    run.json) is the one the runbook's checks read; where a user manager runs, `systemd-run --user
    --unit=openjev-tune app/tune_sglang_v100.py ...` (without --daemon) works as well."""
    r, w = os.pipe()
    first = os.fork()
    if first > 0:  # the invoking process
        os.close(w)
        with os.fdopen(r) as pipe:
            msg = pipe.read().strip()
        os.waitpid(first, 0)
        if not msg.startswith("ok "):
            raise UserError(f"the daemon did not start: {msg or 'no word from it'}; see {log_path}")
        print(f"tuner daemon pid {msg[3:]}; log {log_path}; pid file {pidfile}; live record {out / 'run.json'}",
              flush=True)
        os._exit(0)
    os.close(r)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    try:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(null_fd)
        os.close(log_fd)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        rewrite_pidfile(pidfile, pidfile_record(out, log_path))
        os.write(w, f"ok {os.getpid()}\n".encode())
    except Exception as exc:  # noqa: BLE001 - told to the waiting parent, then the daemon ends
        os.write(w, f"error {exc}\n".encode())
        os._exit(1)
    finally:
        os.close(w)


if __name__ == "__main__" and sys.argv[1:2] == [WATCHDOG_FLAG]:  # the watchdog, started by start_watchdog()
    sys.exit(watchdog_main(sys.argv[2:]))
