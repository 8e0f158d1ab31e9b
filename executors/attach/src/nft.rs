//! The redirect ruleset, programmed over a netfilter netlink socket that lives in
//! the target's network namespace.
//!
//! One named table (`inet <table>`) holds two NAT chains: `prerouting` redirects
//! connections arriving from outside the pod for each intercepted port to the
//! agent's forwarder port; `output` does the same for connections made from inside
//! the pod over loopback, except the agent's own sockets, which carry the agent GID
//! (`meta skgid != <gid>`) — that is how pass-through dials reach the application
//! instead of looping back into the agent.
//!
//! Lifecycle: every apply is one netlink batch that deletes the table if present and
//! recreates it whole, so the kernel commits it atomically and re-applying the same
//! config converges on the same ruleset. The table is created with the kernel's
//! owner flag (`NFT_TABLE_F_OWNER`, Linux ≥ 5.12): it belongs to the netlink socket
//! that created it, other sockets cannot modify it, and the kernel deletes it when
//! that socket is closed — which happens on every exit of the agent process,
//! SIGKILL and OOM kills included. An orderly exit also deletes it explicitly.
//!
//! The messages are encoded here by hand (the nf_tables uAPI is stable and the
//! handful of expressions needed is small), which keeps libnftnl/nft out of the
//! agent image.

use nix::sys::socket::{
    self, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, sockopt,
};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Mutex;
use std::time::Duration;

// netlink
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;
const NLA_F_NESTED: u16 = 0x8000;
// nfnetlink
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFPROTO_UNSPEC: u8 = 0;
const NFPROTO_INET: u8 = 1;
// nf_tables messages
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_GETTABLE: u16 = 1;
const NFT_MSG_DELTABLE: u16 = 2;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_NEWRULE: u16 = 6;
// attributes
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_FLAGS: u16 = 2;
const NFTA_TABLE_OWNER: u16 = 7;
const NFT_TABLE_F_OWNER: u32 = 0x2;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
// hooks / verdicts / registers
const NF_INET_PRE_ROUTING: u32 = 0;
const NF_INET_LOCAL_OUT: u32 = 3;
const NF_ACCEPT: u32 = 1;
const NAT_PRIO_DSTNAT: i32 = -100;
const NFT_REG_1: u32 = 1;
// meta keys
const NFT_META_OIF: u32 = 5;
const NFT_META_SKGID: u32 = 11;
const NFT_META_L4PROTO: u32 = 16;
const NFT_CMP_EQ: u32 = 0;
const NFT_CMP_NEQ: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 0x2;
const IPPROTO_TCP: u8 = 6;
/// The loopback device is always ifindex 1 in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

pub const DEFAULT_TABLE: &str = "podmotion_agent";

/// One intercepted application port and the agent forwarder port it is sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Redirect {
    pub port: u16,
    pub to: u16,
}

/// The whole desired state of the agent's table in the target namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ruleset {
    pub table: String,
    pub agent_gid: u32,
    pub redirects: Vec<Redirect>,
}

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("netlink socket: {0}")]
    Socket(#[source] nix::Error),
    #[error("nftables {op} rejected by the kernel: {err}")]
    Kernel { op: &'static str, err: nix::Error },
    #[error(
        "table inet {table} is owned by another live agent (netlink port {owner}); it is removed when that agent ends"
    )]
    HeldByOther { table: String, owner: u32 },
    #[error("malformed netlink reply")]
    Malformed,
}

impl NftError {
    pub fn category(&self) -> &'static str {
        match self {
            NftError::Socket(_) => "NetlinkSocket",
            NftError::Kernel { .. } => "NftablesRejected",
            NftError::HeldByOther { .. } => "TableHeldByOtherAgent",
            NftError::Malformed => "NetlinkMalformed",
        }
    }
}

/// Message encoder. Netlink headers are native-endian; nf_tables attribute values
/// are big-endian (the kernel reads them with ntohl/ntohs).
#[derive(Default)]
struct Batch {
    buf: Vec<u8>,
    seq: u32,
    acked: Vec<u32>,
}

impl Batch {
    fn new(first_seq: u32) -> Self {
        Batch {
            buf: Vec::new(),
            seq: first_seq,
            acked: Vec::new(),
        }
    }

    fn begin(&mut self, ty: u16, flags: u16, family: u8, res_id: u16) -> usize {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u32.to_ne_bytes()); // len, patched in end()
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&self.seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it in
        self.buf.push(family);
        self.buf.push(0); // NFNETLINK_V0
        self.buf.extend_from_slice(&res_id.to_be_bytes());
        if flags & NLM_F_ACK != 0 {
            self.acked.push(self.seq);
        }
        self.seq = self.seq.wrapping_add(1);
        start
    }

    fn end(&mut self, start: usize) {
        let len = (self.buf.len() - start) as u32;
        self.buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    fn nft_msg(&mut self, msg: u16, flags: u16) -> usize {
        self.begin(
            (NFNL_SUBSYS_NFTABLES << 8) | msg,
            NLM_F_REQUEST | NLM_F_ACK | flags,
            NFPROTO_INET,
            0,
        )
    }

    fn attr(&mut self, ty: u16, data: &[u8]) {
        let len = 4 + data.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn attr_str(&mut self, ty: u16, s: &str) {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.attr(ty, &v);
    }

    fn attr_be32(&mut self, ty: u16, v: u32) {
        self.attr(ty, &v.to_be_bytes());
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    fn nest(&mut self, ty: u16) -> usize {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        start
    }

    fn nest_end(&mut self, start: usize) {
        let len = (self.buf.len() - start) as u16;
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    }

    fn expr(&mut self, name: &str, body: impl FnOnce(&mut Self)) {
        let elem = self.nest(NFTA_LIST_ELEM);
        self.attr_str(NFTA_EXPR_NAME, name);
        let data = self.nest(NFTA_EXPR_DATA);
        body(self);
        self.nest_end(data);
        self.nest_end(elem);
    }

    fn data_value(&mut self, ty: u16, value: &[u8]) {
        let n = self.nest(ty);
        self.attr(NFTA_DATA_VALUE, value);
        self.nest_end(n);
    }

    fn meta_load(&mut self, key: u32) {
        self.expr("meta", |b| {
            b.attr_be32(1, NFT_REG_1); // NFTA_META_DREG
            b.attr_be32(2, key); // NFTA_META_KEY
        });
    }

    fn cmp(&mut self, op: u32, value: &[u8]) {
        self.expr("cmp", |b| {
            b.attr_be32(1, NFT_REG_1); // NFTA_CMP_SREG
            b.attr_be32(2, op); // NFTA_CMP_OP
            b.data_value(3, value); // NFTA_CMP_DATA
        });
    }

    fn tcp_dport_is(&mut self, port: u16) {
        self.meta_load(NFT_META_L4PROTO);
        self.cmp(NFT_CMP_EQ, &[IPPROTO_TCP]);
        self.expr("payload", |b| {
            b.attr_be32(1, NFT_REG_1); // NFTA_PAYLOAD_DREG
            b.attr_be32(2, NFT_PAYLOAD_TRANSPORT_HEADER); // NFTA_PAYLOAD_BASE
            b.attr_be32(3, 2); // NFTA_PAYLOAD_OFFSET: tcp dport
            b.attr_be32(4, 2); // NFTA_PAYLOAD_LEN
        });
        self.cmp(NFT_CMP_EQ, &port.to_be_bytes());
    }

    fn redirect_to(&mut self, port: u16) {
        self.expr("immediate", |b| {
            b.attr_be32(1, NFT_REG_1); // NFTA_IMMEDIATE_DREG
            b.data_value(2, &port.to_be_bytes()); // NFTA_IMMEDIATE_DATA
        });
        self.expr("redir", |b| {
            b.attr_be32(1, NFT_REG_1); // NFTA_REDIR_REG_PROTO_MIN
            b.attr_be32(3, NF_NAT_RANGE_PROTO_SPECIFIED); // NFTA_REDIR_FLAGS
        });
    }

    fn batch_begin(&mut self) {
        let s = self.begin(
            NFNL_MSG_BATCH_BEGIN,
            NLM_F_REQUEST,
            NFPROTO_UNSPEC,
            NFNL_SUBSYS_NFTABLES,
        );
        self.end(s);
    }

    fn batch_end(&mut self) {
        let s = self.begin(
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            NFPROTO_UNSPEC,
            NFNL_SUBSYS_NFTABLES,
        );
        self.end(s);
    }

    fn del_table(&mut self, table: &str) {
        let m = self.nft_msg(NFT_MSG_DELTABLE, 0);
        self.attr_str(NFTA_TABLE_NAME, table);
        self.end(m);
    }

    fn add_chain(&mut self, table: &str, name: &str, hook: u32) {
        let m = self.nft_msg(NFT_MSG_NEWCHAIN, NLM_F_CREATE);
        self.attr_str(NFTA_CHAIN_TABLE, table);
        self.attr_str(NFTA_CHAIN_NAME, name);
        let h = self.nest(NFTA_CHAIN_HOOK);
        self.attr_be32(NFTA_HOOK_HOOKNUM, hook);
        self.attr_be32(NFTA_HOOK_PRIORITY, NAT_PRIO_DSTNAT as u32);
        self.nest_end(h);
        self.attr_be32(NFTA_CHAIN_POLICY, NF_ACCEPT);
        self.attr_str(NFTA_CHAIN_TYPE, "nat");
        self.end(m);
    }

    fn add_rule(&mut self, table: &str, chain: &str, exprs: impl FnOnce(&mut Self)) {
        let m = self.nft_msg(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND);
        self.attr_str(NFTA_RULE_TABLE, table);
        self.attr_str(NFTA_RULE_CHAIN, chain);
        let e = self.nest(NFTA_RULE_EXPRESSIONS);
        exprs(self);
        self.nest_end(e);
        self.end(m);
    }
}

impl Ruleset {
    /// The full-replace batch: [delete table if `exists`], create it owned by the
    /// sending socket, both chains, one rule per redirect and chain.
    fn replace_batch(&self, first_seq: u32, exists: bool) -> Batch {
        let t = self.table.as_str();
        let mut b = Batch::new(first_seq);
        b.batch_begin();
        if exists {
            b.del_table(t);
        }
        let m = b.nft_msg(NFT_MSG_NEWTABLE, NLM_F_CREATE);
        b.attr_str(NFTA_TABLE_NAME, t);
        b.attr_be32(NFTA_TABLE_FLAGS, NFT_TABLE_F_OWNER);
        b.end(m);
        b.add_chain(t, "prerouting", NF_INET_PRE_ROUTING);
        b.add_chain(t, "output", NF_INET_LOCAL_OUT);
        for r in &self.redirects {
            b.add_rule(t, "prerouting", |b| {
                b.tcp_dport_is(r.port);
                b.redirect_to(r.to);
            });
            let gid = self.agent_gid;
            b.add_rule(t, "output", |b| {
                b.meta_load(NFT_META_OIF);
                b.cmp(NFT_CMP_EQ, &LOOPBACK_IFINDEX.to_ne_bytes());
                b.tcp_dport_is(r.port);
                b.meta_load(NFT_META_SKGID);
                b.cmp(NFT_CMP_NEQ, &gid.to_ne_bytes());
                b.redirect_to(r.to);
            });
        }
        b.batch_end();
        b
    }

    /// What `nft list table inet <table>` prints for this ruleset (nft ≥ 1.0);
    /// tests compare the live kernel state against it.
    pub fn expected_listing(&self) -> String {
        let mut pre = String::new();
        let mut out = String::new();
        for r in &self.redirects {
            pre.push_str(&format!("\t\ttcp dport {} redirect to :{}\n", r.port, r.to));
            out.push_str(&format!(
                "\t\toif \"lo\" tcp dport {} meta skgid != {} redirect to :{}\n",
                r.port, self.agent_gid, r.to
            ));
        }
        format!(
            "table inet {t} {{\n\tflags owner\n\n\tchain prerouting {{\n\t\ttype nat hook prerouting priority dstnat; policy accept;\n{pre}\t}}\n\n\tchain output {{\n\t\ttype nat hook output priority -100; policy accept;\n{out}\t}}\n}}\n",
            t = self.table
        )
    }
}

/// The agent's netfilter netlink socket. Create it inside the target namespace
/// (see [`crate::netns::NetnsExecutor`]); it stays bound to that namespace. Closing
/// it (dropping this, or the process dying) makes the kernel drop the owned table.
pub struct NftSession {
    inner: Mutex<SessionInner>,
}

struct SessionInner {
    fd: OwnedFd,
    seq: u32,
}

/// What the kernel reports about an existing table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableInfo {
    pub owner: Option<u32>,
}

impl NftSession {
    /// Opens the socket in the calling thread's network namespace.
    pub fn open_here() -> Result<Self, NftError> {
        let fd = socket::socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkNetFilter,
        )
        .map_err(NftError::Socket)?;
        socket::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).map_err(NftError::Socket)?;
        socket::setsockopt(
            &fd,
            sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(5, 0),
        )
        .map_err(NftError::Socket)?;
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_secs() as u32;
        Ok(NftSession {
            inner: Mutex::new(SessionInner { fd, seq: seed }),
        })
    }

    /// Our own netlink port id (the owner id the kernel records on our table).
    pub fn port_id(&self) -> Result<u32, NftError> {
        let inner = self.inner.lock().expect("nft session lock");
        let addr: NetlinkAddr =
            socket::getsockname(inner.fd.as_raw_fd()).map_err(NftError::Socket)?;
        Ok(addr.pid())
    }

    /// Looks the table up; `None` when absent.
    pub fn get_table(&self, table: &str) -> Result<Option<TableInfo>, NftError> {
        let mut inner = self.inner.lock().expect("nft session lock");
        let mut b = Batch::new(inner.seq);
        let m = b.nft_msg(NFT_MSG_GETTABLE, 0);
        b.attr_str(NFTA_TABLE_NAME, table);
        b.end(m);
        inner.seq = b.seq;
        let seq = b.acked[0];
        drain(&inner.fd);
        send(&inner.fd, &b.buf)?;
        let mut info = None;
        loop {
            let buf = recv(&inner.fd)?;
            for msg in parse(&buf)? {
                if msg.seq != seq {
                    continue;
                }
                match msg.ty {
                    NLMSG_ERROR => {
                        return match msg.error {
                            0 => Ok(info),
                            e if e == -(nix::errno::Errno::ENOENT as i32) => Ok(None),
                            e => Err(NftError::Kernel {
                                op: "get table",
                                err: nix::errno::Errno::from_raw(-e),
                            }),
                        };
                    }
                    NLMSG_DONE => return Ok(info),
                    t if t == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE => {
                        let owner = attrs(&msg.payload[4.min(msg.payload.len())..])
                            .find(|(ty, _)| *ty == NFTA_TABLE_OWNER)
                            .and_then(|(_, v)| v.get(..4))
                            .map(|v| u32::from_be_bytes([v[0], v[1], v[2], v[3]]));
                        info = Some(TableInfo { owner });
                    }
                    _ => {}
                }
            }
        }
    }

    /// Idempotent full replace. Fails with [`NftError::HeldByOther`] while another
    /// live agent owns the table.
    pub fn apply(&self, rules: &Ruleset) -> Result<(), NftError> {
        let me = self.port_id()?;
        let existing = self.get_table(&rules.table)?;
        if let Some(TableInfo { owner: Some(o) }) = existing
            && o != me
        {
            return Err(NftError::HeldByOther {
                table: rules.table.clone(),
                owner: o,
            });
        }
        let mut inner = self.inner.lock().expect("nft session lock");
        let b = rules.replace_batch(inner.seq, existing.is_some());
        inner.seq = b.seq;
        commit(&inner.fd, &b, "replace table").map_err(|e| match e {
            NftError::Kernel {
                err: nix::errno::Errno::EPERM,
                ..
            } => NftError::HeldByOther {
                table: rules.table.clone(),
                owner: 0,
            },
            e => e,
        })
    }

    /// Atomic delete of our table. Absent is fine, and so is a table owned by
    /// another live socket: that one is not ours to remove (the kernel would refuse
    /// anyway).
    pub fn delete(&self, table: &str) -> Result<(), NftError> {
        let me = self.port_id()?;
        match self.get_table(table)? {
            None => return Ok(()),
            Some(TableInfo { owner: Some(o) }) if o != me => return Ok(()),
            Some(_) => {}
        }
        let mut inner = self.inner.lock().expect("nft session lock");
        let mut b = Batch::new(inner.seq);
        b.batch_begin();
        b.del_table(table);
        b.batch_end();
        inner.seq = b.seq;
        match commit(&inner.fd, &b, "delete table") {
            Err(NftError::Kernel {
                err: nix::errno::Errno::ENOENT,
                ..
            }) => Ok(()),
            r => r,
        }
    }
}

fn send(fd: &OwnedFd, buf: &[u8]) -> Result<(), NftError> {
    socket::sendto(
        fd.as_raw_fd(),
        buf,
        &NetlinkAddr::new(0, 0),
        MsgFlags::empty(),
    )
    .map_err(NftError::Socket)?;
    Ok(())
}

fn recv(fd: &OwnedFd) -> Result<Vec<u8>, NftError> {
    let mut buf = vec![0u8; 65536];
    let n = socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(NftError::Socket)?;
    buf.truncate(n);
    Ok(buf)
}

/// Discards replies left over from an earlier, failed exchange.
fn drain(fd: &OwnedFd) {
    let mut buf = vec![0u8; 65536];
    while socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT).is_ok() {}
}

/// Sends a batch and waits for an ack of every message that asked for one; the
/// first error wins (the kernel then aborts the whole batch).
fn commit(fd: &OwnedFd, b: &Batch, op: &'static str) -> Result<(), NftError> {
    drain(fd);
    send(fd, &b.buf)?;
    let mut pending: Vec<u32> = b.acked.clone();
    while !pending.is_empty() {
        let buf = recv(fd)?;
        for msg in parse(&buf)? {
            if msg.ty != NLMSG_ERROR || !pending.contains(&msg.seq) {
                continue;
            }
            if msg.error != 0 {
                return Err(NftError::Kernel {
                    op,
                    err: nix::errno::Errno::from_raw(-msg.error),
                });
            }
            pending.retain(|s| *s != msg.seq);
        }
    }
    Ok(())
}

struct Reply<'a> {
    ty: u16,
    seq: u32,
    /// For NLMSG_ERROR: the (negative) errno, 0 for an ack.
    error: i32,
    payload: &'a [u8],
}

fn parse(buf: &[u8]) -> Result<Vec<Reply<'_>>, NftError> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + 16 <= buf.len() {
        let len = u32::from_ne_bytes(
            buf[off..off + 4]
                .try_into()
                .map_err(|_| NftError::Malformed)?,
        ) as usize;
        if len < 16 || off + len > buf.len() {
            return Err(NftError::Malformed);
        }
        let ty = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
        let mut seq = u32::from_ne_bytes(
            buf[off + 8..off + 12]
                .try_into()
                .map_err(|_| NftError::Malformed)?,
        );
        let payload = &buf[off + 16..off + len];
        let mut error = 0;
        if ty == NLMSG_ERROR {
            if payload.len() < 4 + 16 {
                return Err(NftError::Malformed);
            }
            error = i32::from_ne_bytes(payload[0..4].try_into().map_err(|_| NftError::Malformed)?);
            // The echoed request header carries the sequence number it answers.
            seq = u32::from_ne_bytes(
                payload[12..16]
                    .try_into()
                    .map_err(|_| NftError::Malformed)?,
            );
        }
        out.push(Reply {
            ty,
            seq,
            error,
            payload,
        });
        off += (len + 3) & !3;
    }
    Ok(out)
}

fn attrs(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let ty = u16::from_ne_bytes([buf[2], buf[3]]) & !NLA_F_NESTED;
        if len < 4 || len > buf.len() {
            return None;
        }
        let val = &buf[4..len];
        buf = &buf[((len + 3) & !3).min(buf.len())..];
        Some((ty, val))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Ruleset {
        Ruleset {
            table: "t".into(),
            agent_gid: 7777,
            redirects: vec![Redirect {
                port: 8080,
                to: 15001,
            }],
        }
    }

    #[test]
    fn replace_batch_is_framed_and_acks_every_nftables_message() {
        let b = rules().replace_batch(100, true);
        // begin, del table, new table, 2 chains, 2 rules, end
        let msgs = parse(&b.buf).unwrap();
        assert_eq!(msgs.len(), 8);
        assert_eq!(msgs[0].ty, NFNL_MSG_BATCH_BEGIN);
        assert_eq!(msgs[7].ty, NFNL_MSG_BATCH_END);
        assert_eq!(msgs[1].ty, (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELTABLE);
        assert_eq!(b.acked, (101..107).collect::<Vec<_>>());
        assert_eq!(b.buf.len() % 4, 0);
    }

    #[test]
    fn fresh_table_batch_has_no_delete() {
        let b = rules().replace_batch(1, false);
        let msgs = parse(&b.buf).unwrap();
        assert!(
            msgs.iter()
                .all(|m| m.ty != (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELTABLE)
        );
    }

    #[test]
    fn port_match_and_redirect_target_are_big_endian() {
        let b = rules().replace_batch(1, false);
        let hay = &b.buf;
        let needle = 8080u16.to_be_bytes();
        assert!(hay.windows(2).any(|w| w == needle));
        assert!(hay.windows(2).any(|w| w == 15001u16.to_be_bytes()));
    }

    #[test]
    fn expected_listing_names_gid_and_ports() {
        let l = rules().expected_listing();
        assert!(l.contains("tcp dport 8080 redirect to :15001"));
        assert!(l.contains("meta skgid != 7777"));
    }
}
