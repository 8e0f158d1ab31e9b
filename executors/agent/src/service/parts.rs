//! The pod's other containers: every container of a multi-container pod after the
//! first ([`crate::pod`]), which moves with it.
//!
//! The first container is the migration's own process as in a single-container move;
//! each other one is a [`Part`]: its tree is dumped by a CRIU run of its own, at the
//! same time as the first's and under the same network lock (the pod shares one
//! network namespace, locked once by the first container's registration), into image
//! directories named after it, and restored on the target into the container of the
//! same name (its holder), joining the same network namespace.
//!
//! Each part is registered with the node's broker as a migration of its own, under a
//! derived UID (`<uid>-<index>`) on a connection of its own: its lease. The broker
//! then keeps for every container what it keeps for one: the pin (the process checked
//! against its container's cgroup), the journal, the restore fence, and the rollback
//! when the agent goes away (resumed if only frozen, killed if fenced). Its network
//! "lock" comes after the first's, when the pod's links are already down: it takes
//! nothing down and restores nothing but what is there, yet it is what makes the
//! broker treat the part as a frozen source (the fence needs it; a lost lease rolls it
//! back).
//!
//! A part's freeze is the migration's: the [`super::Freeze`] that decides whether the
//! source resumes or dies holds every part's lease ([`Lease`]), so the thaw, the kill
//! and the fence of the source act on every container, in each path that ends a
//! freeze (commit, abort, the watchdog, shutdown).

use super::helpers::{NETNS_KEY, blocking, broker_call, held_source, io_status, netns_ino};
use crate::containers::{ContainerFs, Containers, Resolved};
use crate::criu::Opts;
use crate::pod::{Layout, PodPlan};
use crate::{creds, mounts};
use podmotion_broker::client::BrokerClient;
use podmotion_broker::procfs;
use podmotion_wire::agent::Role;
use podmotion_wire::broker::{BrokerRole, Reply, Request};
use podmotion_wire::ids::{ContainerId, MigrationUid, ProcRef};
use std::path::PathBuf;
use std::sync::{Arc, Mutex as StdMutex};
use tonic::Status;

/// What ends a part's freeze without the migration's lock: its broker lease, its
/// registration's UID and its tree's root (source) or holder (target).
#[derive(Clone)]
pub(super) struct Lease {
    pub(super) broker: Arc<StdMutex<BrokerClient>>,
    pub(super) uid: MigrationUid,
    pub(super) process: ProcRef,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("uid", &self.uid)
            .field("process", &self.process)
            .finish_non_exhaustive()
    }
}

impl Lease {
    pub(super) async fn call(&self, req: Request) -> Result<Reply, Status> {
        broker_call(&self.broker, req).await
    }
}

/// A container of the pod after the first.
pub(super) struct Part {
    pub(super) name: String,
    pub(super) layout: Layout,
    pub(super) lease: Lease,
    /// The holder whose workload `lease.process` is (a container moved before).
    pub(super) held_by: Option<ProcRef>,
    /// A real container's mounts.
    pub(super) fs: Option<ContainerFs>,
    /// Target: its restored root.
    pub(super) restored: Option<ProcRef>,
}

/// The broker registration UID of the part at `index` (from 1).
fn part_uid(uid: &MigrationUid, index: usize) -> Result<MigrationUid, Status> {
    MigrationUid::parse(&format!("{uid}-{index}")).map_err(|e| {
        Status::invalid_argument(format!(
            "migration uid {uid}: no room for its containers' registrations ({e})"
        ))
    })
}

/// Resolves and registers every container of `plan` after the first, for `role`.
/// Each registration is made on its own connection; what was registered is in `out`
/// even when a later one fails, so that the caller undoes it ([`forget_all`]).
pub(super) async fn prepare(
    containers: &Containers,
    socket: PathBuf,
    deadline: std::time::Duration,
    plan: &PodPlan,
    uid: &MigrationUid,
    role: Role,
    out: &mut Vec<Part>,
) -> Result<(), Status> {
    for (index, c) in plan.containers().iter().enumerate().skip(1) {
        let name = c.name.clone().unwrap_or_default();
        let Resolved { container, pid, fs } = containers
            .resolve(std::slice::from_ref(&c.id))
            .await
            .map_err(|e| Status::new(e.code(), format!("container {name}: {}", e.message())))?;
        let (pid, held_by) = match role {
            Role::Source => held_source(pid)
                .map_err(|e| Status::new(e.code(), format!("container {name}: {}", e.message())))?,
            _ => (pid, None),
        };
        let start_time = procfs::start_time(pid)
            .map_err(|e| Status::not_found(format!("container {name}: {e}")))?;
        let process = ProcRef { pid, start_time };
        if role == Role::Source {
            creds::tree_owner(pid)
                .map_err(|e| Status::failed_precondition(format!("container {name}: {e}")))?;
        }
        let sub = part_uid(uid, index)?;
        let sock = socket.clone();
        let client = blocking(move || {
            BrokerClient::connect_with_deadline(&sock, deadline)
                .map_err(|e| Status::unavailable(format!("broker: {e}")))
        })
        .await?;
        let lease = Lease {
            broker: Arc::new(StdMutex::new(client)),
            uid: sub,
            process,
        };
        let part = Part {
            name: name.clone(),
            layout: plan.layout(index),
            lease: lease.clone(),
            held_by,
            fs,
            restored: None,
        };
        // Recorded before it registers: a failed registration is forgotten too.
        out.push(part);
        register(&lease, role, container)
            .await
            .map_err(|e| Status::new(e.code(), format!("container {name}: {}", e.message())))?;
    }
    Ok(())
}

async fn register(lease: &Lease, role: Role, container: ContainerId) -> Result<(), Status> {
    let role = if role == Role::Source {
        BrokerRole::Source
    } else {
        BrokerRole::Target
    };
    lease
        .call(Request::Register {
            uid: lease.uid.clone(),
            role,
            process: lease.process,
            container,
        })
        .await
        .map(|_| ())
}

/// Ends every part's registration (best effort: the end of its lease, when the part
/// is dropped, does it anyway).
pub(super) async fn forget_all(parts: &[Part]) {
    for p in parts {
        if let Err(e) = p
            .lease
            .call(Request::Forget {
                uid: p.lease.uid.clone(),
            })
            .await
        {
            tracing::warn!(uid = %p.lease.uid, container = %p.name, error = %e.message(), "the broker did not forget the container's registration (the lease's end does)");
        }
    }
}

/// The mount points a container's dump declares external (none for a process of the
/// node's mount namespace).
pub(super) fn external_mounts(fs: Option<&ContainerFs>, pid: i32) -> Result<Vec<String>, Status> {
    let Some(fs) = fs else {
        return Ok(vec![]);
    };
    let path = format!("/proc/{pid}/mountinfo");
    let mi = std::fs::read_to_string(&path).map_err(|e| io_status("read", &path, &e))?;
    Ok(mounts::dump_externals(
        &fs.spec,
        &mounts::parse_mountinfo(&mi),
    ))
}

/// One part's CRIU dump: its options, who it runs as, and what its manifest needs.
pub(super) struct PartDump {
    pub(super) opts: Opts,
    pub(super) dir: PathBuf,
    pub(super) owner: creds::Owner,
    pub(super) external_mounts: Vec<String>,
    pub(super) stdio_pipes: Vec<(i32, String)>,
}

/// The dump of `p` into `dir` (a pre-copy round's or the final one), `parent` its
/// previous round (memory tracking), `fin` a final dump (connections, left stopped).
pub(super) fn dump_of(
    p: &Part,
    dir: PathBuf,
    log: &str,
    track_mem: bool,
    parent: Option<u32>,
    fin: bool,
) -> Result<PartDump, Status> {
    let pid = p.lease.process.pid;
    procfs::check_live(p.lease.process)
        .map_err(|e| Status::failed_precondition(format!("container {}: {e}", p.name)))?;
    let owner = creds::tree_owner(pid)
        .map_err(|e| Status::failed_precondition(format!("container {}: {e}", p.name)))?;
    std::fs::create_dir_all(&dir).map_err(|e| Status::internal(e.to_string()))?;
    let external_mounts = external_mounts(p.fs.as_ref(), pid)?;
    let mut o = Opts::new(&dir, log);
    o.pid = Some(pid);
    o.external = vec![format!("net[{}]:{}", netns_ino(pid, owner)?, NETNS_KEY)];
    o.external
        .extend(mounts::dump_external_args(&external_mounts));
    if track_mem {
        o.track_mem = Some(true);
        if let Some(n) = parent.filter(|n| *n > 0) {
            o.parent_img = Some(p.layout.parent_link(n));
        }
    }
    let mut stdio_pipes = vec![];
    if fin {
        o.tcp_established = Some(true);
        o.tcp_skip_in_flight = Some(true);
        o.leave_stopped = Some(true);
        if p.fs.is_some() {
            stdio_pipes = creds::as_owner(owner, || mounts::stdio_pipes(pid))
                .map_err(|e| io_status("read fd links of", &format!("/proc/{pid}/fd"), &e))?
                .into_iter()
                .map(|p| (p.fd, p.key))
                .collect();
        }
    } else if !track_mem {
        o.leave_running = Some(true);
        o.tcp_close = Some(true);
        // As the one-container warm round (`Service::pre_dump_impl`): a connection the
        // kernel accepted and the workload has not yet is the final dump's to decide,
        // never a reason to fail the round (a rehearsal's native-sidecar PreCopy failed
        // its first round on one: "In-flight connection (l)").
        o.tcp_skip_in_flight = Some(true);
    }
    Ok(PartDump {
        opts: o,
        dir,
        owner,
        external_mounts,
        stdio_pipes,
    })
}

/// Source, after the first container's lock: each part's registration is locked too
/// (see the module docs) and its sockets listed. A failure unlocks the parts locked
/// so far and is returned (the caller unlocks the first).
pub(super) async fn lock_all(
    leases: &[Lease],
) -> Result<Vec<Vec<podmotion_wire::broker::SocketAddrs>>, Status> {
    let mut out = Vec::new();
    for (i, l) in leases.iter().enumerate() {
        let step = async {
            l.call(Request::LockNetwork {
                uid: l.uid.clone(),
                hold: None,
            })
            .await?;
            match l.call(Request::ListSockets { uid: l.uid.clone() }).await? {
                Reply::Sockets { sockets } => Ok(sockets),
                other => Err(Status::internal(format!("broker replied {other:?}"))),
            }
        };
        match step.await {
            Ok(s) => out.push(s),
            Err(e) => {
                for l in &leases[..=i] {
                    let _ = l.call(Request::UnlockNetwork { uid: l.uid.clone() }).await;
                }
                return Err(e);
            }
        }
    }
    Ok(out)
}

/// Fences every part (after the first container's fence). A failure lifts the
/// fences taken so far and is returned (the caller lifts the first's).
pub(super) async fn fence_all(leases: &[Lease]) -> Result<(), Status> {
    for (i, l) in leases.iter().enumerate() {
        if let Err(e) = l.call(Request::Fence { uid: l.uid.clone() }).await {
            for l in &leases[..i] {
                let _ = l.call(Request::Unfence { uid: l.uid.clone() }).await;
            }
            return Err(e);
        }
    }
    Ok(())
}

/// Lifts every part's fence (the operator's abort).
pub(super) async fn unfence_all(leases: &[Lease]) -> Result<(), Status> {
    for l in leases {
        l.call(Request::Unfence { uid: l.uid.clone() }).await?;
    }
    Ok(())
}
