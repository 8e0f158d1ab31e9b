//! The final dump on the source, from the network lock on: the tree left stopped, its
//! freeze recorded and watched (see [`super::FreezeWatchdog`]), and the manifest the
//! target restores from.

use super::{
    FENCED, FENCING, FROZEN, Freeze, FrozenSource, KILLING, Migration, Phase, THAWING, blocking,
    broker_status, io_internal, kill_fenced, now_us, run_criu, thaw_frozen,
};
use crate::criu::{self, Criu, Opts};
use crate::images;
use podmotion_broker::client::BrokerClient;
use podmotion_wire::agent::{
    Manifest, ManifestSocket, MigrationStatus, SocketOutcome, SocketReport,
};
use podmotion_wire::broker::Request;
use podmotion_wire::ids::{MigrationUid, ProcRef};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Instant;
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
    tokio::spawn(watch_freeze(freeze, broker, uid, process, limit));
}

/// The freeze watchdog: `limit` from now, resumes the source if it is still frozen,
/// or kills it if it is fenced.
async fn watch_freeze(
    freeze: Arc<Freeze>,
    broker: Arc<StdMutex<BrokerClient>>,
    uid: MigrationUid,
    process: ProcRef,
    limit: std::time::Duration,
) {
    tokio::time::sleep(limit).await;
    // A failed resume or kill (the broker busy or restarting) is tried again, and
    // so is a freeze another call holds for a moment (a fence being taken, an
    // abort's thaw that may fail and give it back).
    for _ in 0..30 {
        match freeze.get() {
            FROZEN => {
                tracing::warn!(%uid, limit_ms = limit.as_millis() as u64, "freeze watchdog: the source is still frozen past its budget and margin; resuming it");
                match thaw_frozen(&freeze, &broker, &uid).await {
                    Ok(true) => {
                        crate::metrics::global().watchdog_resumed();
                        return;
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::error!(%uid, error = %e, "freeze watchdog could not resume the source; retrying")
                    }
                }
            }
            FENCED => {
                tracing::warn!(%uid, limit_ms = limit.as_millis() as u64, "freeze watchdog: the fenced source is still frozen past its budget and margin; killing it (restore fence: its copy may run on the target, it is never resumed)");
                match kill_fenced(&freeze, &broker, &uid, process).await {
                    Ok(true) => {
                        crate::metrics::global().watchdog_killed();
                        return;
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::error!(%uid, error = %e, "freeze watchdog could not kill the fenced source; retrying")
                    }
                }
            }
            FENCING | THAWING | KILLING => {}
            _ => return,
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// The workload's TCP sockets, duplicated to us by the broker.
async fn inventory(m: &Migration) -> Result<Vec<SocketReport>, Status> {
    let b = Arc::clone(&m.broker);
    let uid = m.uid.clone();
    blocking(move || {
        let fds = b
            .lock()
            .expect("broker client")
            .sockets(&uid)
            .map_err(broker_status)?;
        use nix::sys::socket::{
            SockaddrStorage, getpeername, getsockname, getsockopt, sockopt::AcceptConn,
        };
        use std::os::fd::AsRawFd;
        let mut out = Vec::new();
        for fd in fds {
            let listening = getsockopt(&fd, AcceptConn).unwrap_or(false);
            let local = getsockname::<SockaddrStorage>(fd.as_raw_fd())
                .map(|a| a.to_string())
                .unwrap_or_default();
            let remote = if listening {
                String::new()
            } else {
                getpeername::<SockaddrStorage>(fd.as_raw_fd())
                    .map(|a| a.to_string())
                    .unwrap_or_default()
            };
            out.push(SocketReport {
                local,
                remote,
                listening,
                outcome: SocketOutcome::Pending as i32,
            });
        }
        Ok(out)
    })
    .await
}
