#!/usr/bin/env bash
# Throughput of the embedded Transformers backend behind /classify (not a timed test).
#
#   benchmarks/bench_embedded.sh WORKDIR OUTDIR [SHAPE] [ROWS] [PREMISE_TOKENS]
#
# Builds a random-weight Qwen3.5 classifier of SHAPE (tiny | qwen3.5-4b; default tiny) on
# $DEVICE (default: cuda if torch sees one, else cpu), a synthetic input set of ROWS rows
# (default 256) with premises of PREMISE_TOKENS (default 200:1500) in option groups, its FP16 (GPU)
# or float32 (CPU) reference, starts app/serve_transformers.py on 127.0.0.1, and runs
# bench_classify_v100.py warm: batches of 32, 4 client workers, one initial pass excluded,
# median of 3. Writes OUTDIR/embedded_<shape>_<device>.json (the bench receipt, with the machine
# in it) and the reference receipt beside it. WORKDIR keeps the checkpoint for reuse.
#
# Environment: PYTHON (default .venv/bin/python, else python3), DEVICE, BATCHING (default auto),
# MAX_RUNNING_REQUESTS (default 32), EXCLUSIVE_GPU (physical GPU index: adds --exclusive-gpu with
# the server's PID), MACHINE_LABEL (--machine-label of the receipt), EXTRA_BENCH_ARGS, EXTRA_SERVER_ARGS
# (e.g. --prefix-reuse), NAME_SUFFIX (appended to the receipt's name).
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${1:?usage: bench_embedded.sh WORKDIR OUTDIR [SHAPE] [ROWS] [PREMISE_TOKENS]}
OUTDIR=${2:?usage: bench_embedded.sh WORKDIR OUTDIR [SHAPE] [ROWS] [PREMISE_TOKENS]}
SHAPE=${3:-tiny}
ROWS=${4:-256}
PREMISE=${5:-200:1500}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DEVICE=${DEVICE:-$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}
DTYPE=$([ "$DEVICE" = cpu ] && echo float32 || echo float16)
VOCAB=512   # the tiny tokenizer's vocabulary; ids below it are valid in both shapes
NAME="embedded_${SHAPE}_${DEVICE%%:*}${NAME_SUFFIX:-}"
mkdir -p "$WORK" "$OUTDIR"
[ -e "$OUTDIR/$NAME.json" ] && { echo "bench_embedded.sh: error: $OUTDIR/$NAME.json exists" >&2; exit 1; }

if [ ! -d "$WORK/ckpt-$SHAPE" ]; then
  "$PY" app/make_tiny_model.py "$WORK/ckpt-$SHAPE" --shape "$SHAPE" --dtype "$DTYPE" --device "$DEVICE" \
    --processor-out "$WORK/proc-$SHAPE"
fi
"$PY" app/prepare_v100_model.py "$WORK/ckpt-$SHAPE" "$WORK/model-$SHAPE" --processor-dir "$WORK/proc-$SHAPE" --allow-unpinned
SET="$WORK/set-$ROWS-${PREMISE/:/-}"
[ -e "$SET.jsonl" ] || "$PY" app/make_synthetic_inputs.py "$SET" --rows "$ROWS" --premise-tokens "$PREMISE" --vocab "$VOCAB"
REF="$WORK/ref-$SHAPE-${DEVICE%%:*}-$(basename "$SET")"
[ -d "$REF" ] || "$PY" app/score_reference.py --model "$WORK/model-$SHAPE" --tokens "$SET.tokens.jsonl" \
  --inputs "$SET.jsonl" --out "$REF" --device "$DEVICE"
cp -r "$REF" "$OUTDIR/$NAME.reference"   # reference.json + reference.npy + tokens.sha256

PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# shellcheck disable=SC2086 # EXTRA_SERVER_ARGS is a word list
"$PY" app/serve_transformers.py "$WORK/model-$SHAPE" "$PORT" --device "$DEVICE" --batching "${BATCHING:-auto}" \
  --max-running-requests "${MAX_RUNNING_REQUESTS:-32}" ${EXTRA_SERVER_ARGS:-} >"$OUTDIR/$NAME.server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  kill -0 "$SERVER" 2>/dev/null || { tail -n 20 "$OUTDIR/$NAME.server.log" >&2; exit 1; }
  "$PY" -c "import sys,requests; sys.exit(requests.get('http://127.0.0.1:$PORT/health',timeout=2).status_code!=200)" 2>/dev/null && break
  sleep 1
done
# shellcheck disable=SC2086
"$PY" app/bench_classify_v100.py --url "http://127.0.0.1:$PORT" --inputs "$SET.jsonl" --tokens "$SET.tokens.jsonl" \
  --reference "$REF" --out "$OUTDIR/$NAME.json" --batch-size 32 --workers 4 --repetitions 3 \
  --label "$NAME" ${EXCLUSIVE_GPU:+--exclusive-gpu "$EXCLUSIVE_GPU" --server-pid "$SERVER"} \
  ${MACHINE_LABEL:+--machine-label "$MACHINE_LABEL"} ${EXTRA_BENCH_ARGS:-}
