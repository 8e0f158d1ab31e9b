#!/usr/bin/env bash
# Builds, ahead of their first use, the Go programs a test run needs: the local registry,
# helm, the control plane and kwok, the real nodes' containerd, runc and CNI, the KVM
# device plugin, the Argo CD health evaluator and kube-router. Each is built by the very
# script that its user calls later (hack/registry.sh build, hack/build-helm.sh,
# hack/build-k8s.sh, hack/build-node.sh, hack/build-argocd-health.sh, hack/cluster.sh
# netpol-build); each of those holds a lock while it builds and checks again once it has
# it, so a later call waits for a build under way here and then finds it done. Nothing is
# built twice and nothing is built that the run would not build anyway.
#
# .ci/run starts it in the background at nice 19 before its Rust builds: the Go builds
# then take only the CPU that cargo leaves idle (its dependency graph narrows to one crate
# at a time for minutes: k8s-openapi, the operator, the links) instead of running after
# it on a cold machine. Once a foreground step waits for one of these locks, nothing else
# wants the CPU and the build here gets all of it.
#
#   bash hack/prebuild.sh     prints one line per build (seconds, exit status); exits 1
#                             if any failed (its user will build it again and say why)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
rc=0
for cmd in "registry.sh build" "build-helm.sh" "build-k8s.sh" "build-node.sh" \
  "build-node.sh --device-plugin" "build-argocd-health.sh" "cluster.sh netpol-build"; do
  start=$SECONDS
  # shellcheck disable=SC2086 # a script and its arguments
  if bash "$here"/$cmd >/dev/null; then s=ok; else s=FAILED; rc=1; fi
  echo "[prebuild] hack/$cmd: $s in $((SECONDS - start))s"
done
exit $rc
