//! CRIU restore inside the target holder's PID namespace.
//!
//! A container's process tree is the init of its own PID namespace; CRIU restores it as
//! a new PID namespace nested in the namespace CRIU itself runs in. If that were the
//! agent's (the host's), the restored workload would be reparented to the host's init
//! when CRIU exits, outside its pod. So CRIU runs inside the target pod's holder
//! container's PID namespace: the restored tree is nested under it and its orphans are
//! reaped by the holder, the container's init, as the runtime expects.
//!
//! Entering a PID namespace only moves the caller's *children*, and CRIU needs a /proc
//! of the namespace it runs in, so the agent launches CRIU in two stages of its own
//! binary: stage 1 joins the holder's PID namespace and starts stage 2 (the first
//! process inside it), which takes a private mount namespace with a fresh /proc and
//! executes `criu swrk`. Descriptors CRIU inherits by number pass through both stages.
//!
//! Stage 1 can wait at a gate (a pipe's read end as its stdin) before it starts stage 2: the agent
//! has the broker move stage 1 into the pod's memory cgroup first, so that CRIU and the
//! tree it restores are charged to the pod (see [`crate::criu::Criu::call_in`]). Stage 1
//! starts nothing unless it reads the one byte that opens the gate.

use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, setns, unshare};
use std::os::unix::process::CommandExt;
use std::process::Command;

const STAGE1: &str = "__criu-in-pidns";
const STAGE2: &str = "__criu-in-pidns-stage2";
const GATED: &str = "gated";

/// The command that runs `criu <args>` inside the PID namespace of `holder_pid`;
/// `gated`: once its stdin (the gate) yields a byte.
pub fn criu_command(
    criu: &std::path::Path,
    holder_pid: i32,
    gated: bool,
) -> std::io::Result<Command> {
    let mut c = Command::new(std::env::current_exe()?);
    c.arg(STAGE1)
        .arg(holder_pid.to_string())
        .arg(if gated { GATED } else { "-" })
        .arg(criu);
    Ok(c)
}

/// Runs a stage if `args` (the process's argv) names one; the agent's `main` calls it
/// before anything else. `None`: not a stage.
pub fn run_stage(args: &[String]) -> Option<i32> {
    let stage = args.get(1)?.as_str();
    if stage != STAGE1 && stage != STAGE2 {
        return None;
    }
    let res = match stage {
        STAGE1 => stage1(&args[2..]),
        _ => stage2(&args[2..]),
    };
    Some(res.unwrap_or_else(|e| {
        eprintln!("podmotion-agent {stage}: {e}");
        127
    }))
}

fn stage1(args: &[String]) -> Result<i32, String> {
    let [pid, gate, rest @ ..] = args else {
        return Err(format!("usage: <holder pid> <{GATED}|-> <criu> <args...>"));
    };
    let pid: i32 = pid.parse().map_err(|e| format!("holder pid {pid}: {e}"))?;
    if gate == GATED {
        wait_at_gate()?;
    }
    // A holder of another user (the container's own, e.g. 65532) is reached as that
    // user: the agent has no CAP_SYS_PTRACE (crate::creds).
    let path = format!("/proc/{pid}/ns/pid");
    let owner = crate::creds::owner_of(pid)?;
    let ns = crate::creds::as_owner(owner, || std::fs::File::open(&path))
        .and_then(|r| r)
        .map_err(|e| format!("open {path} as {owner}: {e}"))?;
    setns(&ns, CloneFlags::CLONE_NEWPID).map_err(|e| format!("setns pid of {pid}: {e}"))?;
    let status = Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
        .arg(STAGE2)
        .args(rest)
        .stdin(std::process::Stdio::null())
        .status()
        .map_err(|e| format!("stage 2: {e}"))?;
    Ok(status.code().unwrap_or(128))
}

/// Reads the one byte that opens the gate (stdin; stage 2 and CRIU get none). An end
/// without it (the agent gave up) starts nothing.
fn wait_at_gate() -> Result<(), String> {
    use std::io::Read;
    let mut b = [0u8; 1];
    match std::io::stdin().lock().read(&mut b) {
        Ok(1) => Ok(()),
        Ok(_) => Err("the agent closed the gate: CRIU not started".into()),
        Err(e) => Err(format!("gate: {e}")),
    }
}

fn stage2(args: &[String]) -> Result<i32, String> {
    let [criu, rest @ ..] = args else {
        return Err("usage: <criu> <args...>".into());
    };
    unshare(CloneFlags::CLONE_NEWNS).map_err(|e| format!("unshare mount namespace: {e}"))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_SLAVE,
        None::<&str>,
    )
    .map_err(|e| format!("make / a slave: {e}"))?;
    mount(
        Some("proc"),
        "/proc",
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(|e| format!("mount /proc of the holder's pid namespace: {e}"))?;
    let e = Command::new(criu).args(rest).exec();
    Err(format!("exec {criu}: {e}"))
}
