"""PyTorch's torch and torchvision wheels for the runtime venv (app/prepare_v100_torch.py, V100.md path step 2).

Each wheel is downloaded with the venv's own pip (so the file fits its Python), its sha256 checked against
HF_SOURCE.json's `<project>.wheel_sha256`, else against the one this host recorded (openjev/pins.py, trust on
first use, key `<project>.wheels.<file name>`), and only a verified file is installed; the wheels' own
dependencies come from the index as pip resolves them. pip records the sha256 of an installed file in its
direct_url.json, which is how a re-run tells that the venv already holds the verified wheels.

Only the standard library and openjev: this runs before the venv holds any package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote, urlparse

from openjev.common import UserError, sha256_file, try_exclusive_lock, utc_now
from openjev.pins import HostPins, check_sha256

PROJECTS = ("torch", "torchvision")
KIND = "openjev-torch-wheels"
SCHEMA_VERSION = 1
RECEIPT_NAME = "torch_receipt.json"  # under ROOT/results, beside runtime_receipt.json
MADE_BY = "app/prepare_v100_torch.py"

# Run by the venv's interpreter: {"python": X.Y.Z, project: {version, direct_url} or null}
PROBE = r"""
import json, platform, sys
from importlib import metadata
out = {"python": platform.python_version()}
for name in sys.argv[1:]:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        out[name] = None
        continue
    text = dist.read_text("direct_url.json")
    out[name] = {"version": dist.version, "direct_url": json.loads(text) if text else None}
print(json.dumps(out))
"""


@dataclasses.dataclass(frozen=True)
class Wheel:
    """One wheel to fetch, as HF_SOURCE.json names it."""

    project: str
    version: str  # with the variant as local version: 2.9.1+cu126
    index_url: str
    bundle_pin: str | None

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"

    def pin_key(self, filename: str) -> str:
        return f"{self.project}.wheels.{filename}"

    def origin(self, filename: str) -> str:
        return f"{self.index_url.rstrip('/')}/{filename}"


def wanted_wheels(sources: dict, index_url: str | None = None) -> list[Wheel]:
    """The torch and torchvision wheels the sources file names (`index_url` replaces its index)."""
    out = []
    for project in PROJECTS:
        entry = sources.get(project)
        if not isinstance(entry, dict) or not entry.get("version") or not (index_url or entry.get("index_url")):
            raise UserError(f"the sources file has no usable '{project}' entry (version and index_url); "
                            "restore HF_SOURCE.json from the bundle")
        version = f"{entry['version']}+{entry['variant']}" if entry.get("variant") else entry["version"]
        out.append(Wheel(project, version, index_url or entry["index_url"], entry.get("wheel_sha256")))
    return out


def refuse_unpinnable(wanted: list[Wheel], pins: HostPins, record: bool, allow_unpinned: bool) -> None:
    """Before a download of gigabytes: refuse a wheel nothing could verify."""
    if record or allow_unpinned:
        return
    for w in wanted:
        if w.bundle_pin is None and not any(k.startswith(w.pin_key("")) for k in pins.entries):
            raise UserError(f"{w.project}: HF_SOURCE.json pins no wheel sha256 ({w.project}.wheel_sha256 is null) "
                            f"and {pins.path} records none for this host; refusing to download it unverified "
                            "(pass --record-pins to record its sha256 on first use, or --allow-unpinned for a "
                            "one-off, which is recorded)")


def how_verified(entry: dict) -> str:
    """A check_sha256 entry in words, for the receipt and the summary."""
    if entry.get("pin") == "bundle":
        return "bundle pin"
    if entry.get("pinned"):
        return f"recorded on this host at {entry['recorded_at']} (trust on first use)"
    return "not verified (accepted with --allow-unpinned)"


# ---------------------------------------------------------------- the venv
class Venv:
    """The venv to install into; pip's cache and temporary files go under `root` (downloads of gigabytes)."""

    def __init__(self, path: Path, root: Path):
        self.path, self.root = Path(path).expanduser().absolute(), root
        self.python = self.path / "bin" / "python"

    def check(self) -> None:
        if not os.access(self.python, os.X_OK):
            raise UserError(f"no Python interpreter at {self.python}; create the venv first "
                            f"(python3 -m venv {self.path}, V100.md path step 2)")

    def installed(self) -> dict:
        """{"python": version, project: {version, direct_url} or None} as the venv's interpreter sees it."""
        proc = subprocess.run([str(self.python), "-I", "-c", PROBE, *PROJECTS], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"{self.python} could not list its installed packages (exit status "
                            f"{proc.returncode}): {last}")
        return json.loads(proc.stdout)

    def pip(self, *args: str) -> tuple[int, list[str]]:
        """Run the venv's pip, its output to the terminal: (exit status, the command, for the receipt)."""
        cmd = [str(self.python), "-I", "-m", "pip", *args]
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PIP_CACHE_DIR": str(self.root / "cache" / "pip"), "TMPDIR": str(self.root / "tmp")}
        return subprocess.run(cmd, env=env).returncode, cmd


def installed_file(entry: dict | None) -> tuple[str | None, str | None]:
    """(file name, sha256) of the wheel an installed distribution came from; (None, None) when pip installed
    it from an index (no direct_url.json) or recorded no hash."""
    info = (entry or {}).get("direct_url") or {}
    archive = info.get("archive_info") or {}
    sha = (archive.get("hashes") or {}).get("sha256")
    if sha is None and str(archive.get("hash", "")).startswith("sha256="):
        sha = archive["hash"].split("=", 1)[1]
    name = unquote(urlparse(info.get("url", "")).path).rsplit("/", 1)[-1] or None
    return name, sha


def already_installed(wanted: list[Wheel], state: dict, receipt: dict | None, venv: Venv, pins: HostPins,
                      allow_unpinned: bool) -> dict[str, dict] | None:
    """{project: check entry} when the venv holds exactly the wheels the receipt names and they still verify;
    else None (the step runs)."""
    if not receipt or receipt.get("venv") != str(venv.path):
        return None
    out = {}
    for w in wanted:
        have, recorded = state.get(w.project), (receipt.get("wheels") or {}).get(w.project) or {}
        name, sha = installed_file(have)
        if not have or have["version"] != w.version or sha is None or (name, sha) != (recorded.get("file"),
                                                                                  recorded.get("sha256")):
            return None
        try:
            out[w.project] = check_sha256(pins, w.pin_key(name), w.bundle_pin, sha, origin=w.origin(name),
                                          record=False, allow_unpinned=allow_unpinned, by=MADE_BY)
        except UserError:
            return None  # a pin changed: download and verify anew, which says what differs
        out[w.project]["file"] = name
    return out


# ---------------------------------------------------------------- download, verify, install
@contextlib.contextmanager
def download_folder(folder: Path):
    """FOLDER/download, empty, for this run only (a second run at once is refused); removed afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, holder = try_exclusive_lock(folder / ".lock")
    if fd is None:
        raise UserError(f"another prepare_v100_torch.py (pid {holder}) is working in {folder}; wait for it to finish")
    target = folder / "download"
    try:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        yield target
    finally:
        shutil.rmtree(target, ignore_errors=True)
        os.close(fd)


def download(venv: Venv, wanted: list[Wheel], dest: Path) -> tuple[dict[str, Path], list]:
    """({project: downloaded wheel}, commands): pip download --no-deps of each wanted wheel into dest."""
    commands = []
    for url in dict.fromkeys(w.index_url for w in wanted):
        reqs = [w.requirement for w in wanted if w.index_url == url]
        rc, cmd = venv.pip("download", "--no-deps", "--only-binary", ":all:", "--no-cache-dir", "--index-url", url,
                           "-d", str(dest), *reqs)
        if rc != 0:
            raise UserError(f"pip download from {url} exited with status {rc} (pip's output is above); "
                            "nothing was installed")
        commands.append(cmd)
    files = sorted(dest.iterdir())
    by_project = {w.project: [f for f in files if f.name.startswith(w.project + "-") and f.suffix == ".whl"]
                  for w in wanted}
    if len(files) != len(wanted) or any(len(v) != 1 for v in by_project.values()):
        raise UserError(f"pip download left {', '.join(f.name for f in files) or 'nothing'} in {dest}; expected one "
                        f"wheel of each of {', '.join(PROJECTS)}; nothing was installed")
    return {p: v[0] for p, v in by_project.items()}, commands


def verify(files: dict[str, Path], wanted: list[Wheel], pins: HostPins, *, record: bool, allow_unpinned: bool,
           rejected: Path) -> dict[str, dict]:
    """{project: check entry} for each downloaded wheel. A wheel whose sha256 differs from its pin is moved
    to `rejected` and refused before anything is recorded; then each is checked, recorded with `record`."""
    digests = {w.project: sha256_file(files[w.project]) for w in wanted}
    for w in wanted:
        f = files[w.project]
        try:  # a differing pin only: nothing recorded, nothing accepted yet
            check_sha256(pins, w.pin_key(f.name), w.bundle_pin, digests[w.project], origin=w.origin(f.name),
                         record=False, allow_unpinned=True, by=MADE_BY)
        except UserError as exc:
            rejected.mkdir(parents=True, exist_ok=True)
            os.replace(f, rejected / f.name)
            raise UserError(f"{exc}; the file is kept aside as {rejected / f.name}; nothing was installed") from None
    out = {}
    for w in wanted:
        f = files[w.project]
        out[w.project] = {**check_sha256(pins, w.pin_key(f.name), w.bundle_pin, digests[w.project],
                                         origin=w.origin(f.name), record=record, allow_unpinned=allow_unpinned,
                                         by=MADE_BY), "file": f.name}
    return out


def install(venv: Venv, wanted: list[Wheel], files: dict[str, Path], verified: dict[str, dict]) -> tuple[dict, list]:
    """Install the verified files (their dependencies from the index); a wheel of the same version that pip
    keeps because it is already installed from elsewhere is replaced with --force-reinstall. Returns the
    venv's state afterwards and the commands."""
    urls = list(dict.fromkeys(w.index_url for w in wanted))
    index = ["--index-url", urls[0], *(a for u in urls[1:] for a in ("--extra-index-url", u))]
    # file URLs with their sha256: pip checks it again and records it in direct_url.json (pip before 22.2
    # records no hash of a plain local file)
    src = {w.project: f"{files[w.project].absolute().as_uri()}#sha256={verified[w.project]['sha256']}" for w in wanted}
    commands = []

    def pip_install(*args: str) -> None:
        rc, cmd = venv.pip("install", *args)
        commands.append(cmd)
        if rc != 0:
            raise UserError(f"pip install into {venv.path} exited with status {rc} (pip's output is above); "
                            "run this step again once the cause is fixed")

    pip_install(*index, *(src[w.project] for w in wanted))
    state = venv.installed()
    stale = [w for w in wanted if installed_file(state.get(w.project))[1] != verified[w.project]["sha256"]]
    if stale:  # pip keeps a same-version install from elsewhere (an index) in place of a file
        pip_install("--no-deps", "--no-index", "--force-reinstall", *(src[w.project] for w in stale))
        state = venv.installed()
    for w in wanted:
        have, sha = state.get(w.project), installed_file(state.get(w.project))[1]
        if not have or have["version"] != w.version or sha != verified[w.project]["sha256"]:
            raise UserError(f"after pip install, {venv.path} has {w.project} "
                            f"{have['version'] if have else 'not installed'} (from sha256 {sha}), not the verified "
                            f"{files[w.project].name} (sha256 {verified[w.project]['sha256']}); refusing to call it "
                            "installed")
    return state, commands


def make_receipt(*, wanted: list[Wheel], verified: dict[str, dict], venv: Venv, state: dict, pins: HostPins,
                 started_at: str, commands: list, record: bool, allow_unpinned: bool) -> dict:
    return {
        "kind": KIND, "schema_version": SCHEMA_VERSION, "made_by": MADE_BY,
        "started_at": started_at, "made_at": utc_now(),
        "venv": str(venv.path), "python": state.get("python"),
        "wheels": {w.project: {"version": w.version, "file": verified[w.project]["file"],
                               "sha256": verified[w.project]["sha256"], "source": w.origin(verified[w.project]["file"]),
                               "verified": how_verified(verified[w.project]), "pinned": verified[w.project]["pinned"]}
                   for w in wanted},
        "pins_file": str(pins.path), "record_pins": record, "allow_unpinned": allow_unpinned,
        "commands": commands,
    }


def read_receipt(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("kind") == KIND else None


def summary(project: str, version: str, entry: dict) -> str:
    return f"{project} {version}: {entry['file']} sha256 {entry['sha256']} ({how_verified(entry)})"
