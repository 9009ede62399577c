"""One tuner run: for each profile, wait for an idle GPU, start the server, bench every set cold and warm, stop it."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from openjev.common import REPO_ROOT, UserError, atomic_write_json, environment_receipt, port_is_free, utc_now
from openjev.gpu import Gpu, describe_process, process_start_time
from openjev.tune.processes import (OUT_ENV, RUN_ENV, ServerHandle, _signal_group, child_preexec, log_tail,
                                    say, start_watchdog, stop_process_tree)
from openjev.tune.profiles import InputSet, Profile
from openjev.tune.summary import MODES, format_table, headline, measurement_failures, summarize, write_plot

APP_DIR = REPO_ROOT / "app"


BENCH_SCRIPT = APP_DIR / "bench_classify_v100.py"


SERVER_CMD_ENV = "OPENJEV_TUNE_SERVER_CMD"


DEFAULT_SERVER_CMD = APP_DIR / "serve_sglang_v100.sh"


PHASES = ("waiting-idle", "starting-server", "benchmarking", "stopping-server", "done", "failed", "interrupted",
          "tuner-died")


# Environment keys of the server process worth keeping in server_command.json (never the whole env).
RECORDED_ENV_PREFIXES = ("CUDA_", "SGLANG_", "OPENJEV_", "TILELANG_", "TRITON_", "FLASHINFER_", "TORCH_", "NCCL_",
                         "PYTORCH_", "HF_", "TRANSFORMERS_")


RECORDED_ENV_KEYS = ("MAX_RUNNING_REQUESTS", "SCHEDULE_POLICY", "CONTEXT_LENGTH", "MEM_FRACTION_STATIC",
                     "MAMBA_FULL_MEMORY_RATIO", "PYTHONPATH", "PATH", "CC", "CXX", "CUDAHOSTCXX", "LD_LIBRARY_PATH")


@dataclass(frozen=True)
class IdleDecision:
    state: str  # "idle" (waited enough) | "waiting" | "timeout"
    idle_for: float  # seconds the GPU has been seen without compute processes, up to now
    waited: float  # seconds since the wait began


def idle_decision(samples: Sequence[tuple[float, int | None]], *, start: float, now: float,
                  idle_seconds: float, max_wait: float) -> IdleDecision:
    """Decide the idle wait from NVML samples [(time, number of compute processes or None)].

    A sample of None (NVML failed) counts as busy: only observed idleness counts. The GPU has
    been idle since the first idle sample after the last busy one; it is idle enough when that
    lasted `idle_seconds` (0: one idle sample suffices). Timeout when `max_wait` has passed and
    it is not idle enough; an idle verdict wins over a timeout at the same instant.
    """
    waited = max(0.0, now - start)
    idle_since = None
    for t, n in samples:
        if n is None or n > 0:
            idle_since = None
        elif idle_since is None:
            idle_since = t
    idle_for = max(0.0, now - idle_since) if idle_since is not None else 0.0
    if idle_since is not None and idle_for >= idle_seconds:
        return IdleDecision("idle", idle_for, waited)
    if waited >= max_wait:
        return IdleDecision("timeout", idle_for, waited)
    return IdleDecision("waiting", idle_for, waited)


class Interrupted(BaseException):  # not an Exception: no `except Exception` may swallow it
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Tuner:
    def __init__(self, args: argparse.Namespace, profiles: list[Profile], sets: list[InputSet], gpu: Gpu,
                 server_cmd: list[str], pidfile: Path, log_path: Path | None, stale_note: str | None):
        self.args, self.profiles, self.sets, self.gpu = args, profiles, sets, gpu
        self.server_cmd = server_cmd
        self.out: Path = args.out
        self.exclusive = gpu.available and not args.no_exclusive_gpu
        self.exclusive_note = (None if self.exclusive else "--no-exclusive-gpu given" if gpu.available
                               else gpu.reason)
        self.server: ServerHandle | None = None
        self.bench: subprocess.Popen | None = None
        self.interrupted: Interrupted | None = None
        self.run_id = uuid.uuid4().hex
        self.pidfile = pidfile
        self.watchdog: tuple[subprocess.Popen, int] | None = None
        self.records = [{"name": p.name, "profile": p.to_json(), "status": "pending", "failure": None,
                         "dir": p.name, "measurements": []} for p in profiles]
        self.run = {
            "kind": "openjev-tune-run",
            "schema_version": 1,
            "run_id": self.run_id,
            "phase": "waiting-idle",
            "phase_since": utc_now(),
            "current_profile": None,
            "server_pid": None,
            "updated_at": utc_now(),
            "tuner": {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "started_at": utc_now(),
                      "host": socket.gethostname(), "argv": sys.argv, "daemon": bool(args.daemon),
                      "pid_file": str(pidfile), "log": str(log_path) if log_path else None,
                      "stale_pid_file_replaced": stale_note},
            "config": {
                "gpu": gpu.info, "port": args.port, "model": str(args.model), "server_cmd": server_cmd,
                "server_cmd_source": SERVER_CMD_ENV if os.environ.get(SERVER_CMD_ENV) else "default",
                "bench": {"script": str(BENCH_SCRIPT), "batch_size": args.batch_size, "workers": args.workers,
                          "repetitions": args.repetitions, "truncate": args.truncate},
                "sets": [s.to_json() for s in sets], "profiles": [p.to_json() for p in profiles],
                "idle_seconds": args.idle_seconds, "max_wait": args.max_wait, "poll_interval": args.poll_interval,
                "start_timeout": args.start_timeout, "stop_timeout": args.stop_timeout,
                "bench_timeout": args.bench_timeout,
                "nvml": {"available": gpu.available, "reason": gpu.reason},
                "idle_wait": "NVML compute processes" if gpu.available else f"skipped: {gpu.reason}",
                "exclusivity": ("bench --exclusive-gpu with the server PID" if gpu.available and not args.no_exclusive_gpu
                                else "not checked: --no-exclusive-gpu given" if gpu.available
                                else f"not checked: {gpu.reason}"),
            },
            "profiles": self.records,
            "measurements": [],
            # every server and bench started: {"role", "profile", "pid", "start_time"}; each also carries
            # OPENJEV_TUNE_RUN=run_id in its environment, inherited by its own children
            "children": [],
            "finished_at": None,
            "exit_code": None,
            "error": None,
            "environment": environment_receipt(),
        }

    # ------------------------------------------------------------ record keeping
    def save(self) -> None:
        self.run["updated_at"] = utc_now()
        atomic_write_json(self.out / "run.json", self.run)

    def phase(self, phase: str, profile: str | None = None) -> None:
        assert phase in PHASES, phase
        self.run.update(phase=phase, phase_since=utc_now())
        if profile is not None or phase == "done":
            self.run["current_profile"] = profile
        self.save()

    def save_profile(self, rec: dict) -> None:
        atomic_write_json(self.out / rec["dir"] / "profile.json", rec)
        self.save()

    def check_interrupt(self) -> None:
        if self.interrupted:
            raise self.interrupted

    # ------------------------------------------------------------ signals
    def on_signal(self, signum: int, _frame) -> None:
        """Only note the signal: every wait loop checks it within a second (check_interrupt), so no
        exception ever lands between starting a process and recording it."""
        if self.interrupted is None:
            self.interrupted = Interrupted(signum)
            say(f"{signal.Signals(signum).name} received: stopping at the next step")
        else:
            say(f"{signal.Signals(signum).name} again: already stopping")

    # ------------------------------------------------------------ main loop
    def child_env(self, extra: dict) -> dict:
        return {**os.environ, **extra, RUN_ENV: self.run_id, OUT_ENV: str(self.out)}

    def note_child(self, role: str, profile: str, pid: int) -> None:
        self.run["children"].append({"role": role, "profile": profile, "pid": pid, "start_time": process_start_time(pid)})

    def execute(self) -> int:
        self.out.mkdir(parents=True)
        self.save()
        self.watchdog = start_watchdog(self.out, self.run_id, self.pidfile)
        self.run["tuner"]["watchdog_pid"] = self.watchdog[0].pid if self.watchdog else None
        say(f"{len(self.profiles)} profile(s) on GPU {self.args.gpu}, port {self.args.port}; record {self.out / 'run.json'}")
        if not self.gpu.available:
            say(f"NVML not available ({self.gpu.reason}): idle wait skipped and GPU exclusivity NOT checked")
        elif not self.exclusive:
            say("--no-exclusive-gpu: GPU exclusivity during the bench NOT checked")
        try:
            for rec, prof in zip(self.records, self.profiles):
                self.run_profile(rec, prof)
        except Interrupted as sig:
            say(f"{sig}: stopping")
            self.cleanup_processes(reason=f"tuner received {sig}")
            for rec in self.records:
                if rec["status"] in ("running", "pending"):
                    rec["status"] = "interrupted" if rec["status"] == "running" else "not-run"
                    if rec["status"] == "interrupted":
                        rec["failure"] = f"tuner received {sig}"
                        self._write_profile_quietly(rec)
            code = 128 + sig.signum
            self.finish("interrupted", code)
            return code
        except BaseException as exc:
            self.cleanup_processes(reason=f"tuner error: {exc}")
            self.run["error"] = f"{type(exc).__name__}: {exc}"
            self.finish("failed", 1)
            raise
        summary = self.write_summary()
        code = 0 if summary["checks"]["all_passed"] else 1
        self.finish("done" if code == 0 else "failed", code)
        return code

    def _write_profile_quietly(self, rec: dict) -> None:
        try:
            atomic_write_json(self.out / rec["dir"] / "profile.json", rec)
        except OSError:
            pass

    def finish(self, phase: str, code: int) -> None:
        self.run["server_pid"] = None
        self.run["finished_at"] = utc_now()
        self.run["exit_code"] = code
        if phase == "interrupted":
            try:
                self.write_summary()
            except Exception as exc:  # noqa: BLE001 - a partial summary is a convenience
                say(f"no summary after the interruption: {exc}")
        self.phase(phase)

    def cleanup_processes(self, reason: str) -> None:
        """Stop a running bench and server (used on interruption and on tuner errors)."""
        self._stop_bench()
        self.bench = None
        if self.server is not None:
            rec = next((r for r in self.records if r["status"] == "running"), None)
            self.phase("stopping-server")
            stop = stop_process_tree(self.server, self.args.stop_timeout)
            stop["reason"] = reason
            say(f"server pid {self.server.pid} stopped ({', '.join(stop['signals']) or 'already gone'}); "
                + ("nothing left running" if stop["clean"] else f"LEFT RUNNING: {stop['left_running']}"))
            if rec is not None:
                rec.setdefault("server", {})["stop"] = stop
            self.server = None
            self.run["server_pid"] = None

    # ------------------------------------------------------------ one profile
    def fail(self, rec: dict, why: str, tail_from: Path | None = None) -> None:
        rec["status"], rec["failure"] = "failed", why
        if tail_from is not None:
            rec["server_log_tail"] = log_tail(tail_from)
        say(f"[{rec['name']}] FAILED: {why}")
        self.save_profile(rec)

    def run_profile(self, rec: dict, prof: Profile) -> None:
        self.check_interrupt()
        pdir = self.out / rec["dir"]
        pdir.mkdir()
        rec["status"] = "running"
        rec["started_at"] = utc_now()
        self.run["current_profile"] = prof.name
        say(f"[{prof.name}] policy {prof.schedule_policy}, max running requests {prof.max_running_requests}"
            + (f", flags {' '.join(prof.extra_args)}" if prof.extra_args else "")
            + (f", env {prof.env}" if prof.env else ""))

        self.phase("waiting-idle", prof.name)
        rec["idle_wait"] = self.wait_idle(prof.name)
        self.save_profile(rec)
        if rec["idle_wait"]["result"] == "timeout":
            return self.fail(rec, f"GPU never idle: GPU {self.args.gpu} had compute processes within every "
                                  f"{self.args.idle_seconds:g} s window for {self.args.max_wait:g} s")

        self.check_interrupt()
        self.phase("starting-server", prof.name)
        log_path = pdir / "server.log"
        if not port_is_free("127.0.0.1", self.args.port):
            return self.fail(rec, f"port {self.args.port} is in use before launch")
        try:
            self.start_server(rec, prof, pdir, log_path)
        except OSError as exc:
            return self.fail(rec, f"cannot run the server command: {exc}", log_path)
        ready = self.wait_healthy(rec, prof.name)
        if ready is not True:
            self.cleanup_processes(reason="server did not become healthy")
            return self.fail(rec, ready, log_path)
        self.save_server_config(rec, pdir)

        self.phase("benchmarking", prof.name)
        died = None
        for s in self.sets:
            for mode in MODES:
                self.check_interrupt()
                if self.server.proc.poll() is not None:
                    died = self.server.proc.returncode
                    break
                self.run_bench(rec, pdir, s, mode)
                self.server.track()
                if self.server.proc.poll() is not None:
                    died = self.server.proc.returncode
                    break
            if died is not None:
                break

        self.phase("stopping-server", prof.name)
        code_before = self.server.proc.poll()
        self.cleanup_processes(reason="profile finished")
        stop = rec["server"]["stop"]
        if died is not None or code_before is not None:
            code = died if died is not None else code_before
            return self.fail(rec, f"server exited unexpectedly (exit code {code}) during benchmarking; "
                                  f"{len(rec['measurements'])} of {len(self.sets) * len(MODES)} measurements ran",
                             log_path)
        if not stop["clean"]:
            return self.fail(rec, f"processes of the server tree left running after SIGKILL: {stop['left_running']}")
        rec["status"] = "done"
        rec["finished_at"] = utc_now()
        say(f"[{prof.name}] done")
        self.save_profile(rec)

    def wait_idle(self, name: str) -> dict:
        a = self.args
        if not self.gpu.available:
            return {"result": "skipped", "reason": self.gpu.reason, "seconds": 0.0}
        start = time.monotonic()
        samples: list[tuple[float, int | None]] = []
        last_report, seen_busy = 0.0, {}
        failed_samples = 0
        while True:
            self.check_interrupt()
            now = time.monotonic()
            procs = self.gpu.compute_processes()
            if procs is None:
                failed_samples += 1
            for p in procs or []:
                seen_busy.setdefault(p["pid"], describe_process(p["pid"]))
            n = None if procs is None else len(procs)
            # only the idle run since the last busy (or failed) sample matters: keep the list short
            samples = [(now, n)] if n is None or n > 0 else [*samples, (now, n)]
            d = idle_decision(samples, start=start, now=now, idle_seconds=a.idle_seconds, max_wait=a.max_wait)
            if d.state != "waiting":
                result = {"result": d.state, "seconds": round(d.waited, 3), "idle_for": round(d.idle_for, 3),
                          "idle_seconds": a.idle_seconds, "failed_samples": failed_samples,
                          "processes_seen": list(seen_busy.values())[:20]}
                say(f"[{name}] GPU {a.gpu} " + (f"idle for {d.idle_for:.1f} s" if d.state == "idle"
                                                 else f"never idle for {a.idle_seconds:g} s within {a.max_wait:g} s"))
                return result
            if now - last_report >= 10 or last_report == 0.0:
                busy = (f"{samples[-1][1]} GPU process(es), as seen from here: " + ", ".join(
                    describe_process(p["pid"]) for p in (procs or [])[:3])) if samples[-1][1] else (
                    "NVML sample failed" if procs is None else "no compute process")
                say(f"[{name}] waiting for GPU {a.gpu} to be idle {a.idle_seconds:g} s: idle {d.idle_for:.0f} s, "
                    f"waited {d.waited:.0f}/{a.max_wait:g} s ({busy})")
                last_report = now
            time.sleep(a.poll_interval)

    def start_server(self, rec: dict, prof: Profile, pdir: Path, log_path: Path) -> None:
        argv = [*self.server_cmd, str(self.args.model), str(self.args.port), *prof.extra_args]
        given = {**prof.env, "CUDA_VISIBLE_DEVICES": str(self.args.gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                 "MAX_RUNNING_REQUESTS": str(prof.max_running_requests), "SCHEDULE_POLICY": prof.schedule_policy,
                 "PYTHONUNBUFFERED": "1"}
        inherited = {k: v for k, v in os.environ.items() if _recorded_env_key(k) and k not in given}
        rec["server"] = {"argv": argv, "command": shlex.join(argv), "env_given": given, "env_inherited": inherited,
                         "cwd": str(REPO_ROOT), "log": str(log_path.relative_to(self.out)), "started_at": utc_now()}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=self.child_env(given), cwd=REPO_ROOT, start_new_session=True,
                                    preexec_fn=child_preexec(signal.SIGTERM, os.getpid()))
        self.note_child(f"server of profile {prof.name}", prof.name, proc.pid)
        self.server = ServerHandle(proc, log_path)
        self.server.track()
        rec["server"]["pid"] = proc.pid
        self.run["server_pid"] = proc.pid
        say(f"[{prof.name}] server pid {proc.pid}: {shlex.join(argv)} (log {log_path})")
        self.save_profile(rec)

    def wait_healthy(self, rec: dict, name: str) -> bool | str:
        import requests

        url = f"http://127.0.0.1:{self.args.port}/health"
        t0 = time.monotonic()
        last_report = t0
        while True:
            self.check_interrupt()
            self.server.track()
            code = self.server.proc.poll()
            if code is not None:
                return f"server exited with code {code} before /health answered 200"
            try:
                if requests.get(url, timeout=5).status_code == 200:
                    rec["server"]["ready_seconds"] = round(time.monotonic() - t0, 3)
                    say(f"[{name}] server healthy after {time.monotonic() - t0:.1f} s")
                    return True
            except requests.RequestException:
                pass
            elapsed = time.monotonic() - t0
            if elapsed >= self.args.start_timeout:
                return f"server not healthy after --start-timeout {self.args.start_timeout:g} s"
            if time.monotonic() - last_report >= 30:
                say(f"[{name}] waiting for {url}: {elapsed:.0f}/{self.args.start_timeout:g} s")
                last_report = time.monotonic()
            time.sleep(0.5)

    def save_server_config(self, rec: dict, pdir: Path) -> None:
        import psutil
        import requests

        srv = rec["server"]
        try:
            resp = requests.get(f"http://127.0.0.1:{self.args.port}/server_info", timeout=30)
            info = resp.json() if resp.status_code == 200 else {"error": f"HTTP {resp.status_code}", "body": resp.text[:2000]}
        except (requests.RequestException, ValueError) as exc:
            info = {"error": f"GET /server_info failed: {exc}"}
        atomic_write_json(pdir / "server_info.json", info)
        srv["server_info"] = "server_info.json"
        try:  # the launcher execs the server, so this PID's argv/env is the real server command
            p = psutil.Process(self.server.pid)
            srv["process_argv"] = p.cmdline()
            srv["process_env"] = {k: v for k, v in sorted(p.environ().items()) if _recorded_env_key(k)}
        except psutil.Error as exc:
            srv["process_argv_error"] = str(exc)
        srv["tree_at_ready"] = sorted(self.server.tree)
        atomic_write_json(pdir / "server_command.json", {k: srv.get(k) for k in (
            "argv", "command", "env_given", "env_inherited", "cwd", "pid", "started_at", "process_argv", "process_env")})
        self.save_profile(rec)

    def run_bench(self, rec: dict, pdir: Path, s: InputSet, mode: str) -> dict:
        """One bench invocation; its measurement is recorded even when the tuner is interrupted during it."""
        a, name = self.args, rec["name"]
        stem = f"{s.name}.{mode}"
        out_json = pdir / f"{stem}.json"
        argv = [sys.executable, str(BENCH_SCRIPT), "--url", f"http://127.0.0.1:{a.port}", "--inputs", str(s.inputs),
                "--tokens", str(s.tokens), "--reference", str(s.reference), "--out", str(out_json),
                "--batch-size", str(a.batch_size), "--workers", str(a.workers), "--repetitions", str(a.repetitions),
                "--truncate", str(a.truncate), "--label", f"{name}/{s.name}/{mode}"]
        if mode == "cold":
            argv.append("--cold-cache")
        if self.exclusive:
            argv += ["--exclusive-gpu", str(a.gpu), "--server-pid", str(self.server.pid)]
        m: dict[str, Any] = {"profile": name, "set": s.name, "mode": mode, "receipt": str(out_json.relative_to(self.out)),
                             "log": str((pdir / f"{stem}.bench.log").relative_to(self.out)), "argv": argv,
                             "exclusivity_checked": self.exclusive, "started_at": utc_now()}
        say(f"[{name}] bench {s.name} {mode}")
        t0 = time.monotonic()
        with open(pdir / f"{stem}.bench.log", "ab") as log:
            self.bench = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=REPO_ROOT, start_new_session=True,
                                          env=self.child_env({"PYTHONUNBUFFERED": "1"}),
                                          preexec_fn=child_preexec(signal.SIGKILL, os.getpid()))
        self.note_child(f"bench {name}/{s.name}/{mode}", name, self.bench.pid)
        interrupted = None
        try:
            code = self._wait_bench(m, t0)
        except Interrupted as exc:  # the bench writes its receipt on SIGTERM (exit 4); keep it
            interrupted = exc
            m["error"] = f"tuner received {exc}"
            code = self._stop_bench()
        self.bench = None
        m["exit_code"] = code
        m["seconds"] = round(time.monotonic() - t0, 3)
        m["finished_at"] = utc_now()
        receipt = None
        try:
            receipt = json.loads(out_json.read_text())
        except (OSError, json.JSONDecodeError):
            pass
        m["receipt_found"] = isinstance(receipt, dict)
        m.update(headline(receipt, mode))
        m["arrays"] = sorted(str(p.relative_to(self.out)) for p in pdir.glob(f"{stem}.*.npy"))  # candidate, passes
        m["checks_ok"] = not measurement_failures(m)
        rec["measurements"].append(m)
        self.run["measurements"].append(m)
        self.save_profile(rec)
        say(f"[{name}] bench {s.name} {mode}: exit {code}"
            + (f", median pass {m['median_pass_s']:.3f} s" if isinstance(m.get("median_pass_s"), (int, float)) else "")
            + ("" if m["checks_ok"] else " (CHECK FAILED)"))
        if interrupted is not None:
            raise interrupted
        return m

    def _wait_bench(self, m: dict, t0: float) -> int:
        server_gone_at = None
        while True:
            self.check_interrupt()
            try:
                return self.bench.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            self.server.track()
            if self.server.proc.poll() is not None and server_gone_at is None:
                server_gone_at = time.monotonic()
            too_long = time.monotonic() - t0 > self.args.bench_timeout
            orphaned = server_gone_at is not None and time.monotonic() - server_gone_at > 120
            if too_long or orphaned:
                m["error"] = ("exceeded --bench-timeout" if too_long else "server gone for 120 s; bench still running")
                return self._stop_bench()

    def _stop_bench(self) -> int | None:
        """SIGTERM the bench's process group (it then writes an incomplete receipt), SIGKILL after 15 s."""
        if self.bench is None:
            return None
        if self.bench.poll() is None:
            _signal_group(self.bench.pid, signal.SIGTERM)
            try:
                self.bench.wait(15)
            except subprocess.TimeoutExpired:
                _signal_group(self.bench.pid, signal.SIGKILL)
                self.bench.wait(15)
        return self.bench.returncode

    # ------------------------------------------------------------ the end
    def write_summary(self) -> dict:
        summary = summarize(self.records, [s.name for s in self.sets], exclusivity_checked=self.exclusive,
                            exclusivity_note=self.exclusive_note)
        summary.update(created_at=utc_now(), run="run.json", gpu=self.gpu.info, host=socket.gethostname(),
                       plot="comparison.png", interrupted=self.interrupted is not None)
        title = (f"OpenJEV profile comparison on {socket.gethostname()}, GPU {self.args.gpu}"
                 + (f" ({self.gpu.info['name']})" if self.gpu.info.get("name") else "")
                 + f"; {self.args.repetitions} repetition(s), batch {self.args.batch_size}, {self.args.workers} workers")
        try:
            write_plot(summary, self.out / "comparison.png", title)
        except Exception as exc:  # noqa: BLE001 - the table and summary matter more than the picture
            summary["plot"] = None
            summary["plot_error"] = f"{type(exc).__name__}: {exc}"
        table = format_table(summary)
        summary["table_text"] = table
        atomic_write_json(self.out / "summary.json", summary)
        print(table, flush=True)
        self.run["summary"] = "summary.json"
        return summary


def _recorded_env_key(k: str) -> bool:
    return k in RECORDED_ENV_KEYS or k.startswith(RECORDED_ENV_PREFIXES)


def resolve_server_cmd() -> list[str]:
    raw = os.environ.get(SERVER_CMD_ENV)
    cmd = shlex.split(raw) if raw else [str(DEFAULT_SERVER_CMD)]
    if not cmd:
        raise UserError(f"{SERVER_CMD_ENV} is set but empty")
    prog = cmd[0]
    found = shutil.which(prog) if os.sep not in prog else (prog if Path(prog).is_file() else None)
    if not found:
        raise UserError(f"server command {prog!r} not found" + (f" (from {SERVER_CMD_ENV})" if raw else ""))
    if found.endswith(".sh") and not os.access(found, os.X_OK):
        cmd = ["bash", found, *cmd[1:]]
    else:
        cmd[0] = str(Path(found).absolute()) if os.sep in prog else prog
    return cmd
