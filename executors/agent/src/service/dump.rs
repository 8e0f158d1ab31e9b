//! The final dump on the source, from the network lock on: the tree left stopped, its
//! freeze recorded and watched (see [`super::FreezeWatchdog`]), and the manifest the
//! target restores from.

use super::{
    FENCED, FENCING, FROZEN, Freeze, FrozenSource, KILLING, Migration, Phase, THAWING, blocking,
    io_internal, kill_fenced, now_us, run_criu, thaw_frozen,
};
use crate::criu::{self, Criu, Opts};
use crate::images;
use podmotion_broker::client::BrokerClient;
use podmotion_broker::procfs;
use podmotion_wire::agent::{
    Manifest, ManifestSocket, MigrationStatus, SocketOutcome, SocketReport,
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
}

/// One pre-copy round (see [`super::Agent::pre_dump_impl`]).
pub(super) struct PreDumpRound {
    /// A CRIU pre-dump (memory tracking), or a full dump leaving the tree running.
    pub(super) kind: i32,
    pub(super) opts: Opts,
    /// The round's directory (`pre-<n>`).
    pub(super) dir: PathBuf,
    pub(super) criu: Criu,
}

/// A pre-copy round, run by a task that owns the migration until CRIU is done.
pub(super) async fn pre_dump_locked(
    mut m: tokio::sync::OwnedMutexGuard<Migration>,
    r: PreDumpRound,
) -> Result<MigrationStatus, Status> {
    let t = Instant::now();
    run_criu(r.criu, r.kind, r.opts, r.dir.join("pre-dump.log")).await?;
    m.timings.last_round_us = t.elapsed().as_micros() as u64;
    m.timings.pre_dump_total_us += m.timings.last_round_us;
    m.timings.last_pre_dump_us = now_us();
    m.iteration += 1;
    m.phase = Phase::PreDumping;
    m.last_round_bytes = images::size(&r.dir);
    m.image_bytes = images::size(&m.dir);
    Ok(m.status())
}

/// The final dump from the network lock on, run by a task that owns the migration.
pub(super) async fn dump_locked(
    mut m: tokio::sync::OwnedMutexGuard<Migration>,
    d: DumpOutcome,
) -> Result<MigrationStatus, Status> {
    m.timings.freeze_started_us = now_us();
    let t = Instant::now();
    let sockets = lock_network(&m).await?;
    let dir = d.dir;
    if let Err(e) = run_criu(d.criu, criu::REQ_DUMP, d.opts, dir.join("dump.log")).await {
        // CRIU resumed the tree and its sockets on failure; reopen the network.
        let _ = m
            .broker(Request::UnlockNetwork { uid: m.uid.clone() })
            .await;
        let _ = images::zeroize(&dir);
        m.timings.freeze_started_us = 0;
        return Err(e);
    }
    m.timings.dump_us = t.elapsed().as_micros() as u64;
    m.timings.dump_finished_us = now_us();
    // The tree is stopped: the freeze is recorded and watched from this instant, even
    // if what follows fails.
    m.freeze.set(FROZEN);
    start_freeze_watchdog(&d.frozen, d.margin, &m);
    let manifest = dump_manifest(&m, &sockets, d.external_mounts, d.stdio_pipes);
    write_manifest(&m.dir, &manifest)?;
    m.sockets = sockets;
    m.final_dump_bytes = images::size(&dir);
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

/// Locks the pod's network and lists its sockets. Network first: from here nothing
/// reaches or leaves the pod, so no segment is acknowledged after the socket state is
/// captured. Sockets that cannot be listed reopen the network.
async fn lock_network(m: &Migration) -> Result<Vec<SocketReport>, Status> {
    m.broker(Request::LockNetwork { uid: m.uid.clone() })
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
        sockets: sockets
            .iter()
            .map(|s| ManifestSocket {
                local: s.local.clone(),
                remote: s.remote.clone(),
                listening: s.listening,
            })
            .collect(),
        tcp: m.tcp as i32,
        external_mounts,
        stdio_pipes,
        workload: m.fs.as_ref().and_then(|fs| fs.workload.clone()),
    }
}

fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<(), Status> {
    std::fs::write(
        dir.join("manifest.json"),
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
}
