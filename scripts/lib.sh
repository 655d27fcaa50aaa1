# Shared settings for kvguard's scripts. Source it: `. "$(dirname "$0")/lib.sh"`.
# Everything heavy (cargo target dir, the vLLM virtualenv, pip caches) lives outside the
# clone, under KVGUARD_CACHE, so a fresh clone on the same machine does not rebuild from zero.

set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export REPO
export KVGUARD_CACHE=${KVGUARD_CACHE:-$HOME/.cache/kvguard}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$KVGUARD_CACHE/target}
export KVGUARD_VENV=${KVGUARD_VENV:-$REPO/.venv}
export KVGUARD_VLLM_VENV=${KVGUARD_VLLM_VENV:-$KVGUARD_CACHE/vllm-venv}
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$KVGUARD_CACHE/pip}
export KVGUARD_FIXTURES=${KVGUARD_FIXTURES:-$REPO/integration/fixtures}
mkdir -p "$KVGUARD_CACHE"
# Tools scripts/setup installs when the machine lacks them (Node.js, cargo-nextest).
export PATH=$KVGUARD_CACHE/bin:$PATH
NODE_WHEEL_VERSION=22.20.0
NEXTEST_VERSION=0.9.143

# The built artefacts the harness uses (see integration/src/paths.rs).
export KVGUARD_WASM=${KVGUARD_WASM:-$CARGO_TARGET_DIR/wasm32-wasip1/release/kvguard_filter.wasm}
# The test build with the `trap-injection` feature (scripts/build; failure_policy tests).
export KVGUARD_TRAP_WASM=${KVGUARD_TRAP_WASM:-$CARGO_TARGET_DIR/wasm32-wasip1/release/kvguard_filter_trap.wasm}
export KVGUARD_CONTROL_BIN=${KVGUARD_CONTROL_BIN:-$CARGO_TARGET_DIR/debug/kvguard-control}
if [ -z "${ENVOY_BIN:-}" ] && [ -x "$KVGUARD_VENV/bin/envoy" ]; then
  export ENVOY_BIN=$KVGUARD_VENV/bin/envoy
fi

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
    printf '<== %s: %ss\n' "$_stage_name" "$(( $(date +%s) - _stage_start ))"
    _stage_name=
  fi
}

die() { printf 'error: %s\n' "$*" >&2; exit 1; }
