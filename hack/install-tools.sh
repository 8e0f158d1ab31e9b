#!/usr/bin/env bash
# Tools the chart and Argo CD health tests need (e2e/tests/chart.rs,
# e2e/tests/argocd_health.rs), each step idempotent:
#   - helm, built from its Go module by hack/build-helm.sh (no download site is reachable)
#   - a Lua 5.1 interpreter from Debian's packages: Argo CD runs health.lua in gopher-lua,
#     a Lua 5.1 implementation, so our tests use the same language version.
# Called by hack/install-deps.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

log() { echo "[install-tools] $*" >&2; }

helm=$(bash "$here/build-helm.sh")
log "helm: $helm"

if ! command -v lua5.1 >/dev/null; then
  sudo=()
  if [[ $(id -u) != 0 ]]; then
    command -v sudo >/dev/null || { log "lua5.1 missing and not root: apt-get install lua5.1"; exit 1; }
    sudo=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-cache show lua5.1 >/dev/null 2>&1; then
    "${sudo[@]}" apt-get update -qq
  fi
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends lua5.1 >&2 \
    || { "${sudo[@]}" apt-get update -qq && "${sudo[@]}" apt-get install -y -qq --no-install-recommends lua5.1 >&2; }
fi
log "lua: $(command -v lua5.1) ($(lua5.1 -v 2>&1))"
