"""openjev/paged/ (dynamic paged prefill), app/check_dynamic_paged.py and patches/dynamic-paged.patch.

CPU tests check the dense reference against a plain per-sequence loop, that the known
prefix/causal bugs are far outside the check's tolerance on its cases, the case generator's
invariants, the runtime integration point's argument plumbing, the script's --help, and that
the patch is a well-formed git diff touching only the intended runtime file. GPU tests run the
real check and skip, with the reason shown by `pytest -rs`, where CUDA or TileLang is absent.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

from openjev.paged import dynamic_paged as dp
from openjev.paged.reference import (KNOWN_BUG_MASKS, causal_flops, causal_visibility, check_cases,
                                     dense_attention, gather_sequence_kv, make_case, random_case,
                                     reference_paged_prefill)

SCRIPT = REPO / "app" / "check_dynamic_paged.py"
PATCH = REPO / "patches" / "dynamic-paged.patch"
RUNTIME_FILE = "python/sglang/srt/layers/attention/tilelang_fa_v100/_kernels_paged.py"
SMALL = dict(heads=4, heads_kv=2, dim=16, page_size=4)
ATOL = 2e-3  # the check's default absolute tolerance


def loop_reference(case, sm_scale: float) -> torch.Tensor:
    """The definition, one query row at a time, reading the paged cache slot by slot."""
    q, kc, vc = case.q.double(), case.k_cache.double(), case.v_cache.double()
    heads, heads_kv, page = q.shape[1], kc.shape[2], kc.shape[1]
    out = torch.zeros_like(q)
    cu = case.cu_seqlens_q.tolist()
    for b, (q_len, prefix) in enumerate(zip(case.q_lens, case.prefix_lens)):
        for i in range(q_len):
            for h in range(heads):
                hk = h // (heads // heads_kv)
                logits, values = [], []
                for j in range(prefix + q_len):
                    if j > prefix + i:  # bottom-right causal: only keys up to the query itself
                        continue
                    slot = kc[int(case.block_table[b, j // page]), j % page, hk]
                    logits.append(float(q[cu[b] + i, h] @ slot) * sm_scale)
                    values.append(vc[int(case.block_table[b, j // page]), j % page, hk])
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                out[cu[b] + i, h] = sum(wi * v for wi, v in zip(w, values)) / sum(w)
    return out


# ------------------------------------------------------------------------------ reference
def test_reference_matches_per_sequence_loop():
    case = make_case("loop", q_lens=[1, 3, 6, 2], prefix_lens=[0, 5, 2, 9], spare_pages=2, extra_width=1,
                     seed=3, **SMALL)
    scale = 1.0 / math.sqrt(SMALL["dim"])
    ref = reference_paged_prefill(case.q, case.k_cache, case.v_cache, case.block_table, case.cu_seqlens_q,
                                  case.kv_lens, scale)
    assert torch.isfinite(ref).all(), "the reference read a poisoned (NaN) slot"
    torch.testing.assert_close(ref, loop_reference(case, scale), atol=1e-10, rtol=1e-10)


def test_reference_float32_close_to_float64():
    case = random_case("f32", batch=4, seed=5, max_q=9, max_prefix=20, **SMALL)
    args = (case.q, case.k_cache, case.v_cache, case.block_table, case.cu_seqlens_q, case.kv_lens)
    ref64 = reference_paged_prefill(*args)
    ref32 = reference_paged_prefill(*args, compute_dtype=torch.float32)
    assert ref32.dtype == torch.float32
    assert float((ref32.double() - ref64).abs().max()) < 1e-5


def test_causal_visibility_is_bottom_right():
    # 3 new tokens after a 2-token cached prefix: query i sees keys 0..2+i
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_visibility(3, 5), expected)
    assert torch.equal(causal_visibility(3, 3), torch.tril(torch.ones(3, 3, dtype=torch.bool)))
    with pytest.raises(ValueError):
        causal_visibility(4, 3)


def test_fully_masked_rows_are_defined_as_zero():
    q = torch.randn(2, 2, 8, dtype=torch.float64)
    k = torch.randn(3, 1, 8, dtype=torch.float64)
    v = torch.randn(3, 1, 8, dtype=torch.float64)
    visible = torch.tensor([[False, False, False], [True, True, False]])
    out = dense_attention(q, k, v, visible, 0.5)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert float(out[1].abs().sum()) > 0


def test_known_bugs_fail_the_tolerance_only_with_several_new_tokens():
    case = make_case("bug", q_lens=[5, 1], prefix_lens=[7, 9], seed=11, **SMALL)
    args = (case.q, case.k_cache, case.v_cache, case.block_table, case.cu_seqlens_q, case.kv_lens)
    ref = reference_paged_prefill(*args)
    several, single = slice(0, 5), slice(5, 6)
    for name, mask in KNOWN_BUG_MASKS.items():
        buggy = reference_paged_prefill(*args, mask_fn=mask)
        # a chunk with a cached prefix and several new tokens exposes the bug far beyond tolerance...
        assert float((buggy[several] - ref[several]).abs().max()) > 50 * ATOL, name
        # ...while a one-token chunk cannot (its last key is itself), which is why the cases need both
        assert float((buggy[single] - ref[single]).abs().max()) == 0.0, name


def test_causal_flops_counts_visible_keys():
    q_lens, kv_lens, heads, dim = [3, 4], [5, 4], 2, 8
    visible = sum(int(causal_visibility(q, kv).sum()) for q, kv in zip(q_lens, kv_lens))
    assert causal_flops(q_lens, kv_lens, heads, dim) == 4 * visible * dim * heads


# ------------------------------------------------------------------------------ generator
def test_generator_invariants():
    case = make_case("inv", q_lens=[7, 1, 12, 3], prefix_lens=[0, 9, 30, 5], spare_pages=6, extra_width=3,
                     seed=1, **SMALL)
    ps = case.page_size
    assert case.kv_lens.tolist() == [p + q for p, q in zip(case.prefix_lens, case.q_lens)]
    assert case.cu_seqlens_q.tolist() == [0, 7, 8, 20, 23]
    assert case.q.shape == (23, SMALL["heads"], SMALL["dim"])
    assert case.block_table.dtype == case.cu_seqlens_q.dtype == case.kv_lens.dtype == torch.int32
    used = []
    for b, kv in enumerate(case.kv_lens.tolist()):
        n = math.ceil(kv / ps)
        used += case.block_table[b, :n].tolist()
        pad = set(case.block_table[b, n:].tolist())
        assert len(pad) <= 1 and pad.isdisjoint(used)  # padding entries all name the one pad page
    assert len(used) == len(set(used)), "a physical page is shared between logical pages"
    assert all(0 <= p < case.num_pages for p in used)
    assert used != sorted(used), "physical pages are not shuffled"
    assert case.num_pages == len(used) + 6 + 1  # + spare pages + the padding page
    assert case.width == max(math.ceil(kv / ps) for kv in case.kv_lens.tolist()) + 3
    # poison: exactly the slots no sequence may read are NaN
    readable = 0
    for b, kv in enumerate(case.kv_lens.tolist()):
        k, v = gather_sequence_kv(case.k_cache, case.v_cache, case.block_table[b], kv)
        assert torch.isfinite(k).all() and torch.isfinite(v).all()
        readable += kv
    nan_slots = int(torch.isnan(case.k_cache[..., 0, 0]).sum())
    assert nan_slots == case.num_pages * ps - readable


def test_block_tables_come_from_a_permutation():
    # 6 sequences of 32 keys on 4-token pages: 8 pages each, no padding entries, no spare pages
    case = make_case("perm", q_lens=[16] * 6, prefix_lens=[16] * 6, spare_pages=0, seed=2, **SMALL)
    flat = case.block_table.flatten().tolist()
    assert len(flat) == len(set(flat)) == case.num_pages - 1  # all but the padding page, each once
    expected = torch.randperm(case.num_pages, generator=torch.Generator().manual_seed(2))[:len(flat)]
    assert flat == expected.tolist()
    assert flat != sorted(flat)


def test_check_cases_cover_three_triples_and_the_bug_shapes():
    cases = check_cases(**SMALL)
    triples = {c.shape_triple for c in cases}
    assert len(triples) >= 3 and len(triples) == len(cases)
    chunks = [(p, q) for c in cases for p, q in zip(c.prefix_lens, c.q_lens)]
    assert any(p > 0 and q >= 2 for p, q in chunks), "no chunk with a cached prefix and several new tokens"
    assert any(p == 0 for p, _ in chunks), "no chunk without a cached prefix"
    assert any(q == 1 for _, q in chunks)
    assert all(c.poisoned for c in cases)
    # lengths that are not multiples of the page size or of the tile sizes
    assert any((p + q) % SMALL["page_size"] for p, q in chunks)
    assert any(q % 64 for _, q in chunks)


def test_random_case_forces_a_prefix_chunk():
    case = random_case("r", batch=3, seed=0, max_q=4, max_prefix=10, prefix_probability=0.0, **SMALL)
    assert any(p > 0 and q >= 2 for p, q in zip(case.prefix_lens, case.q_lens))


# ------------------------------------------------------------------------------ kernel module (CPU side)
def test_import_needs_no_tilelang():
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('tilelang', 'tvm', 'tvm_ffi'):\n"
        "            raise ImportError('blocked for the test: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import openjev.paged as paged\n"
        "from openjev.paged import dynamic_paged, reference\n"
        "assert 'tilelang' not in sys.modules\n"
        "print(paged.tile_config_for_arch('sm_70'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "block_M=64" in proc.stdout


@pytest.mark.parametrize("arch,limit", [("sm_70", 96 * 1024), ("7.0", 96 * 1024), ("sm_90", 227 * 1024),
                                        (80, 163 * 1024)])
def test_tile_configs_fit_shared_memory(arch, limit):
    cfg = dp.tile_config_for_arch(arch)
    assert cfg.shared_memory_bytes(256) <= limit
    # Volta mma_sm70: m, n multiples of 16; no cp.async pipeline on SM70
    assert cfg.block_M % 16 == 0 and cfg.block_N % 16 == 0
    if dp._parse_arch(arch) < 80:
        assert cfg.num_stages == 0


def test_tile_config_rejects_pre_volta():
    with pytest.raises(ValueError):
        dp.tile_config_for_arch("sm_61")


def test_validate_inputs_rejects_bad_shapes():
    case = make_case("v", q_lens=[3], prefix_lens=[2], **SMALL)
    args = [case.q, case.k_cache, case.v_cache, case.block_table, case.cu_seqlens_q, case.kv_lens]
    dp.validate_inputs(*args)
    bad = list(args)
    bad[4] = case.cu_seqlens_q[:-1]
    with pytest.raises(ValueError, match="batch\\+1"):
        dp.validate_inputs(*bad)
    bad = list(args)
    bad[3] = case.block_table.long()
    with pytest.raises(ValueError, match="int32"):
        dp.validate_inputs(*bad)
    bad = list(args)
    bad[0] = case.q.float()
    with pytest.raises(ValueError, match="float16"):
        dp.validate_inputs(*bad)


def test_runtime_integration_point_plumbing(monkeypatch):
    """The patched runtime calls the kernel as kernel(q, k_cache, v_cache, block_table,
    cache_seqlens, query_start_loc, prefix_kv_lens, max_tokens, sm_scale); check the mapping
    onto dynamic_paged_prefill with the kernel launch replaced by the reference."""
    runtime_args = ["q", "k_cache", "v_cache", "block_table", "cache_seqlens", "query_start_loc",
                    "prefix_kv_lens", "max_tokens", "sm_scale"]
    assert list(inspect.signature(dp.RuntimePagedKernel.__call__).parameters)[1:] == runtime_args
    seen = {}

    def fake(q, k, v, bt, cu, kl, sm_scale=None, *, max_seqlen_q=None, out=None, config=None):
        seen["max_seqlen_q"] = max_seqlen_q
        return reference_paged_prefill(q, k, v, bt, cu, kl, sm_scale).to(torch.float16)

    monkeypatch.setattr(dp, "dynamic_paged_prefill", fake)
    case = make_case("rt", q_lens=[4, 9, 2], prefix_lens=[3, 0, 11], seed=4, **SMALL)
    kernel = dp.make_runtime_kernel(SMALL["heads"], SMALL["heads_kv"], SMALL["dim"], SMALL["page_size"])
    assert kernel is dp.make_runtime_kernel(SMALL["heads"], SMALL["heads_kv"], SMALL["dim"], SMALL["page_size"])
    prefix = torch.tensor(case.prefix_lens, dtype=torch.int32)
    out = kernel(case.q, case.k_cache, case.v_cache, case.block_table, case.kv_lens, case.cu_seqlens_q, prefix,
                 int(case.q.shape[0]), 0.25)
    assert seen["max_seqlen_q"] == 9  # the longest chunk, not the runtime's total token count
    ref = reference_paged_prefill(case.q, case.k_cache, case.v_cache, case.block_table, case.cu_seqlens_q,
                                  case.kv_lens, 0.25)
    assert float((out.double() - ref).abs().max()) < ATOL
    with pytest.raises(ValueError, match="bound to"):
        dp.make_runtime_kernel(8, 2, 16, 4)(case.q, case.k_cache, case.v_cache, case.block_table, case.kv_lens,
                                            case.cu_seqlens_q, prefix, 16, 0.25)


# ------------------------------------------------------------------------------ script
def test_help_documents_shapes_and_modes():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for text in ("block_table", "cu_seqlens_q", "kv_lens", "[num_pages, page_size, heads_kv, dim]",
                 "--codegen-only-arch", "--bench", "--json", "--nvcc", "bottom-right"):
        assert text in proc.stdout, text


def test_bad_arguments_fail_with_one_line():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--heads", "6", "--heads-kv", "4"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "multiple of --heads-kv" in lines[0]


# ------------------------------------------------------------------------------ patch
def _patch_diff_text() -> str:
    text = PATCH.read_text()
    return text[text.index("diff --git "):]


def test_patch_header_names_revisions_and_switch():
    header = PATCH.read_text().split("diff --git ", 1)[0]
    assert "dca488908ee4e3f1bc676c3bf5dcd26ff049cfc3" in header
    assert "319dd230299a58c61423fdc49e64b66f972bae38" in header
    assert "SGLANG_V100_DYNAMIC_PAGED=0" in header


def test_patch_is_a_well_formed_diff_of_one_runtime_file():
    diff = _patch_diff_text()
    files = re.findall(r"^diff --git a/(\S+) b/(\S+)$", diff, flags=re.M)
    assert files == [(RUNTIME_FILE, RUNTIME_FILE)]
    assert re.findall(r"^--- (\S+)$", diff, flags=re.M) == [f"a/{RUNTIME_FILE}"]
    assert re.findall(r"^\+\+\+ (\S+)$", diff, flags=re.M) == [f"b/{RUNTIME_FILE}"]
    hunks = re.split(r"^(@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@.*)$", diff, flags=re.M)[1:]
    assert hunks, "no hunks"
    added = []
    for header, body in zip(hunks[::2], hunks[1::2]):
        old_start, old_len, new_start, new_len = map(int, re.match(
            r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@", header).groups())
        lines = body.strip("\n").split("\n")
        assert sum(1 for ln in lines if ln[:1] in (" ", "-")) == old_len, header
        assert sum(1 for ln in lines if ln[:1] in (" ", "+")) == new_len, header
        assert all(ln[:1] in (" ", "-", "+") for ln in lines), header
        added += [ln[1:] for ln in lines if ln.startswith("+")]
    assert not any(ln.startswith("-") for h in hunks[1::2] for ln in h.split("\n")), "the patch removes runtime lines"
    joined = "\n".join(added)
    assert "SGLANG_V100_DYNAMIC_PAGED" in joined and "make_runtime_kernel" in joined
    # the added top-level functions are valid Python on their own
    funcs = joined[joined.index("def _dynamic_paged_enabled"):joined.index("def get_paged_kernel") if
                   "def get_paged_kernel" in joined else None]
    compile("import os\n" + funcs, "added-lines", "exec")


def test_patch_applies_with_git_to_its_reconstructed_context(tmp_path):
    """Rebuild only what the hunks need (their context and removed lines at their line
    numbers, blank filler elsewhere: no upstream source is stored) and run git apply --check,
    so git's own parser accepts the patch, then apply it and check the switch is in place."""
    diff = _patch_diff_text()
    hunks = re.findall(r"^@@ -(\d+),(\d+) \+\d+,\d+ @@.*\n((?:[ +\-].*\n?)*)", diff, flags=re.M)
    lines: list[str] = []
    for start, _, body in hunks:
        pre = [ln[1:] for ln in body.rstrip("\n").split("\n") if ln[:1] in (" ", "-")]
        start = int(start)
        lines += [f"# filler {i}" for i in range(len(lines), start - 1)]
        lines += pre
    target = tmp_path / RUNTIME_FILE
    target.parent.mkdir(parents=True)
    target.write_text("\n".join(lines) + "\n")
    git = ["git", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    proc = subprocess.run([*git, "apply", "--check", "-v", str(PATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    subprocess.run([*git, "apply", str(PATCH)], check=True)
    patched = target.read_text()
    assert "if causal and _dynamic_paged_enabled():" in patched
    assert "import os\n" in patched


# ------------------------------------------------------------------------------ receipts
@pytest.mark.parametrize("name", ["dynamic_paged_check_h200.json", "dynamic_paged_bench_h200.json"])
def test_h200_receipts_are_labelled_and_consistent(name):
    path = REPO / "results_h200" / name
    if not path.exists():
        pytest.skip(f"{path.name} not recorded yet (made by app/check_dynamic_paged.py on a GPU)")
    receipt = json.loads(path.read_text())
    assert receipt["machine"] == "NVIDIA H200, not a V100"
    assert receipt["environment"]["gpu_name"] == "NVIDIA H200"
    result = receipt["result"]
    assert result["compile_count_postproc_callback"] == 1 and result["jit_kernel_cache_entries"] == 1
    if receipt["kind"] == "dynamic_paged_check":
        assert result["passed"] and len(result["distinct_shape_triples"]) >= 3
        assert result["max_abs_error"] == max(c["max_abs_error"] for c in result["cases"])
    else:
        for row in result["rows"]:
            assert math.isclose(row["kernel"]["tflops"],
                                row["causal_flops"] / (row["kernel"]["median_ms"] * 1e-3) / 1e12)
            assert row["causal_flops"] == causal_flops([row["q_len"]] * row["batch"],
                                                       [row["seq_len"]] * row["batch"], row["heads"], row["dim"])


# ------------------------------------------------------------------------------ GPU
def _tilelang_reason() -> str | None:
    if importlib.util.find_spec("tilelang") is None:
        return "tilelang is not installed (pip install tilelang==0.1.15); the kernel cannot be built here"
    return None


def test_gpu_check_passes_with_one_compile(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the kernel check needs a GPU (H200 receipts: results_h200/dynamic_paged_*.json)")
    reason = _tilelang_reason()
    if reason:
        pytest.skip(reason)
    receipt = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", str(receipt)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "max abs error:" in proc.stdout
    result = json.loads(receipt.read_text())["result"]
    assert result["compile_count_postproc_callback"] == 1 and len(result["distinct_shape_triples"]) >= 3


def test_sm70_codegen_uses_volta_mma(tmp_path):
    reason = _tilelang_reason()
    if reason:
        pytest.skip(reason)
    receipt = tmp_path / "codegen.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--codegen-only-arch", "sm_70", "--json", str(receipt)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(receipt.read_text())["result"]
    assert result["uses_sm70_mma"] and not (result["uses_cp_async"] or result["uses_tma"] or result["uses_wgmma"])
