#!/usr/bin/env bash
# Builds PodMotion's container images without a daemon (buildah, from Debian packages:
# hack/install-image-tools.sh), pushes them to the local registry and pins them by
# digest in a Helm values file.
#
#   hack/images.sh [NAME...]               build and push (default: every image)
#   hack/images.sh --check-reproducible    build everything twice from the same tree, the
#                                          second time in another cargo target dir (kept
#                                          between runs; IMAGES_REPRO_COLD=1: empty) and
#                                          fresh builder storage, no blob reuse, and
#                                          fail naming every image whose digest differs
#                                          (and the kubectl plugin's tarball, compared
#                                          byte for byte)
#   hack/images.sh --binaries              only compile the Rust binaries of every image
#                                          (no registry, no image): the demo runs it in the
#                                          background while the cluster's Go builds run
#   hack/images.sh --verify [NAME...]      build and push, then pull each manifest back from
#                                          the registry and check it: labels, user, size
#                                          (printed as a table on stderr), and that its
#                                          program runs from the unpacked layers (chroot;
#                                          the agent's `criu --version` and, as root,
#                                          `criu check`; the broker's `ip`)
#
# Images (images/<name>/Containerfile), pushed to $PODMOTION_REGISTRY/podmotion/podmotion-<name>
# (the naming of the chart's defaults and of hack/release.sh):
#   operator agent broker attach preflight   shipped by the chart
#   testload                                 test workload only, never in the chart
#   runner-standin                           test stand-in for the Compass Runner (RunnerPool
#                                            real-node test, demo), never in the chart
#   pause                                    the nodes' sandbox image, also tagged :3.10
#
# Every build also checks the size budget: an image the chart ships (operator, agent,
# broker, attach, preflight) over IMAGE_SIZE_LIMIT_MIB (default 20) MiB compressed fails
# it, naming the image; each image's compressed size is logged.
#
# stdout: exactly one line per image,
# `$PODMOTION_REGISTRY/podmotion/podmotion-<name>@sha256:<digest>`.
# Everything else goes to stderr. Also writes $PODMOTION_RUN/images-values.yaml (the
# chart's image keys pinned by digest; hack/install.sh passes it to helm) and, with every
# image built, pushes the chart itself as an OCI artifact
# (oci://$PODMOTION_REGISTRY/podmotion/charts/podmotion, hack/lib/chart.sh), its pinned
# reference in $PODMOTION_RUN/chart.txt, and beside it the kubectl plugin: the static
# `kubectl-podmotion` binary (built with the images' binaries) as a reproducible
# tarball with its .sha256 and its krew manifest (podmotion.yaml, for the release
# download URL PODMOTION_RELEASE_URL) in $PODMOTION_RUN/plugin/, pushed as an OCI artifact to
# $PODMOTION_REGISTRY/podmotion/kubectl-podmotion:<version> (hack/lib/plugin.sh), its
# pinned reference in $PODMOTION_RUN/plugin.txt (with --verify: fetched back, checked
# against its digests and run with --version).
#
# Reproducibility (same commit -> same digests):
#   * every timestamp is SOURCE_DATE_EPOCH, the commit time of HEAD (buildah --timestamp
#     sets the image's created time, its history and every file's mtime in the layers);
#     COPY makes every file root-owned; buildah writes layers in path order;
#   * Rust binaries: Cargo.toml's profile "images" (release without LTO, symbols
#     stripped; "images-lto" with LTO for hack/release.sh), built for
#     x86_64-unknown-linux-musl (static: no base image and no libc to match), with the
#     workspace (built at one fixed path, see build_rust), the cargo home and the target
#     dir remapped to fixed paths, so that the clone's location does not leak into the
#     binaries;
#   * Debian packages (CRIU, tar, gzip and dash from forky for the agent, iproute2 and conntrack from bookworm for
#     the broker) are resolved once and cached as .debs under $PODMOTION_CACHE/images/debs:
#     back-to-back builds use the same files. forky is Debian testing, a moving suite:
#     the same commit built on a fresh machine (empty cache) or after
#     IMAGES_REFRESH_DEBS=1 gets the suite's packages of that day, so the agent's (and,
#     after a bookworm point release, the broker's) digest can differ from an earlier
#     build. The package list of each build is in the cache next to the .debs.
#
# Environment:
#   PODMOTION_REGISTRY   host:port (default: `hack/registry.sh addr`; started if down)
#   PODMOTION_RUN        default /tmp/podmotion-cluster (images-values.yaml, logs)
#   PODMOTION_CACHE      default ~/.cache/podmotion (buildah storage, .debs, staged contexts)
#   CARGO_TARGET_DIR     default $PODMOTION_CACHE/cargo-target (shared with .ci/run)
#   IMAGES_REFRESH_DEBS  1: resolve and download the Debian packages again
#   IMAGES_CARGO_PROFILE images (default: no LTO, what the tests and the demo run) or
#                        images-lto (thin LTO: hack/release.sh's default)
#   PODMOTION_RELEASE_URL where the plugin's tarball is published, for its krew manifest
#                        (default the GitHub release of this version)
set -euo pipefail

# Run under a cargo process (an e2e test runs hack/release.sh, which runs this), the
# environment carries what cargo set for that crate (CARGO_MANIFEST_DIR, CARGO_PKG_*,
# OUT_DIR, ...). Build scripts declare some of them (ring: rerun-if-env-changed=
# CARGO_MANIFEST_DIR) and cargo compares its own environment: left set, ring's build
# reruns and every binary is rebuilt and relinked (19 min here), and the next run from a
# shell does it all again. None of them means anything to this build.
while read -r v; do unset "$v"; done < <(compgen -e |
  grep -E '^(CARGO_(MANIFEST_|PKG_|CRATE_|BIN_|PRIMARY_PACKAGE|TARGET_TMPDIR|CFG_)|OUT_DIR$)' || true)

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

ALL_IMAGES=(operator agent broker attach preflight testload runner-standin pause)
PAUSE_TAG=3.10
RUST_TARGET=x86_64-unknown-linux-musl
CARGO_PROFILE=${IMAGES_CARGO_PROFILE:-images}
[[ $CARGO_PROFILE == images || $CARGO_PROFILE == images-lto ]] ||
  { echo "[images] ERROR: IMAGES_CARGO_PROFILE is images or images-lto, not '$CARGO_PROFILE'" >&2; exit 2; }

CACHE=${PODMOTION_CACHE:-$HOME/.cache/podmotion}
RUN=${PODMOTION_RUN:-/tmp/podmotion-cluster}
WORK=$CACHE/images
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$CACHE/cargo-target}

log() { echo "[images] $*" >&2; }
die() { echo "[images] ERROR: $*" >&2; exit 1; }

check=0
verify=0
binaries=0
names=()
for a in "$@"; do
  case $a in
    --check-reproducible) check=1 ;;
    --verify) verify=1 ;;
    --binaries) binaries=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2; exit 0 ;;
    -*) die "unknown option $a" ;;
    *)
      [[ " ${ALL_IMAGES[*]} " == *" $a "* ]] || die "unknown image '$a' (images: ${ALL_IMAGES[*]})"
      names+=("$a")
      ;;
  esac
done
((${#names[@]})) || names=("${ALL_IMAGES[@]}")
if ((check)) && ((${#names[@]} != ${#ALL_IMAGES[@]})); then
  die "--check-reproducible builds every image; give no names"
fi

"$here/install-image-tools.sh"

T0=$SECONDS
mkdir -p "$WORK" "$RUN"
exec 7>"$WORK/.lock"
flock -n 7 || { log "another hack/images.sh holds $WORK/.lock; waiting"; flock 7; }

# ---------------------------------------------------------------- inputs

cd "$repo"
REVISION=$(git rev-parse HEAD)
SOURCE_DATE_EPOCH=$(git log -1 --format=%ct HEAD)
export SOURCE_DATE_EPOCH
if ! git diff --quiet HEAD -- 2>/dev/null; then
  log "note: the work tree has uncommitted changes; images are built from it, labelled revision $REVISION-dirty"
  REVISION=$REVISION-dirty
fi
VERSION=$(sed -n '/^\[workspace.package\]/,/^\[/{s/^version = "\(.*\)"$/\1/p}' Cargo.toml)
[[ -n $VERSION ]] || die "no version in [workspace.package] of Cargo.toml"
SOURCE=$(sed -n '/^\[workspace.package\]/,/^\[/{s/^repository = "\(.*\)"$/\1/p}' Cargo.toml)
SOURCE=${SOURCE:-https://github.com/podmotion/podmotion}
TAG=${REVISION:0:12}${REVISION#"${REVISION%-dirty}"}

# ---------------------------------------------------------------- rust binaries

declare -A BIN_OF=(
  [operator]=podmotion-operator [agent]=podmotion-agent [broker]=podmotion-broker
  [attach]=podmotion-attach [preflight]=podmotion-preflight [testload]=podmotion-testload
  [runner-standin]=podmotion-runner-standin
)
declare -A PKG_OF=(
  [podmotion-operator]=podmotion-operator [podmotion-agent]=podmotion-agent
  [podmotion-testload]=podmotion-agent [podmotion-broker]=podmotion-broker
  [podmotion-attach]=podmotion-attach [podmotion-preflight]=podmotion-preflight
  [podmotion-runner-standin]=podmotion-preflight
  # Not an image: the kubectl plugin's release artifact (hack/lib/plugin.sh).
  [kubectl-podmotion]=kubectl-podmotion
)

# Builds every binary of every image in one cargo invocation (always the full set, so
# feature unification, and with it each binary, does not depend on which images were
# asked for). Prints the directory holding the binaries.
#
# The tree is built at one fixed path, $SRC_MOUNT, bind-mounted in a mount namespace
# of the build's own (gone with it): the paths remapped in RUSTFLAGS, and with them
# every dependency's fingerprint, are the same for every clone and copy of the tree —
# CI's fresh clone, a test's worktree with the version bumped (real_upgrade) — so only
# the workspace's own crates compile again. (Remapping the clone's own path made each
# new clone recompile every dependency, twice with --check-reproducible: ~30 min of a
# CI run.) Without root (no mount namespace) the tree is built where it is.
SRC_MOUNT=$WORK/src
build_rust() { # target-dir
  local target_dir=$1 cargo_home=${CARGO_HOME:-$HOME/.cargo} b src=$SRC_MOUNT
  ((EUID == 0)) || src=$repo
  local remap="--remap-path-prefix=$src=/podmotion --remap-path-prefix=$cargo_home=/cargo"
  remap+=" --remap-path-prefix=$target_dir=/target"
  local -a sel=()
  for b in "${!PKG_OF[@]}"; do sel+=(-p "${PKG_OF[$b]}" --bin "$b"); done
  local start=$SECONDS
  log "cargo build (profile $CARGO_PROFILE, $RUST_TARGET) of $repo at $src into $target_dir"
  # Cargo.toml's profiles: "images" (release without LTO, symbols stripped) for the
  # tests and the demo, "images-lto" (with release's thin LTO) for hack/release.sh.
  # RUSTFLAGS for the target only (build scripts and proc macros are not affected).
  # SOURCE_DATE_EPOCH is pinned for cargo: the cc crate (ring, psm) reruns its build
  # script when it changes, and with it every crate above them; the C objects do not
  # depend on it (no __DATE__/__TIME__), and the archive is written deterministically.
  local -a build=(env SOURCE_DATE_EPOCH=0 CARGO_TARGET_DIR="$target_dir"
    CARGO_TARGET_X86_64_UNKNOWN_LINUX_MUSL_RUSTFLAGS="$remap"
    CC_x86_64_unknown_linux_musl=musl-gcc
    CFLAGS_x86_64_unknown_linux_musl="${remap//--remap-path-prefix=/-ffile-prefix-map=}"
    cargo build --locked --target "$RUST_TARGET" --profile "$CARGO_PROFILE" "${sel[@]}")
  if [[ $src == "$repo" ]]; then
    (cd "$repo" && "${build[@]}") >&2
  else
    mkdir -p "$src"
    # shellcheck disable=SC2016 # expanded by the inner shell
    unshare --mount --propagation private -- bash -c \
      'mount --bind "$1" "$2" && cd "$2" && shift 2 && exec "$@"' _ "$repo" "$src" "${build[@]}" >&2
  fi || die "cargo build of the image binaries failed"
  log "cargo build done in $((SECONDS - start))s"
  echo "$target_dir/$RUST_TARGET/$CARGO_PROFILE"
}

# ---------------------------------------------------------------- pause

build_pause() { # out-file
  local src
  src=$(cd "$WORK" && GOFLAGS=-mod=mod GOTOOLCHAIN=local go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  [[ -n $src && -f $src/build/pause/linux/pause.c ]] ||
    die "k8s.io/kubernetes@$KUBE_VERSION source not found (go mod download)"
  local tag
  tag=$(sed -n 's/^TAG ?= *//p' "$src/build/pause/Makefile")
  # Upstream: CFLAGS = -Os -Wall -Werror -static -DVERSION=v$(TAG)-$(REV)
  gcc -Os -Wall -Werror -static "-ffile-prefix-map=$src=/kubernetes" \
    "-DVERSION=v${tag}-${KUBE_VERSION}" -o "$1" "$src/build/pause/linux/pause.c" ||
    die "gcc of build/pause/linux/pause.c failed"
  strip "$1"
}

# ---------------------------------------------------------------- Debian roots

debian_mirror() {
  local f m
  for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -r $f ]] || continue
    case $f in
      *.sources) m=$(awk '/^URIs:/{for(i=2;i<=NF;i++) if($i ~ /\/debian\/?$/){print $i; exit}}' "$f") ;;
      *) m=$(awk '$1=="deb"{for(i=2;i<=NF;i++) if($i ~ /^https?:\/\/.*\/debian\/?$/){print $i; exit}}' "$f") ;;
    esac
    if [[ -n $m ]]; then echo "${m%/}"; return 0; fi
  done
  return 1
}

# Resolves and downloads the runtime closure of packages from a Debian suite with a
# private apt state (the system's apt configuration and dpkg status are never read for
# resolution nor written, as in hack/install-criu.sh). Cached: the .debs of one set stay
# until IMAGES_REFRESH_DEBS=1. Prints the directory holding the .debs.
fetch_debs() { # set-name suite exclude-regex packages...
  local set=$1 suite=$2 exclude=$3
  shift 3
  local dir=$WORK/debs/$set
  if [[ -f $dir/.complete && ${IMAGES_REFRESH_DEBS:-0} != 1 &&
    "$(cat "$dir/.complete")" == "$suite $*" ]]; then
    echo "$dir"
    return 0
  fi
  local mirror keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  mirror=$(debian_mirror) || die "no Debian mirror found in /etc/apt"
  [[ -r $keyring ]] || die "missing $keyring"
  local apt=$WORK/apt-$suite
  mkdir -p "$apt/lists/partial" "$apt/cache" "$apt/archives/partial"
  : >"$apt/status"
  echo "deb [signed-by=$keyring] $mirror $suite main" >"$apt/sources.list"
  local -a opts=(
    -o "Dir::Etc::SourceList=$apt/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::State::Lists=$apt/lists" -o "Dir::State::status=$apt/status"
    -o "Dir::Cache=$apt/cache" -o "Dir::Cache::Archives=$apt/archives"
    -o "APT::Architecture=$(dpkg --print-architecture)" -o "Debug::NoLocking=1"
    -o "APT::Sandbox::User=$(id -un)"
  )
  log "resolving $* from $mirror $suite (private apt state $apt)"
  apt-get "${opts[@]}" -qq update >&2 || die "apt-get update of $suite failed"
  # The closure of Depends and Pre-Depends, taking the first alternative of an or-group
  # (`apt-cache depends --recurse` would follow every alternative and every provider of
  # a virtual package) and leaving out what only maintainer scripts use.
  local -a pkgs=() queue=("$@")
  local -A seen=()
  local p d
  while ((${#queue[@]})); do
    p=${queue[0]}
    queue=("${queue[@]:1}")
    [[ -n ${seen[$p]:-} ]] && continue
    seen[$p]=1
    [[ $p =~ ^($exclude)$ ]] && continue
    pkgs+=("$p")
    while read -r d; do
      [[ -z ${seen[$d]:-} ]] && queue+=("$d")
    done < <(apt-cache "${opts[@]}" depends --no-recommends --no-suggests --no-conflicts \
      --no-breaks --no-replaces --no-enhances "$p" |
      awk '/^ [ |](Pre)?Depends: / { alt = ($0 ~ /^ \|/); if (!inor && $2 !~ /^</) print $2; inor = alt }')
  done
  ((${#pkgs[@]})) || die "no packages resolved for $* in $suite"
  mapfile -t pkgs < <(printf '%s\n' "${pkgs[@]}" | sort -u)
  local tmp=$dir.tmp
  rm -rf "$tmp"
  mkdir -p "$tmp"
  (cd "$tmp" && apt-get "${opts[@]}" -qq download "${pkgs[@]}" >&2) || die "downloading $* from $suite failed"
  # shellcheck disable=SC2016 # dpkg-deb's format, not ours
  (cd "$tmp" && for d in *.deb; do dpkg-deb -W --showformat '${Package} ${Version}\n' "$d"; done) >"$tmp/packages.txt"
  echo "$suite $*" >"$tmp/.complete"
  rm -rf "$dir"
  mv "$tmp" "$dir"
  log "cached ${#pkgs[@]} packages in $dir"
  echo "$dir"
}

# Unpacks .debs into a root (no maintainer scripts run: the images need only files),
# usr-merges it, and drops documentation (keeping the copyright files), locales and
# charset converters.
debian_root() { # deb-dir out-root
  local debs=$1 root=$2 d
  rm -rf "$root"
  mkdir -p "$root"
  for d in "$debs"/*.deb; do dpkg-deb -x "$d" "$root"; done
  for d in bin sbin lib lib64; do
    if [[ -d $root/$d && ! -L $root/$d ]]; then
      mkdir -p "$root/usr/$d"
      cp -a "$root/$d/." "$root/usr/$d/"
      rm -rf "${root:?}/$d"
    fi
    [[ -e $root/usr/$d ]] && ln -s "usr/$d" "$root/$d"
  done
  find "$root/usr/share/doc" -mindepth 2 ! -name copyright ! -type d -delete 2>/dev/null || true
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
  rm -rf "$root"/usr/share/{man,info,locale,lintian,bash-completion,zsh,bug}
  # glibc's iconv modules (8 MiB): neither criu nor ip converts charsets.
  rm -rf "$root"/usr/lib/x86_64-linux-gnu/gconv
  # criu makes its probe directories in /tmp and caches kernel features in /run.
  install -d -m 1777 "$root/tmp"
  install -d -m 0755 "$root/run"
}

# ---------------------------------------------------------------- contexts

stage() { # name bindir ctx
  local name=$1 bindir=$2 ctx=$3 debs
  rm -rf "$ctx"
  mkdir -p "$ctx"
  case $name in
    pause) build_pause "$ctx/pause" ;;
    *) install -m 0755 "$bindir/${BIN_OF[$name]}" "$ctx/${BIN_OF[$name]}" ;;
  esac
  case $name in
    agent)
      # gconv modules: criu does no charset conversion. tar: CRIU archives the content
      # of a container's tmpfs mounts (its /dev) with it, compressed by gzip, which tar
      # starts through /bin/sh (dash). debconf only matters to maintainer scripts.
      debs=$(fetch_debs agent-forky forky 'libc-gconv-modules-extra|debconf' criu tar gzip dash)
      debian_root "$debs" "$ctx/rootfs"
      ;;
    broker)
      # debconf (and perl with it) only matters to maintainer scripts, which never run.
      # conntrack: an unlock makes the node forget unanswered connections to the pod.
      # nftables: forward_connections sends a locked source's new connections to its
      # target (an nft table of the migration's in the node's namespace).
      # iptables (its nf_tables variant, `iptables-nft`): the lock holds those
      # connections' SYNs in a queue of the node's (xt NFQUEUE: kernels without nft's
      # queue expression have it) until the forward or the unlock.
      debs=$(fetch_debs broker-bookworm bookworm 'debconf' iproute2 conntrack nftables iptables)
      debian_root "$debs" "$ctx/rootfs"
      ;;
  esac
}

# ---------------------------------------------------------------- buildah

buildah_in() { # storage-dir args...
  local store=$1
  shift
  buildah --root "$store/root" --runroot "$store/runroot" --storage-driver vfs "$@"
}

# Builds one image in the given storage and pushes it to dest (a containers-transport
# reference). Prints the manifest digest.
build_push() { # name ctx store dest...
  local name=$1 ctx=$2 store=$3
  shift 3
  local img=localhost/podmotion/$name:build dfile
  dfile=$(mktemp)
  local -a args=(--build-arg "SOURCE=$SOURCE" --build-arg "REVISION=$REVISION" --build-arg "VERSION=$VERSION")
  [[ $name == pause ]] && args+=(--build-arg "KUBE_VERSION=$KUBE_VERSION")
  # --layers=false: one layer per image, no intermediate cache; chroot isolation: no
  # container runtime (our Containerfiles have no RUN step anyway).
  BUILDAH_ISOLATION=chroot buildah_in "$store" build --quiet --format oci --layers=false \
    --timestamp "$SOURCE_DATE_EPOCH" "${args[@]}" \
    -f "$repo/images/$name/Containerfile" -t "$img" "$ctx" >/dev/null ||
    die "buildah build of $name failed"
  local dest
  for dest in "$@"; do
    buildah_in "$store" push --quiet --tls-verify=false --digestfile "$dfile" "$img" "$dest" >&2 ||
      die "buildah push of $name to $dest failed"
  done
  cat "$dfile"
  rm -f "$dfile"
}

registry_has() { # name digest
  [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 5 \
    -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
    -I "http://$REGISTRY/v2/podmotion/podmotion-$1/manifests/$2") == 200 ]]
}

ctx_hash() { # name ctx
  {
    printf '%s\n' "$1" "$SOURCE" "$REVISION" "$VERSION" "$SOURCE_DATE_EPOCH" "$KUBE_VERSION" "$(buildah --version)"
    cat "$repo/images/$1/Containerfile"
    tar -C "$2" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - .
  } | sha256sum | cut -d' ' -f1
}

# ---------------------------------------------------------------- verify

declare -A BASE_OF=(
  [operator]="scratch, static musl binary" [attach]="scratch, static musl binary"
  [preflight]="scratch, static musl binary" [testload]="scratch, static musl binary"
  [runner-standin]="scratch, static musl binary"
  [pause]="scratch, static glibc binary (gcc -Os -static)"
  [agent]="Debian forky criu + library closure (.debs), static musl binary"
  [broker]="Debian bookworm iproute2, conntrack, nftables and iptables + library closure (.debs), static musl binary"
)
declare -A USER_OF=(
  [operator]=65532:65532 [preflight]=65532:65532 [testload]=65532:65532 [pause]=65535:65535
  [runner-standin]=65532:65532
  [agent]=0:0 [broker]=0:0 [attach]=0:0
)

reg_get() { # name path (manifests/<ref> or blobs/<digest>)
  curl -fsS --max-time 60 -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
    "http://$REGISTRY/v2/podmotion/podmotion-$1/$2"
}

# Runs (execs: call it in a subshell) a command chrooted into an unpacked image root, with /proc mounted in a private
# mount namespace (nothing of the host's filesystem is visible to it).
in_root() { # root userspec command...
  local root=$1 user=$2
  shift 2
  mkdir -p "$root/proc" "$root/dev"
  # exec: the caller's $! (when run in the background) is then the program itself.
  exec 7>&-
  # shellcheck disable=SC2016 # the inner shell expands its own arguments
  exec unshare --mount --propagation private -- sh -c '
    mount --bind "$1" "$1" && mount -t proc proc "$1/proc" && mount --rbind /dev "$1/dev" || exit 99
    r=$1 u=$2; shift 2
    exec chroot --userspec="$u" "$r" "$@"' sh "$root" "$user" "$@"
}

verify_image() { # name digest -> 0 if every check passed
  local n=$1 digest=$2 tmp m cfg size=0 l fail=0 out rc
  tmp=$(mktemp -d)
  m=$(reg_get "$n" "manifests/$digest") || { log "$n: manifest $digest not in the registry"; return 1; }
  [[ $(printf '%s' "$m" | sha256sum | cut -d' ' -f1) == "${digest#sha256:}" ]] ||
    { log "$n: manifest content does not match $digest"; fail=1; }
  cfg=$(reg_get "$n" "blobs/$(jq -r .config.digest <<<"$m")")
  local want k v
  for k in source revision version; do
    v=$(jq -r --arg k "org.opencontainers.image.$k" '.config.Labels[$k] // ""' <<<"$cfg")
    case $k in source) want=$SOURCE ;; revision) want=$REVISION ;; version) want=$VERSION ;; esac
    [[ $v == "$want" ]] || { log "$n: label org.opencontainers.image.$k is '$v', want '$want'"; fail=1; }
  done
  v=$(jq -r '.config.User // ""' <<<"$cfg")
  [[ $v == "${USER_OF[$n]}" ]] || { log "$n: user '$v', want '${USER_OF[$n]}'"; fail=1; }
  v=$(jq -r '.created' <<<"$cfg")
  [[ $v == "$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)" ]] ||
    { log "$n: created '$v' is not the commit time"; fail=1; }
  mkdir -p "$tmp/root"
  for l in $(jq -r '.layers[].digest' <<<"$m"); do
    reg_get "$n" "blobs/$l" | tar -xzf - -C "$tmp/root" || { log "$n: layer $l does not unpack"; fail=1; }
  done
  size=$(jq '[.layers[].size] | add' <<<"$m")
  local -a ep
  mapfile -t ep < <(jq -r '.config.Entrypoint[]' <<<"$cfg")
  local user=${USER_OF[$n]}
  case $n in
    operator | agent | broker | attach)
      out=$(in_root "$tmp/root" "$user" "${ep[@]}" --help 2>&1) || { log "$n: ${ep[*]} --help failed: $out"; fail=1; }
      ;;
    preflight)
      out=$(in_root "$tmp/root" "$user" "${ep[@]}" --termination-log=/dev/null 2>&1) && rc=0 || rc=$?
      [[ $rc -le 1 && $out == *'{'* ]] || { log "$n: no verdict (exit $rc): $out"; fail=1; }
      ;;
    testload)
      (in_root "$tmp/root" "$user" "${ep[@]}" serve 18089 >/dev/null 2>&1) &
      local pid=$! reply=""
      for _ in $(seq 50); do
        reply=$({ exec 3<>/dev/tcp/127.0.0.1/18089 && echo get >&3 && timeout 2 head -n1 <&3; } 2>/dev/null) && break
        sleep 0.1
      done
      # unshare, sh and chroot exec each other: $pid is podmotion-testload itself.
      kill "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
      [[ $reply =~ ^[0-9]+$ ]] || { log "$n: serve 18089 did not answer 'get' with a counter: '$reply'"; fail=1; }
      out="counter $reply"
      ;;
    pause)
      out=$(in_root "$tmp/root" "$user" "${ep[@]}" -v 2>&1) || { log "$n: /pause -v failed: $out"; fail=1; }
      ;;
    runner-standin)
      out=$(in_root "$tmp/root" "$user" "${ep[@]}" report 2>&1) || true
      [[ $out == *'"runner":"standin-v1"'* ]] || { log "$n: report printed no report: $out"; fail=1; }
      ;;
  esac
  case $n in
    agent)
      v=$(in_root "$tmp/root" 0:0 criu --version 2>&1) || { log "agent: criu --version failed: $v"; fail=1; }
      v=$(awk '/^Version:/{print $2}' <<<"$v")
      dpkg --compare-versions "${v:-0}" ge 4.2 || { log "agent: criu ${v:-?} < 4.2"; fail=1; }
      out="criu $v"
      if ((EUID == 0)); then
        if v=$(in_root "$tmp/root" 0:0 criu check 2>&1); then out+=", criu check: ${v##*$'\n'}"
        else log "agent: criu check failed (needs root and this kernel): $v"; fail=1; fi
      fi
      ;;
    broker)
      v=$(in_root "$tmp/root" 0:0 ip -o link show lo 2>&1) || { log "broker: ip -o link show lo failed: $v"; fail=1; }
      c=$(in_root "$tmp/root" 0:0 conntrack --version 2>&1) || { log "broker: conntrack --version failed: $c"; fail=1; }
      t=$(in_root "$tmp/root" 0:0 nft --version 2>&1) || { log "broker: nft --version failed: $t"; fail=1; }
      x=$(in_root "$tmp/root" 0:0 iptables-nft --version 2>&1) || { log "broker: iptables-nft --version failed: $x"; fail=1; }
      for r in iptables-nft-restore ip6tables-nft-restore; do
        y=$(in_root "$tmp/root" 0:0 "$r" --version 2>&1) || { log "broker: $r --version failed: $y"; fail=1; }
      done
      out="ip: ${v:0:24}; ${c:0:24}; ${t:0:24}; ${x:0:24}"
      ;;
  esac
  out=${out%%$'\n'*}
  printf '%s\t%s\t%s\t%s\n' "$n" "$size" "$digest" "${out:0:100}" >"$tmp/row"
  cat "$tmp/row" >>"$VERIFY_ROWS"
  rm -rf "$tmp"
  return "$fail"
}

# ---------------------------------------------------------------- main

if ((binaries)); then
  build_rust "$CARGO_TARGET_DIR" >/dev/null
  exit 0
fi

if [[ -z ${PODMOTION_REGISTRY:-} ]]; then
  # 7>&-: the registry daemon must not inherit (and hold) our lock.
  "$here/registry.sh" status >/dev/null 2>&1 || "$here/registry.sh" up 7>&-
  PODMOTION_REGISTRY=$("$here/registry.sh" addr)
fi
REGISTRY=$PODMOTION_REGISTRY
curl -fsS --max-time 5 "http://$REGISTRY/v2/" >/dev/null || die "registry $REGISTRY does not answer on /v2/"

need_rust=0
for n in "${names[@]}"; do [[ -n ${BIN_OF[$n]:-} ]] && need_rust=1; done
bindir=""
((need_rust)) && bindir=$(build_rust "$CARGO_TARGET_DIR")

STORE=$WORK/buildah
declare -A DIGEST=()
for n in "${names[@]}"; do
  ctx=$WORK/ctx/$n
  stage "$n" "$bindir" "$ctx"
  h=$(ctx_hash "$n" "$ctx")
  memo=$WORK/built/$n.$h
  if [[ -f $memo ]] && registry_has "$n" "$(cat "$memo")"; then
    DIGEST[$n]=$(cat "$memo")
    log "$n: unchanged, ${DIGEST[$n]}"
  else
    dests=("docker://$REGISTRY/podmotion/podmotion-$n:$TAG")
    [[ $n == pause ]] && dests+=("docker://$REGISTRY/podmotion/podmotion-$n:$PAUSE_TAG")
    start=$SECONDS
    DIGEST[$n]=$(build_push "$n" "$ctx" "$STORE" "${dests[@]}")
    mkdir -p "$WORK/built"
    rm -f "$WORK/built/$n".*
    echo "${DIGEST[$n]}" >"$memo"
    log "$n: built and pushed in $((SECONDS - start))s, ${DIGEST[$n]}"
  fi
done

# Size budget: every image the chart ships stays at most IMAGE_SIZE_LIMIT_MIB (20 MiB,
# DESIGN.md's target) compressed, as pulled: the sum of its layers in the registry. The
# test-only images (testload, runner-standin, pause) are listed, not limited.
limit_mib=${IMAGE_SIZE_LIMIT_MIB:-20}
too_big=()
for n in "${names[@]}"; do
  bytes=$(reg_get "$n" "manifests/${DIGEST[$n]}" | jq '[.layers[].size] | add') ||
    die "$n: cannot read its manifest back from the registry"
  mib=$(awk -v b="$bytes" 'BEGIN{printf "%.2f", b/1048576}')
  case $n in
    operator | agent | broker | attach | preflight)
      if ((bytes > limit_mib * 1048576)); then
        log "$n: $mib MiB compressed, over the ${limit_mib} MiB budget"
        too_big+=("$n")
      else
        log "$n: $mib MiB compressed (budget ${limit_mib} MiB)"
      fi
      ;;
    *) log "$n: $mib MiB compressed (test image, no budget)" ;;
  esac
done
((${#too_big[@]} == 0)) || die "images over ${limit_mib} MiB compressed: ${too_big[*]}"

# Images replaced by this build are unreferenced now (vfs keeps a full copy of each).
buildah_in "$STORE" rmi --prune >/dev/null 2>&1 || true

if ((check)); then
  log "reproducibility: second build (its own cargo target dir at another path, fresh builder storage)"
  scratch=$(mktemp -d "$WORK/repro.XXXXXX")
  trap 'rm -rf "$scratch"' EXIT
  # The second compilation's target dir is at another path than the first's. It is kept
  # between runs (CI's time budget: a warm machine recompiles only the crates that
  # changed, in both dirs; a fresh machine compiles everything twice);
  # IMAGES_REPRO_COLD=1 starts it empty, as the first proof did.
  target2=$WORK/repro-cargo-target
  [[ ${IMAGES_REPRO_COLD:-0} == 1 ]] && target2=$scratch/cargo-target
  bindir2=$(build_rust "$target2")
  bad=()
  for n in "${names[@]}"; do
    ctx=$scratch/ctx/$n
    stage "$n" "$bindir2" "$ctx"
    # To a fresh OCI layout: nothing in it or in the registry can be reused.
    d=$(build_push "$n" "$ctx" "$scratch/buildah" "oci:$scratch/oci-$n:$n")
    if [[ $d == "${DIGEST[$n]}" ]]; then
      log "$n: reproducible, $d"
    else
      log "$n: NOT reproducible: first ${DIGEST[$n]}, second $d"
      bad+=("$n")
    fi
  done
  # shellcheck source=lib/plugin.sh
  source "$here/lib/plugin.sh"
  p1=$(plugin_tarball "$bindir/kubectl-podmotion" "$VERSION" "$SOURCE_DATE_EPOCH" "$scratch/plugin-1")
  p2=$(plugin_tarball "$bindir2/kubectl-podmotion" "$VERSION" "$SOURCE_DATE_EPOCH" "$scratch/plugin-2")
  if cmp -s "$p1" "$p2"; then
    log "kubectl-podmotion: reproducible, $(cut -d' ' -f1 "$p1.sha256")"
  else
    log "kubectl-podmotion: NOT reproducible: $(cut -d' ' -f1 "$p1.sha256") vs $(cut -d' ' -f1 "$p2.sha256")"
    bad+=(kubectl-podmotion)
  fi
  if ((${#bad[@]})); then
    die "digests differ between two builds of $REVISION: ${bad[*]}"
  fi
  log "every image reproducible (${#names[@]} images)"
fi

if ((verify)); then
  VERIFY_ROWS=$(mktemp)
  bad=()
  for n in "${names[@]}"; do
    if verify_image "$n" "${DIGEST[$n]}"; then log "$n: verified"; else bad+=("$n"); fi
  done
  {
    echo "image       compressed   base / check"
    while IFS=$'\t' read -r n size _ out; do
      printf '%-10s %7.2f MiB   %s\n             %s\n' "$n" "$(awk -v s="$size" 'BEGIN{print s/1048576}')" "${BASE_OF[$n]}" "$out"
    done <"$VERIFY_ROWS"
  } >&2
  rm -f "$VERIFY_ROWS"
  ((${#bad[@]} == 0)) || die "verification failed for: ${bad[*]}"
fi

# One line per image on stdout.
for n in "${names[@]}"; do echo "$REGISTRY/podmotion/podmotion-$n@${DIGEST[$n]}"; done

if ((${#names[@]} == ${#ALL_IMAGES[@]})); then
  values=$RUN/images-values.yaml
  cat >"$values.tmp" <<EOF
# Written by hack/images.sh: PodMotion's images from $REGISTRY, pinned by digest.
# Revision $REVISION. Pass to helm with -f.
image:
  repository: $REGISTRY/podmotion/podmotion-operator
  digest: ${DIGEST[operator]}
migrationAgent:
  agent:
    image:
      repository: $REGISTRY/podmotion/podmotion-agent
      digest: ${DIGEST[agent]}
  broker:
    image:
      repository: $REGISTRY/podmotion/podmotion-broker
      digest: ${DIGEST[broker]}
attachment:
  agentImage: $REGISTRY/podmotion/podmotion-attach@${DIGEST[attach]}
runnerPool:
  preflightImage: $REGISTRY/podmotion/podmotion-preflight@${DIGEST[preflight]}
EOF
  mv "$values.tmp" "$values"
  log "wrote $values"
  # shellcheck source=lib/chart.sh
  source "$here/lib/chart.sh"
  chart=$(chart_push "$(bash "$here/build-helm.sh")" "$REGISTRY" "$RUN/chart.txt" "$SOURCE_DATE_EPOCH") ||
    die "pushing the chart failed"
  log "pushed the chart: $chart"
  if ((check)); then
    # Packaged and pushed again, a second later, from a copy whose files are newer (as a
    # fresh checkout's are): the same digest, or a GitOps repository that pins it could
    # not verify a rebuild.
    sleep 1
    cp -RL "$repo/charts/podmotion" "$scratch/chart-copy"
    chart2=$(chart_push "$(bash "$here/build-helm.sh")" "$REGISTRY" "$scratch/chart.txt" "$SOURCE_DATE_EPOCH" \
      "$scratch/chart-copy") ||
      die "pushing the chart again failed"
    [[ $chart2 == "$chart" ]] || die "the chart is NOT reproducible: first $chart, second $chart2"
    log "chart: reproducible, ${chart##*@}"
  fi
  # shellcheck source=lib/plugin.sh
  source "$here/lib/plugin.sh"
  rm -rf "$RUN/plugin"
  plugin_tgz=$(plugin_tarball "$bindir/kubectl-podmotion" "$VERSION" "$SOURCE_DATE_EPOCH" "$RUN/plugin")
  plugin=$(plugin_push "$plugin_tgz" "$REGISTRY" "$REVISION" "$SOURCE_DATE_EPOCH" "$RUN/plugin.txt") ||
    die "pushing the kubectl plugin failed"
  log "pushed the kubectl plugin: $plugin (tarball sha256 $(cut -d' ' -f1 "$plugin_tgz.sha256"))"
  plugin_krew_manifest "$plugin_tgz" "${PODMOTION_RELEASE_URL:-https://github.com/podmotion/podmotion/releases/download/v$VERSION}" \
    "$RUN/plugin/podmotion.yaml" >/dev/null
  if ((verify)); then
    ptmp=$(mktemp -d)
    got=$(plugin_fetch "$plugin" "$ptmp") || die "fetching the kubectl plugin back failed"
    tar -xzf "$got" -C "$ptmp" || die "the kubectl plugin's tarball does not unpack"
    v=$("$ptmp/kubectl-podmotion" --version 2>&1) || die "kubectl-podmotion --version failed: $v"
    ! command -v file >/dev/null || file -b "$ptmp/kubectl-podmotion" | grep -q static ||
      log "note: kubectl-podmotion is not reported static by file(1): $(file -b "$ptmp/kubectl-podmotion" 2>&1)"
    log "kubectl-podmotion: verified, $v"
    rm -rf "$ptmp"
  fi
fi
log "done in $((SECONDS - T0))s"
