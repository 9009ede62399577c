"""A fake NVIDIA CUDA release on a real loopback HTTP server, and app/prepare_v100_cuda.py run against it
(tests/test_prepare_v100_cuda_*.py; no mocks).

The fake release is shaped like NVIDIA's: `redistrib_12.6.3.json` with one entry per component and
per-platform `relative_path`/`sha256`/`md5`/`size`, and archives named
`<component>/linux-x86_64/<component>-linux-x86_64-<version>-archive.tar.xz` that hold one folder of
the same name (bin/, include/, lib/, nvvm/, LICENSE). The script runs as a subprocess with
`--base-url` at the server and `--sources` at a temporary sources file pinning the manifest's
real sha256. The fixtures (`release`, `server`, `pinned`) are imported by the test modules that use
them; `server` there is this loopback server, not conftest's embedded one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parents[1]

from _http_fixtures import LoopbackHTTPServer

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
