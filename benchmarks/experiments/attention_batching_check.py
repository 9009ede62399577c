#!/usr/bin/env python3
"""Can rows of different lengths share one causal attention call and keep each row's own bits?

The embedded backend attends row by row (openjev/engine/attention.py rowwise_attention) because its
logits must be the unpadded forward's bit for bit, and a padded forward's attention is a host cost a
row and layer. This checks, on a CUDA GPU, Transformers' SDPA call (FlashAttention, causal, GQA) at
Qwen3.5-4B's attention shape (16 query / 4 key-value heads of 256) for each row of a set of lengths:

  alone        the row's own call, [1, heads, T, 256] (what the exact forward runs)
  twice        the same row twice in one call (batch 2): whether batch size alone changes its bits
  padded       all rows right-padded with zeros to the longest, one call; the row's first T outputs
  padded_long  the rows of at least --long tokens whose length is not a multiple of 64, padded to the
               longest of them (not a multiple of 64 either)
  padded_long_even  the same rows padded to the next multiple of 64 (FlashAttention's whole-tiles variant)

and, for the queries after a prefix of a multiple of 64 tokens (a warm pass of prefix reuse runs only
those; today it runs the whole row's call with the prefix's queries zeroed), against the same
queries of `alone`:

  tail_lower_right  the tail's queries alone over the row's keys, causal aligned to the bottom right
                    (SDPA with torch.nn.attention.bias.causal_lower_right, FlashAttention forced)
  tail_varlen       every row's tail in one varlen FlashAttention call (torch.nn.attention.varlen),
                    one split of the keys where the call takes num_splits

and, since torch may choose cuDNN's attention over FlashAttention for Transformers' call on SM90:

  backends          the CUDA kernels each kind of call runs (torch.profiler), per row length
  alone_flash/alone_cudnn  the row's own call with that SDPA backend forced, against `alone`
  tail_flash_vs_flash      tail_lower_right against the row's own call with FlashAttention forced
  tail_wide_flash          the queries after the last 64-token boundary at or before the prefix that
                           leaves enough query blocks for FlashAttention not to split the keys (where
                           the whole row's call does not), against the row's own FlashAttention call
  tail_varlen_vs_flash     tail_varlen against the row's own FlashAttention call
  tail_cudnn               the tail's queries with cuDNN forced and the bottom-right mask, against `alone`
  tail_cudnn_pad1          the same with one zero query put before the tail's
  batched_cudnn_left       every case's tail in one cuDNN call with a boolean mask, keys laid out as a
                           prefix-reuse forward has them (each row's prefix left-padded to the longest,
                           its tail after), queries right-padded; against `alone`
  batched_cudnn_aligned    the same with each row's keys from position 0 (right-padded)

and prints, per variant, which rows are bitwise equal to `alone` (and the largest difference), then the
time of the per-row loop against one padded call, and of the whole rows' calls against the tails'.
Output: one JSON object (--out, else stdout).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="130,200,257,320,448,511,512,575,640,700,777,832,833,896,900,960,1024,1100,1217,1280,1409,1500,1601",
                   help="row lengths in tokens, comma-separated")
    p.add_argument("--long", type=int, default=833,
                   help="the padded_long variants' shortest row (default: where 16 heads x its 64-query blocks "
                        "reach 0.8 x 2 x 132 SMs, so FlashAttention no longer splits its keys)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions of each layout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)


def sdpa(q, k, v):
    import torch

    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1,
                                                           scale=q.shape[-1] ** -0.5, enable_gqa=True)
    return out.transpose(1, 2).contiguous()  # [b, T, heads, dim], as Transformers returns it


def padded(rows, width=None):
    import torch

    width = width or max(q.shape[2] for q, _, _ in rows)

    def pad(t):
        return torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[2]))

    return tuple(torch.cat([pad(r[i]) for r in rows]) for i in range(3))


def compare(reference, got) -> dict:
    import torch

    diff = (reference.float() - got.float()).abs().max().item()
    return {"bitwise": bool(torch.equal(reference, got)), "max_abs_diff": diff}


def tail_cases(lengths: list[int]) -> list[tuple[int, int]]:
    """(row, prefix) pairs: each row after its last 64-token boundary, and after about half of it."""
    cases = []
    for i, n in enumerate(lengths):
        for p in sorted({(n - 1) // 64 * 64, n // 2 // 64 * 64}):
            if 0 < p < n:
                cases.append((i, p))
    return cases


def tail_lower_right(q, k, v, prefix: int):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    n = k.shape[2]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, prefix:], k, v, attn_mask=causal_lower_right(n - prefix, n), scale=q.shape[-1] ** -0.5,
            enable_gqa=True)
    return out.transpose(1, 2)[0]  # [T - prefix, heads, dim]


def tail_varlen(rows, cases):
    """Every case's tail queries in one varlen call; the outputs split back by case."""
    import inspect

    import torch
    from torch.nn.attention.varlen import varlen_attn

    qs = [rows[i][0][0, :, p:].transpose(0, 1) for i, p in cases]  # [T - p, heads, dim]
    ks = [rows[i][1][0].transpose(0, 1) for i, _ in cases]
    vs = [rows[i][2][0].transpose(0, 1) for i, _ in cases]
    dev = qs[0].device

    def cu(parts):
        return torch.tensor([0] + [x.shape[0] for x in parts], device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    params = inspect.signature(varlen_attn).parameters
    kw = {"scale": qs[0].shape[-1] ** -0.5}
    kw.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    if "num_splits" in params:
        kw["num_splits"] = 1
    out = varlen_attn(torch.cat(qs), torch.cat(ks), torch.cat(vs), cu(qs), cu(ks), max(x.shape[0] for x in qs),
                      max(x.shape[0] for x in ks), **kw)
    return list(out.split([x.shape[0] for x in qs])), {k: str(v) for k, v in kw.items()}


def forced(backend_name: str, q, k, v, mask=None):
    """SDPA with one backend forced (FLASH_ATTENTION, CUDNN_ATTENTION, ...), [b, T, heads, dim]."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend_name)):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and q.shape[2] > 1, scale=q.shape[-1] ** -0.5,
            enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def kernel_names(fn) -> list[str]:
    """The CUDA kernels one call of fn launches."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA}
    return sorted(n[:120] for n in names)


def wide_prefix(n: int, prefix: int, heads: int, sms: int) -> int:
    """The last 64-token boundary at or before `prefix` that leaves FlashAttention enough query blocks
    (heads x blocks of 64 >= 0.8 x 2 x SMs) not to split the keys of a call of the remaining queries;
    0 where the whole row's own call splits them (the whole row is then the only match)."""
    blocks = -(-int(1.6 * sms) // heads)  # query blocks a call needs
    if heads * -(-n // 64) < 1.6 * sms:
        return 0
    return min(prefix, (n - (blocks - 1) * 64 - 1) // 64 * 64)


def backend_variants(rows, lengths, cases, alone, heads: int) -> tuple[dict, dict]:
    import torch

    def guarded(fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a call this build does not run is a finding
            return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}

    from torch.nn.attention.bias import causal_lower_right

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants, kernels = {}, {"multi_processor_count": sms}
    flash = [forced("FLASH_ATTENTION", *r)[0] for r in rows]
    variants["alone_flash"] = {n: compare(a, f) for n, a, f in zip(lengths, alone, flash)}
    variants["alone_cudnn"] = {n: guarded(lambda r=r, a=a: compare(a, forced("CUDNN_ATTENTION", *r)[0]))
                               for n, r, a in zip(lengths, rows, alone)}
    for n in sorted({lengths[0], 700, 1601} & set(lengths)):
        r = rows[lengths.index(n)]
        p = (n - 1) // 64 * 64
        kernels[str(n)] = {
            "alone": guarded(lambda r=r: kernel_names(lambda: sdpa(*r))),
            "flash": guarded(lambda r=r: kernel_names(lambda: forced("FLASH_ATTENTION", *r))),
            "tail_lower_right": guarded(lambda r=r, p=p: kernel_names(lambda: tail_lower_right(*r, p)))}
    tail, wide, cudnn = {}, {}, {}
    for i, p in cases:
        n, key = lengths[i], f"{lengths[i]}@{p}"
        q, k, v = rows[i]
        tail[key] = guarded(lambda q=q, k=k, v=v, i=i, p=p: compare(flash[i][p:], tail_lower_right(q, k, v, p)))
        w = wide_prefix(n, p, heads, sms)
        wide[key] = guarded(lambda q=q, k=k, v=v, i=i, p=p, w=w: dict(
            compare(flash[i][p:], tail_lower_right(q, k, v, w)[p - w:]), prefix_used=w))
        cudnn[key] = guarded(lambda q=q, k=k, v=v, i=i, p=p: compare(alone[i][p:], forced(
            "CUDNN_ATTENTION", q[:, :, p:], k, v, causal_lower_right(n - p, n))[0]))
    variants.update(tail_flash_vs_flash=tail, tail_wide_flash=wide, tail_cudnn=cudnn)
    outs = guarded(lambda: tail_varlen(rows, cases)[0])
    variants["tail_varlen_vs_flash"] = outs if isinstance(outs, dict) else {
        f"{lengths[i]}@{p}": compare(flash[i][p:], o) for (i, p), o in zip(cases, outs)}
    return variants, kernels


def batched_tails(rows, cases, aligned: bool, backend_name: str = "CUDNN_ATTENTION"):
    """Every case's tail queries in one SDPA call with a boolean mask; outputs split back by case."""
    import torch

    dev = rows[0][0].device
    tails = [rows[i][0].shape[2] - p for i, p in cases]
    width = max(tails)
    heads, kv_heads, dim = rows[0][0].shape[1], rows[0][1].shape[1], rows[0][0].shape[3]
    if aligned:
        keys = max(rows[i][1].shape[2] for i, _ in cases)
        start = [0 for _ in cases]
    else:
        off = max(p for _, p in cases)
        keys = off + width
        start = [off - p for _, p in cases]
    q = torch.zeros(len(cases), heads, width, dim, device=dev, dtype=torch.float16)
    k = torch.zeros(len(cases), kv_heads, keys, dim, device=dev, dtype=torch.float16)
    v = torch.zeros_like(k)
    mask = torch.zeros(len(cases), 1, width, keys, device=dev, dtype=torch.bool)
    pos = torch.arange(keys, device=dev)
    for b, ((i, p), s0) in enumerate(zip(cases, start)):
        rq, rk, rv = rows[i]
        n = rk.shape[2]
        q[b, :, : n - p] = rq[0, :, p:]
        k[b, :, s0: s0 + n] = rk[0]
        v[b, :, s0: s0 + n] = rv[0]
        last = s0 + p + torch.arange(width, device=dev)  # query j sees keys up to its own position
        mask[b, 0] = (pos[None, :] >= s0) & (pos[None, :] <= last[:, None])
    out = forced(backend_name, q, k, v, mask)
    return [out[b, : t] for b, t in enumerate(tails)], (q, k, v, mask)


def batched_variants(rows, lengths, cases, alone) -> tuple[dict, dict]:
    import torch

    variants, seconds = {}, {}
    ones = [(i, p) for i, p in cases if lengths[i] - p == 1]
    pad1 = {}
    for i, p in ones:
        q, k, v = rows[i]
        n = lengths[i]
        try:
            from torch.nn.attention.bias import causal_lower_right

            qq = torch.cat([q.new_zeros(q.shape[:2] + (1, q.shape[3])), q[:, :, p:]], dim=2)
            out = forced("CUDNN_ATTENTION", qq, k, v, causal_lower_right(2, n))[0][1:]
            pad1[f"{n}@{p}"] = compare(alone[i][p:], out)
        except Exception as exc:  # noqa: BLE001
            pad1[f"{n}@{p}"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    variants["tail_cudnn_pad1"] = pad1
    last = [(i, p) for i, p in cases if p == (lengths[i] - 1) // 64 * 64]
    half = [(i, p) for i, p in cases if (i, p) not in last]
    for aligned, name in ((False, "left"), (True, "aligned")):
        for label, group in (("", last), ("_half", half)):
            key = f"batched_cudnn_{name}{label}"
            try:
                outs, call = batched_tails(rows, group, aligned)
                variants[key] = {f"{lengths[i]}@{p}": compare(alone[i][p:], o) for (i, p), o in zip(group, outs)}
                if not label:
                    seconds[key] = timed(lambda call=call: forced("CUDNN_ATTENTION", *call), 20)
            except Exception as exc:  # noqa: BLE001
                variants[key] = {"call": {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}}
    try:
        _, call = batched_tails(rows, last, False)
        seconds["batched_cudnn_left_kernels"] = kernel_names(lambda: forced("CUDNN_ATTENTION", *call))
    except Exception:  # noqa: BLE001
        pass
    return variants, seconds


def timed(fn, repeats: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def main(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("attention_batching_check: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    lengths = [int(x) for x in args.lengths.split(",")]
    dev = "cuda"
    rows = [(torch.randn(1, args.heads, n, args.head_dim, device=dev, dtype=torch.float16),
             torch.randn(1, args.kv_heads, n, args.head_dim, device=dev, dtype=torch.float16),
             torch.randn(1, args.kv_heads, n, args.head_dim, device=dev, dtype=torch.float16)) for n in lengths]
    alone = [sdpa(*r)[0] for r in rows]
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "lengths": lengths,
              "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}, "variants": {}}

    twice = []
    for (q, k, v), ref in zip(rows, alone):
        out = sdpa(torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]))
        twice.append(compare(ref, out[0]))
    report["variants"]["twice"] = twice

    def batched(members, width=None):
        q, k, v = padded([rows[i] for i in members], width)
        out = sdpa(q, k, v)
        return {lengths[i]: compare(alone[i], out[b, :lengths[i]]) for b, i in enumerate(members)}

    report["variants"]["padded"] = batched(list(range(len(rows))))
    long_rows = [i for i, n in enumerate(lengths) if n >= args.long and n % 64]
    report["variants"]["padded_long"] = batched(long_rows) if len(long_rows) > 1 else {}
    if len(long_rows) > 1:
        width = -(-max(lengths[i] for i in long_rows) // 64) * 64
        report["variants"]["padded_long_even"] = batched(long_rows, width)

    cases = tail_cases(lengths)
    lower = {}
    for i, p in cases:
        try:
            lower[f"{lengths[i]}@{p}"] = compare(alone[i][p:], tail_lower_right(*rows[i], p))
        except Exception as exc:  # noqa: BLE001 - a variant this torch build does not run is a finding
            lower[f"{lengths[i]}@{p}"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    report["variants"]["tail_lower_right"] = lower
    try:
        outs, report["tail_varlen_call"] = tail_varlen(rows, cases)
        report["variants"]["tail_varlen"] = {f"{lengths[i]}@{p}": compare(alone[i][p:], o)
                                             for (i, p), o in zip(cases, outs)}
    except Exception as exc:  # noqa: BLE001
        report["variants"]["tail_varlen"] = {"call": {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}}

    more, report["backends"] = backend_variants(rows, lengths, cases, alone, args.heads)
    report["variants"].update(more)
    more, report["batched_seconds"] = batched_variants(rows, lengths, cases, alone)
    report["variants"].update(more)

    def loop():
        for r in rows:
            sdpa(*r)

    def one_call():
        sdpa(*padded(rows))

    last = [(i, p) for i, p in cases if p == (lengths[i] - 1) // 64 * 64]  # the warm pass's tails

    def tails_alone():
        for i, p in last:
            tail_lower_right(*rows[i], p)

    report["seconds"] = {"per_row_loop": timed(loop, args.repeats), "one_padded_call": timed(one_call, args.repeats)}
    for name, fn in (("tails_lower_right_loop", tails_alone), ("tails_varlen_call", lambda: tail_varlen(rows, last))):
        try:
            report["seconds"][name] = timed(fn, args.repeats)
        except Exception:  # noqa: BLE001 - recorded above as the variant's error
            report["seconds"][name] = None
    for name, res in report["variants"].items():
        items = res if isinstance(res, list) else list(res.values())
        keys = lengths if isinstance(res, list) else list(res)
        if not items or not isinstance(items[0], dict):
            continue
        same = [n for n, r in zip(keys, items) if r.get("bitwise")]
        errors = sorted({r["error"] for r in items if "error" in r})
        print(f"{name}: bitwise for {len(same)}/{len(items)} rows {same}; max diff "
              f"{max((r['max_abs_diff'] for r in items if 'max_abs_diff' in r), default=0):.3g}"
              + (f"; errors {errors}" if errors else ""), file=sys.stderr)
    print("seconds: " + ", ".join(f"{k} {v * 1e3:.2f} ms" if v is not None else f"{k} n/a"
                                  for k, v in report["seconds"].items()), file=sys.stderr)
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    sys.exit(main(parser.parse_args()))
