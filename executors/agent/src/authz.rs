//! Who may call which RPC of the agent: one pure decision over the caller's identity
//! (from its TLS client certificate, `podmotion_wire::identity`), the call, and what
//! this agent knows of the migration the call names.
//!
//! mTLS alone proves only that a caller holds some key signed by the agents' CA: every
//! agent holds one. So the table is:
//!
//! | caller                           | control RPCs (Prepare … Status, Fence) | ReceiveImages, LazyPages            |
//! |----------------------------------|---------------------------------|--------------------------------------------|
//! | the operator                     | allowed                         | denied (it streams no images)              |
//! | the agent of node N              | denied                          | only if this agent is the *target* of the migration and the operator named N as its peer at `Prepare`; never N = this node |
//! | the legacy shared agent cert     | denied                          | target of the migration (no node to check) |
//! | no PodMotion identity            | denied                          | denied                                     |
//!
//! A commanding call of the operator also carries its leader term when leader election
//! is on (`podmotion_wire::agent::LeaderTerm`: the Lease's creation time, then its
//! transition count): a term older than the newest
//! this agent has seen is refused ([`admit_term`]), so a replica that still believes it
//! leads after another took over commands nothing. A commanding call without a term is
//! accepted only while this agent has never seen one (leader election off): once a term
//! was seen, a termless call (a replica run with election off beside a leader, or a
//! client that left the metadata out) is refused like a stale one.
//! `Status` is never refused for it.
//! The highest term is also recorded on the node before a call that raised it is
//! admitted, so a restarted agent starts from it (`crate::service::leader_term`).
//!
//! Every denial is `PermissionDenied` ([`Denied`] → `Status`, in one place), and it
//! comes before anything is resolved, frozen, read or written. An unknown migration is
//! denied like a wrong peer, so a caller learns nothing of what runs here.

use std::fmt;

use podmotion_wire::agent::{LeaderTerm, Role};
use podmotion_wire::identity::{IdentityError, Peer};
use tonic::Status;

/// The agent's RPCs (`podmotion.agent.v1.MigrationAgent`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rpc {
    Prepare,
    PreDump,
    Dump,
    /// The operator asks the source to stream its images to the target.
    Send,
    /// The restore fence on the source, before the target's `Restore`.
    Fence,
    /// The source agent's image stream, agent to agent.
    ReceiveImages,
    /// PostCopy: the source agent's lazy-pages session, agent to agent (the same
    /// rule as `ReceiveImages`).
    LazyPages,
    Restore,
    Commit,
    /// The source's node forwards new connections to the restored target.
    Forward,
    Abort,
    Cleanup,
    Status,
}

impl Rpc {
    pub const ALL: [Rpc; 13] = [
        Rpc::Prepare,
        Rpc::PreDump,
        Rpc::Dump,
        Rpc::Send,
        Rpc::Fence,
        Rpc::ReceiveImages,
        Rpc::LazyPages,
        Rpc::Restore,
        Rpc::Commit,
        Rpc::Forward,
        Rpc::Abort,
        Rpc::Cleanup,
        Rpc::Status,
    ];

    /// The calls that command the agent: the operator's only.
    pub fn is_control(self) -> bool {
        !matches!(self, Rpc::ReceiveImages | Rpc::LazyPages)
    }

    /// The operator's calls that act (all but the `Status` read): the ones the leader
    /// term fences.
    pub fn commands(self) -> bool {
        self.is_control() && self != Rpc::Status
    }
}

impl fmt::Display for Rpc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A migration as this agent prepared it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prepared<'a> {
    pub role: Role,
    /// The other agent's node, as the operator named it at `Prepare`.
    pub peer: &'a str,
}

/// What the decision needs besides the caller and the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct State<'a> {
    /// This agent's own node (`None`: it serves the legacy shared certificate and
    /// cannot tell).
    pub this_node: Option<&'a str>,
    /// The migration the call names, if this agent prepared it (only consulted for
    /// `ReceiveImages`; control calls do not depend on it).
    pub migration: Option<Prepared<'a>>,
}

/// Why a call is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    #[error("{rpc}: the caller has no PodMotion identity: {reason}")]
    NoIdentity { rpc: Rpc, reason: IdentityError },
    #[error("{rpc} is the operator's call; {caller} may not make it")]
    NotOperator { rpc: Rpc, caller: Peer },
    #[error("{rpc}: only an agent streams images; {caller} is not one")]
    NotAnAgent { rpc: Rpc, caller: Peer },
    #[error("{rpc}: an agent does not stream images to itself ({caller})")]
    OwnIdentity { rpc: Rpc, caller: Peer },
    #[error("{rpc}: no migration on this agent takes images from {caller}")]
    NotThePeer { rpc: Rpc, caller: Peer },
    #[error(
        "{rpc}: the operator's leader {presented} is older than {highest} this agent has seen: another replica leads now"
    )]
    StaleLeader {
        rpc: Rpc,
        presented: LeaderTerm,
        highest: LeaderTerm,
    },
    #[error(
        "{rpc}: the call carries no leader term, and this agent has seen {highest}: a leader elected operator commands this node (is a second operator running with leader election off?)"
    )]
    NoTerm { rpc: Rpc, highest: LeaderTerm },
}

/// The leader-term fence of a commanding call: `presented` (the term the operator sent,
/// `None` with leader election off) against `highest`, the newest term this agent saw
/// before the call. An older term is refused; a call without a term only while no term
/// was ever seen (leader election off everywhere). Reads (`Status`) change nothing and
/// are never refused for their term.
pub fn admit_term(
    rpc: Rpc,
    presented: Option<LeaderTerm>,
    highest: LeaderTerm,
) -> Result<(), Denied> {
    match presented {
        Some(t) if t < highest && rpc.commands() => Err(Denied::StaleLeader {
            rpc,
            presented: t,
            highest,
        }),
        None if highest != LeaderTerm::default() && rpc.commands() => {
            Err(Denied::NoTerm { rpc, highest })
        }
        _ => Ok(()),
    }
}

/// The decision. Pure: the same inputs always give the same answer.
pub fn authorize(
    caller: &Result<Peer, IdentityError>,
    rpc: Rpc,
    state: State<'_>,
) -> Result<(), Denied> {
    let caller = match caller {
        Ok(p) => p,
        Err(reason) => {
            return Err(Denied::NoIdentity {
                rpc,
                reason: reason.clone(),
            });
        }
    };
    let denied_peer = || Denied::NotThePeer {
        rpc,
        caller: caller.clone(),
    };
    match (caller, rpc.is_control()) {
        (Peer::Operator, true) => Ok(()),
        (Peer::Operator, false) => Err(Denied::NotAnAgent {
            rpc,
            caller: caller.clone(),
        }),
        (Peer::Agent(_) | Peer::SharedAgent, true) => Err(Denied::NotOperator {
            rpc,
            caller: caller.clone(),
        }),
        (Peer::Agent(node), false) => {
            if state.this_node == Some(node.as_str()) {
                return Err(Denied::OwnIdentity {
                    rpc,
                    caller: caller.clone(),
                });
            }
            match state.migration {
                Some(Prepared {
                    role: Role::Target,
                    peer,
                }) if peer == node => Ok(()),
                _ => Err(denied_peer()),
            }
        }
        // Legacy: every agent holds this certificate, so which node streams cannot be
        // checked; the migration must at least be one this agent receives.
        (Peer::SharedAgent, false) => match state.migration {
            Some(Prepared {
                role: Role::Target, ..
            }) => Ok(()),
            _ => Err(denied_peer()),
        },
    }
}

impl From<Denied> for Status {
    fn from(d: Denied) -> Status {
        Status::permission_denied(d.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: &str = "node-b";
    const SRC: &str = "node-a";

    fn agent(n: &str) -> Result<Peer, IdentityError> {
        Ok(Peer::Agent(n.into()))
    }

    fn state(migration: Option<Prepared<'static>>) -> State<'static> {
        State {
            this_node: Some(ME),
            migration,
        }
    }

    fn target_of(peer: &'static str) -> Option<Prepared<'static>> {
        Some(Prepared {
            role: Role::Target,
            peer,
        })
    }

    /// Every caller that is not the operator, as the table's rows.
    fn non_operators() -> Vec<Result<Peer, IdentityError>> {
        vec![
            agent(SRC),
            agent(ME),
            agent("node-c"),
            Ok(Peer::SharedAgent),
            Err(IdentityError::NoIdentity),
            Err(IdentityError::NoCertificate),
        ]
    }

    #[test]
    fn the_operator_may_make_every_control_call_whatever_the_migration() {
        for rpc in Rpc::ALL.into_iter().filter(|r| r.is_control()) {
            for m in [
                None,
                target_of(SRC),
                Some(Prepared {
                    role: Role::Source,
                    peer: SRC,
                }),
            ] {
                assert_eq!(
                    authorize(&Ok(Peer::Operator), rpc, state(m)),
                    Ok(()),
                    "{rpc}"
                );
            }
        }
    }

    #[test]
    fn no_one_but_the_operator_may_make_a_control_call() {
        for rpc in Rpc::ALL.into_iter().filter(|r| r.is_control()) {
            for caller in non_operators() {
                // Not even the peer of a migration this agent is the target of.
                let d = authorize(&caller, rpc, state(target_of(SRC))).unwrap_err();
                assert!(
                    matches!(d, Denied::NotOperator { .. } | Denied::NoIdentity { .. }),
                    "{rpc} by {caller:?}: {d:?}"
                );
                assert_eq!(Status::from(d).code(), tonic::Code::PermissionDenied);
            }
        }
    }

    #[test]
    fn images_come_only_from_the_peer_the_operator_named_to_a_target() {
        let rx = Rpc::ReceiveImages;
        assert_eq!(authorize(&agent(SRC), rx, state(target_of(SRC))), Ok(()));
        // Another agent, though CA-signed.
        assert!(matches!(
            authorize(&agent("node-c"), rx, state(target_of(SRC))),
            Err(Denied::NotThePeer { .. })
        ));
        // A migration this agent does not know, or is the source of.
        assert!(matches!(
            authorize(&agent(SRC), rx, state(None)),
            Err(Denied::NotThePeer { .. })
        ));
        assert!(matches!(
            authorize(
                &agent(SRC),
                rx,
                state(Some(Prepared {
                    role: Role::Source,
                    peer: SRC
                }))
            ),
            Err(Denied::NotThePeer { .. })
        ));
        // The operator streams no images; no identity, no stream.
        assert!(matches!(
            authorize(&Ok(Peer::Operator), rx, state(target_of(SRC))),
            Err(Denied::NotAnAgent { .. })
        ));
        assert!(matches!(
            authorize(&Err(IdentityError::NoIdentity), rx, state(target_of(SRC))),
            Err(Denied::NoIdentity { .. })
        ));
    }

    #[test]
    fn an_agent_never_takes_images_from_its_own_identity() {
        // Even if the operator named this node as the peer.
        assert!(matches!(
            authorize(&agent(ME), Rpc::ReceiveImages, state(target_of(ME))),
            Err(Denied::OwnIdentity { .. })
        ));
    }

    #[test]
    fn the_legacy_shared_certificate_streams_to_targets_only_and_commands_nothing() {
        let legacy = State {
            this_node: None,
            migration: target_of(SRC),
        };
        let shared = Ok(Peer::SharedAgent);
        assert_eq!(authorize(&shared, Rpc::ReceiveImages, legacy), Ok(()));
        assert!(
            authorize(
                &shared,
                Rpc::ReceiveImages,
                State {
                    migration: None,
                    ..legacy
                }
            )
            .is_err()
        );
        assert!(authorize(&shared, Rpc::Dump, legacy).is_err());
    }

    #[test]
    fn a_lower_leader_term_commands_nothing_and_reads_go_on() {
        let t = |term| LeaderTerm::new(0, term);
        for rpc in Rpc::ALL
            .into_iter()
            .filter(|r| r.is_control() && *r != Rpc::Status)
        {
            assert!(
                admit_term(rpc, Some(t(6)), t(6)).is_ok(),
                "{rpc}: the same term"
            );
            assert!(
                admit_term(rpc, Some(t(7)), t(6)).is_ok(),
                "{rpc}: a newer term"
            );
            assert!(
                admit_term(rpc, None, LeaderTerm::default()).is_ok(),
                "{rpc}: no election anywhere, no fence"
            );
            let d = admit_term(rpc, None, t(6)).unwrap_err();
            assert_eq!(
                d,
                Denied::NoTerm { rpc, highest: t(6) },
                "{rpc}: termless after a term"
            );
            assert!(d.to_string().contains("no leader term"), "{d}");
            let d = admit_term(rpc, Some(t(5)), t(6)).unwrap_err();
            assert_eq!(
                d,
                Denied::StaleLeader {
                    rpc,
                    presented: t(5),
                    highest: t(6)
                }
            );
            assert!(d.to_string().contains("term 6"), "{d}");
        }
        assert!(admit_term(Rpc::Status, Some(t(1)), t(6)).is_ok());
        assert!(admit_term(Rpc::Status, None, t(6)).is_ok());
        assert!(admit_term(Rpc::ReceiveImages, Some(t(1)), t(6)).is_ok());
    }

    #[test]
    fn a_recreated_lease_leads_and_the_replaced_one_commands_nothing() {
        let replaced = LeaderTerm::new(1_764_000_000, 41);
        let recreated = LeaderTerm::new(1_764_770_000, 0);
        for rpc in Rpc::ALL.into_iter().filter(|r| r.commands()) {
            assert!(admit_term(rpc, Some(recreated), replaced).is_ok(), "{rpc}");
            let d = admit_term(rpc, Some(replaced), recreated).unwrap_err();
            assert!(
                d.to_string()
                    .contains("term 0 of the Lease created at 1764770000"),
                "{d}"
            );
            // Without an epoch (an operator from before it): older than any Lease's.
            assert!(admit_term(rpc, Some(LeaderTerm::new(0, 99)), recreated).is_err());
        }
    }

    #[test]
    fn every_denial_is_permission_denied() {
        for rpc in Rpc::ALL {
            for caller in non_operators().into_iter().chain([Ok(Peer::Operator)]) {
                for m in [None, target_of(SRC), target_of("node-c")] {
                    if let Err(d) = authorize(&caller, rpc, state(m)) {
                        assert_eq!(Status::from(d).code(), tonic::Code::PermissionDenied);
                    }
                }
            }
        }
    }
}
