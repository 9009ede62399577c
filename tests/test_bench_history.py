"""The scheduled bench's history under damage and noise, on histories written here file by file (the
layout app/bench_scheduled_v100.py and app/bench_classify_v100.py write; their real runs are in
tests/test_bench_scheduled.py): newer schema versions, missing or altered arrays, truncated and stray
runs, an incomplete newest run, a short baseline, noisy passes, a full disk for the plot."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
from pathlib import Path

import numpy as np
from conftest import APP, PY, error_lines, on_full_disk

from openjev import history

REPORT = APP / "report_bench_history.py"


def write_run(root: Path, name: str, medians: dict[str, float] | float, *, complete: bool = True,
              passes: tuple[float, ...] | None = None, schema_version: int = 1) -> Path:
    """A run folder as the scheduler leaves it: run.json, and per mode a bench receipt with its
    passes array beside it (real .npy bytes, their sha256 in the receipt)."""
    run = root / "runs" / name
    (run / "tune" / history.PROFILE_NAME).mkdir(parents=True)
    rec = {"kind": "openjev-scheduled-run", "schema_version": schema_version, "phase": "done" if complete else
           "benchmarking", "started": "2026-12-05T00:00:00Z", "complete": complete, "tune_exit": 0 if complete else None,
           "server_config": {"sets": [{"name": "S"}]}}
    (run / "run.json").write_text(json.dumps(rec))
    if isinstance(medians, float):
        medians = {"cold": medians, "warm": medians}
    for mode, med in medians.items():
        walls = list(passes) if passes else [med, med, med]
        buf = io.BytesIO()
        np.save(buf, np.zeros((len(walls), 4, 3), dtype=np.float32))
        base = run / "tune" / history.PROFILE_NAME / f"S.{mode}"
        base.with_name(f"S.{mode}.passes.npy").write_bytes(buf.getvalue())
        receipt = {"kind": "openjev-bench", "schema_version": 1, "mode": mode, "valid": True, "complete": True,
                   "exit_code": 0, "inputs": {"rows": 4},
                   mode: {"timing": {"median_wall_s": med, "wall_s": walls}, "passes_done": len(walls),
                          "agreement_final": {"max_abs_dp_e": 0.0, "argmax_changes_count": 0},
                          "audit": {"failed": False}},
                   "outputs": {"candidate": None, "passes": {"file": f"S.{mode}.passes.npy",
                                                             "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}}}
        base.with_name(f"S.{mode}.json").write_text(json.dumps(receipt))
    return run


def name(i: int) -> str:
    return f"20261205T0{i // 60:01d}{i % 60:02d}00.000000Z-{1000 + i}"


def steady(root: Path, n: int, median: float = 0.100) -> list[str]:
    names = [name(i) for i in range(n)]
    for i, nm in enumerate(names):
        write_run(root, nm, median * (1 + 0.01 * (i % 3)))
    return names


def judge(root: Path, **kw) -> dict:
    return history.verdict(history.load_history(root), -1, **kw)


def test_a_run_written_by_a_newer_bundle_is_not_read_as_no_regression(tmp_path):
    steady(tmp_path, 5)
    for version in (2, 99):
        nm = name(10 + version)
        write_run(tmp_path, nm, 0.1, schema_version=version)
        v = judge(tmp_path)
        assert v["status"] == "unreadable" and v["regression"] is False
        assert any(f"schema_version {version}" in r for r in v["reasons"]), v
        import shutil

        shutil.rmtree(tmp_path / "runs" / nm)


def test_a_missing_or_altered_passes_array_makes_the_run_invalid(tmp_path):
    steady(tmp_path, 5)
    run = write_run(tmp_path, name(20), 0.1)
    arr = run / "tune" / history.PROFILE_NAME / "S.cold.passes.npy"
    arr.unlink()
    v = judge(tmp_path)
    assert v["regression"] and any("S.cold.passes.npy" in r and "missing" in r for r in v["reasons"]), v
    arr.write_bytes(b"not the array the receipt names")
    v = judge(tmp_path)
    assert v["regression"] and any("S.cold.passes.npy" in r and "sha256" in r for r in v["reasons"]), v


def test_a_damaged_baseline_run_is_skipped_with_its_reason(tmp_path):
    names = steady(tmp_path, 6)
    (tmp_path / "runs" / names[3] / "run.json").write_text('{"kind": "openjev-sched')  # truncated
    v = judge(tmp_path)
    assert names[3] not in v["baseline"]
    assert any(names[3] in n and "unreadable" in n for n in v["notes"]), v["notes"]


def test_a_stray_folder_under_runs_is_not_a_run(tmp_path):
    names = steady(tmp_path, 5)
    (tmp_path / "runs" / "zz-backup").mkdir()
    (tmp_path / "runs" / "notes.txt").write_text("x")
    runs = history.load_history(tmp_path)
    assert [r["name"] for r in runs] == names
    assert history.stray_entries(tmp_path) == ["zz-backup"]
    r = subprocess.run([PY, str(REPORT), "--history", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0 and "zz-backup" in r.stdout and "not a run" in r.stdout, r.stdout + r.stderr


def test_an_incomplete_newest_run_is_reported_as_incomplete(tmp_path):
    steady(tmp_path, 5)
    write_run(tmp_path, name(30), 0.1, complete=False)
    v = judge(tmp_path)
    assert v["status"] == "incomplete" and v["regression"] is False
    r = subprocess.run([PY, str(REPORT), "--history", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == history.EXIT_INCOMPLETE and "incomplete" in r.stdout and "REGRESSION" not in r.stdout


def test_timing_is_judged_only_with_enough_baseline_runs(tmp_path):
    """The cron case: 2 runs of 0.1054 s, then 0.1166 s on a loaded box was mailed as a regression."""
    write_run(tmp_path, name(0), 0.1054)
    write_run(tmp_path, name(1), 0.1054)
    write_run(tmp_path, name(2), 0.1166)
    v = judge(tmp_path)
    assert v["status"] == "insufficient baseline" and not v["regression"], v
    assert any("insufficient baseline" in n for n in v["notes"])
    r = subprocess.run([PY, str(REPORT), "--history", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0 and "insufficient baseline" in r.stdout
    # correctness is judged from the first run: an argmax change is a regression whatever the baseline
    receipt = tmp_path / "runs" / name(2) / "tune" / history.PROFILE_NAME / "S.warm.json"
    rec = json.loads(receipt.read_text())
    rec["warm"]["agreement_final"]["argmax_changes_count"] = 1
    receipt.write_text(json.dumps(rec))
    assert judge(tmp_path)["regression"]


def test_the_band_widens_with_the_runs_own_pass_noise(tmp_path):
    """Passes that scatter by +-10 % inside each run: a median 12 % over is noise, 60 % over is not."""
    for i in range(5):
        write_run(tmp_path, name(i), 0.100, passes=(0.090, 0.100, 0.112))
    write_run(tmp_path, name(5), 0.112, passes=(0.100, 0.112, 0.125))
    v = judge(tmp_path)
    assert not v["regression"], v
    assert v["bands"]["S/cold"]["pass_noise_s"] > 0
    write_run(tmp_path, name(6), 0.160, passes=(0.150, 0.160, 0.170))
    v = judge(tmp_path)
    assert v["regression"] and any("S/cold" in r and "> limit" in r for r in v["reasons"]), v


def test_plot_and_json_on_a_full_disk_are_one_line_and_leave_no_file(tmp_path):
    steady(tmp_path, 3)
    disk = tmp_path / "disk"
    r = on_full_disk(disk, PY, REPORT, "--history", tmp_path, "--plot", disk / "plot.png")
    lines = error_lines(r.stderr)
    assert r.returncode == 1 and len(lines) == 1 and "plot.png" in lines[0] and "No space left" in lines[0], r.stderr
    assert r.stdout.rstrip().endswith("LEFT:"), r.stdout  # no PNG, no temporary file
    r = on_full_disk(tmp_path / "disk2", PY, REPORT, "--history", tmp_path, "--json", tmp_path / "disk2" / "h.json")
    lines = error_lines(r.stderr)
    assert r.returncode == 1 and len(lines) == 1 and "No space left" in lines[0], r.stderr
    assert r.stdout.rstrip().endswith("LEFT:"), r.stdout
