"""app/tune_sglang_v100.py: pure parts (profiles, idle wait, summary) and real runs.

The runs drive the real launcher (app/serve_sglang_v100.sh with OPENJEV_BACKEND=transformers,
which execs the embedded backend on the tiny random-weight model) and the real bench, on CPU. No
NVML here: the idle wait is skipped with a recorded reason; where NVML is present (a GPU machine)
the same tests exercise the NVML path with --idle-seconds 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import APP, PY, REPO, SAMPLE, error_lines, free_port, tree_digest

from openjev.common import UserError
from openjev.tune import processes as tune_processes
from openjev.tune import profiles as tune_profiles
from openjev.tune import summary as tune_summary
from openjev.tune import tuner as tune_tuner

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SCRIPT = APP / "tune_sglang_v100.py"


# ================================================================ helpers
def tune_env(tmp_path: Path, **extra) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OPENJEV_BACKEND": "transformers", "OPENJEV_PYTHON": PY,
           "OPENJEV_V100_ROOT": str(tmp_path / "root"), tune_tuner.SERVER_CMD_ENV: ""}
    env.update(extra)
    return env


def tune_args(overlay, sample_tokens, reference, out, port, *extra) -> list[str]:
    return [PY, str(SCRIPT), "--gpu", "0", "--port", str(port), "--out", str(out), "--model", str(overlay),
            "--set", f"S={SAMPLE},{sample_tokens},{reference}", "--repetitions", "1", "--idle-seconds", "0",
            "--stop-timeout", "30", "--start-timeout", "180", *map(str, extra)]


def run_tune(args, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def wait_for(pred, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def run_json(out: Path) -> dict | None:
    try:
        return load(out / "run.json")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ================================================================ profiles and sets (pure)
def test_default_profiles_are_the_runbook_comparison():
    profiles = tune_profiles.parse_profiles(tune_profiles.DEFAULT_PROFILES)
    assert [(p.name, p.schedule_policy, p.max_running_requests, p.extra_args) for p in profiles] == [
        ("fcfs-8", "fcfs", 8, []), ("fcfs-16", "fcfs", 16, []), ("fcfs-32", "fcfs", 32, []), ("lpm-16", "lpm", 16, [])]


def test_profile_syntax_modifiers_names_and_env():
    a, b, c = tune_profiles.parse_profiles("lpm:16+no-radix, fast=fcfs:32+--mem-fraction-static=0.7,lpm:16+MAMBA_FULL_MEMORY_RATIO=0.9")
    assert (a.name, a.extra_args, a.env) == ("lpm-16-no-radix", ["--disable-radix-cache"], {})
    assert (b.name, b.schedule_policy, b.max_running_requests, b.extra_args) == ("fast", "fcfs", 32, ["--mem-fraction-static=0.7"])
    assert (c.name, c.env) == ("lpm-16-mamba-full-memory-ratio-0.9", {"MAMBA_FULL_MEMORY_RATIO": "0.9"})


@pytest.mark.parametrize("spec,words", [
    ("fcfs", ["POLICY:N"]),
    ("fcfs:0", ["positive integer"]),
    ("sjf:8", ["schedule policy", "lpm"]),
    ("fcfs:8+bogus", ["modifier", "bogus"]),
    ("fcfs:8+CUDA_VISIBLE_DEVICES=1", ["CUDA_VISIBLE_DEVICES", "set by the tuner"]),
    ("fcfs:8,fcfs:8", ["appears twice"]),
    ("bad/name=fcfs:8", ["POLICY:N"]),
    ("", ["empty"]),
])
def test_profile_syntax_errors_are_one_clear_message(spec, words):
    with pytest.raises(UserError) as exc:
        tune_profiles.parse_profiles(spec)
    for w in words:
        assert w in str(exc.value)


def test_profiles_from_a_json_file(tmp_path):
    f = tmp_path / "profiles.json"
    f.write_text(json.dumps([{"name": "base", "schedule_policy": "lpm", "max_running_requests": 16,
                              "extra_args": ["--disable-radix-cache"], "env": {"SGLANG_V100_DYNAMIC_PAGED": "0"}},
                             {"schedule_policy": "fcfs", "max_running_requests": 8}]))
    a, b = tune_profiles.parse_profiles(str(f))
    assert a.to_json() == {"name": "base", "schedule_policy": "lpm", "max_running_requests": 16,
                           "extra_args": ["--disable-radix-cache"], "env": {"SGLANG_V100_DYNAMIC_PAGED": "0"}}
    assert b.name == "fcfs-8"
    f.write_text(json.dumps([{"schedule_policy": "fcfs", "max_running_requests": 8, "flags": []}]))
    with pytest.raises(UserError, match="unknown key"):
        tune_profiles.parse_profiles(str(f))
    with pytest.raises(UserError, match="not found"):
        tune_profiles.parse_profiles(str(tmp_path / "missing.json"))


def test_set_syntax(tmp_path):
    s = tune_profiles.parse_set("G=a.jsonl,b.jsonl,refdir")
    assert s.name == "G" and s.inputs.is_absolute() and s.reference.name == "refdir"
    for bad in ("G=a,b", "a,b,c", "G/x=a,b,c"):
        with pytest.raises(UserError, match="NAME=INPUTS"):
            tune_profiles.parse_set(bad)


# ================================================================ idle wait (pure)
@pytest.mark.parametrize("samples,now,idle_s,max_wait,state,idle_for", [
    ([], 0.0, 60, 3600, "waiting", 0.0),                                   # nothing seen yet
    ([(0, 0)], 0.0, 0, 3600, "idle", 0.0),                                 # --idle-seconds 0: one idle sample
    ([(0, 0), (30, 0)], 30.0, 60, 3600, "waiting", 30.0),                  # idle, not long enough yet
    ([(0, 0), (30, 0), (60, 0)], 60.0, 60, 3600, "idle", 60.0),            # waited enough
    ([(0, 0), (50, 2), (60, 0), (100, 0)], 100.0, 60, 3600, "waiting", 40.0),  # a process reset the clock
    ([(0, 0), (50, 2), (60, 0), (120, 0)], 120.0, 60, 3600, "idle", 60.0),
    ([(0, 0), (50, None), (60, 0)], 61.0, 5, 3600, "waiting", 1.0),        # a failed sample counts as busy
    ([(0, 1), (3599, 1), (3600, 1)], 3600.0, 60, 3600, "timeout", 0.0),    # never idle: gave up
    ([(3540, 0), (3600, 0)], 3600.0, 60, 3600, "idle", 60.0),              # idle wins at the deadline
    ([(3590, 0), (3600, 0)], 3600.0, 60, 3600, "timeout", 10.0),
])
def test_idle_decision(samples, now, idle_s, max_wait, state, idle_for):
    d = tune_tuner.idle_decision(samples, start=0.0, now=now, idle_seconds=idle_s, max_wait=max_wait)
    assert (d.state, d.idle_for, d.waited) == (state, idle_for, now)


# ================================================================ summary and fastest (pure)
def _m(profile, s, mode, median, **kw):
    m = {"profile": profile, "set": s, "mode": mode, "exit_code": 0, "receipt_found": True, "receipt_kind": "openjev-bench",
         "receipt_mode": mode, "valid": True, "complete": True, "audit_passed": True, "median_pass_s": median,
         "receipt": f"{profile}/{s}.{mode}.json"}
    m.update(kw)
    return m


def _p(name, *ms, status="done", failure=None):
    return {"name": name, "status": status, "failure": failure, "measurements": list(ms)}


def test_fastest_per_set_mode_and_overall_by_warm_sum():
    profiles = [
        _p("fcfs-8", _m("fcfs-8", "G", "cold", 13.4), _m("fcfs-8", "G", "warm", 2.7),
           _m("fcfs-8", "T", "cold", 29.6), _m("fcfs-8", "T", "warm", 4.7)),
        _p("fcfs-16", _m("fcfs-16", "G", "cold", 12.0), _m("fcfs-16", "G", "warm", 2.9),
           _m("fcfs-16", "T", "cold", 28.0), _m("fcfs-16", "T", "warm", 4.6)),
        # fastest warm G, but its audit failed: never a winner
        _p("fcfs-32", _m("fcfs-32", "G", "cold", 11.0), _m("fcfs-32", "G", "warm", 1.0, audit_passed=False, exit_code=2),
           _m("fcfs-32", "T", "cold", 27.0), _m("fcfs-32", "T", "warm", 4.0)),
        _p("lpm-16", _m("lpm-16", "G", "cold", 10.0), status="failed", failure="server exited unexpectedly"),
    ]
    s = tune_summary.summarize(profiles, ["G", "T"], exclusivity_checked=True)
    f = s["fastest"]
    assert f["per_set"]["G"]["cold"] == {"profile": "lpm-16", "median_pass_s": 10.0}
    assert f["per_set"]["G"]["warm"]["profile"] == "fcfs-8"
    assert f["per_set"]["T"]["warm"]["profile"] == "fcfs-32"
    assert f["overall"]["profile"] == "fcfs-8" and f["overall"]["warm_sum_s"] == pytest.approx(7.4)
    assert f["overall"]["cold_rule_profile"] == "fcfs-16"
    assert set(f["ineligible"]) == {"fcfs-32", "lpm-16"}
    assert s["promoted"] is None
    assert not s["checks"]["all_passed"]
    assert any("fcfs-32/G/warm" in x and "exit 2" in x for x in s["checks"]["failures"])
    assert any("group audit failed" in x for x in s["checks"]["failures"])
    assert any(x.startswith("lpm-16: failed") for x in s["checks"]["failures"])
    table = tune_summary.format_table(s)
    assert "fastest overall (sum of warm medians): fcfs-8" in table and "1.000!" in table and "CHECKS FAILED" in table
    assert "nothing was promoted" in table


def test_ties_go_to_the_earlier_profile_and_all_ok_summary():
    profiles = [_p(n, _m(n, "S", "cold", 1.0), _m(n, "S", "warm", 0.5)) for n in ("a", "b")]
    s = tune_summary.summarize(profiles, ["S"], exclusivity_checked=False, exclusivity_note="NVML unavailable: x")
    assert s["fastest"]["overall"]["profile"] == "a" and s["fastest"]["per_set"]["S"]["warm"]["profile"] == "a"
    assert s["checks"]["all_passed"]
    table = tune_summary.format_table(s)
    assert "GPU exclusivity: NOT checked (NVML unavailable: x)" in table and "every correctness check held" in table


@pytest.mark.parametrize("change,words", [
    ({"exit_code": 4}, "bench exit 4"),
    ({"receipt_found": False}, "no bench receipt"),
    ({"valid": False, "reasons": ["server unreachable"]}, "not valid (server unreachable)"),
    ({"complete": False}, "incomplete"),
    ({"exclusivity_checked": True}, "exclusivity"),
    ({"exclusivity_checked": True, "exclusivity_valid": False}, "exclusivity"),
    ({"receipt_mode": "warm"}, "not an openjev-bench cold receipt"),
    ({"median_pass_s": None}, "no median"),
])
def test_measurement_checks(change, words):
    assert tune_summary.measurement_failures(_m("p", "S", "cold", 1.0)) == []
    assert tune_summary.measurement_failures(_m("p", "S", "cold", 1.0, exclusivity_checked=True, exclusivity_valid=True)) == []
    bad = tune_summary.measurement_failures(_m("p", "S", "cold", 1.0, **change))
    assert bad and words in " ".join(bad)


def test_headline_reads_the_bench_receipt_keys():
    receipt = {"kind": "openjev-bench", "mode": "warm", "valid": True, "complete": True, "exit_code": 0,
               "inputs": {"rows": 22}, "exclusive": {"valid": True},
               "outputs": {"candidate": {"file": "x.candidate.npy"}, "passes": {"file": "x.passes.npy"}},
               "warm": {"passes_done": 2, "passes_planned": 2,
                        "timing": {"median_wall_s": 2.5, "pairs_per_s": 8.8, "batch_latency_s": {"p50": 0.1, "p99": 0.2}},
                        "agreement_final": {"max_abs_dp_e": 0.01, "argmax_changes_count": 0},
                        "audit": {"failed": False, "failures_total": 0, "ties_total": 1, "groups": 4}}}
    h = tune_summary.headline(receipt, "warm")
    assert h["median_pass_s"] == 2.5 and h["pairs_per_s"] == 8.8 and h["audit_passed"] is True
    assert h["exclusivity_valid"] is True and h["outputs"] == {"candidate": "x.candidate.npy", "passes": "x.passes.npy"}
    assert tune_summary.headline(None, "warm") == {}


def test_pid_file_formats(tmp_path):
    f = tmp_path / "x.pid"
    assert tune_processes.read_pidfile(f) is None
    f.write_text("123\n1700000000.25\n")
    assert tune_processes.read_pidfile(f) == {"pid": 123, "start_time": 1700000000.25}
    f.write_text(json.dumps({"pid": 5, "start_time": 1.0, "host": "h"}))
    assert tune_processes.read_pidfile(f)["host"] == "h"
    f.write_text("garbage")
    with pytest.raises(UserError, match="unreadable"):
        tune_processes.read_pidfile(f)


# ================================================================ refusals (no server starts)
def test_refusals_before_anything_starts(overlay, sample_tokens, reference, tmp_path):
    env = tune_env(tmp_path)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    before = tree_digest(tmp_path)
    port = free_port()

    r = run_tune(tune_args(overlay, sample_tokens, reference, existing, port), env)
    assert r.returncode == 1 and error_lines(r.stderr) and "already exists" in error_lines(r.stderr)[0]
    assert tree_digest(tmp_path) == before  # nothing touched: no pid file, no log, DIR unchanged

    r = run_tune(tune_args(overlay, sample_tokens, reference, tmp_path / "a", 31000), env)
    assert r.returncode == 1 and "31000 is the production endpoint" in error_lines(r.stderr)[0]

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        r = run_tune(tune_args(overlay, sample_tokens, reference, tmp_path / "b", busy.getsockname()[1]), env)
    assert r.returncode == 1 and "already in use" in error_lines(r.stderr)[0]

    r = run_tune(tune_args(overlay, sample_tokens, reference, tmp_path / "c", port, "--profiles", "fcfs:8+oops"), env)
    assert r.returncode == 1 and "modifier 'oops'" in error_lines(r.stderr)[0]

    r = run_tune(tune_args(overlay, sample_tokens, reference, tmp_path / "d", port, "--truncate", "8"), env)
    assert r.returncode == 1 and "--set S:" in error_lines(r.stderr)[0] and "truncat" in error_lines(r.stderr)[0]

    r = run_tune(tune_args(tmp_path / "nomodel", sample_tokens, reference, tmp_path / "e", port), env)
    assert r.returncode == 1 and "model directory" in error_lines(r.stderr)[0]

    r = run_tune(tune_args(overlay, sample_tokens, reference, tmp_path / "f", port),
                 tune_env(tmp_path, **{tune_tuner.SERVER_CMD_ENV: "/nonexistent/serve"}))
    assert r.returncode == 1 and "not found" in error_lines(r.stderr)[0]
    for name in "abcdef":
        assert not (tmp_path / name).exists() and not (tmp_path / f"{name}.pid").exists()


# ================================================================ real runs
def test_two_profiles_end_to_end(overlay, sample_tokens, reference, tmp_path):
    out = tmp_path / "tuning"
    r = run_tune(tune_args(overlay, sample_tokens, reference, out, free_port(), "--profiles", "fcfs:4,lpm:8"),
                 tune_env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]

    run = load(out / "run.json")
    assert run["kind"] == "openjev-tune-run" and run["phase"] == "done" and run["exit_code"] == 0
    assert run["server_pid"] is None and run["tuner"]["pid"] > 0 and run["tuner"]["start_time"] > 0
    assert [p["status"] for p in run["profiles"]] == ["done", "done"]
    if not run["config"]["nvml"]["available"]:
        assert run["config"]["idle_wait"].startswith("skipped: ") and "NOT checked" in r.stdout
        assert run["profiles"][0]["idle_wait"]["result"] == "skipped"
    else:
        assert run["profiles"][0]["idle_wait"]["result"] == "idle"
    assert [(m["profile"], m["set"], m["mode"]) for m in run["measurements"]] == [
        ("fcfs-4", "S", "cold"), ("fcfs-4", "S", "warm"), ("lpm-8", "S", "cold"), ("lpm-8", "S", "warm")]
    for m in run["measurements"]:
        assert m["exit_code"] == 0 and m["checks_ok"] and m["median_pass_s"] > 0 and m["rows"] == 22
        assert (out / m["receipt"]).is_file() and len(m["arrays"]) == 2
        assert ("--cold-cache" in m["argv"]) == (m["mode"] == "cold")

    for name, cap, policy in (("fcfs-4", 4, "fcfs"), ("lpm-8", 8, "lpm")):
        pdir = out / name
        for f in ("profile.json", "server.log", "server_command.json", "server_info.json",
                  "S.cold.json", "S.cold.candidate.npy", "S.cold.passes.npy", "S.cold.bench.log",
                  "S.warm.json", "S.warm.candidate.npy", "S.warm.passes.npy", "S.warm.bench.log"):
            assert (pdir / f).is_file(), f
        info = load(pdir / "server_info.json")
        assert info["max_running_requests"] == cap and info["requested_schedule_policy"] == policy
        cmd = load(pdir / "server_command.json")
        assert cmd["env_given"]["MAX_RUNNING_REQUESTS"] == str(cap) and cmd["env_given"]["SCHEDULE_POLICY"] == policy
        assert cmd["env_given"]["CUDA_VISIBLE_DEVICES"] == "0"
        assert "serve_transformers.py" in " ".join(cmd["process_argv"])  # the launcher exec'd the real server
        assert cmd["process_argv"][cmd["process_argv"].index("--max-running-requests") + 1] == str(cap)
        prof = load(pdir / "profile.json")
        assert prof["server"]["stop"]["clean"] and prof["server"]["stop"]["signals"] == ["SIGTERM"]
        assert gone(prof["server"]["pid"])
        assert load(pdir / "S.warm.json")["kind"] == "openjev-bench"

    summary = load(out / "summary.json")
    assert summary["promoted"] is None and summary["checks"]["all_passed"]
    assert summary["fastest"]["overall"]["profile"] in ("fcfs-4", "lpm-8")
    assert {(row["profile"], row["mode"]) for row in summary["table"]} == {
        ("fcfs-4", "cold"), ("fcfs-4", "warm"), ("lpm-8", "cold"), ("lpm-8", "warm")}
    assert "fastest overall (sum of warm medians)" in r.stdout and "fcfs-4" in r.stdout and "lpm-8" in r.stdout
    png = (out / "comparison.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 5000
    assert not (tmp_path / "tuning.pid").exists()  # removed at the end


def test_failed_start_and_server_death_are_recorded_and_the_next_profile_runs(overlay, sample_tokens, reference,
                                                                                tmp_path):
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps([
        # the embedded backend refuses --context-length 1 and exits: the server never becomes healthy
        {"name": "bad-start", "schedule_policy": "fcfs", "max_running_requests": 4, "extra_args": ["--context-length", "1"]},
        {"name": "victim", "schedule_policy": "fcfs", "max_running_requests": 4},
        {"name": "good", "schedule_policy": "lpm", "max_running_requests": 8},
    ]))
    out = tmp_path / "tuning"
    proc = subprocess.Popen(tune_args(overlay, sample_tokens, reference, out, free_port(), "--profiles", profiles),
                            env=tune_env(tmp_path), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # kill the victim's server once its first bench has started: the bench loses its server (exit 4)
        wait_for(lambda: (out / "victim" / "S.cold.bench.log").exists(), 240, "the victim's first bench")
        victim_pid = run_json(out)["server_pid"]
        os.kill(victim_pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stdout + stderr[-4000:]
    run = load(out / "run.json")
    assert run["phase"] == "failed" and run["exit_code"] == 1
    bad, victim, good = run["profiles"]
    assert bad["status"] == "failed" and "before /health answered 200" in bad["failure"]
    assert "context-length" in bad["server_log_tail"]  # the server's own last words are kept
    assert bad["measurements"] == [] and gone(bad["server"]["pid"])
    assert victim["status"] == "failed" and "exited unexpectedly (exit code -9)" in victim["failure"]
    assert victim["measurements"] and victim["measurements"][0]["exit_code"] == 4
    assert victim["server"]["stop"]["exited_before_stop"] and gone(victim_pid)
    assert good["status"] == "done" and all(m["checks_ok"] for m in good["measurements"])
    summary = load(out / "summary.json")
    assert not summary["checks"]["all_passed"] and summary["fastest"]["overall"]["profile"] == "good"
    assert set(summary["fastest"]["ineligible"]) == {"bad-start", "victim"}
    assert "CHECKS FAILED" in stdout and (out / "comparison.png").read_bytes().startswith(PNG_SIGNATURE)


def test_daemon_pid_guard_and_sigterm_stops_the_server(overlay, sample_tokens, reference, tmp_path):
    out = tmp_path / "tuning"
    env = tune_env(tmp_path)
    args = tune_args(overlay, sample_tokens, reference, out, free_port(), "--profiles", "fcfs:4", "--daemon")
    first = run_tune(args, env, timeout=60)
    assert first.returncode == 0, first.stderr
    pidfile, log = tmp_path / "tuning.pid", tmp_path / "tuning.log"
    rec = load(pidfile)
    daemon = psutil.Process(rec["pid"])
    assert f"tuner daemon pid {rec['pid']}" in first.stdout
    assert abs(daemon.create_time() - rec["start_time"]) < 0.05 and rec["out"] == str(out)
    assert daemon.ppid() != os.getpid() and os.getsid(rec["pid"]) != os.getsid(0)  # detached: another session
    try:
        # a second invocation for the same DIR refuses while the daemon lives
        second = run_tune(args, env, timeout=60)
        assert second.returncode == 1 and "another tuner is running" in error_lines(second.stderr)[0]
        assert load(pidfile) == rec

        # SIGTERM once the server runs: the server is stopped, phase "interrupted", pid file removed
        run = wait_for(lambda: (r := run_json(out)) and r["server_pid"] and r, 120, "the server to start")
        server_pid = run["server_pid"]
        assert psutil.pid_exists(server_pid)
        os.kill(rec["pid"], signal.SIGTERM)
        wait_for(lambda: gone(rec["pid"]), 90, "the daemon to exit")
    finally:
        if not gone(rec["pid"]):
            os.kill(rec["pid"], signal.SIGKILL)
    run = load(out / "run.json")
    assert run["phase"] == "interrupted" and run["exit_code"] == 128 + signal.SIGTERM
    assert run["profiles"][0]["status"] == "interrupted" and "SIGTERM" in run["profiles"][0]["failure"]
    assert run["profiles"][0]["server"]["stop"]["clean"]
    assert gone(server_pid) and not any(gone(p) is False for p in run["profiles"][0]["server"]["stop"]["tree_pids"])
    assert not pidfile.exists()
    assert "SIGTERM received" in log.read_text()


def test_sigterm_in_the_foreground_during_the_bench(overlay, sample_tokens, reference, tmp_path):
    out = tmp_path / "tuning"
    proc = subprocess.Popen(tune_args(overlay, sample_tokens, reference, out, free_port(), "--profiles", "fcfs:4,lpm:8",
                                      # enough passes that the bench is surely still running when the signal lands
                                      "--repetitions", "200"),
                            env=tune_env(tmp_path), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "fcfs-4" / "S.cold.bench.log").exists(), 240, "the first bench")
        server_pid = run_json(out)["server_pid"]
        assert run_json(out)["phase"] == "benchmarking"
        assert (tmp_path / "tuning.pid").is_file() and load(tmp_path / "tuning.pid")["pid"] == proc.pid
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    run = load(out / "run.json")
    assert run["phase"] == "interrupted" and run["current_profile"] == "fcfs-4"
    assert [p["status"] for p in run["profiles"]] == ["interrupted", "not-run"]
    # the bench that was running is stopped too, and its measurement kept (it failed, so the check fails)
    (m,) = run["measurements"]
    assert "SIGTERM" in m["error"] and m["exit_code"] != 0 and not m["checks_ok"]
    assert gone(server_pid) and not (tmp_path / "tuning.pid").exists()
    assert not [p for p in psutil.process_iter(["cmdline"])
                if str(out) in " ".join(p.info["cmdline"] or [])]  # no bench or server of this run left


def test_stale_pid_files_are_reported_and_replaced(overlay, sample_tokens, reference, tmp_path):
    # a server command that exits at once keeps these runs short; the guard is what is tested
    env = tune_env(tmp_path, **{tune_tuner.SERVER_CMD_ENV: "false"})
    for n, stale in enumerate([{"pid": dead_pid(), "start_time": 1.0},  # process gone
                               {"pid": os.getpid(), "start_time": 12345.0}]):  # pid alive, another start time
        out = tmp_path / f"t{n}"
        (tmp_path / f"t{n}.pid").write_text(json.dumps(stale))
        r = run_tune(tune_args(overlay, sample_tokens, reference, out, free_port(), "--profiles", "fcfs:4"), env)
        assert "stale pid file" in r.stderr and ("is gone" if n == 0 else "start time differs") in r.stderr
        assert r.returncode == 1  # the server command failed: recorded, non-zero
        run = load(out / "run.json")
        assert "stale pid file" in run["tuner"]["stale_pid_file_replaced"]
        assert run["profiles"][0]["status"] == "failed" and "exited with code 1" in run["profiles"][0]["failure"]
        assert not (tmp_path / f"t{n}.pid").exists()
    (tmp_path / "t9.pid").write_text("not a pid file")
    r = run_tune(tune_args(overlay, sample_tokens, reference, tmp_path / "t9", free_port()), env)
    assert r.returncode == 1 and "unreadable" in error_lines(r.stderr)[0] and not (tmp_path / "t9").exists()


# ================================================================ the tuner killed outright
def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _cmdline(p: psutil.Process) -> str:
    """A process's command line; "" for one that has ended meanwhile (gone, or a zombie not yet reaped)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _kill_leftovers(procs) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def test_sigkill_of_the_tuner_leaves_no_process_and_the_next_run_names_the_dead_run(overlay, sample_tokens, reference,
                                                                                        tmp_path):
    out, port = tmp_path / "tuning", free_port()
    env = tune_env(tmp_path)
    args = tune_args(overlay, sample_tokens, reference, out, port, "--profiles", "fcfs:4", "--repetitions", "200")
    with open(tmp_path / "tuner.stderr", "wb") as err:
        proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
    children: list[psutil.Process] = []
    try:
        wait_for(lambda: (r := run_json(out)) and r["phase"] == "benchmarking"
                 and (out / "fcfs-4" / "S.cold.bench.log").exists(), 240, "the first bench")
        time.sleep(1.0)  # the bench is sending requests now
        children = _descendants(proc.pid)
        roles = " ".join(_cmdline(p) for p in children)
        assert "bench_classify_v100.py" in roles and "serve_transformers.py" in roles, roles
        proc.kill()  # SIGKILL: no handler runs in the tuner
        proc.wait(10)
        killed_at = time.monotonic()
        wait_for(lambda: all(gone(p.pid) for p in children), 10, "every process of the run to end")
        assert time.monotonic() - killed_at <= 10
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_leftovers(children)
    run = load(out / "run.json")  # valid JSON
    assert run["tuner"]["pid"] == proc.pid
    assert not (out / "fcfs-4" / "S.cold.json").exists()  # the bench did not write into the dead run

    # the next invocation on the same DIR and port names the dead run
    r = run_tune(args, env, timeout=60)
    line = error_lines(r.stderr)[0]
    assert r.returncode == 1 and str(out) in line and f"tuner pid {proc.pid}" in line and "is gone" in line, r.stderr
    assert "still running" not in line  # nothing of it is left
    # and so does --status
    st = run_tune([PY, str(SCRIPT), "--status", str(out)], env, timeout=60)
    assert st.returncode == 0, st.stderr
    assert f"tuner pid {proc.pid} (started" in st.stdout and "is gone" in st.stdout, st.stdout
    assert "no process of this run is running" in st.stdout and "phase 'tuner-died'" in st.stdout
    assert run_json(out)["profiles"][0]["status"] == "interrupted"


def test_a_port_held_by_a_process_of_a_dead_run_is_reported_with_its_run(overlay, sample_tokens, reference, tmp_path):
    # what is left when every layer failed (e.g. the watchdog killed too and a server ignoring SIGTERM): a
    # listener carrying the run's tag, and a run.json whose tuner is gone
    dead_dir = tmp_path / "old-run"
    dead_dir.mkdir()
    tuner_pid = dead_pid()
    (dead_dir / "run.json").write_text(json.dumps({
        "kind": "openjev-tune-run", "run_id": "feedc0de", "phase": "benchmarking", "exit_code": None,
        "updated_at": "2026-01-01T00:00:00Z", "current_profile": "fcfs-4",
        "tuner": {"pid": tuner_pid, "start_time": 1.0, "started_at": "2026-01-01T00:00:00Z",
                  "host": socket.gethostname()},
        "children": [], "profiles": [{"name": "fcfs-4", "status": "running", "measurements": []}]}))
    port = free_port()
    holder = subprocess.Popen(
        [PY, "-c", "import socket,sys,time; s=socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(1); "
                   "print('up', flush=True); time.sleep(120)", str(port)],
        env={**os.environ, tune_processes.RUN_ENV: "feedc0de", tune_processes.OUT_ENV: str(dead_dir)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        env = tune_env(tmp_path)
        r = run_tune(tune_args(overlay, sample_tokens, reference, tmp_path / "new", port), env, timeout=60)
        line = error_lines(r.stderr)[0]
        assert r.returncode == 1 and f"port {port} on 127.0.0.1 is already in use" in line
        assert f"held by pid {holder.pid}" in line and f"a process of tuner run {dead_dir}" in line
        assert f"tuner pid {tuner_pid}" in line and "is gone" in line and f"kill -TERM {holder.pid}" in line
        assert not (tmp_path / "new").exists()
        # the same DIR: named as a dead run with its live process
        r = run_tune(tune_args(overlay, sample_tokens, reference, dead_dir, free_port()), env, timeout=60)
        line = error_lines(r.stderr)[0]
        assert "already exists" in line and "is gone" in line and f"still running: pid {holder.pid}" in line
        st = run_tune([PY, str(SCRIPT), "--status", str(dead_dir)], env, timeout=60)
        assert st.returncode == 0 and f"end them with: kill -TERM {holder.pid}" in st.stdout, st.stdout + st.stderr
    finally:
        holder.kill()
        holder.wait()
    st = run_tune([PY, str(SCRIPT), "--status", str(tmp_path / "nowhere")], env, timeout=60)
    assert st.returncode == 1 and "no such directory" in error_lines(st.stderr)[0]
    st = run_tune([PY, str(SCRIPT), "--port", "1"], env, timeout=60)
    assert st.returncode == 1 and "--gpu, --out" in error_lines(st.stderr)[0]
