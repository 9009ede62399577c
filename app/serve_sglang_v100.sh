#!/usr/bin/env bash
# serve_sglang_v100.sh CHECKPOINT PORT [extra flags...]
#
# Launches the OpenJEV classifier server: SGLang (the pinned V100 runtime) by default, or the
# embedded Transformers backend with OPENJEV_BACKEND=transformers. systemd units call this
# script; it `exec`s the server so the unit sees the server's PID. See --help for every flag
# and environment variable.
set -euo pipefail

readonly PROG=serve_sglang_v100.sh
SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
BUNDLE_ROOT=$(dirname -- "$SCRIPT_DIR")
readonly SCRIPT_DIR BUNDLE_ROOT

# Built-in defaults (SPEC section 3, "app/serve_sglang_v100.sh").
readonly DEFAULT_HOST=127.0.0.1
readonly DEFAULT_CONTEXT_LENGTH=8192
readonly DEFAULT_MAX_RUNNING_REQUESTS=16
readonly DEFAULT_SCHEDULE_POLICY=lpm
readonly DEFAULT_MEM_FRACTION_STATIC=0.8
readonly DEFAULT_MAMBA_FULL_MEMORY_RATIO=3
readonly ADAPTER_PACKAGE=sglang_openjev
readonly DEFAULT_SGLANG_MODULE=sglang_openjev.launch_server

# die, usage_error, expand_home
# shellcheck disable=SC1091
source "$BUNDLE_ROOT/openjev/common.sh"

usage() {
    cat <<'EOF'
usage: serve_sglang_v100.sh CHECKPOINT PORT [--host HOST] [--disable-radix-cache]
                            [--print-command] [--help] [SGLANG_FLAG ...]

Launch the OpenJEV NLI classifier server on one GPU and `exec` it (the server keeps this
process's PID, as systemd expects). Binds 127.0.0.1 unless --host says otherwise. Refuses a
port that already has a listener.

Positional arguments
  CHECKPOINT   model directory (normally the overlay $OPENJEV_V100_ROOT/model)
  PORT         TCP port to listen on (1-65535)

Launcher flags (anywhere on the line; the launcher places them in the command itself)
  | flag                  | meaning                                                              |
  |-----------------------|----------------------------------------------------------------------|
  | --host HOST           | bind HOST instead of 127.0.0.1 (binding beyond loopback is explicit) |
  | --disable-radix-cache | no prefix cache: passed on, and the mamba strategy becomes no_buffer |
  | --print-command       | print the environment (KEY=VALUE lines) and the exact command,       |
  |                       | shell-quoted, then exit 0 without launching (no port check)          |
  | -h, --help            | this help                                                            |
  Every other flag after CHECKPOINT PORT passes through to the server unchanged, after the
  launcher's own flags. A pass-through flag that the launcher also sets (e.g.
  --mem-fraction-static 0.7) replaces the launcher's value: each flag appears once.
  --port and --model-path are refused as flags: give them as CHECKPOINT and PORT.

Flags given to SGLang, through `python -m sglang_openjev.launch_server`, which registers the
classifier and the /classify contract routes and then runs SGLang's own server with these flags.
Their spelling follows the SGLang that OPENJEV_PYTHON imports (detected without importing it, or
OPENJEV_SGLANG_RUNTIME): the pinned V100 fork haohervchb/sglang-V100@dca48890 and stock 0.5.13 take
the legacy names below; stock 0.5.14 and newer take --cuda-graph-backend-decode disabled
--cuda-graph-backend-prefill disabled for the two CUDA-graph switches and
--mamba-radix-cache-strategy for --mamba-scheduler-strategy (same values, same meaning)
  | flag                            | value                       | override                    |
  |---------------------------------|-----------------------------|-----------------------------|
  | --model-path                    | CHECKPOINT                  | positional                  |
  | --host / --port                 | 127.0.0.1 / PORT            | --host, positional          |
  | --is-embedding                  | (classifier, not generator) |                             |
  | --dtype                         | float16                     | flag                        |
  | --context-length                | 8192                        | CONTEXT_LENGTH, flag        |
  | --mem-fraction-static           | 0.8                         | MEM_FRACTION_STATIC, flag   |
  | --max-running-requests          | 16                          | MAX_RUNNING_REQUESTS, flag  |
  | --schedule-policy               | lpm                         | SCHEDULE_POLICY, flag       |
  | --disable-cuda-graph            | (CUDA graphs off)           |                             |
  | --disable-piecewise-cuda-graph  | (CUDA graphs off)           |                             |
  | --mamba-scheduler-strategy      | extra_buffer; no_buffer     | --disable-radix-cache, flag |
  |                                 | with --disable-radix-cache  |                             |
  | --mamba-full-memory-ratio       | 3                           | MAMBA_FULL_MEMORY_RATIO,flag|
  | --attention-backend             | tilelang_fa_v100 (SM70 only)| flag                        |
  | --linear-attn-prefill-backend   | tilelang (SM70 only)        | flag                        |
  | --linear-attn-decode-backend    | triton (SM70 only)          | flag                        |
  | --sampling-backend              | pytorch (SM70 only; the     | flag                        |
  |                                 | classifier never samples)   |                             |
  On a GPU newer than SM70 the four backend flags are left out (SGLang's stock backends)
  and the SM70-only environment below is not set; everything else is the same. SM70 needs the
  fork: with stock SGLang the sm70-tilelang profile is refused.

Environment read by the launcher
  | variable                 | default                          | meaning                        |
  |--------------------------|----------------------------------|--------------------------------|
  | OPENJEV_BACKEND          | sglang                           | sglang, or transformers (the   |
  |                          |                                  | embedded backend, same CLI:    |
  |                          |                                  | app/serve_transformers.py; no  |
  |                          |                                  | GPU/TileLang/GCC 10/CUDA_HOME) |
  | OPENJEV_V100_ROOT        | ~/storage/sglang-openjev-v100    | bundle root: venv, caches, ... |
  | OPENJEV_PYTHON           | $ROOT/venv/bin/python if present,| interpreter that runs the      |
  |                          | else python3                     | server and the port check      |
  | OPENJEV_SGLANG_MODULE    | sglang_openjev.launch_server     | `python -m` entry point: the   |
  |                          |                                  | adapter's wrapper of SGLang's  |
  |                          |                                  | launch_server (contract routes)|
  | CUDA_VISIBLE_DEVICES     | 0                                | GPU to launch on               |
  | OPENJEV_GPU_ARCH         | from nvidia-smi compute_cap of   | sm70 -> TileLang V100 profile; |
  |                          | the first CUDA_VISIBLE_DEVICES   | sm75 and newer -> stock;       |
  |                          | entry                            | e.g. OPENJEV_GPU_ARCH=sm90     |
  | OPENJEV_SGLANG_RUNTIME   | detected: fork-VERSION when the  | flag dialect: fork, fork-VER,  |
  |                          | installed server_args.py has     | stock-0.5.13 ... (stock older  |
  |                          | tilelang_fa_v100, else           | than 0.5.13 refused; newer than|
  |                          | stock-VERSION                    | 0.5.23: as 0.5.23, with a note)|
  | CONTEXT_LENGTH           | 8192                             | --context-length               |
  | MAX_RUNNING_REQUESTS     | 16                               | --max-running-requests         |
  | SCHEDULE_POLICY          | lpm                              | --schedule-policy              |
  | MEM_FRACTION_STATIC      | 0.8                              | --mem-fraction-static          |
  | MAMBA_FULL_MEMORY_RATIO  | 3                                | --mamba-full-memory-ratio      |
  | SGLANG_V100_DYNAMIC_PAGED| 1                                | 0 restores static TileLang     |
  |                          |                                  | paged-kernel selection (SM70)  |
  | OPENJEV_CC, OPENJEV_CXX  | gcc-10, g++-10 found on PATH     | JIT host compilers; both or    |
  |                          |                                  | neither (override for GCC 10)  |
  Precedence: a pass-through flag beats its environment variable, which beats the default.

Environment set for the server
  | variable                      | value                                                    |
  |-------------------------------|----------------------------------------------------------|
  | CUDA_VISIBLE_DEVICES          | as above                                                 |
  | OPENJEV_BACKEND               | sglang or transformers                                   |
  | OPENJEV_ARCH_PROFILE          | sm70-tilelang or stock (SGLang only; /server_info shows) |
  | OPENJEV_SGLANG_RUNTIME        | fork-VERSION or stock-VERSION (SGLang only; /server_info)|
  | OPENJEV_V100_ROOT             | the root                                                 |
  | PYTHONPATH                    | bundle root first, so the adapter package imports        |
  | PYTHONPYCACHEPREFIX           | $ROOT/pycache (no bytecode inside the adapter directory) |
  | SGLANG_EXTERNAL_MODEL_PACKAGE | sglang_openjev (SGLang only)                             |
  | SGLANG_MAMBA_CONV_DTYPE       | float16 (SM70; on other GPUs the adapter's launcher sets |
  |                               | the serving dtype, since SGLang's default is bfloat16)   |
  | SGLANG_MAMBA_SSM_DTYPE        | float16 (SM70 only)                                      |
  | SGLANG_V100_DYNAMIC_PAGED     | 1 or 0 (SM70 only)                                       |
  | CC, CXX, CUDAHOSTCXX          | GCC 10 (required on SM70; used elsewhere when present)   |
  | CUDA_HOME, PATH               | $ROOT/cuda126 and its bin/ first, when that exists       |
  | TILELANG_CACHE_DIR            | $ROOT/tilelang_cache                                     |
  | TRITON_CACHE_DIR              | $ROOT/triton                                             |
  | FLASHINFER_WORKSPACE_BASE     | $ROOT/flashinfer_workspace (JIT: .cache/flashinfer)      |
  | TORCH_EXTENSIONS_DIR          | $ROOT/torch_extensions                                   |
  | CUDA_CACHE_PATH               | $ROOT/cuda_cache                                         |
  JIT cache directories are created at launch (not with --print-command).

Exit status: the server's own once it runs; 1 with one line on stderr when the launcher
refuses (port in use, no GCC 10 on SM70, unknown GPU, no SGLang or an unsupported one, SM70 on
stock SGLang); 2 for usage errors.

Examples
  serve_sglang_v100.sh ~/storage/sglang-openjev-v100/model 31003
  CUDA_VISIBLE_DEVICES=3 MAX_RUNNING_REQUESTS=32 serve_sglang_v100.sh MODEL 31003 --disable-radix-cache
  serve_sglang_v100.sh MODEL 31003 --print-command
EOF
}

# ------------------------------------------------------------------ small helpers
is_positive_int() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }
is_positive_number() { [[ $1 =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)$ && ! $1 =~ ^0*\.?0*$ ]]; }

# True when the operator passed FLAG (as `FLAG` or `FLAG=value`) among the pass-through flags.
operator_gave() {
    local flag=$1 arg
    for arg in "${EXTRA[@]}"; do
        [[ $arg == "$flag" || $arg == "$flag="* ]] && return 0
    done
    return 1
}

# Append a launcher default to CMD unless the operator passed the same flag.
add_default() {
    operator_gave "$1" && return 0
    CMD+=("$@")
}

# ------------------------------------------------------------------ arguments
PRINT_COMMAND=0
HOST=$DEFAULT_HOST
DISABLE_RADIX=0
POSITIONAL=()
EXTRA=()

parse_args() {
    while (($#)); do
        case $1 in
            -h | --help)
                usage
                exit 0
                ;;
            --print-command) PRINT_COMMAND=1 ;;
            --host)
                if (($# < 2)) || [[ $2 == -* ]]; then usage_error "--host needs a value"; fi
                HOST=$2
                shift
                ;;
            --host=*) HOST=${1#--host=} ;;
            --disable-radix-cache) DISABLE_RADIX=1 ;;
            --port | --port=* | --model-path | --model-path=* | --model | --model=*)
                usage_error "give the checkpoint and the port as the positional arguments CHECKPOINT PORT, not as $1"
                ;;
            *)
                if ((${#POSITIONAL[@]} < 2 && ${#EXTRA[@]} == 0)) && [[ $1 != -* ]]; then
                    POSITIONAL+=("$1")
                else
                    EXTRA+=("$1")
                fi
                ;;
        esac
        shift
    done
    ((${#POSITIONAL[@]} == 2)) || usage_error "expected CHECKPOINT and PORT"
    CHECKPOINT=${POSITIONAL[0]}
    PORT=${POSITIONAL[1]}
    [[ -n $HOST ]] || usage_error "--host needs a non-empty value"
    if ! [[ $PORT =~ ^[0-9]{1,5}$ ]] || ((10#$PORT < 1 || 10#$PORT > 65535)); then
        usage_error "PORT must be an integer from 1 to 65535, got '$PORT'"
    fi
    PORT=$((10#$PORT))
    [[ -d $CHECKPOINT ]] || die "checkpoint directory '$CHECKPOINT' does not exist"
    if operator_gave --disable-radix-cache; then DISABLE_RADIX=1; fi
    check_pp_size
}

# The adapter's forward has no pp_proxy_tensors: pipeline parallelism is refused at start.
check_pp_size() {
    local i arg value
    for ((i = 0; i < ${#EXTRA[@]}; i++)); do
        arg=${EXTRA[i]}
        case $arg in
            --pp-size | --pipeline-parallel-size) value=${EXTRA[i + 1]:-} ;;
            --pp-size=* | --pipeline-parallel-size=*) value=${arg#*=} ;;
            *) continue ;;
        esac
        [[ $value =~ ^[0-9]+$ ]] || usage_error "${arg%%=*} needs an integer, got '$value'"
        ((10#$value <= 1)) ||
            die "${arg%%=*} $value is not supported: the sglang_openjev adapter runs on one pipeline stage (no pp_proxy_tensors); use --tp-size or one replica per GPU"
    done
}

# ------------------------------------------------------------------ settings from the environment
read_settings() {
    BACKEND=${OPENJEV_BACKEND:-sglang}
    case $BACKEND in
        sglang | transformers) ;;
        *) die "OPENJEV_BACKEND must be sglang or transformers, got '$BACKEND'" ;;
    esac

    if [[ -n ${OPENJEV_V100_ROOT:-} ]]; then
        ROOT=$(expand_home "$OPENJEV_V100_ROOT")
    else
        [[ -n ${HOME:-} ]] || die "neither OPENJEV_V100_ROOT nor HOME is set"
        ROOT=$HOME/storage/sglang-openjev-v100
    fi

    CONTEXT_LENGTH_V=${CONTEXT_LENGTH:-$DEFAULT_CONTEXT_LENGTH}
    is_positive_int "$CONTEXT_LENGTH_V" || die "CONTEXT_LENGTH must be a positive integer, got '$CONTEXT_LENGTH_V'"
    MAX_RUNNING_V=${MAX_RUNNING_REQUESTS:-$DEFAULT_MAX_RUNNING_REQUESTS}
    is_positive_int "$MAX_RUNNING_V" || die "MAX_RUNNING_REQUESTS must be a positive integer, got '$MAX_RUNNING_V'"
    SCHEDULE_POLICY_V=${SCHEDULE_POLICY:-$DEFAULT_SCHEDULE_POLICY}
    [[ $SCHEDULE_POLICY_V =~ ^[a-z][a-z_-]*$ ]] || die "SCHEDULE_POLICY must be a policy name such as lpm or fcfs, got '$SCHEDULE_POLICY_V'"
    MEM_FRACTION_V=${MEM_FRACTION_STATIC:-$DEFAULT_MEM_FRACTION_STATIC}
    if ! is_positive_number "$MEM_FRACTION_V" || ! awk -v v="$MEM_FRACTION_V" 'BEGIN { exit !(v > 0 && v <= 1) }'; then
        die "MEM_FRACTION_STATIC must be a number in (0, 1], got '$MEM_FRACTION_V'"
    fi
    MAMBA_RATIO_V=${MAMBA_FULL_MEMORY_RATIO:-$DEFAULT_MAMBA_FULL_MEMORY_RATIO}
    is_positive_number "$MAMBA_RATIO_V" || die "MAMBA_FULL_MEMORY_RATIO must be a positive number, got '$MAMBA_RATIO_V'"
    SGLANG_MODULE=${OPENJEV_SGLANG_MODULE:-$DEFAULT_SGLANG_MODULE}
    [[ $SGLANG_MODULE =~ ^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$ ]] ||
        die "OPENJEV_SGLANG_MODULE must be a Python module name, got '$SGLANG_MODULE'"
    DYNAMIC_PAGED_V=${SGLANG_V100_DYNAMIC_PAGED:-1}
    [[ $DYNAMIC_PAGED_V == 0 || $DYNAMIC_PAGED_V == 1 ]] ||
        die "SGLANG_V100_DYNAMIC_PAGED must be 0 or 1, got '$DYNAMIC_PAGED_V'"

    if [[ -z ${CUDA_VISIBLE_DEVICES+set} ]]; then
        DEVICES=0
    else
        DEVICES=$CUDA_VISIBLE_DEVICES
        [[ -n $DEVICES || $BACKEND == transformers ]] ||
            die "CUDA_VISIBLE_DEVICES is set but empty: no GPU to launch SGLang on"
    fi
}

resolve_python() {
    local candidate
    if [[ -n ${OPENJEV_PYTHON:-} ]]; then
        candidate=$OPENJEV_PYTHON
    elif [[ -x $ROOT/venv/bin/python ]]; then
        candidate=$ROOT/venv/bin/python
    else
        candidate=python3
    fi
    PYTHON=$(command -v -- "$candidate") || die "Python interpreter '$candidate' not found (set OPENJEV_PYTHON)"
    [[ -x $PYTHON ]] || die "Python interpreter '$PYTHON' is not executable (set OPENJEV_PYTHON)"
}

# ------------------------------------------------------------------ GPU profile and compilers
# Sets ARCH_NUM (e.g. 70, 90, 120) and PROFILE (sm70-tilelang | stock).
detect_profile() {
    local arch cap device
    if [[ -n ${OPENJEV_GPU_ARCH:-} ]]; then
        arch=$OPENJEV_GPU_ARCH
    else
        device=${DEVICES%%,*}
        command -v nvidia-smi >/dev/null 2>&1 ||
            die "cannot detect the GPU's compute capability: nvidia-smi is not on PATH (set OPENJEV_GPU_ARCH=sm70, sm90, ...)"
        cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader -i "$device" 2>/dev/null) ||
            die "nvidia-smi could not query GPU '$device' (CUDA_VISIBLE_DEVICES=$DEVICES); set OPENJEV_GPU_ARCH to override"
        cap=${cap//[[:space:]]/}
        [[ $cap =~ ^[0-9]+\.[0-9]$ ]] ||
            die "nvidia-smi reported compute capability '$cap' for GPU '$device'; set OPENJEV_GPU_ARCH to override"
        arch=sm${cap/./}
    fi
    [[ $arch =~ ^sm_?([0-9]{2,3})[a-z]?$ ]] ||
        die "OPENJEV_GPU_ARCH must look like sm70, sm90 or sm_120, got '$arch'"
    ARCH_NUM=$((10#${BASH_REMATCH[1]}))
    if ((ARCH_NUM < 70)); then
        die "GPU architecture sm$ARCH_NUM is older than Volta (SM70); no SGLang profile supports it"
    elif ((ARCH_NUM < 75)); then
        PROFILE=sm70-tilelang
    else
        PROFILE=stock
    fi
}

# Sets CC_PATH and CXX_PATH (empty when no GCC 10 and not required).
find_compilers() {
    find_gcc10 && return 0
    [[ $PROFILE == sm70-tilelang ]] &&
        die "GCC 10 is required for SM70 JIT (TileLang C++20 headers) but gcc-10/g++-10 are not on PATH; install gcc-10 g++-10 or set OPENJEV_CC and OPENJEV_CXX"
    return 0
}

# ------------------------------------------------------------------ SGLang runtime and its flag dialect
# Sets RUNTIME_LABEL (fork-VERSION | stock-VERSION), DIALECT (legacy | 0.5.14) and RUNTIME_NOTE, from
# OPENJEV_SGLANG_RUNTIME when set, else from the SGLang that $PYTHON would import (read without
# importing it: sglang_openjev.launch_server --openjev-runtime).
detect_runtime() {
    local line rc=0
    line=$(PYTHONPATH=$BUNDLE_ROOT${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" -B -c '
import sys
from sglang_openjev.launch_server import main
main(["--openjev-runtime", sys.argv[1]])
' "${OPENJEV_SGLANG_RUNTIME:-}" 2>&1) || rc=$?
    if ((rc != 0)); then
        line=${line##*$'\n'}
        die "SGLang runtime: ${line#sglang_openjev.launch_server: error: }"
    fi
    read -r RUNTIME_LABEL DIALECT RUNTIME_NOTE <<<"$line"
    [[ $RUNTIME_LABEL =~ ^(fork|stock)-[^[:space:]]+$ && $DIALECT =~ ^(legacy|0\.5\.14)$ ]] ||
        die "SGLang runtime: unexpected answer from $PYTHON: $line"
    if [[ $PROFILE == sm70-tilelang && $RUNTIME_LABEL == stock-* ]]; then
        die "the sm70-tilelang profile needs the pinned V100 fork (haohervchb/sglang-V100: tilelang_fa_v100, TileLang GDN); $PYTHON has ${RUNTIME_LABEL/-/ SGLang }"
    fi
}

# ------------------------------------------------------------------ environment and command
ENV_KV=()
CMD=()

build_environment() {
    ENV_KV+=("CUDA_VISIBLE_DEVICES=$DEVICES" "OPENJEV_BACKEND=$BACKEND")
    [[ $BACKEND == sglang ]] && ENV_KV+=("OPENJEV_ARCH_PROFILE=$PROFILE")
    ENV_KV+=("OPENJEV_V100_ROOT=$ROOT" "PYTHONPATH=$BUNDLE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
        "PYTHONPYCACHEPREFIX=$ROOT/pycache") # bytecode never lands in sglang_openjev/ (verify_sources.py)
    [[ $BACKEND == sglang ]] || return 0

    ENV_KV+=("SGLANG_EXTERNAL_MODEL_PACKAGE=$ADAPTER_PACKAGE" "OPENJEV_SGLANG_RUNTIME=$RUNTIME_LABEL")
    if [[ $PROFILE == sm70-tilelang ]]; then
        ENV_KV+=("SGLANG_MAMBA_CONV_DTYPE=float16" "SGLANG_MAMBA_SSM_DTYPE=float16"
            "SGLANG_V100_DYNAMIC_PAGED=$DYNAMIC_PAGED_V")
    fi
    if [[ -n $CC_PATH ]]; then
        ENV_KV+=("CC=$CC_PATH" "CXX=$CXX_PATH" "CUDAHOSTCXX=$CXX_PATH")
    fi
    if [[ -d $ROOT/cuda126 ]]; then
        ENV_KV+=("CUDA_HOME=$ROOT/cuda126" "PATH=$ROOT/cuda126/bin:$PATH")
    fi
    ENV_KV+=("TILELANG_CACHE_DIR=$ROOT/tilelang_cache"
        "TRITON_CACHE_DIR=$ROOT/triton"
        "FLASHINFER_WORKSPACE_BASE=$ROOT/flashinfer_workspace"
        "TORCH_EXTENSIONS_DIR=$ROOT/torch_extensions"
        "CUDA_CACHE_PATH=$ROOT/cuda_cache")
}

build_command() {
    local strategy=extra_buffer
    ((DISABLE_RADIX)) && strategy=no_buffer
    if [[ $BACKEND == transformers ]]; then
        CMD=("$PYTHON" "$SCRIPT_DIR/serve_transformers.py" "$CHECKPOINT" "$PORT" --host "$HOST")
        add_default --context-length "$CONTEXT_LENGTH_V"
        add_default --max-running-requests "$MAX_RUNNING_V"
        add_default --schedule-policy "$SCHEDULE_POLICY_V"
    else
        CMD=("$PYTHON" -m "$SGLANG_MODULE" --model-path "$CHECKPOINT" --host "$HOST" --port "$PORT")
        add_default --is-embedding
        add_default --dtype float16
        add_default --context-length "$CONTEXT_LENGTH_V"
        add_default --mem-fraction-static "$MEM_FRACTION_V"
        add_default --max-running-requests "$MAX_RUNNING_V"
        add_default --schedule-policy "$SCHEDULE_POLICY_V"
        if [[ $DIALECT == legacy ]]; then # the fork, stock <= 0.5.13
            add_default --disable-cuda-graph
            add_default --disable-piecewise-cuda-graph
            operator_gave --mamba-radix-cache-strategy || add_default --mamba-scheduler-strategy "$strategy"
        else # stock >= 0.5.14: the old spellings are deprecated aliases (0.5.14) or gone (0.5.23)
            add_default --cuda-graph-backend-decode disabled
            add_default --cuda-graph-backend-prefill disabled
            operator_gave --mamba-scheduler-strategy || add_default --mamba-radix-cache-strategy "$strategy"
        fi
        add_default --mamba-full-memory-ratio "$MAMBA_RATIO_V"
        add_default --enable-metrics  # SGLang's own Prometheus /metrics on every replica
        if [[ $PROFILE == sm70-tilelang ]]; then
            add_default --attention-backend tilelang_fa_v100
            add_default --linear-attn-prefill-backend tilelang
            add_default --linear-attn-decode-backend triton
            add_default --sampling-backend pytorch
        fi
    fi
    ((DISABLE_RADIX)) && add_default --disable-radix-cache
    CMD+=("${EXTRA[@]}")
}

print_command() {
    local kv
    for kv in "${ENV_KV[@]}"; do
        printf '%s=%q\n' "${kv%%=*}" "${kv#*=}"
    done
    printf '%q' "${CMD[0]}"
    printf ' %q' "${CMD[@]:1}"
    printf '\n'
}

# Refuse a port that already has a listener, with the project's own bind check.
check_port() {
    local msg rc=0
    msg=$(PYTHONPATH=$BUNDLE_ROOT${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" -B -c '
import sys
from openjev.common import UserError, bind_listen_socket
try:
    bind_listen_socket(sys.argv[1], int(sys.argv[2]), backlog=1).close()
except UserError as exc:
    print(exc)
    sys.exit(3)
' "$HOST" "$PORT" 2>&1) || rc=$?
    case $rc in
        0) ;;
        3) die "$msg" ;;
        *) die "port check with $PYTHON failed (exit $rc): ${msg##*$'\n'}" ;;
    esac
}

make_cache_dirs() {
    local kv
    for kv in "${ENV_KV[@]}"; do
        case ${kv%%=*} in
            TILELANG_CACHE_DIR | TRITON_CACHE_DIR | FLASHINFER_WORKSPACE_BASE | TORCH_EXTENSIONS_DIR | CUDA_CACHE_PATH)
                mkdir -p -- "${kv#*=}" || die "cannot create cache directory ${kv#*=}"
                ;;
        esac
    done
}

main() {
    parse_args "$@"
    read_settings
    resolve_python
    # The cheap, definitive refusal first: a port that has a listener is refused before the GPU and
    # runtime probes (which import SGLang, seconds) and before anything is loaded.
    ((PRINT_COMMAND)) || check_port
    PROFILE="" CC_PATH="" CXX_PATH="" RUNTIME_LABEL="" DIALECT="" RUNTIME_NOTE=""
    if [[ $BACKEND == sglang ]]; then
        detect_profile
        detect_runtime
        find_compilers
    fi
    build_environment
    build_command
    if ((PRINT_COMMAND)); then
        print_command
        exit 0
    fi
    [[ -z $RUNTIME_NOTE ]] || printf '%s: note: %s\n' "$PROG" "$RUNTIME_NOTE" >&2
    make_cache_dirs
    local kv
    for kv in "${ENV_KV[@]}"; do
        export "${kv?}"
    done
    exec "${CMD[@]}"
}

main "$@"
