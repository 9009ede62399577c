#!/usr/bin/env python3
"""Build sgl-kernel's CPU ops (``csrc/cpu/*.cpp``) as a torch C++ extension, outside the repository.

No package index offers these ops (``sglang-kernel`` ships CUDA wheels only), so a recorded run of
SGLang's CPU engine builds them from a local copy of the public ``sgl-kernel`` source folder, against
the torch of the Python that runs this script (the real-SGLang venv's). Nothing here is copied into
the repository: the source is read where it lies, the library is written under ``--build-dir``.

    build/sglang-venvs/0.5.23/bin/python benchmarks/sgl_cpu_ops_build.py \
        --src /tmp/sgl-kernel --build-dir /tmp/sgl-cpu-build/out

Prints the built library's path on the last line; writes ``build.json`` (flags, sources, torch,
compiler, seconds) beside it and the compiler log to ``build.log``. A build whose ``build.json``
matches the same sources (sha256), flags and torch is reused.

Flags: ``-O3 -march=native -fopenmp -mamx-bf16 -mamx-tile`` (``csrc/cpu/vec.h`` enables its AVX-512
paths only under ``__AMX_BF16__``, so the AMX flags are needed even where the processor has no AMX),
linked with ``-lnuma`` (Debian: ``apt-get install libnuma-dev``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-mamx-bf16", "-mamx-tile", "-Wno-unknown-pragmas",
          "-DSGLANG_CPU_FP8_CVT_FTZ"]
LDFLAGS = ["-lnuma", "-fopenmp"]
NAME = "common_ops"


class BuildError(RuntimeError):
    pass


def sources(src: Path) -> list[Path]:
    cpu = src / "csrc" / "cpu"
    if not cpu.is_dir():
        raise BuildError(f"{src} is not an sgl-kernel source folder: {cpu} does not exist")
    out = []
    for p in sorted(cpu.rglob("*.cpp")):
        rel = p.relative_to(cpu).parts
        if rel[0] in ("aarch64", "ppc64"):
            continue  # the x86_64 build leaves the other architectures' files out (as its CMakeLists)
        out.append(p)
    if not out:
        raise BuildError(f"no .cpp files under {cpu}")
    return out


def fingerprint(src: Path, files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files + sorted((src / "csrc" / "cpu").rglob("*.h")) + sorted((src / "include").rglob("*.h")):
        h.update(str(p.relative_to(src)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def git_revision(src: Path) -> str | None:
    for d in (src, *src.parents):
        if (d / "REVISION").is_file():
            return (d / "REVISION").read_text().strip()
    try:
        return subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def build(src: Path, build_dir: Path, jobs: int = 2, force: bool = False) -> Path:
    import torch
    from torch.utils import cpp_extension

    src = src.resolve()
    build_dir = build_dir.resolve()
    repo = Path(__file__).resolve().parents[1]
    if build_dir == repo or repo in build_dir.parents:
        raise BuildError(f"--build-dir {build_dir} is inside the repository {repo}: build outside it")
    files = sources(src)
    fp = fingerprint(src, files)
    meta_path = build_dir / "build.json"
    lib = build_dir / f"{NAME}.so"
    want = {"sources_sha256": fp, "cflags": CFLAGS, "ldflags": LDFLAGS, "torch": torch.__version__}
    if not force and lib.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        differ = [k for k, v in want.items() if meta.get(k) != v]
        if not differ:
            print(f"sgl cpu ops: reused {lib} (build.json matches)", file=sys.stderr)
            return lib
        print(f"sgl cpu ops: rebuilding {lib}: build.json differs in {differ}", file=sys.stderr)
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ["MAX_JOBS"] = str(jobs)
    log = build_dir / "build.log"
    if log.exists():
        log.rename(build_dir / f"build.{int(log.stat().st_mtime)}.log")
    t0 = time.time()
    # cpp_extension prints the ninja output on stdout/stderr; keep it in build.log as well.
    fd_out, fd_err = os.dup(1), os.dup(2)
    with open(log, "w") as fh:
        os.dup2(fh.fileno(), 1)
        os.dup2(fh.fileno(), 2)
        try:
            cpp_extension.load(
                name=NAME, sources=[str(p) for p in files], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                extra_include_paths=[str(src / "csrc" / "cpu"), str(src / "csrc"), str(src / "include")],
                build_directory=str(build_dir), verbose=True, is_python_module=False)
            ok = True
        except Exception as e:  # noqa: BLE001 - reported with the log's tail
            print(f"BUILD FAILED: {type(e).__name__}: {e}", flush=True)
            ok = False
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(fd_out, 1)
            os.dup2(fd_err, 2)
    secs = round(time.time() - t0, 1)
    if not ok or not lib.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise BuildError(f"building {NAME} failed after {secs} s (log {log}):\n{tail}")
    cxx = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    meta = dict(want, kind="openjev-sgl-cpu-ops-build", seconds=secs, jobs=jobs, library=str(lib), source_dir=str(src),
                source_revision=git_revision(src), n_sources=len(files),
                source_files=[str(p.relative_to(src)) for p in files], compiler=cxx[0] if cxx else None,
                python=platform.python_version(), machine=platform.machine(), nproc=os.cpu_count())
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    print(f"sgl cpu ops: built {lib} in {secs} s ({len(files)} sources, {jobs} jobs)", file=sys.stderr)
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="local sgl-kernel source folder")
    ap.add_argument("--build-dir", type=Path, required=True, help="output folder, outside the repository")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="rebuild even if build.json matches")
    a = ap.parse_args(argv)
    try:
        lib = build(a.src, a.build_dir, a.jobs, a.force)
    except BuildError as e:
        print(f"sgl_cpu_ops_build: error: {e}", file=sys.stderr)
        return 1
    print(lib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
