//! `forward_connections` on the real kernel, as root: while a source is locked, the node
//! sends new TCP connections that would reach it to its target, and from the forward's
//! end (unlock, forget, a broker restart) nothing of it is left.
//!
//! The "node" is this machine's own network namespace (the broker's node is PID 1's,
//! as in the conntrack test). Behind it, each on a veth of its own:
//! - the source pod: the registered holder, 198.18.211.30 (node side 198.18.211.1);
//! - the target pod: 198.18.212.30 (node side 198.18.212.1), a listener on 8080 that
//!   answers each line with the line and the peer it saw;
//! - a client "on another node" or a pod of this node: 198.18.213.30 (node side
//!   198.18.213.1), its default route through the node.
//!
//! And a kube-proxy-like table at kube-proxy's priority (nat, -100) that DNATs the
//! "Service" 198.18.214.10:80 to the source's 8080. Every address is in 198.18.0.0/15,
//! on links made here, gone with their processes; the test's tables are deleted
//! however it ends.

mod support;

use podmotion_broker::Broker;
use podmotion_broker::client::BrokerClient;
use podmotion_broker::forward::table_name;
use podmotion_wire::broker::*;
use podmotion_wire::ids::MigrationUid;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;
use support::{
    KillOnDrop, container, fixture_with, holder_in_netns, require_root, retrans_segs, sh,
};

const SOURCE: &str = "198.18.211.30";
const TARGET: &str = "198.18.212.30";
const TARGET_NODE_SIDE: &str = "198.18.212.1";
const CLIENT: &str = "198.18.213.30";
const VIP: &str = "198.18.214.10";
const LINKS: [&str; 3] = ["pmfw-s", "pmfw-t", "pmfw-c"];
const KUBE_PROXY: &str = "pm_forward_test_kp";
const UID: &str = "forward-root";

const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// Undoes what the test made in this machine's namespace, however it ends: its links,
/// its tables, and the node's IPv4 forwarding, which it turns on (a node routes between
/// its pods; this machine's default is off, and the local cluster turns it on only
/// while it is up) and gives back as it found it.
struct Cleanup {
    ip_forward: String,
}

impl Cleanup {
    fn new() -> Cleanup {
        let ip_forward = std::fs::read_to_string(IP_FORWARD).unwrap();
        std::fs::write(IP_FORWARD, "1").unwrap();
        Cleanup { ip_forward }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::write(IP_FORWARD, self.ip_forward.trim());
        for l in LINKS {
            let _ = Command::new("ip")
                .args(["link", "del", l])
                .stderr(Stdio::null())
                .status();
        }
        let uid = MigrationUid::parse(UID).unwrap();
        for (fam, t) in [("ip", KUBE_PROXY.to_owned()), ("inet", table_name(&uid))] {
            let _ = Command::new("nft")
                .args(["delete", "table", fam, &t])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// A process in a fresh network namespace (not a registered pod: the target, the client).
fn netns() -> KillOnDrop {
    let p = KillOnDrop(
        Command::new("unshare")
            .args(["-n", "sleep", "600"])
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = p.0.id();
    for _ in 0..500 {
        if std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep") {
            return p;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("unshare did not start");
}

/// A veth `link` from this namespace to `pid`'s (`eth0` there), `/24`s of `net`
/// (`198.18.<net>.1` here, `.30` there, its default route through here).
fn link(link: &str, pid: u32, net: u8) {
    sh(&format!(
        "ip link add {link} type veth peer name eth0 netns {pid} && ip addr add 198.18.{net}.1/24 dev {link} && ip link set {link} up"
    ));
    sh(&format!(
        "nsenter -t {pid} -n sh -c 'ip link set lo up && ip addr add 198.18.{net}.30/24 dev eth0 && ip link set eth0 up && ip route add default via 198.18.{net}.1'"
    ));
}

/// Runs `f` on a thread in `pid`'s network namespace (this one's for `None`).
fn in_netns<T: Send + 'static>(
    pid: Option<u32>,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let ns = pid.map(|p| std::fs::File::open(format!("/proc/{p}/ns/net")).unwrap());
    std::thread::spawn(move || {
        if let Some(ns) = ns {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        }
        f()
    })
}

/// The target's server: each line it reads is answered with `target <line> from <peer>`.
fn serve_in(target: u32) {
    let bound = in_netns(Some(target), || {
        let l = TcpListener::bind("0.0.0.0:8080").unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let peer = s.peer_addr().unwrap().ip();
                let mut line = String::new();
                if BufReader::new(&s).read_line(&mut line).is_ok() {
                    let _ =
                        (&s).write_all(format!("target {} from {peer}\n", line.trim()).as_bytes());
                }
            }
        });
    });
    bound.join().unwrap();
}

/// One request over a new connection to `to` from `pid`'s namespace: the answer, or
/// why there was none. `connect` bounds the connect (the SYN and its retransmissions).
fn ask(pid: Option<u32>, to: &str, connect: Duration) -> Result<String, String> {
    let to: SocketAddr = to.parse().unwrap();
    in_netns(pid, move || {
        let s = TcpStream::connect_timeout(&to, connect).map_err(|e| format!("connect: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        (&s).write_all(b"ping\n").map_err(|e| e.to_string())?;
        let mut line = String::new();
        BufReader::new(&s)
            .read_line(&mut line)
            .map_err(|e| format!("read: {e}"))?;
        Ok(line.trim().to_owned())
    })
    .join()
    .unwrap()
}

/// kube-proxy's DNAT of the Service to the source (its endpoint), for the node's own
/// processes (output) and its pods' and other nodes' traffic (prerouting), written
/// afresh (as a kube-proxy that starts does). Of two NAT chains at one priority the
/// kernel consults the one registered last first: writing it after the forward shows
/// the forward's priority, not its age, puts it ahead.
fn kube_proxy() {
    sh(&format!(
        "nft -f - <<'EOF'\ntable ip {KUBE_PROXY}\ndelete table ip {KUBE_PROXY}\ntable ip {KUBE_PROXY} {{\n\tchain pre {{ type nat hook prerouting priority -100; ip daddr {VIP} tcp dport 80 dnat to {SOURCE}:8080; }}\n\tchain out {{ type nat hook output priority -100; ip daddr {VIP} tcp dport 80 dnat to {SOURCE}:8080; }}\n}}\nEOF"
    ));
}

fn table_exists() -> bool {
    let t = table_name(&MigrationUid::parse(UID).unwrap());
    Command::new("nft")
        .args(["list", "table", "inet", &t])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

fn forward() -> Request {
    Request::ForwardConnections {
        uid: MigrationUid::parse(UID).unwrap(),
        targets: vec![TARGET.parse().unwrap()],
        services: vec![ForwardedService {
            address: VIP.parse().unwrap(),
            port: 80,
            target_port: 8080,
        }],
    }
}

const SHORT: Duration = Duration::from_millis(1500);

#[test]
fn a_locked_sources_new_connections_reach_its_target_while_forwarded_and_only_then() {
    if !require_root() {
        return;
    }
    let f = fixture_with("forward", 0, |c| c.forward_new_connections = true);
    let _cleanup = Cleanup::new();
    let (_holder, process) = holder_in_netns(&f);
    let (target, client) = (netns(), netns());
    link(LINKS[0], process.pid as u32, 211);
    link(LINKS[1], target.0.id(), 212);
    link(LINKS[2], client.0.id(), 213);
    serve_in(target.0.id());
    // The node knows its pod's hardware address (as it does a running pod's): a SYN to
    // the locked source is dropped at its dead link, not answered "no route to host"
    // by a failed neighbour resolution, which would end the client's connect.
    let mac = sh(&format!(
        "nsenter -t {} -n cat /sys/class/net/eth0/address",
        process.pid
    ));
    sh(&format!(
        "ip neigh replace {SOURCE} lladdr {} dev {} nud permanent",
        mac.trim(),
        LINKS[0]
    ));
    // The node routes the Service's address somewhere (here: the target's link).
    sh(&format!("ip route add {VIP}/32 dev {}", LINKS[1]));
    kube_proxy();
    let (src, vip) = (format!("{SOURCE}:8080"), format!("{VIP}:80"));
    assert_eq!(
        ask(Some(client.0.id()), &format!("{TARGET}:8080"), SHORT).as_deref(),
        Ok(format!("target ping from {CLIENT}").as_str()),
        "the target serves"
    );

    let uid = MigrationUid::parse(UID).unwrap();
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
        hold: Some(vec![ForwardedService {
            address: VIP.parse().unwrap(),
            port: 80,
            target_port: 0,
        }]),
    })
    .expect("lock");
    c.call(&Request::Fence { uid: uid.clone() }).expect("fence");
    // Locked and not forwarded: nothing answers, through the Service or not.
    assert!(ask(Some(client.0.id()), &src, SHORT).is_err());
    assert!(ask(None, &vip, SHORT).is_err());

    // A client whose SYN came before the forward: held by the node's queue from the
    // lock on, it meets the forward once that is in — the first SYN itself, not a
    // retransmission a second later (the client's own namespace counts them).
    let retransmitted = retrans_segs(&format!("nsenter -t {} -n", client.0.id()));
    let early = {
        let (pid, src) = (client.0.id(), src.clone());
        std::thread::spawn(move || ask(Some(pid), &src, Duration::from_secs(6)))
    };
    let early_local = {
        let vip = vip.clone();
        std::thread::spawn(move || ask(None, &vip, Duration::from_secs(6)))
    };
    std::thread::sleep(Duration::from_millis(300));
    c.call(&forward()).expect("forward_connections");
    assert!(table_exists());
    assert_eq!(
        early.join().unwrap().as_deref(),
        Ok(format!("target ping from {TARGET_NODE_SIDE}").as_str()),
        "a held SYN to the source's address"
    );
    assert_eq!(
        retrans_segs(&format!("nsenter -t {} -n", client.0.id())),
        retransmitted,
        "the client retransmitted: its first SYN was not held"
    );
    assert!(
        early_local
            .join()
            .unwrap()
            .is_ok_and(|a| a.starts_with("target ping from ")),
        "a held SYN of the node's own client of the Service"
    );

    // kube-proxy starts again: its chains are newer than the forward's.
    kube_proxy();
    // New connections: to the source's address from another node (masqueraded: the
    // target answers the node, whose conntrack answers the client as the source), to
    // the Service from a pod of the node and from the node itself.
    assert_eq!(
        ask(Some(client.0.id()), &src, SHORT).as_deref(),
        Ok(format!("target ping from {TARGET_NODE_SIDE}").as_str())
    );
    assert_eq!(
        ask(Some(client.0.id()), &vip, SHORT).as_deref(),
        Ok(format!("target ping from {CLIENT}").as_str())
    );
    assert!(ask(None, &vip, SHORT).is_ok_and(|a| a.starts_with("target ping from ")));

    // The unlock ends it: nothing of it stays in the node.
    c.call(&Request::UnlockNetwork { uid: uid.clone() })
        .expect("unlock");
    assert!(!table_exists(), "the unlock left the forward");

    // Forget ends it too.
    c.call(&Request::LockNetwork {
        uid: uid.clone(),
        hold: None,
    })
    .expect("lock again");
    c.call(&Request::Fence { uid: uid.clone() })
        .expect("fence again");
    c.call(&forward()).expect("forward again");
    assert!(table_exists());
    c.call(&Request::Forget { uid: uid.clone() })
        .expect("forget");
    assert!(!table_exists(), "forget left the forward");

    // A broker that dies with a forward in place: the next one removes it from its
    // journal (this broker stays, as a dead one would leave its table).
    c.call(&Request::Register {
        uid: uid.clone(),
        role: BrokerRole::Source,
        process,
        container: container(),
    })
    .expect("register again");
    c.call(&Request::LockNetwork {
        uid: uid.clone(),
        hold: None,
    })
    .expect("lock a third time");
    c.call(&Request::Fence { uid: uid.clone() })
        .expect("fence a third time");
    c.call(&forward()).expect("forward a third time");
    assert!(table_exists());
    let next = Broker::new(support::config(f.run_dir.clone(), f.cgroup_rel.clone(), 0));
    next.recover();
    assert!(!table_exists(), "a restarted broker left the forward");
    assert!(
        ask(Some(client.0.id()), &src, SHORT).is_err_and(|e| !e.contains("target")),
        "nothing forwards any more"
    );
}

/// The ruleset of a dual-stack forward (IPv4 and IPv6 sources, targets and Services)
/// is one this machine's `nft` accepts (checked, `nft -c`, nothing applied): the
/// IPv6 rules are not exercised end to end above.
#[test]
fn a_dual_stack_forward_is_a_ruleset_nft_accepts() {
    if !require_root() {
        return;
    }
    use podmotion_broker::forward::{Forward, ruleset};
    let f = Forward {
        sources: vec![
            "198.18.211.30".parse().unwrap(),
            "2001:db8:211::30".parse().unwrap(),
        ],
        targets: vec![
            "198.18.212.30".parse().unwrap(),
            "2001:db8:212::30".parse().unwrap(),
        ],
        services: vec![
            ForwardedService {
                address: VIP.parse().unwrap(),
                port: 80,
                target_port: 8080,
            },
            ForwardedService {
                address: "fd00:214::10".parse().unwrap(),
                port: 443,
                target_port: 8443,
            },
        ],
    };
    let script = ruleset("podmotion-fwd-dual-stack-check", &f);
    for want in [
        "ip6 daddr 2001:db8:211::30 meta l4proto tcp ct state new dnat ip6 to 2001:db8:212::30",
        "ip6 daddr fd00:214::10 tcp dport 443 ct state new dnat ip6 to [2001:db8:212::30]:8443",
        "ct original ip6 daddr 2001:db8:211::30 ip6 daddr 2001:db8:212::30 meta l4proto tcp masquerade",
    ] {
        assert!(script.contains(want), "{want} missing from {script}");
    }
    let mut child = Command::new("nft")
        .args(["-c", "-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "nft -c refused {script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
