# shellcheck shell=bash
# What the bundle's bash scripts share (app/*.sh, deploy/*.sh), sourced after each sets PROG:
# the one-line error convention of the Python scripts (openjev/common.py die) and `~` expansion.

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
