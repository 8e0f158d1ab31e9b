//! The pacing of every stream the agent sends (the images, PostCopy's pages).

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How far behind its schedule a stream may fall and then catch up at full speed: a
/// stream idle for a while (PostCopy's pages wait for the restore to ask for them) may
/// send this much of its limit at once, never more.
const BURST: Duration = Duration::from_millis(100);

/// The PodMigration's bandwidth limit: the stream never runs ahead of `limit` bytes
/// per second, allowing a burst of [`BURST`] of it after an idle spell (0 =
/// unlimited).
pub(super) struct Pace {
    limit: u64,
    /// When the bytes charged so far have been paid for at `limit`.
    paid: Mutex<Instant>,
}

impl Pace {
    pub(super) fn new(limit: u64) -> Pace {
        Pace {
            limit,
            paid: Mutex::new(Instant::now()),
        }
    }

    /// Charges `bytes` that are about to go out: how long to wait before they may
    /// (`None`: at once). The one pacing rule of every stream the agent sends, the
    /// images' (blocking, [`Pace::wait`]) and PostCopy's pages (async).
    pub(super) fn ahead(&self, bytes: u64) -> Option<Duration> {
        self.charge(bytes, Instant::now())
    }

    /// [`Pace::ahead`] at `now`: the bytes go out once those before them are paid
    /// for, and a schedule left behind by an idle spell is caught up to `now − BURST`
    /// (not to when the stream started), so idling earns no more than the burst.
    fn charge(&self, bytes: u64, now: Instant) -> Option<Duration> {
        if self.limit == 0 {
            return None;
        }
        let mut paid = self.paid.lock().expect("pace");
        let start = match now.checked_sub(BURST) {
            Some(floor) if floor > *paid => floor,
            _ => *paid,
        };
        *paid = start + Duration::from_secs_f64(bytes as f64 / self.limit as f64);
        start.checked_duration_since(now).filter(|d| !d.is_zero())
    }

    /// Blocks until `bytes` more may go out.
    pub(super) fn wait(&self, bytes: u64) {
        if let Some(ahead) = self.ahead(bytes) {
            std::thread::sleep(ahead);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_waits_for_the_bytes_before_it_to_be_paid_for() {
        let pace = Pace::new(1000);
        let t0 = *pace.paid.lock().unwrap();
        assert_eq!(pace.charge(500, t0), None, "the first bytes go at once");
        assert_eq!(
            pace.charge(500, t0),
            Some(Duration::from_millis(500)),
            "then after the 500 before them, at 1000 B/s"
        );
        assert_eq!(
            pace.charge(100, t0 + Duration::from_millis(600)),
            Some(Duration::from_millis(400))
        );
    }

    #[test]
    fn an_idle_spell_earns_no_more_than_the_burst() {
        let pace = Pace::new(1000);
        let t0 = *pace.paid.lock().unwrap();
        // Idle 10 s (PostCopy's pages before the restore asks): a start-anchored
        // schedule would let 10,000 bytes out at once.
        let now = t0 + Duration::from_secs(10);
        assert_eq!(pace.charge(100, now), None, "the burst goes at once");
        assert_eq!(
            pace.charge(1000, now),
            None,
            "the schedule has caught up to now"
        );
        assert_eq!(
            pace.charge(1000, now),
            Some(Duration::from_secs(1)),
            "then the stream is paced again"
        );
    }

    #[test]
    fn no_limit_never_waits() {
        let pace = Pace::new(0);
        let t0 = Instant::now();
        assert_eq!(pace.charge(u64::MAX, t0), None);
        assert_eq!(pace.charge(u64::MAX, t0), None);
    }
}
