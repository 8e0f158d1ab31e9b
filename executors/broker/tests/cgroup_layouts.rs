//! The broker finds and moves into container cgroups laid out as the kubelet lays them
//! out with each cgroup driver, on this machine's real cgroup hierarchies, as root,
//! with the roots the chart uses by default ([`DEFAULT_PODS_ROOTS`]):
//!
//! - cgroupfs: `/kubepods/burstable/pod<uid>/<id>`;
//! - systemd: `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/cri-containerd-<id>.scope`.
//!
//! Each in three memberships a node's containers can have:
//! - **hybrid**: every v1 hierarchy mounted here and the unified (cgroup2) hierarchy,
//!   as this machine's kubelets place their containers;
//! - **legacy v1**: the v1 hierarchies only, the process left at the v2 root (`0::/`),
//!   as on a host whose v2 hierarchy is unused;
//! - **unified**: the cgroup2 hierarchy only. This machine cannot boot a v2-only node
//!   (every controller is bound to a v1 hierarchy), so every process here also has v1
//!   memberships: what this proves is the v2 path's registration and move on the real
//!   cgroup2 hierarchy; the v2-only host's write plan (no v1 line at all) is a unit
//!   test (`os::tests`).
//!
//! Each case registers a holder in a container's cgroup (a real process in its own
//! network namespace), has the broker move a tree into it (`move_cgroup`) and charge a
//! process to its memory cgroup (`charge_restore`), reads `/proc/<pid>/cgroup`, and
//! checks the refusals: another container's cgroup, the pod's own, the QoS class's.
//! The directories it made are removed however it ends.

mod support;

use podmotion_broker::client::BrokerClient;
use podmotion_broker::{Broker, DEFAULT_PODS_ROOTS, procfs};
use podmotion_wire::broker::*;
use podmotion_wire::ids::{ContainerId, MigrationUid, ProcRef};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{CONTAINER, KillOnDrop, require_root};

/// Another container of the same pod.
const SIBLING: &str = "9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Driver {
    Cgroupfs,
    Systemd,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Membership {
    Hybrid,
    LegacyV1,
    Unified,
}

/// The pod's cgroups as the kubelet (and the runtime) names them with `driver`:
/// (QoS class, pod, container, sibling container), each a path from the hierarchy's
/// root.
fn layout(driver: Driver, pod_uid: &str) -> [String; 4] {
    match driver {
        Driver::Cgroupfs => {
            let qos = "/kubepods/burstable".to_owned();
            let pod = format!("{qos}/pod{pod_uid}");
            [
                qos,
                pod.clone(),
                format!("{pod}/{CONTAINER}"),
                format!("{pod}/{SIBLING}"),
            ]
        }
        Driver::Systemd => {
            let qos = "/kubepods.slice/kubepods-burstable.slice".to_owned();
            let pod = format!(
                "{qos}/kubepods-burstable-pod{}.slice",
                pod_uid.replace('-', "_")
            );
            [
                qos,
                pod.clone(),
                format!("{pod}/cri-containerd-{CONTAINER}.scope"),
                format!("{pod}/cri-containerd-{SIBLING}.scope"),
            ]
        }
    }
}

/// A hierarchy mounted here: its mount point and, for v1, its controllers.
#[derive(Clone, Debug)]
struct Hierarchy {
    mount: PathBuf,
    /// `None`: the unified (cgroup2) hierarchy.
    controllers: Option<String>,
}

/// Every cgroup hierarchy mounted in this process's mount namespace (the first mount
/// of each).
fn hierarchies() -> Vec<Hierarchy> {
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mut out: Vec<Hierarchy> = Vec::new();
    for (ctrls, _) in
        procfs::parse_cgroup_v1(&std::fs::read_to_string("/proc/self/cgroup").unwrap())
    {
        if let Some(mount) = procfs::cgroup_v1_mount(&mi, &ctrls) {
            out.push(Hierarchy {
                mount,
                controllers: Some(ctrls),
            });
        }
    }
    if let Some(mount) = procfs::cgroup2_mount_in(&mi) {
        out.push(Hierarchy {
            mount,
            controllers: None,
        });
    }
    out
}

/// The cgroup directories a case made (removed, deepest first, on drop) and the
/// processes it started (killed and reaped first, so the directories are empty).
#[derive(Default)]
struct Made {
    procs: Vec<KillOnDrop>,
    dirs: Vec<PathBuf>,
}

impl Made {
    /// Makes `path` (from the hierarchy's root) in `h`, each missing level recorded;
    /// in a cpuset hierarchy each new level gets its parent's CPUs and memory nodes
    /// (a cpuset without them takes no process).
    fn mkdir(&mut self, h: &Hierarchy, path: &str) {
        let mut dir = h.mount.clone();
        for c in path.trim_start_matches('/').split('/') {
            let parent = dir.clone();
            dir.push(c);
            match std::fs::create_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => panic!("{}: {e}", dir.display()),
            }
            self.dirs.push(dir.clone());
            if h.controllers
                .as_deref()
                .is_some_and(|c| c.split(',').any(|c| c == "cpuset"))
            {
                for f in ["cpuset.cpus", "cpuset.mems"] {
                    let v = std::fs::read_to_string(parent.join(f)).unwrap();
                    std::fs::write(dir.join(f), v.trim()).unwrap();
                }
            }
        }
    }
}

impl Drop for Made {
    fn drop(&mut self) {
        self.procs.clear();
        // What the started processes left in the cgroups (a moved tree's children).
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let left: Vec<i32> = self
                .dirs
                .iter()
                .filter_map(|d| std::fs::read_to_string(d.join("cgroup.procs")).ok())
                .flat_map(|t| t.lines().filter_map(|l| l.parse().ok()).collect::<Vec<_>>())
                .collect();
            if left.is_empty() || Instant::now() > deadline {
                break;
            }
            for pid in left {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for d in self.dirs.iter().rev() {
            // A cgroup whose last process was just reaped may stay busy a moment.
            let deadline = Instant::now() + Duration::from_secs(5);
            while let Err(e) = std::fs::remove_dir(d) {
                if Instant::now() > deadline {
                    eprintln!("could not remove {}: {e}", d.display());
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// The `cgroup.procs` files of `path` in each hierarchy of `hs`.
fn procs_files(hs: &[Hierarchy], path: &str) -> String {
    hs.iter()
        .map(|h| {
            h.mount
                .join(path.trim_start_matches('/'))
                .join("cgroup.procs")
                .display()
                .to_string()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Waits until `pid` runs `comm` (10 s at most); its pinned reference.
fn running(pid: i32, comm: &str) -> ProcRef {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == comm) {
        assert!(Instant::now() < deadline, "pid {pid} never ran {comm}");
        std::thread::sleep(Duration::from_millis(20));
    }
    ProcRef {
        pid,
        start_time: procfs::start_time(pid).unwrap(),
    }
}

/// `sleep` in a fresh network namespace, written into `path` of each of `hs` first.
fn sleeper_in(made: &mut Made, hs: &[Hierarchy], path: &str) -> ProcRef {
    let child = Command::new("unshare")
        .args(["-n", "sh", "-c"])
        .arg(format!(
            "for f in {}; do echo $$ > $f || exit 1; done; exec sleep 600",
            procs_files(hs, path)
        ))
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    made.procs.push(KillOnDrop(child));
    running(pid, "sleep")
}

/// `/proc/<pid>/cgroup` as (hierarchy id's controllers or "" for v2, path).
fn memberships(pid: i32) -> Vec<(String, String)> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, c, p) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
            (c.to_owned(), p.to_owned())
        })
        .collect()
}

/// The path of `pid` in hierarchy `h`.
fn path_in(pid: i32, h: &Hierarchy) -> String {
    let want = h.controllers.clone().unwrap_or_default();
    memberships(pid)
        .into_iter()
        .find(|(c, _)| *c == want)
        .unwrap_or_else(|| panic!("pid {pid} has no membership in {want:?}"))
        .1
}

fn broker(tag: &str) -> (Arc<Broker>, PathBuf, PathBuf) {
    let run_dir = std::env::temp_dir().join(tag);
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir).unwrap();
    let b = Broker::new(support::config(
        run_dir.clone(),
        DEFAULT_PODS_ROOTS.to_owned(),
        0,
    ));
    let socket = run_dir.join("broker.sock");
    let l = b.bind(&socket).unwrap();
    let b2 = Arc::clone(&b);
    std::thread::spawn(move || b2.serve_listener(l));
    (b, socket, run_dir)
}

fn register(
    c: &mut BrokerClient,
    uid: &str,
    p: ProcRef,
    container: &str,
) -> Result<String, BrokerError> {
    match c.call(&Request::Register {
        uid: MigrationUid::parse(uid).unwrap(),
        role: BrokerRole::Target,
        process: p,
        container: ContainerId::parse(container).unwrap(),
    })? {
        Reply::Registered { cgroup } => Ok(cgroup),
        r => panic!("register answered {r:?}"),
    }
}

/// The cases share `/kubepods` and `/kubepods.slice`: one at a time, so that none
/// removes a parent another is making a pod in.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn case(driver: Driver, membership: Membership) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let all = hierarchies();
    let v2: Vec<_> = all
        .iter()
        .filter(|h| h.controllers.is_none())
        .cloned()
        .collect();
    let v1: Vec<_> = all
        .iter()
        .filter(|h| h.controllers.is_some())
        .cloned()
        .collect();
    let hs = match membership {
        Membership::Hybrid => all.clone(),
        Membership::LegacyV1 => v1.clone(),
        Membership::Unified => v2.clone(),
    };
    if membership == Membership::LegacyV1 {
        // The holder inherits the test's v2 cgroup: the root, as on a host where the
        // v2 hierarchy is unused.
        let mine = memberships(std::process::id() as i32);
        assert!(
            mine.contains(&(String::new(), "/".to_owned())),
            "the test must run at the v2 root to stand for a legacy v1 host: {mine:?}"
        );
    }
    assert!(
        !hs.is_empty(),
        "{membership:?}: no such hierarchy mounted here ({all:?})"
    );
    let tag = format!("pmb-cgl-{driver:?}-{membership:?}-{}", std::process::id()).to_lowercase();
    let pod_uid = format!("6fecc63a-68d4-4995-b8ec-{:012x}", std::process::id());
    let [qos, pod, ctr, sibling] = layout(driver, &pod_uid);
    let mut made = Made::default();
    for p in [&ctr, &sibling] {
        for h in &hs {
            made.mkdir(h, p);
        }
    }
    let (_b, socket, run_dir) = broker(&tag);
    let mut c = BrokerClient::connect(&socket).unwrap();

    // The holder, in the container's cgroup in every hierarchy of the case.
    let holder = sleeper_in(&mut made, &hs, &ctr);
    for h in &hs {
        assert_eq!(path_in(holder.pid, h), ctr, "holder in {h:?}");
    }
    let cgroup = register(&mut c, &format!("{tag}-ok"), holder, CONTAINER)
        .unwrap_or_else(|e| panic!("{driver:?}/{membership:?}: {ctr} refused: {e}"));
    // The broker knows it by its v2 path, or by its v1 path where v2 is unused.
    assert_eq!(cgroup, ctr);
    println!("{driver:?}/{membership:?}: registered at {cgroup}");

    // A restored tree (a shell and its child) in the holder's network namespace, here
    // in the test's own cgroups, moved into the container's.
    let tree = Command::new("nsenter")
        .arg(format!("--net=/proc/{}/ns/net", holder.pid))
        .args(["sh", "-c", "sleep 600 & wait"])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let root = tree.id() as i32;
    made.procs.push(KillOnDrop(tree));
    let root_ref = running(root, "sh");
    let deadline = Instant::now() + Duration::from_secs(10);
    while procfs::tree(root).len() < 2 {
        assert!(Instant::now() < deadline, "the tree's child did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = memberships(root);
    let moved = c
        .call(&Request::MoveCgroup {
            uid: MigrationUid::parse(&format!("{tag}-ok")).unwrap(),
            process: root_ref,
        })
        .unwrap_or_else(|e| panic!("{driver:?}/{membership:?}: move_cgroup: {e}"));
    assert_eq!(moved, Reply::Moved { pids: 2 });
    for pid in procfs::tree(root) {
        for h in &hs {
            assert_eq!(path_in(pid, h), ctr, "pid {pid} in {h:?}");
        }
        // Hierarchies outside the case: where the holder is (the test's own).
        for h in all
            .iter()
            .filter(|h| !hs.iter().any(|x| x.mount == h.mount))
        {
            assert_eq!(
                path_in(pid, h),
                path_in(holder.pid, h),
                "pid {pid} in {h:?}"
            );
        }
    }
    println!(
        "{driver:?}/{membership:?}: moved {:?} from {before:?} to {:?}",
        procfs::tree(root),
        memberships(root)
    );

    // The restore's launcher (a process of the agent's pod: the broker's network
    // namespace) charged to the container's memory cgroup: v1 `memory`, and v2.
    let launcher = Command::new("sleep").arg("600").spawn().unwrap();
    let lpid = launcher.id() as i32;
    made.procs.push(KillOnDrop(launcher));
    let lref = running(lpid, "sleep");
    let charged = c
        .call(&Request::ChargeRestore {
            uid: MigrationUid::parse(&format!("{tag}-ok")).unwrap(),
            process: lref,
        })
        .unwrap_or_else(|e| panic!("{driver:?}/{membership:?}: charge_restore: {e}"));
    assert_eq!(charged, Reply::Moved { pids: 1 });
    for h in &hs {
        let is_memory = h
            .controllers
            .as_deref()
            .is_none_or(|c| c.split(',').any(|c| c == "memory"));
        if is_memory {
            assert_eq!(path_in(lpid, h), ctr, "launcher in {h:?}");
        }
    }

    // Refused: another container of the pod named as this one, and a process in the
    // pod's or the QoS class's own cgroup (no container's).
    let other = sleeper_in(&mut made, &hs, &sibling);
    let e = register(&mut c, &format!("{tag}-sibling"), other, CONTAINER).unwrap_err();
    assert_eq!(e.kind, ErrorKind::ForeignProcess, "{e}");
    // … while it is accepted as the container it is.
    assert_eq!(
        register(&mut c, &format!("{tag}-sibling2"), other, SIBLING).unwrap(),
        sibling
    );
    for p in [&pod, &qos] {
        let stray = sleeper_in(&mut made, &hs, p);
        let e = register(&mut c, &format!("{tag}-stray"), stray, CONTAINER).unwrap_err();
        assert_eq!(e.kind, ErrorKind::ForeignProcess, "{p}: {e}");
    }
    drop(c);
    let _ = std::fs::remove_dir_all(&run_dir);
    let dirs: Vec<_> = made.dirs.clone();
    drop(made);
    let left: Vec<_> = dirs.iter().filter(|d| Path::new(d).exists()).collect();
    assert!(left.is_empty(), "cgroups left behind: {left:?}");
}

#[test]
fn cgroupfs_containers_on_v1_and_unified_hierarchies() {
    if !require_root() {
        return;
    }
    case(Driver::Cgroupfs, Membership::Hybrid);
}

#[test]
fn systemd_scopes_on_v1_and_unified_hierarchies() {
    if !require_root() {
        return;
    }
    case(Driver::Systemd, Membership::Hybrid);
}

#[test]
fn cgroupfs_containers_on_a_legacy_v1_host() {
    if !require_root() {
        return;
    }
    case(Driver::Cgroupfs, Membership::LegacyV1);
}

#[test]
fn systemd_scopes_on_a_legacy_v1_host() {
    if !require_root() {
        return;
    }
    case(Driver::Systemd, Membership::LegacyV1);
}

#[test]
fn cgroupfs_containers_on_the_unified_hierarchy() {
    if !require_root() {
        return;
    }
    case(Driver::Cgroupfs, Membership::Unified);
}

#[test]
fn systemd_scopes_on_the_unified_hierarchy() {
    if !require_root() {
        return;
    }
    case(Driver::Systemd, Membership::Unified);
}
