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
/// A notification from CRIU during a request (`notify_scripts`), and our answer to it.
pub const REQ_NOTIFY: i32 = 6;
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
    /// CRIU tells us of each of its action-script points (`pre-dump`, `post-dump`,
    /// `status-ready`, …) and waits for our answer (see [`Criu::call_notified`]).
    #[prost(bool, optional, tag = "12")]
    pub notify_scripts: Option<bool>,
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
    /// Dump: memory pages stay with the frozen tree and are served on demand by CRIU's
    /// page server when the rest is written. Restore: the restored tree's anonymous
    /// memory is filled by a `criu lazy-pages` daemon over userfaultfd (see
    /// [`crate::lazy`]).
    #[prost(bool, optional, tag = "48")]
    pub lazy_pages: Option<bool>,
    /// A CRIU configuration file read after the RPC options (over them): how a lazy
    /// dump is given its page-server socket, which the RPC's own field does not
    /// reach in lazy mode (see [`crate::lazy::ps_socket_config`]).
    #[prost(string, optional, tag = "51")]
    pub config_file: Option<String>,
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

/// Our answer to a notification (CRIU's `criu_req` with `notify_success`).
#[derive(Clone, PartialEq, prost::Message)]
struct NotifyAnswer {
    #[prost(int32, required, tag = "1")]
    r#type: i32,
    #[prost(bool, optional, tag = "3")]
    notify_success: Option<bool>,
}

/// What CRIU notifies: the action-script point it reached.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Notify {
    #[prost(string, optional, tag = "1")]
    pub script: Option<String>,
    #[prost(int32, optional, tag = "2")]
    pub pid: Option<i32>,
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
    #[prost(message, optional, tag = "5")]
    pub notify: Option<Notify>,
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
        self.run(
            req,
            log_in,
            Launch::default(),
            holder_pid,
            before_start,
            None,
        )
    }

    /// [`Criu::call`], with CRIU running as `owner` when it is not root (its dump of a
    /// non-root workload, see [`crate::creds`]).
    pub fn call_as(
        &self,
        req: Req,
        log_in: Option<&Path>,
        owner: crate::creds::Owner,
    ) -> Result<Resp, CriuError> {
        let launch = Launch {
            stdin: None,
            owner: (!owner.is_root()).then_some(owner),
        };
        self.run(req, log_in, launch, None, None, None)
    }

    /// [`Criu::call`] with `notify_scripts` on: `on_notify` is told each action-script
    /// point CRIU reaches (`post-dump`: every image is written), and CRIU goes on once
    /// it returned (every notification is answered as a success). `stdin`: given to
    /// CRIU as its standard input (fd 0) and to no other process: how a lazy dump gets
    /// its page-server socket (see [`crate::lazy`]).
    pub fn call_notified(
        &self,
        mut req: Req,
        log_in: Option<&Path>,
        stdin: Option<OwnedFd>,
        on_notify: OnNotify<'_>,
    ) -> Result<Resp, CriuError> {
        if let Some(o) = req.opts.as_mut() {
            o.notify_scripts = Some(true);
        }
        let launch = Launch { stdin, owner: None };
        self.run(req, log_in, launch, None, None, Some(on_notify))
    }

    fn run(
        &self,
        req: Req,
        log_in: Option<&Path>,
        launch: Launch,
        holder_pid: Option<i32>,
        before_start: Option<BeforeStart<'_>>,
        on_notify: Option<OnNotify<'_>>,
    ) -> Result<Resp, CriuError> {
        let op = op_name(req.r#type);
        let gate = match (holder_pid, &before_start) {
            (Some(_), Some(_)) => Some(gate_pipe().map_err(|e| CriuError::Spawn(e.to_string()))?),
            _ => None,
        };
        let (r, w) = gate.unzip();
        let (ours, child) = self.spawn_swrk(holder_pid, launch.owner, r.or(launch.stdin))?;
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
        let reply = exchange(ours, &req, on_notify)?;
        child.reap();
        read_reply(op, &reply, || log_in.map(log_tail).unwrap_or_default())
    }

    /// Starts `criu swrk` (inside the holder's PID namespace when given) on one end of
    /// a socket pair; returns the other end (close-on-exec) and the child.
    fn spawn_swrk(
        &self,
        holder_pid: Option<i32>,
        owner: Option<crate::creds::Owner>,
        stdin: Option<OwnedFd>,
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
        let mut cmd = match (holder_pid, owner) {
            (Some(pid), _) => crate::pidns::criu_command(&self.binary, pid, stdin.is_some())
                .map_err(|e| CriuError::Spawn(e.to_string()))?,
            (None, Some(o)) => crate::creds::criu_command(&self.binary, o)
                .map_err(|e| CriuError::Spawn(e.to_string()))?,
            (None, None) => std::process::Command::new(&self.binary),
        };
        let child = cmd
            .arg("swrk")
            .arg(theirs.as_raw_fd().to_string())
            .stdin(stdin.map_or_else(std::process::Stdio::null, std::process::Stdio::from))
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

/// What [`Criu::call_notified`] is told: the action-script point CRIU reached.
pub type OnNotify<'a> = &'a mut dyn FnMut(&str);

/// How `criu swrk` is started beyond its RPC socket.
#[derive(Default)]
struct Launch {
    /// Its standard input (else /dev/null); never given to another process.
    stdin: Option<OwnedFd>,
    /// The user it runs as, if not root ([`crate::creds::criu_command`]).
    owner: Option<crate::creds::Owner>,
}

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

/// Sends the request over `ours` and reads the reply (its bytes; none when CRIU
/// closed the connection), then closes `ours`. Notifications before it (only with
/// `notify_scripts`) go to `on_notify` and are answered as successes.
fn exchange(
    ours: OwnedFd,
    req: &Req,
    mut on_notify: Option<OnNotify<'_>>,
) -> Result<Vec<u8>, CriuError> {
    let io = |e: nix::Error| CriuError::Spawn(e.to_string());
    let buf = prost::Message::encode_to_vec(req);
    send(ours.as_raw_fd(), &buf, MsgFlags::empty()).map_err(io)?;
    let mut rbuf = vec![0u8; 64 * 1024];
    loop {
        rbuf.resize(64 * 1024, 0);
        let n = recv(ours.as_raw_fd(), &mut rbuf, MsgFlags::empty()).map_err(io)?;
        rbuf.truncate(n);
        let Some(f) = on_notify.as_mut() else { break };
        let notified = <Resp as prost::Message>::decode(rbuf.as_slice())
            .ok()
            .filter(|r| r.r#type == REQ_NOTIFY);
        let Some(n) = notified else { break };
        f(n.notify.and_then(|n| n.script).as_deref().unwrap_or(""));
        let answer = NotifyAnswer {
            r#type: REQ_NOTIFY,
            notify_success: Some(true),
        };
        send(
            ours.as_raw_fd(),
            &prost::Message::encode_to_vec(&answer),
            MsgFlags::empty(),
        )
        .map_err(io)?;
    }
    drop(ours);
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

/// A CRIU log summed up for error messages, see [`summarize_log`].
pub fn log_tail(path: &Path) -> String {
    summarize_log(&std::fs::read_to_string(path).unwrap_or_default())
}

/// The longest [`summarize_log`] answer, in characters: it ends up in the
/// PodMigration's status.
const LOG_SUMMARY_MAX: usize = 600;

/// How many of a log's error lines a summary shows.
const LOG_SUMMARY_LINES: usize = 4;

/// `Error` lines of CRIU that are not a failure's cause: it logs them and goes on.
const LOG_NOISE: &[&str] = &[
    // tun.c's feature probe: the agent's container has no /dev/net/tun.
    "tun: Unable to create tun",
    // util.c: CRIU keeps its current descriptor limit.
    "Can't setup RLIMIT_NOFILE",
];

/// A failure's cause that a CRIU log line names, and what to do about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LogCause {
    NoSpace,
    /// A process of the dump or restore killed by SIGKILL (the OOM killer's signal).
    MemoryKill,
    /// Killed by another signal: the cause, with no advice.
    Killed,
    NoMemory,
}

impl LogCause {
    fn of(line: &str) -> Option<LogCause> {
        if line.contains("No space left on device") || line.contains("ENOSPC") {
            Some(LogCause::NoSpace)
        } else if line.contains("killed by signal 9:") || line.contains("killed by signal 9 ") {
            Some(LogCause::MemoryKill)
        } else if line.contains("killed by signal") || line.ends_with(": Killed") {
            Some(LogCause::Killed)
        } else if line.contains("Cannot allocate memory") || line.contains("ENOMEM") {
            Some(LogCause::NoMemory)
        } else {
            None
        }
    }

    /// What to do about it. `restore`: the log is a restore's, which runs charged to
    /// the target pod's memory cgroup (`charge_restore`), so memory there is the pod's
    /// limit, not the agent's; a dump runs in the agent's container.
    fn hint(self, restore: bool) -> Option<&'static str> {
        match (self, restore) {
            (LogCause::NoSpace, _) => Some(
                "the checkpoint volume is full: raise the chart value migrationAgent.checkpointSizeLimit",
            ),
            (LogCause::MemoryKill, false) => Some(
                "killed by SIGKILL, most likely out of memory at the agent container's memory limit: raise the chart value migrationAgent.agent.resources.limits.memory",
            ),
            (LogCause::MemoryKill, true) => Some(
                "killed by SIGKILL, most likely out of memory: the restore is charged to the target pod, so check the pod's resources.limits.memory against the memory its process uses (and the target node's free memory)",
            ),
            (LogCause::Killed, _) => None,
            (LogCause::NoMemory, false) => Some(
                "out of memory, most likely the agent container's memory limit: raise the chart value migrationAgent.agent.resources.limits.memory",
            ),
            (LogCause::NoMemory, true) => Some(
                "out of memory: the restore is charged to the target pod, so check the pod's resources.limits.memory against the memory its process uses (and the target node's free memory)",
            ),
        }
    }
}

/// One line summing up a CRIU log: its last error lines (timestamps dropped, repeats
/// and CRIU's harmless probes left out; the last lines of the log if it has none),
/// the first line naming a cause we know (no space, a kill, no memory) put first and
/// followed by what to do about it, at most [`LOG_SUMMARY_MAX`] characters.
fn summarize_log(log: &str) -> String {
    let mut errs: Vec<&str> = Vec::new();
    for l in log.lines() {
        let l = strip_log_stamp(l);
        if l.contains("Error") && !LOG_NOISE.iter().any(|n| l.contains(n)) && !errs.contains(&l) {
            errs.push(l);
        }
    }
    let (lines, cause) = if errs.is_empty() {
        let mut last: Vec<&str> = log
            .lines()
            .rev()
            .map(strip_log_stamp)
            .filter(|l| !l.is_empty())
            .take(3)
            .collect();
        last.reverse();
        (last, None)
    } else {
        match errs.iter().position(|l| LogCause::of(l).is_some()) {
            Some(i) => {
                let first = errs.remove(i);
                let skip = errs.len().saturating_sub(LOG_SUMMARY_LINES - 1);
                let lines = std::iter::once(first).chain(errs.drain(skip..)).collect();
                (lines, LogCause::of(first))
            }
            None => {
                let skip = errs.len().saturating_sub(LOG_SUMMARY_LINES);
                (errs.split_off(skip), None)
            }
        }
    };
    let restore = log.contains("Restoring FAILED") || log.contains("criu/cr-restore.c");
    let hint = cause
        .and_then(|c| c.hint(restore))
        .map(|h| format!("; hint: {h}"))
        .unwrap_or_default();
    let room = LOG_SUMMARY_MAX.saturating_sub(hint.chars().count());
    let mut text = lines.join(" | ");
    if text.chars().count() > room {
        text = text.chars().take(room.saturating_sub(1)).collect();
        text.push('…');
    }
    text + &hint
}

/// A CRIU log line without its leading `(seconds)` stamp.
fn strip_log_stamp(line: &str) -> &str {
    let l = line.trim();
    match l.strip_prefix('(').and_then(|r| r.split_once(')')) {
        Some((stamp, rest)) if stamp.chars().all(|c| c.is_ascii_digit() || c == '.') => rest.trim(),
        _ => l,
    }
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

    // Fixtures: lines of real CRIU 4.2.1 logs (`-v4`), from a dump of a 16 MiB process
    // into a 1 MiB tmpfs with no /dev/net/tun (as in the agent's container), a restore
    // OOM-killed in a 40 MiB memory cgroup, and a restore under a 150 MB RLIMIT_AS.
    const TUN: &str =
        "(00.004495) Error (criu/tun.c:85): tun: Unable to create tun: No such file or directory";
    const RLIMIT: &str = "(00.047612) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted";
    const SPLICE_ENOSPC: &str = "(00.059469) Error (criu/page-xfer.c:263): page-xfer: Unable to spice data: No space left on device";
    const BFD_ENOSPC: &str =
        "(00.059486) Error (criu/bfd.c:131): bfd: Error flushing image: No space left on device";
    const PARASITE: &str = "(00.059572) Error (criu/mem.c:718): Can't dump page with parasite";
    const DUMP_FAILED: &str = "(00.061811) Error (criu/cr-dump.c:1975): Dumping FAILED.";

    /// The ENOSPC dump as CRIU logged it, every line from the first error on.
    fn enospc_dump_log() -> String {
        [
            "(00.000110) Version: 4.2.1 (gitid 0)",
            "(00.004481) net: Restoring netdev veth idx 10",
            TUN,
            "(00.047590) Dumping processes (pid: 19192 comm: perl)",
            RLIMIT,
            "(00.058772) page-xfer: \tp 0x7fe880271000 - 0x7fe880331000",
            SPLICE_ENOSPC,
            BFD_ENOSPC,
            "(00.059489) page-pipe: Killing page pipe",
            PARASITE,
            "(00.059588) Waiting for 19192 to trap",
            "pie: 19192: __fetched msg: 3 0 0",
            "(00.059704) 19192 was stopped",
            "(00.059783) Error (criu/bfd.c:131): bfd: Error flushing image: No space left on device",
            "(00.059800) Error (criu/bfd.c:131): bfd: Error flushing image: No space left on device",
            "(00.059825) Error (criu/bfd.c:131): bfd: Error flushing image: No space left on device",
            "(00.059842) net: Unlock network",
            "(00.059848) \tUnseizing 19192 into 1",
            DUMP_FAILED,
        ]
        .join("\n")
    }

    #[test]
    fn a_full_checkpoint_volume_is_named_first_with_the_chart_value_to_raise() {
        let s = summarize_log(&enospc_dump_log());
        assert_eq!(
            s,
            "Error (criu/page-xfer.c:263): page-xfer: Unable to spice data: No space left on device \
             | Error (criu/bfd.c:131): bfd: Error flushing image: No space left on device \
             | Error (criu/mem.c:718): Can't dump page with parasite \
             | Error (criu/cr-dump.c:1975): Dumping FAILED.; \
             hint: the checkpoint volume is full: raise the chart value migrationAgent.checkpointSizeLimit"
        );
        assert!(!s.contains("tun") && !s.contains("RLIMIT"), "{s}");
    }

    /// The real nodes' case: few error lines, the tun probe among the last ones.
    #[test]
    fn the_tun_probe_never_leads_the_summary() {
        let log = [TUN, RLIMIT, SPLICE_ENOSPC, DUMP_FAILED].join("\n");
        let s = summarize_log(&log);
        assert!(
            s.starts_with("Error (criu/page-xfer.c:263): page-xfer: Unable to spice data: No space left on device | "),
            "{s}"
        );
        assert!(!s.contains("tun"), "{s}");
        // Even with no cause recognized, the probes are left out.
        let s = summarize_log(&[TUN, PARASITE, DUMP_FAILED].join("\n"));
        assert_eq!(
            s,
            "Error (criu/mem.c:718): Can't dump page with parasite \
             | Error (criu/cr-dump.c:1975): Dumping FAILED."
        );
    }

    #[test]
    fn a_restore_killed_by_the_oom_killer_names_the_pods_memory_limit() {
        let log = [
            "(00.023797) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted",
            "(00.025967) pie: 19481: Preadv 0x5633cc625000:4096... (14 iovs)",
            "(00.060233) Error (criu/cr-restore.c:1269): 19481 killed by signal 9: Killed",
            "(00.060259) Error (criu/cr-restore.c:2331): Restoring FAILED.",
        ]
        .join("\n");
        assert_eq!(
            summarize_log(&log),
            "Error (criu/cr-restore.c:1269): 19481 killed by signal 9: Killed \
             | Error (criu/cr-restore.c:2331): Restoring FAILED.; \
             hint: killed by SIGKILL, most likely out of memory: the restore is charged to the \
             target pod, so check the pod's resources.limits.memory against the memory its \
             process uses (and the target node's free memory)"
        );
        // The same kill in a dump names the agent's limit: a dump runs in its container.
        let dump = [
            "(00.060233) Error (criu/cr-dump.c:2093): 19481 killed by signal 9: Killed",
            "(00.060259) Error (criu/cr-dump.c:2111): Dumping FAILED.",
        ]
        .join("\n");
        assert!(
            summarize_log(&dump).ends_with(
                "hint: killed by SIGKILL, most likely out of memory at the agent container's memory limit: \
                 raise the chart value migrationAgent.agent.resources.limits.memory"
            ),
            "{}",
            summarize_log(&dump)
        );
        // Another signal is the cause, with no advice.
        let segv = log.replace("signal 9: Killed", "signal 11: Segmentation fault");
        let s = summarize_log(&segv);
        assert!(
            s.starts_with("Error (criu/cr-restore.c:1269): 19481 killed by signal 11"),
            "{s}"
        );
        assert!(!s.contains("hint"), "{s}");
    }

    #[test]
    fn no_memory_in_a_restore_is_named_first_with_the_pods_memory_limit() {
        let log = [
            "(00.046128) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted",
            "(00.047276)  19481:  `- type 1 ID 0x18",
            "(00.047359)  19481: Error (criu/mem.c:1363): Unable to reserve memory (142266368 bytes): Cannot allocate memory",
            "(00.047418) Error (criu/cr-restore.c:2331): Restoring FAILED.",
        ]
        .join("\n");
        let s = summarize_log(&log);
        assert!(
            s.starts_with(
                "19481: Error (criu/mem.c:1363): Unable to reserve memory (142266368 bytes): Cannot allocate memory | "
            ),
            "{s}"
        );
        assert!(
            s.ends_with("check the pod's resources.limits.memory against the memory its process uses (and the target node's free memory)"),
            "{s}"
        );
    }

    /// The cause stays first even when it is older than the last lines shown.
    #[test]
    fn the_cause_is_kept_when_later_errors_follow() {
        let later: Vec<String> = (1..=6)
            .map(|i| format!("(00.06{i}) Error (criu/files.c:{i}): later {i}"))
            .collect();
        let log = format!("{SPLICE_ENOSPC}\n{}", later.join("\n"));
        let s = summarize_log(&log);
        assert!(s.starts_with("Error (criu/page-xfer.c:263)"), "{s}");
        assert!(
            s.contains("later 4 | ") && s.contains("later 6; hint: "),
            "{s}"
        );
        assert!(!s.contains("later 3"), "{s}");
    }

    #[test]
    fn the_summary_is_one_bounded_line() {
        let long = format!("(00.1) Error (criu/x.c:1): {}", "x".repeat(2000));
        let log = format!("{long}\n{SPLICE_ENOSPC}\n{long}\n");
        let s = summarize_log(&log);
        assert!(s.chars().count() <= LOG_SUMMARY_MAX, "{}", s.len());
        assert!(!s.contains('\n'));
        assert!(s.starts_with("Error (criu/page-xfer.c:263)"), "{s}");
        assert!(s.ends_with("migrationAgent.checkpointSizeLimit"), "{s}");
        // No error line at all: the last lines of the log.
        assert_eq!(
            summarize_log("(00.1) a\n(00.2) b\n\n(00.3) c\n(00.4) d\n"),
            "b | c | d"
        );
        assert_eq!(summarize_log(""), "");
    }

    #[test]
    fn a_log_file_is_summed_up() {
        let p = std::env::temp_dir().join(format!(
            "pm-criu-log-{}-{}.log",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::write(&p, enospc_dump_log()).unwrap();
        let s = log_tail(&p);
        let _ = std::fs::remove_file(&p);
        assert!(s.starts_with("Error (criu/page-xfer.c:263)"), "{s}");
        assert_eq!(log_tail(Path::new("/nonexistent/criu.log")), "");
    }
}
