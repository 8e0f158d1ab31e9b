# shellcheck shell=bash
# Real nodes of the local cluster (sourced by hack/cluster.sh; uses its variables and
# helpers: RUN, PKI, LOGS, PIDS, BIN, log, die, start, stop, pid_of, sign, write_kubeconfig).
#
# A real node is a kubelet with its own containerd (runc shim, runc, CNI bridge +
# host-local + loopback), all running as processes of this machine, in a private mount
# namespace of their own so that every node sees its own state at the standard paths:
#
#   /run/containerd  /var/lib/containerd  /var/lib/kubelet  /var/lib/cni  /var/log/pods
#   /run/netns  /run/podmotion  /etc/containerd  /etc/kubernetes  /etc/cni/net.d  /opt/cni/bin
#
# are bind mounts of $RUN/nodes/<node>/..., and $RUN/nodes itself is hidden under an empty
# tmpfs inside every node's namespace. A DaemonSet pod that mounts the node's /run
# therefore finds that node's CRI socket at /run/containerd/containerd.sock and no other
# node's state. The namespace is kept by a bind mount of its nsfs file under
# $RUN/ns/<node>; containerd and kubelet are started in it with nsenter.
#
# Network (one L2 segment, like nodes behind one switch): one bridge, pmbr0, with the
# gateway 198.18.255.1/16; each node's pods get addresses from its own /24 (pm-real-<i>:
# 198.18.<i>.0/24) of that /16, and each node has an address of its own on the bridge
# (198.18.255.<10+i>) where its kubelet serves. The API server listens on the gateway
# address, so pods reach it through the `kubernetes` Service (198.19.0.1) by kube-proxy's
# nftables rules. One kube-proxy serves the whole machine (both nodes share its network
# namespace). br_netfilter makes bridged replies pass conntrack. Forwarding between the
# bridge and any other interface is dropped by the nft table `inet podmotion-cluster`:
# nothing leaves the machine.
#
# Scheduling: real nodes are labelled type=real and tainted podmotion.io/real-node=true:
# NoSchedule, so only pods that ask for them (toleration) run there; everything else keeps
# landing on the kwok nodes, as the kwok-based tests expect.
#
# cgroups: each node's kubelet gets the cgroup root /pm-real-<i> (cgroupfs driver), made
# beforehand in every mounted hierarchy (v1 hybrid here: kubelet needs failCgroupV1=false;
# on a v2-only machine the same code makes it in the one hierarchy).
#
# Runner nodes: REAL_RUNNER_NODES more real nodes (default 1: pm-real-<REAL_NODES>, i.e.
# pm-real-2) are dedicated to RunnerPool pods. They are labelled type=runner and
# podmotion.io/runner-node=real and tainted podmotion.io/runner-node=real:NoSchedule only
# (not type=real, not the real-node taint: the real-node tests, the chart's node agents and
# the demo's workloads select type=real and never count or reach them). Each one is
# provisioned as the Runner contract requires (docs/runner-pool.md, "On a real node"):
#   * its /dev/kvm is a device node of its own (same device, 10:232) with mode 0666, kept
#     in the node's directory (mode 0700) and bind-mounted over /dev/kvm in its namespace
#     only: the machine's /dev/kvm keeps its mode;
#   * our KVM device plugin (hack/device-plugin) advertises devices.kubevirt.io/kvm to its
#     kubelet and hands /dev/kvm to the containers that request it;
#   * the Runner's Localhost seccomp profile (hack/runner-node/compass-runner.json) is in
#     the kubelet's seccomp root, at podmotion/compass-runner.json;
#   * the two Runner host trees, /var/lib/compass/sessions and /run/compass, are
#     directories of the node (bind mounts of its own), owned by the Runner's uid 10001.

BRIDGE=pmbr0
GATEWAY_IP=198.18.255.1
CLUSTER_POD_CIDR=198.18.0.0/16
REAL_SERVICE_CIDR=198.19.0.0/16
NFT_TABLE=podmotion-cluster
REAL_NODE_PREFIX=pm-real-

NODE_BIN=$("$here/build-node.sh" --print)
# Runner nodes after the REAL_NODES workload nodes (only with real nodes at all).
if [[ -z ${REAL_RUNNER_NODES:-} && -f $RUN/real-runner-nodes ]]; then REAL_RUNNER_NODES=$(cat "$RUN/real-runner-nodes"); fi
REAL_RUNNER_NODES=${REAL_RUNNER_NODES:-1}
[[ $REAL_RUNNER_NODES =~ ^[0-9]+$ ]] || { echo "[cluster] REAL_RUNNER_NODES must be a number" >&2; exit 2; }
((REAL_NODES > 0)) || REAL_RUNNER_NODES=0
RUNNER_LABEL=podmotion.io/runner-node=real
RUNNER_TAINT=podmotion.io/runner-node=real:NoSchedule
RUNNER_UID=10001
KVM_RESOURCE=devices.kubevirt.io/kvm
RUNNER_SECCOMP=podmotion/compass-runner.json

real_node_name() { echo "$REAL_NODE_PREFIX$1"; }
real_node_ip() { echo "198.18.255.$((10 + $1))"; }
real_node_dir() { echo "$RUN/nodes/$(real_node_name "$1")"; }
real_node_ns() { echo "$RUN/ns/$(real_node_name "$1")"; }
real_node_total() { echo $((REAL_NODES + REAL_RUNNER_NODES)); }
real_node_is_runner() { (($1 >= REAL_NODES)); }
real_node_components() { # index -> component names of that node, in start order
  local n
  n=$(real_node_name "$1")
  if real_node_is_runner "$1"; then echo "$n.containerd $n.kubelet $n.kvm-device-plugin"
  else echo "$n.containerd $n.kubelet"; fi
}

cgroup_hierarchies() { # every mounted cgroup hierarchy (v1 controllers, name=systemd, v2)
  awk '$3 == "cgroup" || $3 == "cgroup2" {print $2}' /proc/mounts | sort -u
}

# ---------------------------------------------------------------- build and images

node_bin() { "$here/build-node.sh"; }  # builds if needed

# ---------------------------------------------------------------- host network

# Deletes the brokers' forward tables (`inet podmotion-fwd-<uid>`, issue 39) left in this
# machine's network namespace, which is every real node's: with no cluster running (or
# before one starts) none is live. A broker killed while it forwarded leaves its table,
# which DNATs new connections for the source pod's old address to the old target: a later
# pod that gets that address is unreachable (two CI rehearsals failed on such leftovers).
# Each one is named on stderr, as the leak it is.
forward_tables_down() {
  local t
  for t in $(nft list tables inet 2>/dev/null | awk '$3 ~ /^podmotion-fwd-/ {print $3}'); do
    echo "[cluster] a broker left nft table inet $t: deleted" >&2
    nft delete table inet "$t" 2>/dev/null || true
  done
}

net_up() {
  [[ $(id -u) == 0 ]] || die "real nodes need root (bridge, mount namespaces, cgroups); REAL_NODES=0 runs without"
  command -v nft >/dev/null || die "nft not found: bash hack/install-attach-deps.sh installs nftables"
  forward_tables_down
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
  fi
  ip addr replace "$GATEWAY_IP/16" dev "$BRIDGE"
  local i
  for ((i = 0; i < $(real_node_total); i++)); do
    ip addr replace "$(real_node_ip "$i")/32" dev "$BRIDGE"
  done
  ip link set "$BRIDGE" up
  # Service addresses are reached through the bridge (kube-proxy rewrites them to pod or
  # API server addresses), never through the default route.
  ip route replace "$REAL_SERVICE_CIDR" dev "$BRIDGE" src "$GATEWAY_IP"
  # Bridged traffic between pods must pass conntrack so Service replies are rewritten.
  if [[ -w /proc/sys/net/bridge/bridge-nf-call-iptables ]]; then
    echo 1 >/proc/sys/net/bridge/bridge-nf-call-iptables
  else
    log "warning: /proc/sys/net/bridge missing (no br_netfilter): a pod reaching a Service backed by a pod on the same bridge will fail"
  fi
  [[ -f $RUN/ip_forward.saved ]] || cat /proc/sys/net/ipv4/ip_forward >"$RUN/ip_forward.saved"
  echo 1 >/proc/sys/net/ipv4/ip_forward
  # PostCopy: CRIU's page server sizes a pipe to 3354624 bytes, past the default
  # fs.pipe-max-size (1 MiB); the agents hold no CAP_SYS_RESOURCE, so a node that
  # offers PostCopy raises the sysctl (the real nodes share this kernel).
  local pipe_max=3354624
  [[ -f $RUN/pipe_max.saved ]] || cat /proc/sys/fs/pipe-max-size >"$RUN/pipe_max.saved"
  if (($(cat /proc/sys/fs/pipe-max-size) < pipe_max)); then
    echo "$pipe_max" >/proc/sys/fs/pipe-max-size
  fi
  nft -f - <<EOF
table inet $NFT_TABLE
delete table inet $NFT_TABLE
table inet $NFT_TABLE {
  chain forward {
    type filter hook forward priority -10; policy accept;
    iifname "$BRIDGE" oifname "$BRIDGE" accept
    iifname "$BRIDGE" counter drop comment "pods never reach another interface"
    oifname "$BRIDGE" counter drop comment "nothing from another interface reaches the pods"
  }
}
EOF
}

net_down() {
  forward_tables_down
  nft delete table inet "$NFT_TABLE" 2>/dev/null || true
  nft delete table ip kube-proxy 2>/dev/null || true
  nft delete table ip6 kube-proxy 2>/dev/null || true
  ip route del "$REAL_SERVICE_CIDR" 2>/dev/null || true
  if ip link show "$BRIDGE" >/dev/null 2>&1; then
    # Remaining veths of pods whose namespace is gone go with their peers; any still
    # attached (a stray) are deleted with the bridge's ports.
    local port
    for port in $(ip -o link show master "$BRIDGE" 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1); do
      ip link del "$port" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
  fi
  if [[ -f $RUN/ip_forward.saved ]]; then
    cat "$RUN/ip_forward.saved" >/proc/sys/net/ipv4/ip_forward
    rm -f "$RUN/ip_forward.saved"
  fi
  if [[ -f $RUN/pipe_max.saved ]]; then
    cat "$RUN/pipe_max.saved" >/proc/sys/fs/pipe-max-size
    rm -f "$RUN/pipe_max.saved"
  fi
}

# ---------------------------------------------------------------- cgroups

cgroup_root_up() { # index
  local n h
  n=$(real_node_name "$1")
  for h in $(cgroup_hierarchies); do
    mkdir -p "$h/$n"
    if [[ -f $h/cpuset.cpus && -f $h/$n/cpuset.cpus ]]; then
      [[ -n $(cat "$h/$n/cpuset.cpus") ]] || cat "$h/cpuset.cpus" >"$h/$n/cpuset.cpus"
      [[ -n $(cat "$h/$n/cpuset.mems") ]] || cat "$h/cpuset.mems" >"$h/$n/cpuset.mems"
    fi
  done
}

cgroup_pids() { # index -> every pid in the node's cgroups (all hierarchies)
  local n h
  n=$(real_node_name "$1")
  for h in $(cgroup_hierarchies); do
    [[ -d $h/$n ]] || continue
    find "$h/$n" -name cgroup.procs -exec cat {} + 2>/dev/null
  done | sort -un
}

cgroup_root_down() { # index: kill what is left, then remove the tree bottom-up
  local n h i pids
  n=$(real_node_name "$1")
  for ((i = 0; i < 50; i++)); do
    pids=$(cgroup_pids "$1")
    [[ -z $pids ]] && break
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    sleep 0.1
  done
  for h in $(cgroup_hierarchies); do
    [[ -d $h/$n ]] || continue
    find "$h/$n" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    [[ -d $h/$n ]] && log "warning: could not remove cgroup $h/$n"
  done
  return 0
}

# ---------------------------------------------------------------- mount namespaces

ns_dir_up() {
  mkdir -p "$RUN/ns"
  # nsfs bind mounts must live on a private mount.
  if ! mountpoint -q "$RUN/ns"; then
    mount -t tmpfs -o size=1m,mode=0700 podmotion-ns "$RUN/ns"
    mount --make-private "$RUN/ns"
  fi
}

# The paths each node sees as its own (node dir relative path : path inside the node).
NODE_BINDS=(
  etc/kubernetes:/etc/kubernetes
  etc/containerd:/etc/containerd
  etc/cni/net.d:/etc/cni/net.d
  var/lib/kubelet:/var/lib/kubelet
  var/lib/containerd:/var/lib/containerd
  var/lib/cni:/var/lib/cni
  var/log/pods:/var/log/pods
  run/containerd:/run/containerd
  run/netns:/run/netns
  run/podmotion:/run/podmotion
)

# Runner nodes also see these as their own (the Runner contract's two host trees).
RUNNER_BINDS=(
  var/lib/compass:/var/lib/compass
  run/compass:/run/compass
)

# What a Runner node needs before its kubelet starts (see the header): the node's
# /dev/kvm with mode 0666, the seccomp profile, the Runner's host trees.
runner_node_provision() { # index
  local dir
  dir=$(real_node_dir "$1")
  [[ -c /dev/kvm ]] || die "$(real_node_name "$1"): /dev/kvm missing on this machine: a runner node needs KVM (REAL_RUNNER_NODES=0 runs without)"
  mkdir -p "$dir/dev"
  chmod 0700 "$dir/dev"
  if [[ ! -c $dir/dev/kvm ]]; then
    rm -f "$dir/dev/kvm"
    mknod -m 0666 "$dir/dev/kvm" c "$((0x$(stat -c %t /dev/kvm)))" "$((0x$(stat -c %T /dev/kvm)))"
  fi
  chmod 0666 "$dir/dev/kvm"
  install -D -m 0644 "$here/runner-node/compass-runner.json" "$dir/var/lib/kubelet/seccomp/$RUNNER_SECCOMP"
  mkdir -p "$dir/var/lib/compass/sessions" "$dir/run/compass"
  chown "$RUNNER_UID:$RUNNER_UID" "$dir/var/lib/compass/sessions" "$dir/run/compass"
}

# Starts the node's KVM device plugin (after its kubelet: it registers on kubelet.sock,
# and registers again whenever the kubelet restarts).
runner_device_plugin_up() { # index
  local n dp
  n=$(real_node_name "$1")
  dp=$("$here/build-node.sh" --device-plugin)
  NS=$(real_node_ns "$1") start_in_ns "$n.kvm-device-plugin" "$dp" \
    --resource-name="$KVM_RESOURCE" --device=/dev/kvm --count=110 \
    --plugin-dir=/var/lib/kubelet/device-plugins
}
node_ns_up() { # index
  local dir ns b src dst nodebin
  dir=$(real_node_dir "$1")
  ns=$(real_node_ns "$1")
  nodebin=$2
  mountpoint -q "$ns" 2>/dev/null && return 0
  for b in "${NODE_BINDS[@]}"; do
    mkdir -p "$dir/${b%%:*}" "${b#*:}"
  done
  mkdir -p /opt/cni/bin
  : >"$ns"
  # unshare binds the new namespace to $ns and runs the script inside it; the script's
  # mounts stay in that namespace (the whole tree is private there).
  local script=""
  for b in "${NODE_BINDS[@]}"; do
    src=$dir/${b%%:*}
    dst=${b#*:}
    script+="mount --bind '$src' '$dst' && "
  done
  script+="mount --bind '$nodebin/cni' /opt/cni/bin && mount -o remount,bind,ro /opt/cni/bin && "
  if real_node_is_runner "$1"; then
    local rb
    for rb in "${RUNNER_BINDS[@]}"; do
      mkdir -p "$dir/${rb%%:*}" "${rb#*:}"
      script+="mount --bind '$dir/${rb%%:*}' '${rb#*:}' && "
    done
    # The node's own /dev/kvm (runner_node_provision made it).
    script+="mount --bind '$dir/dev/kvm' /dev/kvm && "
  fi
  # Hide every node's directory (including this one's, already bound above).
  script+="mount -t tmpfs -o size=1m,mode=0755 podmotion-hidden '$RUN/nodes' && "
  script+="mount -t tmpfs -o size=1m,mode=0700 podmotion-hidden '$RUN/ns' && "
  # Shared inside the node (as / is on a systemd host), so Bidirectional volume mounts
  # (the migration broker's netns directory) work; the host's mounts stay private.
  script+="mount --make-rshared /"
  unshare --mount="$ns" --propagation private sh -c "$script" ||
    die "$(real_node_name "$1"): could not set up its mount namespace ($ns)"
}

node_ns_down() { # index
  local ns
  ns=$(real_node_ns "$1")
  if mountpoint -q "$ns" 2>/dev/null; then
    umount "$ns" 2>/dev/null || umount -l "$ns" 2>/dev/null || true
  fi
  rm -f "$ns"
}

in_node() { # index cmd... : run a command inside the node's mount namespace
  local ns
  ns=$(real_node_ns "$1")
  shift
  nsenter --mount="$ns" -- "$@"
}

# ---------------------------------------------------------------- configuration

node_pki() { # index
  local n ip
  n=$(real_node_name "$1")
  ip=$(real_node_ip "$1")
  [[ -f $PKI/$n.crt ]] && return 0
  sign "$n" "/O=system:nodes/CN=system:node:$n" "extendedKeyUsage=clientAuth"
  sign "$n-serving" "/O=system:nodes/CN=system:node:$n" "extendedKeyUsage=serverAuth" \
    "subjectAltName=IP:$ip,DNS:$n"
  chmod 600 "$PKI"/*.key
}

node_config() { # index nodebin
  local i=$1 nodebin=$2 n ip dir registry
  n=$(real_node_name "$i")
  ip=$(real_node_ip "$i")
  dir=$(real_node_dir "$i")
  registry=$REGISTRY_ADDR
  mkdir -p "$dir/etc/kubernetes/pki" "$dir/etc/containerd/certs.d/$registry" "$dir/etc/cni/net.d"
  cp "$PKI/ca.crt" "$dir/etc/kubernetes/pki/ca.crt"
  cp "$PKI/$n.crt" "$dir/etc/kubernetes/pki/client.crt"
  cp "$PKI/$n.key" "$dir/etc/kubernetes/pki/client.key"
  cp "$PKI/$n-serving.crt" "$dir/etc/kubernetes/pki/serving.crt"
  cp "$PKI/$n-serving.key" "$dir/etc/kubernetes/pki/serving.key"
  cat >"$dir/etc/kubernetes/kubelet.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: podmotion
  cluster:
    server: https://$API_HOST:$APISERVER_PORT
    certificate-authority: /etc/kubernetes/pki/ca.crt
users:
- name: $n
  user:
    client-certificate: /etc/kubernetes/pki/client.crt
    client-key: /etc/kubernetes/pki/client.key
contexts:
- name: podmotion
  context: {cluster: podmotion, user: $n}
current-context: podmotion
EOF
  cat >"$dir/etc/kubernetes/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $ip
port: 10250
readOnlyPort: 0
healthzBindAddress: $ip
healthzPort: 10248
tlsCertFile: /etc/kubernetes/pki/serving.crt
tlsPrivateKeyFile: /etc/kubernetes/pki/serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: /etc/kubernetes/pki/ca.crt}
authorization:
  mode: Webhook
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
cgroupDriver: cgroupfs
cgroupRoot: /$n
failCgroupV1: false
failSwapOn: false
# CAP_SYS_RESOURCE is missing here: leave kernel settings as they are.
protectKernelDefaults: false
makeIPTablesUtilChains: false
resolvConf: /etc/resolv.conf
maxPods: 110
serializeImagePulls: false
# The machine's disk is shared by both nodes and everything else: evict on real pressure
# only, never because of another node's images.
evictionHard:
  memory.available: 100Mi
  nodefs.available: 2%
  imagefs.available: 2%
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
shutdownGracePeriod: 0s
EOF
  cat >"$dir/etc/containerd/config.toml" <<EOF
version = 3
root = "/var/lib/containerd"
state = "/run/containerd"

[grpc]
  address = "/run/containerd/containerd.sock"

[ttrpc]
  address = "/run/containerd/containerd.sock.ttrpc"

[plugins.'io.containerd.cri.v1.runtime']
  enable_selinux = false
  # CAP_SYS_RESOURCE is absent on this machine: without this, runc fails every sandbox
  # writing oom_score_adj -998 for pause.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "$nodebin/runc"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/opt/cni/bin"]
    conf_dir = "/etc/cni/net.d"
    max_conf_num = 1

# NRI listens on one fixed path, /var/run/nri/nri.sock, outside the node's own binds: every
# node's containerd removes the socket and binds it again at start-up, so two starting at
# once race (one dies with "bind: address already in use"), and a restarted one would take
# the socket from the other. No node here uses an NRI plugin.
[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$registry/podmotion/podmotion-pause:3.10"
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "/etc/containerd/certs.d"
EOF
  cat >"$dir/etc/containerd/certs.d/$registry/hosts.toml" <<EOF
# The local registry (hack/registry.sh) speaks plain HTTP on loopback.
server = "http://$registry"
[host."http://$registry"]
  capabilities = ["pull", "resolve"]
EOF
  cat >"$dir/etc/cni/net.d/10-podmotion.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "podmotion",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{
          "subnet": "$CLUSTER_POD_CIDR",
          "rangeStart": "198.18.$i.2",
          "rangeEnd": "198.18.$i.254",
          "gateway": "$GATEWAY_IP"
        }]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    }
  ]
}
EOF
}

kube_proxy_config() {
  write_kubeconfig "$RUN/kube-proxy.kubeconfig" kube-proxy
  cat >"$RUN/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clusterCIDR: $CLUSTER_POD_CIDR
hostnameOverride: $(real_node_name 0)
bindAddress: $GATEWAY_IP
healthzBindAddress: 127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT
metricsBindAddress: 127.0.0.1:$KUBE_PROXY_METRICS_PORT
nodePortAddresses: ["$GATEWAY_IP/32"]
clientConnection:
  kubeconfig: $RUN/kube-proxy.kubeconfig
# Leave the machine's conntrack settings as they are.
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
EOF
}

# ---------------------------------------------------------------- health

real_healthy() { # component
  local c=$1 n i
  case $c in
    kube-proxy) [[ $(curl -fsS --max-time 3 "http://127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT/healthz" 2>/dev/null) == *'"lastUpdated"'* ]] ;;
    *.containerd)
      n=${c%.containerd}
      i=${n#"$REAL_NODE_PREFIX"}
      "$NODE_BIN/ctr" --address "$(real_node_dir "$i")/run/containerd/containerd.sock" version >/dev/null 2>&1 ;;
    *.kubelet)
      n=${c%.kubelet}
      i=${n#"$REAL_NODE_PREFIX"}
      [[ $(curl -fsS --max-time 3 "http://$(real_node_ip "$i"):10248/healthz" 2>/dev/null) == ok ]] ;;
    *.kvm-device-plugin)
      n=${c%.kvm-device-plugin}
      i=${n#"$REAL_NODE_PREFIX"}
      pid_of "$c" >/dev/null && [[ -S $(real_node_dir "$i")/var/lib/kubelet/device-plugins/podmotion-kvm.sock ]] ;;
    *) return 1 ;;
  esac
}

# ---------------------------------------------------------------- up / down

real_nodes_up() {
  ((REAL_NODES > 0)) || return 0
  local i n dir
  NODE_BIN=$(node_bin)
  net_up
  ns_dir_up
  kube_proxy_config
  echo "$REAL_RUNNER_NODES" >"$RUN/real-runner-nodes"
  for ((i = 0; i < $(real_node_total); i++)); do
    real_node_containerd_up "$i"
  done
  start kube-proxy --config="$RUN/kube-proxy.yaml"
  for ((i = 0; i < $(real_node_total); i++)); do
    wait_healthy "$(real_node_name "$i").containerd"
  done
  for ((i = 0; i < $(real_node_total); i++)); do
    real_node_kubelet_up "$i"
  done
  for ((i = 0; i < $(real_node_total); i++)); do
    wait_healthy "$(real_node_name "$i").kubelet"
    if real_node_is_runner "$i"; then
      runner_device_plugin_up "$i"
      wait_healthy "$(real_node_name "$i").kvm-device-plugin"
    fi
  done
  wait_healthy kube-proxy
}

real_node_containerd_up() { # index: configuration, cgroups, namespace, containerd
  local i=$1 n
  n=$(real_node_name "$i")
  node_pki "$i"
  node_config "$i" "$NODE_BIN"
  real_node_is_runner "$i" && runner_node_provision "$i"
  cgroup_root_up "$i"
  node_ns_up "$i" "$NODE_BIN"
  # containerd finds containerd-shim-runc-v2 on its PATH.
  PATH="$NODE_BIN:$PATH" NS=$(real_node_ns "$i") start_in_ns "$n.containerd" "$NODE_BIN/containerd" \
    --config /etc/containerd/config.toml
}

real_node_kubelet_up() { # index
  local i=$1 n labels taints lvar
  n=$(real_node_name "$i")
  if real_node_is_runner "$i"; then
    labels="type=runner,$RUNNER_LABEL"
    taints=$RUNNER_TAINT
  else
    labels="type=real"
    taints="podmotion.io/real-node=true:NoSchedule"
  fi
  lvar=REAL_NODE_${i}_LABELS
  [[ -n ${!lvar:-} ]] && labels+=",${!lvar}"
  NS=$(real_node_ns "$i") start_in_ns "$n.kubelet" "$BIN/kubelet" \
    --config=/etc/kubernetes/kubelet.yaml \
    --kubeconfig=/etc/kubernetes/kubelet.kubeconfig \
    --hostname-override="$n" \
    --node-ip="$(real_node_ip "$i")" \
    --node-labels="$labels" \
    --register-with-taints="$taints" \
    --v=1
}

# Adds the runner nodes to a cluster that is already up (with the same functions `up`
# uses): hack/cluster.sh add-runner-nodes. Does nothing for a node already running.
real_runner_nodes_add() {
  ((REAL_RUNNER_NODES > 0)) || { log "REAL_RUNNER_NODES=0: no runner node"; return 0; }
  local i n
  NODE_BIN=$(node_bin)
  net_up
  ns_dir_up
  echo "$REAL_RUNNER_NODES" >"$RUN/real-runner-nodes"
  for ((i = REAL_NODES; i < $(real_node_total); i++)); do
    n=$(real_node_name "$i")
    if ! pid_of "$n.containerd" >/dev/null; then
      real_node_containerd_up "$i"
      wait_healthy "$n.containerd"
    fi
    if ! pid_of "$n.kubelet" >/dev/null; then
      real_node_kubelet_up "$i"
      wait_healthy "$n.kubelet"
    fi
    if ! pid_of "$n.kvm-device-plugin" >/dev/null; then
      runner_device_plugin_up "$i"
      wait_healthy "$n.kvm-device-plugin"
    fi
  done
  real_nodes_wait_ready
}

real_nodes_wait_ready() {
  ((REAL_NODES > 0)) || return 0
  local i n deadline=$((SECONDS + TIMEOUT))
  for ((i = 0; i < $(real_node_total); i++)); do
    n=$(real_node_name "$i")
    until "$BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" wait --for=condition=Ready "node/$n" --timeout=5s >/dev/null 2>&1; do
      ((SECONDS < deadline)) || fail_with_log "$n.kubelet" "node $n not Ready after ${TIMEOUT}s"
      pid_of "$n.kubelet" >/dev/null || fail_with_log "$n.kubelet" "$n.kubelet exited"
      sleep 0.5
    done
  done
  log "real nodes Ready ($((SECONDS - T0))s)"
}

shim_pids() { # every containerd-shim-runc-v2 whose socket address is under the run dir
  local p exe
  for p in /proc/[0-9]*; do
    exe=$(readlink "$p/exe" 2>/dev/null) || continue
    [[ ${exe% (deleted)} == */containerd-shim-runc-v2 ]] || continue
    # Shims started by our nodes were started from the node's bin dir.
    [[ $exe == "$NODE_BIN"/* || -z ${NODE_BIN:-} ]] || continue
    echo "${p#/proc/}"
  done
}

real_nodes_down() {
  local i n count
  count=$(real_node_count)
  # 1. Pods first, by their kubelets (CNI DEL releases addresses and veths): only while
  #    the API server and the kubelets are still there.
  if ((count > 0)) && healthy kube-apiserver; then
    for ((i = 0; i < count; i++)); do
      n=$(real_node_name "$i")
      pid_of "$n.kubelet" >/dev/null || continue
      "$BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" delete pods -A --field-selector "spec.nodeName=$n" \
        --grace-period=0 --wait=false >/dev/null 2>&1 || true
    done
    local deadline=$((SECONDS + 30)) left
    while ((SECONDS < deadline)); do
      left=0
      for ((i = 0; i < count; i++)); do
        n=$(real_node_name "$i")
        pid_of "$n.kubelet" >/dev/null || continue
        left=$((left + $("$BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" get pods -A --field-selector "spec.nodeName=$n" -o name 2>/dev/null | wc -l)))
      done
      ((left == 0)) && break
      sleep 0.5
    done
  fi
  stop kube-proxy
  # 2. device plugins and kubelets, then whatever still runs in the nodes' cgroups
  #    (containers), then the shims, then containerd.
  for ((i = 0; i < count; i++)); do stop "$(real_node_name "$i").kvm-device-plugin"; done
  for ((i = 0; i < count; i++)); do stop "$(real_node_name "$i").kubelet"; done
  for ((i = 0; i < count; i++)); do
    cgroup_pids "$i" | while read -r p; do kill -KILL "$p" 2>/dev/null || true; done
  done
  local p
  for p in $(shim_pids); do kill -TERM "$p" 2>/dev/null || true; done
  sleep 0.5
  for p in $(shim_pids); do kill -KILL "$p" 2>/dev/null || true; done
  for ((i = 0; i < count; i++)); do stop "$(real_node_name "$i").containerd"; done
  # 3. Namespaces (their mounts go with them), cgroups, network.
  for ((i = 0; i < count; i++)); do
    node_ns_down "$i"
    cgroup_root_down "$i"
  done
  if mountpoint -q "$RUN/ns" 2>/dev/null; then umount "$RUN/ns" 2>/dev/null || umount -l "$RUN/ns" || true; fi
  net_down
  rm -rf "$RUN/nodes"
  # The runner-node count is remembered while the cluster is up (add-runner-nodes,
  # env); the next `up` starts from the default (or the caller's REAL_RUNNER_NODES)
  # again, never from a count an earlier run chose (a CI run after REAL_RUNNER_NODES=2
  # would otherwise come up with two runner nodes).
  rm -f "$RUN/real-runner-nodes"
}

real_node_count() { # how many real nodes this run directory has state for
  local n=0
  if [[ -d $RUN/nodes ]]; then
    n=$(find "$RUN/nodes" -mindepth 1 -maxdepth 1 -type d -name "$REAL_NODE_PREFIX*" | wc -l)
  fi
  ((n > $(real_node_total))) && echo "$n" || real_node_total
}

# Lists what a real-node cluster could leave on the machine; prints one line per leftover.
real_leftovers() {
  local p exe h n
  for p in /proc/[0-9]*; do
    exe=$(readlink "$p/exe" 2>/dev/null) || continue
    case ${exe% (deleted)} in
      */kubelet | */kube-proxy | */containerd | */containerd-shim-runc-v2 | */registry | */etcd | */kube-apiserver | */kube-controller-manager | */kube-scheduler | */kwok | */kvm-device-plugin)
        [[ $exe == "$PODMOTION_CACHE_DIR"/* ]] && echo "process ${p#/proc/} $exe" ;;
    esac
  done
  grep -E " ($RUN|/run/containerd|/var/lib/kubelet|/var/lib/containerd|/run/netns/cni-)" /proc/mounts | awk '{print "mount " $2}'
  ip link show "$BRIDGE" >/dev/null 2>&1 && echo "bridge $BRIDGE"
  ip -o link show type veth 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^veth[0-9a-f]{8}$' | sed 's/^/veth /'
  for h in $(cgroup_hierarchies); do
    for n in "$h/$REAL_NODE_PREFIX"*; do [[ -d $n ]] && echo "cgroup $n"; done
  done
  ls /run/netns 2>/dev/null | grep -E '^cni-' | sed 's/^/netns /'
  nft list tables 2>/dev/null | grep -E "inet ($NFT_TABLE|podmotion-fwd-)|ip6? kube-proxy" | sed 's/^table /nft table /'
  return 0
}
