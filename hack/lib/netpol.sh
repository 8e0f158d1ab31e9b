# shellcheck shell=bash
# NetworkPolicy enforcement for the real nodes (sourced by hack/cluster.sh after
# lib/real-nodes.sh; uses their variables and helpers: RUN, PKI, LOGS, PIDS, REAL_NODES,
# PODMOTION_CACHE_DIR, KUBECONFIG_ADMIN, SERVICE_CIDR, BIN, log, die, sign,
# write_kubeconfig, real_node_name, real_node_ip).
#
# What runs: kube-router's network policy controller alone (`--run-firewall=true
# --run-router=false --run-service-proxy=false`), built from its Go module
# (github.com/cloudnativelabs/kube-router/v2, KUBE_ROUTER_VERSION in hack/versions.env)
# into $PODMOTION_CACHE_DIR/kube-router-<version>-<hash>/. It enforces NetworkPolicies
# with iptables (nf_tables backend: the nft table `ip filter`) and ipsets: the jump
# chains KUBE-ROUTER-INPUT/FORWARD/OUTPUT from the filter table's base chains, one
# KUBE-POD-FW-* chain per pod it treats as local, one KUBE-NWPLCY-* chain per policy, and
# ipsets KUBE-SRC-*/KUBE-DST-* (TMP-* while it swaps them). It needs the `ipset` tool
# (hack/install-deps.sh). Pods selected by no policy keep accepting everything.
#
# One instance for every real node. All real nodes share the host's network namespace
# (one bridge pmbr0, one kube-proxy), and kube-router owns the filter table's KUBE-*
# chains and ipsets of its namespace: at every sync it rewrites the table with
# iptables-restore and deletes every KUBE-POD-FW-* and KUBE-NWPLCY-* chain (their names
# carry the sync's version) and every KUBE-SRC/DST ipset it did not write in that sync.
# Two instances in one namespace would therefore delete each other's chains. So exactly
# one runs, with --hostname-override of the first real node, and it has to treat the
# pods of every real node as its own. kube-router decides that by address alone
# (pkg/controllers/netpol/pod.go, getLocalPods: pod.status.hostIP == the InternalIP of
# the node it runs as), and there is one such address per IP family. netpol_build
# therefore builds from a copy of the module (under the cache; dependencies still checked
# against its go.sum) with one edit: getLocalPods' comparison calls a function added in
# its own file, which also accepts a pod whose hostIP lies in PODMOTION_NETPOL_NODE_CIDRS;
# netpol_up sets that to the /24 that holds every real node's address
# (198.18.255.<10+i>; the kwok nodes' 198.18.254.<n> are outside it), so a real node
# added later (pm-real-2, ...) is covered without a restart. Pods of kwok nodes run
# nothing and are never local.
#
# What it changes on the host, all undone by netpol_down: the nft table `ip filter`
# (created by iptables-nft if it did not exist; deleted again if netpol_up created it and
# it holds no rule of anyone else), its KUBE-* chains and jump rules, the KUBE-SRC-*/
# KUBE-DST-*/TMP-* ipsets, a client certificate $PKI/kube-router.{crt,key}, the
# kubeconfig $RUN/kube-router.kubeconfig, the ClusterRole and ClusterRoleBinding
# podmotion:kube-router, the log $LOGS/kube-router.log and the PID file. It sets
# net.bridge.bridge-nf-call-iptables=1, which lib/real-nodes.sh already sets.
#
#   netpol_build       build if needed; prints the binary's path
#   netpol_up          start the controller for every real node; returns once its first
#                      sync has programmed the chains
#   netpol_down        stop it and remove every chain, rule and ipset it made
#   netpol_leftovers   print what a stopped controller left (nothing when clean)

NETPOL_COMPONENT=kube-router
NETPOL_HEALTH_PORT=16461
NETPOL_NODE_CIDRS_ENV=PODMOTION_NETPOL_NODE_CIDRS
NETPOL_MODULE=github.com/cloudnativelabs/kube-router/v2

# The one edit: getLocalPods' address comparison becomes a call to the function in the
# added file. The text must occur exactly once, or the build stops.
NETPOL_LOCAL_PODS_FROM='strings.Compare(pod.Status.HostIP, nodeIP) != 0'
NETPOL_LOCAL_PODS_TO='!podmotionLocalHostIP(pod.Status.HostIP, nodeIP)'
netpol_overlay_go() {
  cat <<EOF
// Added at build time by PodMotion's hack/lib/netpol.sh; not part of kube-router.
//
// The real nodes of PodMotion's local cluster share one network namespace, so a single
// kube-router enforces policies for all of them: a pod is local when its host IP is this
// node's address or lies in one of the CIDRs listed in $NETPOL_NODE_CIDRS_ENV.

package netpol

import (
	"net"
	"os"
	"strings"
)

func podmotionLocalHostIP(hostIP, nodeIP string) bool {
	if hostIP == nodeIP {
		return true
	}
	ip := net.ParseIP(hostIP)
	if ip == nil {
		return false
	}
	for _, cidr := range strings.Split(os.Getenv("$NETPOL_NODE_CIDRS_ENV"), ",") {
		if _, n, err := net.ParseCIDR(strings.TrimSpace(cidr)); err == nil && n.Contains(ip) {
			return true
		}
	}
	return false
}
EOF
}

netpol_root() {
  local key
  key=$({
    echo "$KUBE_ROUTER_VERSION"
    echo "$NETPOL_LOCAL_PODS_FROM => $NETPOL_LOCAL_PODS_TO"
    netpol_overlay_go
  } | sha256sum | cut -c1-12)
  echo "$PODMOTION_CACHE_DIR/kube-router-$KUBE_ROUTER_VERSION-$key"
}

netpol_bin() { echo "$(netpol_root)/bin/kube-router"; }

netpol_build() {
  local root bin src tmp start
  [[ -n ${KUBE_ROUTER_VERSION:-} ]] || die "KUBE_ROUTER_VERSION is not set (hack/versions.env)"
  root=$(netpol_root)
  bin=$root/bin/kube-router
  if [[ -x $bin ]]; then
    echo "$bin"
    return 0
  fi
  mkdir -p "$root"
  (
    flock 9
    [[ -x $bin ]] && exit 0
    start=$SECONDS
    export GOTOOLCHAIN=local GOFLAGS=-buildvcs=false
    log "kube-router: downloading $NETPOL_MODULE@$KUBE_ROUTER_VERSION"
    src=$(cd "$root" && go mod download -json "$NETPOL_MODULE@$KUBE_ROUTER_VERSION" |
      sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
    [[ -n $src && -f $src/pkg/controllers/netpol/pod.go ]] ||
      die "kube-router: no source for $NETPOL_MODULE@$KUBE_ROUTER_VERSION in the module cache"
    # Files under GOMODCACHE cannot be overlaid: build from a copy of the module.
    tmp=$root/build.tmp
    rm -rf "$tmp"
    cp -r "$src" "$tmp"
    chmod -R u+w "$tmp"
    [[ $(grep -cF "$NETPOL_LOCAL_PODS_FROM" "$tmp/pkg/controllers/netpol/pod.go") == 1 ]] ||
      die "kube-router $KUBE_ROUTER_VERSION: getLocalPods no longer reads '$NETPOL_LOCAL_PODS_FROM' (pkg/controllers/netpol/pod.go); revisit hack/lib/netpol.sh"
    sed -i "s/${NETPOL_LOCAL_PODS_FROM//./\\.}/$NETPOL_LOCAL_PODS_TO/" "$tmp/pkg/controllers/netpol/pod.go"
    grep -qF "$NETPOL_LOCAL_PODS_TO" "$tmp/pkg/controllers/netpol/pod.go" || die "kube-router: the getLocalPods edit did not apply"
    netpol_overlay_go >"$tmp/pkg/controllers/netpol/zz_podmotion_local_nodes.go"
    log "kube-router: building $KUBE_ROUTER_VERSION (every real node's pods are local)"
    (cd "$tmp" && CGO_ENABLED=0 go build -mod=readonly -trimpath \
      -ldflags "-s -w -X $NETPOL_MODULE/pkg/version.Version=$KUBE_ROUTER_VERSION" \
      -o "$root/kube-router.new" ./cmd/kube-router) >&2 || die "kube-router build failed"
    mkdir -p "$root/bin"
    mv "$root/kube-router.new" "$bin"
    rm -rf "$tmp"
    log "kube-router: built in $((SECONDS - start))s: $bin"
  ) 9>"$root/.lock" || return 1
  echo "$bin"
}

netpol_pid() { # pid of the running controller, if its PID file names one
  local f=$PIDS/$NETPOL_COMPONENT.pid pid exe
  [[ -f $f ]] || return 1
  pid=$(cat "$f")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
  [[ ${exe% (deleted)} == */kube-router ]] || return 1
  echo "$pid"
}

netpol_node_cidr() { # the /24 of the real nodes' own addresses (198.18.255.<10+i>)
  local ip
  ip=$(real_node_ip 0)
  echo "${ip%.*}.0/24"
}

netpol_rbac() {
  "$BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" apply -f - >/dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: podmotion:kube-router
rules:
- apiGroups: [""]
  resources: [namespaces, pods, services, nodes, endpoints]
  verbs: [get, list, watch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: podmotion:kube-router
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: podmotion:kube-router}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: podmotion:kube-router}
EOF
}

netpol_up() {
  ((REAL_NODES > 0)) || return 0
  command -v ipset >/dev/null || die "ipset not found: bash hack/install-deps.sh installs it (Debian package ipset)"
  command -v iptables-restore >/dev/null || die "iptables-restore not found (Debian package iptables)"
  if netpol_pid >/dev/null; then
    log "kube-router already running (pid $(netpol_pid))"
    return 0
  fi
  local bin t0 deadline cidr pid
  bin=$(netpol_build) || die "kube-router build failed"
  [[ -f $PKI/kube-router.crt ]] || sign kube-router "/CN=podmotion:kube-router" "extendedKeyUsage=clientAuth"
  write_kubeconfig "$RUN/kube-router.kubeconfig" kube-router
  netpol_rbac || die "kube-router: applying its ClusterRole failed"
  # Whether `ip filter` is ours to delete on the way down.
  if ! nft list table ip filter >/dev/null 2>&1 && [[ ! -f $RUN/netpol.filter-created ]]; then
    touch "$RUN/netpol.filter-created"
  fi
  cidr=$(netpol_node_cidr)
  : >"$LOGS/$NETPOL_COMPONENT.log"
  t0=$(date +%s%N)
  # 8>&-: as in cluster.sh's start, the daemon must not hold the run directory's lock.
  env "$NETPOL_NODE_CIDRS_ENV=$cidr" setsid "$bin" \
    --kubeconfig="$RUN/kube-router.kubeconfig" \
    --hostname-override="$(real_node_name 0)" \
    --run-firewall=true --run-router=false --run-service-proxy=false --run-loadbalancer=false \
    --enable-cni=false --enable-ipv4=true --enable-ipv6=false \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --health-port="$NETPOL_HEALTH_PORT" --metrics-port=0 \
    --v=1 >>"$LOGS/$NETPOL_COMPONENT.log" 2>&1 </dev/null 8>&- &
  pid=$!
  echo "$pid" >"$PIDS/$NETPOL_COMPONENT.pid"
  deadline=$((SECONDS + ${TIMEOUT:-90}))
  # Programmed: the first full sync wrote its chains (it logs how long the restore took).
  until grep -q 'Restoring IPv4 iptables rules took' "$LOGS/$NETPOL_COMPONENT.log" &&
    iptables -w -t filter -S KUBE-ROUTER-FORWARD >/dev/null 2>&1; do
    # (env and setsid exec each other before kube-router runs: test the PID, not the binary.)
    kill -0 "$pid" 2>/dev/null || {
      tail -20 "$LOGS/$NETPOL_COMPONENT.log" >&2
      die "kube-router exited (log: $LOGS/$NETPOL_COMPONENT.log)"
    }
    ((SECONDS < deadline)) || {
      tail -20 "$LOGS/$NETPOL_COMPONENT.log" >&2
      die "kube-router did not program its chains within ${TIMEOUT:-90}s (log: $LOGS/$NETPOL_COMPONENT.log)"
    }
    sleep 0.2
  done
  log "kube-router enforcing NetworkPolicies for the pods of the nodes in $cidr (programmed $(( ($(date +%s%N) - t0) / 1000000 )) ms after start)"
}

netpol_chains() { # kube-router's chains in the filter table
  iptables -w -t filter -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-(ROUTER-|POD-FW-|NWPLCY-)/ {print $2}'
}

netpol_ipsets() {
  ipset list -n 2>/dev/null | grep -E '^(KUBE-(SRC|DST)-|TMP-)' || true
}

netpol_down() {
  local pid i set
  if pid=$(netpol_pid); then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    log "stopped kube-router (pid $pid)"
  fi
  rm -f "$PIDS/$NETPOL_COMPONENT.pid"
  if command -v iptables-save >/dev/null && nft list table ip filter >/dev/null 2>&1; then
    # What kube-router's own cleanup does: the filter table without every line that
    # names one of its chains (declarations, jumps, rules), restored as one transaction,
    # so that rules of anyone else in the table stay as they were.
    iptables-save -t filter | grep -vE 'KUBE-(ROUTER-|POD-FW-|NWPLCY-)' | iptables-restore -w ||
      log "warning: removing kube-router's chains failed; see iptables-save -t filter"
    if [[ -f $RUN/netpol.filter-created ]] && ! iptables -w -t filter -S | grep -q '^-[AN] '; then
      nft delete table ip filter 2>/dev/null || true
    fi
  fi
  nft list table ip filter >/dev/null 2>&1 || rm -f "$RUN/netpol.filter-created"
  if command -v ipset >/dev/null; then
    for set in $(netpol_ipsets); do ipset destroy "$set" 2>/dev/null || true; done
  fi
  if [[ -n ${BIN:-} && -f $KUBECONFIG_ADMIN ]]; then
    "$BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" delete clusterrolebinding,clusterrole \
      podmotion:kube-router --ignore-not-found >/dev/null 2>&1 || true
  fi
  rm -f "$RUN/kube-router.kubeconfig"
}

netpol_leftovers() {
  local p exe
  for p in /proc/[0-9]*; do
    exe=$(readlink "$p/exe" 2>/dev/null) || continue
    [[ ${exe% (deleted)} == "$PODMOTION_CACHE_DIR"/kube-router-*/kube-router ]] && echo "process ${p#/proc/} $exe"
  done
  if command -v iptables >/dev/null && nft list table ip filter >/dev/null 2>&1; then
    netpol_chains | sed 's/^/iptables chain /'
    [[ -f $RUN/netpol.filter-created ]] && echo "nft table ip filter (created for kube-router)"
  fi
  command -v ipset >/dev/null && netpol_ipsets | sed 's/^/ipset /'
  return 0
}
