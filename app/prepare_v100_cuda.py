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
import errno
import fcntl
import filecmp
import http.client
import json
import lzma
import os
import platform as _platform
import posixpath
import re
import shutil
import signal
import sys
import tarfile
import time
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator, Sequence

import requests
import urllib3

from openjev.common import (
    UserError,
    atomic_write_json,
    environment_receipt,
    load_sources,
    openjev_root,
    require_pin,
    run_main,
    sha256_bytes,
    sha256_file,
    utc_now,
)

TOOL = "app/prepare_v100_cuda.py"
RECEIPT_NAME = "openjev_cuda_receipt.json"
RECEIPT_SCHEMA = "openjev.cuda_receipt/2"
MAX_LISTED = 10  # differing files named in the one-line refusal before "and N more"
DEFAULT_BASE_URL = "https://developer.download.nvidia.com/compute/cuda/redist/"
ARCHIVE_SUFFIX = ".tar.xz"
MANIFEST_MAX_BYTES = 8 << 20
CHUNK = 1 << 20
# A deliberately generous estimate of unpacked size / xz archive size (not measured on NVIDIA's
# archives); only the free-space guard uses it, and --skip-space-check turns that off.
UNPACK_FACTOR = 4

# The component set a source build of sgl-kernel (a torch C++/CUDA extension configured through
# torch's Caffe2 CMake config) and FlashInfer's JIT (ninja: nvcc, -I$CUDA_HOME/include,
# -L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda) need. Whole archives are installed:
# headers alone would not satisfy the CUDA::<lib> targets that torch's CMake config references.
DEFAULT_COMPONENTS: tuple[tuple[str, str], ...] = (
    ("cuda_nvcc", "nvcc, ptxas, nvlink, fatbinary, cudafe++, crt/ headers, nvvm/ (cicc, libdevice)"),
    ("cuda_cudart", "cuda.h, cuda_runtime*.h, cuda_fp16/bf16 headers, libcudart, "
                    "lib/stubs/libcuda.so (CUDA::cuda_driver, FlashInfer's -lcuda)"),
    ("cuda_cccl", "thrust/cub/libcu++ and nv/target, which cuda_fp16.h itself includes"),
    ("cuda_nvrtc", "nvrtc.h and libnvrtc: torch's CMake config links caffe2::nvrtc -> CUDA::nvrtc"),
    ("libcublas", "cublas_v2.h/cublasLt.h (included by ATen/cuda/CUDAContextLight.h) and "
                  "libcublas/libcublasLt (caffe2::cublas)"),
    ("libcusparse", "cusparse.h, included by ATen/cuda/CUDAContextLight.h"),
    ("libcusolver", "cusolverDn.h/cusolver_common.h, included by ATen/cuda/CUDAContextLight.h and "
                    "ATen/cuda/Exceptions.h"),
    ("libcurand", "curand_kernel.h/curand_philox4x32_x.h (FlashInfer sampling kernels) and "
                  "CUDA::curand (caffe2::curand)"),
    ("libcufft", "cufft.h and CUDA::cufft, referenced by torch's CMake config (caffe2::cufft)"),
    ("libnvjitlink", "libnvJitLink.so.12, which CUDA 12's libcusparse/libcusolver/libcufft need "
                     "at link time"),
    ("cuda_nvtx", "nvtx3/ headers (torch::nvtx3; the nvToolsExt fallback of torch's CMake config)"),
    ("cuda_profiler_api", "cuda_profiler_api.h (cudaProfilerStart/Stop): part of the runfile "
                          "toolkit's header set that CUDA-using builds assume; a few KiB"),
)
DEFAULT_COMPONENT_NAMES = tuple(name for name, _ in DEFAULT_COMPONENTS)
MACHINE_TO_PLATFORM = {"x86_64": "linux-x86_64", "amd64": "linux-x86_64",
                       "aarch64": "linux-sbsa", "arm64": "linux-sbsa"}
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_VERSION_RE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?$")


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
@dataclasses.dataclass(frozen=True)
class ManifestSource:
    url: str
    base_url: str
    pinned_sha256: str | None
    pinned: bool          # False when the pin does not apply (null, or another version)


@dataclasses.dataclass(frozen=True)
class ComponentPlan:
    name: str
    version: str
    relative_path: str
    sha256: str
    size: int
    url: str

    @property
    def filename(self) -> str:
        return PurePosixPath(self.relative_path).name

    @property
    def top_dir(self) -> str:
        """NVIDIA's archives hold one folder named like the file without `.tar.xz`."""
        return self.filename[: -len(ARCHIVE_SUFFIX)]


def platform_from_machine(machine: str) -> str:
    try:
        return MACHINE_TO_PLATFORM[machine.lower()]
    except KeyError:
        raise UserError(f"no NVIDIA redist platform for machine {machine!r}; pass --platform") from None


def toolkit_dirname(version: str) -> str:
    """`12.6.3` -> `cuda126` (the layout SPEC section 1 fixes)."""
    m = _VERSION_RE.match(version)
    if not m:
        raise UserError(f"--version {version!r} is not a CUDA release like 12.6.3")
    return f"cuda{m.group(1)}{m.group(2)}"


def parse_components(text: str | None) -> list[str]:
    if text is None:
        return list(DEFAULT_COMPONENT_NAMES)
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise UserError(f"--components: {name!r} is not a manifest component name")
        if name not in names:
            names.append(name)
    if not names:
        raise UserError("--components is empty")
    return names


def normalize_base_url(url: str) -> str:
    if not re.match(r"^https?://[^/]+", url):
        raise UserError(f"--base-url {url!r} must be an http:// or https:// URL")
    return url if url.endswith("/") else url + "/"


def resolve_manifest_source(cuda_pin: dict, version: str, base_url: str | None,
                            allow_unpinned: bool) -> ManifestSource:
    """Where the manifest comes from and which sha256 it must have. Refuses before any I/O."""
    pinned_version = cuda_pin.get("version")
    if version != pinned_version and not allow_unpinned:
        raise UserError(f"--version {version} differs from the pinned cuda.version {pinned_version}; "
                        "refusing an unpinned release (pass --allow-unpinned to override; recorded in the receipt)")
    pin_applies = version == pinned_version
    pinned_sha = cuda_pin.get("manifest_sha256") if pin_applies else None
    if pinned_sha is not None and not _SHA256_RE.match(str(pinned_sha)):
        raise UserError(f"cuda.manifest_sha256 {pinned_sha!r} in the sources file is not a sha256 hex digest")
    require_pin(pinned_sha if pin_applies else None, f"CUDA {version} redist manifest", allow_unpinned)
    name = f"redistrib_{version}.json"
    if base_url is not None:
        base = normalize_base_url(base_url)
        url = base + name
    elif pin_applies and cuda_pin.get("manifest_url"):
        url = str(cuda_pin["manifest_url"])
        base = normalize_base_url(url.rsplit("/", 1)[0] + "/")
    else:
        base = DEFAULT_BASE_URL
        url = base + name
    return ManifestSource(url=url, base_url=base, pinned_sha256=pinned_sha, pinned=pinned_sha is not None)


def check_manifest_sha256(data: bytes, source: ManifestSource) -> str:
    actual = sha256_bytes(data)
    if source.pinned_sha256 is not None and actual != source.pinned_sha256:
        raise UserError(f"manifest {source.url} has sha256 {actual}, but the pin is {source.pinned_sha256}; "
                        "refusing it (a changed manifest or a bad mirror)")
    return actual


def parse_manifest(data: bytes, version: str, url: str) -> dict:
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"manifest {url} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise UserError(f"manifest {url} is not a JSON object")
    label = manifest.get("release_label")
    if label is not None and str(label) != version:
        raise UserError(f"manifest {url} is for release {label}, not {version}")
    return manifest


def safe_relative_path(relative_path: Any, where: str) -> str:
    """A manifest `relative_path` must stay under the base URL and name a .tar.xz archive."""
    if not isinstance(relative_path, str) or not relative_path:
        raise UserError(f"{where} has no relative_path")
    p = PurePosixPath(relative_path)
    if (p.is_absolute() or ".." in p.parts or "\\" in relative_path or "://" in relative_path
            or relative_path.startswith("~")):
        raise UserError(f"{where} has an unsafe relative_path {relative_path!r}")
    if not p.name.endswith(ARCHIVE_SUFFIX) or p.name == ARCHIVE_SUFFIX:
        raise UserError(f"{where} archive {p.name!r} is not a {ARCHIVE_SUFFIX} file")
    return relative_path


def plan_components(manifest: dict, names: Sequence[str], platform: str, base_url: str,
                    manifest_name: str = "the manifest") -> list[ComponentPlan]:
    """Validate every requested component against the manifest; raise before anything is fetched."""
    missing = [n for n in names if not isinstance(manifest.get(n), dict)]
    if missing:
        available = sorted(k for k, v in manifest.items() if isinstance(v, dict))
        raise UserError(f"component(s) {', '.join(missing)} missing from {manifest_name} "
                        f"(it has {len(available)} components, e.g. {', '.join(available[:6])}); "
                        "nothing was downloaded")
    plans: list[ComponentPlan] = []
    for name in names:
        entry = manifest[name]
        where = f"{manifest_name} entry {name}/{platform}"
        arch = entry.get(platform)
        if not isinstance(arch, dict):
            raise UserError(f"component {name} has no {platform} archive in {manifest_name}; nothing was downloaded")
        if "relative_path" not in arch and any(isinstance(v, dict) for v in arch.values()):
            raise UserError(f"{where} is split by CUDA variant ({', '.join(sorted(arch))}); not supported")
        relative_path = safe_relative_path(arch.get("relative_path"), where)
        sha = arch.get("sha256")
        if not sha:
            raise UserError(f"{where} has no sha256; refusing to download an unverifiable archive")
        sha = str(sha).lower()
        if not _SHA256_RE.match(sha):
            raise UserError(f"{where} has a malformed sha256 {arch.get('sha256')!r}")
        try:
            size = int(arch.get("size"))
        except (TypeError, ValueError):
            raise UserError(f"{where} has no valid size ({arch.get('size')!r})") from None
        if size <= 0:
            raise UserError(f"{where} has a non-positive size {size}")
        version = entry.get("version")
        if not version:
            raise UserError(f"{manifest_name} entry {name} has no version")
        plans.append(ComponentPlan(name=name, version=str(version), relative_path=relative_path,
                                   sha256=sha, size=size, url=base_url + relative_path))
    filenames = [p.filename for p in plans]
    if len(set(filenames)) != len(filenames):
        raise UserError(f"{manifest_name} maps two components to the same archive file name")
    return plans


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


def plan_identity(version: str, platform: str, manifest_sha: str, plans: Sequence[ComponentPlan]) -> dict:
    return {
        "version": version,
        "platform": platform,
        "manifest_sha256": manifest_sha,
        "components": [{"name": p.name, "version": p.version, "relative_path": p.relative_path,
                        "sha256": p.sha256, "size": p.size} for p in plans],
    }


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# ---------------------------------------------------------------- output
class Console:
    """Per-component lines on stdout; tqdm bars on stderr only when it is a terminal."""

    def __init__(self, quiet: bool):
        self.bars = not quiet and sys.stderr.isatty()

    @staticmethod
    def line(text: str) -> None:
        print(text, flush=True)

    def bar(self, desc: str, total: int, initial: int):
        from tqdm import tqdm  # only a terminal run draws bars; keeps --help and cron runs light

        return tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                    file=sys.stderr, leave=False, disable=not self.bars, dynamic_ncols=True)


# ---------------------------------------------------------------- network
class Interrupted(Exception):
    """A transfer that stopped early; the .part file keeps what arrived."""


def new_session() -> requests.Session:
    session = requests.Session()
    session.headers.update({"User-Agent": "openjev-prepare-v100-cuda/1", "Accept-Encoding": "identity"})
    return session


def fetch_manifest(session: requests.Session, url: str, timeout: float) -> bytes:
    try:
        with session.get(url, stream=True, timeout=timeout) as resp:
            if resp.status_code != 200:
                raise UserError(f"cannot fetch manifest {url}: HTTP {resp.status_code}")
            data = bytearray()
            for chunk in resp.iter_content(chunk_size=65536):
                data += chunk
                if len(data) > MANIFEST_MAX_BYTES:
                    raise UserError(f"manifest {url} is larger than {format_bytes(MANIFEST_MAX_BYTES)}; refusing it")
            return bytes(data)
    except requests.RequestException as exc:
        raise UserError(f"cannot fetch manifest {url}: {one_line(exc)}") from None


def _content_range_start(header: str | None) -> tuple[int, int | None] | None:
    m = re.match(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", header or "")
    if not m:
        return None
    return int(m.group(1)), (None if m.group(3) == "*" else int(m.group(3)))


def iter_body(resp: requests.Response) -> Iterator[bytes]:
    """Body bytes as they arrive, undecoded.

    urllib3's read1() hands over every byte received before a connection drops; read(amt), which
    iter_content uses, holds back the partial last chunk, which a resume would then fetch again.
    """
    read1 = getattr(resp.raw, "read1", None)
    if read1 is None:  # urllib3 < 2.3
        yield from resp.iter_content(chunk_size=64 * 1024)
        return
    while chunk := read1(CHUNK, decode_content=False):
        yield chunk


_TRANSFER_ERRORS = (requests.RequestException, urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)


def transfer_reason(exc: BaseException) -> str:
    """A short cause for a broken transfer (urllib3's messages nest the whole exception chain)."""
    if isinstance(exc, (urllib3.exceptions.ReadTimeoutError, requests.Timeout, TimeoutError)):
        return "read timed out"
    if isinstance(exc, (urllib3.exceptions.ProtocolError, requests.exceptions.ChunkedEncodingError,
                        http.client.IncompleteRead, ConnectionError)):
        return "connection broken"
    return one_line(exc)


def transfer(session: requests.Session, plan: ComponentPlan, part: Path, timeout: float,
             console: Console) -> tuple[int, bool]:
    """One HTTP attempt that appends to `part`. Returns (bytes now in part, whether it resumed).

    Raises Interrupted for a dropped or short transfer (retryable), UserError for anything else.
    """
    offset = part.stat().st_size if part.exists() else 0
    if offset > plan.size:
        part.unlink()
        offset = 0
    if offset == plan.size:
        return offset, False
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    try:
        resp = session.get(plan.url, stream=True, timeout=timeout, headers=headers)
    except requests.RequestException as exc:
        raise Interrupted(f"cannot reach {plan.url}: {one_line(exc)}") from None
    with resp:
        if offset and resp.status_code == 416:
            part.unlink()  # the server cannot serve our .part's continuation: start from byte 0
            console.line(f"      {plan.name}: server refused to resume (HTTP 416); restarting from byte 0")
            return transfer(session, plan, part, timeout, console)
        if offset and resp.status_code == 206:
            cr = _content_range_start(resp.headers.get("Content-Range"))
            if cr is None or cr[0] != offset:
                raise UserError(f"{plan.url}: server answered a resume from byte {offset} with "
                                f"Content-Range {resp.headers.get('Content-Range')!r}")
            if cr[1] is not None and cr[1] != plan.size:
                raise UserError(f"{plan.url}: server has {cr[1]} bytes, the manifest says {plan.size}")
            mode, resumed = "ab", True
        elif resp.status_code == 200:
            if offset:
                console.line(f"      {plan.name}: server ignored the Range request; restarting from byte 0")
            offset, mode, resumed = 0, "wb", False
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) != plan.size:
                raise UserError(f"{plan.url}: server announces {length} bytes, the manifest says {plan.size}")
        elif 500 <= resp.status_code < 600:
            raise Interrupted(f"{plan.url}: HTTP {resp.status_code}")
        else:
            raise UserError(f"cannot download {plan.url}: HTTP {resp.status_code}")

        written = 0
        bar = console.bar(plan.name, plan.size, offset)
        try:
            with open(part, mode) as f:
                chunks = iter_body(resp)
                try:
                    while True:
                        try:
                            chunk = next(chunks, b"")
                        except _TRANSFER_ERRORS as exc:
                            raise Interrupted(f"download of {plan.filename} broke off after "
                                              f"{format_bytes(offset + written)} of {format_bytes(plan.size)} "
                                              f"({transfer_reason(exc)})") from None
                        if not chunk:
                            break
                        if offset + written + len(chunk) > plan.size:
                            f.close()
                            part.unlink()
                            raise UserError(f"{plan.url}: server sent more than the manifest's {plan.size} bytes; "
                                            "the partial file was deleted")
                        f.write(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
                finally:
                    if not f.closed:
                        f.flush()
                        os.fsync(f.fileno())
        finally:
            bar.close()
    total = offset + written
    if total < plan.size:
        raise Interrupted(f"download of {plan.filename} stopped after {format_bytes(total)} of "
                          f"{format_bytes(plan.size)} (the server closed the transfer early)")
    return total, resumed


def download_component(session: requests.Session, plan: ComponentPlan, download_dir: Path, index: str,
                       retries: int, timeout: float, console: Console) -> Path:
    """Reuse a verified archive, or download/resume it; verify its sha256 before returning it."""
    final = download_dir / plan.filename
    part = download_dir / (plan.filename + ".part")
    if final.exists():
        if final.stat().st_size == plan.size and sha256_file(final) == plan.sha256:
            console.line(f"{index} {plan.name} {plan.version}: reusing verified download "
                         f"({format_bytes(plan.size)}, sha256 ok)")
            return final
        console.line(f"{index} {plan.name}: the earlier download failed re-verification; deleting it")
        final.unlink()
    start_offset = part.stat().st_size if part.exists() else 0
    resumed_any = False
    attempt = 0
    while True:
        try:
            _, resumed = transfer(session, plan, part, timeout, console)
            resumed_any = resumed_any or resumed
            break
        except Interrupted as exc:
            have = part.stat().st_size if part.exists() else 0
            if attempt >= retries:
                hint = f"re-run to resume from {part.name}" if have else "re-run to try again"
                raise UserError(f"{exc}; {hint}") from None
            attempt += 1
            console.line(f"      {plan.name}: {exc}; retry {attempt}/{retries} from byte {have}")
            time.sleep(min(0.5 * attempt, 5.0))
    os.replace(part, final)
    actual = sha256_file(final)
    if actual != plan.sha256:
        final.unlink()
        raise UserError(f"{plan.name}: sha256 mismatch for {plan.filename} (expected {plan.sha256}, "
                        f"got {actual}); the bad download was deleted")
    how = f"resumed from {format_bytes(start_offset)}" if resumed_any and start_offset else "downloaded"
    console.line(f"{index} {plan.name} {plan.version}: {format_bytes(plan.size)} {how}, sha256 ok")
    return final


# ---------------------------------------------------------------- unpacking
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


def count_installed(tree: Path) -> int:
    """Files and symlinks in the tree, without the receipt."""
    n = 0
    for dirpath, dirnames, filenames in os.walk(tree):
        n += len(filenames) + sum(1 for d in dirnames if os.path.islink(os.path.join(dirpath, d)))
    if (tree / RECEIPT_NAME).exists():
        n -= 1
    return n


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


# ---------------------------------------------------------------- existing install
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


# ---------------------------------------------------------------- locking and signals
def acquire_lock(root: Path, dirname: str):
    lock_path = root / f".{dirname}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"another prepare_v100_cuda.py run holds {lock_path}; wait for it to finish") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
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
        return receipt
    except OSError as exc:
        raise UserError(f"cannot build {target}: {one_line(exc)}") from None
    finally:
        if os.path.lexists(staging):
            remove_tree(staging)


if __name__ == "__main__":
    run_main(main)
