#!/usr/bin/env python3
"""Record sgl-kernel CPU op calls that /classify's engine never makes, by direct calls.

SGLang's engine calls `causal_conv1d_update_cpu` and `fused_sigmoid_gating_delta_rule_update_cpu`
only when it decodes (generates tokens); an embedding/classification server only prefills, so the
engine recording (tests/sglang_openjev_cpu/record.py) never sees them. This script calls the real built
ops with random inputs of the shapes and dtypes the engine passes for the tiny-gdn64 model in
bf16 (2 key heads and 4 value heads of dim 64, conv width 4, float32 GDN states, int32 indices;
read from sglang/srt/layers/attention/linear/gdn_backend.py and kernels/gdn_triton.py's decode path)
and records them through the same recorder, marked `"source": "direct"`; also one raw varlen
`causal_conv1d_fwd_cpu` call with a row continuing its conv history (has_initial_state True).

    PYTHONPATH=tests build/sglang-venvs/0.5.23/bin/python benchmarks/sgl_cpu_ops_record_direct.py \\
        --ops-lib /tmp/sgl-cpu-build/out/common_ops.so --out tests/data/sgl_cpu_ops
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops-lib", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import torch

    from sglang_openjev_cpu.record import RecordingOp

    torch.ops.load_library(str(a.ops_lib))
    g = torch.Generator().manual_seed(a.seed)
    bf = torch.bfloat16
    hk, hv, dk, dv, width = 2, 4, 64, 64, 4
    dim = hk * dk * 2 + hv * dv
    ns = torch.ops.sgl_kernel

    def rnd(*shape, dtype=bf, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    conv = RecordingOp("causal_conv1d_update_cpu", ns.causal_conv1d_update_cpu, a.out, 2, source="direct")
    gdn = RecordingOp("fused_sigmoid_gating_delta_rule_update_cpu", ns.fused_sigmoid_gating_delta_rule_update_cpu,
                      a.out, 2, source="direct")
    for batch, slots in ((1, 2), (2, 4)):
        idx = torch.randperm(slots, generator=g)[:batch].to(torch.int32)
        # the conv-state pool in the layout SGLang gives it (strides (.., 1, dim)), weights unpacked (is_vnni False)
        conv(rnd(batch, dim), rnd(slots, width - 1, dim).transpose(1, 2), rnd(dim, width, scale=0.5), None, True,
             None, idx, -1, False)
        q, k = rnd(1, batch, hk, dk), rnd(1, batch, hk, dk)
        v = rnd(1, batch, hv, dv)
        A_log = torch.rand(hv, generator=g) * 2.0
        dt_bias = rnd(hv, scale=0.5)
        aa, bb = rnd(batch, hv), rnd(batch, hv)
        state = torch.randn(slots, hv, dk, dv, generator=g) * 0.1
        cu = torch.arange(batch + 1, dtype=torch.int32)
        gdn(A_log, dt_bias, q, k, v, aa, bb, state, idx, cu, True, 1.0, 20.0)
    # The raw varlen prefill op on a row that continues a conv history (has_initial_state True):
    # through sglang_openjev_cpu the engine never passes that (the glue prepends the history, see
    # runtime._conv_fwd_with_history), but it is the kernel's own behaviour the stand-in must share.
    fwd = RecordingOp("causal_conv1d_fwd_cpu", ns.causal_conv1d_fwd_cpu, a.out, 1, source="direct")
    x = rnd(8, dim).t()  # [dim, tokens], the layout the kernel requires
    fwd(x, rnd(dim, width, scale=0.5), None, rnd(3, width - 1, dim).transpose(1, 2),
        torch.tensor([0, 5, 8], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32),
        torch.tensor([True, False]), True, -1, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
