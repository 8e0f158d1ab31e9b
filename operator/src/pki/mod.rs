//! Key material made and rotated at run time by the operator (nothing is generated
//! when the chart renders): the agents' CA (a Secret in the operator's namespace,
//! rotated with an overlapping bundle), the CA bundle the agents trust (a ConfigMap in
//! the agents' namespace), the operator's client certificate (in memory, per replica),
//! node agent certificates (signed from Kubernetes CertificateSigningRequests with the
//! signer `podmotion.io/agent-serving`, only for the agent pod of the node whose
//! identity is asked for), and the migration master key (a Secret, created once).
//!
//! [`plan`] holds every decision (pure, unit-tested) and [`issue`] makes certificates,
//! both in `podmotion-core`; [`shell`] reads and writes the API, the leader alone writing;
//! [`signer`] signs the agents' requests, a controller through the controllers' shell.

pub mod shell;
pub mod signer;

// The pure part, in the core crate, under its old paths.
pub use podmotion_core::pki::{issue, plan};

pub use plan::AGENT_SIGNER;
pub use shell::{Pki, PkiSettings};
