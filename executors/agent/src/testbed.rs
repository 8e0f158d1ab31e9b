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

use podmotion_broker::Broker;
use podmotion_wire::client::{AgentClient, TlsFiles};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

mod net;
mod nodes;
mod pods;
mod tls;

pub use tls::{AGENT_NAMES, Tls};

pub const POD_IP: &str = "10.213.1.10";
pub const POD_PORT: u16 = 8080;
pub const TARGET_OWN_IP: &str = "10.213.1.20";
pub const NODE_IPS: [&str; 2] = ["10.213.0.1", "10.213.0.2"];

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
