//! The migration controller's state, shared by its steps: settings, the master key,
//! what this process knows of the transfer-key Secrets, the agent client, the stores
//! of migrations and agent pods, and the projection caches of the nodes and their load.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;
use podmotion_api::migration::MigrationPhase;
use podmotion_api::{PodMigration, PodMigrationStatus};

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
    /// Per migration UID: how far the last status this process wrote went (see
    /// [`Written`]).
    pub(super) written: std::sync::Mutex<BTreeMap<String, (Written, std::time::Instant)>>,
}

/// How long after its own status write this process waits for its cache to show it
/// before it trusts the cache again (a status rewritten by hand goes less far).
pub(super) const TRUST_CACHE_AFTER: std::time::Duration = std::time::Duration::from_secs(30);

/// How far a status went, by what only grows: the phases entered and whether a failure
/// was recorded. A status read back that went less far than the one this process
/// wrote last predates that write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Written {
    transitions: usize,
    failed: bool,
}

impl Written {
    pub(super) fn of(st: &PodMigrationStatus) -> Written {
        Written {
            transitions: st.phase_transition_timestamps.len(),
            failed: st.failure_reason.is_some(),
        }
    }

    /// Whether `observed` predates this write (it is behind it). Pure.
    pub(super) fn ahead_of(self, observed: &PodMigrationStatus) -> bool {
        let seen = Written::of(observed);
        seen.transitions < self.transitions || (self.failed && !seen.failed)
    }
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

    /// Records the status this process has just written for `pm` (or forgets the
    /// migration: `None`, once it is cleaned up).
    pub(super) fn remember_written(&self, pm: &PodMigration, st: Option<&PodMigrationStatus>) {
        let mut memo = self.written.lock().expect("written");
        let uid = pm.uid().unwrap_or_default();
        match st {
            Some(st) => memo.insert(uid, (Written::of(st), std::time::Instant::now())),
            None => memo.remove(&uid),
        };
    }

    /// Whether `pm`, as this round read it (from the controller's cache), predates the
    /// status this process wrote last: its watch has not delivered that write yet (a
    /// watch broken by an API server restart can lag for seconds). Deciding on it would
    /// undo what the write recorded, e.g. roll back a migration already committing.
    /// Bounded ([`TRUST_CACHE_AFTER`]): a status someone else rewrote is trusted then.
    pub(super) fn behind_own_write(&self, pm: &PodMigration) -> bool {
        let observed = pm.status.clone().unwrap_or_default();
        self.written
            .lock()
            .expect("written")
            .get(&pm.uid().unwrap_or_default())
            .is_some_and(|(w, at)| at.elapsed() < TRUST_CACHE_AFTER && w.ahead_of(&observed))
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use podmotion_api::migration::PhaseTransition;

    fn status(phases: &[MigrationPhase], failed: bool) -> PodMigrationStatus {
        PodMigrationStatus {
            phase: *phases.last().unwrap_or(&MigrationPhase::Pending),
            phase_transition_timestamps: phases
                .iter()
                .map(|p| PhaseTransition {
                    phase: *p,
                    time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
                })
                .collect(),
            failure_reason: failed.then(|| "Aborted".into()),
            ..Default::default()
        }
    }

    #[test]
    fn a_status_that_went_less_far_than_the_last_write_predates_it() {
        use MigrationPhase as P;
        let committing = Written::of(&status(
            &[
                P::Preparing,
                P::Checkpointing,
                P::Transferring,
                P::Restoring,
                P::Committing,
            ],
            false,
        ));
        let transferring = status(&[P::Preparing, P::Checkpointing, P::Transferring], false);
        assert!(committing.ahead_of(&transferring));
        // Rolling back from Transferring (a failure recorded, no new phase) is ahead of
        // the same phases without it, and behind nothing with both.
        let rolling_back = Written::of(&status(
            &[P::Preparing, P::Checkpointing, P::Transferring],
            true,
        ));
        assert!(rolling_back.ahead_of(&transferring));
        assert!(!rolling_back.ahead_of(&status(
            &[P::Preparing, P::Checkpointing, P::Transferring],
            true
        )));
        // What the write recorded, or more (another replica's later write), is not behind.
        assert!(!committing.ahead_of(&status(
            &[
                P::Preparing,
                P::Checkpointing,
                P::Transferring,
                P::Restoring,
                P::Committing
            ],
            false
        )));
        assert!(!committing.ahead_of(&status(
            &[
                P::Preparing,
                P::Checkpointing,
                P::Transferring,
                P::Restoring,
                P::Committing,
                P::Succeeded
            ],
            false
        )));
    }
}
