#!/usr/bin/env bash
# Coverage-guided fuzzing of the broker's frame decoder and validator (libFuzzer through
# libfuzzer-sys), on STABLE Rust: this sets the sanitizer-coverage flags that
# `cargo fuzz` would set, so no nightly toolchain is needed.
#
#   bash hack/fuzz.sh [SECONDS]     # default 60; .ci/run runs it time-boxed
#
# Starts from the committed seed corpus (executors/broker/fuzz/corpus/decode_request/,
# never modified by a run: new inputs go to a scratch directory, printed at the end),
# fails on any crash, panic, timeout or leak (libFuzzer's exit status), and prints the
# run's figures: executions, executions per second, coverage (edges) and features.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
cache=${PODMOTION_CACHE:-$HOME/.cache/podmotion}
export CARGO_TARGET_DIR=$cache/fuzz-target
manifest=executors/broker/fuzz/Cargo.toml
seeds=executors/broker/fuzz/corpus/decode_request
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
echo "[fuzz] building decode_request (stable $(rustc --version | cut -d' ' -f2), release, sanitizer coverage)" >&2
# An explicit --target keeps the flags off build scripts and proc macros (they run on
# the host and must not be instrumented), as cargo-fuzz does.
host=$(rustc -vV | awk '$1 == "host:" {print $2}')
RUSTFLAGS="${flags[*]}" cargo build -q --release --target "$host" --manifest-path "$manifest" --bin decode_request
bin=$CARGO_TARGET_DIR/$host/release/decode_request
work=$(mktemp -d /tmp/podmotion-fuzz.XXXXXX)
mkdir -p "$work/corpus" "$work/artifacts"
log=$work/fuzz.log
echo "[fuzz] running ${secs}s from $(find "$seeds" -type f | wc -l) seeds; scratch $work" >&2
set +e
"$bin" "$work/corpus" "$seeds" \
  -max_total_time="$secs" -max_len=17000 -timeout=5 -rss_limit_mb=1024 \
  -print_final_stats=1 -artifact_prefix="$work/artifacts/" >"$log" 2>&1
rc=$?
set -e
stat() { awk -v k="$1" '$1 == k":" {print $2}' "$log" | tail -1; }
last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
echo "[fuzz] exit $rc; runs $(stat stat::number_of_executed_units); execs/s $(stat stat::average_exec_per_sec); peak RSS $(stat stat::peak_rss_mb) MB" >&2
echo "[fuzz] last status: $last" >&2
echo "[fuzz] corpus grew to $(find "$work/corpus" -type f | wc -l) new inputs in $work/corpus" >&2
if [[ $rc -ne 0 ]]; then
  tail -40 "$log" >&2
  echo "[fuzz] FAILED: crash input(s) in $work/artifacts/" >&2
  exit 1
fi
