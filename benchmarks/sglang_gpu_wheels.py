#!/usr/bin/env python3
"""Download the wheels SGLang 0.5.23 needs on a GPU machine, repacked to fit what it is sent.

Reads the pins of requirements-sglang-gpu.txt (name==version), downloads each for CPython 3.12 on
x86-64 Linux (`pip download --no-deps --only-binary=:all:`) into --out (default .carry/wheels,
ignored by git), repacks sglang and sglang-kernel (see REPACK; their RECORD is rewritten to list
exactly the files kept), and writes manifest.json there (each wheel: file, sha256, bytes, what was
dropped). Wheels already there that this script made, at the pinned version and unchanged, are
reused. It never overwrites a file it did not make, and refuses when the folder plus the git
working tree (tracked and untracked-not-ignored files) would exceed --budget-mib. On the GPU machine:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .carry/wheels/*.whl && export PYTHONPATH=/tmp/site
"""
from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from openjev.common import atomic_write_bytes, sha256_file

REPO = Path(__file__).resolve().parents[1]
PROG = "sglang_gpu_wheels"
MADE_BY = "benchmarks/sglang_gpu_wheels.py"
MIB = 1024 * 1024

# the GPU machine: CPython 3.12, glibc manylinux; sglang 0.5.23 ships manylinux_2_34 only
PYTHON_VERSION = "3.12"
PLATFORMS = ["manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
# already in the GPU machine's image: carrying another copy would shadow it
NEVER = {"torch", "triton", "transformers", "numpy", "requests"}

# per package: what is dropped from its wheel (dist-info files are always kept)
REPACK = {
    "sglang": {
        "drop": ["sglang/multimodal_gen/", "sglang/test/", "sglang/benchmark/",
                 "sglang/srt/rust_extensions/_bench*.so", "sglang/srt/rust_extensions/_grpc*.so",
                 "sglang/srt/rust_extensions/_multimodal*.so", "sglang/srt/rust_extensions/_server*.so"],
        "why": "diffusion server, tests, benchmarks and the Rust bench/gRPC/multimodal/server front ends: "
               "not on the classifier path (--is-embedding, triton attention)",
    },
    "pycountry": {
        "drop": ["pycountry/locales/"],
        "why": "the country and language names' translations (gettext catalogues): SGLang imports pycountry "
               "through mistral-common and never asks for a translated name",
    },
    "mistral-common": {
        "drop": ["mistral_common/data/"],
        "why": "Mistral models' tokenizer files: the classifier path imports mistral-common's protocol classes, "
               "never a Mistral tokenizer",
    },
    "sglang-kernel": {
        "keep_only": "*.py",
        "why": "its CUDA libraries: the classifier path (triton attention, Triton GDN, tvm-ffi JIT kernels) "
               "does not load them",
    },
}


class Refused(Exception):
    """One-line error: printed as `sglang_gpu_wheels: error: ...`, exit 1."""


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def same_version(a: str, b: str) -> bool:
    try:
        from packaging.version import Version
        return Version(a) == Version(b)
    except Exception:  # packaging missing or a version it cannot parse
        return a == b


def wheel_name_version(filename: str) -> tuple[str, str]:
    parts = filename[:-len(".whl")].split("-")
    if not filename.endswith(".whl") or len(parts) not in (5, 6):
        raise Refused(f"not a wheel file name: {filename}")
    return canon(parts[0]), parts[1]


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB // 10 else f"{n / 1024:.0f} KiB"


def read_pins(path: Path) -> list[tuple[str, str]]:
    if not path.is_file():
        raise Refused(f"no requirements file {path}")
    pins, seen = [], set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
        if not m:
            raise Refused(f"{path}:{n}: not a name==version pin: {line!r}")
        name = canon(m.group(1))
        if name in NEVER:
            raise Refused(f"{path}:{n}: {name} is already on the GPU machine and must not be carried")
        if name in seen:
            raise Refused(f"{path}:{n}: {name} pinned twice")
        seen.add(name)
        pins.append((name, m.group(2)))
    if not pins:
        raise Refused(f"{path}: no pins")
    return pins


# ---------------------------------------------------------------------------------------------
# repacking


def _dropped_by(path: str, rule: dict) -> str | None:
    """The rule pattern that drops this wheel member, or None to keep it."""
    top = path.split("/", 1)[0]
    if top.endswith(".dist-info"):
        return None
    if "keep_only" in rule:
        if path.endswith("/"):
            return None
        return None if fnmatch.fnmatch(path.rsplit("/", 1)[-1], rule["keep_only"]) else "not " + rule["keep_only"]
    for pat in rule["drop"]:
        if pat.endswith("/") and path.startswith(pat):
            return pat
        if not pat.endswith("/") and fnmatch.fnmatchcase(path, pat):
            return pat
    return None


def repack_wheel(src: Path, dst: Path, rule: dict) -> dict:
    """Write src without the members rule drops, with a RECORD listing exactly the members kept.

    Returns what was dropped: per pattern the files and bytes (uncompressed)."""
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        records = [i.filename for i in infos if re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename)]
        if len(records) != 1:
            raise Refused(f"{src.name}: expected one .dist-info/RECORD, found {len(records)}")
        record_name = records[0]
        dist_info = record_name.rsplit("/", 1)[0]
        dropped: dict[str, dict] = {}
        kept, rows = [], []
        for info in infos:
            name = info.filename
            # signatures of the old RECORD would no longer match it
            pat = "RECORD signature" if name in (dist_info + "/RECORD.jws", dist_info + "/RECORD.p7s") \
                else _dropped_by(name, rule)
            if pat is not None:
                d = dropped.setdefault(pat, {"files": 0, "bytes": 0})
                if not name.endswith("/"):
                    d["files"] += 1
                    d["bytes"] += info.file_size
                continue
            kept.append(info)
        with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_DEFLATED) as zout:
            for info in kept:
                if info.filename == record_name:
                    continue
                data = b"" if info.filename.endswith("/") else zin.read(info)
                out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                out.external_attr = info.external_attr
                out.create_system = info.create_system
                out.compress_type = zipfile.ZIP_STORED if info.filename.endswith("/") else zipfile.ZIP_DEFLATED
                zout.writestr(out, data)
                if not info.filename.endswith("/"):
                    rows.append((info.filename, record_hash(data), str(len(data))))
            rows.append((record_name, "", ""))
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows)
            rinfo = zin.getinfo(record_name)
            out = zipfile.ZipInfo(record_name, date_time=rinfo.date_time)
            out.external_attr = rinfo.external_attr
            out.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(out, buf.getvalue().encode())
    return {"why": rule["why"], "dropped": dropped,
            "files_dropped": sum(d["files"] for d in dropped.values()),
            "bytes_dropped": sum(d["bytes"] for d in dropped.values())}


# ---------------------------------------------------------------------------------------------
# downloading


def pip_download(name: str, version: str, dest: Path, args) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off",
           "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    for fl in args.find_links or []:
        cmd += ["--find-links", str(fl)]
    if args.no_index:
        cmd.append("--no-index")
    cmd += ["-d", str(dest), f"{name}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        err = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "no output")
        raise Refused(f"pip download {name}=={version} failed: {err}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise Refused(f"pip download {name}=={version}: expected one wheel, got {[w.name for w in wheels]}")
    got_name, got_version = wheel_name_version(wheels[0].name)
    if got_name != name or not same_version(got_version, version):
        raise Refused(f"pip download {name}=={version} gave {wheels[0].name}")
    return wheels[0]


# ---------------------------------------------------------------------------------------------
# the folder and the budget


def load_manifest(out: Path) -> dict:
    path = out / "manifest.json"
    if not path.exists():
        return {"wheels": []}
    try:
        m = json.loads(path.read_text())
    except ValueError:
        m = None
    if not isinstance(m, dict) or m.get("made_by") != MADE_BY or not isinstance(m.get("wheels"), list):
        raise Refused(f"{path} was not written by this script; refusing to overwrite it")
    return m


def tree_bytes(tree: Path, exclude: Path) -> tuple[int, int]:
    """Bytes and count of the files that travel with the working tree (tracked and untracked-not-ignored),
    leaving out those under exclude."""
    try:
        top = subprocess.run(["git", "-C", str(tree), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True).stdout.strip()
        listed = subprocess.run(["git", "-C", top, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                capture_output=True, check=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        raise Refused(f"cannot list the git working tree {tree}: {e}")
    skip = str(exclude.resolve()) + os.sep
    total = count = 0
    for rel in sorted(set(listed.decode("utf-8", "surrogateescape").split("\0")) - {""}):
        p = Path(top) / rel
        try:
            if str(p).startswith(skip):
                continue
            total += p.lstat().st_size
            count += 1
        except FileNotFoundError:  # tracked but deleted
            continue
    return total, count


def entry_for(name: str, version: str, path: Path, repacked) -> dict:
    return {"name": name, "version": version, "file": path.name, "sha256": sha256_file(path),
            "bytes": path.stat().st_size, "repacked": repacked}


def build(args) -> int:
    pins = read_pins(args.requirements)
    out = args.out
    if out.exists() and not out.is_dir():
        raise Refused(f"{out} is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    manifest = load_manifest(out)
    ours = {w["file"]: w for w in manifest["wheels"]}
    wanted = {name: version for name, version in pins}

    # wheels in the folder: ours (unchanged since we wrote them) or foreign
    present = {p.name: p for p in out.glob("*.whl") if p.is_file()}
    unchanged = {f for f, w in ours.items() if f in present and present[f].stat().st_size == w["bytes"]
                 and sha256_file(present[f]) == w["sha256"]}
    for f in present:
        n, v = wheel_name_version(f)
        if f not in unchanged and not (n in wanted and same_version(v, wanted[n])):
            raise Refused(f"{out / f} was not made by this script (not in manifest.json, or changed) and is not "
                          f"a pinned wheel; refusing to leave it beside them (move it away)")

    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=out))
    try:
        entries, staged = [], {}
        for name, version in pins:
            rule = REPACK.get(name)
            reuse = [w for f, w in ours.items() if f in unchanged and canon(w["name"]) == name
                     and same_version(w["version"], version)
                     and (w.get("repacked") or {}).get("rule") == (rule and _rule_id(rule))]
            if reuse:
                w = reuse[0]
                entries.append(w)
                print(f"{name} {version}: reused {w['file']} ({mib(w['bytes'])})", flush=True)
                continue
            dl = staging / "dl" / name
            dl.mkdir(parents=True)
            src = pip_download(name, version, dl, args)
            if rule:
                dst = staging / src.name
                info = repack_wheel(src, dst, rule)
                info.update(rule=_rule_id(rule), source_sha256=sha256_file(src), source_bytes=src.stat().st_size)
                note = (f"downloaded {mib(src.stat().st_size)}, repacked to {mib(dst.stat().st_size)} "
                        f"(dropped {info['files_dropped']} files, {mib(info['bytes_dropped'])} unpacked)")
            else:
                dst = staging / src.name
                os.replace(src, dst)
                info = None
                note = f"downloaded {mib(dst.stat().st_size)}"
            shutil.rmtree(dl)
            entry = entry_for(name, version, dst, info)
            existing = present.get(dst.name)
            if existing is not None and dst.name not in unchanged:
                # a file we did not make (or changed since): only adopt it when it is byte for byte the same
                if sha256_file(existing) != entry["sha256"]:
                    raise Refused(f"refusing to overwrite {existing}: not made by this script (not in "
                                  f"manifest.json, or changed) and differs from the built wheel (move it away)")
                dst.unlink()
                note += ", same as the file already there"
            else:
                staged[dst.name] = dst
            entries.append(entry)
            print(f"{name} {version}: {note} -> {dst.name}", flush=True)

        keep = {e["file"] for e in entries}
        stale = []  # ours, from an older pin or rule
        for f in sorted(set(present) - keep):
            if f not in unchanged:
                raise Refused(f"{out / f} was not made by this script (not in manifest.json, or changed) and "
                              f"is not a file name pip gave for its pin; refusing to leave it beside them "
                              f"(move it away)")
            stale.append(present[f])
        new_manifest = {
            "made_by": MADE_BY,
            "what": "wheels for SGLang 0.5.23's classifier path on a GPU machine that already has torch, triton "
                    "and transformers (CPython 3.12, x86-64 Linux); install with pip install --no-index --no-deps "
                    "--target DIR *.whl",
            "requirements": _display(args.requirements),
            "requirements_sha256": sha256_file(args.requirements),
            "python_version": PYTHON_VERSION, "platforms": PLATFORMS,
            "wheels": entries,
            "wheel_bytes": sum(e["bytes"] for e in entries),
        }
        text = json.dumps(new_manifest, indent=1) + "\n"

        # the folder as it would be: our wheels, the manifest, and whatever else is already there
        others = 0
        for p in out.rglob("*"):
            if not p.is_file() or staging in p.parents:
                continue
            if p.parent == out and (p.suffix == ".whl" or p.name == "manifest.json"):
                continue
            others += p.stat().st_size
        folder = new_manifest["wheel_bytes"] + len(text.encode()) + others
        tree, nfiles = tree_bytes(args.tree, out)
        budget = int(args.budget_mib * MIB)
        line = (f"{mib(folder)} in {_display(out)} ({len(entries)} wheels) + {mib(tree)} working tree "
                f"({nfiles} files) = {mib(folder + tree)}")
        if folder + tree > budget:
            raise Refused(f"over budget: {line} > {args.budget_mib:g} MiB")
        for fname, path in staged.items():
            os.replace(path, out / fname)
        for p in stale:
            p.unlink()
            print(f"removed {p.name} (no longer pinned)", flush=True)
        atomic_write_bytes(out / "manifest.json", text.encode())
        print(f"budget: {line} <= {args.budget_mib:g} MiB", flush=True)
        return 0
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _rule_id(rule: dict) -> str:
    """A stable id of a repack rule: a wheel repacked by another rule is rebuilt."""
    return hashlib.sha256(json.dumps({k: v for k, v in rule.items() if k != "why"}, sort_keys=True)
                          .encode()).hexdigest()[:16]


def _display(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requirements", type=Path, default=REPO / "requirements-sglang-gpu.txt",
                    help="name==version pins (default: requirements-sglang-gpu.txt)")
    ap.add_argument("--out", type=Path, default=REPO / ".carry" / "wheels",
                    help="folder for the wheels and manifest.json (default: .carry/wheels)")
    ap.add_argument("--budget-mib", type=float, default=64.0,
                    help="refuse when the folder plus the working tree would exceed this (default: 64)")
    ap.add_argument("--tree", type=Path, default=REPO,
                    help="the git working tree that travels with the folder (default: this repository)")
    ap.add_argument("--find-links", action="append", metavar="DIR_OR_URL",
                    help="passed to pip download (repeatable)")
    ap.add_argument("--no-index", action="store_true", help="passed to pip download: use --find-links only")


def main(args) -> int:
    try:
        return build(args)
    except Refused as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    sys.exit(main(parser.parse_args()))
