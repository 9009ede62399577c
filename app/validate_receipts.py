#!/usr/bin/env python3
"""Validate receipts (JSON files with a "kind") against the schemas in results_v100/schemas/.

Each PATH is a receipt file or a directory (every *.json under it, recursively, except schema
files). A receipt's "kind" picks its schema: every results_v100/schemas/*.schema.json declares the
kind it validates as `properties.kind.const` (bench_receipt.schema.json: "openjev-bench",
reference.schema.json: "openjev-reference"), or the kinds as `properties.kind.enum` (a renamed kind
and the old one its recorded receipts carry). The files are generated from the receipts' models in
openjev/receipts/: to support a new receipt kind, add its model there and regenerate them
(python -m openjev.receipts --write results_v100/schemas); nothing here changes. Two schemas claiming
one kind is an error.

Beyond the schema, files a receipt names beside itself are checked (skip with --no-check-files):
an "openjev-bench" receipt's outputs (OUT.candidate.npy, OUT.passes.npy) must exist with the
recorded sha256, and an "openjev-reference" receipt's reference.npy must match logits_sha256.

Output: "PATH: ok (KIND)" on stdout for each valid file; one line "PATH: invalid: WHY" on stderr
for each invalid one. Exit status 0 when every file is valid, 1 otherwise (or on a usage error).

Examples:
  validate_receipts.py results/bench_G_warm.json results/ref_G/reference.json
  validate_receipts.py results_v100/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from openjev.common import REPO_ROOT, UserError, run_main, sha256_file

SCHEMA_DIR = REPO_ROOT / "results_v100" / "schemas"
SCHEMA_SUFFIX = ".schema.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="receipt files or directories")
    p.add_argument("--schemas", type=Path, default=SCHEMA_DIR,
                   help=f"directory of *{SCHEMA_SUFFIX} files (default: results_v100/schemas)")
    p.add_argument("--no-check-files", action="store_true",
                   help="only the schema: do not check the .npy files a receipt names beside itself")
    p.add_argument("--quiet", action="store_true", help="print nothing for valid files")
    return p


def schema_kinds(schema: dict) -> list[str]:
    """The kinds a schema validates: properties.kind.const, or every string of properties.kind.enum
    (a renamed kind beside the old one that recorded receipts keep); [] when it declares none."""
    spec = (schema.get("properties") or {}).get("kind") or {}
    if isinstance(spec.get("const"), str):
        return [spec["const"]]
    enum = spec.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(k, str) for k in enum):
        return list(enum)
    return []


def load_schemas(directory: Path) -> dict:
    """kind -> (schema path, validator) for every schema file in `directory`."""
    from jsonschema import Draft202012Validator, FormatChecker
    from jsonschema.exceptions import SchemaError

    if not directory.is_dir():
        raise UserError(f"schema directory {directory} not found")
    out: dict[str, tuple[Path, object]] = {}
    for path in sorted(directory.glob(f"*{SCHEMA_SUFFIX}")):
        try:
            schema = json.loads(path.read_text())
            Draft202012Validator.check_schema(schema)
        except (json.JSONDecodeError, SchemaError) as exc:
            raise UserError(f"schema {path} is broken: {str(exc).splitlines()[0]}") from None
        kinds = schema_kinds(schema)
        if not kinds:
            raise UserError(f"schema {path} does not declare its kind (properties.kind.const or .enum)")
        validator = Draft202012Validator(schema, format_checker=FormatChecker())
        for kind in kinds:
            if kind in out:
                raise UserError(f"schemas {out[kind][0].name} and {path.name} both claim kind {kind!r}")
            out[kind] = (path, validator)
    if not out:
        raise UserError(f"no *{SCHEMA_SUFFIX} files in {directory}")
    return out


def expand(paths: list[Path]) -> list[Path]:
    files = []
    for p in paths:
        if p.is_dir():
            files += sorted(f for f in p.rglob("*.json") if not f.name.endswith(SCHEMA_SUFFIX) and f.is_file())
        else:
            files.append(p)
    return files


def check_bench_files(receipt: dict, where: Path) -> list[str]:
    problems = []
    for key, entry in (receipt.get("outputs") or {}).items():
        if not entry:
            continue
        f = where.parent / entry["file"]
        if not f.is_file():
            problems.append(f"outputs.{key}: {f.name} is missing beside the receipt")
        elif sha256_file(f) != entry["sha256"]:
            problems.append(f"outputs.{key}: {f.name} sha256 differs from the receipt's (replaced or edited)")
    return problems


def check_reference_files(receipt: dict, where: Path) -> list[str]:
    f = where.parent / "reference.npy"
    if not f.is_file():
        return [f"reference.npy is missing beside {where.name}"]
    if sha256_file(f) != receipt.get("logits_sha256"):
        return ["reference.npy sha256 differs from logits_sha256 (replaced or edited)"]
    return []


# Cross-file checks a schema cannot express, by kind (kinds without an entry get the schema only).
FILE_CHECKS = {"openjev-bench": check_bench_files, "openjev-reference": check_reference_files}


def validate_file(path: Path, schemas: dict, check_files: bool) -> tuple[str | None, str | None]:
    """(kind, problem) for one file; problem None when valid."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None, "not found"
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"not valid JSON: {exc}"
    if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
        return None, "no 'kind' field: not a receipt this validator knows"
    kind = doc["kind"]
    if kind not in schemas:
        return kind, f"unknown kind {kind!r} (known: {', '.join(sorted(schemas))}; add {kind}{SCHEMA_SUFFIX}-style " \
                     "schema to the schema directory)"
    from jsonschema.exceptions import best_match

    errors = list(schemas[kind][1].iter_errors(doc))
    if errors:
        err = best_match(errors)
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return kind, f"{kind} schema: at {where}: {_one_line(err.message)}{more}"
    if check_files and kind in FILE_CHECKS:
        problems = FILE_CHECKS[kind](doc, path)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            return kind, problems[0] + more
    return kind, None


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def main() -> int:
    args = build_parser().parse_args()
    schemas = load_schemas(args.schemas)
    files = expand(args.paths)
    if not files:
        raise UserError("no receipt files found under " + " ".join(map(str, args.paths)))
    bad = 0
    for f in files:
        kind, problem = validate_file(f, schemas, not args.no_check_files)
        if problem:
            bad += 1
            print(f"{f}: invalid: {problem}", file=sys.stderr, flush=True)
        elif not args.quiet:
            print(f"{f}: ok ({kind})")
    return 1 if bad else 0


if __name__ == "__main__":
    run_main(main)
