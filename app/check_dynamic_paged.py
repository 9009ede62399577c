#!/usr/bin/env python3
"""Check (and optionally benchmark) the project's dynamic-shape TileLang paged prefill kernel.

Shapes (the kernel's contract, openjev/paged/dynamic_paged.py):
  q             fp16  [total_q, heads, dim]            new tokens of every sequence, packed
  k_cache/v_cache fp16 [num_pages, page_size, heads_kv, dim]
  block_table   int32 [batch, width]                   physical page of each logical page
  cu_seqlens_q  int32 [batch + 1]                      prefix sums of the query lengths
  kv_lens       int32 [batch]                          cached prefix + new tokens per sequence
  out           fp16  [total_q, heads, dim]
Causal mask aligned bottom-right: key j is visible to query i iff j <= (kv_len - q_len) + i.
heads, heads_kv, dim and page_size are compile-time; batch, num_pages, width and total_q are
runtime dimensions, so every case below must reuse ONE compiled kernel.

Modes:
  (default)              run the standard cases on the GPU against a dense FP64 reference,
                         print the maximum absolute error, assert one compiled kernel served
                         every (batch, pages, width) triple, and that the known prefix/causal
                         bugs would fail the tolerance.
  --bench                after the check, time the kernel against torch SDPA (see --help).
  --codegen-only-arch A  lower the kernel for architecture A (e.g. sm_70) to CUDA C++ without
                         running it; needs TileLang but no GPU. With --nvcc, also build a cubin.

Compiles are counted through TileLang itself: the @tilelang.jit factory's kernel cache and a
"tilelang_callback_cuda_postproc" hook, which TileLang calls once per code generation; the
disk cache is pointed at a fresh temporary folder so it cannot hide a compile.
Exit status 0 on success; on failure one line on stderr and status 1.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from openjev.common import UserError, atomic_write_json, environment_receipt, run_main, utc_now

DEFAULT_PREFIX_FRACTIONS = "0,0.5,0.9"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="check_dynamic_paged.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("kernel (compile-time parameters)")
    g.add_argument("--heads", type=int, default=16, help="query heads (default 16, Qwen3.5-4B)")
    g.add_argument("--heads-kv", type=int, default=4, help="KV heads (default 4: GQA 4)")
    g.add_argument("--dim", type=int, default=256, help="head dim (default 256)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16, the runtime's SM70 page)")

    g = p.add_argument_group("check")
    g.add_argument("--seed", type=int, default=0, help="seed of the random cases (default 0)")
    g.add_argument("--atol", type=float, default=2e-3, help="absolute tolerance vs the FP64 reference (default 2e-3)")
    g.add_argument("--rtol", type=float, default=2e-3, help="relative tolerance vs the FP64 reference (default 2e-3)")
    g.add_argument("--device", default="cuda", help="torch device for the check (default cuda)")
    g.add_argument("--json", type=Path, metavar="PATH", help="write the check (or codegen) receipt here")
    g.add_argument("--keep-disk-cache", action="store_true",
                   help="use TileLang's normal disk cache instead of a fresh temporary one (compiles may then be hidden)")
    g.add_argument("--verbose", action="store_true", help="print tracebacks of unexpected errors")

    g = p.add_argument_group("benchmark (--bench)")
    g.add_argument("--bench", action="store_true", help="after the check, benchmark against torch SDPA")
    g.add_argument("--bench-json", type=Path, metavar="PATH", help="write the benchmark receipt here")
    g.add_argument("--bench-batch", type=int, default=8, help="sequences per batch (default 8)")
    g.add_argument("--bench-seq-len", type=int, default=4096, help="tokens per sequence, prefix + new (default 4096)")
    g.add_argument("--bench-prefix-fractions", default=DEFAULT_PREFIX_FRACTIONS,
                   help=f"comma-separated cached-prefix fractions of each sequence (default {DEFAULT_PREFIX_FRACTIONS})")
    g.add_argument("--bench-warmup", type=int, default=5, help="untimed warm-up launches per variant (default 5)")
    g.add_argument("--bench-iters", type=int, default=20, help="timed launches per variant (default 20)")

    g = p.add_argument_group("code generation only")
    g.add_argument("--codegen-only-arch", metavar="ARCH",
                   help="lower for this architecture (sm_70, sm_80, sm_90, ...) without running; no GPU needed")
    g.add_argument("--codegen-source", type=Path, metavar="PATH", help="write the generated CUDA C++ here")
    g.add_argument("--nvcc", metavar="PATH",
                   help="with --codegen-only-arch: build a cubin with this nvcc (must support the arch; CUDA 13 dropped sm_70)")
    return p


# --------------------------------------------------------------------------------------------
# TileLang set-up and compile counting
# --------------------------------------------------------------------------------------------
class CompileCounter:
    """Counts TileLang CUDA code generations via the post-processing callback."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, code, target):  # signature TileLang calls: (generated code, target)
        self.count += 1
        return code


def setup_tilelang(keep_disk_cache: bool) -> tuple[CompileCounter, str | None]:
    cache_dir = None
    if not keep_disk_cache:
        cache_dir = tempfile.mkdtemp(prefix="tilelang-cache-check-")
        os.environ["TILELANG_CACHE_DIR"] = cache_dir
    if "tilelang" in sys.modules and not keep_disk_cache:
        raise UserError("tilelang was imported before the cache folder was set; run this script directly")
    try:
        import tilelang  # noqa: F401  (import after TILELANG_CACHE_DIR is set)
        import tvm_ffi
    except Exception as exc:  # noqa: BLE001 - any import failure means the check cannot run
        raise UserError(f"TileLang is not importable ({type(exc).__name__}: {exc}); install tilelang==0.1.15") from None
    counter = CompileCounter()
    tvm_ffi.register_global_func("tilelang_callback_cuda_postproc", counter, override=True)
    return counter, cache_dir


def machine_label(gpu_name: str | None) -> str:
    if not gpu_name:
        return "no GPU (code generation only)"
    return gpu_name if "V100" in gpu_name else f"{gpu_name}, not a V100"


def gpu_facts(torch) -> dict:
    if not torch.cuda.is_available():
        return {"gpu_name": None}
    major, minor = torch.cuda.get_device_capability()
    return {"gpu_name": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}",
            "cuda_runtime": torch.version.cuda}


def nvcc_version(nvcc: str | None = None) -> str | None:
    exe = nvcc or shutil.which("nvcc")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release ([0-9.]+), (V[0-9.]+)", out)
    return f"{m.group(1)} ({m.group(2)})" if m else None


def receipt_environment(torch) -> dict:
    env = environment_receipt()
    env.update(gpu_facts(torch))
    env["nvcc"] = nvcc_version()
    env["cuda_home"] = os.environ.get("CUDA_HOME")
    return env


# --------------------------------------------------------------------------------------------
# Check
# --------------------------------------------------------------------------------------------
def run_check(args, torch, counter: CompileCounter) -> dict:
    from openjev.paged import dynamic_paged as dp
    from openjev.paged.reference import KNOWN_BUG_MASKS, check_cases, reference_paged_prefill

    device = torch.device(args.device)
    major, minor = torch.cuda.get_device_capability(device)
    config = dp.tile_config_for_arch(major * 10 + minor)
    cases = check_cases(heads=args.heads, heads_kv=args.heads_kv, dim=args.dim, page_size=args.page_size,
                        seed=args.seed)
    results = []
    for case in cases:
        c = case.to(device)
        t0 = time.perf_counter()
        out = dp.dynamic_paged_prefill(c.q, c.k_cache, c.v_cache, c.block_table, c.cu_seqlens_q, c.kv_lens,
                                       max_seqlen_q=c.max_seqlen_q, config=config)
        torch.cuda.synchronize(device)
        call_s = time.perf_counter() - t0
        ref = reference_paged_prefill(c.q, c.k_cache, c.v_cache, c.block_table, c.cu_seqlens_q, c.kv_lens)
        diff = (out.double() - ref).abs()
        finite = bool(torch.isfinite(out).all())
        max_err = float(diff.max()) if finite else float("inf")
        within = bool((diff <= args.atol + args.rtol * ref.abs()).all()) if finite else False
        bug_errors = {
            name: float((reference_paged_prefill(c.q, c.k_cache, c.v_cache, c.block_table, c.cu_seqlens_q,
                                                 c.kv_lens, mask_fn=mask) - ref).abs().max())
            for name, mask in KNOWN_BUG_MASKS.items()
        }
        results.append({
            **case.describe(),
            "max_abs_error": max_err,
            "output_finite": finite,
            "within_tolerance": within,
            "known_bug_max_abs_deviation": bug_errors,
            "first_call_seconds": round(call_s, 3),
            "compiles_after_case": counter.count,
            "jit_cache_entries_after_case": dp.compiled_kernel_count(),
        })
        print(f"case {case.name:<22} (batch, pages, width)={case.shape_triple!s:<16} "
              f"max_abs_err={max_err:.6f} compiles={counter.count} jit_cache={dp.compiled_kernel_count()}",
              flush=True)

    # The runtime integration point, called the way the patched get_paged_kernel's caller
    # (paged_forward) calls the runtime kernel: total tokens as max_tokens, prefix lengths given.
    c = cases[1].to(device)
    q_lens = (c.cu_seqlens_q[1:] - c.cu_seqlens_q[:-1]).to(torch.int32)
    runtime_kernel = dp.make_runtime_kernel(args.heads, args.heads_kv, args.dim, args.page_size)
    out = runtime_kernel(c.q, c.k_cache, c.v_cache, c.block_table, c.kv_lens, c.cu_seqlens_q, c.kv_lens - q_lens,
                         int(c.q.shape[0]), 1.0 / math.sqrt(args.dim))
    torch.cuda.synchronize(device)
    ref = reference_paged_prefill(c.q, c.k_cache, c.v_cache, c.block_table, c.cu_seqlens_q, c.kv_lens)
    runtime_err = float((out.double() - ref).abs().max()) if bool(torch.isfinite(out).all()) else float("inf")
    runtime_ok = bool(((out.double() - ref).abs() <= args.atol + args.rtol * ref.abs()).all())
    print(f"runtime integration point ({runtime_kernel!r}) on {c.name}: max_abs_err={runtime_err:.6f} "
          f"compiles={counter.count}", flush=True)

    triples = sorted({tuple(r[k] for k in ("batch", "num_pages", "block_table_width")) for r in results})
    max_err = max(r["max_abs_error"] for r in results)
    bug_caught = {name: max(r["known_bug_max_abs_deviation"][name] for r in results) for name in KNOWN_BUG_MASKS}
    failures = []
    bad = [r["name"] for r in results if not r["within_tolerance"]]
    if bad:
        failures.append(f"cases over tolerance (atol={args.atol}, rtol={args.rtol}): {', '.join(bad)}; max abs error {max_err:.6f}")
    if len(triples) < 3:
        failures.append(f"only {len(triples)} distinct (batch, pages, width) triples; need >= 3")
    if dp.compiled_kernel_count() != 1:
        failures.append(f"{dp.compiled_kernel_count()} entries in the @tilelang.jit kernel cache; expected exactly 1")
    if counter.count != 1:
        failures.append(f"TileLang generated CUDA code {counter.count} times; expected exactly 1 compile "
                        "(0 means the compile counter is not observing TileLang)")
    if not runtime_ok:
        failures.append(f"the runtime integration point is over tolerance (max abs error {runtime_err:.6f})")
    weak = [n for n, dev in bug_caught.items() if dev <= 10 * (args.atol + args.rtol)]
    if weak:
        failures.append(f"the cases would not catch the known bug(s) {', '.join(weak)}")
    return {
        "cases": results,
        "max_abs_error": max_err,
        "tolerance": {"atol": args.atol, "rtol": args.rtol},
        "distinct_shape_triples": [list(t) for t in triples],
        "compile_count_postproc_callback": counter.count,
        "jit_kernel_cache_entries": dp.compiled_kernel_count(),
        "jit_kernel_cache_keys": [repr(k) for k in dp.kernel_cache_keys()],
        "known_bug_max_abs_deviation": bug_caught,
        "runtime_integration_point": {"case": c.name, "max_abs_error": runtime_err, "within_tolerance": runtime_ok,
                                      "callable": repr(runtime_kernel)},
        "tile_config": {"arch": f"sm_{major}{minor}", **vars_of(config)},
        "failures": failures,
        "passed": not failures,
    }


def vars_of(config) -> dict:
    from dataclasses import asdict

    return asdict(config)


# --------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------
def time_cuda(torch, fn, warmup: int, iters: int) -> dict:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "mean_ms": statistics.fmean(times), "min_ms": min(times),
            "iters": iters, "warmup": warmup}


def sdpa_runner(torch, q, k, v, scale: float, q_len: int, kv_len: int):
    """Pick the fastest SDPA backend that does bottom-right causal attention on these shapes.

    Returns (backend name, gqa handling, callable). q [B, Hq, L, D]; k/v [B, Hkv, S, D]. Tries
    flash (its is_causal is bottom-right when L != S) with native GQA, then with K/V expanded
    to every query head, then memory-efficient attention with the lower-right mask type.
    """
    group = q.shape[1] // k.shape[1]
    attempts = []

    def flash(kk, vv):
        return lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, kk, vv, 0.0, True, False, scale=scale)[0]

    def efficient(kk, vv):
        qt, kt, vt = q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)
        # custom_mask_type 2 = causal from bottom right (torch.nn.attention.bias.CausalVariant.LOWER_RIGHT)
        return lambda: torch.ops.aten._efficient_attention_forward(
            qt, kt, vt, None, None, None, None, None, 0.0, 2, False, scale=scale)[0].transpose(1, 2)

    attempts.append(("flash", "native", lambda: flash(k, v)))
    attempts.append(("flash", "expanded", lambda: flash(k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))))
    attempts.append(("efficient", "expanded",
                     lambda: efficient(k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))))
    errors = {}
    for name, gqa, make in attempts:
        try:
            fn = make()
            out = fn()
            torch.cuda.synchronize()
            if out.shape != q.shape:
                raise RuntimeError(f"unexpected output shape {tuple(out.shape)}")
            return name, gqa, fn, errors
        except Exception as exc:  # noqa: BLE001 - record why each backend was not used
            errors[f"{name}/{gqa}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    raise UserError(f"no SDPA backend ran bottom-right causal attention: {errors}")


def run_bench(args, torch, counter: CompileCounter) -> dict:
    from openjev.paged import dynamic_paged as dp
    from openjev.paged.reference import causal_flops, make_case

    device = torch.device(args.device)
    major, minor = torch.cuda.get_device_capability(device)
    config = dp.tile_config_for_arch(major * 10 + minor)
    fractions = [float(x) for x in args.bench_prefix_fractions.split(",") if x.strip()]
    B, S, H, Hkv, D = args.bench_batch, args.bench_seq_len, args.heads, args.heads_kv, args.dim
    scale = 1.0 / math.sqrt(D)
    rows = []
    for frac in fractions:
        if not 0 <= frac < 1:
            raise UserError(f"prefix fraction {frac} must be in [0, 1)")
        prefix = int(round(S * frac))
        q_len = S - prefix
        case = make_case(f"bench_prefix_{frac:g}", [q_len] * B, [prefix] * B, heads=H, heads_kv=Hkv, dim=D,
                         page_size=args.page_size, spare_pages=B, seed=1234, poison=False).to(device)
        flops = causal_flops(case.q_lens, [S] * B, H, D)
        pages = math.ceil(S / args.page_size)

        def kernel_call(c=case, out=torch.empty_like(case.q)):
            dp.dynamic_paged_prefill(c.q, c.k_cache, c.v_cache, c.block_table, c.cu_seqlens_q, c.kv_lens,
                                     max_seqlen_q=q_len, out=out, config=config)

        def gather(c=case):
            # paged -> dense [B, Hkv, S, D] for K and V; ragged q -> [B, H, L, D]
            idx = c.block_table[:, :pages].reshape(-1).long()
            kd = c.k_cache.index_select(0, idx).view(B, pages * args.page_size, Hkv, D)[:, :S]
            vd = c.v_cache.index_select(0, idx).view(B, pages * args.page_size, Hkv, D)[:, :S]
            qd = c.q.view(B, q_len, H, D).transpose(1, 2).contiguous()
            return qd, kd.transpose(1, 2).contiguous(), vd.transpose(1, 2).contiguous()

        qd, kd, vd = gather()
        backend, gqa, sdpa_fn, backend_errors = sdpa_runner(torch, qd, kd, vd, scale, q_len, S)
        group = H // Hkv
        if gqa == "expanded":
            kd_e, vd_e = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
        else:
            kd_e, vd_e = kd, vd
        # Equal dense work: SDPA alone on tensors already in its layout.
        _, _, sdpa_dense_fn, _ = sdpa_runner(torch, qd, kd_e, vd_e, scale, q_len, S) if gqa == "expanded" else (
            None, None, sdpa_fn, None)

        def gather_plus_sdpa():
            q_, k_, v_ = gather()
            if gqa == "expanded":
                k_, v_ = k_.repeat_interleave(group, 1), v_.repeat_interleave(group, 1)
            if backend == "flash":
                o = torch.ops.aten._scaled_dot_product_flash_attention(q_, k_, v_, 0.0, True, False, scale=scale)[0]
            else:
                o = torch.ops.aten._efficient_attention_forward(
                    q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), None, None, None, None, None, 0.0, 2,
                    False, scale=scale)[0].transpose(1, 2)
            return o.transpose(1, 2).reshape(B * q_len, H, D)  # back to the packed ragged layout

        # Same semantics: the kernel and gather+SDPA must agree before either is timed.
        out_k = torch.empty_like(case.q)
        dp.dynamic_paged_prefill(case.q, case.k_cache, case.v_cache, case.block_table, case.cu_seqlens_q,
                                 case.kv_lens, max_seqlen_q=q_len, out=out_k, config=config)
        agree = float((out_k.float() - gather_plus_sdpa().float()).abs().max())
        if not agree <= 2e-2:
            raise UserError(f"kernel and gather+SDPA[{backend}/{gqa}] disagree by {agree} at prefix fraction {frac}; "
                            "the comparison would not be on equal work")
        t_kernel = time_cuda(torch, kernel_call, args.bench_warmup, args.bench_iters)
        t_gather_sdpa = time_cuda(torch, gather_plus_sdpa, args.bench_warmup, args.bench_iters)
        t_sdpa = time_cuda(torch, sdpa_dense_fn, args.bench_warmup, args.bench_iters)

        def tflops(t):
            return flops / (t["median_ms"] * 1e-3) / 1e12

        row = {
            "prefix_fraction": frac, "batch": B, "seq_len": S, "prefix_len": prefix, "q_len": q_len,
            "heads": H, "heads_kv": Hkv, "dim": D, "page_size": args.page_size, "num_pages": case.num_pages,
            "block_table_width": case.width, "causal_flops": flops,
            "sdpa_backend": backend, "sdpa_gqa": gqa, "sdpa_backends_rejected": backend_errors,
            "kernel_vs_gather_sdpa_max_abs_diff": agree,
            "kernel": {**t_kernel, "tflops": tflops(t_kernel)},
            "gather_plus_sdpa": {**t_gather_sdpa, "tflops": tflops(t_gather_sdpa)},
            "sdpa_dense_only": {**t_sdpa, "tflops": tflops(t_sdpa)},
        }
        row["ratio_kernel_over_sdpa_dense"] = row["kernel"]["tflops"] / row["sdpa_dense_only"]["tflops"]
        row["ratio_kernel_over_gather_plus_sdpa"] = row["kernel"]["tflops"] / row["gather_plus_sdpa"]["tflops"]
        rows.append(row)
        print(f"bench prefix={frac:>4.0%} q_len={q_len:<5} kernel {row['kernel']['tflops']:7.1f} TFLOP/s "
              f"({t_kernel['median_ms']:.3f} ms) | gather+SDPA[{backend}/{gqa}] {row['gather_plus_sdpa']['tflops']:7.1f} "
              f"| SDPA dense {row['sdpa_dense_only']['tflops']:7.1f} | kernel/SDPA {row['ratio_kernel_over_sdpa_dense']:.2f}x "
              f"kernel/(gather+SDPA) {row['ratio_kernel_over_gather_plus_sdpa']:.2f}x | agree {agree:.2e}", flush=True)
        del case, qd, kd, vd, kd_e, vd_e
        torch.cuda.empty_cache()
    return {"rows": rows, "compile_count_postproc_callback": counter.count,
            "jit_kernel_cache_entries": dp.compiled_kernel_count(),
            "tile_config": {"arch": f"sm_{major}{minor}", **vars_of(config)},
            "timing": "CUDA events around each launch, median of the timed launches after warm-up",
            "flops_convention": "4 * sum over queries of visible keys * dim * heads"}


# --------------------------------------------------------------------------------------------
# Code generation only
# --------------------------------------------------------------------------------------------
def run_codegen(args, counter: CompileCounter) -> dict:
    from openjev.paged import dynamic_paged as dp

    t0 = time.perf_counter()
    lowered = dp.lower_for_arch(args.codegen_only_arch, heads=args.heads, heads_kv=args.heads_kv, dim=args.dim,
                                page_size=args.page_size)
    lower_s = time.perf_counter() - t0
    source = lowered.pop("source")
    if args.codegen_source:
        args.codegen_source.write_text(source)
    result = {**lowered, "lower_seconds": round(lower_s, 1), "codegen_callbacks": counter.count,
              "heads": args.heads, "heads_kv": args.heads_kv, "dim": args.dim, "page_size": args.page_size}
    failures = []
    if result["arch"] == "sm_70":
        if not result["uses_sm70_mma"]:
            failures.append("the sm_70 code does not use Volta mma.sync (m16n16k4); it fell back to FMA")
        for key in ("uses_cp_async", "uses_tma", "uses_wgmma"):
            if result[key]:
                failures.append(f"the sm_70 code uses an instruction Volta lacks ({key})")
    if args.nvcc:
        result["nvcc"] = build_cubin(source, args.codegen_only_arch, args.nvcc)
        if result["nvcc"]["returncode"] != 0:
            failures.append(f"nvcc failed: {result['nvcc']['stderr_tail'][-300:]}")
    result["failures"] = failures
    result["passed"] = not failures
    print(f"codegen {result['arch']}: lowered in {lower_s:.1f}s, {result['source_chars']} chars of CUDA, "
          f"sm70 mma={result['uses_sm70_mma']} cp.async={result['uses_cp_async']} tma={result['uses_tma']} "
          f"wgmma={result['uses_wgmma']} shared memory={result['shared_memory_bytes']} B", flush=True)
    return result


def build_cubin(source: str, arch: str, nvcc: str) -> dict:
    from openjev.paged.dynamic_paged import _parse_arch
    from tilelang.cuda.backend import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    cc = _parse_arch(arch)
    with tempfile.TemporaryDirectory(prefix="dynamic-paged-cubin-") as tmp:
        src = Path(tmp, "kernel.cu")
        src.write_text(source)
        cmd = [nvcc, "-std=c++17", f"-arch=sm_{cc}", "-cubin", "-Xptxas", "-v", "-w",
               f"-I{TILELANG_TEMPLATE_PATH}", f"-I{CUTLASS_INCLUDE_DIR}", "-o", str(Path(tmp, "kernel.cubin")), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        info = {"command": " ".join(cmd[:4]) + " ...", "returncode": proc.returncode, "version": nvcc_version(nvcc),
                "stderr_tail": proc.stderr[-2000:]}
        m = re.search(r"Used (\d+) registers", proc.stderr)
        if m:
            info["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", proc.stderr)
        if m:
            info["spill_store_bytes"], info["spill_load_bytes"] = int(m.group(1)), int(m.group(2))
        return info


# --------------------------------------------------------------------------------------------
def main() -> int:
    args = build_parser().parse_args()
    for name in ("heads", "heads_kv", "dim", "page_size", "bench_batch", "bench_seq_len", "bench_iters"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    if args.heads % args.heads_kv:
        raise UserError(f"--heads ({args.heads}) must be a multiple of --heads-kv ({args.heads_kv})")
    if args.nvcc and not args.codegen_only_arch:
        raise UserError("--nvcc only applies with --codegen-only-arch")

    counter, cache_dir = setup_tilelang(args.keep_disk_cache)
    import tilelang
    import torch

    gpu = gpu_facts(torch)
    label = machine_label(gpu.get("gpu_name"))
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])

    def write_receipt(path: Path, kind: str, payload: dict) -> None:
        atomic_write_json(path, {
            "kind": kind, "machine": label, "recorded_at": utc_now(), "command": command,
            "tilelang_version": getattr(tilelang, "__version__", None), "torch_version": torch.__version__,
            "result": payload, "environment": receipt_environment(torch),
        })

    try:
        if args.codegen_only_arch:
            payload = run_codegen(args, counter)
            kind = "dynamic_paged_codegen"
        else:
            if not torch.cuda.is_available():
                raise UserError("no CUDA device visible to torch; use --codegen-only-arch for a GPU-less build check")
            payload = run_check(args, torch, counter)
            kind = "dynamic_paged_check"
            print(f"max abs error: {payload['max_abs_error']:.6f} over {len(payload['cases'])} cases "
                  f"(atol={args.atol}, rtol={args.rtol})", flush=True)
            print(f"compiled kernels: {payload['jit_kernel_cache_entries']} (TileLang code generations: "
                  f"{payload['compile_count_postproc_callback']}) across (batch, pages, width) triples "
                  f"{payload['distinct_shape_triples']}", flush=True)
            print("known-bug deviations from the reference: " + ", ".join(
                f"{k}={v:.4f}" for k, v in payload["known_bug_max_abs_deviation"].items()), flush=True)
        if args.json:
            write_receipt(args.json, kind, payload)
        if payload["failures"]:
            raise UserError("; ".join(payload["failures"]))
        print(f"{kind}: passed on {label}", flush=True)

        if args.bench and not args.codegen_only_arch:
            bench = run_bench(args, torch, counter)
            if args.bench_json:
                write_receipt(args.bench_json, "dynamic_paged_bench", bench)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - one clear line for operators, traceback on request
        if args.verbose:
            traceback.print_exc()
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        raise UserError(f"{type(exc).__name__}: {last}") from None
    finally:
        if cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    run_main(main)
