"""Receipts of the install steps (kind "openjev-torch-wheels", app/prepare_v100_torch.py, results/torch_receipt.json)."""

from __future__ import annotations

from typing import Literal

from openjev.receipts.base import NonEmptyStr, Part, Receipt, Sha256, Timestamp


class VerifiedWheel(Part):
    version: NonEmptyStr
    file: NonEmptyStr
    sha256: Sha256
    source: NonEmptyStr
    verified: NonEmptyStr  # "bundle pin", "recorded on this host at ... (trust on first use)", or not verified
    pinned: bool


class TorchWheels(Receipt):
    """The torch and torchvision wheels installed into the runtime venv, each with how its sha256 was verified
    (the bundle's pin, a pin recorded on this host, or accepted with --allow-unpinned)."""

    schema_file = "torch_wheels.schema.json"
    schema_title = "openjev-torch-wheels receipt (app/prepare_v100_torch.py)"

    kind: Literal["openjev-torch-wheels"]
    schema_version: Literal[1]
    made_by: NonEmptyStr
    started_at: Timestamp
    made_at: Timestamp
    venv: NonEmptyStr
    wheels: dict[str, VerifiedWheel]
    record_pins: bool
    allow_unpinned: bool
