#!/usr/bin/env bash
# The demo (README's first command): installs what is needed, brings up the local cluster
# (control plane, a local registry, kwok nodes and two real nodes), builds our images and
# pushes them to the local registry, installs the chart from them (hack/install.sh), runs
# a workload on the real nodes, applies the sample resources and shows the result.
#
#   bash hack/demo.sh          run the demo (leaves the cluster and the operator running)
#   bash hack/demo.sh down     stop everything the demo started
#
# The tests (bash hack/test.sh) bring a demo's cluster down before they start.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
run=${PODMOTION_RUN:-/tmp/podmotion-cluster}
t0=$SECONDS

step() { printf '\n== [%3ss] %s\n' "$((SECONDS - t0))" "$*"; }

if [[ ${1:-} == down ]]; then
  rm -f "$run/demo"
  exec hack/cluster.sh down
fi

step "dependencies: CRIU, nftables, helm, image builder (first run: a few minutes)"
bash hack/install-deps.sh >"$run.deps.log" 2>&1 || { tail -n 30 "$run.deps.log"; exit 1; }
echo "ok (log: $run.deps.log)"

step "cluster: control plane, registry, kwok nodes, real nodes (first run builds Kubernetes, containerd, runc and CNI from source: ~15-25 min on 2 cores)"
hack/cluster.sh up
eval "$(hack/cluster.sh env)"
mkdir -p "$run"
touch "$run/demo"

step "images: release build of our binaries, daemonless image build, push to $PODMOTION_REGISTRY (first run: ~10 min)"
bash hack/images.sh >"$run/images.txt"
cat "$run/images.txt"

step "chart: helm upgrade --install from charts/podmotion with those images (hack/install.sh)"
bash hack/install.sh

step "workload: demo/web, two replicas of the testload counter server, one on each real node"
testload=$(grep '/podmotion/testload@sha256:' "$run/images.txt")
sed "s|TESTLOAD_IMAGE|$testload|" hack/demo/workload.yaml | kubectl apply -f -
kubectl -n demo rollout status deployment/web --timeout=180s

step "samples: a NodeAgentAttachment, a PodMigration dry run and a RunnerPool"
pod=$(kubectl -n demo get pods -l app=web -o jsonpath='{.items[0].metadata.name}')
for f in hack/demo/resources/*.yaml; do
  sed "s/PODNAME/$pod/" "$f" | kubectl apply -f -
done
kubectl -n demo wait nodeagentattachment/web-intercept --for=condition=Ready --timeout=120s || true
kubectl -n runners wait runnerpool/runners --for=jsonpath='{.status.observedGeneration}'=1 --timeout=60s || true
kubectl -n demo wait podmigration/can-web-move --for=jsonpath='{.status.phase}'=Failed --timeout=60s >/dev/null 2>&1 || true

step "result"
kubectl get nodes -o wide
echo
kubectl get pods -A -o wide
echo
kubectl get podmotion -A
echo
kubectl -n podmotion-system-agents get jobs -o wide
echo
kubectl -n demo get podmigration can-web-move -o jsonpath='{range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{"\n"}{end}'

cat <<TXT

== What you are looking at ($((SECONDS - t0))s)
- Nodes: pm-real-0 and pm-real-1 are real kubelets, each with its own containerd, runc
  and CNI (type=real, tainted podmotion.io/real-node); pm-node-* are kwok nodes (type=kwok).
- podmotion-system: the operator, from our image ($PODMOTION_REGISTRY/podmotion/operator),
  installed by the chart; podmotion-system-agents: a migration agent + netns broker per real
  node, and one attach Job per ready demo/web replica (the NodeAgentAttachment), Running
  our attach image next to the replica it serves.
- The PodMigration is a dry run (every check, nothing frozen); the RunnerPool targets the
  kwok runner node pm-node-2.

The cluster and the operator keep running: export KUBECONFIG=$KUBECONFIG
Stop everything with: bash hack/demo.sh down
TXT
