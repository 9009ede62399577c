"""Pure parts of sglang_openjev_cpu: the CPU entry point's flags and refusals, and the
conv-history correction, checked against a plain PyTorch causal convolution. The engine itself runs in
tests/test_sglang_cpu_engine.py (real SGLang venv); these need only torch."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sglang_openjev_cpu import runtime, serve  # noqa: E402


def test_ops_choice_refuses_unset_and_missing(tmp_path):
    with pytest.raises(runtime.CpuRuntimeError, match="is not set"):
        runtime.ops_choice({})
    with pytest.raises(runtime.CpuRuntimeError, match="no such file"):
        runtime.ops_choice({runtime.OPS_ENV: str(tmp_path / "nope.so")})
    lib = tmp_path / "common_ops.so"
    lib.write_bytes(b"")
    assert runtime.ops_choice({runtime.OPS_ENV: str(lib)}) == ("library", lib.resolve())
    assert runtime.ops_choice({runtime.OPS_ENV: "standin"}) == ("standin", None)
    with pytest.raises(runtime.CpuRuntimeError, match="expected 0"):
        runtime.amx_enabled({runtime.AMX_ENV: "yes"})


def test_configure_environment_sets_engine_and_path():
    env = {runtime.OPS_ENV: "standin", "PYTHONPATH": "/x"}
    runtime.configure_environment(env)
    parts = env["PYTHONPATH"].split(":")
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env[runtime.AMX_ENV] == "0"
    assert str(runtime.SHIM_DIR) in parts and str(runtime.REPO_ROOT) in parts and parts[-1] == "/x"
    assert str(runtime.SUPPORT_ROOT) in parts and (runtime.SUPPORT_ROOT / "openjev_testsupport").is_dir()
    assert (runtime.REPO_ROOT / "sglang_openjev").is_dir()
    assert (runtime.SHIM_DIR / "common_ops.py").is_file()


def test_cpu_server_args_defaults_and_overrides():
    argv = serve.cpu_server_args(["--model-path", "m"], environ={})
    for flag, value in (("--device", "cpu"), ("--max-mamba-cache-size", "32"), ("--max-total-tokens", "4096"),
                        ("--mamba-radix-cache-strategy", "no_buffer"), ("--attention-backend", "torch_native")):
        assert argv[argv.index(flag) + 1] == value
    assert "--disable-overlap-schedule" in argv
    given = serve.cpu_server_args(["--max-mamba-cache-size=8", "--device", "cpu"], environ={runtime.AMX_ENV: "1"})
    assert "--max-mamba-cache-size" not in given and given.count("--device") == 1
    assert "--attention-backend" not in given  # with AMX paths allowed SGLang picks its backend
    with pytest.raises(runtime.CpuRuntimeError, match="CPU engine only"):
        serve.cpu_server_args(["--device", "cuda"], environ={})


def _reference_conv(x_td, w, history):
    """Causal depthwise conv + SiLU of one row x [tokens, dim] after `history` [width-1, dim]."""
    full = torch.cat([history, x_td]).t().unsqueeze(0).float()  # [1, dim, width-1+tokens]
    y = torch.nn.functional.conv1d(full, w.float().unsqueeze(1), groups=w.shape[0])  # valid conv
    return torch.nn.functional.silu(y).squeeze(0)  # [dim, tokens]


def _kernel_like(x, w, bias, conv_states, qsl, idx, his, silu, pad, is_vnni):
    """What sgl-kernel's varlen causal_conv1d_fwd_cpu does: each row against zeros (history ignored),
    its last width-1 inputs written to its slot."""
    width = w.shape[1]
    out = torch.empty_like(x)
    starts = qsl.tolist()
    for r in range(len(starts) - 1):
        s, e = starts[r], starts[r + 1]
        xt = x[:, s:e].t()
        out[:, s:e] = _reference_conv(xt, w, torch.zeros(width - 1, x.shape[0])).to(x.dtype)
        tail = torch.cat([torch.zeros(width - 1, x.shape[0]), xt])[-(width - 1):]
        conv_states[idx[r]] = tail.t()
    return out


def test_conv_history_is_put_in_front_of_continuing_rows():
    torch.manual_seed(0)
    dim, width = 8, 4
    w = torch.randn(dim, width)
    rows = [torch.randn(6, dim), torch.randn(5, dim)]
    hist = [torch.randn(width - 1, dim), torch.zeros(width - 1, dim)]
    pool = torch.zeros(3, dim, width - 1)
    pool[2] = hist[0].t()
    x = torch.cat(rows).t()
    out = runtime._conv_fwd_with_history(_kernel_like, x, w, None, pool, torch.tensor([0, 6, 11]),
                                         torch.tensor([2, 0]), torch.tensor([True, False]), True, -1, False)
    assert out.shape == x.shape
    torch.testing.assert_close(out[:, :6], _reference_conv(rows[0], w, hist[0]))
    torch.testing.assert_close(out[:, 6:], _reference_conv(rows[1], w, hist[1]))
    torch.testing.assert_close(pool[2], rows[0][-(width - 1):].t())  # the state the row leaves
    # without the correction the continuing row's first outputs are wrong (the kernel's behaviour)
    raw = _kernel_like(x, w, None, torch.zeros(3, dim, width - 1), torch.tensor([0, 6, 11]), torch.tensor([2, 0]),
                       torch.tensor([True, False]), True, -1, False)
    assert not torch.allclose(raw[:, :3], _reference_conv(rows[0], w, hist[0])[:, :3])
