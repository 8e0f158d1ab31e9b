//! Acting as a workload's own user, for a workload that does not run as root.
//!
//! The agent is uid 0 with a fixed capability set and without `CAP_SYS_PTRACE` and
//! `CAP_SYS_RESOURCE` (docs/security.md). The kernel then refuses it two things on a
//! process of another uid: every ptrace-mode access check (`/proc/<pid>/ns/*`,
//! `/proc/<pid>/fd/*`, `/proc/<pid>/root`, `PTRACE_SEIZE`) and reading its resource
//! limits (`prlimit`), which CRIU's dump does for each task. Both checks pass for a
//! caller whose user and group IDs are the target's own. So, measured on kernel 6.18
//! with CRIU 4.2.1 (docs/security.md, "Non-root workloads"):
//!
//! - the agent's own reads of such a process's `/proc` entries run on a short-lived
//!   thread whose filesystem IDs are the owner's ([`as_owner`]); the filesystem
//!   capabilities the kernel drops on that change are raised again from the thread's
//!   permitted set, so nothing is gained or lost but the identity;
//! - CRIU's dump and pre-dump run as the owner's uid and gid, with the agent's own
//!   capabilities kept as ambient ones, in CRIU's `--unprivileged` mode (a third stage
//!   of this binary, [`criu_command`] / [`run_stage`]). No capability is added.
//!
//! A tree whose processes run as different users cannot be dumped either way here:
//! that needs `CAP_SYS_PTRACE` and `CAP_SYS_RESOURCE` for a root CRIU ([`tree_owner`]).

use std::path::Path;
use std::process::Command;

/// The user and group a process runs as (real, effective, saved and filesystem IDs
/// all equal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

impl Owner {
    /// Root's own processes need no change of identity.
    pub fn is_root(self) -> bool {
        self.uid == 0 && self.gid == 0
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "uid {} gid {}", self.uid, self.gid)
    }
}

/// The owner named by a `/proc/<pid>/status` text; an error for a process whose four
/// user (or group) IDs differ: it changed identity (a setuid program), and no single
/// identity passes the kernel's checks on it.
pub fn parse_owner(status: &str) -> Result<Owner, String> {
    let ids = |key: &str| -> Result<u32, String> {
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .ok_or_else(|| format!("no {key} line"))?;
        let v: Vec<u32> = line
            .split_whitespace()
            .map(|s| s.parse().map_err(|e| format!("{key} {s:?}: {e}")))
            .collect::<Result<_, _>>()?;
        match v.as_slice() {
            [a, rest @ ..] if rest.len() == 3 && rest.iter().all(|x| x == a) => Ok(*a),
            _ => Err(format!(
                "its {key} IDs differ ({}): it changed identity, which no user but root with \
                 CAP_SYS_PTRACE can follow",
                line.trim()
            )),
        }
    };
    Ok(Owner {
        uid: ids("Uid:")?,
        gid: ids("Gid:")?,
    })
}

/// The owner of process `pid` (its `status`, readable by anyone).
pub fn owner_of(pid: i32) -> Result<Owner, String> {
    let path = format!("/proc/{pid}/status");
    let s = std::fs::read_to_string(&path).map_err(|e| format!("read {path}: {e}"))?;
    parse_owner(&s).map_err(|e| format!("process {pid}: {e}"))
}

/// The one owner of every process in the tree rooted at `pid`; an error naming two
/// processes of different users, and what a dump of such a tree needs.
pub fn tree_owner(pid: i32) -> Result<Owner, String> {
    let root = owner_of(pid)?;
    for p in podmotion_broker::procfs::tree(pid) {
        // A process that ended meanwhile is no longer part of the tree.
        let Ok(o) = owner_of(p) else { continue };
        if o != root {
            return Err(mixed_owners(pid, root, p, o));
        }
    }
    Ok(root)
}

/// Why a tree of two users cannot be dumped, and what would allow it.
pub fn mixed_owners(root: i32, root_owner: Owner, other: i32, other_owner: Owner) -> String {
    format!(
        "the container's processes run as different users (pid {root}: {root_owner}, pid \
         {other}: {other_owner}): CRIU can dump them only as root with CAP_SYS_PTRACE and \
         CAP_SYS_RESOURCE, which the agent does not hold (CAP_SYS_RESOURCE is not in the \
         chart value migrationAgent.agent.capabilities, and nodes whose bounding set lacks \
         it cannot grant it)"
    )
}

/// Runs `f` as `owner` for the kernel's checks on files (`/proc/<pid>/…` of its
/// processes): on a thread of its own whose filesystem IDs are the owner's and whose
/// effective capabilities are the agent's; the thread ends with `f`. Root: `f` runs
/// here.
pub fn as_owner<T: Send>(owner: Owner, f: impl FnOnce() -> T + Send) -> std::io::Result<T> {
    if owner.is_root() {
        return Ok(f());
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            crate::kernel::become_fs_owner(owner.uid, owner.gid)?;
            Ok(f())
        })
        .join()
        .map_err(|_| std::io::Error::other("thread acting as the owner panicked"))?
    })
}

/// The stage of this binary that becomes a workload's owner and executes CRIU.
const STAGE: &str = "__criu-as-owner";

/// The command that runs `criu --unprivileged <args>` as `owner`, with the agent's
/// capabilities (see the module's header).
pub fn criu_command(criu: &Path, owner: Owner) -> std::io::Result<Command> {
    let mut c = Command::new(std::env::current_exe()?);
    c.arg(STAGE)
        .arg(owner.uid.to_string())
        .arg(owner.gid.to_string())
        .arg(criu)
        .arg("--unprivileged");
    Ok(c)
}

/// Runs the stage if `args` (the process's argv) names it; the agent's `main` calls it
/// before anything else (one thread: the change of identity is the process's).
/// `None`: not this stage.
pub fn run_stage(args: &[String]) -> Option<i32> {
    if args.get(1).map(String::as_str) != Some(STAGE) {
        return None;
    }
    let res = (|| -> Result<i32, String> {
        let [uid, gid, criu, rest @ ..] = &args[2..] else {
            return Err("usage: <uid> <gid> <criu> <args...>".into());
        };
        let uid: u32 = uid.parse().map_err(|e| format!("uid {uid}: {e}"))?;
        let gid: u32 = gid.parse().map_err(|e| format!("gid {gid}: {e}"))?;
        crate::kernel::become_owner(uid, gid).map_err(|e| format!("become uid {uid}: {e}"))?;
        use std::os::unix::process::CommandExt;
        let e = Command::new(criu).args(rest).exec();
        Err(format!("exec {criu}: {e}"))
    })();
    Some(res.unwrap_or_else(|e| {
        eprintln!("podmotion-agent {STAGE}: {e}");
        127
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(uid: &str, gid: &str) -> String {
        format!(
            "Name:\tpodmotion-testl\nUmask:\t0022\nState:\tS (sleeping)\nUid:\t{uid}\nGid:\t{gid}\nGroups:\t\n"
        )
    }

    #[test]
    fn a_process_of_one_user_is_owned_by_it() {
        let o = parse_owner(&status(
            "65532\t65532\t65532\t65532",
            "65532\t65532\t65532\t65532",
        ))
        .unwrap();
        assert_eq!(
            o,
            Owner {
                uid: 65532,
                gid: 65532
            }
        );
        assert!(!o.is_root());
        let root = parse_owner(&status("0\t0\t0\t0", "0\t0\t0\t0")).unwrap();
        assert!(root.is_root());
        // Root's uid with another group still changes identity for the kernel's checks.
        assert!(
            !parse_owner(&status("0\t0\t0\t0", "5\t5\t5\t5"))
                .unwrap()
                .is_root()
        );
    }

    #[test]
    fn a_process_that_changed_identity_has_no_single_owner() {
        let e = parse_owner(&status("1000\t0\t0\t0", "0\t0\t0\t0")).unwrap_err();
        assert!(
            e.contains("Uid: IDs differ") && e.contains("CAP_SYS_PTRACE"),
            "{e}"
        );
        let e = parse_owner("Uid:\t1\t1\t1\t1\n").unwrap_err();
        assert_eq!(e, "no Gid: line");
    }

    #[test]
    fn a_mixed_tree_names_both_processes_and_the_missing_capabilities() {
        let m = mixed_owners(10, Owner { uid: 0, gid: 0 }, 11, Owner { uid: 33, gid: 33 });
        assert!(
            m.contains("pid 10: uid 0 gid 0") && m.contains("pid 11: uid 33 gid 33"),
            "{m}"
        );
        assert!(m.contains("CAP_SYS_RESOURCE") && m.contains("migrationAgent.agent.capabilities"));
    }

    #[test]
    fn this_process_has_one_owner() {
        let me = nix::unistd::getuid().as_raw();
        assert_eq!(owner_of(std::process::id() as i32).unwrap().uid, me);
        assert!(
            owner_of(i32::MAX)
                .unwrap_err()
                .contains("/proc/2147483647/status")
        );
    }
}
