"""The toolkit tree: archives unpacked into a staging tree (no path or link may leave it), its inventory and
receipt, the lock, and the atomic swap into place."""

from __future__ import annotations

import errno
import filecmp
import json
import lzma
import os
import posixpath
import shutil
import tarfile
from pathlib import Path, PurePosixPath
from typing import Iterable, Sequence

from openjev.common import (UserError, atomic_write_bytes, atomic_write_json, environment_receipt, sha256_file,
                            try_exclusive_lock, utc_now)
from openjev.cuda.download import CHUNK, Console, format_bytes, one_line
from openjev.cuda.manifest import ComponentPlan, ManifestSource

TOOL = "app/prepare_v100_cuda.py"


RECEIPT_NAME = "openjev_cuda_receipt.json"


RECEIPT_SCHEMA = "openjev.cuda_receipt/2"


MAX_LISTED = 10  # differing files named in the one-line refusal before "and N more"


# A deliberately generous estimate of unpacked size / xz archive size (not measured on NVIDIA's
# archives); only the free-space guard uses it, and --skip-space-check turns that off.
UNPACK_FACTOR = 4


def archive_member_relpath(name: str, top: str) -> PurePosixPath | None:
    """Path of an archive member inside the toolkit tree (its top folder stripped).

    None for the top folder itself; UserError for absolute names, `..`, or anything outside `top`.
    """
    if name.startswith("/") or PurePosixPath(name).is_absolute():
        raise UserError(f"archive member {name!r} has an absolute path")
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if ".." in parts:
        raise UserError(f"archive member {name!r} contains '..'")
    if not parts or parts[0] != top:
        raise UserError(f"archive member {name!r} is outside the archive's top-level folder {top!r}")
    rest = parts[1:]
    return PurePosixPath(*rest) if rest else None


def symlink_stays_inside(link_rel: PurePosixPath, target: str) -> bool:
    """True when a relative symlink at `link_rel` (tree-relative) points inside the tree."""
    if not target or target.startswith("/") or "\0" in target:
        return False
    resolved = posixpath.normpath(posixpath.join(str(link_rel.parent), target))
    return not (resolved == ".." or resolved.startswith("../") or resolved.startswith("/"))


def receipt_identity(receipt: dict) -> dict:
    """The part of a receipt that decides whether two installs are the same toolkit."""
    return {
        "version": receipt.get("version"),
        "platform": receipt.get("platform"),
        "manifest_sha256": (receipt.get("manifest") or {}).get("sha256"),
        "components": [{k: c.get(k) for k in ("name", "version", "relative_path", "sha256", "size")}
                       for c in receipt.get("components") or []],
    }


def _refuse_symlinked_parents(staging: Path, rel: PurePosixPath, member: str) -> None:
    current = staging
    for part in rel.parts[:-1]:
        current = current / part
        if current.is_symlink():
            raise UserError(f"archive member {member!r} would be written through the symlink "
                            f"{current.relative_to(staging)}")


def _same_file_content(a: Path, b: Path) -> bool:
    return filecmp.cmp(a, b, shallow=False)


def extract_component(archive: Path, plan: ComponentPlan, staging: Path, owners: dict[str, str]) -> int:
    """Unpack one archive into `staging`, merging with what earlier components put there.

    Regular files, directories, relative symlinks that stay inside the tree and hard links to
    earlier members are accepted; everything else (devices, fifos, absolute or escaping links,
    absolute or `..` paths, members outside the top folder) is refused. Top-level files of an
    archive (its LICENSE) go to licenses/<component>/. Returns the number of files and links added.
    """
    added = 0
    extracted: dict[str, Path] = {}   # archive-relative path -> extracted regular file (for hard links)
    try:
        tar = tarfile.open(archive, mode="r:xz")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise UserError(f"{plan.name}: cannot open {archive.name}: {one_line(exc)}") from None
    with tar:
        try:
            for member in tar:
                rel = archive_member_relpath(member.name, plan.top_dir)
                if rel is None:
                    if not member.isdir():
                        raise UserError(f"{plan.name}: archive top-level entry {member.name!r} is not a folder")
                    continue
                archive_rel = str(rel)
                if len(rel.parts) == 1 and not member.isdir():
                    rel = PurePosixPath("licenses", plan.name, rel.name)
                key = str(rel)
                other = owners.get(key, "another component")
                dest = staging.joinpath(*rel.parts)
                _refuse_symlinked_parents(staging, rel, member.name)
                try:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                except (FileExistsError, NotADirectoryError):
                    raise UserError(f"{plan.name}: {key} needs a folder where "
                                    f"{owners.get(str(rel.parent), 'another component')} put a file") from None
                if member.isdir():
                    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
                        raise UserError(f"{plan.name}: folder {key} collides with a file from {other}")
                    dest.mkdir(exist_ok=True)
                    dest.chmod(0o755)
                    continue
                if member.issym():
                    if not symlink_stays_inside(rel, member.linkname):
                        raise UserError(f"{plan.name}: symlink {key} -> {member.linkname!r} points outside "
                                        "the toolkit")
                    if os.path.lexists(dest):
                        if dest.is_symlink() and os.readlink(dest) == member.linkname:
                            continue
                        raise UserError(f"{plan.name}: {key} is also provided by {other}")
                    os.symlink(member.linkname, dest)
                elif member.isreg() or member.islnk():
                    source = None
                    if member.islnk():
                        target_rel = archive_member_relpath(member.linkname, plan.top_dir)
                        source = extracted.get(str(target_rel)) if target_rel else None
                        if source is None:
                            raise UserError(f"{plan.name}: hard link {key} -> {member.linkname!r} does not name "
                                            "an earlier file of the same archive")
                    tmp = dest if not os.path.lexists(dest) else dest.with_name(f".{dest.name}.openjev-dup")
                    if source is not None:
                        shutil.copyfile(source, tmp)
                    else:
                        fobj = tar.extractfile(member)
                        if fobj is None:
                            raise UserError(f"{plan.name}: cannot read {member.name!r}")
                        with fobj, open(tmp, "xb") as out:
                            shutil.copyfileobj(fobj, out, CHUNK)
                    mode = 0o755 if member.mode & 0o111 else 0o644
                    os.chmod(tmp, mode)
                    os.utime(tmp, (member.mtime, member.mtime))
                    if tmp != dest:
                        same = dest.is_file() and not dest.is_symlink() and _same_file_content(tmp, dest)
                        tmp.unlink()
                        if not same:
                            raise UserError(f"{plan.name}: {key} is also provided, with different content, "
                                            f"by {other}")
                        continue
                    extracted[archive_rel] = dest
                else:
                    raise UserError(f"{plan.name}: archive member {member.name!r} is not a file, folder or link")
                owners[key] = plan.name
                added += 1
        except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise UserError(f"no space left under {staging.parent} while unpacking {plan.name}") from None
            raise UserError(f"{plan.name}: unpacking {archive.name} failed: {one_line(exc)}") from None
    return added


def finalize_tree(staging: Path) -> None:
    """Add lib64 -> lib (FlashInfer's JIT links -L$CUDA_HOME/lib64) and audit every symlink."""
    if (staging / "lib").is_dir() and not os.path.lexists(staging / "lib64"):
        os.symlink("lib", staging / "lib64")
    root = os.path.realpath(staging)
    for dirpath, dirnames, filenames in os.walk(staging):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                real = os.path.realpath(path)
                if real != root and not real.startswith(root + os.sep):
                    raise UserError(f"symlink {os.path.relpath(path, staging)} resolves outside the toolkit")


def tree_inventory(tree: Path, with_sha256: bool) -> dict[str, dict]:
    """Every file and symlink in the tree (not the receipt), by POSIX relative path.

    Regular files: size, mtime_ns and (with_sha256) sha256; symlinks: their target; anything
    else (fifo, socket, device): its kind, so it shows up as a difference.
    """
    out: dict[str, dict] = {}
    for dirpath, dirnames, filenames in os.walk(tree):
        names = filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in names:
            path = os.path.join(dirpath, name)
            rel = PurePosixPath(*Path(os.path.relpath(path, tree)).parts).as_posix()
            if rel == RECEIPT_NAME:
                continue
            st = os.lstat(path)
            if os.path.islink(path):
                out[rel] = {"symlink": os.readlink(path)}
            elif os.path.isfile(path):
                entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
                if with_sha256:
                    entry["sha256"] = sha256_file(path)
                out[rel] = entry
            else:
                out[rel] = {"kind": "special"}
    return out


def compare_inventory(recorded: dict[str, dict], tree: Path, verify: bool) -> list[str]:
    """Differences between the receipt's file list and the tree, as 'changed X' / 'added X' / 'removed X'."""
    have = tree_inventory(tree, with_sha256=False)
    diffs: list[str] = []
    for rel in sorted(set(recorded) | set(have)):
        want, got = recorded.get(rel), have.get(rel)
        if got is None:
            diffs.append(f"removed {rel}")
        elif want is None:
            diffs.append(f"added {rel}")
        elif "symlink" in want or "symlink" in got:
            if want.get("symlink") != got.get("symlink"):
                diffs.append(f"changed {rel}")
        elif "size" not in got or got["size"] != want.get("size"):
            diffs.append(f"changed {rel}")
        elif verify:
            if sha256_file(tree / rel) != want.get("sha256"):
                diffs.append(f"changed {rel}")
        elif got["mtime_ns"] != want.get("mtime_ns"):
            diffs.append(f"changed {rel}")
    return diffs


def summarize_differences(diffs: Sequence[str], limit: int = MAX_LISTED) -> str:
    shown = ", ".join(diffs[:limit])
    return shown + (f" and {len(diffs) - limit} more" if len(diffs) > limit else "")


def remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def receipt_record_path(tree: Path) -> Path:
    """Where the sha256 of a tree's receipt is kept, beside the tree, so that rewriting the tree and
    its receipt together is still seen."""
    return tree.parent / f".{tree.name}.receipt.sha256"


def read_receipt(tree: Path) -> dict | None:
    try:
        receipt = json.loads((tree / RECEIPT_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(receipt, dict) or receipt.get("tool") != TOOL or receipt.get("complete") is not True:
        return None
    return receipt


def existing_state(target: Path, identity: dict, verify: bool = False) -> tuple[str, str]:
    """('absent'|'same'|'differs', reason); reads the tree, never changes it."""
    if not os.path.lexists(target):
        return "absent", ""
    if target.is_symlink() or not target.is_dir():
        return "differs", f"{target} exists and is not a folder made by this script"
    receipt = read_receipt(target)
    if receipt is None:
        return "differs", f"{target} exists and has no complete {RECEIPT_NAME} from this script"
    if receipt_identity(receipt) != identity:
        difference = _describe_difference(receipt_identity(receipt), identity)
        return "differs", f"{target} holds a different toolkit ({difference})"
    recorded = receipt.get("files")
    if not isinstance(recorded, dict) or not all(isinstance(v, dict) for v in recorded.values()):
        return "differs", (f"{target} has a receipt without the per-file list (older than "
                           f"{RECEIPT_SCHEMA}), so its files cannot be checked, with or without --verify; "
                           "reinstall it")
    record = receipt_record_path(target)
    try:
        recorded_sha = record.read_text().split()[0]
    except (OSError, IndexError):
        return "differs", (f"{target} may have been modified after install: there is no record of its receipt "
                           f"outside the tree ({record}; installed by an older bundle?), so the receipt cannot be "
                           "trusted")
    if sha256_file(target / RECEIPT_NAME) != recorded_sha:
        return "differs", (f"{target} was modified after install: its receipt's sha256 differs from the one "
                           f"recorded in {record}; not calling it installed")
    diffs = compare_inventory(recorded, target, verify)
    if diffs:
        how = "size and sha256" if verify else "size and mtime"
        return "differs", (f"{target} was modified after install ({len(diffs)} files differ from its "
                           f"receipt by {how}: {summarize_differences(diffs)}); not calling it installed")
    return "same", ""


def _describe_difference(old: dict, new: dict) -> str:
    for key in ("version", "platform", "manifest_sha256"):
        if old.get(key) != new.get(key):
            return f"{key} {old.get(key)} vs {new.get(key)}"
    old_c = {c["name"]: c for c in old["components"]}
    new_c = {c["name"]: c for c in new["components"]}
    if set(old_c) != set(new_c):
        added, removed = sorted(set(new_c) - set(old_c)), sorted(set(old_c) - set(new_c))
        return "components " + ", ".join([*(f"+{n}" for n in added), *(f"-{n}" for n in removed)])
    return "component versions or hashes differ"


def acquire_lock(root: Path, dirname: str):
    lock_path = root / f".{dirname}.lock"
    fd, holder = try_exclusive_lock(lock_path)
    if fd is None:
        raise UserError(f"another prepare_v100_cuda.py run (pid {holder}) holds {lock_path}; wait for it to finish")
    return fd


def remove_stale(root: Path, dirname: str, console: Console) -> None:
    """Clean up after runs that were killed (we hold the lock, so none of them is live).

    Staging trees are deleted. A tree a --force run had moved aside is put back when it was killed
    before its replacement took the name; otherwise it is deleted.
    """
    for path in sorted(root.glob(f".{dirname}-staging-*")):
        console.line(f"removing {path.name} left by an earlier run that was killed")
        remove_tree(path)
    target = root / dirname
    for path in sorted(root.glob(f".{dirname}-old-*")):
        if not os.path.lexists(target):
            console.line(f"restoring {dirname} from {path.name}, moved aside by a --force run that was killed")
            os.rename(path, target)
        else:
            console.line(f"removing {path.name} left by an earlier --force run that was killed")
            remove_tree(path)


def write_receipt(staging: Path, *, version: str, platform: str, source: ManifestSource, manifest_sha: str,
                  manifest: dict, allow_unpinned: bool, plans: Sequence[ComponentPlan],
                  files_by_component: dict[str, int], installed_files: int,
                  files: dict[str, dict]) -> dict:
    receipt = {
        "schema": RECEIPT_SCHEMA,
        "tool": TOOL,
        "complete": True,
        "installed_at": utc_now(),
        "version": version,
        "platform": platform,
        "base_url": source.base_url,
        "manifest": {
            "url": source.url,
            "sha256": manifest_sha,
            "pinned": source.pinned,
            "allow_unpinned": bool(allow_unpinned),
            "release_label": manifest.get("release_label"),
            "release_date": manifest.get("release_date"),
            "release_product": manifest.get("release_product"),
        },
        "components": [
            {"name": p.name, "version": p.version, "relative_path": p.relative_path, "sha256": p.sha256,
             "size": p.size, "url": p.url, "license": (manifest.get(p.name) or {}).get("license"),
             "files": files_by_component.get(p.name, 0)}
            for p in plans
        ],
        "layout": {"lib64": "symlink to lib (for tools that link -L$CUDA_HOME/lib64)",
                   "licenses": "licenses/<component>/LICENSE"},
        "installed_files": installed_files,
        "files": files,
        "environment": environment_receipt(),
    }
    atomic_write_json(staging / RECEIPT_NAME, receipt)
    return receipt


def check_space(root: Path, download_dir: Path, plans: Sequence[ComponentPlan]) -> None:
    remaining = 0
    for p in plans:
        final, part = download_dir / p.filename, download_dir / (p.filename + ".part")
        have = final.stat().st_size if final.exists() else (part.stat().st_size if part.exists() else 0)
        remaining += max(p.size - have, 0)
    need = remaining + UNPACK_FACTOR * sum(p.size for p in plans)
    free = shutil.disk_usage(root).free
    if free < need:
        raise UserError(f"{root} has {format_bytes(free)} free; about {format_bytes(need)} is needed "
                        f"(downloads plus unpacking); free space or pass --skip-space-check")


def install_tree(root: Path, dirname: str, target: Path, archives: Iterable[Path],
                 plans: Sequence[ComponentPlan], console: Console, **receipt_fields) -> dict:
    """Unpack into a staging tree and rename it into place; nothing half-made survives a failure."""
    staging = root / f".{dirname}-staging-{os.getpid()}"
    aside = root / f".{dirname}-old-{os.getpid()}"
    remove_tree(staging)
    staging.mkdir()
    try:
        owners: dict[str, str] = {}
        files_by_component: dict[str, int] = {}
        for i, (archive, plan) in enumerate(zip(archives, plans), 1):
            files_by_component[plan.name] = extract_component(archive, plan, staging, owners)
            console.line(f"[{i}/{len(plans)}] {plan.name}: unpacked {files_by_component[plan.name]} files")
        finalize_tree(staging)
        files = tree_inventory(staging, with_sha256=True)
        receipt = write_receipt(staging, plans=plans, files_by_component=files_by_component,
                                installed_files=len(files), files=files, **receipt_fields)
        staging.chmod(0o755)
        receipt_sha = sha256_file(staging / RECEIPT_NAME)
        if os.path.lexists(target):
            os.rename(target, aside)
            try:
                os.rename(staging, target)
            except BaseException:
                os.rename(aside, target)
                raise
            remove_tree(aside)
        else:
            os.rename(staging, target)
        atomic_write_bytes(receipt_record_path(target), f"{receipt_sha}  {target.name}/{RECEIPT_NAME}\n".encode())
        return receipt
    except OSError as exc:
        raise UserError(f"cannot build {target}: {one_line(exc)}") from None
    finally:
        if os.path.lexists(staging):
            remove_tree(staging)
