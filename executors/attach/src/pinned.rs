//! A target process pinned at attach time, so that nothing later follows its PID.
//!
//! A PID is a number the kernel hands out again once its process is gone: a path
//! rebuilt as `/proc/<pid>/root` on a later request reaches whatever process holds the
//! number then — the node's own, with the agent's root and `CAP_DAC_READ_SEARCH`. So
//! each target container's process is pinned once, when the agent attaches: an open
//! directory descriptor of `/proc/<pid>`. Such a descriptor stands for the process
//! itself (the kernel's `struct pid`, as a pidfd does), not for its number: every
//! lookup under it (`root`, `environ`, `ns/net`, `stat`) reaches that process or fails
//! once it has exited, even after the number went to another process. Everything the
//! agent reads of a target goes through [`Pinned`]; paths handed to others (the export
//! links, the namespace file) go through the agent's own descriptor table
//! (`<proc>/<agent pid>/fd/<n>/…`), which resolves through the same pin.

use nix::errno::Errno;
use nix::fcntl::{OFlag, openat};
use nix::sys::stat::{Mode, fstatat};
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

/// One target process, held by an open directory of its `/proc` entry.
#[derive(Debug)]
pub struct Pinned {
    dir: OwnedFd,
    /// `<proc>/<agent pid>/fd/<dir>`: a path that resolves through the pin.
    path: PathBuf,
}

impl Pinned {
    /// Pins the process `pid` of the procfs at `proc_root` (the host's, as the Job
    /// mounts it).
    pub fn open(proc_root: &Path, pid: u32) -> std::io::Result<Pinned> {
        Self::open_dir(proc_root, &proc_root.join(pid.to_string()))
    }

    /// Pins the process whose `/proc` directory is `dir` (a plain directory laid out
    /// like one, in tests). `proc_root` names the agent's own descriptors in
    /// [`Pinned::path`].
    pub fn open_dir(proc_root: &Path, dir: &Path) -> std::io::Result<Pinned> {
        let dir = nix::fcntl::open(
            dir,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        // Our own PID as this procfs numbers it (`self` is a link to it).
        let me = std::fs::read_link(proc_root.join("self"))
            .ok()
            .and_then(|p| p.to_str().map(str::to_owned))
            .unwrap_or_else(|| std::process::id().to_string());
        let path = proc_root
            .join(me)
            .join("fd")
            .join(dir.as_raw_fd().to_string());
        Ok(Pinned { dir, path })
    }

    /// `<proc>/<agent pid>/fd/<n>`: the pinned `/proc/<pid>` directory as a path, for
    /// what takes paths (links, namespace files). Valid while this `Pinned` lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True while the pinned process runs (not exited, not a zombie). Never true of
    /// another process that got its PID.
    pub fn alive(&self) -> bool {
        self.read("stat")
            .is_ok_and(|s| !matches!(stat_state(&s), Some(b'Z' | b'X' | b'x')))
    }

    /// The contents of `/proc/<pid>/<name>` of the pinned process.
    pub fn read(&self, name: &str) -> std::io::Result<Vec<u8>> {
        let fd = openat(
            self.dir.as_fd(),
            name,
            OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOCTTY,
            Mode::empty(),
        )?;
        let mut out = Vec::new();
        std::fs::File::from(fd).read_to_end(&mut out)?;
        Ok(out)
    }

    /// The inode of the pinned process's namespace of `kind` (`net`, `user`, …).
    pub fn ns_inode(&self, kind: &str) -> std::io::Result<u64> {
        let st = fstatat(
            self.dir.as_fd(),
            format!("ns/{kind}").as_str(),
            nix::fcntl::AtFlags::empty(),
        )?;
        Ok(st.st_ino)
    }

    /// The pinned process's root directory (`O_PATH`), for lookups strictly inside it.
    /// Fails (`ENOENT`/`ESRCH`) once the process has exited, whoever has its PID now.
    pub fn root(&self) -> Result<OwnedFd, Errno> {
        openat(
            self.dir.as_fd(),
            "root",
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.dir.as_fd()
    }
}

/// The state letter of a `/proc/<pid>/stat` line (after the parenthesised command,
/// which may hold spaces and parentheses).
fn stat_state(stat: &[u8]) -> Option<u8> {
    let close = stat.iter().rposition(|b| *b == b')')?;
    stat.get(close + 2).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_letter_follows_the_last_parenthesis_of_the_command() {
        assert_eq!(stat_state(b"42 (a) b) c) S 1 2"), Some(b'S'));
        assert_eq!(stat_state(b"42 (sh) Z 1 2"), Some(b'Z'));
        assert_eq!(stat_state(b"garbage"), None);
    }

    #[test]
    fn a_pinned_child_is_alive_until_it_exits_and_its_root_then_fails() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let p = Pinned::open(Path::new("/proc"), child.id()).unwrap();
        assert!(p.alive());
        assert!(p.root().is_ok());
        assert!(p.read("environ").is_ok());
        // The path through our descriptor table reaches the same process: same pid and
        // start time (the rest of the line moves while the child is still exec-ing).
        let identity = |stat: Vec<u8>| {
            let close = stat.iter().rposition(|b| *b == b')').unwrap();
            let pid = String::from_utf8_lossy(&stat[..close])
                .split(' ')
                .next()
                .unwrap()
                .to_string();
            // Field 22 (start time) is the 20th after the command's closing parenthesis.
            let rest = String::from_utf8_lossy(&stat[close + 2..]).into_owned();
            (pid, rest.split(' ').nth(19).unwrap().to_string())
        };
        let ours = identity(std::fs::read(p.path().join("stat")).unwrap());
        assert_eq!(ours.0, child.id().to_string());
        assert_eq!(
            ours,
            identity(std::fs::read(format!("/proc/{}/stat", child.id())).unwrap())
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!p.alive(), "an exited process is not alive");
        assert!(p.root().is_err(), "nor is its root reachable");
        assert!(p.read("stat").is_err());
    }
}
