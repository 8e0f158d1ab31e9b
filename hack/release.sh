#!/usr/bin/env bash
# Publishes a PodMotion release to an OCI registry that speaks TLS: the images the chart
# ships, the chart with its defaults pinned to those images' digests, and the kubectl
# plugin.
#
#   hack/release.sh REGISTRY        e.g. registry.example.com, or mirror.example:5000/team
#
# For version V (Cargo.toml's workspace version, the chart's appVersion and version):
#   REGISTRY/podmotion/podmotion-<name>:V   operator agent broker attach preflight
#   REGISTRY/podmotion/charts/podmotion:V   the chart; values.yaml's `image.digest`,
#                                           `migrationAgent.{agent,broker}.image.digest`,
#                                           `attachment.agentImage` and
#                                           `runnerPool.preflightImage` pinned to the
#                                           digests above (registry part: ghcr.io, as in
#                                           the source; `global.imageRegistry` replaces it)
#   REGISTRY/podmotion/kubectl-podmotion:V  the plugin's tarball (hack/lib/plugin.sh)
# stdout: one pinned reference per artifact, `REGISTRY/podmotion/<repo>@sha256:<digest>`
# (the chart's prefixed `oci://`). A cluster then needs one value:
#
#   helm install podmotion oci://REGISTRY/podmotion/charts/podmotion --version V \
#     -n podmotion-system --create-namespace --set global.imageRegistry=REGISTRY
#
# How: hack/images.sh builds every image (or finds it unchanged) into the local registry,
# which is the staging area, with the plugin; the pinned chart is packaged and staged
# there too (under release/); each artifact is then copied by digest (skopeo copy
# --preserve-digests: the bytes users pull are the bytes built and checked). The same
# commit gives the same digests: the builds are reproducible (hack/images.sh
# --check-reproducible) and so is the chart's archive. A version already published is left as it is when its digest is the one this
# run has ("already published") and refused, naming it, when it differs: a release tag
# never moves unless RELEASE_REPLACE=1.
#
# Environment:
#   RELEASE_CA_FILE      PEM bundle that verifies REGISTRY's certificate (default: the
#                        system's trust store)
#   RELEASE_AUTH_FILE    credentials for REGISTRY, in the containers auth.json / docker
#                        config.json format (`skopeo login --authfile F REGISTRY` writes
#                        it). Default: anonymous push
#   RELEASE_REPLACE      1: move a version tag that names other content
#   RELEASE_ALLOW_DIRTY  1: release a working tree with uncommitted changes (the images'
#                        revision label then ends in -dirty)
#   IMAGES_CARGO_PROFILE images-lto (default: Cargo.toml's release LTO) or images (the
#                        profile of the images the tests run; e2e/tests/real_release.rs
#                        publishes those, already built, instead of compiling again)
#   PODMOTION_RUN, PODMOTION_CACHE, CARGO_TARGET_DIR   as for hack/images.sh
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
RUN=${PODMOTION_RUN:-/tmp/podmotion-cluster}
SHIPPED=(operator agent broker attach preflight)
# Published binaries are built with thin LTO (Cargo.toml's profile images-lto); the
# images the tests and the demo run use the cheaper "images" profile (no LTO).
export IMAGES_CARGO_PROFILE=${IMAGES_CARGO_PROFILE:-images-lto}

log() { echo "[release] $*" >&2; }
die() { echo "[release] ERROR: $*" >&2; exit 1; }

(($# == 1)) || die "usage: hack/release.sh REGISTRY (host[:port][/path])"
DEST=${1%/}
[[ $DEST =~ ^[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9._/-]+)?$ ]] ||
  die "'$1' is not a registry (host[:port][/path], no scheme)"
command -v skopeo >/dev/null || die "skopeo is not installed (bash hack/install-image-tools.sh)"
if [[ ${RELEASE_ALLOW_DIRTY:-0} != 1 && -n $(git -C "$repo" status --porcelain --untracked-files=no) ]]; then
  die "the working tree has uncommitted changes: commit them, or set RELEASE_ALLOW_DIRTY=1"
fi
VERSION=$(sed -n '/^\[workspace.package\]/,/^\[/{s/^version = "\(.*\)"$/\1/p}' "$repo/Cargo.toml")
chart_version=$(sed -n 's/^version: *//p' "$repo/charts/podmotion/Chart.yaml")
[[ $chart_version == "$VERSION" ]] ||
  die "Chart.yaml's version ($chart_version) is not the workspace's ($VERSION)"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# Options that reach REGISTRY: its CA (skopeo reads every *.crt of a directory) and the
# credentials.
mkdir -p "$WORK/certs"
SKOPEO_DEST=(--dest-cert-dir "$WORK/certs")
SKOPEO_READ=(--cert-dir "$WORK/certs")
if [[ -n ${RELEASE_CA_FILE:-} ]]; then
  [[ -r $RELEASE_CA_FILE ]] || die "RELEASE_CA_FILE $RELEASE_CA_FILE is not readable"
  cp "$RELEASE_CA_FILE" "$WORK/certs/ca.crt"
fi
if [[ -n ${RELEASE_AUTH_FILE:-} ]]; then
  [[ -r $RELEASE_AUTH_FILE ]] || die "RELEASE_AUTH_FILE $RELEASE_AUTH_FILE is not readable"
  SKOPEO_DEST+=(--dest-authfile "$RELEASE_AUTH_FILE")
  SKOPEO_READ+=(--authfile "$RELEASE_AUTH_FILE")
fi

# The digest REGISTRY's tag names now; fails when the tag cannot be read.
published() { # repo
  skopeo inspect --raw "${SKOPEO_READ[@]}" "docker://$DEST/$1:$VERSION" >"$WORK/raw" 2>"$WORK/inspect.err" ||
    return 1
  echo "sha256:$(sha256sum <"$WORK/raw" | cut -d' ' -f1)"
}
# Whether the tag may be (re)written with `want`; logs the decision.
may_publish() { # repo want-digest
  local have
  if ! have=$(published "$1"); then
    grep -qiE 'manifest unknown|not found|name unknown' "$WORK/inspect.err" ||
      die "$DEST/$1:$VERSION: cannot read it: $(head -c 400 "$WORK/inspect.err")"
    return 0
  fi
  if [[ $have == "$2" ]]; then
    log "$1:$VERSION: already published, $have"
    return 1
  fi
  [[ ${RELEASE_REPLACE:-0} == 1 ]] ||
    die "$DEST/$1:$VERSION already names $have, not this build's $2 (a release tag never moves; RELEASE_REPLACE=1 moves it)"
  log "$1:$VERSION: replacing $have (RELEASE_REPLACE=1)"
}

copy() { # source-reference repo digest
  may_publish "$2" "$3" || return 0
  skopeo copy --quiet --preserve-digests --src-tls-verify=false "${SKOPEO_DEST[@]}" \
    "docker://$1" "docker://$DEST/$2:$VERSION" >&2 || die "copying $1 to $DEST/$2:$VERSION failed"
  log "$2:$VERSION: published, $3"
}

# ---------------------------------------------------------------- build and stage

log "building (or finding unchanged) every image into the local registry: hack/images.sh (cargo profile $IMAGES_CARGO_PROFILE)"
bash "$here/images.sh" >"$WORK/images.txt"
LOCAL=$(head -n1 "$WORK/images.txt" | cut -d/ -f1)
declare -A DIGEST=()
for n in "${SHIPPED[@]}"; do
  ref=$(grep "/podmotion/podmotion-$n@sha256:" "$WORK/images.txt") || die "hack/images.sh printed no $n image"
  DIGEST[$n]=${ref##*@}
  copy "$ref" "podmotion/podmotion-$n" "${DIGEST[$n]}"
  echo "$DEST/podmotion/podmotion-$n@${DIGEST[$n]}"
done

# ---------------------------------------------------------------- the plugin

plugin=$(cat "$RUN/plugin.txt") || die "hack/images.sh left no $RUN/plugin.txt"
copy "$plugin" podmotion/kubectl-podmotion "${plugin##*@}"
echo "$DEST/podmotion/kubectl-podmotion@${plugin##*@}"

# ---------------------------------------------------------------- the chart

# shellcheck source=lib/chart.sh
source "$here/lib/chart.sh"
# -L: files/ links into the repository (the Argo CD checks), which a copy must carry.
cp -RL "$repo/charts/podmotion" "$WORK/podmotion"
chart_pin "$WORK/podmotion" "${DIGEST[operator]}" "${DIGEST[agent]}" "${DIGEST[broker]}" \
  "${DIGEST[attach]}" "${DIGEST[preflight]}" || die "pinning the chart's values failed"
# Staged under release/ in the local registry (its podmotion/charts/podmotion is the
# chart without pinned defaults, which hack/install.sh uses with images-values.yaml).
staged=$(chart_push "$(bash "$here/build-helm.sh")" "$LOCAL/release" "$WORK/chart.txt" \
  "$(git -C "$repo" log -1 --format=%ct HEAD)" "$WORK/podmotion") || die "staging the chart failed"
copy "${staged#oci://}" podmotion/charts/podmotion "${staged##*@}"
echo "oci://$DEST/podmotion/charts/podmotion@${staged##*@}"
log "released $VERSION to $DEST: helm install podmotion oci://$DEST/podmotion/charts/podmotion --version $VERSION --set global.imageRegistry=$DEST"
