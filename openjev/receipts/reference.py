"""The reference scorer's receipt (kind "openjev-reference", app/score_reference.py, reference.json)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from openjev.receipts.base import (ComputeBound, KernelPath, NonEmptyStr, NonNegFloat, NonNegInt, Part, PosInt,
                                   Receipt, Sha256, Timestamp, TokensEntry, const, require_keys, unique)


class ReferenceInputs(Part):
    path: Any
    sha256: Sha256


class Threads(Part):
    """--threads asked (0 = auto) and the threads that scored exact rows in each worker (1 on a CPU or for
    padded batches)"""

    requested: NonNegInt
    ran: PosInt


class Verify(Part):
    """--verify-rows (padded mode): rows scored again unpadded after the timed pass; a receipt exists only if
    their logits were bitwise the padded ones"""

    rows: PosInt
    row_indices: list[NonNegInt]
    lengths: list[PosInt] = None
    bitwise_equal: Literal[True]
    unequal_rows: const(0) = None
    max_abs_logit_diff: const(0) = None


class ReferenceReceipt(Receipt):
    """Receipt of the reference logits reference.npy beside it: unmodified Transformers forward over exact
    token ids. Only the keys the bench relies on are required; score_reference.py may add more."""

    schema_file = "reference.schema.json"
    schema_title = "openjev-reference receipt (app/score_reference.py, reference.json)"

    kind: Literal["openjev-reference"]
    made_by: str
    made_at: Timestamp
    labels: const(["contradiction", "entailment", "neutral"])
    rows: PosInt
    row_ids: Annotated[list[NonEmptyStr], Field(min_length=1, json_schema_extra={"uniqueItems": True}),
                       AfterValidator(unique)]
    inputs: ReferenceInputs | None = Field(
        description="null when the reference was made without --inputs; the bench refuses such a reference")
    tokens: TokensEntry
    model: require_keys("path")
    backend: str
    dtype: Literal["float16", "bfloat16", "float32"]
    device: str
    mode: Literal["exact", "padded"]
    batch_size: PosInt = None
    logits_sha256: Sha256
    elapsed_s: NonNegFloat = None
    environment: require_keys("host")
    workers: PosInt = None
    threads: Threads = None
    verify: Verify | None = None
    rows_per_s: float | None = None
    compute_bound: ComputeBound | None = None
    kernel_path: KernelPath | None = None
