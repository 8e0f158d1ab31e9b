#!/usr/bin/env bash
# Builds the node components of the local cluster's real nodes from the Go modules pinned
# in hack/versions.env, into ${PODMOTION_CACHE:-$HOME/.cache/podmotion}/node-<hash>/bin/:
#   containerd, containerd-shim-runc-v2, ctr   github.com/containerd/containerd/v2 (CGO off)
#   runc                                       github.com/opencontainers/runc (cgo, seccomp:
#                                              libseccomp-dev from Debian)
#   cni/bridge, cni/host-local, cni/loopback, cni/portmap
#                                              github.com/containernetworking/plugins
# kubelet and kube-proxy are built with the control plane (hack/build-k8s.sh); the pause
# (sandbox) image is built by hack/images.sh and served by the local registry.
#
# The KVM device plugin of the runner node (hack/device-plugin, its own go.mod pins the
# kubelet device-plugin API module) is built separately, into
# ${PODMOTION_CACHE:-$HOME/.cache/podmotion}/device-plugin-<hash of its sources>/kvm-device-plugin.
#
# Does nothing when the directory is complete (a stamp records a hash of the pins).
#
#   hack/build-node.sh                         build if needed, print the bin directory on stdout
#   hack/build-node.sh --print                 only print the bin directory
#   hack/build-node.sh --device-plugin         build the device plugin if needed, print its path
#   hack/build-node.sh --print-device-plugin   only print the device plugin's path
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

cache=${PODMOTION_CACHE:-$HOME/.cache/podmotion}
key=$(grep -E '^(CONTAINERD|RUNC|CNI_PLUGINS)_VERSION=' "$here/versions.env" | sha256sum | cut -c1-12)
root=$cache/node-$key
bin=$root/bin
binaries=(containerd containerd-shim-runc-v2 ctr runc cni/bridge cni/host-local cni/loopback cni/portmap)

log() { echo "[build-node] $*" >&2; }

complete() {
  local b
  for b in "${binaries[@]}"; do [[ -x $bin/$b ]] || return 1; done
}

dp_src=$here/device-plugin
dp_key=$(cat "$dp_src/go.mod" "$dp_src/go.sum" "$dp_src"/*.go | sha256sum | cut -c1-12)
dp_bin=$cache/device-plugin-$dp_key/kvm-device-plugin

build_device_plugin() {
  [[ -x $dp_bin ]] && { echo "$dp_bin"; return 0; }
  mkdir -p "${dp_bin%/*}"
  # One build at a time (hack/prebuild.sh may be building it); the second finds it built.
  exec 9>"${dp_bin%/*}/.lock"
  flock -n 9 || { log "another build holds ${dp_bin%/*}/.lock; waiting"; flock 9; }
  [[ -x $dp_bin ]] && { echo "$dp_bin"; return 0; }
  log "building the KVM device plugin (hack/device-plugin)"
  (cd "$dp_src" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false \
    go build -trimpath -ldflags "-s -w" -o "$dp_bin.tmp" .) >&2
  mv "$dp_bin.tmp" "$dp_bin"
  echo "$dp_bin"
}

case ${1:-} in
  --print) echo "$bin"; exit 0 ;;
  --print-device-plugin) echo "$dp_bin"; exit 0 ;;
  --device-plugin) build_device_plugin; exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--print|--device-plugin|--print-device-plugin]" >&2; exit 2 ;;
esac

if complete; then echo "$bin"; exit 0; fi

mkdir -p "$root"
exec 9>"$root/.lock"
flock -n 9 || { log "another build holds $root/.lock; waiting"; flock 9; }
if complete; then echo "$bin"; exit 0; fi

# runc links libseccomp (seccomp profiles are a node feature the RunnerPool relies on).
if ! pkg-config --exists libseccomp 2>/dev/null; then
  log "installing libseccomp-dev and pkg-config (Debian) for runc"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends libseccomp-dev pkg-config >&2 ||
    { apt-get -o DPkg::Lock::Timeout=300 update -qq && apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends libseccomp-dev pkg-config >&2; }
fi

tmp=$root/bin.tmp
rm -rf "$tmp"
mkdir -p "$tmp/cni"
start=$SECONDS
export GOTOOLCHAIN=local GOFLAGS=-buildvcs=false

log "building containerd $CONTAINERD_VERSION"
CGO_ENABLED=0 GOBIN=$tmp go install -trimpath \
  -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
  "github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD_VERSION" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" \
  "github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD_VERSION"

log "building runc $RUNC_VERSION (seccomp)"
CGO_ENABLED=1 GOBIN=$tmp go install -trimpath -tags "seccomp urfave_cli_no_docs" \
  -ldflags "-s -w -X main.version=${RUNC_VERSION#v}" \
  "github.com/opencontainers/runc@$RUNC_VERSION"

log "building CNI plugins $CNI_PLUGINS_VERSION"
CGO_ENABLED=0 GOBIN=$tmp/cni go install -trimpath -ldflags "-s -w" \
  "github.com/containernetworking/plugins/plugins/main/bridge@$CNI_PLUGINS_VERSION" \
  "github.com/containernetworking/plugins/plugins/ipam/host-local@$CNI_PLUGINS_VERSION" \
  "github.com/containernetworking/plugins/plugins/main/loopback@$CNI_PLUGINS_VERSION" \
  "github.com/containernetworking/plugins/plugins/meta/portmap@$CNI_PLUGINS_VERSION"

rm -rf "$bin"
mv "$tmp" "$bin"
for b in "${binaries[@]}"; do [[ -x $bin/$b ]] || { log "missing $b after build"; exit 1; }; done
log "done in $((SECONDS - start))s: $bin"
echo "$bin"
