//! The migration controller's state, shared by its steps: settings, the master key,
//! what this process knows of the transfer-key Secrets, the agent client, the stores
//! of migrations and agent pods, and the projection caches of the nodes and their load.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;

use super::settings::MigrationConfig;
use crate::cache::Projection;
use crate::context::Context;
use crate::migration::key::MasterKey;
use crate::migration::pending::PodLoad;
use crate::migration::preflight::NodeFacts;

/// The controller: settings, keys, agents and stores.
pub(super) struct Shared<A> {
    pub(super) ctx: Arc<Context>,
    /// Transfer keys are derived from it (see `migration::key`).
    pub(super) master_key: MasterKey,
    /// Per migration UID: whether this process created (true) or deleted (false) its
    /// transfer-key Secret. The operator cannot read Secrets back, so after a restart
    /// a migration past `Pending` is assumed to have its key until cleanup deletes it.
    pub(super) key_secrets: std::sync::Mutex<BTreeMap<String, bool>>,
    pub(super) cfg: MigrationConfig,
    pub(super) agents: Arc<A>,
    pub(super) store: Store<DeserializeGuard<PodMigration>>,
    /// The node agents' pods (watched; endpoints come from their IPs).
    pub(super) agent_pods: Store<Pod>,
    /// Every node, as the pre-flight sees it (without load and agent).
    pub(super) nodes: Arc<Projection<NodeFacts>>,
    /// Every non-terminal pod bound to a node, cluster-wide (what it takes from it).
    pub(super) load: Arc<Projection<PodLoad>>,
}

impl<A> Shared<A> {
    /// Records that this process created (`Some(true)`) or deleted (`Some(false)`) the
    /// migration's key Secret, or forgets the migration (`None`).
    pub(super) fn remember_key_secret(&self, pm: &PodMigration, exists: Option<bool>) {
        let mut memo = self.key_secrets.lock().expect("key secrets");
        let uid = pm.uid().unwrap_or_default();
        match exists {
            Some(e) => memo.insert(uid, e),
            None => memo.remove(&uid),
        };
    }

    /// Whether the migration's key Secret exists, as far as this process knows.
    pub(super) fn key_present(&self, pm: &PodMigration, phase: MigrationPhase) -> bool {
        self.key_secrets
            .lock()
            .expect("key secrets")
            .get(&pm.uid().unwrap_or_default())
            .copied()
            .unwrap_or(phase != MigrationPhase::Pending)
    }
}
