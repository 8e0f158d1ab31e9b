//! Process-level migration agents for two kwok nodes: real `podmotion-agent` processes
//! (with their netns brokers and CRIU) stand for the node agents of two kwok nodes, and
//! test processes stand for the containers of the kwok pods. Used by the full-stack
//! migration test (`tests/migration_full_stack.rs`) and the chaos run
//! (`src/bin/chaos.rs`), whose operators reach these agents through the migration
//! controller's endpoint override.
//!
//! What stands in for what (the agents' testbed, `podmotion_agent::testbed`):
//! - the two kwok nodes are two agents on loopback ports, with certificates identifying
//!   each node's agent (`spiffe://podmotion.io/agent/<node>`, DNS SAN
//!   `podmotion-agent.<node>`);
//! - the source pod's container is the testbed's workload (its own pid and network
//!   namespace, a TCP server keeping a counter); a target pod's holder container is the
//!   testbed's holder process;
//! - the container runtime is the agents' container table: when kwok reports a
//!   container ID, the caller registers the process standing for it;
//! - the CNI is the testbed's "pod address moves" step.
//!
//! Needs root and CRIU (`hack/install-criu.sh`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;
use podmotion_agent::testbed::{POD_IP, Testbed};

/// A binary of the workspace built next to the running executable: in its directory
/// (a binary such as `chaos`) or one up (a test in `deps/`). `PODMOTION_<NAME>_BIN`
/// overrides.
pub fn workspace_bin(name: &str) -> anyhow::Result<PathBuf> {
    let var = format!(
        "PODMOTION_{}_BIN",
        name.trim_start_matches("podmotion-")
            .to_uppercase()
            .replace('-', "_")
    );
    if let Ok(p) = std::env::var(&var) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let dirs = exe.ancestors().skip(1).take(2);
    for dir in dirs {
        let bin = dir.join(name);
        if bin.exists() {
            return Ok(bin);
        }
    }
    anyhow::bail!(
        "{name} not built next to {}: run `cargo build -p podmotion-agent` (same profile), or set {var}",
        exe.display()
    )
}

/// Whether this process can run the agents: root, and CRIU where the testbed looks for
/// it (`hack/install-criu.sh`, or `$PODMOTION_CRIU`).
pub fn check_requirements() -> anyhow::Result<()> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let root = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|u| u.split_whitespace().nth(1))
        == Some("0");
    anyhow::ensure!(root, "the process-level migration agents need root");
    let criu = podmotion_agent::testbed::criu_path();
    anyhow::ensure!(
        criu.exists(),
        "criu not found at {} (hack/install-criu.sh installs it)",
        criu.display()
    );
    Ok(())
}

/// `N` distinct free loopback ports for servers started later, below the kernel's
/// ephemeral range (32768 and up by default): a port the kernel handed out for `:0`
/// and was given back is soon handed out again — to another test's listener, or as the
/// local port of any outgoing connection — before the server binds it (a rehearsal's
/// agent failed with "Address already in use"). Picked at random in 20000–32767, each
/// checked free by a bind, all held until all are picked.
pub fn free_ports<const N: usize>() -> [u16; N] {
    let mut held: Vec<std::net::TcpListener> = Vec::new();
    for _ in 0..10_000 {
        if held.len() == N {
            break;
        }
        let r = u32::from_str_radix(&crate::random_suffix(), 16).expect("hex");
        let port = 20_000 + (r % 12_768) as u16;
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            held.push(l);
        }
    }
    assert_eq!(held.len(), N, "no {N} free ports in 20000-32767");
    std::array::from_fn(|i| held[i].local_addr().expect("bound").port())
}

/// The first container ID kwok reports for `pod` once it runs.
pub fn container_id(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .first()?
        .container_id
        .clone()
}

/// Where a process of the workload runs: the source pod's network namespace or the
/// target pod's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodSide {
    Source,
    Target,
}

/// One live process of the workload (the testload server), found by its marker: the
/// workload's executable in one of the testbed's two pod network namespaces.
#[derive(Clone, Debug)]
pub struct WorkloadProcess {
    pub pid: i32,
    pub side: PodSide,
    /// Not stopped (frozen for a dump, or under CRIU's ptrace): it executes.
    pub running: bool,
}

/// What identifies the workload's processes: its executable, in the source or the
/// target pod's network namespace (a restored tree keeps the executable and joins the
/// target's namespace).
#[derive(Clone, Debug)]
pub struct WorkloadMarker {
    exe: PathBuf,
    /// The source pod's, then the target pod's network namespace.
    netns: [PathBuf; 2],
}

impl WorkloadMarker {
    /// Every live (not zombie) process of the workload, wherever it runs.
    pub fn processes(&self) -> Vec<WorkloadProcess> {
        let inode = |p: &Path| std::fs::metadata(p).map(|m| m.ino()).ok();
        let (src, tgt) = (inode(&self.netns[0]), inode(&self.netns[1]));
        let mut out = Vec::new();
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            if std::fs::read_link(e.path().join("exe")).ok().as_deref() != Some(self.exe.as_path())
            {
                continue;
            }
            let Some(state) = process_state(pid) else {
                continue;
            };
            if matches!(state, 'Z' | 'X' | 'x') {
                continue;
            }
            let ns = inode(&e.path().join("ns/net"));
            let side = if ns.is_some() && ns == src {
                PodSide::Source
            } else if ns.is_some() && ns == tgt {
                PodSide::Target
            } else {
                continue;
            };
            out.push(WorkloadProcess {
                pid,
                side,
                running: !matches!(state, 'T' | 't') && !being_killed(pid),
            });
        }
        out
    }
}

/// Two agents standing for the kwok nodes `nodes` (agent `i` for `nodes[i]`),
/// listening on loopback.
pub struct KwokAgents {
    pub tb: Testbed,
    pub nodes: [String; 2],
    pub ports: [u16; 2],
}

impl KwokAgents {
    /// Starts the testbed (`name` makes its namespaces distinct) and both agents.
    pub fn start(name: &str, nodes: [&str; 2]) -> anyhow::Result<KwokAgents> {
        let mut tb = Testbed::with_nodes(
            name,
            &workspace_bin("podmotion-agent")?,
            &workspace_bin("podmotion-testload")?,
            nodes,
        );
        // Two agents on one host: each its own metrics port (the default is :9090).
        tb.agent_args = vec!["--metrics-listen".into(), "127.0.0.1:0".into()];
        let ports: [u16; 2] = free_ports();
        for (i, port) in ports.iter().enumerate() {
            tb.start_agent_at(i, Some(&format!("127.0.0.1:{port}")));
        }
        // The master key as the chart mounts it: the same across operator restarts.
        let key_file = tb.dir.join("migration-master-key");
        if !key_file.exists() {
            std::fs::write(&key_file, "k".repeat(64))?;
        }
        Ok(KwokAgents {
            tb,
            nodes: nodes.map(str::to_owned),
            ports,
        })
    }

    /// The agent of `node` (index into `nodes`) comes back on its port, empty.
    pub fn restart_agent(&mut self, node: usize) {
        self.tb
            .start_agent_at(node, Some(&format!("127.0.0.1:{}", self.ports[node])));
    }

    /// The operator's flags that make it drive these agents: the endpoint override for
    /// both nodes, the operator's client certificate and the migration master key.
    pub fn operator_args(&self) -> Vec<String> {
        let endpoints = (0..2)
            .map(|i| format!("{}=https://127.0.0.1:{}", self.nodes[i], self.ports[i]))
            .collect::<Vec<_>>()
            .join(",");
        let file = |f: &str| self.tb.dir.join(f).display().to_string();
        vec![
            "--migration-agent-endpoint".into(),
            endpoints,
            "--migration-agent-tls-ca".into(),
            file("ca.crt"),
            "--migration-agent-tls-cert".into(),
            file("operator.crt"),
            "--migration-agent-tls-key".into(),
            file("operator.key"),
            "--migration-key-file".into(),
            file("migration-master-key"),
        ]
    }

    /// Plays the container runtime and the CNI for a migration's target pod once kwok
    /// runs it: its holder process starts, is registered under `container_id`, and
    /// the pod address is added to it.
    pub fn play_target(&mut self, container_id: &str) {
        let holder = self.tb.start_holder();
        self.tb.add_address_to_target();
        // The CNI gives a new pod its routes too. The testbed set the target's once, on
        // an address-less eth0, but the kernel flushes a device's routes when its last
        // address goes: after `reset_target` took the pod address away, a restore there
        // would find no route to the client ("Network is unreachable" on CRIU's
        // reconnect of the client socket).
        self.pod_network_up("tgt");
        self.tb.register_container(container_id, holder.pid);
    }

    /// The agents' logs (for failure output).
    pub fn logs(&self) -> String {
        format!(
            "source agent log:\n{}\ntarget agent log:\n{}",
            self.tb.agent_log(0),
            self.tb.agent_log(1)
        )
    }

    /// Every file left under either node's checkpoint root.
    pub fn checkpoint_files(&self) -> Vec<PathBuf> {
        let mut v = self.tb.checkpoint_files(0);
        v.extend(self.tb.checkpoint_files(1));
        v
    }

    /// The workload's marker, to find its processes from another thread.
    pub fn marker(&self) -> WorkloadMarker {
        WorkloadMarker {
            exe: std::fs::canonicalize(&self.tb.testload_bin)
                .unwrap_or_else(|_| self.tb.testload_bin.clone()),
            netns: [
                PathBuf::from(format!("/run/netns/{}", self.tb.ns("src"))),
                PathBuf::from(format!("/run/netns/{}", self.tb.ns("tgt"))),
            ],
        }
    }

    /// Every live (not zombie) process of the workload, wherever it runs.
    pub fn workload_processes(&self) -> Vec<WorkloadProcess> {
        self.marker().processes()
    }

    /// Ends whatever runs in the pod cgroups (workload trees, restored trees, holders),
    /// gives the pod address back to the source pod alone and starts a fresh workload
    /// there (`ballast_mib` of memory); returns the host pid of its root.
    pub fn fresh_workload(&mut self, ballast_mib: usize) -> i32 {
        self.reset_target();
        kill_cgroup(&self.tb.cgroup.join("src"));
        wait_gone(|| self.workload_processes().is_empty());
        self.pod_network_up("src");
        self.tb.start_workload(ballast_mib, 0).pid
    }

    /// A pod network namespace (`src` or `tgt`) as the testbed built it for a new pod:
    /// eth0 up, the route to the gateway (the client's address) and the default route.
    /// A committed migration leaves the source's network as its final dump locked it
    /// (links down, routes gone: the broker undoes a lock only for a live process, and
    /// a real source pod's namespace goes with the pod), and removing the target's pod
    /// address flushes the target's routes (the last address of eth0); these stand-ins
    /// reuse both namespaces.
    fn pod_network_up(&self, pod: &str) {
        let ns = self.tb.ns(pod);
        for args in [
            vec!["link", "set", "eth0", "up"],
            vec!["route", "replace", "10.213.1.1", "dev", "eth0"],
            vec![
                "route",
                "replace",
                "default",
                "via",
                "10.213.1.1",
                "dev",
                "eth0",
            ],
        ] {
            let ok = std::process::Command::new("ip")
                .args(["-n", &ns])
                .args(&args)
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                eprintln!("kwok agents: `ip -n {ns} {}` failed", args.join(" "));
            }
        }
    }

    /// After a rolled-back migration: the target pod's holder (and anything restored
    /// there) ends, and the pod address leaves the target pod; the source runs on.
    pub fn reset_target(&mut self) {
        kill_cgroup(&self.tb.cgroup.join("tgt"));
        wait_gone(|| {
            self.workload_processes()
                .iter()
                .all(|p| p.side == PodSide::Source)
        });
        let tgt = self.tb.ns("tgt");
        let _ = std::process::Command::new("ip")
            .args([
                "-n",
                &tgt,
                "addr",
                "del",
                &format!("{POD_IP}/32"),
                "dev",
                "eth0",
            ])
            .stderr(std::process::Stdio::null())
            .status();
        let cli = self.tb.ns("cli");
        let _ = std::process::Command::new("ip")
            .args([
                "-n",
                &cli,
                "route",
                "replace",
                &format!("{POD_IP}/32"),
                "dev",
                "to-src",
            ])
            .status();
    }
}

/// The one-letter state of `pid` from `/proc/<pid>/stat`.
/// A SIGKILL is pending for `pid` (its thread's or its group's set), or it is already
/// exiting (PF_EXITING): it never runs its own code again. A stopped source being
/// killed passes through R or D on its way to a zombie, and a sampler that read only
/// the state letter counted that as a second running copy (the short chaos run of
/// 2026-12-05, after a fenced source's kill).
fn being_killed(pid: i32) -> bool {
    const SIGKILL_BIT: u64 = 1 << (9 - 1);
    const PF_EXITING: u64 = 0x4;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let pending = status.lines().any(|l| {
        l.strip_prefix("SigPnd:")
            .or_else(|| l.strip_prefix("ShdPnd:"))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .is_some_and(|m| m & SIGKILL_BIT != 0)
    });
    // Field 9 of stat is the flags; fields are counted after the command's ")".
    let exiting = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|st| {
            let rest = st.rsplit_once(") ")?.1.to_string();
            rest.split(' ').nth(6)?.parse::<u64>().ok()
        })
        .is_some_and(|f| f & PF_EXITING != 0);
    pending || exiting
}

fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

fn kill_cgroup(cg: &Path) {
    let procs = std::fs::read_to_string(cg.join("cgroup.procs")).unwrap_or_default();
    let pids: Vec<&str> = procs.split_whitespace().collect();
    if !pids.is_empty() {
        let _ = std::process::Command::new("kill")
            .arg("-KILL")
            .args(&pids)
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// Waits (up to 5 s) for `done`.
fn wait_gone(mut done: impl FnMut() -> bool) {
    for _ in 0..100 {
        if done() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
