//! Forwarders: the listeners the ruleset redirects intercepted ports to, and what
//! they do with each connection.
//!
//! Each intercepted application port has one forwarder listening on its agent port
//! inside the target namespace (IPv4 and, where the namespace has it, IPv6). A
//! redirected connection is, depending on the port's current mode:
//! - intercepted: handed to a client stream waiting on the control API;
//! - intercepted with a header filter: read as HTTP/1.1 request by request
//!   ([`crate::filtered`]) — matching requests go to a client stream, the others to the
//!   application, dialed like a pass-through;
//! - otherwise passed through: dialed to its original destination from inside the
//!   target namespace (the agent GID lets that dial bypass the redirect), optionally
//!   copying both directions to every wiretap on the port.
//!
//! A connection made straight to a forwarder's port was not redirected: it has no
//! original destination but the forwarder itself, and passing it on would dial the
//! forwarder again, which would dial again, until the agent ran out of descriptors.
//! Such a connection is closed at once ([`redirected_from`]).

use crate::filtered::{self, AppDial, ProxyError};
use crate::metrics::{Counted, ErrorCategory, Mode, Outcome};
use crate::netns::NetnsExecutor;
use crate::port::{
    Delivered, Delivery, Port, TAP_CLOSE, TAP_FROM_APP, TAP_OPEN, TAP_TO_APP, tap_frame,
};
use bytes::Bytes;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// Binds the forwarder listeners for one port inside the target namespace.
pub async fn bind(netns: &NetnsExecutor, agent_port: u16) -> std::io::Result<Vec<TcpListener>> {
    let fds: Vec<OwnedFd> = netns
        .run(move || {
            let mut fds = vec![listen_socket(SocketAddr::from((
                Ipv4Addr::UNSPECIFIED,
                agent_port,
            )))?];
            match listen_socket(SocketAddr::from((Ipv6Addr::UNSPECIFIED, agent_port))) {
                Ok(fd) => fds.push(fd),
                Err(e)
                    if e.raw_os_error() == Some(nix::libc::EAFNOSUPPORT)
                        || e.raw_os_error() == Some(nix::libc::EADDRNOTAVAIL) => {}
                Err(e) => return Err(e),
            }
            Ok(fds)
        })
        .await
        .map_err(into_io)?;
    fds.into_iter()
        .map(|fd| {
            let l = std::net::TcpListener::from(fd);
            l.set_nonblocking(true)?;
            TcpListener::from_std(l)
        })
        .collect()
}

fn listen_socket(addr: SocketAddr) -> std::io::Result<OwnedFd> {
    use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, SockaddrStorage, sockopt};
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket::socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    socket::setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    if addr.is_ipv6() {
        socket::setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
    }
    let sa = SockaddrStorage::from(addr);
    socket::bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &sa)?;
    socket::listen(
        &fd,
        socket::Backlog::new(128).map_err(std::io::Error::from)?,
    )?;
    Ok(fd)
}

/// Dials `addr` from inside the target namespace: the pass-through path.
pub async fn dial(netns: &NetnsExecutor, addr: SocketAddr) -> std::io::Result<TcpStream> {
    let s = netns
        .run(move || {
            let s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
            s.set_nonblocking(true)?;
            Ok(s)
        })
        .await
        .map_err(into_io)?;
    TcpStream::from_std(s)
}

impl AppDial for NetnsExecutor {
    fn dial(
        &self,
        addr: SocketAddr,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<TcpStream>> + Send + '_>>
    {
        Box::pin(dial(self, addr))
    }
}

fn into_io(e: crate::netns::NetnsError) -> std::io::Error {
    match e {
        crate::netns::NetnsError::Op(e) => e,
        e => std::io::Error::other(e.to_string()),
    }
}

/// Where a connection was headed before the ruleset redirected it: `None` when it
/// was not redirected (no NAT record, or one whose original destination is the
/// forwarder's own address: a direct connection to the forwarder's port).
pub fn original_dst(s: &TcpStream) -> Option<SocketAddr> {
    let local = s.local_addr().ok()?;
    redirected_from(local, nat_original_dst(s, local))
}

/// The original destination of a connection accepted at `local`, from the NAT record
/// (`SO_ORIGINAL_DST`), if that is somewhere else than `local`.
pub fn redirected_from(local: SocketAddr, nat: Option<SocketAddr>) -> Option<SocketAddr> {
    let dst = nat?;
    (canonical(dst) != canonical(local)).then_some(dst)
}

/// An IPv4-mapped IPv6 address as the IPv4 one, so both forms compare equal.
fn canonical(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(v4.into(), v6.port()),
            None => a,
        },
        v4 => v4,
    }
}

fn nat_original_dst(s: &TcpStream, local: SocketAddr) -> Option<SocketAddr> {
    use nix::sys::socket::{getsockopt, sockopt};
    if local.is_ipv4() {
        let sa = getsockopt(s, sockopt::OriginalDst).ok()?;
        Some(SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
            u16::from_be(sa.sin_port),
        )))
    } else {
        let sa = getsockopt(s, sockopt::Ip6tOriginalDst).ok()?;
        Some(SocketAddr::V6(SocketAddrV6::new(
            Ipv6Addr::from(sa.sin6_addr.s6_addr),
            u16::from_be(sa.sin6_port),
            0,
            sa.sin6_scope_id,
        )))
    }
}

/// Accept loop of one forwarder listener. Every connection is counted by the port's
/// mode when it was accepted, its bytes both ways and how it ended
/// ([`crate::metrics`]).
pub async fn serve(
    port: Arc<Port>,
    listener: TcpListener,
    netns: Arc<NetnsExecutor>,
    intercept_wait: Duration,
) {
    let metrics = crate::metrics::global();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                metrics.error(ErrorCategory::Accept);
                tracing::warn!(error = %e, "forwarder accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        tokio::spawn(redirected(
            port.clone(),
            stream,
            peer,
            netns.clone(),
            intercept_wait,
        ));
    }
}

/// Serves one redirected connection as the port's mode at its acceptance says:
/// through the filtered intercept, to a client stream, or to the application.
async fn redirected(
    port: Arc<Port>,
    stream: TcpStream,
    peer: SocketAddr,
    netns: Arc<NetnsExecutor>,
    intercept_wait: Duration,
) {
    let metrics = crate::metrics::global();
    let Some(original_dst) = original_dst(&stream) else {
        // Not redirected: dropped before it is counted as a connection of the port.
        metrics.error(ErrorCategory::NotRedirected);
        tracing::debug!(%peer, port = port.agent_port, "dropped a connection that was not redirected");
        return;
    };
    let tracked = metrics.accepted(port.mode_now());
    let stream = Counted::new(stream, metrics.byte_counters(tracked.mode()));
    if tracked.mode() == Mode::Filtered
        && let Some(filter) = port.filter()
    {
        let r = filtered::proxy(
            &port,
            stream,
            peer,
            original_dst,
            &*netns,
            intercept_wait,
            filter,
        )
        .await;
        match r {
            Ok(outcome) => tracked.end(outcome),
            Err(e) => {
                metrics.error(e.category);
                tracing::debug!(error = %e, "filtered connection ended with an error");
                tracked.end(e.outcome);
            }
        }
        return;
    }
    let conn = Delivered {
        stream: Box::new(stream),
        peer,
        original_dst,
    };
    tracked.end(offer_or_pass(&port, conn, &netns, intercept_wait).await);
}

/// An unfiltered connection: offered to a client stream while the port is
/// intercepted, else (or once the intercept stops meanwhile) passed to the
/// application. How it ended.
async fn offer_or_pass(
    port: &Port,
    conn: Delivered,
    netns: &NetnsExecutor,
    intercept_wait: Duration,
) -> Outcome {
    let metrics = crate::metrics::global();
    let conn = if port.intercepted() {
        match port.deliver(conn, intercept_wait).await {
            Delivery::Taken => return Outcome::Delivered,
            Delivery::TimedOut => {
                metrics.error(ErrorCategory::NoClient);
                return Outcome::TimedOut;
            }
            // The intercept stopped meanwhile: pass through.
            Delivery::Stopped(c) => c,
        }
    } else {
        conn
    };
    match pass_through(port, conn, netns).await {
        Ok(()) => Outcome::Forwarded,
        Err(e) => {
            metrics.error(e.category);
            tracing::debug!(error = %e, "pass-through connection ended with an error");
            e.outcome
        }
    }
}

async fn pass_through(
    port: &Port,
    conn: Delivered,
    netns: &NetnsExecutor,
) -> Result<(), ProxyError> {
    let upstream = dial(netns, conn.original_dst)
        .await
        .map_err(filtered::dial_failed)?;
    let io = ProxyError::from;
    let taps = port.taps();
    if taps.is_empty() {
        let (mut a, mut b) = (conn.stream, upstream);
        tokio::io::copy_bidirectional(&mut a, &mut b)
            .await
            .map_err(io)?;
        return Ok(());
    }
    let id = port.next_conn_id();
    let meta = format!(
        "{{\"peer\":\"{}\",\"original_dst\":\"{}\"}}",
        conn.peer, conn.original_dst
    );
    port.tap(&taps, tap_frame(TAP_OPEN, id, meta.as_bytes()));
    let (cr, cw) = tokio::io::split(conn.stream);
    let (ur, uw) = upstream.into_split();
    let up = copy_tapped(port, &taps, id, TAP_TO_APP, cr, uw);
    let down = copy_tapped(port, &taps, id, TAP_FROM_APP, ur, cw);
    let r = tokio::try_join!(up, down);
    port.tap(&taps, tap_frame(TAP_CLOSE, id, &[]));
    r.map(|_| ()).map_err(io)
}

async fn copy_tapped(
    port: &Port,
    taps: &[mpsc::Sender<Bytes>],
    id: u32,
    kind: u8,
    mut r: impl tokio::io::AsyncRead + Unpin,
    mut w: impl tokio::io::AsyncWrite + Unpin,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; crate::port::TAP_FRAME_MAX_PAYLOAD];
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            w.shutdown().await.ok();
            return Ok(());
        }
        w.write_all(&buf[..n]).await?;
        port.tap(taps, tap_frame(kind, id, &buf[..n]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn only_a_connection_whose_nat_record_names_another_destination_was_redirected() {
        let local = a("10.0.0.2:15001");
        assert_eq!(
            redirected_from(local, Some(a("10.0.0.2:8080"))),
            Some(a("10.0.0.2:8080"))
        );
        assert_eq!(
            redirected_from(a("127.0.0.1:15001"), Some(a("10.96.0.1:80"))),
            Some(a("10.96.0.1:80"))
        );
        // Dialed straight to the forwarder: its record names the forwarder itself.
        assert_eq!(redirected_from(local, Some(local)), None);
        assert_eq!(
            redirected_from(a("[::ffff:10.0.0.2]:15001"), Some(local)),
            None
        );
        assert_eq!(
            redirected_from(a("[fd00::2]:15001"), Some(a("[fd00::2]:15001"))),
            None
        );
        // No record at all (no NAT happened).
        assert_eq!(redirected_from(local, None), None);
    }
}
