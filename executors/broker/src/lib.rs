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

pub mod conntrack;
#[cfg(any(test, feature = "fake"))]
pub mod fake;
pub mod handover;
#[allow(unsafe_code)]
pub mod kernel;
pub mod os;
pub mod procfs;

use nix::sys::signal::Signal;
use nix::sys::socket::{MsgFlags, getsockopt, sockopt::PeerCredentials};
pub use os::{Ip, Kernel, Link, RealKernel};
use podmotion_wire::broker::*;
use podmotion_wire::ids::{ContainerId, MigrationUid, ProcRef};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Config {
    /// Runtime dir; netns bind mounts go to `<run_dir>/netns/<uid>`.
    pub run_dir: PathBuf,
    /// Only processes in cgroups under this cgroup v2 path may be registered
    /// (e.g. `/kubepods`): the agent can never pin a host daemon.
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
    /// The addresses adopted by `adopt_address`, by migration ([`handover`]).
    handover: handover::Table,
}

/// Whether cgroup path `cgroup` lies under one of `roots` (comma-separated: nodes that
/// share one hierarchy, as the local cluster's do, have one pods root each).
pub fn under_pods_root(cgroup: &str, roots: &str) -> bool {
    roots
        .split(',')
        .map(|r| r.trim().trim_end_matches('/'))
        .any(|root| {
            !root.is_empty()
                && cgroup
                    .strip_prefix(root)
                    .is_some_and(|r| r.starts_with('/'))
        })
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
    roots
        .split(',')
        .map(|r| r.trim().trim_end_matches('/'))
        .filter(|root| !root.is_empty())
        .filter_map(|root| cgroup.strip_prefix(root))
        .filter(|below| below.starts_with('/'))
        .any(|below| below.split('/').any(is_the_container))
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

    /// Takes the run directory, recovers what a previous broker left there, starts the
    /// sweep of adopted addresses, binds the socket (0600) and serves forever, one
    /// thread per connection.
    pub fn serve(self: &Arc<Self>, socket: &std::path::Path) -> std::io::Result<()> {
        let _owner = self.own_run_dir()?;
        self.recover();
        self.spawn_sweeper();
        let listener = self.bind(socket)?;
        self.serve_listener(listener)
    }

    /// An exclusive `flock` on `<run-dir>/netns/.lock`, held while the broker lives.
    /// Everything under that directory is this broker's: at start it rolls back the
    /// journalled locks and unbinds every netns mount point there, which would wreck
    /// the migrations of another broker using the same directory (two releases with
    /// one `migrationAgent.netnsDir` on a node). A second broker is refused instead.
    fn own_run_dir(&self) -> std::io::Result<nix::fcntl::Flock<std::fs::File>> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let dir = self.cfg.run_dir.join("netns");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
        let path = dir.join(".lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)?;
        nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(
            |(_, e)| {
                std::io::Error::other(format!(
                    "{}: {e}: another broker serves this run directory on this node (two PodMotion releases with one migrationAgent.netnsDir?); give each release its own",
                    path.display()
                ))
            },
        )
    }

    pub fn bind(&self, socket: &std::path::Path) -> std::io::Result<UnixListener> {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::remove_file(socket);
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // Created under a 0077 umask-equivalent: chmod before anyone can connect
        // matters less than it seems (connect needs write permission, checked per
        // connect), but we also check the peer uid.
        let l = UnixListener::bind(socket)?;
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))?;
        Ok(l)
    }

    pub fn serve_listener(self: &Arc<Self>, listener: UnixListener) -> std::io::Result<()> {
        for conn in listener.incoming() {
            let conn = conn?;
            let me = Arc::clone(self);
            std::thread::spawn(move || me.connection(conn));
        }
        Ok(())
    }

    fn connection(self: Arc<Self>, mut s: UnixStream) {
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.peer_allowed(&s) {
            tracing::warn!(error = %e, "refused peer");
            let _ = s.write_all(&encode_frame(&Response::Err(e)));
            return;
        }
        let _ = s.set_read_timeout(None);
        loop {
            let body = match read_request_frame(&mut s) {
                Ok(Some(body)) => body,
                Ok(None) => break,
                Err(e) => {
                    // The rest of the stream cannot be framed any more: answer and close.
                    let _ = s.write_all(&encode_frame(&Response::Err(e)));
                    break;
                }
            };
            if s.write_all(&encode_frame(&self.answer(id, &body))).is_err() {
                break;
            }
        }
        self.lease_lost(id);
    }

    /// The peer runs as the agent's uid and, where required, in the broker's pod.
    fn peer_allowed(&self, s: &UnixStream) -> Result<(), BrokerError> {
        match getsockopt(s, PeerCredentials) {
            Ok(c) if c.uid() == self.cfg.allowed_uid && self.cfg.same_netns_peers => {
                same_pod(&self.kernel, c.pid())
            }
            Ok(c) if c.uid() == self.cfg.allowed_uid => Ok(()),
            Ok(c) => Err(err(
                ErrorKind::PeerNotAllowed,
                format!("peer uid {} is not the agent's uid", c.uid()),
            )),
            Err(e) => Err(kerr(e)),
        }
    }

    /// The response to one frame's body (decoded, validated, handled).
    fn answer(&self, conn: u64, body: &[u8]) -> Response {
        let resp = match decode_request(body).and_then(|req| {
            tracing::info!(op = req.name(), uid = %req.uid(), conn, "request");
            self.handle(conn, req)
        }) {
            Ok(reply) => Response::Ok(reply),
            Err(e) => Response::Err(e),
        };
        if let Response::Err(e) = &resp {
            tracing::warn!(kind = ?e.kind, message = %e.message, "rejected");
        }
        resp
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
        self.journal_remove(uid);
        self.release_neighbours(std::mem::take(&mut s.held));
        s.sweep = None;
        s.gone = true;
        let mut m = self.map();
        if m.get(uid).is_some_and(|x| Arc::ptr_eq(x, e)) {
            m.remove(uid);
        }
    }

    /// The journal lives beside the netns mount points: the one directory the broker
    /// always has writable and that outlives the broker's container (a host path in the
    /// chart). `.journal` is never a migration UID, so the netns sweep skips it.
    fn journal_dir(&self) -> PathBuf {
        self.cfg.run_dir.join("netns").join(".journal")
    }

    fn journal_path(&self, uid: &str) -> PathBuf {
        self.journal_dir().join(uid)
    }

    /// Records a locked source on disk (run directory, 0600) before the lock is
    /// reported done, so that a broker that dies while a source is frozen rolls it back
    /// when it starts again ([`Broker::recover`]).
    /// `fenced`: the restore fence, so that a restarted broker kills the source
    /// instead of rolling it back.
    fn journal_write(
        &self,
        uid: &MigrationUid,
        p: ProcRef,
        l: &Lock,
        fenced: bool,
    ) -> Result<(), BrokerError> {
        let body = serde_json::json!({
            "pid": p.pid, "start_time": p.start_time, "links": l.links, "routes": l.routes,
            "routes6": l.routes6, "addrs6": l.addrs6, "fenced": fenced,
        });
        self.kernel.journal_write(
            &self.journal_dir(),
            uid.as_str(),
            body.to_string().as_bytes(),
        )
    }

    fn journal_remove(&self, uid: &MigrationUid) {
        self.kernel.remove_file(&self.journal_path(uid.as_str()));
    }

    /// Undoes what a previous broker process left behind on this node: every source it
    /// had locked (recorded in the journal) whose process is still the same live process
    /// is rolled back — sockets out of repair, links and routes restored, SIGCONT — or,
    /// if it was fenced, killed; and every netns bind mount it had made is removed. Its
    /// agents' connections (the leases) ended with it, so this is what `lease_lost`
    /// would have done. The addresses it adopted are loaded from their journal and
    /// swept: those not restored are withdrawn (their leases ended), the restored ones
    /// stay while a moved connection uses them. Returns the migration UIDs rolled back
    /// or killed.
    pub fn recover(&self) -> Vec<String> {
        let mut rolled = Vec::new();
        let dir = self.journal_dir();
        for (name, path) in self.kernel.read_dir(&dir) {
            let record = self
                .kernel
                .read_file(&path)
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
            self.kernel.remove_file(&path);
            let Some((p, l, fenced)) = record.as_ref().and_then(parse_journal) else {
                tracing::warn!(file = %path.display(), "unreadable journal record removed");
                continue;
            };
            if MigrationUid::parse(&name).is_err() {
                continue;
            }
            // Only ever a pod's process, as at registration.
            let in_pod = self
                .kernel
                .cgroup_of(p.pid)
                .is_ok_and(|cg| under_pods_root(&cg, &self.cfg.pods_cgroup_root));
            if !in_pod {
                tracing::warn!(uid = %name, pid = p.pid, "journal names no pod process: ignored");
                continue;
            }
            if fenced {
                tracing::warn!(uid = %name, pid = p.pid, "a previous broker left this source fenced: killing it (its restored copy may run)");
                kill_fenced(&self.kernel, p);
            } else {
                tracing::warn!(uid = %name, pid = p.pid, "a previous broker left this source locked: rolling back");
                roll_back(&self.kernel, p, &l);
            }
            rolled.push(name);
        }
        let netns = self.cfg.run_dir.join("netns");
        for (name, _) in self.kernel.read_dir(&netns) {
            if let Ok(uid) = MigrationUid::parse(&name) {
                let _ = self.unbind(&uid);
            }
        }
        self.load_adoptions();
        self.sweep();
        rolled
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

    /// Executes one validated request for connection `conn`.
    pub fn handle(&self, conn: u64, req: Request) -> Result<Reply, BrokerError> {
        const SOURCE: Option<BrokerRole> = Some(BrokerRole::Source);
        const TARGET: Option<BrokerRole> = Some(BrokerRole::Target);
        const ANY: Option<BrokerRole> = None;
        // Each op names the role it needs of the registration it acts on, held by this
        // connection.
        match &req {
            Request::Register {
                uid,
                role,
                process,
                container,
            } => self.register(conn, uid.clone(), *role, *process, container),
            Request::Forget { uid } => self.forget(conn, uid),
            Request::NetnsAddrs { uid } => {
                self.with_entry(uid, conn, ANY, |e, _| self.netns_addrs(e))
            }
            Request::BindNetns { uid } => {
                self.with_entry(uid, conn, TARGET, |e, s| self.bind_netns(uid, e, s))
            }
            Request::UnbindNetns { uid } => {
                self.with_entry(uid, conn, TARGET, |_, s| self.unbind_netns(uid, s))
            }
            Request::MoveCgroup { uid, process } => {
                self.with_entry(uid, conn, TARGET, |e, _| self.move_cgroup(uid, e, *process))
            }
            Request::ChargeRestore { uid, process } => {
                self.with_entry(uid, conn, TARGET, |e, _| self.charge_restore(e, *process))
            }
            Request::AdoptAddress { uid, address } => self.with_entry(uid, conn, TARGET, |e, _| {
                self.adopt_address(uid, e, *address)
            }),
            Request::ReleaseAddress { uid, address } => {
                self.with_entry(uid, conn, TARGET, |e, _| {
                    self.release_address(uid, e, *address)
                })
            }
            Request::LockNetwork { uid } => {
                self.with_entry(uid, conn, SOURCE, |e, s| self.lock_network(uid, e, s))
            }
            Request::UnlockNetwork { uid } => {
                self.with_entry(uid, conn, SOURCE, |e, s| self.unlock_network(uid, e, s))
            }
            Request::ListSockets { uid } => {
                self.with_entry(uid, conn, SOURCE, |e, _| self.list_sockets(e))
            }
            Request::ReleaseTcpRepair { uid } => {
                self.with_entry(uid, conn, SOURCE, |e, _| self.release_tcp_repair(e))
            }
            Request::Resume { uid } => self.with_entry(uid, conn, SOURCE, |e, s| self.resume(e, s)),
            Request::Kill { uid } => {
                self.with_entry(uid, conn, SOURCE, |e, s| self.kill(uid, e, s))
            }
            Request::Fence { uid } => {
                self.with_entry(uid, conn, SOURCE, |e, s| self.fence(uid, e, s))
            }
            Request::Unfence { uid } => {
                self.with_entry(uid, conn, SOURCE, |e, s| self.unfence(uid, e, s))
            }
        }
    }

    /// Pins `process`, a process of `container`, to `uid` for this connection.
    /// Registering the same thing again (same process, role and container) on the same
    /// connection is a no-op; anything else already registered is refused.
    fn register(
        &self,
        conn: u64,
        uid: MigrationUid,
        role: BrokerRole,
        process: ProcRef,
        container: &ContainerId,
    ) -> Result<Reply, BrokerError> {
        self.kernel.check_live(process)?;
        let pin = Pin {
            role,
            process,
            container,
        };
        if let Some(again) = taken(&self.map(), conn, &uid, &pin)? {
            return Ok(again);
        }
        // Read from /proc without the map; checked again with the insert, so that of
        // two registrations of one UID or one process racing, one wins.
        let cgroup = self.pod_cgroup_of(process.pid)?;
        if self.cfg.container_cgroups
            && !names_container(&cgroup, &self.cfg.pods_cgroup_root, container)
        {
            return Err(err(
                ErrorKind::ForeignProcess,
                format!(
                    "pid {} (cgroup {cgroup}) does not belong to container {container}",
                    process.pid
                ),
            ));
        }
        let mut m = self.map();
        if let Some(again) = taken(&m, conn, &uid, &pin)? {
            return Ok(again);
        }
        m.insert(
            uid,
            Arc::new(Entry {
                role,
                process,
                container: container.clone(),
                cgroup: cgroup.clone(),
                conn,
                state: Mutex::new(State::default()),
            }),
        );
        Ok(Reply::Registered { cgroup })
    }

    /// The cgroup of a process the broker may act on: in a pod's cgroup (never the
    /// broker's own) and not in the node's network namespace.
    fn pod_cgroup_of(&self, pid: i32) -> Result<String, BrokerError> {
        let cgroup = self.kernel.cgroup_of(pid)?;
        let root = &self.cfg.pods_cgroup_root;
        let inside = under_pods_root(&cgroup, root);
        let mine = self.kernel.cgroup_of(self.kernel.self_pid()).ok();
        if !inside || mine.as_deref() == Some(cgroup.as_str()) {
            return Err(err(
                ErrorKind::ForeignProcess,
                format!("pid {pid} is not in a pod cgroup under {root}"),
            ));
        }
        // A hostNetwork pod shares the node's network namespace: locking it would
        // take the node's own links down, binding it would hand out the node's.
        if self.kernel.netns_inode(pid)? == self.kernel.node_netns() {
            return Err(err(
                ErrorKind::ForeignProcess,
                format!(
                    "pid {pid} shares the node's network namespace (a hostNetwork pod): never locked, bound or migrated"
                ),
            ));
        }
        Ok(cgroup)
    }

    fn bind_netns(
        &self,
        uid: &MigrationUid,
        e: &Entry,
        s: &mut State,
    ) -> Result<Reply, BrokerError> {
        let path = self.netns_path(uid);
        if !s.netns_bound {
            self.kernel.bind_netns(e.process.pid, &path)?;
            s.netns_bound = true;
        }
        Ok(Reply::NetnsPath {
            path: path.to_string_lossy().into_owned(),
        })
    }

    fn unbind_netns(&self, uid: &MigrationUid, s: &mut State) -> Result<Reply, BrokerError> {
        if s.netns_bound {
            self.unbind(uid)?;
            s.netns_bound = false;
        }
        Ok(Reply::Done)
    }

    /// The addresses (without prefix length) of the registered process's namespace.
    fn netns_addrs(&self, e: &Entry) -> Result<Reply, BrokerError> {
        let addrs = self
            .kernel
            .in_netns(e.process.pid, |ip| {
                let out = ip.ip(&["-o", "addr", "show"])?;
                Ok(addr_lines(&out)
                    .into_iter()
                    .map(|a| a.address().to_owned())
                    .collect::<Vec<_>>())
            })
            .map_err(kerr)?;
        Ok(Reply::Addrs { addrs })
    }

    fn lock_network(
        &self,
        uid: &MigrationUid,
        e: &Entry,
        s: &mut State,
    ) -> Result<Reply, BrokerError> {
        if s.locked.is_none() {
            // What clients send to the pod through a Service while it is locked: their
            // next SYN goes where the Service points then. Its addresses are read
            // before the links go down (the kernel drops IPv6 ones with the link), the
            // sweep starts once they are down (nothing of the pod answers then).
            let staying = self.addresses_that_stay(e.process.pid);
            let l = lock(&self.kernel, e.process.pid)?;
            // Once the links are down (before, the source itself would answer the
            // node's probe and take the held SYN, which its freeze then strands): from
            // here the node holds what it sends to the pod (a client's SYN waits, it
            // is not dropped) until an announcement names the address's new place. A
            // SYN sent between the two is dropped at the dead link and retransmitted.
            s.held.extend(self.hold_neighbours(e.process.pid));
            if let Err(j) = self.journal_write(uid, e.process, &l, s.fenced) {
                // Never report a lock that a broker restart could not undo. If
                // the undo fails too, the lock stays known in memory, so that
                // unlock, forget or the lease rollback retry it.
                if unlock(&self.kernel, e.process.pid, &l).is_err() {
                    s.locked = Some(l);
                }
                return Err(j);
            }
            s.locked = Some(l);
            s.sweep = self.forget_unanswered(staying);
        } else if let Some(l) = &s.locked {
            // Already locked (perhaps by a lock whose journal write and undo both
            // failed): done only once the journal holds it.
            self.journal_write(uid, e.process, l, s.fenced)?;
        }
        Ok(Reply::Done)
    }

    fn unlock_network(
        &self,
        uid: &MigrationUid,
        e: &Entry,
        s: &mut State,
    ) -> Result<Reply, BrokerError> {
        // The saved lock is dropped only once it is restored: after a failed
        // unlock, a retry, `forget` or the lease rollback still knows what to undo.
        if let Some(l) = &s.locked {
            unlock(&self.kernel, e.process.pid, l)?;
            s.locked = None;
            // The pod answers again (a rollback), or is about to be killed (a commit).
            s.sweep = None;
        }
        // The unlock announced the addresses: what the node held goes to the source.
        self.release_neighbours(std::mem::take(&mut s.held));
        self.journal_remove(uid);
        Ok(Reply::Done)
    }

    /// The addresses of every TCP socket of the source's process tree, each socket
    /// once (whichever processes of the tree hold it). The broker reads them itself:
    /// no descriptor of the workload leaves it.
    fn list_sockets(&self, e: &Entry) -> Result<Reply, BrokerError> {
        // Inventory first, then refuse a set larger than one answer lists rather than
        // list part of it: a socket left out would be lost silently.
        let mut seen = std::collections::BTreeSet::new();
        let mut found = Vec::new();
        for pid in self.kernel.tree(e.process.pid) {
            for (fd, ino) in self.kernel.tcp_fds(pid) {
                if seen.insert(ino) {
                    found.push((pid, fd));
                }
            }
        }
        if found.len() > MAX_SOCKETS {
            return Err(err(
                ErrorKind::TooManySockets,
                format!(
                    "the source holds {} TCP sockets; at most {MAX_SOCKETS} can be listed",
                    found.len()
                ),
            ));
        }
        let sockets = found
            .into_iter()
            .map(|(pid, fd)| self.kernel.socket_addrs(pid, fd).map_err(kerr))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Reply::Sockets { sockets })
    }

    fn release_tcp_repair(&self, e: &Entry) -> Result<Reply, BrokerError> {
        release_repair(&self.kernel, e.process.pid)?;
        Ok(Reply::Done)
    }

    /// Moves a restored tree into the cgroups of the target pod's registered process;
    /// only a tree in that pod's network namespace, never the registered process itself.
    /// The migration's adopted addresses are restored from then on (journalled: if that
    /// fails, the move is reported failed, since its addresses would not outlive it).
    fn move_cgroup(
        &self,
        uid: &MigrationUid,
        e: &Entry,
        process: ProcRef,
    ) -> Result<Reply, BrokerError> {
        self.kernel.check_live(process)?;
        if process.pid == e.process.pid
            || self.kernel.netns_inode(process.pid)? != self.kernel.netns_inode(e.process.pid)?
        {
            return Err(err(
                ErrorKind::ForeignProcess,
                format!(
                    "pid {} is not a restored tree in the target pod's network namespace",
                    process.pid
                ),
            ));
        }
        let tree = self.kernel.tree(process.pid);
        self.kernel
            .move_into_cgroups_of(e.process.pid, &e.cgroup, &tree)?;
        self.mark_restored(uid, e.process).map_err(|j| {
            err(
                j.kind,
                format!(
                    "{} pids moved, but the adopted addresses could not be journalled as restored: {}",
                    tree.len(),
                    j.message
                ),
            )
        })?;
        Ok(Reply::Moved {
            pids: tree.len() as u32,
        })
    }

    /// Moves the agent's launcher of CRIU's restore into the holder's memory cgroup
    /// before it starts CRIU, so what the restore allocates is charged to the pod. Only
    /// a process of the agent's own pod (the broker's network namespace, where peers
    /// must share it: see [`Config::same_netns_peers`]), never the broker itself, and
    /// that one process (what it forks later follows it).
    fn charge_restore(&self, e: &Entry, process: ProcRef) -> Result<Reply, BrokerError> {
        self.kernel.check_live(process)?;
        let me = self.kernel.self_pid();
        if process.pid == me
            || (self.cfg.same_netns_peers
                && self.kernel.netns_inode(process.pid)? != self.kernel.netns_inode(me)?)
        {
            return Err(err(
                ErrorKind::ForeignProcess,
                format!("pid {} is not a process of the agent's pod", process.pid),
            ));
        }
        self.kernel
            .charge_memory_to(e.process.pid, &e.cgroup, process.pid)?;
        Ok(Reply::Moved { pids: 1 })
    }

    fn resume(&self, e: &Entry, s: &State) -> Result<Reply, BrokerError> {
        if s.fenced {
            return Err(err(
                ErrorKind::Fenced,
                "the source is fenced (its copy may be restored on the target): only unfence, the operator's abort, lets it resume",
            ));
        }
        signal_tree(&self.kernel, e.process.pid, Signal::SIGCONT)?;
        Ok(Reply::Done)
    }

    /// The restore fence: done only once the journal holds it, so that neither a lost
    /// lease nor a broker restart can resume this source any more.
    fn fence(&self, uid: &MigrationUid, e: &Entry, s: &mut State) -> Result<Reply, BrokerError> {
        let (Some(l), false) = (&s.locked, s.killed) else {
            return Err(err(
                ErrorKind::NotLocked,
                format!("{uid}: no frozen, locked source to fence"),
            ));
        };
        self.journal_write(uid, e.process, l, true)?;
        s.fenced = true;
        Ok(Reply::Done)
    }

    /// Lifts the fence (the operator's abort): in the journal first, then in memory,
    /// so that a failure leaves it fenced (the safe side).
    fn unfence(&self, uid: &MigrationUid, e: &Entry, s: &mut State) -> Result<Reply, BrokerError> {
        if !s.fenced {
            return Ok(Reply::Done);
        }
        if let (Some(l), false) = (&s.locked, s.killed) {
            self.journal_write(uid, e.process, l, false)?;
        }
        s.fenced = false;
        Ok(Reply::Done)
    }

    fn kill(&self, uid: &MigrationUid, e: &Entry, s: &mut State) -> Result<Reply, BrokerError> {
        signal_tree(&self.kernel, e.process.pid, Signal::SIGKILL)?;
        s.killed = true;
        self.journal_remove(uid);
        Ok(Reply::Done)
    }

    /// Ends a registration (a no-op if there is none) once its mount and lock are undone
    /// and its adoptions not yet restored withdrawn.
    fn forget(&self, conn: u64, uid: &MigrationUid) -> Result<Reply, BrokerError> {
        let Some(e) = self.held(uid, conn)? else {
            return Ok(Reply::Done);
        };
        let mut s = e.state();
        if s.gone {
            return Ok(Reply::Done);
        }
        // Adoptions not yet restored end with the registration; restored ones linger
        // (a commit: the moved connections run on) until the sweep withdraws them.
        // First, so that a failure here has undone nothing else.
        self.end_adoptions(uid)?;
        // The registration goes only once its mount and lock are undone: a
        // failed forget keeps the lease, so a retry or the rollback still can.
        if s.netns_bound {
            self.unbind(uid)?;
            s.netns_bound = false;
        }
        if let (Some(l), false) = (&s.locked, s.killed)
            && self.kernel.check_live(e.process).is_ok()
        {
            unlock(&self.kernel, e.process.pid, l)?;
        }
        self.remove(uid, &e, &mut s);
        Ok(Reply::Done)
    }

    fn unbind(&self, uid: &MigrationUid) -> Result<(), BrokerError> {
        self.kernel.unbind(&self.netns_path(uid))
    }
}

/// What a `register` asks to pin.
struct Pin<'a> {
    role: BrokerRole,
    process: ProcRef,
    container: &'a ContainerId,
}

/// For `register`, under the map: `Some` (the answer to repeat) if this connection
/// already registered this pin (process, role and container) under `uid`,
/// `AlreadyRegistered` if `uid` or the process belongs to another registration (another
/// container named for the same process and UID included), `None` if both are free.
fn taken(
    m: &Entries,
    conn: u64,
    uid: &MigrationUid,
    pin: &Pin<'_>,
) -> Result<Option<Reply>, BrokerError> {
    let process = pin.process;
    if let Some(e) = m.get(uid) {
        if e.process == process
            && e.role == pin.role
            && e.container == *pin.container
            && e.conn == conn
        {
            return Ok(Some(Reply::Registered {
                cgroup: e.cgroup.clone(),
            }));
        }
        return Err(err(
            ErrorKind::AlreadyRegistered,
            format!("{uid} is already registered"),
        ));
    }
    if m.values().any(|e| e.process.pid == process.pid) {
        return Err(err(
            ErrorKind::AlreadyRegistered,
            "process belongs to another migration",
        ));
    }
    Ok(None)
}

/// Reads one length-prefixed frame's body; `None` when the peer closed between frames.
/// An error (a read failure, a length over the cap, a frame cut short) leaves the
/// stream unframeable.
fn read_request_frame(s: &mut UnixStream) -> Result<Option<Vec<u8>>, BrokerError> {
    let mut prefix = [0u8; 4];
    if !read_full(s, &mut prefix)? {
        return Ok(None);
    }
    let len = check_len(prefix, MAX_FRAME)?;
    let mut body = vec![0u8; len];
    match read_full(s, &mut body) {
        Ok(true) => Ok(Some(body)),
        _ => Err(err(
            ErrorKind::Truncated,
            "connection closed inside a frame",
        )),
    }
}

/// The peer must share the broker's network namespace: in the chart that is the pod's
/// (the agent and the broker are its two containers), so a process elsewhere on the node
/// running as the same uid — another pod's, or a host process — is refused even though
/// its uid matches.
fn same_pod<K: Kernel>(k: &K, peer: i32) -> Result<(), BrokerError> {
    let mine = k.netns_inode(k.self_pid())?;
    match k.netns_inode(peer) {
        Ok(theirs) if theirs == mine => Ok(()),
        Ok(theirs) => Err(err(
            ErrorKind::PeerNotAllowed,
            format!("peer pid {peer} is in {theirs}, not the broker's pod ({mine})"),
        )),
        Err(_) => Err(err(
            ErrorKind::PeerNotAllowed,
            format!("peer pid {peer} cannot be inspected"),
        )),
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

/// A journal record: the locked process, its lock, and whether it is fenced.
fn parse_journal(v: &serde_json::Value) -> Option<(ProcRef, Lock, bool)> {
    let strings = |k: &str| -> Option<Vec<String>> {
        v.get(k)?
            .as_array()?
            .iter()
            .map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    let p = ProcRef {
        pid: i32::try_from(v.get("pid")?.as_i64()?).ok()?,
        start_time: v.get("start_time")?.as_u64()?,
    };
    (p.pid > 1).then_some(())?;
    Some((
        p,
        Lock {
            links: strings("links")?,
            routes: strings("routes")?,
            // Absent in a journal written before IPv6 was saved.
            routes6: strings("routes6").unwrap_or_default(),
            addrs6: strings("addrs6").unwrap_or_default(),
        },
        // Absent in a journal written before the restore fence.
        v.get("fenced").and_then(|f| f.as_bool()).unwrap_or(false),
    ))
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

/// An IPv6 read: empty when the kernel has no IPv6 ("not supported"), otherwise as is.
fn ipv6_optional(r: std::io::Result<String>) -> std::io::Result<String> {
    match r {
        Err(e) if e.to_string().contains("not supported") => Ok(String::new()),
        r => r,
    }
}

/// Isolates the pod's network namespace: every non-loopback link down (incoming
/// segments and SYNs are dropped silently and retransmitted by the peers, nothing is
/// reset, and the frozen source cannot emit anything), routes saved for `unlock`.
fn lock<K: Kernel>(k: &K, pid: i32) -> Result<Lock, BrokerError> {
    k.in_netns(pid, |ip| {
        let lines = |out: String| -> Vec<String> {
            out.lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_owned)
                .collect()
        };
        let routes = lines(ip.ip(&["-4", "route", "show"])?);
        // A namespace without IPv6 (disabled in the kernel) has nothing to save; any
        // other failure fails the lock before anything is taken down (an IPv6 route
        // that was not saved could not be restored).
        let routes6 = lines(ipv6_optional(ip.ip(&["-6", "route", "show"]))?);
        let links: Vec<String> = ip
            .ip(&["-o", "link", "show", "up"])?
            .lines()
            .filter_map(|l| {
                let name = l.split(':').nth(1)?.trim();
                let name = name.split('@').next()?;
                (name != "lo").then(|| name.to_owned())
            })
            .collect();
        let addrs6 = global_ipv6_addrs(
            &ipv6_optional(ip.ip(&["-6", "-o", "addr", "show", "scope", "global"]))?,
            &links,
        );
        let mut lock = Lock {
            links: Vec::new(),
            routes,
            routes6,
            addrs6,
        };
        for l in links {
            if let Err(e) = ip.ip(&["link", "set", "dev", &l, "down"]) {
                // Half locked: give back what was taken down before reporting the
                // failure — nobody else would (no lock is recorded).
                let _ = restore(ip, &lock);
                return Err(e);
            }
            lock.links.push(l);
        }
        Ok(lock)
    })
    .map_err(kerr)
}

fn unlock<K: Kernel>(k: &K, pid: i32, l: &Lock) -> Result<(), BrokerError> {
    let l = l.clone();
    k.in_netns(pid, move |ip| {
        restore(ip, &l)?;
        announce(ip, &l.links);
        Ok(())
    })
    .map_err(kerr)
}

/// Tells the pod's neighbours that its addresses are back: for each address of each link
/// the lock took down, a gratuitous ARP (IPv4) or an unsolicited Neighbour Advertisement
/// (global IPv6). While the links were down, a neighbour that sent to the pod (the node,
/// for a client's retransmission or a probe) failed to resolve it; a connection it
/// opens just after the unlock can join that failing resolution and get EHOSTUNREACH
/// ("No route to host") for up to its probe time (3 s by default). The announcement
/// settles its entry at once. Best effort: a failure is logged, never a failed unlock
/// (the neighbours then resolve the pod on their own).
fn announce(ip: &mut dyn Ip, locked: &[String]) {
    let links = match ip.ip(&["-o", "link", "show"]) {
        Ok(out) => parse_links(&out),
        Err(e) => {
            tracing::warn!(error = %e, "unlock: links not listed, addresses not announced");
            return;
        }
    };
    let addrs = match ip.ip(&["-o", "addr", "show"]) {
        Ok(out) => addr_lines(&out),
        Err(e) => {
            tracing::warn!(error = %e, "unlock: addresses not listed, not announced");
            return;
        }
    };
    // Every IPv4 address, and the IPv6 addresses of global scope (a link-local address
    // is new after the link comes back, and still tentative).
    let announced = addrs
        .into_iter()
        .filter(|a| !a.v6 || a.global)
        .filter_map(|a| {
            Some((
                a.link.clone(),
                a.address().parse::<std::net::IpAddr>().ok()?,
            ))
        });
    for (name, addr) in announced {
        let Some(link) = links
            .iter()
            .find(|k| k.name == name && k.mac.is_some() && locked.contains(&k.name))
        else {
            continue;
        };
        if let Err(e) = ip.announce(link, addr) {
            tracing::warn!(error = %e, link = %name, %addr, "unlock: address not announced");
        }
    }
}

/// `ip -o link show` output (`2: eth0@if7: <...> mtu 1500 ... \    link/ether
/// 36:9a:9a:24:f0:ec brd ff:ff:ff:ff:ff:ff link-netnsid 0`) as links.
fn parse_links(out: &str) -> Vec<Link> {
    out.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let index = w.next()?.strip_suffix(':')?.parse().ok()?;
            let name = w
                .next()?
                .trim_end_matches(':')
                .split('@')
                .next()?
                .to_owned();
            let mut rest = w.skip_while(|t| *t != "link/ether");
            let mac = rest.next().and_then(|_| parse_mac(rest.next()?));
            Some(Link { name, index, mac })
        })
        .collect()
}

fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// One line of `ip -o addr show` (`2: eth0    inet 198.18.1.21/24 brd ... scope global
/// eth0\\ ...`, `4: eth0@if9    inet6 2001:db8::5/64 scope global \\ ...`).
#[derive(Debug, PartialEq, Eq)]
struct AddrLine {
    link: String,
    v6: bool,
    /// `<addr>/<len>`, as printed.
    cidr: String,
    /// `scope global`.
    global: bool,
}

impl AddrLine {
    /// The address without its prefix length.
    fn address(&self) -> &str {
        self.cidr.split('/').next().unwrap_or(&self.cidr)
    }
}

/// The address lines of `ip -o addr show` output (the one reading of it: the
/// namespace's addresses, the IPv6 addresses a lock saves, the addresses an unlock
/// announces).
fn addr_lines(out: &str) -> Vec<AddrLine> {
    out.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let link = w.nth(1)?.split('@').next()?.to_owned();
            let v6 = match w.next()? {
                "inet" => false,
                "inet6" => true,
                _ => return None,
            };
            let cidr = w.next()?.to_owned();
            let global = w.skip_while(|t| *t != "scope").nth(1) == Some("global");
            Some(AddrLine {
                link,
                v6,
                cidr,
                global,
            })
        })
        .collect()
}

/// Links up, IPv6 addresses back, routes restored: the inverse of [`lock`], inside the
/// pod's network namespace.
fn restore(ip: &mut dyn Ip, l: &Lock) -> std::io::Result<()> {
    {
        for link in &l.links {
            ip.ip(&["link", "set", "dev", link, "up"])?;
        }
        for a in &l.addrs6 {
            // nodad: the address was in use a moment ago; no duplicate detection delay.
            let mut args = vec!["-6", "addr", "replace"];
            args.extend(a.split_whitespace());
            args.push("nodad");
            ip.ip(&args)?;
        }
        // Routes come back in dependency order: a gateway route needs the route to
        // its gateway first, so retry the failures while each pass makes progress.
        let mut left: Vec<(&str, &String)> = (l.routes.iter().map(|r| ("-4", r)))
            .chain(l.routes6.iter().map(|r| ("-6", r)))
            .collect();
        let mut last_err = None;
        while !left.is_empty() {
            let before = left.len();
            left.retain(|(family, r)| {
                let mut args = vec![*family, "route", "replace"];
                args.extend(r.split_whitespace().filter(|w| *w != "linkdown"));
                match ip.ip(&args) {
                    Ok(_) => false,
                    Err(e) => {
                        last_err = Some(e);
                        true
                    }
                }
            });
            if left.len() == before {
                return Err(last_err
                    .take()
                    .unwrap_or_else(|| std::io::Error::other("route restore")));
            }
        }
        Ok(())
    }
}

/// The global IPv6 addresses of `links` in `ip -6 -o addr show scope global` output
/// (`2: eth0    inet6 2001:db8::5/64 scope global \ ...`), as `<addr>/<len> dev <link>`.
fn global_ipv6_addrs(out: &str, links: &[String]) -> Vec<String> {
    addr_lines(out)
        .into_iter()
        .filter(|a| a.v6 && links.contains(&a.link))
        .map(|a| format!("{} dev {}", a.cidr, a.link))
        .collect()
}

/// Reads exactly `buf.len()` bytes; Ok(false) on a clean EOF before the first byte.
fn read_full(s: &mut UnixStream, buf: &mut [u8]) -> Result<bool, BrokerError> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => {
                return Err(err(
                    ErrorKind::Truncated,
                    "connection closed inside a frame",
                ));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(e)),
        }
    }
    Ok(true)
}

/// An I/O error on a broker connection; a deadline passed (a socket timeout) says so.
fn io_err(e: std::io::Error) -> BrokerError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            err(ErrorKind::Kernel, "no answer within the call deadline")
        }
        _ => kerr(e),
    }
}

/// Client side, used by the agent: one connection = one lease.
pub mod client {
    use super::*;

    pub struct BrokerClient {
        s: UnixStream,
    }

    impl BrokerClient {
        pub fn connect(path: &std::path::Path) -> std::io::Result<Self> {
            Ok(Self {
                s: UnixStream::connect(path)?,
            })
        }

        /// Connects, and bounds every call: a broker that does not take a request or
        /// answer it within `deadline` fails the call, and the connection is closed
        /// (a frame cut off leaves nothing to read the next answer from). The
        /// connection is the migration's lease, so its end hands what was registered
        /// on it back to the broker, which undoes it (rolls the source back, or kills
        /// it if fenced) when it gets to it.
        pub fn connect_with_deadline(
            path: &std::path::Path,
            deadline: Duration,
        ) -> std::io::Result<Self> {
            let s = UnixStream::connect(path)?;
            s.set_read_timeout(Some(deadline))?;
            s.set_write_timeout(Some(deadline))?;
            Ok(Self { s })
        }

        pub fn call(&mut self, req: &Request) -> Result<Reply, BrokerError> {
            match self.exchange(req) {
                Ok(Response::Ok(r)) => Ok(r),
                // The broker's answer: the connection is as good as before.
                Ok(Response::Err(e)) => Err(e),
                // The framing is lost (the deadline passed, or the broker went away
                // inside a frame): end the lease rather than read a stale answer later.
                Err(mut e) => {
                    let _ = self.s.shutdown(std::net::Shutdown::Both);
                    e.message = format!(
                        "{}: {} (this migration's broker connection, its lease, is closed: the broker undoes what it holds)",
                        req.name(),
                        e.message
                    );
                    Err(e)
                }
            }
        }

        /// One request and its answer; an error only where the connection failed.
        fn exchange(&mut self, req: &Request) -> Result<Response, BrokerError> {
            self.s.write_all(&encode_frame(req)).map_err(io_err)?;
            let mut prefix = [0u8; 4];
            if !read_full(&mut self.s, &mut prefix)? {
                return Err(err(ErrorKind::Truncated, "broker closed the connection"));
            }
            let len = check_len(prefix, MAX_REPLY_FRAME)?;
            let mut body = vec![0u8; len];
            read_full(&mut self.s, &mut body)?;
            decode_response(&body)
        }

        /// Whether the broker has closed this connection (it ended it, or it exited):
        /// every later call fails, and what was registered on it is the broker's to
        /// undo (the lease's end, or the journal when the broker starts again).
        pub fn closed(&self) -> bool {
            let mut b = [0u8; 1];
            matches!(
                nix::sys::socket::recv(
                    self.s.as_raw_fd(),
                    &mut b,
                    MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT
                ),
                Ok(0) | Err(nix::errno::Errno::ECONNRESET)
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            .call(&Request::LockNetwork { uid: uid.clone() })
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
            encode_frame(&Request::LockNetwork { uid: uid.clone() })
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
