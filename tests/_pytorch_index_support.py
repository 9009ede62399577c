"""A stand-in of PyTorch's wheel index (https://download.pytorch.org/whl/cu126) for loopback HTTP.

V100.md's path step 2 installs `torch==2.9.1+cu126 torchvision==0.24.1+cu126 --index-url
https://download.pytorch.org/whl/cu126`. The real wheels are gigabytes of CUDA code; these are small
real wheels that pip resolves, downloads, checks and installs as it does the real ones:

- named as PyTorch names them (`torch-2.9.1+cu126-cp311-cp311-manylinux_2_28_x86_64.whl`): one per
  CPython the runbook supports (3.10-3.12) and this interpreter's, each tagged for this machine's
  platform (manylinux_2_28 as PyTorch's are, when this machine supports it);
- valid wheels (WHEEL, METADATA, RECORD with the sha256 of every member) holding a tiny importable
  package that answers step 2's check line: `torch.__version__` is "2.9.1+cu126" and
  `torch.cuda.get_arch_list()` holds "sm_70" (nothing else of torch is there; the real wheel's arch
  list is longer and is not claimed here);
- torchvision declares `Requires-Dist: torch==2.9.1`, so pip resolves a dependency across the two
  projects; torch declares none (the real one's dependencies live on PyTorch's index too);
- served as a PEP 503 simple index: `/whl/cu126/torch/` and `/whl/cu126/torchvision/` are HTML pages
  (`text/html`) whose links carry `#sha256=<digest>` (pip refuses a download whose digest differs),
  the files at `/whl/cu126/<name, '+' quoted as %2B>` as PyTorch's pages link them.

    routes, types = pytorch_index()
    with LoopbackHTTPServer(routes, content_types=types) as srv:
        index_url = srv.url + INDEX_PATH.strip("/")      # what --index-url gets

`pytorch_index(tampered=True)` is the same index serving other bytes under the same file names (each wheel
holds one more module), its pages linking their sha256: what a compromised or changed index would serve.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import platform
import sys
import zipfile
from urllib.parse import quote

from packaging import tags

VARIANT = "cu126"
INDEX_PATH = f"/whl/{VARIANT}/"
TORCH_VERSION = f"2.9.1+{VARIANT}"
TORCHVISION_VERSION = f"0.24.1+{VARIANT}"
STANDIN_NOTE = "a stand-in made by tests/_pytorch_index_support.py for V100.md's path step 2, not PyTorch"
ARCH_LIST = ["sm_70"]
PYTHONS = ("310", "311", "312")
# The modules of each stand-in package: {project: {path in the wheel: source}}
PACKAGES = {
    "torch": {
        "torch/__init__.py": f'"""{STANDIN_NOTE}."""\n__version__ = "{TORCH_VERSION}"\nfrom . import cuda  # noqa: E402,F401\n',
        "torch/cuda/__init__.py": (f'"""{STANDIN_NOTE}: the arch list answers step 2\'s check line only."""\n\n\n'
                                   f'def get_arch_list():\n    return {ARCH_LIST!r}\n\n\n'
                                   'def is_available():\n    return False\n'),
    },
    "torchvision": {
        "torchvision/__init__.py": f'"""{STANDIN_NOTE}."""\n__version__ = "{TORCHVISION_VERSION}"\n',
    },
}
REQUIRES = {"torch": [], "torchvision": ["torch==2.9.1"]}
VERSIONS = {"torch": TORCH_VERSION, "torchvision": TORCHVISION_VERSION}


def platform_tag() -> str:
    """manylinux_2_28 (PyTorch's tag) when this machine takes it, else its most specific platform tag."""
    mine = [t for t in tags.sys_tags() if t.interpreter.startswith("cp") and t.abi != "none"]
    wanted = f"manylinux_2_28_{platform.machine()}"
    return wanted if any(t.platform == wanted for t in mine) else mine[0].platform


def wheel_tags() -> list[str]:
    """One cpXY-cpXY-PLATFORM tag per supported CPython and this interpreter's."""
    here = f"{sys.version_info.major}{sys.version_info.minor}"
    plat = platform_tag()
    return [f"cp{v}-cp{v}-{plat}" for v in sorted({*PYTHONS, here})]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(project: str, version: str, tag: str, tampered: bool = False) -> tuple[str, bytes]:
    """(file name, bytes) of a valid wheel of PACKAGES[project] (deterministic: fixed member times);
    tampered: one more module, so other bytes under the same name."""
    dist_info = f"{project}-{version}.dist-info"
    metadata = "".join([f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n",
                        f"Summary: {STANDIN_NOTE}\n", *(f"Requires-Dist: {r}\n" for r in REQUIRES[project])])
    extra = {f"{project}/_tampered.py": "TAMPERED = True\n"} if tampered else {}
    members = {**PACKAGES[project], **extra,
               f"{dist_info}/METADATA": metadata,
               f"{dist_info}/WHEEL": (f"Wheel-Version: 1.0\nGenerator: tests/_pytorch_index_support.py\n"
                                      f"Root-Is-Purelib: false\nTag: {tag}\n"),
               f"{dist_info}/top_level.txt": f"{project}\n"}
    encoded = {name: text.encode() for name, text in members.items()}
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in encoded.items())
    encoded[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in encoded.items():
            info = zipfile.ZipInfo(name, date_time=(2025, 11, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return f"{project}-{version}-{tag}.whl", buf.getvalue()


def pytorch_index(tampered: bool = False) -> tuple[dict[str, bytes], dict[str, str]]:
    """(routes, content types) of the loopback index: a simple page per project and its wheels."""
    routes: dict[str, bytes] = {}
    types: dict[str, str] = {}
    for project, version in VERSIONS.items():
        links = []
        for tag in wheel_tags():
            name, data = build_wheel(project, version, tag, tampered)
            path = INDEX_PATH + quote(name)
            routes[path] = data
            links.append(f'<a href="{html.escape(path)}#sha256={hashlib.sha256(data).hexdigest()}">'
                         f'{html.escape(name)}</a><br/>')
        page = INDEX_PATH + project + "/"
        routes[page] = ("<!DOCTYPE html>\n<html>\n<body>\n<h1>Links for " + project + "</h1>\n"
                        + "\n".join(links) + "\n</body>\n</html>\n").encode()
        types[page] = "text/html"
    return routes, types


def wheel_paths(routes: dict[str, bytes]) -> list[str]:
    return sorted(p for p in routes if p.endswith(".whl"))
