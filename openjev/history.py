"""The scheduled bench's history: reading DIR/runs/*, the regression verdict, the table and the plot."""

from __future__ import annotations

import io
import json
import re
import statistics
from pathlib import Path
from typing import Any, Sequence

from openjev.common import UserError, atomic_write_bytes, sha256_file
from openjev.tune.summary import headline, measurement_failures

PROFILE_NAME = "scheduled"


MODES = ("cold", "warm")


EXIT_REGRESSION = 3
EXIT_INCOMPLETE = 4  # the judged run is incomplete (killed, or still running): not judged
EXIT_UNREADABLE = 5  # the judged run was written by a newer bundle: not judged

SCHEMA_VERSION = 1  # of run.json; a newer one is refused, never read as if it were this one
RUN_NAME_RE = re.compile(r"^\d{8}T\d{6}\.\d{6}Z-\d+$")  # what bench_scheduled_v100.py names a run folder

DEFAULTS = {"baseline_runs": 5, "min_baseline_runs": 3, "mad_k": 4.0, "rel_floor": 0.10, "max_dp_e": 0.02}


def _load(path: Path) -> dict | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def load_run(run_dir: Path) -> dict:
    """One run's record: name, complete, valid, problems, per 'SET/MODE' headline figures."""
    rec = _load(run_dir / "run.json")
    out: dict[str, Any] = {"name": run_dir.name, "started": None, "complete": False, "valid": False,
                           "problems": [], "measurements": {}}
    if rec is None:
        out["problems"].append("run.json missing or unreadable (truncated?)")
        return out
    version = rec.get("schema_version")
    if version != SCHEMA_VERSION:
        out["unreadable"] = True
        out["problems"].append(f"run.json schema_version {version} is not the {SCHEMA_VERSION} this bundle reads "
                               "(written by another version of the bundle)")
        return out
    out["started"] = rec.get("started")
    out["phase"] = rec.get("phase")
    out["complete"] = rec.get("complete") is True
    if not out["complete"]:
        out["problems"].append(f"incomplete (phase {rec.get('phase')})")
    if out["complete"] and rec.get("tune_exit") != 0:
        out["problems"].append(f"tuner exit {rec.get('tune_exit')}")
    sets = [s.get("name") for s in (rec.get("server_config") or {}).get("sets", []) if isinstance(s, dict)]
    for s in sets:
        for mode in MODES:
            key = f"{s}/{mode}"
            receipt = _load(run_dir / "tune" / PROFILE_NAME / f"{s}.{mode}.json")
            h = headline(receipt, mode)
            out["measurements"][key] = h
            if not out["complete"]:
                continue
            if receipt is None:
                out["problems"].append(f"{key}: no receipt")
                continue
            m = {**h, "profile": PROFILE_NAME, "set": s, "mode": mode, "receipt_found": True,
                 "exit_code": h.get("receipt_exit_code")}
            out["problems"] += measurement_failures(m)
            out["problems"] += [f"{key}: {p}" for p in output_problems(receipt, run_dir / "tune" / PROFILE_NAME)]
    if out["complete"] and not sets:
        out["problems"].append("no input sets recorded")
    out["valid"] = out["complete"] and not out["problems"]
    return out


def output_problems(receipt: dict, folder: Path) -> list[str]:
    """The arrays a bench receipt names: present beside it, with the sha256 it recorded."""
    bad = []
    for entry in (receipt.get("outputs") or {}).values():
        if not isinstance(entry, dict) or not entry.get("file"):
            continue
        path = folder / Path(entry["file"]).name
        try:
            digest = sha256_file(path)
        except OSError:
            bad.append(f"{path.name} missing (the receipt names it)")
            continue
        if digest != entry.get("sha256"):
            bad.append(f"{path.name} sha256 differs from the receipt's")
    return bad


def load_history(history: Path) -> list[dict]:
    """The runs under history/runs, oldest first; folders not named as the scheduler names runs are
    not runs (stray_entries lists them)."""
    runs = history / "runs"
    if not runs.is_dir():
        raise UserError(f"--history {history}: no runs/ directory (no scheduled run yet?)")
    return [load_run(d) for d in sorted(runs.iterdir()) if d.is_dir() and RUN_NAME_RE.match(d.name)]


def stray_entries(history: Path) -> list[str]:
    """Folders under history/runs that are not runs (a copy, a backup): ignored, and said so."""
    return sorted(d.name for d in (history / "runs").iterdir() if d.is_dir() and not RUN_NAME_RE.match(d.name))


def mad(values: Sequence[float]) -> float:
    med = statistics.median(values)
    return statistics.median(abs(v - med) for v in values)


def pass_noise(h: dict) -> float | None:
    """One run's own timing noise: the median absolute deviation of its measured pass wall times."""
    walls = h.get("pass_walls_s")
    if not isinstance(walls, list) or len(walls) < 2 or not all(isinstance(w, (int, float)) for w in walls):
        return None
    return mad(walls)


def verdict(runs: Sequence[dict], index: int = -1, *, baseline_runs: int = DEFAULTS["baseline_runs"],
            min_baseline_runs: int = DEFAULTS["min_baseline_runs"], mad_k: float = DEFAULTS["mad_k"],
            rel_floor: float = DEFAULTS["rel_floor"], max_dp_e: float = DEFAULTS["max_dp_e"]) -> dict:
    """Judge runs[index] against the last `baseline_runs` complete and valid runs before it.

    status: "ok", "regression", "incomplete" (not judged), "unreadable" (a newer bundle's run; not
    judged) or "insufficient baseline" (correctness judged, timing not: fewer than
    `min_baseline_runs` baseline runs). The timing band is the baseline median plus the largest of
    k x the MAD of the baseline medians, k x the runs' own pass noise (median of each run's pass
    MAD, the baseline's and this run's) and the floor fraction of the baseline median."""
    if not runs:
        raise UserError("no runs in the history")
    index = index % len(runs)
    run = runs[index]
    earlier = runs[:index]
    usable = [r for r in earlier if r["complete"] and r["valid"]]
    baseline = usable[-baseline_runs:]
    reasons: list[str] = []
    notes = [f"baseline skips {r['name']}: {r['problems'][0] if r['problems'] else 'incomplete'}"
             for r in earlier if r not in usable and (not baseline or r["name"] > baseline[0]["name"])]
    rule = {"baseline_runs": baseline_runs, "min_baseline_runs": min_baseline_runs, "mad_k": mad_k,
            "rel_floor": rel_floor, "max_dp_e": max_dp_e}
    result = {"run": run["name"], "regression": False, "reasons": reasons, "notes": notes, "bands": {},
              "baseline": [b["name"] for b in baseline], "rule": rule}
    if run.get("unreadable"):
        reasons += run["problems"]
        return {**result, "status": "unreadable"}
    if not run["complete"]:
        reasons.append(f"run {run['name']} is incomplete (phase {run.get('phase')}): killed, or still running")
        return {**result, "status": "incomplete"}
    if not run["valid"]:
        reasons += [f"invalid: {p}" for p in run["problems"]]
    bands = result["bands"]
    short = len(baseline) < min_baseline_runs
    for key, h in run["measurements"].items():
        if h.get("argmax_changes"):
            reasons.append(f"{key}: {h['argmax_changes']} NLI argmax change(s)")
        dp = h.get("max_abs_dp_e")
        if isinstance(dp, (int, float)) and dp > max_dp_e:
            reasons.append(f"{key}: max |dp_e| {dp:.6f} > {max_dp_e}")
        if h.get("audit_passed") is False:
            reasons.append(f"{key}: group audit failed")
        med = h.get("median_pass_s")
        base_h = [b["measurements"].get(key, {}) for b in baseline]
        base = [x.get("median_pass_s") for x in base_h if isinstance(x.get("median_pass_s"), (int, float))]
        if not isinstance(med, (int, float)) or short:
            continue
        bmed = statistics.median(base)
        noises = [n for n in map(pass_noise, [*base_h, h]) if n is not None]
        noise = statistics.median(noises) if noises else 0.0
        limit = bmed + max(mad_k * mad(base), mad_k * noise, rel_floor * bmed)
        bands[key] = {"median_s": med, "baseline_median_s": bmed, "limit_s": limit, "baseline_n": len(base),
                      "pass_noise_s": noise}
        if med > limit:
            reasons.append(f"{key}: median {med:.4f} s > limit {limit:.4f} s (baseline median {bmed:.4f} s over "
                           f"{len(base)} run(s), pass noise {noise:.4f} s)")
    if short:
        notes.append(f"insufficient baseline: {len(baseline)} complete and valid run(s) before this one, "
                     f"{min_baseline_runs} needed before timing is judged")
    result["regression"] = bool(reasons)
    status = "regression" if reasons else "insufficient baseline" if short else "ok"
    return {**result, "status": status}


def _f(v: Any, fmt: str = "{:.4f}") -> str:
    return "-" if v is None else fmt.format(v) if isinstance(v, float) else str(v)


def format_table(runs: Sequence[dict]) -> str:
    keys = sorted({k for r in runs for k in r["measurements"]})
    head = ["run", "complete", "valid"] + [f"{k} {c}" for k in keys for c in ("median_s", "argmax", "max|dp_e|", "audit")]
    rows = [head]
    for r in runs:
        row = [r["name"], "yes" if r["complete"] else "NO", "yes" if r["valid"] else "NO"]
        for k in keys:
            h = r["measurements"].get(k, {})
            audit = {True: "ok", False: "FAIL"}.get(h.get("audit_passed"), "-")
            row += [_f(h.get("median_pass_s")), _f(h.get("argmax_changes")), _f(h.get("max_abs_dp_e"), "{:.2e}"), audit]
        rows.append(row)
    widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in rows)


def load_reference_lines(path: Path | None) -> dict[str, float]:
    if path is None:
        return {}
    obj = _load(path)
    if obj is None:
        raise UserError(f"--reference-lines {path}: not a readable JSON object")
    lines = {k: v for k, v in obj.items() if not k.startswith("_") and k != "kind"}
    if not all(isinstance(v, (int, float)) for v in lines.values()):
        raise UserError(f"--reference-lines {path}: values must be seconds (numbers)")
    return lines


def write_plot(runs: Sequence[dict], path: Path, ref_lines: dict[str, float]) -> None:
    """The medians over the runs as a PNG, written whole or not at all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    keys = sorted({k for r in runs for k in r["measurements"]})
    xs = list(range(len(runs)))
    for k in keys:
        pts = [(i, r["measurements"].get(k, {}).get("median_pass_s"), r["valid"]) for i, r in enumerate(runs)]
        pts = [(i, v, ok) for i, v, ok in pts if isinstance(v, (int, float))]
        if not pts:
            continue
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{k} median")
        bad = [p for p in pts if not p[2]]
        if bad:
            ax.scatter([p[0] for p in bad], [p[1] for p in bad], marker="x", s=80, color="red", zorder=3)
    for label, y in ref_lines.items():
        ax.axhline(y, linestyle="--", linewidth=1, color="gray")
        ax.annotate(label, (0, y), fontsize=7, color="gray", va="bottom")
    ax.set_xticks(xs)
    ax.set_xticklabels([r["name"] + ("" if r["complete"] else "\n(incomplete)") for r in runs], rotation=30,
                       ha="right", fontsize=7)
    ax.set_ylabel("median pass wall time, s")
    ax.set_title("scheduled benchmark history (x = invalid/incomplete run)")
    if ref_lines:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, buf.getvalue())
    except OSError as exc:
        raise UserError(f"--plot {path}: cannot write it: {exc.strerror or exc}") from None


def format_verdict(v: dict) -> str:
    notes = "".join(f"\n  note: {n}" for n in v["notes"])
    if v["status"] in ("incomplete", "unreadable"):
        return f"run {v['run']}: {v['status'].upper()}, not judged\n" + "\n".join(f"  - {r}" for r in v["reasons"]) + notes
    if not v["regression"]:
        what = "insufficient baseline, timing not judged" if v["status"] == "insufficient baseline" else "no regression"
        return f"run {v['run']}: {what} (baseline: {len(v['baseline'])} run(s)){notes}"
    return f"run {v['run']}: REGRESSION\n" + "\n".join(f"  - {r}" for r in v["reasons"]) + notes


def exit_status(v: dict) -> int:
    return {"regression": EXIT_REGRESSION, "incomplete": EXIT_INCOMPLETE, "unreadable": EXIT_UNREADABLE}.get(
        v["status"], 0)
