//! An unlock makes the node forget the unanswered connections to the source pod's
//! address (`podmotion_broker::conntrack`), on the real kernel, as root: the pod's
//! holder in a fresh network namespace with 198.18.200.30/24, a veth to this machine's
//! own namespace (198.18.200.1/24 — the broker's "node" is PID 1's namespace, this
//! machine's), the broker in this process, and this machine's conntrack table, made to
//! track this namespace's traffic by a table of our own for the test's length. Every
//! address is in 198.18.0.0/15, on links made here, gone with their processes.

mod support;

use podmotion_broker::client::BrokerClient;
use podmotion_wire::broker::*;
use podmotion_wire::ids::MigrationUid;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{container, fixture, holder_in_netns, require_root, sh};

const POD: &str = "198.18.200.30";
/// An address on the same link that nothing answers: not the pod's, never forgotten.
const NOBODY: &str = "198.18.200.31";
const HOST_LINK: &str = "pmct0";
const TABLE: &str = "pm_conntrack_test";

/// The TCP connections to `addr` that never got an answer, in this namespace.
fn unanswered(addr: &str) -> usize {
    let out = Command::new("conntrack")
        .args([
            "-L",
            "-p",
            "tcp",
            "--reply-src",
            addr,
            "--state",
            "SYN_SENT",
        ])
        .output()
        .expect("conntrack (hack/install-deps.sh installs it)");
    String::from_utf8_lossy(&out.stdout).lines().count()
}

/// A client's SYN to `addr`:8080 that it gives up on before any retransmission (the
/// first comes after 1 s), leaving its conntrack entry unanswered.
fn syn(addr: &str) {
    let _ = Command::new("timeout")
        .args([
            "0.3",
            "bash",
            "-c",
            &format!("exec 3<>/dev/tcp/{addr}/8080"),
        ])
        .stderr(Stdio::null())
        .status();
}

/// Undoes what the test made in this machine's namespace, however it ends.
struct Cleanup;

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", HOST_LINK])
            .stderr(Stdio::null())
            .status();
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", TABLE])
            .status();
        for a in [POD, NOBODY] {
            let _ = Command::new("conntrack")
                .args(["-D", "-p", "tcp", "--reply-src", a])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

#[test]
fn an_unlock_makes_the_node_forget_unanswered_connections_to_the_pods_address() {
    if !require_root() {
        return;
    }
    let f = fixture("conntrack", 0);
    let _cleanup = Cleanup;
    // Connection tracking for this namespace's own traffic (a ct rule hooks it).
    sh(&format!(
        "nft add table inet {TABLE} && nft add chain inet {TABLE} out '{{ type filter hook output priority 0; }}' && nft add rule inet {TABLE} out ct state new accept"
    ));
    let (_holder, process) = holder_in_netns(&f);
    let pid = process.pid;
    sh(&format!(
        "ip link add {HOST_LINK} type veth peer name eth0 netns {pid} && ip addr add 198.18.200.1/24 dev {HOST_LINK} && ip link set {HOST_LINK} up"
    ));
    sh(&format!(
        "nsenter -t {pid} -n sh -c 'ip link set lo up && ip addr add {POD}/24 dev eth0 && ip link set eth0 up'"
    ));

    let uid = MigrationUid::parse("conntrack-forget").unwrap();
    let mut c = BrokerClient::connect(&f.socket).unwrap();
    c.call(&Request::Register {
        uid: uid.clone(),
        role: BrokerRole::Source,
        process,
        container: container(),
    })
    .expect("the holder registers as a source");
    c.call(&Request::LockNetwork { uid: uid.clone() })
        .expect("lock");

    // Two clients nobody answers: one to the locked pod, one to an address nobody has.
    syn(POD);
    syn(NOBODY);
    assert_eq!(unanswered(POD), 1, "a client's SYN to the locked pod");
    assert_eq!(unanswered(NOBODY), 1, "a client's SYN to nobody");
    // The SYNs wait in this namespace's neighbour queue while the pod's address does
    // not resolve; once resolution failed they are dropped, so that the unlock below
    // delivers nothing to the pod (its answer would end the entry by itself).
    let t = Instant::now();
    while !sh(&format!("ip neigh show {POD} dev {HOST_LINK}")).contains("FAILED") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the pod's address still resolving"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    c.call(&Request::UnlockNetwork { uid: uid.clone() })
        .expect("unlock");
    let t = Instant::now();
    while unanswered(POD) > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "the node still has the unanswered connection to the pod 2 s after the unlock"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("forgotten {} ms after the unlock", t.elapsed().as_millis());
    // Only the pod's addresses: another address's entry stays.
    assert_eq!(
        unanswered(NOBODY),
        1,
        "an entry to another address was deleted"
    );
    c.call(&Request::Forget { uid }).expect("forget");
}
