"""The adapter inside SGLang 0.5.23's real CPU engine, over HTTP on 127.0.0.1.

One engine per module (`python -m sglang_openjev_cpu.serve`, SGLANG_USE_CPU_ENGINE=1, bfloat16,
radix cache on, `--chunked-prefill-size 32`, `--sleep-on-idle`: an idle scheduler otherwise spins a whole
core, which the rest of the module needs) on a random-weight tiny-gdn64 classifier (GDN key/value
head dim 64, the smallest the CPU GDN kernels take). The CPU ops are the project's pure-PyTorch
stand-ins (openjev_testsupport.sgl_kernel_cpu_standin), because sgl-kernel's CPU library cannot be
installed in CI; with OPENJEV_SGL_CPU_OPS=/path/to/common_ops.so in the environment the same tests
run on the compiled library instead (benchmarks/sgl_cpu_ops_build.py builds it).

Rows: the bundled NLI sample (22 rows, 31 to 63 tokens) and a synthetic set of 8 rows in option groups
(shared prefixes), 68 to 128 tokens, so most rows span two to five 32-token prefill chunks. The reference is app/score_reference.py
(unmodified Transformers forward, one unpadded row at a time) in float32 and in bfloat16; the
engine runs bfloat16 only (sgl-kernel's CPU GDN kernels take bfloat16/float16, nothing else).
What is checked:

- the engine starts with the adapter, and its scheduler ran the stand-in ops (call log);
- `/classify` and `/v1/classify` give the reference's argmax on every row, logits within the stated
  tolerances of the float32 and bfloat16 references;
- rows longer than the chunk are prefilled in several chunks and stay right;
- the same rows again hit the radix cache (the server's `#cached-token`) and stay right;
- a checkpoint with a tensor too many is refused at start (strict loading), the name in the output.

Skips (reason shown by `pytest -rs`) where sglang 0.5.23 is not installed; `OPENJEV_REQUIRE_SGLANG=1`
turns that into an error unless another sglang version is installed (these tests are 0.5.23's).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "app"
SAMPLE = REPO / "data" / "nli_sample.jsonl"
SGLANG_VERSION = "0.5.23"
CHUNK = 32  # --chunked-prefill-size of the shared engine
# Tolerances, max |engine - reference| over all logits of all rows (engine bfloat16). Measured on the
# 2-core dev machine for these rows: against float32 0.0186 with the stand-ins, 0.0161 with the compiled
# library; against bfloat16 0.0117 with either. With the previous conv window dropped at chunk boundaries (the kernel's
# varlen path without sglang_openjev_cpu's fix) another row set was 0.048 off through the engine, and
# one row of this set moves by 0.166 when Transformers' conv is cut the same way: these bounds refuse both.
TOL_FP32 = 0.025  # engine bfloat16 vs Transformers float32
TOL_BF16 = 0.02   # engine bfloat16 vs Transformers bfloat16
STANDIN_PREFILL_OPS = {
    "causal_conv1d_fwd_cpu", "chunk_gated_delta_rule_cpu", "fused_gdn_gating_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_rmsnorm_gated_cpu", "fused_sigmoid_mul_cpu",
}


def _why_not_here() -> tuple[str | None, bool]:
    """(skip reason or None, whether the reason is only 'another sglang version')."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "sglang is not installed here (the project venv and CI's main suite do not install it)", False
    if version != SGLANG_VERSION:
        return f"sglang {version} here; these tests are for sglang {SGLANG_VERSION}'s CPU engine", True
    try:
        import torch  # noqa: F401

        import openjev_testsupport.sgl_kernel_cpu_standin.ops  # noqa: F401
        import sglang_openjev_cpu.runtime  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means: cannot run here
        return f"{type(exc).__name__}: {exc}", False
    return None, False


REASON, OTHER_VERSION = _why_not_here()
if REASON is not None and os.environ.get("OPENJEV_REQUIRE_SGLANG") == "1" and not OTHER_VERSION:
    raise RuntimeError(f"OPENJEV_REQUIRE_SGLANG=1 but the sglang {SGLANG_VERSION} CPU-engine tests cannot run: {REASON}")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"{REASON}: run in build/sglang-venvs/{SGLANG_VERSION} "
                                "(`make test` does, via .ci/sglang_venv.sh)")

PY = sys.executable


def run(script: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """An app/ script in this venv, which has the bundle's library on PYTHONPATH rather than installed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([PY, str(APP / script), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def post(url: str, body: dict, timeout: float = 300) -> dict:
    import requests

    r = requests.post(url, json=body, timeout=timeout)
    assert r.status_code == 200, f"{url}: {r.status_code} {r.text[:2000]}"
    return r.json()


def ops_env() -> str:
    return os.environ.get("OPENJEV_SGL_CPU_OPS") or "standin"


class Engine:
    """`python -m sglang_openjev_cpu.serve` in its own session, output in a log file."""

    def __init__(self, model: Path, log: Path, *flags: str, call_log: Path | None = None):
        self.port = free_port()
        self.log = log
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OPENJEV_SGL_CPU_OPS": ops_env(), "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", ""))
                                             if p)}
        if call_log is not None:
            env["OPENJEV_STANDIN_CALL_LOG"] = str(call_log)
        cmd = [PY, "-m", "sglang_openjev_cpu.serve", "--model-path", str(model), "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "bfloat16", "--disable-overlap-schedule", "--sleep-on-idle",
               *flags]
        self.fh = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.fh, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                     start_new_session=True)
        self.started = time.monotonic()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 600) -> float:
        import requests

        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited with {self.proc.returncode}:\n{self.text()[-6000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"engine not healthy after {timeout} s:\n{self.text()[-6000:]}")

    def wait_exit(self, timeout: float = 600) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        try:  # children SGLang spawned in the same session, if any outlived the parent
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.fh.close()


def token_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cached_tokens(log_text: str) -> list[int]:
    return [int(m) for m in re.findall(r"#cached-token: (\d+)", log_text)]


def new_tokens(log_text: str) -> list[int]:
    return [int(m) for m in re.findall(r"#new-token: (\d+)", log_text)]


# ---------------------------------------------------------------- fixtures (one engine per module)
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cpu_engine")


@pytest.fixture(scope="module")
def model(work) -> Path:
    """tiny-gdn64 checkpoint and its overlay (the processor configs SGLang's Qwen3.5 path loads)."""
    run("make_tiny_model.py", work / "checkpoint", "--shape", "tiny-gdn64", "--processor-out", work / "processor")
    run("prepare_v100_model.py", work / "checkpoint", work / "overlay", "--processor-dir", work / "processor",
        "--allow-unpinned")
    return work / "overlay"


@pytest.fixture(scope="module")
def rows(model, work) -> tuple[list[str], list[list[int]]]:
    """Demo rows tokenized with the model's tokenizer, then synthetic rows in option groups."""
    run("tokenize_nli.py", "--model", model, "--inputs", SAMPLE, "--out", work / "sample.tokens.jsonl")
    run("make_synthetic_inputs.py", work / "synthetic", "--rows", "8", "--max-group", "3", "--premise-tokens",
        "30:110", "--hypothesis-tokens", "6:14", "--instruction-tokens", "24", "--vocab", "512", "--seed", "1")
    all_rows = token_rows(work / "sample.tokens.jsonl") + token_rows(work / "synthetic.tokens.jsonl")
    with open(work / "all.tokens.jsonl", "w") as fh:
        for r in all_rows:
            fh.write(json.dumps({"id": r["id"], "input_ids": r["input_ids"]}) + "\n")
    return [r["id"] for r in all_rows], [r["input_ids"] for r in all_rows]


@pytest.fixture(scope="module")
def references(model, rows, work) -> dict:
    import numpy as np

    out = {}
    for dtype in ("float32", "bfloat16"):
        run("score_reference.py", "--model", model, "--tokens", work / "all.tokens.jsonl", "--out",
            work / f"ref_{dtype}", "--device", "cpu", "--dtype", dtype, "--no-peak")
        out[dtype] = np.load(work / f"ref_{dtype}" / "reference.npy")
    return out


@pytest.fixture(scope="module")
def engine(model, work, request):
    eng = Engine(model, work / "engine.log", "--chunked-prefill-size", str(CHUNK), "--max-running-requests", "8",
                 call_log=work / "standin_calls.log")
    try:
        request.getfixturevalue("references")  # made while the engine loads
        eng.startup_s = eng.wait_healthy()
        yield eng
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def first_pass(engine, rows) -> dict:
    """Every row once through /classify (cold cache), with the server log position before and after."""
    ids, input_ids = rows
    before = len(engine.text())
    t0 = time.monotonic()
    body = post(f"{engine.url}/classify", {"input_ids": input_ids})
    return {"logits": body["logits"], "seconds": time.monotonic() - t0, "log": engine.text()[before:]}


def margins(ref):
    import numpy as np

    top = np.sort(ref, axis=1)
    return top[:, -1] - top[:, -2]


def compare(logits, ref) -> tuple[float, list[int]]:
    import numpy as np

    got = np.asarray(logits, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    wrong = [i for i in range(len(ref)) if int(got[i].argmax()) != int(ref[i].argmax())]
    return float(np.abs(got - ref).max()), wrong


# ---------------------------------------------------------------- tests
def test_engine_starts_with_the_adapter_on_the_chosen_ops(engine, first_pass, work):
    import requests

    info = requests.get(f"{engine.url}/server_info", timeout=10).json()
    assert info["backend"] == "sglang" and info["device"].startswith("cpu"), (info["backend"], info["device"])
    assert info["dtype"] == "bfloat16" and info["radix_cache"] is True, (info["dtype"], info["radix_cache"])
    assert info["labels"] == ["contradiction", "entailment", "neutral"]
    assert info["sglang_runtime"] == f"stock-{SGLANG_VERSION}", info["sglang_runtime"]
    text = engine.text()
    assert "sglang_openjev replaces SGLang routes" in text
    # the classifier's warm-up ran before the server listened, and left the cache empty
    assert re.search(r"openjev warm-up: 3 rows \(\d+ tokens\) sent twice and the cache flushed", text), text[-3000:]
    kind = "stand-ins" if ops_env() == "standin" else "library"
    assert f"CPU ops loaded: {kind}" in text, "the runtime did not say which CPU ops it loaded"
    if ops_env() == "standin":
        calls = (work / "standin_calls.log").read_text().split()
        called = set(calls[1::2])
        assert STANDIN_PREFILL_OPS <= called, f"stand-ins not run by the engine: {STANDIN_PREFILL_OPS - called}"
    print(f"engine healthy after {engine.startup_s:.1f} s; {len(first_pass['logits'])} rows in "
          f"{first_pass['seconds']:.1f} s; ops: {ops_env()}")


def test_classify_gives_the_reference_argmax_on_every_row(first_pass, references, rows):
    # the row set is meaningful only where no reference argmax is within the tolerance of a tie
    assert margins(references["float32"]).min() > 2 * TOL_FP32, margins(references["float32"]).min()
    for dtype, tol in (("float32", TOL_FP32), ("bfloat16", TOL_BF16)):
        err, wrong = compare(first_pass["logits"], references[dtype])
        print(f"/classify vs Transformers {dtype}: max |logit diff| {err:.5f} over {len(rows[0])} rows")
        assert wrong == [], f"argmax differs from the {dtype} reference on rows {[rows[0][i] for i in wrong]}"
        assert err <= tol, f"max |logit diff| {err} > {tol} against the {dtype} reference"


def test_v1_classify_gives_the_reference_argmax_on_every_row(engine, references, rows):
    ids, input_ids = rows
    body = post(f"{engine.url}/v1/classify", {"input": input_ids, "use_activation": False})
    logits = [d["probs"] for d in sorted(body["data"], key=lambda d: d["index"])]
    labels = [d["label"] for d in sorted(body["data"], key=lambda d: d["index"])]
    for dtype, tol in (("float32", TOL_FP32), ("bfloat16", TOL_BF16)):
        err, wrong = compare(logits, references[dtype])
        print(f"/v1/classify vs Transformers {dtype}: max |logit diff| {err:.5f}")
        assert wrong == [] and err <= tol, (dtype, err, [ids[i] for i in wrong])
    names = ["contradiction", "entailment", "neutral"]
    assert labels == [names[int(r.argmax())] for r in references["float32"]]


def test_rows_spanning_prefill_chunks_stay_right(first_pass, references, rows):
    ids, input_ids = rows
    long_rows = [i for i, r in enumerate(input_ids) if len(r) > 2 * CHUNK]
    assert len(long_rows) >= 5, "the row set must have rows of several chunks"
    assert new_tokens(first_pass["log"]) and max(new_tokens(first_pass["log"])) <= CHUNK * 8
    assert CHUNK in new_tokens(first_pass["log"]), "no prefill batch was cut at the chunk size"
    import numpy as np

    got = np.asarray(first_pass["logits"])[long_rows]
    for dtype, tol in (("float32", TOL_FP32), ("bfloat16", TOL_BF16)):
        ref = references[dtype][long_rows]
        err = float(np.abs(got - ref).max())
        print(f"{len(long_rows)} rows of > {2 * CHUNK} tokens vs {dtype}: max |logit diff| {err:.5f}")
        assert (got.argmax(1) == ref.argmax(1)).all() and err <= tol


def test_the_same_rows_again_hit_the_cache_and_stay_right(engine, first_pass, references, rows):
    """Three long rows after /flush_cache (cold), then the same three again (warm: the radix cache hands
    back the GDN states and KV of their prefixes, so fewer tokens are computed). Rows of one option group
    share a prefix, so the cold pass may already reuse some of it.

    Three rows, because the engine keeps 8 GDN state slots (--max-mamba-cache-size 8): a pass over all
    rows evicts every cached state before the next pass could use it."""
    import numpy as np
    import requests

    ids, input_ids = rows
    pick = sorted(range(len(input_ids)), key=lambda i: -len(input_ids[i]))[:3]
    sent = [input_ids[i] for i in pick]
    # the first pass's last request may still be finishing in SGLang's scheduler: wait for it to go idle
    flushed = requests.post(f"{engine.url}/flush_cache?timeout=30", timeout=60)
    assert flushed.status_code == 200, flushed.text
    runs = []
    for label in ("cold", "warm"):
        before = len(engine.text())
        body = post(f"{engine.url}/classify", {"input_ids": sent})
        time.sleep(0.5)  # the scheduler's log lines of this request
        log = engine.text()[before:]
        runs.append((label, body["logits"], sum(new_tokens(log)), sum(cached_tokens(log))))
    total = sum(len(r) for r in sent)
    for label, logits, computed, cached in runs:
        print(f"{label}: {computed} of {total} tokens computed, #cached-token sum {cached}")
        for dtype, tol in (("float32", TOL_FP32), ("bfloat16", TOL_BF16)):
            ref = references[dtype][pick]
            err = float(np.abs(np.asarray(logits) - ref).max())
            print(f"  {label} vs {dtype}: max |logit diff| {err:.5f}")
            assert (np.asarray(logits).argmax(1) == ref.argmax(1)).all() and err <= tol, (label, dtype, err)
    cold, warm = runs[0][2], runs[1][2]
    assert warm < cold <= total, f"no radix-cache hit on the warm pass: {warm} (warm) vs {cold} (cold) of {total}"


def test_a_checkpoint_with_an_unexpected_tensor_is_refused_at_start(model, work):
    import strict_loading_cases

    bad = work / "bad"
    expect = strict_loading_cases.write_case(model, bad, "extra")  # the overlay: config, tokenizer, processor configs
    eng = Engine(bad, work / "bad.log")
    code = eng.wait_exit()
    text = eng.text()
    assert code != 0, f"the engine started on a bad checkpoint:\n{text[-3000:]}"
    assert "refusing the checkpoint" in text, text[-4000:]
    for fragment in expect:
        assert fragment in text, f"{fragment!r} not in the refusal:\n{text[-4000:]}"
