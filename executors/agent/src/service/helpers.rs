//! The small helpers every step of a migration shares: statuses from the errors of
//! the layers below (the broker, CRIU, the kernel), blocking calls off the runtime, the
//! broker's calls, the clock, and the transfers an Abort cuts short. They name nothing
//! of the service above them.

use crate::creds;
use crate::criu::{self, Criu, Opts, Req};
use podmotion_broker::client::BrokerClient;
use podmotion_broker::procfs;
use podmotion_wire::agent::MigrationStatus;
use podmotion_wire::broker::{BrokerError, Reply, Request};
use podmotion_wire::ids::ProcRef;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{SystemTime, UNIX_EPOCH};
use tonic::Status;

pub(super) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// An error and its sources, `: `-separated (a refused TLS handshake says why only
/// in a source).
pub(super) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let m = s.to_string();
        if !out.contains(&m) {
            out = format!("{out}: {m}");
        }
        src = s.source();
    }
    out
}

pub(super) fn broker_status(e: BrokerError) -> Status {
    Status::failed_precondition(format!("broker: {e}"))
}

pub(super) fn criu_status(e: criu::CriuError) -> Status {
    Status::internal(e.to_string())
}

pub(super) fn io_internal(e: std::io::Error) -> Status {
    Status::internal(e.to_string())
}

/// A failed system call `call` on `path` as a status whose code says what happened:
/// the kernel's refusal (EACCES, EPERM) is `PermissionDenied`, a path that is not
/// there `NotFound`, anything else `Internal`. The message names the call and the
/// path, and what grants the permission when refused.
pub(super) fn io_status(call: &str, path: &str, e: &std::io::Error) -> Status {
    use std::io::ErrorKind;
    let msg = format!("{call} {path}: {e}");
    match e.kind() {
        ErrorKind::PermissionDenied => Status::permission_denied(format!(
            "{msg} (the agent runs as uid 0 without CAP_SYS_PTRACE: a process of another \
             user is reached as that user, see docs/security.md)"
        )),
        ErrorKind::NotFound => Status::not_found(msg),
        _ => Status::internal(msg),
    }
}

/// Runs one CRIU request (`kind`, its log at `log`) on a blocking thread, as `owner`
/// (the tree's: see [`crate::creds`]).
pub(super) async fn run_criu(
    criu: Criu,
    kind: i32,
    opts: Opts,
    log: PathBuf,
    owner: creds::Owner,
) -> Result<criu::Resp, Status> {
    blocking(move || {
        criu.call_as(
            Req {
                r#type: kind,
                opts: Some(opts),
            },
            Some(&log),
            owner,
        )
        .map_err(criu_status)
    })
    .await
}

pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(e.to_string()))?
}

/// The inode of `pid`'s network namespace, read as `owner` (the process's).
pub(super) fn netns_ino(pid: i32, owner: creds::Owner) -> Result<String, Status> {
    let path = format!("/proc/{pid}/ns/net");
    let l = creds::as_owner(owner, || std::fs::read_link(&path))
        .and_then(|r| r)
        .map_err(|e| io_status("readlink", &path, &e))?;
    Ok(l.to_string_lossy()
        .chars()
        .filter(char::is_ascii_digit)
        .collect())
}

/// The tree a source container's dump starts from, from its PID 1 (`pid`): that
/// process, or, if it is PodMotion's holder, the restored workload it holds (see
/// [`crate::holder::held_workload`]) with the holder pinned beside it. CRIU, run in the
/// node's PID namespace as for any container, dumps that workload: the init of the
/// namespace nested below the holder's (what it refuses is a tree that spans two
/// nested namespaces, the holder's own). A holder that holds nothing to migrate is a
/// failed precondition.
pub(super) fn held_source(pid: i32) -> Result<(i32, Option<ProcRef>), Status> {
    let Some(workload) = crate::holder::held_workload(pid).map_err(Status::failed_precondition)?
    else {
        return Ok((pid, None));
    };
    let start_time = procfs::start_time(pid).map_err(|e| Status::not_found(e.to_string()))?;
    Ok((workload, Some(ProcRef { pid, start_time })))
}

/// Name under which the pod's network namespace is external to the images: CRIU
/// neither dumps nor recreates it; the target passes its own namespace for this key.
pub(super) const NETNS_KEY: &str = "podnet";

pub(super) async fn broker_call(
    b: &Arc<StdMutex<BrokerClient>>,
    req: Request,
) -> Result<Reply, Status> {
    let b = Arc::clone(b);
    blocking(move || broker_call_blocking(&b, req)).await
}

/// [`broker_call`] on a thread that may block (the blocking pool's).
pub(super) fn broker_call_blocking(
    b: &StdMutex<BrokerClient>,
    req: Request,
) -> Result<Reply, Status> {
    let r = b.lock().expect("broker client").call(&req);
    crate::metrics::global().broker_op(req.name(), r.as_ref().map(|_| ()).map_err(|e| e.kind));
    r.map_err(broker_status)
}

/// Runs `transfer` unless and until `aborted` is raised: then it is dropped (its
/// stream closed) and the answer is `aborted`.
pub(super) async fn cut_by_abort<T>(
    mut aborted: tokio::sync::watch::Receiver<bool>,
    transfer: impl std::future::Future<Output = Result<T, Status>>,
    what: &str,
) -> Result<T, Status> {
    tokio::select! {
        r = transfer => r,
        _ = aborted.wait_for(|a| *a) => {
            tracing::warn!(what, "cut short by the migration's Abort");
            Err(Status::aborted(format!("{what} was cut short by the migration's Abort")))
        }
    }
}

/// Statuses of the migrations whose transfer is under way, by UID.
pub(super) type Transfers = Arc<StdMutex<HashMap<String, MigrationStatus>>>;

/// A transfer under way (a `Send`, an image stream): it holds its migration for its
/// whole length, so its status at the start is kept in `Agent::transferring` for
/// `Status` to answer, until dropped.
pub(super) struct Transferring {
    all: Transfers,
    uid: String,
}

impl Transferring {
    pub(super) fn mark(all: &Transfers, uid: &str, st: MigrationStatus) -> Transferring {
        all.lock()
            .expect("transferring")
            .insert(uid.to_string(), st);
        Transferring {
            all: Arc::clone(all),
            uid: uid.to_string(),
        }
    }
}

impl Drop for Transferring {
    fn drop(&mut self) {
        self.all.lock().expect("transferring").remove(&self.uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_io_failure_carries_the_code_of_what_happened_and_names_the_call_and_path() {
        let status = |errno: i32| {
            io_status(
                "readlink",
                "/proc/7/ns/net",
                &std::io::Error::from_raw_os_error(errno),
            )
        };
        // The error of issue 39: EACCES was NotFound, with no call and no path.
        let denied = status(nix::libc::EACCES);
        assert_eq!(denied.code(), tonic::Code::PermissionDenied);
        assert!(
            denied
                .message()
                .starts_with("readlink /proc/7/ns/net: Permission denied (os error 13) (")
                && denied.message().contains("CAP_SYS_PTRACE"),
            "{}",
            denied.message()
        );
        assert_eq!(
            status(nix::libc::EPERM).code(),
            tonic::Code::PermissionDenied
        );
        let gone = status(nix::libc::ENOENT);
        assert_eq!(gone.code(), tonic::Code::NotFound);
        assert_eq!(
            gone.message(),
            "readlink /proc/7/ns/net: No such file or directory (os error 2)"
        );
        let other = status(nix::libc::EIO);
        assert_eq!(other.code(), tonic::Code::Internal);
        assert!(other.message().starts_with("readlink /proc/7/ns/net: "));
    }

    #[test]
    fn the_agents_own_read_of_a_namespace_reports_the_path() {
        let e = netns_ino(i32::MAX, creds::Owner { uid: 0, gid: 0 }).unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound);
        assert!(
            e.message()
                .starts_with("readlink /proc/2147483647/ns/net: "),
            "{}",
            e.message()
        );
    }
}
