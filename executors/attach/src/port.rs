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
    pub fn new(app_port: u16, agent_port: u16) -> Self {
        Port {
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

    pub fn start_wiretap(&self) -> u64 {
        let id = IDS.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(1024);
        let mut m = self.mode();
        m.taps.insert(id, tx);
        m.pending_tap_rx.insert(id, rx);
        id
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
            .map(|_| ())
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
