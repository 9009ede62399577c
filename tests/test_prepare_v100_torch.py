"""prepare_v100_torch.py (V100.md path step 2) against the loopback stand-in of PyTorch's index
(tests/_pytorch_index_support.py: small real wheels, PEP 503 pages), installing into real venvs with their
own pip: pins recorded on first use, verified after, a tampered wheel and a differing bundle pin refused
with nothing installed, no pin and no choice refused before any download."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _http_fixtures import LoopbackHTTPServer
from _pytorch_index_support import INDEX_PATH, TORCH_VERSION, TORCHVISION_VERSION, pytorch_index, wheel_paths
from conftest import APP, PY, REPO, error_lines, tree_digest

from openjev.torch_wheels import installed_file

HERE = f"cp{sys.version_info.major}{sys.version_info.minor}"


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A venv with pip and nothing else, made once; each test gets a copy (python -m venv takes seconds)."""
    path = tmp_path_factory.mktemp("venv-template") / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", str(path)], check=True, timeout=300)
    return path


@pytest.fixture()
def index():
    routes, types = pytorch_index()
    with LoopbackHTTPServer(routes, content_types=types) as srv:
        srv.routes = routes
        srv.index_url = srv.url + INDEX_PATH.strip("/")
        yield srv


class Host:
    """A root and a venv on this machine, and the step run as an operator runs it."""

    def __init__(self, tmp: Path, bare_venv: Path, index: LoopbackHTTPServer):
        self.tmp, self.index, self.bare, self.root = tmp, index, bare_venv, tmp / "root"
        self.root.mkdir()
        self.venv = self.new_venv("venv")
        self.pins, self.receipt = self.root / "pins.json", self.root / "results" / "torch_receipt.json"

    def new_venv(self, name: str) -> Path:
        path = self.root / name
        shutil.copytree(self.bare, path, symlinks=True)
        return path

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}  # no find-links, no pip.conf
        return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HOME": str(self.tmp),
                "OPENJEV_V100_ROOT": str(self.root), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}

    def run(self, *args, venv: Path | None = None) -> subprocess.CompletedProcess:
        """As the runbook runs it: by the venv's own Python, which holds nothing but pip (PYTHONPATH stands
        for the bundle's editable install)."""
        venv = venv or self.venv
        python = venv / "bin" / "python" if (venv / "bin" / "python").exists() else Path(PY)
        cmd = [str(python), str(APP / "prepare_v100_torch.py"), "--venv", str(venv), "--index-url",
               self.index.index_url, *map(str, args)]
        return subprocess.run(cmd, capture_output=True, text=True, env=self.env(), timeout=300)

    def installed(self, venv: Path | None = None) -> dict:
        code = ("import json; from importlib import metadata as m\nout = {}\nfor n in ('torch', 'torchvision'):\n"
                "    try: out[n] = m.version(n)\n    except m.PackageNotFoundError: out[n] = None\nprint(json.dumps(out))")
        proc = subprocess.run([str((venv or self.venv) / "bin" / "python"), "-I", "-c", code], capture_output=True,
                              text=True, check=True)
        return json.loads(proc.stdout)

    def served(self) -> dict[str, str]:
        """{file name: sha256} of this machine's wheels as the index serves them now."""
        return {p.rsplit("/", 1)[1].replace("%2B", "+"): hashlib.sha256(self.index.routes[p]).hexdigest()
                for p in wheel_paths(self.index.routes) if f"-{HERE}-{HERE}-" in p}

    def tamper(self) -> None:
        routes, types = pytorch_index(tampered=True)
        for path, data in routes.items():
            self.index.put(path, data, types.get(path))
        self.index.routes = routes

    def wheel_downloads(self) -> int:
        return len([r for r in self.index.requests if r.path.endswith(".whl")])


@pytest.fixture()
def host(tmp_path, bare_venv, index) -> Host:
    return Host(tmp_path, bare_venv, index)


def sources_with(tmp_path: Path, **pins) -> Path:
    src = json.loads((REPO / "HF_SOURCE.json").read_text())
    for project, value in pins.items():
        src[project]["wheel_sha256"] = value
    path = tmp_path / "HF_SOURCE.json"
    path.write_text(json.dumps(src))
    return path


def one_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("prepare_v100_torch.py: error: "), proc.stderr
    return lines[0]


def test_first_run_records_both_sha256_and_installs_the_verified_files(host):
    proc = host.run("--record-pins")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert host.installed() == {"torch": TORCH_VERSION, "torchvision": TORCHVISION_VERSION}
    served = host.served()
    pins = json.loads(host.pins.read_text())["pins"]
    assert {k: v["value"] for k, v in pins.items()} == {f"{n.split('-')[0]}.wheels.{n}": sha for n, sha in served.items()}
    assert all(v["recorded_by"] == "app/prepare_v100_torch.py" for v in pins.values())
    receipt = json.loads(host.receipt.read_text())
    assert receipt["kind"] == "openjev-torch-wheels" and receipt["made_by"] == "app/prepare_v100_torch.py"
    assert receipt["venv"] == str(host.venv) and receipt["record_pins"] is True
    validated = subprocess.run([PY, str(APP / "validate_receipts.py"), str(host.receipt)], capture_output=True, text=True)
    assert validated.returncode == 0 and "ok (openjev-torch-wheels)" in validated.stdout, validated.stderr
    for project, entry in receipt["wheels"].items():
        assert served[entry["file"]] == entry["sha256"] and entry["pinned"] is True
        recorded_at = pins[f"{project}.wheels.{entry['file']}"]["recorded_at"]
        assert entry["verified"] == f"recorded on this host at {recorded_at} (trust on first use)"
        assert entry["verified"] in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == f"installed into {host.venv}; receipt {host.receipt}"
    # pip kept each installed file's sha256: what a re-run reads
    site = next((host.venv / "lib").glob("python*/site-packages"))
    for dist in site.glob("torch*.dist-info"):
        name, sha = installed_file({"direct_url": json.loads((dist / "direct_url.json").read_text())})
        assert served[name] == sha
    assert not (host.root / "wheels" / "download").exists()
    listed = subprocess.run([PY, str(APP / "verify_sources.py"), "--pins", str(host.pins)], capture_output=True,
                            text=True, env=host.env())
    assert "torch.wheel_sha256 (checked by prepare_v100_torch.py)" in listed.stdout, listed.stdout
    assert f"torch.wheels.{next(n for n in served if n.startswith('torch-'))} = " in listed.stdout


def test_a_second_run_verifies_and_changes_nothing(host):
    assert host.run("--record-pins").returncode == 0
    before, downloads = tree_digest(host.root), host.wheel_downloads()
    proc = host.run()
    assert proc.returncode == 0, proc.stderr
    assert "already installed: " in proc.stdout and proc.stdout.rstrip().endswith("nothing to do"), proc.stdout
    assert proc.stdout.count("(trust on first use)") == 2
    assert tree_digest(host.root) == before and host.wheel_downloads() == downloads


def test_a_tampered_wheel_on_a_later_run_is_refused_and_nothing_installed(host):
    assert host.run("--record-pins").returncode == 0
    pins_before = host.pins.read_bytes()
    host.tamper()  # the same file names, other bytes, pages linking their sha256: pip itself accepts them
    fresh = host.new_venv("venv2")
    line = one_error(host.run("--record-pins", venv=fresh))
    torch_file = next(n for n in host.served() if n.startswith("torch-"))
    assert f"torch.wheels.{torch_file}: " in line and f"but {host.pins} recorded " in line, line
    assert f"the file is kept aside as {host.root / 'wheels' / 'rejected' / torch_file}; nothing was installed" in line
    assert host.installed(fresh) == {"torch": None, "torchvision": None}
    assert host.pins.read_bytes() == pins_before
    kept = host.root / "wheels" / "rejected" / torch_file
    assert hashlib.sha256(kept.read_bytes()).hexdigest() == host.served()[torch_file]
    assert not (host.root / "wheels" / "download").exists()


def test_a_bundle_pin_that_differs_is_refused_and_one_that_matches_is_the_check(host, tmp_path):
    line = one_error(host.run("--record-pins", "--sources", sources_with(tmp_path, torchvision="0" * 64)))
    assert f"HF_SOURCE.json pins {'0' * 64}; refusing; the file is kept aside as " in line, line
    assert host.installed() == {"torch": None, "torchvision": None} and not host.pins.exists()

    served = host.served()
    torch_sha = next(sha for n, sha in served.items() if n.startswith("torch-"))
    proc = host.run("--record-pins", "--sources", sources_with(tmp_path, torch=torch_sha))
    assert proc.returncode == 0, proc.stderr
    wheels = json.loads(host.receipt.read_text())["wheels"]
    assert wheels["torch"]["verified"] == "bundle pin"
    assert list(json.loads(host.pins.read_text())["pins"]) == [f"torchvision.wheels.{wheels['torchvision']['file']}"]


def test_without_pins_or_a_choice_it_refuses_before_downloading(host):
    line = one_error(host.run())
    assert "torch: HF_SOURCE.json pins no wheel sha256 (torch.wheel_sha256 is null)" in line
    assert "--record-pins" in line and "--allow-unpinned" in line
    assert host.wheel_downloads() == 0 and not host.pins.exists() and not host.receipt.exists()
    assert host.installed() == {"torch": None, "torchvision": None}


def test_allow_unpinned_installs_once_records_nothing_and_says_so(host):
    proc = host.run("--allow-unpinned")
    assert proc.returncode == 0, proc.stderr
    receipt = json.loads(host.receipt.read_text())
    assert {e["verified"] for e in receipt["wheels"].values()} == {"not verified (accepted with --allow-unpinned)"}
    assert not host.pins.exists()
    assert "torch: HF_SOURCE.json pins no wheel sha256" in one_error(host.run())  # a one-off: not a pin


def test_an_install_from_the_index_is_replaced_by_the_verified_file(host):
    """The runbook's old step 2 (pip install from the index) left torch there, same version: pip would keep
    it in place of the file, so the step reinstalls the verified one."""
    subprocess.run([str(host.venv / "bin" / "python"), "-m", "pip", "install", "torch==" + TORCH_VERSION,
                    "--index-url", host.index.index_url], check=True, capture_output=True, env=host.env())
    proc = host.run("--record-pins")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    receipt = json.loads(host.receipt.read_text())
    assert any("--force-reinstall" in cmd for cmd in receipt["commands"]), receipt["commands"]
    assert host.run().stdout.rstrip().endswith("nothing to do")


def old_pip_wheel() -> Path | None:
    """A pip before 22.2 (which records no sha256 of a plain local file in direct_url.json), as Ubuntu 22.04's
    venvs have: one bundled with an older CPython beside this one (pyenv), if any."""
    versions = Path(sys._base_executable).resolve().parents[2]
    found = sorted(versions.glob("*/lib/python3.*/ensurepip/_bundled/pip-2[0-2].[0-1]*-py3-none-any.whl"))
    return found[-1] if found else None


def test_a_venv_with_an_older_pip_gets_the_same_checks(host):
    wheel = old_pip_wheel()
    if wheel is None:
        pytest.skip("no pip older than 22.2 on this machine (an older CPython's ensurepip bundle)")
    subprocess.run([str(host.venv / "bin" / "python"), "-m", "pip", "install", "--no-index", str(wheel)], check=True,
                   capture_output=True, env=host.env())
    proc = host.run("--record-pins")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert host.run().stdout.rstrip().endswith("nothing to do")


def test_no_venv_is_one_line(host, tmp_path):
    line = one_error(host.run("--record-pins", venv=tmp_path / "nowhere"))
    assert f"no Python interpreter at {tmp_path / 'nowhere' / 'bin' / 'python'}" in line


def test_installed_file_reads_both_forms_of_direct_url():
    url = "file:///r/wheels/download/torch-2.9.1%2Bcu126-cp311-cp311-manylinux_2_28_x86_64.whl"
    name = "torch-2.9.1+cu126-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert installed_file({"direct_url": {"url": url, "archive_info": {"hashes": {"sha256": "ab"}}}}) == (name, "ab")
    assert installed_file({"direct_url": {"url": url, "archive_info": {"hash": "sha256=cd"}}}) == (name, "cd")
    assert installed_file({"direct_url": None}) == (None, None) and installed_file(None) == (None, None)


def test_help_has_examples_and_every_flag():
    proc = subprocess.run([PY, str(APP / "prepare_v100_torch.py"), "--help"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0
    for word in ("Examples:", "--record-pins", "--allow-unpinned", "--pins", "--sources", "--venv", "--index-url"):
        assert word in proc.stdout, word
