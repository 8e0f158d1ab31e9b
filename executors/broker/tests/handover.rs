//! The address hand-over on the real kernel, as root: a target pod's holder in a fresh
//! network namespace ("the pod"), a veth to a second one ("the host", the node's side of
//! the pods' shared segment), the broker in this process. The pod has 198.18.1.10/16
//! and a default route through the host (198.18.0.1/16); the source pod's address,
//! which the target adopts, is 198.18.2.20. Every address is in 198.18.0.0/15, in
//! namespaces made here, gone with their processes.

mod support;

use podmotion_broker::client::BrokerClient;
use podmotion_broker::handover::parse_cidrs;
use podmotion_broker::procfs;
use podmotion_wire::broker::*;
use podmotion_wire::ids::{MigrationUid, ProcRef};
use std::io::{BufRead, BufReader, Write};
use std::process::{ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};
use support::{Fixture, KillOnDrop, container, fixture_with, holder_in_netns, require_root, sh};

const POD: &str = "198.18.1.10";
const HOST: &str = "198.18.0.1";
const ADOPTED: &str = "198.18.2.20";
/// The MAC the host's neighbour entry for [`ADOPTED`] names before the hand-over: the
/// source pod's, on the shared segment.
const SOURCE_MAC: &str = "02:00:5e:00:53:01";

/// Waits until `ok`, at most 10 s.
fn wait_for(what: &str, ok: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The target pod and the host, linked.
struct Net {
    _holder: KillOnDrop,
    process: ProcRef,
    host: KillOnDrop,
}

impl Net {
    fn pod_pid(&self) -> i32 {
        self.process.pid
    }

    fn host_pid(&self) -> i32 {
        self.host.0.id() as i32
    }

    /// Runs `script` in the pod's network namespace.
    fn in_pod(&self, script: &str) -> String {
        sh(&format!(
            "nsenter -t {} -n sh -c '{script}'",
            self.pod_pid()
        ))
    }

    fn in_host(&self, script: &str) -> String {
        sh(&format!(
            "nsenter -t {} -n sh -c '{script}'",
            self.host_pid()
        ))
    }

    /// The pod's host addresses on eth0 (`ip -o addr show`'s `<addr>/<len>`).
    fn pod_addrs(&self) -> String {
        self.in_pod("ip -o -4 addr show dev eth0")
    }

    fn has_adopted(&self) -> bool {
        self.pod_addrs().contains(&format!("inet {ADOPTED}/32"))
    }

    /// The MAC of the pod's eth0 (from `ip`: /sys shows the test's own namespace).
    fn pod_mac(&self) -> String {
        self.in_pod("ip -o link show eth0")
            .split_whitespace()
            .skip_while(|w| *w != "link/ether")
            .nth(1)
            .expect("the pod's MAC")
            .to_owned()
    }

    /// The pod's eth0's `arp_ignore` (/proc/sys/net is the opener's namespace).
    fn arp_ignore(&self) -> String {
        self.in_pod("cat /proc/sys/net/ipv4/conf/eth0/arp_ignore")
            .trim()
            .to_owned()
    }

    /// The host's neighbour entry for `a`.
    fn host_neigh(&self, a: &str) -> String {
        self.in_host(&format!("ip neigh show {a} dev eth0"))
            .trim()
            .to_owned()
    }
}

/// The pod: a holder in its own network namespace, in the fixture's container cgroup;
/// the host: a process in another; a veth between them. The host's neighbour entry for
/// [`ADOPTED`] is the source pod's ([`SOURCE_MAC`], stale), as on a node that talked to
/// the source.
fn net(f: &Fixture) -> Net {
    let (holder, process) = holder_in_netns(f);
    let host = KillOnDrop(
        Command::new("unshare")
            .args(["-n", "sleep", "600"])
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let n = Net {
        _holder: holder,
        process,
        host,
    };
    wait_for("the host's namespace", || {
        procfs::netns_inode(n.host_pid()) != procfs::netns_inode(std::process::id() as i32)
    });
    sh(&format!(
        "ip link add eth0 netns {} type veth peer name eth0 netns {}",
        n.pod_pid(),
        n.host_pid()
    ));
    n.in_pod(&format!(
        "ip link set lo up && ip addr add {POD}/16 dev eth0 && ip link set eth0 up && ip route add default via {HOST} dev eth0"
    ));
    n.in_host(&format!(
        "ip link set lo up && ip addr add {HOST}/16 dev eth0 && ip link set eth0 up && ip neigh replace {ADOPTED} lladdr {SOURCE_MAC} dev eth0 nud stale"
    ));
    assert!(n.host_neigh(ADOPTED).contains(SOURCE_MAC));
    n
}

/// A fixture with the hand-over on for 198.18.0.0/15, lingering `linger`.
fn handover_fixture(name: &str, linger: Duration) -> Fixture {
    fixture_with(name, 0, |c| {
        c.handover_cidrs = parse_cidrs("198.18.0.0/15").unwrap();
        c.address_linger = linger;
    })
}

fn uid(s: &str) -> MigrationUid {
    MigrationUid::parse(s).unwrap()
}

fn ip(s: &str) -> std::net::IpAddr {
    s.parse().unwrap()
}

/// A connection to `addr` registered as the target of `u`.
fn target(f: &Fixture, n: &Net, u: &str) -> BrokerClient {
    let mut c = BrokerClient::connect(&f.socket).unwrap();
    c.call(&Request::Register {
        uid: uid(u),
        role: BrokerRole::Target,
        process: n.process,
        container: container(),
    })
    .expect("the holder registers as a target");
    c
}

fn adopt(c: &mut BrokerClient, u: &str, a: &str) -> Result<Reply, BrokerError> {
    c.call(&Request::AdoptAddress {
        uid: uid(u),
        address: ip(a),
    })
}

fn journal(f: &Fixture, u: &str) -> std::path::PathBuf {
    f.run_dir.join("netns/.handover").join(u)
}

/// A moved connection: a server on the host, a client in the pod's namespace whose
/// socket is bound to [`ADOPTED`]. The client closes its end when told (a line on its
/// stdin) and lives on; the server closes its end when the client's ends.
struct Connection {
    client: KillOnDrop,
    to_client: ChildStdin,
    _server: KillOnDrop,
}

const SERVER: &str = r#"
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 8080))
s.listen(1)
print("listening", flush=True)
c, _ = s.accept()
while c.recv(4096):
    pass
c.close()
import time
time.sleep(600)
"#;

const CLIENT: &str = r#"
import socket, sys, time
s = socket.socket()
s.bind((sys.argv[1], 0))
s.connect((sys.argv[2], 8080))
s.sendall(b"hello")
print("connected", flush=True)
sys.stdin.readline()
s.close()
print("closed", flush=True)
time.sleep(600)
"#;

fn connect(n: &Net) -> Connection {
    let mut server = KillOnDrop(
        Command::new("nsenter")
            .args([
                "-t",
                &n.host_pid().to_string(),
                "-n",
                "python3",
                "-c",
                SERVER,
                HOST,
            ])
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(server.0.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "listening");
    let mut client = KillOnDrop(
        Command::new("nsenter")
            .args([
                "-t",
                &n.pod_pid().to_string(),
                "-n",
                "python3",
                "-c",
                CLIENT,
                ADOPTED,
                HOST,
            ])
            .stdout(Stdio::piped())
            .stdin(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(client.0.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "connected", "the connection from {ADOPTED}");
    let to_client = client.0.stdin.take().unwrap();
    Connection {
        client,
        to_client,
        _server: server,
    }
}

impl Connection {
    fn pid(&self) -> i32 {
        self.client.0.id() as i32
    }

    /// Whether the pod's namespace holds an established connection from [`ADOPTED`].
    fn established(&self) -> bool {
        procfs::tcp_states(self.pid())
            .unwrap()
            .contains(&(ip(ADOPTED), 0x01))
    }

    /// The client closes its end (the server then closes its own: the pod's socket is
    /// left in TIME_WAIT).
    fn close(&mut self) {
        writeln!(self.to_client).unwrap();
        let mut line = String::new();
        BufReader::new(self.client.0.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "closed");
    }

    /// The client as the restored tree: moved into the holder's cgroup.
    fn moved(&self, c: &mut BrokerClient, u: &str) {
        let process = ProcRef {
            pid: self.pid(),
            start_time: procfs::start_time(self.pid()).unwrap(),
        };
        assert_eq!(
            c.call(&Request::MoveCgroup {
                uid: uid(u),
                process
            })
            .unwrap(),
            Reply::Moved { pids: 1 }
        );
    }
}

/// adopt → the address is on the pod's link, unannounced and not answered for (the
/// link's `arp_ignore` 8): the host's neighbour entry for it still names the source's
/// MAC (nothing listens in the pod before the restore); once the restored tree is moved
/// into the holder's cgroup, the link answers again and the entry names the pod's
/// (the gratuitous ARP arrived). It is journalled (0600); asked again, nothing more;
/// release → gone, record gone.
#[test]
fn an_adopted_address_is_on_the_pods_link_announced_once_restored_then_released() {
    if !require_root() {
        return;
    }
    let f = handover_fixture("adopt", Duration::from_secs(3600));
    let n = net(&f);
    let mut c = target(&f, &n, "m-adopt");
    assert_eq!(adopt(&mut c, "m-adopt", ADOPTED).unwrap(), Reply::Done);
    assert!(n.has_adopted(), "{}", n.pod_addrs());
    let mac = n.pod_mac();
    let entry = n.host_neigh(ADOPTED);
    assert!(
        entry.contains(SOURCE_MAC),
        "announced before the restore: the host's entry for {ADOPTED}: {entry:?}"
    );
    // Nor answered for: the pod's link answers no ARP request before the restore.
    assert_eq!(
        n.arp_ignore(),
        "8",
        "the pod's eth0 answers ARP before the restore"
    );
    // The restored tree: a process of the pod's namespace, moved into its cgroup.
    let tree = KillOnDrop(
        Command::new("nsenter")
            .args(["-t", &n.pod_pid().to_string(), "-n", "sleep", "600"])
            .spawn()
            .unwrap(),
    );
    let pid = tree.0.id() as i32;
    wait_for("the tree in the pod's namespace", || {
        procfs::netns_inode(pid).ok() == procfs::netns_inode(n.pod_pid()).ok()
    });
    let process = ProcRef {
        pid,
        start_time: procfs::start_time(pid).unwrap(),
    };
    assert_eq!(
        c.call(&Request::MoveCgroup {
            uid: uid("m-adopt"),
            process
        })
        .unwrap(),
        Reply::Moved { pids: 1 }
    );
    assert_eq!(
        n.arp_ignore(),
        "0",
        "the pod's eth0 not given back its arp_ignore"
    );
    let entry = n.host_neigh(ADOPTED);
    assert!(
        entry.contains(&format!("lladdr {mac}")),
        "the host's entry for {ADOPTED}: {entry:?} (the pod's MAC is {mac})"
    );
    drop(tree);
    use std::os::unix::fs::PermissionsExt;
    let j = journal(&f, "m-adopt");
    let mode = std::fs::metadata(&j).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let record = std::fs::read_to_string(&j).unwrap();
    for part in [
        format!(r#""address":"{ADOPTED}""#),
        r#""link":"eth0""#.to_owned(),
        format!(r#""pid":{}"#, n.pod_pid()),
        r#""restored":true"#.to_owned(),
    ] {
        assert!(record.contains(&part), "{part} not in {record}");
    }
    // Idempotent: once on the link, once in the journal.
    assert_eq!(adopt(&mut c, "m-adopt", ADOPTED).unwrap(), Reply::Done);
    assert_eq!(n.pod_addrs().matches(ADOPTED).count(), 1);
    // The pod's own address: done, and not the broker's to remove.
    assert_eq!(adopt(&mut c, "m-adopt", POD).unwrap(), Reply::Done);
    assert!(!std::fs::read_to_string(&j).unwrap().contains(POD));

    assert_eq!(
        c.call(&Request::ReleaseAddress {
            uid: uid("m-adopt"),
            address: ip(ADOPTED)
        })
        .unwrap(),
        Reply::Done
    );
    assert!(!n.has_adopted(), "{}", n.pod_addrs());
    assert!(!j.exists(), "the record outlived the release");
    c.call(&Request::ReleaseAddress {
        uid: uid("m-adopt"),
        address: ip(POD),
    })
    .unwrap();
    assert!(n.pod_addrs().contains(&format!("inet {POD}/16")));
    c.call(&Request::Forget {
        uid: uid("m-adopt"),
    })
    .unwrap();
}

/// With the hand-over off, `handover_off`; on, an address outside its CIDRs or one that
/// is never a pod's is `address_not_allowed`; the pod's namespace is left as it was.
#[test]
fn adoption_is_refused_when_off_outside_the_cidrs_or_never_a_pods() {
    if !require_root() {
        return;
    }
    let off = fixture_with("adopt-off", 0, |_| {});
    let n = net(&off);
    let before = n.pod_addrs();
    let mut c = target(&off, &n, "m-off");
    let e = adopt(&mut c, "m-off", ADOPTED).unwrap_err();
    assert_eq!(e.kind, ErrorKind::HandoverOff, "{e}");
    c.call(&Request::Forget { uid: uid("m-off") }).unwrap();
    drop(n);

    let f = handover_fixture("adopt-refused", Duration::from_secs(3600));
    let n = net(&f);
    let mut c = target(&f, &n, "m-refused");
    for a in [
        "198.20.0.1",
        "10.0.0.1",
        "127.0.0.1",
        "0.0.0.0",
        "255.255.255.255",
        "224.0.0.1",
        "169.254.0.1",
        "::ffff:198.18.2.20",
        "::1",
        "fe80::1",
    ] {
        let e = adopt(&mut c, "m-refused", a).unwrap_err();
        assert_eq!(e.kind, ErrorKind::AddressNotAllowed, "{a}: {e}");
    }
    assert_eq!(n.pod_addrs(), before);
    assert!(!f.run_dir.join("netns/.handover").exists());
}

/// Restored (the tree moved into the holder's cgroup) and forgotten (a commit): the
/// address stays while a connection from it is established, through several sweeps;
/// once the connection is closed, the next sweep withdraws it.
#[test]
fn a_restored_address_stays_while_its_connection_lives_and_goes_after() {
    if !require_root() {
        return;
    }
    let f = handover_fixture("linger", Duration::from_secs(3600));
    let n = net(&f);
    let mut c = target(&f, &n, "m-linger");
    adopt(&mut c, "m-linger", ADOPTED).unwrap();
    let mut conn = connect(&n);
    conn.moved(&mut c, "m-linger");
    assert!(
        std::fs::read_to_string(journal(&f, "m-linger"))
            .unwrap()
            .contains(r#""restored":true"#)
    );
    c.call(&Request::Forget {
        uid: uid("m-linger"),
    })
    .unwrap();
    drop(c);
    for _ in 0..3 {
        f.broker.sweep();
        assert!(n.has_adopted(), "withdrawn under a live connection");
        assert!(conn.established());
        std::thread::sleep(Duration::from_millis(200));
    }
    conn.close();
    assert!(!conn.established());
    wait_for("the sweep withdraws the address", || {
        f.broker.sweep();
        !n.has_adopted()
    });
    assert!(!journal(&f, "m-linger").exists());
    assert!(f.broker.adoptions().is_empty());
}

/// Past its deadline (`address_linger` after the adoption) the address goes, even
/// under a live connection.
#[test]
fn the_deadline_withdraws_the_address_under_a_live_connection() {
    if !require_root() {
        return;
    }
    let f = handover_fixture("deadline", Duration::from_secs(1));
    let n = net(&f);
    let mut c = target(&f, &n, "m-deadline");
    adopt(&mut c, "m-deadline", ADOPTED).unwrap();
    let conn = connect(&n);
    conn.moved(&mut c, "m-deadline");
    c.call(&Request::Forget {
        uid: uid("m-deadline"),
    })
    .unwrap();
    wait_for("the deadline withdraws the address", || {
        f.broker.sweep();
        !n.has_adopted()
    });
    assert!(conn.established(), "the connection was still there");
    assert!(!journal(&f, "m-deadline").exists());
}

/// Before the restored tree was moved, the registration's end withdraws the address:
/// `forget`, and the lease's end (the agent's connection closes).
#[test]
fn forget_or_the_leases_end_before_the_move_withdraws_the_address() {
    if !require_root() {
        return;
    }
    let f = handover_fixture("forget", Duration::from_secs(3600));
    let n = net(&f);
    let mut c = target(&f, &n, "m-forget");
    adopt(&mut c, "m-forget", ADOPTED).unwrap();
    assert!(n.has_adopted());
    c.call(&Request::Forget {
        uid: uid("m-forget"),
    })
    .unwrap();
    assert!(!n.has_adopted(), "{}", n.pod_addrs());
    assert!(!journal(&f, "m-forget").exists());

    let mut c = target(&f, &n, "m-lease");
    adopt(&mut c, "m-lease", ADOPTED).unwrap();
    assert!(n.has_adopted());
    drop(c);
    wait_for("the lease's end withdraws the address", || !n.has_adopted());
    wait_for("its record goes", || !journal(&f, "m-lease").exists());
}

/// A broker that starts on its predecessor's run directory withdraws the address the
/// predecessor adopted for a migration whose restore it never saw moved (its lease
/// ended with it), and keeps one a moved connection uses.
#[test]
fn a_new_broker_withdraws_its_predecessors_unrestored_adoption_and_keeps_a_used_one() {
    if !require_root() {
        return;
    }
    let f = handover_fixture("restart", Duration::from_secs(3600));
    let n = net(&f);
    let mut c = target(&f, &n, "m-used");
    adopt(&mut c, "m-used", ADOPTED).unwrap();
    let conn = connect(&n);
    conn.moved(&mut c, "m-used");
    c.call(&Request::Forget { uid: uid("m-used") }).unwrap();
    let mut c = target(&f, &n, "m-unused");
    adopt(&mut c, "m-unused", "198.18.2.21").unwrap();
    assert!(n.pod_addrs().contains("198.18.2.21/32"));
    // The broker dies (its memory with it); the connection's end would only come later.
    std::mem::forget(c);
    let mut cfg = support::config(f.run_dir.clone(), f.cgroup_rel.clone(), 0);
    cfg.handover_cidrs = parse_cidrs("198.18.0.0/15").unwrap();
    let next = podmotion_broker::Broker::new(cfg);
    next.recover();
    assert!(
        !n.pod_addrs().contains("198.18.2.21/32"),
        "{}",
        n.pod_addrs()
    );
    assert!(!journal(&f, "m-unused").exists());
    assert!(n.has_adopted(), "withdrawn under a live connection");
    assert_eq!(
        next.adoptions().keys().collect::<Vec<_>>(),
        ["m-used"],
        "the new broker sweeps its predecessor's record"
    );
    assert!(conn.established());
}

/// The background sweep (`spawn_sweeper`, as `serve` starts it) withdraws a restored
/// address nothing uses without being asked.
#[test]
fn the_background_sweep_withdraws_an_unused_restored_address() {
    if !require_root() {
        return;
    }
    let f = fixture_with("sweeper", 0, |c| {
        c.handover_cidrs = parse_cidrs("198.18.0.0/15").unwrap();
        c.sweep_interval = Duration::from_millis(200);
    });
    let n = net(&f);
    let mut c = target(&f, &n, "m-sweeper");
    // A restored tree without a connection from the address.
    let tree = KillOnDrop(
        Command::new("nsenter")
            .args(["-t", &n.pod_pid().to_string(), "-n", "sleep", "600"])
            .spawn()
            .unwrap(),
    );
    let pid = tree.0.id() as i32;
    wait_for("the tree in the pod's namespace", || {
        procfs::netns_inode(pid) == procfs::netns_inode(n.pod_pid())
    });
    adopt(&mut c, "m-sweeper", ADOPTED).unwrap();
    // Not restored yet: the sweep leaves it to the registration.
    let _sweeper = f.broker.spawn_sweeper();
    std::thread::sleep(Duration::from_millis(600));
    assert!(n.has_adopted(), "withdrawn before the restored tree moved");
    c.call(&Request::MoveCgroup {
        uid: uid("m-sweeper"),
        process: ProcRef {
            pid,
            start_time: procfs::start_time(pid).unwrap(),
        },
    })
    .unwrap();
    wait_for("the background sweep withdraws it", || !n.has_adopted());
}
