"""What the bench_classify_v100.py tests share (tests/test_bench_classify_*.py): the input subset, running
the bench, reading the server's counters and the receipts, validate_receipts.py, and whether NVML works here.

Speed: a 12-row subset of the bundled sample (option groups g1, g2, g4, one singleton without instruction,
and x1-a/x1-b: same premise, one without instruction, so two singletons) with its own reference made by
score_reference.py at --truncate 52 (three rows are cut, so truncation is exercised on every run). The
`mini` fixture is imported by the test modules that use it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import requests
from conftest import SAMPLE, run_script

MINI_IDS = ["g1-a", "g1-b", "g1-c", "g2-a", "g2-b", "g2-c", "g2-d", "g4-a", "g4-b", "s4", "x1-a", "x1-b"]
TRUNCATE = 52
BENCH = "bench_classify_v100.py"


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def mini(sample_tokens, overlay, tmp_path_factory) -> dict:
    """A subset of the sample: input set, token file (lines of the session token file) and its reference."""
    d = tmp_path_factory.mktemp("mini")
    keep = set(MINI_IDS)
    inputs = d / "mini.jsonl"
    tokens = d / "mini.tokens.jsonl"
    inputs.write_text("".join(l + "\n" for l in SAMPLE.read_text().splitlines() if json.loads(l)["id"] in keep))
    tokens.write_text("".join(l + "\n" for l in sample_tokens.read_text().splitlines()
                              if l.strip() and json.loads(l)["id"] in keep))
    ref = d / "reference"
    run_script("score_reference.py", "--model", overlay, "--tokens", tokens, "--inputs", inputs, "--out", ref,
               "--truncate", TRUNCATE, check=True)
    return {"inputs": inputs, "tokens": tokens, "reference": ref, "dir": d}


def run_bench(url, mini, out, *extra, reference=None, inputs=None, tokens=None, truncate=TRUNCATE, timeout=240):
    args = ["--url", url, "--inputs", inputs or mini["inputs"], "--tokens", tokens or mini["tokens"],
            "--reference", reference or mini["reference"], "--out", out]
    if truncate is not None:
        args += ["--truncate", truncate]
    return run_script(BENCH, *args, *extra, timeout=timeout)


def server_info(url) -> dict:
    return requests.get(f"{url}/server_info", timeout=30).json()


def receipt_of(out: Path) -> dict:
    return json.loads(out.read_text())


def validate(*paths) -> subprocess.CompletedProcess:
    return run_script("validate_receipts.py", *paths)


def nvml_available() -> tuple[bool, str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True, ""
    except Exception as exc:  # noqa: BLE001
        return False, f"{type(exc).__name__}: {exc}"


NVML, NVML_WHY = nvml_available()
