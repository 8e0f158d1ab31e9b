#!/usr/bin/env bash
# Installs (or upgrades) the PodMotion chart into the local cluster the way a user does:
# `helm upgrade --install` of the chart pulled from the registry as an OCI artifact,
# pinned by digest (charts/podmotion of this tree, packaged and pushed first by
# hack/lib/chart.sh — an unchanged chart keeps its digest), with our own images pinned by
# digest (the values file hack/images.sh writes) and placed on the real nodes.
#
#   bash hack/install.sh [extra helm args...]
#
# Environment:
#   PODMOTION_RELEASE     release name (default podmotion)
#   PODMOTION_NAMESPACE   release namespace (default podmotion-system; the agents go to
#                         <namespace>-agents)
#   PODMOTION_IMAGES_VALUES  values file pinning the images (default
#                         $PODMOTION_RUN/images-values.yaml; built by hack/images.sh when
#                         missing)
#   PODMOTION_CHART       chart to install instead of the pushed one (a directory or an
#                         oci:// reference)
#
# --take-ownership: CRDs kept from an earlier release (crds.keep) are adopted, as an
# upgrade from a manual or another release's install would.
#
# The real nodes carry the taint podmotion.io/real-node=true:NoSchedule (so the kwok-based
# tests never land there); the operator and the migration agents tolerate it and select
# type=real.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
run=${PODMOTION_RUN:-/tmp/podmotion-cluster}
release=${PODMOTION_RELEASE:-podmotion}
namespace=${PODMOTION_NAMESPACE:-podmotion-system}
values=${PODMOTION_IMAGES_VALUES:-$run/images-values.yaml}

log() { echo "[install] $*" >&2; }

eval "$("$here/cluster.sh" env)"
helm=$(bash "$here/build-helm.sh")

if [[ ! -s $values ]]; then
  log "no image values at $values: building and pushing the images (hack/images.sh)"
  bash "$here/images.sh" >/dev/null
fi
[[ -s $values ]] || { log "hack/images.sh wrote no $values"; exit 1; }

chart=${PODMOTION_CHART:-}
oci=()
if [[ -z $chart ]]; then
  # shellcheck source=lib/chart.sh
  source "$here/lib/chart.sh"
  chart=$(chart_push "$helm" "$("$here/registry.sh" addr)" "$run/chart.txt")
fi
[[ $chart == oci://* ]] && oci=(--plain-http)
log "helm upgrade --install $release $chart -n $namespace (images: $values)"
"$helm" upgrade --install "$release" "$chart" "${oci[@]}" \
  --namespace "$namespace" --create-namespace \
  --values "$root/hack/install-values.yaml" \
  --values "$values" \
  --take-ownership \
  --wait --timeout 5m \
  "$@"
log "installed; pods:"
kubectl get pods -n "$namespace" -o wide >&2
kubectl get pods -n "$namespace-agents" -o wide >&2
