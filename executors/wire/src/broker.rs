//! The netns broker's protocol: one request frame, one response frame, over a
//! root-owned Unix stream socket (mode 0600, peer uid checked with SO_PEERCRED).
//!
//! Frame = 4-byte big-endian length + JSON body, the body at most [`MAX_FRAME`] bytes.
//! A request is one of a fixed set of ops ([`Request`]); unknown ops, unknown fields,
//! malformed UIDs and oversize or truncated frames are rejected by [`decode_request`]
//! before anything is looked at. Errors are typed ([`ErrorKind`]).
//!
//! [`Reply::Sockets`] is followed by `chunks` messages carrying descriptors with
//! SCM_RIGHTS, each with a [`FdChunk`] header: ordered (`seq` 0..chunks), at most
//! [`MAX_FDS_PER_CHUNK`] descriptors each, so a large set is never truncated by the
//! kernel's per-message limit and a lost or reordered chunk is detected.

use crate::ids::{MigrationUid, ProcRef};
use serde::{Deserialize, Serialize};

/// Largest request or response body.
pub const MAX_FRAME: usize = 16 * 1024;
/// Descriptors per SCM_RIGHTS message (the kernel allows 253; we stay well below).
pub const MAX_FDS_PER_CHUNK: usize = 16;
/// Descriptors per hand-off: a source with more TCP sockets is refused with
/// [`ErrorKind::TooManySockets`], never handed a silently truncated set.
pub const MAX_FDS: usize = 1024;

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
    /// holder. Later ops act only on what was pinned here.
    Register {
        uid: MigrationUid,
        role: BrokerRole,
        process: ProcRef,
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
    },
    UnlockNetwork {
        uid: MigrationUid,
    },
    /// Source: duplicate the workload's TCP sockets to the caller (SCM_RIGHTS chunks).
    HandOffSockets {
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
            | Request::LockNetwork { uid }
            | Request::UnlockNetwork { uid }
            | Request::HandOffSockets { uid }
            | Request::ReleaseTcpRepair { uid }
            | Request::MoveCgroup { uid, .. }
            | Request::Resume { uid }
            | Request::Kill { uid }
            | Request::Fence { uid }
            | Request::Unfence { uid }
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
            Request::HandOffSockets { .. } => "hand_off_sockets",
            Request::ReleaseTcpRepair { .. } => "release_tcp_repair",
            Request::MoveCgroup { .. } => "move_cgroup",
            Request::Resume { .. } => "resume",
            Request::Kill { .. } => "kill",
            Request::Fence { .. } => "fence",
            Request::Unfence { .. } => "unfence",
            Request::Forget { .. } => "forget",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    Registered { cgroup: String },
    NetnsPath { path: String },
    Addrs { addrs: Vec<String> },
    Sockets { total: u32, chunks: u32 },
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
    /// The source holds more TCP sockets than one hand-off carries ([`MAX_FDS`]).
    TooManySockets,
    /// `fence` of a source whose network is not locked (nothing frozen to fence).
    NotLocked,
    /// `resume` of a fenced source: only `unfence` (the operator's abort) lifts it.
    Fenced,
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

/// Header of one SCM_RIGHTS message of a hand-off (12 bytes, big-endian).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdChunk {
    pub seq: u32,
    pub chunks: u32,
    pub count: u32,
}

impl FdChunk {
    pub const LEN: usize = 12;
    pub fn encode(&self) -> [u8; 12] {
        let mut b = [0u8; 12];
        b[0..4].copy_from_slice(&self.seq.to_be_bytes());
        b[4..8].copy_from_slice(&self.chunks.to_be_bytes());
        b[8..12].copy_from_slice(&self.count.to_be_bytes());
        b
    }
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != Self::LEN {
            return None;
        }
        let n = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Some(Self {
            seq: n(0),
            chunks: n(4),
            count: n(8),
        })
    }
}

/// Encodes a body as a frame.
pub fn encode_frame<T: Serialize>(body: &T) -> Vec<u8> {
    let json = serde_json::to_vec(body).expect("broker messages serialize");
    let mut out = Vec::with_capacity(4 + json.len());
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(&json);
    out
}

/// Checks a frame length prefix before any body byte is read.
pub fn check_len(prefix: [u8; 4]) -> Result<usize, BrokerError> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > MAX_FRAME {
        return Err(BrokerError::new(
            ErrorKind::FrameTooLarge,
            format!("frame of {len} bytes exceeds {MAX_FRAME}"),
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
    "hand_off_sockets",
    "release_tcp_repair",
    "move_cgroup",
    "resume",
    "kill",
    "fence",
    "unfence",
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
    match &req {
        Request::Register { process, .. } | Request::MoveCgroup { process, .. }
            if process.pid <= 1 =>
        {
            Err(BrokerError::new(
                ErrorKind::NoSuchProcess,
                format!("pid {} is never a migration process", process.pid),
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
            },
            Request::BindNetns { uid: uid() },
            Request::MoveCgroup {
                uid: uid(),
                process: p,
            },
            Request::HandOffSockets { uid: uid() },
            Request::Kill { uid: uid() },
            Request::Fence { uid: uid() },
            Request::Unfence { uid: uid() },
        ] {
            let f = encode_frame(&r);
            let len = check_len(f[..4].try_into().unwrap()).unwrap();
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
            (br#"{"op":"register","uid":"a","role":"source","process":{"pid":1,"start_time":1}}"#, ErrorKind::NoSuchProcess),
            (br#"{"op":"register","uid":"a","role":"source","process":{"pid":-5,"start_time":1}}"#, ErrorKind::NoSuchProcess),
            (br#"{"op":"register","uid":"a","role":"root","process":{"pid":9,"start_time":1}}"#, ErrorKind::Malformed),
            (b"\xff\xfe", ErrorKind::Malformed),
        ];
        for (body, kind) in cases {
            let err = decode_request(body).expect_err(&String::from_utf8_lossy(body));
            assert_eq!(err.kind, *kind, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn oversize_and_empty_frames_are_rejected_from_the_prefix() {
        assert_eq!(
            check_len(((MAX_FRAME + 1) as u32).to_be_bytes())
                .unwrap_err()
                .kind,
            ErrorKind::FrameTooLarge
        );
        assert_eq!(
            check_len(u32::MAX.to_be_bytes()).unwrap_err().kind,
            ErrorKind::FrameTooLarge
        );
        assert_eq!(check_len([0; 4]).unwrap_err().kind, ErrorKind::Truncated);
    }

    #[test]
    fn fd_chunk_header_round_trips() {
        let c = FdChunk {
            seq: 2,
            chunks: 5,
            count: 16,
        };
        assert_eq!(FdChunk::decode(&c.encode()), Some(c));
        assert_eq!(FdChunk::decode(&[0; 11]), None);
    }
}
