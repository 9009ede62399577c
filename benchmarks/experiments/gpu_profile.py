#!/usr/bin/env python3
"""Where the embedded backend's and the reference scorer's time goes (a benchmark, not a test).

Loads the classifier through openjev/engine/classifier.py (kernel choice of openjev/engine/kernels.py, recorded),
then on one input set:

  exact     one unpadded forward per row, as score_reference.py: rows never seen before
            ("cold"), the same rows again ("warm"), then new rows, each timed alone; the same
            with cuDNN disabled when --cudnn-ab is given (is a per-length cost cuDNN's?)
  profile   torch.profiler tables of one cold and one warm exact forward, and of one padded
            forward, sorted by self CPU and by self device time
  padded    whole-set passes of length-sorted padded forwards under several token budgets
            (rows x longest row <= budget), with the fraction of the fp16 matmul peak measured
            in the same run

Writes OUT/profile.json and OUT/profile_*.txt. Example (GPU machine):
  python3 benchmarks/experiments/gpu_profile.py --model W/model-qwen3.5-4b --tokens W/set.tokens.jsonl --out OUT
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from openjev.common import read_tokens, truncate_rows


def base_parser(doc: str, out_help: str = "directory (created)") -> argparse.ArgumentParser:
    """The arguments every GPU benchmark script takes: model, token file, output, device."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="model (or overlay) directory")
    p.add_argument("--tokens", type=Path, required=True, help="token file (JSONL {id, input_ids})")
    p.add_argument("--out", type=Path, required=True, help=out_help)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = base_parser(__doc__)
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--exact-rows", type=int, default=12, help="rows per exact group (default 12)")
    p.add_argument("--budgets", default="16384,32768,65536", help="token budgets of the padded passes")
    p.add_argument("--padded-repeats", type=int, default=2)
    p.add_argument("--cudnn-ab", action="store_true", help="also time exact rows with cuDNN disabled")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--full-exact", action="store_true", help="also time one exact pass over the whole set")
    p.add_argument("--compile-budgets", default="", help="after the padded passes, torch.compile the norm/MLP "
                   "modules (openjev/engine/kernels.py compile_pointwise) and time these budgets again")
    return p


def sync(device):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_exact(clf, rows, device):
    from openjev.engine.classifier import score_exact

    out = []
    for r in rows:
        sync(device)
        t0 = time.perf_counter()
        score_exact(clf, [r])
        sync(device)
        out.append(round((time.perf_counter() - t0) * 1000, 2))
    return out


def budget_groups(lengths: list[int], budget: int, max_rows: int | None = None) -> list[list[int]]:
    """Length-sorted forwards of at most `budget` padded tokens (rows x longest row) and, when
    given, at most `max_rows` rows, as the embedded server's scheduler forms them."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups, cur = [], []
    for i in order:
        if cur and ((max_rows is not None and len(cur) + 1 > max_rows) or (len(cur) + 1) * lengths[i] > budget):
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


def time_padded_passes(clf, rows, groups, passes, device):
    """Wall seconds of each of `passes` whole-set passes of padded forwards, one per group of row indices."""
    from openjev.engine.classifier import score_padded

    times = []
    for _ in range(passes):
        sync(device)
        t1 = time.perf_counter()
        for g in groups:
            score_padded(clf, [rows[i] for i in g])
        sync(device)
        times.append(time.perf_counter() - t1)
    return times


# the code's own labelled ranges (torch.profiler.record_function "openjev.*"), reported with their children
RANGE_PREFIX = "openjev."


STACK_FRAMES = 6  # frames of the calling Python stack that group the operators in prof_tables' stack table
SITE_PACKAGES = ("openjev/", "transformers/", "fla/")  # where a call site is named in prof_tables' site table


def site_table(events, sort: str, rows: int) -> list[str]:
    """Lines of operator time summed by (operator, innermost stack frame in SITE_PACKAGES): the stack
    table splits one call site over every module instance that passes through it."""
    from collections import defaultdict

    total: dict = defaultdict(float)
    calls: dict = defaultdict(int)
    for e in events:
        t = getattr(e, sort, 0) or 0
        if t <= 0 or not e.stack or ".py(" in e.key:  # Python functions' own events are not operators
            continue
        site = next((f for f in e.stack if any(p in f for p in SITE_PACKAGES)), e.stack[0])
        total[(e.key, site)] += t
        calls[(e.key, site)] += e.count
    grand = sum(total.values()) or 1
    out = [f"{'us':>12} {'share':>6} {'calls':>7}  operator @ site"]
    for (name, site), t in sorted(total.items(), key=lambda kv: -kv[1])[:rows]:
        out.append(f"{t:12.1f} {t / grand:6.3f} {calls[(name, site)]:7d}  {name[:60]} @ {site}")
    return out


def prof_tables(fn, device, path: Path, rows=30, stack_rows=0, trace: Path | None = None):
    """torch.profiler tables of `fn` by operator (self CPU time, self device time) into `path`; with
    `stack_rows`, also that many rows of operators grouped by the Python stack that called them (the
    last STACK_FRAMES frames), by self device time (self CPU time on a CPU); with `trace`, the
    profiler's Chrome trace there, gzipped. Returns a summary."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    sync(device)
    # stacks reach the events only with the verbose experimental config (torch 2.11-2.13)
    extra = {"with_stack": True, "experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True)} \
        if stack_rows else {}
    with profile(activities=acts, **extra) as prof:
        fn()
        sync(device)
    if trace is not None:
        raw = trace.with_suffix("")  # NAME.json from NAME.json.gz
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    ka = prof.key_averages()
    text = ["# sorted by self CPU time", ka.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70)]
    if device.startswith("cuda"):
        text += ["# sorted by self device time", ka.table(sort_by="self_cuda_time_total", row_limit=rows,
                                                             max_name_column_width=70)]
    if stack_rows:
        by_stack = prof.key_averages(group_by_stack_n=STACK_FRAMES)
        text += [f"# by call site: operators' self {'device' if sort.startswith('self_cuda') else 'CPU'} time summed by the "
                 f"innermost frame in {', '.join(SITE_PACKAGES)} (module instances merged)",
                 *site_table(by_stack, sort, stack_rows),
                 f"# by calling Python stack ({STACK_FRAMES} frames), sorted by {sort}",
                 by_stack.table(sort_by=sort, row_limit=stack_rows, max_name_column_width=70)]
    path.write_text("\n".join(text))
    summary = {"events": len(ka)}
    if device.startswith("cuda"):
        # kernels only: a labelled range's device time is the span of the kernels inside it
        dev = [(e.key, getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)), e.count)
               for e in ka if not e.key.startswith(RANGE_PREFIX)]
        total = sum(t for _, t, _ in dev) or 1
        cats = {"gemm": 0, "fla_triton": 0, "attention": 0, "conv": 0, "other": 0}
        for name, t, _ in dev:
            n = name.lower()
            if any(s in n for s in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul")):
                cats["gemm"] += t
            elif "chunk" in n or "kernel" == n[-6:] and "fla" in n or "l2norm" in n or "solve_tril" in n or "recompute" in n:
                cats["fla_triton"] += t
            elif "flash" in n or "fmha" in n or "attention" in n:
                cats["attention"] += t
            elif "conv" in n:
                cats["conv"] += t
            else:
                cats["other"] += t
        summary["device_us_total"] = round(total, 1)
        summary["device_share"] = {k: round(v / total, 3) for k, v in cats.items()}
        summary["top_device"] = sorted(([k, round(t, 1), c] for k, t, c in dev), key=lambda x: -x[1])[:25]
        summary["kernel_launches"] = sum(c for k, t, c in dev if t > 0)
    summary["ranges"] = {e.key: {"cpu_us": round(e.cpu_time_total, 1), "count": e.count,
                                 "device_us": round(getattr(e, "device_time_total", 0), 1)}
                         for e in ka if e.key.startswith(RANGE_PREFIX)}
    cpu = sorted(((e.key, e.self_cpu_time_total, e.count) for e in ka), key=lambda x: -x[1])[:25]
    summary["top_cpu"] = [[k, round(t, 1), c] for k, t, c in cpu]
    return summary


def main() -> int:
    args = build_parser().parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    from openjev.engine.classifier import load_classifier, score_exact, score_padded
    from openjev.engine.flops import measure_matmul_peak, model_flops
    from openjev.engine.kernels import kernel_path, path_label

    res: dict = {"tokens_file": str(args.tokens)}
    t0 = time.perf_counter()
    peak = measure_matmul_peak(args.device, "float16" if args.device.startswith("cuda") else "float32")
    res["peak_tflops"] = round(peak, 1)
    clf = load_classifier(args.model, args.device)
    res["load_s"] = round(time.perf_counter() - t0, 1)
    res["kernel_path"] = kernel_path(clf.model)
    print(f"kernel path {path_label(res['kernel_path'])}; peak {peak:.0f} TFLOP/s; load {res['load_s']} s", flush=True)
    _, rows = read_tokens(args.tokens)
    rows, _ = truncate_rows(rows, 4096)
    n = args.exact_rows

    # ---- exact forwards
    ex = {}
    ex["cold_first"] = time_exact(clf, rows[:n], args.device)
    ex["warm_same"] = time_exact(clf, rows[:n], args.device)
    ex["cold_new"] = time_exact(clf, rows[n:2 * n], args.device)
    ex["lengths_first"] = [len(r) for r in rows[:n]]
    ex["lengths_new"] = [len(r) for r in rows[n:2 * n]]
    if args.cudnn_ab:
        torch.backends.cudnn.enabled = False
        ex["nocudnn_cold_new"] = time_exact(clf, rows[2 * n:3 * n], args.device)
        ex["nocudnn_warm_same"] = time_exact(clf, rows[2 * n:3 * n], args.device)
        torch.backends.cudnn.enabled = True
    for k in list(ex):
        if not k.startswith("lengths"):
            ex[k + "_median_ms"] = statistics.median(ex[k])
    res["exact"] = ex
    print(json.dumps({k: v for k, v in ex.items() if k.endswith("median_ms")}), flush=True)

    if not args.no_profile:
        res["profile_exact_cold"] = prof_tables(lambda: score_exact(clf, [rows[3 * n]]), args.device,
                                                args.out / f"profile_exact_cold{args.tag}.txt")
        res["profile_exact_warm"] = prof_tables(lambda: score_exact(clf, [rows[3 * n]]), args.device,
                                                args.out / f"profile_exact_warm{args.tag}.txt")

    if args.full_exact:  # the reference scorer's loop over the whole set, after the rows above
        sync(args.device)
        t1 = time.perf_counter()
        score_exact(clf, rows)
        sync(args.device)
        res["exact_full_pass_s"] = round(time.perf_counter() - t1, 3)
        res["exact_rows_per_s"] = round(len(rows) / res["exact_full_pass_s"], 2)
        print(f"exact pass {res['exact_full_pass_s']} s = {res['exact_rows_per_s']} rows/s", flush=True)

    # ---- padded passes
    lengths = [len(r) for r in rows]
    real = sum(lengths)
    flops = model_flops(args.model, real)
    res["tokens"] = real
    res["model_flops_per_pass"] = flops
    padded = {}
    for budget in [int(b) for b in args.budgets.split(",") if b]:
        groups = budget_groups(lengths, budget)
        times = time_padded_passes(clf, rows, groups, 1 + args.padded_repeats, args.device)
        sec = statistics.median(times[1:])  # the first pass is a warm-up
        padded[str(budget)] = {"forwards": len(groups), "padded_tokens": sum(len(g) * max(lengths[i] for i in g) for g in groups),
                               "pass_s": round(sec, 3), "pairs_per_s": round(len(rows) / sec, 1),
                               "fraction_of_peak": round(flops / sec / 1e12 / peak, 3)}
        print(f"padded budget {budget}: {padded[str(budget)]}", flush=True)
    res["padded"] = padded
    if args.compile_budgets:
        from openjev.engine.kernels import compile_pointwise

        compile_pointwise(clf.model)
        comp = {}
        for budget in [int(b) for b in args.compile_budgets.split(",") if b]:
            groups = budget_groups(lengths, budget)
            times = time_padded_passes(clf, rows, groups, 1 + args.padded_repeats, args.device)
            sec = statistics.median(times[1:])
            comp[str(budget)] = {"first_pass_s": round(times[0], 2), "pass_s": round(sec, 3),
                                 "pairs_per_s": round(len(rows) / sec, 1),
                                 "fraction_of_peak": round(flops / sec / 1e12 / peak, 3)}
            print(f"compiled, budget {budget}: {comp[str(budget)]}", flush=True)
        res["padded_compiled"] = comp
    if not args.no_profile and padded:
        budget = int(args.budgets.split(",")[1 if "," in args.budgets else 0])
        groups = budget_groups(lengths, budget)
        g = groups[len(groups) // 2]
        res["profile_padded"] = prof_tables(lambda: score_padded(clf, [rows[i] for i in g]), args.device,
                                            args.out / f"profile_padded{args.tag}.txt")
        res["profile_padded"]["rows"] = len(g)
        res["profile_padded"]["width"] = max(lengths[i] for i in g)
    (args.out / f"profile{args.tag}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    _ = np  # numpy is imported for the classifier's arrays
    return 0


if __name__ == "__main__":
    sys.exit(main())
