"""The bench's receipt and arrays: machine label, output paths, atomic writes, the printed summary."""

from __future__ import annotations

import io
import platform
import re
from pathlib import Path

import numpy as np

from openjev.common import atomic_write_bytes, atomic_write_json, sha256_bytes

KIND = "openjev-bench"


SCHEMA_VERSION = 1


def derive_machine_label(explicit: str | None, server_device: str | None, nvml_gpu_name: str | None,
                         server_is_local: bool, local_platform: str, cpu_model: str | None) -> str:
    """Which machine the figures come from, so that a figure from one GPU is never read as another's."""
    if explicit:
        return explicit
    if nvml_gpu_name:
        return nvml_gpu_name
    dev = (server_device or "").strip()
    m = re.match(r"cuda(?::\d+)?\s*\(([^,)]+)", dev)
    if m:
        return m.group(1).strip()
    if dev.startswith("cuda"):
        return f"gpu: {dev}"
    if dev == "cpu":
        if server_is_local:
            return f"cpu: {local_platform}" + (f" ({cpu_model})" if cpu_model else "")
        return "cpu: remote server"
    return f"unknown (server device {dev!r})" if dev else "unknown (the server's device is not known)"


def cpu_model_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def out_paths(out: Path) -> dict[str, Path]:
    base = out.with_suffix("") if out.suffix == ".json" else out
    return {"json": base.with_name(base.name + ".json") if out.suffix != ".json" else out,
            "candidate": base.with_name(base.name + ".candidate.npy"),
            "passes": base.with_name(base.name + ".passes.npy")}


def write_outputs(paths: dict[str, Path], receipt: dict, passes: list[np.ndarray]) -> None:
    """The receipt checked against its model before anything is written (UserError if it does not fit); then
    the arrays (atomic), stale arrays of an overwritten run removed, the receipt last."""
    from openjev.receipts import BenchReceipt, check_receipt

    outputs = {"candidate": None, "passes": None}
    blobs = {}
    if passes:
        for key, arr in (("candidate", passes[-1]), ("passes", np.stack(passes))):
            blobs[key] = npy_bytes(arr.astype(np.float32))
            outputs[key] = {"file": paths[key].name, "sha256": sha256_bytes(blobs[key]), "shape": list(arr.shape),
                            "dtype": "float32"}
    receipt["outputs"] = outputs
    check_receipt(BenchReceipt, receipt, paths["json"])
    for key, blob in blobs.items():
        atomic_write_bytes(paths[key], blob)
    if not passes:
        for key in ("candidate", "passes"):
            if paths[key].exists():
                paths[key].unlink()  # never leave an earlier run's arrays beside this receipt
    atomic_write_json(paths["json"], receipt)


def pass_name(index: int, total: int) -> str:
    """Human name of pass `index` (0-based, as in the receipt) of `total`: 'pass 1/4 (initial)',
    'pass 3/4 (measured 2/3)'. Progress lines, error lines and the summary all use it."""
    if index == 0:
        return f"pass 1/{total} (initial)"
    return f"pass {index + 1}/{total} (measured {index}/{total - 1})"


def passes_done_text(sec: dict) -> str:
    """'passes 2/4 done (1 initial + 1 of 3 measured)': counts of what completed, never of what was planned."""
    planned = sec.get("passes_planned") or 1
    done = sec.get("passes_done", 0)
    measured = sec.get("measured_passes_done", max(0, done - 1))
    initial = done - measured
    return f"{done}/{planned} done ({initial} initial + {measured} of {planned - 1} measured)"


def server_snapshot(server: dict) -> dict:
    """The bench's latest /server_info snapshot of a receipt's "server" block (after the run, else before)."""
    return server.get("info_after") or server.get("info_before") or {}


def print_summary(r: dict, out: Path) -> None:
    mode = r["mode"]
    sec = r.get(mode) or {}
    t = sec.get("timing") or {}
    ag = sec.get("agreement_final") or {}
    au = sec.get("audit") or {}
    ex = r.get("exclusive")

    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    lat = t.get("batch_latency_s") or {}
    if ex is None:
        excl = "not monitored"
    elif ex["valid"]:
        excl = f"valid (GPU {ex['gpu_index']}, {ex['samples']} samples every {ex['interval_s']} s)"
    else:
        excl = f"INVALID: {ex['reason']}"
    info = server_snapshot(r.get("server") or {})
    rows = [
        ("machine", r["machine"]),
        ("server", f"{info.get('backend', 'n/a')}, serving path {info.get('serving_path') or 'n/a'}"),
        ("mode", mode + (" (flush before every pass)" if sec.get("flush_cache_before_each_pass") else "")),
        ("passes", passes_done_text(sec)),
        ("median wall", f"{f(t.get('median_wall_s'), '.3f')} s  (initial pass {f(t.get('initial_pass_wall_s'), '.3f')} s)"),
        ("pairs/s", f(t.get("pairs_per_s"), ".2f")),
        ("batch latency", f"p50 {f(lat.get('p50'), '.4f')} s, p99 {f(lat.get('p99'), '.4f')} s, "
                          f"max {f(lat.get('max'), '.4f')} s"),
        ("client overhead", f"{f(t.get('client_overhead_fraction') and 100 * t['client_overhead_fraction'], '.2f')}% of wall"),
        ("max |dp_e|", f"{f(ag.get('max_abs_dp_e'), '.6g')}  (max |dlogit| {f(ag.get('max_abs_logit_diff'), '.6g')})"),
        ("argmax changes", f"{ag.get('argmax_changes_count', 'n/a')}"),
        ("groups", f"{au.get('groups', 'n/a')} ({au.get('rows_in_groups', 'n/a')} rows; "
                   f"{au.get('singletons_not_covered', 'n/a')} singletons not covered)"),
        ("audit", f"failures {au.get('failures_total', 'n/a')}, ties {au.get('ties_total', 'n/a')} over "
                  f"{au.get('passes_audited', 0)} passes"),
        ("exclusive GPU", excl),
        ("retries", str(t.get("retries", 0))),
        ("warnings", "; ".join(r.get("warnings") or []) or "none"),
        ("result", f"{'VALID' if r['valid'] else 'INVALID'}, {'complete' if r['complete'] else 'INCOMPLETE'} "
                   f"(exit {r['exit_code']})"),
        ("receipt", str(out)),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"openjev bench{' ' + r['label'] if r.get('label') else ''}: {r['inputs']['rows']} rows, {r['server']['url']}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
