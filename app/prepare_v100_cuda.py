#!/usr/bin/env python3
"""Install a private CUDA toolkit under ROOT/cuda126 from NVIDIA's redistributable archives.

The toolkit is what the SM70 sgl-kernel source build and FlashInfer's JIT compile against; the
system CUDA, driver and /usr/local/cuda are never touched. Every byte is checked against NVIDIA's
`redistrib_<version>.json` manifest, whose own sha256 is pinned in HF_SOURCE.json (the trust
anchor).

Flow (I/O only at the edges; the steps in between are small pure functions):

  1. resolve the manifest URL and its pin from the sources file; refuse a null pin unless
     --allow-unpinned, refuse a version other than the pinned one unless --allow-unpinned;
  2. fetch the manifest, check its sha256 against the pin, parse it and plan the components
     (a component missing from the manifest, or an entry without a sha256, is refused here,
     before any archive is downloaded);
  3. an existing ROOT/cuda126 with the same receipt content whose files all match the receipt's
     per-file list (size and mtime; size and sha256 with --verify) is a no-op; anything else there
     (another toolkit, an edited, added, removed or swapped file, a receipt without the file list)
     is refused, naming the differing files, unless --force; nothing is deleted without --force;
  4. download every archive into ROOT/.cuda126-download/ (`*.part` files, resumed with HTTP
     Range) and verify each sha256 before anything is unpacked;
  5. unpack every archive (path-traversal and link-escape guarded) into
     ROOT/.cuda126-staging-<pid>, merging the archives' top-level folders into one tree, write
     the receipt into it, then rename it to ROOT/cuda126 in one step.

A failed or interrupted run removes its staging tree and never leaves a half-made ROOT/cuda126;
downloads (finished or `.part`) are kept for the next run to reuse or resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform as _platform
import shutil
import signal
from pathlib import Path
from typing import Any, Sequence

from openjev.common import UserError, load_sources, openjev_root, run_main
from openjev.cuda.download import Console, download_component, fetch_manifest, format_bytes, new_session
from openjev.cuda.manifest import (DEFAULT_BASE_URL, DEFAULT_COMPONENT_NAMES, ComponentPlan, ManifestSource,
                                   check_manifest_sha256, parse_components, parse_manifest, plan_components,
                                   plan_identity, platform_from_machine, resolve_manifest_source,
                                   toolkit_dirname)
from openjev.cuda.tree import (RECEIPT_NAME, UNPACK_FACTOR, acquire_lock, check_space, existing_state,
                               install_tree, remove_stale)


# ---------------------------------------------------------------- argument table
@dataclasses.dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    help: str
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


ARGUMENTS: tuple[Flag, ...] = (
    Flag(("root",), "bundle root that receives cuda126/ (default: $OPENJEV_V100_ROOT, "
                    "else ~/storage/sglang-openjev-v100)",
         dict(nargs="?", metavar="ROOT")),
    Flag(("--version",), "CUDA release, e.g. 12.6.3; must equal the sources file's cuda.version "
                         "unless --allow-unpinned (default: that pinned version)",
         dict(metavar="X.Y.Z")),
    Flag(("--components",), "comma-separated manifest component names replacing the default set "
                            f"({','.join(DEFAULT_COMPONENT_NAMES)})",
         dict(metavar="A,B,C")),
    Flag(("--platform",), "manifest platform key (default from `uname -m`: x86_64 -> linux-x86_64, "
                          "aarch64 -> linux-sbsa)",
         dict(metavar="KEY")),
    Flag(("--base-url",), "mirror of NVIDIA's redist directory; the manifest is "
                          "BASE/redistrib_<version>.json and each archive BASE/<relative_path> "
                          f"(default: the pinned manifest URL's directory, {DEFAULT_BASE_URL})",
         dict(metavar="URL")),
    Flag(("--sources",), "pinned-sources JSON to read cuda.version, cuda.manifest_url and "
                         "cuda.manifest_sha256 from (default: the repository's HF_SOURCE.json)",
         dict(metavar="PATH")),
    Flag(("--allow-unpinned",), "accept a manifest whose sha256 is not pinned (null pin or a "
                                "version other than the pinned one); recorded in the receipt",
         dict(action="store_true")),
    Flag(("--force",), "replace an existing ROOT/cuda126 that differs, was not made by this script, "
                       "or (to repair it) matches: the new tree is staged first, the old one is then "
                       "moved aside and deleted",
         dict(action="store_true")),
    Flag(("--verify",), "when ROOT/cuda126 already exists, compare every installed file's sha256 (and "
                        "size) with the receipt instead of the default size and mtime",
         dict(action="store_true")),
    Flag(("--dry-run",), "fetch only the manifest and print the plan (components, sizes, URLs); "
                         "download and change nothing",
         dict(action="store_true")),
    Flag(("--keep-downloads",), "keep the verified archives in ROOT/.cuda126-download/ after a "
                                "successful install (default: delete them)",
         dict(action="store_true")),
    Flag(("--retries",), "extra attempts per archive after a dropped connection or 5xx, each "
                         "resuming from the .part file (default: 2)",
         dict(type=int, default=2, metavar="N")),
    Flag(("--timeout",), "seconds to wait for the server to connect or send data (default: 60)",
         dict(type=float, default=60.0, metavar="SECONDS")),
    Flag(("--skip-space-check",), "do not refuse when free space under ROOT looks smaller than the "
                                  f"downloads plus {UNPACK_FACTOR}x their size for unpacking",
         dict(action="store_true")),
    Flag(("--quiet",), "no progress bars (they are off anyway when stderr is not a terminal); "
                       "one line per component is still printed",
         dict(action="store_true")),
)

EPILOG = """\
examples:
  # the pinned toolkit into $OPENJEV_V100_ROOT/cuda126
  prepare_v100_cuda.py "$OPENJEV_V100_ROOT" --version 12.6.3
  # see what would be fetched, from a mirror, without downloading
  prepare_v100_cuda.py ~/storage/sglang-openjev-v100 --version 12.6.3 \\
      --base-url https://mirror.example/cuda/redist/ --dry-run
  # afterwards
  export CUDA_HOME="$OPENJEV_V100_ROOT/cuda126" PATH="$OPENJEV_V100_ROOT/cuda126/bin:$PATH"

Re-running after an interruption resumes: verified archives are re-hashed and reused, *.part files
are resumed with HTTP Range. Re-running on a finished install with the same plan is a no-op when
every file listed in the receipt is still there unchanged (size and mtime; with --verify size and
sha256) and no file was added; any difference is refused with one line naming the files (at most
10, then "and N more") and nothing is deleted: reinstall with --force. A receipt written before the
per-file list existed (schema openjev.cuda_receipt/1) cannot be checked, with or without --verify:
the run refuses and asks for a reinstall with --force.
Exit status: 0 on success (including "already installed"), 1 with one line on stderr otherwise.
"""


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage mistakes follow the one-line stderr convention too (SPEC section 1)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="prepare_v100_cuda.py",
        description="Install a private CUDA toolkit (default: the pinned 12.6.3) into ROOT/cuda126 from\n"
                    "NVIDIA's redistributable manifest, verifying the manifest against its pin and every\n"
                    "archive against the manifest before unpacking. The system CUDA is never touched.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag in ARGUMENTS:
        parser.add_argument(*flag.names, help=flag.help, **flag.kwargs)
    return parser


# ---------------------------------------------------------------- plan (pure)


# ---------------------------------------------------------------- output


# ---------------------------------------------------------------- network


# ---------------------------------------------------------------- unpacking


# ---------------------------------------------------------------- existing install


# ---------------------------------------------------------------- locking and signals


def _raise_interrupt(signum, frame):  # noqa: ARG001 - signal handler signature
    raise KeyboardInterrupt


# ---------------------------------------------------------------- main
def print_plan(plans: Sequence[ComponentPlan], source: ManifestSource, manifest_sha: str, target: Path,
               download_dir: Path, state: tuple[str, str], force: bool) -> None:
    pin = "pinned" if source.pinned else "UNPINNED (--allow-unpinned)"
    print(f"manifest: {source.url}")
    print(f"manifest sha256: {manifest_sha} ({pin})")
    print(f"target: {target}")
    print(f"downloads: {download_dir}")
    width = max(len(p.name) for p in plans)
    for p in plans:
        print(f"  {p.name:<{width}}  {p.version:<12} {format_bytes(p.size):>10}  {p.url}")
    print(f"total: {len(plans)} components, {format_bytes(sum(p.size for p in plans))}")
    status, reason = state
    if status == "same":
        print(f"existing install: same toolkit; a real run {'reinstalls it (--force)' if force else 'is a no-op'}")
    elif status == "differs":
        action = "replaces it (--force)" if force else "refuses without --force"
        print(f"existing install: {reason}; a real run {action}")
    print("dry run: nothing downloaded or changed")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    if args.retries < 0:
        raise UserError("--retries must be 0 or more")
    if args.timeout <= 0:
        raise UserError("--timeout must be positive")
    console = Console(args.quiet)

    sources = load_sources(args.sources)
    cuda_pin = sources.get("cuda")
    if not isinstance(cuda_pin, dict):
        raise UserError(f"the sources file {args.sources or 'HF_SOURCE.json'} has no 'cuda' entry")
    version = args.version or cuda_pin.get("version")
    if not version:
        raise UserError("no --version given and the sources file pins no cuda.version")
    dirname = toolkit_dirname(version)
    platform = args.platform or platform_from_machine(_platform.machine())
    names = parse_components(args.components)
    source = resolve_manifest_source(cuda_pin, version, args.base_url, args.allow_unpinned)

    root = Path(args.root).expanduser() if args.root else openjev_root()
    root = root.absolute()
    if root.exists() and not root.is_dir():
        raise UserError(f"ROOT {root} exists and is not a folder")
    target = root / dirname
    download_dir = root / f".{dirname}-download"

    session = new_session()
    manifest_bytes = fetch_manifest(session, source.url, args.timeout)
    manifest_sha = check_manifest_sha256(manifest_bytes, source)
    manifest = parse_manifest(manifest_bytes, version, source.url)
    plans = plan_components(manifest, names, platform, source.base_url, f"redistrib_{version}.json")
    identity = plan_identity(version, platform, manifest_sha, plans)

    if args.dry_run:
        print_plan(plans, source, manifest_sha, target, download_dir, existing_state(target, identity, args.verify),
                   args.force)
        return 0

    root.mkdir(parents=True, exist_ok=True)
    lock_fd = acquire_lock(root, dirname)
    try:
        remove_stale(root, dirname, console)
        state, reason = existing_state(target, identity, args.verify)
        if state == "same" and not args.force:
            console.line(f"already installed: CUDA {version} ({platform}) in {target} matches its receipt "
                         f"({'size and sha256' if args.verify else 'size and mtime'} of every file); nothing to do")
            return 0
        if state == "differs" and not args.force:
            raise UserError(f"{reason}; refusing to replace it (pass --force)")
        download_dir.mkdir(exist_ok=True)
        if not args.skip_space_check:
            check_space(root, download_dir, plans)
        pin_note = "pinned" if source.pinned else "UNPINNED, --allow-unpinned"
        console.line(f"CUDA {version} {platform}: {len(plans)} components, "
                     f"{format_bytes(sum(p.size for p in plans))}; manifest sha256 {manifest_sha} ({pin_note})")
        archives: list[Path] = []
        for i, plan in enumerate(plans, 1):
            archives.append(download_component(session, plan, download_dir, f"[{i}/{len(plans)}]",
                                               args.retries, args.timeout, console))
        receipt = install_tree(root, dirname, target, archives, plans, console, version=version,
                               platform=platform, source=source, manifest_sha=manifest_sha, manifest=manifest,
                               allow_unpinned=args.allow_unpinned)
        if not args.keep_downloads:
            shutil.rmtree(download_dir, ignore_errors=True)
    finally:
        os.close(lock_fd)

    console.line(f"installed CUDA {version} ({platform}) into {target}: {len(plans)} components, "
                 f"{receipt['installed_files']} files")
    console.line(f"receipt: {target / RECEIPT_NAME}")
    console.line(f'use: export CUDA_HOME="{target}" PATH="{target}/bin:$PATH"')
    return 0


if __name__ == "__main__":
    run_main(main)
