#!/usr/bin/env python3
"""Make OUT a symlink overlay of an OpenJEV checkpoint plus the two base-model processor configs.

SGLang builds Qwen3.5 as a multimodal architecture and wants preprocessor_config.json and
video_preprocessor_config.json even for text classification; the training checkpoint lacks them.
This step leaves CHECKPOINT untouched: OUT holds one symlink per checkpoint entry (weights,
tokenizer, config are never copied or edited) plus the two processor configs, taken from the
pinned base revision (huggingface_hub, `revision=` the pin) or from --processor-dir offline, and
checked against the sha256 in HF_SOURCE.json.

Refuses: a config that is not a 3-label Qwen3.5 sequence classifier with labels
contradiction/entailment/neutral in that order; a processor config whose sha256 differs from the
pin (or is unpinned, unless --allow-unpinned); an OUT that exists and is not an overlay made by
this script. Re-running on its own overlay is a no-op when nothing changed. OUT appears
atomically: a failure leaves nothing half-made.

Examples:
  prepare_v100_model.py /data/openjev-ckpt                          # OUT = $OPENJEV_V100_ROOT/model
  prepare_v100_model.py /data/openjev-ckpt /srv/model --processor-dir /mnt/qwen3.5-4b
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from _common import UserError, atomic_write_json, load_sources, openjev_root, run_main, sha256_file, utc_now
from sglang_openjev.contract import check_label_order

MARKER = ".openjev_overlay.json"
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")
ARCHITECTURES = {"Qwen3_5ForSequenceClassification", "Qwen3_5TextForSequenceClassification"}
MODEL_TYPES = {"qwen3_5", "qwen3_5_text"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="the OpenJEV checkpoint directory (read only)")
    p.add_argument("out", type=Path, nargs="?", default=None,
                   help="overlay directory to create (default: $OPENJEV_V100_ROOT/model)")
    p.add_argument("--processor-dir", type=Path, default=None,
                   help="offline: take the two processor configs from this directory instead of the hub")
    p.add_argument("--sources", type=Path, default=None, help="pinned-source file (default: the bundle's HF_SOURCE.json)")
    p.add_argument("--allow-unpinned", action="store_true",
                   help="accept processor configs or a base revision that HF_SOURCE.json leaves null (recorded)")
    p.add_argument("--replace", action="store_true",
                   help="rebuild an existing overlay made by this script for a different checkpoint")
    return p


# ---------------------------------------------------------------- pure checks
def check_checkpoint_config(config: dict) -> None:
    """Raise ValueError unless `config` is a 3-label Qwen3.5 classifier in C/E/N order."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type is {model_type!r}, expected one of {sorted(MODEL_TYPES)} (a Qwen3.5 checkpoint)")
    archs = set(config.get("architectures") or [])
    if not archs & ARCHITECTURES:
        raise ValueError(f"architectures {sorted(archs)} has none of {sorted(ARCHITECTURES)}")
    id2label = config.get("id2label")
    num_labels = config.get("num_labels", len(id2label) if id2label else None)
    check_label_order(id2label, num_labels)


def overlay_plan(checkpoint: Path) -> dict[str, str]:
    """name -> absolute target for every top-level checkpoint entry the overlay links."""
    return {e.name: str(e.resolve()) for e in sorted(checkpoint.iterdir()) if e.name != MARKER}


# ---------------------------------------------------------------- processor configs
def fetch_processor_files(args, base: dict, staging: Path) -> dict[str, dict]:
    """Place the two processor configs in `staging`, verified; return their receipt entries."""
    pins = base.get("files") or {}
    revision = base.get("revision")
    if args.processor_dir is None and revision is None and not args.allow_unpinned:
        raise UserError(f"HF_SOURCE.json pins no revision of {base.get('repo')} (null); refusing to download from "
                        "an unpinned branch (pass --processor-dir, or --allow-unpinned to use the default branch)")
    out = {}
    for name in PROCESSOR_FILES:
        if args.processor_dir is not None:
            src = args.processor_dir / name
            if not src.is_file():
                raise UserError(f"--processor-dir {args.processor_dir} has no {name}")
            origin = str(src.resolve())
        else:
            src = Path(_hub_download(base["repo"], name, revision))
            origin = f"hf://{base['repo']}@{revision or 'default-branch'}/{name}"
        digest = sha256_file(src)
        pinned = pins.get(name)
        if pinned is None and not args.allow_unpinned:
            raise UserError(f"{name} has no pinned sha256 in HF_SOURCE.json (null); refusing to use it unverified "
                            f"(its sha256 is {digest}; pin it, or pass --allow-unpinned, which is recorded)")
        if pinned is not None and pinned != digest:
            raise UserError(f"{name} from {origin} has sha256 {digest}, HF_SOURCE.json pins {pinned}; refusing")
        shutil.copyfile(src, staging / name)
        out[name] = {"sha256": digest, "pinned": pinned is not None, "source": origin}
    return out


def _hub_download(repo: str, filename: str, revision: str | None) -> str:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return hf_hub_download(repo_id=repo, filename=filename, revision=revision)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"could not download {filename} from {repo}@{revision or 'default branch'}: {first} "
                        "(offline? pass --processor-dir)") from None


# ---------------------------------------------------------------- overlay on disk
def read_marker(out: Path) -> dict | None:
    try:
        return json.loads((out / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def overlay_is_current(out: Path, marker: dict, plan: dict[str, str], processors: dict[str, dict]) -> bool:
    if marker.get("links") != plan:
        return False
    for name, target in plan.items():
        link = out / name
        if not link.is_symlink() or os.readlink(link) != target:
            return False
    return all((out / n).is_file() and sha256_file(out / n) == e["sha256"] for n, e in processors.items())


def build_overlay(staging: Path, plan: dict[str, str], receipt: dict) -> None:
    for name, target in plan.items():
        os.symlink(target, staging / name)
    atomic_write_json(staging / MARKER, receipt)


def main() -> int:
    args = build_parser().parse_args()
    ckpt = args.checkpoint
    out = (args.out or openjev_root() / "model").expanduser()
    if not ckpt.is_dir():
        raise UserError(f"checkpoint {ckpt} is not a directory")
    try:
        config = json.loads((ckpt / "config.json").read_text())
    except FileNotFoundError:
        raise UserError(f"checkpoint {ckpt} has no config.json") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{ckpt / 'config.json'} is not valid JSON: {exc}") from None
    try:
        check_checkpoint_config(config)
    except ValueError as exc:
        raise UserError(f"{ckpt} is not an OpenJEV classifier: {exc}") from None
    if out.resolve() == ckpt.resolve():
        raise UserError("OUT must differ from CHECKPOINT (the checkpoint is never modified)")

    marker = read_marker(out) if out.exists() else None
    if out.exists() and marker is None:
        raise UserError(f"{out} exists and is not an overlay made by prepare_v100_model.py; refusing to touch it")
    if marker is not None and marker.get("checkpoint") != str(ckpt.resolve()) and not args.replace:
        raise UserError(f"{out} is an overlay of {marker.get('checkpoint')}, not of {ckpt.resolve()}; "
                        "choose a new OUT or pass --replace")

    base = load_sources(args.sources).get("base_model") or {}
    plan = overlay_plan(ckpt)
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging.mkdir()
    try:
        processors = {}
        own = [n for n in PROCESSOR_FILES if n in plan]
        if own:  # the checkpoint already carries them: keep the checkpoint's, record their hashes
            processors = {n: {"sha256": sha256_file(ckpt / n), "pinned": False, "source": "checkpoint"} for n in own}
        missing = [n for n in PROCESSOR_FILES if n not in plan]
        if missing:
            fetched = fetch_processor_files(args, base, staging)
            processors.update({n: e for n, e in fetched.items() if n in missing})
            for n in set(fetched) - set(missing):
                (staging / n).unlink()
        if marker is not None and overlay_is_current(out, marker, plan, processors):
            print(f"{out} is already an up-to-date overlay of {ckpt.resolve()}; nothing to do")
            return 0
        receipt = {
            "made_by": "app/prepare_v100_model.py", "made_at": utc_now(), "checkpoint": str(ckpt.resolve()),
            "links": plan, "processor_files": processors,
            "base_model": {"repo": base.get("repo"), "revision": base.get("revision")},
            "allow_unpinned": args.allow_unpinned,
        }
        build_overlay(staging, plan, receipt)
        if out.exists():  # our own overlay: swap atomically, then drop the old one
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            staging.rename(out)
            shutil.rmtree(old)
        else:
            staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if args.allow_unpinned and not all(e["pinned"] for e in processors.values()):
        print("warning: unpinned processor configs accepted (--allow-unpinned); recorded in "
              f"{out / MARKER}", file=sys.stderr)
    print(f"overlay {out} -> {ckpt.resolve()} ({len(plan)} links, processor configs: "
          + ", ".join(f"{n} {e['sha256'][:12]} ({e['source']})" for n, e in processors.items()) + ")")
    return 0


if __name__ == "__main__":
    run_main(main)
