#!/usr/bin/env bash
# The layering as a checked fact: the pure cores (podmotion-core, operator/core) never
# reach the API client, the async runtime, gRPC/HTTP or the wire protocol, and never
# read the clock (time comes into a core as a value). Fails naming each offender:
#   - a forbidden crate anywhere in the core's normal (non-dev) dependency tree;
#   - a clock read in the core's sources.
#
#   bash hack/check-layers.sh       # .ci/run runs it after the crdgen check
set -euo pipefail
cd "$(dirname "$0")/.."
core=podmotion-core
core_src=operator/core/src
forbidden=(kube-client kube-runtime tokio tonic hyper podmotion-wire)
clock='(Timestamp|SystemTime|Instant|Zoned|Utc|Local)::now\b|OffsetDateTime::now_'
fail=0

# One line per crate of the resolved tree: "name vX.Y.Z [(path)]".
tree=$(cargo tree -q -p "$core" -e normal --prefix none --format '{p}')
for crate in "${forbidden[@]}"; do
  if grep -q "^$crate v" <<<"$tree"; then
    path=$(cargo tree -q -p "$core" -e normal -i "$crate" --depth 8 2>/dev/null | head -n 12)
    echo "check-layers: $core depends on $crate (forbidden in the pure core); how:" >&2
    sed 's/^/    /' <<<"$path" >&2
    fail=1
  fi
done

if hits=$(grep -rnE "$clock" "$core_src"); then
  echo "check-layers: $core reads the clock (pass the time in as a value):" >&2
  sed 's/^/    /' <<<"$hits" >&2
  fail=1
fi

if [ "$fail" -ne 0 ]; then
  exit 1
fi
echo "check-layers: $core has none of ${forbidden[*]} in its dependencies and reads no clock"
