"""Production deployment: systemd socket -> HAProxy gateway -> two replicas, for real.

Everything runs as real processes on 127.0.0.1; nothing is mocked. The units and haproxy.cfg
are rendered by deploy/install_units.sh exactly as on eva01, except for stand-in ports (never
31000) and the embedded Transformers backend (`--backend transformers`, tiny model, CPU).

What plays the part of systemd (PID 1 is not systemd here):
  * systemd-socket-activate (Debian package systemd): the activation test. It binds the socket,
    waits for the first connection and execs the gateway with LISTEN_FDS=1 on fd 3, exactly the
    protocol of a socket unit. It exits with its child, so it cannot model restarts.
  * openjev_testsupport/unit_runner.py: everything else. It reads the rendered unit files and runs them as
    systemd does: it binds the socket unit's ListenStream and holds it for its whole life (as
    PID 1 does across service restarts), passes it as fd 3 with LISTEN_FDS/LISTEN_PID, waits for
    READY=1 over NOTIFY_SOCKET (Type=notify), stops with KillSignal= to the main PID
    (KillMode=mixed) and TimeoutStopSec=, restarts per Restart=/RestartSec=, reloads with
    ExecReload=, and starts the replicas' ExecStart= (app/serve_sglang_v100.sh) with the unit's
    Environment=/EnvironmentFile= in a clean manager environment.
Not exercised: PID-1 systemd itself, cgroups, journald, GPUs, SGLang replicas.

Skips (pytest -rs shows why) when haproxy (apt-get install haproxy) or systemd-socket-activate /
systemd-analyze (apt-get install systemd) are missing. OPENJEV_DEPLOY_REQUESTS scales the failover
load (default 2000 requests from 8 clients, about a minute on 2 shared cores; the gateway
restart test uses a third of it).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from conftest import PY, REPO, error_lines, free_port, free_ports_on, token_rows

from openjev_testsupport import unit_runner
from openjev_testsupport.loopback_bench import RequestNumbers, request_rows

INSTALL = REPO / "deploy" / "install_units.sh"
LAUNCHER = REPO / "app" / "serve_sglang_v100.sh"


def _which(name: str, *fallbacks: str) -> str | None:
    found = shutil.which(name)
    return found or next((f for f in fallbacks if os.access(f, os.X_OK)), None)


HAPROXY = _which("haproxy", "/usr/sbin/haproxy")
SSA = _which("systemd-socket-activate", "/usr/bin/systemd-socket-activate")
ANALYZE = _which("systemd-analyze", "/usr/bin/systemd-analyze")

needs_haproxy = pytest.mark.skipif(
    HAPROXY is None, reason="haproxy is not installed: the gateway needs Debian's haproxy package (apt-get install -y haproxy)")
needs_ssa = pytest.mark.skipif(
    SSA is None, reason="systemd-socket-activate is not installed (Debian package systemd: apt-get install -y systemd)")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze is not installed (Debian package systemd: apt-get install -y systemd)")

FAILOVER_REQUESTS = int(os.environ.get("OPENJEV_DEPLOY_REQUESTS", "2000"))
CLIENTS = 8


# ---------------------------------------------------------------- helpers


def install(*args, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(INSTALL), *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"install_units.sh failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def render(base: Path, model: Path, port: int, stats_port: int, replica_base: int, *extra) -> dict:
    """Render units + haproxy.cfg with install_units.sh for the embedded backend, stand-in ports."""
    root, units, conf = base / "root", base / "units", base / "conf"
    root.mkdir(parents=True, exist_ok=True)
    install("--root", root, "--model", model, "--unit-dir", units, "--conf-dir", conf, "--gpus", "0,1",
            "--port", port, "--stats-port", stats_port, "--replica-port-base", replica_base,
            "--backend", "transformers", "--env", f"OPENJEV_PYTHON={PY}", "--env", "OMP_NUM_THREADS=1",
            "--no-verify", *extra)
    return {"root": root, "units": units, "conf": conf, "port": port, "stats_port": stats_port,
            "replica_ports": [replica_base, replica_base + 1]}


def admin(socket_path: Path, command: str) -> str:
    """One command on HAProxy's runtime API (the unix socket of `stats socket`)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(socket_path))
        s.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def replica_stats(socket_path: Path) -> dict[str, dict]:
    """`show stat` rows of the replicas: status (UP/DOWN/DRAIN/MAINT), stot (requests), wretr, wredis..."""
    text = admin(socket_path, "show stat").lstrip("# ")
    rows = csv.DictReader(io.StringIO(text))
    return {r["svname"]: r for r in rows if r["pxname"] == "openjev" and r["svname"].startswith("replica")}


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except (OSError, requests.RequestException) as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


class Load(RequestNumbers):
    """Bounded /classify load from CLIENTS keep-alive clients; every answer checked bitwise.

    Request i carries the rows request_rows(i, n) names (1-2 rows each).
    """

    def __init__(self, url: str, rows: list[list[int]], ref: np.ndarray, n: int, clients: int = CLIENTS):
        super().__init__(n)
        self.url, self.rows, self.ref, self.clients = url, rows, ref, clients
        self.failures: list[tuple[float, int, str]] = []
        self.mismatches: list[int] = []
        self.latencies: list[float] = []
        self.by_replica: dict[str, int] = {}
        self.threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(clients)]

    def request(self, i: int) -> tuple[dict, np.ndarray]:
        idx = request_rows(i, len(self.rows))
        return {"input_ids": [self.rows[j] for j in idx]}, self.ref[idx]

    def _worker(self) -> None:
        session = requests.Session()
        while (i := self.take()) is not None:
            body, expected = self.request(i)
            t0 = time.perf_counter()
            try:
                r = session.post(f"{self.url}/classify", json=body, timeout=120)
                error = None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"
                if error is None:
                    got = np.asarray(r.json()["logits"], dtype=np.float32)
                    replica = r.headers.get("X-OpenJEV-Replica", "?")
            except requests.RequestException as exc:
                error = repr(exc)
            with self.lock:
                self.in_flight -= 1
                self.done += 1
                self.latencies.append(time.perf_counter() - t0)
                if error is not None:
                    self.failures.append((time.monotonic(), i, error))
                else:
                    self.by_replica[replica] = self.by_replica.get(replica, 0) + 1
                    if got.shape != expected.shape or not np.array_equal(got, expected):
                        self.mismatches.append(i)

    def start(self) -> "Load":
        self.t0 = time.monotonic()
        for t in self.threads:
            t.start()
        return self

    def wait_done(self, count: int, timeout: float = 300) -> None:
        wait_for(lambda: self.done >= count or not any(t.is_alive() for t in self.threads), timeout,
                 f"{count} completed requests")

    def join(self, timeout: float = 600) -> "Load":
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "load did not finish"
        self.seconds = time.monotonic() - self.t0
        return self


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def data(sample_tokens, reference):
    _, rows = token_rows(sample_tokens)
    return rows, np.load(reference / "reference.npy")


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


# ---------------------------------------------------------------- installer and units
def test_install_units_help_dry_run_refuse_force(overlay, tmp_path):
    h = install("--help")
    assert h.stdout.startswith("usage: install_units.sh") and "--dry-run" in h.stdout
    common = ["--root", tmp_path, "--model", overlay, "--unit-dir", tmp_path / "u", "--conf-dir", tmp_path / "c",
              "--no-verify"]
    dry = install(*common, "--dry-run")
    assert "### " + str(tmp_path / "u" / "openjev-gateway.socket") in dry.stdout
    assert "ListenStream=127.0.0.1:31000" in dry.stdout and "dry run: nothing written" in dry.stdout
    assert not (tmp_path / "u").exists() and not (tmp_path / "c").exists()

    first = install(*common)
    files = sorted(p.name for p in (tmp_path / "u").iterdir()) + sorted(p.name for p in (tmp_path / "c").iterdir())
    assert files == ["openjev-gateway.service", "openjev-gateway.socket", "openjev-replica@.service", "openjev.target",
                     "haproxy.cfg", "replica-0.env", "replica-1.env"], files
    assert "systemctl --user enable openjev.target openjev-gateway.socket" in first.stdout
    again = install(*common)
    assert again.stdout.count("unchanged: ") == 7

    (tmp_path / "c" / "replica-1.env").write_text((tmp_path / "c" / "replica-1.env").read_text() + "X=1\n")
    refused = install(*common, "--port", "31010", check=False)
    lines = error_lines(refused.stderr)
    assert refused.returncode == 1 and len(lines) == 1 and "--force" in lines[0] and "replica-1.env" in lines[0]
    assert "ListenStream=127.0.0.1:31000" in (tmp_path / "u" / "openjev-gateway.socket").read_text()
    forced = install(*common, "--port", "31010", "--force")
    assert "replaced: " in forced.stdout
    assert "ListenStream=127.0.0.1:31010" in (tmp_path / "u" / "openjev-gateway.socket").read_text()

    bad = install(*common, "--gpus", "0,0", check=False)
    assert bad.returncode == 2 and len(error_lines(bad.stderr)) == 1


def test_rendered_units_say_what_the_deployment_needs(overlay, tmp_path):
    install("--root", tmp_path, "--model", overlay, "--unit-dir", tmp_path / "u", "--conf-dir", tmp_path / "c",
            "--gpus", "0,1", "--no-verify", "--system", "--user", os.environ.get("USER", "root"))
    sock = (tmp_path / "u" / "openjev-gateway.socket").read_text()
    gw = (tmp_path / "u" / "openjev-gateway.service").read_text()
    rep = (tmp_path / "u" / "openjev-replica@.service").read_text()
    tgt = (tmp_path / "u" / "openjev.target").read_text()
    cfg = (tmp_path / "c" / "haproxy.cfg").read_text()
    for line in ["ListenStream=127.0.0.1:31000", "ReusePort=no", "Accept=no"]:
        assert line in sock.splitlines()
    for line in ["Type=notify", "KillSignal=SIGUSR1", "KillMode=mixed", "Restart=always",
                 "ExecReload=/bin/kill -USR2 $MAINPID", "Requires=openjev-gateway.socket"]:
        assert line in gw.splitlines()
    assert f"-Ws -f {tmp_path / 'c' / 'haproxy.cfg'}" in gw
    for line in ["Type=exec", "Environment=CUDA_VISIBLE_DEVICES=%i", "Restart=on-failure", "KillSignal=SIGTERM",
                 "TimeoutStartSec=20min", f"EnvironmentFile={tmp_path / 'c'}/replica-%i.env",
                 f"ExecStart=/bin/bash {LAUNCHER} ${{OPENJEV_MODEL}} ${{OPENJEV_REPLICA_PORT}} $OPENJEV_REPLICA_ARGS"]:
        assert line in rep.splitlines(), line
    assert "Wants=openjev-gateway.socket openjev-gateway.service openjev-replica@0.service openjev-replica@1.service" in tgt
    for line in ["    bind fd@3", "    balance leastconn", "    option httpchk GET /health", "    http-check expect status 200",
                 "    option redispatch 1", "    option http-buffer-request", "    option http-server-close",
                 "    retry-on conn-failure empty-response junk-response response-timeout 503",
                 "    server replica0 127.0.0.1:31100", "    server replica1 127.0.0.1:31101",
                 "    bind 127.0.0.1:31090", "    http-request use-service prometheus-exporter if { path /metrics }",
                 "    stats uri /stats"]:
        assert line in cfg.splitlines(), line
    assert "OPENJEV_REPLICA_PORT=31101" in (tmp_path / "c" / "replica-1.env").read_text()


@needs_analyze
@needs_haproxy
@pytest.mark.parametrize("mode", ["user", "system"])
def test_systemd_analyze_verify_passes_on_rendered_units(overlay, tmp_path, mode):
    extra = ["--system", "--user", os.environ.get("USER") or "root"] if mode == "system" else []
    out = install("--root", tmp_path, "--model", overlay, "--unit-dir", tmp_path / "u", "--conf-dir", tmp_path / "c",
                  "--dry-run", *extra)
    flag = "--user " if mode == "user" else ""
    assert f"checked: systemd-analyze {flag}verify passed for openjev-gateway.socket openjev-gateway.service " \
           "openjev.target openjev-replica@0.service openjev-replica@1.service" in out.stdout, out.stdout
    assert "checked: haproxy -c" in out.stdout


@needs_analyze
@needs_haproxy
def test_verify_catches_a_broken_unit(overlay, tmp_path):
    """The check is real: a template with a typo'd key fails the install, nothing is written."""
    copy = tmp_path / "deploy"
    shutil.copytree(REPO / "deploy", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "openjev").mkdir()
    shutil.copy(REPO / "openjev" / "common.sh", tmp_path / "openjev")  # what the deploy scripts source
    svc = copy / "systemd" / "openjev-replica@.service"
    svc.write_text(svc.read_text().replace("KillSignal=SIGTERM", "KilSignal=SIGTERM"))
    proc = subprocess.run(["bash", str(copy / "install_units.sh"), "--bundle", REPO, "--root", tmp_path, "--model",
                           overlay, "--unit-dir", tmp_path / "u", "--conf-dir", tmp_path / "c"],
                          capture_output=True, text=True, timeout=120)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "systemd-analyze" in lines[0] and "KilSignal" in lines[0]
    assert not (tmp_path / "u").exists()


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


# ---------------------------------------------------------------- a missing root
@needs_haproxy
def test_install_units_creates_a_missing_root(overlay, tmp_path):
    root = tmp_path / "new" / "root"  # neither it nor its parent exists
    args = ["--root", root, "--model", overlay, "--unit-dir", tmp_path / "units", "--conf-dir", tmp_path / "conf",
            "--gpus", "0", "--backend", "transformers", "--no-verify"]
    dry = install(*args, "--dry-run")
    assert f"would create the missing --root {root}" in dry.stdout and not root.exists()
    done = install(*args)
    assert f"created: {root} (--root)" in done.stdout and root.is_dir() and (root.stat().st_mode & 0o777) == 0o755
    assert install(*args).stdout.count("created:") == 0  # a second run finds it
    (tmp_path / "file").write_text("x")
    swap = {root: tmp_path / "file", tmp_path / "units": tmp_path / "units2", tmp_path / "conf": tmp_path / "conf2"}
    bad = install(*[swap.get(a, a) for a in args], check=False)
    assert bad.returncode != 0 and len(error_lines(bad.stderr)) == 1 and "not a directory" in bad.stderr


@needs_haproxy
def test_unit_runner_names_a_missing_working_directory_in_one_line(overlay, tmp_path):
    r = render(tmp_path, overlay, free_port(), free_port(), free_ports_on("127.0.0.1", 2))
    r["root"].rmdir()  # the root went away after the install (or was never made)
    proc = subprocess.run([PY, "-m", "openjev_testsupport.unit_runner", str(r["units"])], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("unit_runner.py: error: openjev-replica@0.service: "
                                                   f"WorkingDirectory={r['root']} does not exist"), proc.stderr
    # the same through the Python API the tests and benchmarks use
    mgr = unit_runner.Manager(r["units"], tmp_path / "run2", tmp_path / "journal2")
    try:
        with pytest.raises(unit_runner.UnitError, match="WorkingDirectory=.* does not exist"):
            mgr.start_target("openjev.target")
    finally:
        mgr.close()
