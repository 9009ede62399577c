#!/usr/bin/env python3
"""Install PyTorch's torch and torchvision wheels into the runtime venv, each verified by its sha256 first.

The versions and the index come from HF_SOURCE.json (`torch`, `torchvision`: version, variant, index_url).
The venv's own pip downloads each wheel (`pip download --no-deps`, so the file fits the venv's Python)
into ROOT/wheels/download (ROOT: $OPENJEV_V100_ROOT, default ~/storage/sglang-openjev-v100); its sha256
must equal `<project>.wheel_sha256` in HF_SOURCE.json, else the sha256 this host recorded (ROOT/pins.json,
key `<project>.wheels.<file name>`); where neither exists, --record-pins records it (trust on first use)
and --allow-unpinned accepts it once. Only then are the verified files installed (pip install of the
files; their dependencies from the index as pip resolves them). Refused, with one line and nothing
installed: a wheel nothing pins without --record-pins or --allow-unpinned (before the download), and a
wheel whose sha256 differs from its pin (kept aside in ROOT/wheels/rejected/). The receipt
ROOT/results/torch_receipt.json names each wheel, its sha256 and how it was verified ("bundle pin", or
"recorded on this host at <time> (trust on first use)"). A re-run whose venv holds the wheels the receipt
names (pip keeps each installed file's sha256 in direct_url.json), still verified, changes nothing and
says so. pip's cache and temporary files go under ROOT (cache/pip, tmp). Needs no package but pip in the
venv: it runs before torch is there.

Examples:
  venv/bin/python app/prepare_v100_torch.py --record-pins     # first run on this host: records both sha256
  venv/bin/python app/prepare_v100_torch.py                   # later: verifies against the record
  venv/bin/python app/prepare_v100_torch.py --venv /srv/other-venv --index-url https://mirror.example/whl/cu126
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from openjev import torch_wheels as tw
from openjev.common import atomic_write_json, load_sources, openjev_root, run_main, utc_now
from openjev.pins import HostPins, host_pins_path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prepare_v100_torch.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", type=Path, default=None, help="the venv to install into (default: $OPENJEV_V100_ROOT/venv)")
    p.add_argument("--record-pins", action="store_true",
                   help="trust on first use: where HF_SOURCE.json pins no wheel sha256, record the downloaded "
                        "wheel's in --pins; later runs verify against it")
    p.add_argument("--allow-unpinned", action="store_true",
                   help="a one-off: install a wheel nothing pins, unverified (said in the receipt, not recorded)")
    p.add_argument("--pins", type=Path, default=None,
                   help="pins recorded on this host (default: $OPENJEV_V100_ROOT/pins.json)")
    p.add_argument("--sources", type=Path, default=None, help="pinned-source file (default: the bundle's HF_SOURCE.json)")
    p.add_argument("--index-url", default=None, metavar="URL",
                   help="a mirror of PyTorch's index (default: the sources file's torch/torchvision index_url); "
                        "the sha256 checks are the same")
    return p


def _raise_interrupt(signum, frame):  # noqa: ARG001 - signal handler signature
    raise KeyboardInterrupt


def main() -> int:
    args = build_parser().parse_args()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    root = openjev_root().absolute()
    venv = tw.Venv(args.venv or root / "venv", root)
    pins = HostPins(args.pins or host_pins_path(root))
    wanted = tw.wanted_wheels(load_sources(args.sources), args.index_url)
    receipt_path = root / "results" / tw.RECEIPT_NAME

    # 1. already done: the venv holds the wheels the receipt names, and they still verify
    venv.check()
    done = tw.already_installed(wanted, venv.installed(), tw.read_receipt(receipt_path), venv, pins,
                                args.allow_unpinned)
    if done is not None:
        for w in wanted:
            print(tw.summary(w.project, w.version, done[w.project]))
        print(f"already installed: {venv.path} holds these verified wheels (receipt {receipt_path}); nothing to do")
        return 0

    # 2. nothing could verify a wheel: refuse before downloading gigabytes
    tw.refuse_unpinnable(wanted, pins, args.record_pins, args.allow_unpinned)

    # 3. download, verify (recording with --record-pins), install only verified files
    started_at = utc_now()
    with tw.download_folder(root / "wheels") as dest:
        files, commands = tw.download(venv, wanted, dest)
        verified = tw.verify(files, wanted, pins, record=args.record_pins, allow_unpinned=args.allow_unpinned,
                             rejected=root / "wheels" / "rejected")
        state, installs = tw.install(venv, wanted, files, verified)

    # 4. the receipt, and what was verified how
    receipt_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(receipt_path, tw.make_receipt(
        wanted=wanted, verified=verified, venv=venv, state=state, pins=pins, started_at=started_at,
        commands=commands + installs, record=args.record_pins, allow_unpinned=args.allow_unpinned))
    for w in wanted:
        print(tw.summary(w.project, w.version, verified[w.project]))
    print(f"installed into {venv.path}; receipt {receipt_path}")
    return 0


if __name__ == "__main__":
    run_main(main)
