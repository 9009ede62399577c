"""Running app/serve_sglang_v100.sh for the launcher tests (tests/test_serve_sglang_v100_*.py).

The real script runs with bash in a controlled environment (PATH holds only the tools the launcher
uses, plus stand-in gcc-10 / nvidia-smi executables where a test needs them). `--print-command`
output is parsed back into the environment and argv it would exec. The fixtures (`tools`, `root`,
`checkpoint`, `run`) are imported by the test modules that use them.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "app" / "serve_sglang_v100.sh"
BASH = shutil.which("bash") or "/bin/bash"
PY = sys.executable

# Variables the launcher reads; stripped from the inherited environment so the host cannot leak in.
CONTROLLED = {
    "OPENJEV_BACKEND", "OPENJEV_V100_ROOT", "OPENJEV_PYTHON", "OPENJEV_SGLANG_MODULE", "OPENJEV_GPU_ARCH", "OPENJEV_CC", "OPENJEV_CXX",
    "OPENJEV_ARCH_PROFILE", "OPENJEV_SGLANG_RUNTIME", "OPENJEV_LAUNCH_ADAPTATIONS", "CUDA_VISIBLE_DEVICES", "CONTEXT_LENGTH", "MAX_RUNNING_REQUESTS", "SCHEDULE_POLICY",
    "MEM_FRACTION_STATIC", "MAMBA_FULL_MEMORY_RATIO", "SGLANG_V100_DYNAMIC_PAGED", "PYTHONPATH", "CUDA_HOME",
    "CC", "CXX", "CUDAHOSTCXX",
}


# ---------------------------------------------------------------- running the launcher
@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> dict[str, Path]:
    """bin/: only what the launcher needs; gcc10/ and a stand-in nvidia-smi are added per test."""
    base = tmp_path_factory.mktemp("tools")
    bin_dir = base / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "awk", "mkdir", "cat", "sh", "env"):
        found = shutil.which(tool)
        assert found, f"{tool} is needed by the launcher tests"
        (bin_dir / tool).symlink_to(found)
    gcc_dir = base / "gcc10"
    gcc_dir.mkdir()
    for name in ("gcc-10", "g++-10"):
        _write_exe(gcc_dir / name, "#!/bin/sh\necho 'stand-in compiler for the launcher tests'\n")
    return {"bin": bin_dir, "gcc10": gcc_dir}


def _write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    ckpt = tmp_path / "model"
    ckpt.mkdir()
    return ckpt


@pytest.fixture
def run(tools, root):
    """run(*args, env={...}, gcc=True) -> CompletedProcess of `bash serve_sglang_v100.sh args`."""

    def _run(*args, env: dict | None = None, gcc: bool = True, extra_path: tuple = ()) -> subprocess.CompletedProcess:
        return subprocess.run([BASH, str(LAUNCHER), *map(str, args)], capture_output=True, text=True, timeout=60,
                              env=launcher_env(tools, root, env, gcc, extra_path))

    return _run


def launcher_env(tools, root, env, gcc, extra_path) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in CONTROLLED and k != "PATH"}
    path = [str(p) for p in extra_path] + ([str(tools["gcc10"])] if gcc else []) + [str(tools["bin"])]
    full.update(PATH=os.pathsep.join(path), OPENJEV_V100_ROOT=str(root), OPENJEV_PYTHON=PY)
    full.update(env or {})
    return {k: v for k, v in full.items() if v is not None}


def printed(proc: subprocess.CompletedProcess) -> tuple[dict[str, str], list[str]]:
    """Parse --print-command output: KEY=VALUE lines (values shell-quoted), then the command."""
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert len(lines) >= 2
    env = {}
    for line in lines[:-1]:
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), line
        words = shlex.split(value) if value else [""]
        assert len(words) == 1, line
        env[key] = words[0]
    return env, shlex.split(lines[-1])


def sglang_flags(argv: list[str]) -> list[tuple[str, str | None]]:
    """(flag, value) pairs after `-m sglang.launch_server`; value None for a bare switch."""
    start = argv.index("-m") + 2
    pairs, i = [], start
    while i < len(argv):
        tok = argv[i]
        assert tok.startswith("--"), f"stray token {tok!r} in {argv}"
        if "=" in tok:
            name, value = tok.split("=", 1)
            pairs.append((name, value))
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((tok, argv[i + 1]))
            i += 2
        else:
            pairs.append((tok, None))
            i += 1
    return pairs


def flag_map(argv: list[str]) -> dict[str, str | None]:
    pairs = sglang_flags(argv)
    names = [n for n, _ in pairs]
    assert len(names) == len(set(names)), f"a flag appears twice: {names}"
    return dict(pairs)


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{proc.stderr}"
    assert lines[0].startswith("serve_sglang_v100.sh: error: "), lines[0]
    return lines[0]


# The behaviour tests pin the runtime to the fork (OPENJEV_SGLANG_RUNTIME): the same answer in .venv
# (no sglang) and in every real-SGLang venv. Detection and the other dialects have their own tests.
SM70 = {"OPENJEV_GPU_ARCH": "sm70", "OPENJEV_SGLANG_RUNTIME": "fork"}
SM90 = {"OPENJEV_GPU_ARCH": "sm90", "OPENJEV_SGLANG_RUNTIME": "fork"}
