//! The broker against hostile and valid clients, over its real socket, as root.
//! Every hostile request must come back as the right typed error and leave nothing
//! behind: no registration, no netns bind mount, no signal to anyone.

mod support;

use podmotion_broker::client::BrokerClient;
use podmotion_broker::procfs;
use podmotion_wire::broker::*;
use podmotion_wire::ids::{MigrationUid, ProcRef};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use support::{CONTAINER, Fixture, container, fixture, require_root};

/// Sends raw bytes, returns the decoded error of the single response.
fn raw(sock: &Path, bytes: &[u8], close_write: bool) -> BrokerError {
    let mut s = UnixStream::connect(sock).unwrap();
    // A refused peer is answered and closed at once: the write may then meet a closed
    // socket (EPIPE) while the answer is already waiting to be read.
    let _ = s.write_all(bytes);
    if close_write {
        s.shutdown(std::net::Shutdown::Write).unwrap();
    }
    let mut prefix = [0u8; 4];
    s.read_exact(&mut prefix).unwrap();
    let mut body = vec![0; u32::from_be_bytes(prefix) as usize];
    s.read_exact(&mut body).unwrap();
    match decode_response(&body).unwrap() {
        Response::Err(e) => e,
        Response::Ok(r) => panic!("hostile request accepted: {r:?}"),
    }
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut v = (body.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(body);
    v
}

fn uid(s: &str) -> MigrationUid {
    MigrationUid::parse(s).unwrap()
}

fn me() -> ProcRef {
    let pid = std::process::id() as i32;
    ProcRef {
        pid,
        start_time: procfs::start_time(pid).unwrap(),
    }
}

/// A process tree in its own network namespace and in the fixture's pod cgroup,
/// holding `n` TCP listeners (one per child).
fn workload(f: &Fixture, n: usize) -> (Child, ProcRef) {
    let script = format!(
        "echo $$ > {procs}; i=0; while [ $i -lt {n} ]; do busybox nc -l -p $((20000+i)) </dev/null >/dev/null & i=$((i+1)); done; sleep 60",
        procs = f
            .cgroup
            .join("pod")
            .join(CONTAINER)
            .join("cgroup.procs")
            .display()
    );
    let child = Command::new("unshare")
        .args(["-n", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    // Wait until the shell moved itself and every listener is up.
    for _ in 0..200 {
        let listeners: usize = procfs::tree(pid)
            .iter()
            .map(|p| procfs::tcp_fds(*p).len())
            .sum();
        if procfs::cgroup_of(pid)
            .unwrap_or_default()
            .ends_with(CONTAINER)
            && listeners >= n
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    (
        child,
        ProcRef {
            pid,
            start_time: procfs::start_time(pid).unwrap(),
        },
    )
}

#[test]
fn broker_rejects_a_hostile_corpus_with_typed_errors_and_no_side_effect() {
    if !require_root() {
        return;
    }
    let f = fixture("corpus", 0);
    let s = &f.socket;
    let cases: Vec<(Vec<u8>, bool, ErrorKind)> = vec![
        (((MAX_FRAME + 1) as u32).to_be_bytes().to_vec(), false, ErrorKind::FrameTooLarge),
        (u32::MAX.to_be_bytes().to_vec(), false, ErrorKind::FrameTooLarge),
        ([&100u32.to_be_bytes()[..], b"{\"op\":"].concat(), true, ErrorKind::Truncated),
        (frame(br#"{"op":"bind_netns","uid":"a""#), false, ErrorKind::Truncated),
        (frame(br#"{"op":"bind_netns","uid":"../../../etc"}"#), false, ErrorKind::InvalidUid),
        (frame(br#"{"op":"bind_netns","uid":"x;rm -rf /"}"#), false, ErrorKind::InvalidUid),
        (frame(br#"{"op":"bind_netns","uid":"x","target":"/etc/passwd"}"#), false, ErrorKind::Malformed),
        (frame(br#"{"op":"mount","uid":"x"}"#), false, ErrorKind::UnknownOp),
        (frame(br#"{"op":"kill","uid":"never-registered"}"#), false, ErrorKind::NotRegistered),
        (frame(br#"{"op":"register","uid":"x","role":"source","process":{"pid":1,"start_time":0},"container":"c1"}"#), false, ErrorKind::NoSuchProcess),
        // The address hand-over's ops: an address is an IP address and nothing else (no
        // prefix length, port, scope, host name), and they carry no other field.
        (frame(br#"{"op":"adopt_address","uid":"x","address":"not-an-ip"}"#), false, ErrorKind::Malformed),
        (frame(br#"{"op":"adopt_address","uid":"x","address":"198.18.2.20/32"}"#), false, ErrorKind::Malformed),
        (frame(br#"{"op":"adopt_address","uid":"x","address":"198.18.2.20:80"}"#), false, ErrorKind::Malformed),
        (frame(br#"{"op":"adopt_address","uid":"x","address":"fe80::1%eth0"}"#), false, ErrorKind::Malformed),
        (frame(br#"{"op":"adopt_address","uid":"x","address":"localhost"}"#), false, ErrorKind::Malformed),
        (frame(br#"{"op":"adopt_address","uid":"x","address":3323068948}"#), false, ErrorKind::Malformed),
        (frame(br#"{"op":"adopt_address","uid":"x","address":null}"#), false, ErrorKind::Malformed),
        (frame(br#"{"op":"adopt_address","uid":"x"}"#), false, ErrorKind::Malformed),
        (frame(br#"{"op":"adopt_address","uid":"x","address":"198.18.2.20","link":"eth0"}"#), false, ErrorKind::Malformed),
        (frame(br#"{"op":"release_address","uid":"x","address":"../../etc"}"#), false, ErrorKind::Malformed),
        (frame(br#"{"op":"release_address","uid":"x"}"#), false, ErrorKind::Malformed),
        (frame(br#"{"op":"adopt_address","uid":"../x","address":"198.18.2.20"}"#), false, ErrorKind::InvalidUid),
        (frame(br#"{"op":"adopt_address","uid":"never-registered","address":"198.18.2.20"}"#), false, ErrorKind::NotRegistered),
        (frame(br#"{"op":"release_address","uid":"never-registered","address":"198.18.2.20"}"#), false, ErrorKind::NotRegistered),
    ];
    for (bytes, close, kind) in cases {
        let e = raw(s, &bytes, close);
        assert_eq!(e.kind, kind, "{:?} → {e}", String::from_utf8_lossy(&bytes));
    }
    let mut c = BrokerClient::connect(s).unwrap();
    // Our own process is not in a pod cgroup: a host process cannot be pinned.
    let e = c
        .call(&Request::Register {
            uid: uid("m-host"),
            role: BrokerRole::Source,
            process: me(),
            container: container(),
        })
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::ForeignProcess);
    // A recycled pid (right pid, wrong start time).
    let mut reused = me();
    reused.start_time += 1;
    let e = c
        .call(&Request::Register {
            uid: uid("m-reuse"),
            role: BrokerRole::Source,
            process: reused,
            container: container(),
        })
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::PidReused);
    // A dead pid.
    let mut dead = Command::new("true").spawn().unwrap();
    let dead_pid = dead.id() as i32;
    dead.wait().unwrap();
    let e = c
        .call(&Request::Register {
            uid: uid("m-dead"),
            role: BrokerRole::Source,
            process: ProcRef {
                pid: dead_pid,
                start_time: 1,
            },
            container: container(),
        })
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::NoSuchProcess);
    assert_eq!(f.broker.registrations(), 0);
    assert!(
        !f.run_dir.join("netns").exists(),
        "a rejected request created a mount point or a record"
    );
    assert!(f.broker.adoptions().is_empty());
}

/// A process in a pod cgroup that shares the node's network namespace (a hostNetwork
/// pod) is never pinned: a compromised agent cannot have the broker lock the node's
/// links.
#[test]
fn broker_refuses_a_process_in_the_nodes_network_namespace() {
    if !require_root() {
        return;
    }
    let f = fixture("hostnet", 0);
    let script = format!(
        "echo $$ > {}; sleep 60",
        f.cgroup
            .join("pod")
            .join(CONTAINER)
            .join("cgroup.procs")
            .display()
    );
    let mut child = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    for _ in 0..200 {
        if procfs::cgroup_of(pid)
            .unwrap_or_default()
            .ends_with(CONTAINER)
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    let p = ProcRef {
        pid,
        start_time: procfs::start_time(pid).unwrap(),
    };
    let mut c = BrokerClient::connect(&f.socket).unwrap();
    let e = c
        .call(&Request::Register {
            uid: uid("m-hostnet"),
            role: BrokerRole::Source,
            process: p,
            container: container(),
        })
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::ForeignProcess, "{e}");
    assert!(e.message.contains("network namespace"), "{e}");
    assert_eq!(f.broker.registrations(), 0);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn broker_refuses_a_peer_with_the_wrong_uid() {
    if !require_root() {
        return;
    }
    let f = fixture("peer", 4242);
    let e = raw(&f.socket, &frame(br#"{"op":"forget","uid":"a"}"#), false);
    assert_eq!(e.kind, ErrorKind::PeerNotAllowed);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&f.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
}

#[test]
fn broker_pins_processes_and_lists_many_sockets() {
    if !require_root() {
        return;
    }
    let f = fixture("pin", 0);
    let (mut child, p) = workload(&f, 40);
    let mut c = BrokerClient::connect(&f.socket).unwrap();
    let u = uid("m-pin");
    let Reply::Registered { cgroup } = c
        .call(&Request::Register {
            uid: u.clone(),
            role: BrokerRole::Source,
            process: p,
            container: container(),
        })
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(cgroup, format!("{}/pod/{CONTAINER}", f.cgroup_rel));
    // Idempotent for the same pin; refused for another migration or connection.
    c.call(&Request::Register {
        uid: u.clone(),
        role: BrokerRole::Source,
        process: p,
        container: container(),
    })
    .unwrap();
    let e = c
        .call(&Request::Register {
            uid: uid("m-other"),
            role: BrokerRole::Source,
            process: p,
            container: container(),
        })
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::AlreadyRegistered);
    let mut intruder = BrokerClient::connect(&f.socket).unwrap();
    assert_eq!(
        intruder
            .call(&Request::Kill { uid: u.clone() })
            .unwrap_err()
            .kind,
        ErrorKind::Busy
    );
    // Target-only ops are refused on a source.
    assert_eq!(
        c.call(&Request::BindNetns { uid: u.clone() })
            .unwrap_err()
            .kind,
        ErrorKind::WrongRole
    );
    let Reply::Sockets { sockets } = c.call(&Request::ListSockets { uid: u.clone() }).unwrap()
    else {
        panic!("list_sockets answered another reply")
    };
    assert_eq!(sockets.len(), 40, "every listener listed");
    for s in &sockets {
        let port = s.local.expect("a listener's local address").port();
        assert!((20000..20040).contains(&port), "{s:?}");
        assert!(s.listening && s.remote.is_none(), "{s:?}");
    }
    let a = c.call(&Request::NetnsAddrs { uid: u.clone() }).unwrap();
    assert!(matches!(a, Reply::Addrs { .. }), "{a:?}");
    c.call(&Request::Kill { uid: u.clone() }).unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success());
    std::thread::sleep(std::time::Duration::from_millis(100));
    let survivors =
        std::fs::read_to_string(f.cgroup.join("pod").join(CONTAINER).join("cgroup.procs")).unwrap();
    assert!(survivors.trim().is_empty(), "kill left {survivors}");
    c.call(&Request::Forget { uid: u }).unwrap();
    assert_eq!(f.broker.registrations(), 0);
}
