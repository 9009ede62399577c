#!/usr/bin/env python3
"""Variants of the exact reference loop and of the serving forwards, in one process, on
one input set (a benchmark, not a test). Every variant's logits are compared with the baseline
exact pass (the reference scorer's loop before this change), so a speed-up that moves a number is
visible next to its figure.

Exact variants (one unpadded row per forward, rows/s over the whole set):
  exact            score_exact as the reference scorer ran it until now (Transformers' default
                   use_cache, one device-to-host copy per row)
  exact_nocache    the same forward with use_cache=False (no cache object, no conv/recurrent
                   state written; the logits must stay bitwise equal)
  exact_async      openjev/engine/classifier.py score_exact: use_cache=False, logits left on the device and
                   copied once at the end
  exact_threadsN   score_exact(threads=N): N Python threads, a CUDA stream each, one model
Padded variants (rows of a forward length-sorted, at most --rows rows and --budget padded tokens,
as the embedded server's scheduler forms them; fraction of the fp16 matmul peak):
  padded           padded forwards with Transformers' default use_cache (before the change)
  padded_nocache   openjev/engine/classifier.py score_padded (use_cache=False)
  padded_fused     padded_nocache with openjev/engine/fused.py's kernels (only the pieces bitwise equal to
                   Transformers' modules on this device; the record is kept in the entry)
  compiled_pointwise  norm/MLP modules through torch.compile with Inductor's
                   emulate_precision_casts (eager's fp16 rounding kept inside fused kernels)
  compiled_layers  whole decoder layers compiled likewise, fla's chunk rule left out of the graph

Writes OUT/variants.json (kind openjev-embedded-gpu-variants) after every variant. Example (GPU machine):
  python3 benchmarks/experiments/embedded_gpu_variants.py --model W/model-qwen3.5-4b \\
    --tokens W/set.tokens.jsonl --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from gpu_profile import base_parser, budget_groups, prof_tables, sync

from openjev.common import environment_receipt, read_tokens, softmax, truncate_rows, utc_now

EXACT = ("exact", "exact_nocache", "exact_async", "exact_threads2", "exact_threads3")
PADDED = ("padded", "padded_nocache", "padded_fused", "compiled_pointwise", "compiled_layers")


def build_parser() -> argparse.ArgumentParser:
    p = base_parser(__doc__)
    p.add_argument("--variants", default=",".join(EXACT + PADDED), help="comma list, in order")
    p.add_argument("--rows", default="8,16", help="rows per padded forward to try (default 8,16)")
    p.add_argument("--budget", type=int, default=16384, help="padded tokens per forward (default 16384)")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per padded variant after one untimed")
    p.add_argument("--grouping", default="budget", choices=["budget", "dp"],
                   help="budget: consecutive length-sorted rows while rows x longest <= --budget; dp: the embedded "
                        "server's least-padding cuts over the whole set (openjev.engine.batching.length_groups, "
                        "--budget ignored) (default: budget)")
    p.add_argument("--profile", action="store_true",
                   help="after each padded variant, torch.profiler tables of one pass at the largest --rows "
                        "(OUT/profile_VARIANT.txt, summary in the entry)")
    p.add_argument("--machine-label", default=None,
                   help="what the machine is, recorded in the receipt (default: the device name, or 'cpu')")
    return p


def agreement(cand: np.ndarray, ref: np.ndarray) -> dict:
    pc, pr = softmax(cand), softmax(ref)
    return {"bitwise_equal": bool(np.array_equal(cand, ref)), "max_abs_logit_diff": float(np.abs(cand - ref).max()),
            "max_abs_dp_e": float(np.abs(pc[:, 1] - pr[:, 1]).max()), "max_abs_dp": float(np.abs(pc - pr).max()),
            "argmax_changes": int((pc.argmax(1) != pr.argmax(1)).sum())}


def forward_logits(clf, ids, mask=None, use_cache=None):
    kw = {} if use_cache is None else {"use_cache": use_cache}
    return clf.model(input_ids=ids, attention_mask=mask, **kw).logits


def exact_loop(clf, rows, use_cache=None) -> np.ndarray:
    """The reference loop before the batched host copy: one forward and one host copy per row."""
    import torch

    out = np.empty((len(rows), 3), dtype=np.float32)
    with torch.inference_mode():
        for i, row in enumerate(rows):
            ids = torch.tensor([row], dtype=torch.long, device=clf.device)
            out[i] = forward_logits(clf, ids, use_cache=use_cache)[0].float().cpu().numpy()
    return out


def padded_loop(clf, rows, groups, use_cache=None) -> np.ndarray:
    """Padded forwards as before the change (use_cache=None: Transformers' default) or through
    openjev/engine/classifier.py's score_padded (use_cache=False)."""
    import torch

    from openjev.engine.classifier import score_padded

    out = np.empty((len(rows), 3), dtype=np.float32)
    for g in groups:
        part = [rows[i] for i in g]
        if use_cache is False:
            out[g] = score_padded(clf, part)
            continue
        width = max(len(r) for r in part)
        ids = torch.tensor([r + [clf.pad_token_id] * (width - len(r)) for r in part], device=clf.device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in part], device=clf.device)
        with torch.inference_mode():
            out[g] = forward_logits(clf, ids, mask, use_cache=use_cache).float().cpu().numpy()
    return out


def count_syncs(clf, part) -> int | None:
    """Host synchronizations while one padded forward is launched (torch.cuda sync debug mode): a
    forward that syncs stalls the server's queue of launched forwards. None on a CPU."""
    import warnings

    import torch

    from openjev.engine.classifier import padded_logits

    if not str(clf.device).startswith("cuda"):
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            padded_logits(clf, part)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def uncompile(model) -> None:
    for m in model.modules():
        if getattr(m, "_openjev_compiled", False):
            del m.forward
            m._openjev_compiled = False


def compile_layers(model) -> int:
    """torch.compile every decoder layer's forward (dynamic shapes); fla's chunk rule stays eager."""
    import torch

    gdn = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    if gdn is not None:
        modeling = sys.modules[type(gdn).__module__]
        fn = modeling.torch_chunk_gated_delta_rule
        if not getattr(fn, "_openjev_disabled", False):
            wrapped = torch.compiler.disable(fn)
            wrapped._openjev_disabled = True
            modeling.torch_chunk_gated_delta_rule = wrapped
    n = 0
    for m in model.modules():
        if type(m).__name__.endswith("DecoderLayer"):
            m.forward = torch.compile(m.forward, dynamic=True)
            m._openjev_compiled = True
            n += 1
    return n


def is_exact(name: str) -> bool:
    return name in EXACT or (name.startswith("exact_threads") and name.removeprefix("exact_threads").isdigit()
                             and int(name.removeprefix("exact_threads")) > 0)


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    unknown = [v for v in args.variants.split(",") if v and not is_exact(v) and v not in PADDED]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(EXACT + PADDED)}, exact_threadsN")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} exists and is not empty; refusing to overwrite its receipts")
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    from openjev.engine.classifier import load_classifier, score_exact
    from openjev.engine.fused import apply_fused, remove_fused
    from openjev.engine.flops import measure_matmul_peak, model_flops
    from openjev.engine.kernels import compile_pointwise, kernel_path, path_label
    from openjev.engine.batching import length_groups
    from openjev.engine.warmup import warm_up

    res: dict = {"kind": "openjev-embedded-gpu-variants", "made_by": "benchmarks/experiments/embedded_gpu_variants.py",
                 "made_at": utc_now(),
                 "device": args.device, "grouping": args.grouping, "tokens_file": str(args.tokens), "variants": {}}
    if args.device.startswith("cuda"):
        res["machine"] = args.machine_label or f"{torch.cuda.get_device_name()} (not a V100)"
    else:
        res["machine"] = args.machine_label or f"cpu, {os.cpu_count()} logical CPUs (no GPU; not a V100)"
    peak = measure_matmul_peak(args.device, "float16" if args.device.startswith("cuda") else "float32")
    res["peak_tflops"] = round(peak, 1)
    clf = load_classifier(args.model, args.device)
    res["kernel_path"] = kernel_path(clf.model)
    _, rows = read_tokens(args.tokens)
    rows, _ = truncate_rows(rows, 4096)
    lengths = [len(r) for r in rows]
    flops = model_flops(args.model, sum(lengths))
    res.update(tokens=sum(lengths), rows=len(rows), model_flops_per_pass=flops, torch=torch.__version__)
    res["environment"] = environment_receipt()
    max_rows = max(int(x) for x in args.rows.split(","))
    res["warmup"] = warm_up(clf, rows, 2, padded=True, batch=max_rows)
    print(f"kernel path {path_label(res['kernel_path'])}; peak {peak:.0f} TFLOP/s", flush=True)
    out_json = args.out / "variants.json"
    ref = None

    def save():
        out_json.write_text(json.dumps(res, indent=1))

    for v in [x for x in args.variants.split(",") if x]:
        t0 = time.perf_counter()
        try:
            if is_exact(v):
                fn = {"exact": lambda: exact_loop(clf, rows), "exact_nocache": lambda: exact_loop(clf, rows, False),
                      "exact_async": lambda: score_exact(clf, rows)}.get(v)
                if fn is None:  # openjev/engine/classifier.py's threaded exact path
                    n_threads = int(v.removeprefix("exact_threads"))

                    def fn():
                        return score_exact(clf, rows, n_threads)
                sync(args.device)
                t1 = time.perf_counter()
                logits = fn()
                sync(args.device)
                sec = time.perf_counter() - t1
                if ref is None:
                    ref = logits
                    np.save(args.out / "exact_baseline.npy", ref)
                entry = {"pass_s": round(sec, 3), "rows_per_s": round(len(rows) / sec, 2), **agreement(logits, ref)}
            else:
                uncompile(clf.model)
                remove_fused(clf.model)
                use_cache = None if v == "padded" else False
                entry = {}
                if v == "padded_fused":
                    entry["fused"] = apply_fused(clf.model, args.device)
                if v.startswith("compiled"):
                    import torch._inductor.config as ic

                    ic.emulate_precision_casts = True
                    entry_n = compile_pointwise(clf.model) if v == "compiled_pointwise" else compile_layers(clf.model)
                else:
                    entry_n = 0
                entry["compiled_modules"] = entry_n
                for r in [int(x) for x in args.rows.split(",")]:
                    groups = (length_groups(lengths, r) if args.grouping == "dp"
                              else budget_groups(lengths, args.budget, r))
                    times = []
                    for rep in range(1 + args.repeats):
                        sync(args.device)
                        t1 = time.perf_counter()
                        logits = padded_loop(clf, rows, groups, use_cache)
                        sync(args.device)
                        times.append(time.perf_counter() - t1)
                    sec = statistics.median(times[1:])
                    entry[f"rows{r}"] = {"forwards": len(groups), "first_pass_s": round(times[0], 2),
                                         "pass_s": round(sec, 3), "pairs_per_s": round(len(rows) / sec, 1),
                                         "fraction_of_peak": round(flops / sec / 1e12 / peak, 3),
                                         **(agreement(logits, ref) if ref is not None else {})}
                    print(f"{v} rows {r}: {entry[f'rows{r}']}", flush=True)
                if args.profile:
                    entry["profile"] = prof_tables(lambda: padded_loop(clf, rows, groups, use_cache), args.device,
                                                   args.out / f"profile_{v}.txt")
                    entry["profile"]["rows"] = r
                    entry["profile"]["host_syncs_in_one_forward"] = count_syncs(clf, [rows[i] for i in groups[-1]])
        except Exception as exc:  # noqa: BLE001 - one variant failing must not lose the others
            entry = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        entry["wall_s"] = round(time.perf_counter() - t0, 1)
        res["variants"][v] = entry
        print(f"{v}: {json.dumps(entry)}", flush=True)
        save()
    uncompile(clf.model)
    remove_fused(clf.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
