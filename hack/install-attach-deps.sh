#!/usr/bin/env bash
# Installs what the attach executor's root tests need, from Debian packages only:
#   nftables            `nft`, used by the tests to read back the ruleset (the agent
#                       itself speaks netlink and needs no nft binary)
#   iproute2            `ip netns` for the target "pods"
#   containerd, runc    a real CRI endpoint for the runtime-path test
#   containernetworking-plugins  CNI host-device/static (CRI refuses pod sandboxes
#                       without a CNI network)
#   busybox-static      the static userland of the locally built test images and
#                       the test application (httpd)
#   util-linux, procps  setpriv, nsenter, unshare
#   python3-minimal     ctypes execve(2) with a raw environment block (duplicates
#                       and order exactly as given) for the target app
# Idempotent: packages already present are not touched; apt-get update runs only
# when something is missing. Must run as root (CI does). Does not start containerd:
# the tests run private instances.
#
# CI: bash hack/install-attach-deps.sh && cargo test -p podmotion-attach
set -euo pipefail
# ip, nft, runc live in sbin, which a CI environment may not have on PATH.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

pkgs=(nftables iproute2 containerd runc containernetworking-plugins busybox-static util-linux procps python3-minimal)
missing=()
for p in "${pkgs[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$p")
    fi
done

if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "install-attach-deps: need root to install: ${missing[*]}" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    # The apt lock may be held by another installer on a shared machine: wait for it.
    apt_opts=(-o DPkg::Lock::Timeout=300 -y --no-install-recommends)
    apt-get -o DPkg::Lock::Timeout=300 update -qq
    # Installing containerd must not start it as a system service here: tests start
    # their own instance with a private root/state/socket. policy-rc.d keeps
    # invoke-rc.d from starting it; no systemd is running in CI anyway.
    created_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        created_policy=1
    fi
    trap '[[ $created_policy == 1 ]] && rm -f /usr/sbin/policy-rc.d' EXIT
    apt-get "${apt_opts[@]}" install "${missing[@]}"
fi

for bin in nft ip containerd ctr runc busybox nsenter unshare setpriv python3; do
    command -v "$bin" >/dev/null || { echo "install-attach-deps: $bin missing after install" >&2; exit 1; }
done
test -x /usr/lib/cni/loopback || { echo "install-attach-deps: /usr/lib/cni/loopback missing" >&2; exit 1; }
echo "install-attach-deps: ok ($(nft --version | head -1); containerd $(containerd --version | awk '{print $3}'); $(runc --version | head -1))"
