"""The bench's inputs: the input set, its token file and the reference, checked to agree before any request."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from openjev.common import LABELS, UserError, ids_sha256, read_inputs, read_tokens, sha256_file, truncate_rows


@dataclass
class RunData:
    row_ids: list[str]
    inputs: list[dict]
    rows: list[list[int]]          # truncated, as sent
    truncated_rows: int
    reference: np.ndarray          # float32 [rows, 3]
    ref_meta: dict
    inputs_sha: str
    tokens_sha: str
    ids_sha: str
    ref_json_sha: str
    ref_npy_sha: str


def load_run_data(args) -> RunData:
    """Everything checked before a request is sent (exit 1 on any mismatch)."""
    ref_json, ref_npy = args.reference / "reference.json", args.reference / "reference.npy"
    if not args.reference.is_dir():
        raise UserError(f"reference directory {args.reference} not found")
    for f in (ref_json, ref_npy):
        if not f.is_file():
            raise UserError(f"reference {args.reference} is incomplete: {f.name} missing")
    try:
        meta = json.loads(ref_json.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{ref_json} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("kind") != "openjev-reference":
        raise UserError(f"{ref_json} is not a reference receipt (kind {meta.get('kind') if isinstance(meta, dict) else None!r}, "
                        "expected 'openjev-reference')")
    inputs = read_inputs(args.inputs)
    row_ids, raw_rows = read_tokens(args.tokens)
    inputs_sha, tokens_sha = sha256_file(args.inputs), sha256_file(args.tokens)
    ref_inputs = meta.get("inputs") or {}
    ref_tokens = meta.get("tokens") or {}
    if not ref_inputs.get("sha256"):
        raise UserError(f"reference {args.reference} records no input set (made without --inputs); "
                        f"its input set cannot be checked against {args.inputs}")
    if inputs_sha != ref_inputs["sha256"]:
        raise UserError(f"input set {args.inputs} sha256 {inputs_sha[:12]}... differs from the reference's "
                        f"{ref_inputs['sha256'][:12]}... (made from {ref_inputs.get('path')})")
    if tokens_sha != ref_tokens.get("sha256"):
        raise UserError(f"token file {args.tokens} sha256 {tokens_sha[:12]}... differs from the reference's "
                        f"{str(ref_tokens.get('sha256'))[:12]}... (made from {ref_tokens.get('path')})")
    if [r["id"] for r in inputs] != row_ids:
        raise UserError(f"token file {args.tokens} rows do not match input set {args.inputs} (ids or order differ)")
    if meta.get("row_ids") != row_ids:
        raise UserError(f"reference {args.reference} row_ids differ from the token file's ids (or their order)")
    if ref_tokens.get("truncate") != args.truncate:
        raise UserError(f"--truncate {args.truncate} differs from the reference's truncation "
                        f"({ref_tokens.get('truncate')}); pass --truncate {ref_tokens.get('truncate')}")
    rows, cut = truncate_rows(raw_rows, args.truncate)
    ids_sha = ids_sha256(rows)
    if ids_sha != ref_tokens.get("ids_sha256"):
        raise UserError(f"sha256 of the truncated ids {ids_sha[:12]}... differs from the reference's "
                        f"tokens.ids_sha256 {str(ref_tokens.get('ids_sha256'))[:12]}...")
    ref_npy_sha = sha256_file(ref_npy)
    if not meta.get("logits_sha256"):
        raise UserError(f"{ref_json} records no logits_sha256; the reference logits cannot be verified")
    if meta["logits_sha256"] != ref_npy_sha:
        raise UserError(f"{ref_npy} sha256 {ref_npy_sha[:12]}... differs from its receipt's logits_sha256 "
                        f"{meta['logits_sha256'][:12]}... (edited or corrupted)")
    sidecar = args.reference / "tokens.sha256"
    if sidecar.is_file() and sidecar.read_text().split()[:1] != [tokens_sha]:
        raise UserError(f"{sidecar} names another token file hash than {args.tokens}")
    try:
        ref = np.load(ref_npy, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise UserError(f"{ref_npy} cannot be read as a .npy array: {exc}") from None
    if ref.ndim != 2 or ref.shape != (len(row_ids), 3):
        raise UserError(f"{ref_npy} has shape {list(ref.shape)}, expected [{len(row_ids)}, 3] (rows, labels)")
    if not np.issubdtype(ref.dtype, np.floating) or not np.isfinite(ref).all():
        raise UserError(f"{ref_npy} must hold finite floating-point logits (dtype {ref.dtype})")
    if meta.get("labels") not in (None, list(LABELS)):
        raise UserError(f"reference label order {meta.get('labels')} is not {list(LABELS)}")
    return RunData(row_ids, inputs, rows, cut, ref.astype(np.float32), meta, inputs_sha, tokens_sha, ids_sha,
                   sha256_file(ref_json), ref_npy_sha)
