"""Pins recorded on this host for what HF_SOURCE.json leaves null: trust on first use.

A step run with --record-pins records the sha256 (or revision) it downloaded where the bundle pins
none, in ROOT/pins.json, and says so in its receipt; every later run verifies against that record,
as against the bundle's own pins. app/verify_sources.py lists both kinds."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

from openjev.common import UserError, atomic_write_json, openjev_root, utc_now

PINS_NAME = "pins.json"
KIND = "openjev-host-pins"
SCHEMA_VERSION = 1


def host_pins_path(root: Path | None = None) -> Path:
    return (root or openjev_root()) / PINS_NAME


class HostPins:
    """ROOT/pins.json: key -> {value, recorded_at, recorded_by, source}."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries = self._read()

    def _read(self) -> dict[str, dict]:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise UserError(f"{self.path}: not a readable pins file ({exc}); fix or remove it") from None
        if not isinstance(doc, dict) or doc.get("kind") != KIND or doc.get("schema_version") != SCHEMA_VERSION:
            raise UserError(f"{self.path}: not a pins file this bundle reads (kind {KIND}, schema_version "
                            f"{SCHEMA_VERSION}); fix or remove it")
        pins = doc.get("pins")
        if not isinstance(pins, dict) or not all(isinstance(v, dict) and isinstance(v.get("value"), str)
                                                 for v in pins.values()):
            raise UserError(f"{self.path}: its 'pins' are not key -> {{value, ...}} entries; fix or remove it")
        return pins

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def record(self, key: str, value: str, *, source: str, by: str) -> dict:
        """Record key = value (never replacing a different recorded value)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # stdlib only (flock, as filelock takes it): path step 2 records pins before the venv holds any package
        with open(str(self.path) + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.entries = self._read()
            have = self.entries.get(key)
            if have is not None and have["value"] != value:
                raise UserError(f"{key}: {self.path} already records {have['value']}, not {value}; refusing to "
                                "replace it (remove that entry to record anew)")
            entry = {"value": value, "recorded_at": utc_now(), "recorded_by": by, "source": source}
            self.entries[key] = have or entry
            atomic_write_json(self.path, {"kind": KIND, "schema_version": SCHEMA_VERSION,
                                          "note": "recorded on this host on first use (trust on first use); "
                                                  "HF_SOURCE.json pins none of these",
                                          "pins": self.entries})
        return self.entries[key]


def check_sha256(pins: HostPins, key: str, bundle_pin: str | None, digest: str, *, origin: str, record: bool,
                 allow_unpinned: bool, by: str) -> dict:
    """Receipt entry for a file whose sha256 is `digest`: checked against the bundle's pin, else the
    host's record; recorded now with `record` (trust on first use), or accepted unverified with
    `allow_unpinned` (a one-off); refused otherwise."""
    if bundle_pin is not None:
        if digest != bundle_pin:
            raise UserError(f"{key}: {origin} has sha256 {digest}, HF_SOURCE.json pins {bundle_pin}; refusing")
        return {"sha256": digest, "pinned": True, "pin": "bundle"}
    rec = pins.get(key)
    if rec is not None:
        if digest != rec["value"]:
            raise UserError(f"{key}: {origin} has sha256 {digest}, but {pins.path} recorded {rec['value']} on "
                            f"{rec['recorded_at']}; refusing (if the upstream file changed on purpose, remove that "
                            "entry and run again with --record-pins)")
        return {"sha256": digest, "pinned": True, "pin": "host", "recorded_at": rec["recorded_at"]}
    if record:
        rec = pins.record(key, digest, source=origin, by=by)
        return {"sha256": digest, "pinned": True, "pin": "recorded now (trust on first use)",
                "recorded_at": rec["recorded_at"]}
    if allow_unpinned:
        return {"sha256": digest, "pinned": False, "accepted_by": "--allow-unpinned"}
    raise UserError(f"{key} has no pinned sha256 in HF_SOURCE.json (null) and none is recorded in {pins.path}; "
                    f"refusing to use it unverified (its sha256 is {digest}; pass --record-pins to record it on "
                    "first use, or --allow-unpinned for a one-off, which is recorded)")
