#!/usr/bin/env bash
# PodMotion's local Kubernetes cluster: real etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, a local OCI registry (hack/registry.sh), kwok (simulated nodes and pod
# lifecycles, for scale and churn) and REAL_NODES real nodes (a kubelet with its own
# containerd, runc and CNI each, see hack/lib/real-nodes.sh), run as plain processes on
# this machine. Binaries come from hack/build-k8s.sh and hack/build-node.sh (built on first
# use into ${PODMOTION_CACHE:-~/.cache/podmotion}/, versions in hack/versions.env).
#
#   hack/cluster.sh up          build if needed, start everything, wait until healthy, create nodes
#   hack/cluster.sh down        stop pods, every process, the nodes' namespaces, cgroups and
#                               network; delete etcd's data
#   hack/cluster.sh status      state of each component (exit 0 only if all are healthy)
#   hack/cluster.sh env         print `export KUBECONFIG=... PODMOTION_REGISTRY=...` (and PATH
#                               with our kubectl first); use: eval "$(hack/cluster.sh env)"
#   hack/cluster.sh leftovers   list what a cluster left on this machine (processes, mounts,
#                               bridge, veths, cgroups, netns, nft tables); exit 1 if any
#   hack/cluster.sh add-runner-nodes
#                               start the runner nodes (REAL_RUNNER_NODES) on a cluster that
#                               is already up without them, as `up` starts them
#   hack/cluster.sh restart-component <component>
#                               stop one control-plane component (e.g. kube-apiserver) and
#                               start it again with the arguments it ran with (chaos runs)
#   hack/cluster.sh netpol-up | netpol-down
#                               NetworkPolicy enforcement on the real nodes (kube-router,
#                               hack/lib/netpol.sh), for the one test that needs it; kube-router
#                               is built by netpol-up on first use, not by `up`
#   hack/cluster.sh netpol-build  only build kube-router (hack/prebuild.sh), print its path
#
# Environment:
#   PODMOTION_RUN    runtime directory (default /tmp/podmotion-cluster): admin.kubeconfig,
#                    pki/, logs/<component>.log, pids/<component>.pid, etcd/ (data), kwok/
#   PODMOTION_CACHE  binary cache root (see hack/build-k8s.sh)
#   NODES            number of fake (kwok) nodes, named pm-node-0 .. pm-node-<NODES-1> (default 3)
#   REAL_NODES       number of real nodes, pm-real-0 .. (default 2; needs root). Labelled
#                    type=real (kwok nodes: type=kwok). REAL_NODES=0: the fast kwok-only
#                    cluster, everything on loopback. Real nodes need PODMOTION_PORT_OFFSET=0.
#   REAL_NODE_<i>_LABELS  extra labels of pm-real-<i>, comma-separated key=value
#   REAL_RUNNER_NODES  real nodes for RunnerPool pods after those (default 1: pm-real-2),
#                    labelled type=runner and podmotion.io/runner-node=real, tainted
#                    podmotion.io/runner-node=real:NoSchedule, with our KVM device plugin
#                    (devices.kubevirt.io/kvm), the Runner's seccomp profile and a /dev/kvm
#                    of mode 0666 of their own (hack/lib/real-nodes.sh); need /dev/kvm
#   NODE_CPU, NODE_MEMORY, NODE_PODS
#                    capacity = allocatable of every node (default 16, 64Gi, 110); every node
#                    also has devices.kubevirt.io/kvm: "110"
#   RUNNER_NODES     comma-separated node names that get the runner label and taint
#                    podmotion.io/runner-node=true (label) and
#                    podmotion.io/runner-node=true:NoSchedule (taint).
#                    Default: pm-node-2 (when NODES >= 3, else none). RUNNER_NODES= : none.
#   NODE_<i>_LABELS  extra labels of node pm-node-<i>, replacing the runner defaults for it:
#                    comma-separated key=value, e.g. NODE_1_LABELS="zone=b,disk=ssd"
#   NODE_<i>_TAINTS  taints of node pm-node-<i>, replacing the runner defaults for it:
#                    comma-separated key=value:Effect or key:Effect,
#                    e.g. NODE_0_TAINTS="dedicated=gpu:NoSchedule,maint:NoExecute"
#                    Set to the empty string (NODE_2_TAINTS=) to give a node no taints.
#   Every node always has the labels kubernetes.io/hostname=<name>, kubernetes.io/os=linux,
#   kubernetes.io/arch=amd64, type=kwok and the annotation kwok.x-k8s.io/node=fake (kwok
#   manages only annotated nodes).
#   CLUSTER_UP_TIMEOUT  seconds to wait for each component (default 90)
#   PODMOTION_PORT_OFFSET  added to every port below (default 0), to run a second cluster
#                    next to the first one (give it its own PODMOTION_RUN too)
#
# Loopback ports: etcd 12379 (client) / 12380 (peer), kube-apiserver 16443,
# kube-controller-manager 16457, kube-scheduler 16459, kwok 16447, registry 15000,
# kube-proxy 16456 (healthz) / 16449 (metrics). With real nodes the API server listens on
# 198.18.255.1:16443 instead (the pods' gateway), and each kubelet on 198.18.255.<10+i>:10250.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

RUN=${PODMOTION_RUN:-/tmp/podmotion-cluster}
NODES=${NODES:-3}
# status, env and down act on the cluster as it was brought up, unless told otherwise;
# `up` never inherits it (a kwok-only bench cluster once made the next CI run's `up`
# start without real nodes), and `down` forgets it.
if [[ ${1:-} != up && -z ${REAL_NODES:-} && -f $RUN/real-nodes ]]; then REAL_NODES=$(cat "$RUN/real-nodes"); fi
REAL_NODES=${REAL_NODES:-2}
[[ $REAL_NODES =~ ^[0-9]+$ ]] || { echo "[cluster] REAL_NODES must be a number, not '$REAL_NODES'" >&2; exit 2; }
NODE_CPU=${NODE_CPU:-16}
NODE_MEMORY=${NODE_MEMORY:-64Gi}
NODE_PODS=${NODE_PODS:-110}
TIMEOUT=${CLUSTER_UP_TIMEOUT:-90}
if [[ -z ${RUNNER_NODES+x} ]]; then
  RUNNER_NODES=""
  ((NODES >= 3)) && RUNNER_NODES=pm-node-2
fi

off=${PODMOTION_PORT_OFFSET:-0}
[[ $off =~ ^[0-9]+$ ]] || { echo "PODMOTION_PORT_OFFSET must be a number" >&2; exit 2; }
ETCD_PORT=$((12379 + off))
ETCD_PEER_PORT=$((12380 + off))
APISERVER_PORT=$((16443 + off))
KCM_PORT=$((16457 + off))
SCHED_PORT=$((16459 + off))
KWOK_PORT=$((16447 + off))
KUBE_PROXY_HEALTHZ_PORT=$((16456 + off))
KUBE_PROXY_METRICS_PORT=$((16449 + off))
# Pods and Services use 198.18.0.0/15 (set aside for benchmarking), never a private range:
# real nodes' pods 198.18.<i>.0/24, kwok pods 198.18.128.0/17, Services 198.19.0.0/16.
SERVICE_CIDR=198.19.0.0/16
SERVICE_API_IP=198.19.0.1
POD_CIDR=198.18.0.0/16
KWOK_POD_CIDR=198.18.128.0/17
PODMOTION_CACHE_DIR=${PODMOTION_CACHE:-$HOME/.cache/podmotion}
REGISTRY_ADDR=127.0.0.1:$((15000 + off))

PKI=$RUN/pki
LOGS=$RUN/logs
PIDS=$RUN/pids
KUBECONFIG_ADMIN=$RUN/admin.kubeconfig
# shellcheck source=lib/real-nodes.sh
source "$here/lib/real-nodes.sh"
# shellcheck source=lib/netpol.sh
source "$here/lib/netpol.sh"
# With real nodes the API server listens where pods reach it (the bridge's gateway).
API_HOST=127.0.0.1
if ((REAL_NODES > 0)); then
  ((off == 0)) || { echo "[cluster] real nodes need PODMOTION_PORT_OFFSET=0 (one bridge, one pod network); use REAL_NODES=0" >&2; exit 2; }
  API_HOST=$GATEWAY_IP
fi
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)
REAL_COMPONENTS=()
for ((_i = 0; _i < $(real_node_total); _i++)); do
  # shellcheck disable=SC2207
  REAL_COMPONENTS+=($(real_node_components "$_i"))
done
((REAL_NODES > 0)) && REAL_COMPONENTS+=(kube-proxy)

log() { echo "[cluster] $*" >&2; }
die() { echo "[cluster] ERROR: $*" >&2; exit 1; }

bin_dir() { "$here/build-k8s.sh" --print; }

# ---------------------------------------------------------------- processes

pid_of() { # component -> pid if its PID file names a live process of that binary
  # A component is named after its binary, or <node>.<binary> for a real node's.
  local f=$PIDS/$1.pid pid exe
  [[ -f $f ]] || return 1
  pid=$(cat "$f")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
  # The binary may have been replaced by a rebuild: "(deleted)" suffix.
  [[ ${exe% (deleted)} == */"${1##*.}" ]] || return 1
  echo "$pid"
}

start() { # component args...
  local name=$1
  shift
  : >"$LOGS/$name.log"
  # setsid: own session, so the process outlives this script and its caller's job control.
  # Only stdio is passed on: a daemon must not inherit (and so hold forever) the run
  # directory's lock, nor a caller's (a chaos run under `flock` restarts the API server).
  (
    close_inherited_fds
    exec setsid "$BIN/$name" "$@" >>"$LOGS/$name.log" 2>&1 </dev/null
  ) &
  echo $! >"$PIDS/$name.pid"
}

close_inherited_fds() { # in a subshell about to exec: close every descriptor above stderr
  local fd
  for fd in /proc/"$BASHPID"/fd/*; do
    fd=${fd##*/}
    ((fd > 2)) && eval "exec $fd>&-" 2>/dev/null
  done
  return 0
}

start_in_ns() { # component binary args... : like start, inside the mount namespace $NS
  local name=$1 binary=$2
  shift 2
  : >"$LOGS/$name.log"
  # nsenter execs the binary in place (no fork for a mount namespace): $! is its pid.
  (
    close_inherited_fds
    exec setsid nsenter --mount="$NS" -- "$binary" "$@" >>"$LOGS/$name.log" 2>&1 </dev/null
  ) &
  echo $! >"$PIDS/$name.pid"
}

stop() { # component
  local pid i
  pid=$(pid_of "$1") || { rm -f "$PIDS/$1.pid"; return 0; }
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    log "$1 (pid $pid) did not stop after SIGTERM; SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$PIDS/$1.pid"
  log "stopped $1 (pid $pid)"
}

# ---------------------------------------------------------------- health

curl_admin() { # url : HTTPS with the admin client certificate
  curl -fsS --max-time 3 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" "$@"
}

healthy() { # component
  case $1 in
    etcd) curl -fsS --max-time 3 "http://127.0.0.1:$ETCD_PORT/health" 2>/dev/null | grep -q '"health":"true"' ;;
    kube-apiserver) [[ $(curl_admin "https://$API_HOST:$APISERVER_PORT/readyz" 2>/dev/null) == ok ]] ;;
    kube-controller-manager) [[ $(curl -fsSk --max-time 3 "https://127.0.0.1:$KCM_PORT/healthz" 2>/dev/null) == ok ]] ;;
    kube-scheduler) [[ $(curl -fsSk --max-time 3 "https://127.0.0.1:$SCHED_PORT/readyz" 2>/dev/null) == ok ]] ;;
    kwok) curl -fsS --max-time 3 "http://127.0.0.1:$KWOK_PORT/healthz" >/dev/null 2>&1 ;;
    *) real_healthy "$1" ;;
  esac
}

fail_with_log() { # component message
  echo "[cluster] ERROR: $1 failed to start: $2 (log: $LOGS/$1.log)" >&2
  echo "----- last 40 lines of $LOGS/$1.log -----" >&2
  tail -n 40 "$LOGS/$1.log" >&2 || true
  echo "-----" >&2
  echo "[cluster] components that did start are left running for inspection; hack/cluster.sh down stops them" >&2
  exit 1
}

# Whether the process `start`/`start_in_ns` recorded for a component still runs. Not
# pid_of: until the subshell has exec'd the component's binary (after closing
# descriptors, setsid and nsenter), its /proc/<pid>/exe is bash's or nsenter's, and a
# loaded machine stretches that window (a CI run once reported the KVM device plugin
# "exited during start-up" while it had registered with its kubelet).
still_running() { # component
  local f=$PIDS/$1.pid pid state
  [[ -f $f ]] || return 1
  pid=$(cat "$f")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
  [[ -n $state && $state != Z && $state != X ]]
}

wait_healthy() { # component
  local deadline=$((SECONDS + TIMEOUT))
  while ! healthy "$1"; do
    still_running "$1" || fail_with_log "$1" "$1 exited during start-up"
    ((SECONDS < deadline)) || fail_with_log "$1" "$1 not healthy after ${TIMEOUT}s"
    sleep 0.2
  done
  log "$1 healthy ($((SECONDS - T0))s)"
}

port_free() { # port
  ! ss -Hltn "sport = :$1" 2>/dev/null | grep -q .
}

# ---------------------------------------------------------------- certificates

# PKCS#8 EC P-256 keys: fast to generate, accepted by Go and by rustls (kube-rs).
gen_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

sign() { # name subject extensions...
  local name=$1 subj=$2
  shift 2
  gen_key "$PKI/$name.key"
  openssl req -new -key "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
  printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" "$@" >"$PKI/$name.ext"
  local ca=${CA:-ca}
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/$ca.crt" -CAkey "$PKI/$ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days 3650 -extfile "$PKI/$name.ext" \
    -out "$PKI/$name.crt" 2>/dev/null
  rm -f "$PKI/$name.csr" "$PKI/$name.ext"
}

PKI_LAYOUT=3 # bump when gen_pki changes, so existing run directories regenerate
gen_pki() {
  [[ $(cat "$PKI/.complete" 2>/dev/null) == "$PKI_LAYOUT" ]] && return 0
  rm -rf "$PKI"
  mkdir -p "$PKI"
  gen_key "$PKI/ca.key"
  openssl req -x509 -new -key "$PKI/ca.key" -subj "/CN=podmotion-local-ca" -days 3650 \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
    -out "$PKI/ca.crt" 2>/dev/null
  sign apiserver "/CN=kube-apiserver" "extendedKeyUsage=serverAuth" \
    "subjectAltName=IP:127.0.0.1,IP:$SERVICE_API_IP,IP:198.18.255.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  sign admin "/O=system:masters/CN=podmotion-admin" "extendedKeyUsage=clientAuth"
  sign kube-controller-manager "/CN=system:kube-controller-manager" "extendedKeyUsage=clientAuth"
  sign kube-scheduler "/CN=system:kube-scheduler" "extendedKeyUsage=clientAuth"
  sign kwok "/CN=podmotion:kwok" "extendedKeyUsage=clientAuth"
  sign kube-proxy "/CN=system:kube-proxy" "extendedKeyUsage=clientAuth"
  # The API server's client identity towards kubelets (logs, exec, port-forward).
  sign apiserver-kubelet-client "/CN=kube-apiserver-kubelet-client" "extendedKeyUsage=clientAuth"
  # Aggregation layer (front proxy): its own CA and the apiserver's proxy client cert.
  # Without it, controller-manager and scheduler log errors about the missing
  # requestheader CA in kube-system/extension-apiserver-authentication.
  gen_key "$PKI/front-proxy-ca.key"
  openssl req -x509 -new -key "$PKI/front-proxy-ca.key" -subj "/CN=podmotion-front-proxy-ca" -days 3650 \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
    -out "$PKI/front-proxy-ca.crt" 2>/dev/null
  CA=front-proxy-ca sign front-proxy-client "/CN=front-proxy-client" "extendedKeyUsage=clientAuth"
  # Service-account token signing key pair.
  gen_key "$PKI/sa.key"
  openssl ec -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
  chmod 600 "$PKI"/*.key
  echo "$PKI_LAYOUT" >"$PKI/.complete"
}

write_kubeconfig() { # file user
  local b64="base64 -w0"
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: podmotion
  cluster:
    server: https://$API_HOST:$APISERVER_PORT
    certificate-authority-data: $($b64 <"$PKI/ca.crt")
users:
- name: $2
  user:
    client-certificate-data: $($b64 <"$PKI/$2.crt")
    client-key-data: $($b64 <"$PKI/$2.key")
contexts:
- name: podmotion
  context:
    cluster: podmotion
    user: $2
current-context: podmotion
EOF
  chmod 600 "$1"
}

# ---------------------------------------------------------------- nodes

node_manifest() { # index
  local i=$1 name=pm-node-$1 labels taints runner=0 kv key val effect
  [[ ",$RUNNER_NODES," == *",$name,"* ]] && runner=1
  local lvar=NODE_${i}_LABELS tvar=NODE_${i}_TAINTS
  if [[ -n ${!lvar+x} ]]; then labels=${!lvar}
  elif ((runner)); then labels=podmotion.io/runner-node=true
  else labels=""; fi
  if [[ -n ${!tvar+x} ]]; then taints=${!tvar}
  elif ((runner)); then taints=podmotion.io/runner-node=true:NoSchedule
  else taints=""; fi

  cat <<EOF
apiVersion: v1
kind: Node
metadata:
  name: $name
  annotations:
    kwok.x-k8s.io/node: fake
  labels:
    kubernetes.io/hostname: $name
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    type: kwok
EOF
  local IFS=,
  for kv in $labels; do
    [[ -n $kv ]] || continue
    [[ $kv == *=* ]] || die "NODE_${i}_LABELS: '$kv' is not key=value"
    echo "    ${kv%%=*}: \"${kv#*=}\""
  done
  echo "spec:"
  echo "  podCIDR: 198.18.$((128 + i % 128)).0/24"
  local tl=""
  for kv in $taints; do
    [[ -n $kv ]] || continue
    [[ $kv == *:* ]] || die "NODE_${i}_TAINTS: '$kv' is not key[=value]:Effect"
    effect=${kv##*:}
    key=${kv%:*}
    val=""
    [[ $key == *=* ]] && { val=${key#*=}; key=${key%%=*}; }
    tl+="  - {key: \"$key\", value: \"$val\", effect: \"$effect\"}"$'\n'
  done
  if [[ -n $tl ]]; then printf '  taints:\n%s' "$tl"; fi
  cat <<EOF
status:
  addresses:
  - {type: InternalIP, address: "198.18.254.$((i % 250 + 1))"}
  - {type: Hostname, address: "$name"}
  capacity: &res
    cpu: "$NODE_CPU"
    memory: "$NODE_MEMORY"
    pods: "$NODE_PODS"
    ephemeral-storage: 100Gi
    devices.kubevirt.io/kvm: "110"
  allocatable: *res
EOF
}

create_nodes() {
  local i manifest=$RUN/nodes.yaml
  ((NODES > 0)) || { log "NODES=0: no nodes"; return 0; }
  : >"$manifest"
  for ((i = 0; i < NODES; i++)); do
    node_manifest "$i" >>"$manifest"
    echo "---" >>"$manifest"
  done
  "$BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" create -f "$manifest" >/dev/null
  log "created $NODES nodes (runner nodes: ${RUNNER_NODES:-none})"
}

# ---------------------------------------------------------------- commands

all_healthy() {
  local c
  for c in "${COMPONENTS[@]}" "${REAL_COMPONENTS[@]}"; do healthy "$c" || return 1; done
  bash "$here/registry.sh" status >/dev/null 2>&1
}

any_running() {
  local c f
  for c in "${COMPONENTS[@]}" "${REAL_COMPONENTS[@]}"; do pid_of "$c" >/dev/null && return 0; done
  # Components of an earlier run with more real nodes.
  for f in "$PIDS"/*.pid; do [[ -f $f ]] && pid_of "$(basename "$f" .pid)" >/dev/null && return 0; done
  [[ -d $RUN/nodes ]]
}

cmd_up() {
  T0=$SECONDS
  if all_healthy && [[ -f $KUBECONFIG_ADMIN ]]; then
    log "already up (hack/cluster.sh status for details)"
    echo "export KUBECONFIG=$KUBECONFIG_ADMIN"
    return 0
  fi
  if any_running; then
    log "partially running; stopping the rest first"
    cmd_down
  fi
  BIN=$("$here/build-k8s.sh")
  ((REAL_NODES > 0)) && NODE_BIN=$(node_bin)
  mkdir -p "$RUN" "$LOGS" "$PIDS" "$RUN/kwok"
  local p
  for p in $ETCD_PORT $ETCD_PEER_PORT $APISERVER_PORT $KCM_PORT $SCHED_PORT $KWOK_PORT; do
    port_free "$p" || die "127.0.0.1:$p is already in use: $(ss -Hltnp "sport = :$p" | head -1)"
  done
  PODMOTION_RUN=$RUN bash "$here/registry.sh" up >&2 || die "registry failed to start (log: $LOGS/registry.log)"
  gen_pki
  echo "$REAL_NODES" >"$RUN/real-nodes"
  ((REAL_NODES > 0)) && net_up
  write_kubeconfig "$KUBECONFIG_ADMIN" admin
  local c
  for c in kube-controller-manager kube-scheduler kwok; do write_kubeconfig "$RUN/$c.kubeconfig" "$c"; done

  rm -rf "$RUN/etcd"
  start etcd --name podmotion --data-dir "$RUN/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "podmotion=http://127.0.0.1:$ETCD_PEER_PORT" --initial-cluster-state new \
    --unsafe-no-fsync --quota-backend-bytes=$((2 * 1024 * 1024 * 1024)) --log-level warn
  wait_healthy etcd

  # UserNamespacesSupport (hostUsers: false) and ProcMountType (procMount: Unmasked) are GA
  # and locked on since 1.36, so no --feature-gates are needed for the RunnerPool pod shape.
  start kube-apiserver \
    --bind-address="$API_HOST" --advertise-address="$API_HOST" --secure-port="$APISERVER_PORT" \
    --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" \
    --authorization-mode=Node,RBAC \
    --enable-admission-plugins=NodeRestriction,PodSecurity \
    --allow-privileged=true \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$PKI/sa.pub" \
    --service-account-signing-key-file="$PKI/sa.key" \
    --endpoint-reconciler-type="$([[ $API_HOST == 127.0.0.1 ]] && echo none || echo lease)" \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority="$PKI/ca.crt" \
    --kubelet-preferred-address-types=InternalIP \
    --requestheader-client-ca-file="$PKI/front-proxy-ca.crt" \
    --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User \
    --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --proxy-client-cert-file="$PKI/front-proxy-client.crt" \
    --proxy-client-key-file="$PKI/front-proxy-client.key" \
    --profiling=false
  wait_healthy kube-apiserver

  # kwok plays the kubelet of every fake node with one identity.
  "$BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" create clusterrolebinding podmotion:kwok \
    --clusterrole=cluster-admin --user=podmotion:kwok >/dev/null
  # The API server proxies logs, exec and port-forward to kubelets with this identity.
  "$BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" create clusterrolebinding podmotion:apiserver-kubelet-client \
    --clusterrole=system:kubelet-api-admin --user=kube-apiserver-kubelet-client >/dev/null

  start kube-controller-manager \
    --kubeconfig="$RUN/kube-controller-manager.kubeconfig" \
    --authentication-kubeconfig="$RUN/kube-controller-manager.kubeconfig" \
    --authorization-kubeconfig="$RUN/kube-controller-manager.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$KCM_PORT" \
    --leader-elect=false \
    --controllers='*,bootstrapsigner,tokencleaner' \
    --use-service-account-credentials=true \
    --service-account-private-key-file="$PKI/sa.key" \
    --root-ca-file="$PKI/ca.crt" \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" --cluster-cidr="$POD_CIDR" \
    --profiling=false
  start kube-scheduler \
    --kubeconfig="$RUN/kube-scheduler.kubeconfig" \
    --authentication-kubeconfig="$RUN/kube-scheduler.kubeconfig" \
    --authorization-kubeconfig="$RUN/kube-scheduler.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" \
    --leader-elect=false --profiling=false
  # HOME: kwok also loads ~/.kwok/kwok.yaml if it exists; keep it out.
  HOME=$RUN/kwok start kwok \
    --kubeconfig="$RUN/kwok.kubeconfig" \
    --config="$here/kwok/stages.yaml" \
    --manage-all-nodes=false \
    --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
    --node-lease-duration-seconds=40 \
    --cidr="$KWOK_POD_CIDR" \
    --server-address="127.0.0.1:$KWOK_PORT"

  create_nodes
  real_nodes_up
  wait_healthy kube-controller-manager
  wait_healthy kube-scheduler
  wait_healthy kwok

  if ((NODES > 0)); then
    "$BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" wait --for=condition=Ready node -l type=kwok --timeout="${TIMEOUT}s" >/dev/null ||
      fail_with_log kwok "nodes not Ready after ${TIMEOUT}s"
    log "nodes Ready ($((SECONDS - T0))s)"
  fi
  real_nodes_wait_ready
  # The ServiceAccount controller must be working before pods can be created.
  local deadline=$((SECONDS + TIMEOUT))
  until "$BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" -n default get serviceaccount default >/dev/null 2>&1; do
    ((SECONDS < deadline)) || fail_with_log kube-controller-manager "no default ServiceAccount after ${TIMEOUT}s"
    sleep 0.2
  done
  log "up in $((SECONDS - T0))s; kubeconfig $KUBECONFIG_ADMIN, logs $LOGS/"
  echo "export KUBECONFIG=$KUBECONFIG_ADMIN"
}

cmd_down() {
  local i f
  BIN=$(bin_dir)
  # The controllers first, so nothing recreates the pods the real nodes are told to stop.
  stop kube-controller-manager
  stop kube-scheduler
  netpol_down # the API server must still be up to delete its RBAC
  real_nodes_down
  for f in "$PIDS"/*.pid; do # components of a run with more real nodes than now
    [[ -f $f ]] || continue
    case $(basename "$f" .pid) in "$REAL_NODE_PREFIX"*) stop "$(basename "$f" .pid)" ;; esac
  done
  for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do stop "${COMPONENTS[i]}"; done
  PODMOTION_RUN=$RUN bash "$here/registry.sh" down >&2 || true
  rm -rf "$RUN/etcd"
  rm -f "$RUN/real-nodes"
  log "down (logs kept in $LOGS/)"
}

cmd_leftovers() {
  local out
  out=$(
    real_leftovers
    netpol_leftovers
  )
  if [[ -n $out ]]; then
    echo "$out"
    return 1
  fi
  log "nothing left behind"
}

cmd_status() {
  local c pid ok=0 state
  for c in "${COMPONENTS[@]}" "${REAL_COMPONENTS[@]}"; do
    if pid=$(pid_of "$c"); then
      if healthy "$c"; then state="running (pid $pid), healthy"
      else state="running (pid $pid), NOT healthy"; ok=1; fi
    else
      state="stopped"
      ok=1
    fi
    printf '%-24s %s\n' "$c" "$state"
  done
  if bash "$here/registry.sh" status >/dev/null 2>&1; then state="running, answering on $REGISTRY_ADDR"
  else state="stopped"; ok=1; fi
  printf '%-24s %s\n' registry "$state"
  if healthy kube-apiserver; then
    echo
    "$(bin_dir)/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" get nodes -o wide 2>&1 || true
  fi
  return $ok
}

cmd_restart_component() { # component: stop it, start it with the arguments it ran with
  local name=$1 pid args=()
  [[ -n $name ]] || die "usage: $0 restart-component <component>"
  pid=$(pid_of "$name") || die "$name is not running"
  mapfile -d '' -t args <"/proc/$pid/cmdline"
  BIN=$(bin_dir)
  # Only what `start` started (not a real node's components, which run in a namespace).
  [[ ${args[0]} == "$BIN/$name" ]] || die "$name runs ${args[0]}, not $BIN/$name: not restartable here"
  stop "$name"
  cp "$LOGS/$name.log" "$LOGS/$name.log.before-restart" 2>/dev/null || true
  T0=$SECONDS
  start "$name" "${args[@]:1}"
  wait_healthy "$name"
}

cmd_env() {
  echo "export KUBECONFIG=$KUBECONFIG_ADMIN"
  echo "export PODMOTION_REGISTRY=$REGISTRY_ADDR"
  echo "export PATH=\"$(bin_dir):\$PATH\""
}

[[ $NODES =~ ^[0-9]+$ ]] || die "NODES must be a number, not '$NODES'"

lock() { # serialize up/down of one run directory
  mkdir -p "$RUN"
  exec 8>"$RUN/.lock"
  flock -n 8 || { log "waiting for another hack/cluster.sh on $RUN"; flock 8; }
}

case ${1:-} in
  up) lock; cmd_up ;;
  down) lock; cmd_down ;;
  status) cmd_status ;;
  env) cmd_env ;;
  leftovers) cmd_leftovers ;;
  add-runner-nodes)
    lock
    BIN=$(bin_dir)
    healthy kube-apiserver || die "the cluster is not up (hack/cluster.sh up)"
    T0=$SECONDS
    real_runner_nodes_add ;;
  restart-component)
    lock
    cmd_restart_component "${2:-}" ;;
  netpol-up) # NetworkPolicy enforcement on the real nodes (kube-router; hack/lib/netpol.sh)
    lock
    BIN=$(bin_dir)
    healthy kube-apiserver || die "the cluster is not up (hack/cluster.sh up)"
    netpol_up ;;
  netpol-down)
    lock
    BIN=$(bin_dir)
    netpol_down ;;
  netpol-build) # only build kube-router (hack/prebuild.sh); prints its path
    netpol_build ;;
  *) echo "usage: $0 up|down|status|env|leftovers|add-runner-nodes|restart-component <component>|netpol-up|netpol-down|netpol-build" >&2; exit 2 ;;
esac
