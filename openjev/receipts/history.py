"""The scheduled bench's history report and the reference lines drawn on its plot (app/report_bench_history.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from openjev.receipts.base import NonEmptyStr, Obj, Part, Receipt


class HistoryRun(Part):
    name: NonEmptyStr
    complete: bool
    valid: bool
    measurements: Obj


class BenchHistory(Receipt):
    """The runs of a scheduled-benchmark history with their medians, agreement figures, validity and the
    verdict. Not a V100 figure unless its machine says so."""

    schema_file = "bench_history.schema.json"
    schema_title = "openjev-bench-history (app/report_bench_history.py --json)"

    kind: Literal["openjev-bench-history"]
    runs: list[HistoryRun]


class BenchReferenceLines(Receipt):
    """Named reference medians in seconds drawn on the history plot; keys starting with '_' are comments (the
    source of the figures)."""

    schema_file = "bench_reference_lines.schema.json"
    schema_title = "openjev-bench-reference-lines (input of app/report_bench_history.py --reference-lines)"
    schema_keywords = {"patternProperties": {"^[^_]": {"type": ["number", "string"]}}}

    kind: Literal["openjev-bench-reference-lines"]

    @model_validator(mode="after")
    def _lines_are_numbers_or_strings(self):
        for key, value in (self.model_extra or {}).items():
            if key[:1] not in ("", "_") and (isinstance(value, bool) or not isinstance(value, (int, float, str))):
                raise ValueError(f"{key!r}: a line is a number of seconds (or a string), not {value!r}")
        return self
