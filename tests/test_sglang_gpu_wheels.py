"""benchmarks/sglang_gpu_wheels.py on small real wheels built here, served to pip from a local folder
(--find-links DIR --no-index): download, repack, manifest, reuse, budget and foreign-file refusals."""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "sglang_gpu_wheels.py"
SO = "cpython-312-x86_64-linux-gnu.so"

SGLANG_FILES = {
    "sglang/__init__.py": b"__version__ = '0.5.23'\n",
    "sglang/srt/__init__.py": b"",
    "sglang/srt/rust_extensions/__init__.py": b"",
    f"sglang/srt/rust_extensions/_bench.{SO}": b"\x7fELF bench" * 100,
    f"sglang/srt/rust_extensions/_server.{SO}": b"\x7fELF server" * 100,
    f"sglang/srt/mem_cache/rust_tree_core/mem_cache.{SO}": b"\x7fELF mem_cache",
    "sglang/kernels/jit/rope.py": b"# jit kernel\n",
    "sglang/test/x.py": b"assert False\n",
    "sglang/multimodal_gen/y.py": b"assert False\n",
    "sglang/benchmark/z.py": b"assert False\n",
}
SGLANG_DROPPED = {"sglang/test/x.py", "sglang/multimodal_gen/y.py", "sglang/benchmark/z.py",
                  f"sglang/srt/rust_extensions/_bench.{SO}", f"sglang/srt/rust_extensions/_server.{SO}"}
KERNEL_FILES = {"sgl_kernel/__init__.py": b"", "sgl_kernel/version.py": b"__version__ = '0.4.10'\n",
                "sgl_kernel/common_ops.abi3.so": b"\x7fELF ops" * 1000, "sgl_kernel/include/a.h": b"//\n"}


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A real wheel (py3-none-any) with METADATA, WHEEL and a RECORD of its files."""
    dist = f"{name.replace('-', '_')}-{version}"
    info = f"{dist}.dist-info"
    files = {**files,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(
        [(p, record_hash(d), len(d)) for p, d in files.items()] + [(f"{info}/RECORD", "", "")])
    files[f"{info}/RECORD"] = buf.getvalue().encode()
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, d in files.items():
            z.writestr(p, d)
    return path


def check_record(whl: Path) -> dict[str, bytes]:
    """RECORD lists exactly the members, each with its sha256 and size; returns the members."""
    with zipfile.ZipFile(whl) as z:
        members = {n: z.read(n) for n in z.namelist() if not n.endswith("/")}
    (record,) = [n for n in members if n.endswith(".dist-info/RECORD")]
    rows = list(csv.reader(io.StringIO(members[record].decode())))
    assert sorted(r[0] for r in rows) == sorted(members)
    for path, digest, size in rows:
        if path == record:
            assert (digest, size) == ("", "")
        else:
            assert (digest, int(size)) == (record_hash(members[path]), len(members[path])), path
    return members


def git_tree(path: Path, files: dict[str, int]) -> Path:
    path.mkdir()
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    for name, size in files.items():
        (path / name).write_bytes(b"x" * size)
    subprocess.run(["git", "-C", str(path), "add", *[n for n in files if not n.startswith("untracked")]], check=True)
    return path


@pytest.fixture
def env(tmp_path):
    """A local index with the pinned wheels (and a decoy version), a pin file, a small git tree."""
    index = tmp_path / "index"
    index.mkdir()
    make_wheel(index, "sglang", "0.5.23", SGLANG_FILES)
    make_wheel(index, "sglang-kernel", "0.4.10", KERNEL_FILES)
    make_wheel(index, "fake-dep", "1.0", {"fake_dep/__init__.py": b"V = 1\n"})
    make_wheel(index, "fake-dep", "2.0", {"fake_dep/__init__.py": b"V = 2\n"})
    reqs = tmp_path / "reqs.txt"
    reqs.write_text("# test pins\nsglang==0.5.23\nsglang-kernel==0.4.10\nfake_dep==1.0\n")
    tree = git_tree(tmp_path / "tree", {"a.txt": 1000, "untracked.txt": 500})
    return {"index": index, "reqs": reqs, "tree": tree, "out": tmp_path / "out", "tmp": tmp_path}


def run(env, *extra, budget="64"):
    cmd = [sys.executable, str(SCRIPT), "--requirements", str(env["reqs"]), "--out", str(env["out"]),
           "--tree", str(env["tree"]), "--find-links", str(env["index"]), "--no-index", "--budget-mib", budget,
           *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def one_error(proc) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sglang_gpu_wheels: error: "), proc.stderr
    return lines[0]


def test_help():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--budget-mib" in proc.stdout and "--find-links" in proc.stdout


def test_download_repack_manifest_install_and_reuse(env, tmp_path):
    proc = run(env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines[:3]] == ["sglang 0.5.23", "sglang-kernel 0.4.10", "fake-dep 1.0"]
    assert "downloaded" in lines[0] and "repacked" in lines[0] and "downloaded" in lines[2]
    assert lines[-1].startswith("budget: ") and "<= 64 MiB" in lines[-1]

    out = env["out"]
    manifest = json.loads((out / "manifest.json").read_text())
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([w["file"] for w in manifest["wheels"]] + ["manifest.json"])  # no staging left
    for w in manifest["wheels"]:
        data = (out / w["file"]).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (w["sha256"], w["bytes"])
    by = {w["name"]: w for w in manifest["wheels"]}
    assert by["fake-dep"]["version"] == "1.0" and by["fake-dep"]["repacked"] is None
    assert (out / by["fake-dep"]["file"]).read_bytes() == (env["index"] / "fake_dep-1.0-py3-none-any.whl").read_bytes()

    # sglang: the dropped paths are gone, the kept .so and jit kernels stay, RECORD matches
    members = check_record(out / by["sglang"]["file"])
    kept = {p for p in members if not p.startswith("sglang-0.5.23.dist-info/")}
    assert kept == set(SGLANG_FILES) - SGLANG_DROPPED
    rep = by["sglang"]["repacked"]
    assert rep["files_dropped"] == len(SGLANG_DROPPED)
    assert rep["dropped"]["sglang/test/"] == {"files": 1, "bytes": len(SGLANG_FILES["sglang/test/x.py"])}
    assert rep["source_sha256"] == hashlib.sha256(
        (env["index"] / "sglang-0.5.23-py3-none-any.whl").read_bytes()).hexdigest()
    # sglang-kernel: .py files only
    members = check_record(out / by["sglang-kernel"]["file"])
    assert {p for p in members if not p.startswith("sglang_kernel-0.4.10.dist-info/")} == \
        {"sgl_kernel/__init__.py", "sgl_kernel/version.py"}

    # pip installs the repacked wheels as the GPU machine does
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--no-cache-dir", "--disable-pip-version-check", "--target", str(site),
                          *map(str, sorted(out.glob("*.whl")))], capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0, pip.stderr
    assert (site / f"sglang/srt/mem_cache/rust_tree_core/mem_cache.{SO}").is_file()
    assert not (site / "sglang/test").exists() and not (site / f"sglang/srt/rust_extensions/_bench.{SO}").exists()
    assert not (site / "sgl_kernel/common_ops.abi3.so").exists()
    installed = (site / "sglang-0.5.23.dist-info/RECORD").read_text()
    assert "sglang/test/x.py" not in installed and f"mem_cache.{SO}" in installed
    probe = subprocess.run([sys.executable, "-c", "import sglang, fake_dep; print(sglang.__version__, fake_dep.V)"],
                           capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert probe.stdout.split() == ["0.5.23", "1"], probe.stderr

    # a second run reuses everything: it does not need the index at all
    for p in env["index"].iterdir():
        p.unlink()
    again = run(env)
    assert again.returncode == 0, again.stderr
    assert sum("reused" in ln for ln in again.stdout.splitlines()) == 3
    assert json.loads((out / "manifest.json").read_text())["wheels"] == manifest["wheels"]

    # a new pin: the new version is downloaded, the old wheel (ours) removed
    make_wheel(env["index"], "fake-dep", "2.0", {"fake_dep/__init__.py": b"V = 2\n"})
    env["reqs"].write_text("sglang==0.5.23\nsglang-kernel==0.4.10\nfake-dep==2.0\n")
    bumped = run(env)
    assert bumped.returncode == 0, bumped.stderr
    assert "removed fake_dep-1.0-py3-none-any.whl" in bumped.stdout
    assert sorted(p.name for p in out.glob("fake_dep-*")) == ["fake_dep-2.0-py3-none-any.whl"]


def test_budget_refusal_leaves_the_folder_alone(env):
    env["reqs"].write_text("fake-dep==1.0\n")
    (env["tree"] / "big.bin").write_bytes(b"x" * 300_000)  # untracked, not ignored: it travels too
    err = one_error(run(env, budget="0.25"))
    assert "over budget" in err and "working tree (3 files)" in err and "> 0.25 MiB" in err
    assert sorted(p.name for p in env["out"].iterdir()) == []  # nothing moved in, staging removed

    (env["tree"] / ".gitignore").write_text("big.bin\n")  # ignored: it does not travel
    proc = run(env, budget="0.25")
    assert proc.returncode == 0, proc.stderr
    assert "working tree (3 files)" in proc.stdout  # a.txt, untracked.txt, .gitignore


def test_refuses_to_overwrite_a_foreign_wheel(env):
    out = env["out"]
    out.mkdir()
    foreign = out / "sglang-0.5.23-py3-none-any.whl"
    original = (env["index"] / foreign.name).read_bytes()  # the unrepacked wheel: not what the script builds
    foreign.write_bytes(original)
    err = one_error(run(env))
    assert "refusing to overwrite" in err and foreign.name in err
    assert foreign.read_bytes() == original and not (out / "manifest.json").exists()
    assert sorted(p.name for p in out.iterdir()) == [foreign.name]


def test_adopts_an_identical_file_and_refuses_strangers(env):
    env["reqs"].write_text("fake-dep==1.0\n")
    out = env["out"]
    out.mkdir()
    same = out / "fake_dep-1.0-py3-none-any.whl"
    same.write_bytes((env["index"] / same.name).read_bytes())
    proc = run(env)
    assert proc.returncode == 0, proc.stderr
    assert "same as the file already there" in proc.stdout
    assert same.name in {w["file"] for w in json.loads((out / "manifest.json").read_text())["wheels"]}

    stranger = out / "other-1.0-py3-none-any.whl"
    stranger.write_bytes(b"not ours")
    err = one_error(run(env))
    assert "other-1.0-py3-none-any.whl was not made by this script" in err and stranger.read_bytes() == b"not ours"

    stranger.unlink()
    ours = out / "fake_dep-1.0-py3-none-any.whl"  # ours, but changed since: no longer ours to replace
    ours.write_bytes(b"edited")
    err = one_error(run(env))
    assert "refusing to overwrite" in err and ours.read_bytes() == b"edited"

    ours.unlink()
    (out / "manifest.json").write_text("{}")
    assert "manifest.json was not written by this script" in one_error(run(env))


def test_pin_errors(env):
    env["reqs"].write_text("torch==2.11.0\n")
    assert "torch is already on the GPU machine" in one_error(run(env))
    env["reqs"].write_text("fake-dep>=1.0\n")
    assert "not a name==version pin" in one_error(run(env))
    env["reqs"].write_text("fake-dep==3.0\n")
    err = one_error(run(env))
    assert "pip download fake-dep==3.0 failed" in err
    assert not list(env["out"].glob(".partial-*"))


def test_pinned_list_matches_the_sglang_freeze():
    import sglang_gpu_wheels as g

    pins = dict(g.read_pins(REPO / "requirements-sglang-gpu.txt"))
    frozen = {}
    for f in ("requirements-sglang-0.5.23.txt", "requirements-gpu-embedded.txt"):
        for line in (REPO / f).read_text().splitlines():
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line.strip())
            if m:
                frozen[g.canon(m.group(1))] = m.group(2)
    assert len(pins) == 41 and {"sglang", "sglang-kernel", "fla-core", "flash-linear-attention"} <= set(pins)
    assert {n: v for n, v in pins.items() if frozen.get(n) != v} == {}
    assert not set(pins) & g.NEVER
    assert set(g.REPACK) == {"sglang", "sglang-kernel", "pycountry", "mistral-common"}
