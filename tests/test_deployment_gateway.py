"""Production deployment, for real: systemd socket -> HAProxy gateway -> two replicas on 127.0.0.1, run by
tests/openjev_testsupport/unit_runner.py (tests/_deployment_support.py says what plays the part of systemd).
Socket activation with systemd's own tool, a replica crash and a graceful replica restart under load,
drain and ready over HAProxy's runtime API, the gateway restarted, reloaded and crashed under load, and
the production port held against a second standalone server.

Skips (pytest -rs shows why) when haproxy (apt-get install haproxy) or systemd-socket-activate
(apt-get install systemd) are missing. OPENJEV_DEPLOY_REQUESTS scales the failover
load (default 2000 requests from 8 clients, about a minute on 2 shared cores; the gateway
restart test uses a third of it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from _deployment_support import (HAPROXY, LAUNCHER, SSA, Load, admin, needs_haproxy, needs_ssa, render, replica_stats,
                                 wait_for)
from _deployment_support import data  # noqa: F401 - fixture
from conftest import PY, REPO, error_lines, free_port, free_ports_on

from openjev_testsupport import unit_runner

FAILOVER_REQUESTS = int(os.environ.get("OPENJEV_DEPLOY_REQUESTS", "2000"))


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def deployment(overlay, tmp_path_factory):
    """The rendered target running under unit_runner: socket, gateway, replicas 0 and 1."""
    if HAPROXY is None:
        pytest.skip("haproxy is not installed: apt-get install -y haproxy (Debian package)")
    base = tmp_path_factory.mktemp("deploy")
    r = render(base, overlay, free_port(), free_port(), free_ports_on("127.0.0.1", 2))
    # Short runtime path: AF_UNIX socket paths are limited to 107 bytes.
    runtime = Path(f"/tmp/openjev-deploy-test-{os.getpid()}")
    mgr = unit_runner.Manager(r["units"], runtime, base / "journal")
    try:
        mgr.start_target("openjev.target", wait=True)
        r["mgr"] = mgr
        r["admin"] = runtime / "openjev-gateway" / "admin.sock"
        r["url"] = f"http://127.0.0.1:{r['port']}"
        r["gateway"] = mgr.service("openjev-gateway.service")
        r["replicas"] = [mgr.service("openjev-replica@0.service"), mgr.service("openjev-replica@1.service")]
        wait_both_up(r)
        yield r
    finally:
        mgr.close()
        shutil.rmtree(runtime, ignore_errors=True)


def wait_both_up(r: dict, timeout: float = 240) -> None:
    def up():
        st = replica_stats(r["admin"])
        return all(st.get(f"replica{g}", {}).get("status") == "UP" for g in (0, 1)) and st

    wait_for(up, timeout, "both replicas UP in HAProxy")


def journal(r: dict, unit: str) -> str:
    return (r["mgr"].log_dir / f"{unit}.log").read_text(errors="replace")


# ---------------------------------------------------------------- socket activation (systemd's own tool)
@needs_ssa
@needs_haproxy
def test_socket_activation_serves_connections_made_before_the_gateway_is_up(deployment, overlay, data, tmp_path):
    """systemd-socket-activate binds the port and starts the gateway only on the first connection.

    Between the two, a 1.5 s `sleep` stands in for a slow gateway start so the window can be
    observed: all requests are connected and written while the process is still the shell
    (no HAProxy exists), the kernel queues them on the systemd-held socket, and HAProxy answers
    every one of them once it is up, with the reference logits.
    """
    rows, ref = data
    port = free_port()
    # A second rendering: the same replicas, its own endpoint and stats ports.
    render(tmp_path, overlay, port, free_port(), deployment["replica_ports"][0])
    mgr = unit_runner.Manager(tmp_path / "units", tmp_path / "run", tmp_path / "journal")
    try:
        svc = mgr.service("openjev-gateway.service")
        env = svc.environment()
        (tmp_path / "run" / "openjev-gateway").mkdir(parents=True, exist_ok=True)
        exec_start = svc.command("ExecStart", env)[0]  # the unit's own command line
    finally:
        mgr.close()
    cmd = [SSA, "-l", f"127.0.0.1:{port}", "--fdname=openjev-gateway.socket",
           "-E", f"OPENJEV_GATEWAY_ADMIN={env['OPENJEV_GATEWAY_ADMIN']}",
           "/bin/sh", "-c", 'sleep 1.5; exec "$0" "$@"', *exec_start]
    log = tmp_path / "ssa.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "Listening on" in log.read_text(), 20, "systemd-socket-activate to listen")
        exe = lambda: os.path.basename(os.readlink(f"/proc/{proc.pid}/exe"))  # noqa: E731
        assert exe() == "systemd-socket-activate"

        n = 8
        socks = []
        for i in range(n):  # connect and send the whole request now; read later
            body = json.dumps({"input_ids": [rows[i]]}).encode()
            s = socket.create_connection(("127.0.0.1", port), timeout=60)
            s.sendall(b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            socks.append(s)
        sent_while = exe()
        haproxy_children = subprocess.run(["pgrep", "-P", str(proc.pid), "-x", "haproxy"], capture_output=True).stdout
        # still systemd-socket-activate itself, or the shell sleeping before exec'ing HAProxy
        assert sent_while in ("systemd-socket-activate", "dash", "sh", "bash"), f"gateway already {sent_while!r}"
        assert not haproxy_children

        answers = []
        for s in socks:
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
            s.close()
            head, _, body = raw.partition(b"\r\n\r\n")
            answers.append((head.split(b"\r\n")[0], body))
        assert exe() == "haproxy"
        for i, (status, body) in enumerate(answers):
            assert status == b"HTTP/1.1 200 OK", (status, body[:200])
            assert np.array_equal(np.asarray(json.loads(body)["logits"], dtype=np.float32), ref[i:i + 1])
        text = log.read_text()
        assert "Communication attempt on fd 3" in text and "Execing /bin/sh" in text
        print(f"\nsocket activation: {n} requests connected and sent while pid {proc.pid} was {sent_while!r} "
              f"(no HAProxy yet); all {n} answered 200 with the reference logits by HAProxy (pid {proc.pid}, "
              "LISTEN_FDS=1, fd 3)")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)  # soft stop, like the unit's KillSignal
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


# ---------------------------------------------------------------- failover
@needs_haproxy
def test_replica_crash_fails_no_request_and_the_replica_rejoins(deployment, data):
    rows, ref = data
    r = deployment
    wait_both_up(r)
    victim = r["replicas"][0]
    pid_before = victim.main_pid
    before = replica_stats(r["admin"])

    load = Load(r["url"], rows, ref, FAILOVER_REQUESTS).start()
    load.wait_done(FAILOVER_REQUESTS // 3)
    in_flight_at_kill = load.in_flight
    on_victim_at_kill = int(replica_stats(r["admin"])["replica0"]["scur"])  # its open requests, per HAProxy
    t_kill = time.monotonic()
    victim.kill(signal.SIGKILL)  # the replica and everything in its group die at once
    t_down = wait_for(lambda: replica_stats(r["admin"])["replica0"]["status"].startswith("DOWN") and time.monotonic(),
                      60, "HAProxy to mark replica0 DOWN")
    load.join()
    # Restart=on-failure (RestartSec=5s) brings it back; HAProxy admits it after 2 good checks.
    t_up = wait_for(lambda: replica_stats(r["admin"])["replica0"]["status"] == "UP" and time.monotonic(), 240,
                    "replica0 to rejoin (UP)")
    assert victim.main_pid not in (None, pid_before)
    assert len(victim.restarts()) >= 1

    stot_rejoined = int(replica_stats(r["admin"])["replica0"]["stot"])
    after = Load(r["url"], rows, ref, 96).start().join()
    st = replica_stats(r["admin"])
    summary = {
        "requests": load.n, "clients": load.clients, "failures": len(load.failures), "mismatches": len(load.mismatches),
        "in_flight_at_kill": in_flight_at_kill, "in_flight_on_killed_replica": on_victim_at_kill,
        "served_by": load.by_replica,
        "seconds_to_down": round(t_down - t_kill, 2), "seconds_to_rejoin": round(t_up - t_kill, 2),
        "retries": int(st["replica0"]["wretr"]) + int(st["replica1"]["wretr"]) - int(before["replica0"]["wretr"])
        - int(before["replica1"]["wretr"]),
        "redispatches": int(st["replica0"]["wredis"]) + int(st["replica1"]["wredis"])
        - int(before["replica0"]["wredis"]) - int(before["replica1"]["wredis"]),
        "after_rejoin": {"requests": after.n, "failures": len(after.failures), "mismatches": len(after.mismatches),
                         "served_by": after.by_replica},
        "throughput_rps": round(load.n / load.seconds, 1),
    }
    print(f"\nfailover: {json.dumps(summary)}")
    assert not load.failures, load.failures[:5]
    assert not load.mismatches, load.mismatches[:10]
    assert load.by_replica.get("replica0", 0) > 0 and load.by_replica.get("replica1", 0) > 0
    # Back in rotation: the restarted replica answers requests again.
    assert not after.failures and not after.mismatches
    assert after.by_replica.get("replica0", 0) > 0, after.by_replica
    assert int(st["replica0"]["stot"]) > stot_rejoined


@needs_haproxy
def test_replica_restart_under_load_and_drain_over_the_runtime_api(deployment, data):
    """`systemctl restart openjev-replica@1` (SIGTERM: graceful) under load fails nothing; then the
    operator's drain/ready commands of DEPLOYMENT-eva01.md steer traffic as documented."""
    rows, ref = data
    r = deployment
    wait_both_up(r)
    victim = r["replicas"][1]
    pid0 = victim.main_pid
    load = Load(r["url"], rows, ref, max(300, FAILOVER_REQUESTS // 4)).start()
    load.wait_done(load.n // 4)
    in_flight = load.in_flight
    victim.restart(wait=True)  # SIGTERM to the server, wait for it to exit, start it again
    load.join()
    assert victim.main_pid not in (None, pid0)
    assert not load.failures, load.failures[:5]
    assert not load.mismatches
    wait_both_up(r)

    assert admin(r["admin"], "set server openjev/replica0 state drain").strip() == ""
    drained = Load(r["url"], rows, ref, 48).start().join()
    assert drained.by_replica == {"replica1": 48} and not drained.failures
    assert replica_stats(r["admin"])["replica0"]["status"] == "DRAIN"
    admin(r["admin"], "set server openjev/replica0 state ready")
    both = Load(r["url"], rows, ref, 48).start().join()
    assert set(both.by_replica) == {"replica0", "replica1"} and not both.failures
    print(f"\nreplica restart (SIGTERM) under load: {load.n} requests, {in_flight} in flight at the restart, "
          f"{len(load.failures)} failed, {len(load.mismatches)} mismatched; drain: {drained.by_replica}, "
          f"ready: {both.by_replica}")


# ---------------------------------------------------------------- gateway restart, reload, crash
@needs_haproxy
def test_gateway_restart_reload_and_crash_under_load(deployment, data):
    """restart (SIGUSR1 soft stop, new process on the held socket), reload (SIGUSR2) and a crash
    (SIGKILL, then Restart=always) under load. Goal: none lost on restart and reload; a crash
    may lose at most the requests in flight at that moment. The test reports each count."""
    rows, ref = data
    r = deployment
    wait_both_up(r)
    gw = r["gateway"]
    n = max(240, FAILOVER_REQUESTS // 3)
    load = Load(r["url"], rows, ref, n).start()
    events = []

    load.wait_done(n // 4)
    pid0, t = gw.main_pid, time.monotonic()
    events.append(("restart", t, load.in_flight))
    gw.restart()  # blocks: old master soft-stops (in-flight finish), new master READY=1
    restart_gap = time.monotonic() - t
    assert gw.main_pid not in (None, pid0)

    load.wait_done(n // 2)
    events.append(("reload", time.monotonic(), load.in_flight))
    gw.reload()

    load.wait_done(3 * n // 4)
    pid1 = gw.main_pid
    events.append(("crash", time.monotonic(), load.in_flight))
    gw.kill(signal.SIGKILL)  # master and worker die; Restart=always starts a new one after 1 s
    wait_for(lambda: gw.main_pid not in (None, pid1) and gw.main_pid, 30, "the gateway to be restarted")
    load.join()

    def lost_between(t0, t1):
        return [f for f in load.failures if t0 <= f[0] < t1]

    bounds = [e[1] for e in events] + [float("inf")]
    report = {name: {"in_flight": inflight, "failed": len(lost_between(bounds[k], bounds[k + 1]))}
              for k, (name, _, inflight) in enumerate(events)}
    report["restart"]["seconds_stop_to_ready"] = round(restart_gap, 2)
    early = [f for f in load.failures if f[0] < bounds[0]]
    print(f"\ngateway under load ({n} requests, {load.clients} clients): {json.dumps(report)}; "
          f"failures before the first event: {len(early)}; mismatches: {len(load.mismatches)}; "
          f"max latency {max(load.latencies):.2f} s")
    assert not early and not load.mismatches
    assert report["restart"]["failed"] == 0, load.failures[:5]
    assert report["reload"]["failed"] == 0, load.failures[:5]
    assert report["crash"]["failed"] <= report["crash"]["in_flight"], load.failures[:10]
    # The socket never closed: the same listening socket served all three gateway generations.
    assert requests.post(f"{r['url']}/classify", json={"input_ids": [rows[0]]}, timeout=60).status_code == 200
    assert journal(r, "openjev-gateway.service").count("READY=1") >= 3


# ---------------------------------------------------------------- the production port
@needs_haproxy
@pytest.mark.parametrize("how", ["launcher-sglang", "launcher-transformers", "serve_transformers"])
def test_production_port_refuses_a_second_standalone_server(deployment, overlay, how):
    """With the socket held (gateway running, or stopped: systemd keeps the socket), a standalone
    server on the production port exits non-zero with one line, before loading anything."""
    r = deployment
    port = r["port"]
    env = {**os.environ, "OPENJEV_PYTHON": PY, "PYTHONUNBUFFERED": "1"}
    if how == "serve_transformers":
        cmd = [PY, str(REPO / "app" / "serve_transformers.py"), str(overlay), str(port)]
    else:
        cmd = ["bash", str(LAUNCHER), str(overlay), str(port)]
        env["OPENJEV_BACKEND"] = how.split("-")[1]
        env["OPENJEV_GPU_ARCH"] = "sm90"  # no GPU here: skip nvidia-smi; the port check comes next

    def attempt():
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        return p, time.monotonic() - t0

    p, secs = attempt()
    lines = error_lines(p.stderr)
    assert p.returncode != 0 and len(lines) == 1, (p.returncode, p.stderr[-2000:])
    assert str(port) in lines[0] and "already in use" in lines[0], lines
    # The gateway is unaffected.
    assert requests.get(f"{r['url']}/health", timeout=30).status_code == 200

    if how == "serve_transformers":  # also while the gateway process is down: the socket is not its own
        gw = r["gateway"]
        gw.stop()
        try:
            assert gw.main_pid is None
            p2, _ = attempt()
            assert p2.returncode != 0 and len(error_lines(p2.stderr)) == 1 and str(port) in p2.stderr
        finally:
            gw.start()
        wait_both_up(r)
    print(f"\n{how}: refused in {secs:.1f} s: {lines[0]}")
