#!/usr/bin/env bash
# Installs everything the tests and the demo need that is not part of the machine
# image, each step idempotent (a warm machine does nothing here):
#   - rustfmt and clippy for the toolchain
#   - the executors' kernel-side dependencies (CRIU from a private prefix, nftables,
#     containerd, ...), the image builder (buildah, ...), through their own scripts
#   - what the real nodes' NetworkPolicy controller (kube-router, hack/lib/netpol.sh)
#     needs besides the kernel: the ipset tool and iptables (nf_tables backend)
#   - tshark: the wiretap e2e test (e2e/tests/real_plugin.rs) reads the plugin's pcapng
#     with it, a reader nobody here wrote
# The control-plane binaries are built by hack/cluster.sh (hack/build-k8s.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

if command -v rustup >/dev/null; then
  rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
fi

for script in install-criu.sh install-attach-deps.sh install-tools.sh install-image-tools.sh; do
  if [[ -x $here/$script || -f $here/$script ]]; then
    echo "== hack/$script"
    bash "$here/$script"
  fi
done

# kube-router's policy controller programs ipsets with the `ipset` tool and its rules with
# iptables-save/iptables-restore (Debian's default nf_tables backend).
missing=()
command -v ipset >/dev/null || missing+=(ipset)
command -v iptables-restore >/dev/null || missing+=(iptables)
command -v tshark >/dev/null || missing+=(tshark)
# conntrack: the broker's root test of forgetting unanswered connections (its image has its own).
command -v conntrack >/dev/null || missing+=(conntrack)
if ((${#missing[@]})); then
  echo "== apt-get install ${missing[*]} (NetworkPolicy enforcement on the real nodes; tshark for the wiretap test; conntrack for the broker's)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends "${missing[@]}" ||
    { apt-get -o DPkg::Lock::Timeout=300 update -qq &&
      apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends "${missing[@]}"; }
fi
