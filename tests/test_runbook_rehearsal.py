"""V100.md's path ("The path, in order"), rehearsed on this CPU machine: its own command blocks, in
order, twice, with bash in a temporary root (so the document cannot drift from the code).

Each block runs as written except for the entries of SUBSTITUTIONS (placeholders and what a CPU
machine cannot have, each with its reason) and ENVIRONMENT. Blocks run in one `bash -eo pipefail`
each; the exported variables and working directory one step leaves are the next step's, as in one
operator shell. Downloads come from loopback HTTP servers with real files and real sha256: PyTorch's
index (a PEP 503 simple index of small real torch and torchvision wheels, tests/_pytorch_index_support.py,
installed into a venv of their own: step 2's rows in SUBSTITUTIONS say why), NVIDIA's
redistributables (real .tar.xz archives of every default component, the manifest's sha256 pinned)
and the Hugging Face hub (the tiny model's processor configs). The V100 steps run to their refusal
and change nothing; the embedded backend serves steps 6-10, as the runbook says for a host without
a V100; step 10's systemctl is played by tests/openjev_testsupport/unit_runner.py, HAProxy for real.
The second pass must change nothing but the measurements (MEASURED).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from _http_fixtures import LoopbackHTTPServer
from _prepare_v100_cuda_support import _tar_xz
from _pytorch_index_support import INDEX_PATH, TORCH_VERSION, pytorch_index, wheel_paths
from _runbook import step_blocks
from conftest import PY, REPO, SAMPLE, free_port, free_ports_on, token_rows, tree_digest
from test_prepare_v100_model import FakeHub

from openjev.cuda.manifest import DEFAULT_COMPONENT_NAMES

# What the steps call on PATH (Debian packages haproxy, systemd, curl, git)
TOOLS = ("haproxy", "systemd-analyze", "curl", "git")
PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"
CUDA_VERSION = "12.6.3"
PLATFORM = "linux-x86_64"
STEP_TIMEOUT = 600

# (step, text in V100.md's block, what runs instead, why). Every text must be found in its step.
SUBSTITUTIONS: list[tuple[int, str, str, str]] = [
    (1, "BUNDLE_URL", "{bundle}", "placeholder: this checkout (git clone of its committed HEAD)"),
    (2, "python3 -m venv venv",
     "{base_python} -m venv --without-pip venv && echo {dev_site} > venv/lib/{pyver}/site-packages/_rehearsal_dev_venv.pth",
     "the venv of steps 3-10: PyTorch's cu126 wheels cannot run here, and the embedded backend needs a real "
     "torch: the venv sees the project's CPU environment "
     "(.venv's site-packages, torch 2.13.0 CPU) through a .pth; .venv is itself a venv, so "
     "--system-site-packages would not show its packages; --without-pip: pip and setuptools too come from .venv "
     "(ensurepip's setuptools cannot build an editable wheel offline)"),
    (2, "venv/bin/python app/prepare_v100_torch.py --record-pins",
     "{base_python} -m venv {torch_venv} && venv/bin/python app/prepare_v100_torch.py --record-pins "
     "--venv {torch_venv} --index-url {torch_index}",
     "the cu126 wheels' stand-ins go into a venv of their own, outside the root, made as the block's first "
     "line makes one (with pip): in venv they would shadow .venv's real CPU torch, which the embedded "
     "backend of steps 5-10 runs on; PyTorch's index is a loopback PEP 503 simple index (/whl/cu126/torch/, "
     "/whl/cu126/torchvision/) of small real wheels named and tagged as PyTorch's for this machine, each link "
     "with its #sha256= (tests/_pytorch_index_support.py); the script, its pins and its receipt are the root's"),
    (2, "-m pip install --no-deps -e .", "-m pip install --no-deps --no-build-isolation -e .",
     "the only package index in tests is the PyTorch stand-in, which has no setuptools: setuptools comes "
     "from .venv instead of an isolated build"),
    (2, "venv/bin/python -c 'import torch", "{torch_venv}/bin/python -c 'import torch",
     "the check line asks the venv the wheels went into (venv's torch is .venv's, as the first row says)"),
    (3, "--version 12.6.3", "--version 12.6.3 --base-url {cuda_url} --sources {cuda_sources}",
     "NVIDIA's redistributables: a loopback mirror of every default component (real .tar.xz, real sha256); "
     "its manifest's sha256 pinned in a copy of HF_SOURCE.json outside the root"),
    (5, "/path/to/openjev-checkpoint", "{checkpoint}", "placeholder: the tiny random-weight checkpoint (make_tiny_model.py)"),
    (6, "31003", "{dev_port}", "a free port: the documented one may be taken on a shared machine"),
    (7, "31003", "{dev_port}", "as step 6"),
    (8, """--exclusive-gpu 3 --server-pid "$(curl -s http://127.0.0.1:31003/server_info | venv/bin/python -c 'import json,sys;print(json.load(sys.stdin)["pid"])')\"""",
     "", "no NVML without a GPU: the exclusivity monitor would refuse to send anything"),
    (8, "31003", "{dev_port}", "as step 6"),
    (8, "/path/to/nli-sets", "{sets}", "placeholder: set G is the bundled 22-row sample"),
    (9, "31001", "{bench_port}", "as step 6"),
    (9, "/path/to/nli-sets", "{sets}", "as step 8"),
    (10, "--gpus 0,1", "--gpus 0,1 --port {gw_port} --replica-port-base {replica_base} --stats-port {stats_port}",
     "free ports instead of 31000, 31100-31101 and 31090"),
    (10, "systemctl --user daemon-reload", "true", "PID 1 is not systemd here; the unit runner reads the files afresh"),
    (10, "systemctl --user enable --now openjev.target openjev-gateway.socket",
     "PYTHONPATH={repo}:{repo}/tests nohup {py} -m openjev_testsupport.unit_runner ~/.config/systemd/user "
     "--runtime-dir {runtime} --log-dir {journal} > {journal}.log 2>&1 & echo $! > {unit_runner_pid}",
     "tests/openjev_testsupport/unit_runner.py plays systemd (socket held on fd 3, Type=notify, the replicas' env files)"),
    (10, "127.0.0.1:31000", "127.0.0.1:{gw_port}", "as --port above"),
]
# The environment every step starts from (then each step's exports): (name, value, why).
ENVIRONMENT = [
    ("HOME", "{home}", "a fresh home: ~ in the blocks, the user unit directory and the hub's cache land under tmp"),
    ("HF_ENDPOINT", "{hub_url}", "the hub: a loopback server with the tiny model's processor configs"),
    ("PIP_INDEX_URL", "{torch_index}", "pip's only package index: the loopback stand-in of PyTorch's"),
    ("PIP_CONFIG_FILE", os.devnull, "this machine's pip configuration files (constraints, find-links) play no part"),
    ("PIP_DISABLE_PIP_VERSION_CHECK", "1", "no request to PyPI for pip's own version"),
]
# Steps that need a V100 and must stop there, changing nothing: (step, block index, stderr needle).
REFUSALS = {(0, 0): "nvidia-smi", (4, 0): "install_v100_runtime.sh: error: preflight failed: "}
# What a second pass rewrites by design, under the root: (path prefix, why).
REWRITTEN = [
    ("serve-", "the development server's log (step 6)"),
    ("results/bench_G_", "the bench re-measures (step 8); its receipts are validated again"),
    ("results/bench_history/", "one more scheduled run (step 9)"),
    (".cuda126.lock", "the lock file holds the last run's pid"),
    ("pycache/", "bytecode cache: pip rewrites its editable finder, which is compiled again"),
]
TIME_LIMIT_S = 300  # both passes; about 100 s on the 2-core development machine


def release() -> tuple[dict[str, bytes], bytes]:
    """Every default CUDA component as a real .tar.xz shaped like NVIDIA's, and the manifest."""
    files: dict[str, bytes] = {}
    manifest: dict = {"release_date": "2024-11-20", "release_label": CUDA_VERSION, "release_product": "cuda"}
    for name in DEFAULT_COMPONENT_NAMES:
        version = "12.6.85" if name == "cuda_nvcc" else "12.6.77"
        members = {"LICENSE": (f"{name} license\n".encode(), 0o644),
                   f"include/{name}.h": (f"/* {name} */\n".encode(), 0o644)}
        if name == "cuda_nvcc":
            members["bin/nvcc"] = (b"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                                   b"echo 'Cuda compilation tools, release 12.6, V12.6.85'\n", 0o755)
        top = f"{name}-{PLATFORM}-{version}-archive"
        data = _tar_xz(top, members, {})
        rel = f"{name}/{PLATFORM}/{top}.tar.xz"
        files["/" + rel] = data
        manifest[name] = {"name": name, "license": "CUDA Toolkit", "version": version,
                          PLATFORM: {"relative_path": rel, "sha256": hashlib.sha256(data).hexdigest(),
                                     "md5": hashlib.md5(data).hexdigest(), "size": str(len(data))}}
    body = json.dumps(manifest, indent=2).encode()
    files[f"/redistrib_{CUDA_VERSION}.json"] = body
    return files, body


def dev_site_packages() -> str:
    import site

    return next(p for p in site.getsitepackages() if p.endswith("site-packages"))


class Rehearsal:
    def __init__(self, tmp: Path, values: dict, env: dict):
        self.tmp, self.values, self.env, self.cwd = tmp, values, dict(env), str(tmp)
        self.groups: list[int] = []
        self.seconds: dict[str, float] = {}
        self.blocks = step_blocks()
        self.log_dir = tmp / "steps"
        self.log_dir.mkdir()

    def block(self, step: int, index: int) -> str:
        text = self.blocks[step][index]
        for n, old, new, _ in SUBSTITUTIONS:  # in table order
            if n == step:
                text = text.replace(old, new.format(**self.values))
        return text

    def run(self, step: int, index: int, tag: str, expect_rc: int | None = 0) -> subprocess.CompletedProcess:
        """One block in bash, from the previous step's variables and directory; returns its output."""
        state = self.log_dir / f"{tag}.state"
        script = (f"trap 'env -0 > {state}.env; pwd > {state}.cwd' EXIT\nset -eo pipefail\n"
                  + self.block(step, index))
        out, err = self.log_dir / f"{tag}.out", self.log_dir / f"{tag}.err"
        with out.open("w") as o, err.open("w") as e:
            proc = subprocess.Popen(["bash", "-c", script], cwd=self.cwd, env=self.env, stdout=o, stderr=e,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            self.groups.append(proc.pid)
            t0 = time.monotonic()
            try:
                rc = proc.wait(timeout=STEP_TIMEOUT)
                self.seconds[tag] = time.monotonic() - t0
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise
        result = subprocess.CompletedProcess(script, rc, out.read_text(), err.read_text())
        if expect_rc is not None:
            assert rc == expect_rc, f"step {tag} exited {rc}:\n{script}\n--- stdout\n{result.stdout[-3000:]}\n" \
                                    f"--- stderr\n{result.stderr[-3000:]}"
        raw = Path(f"{state}.env").read_bytes().split(b"\0")
        self.env = {k: v for k, _, v in (x.decode().partition("=") for x in raw if x)
                    if k not in ("_", "SHLVL", "PWD", "OLDPWD")}
        self.cwd = Path(f"{state}.cwd").read_text().strip()
        return result

    def stop_everything(self) -> None:
        """SIGTERM the unit runner (it stops its units), then every step's process group."""
        pid_file = Path(self.values["unit_runner_pid"])
        if pid_file.exists():
            pid = int(pid_file.read_text())
            try:
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    os.kill(pid, 0)
                    time.sleep(0.2)
            except ProcessLookupError:
                pass
            pid_file.unlink()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for group in self.groups:
                try:
                    os.killpg(group, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(1 if sig == signal.SIGTERM else 0)
        self.groups.clear()


@pytest.fixture()
def rehearsal(tmp_path, tiny_model):
    if not (REPO / ".git").exists():
        pytest.skip("this checkout is not a git repository: step 1 clones it")
    missing = [t for t in TOOLS if shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (apt-get install -y haproxy systemd curl git)")
    files, manifest = release()
    sets = tmp_path / "sets"
    sets.mkdir()
    shutil.copy(SAMPLE, sets / "G.jsonl")
    sources = json.loads((REPO / "HF_SOURCE.json").read_text())
    sources["cuda"]["manifest_sha256"] = hashlib.sha256(manifest).hexdigest()
    (tmp_path / "cuda-sources.json").write_text(json.dumps(sources, indent=2))
    hub = FakeHub({n: (tiny_model["processor"] / n).read_bytes()
                   for n in ("preprocessor_config.json", "video_preprocessor_config.json")},
                  sources["base_model"]["revision"] or "0" * 40)  # the pinned revision, else the default branch's
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    runtime = Path(f"/tmp/openjev-rehearsal-{os.getpid()}")  # AF_UNIX paths: at most 107 bytes
    home = tmp_path / "home"
    home.mkdir()
    index_routes, index_types = pytorch_index()
    with LoopbackHTTPServer(files) as cuda, LoopbackHTTPServer(index_routes, content_types=index_types) as pytorch:
        values = {
            "bundle": str(REPO), "base_python": sys._base_executable, "dev_site": dev_site_packages(), "pyver": PYVER,
            "cuda_url": cuda.url, "cuda_sources": str(tmp_path / "cuda-sources.json"),
            "checkpoint": str(tiny_model["checkpoint"]), "sets": str(sets), "dev_port": free_port(),
            "bench_port": free_port(), "gw_port": free_port(), "stats_port": free_port(),
            "replica_base": free_ports_on("127.0.0.1", 2), "repo": str(REPO), "py": PY, "runtime": str(runtime),
            "journal": str(tmp_path / "journal"), "unit_runner_pid": str(tmp_path / "unit_runner.pid"),
            "home": str(home), "hub_url": f"http://127.0.0.1:{hub.server_address[1]}",
            "torch_index": pytorch.url + INDEX_PATH.strip("/"), "torch_venv": str(tmp_path / "pytorch-venv")}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
               "USER": os.environ.get("USER", "root"), "LOGNAME": os.environ.get("USER", "root"),
               **{k: v.format(**values) for k, v, _ in ENVIRONMENT}}
        r = Rehearsal(tmp_path, values, env)
        r.root = home / "storage" / "sglang-openjev-v100"
        r.cuda, r.hub, r.pytorch, r.pytorch_routes = cuda, hub, pytorch, index_routes
        try:
            yield r
        finally:
            r.stop_everything()
            hub.shutdown()
            shutil.rmtree(runtime, ignore_errors=True)


def digest(root: Path) -> dict:
    return {k: v for k, v in tree_digest(root).items() if not k.startswith(".git/")}


def run_path(r: Rehearsal, n: int) -> dict:
    """Steps 0-10 in order; returns what the steps printed, by tag."""
    out = {}
    for step in sorted(r.blocks):
        for index in range(len(r.blocks[step])):
            tag = f"pass{n}-step{step}.{index}"
            needle = REFUSALS.get((step, index))
            if step == 0 and shutil.which("nvidia-smi"):  # a GPU host: the prerequisites are its own business
                out[tag] = r.run(step, index, tag, expect_rc=None)
                continue
            if needle is not None:
                before = digest(r.root) if r.root.exists() else None
                proc = r.run(step, index, tag, expect_rc=None)
                assert proc.returncode != 0 and needle in proc.stderr, (tag, proc.returncode, proc.stderr[-2000:])
                assert (digest(r.root) if r.root.exists() else None) == before, f"{tag} changed the root"
            else:
                proc = r.run(step, index, tag)
            out[tag] = proc
    return out


def test_the_runbook_path_runs_in_order_and_a_second_pass_changes_nothing(rehearsal):
    r, root = rehearsal, rehearsal.root
    t0 = time.monotonic()
    first = run_path(r, 1)
    p = lambda step, i=0: first[f"pass1-step{step}.{i}"]  # noqa: E731

    # 1: the variables and the directory every later step starts from
    assert r.env["OPENJEV_V100_ROOT"] == str(root) and r.cwd == str(root)
    assert r.env["PYTHONPYCACHEPREFIX"] == str(root / "pycache")
    assert (root / ".git").is_dir() and (root / "app" / "serve_sglang_v100.sh").is_file()
    # 2: pip took this machine's wheels from the loopback index, the step recorded their sha256 in the root's
    # pins.json (trust on first use) and installed them, and the check line printed what the runbook shows;
    # the venv imports the bundle's library and keeps .venv's real torch
    pages = {q.path for q in r.pytorch.requests if not q.path.endswith(".whl")}
    assert pages == {f"{INDEX_PATH}torch/", f"{INDEX_PATH}torchvision/"}, r.pytorch.requests
    fetched = sorted(q.path for q in r.pytorch.requests if q.path.endswith(".whl"))
    assert len(fetched) == 2 and set(fetched) <= set(wheel_paths(r.pytorch_routes)), fetched
    wheel_pins = wheel_pins_recorded(root)
    assert wheel_pins == {f"{path.split('/')[-1].split('-')[0]}.wheels.{path.split('/')[-1].replace('%2B', '+')}":
                          hashlib.sha256(r.pytorch_routes[path]).hexdigest() for path in fetched}, wheel_pins
    assert p(2).stdout.count("(trust on first use)") == 2 and "installed into " in p(2).stdout, p(2).stdout
    assert json.loads((root / "results" / "torch_receipt.json").read_text())["kind"] == "openjev-torch-wheels"
    check = p(2).stdout.strip().splitlines()[-1]
    assert check.startswith(f"{TORCH_VERSION} [") and "'sm_70'" in check, p(2).stdout
    probe = subprocess.run([str(root / "venv/bin/python"), "-c",
                            "import openjev, torch; print(openjev.__file__); print(torch.__version__)"],
                           capture_output=True, text=True, env=r.env, cwd=root)
    assert probe.stdout.splitlines()[0] == str(root / "openjev" / "__init__.py"), probe
    assert probe.stdout.splitlines()[1] != TORCH_VERSION, probe
    # 3: the toolkit, its receipt and the receipt's hash outside the tree
    assert "Cuda compilation tools, release 12.6, V12.6.85" in p(3).stdout
    receipt = json.loads((root / "cuda126" / "openjev_cuda_receipt.json").read_text())
    assert [c["name"] for c in receipt["components"]] == list(DEFAULT_COMPONENT_NAMES)
    assert receipt["base_url"] == r.cuda.url and receipt["complete"] is True
    assert (root / ".cuda126.receipt.sha256").is_file()
    # 4: the dry run printed the plan; the install stopped at its preflight; the embedded backend is chosen
    assert "preflight" in p(4).stdout and not (root / "results" / "runtime_receipt.json").exists()
    assert r.env["OPENJEV_BACKEND"] == "transformers"
    # 5: the overlay, the host pins recorded from the loopback hub, no bytecode in the adapter
    assert json.loads((root / "pins.json").read_text())["kind"] == "openjev-host-pins"
    assert (root / "model" / ".openjev_overlay.json").is_file()
    assert any(path.endswith("/preprocessor_config.json") for _, path in r.hub.requests)
    assert not (root / "sglang_openjev" / "__pycache__").exists()
    # 6-7: the server answered; every argmax equal to the reference's
    assert '"status":"ok"' in p(6).stdout.replace(" ", "")
    assert "argmax agreement 22/22" in p(7).stdout, p(7).stdout
    # 8: the bench receipts are valid
    for mode in ("warm", "cold"):
        assert json.loads((root / "results" / f"bench_G_{mode}.json").read_text())["valid"] is True
    # 9: one scheduled run, complete, and its report
    runs = sorted((root / "results" / "bench_history" / "runs").iterdir())
    assert len(runs) == 1 and json.loads((runs[0] / "run.json").read_text())["complete"] is True
    assert p(9).stdout.strip(), p(9)
    # 10: the units and the gateway, serving the reference's logits bitwise through HAProxy
    units = home_units(r)
    assert {"openjev-gateway.socket", "openjev-gateway.service", "openjev-replica@.service", "openjev.target"} <= units
    assert (root / "gateway" / "haproxy.cfg").is_file()
    assert first["pass1-step10.0"].stdout.count("installed: ") == 7
    _, rows = token_rows(root / "results" / "G.tokens.jsonl")
    got = requests.post(f"http://127.0.0.1:{r.values['gw_port']}/classify", json={"input_ids": rows},
                        timeout=120).json()["logits"]
    assert np.array_equal(np.asarray(got, dtype=np.float32), np.load(root / "results" / "ref_G" / "reference.npy"))
    first_s = time.monotonic() - t0

    # The second pass: nothing changes but the measurements, which stay valid
    r.stop_everything()
    before = digest(root)
    second = run_path(r, 2)
    after = digest(root)
    changed = sorted(k for k in before.keys() | after.keys()
                     if before.get(k) != after.get(k) and not k.startswith(tuple(p for p, _ in REWRITTEN)))
    assert changed == [], changed
    assert "already installed" in second["pass2-step3.0"].stdout
    # 2: the installed wheels verified against the pins pass 1 recorded; nothing downloaded or changed
    recorded = json.loads((root / "pins.json").read_text())["pins"]
    step2 = second["pass2-step2.0"].stdout
    assert "nothing to do" in step2 and wheel_pins_recorded(root) == wheel_pins, step2
    for key in wheel_pins:
        assert f"{key.split('.wheels.')[1]} sha256 {wheel_pins[key]} (recorded on this host at " \
               f"{recorded[key]['recorded_at']} (trust on first use))" in step2, step2
    assert len([q for q in r.pytorch.requests if q.path.endswith(".whl")]) == 2, "step 2 downloaded again"
    assert second["pass2-step10.0"].stdout.count("unchanged: ") == 7, second["pass2-step10.0"].stdout
    assert "argmax agreement 22/22" in second["pass2-step7.0"].stdout
    for mode in ("warm", "cold"):
        assert json.loads((root / "results" / f"bench_G_{mode}.json").read_text())["valid"] is True
    assert len(list((root / "results" / "bench_history" / "runs").iterdir())) == 2
    total = time.monotonic() - t0
    print(f"\nrunbook rehearsal: first pass {first_s:.0f} s, both passes {total:.0f} s; per block: "
          + ", ".join(f"{tag.split('-', 1)[1]} {s:.0f}" for tag, s in r.seconds.items() if tag.startswith("pass1")))
    assert total < TIME_LIMIT_S, f"the rehearsal took {total:.0f} s (limit {TIME_LIMIT_S} s)"


def wheel_pins_recorded(root: Path) -> dict[str, str]:
    """{key: sha256} of the wheel pins step 2 recorded in the root's pins.json."""
    pins = json.loads((root / "pins.json").read_text())["pins"]
    return {k: v["value"] for k, v in pins.items() if ".wheels." in k}


def home_units(r: Rehearsal) -> set[str]:
    return {p.name for p in (Path(r.values["home"]) / ".config" / "systemd" / "user").iterdir()}
