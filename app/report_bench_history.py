#!/usr/bin/env python3
"""Report over the history of scheduled benchmark runs (app/bench_scheduled_v100.py), with a verdict.

Reads DIR/runs/*/run.json and each run's bench receipts (DIR/runs/RUN/tune/scheduled/SET.MODE.json,
written by app/bench_classify_v100.py through app/tune_sglang_v100.py) and prints one row per run:
run, complete, valid, and per set and mode the median pass wall time (s), NLI argmax changes,
max |dp_e| and the group audit.

A run is COMPLETE when its run.json says complete: true (the scheduler marks it only at the very end;
a run killed midway stays complete: false, and an unreadable run.json counts as incomplete). A run is
VALID when it is complete, the tuner exited 0 and every receipt is an openjev-bench receipt that is
valid (GPU exclusivity held where monitored), complete, with a median and a passed group audit.

Verdict for the newest run (or --run NAME):
  * INCOMPLETE, not judged, when its run.json does not say complete (killed, or still running);
  * UNREADABLE, not judged, when its run.json has a schema_version other than this bundle's (1);
  * REGRESSION when the run is invalid (a receipt missing, invalid or incomplete, an array it names
    missing or altered, the tuner failed), on any NLI argmax change against the reference, max |dp_e|
    above --max-dp-e (default 0.02; the runbook's eva01 runs reached 0.012851), a group-audit failure,
    or a set+mode median above the band: baseline median + the largest of k x MAD of the baseline
    medians, k x the runs' own pass noise (median of each run's MAD over its measured passes) and
    floor x baseline median, where the baseline is the last N complete and valid runs before it
    (defaults N=5, k=4, floor=0.10);
  * with fewer than --min-baseline-runs (default 3) baseline runs, timing is not judged ("insufficient
    baseline"); correctness is.
Incomplete or invalid runs never enter a baseline; the verdict notes each one it skipped and why.
Folders under runs/ not named as the scheduler names runs (a copy, a backup) are ignored, with a note.

--plot PNG draws each set+mode's median over the runs (matplotlib, Agg); --reference-lines JSON
{"LABEL": seconds, ...} adds horizontal reference lines (e.g. the runbook's eva01 medians,
benchmarks/results_cpu/eva01_reference_lines.json; those are V100 figures, not CPU ones).

Exit status: 0 no regression (or insufficient baseline); 3 regression; 4 incomplete; 5 unreadable;
1 bad input or an output that cannot be written (one line on stderr).

Example:
  report_bench_history.py --history /var/lib/openjev/bench-history --plot medians.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from openjev.common import UserError, atomic_write_json, run_main
from openjev.history import (DEFAULTS, exit_status, format_table, format_verdict, load_history,
                             load_reference_lines, stray_entries, verdict, write_plot)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=Path, required=True, help="history directory (holds runs/)")
    p.add_argument("--run", default=None, help="run to judge (folder name under runs/; default: the newest)")
    p.add_argument("--baseline-runs", type=int, default=DEFAULTS["baseline_runs"],
                   help="N: complete and valid runs before it that form the baseline (default: 5)")
    p.add_argument("--min-baseline-runs", type=int, default=DEFAULTS["min_baseline_runs"],
                   help="fewer baseline runs than this: timing is not judged (default: 3)")
    p.add_argument("--mad-k", type=float, default=DEFAULTS["mad_k"], help="k of the noise band median + k x MAD (default: 4)")
    p.add_argument("--rel-floor", type=float, default=DEFAULTS["rel_floor"],
                   help="least band width as a fraction of the baseline median (default: 0.10)")
    p.add_argument("--max-dp-e", type=float, default=DEFAULTS["max_dp_e"], help="bound on max |dp_e| (default: 0.02)")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG", help="write a plot of the medians over the runs")
    p.add_argument("--reference-lines", type=Path, default=None, metavar="JSON",
                   help='JSON {"LABEL": seconds} drawn as horizontal lines on --plot')
    p.add_argument("--json", type=Path, default=None, help="also write the table and verdict as JSON here")
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.baseline_runs < 1 or args.min_baseline_runs < 1 or args.mad_k < 0 or args.rel_floor < 0 or args.max_dp_e < 0:
        raise UserError("--baseline-runs and --min-baseline-runs must be >= 1 and --mad-k, --rel-floor, --max-dp-e >= 0")
    ref_lines = load_reference_lines(args.reference_lines)
    runs = load_history(args.history)
    if not runs:
        raise UserError(f"--history {args.history}: no runs")
    names = [r["name"] for r in runs]
    if args.run is not None and args.run not in names:
        raise UserError(f"--run {args.run}: not in {args.history}/runs")
    idx = names.index(args.run) if args.run else -1
    v = verdict(runs, idx, baseline_runs=args.baseline_runs, min_baseline_runs=args.min_baseline_runs,
                mad_k=args.mad_k, rel_floor=args.rel_floor, max_dp_e=args.max_dp_e)
    print(format_table(runs))
    for stray in stray_entries(args.history):
        print(f"note: runs/{stray} is not a run (not named as the scheduler names runs); ignored")
    print(format_verdict(v))
    if args.plot:
        write_plot(runs, args.plot, ref_lines)
    if args.json:
        from openjev.receipts import BenchHistory, check_receipt

        report = {"kind": "openjev-bench-history", "schema_version": 1, "runs": runs, "verdict": v}
        check_receipt(BenchHistory, report, args.json)
        try:
            atomic_write_json(args.json, report)
        except OSError as exc:
            raise UserError(f"--json {args.json}: cannot write it: {exc.strerror or exc}") from None
    return exit_status(v)


if __name__ == "__main__":
    run_main(main)
