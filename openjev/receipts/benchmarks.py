"""Receipts of the deployment and client benchmarks under benchmarks/ (gateway, multihost, replicas on GPUs,
serving front, harness overhead). None is a V100 figure unless its machine says so."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from openjev.receipts.base import (DateTimePrefix, Int, NonEmptyStr, NonNegFloat, NonNegInt, Obj, Part, PosFloat,
                                   PosInt, Receipt, Timestamp, const, require_keys)

NonEmptyObj = Annotated[Obj, Field(min_length=1)]
LoadAverage = Annotated[list[float], Field(min_length=3, max_length=3)]


class Machine(Part):
    label: NonEmptyStr
    platform: Any
    cpu_model: Any
    cpu_count: Any


# ---------------------------------------------------------------- benchmarks/bench_gateway.py
class GatewayBench(Receipt):
    """Added latency of the HAProxy gateway and throughput with one and two replicas of the embedded backend,
    on one machine. Not a V100 figure: these results live under benchmarks/results_<machine>/, never in
    results_v100/."""

    schema_file = "gateway_bench.schema.json"
    schema_title = "openjev-gateway-bench result (benchmarks/bench_gateway.py)"

    kind: Literal["openjev-gateway-bench"]
    created: DateTimePrefix
    machine: Machine
    haproxy_version: NonEmptyStr
    deployment: str
    parameters: Obj
    latency: NonEmptyObj
    goal: Obj
    throughput: NonEmptyObj


# ---------------------------------------------------------------- benchmarks/bench_multihost.py
class AddedLatency(Part):
    p50_ms: Any
    p99_ms: Any


class HopLatency(Part):
    direct: Any
    local_gw: Any
    tls_hop: Any
    added_tls_hop_vs_direct: AddedLatency


class ConnectionLatency(Part):
    """request -> figures, with keep-alive connections and with a fresh connection per request"""

    __pydantic_extra__: dict[str, dict[str, HopLatency]]
    keepalive: dict[str, HopLatency]
    fresh: dict[str, HopLatency]


class MultihostLatency(Part):
    __pydantic_extra__: dict[str, ConnectionLatency]
    as_rendered: ConnectionLatency


AffinityRun = require_keys("requests", "failures", "mismatches", "served_by", "share_on_group_main_replica_mean",
                           when_object=True)


class Affinity(Part):
    __pydantic_extra__: dict[str, AffinityRun]
    leastconn: AffinityRun


class MultihostBench(Receipt):
    """Added latency of one mutual-TLS hop (front gateway -> peer listener) side by side with a direct call and
    the peer's local gateway, and prefix-affinity routing, with hosts played on loopback addresses of one
    machine. Not a V100 figure: these results live under benchmarks/results_<machine>/, never in results_v100/."""

    schema_file = "multihost_bench.schema.json"
    schema_title = "openjev-multihost-bench result (benchmarks/bench_multihost.py)"

    kind: Literal["openjev-multihost-bench"]
    created: DateTimePrefix
    machine: Machine
    haproxy_version: NonEmptyStr
    deployment: str
    parameters: Obj
    latency: MultihostLatency
    affinity: Affinity


# ---------------------------------------------------------------- benchmarks/bench_replicas_gpu.py
class Load(Part):
    requests: PosInt
    rows: Any
    clients: Any
    seconds: Any
    requests_per_s: Any
    failures: NonNegInt
    mismatches: NonNegInt
    bitwise_equal_answers: NonNegInt
    max_softmax_diff: Any
    served_by: Any


class Throughput(Part):
    one_replica: Load
    two_replicas: Load
    ratio_two_vs_one: PosFloat


class Failover(Load):
    killed: Any
    killed_pid: Any
    new_pid: Any
    restarts: Any
    seconds_to_down: Any
    seconds_to_rejoin: Any
    after_rejoin: Load
    verdict: Literal["pass", "fail"]


class ReplicaPhases(Part):
    start: require_keys("seconds_to_both_up") = None
    placement: require_keys("seen", "expected", "each_on_its_gpu_only", "pids") = None
    exclusivity: require_keys("per_replica", "expected_valid") = None
    throughput: Throughput = None
    failover: Failover = None


class ReplicasMachine(Part):
    label: NonEmptyStr
    platform: Any


class ReplicasGpuBench(Receipt):
    """The deployment's gateway over two embedded replicas on GPUs: NVML placement, per-replica GPU
    exclusivity, throughput one vs two replicas, failover of a SIGKILLed replica under load. Phases are
    written as they end, so a partial receipt has fewer of them and an 'error'. Not a V100 figure unless the
    machine says so."""

    schema_file = "replicas_gpu_bench.schema.json"
    schema_title = "openjev-replicas-gpu-bench result (benchmarks/bench_replicas_gpu.py)"

    kind: Literal["openjev-replicas-gpu-bench"]
    created: DateTimePrefix
    finished: str = None
    error: str = None
    machine: ReplicasMachine
    layout: NonEmptyStr
    haproxy_version: str = None
    parameters: Obj
    bundle_git: Any
    phases: ReplicaPhases


# ---------------------------------------------------------------- benchmarks/bench_serving_front.py
class FrontLoad(Part):
    clients: PosInt
    requests_per_client: Any
    requests: PosInt
    errors: NonNegInt
    logit_mismatches: NonNegInt
    wall_s: Any
    requests_per_s: Any
    latency_s: require_keys("p50", "p90", "p99", "max")
    p99_over_p50: Any


class HealthUnderBigText(Part):
    body_bytes: PosInt
    big_request: Any
    health_polls: NonNegInt
    health_statuses: Any
    health_latency_s: Any
    rss_mb_before: Any
    rss_mb_after: Any


class MixedLoad(Part):
    """Three big requests fill every scheduling step; a 1-row request sent once they are served: its wait in
    steps and seconds, and the big requests' tokens per second."""

    tries: PosInt
    big_requests: Any
    big_rows: Any
    big_row_tokens: Any
    errors: list[str]
    small_steps: require_keys("p50", "p99", "max")
    small_seconds: require_keys("p50", "p99", "max")
    big_tokens_per_s: require_keys("median", "min", "max")


class FrontMachine(Part):
    label: NonEmptyStr
    platform: Any
    cpu_model: Any
    cpu_count: Any
    host: Any
    load_average_before: LoadAverage
    load_average_after: LoadAverage


FRONT_PHASES = ("load_default", "health_under_big_text", "mixed_load")


class ServingFrontBench(Receipt):
    """Load, /health-under-a-big-body and mixed-load figures of the embedded backend on one machine (the phases
    that ran are present). Not a V100 figure: these results live under benchmarks/results_<machine>/, never in
    results_v100/."""

    schema_file = "serving_front_bench.schema.json"
    schema_title = "openjev-serving-front-bench result (benchmarks/bench_serving_front.py)"
    schema_keywords = {"anyOf": [{"required": [phase]} for phase in FRONT_PHASES]}

    kind: Literal["openjev-serving-front-bench"]
    schema_version: const(1)
    made_by: str
    started_at: NonEmptyStr
    finished_at: NonEmptyStr
    command: str
    machine: FrontMachine
    server_info: require_keys("backend", "step_token_budget", "threads")
    acceptance: dict[str, bool]
    load_default: FrontLoad = None
    load_torch_threads: FrontLoad = None
    health_under_big_text: HealthUnderBigText = None
    mixed_load: MixedLoad = None

    @model_validator(mode="after")
    def _some_phase_ran(self):
        if not self.model_fields_set & set(FRONT_PHASES):
            raise ValueError(f"no phase: the receipt holds at least one of {', '.join(FRONT_PHASES)}")
        return self


# ---------------------------------------------------------------- benchmarks/bench_harness_overhead.py
class TrivialPass(Part):
    workers: PosInt
    requests: PosInt
    wall_s: PosFloat
    requests_per_s: PosFloat
    client_cpu_s: NonNegFloat
    client_cpu_per_request_ms: Any
    client_overhead_fraction: Any
    latency_s: Any


class NormalRun(Part):
    bench_exit_code: Any
    valid: Any
    rows: Any
    batch_size: Any
    workers: Any
    repetitions: Any
    median_wall_s: Any
    client_cpu_s: Any
    client_overhead_fraction: NonNegFloat | None
    command: Any


class OverheadTarget(Part):
    client_overhead_fraction_max: float
    met: bool | None


class OverheadMachine(Part):
    label: NonEmptyStr
    platform: Any
    cpu_model: Any
    cpu_count: Int | None
    host: Any
    load_average_before: Any
    load_average_after: Any


class HarnessOverhead(Receipt):
    """What the bench client itself costs on one machine. Not a V100 figure: these results live under
    benchmarks/results_<machine>/, never in results_v100/."""

    schema_file = "harness_overhead.schema.json"
    schema_title = "openjev-harness-overhead result (benchmarks/bench_harness_overhead.py)"

    kind: Literal["openjev-harness-overhead"]
    schema_version: const(1)
    made_by: str
    started_at: Timestamp
    finished_at: Timestamp
    machine: OverheadMachine
    command: str
    server: Obj
    null_server: list[TrivialPass]
    trivial: list[TrivialPass]
    normal: NormalRun | None
    target: OverheadTarget
    definitions: Obj
    environment: require_keys("host", "platform")
