"""Agreement with the reference and the option-group audit, per pass; the bench's exit rule."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from openjev.common import LABELS, entailment_prob

EXIT_OK, EXIT_USAGE, EXIT_AUDIT, EXIT_EXCLUSIVE, EXIT_INCOMPLETE = 0, 1, 2, 3, 4


WORST_ROWS_KEPT = 10


def percentile_summary(values: Sequence[float]) -> dict:
    """p50/p90/p99 (linear interpolation, numpy's default), max, mean and count; nulls when empty."""
    if len(values) == 0:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None, "count": 0}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(a.max()),
            "mean": float(a.mean()), "count": int(a.size)}


def median_or_none(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if len(values) else None


def agreement(candidate: np.ndarray, reference: np.ndarray, row_ids: Sequence[str], full: bool = False) -> dict:
    """Candidate vs reference logits: entailment-probability and logit differences, argmax changes."""
    dpe = np.abs(entailment_prob(candidate) - entailment_prob(reference))
    dlogit = np.abs(candidate.astype(np.float64) - reference.astype(np.float64))
    cand_arg, ref_arg = candidate.argmax(axis=1), reference.argmax(axis=1)
    changed = np.flatnonzero(cand_arg != ref_arg)
    out = {
        "rows": int(len(row_ids)),
        "max_abs_dp_e": float(dpe.max()),
        "p99_abs_dp_e": float(np.percentile(dpe, 99)),
        "mean_abs_dp_e": float(dpe.mean()),
        "max_abs_logit_diff": float(dlogit.max()),
        "argmax_changes_count": int(changed.size),
        "argmax_changes": [{"id": row_ids[i], "reference": LABELS[ref_arg[i]], "candidate": LABELS[cand_arg[i]]}
                           for i in changed],
        "bitwise_equal": bool(np.array_equal(candidate, reference)),
    }
    if full:
        pe_c, pe_r = entailment_prob(candidate), entailment_prob(reference)
        worst = np.argsort(-dpe, kind="stable")[:WORST_ROWS_KEPT]
        out["worst_rows"] = [{"id": row_ids[i], "abs_dp_e": float(dpe[i]), "p_e_reference": float(pe_r[i]),
                              "p_e_candidate": float(pe_c[i])} for i in worst]
    return out


def group_key(row: dict) -> tuple:
    """Option-group key: the premise and the instruction; absent/null instruction is its own value."""
    ins = row.get("instruction")
    return (row["premise"], ins is not None, ins if ins is not None else "")


def option_groups(inputs: Sequence[dict]) -> tuple[list[list[int]], int]:
    """Row indices of every option group (>= 2 rows, in first-appearance order) and the singleton count."""
    by_key: dict[tuple, list[int]] = {}
    for i, row in enumerate(inputs):
        by_key.setdefault(group_key(row), []).append(i)
    groups = [idx for idx in by_key.values() if len(idx) > 1]
    singletons = sum(1 for idx in by_key.values() if len(idx) == 1)
    return groups, singletons


def argmax_set(values: np.ndarray, idx: Sequence[int]) -> list[int]:
    """Every index of `idx` whose value equals the maximum over `idx` exactly (input order kept)."""
    best = max(values[i] for i in idx)
    return [i for i in idx if values[i] == best]


def audit_pass(groups: Sequence[Sequence[int]], ref_pe: np.ndarray, cand_pe: np.ndarray,
               row_ids: Sequence[str]) -> dict:
    """Group audit of one pass (rules in the module docstring)."""
    failures, ties = [], []
    ref_tied = cand_tied = 0
    for g, idx in enumerate(groups):
        winners = argmax_set(ref_pe, idx)
        chosen = argmax_set(cand_pe, idx)
        ref_tied += len(winners) > 1
        cand_tied += len(chosen) > 1
        outside = [i for i in chosen if i not in winners]
        if outside:
            failures.append({
                "group": g, "rows": [row_ids[i] for i in idx],
                "reference_winners": [row_ids[i] for i in winners],
                "candidate_choice": [row_ids[i] for i in chosen],
                "outside_winners": [row_ids[i] for i in outside],
                "reference_margin": float(ref_pe[winners[0]] - max(ref_pe[i] for i in outside)),
                "candidate_margin": float(max(cand_pe[i] for i in outside) - max(cand_pe[i] for i in winners)),
                "p_e_reference": {row_ids[i]: float(ref_pe[i]) for i in idx},
                "p_e_candidate": {row_ids[i]: float(cand_pe[i]) for i in idx},
            })
        elif len(winners) > 1 and chosen[0] != winners[0]:
            ties.append({"group": g, "rows": [row_ids[i] for i in idx],
                         "reference_winners": [row_ids[i] for i in winners],
                         "reference_choice": row_ids[winners[0]], "candidate_choice": row_ids[chosen[0]]})
    return {
        "groups": len(groups), "rows_in_groups": int(sum(len(i) for i in groups)),
        "failures_count": len(failures), "ties_count": len(ties),
        "reference_tied_groups": int(ref_tied), "candidate_tied_groups": int(cand_tied),
        "passed": not failures, "failures": failures, "ties": ties,
    }


def decide_exit(audit_failed: bool, server_failure: bool, exclusive_valid: bool | None) -> int:
    """Exit status from the run's outcome; precedence 2 (audit) > 4 (incomplete) > 3 (exclusivity)."""
    if audit_failed:
        return EXIT_AUDIT
    if server_failure:
        return EXIT_INCOMPLETE
    if exclusive_valid is False:
        return EXIT_EXCLUSIVE
    return EXIT_OK


def timing_summary(entries: list[dict], n_rows: int) -> dict:
    measured = [e for e in entries if e["kind"] == "measured" and e["complete"]]
    walls = [e["wall_s"] for e in measured]
    lat = [x for e in measured for x in e["batch_latencies_s"]]
    med = median_or_none(walls)
    cpu = sum(e["client_cpu_s"] for e in measured)
    initial = next((e for e in entries if e["kind"] == "initial" and e["complete"]), None)
    return {
        "measured_passes": len(measured),
        "wall_s": walls,
        "median_wall_s": med,
        "min_wall_s": min(walls) if walls else None,
        "max_wall_s": max(walls) if walls else None,
        "pairs_per_s": (n_rows / med) if med else None,
        "batch_latency_s": percentile_summary(lat),
        "client_cpu_s": cpu if measured else None,
        "client_overhead_fraction": (cpu / sum(walls)) if walls and sum(walls) > 0 else None,
        "initial_pass_wall_s": initial["wall_s"] if initial else None,
        "retries": sum(e["retries"] for e in entries),
        "retried_passes": [e["index"] for e in entries if e["retries"]],
        "definition": "wall: first request sent -> last response received, per pass; median over the measured "
                      "passes (the initial pass excluded); pairs/s = rows / median wall; batch latency: send -> "
                      "response of each request (retries included), over the measured passes, linear percentiles; "
                      "client overhead: CPU seconds of the bench process during the passes / their wall seconds "
                      "(request bodies are encoded once, before the first pass)",
    }
