#!/usr/bin/env bash
# The H200 session behind the embedded-backend, GPU-exclusivity and tuning receipts in
# results_h200/ (an NVIDIA H200 development machine: SM90, not a V100).
#
#   bash benchmarks/h200_session.sh OUTDIR        # on the GPU machine, from the repository root
#
# 1. a random-weight classifier of Qwen3.5-4B's text shape in FP16 on the GPU, synthetic input
#    sets in option groups (ROWS, default 128, premises of 200-1500 tokens; SMALL, default 32,
#    premises of 200-800 tokens) and their FP16 references (unpadded, one row per forward)
# 2. throughput: the embedded backend (padded batching) with bench_classify_v100.py warm,
#    batches of 32, 4 workers, median of 3, with the GPU-exclusivity monitor
# 3. exclusivity: an exact-batching server on the small set, once alone (valid) and once with a
#    competing CUDA process started mid-run (invalid, non-zero)
# 4. tuning: tune_sglang_v100.py with two profiles against the embedded backend, idle wait 5 s
# Results are packed after every stage into OUTDIR/results_h200.tgz (a time-out keeps what ran).
# Environment: PYTHON (default python3), WORK (default /tmp/openjev-h200); SHAPE (default
# qwen3.5-4b) and DEVICE (default cuda) exist to rehearse the script on a CPU with SHAPE=tiny.
set -uo pipefail
OUT=${1:?usage: h200_session.sh OUTDIR}
PY=${PYTHON:-python3}
# the bundle's library (openjev, sglang_openjev) is not pip-installed on the GPU machine
export PYTHONPATH="$(pwd -P)${PYTHONPATH:+:$PYTHONPATH}"
W=${WORK:-/tmp/openjev-h200}
R="$W/results"   # packed into OUTDIR/results_h200.tgz
SHAPE=${SHAPE:-qwen3.5-4b}
DEVICE=${DEVICE:-cuda}
mkdir -p "$R" "$W" "$OUT"
PACK="$OUT/results_h200.tgz"
# shellcheck source=benchmarks/gpu_session_lib.sh
. "$(pwd -P)/benchmarks/gpu_session_lib.sh"
LABEL=${MACHINE_LABEL:-$(machine_label)}

start_server() {  # start_server NAME PORT FLAGS... -> $SERVER
  local name=$1 port=$2; shift 2
  "$PY" app/serve_transformers.py "$W/model-$SHAPE" "$port" --device "$DEVICE" "$@" >"$R/$name.server.log" 2>&1 &
  SERVER=$!
  wait_healthy "$SERVER" "$port" "$R/$name.server.log" 300
}
stop_server() { kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; }

nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv >"$R/nvidia_smi.csv" 2>&1
"$PY" -c 'import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)' >"$R/versions.txt"

log "1+2. model, reference, throughput (padded batching, exclusive GPU 0)"
DEVICE=$DEVICE EXCLUSIVE_GPU=0 MAX_RUNNING_REQUESTS=32 MACHINE_LABEL=$LABEL \
  bash benchmarks/bench_embedded.sh "$W" "$R" "$SHAPE" "${ROWS:-128}" 200:1500
echo "throughput bench exit $?" | tee -a "$R/exit_codes.txt"
pack

log "3. small set and reference"
"$PY" app/make_synthetic_inputs.py "$W/SMALL" --rows "${SMALL:-32}" --premise-tokens 200:800 --seed 1
"$PY" app/score_reference.py --model "$W/model-$SHAPE" --tokens "$W/SMALL.tokens.jsonl" --inputs "$W/SMALL.jsonl" \
  --out "$W/ref64" --device "$DEVICE"
cp -r "$W/ref64" "$R/SMALL.reference"

log "3a. exclusivity, server alone (exact batching)"
PORT=$(free_port)
if start_server exclusive "$PORT" --batching exact; then
  BENCH=(app/bench_classify_v100.py --url "http://127.0.0.1:$PORT" --inputs "$W/SMALL.jsonl"
         --tokens "$W/SMALL.tokens.jsonl" --reference "$W/ref64" --exclusive-gpu 0 --server-pid "$SERVER"
         --machine-label "$LABEL")
  "$PY" "${BENCH[@]}" --out "$R/exclusive_alone.json" --repetitions 2 --label exclusive-alone
  echo "exclusive alone exit $?" | tee -a "$R/exit_codes.txt"
  pack
  log "3b. exclusivity, competing CUDA process started mid-run"
  ( sleep 4; exec "$PY" -c 'import torch, time; x = torch.ones(1 << 20, device="cuda"); time.sleep(60)' ) &
  COMPETITOR=$!
  "$PY" "${BENCH[@]}" --out "$R/exclusive_competitor.json" --repetitions 4 --label exclusive-competitor
  echo "exclusive with competitor exit $?" | tee -a "$R/exit_codes.txt"
  kill "$COMPETITOR" 2>/dev/null; pkill -P "$COMPETITOR" 2>/dev/null; wait "$COMPETITOR" 2>/dev/null
  stop_server
else
  echo "exclusive server failed to start" | tee -a "$R/exit_codes.txt"
fi
pack

log "4. tuning: two profiles, embedded backend, idle wait 5 s"
OPENJEV_BACKEND=transformers OPENJEV_PYTHON="$PY" "$PY" app/tune_sglang_v100.py --gpu 0 --port "$(free_port)" \
  --out "$W/tune" --model "$W/model-$SHAPE" --profiles fcfs:8,lpm:16 \
  --set "SMALL=$W/SMALL.jsonl,$W/SMALL.tokens.jsonl,$W/ref64" --repetitions 2 --idle-seconds 5 --max-wait 120 \
  --start-timeout 300 >"$R/tune.stdout.txt" 2>"$R/tune.stderr.txt"
echo "tune exit $?" | tee -a "$R/exit_codes.txt"
mkdir -p "$R/tune"
( cd "$W/tune" && find . -name '*.json' -o -name '*.png' -o -name '*.log' | tar -czf "$R/tune/tune_run.tgz" -T - )
cp "$W/tune/summary.json" "$W/tune/run.json" "$W/tune/comparison.png" "$R/tune/" 2>/dev/null
pack
log done
