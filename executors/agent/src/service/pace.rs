//! The pacing of every stream the agent sends (the images, PostCopy's pages).

use std::time::Instant;

/// The PodMigration's bandwidth limit: the stream never runs ahead of `limit` bytes
/// per second since it started (0 = unlimited).
pub(super) struct Pace {
    limit: u64,
    started: Instant,
    sent: std::sync::atomic::AtomicU64,
}

impl Pace {
    pub(super) fn new(limit: u64) -> Pace {
        Pace {
            limit,
            started: Instant::now(),
            sent: Default::default(),
        }
    }

    /// Charges `bytes` that are about to go out: how long to wait before they may
    /// (`None`: at once). The one pacing rule of every stream the agent sends, the
    /// images' (blocking, [`Pace::wait`]) and PostCopy's pages (async).
    pub(super) fn ahead(&self, bytes: u64) -> Option<std::time::Duration> {
        if self.limit == 0 {
            return None;
        }
        let before = self
            .sent
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        let due = std::time::Duration::from_secs_f64(before as f64 / self.limit as f64);
        due.checked_sub(self.started.elapsed())
            .filter(|d| !d.is_zero())
    }

    /// Blocks until `bytes` more may go out.
    pub(super) fn wait(&self, bytes: u64) {
        if let Some(ahead) = self.ahead(bytes) {
            std::thread::sleep(ahead);
        }
    }
}
