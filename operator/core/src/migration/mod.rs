//! PodMigration's pure core: the phase machine (`machine`) and what it decides from
//! and returns (`observed`), the pre-flight checks and target selection
//! (`preflight`), the objects a migration owns (`render`), and the agent boundary the
//! controller drives (`agent`). Nothing here does I/O; the thin
//! controller in `crate::controllers::migration` fetches the observed state, calls
//! these, and applies what they return.

pub mod agent;
pub mod key;
pub mod machine;
pub mod observed;
pub mod pending;
pub mod preflight;
pub mod render;
pub mod stage;

#[cfg(test)]
mod fixtures;
#[cfg(test)]
mod machine_forward_tests;
#[cfg(test)]
mod machine_tests;
