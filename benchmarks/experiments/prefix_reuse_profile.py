#!/usr/bin/env python3
"""Where prefix reuse's time goes, in process (a benchmark, not a test): the embedded backend's
padded path and its prefix-reuse path (openjev/engine/prefix.py) over the same set, steps formed as
the server forms them (requests of --batch rows, --workers of them pending, plan_step under the
step token budget, a prefix-reuse row costing what it computes), without HTTP.

  padded          the default path (bitwise the reference on a GPU)
  prefix_flushed  prefix reuse, the state cache emptied before each pass
  prefix_warm     prefix reuse, the cache kept from the passes before
  prefix_nocache  prefix reuse without a cache (shared prefixes within a step only)

Each mode: one untimed pass, then --passes timed passes (device synchronized), tokens the forwards
ran, and against the padded path's logits the largest entailment-probability difference and argmax
changes. Then torch.profiler tables of one flushed and one warm pass, with the prefix path's phases
(openjev.prefix.body/continued/tail, cache_build, states) and the device's busy share of the wall time;
with --host-profile, cProfile of one flushed and one warm pass (the host's time by Python function).
With --divergence-rows: those rows' exact forwards against the prefix path's two forwards (the
prefix up to the last chunk boundary, keeping states, then the tail from them), module by module
(projections, GDN core and attention outputs, mixers, MLPs, layers) in execution order, so the
first module whose output leaves the exact forward's is named.

  python3 benchmarks/experiments/prefix_reuse_profile.py --model W/model --tokens W/set.tokens.jsonl --out OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
from gpu_profile import base_parser, prof_tables, sync

from openjev.common import entailment_prob, read_tokens, truncate_rows

MODES = ("padded", "prefix_flushed", "prefix_warm", "prefix_nocache")


def positive_ints(text: str) -> list[int]:
    """A comma list of positive integers (argparse type)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of positive integers, e.g. 1024,4096")
    return values


def build_parser():
    p = base_parser(__doc__)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="rows a request (default 32)")
    p.add_argument("--workers", type=int, default=4, help="requests pending at once (default 4)")
    p.add_argument("--max-rows", type=int, default=16, help="rows a forward (--max-running-requests)")
    p.add_argument("--step-tokens", type=int, default=65536, help="step token budget")
    p.add_argument("--cache-mb", type=int, default=49152)
    p.add_argument("--forward-rows", type=int, default=None,
                   help="rows any prefix-path forward may hold, tail forwards included (default: the engine's "
                        "PREFIX_FORWARD_ROWS and PREFIX_TAIL_FORWARD_ROWS)")
    p.add_argument("--forward-costs", type=positive_ints, default=[],
                   help="comma list of padded tokens one more forward is counted as when a phase's rows are cut into "
                        "padded forwards, tail phases apart (default: the engine's PREFIX_FORWARD_COST_TOKENS; packed forwards, "
                        "OPENJEV_PACKED_LAYOUT, are cut by rows and tokens alone); each value runs "
                        "the prefix modes again, named MODE@VALUE")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--stacks", type=int, default=0, metavar="ROWS",
                   help="add to the profile tables ROWS rows of operators grouped by the Python stack that called them")
    p.add_argument("--trace", action="store_true",
                   help="also write each profiled pass's Chrome trace (trace_prefix_flushed.json.gz, ...)")
    p.add_argument("--host-profile", action="store_true",
                   help="also cProfile one flushed and one warm pass (host_profile_flushed.txt, host_profile_warm.txt): "
                        "the host's time by Python function, and who called the device-synchronising methods; and the "
                        "Python stacks of every operation that waits for the device (device_syncs_flushed.txt, ...)")
    p.add_argument("--divergence-rows", default="", help="comma list of row indices for the module comparison")
    return p


# (module name suffix, hook on the input instead of the output)
WATCHED = (("linear_attn.in_proj_qkv", False), ("linear_attn.norm", True), ("linear_attn", False),
           ("self_attn.q_proj", False), ("self_attn.o_proj", True), ("self_attn", False), ("mlp", False))


def divergence(clf, forwards, rows, picks) -> dict:
    """Module outputs of each picked row's exact forward vs the prefix path's: a forward of the rows'
    prefixes (to the last 64-token boundary, keeping states) and one of their tails from those states."""
    from openjev.engine.classifier import score_exact
    from openjev.engine.prefix import GDN_CHUNK

    mods = {n: m for n, m in clf.model.named_modules() if ".layers." in n and (
        n.rsplit(".", 1)[-1].isdigit() or any(n.endswith("." + w) for w, _ in WATCHED))}
    kept, worst, mode = {}, {}, {"row": None, "phase": None, "spans": None, "width": 0}

    def hook(name, on_input):
        def fn(_m, args, out=None):
            t = args[0] if on_input else (out[0] if isinstance(out, tuple) else out)
            if mode["row"] is not None:
                kept[(mode["row"], name)] = t.detach().reshape(-1, t.shape[-1]).clone()
                return
            t = t.detach().reshape(len(mode["spans"]), mode["width"], -1)
            for j, (i, start, n) in enumerate(mode["spans"]):
                ref = kept[(i, name)]
                per_tok = ref.shape[0] // len(rows[i])
                ref = ref.reshape(len(rows[i]), per_tok * ref.shape[-1])[start:start + n]
                got = t[j, :n]
                d = float((got.float() - ref.float()).abs().max())
                key = (mode["phase"], name)
                worst[key] = max(worst.get(key, 0.0), d)
        return fn

    handles = []
    for n, m in mods.items():
        on_input = next((o for w, o in WATCHED if n.endswith("." + w)), False)
        handles.append(m.register_forward_pre_hook(hook(n, True)) if on_input else m.register_forward_hook(hook(n, False)))
    try:
        for i in picks:
            mode["row"] = i
            score_exact(clf, [rows[i]])
        mode["row"] = None
        cuts = [(len(rows[i]) - 1) // GDN_CHUNK * GDN_CHUNK for i in picks]
        mode.update(phase="prefix", spans=[(i, 0, c) for i, c in zip(picks, cuts)], width=max(cuts))
        _, states = forwards.run([(None, rows[i][:c], len(rows[i])) for i, c in zip(picks, cuts)], True)
        tails = [len(rows[i]) - c for i, c in zip(picks, cuts)]
        mode.update(phase="tail", spans=[(i, c, n) for i, c, n in zip(picks, cuts, tails)], width=max(tails))
        forwards.run([(st, rows[i][c:], len(rows[i])) for i, c, st in zip(picks, cuts, states)], False)
        sync(clf.device)
    finally:
        for h in handles:
            h.remove()
    order = list(dict.fromkeys(worst))  # execution order
    out = {"rows": picks, "cuts": cuts,
           "modules": [{"phase": ph, "module": n, "max_abs_diff": worst[(ph, n)]} for ph, n in order]}
    for ph in ("prefix", "tail"):
        first = next((e for e in out["modules"] if e["phase"] == ph and e["max_abs_diff"] > 0), None)
        out[f"first_differing_{ph}"] = first
    return out


def plan_cost(eng):
    """The prefix engine's cost of rows a plan (a baseline tree's engine may cost each row alone, by its
    step_tokens)."""
    return getattr(eng, "step_cost", None) or (lambda: eng.step_tokens)


def server_steps(rows, batch: int, workers: int, budget: int, step_cost=lambda: len):
    """Row indices of each step, as the server's scheduler plans them for `workers` clients that each
    send requests of `batch` rows and send the next when one is answered: each step planned when the
    one before it has run (a generator), with the cost the server gives a row in a plan (`step_cost()`
    makes one a plan: its length, or with prefix reuse PrefixEngine.step_cost)."""
    from openjev.engine.scheduler import plan_step

    jobs = [SimpleNamespace(rows=rows[i:i + batch], base=i, cursor=0, cancelled=False, served_tokens=0)
            for i in range(0, len(rows), batch)]
    pending, queue = jobs[:workers], jobs[workers:]
    while pending:
        yield [job.base + k for job, k in plan_step(pending, budget, step_cost())]
        for _ in range(sum(j.cursor >= len(j.rows) for j in pending)):  # each answered client sends again
            if queue:
                pending.append(queue.pop(0))
        pending = [j for j in pending if j.cursor < len(j.rows)]


# Tensor methods that wait for the device (or copy from the host) when called on device tensors.
SYNCING = r"method '(cpu|item|tolist|to|nonzero|numpy)' of 'torch._C.TensorBase'|built-in method (tensor|as_tensor) "


def host_profile(fn, device, path) -> dict:
    """cProfile of `fn` (the host's time by Python function): the top functions by own time and by
    cumulative time, and the callers of the methods that synchronise with the device."""
    import cProfile
    import io
    import pstats

    sync(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    sync(device)
    prof.disable()
    wall = time.perf_counter() - t0
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    buf.write(f"# wall {wall:.4f} s under cProfile\n# by own time\n")
    stats.sort_stats("tottime").print_stats(45)
    buf.write("# by cumulative time\n")
    stats.sort_stats("cumulative").print_stats(45)
    buf.write("# callers of the synchronising methods\n")
    stats.print_callers(SYNCING)
    path.write_text(buf.getvalue())
    return {"wall_s": round(wall, 4), "calls": stats.total_calls}


def device_syncs(fn, device, path) -> dict:
    """Every operation of `fn` that makes the host wait for the device (torch.cuda's sync debug mode),
    by the Python stack that called it, most frequent first; on a CPU there are none to find."""
    import traceback
    import warnings

    if not str(device).startswith("cuda"):
        path.write_text(f"# {device}: no device to wait for\n")
        return {"syncs": None}
    import torch

    found = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" not in str(message):  # e.g. the debug mode's own note that it is a prototype
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        found[(str(message).splitlines()[0], "".join(traceback.format_list(frames[-8:])))] += 1

    sync(device)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)
    text = [f"# {sum(found.values())} synchronising operations, {len(found)} call sites"]
    for (message, stack), n in found.most_common():
        text += [f"## {n} x {message}", stack]
    path.write_text("\n".join(text) + "\n")
    return {"syncs": sum(found.values()), "sites": len(found)}


def run_pass(step_fn, rows, steps, device):
    logits = np.empty((len(rows), 3), dtype=np.float32)
    computed = padded = forwards = count = 0
    sync(device)
    t0 = time.perf_counter()
    for step in steps:
        res = step_fn([rows[i] for i in step])
        logits[step] = res.logits
        computed += res.computed_tokens
        padded += res.padded_tokens
        forwards += res.forwards
        count += 1
    sync(device)
    return time.perf_counter() - t0, logits, computed, padded, forwards, count


def main() -> int:
    args = build_parser().parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from openjev.engine import prefix
    from openjev.engine.batching import forward_rows
    from openjev.engine.classifier import load_classifier
    from openjev.engine.kernels import kernel_path
    from openjev.engine.prefix import PrefixEngine
    from openjev.engine.warmup import prepare_serving

    if args.forward_rows:
        prefix.PREFIX_FORWARD_ROWS = prefix.PREFIX_TAIL_FORWARD_ROWS = args.forward_rows
    clf = load_classifier(args.model, args.device)
    prepare_serving(clf, "padded", args.max_rows)
    _, rows = read_tokens(args.tokens)
    rows, _ = truncate_rows(rows, 4096)
    steps = list(server_steps(rows, args.batch, args.workers, args.step_tokens))  # by length (a cold pass)
    res = {"tokens_file": str(args.tokens), "rows": len(rows), "tokens": sum(map(len, rows)),
           "steps": [len(s) for s in steps], "kernel_path": kernel_path(clf.model),
           "prefix_forward_rows": prefix.PREFIX_FORWARD_ROWS,
           "prefix_tail_forward_rows": prefix.PREFIX_TAIL_FORWARD_ROWS, "modes": {}}
    print(f"{len(rows)} rows, {res['tokens']} tokens, {len(steps)} steps of {res['steps']} rows", flush=True)
    engines = {"prefix_flushed": PrefixEngine(clf, args.cache_mb << 20), "prefix_nocache": PrefixEngine(clf, 0)}
    engines["prefix_warm"] = engines["prefix_flushed"]
    res["packed_layout"] = engines["prefix_flushed"].stats()["packed_layout"]  # packed forwards ignore the cost
    base = None
    engine_cost = prefix.PREFIX_FORWARD_COST_TOKENS  # the profile and the module comparison run with it
    costs = args.forward_costs or [engine_cost]
    res["prefix_forward_cost_tokens"] = engine_cost
    # a baseline tree's engine may cut tails at the one cost
    res["prefix_tail_forward_cost_tokens"] = getattr(prefix, "PREFIX_TAIL_FORWARD_COST_TOKENS", engine_cost)
    runs = [(m, None) for m in args.modes.split(",") if m == "padded"] + [
        (m, c) for c in costs for m in args.modes.split(",") if m != "padded"]
    for mode, cost_tokens in runs:
        name = mode if cost_tokens is None or len(costs) == 1 else f"{mode}@{cost_tokens}"
        if mode == "padded":
            step_fn = lambda r: forward_rows(clf, r, "padded", args.max_rows)  # noqa: E731
            step_cost = lambda: len  # noqa: E731
        else:
            eng = engines[mode]
            eng.forward_cost = cost_tokens
            step_fn = lambda r, eng=eng: eng.run_step(r, args.max_rows)  # noqa: E731
            step_cost = plan_cost(eng)
        out = []
        for k in range(1 + args.passes):
            if mode == "prefix_flushed":
                eng.cache.clear()
            sec, logits, computed, padded, forwards, count = run_pass(
                step_fn, rows, server_steps(rows, args.batch, args.workers, args.step_tokens, step_cost), args.device)
            out.append({"seconds": round(sec, 4), "computed_tokens": computed, "padded_tokens": padded,
                        "forwards": forwards, "steps": count})
        if mode == "padded":
            base = logits
        m = {"passes": out, "median_s": round(statistics.median(p["seconds"] for p in out[1:]), 4)}
        if base is not None and mode != "padded":
            m["max_abs_dp_e"] = float(np.abs(entailment_prob(logits) - entailment_prob(base)).max())
            m["argmax_changes"] = int((logits.argmax(1) != base.argmax(1)).sum())
        res["modes"][name] = m
        print(name, json.dumps({k: v for k, v in m.items() if k != "passes"}), out[-1], flush=True)
    for eng in engines.values():
        eng.forward_cost = engine_cost
    eng = engines["prefix_flushed"]

    def one_pass(flush: bool):
        """A pass of the prefix path as the server forms its steps, the cache emptied first if `flush`."""
        if flush:
            eng.cache.clear()
        planned = server_steps(rows, args.batch, args.workers, args.step_tokens, plan_cost(eng))
        return lambda: [eng.run_step([rows[i] for i in s], args.max_rows) for s in planned]

    if not args.no_profile:
        for name, flush in (("flushed", True), ("warm", False)):
            t0 = time.perf_counter()
            summary = prof_tables(one_pass(flush), args.device, args.out / f"profile_prefix_{name}.txt", rows=40,
                                  stack_rows=args.stacks,
                                  trace=args.out / f"trace_prefix_{name}.json.gz" if args.trace else None)
            summary["wall_us"] = round((time.perf_counter() - t0) * 1e6)
            res[f"profile_prefix_{name}"] = summary
            print(name, "device busy", summary.get("device_us_total"), "of wall", summary["wall_us"], flush=True)
        res["prefix_cache"] = eng.cache.stats()
    if args.host_profile:
        for name, flush in (("flushed", True), ("warm", False)):
            res[f"host_profile_{name}"] = host_profile(one_pass(flush), args.device, args.out / f"host_profile_{name}.txt")
            res[f"host_profile_{name}"].update(
                device_syncs(one_pass(flush), args.device, args.out / f"device_syncs_{name}.txt"))
            print(name, "host profile", res[f"host_profile_{name}"], flush=True)
    if args.divergence_rows:
        picks = [int(i) for i in args.divergence_rows.split(",")]
        res["divergence"] = divergence(clf, engines["prefix_nocache"].forwards, rows, picks)
        print("first differing:", res["divergence"]["first_differing_prefix"], res["divergence"]["first_differing_tail"],
              flush=True)
    (args.out / "prefix_reuse_profile.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
