//! The few kernel calls the agent makes that no safe wrapper it links offers: the
//! capability sets (`capget`/`capset`, ambient capabilities) and the changes of
//! identity of [`crate::creds`]. Each `unsafe` block is a plain system call on values
//! owned by the caller.

use std::io::{Error, Result};

const CAP_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// This thread's (effective, permitted, inheritable) capability sets.
fn capget() -> Result<(u64, u64, u64)> {
    let mut h = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut d = [CapData::default(); 2];
    // SAFETY: the header and the two data structs (version 3's layout) are valid,
    // writable and outlive the call.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) };
    if r != 0 {
        return Err(Error::last_os_error());
    }
    let join = |lo: u32, hi: u32| u64::from(lo) | (u64::from(hi) << 32);
    Ok((
        join(d[0].effective, d[1].effective),
        join(d[0].permitted, d[1].permitted),
        join(d[0].inheritable, d[1].inheritable),
    ))
}

/// Sets this thread's capability sets.
fn capset(effective: u64, permitted: u64, inheritable: u64) -> Result<()> {
    let mut h = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let split = |v: u64| (v as u32, (v >> 32) as u32);
    let (e, p, i) = (split(effective), split(permitted), split(inheritable));
    let d = [
        CapData {
            effective: e.0,
            permitted: p.0,
            inheritable: i.0,
        },
        CapData {
            effective: e.1,
            permitted: p.1,
            inheritable: i.1,
        },
    ];
    // SAFETY: the header and data are valid for the call; capset only reads the data.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()) };
    if r != 0 {
        return Err(Error::last_os_error());
    }
    Ok(())
}

fn check(r: libc::c_int) -> Result<()> {
    if r == -1 {
        Err(Error::last_os_error())
    } else {
        Ok(())
    }
}

/// This thread's filesystem IDs become `uid`/`gid` (the kernel's file and ptrace-read
/// checks use them) and its effective capabilities are raised back to its permitted
/// set (a change of fsuid from 0 drops the file capabilities from the effective set).
/// Only this thread changes: `setfsuid` is per thread, and glibc does not apply it to
/// the other threads.
pub fn become_fs_owner(uid: u32, gid: u32) -> Result<()> {
    // SAFETY: plain system calls on integers. setfsuid/setfsgid return the previous
    // ID whether or not they succeeded; a second call with an invalid ID (-1) reads
    // the current one back, which tells.
    unsafe {
        libc::setfsgid(gid);
        libc::setfsuid(uid);
        if libc::setfsgid(u32::MAX) as u32 != gid || libc::setfsuid(u32::MAX) as u32 != uid {
            return Err(Error::other(format!(
                "setfsuid/setfsgid {uid}/{gid} refused (CAP_SETUID/CAP_SETGID missing?)"
            )));
        }
    }
    let (_, permitted, inheritable) = capget()?;
    capset(permitted, permitted, inheritable)
}

/// The calling process (single-threaded: run before any thread exists) becomes
/// `uid`/`gid` in every ID, with no supplementary group, keeping its permitted
/// capabilities as effective, inheritable and ambient ones, so that a program it
/// executes runs as that user with the same capabilities.
pub fn become_owner(uid: u32, gid: u32) -> Result<()> {
    // SAFETY: plain system calls on integers and a null group list of length 0.
    unsafe {
        check(libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0))?;
        check(libc::setgroups(0, std::ptr::null()))?;
        check(libc::setresgid(gid, gid, gid))?;
        check(libc::setresuid(uid, uid, uid))?;
    }
    let (_, permitted, _) = capget()?;
    capset(permitted, permitted, permitted)?;
    for cap in 0..64u64 {
        if permitted & (1 << cap) != 0 {
            // SAFETY: a plain system call on integers.
            check(unsafe {
                libc::prctl(
                    libc::PR_CAP_AMBIENT,
                    libc::PR_CAP_AMBIENT_RAISE as libc::c_ulong,
                    cap as libc::c_ulong,
                    0 as libc::c_ulong,
                    0 as libc::c_ulong,
                )
            })
            .map_err(|e| Error::other(format!("raise ambient capability {cap}: {e}")))?;
        }
    }
    Ok(())
}
