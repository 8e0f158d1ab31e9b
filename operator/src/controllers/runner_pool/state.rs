//! What every step of the RunnerPool controller shares: the context, the settings and
//! the projection caches a round reads from (its own module, below the steps that use
//! it, so `mod.rs` and the steps do not name each other).

use std::sync::Arc;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::caches::NodeLabels;
use super::settings::RunnerPoolConfig;
use crate::cache::Projection;
use crate::context::Context;

pub(super) struct Shared {
    pub(super) ctx: Arc<Context>,
    pub(super) cfg: RunnerPoolConfig,
    pub(super) daemonsets: Arc<Projection<DaemonSet>>,
    pub(super) pods: Arc<Projection<Pod>>,
    pub(super) policies: Arc<Projection<NetworkPolicy>>,
    pub(super) nodes: Arc<Projection<NodeLabels>>,
}

impl Shared {
    pub(super) fn caches_ready(&self) -> bool {
        self.daemonsets.is_ready()
            && self.pods.is_ready()
            && self.policies.is_ready()
            && self.nodes.is_ready()
    }
}
