"""openjev.receipts: the schema files are what the models generate, and models and files judge receipts alike."""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import validate_receipts

from openjev.common import UserError
from openjev.receipts import RECEIPTS, BenchReceipt, ReferenceReceipt, check_receipt, problem
from openjev.receipts.schema_files import check_all, render, schema_of

REPO = Path(__file__).resolve().parents[1]
RECORDED = [REPO / "results_h200", REPO / "results_h100", REPO / "benchmarks" / "results_cpu"]


def model_kinds(model) -> list[str]:
    return list(model.model_fields["kind"].annotation.__args__)


MODELS = {kind: model for model in RECEIPTS for kind in model_kinds(model)}


@functools.cache
def recorded_receipts() -> list[tuple[Path, dict]]:
    """(file, receipt) for every recorded receipt of a kind a model knows (read once; copy before editing)."""
    out = []
    for f in validate_receipts.expand([d for d in RECORDED if d.is_dir()]):
        doc = json.loads(f.read_text())
        if isinstance(doc, dict) and doc.get("kind") in MODELS:
            out.append((f, doc))
    return out


def test_the_schema_files_are_what_the_models_generate():
    assert check_all(RECEIPTS, validate_receipts.SCHEMA_DIR) == [], \
        "regenerate with: python -m openjev.receipts --write results_v100/schemas"


def test_each_schema_declares_its_models_kinds_and_file():
    for model in RECEIPTS:
        schema = schema_of(model)
        assert schema["$id"].endswith("/" + model.schema_file) and schema["title"] == model.schema_title
        assert validate_receipts.schema_kinds(schema) == model_kinds(model)
        assert render(model).endswith("}\n")
    assert len({m.schema_file for m in RECEIPTS}) == len(RECEIPTS)


def test_check_names_each_differing_missing_or_stray_file(tmp_path):
    d = tmp_path / "schemas"
    shutil.copytree(validate_receipts.SCHEMA_DIR, d)
    (d / "reference.schema.json").write_text("{}\n")
    (d / "fla_configs.schema.json").unlink()
    (d / "stray.schema.json").write_text("{}\n")
    cmd = [sys.executable, "-m", "openjev.receipts"]
    proc = subprocess.run([*cmd, "--check", str(d)], capture_output=True, text=True, cwd=REPO, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1 and len(lines) == 3, proc.stderr
    assert [l.split(":")[0] for l in lines] == [str(d / n) for n in
                                                 ("reference.schema.json", "fla_configs.schema.json",
                                                  "stray.schema.json")]
    proc = subprocess.run([*cmd, "--write", str(d)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("wrote ") == 2, proc.stdout + proc.stderr
    assert check_all(RECEIPTS, d) == [f"{d / 'stray.schema.json'}: no receipt model generates it"]


def test_every_recorded_receipt_fits_its_model_and_its_schema():
    schemas = validate_receipts.load_schemas(validate_receipts.SCHEMA_DIR)
    receipts = recorded_receipts()
    assert len(receipts) > 100 and {d["kind"] for _, d in receipts} >= {"openjev-bench", "openjev-reference"}
    for f, doc in receipts:
        assert problem(MODELS[doc["kind"]], doc) is None, f
        assert validate_receipts.validate_file(f, schemas, False) == (doc["kind"], None)


def _bench() -> dict:
    for _, doc in recorded_receipts():
        if doc["kind"] == "openjev-bench" and doc["valid"] and doc.get("warm"):
            return copy.deepcopy(doc)
    raise AssertionError("no valid warm bench receipt recorded")


def _edits():
    def mixed(d):
        d["cold"] = copy.deepcopy(d["warm"])

    def exit_3_without_record(d):
        d.update(exit_code=3, valid=False, reasons=["r"], exclusive=None)

    def complete_pass_with_error(d):
        d["warm"]["passes"][0]["error"] = "boom"

    def warm_that_flushed(d):
        d["warm"]["flush_cache_before_each_pass"] = True

    return {"valid with exit 2": lambda d: d.update(exit_code=2), "cold and warm": mixed,
            "no machine": lambda d: d.pop("machine"), "bad hash": lambda d: d["tokens"].update(sha256="xyz"),
            "exit 3, no record": exit_3_without_record, "complete pass with an error": complete_pass_with_error,
            "warm that flushed": warm_that_flushed,
            "shape of one axis": lambda d: d["outputs"]["candidate"].update(shape=[12])}


@pytest.mark.parametrize("name", sorted(_edits()))
def test_model_and_schema_reject_the_same_broken_bench_receipt(name, tmp_path):
    schemas = validate_receipts.load_schemas(validate_receipts.SCHEMA_DIR)
    doc = _bench()
    _edits()[name](doc)
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(doc))
    assert validate_receipts.validate_file(f, schemas, False)[1], name
    assert problem(BenchReceipt, doc), name


def test_integers_and_constants_compare_as_in_json_schema():
    doc = _bench()
    doc["warm"]["passes_planned"] = float(doc["warm"]["passes_planned"])  # 4.0 is an integer to JSON Schema
    doc["exit_code"] = 0.0
    assert problem(BenchReceipt, doc) is None
    doc["arguments"]["workers"] = True  # but a boolean is not
    assert "arguments.workers" in problem(BenchReceipt, doc)


def test_a_writer_refuses_a_receipt_its_model_rejects(tmp_path):
    ref = copy.deepcopy(next(d for _, d in recorded_receipts() if d["kind"] == "openjev-reference"))
    check_receipt(ReferenceReceipt, ref, tmp_path / "reference.json")
    bad = {**ref, "rows": 0, "mode": "fast"}
    with pytest.raises(UserError) as exc:
        check_receipt(ReferenceReceipt, bad, tmp_path / "reference.json")
    msg = str(exc.value)
    assert "\n" not in msg and "at rows:" in msg and "(and 1 more)" in msg and "not written" in msg
