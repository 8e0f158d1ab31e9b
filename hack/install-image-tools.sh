#!/usr/bin/env bash
# Installs the tools hack/images.sh and hack/registry.sh need, from Debian packages and
# rustup, and nothing else. Idempotent: a second run checks and returns at once.
#
#   buildah      daemonless OCI image builder (bookworm: 1.28); --no-install-recommends
#                keeps crun, fuse-overlayfs and netavark out: our Containerfiles have no
#                RUN step, so no runtime and no container network is ever started.
#   musl-tools   musl-gcc, for the C parts of Rust crates (ring) on the static musl target
#   gcc, libc6-dev  the pause binary (gcc -Os -static, glibc)
#   the linter  (shellcheck, lint of the hack/ scripts; optional)
#   curl, jq     registry checks
#   skopeo       copies released artifacts between registries by digest (hack/release.sh)
#   rustup target x86_64-unknown-linux-musl
# Go (for the registry and the pause source) is expected on PATH, as for hack/build-k8s.sh.
set -euo pipefail

log() { echo "[install-image-tools] $*" >&2; }

pkgs=(buildah skopeo musl-tools gcc libc6-dev shellcheck curl jq)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # One `apt-get update` only when the lists are missing or do not know a package.
  if ! apt-get install -s --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    apt-get -o DPkg::Lock::Timeout=300 -qq update
  fi
  apt-get -o DPkg::Lock::Timeout=300 -qq install -y --no-install-recommends "${missing[@]}" >&2
fi

if ! rustup target list --installed 2>/dev/null | grep -qx x86_64-unknown-linux-musl; then
  log "adding the rust target x86_64-unknown-linux-musl"
  rustup target add x86_64-unknown-linux-musl >&2
fi

command -v go >/dev/null || { log "go is not on PATH (needed for the registry and the pause source)"; exit 1; }
log "ok: $(buildah --version), $(musl-gcc -dumpversion 2>/dev/null | sed 's/^/musl-gcc /')"
