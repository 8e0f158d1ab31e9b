//! The broker's direct kernel calls: the only module with `unsafe`. Everything that
//! has a safe binding (setns, mount, getsockname, kill) goes through `nix`; the raw calls
//! here are those nix 0.30 does not wrap: pidfd_open/pidfd_getfd and the TCP_REPAIR
//! socket option.

use nix::sched::CloneFlags;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Duplicates descriptor `fd` of process `pid` into the broker (pidfd_getfd(2)).
pub fn steal_fd(pid: i32, fd: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes two integers and returns a new descriptor or -1; no
    // memory is passed.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pidfd_open returned a fresh descriptor that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    // SAFETY: integer arguments only; the result is a new descriptor or -1.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pidfd_getfd returned a fresh descriptor (with O_CLOEXEC) owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(got as i32) })
}

const TCP_REPAIR: libc::c_int = 19;

/// Whether a TCP socket is in repair mode.
pub fn tcp_repair(sock: &OwnedFd) -> std::io::Result<bool> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are valid for writes of the sizes given; `sock` is open.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            TCP_REPAIR,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v != 0)
}

/// Takes a socket out of repair mode (TCP_REPAIR_OFF = 0).
pub fn tcp_repair_off(sock: &OwnedFd) -> std::io::Result<()> {
    let v: libc::c_int = 0;
    // SAFETY: `v` is a valid c_int for reads of its size; `sock` is open.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            TCP_REPAIR,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `f` on a fresh thread that has joined the network namespace of `pid`; child
/// processes it spawns (iproute2) inherit that namespace. The broker's own threads
/// never change namespace.
pub fn in_netns<T: Send + 'static>(
    pid: i32,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::spawn(move || {
        nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
        f()
    })
    .join()
    .map_err(|_| std::io::Error::other("netns worker panicked"))?
}
