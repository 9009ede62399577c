"""The bench's receipt (kind "openjev-bench", app/bench_classify_v100.py, written by openjev/bench/receipt.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from openjev.receipts.base import (ComputeBound, Int, KernelPath, Label, NonEmptyStr, NonNegFloat, NonNegInt, Obj,
                                   Part, PosFloat, PosInt, Receipt, Sha256, Timestamp, TokensEntry, const, int_at_least,
                                   one_of, ref)

NumberOrNull = float | None


class ArrayFile(Part):
    file: str = Field(pattern=r"^[^/]+\.npy$")
    sha256: Sha256
    shape: list[NonNegInt] = Field(min_length=2, max_length=3)
    dtype: Literal["float32"]


class ArgmaxChange(Part):
    id: Any
    reference: Label
    candidate: Label


class Agreement(Part):
    rows: Any
    max_abs_dp_e: float = Field(ge=0, le=1)
    p99_abs_dp_e: float = Field(ge=0, le=1)
    mean_abs_dp_e: float = Field(ge=0, le=1)
    max_abs_logit_diff: NonNegFloat
    argmax_changes_count: NonNegInt
    argmax_changes: list[ArgmaxChange]
    bitwise_equal: bool
    worst_rows: list[Any] = None


class AuditFailure(Part):
    group: Any
    rows: Any
    reference_winners: Any
    candidate_choice: Any
    outside_winners: list[str] = Field(min_length=1)
    reference_margin: NonNegFloat = None
    candidate_margin: NonNegFloat = None


class AuditTie(Part):
    group: Any
    rows: Any
    reference_winners: list[str] = Field(min_length=2)
    reference_choice: Any
    candidate_choice: Any


class PassAudit(Part):
    groups: Any
    rows_in_groups: Any
    failures_count: Any
    ties_count: Any
    reference_tied_groups: Any
    candidate_tied_groups: Any
    passed: Any
    failures: list[AuditFailure]
    ties: list[AuditTie]


class Pass(Part):
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"complete": {"const": True}}},
        "then": {"properties": {"wall_s": {"type": "number"}, "agreement": {"type": "object"},
                                "audit": {"type": "object"}, "error": {"type": "null"}}}})

    index: NonNegInt
    kind: Literal["initial", "measured"]
    started_at: Any
    complete: bool
    flush_cache: Obj | None
    batches: Any
    rows: Any
    wall_s: NumberOrNull
    batch_latencies_s: list[NumberOrNull]
    client_cpu_s: Any
    client_overhead_fraction: NumberOrNull
    retries: Any
    error: Any
    agreement: Agreement | None
    audit: PassAudit | None

    @model_validator(mode="after")
    def _complete_pass_has_figures(self):
        if self.complete and (self.wall_s is None or self.agreement is None or self.audit is None
                              or self.error is not None):
            raise ValueError("a complete pass has wall_s, agreement and audit, and no error")
        return self


class BatchLatency(Part):
    p50: NumberOrNull
    p90: NumberOrNull
    p99: NumberOrNull
    max: NumberOrNull
    mean: Any
    count: NonNegInt


class Timing(Part):
    measured_passes: NonNegInt
    wall_s: list[float]
    median_wall_s: NumberOrNull
    pairs_per_s: NumberOrNull
    batch_latency_s: BatchLatency
    client_cpu_s: Any
    client_overhead_fraction: NumberOrNull
    initial_pass_wall_s: Any
    retries: Any
    retried_passes: Any
    definition: Any


class SectionAuditFailure(AuditFailure):
    pass_: Any = Field(alias="pass")


class SectionAuditTie(AuditTie):
    pass_: Any = Field(alias="pass")


class SectionAudit(Part):
    definition: Any
    groups: NonNegInt
    rows_in_groups: Any
    singletons_not_covered: NonNegInt
    group_rows: Any
    passes_audited: Any
    failed: bool
    failures_total: Any
    ties_total: Any
    failures: list[SectionAuditFailure]
    ties: list[SectionAuditTie]


class Section(Part):
    flush_cache_before_each_pass: bool
    passes_planned: int_at_least(2)
    passes_done: NonNegInt
    measured_passes_done: NonNegInt
    passes: list[Pass]
    timing: Timing | None
    agreement_final: Agreement | None
    audit: SectionAudit


class ExclusiveServer(Part):
    pid: Any
    create_time: Any


class Violation(Part):
    t_s: Any
    at: Any
    violations: Any
    gpu_processes: Any


class Exclusive(Part):
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"valid": {"const": False}}},
        "then": {"properties": {"reason": {"type": "string"}}}})

    gpu_index: NonNegInt
    gpu: Obj | None
    server: ExclusiveServer
    interval_s: PosFloat
    samples: NonNegInt
    violating_samples: NonNegInt
    valid: bool
    reason: str | None
    violations: list[Violation] = Field(max_length=10)
    gpu_processes_seen: Any
    note: Any

    @model_validator(mode="after")
    def _invalid_says_why(self):
        if not self.valid and self.reason is None:
            raise ValueError("an invalid exclusivity record has a reason")
        return self


class BenchArguments(Part):
    url: Any
    inputs: Any
    tokens: Any
    reference: Any
    out: Any
    batch_size: PosInt
    workers: PosInt
    repetitions: PosInt
    truncate: PosInt
    cold_cache: bool
    exclusive_gpu: Any
    server_pid: Any
    sample_interval: Any
    timeout: Any
    retries: NonNegInt
    argv: list[str]


class BenchEnvironment(Part):
    host: str
    platform: Any
    bundle_git: Any
    gpus: list[Any]


class BenchServer(Part):
    url: str
    info_before: Obj | None
    info_after: Obj | None
    model: str | None
    flush_cache_calls_delta: Int | None


class BenchInputs(Part):
    path: Any
    sha256: Sha256
    rows: PosInt


class BenchReference(Part):
    path: Any
    receipt_sha256: Sha256
    logits_sha256: Sha256
    dtype: Any
    device: Any


class BenchOutputs(Part):
    candidate: ArrayFile | None
    passes: ArrayFile | None


def _mode_rule(mode: str, other: str) -> dict:
    return {"if": {"properties": {"mode": {"const": mode}}},
            "then": {"required": [mode], "not": {"required": [other]},
                     "properties": {mode: {"properties": {"flush_cache_before_each_pass": {"const": mode == "cold"}}}}}}


def _exit_rule(codes: list[int], then: dict) -> dict:
    cond = {"const": codes[0]} if len(codes) == 1 else {"enum": codes}
    return {"if": {"properties": {"exit_code": cond}, "required": ["exit_code"]}, "then": then}


class BenchReceipt(Receipt):
    """One JSON per benchmark run. Figures live under the key named by `mode` ('cold' or 'warm'); a run never
    has both. Exit status 1 writes no receipt, so exit_code is 0, 2, 3 or 4."""

    schema_file = "bench_receipt.schema.json"
    schema_title = "openjev-bench receipt (app/bench_classify_v100.py)"
    schema_keywords = {"allOf": [
        _mode_rule("cold", "warm"),
        _mode_rule("warm", "cold"),
        {"if": {"properties": {"valid": {"const": True}}, "required": ["valid"]},
         "then": {"properties": {"exit_code": {"const": 0}, "complete": {"const": True}, "reasons": {"maxItems": 0}}}},
        _exit_rule([0], {"properties": {"valid": {"const": True}}}),
        _exit_rule([2, 3, 4], {"properties": {"valid": {"const": False}, "reasons": {"minItems": 1}}}),
        _exit_rule([3], {"properties": {"exclusive": {**ref(Exclusive), "properties": {"valid": {"const": False}}}}}),
    ]}

    kind: Literal["openjev-bench"]
    schema_version: const(1)
    made_by: str
    label: str | None
    machine: NonEmptyStr = Field(description="where the figures come from: the server's GPU name, "
                                             "'cpu: <platform> (<cpu model>)', or --machine-label")
    mode: Literal["cold", "warm"]
    valid: bool
    complete: bool
    exit_code: one_of(0, 2, 3, 4)
    reasons: list[str]
    warnings: list[str]
    started_at: Timestamp
    finished_at: Timestamp
    arguments: BenchArguments
    environment: BenchEnvironment
    server: BenchServer
    inputs: BenchInputs
    tokens: TokensEntry
    reference: BenchReference
    exclusive: Exclusive | None
    outputs: BenchOutputs
    cold: Section = None
    warm: Section = None
    compute_bound: ComputeBound | None = None
    kernel_path: KernelPath | None = None

    @model_validator(mode="after")
    def _one_mode_and_a_consistent_verdict(self):
        sections = {m for m in ("cold", "warm") if m in self.model_fields_set}
        if sections != {self.mode}:
            raise ValueError(f"mode {self.mode!r}: the receipt holds the {self.mode!r} section and no other "
                             f"(it holds {', '.join(sorted(sections)) or 'none'})")
        if getattr(self, self.mode).flush_cache_before_each_pass != (self.mode == "cold"):
            raise ValueError(f"{self.mode}.flush_cache_before_each_pass must be {self.mode == 'cold'}")
        if self.valid != (self.exit_code == 0):
            raise ValueError(f"valid {self.valid} with exit_code {self.exit_code}: valid exactly when exit_code is 0")
        if self.valid and (not self.complete or self.reasons):
            raise ValueError("a valid run is complete and has no reasons")
        if not self.valid and not self.reasons:
            raise ValueError(f"exit_code {self.exit_code} needs at least one reason")
        if self.exit_code == 3 and (self.exclusive is None or self.exclusive.valid):
            raise ValueError("exit_code 3 needs an exclusive record that is not valid")
        return self
