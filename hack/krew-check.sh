#!/usr/bin/env bash
# The kubectl plugin's krew manifest, checked with krew's own tools (issue 43): the
# manifest hack/images.sh writes beside the plugin's tarball ($PODMOTION_RUN/plugin/
# podmotion.yaml) must pass krew-index's `validate-krew-manifest` (structure, name,
# platforms), install with `krew install --manifest --archive` (the sha256 checked
# against the archive, the files and the LICENSE krew wants) into a scratch KREW_ROOT,
# and run from there as `kubectl-podmotion --version`; a manifest whose sha256 is not
# the archive's must be refused. Only the download from the release URL is not done:
# no release site is reachable from here, so the archive is handed to krew directly.
#
#   hack/krew-check.sh [PLUGIN_DIR]   default $PODMOTION_RUN/plugin (after hack/images.sh)
#
# krew and validate-krew-manifest (KREW_VERSION in hack/versions.env) are built once
# from the Go module proxy into ${PODMOTION_CACHE:-$HOME/.cache/podmotion}/krew-<version>/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
: "${KREW_VERSION:?KREW_VERSION missing from hack/versions.env}"
log() { echo "[krew-check] $*" >&2; }
die() { log "FAIL: $*"; exit 1; }

dir=${1:-${PODMOTION_RUN:-/tmp/podmotion-cluster}/plugin}
manifest=$dir/podmotion.yaml
tgz=$(find "$dir" -maxdepth 1 -name 'kubectl-podmotion-*-linux-amd64.tar.gz' 2>/dev/null | head -n1)
[[ -f $manifest && -n $tgz ]] || die "no plugin tarball and manifest in $dir: run hack/images.sh first"
version=$(basename "$tgz")
version=${version#kubectl-podmotion-}
version=${version%-linux-amd64.tar.gz}

tools=${PODMOTION_CACHE:-$HOME/.cache/podmotion}/krew-$KREW_VERSION
if [[ ! -x $tools/krew || ! -x $tools/validate-krew-manifest ]]; then
  command -v go >/dev/null || die "go is not on PATH (needed to build krew's tools)"
  mkdir -p "$tools"
  exec 9>"$tools/.lock"
  flock 9
  if [[ ! -x $tools/krew || ! -x $tools/validate-krew-manifest ]]; then
    log "building sigs.k8s.io/krew $KREW_VERSION (krew, validate-krew-manifest; first build takes minutes)"
    tmp=$(mktemp -d "$tools/.build.XXXXXX")
    GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN="$tmp" GOFLAGS=-buildvcs=false \
      go install "sigs.k8s.io/krew/cmd/krew@$KREW_VERSION" \
      "sigs.k8s.io/krew/cmd/validate-krew-manifest@$KREW_VERSION" >&2 || { rm -rf "$tmp"; die "building krew failed"; }
    mv "$tmp/krew" "$tmp/validate-krew-manifest" "$tools/"
    rm -rf "$tmp"
  fi
  exec 9>&-
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
krew() { KREW_ROOT=$1 KREW_OS=linux KREW_ARCH=amd64 "$tools/krew" "${@:2}"; }

log "validate-krew-manifest $manifest"
"$tools/validate-krew-manifest" -manifest "$manifest" -skip-install >"$scratch/validate.log" 2>&1 ||
  die "validate-krew-manifest refused it: $(cat "$scratch/validate.log")"

log "krew install --manifest --archive $(basename "$tgz")"
krew "$scratch/root" install --manifest="$manifest" --archive="$tgz" >"$scratch/install.log" 2>&1 ||
  die "krew install failed: $(cat "$scratch/install.log")"
got=$("$scratch/root/bin/kubectl-podmotion" --version 2>&1) || die "the installed plugin does not run: $got"
[[ $got == *"$version"* ]] || die "the installed plugin says $got, not version $version"
find "$scratch/root/store/podmotion" -type f -name LICENSE | grep -q . ||
  die "krew installed no LICENSE: $(find "$scratch/root/store" -type f)"

log "a manifest with another sha256 is refused"
mkdir -p "$scratch/bad"
sed "s/^\( *sha256: \).*/\1$(printf '0%.0s' {1..64})/" "$manifest" >"$scratch/bad/podmotion.yaml"
grep -q "sha256: 0000" "$scratch/bad/podmotion.yaml" || die "could not write the wrong-sha256 manifest"
if krew "$scratch/root2" install --manifest="$scratch/bad/podmotion.yaml" --archive="$tgz" >"$scratch/bad.log" 2>&1; then
  die "krew installed an archive whose sha256 is not the manifest's"
fi
grep -qi 'sha256\|checksum' "$scratch/bad.log" || die "refused, but not for its sha256: $(cat "$scratch/bad.log")"

log "ok: the krew manifest of kubectl-podmotion $version validates and installs ($got)"
