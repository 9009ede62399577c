"""app/prepare_v100_cuda.py's plan before any download: its arguments and help, the platform and
components, the manifest entries it accepts, the pinned manifest sha256 (`--allow-unpinned`), and
`--dry-run`; in-process and against the fake release of tests/_prepare_v100_cuda_support.py.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from _prepare_v100_cuda_support import (COMPONENTS, MANIFEST_PATH, PLATFORM, PYTHON, RECEIPT, SCRIPT, VERSION, Release,
                                        archive_requests, assert_failed_one_line, assert_nothing_half_made,
                                        relative_path, run, top_dir, write_sources)
from _prepare_v100_cuda_support import pinned, release, server  # noqa: F401 - fixtures

from openjev.common import UserError
from openjev.cuda import download as cuda_download
from openjev.cuda import manifest as cuda_manifest


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


# ---------------------------------------------------------------- end to end
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
