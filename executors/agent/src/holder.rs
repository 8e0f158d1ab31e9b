//! The holder: the process each container of a migration's target pod runs until the
//! agent restores the source's process tree into it, and the container's init after.
//!
//! The target pod runs the *source's image* (CRIU restores the tree on top of the
//! holder container's root filesystem, so it must hold the same files), with its command
//! replaced by this program, copied into a shared `emptyDir` by an init container of
//! the agent's image (`podmotion-agent install-holder <path>`). The binary is static, so
//! it runs in any image.
//!
//! `podmotion-agent hold` is PID 1 of the container:
//! * before restore it waits, and exits 0 on SIGTERM/SIGINT (the pod is deleted);
//! * the agent runs CRIU inside this PID namespace, so the restored tree's root becomes
//!   this process's child when CRIU exits; SIGTERM/SIGINT are then forwarded to it, and
//!   when it exits the holder exits with its status, so the kubelet sees the workload's
//!   exit and applies the pod's restart policy;
//! * after restore the agent writes `/.podmotion/restart.json` (the source container's
//!   original process: argv and working directory, from the runtime's spec);
//!   when the container is started again, the holder finds it and executes that process
//!   in its place: a restart of an adopted pod starts the workload afresh, as a restart
//!   of the source would have.

use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, sigprocmask};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use podmotion_wire::agent::{HOLDER_RESTART, Workload};
use std::os::unix::process::CommandExt;
use std::path::Path;

/// Mode that copies this binary to a path (the target pod's init container).
pub const INSTALL: &str = "install-holder";
/// Mode that holds a target container (its PID 1).
pub const HOLD: &str = "hold";

/// `process.{args,cwd}` of an OCI runtime spec: the container's original process.
pub fn workload_from_spec(spec: &serde_json::Value) -> Option<Workload> {
    let p = spec.get("process")?;
    let strings = |k: &str| -> Vec<String> {
        p.get(k)
            .and_then(|v| v.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let args = strings("args");
    if args.is_empty() {
        return None;
    }
    Some(Workload {
        args,
        cwd: p
            .get("cwd")
            .and_then(|v| v.as_str())
            .unwrap_or("/")
            .to_owned(),
    })
}

/// Runs a holder mode if argv names one; `None`: not a holder mode.
pub fn run_mode(args: &[String]) -> Option<i32> {
    let mode = args.get(1)?.as_str();
    let res = match mode {
        INSTALL => install(&args[2..]),
        HOLD => hold(&args[2..]),
        _ => return None,
    };
    Some(res.unwrap_or_else(|e| {
        eprintln!("podmotion holder {mode}: {e}");
        1
    }))
}

fn install(args: &[String]) -> Result<i32, String> {
    let [dest] = args else {
        return Err("usage: install-holder <path>".into());
    };
    let dest = Path::new(dest);
    let tmp = dest.with_extension("tmp");
    let me = std::env::current_exe().map_err(|e| format!("own binary: {e}"))?;
    std::fs::copy(&me, &tmp).map_err(|e| format!("copy to {}: {e}", tmp.display()))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("chmod {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, dest).map_err(|e| format!("rename to {}: {e}", dest.display()))?;
    Ok(0)
}

/// Exit code for a wait status, as a shell reports it.
pub fn exit_code(status: WaitStatus) -> Option<i32> {
    match status {
        WaitStatus::Exited(_, code) => Some(code),
        WaitStatus::Signaled(_, sig, _) => Some(128 + sig as i32),
        _ => None,
    }
}

/// PIDs of this process's children (`/proc/self/task/*/children`).
fn children() -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
            }
        }
    }
    out
}

fn hold(args: &[String]) -> Result<i32, String> {
    if !args.is_empty() {
        return Err("usage: hold".into());
    }
    let restart = Path::new(HOLDER_RESTART);
    if let Ok(raw) = std::fs::read(restart) {
        // A restart of a container whose restored workload exited: start it afresh.
        let w: Workload =
            serde_json::from_slice(&raw).map_err(|e| format!("{}: {e}", restart.display()))?;
        // The environment is the holder's own: the runtime gave this container the
        // application's environment as resolved for this pod (its name, its IP).
        let e = std::process::Command::new(&w.args[0])
            .args(&w.args[1..])
            .current_dir(if w.cwd.is_empty() { "/" } else { &w.cwd })
            .exec();
        return Err(format!("exec {}: {e}", w.args[0]));
    }
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGCHLD] {
        set.add(s);
    }
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&set), None).map_err(|e| e.to_string())?;
    loop {
        // A child may have been adopted and exited between two waits: reap first.
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(s) => {
                    if let Some(code) = exit_code(s) {
                        return Ok(code);
                    }
                }
            }
        }
        let sig = set.wait().map_err(|e| e.to_string())?;
        if sig == Signal::SIGTERM || sig == Signal::SIGINT {
            let kids = children();
            if kids.is_empty() {
                return Ok(0);
            }
            for k in kids {
                let _ = kill(Pid::from_raw(k), sig);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_workload_is_the_runtime_specs_process() {
        let spec = json!({"process": {"args": ["/bin/app", "-v"], "env": ["A=1"], "cwd": "/srv"}});
        assert_eq!(
            workload_from_spec(&spec),
            Some(Workload {
                args: vec!["/bin/app".into(), "-v".into()],
                cwd: "/srv".into()
            })
        );
        assert_eq!(workload_from_spec(&json!({"process": {"args": []}})), None);
        assert_eq!(workload_from_spec(&json!({})), None);
    }

    #[test]
    fn exit_codes_are_the_shells() {
        let p = Pid::from_raw(7);
        assert_eq!(exit_code(WaitStatus::Exited(p, 3)), Some(3));
        assert_eq!(
            exit_code(WaitStatus::Signaled(p, Signal::SIGKILL, false)),
            Some(137)
        );
        assert_eq!(exit_code(WaitStatus::StillAlive), None);
    }
}
