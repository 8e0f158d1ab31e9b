//! Target selection: which pods of the workload get (or keep) an agent, and why the
//! others are skipped.
//!
//! A pod is *admissible* when it is Running and Ready on a node and can host a node
//! agent. Pods on the host network, pods with an injected traffic-agent sidecar, pods
//! in their own user namespace and pods on a node of another platform than the agent
//! image's (`crate::platform`) can never host one. A pod that already has its Job and
//! merely turned un-Ready (or is terminating but not gone yet) is *held*: it keeps its
//! Job. Everything else waits as `NotReady`.

use std::collections::BTreeMap;

use podmotion_api::attachment::{AgentPort, SidecarRecognition, SkipReason};

use super::observed::{PodPhase, PodView};

/// What a pod is to the attachment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodClass {
    /// Running, Ready, on a node: gets a Job.
    Admissible,
    /// Not admissible now, but has its Job already and keeps it.
    Held,
    /// Gets no Job, for this reason.
    Skipped(SkipReason, String),
}

/// Whether `pod` carries an injected traffic-agent sidecar, by container name or annotation.
pub fn has_sidecar(pod: &PodView, sidecar: &SidecarRecognition) -> bool {
    pod.containers
        .iter()
        .any(|c| c.name == sidecar.container_name)
        || pod
            .annotations
            .get(&sidecar.annotation)
            .is_some_and(|v| v.eq_ignore_ascii_case("true"))
}

/// Classifies one pod. `has_job`: an agent Job made for this very pod (same UID) exists.
/// `unfit_node`: why the pod's node cannot run the agent image, if it cannot
/// ([`crate::platform::Platform::mismatch`] of its labels).
pub fn classify(
    pod: &PodView,
    sidecar: &SidecarRecognition,
    has_job: bool,
    unfit_node: Option<&str>,
) -> PodClass {
    if let Some(skip) = never_admissible(pod, sidecar, unfit_node) {
        return skip;
    }
    match pod.phase {
        PodPhase::Failed => {
            return PodClass::Skipped(SkipReason::NotReady, "the pod has failed".into());
        }
        PodPhase::Succeeded => {
            return PodClass::Skipped(SkipReason::NotReady, "the pod has completed".into());
        }
        _ => {}
    }
    if pod.phase == PodPhase::Running && pod.ready && pod.node.is_some() && !pod.terminating {
        return PodClass::Admissible;
    }
    if has_job && pod.node.is_some() {
        return PodClass::Held;
    }
    let why = if pod.terminating {
        "the pod is terminating"
    } else if pod.node.is_none() {
        "the pod is not scheduled to a node yet"
    } else if pod.phase != PodPhase::Running {
        "the pod is not Running yet"
    } else {
        "the pod is not Ready yet"
    };
    PodClass::Skipped(
        SkipReason::NotReady,
        format!("{why}; it gets its agent once Running and Ready"),
    )
}

/// Why `pod` can never host an agent, whatever its phase (`None`: it can, once Running
/// and Ready): the host network, an injected sidecar, a user namespace, a node of
/// another platform.
fn never_admissible(
    pod: &PodView,
    sidecar: &SidecarRecognition,
    unfit_node: Option<&str>,
) -> Option<PodClass> {
    if pod.host_network {
        return Some(PodClass::Skipped(
            SkipReason::HostNetwork,
            "the pod uses the host network; its network namespace is the node's".into(),
        ));
    }
    if has_sidecar(pod, sidecar) {
        return Some(PodClass::Skipped(
            SkipReason::InjectedSidecar,
            format!(
                "the pod carries an injected traffic-agent sidecar (container {:?} or annotation {:?}); \
                 a node agent would program the same nftables table and bind the same ports",
                sidecar.container_name, sidecar.annotation
            ),
        ));
    }
    if pod.host_users == Some(false) {
        return Some(PodClass::Skipped(
            SkipReason::UserNamespace,
            "the pod runs in its own user namespace (hostUsers: false), which needs a packet-mark \
             discriminator the agent does not support yet"
                .into(),
        ));
    }
    let (node, why) = (pod.node.as_ref()?, unfit_node?);
    Some(PodClass::Skipped(
        SkipReason::UnsupportedPlatform,
        format!("the pod's node {node} cannot run the agent: {why}"),
    ))
}

/// The container IDs handed to the agent for `pod`: those of `wanted` containers (empty:
/// every container but the sidecar's), by container name. Containers not started yet
/// have no ID and are left out.
pub fn container_ids(
    pod: &PodView,
    wanted: &[String],
    sidecar: &SidecarRecognition,
) -> BTreeMap<String, String> {
    pod.containers
        .iter()
        .filter(|c| {
            if wanted.is_empty() {
                c.name != sidecar.container_name
            } else {
                wanted.contains(&c.name)
            }
        })
        .filter_map(|c| c.id.clone().map(|id| (c.name.clone(), id)))
        .collect()
}

/// Names of the containers the agent works on, in the pod's order (the first is the
/// primary): `wanted` (empty: every container but the sidecar's).
pub fn container_names(
    pod: &PodView,
    wanted: &[String],
    sidecar: &SidecarRecognition,
) -> Vec<String> {
    pod.containers
        .iter()
        .filter(|c| {
            if wanted.is_empty() {
                c.name != sidecar.container_name
            } else {
                wanted.contains(&c.name)
            }
        })
        .map(|c| c.name.clone())
        .collect()
}

/// The port numbers the agent redirects on `pod`: the union over `claims` (each an
/// attachment's `ports`; an empty list means every port the selected containers
/// declare), named ports resolved against the selected containers. Sorted, unique.
/// A name no selected container declares is left out.
pub fn resolve_ports(
    pod: &PodView,
    wanted: &[String],
    sidecar: &SidecarRecognition,
    claims: &[&[AgentPort]],
) -> Vec<i32> {
    let names = container_names(pod, wanted, sidecar);
    let declared: Vec<&(i32, Option<String>, String)> = pod
        .containers
        .iter()
        .filter(|c| names.contains(&c.name))
        .flat_map(|c| c.ports.iter())
        .collect();
    let mut out: Vec<i32> = vec![];
    for ports in claims {
        if ports.is_empty() {
            out.extend(declared.iter().map(|(n, _, _)| *n));
            continue;
        }
        for p in *ports {
            match (&p.port, &p.name) {
                (Some(n), _) => out.push(*n),
                (None, Some(name)) => out.extend(
                    declared
                        .iter()
                        .filter(|(_, pn, _)| pn.as_ref() == Some(name))
                        .map(|(n, _, _)| *n),
                ),
                (None, None) => {}
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attachment::fixtures::pod;

    fn class(p: PodView, has_job: bool) -> PodClass {
        classify(&p, &SidecarRecognition::default(), has_job, None)
    }
    fn reason(c: PodClass) -> Option<SkipReason> {
        match c {
            PodClass::Skipped(r, _) => Some(r),
            _ => None,
        }
    }

    #[test]
    fn selection_table() {
        use SkipReason::*;
        // (case, pod, has a Job already, expected class or skip reason)
        let cases: Vec<(&str, PodView, bool, Result<PodClass, SkipReason>)> = vec![
            (
                "running ready pod is admissible",
                pod("a").on_node("n1").ready().build(),
                false,
                Ok(PodClass::Admissible),
            ),
            (
                "host network pod is skipped",
                pod("a").on_node("n1").ready().host_network().build(),
                false,
                Err(HostNetwork),
            ),
            (
                "host network pod is skipped even with a Job",
                pod("a").on_node("n1").ready().host_network().build(),
                true,
                Err(HostNetwork),
            ),
            (
                "pod with sidecar container is skipped",
                pod("a").on_node("n1").ready().with_sidecar().build(),
                false,
                Err(InjectedSidecar),
            ),
            (
                "pod with sidecar annotation is skipped",
                pod("a")
                    .on_node("n1")
                    .ready()
                    .annotated("telepresence.io/agent-injected", "true")
                    .build(),
                false,
                Err(InjectedSidecar),
            ),
            (
                "sidecar annotation false does not count",
                pod("a")
                    .on_node("n1")
                    .ready()
                    .annotated("telepresence.io/agent-injected", "false")
                    .build(),
                false,
                Ok(PodClass::Admissible),
            ),
            (
                "user namespaced pod is skipped",
                pod("a").on_node("n1").ready().host_users(false).build(),
                false,
                Err(UserNamespace),
            ),
            (
                "hostUsers true is admissible",
                pod("a").on_node("n1").ready().host_users(true).build(),
                false,
                Ok(PodClass::Admissible),
            ),
            (
                "pending pod waits",
                pod("a").on_node("n1").pending().build(),
                false,
                Err(NotReady),
            ),
            (
                "unscheduled pod waits",
                pod("a").build(),
                false,
                Err(NotReady),
            ),
            (
                "unready pod without a Job waits",
                pod("a").on_node("n1").build(),
                false,
                Err(NotReady),
            ),
            (
                "unready pod keeps its Job",
                pod("a").on_node("n1").build(),
                true,
                Ok(PodClass::Held),
            ),
            (
                "terminating pod keeps its Job until gone",
                pod("a").on_node("n1").ready().terminating().build(),
                true,
                Ok(PodClass::Held),
            ),
            (
                "terminating pod without a Job gets none",
                pod("a").on_node("n1").ready().terminating().build(),
                false,
                Err(NotReady),
            ),
            (
                "failed pod loses its Job",
                pod("a").on_node("n1").failed().build(),
                true,
                Err(NotReady),
            ),
            (
                "completed pod loses its Job",
                pod("a").on_node("n1").succeeded().build(),
                true,
                Err(NotReady),
            ),
        ];
        for (case, p, has_job, want) in cases {
            let got = class(p, has_job);
            match want {
                Ok(c) => assert_eq!(got, c, "{case}"),
                Err(r) => assert_eq!(reason(got.clone()), Some(r), "{case}: {got:?}"),
            }
        }
    }

    #[test]
    fn a_pod_on_a_node_of_another_platform_is_skipped_with_the_reason_and_loses_its_job() {
        let sc = SidecarRecognition::default();
        let why =
            "the node is kubernetes.io/arch=arm64; PodMotion's images are built for linux/amd64";
        let ready = pod("a").on_node("n1").ready().build();
        for has_job in [false, true] {
            match classify(&ready, &sc, has_job, Some(why)) {
                PodClass::Skipped(SkipReason::UnsupportedPlatform, msg) => {
                    assert!(msg.contains("node n1"), "{msg}");
                    assert!(msg.contains("kubernetes.io/arch=arm64"), "{msg}");
                }
                other => panic!("has_job {has_job}: {other:?}"),
            }
        }
        // Not Ready yet: the node is known, so is the verdict; it will never get a Job.
        let pending = pod("a").on_node("n1").pending().build();
        assert_eq!(
            reason(classify(&pending, &sc, false, Some(why))),
            Some(SkipReason::UnsupportedPlatform)
        );
        // Not scheduled yet: no node to judge.
        assert_eq!(
            reason(classify(&pod("a").build(), &sc, false, Some(why))),
            Some(SkipReason::NotReady)
        );
        // A node of the right platform changes nothing.
        assert_eq!(classify(&ready, &sc, false, None), PodClass::Admissible);
    }

    #[test]
    fn sidecar_recognition_is_configurable() {
        let custom = SidecarRecognition {
            container_name: "mesh-agent".into(),
            annotation: "example.com/agent".into(),
        };
        let p = pod("a")
            .on_node("n1")
            .ready()
            .with_container("mesh-agent")
            .build();
        assert_eq!(
            reason(classify(&p, &custom, false, None)),
            Some(SkipReason::InjectedSidecar)
        );
        // The default name means nothing under a custom recognition.
        let p = pod("a").on_node("n1").ready().with_sidecar().build();
        assert_eq!(classify(&p, &custom, false, None), PodClass::Admissible);
        let p = pod("a")
            .on_node("n1")
            .ready()
            .annotated("example.com/agent", "true")
            .build();
        assert_eq!(
            reason(classify(&p, &custom, false, None)),
            Some(SkipReason::InjectedSidecar)
        );
    }

    #[test]
    fn ports_are_resolved_by_number_and_name_and_merged() {
        let p = pod("a").on_node("n1").ready().build(); // app declares 8080 "http"
        let sc = SidecarRecognition::default();
        let num = |n: i32| AgentPort {
            port: Some(n),
            name: None,
            protocol: Default::default(),
        };
        let named = |n: &str| AgentPort {
            port: None,
            name: Some(n.into()),
            protocol: Default::default(),
        };
        assert_eq!(
            resolve_ports(&p, &[], &sc, &[&[]]),
            vec![8080],
            "empty means every declared port"
        );
        assert_eq!(resolve_ports(&p, &[], &sc, &[&[named("http")]]), vec![8080]);
        assert_eq!(
            resolve_ports(&p, &[], &sc, &[&[named("grpc")]]),
            Vec::<i32>::new()
        );
        assert_eq!(
            resolve_ports(&p, &[], &sc, &[&[num(9090)], &[named("http"), num(9090)]]),
            vec![8080, 9090]
        );
        assert_eq!(
            resolve_ports(&p, &[], &sc, &[]),
            Vec::<i32>::new(),
            "an ingest redirects nothing"
        );
    }

    #[test]
    fn container_ids_cover_the_configured_containers_only() {
        let p = pod("a").on_node("n1").ready().with_container("log").build();
        let all = container_ids(&p, &[], &SidecarRecognition::default());
        assert_eq!(
            all.keys().cloned().collect::<Vec<_>>(),
            vec!["app".to_string(), "log".to_string()]
        );
        let one = container_ids(&p, &["log".into()], &SidecarRecognition::default());
        assert_eq!(one.len(), 1);
        assert_eq!(one["log"], "containerd://a-log-1");
    }
}
