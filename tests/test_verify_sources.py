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
