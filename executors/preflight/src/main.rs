//! Runner node preflight: checks KVM, user namespaces, AppArmor and quotas
#![forbid(unsafe_code)]

fn main() {}
