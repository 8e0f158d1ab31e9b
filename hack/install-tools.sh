#!/usr/bin/env bash
# Tools the chart tests need (e2e/tests/chart.rs, e2e/tests/argocd_health.rs), idempotent:
#   - helm, built from its Go module by hack/build-helm.sh (no download site is reachable)
# The Argo CD health evaluator those tests also run is built by hack/build-argocd-health.sh
# (hack/test.sh, or the test itself on first use), not here: the demo runs this script and
# does not need it.
# Called by hack/install-deps.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

log() { echo "[install-tools] $*" >&2; }

helm=$(bash "$here/build-helm.sh")
log "helm: $helm"
