//! The agent's Prometheus metrics, served as text on `/metrics` of a plain HTTP port
//! (no TLS, no secrets: counts only), by the server the executors share (the
//! podmotion-metrics crate). What the agent knows about its migrations it learns from
//! the answers of its own RPCs: [`Observed`] wraps the gRPC service and
//! feeds every returned `MigrationStatus` to [`AgentMetrics::observe`], so the service
//! itself only calls in for what no answer shows (broker ops, watchdog resumes, the
//! frozen sources read at scrape time). Every label value comes from a fixed set
//! (roles, phases, RPC names, gRPC codes, broker ops and error kinds): never a
//! migration UID or a message. The netns broker serves no metrics of its own: the
//! agent is its only client and counts every op it asks for (docs/metrics.md says why).

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use podmotion_metrics::registered;
use podmotion_wire::agent::{
    CommitRequest, ForwardRequest, ImageChunk, LazyFrame, MigrationRef, MigrationStatus, Phase,
    PrepareRequest, ReceiveSummary, Role, SendRequest,
};
use podmotion_wire::broker::ErrorKind;
use podmotion_wire::proto::migration_agent_server::MigrationAgent;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tonic::{Request as GrpcRequest, Response, Status, Streaming};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub rpc: &'static str,
    /// `Ok` or the gRPC code's name (`FailedPrecondition`, …).
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    pub rpc: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// `Source` or `Target`.
    pub role: &'static str,
    pub phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub role: &'static str,
    /// `Committed`, `Aborted` or `Killed` (a fenced source its watchdog killed).
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GaveUpLabels {
    /// `broker_lease_ended` (the broker rolls the source back or kills it itself) or
    /// `source_gone`.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BrokerLabels {
    /// The broker op (`lock_network`, `resume`, …: `Request::name`).
    pub op: &'static str,
    /// `ok`, or the broker's error kind (`busy`, `no_such_process`, …).
    pub result: String,
}

/// What the agent last saw of one migration.
struct Tracked {
    role: &'static str,
    phase: &'static str,
    iteration: u32,
    bytes_sent: u64,
    bytes_received: u64,
    /// Last time the phase, round or byte counts moved.
    progressed: Instant,
    /// Reached Committed or Aborted (counted once; kept until CleanedUp).
    finished: bool,
}

/// All metrics of one agent.
pub struct AgentMetrics {
    registry: Registry,
    calls: Family<CallLabels, Counter>,
    call_duration: Family<RpcLabels, Histogram>,
    migrations: Family<PhaseLabels, Gauge>,
    finished: Family<OutcomeLabels, Counter>,
    idle_seconds: Gauge<f64, AtomicU64>,
    freeze_duration: Histogram,
    bytes_sent: Counter,
    bytes_received: Counter,
    frozen_sources: Gauge,
    frozen_over_budget: Gauge,
    frozen_seconds_max: Gauge<f64, AtomicU64>,
    watchdog_resumes: Counter,
    watchdog_kills: Counter,
    watchdog_gave_up: Family<GaveUpLabels, Counter>,
    broker_ops: Family<BrokerLabels, Counter>,
    tracked: Mutex<HashMap<String, Tracked>>,
}

static GLOBAL: LazyLock<AgentMetrics> = LazyLock::new(AgentMetrics::new);

/// The process's metrics (what the service's hooks and `/metrics` use).
pub fn global() -> &'static AgentMetrics {
    &GLOBAL
}

/// The agent's RPCs, as the `rpc` label names them.
const RPCS: [&str; 12] = [
    "Prepare",
    "PreDump",
    "Dump",
    "Send",
    "Fence",
    "ReceiveImages",
    "Restore",
    "Commit",
    "Forward",
    "Abort",
    "Cleanup",
    "Status",
];

/// Why the freeze watchdog may give up on a source, as the `reason` label names it.
pub const WATCHDOG_GAVE_UP: [&str; 2] = ["broker_lease_ended", "source_gone"];

const PHASES: [Phase; 12] = [
    Phase::Unknown,
    Phase::Prepared,
    Phase::PreDumping,
    Phase::Dumped,
    Phase::Sent,
    Phase::Receiving,
    Phase::Received,
    Phase::Restored,
    Phase::Committed,
    Phase::Aborted,
    Phase::CleanedUp,
    Phase::Killed,
];

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Unknown => "Unknown",
        Phase::Prepared => "Prepared",
        Phase::PreDumping => "PreDumping",
        Phase::Dumped => "Dumped",
        Phase::Sent => "Sent",
        Phase::Receiving => "Receiving",
        Phase::Received => "Received",
        Phase::Restored => "Restored",
        Phase::Committed => "Committed",
        Phase::Aborted => "Aborted",
        Phase::CleanedUp => "CleanedUp",
        Phase::Killed => "Killed",
    }
}

fn role_name(r: i32) -> &'static str {
    match Role::try_from(r) {
        Ok(Role::Source) => "Source",
        Ok(Role::Target) => "Target",
        _ => "Unspecified",
    }
}

fn code_name(c: tonic::Code) -> String {
    // tonic's Debug of a code is its CamelCase name: a fixed set of 17.
    format!("{c:?}")
}

fn kind_name(k: ErrorKind) -> String {
    serde_json::to_value(k)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| "unknown".into())
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// A source still frozen: how long, and the freeze budget its migration named.
#[derive(Clone, Copy, Debug)]
pub struct FrozenAge {
    pub frozen_for: Duration,
    pub budget: Duration,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl AgentMetrics {
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("podmotion_agent");
        let reg = &mut r;
        // call_duration: 1 ms … 65 s (a pre-dump or restore of a small pod takes tens of
        // ms, a large Send tens of seconds); freeze_duration: 10 ms … 41 s.
        #[rustfmt::skip]
        let metrics = AgentMetrics {
            calls: registered(reg, "calls", "Agent RPCs answered, by RPC and gRPC code", Family::default()),
            call_duration: registered(reg, "call_duration_seconds", "Time spent answering one agent RPC (dump, restore, send, …)", Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 17)))),
            migrations: registered(reg, "migrations", "Migrations on this agent that have not finished, by role and phase", Family::default()),
            finished: registered(reg, "migrations_finished", "Migrations this agent saw end, by role and outcome", Family::default()),
            idle_seconds: registered(reg, "migration_idle_seconds_max", "Longest time any unfinished migration on this agent went without progress (phase, round or bytes)", Gauge::default()),
            freeze_duration: registered(reg, "source_freeze_seconds", "How long a source stayed frozen, from its final dump to the Commit or Abort that ended the freeze", Histogram::new(exponential_buckets(0.01, 2.0, 13))),
            bytes_sent: registered(reg, "sent_bytes", "Checkpoint image bytes this agent sent", Counter::default()),
            bytes_received: registered(reg, "received_bytes", "Checkpoint image bytes this agent received", Counter::default()),
            frozen_sources: registered(reg, "frozen_sources", "Sources this agent froze that are still frozen (network locked by the broker)", Gauge::default()),
            frozen_over_budget: registered(reg, "frozen_sources_over_budget", "Frozen sources whose freeze has lasted longer than their migration's freeze budget", Gauge::default()),
            frozen_seconds_max: registered(reg, "frozen_seconds_max", "How long the longest-frozen source has been frozen (0 when none is)", Gauge::default()),
            watchdog_resumes: registered(reg, "watchdog_resumes", "Sources the freeze watchdog resumed because nobody committed or aborted in time", Counter::default()),
            watchdog_kills: registered(reg, "watchdog_kills", "Fenced sources (the target may have restored them) the freeze watchdog killed because nobody committed or aborted in time", Counter::default()),
            watchdog_gave_up: registered(reg, "watchdog_gave_up", "Frozen sources the freeze watchdog stopped trying to resume or kill, by why no retry could succeed", Family::default()),
            broker_ops: registered(reg, "broker_ops", "Netns broker ops this agent asked for, by op and result", Family::default()),
            tracked: Mutex::new(HashMap::new()),
            registry: r,
        };
        metrics.start_known_series_at_zero();
        metrics
    }

    /// Every known series starts at 0: a rate() or increase() over it works from the
    /// first scrape, and a fresh agent's /metrics shows every family the alerts and
    /// the dashboard use (e2e/tests/real_metrics.rs checks that).
    fn start_known_series_at_zero(&self) {
        for rpc in RPCS {
            let _ = self.calls.get_or_create(&CallLabels {
                rpc,
                code: "Ok".into(),
            });
            let _ = self.call_duration.get_or_create(&RpcLabels { rpc });
        }
        for role in ["Source", "Target"] {
            for outcome in ["Committed", "Aborted", "Killed"] {
                let _ = self
                    .finished
                    .get_or_create(&OutcomeLabels { role, outcome });
            }
        }
        for reason in WATCHDOG_GAVE_UP {
            let _ = self
                .watchdog_gave_up
                .get_or_create(&GaveUpLabels { reason });
        }
        for &op in podmotion_wire::broker::OPS {
            let _ = self.broker_ops.get_or_create(&BrokerLabels {
                op,
                result: "ok".into(),
            });
        }
    }

    /// One answered RPC; `status` is the migration's state it returned, if any.
    pub fn call(
        &self,
        rpc: &'static str,
        took: Duration,
        result: Result<Option<&MigrationStatus>, &Status>,
    ) {
        let code = match result {
            Ok(_) => "Ok".to_owned(),
            Err(s) => code_name(s.code()),
        };
        self.calls.get_or_create(&CallLabels { rpc, code }).inc();
        self.call_duration
            .get_or_create(&RpcLabels { rpc })
            .observe(took.as_secs_f64());
        if let Ok(Some(s)) = result {
            self.observe(s);
        }
    }

    /// Takes in a migration's state as an RPC returned it.
    pub fn observe(&self, s: &MigrationStatus) {
        let phase = Phase::try_from(s.phase).unwrap_or(Phase::Unknown);
        let role = role_name(s.role);
        let mut tracked = self.tracked.lock().expect("tracked");
        if phase == Phase::CleanedUp {
            tracked.remove(&s.migration_uid);
            return;
        }
        let now = Instant::now();
        let t = tracked
            .entry(s.migration_uid.clone())
            .or_insert_with(|| Tracked {
                role,
                phase: "",
                iteration: 0,
                bytes_sent: 0,
                bytes_received: 0,
                progressed: now,
                finished: false,
            });
        let sent = s.bytes_sent.saturating_sub(t.bytes_sent);
        let received = s.bytes_received.saturating_sub(t.bytes_received);
        self.bytes_sent.inc_by(sent);
        self.bytes_received.inc_by(received);
        let name = phase_name(phase);
        if sent > 0 || received > 0 || t.phase != name || t.iteration != s.iteration {
            t.progressed = now;
        }
        t.bytes_sent = t.bytes_sent.max(s.bytes_sent);
        t.bytes_received = t.bytes_received.max(s.bytes_received);
        t.iteration = s.iteration;
        t.phase = name;
        if matches!(phase, Phase::Committed | Phase::Aborted | Phase::Killed) && !t.finished {
            t.finished = true;
            self.finished
                .get_or_create(&OutcomeLabels {
                    role,
                    outcome: name,
                })
                .inc();
            let froze = s.timings.map(|t| t.freeze_started_us).unwrap_or(0);
            if role == "Source" && froze > 0 {
                self.freeze_duration
                    .observe(now_us().saturating_sub(froze) as f64 / 1e6);
            }
        }
    }

    /// One broker op the agent asked for (a broker that did not answer is `truncated`
    /// or `kernel`, as the client reports it).
    pub fn broker_op(&self, op: &'static str, result: Result<(), ErrorKind>) {
        let result = match result {
            Ok(()) => "ok".to_owned(),
            Err(k) => kind_name(k),
        };
        self.broker_ops
            .get_or_create(&BrokerLabels { op, result })
            .inc();
    }

    /// The freeze watchdog resumed a source.
    pub fn watchdog_resumed(&self) {
        self.watchdog_resumes.inc();
    }

    /// The freeze watchdog killed a fenced source.
    pub fn watchdog_killed(&self) {
        self.watchdog_kills.inc();
    }

    /// The freeze watchdog gave up on a source (`reason`: one of [`WATCHDOG_GAVE_UP`]).
    pub fn watchdog_gave_up(&self, reason: &'static str) {
        self.watchdog_gave_up
            .get_or_create(&GaveUpLabels { reason })
            .inc();
    }

    /// The text exposition format, with the gauges brought up to date: the frozen
    /// sources as the agent holds them now, the unfinished migrations as last seen.
    pub fn encode(&self, frozen: &[FrozenAge]) -> String {
        self.frozen_sources.set(frozen.len() as i64);
        self.frozen_over_budget
            .set(frozen.iter().filter(|f| f.frozen_for > f.budget).count() as i64);
        self.frozen_seconds_max.set(
            frozen
                .iter()
                .map(|f| f.frozen_for.as_secs_f64())
                .fold(0.0, f64::max),
        );
        {
            let tracked = self.tracked.lock().expect("tracked");
            let mut counts: HashMap<(&'static str, &'static str), i64> = HashMap::new();
            let mut idle = Duration::ZERO;
            for t in tracked.values().filter(|t| !t.finished) {
                *counts.entry((t.role, t.phase)).or_default() += 1;
                idle = idle.max(t.progressed.elapsed());
            }
            // Every (role, phase) series exists, at 0 when empty: a migration leaving a
            // phase must bring its series down, not leave it at its last value.
            for role in ["Source", "Target"] {
                for p in PHASES {
                    let phase = phase_name(p);
                    if matches!(
                        p,
                        Phase::Committed | Phase::Aborted | Phase::CleanedUp | Phase::Killed
                    ) {
                        continue;
                    }
                    self.migrations
                        .get_or_create(&PhaseLabels { role, phase })
                        .set(counts.get(&(role, phase)).copied().unwrap_or(0));
                }
            }
            self.idle_seconds.set(idle.as_secs_f64());
        }
        podmotion_metrics::encode(&self.registry)
    }
}

/// The gRPC service (the agent's) with every answer counted: what `main` serves.
pub struct Observed<A> {
    pub agent: Arc<A>,
}

type Res<T> = Result<Response<T>, Status>;

async fn timed(
    rpc: &'static str,
    f: impl std::future::Future<Output = Res<MigrationStatus>>,
) -> Res<MigrationStatus> {
    let start = Instant::now();
    let r = f.await;
    global().call(rpc, start.elapsed(), r.as_ref().map(|s| Some(s.get_ref())));
    r
}

#[tonic::async_trait]
impl<A: MigrationAgent> MigrationAgent for Observed<A> {
    async fn prepare(&self, r: GrpcRequest<PrepareRequest>) -> Res<MigrationStatus> {
        timed("Prepare", self.agent.prepare(r)).await
    }
    async fn pre_dump(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        timed("PreDump", self.agent.pre_dump(r)).await
    }
    async fn dump(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        timed("Dump", self.agent.dump(r)).await
    }
    async fn send(&self, r: GrpcRequest<SendRequest>) -> Res<MigrationStatus> {
        timed("Send", self.agent.send(r)).await
    }
    async fn receive_images(&self, r: GrpcRequest<Streaming<ImageChunk>>) -> Res<ReceiveSummary> {
        let start = Instant::now();
        let res = self.agent.receive_images(r).await;
        global().call("ReceiveImages", start.elapsed(), res.as_ref().map(|_| None));
        res
    }
    type LazyPagesStream = A::LazyPagesStream;
    async fn lazy_pages(&self, r: GrpcRequest<Streaming<LazyFrame>>) -> Res<Self::LazyPagesStream> {
        let start = Instant::now();
        let res = self.agent.lazy_pages(r).await;
        global().call("LazyPages", start.elapsed(), res.as_ref().map(|_| None));
        res
    }
    async fn fence(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        timed("Fence", self.agent.fence(r)).await
    }
    async fn restore(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        timed("Restore", self.agent.restore(r)).await
    }
    async fn commit(&self, r: GrpcRequest<CommitRequest>) -> Res<MigrationStatus> {
        timed("Commit", self.agent.commit(r)).await
    }
    async fn forward(&self, r: GrpcRequest<ForwardRequest>) -> Res<MigrationStatus> {
        timed("Forward", self.agent.forward(r)).await
    }
    async fn abort(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        timed("Abort", self.agent.abort(r)).await
    }
    async fn cleanup(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        timed("Cleanup", self.agent.cleanup(r)).await
    }
    async fn status(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        timed("Status", self.agent.status(r)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use podmotion_wire::agent::Timings;

    fn status(uid: &str, role: Role, phase: Phase, sent: u64) -> MigrationStatus {
        MigrationStatus {
            migration_uid: uid.into(),
            role: role as i32,
            phase: phase as i32,
            bytes_sent: sent,
            timings: Some(Timings {
                freeze_started_us: now_us().saturating_sub(250_000),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_committed_source_counts_once_and_leaves_the_phase_gauges() {
        let m = AgentMetrics::new();
        m.observe(&status("u1", Role::Source, Phase::Dumped, 0));
        let text = m.encode(&[]);
        assert!(
            text.contains(r#"podmotion_agent_migrations{role="Source",phase="Dumped"} 1"#),
            "{text}"
        );
        m.observe(&status("u1", Role::Source, Phase::Sent, 1000));
        m.observe(&status("u1", Role::Source, Phase::Committed, 1000));
        // The same answer again (a retried Commit, a Status) counts nothing more.
        m.observe(&status("u1", Role::Source, Phase::Committed, 1000));
        let text = m.encode(&[]);
        assert!(
            text.contains(
                r#"podmotion_agent_migrations_finished_total{role="Source",outcome="Committed"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains("podmotion_agent_sent_bytes_total 1000"),
            "{text}"
        );
        assert!(
            text.contains(r#"podmotion_agent_migrations{role="Source",phase="Dumped"} 0"#),
            "{text}"
        );
        assert!(
            text.contains(r#"podmotion_agent_migrations{role="Source",phase="Sent"} 0"#),
            "{text}"
        );
        assert!(
            text.contains("podmotion_agent_source_freeze_seconds_count 1"),
            "{text}"
        );
        m.observe(&status("u1", Role::Source, Phase::CleanedUp, 1000));
        assert!(m.tracked.lock().unwrap().is_empty());
    }

    #[test]
    fn frozen_sources_past_their_budget_are_counted() {
        let m = AgentMetrics::new();
        let text = m.encode(&[
            FrozenAge {
                frozen_for: Duration::from_secs(3),
                budget: Duration::from_secs(1),
            },
            FrozenAge {
                frozen_for: Duration::from_millis(100),
                budget: Duration::from_secs(1),
            },
        ]);
        assert!(text.contains("podmotion_agent_frozen_sources 2"), "{text}");
        assert!(
            text.contains("podmotion_agent_frozen_sources_over_budget 1"),
            "{text}"
        );
        assert!(
            text.contains("podmotion_agent_frozen_seconds_max 3"),
            "{text}"
        );
    }

    #[test]
    fn broker_ops_and_failed_calls_are_labelled_by_bounded_names() {
        let m = AgentMetrics::new();
        m.broker_op("lock_network", Ok(()));
        m.broker_op("resume", Err(ErrorKind::NoSuchProcess));
        m.call(
            "Dump",
            Duration::from_millis(5),
            Err(&Status::failed_precondition("broker: busy")),
        );
        let text = m.encode(&[]);
        for line in [
            r#"podmotion_agent_broker_ops_total{op="lock_network",result="ok"} 1"#,
            r#"podmotion_agent_broker_ops_total{op="resume",result="no_such_process"} 1"#,
            r#"podmotion_agent_calls_total{rpc="Dump",code="FailedPrecondition"} 1"#,
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }
}
