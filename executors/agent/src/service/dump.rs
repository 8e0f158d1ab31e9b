//! The final dump on the source, from the network lock on: the tree left stopped, its
//! freeze recorded and watched (see [`super::FreezeWatchdog`]), and the manifest the
//! target restores from.

use super::freeze::{FENCED, FENCING, FROZEN, Freeze, FrozenSource, KILLING, THAWING};
use super::freeze::{kill_fenced, thaw_frozen, thaw_source};
use super::helpers::{blocking, io_internal, now_us, run_criu};
use super::parts::{self, PartDump};
use super::post_copy;
use super::room::check_room;
use super::state::Migration;
use crate::criu::{self, Criu, Opts};
use crate::images;
use podmotion_broker::client::BrokerClient;
use podmotion_broker::procfs;
use podmotion_wire::agent::{
    Manifest, ManifestSocket, MigrationStatus, Phase, SocketOutcome, SocketReport,
};
use podmotion_wire::broker::{Reply, Request, SocketAddrs};
use podmotion_wire::ids::{MigrationUid, ProcRef};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};
use tonic::Status;

/// What the final dump needs once the network is locked (see
/// [`super::Agent::dump_impl`]).
pub(super) struct DumpOutcome {
    pub(super) dir: PathBuf,
    pub(super) opts: Opts,
    pub(super) external_mounts: Vec<String>,
    pub(super) stdio_pipes: Vec<(i32, String)>,
    pub(super) criu: Criu,
    pub(super) frozen: Arc<StdMutex<Vec<FrozenSource>>>,
    pub(super) margin: std::time::Duration,
    /// PostCopy: a lazy dump ([`super::post_copy::Source`]).
    pub(super) lazy: bool,
    /// Who CRIU runs as: the tree's owner ([`crate::creds`]).
    pub(super) owner: crate::creds::Owner,
    /// The final dumps of the pod's other containers, in the order of `m.parts`.
    pub(super) parts: Vec<PartDump>,
}

/// The final dump from the network lock on, run by a task that owns the migration.
/// First, before anything is locked or frozen, the checkpoint volume must have room
/// for it ([`super::room::check_room`]).
pub(super) async fn dump_locked(
    mut m: tokio::sync::OwnedMutexGuard<Migration>,
    d: DumpOutcome,
) -> Result<MigrationStatus, Status> {
    if let Err(e) = check_room(&m, &d.dir, d.opts.parent_img.is_some()).await {
        let _ = images::zeroize(&d.dir);
        return Err(e);
    }
    let DumpOutcome {
        dir,
        opts,
        external_mounts,
        stdio_pipes,
        criu,
        frozen,
        margin,
        lazy,
        owner,
        parts,
    } = d;
    let part_dirs: Vec<PathBuf> = parts.iter().map(|p| p.dir.clone()).collect();
    let (sockets, t) = match lock_settled(&mut m).await {
        Ok(s) => s,
        Err(e) => {
            zeroize_all(&part_dirs);
            return Err(e);
        }
    };
    let part_sockets = lock_parts(&mut m, &part_dirs).await?;
    let lazy = match dump_all(&m, &criu, opts, &dir, lazy, owner, &parts).await {
        Ok(lazy) => lazy,
        Err(e) => {
            undo_failed_dump(&mut m, &dir, &part_dirs).await;
            return Err(e);
        }
    };
    m.timings.dump_us = t.elapsed().as_micros() as u64;
    m.timings.dump_finished_us = now_us();
    hold_freeze(&mut m, lazy, &frozen, margin);
    super::warm::record_final_freeze(&mut m, &dir, &part_dirs);
    let mut all_sockets = sockets.clone();
    all_sockets.extend(write_part_manifests(&m, parts, part_sockets)?);
    let manifest = dump_manifest(&m, &sockets, external_mounts, stdio_pipes);
    write_manifest(&m.dir, &manifest)?;
    m.sockets = all_sockets;
    m.final_dump_bytes =
        images::size(&dir) + part_dirs.iter().map(|p| images::size(p)).sum::<u64>();
    m.image_bytes = images::size(&m.dir);
    m.phase = Phase::Dumped;
    tracing::info!(
        uid = %m.uid,
        dump_ms = m.timings.dump_us / 1000,
        bytes = m.final_dump_bytes,
        watchdog_ms = m.freeze_limit.as_millis() as u64,
        "dumped; source left stopped"
    );
    Ok(m.status())
}

/// The tree is stopped (PostCopy: held by the lazy dump): the freeze is recorded and
/// watched from this instant, even if what follows fails.
fn hold_freeze(
    m: &mut Migration,
    lazy: Option<Arc<post_copy::Source>>,
    frozen: &StdMutex<Vec<FrozenSource>>,
    margin: Duration,
) {
    if let Some(src) = lazy {
        *m.freeze.lazy.lock().expect("lazy") = Some(Arc::clone(&src));
        m.lazy_source = Some(src);
    }
    m.freeze.set(FROZEN);
    start_freeze_watchdog(frozen, margin, m);
}

/// Zeroizes the image dirs of the pod's other containers (a final dump that failed).
fn zeroize_all(part_dirs: &[PathBuf]) {
    for p in part_dirs {
        let _ = images::zeroize(p);
    }
}

/// The pod's other containers: locked after the first (the pod's links are down
/// already), their sockets listed. On failure the first's network reopens.
async fn lock_parts(
    m: &mut Migration,
    part_dirs: &[PathBuf],
) -> Result<Vec<Vec<SocketAddrs>>, Status> {
    let leases: Vec<_> = m.parts.iter().map(|p| p.lease.clone()).collect();
    match parts::lock_all(&leases).await {
        Ok(s) => Ok(s),
        Err(e) => {
            let _ = m
                .broker(Request::UnlockNetwork { uid: m.uid.clone() })
                .await;
            zeroize_all(part_dirs);
            m.timings.freeze_started_us = 0;
            Err(e)
        }
    }
}

/// The final dumps. Every container at once, each by a CRIU of its own: the pod is
/// cut as nearly at one instant as separate trees allow, and the freeze lasts as long
/// as the longest dump, not their sum. The first container's failure, else the first
/// failed part's; PostCopy: the lazy dump holding the first.
async fn dump_all(
    m: &Migration,
    criu: &Criu,
    opts: Opts,
    dir: &Path,
    lazy: bool,
    owner: crate::creds::Owner,
    parts: &[PartDump],
) -> Result<Option<Arc<post_copy::Source>>, Status> {
    let others = futures::future::join_all(parts.iter().map(|p| {
        run_criu(
            criu.clone(),
            criu::REQ_DUMP,
            p.opts.clone(),
            p.dir.join("dump.log"),
            p.owner,
        )
    }));
    let first = async {
        if lazy {
            post_copy::Source::dump(criu.clone(), opts, dir, dir.join("dump.log"))
                .await
                .map(Some)
        } else {
            run_criu(
                criu.clone(),
                criu::REQ_DUMP,
                opts,
                dir.join("dump.log"),
                owner,
            )
            .await
            .map(|_| None)
        }
    };
    let (dumped, others) = tokio::join!(first, others);
    let part_failure = others.iter().enumerate().find_map(|(i, r)| {
        r.as_ref().err().map(|e| {
            Status::new(
                e.code(),
                format!("container {}: {}", m.parts[i].name, e.message()),
            )
        })
    });
    match (dumped, part_failure) {
        (Err(e), _) | (Ok(_), Some(e)) => Err(e),
        (Ok(lazy), None) => Ok(lazy),
    }
}

/// After a failed final dump: CRIU resumed a tree whose dump failed; with several
/// containers, the trees whose dumps succeeded are stopped, their sockets in repair:
/// every container resumes and the network reopens (each step a no-op where there is
/// nothing to undo). The images go.
async fn undo_failed_dump(m: &mut Migration, dir: &Path, part_dirs: &[PathBuf]) {
    if m.parts.is_empty() {
        // One container: CRIU resumed it and its sockets; reopen the network.
        let _ = m
            .broker(Request::UnlockNetwork { uid: m.uid.clone() })
            .await;
    } else if let Err(t) = thaw_source(&m.freeze, &m.broker, &m.uid).await {
        tracing::error!(uid = %m.uid, error = %t.message(), "a failed dump of the pod could not resume every container; the broker resumes them when this migration's lease ends");
    }
    let _ = images::zeroize(dir);
    zeroize_all(part_dirs);
    m.timings.freeze_started_us = 0;
}

/// The manifests of the pod's other containers, each beside its images; the sockets
/// found in them.
fn write_part_manifests(
    m: &Migration,
    parts: Vec<PartDump>,
    part_sockets: Vec<Vec<SocketAddrs>>,
) -> Result<Vec<SocketReport>, Status> {
    let mut all_sockets = Vec::new();
    for ((p, pd), found) in m.parts.iter().zip(parts).zip(part_sockets) {
        let found: Vec<SocketReport> = found.iter().map(socket_report).collect();
        let manifest = Manifest {
            final_dir: p.layout.final_dir(),
            sockets: manifest_sockets(&found),
            tcp: m.tcp as i32,
            external_mounts: pd.external_mounts,
            stdio_pipes: pd.stdio_pipes,
            workload: workload_of(&m.uid, p.held_by, p.fs.as_ref()),
        };
        write_manifest_as(&m.dir, &p.layout.manifest(), &manifest)?;
        all_sockets.extend(found);
    }
    Ok(all_sockets)
}

/// The longest the final dump waits for the pod's connections in flight to settle.
const QUIESCE_LIMIT: std::time::Duration = std::time::Duration::from_millis(150);

/// How long the quiesce after a lifted lock waits at most: the segments the brief lock
/// dropped (an answer, a client's ACK) are sent again only at their retransmission
/// timeout, 200 ms at least (Linux's `TCP_RTO_MIN`), so a wait shorter than that finds
/// them still in flight and locks with them behind the link — a request lost (a
/// client's read timing out, seen on real nodes at [`QUIESCE_LIMIT`]).
const QUIESCE_AFTER_RELOCK: std::time::Duration = std::time::Duration::from_millis(450);

/// How many times the lock is lifted and taken again when connections came in flight
/// between the quiesce's last look and the lock ([`lock_settled`]).
const RELOCKS: usize = 3;

/// Quiesces the pod and locks its network with nothing in flight behind the lock, and
/// returns the lock's sockets and when the lock was taken (the freeze's start, also in
/// `timings.freeze_started_us`).
///
/// A client's SYN can still come between the quiesce's last look and the lock; the
/// kernel completes the connection, the workload (still running) takes the request and
/// answers it behind the dead link, and where the address does not move that request
/// is lost with the source: the client's read times out (the one failed request of
/// docs/benchmarks.md, "What a client sees", run 5). So once locked, if the quiesce had
/// found the pod quiet, look again: a connection in flight now (queued, half open, or
/// answered and not acknowledged) came in that window. The lock is then lifted (the
/// answer goes out, the client's ACK comes in), the pod quiesced, and the lock taken
/// again ([`look_again`]); the last lock stays, whatever it sees.
async fn lock_settled(m: &mut Migration) -> Result<(Vec<SocketReport>, Instant), Status> {
    let mut quiet = quiesce(m, QUIESCE_LIMIT).await;
    let mut relocks = 0;
    loop {
        m.timings.freeze_started_us = now_us();
        let t = Instant::now();
        let sockets = lock_network(m).await?;
        let came = if look_again(quiet, relocks) {
            procfs::in_flight_of(m.process.pid).unwrap_or(0)
        } else {
            0
        };
        if came == 0 {
            return Ok((sockets, t));
        }
        tracing::info!(uid = %m.uid, in_flight = came, relock = relocks + 1, "connections came in flight before the lock; unlocking to let them finish");
        if let Err(e) = m
            .broker(Request::UnlockNetwork { uid: m.uid.clone() })
            .await
        {
            m.timings.freeze_started_us = 0;
            return Err(e);
        }
        relocks += 1;
        quiet = quiesce(m, QUIESCE_AFTER_RELOCK).await;
    }
}

/// Whether the lock just taken looks for connections in flight (and is lifted again
/// if it finds one), given whether the quiesce before it found the pod `quiet` and how
/// many times the lock was lifted already: at most [`RELOCKS`] times, and once only
/// for a pod the first quiesce did not find quiet within [`QUIESCE_LIMIT`] — on a busy
/// node a workload answering its clients can take longer than that (seen on the real
/// nodes with three migrations at once: a client's read lost behind the lock, its 3 s
/// read timeout the one failed request), while a pod that is still not quiet after
/// [`QUIESCE_AFTER_RELOCK`] is never quiet (a stream) and is locked as it is.
fn look_again(quiet: bool, relocks: usize) -> bool {
    relocks < RELOCKS && (quiet || relocks == 0)
}

/// Waits, before the lock (`limit` at most, the workload still running), until
/// no connection of the pod is in flight ([`procfs::in_flight`]): a request the kernel
/// accepted but the workload had not answered when the links went down is lost where
/// the address does not move (the source is killed at the commit with it unread: the
/// client sees a reset). Returns whether it found the pod quiet; a workload that is
/// never quiet (a stream) is frozen at the limit.
async fn quiesce(m: &Migration, limit: std::time::Duration) -> bool {
    let (pid, t) = (m.process.pid, Instant::now());
    let mut busy;
    loop {
        busy = match procfs::in_flight_of(pid) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(uid = %m.uid, pid, error = %e, "connections in flight not read; freezing without waiting");
                return false;
            }
        };
        if busy == 0 || t.elapsed() >= limit {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    tracing::info!(
        uid = %m.uid,
        waited_ms = t.elapsed().as_millis() as u64,
        in_flight = busy,
        "connections in flight before the freeze"
    );
    busy == 0
}

/// Locks the pod's network and lists its sockets. Network first: from here nothing
/// reaches or leaves the pod, so no segment is acknowledged after the socket state is
/// captured. Sockets that cannot be listed reopen the network.
async fn lock_network(m: &Migration) -> Result<Vec<SocketReport>, Status> {
    m.broker(Request::LockNetwork {
        uid: m.uid.clone(),
        // Checked at `Prepare`.
        hold: Some(super::forward::service_ports(&m.hold_services, false).unwrap_or_default()),
    })
    .await?;
    match inventory(m).await {
        Ok(s) => Ok(s),
        Err(e) => {
            let _ = m
                .broker(Request::UnlockNetwork { uid: m.uid.clone() })
                .await;
            Err(e)
        }
    }
}

/// The manifest of the final dump: its dir, sockets, TCP preservation and, for a
/// container, its external mounts, pipes and workload.
fn dump_manifest(
    m: &Migration,
    sockets: &[SocketReport],
    external_mounts: Vec<String>,
    stdio_pipes: Vec<(i32, String)>,
) -> Manifest {
    Manifest {
        final_dir: "final".into(),
        sockets: manifest_sockets(sockets),
        tcp: m.tcp as i32,
        external_mounts,
        stdio_pipes,
        workload: workload_of(&m.uid, m.held_by, m.fs.as_ref()),
    }
}

fn manifest_sockets(sockets: &[SocketReport]) -> Vec<ManifestSocket> {
    sockets
        .iter()
        .map(|s| ManifestSocket {
            local: s.local.clone(),
            remote: s.remote.clone(),
            listening: s.listening,
        })
        .collect()
}

/// The process the target's holder executes if the adopted container is started
/// again: the source container's own (its runtime's spec), or, for a source that is
/// itself a holder, the one its restart file names (the spec's would be the holder,
/// which would then execute itself). A restart file that cannot be read is logged and
/// left out: a restart of the adopted container then holds, as the holder does.
fn workload_of(
    uid: &MigrationUid,
    held_by: Option<ProcRef>,
    fs: Option<&crate::containers::ContainerFs>,
) -> Option<podmotion_wire::agent::Workload> {
    let Some(holder) = held_by else {
        return fs.and_then(|fs| fs.workload.clone());
    };
    let root = PathBuf::from(format!("/proc/{}/root", holder.pid));
    match procfs::check_live(holder)
        .map_err(|e| e.to_string())
        .and_then(|()| crate::holder::restart_workload(&root))
    {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(%uid, holder = holder.pid, error = %e, "the holder's restart file was not read: a restart of the adopted container will not start the workload");
            None
        }
    }
}

fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<(), Status> {
    write_manifest_as(dir, "manifest.json", manifest)
}

fn write_manifest_as(dir: &Path, name: &str, manifest: &Manifest) -> Result<(), Status> {
    std::fs::write(
        dir.join(name),
        serde_json::to_vec(manifest).expect("manifest"),
    )
    .map_err(io_internal)
}

/// Resumes the source `m` froze if it is still frozen `m.freeze_limit` from now
/// (tokio's clock is monotonic): neither Commit nor Abort claimed the freeze.
fn start_freeze_watchdog(
    frozen: &StdMutex<Vec<FrozenSource>>,
    margin: std::time::Duration,
    m: &Migration,
) {
    let (freeze, broker, uid, limit) = (
        Arc::clone(&m.freeze),
        Arc::clone(&m.broker),
        m.uid.clone(),
        m.freeze_limit,
    );
    let process = m.process;
    frozen.lock().expect("frozen").push(FrozenSource {
        freeze: Arc::clone(&freeze),
        broker: Arc::clone(&broker),
        uid: uid.clone(),
        process,
        since: std::time::Instant::now(),
        budget: limit.saturating_sub(margin),
    });
    let watch = watch_freeze(freeze, broker, uid, process, limit, WATCHDOG_RETRY);
    tokio::spawn(watch);
}

/// How the freeze watchdog retries a resume or kill that failed: after `first`, then
/// twice as long after each failure, at most `max` apart.
#[derive(Clone, Copy, Debug)]
pub(super) struct Backoff {
    pub(super) first: Duration,
    pub(super) max: Duration,
}

const WATCHDOG_RETRY: Backoff = Backoff {
    first: Duration::from_secs(1),
    max: Duration::from_secs(10),
};

/// The freeze watchdog: `limit` from now, resumes the source if it is still frozen,
/// or kills it if it is fenced. A failed resume or kill (the broker busy, an `ip`
/// step failing) is tried again, with `retry`'s backoff, for as long as the freeze
/// stays unclaimed; a freeze another call holds for a moment (a fence being taken, an
/// abort's thaw that may fail and give it back) is waited for. It stops as soon as
/// Commit, Abort, Fence or shutdown has claimed the freeze (each attempt starts with
/// the atomic claim), and gives up only where no retry can succeed (see
/// [`hopeless`]).
pub(super) async fn watch_freeze(
    freeze: Arc<Freeze>,
    broker: Arc<StdMutex<BrokerClient>>,
    uid: MigrationUid,
    process: ProcRef,
    limit: Duration,
    retry: Backoff,
) {
    tokio::time::sleep(limit).await;
    let limit_ms = limit.as_millis() as u64;
    let mut delay = retry.first;
    let mut failures = 0u32;
    // The state last announced in the log (once each, not at every retry).
    let mut announced = None;
    loop {
        let state = freeze.get();
        let first = announced.replace(state) != Some(state);
        let attempt = match state {
            FROZEN | FENCED => {
                end_freeze(&freeze, &broker, &uid, process, state, first, limit_ms).await
            }
            FENCING | THAWING | KILLING => {
                tokio::time::sleep(retry.first).await;
                continue;
            }
            _ => return,
        };
        match attempt {
            Ok(true) => return,
            // Claimed in between: the next look says by what.
            Ok(false) => {}
            Err(e) => {
                failures += 1;
                if let Some(why) = hopeless(&broker, process).await {
                    tracing::error!(%uid, error = %e, failures, why = why.explain(), "freeze watchdog gave up");
                    crate::metrics::global().watchdog_gave_up(why.label());
                    freeze.give_up();
                    return;
                }
                tracing::warn!(%uid, error = %e, failures, retry_in_ms = delay.as_millis() as u64, "freeze watchdog could not resume or kill the source; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(retry.max);
            }
        }
    }
}

/// One attempt of the watchdog on a freeze in `state` (`FROZEN`: resume it; `FENCED`:
/// kill it), announced in the log the `first` time; counted when it acted.
async fn end_freeze(
    freeze: &Arc<Freeze>,
    broker: &Arc<StdMutex<BrokerClient>>,
    uid: &MigrationUid,
    process: ProcRef,
    state: u8,
    first: bool,
    limit_ms: u64,
) -> Result<bool, Status> {
    let metrics = crate::metrics::global();
    if state == FENCED && freeze.serving_pages() {
        // PostCopy: the target's copy still fetches its pages from this tree.
        if first {
            tracing::warn!(%uid, limit_ms, "freeze watchdog: the fenced source is past its budget but still serves its target's pages; it is killed once its session ends");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        return Ok(false);
    }
    if state == FENCED {
        if first {
            tracing::warn!(%uid, limit_ms, "freeze watchdog: the fenced source is still frozen past its budget and margin; killing it (restore fence: its copy may run on the target, it is never resumed)");
        }
        let r = kill_fenced(freeze, broker, uid, process).await;
        if let Ok(true) = r {
            metrics.watchdog_killed();
        }
        return r;
    }
    if first {
        tracing::warn!(%uid, limit_ms, "freeze watchdog: the source is still frozen past its budget and margin; resuming it");
    }
    let r = thaw_frozen(freeze, broker, uid).await;
    if let Ok(true) = r {
        metrics.watchdog_resumed();
    }
    r
}

/// Why no retry of the freeze watchdog can succeed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GaveUp {
    // In the order of `metrics::WATCHDOG_GAVE_UP`.
    /// The broker closed this migration's connection, the lease every broker op of the
    /// migration needs: the broker itself rolls the source back, or kills it if
    /// fenced (when the lease ends, or from its journal when it starts again).
    BrokerLeaseEnded,
    /// The source process is gone: nothing is frozen any more.
    SourceGone,
}

impl GaveUp {
    /// Its `reason` label in the metrics.
    pub(super) fn label(self) -> &'static str {
        crate::metrics::WATCHDOG_GAVE_UP[self as usize]
    }

    fn explain(self) -> &'static str {
        match self {
            GaveUp::BrokerLeaseEnded => {
                "the broker closed this migration's connection (its lease): the broker rolls the source back, or kills it if fenced, itself"
            }
            GaveUp::SourceGone => "the source process is gone",
        }
    }
}

/// After a failed resume or kill: why retrying cannot succeed, if it cannot.
async fn hopeless(broker: &Arc<StdMutex<BrokerClient>>, process: ProcRef) -> Option<GaveUp> {
    let b = Arc::clone(broker);
    let closed = blocking(move || Ok(b.lock().expect("broker client").closed()))
        .await
        .unwrap_or(false);
    if closed {
        Some(GaveUp::BrokerLeaseEnded)
    } else if procfs::check_live(process).is_err() {
        Some(GaveUp::SourceGone)
    } else {
        None
    }
}

/// The workload's TCP sockets, by the addresses the broker reads of them (it passes
/// no descriptor).
async fn inventory(m: &Migration) -> Result<Vec<SocketReport>, Status> {
    let Reply::Sockets { sockets } = m
        .broker(Request::ListSockets { uid: m.uid.clone() })
        .await?
    else {
        return Err(Status::internal("unexpected broker reply"));
    };
    Ok(sockets.iter().map(socket_report).collect())
}

/// One socket of the report, not yet migrated: its addresses as `ip:port` (`[ip]:port`
/// for IPv6), empty where there is none (a listener's peer).
fn socket_report(s: &SocketAddrs) -> SocketReport {
    let text = |a: Option<std::net::SocketAddr>| a.map(|a| a.to_string()).unwrap_or_default();
    SocketReport {
        local: text(s.local),
        remote: text(s.remote),
        listening: s.listening,
        outcome: SocketOutcome::Pending as i32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    #[test]
    fn a_pod_not_quiet_at_first_is_looked_at_again_once_a_quiet_one_up_to_the_limit() {
        // Quiet each time: looked at after every lock until RELOCKS lifts.
        assert!((0..RELOCKS).all(|r| look_again(true, r)));
        assert!(!look_again(true, RELOCKS));
        // Not quiet within the first quiesce (a busy node): once.
        assert!(look_again(false, 0));
        // Still not quiet after a relock's longer quiesce: a stream, locked as it is.
        assert!(!look_again(false, 1));
    }

    /// The report's text is what the agent printed when it read the addresses off the
    /// descriptors itself (nix's `SockaddrStorage`), so the operator and the manifest
    /// see the same strings: `ip:port`, `[ip]:port`, the IPv6 scope kept.
    #[test]
    fn a_socket_is_reported_by_the_address_text_it_always_had() {
        use nix::sys::socket::SockaddrStorage;
        for (local, remote) in [
            ("198.18.0.5:8080", Some("198.51.100.7:41000")),
            ("[::1]:80", Some("[2001:db8::7]:41000")),
            ("[fe80::1%3]:8443", Some("[::ffff:10.0.0.9]:41000")),
            ("0.0.0.0:80", None),
        ] {
            let at = |s: &str| s.parse::<SocketAddr>().unwrap();
            let r = socket_report(&SocketAddrs {
                local: Some(at(local)),
                remote: remote.map(at),
                listening: remote.is_none(),
            });
            assert_eq!(r.local, local);
            assert_eq!(r.local, SockaddrStorage::from(at(local)).to_string());
            assert_eq!(r.remote, remote.unwrap_or(""));
            assert_eq!(r.listening, remote.is_none());
            assert_eq!(r.outcome, SocketOutcome::Pending as i32);
        }
        let unknown = socket_report(&SocketAddrs {
            local: None,
            remote: None,
            listening: false,
        });
        assert_eq!((unknown.local.as_str(), unknown.remote.as_str()), ("", ""));
    }

    /// A tmpfs mounted for a test, detached on drop.
    struct Tmpfs(PathBuf);

    impl Tmpfs {
        fn mount(at: &Path, size: &str) -> Tmpfs {
            use nix::mount::{MsFlags, mount};
            std::fs::create_dir_all(at).unwrap();
            mount(
                Some("tmpfs"),
                at,
                Some("tmpfs"),
                MsFlags::empty(),
                Some(format!("size={size},mode=0700").as_str()),
            )
            .expect("mounting a tmpfs (the agent's tests run as root)");
            Tmpfs(at.to_owned())
        }
    }

    impl Drop for Tmpfs {
        fn drop(&mut self) {
            let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
        }
    }

    /// A source to dump: a `sleep` child, killed and reaped on drop.
    struct Sleeper(std::process::Child);

    impl Drop for Sleeper {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// The state letter of `/proc/<pid>/stat` (`T`: stopped).
    fn state(pid: i32) -> char {
        let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        st.rsplit_once(')')
            .unwrap()
            .1
            .trim_start()
            .chars()
            .next()
            .unwrap()
    }

    /// A Cold final dump into a checkpoint volume without room for it is refused
    /// before the network lock and the freeze: the broker is asked nothing after the
    /// registration, CRIU (absent here) is never run, the source keeps running and the
    /// migration stays prepared.
    #[tokio::test]
    async fn a_final_dump_without_room_is_refused_before_the_source_is_frozen() {
        use super::super::prepare_tests::{UID, agent};
        use super::super::testkit::{Answer, FakeBroker, Scratch};
        use podmotion_wire::agent::{Phase, PrepareRequest, Role};

        let d = Scratch::new("dump-room");
        let volume = Tmpfs::mount(&d.0.join("checkpoints"), "1m");
        // Filled up: whatever the sleeper's memory, it cannot fit.
        let mut filler = std::fs::File::create(volume.0.join("filler")).unwrap();
        while std::io::Write::write_all(&mut filler, &[7u8; 64 << 10]).is_ok() {}
        drop(filler);
        let source = Sleeper(
            std::process::Command::new("sleep")
                .arg("600")
                .spawn()
                .unwrap(),
        );
        let pid = source.0.id() as i32;
        let broker = FakeBroker::start(&d.0, |r| match r {
            Request::Register { .. } => Answer::Reply(Reply::Registered {
                cgroup: "/pods/src".into(),
            }),
            _ => Answer::Reply(Reply::Done),
        });
        let a = agent(&d.0, broker.socket.clone());
        std::fs::write(d.0.join("containers"), format!("c1 {pid}\n")).unwrap();
        a.prepare_impl(PrepareRequest {
            migration_uid: UID.into(),
            role: Role::Source as i32,
            transfer_key: vec![7; podmotion_wire::transfer::KEY_LEN],
            peer_node: "node-b".into(),
            container_ids: vec!["c1".into()],
            ..Default::default()
        })
        .await
        .unwrap();

        let e = a.dump_impl(UID).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
        assert!(
            e.message().starts_with(
                "the checkpoint volume has 0 MiB free, but the final dump needs about "
            ) && e
                .message()
                .contains("(the process tree's memory, plus 10%)")
                && e.message().contains("migrationAgent.checkpointSizeLimit"),
            "{e}"
        );
        assert_eq!(broker.ops(), ["register"], "the network was locked");
        assert_ne!(state(pid), 'T', "the source was left stopped");
        let st = a.get(UID).unwrap().lock().await.status();
        assert_eq!(st.phase, Phase::Prepared as i32);
        assert_eq!(st.timings.unwrap_or_default().freeze_started_us, 0);
        assert!(!volume.0.join(UID).join("final").exists());
    }
}
