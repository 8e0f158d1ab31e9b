//! A simulated node for driving [`crate::Broker`] without touching a real process:
//! [`FakeKernel`] implements [`Kernel`](crate::Kernel) over a small world — a table of processes
//! (pid, parent, start time, cgroup, network namespace, tracer, stopped, TCP sockets),
//! network namespaces with links, IPv4/IPv6 routes and addresses (enough of `ip` to
//! lock and restore them), bind mounts, journal files and a virtual clock — and
//! records every effect the broker has on it. [`Harness`] runs a sequence of [`Op`]s
//! (requests from two agent connections, and the world's own events: CRIU stopping
//! and releasing a tree, processes exiting and pids being reused, connections opened
//! on an address, faults, lease loss, a broker restart, time passing and the sweep of
//! adopted addresses) against one broker and checks the invariants after every step;
//! the fuzz target `fuzz/fuzz_targets/dispatch.rs` and the unit tests drive it.
//!
//! Compiled only for the broker's tests and with the `fake` feature (the fuzz targets'),
//! never into the shipped binary. Layout, each module naming only those below it:
//! `world` (the node's state and constants), `kernel` (the [`Kernel`](crate::Kernel)
//! over it), `model` (ops, the harness's model, the broker's configuration),
//! `invariants` (the checks after every step), `lease` (the hand-over, lost leases
//! and restarts as the model sees them) and `harness` (one step).

mod harness;
mod invariants;
mod kernel;
mod lease;
mod model;
mod world;

pub use kernel::{FakeKernel, Pause};
pub use model::{Harness, Op, config};
pub use world::*;
