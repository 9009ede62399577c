"""app/prepare_v100_cuda.py's unpacking (`openjev/cuda/tree.py`): member paths and links that would leave
the toolkit folder are refused, components merge into one tree with their inner links kept; in-process
on real .tar.xz archives, and end to end against the fake release of tests/_prepare_v100_cuda_support.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path, PurePosixPath

import pytest
from _prepare_v100_cuda_support import (PLATFORM, Release, _tar_xz, assert_failed_one_line, assert_nothing_half_made,
                                        relative_path, run, top_dir, write_sources)
from _prepare_v100_cuda_support import pinned, release, server  # noqa: F401 - fixtures

from openjev.common import UserError
from openjev.cuda import manifest as cuda_manifest
from openjev.cuda import tree as cuda_tree


# ---------------------------------------------------------------- pure helpers
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
