#!/usr/bin/env python3
"""Verify the local adapter files against the sha256 pins in HF_SOURCE.json.

Every file inside the adapter directory (HF_SOURCE.json `adapter.local_dir`, by default
`sglang_openjev/`), whatever its name or kind, must be listed in `adapter.files` with its sha256,
and every listed file must exist and match. Anything unlisted there fails verification: an
extension module planted beside a .py (`routes.cpython-311-x86_64-linux-gnu.so` would be imported
instead of routes.py), a `.pth`, `__pycache__/*.pyc` bytecode, data files, symlinks. Bytecode
belongs outside the directory: the launcher and the test suite set PYTHONPYCACHEPREFIX. A null pin is refused unless --allow-unpinned. The other
pins (runtime, FlashInfer, CUDA, PyTorch, Rust, protoc) are listed with their state; the scripts
that download those verify them at the time they use them. Pins recorded on this host where the
bundle pins none (trust on first use, `prepare_v100_torch.py --record-pins` and
`prepare_v100_model.py --record-pins`; --pins, default $OPENJEV_V100_ROOT/pins.json) are listed as
such, each with when and by what it was recorded.

Exit status: 0 all verified; 1 a mismatch, a missing or unlisted file, or a refused null pin.

Examples:
  verify_sources.py                                   # this bundle
  verify_sources.py --root ~/storage/sglang-openjev-v100/app --json
  verify_sources.py --print-adapter-pins              # sha256 of the local files, to review and pin
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from openjev.common import REPO_ROOT, UserError, load_sources, run_main, sha256_file
from openjev.pins import HostPins, host_pins_path

# Pins that other scripts consume: (HF_SOURCE key, field) -> the script that verifies it.
OTHER_PINS = {
    ("base_model", "revision"): "prepare_v100_model.py",
    ("runtime", "revision"): "install_v100_runtime.sh",
    ("flashinfer", "revision"): "install_v100_runtime.sh",
    ("torch", "wheel_sha256"): "prepare_v100_torch.py",
    ("torchvision", "wheel_sha256"): "prepare_v100_torch.py",
    ("cuda", "manifest_sha256"): "prepare_v100_cuda.py",
    ("rust", "rustup_init_sha256"): "install_v100_runtime.sh",
    ("protoc", "sha256"): "install_v100_runtime.sh",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", type=Path, default=None, help="pinned-source file (default: the bundle's HF_SOURCE.json)")
    p.add_argument("--pins", type=Path, default=None,
                   help="pins recorded on this host (default: $OPENJEV_V100_ROOT/pins.json; absent: none)")
    p.add_argument("--root", type=Path, default=REPO_ROOT,
                   help="bundle root holding the adapter directory (default: this checkout)")
    p.add_argument("--allow-unpinned", action="store_true", help="report null adapter pins instead of refusing them")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--print-adapter-pins", action="store_true",
                   help="print {file: sha256} of the local adapter files (for review before pinning) and exit")
    return p


def local_adapter_files(adapter_dir: Path) -> dict[str, str | None]:
    """Every non-directory entry under the adapter directory -> sha256 (None for symlinks and
    special files, which can never match a pin). Symlinked directories are not followed."""
    out: dict[str, str | None] = {}
    for dirpath, dirnames, filenames in os.walk(adapter_dir):
        base = Path(dirpath)
        for name in filenames + [d for d in dirnames if (base / d).is_symlink()]:
            path = base / name
            rel = path.relative_to(adapter_dir).as_posix()
            out[rel] = sha256_file(path) if (path.is_file() and not path.is_symlink()) else None
    return dict(sorted(out.items()))


def compare(pins: dict[str, str | None], local: dict[str, str], allow_unpinned: bool) -> list[dict]:
    """One row per file: status ok | unpinned | mismatch | missing | unlisted."""
    rows = []
    for name in sorted(set(pins) | set(local)):
        pin, have = pins.get(name, "<unlisted>"), local.get(name)
        if name not in pins:
            status = "unlisted"
        elif name not in local:
            status = "missing"
        elif have is None:
            status = "mismatch"  # a symlink or special file where a pinned file belongs
        elif pin is None:
            status = "unpinned-allowed" if allow_unpinned else "unpinned"
        else:
            status = "ok" if pin == have else "mismatch"
        rows.append({"file": name, "status": status, "pinned": pin if name in pins else None, "local": have})
    return rows


def main() -> int:
    args = build_parser().parse_args()
    sources = load_sources(args.sources)
    adapter = sources.get("adapter") or {}
    adapter_dir = args.root / adapter.get("local_dir", "sglang_openjev")
    if not adapter_dir.is_dir():
        raise UserError(f"adapter directory {adapter_dir} not found")
    local = local_adapter_files(adapter_dir)
    if args.print_adapter_pins:
        print(json.dumps(local, indent=2))
        return 0
    rows = compare(adapter.get("files") or {}, local, args.allow_unpinned)
    other = [{"pin": f"{k}.{f}", "value": (sources.get(k) or {}).get(f), "verified_by": s}
             for (k, f), s in OTHER_PINS.items()]
    host = HostPins(args.pins or host_pins_path())
    recorded = [{"pin": k, **v} for k, v in sorted(host.entries.items())]
    bad = [r for r in rows if r["status"] not in ("ok", "unpinned-allowed")]
    if args.json:
        print(json.dumps({"adapter_dir": str(adapter_dir), "files": rows, "other_pins": other,
                          "host_pins": {"file": str(host.path), "pins": recorded},
                          "allow_unpinned": args.allow_unpinned, "ok": not bad}, indent=2))
    else:
        for r in rows:
            print(f"{r['status']:>16}  {adapter_dir.name}/{r['file']}")
        for o in other:
            print(f"{'bundle pin' if o['value'] else 'NULL':>16}  {o['pin']} (checked by {o['verified_by']})")
        for r in recorded:
            print(f"{'host pin':>16}  {r['pin']} = {r['value']} (recorded {r['recorded_at']} by {r['recorded_by']}, "
                  f"trust on first use; {host.path})")
    if not rows:
        raise UserError(f"no adapter files found under {adapter_dir}")
    if bad:
        first = bad[0]
        listed = ", ".join(f"{r['file']} ({r['status']})" for r in bad[:10])
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise UserError(f"{len(bad)} adapter file(s) failed verification; first: {first['file']} is {first['status']}"
                        + (" (pass --allow-unpinned to accept null pins)" if first["status"] == "unpinned" else "")
                        + f"; all: {listed}{more}"
                        + ("; unlisted files in the adapter directory may be imported (remove them)"
                           if any(r["status"] == "unlisted" for r in bad) else ""))
    return 0


if __name__ == "__main__":
    run_main(main)
