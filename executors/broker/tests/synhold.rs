//! The kernel fact `synhold` rests on, as root on this machine's kernel: a SYN queued
//! (NFQUEUE) in the raw table's PREROUTING, before conntrack, and accepted after a nat
//! chain was added meets that chain — the held connection reaches the target the DNAT
//! names, with no retransmission.
//!
//! Deterministic, no clock: the client's namespace is the test's own, so its
//! `RetransSegs` (`/proc/net/snmp`) counts its SYN retransmissions alone; it must be 0
//! — only the held SYN itself connected, not a retransmission a second later.
//!
//! In the order the broker must follow: the DNAT added, the hold rule deleted, then the
//! release. (The rule left in place while hooks were registered ahead of it — this
//! namespace's first conntrack user adds the defragmenter's, at -400 — re-queued the
//! released SYN: the kernel resumes a reinjected packet by its index in the hook list,
//! which then named the hold's hook again.)
//!
//! Four network namespaces of the test's own (`pmsh-*`), none of them this machine's:
//! a "node" routing between the source (198.18.241.30, its link down: locked), the
//! target (198.18.242.30, listening on 8080) and a client (198.18.243.30). All of them
//! and their links go with the namespaces, however the test ends.

mod support;

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

use nix::sched::{CloneFlags, setns};
use podmotion_broker::synhold::{Held, Queue, bind_free, install_scripts, remove_script, restore};
use support::{require_root, retrans_segs, sh};

const NETNS: [&str; 4] = ["pmsh-node", "pmsh-src", "pmsh-tgt", "pmsh-cli"];
const SOURCE: &str = "198.18.241.30";
const TARGET: &str = "198.18.242.30";
const QUEUE: u16 = 0x5eed;
const CHAIN: &str = "pm-hold-test";

struct Namespaces;

impl Namespaces {
    fn new() -> Namespaces {
        drop(Namespaces);
        let mut s = String::from("set -e\n");
        for n in NETNS {
            s += &format!("ip netns add {n}\nip -n {n} link set lo up\n");
        }
        s += "ip netns exec pmsh-node sysctl -qw net.ipv4.ip_forward=1\n";
        for (name, octet) in [("src", 241), ("tgt", 242), ("cli", 243)] {
            s += &format!(
                "ip link add pmsh-{name} netns pmsh-node type veth peer name eth0 netns pmsh-{name}\n\
                 ip -n pmsh-node addr add 198.18.{octet}.1/24 dev pmsh-{name}\n\
                 ip -n pmsh-node link set pmsh-{name} up\n\
                 ip -n pmsh-{name} addr add 198.18.{octet}.30/24 dev eth0\n\
                 ip -n pmsh-{name} link set eth0 up\n\
                 ip -n pmsh-{name} route add default via 198.18.{octet}.1\n"
            );
        }
        sh(&s);
        Namespaces
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in NETNS {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", n])
                .status();
        }
    }
}

/// Runs `f` on a thread of its own in namespace `netns`.
fn in_netns<T: Send + 'static>(
    netns: &'static str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    std::thread::spawn(move || {
        let ns = File::open(format!("/run/netns/{netns}")).unwrap();
        setns(ns, CloneFlags::CLONE_NEWNET).unwrap();
        f()
    })
}

#[test]
fn a_held_syn_released_after_a_dnat_was_added_reaches_the_target() {
    if !require_root() {
        return;
    }
    let _ns = Namespaces::new();
    let target = in_netns("pmsh-tgt", || {
        let l = TcpListener::bind((TARGET, 8080)).unwrap();
        let (mut c, peer) = l.accept().unwrap();
        std::io::Write::write_all(&mut c, format!("target saw {}\n", peer.ip()).as_bytes())
            .unwrap();
    });
    // Locked: the source's link is down. The hold: its new connections to the queue.
    sh("ip -n pmsh-src link set eth0 down");
    let held = Held {
        addresses: vec![SOURCE.parse().unwrap()],
        services: vec![],
    };
    // The broker's own scripts, as it applies them (one transaction per family).
    let scripts = install_scripts(CHAIN, &held, QUEUE);
    assert_eq!(scripts.len(), 1, "an IPv4 hold has one family");
    let family = scripts[0].0;
    in_netns("pmsh-node", move || {
        for (f, script) in scripts {
            restore(f, &script).unwrap();
        }
    })
    .join()
    .unwrap();
    let (bound_tx, bound) = mpsc::channel();
    let node = in_netns("pmsh-node", move || {
        let mut q = Queue::bind(QUEUE).unwrap();
        bound_tx.send(()).unwrap();
        while q.held() == 0 {
            q.take(Duration::from_millis(100)).unwrap();
        }
        // The forward, added while the SYN is held.
        sh(&format!(
            "ip netns exec pmsh-node nft -f - <<'EOF'\n\
             table inet pmsh-fwd {{\n\
               chain prerouting {{ type nat hook prerouting priority -110; policy accept;\n\
                 ip daddr {SOURCE} meta l4proto tcp ct state new dnat ip to {TARGET}\n\
               }}\n\
               chain postrouting {{ type nat hook postrouting priority 90; policy accept;\n\
                 ct original ip daddr {SOURCE} ip daddr {TARGET} meta l4proto tcp masquerade\n\
               }}\n\
             }}\nEOF"
        ));
        restore(family, &remove_script(CHAIN)).unwrap();
        q.release().unwrap()
    });
    bound.recv().unwrap();
    let client = in_netns("pmsh-cli", || {
        let to: SocketAddr = format!("{SOURCE}:8080").parse().unwrap();
        let c = TcpStream::connect_timeout(&to, Duration::from_secs(10))?;
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut line = String::new();
        BufReader::new(c).read_line(&mut line)?;
        Ok::<_, std::io::Error>(line)
    });
    let line = client.join().unwrap();
    let released = node.join().unwrap();
    assert_eq!(released, 1, "the client's one SYN was held");
    let line = line.expect("the held connection reached the target");
    assert_eq!(
        retrans_segs("ip netns exec pmsh-cli"),
        0,
        "the client retransmitted its SYN: the held one went nowhere"
    );
    assert_eq!(
        line.trim(),
        "target saw 198.18.242.1",
        "masqueraded, from the node"
    );
    target.join().unwrap();
}

#[test]
fn two_holds_in_one_namespace_each_bind_a_queue_of_their_own() {
    if !require_root() {
        return;
    }
    sh("ip netns add pmsh-queues");
    let got = in_netns("pmsh-queues", || {
        let first = bind_free().expect("the first hold's queue");
        // Another socket's queue answers EPERM, not EBUSY: still taken, not an error.
        let second = bind_free().expect("the second hold's queue, beside the first");
        let third = bind_free().expect("a third");
        (first.num(), second.num(), third.num())
    })
    .join();
    let _ = std::process::Command::new("ip")
        .args(["netns", "del", "pmsh-queues"])
        .status();
    let (a, b, c) = got.unwrap();
    assert!(a != b && b != c && a != c, "{a:#x} {b:#x} {c:#x}");
}
