# shellcheck shell=bash
# The chart as users get it: an OCI artifact in a registry (sourced by hack/images.sh and
# hack/install.sh).
#
# chart_push HELM REGISTRY OUT [EPOCH [DIR]]: `helm package` of DIR (default
# charts/podmotion) and `helm push` to oci://REGISTRY/podmotion/charts/podmotion:<chart
# version>, plain HTTP (the local registry has no TLS; REGISTRY may carry a path:
# hack/release.sh stages its pinned chart under 127.0.0.1:15000/release). Writes the
# pinned reference, `oci://REGISTRY/podmotion/charts/podmotion@sha256:<digest>`, to OUT
# and to stdout.
# Reproducible: the same tree gives the same archive (every file's mtime set to EPOCH,
# wherever and whenever it was checked out), and the manifest's
# `org.opencontainers.image.created` is the archive's mtime (helm push takes it from
# there), set here to EPOCH (default: SOURCE_DATE_EPOCH, else the commit's time) instead
# of the packaging time: the same commit pushed twice gives the same digest
# (`hack/images.sh --check-reproducible` pushes it twice and compares). A changed chart
# under the same version moves the tag; the digest always names exactly what was pushed.
chart_push() {
  local helm=$1 registry=$2 out=$3 epoch=${4:-} dir=${5:-} root tmp pushed digest
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  [[ -n $dir ]] || dir=$root/charts/podmotion
  [[ -n $epoch ]] || epoch=${SOURCE_DATE_EPOCH:-$(git -C "$root" log -1 --format=%ct HEAD)}
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064 # expand now: tmp is local
  trap "rm -rf '$tmp'" RETURN
  # helm package writes each file's mtime into the archive: packaged from a copy (-L:
  # files/ links into the repository) whose every mtime is EPOCH, so the archive is the
  # same from any checkout of the commit, not only from the one it was first built in.
  mkdir "$tmp/src"
  cp -RL "$dir" "$tmp/src/podmotion"
  find "$tmp/src" -exec touch -h -d "@$epoch" {} +
  "$helm" package "$tmp/src/podmotion" -d "$tmp" >/dev/null 2>"$tmp/package.log" || {
    cat "$tmp/package.log" >&2
    return 1
  }
  touch -d "@$epoch" "$tmp"/podmotion-*.tgz
  pushed=$("$helm" push "$tmp"/podmotion-*.tgz "oci://$registry/podmotion/charts" --plain-http 2>&1) || {
    echo "$pushed" >&2
    return 1
  }
  digest=$(sed -n 's/^Digest: \(sha256:[0-9a-f]\{64\}\).*/\1/p' <<<"$pushed" | head -n1)
  [[ -n $digest ]] || {
    echo "helm push printed no digest: $pushed" >&2
    return 1
  }
  echo "oci://$registry/podmotion/charts/podmotion@$digest" | tee "$out"
}

# chart_pin DIR OPERATOR AGENT BROKER ATTACH PREFLIGHT: pins the defaults of the chart
# copy in DIR to those images' digests (`sha256:…` each), in the chart's own naming
# (`ghcr.io/podmotion/podmotion-<name>`, which `global.imageRegistry` moves): a release's
# chart then installs with that one value (hack/release.sh). Comments and order of
# values.yaml are kept (hack/lib/fill-values.pl).
chart_pin() {
  local dir=$1 d
  for d in "${@:2}"; do
    [[ $d =~ ^sha256:[0-9a-f]{64}$ ]] || { echo "chart_pin: '$d' is not a sha256 digest" >&2; return 1; }
  done
  (($# == 6)) || { echo "chart_pin: want DIR and five digests" >&2; return 1; }
  perl "$(dirname "${BASH_SOURCE[0]}")/fill-values.pl" "$dir/values.yaml" \
    "image.digest=$2" \
    "migrationAgent.agent.image.digest=$3" \
    "migrationAgent.broker.image.digest=$4" \
    "attachment.agentImage=ghcr.io/podmotion/podmotion-attach@$5" \
    "runnerPool.preflightImage=ghcr.io/podmotion/podmotion-preflight@$6"
}
