//! The source's side of the image stream (`Send`): the connection to the target agent,
//! and [`produce`], which reads the checkpoint dir and seals, paces and queues what the
//! target does not hold yet.

use super::helpers::{error_chain, io_internal, now_us};
use super::pace::Pace;
use super::state::{Config, Migration};
use podmotion_wire::agent::{ImageChunk, Phase, ReceiveSummary, SendRequest};
use podmotion_wire::identity::{Peer, PeerVerifier};
use podmotion_wire::proto::migration_agent_client::MigrationAgentClient;
use podmotion_wire::transfer::{self, Sealer};
use std::collections::BTreeSet;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;
use tonic::Status;
use tonic::transport::Channel;

/// The producer's error when the target stopped taking chunks (its answer says why).
const TARGET_CLOSED: &str = "target closed the stream";

/// Delta block size when comparing a final image with its warm copy.
pub(super) const BLOCK: usize = 64 * 1024;

/// Dials the target agent at the request's endpoint. The endpoint says where to dial;
/// what is trusted is the identity the operator named at Prepare (`peer`): the server
/// must prove it is the peer's agent.
pub(super) async fn connect_target(
    cfg: &Config,
    peer: &str,
    r: &SendRequest,
) -> Result<Channel, Status> {
    let tls = cfg.tls.material();
    let verifier = PeerVerifier::new(
        &tls.ca_pem,
        Peer::Agent(peer.to_owned()),
        cfg.legacy_shared_identity,
    )
    .map_err(|e| Status::internal(format!("agents' CA: {e}")))?;
    let sni = if r.target_server_name.is_empty() {
        peer.to_owned()
    } else {
        r.target_server_name.clone()
    };
    tonic::transport::Endpoint::from_shared(r.target_endpoint.clone())
        .map_err(|e| Status::invalid_argument(e.to_string()))?
        .tls_config_with_verifier(
            tonic::transport::ClientTlsConfig::new()
                .identity(tonic::transport::Identity::from_pem(
                    &tls.cert_pem,
                    &tls.key_pem,
                ))
                .domain_name(sni),
            Arc::new(verifier),
        )
        .map_err(|e| Status::invalid_argument(e.to_string()))?
        .tcp_nodelay(true)
        .initial_stream_window_size(Some(8 << 20))
        .initial_connection_window_size(Some(16 << 20))
        .connect()
        .await
        .map_err(|e| Status::unavailable(format!("target agent: {}", error_chain(&e))))
}

/// One image stream to the target over `channel`: a fresh sealer, [`produce`] on a
/// blocking thread, the target's summary checked against what was sent. Returns the
/// plaintext bytes sent and the paths now on the target.
pub(super) async fn stream_images(
    channel: Channel,
    m: &Migration,
    delta: bool,
    bandwidth_limit: u64,
) -> Result<(u64, Vec<String>), Status> {
    let mut client = MigrationAgentClient::new(channel).max_encoding_message_size(4 << 20);
    let (tx, rx) = tokio::sync::mpsc::channel::<ImageChunk>(8);
    let dir = m.dir.clone();
    let sealer = stream_sealer(&m.key, m.uid.as_str())?;
    let uid = m.uid.to_string();
    let already = m.sent.clone();
    let pace = Pace::new(bandwidth_limit);
    let producer = tokio::task::spawn_blocking(move || {
        produce(&dir, &uid, &sealer, &tx, &already, delta, &pace)
    });
    let stream =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
    let summary = client.receive_images(stream).await;
    let produced = producer
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
    let ((sent, paths), summary) =
        stream_outcome(produced, summary.map(tonic::Response::into_inner))?;
    if summary.bytes != sent {
        return Err(Status::data_loss(format!(
            "target stored {} of {sent} bytes",
            summary.bytes
        )));
    }
    Ok((sent, paths))
}

/// How a stream ended, from the producer's result and the target's answer. The
/// target's own error first: a target that refused the stream closed it, and the
/// producer's "target closed the stream" says nothing of why.
fn stream_outcome<P>(
    produced: Result<P, Status>,
    summary: Result<ReceiveSummary, Status>,
) -> Result<(P, ReceiveSummary), Status> {
    match (produced, summary) {
        (Err(e), Err(target)) if e.message() == TARGET_CLOSED => Err(target),
        (Err(e), _) => Err(e),
        (Ok(_), Err(target)) => Err(target),
        (Ok(p), Ok(s)) => Ok((p, s)),
    }
}

impl Migration {
    /// Records a stream the target stored (`t`: when the `Send` started): a pre-copy
    /// round's size and time, or the final transfer, which moves the phase to `Sent`.
    pub(super) fn record_sent(&mut self, sent: u64, paths: Vec<String>, t: Instant) {
        self.bytes_sent += sent;
        self.sent.extend(paths);
        if self.phase == Phase::PreDumping {
            // A pre-copy round streamed while the workload runs: its size is the
            // dirty set, its speed the link's, both what the freeze budget needs.
            self.last_round_sent_bytes = sent;
            self.pre_copy_sent_bytes += sent;
            self.timings.pre_copy_send_us += t.elapsed().as_micros() as u64;
        }
        if self.phase == Phase::Dumped {
            self.timings.send_us = t.elapsed().as_micros() as u64;
            self.timings.send_finished_us = now_us();
            self.phase = Phase::Sent;
            tracing::info!(
                uid = %self.uid,
                bytes = sent,
                send_ms = self.timings.send_us / 1000,
                "final images sent"
            );
        }
    }
}

/// The sealer of one outgoing image stream (every Send, every retry): a fresh random
/// stream id, so no two streams under the migration key share a nonce.
pub(super) fn stream_sealer(key: &[u8], uid: &str) -> Result<Sealer, Status> {
    let id: [u8; transfer::STREAM_ID_LEN] = rand::random();
    Sealer::new(key, uid, &id).map_err(|e| Status::internal(e.to_string()))
}

/// Reads the checkpoint dir and sends what was not sent before as sealed chunks;
/// returns the plaintext bytes sent and the paths now on the target. With `delta`, an
/// image of a later round (a warm copy after the first, or the final dump) whose
/// namesake the target holds from the newest earlier warm copy is sent as the blocks
/// that differ: each round then moves only what the workload changed since the last.
pub(super) fn produce(
    dir: &Path,
    uid: &str,
    sealer: &Sealer,
    tx: &tokio::sync::mpsc::Sender<ImageChunk>,
    already: &BTreeSet<String>,
    delta: bool,
    pace: &Pace,
) -> Result<(u64, Vec<String>), Status> {
    let entries = entries_to_send(dir, already)?;
    // The newest warm copy the target holds, for deltas.
    let base_dir = newest_warm_copy(already);
    let mut out = Outgoing {
        uid,
        sealer,
        tx,
        pace,
        seq: 0,
        bytes: 0,
    };
    let mut paths = Vec::new();
    for (rel, is_link) in entries {
        let full = dir.join(&rel);
        paths.push(rel.clone());
        if is_link {
            out.send_link(&full, &rel)?;
            continue;
        }
        match delta_base(base_dir.as_deref(), &rel, already, delta) {
            Some(base) => out.send_delta(&full, &dir.join(&base), &rel, &base)?,
            None => out.send_whole(&full, &rel)?,
        }
    }
    out.finish()?;
    Ok((out.bytes, paths))
}

/// The files and links of the checkpoint dir (logs aside) the target does not hold,
/// in the order they are sent.
fn entries_to_send(dir: &Path, already: &BTreeSet<String>) -> Result<Vec<(String, bool)>, Status> {
    let mut entries = Vec::new();
    collect(dir, dir, &mut entries).map_err(io_internal)?;
    entries.retain(|(rel, _)| !already.contains(rel));
    entries.sort_by_key(|(rel, _)| send_order(rel));
    Ok(entries)
}

/// The sort key of a path in a stream. Parents before children: pre-1, pre-2, …,
/// final, then the manifest last (its arrival tells the target the image set is
/// complete).
fn send_order(rel: &str) -> (bool, bool, u32, String) {
    (
        rel.starts_with("manifest"),
        rel.starts_with("final"),
        pre_round(rel),
        rel.to_owned(),
    )
}

/// The newest warm copy (`pre-<n>`) of which the target holds a file.
fn newest_warm_copy(already: &BTreeSet<String>) -> Option<String> {
    already
        .iter()
        .filter_map(|p| p.split_once('/').map(|(d, _)| d))
        .filter(|d| d.starts_with("pre-"))
        .max_by_key(|d| pre_round(d))
        .map(str::to_owned)
}

/// The file `rel` is sent as a delta against, with `delta`: its namesake in the newest
/// warm copy the target holds (`base_dir`), for an image of a later round.
fn delta_base(
    base_dir: Option<&str>,
    rel: &str,
    already: &BTreeSet<String>,
    delta: bool,
) -> Option<String> {
    let later_round = rel.starts_with("final/") || pre_round(rel) > 0;
    let b = base_dir.filter(|_| delta && later_round)?;
    let name = rel.rsplit('/').next().unwrap_or_default();
    let base = format!("{b}/{name}");
    already.contains(&base).then_some(base)
}

/// One outgoing stream: seals each chunk under the next sequence number, paces it and
/// queues it for the target, counting the image bytes sent.
struct Outgoing<'a> {
    uid: &'a str,
    sealer: &'a Sealer,
    tx: &'a tokio::sync::mpsc::Sender<ImageChunk>,
    pace: &'a Pace,
    seq: u64,
    bytes: u64,
}

/// A run of differing blocks of a delta, at most one `CHUNK`, and where it starts.
struct Run {
    data: Vec<u8>,
    at: u64,
}

impl Run {
    fn new() -> Run {
        Run {
            data: Vec::with_capacity(transfer::CHUNK + transfer::TAG_LEN),
            at: 0,
        }
    }
}

impl Outgoing<'_> {
    /// The stream id travels in the first chunk, the stream's header.
    fn header(&self) -> Vec<u8> {
        if self.seq == 0 {
            self.sealer.stream_id().to_vec()
        } else {
            vec![]
        }
    }

    /// Seals `data` (the plaintext, with room for the tag) in place and sends it as the
    /// next chunk.
    fn send_sealed(
        &mut self,
        path: &str,
        offset: u64,
        mut data: Vec<u8>,
        symlink: bool,
        base: &str,
    ) -> Result<(), Status> {
        self.sealer
            .seal_in_place(self.seq, path, offset, false, &mut data);
        self.send(ImageChunk {
            migration_uid: self.uid.into(),
            seq: self.seq,
            path: path.into(),
            offset,
            sealed: data,
            end: false,
            symlink,
            base: base.into(),
            stream_id: self.header(),
        })?;
        self.seq += 1;
        Ok(())
    }

    /// Sends a copy of `data` (with room for the tag) as the next chunk.
    fn send_copy(
        &mut self,
        path: &str,
        offset: u64,
        data: &[u8],
        symlink: bool,
        base: &str,
    ) -> Result<(), Status> {
        let mut buf = Vec::with_capacity(data.len() + transfer::TAG_LEN);
        buf.extend_from_slice(data);
        self.send_sealed(path, offset, buf, symlink, base)
    }

    /// Waits for the pace, then queues `c` for the target.
    fn send(&self, c: ImageChunk) -> Result<(), Status> {
        self.pace.wait(c.sealed.len() as u64);
        self.tx
            .blocking_send(c)
            .map_err(|_| Status::aborted(TARGET_CLOSED))
    }

    /// A link: its target, in one chunk.
    fn send_link(&mut self, full: &Path, rel: &str) -> Result<(), Status> {
        let target = std::fs::read_link(full).map_err(io_internal)?;
        self.send_copy(rel, 0, target.to_string_lossy().as_bytes(), true, "")
    }

    /// A whole file, a chunk at a time (an empty file as one empty chunk).
    fn send_whole(&mut self, full: &Path, rel: &str) -> Result<(), Status> {
        let mut f = std::fs::File::open(full).map_err(io_internal)?;
        let mut offset = 0u64;
        loop {
            // Read straight into the buffer that is sealed in place and sent: no copy.
            let mut buf = Vec::with_capacity(transfer::CHUNK + transfer::TAG_LEN);
            let n = (&mut f)
                .take(transfer::CHUNK as u64)
                .read_to_end(&mut buf)
                .map_err(io_internal)?;
            if n == 0 && offset > 0 {
                break;
            }
            self.send_sealed(rel, offset, buf, false, "")?;
            offset += n as u64;
            self.bytes += n as u64;
            if n == 0 {
                break;
            }
        }
        Ok(())
    }

    /// A file as a delta against `base` (at `base_file`), which the target holds: its
    /// length first, then the runs of blocks that differ. Both files are compared a
    /// window at a time, so memory stays flat whatever the image size.
    fn send_delta(
        &mut self,
        full: &Path,
        base_file: &Path,
        rel: &str,
        base: &str,
    ) -> Result<(), Status> {
        let f = std::fs::File::open(full).map_err(io_internal)?;
        let len = f.metadata().map_err(io_internal)?.len();
        let mut new = f.take(len);
        let mut old = std::fs::File::open(base_file).map_err(io_internal)?;
        self.send_copy(rel, 0, &len.to_be_bytes(), false, base)?;
        let (mut nw, mut ow) = (Vec::new(), Vec::new());
        let mut run = Run::new();
        let mut pos = 0u64;
        loop {
            nw.clear();
            ow.clear();
            let n = (&mut new)
                .take(transfer::CHUNK as u64)
                .read_to_end(&mut nw)
                .map_err(io_internal)?;
            if n == 0 {
                break;
            }
            (&mut old)
                .take(n as u64)
                .read_to_end(&mut ow)
                .map_err(io_internal)?;
            self.send_differing_blocks(rel, &mut run, pos, &nw, &ow)?;
            pos += n as u64;
        }
        self.flush_run(rel, &mut run)
    }

    /// Compares one window (`new` at `pos`, and the base's bytes there) block by block,
    /// growing `run` with the blocks that differ and sending it when a block matches
    /// or it is one `CHUNK` long.
    fn send_differing_blocks(
        &mut self,
        rel: &str,
        run: &mut Run,
        pos: u64,
        new: &[u8],
        old: &[u8],
    ) -> Result<(), Status> {
        let n = new.len();
        for b in (0..n).step_by(BLOCK) {
            let e = (b + BLOCK).min(n);
            if old.get(b..e).is_some_and(|o| same_bytes(o, &new[b..e])) {
                self.flush_run(rel, run)?;
                continue;
            }
            if run.data.is_empty() {
                run.at = pos + b as u64;
            }
            run.data.extend_from_slice(&new[b..e]);
            if run.data.len() >= transfer::CHUNK {
                self.flush_run(rel, run)?;
            }
        }
        Ok(())
    }

    /// Sends the run of differing blocks, if any, and starts an empty one.
    fn flush_run(&mut self, rel: &str, run: &mut Run) -> Result<(), Status> {
        if run.data.is_empty() {
            return Ok(());
        }
        let data = std::mem::replace(&mut run.data, Run::new().data);
        self.bytes += data.len() as u64;
        self.send_sealed(rel, run.at, data, false, "")
    }

    /// The final chunk: it authenticates the count of chunks before it.
    fn finish(&mut self) -> Result<(), Status> {
        let seq = self.seq;
        let sealed = self.sealer.seal(seq, "", 0, true, &seq.to_be_bytes());
        self.send(ImageChunk {
            migration_uid: self.uid.into(),
            seq,
            path: String::new(),
            offset: 0,
            sealed,
            end: true,
            symlink: false,
            base: String::new(),
            stream_id: self.header(),
        })
    }
}

fn pre_round(rel: &str) -> u32 {
    rel.strip_prefix("pre-")
        .and_then(|r| r.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

pub(super) fn collect(
    root: &Path,
    dir: &Path,
    out: &mut Vec<(String, bool)>,
) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let ft = e.file_type()?;
        let rel = e
            .path()
            .strip_prefix(root)
            .expect("under root")
            .to_string_lossy()
            .into_owned();
        // Logs, and the agent's own CRIU configuration (`lazy::ps_socket_config`),
        // stay on this node.
        if rel.ends_with(".log") || rel.ends_with(".conf") {
            continue;
        }
        if ft.is_dir() {
            collect(root, &e.path(), out)?;
        } else if ft.is_symlink() {
            out.push((rel, true));
        } else if ft.is_file() {
            out.push((rel, false));
        }
    }
    Ok(())
}

/// Whether `a` and `b` hold the same bytes, compared a word at a time (vectorized).
/// Not `==` on the slices: that is libc's `memcmp`, which in the shipped images is
/// musl's, a byte at a time, and a delta compares the whole warm copy inside the
/// freeze (12% of the agents' CPU in a 512 MiB migration, measured with `perf`).
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    const LANES: usize = 8;
    const STRIDE: usize = LANES * 8;
    if a.len() != b.len() {
        return false;
    }
    let (xs, ys) = (a.chunks_exact(STRIDE), b.chunks_exact(STRIDE));
    let (xr, yr) = (xs.remainder(), ys.remainder());
    for (x, y) in xs.zip(ys) {
        let mut diff = 0u64;
        for i in 0..LANES {
            let w = |s: &[u8]| u64::from_ne_bytes(s[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            diff |= w(x) ^ w(y);
        }
        if diff != 0 {
            return false;
        }
    }
    xr.iter().zip(yr).all(|(x, y)| x == y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_compare_equal_only_when_every_byte_is() {
        let a: Vec<u8> = (0..BLOCK + 77).map(|i| (i * 31 % 251) as u8).collect();
        // Another buffer with the same bytes (not the same memory).
        let same = a.clone();
        for len in [0, 1, 63, 64, 65, 200, BLOCK, BLOCK + 77] {
            let x = &a[..len];
            assert!(same_bytes(x, &same[..len]), "len {len}");
            for at in [0, len / 2, len.saturating_sub(1)] {
                if len == 0 {
                    continue;
                }
                let mut y = x.to_vec();
                y[at] ^= 0x80;
                assert!(!same_bytes(x, &y), "len {len}, differing at {at}");
            }
        }
        assert!(!same_bytes(&a[..64], &a[..65]));
    }

    fn set(paths: &[&str]) -> BTreeSet<String> {
        paths.iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn rounds_go_in_order_and_the_manifest_last() {
        let mut rels = vec![
            "manifest.json",
            "final/pages-1.img",
            "pre-10/pages-1.img",
            "pre-2/parent",
            "pre-2/pages-1.img",
            "pre-1/pages-1.img",
        ];
        rels.sort_by_key(|r| send_order(r));
        assert_eq!(
            rels,
            [
                "pre-1/pages-1.img",
                "pre-2/pages-1.img",
                "pre-2/parent",
                "pre-10/pages-1.img",
                "final/pages-1.img",
                "manifest.json",
            ]
        );
    }

    #[test]
    fn the_delta_base_is_the_namesake_in_the_newest_warm_copy_the_target_holds() {
        let already = set(&["pre-1/pages-1.img", "pre-2/pages-1.img", "pre-10/core.img"]);
        let base = newest_warm_copy(&already);
        assert_eq!(base.as_deref(), Some("pre-10"));
        assert_eq!(newest_warm_copy(&set(&["manifest.json"])), None);
        // pre-10 holds no pages-1.img: no delta.
        assert_eq!(
            delta_base(base.as_deref(), "final/pages-1.img", &already, true),
            None
        );
        assert_eq!(
            delta_base(Some("pre-2"), "final/pages-1.img", &already, true).as_deref(),
            Some("pre-2/pages-1.img")
        );
        assert_eq!(
            delta_base(Some("pre-2"), "pre-3/pages-1.img", &already, true).as_deref(),
            Some("pre-2/pages-1.img")
        );
        // Not asked for, or not an image of a later round: whole.
        assert_eq!(
            delta_base(Some("pre-2"), "final/pages-1.img", &already, false),
            None
        );
        assert_eq!(
            delta_base(
                Some("pre-2"),
                "pages-1.img",
                &set(&["pre-2/pages-1.img"]),
                true
            ),
            None
        );
        assert_eq!(delta_base(None, "final/pages-1.img", &already, true), None);
    }

    #[test]
    fn a_stream_that_fails_reports_the_targets_reason_over_a_closed_stream() {
        let summary = |bytes| Ok(ReceiveSummary { files: 1, bytes });
        let refused = || Err(Status::permission_denied("not the peer"));
        let closed = Err::<u64, _>(Status::aborted(TARGET_CLOSED));
        let e = stream_outcome(closed, refused()).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        let e = stream_outcome(Err::<u64, _>(Status::internal("disk")), refused()).unwrap_err();
        assert_eq!(e.message(), "disk");
        let closed = Err::<u64, _>(Status::aborted(TARGET_CLOSED));
        let e = stream_outcome(closed, summary(0)).unwrap_err();
        assert_eq!(e.message(), TARGET_CLOSED);
        let e = stream_outcome(Ok(7u64), refused()).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        let (p, s) = stream_outcome(Ok(7u64), summary(7)).unwrap();
        assert_eq!((p, s.bytes), (7, 7));
    }
}
