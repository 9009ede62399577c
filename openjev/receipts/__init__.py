"""Receipts as pydantic models: one model per receipt kind, the source of results_v100/schemas/*.schema.json.

A receipt is a JSON file with a "kind". Its model says which keys it must hold and what they may be;
`python -m openjev.receipts --write results_v100/schemas` generates the JSON Schema files from the models
(`--check`: do the files agree), and app/validate_receipts.py validates receipts against those files.
Writers check a receipt before writing it with `check_receipt`.

  openjev.receipts.base          base classes, field types, parts several receipts share
  openjev.receipts.bench         "openjev-bench" (app/bench_classify_v100.py)
  openjev.receipts.reference     "openjev-reference" (app/score_reference.py)
  openjev.receipts.history       the bench history report and its reference lines
  openjev.receipts.install       the torch wheels the runtime venv was given (app/prepare_v100_torch.py)
  openjev.receipts.benchmarks    gateway, multihost, replicas on GPUs, serving front, harness overhead
  openjev.receipts.engine        fla configurations, embedded variants, sgl-kernel CPU ops build and engine
  openjev.receipts.schema_files  the generated schema files and their check
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from openjev.common import UserError
from openjev.receipts.base import Receipt
from openjev.receipts.bench import BenchReceipt
from openjev.receipts.benchmarks import GatewayBench, HarnessOverhead, MultihostBench, ReplicasGpuBench, \
    ServingFrontBench
from openjev.receipts.engine import EmbeddedGpuVariants, FlaConfigs, SglangCpuEngine, SglCpuOpsBuild
from openjev.receipts.history import BenchHistory, BenchReferenceLines
from openjev.receipts.install import TorchWheels
from openjev.receipts.reference import ReferenceReceipt

# every receipt model, one schema file each
RECEIPTS: tuple[type[Receipt], ...] = (
    BenchReceipt, ReferenceReceipt, BenchHistory, BenchReferenceLines, GatewayBench, MultihostBench,
    ReplicasGpuBench, ServingFrontBench, HarnessOverhead, FlaConfigs, EmbeddedGpuVariants, SglCpuOpsBuild,
    SglangCpuEngine, TorchWheels,
)


def problem(model: type[Receipt], receipt: Any) -> str | None:
    """Why `receipt` (as JSON would hold it) does not fit `model`, in one line; None when it fits."""
    try:
        model.model_validate(json.loads(json.dumps(receipt)))
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        where = ".".join(map(str, first["loc"])) or "(top level)"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return f"at {where}: {' '.join(first['msg'].split())}{more}"
    return None


def check_receipt(model: type[Receipt], receipt: dict, path) -> None:
    """Refuse to write a receipt its model rejects: a UserError naming the first problem."""
    why = problem(model, receipt)
    if why:
        raise UserError(f"the receipt for {path} does not fit {model.__name__} (openjev/receipts): {why}; "
                        "not written")
