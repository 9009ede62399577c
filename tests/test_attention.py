"""Padded forwards' attention (openjev/engine/attention.py): with OPENJEV_PADDED_ATTENTION=shared, rows
that share one call get the output of their own calls; on a GPU bit for bit."""

from __future__ import annotations

import pytest

from openjev_testsupport.varlen_reference import varlen_by_own_calls, varlen_reference


@pytest.fixture(autouse=True)
def serving_sdpa_backends():
    """SDPA's backends as the embedded backend sets them on a GPU (kernels.configure_backends: no cuDNN
    attention, so SDPA picks FlashAttention), put back after each test."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        yield
        return
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    yield
    torch.backends.cuda.enable_cudnn_sdp(was)

# (row lengths, prefix lengths, offset of the cached keys, per-row states, the whole rows' calls) and the
# rows that keep their own call: a call of a whole number of 64-token tiles
CASES = [
    ([70, 5, 130, 64], None, 0, False, None, [3]),
    ([3, 70, 64], [64, 0, 128], 128, True, [200, 300, 257], []),  # state-keeping: calls past the tokens
    ([1, 30, 64], [128, 64, 0], 128, False, None, [2]),
    ([64, 5, 128], None, 0, True, [100, 5, 150], []),  # no prefix state, calls past the tensors
]


def _attend(torch, layout_args, query, key, value, module, dim):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from openjev.engine.attention import current_layout, padded_layout

    lengths, starts, offset, states, calls = (tuple(layout_args) + (None,))[:5]
    with padded_layout(lengths, starts, offset, per_row_states=states, calls=calls):
        out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, None, scaling=dim ** -0.5)
        plans = list(current_layout().plans.values())
    return out, plans[0] if plans else None


def _rows(torch, lengths, offset, heads, kv_heads, dim, dtype, device, starts=None, nan_outside=False):
    """Random queries, keys and values of a padded layout; with nan_outside, NaN wherever a row's own
    call does not read (padding, cached keys before its prefix), as a padded forward may hold there."""
    gen = torch.Generator(device=device).manual_seed(0)
    width = max(lengths)
    query = torch.randn((len(lengths), heads, width, dim), dtype=dtype, device=device, generator=gen)
    key, value = (torch.randn((len(lengths), kv_heads, offset + width, dim), dtype=dtype, device=device, generator=gen)
                  for _ in range(2))
    if nan_outside:
        for j, (n, p) in enumerate(zip(lengths, starts or [0] * len(lengths))):
            query[j, :, n:] = float("nan")
            for x in (key, value):
                x[j, :, : offset - p] = float("nan")
                x[j, :, offset + n:] = float("nan")
    return query, key, value


@pytest.mark.parametrize("lengths,starts,offset,states,calls,alone", CASES)
def test_rows_sharing_a_call_get_their_own_calls_output(monkeypatch, lengths, starts, offset, states, calls, alone):
    """The shared call's plumbing on a CPU (float64, where a shared call is allowed for the test):
    each row's queries, keys and values placed from the padded layout (or, with no prefix state, taken
    as they stand), its outputs put back, padding positions zero; rows of a whole number of tiles keep
    their own call."""
    torch = pytest.importorskip("torch")
    from openjev.engine import attention

    monkeypatch.delenv("OPENJEV_PADDED_ATTENTION", raising=False)
    assert attention.rowwise_attention() == "rowwise"
    monkeypatch.setenv("OPENJEV_PADDED_ATTENTION", "shared")
    heads, kv_heads, dim = 4, 2, 8
    module = attention._CheckModule(heads // kv_heads)
    query, key, value = _rows(torch, lengths, offset, heads, kv_heads, dim, torch.float64, "cpu", starts, nan_outside=True)
    args = (lengths, starts, offset, states, calls)
    monkeypatch.setattr(attention, "shared_calls_allowed", lambda *_: True)
    shared, plan = _attend(torch, args, query, key, value, module, dim)
    assert plan is not None and plan.batch is not None and plan.alone == alone
    direct = offset == 0 and not any(starts or ())  # rows with no prefix state: the padded tensors as they stand
    assert isinstance(plan.batch, attention.DirectRows if direct else attention.BatchedRows)
    monkeypatch.setenv("OPENJEV_PADDED_ATTENTION", "rowwise")  # the default: one call a row
    each, plan = _attend(torch, args, query, key, value, module, dim)
    assert plan.batch is None and plan.alone == list(range(len(lengths)))
    torch.testing.assert_close(shared, each, rtol=0, atol=1e-12)
    for j, n in enumerate(lengths):
        assert not shared[j, n:].any()


def _cpu_rowwise_case(monkeypatch, torch, lengths, starts, offset):
    """The rowwise mode on a CPU, a small GQA head shape, and a float64 padded layout with NaN wherever
    a row's own call does not read."""
    from openjev.engine import attention

    monkeypatch.setenv("OPENJEV_PADDED_ATTENTION", "rowwise")
    attention.rowwise_attention()
    heads, kv_heads, dim = 4, 2, 8
    rows = _rows(torch, lengths, offset, heads, kv_heads, dim, torch.float64, "cpu", starts, nan_outside=True)
    return attention, attention._CheckModule(heads // kv_heads), dim, rows


PACKED_CASES = [c[:4] for c in CASES if c[1]] + [([5, 70, 1], [0, 0, 0], 0, True)]


@pytest.mark.parametrize("lengths,starts,offset,states,calls,alone", [c for c in CASES if c[4]])
def test_a_row_attends_with_its_whole_rows_call_length(monkeypatch, lengths, starts, offset, states, calls, alone):
    """Each row's own call is its whole row's length, the positions past its tokens zeros: on a CPU
    (float64) its outputs are those of the call of its prefix and tokens alone, padding zero."""
    torch = pytest.importorskip("torch")
    attention, module, dim, (query, key, value) = _cpu_rowwise_case(monkeypatch, torch, lengths, starts, offset)
    seen = []
    real = attention.attend_after_prefix
    monkeypatch.setattr(attention, "attend_after_prefix", lambda *a, **k: seen.append(k["call"]) or real(*a, **k))
    whole, _ = _attend(torch, (lengths, starts, offset, states, calls), query, key, value, module, dim)
    assert seen == [c for c, n in zip(calls, lengths) if c != n]
    short, _ = _attend(torch, (lengths, starts, offset, states, None), query, key, value, module, dim)
    torch.testing.assert_close(whole, short, rtol=0, atol=1e-12)
    for j, n in enumerate(lengths):
        assert not whole[j, n:].any()


@pytest.mark.parametrize("lengths,starts,offset,states", PACKED_CASES)
def test_packed_rows_give_the_whole_rows_output(monkeypatch, lengths, starts, offset, states):
    """OPENJEV_PREFIX_ATTENTION=varlen on a CPU, the varlen kernel replaced by a row-at-a-time
    reference (float64): each row's queries and its prefix's and own keys gathered from the padded
    layout, outputs put back, padding zero; NaN wherever a row's own call does not read stays unread."""
    torch = pytest.importorskip("torch")
    attention, module, dim, (query, key, value) = _cpu_rowwise_case(monkeypatch, torch, lengths, starts, offset)
    args = (lengths, starts, offset, states)
    whole, plan = _attend(torch, args, query, key, value, module, dim)
    assert plan.packed is None
    monkeypatch.setenv("OPENJEV_PREFIX_ATTENTION", "varlen")
    _, plan = _attend(torch, args, query, key, value, module, dim)
    assert plan.packed is None  # a CPU has no varlen kernel: the whole row's calls
    monkeypatch.setattr(attention, "packed_calls_allowed", lambda *_: True)
    monkeypatch.setattr(attention, "varlen_flash", varlen_reference)
    monkeypatch.setenv("OPENJEV_PREFIX_ATTENTION", "varlen-tails")  # only where the forward keeps no state
    _, plan = _attend(torch, args, query, key, value, module, dim)
    assert (plan.packed is None) == states
    monkeypatch.setenv("OPENJEV_PREFIX_ATTENTION", "varlen")
    packed, plan = _attend(torch, args, query, key, value, module, dim)
    assert plan.packed is not None and plan.alone == [] and plan.batch is None
    assert plan.packed.max_q == max(lengths) and plan.packed.max_k == max(n + p for n, p in zip(lengths, starts))
    torch.testing.assert_close(packed, whole, rtol=0, atol=1e-12)
    for j, n in enumerate(lengths):
        assert not packed[j, n:].any()


def test_varlen_exact_packs_only_the_rows_whose_own_calls_do_not_split(monkeypatch):
    """OPENJEV_PREFIX_ATTENTION=varlen-exact on a CPU (float64, the varlen kernel replaced by its
    row-at-a-time reference, a GPU of 5 multiprocessors so that 4 heads split calls of up to 64
    tokens): rows whose whole calls do not split share the varlen call, the others keep their own
    calls; every row's output is the whole row's call's, padding zero."""
    torch = pytest.importorskip("torch")
    lengths, starts, offset, calls = [3, 70, 64, 30], [64, 0, 128, 0], 128, [200, 300, 257, 64]
    attention, module, dim, (query, key, value) = _cpu_rowwise_case(monkeypatch, torch, lengths, starts, offset)
    args = (lengths, starts, offset, True, calls)
    whole, _ = _attend(torch, args, query, key, value, module, dim)
    monkeypatch.setenv("OPENJEV_PREFIX_ATTENTION", "varlen-exact")
    monkeypatch.setattr(attention, "packed_calls_allowed", lambda *_: True)
    monkeypatch.setattr(attention, "varlen_flash", varlen_reference)
    monkeypatch.setattr(attention, "device_sms", lambda _device: 5)
    monkeypatch.setattr(attention, "unsplit_varlen_allowed", lambda *_: False)  # the device check said no
    _, plan = _attend(torch, args, query, key, value, module, dim)
    assert plan.packed is None and plan.alone == [0, 1, 2, 3]
    monkeypatch.setattr(attention, "unsplit_varlen_allowed", lambda *_: True)
    packed, plan = _attend(torch, args, query, key, value, module, dim)
    assert plan.packed is not None and plan.alone == [3]
    assert sorted(set(plan.packed.q_rows.tolist())) == [0, 1, 2] and plan.packed.cu_k.tolist() == [0, 67, 137, 329]
    torch.testing.assert_close(packed, whole, rtol=0, atol=1e-12)
    for j, n in enumerate(lengths):
        assert not packed[j, n:].any()


def test_packed_rows_only_for_prefix_forwards(monkeypatch):
    """The exact path's forwards (no prefix layout) keep their own calls whatever the mode."""
    torch = pytest.importorskip("torch")
    from openjev.engine import attention

    monkeypatch.setenv("OPENJEV_PREFIX_ATTENTION", "varlen")
    monkeypatch.setattr(attention, "packed_calls_allowed", lambda *_: True)
    attention.rowwise_attention()
    query, key, value = _rows(torch, [5, 3], 0, 4, 2, 8, torch.float64, "cpu")
    _, plan = _attend(torch, ([5, 3], None, 0, False), query, key, value, attention._CheckModule(2), 8)
    assert plan.packed is None and plan.alone == [0, 1]


def test_prefix_attention_mode_is_checked(monkeypatch):
    from openjev.common import UserError
    from openjev.engine.kernels import prefix_attention_mode

    monkeypatch.delenv("OPENJEV_PREFIX_ATTENTION", raising=False)
    assert prefix_attention_mode() == "whole-row"
    monkeypatch.setenv("OPENJEV_PREFIX_ATTENTION", "varlen")
    assert prefix_attention_mode() == "varlen"
    monkeypatch.setenv("OPENJEV_PREFIX_ATTENTION", "packed")
    with pytest.raises(UserError, match="OPENJEV_PREFIX_ATTENTION='packed': expected whole-row, varlen, "
                                        "varlen-tails or varlen-exact"):
        prefix_attention_mode()


def test_attention_streams_are_checked(monkeypatch):
    from openjev.common import UserError
    from openjev.engine.attention import side_streams
    from openjev.engine.kernels import attention_streams

    monkeypatch.delenv("OPENJEV_ATTENTION_STREAMS", raising=False)
    assert attention_streams() == 4
    assert side_streams("cpu") == ()  # streams are CUDA's: a CPU forward makes its calls in turn
    monkeypatch.setenv("OPENJEV_ATTENTION_STREAMS", "1")
    assert attention_streams() == 1
    assert side_streams("cpu") == ()
    for bad in ("0", "65", "four", "-2"):
        monkeypatch.setenv("OPENJEV_ATTENTION_STREAMS", bad)
        with pytest.raises(UserError, match=f"OPENJEV_ATTENTION_STREAMS='{bad}': expected a whole number from 1 to 64"):
            attention_streams()


def test_each_thread_spreads_over_its_own_streams(monkeypatch):
    """Side streams are made once a thread: a side stream two threads' forwards shared could hand one's
    freed result memory to the other's next call before the first thread's current stream had read it."""
    import threading

    import torch

    from openjev.engine import attention

    class FakeStream:
        def __init__(self, device=None):
            self.device = device

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setenv("OPENJEV_ATTENTION_STREAMS", "3")
    monkeypatch.setattr(attention, "_THREAD", threading.local())  # none made before; the fakes go with the test
    mine = attention.side_streams("cuda:0")
    assert len(mine) == 3 and attention.side_streams("cuda:0") is mine
    theirs = []
    worker = threading.Thread(target=lambda: theirs.append(attention.side_streams("cuda:0")))
    worker.start()
    worker.join()
    assert len(theirs[0]) == 3 and not set(map(id, theirs[0])) & set(map(id, mine))


def test_varlen_modes_are_checked_at_load(monkeypatch):
    """A varlen mode where FlashAttention's varlen call cannot run is one line at load, not a failure
    of every forward: on a CPU, and on a GPU whose probe call fails (a V100, a torch before 2.10)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig

    from openjev.common import UserError
    from openjev.engine import attention

    cfg = AutoConfig.for_model("qwen3_5_text", num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64)
    monkeypatch.delenv("OPENJEV_PREFIX_ATTENTION", raising=False)
    assert attention.check_packed_calls(cfg, "cpu", torch.float32) is None
    monkeypatch.setenv("OPENJEV_PREFIX_ATTENTION", "varlen-tails")
    with pytest.raises(UserError, match=r"OPENJEV_PREFIX_ATTENTION=varlen-tails needs a CUDA device .* runs on cpu: unset it"):
        attention.check_packed_calls(cfg, "cpu", torch.float32)
    probe = torch.empty((1, 4, 1, 16))
    monkeypatch.setattr(attention, "_head_probe", lambda *_: (probe, 2))  # no CUDA tensors here

    def unsupported(*_):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore")

    monkeypatch.setattr(attention, "_probe_varlen", unsupported)
    with pytest.raises(UserError, match=r"varlen call does not run here \(FlashAttention only supports Ampere GPUs "
                                        r"or newer\.\); unset it$"):
        attention.check_packed_calls(cfg, "cuda:0", torch.float16)
    seen = []
    monkeypatch.setattr(attention, "_probe_varlen", lambda q, kv: seen.append((q.shape, kv)))
    assert attention.check_packed_calls(cfg, "cuda:0", torch.float16) is True and seen == [(probe.shape, 2)]
    # varlen-exact: what the device check of its bits says (the rows keep their own calls where it fails)
    monkeypatch.setenv("OPENJEV_PREFIX_ATTENTION", "varlen-exact")
    monkeypatch.setattr(attention, "_INNER", [object()])
    for bitwise in (False, True):
        monkeypatch.setattr(attention, "unsplit_varlen_is_exact", lambda *_, b=bitwise: b)
        assert attention.check_packed_calls(cfg, "cuda:0", torch.float16) is bitwise


def test_probe_varlen_calls_the_varlen_kernel_with_two_rows(monkeypatch):
    torch = pytest.importorskip("torch")
    from openjev.engine import attention

    calls = []
    monkeypatch.setattr(attention, "varlen_flash", lambda *a: calls.append(a) or varlen_reference(*a))
    attention._probe_varlen(torch.empty((1, 4, 1, 16)), 2)
    (q, k, v, cu_q, cu_k, max_q, max_k, scale), = calls
    assert q.shape == (5, 4, 16) and k.shape == (9, 2, 16) and cu_q.tolist() == [0, 2, 5] and cu_k.tolist() == [0, 4, 9]
    assert (max_q, max_k, scale) == (3, 5, 0.25)


def test_no_shared_calls_on_a_cpu():
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig

    from openjev.engine.attention import check_batching

    cfg = AutoConfig.for_model("qwen3_5_text", num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64)
    assert check_batching(cfg, "cpu", torch.float32) is None


@pytest.mark.gpu
def test_rows_sharing_a_call_on_a_gpu_are_bitwise_their_own_calls(monkeypatch):
    """At Qwen3.5-4B's attention shape (16 query / 4 key-value heads of 256, FP16), rows that share one
    call keep their own calls' bits; rows of whole tiles keep their own calls. Where the device check
    finds shared calls not bitwise on this GPU, the mode falls back to a call a row (then skipped)."""
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("OPENJEV_PREFIX_ATTENTION", raising=False)  # the whole row's calls, whatever the session set
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: FlashAttention is a GPU kernel")
    from openjev.engine import attention

    assert attention.rowwise_attention() in ("rowwise", "shared")
    heads, kv_heads, dim = 16, 4, 256
    module = attention._CheckModule(heads // kv_heads)
    probe = torch.empty((1, heads, 1, dim), device="cuda", dtype=torch.float16)
    exact = attention.batched_rows_are_exact(probe, kv_heads, attention._INNER[0])
    cases = [([900, 1217, 300, 1024, 1500], None, 0, False),
             ([64, 37, 1280, 130], None, 0, True),
             ([37, 300, 1, 64], [1280, 640, 896, 1408], 1408, True),
             ([37, 300, 1, 700], [1280, 640, 896, 0], 1280, False)]
    for lengths, starts, offset, states in cases:
        query, key, value = _rows(torch, lengths, offset, heads, kv_heads, dim, torch.float16, "cuda", starts,
                                  nan_outside=True)
        args = (lengths, starts, offset, states)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OPENJEV_PADDED_ATTENTION", "shared")
            shared, plan = _attend(torch, args, query, key, value, module, dim)
        if not exact:
            assert plan.batch is None and plan.alone == list(range(len(lengths)))
            pytest.skip(f"shared calls are not the rows' own calls' bits on {torch.cuda.get_device_name()} "
                        "(the device check): OPENJEV_PADDED_ATTENTION=shared keeps a call a row there")
        assert plan is not None and plan.batch is not None, "no rows shared a call on this GPU"
        each, plan = _attend(torch, args, query, key, value, module, dim)
        assert plan.batch is None
        for j, n in enumerate(lengths):
            assert torch.equal(shared[j, :n], each[j, :n]), (args, j, float((shared[j, :n] - each[j, :n]).abs().max()))


def _own_calls_on_the_gpu(monkeypatch):
    """(torch, openjev.engine.attention with the row-by-row function installed, its check module for 16
    query and 4 key-value heads) with the attention variables unset; skips where there is no CUDA device."""
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("OPENJEV_PREFIX_ATTENTION", raising=False)
    monkeypatch.delenv("OPENJEV_PADDED_ATTENTION", raising=False)
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: FlashAttention is a GPU kernel")
    from openjev.engine import attention

    attention.rowwise_attention()
    return torch, attention, attention._CheckModule(4)


@pytest.mark.gpu
@pytest.mark.parametrize("streams", ["2", "4", "8"])
def test_own_calls_spread_over_streams_keep_their_bits(monkeypatch, streams):
    """At Qwen3.5-4B's attention shape in FP16, the rows' own calls made side by side on several CUDA
    streams (OPENJEV_ATTENTION_STREAMS) give every row the bits of the same calls made in turn on one,
    rows from prefix states and rows whose calls split their keys included."""
    torch, attention, module = _own_calls_on_the_gpu(monkeypatch)
    heads, kv_heads, dim = 16, 4, 256
    cases = [((lengths, None, 0, False), _rows(torch, lengths, 0, heads, kv_heads, dim, torch.float16, "cuda",
                                               nan_outside=True))
             for lengths in ([900, 1217, 300, 1024, 1500, 37, 130, 700], [64] * 12)]
    cases += list(_gpu_prefix_cases(torch, heads, kv_heads, dim))
    for args, (query, key, value) in cases:
        with monkeypatch.context() as mp:
            mp.setenv("OPENJEV_ATTENTION_STREAMS", "1")
            one, _ = _attend(torch, args, query, key, value, module, dim)
            mp.setenv("OPENJEV_ATTENTION_STREAMS", streams)
            spread, plan = _attend(torch, args, query, key, value, module, dim)
        torch.cuda.synchronize()
        assert plan.own.flash, "the rows' own calls did not run FlashAttention's op"
        for j, n in enumerate(args[0]):
            assert torch.equal(spread[j, :n], one[j, :n]), (args[0], j, float((spread[j, :n] - one[j, :n]).abs().max()))


def _gpu_prefix_cases(torch, heads, kv_heads, dim):
    """Padded layouts of forwards from prefix states, FP16 on the GPU: (layout arguments, rows)."""
    for lengths, starts, offset, states in [([37, 300, 1, 64], [1280, 640, 896, 1408], 1408, False),
                                            ([37, 3, 700], [1280, 64, 0], 1280, True)]:
        yield ((lengths, starts, offset, states),
               _rows(torch, lengths, offset, heads, kv_heads, dim, torch.float16, "cuda", starts, nan_outside=True))


def _against_whole_rows(torch, monkeypatch, mode: str):
    """At Qwen3.5-4B's attention shape (16 query and 4 key-value heads of 256), for each GPU prefix
    case: (row lengths, outputs with each row's whole-row call, outputs and plan with
    OPENJEV_PREFIX_ATTENTION=mode)."""
    from openjev.engine import attention

    heads, kv_heads, dim = 16, 4, 256
    module = attention._CheckModule(heads // kv_heads)
    for args, (query, key, value) in _gpu_prefix_cases(torch, heads, kv_heads, dim):
        with monkeypatch.context() as mp:
            mp.delenv("OPENJEV_PREFIX_ATTENTION", raising=False)
            whole, _ = _attend(torch, args, query, key, value, module, dim)
            mp.setenv("OPENJEV_PREFIX_ATTENTION", mode)
            other, plan = _attend(torch, args, query, key, value, module, dim)
        yield args[0], whole, other, plan


@pytest.mark.gpu
def test_varlen_exact_on_a_gpu_is_bitwise_the_whole_rows_calls(monkeypatch):
    """At Qwen3.5-4B's attention shape in FP16, OPENJEV_PREFIX_ATTENTION=varlen-exact: the device check
    passes on SM80/SM90, and rows whose own calls do not split, in one varlen call, get those calls'
    bits; the other rows keep their own calls."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: FlashAttention is a GPU kernel")
    from openjev.engine import attention

    attention.rowwise_attention()
    probe = torch.empty((1, 16, 1, 256), device="cuda", dtype=torch.float16)
    assert attention.unsplit_varlen_is_exact(probe, 4, attention._INNER[0])
    packed_any = False
    for lengths, whole, exact, plan in _against_whole_rows(torch, monkeypatch, "varlen-exact"):
        packed_any = packed_any or plan.packed is not None
        for j, n in enumerate(lengths):
            assert torch.equal(exact[j, :n], whole[j, :n]), (lengths, j, float((exact[j, :n] - whole[j, :n]).abs().max()))
            assert not exact[j, n:].any()
    assert packed_any


@pytest.mark.gpu
def test_packed_rows_on_a_gpu_are_within_a_unit_of_the_whole_rows_calls(monkeypatch):
    """At Qwen3.5-4B's attention shape in FP16, OPENJEV_PREFIX_ATTENTION=varlen: every row of a forward
    from prefix states in one FlashAttention varlen call, against the whole row's calls: not bit for
    bit, within about one unit in the last place of each output."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: FlashAttention is a GPU kernel")
    from openjev.engine import attention

    attention.rowwise_attention()
    for lengths, whole, packed, plan in _against_whole_rows(torch, monkeypatch, "varlen"):
        assert plan.packed is not None
        for j, n in enumerate(lengths):
            torch.testing.assert_close(packed[j, :n], whole[j, :n], rtol=2e-3, atol=1e-3)
            assert not packed[j, n:].any()


def _own_call_definition(torch, query, key, value, lengths, starts, offset, calls, dim):
    """Each row's own call by its definition: the whole call's queries, zeros but for the row's own
    after its prefix, keys and values of the prefix and the row (zeros past them), one SDPA call."""
    out = torch.zeros((query.shape[0], query.shape[2], query.shape[1], dim), dtype=query.dtype, device=query.device)
    for j, (n, p, c) in enumerate(zip(lengths, starts, calls)):
        q = torch.zeros((1, query.shape[1], c, dim), dtype=query.dtype, device=query.device)
        q[0, :, p:p + n] = query[j, :, :n]
        k = torch.zeros((1, key.shape[1], c, dim), dtype=key.dtype, device=key.device)
        v = torch.zeros_like(k)
        k[0, :, :p + n], v[0, :, :p + n] = key[j, :, offset - p: offset + n], value[j, :, offset - p: offset + n]
        res = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=dim ** -0.5,
                                                               enable_gqa=True)
        out[j, :n] = res[0, :, p:p + n].transpose(0, 1)
    return out


OWN_CASES = [
    ([5, 70, 1, 64], [128, 0, 64, 192], 192, None),  # rows with and without a prefix: buffer segments, views
    ([3, 70, 64], [64, 0, 128], 128, [200, 300, 257]),  # calls past the tokens: an unseen zero token
    ([37, 300, 9], None, 0, None),  # no prefix: the padded tensors' views
]


@pytest.mark.parametrize("lengths,starts,offset,calls", OWN_CASES)
def test_each_rows_own_call_is_its_definition(monkeypatch, lengths, starts, offset, calls):
    """The rows that keep their own calls (the default) on a CPU, float64, NaN wherever a row's own
    call does not read: each row's outputs are those of its definition (zero queries before its own,
    its prefix's keys), put back in its place, padding zero."""
    torch = pytest.importorskip("torch")
    attention, module, dim, (query, key, value) = _cpu_rowwise_case(monkeypatch, torch, lengths, starts, offset)
    out, plan = _attend(torch, (lengths, starts, offset, False, calls), query, key, value, module, dim)
    assert plan.alone == list(range(len(lengths))) and not plan.own.flash  # a CPU: Transformers' function
    starts = starts or [0] * len(lengths)
    calls = calls or [n + p for n, p in zip(lengths, starts)]
    definition = _own_call_definition(torch, query, key, value, lengths, starts, offset, calls, dim)
    torch.testing.assert_close(out, definition, rtol=0, atol=1e-12)
    for j, n in enumerate(lengths):
        assert not out[j, n:].any()


@pytest.mark.gpu
def test_own_calls_on_a_gpu_are_bitwise_transformers_calls(monkeypatch):
    """At Qwen3.5-4B's attention shape in FP16, the rows' own calls with FlashAttention's op called
    directly (SDPA's dispatcher picks it on SM80/SM90) are bit for bit the calls Transformers' SDPA
    function makes of each row's zero-extended queries, rows with and without a prefix."""
    torch, attention, module = _own_calls_on_the_gpu(monkeypatch)
    heads, kv_heads, dim = 16, 4, 256
    inner = attention._INNER[0]
    for lengths, starts, offset in [([37, 300, 1, 64], [1280, 640, 896, 1408], 1408),
                                    ([37, 3, 700, 1217], [1280, 64, 0, 0], 1280),
                                    ([900, 130, 1500], [0, 0, 0], 0)]:
        query, key, value = _rows(torch, lengths, offset, heads, kv_heads, dim, torch.float16, "cuda", starts,
                                  nan_outside=True)
        out, plan = _attend(torch, (lengths, starts, offset, False), query, key, value, module, dim)
        assert plan.own.flash is True
        for j, (n, p) in enumerate(zip(lengths, starts)):
            q = query[j:j + 1, :, :n]
            k, v = key[j:j + 1, :, offset - p: offset + n], value[j:j + 1, :, offset - p: offset + n]
            own = (inner(module, q, k, v, None, scaling=dim ** -0.5)[0] if p == 0
                   else attention.attend_after_prefix(inner, module, q, k, v, p, scaling=dim ** -0.5))
            assert torch.equal(out[j:j + 1, :n], own), (lengths, j, float((out[j:j + 1, :n] - own).abs().max()))



PACKED_CALL_CASES = [
    ([5, 70, 1, 64], [128, 0, 64, 192], None),  # rows with and without a prefix
    ([3, 70, 64], [64, 0, 128], [200, 300, 257]),  # calls past the tokens
    ([37, 300, 9], [0, 0, 0], None),  # no prefix: views of the packed queries
]


def _packed_calls(torch, inner, lengths, starts, calls, heads, kv_heads, dim, dtype, device, varlen=False):
    """A packed forward's attention (PackedCalls) of random rows: the rows' tokens one after another,
    queries, keys and values as Transformers' layer hands them (transposed views of [1, tokens, heads,
    dim]), each row's prefix keys in the key buffers. (output, padded query, key, value, offset)."""
    from types import SimpleNamespace

    from openjev.engine import attention

    offset = max(starts)
    query, key, value = _rows(torch, lengths, offset, heads, kv_heads, dim, dtype, device)

    def pack(x, at):
        rows = torch.cat([x[j, :, at:at + n] for j, n in enumerate(lengths)], 1)
        return rows.transpose(0, 1).contiguous().transpose(0, 1)[None]

    calls_of = attention.PackedCalls(list(lengths), list(starts), list(calls or [n + p for n, p in zip(lengths, starts)]),
                                     varlen=varlen)
    shape = (kv_heads, sum(calls_of.key_spans()), dim)
    buffers = []
    for x in (key, value):  # NaN where the layer writes its tokens' keys, zeros past them in a longer call
        buf = torch.full(shape, float("nan"), dtype=dtype, device=device)
        for j, (n, p, k0, span) in enumerate(zip(lengths, starts, calls_of.key_starts(), calls_of.key_spans())):
            buf[:, k0:k0 + p] = x[j, :, offset - p: offset]
            buf[:, k0 + p + n:k0 + span] = 0
        buffers.append(buf)
    module = attention._CheckModule(heads // kv_heads)
    module.layer_idx = 0
    forward = SimpleNamespace(key_buffers=lambda layer: tuple(buffers))
    out = calls_of.attend(inner, module, pack(query, 0), pack(key, offset), pack(value, offset), forward,
                          scaling=dim ** -0.5)
    return out, query, key, value, offset, calls_of


@pytest.mark.parametrize("lengths,starts,calls", PACKED_CALL_CASES)
def test_packed_calls_give_each_rows_own_call(lengths, starts, calls):
    """PackedCalls on a CPU, float64: every row's outputs are its own call's by its definition, in the
    rows' order, [1, tokens, heads, dim] contiguous as the layer reshapes it (a view, no copy)."""
    torch = pytest.importorskip("torch")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    heads, dim = 4, 8
    out, query, key, value, offset, _ = _packed_calls(torch, sdpa_attention_forward, lengths, starts, calls, heads, 2,
                                                      dim, torch.float64, "cpu")
    assert out.shape == (1, sum(lengths), heads, dim) and out.is_contiguous()
    calls = calls or [n + p for n, p in zip(lengths, starts)]
    definition = _own_call_definition(torch, query, key, value, lengths, starts, offset, calls, dim)
    torch.testing.assert_close(out[0], torch.cat([definition[j, :n] for j, n in enumerate(lengths)]), rtol=0, atol=0)


@pytest.mark.gpu
def test_packed_calls_on_a_gpu_are_bitwise_transformers_calls(monkeypatch):
    """At Qwen3.5-4B's attention shape in FP16, PackedCalls (FlashAttention's op called directly on
    token-major queries) gives every row the bits of Transformers' SDPA call of the row alone, rows
    with and without a prefix, calls longer than a row's prefix and tokens (zeros after them) among them."""
    torch, attention, module = _own_calls_on_the_gpu(monkeypatch)
    heads, kv_heads, dim = 16, 4, 256
    inner = attention._INNER[0]
    for lengths, starts, calls in [([37, 300, 1, 64], [1280, 640, 896, 1408], None),
                                   ([37, 3, 700, 1217], [1280, 64, 0, 0], [1317, 1000, 1300, 1217]),
                                   ([900, 130, 1500], [0, 0, 0], None)]:
        out, query, key, value, offset, _ = _packed_calls(torch, inner, lengths, starts, calls, heads, kv_heads, dim,
                                                          torch.float16, "cuda")
        assert out.is_contiguous()
        bos = 0
        for j, (n, p) in enumerate(zip(lengths, starts)):
            q = query[j:j + 1, :, :n]
            k, v = key[j:j + 1, :, offset - p: offset + n], value[j:j + 1, :, offset - p: offset + n]
            c = calls[j] if calls else p + n
            own = (inner(module, q, k, v, None, scaling=dim ** -0.5)[0] if p == 0 and c == n
                   else attention.attend_after_prefix(inner, module, q, k, v, p, call=c, scaling=dim ** -0.5))
            assert torch.equal(out[:, bos:bos + n], own), (lengths, j, float((out[:, bos:bos + n] - own).abs().max()))
            bos += n


def test_packed_calls_share_a_varlen_call_for_rows_whose_own_calls_do_not_split(monkeypatch):
    """PackedCalls with `varlen` (OPENJEV_PREFIX_ATTENTION=varlen-exact in the packed layout) on a CPU,
    float64, the varlen kernel replaced by its row-at-a-time reference and a GPU of 5 multiprocessors
    (4 heads split calls of up to 64 tokens): rows whose calls do not split and hold no zeros past
    their tokens share the call, reading their keys where they lie in the key buffers (the others'
    rooms as sequences with no queries); the rest keep their own calls; every row's output is its own
    call's, in the rows' order."""
    torch = pytest.importorskip("torch")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from openjev.engine import attention

    monkeypatch.setattr(attention, "packed_calls_allowed", lambda *_: True)
    monkeypatch.setattr(attention, "varlen_flash", varlen_reference)
    monkeypatch.setattr(attention, "device_sms", lambda _device: 5)
    lengths, starts, calls = [3, 70, 64, 30, 5, 9], [64, 0, 128, 0, 0, 64], [67, 70, 192, 30, 200, 73]
    heads, dim = 4, 8
    out, query, key, value, offset, calls_of = _packed_calls(torch, sdpa_attention_forward, lengths, starts, calls,
                                                             heads, 2, dim, torch.float64, "cpu", varlen=True)
    assert calls_of.varlen_rows(query) == [0, 1, 2, 5]  # 30 tokens split; 200 holds zeros past its 5
    q_index, cu_q, cu_k, max_q, max_k = calls_of.plan[5]
    assert cu_q.tolist() == [0, 3, 73, 137, 137, 137, 146] and cu_k.tolist() == [0, 67, 137, 329, 359, 559, 632]
    assert q_index.tolist() == list(range(137)) + list(range(172, 181)) and (max_q, max_k) == (70, 200)
    assert out.shape == (1, sum(lengths), heads, dim) and out.is_contiguous()
    definition = _own_call_definition(torch, query, key, value, lengths, starts, offset, calls, dim)
    torch.testing.assert_close(out[0], torch.cat([definition[j, :n] for j, n in enumerate(lengths)]), rtol=0, atol=1e-12)
    alone = attention.PackedCalls([3, 30], [64, 0], [67, 30], varlen=True)
    assert alone.varlen_rows(query) == []  # one row would share the call: its own call


def test_the_packed_varlen_check_passes_bits_and_refuses_a_unit_off(monkeypatch):
    """packed_varlen_is_exact on a CPU (float64, 40 multiprocessors: 4 heads split calls of up to 960
    tokens, as 16 heads do on 132): with a varlen call that is the
    rows' own calls' bits it passes; one a unit in the last place off, or none that runs (a CPU), it
    refuses, so each row keeps its own call."""
    torch = pytest.importorskip("torch")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from openjev.engine import attention

    check = attention.packed_varlen_is_exact.__wrapped__  # past the per-process answer
    probe = torch.empty((1, 4, 1, 8), dtype=torch.float64)
    module = attention._CheckModule(2)
    assert not check(probe, 2, sdpa_attention_forward)  # a CPU: no varlen call, nothing shared
    monkeypatch.setattr(attention, "packed_calls_allowed", lambda *_: True)
    monkeypatch.setattr(attention, "device_sms", lambda _device: 40)
    exact = varlen_by_own_calls(sdpa_attention_forward, module)
    monkeypatch.setattr(attention, "varlen_flash", exact)
    assert check(probe, 2, sdpa_attention_forward)
    monkeypatch.setattr(attention, "varlen_flash", lambda *a: torch.nextafter(exact(*a), torch.tensor(float("inf"))))
    assert not check(probe, 2, sdpa_attention_forward)


@pytest.mark.gpu
def test_packed_varlen_on_a_gpu_is_bitwise_each_rows_own_call(monkeypatch):
    """At Qwen3.5-4B's attention shape in FP16, the packed layout's varlen call (OPENJEV_PREFIX_ATTENTION=
    varlen-exact) gives the rows whose own calls do not split their own calls' bits: the load check
    passes."""
    torch, attention, module = _own_calls_on_the_gpu(monkeypatch)
    probe = torch.empty((1, 16, 1, 256), dtype=torch.float16, device="cuda")
    assert attention.packed_varlen_is_exact.__wrapped__(probe, 4, attention._INNER[0])
