#!/usr/bin/env python3
"""The production layout on GPUs: the gateway over two embedded replicas, failover under load.

The deployment is the real one, as in benchmarks/bench_gateway.py: units and haproxy.cfg rendered by
deploy/install_units.sh (`--backend transformers`), run by tests/openjev_testsupport/unit_runner.py the way systemd
runs them (socket held by the runner, fd 3; each replica's CUDA_VISIBLE_DEVICES comes from its unit
instance, `Environment=CUDA_VISIBLE_DEVICES=%i`). Phases, each written to the receipt as it ends:

  placement    NVML: on which physical GPU each replica's main process holds a context, and the
               CUDA_VISIBLE_DEVICES it was started with (read from /proc/PID/environ)
  exclusivity  app/bench_classify_v100.py --exclusive-gpu G --server-pid PID straight to each
               replica's port (the whole set, one measured pass): valid when no other process used
               that replica's GPU during the run
  throughput   --requests requests (1 or 2 rows of the set each) from --clients keep-alive clients
               through the gateway with one replica (replica 1 in maintenance) and with two, in one
               run; the ratio two/one
  failover     --failover-requests requests from --clients clients through the gateway; replica 0
               and its process group SIGKILLed when a third of them are done; HAProxy marks it
               DOWN, the runner restarts it (Restart=on-failure, RestartSec=5s) and HAProxy admits
               it again; then --after-requests more requests must reach it

Every answer is compared with the reference logits (score_reference.py on the same GPU, FP16,
one unpadded row per forward): a mismatch is a different argmax or a softmax probability off by
more than --max-prob-diff (0 = bitwise equality of the logits).

With one GPU (the kind this workplace lends), --share-gpu N puts both replicas on GPU N
(a CUDA_VISIBLE_DEVICES=N line appended to each rendered replica-<G>.env overrides the instance's
value, as an EnvironmentFile line does under systemd): the receipt says so, and the exclusivity check is then expected to be invalid
(the other replica is a competitor on the same GPU). Throughput two/one on one shared GPU measures
sharing, not the two-GPU scaling of eva01.

Example (benchmarks/h200_session15.sh runs it on the GPU machine):
  python3 benchmarks/bench_replicas_gpu.py --model M --inputs SET.jsonl --tokens SET.tokens.jsonl \\
      --reference REF --share-gpu 0 --out results_h200/two_gpu/replicas_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

from openjev.common import UserError, atomic_write_json, git_revision, run_main, softmax, utc_now
from openjev_testsupport import unit_runner
from openjev_testsupport.loopback_bench import (Client, RequestNumbers, admin, free_pair, machine, request_rows, run,
                                                run_clients, summary_ms)
from openjev_testsupport.ports import free_port

KIND = "openjev-replicas-gpu-bench"
PY = sys.executable


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="model overlay the replicas serve")
    p.add_argument("--inputs", type=Path, required=True, help="input rows (JSONL) the token file was made from")
    p.add_argument("--tokens", type=Path, required=True, help="token file (tokenize_nli.py / make_synthetic_inputs.py)")
    p.add_argument("--reference", type=Path, required=True, help="reference dir (score_reference.py output)")
    p.add_argument("--out", type=Path, required=True, help="receipt JSON (refused if it exists)")
    p.add_argument("--work", type=Path, default=None, help="units, logs, bench receipts (default: beside --out)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpus", default="0,1", help="GPU indices, one replica each (default: %(default)s)")
    g.add_argument("--share-gpu", type=int, default=None, metavar="N",
                   help="one-GPU machine: two replicas (instances 0 and 1), both on GPU N")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu rehearses the script on a machine without a GPU (no NVML phases) (default: %(default)s)")
    p.add_argument("--requests", type=int, default=512, help="requests per throughput run (default: %(default)s)")
    p.add_argument("--failover-requests", type=int, default=2000, help="requests of the failover run (default: %(default)s)")
    p.add_argument("--after-requests", type=int, default=96, help="requests after the rejoin (default: %(default)s)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default: %(default)s)")
    p.add_argument("--max-prob-diff", type=float, default=2e-3,
                   help="largest softmax difference that still matches the reference; 0 = bitwise (default: %(default)s)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra replica setting (install_units.sh --env), e.g. MAX_RUNNING_REQUESTS=32")
    p.add_argument("--replica-args", default=None, metavar="ARGS",
                   help="server flags for every replica (OPENJEV_REPLICA_ARGS in its env file), e.g. '--batching exact'")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds for the replicas to be UP (default: %(default)s)")
    p.add_argument("--haproxy", default=None, help="HAProxy executable (default: haproxy on PATH)")
    p.add_argument("--machine-label", default=None, help="what the receipt calls this machine")
    return p


# ---------------------------------------------------------------- pure helpers
def compare(got: np.ndarray, ref: np.ndarray, max_prob_diff: float) -> tuple[bool, float, bool]:
    """(matches, largest softmax difference, bitwise equal) of answered logits against the reference rows."""
    if got.shape != ref.shape:
        return False, float("inf"), False
    bitwise = bool(np.array_equal(got, ref))
    diff = float(np.abs(softmax(got.astype(np.float64)) - softmax(ref.astype(np.float64))).max())
    if max_prob_diff == 0:
        return bitwise, diff, bitwise
    same_argmax = bool((got.argmax(axis=-1) == ref.argmax(axis=-1)).all())
    return same_argmax and diff <= max_prob_diff, diff, bitwise


def replica_placement(replica_gpus: dict[str, list[int]], expected: dict[str, int]) -> dict:
    """Verdict on NVML's view: every replica on exactly its expected physical GPU."""
    ok = {name: replica_gpus.get(name) == [gpu] for name, gpu in expected.items()}
    return {"seen": replica_gpus, "expected": {k: [v] for k, v in expected.items()}, "each_on_its_gpu_only": all(ok.values()),
            "per_replica": ok}


# ---------------------------------------------------------------- load
class Load(RequestNumbers):
    """Requests through the gateway from keep-alive clients, in a thread; progress readable while it runs."""

    def __init__(self, port: int, rows: list[list[int]], ref: np.ndarray, n: int, clients: int, max_prob_diff: float):
        super().__init__(n)
        self.port, self.rows, self.ref, self.clients, self.tol = port, rows, ref, clients, max_prob_diff
        self.row_count = self.bitwise = 0
        self.failures: list[str] = []
        self.mismatches: list[int] = []
        self.max_diff = 0.0
        self.latency: list[float] = []
        self.by_replica: dict[str, int] = {}
        self.seconds = 0.0
        self._thread: threading.Thread | None = None

    def _worker(self) -> None:
        c = Client(self.port)
        while (i := self.take()) is not None:
            idx = request_rows(i, len(self.rows))
            body = json.dumps({"input_ids": [self.rows[j] for j in idx]}).encode()
            t0 = time.perf_counter()
            try:
                status, data, headers = c.call("POST", "/classify", body)
                err = None if status == 200 else f"request {i}: HTTP {status} {data[:200]!r}"
            except UserError as exc:
                status, data, headers, err = 0, b"", {}, f"request {i}: {exc}"
            dt = time.perf_counter() - t0
            with self.lock:
                self.in_flight -= 1
                self.done += 1
                self.latency.append(dt)
                self.row_count += len(idx)
                if err is not None:
                    self.failures.append(err)
                    continue
                got = np.asarray(json.loads(data)["logits"], dtype=np.float32)
                ok, diff, bitwise = compare(got, self.ref[idx], self.tol)
                self.max_diff = max(self.max_diff, diff)
                self.bitwise += int(bitwise)
                if not ok:
                    self.mismatches.append(i)
                name = {k.lower(): v for k, v in headers.items()}.get("x-openjev-replica", "?")
                self.by_replica[name] = self.by_replica.get(name, 0) + 1

    def start(self) -> "Load":
        def body():
            self.seconds = run_clients(self._worker, self.clients)

        self._thread = threading.Thread(target=body)
        self._thread.start()
        return self

    def wait_done(self, count: int, timeout: float = 1800) -> None:
        deadline = time.monotonic() + timeout
        while self.done < count and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise UserError(f"load: {self.done} of {count} requests done after {timeout:.0f} s")
            time.sleep(0.02)

    def join(self) -> "Load":
        self._thread.join()
        return self

    def summary(self) -> dict:
        return {"requests": self.n, "rows": self.row_count, "clients": self.clients, "seconds": round(self.seconds, 3),
                "requests_per_s": round(self.n / self.seconds, 2) if self.seconds else None,
                "rows_per_s": round(self.row_count / self.seconds, 2) if self.seconds else None,
                "latency": summary_ms(self.latency) if self.latency else None,
                "failures": len(self.failures), "failure_examples": self.failures[:5],
                "mismatches": len(self.mismatches), "bitwise_equal_answers": self.bitwise,
                "max_softmax_diff": round(self.max_diff, 6), "served_by": dict(sorted(self.by_replica.items()))}


# ---------------------------------------------------------------- HAProxy runtime API
def stats(path: Path) -> dict[str, dict[str, str]]:
    lines = admin(path, "show stat").lstrip("# ").splitlines()
    head = lines[0].split(",")
    rows = [dict(zip(head, line.split(","))) for line in lines[1:] if line]
    return {r["svname"]: r for r in rows if r.get("pxname") == "openjev" and r["svname"].startswith("replica")}


def wait_for(what: str, check, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except OSError:
            pass
        time.sleep(interval)
    raise UserError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_status(path: Path, want: dict[str, str], timeout: float) -> None:
    wait_for(f"replicas {want}", lambda: all(stats(path)[k]["status"] == v for k, v in want.items()), timeout)


# ---------------------------------------------------------------- GPU facts (NVML)
def gpu_processes() -> dict[int, list[int]]:
    """Physical GPU index -> PIDs with a compute context there (NVML)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return {i: sorted(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(pynvml.nvmlDeviceGetCount())}
    finally:
        pynvml.nvmlShutdown()


def proc_env(pid: int, key: str) -> str | None:
    try:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            k, _, v = item.decode(errors="replace").partition("=")
            if k == key:
                return v
    except OSError:
        return None
    return None


def gpu_description() -> dict:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,compute_cap,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True)
    return {"nvidia_smi": [line.strip() for line in out.stdout.splitlines() if line.strip()] or out.stderr.strip()}


# ---------------------------------------------------------------- main
def main() -> int:
    args = build_parser().parse_args()
    out = args.out.resolve()
    if "results_v100" in out.parts:
        raise UserError(f"{out} is under results_v100/, which holds V100 receipts only")
    if out.exists():
        raise UserError(f"{out} exists; choose another --out (receipts are never overwritten)")
    for path, what in ((args.model, "--model"), (args.inputs, "--inputs"), (args.tokens, "--tokens"),
                       (args.reference / "reference.npy", "--reference")):
        if not path.exists():
            raise UserError(f"{what}: {path} does not exist")
    if min(args.requests, args.failover_requests, args.after_requests, args.clients) < 1:
        raise UserError("--requests, --failover-requests, --after-requests and --clients must be >= 1")
    if args.share_gpu is not None:
        gpus, expected = [0, 1], {"replica0": args.share_gpu, "replica1": args.share_gpu}
    else:
        try:
            gpus = [int(g) for g in args.gpus.split(",")]
        except ValueError:
            raise UserError(f"--gpus must be comma-separated GPU indices, got {args.gpus!r}") from None
        if len(gpus) != 2 or len(set(gpus)) != 2:
            raise UserError(f"--gpus must name two different GPUs, got {args.gpus!r}")
        expected = {f"replica{g}": g for g in gpus}
    names = [f"replica{g}" for g in gpus]
    haproxy = shutil.which(args.haproxy or "haproxy") or ("/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None)
    if haproxy is None:
        raise UserError("haproxy is not installed (Debian: apt-get install haproxy), or give --haproxy PATH")
    gpu_mode = args.device == "cuda"

    rows = [json.loads(line)["input_ids"] for line in args.tokens.read_text().splitlines() if line.strip()]
    ref = np.load(args.reference / "reference.npy")
    if len(rows) != len(ref):
        raise UserError(f"{args.tokens} has {len(rows)} rows, {args.reference}/reference.npy {len(ref)}")

    work = (args.work or out.parent / (out.stem + ".work")).resolve()
    if work.exists() and any(work.iterdir()):
        raise UserError(f"{work} exists and is not empty; give another --work")
    (work / "root").mkdir(parents=True, exist_ok=True)
    receipt: dict = {"kind": KIND, "created": utc_now(), "bundle_git": git_revision(),
                     "machine": {**machine(), **(gpu_description() if gpu_mode else {}),
                                 "label": args.machine_label or machine()["label"]},
                     "layout": ("two replicas sharing GPU %d (one-GPU machine: not the two-GPU layout of eva01)"
                                % args.share_gpu) if args.share_gpu is not None else f"one replica per GPU {gpus}",
                     "parameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "phases": {}}
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(phase: str | None = None, value=None) -> None:
        if phase is not None:
            receipt["phases"][phase] = value
            print(f"== {phase}: {json.dumps(value)[:600]}", flush=True)
        atomic_write_json(out, receipt)

    env = [f"OPENJEV_PYTHON={PY}", *args.env]
    if not gpu_mode:
        env.append("OMP_NUM_THREADS=1")
    elif not shutil.which("nvidia-smi", path=unit_runner.MANAGER_PATH):
        import torch  # the launcher's arch detection needs nvidia-smi on the units' PATH

        major, minor = torch.cuda.get_device_capability(0)
        env.append(f"OPENJEV_GPU_ARCH=sm{major}{minor}")
    port, stats_port, base = free_port(), free_port(), free_pair()
    render = ["bash", REPO / "deploy" / "install_units.sh", "--root", work / "root", "--model", args.model.resolve(),
              "--unit-dir", work / "units", "--conf-dir", work / "conf", "--gpus", ",".join(map(str, gpus)),
              "--port", port, "--stats-port", stats_port, "--replica-port-base", base - min(gpus),
              "--backend", "transformers", "--haproxy", haproxy, "--no-verify"]
    for kv in env:
        render += ["--env", kv]
    run(render, "install_units.sh")
    if args.replica_args:
        # After the installer's own OPENJEV_REPLICA_ARGS line (empty on 127.0.0.1): the later line wins.
        for g in gpus:
            with open(work / "conf" / f"replica-{g}.env", "a") as f:
                f.write(f"OPENJEV_REPLICA_ARGS={args.replica_args}\n")
    if args.share_gpu is not None:
        # The installer sets CUDA_VISIBLE_DEVICES from the instance only (it refuses --env for it); an
        # operator's line in the replica's EnvironmentFile overrides Environment= under systemd and the runner.
        for g in gpus:
            with open(work / "conf" / f"replica-{g}.env", "a") as f:
                f.write(f"# bench_replicas_gpu.py --share-gpu: one-GPU machine, every replica on GPU {args.share_gpu}\n"
                        f"CUDA_VISIBLE_DEVICES={args.share_gpu}\n")
    replica_port = {f"replica{g}": base - min(gpus) + g for g in gpus}
    runtime = Path(tempfile.mkdtemp(prefix="ojgpu-", dir="/tmp"))  # short: AF_UNIX path limit
    adm = runtime / "openjev-gateway" / "admin.sock"
    mgr = unit_runner.Manager(work / "units", runtime, work / "journal")
    receipt["haproxy_version"] = subprocess.run([haproxy, "-v"], capture_output=True, text=True).stdout.split()[2]
    save()
    status = 1
    try:
        t0 = time.monotonic()
        mgr.start_target("openjev.target")
        wait_status(adm, {n: "UP" for n in names}, args.start_timeout)
        services = {n: mgr.service(f"openjev-replica@{n[len('replica'):]}.service") for n in names}
        save("start", {"seconds_to_both_up": round(time.monotonic() - t0, 1), "gateway_port": port,
                       "replica_ports": replica_port})

        pids = {n: s.main_pid for n, s in services.items()}
        if gpu_mode:
            procs = gpu_processes()
            seen = {n: [g for g, p in procs.items() if pid in p] for n, pid in pids.items()}
            save("placement", {**replica_placement(seen, expected), "pids": pids,
                               "cuda_visible_devices": {n: proc_env(pid, "CUDA_VISIBLE_DEVICES") for n, pid in pids.items()},
                               "all_gpu_processes": {str(g): p for g, p in procs.items()}})

            excl = {}
            subset = work / "exclusive"
            subset.mkdir()
            for n in names:
                bench = [PY, REPO / "app" / "bench_classify_v100.py", "--url", f"http://127.0.0.1:{replica_port[n]}",
                         "--inputs", args.inputs, "--tokens", args.tokens, "--reference", args.reference,
                         "--repetitions", 1, "--exclusive-gpu", expected[n], "--server-pid", pids[n],
                         "--out", subset / f"{n}.json", "--label", f"exclusive-{n}"]
                if args.machine_label:
                    bench += ["--machine-label", args.machine_label]
                proc = subprocess.run([str(c) for c in bench], capture_output=True, text=True, cwd=REPO)
                rec = json.loads((subset / f"{n}.json").read_text()) if (subset / f"{n}.json").exists() else {}
                ex = rec.get("exclusive") or {}
                excl[n] = {"exit_code": proc.returncode, "gpu": expected[n],
                           "valid": ex.get("valid") if isinstance(ex, dict) else None,
                           "reason": ex.get("reason") if isinstance(ex, dict) else None,
                           "stderr_tail": proc.stderr.strip().splitlines()[-3:]}
            save("exclusivity", {"per_replica": excl,
                                 "expected_valid": args.share_gpu is None,
                                 "note": "two replicas on one GPU: each is the other's competitor, so invalid is the "
                                         "expected verdict" if args.share_gpu is not None else
                                         "one replica per GPU: each run must be valid"})

        admin(adm, f"set server openjev/{names[1]} state maint")
        wait_status(adm, {names[1]: "MAINT"}, 60)
        one = Load(port, rows, ref, args.requests, args.clients, args.max_prob_diff).start().join().summary()
        admin(adm, f"set server openjev/{names[1]} state ready")
        wait_status(adm, {n: "UP" for n in names}, 120)
        two = Load(port, rows, ref, args.requests, args.clients, args.max_prob_diff).start().join().summary()
        save("throughput", {"one_replica": one, "two_replicas": two,
                            "ratio_two_vs_one": round(two["requests_per_s"] / one["requests_per_s"], 3)})

        victim, name = services[names[0]], names[0]
        pid_before = victim.main_pid
        before = stats(adm)
        load = Load(port, rows, ref, args.failover_requests, args.clients, args.max_prob_diff).start()
        load.wait_done(args.failover_requests // 3)
        in_flight = load.in_flight
        t_kill = time.monotonic()
        victim.kill(signal.SIGKILL)  # the replica and its process group, at once
        t_down = wait_for(f"HAProxy to mark {name} DOWN",
                          lambda: stats(adm)[name]["status"].startswith("DOWN") and time.monotonic(), 120)
        load.join()
        t_up = wait_for(f"{name} to rejoin (UP)", lambda: stats(adm)[name]["status"] == "UP" and time.monotonic(),
                        args.start_timeout)
        after = Load(port, rows, ref, args.after_requests, args.clients, args.max_prob_diff).start().join().summary()
        st = stats(adm)
        failover = {**load.summary(), "killed": name, "killed_pid": pid_before, "new_pid": victim.main_pid,
                    "restarts": len(victim.restarts()), "in_flight_at_kill": in_flight,
                    "seconds_to_down": round(t_down - t_kill, 2), "seconds_to_rejoin": round(t_up - t_kill, 2),
                    "retries": sum(int(st[n]["wretr"]) - int(before[n]["wretr"]) for n in names),
                    "redispatches": sum(int(st[n]["wredis"]) - int(before[n]["wredis"]) for n in names),
                    "after_rejoin": after}
        if gpu_mode:
            procs = gpu_processes()
            failover["placement_after_restart"] = {n: [g for g, p in procs.items() if services[n].main_pid in p]
                                                   for n in names}
        ok = (failover["failures"] == 0 and failover["mismatches"] == 0 and after["failures"] == 0
              and after["mismatches"] == 0 and after["served_by"].get(name, 0) > 0
              and failover["new_pid"] not in (None, pid_before))
        failover["verdict"] = "pass" if ok else "fail"
        save("failover", failover)
        status = 0 if ok else 1
    except (UserError, unit_runner.UnitError) as exc:
        receipt["error"] = str(exc)
        save()
        raise
    finally:
        mgr.close()
        shutil.rmtree(runtime, ignore_errors=True)
        receipt["finished"] = utc_now()
        save()
    print(f"wrote {out}")
    return status


if __name__ == "__main__":
    run_main(main)
