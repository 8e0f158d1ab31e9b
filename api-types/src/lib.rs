//! PodMotion's API: the three custom resources of `podmotion.io/v1alpha1`, the names
//! (labels, annotations, finalizers, condition types and reasons) every component
//! shares, and the condition helpers that keep status kstatus-compatible.
//!
//! This crate has no I/O. The operator, the executors and the CRD generator all
//! depend on it, so a name is defined here once and nowhere else.
#![forbid(unsafe_code)]

pub mod attachment;
pub mod conditions;
pub mod crds;
pub mod migration;
pub mod names;
pub mod runner_pool;
pub mod samples;

pub use attachment::{NodeAgentAttachment, NodeAgentAttachmentSpec, NodeAgentAttachmentStatus};
pub use migration::{PodMigration, PodMigrationSpec, PodMigrationStatus};
pub use runner_pool::{RunnerPool, RunnerPoolSpec, RunnerPoolStatus};

/// API group of every PodMotion resource.
pub const GROUP: &str = "podmotion.io";
/// The one served and stored version.
pub const VERSION: &str = "v1alpha1";
