//! While a source is locked the node forgets the unanswered connections to its pod's
//! address, and from the unlock it does not (`podmotion_broker::conntrack`), on the real
//! kernel, as root: the pod's
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
fn a_locked_pod_s_unanswered_connections_are_forgotten_until_its_unlock() {
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
    c.call(&Request::LockNetwork {
        uid: uid.clone(),
        hold: None,
    })
    .expect("lock");

    // Two clients nobody answers: one to the locked pod, one to an address nobody has.
    syn(POD);
    syn(NOBODY);
    assert_eq!(unanswered(NOBODY), 1, "a client's SYN to nobody");
    let t = Instant::now();
    while unanswered(POD) > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "the node still has the unanswered connection to the locked pod after 2 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "forgotten within {} ms of the SYN, while locked",
        t.elapsed().as_millis()
    );
    // Only the pod's addresses: another address's entry stays.
    assert_eq!(
        unanswered(NOBODY),
        1,
        "an entry to another address was deleted"
    );

    // Unlocked, the pod answers again: the node stops forgetting. (Its SYNs are dropped
    // by the pod's own rule here, so that its entry stays unanswered.)
    c.call(&Request::UnlockNetwork { uid: uid.clone() })
        .expect("unlock");
    sh(&format!(
        "nsenter -t {pid} -n sh -c \"nft add table inet pmct && nft add chain inet pmct in '{{ type filter hook input priority 0; }}' && nft add rule inet pmct in tcp dport 8080 drop\""
    ));
    syn(POD);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        unanswered(POD),
        1,
        "a connection to the unlocked pod was forgotten"
    );
    c.call(&Request::Forget { uid }).expect("forget");
}
