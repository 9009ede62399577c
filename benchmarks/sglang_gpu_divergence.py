#!/usr/bin/env python3
"""Where SGLang's forward leaves the FP16 Transformers reference, module by module (a diagnostic
benchmark, not a test).

Input: the module outputs SGLang computed for some rows (benchmarks/sglang_forward_capture.py via
SGLang's --forward-hooks, one file per row) and the logits its /classify returned for them. For each
row, in one process with the Transformers classifier the reference uses (openjev/engine/classifier.py):

  reconstruct  SGLang's residual stream from its captured outputs (embedding + each mixer + each MLP,
               FP16 adds), the final norm and score head applied to it: must give SGLang's logits
  local        teacher-forced: each Transformers decoder layer gets SGLang's residual stream as its
               input and SGLang's mixer output as its MLP's input, so every module's difference is its
               own (norm + mixer, norm + MLP), not inherited; the GDN mixer split into the gated delta
               rule (core) and what follows it (gated norm + out_proj) by also feeding SGLang's core
  truth        the same teacher-forced modules in float32 (TF32 off): is SGLang's module or the
               reference's farther from exact arithmetic
  propagation  free-running FP16 forwards with one kind of SGLang's local difference added at every
               layer (GDN mixers, GDN cores only, attention mixers, MLPs, all): what each kind alone
               does to p_e; "all" must come back near SGLang's own logits

Writes OUT/divergence.json (kind openjev-sglang-divergence). Example (GPU machine):
  python3 benchmarks/sglang_gpu_divergence.py --model M --tokens set.tokens.jsonl --captures CAP \
      --sglang-logits CAP/logits.json --out OUT
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path

import numpy as np

from openjev.common import atomic_write_json, entailment_prob, environment_receipt, read_tokens, utc_now


def add_cli_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", required=True, help="classifier directory (the one SGLang served)")
    p.add_argument("--tokens", required=True, help="token file of the rows (id, input_ids)")
    p.add_argument("--captures", required=True, type=Path, help="directory of len{T}.pt capture files")
    p.add_argument("--sglang-logits", required=True, type=Path, help="JSON {row id: [c, e, n]} from SGLang")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--machine-label", default="")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float16", help="the dtype SGLang served (the teacher-forced forwards run in it)")
    return p


def compare(a, b) -> dict:
    """a against b (b the base): relative RMS and max abs difference, float32."""
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    d = a - b
    return {"rel_rms": float(d.norm() / b.norm().clamp_min(1e-30)), "max_abs": float(d.abs().max())}


def text_parts(model):
    """(decoder layers, final norm, layer types) of a Transformers Qwen3.5 classifier."""
    import torch

    for name, mod in model.named_modules():
        if name.endswith("layers") and isinstance(mod, torch.nn.ModuleList) and hasattr(mod[0], "mlp"):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            types = ["gdn" if hasattr(layer, "linear_attn") else "attn" for layer in mod]
            return mod, parent.norm, types
    raise SystemExit("no decoder layers found in the model")


def index_in_type(types: list[str]) -> list[int]:
    """For each layer, how many layers of its type come before it (the capture hooks count per kind)."""
    seen = {t: 0 for t in types}
    out = []
    for t in types:
        out.append(seen[t])
        seen[t] += 1
    return out


def gdn_captures(caps: dict, types: list[str], kind: str) -> dict[int, object]:
    """{layer: capture} of a GDN-only kind (gdn_core, gdn_norm), for the GDN layers that have one."""
    return {i: caps[f"{kind}.{k}"] for i, (t, k) in enumerate(zip(types, index_in_type(types)))
            if t == "gdn" and f"{kind}.{k}" in caps}


def sglang_stream(caps: dict, types: list[str]):
    """SGLang's residual stream (r[L] enters layer L, r[-1] the final norm), mixer and MLP outputs,
    rebuilt with SGLang's FP16 adds: the residual plus the mixer, that plus the MLP."""
    r, mix, mlp = [caps["embed.0"]], [], []
    for i, (t, k) in enumerate(zip(types, index_in_type(types))):
        mix.append(caps[f"{'gdn_out' if t == 'gdn' else 'attn_out'}.{k}"])
        mlp.append(caps[f"mlp_out.{i}"])
        r.append(((r[-1] + mix[-1]).to(r[-1].dtype) + mlp[-1]).to(r[-1].dtype))
    return r, mix, mlp


def forward_with_hooks(model, ids, hooks):
    import torch

    handles = []
    try:
        for mod, kind, fn in hooks:
            if kind == "pre":
                handles.append(mod.register_forward_pre_hook(fn, with_kwargs=True))
            else:
                handles.append(mod.register_forward_hook(fn))
        with torch.inference_mode():
            return model(input_ids=ids, use_cache=False).logits[0].float().cpu().numpy()
    finally:
        for h in handles:
            h.remove()


def replace_hidden(new):
    def pre(mod, args, kwargs):
        if args:
            return (new,) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = new
        return args, kwargs
    return pre


def teacher_forced(model, ids, stream, types, device, dtype, feed_core=None, record_core=False):
    """One forward where every layer (and the final norm) starts from SGLang's values; returns the
    modules' own outputs {mixer: [..], mlp: [..], core: {L: ..}, core_norm: {L: ..}} and the logits."""

    layers, final_norm, _ = text_parts(model)
    r, mix, mlp = stream
    got = {"mixer": [None] * len(types), "mlp": [None] * len(types), "core": {}, "core_norm": {}}
    to = lambda t: t.to(device=device, dtype=dtype)[None]  # noqa: E731
    hooks = []
    for i, (layer, t) in enumerate(zip(layers, types)):
        hooks.append((layer, "pre", replace_hidden(to(r[i]))))

        def mixer_hook(mod, inp, out, i=i):
            o = out[0] if isinstance(out, tuple) else out
            got["mixer"][i] = o[0].detach().float().cpu()
            s = to(mix[i])
            return (s,) + tuple(out[1:]) if isinstance(out, tuple) else s

        def mlp_hook(mod, inp, out, i=i):
            got["mlp"][i] = out[0].detach().float().cpu()
            return to(mlp[i])

        hooks.append((layer.linear_attn if t == "gdn" else layer.self_attn, "post", mixer_hook))
        hooks.append((layer.mlp, "post", mlp_hook))
        if t == "gdn" and (record_core or feed_core is not None):
            def core_pre(mod, args, kwargs, i=i):
                got["core"][i] = args[0].detach().float().cpu()
                if feed_core is not None:
                    return (feed_core[i].to(device=device, dtype=args[0].dtype).reshape(args[0].shape),) + tuple(args[1:]), kwargs
                return None

            def core_post(mod, inp, out, i=i):
                got["core_norm"][i] = out.detach().float().cpu()

            hooks.append((layer.linear_attn.norm, "pre", core_pre))
            hooks.append((layer.linear_attn.norm, "post", core_post))
    hooks.append((final_norm, "pre", replace_hidden(to(r[-1]))))
    logits = forward_with_hooks(model, ids, hooks)
    return got, logits


def propagate(model, ids, types, deltas: dict, device):
    """Free-running FP16 forward with deltas[(kind, L)] added to that module's output (kind mixer,
    mlp) or to the GDN core (kind core, at the gated norm's input)."""
    layers, _, _ = text_parts(model)
    hooks = []
    for (kind, i), d in deltas.items():
        layer = layers[i]
        dd = d.to(device)

        def add_out(mod, inp, out, dd=dd):
            o = out[0] if isinstance(out, tuple) else out
            n = (o.float() + dd.reshape(o.shape)).to(o.dtype)
            return (n,) + tuple(out[1:]) if isinstance(out, tuple) else n

        def add_core(mod, args, kwargs, dd=dd):
            a = args[0]
            return ((a.float() + dd.reshape(a.shape)).to(a.dtype),) + tuple(args[1:]), kwargs

        if kind == "core":
            hooks.append((layer.linear_attn.norm, "pre", add_core))
        elif kind == "mlp":
            hooks.append((layer.mlp, "post", add_out))
        else:
            hooks.append((layer.linear_attn if types[i] == "gdn" else layer.self_attn, "post", add_out))
    return forward_with_hooks(model, ids, hooks)


def summarise(per_layer: list[dict | None]) -> dict:
    vals = [x["rel_rms"] for x in per_layer if x]
    if not vals:
        return {}
    return {"layers": len(vals), "median_rel_rms": float(np.median(vals)), "max_rel_rms": float(np.max(vals)),
            "worst_layer": int(np.argmax([x["rel_rms"] if x else -1 for x in per_layer])),
            "max_abs": float(max(x["max_abs"] for x in per_layer if x))}


def analyse_row(clf, ids, caps, sg_logits, types, device):
    """The receipt entry of one row; also (stream, the reference's teacher-forced outputs, SGLang's
    GDN cores) for the float32 part."""
    stream = sglang_stream(caps, types)
    r, mix, mlp = stream
    dtype = r[0].dtype
    sg_core, sg_norm = gdn_captures(caps, types, "gdn_core"), gdn_captures(caps, types, "gdn_norm")
    row: dict = {"tokens": int(ids.shape[1]), "sglang_logits": [float(x) for x in sg_logits]}
    # A: teacher-forced, whole modules
    got, tf_logits = teacher_forced(clf.model, ids, stream, types, device, dtype, record_core=True)
    row["reconstruct"] = {"logits": tf_logits.tolist(),
                          "max_abs_vs_sglang": float(np.abs(tf_logits - np.asarray(sg_logits)).max())}
    local = {"gdn_mixer": [], "attn_mixer": [], "mlp_after_gdn": [], "mlp_after_attn": []}
    deltas = {}
    for i, t in enumerate(types):
        local[f"{t}_mixer"].append(compare(mix[i], got["mixer"][i]))
        local[f"mlp_after_{t}"].append(compare(mlp[i], got["mlp"][i]))
        deltas[("mixer", i)] = mix[i].float() - got["mixer"][i]
        deltas[("mlp", i)] = mlp[i].float() - got["mlp"][i]
    # B: teacher-forced with SGLang's GDN core fed to the gated norm
    core_local, post_local, norm_local = [], [], []
    if sg_core:
        got_b, _ = teacher_forced(clf.model, ids, stream, types, device, dtype, feed_core=sg_core)
        for i in sg_core:
            core_local.append(compare(sg_core[i], got["core"][i]))
            deltas[("core", i)] = sg_core[i].float().reshape(-1) - got["core"][i].reshape(-1)
            post_local.append(compare(mix[i], got_b["mixer"][i]))
            if i in sg_norm:
                norm_local.append(compare(sg_norm[i], got_b["core_norm"][i]))
    local.update(gdn_core=core_local, gdn_after_core=post_local, gdn_gated_norm=norm_local)
    row["local"] = {k: summarise(v) for k, v in local.items()}
    row["local_per_layer"] = {k: [x["rel_rms"] for x in v] for k, v in local.items()}
    # propagation, free running FP16
    clean = propagate(clf.model, ids, types, {}, device)
    runs = {"gdn_mixers": ("mixer", "gdn"), "gdn_cores": ("core", "gdn"), "attn_mixers": ("mixer", "attn"),
            "mlps": ("mlp", None), "all": (None, None)}
    prop = {"clean": {"logits": clean.tolist()}}
    for name, (kind, lt) in runs.items():
        if name == "all":
            sel = {k: v for k, v in deltas.items() if k[0] in ("mixer", "mlp")}
        else:
            sel = {k: v for k, v in deltas.items() if k[0] == kind and (lt is None or types[k[1]] == lt)}
        if not sel:
            continue
        lg = propagate(clf.model, ids, types, sel, device)
        prop[name] = {"logits": lg.tolist(), "dp_e_vs_clean": float(entailment_prob(lg) - entailment_prob(clean)),
                      "max_abs_logit_vs_clean": float(np.abs(lg - clean).max())}
    prop["sglang"] = {"dp_e_vs_clean": float(entailment_prob(sg_logits) - entailment_prob(clean))}
    row["propagation"] = prop
    return row, (stream, got, sg_core)


@contextlib.contextmanager
def pytorch_gdn():
    """Transformers' own PyTorch gated delta rule and causal conv instead of the kernels bound at import
    (flash-linear-attention's float32 Triton kernels exceed an H200's shared memory at these shapes)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mq

    saved = {}
    for name in ("torch_chunk_gated_delta_rule", "torch_causal_conv1d_fn", "causal_conv1d_fn"):
        fn = getattr(mq, name, None)
        base = fn
        while base is not None and hasattr(base, "__wrapped__"):
            base = base.__wrapped__
        if fn is not None and base is not fn:
            saved[name] = fn
            setattr(mq, name, base)
    try:
        yield sorted(saved)
    finally:
        for name, fn in saved.items():
            setattr(mq, name, fn)


def main(args) -> int:
    import torch

    from openjev.engine.classifier import load_classifier

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    tok_ids, toks = read_tokens(args.tokens)
    sg = json.loads(args.sglang_logits.read_text())
    by_len = {len(toks[i]): (tok_ids[i], toks[i]) for i in range(len(toks)) if tok_ids[i] in sg}
    files = sorted(args.captures.glob("len*.pt"))
    files = [f for f in files if not f.name.endswith(".final_norm.pt")]
    receipt = {"kind": "openjev-sglang-divergence", "made_by": "benchmarks/sglang_gpu_divergence.py",
               "started_at": utc_now(), "machine": args.machine_label, "model": str(args.model), "rows": {}}
    dev = args.device
    clf = load_classifier(args.model, dev, args.dtype)
    _, _, types = text_parts(clf.model)
    receipt["layer_types"] = types
    kept = {}
    for f in files:
        n = int(f.name[3:-3])
        if n not in by_len:
            continue
        rid, row = by_len[n]
        caps = torch.load(f)
        ids = torch.tensor([row], device=dev)
        print(f"row {rid} ({n} tokens)", flush=True)
        receipt["rows"][rid], parts = analyse_row(clf, ids, caps, sg[rid], types, dev)
        kept[rid] = (ids, *parts)
        atomic_write_json(args.out / "divergence.json", receipt)
    del clf
    torch.cuda.empty_cache()
    # truth: the same teacher-forced modules in float32
    try:
        big = load_classifier(args.model, dev, "float32")
        with pytorch_gdn() as swapped:
            receipt["truth_gdn_functions"] = swapped
            truth_part(big, kept, types, dev, receipt, args.out)
    except Exception:  # noqa: BLE001 - the FP16 parts above are kept either way
        receipt["truth_error"] = traceback.format_exc()[-3000:]
    receipt["finished_at"] = utc_now()
    receipt["environment"] = environment_receipt()
    atomic_write_json(args.out / "divergence.json", receipt)
    return 0


def truth_part(big, kept, types, dev, receipt, out) -> None:
    """The same rows' teacher-forced modules in float32: SGLang's and the reference's distance from them."""
    import torch

    for rid, (ids, stream, got16, sg_core) in kept.items():
        got32, _ = teacher_forced(big.model, ids, stream, types, dev, torch.float32, record_core=True)
        _, mix, mlp = stream
        truth = {}
        for key, sgv, hf, tr in (("mixer", mix, got16["mixer"], got32["mixer"]), ("mlp", mlp, got16["mlp"], got32["mlp"])):
            for t in ("gdn", "attn"):
                idx = [i for i, x in enumerate(types) if x == t]
                name = f"{t}_mixer" if key == "mixer" else f"mlp_after_{t}"
                truth[name] = {"sglang_vs_fp32": summarise([compare(sgv[i], tr[i]) for i in idx]),
                               "reference_vs_fp32": summarise([compare(hf[i], tr[i]) for i in idx])}
        if sg_core:
            idx = sorted(sg_core)
            truth["gdn_core"] = {"sglang_vs_fp32": summarise([compare(sg_core[i], got32["core"][i]) for i in idx]),
                                 "reference_vs_fp32": summarise([compare(got16["core"][i], got32["core"][i]) for i in idx])}
        receipt["rows"][rid]["truth"] = truth
        free32 = propagate(big.model, ids, types, {}, dev)
        e = receipt["rows"][rid]
        e["truth_logits_fp32"] = free32.tolist()
        pe32 = entailment_prob(free32)
        e["dp_e_vs_fp32"] = {"reference": float(entailment_prob(e["propagation"]["clean"]["logits"]) - pe32),
                             "sglang": float(entailment_prob(e["sglang_logits"]) - pe32)}
        atomic_write_json(out / "divergence.json", receipt)


if __name__ == "__main__":
    sys.exit(main(add_cli_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0])).parse_args()))
