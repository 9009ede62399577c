"""Receipts of the engine's kernels and experiments: pinned fla configurations, the embedded variants on a GPU,
sgl-kernel's CPU ops build and SGLang's CPU engine run."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, WithJsonSchema

from openjev.receipts.base import (Int, NonNegFloat, NonNegInt, Obj, Part, PosInt, Receipt, Sha256, Timestamp,
                                   require_keys)

# ---------------------------------------------------------------- openjev/engine/kernels.py pin_autotuners


class FlaKernelConfig(Part):
    kwargs: Obj
    num_warps: PosInt
    num_stages: NonNegInt
    num_ctas: PosInt = None
    maxnreg: Int | None = None


class FlaConfigs(Receipt):
    """Written once per machine (default ~/.cache/openjev/fla-configs/GPU-flaVER-tritonVER-hH-kK-vV-DTYPE.json,
    or $OPENJEV_FLA_CONFIGS) by the first process that loads fla: the configuration Triton's autotuner chose
    for each kernel at one shape. Every later process (reference scorer, servers) runs each kernel with that
    configuration at every shape, so forwards of any shape sum alike. Copy the file to another machine of the
    same GPU model to make its processes run the same configurations."""

    schema_file = "fla_configs.schema.json"
    schema_title = ("openjev-fla-configs (openjev/engine/kernels.py pin_autotuners: one Triton configuration per "
                    "flash-linear-attention kernel)")

    kind: Literal["openjev-fla-configs"]
    made_at: Timestamp
    made_by: str
    device: str = Field(None, description="the GPU the configurations were timed on")
    fla: str | None = None
    triton: str = None
    torch: str = None
    tuned_on: Obj = Field(None, description="the shape the kernels were tuned at")
    tune_seconds: NonNegFloat = None
    kernels: dict[str, FlaKernelConfig] = Field(
        description="module.qualified_name of the kernel -> its Triton configuration")


# ---------------------------------------------------------------- benchmarks/experiments/embedded_gpu_variants.py
VARIANT_FIGURES = (("error",), ("pass_s", "rows_per_s", "bitwise_equal", "max_abs_dp_e", "argmax_changes"),
                   ("compiled_modules",))


def _has_figures(v: dict) -> dict:
    if not any(all(k in v for k in keys) for keys in VARIANT_FIGURES):
        raise ValueError("a variant holds error, compiled_modules, or pass_s, rows_per_s, bitwise_equal, "
                         "max_abs_dp_e and argmax_changes")
    return v


VariantFigures = Annotated[Obj, AfterValidator(_has_figures), WithJsonSchema(
    {"type": "object", "anyOf": [{"required": list(keys)} for keys in VARIANT_FIGURES]})]


class EmbeddedGpuVariants(Receipt):
    """Variants of the exact reference loop and of padded forwards in one process, each compared with the
    baseline exact pass of the same process. Written after every variant, so a cut-off run keeps what
    finished."""

    schema_file = "embedded_gpu_variants.schema.json"
    schema_title = ("openjev-embedded-gpu-variants receipt (benchmarks/experiments/embedded_gpu_variants.py, "
                    "OUT/variants.json)")

    kind: Literal["openjev-embedded-gpu-variants", "openjev-variants14"] = Field(
        description="the first is written now; the second is the kind of the receipts recorded before the script "
                    "was renamed")
    made_by: str
    made_at: Timestamp
    machine: str = Field(min_length=1, description="what the machine is (an H200 figure is never a V100 figure)")
    device: str
    grouping: Literal["budget", "dp"] = Field(
        None, description="how padded forwards were formed: rows x longest <= budget, or the server's "
                          "least-padding cuts over the whole set")
    peak_tflops: NonNegFloat = Field(
        description="matmul peak measured in the same run (fp16 on a GPU, float32 on a CPU)")
    kernel_path: require_keys("gdn")
    tokens: PosInt
    rows: PosInt
    model_flops_per_pass: NonNegFloat
    environment: Obj
    variants: dict[str, VariantFigures] = Field(
        description="name -> figures; exact variants: pass_s, rows_per_s and the agreement with the baseline; "
                    "padded: per rows-per-forward entry (rowsN) the same plus fraction_of_peak; a variant that "
                    "failed holds error")


# ---------------------------------------------------------------- benchmarks/sgl_cpu_ops_build.py
class SglCpuOpsBuild(Receipt):
    """How sgl-kernel's CPU ops were built outside the repository: sources' sha256, flags, torch, compiler,
    seconds."""

    schema_file = "sgl_cpu_ops_build.schema.json"
    schema_title = "openjev-sgl-cpu-ops-build (benchmarks/sgl_cpu_ops_build.py build.json)"

    kind: Literal["openjev-sgl-cpu-ops-build"]
    sources_sha256: Sha256
    cflags: list[str]
    ldflags: list[str]
    torch: Any
    seconds: NonNegFloat
    jobs: PosInt
    n_sources: PosInt
    source_files: list[str]


# ---------------------------------------------------------------- benchmarks/sglang_cpu_engine.py
class EngineBench(Part):
    set_: Any = Field(alias="set")
    mode: Literal["cold", "warm"]
    exit_status: Any
    receipt: Any
    max_abs_logit_diff: NonNegFloat = None
    argmax_changes_total: NonNegInt = None
    argmax_equal_every_pass: dict[str, bool] = None


class EngineCase(Part):
    dtype: Literal["bfloat16", "float32", "float16"]
    case: Any
    server_flags: Any
    server_command: Any
    startup_seconds: NonNegFloat = None
    error: str = None
    benches: list[EngineBench] = None


class EngineOps(Part):
    library_sha256: Sha256
    source_revision: Any
    cflags: Any
    torch: Any


class SglangCpuEngine(Receipt):
    """The adapter inside SGLang's CPU engine with sgl-kernel's real CPU ops, against the Transformers
    reference. Not a V100 figure: it lives under benchmarks/results_<machine>/."""

    schema_file = "sglang_cpu_engine.schema.json"
    schema_title = "openjev-sglang-cpu-engine summary (benchmarks/sglang_cpu_engine.py)"

    kind: Literal["openjev-sglang-cpu-engine"]
    made_at: str
    machine: require_keys("processor", "nproc", "platform")
    command: str
    ops: EngineOps
    model: Obj
    cases: list[EngineCase]
    per_dtype: Obj
    all_argmax_equal: bool
