#!/usr/bin/env bash
# The test command (README): installs what the tests need, brings the local cluster up
# (building it on a cold cache: control plane, real nodes, registry), builds and pushes
# our images (hack/images.sh), runs every test of the workspace — unit, golden, e2e
# against the cluster and its real nodes, and the executors' root tests on the real
# kernel — then brings the cluster down and checks that it left nothing behind.
#
#   bash hack/test.sh [extra cargo test args]
#
# A cluster left running by the demo (bash hack/demo.sh) is replaced: its operator,
# installed by the chart, would reconcile the tests' objects too. Any other running
# cluster is reused and left running.
# PODMOTION_KEEP_CLUSTER=1 leaves a cluster this script started running afterwards.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
run=${PODMOTION_RUN:-/tmp/podmotion-cluster}

step() { echo "== $*" >&2; }

step "dependencies (hack/install-deps.sh)"
bash hack/install-deps.sh

if [[ -f $run/demo ]]; then
  step "the demo's cluster is running with its operator: bringing it down first"
  hack/cluster.sh down
  rm -f "$run/demo"
fi
started=0
if ! hack/cluster.sh status >/dev/null 2>&1; then
  step "cluster up (hack/cluster.sh up)"
  hack/cluster.sh up
  started=1
  # A step that stops this script early (a build error under `set -e`) takes the
  # cluster it started down too; the end below does it and checks for leftovers.
  if [[ ${PODMOTION_KEEP_CLUSTER:-0} != 1 ]]; then
    trap 'hack/cluster.sh down >&2 || true' EXIT
  fi
elif [[ $(cat "$run/real-nodes" 2>/dev/null) == 0 && ${PODMOTION_REAL_NODES:-} != 0 ]]; then
  echo "the running cluster has no real nodes (brought up with REAL_NODES=0), which the" \
    "tests need: bring it down first (hack/cluster.sh down)" >&2
  exit 1
fi
eval "$(hack/cluster.sh env)"

# Executors find CRIU through this (hack/install-criu.sh prints its path last).
if [[ -z ${PODMOTION_CRIU:-} && -f hack/install-criu.sh ]]; then
  PODMOTION_CRIU=$(bash hack/install-criu.sh | tail -n 1)
  export PODMOTION_CRIU
fi

step "images (hack/images.sh): built, pushed to $PODMOTION_REGISTRY"
bash hack/images.sh >"$run/images.txt"
cat "$run/images.txt"
export PODMOTION_IMAGES_VALUES=$run/images-values.yaml PODMOTION_IMAGES_LIST=$run/images.txt

# Every cargo command below keeps `cargo test --workspace`'s feature set: a `-p X`
# selection resolves features for X alone and rebuilds kube, k8s-openapi, tokio and what
# sits on them (.ci/run says more).
step "every binary and test of the workspace (cargo build --workspace --all-targets: the plugin e2e/tests/real_plugin.rs drives, the operator e2e/tests/chart.rs runs, chaos)"
cargo build --workspace --all-targets --locked

step "Argo CD health evaluator (hack/build-argocd-health.sh; e2e/tests/argocd_health.rs runs it; a cold build takes a few minutes)"
bash hack/build-argocd-health.sh >/dev/null

step "cargo test --workspace"
rc=0
# --no-fail-fast: one failing test binary must not hide the others' results.
cargo test --workspace --locked --no-fail-fast "$@" || rc=$?

step "the plugin's krew manifest (hack/krew-check.sh: krew's own validator, then krew install from the release tarball)"
bash hack/krew-check.sh "$run/plugin" || rc=1
step "the quickstart, word for word (hack/quickstart-check.sh runs docs/quickstart.md's blocks on the real nodes)"
bash hack/quickstart-check.sh || rc=1
step "NetworkPolicy enforcement on the real nodes (kube-router; e2e/tests/real_network_policy.rs, real_policy_migration.rs)"
# Enforcement is on only for these tests: the rest of the suite runs as before.
if hack/cluster.sh netpol-up; then
  # Ignored in the workspace run (they need kube-router): run here, and only here.
  cargo test --locked --workspace --test real_network_policy --test real_policy_migration \
    -- --ignored || rc=1
else
  rc=1
fi
hack/cluster.sh netpol-down || rc=1
step "chaos run, short (e2e/src/bin/chaos.rs, docs/reliability.md): two operator replicas, leader SIGKILLed every 4-8 s, 20 % of writes answered 409/429, the API server restarted once, churn of the three kinds; fails on any invariant violation"
# With live migrations (process-level agents on the kwok nodes: root and CRIU, the agent
# and testload binaries next to chaos). Run under `flock -o` if at all: a lock
# descriptor the workload inherits makes CRIU refuse the dump (docs/reliability.md).
"${CARGO_TARGET_DIR:-$root/target}/debug/chaos" --api-restart || rc=1

if [[ $started == 1 && ${PODMOTION_KEEP_CLUSTER:-0} != 1 ]]; then
  step "cluster down, and nothing left behind"
  trap - EXIT
  hack/cluster.sh down || rc=1
  if ! hack/cluster.sh leftovers; then
    echo "hack/cluster.sh down left the above behind" >&2
    rc=1
  fi
fi
exit $rc
