//! Pre-flight checks and target selection: is this pod migratable, and to where?
//!
//! Runs before anything is frozen. The verdict becomes the `Migratable` condition; a
//! pod that fails a check keeps running untouched. Inputs are plain facts extracted
//! from the pod, its claims, the nodes and the other PodMigrations
//! (`PodFacts::from_pod`, `ClaimFacts::from_objects`, `NodeFacts::from_node`), so every
//! rule is tested without a cluster. What cannot move at all (host namespaces, data on
//! the node, devices, static pods, protected namespaces, a container that cannot move
//! with the pod's others) is refused here, each with its own reason.
//!
//! The module is split along its seams, from the bottom up: the quantities and
//! requests the checks count with (`resources`); the facts they read of the source pod
//! and its claims (`pod`); this PodMigration and the others, for one migration per pod
//! and the concurrency slots (`migrations`); the nodes and which one takes the pod
//! (`target`); and the checks themselves, in the order their refusals take precedence,
//! with the verdict (`checks`).

mod checks;
mod migrations;
mod pod;
mod resources;
mod target;

pub use checks::{EXEC_PROBE_DISABLED, MAX_CONTAINERS, exec_probes_disabled_message, preflight};
pub use migrations::{Limits, Me, OtherMigration, SlotHolder, slot_available};
pub use pod::{ClaimFacts, OwnerFacts, PodClaim, PodFacts, claim_names};
pub use resources::{Resources, pod_requests, quantity};
pub use target::{NodeFacts, select_target, unfit_reason};

/// Why a pod cannot be migrated now: an Event/condition reason and a message.
pub type Refusal = (&'static str, String);
