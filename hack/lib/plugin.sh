# shellcheck shell=bash
# The kubectl plugin as users get it: an image-less release artifact beside the chart
# (sourced by hack/images.sh; the functions can be used on their own).
#
# plugin_tarball BIN VERSION EPOCH OUTDIR: a reproducible tarball of the static
# `kubectl-podmotion` binary BIN and the project's LICENSE (tar sorted by name, every
# mtime EPOCH, owner 0:0, gzip without name or time),
# `kubectl-podmotion-VERSION-linux-amd64.tar.gz`, and its `.sha256` (sha256sum format)
# in OUTDIR. Prints the tarball's path.
#
# plugin_krew_manifest TARBALL URL_BASE OUT: the krew manifest (`podmotion.yaml`, the
# file krew-index holds as `plugins/podmotion.yaml`) of TARBALL as published at
# URL_BASE/<its name>: version, sha256, the files to install (binary and LICENSE) and
# the one platform it is built for. hack/krew-check.sh validates it with krew's own
# tools and installs the plugin from it.
#
# plugin_push TARBALL REGISTRY REVISION EPOCH OUT: pushes TARBALL to
# REGISTRY/podmotion/kubectl-podmotion:<version> as an OCI artifact (OCI image manifest,
# artifactType application/vnd.podmotion.kubectl-plugin.v1, the empty config, one
# tar+gzip layer titled with the file name) with plain HTTP, through the registry's
# own API. The manifest holds nothing but the tarball's digest, its name and the
# revision, so the same tree gives the same manifest digest. Writes the pinned
# reference `REGISTRY/podmotion/kubectl-podmotion@sha256:<digest>` to OUT and stdout.
#
# plugin_fetch REFERENCE DIR: fetches the artifact back (manifest, then the layer,
# checked against its digest) into DIR. Prints the tarball's path.

PLUGIN_ARTIFACT_TYPE=application/vnd.podmotion.kubectl-plugin.v1
PLUGIN_REPO=podmotion/kubectl-podmotion
PLUGIN_LICENSE=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/LICENSE

plugin_tarball() {
  local bin=$1 version=$2 epoch=$3 out=$4 stage name
  name=kubectl-podmotion-$version-linux-amd64.tar.gz
  stage=$(mktemp -d)
  # shellcheck disable=SC2064 # expand now: stage is local
  trap "rm -rf '$stage'" RETURN
  install -m 0755 "$bin" "$stage/kubectl-podmotion"
  # krew installs only what a manifest's `files` names and wants a license among it.
  install -m 0644 "$PLUGIN_LICENSE" "$stage/LICENSE"
  mkdir -p "$out"
  tar --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner --format=gnu \
    -C "$stage" -cf - LICENSE kubectl-podmotion | gzip -9 -n >"$out/$name"
  (cd "$out" && sha256sum "$name" >"$name.sha256")
  echo "$out/$name"
}

# _plugin_blob REGISTRY FILE DIGEST: uploads FILE as a blob unless the registry has it.
_plugin_blob() {
  local registry=$1 file=$2 digest=$3 loc
  curl -fsS -o /dev/null --head "http://$registry/v2/$PLUGIN_REPO/blobs/$digest" 2>/dev/null && return 0
  loc=$(curl -fsS -X POST -D - -o /dev/null "http://$registry/v2/$PLUGIN_REPO/blobs/uploads/" |
    sed -n 's/^[Ll]ocation: *\([^[:space:]]*\).*/\1/p') || return 1
  [[ -n $loc ]] || { echo "the registry gave no upload location" >&2; return 1; }
  [[ $loc == http* ]] || loc=http://$registry$loc
  [[ $loc == *\?* ]] && loc+="&digest=$digest" || loc+="?digest=$digest"
  curl -fsS -X PUT -H 'Content-Type: application/octet-stream' --data-binary "@$file" "$loc" >/dev/null
}

plugin_push() {
  local tgz=$1 registry=$2 revision=$3 epoch=$4 out=$5 tmp name version size digest manifest mdigest
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064 # expand now: tmp is local
  trap "rm -rf '$tmp'" RETURN
  name=$(basename "$tgz")
  version=${name#kubectl-podmotion-}
  version=${version%-linux-amd64.tar.gz}
  size=$(stat -c %s "$tgz")
  digest=sha256:$(sha256sum "$tgz" | cut -d' ' -f1)
  printf '{}' >"$tmp/config"
  _plugin_blob "$registry" "$tgz" "$digest" || return 1
  _plugin_blob "$registry" "$tmp/config" "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a" || return 1
  manifest=$(jq -cn --arg t "$PLUGIN_ARTIFACT_TYPE" --arg d "$digest" --argjson s "$size" \
    --arg n "$name" --arg r "$revision" --arg c "$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)" '{
      schemaVersion: 2,
      mediaType: "application/vnd.oci.image.manifest.v1+json",
      artifactType: $t,
      config: {mediaType: "application/vnd.oci.empty.v1+json",
        digest: "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a", size: 2},
      layers: [{mediaType: "application/vnd.oci.image.layer.v1.tar+gzip", digest: $d, size: $s,
        annotations: {"org.opencontainers.image.title": $n}}],
      annotations: {"org.opencontainers.image.revision": $r, "org.opencontainers.image.created": $c}
    }')
  printf '%s' "$manifest" >"$tmp/manifest"
  mdigest=sha256:$(sha256sum "$tmp/manifest" | cut -d' ' -f1)
  curl -fsS -X PUT -H 'Content-Type: application/vnd.oci.image.manifest.v1+json' \
    --data-binary "@$tmp/manifest" "http://$registry/v2/$PLUGIN_REPO/manifests/$version" >/dev/null || return 1
  echo "$registry/$PLUGIN_REPO@$mdigest" | tee "$out"
}

plugin_fetch() {
  local ref=$1 dir=$2 registry digest m layer name
  registry=${ref%%/*}
  digest=${ref##*@}
  m=$(curl -fsS -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
    "http://$registry/v2/$PLUGIN_REPO/manifests/$digest") || return 1
  [[ sha256:$(printf '%s' "$m" | sha256sum | cut -d' ' -f1) == "$digest" ]] ||
    { echo "the manifest of $ref does not match its digest" >&2; return 1; }
  layer=$(jq -r '.layers[0].digest' <<<"$m")
  name=$(jq -r '.layers[0].annotations["org.opencontainers.image.title"]' <<<"$m")
  [[ $name == kubectl-podmotion-*-linux-amd64.tar.gz ]] || { echo "unexpected artifact title '$name'" >&2; return 1; }
  mkdir -p "$dir"
  curl -fsS -o "$dir/$name" "http://$registry/v2/$PLUGIN_REPO/blobs/$layer" || return 1
  [[ sha256:$(sha256sum "$dir/$name" | cut -d' ' -f1) == "$layer" ]] ||
    { echo "the tarball of $ref does not match its digest" >&2; return 1; }
  echo "$dir/$name"
}

plugin_krew_manifest() {
  local tgz=$1 base=$2 out=$3 name version sha
  name=$(basename "$tgz")
  version=${name#kubectl-podmotion-}
  version=${version%-linux-amd64.tar.gz}
  sha=$(sha256sum "$tgz" | cut -d' ' -f1)
  cat >"$out" <<YAML
apiVersion: krew.googlecontainertools.github.com/v1alpha2
kind: Plugin
metadata:
  name: podmotion
spec:
  version: v$version
  homepage: https://github.com/podmotion/podmotion
  shortDescription: Live-migrate pods and attach node agents to workloads
  description: |
    The client of the PodMotion operator: live-migrate a running pod to another
    node (migrate, migrate-cancel, drain), attach a node-hosted agent to every
    replica of a workload without restarting it (intercept, wiretap, env, cp),
    and list what runs (status). Needs the PodMotion operator in the cluster.
  platforms:
    - selector:
        matchLabels:
          os: linux
          arch: amd64
      uri: ${base%/}/$name
      sha256: $sha
      files:
        - from: kubectl-podmotion
          to: .
        - from: LICENSE
          to: .
      bin: kubectl-podmotion
YAML
  echo "$out"
}
