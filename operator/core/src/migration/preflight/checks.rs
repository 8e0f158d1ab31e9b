//! The checks, in the order their refusals take precedence, and the verdict they
//! give: what the pod is, what its spec makes impossible to move, whether another
//! migration has it, then the target (`target`).

use podmotion_api::migration::{MigrationMode, PodMigrationSpec};
use podmotion_api::names::reasons;

use super::Refusal;
use super::migrations::{Me, OtherMigration};
use super::pod::PodFacts;
use super::target::{NodeFacts, select_target};
use crate::migration::observed::{Plan, Preflight};
use crate::migration::render::target_pod_name;

/// A PodMigration whose probe is an exec probe while exec probes are off.
pub const EXEC_PROBE_DISABLED: &str = "ExecProbeDisabled";

/// Why an exec probe (`what` names it) is refused while exec probes are off, and what
/// to do.
pub fn exec_probes_disabled_message(what: &str) -> String {
    format!(
        "{what} is an exec probe, and this installation has exec probes off: running a \
         command in the pods needs the operator to hold pods/exec create, so only the \
         installer can enable them (Helm value migration.execProbes.enabled=true, the \
         operator's --migration-exec-probes); or set spec.probe to an httpGet, tcpSocket \
         or grpc probe"
    )
}

/// Owner kinds whose controller adopts a pod of another name carrying its labels.
/// StatefulSet pods have identities (name, volumes) and DaemonSet/Job pods are tied to
/// their node or completion; none of those can be moved by adoption.
fn adoptable_owner(kind: &str) -> bool {
    kind == "ReplicaSet"
}

/// A check that found nothing to refuse passes.
fn unless(refusal: Option<Refusal>) -> Result<(), Refusal> {
    refusal.map_or(Ok(()), Err)
}

/// The pre-flight verdict: every check, then the target.
pub fn preflight(
    spec: &PodMigrationSpec,
    me: &Me,
    pod: Option<&PodFacts>,
    nodes: &[NodeFacts],
    others: &[OtherMigration],
) -> Preflight {
    match plan(spec, me, pod, nodes, others) {
        Ok(plan) => Preflight::Migratable(plan),
        Err((reason, message)) => Preflight::NotMigratable { reason, message },
    }
}

/// The checks in the order their refusals take precedence, then the target.
fn plan(
    spec: &PodMigrationSpec,
    me: &Me,
    pod: Option<&PodFacts>,
    nodes: &[NodeFacts],
    others: &[OtherMigration],
) -> Result<Plan, Refusal> {
    let pod = pod.ok_or_else(|| {
        (
            reasons::SOURCE_POD_NOT_FOUND,
            format!("pod {} does not exist", spec.pod_name),
        )
    })?;
    let source = running_source(spec, pod)?;
    unless(protected_or_static(me, pod))?;
    unless(exec_probe_refused(spec, me, pod))?;
    unless(unsupported_owner(pod))?;
    unless(cannot_move(spec, pod))?;
    unless(already_migrating(me, pod, others))?;
    source_agent_ready(&source, nodes)?;
    let target = select_target(spec, pod, &source, nodes)?;
    Ok(Plan {
        source_node: source,
        target_node: target,
        source_pod_uid: pod.uid.clone(),
        target_pod: target_pod_name(&pod.name, &me.uid),
    })
}

/// The source node of the pinned pod, if it is Running there.
fn running_source(spec: &PodMigrationSpec, pod: &PodFacts) -> Result<String, Refusal> {
    if let Some(uid) = &spec.pod_uid
        && *uid != pod.uid
    {
        return Err((
            reasons::POD_UID_MISMATCH,
            format!("pod {} has UID {}, not the pinned {uid}", pod.name, pod.uid),
        ));
    }
    if !pod.running || pod.terminating {
        return Err((
            reasons::SOURCE_POD_NOT_RUNNING,
            format!("pod {} is not Running", pod.name),
        ));
    }
    pod.node.clone().ok_or_else(|| {
        (
            reasons::SOURCE_POD_NOT_RUNNING,
            format!("pod {} is not bound to a node", pod.name),
        )
    })
}

/// The probe is checked before anything is frozen: an exec probe that cannot run
/// would roll every migration back after its freeze.
fn exec_probe_refused(spec: &PodMigrationSpec, me: &Me, pod: &PodFacts) -> Option<Refusal> {
    let exec_probe = match &spec.probe {
        Some(p) => p.exec.is_some().then_some("spec.probe"),
        None => pod
            .readiness_exec_probe
            .then_some("the pod's readiness probe (the check used when spec.probe is unset)"),
    };
    let what = exec_probe.filter(|_| !me.exec_probes)?;
    Some((EXEC_PROBE_DISABLED, exec_probes_disabled_message(what)))
}

fn unsupported_owner(pod: &PodFacts) -> Option<Refusal> {
    let owner = pod.owner.as_ref().filter(|o| !adoptable_owner(&o.kind))?;
    Some((
        reasons::UNSUPPORTED_OWNER,
        format!(
            "pod {} is controlled by {} {}; only ReplicaSet (Deployment) pods and bare pods can move",
            pod.name, owner.kind, owner.name
        ),
    ))
}

/// One migration per pod: the oldest non-terminal PodMigration of a pod wins
/// (name breaks ties), so two created together never both proceed.
fn already_migrating(me: &Me, pod: &PodFacts, others: &[OtherMigration]) -> Option<Refusal> {
    let first = others
        .iter()
        .filter(|m| m.pod_name == pod.name && !m.terminal && m.name != me.name)
        .find(|m| (m.created, &m.name) < (me.created, &me.name))?;
    Some((
        reasons::ALREADY_MIGRATING,
        format!(
            "pod {} is already being migrated by {}",
            pod.name, first.name
        ),
    ))
}

fn source_agent_ready(source: &str, nodes: &[NodeFacts]) -> Result<(), Refusal> {
    match nodes.iter().find(|n| n.name == source) {
        Some(n) if n.has_ready_agent => Ok(()),
        _ => Err((
            reasons::NO_AGENT_ON_NODE,
            format!("no ready migration agent on the source node {source}"),
        )),
    }
}

/// Pods that are never PodMotion's to move: those in the cluster's system namespace or
/// the operator's own, and static pods.
fn protected_or_static(me: &Me, pod: &PodFacts) -> Option<Refusal> {
    let name = &pod.name;
    if pod.namespace == "kube-system"
        || pod.namespace == me.operator_namespace
        || pod.namespace == me.agents_namespace
    {
        let whose = if pod.namespace == "kube-system" {
            "the cluster's system namespace"
        } else if pod.namespace == me.agents_namespace {
            "PodMotion's agents' namespace"
        } else {
            "PodMotion's own namespace"
        };
        return Some((
            reasons::PROTECTED_NAMESPACE,
            format!(
                "pod {name} is in {} ({whose}), whose pods PodMotion never migrates; \
                 reschedule it (delete the pod and let its controller recreate it) instead",
                pod.namespace
            ),
        ));
    }
    // Before the owner check: a mirror pod's controller is its Node.
    if pod.static_pod {
        return Some((
            reasons::STATIC_POD,
            format!(
                "pod {name} is a static pod: the kubelet runs it from a manifest on its node \
                 and the API server only shows a mirror; move the manifest to another node's \
                 static pod directory instead"
            ),
        ));
    }
    None
}

/// What the pod's spec makes impossible to move, cheapest and least negotiable first;
/// `None` if nothing. Local data comes last: it is the one a user may waive.
fn cannot_move(spec: &PodMigrationSpec, pod: &PodFacts) -> Option<Refusal> {
    let name = &pod.name;
    if !pod.host_namespaces.is_empty() {
        return Some((
            reasons::HOST_NAMESPACES,
            format!(
                "pod {name} shares the node's namespaces ({}): its processes and sockets are \
                 the node's, which cannot be checkpointed and recreated on another node; \
                 reschedule it instead, or run it without {}",
                pod.host_namespaces.join(", "),
                pod.host_namespaces.join(" and ")
            ),
        ));
    }
    if let Some(r) = containers_refused(spec, pod) {
        return Some(r);
    }
    if !pod.extended_resources.is_empty() {
        let list: Vec<String> = pod
            .extended_resources
            .iter()
            .map(|(c, r)| format!("{r} (container {c})"))
            .collect();
        return Some((
            reasons::EXTENDED_RESOURCES,
            format!(
                "pod {name} uses {}: a device's state cannot be checkpointed and the target \
                 node's device would be another one; PodMotion moves pods that use only cpu, \
                 memory, ephemeral-storage and hugepages; reschedule it instead",
                list.join(", ")
            ),
        ));
    }
    if let Some(r) = non_root_refused(spec, pod) {
        return Some(r);
    }
    local_data(spec, pod).map(|m| (reasons::LOCAL_DATA, m))
}

/// The most containers one migration moves: the agents' bound
/// (`executors/agent/src/pod.rs`, `MAX_CONTAINERS`), refused here before any freeze.
pub const MAX_CONTAINERS: usize = 16;

/// What keeps a pod of several containers (native sidecars count) from moving as one,
/// naming the container concerned. Every container that runs is frozen, dumped and
/// restored into its own container of the target pod (finished init containers are
/// not restored: they ran to completion), except where the agents cannot:
/// PostCopy's lazy dump serves the pages of one process tree; a container with no
/// running process has nothing to dump, and its target container would start empty.
fn containers_refused(spec: &PodMigrationSpec, pod: &PodFacts) -> Option<Refusal> {
    let (name, n) = (&pod.name, pod.containers.len());
    if n < 2 {
        return None;
    }
    if spec.mode == MigrationMode::PostCopy {
        return Some((
            reasons::MULTIPLE_CONTAINERS,
            format!(
                "pod {name} has {n} containers ({}; native sidecars count) and mode PostCopy \
                 moves one: its lazy dump serves the memory of a single process tree, and \
                 each container is a tree of its own; use mode PreCopy or Cold, which move \
                 every container of the pod together",
                pod.containers.join(", ")
            ),
        ));
    }
    if n > MAX_CONTAINERS {
        return Some((
            reasons::MULTIPLE_CONTAINERS,
            format!(
                "pod {name} has {n} containers ({}; native sidecars count): at most \
                 {MAX_CONTAINERS} move with one migration; reschedule it instead",
                pod.containers.join(", ")
            ),
        ));
    }
    let (container, why) = pod.not_running_containers.first()?;
    Some((
        reasons::MULTIPLE_CONTAINERS,
        format!(
            "pod {name}: container {container} is not running ({why}), so it has no process \
             to move with the pod's other containers and its copy on the target would start \
             afresh; wait until it runs (or fix it), then migrate"
        ),
    ))
}

/// A non-root container in a mode whose dump needs root privileges the agents lack.
/// PreCopy and Cold dump a non-root container as its own user (the agent runs CRIU
/// as that user with its own capabilities: docs/security.md, "Non-root workloads");
/// PostCopy's lazy dump runs CRIU as root, which reads another user's resource limits
/// only with CAP_SYS_RESOURCE and seizes its process only with CAP_SYS_PTRACE.
fn non_root_refused(spec: &PodMigrationSpec, pod: &PodFacts) -> Option<Refusal> {
    if spec.mode != MigrationMode::PostCopy {
        return None;
    }
    let (container, uid) = pod.non_root_containers.first()?;
    Some((
        reasons::NON_ROOT_WORKLOAD,
        format!(
            "pod {}: container {container} runs as uid {uid}, and a PostCopy dump runs CRIU \
             as root, which needs CAP_SYS_RESOURCE and CAP_SYS_PTRACE to dump another \
             user's process; the agents hold neither (chart value \
             migrationAgent.agent.capabilities; CAP_SYS_RESOURCE must also be in the \
             node's capability bounding set). Use mode PreCopy or Cold, which dump it as \
             its own user",
            pod.name
        ),
    ))
}

/// Why the pod's data cannot follow it to another node, if it cannot. Pod-scoped
/// volumes may be waived with `leaveLocalDataBehind` (the target gets fresh ones);
/// disks and claims that cannot be mounted on the target node never are: the target
/// pod mounts the very same volume, so its holders would never start.
fn local_data(spec: &PodMigrationSpec, pod: &PodFacts) -> Option<String> {
    let name = &pod.name;
    let mut fixed: Vec<String> = pod
        .node_attached_disks
        .iter()
        .map(|(v, kind)| format!("volume {v} ({kind}) is a disk attached to one node at a time"))
        .collect();
    for c in &pod.claims {
        let (v, claim) = (&c.volume, &c.claim);
        match &c.facts {
            None => fixed.push(format!("volume {v}: claim {claim} does not exist")),
            Some(f) => {
                if let Some(kind) = f.node_local_kind {
                    fixed.push(format!(
                        "volume {v}: claim {claim} is bound to the {kind} PersistentVolume {}, \
                         whose data is on one node's disk",
                        f.volume_name.as_deref().unwrap_or("?")
                    ));
                } else if !f
                    .access_modes
                    .iter()
                    .any(|m| m == "ReadWriteMany" || m == "ReadOnlyMany")
                {
                    let modes = if f.access_modes.is_empty() {
                        "without access modes".to_string()
                    } else {
                        f.access_modes.join("/")
                    };
                    fixed.push(format!(
                        "volume {v}: claim {claim} is {modes}, so the target pod cannot mount \
                         it on another node while the source pod holds it"
                    ));
                }
            }
        }
    }
    if !fixed.is_empty() {
        return Some(format!(
            "pod {name} cannot take its storage along: {}; only ReadWriteMany or ReadOnlyMany \
             claims on volumes reachable from the target node follow a pod \
             (leaveLocalDataBehind does not change this); reschedule the pod instead",
            fixed.join("; ")
        ));
    }
    if spec.leave_local_data_behind || pod.local_volumes.is_empty() {
        return None;
    }
    let list: Vec<String> = pod
        .local_volumes
        .iter()
        .map(|(v, kind)| format!("{v} ({kind})"))
        .collect();
    Some(format!(
        "pod {name} keeps data on its node in {}; set spec.leaveLocalDataBehind: true to \
         migrate it with fresh, empty volumes on the target (that data is lost), or keep the \
         data on a ReadWriteMany claim",
        list.join(", ")
    ))
}

#[cfg(test)]
#[path = "checks_tests.rs"]
mod tests;
