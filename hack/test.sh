#!/usr/bin/env bash
# The test command (README): installs what the tests need, brings the local control
# plane up (building it on a cold cache), runs every test of the workspace — unit,
# golden, e2e against the control plane, and the executors' root tests on the real
# kernel — and brings the control plane down again, even when tests fail.
#
#   bash hack/test.sh [extra cargo test args]
#
# PODMOTION_KEEP_CLUSTER=1 leaves the control plane running afterwards.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

bash hack/install-deps.sh

started=0
if ! hack/cluster.sh status >/dev/null 2>&1; then
  hack/cluster.sh up
  started=1
fi
cleanup() {
  if [[ $started == 1 && ${PODMOTION_KEEP_CLUSTER:-0} != 1 ]]; then
    hack/cluster.sh down || true
  fi
}
trap cleanup EXIT
eval "$(hack/cluster.sh env)"

# Executors find CRIU through this (hack/install-criu.sh prints its path last).
if [[ -z ${PODMOTION_CRIU:-} && -f hack/install-criu.sh ]]; then
  PODMOTION_CRIU=$(bash hack/install-criu.sh | tail -n 1)
  export PODMOTION_CRIU
fi

cargo test --workspace --locked "$@"
