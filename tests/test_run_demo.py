"""The README's first command end to end (app/run_demo.sh, which `make demo` runs)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO


def test_demo_runs_end_to_end_and_keeps_every_run(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OPENJEV_DEMO_DIR": str(tmp_path / "demo")}
    first = subprocess.run(["bash", "app/run_demo.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "argmax agreement 22/22" in first.stdout and "bitwise equal: True" in first.stdout
    for label in ("contradiction", "entailment", "neutral"):
        assert label in first.stdout
    runs = list((tmp_path / "demo" / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "reference" / "reference.npy").is_file()
    assert (runs[0] / "logits_table.txt").read_text().strip()
    second = subprocess.run(["bash", "app/run_demo.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert "reusing" in second.stderr and "nothing to do" in second.stdout
    assert len(list((tmp_path / "demo" / "runs").iterdir())) == 2
