"""A padded forward's MLPs on its real tokens only (OPENJEV_PACKED_MLP=on, opt-in).

A right-padded forward (openjev/engine/attention.py PaddedLayout) runs every module on every
position, padding included. The MLP is two thirds of a decoder layer's matrix products and reads
only its own token, so each MLP can gather the real tokens into one [tokens, hidden] matrix, run
on it, and put its rows back (zeros at the padding). Real tokens never read a padded position's
MLP output: attention is causal and its padded keys come after the real ones; the GDN rule and
its convolution are causal too, and a state-keeping forward makes padded tokens inert
(openjev/engine/prefix.py padding_inert_chunk). What can change a real token's bits is the matrix
product's kernel, chosen by the number of rows: `install_packed_mlp` checks on the device, at
load, that the packed product gives each real row the bits of the padded one, and packs only
where it does."""

from __future__ import annotations

import functools
import logging
import os

from openjev.common import UserError
from openjev.engine.attention import current_layout
from openjev.engine.bitwise import Bitwise
from openjev.engine.transfer import to_device

log = logging.getLogger("openjev.packing")

PACKED_MLP_ENV = "OPENJEV_PACKED_MLP"
PACKED_MLP_MODES = ("off", "on")
# (rows of the check's padded input, their real lengths): a short and a long row, one full
CHECK_LENGTHS = ((300, 201, 37), (1100, 640, 7, 1100))


def packed_mlp_mode(mode: str | None = None) -> str:
    mode = mode or os.environ.get(PACKED_MLP_ENV) or "off"
    if mode not in PACKED_MLP_MODES:
        raise UserError(f"{PACKED_MLP_ENV}={mode!r}: expected one of {', '.join(PACKED_MLP_MODES)}")
    return mode


def real_token_index(lengths, width: int, device):
    """Flat indices of the real tokens of rows right-padded to `width`, on `device`; None where no
    row is padded."""
    import torch

    if all(n >= width for n in lengths):
        return None
    index = torch.cat([torch.arange(min(n, width), dtype=torch.long) + b * width for b, n in enumerate(lengths)])
    return to_device(index, device)


def _layout_index(x):
    """The real-token index of the padded forward running in this thread, if `x` is its [rows,
    width, hidden] hidden state (built once a forward: kept in the layout's plans)."""
    layout = current_layout()
    if layout is None or x.dim() != 3 or x.shape[0] != len(layout.lengths):
        return None
    key = ("real_tokens", str(x.device), int(x.shape[1]))
    if key not in layout.plans:
        layout.plans[key] = real_token_index(layout.lengths, int(x.shape[1]), x.device)
    return layout.plans[key]


def packed_call(inner, x, index):
    """inner(x) on the rows of [rows, width, hidden] `x` that `index` names; zeros elsewhere."""
    if index is None:
        return inner(x)
    flat = x.reshape(-1, x.shape[-1])
    y = inner(flat.index_select(0, index))
    out = y.new_zeros((flat.shape[0], y.shape[-1]))
    out.index_copy_(0, index, y)
    return out.view(x.shape[0], x.shape[1], y.shape[-1])


def packed_mlp_forward(inner, x):
    return packed_call(inner, x, _layout_index(x))


def _mlps(model):
    return [m for m in model.modules()
            if type(m).__name__.endswith("MLP") and "Vision" not in type(m).__name__ and hasattr(m, "down_proj")]


def _check(m, device, dtype) -> tuple[bool, float]:
    """Packed against padded on random hidden states: every real row bitwise?"""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(17)
    compare = Bitwise()
    for lengths in CHECK_LENGTHS:
        width = max(lengths)
        x = torch.randn(len(lengths), width, m.down_proj.out_features, generator=gen).to(device=device, dtype=dtype)
        want = m.forward(x)
        got = packed_call(m.forward, x, real_token_index(lengths, width, x.device))
        for b, n in enumerate(lengths):
            compare(want[b, :n], got[b, :n])
    return compare.result


def install_packed_mlp(model, device, mode: str | None = None, check: bool = True) -> dict:
    """Wrap every text MLP's current forward (Transformers' or the fused one) so that a padded
    forward runs it on its real tokens, where the device check finds that bitwise. Returns the
    record kept in kernel_path["packed_mlp"]; check=False skips the check (tests)."""
    import torch

    mode = packed_mlp_mode(mode)
    record: dict = {"requested": mode, "used": False, "modules": 0}
    mlps = _mlps(model)
    if mode == "off":
        record["reason"] = f"{PACKED_MLP_ENV}=off: every position of a padded forward runs the MLP"
    elif not mlps:
        record["reason"] = "no MLP module with down_proj"
    else:
        same, worst = (True, 0.0)
        if check:
            with torch.inference_mode():
                same, worst = _check(mlps[0], device, next(model.parameters()).dtype)
        record["check_lengths"] = [list(c) for c in CHECK_LENGTHS] if check else None
        if not same:
            record["reason"] = (f"packed MLP rows not bitwise the padded ones on {device} "
                                f"(max abs diff {worst:.3g}): every position runs the MLP")
            log.warning("packed MLP not used: %s", record["reason"])
        else:
            remove_packed_mlp(model)
            for m in mlps:
                m.forward = functools.partial(packed_mlp_forward, m.forward)
            record.update(used=True, modules=len(mlps),
                          reason="padded forwards run each MLP on their real tokens only"
                                 + (" (bitwise the padded rows on the device check)" if check else " (unchecked)"))
    model._openjev_packed_mlp = record
    return record


def remove_packed_mlp(model) -> None:
    """Give every MLP back the forward it had before install_packed_mlp."""
    for m in _mlps(model):
        fwd = m.__dict__.get("forward")
        if getattr(fwd, "func", None) is packed_mlp_forward:
            inner = fwd.args[0]
            if getattr(inner, "__self__", None) is m and getattr(inner, "__func__", None) is type(m).forward:
                del m.forward  # it was the class's own forward
            else:
                m.forward = inner
    model.__dict__.pop("_openjev_packed_mlp", None)


def packed_mlp_record(model) -> dict | None:
    return getattr(model, "_openjev_packed_mlp", None)
