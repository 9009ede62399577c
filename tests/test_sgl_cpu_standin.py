"""The pure-PyTorch stand-ins for sgl-kernel's CPU ops (openjev_testsupport.sgl_kernel_cpu_standin)
against the real kernel, op by op, on the recorded calls in tests/data/sgl_cpu_ops/.

The recordings (manifest.json there) are inputs and outputs of the compiled library (github:mingfeima/
sglang 2f14d6c, sgl-kernel/csrc/cpu) captured inside SGLang 0.5.23's CPU engine serving /classify, plus
direct calls of the decode ops. Each case is re-run through torch.ops.sgl_kernel.<op> (the stand-in,
registered under the kernel's own schema) with every tensor rebuilt at its recorded shape, dtype and
strides; outputs and the tensors the op changes in place must match the recording within the op's
tolerance below: |stand-in - kernel| <= atol + rtol * |kernel| element by element, or, for the chunked
GDN prefill, <= frac * max|kernel| over the tensor (atol is also a fraction of max|kernel|).

Needs only torch and numpy: runs in the project venv (CI's main suite) and in the SGLang venvs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import openjev_testsupport.sgl_kernel_cpu_standin as standin

DATA = Path(__file__).resolve().parent / "data" / "sgl_cpu_ops"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
# (rtol, atol as a fraction of the tensor's max |kernel|): one bfloat16 unit in the last place (8-bit
# significand) of each element, plus 2^-12 of the tensor's scale for elements that cancel to about zero
BF16_ULP = (2.0 ** -7, 2.0 ** -12)
EXACT = (0.0, 0.0)
F32 = (1e-5, 1e-7)

# op -> {output or "<arg>.after": (rtol, atol) | ("frac", f)}; "*" for the rest of that op's tensors.
TOLERANCES = {
    "fused_sigmoid_mul_cpu": {"*": BF16_ULP},
    "fused_rmsnorm_gated_cpu": {"*": BF16_ULP},
    "fused_qk_gemma_rmsnorm_with_gate_cpu": {"*": BF16_ULP, "out2": EXACT},          # out2: the gate, copied
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": {"*": EXACT},                  # a split: copies only
    "fused_gdn_gating_cpu": {"out0": F32, "out1": BF16_ULP},                         # g float32, beta bf16
    "causal_conv1d_fwd_cpu": {"out0": BF16_ULP, "conv_states.after": EXACT},
    "causal_conv1d_update_cpu": {"out0": BF16_ULP, "conv_states.after": EXACT},
    "fused_sigmoid_gating_delta_rule_update_cpu": {"out0": BF16_ULP, "initial_state_source.after": F32},
    # the kernel keeps bf16 intermediates in its AMX-tile matmuls (solved block, w, u, state operand):
    # 1% of the tensor's largest magnitude
    "chunk_gated_delta_rule_cpu": {"*": ("frac", 0.01)},
}

CASES = [(op, case["case"]) for op, spec in sorted(MANIFEST["ops"].items()) for case in spec["cases"]]


def tensor(op: str, spec: dict, file_key: str = "file") -> torch.Tensor:
    arr = np.load(DATA / op / spec[file_key])
    t = torch.from_numpy(arr)
    if spec["dtype"] == "bfloat16":  # stored as uint16 bit patterns
        t = t.view(torch.bfloat16)
    assert list(t.shape) == spec["shape"] and str(t.dtype) == f"torch.{spec['dtype']}", (spec, t.shape, t.dtype)
    if file_key == "file" and "strides" in spec:  # the layout the kernel was given (transposed x, re-laid pools)
        laid = torch.empty_strided(tuple(spec["shape"]), tuple(spec["strides"]), dtype=t.dtype)
        laid.copy_(t)
        return laid
    return t


def check(op: str, name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    rules = TOLERANCES[op]
    rule = rules.get(name, rules.get("*"))
    assert rule is not None, f"no tolerance stated for {op} {name}"
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (name, got.dtype, want.dtype,
                                                                               got.shape, want.shape)
    g, w = got.float(), want.float()
    diff = (g - w).abs()
    if rule[0] == "frac":
        bound = rule[1] * float(w.abs().max())
        ok = bool((diff <= bound).all())
        figure = f"max |diff| {float(diff.max()):.3g} <= {rule[1]} x max|kernel| {float(w.abs().max()):.3g}"
    else:
        rtol, atol = rule[0], rule[1] * float(w.abs().max())
        ok = bool((diff <= atol + rtol * w.abs()).all())
        figure = f"max |diff| {float(diff.max()):.3g} (rtol {rtol:.3g}, atol {atol:.3g}, max|kernel| {float(w.abs().max()):.3g})"
    assert ok, f"{op} {name}: {figure}"
    return figure


def test_the_recordings_cover_the_ops_sglang_calls():
    called = {"causal_conv1d_fwd_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu", "fused_gdn_gating_cpu",
              "fused_sigmoid_gating_delta_rule_update_cpu", "fused_qkvzba_split_reshape_cat_contiguous_cpu",
              "fused_qk_gemma_rmsnorm_with_gate_cpu", "fused_rmsnorm_gated_cpu", "fused_sigmoid_mul_cpu"}
    assert set(MANIFEST["ops"]) == called
    # the stand-ins register these nine plus fused_qk_gemma_rmsnorm_cpu, which qwen3_5.py only looks up
    assert set(standin.SCHEMAS) == called | {"fused_qk_gemma_rmsnorm_cpu"}


@pytest.mark.parametrize("op", sorted(MANIFEST["ops"]))
def test_the_stand_in_has_the_kernels_schema(op):
    registered = str(getattr(torch.ops.sgl_kernel, op).default._schema)
    assert registered == MANIFEST["ops"][op]["schema"]


@pytest.mark.parametrize("op,case", CASES, ids=[f"{op}-{case}" for op, case in CASES])
def test_the_stand_in_matches_the_kernel_on_the_recorded_call(op, case):
    rec = json.loads((DATA / op / f"{case}.json").read_text())
    args = [tensor(op, a) if "file" in a else a["value"] for a in rec["args"]]
    out = getattr(torch.ops.sgl_kernel, op)(*args)
    out = out if isinstance(out, tuple) else (out,)
    assert len(out) == len(rec["outputs"])
    figures = []
    for i, (got, spec) in enumerate(zip(out, rec["outputs"])):
        figures.append(f"out{i}: " + check(op, f"out{i}", got, tensor(op, spec)))
    for a, value in zip(rec["args"], args):
        if "after_file" in a:  # changed in place by the kernel: the stand-in must leave the same values
            figures.append(f"{a['name']}: " + check(op, f"{a['name']}.after", value, tensor(op, a, "after_file")))
        elif "file" in a:
            assert a["name"] not in rec.get("mutated", []), a["name"]
    print(f"{op} {case}: " + "; ".join(figures))


def test_the_stand_in_refuses_what_the_kernel_refuses():
    """The CPU engine's obstacle: GDN head dims other than 64/128 are refused, with the kernel's message."""
    q = torch.zeros(1, 5, 2, 32, dtype=torch.bfloat16)
    v = torch.zeros(1, 5, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Unexpected head dim size, 32"):
        torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu(
            q, q, v, torch.zeros(1, 5, 2), torch.zeros(1, 5, 2, dtype=torch.bfloat16), torch.zeros(1, 2, 32, 32),
            True, torch.tensor([0, 5], dtype=torch.int32), False, True, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="scalar path not implemented"):  # the kernel's float16 conv
        torch.ops.sgl_kernel.causal_conv1d_update_cpu(
            torch.zeros(1, 64, dtype=torch.float16), torch.zeros(1, 64, 3, dtype=torch.float16),
            torch.zeros(64, 4, dtype=torch.float16), None, True, None, None, -1, False)
    with pytest.raises(RuntimeError, match="already defines"):  # a second registration (the library loaded too)
        standin._LIB, saved = None, standin._LIB
        try:
            standin.register()
        finally:
            standin._LIB = saved
