#!/usr/bin/env bash
# The layering as a checked fact: the pure cores (podmotion-core, operator/core) never
# reach the API client, the async runtime, gRPC/HTTP or the wire protocol, and never
# read the clock (time comes into a core as a value). Fails naming each offender:
#   - a forbidden crate anywhere in the core's normal (non-dev) dependency tree;
#   - a clock read in the core's sources;
#   - an API write call in the operator's runtime outside its writer (hack/lib/api-writes.pl).
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

# One door for API writes: in the operator's runtime every create, replace, patch,
# delete (and the finalizer helper's patches, and Events) goes through
# operator/src/writer.rs, which holds the leader's fence. leader.rs writes the Lease
# itself: it is the fence.
writer_ok=(operator/src/writer.rs operator/src/leader.rs)
runtime_files=()
while read -r f; do
  [ -f "$f" ] || continue
  for ok in "${writer_ok[@]}"; do [ "$f" = "$ok" ] && continue 2; done
  runtime_files+=("$f")
done < <(git ls-files --cached --others --exclude-standard 'operator/src/*.rs')
if ! writes=$(perl hack/lib/api-writes.pl "${runtime_files[@]}"); then
  echo "check-layers: API writes outside the writer (operator/src/writer.rs); call the" >&2
  echo "  writer's verb instead (ctx.writer.create/apply/replace/patch/delete/...), so the" >&2
  echo "  leader's fence cannot be forgotten:" >&2
  sed 's/^/    /' <<<"$writes" >&2
  fail=1
fi

if [ "$fail" -ne 0 ]; then
  exit 1
fi
echo "check-layers: $core has none of ${forbidden[*]} in its dependencies and reads no clock"
echo "check-layers: every API write of the operator's runtime goes through operator/src/writer.rs"
