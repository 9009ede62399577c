"""The scheduled bench's history: reading DIR/runs/*, the regression verdict, the table and the plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Sequence

from openjev.common import UserError
from openjev.tune.summary import headline, measurement_failures

PROFILE_NAME = "scheduled"


MODES = ("cold", "warm")


EXIT_REGRESSION = 3


DEFAULTS = {"baseline_runs": 5, "mad_k": 4.0, "rel_floor": 0.10, "max_dp_e": 0.02}


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
        out["problems"].append("run.json missing or unreadable")
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
    if out["complete"] and not sets:
        out["problems"].append("no input sets recorded")
    out["valid"] = out["complete"] and not out["problems"]
    return out


def load_history(history: Path) -> list[dict]:
    runs = history / "runs"
    if not runs.is_dir():
        raise UserError(f"--history {history}: no runs/ directory (no scheduled run yet?)")
    return [load_run(d) for d in sorted(runs.iterdir()) if d.is_dir()]


def mad(values: Sequence[float]) -> float:
    med = statistics.median(values)
    return statistics.median(abs(v - med) for v in values)


def verdict(runs: Sequence[dict], index: int = -1, *, baseline_runs: int = DEFAULTS["baseline_runs"],
            mad_k: float = DEFAULTS["mad_k"], rel_floor: float = DEFAULTS["rel_floor"],
            max_dp_e: float = DEFAULTS["max_dp_e"]) -> dict:
    """Judge runs[index] against the last `baseline_runs` complete and valid runs before it."""
    if not runs:
        raise UserError("no runs in the history")
    index = index % len(runs)
    run = runs[index]
    baseline = [r for r in runs[:index] if r["complete"] and r["valid"]][-baseline_runs:]
    reasons: list[str] = []
    notes: list[str] = []
    if not run["complete"]:
        reasons.append(f"run {run['name']} is incomplete")
    elif not run["valid"]:
        reasons += [f"invalid: {p}" for p in run["problems"]]
    bands = {}
    for key, h in run["measurements"].items():
        if h.get("argmax_changes"):
            reasons.append(f"{key}: {h['argmax_changes']} NLI argmax change(s)")
        dp = h.get("max_abs_dp_e")
        if isinstance(dp, (int, float)) and dp > max_dp_e:
            reasons.append(f"{key}: max |dp_e| {dp:.6f} > {max_dp_e}")
        if h.get("audit_passed") is False:
            reasons.append(f"{key}: group audit failed")
        med = h.get("median_pass_s")
        base = [b["measurements"].get(key, {}).get("median_pass_s") for b in baseline]
        base = [v for v in base if isinstance(v, (int, float))]
        if not isinstance(med, (int, float)):
            continue
        if not base:
            notes.append(f"{key}: no baseline run yet")
            continue
        bmed = statistics.median(base)
        limit = bmed + max(mad_k * mad(base), rel_floor * bmed)
        bands[key] = {"median_s": med, "baseline_median_s": bmed, "limit_s": limit, "baseline_n": len(base)}
        if med > limit:
            reasons.append(f"{key}: median {med:.4f} s > limit {limit:.4f} s (baseline median {bmed:.4f} s over "
                           f"{len(base)} run(s))")
    return {"run": run["name"], "regression": bool(reasons), "reasons": reasons, "notes": notes, "bands": bands,
            "baseline": [b["name"] for b in baseline],
            "rule": {"baseline_runs": baseline_runs, "mad_k": mad_k, "rel_floor": rel_floor, "max_dp_e": max_dp_e}}


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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_verdict(v: dict) -> str:
    if not v["regression"]:
        return f"run {v['run']}: no regression (baseline: {len(v['baseline'])} run(s))"
    return f"run {v['run']}: REGRESSION\n" + "\n".join(f"  - {r}" for r in v["reasons"])
