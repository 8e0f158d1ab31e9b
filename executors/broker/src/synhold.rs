//! Holding a locked source's new connections in the kernel (issue 39, "what a client
//! sees"): a queue of netfilter's (NFQUEUE) that the broker binds and never answers
//! until the source's connections have a place to go.
//!
//! Without it a SYN sent to the locked source is dropped at its links, and the client
//! retransmits it a second later (Linux's initial RTO): the client's gap is the
//! downtime rounded up to that second. With it, a rule of the node's (raw table, before
//! conntrack: the connection is not yet bound to any address) sends the SYNs to the
//! source's staying addresses to queue `num`; the broker reads them (their metadata
//! only: `NFQNL_COPY_META`) and holds their ids. At the forward (the DNAT to the target
//! installed first) or at the unlock it removes the rule, then accepts every held SYN:
//! each continues from the hook after the rule, meets conntrack and the node's NAT
//! rules as they are then, and reaches the target (or the source again after a
//! rollback) at once.
//!
//! The kernel fact this rests on, proven on this machine's kernel by
//! `tests/synhold.rs`: a SYN queued in raw PREROUTING and accepted after a nat chain was
//! added meets that chain (the connection answers from the target within the hold).
//!
//! Failure modes, all of them the behaviour without the hold: the queue is full
//! (`NFQA_CFG_F_FAIL_OPEN`: the SYN goes on to the locked link), nobody is bound (the
//! rule's `--queue-bypass`), the socket closes (the kernel drops what it held; the
//! clients retransmit).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, send,
    setsockopt, socket, sockopt,
};

const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_VERDICT: u16 = 1;
const NFQNL_MSG_CONFIG: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLMSG_ERROR: u16 = 2;

const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQA_CFG_MASK: u16 = 4;
const NFQA_CFG_FLAGS: u16 = 5;
const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_COPY_META: u8 = 1;
const NFQA_CFG_F_FAIL_OPEN: u32 = 1;
const NF_ACCEPT: u32 = 1;

const NLMSG_HDRLEN: usize = 16;
const NFGEN_HDRLEN: usize = 4;

/// One netfilter attribute, padded to 4 bytes.
fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
    let len = 4 + payload.len();
    let mut out = Vec::with_capacity(len.next_multiple_of(4));
    out.extend_from_slice(&u16::try_from(len).expect("a small attribute").to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    out.resize(len.next_multiple_of(4), 0);
    out
}

/// A queue message (`kind`: config or verdict) for queue `num`.
fn message(kind: u16, flags: u16, num: u16, attrs: &[Vec<u8>]) -> Vec<u8> {
    let body: Vec<u8> = attrs.concat();
    let len = NLMSG_HDRLEN + NFGEN_HDRLEN + body.len();
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&u32::try_from(len).expect("a small message").to_ne_bytes());
    out.extend_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | kind).to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes()); // sequence
    out.extend_from_slice(&0u32.to_ne_bytes()); // port: the kernel
    out.push(libc::AF_UNSPEC as u8);
    out.push(0); // NFNETLINK_V0
    out.extend_from_slice(&num.to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// The configuration messages that bind queue `num` to this socket, copying the
/// packets' metadata only, failing open when the queue is full.
fn bind_messages(num: u16) -> [Vec<u8>; 2] {
    // pf is ignored by kernels since 3.8; AF_INET for older ones.
    let mut cmd = vec![NFQNL_CFG_CMD_BIND, 0];
    cmd.extend_from_slice(&(libc::AF_INET as u16).to_be_bytes());
    let mut params = 0u32.to_be_bytes().to_vec(); // copy range: none
    params.push(NFQNL_COPY_META);
    let flags = NFQA_CFG_F_FAIL_OPEN.to_be_bytes();
    let ack = NLM_F_REQUEST | NLM_F_ACK;
    [
        message(NFQNL_MSG_CONFIG, ack, num, &[attr(NFQA_CFG_CMD, &cmd)]),
        message(
            NFQNL_MSG_CONFIG,
            ack,
            num,
            &[
                attr(NFQA_CFG_PARAMS, &params),
                attr(NFQA_CFG_FLAGS, &flags),
                attr(NFQA_CFG_MASK, &flags),
            ],
        ),
    ]
}

/// The verdict that lets packet `id` of queue `num` go on.
fn accept_message(num: u16, id: u32) -> Vec<u8> {
    let mut v = NF_ACCEPT.to_be_bytes().to_vec();
    v.extend_from_slice(&id.to_be_bytes());
    message(
        NFQNL_MSG_VERDICT,
        NLM_F_REQUEST,
        num,
        &[attr(NFQA_VERDICT_HDR, &v)],
    )
}

/// What one datagram from the kernel says, message by message.
#[derive(Debug, PartialEq, Eq)]
enum Incoming {
    /// A queued packet's id.
    Packet(u32),
    /// An acknowledgement (0) or an error (a negative errno).
    Ack(i32),
    Other,
}

fn parse(mut buf: &[u8]) -> Vec<Incoming> {
    let mut out = Vec::new();
    while buf.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes(buf[0..4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes(buf[4..6].try_into().expect("2 bytes"));
        if len < NLMSG_HDRLEN || len > buf.len() {
            break;
        }
        let payload = &buf[NLMSG_HDRLEN..len];
        out.push(if kind == NLMSG_ERROR && payload.len() >= 4 {
            Incoming::Ack(i32::from_ne_bytes(
                payload[0..4].try_into().expect("4 bytes"),
            ))
        } else if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET
            && payload.len() >= NFGEN_HDRLEN
        {
            packet_id(&payload[NFGEN_HDRLEN..]).map_or(Incoming::Other, Incoming::Packet)
        } else {
            Incoming::Other
        });
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
    }
    out
}

/// The id in a packet message's `NFQA_PACKET_HDR` (id, hw protocol, hook).
fn packet_id(mut attrs: &[u8]) -> Option<u32> {
    while attrs.len() >= 4 {
        let len = u16::from_ne_bytes(attrs[0..2].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(attrs[2..4].try_into().ok()?) & 0x7fff;
        if len < 4 || len > attrs.len() {
            return None;
        }
        if kind == NFQA_PACKET_HDR && len >= 8 {
            return Some(u32::from_be_bytes(attrs[4..8].try_into().ok()?));
        }
        attrs = &attrs[len.next_multiple_of(4).min(attrs.len())..];
    }
    None
}

/// A bound queue and the packets it holds.
#[derive(Debug)]
pub struct Queue {
    sock: OwnedFd,
    num: u16,
    held: Vec<u32>,
}

impl Queue {
    /// Binds queue `num` (`EBUSY`: another process has it).
    pub fn bind(num: u16) -> io::Result<Queue> {
        let sock = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkNetFilter,
        )?;
        bind(sock.as_raw_fd(), &NetlinkAddr::new(0, 0))?;
        // The kernel's answers to a burst of SYNs must not be lost to a small buffer.
        setsockopt(&sock, sockopt::RcvBuf, &(1 << 20))?;
        let q = Queue {
            sock,
            num,
            held: Vec::new(),
        };
        for m in bind_messages(num) {
            send(q.sock.as_raw_fd(), &m, MsgFlags::empty())?;
            q.acked()?;
        }
        Ok(q)
    }

    pub fn num(&self) -> u16 {
        self.num
    }

    /// How many packets it holds.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    fn acked(&self) -> io::Result<()> {
        setsockopt(
            &self.sock,
            sockopt::ReceiveTimeout,
            &timeval(Duration::from_secs(2)),
        )?;
        let mut buf = vec![0u8; 8192];
        loop {
            let n = recv(self.sock.as_raw_fd(), &mut buf, MsgFlags::empty())?;
            for m in parse(&buf[..n]) {
                match m {
                    Incoming::Ack(0) => return Ok(()),
                    Incoming::Ack(e) => return Err(io::Error::from_raw_os_error(-e)),
                    _ => {}
                }
            }
        }
    }

    /// Takes what the kernel queued within `wait` (at least one read), holding it.
    pub fn take(&mut self, wait: Duration) -> io::Result<usize> {
        let until = Instant::now() + wait;
        let mut buf = vec![0u8; 65536];
        let mut taken = 0;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            let t = timeval(left.max(Duration::from_millis(1)));
            setsockopt(&self.sock, sockopt::ReceiveTimeout, &t)?;
            match recv(self.sock.as_raw_fd(), &mut buf, MsgFlags::empty()) {
                Ok(n) => {
                    for m in parse(&buf[..n]) {
                        if let Incoming::Packet(id) = m {
                            self.held.push(id);
                            taken += 1;
                        }
                    }
                }
                Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
            if Instant::now() >= until {
                return Ok(taken);
            }
        }
    }

    /// Lets every held packet go on, in the order they came. Returns how many.
    pub fn release(&mut self) -> io::Result<usize> {
        let ids = std::mem::take(&mut self.held);
        for (i, id) in ids.iter().enumerate() {
            if let Err(e) = send(
                self.sock.as_raw_fd(),
                &accept_message(self.num, *id),
                MsgFlags::empty(),
            ) {
                self.held = ids[i..].to_vec();
                return Err(e.into());
            }
        }
        Ok(ids.len())
    }
}

/// What a hold sends to its queue: new TCP connections (SYN without ACK) to these
/// addresses, and to these Service addresses and ports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    pub addresses: Vec<std::net::IpAddr>,
    pub services: Vec<(std::net::IpAddr, u16)>,
}

/// The raw table's chain of migration `uid`'s hold (iptables' names are at most 28
/// characters; a migration UID's first 20 tell migrations apart on one node).
pub fn chain_name(uid: &podmotion_wire::ids::MigrationUid) -> String {
    let u: String = uid.as_str().chars().take(20).collect();
    format!("pm-hold-{u}")
}

/// The arguments of an iptables command on the raw table: `rest` after `-w -t raw`.
fn raw(rest: &[&str]) -> Vec<String> {
    ["-w", "-t", "raw"]
        .iter()
        .chain(rest)
        .map(|s| s.to_string())
        .collect()
}

/// The iptables commands (program, arguments) that install a hold of `held` to queue
/// `num` in chain `chain` of the raw table — before conntrack, so a released SYN is a
/// new connection to the NAT rules as they are then — jumped to from PREROUTING (clients
/// on other nodes, this node's pods) and OUTPUT (the node itself), per family.
/// `--queue-bypass`: with nobody bound to the queue, the SYN goes on as without the hold.
pub fn install_commands(chain: &str, held: &Held, num: u16) -> Vec<(&'static str, Vec<String>)> {
    let mut out = Vec::new();
    for (prog, v4) in [("iptables-nft", true), ("ip6tables-nft", false)] {
        let addrs: Vec<_> = held
            .addresses
            .iter()
            .filter(|a| a.is_ipv4() == v4)
            .collect();
        let svcs: Vec<_> = held
            .services
            .iter()
            .filter(|(a, _)| a.is_ipv4() == v4)
            .collect();
        if addrs.is_empty() && svcs.is_empty() {
            continue;
        }
        let num = num.to_string();
        let rule = |dest: String, port: Option<String>| {
            let mut r = vec!["-A".to_string(), chain.into(), "-d".into(), dest];
            r.extend(["-p", "tcp"].map(String::from));
            if let Some(p) = port {
                r.extend(["--dport".to_string(), p]);
            }
            r.extend(["--syn", "-j", "NFQUEUE", "--queue-bypass", "--queue-num"].map(String::from));
            r.push(num.clone());
            let refs: Vec<&str> = r.iter().map(String::as_str).collect();
            raw(&refs)
        };
        out.push((prog, raw(&["-N", chain])));
        for a in addrs {
            out.push((prog, rule(a.to_string(), None)));
        }
        for (a, port) in svcs {
            out.push((prog, rule(a.to_string(), Some(port.to_string()))));
        }
        for hook in ["PREROUTING", "OUTPUT"] {
            out.push((prog, raw(&["-I", hook, "-j", chain])));
        }
    }
    out
}

/// The commands that remove chain `chain` from both families, each allowed to fail (a
/// family it was never in, a second removal): the jumps first, then the chain.
pub fn remove_commands(chain: &str) -> Vec<(&'static str, Vec<String>)> {
    let mut out = Vec::new();
    for prog in ["iptables-nft", "ip6tables-nft"] {
        for hook in ["PREROUTING", "OUTPUT"] {
            out.push((prog, raw(&["-D", hook, "-j", chain])));
        }
        out.push((prog, raw(&["-F", chain])));
        out.push((prog, raw(&["-X", chain])));
    }
    out
}

/// How a hold ends: its SYNs let go on (to the forward, or the source again after a
/// rollback), or dropped (the clients retransmit, as without the hold).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    Release,
    Drop,
}

type Ender = Box<dyn FnOnce(End) -> io::Result<usize> + Send>;

/// A running hold. [`Hold::end`] ends it (its rule removed first, then the held SYNs
/// released or dropped); dropping it is [`End::Drop`].
pub struct Hold {
    chain: String,
    ender: Option<Ender>,
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hold").field("chain", &self.chain).finish()
    }
}

impl Hold {
    /// A hold of chain `chain` that `ender` ends (the kernel layer's).
    pub fn new(
        chain: String,
        ender: impl FnOnce(End) -> io::Result<usize> + Send + 'static,
    ) -> Hold {
        Hold {
            chain,
            ender: Some(Box::new(ender)),
        }
    }

    /// Ends the hold; the number of SYNs released.
    pub fn end(mut self, how: End) -> io::Result<usize> {
        let ender = self.ender.take().expect("a hold ends once");
        ender(how)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(ender) = self.ender.take()
            && let Err(e) = ender(End::Drop)
        {
            tracing::warn!(chain = %self.chain, error = %e, "hold of new connections not ended cleanly");
        }
    }
}

/// The queue numbers the broker's holds use (one per held migration on a node).
const QUEUE_BASE: u16 = 0x7a00;
const QUEUES: u16 = 256;
/// How often the holding thread looks whether it was told to end.
const TAKE_EVERY: Duration = Duration::from_millis(20);
/// A hold never outlives this (the lock's own sweep has the same bound): its SYNs are
/// dropped then, as without it.
pub const HOLD_AT_MOST: Duration = Duration::from_secs(600);

/// Binds the first free queue of the broker's range.
fn bind_free() -> io::Result<Queue> {
    let mut last = None;
    for n in QUEUE_BASE..QUEUE_BASE + QUEUES {
        match Queue::bind(n) {
            Ok(q) => return Ok(q),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("no free queue")))
}

/// Runs each command; `must`: the first failure is returned.
fn run_all(cmds: &[(&'static str, Vec<String>)], must: bool) -> io::Result<()> {
    for (prog, args) in cmds {
        let out = std::process::Command::new(prog).args(args).output()?;
        if must && !out.status.success() {
            return Err(io::Error::other(format!(
                "{prog} {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
    }
    Ok(())
}

/// Starts holding `held` in the network namespace of `netns_pid` (the node's): a
/// thread of its own enters it, binds a queue, installs the chain and takes what comes
/// until the hold ends. Returns once the rules are in (or failed, leaving nothing).
pub fn start(netns_pid: i32, chain: String, held: Held) -> io::Result<Hold> {
    let ns = std::fs::File::open(format!("/proc/{netns_pid}/ns/net"))?;
    let (ready_tx, ready) = std::sync::mpsc::channel::<io::Result<()>>();
    let (end_tx, end_rx) = std::sync::mpsc::channel::<End>();
    let (done_tx, done) = std::sync::mpsc::channel::<io::Result<usize>>();
    let c = chain.clone();
    std::thread::spawn(move || {
        let setup = || -> io::Result<Queue> {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
            let q = bind_free()?;
            if let Err(e) = run_all(&install_commands(&c, &held, q.num()), true) {
                let _ = run_all(&remove_commands(&c), false);
                return Err(e);
            }
            Ok(q)
        };
        let mut q = match setup() {
            Ok(q) => q,
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        let _ = ready_tx.send(Ok(()));
        let started = Instant::now();
        let how = loop {
            if let Err(e) = q.take(TAKE_EVERY) {
                tracing::warn!(chain = %c, error = %e, "hold: reading the queue");
            }
            match end_rx.try_recv() {
                Ok(how) => break how,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => break End::Drop,
                Err(std::sync::mpsc::TryRecvError::Empty) => {}
            }
            if started.elapsed() > HOLD_AT_MOST {
                break End::Drop;
            }
        };
        // The rule first (a SYN released past a rule still in place can meet it
        // again), then what came meanwhile, then the verdicts.
        let removed = run_all(&remove_commands(&c), false);
        let _ = q.take(Duration::from_millis(1));
        let r = removed.and_then(|()| match how {
            End::Release => q.release(),
            End::Drop => Ok(0),
        });
        drop(q);
        let _ = done_tx.send(r);
    });
    ready
        .recv()
        .map_err(|_| io::Error::other("hold thread ended"))??;
    Ok(Hold::new(chain, move |how| {
        let _ = end_tx.send(how);
        done.recv_timeout(Duration::from_secs(10))
            .map_err(|_| io::Error::other("hold thread did not answer"))?
    }))
}

/// Removes chain `chain` (both families) in the namespace of `netns_pid`; absent is
/// fine.
pub fn remove(netns_pid: i32, chain: &str) -> io::Result<()> {
    let chain = chain.to_string();
    crate::kernel::in_netns(netns_pid, move || run_all(&remove_commands(&chain), false))
}

fn timeval(d: Duration) -> nix::sys::time::TimeVal {
    nix::sys::time::TimeVal::new(
        i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        i64::from(d.subsec_micros()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verdict_names_the_queue_the_packet_and_accept() {
        let m = accept_message(0x1234, 0xdead_beef);
        assert_eq!(m.len(), 16 + 4 + 12);
        assert_eq!(
            u32::from_ne_bytes(m[0..4].try_into().unwrap()) as usize,
            m.len()
        );
        assert_eq!(u16::from_ne_bytes(m[4..6].try_into().unwrap()), 0x0301);
        assert_eq!(&m[18..20], &[0x12, 0x34], "the queue, big-endian");
        assert_eq!(&m[24..28], &NF_ACCEPT.to_be_bytes());
        assert_eq!(&m[28..32], &0xdead_beef_u32.to_be_bytes());
    }

    #[test]
    fn binding_asks_for_metadata_only_and_fails_open() {
        let [cmd, params] = bind_messages(7);
        assert_eq!(cmd[20 + 4], NFQNL_CFG_CMD_BIND);
        // Every message asks for an acknowledgement.
        for m in [&cmd, &params] {
            assert_eq!(
                u16::from_ne_bytes(m[6..8].try_into().unwrap()),
                NLM_F_REQUEST | NLM_F_ACK
            );
        }
        // PARAMS: range 0, mode META (5 bytes, padded to 8, attribute 12).
        assert_eq!(&params[24..29], &[0, 0, 0, 0, NFQNL_COPY_META]);
        assert_eq!(&params[32 + 4..32 + 8], &NFQA_CFG_F_FAIL_OPEN.to_be_bytes());
    }

    fn joined(c: &[(&str, Vec<String>)]) -> Vec<String> {
        c.iter()
            .map(|(p, a)| format!("{p} {}", a.join(" ")))
            .collect()
    }

    #[test]
    fn a_hold_queues_syns_to_the_sources_addresses_and_services_before_conntrack() {
        let held = Held {
            addresses: vec!["198.18.1.5".parse().unwrap(), "fd00::5".parse().unwrap()],
            services: vec![("198.19.0.10".parse().unwrap(), 80)],
        };
        let c = joined(&install_commands("pm-hold-x", &held, 7));
        let q = "-p tcp --syn -j NFQUEUE --queue-bypass --queue-num 7";
        assert_eq!(
            c,
            vec![
                "iptables-nft -w -t raw -N pm-hold-x".to_string(),
                format!("iptables-nft -w -t raw -A pm-hold-x -d 198.18.1.5 {q}"),
                format!(
                    "iptables-nft -w -t raw -A pm-hold-x -d 198.19.0.10 -p tcp --dport 80 --syn -j NFQUEUE --queue-bypass --queue-num 7"
                ),
                "iptables-nft -w -t raw -I PREROUTING -j pm-hold-x".to_string(),
                "iptables-nft -w -t raw -I OUTPUT -j pm-hold-x".to_string(),
                "ip6tables-nft -w -t raw -N pm-hold-x".to_string(),
                format!("ip6tables-nft -w -t raw -A pm-hold-x -d fd00::5 {q}"),
                "ip6tables-nft -w -t raw -I PREROUTING -j pm-hold-x".to_string(),
                "ip6tables-nft -w -t raw -I OUTPUT -j pm-hold-x".to_string(),
            ]
        );
        // The jumps go before the chain, in both families.
        let r = joined(&remove_commands("pm-hold-x"));
        assert_eq!(r.len(), 8);
        assert!(r[0].ends_with("-D PREROUTING -j pm-hold-x") && r[3].ends_with("-X pm-hold-x"));
        assert!(r[4].starts_with("ip6tables-nft"));
    }

    #[test]
    fn a_hold_chain_is_an_iptables_name_of_its_migration() {
        let uid = podmotion_wire::ids::MigrationUid::parse("226e6566-e9e9-43c3-ab93-e7d805a91b05")
            .unwrap();
        let c = chain_name(&uid);
        assert_eq!(c, "pm-hold-226e6566-e9e9-43c3-a");
        assert!(c.len() <= 28, "{c}");
    }

    fn packet_message(id: u32) -> Vec<u8> {
        let mut hdr = id.to_be_bytes().to_vec();
        hdr.extend_from_slice(&[0x08, 0x00, 0]);
        message(
            NFQNL_MSG_PACKET,
            0,
            7,
            &[attr(9, b"x"), attr(NFQA_PACKET_HDR, &hdr)],
        )
    }

    #[test]
    fn a_datagram_of_packets_and_an_error_reads_as_such() {
        let mut d = packet_message(5);
        d.extend(packet_message(6));
        let mut err = Vec::new();
        err.extend_from_slice(&(NLMSG_HDRLEN as u32 + 4).to_ne_bytes());
        err.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        err.extend_from_slice(&[0; 10]);
        err.extend_from_slice(&(-16i32).to_ne_bytes());
        d.extend(err);
        assert_eq!(
            parse(&d),
            vec![Incoming::Packet(5), Incoming::Packet(6), Incoming::Ack(-16)]
        );
        // Truncated or garbage: nothing read past it, no panic.
        assert_eq!(parse(&d[..10]), vec![]);
        assert_eq!(parse(&[0xff; 40]), vec![]);
    }
}
