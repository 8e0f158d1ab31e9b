//! The one KVM ioctl the preflight and the Runner stand-in make: `KVM_GET_API_VERSION`
//! on an open `/dev/kvm`, which proves the descriptor reaches the KVM API (a device node
//! that opens but belongs to another driver, or a cgroup that allows open but not use,
//! would not answer 12).
#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::AsRawFd;

/// The API version every KVM since Linux 2.6.22 reports.
pub const KVM_API_VERSION: i32 = 12;

// KVM_GET_API_VERSION = _IO(KVMIO = 0xAE, 0x00): no argument.
nix::ioctl_none!(kvm_get_api_version, 0xAE, 0x00);

/// `KVM_GET_API_VERSION` on `kvm`.
pub fn api_version(kvm: &File) -> nix::Result<i32> {
    // SAFETY: the ioctl takes no argument and writes no memory of ours; the descriptor is
    // valid for the whole call because `kvm` is borrowed.
    unsafe { kvm_get_api_version(kvm.as_raw_fd()) }
}
