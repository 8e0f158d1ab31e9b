//! What the real-kernel tests of the broker library share (`hostile.rs`,
//! `handover.rs`): root, an in-process broker on a private socket, run directory and
//! pods cgroup root (`Fixture`), and the container its processes run in.
#![allow(dead_code)]

use podmotion_broker::{Broker, Config, procfs};
use podmotion_wire::ids::ContainerId;
use std::path::PathBuf;
use std::process::Child;
use std::sync::Arc;
use std::time::Duration;

/// The container the fixture's processes run in: its pod cgroup's leaf is named by its
/// ID, as with the kubelet's cgroupfs driver (`<root>/pod/<id>`).
pub const CONTAINER: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";

pub fn container() -> ContainerId {
    ContainerId::parse(CONTAINER).unwrap()
}

pub fn require_root() -> bool {
    if std::env::var("PODMOTION_ROOT_TESTS").as_deref() == Ok("0") {
        // A developer's local run only: under CI (`CI` set) the switch fails the test.
        assert!(
            !std::env::var("CI").is_ok_and(|v| !matches!(v.as_str(), "" | "0" | "false")),
            "PODMOTION_ROOT_TESTS=0 is set under CI: skip switches are for local runs only"
        );
        eprintln!("PODMOTION_ROOT_TESTS=0: skipping");
        return false;
    }
    assert!(
        nix::unistd::geteuid().is_root(),
        "broker tests need root (set PODMOTION_ROOT_TESTS=0 to skip)"
    );
    true
}

/// An in-process broker serving on `<run_dir>/broker.sock`, its pods cgroup root a
/// fresh cgroup holding one pod with [`CONTAINER`]'s leaf cgroup.
pub struct Fixture {
    pub broker: Arc<Broker>,
    pub socket: PathBuf,
    pub run_dir: PathBuf,
    pub cgroup: PathBuf,
    pub cgroup_rel: String,
}

/// The configuration of fixture `tag` (hand-over off).
pub fn config(run_dir: PathBuf, cgroup_rel: String, allowed_uid: u32) -> Config {
    Config {
        run_dir,
        pods_cgroup_root: cgroup_rel,
        allowed_uid,
        same_netns_peers: true,
        container_cgroups: true,
        handover_cidrs: Vec::new(),
        address_linger: Duration::from_secs(3600),
        sweep_interval: Duration::from_secs(2),
        hold_neighbours: false,
        forward_new_connections: false,
    }
}

pub fn fixture(name: &str, allowed_uid: u32) -> Fixture {
    fixture_with(name, allowed_uid, |_| {})
}

/// A fixture whose configuration `tweak` adjusts.
pub fn fixture_with(name: &str, allowed_uid: u32, tweak: impl FnOnce(&mut Config)) -> Fixture {
    let tag = format!("pmb-{name}-{}", std::process::id());
    let run_dir = std::env::temp_dir().join(&tag);
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir).unwrap();
    let cgroup_rel = format!("/{tag}");
    let cgroup = procfs::cgroup2_mount().unwrap().join(&tag);
    std::fs::create_dir_all(cgroup.join("pod").join(CONTAINER)).unwrap();
    let mut cfg = config(run_dir.clone(), cgroup_rel.clone(), allowed_uid);
    tweak(&mut cfg);
    let broker = Broker::new(cfg);
    let socket = run_dir.join("broker.sock");
    let listener = broker.bind(&socket).unwrap();
    let b = Arc::clone(&broker);
    std::thread::spawn(move || b.serve_listener(listener));
    Fixture {
        broker,
        socket,
        run_dir,
        cgroup,
        cgroup_rel,
    }
}

impl Fixture {
    /// The `cgroup.procs` of [`CONTAINER`]'s cgroup.
    pub fn procs(&self) -> PathBuf {
        self.cgroup.join("pod").join(CONTAINER).join("cgroup.procs")
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.run_dir);
        for d in [&format!("pod/{CONTAINER}"), "pod", ""] {
            let _ = std::fs::remove_dir(self.cgroup.join(d));
        }
    }
}

/// A pod's holder: `sleep` in a fresh network namespace, in the fixture's container
/// cgroup, pinned once it runs (10 s at most).
pub fn holder_in_netns(f: &Fixture) -> (KillOnDrop, podmotion_wire::ids::ProcRef) {
    let holder = KillOnDrop(
        std::process::Command::new("unshare")
            .args(["-n", "sh", "-c"])
            .arg(format!("echo $$ > {}; exec sleep 600", f.procs().display()))
            .stdin(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = holder.0.id() as i32;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep") {
        assert!(
            std::time::Instant::now() < deadline,
            "the holder did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let process = podmotion_wire::ids::ProcRef {
        pid,
        start_time: procfs::start_time(pid).unwrap(),
    };
    (holder, process)
}

/// Kills (SIGKILL also ends a stopped process) and reaps a child however the test ends.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `sh -c script`, panicking with its stderr when it fails; its stdout.
pub fn sh(script: &str) -> String {
    let out = std::process::Command::new("sh")
        .args(["-c", script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `Tcp: RetransSegs` of the network namespace `enter` (a command prefix that enters
/// it: `nsenter -t <pid> -n`, `ip netns exec <name>`) runs `cat /proc/net/snmp` in.
pub fn retrans_segs(enter: &str) -> u64 {
    let snmp = sh(&format!("{enter} cat /proc/net/snmp"));
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next().unwrap(), tcp.next().unwrap());
    let i = names
        .split_whitespace()
        .position(|n| n == "RetransSegs")
        .unwrap();
    values.split_whitespace().nth(i).unwrap().parse().unwrap()
}
