# shellcheck shell=bash
# What the GPU session scripts share (sourced after they set PY, R, TO and PACK, the .tgz that
# receives R after every stage): logging, exit codes, a free port, the health wait and the stage loop.
log() { echo "== $(date -u +%H:%M:%S) $*"; }
code() { echo "$1 exit $2" | tee -a "$R/exit_codes.txt"; }
pack() { tar -czf "$PACK" -C "$R" . ; }
# the machine as the driver names it (the lent GPU may be an H100 or an H200: never a V100)
machine_label() {
  local gpu
  gpu=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader -i 0 2>/dev/null | head -n 1 | sed 's/, */ SM/; s/\.//')
  echo "${gpu:-unknown GPU} (development machine; not a V100)"
}
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

wait_healthy() {  # PID PORT LOG [TRIES]: GET /health once a second until 200; the log's tail if PID dies
  for _ in $(seq 1 "${4:-500}"); do
    kill -0 "$1" 2>/dev/null || { tail -n 40 "$3"; return 1; }
    "$PY" -c "import sys,requests; sys.exit(requests.get('http://127.0.0.1:$2/health',timeout=2).status_code!=200)" \
      2>/dev/null && return 0
    sleep 1
  done
  return 1
}

run_stages() {  # STAGE...: each stage_NAME (exported) under the time limit TO, logged, its exit code kept, R packed
  local s
  for s in "$@"; do
    log "stage $s"
    timeout -k 10 "$TO" bash -c "stage_$s" 2>&1 | tee "$R/stage_$s.log"
    code "$s" "${PIPESTATUS[0]}"
    pack
  done
  log done
}
