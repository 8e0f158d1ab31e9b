#!/usr/bin/env bash
# The demo (README's first command): installs what is needed, brings up the local cluster
# (control plane, a local registry, kwok nodes, two real nodes and a real runner node),
# builds our images and
# pushes them to the local registry, installs the chart from them (hack/install.sh), runs
# a workload on the real nodes, applies the sample resources and shows the result.
#
#   bash hack/demo.sh          run the demo (leaves the cluster and the operator running)
#   bash hack/demo.sh down     stop everything the demo started
#
# Each step prints a line when it starts and when it ends (with its duration). The long
# ones (dependencies, cluster, images, chart) also keep their output in
# ${PODMOTION_RUN:-/tmp/podmotion-cluster}.<step>.log; the cluster, image and chart steps
# show it as it comes, and each of those four prints a heartbeat after 30 s without output.
# At the end: each sample's Ready condition, what you are looking at, where to look next.
#
# The tests (bash hack/test.sh) bring a demo's cluster down before they start.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
run=${PODMOTION_RUN:-/tmp/podmotion-cluster}
t0=$SECONDS

# Every step prints a line when it starts and one when it ends, with its duration.
current="" current_t=0
step_done() {
  [[ -n $current ]] || return 0
  printf -- '-- done in %ss: %s\n' "$((SECONDS - current_t))" "$current"
  current=""
}
step() {
  step_done
  current=$1 current_t=$SECONDS
  printf '\n== [%3ss] %s\n' "$((SECONDS - t0))" "$*"
}

# Runs "$@" with stdout and stderr appended to the log $1, and shows progress: the log's
# lines as they come (or, with --quiet, none), and every 30 s without a new line a
# heartbeat with the time so far and the log's last line — a cold build can be silent
# for minutes (go build, a Kubernetes build). Returns the command's exit status.
run_logged() { # [--quiet] log command...
  local quiet=0
  if [[ $1 == --quiet ]]; then quiet=1; shift; fi
  local log=$1; shift
  : >"$log"
  "$@" >>"$log" 2>&1 &
  local pid=$! start=$SECONDS tailer="" size=0 new last_change=$SECONDS rc=0 last
  if [[ $quiet == 0 ]]; then
    tail -n +1 -f --pid="$pid" "$log" &
    tailer=$!
  fi
  while kill -0 "$pid" 2>/dev/null; do
    sleep 2
    new=$(stat -c %s "$log" 2>/dev/null || echo 0)
    if [[ $new != "$size" ]]; then
      size=$new last_change=$SECONDS
    elif ((SECONDS - last_change >= 30)); then
      last=$(tail -n 1 "$log" 2>/dev/null | cut -c1-100)
      printf '   ... still running (%ss)%s\n' "$((SECONDS - start))" "${last:+; last: $last}"
      last_change=$SECONDS
    fi
  done
  wait "$pid" || rc=$?
  [[ -z $tailer ]] || wait "$tailer" 2>/dev/null || true
  return "$rc"
}

if [[ ${1:-} == down ]]; then
  rm -f "$run/demo"
  exec hack/cluster.sh down
fi

step "dependencies: CRIU, nftables, helm, image builder (first run: a few minutes)"
run_logged --quiet "$run.deps.log" bash hack/install-deps.sh || { tail -n 30 "$run.deps.log"; exit 1; }
echo "ok (log: $run.deps.log)"

# The images' Rust binaries compile meanwhile, at nice 19: on a cold machine they take
# the CPU the cluster's Go builds leave idle, and the images step finds them built (or
# waits for that build's lock). Its own process group, ended if the demo stops first.
setsid nice -n 19 bash hack/images.sh --binaries >"$run.binaries.log" 2>&1 </dev/null &
binaries=$!
trap 'kill -- -"$binaries" 2>/dev/null || true' EXIT

step "cluster: control plane, registry, kwok nodes, real nodes (first run builds Kubernetes, containerd, runc and CNI from source: ~15-25 min on 2 cores)"
run_logged "$run.cluster.log" hack/cluster.sh up || { echo "hack/cluster.sh up failed (log: $run.cluster.log)"; exit 1; }
eval "$(hack/cluster.sh env)"
# A cluster brought up before runner nodes existed gets them now (no-op otherwise).
run_logged "$run.cluster.log" hack/cluster.sh add-runner-nodes || { echo "hack/cluster.sh add-runner-nodes failed (log: $run.cluster.log)"; exit 1; }
mkdir -p "$run"
touch "$run/demo"

step "images: release build of our binaries, daemonless image build, push to $PODMOTION_REGISTRY (first run: ~10 min)"
# stdout (the image references) to images.txt; cargo's and buildah's progress shown.
# shellcheck disable=SC2016 # $1 is sh's, not ours
run_logged "$run.images.log" sh -c 'exec bash hack/images.sh >"$1"' images "$run/images.txt" ||
  { echo "hack/images.sh failed (log: $run.images.log)"; exit 1; }
cat "$run/images.txt"

step "chart: pushed to the registry as an OCI artifact, helm upgrade --install from there with those images (hack/install.sh)"
run_logged "$run.install.log" bash hack/install.sh || { echo "hack/install.sh failed (log: $run.install.log)"; exit 1; }

step "workload: demo/web, two replicas of the testload counter server, one on each real node; demo/mover, one replica"
testload=$(grep '/podmotion/podmotion-testload@sha256:' "$run/images.txt")
sed "s|TESTLOAD_IMAGE|$testload|" hack/demo/workload.yaml | kubectl apply -f -
kubectl -n demo rollout status deployment/web --timeout=180s
kubectl -n demo rollout status deployment/mover --timeout=180s

# The counter of a testload pod, read over TCP (`get`).
counter() { # pod-ip
  local v=""
  exec 3<>"/dev/tcp/$1/8080" && echo get >&3 && read -r -t 10 v <&3
  exec 3<&- 3>&-
  echo "$v"
}

step "samples: a NodeAgentAttachment, a real PodMigration, a PodMigration dry run and a RunnerPool"
runner=$(grep '/podmotion/podmotion-runner-standin@sha256:' "$run/images.txt")
pod=$(kubectl -n demo get pods -l app=web -o jsonpath='{.items[0].metadata.name}')
mover=$(kubectl -n demo get pods -l app=mover -o jsonpath='{.items[0].metadata.name}')
mover_node=$(kubectl -n demo get pod "$mover" -o jsonpath='{.spec.nodeName}')
mover_ip=$(kubectl -n demo get pod "$mover" -o jsonpath='{.status.podIP}')
before=$(counter "$mover_ip" || true)
for f in hack/demo/resources/*.yaml; do
  sed -e "s/PODNAME/$pod/" -e "s/MOVERPOD/$mover/" -e "s|RUNNER_IMAGE|$runner|" "$f" | kubectl apply -f -
done
kubectl -n demo wait podmigration/move-mover --for=jsonpath='{.status.phase}'=Succeeded --timeout=300s || true
kubectl -n demo wait nodeagentattachment/web-intercept --for=condition=Ready --timeout=120s || true
kubectl -n runners wait runnerpool/runners --for=condition=Ready --timeout=240s || true
kubectl -n demo wait podmigration/can-web-move --for=jsonpath='{.status.phase}'=Succeeded --timeout=60s >/dev/null 2>&1 || true

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
echo
kubectl -n demo get podmigration move-mover -o wide
echo
kubectl -n runners get runnerpool runners -o wide
runner_pod=$(kubectl -n runners get pods -l app.kubernetes.io/name=runner,app.kubernetes.io/instance=runners -o jsonpath='{.items[0].metadata.name}' 2>/dev/null || true)
if [[ -n $runner_pod ]]; then
  echo "runner $runner_pod, as probed from inside the pod (stand-in's report):"
  kubectl -n runners logs "$runner_pod" -c runner 2>/dev/null | head -n1 | jq -c '{ok, checks: [.checks[] | {(.name): .ok}] | add, facts: .facts | {ids, kvm_owner, kvm_mode, kvm_api_version, uid_map}}' 2>/dev/null || true
fi
target=$(kubectl -n demo get podmigration move-mover -o jsonpath='{.status.targetPod}')
after=""
if [[ -n $target ]]; then
  target_ip=$(kubectl -n demo get pod "$target" -o jsonpath='{.status.podIP}' 2>/dev/null || true)
  target_node=$(kubectl -n demo get pod "$target" -o jsonpath='{.spec.nodeName}' 2>/dev/null || true)
  [[ -n $target_ip ]] && after=$(counter "$target_ip" || true)
fi
echo "mover: pod $mover on $mover_node, counter $before before the migration"
echo "       pod ${target:-?} on ${target_node:-?}, counter ${after:-?} after it (same process, moved)"

step_done

# One line per sample: its Ready condition as the operator wrote it.
ready_line() { # namespace kind/name
  kubectl -n "$1" get "$2" -o jsonpath='{range .status.conditions[?(@.type=="Ready")]}Ready={.status} {.reason}: {.message}{end}' 2>/dev/null || echo "(not found)"
}
echo
echo "== The samples now"
for s in demo:podmigration/move-mover demo:podmigration/can-web-move demo:nodeagentattachment/web-intercept runners:runnerpool/runners; do
  printf '%-38s %s\n' "${s#*:}" "$(ready_line "${s%%:*}" "${s#*:}")"
done

cat <<TXT

== What you are looking at ($((SECONDS - t0))s)
- Nodes: pm-real-0 and pm-real-1 are real kubelets, each with its own containerd, runc
  and CNI (type=real, tainted podmotion.io/real-node); pm-node-* are kwok nodes (type=kwok).
- podmotion-system: the operator, from our image ($PODMOTION_REGISTRY/podmotion/podmotion-operator),
  installed by the chart; podmotion-system-agents: a migration agent + netns broker per real
  node, and one attach Job per ready demo/web replica (the NodeAgentAttachment), Running
  our attach image next to the replica it serves.
- move-mover live-migrated the demo/mover pod (a real container, 16 MiB of state) to the
  other real node: checkpointed by CRIU in the agent, restored into the target pod, probed
  and handed to the ReplicaSet; its counter kept counting. can-web-move is a dry run
  (every check, nothing frozen).
- The RunnerPool runs a Runner on the real runner node pm-real-2 (type=runner, tainted
  podmotion.io/runner-node=real, our KVM device plugin, the Runner's seccomp profile):
  hostUsers: false, procMount: Unmasked, Localhost seccomp, no capability. Its Runner is
  our stand-in (the Compass Runner does not exist here), which opened /dev/kvm, created a
  user namespace and mounted a fresh /proc from inside the pod (report above).

== Where to look next (export KUBECONFIG=$KUBECONFIG first)
  kubectl get podmotion -A -o wide                       every PodMotion object, one line each
  kubectl -n demo describe podmigration move-mover       phases, conditions, downtime, the operator's events
  kubectl -n demo get nodeagentattachment web-intercept -o yaml   ready/skipped replicas and why
  kubectl -n podmotion-system-agents get jobs,pods -o wide        the agents: per node and per replica
  kubectl -n runners describe runnerpool runners         the pool's DaemonSet, capacity, preflight
  kubectl -n podmotion-system logs deploy/podmotion --tail=50     the operator's log
  docs/kubectl.md: printer columns, conditions, kubectl wait, kstatus and Argo CD health

The cluster and the operator keep running: export KUBECONFIG=$KUBECONFIG
Stop everything with: bash hack/demo.sh down
TXT
