#!/usr/bin/env bash
# Installs a CRIU new enough for this kernel into a private prefix and prints
# the path of a wrapper that runs it.
#
# Why: Debian bookworm's criu 3.17 fails in vDSO detection on current kernels;
# trixie's 4.1.1 checkpoints processes but cannot dump any TCP socket on kernels
# >= 6.16 (getsockopt(SO_PASSCRED) on inet sockets now fails with EOPNOTSUPP;
# fixed in criu 4.2, "Restrict SO_PASSCRED and SO_PASSSEC to supported
# families"). So we take criu from forky (Debian testing, 4.2.x). We must not mix trixie's libc into the system, so the
# packages are fetched with apt's own client pointed at a private sources list,
# lists dir and archive cache (the system's apt configuration and dpkg status
# are never read for resolution nor written), unpacked with dpkg-deb into
# ${PODMOTION_CACHE:-$HOME/.cache/podmotion}/criu-<ver>/root, and run through
# that prefix's own dynamic loader. The loader gets the library path with
# --library-path (same effect as LD_LIBRARY_PATH for criu itself) so that the
# variable is not inherited by programs criu may spawn (ip, iptables-restore
# from the system, which must keep the system libc).
#
# Idempotent: a second run finds the wrapper, checks it still runs, and only
# prints the path. Usage: hack/install-criu.sh [--check]
#   --check  also run `criu check` (needs root) and fail if it fails.
set -euo pipefail

# The suite's current criu is taken (a pinned Debian revision disappears from
# a testing suite when it moves); it must be at least MIN_VERSION.
SUITE="${CRIU_SUITE:-forky}"
MIN_VERSION="${CRIU_MIN_VERSION:-4.2}"
CACHE="${PODMOTION_CACHE:-$HOME/.cache/podmotion}"
# $CACHE/criu is a symlink to the versioned prefix criu-<debian version>.
WRAPPER="$CACHE/criu/bin/criu"

log() { echo "install-criu: $*" >&2; }

run_check() {
  if [[ "${1:-}" == "--check" ]]; then
    "$WRAPPER" check >&2 || { log "criu check failed"; exit 1; }
  fi
}

have=$("$WRAPPER" --version 2>/dev/null | awk '/^Version:/{print $2}' || true)
if [[ -n "$have" ]] && dpkg --compare-versions "$have" ge "$MIN_VERSION"; then
  run_check "${1:-}"
  echo "$WRAPPER"
  exit 0
fi

# Reuse the Debian mirror host the system is already configured with; only
# the suite changes. deb822 (.sources) and one-line formats are both read.
mirror=""
for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
  [[ -r "$f" ]] || continue
  case "$f" in *.sources)
    m=$(awk '/^URIs:/{for(i=2;i<=NF;i++) if($i ~ /\/debian\/?$/){print $i; exit}}' "$f") ;;
  *)
    m=$(awk '$1=="deb"{for(i=2;i<=NF;i++) if($i ~ /^https?:\/\/.*\/debian\/?$/){print $i; exit}}' "$f") ;;
  esac
  if [[ -n "$m" ]]; then mirror="${m%/}"; break; fi
done
[[ -n "$mirror" ]] || { log "no Debian mirror found in /etc/apt"; exit 1; }
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
[[ -r "$keyring" ]] || { log "missing $keyring"; exit 1; }

work="$CACHE/apt-${SUITE}"
mkdir -p "$work/lists/partial" "$work/archives/partial" "$work/cache"
: > "$work/status"
echo "deb [signed-by=$keyring] $mirror $SUITE main" > "$work/sources.list"
apt_opts=(
  -o "Dir::Etc::SourceList=$work/sources.list"
  -o "Dir::Etc::SourceParts=/dev/null"
  -o "Dir::State::Lists=$work/lists"
  -o "Dir::State::status=$work/status"
  -o "Dir::Cache=$work/cache"
  -o "Dir::Cache::Archives=$work/archives"
  -o "APT::Architecture=$(dpkg --print-architecture)"
  -o "Debug::NoLocking=1"
  # The private dirs belong to the caller; apt's _apt sandbox user cannot
  # write them, so download as the caller instead of warning about it.
  -o "APT::Sandbox::User=$(id -un)"
)
log "fetching criu from $mirror $SUITE (private apt state in $work)"
apt-get "${apt_opts[@]}" -qq update
# The runtime closure of criu (libraries only: no maintainer scripts run, so
# the package set is exactly what the loader needs).
mapfile -t pkgs < <(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends \
  --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances criu \
  | grep -v '^ ' | grep -v '^<' | sort -u)
[[ " ${pkgs[*]} " == *" criu "* ]] || { log "criu not in $SUITE"; exit 1; }
CRIU_VERSION=$(apt-cache "${apt_opts[@]}" show criu | awk '/^Version:/{print $2; exit}')
dpkg --compare-versions "$CRIU_VERSION" ge "$MIN_VERSION" \
  || { log "$SUITE has criu $CRIU_VERSION, need >= $MIN_VERSION"; exit 1; }
PREFIX="$CACHE/criu-${CRIU_VERSION}"
rm -f "$work"/archives/*.deb
(cd "$work/archives" && apt-get "${apt_opts[@]}" -qq download "${pkgs[@]}")

tmp="$PREFIX.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp/root" "$tmp/bin"
for deb in "$work"/archives/*.deb; do
  dpkg-deb -x "$deb" "$tmp/root"
done
loader=""
for l in "$tmp"/root/usr/lib64/ld-linux-x86-64.so.2 "$tmp"/root/lib64/ld-linux-x86-64.so.2; do
  if [[ -e "$l" ]]; then loader="$l"; break; fi
done
[[ -n "$loader" ]] || { log "no dynamic loader in the extracted libc6"; exit 1; }
loader="${loader#"$tmp/root"}"
cat > "$tmp/bin/criu" <<WRAP
#!/bin/sh
# Runs criu $CRIU_VERSION from its private prefix with its own libc (see hack/install-criu.sh).
P="$PREFIX/root"
exec "\$P$loader" --library-path "\$P/usr/lib/x86_64-linux-gnu:\$P/lib/x86_64-linux-gnu" "\$P/usr/sbin/criu" "\$@"
WRAP
chmod 0755 "$tmp/bin/criu"
rm -rf "$PREFIX"
mv "$tmp" "$PREFIX"
ln -sfn "criu-${CRIU_VERSION}" "$CACHE/criu"
"$WRAPPER" --version >&2
run_check "${1:-}"
echo "$WRAPPER"
