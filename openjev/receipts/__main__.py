"""python -m openjev.receipts --write [DIR] | --check [DIR]: generate the receipts' JSON Schema files from
their models, or check that DIR holds exactly what the models generate (default DIR: results_v100/schemas).

--check prints one line per differing, missing or stray schema file and exits 1 when there is any.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from openjev.common import REPO_ROOT, run_main
from openjev.receipts import RECEIPTS
from openjev.receipts.schema_files import check_all, write_all

SCHEMA_DIR = REPO_ROOT / "results_v100" / "schemas"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m openjev.receipts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", type=Path, nargs="?", const=SCHEMA_DIR, metavar="DIR",
                      help="write every schema file into DIR")
    what.add_argument("--check", type=Path, nargs="?", const=SCHEMA_DIR, metavar="DIR",
                      help="compare DIR's schema files with what the models generate")
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.write is not None:
        for path in write_all(RECEIPTS, args.write):
            print(f"wrote {path}")
        return 0
    problems = check_all(RECEIPTS, args.check)
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    run_main(main)
