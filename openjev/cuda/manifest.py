"""NVIDIA's redistrib_VERSION.json: where it comes from, its pinned sha256, and the plan of components it gives."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import PurePosixPath
from typing import Any, Sequence

from openjev.common import UserError, require_pin, sha256_bytes

DEFAULT_BASE_URL = "https://developer.download.nvidia.com/compute/cuda/redist/"


ARCHIVE_SUFFIX = ".tar.xz"


MANIFEST_MAX_BYTES = 8 << 20


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
    ("cuda_cuobjdump", "cuobjdump: lists the SM code a built library holds (the runtime installer's "
                       "sm_70 check of sgl-kernel); about 0.2 MiB"),
)


DEFAULT_COMPONENT_NAMES = tuple(name for name, _ in DEFAULT_COMPONENTS)


MACHINE_TO_PLATFORM = {"x86_64": "linux-x86_64", "amd64": "linux-x86_64",
                       "aarch64": "linux-sbsa", "arm64": "linux-sbsa"}


_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


_VERSION_RE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?$")


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


def plan_identity(version: str, platform: str, manifest_sha: str, plans: Sequence[ComponentPlan]) -> dict:
    return {
        "version": version,
        "platform": platform,
        "manifest_sha256": manifest_sha,
        "components": [{"name": p.name, "version": p.version, "relative_path": p.relative_path,
                        "sha256": p.sha256, "size": p.size} for p in plans],
    }
