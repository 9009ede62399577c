#!/usr/bin/env bash
# The main job on the embedded default (README, first command: `make demo`).
#
#   1. build a tiny random-weight Qwen3.5 3-label classifier locally (once; reused afterwards)
#   2. overlay it with prepare_v100_model.py (offline processor configs, --allow-unpinned: the
#      tiny model's stand-in configs have no pin, and the overlay receipt records that)
#   3. tokenize the bundled NLI sample into exact token ids
#   4. score the reference logits with the unmodified Transformers forward
#   5. start the embedded /classify backend on 127.0.0.1 (a free port)
#   6. classify the same ids over HTTP and print the logits table against the reference
#
# Every run writes a new directory build/demo/runs/<UTC time>/; nothing earlier is overwritten.
# Environment: PYTHON (default .venv/bin/python), OPENJEV_DEMO_DIR (default build/demo).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
DEMO=${OPENJEV_DEMO_DIR:-build/demo}
RUN="$DEMO/runs/$(date -u +%Y%m%dT%H%M%SZ)"
INPUTS=data/nli_sample.jsonl

step() { printf '\n== %s\n' "$*" >&2; }
fail() { printf 'run_demo.sh: error: %s\n' "$*" >&2; exit 1; }

[ -x "$PY" ] || command -v "$PY" >/dev/null || fail "python $PY not found; run 'make demo' (it creates .venv)"
[ -e "$RUN" ] && fail "$RUN already exists"

if [ ! -d "$DEMO/checkpoint" ]; then
  [ -e "$DEMO/base-processor" ] && fail "$DEMO/base-processor exists without $DEMO/checkpoint; remove $DEMO to start over"
  step "1/6 building the tiny random-weight Qwen3.5 classifier in $DEMO/checkpoint"
  "$PY" app/make_tiny_model.py "$DEMO/checkpoint" --processor-out "$DEMO/base-processor"
else
  step "1/6 reusing $DEMO/checkpoint"
fi

step "2/6 overlay $DEMO/model"
"$PY" app/prepare_v100_model.py "$DEMO/checkpoint" "$DEMO/model" --processor-dir "$DEMO/base-processor" --allow-unpinned

mkdir -p "$RUN"
step "3/6 tokenizing $INPUTS"
"$PY" app/tokenize_nli.py --model "$DEMO/model" --inputs "$INPUTS" --out "$RUN/sample.tokens.jsonl"

step "4/6 reference logits (unmodified Transformers forward)"
"$PY" app/score_reference.py --model "$DEMO/model" --tokens "$RUN/sample.tokens.jsonl" --inputs "$INPUTS" \
  --out "$RUN/reference"

PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
step "5/6 embedded /classify backend on 127.0.0.1:$PORT (log: $RUN/server.log)"
"$PY" app/serve_transformers.py "$DEMO/model" "$PORT" >"$RUN/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
  kill -0 "$SERVER" 2>/dev/null || { tail -n 5 "$RUN/server.log" >&2; fail "the server exited during start-up"; }
  "$PY" -c "import sys, requests; sys.exit(requests.get('http://127.0.0.1:$PORT/health', timeout=2).status_code != 200)" \
    2>/dev/null && break
  sleep 1
done

step "6/6 classifying over HTTP"
"$PY" app/classify_tokens.py --url "http://127.0.0.1:$PORT" --tokens "$RUN/sample.tokens.jsonl" --inputs "$INPUTS" \
  --reference "$RUN/reference" | tee "$RUN/logits_table.txt"
printf '\ndemo run kept in %s\n' "$RUN" >&2
