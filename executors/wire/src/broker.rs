//! The netns broker's protocol: one request frame, one response frame, over a
//! root-owned Unix stream socket (mode 0600, peer uid checked with SO_PEERCRED).
//!
//! Frame = 4-byte big-endian length + JSON body, the body at most [`MAX_FRAME`] bytes.
//! A request is one of a fixed set of ops ([`Request`]); unknown ops, unknown fields,
//! malformed UIDs and oversize or truncated frames are rejected by [`decode_request`]
//! before anything is looked at. Errors are typed ([`ErrorKind`]).
//!
//! Every answer is one frame and nothing else: no descriptor ever crosses this socket
//! (the workload's sockets are described by their addresses, [`SocketAddrs`]).

use crate::ids::{ContainerId, MigrationUid, ProcRef};
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr};

/// Largest request body: what the broker reads from its (untrusted) client.
pub const MAX_FRAME: usize = 16 * 1024;
/// Largest response body: what the agent reads from the broker. Sized for the largest
/// answer, a [`Reply::Sockets`] of [`MAX_SOCKETS`] sockets each with the longest
/// addresses there are (IPv6 with a scope id, about 160 bytes of JSON a socket):
/// a test in this module encodes that reply and checks it fits.
pub const MAX_REPLY_FRAME: usize = 256 * 1024;
/// TCP sockets per `list_sockets` answer: a source with more is refused with
/// [`ErrorKind::TooManySockets`], never answered with a silently truncated list.
pub const MAX_SOCKETS: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BrokerRole {
    Source,
    Target,
}

/// The fixed op set. `docs/broker-ops.md` says for each why the agent cannot do it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Pin a migration to a process: the source workload's root, or the target pod's
    /// holder. Later ops act only on what was pinned here. `container` is the container
    /// the operator named in `Prepare` (its bare ID, as the runtime reports it), which
    /// the agent resolved to `process`: the broker refuses a process whose cgroup is
    /// not that container's.
    Register {
        uid: MigrationUid,
        role: BrokerRole,
        process: ProcRef,
        container: ContainerId,
    },
    /// Target: bind-mount the holder's network namespace at a path the broker computes
    /// from the UID (`<run>/netns/<uid>`), for CRIU's `--join-ns net:<path>`.
    BindNetns {
        uid: MigrationUid,
    },
    UnbindNetns {
        uid: MigrationUid,
    },
    /// Addresses present in the registered process's network namespace.
    NetnsAddrs {
        uid: MigrationUid,
    },
    /// Source: isolate the pod's network (links down, routes saved) for the freeze.
    LockNetwork {
        uid: MigrationUid,
        /// Hold the pod's new connections from the lock to the forward or the unlock
        /// (the broker's `--forward-new-connections` on): those to the source's own
        /// addresses and to these Service ports whose endpoints list the source (at
        /// most [`MAX_FORWARDED_SERVICES`]; `target_port` is not used). `None` (an
        /// agent's lock of a pod's further container, whose network is the first's,
        /// or an agent of before the hold): nothing held.
        #[serde(default)]
        hold: Option<Vec<ForwardedService>>,
    },
    UnlockNetwork {
        uid: MigrationUid,
    },
    /// Source: the addresses of the workload's TCP sockets (each socket once, however
    /// many processes of the tree hold it). Only addresses leave the broker.
    ListSockets {
        uid: MigrationUid,
    },
    /// Source: take the workload's sockets out of TCP repair mode (after a
    /// `leave_stopped` dump) so they work again on resume or close with FIN on kill.
    ReleaseTcpRepair {
        uid: MigrationUid,
    },
    /// Target: move a restored tree (which must live in the holder's network
    /// namespace) into the holder's cgroup v2 scope.
    MoveCgroup {
        uid: MigrationUid,
        process: ProcRef,
    },
    /// Target: charge what CRIU's restore allocates to the pod, not to the agent.
    /// `process` is the agent's launcher of CRIU's restore, not yet started (a process of
    /// the agent's own pod: the broker's network namespace, never the broker itself): it
    /// is moved into the holder's memory cgroup (the v1 `memory` hierarchy, and the
    /// holder's cgroup v2 directory where it has one), so CRIU and the tree it restores
    /// are created there. Memory is charged where it is first touched and a later move
    /// does not carry its charge along (this kernel has no charge moving), so without
    /// this the restored workload's memory stays charged to the agent's container.
    ChargeRestore {
        uid: MigrationUid,
        process: ProcRef,
    },
    /// Target: take over one address of the source pod (the address hand-over the
    /// installer enabled: `--address-handover-cidrs`, off by default): add it to the
    /// holder's network namespace, on the link of its default route (or its only link;
    /// `/32`, or `/128` with `nodad`), and announce it from there (gratuitous ARP,
    /// unsolicited Neighbour Advertisement), so the restored tree keeps its established
    /// connections. Done at once if the address is there already (adopted before, or
    /// the pod's own: then nothing is recorded, nothing later removed). The address must
    /// lie in one of those CIDRs. Once `move_cgroup` has moved the restored tree it
    /// lingers after the migration while a restored connection uses it (see the
    /// broker's sweep), never past the installer's `--address-linger-seconds`; before,
    /// `forget` or the lease's end withdraws it.
    AdoptAddress {
        uid: MigrationUid,
        address: IpAddr,
    },
    /// Target: remove an adopted address from the holder's namespace (rollback, before
    /// the source is resumed and announces it again). Done if it was not adopted.
    ReleaseAddress {
        uid: MigrationUid,
        address: IpAddr,
    },
    /// Source: SIGCONT the registered tree (abort).
    Resume {
        uid: MigrationUid,
    },
    /// Source: SIGKILL the registered tree (commit).
    Kill {
        uid: MigrationUid,
    },
    /// Source: the restore fence (the operator is about to ask the target to restore).
    /// From here the broker never resumes this source: `resume` is refused, and a lost
    /// lease or a broker restart kills the tree instead of rolling it back. Needs the
    /// network locked (the final dump's freeze); recorded in the journal before it is
    /// reported done, so a restarted broker keeps it.
    Fence {
        uid: MigrationUid,
    },
    /// Source: lifts the fence (the operator's abort, sent once the target's copy is
    /// confirmed killed); the source may be resumed again.
    Unfence {
        uid: MigrationUid,
    },
    /// Source, locked and fenced: the node sends NEW TCP connections that would reach the locked
    /// source to the restored target instead (the operator asks once the target's probe
    /// passed), until `stop_forwarding`, the unlock, the kill or the registration's end.
    /// The broker adds, in the node's network namespace, one nftables table of this
    /// migration's (`podmotion-fwd-<uid>`): connections to the source pod's own
    /// addresses (the broker reads them, never the client) are DNATed to the target's
    /// address of the same family and masqueraded; connections to each Service address
    /// and port in `services` (the Services whose endpoints list the source) are DNATed
    /// to the target's address and `target_port` ahead of kube-proxy's rules. Setting it
    /// again replaces it. Needs the installer's `--forward-new-connections`
    /// (`ForwardOff` otherwise) and the network locked and fenced (`NotLocked`).
    ForwardConnections {
        uid: MigrationUid,
        /// The target pod's addresses, at most one per family.
        targets: Vec<IpAddr>,
        /// At most [`MAX_FORWARDED_SERVICES`].
        #[serde(default)]
        services: Vec<ForwardedService>,
    },
    /// Source: ends `forward_connections` (done if there is none).
    StopForwarding {
        uid: MigrationUid,
    },
    /// Drop the registration (unbinds, unlocks).
    Forget {
        uid: MigrationUid,
    },
}

impl Request {
    pub fn uid(&self) -> &MigrationUid {
        match self {
            Request::Register { uid, .. }
            | Request::BindNetns { uid }
            | Request::UnbindNetns { uid }
            | Request::NetnsAddrs { uid }
            | Request::LockNetwork { uid, .. }
            | Request::UnlockNetwork { uid }
            | Request::ListSockets { uid }
            | Request::ReleaseTcpRepair { uid }
            | Request::MoveCgroup { uid, .. }
            | Request::ChargeRestore { uid, .. }
            | Request::AdoptAddress { uid, .. }
            | Request::ReleaseAddress { uid, .. }
            | Request::Resume { uid }
            | Request::Kill { uid }
            | Request::Fence { uid }
            | Request::Unfence { uid }
            | Request::ForwardConnections { uid, .. }
            | Request::StopForwarding { uid }
            | Request::Forget { uid } => uid,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Request::Register { .. } => "register",
            Request::BindNetns { .. } => "bind_netns",
            Request::UnbindNetns { .. } => "unbind_netns",
            Request::NetnsAddrs { .. } => "netns_addrs",
            Request::LockNetwork { .. } => "lock_network",
            Request::UnlockNetwork { .. } => "unlock_network",
            Request::ListSockets { .. } => "list_sockets",
            Request::ReleaseTcpRepair { .. } => "release_tcp_repair",
            Request::MoveCgroup { .. } => "move_cgroup",
            Request::ChargeRestore { .. } => "charge_restore",
            Request::AdoptAddress { .. } => "adopt_address",
            Request::ReleaseAddress { .. } => "release_address",
            Request::Resume { .. } => "resume",
            Request::Kill { .. } => "kill",
            Request::Fence { .. } => "fence",
            Request::Unfence { .. } => "unfence",
            Request::ForwardConnections { .. } => "forward_connections",
            Request::StopForwarding { .. } => "stop_forwarding",
            Request::Forget { .. } => "forget",
        }
    }
}

/// Services per `forward_connections`: more is refused (`Malformed`).
pub const MAX_FORWARDED_SERVICES: usize = 64;

/// One TCP port of a Service whose endpoints list the source: new connections to
/// `address`:`port` go to the target's address, port `target_port`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForwardedService {
    /// The Service's cluster IP.
    pub address: IpAddr,
    pub port: u16,
    /// The endpoint's port (the pod's).
    pub target_port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    Registered { cgroup: String },
    NetnsPath { path: String },
    Addrs { addrs: Vec<String> },
    Sockets { sockets: Vec<SocketAddrs> },
    Moved { pids: u32 },
    Done,
}

/// Typed broker errors; `kind` is a bounded set usable as a metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    FrameTooLarge,
    Truncated,
    Malformed,
    UnknownOp,
    InvalidUid,
    PeerNotAllowed,
    NotRegistered,
    AlreadyRegistered,
    WrongRole,
    NoSuchProcess,
    PidReused,
    ForeignProcess,
    Busy,
    /// A path the broker computes (the netns mount point or its directory) is a
    /// symlink or not what the broker made: refused, nothing followed.
    UnsafePath,
    /// The source holds more TCP sockets than one answer lists ([`MAX_SOCKETS`]).
    TooManySockets,
    /// `fence` of a source whose network is not locked (nothing frozen to fence).
    NotLocked,
    /// `resume` of a fenced source: only `unfence` (the operator's abort) lifts it.
    Fenced,
    /// `adopt_address` on a node whose installer did not enable the address hand-over
    /// (no `--address-handover-cidrs`).
    HandoverOff,
    /// `adopt_address` of an address outside the hand-over CIDRs, or one that is never
    /// a pod's (loopback, unspecified, multicast, link-local, IPv4 broadcast,
    /// IPv4-mapped), or one too many (eight per migration), or one another migration
    /// (or this one, for an earlier holder) still holds.
    AddressNotAllowed,
    /// `forward_connections` on a node whose installer did not enable it (no
    /// `--forward-new-connections`).
    ForwardOff,
    Kernel,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{kind:?}: {message}")]
#[serde(deny_unknown_fields)]
pub struct BrokerError {
    pub kind: ErrorKind,
    pub message: String,
}

impl BrokerError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Response {
    Ok(Reply),
    Err(BrokerError),
}

/// One TCP socket of a source, as `list_sockets` describes it: its local address, its
/// peer's (none for a listener, or where the kernel has none) and whether it listens.
/// An address the kernel could not give (or not an IP one) is `None`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SocketAddrs {
    pub local: Option<SocketAddr>,
    pub remote: Option<SocketAddr>,
    pub listening: bool,
}

/// Encodes a body as a frame.
pub fn encode_frame<T: Serialize>(body: &T) -> Vec<u8> {
    let json = serde_json::to_vec(body).expect("broker messages serialize");
    let mut out = Vec::with_capacity(4 + json.len());
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(&json);
    out
}

/// Checks a frame length prefix against `max` ([`MAX_FRAME`] for a request,
/// [`MAX_REPLY_FRAME`] for a response) before any body byte is read.
pub fn check_len(prefix: [u8; 4], max: usize) -> Result<usize, BrokerError> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > max {
        return Err(BrokerError::new(
            ErrorKind::FrameTooLarge,
            format!("frame of {len} bytes exceeds {max}"),
        ));
    }
    if len == 0 {
        return Err(BrokerError::new(ErrorKind::Truncated, "empty frame"));
    }
    Ok(len)
}

/// Every op the broker answers, by its wire name (`"op"`): the decoder refuses any
/// other, and the agent's metrics count each of them from zero.
pub const OPS: &[&str] = &[
    "register",
    "bind_netns",
    "unbind_netns",
    "netns_addrs",
    "lock_network",
    "unlock_network",
    "list_sockets",
    "release_tcp_repair",
    "move_cgroup",
    "charge_restore",
    "adopt_address",
    "release_address",
    "resume",
    "kill",
    "fence",
    "unfence",
    "forward_connections",
    "stop_forwarding",
    "forget",
];

/// Decodes and syntactically validates one request body (without the length prefix).
/// Semantic checks that need the kernel (pid liveness, start time, ownership) are the
/// broker's; everything decidable from the bytes alone is done here.
pub fn decode_request(body: &[u8]) -> Result<Request, BrokerError> {
    if body.len() > MAX_FRAME {
        return Err(BrokerError::new(ErrorKind::FrameTooLarge, "body too large"));
    }
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        let kind = if e.is_eof() {
            ErrorKind::Truncated
        } else {
            ErrorKind::Malformed
        };
        BrokerError::new(kind, e.to_string())
    })?;
    let op = value
        .get("op")
        .and_then(|o| o.as_str())
        .ok_or_else(|| BrokerError::new(ErrorKind::Malformed, "missing op"))?;
    if !OPS.contains(&op) {
        return Err(BrokerError::new(
            ErrorKind::UnknownOp,
            format!("unknown op {:?}", op.chars().take(32).collect::<String>()),
        ));
    }
    if let Some(uid) = value.get("uid") {
        let s = uid
            .as_str()
            .ok_or_else(|| BrokerError::new(ErrorKind::InvalidUid, "uid is not a string"))?;
        MigrationUid::parse(s)
            .map_err(|e| BrokerError::new(ErrorKind::InvalidUid, e.to_string()))?;
    }
    let req: Request = serde_json::from_value(value)
        .map_err(|e| BrokerError::new(ErrorKind::Malformed, e.to_string()))?;
    check_fields(req)
}

/// The checks of a decoded request's fields that need no kernel.
fn check_fields(req: Request) -> Result<Request, BrokerError> {
    match &req {
        Request::Register { process, .. } | Request::MoveCgroup { process, .. }
            if process.pid <= 1 =>
        {
            Err(BrokerError::new(
                ErrorKind::NoSuchProcess,
                format!("pid {} is never a migration process", process.pid),
            ))
        }
        Request::ForwardConnections {
            targets, services, ..
        } if targets.is_empty()
            || targets.len() > 2
            || (targets.len() == 2 && targets[0].is_ipv4() == targets[1].is_ipv4())
            || services.len() > MAX_FORWARDED_SERVICES
            || services.iter().any(|s| s.port == 0 || s.target_port == 0) =>
        {
            Err(BrokerError::new(
                ErrorKind::Malformed,
                "forward_connections: one target address per family (one or two), at most 64 services, no port 0",
            ))
        }
        Request::LockNetwork {
            hold: Some(services),
            ..
        } if services.len() > MAX_FORWARDED_SERVICES || services.iter().any(|s| s.port == 0) => {
            Err(BrokerError::new(
                ErrorKind::Malformed,
                "lock_network: at most 64 services, no port 0",
            ))
        }
        _ => Ok(req),
    }
}

/// Decodes a response body (client side).
pub fn decode_response(body: &[u8]) -> Result<Response, BrokerError> {
    serde_json::from_slice(body).map_err(|e| BrokerError::new(ErrorKind::Malformed, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uid() -> MigrationUid {
        MigrationUid::parse("m-1").unwrap()
    }

    #[test]
    fn every_request_round_trips() {
        let p = ProcRef {
            pid: 42,
            start_time: 7,
        };
        for r in [
            Request::Register {
                uid: uid(),
                role: BrokerRole::Source,
                process: p,
                container: ContainerId::parse("3d359f10a9c1").unwrap(),
            },
            Request::BindNetns { uid: uid() },
            Request::MoveCgroup {
                uid: uid(),
                process: p,
            },
            Request::ListSockets { uid: uid() },
            Request::Kill { uid: uid() },
            Request::Fence { uid: uid() },
            Request::Unfence { uid: uid() },
            Request::AdoptAddress {
                uid: uid(),
                address: "198.18.2.20".parse().unwrap(),
            },
            Request::ReleaseAddress {
                uid: uid(),
                address: "2001:db8::5".parse().unwrap(),
            },
            Request::ForwardConnections {
                uid: uid(),
                targets: vec![
                    "198.18.1.7".parse().unwrap(),
                    "2001:db8::7".parse().unwrap(),
                ],
                services: vec![ForwardedService {
                    address: "198.19.0.10".parse().unwrap(),
                    port: 80,
                    target_port: 8080,
                }],
            },
            Request::StopForwarding { uid: uid() },
        ] {
            let f = encode_frame(&r);
            let len = check_len(f[..4].try_into().unwrap(), MAX_FRAME).unwrap();
            assert_eq!(decode_request(&f[4..4 + len]).unwrap(), r);
        }
    }

    #[test]
    fn broker_rejects_hostile_bodies_with_typed_errors() {
        let cases: &[(&[u8], ErrorKind)] = &[
            (br#"{"op":"bind_netns","uid":"../../etc"}"#, ErrorKind::InvalidUid),
            (br#"{"op":"bind_netns","uid":"a;reboot"}"#, ErrorKind::InvalidUid),
            (br#"{"op":"bind_netns","uid":7}"#, ErrorKind::InvalidUid),
            (br#"{"op":"mount_anything","uid":"a"}"#, ErrorKind::UnknownOp),
            (br#"{"uid":"a"}"#, ErrorKind::Malformed),
            (br#"{"op":"bind_netns","uid":"a","path":"/etc"}"#, ErrorKind::Malformed),
            (br#"{"op":"bind_netns","uid":"a""#, ErrorKind::Truncated),
            (br#"{"op":"register","uid":"a","role":"source","process":{"pid":1,"start_time":1},"container":"c1"}"#, ErrorKind::NoSuchProcess),
            (br#"{"op":"register","uid":"a","role":"source","process":{"pid":-5,"start_time":1},"container":"c1"}"#, ErrorKind::NoSuchProcess),
            (br#"{"op":"register","uid":"a","role":"root","process":{"pid":9,"start_time":1},"container":"c1"}"#, ErrorKind::Malformed),
            // The container the operator named is required, and only a bare runtime ID:
            // nothing that spans or climbs cgroup path components.
            (br#"{"op":"register","uid":"a","role":"source","process":{"pid":9,"start_time":1}}"#, ErrorKind::Malformed),
            (br#"{"op":"register","uid":"a","role":"source","process":{"pid":9,"start_time":1},"container":"../x"}"#, ErrorKind::Malformed),
            (br#"{"op":"register","uid":"a","role":"source","process":{"pid":9,"start_time":1},"container":"a/b"}"#, ErrorKind::Malformed),
            (br#"{"op":"register","uid":"a","role":"source","process":{"pid":9,"start_time":1},"container":".."}"#, ErrorKind::Malformed),
            (br#"{"op":"register","uid":"a","role":"source","process":{"pid":9,"start_time":1},"container":""}"#, ErrorKind::Malformed),
            (br#"{"op":"register","uid":"a","role":"source","process":{"pid":9,"start_time":1},"container":7}"#, ErrorKind::Malformed),
            (b"\xff\xfe", ErrorKind::Malformed),
            // An address is an IP address and nothing else, and it is required.
            (br#"{"op":"adopt_address","uid":"a","address":"pod"}"#, ErrorKind::Malformed),
            (br#"{"op":"adopt_address","uid":"a","address":"198.18.2.20/32"}"#, ErrorKind::Malformed),
            (br#"{"op":"adopt_address","uid":"a","address":"198.18.2.20:80"}"#, ErrorKind::Malformed),
            (br#"{"op":"adopt_address","uid":"a","address":"fe80::1%eth0"}"#, ErrorKind::Malformed),
            (br#"{"op":"adopt_address","uid":"a","address":"198.018.2.20"}"#, ErrorKind::Malformed),
            (br#"{"op":"adopt_address","uid":"a","address":3323068948}"#, ErrorKind::Malformed),
            (br#"{"op":"adopt_address","uid":"a"}"#, ErrorKind::Malformed),
            (br#"{"op":"adopt_address","uid":"a","address":"198.18.2.20","link":"eth0"}"#, ErrorKind::Malformed),
            (br#"{"op":"release_address","uid":"a","address":null}"#, ErrorKind::Malformed),
            (br#"{"op":"release_address","uid":"../a","address":"198.18.2.20"}"#, ErrorKind::InvalidUid),
            // A forward names one target address per family, addresses only, and no
            // port 0; nothing else (no table, chain or rule text) is accepted.
            (br#"{"op":"forward_connections","uid":"a","targets":[]}"#, ErrorKind::Malformed),
            (br#"{"op":"forward_connections","uid":"a"}"#, ErrorKind::Malformed),
            (br#"{"op":"forward_connections","uid":"a","targets":["198.18.1.7","198.18.1.8"]}"#, ErrorKind::Malformed),
            (br#"{"op":"forward_connections","uid":"a","targets":["198.18.1.7","2001:db8::7","198.18.1.8"]}"#, ErrorKind::Malformed),
            (br#"{"op":"forward_connections","uid":"a","targets":["198.18.1.7; flush ruleset"]}"#, ErrorKind::Malformed),
            (br#"{"op":"forward_connections","uid":"a","targets":["198.18.1.7"],"services":[{"address":"198.19.0.10","port":0,"target_port":80}]}"#, ErrorKind::Malformed),
            (br#"{"op":"forward_connections","uid":"a","targets":["198.18.1.7"],"services":[{"address":"198.19.0.10","port":80,"target_port":0}]}"#, ErrorKind::Malformed),
            (br#"{"op":"forward_connections","uid":"a","targets":["198.18.1.7"],"services":[{"address":"198.19.0.10","port":80,"target_port":80,"protocol":"udp"}]}"#, ErrorKind::Malformed),
            (br#"{"op":"forward_connections","uid":"a","targets":["198.18.1.7"],"table":"nat"}"#, ErrorKind::Malformed),
            (br#"{"op":"stop_forwarding","uid":"../a"}"#, ErrorKind::InvalidUid),
            (br#"{"op":"lock_network","uid":"a","hold":[{"address":"198.19.0.10","port":0,"target_port":80}]}"#, ErrorKind::Malformed),
            (br#"{"op":"lock_network","uid":"a","hold":[{"address":"198.19.0.10; flush","port":80,"target_port":80}]}"#, ErrorKind::Malformed),
        ];
        for (body, kind) in cases {
            let err = decode_request(body).expect_err(&String::from_utf8_lossy(body));
            assert_eq!(err.kind, *kind, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn a_forward_of_more_services_than_allowed_is_refused_and_the_most_fits_a_frame() {
        let svc = |n: usize| ForwardedService {
            address: std::net::Ipv6Addr::new(
                0xfd00, 0xffff, 0xffff, 0xffff, 0xffff, 0xffff, 0xffff, n as u16,
            )
            .into(),
            port: u16::MAX,
            target_port: u16::MAX,
        };
        let req = |n: usize| Request::ForwardConnections {
            uid: MigrationUid::parse(&"a".repeat(63)).unwrap(),
            targets: vec![
                "198.18.1.7".parse().unwrap(),
                "2001:db8::7".parse().unwrap(),
            ],
            services: (0..n).map(svc).collect(),
        };
        let f = encode_frame(&req(MAX_FORWARDED_SERVICES));
        let len = check_len(f[..4].try_into().unwrap(), MAX_FRAME).expect("fits a frame");
        assert_eq!(
            decode_request(&f[4..4 + len]),
            Ok(req(MAX_FORWARDED_SERVICES))
        );
        let f = encode_frame(&req(MAX_FORWARDED_SERVICES + 1));
        assert_eq!(
            decode_request(&f[4..]).unwrap_err().kind,
            ErrorKind::Malformed
        );
        // The lock's hold takes the same list, with the same bound.
        let lock = |n: usize| Request::LockNetwork {
            uid: MigrationUid::parse(&"a".repeat(63)).unwrap(),
            hold: Some((0..n).map(svc).collect()),
        };
        let f = encode_frame(&lock(MAX_FORWARDED_SERVICES));
        assert_eq!(decode_request(&f[4..]), Ok(lock(MAX_FORWARDED_SERVICES)));
        let f = encode_frame(&lock(MAX_FORWARDED_SERVICES + 1));
        assert_eq!(
            decode_request(&f[4..]).unwrap_err().kind,
            ErrorKind::Malformed
        );
        // An agent of before the hold: no services.
        assert_eq!(
            decode_request(br#"{"op":"lock_network","uid":"a"}"#),
            Ok(Request::LockNetwork {
                uid: MigrationUid::parse("a").unwrap(),
                hold: None
            })
        );
    }

    #[test]
    fn oversize_and_empty_frames_are_rejected_from_the_prefix() {
        for max in [MAX_FRAME, MAX_REPLY_FRAME] {
            assert_eq!(
                check_len(((max + 1) as u32).to_be_bytes(), max)
                    .unwrap_err()
                    .kind,
                ErrorKind::FrameTooLarge
            );
            assert_eq!(check_len((max as u32).to_be_bytes(), max), Ok(max));
            assert_eq!(
                check_len(u32::MAX.to_be_bytes(), max).unwrap_err().kind,
                ErrorKind::FrameTooLarge
            );
            assert_eq!(
                check_len([0; 4], max).unwrap_err().kind,
                ErrorKind::Truncated
            );
        }
    }

    /// The longest address text there is: IPv6 without a zero group to shorten, the
    /// largest scope id and port.
    fn longest_addr(host: u16) -> SocketAddr {
        let ip =
            std::net::Ipv6Addr::new(0xffff, 0xffff, 0xffff, 0xffff, 0xffff, 0xffff, 0xffff, host);
        SocketAddr::V6(std::net::SocketAddrV6::new(ip, u16::MAX, 0, u32::MAX))
    }

    #[test]
    fn the_largest_socket_list_fits_one_reply_frame() {
        let worst = SocketAddrs {
            local: Some(longest_addr(0xfffe)),
            remote: Some(longest_addr(0xffff)),
            listening: false,
        };
        assert_eq!(
            worst.local.unwrap().to_string(),
            "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe%4294967295]:65535"
        );
        let reply = Response::Ok(Reply::Sockets {
            sockets: vec![worst; MAX_SOCKETS],
        });
        let f = encode_frame(&reply);
        let len = check_len(f[..4].try_into().unwrap(), MAX_REPLY_FRAME)
            .expect("the largest list fits the reply frame");
        assert_eq!(len, f.len() - 4);
        // Not a cap far above need either: a list twice as long would not fit.
        assert!(2 * len > MAX_REPLY_FRAME, "{len} bytes");
        assert_eq!(decode_response(&f[4..]).unwrap(), reply);
    }

    #[test]
    fn socket_addresses_round_trip_as_address_text() {
        let v4: SocketAddr = "198.18.0.5:8080".parse().unwrap();
        let scoped: SocketAddr = "[fe80::1%3]:80".parse().unwrap();
        let reply = Response::Ok(Reply::Sockets {
            sockets: vec![
                SocketAddrs {
                    local: Some(v4),
                    remote: None,
                    listening: true,
                },
                SocketAddrs {
                    local: Some(scoped),
                    remote: Some("[::1]:41000".parse().unwrap()),
                    listening: false,
                },
            ],
        });
        let body = &encode_frame(&reply)[4..];
        let text = std::str::from_utf8(body).unwrap();
        assert!(
            text.contains(r#""local":"198.18.0.5:8080","remote":null"#),
            "{text}"
        );
        assert!(text.contains(r#""local":"[fe80::1%3]:80""#), "{text}");
        assert_eq!(decode_response(body).unwrap(), reply);
        // Anything but an address (or null) is refused.
        let bad = br#"{"ok":{"reply":"sockets","sockets":[{"local":"/etc","remote":null,"listening":true}]}}"#;
        assert_eq!(decode_response(bad).unwrap_err().kind, ErrorKind::Malformed);
    }
}
