//! PodMotion's pure cores: `migration`, `attachment` and `runner_pool` (one per custom
//! resource), which release reconciles an object (`claim`), the PKI's decisions and
//! certificate making (`pki`), the platform of PodMotion's own images (`platform`), the object metadata the cores and the runtime share
//! (`meta`) and what a core wants said as an Event (`note`).
//!
//! They take plain structs and return desired objects, next steps and status. This
//! crate has no API client, async runtime, wire protocol or clock among its
//! dependencies (`hack/check-layers.sh`), so a core that tried to do I/O would not
//! compile; time comes in as a value. The runtime (the `podmotion-operator` crate)
//! fetches, applies, talks to the agents and re-exports these modules under the same
//! paths.
#![forbid(unsafe_code)]

pub mod attachment;
pub mod claim;
pub mod eviction;
pub mod meta;
pub mod migration;
pub mod note;
pub mod pki;
pub mod platform;
pub mod runner_pool;
