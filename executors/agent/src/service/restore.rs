//! `Restore` on the target: the received tree restored by CRIU into the pod's network
//! namespace (a container's inside its holder), and never a process of it left
//! running after a restore that failed (see [`super::state::kill_restored`]).

use super::helpers::{NETNS_KEY, blocking, broker_call_blocking, criu_status, io_status, now_us};
use super::manifest::{final_dir, read_manifest, read_manifest_named};
use super::post_copy;
use super::state::{Config, Migration, kill_restored};
use crate::admission::{Admission, Step, admit};
use crate::containers::ContainerFs;
use crate::criu::{self, Criu, Opts, Req};
use crate::{images, mounts};
use podmotion_broker::client::BrokerClient;
use podmotion_broker::procfs;
use podmotion_wire::agent::{
    HOLDER_RESTART, Manifest, ManifestSocket, MigrationStatus, Phase, SocketOutcome, SocketReport,
    TcpPreservation,
};
use podmotion_wire::broker::{Reply, Request};
use podmotion_wire::ids::{MigrationUid, ProcRef};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Instant;
use tonic::Status;

/// The body of `Restore`, run by a task that owns the migration (see
/// [`super::Agent::restore_impl`]).
pub(super) async fn restore_locked(
    cfg: Arc<Config>,
    mut m: tokio::sync::OwnedMutexGuard<Migration>,
    mm: Arc<tokio::sync::Mutex<Migration>>,
) -> Result<MigrationStatus, Status> {
    if admit(m.role, m.phase, Step::Restore)? == Admission::Done {
        return Ok(m.status());
    }
    let (manifest, part_manifests, pod_manifest) = read_manifests(&m)?;
    let (mut run, dir, preserve) = plan_run(&cfg, &mut m, &manifest, &pod_manifest).await?;
    // PostCopy: the daemon that fills the restored memory from the source, on the
    // session the source opened, listening before CRIU starts.
    let daemon = match lazy_daemon(&m, &dir).await {
        Ok(d) => d,
        Err(e) => {
            m.release_adopted().await;
            return Err(e);
        }
    };
    if daemon.is_some() {
        run.opts.lazy_pages = Some(true);
    }
    let holder_pid = run.container.is_some().then_some(m.process.pid);
    tracing::info!(uid = %m.uid, holder = ?holder_pid, root = ?run.opts.root, "restoring");
    let log = dir.join("restore.log");
    let restored = match restore_tree(&mut m, cfg.criu.clone(), log, run, holder_pid).await {
        Ok(r) => r,
        Err(e) => {
            // Given back already where the restore had to be undone (a holder's);
            // CRIU's own rollback leaves nothing of the tree.
            m.release_adopted().await;
            if let Some(mut d) = daemon {
                let _ = d.kill();
                let _ = d.wait();
            }
            return Err(e);
        }
    };
    let holder = holder_pid.is_some();
    place_copy(&cfg, &mut m, restored, holder, &part_manifests, preserve).await?;
    write_restart_file(&m, &manifest);
    m.sockets = restored_sockets(&pod_manifest.sockets, preserve);
    release_images(&mut m, daemon, mm, dir);
    m.phase = Phase::Restored;
    tracing::info!(
        uid = %m.uid,
        pid = restored.pid,
        restore_ms = m.timings.restore_us / 1000,
        "restored"
    );
    Ok(m.status())
}

/// The first container's manifest, the pod's other containers' and the pod's (the
/// first's with every container's sockets): the connections of every container decide
/// whether they are kept (one network namespace, one decision).
fn read_manifests(m: &Migration) -> Result<(Manifest, Vec<Manifest>, Manifest), Status> {
    let manifest = read_manifest(&m.dir)?;
    let part_manifests = m
        .parts
        .iter()
        .map(|p| read_manifest_named(&m.dir, &p.layout.manifest()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut pod_manifest = manifest.clone();
    for pm in &part_manifests {
        pod_manifest.sockets.extend(pm.sockets.iter().cloned());
    }
    Ok((manifest, part_manifests, pod_manifest))
}

/// The restore's run, its final image dir and whether connections are preserved: the
/// addresses of the pod's namespace, those taken over for it (given back if the run
/// cannot be made).
async fn plan_run(
    cfg: &Config,
    m: &mut Migration,
    manifest: &Manifest,
    pod_manifest: &Manifest,
) -> Result<(RestoreRun, PathBuf, bool), Status> {
    let Reply::Addrs { mut addrs } = m.broker(Request::NetnsAddrs { uid: m.uid.clone() }).await?
    else {
        return Err(Status::internal("unexpected broker reply"));
    };
    let tcp = effective_tcp(manifest, m.tcp);
    adopt_addresses(m, pod_manifest, tcp, &mut addrs).await;
    let run = tcp_preserved(pod_manifest, tcp, &addrs).and_then(|preserve| {
        let dir = final_dir(&m.dir, manifest)?;
        Ok((
            restore_run(cfg, m, manifest, &dir, preserve)?,
            dir,
            preserve,
        ))
    });
    if run.is_err() {
        m.release_adopted().await;
    }
    run
}

/// The restored copy runs: recorded, moved into the pod's cgroup, and the pod's other
/// containers restored beside it. From here every failure kills it before answering.
async fn place_copy(
    cfg: &Arc<Config>,
    m: &mut Migration,
    restored: ProcRef,
    holder: bool,
    part_manifests: &[Manifest],
    preserve: bool,
) -> Result<(), Status> {
    m.restored = Some(restored);
    if let Err(e) = m
        .broker(Request::MoveCgroup {
            uid: m.uid.clone(),
            process: restored,
        })
        .await
    {
        return Err(undo_restore(m, holder, e).await);
    }
    if let Err(e) = restore_parts(cfg, m, part_manifests, preserve).await {
        return Err(undo_restore(m, holder, e).await);
    }
    Ok(())
}

/// The images once the copy runs: PostCopy's daemon reads them until every page is
/// in (and zeroizes them when it is done); otherwise they go now.
fn release_images(
    m: &mut Migration,
    daemon: Option<std::process::Child>,
    mm: Arc<tokio::sync::Mutex<Migration>>,
    dir: PathBuf,
) {
    match (daemon, m.lazy_target.clone()) {
        // PostCopy: the daemon reads the images until every page is in; it zeroizes
        // them when it is done.
        (Some(d), Some(t)) => post_copy::target::watch_daemon(d, t, mm, dir),
        _ => {
            // The images are no longer needed: do not keep the workload's memory around.
            let _ = images::zeroize(&m.dir);
            m.image_bytes = 0;
        }
    }
}

/// PostCopy: `criu lazy-pages` for the images in `dir`, started when the source opened its
/// session, once it listens; `None` for the other modes.
async fn lazy_daemon(m: &Migration, dir: &Path) -> Result<Option<std::process::Child>, Status> {
    if !m.post_copy {
        return Ok(None);
    }
    let daemon = m
        .lazy_target
        .as_ref()
        .and_then(|t| t.take_daemon())
        .ok_or_else(|| {
            Status::failed_precondition(
                "PostCopy: the source has not opened its lazy-pages session (or a restore already used it)",
            )
        })?;
    post_copy::daemon_listening(daemon, dir).await.map(Some)
}

/// The preservation the restore runs under: the manifest's (what the source dumped
/// for), else the migration's.
fn effective_tcp(manifest: &Manifest, tcp: TcpPreservation) -> TcpPreservation {
    TcpPreservation::try_from(manifest.tcp).unwrap_or(tcp)
}

/// The local addresses of the dumped established connections that the target's
/// namespace lacks (`addrs`), each once, in the manifest's order.
fn missing_addresses(manifest: &Manifest, addrs: &[String]) -> Vec<std::net::IpAddr> {
    let mut out = Vec::new();
    for s in manifest.sockets.iter().filter(|s| !s.listening) {
        if let Ok(a) = s.local.parse::<std::net::SocketAddr>()
            && !addrs.contains(&a.ip().to_string())
            && !out.contains(&a.ip())
        {
            out.push(a.ip());
        }
    }
    out
}

/// Unless the preservation is `None`, asks the broker to take over the source pod's
/// addresses that the dumped connections use (the installer's address hand-over) and
/// adds what it took to `addrs`. A node without the hand-over (`handover_off`), an
/// address outside its CIDRs or a failure stops there: the connections are then
/// closed cleanly, or the restore is refused under `Strict` ([`tcp_preserved`]).
async fn adopt_addresses(
    m: &mut Migration,
    manifest: &Manifest,
    tcp: TcpPreservation,
    addrs: &mut Vec<String>,
) {
    if tcp == TcpPreservation::None {
        return;
    }
    for address in missing_addresses(manifest, addrs) {
        let req = Request::AdoptAddress {
            uid: m.uid.clone(),
            address,
        };
        match m.broker(req).await {
            Ok(_) => {
                tracing::info!(uid = %m.uid, %address, "the source's address was taken over");
                m.adopted.push(address);
                addrs.push(address.to_string());
            }
            Err(e) => {
                tracing::info!(uid = %m.uid, %address, error = %e.message(), "the source's address was not taken over: its connections cannot be kept");
                return;
            }
        }
    }
}

/// Whether the restore keeps the established connections (`addrs`: the target
/// namespace's addresses): under the manifest's preservation (else `tcp`, see
/// [`effective_tcp`]), unless it is `None`, if every established socket's local
/// address moved to the target (one it cannot parse never did).
/// `Strict` refuses a restore that would not keep them.
fn tcp_preserved(
    manifest: &Manifest,
    tcp: TcpPreservation,
    addrs: &[String],
) -> Result<bool, Status> {
    let ip_of = |s: &str| {
        s.parse::<std::net::SocketAddr>()
            .map(|a| a.ip().to_string())
            .unwrap_or_default()
    };
    let moved = manifest
        .sockets
        .iter()
        .filter(|s| !s.listening)
        .all(|s| addrs.contains(&ip_of(&s.local)));
    let tcp = effective_tcp(manifest, tcp);
    let preserve = tcp != TcpPreservation::None && moved;
    if tcp == TcpPreservation::Strict && !moved {
        return Err(Status::failed_precondition(
            "Strict TCP preservation: the pod address did not move to the target; refusing to restore",
        ));
    }
    Ok(preserve)
}

/// What CRIU's restore runs with: its options and the descriptors it inherits, which
/// stay open until it has run.
struct RestoreRun {
    opts: Opts,
    ns_fd: OwnedFd,
    /// A container's (see [`container_restore`]).
    container: Option<Vec<OwnedFd>>,
}

/// The restore's options: into the target's network namespace, connections restored
/// (`preserve`) or closed.
fn restore_run(
    cfg: &Config,
    m: &Migration,
    manifest: &Manifest,
    dir: &Path,
    preserve: bool,
) -> Result<RestoreRun, Status> {
    restore_run_into(
        cfg,
        m,
        m.process.pid,
        m.fs.as_ref(),
        manifest,
        dir,
        preserve,
    )
}

/// [`restore_run`] into the container whose PID 1 is `holder_pid` (its mounts `fs`).
fn restore_run_into(
    cfg: &Config,
    m: &Migration,
    holder_pid: i32,
    fs: Option<&ContainerFs>,
    manifest: &Manifest,
    dir: &Path,
    preserve: bool,
) -> Result<RestoreRun, Status> {
    let netns = m
        .netns_path
        .clone()
        .ok_or_else(|| Status::internal("target netns not bound"))?;
    // Not close-on-exec: criu swrk inherits it and finds it by number.
    let ns_fd = nix::fcntl::open(
        netns.as_str(),
        nix::fcntl::OFlag::O_RDONLY,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| Status::internal(format!("open {netns}: {e}")))?;
    let mut o = Opts::new(dir, "restore.log");
    o.inherit_fd = vec![criu::InheritFd {
        key: NETNS_KEY.into(),
        fd: ns_fd.as_raw_fd(),
    }];
    // A container: its mounts bound to the holder's, its root the holder's root
    // filesystem, its pipes to the runtime the holder's own, and CRIU run inside
    // the holder's PID namespace (crate::pidns).
    let container = container_restore(cfg, holder_pid, fs, manifest, &mut o)?;
    if preserve {
        o.tcp_established = Some(true);
    } else {
        o.tcp_close = Some(true);
    }
    Ok(RestoreRun {
        opts: o,
        ns_fd,
        container,
    })
}

/// The pod's other containers, restored after the first, each into the target
/// container of its name (inside its holder), in the same network namespace, moved
/// into its holder's cgroups and charged to its pod. The first failure is returned;
/// the caller undoes every restore ([`undo_restore`]). The freeze lasts until the last
/// one runs: `resumed_us` and `restore_us` cover them all.
async fn restore_parts(
    cfg: &Arc<Config>,
    m: &mut Migration,
    manifests: &[Manifest],
    preserve: bool,
) -> Result<(), Status> {
    if m.parts.is_empty() {
        return Ok(());
    }
    let started = Instant::now();
    for (i, manifest) in manifests.iter().enumerate() {
        let (name, lease, fs) = {
            let p = &m.parts[i];
            (p.name.clone(), p.lease.clone(), p.fs.clone())
        };
        let named = |e: Status| Status::new(e.code(), format!("container {name}: {}", e.message()));
        let dir = final_dir(&m.dir, manifest).map_err(named)?;
        let run = restore_run_into(
            cfg,
            m,
            lease.process.pid,
            fs.as_ref(),
            manifest,
            &dir,
            preserve,
        )
        .map_err(named)?;
        let holder_pid = run.container.is_some().then_some(lease.process.pid);
        tracing::info!(uid = %m.uid, container = %name, holder = ?holder_pid, "restoring the pod's container");
        let charge = holder_pid.map(|_| (Arc::clone(&lease.broker), lease.uid.clone()));
        let resp = run_restore(
            cfg.criu.clone(),
            dir.join("restore.log"),
            run,
            holder_pid,
            charge,
        )
        .await
        .map_err(named)?;
        let criu_pid = resp.restore.map(|r| r.pid).unwrap_or(0);
        let restored = find_restored(criu_pid, holder_pid).map_err(named)?;
        m.parts[i].restored = Some(restored);
        lease
            .call(Request::MoveCgroup {
                uid: lease.uid.clone(),
                process: restored,
            })
            .await
            .map_err(named)?;
        write_restart_file_of(&m.uid, lease.process.pid, fs.as_ref(), manifest);
    }
    m.timings.resumed_us = now_us();
    m.timings.restore_us += started.elapsed().as_micros() as u64;
    Ok(())
}

/// Runs the restore and finds its root; a restore that fails leaves no process of it
/// running (see [`undo_restore`]).
async fn restore_tree(
    m: &mut Migration,
    criu: Criu,
    log: PathBuf,
    run: RestoreRun,
    holder_pid: Option<i32>,
) -> Result<ProcRef, Status> {
    m.timings.restore_started_us = now_us();
    let t = Instant::now();
    let charge = holder_pid.map(|_| (Arc::clone(&m.broker), m.uid.clone()));
    let resp = match run_restore(criu, log, run, holder_pid, charge).await {
        Ok(r) => r,
        Err(e) => {
            // CRIU kills what it forked when it fails (its own rollback). In a
            // holder's PID namespace anything it left (CRIU itself killed
            // mid-restore) is below the holder: end it all before answering.
            if holder_pid.is_some() {
                return Err(undo_restore(m, true, e).await);
            }
            return Err(e);
        }
    };
    m.timings.resumed_us = now_us();
    m.timings.restore_us = t.elapsed().as_micros() as u64;
    let criu_pid = resp.restore.map(|r| r.pid).unwrap_or(0);
    match find_restored(criu_pid, holder_pid) {
        Ok(p) => Ok(p),
        Err(e) => Err(undo_restore(m, holder_pid.is_some(), e).await),
    }
}

/// Runs CRIU's restore (inside the holder's PID namespace for a container), then
/// closes the descriptors it inherited. For a container, `charge` (the migration's
/// broker lease and UID) has the broker move CRIU's launcher into the pod's memory
/// cgroup before CRIU starts: memory is charged to the cgroup that first touches it
/// and stays there when its process moves, so the restored workload would otherwise
/// stay charged to the agent's container (its limit, not the pod's, would bound it).
async fn run_restore(
    criu: Criu,
    log: PathBuf,
    run: RestoreRun,
    holder_pid: Option<i32>,
    charge: Option<(Arc<StdMutex<BrokerClient>>, MigrationUid)>,
) -> Result<criu::Resp, Status> {
    blocking(move || {
        let RestoreRun {
            opts,
            ns_fd,
            container,
        } = run;
        let mut to_pod = |pid: i32| -> Result<(), String> {
            let Some((broker, uid)) = &charge else {
                return Ok(());
            };
            let process = ProcRef {
                pid,
                start_time: procfs::start_time(pid).map_err(|e| e.to_string())?,
            };
            broker_call_blocking(
                broker,
                Request::ChargeRestore {
                    uid: uid.clone(),
                    process,
                },
            )
            .map(|_| ())
            .map_err(|e| {
                format!(
                    "charging the restore to the pod's memory cgroup: {}",
                    e.message()
                )
            })
        };
        let r = criu
            .call_in(
                Req {
                    r#type: criu::REQ_RESTORE,
                    opts: Some(opts),
                },
                Some(&log),
                holder_pid,
                Some(&mut to_pod),
            )
            .map_err(criu_status);
        drop(ns_fd);
        drop(container);
        r
    })
    .await
}

/// The restored root, pinned, from the PID CRIU reported. CRIU run inside the holder's
/// PID namespace reports the restored root's PID there; it is now the holder's child
/// (CRIU has exited).
fn find_restored(criu_pid: i32, holder_pid: Option<i32>) -> Result<ProcRef, Status> {
    let pid = match holder_pid {
        Some(h) => procfs::child_by_ns_pid(h, criu_pid),
        None => Some(criu_pid),
    };
    pid.and_then(|pid| {
        Some(ProcRef {
            pid,
            start_time: procfs::start_time(pid).ok()?,
        })
    })
    .ok_or_else(|| {
        Status::internal(format!(
            "the restored root (pid {criu_pid} as CRIU reported it) is not to be found{}",
            holder_pid
                .map(|h| format!(" among the children of the holder {h}"))
                .unwrap_or_default()
        ))
    })
}

/// What the holder executes if the adopted container is started again (a container
/// whose manifest names its workload); only warned about if it cannot be written.
fn write_restart_file(m: &Migration, manifest: &Manifest) {
    write_restart_file_of(&m.uid, m.process.pid, m.fs.as_ref(), manifest)
}

/// [`write_restart_file`] for the container whose PID 1 is the holder `holder_pid`.
fn write_restart_file_of(
    uid: &MigrationUid,
    holder_pid: i32,
    fs: Option<&ContainerFs>,
    manifest: &Manifest,
) {
    if let (Some(_), Some(w)) = (fs, &manifest.workload) {
        let path = format!("/proc/{holder_pid}/root{HOLDER_RESTART}");
        let body = serde_json::to_vec(w).expect("workload");
        // Reached as the holder's user (crate::creds), with the agent's capabilities.
        let written = crate::creds::owner_of(holder_pid)
            .map_err(std::io::Error::other)
            .and_then(|o| crate::creds::as_owner(o, || std::fs::write(&path, &body)))
            .and_then(|r| r);
        if let Err(e) = written {
            tracing::warn!(%uid, path, error = %e, "restart file not written: a restart of the adopted container will not start the workload");
        }
    }
}

/// What became of each dumped socket: listeners are restored, connections preserved
/// or closed cleanly.
fn restored_sockets(sockets: &[ManifestSocket], preserve: bool) -> Vec<SocketReport> {
    sockets
        .iter()
        .map(|s| SocketReport {
            local: s.local.clone(),
            remote: s.remote.clone(),
            listening: s.listening,
            outcome: if s.listening {
                SocketOutcome::ListenerRestored
            } else if preserve {
                SocketOutcome::Preserved
            } else {
                SocketOutcome::ClosedCleanly
            } as i32,
        })
        .collect()
}

/// After a failed restore, no process of it may run: kills what it restored (see
/// [`kill_restored`]) and returns `e`, saying whether the kill was confirmed. An
/// unconfirmed kill keeps the copy recorded, so an `Abort` tries again (and fails
/// while it cannot confirm it: the operator then never thaws the source).
async fn undo_restore(m: &mut Migration, holder: bool, e: Status) -> Status {
    m.release_adopted().await;
    if let Err(k) = m.kill_restored_parts().await {
        tracing::error!(uid = %m.uid, error = %e.message(), kill = %k.message(), "restore failed and a container's copy could not be confirmed killed");
        return Status::new(
            e.code(),
            format!(
                "{}; a restored copy may still run: {}",
                e.message(),
                k.message()
            ),
        );
    }
    let root = m.restored;
    let holder = holder.then_some(m.process);
    match blocking(move || kill_restored(root, holder).map_err(Status::internal)).await {
        Ok(()) => {
            m.restored = None;
            tracing::warn!(uid = %m.uid, error = %e.message(), "restore failed; no restored process left");
            Status::new(
                e.code(),
                format!("{}; no restored process left", e.message()),
            )
        }
        Err(k) => {
            tracing::error!(uid = %m.uid, error = %e.message(), kill = %k.message(), "restore failed and its copy could not be confirmed killed");
            Status::new(
                e.code(),
                format!(
                    "{}; a restored copy may still run: {}",
                    e.message(),
                    k.message()
                ),
            )
        }
    }
}

/// Restore options for a container's dump (`None`: a process of the node's mount
/// namespace, restored as it was). Returns the descriptors CRIU inherits; they must
/// stay open until the restore has run.
fn container_restore(
    cfg: &Config,
    holder_pid: i32,
    fs: Option<&ContainerFs>,
    manifest: &Manifest,
    o: &mut Opts,
) -> Result<Option<Vec<OwnedFd>>, Status> {
    if manifest.external_mounts.is_empty() && fs.is_none() {
        return Ok(None);
    }
    let Some(fs) = fs else {
        return Err(Status::failed_precondition(
            "the source is a container but the target holder was not resolved through the container runtime",
        ));
    };
    let path = format!("/proc/{holder_pid}/mountinfo");
    let mi = std::fs::read_to_string(&path).map_err(|e| io_status("read", &path, &e))?;
    // The holder runs as the container's user: its fds are opened as that user.
    let owner = crate::creds::owner_of(holder_pid).map_err(Status::failed_precondition)?;
    let holder = mounts::Holder {
        spec: fs.spec.clone(),
        mountinfo: mounts::parse_mountinfo(&mi),
        rootfs: fs.rootfs.clone(),
    };
    let args =
        mounts::restore_external_args(&manifest.external_mounts, &holder, &cfg.containers.host())
            .map_err(Status::failed_precondition)?;
    o.external.extend(args);
    o.root = Some(holder.rootfs.to_string_lossy().into_owned());
    let mut fds = Vec::new();
    for (fd, key) in &manifest.stdio_pipes {
        let path = format!("/proc/{holder_pid}/fd/{fd}");
        let flags = if *fd == 0 {
            nix::fcntl::OFlag::O_RDONLY
        } else {
            nix::fcntl::OFlag::O_WRONLY
        };
        // Not close-on-exec: criu swrk inherits it and finds it by number.
        let f = crate::creds::as_owner(owner, || {
            nix::fcntl::open(path.as_str(), flags, nix::sys::stat::Mode::empty())
                .map_err(std::io::Error::from)
        })
        .and_then(|r| r)
        .map_err(|e| io_status("open", &path, &e))?;
        o.inherit_fd.push(criu::InheritFd {
            key: key.clone(),
            fd: f.as_raw_fd(),
        });
        fds.push(f);
    }
    Ok(Some(fds))
}

#[cfg(test)]
mod tests {
    use super::super::testkit::manifest;
    use super::*;

    fn socket(local: &str, listening: bool) -> ManifestSocket {
        ManifestSocket {
            local: local.into(),
            remote: if listening { "" } else { "10.0.0.9:41000" }.into(),
            listening,
        }
    }

    #[test]
    fn connections_are_kept_only_if_their_address_moved_and_strict_refuses_otherwise() {
        use TcpPreservation as T;
        let sockets = || vec![socket("0.0.0.0:80", true), socket("10.0.0.5:80", false)];
        let here = ["10.0.0.5".to_string()];
        let elsewhere = ["10.0.0.6".to_string()];
        let keeps = |tcp, default, addrs: &[String]| {
            tcp_preserved(&manifest(tcp, sockets()), default, addrs)
        };
        assert!(keeps(T::BestEffort, T::None, &here).unwrap());
        assert!(!keeps(T::BestEffort, T::None, &elsewhere).unwrap());
        assert!(!keeps(T::None, T::Strict, &here).unwrap());
        assert!(keeps(T::Strict, T::None, &here).unwrap());
        let e = keeps(T::Strict, T::None, &elsewhere).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        // Only listeners: nothing had to move.
        let listeners = manifest(T::Strict, vec![socket("0.0.0.0:80", true)]);
        assert!(tcp_preserved(&listeners, T::None, &elsewhere).unwrap());
        // A manifest without a valid preservation falls back on the migration's.
        let mut unknown = manifest(T::Strict, sockets());
        unknown.tcp = 99;
        assert!(!tcp_preserved(&unknown, T::None, &here).unwrap());
        assert!(tcp_preserved(&unknown, T::Strict, &elsewhere).is_err());
    }

    #[test]
    fn listeners_are_restored_and_connections_preserved_or_closed() {
        let sockets = [socket("0.0.0.0:80", true), socket("10.0.0.5:80", false)];
        let outcomes = |preserve| {
            restored_sockets(&sockets, preserve)
                .iter()
                .map(|s| s.outcome)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            outcomes(true),
            [
                SocketOutcome::ListenerRestored as i32,
                SocketOutcome::Preserved as i32
            ]
        );
        assert_eq!(
            outcomes(false),
            [
                SocketOutcome::ListenerRestored as i32,
                SocketOutcome::ClosedCleanly as i32
            ]
        );
        let r = restored_sockets(&sockets, true);
        assert_eq!(
            (r[1].local.as_str(), r[1].remote.as_str()),
            ("10.0.0.5:80", "10.0.0.9:41000")
        );
    }
}
