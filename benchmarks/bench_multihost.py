#!/usr/bin/env python3
"""What one mutual-TLS hop to a peer host costs, and what prefix affinity does to routing.

Two hosts are played on one machine by two loopback addresses: the front host 127.0.0.2 (endpoint
socket, HAProxy gateway with `--remote peer3=127.0.0.3:P`, two local replicas) and the peer host
127.0.0.3 (HAProxy with `--peer-listen 127.0.0.3:P`, two replicas). Everything is rendered by
deploy/install_units.sh (embedded backend, tiny random-weight model, one CPU thread per replica),
the certificates are made by deploy/openjev_certs.sh, and tests/openjev_testsupport/unit_runner.py runs the units as
systemd does (see benchmarks/bench_gateway.py for the single-host version).

  latency   one client, one request at a time, the same request sent in turn over three paths to
            the same replica (peer replica0; every other server is in maintenance over the
            runtime API), in one run, order rotated every round:
              direct     client -> peer replica0
              local_gw   client -> the peer host's own gateway (one HAProxy, no TLS) -> replica0
              tls_hop    client -> front gateway -> mutual TLS -> peer listener -> replica0
            GET /health (the proxies' own cost) and POST /classify with one row; keep-alive client
            connections and a fresh connection per request. Reported: p50/p99 of each path and
            tls_hop - direct (what a client of the front pays for a replica on another host) and
            tls_hop - local_gw (the TLS hop alone). Measured twice: as rendered (the front keeps
            and reuses its connections to the peer), and as a variant with the rendered front's
            keep-alive lines replaced by `option http-server-close` and a reload (one TLS
            connection per request, as the single-host gateway does with its replicas).
  affinity  every row of the input set as its own request, --affinity-rounds times in a shuffled
            order, from --clients clients through the front gateway with all four replicas in
            rotation: first with leastconn (the default), then with `--prefix-affinity N` and the
            default bounded load, then with `--hash-balance-factor 0` (each re-rendered, then
            `systemctl reload` of both gateways). For each option group (rows
            sharing premise and instruction) it records which replica (front server + peer
            replica) answered: distinct replicas per group and the share of the group's requests
            on its most used replica. Also requests per replica, throughput, failures and
            mismatches (every answer is compared bitwise with the reference logits).

The result names the machine and the load average before and after; this is a CPU benchmark and
the script refuses to write under results_v100/.

Example (how benchmarks/results_cpu/multihost_cpu.json was made):
  .venv/bin/python benchmarks/bench_multihost.py --out benchmarks/results_cpu/multihost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "app"

from openjev.common import UserError, run_main
from openjev_testsupport import unit_runner
from openjev_testsupport.loopback_bench import (Client, RequestNumbers, admin, build_tiny, cpu_result_path, find_haproxy,
                                                haproxy_version, result_head, run, run_clients, summary_ms, work_dir,
                                                write_result)
from openjev_testsupport.pki import CERTS, make_host_tls
from openjev_testsupport.ports import free_ports_on

KIND = "openjev-multihost-bench"
DEFAULT_OUT = REPO / "benchmarks" / "results_cpu" / "multihost_cpu.json"
PY = sys.executable
FRONT, PEER = "127.0.0.2", "127.0.0.3"
INSTALL = REPO / "deploy" / "install_units.sh"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON (default: %(default)s)")
    p.add_argument("--work", type=Path, default=None,
                   help="directory for the tiny model, certificates, rendered units and logs (default: a temporary one)")
    p.add_argument("--rounds", type=int, default=1000,
                   help="latency rounds per request kind and client mode; each round calls all three paths (default: 1000)")
    p.add_argument("--prefix-affinity", type=int, default=24,
                   help="N for --prefix-affinity in the affinity phase (default: 24: longer than the instruction "
                        "all rows of data/nli_sample.jsonl share, shorter than the premise of an option group)")
    p.add_argument("--affinity-rounds", type=int, default=40,
                   help="each row is sent this many times per affinity run (default: 40)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients in the affinity runs (default: 8)")
    p.add_argument("--haproxy", default=None, help="HAProxy executable (default: haproxy on PATH)")
    return p


# ---------------------------------------------------------------- setup


def make_pki(work: Path) -> dict[str, Path]:
    """CA, the front's client certificate and the peer's server certificate (CN peer3): {host: TLS_DIR}."""
    def certs(*args) -> str:
        return run(["bash", CERTS, *args], f"openjev_certs.sh {args[0]}")

    return make_host_tls(work, certs, {"peer": ("peer3", PEER)})


def render(host: dict, *extra) -> None:
    run(["bash", INSTALL, "--root", host["root"], "--model", host["model"], "--unit-dir", host["units"],
         "--conf-dir", host["conf"], "--gpus", "0,1", "--port", host["port"], "--stats-port", host["stats"],
         "--replica-port-base", host["base"], "--backend", "transformers", "--haproxy", host["haproxy"],
         "--env", f"OPENJEV_PYTHON={PY}", "--env", "OMP_NUM_THREADS=1", "--local-address", host["addr"],
         "--tls-dir", host["tls"], "--force", *host["extra"], *extra], f"install_units.sh ({host['addr']})")


def show_stat(adm: Path) -> dict[str, dict]:
    lines = admin(adm, "show stat").lstrip("# ").splitlines()
    head = lines[0].split(",")
    rows = [dict(zip(head, line.split(","))) for line in lines[1:] if line]
    return {r["svname"]: r for r in rows if r.get("pxname") == "openjev" and r["svname"] not in ("FRONTEND", "BACKEND")}


def wait_status(adm: Path, want: dict[str, str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = {k: v["status"] for k, v in show_stat(adm).items()}
            if all(last.get(k) == v for k, v in want.items()):
                return
        except (OSError, IndexError):
            pass
        time.sleep(0.2)
    raise UserError(f"servers did not reach {want} within {timeout:.0f} s (last: {last})")


def set_state(adm: Path, states: dict[str, str]) -> None:
    for server, state in states.items():
        out = admin(adm, f"set server openjev/{server} state {state}").strip()
        if out:
            raise UserError(f"runtime API: set server openjev/{server} state {state}: {out}")


def latency_phase(paths: dict[str, tuple[str, int]], rounds: int, row: list[int]) -> dict:
    kinds = {"health": ("GET", "/health", None),
             "classify_1_row": ("POST", "/classify", json.dumps({"input_ids": [row]}).encode())}
    out: dict = {}
    names = list(paths)
    for mode in ("keepalive", "fresh"):
        out[mode] = {}
        for kind, (method, path, body) in kinds.items():
            clients = {n: Client(paths[n][1], fresh=mode == "fresh", addr=paths[n][0]) for n in names}
            for c in clients.values():  # warm up connections, TLS session caches, the replica
                for _ in range(20):
                    c.call(method, path, body)
            times: dict[str, list[float]] = {n: [] for n in names}
            for i in range(rounds):
                for n in names[i % 3:] + names[:i % 3]:
                    t0 = time.perf_counter()
                    status, _, _ = clients[n].call(method, path, body)
                    times[n].append(time.perf_counter() - t0)
                    if status != 200:
                        raise UserError(f"{kind} via {n}: HTTP {status}")
            res = {n: summary_ms(times[n]) for n in names}
            for a, b in (("tls_hop", "direct"), ("tls_hop", "local_gw"), ("local_gw", "direct")):
                res[f"added_{a}_vs_{b}"] = {
                    "p50_ms": round(res[a]["p50_ms"] - res[b]["p50_ms"], 3),
                    "p99_ms": round(res[a]["p99_ms"] - res[b]["p99_ms"], 3),
                    "paired_difference_median_ms": round(statistics.median(
                        (x - y) * 1e3 for x, y in zip(times[a], times[b])), 3)}
            out[mode][kind] = res
            add = res["added_tls_hop_vs_direct"]
            print(f"latency {kind}, {mode}: direct p50 {res['direct']['p50_ms']} p99 {res['direct']['p99_ms']}; "
                  f"local_gw p50 {res['local_gw']['p50_ms']} p99 {res['local_gw']['p99_ms']}; tls_hop p50 "
                  f"{res['tls_hop']['p50_ms']} p99 {res['tls_hop']['p99_ms']} ms; tls_hop - direct: p50 "
                  f"{add['p50_ms']} p99 {add['p99_ms']} ms", flush=True)
    return out


def affinity_run(url: tuple[str, int], rows: list[list[int]], ref: np.ndarray, groups: list[str], rounds: int,
                 clients: int, seed: int) -> dict:
    order = [i for _ in range(rounds) for i in range(len(rows))]
    random.Random(seed).shuffle(order)
    numbers = RequestNumbers(len(order))
    lock = numbers.lock
    state = {"failures": 0, "mismatches": 0}
    routed: list[tuple[int, str]] = []
    lat: list[float] = []

    def worker():
        c = Client(url[1], addr=url[0])
        while (k := numbers.take()) is not None:
            i = order[k]
            t0 = time.perf_counter()
            try:
                status, data, headers = c.call("POST", "/classify", json.dumps({"input_ids": [rows[i]]}).encode())
            except UserError:
                status, data, headers = 0, b"", {}
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)
                if status != 200:
                    state["failures"] += 1
                    continue
                if not np.array_equal(np.asarray(json.loads(data)["logits"], dtype=np.float32), ref[[i]]):
                    state["mismatches"] += 1
                where = headers.get("x-openjev-replica", "?")
                if "x-openjev-peer-replica" in headers:
                    where += "/" + headers["x-openjev-peer-replica"]
                routed.append((i, where))

    secs = run_clients(worker, clients)
    by_group: dict[str, Counter] = defaultdict(Counter)
    for i, where in routed:
        by_group[groups[i]][where] += 1
    multi = {g: c for g, c in by_group.items() if sum(c.values()) and len({i for i, _ in routed if groups[i] == g}) > 1}
    share = [max(c.values()) / sum(c.values()) for c in multi.values()]
    return {"requests": len(order), "clients": clients, "seconds": round(secs, 3),
            "requests_per_s": round(len(order) / secs, 2), "latency": summary_ms(lat),
            "failures": state["failures"], "mismatches": state["mismatches"],
            "served_by": dict(sorted(Counter(w for _, w in routed).items())),
            "option_groups": len(multi),
            "distinct_replicas_per_group": {g: len(c) for g, c in sorted(multi.items())},
            "mean_distinct_replicas_per_group": round(statistics.fmean(len(c) for c in multi.values()), 3),
            "share_on_group_main_replica_mean": round(statistics.fmean(share), 4),
            "share_on_group_main_replica_min": round(min(share), 4)}


def group_keys(inputs: Path, ids: list[str]) -> list[str]:
    by_id = {}
    for line in inputs.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            by_id[d["id"]] = f"{d.get('instruction', '')}\x00{d['premise']}"
    return [by_id[i] for i in ids]


def lcp(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([a, b]))


# ---------------------------------------------------------------- main
def main() -> int:
    args = build_parser().parse_args()
    out = cpu_result_path(args.out)
    haproxy = find_haproxy(args.haproxy)
    if shutil.which("openssl") is None:
        raise UserError("openssl is not installed (Debian: apt-get install openssl)")
    if min(args.rounds, args.affinity_rounds, args.clients, args.prefix_affinity) < 1:
        raise UserError("--rounds, --affinity-rounds, --clients and --prefix-affinity must be >= 1")
    for addr in (FRONT, PEER):
        try:
            with socket.socket() as s:
                s.bind((addr, 0))
        except OSError as exc:
            raise UserError(f"cannot bind {addr} ({exc}): this benchmark plays two hosts on 127.0.0.2 and 127.0.0.3") from None

    with work_dir(args.work, "openjev-bench-multihost-") as work:
        model, tokens, refdir = build_tiny(work)
        token_rows = [json.loads(line) for line in tokens.read_text().splitlines() if line.strip()]
        rows = [r["input_ids"] for r in token_rows]
        ref = np.load(refdir / "reference.npy")
        groups = group_keys(REPO / "data" / "nli_sample.jsonl", [r["id"] for r in token_rows])

        tls = make_pki(work)
        peer_port = free_ports_on(PEER)
        hosts = {}
        for name, addr in (("peer", PEER), ("front", FRONT)):
            d = work / name
            (d / "root").mkdir(parents=True, exist_ok=True)
            hosts[name] = {"addr": addr, "root": d / "root", "units": d / "units", "conf": d / "conf", "model": model,
                           "port": free_ports_on(addr), "stats": free_ports_on(addr), "base": free_ports_on(addr, 2),
                           "tls": tls[name], "haproxy": haproxy,
                           "extra": ["--peer-listen", f"{PEER}:{peer_port}"] if name == "peer"
                           else ["--remote", f"peer3={PEER}:{peer_port}"]}
            render(hosts[name])
        load_before = os.getloadavg()
        version = haproxy_version(haproxy)
        managers = []
        try:
            for name, h in hosts.items():
                runtime = Path(tempfile.mkdtemp(prefix=f"ojmh-{name}-", dir="/tmp"))
                mgr = unit_runner.Manager(h["units"], runtime, work / name / "journal")
                managers.append((mgr, runtime))
                h["mgr"], h["admin"] = mgr, runtime / "openjev-gateway" / "admin.sock"
                print(f"starting the {name} host on {h['addr']} ...", flush=True)
                mgr.start_target("openjev.target")
            wait_status(hosts["peer"]["admin"], {"replica0": "UP", "replica1": "UP"})
            wait_status(hosts["front"]["admin"], {"replica0": "UP", "replica1": "UP", "peer-peer3": "UP"})

            # latency: every path ends at the peer's replica0
            set_state(hosts["front"]["admin"], {"replica0": "maint", "replica1": "maint"})
            set_state(hosts["peer"]["admin"], {"replica1": "maint"})
            wait_status(hosts["front"]["admin"], {"replica0": "MAINT", "replica1": "MAINT", "peer-peer3": "UP"})
            paths = {"direct": (PEER, hosts["peer"]["base"]), "local_gw": (PEER, hosts["peer"]["port"]),
                     "tls_hop": (FRONT, hosts["front"]["port"])}
            latency = {"as_rendered": latency_phase(paths, args.rounds, rows[0])}
            cfg = hosts["front"]["conf"] / "haproxy.cfg"
            rendered = cfg.read_text()
            keepalive = "    no option http-server-close\n    option http-keep-alive\n    http-reuse always\n"
            if keepalive not in rendered:
                raise UserError(f"{cfg} does not hold the front gateway's keep-alive lines")
            cfg.write_text(rendered.replace(keepalive, "    option http-server-close\n"))
            hosts["front"]["mgr"].service("openjev-gateway.service").reload()
            time.sleep(1.0)
            set_state(hosts["front"]["admin"], {"replica0": "maint", "replica1": "maint"})  # a reload resets states
            wait_status(hosts["front"]["admin"], {"replica0": "MAINT", "replica1": "MAINT", "peer-peer3": "UP"})
            print("variant: front gateway with option http-server-close ...", flush=True)
            latency["variant_server_close"] = latency_phase(paths, args.rounds, rows[0])
            cfg.write_text(rendered)
            hosts["front"]["mgr"].service("openjev-gateway.service").reload()
            time.sleep(1.0)
            set_state(hosts["front"]["admin"], {"replica0": "ready", "replica1": "ready"})
            set_state(hosts["peer"]["admin"], {"replica1": "ready"})
            wait_status(hosts["peer"]["admin"], {"replica0": "UP", "replica1": "UP"})
            wait_status(hosts["front"]["admin"], {"replica0": "UP", "replica1": "UP", "peer-peer3": "UP"})

            # affinity: leastconn, then --prefix-affinity N (re-render, seamless reload of both gateways)
            front_url = (FRONT, hosts["front"]["port"])
            print(f"affinity: leastconn, {args.affinity_rounds} x {len(rows)} requests ...", flush=True)
            least = affinity_run(front_url, rows, ref, groups, args.affinity_rounds, args.clients, seed=1)
            hashed = {}
            for factor in ("150", "0"):
                for h in hosts.values():
                    render(h, "--prefix-affinity", args.prefix_affinity, "--hash-balance-factor", factor)
                    h["mgr"].service("openjev-gateway.service").reload()
                time.sleep(1.0)
                wait_status(hosts["peer"]["admin"], {"replica0": "UP", "replica1": "UP"})
                wait_status(hosts["front"]["admin"], {"replica0": "UP", "replica1": "UP", "peer-peer3": "UP"})
                print(f"affinity: --prefix-affinity {args.prefix_affinity} --hash-balance-factor {factor}, "
                      f"{args.affinity_rounds} x {len(rows)} requests ...", flush=True)
                hashed[factor] = affinity_run(front_url, rows, ref, groups, args.affinity_rounds, args.clients, seed=1)
        finally:
            for mgr, runtime in managers:
                mgr.close()
                shutil.rmtree(runtime, ignore_errors=True)
    load_after = os.getloadavg()

    all_lcp = [lcp(a, b) for i, a in enumerate(rows) for j, b in enumerate(rows) if i < j and groups[i] != groups[j]]
    in_lcp = [lcp(a, b) for i, a in enumerate(rows) for j, b in enumerate(rows) if i < j and groups[i] == groups[j]]
    for name, res in (("leastconn", least), (f"prefix-affinity {args.prefix_affinity}, factor 150", hashed["150"]),
                      (f"prefix-affinity {args.prefix_affinity}, unbounded", hashed["0"])):
        print(f"{name}: {res['requests_per_s']} req/s, p50 {res['latency']['p50_ms']} ms, distinct replicas per "
              f"group {res['mean_distinct_replicas_per_group']}, share on the group's main replica "
              f"{res['share_on_group_main_replica_mean']}, served by {res['served_by']}, failures {res['failures']}, "
              f"mismatches {res['mismatches']}")
    result = {
        **result_head(KIND, load_before, load_after, version),
        "deployment": "two hosts played on 127.0.0.2 (front: gateway with --remote peer3=127.0.0.3:P, two local "
                      "replicas) and 127.0.0.3 (peer: --peer-listen 127.0.0.3:P, two replicas); deploy/install_units.sh "
                      "--backend transformers (tiny random-weight model, float32, OMP_NUM_THREADS=1 per replica), "
                      "certificates from deploy/openjev_certs.sh (ECDSA P-256), run by "
                      "tests/openjev_testsupport/unit_runner.py",
        "parameters": {"rounds": args.rounds, "prefix_affinity": args.prefix_affinity,
                       "affinity_rounds": args.affinity_rounds, "clients": args.clients,
                       "rows": len(rows), "model": "tiny random-weight"},
        "latency": latency,
        "affinity": {
            "input_set": "data/nli_sample.jsonl: option groups = rows sharing instruction and premise",
            "common_prefix_tokens_between_groups_max": max(all_lcp),
            "common_prefix_tokens_within_groups_min": min(in_lcp),
            "leastconn": least,
            f"prefix_affinity_{args.prefix_affinity}_hash_balance_factor_150": hashed["150"],
            f"prefix_affinity_{args.prefix_affinity}_unbounded": hashed["0"],
        },
        "notes": [
            "Latency: one client; the three paths end at the same replica (peer replica0; all other servers in "
            "maintenance); requests interleaved in one run. as_rendered: the front gateway keeps and reuses its "
            "TLS connections to the peer (no option http-server-close, option http-keep-alive, http-reuse always, "
            "as install_units.sh renders a front). variant_server_close: the same front with option "
            "http-server-close (one new TLS connection to the peer per request, resumed from HAProxy's session "
            "cache), measured in the same run after a reload.",
            "Affinity: what is measured is routing (which replica answered each option group); the embedded backend "
            "has no prefix cache, so the cache-hit gain on SGLang replicas is not measured here.",
            "Shared 2-core machine: all processes (6 HAProxy processes' threads, 4 replicas, the client) compete for "
            "the same cores; see the load averages.",
        ],
    }
    write_result(out, result)
    return 0


if __name__ == "__main__":
    run_main(main)
