#!/usr/bin/env bash
# The demo (README's first command): brings up the local control plane, installs the
# CRDs, builds and starts the operator against it, applies a workload and the sample
# resources, and shows what the operator made of them.
#
#   bash hack/demo.sh          run the demo (leaves the cluster and operator running)
#   bash hack/demo.sh down     stop the operator and the cluster
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
run=${PODMOTION_RUN:-/tmp/podmotion-cluster}

if [[ ${1:-} == down ]]; then
  if [[ -f $run/pids/operator.pid ]]; then
    kill "$(cat "$run/pids/operator.pid")" 2>/dev/null || true
    rm -f "$run/pids/operator.pid"
  fi
  exec hack/cluster.sh down
fi

hack/cluster.sh up
eval "$(hack/cluster.sh env)"

echo "== CRDs"
kubectl apply --server-side -f crds/
kubectl wait --for=condition=Established --timeout=60s -f crds/

echo "== operator"
cargo build -q -p podmotion-operator
kubectl create namespace podmotion-system --dry-run=client -o yaml | kubectl apply -f -
if [[ -f $run/pids/operator.pid ]] && kill -0 "$(cat "$run/pids/operator.pid")" 2>/dev/null; then
  kill "$(cat "$run/pids/operator.pid")"
  sleep 1
fi
mkdir -p "$run/pids" "$run/logs"
POD_NAMESPACE=podmotion-system PODMOTION_HTTP_ADDR=127.0.0.1:18080 \
  nohup target/debug/podmotion-operator >"$run/logs/operator.log" 2>&1 &
echo $! >"$run/pids/operator.pid"
for _ in $(seq 60); do
  curl -sf http://127.0.0.1:18080/readyz >/dev/null && break
  sleep 1
done
curl -sf http://127.0.0.1:18080/readyz >/dev/null || { tail -n 30 "$run/logs/operator.log"; exit 1; }
echo "operator ready (logs: $run/logs/operator.log, metrics: http://127.0.0.1:18080/metrics)"

echo "== workload and samples"
kubectl apply -f hack/demo/workload.yaml
kubectl -n demo rollout status deployment/web --timeout=90s
pod=$(kubectl -n demo get pods -l app=web -o jsonpath='{.items[0].metadata.name}')
for f in hack/demo/resources/*.yaml; do
  sed "s/PODNAME/$pod/" "$f" | kubectl apply -f -
done
kubectl -n runners wait runnerpool/runners --for=jsonpath='{.status.observedGeneration}'=1 --timeout=60s || true
kubectl -n demo wait nodeagentattachment/web-intercept --for=condition=Ready --timeout=60s || true

echo "== result"
kubectl get nodes
kubectl get podmotion -A
echo
kubectl -n podmotion-system get jobs -o wide
kubectl -n runners get daemonset,networkpolicy,poddisruptionbudget,serviceaccount -l app.kubernetes.io/managed-by=podmotion
echo
kubectl -n demo get podmigration can-web-move -o jsonpath='{range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{"\n"}{end}'
echo
echo "The cluster and the operator keep running: export KUBECONFIG=$KUBECONFIG"
echo "Stop both with: bash hack/demo.sh down"
