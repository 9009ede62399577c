"""app/prepare_v100_cuda.py end to end against the fake release of tests/_prepare_v100_cuda_support.py: the
installed tree and its receipt, the no-op re-run, every change to an installed tree refused (with
`--verify`, `--force`), leftovers of killed runs, a concurrent run, a foreign or different install.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from _prepare_v100_cuda_support import (COMPONENTS, MANIFEST_PATH, PLATFORM, PYTHON, RECEIPT, SCRIPT, VERSION, Release,
                                        archive_requests, assert_failed_one_line, run, tree_entries)
from _prepare_v100_cuda_support import pinned, release, server  # noqa: F401 - fixtures

from openjev.common import UserError
from openjev.cuda import download as cuda_download
from openjev.cuda import tree as cuda_tree


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
