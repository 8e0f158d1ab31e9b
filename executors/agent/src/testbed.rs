//! A two-node testbed on one machine, for the root-only migration tests and the
//! benchmark: every address lives in network namespaces created here.
//!
//! ```text
//!  <p>-na 10.213.0.1 ── veth ── 10.213.0.2 <p>-nb        node network (agents, gRPC+mTLS)
//!  <p>-src 10.213.1.10 ─ veth ─┐                          source pod (workload)
//!                              <p>-cli 10.213.1.1         "the network" + the client
//!  <p>-tgt (no address) ─ veth ┘                          target pod (holder)
//! ```
//! Moving the pod address = adding 10.213.1.10 to the target pod and pointing the
//! client's /32 route at the target's veth (what a CNI with sticky pod IPs does).
//! Brokers run in-process (one per node, separate sockets and run dirs); agents are
//! real `podmotion-agent` processes; checkpoint roots are private tmpfs mounts.
//!
//! Pods beyond `src` and `tgt` can be added ([`Testbed::add_pod`]: a pod that a move
//! makes, on either node), and a pod's process can be a *container*
//! ([`Testbed::start_container`]): the init of its own PID and mount namespaces, rooted
//! in a read-only bind of the host's root filesystem with its own `/proc` and `/dev`
//! (what a runtime makes of an image, minus the image), registered with that root
//! filesystem so that the agents treat it as a container: CRIU dumps its mount
//! namespace and restores it on the holder's root, inside the holder's PID namespace.
//! A target pod's container runs PodMotion's holder ([`Testbed::start_holder_container`]),
//! so a pod restored there is a pod PodMotion moved — and can be moved again.

use podmotion_broker::{Broker, Config as BrokerConfig, procfs};
use podmotion_wire::client::{AgentClient, TlsFiles};
use podmotion_wire::ids::ProcRef;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

pub const POD_IP: &str = "10.213.1.10";
pub const POD_PORT: u16 = 8080;
pub const TARGET_OWN_IP: &str = "10.213.1.20";
pub const NODE_IPS: [&str; 2] = ["10.213.0.1", "10.213.0.2"];
pub const AGENT_NAMES: [&str; 2] = ["agent-a", "agent-b"];

fn sh(cmd: &str) {
    let st = Command::new("sh").args(["-c", cmd]).status().expect("sh");
    assert!(st.success(), "failed: {cmd}");
}

fn ip(args: &str) {
    sh(&format!("ip {args}"));
}

/// The criu wrapper to use: $PODMOTION_CRIU or the one hack/install-criu.sh installs.
pub fn criu_path() -> PathBuf {
    if let Ok(p) = std::env::var("PODMOTION_CRIU") {
        return PathBuf::from(p);
    }
    let home = std::env::var("PODMOTION_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
                .join(".cache/podmotion")
        });
    home.join("criu/bin/criu")
}

/// Lets CRIU's lazy page server get its pipe on this host: raises the host's
/// `fs.pipe-max-size` to [`crate::lazy::CRIU_PIPE_BYTES`] where it is lower (a node
/// setting, not namespaced; it stays raised).
pub fn ensure_lazy_pipe_room() {
    if crate::lazy::pipe_room().is_err() {
        std::fs::write(
            "/proc/sys/fs/pipe-max-size",
            crate::lazy::CRIU_PIPE_BYTES.to_string(),
        )
        .expect("raise fs.pipe-max-size");
    }
    crate::lazy::pipe_room().expect("pipe room");
}

/// Whether root tests run: they do unless PODMOTION_ROOT_TESTS=0 (a developer's local
/// run only: under CI, `CI` set, the switch fails the test); if they run, root and CRIU
/// must be there (a missing CRIU fails the test, it never skips silently).
pub fn root_tests_enabled() -> bool {
    if std::env::var("PODMOTION_ROOT_TESTS").as_deref() == Ok("0") {
        assert!(
            !std::env::var("CI").is_ok_and(|v| !matches!(v.as_str(), "" | "0" | "false")),
            "PODMOTION_ROOT_TESTS=0 is set under CI: skip switches are for local runs only"
        );
        eprintln!("PODMOTION_ROOT_TESTS=0: skipping root-only migration test");
        return false;
    }
    assert!(
        nix::unistd::geteuid().is_root(),
        "migration tests need root (PODMOTION_ROOT_TESTS=0 skips them)"
    );
    let c = criu_path();
    assert!(
        c.exists(),
        "criu not found at {} — run hack/install-criu.sh (PODMOTION_ROOT_TESTS=0 skips)",
        c.display()
    );
    true
}

pub struct Tls {
    pub ca_pem: Vec<u8>,
    pub agents: [TlsFiles; 2],
    pub operator: TlsFiles,
    /// The node each agent's certificate identifies (`spiffe://podmotion.io/agent/<node>`).
    pub nodes: [String; 2],
    ca: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl Tls {
    /// A leaf certificate of the testbed's CA with these DNS SANs, identity URI SAN
    /// and CN, also written to `<dir>/<file>.crt|.key`.
    pub fn issue(&self, dir: &Path, file: &str, dns: &[String], uri: &str, cn: &str) -> TlsFiles {
        use rcgen::{CertificateParams, DnType, KeyPair, SanType};
        let k = KeyPair::generate().expect("key");
        let mut p = CertificateParams::new(dns.to_vec()).expect("params");
        p.distinguished_name.push(DnType::CommonName, cn);
        if !uri.is_empty() {
            p.subject_alt_names
                .push(SanType::URI(uri.try_into().expect("uri")));
        }
        let c = p.signed_by(&k, &self.ca).expect("sign");
        let (cert_pem, key_pem) = (c.pem().into_bytes(), k.serialize_pem().into_bytes());
        std::fs::write(dir.join(format!("{file}.crt")), &cert_pem).expect("write");
        std::fs::write(dir.join(format!("{file}.key")), &key_pem).expect("write");
        TlsFiles::from_pem(self.ca_pem.clone(), cert_pem, key_pem)
    }
}

/// A CA and leaf certificates in the identity format of `podmotion_wire::identity`:
/// agent `i` is `agent/<nodes[i]>` with DNS SANs `AGENT_NAMES[i]` plus `extra_sans[i]`;
/// the operator is `operator`.
fn make_tls(dir: &Path, nodes: [String; 2], extra_sans: &[Vec<String>; 2]) -> Tls {
    use podmotion_wire::identity::{OPERATOR_CN, OPERATOR_URI, agent_cn, agent_uri};
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(p, KeyPair::generate().expect("key")).expect("ca");
    let ca_pem = ca.pem().into_bytes();
    std::fs::write(dir.join("ca.crt"), &ca_pem).expect("write");
    let mut tls = Tls {
        agents: [
            TlsFiles::from_pem(vec![], vec![], vec![]),
            TlsFiles::from_pem(vec![], vec![], vec![]),
        ],
        operator: TlsFiles::from_pem(vec![], vec![], vec![]),
        nodes,
        ca,
        ca_pem,
    };
    for i in 0..2 {
        let dns: Vec<String> = std::iter::once(AGENT_NAMES[i].to_owned())
            .chain(extra_sans[i].iter().cloned())
            .collect();
        let node = tls.nodes[i].clone();
        tls.agents[i] = tls.issue(
            dir,
            AGENT_NAMES[i],
            &dns,
            &agent_uri(&node),
            &agent_cn(&node),
        );
    }
    tls.operator = tls.issue(
        dir,
        "operator",
        &["operator".into()],
        OPERATOR_URI,
        OPERATOR_CN,
    );
    tls
}

pub struct Testbed {
    pub p: String,
    pub dir: PathBuf,
    pub cgroup: PathBuf,
    pub brokers: [Arc<Broker>; 2],
    pub tls: Tls,
    agent_bin: PathBuf,
    pub testload_bin: PathBuf,
    agents: [Option<Child>; 2],
    children: Vec<Child>,
    /// Extra arguments for the agents started from now on.
    pub agent_args: Vec<String>,
    /// The CRIU the agents started from now on run ([`criu_path`] unless a test puts
    /// a wrapper in its place).
    pub criu: PathBuf,
    /// The containers' root filesystem, once mounted ([`Testbed::rootfs`]).
    rootfs: Option<PathBuf>,
    /// Pods added beyond `src` and `tgt` ([`Testbed::add_pod`]).
    pods: Vec<String>,
}

/// The testbed's container runtime, run as `bash container.sh <rootfs> <argv...>`
/// inside new mount and PID namespaces (`unshare -m -p -f --propagation private`):
/// descriptors inherited from the test's environment closed (the host's files are not
/// the container's), a fresh `/proc` of the new PID namespace and a tmpfs `/dev` with
/// `null` in the root filesystem, which becomes the root (`pivot_root`, the old root
/// detached), then `argv` as the namespace's init, in a session of its own (CRIU dumps
/// a session leader's tree), its streams on the container's `/dev/null`.
const CONTAINER_SH: &str = r#"R=$1; shift
for f in /proc/self/fd/*; do
  fd=${f##*/}; [ "$fd" -gt 2 ] && eval "exec $fd>&-"
done 2>/dev/null
mount -t proc proc "$R/proc" &&
mount -t tmpfs -o mode=755,size=1m tmpfs "$R/dev" &&
mknod -m 666 "$R/dev/null" c 1 3 &&
cd "$R" && pivot_root . tmp && umount -l /tmp || exit 1
exec setsid "$@" </dev/null >/dev/null 2>&1
"#;

/// The network namespace `n` of the testbed `p` (see [`Testbed::ns`]).
fn ns_of(p: &str, n: &str) -> String {
    format!("{p}-{n}")
}

/// The testbed's network namespaces, each new (a leftover of the same name deleted
/// first) with its loopback up: the two nodes, the source and target pods, the client.
fn fresh_namespaces(p: &str) {
    for n in ["na", "nb", "src", "tgt", "cli"] {
        let _ = Command::new("ip")
            .args(["netns", "del", &ns_of(p, n)])
            .stderr(Stdio::null())
            .status();
        ip(&format!("netns add {}", ns_of(p, n)));
        ip(&format!("-n {} link set lo up", ns_of(p, n)));
    }
}

/// The two nodes' link: a veth pair between them, with [`NODE_IPS`].
fn link_nodes(p: &str) {
    let ns = |n: &str| ns_of(p, n);
    ip(&format!(
        "link add eth0 netns {} type veth peer name eth0 netns {}",
        ns("na"),
        ns("nb")
    ));
    for (i, n) in ["na", "nb"].iter().enumerate() {
        ip(&format!(
            "-n {} addr add {}/24 dev eth0",
            ns(n),
            NODE_IPS[i]
        ));
        ip(&format!("-n {} link set eth0 up", ns(n)));
    }
}

/// The source and target pods' links to the client namespace, which routes
/// [`POD_IP`] to the source; the source holds the pod IP.
fn link_pods_to_client(p: &str) {
    let ns = |n: &str| ns_of(p, n);
    ip(&format!(
        "link add to-src netns {} type veth peer name eth0 netns {}",
        ns("cli"),
        ns("src")
    ));
    ip(&format!(
        "link add to-tgt netns {} type veth peer name eth0 netns {}",
        ns("cli"),
        ns("tgt")
    ));
    for l in ["to-src", "to-tgt"] {
        ip(&format!("-n {} addr add 10.213.1.1/32 dev {l}", ns("cli")));
        ip(&format!("-n {} link set {l} up", ns("cli")));
    }
    ip(&format!("-n {} addr add {POD_IP}/32 dev eth0", ns("src")));
    for n in ["src", "tgt"] {
        ip(&format!("-n {} link set eth0 up", ns(n)));
        ip(&format!("-n {} route add 10.213.1.1 dev eth0", ns(n)));
        ip(&format!(
            "-n {} route add default via 10.213.1.1 dev eth0",
            ns(n)
        ));
    }
    ip(&format!(
        "-n {} route add {POD_IP}/32 dev to-src",
        ns("cli")
    ));
}

/// The testbed's pods cgroup (`<cgroup2>/<p>`) with the source and target pods'.
fn pod_cgroups(p: &str) -> PathBuf {
    let cgroup = procfs::cgroup2_mount().expect("cgroup2").join(p);
    for c in ["src", "tgt"] {
        std::fs::create_dir_all(cgroup.join(c)).expect("cgroup");
    }
    cgroup
}

/// Node `i`'s broker, serving on `<dir>/node<i>/broker.sock` from a thread of its
/// own, with its checkpoint root on a tmpfs.
fn start_broker(dir: &Path, p: &str, i: usize) -> Arc<Broker> {
    let run = dir.join(format!("node{i}"));
    std::fs::create_dir_all(run.join("checkpoints")).expect("dir");
    sh(&format!(
        "mount -t tmpfs -o mode=0700,size=2g tmpfs {}",
        run.join("checkpoints").display()
    ));
    let b = Broker::new(BrokerConfig {
        run_dir: run.clone(),
        pods_cgroup_root: format!("/{p}"),
        allowed_uid: 0,
        // The testbed's agents run in their node's network namespace, this
        // broker in the test's: not the chart's one-pod shape.
        same_netns_peers: false,
        // The testbed's pods are the cgroups `src` and `tgt`, which carry no
        // container ID (its "containers" are rows of the container table): not the
        // kubelet's cgroup layout.
        container_cgroups: false,
        // The address hand-over is off: the testbed's pods are not on one L2 segment
        // (the client routes the pod address to the source's link), so an announced
        // address would not move; its tests play a CNI that moves the address instead.
        handover_cidrs: Vec::new(),
        address_linger: std::time::Duration::from_secs(3600),
        sweep_interval: std::time::Duration::from_secs(2),
        hold_neighbours: false,
    });
    let l = b.bind(&run.join("broker.sock")).expect("broker socket");
    let b2 = Arc::clone(&b);
    std::thread::spawn(move || b2.serve_listener(l));
    b
}

impl Testbed {
    pub fn new(name: &str, agent_bin: &Path, testload_bin: &Path) -> Self {
        Self::build(
            name,
            agent_bin,
            testload_bin,
            AGENT_NAMES.map(str::to_owned),
            [vec![], vec![]],
        )
    }

    /// A testbed whose agents stand for the Kubernetes nodes `nodes`: their
    /// certificates identify `agent/<node>` and carry the DNS SAN
    /// `podmotion-agent.<node>` the operator dials.
    pub fn with_nodes(name: &str, agent_bin: &Path, testload_bin: &Path, nodes: [&str; 2]) -> Self {
        Self::build(
            name,
            agent_bin,
            testload_bin,
            nodes.map(str::to_owned),
            nodes.map(|n| vec![format!("podmotion-agent.{n}")]),
        )
    }

    fn build(
        name: &str,
        agent_bin: &Path,
        testload_bin: &Path,
        nodes: [String; 2],
        extra_sans: [Vec<String>; 2],
    ) -> Self {
        let p = format!("pm{}{}", name, std::process::id() % 100_000);
        let dir = PathBuf::from(format!("/run/podmotion-testbed/{p}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        fresh_namespaces(&p);
        link_nodes(&p);
        link_pods_to_client(&p);
        let cgroup = pod_cgroups(&p);
        let brokers = [0, 1].map(|i| start_broker(&dir, &p, i));
        let tls = make_tls(&dir, nodes, &extra_sans);
        Self {
            p,
            dir,
            cgroup,
            brokers,
            tls,
            agent_bin: agent_bin.into(),
            testload_bin: testload_bin.into(),
            agents: [None, None],
            agent_args: vec![],
            criu: criu_path(),
            children: vec![],
            rootfs: None,
            pods: vec![],
        }
    }

    pub fn ns(&self, n: &str) -> String {
        ns_of(&self.p, n)
    }

    pub fn checkpoints(&self, node: usize) -> PathBuf {
        self.dir.join(format!("node{node}/checkpoints"))
    }

    /// Every file left under a node's checkpoint root.
    pub fn checkpoint_files(&self, node: usize) -> Vec<PathBuf> {
        fn walk(d: &Path, out: &mut Vec<PathBuf>) {
            for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
                if e.path().is_dir() {
                    walk(&e.path(), out)
                }
                out.push(e.path());
            }
        }
        let mut v = vec![];
        walk(&self.checkpoints(node), &mut v);
        v
    }

    /// Starts the agent of `node` in that node's network namespace, on port 7443.
    pub fn start_agent(&mut self, node: usize) {
        self.start_agent_at(node, None)
    }

    /// Starts the agent of `node`: in the node's network namespace, or, with `listen`,
    /// in the caller's (e.g. `127.0.0.1:port`, for an operator in this process that
    /// also talks to an API server on loopback). Either way it resolves container IDs
    /// through [`Testbed::container_table`].
    pub fn start_agent_at(&mut self, node: usize, listen: Option<&str>) {
        let name = AGENT_NAMES[node];
        let log = std::fs::File::create(self.dir.join(format!("{name}.log"))).expect("log");
        let (mut cmd, listen) = match listen {
            None => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{}", self.ns(["na", "nb"][node])))
                    .arg(&self.agent_bin);
                (c, format!("{}:7443", NODE_IPS[node]))
            }
            Some(l) => (Command::new(&self.agent_bin), l.to_string()),
        };
        // Two agents may share a network namespace (both on loopback): the metrics
        // port is the kernel's choice unless the test names one.
        if !self
            .agent_args
            .iter()
            .any(|a| a.starts_with("--metrics-listen"))
        {
            cmd.args(["--metrics-listen", "127.0.0.1:0"]);
        }
        let child = cmd
            .args(["--listen", &listen])
            .arg("--container-table")
            .arg(self.container_table())
            .arg("--tls-ca")
            .arg(self.dir.join("ca.crt"))
            .arg("--tls-cert")
            .arg(self.dir.join(format!("{name}.crt")))
            .arg("--tls-key")
            .arg(self.dir.join(format!("{name}.key")))
            .arg("--criu")
            .arg(&self.criu)
            .arg("--broker-socket")
            .arg(self.dir.join(format!("node{node}/broker.sock")))
            .arg("--checkpoints-root")
            .arg(self.checkpoints(node))
            .args(&self.agent_args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("agent");
        self.agents[node] = Some(child);
    }

    /// The agents' container table (see `containers::Containers::Table`).
    pub fn container_table(&self) -> PathBuf {
        self.dir.join("containers")
    }

    /// "The container runtime" starts a container: `id` runs as host `pid`.
    pub fn register_container(&self, id: &str, pid: i32) {
        self.table_line(&format!("{id} {pid}"));
    }

    fn table_line(&self, line: &str) {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.container_table())
            .expect("container table");
        writeln!(f, "{line}").expect("container table");
    }

    /// "The container runtime" runs `pid` as container `name` of this testbed;
    /// returns the container ID the operator names (no PID crosses the wire):
    /// `testbed://<p>-<name>`, whose bare ID (`<p>-<name>`) is a valid `ContainerId`
    /// like a runtime's (no `/`).
    pub fn container(&self, name: &str, pid: i32) -> String {
        let id = format!("testbed://{}-{name}", self.p);
        self.register_container(&id, pid);
        id
    }

    /// The `Prepare` the operator sends the agent of `node` (0: the source, 1: the
    /// target) for container `container_id`, naming the other agent's node as the peer.
    pub fn prepare_request(
        &self,
        uid: &str,
        node: usize,
        container_id: &str,
        tcp: podmotion_wire::agent::TcpPreservation,
    ) -> podmotion_wire::agent::PrepareRequest {
        use podmotion_wire::agent::{PrepareRequest, Role};
        PrepareRequest {
            migration_uid: uid.into(),
            role: [Role::Source, Role::Target][node] as i32,
            transfer_key: vec![42; 32],
            tcp: tcp as i32,
            container_ids: vec![container_id.into()],
            peer_node: self.tls.nodes[1 - node].clone(),
            freeze_budget_ms: 0,
            post_copy: false,
            containers: vec![],
        }
    }

    /// The agent log of `node` (for failure output).
    pub fn agent_log(&self, node: usize) -> String {
        std::fs::read_to_string(self.dir.join(format!("{}.log", AGENT_NAMES[node])))
            .unwrap_or_default()
    }

    /// The peak resident set (VmHWM, KiB) of the running agent of `node` so far.
    pub fn agent_peak_rss_kib(&self, node: usize) -> Option<u64> {
        let pid = self.agents[node].as_ref()?.id();
        let st = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        st.lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// The CPU time (user + system, ms) the running agent of `node` used so far, its
    /// own threads only (not the CRIU processes it runs).
    pub fn agent_cpu_ms(&self, node: usize) -> Option<u64> {
        let pid = self.agents[node].as_ref()?.id();
        let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command name (which may hold spaces): utime, stime are
        // fields 14 and 15, i.e. 12 and 13 after the closing parenthesis.
        let rest = st.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        // USER_HZ: 100 on every Linux architecture this runs on.
        Some(ticks * 10)
    }

    pub fn kill_agent(&mut self, node: usize) {
        if let Some(mut c) = self.agents[node].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops the agent of `node` as the kubelet does (SIGTERM) and waits for it; its
    /// exit status.
    pub fn terminate_agent(&mut self, node: usize) -> Option<std::process::ExitStatus> {
        let mut c = self.agents[node].take()?;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        for _ in 0..200 {
            if let Ok(Some(st)) = c.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        c.wait().ok()
    }

    pub fn endpoint(node: usize) -> String {
        format!("https://{}:7443", NODE_IPS[node])
    }

    /// Starts the workload (its own pid namespace, session leader) in the source pod's
    /// netns and cgroup; returns the root of the tree to migrate once it serves.
    pub fn start_workload(&mut self, ballast_mib: usize, dirty_kib_s: usize) -> ProcRef {
        let script = format!(
            "echo $$ > {cg}/cgroup.procs && exec nsenter --net=/run/netns/{ns} unshare -p -f setsid {bin} serve {POD_PORT} {ballast_mib} {dirty_kib_s}",
            cg = self.cgroup.join("src").display(),
            ns = self.ns("src"),
            bin = self.testload_bin.display()
        );
        // No inherited files: CRIU restores open files by path and size, so a log
        // that grew between dump and restore would (rightly) fail the restore.
        let child = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("workload");
        let outer = child.id() as i32;
        self.children.push(child);
        for _ in 0..1200 {
            if let Some(root) = procfs::tree(outer).into_iter().find(|p| {
                std::fs::read_to_string(format!("/proc/{p}/status"))
                    .map(|s| {
                        s.lines()
                            .any(|l| l.starts_with("NSpid:") && l.ends_with("\t1"))
                    })
                    .unwrap_or(false)
            }) && let Ok(mut c) = self.connect_timeout(Duration::from_millis(200))
            {
                // Measure the workload, not its warm-up: wait for the ballast.
                while ask(&mut c, "ballast").expect("ballast") != "filled" {
                    std::thread::sleep(Duration::from_millis(50));
                }
                return ProcRef {
                    pid: root,
                    start_time: procfs::start_time(root).expect("start"),
                };
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("workload did not come up");
    }

    /// The target pod's holder: keeps its netns and cgroup.
    pub fn start_holder(&mut self) -> ProcRef {
        let script = format!(
            "echo $$ > {cg}/cgroup.procs && exec nsenter --net=/run/netns/{ns} sleep 100000",
            cg = self.cgroup.join("tgt").display(),
            ns = self.ns("tgt")
        );
        let child = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .spawn()
            .expect("holder");
        let pid = child.id() as i32;
        self.children.push(child);
        for _ in 0..200 {
            if procfs::cgroup_of(pid)
                .map(|c| c.ends_with("/tgt"))
                .unwrap_or(false)
                && std::fs::read_link(format!("/proc/{pid}/exe"))
                    .map(|e| e.ends_with("sleep"))
                    .unwrap_or(false)
            {
                return ProcRef {
                    pid,
                    start_time: procfs::start_time(pid).expect("start"),
                };
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("holder did not come up");
    }

    /// A pod `name` (at most 12 characters) beside `src` and `tgt`: its network
    /// namespace linked to the client's (as `src` and `tgt` are, without the pod
    /// address) and its cgroup. Removed with the testbed.
    pub fn add_pod(&mut self, name: &str) {
        assert!(
            name.len() <= 12,
            "pod name {name:?}: its veth name would be too long"
        );
        let (ns, cli) = (self.ns(name), self.ns("cli"));
        let _ = Command::new("ip")
            .args(["netns", "del", &ns])
            .stderr(Stdio::null())
            .status();
        ip(&format!("netns add {ns}"));
        self.pods.push(name.to_owned());
        ip(&format!("-n {ns} link set lo up"));
        ip(&format!(
            "link add to-{name} netns {cli} type veth peer name eth0 netns {ns}"
        ));
        ip(&format!("-n {cli} addr add 10.213.1.1/32 dev to-{name}"));
        ip(&format!("-n {cli} link set to-{name} up"));
        ip(&format!("-n {ns} link set eth0 up"));
        ip(&format!("-n {ns} route add 10.213.1.1 dev eth0"));
        ip(&format!(
            "-n {ns} route add default via 10.213.1.1 dev eth0"
        ));
        std::fs::create_dir_all(self.cgroup.join(name)).expect("cgroup");
    }

    /// "The CNI" of a pod the workload moved to: the pod address exists in pod
    /// `name` (it may still exist in others) and the client's route leads there.
    pub fn route_pod_address_to(&self, name: &str) {
        self.pod_address_in(name);
        ip(&format!(
            "-n {} route replace {POD_IP}/32 dev to-{name}",
            self.ns("cli")
        ));
    }

    /// The pod address exists in pod `name` (what a restore that keeps the
    /// connections needs there); the client's route does not change.
    pub fn pod_address_in(&self, name: &str) {
        ip(&format!(
            "-n {} addr replace {POD_IP}/32 dev eth0",
            self.ns(name)
        ));
    }

    /// "The CNI" gives the pod address of pod `name` back (a rolled-back target):
    /// what a copy killed there still sends from it goes nowhere, as the agent's
    /// address hand-over releases an adopted address before it kills the copy.
    pub fn pod_address_gone_from(&self, name: &str) {
        ip(&format!(
            "-n {} addr del {POD_IP}/32 dev eth0",
            self.ns(name)
        ));
    }

    /// The containers' root filesystem: a read-only, non-recursive bind of the host's
    /// `/` (no submounts: no /proc, /sys, /dev, tmpfs, netns), mounted once, outside
    /// the testbed's directory, and unmounted with the testbed. Read-only: a container
    /// writes nothing of the host's.
    pub fn rootfs(&mut self) -> PathBuf {
        if let Some(r) = &self.rootfs {
            return r.clone();
        }
        let r = PathBuf::from(format!("/run/podmotion-testbed/{}.rootfs", self.p));
        std::fs::create_dir_all(&r).expect("rootfs dir");
        sh(&format!("mount --bind / {}", r.display()));
        self.rootfs = Some(r.clone());
        sh(&format!("mount -o remount,bind,ro {}", r.display()));
        r
    }

    /// Starts a container in pod `pod` running `argv` as the init of its own PID and
    /// mount namespaces, rooted in [`Testbed::rootfs`] with a fresh `/proc` and a
    /// tmpfs `/dev` holding `null` (its standard streams); returns that init once it
    /// runs `argv`.
    pub fn start_container(&mut self, pod: &str, argv: &[String]) -> ProcRef {
        let rootfs = self.rootfs();
        let runtime = self.dir.join("container.sh");
        std::fs::write(&runtime, CONTAINER_SH).expect("container.sh");
        let quoted: Vec<String> = argv.iter().map(|a| format!("'{a}'")).collect();
        let script = format!(
            "echo $$ > {cg}/cgroup.procs && exec nsenter --net=/run/netns/{ns} unshare -m -p -f --propagation private bash {runtime} {rootfs} {argv}",
            cg = self.cgroup.join(pod).display(),
            ns = self.ns(pod),
            runtime = runtime.display(),
            rootfs = rootfs.display(),
            argv = quoted.join(" "),
        );
        let child = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("container");
        let outer = child.id() as i32;
        self.children.push(child);
        let want: Vec<u8> = argv
            .iter()
            .flat_map(|a| [a.as_bytes(), b"\0"].concat())
            .collect();
        for _ in 0..1000 {
            let init = procfs::tree(outer).into_iter().find(|p| {
                procfs::ns_pids(*p).is_some_and(|n| n.len() > 1 && n.last() == Some(&1))
                    && std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c == want)
            });
            if let Some(pid) = init {
                return ProcRef {
                    pid,
                    start_time: procfs::start_time(pid).expect("start"),
                };
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("container {argv:?} did not come up in pod {pod}");
    }

    /// The workload as a container of pod `pod` (see [`Testbed::start_container`]),
    /// once it serves with its ballast filled; the pod address must lead to `pod`.
    pub fn start_workload_container(
        &mut self,
        pod: &str,
        ballast_mib: usize,
        dirty_kib_s: usize,
    ) -> ProcRef {
        let argv = [
            self.testload_bin.display().to_string(),
            "serve".into(),
            POD_PORT.to_string(),
            ballast_mib.to_string(),
            dirty_kib_s.to_string(),
        ];
        let root = self.start_container(pod, &argv);
        for _ in 0..1200 {
            if let Ok(mut c) = self.connect_timeout(Duration::from_millis(200)) {
                while ask(&mut c, "ballast").expect("ballast") != "filled" {
                    std::thread::sleep(Duration::from_millis(50));
                }
                return root;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("workload container did not come up");
    }

    /// A target pod's container in pod `pod`: PodMotion's holder (`<dir>/hold hold`,
    /// installed by the agent's own `install-holder`, as the target pod's init
    /// container does), the init of its container (see [`Testbed::start_container`]).
    pub fn start_holder_container(&mut self, pod: &str) -> ProcRef {
        let hold = self.dir.join("hold");
        if !hold.exists() {
            let st = Command::new(&self.agent_bin)
                .arg(crate::holder::INSTALL)
                .arg(&hold)
                .status()
                .expect("install-holder");
            assert!(st.success(), "install-holder failed");
        }
        self.start_container(
            pod,
            &[hold.display().to_string(), crate::holder::HOLD.into()],
        )
    }

    /// "The container runtime" runs `pid`, a container of [`Testbed::start_container`],
    /// as container `name`: registered with its root filesystem; returns its ID.
    pub fn container_with_rootfs(&mut self, name: &str, pid: i32) -> String {
        let rootfs = self.rootfs();
        let id = format!("testbed://{}-{name}", self.p);
        self.table_line(&format!("{id} {pid} {}", rootfs.display()));
        id
    }

    /// "The CNI": the pod address now exists in the target pod too.
    pub fn add_address_to_target(&self) {
        ip(&format!(
            "-n {} addr add {POD_IP}/32 dev eth0",
            self.ns("tgt")
        ));
    }

    /// The target pod gets its own address (the pod address does not move).
    pub fn give_target_its_own_address(&self) {
        ip(&format!(
            "-n {} addr add {TARGET_OWN_IP}/32 dev eth0",
            self.ns("tgt")
        ));
        ip(&format!(
            "-n {} route add {TARGET_OWN_IP}/32 dev to-tgt",
            self.ns("cli")
        ));
    }

    /// A client connection to `ip:8080` from the client namespace.
    pub fn connect_to(&self, ip: &'static str) -> std::io::Result<TcpStream> {
        self.in_netns("cli", move || {
            let s = TcpStream::connect_timeout(
                &format!("{ip}:{POD_PORT}").parse().expect("addr"),
                Duration::from_secs(5),
            )?;
            s.set_read_timeout(Some(Duration::from_secs(20)))?;
            Ok(s)
        })
    }

    /// "The network": traffic for the pod address goes to the target pod.
    pub fn route_to_target(&self) {
        ip(&format!(
            "-n {} route replace {POD_IP}/32 dev to-tgt",
            self.ns("cli")
        ));
    }

    /// Runs `f` on a thread inside network namespace `ns`.
    pub fn in_netns<T: Send + 'static>(
        &self,
        ns: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        let file = std::fs::File::open(format!("/run/netns/{}", self.ns(ns))).expect("netns");
        std::thread::spawn(move || {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("netns thread")
    }

    /// A client connection to the pod address from the client namespace.
    pub fn connect_timeout(&self, t: Duration) -> std::io::Result<TcpStream> {
        self.in_netns("cli", move || {
            let s = TcpStream::connect_timeout(
                &format!("{POD_IP}:{POD_PORT}").parse().expect("addr"),
                t,
            )?;
            s.set_read_timeout(Some(Duration::from_secs(20)))?;
            Ok(s)
        })
    }

    /// Runs the operator side (an async closure) on a thread in node A's namespace.
    pub fn operator<F, Fut, T>(&self, f: F) -> T
    where
        F: FnOnce(Tls2) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T>,
        T: Send + 'static,
    {
        let tls = Tls2 {
            operator: self.tls.operator.clone(),
        };
        self.in_netns("na", move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("rt")
                .block_on(f(tls))
        })
    }
}

/// What the operator closure gets.
pub struct Tls2 {
    pub operator: TlsFiles,
}

impl Tls2 {
    /// Connects to an agent, retrying while it starts.
    pub async fn agent(&self, node: usize) -> AgentClient {
        for _ in 0..100 {
            if let Ok(c) =
                AgentClient::connect(&Testbed::endpoint(node), AGENT_NAMES[node], &self.operator)
                    .await
            {
                return c;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("agent {node} unreachable");
    }
}

/// One request/response line on a client connection.
pub fn ask(s: &mut TcpStream, line: &str) -> std::io::Result<String> {
    use std::io::{BufRead, BufReader, Write};
    writeln!(s, "{line}")?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut out = String::new();
    if r.read_line(&mut out)? == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "closed",
        ));
    }
    Ok(out.trim().to_owned())
}

impl Drop for Testbed {
    fn drop(&mut self) {
        self.kill_agent(0);
        self.kill_agent(1);
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Whatever is still in the pod cgroups (restored trees, pid-ns inits).
        let pods: Vec<String> = ["src", "tgt"]
            .into_iter()
            .map(str::to_owned)
            .chain(self.pods.iter().cloned())
            .collect();
        for c in &pods {
            let procs = std::fs::read_to_string(self.cgroup.join(c).join("cgroup.procs"))
                .unwrap_or_default();
            for p in procs
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
            {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        std::thread::sleep(Duration::from_millis(100));
        for c in pods.iter().map(String::as_str).chain([""]) {
            let _ = std::fs::remove_dir(self.cgroup.join(c));
        }
        if let Some(r) = &self.rootfs {
            // Never removed recursively: while mounted it is the host's root.
            let _ = Command::new("umount").arg("-l").arg(r).status();
            let _ = std::fs::remove_dir(r);
        }
        for i in 0..2 {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(self.checkpoints(i))
                .status();
            let netns = self.dir.join(format!("node{i}/netns"));
            for e in std::fs::read_dir(&netns).into_iter().flatten().flatten() {
                let _ = Command::new("umount").arg("-l").arg(e.path()).status();
            }
        }
        for n in ["na", "nb", "cli"]
            .into_iter()
            .chain(pods.iter().map(String::as_str))
        {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(n)])
                .status();
        }
        if std::env::var("PODMOTION_KEEP_TESTBED").is_err() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
