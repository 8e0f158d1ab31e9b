//! One intercepted application port's state: its mode (intercepted, with or without
//! a header filter, or passed through), the client streams waiting for its
//! connections and its wiretaps. The forwarders ([`crate::forward`]) and the filtered
//! intercept ([`crate::filtered`]) read it for each connection; the control API changes
//! it.

use crate::http::Filter;
use crate::metrics::{ErrorCategory, Mode};
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, mpsc, oneshot};

/// A byte stream a client stream can be spliced to: the intercepted TCP connection
/// itself, or (filtered intercept) the forwarder's end of an in-memory pipe.
pub trait Conn: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Conn for T {}

/// An intercepted connection on its way to a client stream.
pub struct Delivered {
    pub stream: Box<dyn Conn>,
    pub peer: SocketAddr,
    pub original_dst: SocketAddr,
}

/// Wiretap frame kinds on the client stream: `[kind u8][conn u32][len u32][payload]`.
pub const TAP_OPEN: u8 = 0;
pub const TAP_TO_APP: u8 = 1;
pub const TAP_FROM_APP: u8 = 2;
pub const TAP_CLOSE: u8 = 3;

pub fn tap_frame(kind: u8, conn: u32, payload: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(9 + payload.len());
    v.push(kind);
    v.extend_from_slice(&conn.to_be_bytes());
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    Bytes::from(v)
}

#[derive(Default)]
struct PortMode {
    intercept: Option<u64>,
    /// The intercept's header filter (a filtered HTTP intercept), if any.
    filter: Option<Arc<Filter>>,
    waiters: VecDeque<oneshot::Sender<Delivered>>,
    taps: HashMap<u64, mpsc::Sender<Bytes>>,
    pending_tap_rx: HashMap<u64, mpsc::Receiver<Bytes>>,
}

pub struct Port {
    pub app_port: u16,
    pub agent_port: u16,
    mode: Mutex<PortMode>,
    waiter_added: Notify,
    conn_ids: AtomicU32,
    pub tap_drops: AtomicU64,
    taps_budget: Arc<TapBudget>,
}

/// Most frames a wiretap's stream queues before it drops (a slow reader loses frames,
/// never slows the application).
pub const TAP_QUEUE_FRAMES: usize = 1024;
/// Most payload bytes in one wiretap frame (the forwarders copy in reads this size).
pub const TAP_FRAME_MAX_PAYLOAD: usize = 16 * 1024;
/// Concurrent wiretaps of one agent, all ports together, unless the installer says
/// otherwise (`--max-wiretaps`): each can queue about 16 MiB.
pub const DEFAULT_MAX_WIRETAPS: usize = 4;

/// The agent's wiretaps, all ports together, and how many it may hold: each queues up
/// to [`TAP_QUEUE_FRAMES`] frames of [`TAP_FRAME_MAX_PAYLOAD`] bytes, so the limit
/// bounds the memory wiretaps can take.
#[derive(Debug)]
pub struct TapBudget {
    limit: usize,
    active: std::sync::atomic::AtomicUsize,
}

impl TapBudget {
    pub fn new(limit: usize) -> Arc<TapBudget> {
        Arc::new(TapBudget {
            limit,
            active: Default::default(),
        })
    }

    /// The most memory the wiretaps' queues can hold at this limit.
    pub fn max_bytes(&self) -> usize {
        self.limit * TAP_QUEUE_FRAMES * (9 + TAP_FRAME_MAX_PAYLOAD)
    }

    fn take(&self) -> Result<(), ModeError> {
        self.active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limit).then_some(n + 1)
            })
            .map(|_| ())
            .map_err(|_| ModeError::TooManyWiretaps(self.limit))
    }

    fn give_back(&self) {
        self.active.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ModeError {
    #[error("port {0} is not configured for this agent")]
    UnknownPort(u16),
    #[error("port {0} is already intercepted")]
    AlreadyIntercepted(u16),
    #[error("port {0} is not intercepted")]
    NotIntercepted(u16),
    #[error("wiretap {1} on port {0} not found or its stream is already attached")]
    NoTap(u16, u64),
    #[error(
        "this agent already runs {0} wiretaps, its limit (set by the installer): stop one first"
    )]
    TooManyWiretaps(usize),
}

static IDS: AtomicU64 = AtomicU64::new(1);

/// What became of a connection offered to the intercept's client streams.
pub(crate) enum Delivery {
    /// A client stream has it.
    Taken,
    /// The intercept stopped meanwhile: the connection is back, for the application.
    Stopped(Delivered),
    /// No client stream came in time; the connection was dropped.
    TimedOut,
}

impl Port {
    /// A port with a wiretap budget of its own, at the default limit.
    pub fn new(app_port: u16, agent_port: u16) -> Self {
        Self::with_tap_budget(app_port, agent_port, TapBudget::new(DEFAULT_MAX_WIRETAPS))
    }

    /// A port whose wiretaps count against `budget`, shared by the agent's ports.
    pub fn with_tap_budget(app_port: u16, agent_port: u16, budget: Arc<TapBudget>) -> Self {
        Port {
            taps_budget: budget,
            app_port,
            agent_port,
            mode: Mutex::new(PortMode::default()),
            waiter_added: Notify::new(),
            conn_ids: AtomicU32::new(1),
            tap_drops: AtomicU64::new(0),
        }
    }

    fn mode(&self) -> std::sync::MutexGuard<'_, PortMode> {
        self.mode.lock().expect("port mode lock")
    }

    /// Starts intercepting the port: every connection, or with `filter` only the
    /// HTTP requests carrying its headers.
    pub fn start_intercept(&self, filter: Option<Filter>) -> Result<u64, ModeError> {
        let mut m = self.mode();
        if m.intercept.is_some() {
            return Err(ModeError::AlreadyIntercepted(self.app_port));
        }
        let id = IDS.fetch_add(1, Ordering::Relaxed);
        m.intercept = Some(id);
        m.filter = filter.map(Arc::new);
        Ok(id)
    }

    /// The header filter of the running intercept, if it is a filtered one.
    pub fn filter(&self) -> Option<Arc<Filter>> {
        let m = self.mode();
        m.intercept.and(m.filter.clone())
    }

    /// Stops the intercept; waiting client streams are dropped (closed). Connections
    /// already handed over keep running.
    pub fn stop_intercept(&self) -> Result<(), ModeError> {
        let mut m = self.mode();
        if m.intercept.take().is_none() {
            return Err(ModeError::NotIntercepted(self.app_port));
        }
        m.filter = None;
        m.waiters.clear();
        Ok(())
    }

    pub fn intercepted(&self) -> bool {
        self.mode().intercept.is_some()
    }

    /// A client stream ready to take one intercepted connection.
    pub fn add_waiter(&self) -> Result<oneshot::Receiver<Delivered>, ModeError> {
        let mut m = self.mode();
        if m.intercept.is_none() {
            return Err(ModeError::NotIntercepted(self.app_port));
        }
        let (tx, rx) = oneshot::channel();
        m.waiters.push_back(tx);
        drop(m);
        self.waiter_added.notify_waiters();
        Ok(rx)
    }

    /// Starts a wiretap, if the agent's limit allows one more.
    pub fn start_wiretap(&self) -> Result<u64, ModeError> {
        self.taps_budget.take()?;
        let id = IDS.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(TAP_QUEUE_FRAMES);
        let mut m = self.mode();
        m.taps.insert(id, tx);
        m.pending_tap_rx.insert(id, rx);
        Ok(id)
    }

    pub fn take_wiretap_stream(&self, id: u64) -> Result<mpsc::Receiver<Bytes>, ModeError> {
        self.mode()
            .pending_tap_rx
            .remove(&id)
            .ok_or(ModeError::NoTap(self.app_port, id))
    }

    pub fn stop_wiretap(&self, id: u64) -> Result<(), ModeError> {
        let mut m = self.mode();
        m.pending_tap_rx.remove(&id);
        m.taps
            .remove(&id)
            .map(|_| self.taps_budget.give_back())
            .ok_or(ModeError::NoTap(self.app_port, id))
    }

    /// How the port treats a connection accepted now.
    pub(crate) fn mode_now(&self) -> Mode {
        let m = self.mode();
        match (m.intercept.is_some(), m.filter.is_some()) {
            (true, true) => Mode::Filtered,
            (true, false) => Mode::Intercept,
            (false, _) if !m.taps.is_empty() => Mode::Wiretap,
            (false, _) => Mode::Passthrough,
        }
    }

    /// The id of the next passed-through connection (in its wiretap frames).
    pub(crate) fn next_conn_id(&self) -> u32 {
        self.conn_ids.fetch_add(1, Ordering::Relaxed)
    }

    pub fn wiretaps(&self) -> Vec<u64> {
        self.mode().taps.keys().copied().collect()
    }

    pub(crate) fn taps(&self) -> Vec<mpsc::Sender<Bytes>> {
        self.mode().taps.values().cloned().collect()
    }

    pub(crate) fn tap(&self, taps: &[mpsc::Sender<Bytes>], frame: Bytes) {
        for t in taps {
            // A slow tap loses frames rather than slowing the application down.
            if t.try_send(frame.clone()).is_err() {
                self.tap_drops.fetch_add(1, Ordering::Relaxed);
                crate::metrics::global().error(ErrorCategory::WiretapOverflow);
            }
        }
    }

    /// Hands `conn` to a waiting client stream; waits up to `wait` for one.
    pub(crate) async fn deliver(&self, mut conn: Delivered, wait: Duration) -> Delivery {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.waiter_added.notified();
            loop {
                let next = {
                    let mut m = self.mode();
                    if m.intercept.is_none() {
                        return Delivery::Stopped(conn);
                    }
                    m.waiters.pop_front()
                };
                let Some(w) = next else { break };
                match w.send(conn) {
                    Ok(()) => return Delivery::Taken,
                    Err(back) => conn = back,
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                tracing::warn!(
                    port = self.app_port,
                    "no client stream took the intercepted connection in time; closing it"
                );
                return Delivery::TimedOut;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wiretaps_past_the_agents_limit_are_refused_on_every_port_until_one_stops() {
        let budget = TapBudget::new(2);
        let a = Port::with_tap_budget(8080, 15001, budget.clone());
        let b = Port::with_tap_budget(9090, 15002, budget);
        let first = a.start_wiretap().unwrap();
        b.start_wiretap().unwrap();
        for port in [&a, &b] {
            let e = port.start_wiretap().unwrap_err();
            assert!(matches!(e, ModeError::TooManyWiretaps(2)), "{e}");
            assert!(e.to_string().contains("limit"), "{e}");
        }
        assert_eq!(a.wiretaps().len() + b.wiretaps().len(), 2);
        a.stop_wiretap(first).unwrap();
        assert!(a.stop_wiretap(first).is_err(), "a stop gives back once");
        b.start_wiretap().unwrap();
        assert!(a.start_wiretap().is_err());
    }

    #[test]
    fn the_default_limit_bounds_wiretap_memory_to_about_64_mib() {
        let max = TapBudget::new(DEFAULT_MAX_WIRETAPS).max_bytes();
        assert!(max > 64 << 20 && max < 65 << 20, "{max}");
    }
}
