#!/usr/bin/env bash
# A CPU history of scheduled runs (embedded backend, tiny random-weight model, the 22-row
# sample) and its report + plot: two normal runs, one with --torch-threads 32 (oversubscribing the
# cores: a real, slower server setting), one SIGKILLed midway. Run from the repository root:
#   bash benchmarks/results_cpu/bench_history/make_history_cpu.sh
set -euo pipefail
OUT=benchmarks/results_cpu/bench_history
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
P=.venv/bin/python
$P app/make_tiny_model.py "$W/ckpt" --processor-out "$W/proc" >/dev/null
$P app/prepare_v100_model.py "$W/ckpt" "$W/model" --processor-dir "$W/proc" --allow-unpinned >/dev/null
$P app/tokenize_nli.py --model "$W/model" --inputs data/nli_sample.jsonl --out "$W/tok.jsonl" >/dev/null
$P app/score_reference.py --model "$W/model" --tokens "$W/tok.jsonl" --inputs data/nli_sample.jsonl --out "$W/ref" >/dev/null
export OPENJEV_BACKEND=transformers OPENJEV_PYTHON=$PWD/$P OPENJEV_TUNE_SERVER_CMD=
H=$W/history
run() { ${EXEC:-} $P app/bench_scheduled_v100.py --history "$H" --checkpoint "$W/model" --gpu 0 --port 31777 \
    --set "S=data/nli_sample.jsonl,$W/tok.jsonl,$W/ref" --repetitions 2 --batch-size 4 --workers 2 \
    --idle-seconds 0 --rel-floor 1.0 "$@"; }
run; run
run --server-arg=--torch-threads=32 || echo "exit $?"
EXEC=exec run & PID=$!  # exec: $PID is the scheduler itself
# kill it midway: once its cold receipt is written, before the warm bench ends
until [[ $(ls "$H"/runs/*/tune/scheduled/S.cold.json 2>/dev/null | wc -l) -ge 4 ]]; do sleep 0.05; done
kill -KILL $PID; wait $PID || true; sleep 5
$P app/report_bench_history.py --history "$H" --rel-floor 1.0 --plot "$OUT/history_cpu.png" \
    --reference-lines "$OUT/eva01_reference_lines.json" --json "$OUT/history_cpu.json" | tee "$OUT/report_cpu.txt" || echo "report exit $?"
