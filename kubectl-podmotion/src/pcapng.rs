//! The attach agent's wiretap frames as a pcapng file Wireshark opens: each tapped
//! connection becomes a TCP conversation between its peer and its original destination
//! (a three-way handshake at `open`, one segment per copied chunk in each direction
//! with consistent sequence and acknowledgement numbers, a FIN exchange at `close`),
//! in raw IPv4/IPv6 packets (link type 101, `LINKTYPE_RAW`) with valid checksums.
//! The packets are synthesized from the byte streams the agent copied: their payload
//! and order are real, their TCP/IP headers are not what was on the wire.
//!
//! Pure: frames in, bytes out (the caller writes them to the file).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Wiretap frame kinds (`docs/attach-executor.md`).
pub const TAP_OPEN: u8 = 0;
pub const TAP_TO_APP: u8 = 1;
pub const TAP_FROM_APP: u8 = 2;
pub const TAP_CLOSE: u8 = 3;

const LINKTYPE_RAW: u16 = 101;
/// Largest TCP payload per synthesized segment (fits an IPv4 total length).
const MAX_SEGMENT: usize = 65_000;
const SYN: u8 = 0x02;
const FIN: u8 = 0x01;
const PSH: u8 = 0x08;
const ACK: u8 = 0x10;

fn block(kind: u32, body: &[u8]) -> Vec<u8> {
    let pad = (4 - body.len() % 4) % 4;
    let total = (12 + body.len() + pad) as u32;
    let mut b = Vec::with_capacity(total as usize);
    b.extend_from_slice(&kind.to_le_bytes());
    b.extend_from_slice(&total.to_le_bytes());
    b.extend_from_slice(body);
    b.extend(std::iter::repeat_n(0, pad));
    b.extend_from_slice(&total.to_le_bytes());
    b
}

/// Section header and one interface (raw IP, microsecond timestamps): the start of
/// the file.
pub fn header() -> Vec<u8> {
    let mut shb = vec![];
    shb.extend_from_slice(&0x1A2B_3C4Du32.to_le_bytes());
    shb.extend_from_slice(&1u16.to_le_bytes());
    shb.extend_from_slice(&0u16.to_le_bytes());
    shb.extend_from_slice(&(-1i64).to_le_bytes());
    let mut idb = vec![];
    idb.extend_from_slice(&LINKTYPE_RAW.to_le_bytes());
    idb.extend_from_slice(&0u16.to_le_bytes());
    idb.extend_from_slice(&0u32.to_le_bytes()); // snaplen: no limit
    let mut out = block(0x0A0D_0D0A, &shb);
    out.extend(block(1, &idb));
    out
}

/// One enhanced packet block at `micros` since the epoch.
fn packet(micros: u64, data: &[u8]) -> Vec<u8> {
    let mut b = vec![];
    b.extend_from_slice(&0u32.to_le_bytes()); // interface 0
    b.extend_from_slice(&((micros >> 32) as u32).to_le_bytes());
    b.extend_from_slice(&(micros as u32).to_le_bytes());
    b.extend_from_slice(&(data.len() as u32).to_le_bytes());
    b.extend_from_slice(&(data.len() as u32).to_le_bytes());
    b.extend_from_slice(data);
    block(6, &b)
}

fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for p in parts {
        let mut chunks = p.chunks_exact(2);
        for c in &mut chunks {
            sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
        }
        if let [last] = chunks.remainder() {
            sum += u32::from(*last) << 8;
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A raw IP packet carrying one TCP segment from `src` to `dst`.
pub fn tcp_packet(
    src: SocketAddr,
    dst: SocketAddr,
    seq: u32,
    ack: u32,
    flags: u8,
    payload: &[u8],
) -> Option<Vec<u8>> {
    let mut tcp = vec![0u8; 20];
    tcp[0..2].copy_from_slice(&src.port().to_be_bytes());
    tcp[2..4].copy_from_slice(&dst.port().to_be_bytes());
    tcp[4..8].copy_from_slice(&seq.to_be_bytes());
    tcp[8..12].copy_from_slice(&ack.to_be_bytes());
    tcp[12] = 5 << 4;
    tcp[13] = flags;
    tcp[14..16].copy_from_slice(&65_535u16.to_be_bytes());
    tcp.extend_from_slice(payload);
    match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => Some(ipv4_packet(s, d, tcp)),
        (IpAddr::V6(s), IpAddr::V6(d)) => Some(ipv6_packet(s, d, tcp)),
        _ => None,
    }
}

/// An IPv4 header (don't fragment, TTL 64) before `tcp`, both checksums filled in.
fn ipv4_packet(s: Ipv4Addr, d: Ipv4Addr, mut tcp: Vec<u8>) -> Vec<u8> {
    let tcp_len = tcp.len();
    let pseudo = [
        &s.octets()[..],
        &d.octets()[..],
        &[0, 6],
        &(tcp_len as u16).to_be_bytes()[..],
    ]
    .concat();
    let c = checksum(&[&pseudo, &tcp]);
    tcp[16..18].copy_from_slice(&c.to_be_bytes());
    let mut ip = vec![0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((20 + tcp_len) as u16).to_be_bytes());
    ip[6] = 0x40; // don't fragment
    ip[8] = 64;
    ip[9] = 6;
    ip[12..16].copy_from_slice(&s.octets());
    ip[16..20].copy_from_slice(&d.octets());
    let c = checksum(&[&ip]);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    ip.extend_from_slice(&tcp);
    ip
}

/// An IPv6 header (hop limit 64) before `tcp`, its checksum filled in.
fn ipv6_packet(s: Ipv6Addr, d: Ipv6Addr, mut tcp: Vec<u8>) -> Vec<u8> {
    let tcp_len = tcp.len();
    let pseudo = [
        &s.octets()[..],
        &d.octets()[..],
        &(tcp_len as u32).to_be_bytes()[..],
        &[0, 0, 0, 6],
    ]
    .concat();
    let c = checksum(&[&pseudo, &tcp]);
    tcp[16..18].copy_from_slice(&c.to_be_bytes());
    let mut ip = vec![0u8; 40];
    ip[0] = 0x60;
    ip[4..6].copy_from_slice(&(tcp_len as u16).to_be_bytes());
    ip[6] = 6;
    ip[7] = 64;
    ip[8..24].copy_from_slice(&s.octets());
    ip[24..40].copy_from_slice(&d.octets());
    ip.extend_from_slice(&tcp);
    ip
}

struct Conversation {
    client: SocketAddr,
    server: SocketAddr,
    /// Next sequence numbers of each side.
    c_seq: u32,
    s_seq: u32,
}

/// Turns wiretap frames into pcapng packet blocks, per connection.
#[derive(Default)]
pub struct Writer {
    conns: HashMap<(usize, u32), Conversation>,
    pub packets: u64,
    pub connections: u64,
}

#[derive(serde::Deserialize)]
struct OpenMeta {
    peer: String,
    original_dst: String,
}

/// The packet blocks of one frame, all stamped with the frame's time.
struct Blocks {
    micros: u64,
    out: Vec<u8>,
    packets: u64,
}

impl Blocks {
    /// One TCP segment from `from` to `to` (nothing if the addresses' families differ).
    fn segment(
        &mut self,
        (from, to): (SocketAddr, SocketAddr),
        seq: u32,
        ack: u32,
        flags: u8,
        data: &[u8],
    ) {
        if let Some(p) = tcp_packet(from, to, seq, ack, flags, data) {
            self.out.extend(packet(self.micros, &p));
            self.packets += 1;
        }
    }
}

impl Conversation {
    fn to_server(&self) -> (SocketAddr, SocketAddr) {
        (self.client, self.server)
    }

    fn to_client(&self) -> (SocketAddr, SocketAddr) {
        (self.server, self.client)
    }
}

impl Writer {
    /// The packet blocks for one frame of source `src` (an agent: connection ids are
    /// per agent) taken at `micros`. Unknown connections and unparsable opens give
    /// nothing.
    pub fn frame(
        &mut self,
        src: usize,
        kind: u8,
        conn: u32,
        payload: &[u8],
        micros: u64,
    ) -> Vec<u8> {
        let mut b = Blocks {
            micros,
            out: vec![],
            packets: 0,
        };
        match kind {
            TAP_OPEN => self.open((src, conn), payload, &mut b),
            TAP_TO_APP | TAP_FROM_APP => {
                self.data((src, conn), kind == TAP_TO_APP, payload, &mut b)
            }
            TAP_CLOSE => self.close((src, conn), &mut b),
            _ => {}
        }
        self.packets += b.packets;
        b.out
    }

    /// A new conversation between the peer and the original destination in the open
    /// frame's JSON: the three-way handshake.
    fn open(&mut self, key: (usize, u32), payload: &[u8], b: &mut Blocks) {
        let Ok(meta) = serde_json::from_slice::<OpenMeta>(payload) else {
            return;
        };
        let (Ok(client), Ok(server)) = (meta.peer.parse(), meta.original_dst.parse()) else {
            return;
        };
        // Initial sequence numbers from the connection id: stable, distinct.
        let isn = key.1.wrapping_mul(0x9E37_79B9);
        let (c, s) = (isn, isn ^ 0x5555_5555);
        b.segment((client, server), c, 0, SYN, &[]);
        b.segment((server, client), s, c.wrapping_add(1), SYN | ACK, &[]);
        b.segment(
            (client, server),
            c.wrapping_add(1),
            s.wrapping_add(1),
            ACK,
            &[],
        );
        self.conns.insert(
            key,
            Conversation {
                client,
                server,
                c_seq: c.wrapping_add(1),
                s_seq: s.wrapping_add(1),
            },
        );
        self.connections += 1;
    }

    /// Bytes copied to the application (`to_app`) or from it: segments of at most
    /// [`MAX_SEGMENT`], advancing the sender's sequence number.
    fn data(&mut self, key: (usize, u32), to_app: bool, payload: &[u8], b: &mut Blocks) {
        let Some(cv) = self.conns.get_mut(&key) else {
            return;
        };
        for seg in payload.chunks(MAX_SEGMENT) {
            if to_app {
                b.segment(cv.to_server(), cv.c_seq, cv.s_seq, PSH | ACK, seg);
                cv.c_seq = cv.c_seq.wrapping_add(seg.len() as u32);
            } else {
                b.segment(cv.to_client(), cv.s_seq, cv.c_seq, PSH | ACK, seg);
                cv.s_seq = cv.s_seq.wrapping_add(seg.len() as u32);
            }
        }
    }

    /// The end of a conversation: a FIN each way and the last ACK.
    fn close(&mut self, key: (usize, u32), b: &mut Blocks) {
        let Some(cv) = self.conns.remove(&key) else {
            return;
        };
        let (c, s) = (cv.c_seq, cv.s_seq);
        b.segment(cv.to_server(), c, s, FIN | ACK, &[]);
        b.segment(cv.to_client(), s, c.wrapping_add(1), FIN | ACK, &[]);
        b.segment(
            cv.to_server(),
            c.wrapping_add(1),
            s.wrapping_add(1),
            ACK,
            &[],
        );
    }
}

/// Largest frame payload accepted from an agent: agents send at most 16 KiB of
/// connection bytes per frame (and a short JSON line on open); a length past this is
/// a broken or hostile stream, not something to buffer gigabytes for.
pub const MAX_FRAME_PAYLOAD: usize = 64 * 1024;

/// A frame header announcing more than [`MAX_FRAME_PAYLOAD`] bytes.
#[derive(Debug, PartialEq, Eq)]
pub struct FrameTooLong(pub u64);

impl std::fmt::Display for FrameTooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the agent announced a wiretap frame of {} bytes (at most {MAX_FRAME_PAYLOAD} expected)",
            self.0
        )
    }
}

impl std::error::Error for FrameTooLong {}

/// One frame: kind, connection, payload, bytes it took.
pub type Frame<'a> = (u8, u32, &'a [u8], usize);

/// Splits the start of `buf` into one frame, or `None` while the frame is not whole;
/// a frame longer than [`MAX_FRAME_PAYLOAD`] is refused as soon as its header is in.
pub fn parse_frame(buf: &[u8]) -> Result<Option<Frame<'_>>, FrameTooLong> {
    let (Some(head), Some(rest)) = (buf.get(..9), buf.get(9..)) else {
        return Ok(None);
    };
    let conn = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
    let len = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) as usize;
    if len > MAX_FRAME_PAYLOAD {
        return Err(FrameTooLong(len as u64));
    }
    Ok(rest
        .get(..len)
        .map(|payload| (head[0], conn, payload, 9 + len)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, conn: u32, payload: &[u8]) -> Vec<u8> {
        let mut v = vec![kind];
        v.extend_from_slice(&conn.to_be_bytes());
        v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn frames_are_split_only_when_whole() {
        let f = frame(TAP_TO_APP, 7, b"hello");
        assert_eq!(
            parse_frame(&f),
            Ok(Some((TAP_TO_APP, 7, &b"hello"[..], 14)))
        );
        assert_eq!(parse_frame(&f[..13]), Ok(None));
        assert_eq!(parse_frame(&f[..8]), Ok(None));
    }

    #[test]
    fn a_frame_longer_than_any_agent_sends_is_refused_from_its_header() {
        let mut huge = vec![TAP_TO_APP, 0, 0, 0, 7];
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(parse_frame(&huge), Err(FrameTooLong(u32::MAX as u64)));
        let at_limit = frame(TAP_TO_APP, 7, &vec![0; MAX_FRAME_PAYLOAD]);
        assert!(matches!(parse_frame(&at_limit), Ok(Some(_))));
        let past = frame(TAP_TO_APP, 7, &vec![0; MAX_FRAME_PAYLOAD + 1]);
        assert_eq!(
            parse_frame(&past[..9]),
            Err(FrameTooLong(MAX_FRAME_PAYLOAD as u64 + 1))
        );
    }

    #[test]
    fn ipv4_and_tcp_checksums_verify() {
        let p = tcp_packet(
            "10.0.0.1:40000".parse().unwrap(),
            "10.0.0.2:8080".parse().unwrap(),
            1,
            2,
            PSH | ACK,
            b"abc",
        )
        .unwrap();
        assert_eq!(p.len(), 20 + 20 + 3);
        assert_eq!(checksum(&[&p[..20]]), 0, "the IPv4 header sums to zero");
        let pseudo = [&p[12..20], &[0, 6], &(23u16).to_be_bytes()[..]].concat();
        assert_eq!(
            checksum(&[&pseudo, &p[20..]]),
            0,
            "the TCP segment sums to zero"
        );
        let p6 = tcp_packet(
            "[fd00::1]:40000".parse().unwrap(),
            "[fd00::2]:8080".parse().unwrap(),
            1,
            2,
            ACK,
            b"",
        )
        .unwrap();
        assert_eq!((p6[0] >> 4, p6.len()), (6, 60));
        assert!(
            tcp_packet(
                "10.0.0.1:1".parse().unwrap(),
                "[fd00::2]:2".parse().unwrap(),
                0,
                0,
                0,
                b""
            )
            .is_none()
        );
    }

    #[test]
    fn a_tapped_connection_is_a_tcp_conversation_with_consistent_sequence_numbers() {
        let mut w = Writer::default();
        let open = br#"{"peer":"10.0.0.1:40000","original_dst":"10.0.0.2:8080"}"#;
        let mut out = w.frame(0, TAP_OPEN, 1, open, 1_000_000);
        out.extend(w.frame(0, TAP_TO_APP, 1, b"echo hi\n", 1_000_001));
        out.extend(w.frame(0, TAP_FROM_APP, 1, b"hi\n", 1_000_002));
        out.extend(w.frame(0, TAP_CLOSE, 1, b"", 1_000_003));
        assert_eq!((w.packets, w.connections), (3 + 1 + 1 + 3, 1));
        assert!(
            w.frame(0, TAP_TO_APP, 1, b"late", 0).is_empty(),
            "a closed connection"
        );
        assert!(
            w.frame(1, TAP_TO_APP, 1, b"other agent", 0).is_empty(),
            "ids are per agent"
        );
        // Walk the blocks: each is an EPB whose packet carries the expected flags and
        // sequence numbers.
        let mut at = 0;
        let mut segs = vec![];
        while at < out.len() {
            let kind = u32::from_le_bytes(out[at..at + 4].try_into().unwrap());
            let total = u32::from_le_bytes(out[at + 4..at + 8].try_into().unwrap()) as usize;
            assert_eq!(kind, 6);
            let cap = u32::from_le_bytes(out[at + 20..at + 24].try_into().unwrap()) as usize;
            let ip = &out[at + 28..at + 28 + cap];
            let tcp = &ip[20..];
            let seq = u32::from_be_bytes(tcp[4..8].try_into().unwrap());
            let ack = u32::from_be_bytes(tcp[8..12].try_into().unwrap());
            segs.push((tcp[13], seq, ack, tcp[20..].to_vec()));
            at += total;
        }
        let (c0, s0) = (segs[0].1, segs[1].1);
        assert_eq!(segs[0].0, SYN);
        assert_eq!((segs[1].0, segs[1].2), (SYN | ACK, c0 + 1));
        assert_eq!(
            (segs[3].1, segs[3].2, segs[3].3.as_slice()),
            (c0 + 1, s0 + 1, &b"echo hi\n"[..])
        );
        assert_eq!(
            (segs[4].1, segs[4].2, segs[4].3.as_slice()),
            (s0 + 1, c0 + 9, &b"hi\n"[..])
        );
        assert_eq!((segs[5].0, segs[5].1), (FIN | ACK, c0 + 9));
        assert_eq!(
            (segs[6].0, segs[6].1, segs[6].2),
            (FIN | ACK, s0 + 4, c0 + 10)
        );
        assert_eq!(header().len() % 4, 0);
    }
}
