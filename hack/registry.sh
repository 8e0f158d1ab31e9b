#!/usr/bin/env bash
# The local OCI registry the real nodes pull PodMotion's images from: distribution's
# `registry`, built from the wrapper module hack/registry (its main is upstream's
# cmd/registry with the filesystem storage driver alone; the module pins the version)
# into ${PODMOTION_CACHE:-$HOME/.cache/podmotion}/registry-<version>-<hash>/registry and
# run as a plain process, plain HTTP on loopback only.
#
#   hack/registry.sh up       build if needed, start, wait until /v2/ answers (idempotent)
#   hack/registry.sh down     stop it (the stored images are kept)
#   hack/registry.sh status   exit 0 only when it runs and /v2/ answers
#   hack/registry.sh addr     print host:port
#   hack/registry.sh build    only build (prints the binary's path)
#
# Environment:
#   PODMOTION_RUN          runtime directory (default /tmp/podmotion-cluster): pids/registry.pid,
#                          logs/registry.log, registry.yml
#   PODMOTION_CACHE        binary cache root; the blobs live in $PODMOTION_CACHE/registry-data
#                          so that pushed images survive cluster restarts
#   PODMOTION_PORT_OFFSET  added to the port 15000 (as for hack/cluster.sh)
#   CLUSTER_UP_TIMEOUT     seconds to wait for /v2/ (default 90)
set -euo pipefail

MODULE=github.com/distribution/distribution/v3
SRC=$(cd "$(dirname "$0")" && pwd)/registry
# The version hack/registry/go.mod requires (v3.1.2: the newest v3 on the proxy when pinned).
REGISTRY_VERSION=$(sed -n "s|^require $MODULE \(v[^ ]*\)\$|\1|p" "$SRC/go.mod")

RUN=${PODMOTION_RUN:-/tmp/podmotion-cluster}
CACHE=${PODMOTION_CACHE:-$HOME/.cache/podmotion}
DATA=$CACHE/registry-data
LOGS=$RUN/logs
PIDS=$RUN/pids
CONFIG=$RUN/registry.yml
TIMEOUT=${CLUSTER_UP_TIMEOUT:-90}

off=${PODMOTION_PORT_OFFSET:-0}
[[ $off =~ ^[0-9]+$ ]] || { echo "PODMOTION_PORT_OFFSET must be a number" >&2; exit 2; }
PORT=$((15000 + off))
ADDR=127.0.0.1:$PORT

log() { echo "[registry] $*" >&2; }
die() { echo "[registry] ERROR: $*" >&2; exit 1; }

# ---------------------------------------------------------------- build

inputs_hash() {
  {
    cat "$SRC/go.mod" "$SRC/go.sum" "$SRC"/*.go
    printf '%s\n' "CGO_ENABLED=0 -trimpath ldflags-v1" "$(go env GOVERSION 2>/dev/null)"
  } | sha256sum | cut -d' ' -f1
}
ROOT=$CACHE/registry-$REGISTRY_VERSION-$(inputs_hash | cut -c1-12)
BIN=$ROOT/registry
STAMP=$ROOT/.stamp

built() {
  [[ -x $BIN && -f $STAMP && "$(cat "$STAMP")" == "$(inputs_hash)" ]]
}

build() {
  built && return 0
  command -v go >/dev/null || die "go is not on PATH (needed to build the registry)"
  mkdir -p "$ROOT"
  exec 9>"$ROOT/.lock"
  if ! flock -n 9; then
    log "another build holds $ROOT/.lock; waiting"
    flock 9
  fi
  if built; then exec 9>&-; return 0; fi
  [[ -n $REGISTRY_VERSION ]] || die "hack/registry/go.mod requires no $MODULE"
  log "building $MODULE $REGISTRY_VERSION (hack/registry: the filesystem storage driver only)"
  local tmp start=$SECONDS
  tmp=$(mktemp -d "$ROOT/.build.XXXXXX")
  # The version is stamped the way distribution's Makefile does it.
  if ! (cd "$SRC" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false" \
    go build -trimpath \
    -ldflags "-s -w -X github.com/distribution/distribution/v3/version.version=$REGISTRY_VERSION" \
    -o "$tmp/registry" . >&2); then
    rm -rf "$tmp"
    die "building the registry failed"
  fi
  mv -f "$tmp/registry" "$BIN"
  rm -rf "$tmp"
  inputs_hash >"$STAMP"
  exec 9>&-
  log "built in $((SECONDS - start))s: $BIN"
}

# ---------------------------------------------------------------- process

pid_of() { # -> pid if the PID file names a live process of our registry binary
  local f=$PIDS/registry.pid pid exe
  [[ -f $f ]] || return 1
  pid=$(cat "$f")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
  # The binary may have been replaced by a rebuild: "(deleted)" suffix.
  [[ ${exe% (deleted)} == */registry ]] || return 1
  echo "$pid"
}

answering() {
  [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 3 "http://$ADDR/v2/" 2>/dev/null) == 200 ]]
}

fail_with_log() { # message
  echo "[registry] ERROR: $1" >&2
  echo "----- last 40 lines of $LOGS/registry.log -----" >&2
  tail -n 40 "$LOGS/registry.log" >&2 || true
  echo "-----" >&2
  exit 1
}

write_config() {
  # Deletes are allowed so that old digests can be removed by hand; no auth, no TLS:
  # the listener is loopback only.
  cat >"$CONFIG" <<EOF
version: 0.1
log:
  level: info
  formatter: text
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $DATA
  delete:
    enabled: true
  redirect:
    disable: true
http:
  addr: $ADDR
  headers:
    X-Content-Type-Options: [nosniff]
health:
  storagedriver:
    enabled: false
EOF
}

cmd_up() {
  if pid_of >/dev/null && answering; then
    log "already up on $ADDR"
    return 0
  fi
  build
  mkdir -p "$LOGS" "$PIDS" "$DATA"
  exec 8>"$RUN/.registry.lock"
  flock -n 8 || { log "waiting for another hack/registry.sh on $RUN"; flock 8; }
  if pid_of >/dev/null; then
    # Started but not answering (yet): give it the usual time, then report.
    :
  else
    if ss -Hltn "sport = :$PORT" 2>/dev/null | grep -q .; then
      die "$ADDR is already in use: $(ss -Hltnp "sport = :$PORT" | head -1)"
    fi
    write_config
    : >"$LOGS/registry.log"
    # setsid: own session, so the process outlives this script and its caller's job
    # control. Only stdio is passed on: a daemon that inherits a descriptor holds it
    # forever, and a caller's lock with it (`flock F hack/cluster.sh up` hung every
    # later `flock F`).
    (
      for fd in /proc/"$BASHPID"/fd/*; do
        fd=${fd##*/}
        if ((fd > 2)); then eval "exec $fd>&-"; fi
      done
      exec setsid "$BIN" serve "$CONFIG" >>"$LOGS/registry.log" 2>&1 </dev/null
    ) &
    echo $! >"$PIDS/registry.pid"
  fi
  local deadline=$((SECONDS + TIMEOUT))
  while ! answering; do
    pid_of >/dev/null || fail_with_log "registry exited during start-up"
    ((SECONDS < deadline)) || fail_with_log "registry: /v2/ on $ADDR not answering after ${TIMEOUT}s"
    sleep 0.1
  done
  log "up on $ADDR (storage $DATA, log $LOGS/registry.log)"
}

cmd_down() {
  local pid i
  pid=$(pid_of) || { rm -f "$PIDS/registry.pid"; log "not running"; return 0; }
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    log "registry (pid $pid) did not stop after SIGTERM; SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$PIDS/registry.pid"
  log "stopped registry (pid $pid); images kept in $DATA"
}

cmd_status() {
  local pid
  if ! pid=$(pid_of); then
    echo "registry                 stopped"
    return 1
  fi
  if answering; then
    echo "registry                 running (pid $pid), answering on $ADDR"
  else
    echo "registry                 running (pid $pid), NOT answering on $ADDR"
    return 1
  fi
}

case ${1:-} in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  addr) echo "$ADDR" ;;
  build) build; echo "$BIN" ;;
  *) echo "usage: $0 up|down|status|addr|build" >&2; exit 2 ;;
esac
