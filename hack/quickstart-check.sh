#!/usr/bin/env bash
# Follows docs/quickstart.md word for word on the local cluster: extracts every block
# fenced ```sh (what a user runs) and ```sh local-cluster (the local cluster's values,
# which a user skips), in the order of the page, and runs them unchanged in one bash
# shell with `set -euo pipefail`, as a user pasting them would. Nothing else is run
# between them; a failing command fails the check, naming its block.
#
#   bash hack/quickstart-check.sh          run it (the cluster must be up: hack/cluster.sh up)
#   bash hack/quickstart-check.sh --print  print the script it would run, and exit
#
# The blocks run in a scratch directory that looks like the root of a checkout (a
# symbolic link to each top-level entry of this one), with HOME there too, so the files
# the page writes (podmotion-*.yaml, ~/.local/bin/kubectl-podmotion) never land in the
# tree or in your home. The environment is the local cluster's
# (`hack/cluster.sh env`: KUBECONFIG, our kubectl) plus the helm hack/build-helm.sh
# builds, on PATH.
#
# The page installs release `podmotion` in `podmotion-system`, as a user would: the
# check refuses to start when that namespace exists (another install: hack/install.sh,
# the demo) rather than touch it. Whatever happens, it removes what the page created
# (its namespaces, node labels, the release and its namespace; the CRDs stay, as the
# page says) before it exits. Run it under the real nodes' lock:
#   flock /tmp/pm-realnodes.lock bash hack/quickstart-check.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
page=$root/docs/quickstart.md

# The blocks, in order, each preceded by an echo naming it (line of the page).
extract() {
  awk '
    /^```sh( local-cluster)?[[:space:]]*$/ && !inblock {
      inblock = 1; n++
      printf "printf \"\\n== quickstart block %d (docs/quickstart.md:%d)%s\\n\"\n", n, NR, ($2 == "local-cluster" ? ", local cluster only" : "")
      printf "qs_block=%d qs_line=%d\n", n, NR
      next
    }
    /^```/ && inblock { inblock = 0; next }
    inblock { print }
    END { if (inblock) { print "unterminated ```sh block" > "/dev/stderr"; exit 1 } }
  ' "$page"
}

script=$(extract)
nblocks=$(grep -c '^qs_block=' <<<"$script" || true)
((nblocks > 0)) || { echo "[quickstart] no \`\`\`sh block in $page" >&2; exit 1; }
grep -q '^```sh local-cluster' "$page" || { echo "[quickstart] no \`\`\`sh local-cluster block in $page" >&2; exit 1; }
if [[ ${1:-} == --print ]]; then
  printf '%s\n' "$script"
  exit 0
fi

eval "$("$here/cluster.sh" env)"
helm=$(bash "$here/build-helm.sh")
PATH="$(dirname "$helm"):$PATH"
export PATH
"$here/cluster.sh" status >/dev/null || { echo "[quickstart] the local cluster is not up: hack/cluster.sh up" >&2; exit 1; }
if kubectl get namespace podmotion-system >/dev/null 2>&1; then
  echo "[quickstart] namespace podmotion-system exists (hack/install.sh or the demo installed PodMotion there):" >&2
  echo "[quickstart] the quickstart installs its own release there; uninstall that one first" >&2
  echo "[quickstart] (helm uninstall podmotion -n podmotion-system; kubectl delete namespace podmotion-system)" >&2
  exit 1
fi

scratch=$(mktemp -d /tmp/podmotion-quickstart.XXXXXX)
for f in "$root"/* "$root"/.[!.]*; do
  [[ -e $f ]] && ln -s "$f" "$scratch/$(basename "$f")"
done
mkdir "$scratch/home"

# Removes what the page creates, whether it got that far or not (each step tolerates
# its object being gone already: the page's own clean-up may have run).
cleanup() {
  local rc=$?
  trap - EXIT
  echo "[quickstart] cleaning up (exit status $rc)" >&2
  kubectl delete namespace quickstart quickstart-runners --ignore-not-found --wait --timeout=3m >&2 || true
  kubectl label node pm-real-0 pm-real-1 podmotion.io/quickstart- >/dev/null 2>&1 || true
  if "$helm" status podmotion -n podmotion-system >/dev/null 2>&1; then
    "$helm" uninstall podmotion -n podmotion-system --wait --timeout 5m >&2 || true
  fi
  kubectl delete namespace podmotion-system --ignore-not-found --wait --timeout=3m >&2 || true
  kubectl delete priorityclass quickstart-runner --ignore-not-found >&2 || true
  rm -rf "$scratch"
  exit "$rc"
}
trap cleanup EXIT

{
  cat <<'HEAD'
set -euo pipefail
trap 'echo "[quickstart] FAILED in block $qs_block (docs/quickstart.md:$qs_line), exit status $?" >&2' ERR
HEAD
  printf '%s\n' "$script"
} >"$scratch/quickstart.sh"
start=$SECONDS
# The blocks run as one script, as a user pasting them into one shell would; ERR names
# the block that failed.
(cd "$scratch" && HOME=$scratch/home bash quickstart.sh)
echo "[quickstart] all $nblocks blocks of docs/quickstart.md ran on the local cluster in $((SECONDS - start)) s"
