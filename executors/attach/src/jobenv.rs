//! The attachment controller's Job environment, mapped onto the executor's config.
//!
//! The controller renders the agent Job with the sidecar-compatible `AGENT_CONFIG`
//! JSON, `AGENT_CONTAINER_IDS` (a JSON object container name → CRI ID),
//! `AGENT_CRI_SOCKET_DIR` (where the node's runtime socket, or its directory, is
//! mounted), `AGENT_TOKEN_SHA256` (the verifier of the control API's token; the token
//! itself is in the attachment's namespace) and `AGENT_CONTROL_PORT` (the control API's
//! port on the target pod's loopback). Explicit flags and
//! `PODMOTION_*` variables take precedence; these fill what is left unset.

use crate::nft::Redirect;
pub use podmotion_attach_job::{
    AgentConfig, PortEntry, config_keys, container_ids, env, token_verifier,
};

/// First forwarder port handed out when the config does not name one.
pub const AGENT_PORT_BASE: u16 = 15001;

/// The port mappings of `config`, with forwarder ports assigned from
/// [`AGENT_PORT_BASE`] upwards where none is given (never colliding with an application
/// or forwarder port).
pub fn redirects(config: &AgentConfig) -> Result<Vec<Redirect>, String> {
    let wanted: Vec<(u16, Option<u16>)> = config
        .ports
        .iter()
        .map(|p| match p {
            PortEntry::Number(n) => Ok((*n, None)),
            PortEntry::Mapped { port, agent_port, protocol } => match protocol.as_deref() {
                None | Some("TCP") => Ok((*port, *agent_port)),
                Some(p) => Err(format!("AGENT_CONFIG: port {port}/{p}: only TCP ports can be intercepted by the node agent")),
            },
        })
        .collect::<Result<_, String>>()?;
    let mut taken: Vec<u16> = wanted
        .iter()
        .flat_map(|(a, b)| [Some(*a), *b])
        .flatten()
        .collect();
    let mut next = AGENT_PORT_BASE;
    let mut out = Vec::new();
    for (port, agent_port) in wanted {
        if port == 0 {
            return Err("AGENT_CONFIG: port 0".into());
        }
        if out.iter().any(|r: &Redirect| r.port == port) {
            return Err(format!("AGENT_CONFIG: port {port} listed twice"));
        }
        let to = match agent_port {
            Some(p) => p,
            None => {
                while taken.contains(&next) {
                    next = next
                        .checked_add(1)
                        .ok_or("AGENT_CONFIG: out of forwarder ports")?;
                }
                taken.push(next);
                next
            }
        };
        out.push(Redirect { port, to });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controller_agent_config_yields_gid_ports_and_env_treatment() {
        let c = AgentConfig::parse(
            r#"{"namespace":"ns","workload":{"kind":"Deployment","name":"web"},"containers":["app","side"],
                "agentGID":7777,"managerNamespace":"podmotion","config":{"envPrefix":"T_"},
                "ports":[8080,{"port":9090,"agentPort":15001},{"port":7070}]}"#,
        )
        .unwrap();
        assert_eq!(c.agent_gid, Some(7777));
        assert_eq!(c.config["envPrefix"], "T_");
        // 15001 is taken by 9090's explicit mapping: auto-assignment skips it.
        assert_eq!(
            redirects(&c).unwrap(),
            vec![
                Redirect {
                    port: 8080,
                    to: 15002
                },
                Redirect {
                    port: 9090,
                    to: 15001
                },
                Redirect {
                    port: 7070,
                    to: 15003
                },
            ]
        );
    }

    #[test]
    fn udp_ports_are_refused_with_a_clear_error() {
        let c = AgentConfig::parse(r#"{"ports":[{"port":53,"protocol":"UDP"}]}"#).unwrap();
        let e = redirects(&c).unwrap_err();
        assert!(e.contains("only TCP"), "{e}");
        let c = AgentConfig::parse(r#"{"ports":[{"port":80,"protocol":"TCP"}]}"#).unwrap();
        assert_eq!(redirects(&c).unwrap()[0].port, 80);
    }

    #[test]
    fn duplicate_ports_are_refused() {
        let c = AgentConfig::parse(r#"{"ports":[8080,8080]}"#).unwrap();
        assert!(redirects(&c).is_err());
    }

    #[test]
    fn container_ids_put_the_configured_primary_first() {
        let ids = container_ids(
            r#"{"a-side":"containerd://s","web":"containerd://w","z":"containerd://z"}"#,
            &["web".into()],
        )
        .unwrap();
        assert_eq!(
            ids,
            vec!["containerd://w", "containerd://s", "containerd://z"]
        );
    }
}
