"""Record real sgl-kernel CPU op calls made inside SGLang's engine, for the stand-in checks.

Enabled by OPENJEV_SGL_CPU_RECORD=DIR (with OPENJEV_SGL_CPU_OPS=<built library>): after the
library is loaded, every op of the `sgl_kernel` namespace is wrapped on `torch.ops.sgl_kernel`
(before SGLang's modules bind them); the first calls of each op with a new (shapes, dtypes)
signature, up to OPENJEV_SGL_CPU_RECORD_PER_OP (default 2) per op and process dtype, are saved as

  DIR/<op>/<case>.<arg>.npy          inputs, as passed (before the call)
  DIR/<op>/<case>.out<i>.npy         outputs
  DIR/<op>/<case>.<arg>.after.npy    tensor inputs the call changed in place (found by comparing)
  DIR/<op>/<case>.json               schema, arguments (scalars inline, None as null), dtypes, shapes

Each tensor's strides as passed are in the JSON ("strides": the GDN conv-state pools are passed in
the CPU kernels' layout, strides (.., 1, dim); the .npy holds the logical values, contiguous).
bfloat16 arrays are stored as their uint16 bit patterns (`"dtype": "bfloat16"` in the JSON; read
back with `torch.from_numpy(a).view(torch.bfloat16)`).

State pools (the GDN conv/ssm state caches, one row per request slot) are compacted so the files
stay small: the rows the index argument names are gathered, the indices renumbered, and the real op
is run again on the compacted inputs; that second run is what is saved, after checking that its
outputs and the gathered rows equal those of SGLang's own call (the JSON records that check).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, Optional

RECORD_ENV = "OPENJEV_SGL_CPU_RECORD"
PER_OP_ENV = "OPENJEV_SGL_CPU_RECORD_PER_OP"

# op -> (pool argument, index argument): the pool's first dimension is the request slot.
POOLS = {
    "causal_conv1d_fwd_cpu": ("conv_states", "cache_indices"),
    "causal_conv1d_update_cpu": ("conv_states", "conv_state_indices"),
    "chunk_gated_delta_rule_cpu": ("initial_state", "initial_state_indices"),
    "fused_sigmoid_gating_delta_rule_update_cpu": ("initial_state_source", "initial_state_indices"),
}

_lock = threading.Lock()
_counts: dict[tuple[str, str], int] = {}
_seen: set[tuple] = set()


def _say(msg: str) -> None:
    print(f"openjev cpu ops recorder (pid {os.getpid()}): {msg}", file=sys.stderr, flush=True)


def _np(t):
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy(), "bfloat16"
    return t.numpy(), str(t.dtype).replace("torch.", "")


def _signature(args: list) -> tuple:
    import torch

    return tuple((tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)


def _bind(schema, args, kwargs) -> list:
    values = list(args)
    for a in schema.arguments[len(args):]:
        if a.name in kwargs:
            values.append(kwargs[a.name])
        elif a.has_default_value():
            values.append(a.default_value)
        else:
            values.append(None)
    return values


def _clone(v):
    import torch

    return v.clone() if isinstance(v, torch.Tensor) else v


def _compact(name: str, names: list[str], values: list):
    """Gather the pool rows named by the index argument and renumber the indices (pad slots kept)."""
    import torch

    if name not in POOLS:
        return values, None
    pool_name, idx_name = POOLS[name]
    pi, ii = names.index(pool_name), names.index(idx_name)
    pool, idx = values[pi], values[ii]
    if not isinstance(pool, torch.Tensor) or not isinstance(idx, torch.Tensor):
        return values, None
    flat = idx.reshape(-1)
    valid = flat[(flat >= 0) & (flat < pool.shape[0])]
    rows = torch.unique(valid, sorted=True)
    remap = {int(r): i for i, r in enumerate(rows.tolist())}
    pad = values[names.index("pad_slot_id")] if "pad_slot_id" in names else None
    new_idx = flat.clone()
    for j, v in enumerate(flat.tolist()):
        if v in remap:
            new_idx[j] = remap[v]
        elif pad is not None and v == pad:
            new_idx[j] = pad
    out = list(values)
    out[pi] = _gather_like(pool, rows)
    out[ii] = new_idx.reshape(idx.shape)
    return out, (pi, rows)


def _gather_like(pool, rows):
    """pool[rows] with the pool's own strides below the slot dimension (the conv kernels re-stride
    a state tensor in place unless it already has their layout)."""
    import torch

    order = sorted(range(1, pool.dim()), key=lambda d: -pool.stride(d))  # outermost first
    shape = [len(rows)] + [pool.size(d) for d in order]
    buf = torch.empty(shape, dtype=pool.dtype)
    inv = [0] + [1 + order.index(d) for d in range(1, pool.dim())]
    out = buf.permute(*inv)
    out.copy_(pool.index_select(0, rows.to(torch.long)))
    return out


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


class RecordingOp:
    """Calls the real op; records the first calls of each new signature."""

    def __init__(self, name: str, packet, out_dir: Path, per_op: int, source: str = "engine"):
        self._name, self._packet, self._dir, self._per_op = name, packet, out_dir, per_op
        self._source = source
        self._schema = packet.default._schema

    def __getattr__(self, item):  # .default, overloads, _schema ... as the real packet
        return getattr(self._packet, item)

    def __call__(self, *args, **kwargs):
        try:
            values = _bind(self._schema, args, kwargs)
            sig = (self._name, _signature(values))
            dtype_key = next((str(v.dtype) for v in values if hasattr(v, "dtype") and v.is_floating_point()), "")
            want = sig not in _seen and _counts.get((self._name, dtype_key), 0) < self._per_op
        except Exception as exc:  # noqa: BLE001 - recording must never break serving
            _say(f"{self._name}: not recorded ({type(exc).__name__}: {exc})")
            want = False
        if not want:
            return self._packet(*args, **kwargs)
        before = [_clone(v) for v in values]
        result = self._packet(*args, **kwargs)
        try:
            with _lock:
                if sig in _seen:
                    return result
                _seen.add(sig)
                n = _counts.get((self._name, dtype_key), 0)
                _counts[(self._name, dtype_key)] = n + 1
            prefix = "" if self._source == "engine" else f"{self._source}_"
            self._save(before, values, result, f"{prefix}{dtype_key.replace('torch.', '')}_{len(_seen):03d}")
        except Exception as exc:  # noqa: BLE001
            _say(f"{self._name}: recording failed ({type(exc).__name__}: {exc})")
        return result

    def _save(self, before: list, after_call: list, result, case: str) -> None:
        import torch

        names = [a.name for a in self._schema.arguments]
        outs = list(result) if isinstance(result, (tuple, list)) else [result]
        mutated = [names[i] for i, (b, a) in enumerate(zip(before, after_call))
                   if isinstance(b, torch.Tensor) and not _same(b, a)]
        compact_in, pool = _compact(self._name, names, before)
        check = None
        if pool is not None:
            # Run the real op again on the compacted inputs; it must reproduce SGLang's call.
            run_in = [_clone(v) for v in compact_in]
            res2 = self._packet(*run_in)
            outs2 = list(res2) if isinstance(res2, (tuple, list)) else [res2]
            pi, rows = pool
            gathered_after = after_call[pi].index_select(0, rows.to(torch.long))
            same_outs = all(_same(a, b) for a, b in zip(outs, outs2) if isinstance(a, torch.Tensor)
                            and a.data_ptr() != after_call[pi].data_ptr())
            same_pool = _same(run_in[pi], gathered_after) if names[pi] in mutated else True
            check = {"compacted_pool": names[pi], "rows": rows.tolist(),
                     "outputs_equal_engine_call": bool(same_outs), "pool_rows_equal_engine_call": bool(same_pool)}
            after_vals, outs = run_in, outs2
        else:
            after_vals = after_call
        d = self._dir / self._name
        d.mkdir(parents=True, exist_ok=True)
        meta: dict[str, Any] = {"op": f"sgl_kernel::{self._name}", "schema": str(self._schema), "case": case,
                                "args": [], "outputs": [], "mutated": mutated, "compaction": check,
                                "source": self._source}
        import numpy as np

        for name, v in zip(names, compact_in):
            if isinstance(v, torch.Tensor):
                arr, dt = _np(v)
                np.save(d / f"{case}.{name}.npy", arr)
                entry = {"name": name, "file": f"{case}.{name}.npy", "dtype": dt, "shape": list(v.shape),
                         "strides": list(v.stride())}
                if name in mutated:
                    arr2, _ = _np(after_vals[names.index(name)])
                    np.save(d / f"{case}.{name}.after.npy", arr2)
                    entry["after_file"] = f"{case}.{name}.after.npy"
                meta["args"].append(entry)
            else:
                meta["args"].append({"name": name, "value": v})
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                arr, dt = _np(o)
                np.save(d / f"{case}.out{i}.npy", arr)
                meta["outputs"].append({"file": f"{case}.out{i}.npy", "dtype": dt, "shape": list(o.shape)})
            else:
                meta["outputs"].append({"value": o})
        (d / f"{case}.json").write_text(json.dumps(meta, indent=1) + "\n")
        _say(f"recorded {self._name} {case}")


def install(out_dir: Optional[str] = None) -> list[str]:
    """Wrap every sgl_kernel op on torch.ops.sgl_kernel; returns their names."""
    import torch

    out = Path(out_dir or os.environ[RECORD_ENV])
    per_op = int(os.environ.get(PER_OP_ENV, "2"))
    names = sorted({n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith("sgl_kernel::")})
    ns = torch.ops.sgl_kernel
    for n in names:
        setattr(ns, n, RecordingOp(n, getattr(ns, n), out, per_op))
    _say(f"wrapping {len(names)} sgl_kernel ops, recording into {out}")
    return names
