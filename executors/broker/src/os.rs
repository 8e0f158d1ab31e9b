//! The broker's kernel layer: everything [`crate::Broker`] reaches the node through —
//! /proc lookups, signals, `pidfd_getfd` and TCP repair, `ip` in a pod's network
//! namespace, bind mounts, cgroup writes, the journal files, a namespace's TCP table
//! and the clocks — behind one
//! trait, [`Kernel`]. The binary uses [`RealKernel`] (the calls it always made, moved
//! here unchanged); tests and the fuzzer use `crate::fake::FakeKernel` (feature `fake`), a small
//! simulated node, so that the dispatcher can be driven hard without touching a real
//! process. No `unsafe` here: the raw calls are in [`crate::kernel`].

use crate::{err, kernel, kerr, procfs};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use podmotion_wire::broker::{BrokerError, ErrorKind, SocketAddrs};
use podmotion_wire::ids::ProcRef;
use std::io::Write;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// A link of a pod's network namespace, as `ip -o link show` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub name: String,
    pub index: i32,
    /// Its Ethernet address; `None` for a link without one (`link/none`, loopback).
    pub mac: Option<[u8; 6]>,
}

/// Runs `ip` (iproute2) inside the network namespace [`Kernel::in_netns`] entered, and
/// announces addresses there.
pub trait Ip {
    fn ip(&mut self, args: &[&str]) -> std::io::Result<String>;
    /// Tells the neighbours on `link` (which has a MAC) that `addr` is there: a
    /// gratuitous ARP request for IPv4, an unsolicited Neighbour Advertisement for IPv6.
    fn announce(&mut self, link: &Link, addr: std::net::IpAddr) -> std::io::Result<()>;
    /// Sets `link`'s `arp_ignore` (`net.ipv4.conf.<link>.arp_ignore`, this namespace's)
    /// to `value`; returns the value it had.
    fn arp_ignore(&mut self, link: &str, value: u8) -> std::io::Result<u8>;
    /// Runs `script` with `nft -f -` (nftables, one transaction) in this namespace.
    fn nft(&mut self, script: &str) -> std::io::Result<()>;
}

/// The longest one sweep runs, whatever the lock: a lock outliving it (a PostCopy
/// source serving pages for that long) leaves its later clients to their retransmissions.
pub const SWEEP_AT_MOST: Duration = Duration::from_secs(600);

/// Whether a sweep of unanswered connections is to go on: shared by the lock's
/// [`crate::conntrack::Sweep`] and the thread doing it.
#[derive(Clone, Debug)]
pub struct SweepFlag(pub(crate) std::sync::Arc<std::sync::atomic::AtomicBool>);

impl SweepFlag {
    /// Whether the lock it belongs to still holds.
    pub fn on(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// What the broker needs from the node. Errors are the broker's typed errors where the
/// broker forwards them, `io::Error` where it maps them itself (as before the trait).
pub trait Kernel: Send + Sync + 'static {
    /// The broker's own pid.
    fn self_pid(&self) -> i32;
    /// Start time of `pid` (clock ticks since boot); `NoSuchProcess` if it is gone.
    fn start_time(&self, pid: i32) -> Result<u64, BrokerError>;
    /// Whether `pid` is a zombie; `NoSuchProcess` if it is gone.
    fn is_zombie(&self, pid: i32) -> Result<bool, BrokerError>;
    /// cgroup v2 path of `pid`.
    fn cgroup_of(&self, pid: i32) -> Result<String, BrokerError>;
    /// `net:[inode]` of `pid`'s network namespace.
    fn netns_inode(&self, pid: i32) -> Result<String, BrokerError>;
    /// The node's own network namespace.
    fn node_netns(&self) -> String;
    fn tracer_pid(&self, pid: i32) -> Option<i32>;
    /// The process tree rooted at `root`, root first.
    fn tree(&self, root: i32) -> Vec<i32>;
    /// (fd, socket inode) of each TCP socket `pid` holds.
    fn tcp_fds(&self, pid: i32) -> Vec<(i32, u64)>;
    /// The addresses of TCP socket `fd` of `pid` (read through a duplicate of it that
    /// is closed before this returns: no descriptor outlives the call).
    fn socket_addrs(&self, pid: i32, fd: i32) -> std::io::Result<SocketAddrs>;
    /// Takes socket `fd` of `pid` out of TCP repair if it is in repair; a descriptor
    /// that cannot be taken or queried is skipped.
    fn repair_off(&self, pid: i32, fd: i32) -> Result<(), BrokerError>;
    fn signal(&self, pid: i32, sig: Signal) -> nix::Result<()>;
    /// Runs `f` inside the network namespace of `pid`.
    fn in_netns<T: Send + 'static>(
        &self,
        pid: i32,
        f: impl FnOnce(&mut dyn Ip) -> std::io::Result<T> + Send + 'static,
    ) -> std::io::Result<T>;
    /// Runs `f` inside the node's own network namespace (init's: the broker runs with
    /// the node's PID namespace).
    fn in_node_netns<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Ip) -> std::io::Result<T> + Send + 'static,
    ) -> std::io::Result<T> {
        self.in_netns(1, f)
    }
    /// Writes every pid of `tree` into the cgroups of `holder` (v1 hierarchies and the
    /// v2 path `cgroup_v2`).
    fn move_into_cgroups_of(
        &self,
        holder: i32,
        cgroup_v2: &str,
        tree: &[i32],
    ) -> Result<(), BrokerError>;
    /// Writes `pid` into the memory cgroup of `holder` (its v1 `memory` hierarchy, and
    /// the v2 path `cgroup_v2` where it exists): what `pid` allocates from then on, and
    /// what it forks, is charged there.
    fn charge_memory_to(&self, holder: i32, cgroup_v2: &str, pid: i32) -> Result<(), BrokerError>;
    /// Bind-mounts the network namespace of `pid` at `path` (never through a symlink).
    fn bind_netns(&self, pid: i32, path: &Path) -> Result<(), BrokerError>;
    /// Detaches and removes the mount at `path` (absent is fine).
    fn unbind(&self, path: &Path) -> Result<(), BrokerError>;
    /// Writes `body` to `dir/name` atomically (0600, `dir` made 0700, never a symlink).
    fn journal_write(&self, dir: &Path, name: &str, body: &[u8]) -> Result<(), BrokerError>;
    fn remove_file(&self, path: &Path);
    /// (file name, path) of each entry of `dir`; empty if it cannot be read or is a
    /// symlink (never followed).
    fn read_dir(&self, dir: &Path) -> Vec<(String, PathBuf)>;
    /// The contents of the regular file at `path`; `None` if it cannot be read or is a
    /// symlink (never followed).
    fn read_file(&self, path: &Path) -> Option<Vec<u8>>;
    /// The local address and state (`/proc/net/tcp`'s `st`) of every TCP socket in the
    /// network namespace of `pid`.
    fn tcp_states(&self, pid: i32) -> std::io::Result<Vec<(std::net::IpAddr, u8)>>;
    /// Deletes, in the node's network namespace, the TCP connections to `addrs` that
    /// never got an answer, every `every` for `for_`, in the background
    /// ([`crate::conntrack`]); returns at once.
    /// Deletes, every `every` while `flag` is on (and at most
    /// [`SWEEP_AT_MOST`]), the node's conntrack entries of TCP
    /// connections to `addrs` that never got an answer; in the background.
    fn sweep_unanswered(&self, addrs: Vec<std::net::IpAddr>, flag: SweepFlag, every: Duration);
    /// Starts holding, in the node's network namespace, the new TCP connections `held`
    /// names in raw-table chain `chain` ([`crate::synhold`]); returns once the rules
    /// are in, or fails leaving none.
    fn hold_syns(
        &self,
        chain: String,
        held: crate::synhold::Held,
    ) -> std::io::Result<crate::synhold::Hold>;
    /// Removes hold chain `chain` from the node (a previous broker process's, at
    /// start); absent is fine.
    fn remove_hold(&self, chain: &str) -> std::io::Result<()>;
    fn now(&self) -> Instant;
    /// Wall-clock time, seconds since the Unix epoch (the hand-over journal's
    /// deadlines, which must survive a broker restart).
    fn unix_now(&self) -> u64;
    fn sleep(&self, d: Duration);

    /// The process named by `p`, or a typed error if it died or its pid was reused.
    fn check_live(&self, p: ProcRef) -> Result<(), BrokerError> {
        let no_such = || {
            BrokerError::new(
                ErrorKind::NoSuchProcess,
                format!("pid {} is not alive", p.pid),
            )
        };
        if p.pid <= 1 {
            return Err(no_such());
        }
        let st = self.start_time(p.pid)?;
        if st != p.start_time {
            return Err(BrokerError::new(
                ErrorKind::PidReused,
                format!("pid {} has start time {st}, not {}", p.pid, p.start_time),
            ));
        }
        // A zombie has no namespaces or fds to act on.
        if self.is_zombie(p.pid)? {
            return Err(no_such());
        }
        Ok(())
    }
}

/// The node itself: /proc, syscalls, iproute2, the real filesystem.
#[derive(Clone, Copy, Debug, Default)]
pub struct RealKernel;

struct RealIp;

impl Ip for RealIp {
    fn ip(&mut self, args: &[&str]) -> std::io::Result<String> {
        let out = Command::new("ip").args(args).output()?;
        if !out.status.success() {
            return Err(std::io::Error::other(format!(
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn announce(&mut self, link: &Link, addr: std::net::IpAddr) -> std::io::Result<()> {
        let mac = link
            .mac
            .ok_or_else(|| std::io::Error::other(format!("{} has no MAC", link.name)))?;
        match addr {
            std::net::IpAddr::V4(a) => kernel::announce_ipv4(link.index, mac, a),
            std::net::IpAddr::V6(a) => kernel::announce_ipv6(link.index, mac, a),
        }
    }

    fn arp_ignore(&mut self, link: &str, value: u8) -> std::io::Result<u8> {
        // A link name from `ip link`; never a path.
        if link.is_empty() || link.contains('/') || link.starts_with('.') {
            return Err(std::io::Error::other(format!("not a link name: {link:?}")));
        }
        // /proc/sys/net is the namespace of the thread that opens it: this one.
        let path = format!("/proc/sys/net/ipv4/conf/{link}/arp_ignore");
        let was = std::fs::read_to_string(&path)?
            .trim()
            .parse::<u8>()
            .map_err(|e| std::io::Error::other(format!("{path}: {e}")))?;
        std::fs::write(&path, value.to_string())?;
        Ok(was)
    }

    fn nft(&mut self, script: &str) -> std::io::Result<()> {
        kernel::run_script("nft", &["-f", "-"], script)
    }
}

impl Kernel for RealKernel {
    fn self_pid(&self) -> i32 {
        std::process::id() as i32
    }

    fn start_time(&self, pid: i32) -> Result<u64, BrokerError> {
        procfs::start_time(pid)
    }

    fn is_zombie(&self, pid: i32) -> Result<bool, BrokerError> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|_| {
            BrokerError::new(ErrorKind::NoSuchProcess, format!("pid {pid} is not alive"))
        })?;
        Ok(status
            .lines()
            .any(|l| l.starts_with("State:") && l.contains('Z')))
    }

    fn cgroup_of(&self, pid: i32) -> Result<String, BrokerError> {
        procfs::cgroup_of(pid)
    }

    fn netns_inode(&self, pid: i32) -> Result<String, BrokerError> {
        procfs::netns_inode(pid)
    }

    fn node_netns(&self) -> String {
        procfs::node_netns()
    }

    fn tracer_pid(&self, pid: i32) -> Option<i32> {
        procfs::tracer_pid(pid)
    }

    fn tree(&self, root: i32) -> Vec<i32> {
        procfs::tree(root)
    }

    fn tcp_fds(&self, pid: i32) -> Vec<(i32, u64)> {
        procfs::tcp_fds(pid)
    }

    fn socket_addrs(&self, pid: i32, fd: i32) -> std::io::Result<SocketAddrs> {
        let dup = kernel::steal_fd(pid, fd)?;
        Ok(addrs_of(dup.as_fd()))
    }

    fn repair_off(&self, pid: i32, fd: i32) -> Result<(), BrokerError> {
        let Ok(sock) = kernel::steal_fd(pid, fd) else {
            return Ok(());
        };
        if kernel::tcp_repair(&sock).unwrap_or(false) {
            kernel::tcp_repair_off(&sock).map_err(kerr)?;
        }
        Ok(())
    }

    fn signal(&self, pid: i32, sig: Signal) -> nix::Result<()> {
        kill(Pid::from_raw(pid), sig)
    }

    fn in_netns<T: Send + 'static>(
        &self,
        pid: i32,
        f: impl FnOnce(&mut dyn Ip) -> std::io::Result<T> + Send + 'static,
    ) -> std::io::Result<T> {
        kernel::in_netns(pid, move || f(&mut RealIp))
    }

    fn in_node_netns<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Ip) -> std::io::Result<T> + Send + 'static,
    ) -> std::io::Result<T> {
        kernel::in_netns(procfs::node_netns_pid()?, move || f(&mut RealIp))
    }

    fn move_into_cgroups_of(
        &self,
        holder: i32,
        cgroup_v2: &str,
        tree: &[i32],
    ) -> Result<(), BrokerError> {
        write_into_cgroups_of(holder, cgroup_v2, tree, |_| true)
    }

    fn charge_memory_to(&self, holder: i32, cgroup_v2: &str, pid: i32) -> Result<(), BrokerError> {
        write_into_cgroups_of(holder, cgroup_v2, &[pid], |ctrls| {
            ctrls.split(',').any(|c| c == "memory")
        })
    }

    fn bind_netns(&self, pid: i32, path: &Path) -> Result<(), BrokerError> {
        let point = mount_point(path)?;
        let src = format!("/proc/{pid}/ns/net");
        // Mount onto the file we opened (its /proc/self/fd link), not onto a path that
        // could be swapped for a symlink in between.
        let target = format!("/proc/self/fd/{}", point.as_raw_fd());
        nix::mount::mount(
            Some(src.as_str()),
            target.as_str(),
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(|e| {
            let _ = std::fs::remove_file(path);
            kerr(e)
        })
    }

    fn unbind(&self, path: &Path) -> Result<(), BrokerError> {
        let flags = nix::mount::MntFlags::MNT_DETACH | nix::mount::MntFlags::UMOUNT_NOFOLLOW;
        match nix::mount::umount2(path, flags) {
            Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
            Err(e) => return Err(kerr(e)),
        }
        let _ = std::fs::remove_file(path);
        Ok(())
    }

    fn journal_write(&self, dir: &Path, name: &str, body: &[u8]) -> Result<(), BrokerError> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(kerr)?;
        if std::fs::symlink_metadata(dir)
            .map_err(kerr)?
            .file_type()
            .is_symlink()
        {
            return Err(err(
                ErrorKind::UnsafePath,
                format!("{} is a symlink: refused, nothing followed", dir.display()),
            ));
        }
        let tmp = dir.join(format!(".{name}.tmp"));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(kerr)?;
        f.write_all(body).map_err(kerr)?;
        f.sync_all().map_err(kerr)?;
        std::fs::rename(&tmp, dir.join(name)).map_err(kerr)
    }

    /// Never through a symlink planted at the file's directory (the file itself, a
    /// link, is removed, not followed).
    fn remove_file(&self, path: &Path) {
        if path
            .parent()
            .is_some_and(|d| std::fs::symlink_metadata(d).is_ok_and(|m| m.file_type().is_symlink()))
        {
            tracing::warn!(file = %path.display(), "not removed: its directory is a symlink");
            return;
        }
        let _ = std::fs::remove_file(path);
    }

    fn read_dir(&self, dir: &Path) -> Vec<(String, PathBuf)> {
        if std::fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink()) {
            tracing::warn!(dir = %dir.display(), "a symlink where the broker keeps its records: not followed");
            return Vec::new();
        }
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
            .collect()
    }

    fn read_file(&self, path: &Path) -> Option<Vec<u8>> {
        use std::io::Read;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
            .open(path)
            .ok()?;
        if !f.metadata().ok()?.is_file() {
            return None;
        }
        let mut body = Vec::new();
        f.read_to_end(&mut body).ok()?;
        Some(body)
    }

    fn tcp_states(&self, pid: i32) -> std::io::Result<Vec<(std::net::IpAddr, u8)>> {
        procfs::tcp_states(pid)
    }

    fn sweep_unanswered(&self, addrs: Vec<std::net::IpAddr>, flag: SweepFlag, every: Duration) {
        let (k, addrs_of_log) = (*self, addrs.clone());
        std::thread::spawn(move || {
            // One entry into the node's namespace for the whole sweep.
            let r = k.in_node_netns(move |_| {
                let (t, mut forgotten) = (Instant::now(), 0u32);
                while flag.on() && t.elapsed() < SWEEP_AT_MOST {
                    for a in &addrs {
                        let out = Command::new("conntrack")
                            .args(conntrack_delete_args(*a))
                            .output()?;
                        // 1 with nothing deleted; anything else is a failure.
                        if !out.status.success() && out.status.code() != Some(1) {
                            return Err(std::io::Error::other(format!(
                                "conntrack -D (after {forgotten} forgotten): {}",
                                String::from_utf8_lossy(&out.stderr).trim()
                            )));
                        }
                        forgotten += conntrack_deleted_count(&String::from_utf8_lossy(&out.stderr));
                    }
                    std::thread::sleep(every);
                }
                Ok(forgotten)
            });
            match r {
                Ok(forgotten) => tracing::info!(
                    ?addrs_of_log,
                    forgotten,
                    "lock: the node forgot the unanswered connections to the locked pod's addresses"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "lock: unanswered connections not forgotten")
                }
            }
        });
    }

    fn hold_syns(
        &self,
        chain: String,
        held: crate::synhold::Held,
    ) -> std::io::Result<crate::synhold::Hold> {
        crate::synhold::start(procfs::node_netns_pid()?, chain, held)
    }

    fn remove_hold(&self, chain: &str) -> std::io::Result<()> {
        crate::synhold::remove(procfs::node_netns_pid()?, chain)
    }

    fn now(&self) -> Instant {
        Instant::now()
    }

    fn unix_now(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    }

    fn sleep(&self, d: Duration) {
        std::thread::sleep(d)
    }
}

/// What `list_sockets` reports of a socket: whether it listens, its local address and,
/// unless it listens, its peer's. An address the kernel does not give (an unconnected
/// socket has no peer) is `None`.
pub fn addrs_of(sock: BorrowedFd<'_>) -> SocketAddrs {
    use nix::sys::socket::{
        SockaddrStorage, getpeername, getsockname, getsockopt, sockopt::AcceptConn,
    };
    let fd = sock.as_raw_fd();
    let ip = |a: SockaddrStorage| -> Option<SocketAddr> {
        a.as_sockaddr_in()
            .map(|v4| SocketAddr::V4((*v4).into()))
            .or_else(|| a.as_sockaddr_in6().map(|v6| SocketAddr::V6((*v6).into())))
    };
    let listening = getsockopt(&sock, AcceptConn).unwrap_or(false);
    SocketAddrs {
        local: getsockname(fd).ok().and_then(ip),
        remote: if listening {
            None
        } else {
            getpeername(fd).ok().and_then(ip)
        },
        listening,
    }
}

/// Opens (creating it) the regular file at `path` that a netns is bind-mounted onto,
/// refusing to follow a symlink at the file or at its directory: the directory is made
/// by the broker (0700) or must already be a real directory, and the file is opened
/// with O_NOFOLLOW. A planted link is reported, never followed, never removed.
fn mount_point(path: &Path) -> Result<std::fs::File, BrokerError> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let unsafe_path = |what: &Path, why: &str| {
        err(
            ErrorKind::UnsafePath,
            format!("{} {why}: refused, nothing followed", what.display()),
        )
    };
    let dir = path.parent().expect("netns paths have a parent");
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.file_type().is_symlink() => return Err(unsafe_path(dir, "is a symlink")),
        Ok(m) if !m.is_dir() => return Err(unsafe_path(dir, "is not a directory")),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(kerr)?;
        }
        Err(e) => return Err(kerr(e)),
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(nix::libc::ELOOP) => unsafe_path(path, "is a symlink"),
            _ => kerr(e),
        })
        .and_then(|f| {
            if f.metadata().map_err(kerr)?.is_file() {
                Ok(f)
            } else {
                Err(unsafe_path(path, "is not a regular file"))
            }
        })
}

/// Writes every pid of `tree` into the cgroups of `holder`: the v1 hierarchies whose
/// controllers `accept` accepts, and the v2 path `cgroup_v2` (see [`cgroup_targets`]).
fn write_into_cgroups_of(
    holder: i32,
    cgroup_v2: &str,
    tree: &[i32],
    accept: impl Fn(&str) -> bool,
) -> Result<(), BrokerError> {
    let text = std::fs::read_to_string(format!("/proc/{holder}/cgroup"))
        .map_err(|_| err(ErrorKind::NoSuchProcess, format!("pid {holder} is gone")))?;
    let mi = std::fs::read_to_string("/proc/self/mountinfo").map_err(kerr)?;
    let targets = cgroup_targets(&text, &mi, cgroup_v2, accept)?;
    // A v2 directory the v1 moves make optional: written only where it exists.
    for t in targets {
        if t.optional && !t.dir.is_dir() {
            continue;
        }
        let procs = t.dir.join("cgroup.procs");
        for pid in tree {
            std::fs::write(&procs, pid.to_string())
                .map_err(|e| kerr(format!("{}: {e}", procs.display())))?;
        }
    }
    Ok(())
}

/// A cgroup directory a move writes into (its `cgroup.procs`).
#[derive(Debug, PartialEq, Eq)]
pub struct CgroupTarget {
    pub dir: std::path::PathBuf,
    /// Skipped when the directory does not exist (the v2 one on a hybrid host).
    pub optional: bool,
}

/// Where a move into the cgroups of a holder writes, from the holder's
/// `/proc/<pid>/cgroup` text and the broker's mountinfo: the holder's directory in
/// each v1 hierarchy whose controllers `accept` accepts, then `cgroup_v2` (the v2 path
/// pinned at registration) in the cgroup2 mount.
/// - Unified host (no v1 membership): the v2 directory only, required.
/// - Hybrid host (v1 controllers, the v2 hierarchy in use: the holder's v2 path is
///   `cgroup_v2`): the v1 directories, then the v2 one where it exists (the runtime may
///   not have made it).
/// - Legacy v1 host (the holder at the v2 root, or no cgroup2 mounted): the v1
///   directories only; the pinned path is then the holder's v1 path
///   ([`procfs::cgroup_path`]).
pub fn cgroup_targets(
    proc_cgroup: &str,
    mountinfo: &str,
    cgroup_v2: &str,
    accept: impl Fn(&str) -> bool,
) -> Result<Vec<CgroupTarget>, BrokerError> {
    let v1: Vec<_> = procfs::parse_cgroup_v1(proc_cgroup)
        .into_iter()
        .filter(|(ctrls, _)| accept(ctrls))
        .collect();
    let rel = |p: &str| {
        let p = p.trim_start_matches('/');
        // The kernel prints no `..`; a path with one is refused, never joined.
        if p.split('/').any(|c| c == "..") {
            return Err(err(
                ErrorKind::Kernel,
                format!("cgroup path {p} climbs out of its hierarchy"),
            ));
        }
        Ok(p.to_owned())
    };
    let mut out = Vec::new();
    for (ctrls, path) in &v1 {
        let mp = procfs::cgroup_v1_mount(mountinfo, ctrls).ok_or_else(|| {
            err(
                ErrorKind::Kernel,
                format!("cgroup v1 hierarchy {ctrls} is not mounted in the broker"),
            )
        })?;
        out.push(CgroupTarget {
            dir: mp.join(rel(path)?),
            optional: false,
        });
    }
    let holder_v2 = proc_cgroup.lines().find_map(|l| l.strip_prefix("0::"));
    if !v1.is_empty() && holder_v2 != Some(cgroup_v2) {
        return Ok(out);
    }
    let mount = match procfs::cgroup2_mount_in(mountinfo) {
        Some(m) => m,
        None if !v1.is_empty() => return Ok(out),
        None => return Err(err(ErrorKind::Kernel, "cgroup2 is not mounted")),
    };
    out.push(CgroupTarget {
        dir: mount.join(rel(cgroup_v2)?),
        optional: !v1.is_empty(),
    });
    Ok(out)
}

/// `conntrack` arguments deleting the TCP connections to `addr` that never got an
/// answer (the reply direction's source is the DNAT target, `addr`).
pub fn conntrack_delete_args(addr: std::net::IpAddr) -> Vec<String> {
    let family = if addr.is_ipv4() { "ipv4" } else { "ipv6" };
    [
        "-D",
        "-f",
        family,
        "-p",
        "tcp",
        "--reply-src",
        &addr.to_string(),
        "--state",
        "SYN_SENT",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The count `conntrack -D` reports on stderr (`… 3 flow entries have been deleted.`).
pub fn conntrack_deleted_count(stderr: &str) -> u32 {
    stderr
        .lines()
        .find_map(|l| {
            let rest = l.strip_suffix(" flow entries have been deleted.")?;
            rest.rsplit(' ').next()?.parse().ok()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delete_names_the_family_the_reply_source_and_syn_sent() {
        assert_eq!(
            conntrack_delete_args("198.18.0.5".parse().unwrap()).join(" "),
            "-D -f ipv4 -p tcp --reply-src 198.18.0.5 --state SYN_SENT"
        );
        assert_eq!(
            conntrack_delete_args("2001:db8::5".parse().unwrap()).join(" "),
            "-D -f ipv6 -p tcp --reply-src 2001:db8::5 --state SYN_SENT"
        );
    }

    #[test]
    fn the_deleted_count_is_read_from_conntracks_report() {
        assert_eq!(
            conntrack_deleted_count(
                "conntrack v1.4.7 (conntrack-tools): 2 flow entries have been deleted.\n"
            ),
            2
        );
        assert_eq!(
            conntrack_deleted_count(
                "conntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.\n"
            ),
            0
        );
        assert_eq!(conntrack_deleted_count("conntrack: something else\n"), 0);
    }

    const SCOPE: &str = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod6fecc63a_68d4.slice/cri-containerd-3d359f10a9c1.scope";
    const LEAF: &str = "/kubepods/burstable/pod6fecc63a-68d4/3d359f10a9c1";

    fn dirs(t: &[CgroupTarget]) -> Vec<(String, bool)> {
        t.iter()
            .map(|t| (t.dir.display().to_string(), t.optional))
            .collect()
    }

    #[test]
    fn a_unified_hosts_move_writes_the_v2_directory_only() {
        let mi = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        let cg = format!("0::{SCOPE}\n");
        let t = cgroup_targets(&cg, mi, SCOPE, |_| true).unwrap();
        assert_eq!(dirs(&t), [(format!("/sys/fs/cgroup{SCOPE}"), false)]);
        // No cgroup2 mounted and no v1 hierarchy: nowhere to move, an error.
        assert!(cgroup_targets(&cg, "", SCOPE, |_| true).is_err());
    }

    const HYBRID_MI: &str = "\
32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
";

    #[test]
    fn a_hybrid_hosts_move_writes_every_v1_hierarchy_then_v2_where_it_exists() {
        for path in [SCOPE, LEAF] {
            let cg = format!("9:name=systemd:{path}\n4:memory:{path}\n1:cpu:{path}\n0::{path}\n");
            let t = cgroup_targets(&cg, HYBRID_MI, path, |_| true).unwrap();
            assert_eq!(
                dirs(&t),
                [
                    (format!("/sys/fs/cgroup/systemd{path}"), false),
                    (format!("/sys/fs/cgroup/memory{path}"), false),
                    (format!("/sys/fs/cgroup/cpu{path}"), false),
                    (format!("/sys/fs/cgroup/unified{path}"), true),
                ]
            );
            // The memory charge: the memory hierarchy and v2 only.
            let t = cgroup_targets(&cg, HYBRID_MI, path, |c| {
                c.split(',').any(|c| c == "memory")
            })
            .unwrap();
            assert_eq!(
                dirs(&t),
                [
                    (format!("/sys/fs/cgroup/memory{path}"), false),
                    (format!("/sys/fs/cgroup/unified{path}"), true),
                ]
            );
        }
    }

    #[test]
    fn a_legacy_v1_hosts_move_writes_the_v1_hierarchies_only() {
        // The holder at the v2 root (the hierarchy unused): its pinned path is its v1
        // one, never joined to the cgroup2 mount.
        let cg = format!("9:name=systemd:{LEAF}\n1:cpu:{LEAF}\n0::/\n");
        assert_eq!(procfs::cgroup_path(&cg).as_deref(), Some(LEAF));
        let t = cgroup_targets(&cg, HYBRID_MI, LEAF, |_| true).unwrap();
        assert_eq!(
            dirs(&t),
            [
                (format!("/sys/fs/cgroup/systemd{LEAF}"), false),
                (format!("/sys/fs/cgroup/cpu{LEAF}"), false),
            ]
        );
        // No cgroup2 mounted at all.
        let mi: String = HYBRID_MI
            .lines()
            .take(3)
            .map(|l| format!("{l}\n"))
            .collect();
        let t = cgroup_targets(&cg, &mi, LEAF, |_| true).unwrap();
        assert_eq!(t.len(), 2);
        // A hierarchy the holder is in but the broker has not mounted: an error.
        let cg = format!("5:pids:{LEAF}\n0::/\n");
        assert!(cgroup_targets(&cg, HYBRID_MI, LEAF, |_| true).is_err());
    }

    #[test]
    fn a_path_that_climbs_is_never_joined_to_a_mount() {
        let cg = "1:cpu:/kubepods/../../etc\n0::/kubepods/../x\n";
        assert!(cgroup_targets(cg, HYBRID_MI, "/kubepods/../x", |_| true).is_err());
        let cg = "0::/kubepods/../x\n";
        let mi = "30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert!(cgroup_targets(cg, mi, "/kubepods/../x", |_| true).is_err());
    }
}
