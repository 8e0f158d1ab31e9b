//! The PKI's pure part: every decision about the agents' CA and their certificates
//! ([`plan`]) and making and signing certificates in memory ([`issue`]). The runtime's
//! `pki::shell` reads and writes the API.

pub mod issue;
pub mod plan;

pub use plan::AGENT_SIGNER;
