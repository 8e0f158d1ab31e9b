#!/usr/bin/env bash
# A private containerd (CRI plugin on, runc, CNI) for the attach executor's
# runtime-path tests. Nothing is pulled: the sandbox ("pause") and workload images are
# built here from Debian's static busybox as OCI image tarballs and imported with ctr.
#
#   cri-fixture.sh up DIR     start containerd with root/state/socket under DIR;
#                             prints the socket path on stdout when CRI answers
#   cri-fixture.sh down DIR   stop it, remove every pod it created, unmount, delete DIR
#
# DIR must be a fresh directory (tests use a temp dir). Needs root.
set -euo pipefail

cmd=${1:?up|down}
dir=${2:?dir}
sock="$dir/containerd.sock"
ns=k8s.io
# CRI insists on an eth0 with an address in every pod sandbox. The CNI host-device
# plugin moves one end of a veth pair (created without any address in the root
# namespace; this kernel has no dummy links) into the pod's namespace as eth0 with a
# static address: the only address it gets lives inside the namespace containerd
# creates for the pod, and the peer left behind has none. One pod per fixture.
hash=$(printf '%s' "$dir" | sha256sum | cut -c1-8)
dummy="pmtd$hash"
peer="pmtp$hash"

build_image() { # name tag entrypoint-json out.tar
    local name=$1 out=$4 work
    work=$(mktemp -d "$dir/img.XXXXXX")
    mkdir -p "$work/rootfs/bin" "$work/rootfs/etc" "$work/rootfs/srv/www" "$work/rootfs/tmp" \
        "$work/rootfs/proc" "$work/rootfs/sys" "$work/rootfs/dev" "$work/oci/blobs/sha256"
    cp /bin/busybox "$work/rootfs/bin/busybox"
    for a in sh sleep httpd cat ls env; do ln -s busybox "$work/rootfs/bin/$a"; done
    echo 'root:x:0:0:root:/:/bin/sh' >"$work/rootfs/etc/passwd"
    echo 'root:x:0:' >"$work/rootfs/etc/group"
    echo "podmotion image $name" >"$work/rootfs/etc/podmotion-release"
    echo 'hello from the container' >"$work/rootfs/srv/www/index.html"
    # Reproducible layer: fixed mtime, numeric owner, sorted entries.
    tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work/rootfs" -cf "$work/layer.tar" .
    local layer_sha layer_size cfg cfg_sha cfg_size man man_sha man_size
    layer_sha=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
    layer_size=$(stat -c %s "$work/layer.tar")
    mv "$work/layer.tar" "$work/oci/blobs/sha256/$layer_sha"
    cfg=$(printf '{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/bin"],"Entrypoint":%s,"WorkingDir":"/"},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' "$3" "$layer_sha")
    cfg_sha=$(printf '%s' "$cfg" | sha256sum | cut -d' ' -f1)
    cfg_size=$(printf '%s' "$cfg" | wc -c)
    printf '%s' "$cfg" >"$work/oci/blobs/sha256/$cfg_sha"
    man=$(printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%s}]}' "$cfg_sha" "$cfg_size" "$layer_sha" "$layer_size")
    man_sha=$(printf '%s' "$man" | sha256sum | cut -d' ' -f1)
    man_size=$(printf '%s' "$man" | wc -c)
    printf '%s' "$man" >"$work/oci/blobs/sha256/$man_sha"
    printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"%s:%s","org.opencontainers.image.ref.name":"%s"}}]}' \
        "$man_sha" "$man_size" "$name" "$2" "$2" >"$work/oci/index.json"
    echo '{"imageLayoutVersion":"1.0.0"}' >"$work/oci/oci-layout"
    tar -C "$work/oci" -cf "$out" .
    rm -rf "$work"
}

case $cmd in
up)
    mkdir -p "$dir/root" "$dir/state" "$dir/cni"
    ip link show "$peer" >/dev/null 2>&1 || ip link add "$dummy" type veth peer name "$peer"
    cat >"$dir/cni/10-podmotion-test.conflist" <<CNI
{"cniVersion":"0.4.0","name":"podmotion-test","plugins":[{"type":"host-device","device":"$dummy","ipam":{"type":"static","addresses":[{"address":"10.213.251.2/30"}]}}]}
CNI
    cat >"$dir/config.toml" <<TOML
version = 2
root = "$dir/root"
state = "$dir/state"
disabled_plugins = ["io.containerd.internal.v1.tracing", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[debug]
  address = "$dir/debug.sock"
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "podmotion.test/pause:1"
  enable_selinux = false
  # The sandbox (pause) gets oom_score_adj -998 by default; lowering a score needs
  # CAP_SYS_RESOURCE, which this workplace's root does not have (runc then fails
  # with "can't get final child's PID from pipe: EOF"). Clamp to containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$dir/cni"
TOML
    containerd --config "$dir/config.toml" >"$dir/containerd.log" 2>&1 &
    echo $! >"$dir/containerd.pid"
    for _ in $(seq 100); do
        [[ -S $sock ]] && ctr -a "$sock" version >/dev/null 2>&1 && break
        kill -0 "$(cat "$dir/containerd.pid")" 2>/dev/null || { cat "$dir/containerd.log" >&2; exit 1; }
        sleep 0.1
    done
    build_image podmotion.test/pause 1 '["/bin/sleep","2147483647"]' "$dir/pause.tar"
    build_image podmotion.test/busybox 1 '["/bin/sh"]' "$dir/busybox.tar"
    ctr -a "$sock" -n "$ns" images import --snapshotter overlayfs "$dir/pause.tar" >&2
    ctr -a "$sock" -n "$ns" images import --snapshotter overlayfs "$dir/busybox.tar" >&2
    echo "$sock"
    ;;
down)
    [[ -f $dir/containerd.pid ]] || exit 0
    pid=$(cat "$dir/containerd.pid")
    # Kill every task of the namespace (shims reap them) before containerd itself.
    for c in $(ctr -a "$sock" -n "$ns" tasks ls -q 2>/dev/null); do
        ctr -a "$sock" -n "$ns" tasks kill -s KILL "$c" >/dev/null 2>&1 || true
    done
    sleep 0.3
    for c in $(ctr -a "$sock" -n "$ns" tasks ls -q 2>/dev/null); do
        ctr -a "$sock" -n "$ns" tasks delete -f "$c" >/dev/null 2>&1 || true
    done
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    # Shims outlive containerd by design; end the ones started for this root.
    for s in $(pgrep -f "containerd-shim-runc-v2 .*-address $sock" || true); do kill -9 "$s" 2>/dev/null || true; done
    # Pod netns bind mounts and rootfs mounts created under DIR / for its pods.
    { grep -F "$dir/" /proc/self/mounts || true; } | awk '{print $2}' | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
    ip link del "$peer" 2>/dev/null || true
    rm -rf "$dir"
    ;;
*) echo "usage: $0 up|down DIR" >&2; exit 2 ;;
esac
