# shellcheck shell=bash
# What the bundle's bash scripts share (app/*.sh, deploy/*.sh), sourced after each sets PROG:
# the one-line error convention of the Python scripts (openjev/common.py die), `~` expansion and
# the choice of the GCC 10 host compilers.

# One line on stderr, exit 1: a failure the operator can act on.
die() {
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit 1
}

# One line on stderr, exit 2: the command line itself is wrong.
usage_error() {
    printf '%s: error: %s (see --help)\n' "$PROG" "$*" >&2
    exit 2
}

# PATH with a leading ~ or ~/ made absolute from $HOME.
expand_home() {
    local path=$1 tilde='~'
    if [[ $path == "$tilde" || $path == "$tilde/"* ]]; then
        [[ -n ${HOME:-} ]] || die "HOME is not set; cannot expand $path"
        path=$HOME${path#"$tilde"}
    fi
    printf '%s' "$path"
}

# CC_PATH and CXX_PATH: OPENJEV_CC and OPENJEV_CXX when set (both, executables; else die), or
# gcc-10 and g++-10 on PATH. Returns 1, both empty, when GCC 10 was looked for and is not there.
find_gcc10() {
    CC_PATH="" CXX_PATH=""
    if [[ -n ${OPENJEV_CC:-} || -n ${OPENJEV_CXX:-} ]]; then
        [[ -n ${OPENJEV_CC:-} && -n ${OPENJEV_CXX:-} ]] || die "set both OPENJEV_CC and OPENJEV_CXX, or neither"
        CC_PATH=$(command -v -- "$OPENJEV_CC") || die "OPENJEV_CC='$OPENJEV_CC' is not an executable compiler"
        CXX_PATH=$(command -v -- "$OPENJEV_CXX") || die "OPENJEV_CXX='$OPENJEV_CXX' is not an executable compiler"
        return 0
    fi
    CC_PATH=$(command -v gcc-10 || true)
    CXX_PATH=$(command -v g++-10 || true)
    [[ -n $CC_PATH && -n $CXX_PATH ]] && return 0
    CC_PATH="" CXX_PATH=""
    return 1
}
