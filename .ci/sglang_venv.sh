#!/bin/sh
# sglang_venv.sh VERSION [VERSION ...]: build/sglang-venvs/VERSION from requirements-sglang-VERSION.txt.
# Every package is pinned in that file and installed with --no-deps (nothing resolved at install
# time, nothing edited after). Each venv is reused while its stamp (the sha256 of its requirement
# file) matches.
#
# Shared base (several versions): the lines that every named version's file pins identically
# (torch, its nvidia libraries, triton, ...: most of the ~7 GB) are installed once into
# build/sglang-venvs/.base; a version venv is then a hard-linked copy of the base (`cp -al`: no
# second copy on disk, the base is never written through it) plus `pip install --no-deps` of its
# own remaining lines. The result holds the same wheels at the same versions as installing the whole
# file; only the base's own path in bin/ scripts and pyvenv.cfg is rewritten to the venv's (sed -i
# writes new files, so the base keeps its own).
#
# pip installs with --no-compile: the tests run with PYTHONPYCACHEPREFIX (tests/conftest.py), so the
# __pycache__ pip would write into site-packages is never read (compiling it was half of the install).
#
# When a venv cannot be made here (no index, no disk), it writes build/sglang-venvs/VERSION.unavailable
# with the reason and goes on, so `make test` skips that version with the reason;
# OPENJEV_SGLANG_REQUIRED=1 (CI) makes that a failure instead (exit 1).
set -u
py=${PYTHON:-python3}
root=build/sglang-venvs
[ $# -ge 1 ] || { echo "usage: sh .ci/sglang_venv.sh VERSION [VERSION ...]" >&2; exit 2; }

# A requirement file's package lines, normalised: no comments or blank lines, sorted.
reqs() { sed -e 's/[[:space:]]*#.*$//' -e 's/[[:space:]]*$//' "$1" | grep -v '^$' | LC_ALL=C sort -u; }
now() { date +%s; }

mkdir -p "$root" || { echo "sglang_venv: error: cannot create $root" >&2; exit 1; }
rootabs=$(cd "$root" && pwd -P)
todo=""
for v in "$@"; do
  req=requirements-sglang-$v.txt
  [ -f "$req" ] || { echo "sglang_venv: error: $req does not exist" >&2; exit 2; }
  want=$(sha256sum "$req" | cut -d' ' -f1)
  if [ -x "$root/$v/bin/python" ] && [ "$(cat "$root/$v/.stamp" 2>/dev/null)" = "$want" ]; then
    echo "sglang venv $v: reused ($root/$v, stamp matches $req)"; rm -f "$root/$v.unavailable"
  else
    todo="$todo $v"
  fi
done
[ -n "$todo" ] || exit 0

failed=0
fail() {  # fail VERSION REASON
  echo "$2" >"$root/$1.unavailable"; rm -rf "${root:?}/$1"
  echo "sglang venv $1: unavailable: $2" >&2
  failed=1
}

# ---- the shared base: lines common to every named version (only with two or more versions)
base=""
if [ $# -ge 2 ]; then
  common=$(mktemp); tmp=$(mktemp)
  reqs "requirements-sglang-$1.txt" >"$common"
  for v in "$@"; do reqs "requirements-sglang-$v.txt" | LC_ALL=C comm -12 "$common" - >"$tmp"; cp "$tmp" "$common"; done
  rm -f "$tmp"
  if [ -s "$common" ]; then
    bwant=$(sha256sum "$common" | cut -d' ' -f1)
    if [ -x "$root/.base/bin/python" ] && [ "$(cat "$root/.base/.stamp" 2>/dev/null)" = "$bwant" ]; then
      echo "sglang venv base: reused ($(wc -l <"$common") packages common to: $*)"; base=$root/.base
    else
      rm -rf "$root/.base"
      echo "sglang venv base: installing the $(wc -l <"$common") packages pinned alike for $* into $root/.base"
      start=$(now)
      if "$py" -m venv "$root/.base" && cp "$common" "$root/.base/requirements.txt" &&
        "$root/.base/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
          -r "$root/.base/requirements.txt" >"$root/base.install.log" 2>&1; then
        echo "$bwant" >"$root/.base/.stamp"; base=$root/.base
        echo "sglang venv base: ready in $(( $(now) - start )) s"
      else
        echo "sglang venv base: failed (log: $root/base.install.log: $(grep -m1 ERROR "$root/base.install.log" 2>/dev/null)); installing each version whole" >&2
        rm -rf "$root/.base"
      fi
    fi
  fi
  rm -f "$common"
fi

# ---- each version: base copy + its own lines, or the whole file
for v in $todo; do
  req=requirements-sglang-$v.txt
  dir=$root/$v
  want=$(sha256sum "$req" | cut -d' ' -f1)
  rm -rf "$dir" "$root/$v.unavailable"
  start=$(now)
  own=$(mktemp)
  if [ -n "$base" ]; then
    reqs "$req" | LC_ALL=C comm -23 - "$base/requirements.txt" >"$own"
    echo "sglang venv $v: hard-linked copy of the base + $(wc -l <"$own") packages of its own from $req"
    if ! cp -al "$base" "$dir"; then fail "$v" "cp -al $base $dir failed"; rm -f "$own"; continue; fi
    rm -f "$dir/.stamp" "$dir/requirements.txt"
    for f in "$dir"/bin/* "$dir/pyvenv.cfg"; do
      [ -f "$f" ] && [ ! -L "$f" ] && grep -q "$rootabs/.base" "$f" 2>/dev/null &&
        sed -i "s|$rootabs/.base|$rootabs/$v|g" "$f"
    done
  else
    reqs "$req" >"$own"
    echo "sglang venv $v: installing $req into $dir (a few minutes, ~7 GB: torch's CUDA wheel)"
    if ! "$py" -m venv "$dir"; then fail "$v" "python -m venv failed"; rm -f "$own"; continue; fi
  fi
  if ! "$dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile -r "$own" >"$dir.install.log" 2>&1; then
    fail "$v" "pip install --no-deps -r $req failed (log: $dir.install.log: $(grep -m1 ERROR "$dir.install.log"))"
    rm -f "$own"; continue
  fi
  rm -f "$own"
  # the import check compiles what SGLang loads into the tests' bytecode folder, where they reuse it
  if ! PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$(pwd -P)/build/pycache} \
    "$dir/bin/python" -c "import sglang, sglang.srt.server_args, sglang.srt.models.registry; assert sglang.__version__ == '$v', sglang.__version__" \
    >>"$dir.install.log" 2>&1; then
    fail "$v" "sglang $v does not import in $dir (log: $dir.install.log)"; continue
  fi
  echo "$want" >"$dir/.stamp"
  echo "sglang venv $v: ready in $(( $(now) - start )) s"
done
if [ "$failed" = 1 ] && [ "${OPENJEV_SGLANG_REQUIRED:-0}" = 1 ]; then exit 1; fi
exit 0
