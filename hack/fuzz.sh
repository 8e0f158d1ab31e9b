#!/usr/bin/env bash
# Coverage-guided fuzzing of the broker (libFuzzer through libfuzzer-sys), on STABLE
# Rust: this sets the sanitizer-coverage flags that `cargo fuzz` would set, so no
# nightly toolchain is needed. Two targets, the time split between them:
#   decode_request  the frame length check and the decoder/validator (a third);
#   dispatch        the op dispatcher over a simulated node, invariants checked after
#                   every op (two thirds).
#
#   bash hack/fuzz.sh [SECONDS]     # total, default 60; .ci/run runs it time-boxed
#
# Each target starts from its committed seed corpus (executors/broker/fuzz/corpus/<target>/,
# never modified by a run: new inputs go to a scratch directory, printed at the end),
# fails on any crash, panic, timeout or leak (libFuzzer's exit status), and prints the
# run's figures: executions, executions per second, coverage (edges) and features.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
cache=${PODMOTION_CACHE:-$HOME/.cache/podmotion}
export CARGO_TARGET_DIR=$cache/fuzz-target
manifest=executors/broker/fuzz/Cargo.toml
flags=(
  --cfg fuzzing
  -Cpasses=sancov-module
  -Cllvm-args=-sanitizer-coverage-level=4
  -Cllvm-args=-sanitizer-coverage-inline-8bit-counters
  -Cllvm-args=-sanitizer-coverage-pc-table
  -Cllvm-args=-sanitizer-coverage-trace-compares
  -Cdebug-assertions
  -Coverflow-checks
)
echo "[fuzz] building decode_request and dispatch (stable $(rustc --version | cut -d' ' -f2), release, sanitizer coverage)" >&2
# An explicit --target keeps the flags off build scripts and proc macros (they run on
# the host and must not be instrumented), as cargo-fuzz does.
host=$(rustc -vV | awk '$1 == "host:" {print $2}')
RUSTFLAGS="${flags[*]}" cargo build -q --release --target "$host" --manifest-path "$manifest" \
  --bin decode_request --bin dispatch
work=$(mktemp -d /tmp/podmotion-fuzz.XXXXXX)
failed=0
# run TARGET SECONDS MAX_LEN
run() {
  local target=$1 t=$2 max_len=$3
  local bin=$CARGO_TARGET_DIR/$host/release/$target
  local seeds=executors/broker/fuzz/corpus/$target
  local dir=$work/$target
  mkdir -p "$dir/corpus" "$dir/artifacts"
  local log=$dir/fuzz.log
  echo "[fuzz] $target: running ${t}s from $(find "$seeds" -type f | wc -l) seeds; scratch $dir" >&2
  set +e
  "$bin" "$dir/corpus" "$seeds" \
    -max_total_time="$t" -max_len="$max_len" -timeout=5 -rss_limit_mb=1024 \
    -print_final_stats=1 -artifact_prefix="$dir/artifacts/" >"$log" 2>&1
  local rc=$?
  set -e
  stat() { awk -v k="$1" '$1 == k":" {print $2}' "$log" | tail -1; }
  local last
  last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  echo "[fuzz] $target: exit $rc; runs $(stat stat::number_of_executed_units); execs/s $(stat stat::average_exec_per_sec); peak RSS $(stat stat::peak_rss_mb) MB" >&2
  echo "[fuzz] $target: last status: $last" >&2
  echo "[fuzz] $target: corpus grew to $(find "$dir/corpus" -type f | wc -l) new inputs in $dir/corpus" >&2
  if [[ $rc -ne 0 ]]; then
    tail -40 "$log" >&2
    echo "[fuzz] $target FAILED: crash input(s) in $dir/artifacts/" >&2
    failed=1
  fi
}
# The time box is the total: a third to the decoder, the rest to the dispatcher.
t1=$(( secs / 3 > 0 ? secs / 3 : 1 ))
t2=$(( secs - t1 > 0 ? secs - t1 : 1 ))
run decode_request "$t1" 17000
# 64 ops of 3 bytes each: what the dispatch target reads of an input.
run dispatch "$t2" 192
exit $failed
