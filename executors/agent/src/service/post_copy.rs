//! PostCopy on the agents (see [`crate::lazy`] for CRIU's side): the source's lazy dump
//! and its page-serving session, the target's `criu lazy-pages` daemon, and the
//! `LazyPages` stream between them — two sealed byte streams, the page server's answers
//! up, the target's requests down, every request checked on the source
//! ([`Requests`]).
//!
//! Who ends what:
//! - the target's daemon ends the session when every page is in (a close request): the
//!   source's CRIU returns, the tree stays stopped for `Commit`, and both sides record
//!   `lazy_done`;
//! - a session that breaks before that, on the target: the restored copy is killed
//!   *before* the daemon is told (its missing pages would read as zeros), and
//!   `lazy_error` says the pod is lost; on the source: the agent ends the session
//!   cleanly itself, so the tree stays stopped (and fenced, if it was) for the
//!   operator's `Abort` or the freeze watchdog, as after a Cold dump (CRIU resumes the
//!   tree of a session that fails: the agent never lets one fail while it runs);
//! - a thaw (an `Abort`, the freeze watchdog, shutdown) ends the session cleanly first
//!   ([`Source::end`]); the freeze watchdog never kills a source that still serves
//!   pages.

use super::pace::Pace;
use crate::criu::{self, Criu, Opts, Req};
use crate::lazy::{self, Requests};
use podmotion_wire::agent::LazyFrame;
use podmotion_wire::proto::migration_agent_client::MigrationAgentClient;
use podmotion_wire::transfer::{self, Sealer};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Mutex;
use tonic::Status;
use tonic::transport::Channel;

pub(super) mod target;

/// The sealed direction of the target's page requests.
const REQUESTS: &str = "lazy/requests";
/// The sealed direction of the source's answers (the pages).
const PAGES: &str = "lazy/pages";
/// Largest piece of one direction in one frame.
const FRAME: usize = 1 << 20;
/// How long a clean end of a session may take to reach CRIU's return.
const END_WAIT: Duration = Duration::from_secs(30);

/// The lazy phase as one side sees it (shared with the tasks that carry it).
#[derive(Debug, Default)]
pub(super) struct LazyState {
    done: AtomicBool,
    /// Page bytes sent (source) or received (target).
    bytes: AtomicU64,
    error: StdMutex<String>,
}

impl LazyState {
    pub(super) fn done(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }
    pub(super) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::SeqCst)
    }
    pub(super) fn error(&self) -> String {
        self.error.lock().expect("lazy error").clone()
    }
    fn finish(&self) {
        if self.error().is_empty() {
            self.done.store(true, Ordering::SeqCst);
        }
    }
    /// Records why the lazy phase failed (the first reason stays).
    fn fail(&self, why: String) {
        let mut e = self.error.lock().expect("lazy error");
        if e.is_empty() {
            *e = why;
        }
    }
}

/// The dump's end, once CRIU returned.
type Outcome = Option<Result<(), String>>;

/// A lazy dump on the source: CRIU serving the frozen tree's pages on its socket.
pub(crate) struct Source {
    pub(super) state: Arc<LazyState>,
    /// The filter and the write end of CRIU's socket, together: every write to CRIU
    /// passes here, so the end of a session lands between whole requests.
    writer: Mutex<(Requests, Option<OwnedWriteHalf>)>,
    /// CRIU's answers, until the session's carrier takes them.
    reader: StdMutex<Option<OwnedReadHalf>>,
    outcome: tokio::sync::watch::Receiver<Outcome>,
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source")
            .field("state", &self.state)
            .field("serving", &self.serving())
            .finish()
    }
}

impl Source {
    /// Runs the final dump lazily (`opts` as the final dump's; `dir` its images) and
    /// returns once every image but the lazy pages is written. An error before that is
    /// a failed dump: CRIU resumed the tree.
    pub(super) async fn dump(
        criu: Criu,
        mut opts: Opts,
        dir: &Path,
        log: PathBuf,
    ) -> Result<Arc<Source>, Status> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| Status::internal(format!("lazy-pages socket: {e}")))?;
        let conf = lazy::ps_socket_config(dir)
            .map_err(|e| Status::internal(format!("lazy-pages configuration: {e}")))?;
        opts.lazy_pages = Some(true);
        opts.config_file = Some(conf.to_string_lossy().into_owned());
        let (written_rx, mut outcome) = spawn_lazy_dump(criu, opts, log, theirs);
        if written_rx.await.is_err() {
            // CRIU returned before the images were written: its answer says why.
            let _ = outcome.wait_for(Option::is_some).await;
            let why = outcome.borrow().clone().and_then(Result::err);
            return Err(Status::internal(why.unwrap_or_else(|| {
                "criu dump ended before its images were written".into()
            })));
        }
        // Serving now: on the socket the agent gave it, never on a TCP port of the node
        // (a CRIU that ignored `ps-socket 0` would serve the frozen tree's memory to
        // whoever connects). Checked before a byte is served; a listener ends the
        // session at once (the dump then fails and CRIU resumes the tree, the migration
        // rolls back).
        let listeners: Vec<(u32, Vec<u16>)> = lazy::criu_children()
            .into_iter()
            .map(|pid| (pid, lazy::tcp_listen_ports(pid).unwrap_or_default()))
            .filter(|(_, ports)| !ports.is_empty())
            .collect();
        if !listeners.is_empty() {
            drop(ours);
            let _ = tokio::time::timeout(END_WAIT, outcome.wait_for(Option::is_some)).await;
            return Err(Status::internal(format!(
                "criu's lazy page server listens on TCP ({listeners:?}: pid, ports) instead                  of the agent's socket: refused, the dump is ended and the tree resumed                  (this CRIU ignores `ps-socket` in its configuration file)"
            )));
        }
        ours.set_nonblocking(true)
            .map_err(|e| Status::internal(e.to_string()))?;
        let (r, w) = tokio::net::UnixStream::from_std(ours)
            .map_err(|e| Status::internal(e.to_string()))?
            .into_split();
        Ok(Arc::new(Source {
            state: Arc::default(),
            writer: Mutex::new((Requests::default(), Some(w))),
            reader: StdMutex::new(Some(r)),
            outcome,
        }))
    }

    /// CRIU still serves (its dump has not returned).
    pub(super) fn serving(&self) -> bool {
        self.outcome.borrow().is_none()
    }

    /// Ends the session where the requests passed on so far end, if it still runs,
    /// and waits for CRIU's dump to return: the tree is then left stopped, as after a
    /// Cold dump. `Ok` once CRIU returned and no longer holds the tree; a CRIU that
    /// returned a failure (it then resumed the tree itself) is recorded in the state.
    /// `Err` only while CRIU still holds it.
    pub(super) async fn end(&self) -> Result<(), String> {
        {
            let mut w = self.writer.lock().await;
            let (requests, writer) = &mut *w;
            if let (Some(close), Some(writer)) = (requests.close_now(), writer.as_mut()) {
                let _ = writer.write_all(&close).await;
            }
        }
        match self.returned().await {
            Ok(()) => Ok(()),
            Err(e) if self.serving() => Err(e),
            Err(e) => {
                self.state.fail(format!("criu's lazy dump failed: {e}"));
                Ok(())
            }
        }
    }

    /// Waits (bounded) for CRIU's dump to return; its outcome.
    async fn returned(&self) -> Result<(), String> {
        let mut o = self.outcome.clone();
        match tokio::time::timeout(END_WAIT, o.wait_for(Option::is_some)).await {
            Ok(Ok(v)) => v.clone().expect("some"),
            Ok(Err(_)) => Err("criu's dump went away".into()),
            Err(_) => Err(format!(
                "criu's lazy dump did not return within {END_WAIT:?} of the session's end"
            )),
        }
    }
}

/// Starts CRIU's lazy dump on a blocking thread, on `theirs` (its end of the session's
/// socket): told once every image but the lazy pages is written (its `post-dump`
/// notification), and watched for its return.
fn spawn_lazy_dump(
    criu: Criu,
    opts: Opts,
    log: PathBuf,
    theirs: std::os::unix::net::UnixStream,
) -> (
    tokio::sync::oneshot::Receiver<()>,
    tokio::sync::watch::Receiver<Outcome>,
) {
    let (written_tx, written_rx) = tokio::sync::oneshot::channel();
    let (outcome_tx, outcome) = tokio::sync::watch::channel::<Outcome>(None);
    tokio::task::spawn_blocking(move || {
        let mut written_tx = Some(written_tx);
        let mut told = |script: &str| {
            if script == "post-dump"
                && let Some(tx) = written_tx.take()
            {
                let _ = tx.send(());
            }
        };
        let r = criu.call_notified(
            Req {
                r#type: criu::REQ_DUMP,
                opts: Some(opts),
            },
            Some(&log),
            Some(OwnedFd::from(theirs)),
            &mut told,
        );
        let _ = outcome_tx.send(Some(r.map(|_| ()).map_err(|e| e.to_string())));
    });
    (written_rx, outcome)
}

/// Seals one direction of a session.
struct Outgoing {
    uid: String,
    sealer: Sealer,
    path: &'static str,
    seq: u64,
    offset: u64,
}

impl Outgoing {
    fn new(key: &[u8], uid: &str, path: &'static str) -> Result<Self, Status> {
        let id: [u8; transfer::STREAM_ID_LEN] = rand::random();
        Ok(Outgoing {
            uid: uid.to_owned(),
            sealer: Sealer::new(key, uid, &id).map_err(|e| Status::internal(e.to_string()))?,
            path,
            seq: 0,
            offset: 0,
        })
    }

    fn frame(&mut self, plain: &[u8]) -> LazyFrame {
        let sealed = self
            .sealer
            .seal(self.seq, self.path, self.offset, false, plain);
        let f = LazyFrame {
            migration_uid: self.uid.clone(),
            seq: self.seq,
            sealed,
            stream_id: if self.seq == 0 {
                self.sealer.stream_id().to_vec()
            } else {
                vec![]
            },
        };
        self.seq += 1;
        self.offset += plain.len() as u64;
        f
    }
}

/// Opens the other direction of a session.
struct Incoming {
    key: Vec<u8>,
    uid: String,
    path: &'static str,
    opener: Option<Sealer>,
    seq: u64,
    offset: u64,
}

impl Incoming {
    fn new(key: &[u8], uid: &str, path: &'static str) -> Self {
        Incoming {
            key: key.to_vec(),
            uid: uid.to_owned(),
            path,
            opener: None,
            seq: 0,
            offset: 0,
        }
    }

    fn open(&mut self, f: LazyFrame) -> Result<Vec<u8>, String> {
        if f.migration_uid != self.uid {
            return Err("a frame of another migration".into());
        }
        if f.seq != self.seq {
            return Err(format!("frame {} where {} was due", f.seq, self.seq));
        }
        if self.opener.is_none() {
            let s = Sealer::new(&self.key, &self.uid, &f.stream_id).map_err(|e| e.to_string())?;
            self.opener = Some(s);
        }
        let plain = self
            .opener
            .as_ref()
            .expect("opener")
            .open(f.seq, self.path, self.offset, false, &f.sealed)
            .map_err(|e| e.to_string())?;
        self.seq += 1;
        self.offset += plain.len() as u64;
        Ok(plain)
    }
}

/// The source's side of the session, from the end of its final `Send`: opens
/// `LazyPages` on the target and carries the session until it ends, then records how
/// (see the module's rules). Runs in a task of its own.
pub(super) async fn serve_pages(
    channel: Channel,
    src: Arc<Source>,
    uid: String,
    key: Vec<u8>,
    bandwidth_limit: u64,
) {
    let outcome = carry_source(channel, &src, &uid, &key, bandwidth_limit).await;
    let clean = src.writer.lock().await.0.closed() && outcome.is_ok();
    if clean {
        match src.returned().await {
            Ok(()) => {
                src.state.finish();
                tracing::info!(%uid, bytes = src.state.bytes(), "PostCopy: every page served; the source stays stopped for the commit");
            }
            Err(e) => src
                .state
                .fail(format!("the source's page server ended badly: {e}")),
        }
        return;
    }
    // Broken (the target aborted and killed its copy, or it, its agent or the link
    // went away): the session ends cleanly here, so the tree stays stopped and, if
    // fenced, fenced — the operator's `Abort` resumes it once the target's copy is
    // confirmed killed, the freeze watchdog kills it otherwise, as after a Cold dump.
    let why = outcome
        .err()
        .unwrap_or_else(|| "the session ended early".into());
    let ended = src.end().await;
    src.state.fail(format!(
        "the lazy-pages session broke ({why}); the source stays stopped{}",
        ended.err().map(|e| format!(" ({e})")).unwrap_or_default()
    ));
    tracing::warn!(%uid, error = %src.state.error(), "PostCopy: lazy phase failed on the source");
}

/// Carries one session on the source: CRIU's answers up, sealed and paced; the
/// target's requests down, opened and filtered. Ends when either side ends.
async fn carry_source(
    channel: Channel,
    src: &Source,
    uid: &str,
    key: &[u8],
    bandwidth_limit: u64,
) -> Result<(), String> {
    let reader = src
        .reader
        .lock()
        .expect("reader")
        .take()
        .ok_or("the session was already carried")?;
    let mut out = Outgoing::new(key, uid, PAGES).map_err(|e| e.message().to_owned())?;
    let (tx, rx) = tokio::sync::mpsc::channel::<LazyFrame>(8);
    let up = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
    let mut client = MigrationAgentClient::new(channel)
        .max_encoding_message_size(4 << 20)
        .max_decoding_message_size(4 << 20);
    // The first frame opens the call: the target admits it on it.
    tx.send(out.frame(&[])).await.map_err(|_| "stream closed")?;
    let call = client.lazy_pages(up);
    let pages = send_pages(reader, out, tx, bandwidth_limit, Arc::clone(&src.state));
    let requests = async {
        let mut down = call.await.map_err(|e| e.message().to_owned())?.into_inner();
        let mut opened = Incoming::new(key, uid, REQUESTS);
        while let Some(f) = down.message().await.map_err(|e| e.message().to_owned())? {
            let plain = opened.open(f)?;
            let mut w = src.writer.lock().await;
            let (requests, writer) = &mut *w;
            let pass = requests.take(&plain).map_err(|e| e.to_string())?;
            let writer = writer.as_mut().ok_or("the session was cut")?;
            writer.write_all(&pass).await.map_err(|e| e.to_string())?;
            if requests.closed() {
                return Ok(());
            }
        }
        Err("the target ended the session without closing it".to_string())
    };
    // The answers end when CRIU closes its socket (after the close); the requests end
    // at the close. Either erring ends both.
    let (a, b) = tokio::join!(pages, requests);
    b.and(a)
}

/// CRIU's answers up, sealed and paced, until CRIU closes its socket.
async fn send_pages(
    mut reader: OwnedReadHalf,
    mut out: Outgoing,
    tx: tokio::sync::mpsc::Sender<LazyFrame>,
    bandwidth_limit: u64,
    state: Arc<LazyState>,
) -> Result<(), String> {
    let pace = Pace::new(bandwidth_limit);
    let mut buf = vec![0u8; FRAME];
    loop {
        let n = reader.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Ok::<(), String>(());
        }
        if let Some(wait) = pace.ahead(n as u64) {
            tokio::time::sleep(wait).await;
        }
        tx.send(out.frame(&buf[..n]))
            .await
            .map_err(|_| "the target closed the session".to_string())?;
        state.bytes.fetch_add(n as u64, Ordering::SeqCst);
    }
}

/// The target's side: the daemon's end of its socket until `Restore` starts it, and
/// what the lazy phase came to.
pub(super) struct Target {
    pub(super) state: Arc<LazyState>,
    /// `criu lazy-pages`, started when the session opened (its start is then not part
    /// of the freeze), until `Restore` takes it; killed with the target otherwise.
    daemon: StdMutex<Option<std::process::Child>>,
    /// The daemon's requests, parsed to tell a clean end from a cut session.
    requests: StdMutex<Requests>,
}

impl Target {
    /// The daemon, once (`Restore` restores lazily on it, then watches it).
    pub(super) fn take_daemon(&self) -> Option<std::process::Child> {
        self.daemon.lock().expect("daemon").take()
    }

    /// Kills a daemon no restore took (an abort or a cleanup before the restore).
    pub(super) fn stop_daemon(&self) {
        if let Some(mut d) = self.take_daemon() {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.stop_daemon();
    }
}

/// The stream of frames the target answers `LazyPages` with.
pub(super) type FrameStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<LazyFrame, Status>> + Send>>;

/// Starts the target's `criu lazy-pages` for the images in `dir` on the session's
/// socket (without waiting: [`daemon_listening`] does, at the restore).
fn spawn_daemon(criu: &Criu, dir: &Path, socket: OwnedFd) -> Result<std::process::Child, Status> {
    lazy::daemon_command(&criu.binary, dir, "lazy.log")
        .stdin(socket)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| Status::internal(format!("criu lazy-pages: {e}")))
}

/// Waits (5 s at most) for the daemon started with the session to listen for the
/// restored processes; a daemon that exited instead is reported with its log.
pub(super) async fn daemon_listening(
    mut child: std::process::Child,
    dir: &Path,
) -> Result<std::process::Child, Status> {
    let sock = dir.join("lazy-pages.socket");
    for _ in 0..500 {
        if sock.exists() {
            return Ok(child);
        }
        if let Ok(Some(st)) = child.try_wait() {
            return Err(Status::internal(format!(
                "criu lazy-pages exited ({st}): {}",
                criu::log_tail(&dir.join("lazy.log"))
            )));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    Err(Status::internal("criu lazy-pages did not start listening"))
}
