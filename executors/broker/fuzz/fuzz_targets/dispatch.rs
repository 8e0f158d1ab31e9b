//! The broker's op dispatcher (`Broker::handle`, the lease rollback and the restart
//! recovery) over a simulated node (`podmotion_broker::fake`): the input is a sequence
//! of 3-byte ops — requests from two agent connections over three migration UIDs and
//! the node's pids (register → lock_network → list_sockets → release_tcp_repair →
//! move_cgroup → kill → fence → unfence → forget, in any order, with pinned start
//! times right or wrong),
//! and node events between them (CRIU stopping/releasing a tree, exits, pid reuse,
//! new children, injected kernel faults, planted symlinks, a lost lease, a broker
//! restart). After every op the harness checks the invariants (see
//! `Harness::step`; among them: a fenced source is never sent SIGCONT, nothing of its
//! tree lives once its lease ended or a restart found it journalled, and `list_sockets`
//! answers exactly the addresses of the registered tree's sockets); any violation or
//! panic is a crash.
#![no_main]

use libfuzzer_sys::fuzz_target;
use podmotion_broker::fake::Harness;

fuzz_target!(|data: &[u8]| {
    let mut h = Harness::new();
    if let Err(v) = h.run_bytes(data, 64) {
        panic!("invariant violated: {v}");
    }
});
