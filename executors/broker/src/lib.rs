//! The netns broker: the one long-lived privileged piece of the migration node agent.
//!
//! It listens on a root-owned Unix socket (0600), checks the peer's uid with
//! SO_PEERCRED, reads one length-capped frame per request, decodes and validates it
//! ([`podmotion_wire::broker::decode_request`]), checks every pid against /proc (live,
//! same start time as when pinned, part of the migration), and only then acts. Paths
//! it mounts on are computed from the migration UID, never taken from the client.
//!
//! Each connection is a lease: if the agent that locked a source's network disappears
//! before `kill`, `unlock_network` or `forget`, the broker rolls the source back
//! (waits for CRIU to detach, takes sockets out of repair, unlocks, SIGCONT), so a
//! killed agent never leaves a workload frozen — unless the source is **fenced**
//! (`fence`: the operator is about to restore it on the target): a fenced source is
//! never resumed by the broker (`resume` is refused until `unfence`), and a lost lease
//! or a restart kills its tree instead, so it never runs beside its restored copy.
//!
//! Where the installer enabled it (`--address-handover-cidrs`), a target can take over
//! the source pod's address ([`handover`]: `adopt_address`, `release_address`), journalled
//! and swept by a background thread until no moved connection uses it.
#![deny(unsafe_code)]

pub mod client;
pub mod conntrack;
#[cfg(any(test, feature = "fake"))]
pub mod fake;
pub mod forward;
mod frame;
pub mod handover;
mod journal;
#[allow(unsafe_code)]
pub mod kernel;
mod netlock;
mod ops;
pub mod os;
pub mod procfs;
mod serve;
pub mod synhold;

use netlock::unlock;
use nix::sys::signal::Signal;
pub use os::{Ip, Kernel, Link, RealKernel};
use podmotion_wire::broker::*;
use podmotion_wire::ids::{ContainerId, MigrationUid, ProcRef};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Config {
    /// Runtime dir; netns bind mounts go to `<run_dir>/netns/<uid>`.
    pub run_dir: PathBuf,
    /// Only processes in cgroups strictly below one of these paths (comma-separated;
    /// [`DEFAULT_PODS_ROOTS`]: `/kubepods` for the kubelet's cgroupfs driver,
    /// `/kubepods.slice` for its systemd driver) may be registered: the agent can
    /// never pin a host daemon. Matched against a process's cgroup v2 path, or its v1
    /// path on a legacy v1 host ([`procfs::cgroup_path`]).
    pub pods_cgroup_root: String,
    /// The uid the agent runs as.
    pub allowed_uid: u32,
    /// Peers must also share the broker's network namespace — the chart's shape, where
    /// the agent and the broker are the two containers of one pod. Always on in the
    /// shipped binary; off only where a test harness runs agents in other namespaces
    /// than an in-process broker (the agent crate's testbed).
    pub same_netns_peers: bool,
    /// A registered process must be in the cgroup of the container the agent names
    /// (`register`'s `container`, see [`names_container`]): the container the operator
    /// named in its `Prepare`, not just any pod's process. Always on in the shipped
    /// binary; off only where a test harness stands processes in cgroups that carry no
    /// container ID (the agent crate's testbed: `src` and `tgt`).
    pub container_cgroups: bool,
    /// The pod address hand-over (`adopt_address`, `--address-handover-cidrs`): the
    /// networks an adopted address must lie in. Empty: the hand-over is off
    /// (`HandoverOff`).
    pub handover_cidrs: Vec<handover::Cidr>,
    /// The longest an adopted address stays (`--address-linger-seconds`): past this,
    /// counted from its adoption, the sweep withdraws it, moved connections or not.
    pub address_linger: Duration,
    /// How often the background sweep of adopted addresses runs
    /// ([`Broker::spawn_sweeper`], started by [`Broker::serve`]; 2 s in the binary).
    pub sweep_interval: Duration,
    /// Whether `lock_network` holds the node's neighbour entries for the source's
    /// handed-over addresses (`--address-handover-hold-neighbours`, off by default):
    /// measured on the real nodes, the target answers the node's ARP probes for an
    /// adopted address before its restore, and a held segment of a moved connection
    /// reached it then and was reset (docs/broker-ops.md, `lock_network`).
    pub hold_neighbours: bool,
    /// Whether `forward_connections` may forward a locked source's new connections to
    /// its target (`--forward-new-connections`; see [`forward`]). Off: `ForwardOff`.
    pub forward_new_connections: bool,
}

/// The registrations, by migration UID.
///
/// Locking (issue 16 finding 8: one migration's slow kernel work must not hold up
/// another's). Two levels:
/// - the map (`Broker::entries`) is held only to look up, insert or remove an entry,
///   and for what must be atomic across migrations: `register`'s check that the UID
///   and the process belong to no other migration together with its insert, and
///   `lease_lost`'s choice of the entries a connection holds. It is never held across
///   a kernel call (`register` reads /proc between two short holds and checks again).
/// - each entry's `state` is held for the whole of one op on that migration, its
///   kernel work included (`ip`, mounts, cgroup writes, signals, the journal), and by
///   `lease_lost` for that migration's rollback: the ops on one migration run one at
///   a time, those on different migrations in parallel.
///
/// Lock order: an entry's `state`, then the map; never the map while waiting for an
/// entry, and never two entries at once. The adopted addresses (`adopt_address`) have
/// locks of their own, taken after a `state` and before the map (see [`handover`]).
/// What the map-side checks need (the holding
/// connection, role, process, cgroup) is fixed at `register` and kept outside `state`,
/// so `Busy`, `WrongRole` and the "process of another migration" refusal never wait
/// for another migration's kernel work.
///
/// An entry leaves the map only with its `state` locked, `gone` set and its journal
/// record removed (`forget`, `lease_lost`): an op that looked the entry up before it
/// went finds `gone` once it holds `state` and answers `NotRegistered`; a rollback
/// finishes before its UID and pid can be registered again, so a new registration
/// can never lock a network the rollback is still restoring, nor lose its journal
/// record to the old one's removal.
type Entries = HashMap<MigrationUid, Arc<Entry>>;

/// One registration: what `register` pinned (fixed for its life), and its state.
#[derive(Debug)]
struct Entry {
    role: BrokerRole,
    process: ProcRef,
    /// The container the agent named (its cgroup checked at `register`).
    container: ContainerId,
    cgroup: String,
    /// The connection (lease) holding it.
    conn: u64,
    state: Mutex<State>,
}

/// What the ops of one migration change, under that migration's own lock.
#[derive(Debug, Default)]
struct State {
    /// Removed from the map (forgotten or its lease lost): no op acts on it any more.
    gone: bool,
    netns_bound: bool,
    /// Links set down and routes saved by `lock_network`.
    locked: Option<Lock>,
    killed: bool,
    /// The restore fence (`fence`): never resumed; killed, not rolled back, when the
    /// lease is lost (and, through the journal, when the broker restarts).
    fenced: bool,
    /// The node's neighbour entries `lock_network` holds for the source's addresses
    /// (the hand-over on): see [`handover`]'s "Held neighbours".
    held: Vec<handover::Held>,
    /// The node forgetting unanswered connections to the locked source
    /// ([`conntrack`]): from the lock to the unlock or the registration's end.
    sweep: Option<conntrack::Sweep>,
    /// The source's addresses that stay (read at the lock, before its links went
    /// down): those the conntrack sweep forgets and `forward_connections` forwards.
    staying: Vec<std::net::IpAddr>,
    /// `forward_connections`' table is in the node (journalled).
    forwarding: bool,
    /// The lock's hold of new connections ([`synhold`]), with forwarding on: until the
    /// forward (released to it), the unlock (released to the source after a rollback,
    /// dropped before a commit's kill) or the registration's end (dropped).
    hold: Option<synhold::Hold>,
}

#[derive(Debug, Clone)]
struct Lock {
    links: Vec<String>,
    /// IPv4 routes (`ip -4 route show` lines).
    routes: Vec<String>,
    /// IPv6 routes (`ip -6 route show` lines).
    routes6: Vec<String>,
    /// Global IPv6 addresses of the links set down (`<addr>/<len> dev <link>`): the
    /// kernel drops them when a link goes down (`keep_addr_on_down` is off by default),
    /// IPv4 addresses it keeps.
    addrs6: Vec<String>,
}

/// The dispatcher over a kernel layer: [`RealKernel`] in the binary (the default),
/// `fake::FakeKernel` in tests and the fuzzer (feature `fake`).
pub struct Broker<K: Kernel = RealKernel> {
    cfg: Config,
    kernel: K,
    entries: Mutex<Entries>,
    next_conn: AtomicU64,
    /// While [`Broker::recover`] undoes what a previous broker left: [`Broker::stop`]
    /// lets it finish.
    recovering: AtomicBool,
    /// The addresses adopted by `adopt_address`, by migration ([`handover`]).
    handover: handover::Table,
}

/// The pods cgroup roots of a node when the installer names none: the kubelet's with
/// the cgroupfs driver (`/kubepods`) and with the systemd driver (`/kubepods.slice`).
/// Only one exists on a node; the other names nothing there.
pub const DEFAULT_PODS_ROOTS: &str = "/kubepods,/kubepods.slice";

/// The path of `cgroup` below one of `roots` (comma-separated: nodes that share one
/// hierarchy, as the local cluster's do, have one pods root each), starting with `/`:
/// `None` when it lies under none, is a root itself, or has an empty, `.` or `..`
/// component (the kernel never prints one; a path that has one is not trusted).
fn below_pods_root<'a>(cgroup: &'a str, roots: &str) -> Option<&'a str> {
    roots
        .split(',')
        .map(|r| r.trim().trim_end_matches('/'))
        .filter(|root| !root.is_empty())
        .filter_map(|root| cgroup.strip_prefix(root))
        .find(|below| {
            below.starts_with('/') && below[1..].split('/').all(|c| !matches!(c, "" | "." | ".."))
        })
}

/// Whether cgroup path `cgroup` lies strictly below one of `roots` (see
/// [`below_pods_root`]): the kubelet's cgroupfs layout
/// (`/kubepods/<qos>/pod<uid>/<id>`) and its systemd layout
/// (`/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid_>.slice/cri-containerd-<id>.scope`)
/// alike; never a root itself.
pub fn under_pods_root(cgroup: &str, roots: &str) -> bool {
    below_pods_root(cgroup, roots).is_some()
}

/// The runtimes' names for a container's cgroup other than its bare ID:
/// `<runtime>-<id>.scope` with the systemd cgroup driver (containerd, CRI-O,
/// cri-dockerd), `crio-<id>` with CRI-O's cgroupfs driver.
const RUNTIME_CGROUP_PREFIXES: &[&str] = &["cri-containerd", "crio", "docker"];

/// Whether cgroup path `cgroup` is container `id`'s or lies below it: some path
/// component below one of `roots` (comma-separated, as for [`under_pods_root`]) is
/// the ID itself (the cgroupfs driver: `<root>/besteffort/pod<uid>/<id>`) or the
/// runtime's name for it (`<runtime>-<id>.scope` with the systemd driver,
/// `crio-<id>` with CRI-O's cgroupfs; see [`RUNTIME_CGROUP_PREFIXES`]). A component
/// that merely contains the ID, or one at or above the pods root, does not count.
pub fn names_container(cgroup: &str, roots: &str, id: &ContainerId) -> bool {
    let id = id.as_str();
    let is_the_container = |c: &str| {
        c == id
            || RUNTIME_CGROUP_PREFIXES.iter().any(|p| {
                c.strip_prefix(p)
                    .and_then(|r| r.strip_prefix('-'))
                    .is_some_and(|r| r == id || r.strip_suffix(".scope") == Some(id))
            })
    };
    below_pods_root(cgroup, roots).is_some_and(|below| below[1..].split('/').any(is_the_container))
}

fn err(kind: ErrorKind, m: impl Into<String>) -> BrokerError {
    BrokerError::new(kind, m)
}

fn kerr(e: impl std::fmt::Display) -> BrokerError {
    err(ErrorKind::Kernel, e.to_string())
}

impl Broker<RealKernel> {
    /// The broker over the node's real kernel (the binary's).
    pub fn new(cfg: Config) -> Arc<Self> {
        Self::with_kernel(cfg, RealKernel)
    }
}

impl Entry {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("broker state")
    }
}

impl<K: Kernel> Broker<K> {
    /// The broker over any kernel layer (tests and the fuzzer: `fake::FakeKernel`, feature `fake`).
    pub fn with_kernel(cfg: Config, kernel: K) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            kernel,
            entries: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            recovering: AtomicBool::new(false),
            handover: handover::Table::default(),
        })
    }

    pub fn kernel(&self) -> &K {
        &self.kernel
    }

    pub fn netns_path(&self, uid: &MigrationUid) -> PathBuf {
        self.cfg.run_dir.join("netns").join(uid.as_str())
    }

    /// Number of live registrations (tests use it to prove "no side effect").
    pub fn registrations(&self) -> usize {
        self.map().len()
    }

    /// The map of registrations: held only for a lookup, an insert or a removal (see
    /// [`Entries`] for the lock order).
    fn map(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().expect("broker state")
    }

    /// The agent behind connection `conn` is gone: roll back what it left half-done.
    /// Called when a connection ends; public for harnesses that drive [`Broker::handle`]
    /// directly.
    pub fn lease_lost(&self, conn: u64) {
        let mine: Vec<(MigrationUid, Arc<Entry>)> = self
            .map()
            .iter()
            .filter(|(_, e)| e.conn == conn)
            .map(|(u, e)| (u.clone(), Arc::clone(e)))
            .collect();
        for (uid, e) in mine {
            // Waits for an op still running on this migration, then rolls back what
            // it left; an entry forgotten meanwhile is gone and needs nothing.
            let mut s = e.state();
            if s.gone {
                continue;
            }
            // Before a rollback lets the source answer again.
            self.end_forward_logged(&uid, &mut s);
            if s.netns_bound {
                let _ = self.unbind(&uid);
            }
            match (e.role, &s.locked, s.killed, s.fenced) {
                (BrokerRole::Source, _, false, true) => {
                    tracing::warn!(%uid, "agent gone while the source was fenced: killing it (its restored copy may run)");
                    kill_fenced(&self.kernel, e.process);
                }
                (BrokerRole::Source, Some(l), false, false) => {
                    tracing::warn!(%uid, "agent gone while the source was frozen: rolling back");
                    roll_back(&self.kernel, e.process, l);
                }
                _ => {}
            }
            // Adoptions not yet restored end with the lease (best effort: what cannot
            // be withdrawn now stays recorded, and the sweep withdraws it).
            if let Err(err) = self.end_adoptions(&uid) {
                tracing::warn!(%uid, error = %err, "agent gone: adopted address not withdrawn yet");
            }
            self.remove(&uid, &e, &mut s);
        }
    }

    /// Ends registration `e` of `uid`, its `state` held: journal record removed, marked
    /// gone, out of the map (unless the map already holds a newer one).
    fn remove(&self, uid: &MigrationUid, e: &Arc<Entry>, s: &mut State) {
        self.end_forward_logged(uid, s);
        self.end_hold(uid, s, synhold::End::Drop);
        self.journal_remove(uid);
        self.release_neighbours(std::mem::take(&mut s.held));
        s.sweep = None;
        s.gone = true;
        let mut m = self.map();
        if m.get(uid).is_some_and(|x| Arc::ptr_eq(x, e)) {
            m.remove(uid);
        }
    }

    /// The registration of `uid` if connection `conn` holds it (`Busy` if another
    /// does). Takes the map only for the lookup.
    fn held(&self, uid: &MigrationUid, conn: u64) -> Result<Option<Arc<Entry>>, BrokerError> {
        match self.map().get(uid) {
            Some(e) if e.conn != conn => Err(err(
                ErrorKind::Busy,
                format!("{uid} is held by another connection"),
            )),
            e => Ok(e.cloned()),
        }
    }

    /// Runs `op` on the registration of `uid` held by `conn`, in `role` if one is
    /// named, its process still the one pinned, under that migration's lock only.
    fn with_entry<T>(
        &self,
        uid: &MigrationUid,
        conn: u64,
        role: Option<BrokerRole>,
        op: impl FnOnce(&Entry, &mut State) -> Result<T, BrokerError>,
    ) -> Result<T, BrokerError> {
        let not_registered = || err(ErrorKind::NotRegistered, format!("{uid} is not registered"));
        let e = self.held(uid, conn)?.ok_or_else(not_registered)?;
        if let Some(r) = role
            && e.role != r
        {
            return Err(err(
                ErrorKind::WrongRole,
                format!("{uid} is registered as {:?}", e.role),
            ));
        }
        let mut s = e.state();
        if s.gone {
            return Err(not_registered());
        }
        self.kernel.check_live(e.process)?;
        op(&e, &mut s)
    }
}

/// Gives a frozen, locked source back its life: waits for CRIU to detach (it may still
/// be dumping), then — only if it is still the same live process — takes its sockets
/// out of repair, restores links and routes, and SIGCONTs the tree.
fn roll_back<K: Kernel>(k: &K, p: ProcRef, l: &Lock) {
    let deadline = k.now() + Duration::from_secs(60);
    while tracer_attached(k, p.pid) && k.now() < deadline {
        k.sleep(Duration::from_millis(20));
    }
    if k.check_live(p).is_ok() {
        let _ = release_repair(k, p.pid);
        let _ = unlock(k, p.pid, l);
        let _ = signal_tree(k, p.pid, Signal::SIGCONT);
    }
}

/// Kills a fenced source's tree (a lost lease or a restart): it is never resumed, its
/// restored copy may already run on the target. The network stays locked, as after a
/// commit: nothing of the dead tree's connections may answer for the restored copy.
fn kill_fenced<K: Kernel>(k: &K, p: ProcRef) {
    if k.check_live(p).is_ok() {
        let _ = signal_tree(k, p.pid, Signal::SIGKILL);
    }
}

fn tracer_attached<K: Kernel>(k: &K, pid: i32) -> bool {
    k.tree(pid)
        .iter()
        .any(|p| k.tracer_pid(*p).unwrap_or(0) != 0)
}

fn signal_tree<K: Kernel>(k: &K, root: i32, sig: Signal) -> Result<(), BrokerError> {
    for pid in k.tree(root) {
        match k.signal(pid, sig) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
            Err(e) => return Err(kerr(e)),
        }
    }
    Ok(())
}

fn release_repair<K: Kernel>(k: &K, root: i32) -> Result<(), BrokerError> {
    for pid in k.tree(root) {
        for (fd, _) in k.tcp_fds(pid) {
            k.repair_off(pid, fd)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlock::{addr_lines, global_ipv6_addrs, parse_links, parse_mac};
    use nix::sys::socket::MsgFlags;
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::{UnixListener, UnixStream};

    const ID: &str = "3d359f10a9c1e6f0b2a4d8c7e5f60718293a4b5c6d7e8f90a1b2c3d4e5f6a7b2";
    const POD: &str = "pod6fecc63a-68d4-4995-b8ec-5091216a6244";

    fn names(cgroup: &str, roots: &str, id: &str) -> bool {
        names_container(cgroup, roots, &ContainerId::parse(id).unwrap())
    }

    #[test]
    fn the_cgroupfs_drivers_container_leaf_names_its_container() {
        let roots = "/pm-real-0/kubepods,/pm-real-1/kubepods";
        let cg = format!("/pm-real-1/kubepods/besteffort/{POD}/{ID}");
        assert!(names(&cg, roots, ID));
        assert!(names(&format!("/kubepods/{POD}/{ID}"), "/kubepods", ID));
        // CRI-O's cgroupfs driver prefixes the ID.
        assert!(names(
            &format!("/kubepods/{POD}/crio-{ID}"),
            "/kubepods",
            ID
        ));
        // Another container of the same pod, or of another pod, does not.
        let other = "9a8b7c6d5e4f";
        assert!(!names(&cg, roots, other));
        assert!(!names(&format!("/kubepods/{POD}/{other}"), "/kubepods", ID));
        // Nor the pod's cgroup itself.
        assert!(!names(
            &format!("/pm-real-1/kubepods/besteffort/{POD}"),
            roots,
            ID
        ));
    }

    #[test]
    fn the_systemd_drivers_scope_names_its_container() {
        let root = "/kubepods.slice";
        let pod =
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod6fecc63a_68d4.slice";
        for runtime in ["cri-containerd", "crio", "docker"] {
            assert!(
                names(&format!("{pod}/{runtime}-{ID}.scope"), root, ID),
                "{runtime}"
            );
        }
        // Not an unknown runtime's, nor CRI-O's conmon (the monitor, not the container).
        assert!(!names(&format!("{pod}/other-{ID}.scope"), root, ID));
        assert!(!names(&format!("{pod}/crio-conmon-{ID}.scope"), root, ID));
        assert!(!names(
            &format!("{pod}/cri-containerd-{ID}.slice"),
            root,
            ID
        ));
    }

    #[test]
    fn a_component_that_merely_contains_the_id_does_not_name_the_container() {
        for leaf in [
            format!("{ID}x"),
            format!("x{ID}"),
            format!("x-{ID}"),
            format!("{ID}.scope"),
            format!("cri-containerd-{ID}x.scope"),
            format!("cri-containerd-{ID}.scopex"),
        ] {
            assert!(
                !names(&format!("/kubepods/{POD}/{leaf}"), "/kubepods", ID),
                "{leaf}"
            );
        }
        // Nor a shorter ID that the real one begins with.
        assert!(!names(
            &format!("/kubepods/{POD}/{ID}"),
            "/kubepods",
            &ID[..12]
        ));
    }

    #[test]
    fn an_id_at_or_above_the_pods_root_does_not_name_the_container() {
        assert!(!names(
            "/pm-real-1/kubepods/besteffort/p/c",
            "/pm-real-1/kubepods",
            "pm-real-1"
        ));
        assert!(!names(
            "/pm-real-1/kubepods/besteffort/p/c",
            "/pm-real-1/kubepods",
            "kubepods"
        ));
        // Outside every root, however it is named.
        assert!(!names(&format!("/system.slice/{ID}"), "/kubepods", ID));
        // A root that only begins the path's first component is not a root.
        assert!(!names(&format!("/kubepods2/{POD}/{ID}"), "/kubepods", ID));
        assert!(!names(&format!("/kubepods/{POD}/{ID}"), "", ID));
    }

    #[test]
    fn a_sub_cgroup_below_the_containers_names_the_container() {
        assert!(names(
            &format!("/kubepods/burstable/{POD}/{ID}/init/worker"),
            "/kubepods/",
            ID
        ));
        assert!(names(
            &format!("/kubepods.slice/kubepods-pod1.slice/crio-{ID}.scope/container"),
            "/kubepods.slice",
            ID
        ));
    }

    /// The kubelet's pod and container cgroups in every QoS class, with each driver
    /// (the pod UID with `_` for `-` in the systemd slice's name).
    fn kubelet_layouts(id: &str) -> Vec<String> {
        let uid = "6fecc63a-68d4-4995-b8ec-5091216a6244";
        let uid_ = uid.replace('-', "_");
        let mut out = Vec::new();
        for qos in ["besteffort/", "burstable/", ""] {
            out.push(format!("/kubepods/{qos}pod{uid}/{id}"));
            out.push(format!("/kubepods/{qos}pod{uid}/crio-{id}"));
        }
        for runtime in ["cri-containerd", "crio", "docker"] {
            for qos in ["besteffort", "burstable"] {
                out.push(format!(
                    "/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid_}.slice/{runtime}-{id}.scope"
                ));
            }
            out.push(format!(
                "/kubepods.slice/kubepods-pod{uid_}.slice/{runtime}-{id}.scope"
            ));
        }
        out
    }

    #[test]
    fn the_default_roots_accept_the_containers_of_both_drivers() {
        for cg in kubelet_layouts(ID) {
            assert!(under_pods_root(&cg, DEFAULT_PODS_ROOTS), "{cg}");
            assert!(names(&cg, DEFAULT_PODS_ROOTS, ID), "{cg}");
            assert!(!names(&cg, DEFAULT_PODS_ROOTS, "9a8b7c6d5e4f"), "{cg}");
            // Each driver's path only under its own root.
            let own = if cg.starts_with("/kubepods.slice/") {
                "/kubepods.slice"
            } else {
                "/kubepods"
            };
            let other = if own == "/kubepods" {
                "/kubepods.slice"
            } else {
                "/kubepods"
            };
            assert!(names(&cg, own, ID), "{cg}");
            assert!(!under_pods_root(&cg, other), "{cg} under {other}");
        }
        // Spaces around the roots, as a values file may have them.
        let spaced = " /kubepods , /kubepods.slice ";
        assert!(kubelet_layouts(ID).iter().all(|cg| names(cg, spaced, ID)));
    }

    #[test]
    fn a_root_itself_and_what_is_not_strictly_below_one_is_no_pods_cgroup() {
        for cg in [
            "/kubepods",
            "/kubepods/",
            "/kubepods.slice",
            "/kubepods.slice/",
            "/",
            "",
            "/kubepods-besteffort.slice",
            "/kubepods.slicex/kubepods-pod1.slice/x",
            "/kubepodsx/pod1/x",
            "/system.slice/containerd.service",
            "/init.scope",
        ] {
            assert!(!under_pods_root(cg, DEFAULT_PODS_ROOTS), "{cg:?}");
        }
        // No empty, `.` or `..` component below the root, whatever follows.
        for cg in [
            format!("/kubepods/../system.slice/{ID}"),
            format!("/kubepods.slice/../{ID}"),
            format!("/kubepods/besteffort/./pod1/{ID}"),
            format!("/kubepods//pod1/{ID}"),
            format!("/kubepods/pod1/{ID}/"),
        ] {
            assert!(!under_pods_root(&cg, DEFAULT_PODS_ROOTS), "{cg}");
            assert!(!names(&cg, DEFAULT_PODS_ROOTS, ID), "{cg}");
        }
        // The local cluster's roots (hack/install-values.yaml) keep working.
        let local = "/pm-real-0/kubepods,/pm-real-1/kubepods";
        let cg = format!("/pm-real-0/kubepods/besteffort/{POD}/{ID}");
        assert!(names(&cg, local, ID));
        assert!(!under_pods_root("/pm-real-0/kubepods", local));
        assert!(!under_pods_root(&cg, DEFAULT_PODS_ROOTS));
    }

    #[test]
    fn links_and_ipv4_addresses_are_read_as_iproute2_prints_them() {
        let links = "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN mode DEFAULT group default qlen 1000\\    link/loopback 00:00:00:00:00:00 brd 00:00:00:00:00:00\n\
                     2: eth0@if7: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP mode DEFAULT group default \\    link/ether 36:9a:9a:24:f0:ec brd ff:ff:ff:ff:ff:ff link-netnsid 0\n\
                     3: wg0: <POINTOPOINT,NOARP,UP,LOWER_UP> mtu 1420 qdisc noqueue state UNKNOWN \\    link/none \n\
                     4: bad: garbage\n";
        assert_eq!(
            parse_links(links),
            vec![
                Link {
                    name: "lo".into(),
                    index: 1,
                    mac: None
                },
                Link {
                    name: "eth0".into(),
                    index: 2,
                    mac: Some([0x36, 0x9a, 0x9a, 0x24, 0xf0, 0xec])
                },
                Link {
                    name: "wg0".into(),
                    index: 3,
                    mac: None
                },
                Link {
                    name: "bad".into(),
                    index: 4,
                    mac: None
                },
            ]
        );
        let addrs = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n\
                     1: lo    inet6 ::1/128 scope host noprefixroute \\       valid_lft forever preferred_lft forever\n\
                     2: eth0    inet 198.18.1.21/24 brd 198.18.1.255 scope global eth0\\       valid_lft forever preferred_lft forever\n\
                     2: eth0    inet 198.18.9.4/32 scope global eth0\\       valid_lft forever\n\
                     2: eth0    inet6 2001:db8:1::15/64 scope global nodad \\       valid_lft forever preferred_lft forever\n\
                     2: eth0    inet6 fe80::349a:9aff:fe24:f0ec/64 scope link tentative \\       valid_lft forever preferred_lft forever\n";
        let lines = addr_lines(addrs);
        assert_eq!(
            lines
                .iter()
                .map(|a| (a.link.as_str(), a.v6, a.address(), a.global))
                .collect::<Vec<_>>(),
            vec![
                ("lo", false, "127.0.0.1", false),
                ("lo", true, "::1", false),
                ("eth0", false, "198.18.1.21", true),
                ("eth0", false, "198.18.9.4", true),
                ("eth0", true, "2001:db8:1::15", true),
                ("eth0", true, "fe80::349a:9aff:fe24:f0ec", false),
            ]
        );
        assert_eq!(parse_mac("36:9a:9a:24:f0"), None);
        assert_eq!(parse_mac("36:9a:9a:24:f0:ec:01"), None);
    }

    #[test]
    fn a_client_knows_when_the_broker_closed_its_connection() {
        let dir = std::env::temp_dir().join(format!("pm-broker-closed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("b.sock");
        let _ = std::fs::remove_file(&path);
        let l = UnixListener::bind(&path).unwrap();
        let c = client::BrokerClient::connect(&path).unwrap();
        let (server, _) = l.accept().unwrap();
        assert!(!c.closed(), "an open connection with nothing to read");
        drop(server);
        assert!(c.closed());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A broker that takes the request but never answers (an `ip` step hung): the call
    /// fails within the deadline, saying which op, and the connection (the lease) is
    /// closed, so the broker gets back what was registered on it; a late answer is
    /// never read as the next call's.
    #[test]
    fn a_call_the_broker_does_not_answer_in_time_fails_and_ends_the_lease() {
        let dir = std::env::temp_dir().join(format!("pm-broker-deadline-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("b.sock");
        let _ = std::fs::remove_file(&path);
        let l = UnixListener::bind(&path).unwrap();
        let mut c =
            client::BrokerClient::connect_with_deadline(&path, Duration::from_millis(200)).unwrap();
        let (mut server, _) = l.accept().unwrap();
        let uid = MigrationUid::parse("2d4e6f80-9a1b-4c3d-8e5f-60718293a4b5").unwrap();
        let t = std::time::Instant::now();
        let e = c
            .call(&Request::LockNetwork {
                uid: uid.clone(),
                hold: None,
            })
            .unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(
            e.message
                .starts_with("lock_network: no answer within the call deadline"),
            "{e}"
        );
        // The broker sees the lease end: its read after the request finds the close.
        let mut req = Vec::new();
        server.read_to_end(&mut req).unwrap();
        assert_eq!(
            req,
            encode_frame(&Request::LockNetwork {
                uid: uid.clone(),
                hold: None
            })
        );
        // Its late answer is not taken as the next call's.
        let _ = server.write_all(&encode_frame(&Response::Ok(Reply::Done)));
        assert!(c.closed());
        assert!(c.call(&Request::UnlockNetwork { uid }).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// What came back for one request: the answer, the descriptors that came with it
    /// or after it, and how many bytes followed its frame.
    struct Exchanged {
        resp: Response,
        fds: Vec<i32>,
        bytes_after: usize,
    }

    /// Writes `req` as one frame and reads the answer the way a client must be ready
    /// to: `recvmsg` with room for descriptors, and whatever else arrives after it.
    fn exchange(s: &UnixStream, req: &Request) -> Exchanged {
        use nix::sys::socket::{ControlMessageOwned, recvmsg};
        use std::io::IoSliceMut;
        (&*s).write_all(&encode_frame(req)).unwrap();
        let mut got = Vec::new();
        let mut bytes = Vec::new();
        let mut recv = |flags: MsgFlags, bytes: &mut Vec<u8>| {
            let mut buf = [0u8; 4096];
            let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 64]);
            let mut iov = [IoSliceMut::new(&mut buf)];
            let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), flags);
            let Ok(msg) = msg else {
                return false;
            };
            for c in msg.cmsgs().unwrap() {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    got.extend(fds);
                }
            }
            let n = msg.bytes;
            bytes.extend_from_slice(&buf[..n]);
            n > 0
        };
        let len = |b: &[u8]| check_len(b[..4].try_into().unwrap(), MAX_REPLY_FRAME).unwrap();
        while bytes.len() < 4 || bytes.len() < 4 + len(&bytes) {
            assert!(
                recv(MsgFlags::MSG_CMSG_CLOEXEC, &mut bytes),
                "broker closed"
            );
        }
        // Give anything the broker sends after the frame the time to arrive.
        std::thread::sleep(Duration::from_millis(100));
        let mut after = Vec::new();
        while recv(
            MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
            &mut after,
        ) {}
        let end = 4 + len(&bytes);
        Exchanged {
            resp: decode_response(&bytes[4..end]).unwrap(),
            fds: got,
            bytes_after: bytes.len() - end + after.len(),
        }
    }

    /// `list_sockets` over the broker's socket: the workload's socket addresses, in
    /// the answer frame, and not one descriptor passed to the client (the broker used
    /// to hand over a duplicate of every socket with SCM_RIGHTS).
    #[test]
    fn list_sockets_answers_with_addresses_and_passes_no_descriptor() {
        let dir = std::env::temp_dir().join(format!("pm-broker-list-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("b.sock");
        let k = fake::FakeKernel::new(fake::World::standard());
        let b = Broker::with_kernel(
            Config {
                run_dir: dir.join("run"),
                pods_cgroup_root: fake::PODS_ROOT.into(),
                allowed_uid: nix::unistd::geteuid().as_raw(),
                same_netns_peers: false,
                container_cgroups: true,
                handover_cidrs: Vec::new(),
                address_linger: Duration::from_secs(3600),
                sweep_interval: Duration::from_secs(2),
                hold_neighbours: false,
                forward_new_connections: false,
            },
            k.clone(),
        );
        let l = b.bind(&path).unwrap();
        std::thread::spawn(move || b.serve_listener(l));
        let s = UnixStream::connect(&path).unwrap();
        let uid = MigrationUid::parse("m-list").unwrap();
        let process = ProcRef {
            pid: 101,
            start_time: k.world().procs[&101].start_time,
        };
        let role = BrokerRole::Source;
        let container = k.world().container_of(101);
        let r = exchange(
            &s,
            &Request::Register {
                uid: uid.clone(),
                role,
                process,
                container,
            },
        );
        assert!(
            matches!(r.resp, Response::Ok(Reply::Registered { .. })),
            "{:?}",
            r.resp
        );

        let r = exchange(&s, &Request::ListSockets { uid });
        assert!(
            r.fds.is_empty(),
            "descriptors passed to the client: {:?}",
            r.fds
        );
        assert_eq!(r.bytes_after, 0, "bytes after the answer frame");
        let want: Vec<SocketAddrs> = [101, 102]
            .iter()
            .flat_map(|pid| k.world().procs[pid].sockets.clone())
            .map(|s| s.addrs)
            .collect();
        assert_eq!(want.len(), 3);
        assert_eq!(r.resp, Response::Ok(Reply::Sockets { sockets: want }));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_sockets_addresses_are_read_from_the_kernel() {
        use std::net::{TcpListener, TcpStream};
        use std::os::fd::AsFd;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = listener.local_addr().unwrap();
        let client = TcpStream::connect(at).unwrap();
        let (server, from) = listener.accept().unwrap();
        assert_eq!(
            os::addrs_of(listener.as_fd()),
            SocketAddrs {
                local: Some(at),
                remote: None,
                listening: true
            }
        );
        assert_eq!(
            os::addrs_of(server.as_fd()),
            SocketAddrs {
                local: Some(at),
                remote: Some(from),
                listening: false
            }
        );
        // Through a duplicate taken with pidfd_getfd, as from a workload (here our own
        // process), closed once read.
        let fd = client.as_raw_fd();
        assert_eq!(
            RealKernel
                .socket_addrs(std::process::id() as i32, fd)
                .unwrap(),
            SocketAddrs {
                local: Some(from),
                remote: Some(at),
                listening: false
            }
        );
        // Neither bound nor connected: the kernel's unspecified address, no peer.
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
        let bare = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        assert_eq!(
            os::addrs_of(bare.as_fd()),
            SocketAddrs {
                local: Some("0.0.0.0:0".parse().unwrap()),
                remote: None,
                listening: false
            }
        );
    }

    #[test]
    fn global_ipv6_addresses_of_the_locked_links_are_saved_with_their_link() {
        let out = "3: pm0    inet6 2001:db8:254::1/64 scope global nodad \\       valid_lft forever preferred_lft forever\n\
                   4: eth0@if9    inet6 2001:db8:1::5/64 scope global \\       valid_lft forever preferred_lft forever\n\
                   5: other    inet6 2001:db8:2::5/64 scope global \\       valid_lft forever\n";
        assert_eq!(
            global_ipv6_addrs(out, &["pm0".into(), "eth0".into()]),
            ["2001:db8:254::1/64 dev pm0", "2001:db8:1::5/64 dev eth0"]
        );
        assert!(global_ipv6_addrs("", &["pm0".into()]).is_empty());
    }
}
