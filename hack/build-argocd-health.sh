#!/usr/bin/env bash
# Builds podmotion-argocd-health (hack/argocd-health: Argo CD's own health evaluation —
# argocd-cm parsing, the gopher-lua VM, gitops-engine's GetResourceHealth — as a small
# program; Argo CD version pinned as ARGOCD_VERSION in hack/versions.env) into
# ${PODMOTION_CACHE:-$HOME/.cache/podmotion}/argocd-health-$ARGOCD_VERSION/.
# e2e/tests/argocd_health.rs runs it against live objects. Needs Go and the module proxy.
#
# Idempotent: rebuilds only when the pinned version or the program's sources (main.go,
# go.mod, go.sum) change. A cold build downloads ~800 MB of modules and compiles for a
# few minutes on 2 cores (5.5 min measured with other builds running).
#
#   hack/build-argocd-health.sh           build if needed, print the binary's path on stdout
#   hack/build-argocd-health.sh --force   rebuild
#   hack/build-argocd-health.sh --print   only print the binary's path
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
: "${ARGOCD_VERSION:?ARGOCD_VERSION missing from hack/versions.env}"

src=$here/argocd-health
cache=${PODMOTION_CACHE:-$HOME/.cache/podmotion}
root=$cache/argocd-health-$ARGOCD_VERSION
bin=$root/podmotion-argocd-health
stamp=$root/.sources

force=0
case ${1:-} in
  --force) force=1 ;;
  --print) echo "$bin"; exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--force|--print]" >&2; exit 2 ;;
esac

log() { echo "[build-argocd-health] $*" >&2; }

sources=$(cd "$src" && sha256sum main.go go.mod go.sum | sha256sum | cut -d' ' -f1)
complete() { [[ -x $bin && -f $stamp && $(cat "$stamp") == "$sources" ]]; }

if [[ $force == 0 ]] && complete; then
  echo "$bin"
  exit 0
fi

# The module must build the version pinned here, not whatever go.mod drifted to.
if ! grep -qE "^[[:space:]]*(require[[:space:]]+)?github.com/argoproj/argo-cd/v3 $ARGOCD_VERSION\$" "$src/go.mod"; then
  log "$src/go.mod does not require github.com/argoproj/argo-cd/v3 $ARGOCD_VERSION (hack/versions.env)"
  log "update it: cd hack/argocd-health && go get github.com/argoproj/argo-cd/v3@$ARGOCD_VERSION && go mod tidy"
  exit 1
fi
command -v go >/dev/null || { log "go is not on PATH (needed to build the Argo CD health evaluator)"; exit 1; }

mkdir -p "$root"
exec 9>"$root/.lock"
if ! flock -n 9; then
  log "another build holds $root/.lock; waiting"
  flock 9
fi
if [[ $force == 0 ]] && complete; then
  echo "$bin"
  exit 0
fi

log "building hack/argocd-health with github.com/argoproj/argo-cd/v3@$ARGOCD_VERSION (GOTOOLCHAIN=local; a cold build takes minutes)"
start=$SECONDS
tmp=$(mktemp -d "$root/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
(cd "$src" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false" \
  go build -trimpath -ldflags "-s -w" -o "$tmp/podmotion-argocd-health" . >&2)
mv -f "$tmp/podmotion-argocd-health" "$bin"
echo "$sources" >"$stamp"
log "ready at $bin ($((SECONDS - start)) s)"
echo "$bin"
