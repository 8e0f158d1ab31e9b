//! The attach agent's Prometheus metrics, served as text on `GET /metrics` of a plain
//! HTTP port of its own (`--metrics-listen`, in the Job pod's network namespace; no
//! TLS and no token: counts only — the control API keeps its bearer token). Like the
//! migration agent's (executors/agent/src/metrics.rs), with the same library, the same
//! server (podmotion-metrics) and the same rule: every label value comes from a fixed
//! set (modes, outcomes, directions, routes, results, error categories, control API
//! routes and status codes), never a peer address, a port number, a header or a path,
//! so one agent's series are a fixed number however much traffic it sees.
//!
//! Connections are labelled by the port's mode when the forwarder accepted them:
//! `intercept` (handed to a client stream), `filtered` (a filtered HTTP intercept,
//! routed request by request), `wiretap` (passed through and copied to a wiretap) or
//! `passthrough` (passed through to the application).

use std::pin::Pin;
use std::sync::LazyLock;
use std::task::{Context, Poll};

use podmotion_metrics::registered;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How a port treated a connection when the forwarder accepted it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Intercept,
    Filtered,
    Wiretap,
    Passthrough,
}

impl Mode {
    pub const ALL: [Mode; 4] = [
        Mode::Intercept,
        Mode::Filtered,
        Mode::Wiretap,
        Mode::Passthrough,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Mode::Intercept => "intercept",
            Mode::Filtered => "filtered",
            Mode::Wiretap => "wiretap",
            Mode::Passthrough => "passthrough",
        }
    }
}

/// How a connection ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Handed to a client stream (an intercept), or under a filtered intercept served
    /// until its end with at least one request routed to a client stream.
    Delivered,
    /// Relayed to the application and back until either side closed.
    Forwarded,
    /// No client stream took it in time: closed (a filtered intercept answers 502).
    TimedOut,
    /// The application could not be dialed from inside the target's namespace.
    DialFailed,
    /// Ended by an I/O or HTTP framing error after it was connected.
    Error,
}

impl Outcome {
    pub const ALL: [Outcome; 5] = [
        Outcome::Delivered,
        Outcome::Forwarded,
        Outcome::TimedOut,
        Outcome::DialFailed,
        Outcome::Error,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Delivered => "delivered",
            Outcome::Forwarded => "forwarded",
            Outcome::TimedOut => "timed_out",
            Outcome::DialFailed => "dial_failed",
            Outcome::Error => "error",
        }
    }
}

/// What a filtered intercept did with one request (or a connection that was not HTTP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// Carried the filter's headers: to a client stream.
    Matched,
    /// Did not: to the application.
    Passed,
    /// The connection's first bytes were not HTTP/1.x: passed through unchanged.
    NotHttp,
}

impl Route {
    pub const ALL: [Route; 3] = [Route::Matched, Route::Passed, Route::NotHttp];
    pub fn name(self) -> &'static str {
        match self {
            Route::Matched => "matched",
            Route::Passed => "passed",
            Route::NotHttp => "not_http",
        }
    }
}

/// Errors by bounded category.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCategory {
    /// A forwarder's accept failed.
    Accept,
    /// Dialing the application from inside the target's namespace failed.
    Dial,
    /// A connection ended with an I/O error.
    Io,
    /// A filtered connection broke HTTP framing after its first request.
    HttpFraming,
    /// An intercepted connection (or request) found no client stream in time.
    NoClient,
    /// A wiretap stream was too slow: a frame was dropped.
    WiretapOverflow,
    /// A file or directory copy (`/v1/files`) ended early.
    FileCopy,
    /// Re-applying or deleting the redirect ruleset failed.
    Ruleset,
    /// A connection reached a forwarder without being redirected (dialed directly):
    /// dropped, since passing it on would dial the forwarder itself.
    NotRedirected,
}

impl ErrorCategory {
    pub const ALL: [ErrorCategory; 9] = [
        ErrorCategory::Accept,
        ErrorCategory::Dial,
        ErrorCategory::Io,
        ErrorCategory::HttpFraming,
        ErrorCategory::NoClient,
        ErrorCategory::WiretapOverflow,
        ErrorCategory::FileCopy,
        ErrorCategory::Ruleset,
        ErrorCategory::NotRedirected,
    ];
    pub fn name(self) -> &'static str {
        match self {
            ErrorCategory::Accept => "accept",
            ErrorCategory::Dial => "dial",
            ErrorCategory::Io => "io",
            ErrorCategory::HttpFraming => "http_framing",
            ErrorCategory::NoClient => "no_client",
            ErrorCategory::WiretapOverflow => "wiretap_overflow",
            ErrorCategory::FileCopy => "file_copy",
            ErrorCategory::Ruleset => "ruleset",
            ErrorCategory::NotRedirected => "not_redirected",
        }
    }
}

/// The answer to one `GET /v1/files`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileResult {
    File,
    Directory,
    /// 404: no such path (or container) inside the target's root.
    NotFound,
    /// 400: a bad query, a symlink loop, a magic link, a special file.
    Refused,
    /// 403: the agent may not read it.
    Forbidden,
    /// Anything else (500, a missing upgrade).
    Error,
}

impl FileResult {
    pub const ALL: [FileResult; 6] = [
        FileResult::File,
        FileResult::Directory,
        FileResult::NotFound,
        FileResult::Refused,
        FileResult::Forbidden,
        FileResult::Error,
    ];
    pub fn name(self) -> &'static str {
        match self {
            FileResult::File => "file",
            FileResult::Directory => "directory",
            FileResult::NotFound => "not_found",
            FileResult::Refused => "refused",
            FileResult::Forbidden => "forbidden",
            FileResult::Error => "error",
        }
    }
    /// The result of a refused request, from its HTTP status.
    pub fn of_status(status: u16) -> FileResult {
        match status {
            404 => FileResult::NotFound,
            400 => FileResult::Refused,
            403 => FileResult::Forbidden,
            _ => FileResult::Error,
        }
    }
}

/// The control API's routes, as the `route` label names them.
pub const API_ROUTES: [&str; 10] = [
    "healthz",
    "env",
    "exports",
    "files",
    "intercepts",
    "intercept_accept",
    "wiretaps",
    "wiretap_stream",
    "unauthorized",
    "unknown",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabels {
    pub mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndLabels {
    pub mode: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BytesLabels {
    pub mode: &'static str,
    /// `from_peer` (what the redirected connection's peer sent) or `to_peer`.
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CategoryLabels {
    pub category: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    pub route: &'static str,
    /// The answer's HTTP status code (`200`, `101`, `401`, …): a fixed set.
    pub code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InterceptLabels {
    /// `whole` (every connection of the port) or `filtered` (by HTTP headers).
    pub kind: &'static str,
}

/// What the intercept and wiretap gauges show: the attached ports' state at a scrape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortGauges {
    /// Ports intercepted whole (every connection).
    pub whole: i64,
    /// Ports under a filtered (HTTP header) intercept.
    pub filtered: i64,
    /// Wiretaps running, over all ports.
    pub wiretaps: i64,
}

/// All metrics of one attach agent.
pub struct AttachMetrics {
    registry: Registry,
    accepted: Family<ModeLabels, Counter>,
    active: Family<ModeLabels, Gauge>,
    ended: Family<EndLabels, Counter>,
    bytes: Family<BytesLabels, Counter>,
    filtered_requests: Family<RouteLabels, Counter>,
    errors: Family<CategoryLabels, Counter>,
    file_requests: Family<ResultLabels, Counter>,
    api_requests: Family<ApiLabels, Counter>,
    ruleset_installed: Gauge,
    redirected_ports: Gauge,
    intercepts: Family<InterceptLabels, Gauge>,
    wiretaps: Gauge,
}

static GLOBAL: LazyLock<AttachMetrics> = LazyLock::new(AttachMetrics::new);

/// The process's metrics (what the forwarders, the control API and `/metrics` use).
pub fn global() -> &'static AttachMetrics {
    &GLOBAL
}

impl Default for AttachMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl AttachMetrics {
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("podmotion_attach");
        let reg = &mut r;
        #[rustfmt::skip]
        let metrics = AttachMetrics {
            accepted: registered(reg, "connections_accepted", "Redirected connections the forwarders accepted, by the port's mode at that moment", Family::default()),
            active: registered(reg, "connections_active", "Redirected connections open now, by mode", Family::default()),
            ended: registered(reg, "connections_ended", "Redirected connections that ended, by mode and outcome", Family::default()),
            bytes: registered(reg, "connection_bytes", "Bytes of redirected connections, by mode and direction (from_peer, to_peer)", Family::default()),
            filtered_requests: registered(reg, "filtered_requests", "Routing decisions of filtered HTTP intercepts: requests matched (to a client stream) or passed (to the application), connections not HTTP", Family::default()),
            errors: registered(reg, "errors", "Errors of the forwarders, the ruleset and the file copies, by category", Family::default()),
            file_requests: registered(reg, "file_requests", "GET /v1/files requests, by result", Family::default()),
            api_requests: registered(reg, "api_requests", "Control API requests answered, by route and HTTP status code", Family::default()),
            ruleset_installed: registered(reg, "ruleset_installed", "1 while the agent's redirect ruleset is installed in the target's network namespace", Gauge::default()),
            redirected_ports: registered(reg, "redirected_ports", "Application ports the installed ruleset redirects to the agent", Gauge::default()),
            intercepts: registered(reg, "intercepts", "Ports intercepted now, by kind (whole, filtered)", Family::default()),
            wiretaps: registered(reg, "wiretaps", "Wiretaps running now", Gauge::default()),
            registry: r,
        };
        metrics.start_known_series_at_zero();
        metrics
    }

    /// Every known series starts at 0, so rate() works from the first scrape and a
    /// fresh agent's /metrics shows every family the alerts and dashboard use.
    fn start_known_series_at_zero(&self) {
        for mode in Mode::ALL {
            let m = mode.name();
            let _ = self.accepted.get_or_create(&ModeLabels { mode: m });
            let _ = self.active.get_or_create(&ModeLabels { mode: m });
            for o in Outcome::ALL {
                let _ = self.ended.get_or_create(&EndLabels {
                    mode: m,
                    outcome: o.name(),
                });
            }
            for direction in ["from_peer", "to_peer"] {
                let _ = self
                    .bytes
                    .get_or_create(&BytesLabels { mode: m, direction });
            }
        }
        for route in Route::ALL {
            let _ = self.filtered_requests.get_or_create(&RouteLabels {
                route: route.name(),
            });
        }
        for c in ErrorCategory::ALL {
            let _ = self
                .errors
                .get_or_create(&CategoryLabels { category: c.name() });
        }
        for f in FileResult::ALL {
            let _ = self
                .file_requests
                .get_or_create(&ResultLabels { result: f.name() });
        }
        for kind in ["whole", "filtered"] {
            let _ = self.intercepts.get_or_create(&InterceptLabels { kind });
        }
    }

    /// A connection accepted by a forwarder: counted, and open until the returned
    /// guard ends it (with [`Tracked::end`], or as `error` when dropped unended).
    pub fn accepted(&self, mode: Mode) -> Tracked<'_> {
        let labels = ModeLabels { mode: mode.name() };
        self.accepted.get_or_create(&labels).inc();
        self.active.get_or_create(&labels).inc();
        Tracked {
            metrics: self,
            mode,
            ended: false,
        }
    }

    /// Counters of the bytes of one connection of `mode`: (from the peer, to it).
    pub fn byte_counters(&self, mode: Mode) -> (Counter, Counter) {
        let c = |direction| {
            self.bytes
                .get_or_create(&BytesLabels {
                    mode: mode.name(),
                    direction,
                })
                .clone()
        };
        (c("from_peer"), c("to_peer"))
    }

    pub fn filtered(&self, route: Route) {
        self.filtered_requests
            .get_or_create(&RouteLabels {
                route: route.name(),
            })
            .inc();
    }

    pub fn error(&self, category: ErrorCategory) {
        self.errors
            .get_or_create(&CategoryLabels {
                category: category.name(),
            })
            .inc();
    }

    pub fn file_request(&self, result: FileResult) {
        self.file_requests
            .get_or_create(&ResultLabels {
                result: result.name(),
            })
            .inc();
    }

    /// One control API answer; `route` is one of [`API_ROUTES`].
    pub fn api_request(&self, route: &'static str, code: u16) {
        self.api_requests
            .get_or_create(&ApiLabels { route, code })
            .inc();
    }

    /// The ruleset is in place with `ports` redirects (`None`: removed).
    pub fn ruleset(&self, ports: Option<usize>) {
        self.ruleset_installed.set(i64::from(ports.is_some()));
        self.redirected_ports.set(ports.unwrap_or(0) as i64);
    }

    /// The text exposition format, with the intercept and wiretap gauges set from
    /// `ports` (all 0 before the agent is attached: `None`).
    pub fn encode(&self, ports: Option<PortGauges>) -> String {
        let ports = ports.unwrap_or_default();
        self.intercepts
            .get_or_create(&InterceptLabels { kind: "whole" })
            .set(ports.whole);
        self.intercepts
            .get_or_create(&InterceptLabels { kind: "filtered" })
            .set(ports.filtered);
        self.wiretaps.set(ports.wiretaps);
        podmotion_metrics::encode(&self.registry)
    }
}

/// The value of one series (`name{labels}` exactly as encoded) in this registry's
/// text; 0 when absent. For tests of the code that counts.
#[cfg(test)]
pub(crate) fn value(series: &str) -> f64 {
    global()
        .encode(None)
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// One open connection (see [`AttachMetrics::accepted`]).
pub struct Tracked<'a> {
    metrics: &'a AttachMetrics,
    mode: Mode,
    ended: bool,
}

impl Tracked<'_> {
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The connection ended with `outcome`.
    pub fn end(mut self, outcome: Outcome) {
        self.finish(outcome);
    }

    fn finish(&mut self, outcome: Outcome) {
        if self.ended {
            return;
        }
        self.ended = true;
        let m = self.metrics;
        m.active
            .get_or_create(&ModeLabels {
                mode: self.mode.name(),
            })
            .dec();
        m.ended
            .get_or_create(&EndLabels {
                mode: self.mode.name(),
                outcome: outcome.name(),
            })
            .inc();
    }
}

impl Drop for Tracked<'_> {
    fn drop(&mut self) {
        // A task aborted at shutdown (or a panic) leaves no connection counted open.
        self.finish(Outcome::Error);
    }
}

/// A byte stream whose reads count as `from_peer` and writes as `to_peer` bytes:
/// wraps the redirected connection itself, so every way it is spliced (to a client
/// stream, through the filtered proxy, to the application) is counted the same,
/// partial transfers included.
pub struct Counted<S> {
    inner: S,
    read: Counter,
    written: Counter,
}

impl<S> Counted<S> {
    pub fn new(inner: S, (read, written): (Counter, Counter)) -> Self {
        Counted {
            inner,
            read,
            written,
        }
    }
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            self.read.inc_by((buf.filled().len() - before) as u64);
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            self.written.inc_by(n as u64);
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn a_fresh_agent_shows_every_family_at_zero() {
        let text = AttachMetrics::new().encode(None);
        for line in [
            r#"podmotion_attach_connections_accepted_total{mode="intercept"} 0"#,
            r#"podmotion_attach_connections_ended_total{mode="filtered",outcome="timed_out"} 0"#,
            r#"podmotion_attach_connection_bytes_total{mode="passthrough",direction="to_peer"} 0"#,
            r#"podmotion_attach_filtered_requests_total{route="matched"} 0"#,
            r#"podmotion_attach_errors_total{category="dial"} 0"#,
            r#"podmotion_attach_file_requests_total{result="not_found"} 0"#,
            r#"podmotion_attach_intercepts{kind="filtered"} 0"#,
            "podmotion_attach_ruleset_installed 0",
            "podmotion_attach_wiretaps 0",
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }

    #[test]
    fn a_connection_is_active_until_it_ends_and_ends_once() {
        let m = AttachMetrics::new();
        let t = m.accepted(Mode::Wiretap);
        let text = m.encode(None);
        assert!(
            text.contains(r#"podmotion_attach_connections_active{mode="wiretap"} 1"#),
            "{text}"
        );
        t.end(Outcome::Forwarded);
        // A guard dropped without an end (an aborted task) counts as an error.
        drop(m.accepted(Mode::Intercept));
        let text = m.encode(None);
        for line in [
            r#"podmotion_attach_connections_active{mode="wiretap"} 0"#,
            r#"podmotion_attach_connections_accepted_total{mode="wiretap"} 1"#,
            r#"podmotion_attach_connections_ended_total{mode="wiretap",outcome="forwarded"} 1"#,
            r#"podmotion_attach_connections_ended_total{mode="wiretap",outcome="error"} 0"#,
            r#"podmotion_attach_connections_ended_total{mode="intercept",outcome="error"} 1"#,
            r#"podmotion_attach_connections_active{mode="intercept"} 0"#,
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }

    #[tokio::test]
    async fn a_counted_stream_counts_both_directions() {
        let m = AttachMetrics::new();
        let (a, mut b) = tokio::io::duplex(64);
        let mut c = Counted::new(a, m.byte_counters(Mode::Passthrough));
        b.write_all(b"hello").await.unwrap();
        let mut buf = [0u8; 5];
        c.read_exact(&mut buf).await.unwrap();
        c.write_all(b"hi").await.unwrap();
        let text = m.encode(None);
        for line in [
            r#"podmotion_attach_connection_bytes_total{mode="passthrough",direction="from_peer"} 5"#,
            r#"podmotion_attach_connection_bytes_total{mode="passthrough",direction="to_peer"} 2"#,
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }

    #[test]
    fn the_ruleset_gauges_follow_install_and_removal() {
        let m = AttachMetrics::new();
        m.ruleset(Some(2));
        let text = m.encode(None);
        assert!(
            text.contains("podmotion_attach_ruleset_installed 1"),
            "{text}"
        );
        assert!(
            text.contains("podmotion_attach_redirected_ports 2"),
            "{text}"
        );
        m.ruleset(None);
        let text = m.encode(None);
        assert!(
            text.contains("podmotion_attach_ruleset_installed 0"),
            "{text}"
        );
        assert!(
            text.contains("podmotion_attach_redirected_ports 0"),
            "{text}"
        );
    }

    #[test]
    fn file_results_come_from_the_refusals_status() {
        assert_eq!(FileResult::of_status(404), FileResult::NotFound);
        assert_eq!(FileResult::of_status(400), FileResult::Refused);
        assert_eq!(FileResult::of_status(403), FileResult::Forbidden);
        assert_eq!(FileResult::of_status(500), FileResult::Error);
    }
}
