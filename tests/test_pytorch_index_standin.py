"""tests/_pytorch_index_support.py, the loopback stand-in of PyTorch's index that V100.md's path step 2
installs from in tests/test_runbook_rehearsal.py: pip finds this machine's wheels on the simple pages,
checks their sha256, installs them, and the stand-in answers step 2's check line."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from io import BytesIO

from _http_fixtures import LoopbackHTTPServer
from _pytorch_index_support import INDEX_PATH, TORCH_VERSION, pytorch_index, wheel_paths, wheel_tags
from packaging.utils import parse_wheel_filename

REQUIREMENTS = ["torch==2.9.1+cu126", "torchvision==0.24.1+cu126"]  # as V100.md's step 2 asks


def pip(*args: str, cwd) -> subprocess.CompletedProcess:
    """This interpreter's pip, untouched by the machine's pip configuration and PIP_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", HOME=str(cwd))
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_the_wheels_are_valid_and_the_pages_link_them_with_their_sha256():
    routes, types = pytorch_index()
    wheels = wheel_paths(routes)
    assert len(wheels) == 2 * len(wheel_tags())
    for path in wheels:
        name = path.rsplit("/", 1)[1].replace("%2B", "+")
        project, version, _, tagset = parse_wheel_filename(name)
        with zipfile.ZipFile(BytesIO(routes[path])) as zf:
            record = zf.read(f"{project}-{version}.dist-info/RECORD").decode()
            for line in record.splitlines():
                member, digest, size = line.rsplit(",", 2)
                if digest:
                    data = zf.read(member)
                    assert int(size) == len(data) and digest.startswith("sha256=")
            assert f"Tag: {next(iter(tagset))}" in zf.read(f"{project}-{version}.dist-info/WHEEL").decode()
        page = routes[f"{INDEX_PATH}{project}/"].decode()
        assert f'href="{path}#sha256={hashlib.sha256(routes[path]).hexdigest()}"' in page
        assert types[f"{INDEX_PATH}{project}/"] == "text/html"


def test_pip_installs_the_standins_as_step_2_asks_and_they_answer_its_check_line(tmp_path):
    routes, types = pytorch_index()
    target = tmp_path / "site"
    with LoopbackHTTPServer(routes, content_types=types) as srv:
        proc = pip("install", "--target", str(target), *REQUIREMENTS, "--index-url", srv.url + "whl/cu126",
                   cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        fetched = [r.path for r in srv.requests if r.path.endswith(".whl")]
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert sorted(p.split("/")[-1].split("-")[0] for p in fetched) == ["torch", "torchvision"]
    assert all(f"-{here}-{here}-" in p for p in fetched), fetched
    check = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.cuda.get_arch_list())"],
                           capture_output=True, text=True, env={"PYTHONPATH": str(target), "PATH": os.environ["PATH"]})
    assert check.returncode == 0 and re.fullmatch(rf"{re.escape(TORCH_VERSION)} \[.*'sm_70'.*\]\n", check.stdout), check


def test_pip_refuses_a_wheel_whose_sha256_differs_from_the_link(tmp_path):
    routes, types = pytorch_index()
    with LoopbackHTTPServer(routes, content_types=types) as srv:
        for path in wheel_paths(routes):
            srv.fault(path, corrupt=True, times=None)
        proc = pip("download", "--no-deps", "-d", str(tmp_path / "w"), REQUIREMENTS[0],
                   "--index-url", srv.url + "whl/cu126", cwd=tmp_path)
    assert proc.returncode != 0 and "hash" in (proc.stdout + proc.stderr).lower(), proc.stdout + proc.stderr
    assert not list(tmp_path.glob("w/*.whl"))
