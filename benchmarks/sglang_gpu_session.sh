#!/usr/bin/env bash
# SGLang's GPU engine with the adapter, beside the embedded backend, on the same sets and references,
# on a GPU machine that has torch, triton and transformers but no SGLang (the lent H100 or H200, not a
# V100). Receipts land in OUTDIR/results.tgz, packed after every stage (a time-out keeps what ran).
#
#   python benchmarks/sglang_gpu_wheels.py          # here: the carried wheels in .carry/wheels
#   bash benchmarks/sglang_gpu_session.sh OUTDIR    # there, from the repository root, .carry carried
#
# STAGES (default "setup prep sglang_cache sglang_uncached embedded"), in order:
#   setup            .carry/wheels installed into SITE (default /tmp/site) unless already there; the
#                    sgl_kernel stand-ins' GPU test (tests/test_sgl_cuda_standin.py -m gpu)
#   prep             the random-weight Qwen3.5-4B-shape classifier (FP16) and the 128-row set s128
#                    (benchmarks/experiments/embedded_h200_session.sh prep), the G-like set g303 (303 rows, premises
#                    200-1500 tokens) and the T-like set t564 (564 rows, premises 300-2500 tokens), all in
#                    option groups, and, for each set in SETS, its exact FP16 reference
#                    (app/score_reference.py)
#   sglang_cache     app/serve_sglang_v100.sh with the radix cache (extra_buffer); per set: bench with
#                    --cold-cache (flushed before each pass), then warm
#   sglang_uncached  the same with --disable-radix-cache; per set one bench
#   embedded         app/serve_transformers.py --max-running-requests 16 --step-token-budget 65536; per
#                    set one bench (the exact path has no prefix cache: one mode)
#   embedded_prefix  the same with --prefix-reuse --prefix-cache-mb PREFIX_CACHE_MB (default 49152); per set
#                    a bench flushed before each pass (--cold-cache), then warm
#   prefix_profile   benchmarks/experiments/prefix_reuse_profile.py on each set in SETS: the padded path and
#                    prefix reuse (flushed, warm, no cache) in process, steps as the server forms them,
#                    torch.profiler tables of a flushed and a warm pass, module outputs of the rows
#                    PREFIX_DIVERGENCE_ROWS (default 49,95,71,1) against their exact forwards
#                    (results/prefix_profile_SET/, or _MODE for each OPENJEV_PADDED_ATTENTION mode in
#                    PADDED_ATTENTION_MODES, e.g. "rowwise shared", other than the default rowwise); first the
#                    gpu_tests stage's tests
#   gpu_tests        the prefix path's GPU tests (PREFIX_GPU_TESTS: tests/test_prefix_reuse.py,
#                    tests/test_attention.py, tests/test_packing.py, tests/test_packed_layout.py, tests/test_fused.py
#                    -m gpu), alone: the kernels and calls the packed layout's load checks rely on
#   embedded_prefix_baseline  embedded_prefix with openjev/ from BASELINE (a tarball of `git archive COMMIT
#                    openjev`, e.g. carried in .carry/): the same-lease "before" of a change, receipts tagged _baseline
#   prefix_passes    in process, no profiler: PREFIX_PASSES (5) flushed and warm passes of prefix reuse for each set,
#                    this tree and BASELINE's (if set), alternated twice (results/prefix_passes_SET_TREE_RUN/)
#   ssm_fp16         radix cache with SGLANG_MAMBA_SSM_DTYPE=float16 (the SM70 setting): flushed bench
#                    on the T-like set, for the state-dtype comparison on the longest inputs
#   variant          one server with VARIANT_ARGS (serve_sglang_v100.sh flags) and VARIANT_ENV
#                    (NAME=VALUE words), benches VARIANT_MODES (default flushed), receipts tagged VARIANT_TAG
#   native_ops       the faithfulness bisection's next step: every SGLang fused op (norms, activation,
#                    ...) on its forward_native path (SGLANG_FORCE_FUSED_OP_BACKEND=torch, SGLang's own
#                    switch for bisecting numerics), no chunking, no cuBLAS split-K; flushed bench on s128
#   divergence       module by module: SGLang (radix cache off, no chunking) with --forward-hooks capturing
#                    every mixer, GDN core, gated norm and MLP output of the rows DIVERGENCE_ROWS of s128
#                    (default the group the audit failed on), each sent alone; then
#                    benchmarks/sglang_gpu_divergence.py against the Transformers reference's modules
#   tune             app/tune_sglang_v100.py against SGLang's engine: profiles TUNE_PROFILES (default
#                    fcfs:8,fcfs:16,lpm:16) on the sets TUNE_SETS (default g303), cold and warm, idle wait
#                    5 s; the server command is serve_sglang_v100.sh with this session's flags; with
#                    TUNE_DEADLINE (epoch seconds) the tuner gets SIGTERM 20 s before it, so it stops the
#                    server, marks run.json interrupted and the profiles done so far are kept
# Benches: app/bench_classify_v100.py, batches of 32 from 4 workers, 3 measured passes, the GPU-exclusivity
# monitor on GPU 0; then benchmarks/compute_bound.py.
# Environment: PYTHON (python3), WORK (/tmp/openjev-sglang-gpu), SITE (/tmp/site), SETS ("s128 t564"),
# EMBEDDED_TAG (a suffix of the embedded stages' receipt names, e.g. _shared beside
# OPENJEV_PADDED_ATTENTION=shared, which the servers read from the environment), EMBEDDED_ARGS (more
# serve_transformers.py flags for both embedded stages, e.g. --log-level debug: one line a step),
# SGLANG_ARGS (more serve_sglang_v100.sh flags), STAGE_TIMEOUT (seconds a stage, default 560),
# REPETITIONS (3), BASELINE, PREFIX_PASSES. .carry/wheels with the tree is about 52 MiB of the GPU tool's 64
# (sglang_gpu_wheels.py repacks sglang, sglang-kernel, pycountry and mistral-common); for the embedded stages alone
# it may leave out the sglang wheel, and setup then installs the rest and skips the stand-ins' test. Stand-ins: sgl-kernel's compiled ops are not carried (a 356 MiB wheel); its
# Python package falls back to `import common_ops`, which tests/openjev_testsupport/sgl_kernel_cuda_standin/shim
# provides (pure-PyTorch norms and silu_and_mul, checked against FlashInfer's kernels).
set -uo pipefail
OUTDIR=${1:?usage: sglang_gpu_session.sh OUTDIR}
PY=${PYTHON:-python3}
W=${WORK:-/tmp/openjev-sglang-gpu}
SITE=${SITE:-/tmp/site}
R="$W/results"
SETS=${SETS:-s128 t564}
TO=${STAGE_TIMEOUT:-560}
REPS=${REPETITIONS:-3}
SHAPE=qwen3.5-4b
MODEL="$W/model-$SHAPE"
REPO=$(pwd -P)
SHIM="$REPO/tests/openjev_testsupport/sgl_kernel_cuda_standin/shim"
mkdir -p "$R" "$OUTDIR"
# the bundle's library (openjev, sglang_openjev) is not pip-installed on the GPU machine: the repo goes first,
# then tests/ (the test support package openjev_testsupport, which the shim's common_ops imports)
export PYTHONPATH="$REPO:$REPO/tests:$SITE:$SHIM${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# sgl_kernel's package metadata says 0.4.10, but its compiled library is absent: SGLang's start-up
# version assertion reads the distribution, not the ops.
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
PACK="$OUTDIR/results.tgz"
# shellcheck source=benchmarks/gpu_session_lib.sh
. "$REPO/benchmarks/gpu_session_lib.sh"
LABEL=${MACHINE_LABEL:-$(machine_label)}
set_path() {
  case $1 in s128) echo "$W/set-128-200-1500" ;; g303) echo "$W/set-303-200-1500" ;; t564) echo "$W/set-564-300-2500" ;;
    *) return 1 ;; esac
}

stage_setup() {
  if ! "$PY" -c 'import sglang, sys; sys.exit(sglang.__version__ != "0.5.23")' 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .carry/wheels/*.whl || return 1
  fi
  nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv >"$R/nvidia_smi.csv" 2>&1
  "$PY" -c 'import importlib.util as u, torch, transformers, triton, fla
sg = __import__("sglang").__version__ if u.find_spec("sglang") else "not carried"
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      "triton", triton.__version__, "sglang", sg, "fla", fla.__version__)' | tee "$R/versions.txt"
  cp .carry/wheels/manifest.json "$R/carried_wheels.json"
  if ! ls .carry/wheels/sglang-*.whl >/dev/null 2>&1; then
    echo "setup: no sglang wheel carried (embedded stages only): the stand-ins' GPU test is SGLang's, not run"
    return 0
  fi
  "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_sgl_cuda_standin.py 2>&1 | tee "$R/standin_gpu_tests.txt"
  return "${PIPESTATUS[0]}"
}

baseline_tree() {  # the repository with openjev/ from BASELINE (a tarball of `git archive COMMIT openjev`), once
  local tree="$W/baseline"
  [ -n "${BASELINE:-}" ] || { echo "BASELINE is not set: a tarball of git archive COMMIT openjev" >&2; return 1; }
  if [ ! -d "$tree/openjev" ]; then
    mkdir -p "$tree" && cp -a "$REPO/." "$tree/" && rm -rf "$tree/openjev" && tar -xf "$BASELINE" -C "$tree" || return 1
  fi
  echo "$tree"
}

stage_prep() {
  WORK=$W STAGES=prep bash benchmarks/experiments/embedded_h200_session.sh "$W/prep-embedded" >/dev/null || return 1
  [ -e "$W/set-564-300-2500.jsonl" ] || "$PY" app/make_synthetic_inputs.py "$W/set-564-300-2500" --rows 564 \
    --premise-tokens 300:2500 --vocab 512 --seed 564 || return 1
  [ -e "$W/set-303-200-1500.jsonl" ] || "$PY" app/make_synthetic_inputs.py "$W/set-303-200-1500" --rows 303 \
    --premise-tokens 200:1500 --vocab 512 --seed 303 || return 1
  for s in $SETS; do
    local set ref="$W/ref-$s"
    set=$(set_path "$s") || return 1
    [ -d "$ref" ] || "$PY" app/score_reference.py --model "$MODEL" --tokens "$set.tokens.jsonl" --inputs "$set.jsonl" \
      --out "$ref" --device cuda || return 1
    mkdir -p "$R/reference_$s" && cp "$ref/reference.json" "$R/reference_$s/"
  done
}

bench() {  # NAME SET PORT PID [bench flags...]
  local name=$1 s=$2 port=$3 pid=$4 set
  shift 4
  set=$(set_path "$s")
  "$PY" app/bench_classify_v100.py --url "http://127.0.0.1:$port" --inputs "$set.jsonl" --tokens "$set.tokens.jsonl" \
    --reference "$W/ref-$s" --out "$R/$name.json" --batch-size 32 --workers 4 --repetitions "$REPS" --label "$name" \
    --machine-label "$LABEL" --exclusive-gpu 0 --server-pid "$pid" "$@"
  local rc=$?
  "$PY" benchmarks/compute_bound.py "$R/$name.json" --model "$MODEL" --device cuda >/dev/null 2>&1
  echo "$name exit $rc" >>"$R/bench_exit_codes.txt"
  return 0
}

server_info() {  # PORT: the server's /server_info, indented, on stdout (errors too, for the record)
  "$PY" -c "import json,requests; print(json.dumps(requests.get('http://127.0.0.1:$1/server_info',timeout=10).json(), indent=1, default=str))" 2>&1
}

run_sglang() {  # TAG MODES [serve flags...]: one server, every set in SETS, MODES "flushed warm" or "uncached"
  local tag=$1 modes=$2 port pid s m
  shift 2
  port=$(free_port)
  # shellcheck disable=SC2086
  OPENJEV_PYTHON=$PY OPENJEV_V100_ROOT="$W/root" CUDA_VISIBLE_DEVICES=0 bash app/serve_sglang_v100.sh "$MODEL" "$port" \
    --attention-backend triton --sampling-backend pytorch --linear-attn-prefill-backend triton --grammar-backend none \
    --skip-server-warmup "$@" ${SGLANG_ARGS:-} >"$R/sglang_$tag.server.log" 2>&1 &
  pid=$!
  local t0=$SECONDS
  wait_healthy "$pid" "$port" "$R/sglang_$tag.server.log" || { kill "$pid"; return 1; }
  echo "sglang_$tag healthy after $((SECONDS - t0)) s" | tee -a "$R/startup.txt"
  server_info "$port" >"$R/sglang_$tag.server_info.json"
  for s in $SETS; do
    for m in $modes; do
      case $m in
        flushed) bench "sglang_${tag}_${s}_flushed" "$s" "$port" "$pid" --cold-cache ;;
        *) bench "sglang_${tag}_${s}_$m" "$s" "$port" "$pid" ;;
      esac
    done
  done
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  return 0
}

stage_sglang_cache() { run_sglang cache "flushed warm"; }

stage_sglang_uncached() { run_sglang uncached uncached --disable-radix-cache; }

stage_ssm_fp16() { SETS=t564 SGLANG_MAMBA_SSM_DTYPE=float16 run_sglang ssm_fp16 flushed; }

stage_native_ops() {
  SETS=s128 SGLANG_FORCE_FUSED_OP_BACKEND=torch CUBLAS_WORKSPACE_CONFIG=:0:0 \
    run_sglang native_ops flushed --chunked-prefill-size -1
}

stage_divergence() {
  local port pid set="$(set_path s128)" cap="$W/capture" hooks
  local ids=${DIVERGENCE_ROWS:-syn00045-0 syn00045-1 syn00045-2 syn00045-3}
  rm -rf "$cap" && mkdir -p "$cap"
  # shellcheck disable=SC2086
  hooks=$("$PY" benchmarks/sglang_forward_capture.py hooks --tokens "$set.tokens.jsonl" --ids $ids --dir "$cap" \
    --layers 32) || return 1
  port=$(free_port)
  PYTHONPATH="$REPO/benchmarks:$PYTHONPATH" OPENJEV_PYTHON=$PY OPENJEV_V100_ROOT="$W/root" CUDA_VISIBLE_DEVICES=0 \
    bash app/serve_sglang_v100.sh "$MODEL" "$port" --attention-backend triton --sampling-backend pytorch \
    --linear-attn-prefill-backend triton --grammar-backend none --skip-server-warmup --disable-radix-cache \
    --chunked-prefill-size -1 --forward-hooks "$hooks" >"$R/sglang_divergence.server.log" 2>&1 &
  pid=$!
  wait_healthy "$pid" "$port" "$R/sglang_divergence.server.log" || { kill "$pid"; return 1; }
  # shellcheck disable=SC2086
  "$PY" benchmarks/sglang_forward_capture.py send --tokens "$set.tokens.jsonl" --ids $ids \
    --url "http://127.0.0.1:$port" --out "$cap/logits.json" || { kill "$pid"; return 1; }
  sleep 2
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  mkdir -p "$R/divergence" && cp "$cap/logits.json" "$R/divergence/sglang_logits.json" && ls -la "$cap"
  "$PY" benchmarks/sglang_gpu_divergence.py --model "$MODEL" --tokens "$set.tokens.jsonl" --captures "$cap" \
    --sglang-logits "$cap/logits.json" --out "$R/divergence" --machine-label "$LABEL"
}

stage_variant() {  # shellcheck disable=SC2086
  env ${VARIANT_ENV:-} bash -c 'run_sglang "$@"' _ "${VARIANT_TAG:-variant}" "${VARIANT_MODES:-flushed}" ${VARIANT_ARGS:-}
}

stage_tune() {
  local s set args=() serve="$W/serve_sglang_session.sh"
  for s in ${TUNE_SETS:-g303}; do
    set=$(set_path "$s") || return 1
    args+=(--set "$s=$set.jsonl,$set.tokens.jsonl,$W/ref-$s")
  done
  # the tuner runs CMD CHECKPOINT PORT [profile flags]; this session's flags go after the profile's
  cat >"$serve" <<EOS
#!/usr/bin/env bash
exec bash "$REPO/app/serve_sglang_v100.sh" "\$@" --attention-backend triton --sampling-backend pytorch \\
  --linear-attn-prefill-backend triton --grammar-backend none --skip-server-warmup ${SGLANG_ARGS:-}
EOS
  rm -rf "$W/tune" "$W/tune.pid"
  local limit=$((TO - 20))
  [ -n "${TUNE_DEADLINE:-}" ] && limit=$((TUNE_DEADLINE - $(date +%s) - 20))
  [ "$limit" -gt 60 ] || { echo "tune: no time left before TUNE_DEADLINE"; return 1; }
  OPENJEV_TUNE_SERVER_CMD="bash $serve" OPENJEV_PYTHON=$PY OPENJEV_V100_ROOT="$W/root" timeout -s TERM "$limit" \
    "$PY" app/tune_sglang_v100.py --gpu 0 --port "$(free_port)" --out "$W/tune" --model "$MODEL" --profiles "${TUNE_PROFILES:-fcfs:8,fcfs:16,lpm:16}" \
    "${args[@]}" --repetitions "$REPS" --idle-seconds 5 --max-wait 120 --start-timeout 300 \
    >"$R/tune.stdout.txt" 2>"$R/tune.stderr.txt"
  local rc=$?
  mkdir -p "$R/tune"
  [ -d "$W/tune" ] && ( cd "$W/tune" && find . -name '*.json' -o -name '*.npy' -o -name '*.png' -o -name '*.log' | tar -czf "$R/tune/tune_run.tgz" -T - )
  cp "$W/tune/summary.json" "$W/tune/run.json" "$W/tune/comparison.png" "$R/tune/" 2>/dev/null
  return "$rc"
}

stage_embedded() {
  local port pid s tag=embedded${EMBEDDED_TAG:-}
  port=$(free_port)
  # shellcheck disable=SC2086
  "$PY" app/serve_transformers.py "$MODEL" "$port" --device cuda --max-running-requests 16 --step-token-budget 65536 \
    ${EMBEDDED_ARGS:-} >"$R/$tag.server.log" 2>&1 &
  pid=$!
  wait_healthy "$pid" "$port" "$R/$tag.server.log" || { kill "$pid"; return 1; }
  for s in $SETS; do bench "${tag}_$s" "$s" "$port" "$pid"; done
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  return 0
}

stage_embedded_prefix() {  # the embedded backend with --prefix-reuse: per set, flushed before each pass, then warm
  local port pid s tag=embedded_prefix${EMBEDDED_TAG:-}
  port=$(free_port)
  # shellcheck disable=SC2086
  "$PY" app/serve_transformers.py "$MODEL" "$port" --device cuda --max-running-requests 16 --step-token-budget 65536 \
    --prefix-reuse --prefix-cache-mb "${PREFIX_CACHE_MB:-49152}" ${EMBEDDED_ARGS:-} >"$R/$tag.server.log" 2>&1 &
  pid=$!
  wait_healthy "$pid" "$port" "$R/$tag.server.log" || { kill "$pid"; return 1; }
  for s in $SETS; do
    bench "${tag}_${s}_flushed" "$s" "$port" "$pid" --cold-cache
    bench "${tag}_${s}_warm" "$s" "$port" "$pid"
  done
  server_info "$port" >"$R/$tag.server_info.json"
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  return 0
}

stage_embedded_prefix_baseline() {  # embedded_prefix with openjev/ from BASELINE, receipts tagged _baseline
  local tree
  tree=$(baseline_tree) || return 1
  (cd "$tree" && PYTHONPATH="$tree:$tree/tests:$PYTHONPATH" EMBEDDED_TAG=_baseline${EMBEDDED_TAG:-} stage_embedded_prefix)
}

stage_prefix_passes() {  # in process, no profiler: flushed and warm passes of this tree and BASELINE's, alternated
  local s set tree run dir
  for s in $SETS; do
    set=$(set_path "$s") || return 1
    for run in 1 2; do
      for tree in "$REPO" ${BASELINE:+baseline}; do
        [ "$tree" = baseline ] && { tree=$(baseline_tree) || return 1; }
        dir="$R/prefix_passes_${s}_$([ "$tree" = "$REPO" ] && echo this || echo baseline)_$run"
        (cd "$tree" && PYTHONPATH="$tree:$tree/tests:$PYTHONPATH" "$PY" benchmarks/experiments/prefix_reuse_profile.py \
          --model "$MODEL" --tokens "$set.tokens.jsonl" --out "$dir" --device cuda --cache-mb "${PREFIX_CACHE_MB:-49152}" \
          --modes prefix_flushed,prefix_warm --passes "${PREFIX_PASSES:-5}" --no-profile) || return 1
      done
    done
  done
}

PREFIX_GPU_TESTS=${PREFIX_GPU_TESTS:-tests/test_prefix_reuse.py tests/test_attention.py tests/test_packing.py tests/test_packed_layout.py tests/test_fused.py}

stage_gpu_tests() {  # shellcheck disable=SC2086 # PREFIX_GPU_TESTS is a word list
  "$PY" -m pytest -q -p no:cacheprovider -m gpu $PREFIX_GPU_TESTS 2>&1 | tee "$R/prefix_gpu_tests.txt"
  return "${PIPESTATUS[0]}"
}

stage_prefix_profile() {
  local s set m dir
  stage_gpu_tests
  for s in $SETS; do
    set=$(set_path "$s") || return 1
    for m in ${PADDED_ATTENTION_MODES:-rowwise}; do
      dir="$R/prefix_profile_$s"; [ "$m" = rowwise ] || dir="${dir}_$m"
      OPENJEV_PADDED_ATTENTION=$m "$PY" benchmarks/experiments/prefix_reuse_profile.py --model "$MODEL" \
        --tokens "$set.tokens.jsonl" --out "$dir" --device cuda --cache-mb "${PREFIX_CACHE_MB:-49152}" \
        --divergence-rows "${PREFIX_DIVERGENCE_ROWS:-49,95,71,1}" || return 1
    done
  done
}

export REPO PY W R SITE SETS REPS SHAPE MODEL LABEL SGLANG_ARGS VARIANT_ARGS VARIANT_ENV VARIANT_TAG VARIANT_MODES
export TUNE_SETS TUNE_PROFILES TUNE_DEADLINE TO PACK PREFIX_CACHE_MB PREFIX_DIVERGENCE_ROWS PADDED_ATTENTION_MODES BASELINE PREFIX_PASSES
export PREFIX_GPU_TESTS
export -f log code pack free_port set_path wait_healthy bench server_info run_sglang stage_setup stage_prep stage_sglang_cache \
  stage_sglang_uncached stage_ssm_fp16 stage_embedded stage_embedded_prefix stage_gpu_tests stage_prefix_profile stage_variant stage_native_ops stage_divergence stage_tune \
  baseline_tree stage_embedded_prefix_baseline stage_prefix_passes
# shellcheck disable=SC2086 # STAGES is a word list
run_stages ${STAGES:-setup prep sglang_cache sglang_uncached embedded}
