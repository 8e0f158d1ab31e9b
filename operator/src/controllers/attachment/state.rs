//! The attachment controller's state, shared by its steps: settings, the projection
//! caches of pods, agent Jobs and nodes' platform labels, and the attachments' store; and whether a step may
//! create or only delete.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;
use podmotion_api::NodeAgentAttachment;

use super::settings::AttachmentConfig;
use crate::attachment::observed::LeaseView;
use crate::attachment::render::Settings;
use crate::attachment::{JobView, PodView};
use crate::cache::{Key, Projection};
use crate::context::Context;

pub(super) const NAME: &str = "attachment";

/// A node's platform labels (`kubernetes.io/os`, `kubernetes.io/arch`).
pub(super) type PlatformLabels = std::collections::BTreeMap<String, String>;

/// The controller: settings, caches and the attachments' store.
pub(super) struct Shared {
    pub(super) ctx: Arc<Context>,
    pub(super) cfg: AttachmentConfig,
    pub(super) settings: Settings,
    pub(super) store: Store<DeserializeGuard<NodeAgentAttachment>>,
    pub(super) pods: Arc<Projection<PodView>>,
    pub(super) jobs: Arc<Projection<JobView>>,
    pub(super) nodes: Arc<Projection<PlatformLabels>>,
    /// The watched namespaces' Leases: what wakes an ingest when its client renews.
    pub(super) leases: Arc<Projection<LeaseView>>,
    pub(super) policy_applied: AtomicBool,
}

impl Shared {
    /// Whether every cache has its first complete list (the attachments' store is
    /// waited for by the controller runtime itself).
    pub(super) fn caches_ready(&self) -> bool {
        self.pods.is_ready() && self.jobs.is_ready() && self.nodes.is_ready()
    }

    pub(super) fn job_key(&self, name: &str) -> Key {
        (self.settings.namespace.clone(), name.into())
    }
}

/// Whether a workload reconcile may create Jobs and Leases, or only delete (the sweep).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Full,
    DeletesOnly,
}
