#!/usr/bin/env bash
# The shape of the code as a checked fact (issue 44): no module cycle in any crate, no
# source file over $MAX_LINES lines and no function over $MAX_FN_LINES lines outside
# tests and generated code. Fails naming
# each offender; the allow-lists below hold what was there when the check came, each
# with the issue that removes it, and shrink as the splits land (an allow-listed file
# that is back under the limit, or a cycle that is gone, is reported so its line can go).
#
#   bash hack/check-modules.sh      # .ci/run runs it after hack/check-layers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_LINES=800
MAX_FN_LINES=60
fail=0

# Known cycles, "crate: a -> b -> ... -> a" as hack/lib/modules.pl prints them.
known_cycles=(
)

# Files over the limit (lines before the first `#[cfg(test)]`).
known_large=(
)

# Functions over the limit, "file fn name" (hack/lib/fn-lengths.pl). A table (a match
# that maps each case to its value and does nothing else) may stay, said so here.
known_long_fns=(
  # A table: each arm maps one broker request to its op and the role that op needs.
  "executors/broker/src/ops.rs fn handle"
)

srcs=()
for manifest in $(git ls-files '*Cargo.toml'); do
  dir=$(dirname "$manifest")
  [ -d "$dir/src" ] && srcs+=("$dir/src")
done
if ! printf '%s\n' "${known_cycles[@]}" | perl hack/lib/modules.pl "${srcs[@]}"; then
  echo "check-modules: module cycle (above): move what both sides use below them (a" >&2
  echo "  state/types module the others import), or pass it in; see hack/lib/modules.pl" >&2
  fail=1
fi

is_known_large() {
  local f
  for f in "${known_large[@]}"; do [ "$f" = "$1" ] && return 0; done
  return 1
}
is_known_long_fn() {
  local f
  for f in "${known_long_fns[@]}"; do [ "$f" = "$1" ] && return 0; done
  return 1
}
# Tests (tests/ directories, *tests.rs, testkit, fixtures) and generated code are not
# counted.
counted=()
while read -r f; do
  case "$f" in
    */tests/*|*tests.rs|*/testkit.rs|*/fixtures.rs|*/generated/*|*/fuzz/*) continue ;;
  esac
  counted+=("$f")
  [ -f "$f" ] || continue
  n=$(awk '/^[[:space:]]*#\[cfg\(test\)\]/{exit} {n++} END{print n+0}' "$f")
  if [ "$n" -gt "$MAX_LINES" ]; then
    if is_known_large "$f"; then
      echo "check-modules: $f has $n lines (allow-listed)"
    else
      echo "check-modules: $f has $n lines outside its tests, over $MAX_LINES: split it along its seams" >&2
      fail=1
    fi
  elif is_known_large "$f"; then
    echo "check-modules: $f is under the limit ($n lines): take it off known_large in $0 once its edits land"
  fi
done < <(git ls-files --cached --others --exclude-standard '*.rs')

long_now=()
while read -r loc fn name rest; do
  key="${loc%%:*} fn ${name%:}"
  long_now+=("$key")
  if is_known_long_fn "$key"; then
    echo "check-modules: $loc fn ${name%:} $rest (allow-listed)"
  else
    echo "check-modules: $loc fn ${name%:} has $rest, over $MAX_FN_LINES: split it into named steps" >&2
    fail=1
  fi
done < <(perl hack/lib/fn-lengths.pl "$MAX_FN_LINES" "${counted[@]}")
for k in "${known_long_fns[@]}"; do
  if ! printf '%s\n' "${long_now[@]}" | grep -qxF "$k"; then
    echo "check-modules: $k is under $MAX_FN_LINES lines (or gone): take it off known_long_fns in $0"
  fi
done

if [ "$fail" -ne 0 ]; then
  exit 1
fi
echo "check-modules: no module cycle, no file over $MAX_LINES lines, no function over $MAX_FN_LINES lines (but the allow-listed)"
