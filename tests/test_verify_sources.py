"""verify_sources.py against real files: ok, mismatch, missing, unlisted, null pins."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from conftest import REPO, error_lines, run_script


def make_bundle(tmp_path, pins_edit=None):
    root = tmp_path / "bundle"
    (root / "sglang_openjev").mkdir(parents=True)
    (root / "sglang_openjev" / "a.py").write_text("A = 1\n")
    (root / "sglang_openjev" / "b.py").write_text("B = 2\n")
    src = json.loads((REPO / "HF_SOURCE.json").read_text())
    src["adapter"]["files"] = {n: hashlib.sha256((root / "sglang_openjev" / n).read_bytes()).hexdigest()
                               for n in ("a.py", "b.py")}
    if pins_edit:
        pins_edit(src["adapter"]["files"])
    (root / "HF_SOURCE.json").write_text(json.dumps(src))
    return root


def verify(root, *extra):
    return run_script("verify_sources.py", "--root", root, "--sources", root / "HF_SOURCE.json", *extra)


def test_matching_files_verify(tmp_path):
    proc = verify(make_bundle(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ok"] and {r["status"] for r in out["files"]} == {"ok"}


@pytest.mark.parametrize("change,status", [
    (lambda root: (root / "sglang_openjev" / "a.py").write_text("A = 666\n"), "mismatch"),
    (lambda root: (root / "sglang_openjev" / "b.py").unlink(), "missing"),
    (lambda root: (root / "sglang_openjev" / "c.py").write_text("C = 3\n"), "unlisted"),
])
def test_tampering_fails(tmp_path, change, status):
    root = make_bundle(tmp_path)
    change(root)
    proc = verify(root)
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr)
    assert f"is {status}" in line


def test_null_pin_refused_unless_allowed(tmp_path):
    root = make_bundle(tmp_path, lambda pins: pins.update({"b.py": None}))
    proc = verify(root)
    assert proc.returncode == 1 and "--allow-unpinned" in error_lines(proc.stderr)[0]
    assert verify(root, "--allow-unpinned").returncode == 0


def test_this_bundle_verifies_against_its_own_pins():
    proc = run_script("verify_sources.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_print_adapter_pins_lists_local_hashes(tmp_path):
    root = make_bundle(tmp_path)
    proc = verify(root, "--print-adapter-pins")
    assert json.loads(proc.stdout) == json.loads((root / "HF_SOURCE.json").read_text())["adapter"]["files"]


def copy_of_this_bundle(tmp_path):
    """The real adapter directory and HF_SOURCE.json, copied without any bytecode the host left."""
    root = tmp_path / "bundle"
    shutil.copytree(REPO / "sglang_openjev", root / "sglang_openjev", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "HF_SOURCE.json", root / "HF_SOURCE.json")
    return root


@pytest.mark.parametrize("planted", [
    "routes.cpython-311-x86_64-linux-gnu.so",  # would be imported instead of routes.py
    "evil.pth",
    "__pycache__/routes.cpython-311.pyc",
    "data/labels.json",
    "routes.py.orig",
])
def test_any_unlisted_file_in_the_adapter_directory_fails(tmp_path, planted):
    root = copy_of_this_bundle(tmp_path)
    assert verify(root).returncode == 0  # the copy verifies clean
    path = root / "sglang_openjev" / planted
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF planted" if planted.endswith(".so") else b"import os\n")
    proc = verify(root)
    assert proc.returncode == 1, proc.stdout
    (line,) = error_lines(proc.stderr)
    assert f"{planted} (unlisted)" in line
    out = json.loads(verify(root, "--json").stdout)
    assert not out["ok"]
    assert [r["file"] for r in out["files"] if r["status"] == "unlisted"] == [planted]


def test_all_failing_files_are_listed_and_a_symlink_never_matches(tmp_path):
    root = copy_of_this_bundle(tmp_path)
    adapter = root / "sglang_openjev"
    (adapter / "x.pth").write_text("import os\n")
    (adapter / "__pycache__").mkdir()
    (adapter / "__pycache__" / "contract.cpython-311.pyc").write_bytes(b"\x00" * 16)
    real = tmp_path / "routes_real.py"
    real.write_bytes((adapter / "routes.py").read_bytes())  # same bytes, but reached through a link
    (adapter / "routes.py").unlink()
    (adapter / "routes.py").symlink_to(real)
    proc = verify(root)
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr)
    assert "3 adapter file(s) failed" in line
    for needle in ("x.pth (unlisted)", "__pycache__/contract.cpython-311.pyc (unlisted)", "routes.py (mismatch)"):
        assert needle in line, line
