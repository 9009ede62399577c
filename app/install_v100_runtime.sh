#!/usr/bin/env bash
# install_v100_runtime.sh [--dry-run] [--allow-unpinned]
#
# Installs the pinned SGLang V100 runtime into $OPENJEV_V100_ROOT/venv: the minimal SM70
# sgl-kernel built from the pinned runtime checkout, the project's patches, the patched
# FlashInfer, a private Rust/cargo/protoc, GCC 10 for the builds, and runtime_receipt.json.
# The GPU preflight runs first; nothing is touched unless it passes. The plan is data: the
# same command strings are printed by --dry-run and executed by a real run. See --help.
set -euo pipefail

readonly PROG=install_v100_runtime.sh
SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
BUNDLE_ROOT=$(dirname -- "$SCRIPT_DIR")
readonly SCRIPT_DIR BUNDLE_ROOT

# Build requirements added to the runtime's own dependencies (the fork's scripts/install_v100.sh
# pins these for torch 2.9.1 / SM70) and packages whose SM70 builds replace the stock wheels.
readonly EXTRA_REQUIREMENTS="tilelang==0.1.8 grpcio==1.81.1 grpcio-health-checking==1.81.1 grpcio-reflection==1.81.1 protobuf==6.33.6"
readonly EXCLUDED_REQUIREMENTS="torch,torchvision,torchaudio,torchcodec,flashinfer-python,flashinfer-cubin,sglang-kernel,sgl-kernel"
readonly BUILD_TOOLS="setuptools>=61 setuptools-scm>=8 setuptools-rust>=1.10 wheel scikit-build-core cmake ninja packaging"
readonly NCCL_PIN=nvidia-nccl-cu12==2.27.5

# die, usage_error, expand_home
# shellcheck disable=SC1091
source "$BUNDLE_ROOT/openjev/common.sh"

say() { printf '%s: %s\n' "$PROG" "$*"; }

usage() {
    cat <<'EOF'
usage: install_v100_runtime.sh [--dry-run] [--allow-unpinned] [--help]

Install the pinned SGLang V100 runtime into $OPENJEV_V100_ROOT (default
~/storage/sglang-openjev-v100). Prerequisites: $ROOT/venv with torch 2.9.1+cu126 and
torchvision 0.24.1+cu126, and the private CUDA toolkit $ROOT/cuda126 (prepare_v100_cuda.py).
Nothing outside $ROOT is changed (pip and build caches, temporary files, Rust and protoc all
live under it).

Flags
  | flag             | meaning                                                                |
  |------------------|------------------------------------------------------------------------|
  | --dry-run        | print every step, numbered, one line each, with its exact command and  |
  |                  | its "already done" test; run nothing (the GPU preflight is not run     |
  |                  | and cannot block the plan); exit 0                                     |
  | --allow-unpinned | let steps that download an artifact whose sha256 in HF_SOURCE.json is  |
  |                  | null proceed unverified; recorded in the receipt                       |
  | -h, --help       | this help                                                              |

Steps (each detects that it is already done, so re-running is safe)
   preflight    app/v100_preflight.py: torch.cuda.get_arch_list() has sm_70, the GPU is SM70, and
                an FP16 GPU matmul matches a float32 CPU matmul of the same inputs
                (max|gpu-cpu| <= 2^-8 * max|cpu|). Runs FIRST: on failure one line on stderr,
                exit 1, nothing changed. Then, still before any change: pins, GCC 10, nvcc, tools.
   toolchain    export CC/CXX/CUDAHOSTCXX (GCC 10), CUDA_HOME, RUSTUP_HOME, CARGO_HOME, PROTOC,
                PATH, TORCH_CUDA_ARCH_LIST=7.0, MAX_JOBS, pip cache and TMPDIR under the root
   dirs         create the directories under the root
   rust         rustup-init <rust.rustup_version> for x86_64 (versioned archive URL, sha256 from
                HF_SOURCE.json) -> Rust <rust.version> in $ROOT/rustup,
                $ROOT/cargo
   protoc       protoc <protoc.version> (sha256 from HF_SOURCE.json) -> $ROOT/protoc
   runtime      clone the runtime into $ROOT/src/sglang-V100, check out the pinned revision,
                verify `git rev-parse HEAD` equals the pin
   patches      each patches/*.patch: `git apply --check`, then `git apply` (skipped when
                `git apply --reverse --check` shows it is already applied)
   flashinfer   clone haohervchb/flashinfer at its pin with submodules, apply the runtime's
                patches/flashinfer-sm70.patch the same way, editable install
   build-tools  setuptools, setuptools-rust, scikit-build-core, cmake, ninja (constrained)
   sgl-kernel   minimal SM70 build: CMAKE_ARGS=-DSGL_KERNEL_V100_ONLY=ON, CUDA arch 70
   runtime-deps the runtime's dependencies less torch/FlashInfer/sgl-kernel, plus tilelang 0.1.8 and
                the gRPC pins, with torch/torchvision/NCCL held by a constraints file
   runtime-install  editable install of the patched runtime (builds its Rust gRPC extension)
   nccl         the CUDA 12 NCCL that torch 2.9.1 needs
   verify       import torch, sglang, sgl_kernel, flashinfer, tilelang; sgl_kernel is the sm70 build
   kernel-arch  cuobjdump --list-elf of the built sgl-kernel library lists sm_70 cubins (else one line,
                exit 1); the list goes into the receipt
   receipt      $ROOT/results/runtime_receipt.json, written atomically

Environment
  | variable           | default                                 | meaning                      |
  |--------------------|-----------------------------------------|------------------------------|
  | OPENJEV_V100_ROOT  | ~/storage/sglang-openjev-v100           | everything the install makes |
  | OPENJEV_PYTHON     | $ROOT/venv/bin/python, else python3     | the venv's interpreter       |
  | OPENJEV_CC         | gcc-10 on PATH                          | C compiler (with OPENJEV_CXX)|
  | OPENJEV_CXX        | g++-10 on PATH                          | C++ / CUDA host compiler     |
  | OPENJEV_HF_SOURCE  | <bundle>/HF_SOURCE.json                 | pinned sources               |
  | OPENJEV_PATCH_DIR  | <bundle>/patches                        | project patches (*.patch)    |
  | MAX_JOBS           | min(cores, (available RAM - 16 GiB)/4 GiB), at least 1 | build jobs    |
  | NVCC_THREADS       | 1                                       | nvcc threads per job         |

Receipt ($ROOT/results/runtime_receipt.json): runtime and FlashInfer URLs, pinned revisions,
checked-out HEADs and working-tree diff hashes; every patch with its sha256; package versions
(torch, sglang, sglang-kernel, flashinfer, tilelang, transformers, triton, NCCL); GCC, nvcc,
rustc, cargo and protoc versions; the preflight result before and after the install (arch list,
device, matmul max abs error and tolerance); every step with ran/already-done; whether
--allow-unpinned was used; and the machine (openjev/common.py environment_receipt).

Exit status: 0 on success (and for --dry-run, --help); 1 with one line on stderr when a
check refuses (preflight, pins, GCC 10, toolkit) or a step fails; 2 for usage errors.
EOF
}

# ------------------------------------------------------------------ arguments and paths
DRY_RUN=0
ALLOW_UNPINNED=0

parse_args() {
    while (($#)); do
        case $1 in
            -h | --help)
                usage
                exit 0
                ;;
            --dry-run) DRY_RUN=1 ;;
            --allow-unpinned) ALLOW_UNPINNED=1 ;;
            *) usage_error "unknown argument '$1'" ;;
        esac
        shift
    done
}

resolve_paths() {
    if [[ -n ${OPENJEV_V100_ROOT:-} ]]; then
        ROOT=$(expand_home "$OPENJEV_V100_ROOT")
    else
        [[ -n ${HOME:-} ]] || die "neither OPENJEV_V100_ROOT nor HOME is set"
        ROOT=$HOME/storage/sglang-openjev-v100
    fi
    [[ $ROOT == /* ]] || ROOT=$PWD/$ROOT
    if [[ -n ${OPENJEV_PYTHON:-} ]]; then
        PY=$OPENJEV_PYTHON
        if [[ $PY != */* ]]; then
            PY=$(command -v -- "$PY" || echo "$PY")
        elif [[ $PY != /* ]]; then
            PY=$PWD/$PY
        fi
    elif [[ -x $ROOT/venv/bin/python ]]; then
        PY=$ROOT/venv/bin/python
    else
        PY=$(command -v python3 || echo python3)
    fi
    HF_SOURCE=${OPENJEV_HF_SOURCE:-$BUNDLE_ROOT/HF_SOURCE.json}
    PATCH_DIR=${OPENJEV_PATCH_DIR:-$BUNDLE_ROOT/patches}
    RT=$ROOT/src/sglang-V100
    FI=$ROOT/src/flashinfer
    BUILD=$ROOT/build
    STAMPS=$BUILD/stamps
    DOWNLOADS=$ROOT/downloads
    CUDA_DIR=$ROOT/cuda126
    NVCC=$CUDA_DIR/bin/nvcc
    CUOBJDUMP=$CUDA_DIR/bin/cuobjdump
    ELF_LIST=$BUILD/sgl-kernel-elf.txt
    PREFLIGHT=$SCRIPT_DIR/v100_preflight.py
    RECEIPT=$ROOT/results/runtime_receipt.json
    STEP_LOG=$BUILD/install-steps.tsv
}

# ------------------------------------------------------------------ pinned sources
# Reads HF_SOURCE.json with any Python (no third-party imports); null becomes an empty string.
load_pins() {
    local reader key value
    reader=$PY
    [[ -x $reader ]] || reader=$(command -v python3) || die "no Python to read $HF_SOURCE (set OPENJEV_PYTHON)"
    [[ -f $HF_SOURCE ]] || die "pinned-source file $HF_SOURCE not found"
    local lines
    lines=$("$reader" -B -c '
import json, sys
d = json.load(open(sys.argv[1]))
def get(*path):
    cur = d
    for p in path:
        cur = cur.get(p) if isinstance(cur, dict) else None
    return "" if cur is None else str(cur)
for key, path in [("RUNTIME_URL", ("runtime", "repo")), ("RUNTIME_REV", ("runtime", "revision")),
                  ("FLASHINFER_URL", ("flashinfer", "repo")), ("FLASHINFER_REV", ("flashinfer", "revision")),
                  ("TORCH_VERSION", ("torch", "version")), ("TORCHVISION_VERSION", ("torchvision", "version")),
                  ("RUST_VERSION", ("rust", "version")), ("RUSTUP_SHA256", ("rust", "rustup_init_sha256")),
                  ("RUSTUP_URL", ("rust", "rustup_init_url")),
                  ("PROTOC_VERSION", ("protoc", "version")), ("PROTOC_URL", ("protoc", "url")),
                  ("PROTOC_SHA256", ("protoc", "sha256"))]:
    value = get(*path)
    if any(c in value for c in "\n\t\x27\x22 $`\\"):
        sys.exit(f"unsafe value for {key} in {sys.argv[1]}")
    print(f"{key}={value}")
' "$HF_SOURCE" 2>&1) || die "cannot read $HF_SOURCE: ${lines##*$'\n'}"
    while IFS='=' read -r key value; do
        case $key in
            RUNTIME_URL | RUNTIME_REV | FLASHINFER_URL | FLASHINFER_REV | TORCH_VERSION | TORCHVISION_VERSION | \
                RUST_VERSION | RUSTUP_SHA256 | RUSTUP_URL | PROTOC_VERSION | PROTOC_URL | PROTOC_SHA256)
                printf -v "$key" '%s' "$value"
                ;;
        esac
    done <<<"$lines"
    local name
    for name in RUNTIME_URL RUNTIME_REV FLASHINFER_URL FLASHINFER_REV RUST_VERSION RUSTUP_URL PROTOC_VERSION PROTOC_URL TORCH_VERSION; do
        [[ -n ${!name} ]] || die "$HF_SOURCE has no value for ${name,,}; these pins cannot be overridden"
    done
    [[ $RUNTIME_REV =~ ^[0-9a-f]{40}$ && $FLASHINFER_REV =~ ^[0-9a-f]{40}$ ]] ||
        die "runtime and flashinfer revisions in $HF_SOURCE must be 40-hex commit ids"
}

# ------------------------------------------------------------------ toolchain selection
find_compilers() {
    GCC_NOTE=""
    find_gcc10 && return 0
    GCC_NOTE="gcc-10/g++-10 are not on PATH: install gcc-10 g++-10 or set OPENJEV_CC and OPENJEV_CXX"
    CC_PATH=gcc-10 CXX_PATH=g++-10
}

default_jobs() {
    local cores mem_kib mem_jobs
    cores=$(nproc 2>/dev/null || echo 1)
    mem_kib=$(awk '/^MemAvailable:/ { print $2 }' /proc/meminfo 2>/dev/null || echo 0)
    mem_jobs=$(((${mem_kib:-0} - 16 * 1024 * 1024) / (4 * 1024 * 1024)))
    ((mem_jobs >= 1)) || mem_jobs=1
    ((mem_jobs < cores)) && cores=$mem_jobs
    echo "$cores"
}

# ------------------------------------------------------------------ the plan (data)
# Each step: a stage name, a shell command string and an optional "already done" test string.
# Strings are built with shell quoting (q) so that printing them shows exactly what eval runs.
STAGES=()
COMMANDS=()
DONE_TESTS=()
NEEDS_PIN=()

q() {
    local out="" arg
    for arg in "$@"; do
        out+="${out:+ }$(printf '%q' "$arg")"
    done
    printf '%s' "$out"
}

step() { # step STAGE DONE_TEST COMMAND [NEEDS_PIN]
    STAGES+=("$1")
    DONE_TESTS+=("$2")
    COMMANDS+=("$3")
    NEEDS_PIN+=("${4:-}")
}

# `git apply --check` then `git apply`, both skipped when the patch is already applied.
patch_steps() { # patch_steps STAGE REPO PATCH
    local stage=$1 repo=$2 patch=$3 applied
    applied="$(q git -C "$repo" apply --reverse --check "$patch") 2>/dev/null"
    step "$stage" "$applied" "$(q git -C "$repo" apply --check "$patch")"
    step "$stage" "$applied" "$(q git -C "$repo" apply "$patch")"
}

# The pinned revision checked out in REPO (fetched from URL with its tags), then verified.
checkout_steps() { # checkout_steps STAGE URL REPO REV
    local stage=$1 url=$2 repo=$3 rev=$4 head have
    head="\"\$(git -C $(q "$repo") rev-parse HEAD 2>/dev/null)\" = $rev"
    have="$(q git -C "$repo" cat-file -e "$rev^{commit}") 2>/dev/null"
    step "$stage" "[ -d $(q "$repo/.git") ]" "$(q git init -q "$repo") && $(q git -C "$repo" remote add origin "$url")"
    step "$stage" "$have" "$(q git -C "$repo" fetch --tags origin)"
    step "$stage" "$have" "$(q git -C "$repo" fetch origin "$rev")"
    step "$stage" "[ $head ]" "if $(q git -C "$repo" rev-parse -q --verify HEAD) >/dev/null; then $(q git -C "$repo" diff --quiet HEAD) || { echo $(q "$repo has local changes and is not at $rev; move it aside") >&2; false; }; fi && $(q git -C "$repo" checkout -q --detach "$rev")"
    step "$stage" "" "[ $head ] || { echo $(q "$repo is not at the pinned revision $rev") >&2; false; }"
}

# Fingerprint of a checkout: HEAD and the hash of its working-tree diff (patches included).
tree_fingerprint() { printf '{ git -C %s rev-parse HEAD; git -C %s diff HEAD | sha256sum; }' "$(q "$1")" "$(q "$1")"; }

build_plan() {
    local patch name fp kdir_expr jobs pip
    pip="$(q "$PY") -m pip"
    jobs=${MAX_JOBS:-$(default_jobs)}
    NVCC_THREADS_V=${NVCC_THREADS:-1}

    step preflight "" "$(q "$PY" -B "$PREFLIGHT")"
    step toolchain "" "export $(q "CC=$CC_PATH" "CXX=$CXX_PATH" "CUDAHOSTCXX=$CXX_PATH" "CUDA_HOME=$CUDA_DIR" \
        "CUDACXX=$NVCC" "CUDAToolkit_ROOT=$CUDA_DIR" "RUSTUP_HOME=$ROOT/rustup" "CARGO_HOME=$ROOT/cargo" \
        "PROTOC=$ROOT/protoc/bin/protoc" "TORCH_CUDA_ARCH_LIST=7.0" "MAX_JOBS=$jobs" \
        "CMAKE_BUILD_PARALLEL_LEVEL=$jobs" "NVCC_THREADS=$NVCC_THREADS_V" "PIP_CACHE_DIR=$ROOT/cache/pip" \
        "PIP_DISABLE_PIP_VERSION_CHECK=1" "TMPDIR=$ROOT/tmp") PATH=$(q "$CUDA_DIR/bin:$ROOT/cargo/bin:$ROOT/protoc/bin"):\"\$PATH\""
    step toolchain "" "$(q "$CC_PATH" --version) | head -n 1 && $(q "$CXX_PATH" --version) | head -n 1"
    step toolchain "" "$(q "$NVCC" --version) | tail -n 1"
    step dirs "" "$(q mkdir -p "$ROOT/src" "$BUILD" "$STAMPS" "$DOWNLOADS" "$ROOT/cache/pip" "$ROOT/tmp" "$ROOT/results")"

    # Rust and protoc: private, pinned, verified against HF_SOURCE.json hashes.
    local rust_done protoc_done rustup_init verify
    rust_done="$(q env "RUSTUP_HOME=$ROOT/rustup" "CARGO_HOME=$ROOT/cargo" "$ROOT/cargo/bin/rustc" --version) 2>/dev/null | grep -q $(q "^rustc $RUST_VERSION ")"
    rustup_init=$DOWNLOADS/rustup-init-$(uname -m)
    verify=""
    [[ -n $RUSTUP_SHA256 ]] && verify=" && echo $(q "$RUSTUP_SHA256  $rustup_init.part") | sha256sum -c --quiet -"
    step rust "$rust_done" "$(q curl -fsSL --retry 3 -o "$rustup_init.part" "$RUSTUP_URL")$verify && $(q chmod +x "$rustup_init.part") && $(q mv "$rustup_init.part" "$rustup_init")" rust
    step rust "$rust_done" "$(q "$rustup_init" -y --no-modify-path --profile minimal --default-toolchain "$RUST_VERSION")"
    protoc_done="[ \"\$($(q "$ROOT/protoc/bin/protoc") --version 2>/dev/null)\" = $(q "libprotoc $PROTOC_VERSION") ]"
    local protoc_zip=$DOWNLOADS/protoc-$PROTOC_VERSION.zip
    verify=""
    [[ -n $PROTOC_SHA256 ]] && verify=" && echo $(q "$PROTOC_SHA256  $protoc_zip.part") | sha256sum -c --quiet -"
    step protoc "$protoc_done" "$(q curl -fsSL --retry 3 -o "$protoc_zip.part" "$PROTOC_URL")$verify && $(q mv "$protoc_zip.part" "$protoc_zip")" protoc
    step protoc "$protoc_done" "$(q rm -rf "$BUILD/protoc.new") && $(q "$PY" -m zipfile -e "$protoc_zip" "$BUILD/protoc.new") && $(q chmod +x "$BUILD/protoc.new/bin/protoc") && $(q rm -rf "$ROOT/protoc") && $(q mv "$BUILD/protoc.new" "$ROOT/protoc")"

    # The pinned runtime and the project's patches.
    checkout_steps runtime "$RUNTIME_URL" "$RT" "$RUNTIME_REV"
    PATCHES=()
    if [[ -d $PATCH_DIR ]]; then
        for patch in "$PATCH_DIR"/*.patch; do
            [[ -f $patch ]] && PATCHES+=("$patch")
        done
    fi
    for patch in "${PATCHES[@]}"; do
        patch_steps patches "$RT" "$patch"
    done

    # FlashInfer at its pin with the runtime's SM70 patch, editable install.
    checkout_steps flashinfer "$FLASHINFER_URL" "$FI" "$FLASHINFER_REV"
    step flashinfer "! git -C $(q "$FI") submodule status --recursive | grep -q '^[-+]'" "$(q git -C "$FI" submodule update --init --recursive)"
    FI_PATCH=$RT/patches/flashinfer-sm70.patch
    patch_steps flashinfer "$FI" "$FI_PATCH"
    step build-tools "" "$(q printf '%s\n' "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" "$NCCL_PIN") > $(q "$BUILD/constraints.txt.tmp") && $(q mv "$BUILD/constraints.txt.tmp" "$BUILD/constraints.txt")"
    # shellcheck disable=SC2086 # BUILD_TOOLS is a word list on purpose
    step build-tools "" "$pip install -c $(q "$BUILD/constraints.txt") $(q $BUILD_TOOLS)"
    fp=$(tree_fingerprint "$FI")
    step flashinfer "cmp -s $(q "$STAMPS/flashinfer") <($fp) && $pip show flashinfer-python >/dev/null 2>&1" \
        "$pip install --no-deps --no-build-isolation -e $(q "$FI") && $fp > $(q "$STAMPS/flashinfer")"

    # Minimal SM70 sgl-kernel from the runtime checkout (sgl-kernel/ or python/sglang/kernels/aot).
    kdir_expr="kdir=$(q "$RT/sgl-kernel"); [ -d \"\$kdir\" ] || kdir=$(q "$RT/python/sglang/kernels/aot")"
    local cmake_args="-DSGL_KERNEL_V100_ONLY=ON -DSGL_KERNEL_COMPILE_THREADS=$NVCC_THREADS_V -DCMAKE_CUDA_ARCHITECTURES=70 -DCMAKE_CUDA_COMPILER=$NVCC -DCUDAToolkit_ROOT=$CUDA_DIR"
    fp="{ git -C $(q "$RT") rev-parse HEAD; echo $(q "$cmake_args"); $(q "$CXX_PATH") --version | head -n 1; $(q "$NVCC") --version | tail -n 1; $(q "$PY") -c 'import torch; print(torch.__version__)'; }"
    step sgl-kernel "cmp -s $(q "$STAMPS/sgl-kernel") <($fp) && $pip show sglang-kernel >/dev/null 2>&1" \
        "$kdir_expr; $pip uninstall -y sglang-kernel sgl-kernel >/dev/null 2>&1; find \"\$kdir/python/sgl_kernel\" -type f -name 'common_ops*.so' -delete 2>/dev/null; CMAKE_ARGS=$(q "$cmake_args") $pip install --no-deps --no-build-isolation --config-settings=build-dir=$(q "$BUILD/sgl-kernel") \"\$kdir\" && $fp > $(q "$STAMPS/sgl-kernel")"

    # The runtime itself: dependencies (less what is built here), then the editable install.
    local reqs=$BUILD/runtime-requirements.txt
    # shellcheck disable=SC2016 # the Python one-liner is single-quoted on purpose
    local filter='import re,sys;t=__import__("tomllib") if sys.version_info>=(3,11) else __import__("pip._vendor.tomli",fromlist=["load"]);d=t.load(open(sys.argv[1],"rb"))["project"]["dependencies"];x=set(sys.argv[2].split(","));print("\n".join(r for r in d if re.split(r"[\s<>=!~;\[]",r,maxsplit=1)[0].lower().replace("_","-") not in x))'
    # shellcheck disable=SC2086 # EXTRA_REQUIREMENTS is a word list on purpose
    step runtime-deps "" "$(q "$PY") -c '$filter' $(q "$RT/python/pyproject.toml" "$EXCLUDED_REQUIREMENTS") > $(q "$reqs.tmp") && $(q printf '%s\n' $EXTRA_REQUIREMENTS) >> $(q "$reqs.tmp") && $(q mv "$reqs.tmp" "$reqs")"
    step runtime-deps "" "$pip install -c $(q "$BUILD/constraints.txt") -r $(q "$reqs")"
    fp=$(tree_fingerprint "$RT")
    step runtime-install "cmp -s $(q "$STAMPS/runtime") <($fp) && $pip show sglang >/dev/null 2>&1" \
        "$pip install --no-deps --no-build-isolation -e $(q "$RT/python") && $fp > $(q "$STAMPS/runtime")"
    step nccl "" "$pip uninstall -y nvidia-nccl-cu13 >/dev/null 2>&1; $pip install --no-deps $(q "$NCCL_PIN")"
    step verify "" "$(q "$PY") -B -c 'import torch, sglang, sgl_kernel, flashinfer, tilelang; print(\"torch\", torch.__version__, \"sglang\", sglang.__version__, \"sgl_kernel\", sgl_kernel.common_ops.__file__); assert \"/sm70/\" in sgl_kernel.common_ops.__file__, \"sgl_kernel is not the SM70 build\"'"
    # the built library itself must hold sm_70 code: cuobjdump lists its cubins (recorded in the receipt)
    step kernel-arch "" "lib=\$($(q "$PY") -B -c 'import sgl_kernel; print(sgl_kernel.common_ops.__file__)') && { echo \"# \$lib\"; $(q "$CUOBJDUMP") --list-elf \"\$lib\"; } > $(q "$ELF_LIST") && { grep -q 'sm_70' $(q "$ELF_LIST") || { echo \"sgl-kernel's \$lib holds no sm_70 code (cuobjdump --list-elf lists: \$(grep -o 'sm_[0-9]*[a-z]*' $(q "$ELF_LIST") | sort -u | tr '\\n' ' ')); rebuild it with CMAKE_CUDA_ARCHITECTURES=70\" >&2; false; }; }"

    local receipt_args=(-B "$PREFLIGHT" receipt --out "$RECEIPT" --runtime-src "$RT" --runtime-rev "$RUNTIME_REV"
        --runtime-url "$RUNTIME_URL" --flashinfer-src "$FI" --flashinfer-rev "$FLASHINFER_REV"
        --flashinfer-url "$FLASHINFER_URL" --flashinfer-patch "$FI_PATCH" --cc "$CC_PATH" --cxx "$CXX_PATH"
        --nvcc "$NVCC" --rust-version "$RUST_VERSION" --protoc-version "$PROTOC_VERSION" --steps "$STEP_LOG"
        --elf-list "$ELF_LIST")
    for patch in "${PATCHES[@]}"; do
        receipt_args+=(--patch "$patch")
    done
    ((ALLOW_UNPINNED)) && receipt_args+=(--allow-unpinned)
    step receipt "" "OPENJEV_PREFLIGHT_JSON=\"\$PREFLIGHT_JSON\" PYTHONPATH=$(q "$BUNDLE_ROOT")\${PYTHONPATH:+:\$PYTHONPATH} $(q "$PY" "${receipt_args[@]}")"
}

# ------------------------------------------------------------------ dry run
print_plan() {
    local i total=${#COMMANDS[@]} line
    say "dry run: nothing below is executed. Step 1, the GPU preflight, runs first in a real install: if it fails, the install stops before anything is touched."
    say "root $ROOT; python $PY; pins from $HF_SOURCE: runtime $RUNTIME_REV, flashinfer $FLASHINFER_REV, rust $RUST_VERSION, protoc $PROTOC_VERSION"
    for patch in "${PATCHES[@]}"; do
        say "patch $(basename -- "$patch") sha256 $(sha256sum <"$patch" | cut -d' ' -f1)"
    done
    ((${#PATCHES[@]})) || say "patch directory $PATCH_DIR holds no *.patch files"
    for ((i = 0; i < total; i++)); do
        line=$(printf '%2d. [%s] %s' "$((i + 1))" "${STAGES[i]}" "${COMMANDS[i]}")
        ((i == 0)) && line+="   # runs first; on failure the install stops before anything is touched (not run by --dry-run)"
        [[ -n ${DONE_TESTS[i]} ]] && line+="   # already done if: ${DONE_TESTS[i]}"
        printf '%s\n' "$line"
    done
    [[ -z $GCC_NOTE ]] || say "note: $GCC_NOTE; a real install stops before step 2"
    [[ -x $NVCC ]] || say "note: $NVCC is missing; run prepare_v100_cuda.py $ROOT --version 12.6.3 first (a real install stops before step 2)"
    local name
    for name in RUSTUP_SHA256 PROTOC_SHA256; do
        [[ -n ${!name} ]] && continue
        if ((ALLOW_UNPINNED)); then
            say "note: ${name,,} is null in $HF_SOURCE: that download is used unverified (--allow-unpinned, recorded in the receipt)"
        else
            say "note: ${name,,} is null in $HF_SOURCE: a real install refuses that download unless it is already done (pass --allow-unpinned to override)"
        fi
    done
    return 0
}

# ------------------------------------------------------------------ real run
run_preflight() {
    local out rc=0 line reason="" json=""
    [[ -x $PY ]] || die "preflight failed: no Python interpreter at $PY (create $ROOT/venv with the cu126 torch wheels, or set OPENJEV_PYTHON); nothing was changed"
    out=$("$PY" -B "$PREFLIGHT" 2>&1) || rc=$?
    while IFS= read -r line; do
        case $line in
            "v100_preflight.py: error: "*) reason=${line#v100_preflight.py: error: } ;;
            "{"*) json=$line ;;
        esac
    done <<<"$out"
    if ((rc != 0)); then
        [[ -n $reason ]] || reason="$PY $PREFLIGHT exited with status $rc: ${out##*$'\n'}"
        die "preflight failed: $reason; nothing was changed"
    fi
    [[ -n $json ]] || die "preflight printed no result line; nothing was changed"
    PREFLIGHT_JSON=$json
    say "preflight passed: $PREFLIGHT_JSON"
}

# Read-only checks that must pass before the first change.
check_before_changes() {
    [[ -z $GCC_NOTE ]] || die "$GCC_NOTE"
    [[ -x $NVCC ]] || die "$NVCC is missing; run prepare_v100_cuda.py $ROOT --version 12.6.3 first"
    [[ -x $CUOBJDUMP ]] || die "$CUOBJDUMP is missing (the sm_70 check of sgl-kernel needs it); run prepare_v100_cuda.py $ROOT --version 12.6.3 again: its default components include cuda_cuobjdump"
    local tool
    for tool in git sha256sum cmp grep find; do
        command -v "$tool" >/dev/null 2>&1 || die "$tool is required but not on PATH"
    done
    local i pin_var
    for ((i = 0; i < ${#COMMANDS[@]}; i++)); do
        case ${NEEDS_PIN[i]} in
            rust) pin_var=RUSTUP_SHA256 ;;
            protoc) pin_var=PROTOC_SHA256 ;;
            *) continue ;;
        esac
        eval "${DONE_TESTS[i]}" >/dev/null 2>&1 && continue
        command -v curl >/dev/null 2>&1 || die "curl is required for the ${NEEDS_PIN[i]} download but not on PATH"
        if [[ -z ${!pin_var} ]] && ((!ALLOW_UNPINNED)); then
            die "${pin_var,,} is null in $HF_SOURCE; refusing the unverified ${NEEDS_PIN[i]} download (pass --allow-unpinned to override; it is recorded in the receipt)"
        fi
    done
    return 0
}

# Runs steps 2..N (step 1, the preflight, already ran). Each step is skipped when its
# "already done" test passes. The step log feeds the receipt, which is the last step.
run_plan() {
    local i total=${#COMMANDS[@]} rc t=$'\t'
    local log=("1${t}preflight${t}ran${t}${COMMANDS[0]}")
    for ((i = 1; i < total; i++)); do
        if [[ ${STAGES[i]} == receipt ]]; then
            log+=("$((i + 1))${t}receipt${t}ran${t}${COMMANDS[i]}")
            printf '%s\n' "${log[@]}" >"$STEP_LOG.tmp" && mv -- "$STEP_LOG.tmp" "$STEP_LOG"
        fi
        if [[ -n ${DONE_TESTS[i]} ]] && eval "${DONE_TESTS[i]}" >/dev/null 2>&1; then
            say "[$((i + 1))/$total] ${STAGES[i]}: already done"
            log+=("$((i + 1))${t}${STAGES[i]}${t}already-done${t}${COMMANDS[i]}")
            continue
        fi
        say "[$((i + 1))/$total] ${STAGES[i]}: ${COMMANDS[i]}"
        rc=0
        eval "${COMMANDS[i]}" || rc=$?
        ((rc == 0)) || die "step $((i + 1)) [${STAGES[i]}] failed with exit status $rc: ${COMMANDS[i]}"
        [[ ${STAGES[i]} == receipt ]] || log+=("$((i + 1))${t}${STAGES[i]}${t}ran${t}${COMMANDS[i]}")
    done
}

main() {
    parse_args "$@"
    resolve_paths
    find_compilers
    if ((DRY_RUN)); then
        load_pins
        build_plan
        print_plan
        exit 0
    fi
    # Preflight FIRST: nothing under the root (or anywhere) is touched before it passes.
    run_preflight
    load_pins
    build_plan
    check_before_changes
    run_plan
    say "runtime installed; receipt $RECEIPT"
}

main "$@"
