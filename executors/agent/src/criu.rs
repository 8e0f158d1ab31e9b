//! CRIU over its RPC: `criu swrk <fd>` is spawned per request and spoken to over a
//! SOCK_SEQPACKET pair; criu is never linked. The messages below are the subset of
//! CRIU's `images/rpc.proto` we use, with its field numbers (prost derive, proto2
//! optional semantics), so pre-dump, leave_stopped and network_lock are reachable.

use nix::sys::socket::{AddressFamily, MsgFlags, SockFlag, SockType, recv, send, socketpair};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

pub const REQ_DUMP: i32 = 1;
pub const REQ_RESTORE: i32 = 2;
pub const REQ_PRE_DUMP: i32 = 4;
pub const REQ_VERSION: i32 = 10;

pub const CG_IGNORE: i32 = 0;
pub const NETWORK_LOCK_SKIP: i32 = 3;

#[derive(Clone, PartialEq, prost::Message)]
pub struct InheritFd {
    #[prost(string, required, tag = "1")]
    pub key: String,
    #[prost(int32, required, tag = "2")]
    pub fd: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Opts {
    #[prost(int32, required, tag = "1")]
    pub images_dir_fd: i32,
    #[prost(int32, optional, tag = "2")]
    pub pid: Option<i32>,
    #[prost(bool, optional, tag = "3")]
    pub leave_running: Option<bool>,
    #[prost(bool, optional, tag = "5")]
    pub tcp_established: Option<bool>,
    #[prost(bool, optional, tag = "7")]
    pub shell_job: Option<bool>,
    #[prost(int32, optional, tag = "9")]
    pub log_level: Option<i32>,
    #[prost(string, optional, tag = "10")]
    pub log_file: Option<String>,
    /// Root of the restored mount namespace (a container's root filesystem).
    #[prost(string, optional, tag = "13")]
    pub root: Option<String>,
    #[prost(string, optional, tag = "14")]
    pub parent_img: Option<String>,
    #[prost(bool, optional, tag = "15")]
    pub track_mem: Option<bool>,
    #[prost(bool, optional, tag = "26")]
    pub rst_sibling: Option<bool>,
    #[prost(message, repeated, tag = "27")]
    pub inherit_fd: Vec<InheritFd>,
    #[prost(int32, optional, tag = "34")]
    pub manage_cgroups_mode: Option<i32>,
    #[prost(string, repeated, tag = "37")]
    pub external: Vec<String>,
    #[prost(bool, optional, tag = "46")]
    pub tcp_skip_in_flight: Option<bool>,
    #[prost(bool, optional, tag = "52")]
    pub tcp_close: Option<bool>,
    #[prost(int32, optional, tag = "64")]
    pub network_lock: Option<i32>,
    #[prost(string, optional, tag = "68")]
    pub images_dir: Option<String>,
    #[prost(bool, optional, tag = "69")]
    pub leave_stopped: Option<bool>,
}

impl Opts {
    pub fn new(dir: &Path, log: &str) -> Self {
        Self {
            images_dir_fd: -1,
            images_dir: Some(dir.to_string_lossy().into_owned()),
            log_file: Some(log.to_owned()),
            log_level: Some(4),
            manage_cgroups_mode: Some(CG_IGNORE),
            network_lock: Some(NETWORK_LOCK_SKIP),
            ..Default::default()
        }
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Req {
    #[prost(int32, required, tag = "1")]
    pub r#type: i32,
    #[prost(message, optional, tag = "2")]
    pub opts: Option<Opts>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RestoreResp {
    #[prost(int32, required, tag = "1")]
    pub pid: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Version {
    #[prost(int32, required, tag = "1")]
    pub major_number: i32,
    #[prost(int32, required, tag = "2")]
    pub minor_number: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Resp {
    #[prost(int32, required, tag = "1")]
    pub r#type: i32,
    #[prost(bool, required, tag = "2")]
    pub success: bool,
    #[prost(message, optional, tag = "4")]
    pub restore: Option<RestoreResp>,
    #[prost(int32, optional, tag = "7")]
    pub cr_errno: Option<i32>,
    #[prost(string, optional, tag = "9")]
    pub cr_errmsg: Option<String>,
    #[prost(message, optional, tag = "10")]
    pub version: Option<Version>,
}

#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    #[error("cannot run criu: {0}")]
    Spawn(String),
    #[error("criu {op} failed (errno {errno}): {msg}; log tail: {log}")]
    Failed {
        op: &'static str,
        errno: i32,
        msg: String,
        log: String,
    },
}

#[derive(Clone, Debug)]
pub struct Criu {
    pub binary: PathBuf,
}

impl Criu {
    /// Runs one request in a fresh `criu swrk`. `inherit` descriptors must not be
    /// close-on-exec (criu finds them by number).
    pub fn call(&self, req: Req, log_in: Option<&Path>) -> Result<Resp, CriuError> {
        self.call_in(req, log_in, None, None)
    }

    /// [`Criu::call`], with CRIU running inside the PID namespace of `holder_pid` when
    /// given (a container's restore, see [`crate::pidns`]). There, `before_start` runs
    /// first, given the pid of the launcher that will start CRIU (the agent's first
    /// stage, waiting at its gate): CRIU starts only once it returned `Ok`; its error
    /// ends the launch, nothing started. Without a holder it is not called.
    pub fn call_in(
        &self,
        req: Req,
        log_in: Option<&Path>,
        holder_pid: Option<i32>,
        before_start: Option<BeforeStart<'_>>,
    ) -> Result<Resp, CriuError> {
        let op = op_name(req.r#type);
        let gate = match (holder_pid, &before_start) {
            (Some(_), Some(_)) => Some(gate_pipe().map_err(|e| CriuError::Spawn(e.to_string()))?),
            _ => None,
        };
        let (r, w) = gate.unzip();
        let (ours, child) = self.spawn_swrk(holder_pid, r)?;
        let mut child = Swrk(child);
        if let (Some(w), Some(f)) = (w, before_start) {
            // A launcher that is not let through is killed and reaped (`Swrk`'s drop).
            f(child.0.id() as i32).map_err(CriuError::Spawn)?;
            nix::unistd::write(&w, &[1]).map_err(|e| CriuError::Spawn(format!("gate: {e}")))?;
        }
        // No timeout on the reply: a dump of a large process may take long. A CRIU that
        // hangs blocks this (blocking-pool) thread until it ends, and the step that
        // called it keeps holding its migration. What bounds it is the operator: its
        // progress timeout (`progressTimeoutSeconds`) rolls the migration back with an
        // `Abort`, but that `Abort` waits for the same migration's lock, so it cannot
        // act either: the rollback ends with "source state unknown" and what frees the
        // source is CRIU ending or the agent's end (its broker lease then rolls the lock
        // back). Killing CRIU from `Abort` is not safe: mid-dump its parasite code runs
        // inside the workload.
        let reply = exchange(ours, &req)?;
        child.reap();
        read_reply(op, &reply, || log_in.map(log_tail).unwrap_or_default())
    }

    /// Starts `criu swrk` (inside the holder's PID namespace when given) on one end of
    /// a socket pair; returns the other end (close-on-exec) and the child.
    fn spawn_swrk(
        &self,
        holder_pid: Option<i32>,
    ) -> Result<(OwnedFd, std::process::Child), CriuError> {
        let (ours, theirs): (OwnedFd, OwnedFd) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::empty(),
        )
        .map_err(|e| CriuError::Spawn(e.to_string()))?;
        nix::fcntl::fcntl(
            &ours,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )
        .map_err(|e| CriuError::Spawn(e.to_string()))?;
        let mut cmd = match holder_pid {
            Some(pid) => crate::pidns::criu_command(&self.binary, pid, gate.is_some())
                .map_err(|e| CriuError::Spawn(e.to_string()))?,
            None => std::process::Command::new(&self.binary),
        };
        let child = cmd
            .arg("swrk")
            .arg(theirs.as_raw_fd().to_string())
            .stdin(gate.map_or_else(std::process::Stdio::null, std::process::Stdio::from))
            .spawn()
            .map_err(|e| CriuError::Spawn(format!("{}: {e}", self.binary.display())))?;
        drop(theirs);
        Ok((ours, child))
    }

    pub fn version(&self) -> Result<(i32, i32), CriuError> {
        let r = self.call(
            Req {
                r#type: REQ_VERSION,
                opts: None,
            },
            None,
        )?;
        let v = r.version.unwrap_or_default();
        Ok((v.major_number, v.minor_number))
    }
}

/// What [`Criu::call_in`] runs between the launch and CRIU's start, given the
/// launcher's pid; its error (said in words) ends the launch.
pub type BeforeStart<'a> = &'a mut dyn FnMut(i32) -> Result<(), String>;

/// A gate for the launcher: the read end becomes its stdin; neither end leaks into
/// other children (close-on-exec).
fn gate_pipe() -> nix::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
}

/// A running `criu swrk`: waited for once it has answered ([`Swrk::reap`]); dropped
/// before that (a failed send or receive, a panic), it is killed and reaped, so no
/// failure path leaves it running or a zombie. Inside a holder's PID namespace the
/// child is the agent's first stage (see [`crate::pidns`]): CRIU itself, reparented to
/// the holder, exits on the socket's end, which is already closed then.
struct Swrk(std::process::Child);

impl Swrk {
    /// Waits for CRIU to exit after its reply.
    fn reap(&mut self) {
        let _ = self.0.wait();
    }
}

impl Drop for Swrk {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// What an operation is called in errors.
fn op_name(kind: i32) -> &'static str {
    match kind {
        REQ_DUMP => "dump",
        REQ_RESTORE => "restore",
        REQ_PRE_DUMP => "pre-dump",
        _ => "request",
    }
}

/// Sends the request over `ours` and reads the one reply (its bytes; none when CRIU
/// closed the connection), then closes `ours`.
fn exchange(ours: OwnedFd, req: &Req) -> Result<Vec<u8>, CriuError> {
    let buf = prost::Message::encode_to_vec(req);
    send(ours.as_raw_fd(), &buf, MsgFlags::empty()).map_err(|e| CriuError::Spawn(e.to_string()))?;
    let mut rbuf = vec![0u8; 64 * 1024];
    let n = recv(ours.as_raw_fd(), &mut rbuf, MsgFlags::empty())
        .map_err(|e| CriuError::Spawn(e.to_string()))?;
    drop(ours);
    rbuf.truncate(n);
    Ok(rbuf)
}

/// CRIU's reply to `op`: its response if it succeeded; otherwise why not, with the
/// tail of its log (read only then).
fn read_reply(op: &'static str, reply: &[u8], log: impl Fn() -> String) -> Result<Resp, CriuError> {
    if reply.is_empty() {
        return Err(CriuError::Failed {
            op,
            errno: 0,
            msg: "criu closed the connection".into(),
            log: log(),
        });
    }
    let resp: Resp = prost::Message::decode(reply).map_err(|e| CriuError::Spawn(e.to_string()))?;
    if !resp.success {
        return Err(CriuError::Failed {
            op,
            errno: resp.cr_errno.unwrap_or(0),
            msg: resp.cr_errmsg.clone().unwrap_or_default(),
            log: log(),
        });
    }
    Ok(resp)
}

/// The last error lines of a CRIU log, for error messages.
pub fn log_tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let errs: Vec<&str> = s.lines().filter(|l| l.contains("Error")).collect();
    let lines = if errs.is_empty() {
        s.lines().rev().take(3).collect::<Vec<_>>()
    } else {
        errs.into_iter().rev().take(4).collect()
    };
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_operation() {
        assert_eq!(op_name(REQ_DUMP), "dump");
        assert_eq!(op_name(REQ_RESTORE), "restore");
        assert_eq!(op_name(REQ_PRE_DUMP), "pre-dump");
        assert_eq!(op_name(REQ_VERSION), "request");
    }

    /// Our children named `comm` (running or zombies), from /proc.
    fn children_named(comm: &str) -> Vec<i32> {
        let me = std::process::id().to_string();
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
            .filter_map(|st| {
                // pid (comm) state ppid ...
                let (head, rest) = st.rsplit_once(')')?;
                let (pid, name) = head.split_once(" (")?;
                let ppid = rest.split_whitespace().nth(1)?;
                (name == comm && ppid == me).then(|| pid.parse().ok())?
            })
            .collect()
    }

    #[test]
    fn a_criu_whose_request_cannot_be_sent_is_killed_and_reaped() {
        let dir = std::env::temp_dir().join(format!(
            "pm-criu-reap-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        // A "criu" that never answers nor exits: it blocks opening a FIFO nobody writes.
        let name = format!("pmcriu{}", std::process::id() % 1_000_000);
        let fifo = dir.join("never");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let fake = dir.join(&name);
        std::fs::write(&fake, format!("#!/bin/sh\nread x < {}\n", fifo.display())).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let criu = Criu { binary: fake };
        // Larger than a SOCK_SEQPACKET message can be: the send fails (EMSGSIZE).
        let mut opts = Opts::new(&dir, "dump.log");
        opts.external = vec!["x".repeat(1 << 20); 4];
        let e = criu
            .call(
                Req {
                    r#type: REQ_DUMP,
                    opts: Some(opts),
                },
                None,
            )
            .unwrap_err();
        assert!(matches!(e, CriuError::Spawn(_)), "{e}");
        let left = children_named(&name);
        for pid in &left {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(*pid), None);
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            left.is_empty(),
            "criu swrk left running or unreaped after a failed send: {left:?}"
        );
    }

    #[test]
    fn a_reply_is_a_response_only_if_criu_succeeded() {
        let log = || "Error (criu/cr-dump.c:1): boom".to_string();
        let e = read_reply("dump", &[], log).unwrap_err();
        assert_eq!(
            e.to_string(),
            "criu dump failed (errno 0): criu closed the connection; log tail: Error (criu/cr-dump.c:1): boom"
        );
        let failed = Resp {
            r#type: REQ_RESTORE,
            success: false,
            cr_errno: Some(17),
            cr_errmsg: Some("File exists".into()),
            ..Default::default()
        };
        let e = read_reply("restore", &prost::Message::encode_to_vec(&failed), log).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("criu restore failed (errno 17): File exists; log tail:"),
            "{e}"
        );
        let ok = Resp {
            r#type: REQ_RESTORE,
            success: true,
            restore: Some(RestoreResp { pid: 42 }),
            ..Default::default()
        };
        let r = read_reply("restore", &prost::Message::encode_to_vec(&ok), || {
            panic!("the log is read only on failure")
        })
        .unwrap();
        assert_eq!(r.restore.map(|r| r.pid), Some(42));
    }
}
