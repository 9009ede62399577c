#!/usr/bin/env python3
"""Make OUT a symlink overlay of an OpenJEV checkpoint plus the two base-model processor configs.

SGLang builds Qwen3.5 as a multimodal architecture and wants preprocessor_config.json and
video_preprocessor_config.json even for text classification; the training checkpoint lacks them.
This step leaves CHECKPOINT untouched: OUT holds one symlink per checkpoint entry (weights,
tokenizer, config are never copied or edited) plus the two processor configs, taken from the
pinned base revision (huggingface_hub, `revision=` the pin) or from --processor-dir offline, and
checked against the sha256 in HF_SOURCE.json.

Refuses: a config that is not a 3-label Qwen3.5 sequence classifier with labels
contradiction/entailment/neutral in that order; an incomplete checkpoint (no config.json, no
tokenizer_config.json, no tokenizer.json (or vocab.json + merges.txt), a shard named by
model.safetensors.index.json missing, or no model.safetensors / index at all), with the list;
weights that would not load, read from the safetensors headers (a 0-byte or truncated file, a
tensor missing, unexpected, duplicated or of the wrong shape, the classification head);
a processor config whose sha256 differs from the pin (or is unpinned, unless --allow-unpinned),
whether fetched or carried inside the checkpoint (a carried one that differs from the pin is
accepted only with --allow-unpinned, and recorded); an OUT that exists and is not an overlay made by
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
import signal
import sys
from pathlib import Path

from openjev.common import UserError, atomic_write_json, load_sources, openjev_root, run_main, sha256_file, utc_now
from openjev.pins import HostPins, check_sha256, host_pins_path
from sglang_openjev.contract import check_label_order
from sglang_openjev.weights import checkpoint_tensor_problems

MARKER = ".openjev_overlay.json"
MADE_BY = "app/prepare_v100_model.py"
REVISION_KEY = "base_model.revision"
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")
ARCHITECTURES = {"Qwen3_5ForSequenceClassification"}
# The launcher (sglang_openjev.launch_server) serves only the multimodal qwen3_5 config with text_config:
# SGLang registers no 'qwen3_5_text' config class, so an overlay of a text-only checkpoint could not start.
MODEL_TYPES = {"qwen3_5"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="the OpenJEV checkpoint directory (read only)")
    p.add_argument("out", type=Path, nargs="?", default=None,
                   help="overlay directory to create (default: $OPENJEV_V100_ROOT/model)")
    p.add_argument("--processor-dir", type=Path, default=None,
                   help="offline: take the two processor configs from this directory instead of the hub")
    p.add_argument("--sources", type=Path, default=None, help="pinned-source file (default: the bundle's HF_SOURCE.json)")
    p.add_argument("--allow-unpinned", action="store_true",
                   help="accept processor configs or a base revision that HF_SOURCE.json leaves null, and a processor "
                        "config carried inside the checkpoint that differs from its pin (all recorded)")
    p.add_argument("--record-pins", action="store_true",
                   help="trust on first use: where HF_SOURCE.json pins nothing (the base revision, a processor "
                        "config's sha256), record what this run downloads in --pins; later runs verify against it")
    p.add_argument("--pins", type=Path, default=None,
                   help="pins recorded on this host (default: $OPENJEV_V100_ROOT/pins.json)")
    p.add_argument("--replace", action="store_true",
                   help="rebuild an existing overlay made by this script for a different checkpoint")
    return p


# ---------------------------------------------------------------- pure checks
def check_checkpoint_config(config: dict) -> None:
    """Raise ValueError unless `config` is a 3-label Qwen3.5 classifier in C/E/N order."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        hint = (" (a text-only Qwen3.5 checkpoint: SGLang registers no 'qwen3_5_text' config class, so the launcher "
                "refuses it too; save it with the multimodal qwen3_5 config and text_config)"
                if model_type == "qwen3_5_text" else " (a Qwen3.5 checkpoint)")
        raise ValueError(f"model_type is {model_type!r}, expected one of {sorted(MODEL_TYPES)}{hint}")
    archs = set(config.get("architectures") or [])
    if not archs & ARCHITECTURES:
        raise ValueError(f"architectures {sorted(archs)} has none of {sorted(ARCHITECTURES)}")
    id2label = config.get("id2label")
    num_labels = config.get("num_labels", len(id2label) if id2label else None)
    check_label_order(id2label, num_labels)


def missing_checkpoint_files(names: set[str], index: dict | None) -> list[str]:
    """What a complete checkpoint lacks, given its top-level file names and its parsed
    model.safetensors.index.json (None when there is none). Empty list = complete."""
    missing = [n for n in ("config.json", "tokenizer_config.json") if n not in names]
    if "tokenizer.json" not in names and not {"vocab.json", "merges.txt"} <= names:
        missing.append("tokenizer.json")
    if index is not None:
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            missing.append("model.safetensors.index.json weight_map (empty or malformed)")
        else:
            missing += sorted({str(v) for v in weight_map.values()} - names)
    elif "model.safetensors" not in names:
        missing.append("model.safetensors (no weights: neither it nor model.safetensors.index.json)")
    return missing


def check_checkpoint_complete(checkpoint: Path) -> None:
    names = {e.name for e in checkpoint.iterdir() if e.is_file()}
    index = None
    if "model.safetensors.index.json" in names:
        try:
            index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"{checkpoint / 'model.safetensors.index.json'} is not readable JSON: {exc}") from None
    missing = missing_checkpoint_files(names, index)
    if missing:
        raise UserError(f"checkpoint {checkpoint} is incomplete; missing: {', '.join(missing)}; "
                        "refusing to build an overlay")


def check_carried_processor(name: str, digest: str, pinned: str | None, allow_unpinned: bool) -> dict:
    """Receipt entry for a processor config the checkpoint itself carries, checked against the pin."""
    if pinned == digest:
        return {"sha256": digest, "pinned": True, "source": "checkpoint"}
    if not allow_unpinned:
        why = "HF_SOURCE.json pins none (null)" if pinned is None else f"HF_SOURCE.json pins {pinned}"
        raise UserError(f"the checkpoint carries {name} with sha256 {digest}; {why}; refusing it "
                        "(pass --allow-unpinned to accept it, which is recorded)")
    return {"sha256": digest, "pinned": False, "source": "checkpoint", "pin": pinned,
            "accepted_by": "--allow-unpinned"}


def overlay_plan(checkpoint: Path) -> dict[str, str]:
    """name -> absolute target for every top-level checkpoint entry the overlay links."""
    return {e.name: str(e.resolve()) for e in sorted(checkpoint.iterdir()) if e.name != MARKER}


# ---------------------------------------------------------------- processor configs
def fetch_processor_files(args, base: dict, staging: Path, pins: HostPins) -> dict[str, dict]:
    """Place the two processor configs in `staging`, verified; return their receipt entries."""
    bundle_pins = base.get("files") or {}
    revision = None if args.processor_dir is not None else resolve_revision(args, base, pins)
    out = {}
    for name in PROCESSOR_FILES:
        if args.processor_dir is not None:
            src = args.processor_dir / name
            if not src.is_file():
                raise UserError(f"--processor-dir {args.processor_dir} has no {name}")
            origin = str(src.resolve())
        else:
            src = Path(_hub_download(base["repo"], name, revision))
            if revision is None and args.record_pins:  # the default branch, now: record the commit it was
                revision = snapshot_commit(src)
                pins.record(REVISION_KEY, revision, source=f"hf://{base['repo']} default branch", by=MADE_BY)
            origin = f"hf://{base['repo']}@{revision or 'default-branch'}/{name}"
        entry = check_sha256(pins, f"base_model.files.{name}", bundle_pins.get(name), sha256_file(src), origin=origin,
                             record=args.record_pins, allow_unpinned=args.allow_unpinned, by=MADE_BY)
        shutil.copyfile(src, staging / name)
        out[name] = {**entry, "source": origin}
    return out


def resolve_revision(args, base: dict, pins: HostPins) -> str | None:
    """The base model's revision to download at: the bundle's pin, else the one recorded on this host;
    None (the default branch) only with --record-pins (recorded then) or --allow-unpinned."""
    if base.get("revision"):
        return base["revision"]
    if (rec := pins.get(REVISION_KEY)) is not None:
        return rec["value"]
    if args.record_pins or args.allow_unpinned:
        return None
    raise UserError(f"HF_SOURCE.json pins no revision of {base.get('repo')} (null) and none is recorded in "
                    f"{pins.path}; refusing to download from an unpinned branch (pass --processor-dir, "
                    "--record-pins to record the default branch's commit on first use, or --allow-unpinned)")


def snapshot_commit(path: Path) -> str:
    """The commit a hub download resolved to: huggingface_hub keeps it as .../snapshots/<commit>/FILE."""
    if path.parent.parent.name != "snapshots" or len(path.parent.name) != 40:
        raise UserError(f"cannot tell which commit {path} was downloaded at; pin the revision by hand")
    return path.parent.name


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


def _raise_interrupt(signum, frame):  # noqa: ARG001 - signal handler signature
    raise KeyboardInterrupt


def foreign_entries(out: Path, marker: dict) -> list[str]:
    """Entries of an existing overlay that this script did not create (an operator put them there)."""
    ours = set(marker.get("links") or {}) | set(marker.get("processor_files") or {}) | {MARKER}
    return sorted(e.name for e in out.iterdir() if e.name not in ours)


def clean_stale(out: Path) -> None:
    """Remove `.OUT.partial-PID` / `.OUT.old-PID` left by runs that died (PID no longer alive)."""
    if not out.parent.is_dir():
        return
    for path in sorted(out.parent.glob(f".{out.name}.partial-*")) + sorted(out.parent.glob(f".{out.name}.old-*")):
        try:
            pid = int(path.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if pid == os.getpid() or _alive(pid):
            continue
        if ".old-" in path.name and not out.exists():
            print(f"restoring {out} from {path.name}, moved aside by a run that died", file=sys.stderr)
            path.rename(out)
            continue
        print(f"removing {path.name} left by a run that died (pid {pid})", file=sys.stderr)
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    try:
        return _main()
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        raise UserError(f"{where}{exc.strerror or exc}; nothing was changed") from None


def _main() -> int:
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
    check_checkpoint_complete(ckpt)
    problems = checkpoint_tensor_problems(ckpt, config)
    if problems:
        raise UserError(f"checkpoint {ckpt} would not load (read from its safetensors headers): "
                        f"{'; '.join(problems)}; refusing to build an overlay")
    if out.resolve() == ckpt.resolve():
        raise UserError("OUT must differ from CHECKPOINT (the checkpoint is never modified)")

    marker = read_marker(out) if out.exists() else None
    if out.exists() and marker is None:
        raise UserError(f"{out} exists and is not an overlay made by prepare_v100_model.py; refusing to touch it")
    if marker is not None and marker.get("checkpoint") != str(ckpt.resolve()) and not args.replace:
        raise UserError(f"{out} is an overlay of {marker.get('checkpoint')}, not of {ckpt.resolve()}; "
                        "choose a new OUT or pass --replace")

    clean_stale(out)

    base = load_sources(args.sources).get("base_model") or {}
    pins = HostPins(args.pins or host_pins_path())
    plan = overlay_plan(ckpt)
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging.mkdir()
    try:
        processors = {}
        own = [n for n in PROCESSOR_FILES if n in plan]
        if own:  # the checkpoint already carries them: keep the checkpoint's, record their hashes
            pins = base.get("files") or {}
            processors = {n: check_carried_processor(n, sha256_file(ckpt / n), pins.get(n), args.allow_unpinned)
                          for n in own}
        missing = [n for n in PROCESSOR_FILES if n not in plan]
        if missing:
            fetched = fetch_processor_files(args, base, staging, pins)
            processors.update({n: e for n, e in fetched.items() if n in missing})
            for n in set(fetched) - set(missing):
                (staging / n).unlink()
        if marker is not None and overlay_is_current(out, marker, plan, processors):
            print(f"{out} is already an up-to-date overlay of {ckpt.resolve()}; nothing to do")
            return 0
        receipt = {
            "made_by": MADE_BY, "made_at": utc_now(), "checkpoint": str(ckpt.resolve()),
            "links": plan, "processor_files": processors,
            "base_model": {"repo": base.get("repo"), "revision": base.get("revision"),
                           "revision_recorded_on_this_host": (pins.get(REVISION_KEY) or {}).get("value")},
            "allow_unpinned": args.allow_unpinned,
        }
        if marker is not None and (foreign := foreign_entries(out, marker)):
            raise UserError(f"{out} holds files this script did not create: {', '.join(foreign[:10])}"
                            + (f" and {len(foreign) - 10} more" if len(foreign) > 10 else "")
                            + "; refusing to rebuild over them (move them out of the overlay first)")
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
