//! The operator's `AgentClient` (the port `crate::migration::agent` defines) over the
//! executors' gRPC wire client (`podmotion_wire::client`).
//!
//! The wire calls block until a step is done and return the agent's
//! `MigrationStatus`; the phase machine instead wants "start a step" and "how do the
//! steps stand". This adapter starts each call on a task and remembers the call in
//! flight (and its failure) per node and migration; reports merge that memory with the
//! agent's own `Status`. The memory is only a convenience: after an operator restart
//! the agent's status alone says which step completed, and every call is idempotent.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use podmotion_api::migration::{ApplicationProbe, ExecProbe, MigrationMode, TcpPreservation};
use podmotion_wire::agent::{ContainerRef, MigrationStatus, PrepareRequest, Role, SendRequest};
use podmotion_wire::client::{AgentClient as WireClient, ClientError, TlsFiles};

mod forward;
mod probe;
mod report;

use crate::leader::{Leadership, NotLeader};
use crate::migration::agent::{
    AgentCallError, AgentClient, AgentEndpoint, AgentReport, Step, StepRequest, StepState,
};
use crate::migration::preflight::{EXEC_PROBE_DISABLED, exec_probes_disabled_message};
use probe::{ProbeError, exec_once, probe_once};
use report::{remembered_outcome, report_from_status};

pub use crate::pki::plan::agent_server_name;

type Key = (String, String);

/// `AgentClient` over mutual TLS (or plain HTTP/2 for `http://` endpoints in local runs).
#[derive(Clone)]
pub struct WireAgents {
    client: kube::Client,
    tls: Option<TlsFiles>,
    inflight: Arc<Mutex<BTreeMap<Key, (Step, StepState)>>>,
    /// When each migration's last failed step call ended, and which step it was: the
    /// same step is not asked again sooner than [`STEP_RETRY_AFTER`].
    failed_at: Arc<Mutex<BTreeMap<Key, (Step, std::time::Instant)>>>,
    /// How each `Step::Forward` stands (kept apart from `inflight`: see `forward`).
    forwards: Arc<Mutex<BTreeMap<Key, StepState>>>,
    /// Exec probes may run (`--migration-exec-probes`: the installer granted
    /// `pods/exec`); otherwise they fail closed (the pre-flight refuses them first).
    exec_probes: bool,
    /// Deadline of connecting to an agent (`--migration-agent-call-timeout-seconds`).
    call_timeout: Duration,
    /// This replica's leadership: every call carries the term of the lease it holds,
    /// and agents refuse a term lower than one they have seen.
    leader: Option<Leadership>,
    /// Announces a migration UID when one of its step calls ended.
    ended: UnboundedSender<String>,
    /// The receiving end of `ended`, until [`AgentClient::step_ends`] takes it.
    ends: Arc<Mutex<Option<UnboundedReceiver<String>>>>,
}

impl WireAgents {
    pub fn new(client: kube::Client, tls: Option<TlsFiles>) -> Self {
        let (ended, ends) = futures::channel::mpsc::unbounded();
        WireAgents {
            client,
            tls,
            inflight: Default::default(),
            failed_at: Default::default(),
            forwards: Default::default(),
            exec_probes: false,
            call_timeout: Duration::from_secs(10),
            leader: None,
            ended,
            ends: Arc::new(Mutex::new(Some(ends))),
        }
    }

    /// Calls carry the term of the lease `leader` holds (none with leader election off).
    pub fn with_leader(mut self, leader: Leadership) -> Self {
        self.leader = Some(leader);
        self
    }

    /// The term to send (`None`: no leader election); a replica that does not lead
    /// connects to no agent.
    fn term(&self) -> Result<Option<podmotion_wire::agent::LeaderTerm>, NotLeader> {
        self.leader
            .as_ref()
            .map_or(Ok(None), Leadership::fencing_term)
    }

    /// With the migration controller's settings: whether exec probes may run, and the
    /// agent call deadline.
    pub fn with_settings(mut self, exec_probes: bool, call_timeout: Duration) -> Self {
        self.exec_probes = exec_probes;
        self.call_timeout = call_timeout;
        self
    }

    async fn connect(&self, e: &AgentEndpoint) -> Result<WireClient, AgentCallError> {
        let err = |m: String| AgentCallError {
            node: e.node.clone(),
            message: m,
        };
        let term = self.term().map_err(|x| err(x.to_string()))?;
        match (&self.tls, e.url.starts_with("http://")) {
            (_, true) => {
                let ch = tonic::transport::Endpoint::from_shared(e.url.clone())
                    .map_err(|x| err(x.to_string()))?
                    .connect_timeout(std::time::Duration::from_secs(5))
                    .connect()
                    .await
                    .map_err(|x| err(format!("cannot reach agent: {x}")))?;
                Ok(WireClient::from_channel(ch).with_leader_term(term))
            }
            (Some(tls), false) => WireClient::connect(&e.url, &agent_server_name(&e.node), tls)
                .await
                .map(|c| c.with_leader_term(term))
                .map_err(|x| err(x.to_string())),
            (None, false) => Err(err("no agent TLS material configured".into())),
        }
    }

    async fn call(&self, e: &AgentEndpoint, r: &StepRequest) -> Result<(), (String, String)> {
        let fail = |c: &ClientError| (c.category().to_string(), c.to_string());
        let mut c = self.connect_within_deadline(e).await?;
        let uid = r.migration_uid.as_str();
        let tcp = wire_tcp(r.tcp_preservation);
        let res = match r.step {
            // A Prepare of the same migration under way on the agent (a retry racing
            // the first call, or two replicas across a leader change) is answered
            // `Unavailable`, "ask again": the call is idempotent, so it is asked again
            // within the call deadline rather than failing the migration.
            Step::Prepare | Step::Receive => {
                let mut req = prepare_request(r, tcp);
                if r.step == Step::Prepare {
                    req.hold_services = self.hold_services(r).await;
                }
                asking_again(self.call_timeout, ASK_AGAIN_PAUSE, || {
                    let (mut c, req) = (c.clone(), req.clone());
                    async move { c.prepare(req).await }
                })
                .await
            }
            // A pre-copy round is the dump while the workload runs and the stream of
            // what changed to the target: pages move before the freeze, and the
            // stream measures the dirty set and the link for the freeze budget.
            Step::PreDump(_) => match (c.pre_dump(uid).await, &r.target_agent_url) {
                (Ok(_), Some(url)) => send(&mut c, r, url).await,
                (res, _) => res,
            },
            Step::Dump => c.dump(uid).await,
            Step::Transfer => {
                let Some(url) = &r.target_agent_url else {
                    return Err(("NoTargetAgent".into(), "no target agent endpoint".into()));
                };
                send(&mut c, r, url).await
            }
            Step::Fence => c.fence(uid).await,
            Step::Restore => c.restore(uid).await,
            // The wire service has no probe call yet: the operator probes the restored
            // pod over the pod network itself (TCP, HTTP, HTTPS, gRPC), and exec probes
            // through the API server's pods/exec (only when enabled; else they fail
            // closed), so nothing is committed without proof.
            Step::Probe => return self.probe(r).await,
            Step::Commit => c.commit_closing(uid, r.close_connections).await,
            // Started apart (`start_forward`), never through here.
            Step::Forward => return Err(("InvalidRequest".into(), "Forward".into())),
            Step::Abort => c.abort(uid).await,
            Step::Cleanup => c.cleanup(uid).await,
        };
        res.map(|_| ()).map_err(|e| fail(&e))
    }

    /// What the source's lock holds beside its own addresses: the Service ports listing
    /// it now (this node's clients reach it by those, before kube-proxy's DNAT). A read
    /// that fails holds the source's own addresses only.
    async fn hold_services(&self, r: &StepRequest) -> Vec<podmotion_wire::agent::ForwardedPort> {
        match self.source_services(r).await {
            Ok((slices, services)) => forward::service_ports(&r.source_pod_uid, &slices, &services),
            Err((_, m)) => {
                tracing::warn!(uid = %r.migration_uid, error = %m, "the Services listing the source not read: its lock holds its own addresses only");
                Vec::new()
            }
        }
    }

    /// Connects to the agent at `e` within the call deadline: connecting gets the call
    /// deadline; the step's own work (a transfer may take minutes) is bounded by the
    /// machine's progress timeout instead.
    async fn connect_within_deadline(
        &self,
        e: &AgentEndpoint,
    ) -> Result<WireClient, (String, String)> {
        tokio::time::timeout(self.call_timeout, self.connect(e))
            .await
            .map_err(|_| {
                (
                    "AgentUnreachable".to_string(),
                    format!(
                        "no connection to the agent on {} within {}s (--migration-agent-call-timeout-seconds)",
                        e.node,
                        self.call_timeout.as_secs()
                    ),
                )
            })?
            .map_err(|x| ("AgentUnreachable".to_string(), x.message))
    }
}

/// The wire's form of a migration's TCP preservation.
fn wire_tcp(tcp: TcpPreservation) -> podmotion_wire::agent::TcpPreservation {
    match tcp {
        TcpPreservation::Strict => podmotion_wire::agent::TcpPreservation::Strict,
        TcpPreservation::BestEffort => podmotion_wire::agent::TcpPreservation::BestEffort,
        TcpPreservation::None => podmotion_wire::agent::TcpPreservation::None,
    }
}

/// The `Prepare` of the source (`Step::Prepare`) or the target (`Step::Receive`): the
/// agent resolves the named container IDs to the pod's process tree (source) or its
/// holder (target) itself (no PID crosses the wire), and the other agent's node is
/// named as the peer: the target takes images only from the source's agent, the source
/// streams only to the target's.
fn prepare_request(r: &StepRequest, tcp: podmotion_wire::agent::TcpPreservation) -> PrepareRequest {
    let (role, peer) = if r.step == Step::Receive {
        (Role::Target, &r.source_node)
    } else {
        (Role::Source, &r.target_node)
    };
    PrepareRequest {
        migration_uid: r.migration_uid.clone(),
        role: role as i32,
        transfer_key: r.transfer_key.0.to_vec(),
        tcp: tcp as i32,
        container_ids: r.container_ids.clone(),
        peer_node: peer.clone(),
        freeze_budget_ms: r.freeze_budget_millis,
        // Both sides: the source checks it can serve lazy pages, the target admits the
        // source's page stream.
        post_copy: r.mode == MigrationMode::PostCopy,
        containers: r
            .containers
            .iter()
            .map(|(name, id)| ContainerRef {
                name: name.clone(),
                id: id.clone(),
            })
            .collect(),
        // The source's: filled in by the caller (it reads the Services).
        hold_services: Vec::new(),
    }
}

/// The pause before asking an agent again after `Unavailable`.
const ASK_AGAIN_PAUSE: Duration = Duration::from_millis(200);

/// Calls `call` again, every `pause`, while the agent answers `Unavailable` ("ask
/// again"), for as long as `within` allows; then its last answer stands. Only for
/// idempotent calls.
async fn asking_again<T, F, Fut>(
    within: Duration,
    pause: Duration,
    mut call: F,
) -> Result<T, ClientError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match call().await {
            Err(ClientError::Status(s))
                if s.code() == tonic::Code::Unavailable
                    && tokio::time::Instant::now() + pause < deadline =>
            {
                tokio::time::sleep(pause).await
            }
            res => return res,
        }
    }
}

/// Streams the images the source holds and the target lacks (incremental).
async fn send(
    c: &mut WireClient,
    r: &StepRequest,
    target_url: &str,
) -> Result<MigrationStatus, ClientError> {
    let req = SendRequest {
        migration_uid: r.migration_uid.clone(),
        target_endpoint: target_url.into(),
        target_server_name: agent_server_name(&r.target_node),
        bandwidth_limit: r.bandwidth_limit_bytes_per_second.unwrap_or(0).max(0) as u64,
    };
    let req = c.request(req);
    c.raw()
        .send(req)
        .await
        .map(|resp| resp.into_inner())
        .map_err(ClientError::from)
}

impl WireAgents {
    async fn probe(&self, r: &StepRequest) -> Result<(), (String, String)> {
        let Some(p) = &r.probe else {
            // No probe anywhere: the restore resuming the process is the proof.
            return Ok(());
        };
        if p.exec.is_some() && !self.exec_probes {
            return Err((
                EXEC_PROBE_DISABLED.into(),
                exec_probes_disabled_message("the migration's probe"),
            ));
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &r.namespace);
        let target = pods.get(&r.target_pod).await.ok();
        let timeout = Duration::from_secs(p.timeout_seconds.max(1) as u64);
        let what = probe_target(p, target.as_ref(), &r.target_pod)?;
        let mut last = String::new();
        for attempt in 1..=p.failure_threshold.max(1) {
            let res = match &what {
                ProbeTarget::Exec(e, container) => {
                    exec_once(&pods, &r.target_pod, container, e, timeout).await
                }
                ProbeTarget::Address(ip) => probe_once(ip, p, timeout).await,
            };
            match res {
                Ok(()) => return Ok(()),
                Err(ProbeError::Unsupported(m)) => return Err(("ProbeUnsupported".into(), m)),
                Err(ProbeError::Failed(m)) => last = format!("attempt {attempt}: {m}"),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Err(("ProbeFailed".into(), last))
    }
}

/// What a probe runs against in the target pod: a command in one of its containers
/// (the probe's, else the first), or its address.
#[derive(Debug, PartialEq)]
enum ProbeTarget<'a> {
    Exec(&'a ExecProbe, String),
    Address(String),
}

/// Where probe `p` runs in the target pod `target` (named `name`). Pure.
fn probe_target<'a>(
    p: &'a ApplicationProbe,
    target: Option<&Pod>,
    name: &str,
) -> Result<ProbeTarget<'a>, (String, String)> {
    let failed = |m: String| ("ProbeFailed".to_string(), m);
    if let Some(e) = &p.exec {
        let first = target
            .and_then(|t| t.spec.as_ref())
            .and_then(|s| s.containers.first())
            .map(|c| c.name.clone());
        let container = e
            .container
            .clone()
            .or(first)
            .ok_or_else(|| failed(format!("the target pod {name} has no container")))?;
        return Ok(ProbeTarget::Exec(e, container));
    }
    target
        .and_then(|pod| pod.status.as_ref()?.pod_ip.clone())
        .map(ProbeTarget::Address)
        .ok_or_else(|| failed("the target pod has no IP".to_string()))
}

/// The least time between a failed step call and the next call of the same step to
/// the same agent for the same migration. Each call's end wakes the migration's
/// reconcile, so without it a step that keeps failing (a Cleanup the agent refuses)
/// was asked again at once, tens of times a second, for as long as it failed.
const STEP_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a report waits for the progress of a step in flight (see
/// [`WireAgents::report`]): it says more when it comes, nothing is lost without it.
const PROGRESS_READ: std::time::Duration = std::time::Duration::from_secs(1);

impl AgentClient for WireAgents {
    async fn report(&self, e: &AgentEndpoint, uid: &str) -> Result<AgentReport, AgentCallError> {
        let mut r = self.step_report(e, uid).await?;
        r.progress.forward = self.forward_state(&e.node, uid);
        Ok(r)
    }

    async fn start(&self, e: &AgentEndpoint, r: &StepRequest) -> Result<(), AgentCallError> {
        if r.step == Step::Forward {
            return self.start_forward(e, r);
        }
        self.start_step(e, r)
    }

    fn step_ends(&self) -> impl futures::Stream<Item = String> + Send + 'static {
        let taken = self.ends.lock().expect("step ends lock").take();
        match taken {
            Some(rx) => rx.left_stream(),
            None => futures::stream::empty().right_stream(),
        }
    }
}

impl WireAgents {
    /// The agent's report of its steps (all but the forward's).
    async fn step_report(
        &self,
        e: &AgentEndpoint,
        uid: &str,
    ) -> Result<AgentReport, AgentCallError> {
        let key = (e.node.clone(), uid.to_string());
        let remembered = self
            .inflight
            .lock()
            .expect("inflight lock")
            .get(&key)
            .cloned();
        if let Some((step, state)) = remembered {
            // A call in flight or failed says more than the agent's last completed phase.
            let mut r = AgentReport {
                last: Some((step, state)),
                ..Default::default()
            };
            // Only the progress is read, and only if the agent answers at once: a step
            // under way may hold the migration on the agent (a Send or an image stream,
            // minutes when paced), and a report that waited for it held the whole
            // reconcile, a deletion's rollback included, until the transfer ended.
            if let Ok(mut c) = self.connect(e).await
                && let Ok(Ok(st)) = tokio::time::timeout(PROGRESS_READ, c.status(uid)).await
            {
                r.progress = report_from_status(&st).progress;
            }
            return Ok(r);
        }
        let mut c = self.connect(e).await?;
        match c.status(uid).await {
            Ok(st) => Ok(report_from_status(&st)),
            Err(ClientError::Status(s)) if s.code() == tonic::Code::NotFound => {
                Ok(AgentReport::default())
            }
            Err(x) => Err(AgentCallError {
                node: e.node.clone(),
                message: x.to_string(),
            }),
        }
    }

    /// Starts a step (but the forward) on a task, remembering it in flight.
    fn start_step(&self, e: &AgentEndpoint, r: &StepRequest) -> Result<(), AgentCallError> {
        let key = (e.node.clone(), r.migration_uid.clone());
        if self
            .failed_at
            .lock()
            .expect("failed_at lock")
            .get(&key)
            .is_some_and(|(s, at)| *s == r.step && at.elapsed() < STEP_RETRY_AFTER)
        {
            // Its failure is still what the report shows; the reconcile that asked
            // polls and asks again.
            return Ok(());
        }
        {
            let mut inflight = self.inflight.lock().expect("inflight lock");
            if matches!(inflight.get(&key), Some((s, StepState::Running)) if *s == r.step) {
                return Ok(());
            }
            inflight.insert(key.clone(), (r.step, StepState::Running));
        }
        let this = self.clone();
        let (e, r) = (e.clone(), r.clone());
        tokio::spawn(async move {
            let res = this.call(&e, &r).await;
            {
                let mut failed_at = this.failed_at.lock().expect("failed_at lock");
                if res.is_err() {
                    failed_at.insert(key.clone(), (r.step, std::time::Instant::now()));
                } else {
                    failed_at.remove(&key);
                }
            }
            {
                let mut inflight = this.inflight.lock().expect("inflight lock");
                match remembered_outcome(r.step, res) {
                    Some(outcome) => inflight.insert(key, outcome),
                    None => inflight.remove(&key),
                };
            }
            // Nobody listening (no controller runs these agents) loses nothing.
            let _ = this.ended.unbounded_send(r.migration_uid);
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migration::key::TransferKey;
    use podmotion_api::migration::MigrationMode;

    #[test]
    fn a_probe_runs_in_its_container_or_the_first_and_else_at_the_pod_address() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "t"},
            "spec": {"containers": [{"name": "app"}, {"name": "side"}]},
            "status": {"podIP": "198.18.0.7"}
        }))
        .unwrap();
        let tcp = ApplicationProbe {
            http_get: None,
            tcp_socket: Some(podmotion_api::migration::TcpProbe { port: 80 }),
            grpc: None,
            exec: None,
            timeout_seconds: 1,
            failure_threshold: 1,
        };
        assert_eq!(
            probe_target(&tcp, Some(&pod), "t"),
            Ok(ProbeTarget::Address("198.18.0.7".into()))
        );
        assert_eq!(
            probe_target(&tcp, None, "t").unwrap_err().1,
            "the target pod has no IP"
        );
        let exec = |container: Option<&str>| ApplicationProbe {
            tcp_socket: None,
            exec: Some(ExecProbe {
                command: vec!["true".into()],
                container: container.map(Into::into),
            }),
            ..tcp.clone()
        };
        let first = exec(None);
        let named = exec(Some("side"));
        let run_in = |p| match probe_target(p, Some(&pod), "t") {
            Ok(ProbeTarget::Exec(_, c)) => c,
            other => panic!("{other:?}"),
        };
        assert_eq!(run_in(&first), "app");
        assert_eq!(run_in(&named), "side");
        let err = probe_target(&first, None, "t").unwrap_err();
        assert_eq!(err.0, "ProbeFailed");
        assert!(err.1.contains("has no container"), "{err:?}");
    }

    fn request(step: Step) -> StepRequest {
        StepRequest {
            migration_uid: "u1".into(),
            namespace: "ns".into(),
            source_pod: "web-0".into(),
            source_pod_uid: "pod-uid".into(),
            target_pod: "web-0-moved".into(),
            source_node: "node-a".into(),
            target_node: "node-b".into(),
            transfer_key: TransferKey([7; 32]),
            mode: MigrationMode::Cold,
            tcp_preservation: TcpPreservation::BestEffort,
            bandwidth_limit_bytes_per_second: None,
            probe: None,
            target_agent_url: Some("https://10.0.0.2:7443".into()),
            container_ids: vec!["containerd://abc".into()],
            containers: vec![("app".into(), "containerd://abc".into())],
            close_connections: false,
            freeze_budget_millis: 5000,
            step,
        }
    }

    /// Agents whose one endpoint (`node-b`) refuses every connection, and that endpoint.
    fn agents_of_a_closed_port() -> (WireAgents, AgentEndpoint) {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let api = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let agents = WireAgents::new(kube::Client::try_from(api).unwrap(), None);
        let e = AgentEndpoint {
            node: "node-b".into(),
            url,
        };
        (agents, e)
    }

    /// A step that ends (here: its agent refuses the connection) announces its
    /// migration after its outcome is remembered, so the reconcile it wakes sees it.
    #[tokio::test]
    async fn a_step_that_ends_announces_its_migration_once_its_outcome_is_reported() {
        let (agents, e) = agents_of_a_closed_port();
        let mut ends = agents.step_ends();
        agents.start(&e, &request(Step::Prepare)).await.unwrap();
        let uid = tokio::time::timeout(Duration::from_secs(60), ends.next())
            .await
            .expect("the step's end was announced")
            .expect("the stream is open");
        assert_eq!(uid, "u1");
        let r = agents.report(&e, "u1").await.unwrap();
        assert!(
            matches!(&r.last, Some((Step::Prepare, StepState::Failed { category, .. })) if category == "AgentUnreachable"),
            "{r:?}"
        );
        // Handed out once: a second taker gets an ended stream.
        assert_eq!(agents.step_ends().next().await, None);
    }

    /// A step that failed is not asked again at once (each call's end wakes the
    /// reconcile that asks it: a step that keeps failing was asked tens of times a
    /// second), but is once [`STEP_RETRY_AFTER`] has passed; another step is asked.
    #[tokio::test]
    async fn a_failed_step_is_asked_again_only_after_a_pause() {
        let (agents, e) = agents_of_a_closed_port();
        let mut ends = agents.step_ends();
        let last = |agents: &WireAgents| {
            agents
                .inflight
                .lock()
                .unwrap()
                .get(&("node-b".to_string(), "u1".to_string()))
                .cloned()
        };
        let ended = async |ends: &mut _| {
            tokio::time::timeout(Duration::from_secs(60), futures::StreamExt::next(ends))
                .await
                .expect("the step's end was announced")
        };
        agents.start(&e, &request(Step::Cleanup)).await.unwrap();
        ended(&mut ends).await;
        assert!(matches!(
            last(&agents),
            Some((Step::Cleanup, StepState::Failed { .. }))
        ));
        // At once again: not asked (nothing runs), the failure stands.
        agents.start(&e, &request(Step::Cleanup)).await.unwrap();
        assert!(matches!(
            last(&agents),
            Some((Step::Cleanup, StepState::Failed { .. }))
        ));
        // Another step is asked at once.
        agents.start(&e, &request(Step::Abort)).await.unwrap();
        assert!(
            matches!(last(&agents), Some((Step::Abort, _))),
            "{:?}",
            last(&agents)
        );
        ended(&mut ends).await;
        // After the pause, the failed step is asked again.
        tokio::time::sleep(STEP_RETRY_AFTER).await;
        agents.start(&e, &request(Step::Abort)).await.unwrap();
        assert!(
            matches!(last(&agents), Some((Step::Abort, StepState::Running))),
            "{:?}",
            last(&agents)
        );
        ended(&mut ends).await;
    }

    /// A call answered `Unavailable` three times, then `answer`; returns what
    /// `asking_again` made of it within `within` and how many calls it made.
    async fn asked_again(within: Duration, answer: tonic::Code) -> (Result<u32, ClientError>, u32) {
        let calls = std::sync::atomic::AtomicU32::new(0);
        let res = asking_again(within, Duration::from_millis(5), || {
            let n = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            async move {
                match n {
                    1..=3 => Err(ClientError::Status(tonic::Status::unavailable("ask again"))),
                    _ if answer == tonic::Code::Ok => Ok(n),
                    _ => Err(ClientError::Status(tonic::Status::new(answer, "no"))),
                }
            }
        })
        .await;
        (res, calls.into_inner())
    }

    #[tokio::test]
    async fn a_prepare_answered_ask_again_is_asked_again_until_the_deadline() {
        // Answered at last: the answer after the "ask again"s.
        let (res, calls) = asked_again(Duration::from_secs(10), tonic::Code::Ok).await;
        assert_eq!((res.unwrap(), calls), (4, 4));
        // Another failure is not asked again: it stands.
        let (res, calls) = asked_again(Duration::from_secs(10), tonic::Code::NotFound).await;
        assert_eq!(res.unwrap_err().category(), "MigrationUnknown");
        assert_eq!(calls, 4);
        // Past the deadline, the "ask again" stands (an agent that never answers
        // otherwise fails the step within the call deadline).
        let (res, calls) = asked_again(Duration::from_millis(1), tonic::Code::Ok).await;
        assert_eq!(res.unwrap_err().category(), "AgentUnavailable");
        assert_eq!(calls, 1);
    }

    #[test]
    fn each_agent_is_told_the_other_agent_s_node_and_only_container_ids() {
        let tcp = podmotion_wire::agent::TcpPreservation::BestEffort;
        let src = prepare_request(&request(Step::Prepare), tcp);
        assert_eq!(
            src.freeze_budget_ms, 5000,
            "the source agent's freeze watchdog gets the budget"
        );
        assert_eq!(src.role, Role::Source as i32);
        assert_eq!(
            src.peer_node, "node-b",
            "the source streams to the target's agent"
        );
        let tgt = prepare_request(&request(Step::Receive), tcp);
        assert_eq!(tgt.role, Role::Target as i32);
        assert_eq!(
            tgt.peer_node, "node-a",
            "the target takes images from the source's"
        );
        assert_eq!(tgt.container_ids, vec!["containerd://abc".to_string()]);
        assert_eq!(
            tgt.containers,
            vec![ContainerRef {
                name: "app".into(),
                id: "containerd://abc".into()
            }],
            "the containers go by name too"
        );
        assert_eq!(tgt.transfer_key, vec![7; 32]);
        assert!(!src.post_copy && !tgt.post_copy);
    }

    #[test]
    fn both_agents_of_a_post_copy_migration_are_told_so() {
        let tcp = podmotion_wire::agent::TcpPreservation::BestEffort;
        for step in [Step::Prepare, Step::Receive] {
            let mut r = request(step);
            r.mode = MigrationMode::PostCopy;
            assert!(prepare_request(&r, tcp).post_copy, "{step}");
            r.mode = MigrationMode::PreCopy;
            assert!(!prepare_request(&r, tcp).post_copy, "{step}");
        }
    }
}
