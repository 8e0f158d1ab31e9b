//! The agent Job contract: what the attachment controller (operator) writes into an
//! agent Job's environment and what the attach executor reads from it, defined once.
//! The operator renders with these types and names, the executor parses with them, and
//! `e2e/tests/attach_contract.rs` renders a Job and parses it back end to end.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Environment variable names of the agent container.
pub mod env {
    /// [`AgentConfig`](super::AgentConfig) as JSON: the sidecar-compatible configuration.
    pub const AGENT_CONFIG: &str = "AGENT_CONFIG";
    /// JSON object, container name → CRI container ID (`containerd://…` accepted).
    pub const AGENT_CONTAINER_IDS: &str = "AGENT_CONTAINER_IDS";
    /// Where the node's runtime socket directory (or `/run`) is mounted; probed.
    pub const AGENT_CRI_SOCKET_DIR: &str = "AGENT_CRI_SOCKET_DIR";
    /// Where the runtime socket itself is mounted (when the installer named a socket).
    pub const CRI_SOCKET: &str = "PODMOTION_CRI_SOCKET";
    /// Directory holding `token`, the control API's bearer token (manual runs; the
    /// controller gives [`AGENT_TOKEN_SHA256`] instead).
    pub const AGENT_CREDENTIALS_DIR: &str = "AGENT_CREDENTIALS_DIR";
    /// The control API's token verifier: [`token_verifier`](super::token_verifier) of
    /// the bearer token, which itself lives only in a Secret of the attachment's own
    /// namespace. Set but empty is an error (the agent never serves without one).
    pub const AGENT_TOKEN_SHA256: &str = "AGENT_TOKEN_SHA256";
    /// Port of the control API on the target pod's loopback (`127.0.0.1:<port>` in the
    /// target's network namespace): a client reaches it by port-forwarding to its own
    /// pod. The installer chooses it (chart value `attachment.controlPort`).
    pub const AGENT_CONTROL_PORT: &str = "AGENT_CONTROL_PORT";
    /// Most concurrent wiretaps of the agent, all ports together (chart value
    /// `attachment.maxWiretaps`; the agent's own default when unset).
    pub const MAX_WIRETAPS: &str = "PODMOTION_MAX_WIRETAPS";
    /// Where the export symlinks are created (a writable emptyDir).
    pub const EXPORTS_DIR: &str = "PODMOTION_EXPORTS_DIR";
    /// The target, for the agent's logs and its clients (informational).
    pub const AGENT_TARGET_NAMESPACE: &str = "AGENT_TARGET_NAMESPACE";
    pub const AGENT_TARGET_POD: &str = "AGENT_TARGET_POD";
    pub const AGENT_TARGET_POD_UID: &str = "AGENT_TARGET_POD_UID";
    pub const AGENT_TARGET_POD_IP: &str = "AGENT_TARGET_POD_IP";
    /// The node the Job is pinned to (informational).
    pub const NODE_NAME: &str = "NODE_NAME";
    /// Where the agent's `GET /metrics` listens (`0.0.0.0:<port>`).
    pub const METRICS_LISTEN: &str = "PODMOTION_METRICS_LISTEN";
    /// `json` or `text`: every PodMotion binary's log format variable
    /// (`podmotion_log::ENV`, the same name).
    pub const LOG_FORMAT: &str = "PODMOTION_LOG_FORMAT";

    /// Every name the controller may set.
    pub const ALL: [&str; 15] = [
        AGENT_CONFIG,
        AGENT_CONTAINER_IDS,
        AGENT_CRI_SOCKET_DIR,
        CRI_SOCKET,
        AGENT_TOKEN_SHA256,
        AGENT_CONTROL_PORT,
        MAX_WIRETAPS,
        EXPORTS_DIR,
        AGENT_TARGET_NAMESPACE,
        AGENT_TARGET_POD,
        AGENT_TARGET_POD_UID,
        AGENT_TARGET_POD_IP,
        NODE_NAME,
        METRICS_LISTEN,
        LOG_FORMAT,
    ];
}

/// Keys of [`AgentConfig::config`] the executor itself reads.
pub mod config_keys {
    /// Prefix added to every environment name the agent reports.
    pub const ENV_PREFIX: &str = "envPrefix";
    /// Comma list of environment names (`NAME` or `PREFIX*`) the agent drops.
    pub const ENV_EXCLUDE: &str = "envExclude";
}

/// `AGENT_CONFIG`: what a traffic-agent sidecar would be told, plus the ports.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentConfig {
    /// The workload's namespace.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<Workload>,
    /// Target container names, primary first.
    #[serde(default)]
    pub containers: Vec<String>,
    /// The agent's GID (the Job's `runAsGroup`), exempted by the redirect rules.
    #[serde(default, rename = "agentGID", skip_serializing_if = "Option::is_none")]
    pub agent_gid: Option<u32>,
    /// The namespace the agent Jobs live in.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub manager_namespace: String,
    /// The attachment's `agent.config`; [`config_keys`] are read by the executor.
    #[serde(default)]
    pub config: BTreeMap<String, String>,
    /// Intercepted ports: numbers, or `{"port": N, "agentPort": M}`.
    #[serde(default)]
    pub ports: Vec<PortEntry>,
}

/// The workload an agent is attached to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    pub kind: String,
    pub name: String,
}

/// One intercepted port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PortEntry {
    Number(u16),
    Mapped {
        port: u16,
        #[serde(default, rename = "agentPort", skip_serializing_if = "Option::is_none")]
        agent_port: Option<u16>,
        /// `TCP` (default) or `UDP`; only TCP is redirected.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        protocol: Option<String>,
    },
}

impl AgentConfig {
    /// The JSON the controller puts in `AGENT_CONFIG`.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("strings and numbers serialize")
    }

    /// Parses `AGENT_CONFIG`.
    pub fn parse(json: &str) -> Result<AgentConfig, String> {
        serde_json::from_str(json).map_err(|e| format!("{}: {e}", env::AGENT_CONFIG))
    }
}

/// The verifier of a control API bearer token: lower-case hex of its SHA-256. The agent
/// holds only this; the token itself (256 random bits, so the verifier cannot be
/// inverted) is in the attachment's namespace, readable by that namespace's users only.
pub fn token_verifier(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether `presented` is the token of `verifier`, in time independent of where they
/// differ.
pub fn token_matches(verifier: &str, presented: &str) -> bool {
    let got = token_verifier(presented);
    let (a, b) = (got.as_bytes(), verifier.trim().as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `AGENT_CONTAINER_IDS` as the controller writes it.
pub fn container_ids_json(ids: &BTreeMap<String, String>) -> String {
    serde_json::to_string(ids).expect("a string map serializes")
}

/// `AGENT_CONTAINER_IDS` (`{"app": "containerd://…", …}`) as a list, primary first:
/// the order of `order` (`AGENT_CONFIG.containers`), then the remaining names sorted.
pub fn container_ids(json: &str, order: &[String]) -> Result<Vec<String>, String> {
    let map: BTreeMap<String, String> =
        serde_json::from_str(json).map_err(|e| format!("{}: {e}", env::AGENT_CONTAINER_IDS))?;
    let mut out: Vec<String> = order.iter().filter_map(|n| map.get(n).cloned()).collect();
    for (name, id) in &map {
        if !order.contains(name) {
            out.push(id.clone());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_reads_back_as_written() {
        let c = AgentConfig {
            namespace: "shop".into(),
            workload: Some(Workload {
                kind: "Deployment".into(),
                name: "web".into(),
            }),
            containers: vec!["app".into()],
            agent_gid: Some(7777),
            manager_namespace: "agents".into(),
            config: BTreeMap::from([(config_keys::ENV_PREFIX.to_string(), "T_".to_string())]),
            ports: vec![PortEntry::Number(8080)],
        };
        assert_eq!(AgentConfig::parse(&c.to_json()), Ok(c));
    }

    #[test]
    fn mapped_ports_and_the_sidecar_form_parse() {
        let c = AgentConfig::parse(
            r#"{"agentGID":7,"ports":[8080,{"port":9090,"agentPort":15001},{"port":53,"protocol":"UDP"}]}"#,
        )
        .unwrap();
        assert_eq!(
            c.ports,
            vec![
                PortEntry::Number(8080),
                PortEntry::Mapped {
                    port: 9090,
                    agent_port: Some(15001),
                    protocol: None
                },
                PortEntry::Mapped {
                    port: 53,
                    agent_port: None,
                    protocol: Some("UDP".into())
                },
            ]
        );
        assert!(AgentConfig::parse("{\"ports\":[70000]}").is_err());
    }

    #[test]
    fn only_the_token_matches_its_verifier() {
        let v = token_verifier("ff009a");
        assert_eq!(v.len(), 64);
        assert!(token_matches(&v, "ff009a"));
        assert!(!token_matches(&v, "ff009b"));
        assert!(!token_matches(&v, ""));
        assert!(
            !token_matches(&v, &v),
            "the verifier itself is not a credential"
        );
        assert_eq!(
            token_verifier("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn container_ids_come_primary_first() {
        let json = r#"{"b":"containerd://2","a":"containerd://1","c":"containerd://3"}"#;
        assert_eq!(
            container_ids(json, &["c".into()]).unwrap(),
            ["containerd://3", "containerd://1", "containerd://2"]
        );
    }
}
