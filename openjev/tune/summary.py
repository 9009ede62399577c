"""The tuner's comparison: each bench receipt's headline, the checks, the fastest profiles, the table and the plot."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

MODES = ("cold", "warm")


def headline(receipt: dict | None, mode: str) -> dict:
    """Headline figures of one receipt of app/bench_classify_v100.py (kind "openjev-bench").

    Its figures live under receipt[mode] ("cold" with --cold-cache, else "warm"): timing.median_wall_s
    (median measured pass wall time), timing.pairs_per_s, timing.batch_latency_s.{p50,p99},
    agreement_final, audit.failed; top level: valid, complete, exit_code, exclusive.valid, outputs.
    """
    if not isinstance(receipt, dict):
        return {}
    sec = receipt.get(mode) if isinstance(receipt.get(mode), dict) else {}
    timing = sec.get("timing") or {}
    lat = timing.get("batch_latency_s") or {}
    ag = sec.get("agreement_final") or {}
    audit = sec.get("audit") or {}
    excl = receipt.get("exclusive")
    outputs = receipt.get("outputs") or {}
    out = {
        "receipt_kind": receipt.get("kind"),
        "receipt_mode": receipt.get("mode"),
        "machine": receipt.get("machine"),
        "valid": receipt.get("valid"),
        "complete": receipt.get("complete"),
        "receipt_exit_code": receipt.get("exit_code"),
        "reasons": receipt.get("reasons") or [],
        "rows": (receipt.get("inputs") or {}).get("rows"),
        "passes_done": sec.get("passes_done"),
        "passes_planned": sec.get("passes_planned"),
        "median_pass_s": timing.get("median_wall_s"),
        "initial_pass_s": timing.get("initial_pass_wall_s"),
        "pass_walls_s": timing.get("wall_s"),
        "pairs_per_s": timing.get("pairs_per_s"),
        "batch_latency_p50_s": lat.get("p50"),
        "batch_latency_p99_s": lat.get("p99"),
        "max_abs_dp_e": ag.get("max_abs_dp_e"),
        "argmax_changes": ag.get("argmax_changes_count"),
        "audit_passed": (not audit["failed"]) if isinstance(audit.get("failed"), bool) else None,
        "audit_failures": audit.get("failures_total"),
        "audit_ties": audit.get("ties_total"),
        "audit_groups": audit.get("groups"),
        "exclusivity_valid": excl.get("valid") if isinstance(excl, dict) else None,
        "outputs": {k: v.get("file") for k, v in outputs.items() if isinstance(v, dict)},
    }
    return {k: v for k, v in out.items() if v is not None}


def measurement_failures(m: dict) -> list[str]:
    """Every check of one measurement that did not hold (empty: all held)."""
    where = f"{m['profile']}/{m['set']}/{m['mode']}"
    bad = []
    if m.get("exit_code") != 0:
        bad.append(f"{where}: bench exit {m.get('exit_code')}{' (' + m['error'] + ')' if m.get('error') else ''}")
    if not m.get("receipt_found"):
        bad.append(f"{where}: no bench receipt")
        return bad
    if m.get("receipt_kind") != "openjev-bench" or m.get("receipt_mode") != m["mode"]:
        bad.append(f"{where}: receipt is not an openjev-bench {m['mode']} receipt")
    if m.get("valid") is not True:
        bad.append(f"{where}: receipt not valid" + (f" ({m['reasons'][0]})" if m.get("reasons") else ""))
    if m.get("complete") is not True:
        bad.append(f"{where}: receipt incomplete")
    if m.get("audit_passed") is False:
        bad.append(f"{where}: group audit failed")
    if m.get("exclusivity_valid") is False or (m.get("exclusivity_checked") and m.get("exclusivity_valid") is not True):
        bad.append(f"{where}: GPU exclusivity invalid or not recorded")
    if not isinstance(m.get("median_pass_s"), (int, float)):
        bad.append(f"{where}: no median pass wall time in the receipt")
    return bad


def summarize(profiles: Sequence[dict], set_names: Sequence[str], *, exclusivity_checked: bool,
              exclusivity_note: str | None = None) -> dict:
    """Comparison table, fastest profiles and every check, from the profile records of run.json."""
    order = [p["name"] for p in profiles]
    rows, failures = [], []
    cell: dict[tuple[str, str, str], dict] = {}
    for p in profiles:
        if p.get("status") != "done":
            failures.append(f"{p['name']}: {p.get('status', 'pending')}" + (f" ({p['failure']})" if p.get("failure") else ""))
        for m in p.get("measurements", []):
            bad = measurement_failures(m)
            failures += bad
            row = {"profile": p["name"], "set": m["set"], "mode": m["mode"], "median_pass_s": m.get("median_pass_s"),
                   "pairs_per_s": m.get("pairs_per_s"), "exit_code": m.get("exit_code"), "checks_ok": not bad,
                   "receipt": m.get("receipt")}
            rows.append(row)
            cell[(p["name"], m["set"], m["mode"])] = row

    def ok_median(name: str, s: str, mode: str) -> float | None:
        r = cell.get((name, s, mode))
        return r["median_pass_s"] if r and r["checks_ok"] and isinstance(r["median_pass_s"], (int, float)) else None

    per_set: dict[str, dict[str, Any]] = {}
    for s in set_names:
        per_set[s] = {}
        for mode in MODES:
            cands = [(ok_median(n, s, mode), i, n) for i, n in enumerate(order) if ok_median(n, s, mode) is not None]
            per_set[s][mode] = ({"profile": min(cands)[2], "median_pass_s": min(cands)[0]} if cands else None)

    eligible, ineligible = [], {}
    for i, p in enumerate(profiles):
        medians = {mode: [ok_median(p["name"], s, mode) for s in set_names] for mode in MODES}
        if p.get("status") != "done":
            ineligible[p["name"]] = f"profile {p.get('status', 'pending')}"
        elif any(v is None for mode in MODES for v in medians[mode]):
            ineligible[p["name"]] = "a measurement is missing or failed a check"
        else:
            eligible.append((sum(medians["warm"]), sum(medians["cold"]), i, p["name"]))
    overall = None
    if eligible:
        warm_sum, cold_sum, _, name = min(eligible)
        cold_best = min(eligible, key=lambda e: (e[1], e[0], e[2]))
        overall = {"profile": name, "warm_sum_s": warm_sum, "cold_sum_s": cold_sum,
                   "cold_rule_profile": cold_best[3], "cold_rule_cold_sum_s": cold_best[1]}
    checks_ok = not failures
    return {
        "kind": "openjev-tune-summary",
        "schema_version": 1,
        "promoted": None,
        "note": "comparison only: no profile is promoted; the production endpoint is unchanged",
        "profiles": [{"name": p["name"], "status": p.get("status"), "failure": p.get("failure"),
                      "config": p.get("profile")} for p in profiles],
        "sets": list(set_names),
        "table": rows,
        "fastest": {
            "rule": ("per set and mode: lowest median pass wall time among measurements whose checks held; overall: "
                     "lowest sum of warm medians over all sets among profiles with every measurement present and "
                     "every check held (ties: lower cold sum, then profile order); cold_rule_profile: the same by "
                     "the sum of cold medians"),
            "per_set": per_set,
            "overall": overall,
            "ineligible": ineligible,
        },
        "checks": {"all_passed": checks_ok, "failures": failures, "exclusivity_checked": exclusivity_checked,
                   "exclusivity_note": exclusivity_note},
    }


def format_table(summary: dict) -> str:
    """The comparison table printed at the end (plain text, fixed width)."""
    sets = summary["sets"]
    cols = [f"{s} {mode}" for s in sets for mode in MODES]
    cell = {(r["profile"], r["set"], r["mode"]): r for r in summary["table"]}
    header = ["profile", "status", *cols, "warm sum", "checks"]
    lines = []
    for p in summary["profiles"]:
        vals, warm, all_ok, missing = [], 0.0, p["status"] == "done", False
        for s in sets:
            for mode in MODES:
                r = cell.get((p["name"], s, mode))
                if r is None or not isinstance(r["median_pass_s"], (int, float)):
                    vals.append("-")
                    missing = True
                    all_ok = False
                    continue
                vals.append(f"{r['median_pass_s']:.3f}" + ("" if r["checks_ok"] else "!"))
                all_ok &= r["checks_ok"]
                if mode == "warm":
                    warm += r["median_pass_s"]
        warm_txt = "-" if missing else f"{warm:.3f}"
        lines.append([p["name"], p["status"] or "pending", *vals, warm_txt, "ok" if all_ok else "FAILED"])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    fmt = lambda row: "  ".join(str(x).ljust(w) if i < 2 else str(x).rjust(w) for i, (x, w) in enumerate(zip(row, widths)))  # noqa: E731
    out = ["median pass wall time, seconds (lower is better; '!' = a check failed, '-' = not measured)",
           fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in lines), ""]
    fastest = summary["fastest"]
    for s in sets:
        for mode in MODES:
            f = fastest["per_set"][s][mode]
            out.append(f"fastest {s} {mode}: " + (f"{f['profile']} ({f['median_pass_s']:.3f} s)" if f else "none (no valid measurement)"))
    ov = fastest["overall"]
    if ov:
        out.append(f"fastest overall (sum of warm medians): {ov['profile']} ({ov['warm_sum_s']:.3f} s); "
                   f"by sum of cold medians: {ov['cold_rule_profile']} ({ov['cold_rule_cold_sum_s']:.3f} s)")
    else:
        out.append("fastest overall: none (no profile completed every measurement with every check held)")
    checks = summary["checks"]
    if not checks["exclusivity_checked"]:
        out.append(f"GPU exclusivity: NOT checked ({checks.get('exclusivity_note') or 'NVML unavailable'})")
    if checks["all_passed"]:
        out.append("every correctness check held (bench exits 0, receipts valid and complete, group audits passed"
                   + (", GPU exclusive)" if checks["exclusivity_checked"] else ")"))
    else:
        out.append(f"CHECKS FAILED ({len(checks['failures'])}):")
        out += [f"  - {f}" for f in checks["failures"]]
    out.append("nothing was promoted: choose a profile by hand, from these receipts")
    return "\n".join(out)


def write_plot(summary: dict, path: Path, title: str) -> None:
    """Grouped bars: one panel per mode, input sets on x, one bar per profile, values annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets, profiles = summary["sets"], [p["name"] for p in summary["profiles"]]
    cell = {(r["profile"], r["set"], r["mode"]): r for r in summary["table"]}
    fig, axes = plt.subplots(1, len(MODES), figsize=(max(9.0, 4 + 0.9 * len(sets) * len(profiles)), 5.5),
                             squeeze=False)
    width = 0.8 / max(1, len(profiles))
    for ax, mode in zip(axes[0], MODES):
        top = max([r["median_pass_s"] for r in summary["table"]
                   if r["mode"] == mode and isinstance(r["median_pass_s"], (int, float))] or [1.0])
        for j, name in enumerate(profiles):
            for i, s in enumerate(sets):
                x = i - 0.4 + width * (j + 0.5)
                r = cell.get((name, s, mode))
                v = r["median_pass_s"] if r and isinstance(r["median_pass_s"], (int, float)) else None
                if v is None:
                    ax.text(x, top * 0.02, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
                    continue
                ok = r["checks_ok"]
                ax.bar(x, v, width, color=f"C{j}", hatch=None if ok else "//", edgecolor="black" if not ok else None,
                       label=name if i == 0 else None)
                ax.text(x, v, f"{v:.2f}" + ("" if ok else "!"), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(sets)))
        ax.set_xticklabels(sets)
        ax.set_title("cold: prefix cache cleared before each pass" if mode == "cold"
                     else "warm: repeated inputs, warm prefix cache", fontsize=10)
        ax.set_ylabel("median pass wall time (s), lower is better")
        ax.set_ylim(0, top * 1.18)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        h, lab = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lab):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8)
    fig.suptitle(title + "\n('!' / hatched: a correctness check failed; nothing promoted)", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 0.93))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
