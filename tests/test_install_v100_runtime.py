"""app/install_v100_runtime.sh and app/v100_preflight.py.

This machine has no GPU (torch is a CPU build), which is exactly the preflight-refusal case:
the real script must stop with one line and leave the root byte-identical. --dry-run is
checked step by step. The last test drives a whole real run on local stand-ins (local git
repositories as the pinned sources, a stand-in interpreter whose preflight passes and whose
pip records instead of installing) to show the plan executes, patches apply once, re-running
finds every step done, and the receipt is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHELLCHECK_MISSING, shellcheck

REPO = Path(__file__).resolve().parents[1]
INSTALLER = REPO / "app" / "install_v100_runtime.sh"
PREFLIGHT = REPO / "app" / "v100_preflight.py"
BASH = shutil.which("bash") or "/bin/bash"
PY = sys.executable
SOURCES = json.loads((REPO / "HF_SOURCE.json").read_text())
RUNTIME_REV = SOURCES["runtime"]["revision"]
FLASHINFER_REV = SOURCES["flashinfer"]["revision"]
STAGE_ORDER = ["preflight", "toolchain", "dirs", "rust", "protoc", "runtime", "patches", "flashinfer", "build-tools",
               "sgl-kernel", "runtime-deps", "runtime-install", "nccl", "verify", "kernel-arch", "receipt"]
STEP_RE = re.compile(r"^\s*(\d+)\. \[([a-z-]+)\] (.*)$")
CONTROLLED = {"OPENJEV_V100_ROOT", "OPENJEV_PYTHON", "OPENJEV_CC", "OPENJEV_CXX", "OPENJEV_HF_SOURCE",
              "OPENJEV_PATCH_DIR", "MAX_JOBS", "NVCC_THREADS"}


def run_installer(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in CONTROLLED}
    full.update({"OPENJEV_PYTHON": PY, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})})
    return subprocess.run([BASH, str(INSTALLER), *map(str, args)], capture_output=True, text=True, env=full,
                          timeout=timeout)


def tree(root: Path) -> dict | None:
    """Every path under root: type, link target, mode, bytes hash (None when root is absent)."""
    if not root.exists():
        return None
    out = {".": ("dir", root.stat().st_mode)}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_file():
            out[rel] = ("file", p.stat().st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
        else:
            out[rel] = ("dir", p.stat().st_mode)
    return out


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected exactly one stderr line:\n{proc.stderr}"
    assert lines[0].startswith("install_v100_runtime.sh: error: "), lines[0]
    return lines[0]


def plan_steps(stdout: str) -> list[tuple[int, str, str, str]]:
    """(number, stage, command, already-done test) for every numbered plan line."""
    steps = []
    for line in stdout.splitlines():
        m = STEP_RE.match(line)
        if m:
            rest = m.group(3)
            command, _, done = rest.partition("   # already done if: ")
            command = command.split("   # runs first;")[0]
            steps.append((int(m.group(1)), m.group(2), command, done))
    return steps


def _exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# ---------------------------------------------------------------- preflight refusal
def _populated_root(root: Path) -> Path:
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "results").mkdir()
    (root / "results" / "old.json").write_text('{"kept": true}\n')
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{}\n")
    (root / "model" / "weights.safetensors").symlink_to("/nonexistent/weights.safetensors")
    (root / "notes.txt").write_bytes(b"\x00\x01 binary\n")
    return root


def test_preflight_refuses_without_sm70_gpu_and_changes_nothing(tmp_path):
    """torch here is a CPU build: the real preflight refuses; the populated root is untouched."""
    root = _populated_root(tmp_path / "root")
    before = tree(root)
    proc = run_installer(env={"OPENJEV_V100_ROOT": str(root)})
    assert proc.returncode == 1 and proc.stdout == ""
    line = one_error_line(proc)
    assert line.startswith("install_v100_runtime.sh: error: preflight failed: ")
    assert "sm_70" in line and "nothing was changed" in line
    assert tree(root) == before


def test_preflight_refuses_a_python_without_torch(tmp_path):
    root = tmp_path / "root"  # absent: it must stay absent
    before = tree(root)
    no_site = _exe(tmp_path / "python", f"#!/bin/sh\nexec '{PY}' -S \"$@\"\n")  # no site-packages: no torch
    proc = run_installer(env={"OPENJEV_V100_ROOT": str(root), "OPENJEV_PYTHON": str(no_site)})
    assert proc.returncode == 1
    assert "preflight failed: torch is not importable" in one_error_line(proc)
    proc = run_installer(env={"OPENJEV_V100_ROOT": str(root), "OPENJEV_PYTHON": str(tmp_path / "missing")})
    assert proc.returncode == 1 and "preflight failed: no Python interpreter" in one_error_line(proc)
    assert tree(root) == before is None


def test_preflight_helper_reports_one_json_line():
    proc = subprocess.run([PY, "-B", "-S", str(PREFLIGHT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["ok"] is False and result["reason"].startswith("torch is not importable")
    assert set(result) >= {"ok", "reason", "torch", "arch_list", "cuda_available", "capability", "matmul"}
    assert proc.stderr.strip() == f"v100_preflight.py: error: {result['reason']}"


# ---------------------------------------------------------------- --dry-run
@pytest.fixture
def patch_dir(tmp_path) -> Path:
    d = tmp_path / "patches"
    d.mkdir()
    for name in ("a-first.patch", "b-second.patch"):
        (d / name).write_text(f"--- a/{name}\n+++ b/{name}\n")
    (d / "README").write_text("not a patch\n")
    return d


def dry_run(tmp_path, patch_dir, *extra, env=None) -> subprocess.CompletedProcess:
    return run_installer("--dry-run", *extra, env={"OPENJEV_V100_ROOT": str(tmp_path / "root"),
                                                   "OPENJEV_PATCH_DIR": str(patch_dir), **(env or {})})


def test_dry_run_prints_every_step_in_order_without_the_preflight_blocking(tmp_path, patch_dir):
    proc = dry_run(tmp_path, patch_dir)
    assert proc.returncode == 0, proc.stderr  # the preflight would fail on this machine: it must not block
    assert proc.stderr == ""
    assert not (tmp_path / "root").exists(), "--dry-run creates nothing"
    steps = plan_steps(proc.stdout)
    assert [n for n, *_ in steps] == list(range(1, len(steps) + 1)), "numbered 1..N, one line each"
    first_seen = list(dict.fromkeys(stage for _, stage, *_ in steps))
    assert first_seen == STAGE_ORDER
    n, stage, command, _ = steps[0]
    assert stage == "preflight" and command == f"{PY} -B {PREFLIGHT}"
    assert "runs first; on failure the install stops before anything is touched" in proc.stdout.splitlines()[
        next(i for i, line in enumerate(proc.stdout.splitlines()) if STEP_RE.match(line))]
    assert "Step 1, the GPU preflight, runs first" in proc.stdout
    # the same plan twice: it is data, not a transcript
    assert dry_run(tmp_path, patch_dir).stdout == proc.stdout


def test_dry_run_names_the_pins_and_the_private_toolchain(tmp_path, patch_dir):
    root = tmp_path / "root"
    proc = dry_run(tmp_path, patch_dir)
    steps = plan_steps(proc.stdout)
    text = "\n".join(cmd for _, _, cmd, _ in steps)
    runtime = [cmd for _, stage, cmd, _ in steps if stage == "runtime"]
    assert any(f"fetch origin {RUNTIME_REV}" in c for c in runtime)
    assert any(f"checkout -q --detach {RUNTIME_REV}" in c for c in runtime)
    assert any(f"rev-parse HEAD 2>/dev/null)\" = {RUNTIME_REV} ]" in c for c in runtime), "HEAD is verified"
    assert any("github.com/haohervchb/sglang-V100" in c for c in runtime)
    flashinfer = [cmd for _, stage, cmd, _ in steps if stage == "flashinfer"]
    assert any(f"checkout -q --detach {FLASHINFER_REV}" in c for c in flashinfer)
    assert any("github.com/haohervchb/flashinfer" in c for c in flashinfer)
    assert any("submodule update --init --recursive" in c for c in flashinfer)
    assert f"RUSTUP_HOME={root}/rustup CARGO_HOME={root}/cargo" in text
    assert f"--default-toolchain {SOURCES['rust']['version']}" in text
    assert SOURCES["protoc"]["url"] in text and f"mv {root}/build/protoc.new {root}/protoc" in text
    assert "TORCH_CUDA_ARCH_LIST=7.0" in text and "-DSGL_KERNEL_V100_ONLY=ON" in text
    assert f"-DCMAKE_CUDA_COMPILER={root}/cuda126/bin/nvcc" in text
    assert f"-m pip install --no-deps --no-build-isolation -e {root}/src/sglang-V100/python" in text
    assert f"--out {root}/results/runtime_receipt.json" in text
    assert f"-m pip install -c {root}/build/constraints.txt -r {root}/build/runtime-requirements.txt" in text
    assert "pins from" in proc.stdout and RUNTIME_REV in proc.stdout and FLASHINFER_REV in proc.stdout


def test_dry_run_checks_each_patch_before_applying_it(tmp_path, patch_dir):
    proc = dry_run(tmp_path, patch_dir)
    steps = plan_steps(proc.stdout)
    runtime_dir = tmp_path / "root" / "src" / "sglang-V100"
    for name in ("a-first.patch", "b-second.patch"):
        path = patch_dir / name
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        assert f"patch {name} sha256 {sha}" in proc.stdout, "each patch is listed with its sha256"
        check = [n for n, stage, cmd, _ in steps if cmd == f"git -C {runtime_dir} apply --check {path}"]
        apply = [n for n, stage, cmd, _ in steps if cmd == f"git -C {runtime_dir} apply {path}"]
        assert len(check) == 1 and len(apply) == 1 and check[0] < apply[0]
        for n in (check[0], apply[0]):
            assert steps[n - 1][1] == "patches"
            assert steps[n - 1][3] == f"git -C {runtime_dir} apply --reverse --check {path} 2>/dev/null"
    ordered = [cmd for _, stage, cmd, _ in steps if stage == "patches"]
    assert ordered[0].endswith("a-first.patch") and ordered[-1].endswith("b-second.patch")
    assert "README" not in "\n".join(ordered)
    fi_patch = runtime_dir / "patches" / "flashinfer-sm70.patch"
    fi_check = [n for n, _, cmd, _ in steps if cmd.endswith(f"apply --check {fi_patch}")]
    fi_apply = [n for n, _, cmd, _ in steps if cmd.endswith(f"apply {fi_patch}")]
    assert len(fi_check) == 1 and len(fi_apply) == 1 and fi_check[0] < fi_apply[0]
    receipt = next(cmd for _, stage, cmd, _ in steps if stage == "receipt")
    assert f"--patch {patch_dir / 'a-first.patch'} --patch {patch_dir / 'b-second.patch'}" in receipt


def test_dry_run_commands_are_valid_shell(tmp_path, patch_dir):
    for _, _, command, done in plan_steps(dry_run(tmp_path, patch_dir).stdout):
        for snippet in filter(None, (command, done)):
            proc = subprocess.run([BASH, "-n", "-c", snippet], capture_output=True, text=True)
            assert proc.returncode == 0, f"{snippet}\n{proc.stderr}"


def test_dry_run_states_pins_and_prerequisites(tmp_path, patch_dir):
    proc = dry_run(tmp_path, patch_dir, env={"PATH": "/usr/bin:/bin"})
    assert "rustup_sha256 is null" not in proc.stdout and "protoc_sha256 is null" not in proc.stdout
    # both pinned in HF_SOURCE.json from two public sources each; rustup-init from its versioned archive URL
    rust = next(cmd for _, stage, cmd, _ in plan_steps(proc.stdout) if stage == "rust")
    assert SOURCES["rust"]["rustup_init_url"] in rust and SOURCES["rust"]["rustup_init_sha256"] in rust
    assert "/rustup/archive/1.28.2/" in SOURCES["rust"]["rustup_init_url"] and "sha256sum -c" in rust
    protoc = next(cmd for _, stage, cmd, _ in plan_steps(proc.stdout) if stage == "protoc")
    assert SOURCES['protoc']['sha256'] in protoc and "sha256sum -c" in protoc
    assert "prepare_v100_cuda.py" in proc.stdout  # no private toolkit under this root yet
    # with a null hash: a note, and --allow-unpinned is the one-off that is recorded
    sources = json.loads(json.dumps(SOURCES))
    sources["rust"]["rustup_init_sha256"] = None
    nulled = tmp_path / "HF_SOURCE.json"
    nulled.write_text(json.dumps(sources))
    proc = dry_run(tmp_path, patch_dir, env={"OPENJEV_HF_SOURCE": str(nulled)})
    assert "note: rustup_sha256 is null" in proc.stdout and "--allow-unpinned" in proc.stdout
    unpinned = dry_run(tmp_path, patch_dir, "--allow-unpinned", env={"OPENJEV_HF_SOURCE": str(nulled)})
    assert "used unverified (--allow-unpinned, recorded in the receipt)" in unpinned.stdout
    receipt = next(cmd for _, stage, cmd, _ in plan_steps(unpinned.stdout) if stage == "receipt")
    assert receipt.endswith("--allow-unpinned")
    download = next(cmd for _, stage, cmd, _ in plan_steps(unpinned.stdout) if stage == "rust")
    assert "sha256sum" not in download


def test_dry_run_gcc_selection(tmp_path, patch_dir):
    cc, cxx = shutil.which("sh"), shutil.which("cat")
    proc = dry_run(tmp_path, patch_dir, env={"OPENJEV_CC": cc, "OPENJEV_CXX": cxx})
    export = next(cmd for _, stage, cmd, _ in plan_steps(proc.stdout) if stage == "toolchain")
    assert f"CC={cc} CXX={cxx} CUDAHOSTCXX={cxx}" in export
    assert "gcc-10/g++-10 are not on PATH" not in proc.stdout
    bare = tmp_path / "bare-bin"  # a PATH with the basic tools and no gcc-10
    bare.mkdir()
    for tool in ("dirname", "uname", "nproc", "awk", "sha256sum", "cut", "basename"):
        (bare / tool).symlink_to(shutil.which(tool))
    proc = dry_run(tmp_path, patch_dir, env={"PATH": str(bare)})
    assert proc.returncode == 0, proc.stderr
    assert "note: gcc-10/g++-10 are not on PATH" in proc.stdout and "a real install stops before step 2" in proc.stdout
    export = next(cmd for _, stage, cmd, _ in plan_steps(proc.stdout) if stage == "toolchain")
    assert "CC=gcc-10 CXX=g++-10 CUDAHOSTCXX=g++-10" in export


def test_unpinned_runtime_revision_is_refused(tmp_path, patch_dir):
    sources = json.loads(json.dumps(SOURCES))
    sources["runtime"]["revision"] = None
    bad = tmp_path / "HF_SOURCE.json"
    bad.write_text(json.dumps(sources))
    for extra in ((), ("--allow-unpinned",)):
        proc = dry_run(tmp_path, patch_dir, *extra, env={"OPENJEV_HF_SOURCE": str(bad)})
        assert proc.returncode == 1 and "runtime_rev" in one_error_line(proc)


def test_usage(tmp_path):
    proc = run_installer("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    for word in ("--dry-run", "--allow-unpinned", "--help", "OPENJEV_V100_ROOT", "OPENJEV_PYTHON", "OPENJEV_CC",
                 "OPENJEV_CXX", "OPENJEV_HF_SOURCE", "OPENJEV_PATCH_DIR", "MAX_JOBS", "NVCC_THREADS",
                 "runtime_receipt.json", "git apply --check", "sm_70", *STAGE_ORDER):
        assert word in proc.stdout, word
    proc = run_installer("--frobnicate")
    assert proc.returncode == 2 and "unknown argument '--frobnicate'" in one_error_line(proc)


def test_bash_syntax_and_shellcheck():
    subprocess.run([BASH, "-n", str(INSTALLER)], check=True)
    if shellcheck() is None:
        pytest.skip(SHELLCHECK_MISSING + "; bash -n passed")
    proc = subprocess.run([shellcheck(), str(INSTALLER)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


# ---------------------------------------------------------------- a whole run on local stand-ins
def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def _repo(path: Path, files: dict[str, str]) -> str:
    path.mkdir(parents=True)
    _git(path, "init", "-q")
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    _git(path, "add", "-A")
    _git(path, "commit", "-q", "-m", "pinned")
    return _git(path, "rev-parse", "HEAD")


def _diff(rel: str, old: str, new: str) -> str:
    return f"--- a/{rel}\n+++ b/{rel}\n@@ -1 +1 @@\n-{old}\n+{new}\n"


def test_real_run_on_local_stand_ins_is_idempotent_and_writes_the_receipt(tmp_path):
    """The real (non-dry) path end to end, offline: every step is the plan's own command."""
    src = tmp_path / "upstream"
    fi_rev = _repo(src / "flashinfer", {"flashinfer/kernel.py": "arch = 'sm75'\n"})
    rt_rev = _repo(src / "runtime", {
        "python/pyproject.toml": '[project]\nname = "sglang"\ndependencies = ["torch==2.9.1", '
                                 '"flashinfer_python==0.6.12", "sglang-kernel==0.4.3", "numpy", '
                                 '"decord2 ; sys_platform == \'linux\'"]\n',
        "python/sglang/attention.py": "dynamic = False\n",
        "sgl-kernel/python/sgl_kernel/__init__.py": "",
        "patches/flashinfer-sm70.patch": _diff("flashinfer/kernel.py", "arch = 'sm75'", "arch = 'sm70'"),
    })
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "dynamic-paged.patch").write_text(_diff("python/sglang/attention.py", "dynamic = False",
                                                       "dynamic = True"))
    sources = json.loads(json.dumps(SOURCES))
    sources["runtime"].update(repo=str(src / "runtime"), revision=rt_rev)
    sources["flashinfer"].update(repo=str(src / "flashinfer"), revision=fi_rev)
    hf_source = tmp_path / "HF_SOURCE.json"
    hf_source.write_text(json.dumps(sources))

    root = tmp_path / "root"
    # Prerequisites the operator provides: the private CUDA toolkit, and (already provisioned
    # here) Rust and protoc at the pinned versions, so that nothing is downloaded.
    (root / "cuda126" / "bin").mkdir(parents=True)
    _exe(root / "cuda126" / "bin" / "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 12.6, V12.6.85'\n")
    cuobjdump = root / "cuda126" / "bin" / "cuobjdump"  # what CUDA 12.6's cuobjdump --list-elf prints for a library
    _exe(cuobjdump, "#!/bin/sh\n[ \"$1\" = --list-elf ] || exit 2\n"
                    "echo 'ELF file    1: common_ops.1.sm_70.cubin'\necho 'ELF file    2: common_ops.2.sm_70.cubin'\n")
    (root / "cargo" / "bin").mkdir(parents=True)
    _exe(root / "cargo" / "bin" / "rustc", f"#!/bin/sh\necho 'rustc {SOURCES['rust']['version']} (stand-in)'\n")
    (root / "protoc" / "bin").mkdir(parents=True)
    _exe(root / "protoc" / "bin" / "protoc", f"#!/bin/sh\necho 'libprotoc {SOURCES['protoc']['version']}'\n")
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("gcc-10", "g++-10"):
        _exe(tools / name, "#!/bin/sh\necho 'gcc-10 (stand-in) 10.5.0'\n")
    pip_log = tmp_path / "pip.log"
    # Stand-in venv interpreter: its preflight passes (no V100 here); pip and the GPU imports are
    # recorded instead of run; everything else (the requirement filter, the receipt) is real Python.
    stand_in = _exe(tmp_path / "venv-python", f"""#!/bin/sh
if [ "$#" = 2 ] && [ "$2" = '{PREFLIGHT}' ]; then
  echo '{{"ok": true, "reason": null, "arch_list": ["sm_70"], "capability": "7.0", "matmul": {{"max_abs_err": 0.0}}}}'
  exit 0
fi
case "$*" in
  "-m pip "*) echo "$*" >> '{pip_log}'; exit 0 ;;
  *"import torch, sglang"*) echo 'verify (stand-in)'; exit 0 ;;
  *"print(sgl_kernel.common_ops.__file__)"*) echo '{tmp_path}/site/sgl_kernel/sm70/common_ops.abi3.so'; exit 0 ;;
  *"import torch; print(torch.__version__)"*) echo '2.9.1+cu126'; exit 0 ;;
esac
exec '{PY}' -S "$@"
""")  # -S: the real scripts need only the standard library here (and skipping torch keeps this fast)
    env = {"OPENJEV_V100_ROOT": str(root), "OPENJEV_PYTHON": str(stand_in), "OPENJEV_HF_SOURCE": str(hf_source),
           "OPENJEV_PATCH_DIR": str(patches), "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}",
           "GIT_CONFIG_GLOBAL": str(tmp_path / "gitconfig"), "MAX_JOBS": "2"}
    (tmp_path / "gitconfig").write_text("[protocol \"file\"]\n\tallow = always\n")

    first = run_installer(env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    rt, fi = root / "src" / "sglang-V100", root / "src" / "flashinfer"
    assert _git(rt, "rev-parse", "HEAD") == rt_rev and _git(fi, "rev-parse", "HEAD") == fi_rev
    assert (rt / "python/sglang/attention.py").read_text() == "dynamic = True\n", "project patch applied"
    assert (fi / "flashinfer/kernel.py").read_text() == "arch = 'sm70'\n", "FlashInfer SM70 patch applied"
    reqs = (root / "build" / "runtime-requirements.txt").read_text().splitlines()
    assert reqs[:2] == ["numpy", "decord2 ; sys_platform == 'linux'"] and "tilelang==0.1.8" in reqs
    assert not any(r.startswith(("torch", "flashinfer", "sglang-kernel")) for r in reqs)
    pip_calls = pip_log.read_text()
    assert f"install --no-deps --no-build-isolation -e {fi}" in pip_calls
    assert f"install --no-deps --no-build-isolation --config-settings=build-dir={root}/build/sgl-kernel {rt}/sgl-kernel" in pip_calls
    assert f"install --no-deps --no-build-isolation -e {rt}/python" in pip_calls

    receipt = json.loads((root / "results" / "runtime_receipt.json").read_text())
    assert receipt["runtime"]["pinned_revision"] == rt_rev and receipt["runtime"]["head_matches_pin"] is True
    assert receipt["flashinfer"]["head"] == fi_rev
    assert receipt["flashinfer"]["patch"]["sha256"] == hashlib.sha256(
        (rt / "patches/flashinfer-sm70.patch").read_bytes()).hexdigest()
    assert receipt["patches"] == [{"name": "dynamic-paged.patch", "path": str(patches / "dynamic-paged.patch"),
                                   "sha256": hashlib.sha256((patches / "dynamic-paged.patch").read_bytes()).hexdigest()}]
    assert receipt["allow_unpinned"] is False
    assert receipt["sgl_kernel_code"] == {"library": f"{tmp_path}/site/sgl_kernel/sm70/common_ops.abi3.so",
                                          "cubins": ["common_ops.1.sm_70.cubin", "common_ops.2.sm_70.cubin"],
                                          "sm": ["sm_70"]}
    assert receipt["preflight"]["ok"] is True and receipt["preflight"]["arch_list"] == ["sm_70"]
    assert receipt["toolchain"]["cc_version"] == "gcc-10 (stand-in) 10.5.0"
    assert receipt["toolchain"]["nvcc_version"] == "Cuda compilation tools, release 12.6, V12.6.85"
    assert receipt["toolchain"]["pinned"] == {"rust": SOURCES["rust"]["version"], "protoc": SOURCES["protoc"]["version"]}
    statuses = {s["step"]: (s["stage"], s["status"]) for s in receipt["steps"]}
    assert statuses[1] == ("preflight", "ran") and all(st == "already-done" for stage, st in statuses.values()
                                                       if stage in ("rust", "protoc"))

    # Re-running is safe: sources, patches and builds are detected as done.
    snapshot = tree(root / "src")
    second = run_installer(env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert tree(root / "src") == snapshot, "nothing re-applied or re-checked-out"
    again = {s["step"]: (s["stage"], s["status"])
             for s in json.loads((root / "results" / "runtime_receipt.json").read_text())["steps"]}
    for stage in ("runtime", "patches", "sgl-kernel", "runtime-install"):
        assert {st for sg, st in again.values() if sg == stage} <= {"already-done", "ran"}
    done = [sg for sg, st in again.values() if st == "already-done"]
    assert done.count("patches") == 2 and "sgl-kernel" in done and "runtime-install" in done
    assert [sg for sg, st in again.values() if sg == "runtime" and st == "ran"] == ["runtime"], "only the HEAD check"
    assert pip_log.read_text().count("--no-build-isolation -e") == 2, "editable installs were not repeated"

    # A library built without sm_70 code is refused with one line naming what it holds; the last
    # good receipt stays as it was (the receipt step comes after the check).
    receipt_before = (root / "results" / "runtime_receipt.json").read_bytes()
    _exe(cuobjdump, "#!/bin/sh\necho 'ELF file    1: common_ops.1.sm_80.cubin'\n")
    third = run_installer(env=env)
    assert third.returncode == 1
    lines = [ln for ln in third.stderr.splitlines() if ln.strip()]
    assert any("holds no sm_70 code" in ln and "sm_80" in ln for ln in lines), third.stderr
    assert (root / "results" / "runtime_receipt.json").read_bytes() == receipt_before
    # and a toolkit without cuobjdump is refused before any change
    cuobjdump.unlink()
    before = tree(root)
    fourth = run_installer(env=env)
    assert fourth.returncode == 1 and "cuobjdump is missing" in fourth.stderr
    assert tree(root) == before, "nothing under the root changed"
