//! Builders for the RunnerPool core's tests: `pool("rp").sessions(4).build()`.

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube_core::ObjectMeta;
use podmotion_api::runner_pool::{LivenessProbe, RunnerPool, RunnerPoolSpec, ServerRef};

use super::{Inputs, ServerEndpoint};

pub const IMAGE: &str = "registry.example/compass/runner@sha256:4f1c3a2b5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708";
pub const PREFLIGHT_IMAGE: &str = "registry.example/podmotion/preflight@sha256:00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

pub struct PoolBuilder(RunnerPool);

/// A valid RunnerPool in namespace `runners` with every default.
pub fn pool(name: &str) -> PoolBuilder {
    let spec: RunnerPoolSpec = serde_json::from_value(serde_json::json!({
        "image": IMAGE,
        "sessionsPerNode": 4,
        "server": {"serviceName": "compass-server", "namespace": "compass", "port": 8443}
    }))
    .expect("fixture spec");
    let mut rp = RunnerPool::new(name, spec);
    rp.metadata = ObjectMeta {
        name: Some(name.into()),
        namespace: Some("runners".into()),
        uid: Some("0d6c1f7e-1111-4222-8333-944455556666".into()),
        generation: Some(1),
        ..Default::default()
    };
    PoolBuilder(rp)
}

impl PoolBuilder {
    pub fn sessions(mut self, n: i32) -> Self {
        self.0.spec.sessions_per_node = n;
        self
    }
    pub fn guest(mut self, memory_mib: i64, milli_cpu: i64) -> Self {
        self.0.spec.session.memory_mib = memory_mib;
        self.0.spec.session.milli_cpu = milli_cpu;
        self
    }
    pub fn overhead(
        mut self,
        mem: i64,
        cpu: i64,
        page_tables: i64,
        runner_mem: i64,
        runner_cpu: i64,
    ) -> Self {
        let o = &mut self.0.spec.overhead;
        (
            o.per_session_memory_mib,
            o.per_session_milli_cpu,
            o.page_table_mib_per_guest_gib,
        ) = (mem, cpu, page_tables);
        (o.runner_memory_mib, o.runner_milli_cpu) = (runner_mem, runner_cpu);
        self
    }
    pub fn reap_budget(mut self, s: i32) -> Self {
        self.0.spec.reap_budget_seconds = s;
        self
    }
    pub fn max_unavailable(mut self, v: IntOrString) -> Self {
        self.0.spec.rollout.max_unavailable = v;
        self
    }
    pub fn liveness(mut self, period: i32, threshold: i32) -> Self {
        self.0.spec.probes.liveness = Some(LivenessProbe {
            path: "/livez".into(),
            period_seconds: period,
            failure_threshold: threshold,
        });
        self
    }
    pub fn secret(mut self, name: &str) -> Self {
        self.0.spec.credentials.secret_name = Some(name.into());
        self
    }
    pub fn reference_priority_class(mut self, name: &str) -> Self {
        self.0.spec.priority_class.name = name.into();
        self.0.spec.priority_class.create = false;
        self
    }
    pub fn node_label(mut self, key: &str, value: &str) -> Self {
        self.0.spec.nodes.label_key = key.into();
        self.0.spec.nodes.label_value = value.into();
        self
    }
    pub fn server_in_own_namespace(mut self) -> Self {
        self.0.spec.server = ServerRef {
            service_name: "compass-server".into(),
            namespace: None,
            port: 8443,
        };
        self
    }
    pub fn generation(mut self, g: i64) -> Self {
        self.0.metadata.generation = Some(g);
        self
    }
    pub fn build(self) -> RunnerPool {
        self.0
    }
}

/// Inputs with three eligible nodes, a resolved Server and a known token.
pub fn inputs() -> Inputs {
    Inputs {
        preflight_image: PREFLIGHT_IMAGE.into(),
        log_format: podmotion_log::LogFormat::Json,
        platform: crate::platform::Platform::default(),
        eligible_nodes: 3,
        server: Some(ServerEndpoint {
            namespace: "compass".into(),
            selector: [("app".to_string(), "compass-server".to_string())].into(),
            target_port: IntOrString::Int(9443),
        }),
        credential_token: Some("s3cr3t-token".into()),
    }
}
