//! The shipped broker BINARY (not the library in-process) against more than a thousand
//! generated hostile inputs over its real socket, as root. Every input must come back
//! as a typed error of the expected kind, the broker must keep serving, and nothing on
//! the host may change: no mount, nothing in the run directory, no process stopped, no
//! link of the node's network namespace taken down.
//!
//! Classes (counted per class in the test's output, figures in docs/reliability.md):
//! garbage bodies, frame-level abuse (oversize, truncated), unknown ops, unknown
//! fields, malformed UIDs on every op, pinning every other live process on the machine
//! (the kubelets', containerd's, other pods' — all outside the broker's pods cgroup
//! root) in both roles, the same pids with a reused start time, every op on an
//! unregistered migration, malformed container IDs, malformed addresses on the
//! address hand-over's ops, a connection flood and a slow client, and a symlink planted
//! at the netns bind-mount path; a live pod process registered under another
//! container's ID; addresses the hand-over must refuse; invalid hand-over flags.

mod support;

use podmotion_broker::procfs;
use podmotion_wire::broker::*;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::{CONTAINER, require_root};

/// The ops whose request is the migration UID alone: every op of the one list
/// (`podmotion_wire::broker::OPS`) but the three that carry a process and the three that
/// carry addresses.
fn ops_with_uid_only() -> impl Iterator<Item = &'static str> {
    OPS.iter().copied().filter(|op| {
        !matches!(
            *op,
            "register"
                | "move_cgroup"
                | "charge_restore"
                | "adopt_address"
                | "release_address"
                | "forward_connections"
        )
    })
}

/// The address hand-over's ops (their request: the UID and an address).
const ADDRESS_OPS: [&str; 2] = ["adopt_address", "release_address"];

/// The ops whose request names addresses besides the UID: the hand-over's and
/// `forward_connections` (its target addresses).
const NAMING_OPS: [&str; 3] = ["adopt_address", "release_address", "forward_connections"];

/// A well-formed request of `op` on migration `uid`: the UID, and an address for the
/// address ops (not for the three that carry a process).
fn well_formed(op: &str, uid: &str) -> serde_json::Value {
    if ADDRESS_OPS.contains(&op) {
        serde_json::json!({"op": op, "uid": uid, "address": "198.18.2.20"})
    } else if op == "forward_connections" {
        serde_json::json!({"op": op, "uid": uid, "targets": ["198.18.2.20"]})
    } else {
        serde_json::json!({"op": op, "uid": uid})
    }
}

/// Addresses the decoder refuses: not an IP address alone (a prefix length, a port, a
/// scope, a host name, a list, leading zeros, other digits, whitespace, control
/// characters, path and shell text).
const BAD_ADDRESSES: &[&str] = &[
    "",
    "not-an-ip",
    "localhost",
    "198.18.2.20/32",
    "198.18.2.20:80",
    "198.18.2",
    "198.18.2.256",
    "198.018.2.20",
    "0x7f.0.0.1",
    " 198.18.2.20",
    "198.18.2.20 ",
    "198.18.2.20\n",
    "198.18.2.20\u{0}",
    "198.18.2.20,198.18.2.21",
    "\u{661}\u{669}\u{668}.18.2.20",
    "fe80::1%eth0",
    "[::1]",
    "::1/128",
    "2001:db8::g",
    "../../etc",
    "$(id)",
];

/// The tests of this binary run one at a time: one of them stops a process and takes
/// a link down on purpose, which another's "nothing on the host changed" would see.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The container the tests' processes run in, and another container of the same pod:
/// leaf cgroups named by their IDs below the pod's (`<root>/pod/<id>`, as with the
/// kubelet's cgroupfs driver), so that the broker finds the container it is named.
const OTHER_CONTAINER: &str = "9a8b7c6d5e4f30211203f4e5d6c7b8a99a8b7c6d5e4f30211203f4e5d6c7b8a9";

fn container() -> podmotion_wire::ids::ContainerId {
    podmotion_wire::ids::ContainerId::parse(CONTAINER).unwrap()
}

/// The broker binary on a private socket and run directory; its pods cgroup root is a
/// fresh cgroup (v2 mount) that holds only what a test puts there: one pod with the
/// leaf cgroups of two containers, [`CONTAINER`] and [`OTHER_CONTAINER`].
struct BrokerProcess {
    child: Child,
    dir: PathBuf,
    socket: PathBuf,
    cgroup: PathBuf,
}

impl BrokerProcess {
    fn start(name: &str) -> Self {
        Self::start_with(name, &[])
    }

    /// The broker binary started with `args` besides its socket, run directory and pods
    /// cgroup root.
    fn start_with(name: &str, args: &[&str]) -> Self {
        let tag = format!("pmhb-{name}-{}", std::process::id());
        let dir = std::env::temp_dir().join(&tag);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let cgroup = procfs::cgroup2_mount().unwrap().join(&tag);
        for c in [CONTAINER, OTHER_CONTAINER] {
            std::fs::create_dir_all(cgroup.join("pod").join(c)).unwrap();
        }
        let socket = dir.join("broker.sock");
        let child = Command::new(env!("CARGO_BIN_EXE_podmotion-broker"))
            .arg("--socket")
            .arg(&socket)
            .arg("--run-dir")
            .arg(dir.join("run"))
            .arg("--pods-cgroup-root")
            .arg(format!("/{tag}"))
            .args(args)
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start podmotion-broker");
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(&socket).is_err() {
            assert!(Instant::now() < deadline, "broker never served {socket:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self {
            child,
            dir,
            socket,
            cgroup,
        }
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Another broker binary on this one's run directory (its own socket `socket` in
    /// the same directory), waiting `wait_s` seconds for it at start; stderr piped.
    fn second_broker(&self, socket: &str, wait_s: u32) -> Child {
        Command::new(env!("CARGO_BIN_EXE_podmotion-broker"))
            .arg("--socket")
            .arg(self.dir.join(socket))
            .arg("--run-dir")
            .arg(self.dir.join("run"))
            .arg("--pods-cgroup-root")
            .arg("/pmhb-nowhere")
            .arg("--run-dir-wait-seconds")
            .arg(wait_s.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start a second podmotion-broker")
    }

    /// The `cgroup.procs` of container `id`'s cgroup.
    fn procs_of(&self, id: &str) -> PathBuf {
        self.cgroup.join("pod").join(id).join("cgroup.procs")
    }

    /// The `cgroup.procs` of [`CONTAINER`]'s cgroup, where the tests' processes run.
    fn procs(&self) -> PathBuf {
        self.procs_of(CONTAINER)
    }
}

impl Drop for BrokerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
        for d in [
            &format!("pod/{CONTAINER}"),
            &format!("pod/{OTHER_CONTAINER}"),
            "pod",
            "",
        ] {
            let _ = std::fs::remove_dir(self.cgroup.join(d));
        }
    }
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut v = (body.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(body);
    v
}

/// One connection, one input, the one response: the typed error, or why there was
/// none (a hostile input accepted, no answer, an undecodable answer).
fn send(sock: &Path, bytes: &[u8], close_write: bool) -> Result<BrokerError, String> {
    let mut s = UnixStream::connect(sock).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // An oversize prefix is answered and the connection closed at once: a write may
    // then meet a closed socket while the answer is already waiting to be read.
    let _ = s.write_all(bytes);
    if close_write {
        s.shutdown(std::net::Shutdown::Write).unwrap();
    }
    let mut prefix = [0u8; 4];
    s.read_exact(&mut prefix)
        .map_err(|e| format!("no response: {e}"))?;
    let mut body = vec![0; u32::from_be_bytes(prefix) as usize];
    s.read_exact(&mut body)
        .map_err(|e| format!("short response: {e}"))?;
    match decode_response(&body).map_err(|e| format!("undecodable response: {e}"))? {
        Response::Err(e) => Ok(e),
        Response::Ok(r) => Err(format!("ACCEPTED: {r:?}")),
    }
}

/// What the host looks like, in the parts a broker could change.
#[derive(PartialEq, Debug)]
struct HostState {
    mounts: BTreeSet<String>,
    run_dir: BTreeSet<PathBuf>,
    links_up: BTreeMap<String, bool>,
}

fn host_state(run_dir: &Path) -> HostState {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .map(|l| l.split_whitespace().nth(4).unwrap_or("").to_owned())
        .collect();
    let mut entries = BTreeSet::new();
    let mut stack = vec![run_dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            }
            entries.insert(e.path());
        }
    }
    let links_up = std::fs::read_dir("/sys/class/net")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let flags = std::fs::read_to_string(e.path().join("flags")).ok()?;
            let flags = u32::from_str_radix(flags.trim().trim_start_matches("0x"), 16).ok()?;
            Some((name, flags & 1 == 1))
        })
        .collect();
    HostState {
        mounts,
        run_dir: entries,
        links_up,
    }
}

/// Pids of stopped processes (state T or t).
fn stopped() -> BTreeSet<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    let rest = &s[s.rfind(')')? + 1..];
                    rest.split_whitespace()
                        .next()
                        .map(|st| st == "T" || st == "t")
                })
                .unwrap_or(false)
        })
        .collect()
}

fn live_processes() -> Vec<(i32, u64)> {
    let me = std::process::id() as i32;
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid > 1 && *pid != me)
        .filter_map(|pid| Some((pid, procfs::start_time(pid).ok()?)))
        .collect()
}

/// A deterministic byte generator (xorshift), so a failure names an input that the
/// next run produces again.
struct Gen(u64);
impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

const BAD_UIDS: &[&str] = &[
    "",
    "../../etc",
    "..",
    ".",
    "/",
    "/etc/passwd",
    "a/b",
    "A",
    "UPPER-case",
    "x;rm -rf /",
    "x y",
    "x\ny",
    "x\r\n",
    "x\u{0}y",
    "\u{0}",
    "x\ty",
    "ü",
    "mig_1",
    "mig.1",
    "mig:1",
    "mig@1",
    "$(id)",
    "`id`",
    "*",
    "?",
    "%2e%2e",
    "\\..\\..",
    "x\u{202e}y",
    "\u{feff}mig",
    "mig\u{7f}",
    "nul\u{0}../../etc",
    "0123456789012345678901234567890123456789012345678901234567890123456789",
    "-----------------------------------------------------------------------------------",
];

/// Container IDs the decoder refuses: path separators and traversal, a runtime prefix
/// left on, what cannot be a cgroup name component, too long.
const BAD_CONTAINERS: &[&str] = &[
    "",
    ".",
    "..",
    "../x",
    "a/b",
    "/",
    "../../../sys/fs/cgroup",
    "containerd://0f1e2d3c",
    "x\u{0}y",
    "\u{0}",
    "x y",
    "x\ny",
    "ü",
    "x;rm -rf /",
    "$(id)",
    "*",
    "x\u{202e}y",
    "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789",
];

/// The UID values that are not strings at all.
const NON_STRING_UIDS: &[&str] = &["1", "null", "true", "[]", "{}", "[\"a\"]", "1e9", "-1"];

#[test]
fn broker_binary_rejects_a_thousand_hostile_inputs_and_changes_nothing() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    let mut b = BrokerProcess::start_with("corpus", &["--address-handover-cidrs", "198.18.0.0/15"]);
    let run = b.dir.join("run");
    let before = host_state(&run);
    let stopped_before = stopped();
    let mut cases: Vec<(&'static str, Vec<u8>, bool, Vec<ErrorKind>)> = Vec::new();
    use ErrorKind::*;

    // Garbage bodies, framed correctly.
    let mut g = Gen(0x9e37_79b9_7f4a_7c15);
    for i in 0..300 {
        let body = g.bytes(1 + i % 200);
        cases.push(("garbage", frame(&body), false, vec![Malformed, Truncated]));
    }
    // JSON that is not a request.
    for body in [
        "{}",
        "[]",
        "null",
        "1",
        "\"op\"",
        "{\"op\":1}",
        "{\"op\":null}",
        "{\"op\":[]}",
        "{\"uid\":\"m\"}",
        "{\"op\":\"kill\"}",
        "{\"op\":\"register\",\"uid\":\"m\"}",
        "{\"op\":\"register\",\"uid\":\"m\",\"role\":\"both\",\"process\":{\"pid\":5,\"start_time\":1}}",
        "{\"op\":\"register\",\"uid\":\"m\",\"role\":\"source\",\"process\":{\"pid\":-5,\"start_time\":1}}",
        "{\"op\":\"register\",\"uid\":\"m\",\"role\":\"source\",\"process\":{\"pid\":4294967296,\"start_time\":1}}",
        "{\"op\":\"register\",\"uid\":\"m\",\"role\":\"source\",\"process\":{\"pid\":\"5\",\"start_time\":1}}",
        "{\"op\":\"register\",\"uid\":\"m\",\"role\":\"source\",\"process\":{\"pid\":5}}",
        "{\"op\":\"move_cgroup\",\"uid\":\"m\"}",
    ] {
        cases.push((
            "not a request",
            frame(body.as_bytes()),
            false,
            vec![Malformed, NoSuchProcess],
        ));
    }
    // Frame-level abuse: oversize prefixes answer and close; truncated frames.
    for len in [MAX_FRAME as u32 + 1, 1 << 20, 1 << 31, u32::MAX] {
        cases.push((
            "oversize",
            len.to_be_bytes().to_vec(),
            false,
            vec![FrameTooLarge],
        ));
    }
    for (claimed, sent) in [(100u32, 10usize), (16, 0), (MAX_FRAME as u32, 100), (5, 4)] {
        let mut v = claimed.to_be_bytes().to_vec();
        v.extend(std::iter::repeat_n(b'{', sent));
        cases.push(("truncated", v, true, vec![Truncated]));
    }
    // Unknown ops.
    for op in [
        "mount",
        "umount",
        "exec",
        "shell",
        "chroot",
        "setns",
        "ptrace",
        "kill_all",
        "Kill",
        "KILL",
        "kill ",
        " kill",
        "register\u{0}",
        "bind-netns",
        "bindNetns",
        "move-cgroup",
        "signal",
        "open",
        "read_file",
        "write_file",
        "unlink",
        "symlink",
        "chmod",
        "chown",
        "reboot",
        "",
        "op",
        "forget_all",
        "lock_network2",
        "list_sockets_all",
    ] {
        let body = serde_json::json!({"op": op, "uid": "m-1"}).to_string();
        cases.push(("unknown op", frame(body.as_bytes()), false, vec![UnknownOp]));
    }
    // Unknown fields on every op (but the three that carry a process, which have a class
    // of their own).
    for op in ops_with_uid_only().chain(NAMING_OPS) {
        for field in ["path", "target", "netns", "pid", "cgroup", "signal", "Uid"] {
            let mut body = well_formed(op, "m-1");
            body[field] = "/etc".into();
            let body = body.to_string();
            cases.push((
                "unknown field",
                frame(body.as_bytes()),
                false,
                vec![Malformed],
            ));
        }
    }
    // Malformed UIDs on every op (and non-string UIDs).
    for op in OPS {
        for bad in BAD_UIDS {
            let body = serde_json::json!({"op": op, "uid": bad, "role": "source",
                "process": {"pid": 4242, "start_time": 1}})
            .to_string();
            cases.push(("bad uid", frame(body.as_bytes()), false, vec![InvalidUid]));
        }
        for bad in NON_STRING_UIDS {
            let body = format!("{{\"op\":\"{op}\",\"uid\":{bad}}}");
            cases.push(("bad uid", frame(body.as_bytes()), false, vec![InvalidUid]));
        }
    }
    // Malformed container IDs (and non-string ones, and none at all) on a register that
    // is otherwise well formed: refused by the decoder, before any pid is looked at.
    for (i, bad) in BAD_CONTAINERS.iter().enumerate() {
        let body = serde_json::json!({"op": "register", "uid": format!("m-badc-{i}"),
            "role": "source", "process": {"pid": 4242, "start_time": 1}, "container": bad})
        .to_string();
        cases.push((
            "bad container",
            frame(body.as_bytes()),
            false,
            vec![Malformed],
        ));
    }
    for bad in NON_STRING_UIDS {
        let body = format!(
            "{{\"op\":\"register\",\"uid\":\"m-badc\",\"role\":\"target\",\"process\":{{\"pid\":4242,\"start_time\":1}},\"container\":{bad}}}"
        );
        cases.push((
            "bad container",
            frame(body.as_bytes()),
            false,
            vec![Malformed],
        ));
    }
    let body =
        r#"{"op":"register","uid":"m-noc","role":"source","process":{"pid":4242,"start_time":1}}"#;
    cases.push((
        "bad container",
        frame(body.as_bytes()),
        false,
        vec![Malformed],
    ));
    // Every other live process on the machine, in both roles: none is under the
    // broker's pods cgroup root, so each is foreign (or gone/reused by now).
    let procs = live_processes();
    for (pid, start) in &procs {
        for role in ["source", "target"] {
            let body = serde_json::json!({"op": "register", "uid": format!("m-{pid}-{role}"),
                "role": role, "process": {"pid": pid, "start_time": start},
                "container": CONTAINER})
            .to_string();
            cases.push((
                "foreign process",
                frame(body.as_bytes()),
                false,
                vec![ForeignProcess, NoSuchProcess, PidReused],
            ));
        }
        // The same pid with another start time: a recycled pid.
        let body = serde_json::json!({"op": "register", "uid": format!("m-{pid}-reuse"),
            "role": "source", "process": {"pid": pid, "start_time": start + 1},
            "container": CONTAINER})
        .to_string();
        cases.push((
            "pid reuse",
            frame(body.as_bytes()),
            false,
            vec![PidReused, NoSuchProcess],
        ));
        let body = serde_json::json!({"op": "move_cgroup", "uid": format!("m-{pid}-move"),
            "process": {"pid": pid, "start_time": start}})
        .to_string();
        cases.push((
            "move_cgroup unregistered",
            frame(body.as_bytes()),
            false,
            vec![NotRegistered, NoSuchProcess, PidReused],
        ));
    }
    // Malformed addresses on the address hand-over's ops (and non-strings, and none at
    // all, and one beside a field it does not have): refused by the decoder.
    for op in ADDRESS_OPS {
        for bad in BAD_ADDRESSES {
            let body = serde_json::json!({"op": op, "uid": "m-addr", "address": bad}).to_string();
            cases.push((
                "bad address",
                frame(body.as_bytes()),
                false,
                vec![Malformed],
            ));
        }
        for bad in NON_STRING_UIDS
            .iter()
            .chain(&["3323068948", "[\"198.18.2.20\"]"])
        {
            let body = format!("{{\"op\":\"{op}\",\"uid\":\"m-addr\",\"address\":{bad}}}");
            cases.push((
                "bad address",
                frame(body.as_bytes()),
                false,
                vec![Malformed],
            ));
        }
        let body = serde_json::json!({"op": op, "uid": "m-addr"}).to_string();
        cases.push((
            "bad address",
            frame(body.as_bytes()),
            false,
            vec![Malformed],
        ));
        let body = serde_json::json!({"op": op, "uid": "m-addr", "addresses": ["198.18.2.20"]})
            .to_string();
        cases.push((
            "bad address",
            frame(body.as_bytes()),
            false,
            vec![Malformed],
        ));
    }
    // Every op on migrations nobody registered (`forget` excepted: forgetting what is
    // not registered is idempotent, answered Done, and changes nothing).
    for i in 0..12 {
        for op in ops_with_uid_only()
            .chain(NAMING_OPS)
            .filter(|op| *op != "forget")
        {
            let body = well_formed(op, &format!("never-{i}")).to_string();
            cases.push((
                "unregistered",
                frame(body.as_bytes()),
                false,
                vec![NotRegistered],
            ));
        }
    }

    let distinct: BTreeSet<&Vec<u8>> = cases.iter().map(|(_, b, _, _)| b).collect();
    let mut by_class: BTreeMap<&str, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    for (class, bytes, close, kinds) in &cases {
        *by_class.entry(class).or_default() += 1;
        match send(&b.socket, bytes, *close) {
            Ok(e) if kinds.contains(&e.kind) => {}
            Ok(e) => failures.push(format!(
                "{class}: {:?} → {e}, want one of {kinds:?}",
                String::from_utf8_lossy(bytes)
            )),
            Err(e) => failures.push(format!(
                "{class}: {:?} → {e}",
                String::from_utf8_lossy(bytes)
            )),
        }
    }
    eprintln!(
        "hostile inputs: {} ({} distinct), by class: {by_class:?}, failures: {}",
        cases.len(),
        distinct.len(),
        failures.len()
    );
    assert!(b.alive(), "the broker died");
    assert!(
        failures.is_empty(),
        "{} of {} hostile inputs not rejected as expected:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert!(
        distinct.len() >= 1000,
        "only {} distinct hostile inputs",
        distinct.len()
    );
    let after = host_state(&run);
    assert_eq!(before.run_dir, after.run_dir, "the run directory changed");
    let new_mounts: Vec<_> = after.mounts.difference(&before.mounts).collect();
    assert!(
        new_mounts
            .iter()
            .all(|m| !m.starts_with(b.dir.to_str().unwrap())),
        "mounts appeared under the broker's directory: {new_mounts:?}"
    );
    for (link, up) in &before.links_up {
        if let Some(now) = after.links_up.get(link) {
            assert_eq!(up, now, "link {link} changed state");
        }
    }
    let newly_stopped: Vec<_> = stopped().difference(&stopped_before).copied().collect();
    assert!(
        newly_stopped.is_empty(),
        "processes stopped: {newly_stopped:?}"
    );
}

#[test]
fn broker_binary_keeps_serving_through_a_connection_flood_and_a_slow_client() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    let mut b = BrokerProcess::start("flood");
    // A slow client: a length prefix and half a body, then nothing.
    const HEAD: &[u8] = b"{\"op\":\"kill\",\"uid\":";
    const TAIL: &[u8] = b"\"late-client\"}";
    const LEN: usize = 64;
    let mut slow = UnixStream::connect(&b.socket).unwrap();
    slow.write_all(&(LEN as u32).to_be_bytes()).unwrap();
    slow.write_all(HEAD).unwrap();
    // A flood of idle connections.
    let flood: Vec<UnixStream> = (0..400)
        .map(|_| UnixStream::connect(&b.socket).unwrap())
        .collect();
    // A real request still gets its answer.
    let e = send(
        &b.socket,
        &frame(br#"{"op":"kill","uid":"after-flood"}"#),
        false,
    )
    .expect("served after the flood");
    assert_eq!(e.kind, ErrorKind::NotRegistered);
    drop(flood);
    // The slow client finishing late is answered too, not with a stale buffer.
    slow.write_all(TAIL).unwrap();
    slow.write_all(&[b' '; LEN - HEAD.len() - TAIL.len()])
        .unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut prefix = [0u8; 4];
    slow.read_exact(&mut prefix).unwrap();
    let mut body = vec![0; u32::from_be_bytes(prefix) as usize];
    slow.read_exact(&mut body).unwrap();
    match decode_response(&body).unwrap() {
        Response::Err(e) => assert_eq!(e.kind, ErrorKind::NotRegistered, "{e}"),
        Response::Ok(r) => panic!("accepted: {r:?}"),
    }
    assert!(b.alive(), "the broker died");
}

/// A process tree in its own network namespace, in the broker's pods cgroup.
fn holder(b: &BrokerProcess) -> (Child, podmotion_wire::ids::ProcRef) {
    holder_in(b, CONTAINER)
}

/// A process tree in its own network namespace, in container `id`'s cgroup.
fn holder_in(b: &BrokerProcess, id: &str) -> (Child, podmotion_wire::ids::ProcRef) {
    let procs = b.procs_of(id);
    let child = Command::new("unshare")
        .args(["-n", "sh", "-c"])
        .arg(format!("echo $$ > {}; exec sleep 60", procs.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let inside = std::fs::read_to_string(&procs)
            .unwrap_or_default()
            .lines()
            .any(|l| l.trim() == pid.to_string());
        let slept =
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep");
        if inside && slept {
            break;
        }
        assert!(Instant::now() < deadline, "holder never settled");
        std::thread::sleep(Duration::from_millis(20));
    }
    let start_time = procfs::start_time(pid).unwrap();
    (child, podmotion_wire::ids::ProcRef { pid, start_time })
}

/// A live pod process, under the broker's pods root and in a network namespace of its
/// own — everything the broker checked before — registered under the ID of a container
/// it does not run in (a pid gone stale and reused by another container, or an agent
/// that resolved the wrong one) is refused: the broker pins only a process of the
/// container the agent names. Nothing is registered.
#[test]
fn broker_binary_refuses_a_process_registered_under_another_containers_id() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    use podmotion_broker::client::BrokerClient;
    use podmotion_wire::ids::{ContainerId, MigrationUid};
    let b = BrokerProcess::start("container");
    let (child, process) = holder_in(&b, OTHER_CONTAINER);
    let _child = KillOnDrop(child);
    let mut c = BrokerClient::connect(&b.socket).unwrap();
    for (u, role) in [
        ("m-foreign-src", BrokerRole::Source),
        ("m-foreign-tgt", BrokerRole::Target),
    ] {
        let uid = MigrationUid::parse(u).unwrap();
        let e = c
            .call(&Request::Register {
                uid: uid.clone(),
                role,
                process,
                container: container(),
            })
            .expect_err("a process of another container registered");
        assert_eq!(e.kind, ErrorKind::ForeignProcess, "{e}");
        for named in [
            format!("pid {}", process.pid),
            format!("/pod/{OTHER_CONTAINER}"),
            format!("container {CONTAINER}"),
        ] {
            assert!(e.message.contains(&named), "{named:?} not in {e}");
        }
        // Nothing was registered: no op acts on that UID.
        let e = c
            .call(&Request::NetnsAddrs { uid: uid.clone() })
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotRegistered, "{e}");
    }
    // The same process under its own container's ID registers (so the refusal above was
    // the container's, not anything else about the process).
    let uid = MigrationUid::parse("m-own").unwrap();
    let own = ContainerId::parse(OTHER_CONTAINER).unwrap();
    let r = c
        .call(&Request::Register {
            uid: uid.clone(),
            role: BrokerRole::Source,
            process,
            container: own.clone(),
        })
        .expect("a process registers under its own container");
    assert_eq!(
        r,
        Reply::Registered {
            cgroup: format!(
                "/{}/pod/{OTHER_CONTAINER}",
                b.cgroup.file_name().unwrap().to_string_lossy()
            )
        }
    );
    // Asked again with another container, it is not the same registration.
    let e = c
        .call(&Request::Register {
            uid: uid.clone(),
            role: BrokerRole::Source,
            process,
            container: container(),
        })
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::AlreadyRegistered, "{e}");
    c.call(&Request::Forget { uid }).unwrap();
}

/// Someone planted a symlink where the broker bind-mounts a holder's network namespace
/// (the file, or the netns directory itself): the broker must refuse, and neither
/// truncate nor mount over what the link points at.
#[test]
fn broker_binary_refuses_a_symlink_at_the_netns_path() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    use podmotion_broker::client::BrokerClient;
    use podmotion_wire::ids::MigrationUid;
    let b = BrokerProcess::start("symlink");
    let (mut child, process) = holder(&b);
    let victim_dir = b.dir.join("victim");
    std::fs::create_dir_all(&victim_dir).unwrap();
    let victim = victim_dir.join("file");
    std::fs::write(&victim, b"precious").unwrap();
    let netns_dir = b.dir.join("run/netns");
    std::fs::create_dir_all(&netns_dir).unwrap();
    let mut c = BrokerClient::connect(&b.socket).unwrap();
    let uid = MigrationUid::parse("m-link").unwrap();
    c.call(&Request::Register {
        uid: uid.clone(),
        role: BrokerRole::Target,
        process,
        container: container(),
    })
    .expect("a holder in the pods cgroup registers");
    let mounted_on_victim = || {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .any(|l| l.split_whitespace().nth(4) == Some(victim.to_str().unwrap()))
    };

    // 1. The mount point itself is a symlink to the victim file.
    std::os::unix::fs::symlink(&victim, netns_dir.join("m-link")).unwrap();
    let e = c
        .call(&Request::BindNetns { uid: uid.clone() })
        .expect_err("bind through a planted symlink");
    assert_eq!(e.kind, ErrorKind::UnsafePath, "{e}");
    assert!(
        !mounted_on_victim(),
        "the netns was mounted over the victim"
    );
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        b"precious",
        "victim truncated"
    );
    std::fs::remove_file(netns_dir.join("m-link")).unwrap();

    // 2. The netns directory is a symlink to the victim's directory (its `.lock`,
    // which the broker holds, goes with it: the broker keeps its lock on the inode).
    std::fs::remove_dir_all(&netns_dir).unwrap();
    std::os::unix::fs::symlink(&victim_dir, &netns_dir).unwrap();
    let e = c
        .call(&Request::BindNetns { uid: uid.clone() })
        .expect_err("bind through a planted directory symlink");
    assert_eq!(e.kind, ErrorKind::UnsafePath, "{e}");
    assert!(
        !victim_dir.join("m-link").exists(),
        "a mount point was created through the directory symlink"
    );
    std::fs::remove_file(&netns_dir).unwrap();

    // 3. With the links gone, the same request works and unbinds cleanly.
    let path = match c.call(&Request::BindNetns { uid: uid.clone() }).unwrap() {
        Reply::NetnsPath { path } => PathBuf::from(path),
        r => panic!("unexpected reply {r:?}"),
    };
    assert_eq!(path, netns_dir.join("m-link"));
    c.call(&Request::UnbindNetns { uid: uid.clone() }).unwrap();
    assert!(!path.exists(), "mount point left behind");
    c.call(&Request::Forget { uid }).unwrap();
    let _ = child.kill();
    let _ = child.wait();
}

/// Two brokers on one run directory (two releases with one `netnsDir` on a node): at
/// its start the second would roll back the first's journalled locks and unbind its
/// netns mount points. It is refused, says why, and the first's mount point stays.
#[test]
fn a_second_broker_on_the_same_run_directory_is_refused_and_changes_nothing() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    use podmotion_broker::client::BrokerClient;
    use podmotion_wire::ids::MigrationUid;
    use std::os::unix::fs::MetadataExt;
    let mut b = BrokerProcess::start("second");
    let (mut child, process) = holder(&b);
    let mut c = BrokerClient::connect(&b.socket).unwrap();
    let uid = MigrationUid::parse("m-second").unwrap();
    c.call(&Request::Register {
        uid: uid.clone(),
        role: BrokerRole::Target,
        process,
        container: container(),
    })
    .expect("a holder in the pods cgroup registers");
    let path = match c.call(&Request::BindNetns { uid: uid.clone() }).unwrap() {
        Reply::NetnsPath { path } => PathBuf::from(path),
        r => panic!("unexpected reply {r:?}"),
    };
    let netns = format!("/proc/{}/ns/net", process.pid);
    let ino = |p: &Path| std::fs::metadata(p).map(|m| m.ino());
    assert_eq!(ino(&path).unwrap(), ino(Path::new(&netns)).unwrap());

    let mut second = b.second_broker("second.sock", 1);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = second.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = second.kill();
            let _ = second.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut second.stderr.take().unwrap(), &mut stderr).unwrap();
    let status = status.expect("the second broker served the first's run directory");
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("another broker serves this run directory"),
        "{stderr}"
    );
    assert_eq!(
        ino(&path).ok(),
        ino(Path::new(&netns)).ok(),
        "the first broker's netns mount point was removed"
    );
    assert!(b.alive(), "the first broker died");
    c.call(&Request::UnbindNetns { uid: uid.clone() }).unwrap();
    c.call(&Request::Forget { uid }).unwrap();
    let _ = child.kill();
    let _ = child.wait();
}

/// The broker of an agent pod that replaces a deleted one starts while the old pod's
/// broker may still hold the run directory (finishing its stop grace or its
/// recovery). It waits for it instead of exiting into the kubelet's crash-loop
/// back-off, and serves as soon as the old one ends.
#[test]
fn a_broker_started_beside_a_dying_one_takes_over_when_it_ends() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    let mut old = BrokerProcess::start("takeover");
    let socket = old.dir.join("next.sock");
    let mut next = old.second_broker("next.sock", 30);
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        next.try_wait().unwrap().is_none(),
        "the next broker gave up while the old one held the run directory"
    );
    assert!(
        UnixStream::connect(&socket).is_err(),
        "the next broker served beside the old one"
    );
    assert!(old.alive(), "the old broker died");
    let _ = old.child.kill();
    let _ = old.child.wait();
    let deadline = Instant::now() + Duration::from_secs(20);
    while UnixStream::connect(&socket).is_err() {
        assert!(
            next.try_wait().unwrap().is_none() && Instant::now() < deadline,
            "the next broker did not take over once the old one ended"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = next.kill();
    let _ = next.wait();
}

/// A client with the agent's uid (root here) but outside the broker's pod — another
/// network namespace, as another pod's process would be — is refused before any
/// request is read.
#[test]
fn broker_binary_refuses_a_peer_with_the_right_uid_in_another_pod() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    let b = BrokerProcess::start("peer");
    let client = r#"
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
body = b'{"op":"kill","uid":"m-peer"}'
try:
    s.sendall(struct.pack(">I", len(body)) + body)
except OSError:
    pass
n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
sys.stdout.write(s.recv(n, socket.MSG_WAITALL).decode())
"#;
    let answer = |netns: bool| {
        let mut cmd = if netns {
            let mut c = Command::new("unshare");
            c.args(["-n", "python3"]);
            c
        } else {
            Command::new("python3")
        };
        let out = cmd
            .args(["-c", client])
            .arg(&b.socket)
            .output()
            .expect("run python3");
        assert!(out.status.success(), "client failed: {out:?}");
        match decode_response(&out.stdout).unwrap() {
            Response::Err(e) => e,
            Response::Ok(r) => panic!("accepted: {r:?}"),
        }
    };
    // Same uid, same network namespace: served (the request itself is refused).
    assert_eq!(answer(false).kind, ErrorKind::NotRegistered);
    // Same uid, another network namespace: refused as a peer.
    let e = answer(true);
    assert_eq!(e.kind, ErrorKind::PeerNotAllowed, "{e}");
    assert!(e.message.contains("not the broker's pod"), "{e}");
}

/// The state of a process (`R`, `S`, `T`, …).
fn proc_state(pid: i32) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    s.rfind(')')
        .and_then(|i| s[i + 1..].split_whitespace().next().map(str::to_owned))
        .unwrap_or_default()
}

/// A source with a link of its own (`pm0`: up, with IPv4 and IPv6 addresses and a
/// route of each family through a gateway) in its netns, in [`CONTAINER`]'s cgroup.
fn linked_source(b: &BrokerProcess) -> (KillOnDrop, podmotion_wire::ids::ProcRef) {
    let procs = b.procs();
    let child = KillOnDrop(
        Command::new("unshare")
            .args(["-n", "sh", "-c"])
            .arg(format!(
                "echo $$ > {}; ip link add pm0 type veth peer name pm1 && ip addr add 198.18.254.1/24 dev pm0 && ip link set pm1 up && ip link set pm0 up && ip -6 addr add 2001:db8:254::1/64 dev pm0 nodad && ip -6 route add 2001:db8:99::/64 via 2001:db8:254::2 dev pm0 && exec sleep 120",
                procs.display()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id() as i32;
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(format!("/proc/{pid}/comm")).map_or(true, |c| c.trim() != "sleep")
    {
        assert!(Instant::now() < deadline, "source never settled");
        std::thread::sleep(Duration::from_millis(20));
    }
    let process = podmotion_wire::ids::ProcRef {
        pid,
        start_time: procfs::start_time(pid).unwrap(),
    };
    (child, process)
}

/// Whether `pm0` is up in `pid`'s network namespace.
fn link_up(pid: i32) -> bool {
    let out = Command::new("nsenter")
        .args([
            "-t",
            &pid.to_string(),
            "-n",
            "ip",
            "-o",
            "link",
            "show",
            "pm0",
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).contains(",UP")
}

/// The broker dies (SIGKILL) while a source it locked is frozen: its links are down
/// and its tree stopped. A broker started again on the same run directory must roll the
/// source back — links up, routes back, tree running — and leave nothing behind.
#[test]
fn broker_binary_restarted_with_a_source_locked_rolls_it_back() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    use podmotion_broker::client::BrokerClient;
    use podmotion_wire::ids::MigrationUid;
    let mut b = BrokerProcess::start("restart");
    let (_source, process) = linked_source(&b);
    let pid = process.pid;
    let link_up = || link_up(pid);
    let has_route = || {
        let out = Command::new("nsenter")
            .args(["-t", &pid.to_string(), "-n", "ip", "-4", "route", "show"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).contains("198.18.254.0/24")
    };
    let has_route6 = || {
        let out = Command::new("nsenter")
            .args(["-t", &pid.to_string(), "-n", "ip", "-6", "route", "show"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).contains("2001:db8:99::/64 via 2001:db8:254::2")
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(link_up() && has_route() && has_route6()) {
        assert!(Instant::now() < deadline, "the source's link is not set up");
        std::thread::sleep(Duration::from_millis(20));
    }

    let mut c = BrokerClient::connect(&b.socket).unwrap();
    let uid = MigrationUid::parse("m-restart").unwrap();
    c.call(&Request::Register {
        uid: uid.clone(),
        role: BrokerRole::Source,
        process,
        container: container(),
    })
    .unwrap();
    c.call(&Request::LockNetwork { uid, hold: None }).unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGSTOP).unwrap();
    assert!(!link_up(), "lock_network left the link up");

    // The broker dies with the source frozen and locked.
    b.child.kill().unwrap();
    b.child.wait().unwrap();
    drop(c);
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !link_up(),
        "nothing should have undone the lock without a broker"
    );
    assert_eq!(proc_state(pid), "T", "the source should still be stopped");

    // A new broker on the same run directory.
    let socket = b.socket.clone();
    b.child = Command::new(env!("CARGO_BIN_EXE_podmotion-broker"))
        .arg("--socket")
        .arg(&socket)
        .arg("--run-dir")
        .arg(b.dir.join("run"))
        .arg("--pods-cgroup-root")
        .arg(format!(
            "/{}",
            b.cgroup.file_name().unwrap().to_string_lossy()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(link_up() && proc_state(pid) != "T" && UnixStream::connect(&socket).is_ok()) {
        assert!(
            Instant::now() < deadline,
            "the restarted broker did not roll the source back: link up {}, state {}",
            link_up(),
            proc_state(pid)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(has_route(), "the source's route was not restored");
    assert!(
        has_route6(),
        "the source's IPv6 address and route were not restored"
    );
    let journal: Vec<_> = std::fs::read_dir(b.dir.join("run/netns/.journal"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(journal.is_empty(), "journal left behind: {journal:?}");
}

/// A broker of `name` started with `args`, a source of its own registered, locked and
/// stopped (as after a final dump) over the connection returned, then sent SIGTERM.
fn terminated_with_a_source_locked(
    name: &str,
    args: &[&str],
) -> (
    BrokerProcess,
    KillOnDrop,
    podmotion_wire::ids::ProcRef,
    podmotion_broker::client::BrokerClient,
) {
    use podmotion_wire::ids::MigrationUid;
    let b = BrokerProcess::start_with(name, args);
    let (source, process) = linked_source(&b);
    let mut c = podmotion_broker::client::BrokerClient::connect(&b.socket).unwrap();
    let uid = MigrationUid::parse("m-stop").unwrap();
    c.call(&Request::Register {
        uid: uid.clone(),
        role: BrokerRole::Source,
        process,
        container: container(),
    })
    .unwrap();
    c.call(&Request::LockNetwork { uid, hold: None }).unwrap();
    let pid = nix::unistd::Pid::from_raw(process.pid);
    nix::sys::signal::kill(pid, nix::sys::signal::SIGSTOP).unwrap();
    assert!(!link_up(process.pid), "lock_network left the link up");
    let broker = nix::unistd::Pid::from_raw(b.child.id() as i32);
    nix::sys::signal::kill(broker, nix::sys::signal::SIGTERM).unwrap();
    (b, source, process, c)
}

/// Waits up to 20 s for the broker to exit: its exit status.
fn exited(b: &mut BrokerProcess) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(s) = b.child.try_wait().unwrap() {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "the broker did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The journal records left in `b`'s run directory.
fn journal(b: &BrokerProcess) -> Vec<PathBuf> {
    std::fs::read_dir(b.dir.join("run/netns/.journal"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// SIGTERM (the pod's deletion, a rollout) with a source locked: the broker serves on
/// (its agent, stopping too, resumes the source through it) and exits 0 as soon as
/// no registration is left, well before its grace ends.
#[test]
fn a_terminated_broker_serves_its_agents_last_calls_then_exits() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    use podmotion_wire::ids::MigrationUid;
    let (mut b, _source, process, mut c) =
        terminated_with_a_source_locked("stop-served", &["--stop-grace-seconds", "600"]);
    std::thread::sleep(Duration::from_millis(300));
    assert!(b.alive(), "the broker exited with a registration held");
    let uid = MigrationUid::parse("m-stop").unwrap();
    c.call(&Request::UnlockNetwork { uid: uid.clone() })
        .expect("the agent's unlock after SIGTERM");
    c.call(&Request::Resume { uid: uid.clone() })
        .expect("the agent's resume after SIGTERM");
    assert!(link_up(process.pid));
    assert_ne!(proc_state(process.pid), "T");
    c.call(&Request::Forget { uid }).expect("forget");
    let status = exited(&mut b);
    assert!(status.success(), "{status}");
    assert!(journal(&b).is_empty(), "{:?}", journal(&b));
}

/// SIGTERM with a source locked and an agent that never comes (it hangs, or died
/// before the broker): once its grace ends the broker rolls the source back itself —
/// link up, tree running, journal empty — and exits 0, where before it died at once
/// and left the source locked and stopped until a next broker (none after an
/// uninstall).
#[test]
fn a_terminated_broker_whose_agent_never_comes_rolls_back_and_exits() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    let (mut b, _source, process, c) =
        terminated_with_a_source_locked("stop-alone", &["--stop-grace-seconds", "1"]);
    let status = exited(&mut b);
    assert!(status.success(), "{status}");
    assert!(link_up(process.pid), "the source's link stayed down");
    assert_ne!(proc_state(process.pid), "T", "the source stayed stopped");
    assert!(journal(&b).is_empty(), "{:?}", journal(&b));
    drop(c);
}

/// Kills (SIGKILL also ends a stopped process) and reaps a child however the test ends.
struct KillOnDrop(Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The child half of the next test, run by it as `<this test binary> --exact
/// holds_tcp_sockets_when_asked` inside a fresh network namespace: with
/// `PM_HOLD_TCP_SOCKETS=N` it opens N TCP listeners on loopback and sleeps; otherwise
/// (an ordinary test run) it returns at once.
#[test]
fn holds_tcp_sockets_when_asked() {
    let Some(n) = std::env::var("PM_HOLD_TCP_SOCKETS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    else {
        return;
    };
    let held: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    std::thread::sleep(Duration::from_secs(120));
    drop(held);
}

/// A source in the broker's pods cgroup, in its own network namespace, holding `n` TCP
/// listeners (the child half above); returns once all of them exist.
fn socket_holder(b: &BrokerProcess, n: usize) -> (KillOnDrop, podmotion_wire::ids::ProcRef) {
    let procs = b.procs();
    let me = std::env::current_exe().unwrap();
    let child = KillOnDrop(
        Command::new("unshare")
            .args(["-n", "sh", "-c"])
            .arg(format!(
                "ulimit -n 4096 && ip link set lo up && echo $$ > {} && exec {} --exact holds_tcp_sockets_when_asked --test-threads=1",
                procs.display(),
                me.display()
            ))
            .env("PM_HOLD_TCP_SOCKETS", n.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id() as i32;
    let deadline = Instant::now() + Duration::from_secs(20);
    while procfs::tcp_fds(pid).len() < n {
        assert!(
            Instant::now() < deadline,
            "the holder never opened its {n} sockets ({} so far)",
            procfs::tcp_fds(pid).len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let process = podmotion_wire::ids::ProcRef {
        pid,
        start_time: procfs::start_time(pid).unwrap(),
    };
    (child, process)
}

/// More TCP sockets than one answer lists: the broker once handed over the first
/// 1,024 and dropped the rest without a word (their connections would have been lost on
/// the target); it refuses with `TooManySockets` and lists nothing. A source under the
/// limit gets every one of its sockets listed, by address, in one answer.
#[test]
fn broker_binary_refuses_to_list_more_sockets_than_one_answer_carries() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    use podmotion_broker::client::BrokerClient;
    use podmotion_wire::ids::MigrationUid;
    let b = BrokerProcess::start("sockets");
    for (n, uid) in [
        (MAX_SOCKETS + 76, "m-many-sockets"),
        (200, "m-some-sockets"),
    ] {
        let (_child, process) = socket_holder(&b, n);
        let uid = MigrationUid::parse(uid).unwrap();
        let mut c = BrokerClient::connect(&b.socket).unwrap();
        c.call(&Request::Register {
            uid: uid.clone(),
            role: BrokerRole::Source,
            process,
            container: container(),
        })
        .unwrap();
        match c.call(&Request::ListSockets { uid: uid.clone() }) {
            Err(e) if n > MAX_SOCKETS => assert_eq!(e.kind, ErrorKind::TooManySockets, "{e}"),
            Ok(Reply::Sockets { sockets }) if n <= MAX_SOCKETS => {
                assert_eq!(sockets.len(), n);
                assert!(sockets.iter().all(|s| s.listening
                    && s.remote.is_none()
                    && s.local.is_some_and(|a| a.ip().is_loopback())));
            }
            other => panic!("{n} sockets: {other:?}"),
        }
        c.call(&Request::Forget { uid }).unwrap();
    }
}

/// The restore fence on the real broker binary: a fenced source (frozen, locked, the
/// fence journalled) is killed, never resumed, when the agent's connection ends (the
/// agent died) and when a broker restarts on the run directory its predecessor left.
#[test]
fn broker_binary_kills_a_fenced_source_on_a_lost_lease_and_after_a_restart() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    use podmotion_broker::client::BrokerClient;
    use podmotion_wire::ids::MigrationUid;
    let mut b = BrokerProcess::start("fence");
    let procs = b.procs();
    for restart in [false, true] {
        let mut child = KillOnDrop(
            Command::new("unshare")
                .args(["-n", "sh", "-c"])
                .arg(format!(
                    "echo $$ > {}; ip link set lo up; exec sleep 120",
                    procs.display()
                ))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let pid = child.0.id() as i32;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .map_or(true, |c| c.trim() != "sleep")
        {
            assert!(Instant::now() < deadline, "source never settled");
            std::thread::sleep(Duration::from_millis(20));
        }
        let process = podmotion_wire::ids::ProcRef {
            pid,
            start_time: procfs::start_time(pid).unwrap(),
        };
        let mut c = BrokerClient::connect(&b.socket).unwrap();
        let uid = MigrationUid::parse(if restart { "m-fence-r" } else { "m-fence-l" }).unwrap();
        c.call(&Request::Register {
            uid: uid.clone(),
            role: BrokerRole::Source,
            process,
            container: container(),
        })
        .unwrap();
        c.call(&Request::LockNetwork {
            uid: uid.clone(),
            hold: None,
        })
        .unwrap();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGSTOP).unwrap();
        // A signal is delivered when the process next runs: under load that is later
        // than this thread's next read of its state (seen once at load 6.5).
        let stopped_by = Instant::now() + Duration::from_secs(10);
        while proc_state(pid) != "T" {
            assert!(Instant::now() < stopped_by, "the source never stopped");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            c.call(&Request::Fence { uid: uid.clone() }).unwrap(),
            Reply::Done
        );
        let refused = c.call(&Request::Resume { uid: uid.clone() }).unwrap_err();
        assert_eq!(refused.kind, ErrorKind::Fenced, "{refused}");
        assert_eq!(proc_state(pid), "T", "a fenced source is not resumed");
        if restart {
            // The broker dies with the source fenced; a new one starts on its run dir.
            b.child.kill().unwrap();
            b.child.wait().unwrap();
            drop(c);
            std::thread::sleep(Duration::from_millis(200));
            assert_eq!(proc_state(pid), "T", "nothing acts without a broker");
            b.child = Command::new(env!("CARGO_BIN_EXE_podmotion-broker"))
                .arg("--socket")
                .arg(&b.socket)
                .arg("--run-dir")
                .arg(b.dir.join("run"))
                .arg("--pods-cgroup-root")
                .arg(format!(
                    "/{}",
                    b.cgroup.file_name().unwrap().to_string_lossy()
                ))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
        } else {
            // The agent's connection ends: its lease is lost.
            drop(c);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let st = proc_state(pid);
            assert!(
                st != "S" && st != "R",
                "the fenced source was resumed (state {st})"
            );
            if st == "Z" || st.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the fenced source was not killed (restart: {restart}; state {st})"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.0.wait();
        let journal: Vec<_> = std::fs::read_dir(b.dir.join("run/netns/.journal"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(journal.is_empty(), "journal left behind: {journal:?}");
    }
}

/// Runs `sh -c script`, panicking with its stderr when it fails.
fn sh(script: &str) -> String {
    let out = Command::new("sh").args(["-c", script]).output().unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Deletes a link of the node's network namespace (a veth: its peer goes with it).
struct DelLink(String);
impl Drop for DelLink {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.0]).output();
    }
}

/// While a source's links are down, the node's neighbour entries for its addresses fail
/// (a client's retransmission, a kubelet probe). Right after the unlock they must hold
/// the pod's MAC again, for IPv4 and IPv6: otherwise a connection the node opens then
/// joins a failing resolution and gets EHOSTUNREACH for up to its probe time (3 s by
/// default) — seen by the real-node interrupted-migrations test as "No route to host"
/// from a thawed source.
#[test]
fn broker_binary_unlock_announces_the_pods_address_to_the_node() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    use podmotion_broker::client::BrokerClient;
    use podmotion_wire::ids::MigrationUid;
    let b = BrokerProcess::start("announce");
    let (child, process) = holder(&b);
    let _child = KillOnDrop(child);
    let pid = process.pid;
    let host = format!("pmga{}", std::process::id() % 100_000);
    let pod = format!("pmgp{}", std::process::id() % 100_000);
    let (node4, pod4) = ("198.18.127.1", "198.18.127.2");
    let (node6, pod6) = ("2001:db8:127::1", "2001:db8:127::2");
    sh(&format!(
        "ip link add {host} type veth peer name {pod} netns {pid}"
    ));
    let _link = DelLink(host.clone());
    // IPv4: the node gives up on an unanswered resolution after one probe of 50 ms (an
    // ARP reply or gratuitous ARP settles a FAILED entry too). IPv6: it probes every
    // 5 s, so that the entry is still INCOMPLETE at the unlock (Linux ignores a
    // Neighbour Advertisement for a FAILED entry; a FAILED entry is resolved anew by the
    // next packet — the window that returns EHOSTUNREACH is a resolution still under
    // way, which an advertisement completes).
    let mut setup = String::new();
    for (family, knob, v) in [
        ("ipv4", "mcast_solicit", 1),
        ("ipv4", "ucast_solicit", 1),
        ("ipv4", "retrans_time_ms", 50),
        ("ipv6", "mcast_solicit", 3),
        ("ipv6", "retrans_time_ms", 5000),
    ] {
        setup += &format!("echo {v} > /proc/sys/net/{family}/neigh/{host}/{knob} && ");
    }
    sh(&format!(
        "{setup}ip addr add {node4}/24 dev {host} && ip -6 addr add {node6}/64 dev {host} nodad && \
         ip link set {host} up && \
         nsenter -t {pid} -n sh -c 'ip addr add {pod4}/24 dev {pod} && ip -6 addr add {pod6}/64 dev {pod} nodad && ip link set {pod} up && ip link set lo up'"
    ));
    let pod_mac = sh(&format!("nsenter -t {pid} -n ip -o link show {pod}"))
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .expect("the pod's MAC")
        .to_owned();
    let entries = || {
        [pod4, pod6].map(|a| {
            sh(&format!("ip neigh show {a} dev {host}"))
                .trim()
                .to_owned()
        })
    };
    let poke = || {
        for (from, to) in [(node4, pod4), (node6, pod6)] {
            let from: std::net::IpAddr = from.parse().unwrap();
            let to: std::net::IpAddr = to.parse().unwrap();
            let s = std::net::UdpSocket::bind((from, 0)).unwrap();
            let _ = s.send_to(b"x", (to, 9));
        }
    };
    let wait = |what: &str, ok: &dyn Fn(usize, &str) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let e = entries();
            if e.iter().enumerate().all(|(i, e)| ok(i, e)) {
                return;
            }
            assert!(Instant::now() < deadline, "{what}: the entries are {e:?}");
            poke();
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // The setup works: the node resolves the pod, both families.
    wait("before the lock", &|_, e| e.contains(&pod_mac));

    let mut c = BrokerClient::connect(&b.socket).unwrap();
    let uid = MigrationUid::parse("m-announce").unwrap();
    c.call(&Request::Register {
        uid: uid.clone(),
        role: BrokerRole::Source,
        process,
        container: container(),
    })
    .unwrap();
    c.call(&Request::LockNetwork {
        uid: uid.clone(),
        hold: None,
    })
    .unwrap();
    // Traffic to the locked pod: the node's IPv4 entry fails, its IPv6 one is being
    // resolved.
    sh(&format!("ip neigh flush dev {host}"));
    wait("while locked", &|i, e| {
        e.contains(if i == 0 { "FAILED" } else { "INCOMPLETE" })
    });

    c.call(&Request::UnlockNetwork { uid: uid.clone() })
        .unwrap();
    // No traffic since: only the pod's announcements can have settled the entries.
    let after = entries();
    for (addr, e) in [pod4, pod6].iter().zip(&after) {
        assert!(
            e.contains(&format!("lladdr {pod_mac}")),
            "the node's entry for {addr} right after the unlock: {e:?} (the pod's MAC is {pod_mac})"
        );
    }
    c.call(&Request::Forget { uid }).unwrap();
}

/// The address hand-over on the shipped binary (`--address-handover-cidrs
/// 198.18.0.0/15`), a target registered: every address outside the CIDRs or never a
/// pod's is `address_not_allowed` and changes nothing; at most eight addresses a
/// migration; one broker without the flag answers `handover_off`. What was adopted goes
/// with `forget` (nothing was restored), its record too.
#[test]
fn broker_binary_refuses_addresses_outside_its_hand_over_policy() {
    if !require_root() {
        return;
    }
    let _serial = serial();
    use podmotion_broker::client::BrokerClient;
    use podmotion_wire::ids::MigrationUid;
    let addrs_of = |pid: i32| sh(&format!("nsenter -t {pid} -n ip -o addr show"));
    let adopt = |c: &mut BrokerClient, uid: &MigrationUid, a: &str| {
        c.call(&Request::AdoptAddress {
            uid: uid.clone(),
            address: a.parse().unwrap(),
        })
    };
    let uid = MigrationUid::parse("m-policy").unwrap();

    let off = BrokerProcess::start("handover-off");
    let (child, process) = holder(&off);
    let _child = KillOnDrop(child);
    let mut c = BrokerClient::connect(&off.socket).unwrap();
    c.call(&Request::Register {
        uid: uid.clone(),
        role: BrokerRole::Target,
        process,
        container: container(),
    })
    .unwrap();
    let e = adopt(&mut c, &uid, "198.18.2.20").unwrap_err();
    assert_eq!(e.kind, ErrorKind::HandoverOff, "{e}");
    c.call(&Request::Forget { uid: uid.clone() }).unwrap();
    drop((c, _child, off));

    let b = BrokerProcess::start_with(
        "handover-on",
        &["--address-handover-cidrs", "198.18.0.0/15"],
    );
    let (child, process) = holder(&b);
    let _child = KillOnDrop(child);
    let pid = process.pid;
    // The holder's links: a veth pair, the default route through d0, which takes the
    // adopted addresses.
    sh(&format!(
        "nsenter -t {pid} -n sh -c 'ip link add d0 type veth peer name d1 && ip addr add 198.18.9.1/24 dev d0 && ip link set d1 up && ip link set d0 up && ip route add default via 198.18.9.2 dev d0'"
    ));
    let before = addrs_of(pid);
    let mut c = BrokerClient::connect(&b.socket).unwrap();
    c.call(&Request::Register {
        uid: uid.clone(),
        role: BrokerRole::Target,
        process,
        container: container(),
    })
    .unwrap();
    for a in [
        "198.20.0.1",
        "198.17.255.255",
        "10.0.0.1",
        "203.0.113.7",
        "127.0.0.1",
        "0.0.0.0",
        "255.255.255.255",
        "224.0.0.1",
        "169.254.10.1",
        "::ffff:198.18.2.20",
        "::1",
        "::",
        "fe80::1",
        "ff02::1",
        "2001:db8::5",
    ] {
        let e = adopt(&mut c, &uid, a).unwrap_err();
        assert_eq!(e.kind, ErrorKind::AddressNotAllowed, "{a}: {e}");
    }
    assert_eq!(addrs_of(pid), before, "a refused address changed the pod");
    assert!(
        !b.dir.join("run/netns/.handover").exists(),
        "a refused address was recorded"
    );
    for i in 1..=8 {
        assert_eq!(
            adopt(&mut c, &uid, &format!("198.18.2.{i}")).unwrap(),
            Reply::Done
        );
    }
    let e = adopt(&mut c, &uid, "198.18.2.9").unwrap_err();
    assert_eq!(e.kind, ErrorKind::AddressNotAllowed, "{e}");
    let now = addrs_of(pid);
    assert_eq!(now.matches("/32 scope global d0").count(), 8, "{now}");
    assert!(!now.contains("198.18.2.9/"), "{now}");
    c.call(&Request::Forget { uid }).unwrap();
    assert_eq!(addrs_of(pid), before, "forget left adopted addresses");
    let records: Vec<_> = std::fs::read_dir(b.dir.join("run/netns/.handover"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(records.is_empty(), "records left behind: {records:?}");
}

/// An invalid hand-over flag stops the binary at start, naming what is wrong: a CIDR
/// that is not one (by flag or environment), a linger out of 1..=86400 seconds.
#[test]
fn broker_binary_refuses_to_start_with_invalid_hand_over_flags() {
    let dir = std::env::temp_dir().join(format!("pmhb-flags-{}", std::process::id()));
    let run = |args: &[&str], env: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_podmotion-broker"));
        cmd.arg("--socket")
            .arg(dir.join("b.sock"))
            .arg("--run-dir")
            .arg(dir.join("run"))
            .args(args)
            .env_remove("PODMOTION_ADDRESS_HANDOVER_CIDRS")
            .env_remove("PODMOTION_ADDRESS_LINGER_SECONDS")
            .stdin(Stdio::null());
        if let Some(v) = env {
            cmd.env("PODMOTION_ADDRESS_HANDOVER_CIDRS", v);
        }
        let out = cmd.output().unwrap();
        assert!(!out.status.success(), "{args:?} {env:?} started");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    for (args, env, named) in [
        (
            &["--address-handover-cidrs", "198.18.0.0/15,198.18.0.0/33"][..],
            None,
            "198.18.0.0/33",
        ),
        (&["--address-handover-cidrs", "pods"], None, "pods"),
        (
            &["--address-handover-cidrs", "198.18.0.1/15"],
            None,
            "198.18.0.1/15",
        ),
        (&[], Some("198.18.0.0/15, 2001:db8::1/32"), "2001:db8::1/32"),
        (
            &["--address-linger-seconds", "0"],
            None,
            "address-linger-seconds",
        ),
        (&["--address-linger-seconds", "86401"], None, "86401"),
    ] {
        let stderr = run(args, env);
        assert!(stderr.contains(named), "{args:?} {env:?}: {stderr}");
    }
    assert!(!dir.join("b.sock").exists(), "a broker served");
    let _ = std::fs::remove_dir_all(&dir);
}
