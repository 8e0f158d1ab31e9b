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

/// One family's iptables: its command and its `-restore`, which applies a whole
/// script as one transaction in one process (the lock's and the forward's paths each
/// waited for four process starts per family before; ≈ 0.2 s on a busy node between
/// the forward and the held SYNs' release, seen on the real nodes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Family {
    pub command: &'static str,
    pub restore: &'static str,
    v4: bool,
}

pub const FAMILIES: [Family; 2] = [
    Family {
        command: "iptables-nft",
        restore: "iptables-nft-restore",
        v4: true,
    },
    Family {
        command: "ip6tables-nft",
        restore: "ip6tables-nft-restore",
        v4: false,
    },
];

/// The raw-table scripts (family, `-restore --noflush` input) that install a hold of
/// `held` to queue `num` in chain `chain` — before conntrack, so a released SYN is a
/// new connection to the NAT rules as they are then — jumped to from PREROUTING
/// (clients on other nodes, this node's pods) and OUTPUT (the node itself), for each
/// family `held` names. `--queue-bypass`: with nobody bound to the queue, the SYN goes
/// on as without the hold. Each script is one transaction: it fails whole.
pub fn install_scripts(chain: &str, held: &Held, num: u16) -> Vec<(Family, String)> {
    let mut out = Vec::new();
    for f in FAMILIES {
        let addrs: Vec<_> = held
            .addresses
            .iter()
            .filter(|a| a.is_ipv4() == f.v4)
            .collect();
        let svcs: Vec<_> = held
            .services
            .iter()
            .filter(|(a, _)| a.is_ipv4() == f.v4)
            .collect();
        if addrs.is_empty() && svcs.is_empty() {
            continue;
        }
        let queue = format!("--syn -j NFQUEUE --queue-bypass --queue-num {num}");
        let mut script = format!("*raw\n:{chain} - [0:0]\n");
        for a in addrs {
            script.push_str(&format!("-A {chain} -d {a} -p tcp {queue}\n"));
        }
        for (a, port) in svcs {
            script.push_str(&format!(
                "-A {chain} -d {a} -p tcp --dport {port} {queue}\n"
            ));
        }
        for hook in ["PREROUTING", "OUTPUT"] {
            script.push_str(&format!("-I {hook} -j {chain}\n"));
        }
        script.push_str("COMMIT\n");
        out.push((f, script));
    }
    out
}

/// The raw-table script that removes chain `chain` of one family whose hold was
/// installed whole: the jumps first, then the chain, in one transaction (it fails
/// whole where a piece is missing: then [`remove_commands`]).
pub fn remove_script(chain: &str) -> String {
    format!(
        "*raw\n-D PREROUTING -j {chain}\n-D OUTPUT -j {chain}\n-F {chain}\n-X {chain}\nCOMMIT\n"
    )
}

/// The commands that remove chain `chain` from `families`, each allowed to fail (a
/// family it was never in, a second removal, a hold half installed): the jumps first,
/// then the chain.
pub fn remove_commands(chain: &str, families: &[Family]) -> Vec<(&'static str, Vec<String>)> {
    let mut out = Vec::new();
    for f in families {
        for hook in ["PREROUTING", "OUTPUT"] {
            out.push((f.command, raw(&["-D", hook, "-j", chain])));
        }
        out.push((f.command, raw(&["-F", chain])));
        out.push((f.command, raw(&["-X", chain])));
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

/// Binds the first free queue of the broker's range. A queue another socket holds
/// answers `EPERM` (the kernel's "not yours"; `EBUSY` is this socket's own): both
/// mean taken, so two holds at once in one network namespace — two migrations from
/// one node, or nodes sharing a namespace — each get a queue. (Taking only `EBUSY` as
/// taken left the second hold unstarted, seen on the real nodes: "Operation not
/// permitted", its clients' SYNs dropped at the lock.)
pub fn bind_free() -> io::Result<Queue> {
    let mut last = None;
    for n in QUEUE_BASE..QUEUE_BASE + QUEUES {
        match Queue::bind(n) {
            Ok(q) => return Ok(q),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EPERM)) => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::other(format!(
        "no queue of {QUEUE_BASE:#x}..{:#x} could be bound (the last: {})",
        QUEUE_BASE + QUEUES,
        last.map_or_else(|| "none tried".to_string(), |e| e.to_string())
    )))
}

/// Runs each command, whatever each one's exit (a piece already gone); only a program
/// that cannot be started is an error.
fn run_all(cmds: &[(&'static str, Vec<String>)]) -> io::Result<()> {
    for (prog, args) in cmds {
        std::process::Command::new(prog).args(args).output()?;
    }
    Ok(())
}

/// Applies `script` with `family`'s `-restore --noflush` (one transaction).
pub fn restore(family: Family, script: &str) -> io::Result<()> {
    crate::kernel::run_script(family.restore, &["--noflush", "-w"], script)
}

/// Installs the hold's scripts; on a failure, removes what any of them left. Returns
/// the families installed.
fn install(chain: &str, held: &Held, num: u16) -> io::Result<Vec<Family>> {
    let mut done = Vec::new();
    for (f, script) in install_scripts(chain, held, num) {
        if let Err(e) = restore(f, &script) {
            let _ = run_all(&remove_commands(chain, &FAMILIES));
            return Err(e);
        }
        done.push(f);
    }
    Ok(done)
}

/// Removes the chain from the `families` it was installed in: one transaction each,
/// else piece by piece.
fn uninstall(chain: &str, families: &[Family]) -> io::Result<()> {
    for f in families {
        if restore(*f, &remove_script(chain)).is_err() {
            run_all(&remove_commands(chain, &[*f]))?;
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
        let setup = || -> io::Result<(Queue, Vec<Family>)> {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
            let q = bind_free()?;
            let families = install(&c, &held, q.num())?;
            Ok((q, families))
        };
        let (mut q, families) = match setup() {
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
        let removed = uninstall(&c, &families);
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
    crate::kernel::in_netns(netns_pid, move || {
        run_all(&remove_commands(&chain, &FAMILIES))
    })
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
        let s = install_scripts("pm-hold-x", &held, 7);
        let q = "-p tcp --syn -j NFQUEUE --queue-bypass --queue-num 7";
        assert_eq!(
            s,
            vec![
                (
                    FAMILIES[0],
                    format!(
                        "*raw\n:pm-hold-x - [0:0]\n-A pm-hold-x -d 198.18.1.5 {q}\n\
                         -A pm-hold-x -d 198.19.0.10 -p tcp --dport 80 --syn -j NFQUEUE --queue-bypass --queue-num 7\n\
                         -I PREROUTING -j pm-hold-x\n-I OUTPUT -j pm-hold-x\nCOMMIT\n"
                    )
                ),
                (
                    FAMILIES[1],
                    format!(
                        "*raw\n:pm-hold-x - [0:0]\n-A pm-hold-x -d fd00::5 {q}\n\
                         -I PREROUTING -j pm-hold-x\n-I OUTPUT -j pm-hold-x\nCOMMIT\n"
                    )
                ),
            ]
        );
        // An IPv4-only hold has no IPv6 half.
        let v4 = Held {
            addresses: vec!["198.18.1.5".parse().unwrap()],
            services: vec![],
        };
        let s = install_scripts("pm-hold-x", &v4, 7);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].0.restore, "iptables-nft-restore");
        // The jumps go before the chain.
        let r = remove_script("pm-hold-x");
        assert!(r.find("-D PREROUTING").unwrap() < r.find("-X pm-hold-x").unwrap());
        let r = joined(&remove_commands("pm-hold-x", &FAMILIES));
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
