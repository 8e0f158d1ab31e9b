#!/usr/bin/env bash
# Builds `helm` from its Go module (helm.sh/helm/v4, version pinned as HELM_VERSION in
# hack/versions.env) into ${PODMOTION_CACHE:-$HOME/.cache/podmotion}/helm-$HELM_VERSION/helm.
# No download site is reachable from our machines; the Go module proxy is.
#
# Idempotent: does nothing when the binary exists and reports the pinned version.
#
#   hack/build-helm.sh           build if needed, print the binary's path on stdout
#   hack/build-helm.sh --force   rebuild
#   hack/build-helm.sh --print   only print the binary's path
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
: "${HELM_VERSION:?HELM_VERSION missing from hack/versions.env}"

cache=${PODMOTION_CACHE:-$HOME/.cache/podmotion}
root=$cache/helm-$HELM_VERSION
helm=$root/helm

force=0
case ${1:-} in
  --force) force=1 ;;
  --print) echo "$helm"; exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--force|--print]" >&2; exit 2 ;;
esac

log() { echo "[build-helm] $*" >&2; }

complete() {
  [[ -x $helm ]] && "$helm" version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"
}

if [[ $force == 0 ]] && complete; then
  echo "$helm"
  exit 0
fi

command -v go >/dev/null || { log "go is not on PATH (needed to build helm)"; exit 1; }

mkdir -p "$root"
exec 9>"$root/.lock"
if ! flock -n 9; then
  log "another build holds $root/.lock; waiting"
  flock 9
fi
if [[ $force == 0 ]] && complete; then
  echo "$helm"
  exit 0
fi

major=${HELM_VERSION%%.*} # v4
module=helm.sh/helm/$major
log "building $module/cmd/helm@$HELM_VERSION (GOTOOLCHAIN=local; first build takes minutes)"
tmp=$(mktemp -d "$root/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# `go install pkg@version` builds in module mode from the proxy, ignoring any go.mod
# around us. The version is stamped the way helm's Makefile does it.
GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN="$tmp" GOFLAGS=-buildvcs=false \
  go install -trimpath \
  -ldflags "-s -w -X $module/internal/version.version=$HELM_VERSION" \
  "$module/cmd/helm@$HELM_VERSION" >&2
mv -f "$tmp/helm" "$helm"
if ! complete; then
  log "built $helm but \`helm version\` does not report $HELM_VERSION:"
  "$helm" version >&2 || true
  exit 1
fi
log "helm $HELM_VERSION ready at $helm"
echo "$helm"
