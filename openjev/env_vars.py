"""Every OPENJEV_* environment variable the bundle reads, in one typed table.

V100.md's section "Environment variables" is generated from it (`python -m openjev.env_vars`
prints the table; tests/test_env_vars.py fails when the code reads a variable this table lacks,
when the table names one nothing reads, or when V100.md's copy differs)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

# who sets it: operator (a person or a systemd unit), bundle (one step sets it for another), test (CI
# and the test suite)
SETTERS = ("operator", "bundle", "test")


@dataclass(frozen=True)
class EnvVar:
    name: str
    set_by: str
    default: str
    read_by: str
    meaning: str


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("OPENJEV_V100_ROOT", "operator", "~/storage/sglang-openjev-v100", "every step",
           "the root of the private CUDA toolkit, the runtime venv and its receipts"),
    EnvVar("OPENJEV_PYTHON", "operator", "$ROOT/venv/bin/python, else python3", "install_v100_runtime.sh, serve_sglang_v100.sh",
           "the interpreter of the runtime venv"),
    EnvVar("OPENJEV_CC", "operator", "gcc-10 on PATH", "install_v100_runtime.sh", "C compiler (with OPENJEV_CXX)"),
    EnvVar("OPENJEV_CXX", "operator", "g++-10 on PATH", "install_v100_runtime.sh", "C++ and CUDA host compiler"),
    EnvVar("OPENJEV_HF_SOURCE", "operator", "<bundle>/HF_SOURCE.json", "install_v100_runtime.sh", "the pinned sources"),
    EnvVar("OPENJEV_PATCH_DIR", "operator", "<bundle>/patches", "install_v100_runtime.sh", "the project's patches"),
    EnvVar("OPENJEV_GPU_ARCH", "operator", "nvidia-smi's compute_cap", "serve_sglang_v100.sh",
           "sm70 picks the TileLang V100 profile; another value the stock profile"),
    EnvVar("OPENJEV_SGLANG_MODULE", "operator", "sglang_openjev.launch_server", "serve_sglang_v100.sh",
           "the `python -m` entry point of the server"),
    EnvVar("OPENJEV_SGLANG_RUNTIME", "operator", "detected from the installed sglang", "serve_sglang_v100.sh",
           "the flag dialect: fork, fork-VERSION or stock-VERSION"),
    EnvVar("OPENJEV_BACKEND", "operator", "sglang", "serve_sglang_v100.sh, the units",
           "transformers runs the embedded backend instead of SGLang"),
    EnvVar("OPENJEV_ARCH_PROFILE", "bundle", "set by serve_sglang_v100.sh", "the adapter's /server_info",
           "the profile launched (sm70-tilelang or stock)"),
    EnvVar("OPENJEV_LAUNCH_ADAPTATIONS", "bundle", "set by the launcher", "the adapter's /server_info",
           "JSON list of what the launcher adapted to the SGLang version"),
    EnvVar("OPENJEV_BUNDLE_REVISION", "operator", "the bundle's git commit when it is a checkout", "the adapter's /server_info",
           "the bundle revision to report where the bundle is no git checkout"),
    EnvVar("OPENJEV_MAX_BATCH_SIZE", "operator", "512", "the adapter", "rows a /classify request may carry"),
    EnvVar("OPENJEV_MAX_BODY_BYTES", "operator", "33554432", "serve_transformers.py",
           "a larger request body gets 413 before it is parsed (--max-body-bytes)"),
    EnvVar("OPENJEV_MAX_TEXT_CHARS", "operator", "1048576", "serve_transformers.py",
           "characters of all texts of one request (--max-text-chars)"),
    EnvVar("OPENJEV_STEP_TOKEN_BUDGET", "operator", "16384", "serve_transformers.py",
           "tokens of one scheduling step (--step-token-budget)"),
    EnvVar("OPENJEV_BATCH_WAIT_MS", "operator", "0", "serve_transformers.py",
           "milliseconds an idle server waits for requests sent together (--batch-wait-ms)"),
    EnvVar("OPENJEV_PREFIX_CACHE_MB", "operator", "4096", "serve_transformers.py",
           "device memory for cached prefix states with --prefix-reuse (--prefix-cache-mb; 0 within a step only)"),
    EnvVar("OPENJEV_MAX_QUEUED_REQUESTS", "operator", "512", "serve_transformers.py",
           "requests waiting or running at most; one more gets 429 (--max-queued-requests; 0 no limit)"),
    EnvVar("OPENJEV_DRAIN_SECONDS", "operator", "30", "serve_transformers.py",
           "on SIGTERM, how long admitted requests may finish before they get 503 (--drain-seconds)"),
    EnvVar("OPENJEV_TORCH_THREADS", "operator", "0 (all but one core)", "serve_transformers.py", "torch threads (--torch-threads)"),
    EnvVar("OPENJEV_WATCHDOG_SECONDS", "operator", "120", "serve_transformers.py",
           "a forward running longer marks the server unhealthy (--watchdog-seconds; 0 off)"),
    EnvVar("OPENJEV_KERNELS", "operator", "auto", "the embedded backend, score_reference.py",
           "torch forces Transformers' PyTorch GDN fallback instead of flash-linear-attention"),
    EnvVar("OPENJEV_FUSED", "operator", "auto", "the embedded backend", "off keeps every module as Transformers wrote it; a comma list of pieces (rms_norm, gated_norm, swiglu, conv_silu, grouped_heads) checks and uses those alone"),
    EnvVar("OPENJEV_PACKED_MLP", "operator", "off", "the embedded backend",
           "on: a padded forward runs each MLP on its real tokens only, where a check at load finds that "
           "bitwise the padded rows (bitwise through the server on an H100; a warm prefix pass 6 % faster in process)"),
    EnvVar("OPENJEV_PACKED_LAYOUT", "operator", "auto", "the embedded backend",
           "with --prefix-reuse, forwards from prefix states run the rows' tokens one after another (no padding), "
           "each GDN conv and rule and each attention call row by row, where checks at load find fla's "
           "variable-length rule and the segments conv bitwise each row's own calls; auto: where fla's rule runs "
           "(a GPU; bitwise through the server on an H100, a flushed pass 18 % faster), on: also with Transformers' "
           "PyTorch rule (slower on a CPU), off: padded forwards"),
    EnvVar("OPENJEV_COMPILE", "operator", "unset", "the embedded backend", "1: torch.compile of the norm and MLP modules instead"),
    EnvVar("OPENJEV_CUDNN", "operator", "unset", "the embedded backend", "1 keeps cuDNN on for GPU forwards"),
    EnvVar("OPENJEV_PADDED_ATTENTION", "operator", "rowwise", "the embedded backend",
           "shared lets rows of a padded forward share attention calls where that keeps each row's own "
           "call's bits (checked on the GPU at load; bitwise on an H100, not faster); masked keeps Transformers' "
           "masked call"),
    EnvVar("OPENJEV_PREFIX_ATTENTION", "operator", "whole-row", "the embedded backend",
           "varlen: with --prefix-reuse on a GPU, every row of a forward from prefix states in one FlashAttention "
           "varlen call a layer (faster; on an H100 a largest entailment-probability difference of 0.00295, over the 2e-3 goal); "
           "varlen-tails only in forwards that keep no state; varlen-exact only the rows whose own calls would not split "
           "their keys, where a check at load finds that bitwise (padded forwards: bitwise through the server on an "
           "H100, not faster; the packed layout: rows whose calls hold no zeros past their tokens, their queries only, "
           "not yet run on a GPU); whole-row keeps each row's own call"),
    EnvVar("OPENJEV_ATTENTION_STREAMS", "operator", "4", "the embedded backend",
           "CUDA streams a padded forward's own attention calls (one a row and layer) are spread over, so that "
           "calls too small to fill the GPU run side by side (the same kernels on the same inputs: the same bits, "
           "tested on an H100; warm prefix-reuse steps about 10 % faster there); 1 makes them in turn"),
    EnvVar("OPENJEV_FLA_CONFIGS", "operator", "~/.cache/openjev/fla-configs/ (one file per GPU model)", "the embedded backend",
           "the file of fla's pinned Triton configurations; off turns pinning off"),
    EnvVar("OPENJEV_WARM_TOKENS", "operator", "16384", "the embedded backend", "padded tokens the start-up warm-up covers"),
    EnvVar("OPENJEV_MODEL", "operator", "written by install_units.sh", "the replica units", "the model directory a replica serves"),
    EnvVar("OPENJEV_REPLICA_PORT", "operator", "written by install_units.sh", "the replica units", "the port of a replica"),
    EnvVar("OPENJEV_REPLICA_ARGS", "operator", "empty", "the replica units", "server flags for every replica"),
    EnvVar("OPENJEV_GATEWAY_ADMIN", "bundle", "set by the gateway unit", "haproxy's configuration", "the gateway's admin socket"),
    EnvVar("OPENJEV_PREFLIGHT_JSON", "bundle", "set by install_v100_runtime.sh", "v100_preflight.py",
           "the preflight result carried into the install receipt"),
    EnvVar("OPENJEV_TUNE_SERVER_CMD", "operator", "app/serve_sglang_v100.sh", "tune_sglang_v100.py",
           "shell words that start a server for a profile"),
    EnvVar("OPENJEV_TUNE_RUN", "bundle", "set by tune_sglang_v100.py", "tune_sglang_v100.py",
           "the run id every process of a tuning run carries"),
    EnvVar("OPENJEV_TUNE_OUT", "bundle", "set by tune_sglang_v100.py", "tune_sglang_v100.py",
           "the output folder of the tuning run a process belongs to"),
    EnvVar("OPENJEV_DEMO_DIR", "operator", "build/demo", "run_demo.sh (make demo)", "where the demo keeps its checkpoint and runs"),
    EnvVar("OPENJEV_SGLANG_VERSIONS", "test", "0.5.13 0.5.14 0.5.23", "Makefile", "the real-SGLang venvs make test builds"),
    EnvVar("OPENJEV_SGLANG_REQUIRED", "test", "unset", ".ci/sglang_venv.sh", "1 (CI): a real-SGLang venv that cannot be made fails"),
    EnvVar("OPENJEV_REQUIRE_SGLANG", "test", "unset", "the SGLang tests", "1: sglang not importable is a failure, not a skip"),
    EnvVar("OPENJEV_NO_PROVISION", "test", "0", ".ci/provision.sh", "1 skips installing haproxy and systemd"),
    EnvVar("OPENJEV_DEPLOY_REQUESTS", "test", "2000", "tests/test_deployment_gateway.py",
           "requests of the failover test"),
    EnvVar("OPENJEV_MULTIHOST_REQUESTS", "test", "2000", "tests/test_deployment_multihost_cluster.py",
           "requests of the several-hosts failover test"),
    EnvVar("OPENJEV_STANDIN_CALL_LOG", "test", "unset", "the sgl_kernel stand-ins", "a file each process appends `<pid> <op>` to"),
    EnvVar("OPENJEV_SGL_CPU_OPS", "test", "standin", "SGLang's CPU engine glue",
           "the CPU ops: the stand-ins or a built sgl-kernel CPU library"),
    EnvVar("OPENJEV_SGL_CPU_AMX", "test", "0", "SGLang's CPU engine glue", "1 leaves SGLang's Intel-AMX paths on"),
    EnvVar("OPENJEV_SGL_CPU_RECORD", "test", "unset", "SGLang's CPU engine glue", "a folder where CPU op calls are recorded"),
    EnvVar("OPENJEV_SGL_CPU_RECORD_PER_OP", "test", "2", "SGLang's CPU engine glue", "recorded calls per op and dtype"),
)


def markdown_table() -> str:
    rows = ["| variable | set by | default | read by | meaning |", "|---|---|---|---|---|"]
    for v in ENV_VARS:
        rows.append(f"| `{v.name}` | {v.set_by} | {v.default} | {v.read_by} | {v.meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
