//! PostCopy on the target, above the migration's state: the session the source opens
//! (the daemon started on it, the source's pages carried to the daemon) and the daemon
//! watched after the restore. A lost source, or a daemon that fails, kills the
//! restored copy.

use super::super::helpers::blocking;
use super::super::manifest::final_images;
use super::super::state::Migration;
use super::{FRAME, FrameStream, Incoming, Outgoing, PAGES, REQUESTS, Target, spawn_daemon};
use crate::criu::{self, Criu};
use crate::lazy::Requests;
use podmotion_broker::procfs;
use podmotion_wire::agent::LazyFrame;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex as StdMutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Mutex;
use tokio::sync::mpsc::Sender;
use tonic::Status;

/// Opens the target's side of a session (the caller admitted it): a socket pair whose
/// one end the daemon's (started here, see [`spawn_daemon`]), the other carried here
/// until either side ends.
/// Returns the stream of the daemon's requests, sealed.
pub(crate) fn accept_session(
    criu: &Criu,
    m: &mut Migration,
    mm: Arc<Mutex<Migration>>,
    first: LazyFrame,
    rest: tonic::Streaming<LazyFrame>,
) -> Result<FrameStream, Status> {
    let (target, reader, writer) = start_session(criu, m)?;
    m.lazy_target = Some(Arc::clone(&target));
    let uid = m.uid.to_string();
    let out = Outgoing::new(&m.key, &uid, REQUESTS)?;
    let opened = Incoming::new(&m.key, &uid, PAGES);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<LazyFrame, Status>>(8);
    // The daemon's requests, sealed, down the answer stream.
    tokio::spawn(send_requests(reader, out, tx, Arc::clone(&target)));
    // The source's pages, opened, to the daemon; then how the session ended.
    tokio::spawn(carry_pages(first, rest, opened, writer, target, mm));
    let stream =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
    Ok(Box::pin(stream))
}

/// The session's target and the two ends of its socket the carriers take: the daemon
/// on the other end, started on the final images.
fn start_session(
    criu: &Criu,
    m: &Migration,
) -> Result<(Arc<Target>, OwnedReadHalf, OwnedWriteHalf), Status> {
    let dir = final_images(&m.dir)?;
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| Status::internal(format!("lazy-pages socket: {e}")))?;
    // The daemon starts now, on the final images, while the source is frozen but
    // before `Restore` is asked for: its start (CRIU's kernel-feature probe, ≈ 50 ms)
    // is then mostly over when the restore needs it.
    let daemon = spawn_daemon(criu, &dir, OwnedFd::from(theirs))?;
    ours.set_nonblocking(true)
        .map_err(|e| Status::internal(e.to_string()))?;
    let (reader, writer) = tokio::net::UnixStream::from_std(ours)
        .map_err(|e| Status::internal(e.to_string()))?
        .into_split();
    let target = Arc::new(Target {
        state: Arc::default(),
        daemon: StdMutex::new(Some(daemon)),
        requests: StdMutex::new(Requests::default()),
    });
    Ok((target, reader, writer))
}

/// The daemon's requests, sealed, down the answer stream, until either ends.
async fn send_requests(
    mut reader: OwnedReadHalf,
    mut out: Outgoing,
    tx: Sender<Result<LazyFrame, Status>>,
    t: Arc<Target>,
) {
    let mut buf = vec![0u8; FRAME];
    loop {
        let n = match reader.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let _ = t.requests.lock().expect("requests").take(&buf[..n]);
        if tx.send(Ok(out.frame(&buf[..n]))).await.is_err() {
            break;
        }
    }
}

/// The source's pages, opened, to the daemon; then how the session ended: a source
/// lost before the daemon asked for the end kills the restored copy.
async fn carry_pages(
    first: LazyFrame,
    mut rest: tonic::Streaming<LazyFrame>,
    mut opened: Incoming,
    mut writer: OwnedWriteHalf,
    target: Arc<Target>,
    mm: Arc<Mutex<Migration>>,
) {
    let carried = async {
        let mut next = Some(first);
        loop {
            let f = match next.take() {
                Some(f) => f,
                None => match rest.message().await.map_err(|e| e.message().to_owned())? {
                    Some(f) => f,
                    None => return Ok::<(), String>(()),
                },
            };
            let plain = opened.open(f)?;
            writer.write_all(&plain).await.map_err(|e| e.to_string())?;
            target
                .state
                .bytes
                .fetch_add(plain.len() as u64, Ordering::SeqCst);
        }
    }
    .await;
    if target.requests.lock().expect("requests").closed() {
        // The daemon asked for the end: its own exit says how it went
        // ([`watch_daemon`]).
        return;
    }
    // The source is lost: the copy dies before the daemon learns it (dropping
    // `writer` tells it).
    let why = carried
        .err()
        .unwrap_or_else(|| "the source ended the session early".into());
    let mut m = mm.lock().await;
    target.state.fail(format!(
        "the source was lost during PostCopy's lazy phase ({why}): the restored copy was killed, the pod is lost"
    ));
    if let Err(e) = m.kill_restored_copy().await {
        tracing::error!(uid = %m.uid, error = %e.message(), "PostCopy: the restored copy could not be confirmed killed");
    }
    drop(writer);
    tracing::warn!(uid = %m.uid, error = %target.state.error(), "PostCopy: lazy phase failed on the target");
}

/// Watches the target's daemon after a restore: its good exit ends the lazy phase
/// (the images are then zeroized); a bad one kills the restored copy first.
pub(crate) fn watch_daemon(
    mut child: std::process::Child,
    target: Arc<Target>,
    mm: Arc<Mutex<Migration>>,
    dir: PathBuf,
) {
    tokio::spawn(async move {
        let st = blocking(move || child.wait().map_err(|e| Status::internal(e.to_string()))).await;
        let mut m = mm.lock().await;
        match st {
            // The daemon also ends well when every process it served exited (an abort
            // killed the copy, or the workload ended): done only with the copy alive.
            Ok(s) if s.success() && m.restored.is_some_and(|p| procfs::check_live(p).is_ok()) => {
                target.state.finish();
                tracing::info!(uid = %m.uid, bytes = target.state.bytes(), "PostCopy: every page is in");
            }
            Ok(s) if s.success() => {
                target.state.fail(
                    "the restored copy ended before every page came in (aborted, or the workload exited)".into(),
                );
            }
            other => {
                let why = match other {
                    Ok(s) => format!(
                        "criu lazy-pages exited ({s}): {}",
                        criu::log_tail(&dir.join("lazy.log"))
                    ),
                    Err(e) => e.message().to_owned(),
                };
                target.state.fail(format!(
                    "the lazy phase failed ({why}): the restored copy was killed, the pod is lost"
                ));
                if let Err(e) = m.kill_restored_copy().await {
                    tracing::error!(uid = %m.uid, error = %e.message(), "PostCopy: the restored copy could not be confirmed killed");
                }
                tracing::warn!(uid = %m.uid, error = %target.state.error(), "PostCopy: lazy phase failed on the target");
            }
        }
        let _ = crate::images::zeroize(&m.dir);
        m.image_bytes = 0;
    });
}
