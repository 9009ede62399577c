"""app/prepare_v100_cuda.py against a real loopback HTTP server and real .tar.xz archives (no mocks).

The fake release is shaped like NVIDIA's: `redistrib_12.6.3.json` with one entry per component and
per-platform `relative_path`/`sha256`/`md5`/`size`, and archives named
`<component>/linux-x86_64/<component>-linux-x86_64-<version>-archive.tar.xz` that hold one folder of
the same name (bin/, include/, lib/, nvvm/, LICENSE). The script runs as a subprocess with
`--base-url` at the server and `--sources` at a temporary sources file pinning the manifest's
real sha256. Pure helpers (path safety, planning) are also tested in-process.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parents[1]

from _http_fixtures import LoopbackHTTPServer

from openjev.common import UserError
from openjev.cuda import download as cuda_download
from openjev.cuda import manifest as cuda_manifest
from openjev.cuda import tree as cuda_tree

PYTHON = str(REPO / ".venv/bin/python") if (REPO / ".venv/bin/python").exists() else sys.executable
SCRIPT = str(REPO / "app/prepare_v100_cuda.py")
VERSION = "12.6.3"
PLATFORM = "linux-x86_64"
MANIFEST_PATH = f"/redistrib_{VERSION}.json"
RECEIPT = "openjev_cuda_receipt.json"
BIG = 300_000  # incompressible bytes in nvcc's archive, so transfers can be cut mid-way


# ---------------------------------------------------------------- the fake NVIDIA release
def _tar_xz(top: str, files: dict[str, tuple[bytes, int]], links: dict[str, str],
            raw_members: list[tarfile.TarInfo] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz", preset=0) as tar:
        dirs = {top}
        for rel in [*files, *links]:
            parent = PurePosixPath(top, rel).parent
            while str(parent) not in dirs and str(parent) != ".":
                dirs.add(str(parent))
                parent = parent.parent
        for d in sorted(dirs):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
            tar.addfile(info)
        for rel, (data, mode) in files.items():
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size, info.mode, info.mtime = len(data), mode, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
        for rel, target in links.items():
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, 1_700_000_000
            tar.addfile(info)
        for info in raw_members or []:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isreg() else None)
    return buf.getvalue()


COMPONENTS: dict[str, tuple[str, dict[str, tuple[bytes, int]], dict[str, str]]] = {
    "cuda_nvcc": ("12.6.85", {
        "bin/nvcc": (b"#!/bin/sh\necho 'Cuda compilation tools, release 12.6, V12.6.85'\n", 0o755),
        "bin/ptxas": (random.Random(7).randbytes(BIG), 0o755),
        "bin/nvcc.profile": (b"TOP = $(_HERE_)/..\n", 0o644),
        "include/crt/host_config.h": (b"/* crt */\n", 0o644),
        "lib/libnvptxcompiler_static.a": (b"!<arch>\n", 0o644),
        "nvvm/bin/cicc": (b"\x7fELF cicc", 0o755),
        "nvvm/libdevice/libdevice.10.bc": (b"BC\xc0\xde", 0o644),
        "LICENSE": (b"nvcc license\n", 0o644),
    }, {}),
    "cuda_cudart": ("12.6.77", {
        "include/cuda.h": (b"#define CUDA_VERSION 12060\n", 0o644),
        "include/cuda_runtime.h": (b"/* runtime */\n", 0o644),
        "lib/libcudart.so.12.6.77": (b"\x7fELF cudart", 0o755),
        "lib/stubs/libcuda.so": (b"\x7fELF stub", 0o755),
        "pkg-config/cudart-12.6.pc": (b"cudaroot=/usr/local/cuda\n", 0o644),
        "LICENSE": (b"cudart license\n", 0o644),
    }, {"lib/libcudart.so.12": "libcudart.so.12.6.77", "lib/libcudart.so": "libcudart.so.12"}),
    "cuda_cccl": ("12.6.77", {
        "include/nv/target": (b"// nv/target\n", 0o644),
        "include/cub/cub.cuh": (b"// cub\n", 0o644),
        "lib/cmake/cub/cub-config.cmake": (b"# cub\n", 0o644),
        "LICENSE": (b"cccl license\n", 0o644),
    }, {}),
}
NAMES = ",".join(COMPONENTS)


def top_dir(name: str, version: str) -> str:
    return f"{name}-{PLATFORM}-{version}-archive"


def relative_path(name: str, version: str) -> str:
    return f"{name}/{PLATFORM}/{top_dir(name, version)}.tar.xz"


class Release:
    """Archives, manifest and the file set an install of all of them must produce."""

    def __init__(self) -> None:
        self.archives: dict[str, bytes] = {}
        self.manifest: dict = {"release_date": "2024-11-20", "release_label": VERSION, "release_product": "cuda"}
        for name, (version, files, links) in COMPONENTS.items():
            data = _tar_xz(top_dir(name, version), files, links)
            rp = relative_path(name, version)
            self.archives[rp] = data
            self.manifest[name] = {
                "name": name.replace("_", " "), "license": "CUDA Toolkit", "license_path": f"{name}/LICENSE.txt",
                "version": version,
                PLATFORM: {"relative_path": rp, "sha256": hashlib.sha256(data).hexdigest(),
                           "md5": hashlib.md5(data).hexdigest(), "size": str(len(data))},
            }

    def expected_files(self, names=tuple(COMPONENTS)) -> set[str]:
        out = {RECEIPT}
        for name in names:
            _, files, links = COMPONENTS[name]
            for rel in [*files, *links]:
                out.add(f"licenses/{name}/{rel}" if "/" not in rel else rel)
        if any(p.startswith("lib/") for p in out):
            out.add("lib64")
        return out

    def manifest_bytes(self, manifest: dict | None = None) -> bytes:
        return json.dumps(manifest or self.manifest, indent=2).encode()

    def publish(self, server: LoopbackHTTPServer, manifest: dict | None = None) -> str:
        for rp, data in self.archives.items():
            server.put("/" + rp, data)
        body = self.manifest_bytes(manifest)
        server.put(MANIFEST_PATH, body)
        return hashlib.sha256(body).hexdigest()


@pytest.fixture(scope="module")
def release() -> Release:
    return Release()


@pytest.fixture()
def server():
    with LoopbackHTTPServer() as srv:
        yield srv


def write_sources(path: Path, sha: str | None, version: str = VERSION) -> Path:
    path.write_text(json.dumps({"cuda": {
        "version": version,
        "manifest_url": f"https://developer.download.nvidia.com/compute/cuda/redist/redistrib_{version}.json",
        "manifest_sha256": sha}}))
    return path


def command(root: Path, server: LoopbackHTTPServer, sources: Path, *extra: str,
            components: str | None = NAMES) -> list[str]:
    cmd = [PYTHON, SCRIPT, str(root), "--version", VERSION, "--platform", PLATFORM,
           "--base-url", server.url, "--sources", str(sources), "--retries", "0", "--timeout", "10"]
    if components is not None:
        cmd += ["--components", components]
    return [*cmd, *extra]


def run(root: Path, server: LoopbackHTTPServer, sources: Path, *extra: str, components: str | None = NAMES):
    return subprocess.run(command(root, server, sources, *extra, components=components),
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def tree_entries(root: Path) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            out.add(os.path.relpath(os.path.join(dirpath, name), root))
    return out


def archive_requests(server: LoopbackHTTPServer) -> list:
    return [r for r in server.requests if r.path != MANIFEST_PATH]


def assert_failed_one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("prepare_v100_cuda.py: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def assert_nothing_half_made(root: Path) -> None:
    assert not (root / "cuda126").exists()
    assert not list(root.glob(".cuda126-staging-*"))
    assert not list(root.glob(".cuda126-old-*"))


@pytest.fixture()
def pinned(tmp_path: Path, release: Release, server: LoopbackHTTPServer) -> Path:
    """Publish the release and return a sources file pinning its manifest."""
    return write_sources(tmp_path / "sources.json", release.publish(server))


# ---------------------------------------------------------------- pure helpers
def test_help_has_argument_table_and_example():
    proc = subprocess.run([PYTHON, SCRIPT, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    for flag in ("--version", "--components", "--platform", "--base-url", "--sources", "--allow-unpinned",
                 "--force", "--dry-run", "--keep-downloads", "--retries", "--timeout", "--quiet"):
        assert flag in proc.stdout
    assert "examples:" in proc.stdout and "--version 12.6.3" in proc.stdout


def test_platform_dirname_and_components_parsing():
    assert cuda_manifest.platform_from_machine("x86_64") == "linux-x86_64"
    assert cuda_manifest.platform_from_machine("aarch64") == "linux-sbsa"
    with pytest.raises(UserError):
        cuda_manifest.platform_from_machine("ppc64le")
    assert cuda_manifest.toolkit_dirname("12.6.3") == "cuda126"
    with pytest.raises(UserError):
        cuda_manifest.toolkit_dirname("twelve")
    assert cuda_manifest.parse_components(None) == list(cuda_manifest.DEFAULT_COMPONENT_NAMES)
    assert cuda_manifest.parse_components(" cuda_nvcc,cuda_nvcc, libcublas ,") == ["cuda_nvcc", "libcublas"]
    with pytest.raises(UserError):
        cuda_manifest.parse_components("cuda_nvcc,../x")
    # the default set covers what the sgl-kernel build and FlashInfer JIT need
    assert {"cuda_nvcc", "cuda_cudart", "cuda_cccl", "cuda_nvrtc", "libcublas", "libcusparse",
            "libcusolver", "libcurand", "libcufft", "cuda_nvtx", "cuda_profiler_api", "cuda_cuobjdump"} <= set(cuda_manifest.DEFAULT_COMPONENT_NAMES)


@pytest.mark.parametrize("name", ["/etc/passwd", "top/../../etc/passwd", "other/bin/nvcc", "../top/x"])
def test_member_paths_outside_the_top_folder_are_refused(name):
    with pytest.raises(UserError):
        cuda_tree.archive_member_relpath(name, "top")


def test_member_paths_and_symlinks_inside_are_accepted():
    assert cuda_tree.archive_member_relpath("top", "top") is None
    assert cuda_tree.archive_member_relpath("./top/bin/nvcc", "top") == PurePosixPath("bin/nvcc")
    assert cuda_tree.symlink_stays_inside(PurePosixPath("lib/libcudart.so"), "libcudart.so.12")
    assert cuda_tree.symlink_stays_inside(PurePosixPath("lib/x"), "../include/cuda.h")
    assert not cuda_tree.symlink_stays_inside(PurePosixPath("lib/x"), "../../etc/passwd")
    assert not cuda_tree.symlink_stays_inside(PurePosixPath("lib/x"), "/usr/lib/libcuda.so")


def test_plan_refuses_bad_manifest_entries(release: Release):
    base = "http://mirror/"
    plans = cuda_manifest.plan_components(release.manifest, list(COMPONENTS), PLATFORM, base)
    assert [p.name for p in plans] == list(COMPONENTS)
    assert plans[0].url == base + relative_path("cuda_nvcc", "12.6.85")
    assert plans[0].top_dir == top_dir("cuda_nvcc", "12.6.85")
    with pytest.raises(UserError, match="libnope"):
        cuda_manifest.plan_components(release.manifest, ["cuda_nvcc", "libnope"], PLATFORM, base)
    with pytest.raises(UserError, match="linux-sbsa"):
        cuda_manifest.plan_components(release.manifest, ["cuda_nvcc"], "linux-sbsa", base)
    for field, value, message in (("sha256", None, "no sha256"), ("sha256", "abc", "malformed sha256"),
                                  ("relative_path", "../../etc/x.tar.xz", "unsafe"),
                                  ("relative_path", "cuda_nvcc/x.zip", "not a .tar.xz"), ("size", None, "size")):
        manifest = json.loads(json.dumps(release.manifest))
        manifest["cuda_nvcc"][PLATFORM][field] = value
        with pytest.raises(UserError, match=message):
            cuda_manifest.plan_components(manifest, ["cuda_nvcc"], PLATFORM, base)


def test_pin_resolution_refuses_before_any_io():
    pin = {"version": VERSION, "manifest_url": "https://x/redist/redistrib_12.6.3.json", "manifest_sha256": None}
    with pytest.raises(UserError, match="--allow-unpinned"):
        cuda_manifest.resolve_manifest_source(pin, VERSION, None, allow_unpinned=False)
    src = cuda_manifest.resolve_manifest_source(pin, VERSION, None, allow_unpinned=True)
    assert (src.url, src.base_url, src.pinned) == (pin["manifest_url"], "https://x/redist/", False)
    with pytest.raises(UserError, match="differs from the pinned"):
        cuda_manifest.resolve_manifest_source({**pin, "manifest_sha256": "0" * 64}, "12.8.0", None, allow_unpinned=False)
    src = cuda_manifest.resolve_manifest_source({**pin, "manifest_sha256": "0" * 64}, VERSION, "http://m/r", False)
    assert (src.url, src.pinned) == ("http://m/r/redistrib_12.6.3.json", True)


def _evil_archive(tmp_path: Path, member: tarfile.TarInfo) -> tuple[Path, "cuda_manifest.ComponentPlan"]:
    top = "cuda_evil-linux-x86_64-1.0-archive"
    data = _tar_xz(top, {"include/ok.h": (b"ok", 0o644)}, {}, raw_members=[member])
    path = tmp_path / f"{top}.tar.xz"
    path.write_bytes(data)
    plan = cuda_manifest.ComponentPlan("cuda_evil", "1.0", f"cuda_evil/{PLATFORM}/{top}.tar.xz",
                              hashlib.sha256(data).hexdigest(), len(data), "http://x/")
    return path, plan


def _member(name: str, kind=tarfile.REGTYPE, linkname: str = "", size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, linkname, size
    return info


TOP = "cuda_evil-linux-x86_64-1.0-archive"


@pytest.mark.parametrize("member,message", [
    (_member(f"{TOP}/../escape.txt", size=1), "'..'"),
    (_member("/tmp/openjev-absolute.txt", size=1), "absolute"),
    (_member(f"{TOP}/lib/escape", tarfile.SYMTYPE, "../../outside"), "outside the toolkit"),
    (_member(f"{TOP}/lib/abs", tarfile.SYMTYPE, "/etc/passwd"), "outside the toolkit"),
    (_member(f"{TOP}/lib/hard", tarfile.LNKTYPE, "/etc/passwd"), "absolute"),
    (_member(f"{TOP}/dev/null", tarfile.CHRTYPE), "not a file, folder or link"),
])
def test_unpacking_refuses_escaping_members(tmp_path: Path, member, message):
    archive, plan = _evil_archive(tmp_path, member)
    staging = tmp_path / "staging"
    staging.mkdir()
    with pytest.raises(UserError, match=message):
        cuda_tree.extract_component(archive, plan, staging, {})
    assert not (tmp_path / "escape.txt").exists() and not Path("/tmp/openjev-absolute.txt").exists()


def test_unpacking_refuses_writing_through_a_symlink(tmp_path: Path):
    top = "cuda_evil-linux-x86_64-1.0-archive"
    data = _tar_xz(top, {}, {"lib/dir": "."}, raw_members=[_member(f"{top}/lib/dir/x", size=1)])
    archive = tmp_path / f"{top}.tar.xz"
    archive.write_bytes(data)
    plan = cuda_manifest.ComponentPlan("cuda_evil", "1.0", f"c/{top}.tar.xz", "0" * 64, len(data), "http://x/")
    (tmp_path / "staging").mkdir()
    with pytest.raises(UserError, match="through the symlink"):
        cuda_tree.extract_component(archive, plan, tmp_path / "staging", {})


def _component(tmp_path: Path, name: str, files, links=None, raw_members=None):
    top = f"{name}-{PLATFORM}-1.0-archive"
    data = _tar_xz(top, files, links or {}, raw_members=raw_members)
    path = tmp_path / f"{top}.tar.xz"
    path.write_bytes(data)
    return path, cuda_manifest.ComponentPlan(name, "1.0", f"{name}/{PLATFORM}/{top}.tar.xz",
                                    hashlib.sha256(data).hexdigest(), len(data), "http://x/")


def test_unpacking_merges_components_and_keeps_inner_links(tmp_path: Path):
    staging = tmp_path / "staging"
    staging.mkdir()
    owners: dict[str, str] = {}
    hard = _member(f"cuda_a-{PLATFORM}-1.0-archive/lib/libsame.so", tarfile.LNKTYPE,
                   f"cuda_a-{PLATFORM}-1.0-archive/lib/liba.so.1")
    a = _component(tmp_path, "cuda_a", {"lib/liba.so.1": (b"A", 0o755), "include/common.h": (b"same", 0o644),
                                        "LICENSE": (b"a", 0o644)}, {"lib/liba.so": "liba.so.1"}, [hard])
    b = _component(tmp_path, "cuda_b", {"include/b.h": (b"B", 0o644), "include/common.h": (b"same", 0o644),
                                        "LICENSE": (b"b", 0o644)})
    assert cuda_tree.extract_component(*a, staging, owners) == 5
    assert cuda_tree.extract_component(*b, staging, owners) == 2  # identical include/common.h is not counted twice
    assert (staging / "lib/libsame.so").read_bytes() == b"A" and not (staging / "lib/libsame.so").is_symlink()
    assert os.readlink(staging / "lib/liba.so") == "liba.so.1"
    assert (staging / "licenses/cuda_a/LICENSE").read_bytes() == b"a"
    assert (staging / "licenses/cuda_b/LICENSE").read_bytes() == b"b"
    c = _component(tmp_path, "cuda_c", {"include/common.h": (b"different", 0o644)})
    with pytest.raises(UserError, match="with different content, by cuda_a"):
        cuda_tree.extract_component(*c, staging, owners)
    assert (staging / "include/common.h").read_bytes() == b"same"
    cuda_tree.finalize_tree(staging)
    assert os.readlink(staging / "lib64") == "lib"


# ---------------------------------------------------------------- end to end
def test_install_produces_exactly_the_listed_files(tmp_path: Path, release: Release, server, pinned: Path):
    root = tmp_path / "root"
    (root / ".cuda126-staging-999999/bin").mkdir(parents=True)  # left by a run that was killed
    proc = run(root, server, pinned)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # not a TTY: no progress bars; progress lines go to stdout
    tree = root / "cuda126"
    assert tree_entries(tree) == release.expected_files()
    # contents, modes and links as in the archives; LICENSEs kept apart per component
    assert (tree / "bin/ptxas").read_bytes() == COMPONENTS["cuda_nvcc"][1]["bin/ptxas"][0]
    assert os.access(tree / "bin/nvcc", os.X_OK) and not os.access(tree / "include/cuda.h", os.X_OK)
    assert os.readlink(tree / "lib/libcudart.so") == "libcudart.so.12"
    assert (tree / "lib/libcudart.so").read_bytes() == b"\x7fELF cudart"
    assert os.readlink(tree / "lib64") == "lib" and (tree / "lib64/stubs/libcuda.so").is_file()
    assert (tree / "licenses/cuda_cccl/LICENSE").read_bytes() == b"cccl license\n"
    receipt = json.loads((tree / RECEIPT).read_text())
    assert receipt["tool"] == "app/prepare_v100_cuda.py" and receipt["complete"] is True
    assert (receipt["version"], receipt["platform"], receipt["base_url"]) == (VERSION, PLATFORM, server.url)
    assert receipt["manifest"]["sha256"] == hashlib.sha256(release.manifest_bytes()).hexdigest()
    assert receipt["manifest"]["pinned"] is True and receipt["manifest"]["allow_unpinned"] is False
    assert [c["name"] for c in receipt["components"]] == list(COMPONENTS)
    for c in receipt["components"]:
        entry = release.manifest[c["name"]]
        assert (c["version"], c["relative_path"], c["sha256"], c["size"]) == (
            entry["version"], entry[PLATFORM]["relative_path"], entry[PLATFORM]["sha256"], int(entry[PLATFORM]["size"]))
    assert receipt["installed_files"] == len(release.expected_files()) - 1
    assert sum(c["files"] for c in receipt["components"]) == receipt["installed_files"] - 1  # + lib64
    # one progress line per component, downloads cleaned up, nothing left aside
    for i, name in enumerate(COMPONENTS, 1):
        assert f"[{i}/3] {name}" in proc.stdout
    assert not (root / ".cuda126-download").exists()
    assert not list(root.glob(".cuda126-staging-*")) and not list(root.glob(".cuda126-old-*"))


def test_rerun_on_finished_install_is_a_noop(tmp_path: Path, release: Release, server, pinned: Path):
    root = tmp_path / "root"
    assert run(root, server, pinned).returncode == 0
    before = (root / "cuda126" / RECEIPT).read_bytes()
    n_requests = len(server.requests)
    proc = run(root, server, pinned)
    assert proc.returncode == 0, proc.stderr
    assert "already installed" in proc.stdout
    assert [r.path for r in server.requests[n_requests:]] == [MANIFEST_PATH]  # no archive fetched again
    assert (root / "cuda126" / RECEIPT).read_bytes() == before
    # the no-op is decided by receipt content and the installed file count
    identity = cuda_tree.receipt_identity(json.loads(before))
    assert cuda_tree.existing_state(root / "cuda126", identity) == ("same", "")
    (root / "cuda126/include/cub/cub.cuh").unlink()
    state, reason = cuda_tree.existing_state(root / "cuda126", identity)
    assert state == "differs" and "modified after install" in reason


def _installed(tmp_path: Path, server, pinned: Path) -> tuple[Path, dict]:
    root = tmp_path / "root"
    assert run(root, server, pinned).returncode == 0
    receipt = json.loads((root / "cuda126" / RECEIPT).read_text())
    return root, receipt


def _snapshot(tree: Path) -> dict[str, bytes | str]:
    out = {}
    for rel in tree_entries(tree):
        p = tree / rel
        out[rel] = "->" + os.readlink(p) if p.is_symlink() else p.read_bytes()
    return out


def assert_refused_untouched(root: Path, server, pinned: Path, *needles: str, extra: tuple[str, ...] = ()) -> str:
    before = _snapshot(root / "cuda126")
    n = len(server.requests)
    line = assert_failed_one_line(run(root, server, pinned, *extra), "modified after install", "--force", *needles)
    assert "already installed" not in line
    assert _snapshot(root / "cuda126") == before  # nothing deleted, nothing repaired
    assert [r.path for r in server.requests[n:]] == [MANIFEST_PATH]
    return line


def test_receipt_lists_every_installed_file_with_size_and_sha256(tmp_path: Path, release: Release, server, pinned):
    root, receipt = _installed(tmp_path, server, pinned)
    tree = root / "cuda126"
    files = receipt["files"]
    assert receipt["schema"] == "openjev.cuda_receipt/2"
    assert set(files) == release.expected_files() - {RECEIPT}
    assert receipt["installed_files"] == len(files)
    ptxas = COMPONENTS["cuda_nvcc"][1]["bin/ptxas"][0]
    assert files["bin/ptxas"]["size"] == len(ptxas)
    assert files["bin/ptxas"]["sha256"] == hashlib.sha256(ptxas).hexdigest()
    assert files["lib/libcudart.so"] == {"symlink": "libcudart.so.12"} and files["lib64"] == {"symlink": "lib"}
    for rel, entry in files.items():
        if "sha256" in entry:
            assert entry["sha256"] == hashlib.sha256((tree / rel).read_bytes()).hexdigest(), rel
            assert entry["mtime_ns"] == os.lstat(tree / rel).st_mtime_ns


def test_same_size_edit_with_mtime_kept_is_caught_by_verify(tmp_path: Path, release: Release, server, pinned):
    root, _ = _installed(tmp_path, server, pinned)
    nvcc = root / "cuda126/bin/nvcc"
    st = nvcc.stat()
    data = nvcc.read_bytes()
    nvcc.write_bytes(data.replace(b"release 12.6", b"release 99.9"))  # same size, other content
    os.utime(nvcc, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert nvcc.stat().st_size == len(data)
    # the default check (size and mtime) cannot see this edit: documented; --verify hashes
    assert "already installed" in run(root, server, pinned).stdout
    line = assert_refused_untouched(root, server, pinned, "changed bin/nvcc", "sha256", extra=("--verify",))
    assert "1 files differ" in line
    # an edit that changes the mtime is caught without --verify
    nvcc.write_bytes(data.replace(b"release 12.6", b"release 99.9"))
    os.utime(nvcc, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert_refused_untouched(root, server, pinned, "changed bin/nvcc", "size and mtime")


def test_size_change_is_refused_without_verify(tmp_path: Path, release: Release, server, pinned):
    root, _ = _installed(tmp_path, server, pinned)
    header = root / "cuda126/include/cuda.h"
    st = header.stat()
    header.write_bytes(b"#define CUDA_VERSION 120600\n")  # one byte longer
    os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the mtime put back
    assert_refused_untouched(root, server, pinned, "changed include/cuda.h")


def test_swapped_file_and_retargeted_link_are_refused(tmp_path: Path, release: Release, server, pinned):
    root, _ = _installed(tmp_path, server, pinned)
    tree = root / "cuda126"
    os.replace(tree / "bin/ptxas", tree / "bin/ptxas.orig")
    (tree / "bin/ptxas").write_bytes(b"\x7fELF someone else's ptxas")
    (tree / "lib/libcudart.so").unlink()
    os.symlink("/usr/lib/libcudart.so", tree / "lib/libcudart.so")
    line = assert_refused_untouched(root, server, pinned, "changed bin/ptxas", "added bin/ptxas.orig",
                                    "changed lib/libcudart.so", extra=("--verify",))
    assert "3 files differ" in line


def test_removed_and_added_files_are_refused_and_listed_at_most_ten(tmp_path: Path, release: Release, server, pinned):
    root, _ = _installed(tmp_path, server, pinned)
    tree = root / "cuda126"
    (tree / "include/cub/cub.cuh").unlink()
    line = assert_refused_untouched(root, server, pinned, "removed include/cub/cub.cuh")
    assert "1 files differ" in line
    for i in range(12):
        (tree / f"lib/extra{i:02d}.so").write_bytes(b"planted")
    line = assert_refused_untouched(root, server, pinned, "removed include/cub/cub.cuh", "added lib/extra00.so",
                                    "and 3 more", extra=("--verify",))
    assert "13 files differ" in line and "lib/extra11.so" not in line
    # --force replaces it with a clean tree
    proc = run(root, server, pinned, "--force")
    assert proc.returncode == 0, proc.stderr
    assert tree_entries(tree) == release.expected_files()
    assert "already installed" in run(root, server, pinned, "--verify").stdout


def test_a_file_and_its_receipt_rewritten_together_are_refused(tmp_path: Path, release: Release, server, pinned):
    """The receipt's own sha256 is kept outside the tree (ROOT/.cuda126.receipt.sha256): rewriting a
    file and the receipt's entry for it in step is still seen."""
    root, receipt = _installed(tmp_path, server, pinned)
    nvcc = root / "cuda126/bin/nvcc"
    nvcc.write_bytes(b"#!/bin/sh\necho someone else's nvcc\n")
    st = nvcc.stat()
    receipt["files"]["bin/nvcc"].update(size=st.st_size, mtime_ns=st.st_mtime_ns,
                                        sha256=hashlib.sha256(nvcc.read_bytes()).hexdigest())
    (root / "cuda126" / RECEIPT).write_text(json.dumps(receipt))
    for extra in ((), ("--verify",)):
        assert_refused_untouched(root, server, pinned, "receipt's sha256 differs", ".cuda126.receipt.sha256",
                                 extra=extra)
    (root / ".cuda126.receipt.sha256").unlink()  # and with the record gone: cannot be trusted
    line = assert_failed_one_line(run(root, server, pinned), "no record of its receipt outside the tree", "--force")
    assert "already installed" not in line


def test_receipt_without_file_list_is_refused_with_reinstall_advice(tmp_path: Path, release: Release, server, pinned):
    root, receipt = _installed(tmp_path, server, pinned)
    del receipt["files"]
    receipt["schema"] = "openjev.cuda_receipt/1"
    (root / "cuda126" / RECEIPT).write_text(json.dumps(receipt))
    for extra in ((), ("--verify",)):
        before = _snapshot(root / "cuda126")
        line = assert_failed_one_line(run(root, server, pinned, *extra), "without the per-file list",
                                      "reinstall", "--force")
        assert _snapshot(root / "cuda126") == before
    assert "--verify" in subprocess.run([PYTHON, SCRIPT, "--help"], capture_output=True, text=True,
                                        timeout=30).stdout


def test_leftovers_of_killed_runs_are_cleaned_or_restored(tmp_path: Path):
    console = cuda_download.Console(quiet=True)
    (tmp_path / ".cuda126-staging-41/bin").mkdir(parents=True)
    (tmp_path / ".cuda126-old-42/bin").mkdir(parents=True)  # --force run killed between its two renames
    cuda_tree.remove_stale(tmp_path, "cuda126", console)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cuda126"]
    assert (tmp_path / "cuda126/bin").is_dir()
    (tmp_path / ".cuda126-old-43").mkdir()  # killed after the new tree took the name: just delete
    cuda_tree.remove_stale(tmp_path, "cuda126", console)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cuda126"]


def test_a_second_concurrent_run_is_refused(tmp_path: Path):
    fd = cuda_tree.acquire_lock(tmp_path, "cuda126")
    try:
        with pytest.raises(UserError, match="another prepare_v100_cuda.py run"):
            cuda_tree.acquire_lock(tmp_path, "cuda126")
    finally:
        os.close(fd)


def test_foreign_or_different_install_is_refused_unless_force(tmp_path: Path, release: Release, server, pinned):
    root = tmp_path / "root"
    (root / "cuda126/bin").mkdir(parents=True)
    (root / "cuda126/bin/nvcc").write_text("someone else's\n")
    assert_failed_one_line(run(root, server, pinned), "no complete openjev_cuda_receipt.json", "--force")
    assert (root / "cuda126/bin/nvcc").read_text() == "someone else's\n"
    assert archive_requests(server) == []

    proc = run(root, server, pinned, "--force")
    assert proc.returncode == 0, proc.stderr
    assert tree_entries(root / "cuda126") == release.expected_files()
    assert not list(root.glob(".cuda126-old-*")) and not list(root.glob(".cuda126-staging-*"))
    # our own install, but a different plan (one component fewer): refused as well
    assert_failed_one_line(run(root, server, pinned, components="cuda_nvcc,cuda_cudart"),
                           "different toolkit", "-cuda_cccl", "--force")
    assert tree_entries(root / "cuda126") == release.expected_files()


def test_corrupted_archive_fails_before_unpacking(tmp_path: Path, release: Release, server, pinned: Path):
    server.fault("/" + relative_path("cuda_cudart", "12.6.77"), corrupt=True, times=None)
    root = tmp_path / "root"
    assert_failed_one_line(run(root, server, pinned), "cuda_cudart", "sha256 mismatch",
                           "deleted")
    assert_nothing_half_made(root)
    downloads = {p.name for p in (root / ".cuda126-download").iterdir()}
    assert f"{top_dir('cuda_cudart', '12.6.77')}.tar.xz" not in downloads  # the bad file is gone
    assert not any(n.endswith(".part") for n in downloads)


def test_truncated_download_fails_cleanly(tmp_path: Path, release: Release, server, pinned: Path):
    server.fault("/" + relative_path("cuda_nvcc", "12.6.85"), cut_after=BIG // 3, times=None)
    root = tmp_path / "root"
    assert_failed_one_line(run(root, server, pinned), "cuda_nvcc", "re-run to resume")
    assert_nothing_half_made(root)


def test_interrupted_run_resumes_with_a_range_request(tmp_path: Path, release: Release, server, pinned):
    path = "/" + relative_path("cuda_nvcc", "12.6.85")
    cut = BIG // 2
    server.fault(path, cut_after=cut, times=1)
    root = tmp_path / "root"
    assert_failed_one_line(run(root, server, pinned), "re-run to resume")
    assert_nothing_half_made(root)
    part = root / ".cuda126-download" / f"{top_dir('cuda_nvcc', '12.6.85')}.tar.xz.part"
    assert part.stat().st_size == cut

    proc = run(root, server, pinned)
    assert proc.returncode == 0, proc.stderr
    assert [r.range for r in server.requests_for(path)] == [None, f"bytes={cut}-"]
    assert "resumed from" in proc.stdout
    assert tree_entries(root / "cuda126") == release.expected_files()


def test_sigterm_mid_download_stops_cleanly_and_keeps_the_part(tmp_path: Path, release: Release, server, pinned):
    server.fault("/" + relative_path("cuda_nvcc", "12.6.85"), stall_after=BIG // 2)
    root = tmp_path / "root"
    part = root / ".cuda126-download" / f"{top_dir('cuda_nvcc', '12.6.85')}.tar.xz.part"
    proc = subprocess.Popen(command(root, server, pinned), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not (part.exists() and part.stat().st_size >= BIG // 2 - 65536):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert err.strip() == "prepare_v100_cuda.py: error: interrupted"
    assert_nothing_half_made(root)
    assert part.stat().st_size == BIG // 2  # everything that arrived was kept for the resume


def test_dropped_connection_is_retried_within_one_run(tmp_path: Path, release: Release, server, pinned):
    path = "/" + relative_path("cuda_nvcc", "12.6.85")
    server.fault(path, cut_after=BIG // 2, times=1)
    root = tmp_path / "root"
    proc = run(root, server, pinned, "--retries", "1")
    assert proc.returncode == 0, proc.stderr
    assert [r.range for r in server.requests_for(path)] == [None, f"bytes={BIG // 2}-"]
    assert "retry 1/1" in proc.stdout


def test_server_without_range_support_restarts_the_download(tmp_path: Path, release: Release, pinned: Path):
    with LoopbackHTTPServer(range_support=False) as srv:
        sources = write_sources(tmp_path / "norange.json", release.publish(srv))
        path = "/" + relative_path("cuda_nvcc", "12.6.85")
        srv.fault(path, cut_after=BIG // 2, times=1)
        root = tmp_path / "root"
        assert run(root, srv, sources).returncode != 0
        proc = run(root, srv, sources)
        assert proc.returncode == 0, proc.stderr
        assert "ignored the Range request; restarting" in proc.stdout
        assert tree_entries(root / "cuda126") == release.expected_files()


def test_missing_component_is_refused_before_download(tmp_path: Path, release: Release, server, pinned):
    root = tmp_path / "root"
    assert_failed_one_line(run(root, server, pinned, components="cuda_nvcc,libcublas"),
                           "libcublas", "missing from redistrib_12.6.3.json")
    assert archive_requests(server) == []
    assert not root.exists() or not any(root.iterdir())


def test_manifest_entry_without_sha256_is_refused(tmp_path: Path, release: Release, server):
    manifest = json.loads(json.dumps(release.manifest))
    del manifest["cuda_cccl"][PLATFORM]["sha256"]
    sources = write_sources(tmp_path / "s.json", release.publish(server, manifest))
    root = tmp_path / "root"
    assert_failed_one_line(run(root, server, sources), "cuda_cccl", "no sha256")
    assert archive_requests(server) == []
    assert_nothing_half_made(root)


def test_manifest_differing_from_the_pin_is_refused(tmp_path: Path, release: Release, server):
    release.publish(server)
    sources = write_sources(tmp_path / "s.json", hashlib.sha256(b"another manifest").hexdigest())
    root = tmp_path / "root"
    assert_failed_one_line(run(root, server, sources), "but the pin is")
    assert archive_requests(server) == []
    assert_nothing_half_made(root)


def test_null_pin_needs_allow_unpinned_and_is_recorded(tmp_path: Path, release: Release, server):
    release.publish(server)
    sources = write_sources(tmp_path / "s.json", None)
    root = tmp_path / "root"
    assert_failed_one_line(run(root, server, sources), "no pinned sha256", "--allow-unpinned")
    assert server.requests == []  # refused before any network I/O
    proc = run(root, server, sources, "--allow-unpinned")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((root / "cuda126" / RECEIPT).read_text())["manifest"]
    assert manifest["pinned"] is False and manifest["allow_unpinned"] is True
    assert manifest["sha256"] == hashlib.sha256(release.manifest_bytes()).hexdigest()


def test_version_other_than_the_pinned_one_is_refused(tmp_path: Path, release: Release, server, pinned):
    proc = subprocess.run([PYTHON, SCRIPT, str(tmp_path / "root"), "--version", "12.8.1", "--sources", str(pinned),
                           "--base-url", server.url], capture_output=True, text=True, timeout=30)
    assert_failed_one_line(proc, "12.8.1", "--allow-unpinned")
    assert server.requests == []


def test_dry_run_downloads_nothing(tmp_path: Path, release: Release, server, pinned: Path):
    root = tmp_path / "root"
    proc = run(root, server, pinned, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    for name, (version, _, _) in COMPONENTS.items():
        line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith(name + " "))
        assert server.url + relative_path(name, version) in line
        assert cuda_download.format_bytes(len(release.archives[relative_path(name, version)])) in line
    assert "dry run" in proc.stdout and "(pinned)" in proc.stdout
    assert [r.path for r in server.requests] == [MANIFEST_PATH]
    assert not root.exists()


def test_archive_escaping_the_tree_fails_without_leaving_anything(tmp_path: Path, release: Release, server):
    top = top_dir("cuda_cccl", "12.6.77")
    evil = _tar_xz(top, {"include/ok.h": (b"ok", 0o644)}, {"include/escape": "../../../outside"})
    manifest = json.loads(json.dumps(release.manifest))
    manifest["cuda_cccl"][PLATFORM].update(sha256=hashlib.sha256(evil).hexdigest(), size=str(len(evil)))
    sources = write_sources(tmp_path / "s.json", release.publish(server, manifest))
    server.put("/" + relative_path("cuda_cccl", "12.6.77"), evil)
    root = tmp_path / "root"
    assert_failed_one_line(run(root, server, sources), "cuda_cccl", "outside the toolkit")
    assert_nothing_half_made(root)
