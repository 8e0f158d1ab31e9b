# shellcheck shell=bash
# The chart as users get it: an OCI artifact in a registry (sourced by hack/images.sh and
# hack/install.sh).
#
# chart_push HELM REGISTRY OUT: `helm package` of charts/podmotion (reproducible: the same
# tree gives the same archive, so the same digest) and `helm push` to
# oci://REGISTRY/podmotion/charts/podmotion:<chart version>, plain HTTP (the local
# registry has no TLS). Writes the pinned reference, `oci://REGISTRY/podmotion/charts/
# podmotion@sha256:<digest>`, to OUT and to stdout. Pushing an unchanged chart again
# changes nothing; a changed chart under the same version moves the tag, and the digest
# always names exactly what was pushed.
chart_push() {
  local helm=$1 registry=$2 out=$3 root tmp pushed digest
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064 # expand now: tmp is local
  trap "rm -rf '$tmp'" RETURN
  "$helm" package "$root/charts/podmotion" -d "$tmp" >/dev/null 2>"$tmp/package.log" || {
    cat "$tmp/package.log" >&2
    return 1
  }
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
