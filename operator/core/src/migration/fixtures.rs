//! Builders for the pure core's tests: `pod("web-0").on("n0").build()`,
//! `node("n1").without_agent().build()`, `spec("web-0").cold().build()`,
//! `at(Checkpointing).source(done(PreDump(1)).dirty(..))`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, Pod, PodSpec, PodStatus, ResourceRequirements, Taint, Toleration, Volume,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use kube_core::ObjectMeta;
use podmotion_api::PodMigration;
use podmotion_api::migration::{
    MigrationMode, MigrationPhase, PhaseTransition, PodMigrationSpec, PodMigrationStatus, PreCopy,
};
use serde_json::{Value, json};

use super::agent::{AgentProgress, AgentReport, AgentView, Step, StepState};
use super::machine::{Knobs, Observed, Plan, Preflight, SourcePodFacts, TargetPodFacts};
use super::preflight::{ClaimFacts, Me, NodeFacts, OwnerFacts, PodFacts, Resources};

pub const SOURCE_UID: &str = "5a1c0000-0000-4000-8000-000000000001";

pub fn ts(s: i64) -> Timestamp {
    Timestamp::from_second(s).unwrap()
}

/// `t` to the second below, as the API's timestamps carry it.
pub fn whole_second(t: Timestamp) -> Timestamp {
    ts(t.as_second())
}

// ------------------------------------------------------------------ preflight

pub struct PodB(PodFacts);
pub fn pod(name: &str) -> PodB {
    PodB(PodFacts {
        name: name.into(),
        uid: SOURCE_UID.into(),
        node: None,
        running: true,
        terminating: false,
        owner: Some(OwnerFacts {
            kind: "ReplicaSet".into(),
            name: "web-abc".into(),
            uid: "rs-uid".into(),
        }),
        requests: Resources {
            cpu_millis: 100,
            memory_bytes: 64 << 20,
        },
        node_selector: BTreeMap::new(),
        tolerations: vec![],
        required_node_affinity: None,
        namespace: "apps".into(),
        static_pod: false,
        host_namespaces: vec![],
        containers: vec!["app".into()],
        extended_resources: vec![],
        local_volumes: vec![],
        node_attached_disks: vec![],
        claims: vec![],
        readiness_exec_probe: false,
        non_root_containers: vec![],
        not_running_containers: vec![],
    })
}
impl PodB {
    pub fn on(mut self, n: &str) -> Self {
        self.0.node = Some(n.into());
        self
    }
    pub fn pending(mut self) -> Self {
        self.0.running = false;
        self
    }
    pub fn terminating(mut self) -> Self {
        self.0.terminating = true;
        self
    }
    pub fn owned_by(mut self, kind: &str, name: &str) -> Self {
        self.0.owner = Some(OwnerFacts {
            kind: kind.into(),
            name: name.into(),
            uid: "owner-uid".into(),
        });
        self
    }
    pub fn requests(mut self, cpu_millis: u64, memory_bytes: u64) -> Self {
        self.0.requests = Resources {
            cpu_millis,
            memory_bytes,
        };
        self
    }
    pub fn tolerates(mut self, key: &str, value: &str) -> Self {
        self.0.tolerations.push(Toleration {
            key: Some(key.into()),
            operator: Some("Equal".into()),
            value: Some(value.into()),
            effect: Some("NoSchedule".into()),
            ..Default::default()
        });
        self
    }
    pub fn node_selector(mut self, k: &str, v: &str) -> Self {
        self.0.node_selector.insert(k.into(), v.into());
        self
    }
    pub fn build(self) -> PodFacts {
        self.0
    }
}

pub struct NodeB(NodeFacts);
pub fn node(name: &str) -> NodeB {
    NodeB(NodeFacts {
        name: name.into(),
        labels: BTreeMap::new(),
        schedulable: true,
        taints: vec![],
        allocatable: Resources {
            cpu_millis: 16_000,
            memory_bytes: 64 << 30,
        },
        requested: Resources::default(),
        has_ready_agent: true,
    })
}
impl NodeB {
    pub fn without_agent(mut self) -> Self {
        self.0.has_ready_agent = false;
        self
    }
    pub fn allocatable(mut self, cpu_millis: u64, memory_bytes: u64) -> Self {
        self.0.allocatable = Resources {
            cpu_millis,
            memory_bytes,
        };
        self
    }
    pub fn used(mut self, cpu_millis: u64, memory_bytes: u64) -> Self {
        self.0.requested = Resources {
            cpu_millis,
            memory_bytes,
        };
        self
    }
    pub fn label(mut self, k: &str, v: &str) -> Self {
        self.0.labels.insert(k.into(), v.into());
        self
    }
    pub fn cordoned(mut self) -> Self {
        self.0.schedulable = false;
        self
    }
    pub fn taint(mut self, k: &str, v: &str, effect: &str) -> Self {
        self.0.taints.push(Taint {
            key: k.into(),
            value: Some(v.into()),
            effect: effect.into(),
            time_added: None,
        });
        self
    }
    pub fn build(self) -> NodeFacts {
        self.0
    }
}

pub struct SpecB(PodMigrationSpec);
pub fn spec(pod: &str) -> SpecB {
    SpecB(serde_json::from_value(serde_json::json!({ "podName": pod })).unwrap())
}
impl SpecB {
    pub fn uid(mut self, u: &str) -> Self {
        self.0.pod_uid = Some(u.into());
        self
    }
    pub fn target(mut self, n: &str) -> Self {
        self.0.target_node = Some(n.into());
        self
    }
    pub fn selector(mut self, k: &str, v: &str) -> Self {
        self.0
            .target_node_selector
            .get_or_insert_with(Default::default)
            .insert(k.into(), v.into());
        self
    }
    pub fn post_copy(mut self) -> Self {
        self.0.mode = MigrationMode::PostCopy;
        self
    }
    pub fn cold(mut self) -> Self {
        self.0.mode = MigrationMode::Cold;
        self
    }
    pub fn leave_local_data_behind(mut self) -> Self {
        self.0.leave_local_data_behind = true;
        self
    }
    pub fn dry_run(mut self) -> Self {
        self.0.dry_run = true;
        self
    }
    pub fn budget_millis(mut self, ms: i64) -> Self {
        self.0.freeze_budget_millis = ms;
        self
    }
    pub fn rounds(mut self, max_rounds: i32, dirty_threshold_bytes: i64) -> Self {
        self.0.pre_copy = Some(PreCopy {
            max_rounds,
            dirty_threshold_bytes,
        });
        self
    }
    pub fn build(self) -> PodMigrationSpec {
        self.0
    }
}

/// A Pod object as the API server returns it: Running on `node`, one container with
/// requests 100m/64Mi, a controller owner.
pub fn k8s_pod(name: &str, node: &str, owner_kind: &str, owner_name: &str) -> Pod {
    let requests = BTreeMap::from([
        ("cpu".to_string(), Quantity("100m".into())),
        ("memory".to_string(), Quantity("64Mi".into())),
    ]);
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("apps".into()),
            uid: Some(SOURCE_UID.into()),
            owner_references: Some(vec![OwnerReference {
                api_version: "apps/v1".into(),
                kind: owner_kind.into(),
                name: owner_name.into(),
                uid: "owner-uid".into(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            containers: vec![Container {
                name: "app".into(),
                image: Some("example/app:1".into()),
                env: Some(vec![]),
                readiness_probe: Some(Default::default()),
                resources: Some(ResourceRequirements {
                    requests: Some(requests),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            init_containers: Some(vec![Container {
                name: "init".into(),
                ..Default::default()
            }]),
            volumes: Some(vec![Volume {
                name: "scratch".into(),
                empty_dir: Some(Default::default()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            ..Default::default()
        }),
    }
}

/// A stored PodMigration (namespace, UID) for `pod`.
pub fn migration(name: &str, pod: &str) -> PodMigration {
    let mut m = PodMigration::new(name, spec(pod).build());
    m.metadata.namespace = Some("apps".into());
    m.metadata.uid = Some("9e3f0000-0000-4000-8000-00000000abcd".into());
    m
}

/// The PodMigration deciding in the pre-flight tests (`move-web`, created at 100), exec
/// probes off.
pub fn me() -> Me {
    Me {
        name: "move-web".into(),
        uid: "0c5b5e52-0000-4000-8000-000000000001".into(),
        created: ts(100),
        operator_namespace: "podmotion-system".into(),
        agents_namespace: "podmotion-system-agents".into(),
        exec_probes: false,
    }
}

/// A running ReplicaSet pod `web-0` on n0 in `apps` with one container (100m/64Mi,
/// no volumes), with `patch` merged into its manifest (objects merged, everything
/// else replaced), read as the controller reads it.
pub fn k8s(patch: Value) -> PodFacts {
    let mut pod = json!({
        "metadata": {"name": "web-0", "namespace": "apps",
            "uid": SOURCE_UID,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "name": "web-abc", "uid": "rs-uid", "controller": true}]},
        "spec": {"nodeName": "n0", "containers": [{"name": "app", "image": "app:1",
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]},
        "status": {"phase": "Running"}
    });
    merge(&mut pod, patch);
    PodFacts::from_pod(&serde_json::from_value(pod).unwrap())
}

pub fn merge(into: &mut Value, patch: Value) {
    match (into, patch) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

/// A pod patch mounting claim `claim` as volume `data`.
pub fn claim_volume(claim: &str) -> Value {
    json!({"spec": {"volumes": [{"name": "data",
        "persistentVolumeClaim": {"claimName": claim}}]}})
}

/// Bound claims with these access modes, on network volumes.
pub fn claims(list: &[(&str, &[&str])]) -> BTreeMap<String, ClaimFacts> {
    list.iter()
        .map(|(name, modes)| {
            (
                name.to_string(),
                ClaimFacts {
                    access_modes: modes.iter().map(|m| m.to_string()).collect(),
                    volume_name: Some(format!("pv-{name}")),
                    ..Default::default()
                },
            )
        })
        .collect()
}

// -------------------------------------------------------------------- machine

/// A report whose last step is `step` in `state`.
pub fn report(step: Step, state: StepState) -> AgentReport {
    AgentReport {
        last: Some((step, state)),
        progress: AgentProgress::default(),
    }
}
pub fn done(step: Step) -> AgentReport {
    report(step, StepState::Done)
}
pub fn running(step: Step) -> AgentReport {
    report(step, StepState::Running)
}
pub fn failed(step: Step, category: &str) -> AgentReport {
    report(
        step,
        StepState::Failed {
            category: category.into(),
            message: "boom".into(),
        },
    )
}
pub fn blank() -> AgentReport {
    AgentReport::default()
}

pub trait ReportExt {
    fn dirty(self, bytes: u64, rate: u64) -> Self;
    fn frozen_at(self, t: Timestamp) -> Self;
    fn resumed_at(self, t: Timestamp) -> Self;
    fn sent(self, iteration: u32, bytes: u64) -> Self;
    /// Source: the restore fence holds.
    fn fenced(self) -> Self;
    /// Source: fenced, then killed on its node (its agent's watchdog).
    fn killed_under_fence(self) -> Self;
    /// PostCopy: `bytes` of pages moved after the resume, every page in or not.
    fn lazy(self, bytes: u64, done: bool) -> Self;
    /// PostCopy: the lazy phase failed.
    fn lazy_failed(self, why: &str) -> Self;
}
impl ReportExt for AgentReport {
    fn dirty(mut self, bytes: u64, rate: u64) -> Self {
        self.progress.dirty_bytes = Some(bytes);
        self.progress.rate_bytes_per_second = Some(rate);
        self
    }
    fn frozen_at(mut self, t: Timestamp) -> Self {
        self.progress.frozen_at = Some(t);
        self
    }
    fn resumed_at(mut self, t: Timestamp) -> Self {
        self.progress.resumed_at = Some(t);
        self
    }
    fn fenced(mut self) -> Self {
        self.progress.fenced = true;
        self
    }
    fn killed_under_fence(mut self) -> Self {
        self.progress.fenced = true;
        self.progress.killed_under_fence = true;
        self
    }
    fn lazy(mut self, bytes: u64, done: bool) -> Self {
        self.progress.lazy_bytes = bytes;
        self.progress.lazy_done = done;
        self
    }
    fn lazy_failed(mut self, why: &str) -> Self {
        self.progress.lazy_error = Some(why.into());
        self
    }
    fn sent(mut self, iteration: u32, bytes: u64) -> Self {
        self.progress.iteration = iteration;
        self.progress.bytes_sent = bytes;
        self
    }
}

/// The clock of machine fixtures: created at 1000, now at 1010.
pub const CREATED: i64 = 1000;
pub const NOW: i64 = 1010;

/// An Observed in `phase` whose facts are the healthy, expected ones for that phase:
/// pods present and running, agents reporting the step that phase ends with.
pub fn at(phase: MigrationPhase) -> Observed {
    use MigrationPhase as P;
    let rank = super::machine::rank(phase);
    let status = PodMigrationStatus {
        phase,
        phase_transition_timestamps: vec![PhaseTransition {
            phase,
            time: Time(ts(NOW - 1)),
        }],
        source_pod_uid: (rank >= 1).then(|| SOURCE_UID.into()),
        source_node: Some("n0".into()),
        target_node: Some("n1".into()),
        target_pod: (rank >= 1).then(|| "web-0-pm-1234abcd".into()),
        ..Default::default()
    };
    let (source, target) = match phase {
        P::Pending => (blank(), blank()),
        P::Preparing => (blank(), blank()),
        P::Checkpointing => (running(Step::PreDump(1)), done(Step::Receive)),
        P::Transferring => (
            running(Step::Transfer).frozen_at(ts(NOW)),
            done(Step::Receive),
        ),
        // The target restores only once the source acknowledged the restore fence.
        P::Restoring => (
            done(Step::Fence).fenced().frozen_at(ts(NOW)),
            running(Step::Restore),
        ),
        P::Committing => (
            done(Step::Fence).fenced().frozen_at(ts(NOW)),
            done(Step::Probe).resumed_at(ts(NOW)),
        ),
        P::Succeeded | P::Failed | P::Aborted => (done(Step::Cleanup), done(Step::Cleanup)),
    };
    // A budget long enough that the freeze watchdog stays out of tables about other
    // events; the freeze-budget tests set their own.
    let mut knobs = Knobs::from_spec(&spec("web-0").build());
    knobs.freeze_budget_millis = 24 * 3600 * 1000;
    Observed {
        pod_name: "web-0".into(),
        now: ts(NOW),
        created: ts(CREATED),
        generation: Some(1),
        knobs,
        status,
        has_finalizer: true,
        deletion_requested: false,
        preflight: (phase == P::Pending).then(|| {
            Preflight::Migratable(Plan {
                source_node: "n0".into(),
                target_node: "n1".into(),
                source_pod_uid: SOURCE_UID.into(),
                target_pod: "web-0-pm-1234abcd".into(),
            })
        }),
        slot_available: true,
        source_pod: Some(SourcePodFacts {
            uid: SOURCE_UID.into(),
            running: true,
            terminating: false,
            deletion_grace_seconds: None,
            deletion_accepted: None,
            deletion_cost_lowered: false,
        }),
        target_pod: (1..=5).contains(&rank).then_some(TargetPodFacts {
            running: true,
            unusable: None,
            terminating: false,
            handed_over: false,
            awaiting_adoption: false,
        }),
        transfer_key_present: (1..=5).contains(&rank),
        source_agent: AgentView::reported(source),
        target_agent: AgentView::reported(target),
    }
}

/// Fluent edits of an Observed.
pub trait ObservedExt {
    fn source(self, r: AgentReport) -> Self;
    fn target(self, r: AgentReport) -> Self;
    fn source_view(self, v: AgentView) -> Self;
    fn target_view(self, v: AgentView) -> Self;
    fn knobs(self, s: PodMigrationSpec) -> Self;
    fn deleting(self) -> Self;
    fn failing(self, reason: &str) -> Self;
    fn at_second(self, s: i64) -> Self;
    /// The target pod handed over and adopted by the source's owner.
    fn adopted(self) -> Self;
    /// The source pod terminating, deleted with this grace period.
    fn source_terminating(self, grace_seconds: i64) -> Self;
    /// [`Knobs::kill_settle`] later: the source's kubelet has had the time to see its
    /// pod's deletion, and the Services to let it go.
    fn kubelet_settled(self) -> Self;
}
impl ObservedExt for Observed {
    fn source(mut self, r: AgentReport) -> Self {
        self.source_agent = AgentView::reported(r);
        self
    }
    fn target(mut self, r: AgentReport) -> Self {
        self.target_agent = AgentView::reported(r);
        self
    }
    fn source_view(mut self, v: AgentView) -> Self {
        self.source_agent = v;
        self
    }
    fn target_view(mut self, v: AgentView) -> Self {
        self.target_agent = v;
        self
    }
    fn knobs(mut self, s: PodMigrationSpec) -> Self {
        self.knobs = Knobs::from_spec(&s);
        self
    }
    fn deleting(mut self) -> Self {
        self.deletion_requested = true;
        self
    }
    fn failing(mut self, reason: &str) -> Self {
        self.status.failure_reason = Some(reason.into());
        self.status.failure_message = Some("earlier failure".into());
        self
    }
    fn at_second(mut self, s: i64) -> Self {
        self.now = ts(s);
        self
    }
    fn adopted(mut self) -> Self {
        let tp = self.target_pod.as_mut().expect("a target pod");
        tp.handed_over = true;
        tp.awaiting_adoption = false;
        self
    }
    fn source_terminating(mut self, grace_seconds: i64) -> Self {
        let s = self.source_pod.as_mut().expect("a source pod");
        s.terminating = true;
        s.deletion_grace_seconds = Some(grace_seconds);
        s.deletion_accepted = Some(whole_second(self.now));
        self
    }
    fn kubelet_settled(mut self) -> Self {
        self.now += self.knobs.kill_settle();
        self
    }
}
