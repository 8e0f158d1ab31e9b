//! The one KVM ioctl the preflight and the Runner stand-in make: `KVM_GET_API_VERSION`
//! on an open `/dev/kvm`, which proves the descriptor reaches the KVM API (a device node
//! that opens but belongs to another driver, or a cgroup that allows open but not use,
//! would not answer 12).
#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::AsRawFd;

/// The API version every KVM since Linux 2.6.22 reports.
pub const KVM_API_VERSION: i32 = 12;

// KVM_GET_API_VERSION = _IO(KVMIO = 0xAE, 0x00). The kernel answers EINVAL unless the
// argument is 0, so it is passed explicitly: `ioctl_none!` leaves the variadic third
// argument to whatever the register holds (0 by chance with glibc here, not with musl —
// found by the real-node test, where the stand-in's static musl build got EINVAL).
nix::ioctl_write_int_bad!(kvm_get_api_version, nix::request_code_none!(0xAE, 0x00));

/// `KVM_GET_API_VERSION` on `kvm`.
pub fn api_version(kvm: &File) -> nix::Result<i32> {
    // SAFETY: the ioctl reads only its integer argument (0) and writes no memory of
    // ours; the descriptor is valid for the whole call because `kvm` is borrowed.
    unsafe { kvm_get_api_version(kvm.as_raw_fd(), 0) }
}
