//! Builders for the core's tests: `pod("web-0").on_node("n1").ready().with_sidecar()`,
//! `attachment("a").mode(Ingest).created(5)`, `group(...)`.

use std::collections::BTreeMap;

use k8s_openapi::jiff::Timestamp;
use podmotion_api::attachment::{
    AgentPort, AttachMode, IngestSession, NodeAgentAttachmentSpec, WorkloadKind, WorkloadRef,
};

use super::observed::{
    AttachmentView, ContainerView, JobRun, JobView, LeaseView, ObservedGroup, PodPhase, PodView,
};
use super::render::Settings;

pub fn t(secs: i64) -> Timestamp {
    Timestamp::from_second(secs).unwrap()
}

pub struct PodBuilder(PodView);

/// A pod of Deployment web with one container `app`, Pending, not scheduled.
pub fn pod(name: &str) -> PodBuilder {
    let n: u32 = name.bytes().map(u32::from).sum();
    PodBuilder(PodView {
        name: name.into(),
        uid: format!("uid-{name}"),
        labels: BTreeMap::from([("app".to_string(), "web".to_string())]),
        node: None,
        ip: Some(format!("10.244.{}.{}", n % 200, n % 250 + 1)),
        phase: PodPhase::Pending,
        ready: false,
        terminating: false,
        host_network: false,
        host_users: None,
        annotations: BTreeMap::new(),
        containers: vec![ContainerView {
            name: "app".into(),
            id: Some(format!("containerd://{name}-app-1")),
            ports: vec![(8080, Some("http".into()), "TCP".into())],
        }],
        tolerations: vec![],
    })
}

impl PodBuilder {
    pub fn on_node(mut self, node: &str) -> Self {
        self.0.node = Some(node.into());
        self
    }
    /// Running and Ready.
    pub fn ready(mut self) -> Self {
        self.0.phase = PodPhase::Running;
        self.0.ready = true;
        self
    }
    /// Running but not Ready.
    pub fn unready(mut self) -> Self {
        self.0.phase = PodPhase::Running;
        self.0.ready = false;
        self
    }
    pub fn pending(mut self) -> Self {
        self.0.phase = PodPhase::Pending;
        self.0.ready = false;
        self
    }
    pub fn failed(mut self) -> Self {
        self.0.phase = PodPhase::Failed;
        self.0.ready = false;
        self
    }
    pub fn succeeded(mut self) -> Self {
        self.0.phase = PodPhase::Succeeded;
        self.0.ready = false;
        self
    }
    pub fn terminating(mut self) -> Self {
        self.0.terminating = true;
        self
    }
    pub fn host_network(mut self) -> Self {
        self.0.host_network = true;
        self
    }
    pub fn host_users(mut self, v: bool) -> Self {
        self.0.host_users = Some(v);
        self
    }
    pub fn with_sidecar(self) -> Self {
        self.with_container("traffic-agent")
    }
    pub fn with_container(mut self, c: &str) -> Self {
        let name = &self.0.name;
        self.0.containers.push(ContainerView {
            name: c.into(),
            id: Some(format!("containerd://{name}-{c}-1")),
            ports: vec![],
        });
        self
    }
    pub fn annotated(mut self, k: &str, v: &str) -> Self {
        self.0.annotations.insert(k.into(), v.into());
        self
    }
    /// Every container restarted once: new container IDs.
    pub fn restarted(mut self) -> Self {
        for c in &mut self.0.containers {
            c.id =
                c.id.as_ref()
                    .map(|id| format!("{}-2", id.strip_suffix("-1").unwrap_or(id)));
        }
        self
    }
    pub fn uid(mut self, uid: &str) -> Self {
        self.0.uid = uid.into();
        self
    }
    pub fn build(self) -> PodView {
        self.0
    }
}

pub struct AttachmentBuilder(AttachmentView);

/// An Intercept attachment of Deployment web (all ports), created at t(0).
pub fn attachment(name: &str) -> AttachmentBuilder {
    AttachmentBuilder(AttachmentView {
        name: name.into(),
        uid: format!("uid-{name}"),
        generation: Some(1),
        created: t(0),
        deleting: false,
        spec: NodeAgentAttachmentSpec {
            workload_ref: web(),
            mode: AttachMode::Intercept,
            containers: vec![],
            ports: vec![],
            agent: Default::default(),
            sidecar: Default::default(),
            ingest: None,
        },
        lease: None,
        status: None,
    })
}

impl AttachmentBuilder {
    pub fn mode(mut self, m: AttachMode) -> Self {
        self.0.spec.mode = m;
        if m == AttachMode::Ingest {
            self.0.spec.ingest = Some(IngestSession {
                lease_name: None,
                lease_duration_seconds: 60,
            });
        }
        self
    }
    pub fn created(mut self, secs: i64) -> Self {
        self.0.created = t(secs);
        self
    }
    pub fn deleting(mut self) -> Self {
        self.0.deleting = true;
        self
    }
    pub fn ports(mut self, ports: &[i32]) -> Self {
        self.0.spec.ports = ports
            .iter()
            .map(|p| AgentPort {
                port: Some(*p),
                name: None,
                protocol: Default::default(),
            })
            .collect();
        self
    }
    pub fn agent_gid(mut self, gid: i64) -> Self {
        self.0.spec.agent.gid = gid;
        self
    }
    /// The session lease was last renewed at `t(secs)` for `duration` seconds.
    pub fn lease_renewed(mut self, secs: i64, duration: i32) -> Self {
        self.0.lease = Some(LeaseView {
            renewed: Some(t(secs)),
            duration_seconds: Some(duration),
        });
        self
    }
    pub fn build(self) -> AttachmentView {
        self.0
    }
}

pub fn web() -> WorkloadRef {
    WorkloadRef {
        kind: WorkloadKind::Deployment,
        name: "web".into(),
    }
}

pub fn settings() -> Settings {
    Settings::default()
}

/// Deployment web in namespace `shop`, observed at t(100).
pub fn group(
    attachments: Vec<AttachmentView>,
    pods: Vec<PodView>,
    jobs: Vec<JobView>,
) -> ObservedGroup {
    ObservedGroup {
        namespace: "shop".into(),
        workload: web(),
        workload_exists: true,
        attachments,
        pods,
        jobs,
        node_labels: BTreeMap::new(),
        now: t(100),
    }
}

/// The Jobs a plan creates, as they read back once they exist with a ready agent.
pub fn created_jobs(p: &super::Plan) -> Vec<JobView> {
    p.create
        .iter()
        .map(|c| {
            let mut v = JobView::from_job(&c.job).expect("rendered Jobs carry their target");
            v.uid = format!("juid-{}", c.pod);
            v.suspended = false;
            v.run = JobRun::Active { ready: true };
            v
        })
        .collect()
}
