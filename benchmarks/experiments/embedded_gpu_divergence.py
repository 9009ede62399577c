#!/usr/bin/env python3
"""Where a padded forward's logits leave the exact FP16 reference, and how far both are
from a higher-precision forward (a diagnostic benchmark, not a test).

The HTTP goal asks for max |dp_e| <= 2e-3 against the exact FP16 reference; the padded forwards
of the embedded backend sit at 0.0020-0.0024. This script measures, in one process:

  candidates  the exact FP16 reference loop (openjev/engine/classifier.py score_exact, one thread) and padded
              FP16 forwards of --rows rows (length-sorted, as the embedded scheduler forms them),
              each with PyTorch's default cuBLAS reductions and again with
              torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
  chain       one padded forward's group: every decoder sub-module's output (norms, token mixer,
              MLP, the layer) compared with the same row's exact forward, in execution order, so
              the first module whose output differs is named
  isolated    batch invariance of single modules given identical inputs: the exact forward's
              inputs of the first GDN layer and the first full-attention layer's norms, MLP and
              projections, run alone row by row and as one zero-padded batch
  overhead    where a warm exact forward's CPU time goes: enqueue time vs wall time, host
              synchronisations (torch.cuda.set_sync_debug_mode), the top of a cProfile
  truth       the same rows through the unmodified forward in --truth-dtype (float32 on a GPU,
              TF32 off; float64 on a CPU) and every candidate's distance from it

Writes OUT/divergence.json (kind openjev-embedded-gpu-divergence) after every part, OUT/*.npy logits and
OUT/cprofile.txt. Example (GPU machine):
  python3 benchmarks/experiments/embedded_gpu_divergence.py --model W/model-qwen3.5-4b \\
    --tokens W/set.tokens.jsonl --out OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
import traceback
import warnings

import numpy as np
from embedded_gpu_variants import agreement, padded_loop
from gpu_profile import base_parser, budget_groups, sync

from openjev.common import entailment_prob, environment_receipt, read_tokens, truncate_rows, utc_now

PARTS = ("candidates", "chain", "isolated", "overhead", "truth")
# sub-modules compared in the chain, by the last component of their name
CHAIN = ("input_layernorm", "linear_attn", "self_attn", "post_attention_layernorm", "mlp")
# modules run alone (relative to a decoder layer) for the isolated batch-invariance check
ISOLATED = ("input_layernorm", "post_attention_layernorm", "mlp", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
            "linear_attn", "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
            "linear_attn.out_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
# modules outside the decoder layers run alone too (the final norm and the classification head)
ISOLATED_TOP = ("language_model.norm", "score")
# environment variables that change cuBLAS's algorithm choice, recorded in the receipt
BLAS_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_BLAS_PREFER_CUBLASLT")


def build_parser() -> argparse.ArgumentParser:
    p = base_parser(__doc__, "directory (created; refused if not empty)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--rows", type=int, default=8, help="rows per padded forward (default 8, the served setting)")
    p.add_argument("--budget", type=int, default=16384, help="padded tokens per forward (default 16384)")
    p.add_argument("--truth-dtype", default=None, help="dtype of the truth forward (default float32 on a GPU, "
                   "float64 on a CPU)")
    p.add_argument("--sdpa", choices=("default", "mem_efficient"), default="default",
                   help="SDPA backends: PyTorch's choice (FlashAttention for unpadded rows, memory-efficient "
                   "with a mask) or memory-efficient only, for both (default: default)")
    p.add_argument("--machine-label", default=None, help="recorded in the receipt (default: the device name)")
    return p


def reduced_precision(flag: bool) -> None:
    import torch

    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = flag
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag


def first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def diff_entry(name: str, a, b) -> dict:
    d = (a.float() - b.float()).abs().max().item()
    scale = b.float().abs().max().item()
    return {"module": name, "max_abs_diff": d, "rel": d / scale if scale else 0.0}


def worst_of(entries) -> dict:
    """The diff_entry with the largest max_abs_diff (the first of equals)."""
    return max(entries, key=lambda e: e["max_abs_diff"])


def chain(clf, rows, group) -> list[dict]:
    """Every chained sub-module's output in the padded forward of `group` vs each row's exact forward."""
    import torch

    from openjev.engine.classifier import score_exact, score_padded

    mods = {n: m for n, m in clf.model.named_modules()
            if ".layers." in n and (n.rsplit(".", 1)[-1] in CHAIN or n.rsplit(".", 1)[-1].isdigit())}
    kept: dict = {}
    results: dict = {}
    state = {"row": None}

    def hook(name):
        def fn(_m, _a, out):
            t = first_tensor(out)
            if state["row"] is not None:  # exact forward of one row: keep [T, H]
                kept[(state["row"], name)] = t[0].detach().clone()
            else:  # padded forward: compare each row's slice, keep the worst row
                results[name] = worst_of(diff_entry(name, t[j, : len(rows[i])], kept.pop((i, name)))
                                         for j, i in enumerate(group))
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in mods.items()]
    try:
        for i in group:
            state["row"] = i
            score_exact(clf, [rows[i]])
        state["row"] = None
        score_padded(clf, [rows[i] for i in group])
        sync(clf.device)
    finally:
        for h in handles:
            h.remove()
    kept.clear()
    if clf.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return list(results.values())  # execution order: hooks fire as modules return


def isolated(clf, rows, group, layer_indices) -> list[dict]:
    """Modules run alone on identical inputs, one row at a time and as one zero-padded batch."""
    import torch

    from openjev.engine.classifier import score_exact

    mods = dict(clf.model.named_modules())
    wanted = [f"layers.{li}.{s}" for li in layer_indices for s in ISOLATED] + list(ISOLATED_TOP)
    names = [full for n in wanted for full in [next((k for k in mods if k == n or k.endswith("." + n)), None)]
             if full is not None]
    inputs: dict = {}
    state = {"row": None}

    def pre(name):
        def fn(_m, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            inputs[(state["row"], name)] = x[0].detach().clone()
        return fn

    handles = [mods[n].register_forward_pre_hook(pre(n), with_kwargs=True) for n in names]
    try:
        for i in group:
            state["row"] = i
            score_exact(clf, [rows[i]])
    finally:
        for h in handles:
            h.remove()
    out = []
    with torch.inference_mode():
        for n in names:
            m = mods[n]
            xs = [inputs.pop((i, n)) for i in group]
            width = max(x.shape[0] for x in xs)
            batch = torch.zeros((len(xs), width, xs[0].shape[-1]), dtype=xs[0].dtype, device=xs[0].device)
            mask = torch.zeros((len(xs), width), dtype=torch.long, device=xs[0].device)
            for j, x in enumerate(xs):
                batch[j, : x.shape[0]] = x
                mask[j, : x.shape[0]] = 1
            is_gdn = n.endswith("linear_attn")
            alone = [first_tensor(m(x[None], attention_mask=None) if is_gdn else m(x[None]))[0] for x in xs]
            both = first_tensor(m(batch, attention_mask=mask) if is_gdn else m(batch))
            worst = worst_of(diff_entry(n, both[j, : x.shape[0]], alone[j]) for j, x in enumerate(xs))
            worst["bitwise_equal"] = worst["max_abs_diff"] == 0.0
            out.append(worst)
    return out


def overhead(clf, rows, repeats: int = 10) -> dict:
    """Enqueue vs wall time of warm exact forwards of one mid-length row, host syncs, cProfile."""
    import torch

    from openjev.engine.classifier import _forward

    row = sorted(rows, key=len)[len(rows) // 2]
    ids = torch.tensor([row], dtype=torch.long, device=clf.device)
    res: dict = {"length": len(row)}
    with torch.inference_mode():
        for _ in range(2):
            _forward(clf, ids)
        sync(clf.device)
        enq, wall = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            _forward(clf, ids)
            t1 = time.perf_counter()
            sync(clf.device)
            enq.append(t1 - t0)
            wall.append(time.perf_counter() - t0)
        res["enqueue_ms"] = round(1e3 * float(np.median(enq)), 2)
        res["wall_ms"] = round(1e3 * float(np.median(wall)), 2)
        if clf.device.startswith("cuda"):
            syncs: dict = {}

            def record(message, category, filename, lineno, file=None, line=None):
                stack = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                         for f in traceback.extract_stack()[-14:-2]]
                key = " <- ".join(reversed(stack[-4:]))
                syncs[key] = syncs.get(key, 0) + 1

            with warnings.catch_warnings():  # restores showwarning on the way out
                warnings.simplefilter("always")
                warnings.showwarning = record
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    _forward(clf, ids)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            sync(clf.device)
            res["host_syncs_per_forward"] = sum(syncs.values())
            res["host_sync_sites"] = syncs
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            _forward(clf, ids)
        sync(clf.device)
        prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(40)
    res["cprofile_text"] = buf.getvalue()
    return res


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}")
    parts = [p for p in PARTS if p in parts]  # truth frees the FP16 model, so it runs last
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} exists and is not empty; refusing to overwrite its receipts")
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    from openjev.engine.classifier import load_classifier, score_exact
    from openjev.engine.kernels import kernel_path
    from openjev.engine.warmup import warm_up

    gpu = args.device.startswith("cuda")
    res: dict = {"kind": "openjev-embedded-gpu-divergence",
                 "made_by": "benchmarks/experiments/embedded_gpu_divergence.py", "made_at": utc_now(),
                 "device": args.device, "tokens_file": str(args.tokens), "rows_per_forward": args.rows,
                 "budget": args.budget, "parts": {}}
    res["machine"] = args.machine_label or (f"{torch.cuda.get_device_name()} (not a V100)" if gpu
                                            else f"cpu, {os.cpu_count()} logical CPUs (no GPU; not a V100)")
    res["environment"] = environment_receipt()
    res["blas_env"] = {k: os.environ.get(k) for k in BLAS_ENV}
    res["sdpa"] = args.sdpa
    if args.sdpa == "mem_efficient":
        torch.backends.cuda.enable_flash_sdp(False)
    _, rows = read_tokens(args.tokens)
    rows, _ = truncate_rows(rows, 4096)
    lengths = [len(r) for r in rows]
    res.update(rows=len(rows), tokens=sum(lengths))
    groups = budget_groups(lengths, args.budget, args.rows)
    out_json = args.out / "divergence.json"

    def save():
        out_json.write_text(json.dumps(res, indent=1))

    def run_part(name, fn):
        t0 = time.perf_counter()
        try:
            entry = fn()
        except Exception as exc:  # noqa: BLE001 - one part failing must not lose the others
            entry = {"error": f"{type(exc).__name__}: {str(exc)[:800]}", "traceback": traceback.format_exc()[-3000:]}
        entry["wall_s"] = round(time.perf_counter() - t0, 1)
        res["parts"][name] = entry
        print(f"== {name}: {json.dumps({k: v for k, v in entry.items() if k != 'cprofile_text'})[:3000]}", flush=True)
        save()

    clf = load_classifier(args.model, args.device)
    res["kernel_path"] = kernel_path(clf.model)
    res["dtype"] = clf.dtype
    res["warmup"] = warm_up(clf, rows, 2, padded=True, batch=args.rows)
    cands: dict = {}

    def candidates() -> dict:
        entry: dict = {}
        for reduced in ((True, False) if gpu else (True,)):
            reduced_precision(reduced)
            tag = "" if reduced else "_full_reduction"
            sync(args.device)
            t0 = time.perf_counter()
            cands["exact" + tag] = score_exact(clf, rows)
            sync(args.device)
            entry["exact" + tag] = {"pass_s": round(time.perf_counter() - t0, 3)}
            t0 = time.perf_counter()
            cands[f"padded{args.rows}" + tag] = padded_loop(clf, rows, groups, False)
            sync(args.device)
            entry[f"padded{args.rows}" + tag] = {"pass_s": round(time.perf_counter() - t0, 3)}
        reduced_precision(True)
        ref = cands["exact"]
        for k, v in cands.items():
            np.save(args.out / f"{k}.npy", v)
            entry[k].update(agreement(v, ref))
            if k.endswith("_full_reduction"):
                entry[k]["vs_own_exact"] = agreement(v, cands["exact_full_reduction"])
        return entry

    def worst_group() -> list[int]:
        key = f"padded{args.rows}"
        if "exact" not in cands or key not in cands:
            return groups[len(groups) // 2]
        dpe = np.abs(entailment_prob(cands[key]) - entailment_prob(cands["exact"]))
        worst = int(dpe.argmax())
        return next(g for g in groups if worst in g)

    def layer_indices() -> list[int]:
        types = list(getattr(clf.model.config.get_text_config(), "layer_types", None) or [])
        picks = [types.index(t) for t in ("linear_attention", "full_attention") if t in types]
        return picks or [0]

    for part in parts:
        if part == "candidates":
            run_part(part, candidates)
        elif part == "chain":
            def chained():
                g = worst_group()
                mods = chain(clf, rows, g)
                first = next((m["module"] for m in mods if m["max_abs_diff"] > 0), None)
                return {"group": g, "lengths": [lengths[i] for i in g], "first_divergent": first, "modules": mods}
            run_part(part, chained)
        elif part == "isolated":
            def iso():
                g = worst_group()
                out = {"group": g, "default": isolated(clf, rows, g, layer_indices())}
                if gpu:
                    reduced_precision(False)
                    try:
                        out["full_reduction"] = isolated(clf, rows, g, layer_indices())
                    finally:
                        reduced_precision(True)
                return out
            run_part(part, iso)
        elif part == "overhead":
            def ovh():
                entry = overhead(clf, rows)
                (args.out / "cprofile.txt").write_text(entry.pop("cprofile_text"))
                return entry
            run_part(part, ovh)
        elif part == "truth":
            def truth():
                nonlocal clf
                dt = args.truth_dtype or ("float32" if gpu else "float64")
                del clf
                if gpu:
                    torch.cuda.empty_cache()
                    torch.backends.cuda.matmul.allow_tf32 = False
                    torch.backends.cudnn.allow_tf32 = False
                big = load_classifier(args.model, args.device, dt)
                warm_up(big, rows, 1)
                t0 = time.perf_counter()
                tr = score_exact(big, rows)
                entry = {"dtype": dt, "pass_s": round(time.perf_counter() - t0, 3)}
                np.save(args.out / f"truth_{dt}.npy", tr)
                entry["against_truth"] = {k: agreement(v, tr) for k, v in cands.items()}
                return entry
            run_part(part, truth)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
