# Shared settings for kvguard's scripts. Source it: `. "$(dirname "$0")/lib.sh"`.
# Everything heavy (cargo target dir, the vLLM virtualenv, pip caches) lives outside the
# clone, under KVGUARD_CACHE, so a fresh clone on the same machine does not rebuild from zero.

set -euo pipefail

# usage: prints the calling script's header comment (the lines after `#!` up to the first
# line that is not a comment), without the leading `# `; then, if the script defined a
# function `help_more` before sourcing this file (e.g. a binary's flags), its output.
usage() {
  sed -n '2,/^[^#]/{/^#/!q;s/^# \{0,1\}//;p}' "$0"
  if declare -F help_more >/dev/null; then help_more; fi
}
# Every script answers -h/--help with its usage and does nothing else: a script that
# sources this file with -h or --help among its arguments prints its usage and exits 0
# here, before anything runs.
for _arg in "$@"; do
  case "$_arg" in -h|--help) usage; exit 0 ;; esac
done
unset _arg

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export REPO
export KVGUARD_CACHE=${KVGUARD_CACHE:-$HOME/.cache/kvguard}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$KVGUARD_CACHE/target}
export KVGUARD_VENV=${KVGUARD_VENV:-$REPO/.venv}
export KVGUARD_VLLM_VENV=${KVGUARD_VLLM_VENV:-$KVGUARD_CACHE/vllm-venv}
# The real LLM hops (LiteLLM, vllm-router): scripts/setup-hops; the e2e suites find them here.
export KVGUARD_HOPS_VENV=${KVGUARD_HOPS_VENV:-$KVGUARD_CACHE/hops-venv}
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$KVGUARD_CACHE/pip}
export KVGUARD_FIXTURES=${KVGUARD_FIXTURES:-$REPO/integration/fixtures}
mkdir -p "$KVGUARD_CACHE"
# Tools scripts/setup installs when the machine lacks them (Node.js, cargo-nextest).
export PATH=$KVGUARD_CACHE/bin:$PATH
NEXTEST_VERSION=0.9.143

# The built artefacts the harness uses (see integration/src/paths.rs).
export KVGUARD_WASM=${KVGUARD_WASM:-$CARGO_TARGET_DIR/wasm32-wasip1/release/kvguard_filter.wasm}
# The test build with the `trap-injection` feature (scripts/build; failure_policy tests).
export KVGUARD_TRAP_WASM=${KVGUARD_TRAP_WASM:-$CARGO_TARGET_DIR/wasm32-wasip1/release/kvguard_filter_trap.wasm}
export KVGUARD_CONTROL_BIN=${KVGUARD_CONTROL_BIN:-$CARGO_TARGET_DIR/debug/kvguard-control}
if [ -z "${ENVOY_BIN:-}" ] && [ -x "$KVGUARD_VENV/bin/envoy" ]; then
  export ENVOY_BIN=$KVGUARD_VENV/bin/envoy
fi

# py_env NAME DIR: the virtualenv DIR holds exactly locks/NAME.txt (the whole tree, exact
# versions, every file's sha256; scripts/lock makes it from locks/NAME.in). Installed into an
# emptied DIR with pip --require-hashes --no-deps whenever the lock (or the Python it runs on)
# changed; otherwise checked in about a second against the lock, so a package added or
# changed by hand fails here rather than passing a test a new machine would fail.
py_env() {
  local name=$1 dir=$2 lock=$REPO/locks/$1.txt want
  [ -f "$lock" ] || die "no lock $lock: add locks/$name.in and run scripts/lock $name"
  want="$(sha256sum "$lock" | cut -d' ' -f1) $(python3 -c 'import sys; print(sys.version.split()[0])')"
  if [ "$(cat "$dir/.kvguard-lock" 2>/dev/null)" = "$want" ]; then
    "$dir/bin/python" "$REPO/scripts/lock_check.py" "$lock" ||
      die "$dir differs from locks/$name.txt (installed by hand?): remove $dir and rerun"
    return 0
  fi
  echo "installing the $name environment from locks/$name.txt into $dir (emptied first)"
  rm -rf "$dir"
  python3 -m venv "$dir" || die "python3 -m venv $dir failed (Debian: apt-get install python3-venv)"
  "$dir/bin/python" -m pip install -q --disable-pip-version-check --no-deps --require-hashes -r "$lock" ||
    die "installing locks/$name.txt into $dir failed (a lock made for another Python or platform? scripts/lock $name)"
  "$dir/bin/python" "$REPO/scripts/lock_check.py" "$lock" || die "$dir does not match locks/$name.txt after installing it"
  # Written last: its presence means a whole install (integration/src/vllm.rs and
  # scripts/test-compose look for it).
  echo "$want" > "$dir/.kvguard-lock"
}

_stage_start=0
_stage_name=
# stage NAME: prints a header and, at the next stage or at `stage_end`, the time the last one took.
stage() {
  stage_end
  _stage_name=$1
  _stage_start=$(date +%s)
  printf '\n==> %s\n' "$_stage_name"
}
stage_end() {
  if [ -n "$_stage_name" ]; then
    local secs=$(( $(date +%s) - _stage_start ))
    printf '<== %s: %ss\n' "$_stage_name" "$secs"
    _stage_times+=("$(printf '%6ss  %s' "$secs" "$_stage_name")")
    _stage_name=
  fi
}
_stage_times=()
# stage_summary: every finished stage with its time (after `stage_end`).
stage_summary() {
  printf '\nstage times:\n'
  printf '  %s\n' "${_stage_times[@]}"
}

die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# shrink_wasm FILE: the filter's module through binaryen's wasm-opt -Oz (Debian `binaryen`,
# installed by scripts/setup), in place: ~16% smaller (the module is size-bound, issue 17:
# <= 300 KB; -Oz is 8.7 KB below -O3 for 0.25 % more instructions per request,
# docs/BENCHMARKS.md). The features are exactly
# those rustc's wasm32-wasip1 output uses (its defaults and +simd128 from .cargo/config.toml);
# a module using another fails wasm-opt's validation here rather than in Envoy.
shrink_wasm() {
  command -v wasm-opt >/dev/null 2>&1 || die "wasm-opt not found: run scripts/setup (Debian package binaryen)"
  local before after
  before=$(stat -c %s "$1")
  wasm-opt -Oz --enable-bulk-memory --enable-multivalue --enable-mutable-globals \
    --enable-nontrapping-float-to-int --enable-reference-types --enable-sign-ext --enable-simd \
    "$1" -o "$1.opt" || die "wasm-opt failed on $1"
  mv -f "$1.opt" "$1"
  after=$(stat -c %s "$1")
  echo "wasm-opt -Oz: $1 $before -> $after bytes"
}
