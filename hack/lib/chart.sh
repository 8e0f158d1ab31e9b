# shellcheck shell=bash
# The chart as users get it: an OCI artifact in a registry (sourced by hack/images.sh and
# hack/install.sh).
#
# chart_push HELM REGISTRY OUT [EPOCH]: `helm package` of charts/podmotion and `helm push`
# to oci://REGISTRY/podmotion/charts/podmotion:<chart version>, plain HTTP (the local
# registry has no TLS). Writes the pinned reference, `oci://REGISTRY/podmotion/charts/
# podmotion@sha256:<digest>`, to OUT and to stdout.
# Reproducible: the same tree gives the same archive, and the manifest's
# `org.opencontainers.image.created` is the archive's mtime (helm push takes it from
# there), set here to EPOCH (default: SOURCE_DATE_EPOCH, else the commit's time) instead
# of the packaging time: the same commit pushed twice gives the same digest
# (`hack/images.sh --check-reproducible` pushes it twice and compares). A changed chart
# under the same version moves the tag; the digest always names exactly what was pushed.
chart_push() {
  local helm=$1 registry=$2 out=$3 epoch=${4:-} root tmp pushed digest
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  [[ -n $epoch ]] || epoch=${SOURCE_DATE_EPOCH:-$(git -C "$root" log -1 --format=%ct HEAD)}
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064 # expand now: tmp is local
  trap "rm -rf '$tmp'" RETURN
  "$helm" package "$root/charts/podmotion" -d "$tmp" >/dev/null 2>"$tmp/package.log" || {
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
