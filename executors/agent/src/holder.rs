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
//!   exit and applies the pod's restart policy. The workload is the child that is the
//!   init of a PID namespace nested below the holder's (CRIU restores the source
//!   container's init as one): any other process that ends as the holder's child — one
//!   left by `kubectl exec`, a CRIU whose launcher was killed — is only reaped, never
//!   taken for the workload (its exit would end the container, and the restored tree
//!   with it);
//! * after restore the agent writes `/.podmotion/restart.json` (the source container's
//!   original process: argv and working directory, from the runtime's spec);
//!   when the container is started again, the holder finds it and executes that process
//!   in its place: a restart of an adopted pod starts the workload afresh, as a restart
//!   of the source would have;
//! * migrated again, the holder's container is the source: the agent dumps the restored
//!   tree ([`held_workload`]) and carries the restart file along ([`restart_workload`]).

use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, sigprocmask};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid, waitpid};
use nix::unistd::Pid;
use podmotion_broker::procfs;
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

/// PIDs of the children of `pid` (`/proc/<pid>/task/*/children`; `self` for this
/// process).
fn children_of(pid: &str) -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
            }
        }
    }
    out
}

fn children() -> Vec<i32> {
    children_of("self")
}

/// How many PID namespaces deep `pid` is, as this process's /proc sees it (the
/// length of its `NSpid`); `None` if it cannot be read. The holder's /proc is its
/// container's, mounted for the container's PID namespace (as every runtime mounts
/// it), so the PIDs its `wait` reports name the same processes there.
fn ns_depth(pid: &str) -> Option<usize> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    procfs::parse_ns_pids(&status).map(|p| p.len())
}

/// Whether a child `child_depth` PID namespaces deep is the holder's workload: the
/// init of a namespace nested below the holder's (`own_depth` deep). A child whose
/// depth cannot be read counts as the workload: the holder then ends with it, as it
/// did before it told them apart.
fn is_workload(own_depth: Option<usize>, child_depth: Option<usize>) -> bool {
    match (own_depth, child_depth) {
        (Some(own), Some(child)) => child > own,
        _ => true,
    }
}

/// Whether `argv` (a process's command line) is the holder's: `<dir>/hold hold`.
pub fn is_holder_argv(argv: &[String]) -> bool {
    matches!(argv, [bin, mode] if mode == HOLD
        && Path::new(bin).file_name().is_some_and(|n| n == "hold"))
}

/// The restored workload a source container holds, if its PID 1 (`pid`, a host PID)
/// is PodMotion's holder: a pod PodMotion moved before. `Ok(None)`: an ordinary
/// container, whose PID 1 is the tree to dump. The workload is the holder's one child
/// that is the init of a PID namespace nested below the holder's: the tree CRIU
/// restored there, which it can dump again (what it cannot dump is the holder's own
/// tree, two PID namespaces deep). A holder that holds none (the restore never
/// happened) or several is an error, said in words.
pub fn held_workload(pid: i32) -> Result<Option<i32>, String> {
    let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return Ok(None);
    };
    let argv: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    if !is_holder_argv(&argv) {
        return Ok(None);
    }
    let own = ns_depth(&pid.to_string())
        .ok_or_else(|| format!("the PID namespaces of the holder {pid} cannot be read"))?;
    let nested: Vec<i32> = children_of(&pid.to_string())
        .into_iter()
        .filter(|c| ns_depth(&c.to_string()).is_some_and(|d| d > own))
        .collect();
    match nested.as_slice() {
        [w] => Ok(Some(*w)),
        [] => Err(format!(
            "the container's PID 1 ({pid}) is PodMotion's holder but holds no restored \
             workload (its restore never completed): nothing to migrate"
        )),
        many => Err(format!(
            "the container's PID 1 ({pid}) is PodMotion's holder and holds {} PID \
             namespaces ({many:?}), not one restored workload",
            many.len()
        )),
    }
}

/// The workload a holder executes when its container is started again: the restart
/// file under `root` (a holder's root filesystem, e.g. `/proc/<pid>/root`); `None` if
/// there is none or it cannot be read (the caller says so).
pub fn restart_workload(root: &Path) -> Result<Option<Workload>, String> {
    let path = root.join(HOLDER_RESTART.trim_start_matches('/'));
    match std::fs::read(&path) {
        Ok(raw) => serde_json::from_slice(&raw)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Reaps one child that ended, if one did: whether it was the workload (see
/// [`is_workload`], read before it is reaped, while its zombie still shows its PID
/// namespaces) and its wait status.
fn reap_one(own_depth: Option<usize>) -> Option<(bool, WaitStatus)> {
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    let pid = waitid(Id::All, flags).ok()?.pid()?;
    let workload = is_workload(own_depth, ns_depth(&pid.to_string()));
    let status = waitpid(pid, None).ok()?;
    Some((workload, status))
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
    let own = ns_depth("self");
    loop {
        // A child may have been adopted and exited between two waits: reap first.
        while let Some((workload, s)) = reap_one(own) {
            if workload && let Some(code) = exit_code(s) {
                return Ok(code);
            }
        }
        let sig = set.wait().map_err(|e| e.to_string())?;
        if sig == Signal::SIGTERM || sig == Signal::SIGINT {
            let kids = children();
            for k in &kids {
                let _ = kill(Pid::from_raw(*k), sig);
            }
            // Nothing restored yet (or only strays): the pod is deleted, end now.
            let holding = kids
                .iter()
                .any(|k| is_workload(own, ns_depth(&k.to_string())));
            if !holding {
                return Ok(0);
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
    fn only_a_child_in_a_nested_pid_namespace_is_the_workload() {
        // The holder at depth 2 (host, container): the restored init is 3 deep.
        assert!(is_workload(Some(2), Some(3)));
        // A process of the holder's own namespace (kubectl exec, a CRIU left over).
        assert!(!is_workload(Some(2), Some(2)));
        // Unreadable: the holder ends with it, as before.
        assert!(is_workload(Some(2), None));
        assert!(is_workload(None, Some(2)));
    }

    #[test]
    fn a_holder_is_known_by_its_command_line() {
        let argv = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(is_holder_argv(&argv(&["/.podmotion/hold", "hold"])));
        assert!(is_holder_argv(&argv(&["/run/tb/hold", "hold"])));
        assert!(!is_holder_argv(&argv(&["/.podmotion/hold"])));
        assert!(!is_holder_argv(&argv(&["/.podmotion/hold", "hold", "x"])));
        assert!(!is_holder_argv(&argv(&["/bin/app", "hold"])));
        assert!(!is_holder_argv(&argv(&[
            "/.podmotion/hold",
            "install-holder"
        ])));
        assert!(!is_holder_argv(&[]));
    }

    #[test]
    fn an_ordinary_process_holds_nothing() {
        // This test process is no holder: its own PID 1 is the tree to dump.
        assert_eq!(held_workload(std::process::id() as i32), Ok(None));
        assert_eq!(held_workload(i32::MAX), Ok(None));
    }

    #[test]
    fn the_restart_file_travels_with_a_holder_source() {
        let root = std::env::temp_dir().join(format!(
            "pm-holder-root-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(root.join(".podmotion")).unwrap();
        assert_eq!(restart_workload(&root), Ok(None));
        let w = Workload {
            args: vec!["/bin/app".into(), "-v".into()],
            cwd: "/srv".into(),
        };
        std::fs::write(
            root.join(".podmotion/restart.json"),
            serde_json::to_vec(&w).unwrap(),
        )
        .unwrap();
        assert_eq!(restart_workload(&root), Ok(Some(w)));
        std::fs::write(root.join(".podmotion/restart.json"), b"{").unwrap();
        let e = restart_workload(&root).unwrap_err();
        assert!(e.contains("restart.json"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
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
