//! Work inside the target's network namespace from a dedicated OS thread.
//!
//! A socket belongs to the network namespace of the thread that created it, for its
//! whole life. So listeners, dials and the nftables netlink socket are created by a
//! dedicated thread (never a tokio worker) that `setns(2)`es into the target's
//! namespace, creates the socket, and `setns`es back to the agent's own namespace.
//! If the way back fails, the thread is retired — it hands the job queue to a fresh
//! thread and exits — so no later job can run in a namespace it did not ask for. The
//! namespace fds are opened once per agent and reused: the target fd pins the
//! namespace even if the target's PID is reused later.

use nix::sched::{CloneFlags, setns};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::{Arc, Mutex, mpsc};

/// A job runs inside the namespace and returns its reply, which is sent only after
/// the thread has tried to restore itself.
type Job = Box<dyn FnOnce(std::io::Result<()>) -> Reply + Send>;
type Reply = Box<dyn FnOnce() + Send>;

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("opening network namespace {path}: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("entering the target network namespace: {0}")]
    Enter(std::io::Error),
    #[error("{0}")]
    Op(std::io::Error),
    #[error("namespace worker thread died")]
    WorkerGone,
}

struct Shared {
    target: OwnedFd,
    restore: OwnedFd,
}

pub struct NetnsExecutor {
    shared: Arc<Shared>,
    worker: Mutex<Option<mpsc::Sender<Job>>>,
}

impl NetnsExecutor {
    /// `target` is e.g. `/proc/<pid>/ns/net`; the agent's own namespace is taken from
    /// `/proc/thread-self/ns/net` of the calling thread.
    pub fn open(target: &Path) -> Result<Self, NetnsError> {
        let restore = open_ns(Path::new("/proc/thread-self/ns/net"))?;
        Self::with_restore(target, restore)
    }

    /// Test hook: restore into an arbitrary fd (a non-namespace fd makes every
    /// restore fail, which proves retired threads are not reused).
    #[doc(hidden)]
    pub fn with_restore(target: &Path, restore: OwnedFd) -> Result<Self, NetnsError> {
        let target = open_ns(target)?;
        Ok(NetnsExecutor {
            shared: Arc::new(Shared { target, restore }),
            worker: Mutex::new(None),
        })
    }

    fn spawn_worker(shared: Arc<Shared>) -> mpsc::Sender<Job> {
        let (tx, rx) = mpsc::channel::<Job>();
        Self::spawn_thread(shared, rx);
        tx
    }

    /// One worker thread serving the queue. When its way back fails it hands the
    /// queue to a fresh thread and exits, so queued jobs are never lost and never
    /// run on the thread that is stuck in the wrong namespace.
    fn spawn_thread(shared: Arc<Shared>, rx: mpsc::Receiver<Job>) {
        std::thread::Builder::new()
            .name("netns-worker".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    let entered = setns(&shared.target, CloneFlags::CLONE_NEWNET)
                        .map_err(std::io::Error::from);
                    let was_entered = entered.is_ok();
                    let reply = job(entered);
                    if was_entered
                        && let Err(e) = setns(&shared.restore, CloneFlags::CLONE_NEWNET)
                    {
                        tracing::error!(error = %e, "restoring the agent's network namespace failed; retiring the thread");
                        Self::spawn_thread(shared, rx);
                        reply();
                        return;
                    }
                    reply();
                }
            })
            .expect("spawning netns worker thread");
    }

    /// Hands a job to the worker, replacing a retired worker once: a retired thread
    /// has dropped its receiver, so the send fails and the job comes back to be given
    /// to a fresh thread.
    fn submit(&self, mut job: Job) -> Result<(), NetnsError> {
        let mut guard = self.worker.lock().expect("netns worker lock");
        for _ in 0..2 {
            let tx = guard.get_or_insert_with(|| Self::spawn_worker(self.shared.clone()));
            match tx.send(job) {
                Ok(()) => return Ok(()),
                Err(mpsc::SendError(back)) => {
                    job = back;
                    *guard = None;
                }
            }
        }
        Err(NetnsError::WorkerGone)
    }

    fn job<T, F>(f: F, reply: impl FnOnce(Result<T, NetnsError>) + Send + 'static) -> Job
    where
        T: Send + 'static,
        F: FnOnce() -> std::io::Result<T> + Send + 'static,
    {
        Box::new(move |entered| {
            let r = match entered {
                Ok(()) => f().map_err(NetnsError::Op),
                Err(e) => Err(NetnsError::Enter(e)),
            };
            Box::new(move || reply(r))
        })
    }

    /// Runs `f` on the worker thread while it is inside the target namespace.
    pub async fn run<T, F>(&self, f: F) -> Result<T, NetnsError>
    where
        T: Send + 'static,
        F: FnOnce() -> std::io::Result<T> + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(Self::job(f, move |r| {
            let _ = tx.send(r);
        }))?;
        rx.await.map_err(|_| NetnsError::WorkerGone)?
    }

    /// Blocking variant for code that is not on a runtime.
    pub fn run_blocking<T, F>(&self, f: F) -> Result<T, NetnsError>
    where
        T: Send + 'static,
        F: FnOnce() -> std::io::Result<T> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        self.submit(Self::job(f, move |r| {
            let _ = tx.send(r);
        }))?;
        rx.recv().map_err(|_| NetnsError::WorkerGone)?
    }
}

fn open_ns(path: &Path) -> Result<OwnedFd, NetnsError> {
    std::fs::File::open(path)
        .map(OwnedFd::from)
        .map_err(|source| NetnsError::Open {
            path: path.display().to_string(),
            source,
        })
}

/// Inode of a namespace link (`/proc/<pid>/ns/<kind>`): equal inodes, same namespace.
pub fn ns_inode(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(std::fs::metadata(path)?.ino())
}
