#!/usr/bin/env bash
# GPU session of the embedded backend and the reference scorer at the GPU's speed, and of the
# gateway over two replicas on one GPU (stage "replicas"). Receipts land in results_h200/; an NVIDIA H200
# is an SM90 development machine, not a V100.
#
#   bash benchmarks/experiments/embedded_h200_session.sh OUTDIR   # on the GPU machine, from the repository root
#
# STAGES (default "prep profile profile_torch reference http") picks what runs, in order:
#   prep           random-weight classifier of Qwen3.5-4B's text shape (FP16) and the 128-row
#                  synthetic set (premises 200-1500 tokens, option groups), as bench_embedded.sh
#   profile        benchmarks/experiments/gpu_profile.py with the kernels Transformers binds (fla if installed)
#   profile_torch  the same, short, with OPENJEV_KERNELS=torch (Transformers' PyTorch fallback)
#   reference      app/score_reference.py, exact (one unpadded row per forward), FP16, REF_WORKERS
#                  processes (default 1)
#   reference_w1   the same with one process; checks the logits are bitwise equal
#   reference_t1   the same with --threads 1 (the default runs 2 on a GPU); checks the logits are bitwise equal
#   reference_b8   the same with --batch-size 8 --verify-rows 8 (padded, row-by-row attention); checks the
#                  logits are bitwise equal
#   reference_torch  the same with --kernels torch (figure only; its logits are not the reference)
#   http           app/serve_transformers.py + app/bench_classify_v100.py through /classify
#                  (batches of 32, 4 workers, median of 3, GPU-exclusivity monitor), then
#                  benchmarks/compute_bound.py adds the fraction of the fp16 matmul peak
#   http16         the same with --max-running-requests 16
#   replicas       the gateway over two replicas on a one-GPU machine: a 128-row set of short premises (64-256 tokens) and
#                  its FP16 reference, then benchmarks/bench_replicas_gpu.py --share-gpu 0 (the gateway
#                  and two embedded replicas run by tests/openjev_testsupport/unit_runner.py, both on GPU 0; placement,
#                  exclusivity, throughput one vs two replicas, failover of 2,000 requests with a
#                  SIGKILLed replica); HAPROXY names the HAProxy executable (default: haproxy on PATH);
#                  REPLICA_BATCHING (exact: answers bitwise the reference; padded) and MAX_PROB_DIFF
#                  (0 = bitwise) set how replicas batch and what counts as a mismatch
#   http_compiled  the same with OPENJEV_COMPILE=1 (norm and MLP modules through torch.compile)
#   variants       benchmarks/experiments/embedded_gpu_variants.py: exact-loop and padded-forward variants in
#                  one process, each compared with the baseline exact pass (VARIANTS: its --variants list;
#                  VARIANT_ARGS: more of its flags, e.g. "--grouping dp --profile")
#   divergence     benchmarks/experiments/embedded_gpu_divergence.py: where padded forwards leave the exact
#                  FP16 reference (module by module), cuBLAS reduced-precision reductions on/off, host syncs and a
#                  cProfile of a warm exact forward, and every candidate against an FP32 forward
#                  (DIVERGENCE_PARTS: its --parts list)
# Results are packed after every stage into OUTDIR/results.tgz (a time-out keeps what ran).
# Environment: PYTHON (default python3), WORK (default /tmp/openjev-h200), SHAPE (qwen3.5-4b),
# DEVICE (cuda), ROWS (128), SERVER_ARGS (serve_transformers.py flags; default --max-running-requests 8), HTTP_LABEL,
# STAGE_TIMEOUT (seconds per stage, default 400). Rehearse on a CPU with SHAPE=tiny DEVICE=cpu.
set -uo pipefail
PROFILE_ARGS=${PROFILE_ARGS:-} SERVER_ARGS=${SERVER_ARGS:---max-running-requests 8} HTTP_LABEL=${HTTP_LABEL:-} REF_WORKERS=${REF_WORKERS:-1}
OPENJEV_COMPILE=${OPENJEV_COMPILE:-}
OUTDIR=${1:?usage: embedded_h200_session.sh OUTDIR}
PY=${PYTHON:-python3}
# the bundle's library (openjev, sglang_openjev) is not pip-installed on the GPU machine; tests/ holds the
# test support package (openjev_testsupport) that benchmarks/bench_replicas_gpu.py imports
export PYTHONPATH="$(pwd -P):$(pwd -P)/tests${PYTHONPATH:+:$PYTHONPATH}"
W=${WORK:-/tmp/openjev-h200}
R="$W/results-embedded"
SHAPE=${SHAPE:-qwen3.5-4b}
DEVICE=${DEVICE:-cuda}
ROWS=${ROWS:-128}
TO=${STAGE_TIMEOUT:-400}
DTYPE=$([ "$DEVICE" = cpu ] && echo float32 || echo float16)
SET="$W/set-$ROWS-200-1500"
MODEL="$W/model-$SHAPE"
REF="$W/ref-embedded-$SHAPE-$DEVICE"
mkdir -p "$R" "$OUTDIR"
PACK="$OUTDIR/results.tgz"
# shellcheck source=benchmarks/gpu_session_lib.sh
. "$(pwd -P)/benchmarks/gpu_session_lib.sh"
LABEL=${MACHINE_LABEL:-$(machine_label)}

stage_prep() {
  nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv >"$R/nvidia_smi.csv" 2>&1
  "$PY" -c 'import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, "triton", triton.__version__)' \
    >"$R/versions.txt" 2>&1
  "$PY" -c 'import fla; print("fla", fla.__version__)' >>"$R/versions.txt" 2>&1
  [ -d "$W/ckpt-$SHAPE" ] || "$PY" app/make_tiny_model.py "$W/ckpt-$SHAPE" --shape "$SHAPE" --dtype "$DTYPE" \
    --device "$DEVICE" --processor-out "$W/proc-$SHAPE" || return 1
  [ -d "$MODEL" ] || "$PY" app/prepare_v100_model.py "$W/ckpt-$SHAPE" "$MODEL" --processor-dir "$W/proc-$SHAPE" \
    --allow-unpinned || return 1
  [ -e "$SET.jsonl" ] || "$PY" app/make_synthetic_inputs.py "$SET" --rows "$ROWS" --premise-tokens 200:1500 --vocab 512
}

stage_profile() {
  "$PY" benchmarks/experiments/gpu_profile.py --model "$MODEL" --tokens "$SET.tokens.jsonl" --out "$R/profile" --device "$DEVICE" \
    --cudnn-ab ${PROFILE_ARGS:-}
}

stage_profile_torch() {
  OPENJEV_KERNELS=torch "$PY" benchmarks/experiments/gpu_profile.py --model "$MODEL" --tokens "$SET.tokens.jsonl" \
    --out "$R/profile" --device "$DEVICE" --tag _torch --exact-rows 6 --budgets 32768 --padded-repeats 1 \
    ${PROFILE_ARGS:-}
}

stage_reference() {
  rm -rf "$REF"
  "$PY" app/score_reference.py --model "$MODEL" --tokens "$SET.tokens.jsonl" --inputs "$SET.jsonl" --out "$REF" \
    --device "$DEVICE" --workers "${REF_WORKERS:-1}" || return 1
  mkdir -p "$R/reference" && cp "$REF/reference.json" "$REF/reference.npy" "$REF/tokens.sha256" "$R/reference/"
}

reference_again() {  # TAG "WHAT" FLAGS...: the reference again with FLAGS; bitwise equal to stage reference's?
  local tag=$1 what=$2
  shift 2
  rm -rf "$REF-$tag"
  "$PY" app/score_reference.py --model "$MODEL" --tokens "$SET.tokens.jsonl" --inputs "$SET.jsonl" --out "$REF-$tag" \
    --device "$DEVICE" "$@" || return 1
  mkdir -p "$R/reference_$tag" && cp "$REF-$tag/reference.json" "$R/reference_$tag/"
  cmp "$REF/reference.npy" "$REF-$tag/reference.npy" && echo "reference.npy bitwise equal for $what" \
    | tee "$R/reference_$tag/bitwise.txt"
}

stage_reference_w1() { reference_again w1 "--workers ${REF_WORKERS:-1} and 1" --workers 1; }

stage_reference_t1() { reference_again t1 "--threads auto and 1" --threads 1; }

stage_reference_b8() { reference_again b8 "--batch-size 1 and 8" --batch-size 8 --verify-rows 8; }

stage_reference_torch() {
  rm -rf "$REF-torch"
  "$PY" app/score_reference.py --model "$MODEL" --tokens "$SET.tokens.jsonl" --inputs "$SET.jsonl" \
    --out "$REF-torch" --device "$DEVICE" --kernels torch || return 1
  mkdir -p "$R/reference_torch" && cp "$REF-torch/reference.json" "$R/reference_torch/"
}

stage_http() {
  local name=${HTTP_LABEL:-embedded_${SHAPE}_${DEVICE}} port server rc
  port=$(free_port)
  # shellcheck disable=SC2086
  "$PY" app/serve_transformers.py "$MODEL" "$port" --device "$DEVICE" ${SERVER_ARGS:-} >"$R/$name.server.log" 2>&1 &
  server=$!
  for _ in $(seq 1 600); do
    kill -0 "$server" 2>/dev/null || { tail -n 20 "$R/$name.server.log"; return 1; }
    "$PY" -c "import sys,requests; sys.exit(requests.get('http://127.0.0.1:$port/health',timeout=2).status_code!=200)" \
      2>/dev/null && break
    sleep 1
  done
  local excl=()
  [ "$DEVICE" = cpu ] || excl=(--exclusive-gpu 0 --server-pid "$server")
  "$PY" app/bench_classify_v100.py --url "http://127.0.0.1:$port" --inputs "$SET.jsonl" --tokens "$SET.tokens.jsonl" \
    --reference "$REF" --out "$R/$name.json" --batch-size 32 --workers 4 --repetitions 3 --label "$name" \
    --machine-label "$LABEL" "${excl[@]}"
  rc=$?
  "$PY" -c "import requests; print(requests.get('http://127.0.0.1:$port/metrics', timeout=10).text)" \
    >"$R/$name.metrics.txt" 2>&1  # step seconds and rows, padded tokens: where the server's time went
  kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
  "$PY" benchmarks/compute_bound.py "$R/$name.json" --model "$MODEL" --device "$DEVICE" || return 1
  return $rc
}

stage_variants() {
  "$PY" benchmarks/experiments/embedded_gpu_variants.py --model "$MODEL" --tokens "$SET.tokens.jsonl" \
    --out "$R/variants" --device "$DEVICE" ${VARIANTS:+--variants "$VARIANTS"} ${VARIANT_ARGS:-}
}

stage_divergence() {
  "$PY" benchmarks/experiments/embedded_gpu_divergence.py --model "$MODEL" --tokens "$SET.tokens.jsonl" \
    --out "$R/divergence" --device "$DEVICE" --machine-label "$LABEL" ${DIVERGENCE_PARTS:+--parts "$DIVERGENCE_PARTS"}
}

stage_http_compiled() {  # the same server with OPENJEV_COMPILE=1 (norm/MLP modules compiled)
  OPENJEV_COMPILE=1 HTTP_LABEL=embedded_${SHAPE}_${DEVICE}_compiled stage_http
}

stage_http16() {  # 16 rows per forward instead of SERVER_ARGS'
  SERVER_ARGS="--max-running-requests 16" HTTP_LABEL=embedded_${SHAPE}_${DEVICE}_mrr16 stage_http
}

stage_replicas() {  # two replicas sharing GPU 0 behind the gateway
  local set="$W/set-128-64-256" ref="$W/ref-short-$SHAPE-$DEVICE"
  local out="$R/two_gpu/replicas_shared_gpu0_${REPLICA_BATCHING:-exact}.json"
  [ -e "$set.jsonl" ] || "$PY" app/make_synthetic_inputs.py "$set" --rows 128 --premise-tokens 64:256 --vocab 512 --seed 15 || return 1
  [ -d "$ref" ] || "$PY" app/score_reference.py --model "$MODEL" --tokens "$set.tokens.jsonl" --inputs "$set.jsonl" \
    --out "$ref" --device "$DEVICE" || return 1
  mkdir -p "$R/two_gpu"
  "$PY" benchmarks/bench_replicas_gpu.py --model "$MODEL" --inputs "$set.jsonl" --tokens "$set.tokens.jsonl" \
    --reference "$ref" --share-gpu 0 --device "$DEVICE" --out "$out" --work "$W/replicas-work" \
    --env MAX_RUNNING_REQUESTS=32 --machine-label "$LABEL" ${HAPROXY:+--haproxy "$HAPROXY"} \
    --replica-args "--batching ${REPLICA_BATCHING:-exact}" --max-prob-diff "${MAX_PROB_DIFF:-0}"
  local rc=$?
  cp "$W"/replicas-work/journal/*.log "$R/two_gpu/" 2>/dev/null
  return $rc
}

export PY W R SHAPE DEVICE ROWS LABEL DTYPE SET MODEL REF PROFILE_ARGS SERVER_ARGS HTTP_LABEL REF_WORKERS OPENJEV_COMPILE VARIANTS DIVERGENCE_PARTS
export VARIANTS=${VARIANTS:-} VARIANT_ARGS=${VARIANT_ARGS:-} DIVERGENCE_PARTS=${DIVERGENCE_PARTS:-}
export HAPROXY=${HAPROXY:-}
export PACK
export -f log code pack free_port wait_healthy reference_again stage_replicas stage_prep stage_profile stage_profile_torch stage_reference stage_reference_w1 stage_reference_t1 stage_reference_b8 stage_reference_torch stage_variants stage_divergence stage_http stage_http_compiled stage_http16
# shellcheck disable=SC2086 # STAGES is a word list
run_stages ${STAGES:-prep profile profile_torch reference http}
