"""Several hosts running: a front gateway over local replicas and peer hosts, mutual TLS by HAProxy.

Three hosts are played on one machine by three loopback addresses, and only those:
  127.0.0.2  front host: endpoint socket, HAProxy gateway (--remote peer3=127.0.0.3:P --remote
             peer4=127.0.0.4:P), two local embedded replicas
  127.0.0.3  peer host "peer3": HAProxy with the peer listener (--peer-listen 127.0.0.3:P) over its
             own two embedded replicas (and its own endpoint socket, as every host has)
  127.0.0.4  peer host "peer4": the same
Every file comes from deploy/install_units.sh (one rendering per host, `--local-address` puts each
host's loopback services on its address), every certificate from deploy/openjev_certs.sh (OpenSSL),
and tests/openjev_testsupport/unit_runner.py runs each host's units the way systemd does (see
tests/_deployment_support.py). Replicas: the embedded backend (`--backend transformers`) on the tiny
model, one thread each.

Skips (pytest -rs shows why) without haproxy (apt-get install -y haproxy) or openssl.
OPENJEV_MULTIHOST_REQUESTS scales the load of the host-failure test (default 2000 requests from 8 clients).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from _deployment_multihost_support import HOSTS, MULTIHOST_MARKS, OPENSSL, certs
from _deployment_multihost_support import pki  # noqa: F401 - fixture
from _deployment_support import Load, admin, install, wait_for
from _deployment_support import data  # noqa: F401 - fixture
from conftest import PY, REPO, token_rows

from openjev_testsupport import unit_runner
from openjev_testsupport.ports import free_ports_on

REQUESTS = int(os.environ.get("OPENJEV_MULTIHOST_REQUESTS", "2000"))
CLIENTS = 8

pytestmark = MULTIHOST_MARKS


# ---------------------------------------------------------------- helpers
def render_host(base: Path, name: str, model: Path, tls_dir: Path, *extra) -> dict:
    addr = HOSTS[name]
    root, units, conf = base / name / "root", base / name / "units", base / name / "conf"
    root.mkdir(parents=True, exist_ok=True)
    port, stats, replica_base = free_ports_on(addr), free_ports_on(addr), free_ports_on(addr, 2)
    args = ["--root", root, "--model", model, "--unit-dir", units, "--conf-dir", conf, "--gpus", "0,1",
            "--port", port, "--stats-port", stats, "--replica-port-base", replica_base,
            "--backend", "transformers", "--env", f"OPENJEV_PYTHON={PY}", "--env", "OMP_NUM_THREADS=1",
            "--local-address", addr, "--tls-dir", tls_dir, "--no-verify", *extra]
    install(*args)
    return {"name": name, "addr": addr, "root": root, "units": units, "conf": conf, "port": port,
            "stats_port": stats, "replica_ports": [replica_base, replica_base + 1],
            "url": f"http://{addr}:{port}", "install_args": args}


def servers(admin_sock: Path) -> dict[str, dict]:
    """`show stat` rows of backend openjev's servers (replicaN, peer-NAME)."""
    text = admin(admin_sock, "show stat").lstrip("# ")
    return {r["svname"]: r for r in csv.DictReader(io.StringIO(text))
            if r["pxname"] == "openjev" and r["svname"] not in ("FRONTEND", "BACKEND")}


def wait_up(host: dict, names: list[str], timeout: float = 300) -> dict:
    return wait_for(lambda: (lambda st: all(st.get(n, {}).get("status") == "UP" for n in names) and st)(
        servers(host["admin"])), timeout, f"{names} UP on {host['name']}")


def stop_host(mgr: unit_runner.Manager) -> None:
    """The whole host goes away at once: SIGKILL to every process of every unit, nothing restarts."""
    mgr._shutting_down = True           # no socket activation on this host any more
    for svc in mgr.services.values():   # systemd's job is gone too: no Restart=
        with svc._lock:
            svc._wanted = False
    for svc in mgr.services.values():
        svc.kill(signal.SIGKILL)


def tls_request(addr: str, port: int, ca: Path, client_pem: Path | None, server_name: str = "peer3") -> tuple[str, str]:
    """GET /health on a peer listener with the given client certificate: ("answered", status line)
    or ("refused", why). The server's certificate is verified against ca as the gateway does."""
    ctx = ssl.create_default_context(cafile=str(ca))
    if client_pem is not None:
        ctx.load_cert_chain(str(client_pem))
    try:
        with socket.create_connection((addr, port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname=server_name) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: peer\r\nConnection: close\r\n\r\n")
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
    except (ssl.SSLError, OSError) as exc:
        return "refused", f"{type(exc).__name__}: {exc}"
    if not data:
        return "refused", "closed without a response"
    return "answered", data.split(b"\r\n", 1)[0].decode()


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def cluster(overlay, pki, tmp_path_factory):
    """Three hosts running: front (127.0.0.2), peer3 (127.0.0.3), peer4 (127.0.0.4)."""
    base = tmp_path_factory.mktemp("multihost")
    hosts = {}
    for name in ("peer3", "peer4"):
        peer_port = free_ports_on(HOSTS[name])
        hosts[name] = render_host(base, name, overlay, pki["tls"][name], "--peer-listen", f"{HOSTS[name]}:{peer_port}")
        hosts[name]["peer_port"] = peer_port
    hosts["front"] = render_host(base, "front", overlay, pki["tls"]["front"],
                                 *[a for n in ("peer3", "peer4") for a in
                                   ("--remote", f"{n}={HOSTS[n]}:{hosts[n]['peer_port']}")])
    managers = []
    try:
        for name, h in hosts.items():
            runtime = Path(f"/tmp/ojmh-{os.getpid()}-{name}")  # AF_UNIX paths are short
            mgr = unit_runner.Manager(h["units"], runtime, base / name / "journal")
            managers.append((mgr, runtime))
            h["mgr"], h["admin"] = mgr, runtime / "openjev-gateway" / "admin.sock"
            mgr.start_target("openjev.target", wait=True)
        for name in ("peer3", "peer4"):
            wait_up(hosts[name], ["replica0", "replica1"])
        wait_up(hosts["front"], ["replica0", "replica1", "peer-peer3", "peer-peer4"])
        yield hosts
    finally:
        for mgr, runtime in managers:
            mgr.close()
            shutil.rmtree(runtime, ignore_errors=True)


# ---------------------------------------------------------------- mutual TLS
def test_peer_listener_accepts_only_the_gateway_certificate(cluster, pki):
    peer = cluster["peer3"]
    addr, port, ca = peer["addr"], peer["peer_port"], pki["ca"] / "ca.crt"
    good = tls_request(addr, port, ca, pki["tls"]["front"] / "gateway-client.pem")
    assert good == ("answered", "HTTP/1.1 200 OK"), good
    outcomes = {
        "no client certificate": tls_request(addr, port, ca, None),
        "certificate of another CA (CN=openjev-gateway)": tls_request(addr, port, ca, pki["base"] / "rogue-client.pem"),
        "certificate of this CA, another CN": tls_request(addr, port, ca, pki["base"] / "intruder-client.pem"),
        "a peer's server certificate used as a client certificate": tls_request(addr, port, ca, pki["tls"]["peer4"] / "peer.pem"),
    }
    for case, (what, detail) in outcomes.items():
        assert what == "refused", (case, detail)
    # Plain HTTP on the TLS port gets no HTTP answer either.
    with socket.create_connection((addr, port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: peer\r\nConnection: close\r\n\r\n")
        s.settimeout(10)
        try:
            plain = s.recv(65536)
        except OSError:
            plain = b""
    assert b"200 OK" not in plain
    print("\npeer listener: gateway certificate -> " + good[1] + "; " +
          "; ".join(f"{case} -> refused ({detail[:80]})" for case, (_, detail) in outcomes.items()))


def test_gateway_verifies_the_peer_certificate(cluster, pki, overlay, tmp_path):
    """A front gateway that expects another name (or has another CA) keeps that peer DOWN: the
    certificate check is done by HAProxy on every connection, health checks included."""
    rogue_tls = tmp_path / "tls"
    rogue_tls.mkdir(mode=0o700)
    shutil.copy(pki["rogue"] / "ca.crt", rogue_tls / "ca.crt")
    shutil.copy(pki["tls"]["front"] / "gateway-client.pem", rogue_tls / "gateway-client.pem")
    peer3, peer4 = cluster["peer3"], cluster["peer4"]
    h = render_host(tmp_path, "front", overlay, pki["tls"]["front"], "--gpus", "7",
                    "--remote", f"peer4={peer3['addr']}:{peer3['peer_port']}",   # peer3 does not hold peer4's name
                    "--remote", f"peer3={peer3['addr']}:{peer3['peer_port']}")   # control: right name
    # One more server, as --remote renders it but from a gateway that trusts another CA.
    cfg = (h["conf"] / "haproxy.cfg").read_text()
    rogue = (f"    server peer-rogueca {peer4['addr']}:{peer4['peer_port']} ssl verify required ca-file "
             f"{rogue_tls}/ca.crt crt {rogue_tls}/gateway-client.pem verifyhost peer4 sni str(peer4)\n")
    (h["conf"] / "haproxy.cfg").write_text(cfg.replace("    server peer-peer3 ", rogue + "    server peer-peer3 ", 1))
    runtime = Path(f"/tmp/ojmh-{os.getpid()}-verify")
    mgr = unit_runner.Manager(h["units"], runtime, tmp_path / "journal")
    try:
        mgr.listen("openjev-gateway.socket")
        mgr.service("openjev-gateway.service").start()
        h["admin"] = runtime / "openjev-gateway" / "admin.sock"
        st = wait_for(lambda: (lambda s: s.get("peer-peer3", {}).get("status") == "UP"
                               and s["peer-peer4"]["status"].startswith("DOWN")
                               and s["peer-rogueca"]["status"].startswith("DOWN") and s)(servers(h["admin"])),
                      60, "peer-peer3 UP, peer-peer4 and peer-rogueca DOWN")
        for name in ("peer-peer4", "peer-rogueca"):
            assert st[name]["check_status"] == "L6RSP", st[name]
        r = requests.post(f"{h['url']}/classify", json={"input_ids": [[1, 2, 3]]}, timeout=60)
        assert r.status_code == 200 and r.headers["X-OpenJEV-Replica"] == "peer-peer3"
        print(f"\ngateway side: peer-peer3 UP; wrong name -> {st['peer-peer4']['check_status']} "
              f"({st['peer-peer4'].get('last_chk')}); other CA -> {st['peer-rogueca']['check_status']} "
              f"({st['peer-rogueca'].get('last_chk')})")
    finally:
        mgr.close()
        shutil.rmtree(runtime, ignore_errors=True)


def test_health_checks_go_through_the_tunnel(cluster, data):
    """The front checks GET /health through the TLS hop, answered by the peer's own backend: a peer
    whose replicas are all out answers 503 and the front takes it out; back in, it rejoins."""
    rows, ref = data
    front, peer3 = cluster["front"], cluster["peer3"]
    st = wait_up(front, ["replica0", "replica1", "peer-peer3", "peer-peer4"])
    assert st["peer-peer3"]["check_status"] == "L7OK" and st["peer-peer3"]["check_code"] == "200"
    admin(peer3["admin"], "set server openjev/replica0 state maint")
    admin(peer3["admin"], "set server openjev/replica1 state maint")
    try:
        st = wait_for(lambda: (lambda s: s["peer-peer3"]["status"].startswith("DOWN") and s)(servers(front["admin"])),
                      60, "the front to take peer-peer3 out")
        assert st["peer-peer3"]["check_status"] == "L7STS" and st["peer-peer3"]["check_code"] == "503", st["peer-peer3"]
        during = Load(front["url"], rows, ref, 64, CLIENTS).start().join()
        assert not during.failures and not during.mismatches and "peer-peer3" not in during.by_replica
    finally:
        admin(peer3["admin"], "set server openjev/replica0 state ready")
        admin(peer3["admin"], "set server openjev/replica1 state ready")
    wait_up(front, ["peer-peer3"], timeout=60)
    print(f"\ntunnel health checks: peer3 without replicas -> front check {st['peer-peer3']['check_status']} "
          f"{st['peer-peer3']['check_code']}, DOWN; 64 requests meanwhile served by {during.by_replica}; back UP")


def hold_connections(addr: str, port: int, n: int, source: str) -> list[socket.socket]:
    """n TCP connections from `source` that never send a byte (idle, or half-open before TLS)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 1000:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 4000), hard))
    held = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.bind((source, 0))
        try:
            s.connect((addr, port))
        except BlockingIOError:
            pass
        held.append(s)
    return held


def test_ten_thousand_idle_connections_lock_out_neither_the_peer_nor_the_gateway(cluster, data):
    """10,000 connections that never start TLS on peer3's listener and 10,000 that never send a request
    on the front gateway, all from one other address: peer3 stays UP in the front's checks over
    several check rounds and every request through the front is answered, bitwise (before, 4,200 such
    connections filled the shared 4,096-connection limit: the front's checks timed out and peer3 went
    DOWN until they closed)."""
    rows, ref = data
    front, peer3 = cluster["front"], cluster["peer3"]
    wait_up(front, ["replica0", "replica1", "peer-peer3", "peer-peer4"])
    idle = Load(front["url"], rows, ref, 64, CLIENTS).start().join()
    assert not idle.failures
    front_port = int(front["url"].rsplit(":", 1)[1])
    p99 = lambda lat: float(np.percentile(lat, 99))  # noqa: E731
    for what, addr, port in (("peer3's listener", HOSTS["peer3"], peer3["peer_port"]),
                             ("the front gateway", HOSTS["front"], front_port)):
        held = hold_connections(addr, port, 10_000, "127.0.0.9")
        try:
            time.sleep(8)  # four check intervals with the connections held
            st = servers(front["admin"])
            assert st["peer-peer3"]["status"].startswith("UP"), (what, st["peer-peer3"])
            during = Load(front["url"], rows, ref, 64, CLIENTS).start().join()
            assert not during.failures and not during.mismatches, (what, during.failures[:3])
            st = servers(front["admin"])
            assert all(st[n]["status"].startswith("UP") for n in ("peer-peer3", "peer-peer4")), (what, st)
        finally:
            for s in held:
                s.close()
        print(f"\n10,000 held connections on {what}: peer3 UP, 64 requests all answered; p99 "
              f"{p99(during.latencies):.3f} s against {p99(idle.latencies):.3f} s idle")


def lcp(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([a, b]))


def test_prefix_affinity_sends_an_option_group_to_one_replica(cluster, data, sample_tokens):
    """--prefix-affinity N on every host (re-rendered, reloaded): each option group's requests, in
    any JSON spacing, reach one replica through both levels (front, then peer); leastconn again after."""
    rows, ref = data
    ids, _ = token_rows(sample_tokens)
    inputs = {d["id"]: d for d in map(json.loads, (REPO / "data" / "nli_sample.jsonl").read_text().splitlines())}
    group = [f"{inputs[i].get('instruction', '')}|{inputs[i]['premise']}" for i in ids]
    between = max(lcp(a, b) for i, a in enumerate(rows) for j, b in enumerate(rows) if group[i] != group[j])
    within = min(lcp(a, b) for i, a in enumerate(rows) for j, b in enumerate(rows) if group[i] == group[j])
    n = between + 1
    assert n <= within, (between, within)

    def rerender(*extra):
        for name in ("peer3", "peer4", "front"):
            install(*cluster[name]["install_args"], "--force", *extra)
            cluster[name]["mgr"].service("openjev-gateway.service").reload()
        time.sleep(1.0)
        wait_up(cluster["front"], ["replica0", "replica1", "peer-peer3", "peer-peer4"], timeout=60)

    front = cluster["front"]
    rerender("--prefix-affinity", str(n), "--hash-balance-factor", "0")
    try:
        assert "    balance hash var(txn.openjev_prefix)" in (front["conf"] / "haproxy.cfg").read_text().splitlines()
        where: dict[str, set] = {}
        session = requests.Session()
        for rnd in range(3):
            for i, row in enumerate(rows):
                body = json.dumps({"input_ids": [row]}, separators=(",", ":") if rnd == 1 else (", ", ": "))
                if rnd == 2:
                    body = json.dumps({"input_ids": row}, indent=1)  # one row, pretty-printed
                r = session.post(f"{front['url']}/classify", data=body, headers={"Content-Type": "application/json"},
                                 timeout=60)
                assert r.status_code == 200, r.text[:200]
                assert np.array_equal(np.asarray(r.json()["logits"], dtype=np.float32), ref[[i]])
                replica = r.headers["X-OpenJEV-Replica"] + "/" + r.headers.get("X-OpenJEV-Peer-Replica", "-")
                where.setdefault(group[i], set()).add(replica)
    finally:
        rerender()
    assert "    balance leastconn" in (front["conf"] / "haproxy.cfg").read_text().splitlines()
    assert all(len(v) == 1 for v in where.values()), where
    used = set().union(*where.values())
    assert len(used) >= 2, used  # the key is the premise, not a prefix every request shares
    print(f"\nprefix affinity N={n} (groups share {within}+ ids, different groups at most {between}): "
          f"{len(where)} groups x 3 spellings -> one replica each; replicas used: {sorted(used)}")


# ---------------------------------------------------------------- certificate rotation
def cert_serial(pem: Path) -> str:
    out = subprocess.run([OPENSSL, "x509", "-noout", "-serial", "-in", str(pem)], capture_output=True, text=True,
                         check=True).stdout
    return out.strip().split("=", 1)[1].upper()


def presented_serial(addr: str, port: int, ca: Path, client_pem: Path, name: str) -> str:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(client_pem))
    with socket.create_connection((addr, port), timeout=10) as raw, ctx.wrap_socket(raw, server_hostname=name) as s:
        return s.getpeercert()["serialNumber"].upper()


def loaded_serial(admin_sock: Path, pem: Path) -> str:
    """The serial of the certificate the running HAProxy holds for pem (runtime API `show ssl cert`)."""
    for line in admin(admin_sock, f"show ssl cert {pem}").splitlines():
        if line.startswith("Serial: "):
            return line.split(": ", 1)[1].strip().upper()
    return ""


def test_certificate_rotation_with_seamless_reload_loses_nothing(cluster, pki, data):
    """New peer certificate and new gateway client certificate (same CA) written in place by
    openjev_certs.sh --force, then `systemctl reload` (SIGUSR2) of the peer and of the front
    gateway, all under load: nothing fails, and the running processes hold the new certificates."""
    rows, ref = data
    front, peer3 = cluster["front"], cluster["peer3"]
    wait_up(front, ["replica0", "replica1", "peer-peer3", "peer-peer4"])
    peer_pem, client_pem = pki["tls"]["peer3"] / "peer.pem", pki["tls"]["front"] / "gateway-client.pem"
    ca = pki["ca"] / "ca.crt"
    old = {"peer": cert_serial(peer_pem), "client": cert_serial(client_pem)}
    assert presented_serial(peer3["addr"], peer3["peer_port"], ca, client_pem, "peer3") == old["peer"]
    assert loaded_serial(front["admin"], client_pem) == old["client"]

    n = max(300, REQUESTS // 4)
    load = Load(front["url"], rows, ref, n, CLIENTS).start()
    load.wait_done(n // 4)
    certs("server", pki["ca"], "peer3", peer_pem, "--ip", peer3["addr"], "--force")
    certs("client", pki["ca"], "openjev-gateway", client_pem, "--force")
    new = {"peer": cert_serial(peer_pem), "client": cert_serial(client_pem)}
    assert new["peer"] != old["peer"] and new["client"] != old["client"]
    in_flight = {"peer_reload": load.in_flight}
    peer3["mgr"].service("openjev-gateway.service").reload()
    load.wait_done(n // 2)
    in_flight["front_reload"] = load.in_flight
    front["mgr"].service("openjev-gateway.service").reload()
    load.join()
    wait_for(lambda: loaded_serial(front["admin"], client_pem) == new["client"], 30, "the front to hold the new client certificate")
    wait_for(lambda: loaded_serial(peer3["admin"], peer_pem) == new["peer"], 30, "peer3 to hold the new server certificate")
    assert presented_serial(peer3["addr"], peer3["peer_port"], ca, client_pem, "peer3") == new["peer"]
    st = wait_up(front, ["replica0", "replica1", "peer-peer3", "peer-peer4"], timeout=60)
    print(f"\nrotation under load: {n} requests, {CLIENTS} clients, in flight at the reloads {in_flight}; "
          f"{len(load.failures)} failed, {len(load.mismatches)} mismatched; served by {load.by_replica}; "
          f"peer3 serial {old['peer']} -> {new['peer']}, gateway client serial {old['client']} -> {new['client']}; "
          f"front sees peer-peer3 {st['peer-peer3']['status']}")
    assert not load.failures, load.failures[:5]
    assert not load.mismatches
    assert load.by_replica.get("peer-peer3", 0) > 0


# ---------------------------------------------------------------- a whole host goes away
def test_one_peer_host_stopped_midway_fails_no_request(cluster, data):
    rows, ref = data
    front, peer3, peer4 = cluster["front"], cluster["peer3"], cluster["peer4"]
    wait_up(front, ["replica0", "replica1", "peer-peer3", "peer-peer4"])
    before = {name: servers(cluster[name]["admin"]) for name in ("front", "peer3", "peer4")}

    load = Load(front["url"], rows, ref, REQUESTS, CLIENTS).start()
    load.wait_done(REQUESTS // 3)
    served_before_stop = dict(load.by_replica)
    in_flight = load.in_flight
    on_peer4 = int(servers(front["admin"])["peer-peer4"]["scur"])
    peer4_stats = servers(peer4["admin"])
    t_stop = time.monotonic()
    stop_host(peer4["mgr"])
    t_down = wait_for(lambda: servers(front["admin"])["peer-peer4"]["status"].startswith("DOWN") and time.monotonic(),
                      60, "the front gateway to mark peer-peer4 DOWN")
    load.join()
    after = servers(front["admin"])
    peer3_after = servers(peer3["admin"])

    def delta(st, st0, name, key):
        return int(st[name][key]) - int(st0[name][key])

    summary = {
        "requests": load.n, "clients": load.clients, "failures": len(load.failures),
        "mismatches": len(load.mismatches), "seconds": round(load.seconds, 1),
        "in_flight_at_stop": in_flight, "in_flight_on_peer4_at_stop": on_peer4,
        "served_before_stop": served_before_stop, "served_by": load.by_replica,
        "seconds_to_down": round(t_down - t_stop, 2),
        "peer4_check": f"{after['peer-peer4']['check_status']}",
        "front_retries": sum(delta(after, before["front"], n, "wretr") for n in after),
        "front_redispatches": sum(delta(after, before["front"], n, "wredis") for n in after),
        "peer3_replicas_served": {n: delta(peer3_after, before["peer3"], n, "stot") for n in ("replica0", "replica1")},
        "peer4_replicas_served_before_stop": {n: delta(peer4_stats, before["peer4"], n, "stot")
                                              for n in ("replica0", "replica1")},
    }
    print(f"\npeer host stopped midway: {json.dumps(summary)}")
    assert not load.failures, load.failures[:5]
    assert not load.mismatches, load.mismatches[:10]
    # Every server of the front took part: both local replicas and both peers (peer4 before its stop),
    # and on the peers, both replicas behind each listener.
    for name in ("replica0", "replica1", "peer-peer3", "peer-peer4"):
        assert served_before_stop.get(name, 0) > 0, served_before_stop
    assert all(v > 0 for v in summary["peer3_replicas_served"].values()), summary
    assert all(v > 0 for v in summary["peer4_replicas_served_before_stop"].values()), summary
    # After the stop the front keeps serving from the rest; peer4 is out by its health checks.
    assert after["peer-peer4"]["status"].startswith("DOWN")
    assert load.by_replica["peer-peer3"] > served_before_stop["peer-peer3"]
    assert load.by_replica["replica0"] > served_before_stop["replica0"]
