//! Would the namespace's PodSecurity admission accept the Runner pods? The check runs
//! the Pod Security Standards' baseline rules that our pod shape can touch against the
//! rendered pod, so the answer follows the real template, not a hard-coded claim.
//!
//! The Runner needs `privileged`: its two hostPath volumes and AppArmor `Unconfined`
//! are forbidden by `baseline` (and so by `restricted`). `procMount: Unmasked` is
//! allowed by `baseline` since 1.35 for pods with `hostUsers: false`, which ours are.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, PodSpec};

/// Namespace label holding the enforced level.
pub const ENFORCE_LABEL: &str = "pod-security.kubernetes.io/enforce";

/// A PodSecurity level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Restricted,
    Baseline,
    Privileged,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Restricted => "restricted",
            Level::Baseline => "baseline",
            Level::Privileged => "privileged",
        }
    }
    /// The level a namespace enforces. No label: the API server's default,
    /// `privileged` (unless the cluster's admission configuration says otherwise).
    /// An unknown value is read as the strictest level.
    pub fn enforced(namespace_labels: &BTreeMap<String, String>) -> Level {
        match namespace_labels.get(ENFORCE_LABEL).map(String::as_str) {
            None | Some("privileged") => Level::Privileged,
            Some("baseline") => Level::Baseline,
            _ => Level::Restricted,
        }
    }
}

/// The verdict for one namespace and pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodSecurityVerdict {
    pub namespace: String,
    pub enforced: Level,
    /// What in the pod the `baseline` level forbids.
    pub baseline_violations: Vec<String>,
}

impl PodSecurityVerdict {
    pub fn admitted(&self) -> bool {
        self.enforced == Level::Privileged || self.baseline_violations.is_empty()
    }
    /// A message for the condition: what the namespace enforces, what it rejects, and
    /// what to do.
    pub fn message(&self) -> String {
        if self.admitted() {
            return format!(
                "namespace {} enforces PodSecurity level {}, which admits the Runner pods",
                self.namespace,
                self.enforced.as_str()
            );
        }
        format!(
            "namespace {} enforces PodSecurity level {}, which rejects the Runner pods ({}); \
             label the namespace pod-security.kubernetes.io/enforce=privileged \
             (the Runner's hostPath mounts are forbidden by baseline)",
            self.namespace,
            self.enforced.as_str(),
            self.baseline_violations.join("; ")
        )
    }
}

fn all_containers(pod: &PodSpec) -> impl Iterator<Item = &Container> {
    pod.init_containers
        .iter()
        .flatten()
        .chain(pod.containers.iter())
}

/// The `baseline` rules our pod shape can break, in the API server's terms.
pub fn baseline_violations(pod: &PodSpec) -> Vec<String> {
    let mut v = pod_violations(pod);
    let user_namespaced = pod.host_users == Some(false);
    for c in all_containers(pod) {
        v.extend(container_violations(c, user_namespaced));
    }
    v
}

/// The pod's own: hostPath volumes, the host's namespaces, an unconfined AppArmor
/// profile.
fn pod_violations(pod: &PodSpec) -> Vec<String> {
    let mut v = vec![];
    let host_paths: Vec<&str> = pod
        .volumes
        .iter()
        .flatten()
        .filter(|vol| vol.host_path.is_some())
        .map(|vol| vol.name.as_str())
        .collect();
    if !host_paths.is_empty() {
        v.push(format!("hostPath volumes {}", host_paths.join(", ")));
    }
    for (on, what) in [
        (pod.host_network, "hostNetwork"),
        (pod.host_pid, "hostPID"),
        (pod.host_ipc, "hostIPC"),
    ] {
        if on == Some(true) {
            v.push(format!("{what}=true"));
        }
    }
    let pod_apparmor_unconfined = pod
        .security_context
        .as_ref()
        .and_then(|s| s.app_armor_profile.as_ref())
        .is_some_and(|p| p.type_ == "Unconfined");
    if pod_apparmor_unconfined {
        v.push("pod AppArmor profile Unconfined".into());
    }
    v
}

/// One container's: privileged, unconfined AppArmor, a procMount outside a user
/// namespace, added capabilities, a hostPort (a container without a securityContext is
/// passed over).
fn container_violations(c: &Container, user_namespaced: bool) -> Vec<String> {
    let mut v = vec![];
    let Some(sc) = &c.security_context else {
        return v;
    };
    if sc.privileged == Some(true) {
        v.push(format!("container {} privileged", c.name));
    }
    if sc
        .app_armor_profile
        .as_ref()
        .is_some_and(|p| p.type_ == "Unconfined")
    {
        v.push(format!("container {} AppArmor profile Unconfined", c.name));
    }
    if sc.proc_mount.as_deref().is_some_and(|m| m != "Default") && !user_namespaced {
        v.push(format!(
            "container {} procMount without hostUsers: false",
            c.name
        ));
    }
    let added = sc
        .capabilities
        .as_ref()
        .and_then(|c| c.add.as_ref())
        .map(Vec::len)
        .unwrap_or(0);
    if added > 0 {
        v.push(format!("container {} adds capabilities", c.name));
    }
    if c.ports
        .iter()
        .flatten()
        .any(|p| p.host_port.is_some_and(|h| h != 0))
    {
        v.push(format!("container {} hostPort", c.name));
    }
    v
}

/// Judges `pod` against the namespace's enforced level.
pub fn check(
    namespace: &str,
    namespace_labels: &BTreeMap<String, String>,
    pod: &PodSpec,
) -> PodSecurityVerdict {
    PodSecurityVerdict {
        namespace: namespace.into(),
        enforced: Level::enforced(namespace_labels),
        baseline_violations: baseline_violations(pod),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner_pool::fixtures::{inputs, pool};
    use crate::runner_pool::render;

    fn runner_pod() -> PodSpec {
        render(&pool("rp").build(), &inputs())
            .daemonset
            .spec
            .template
            .spec
            .unwrap()
    }
    fn labels(level: Option<&str>) -> BTreeMap<String, String> {
        level
            .map(|l| BTreeMap::from([(ENFORCE_LABEL.to_string(), l.to_string())]))
            .unwrap_or_default()
    }

    #[test]
    fn privileged_namespace_admits_the_runner() {
        let v = check("runners", &labels(Some("privileged")), &runner_pod());
        assert!(v.admitted(), "{}", v.message());
    }

    #[test]
    fn unlabelled_namespace_is_read_as_the_default_privileged() {
        assert!(check("runners", &labels(None), &runner_pod()).admitted());
    }

    #[test]
    fn baseline_namespace_rejects_the_runner_and_names_host_path_and_apparmor() {
        let v = check("runners", &labels(Some("baseline")), &runner_pod());
        assert!(!v.admitted());
        let m = v.message();
        assert!(m.contains("hostPath volumes sessions, runtime"), "{m}");
        assert!(m.contains("AppArmor profile Unconfined"), "{m}");
        assert!(m.contains("enforce=privileged"), "{m}");
    }

    #[test]
    fn restricted_namespace_rejects_the_runner() {
        assert!(!check("runners", &labels(Some("restricted")), &runner_pod()).admitted());
    }

    #[test]
    fn unmasked_proc_mount_is_a_violation_only_without_user_namespaces() {
        let mut pod = runner_pod();
        assert!(
            !baseline_violations(&pod)
                .iter()
                .any(|v| v.contains("procMount"))
        );
        pod.host_users = Some(true);
        assert!(
            baseline_violations(&pod)
                .iter()
                .any(|v| v.contains("procMount"))
        );
    }
}
