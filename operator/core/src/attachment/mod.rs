//! The pure core of the NodeAgentAttachment controller: from the observed state of one
//! workload (its attachments, pods, agent Jobs and ingest leases) to the Jobs that must
//! exist, the Jobs that must go, and every attachment's status.
//!
//! All attachments that claim the same workload are planned together, because they share
//! that workload's Jobs: one Job per target pod, named deterministically from the pod
//! ([`naming`]). Which pods are targets and which are skipped, and why, is
//! [`selection`]; whether an existing Job is still wanted is decided by exactly one
//! predicate, [`reap::wanted`], which every removal path (finalizer, lease expiry,
//! orphan sweep) reaches through [`plan::plan`]; [`render`] builds the Job, its
//! credential Secret, the ingest Lease and the deny-all-ingress NetworkPolicy;
//! [`notes`] words the Events about Job changes. Nothing here does I/O.

pub mod naming;
pub mod notes;
pub mod observed;
pub mod plan;
pub mod reap;
pub mod render;
pub mod selection;

#[cfg(test)]
pub(crate) mod fixtures;

pub use naming::job_name;
pub use observed::{AttachmentView, JobRun, JobView, LeaseView, ObservedGroup, PodPhase, PodView};
pub use plan::{Plan, plan};
pub use reap::{JobFate, ReapReason, ReplaceReason, wanted};
pub use render::Settings;
