//! Reading the node preflight's verdict from a Runner pod.
//!
//! The `preflight` executor (executors/preflight) runs as the pod's init container and
//! writes one JSON line to its termination message:
//! `{"preflight":"v1","ok":false,"checks":[{"name":"kvm","ok":false,"detail":"…"}]}`.
//! The kubelet copies it to `status.initContainerStatuses[].state.terminated.message`
//! (or `lastState` once the init container is being retried). This module turns that
//! into a per-node verdict; it never trusts the message to be well-formed.
//!
//! The preflight's checks are named after the pod field they prove was honoured
//! (`hostUsers`, `procMount`, `seccompProfile`, `capabilities`, besides `kvm`, `userns`,
//! `apparmor`, `quota`). When the node refuses the shape before the preflight can run
//! (the runtime cannot create the container: a missing seccomp profile, no user
//! namespace support, a device it cannot create), the runtime's message is reported
//! under the field it names, so that a node never runs the pod with less than asked
//! without the pool saying which field and why.

use k8s_openapi::api::core::v1::{ContainerStateTerminated, Pod};
use podmotion_api::runner_pool::PreflightFailure;
use serde::Deserialize;

/// Name of the preflight init container in every Runner pod.
pub const PREFLIGHT_CONTAINER: &str = "preflight";

/// Version tag of the verdict format.
pub const VERDICT_VERSION: &str = "v1";

/// One check of a verdict.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    #[serde(default)]
    pub detail: String,
}

/// The executor's verdict line.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct Verdict {
    pub preflight: String,
    pub ok: bool,
    #[serde(default)]
    pub checks: Vec<Check>,
}

/// Parses a termination message (only its first line counts).
pub fn parse_verdict(message: &str) -> Result<Verdict, String> {
    let line = message.lines().next().unwrap_or_default().trim();
    let v: Verdict =
        serde_json::from_str(line).map_err(|e| format!("unreadable preflight verdict: {e}"))?;
    if v.preflight != VERDICT_VERSION {
        return Err(format!(
            "preflight verdict version {:?}, want {VERDICT_VERSION:?}",
            v.preflight
        ));
    }
    Ok(v)
}

/// What a pod says about its node's preflight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePreflight {
    /// Not finished yet (or the pod has not started).
    Pending,
    /// Every check passed on this node.
    Passed(String),
    Failed(PreflightFailure),
}

/// The pod field a runtime's refusal to create or start a container names, with what
/// the node must provide; `None` when the message names none of the Runner's fields
/// (an image pull, a name conflict: not a node problem this module can name).
pub fn refused_field(message: &str) -> Option<(&'static str, &'static str)> {
    let m = message.to_ascii_lowercase();
    let has = |words: &[&str]| words.iter().any(|w| m.contains(w));
    if has(&["seccomp"]) {
        Some((
            "seccompProfile",
            "the Localhost profile is not usable on the node (staged under the kubelet's seccomp root?)",
        ))
    } else if has(&["apparmor"]) {
        Some((
            "appArmorProfile",
            "the runtime cannot apply the AppArmor setting",
        ))
    } else if has(&[
        "user namespace",
        "userns",
        "idmap",
        "id map",
        "uid_map",
        "hostusers",
    ]) {
        Some((
            "hostUsers",
            "the node cannot run the pod in a user namespace (hostUsers: false)",
        ))
    } else if has(&["procmount", "proc mount", "masked"]) {
        Some(("procMount", "the node cannot honour procMount: Unmasked"))
    } else if has(&["/dev/kvm", "device"]) {
        Some((
            "kvm",
            "the runtime cannot give the container the KVM device",
        ))
    } else {
        None
    }
}

fn refused_by_node(node: &str, message: &str) -> Option<PreflightFailure> {
    let (field, why) = refused_field(message)?;
    Some(PreflightFailure {
        node: node.into(),
        checks: vec![field.into()],
        message: format!("{field}: {why}: {message}"),
    })
}

fn failure(node: &str, t: &ContainerStateTerminated) -> NodePreflight {
    let message = t.message.clone().unwrap_or_default();
    // runc failed to start the container (the kubelet records StartError with runc's
    // message): no verdict, but the message may name the field the node refused.
    if t.exit_code != 0
        && parse_verdict(&message).is_err()
        && let Some(f) = refused_by_node(node, &message)
    {
        return NodePreflight::Failed(f);
    }
    match parse_verdict(&message) {
        Ok(v) if v.ok && t.exit_code == 0 => NodePreflight::Passed(node.into()),
        Ok(v) => {
            let failed: Vec<&Check> = v.checks.iter().filter(|c| !c.ok).collect();
            NodePreflight::Failed(PreflightFailure {
                node: node.into(),
                checks: failed.iter().map(|c| c.name.clone()).collect(),
                message: failed
                    .iter()
                    .map(|c| format!("{}: {}", c.name, c.detail))
                    .collect::<Vec<_>>()
                    .join("; "),
            })
        }
        Err(e) if t.exit_code == 0 => {
            // Exited cleanly without a verdict: not a node problem we can name.
            tracing::debug!(node, error = %e, "preflight passed without a verdict");
            NodePreflight::Passed(node.into())
        }
        Err(e) => NodePreflight::Failed(PreflightFailure {
            node: node.into(),
            checks: vec!["verdict".into()],
            message: format!(
                "preflight exited {} ({}): {e}",
                t.exit_code,
                t.reason.clone().unwrap_or_default()
            ),
        }),
    }
}

/// The preflight outcome a Runner pod reports for its node.
pub fn from_pod(pod: &Pod) -> NodePreflight {
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or_default();
    let Some(status) = pod
        .status
        .as_ref()
        .and_then(|s| s.init_container_statuses.as_ref())
        .and_then(|l| l.iter().find(|c| c.name == PREFLIGHT_CONTAINER))
    else {
        return NodePreflight::Pending;
    };
    if let Some(t) = status.state.as_ref().and_then(|s| s.terminated.as_ref()) {
        return failure(node, t);
    }
    // The runtime could not create or start the container (a Localhost seccomp profile
    // not staged on the node, no user namespace support, a device it cannot create): the
    // preflight never ran, so say it here, under the field the runtime's message names.
    if let Some(w) = status.state.as_ref().and_then(|s| s.waiting.as_ref()) {
        let message = w.message.clone().unwrap_or_default();
        let refused = matches!(
            w.reason.as_deref(),
            Some("CreateContainerError" | "CreateContainerConfigError" | "RunContainerError")
        );
        if refused && let Some(f) = refused_by_node(node, &message) {
            return NodePreflight::Failed(f);
        }
    }
    // Retried after a failure: the last run's verdict is the news.
    if let Some(t) = status
        .last_state
        .as_ref()
        .and_then(|s| s.terminated.as_ref())
    {
        return failure(node, t);
    }
    NodePreflight::Pending
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod_with(state: serde_json::Value, last: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "rp-x"},
            "spec": {"nodeName": "pm-node-2", "containers": []},
            "status": {"initContainerStatuses": [{
                "name": "preflight", "image": "i", "imageID": "", "ready": false, "restartCount": 1,
                "state": state, "lastState": last,
            }]}
        }))
        .unwrap()
    }
    const FAIL: &str = r#"{"preflight":"v1","ok":false,"checks":[{"name":"kvm","ok":false,"detail":"open /dev/kvm: Permission denied (os error 13)"},{"name":"userns","ok":true,"detail":"created"}]}"#;

    #[test]
    fn failed_preflight_names_the_node_and_the_failing_checks() {
        let p = pod_with(
            json!({"terminated": {"exitCode": 1, "message": FAIL}}),
            json!({}),
        );
        let NodePreflight::Failed(f) = from_pod(&p) else {
            panic!("want failure")
        };
        assert_eq!(f.node, "pm-node-2");
        assert_eq!(f.checks, vec!["kvm"]);
        assert!(f.message.contains("Permission denied"), "{}", f.message);
    }

    #[test]
    fn the_executors_golden_verdict_parses_with_both_failures_named() {
        let line = include_str!("../../../../executors/preflight/testdata/verdict-v1.json");
        let p = pod_with(
            json!({"terminated": {"exitCode": 1, "message": line}}),
            json!({}),
        );
        let NodePreflight::Failed(f) = from_pod(&p) else {
            panic!("want failure")
        };
        assert_eq!(f.checks, vec!["kvm", "quota"]);
        assert!(
            f.message.contains("mode 0666") && f.message.contains("prjquota"),
            "{}",
            f.message
        );
    }

    #[test]
    fn retried_preflight_reports_the_last_failed_run() {
        let p = pod_with(
            json!({"waiting": {"reason": "CrashLoopBackOff"}}),
            json!({"terminated": {"exitCode": 1, "message": FAIL}}),
        );
        assert!(matches!(from_pod(&p), NodePreflight::Failed(_)));
    }

    #[test]
    fn passing_preflight_is_passed_and_running_is_pending() {
        let ok = r#"{"preflight":"v1","ok":true,"checks":[{"name":"kvm","ok":true}]}"#;
        assert_eq!(
            from_pod(&pod_with(
                json!({"terminated": {"exitCode": 0, "message": ok}}),
                json!({})
            )),
            NodePreflight::Passed("pm-node-2".into())
        );
        assert_eq!(
            from_pod(&pod_with(json!({"running": {}}), json!({}))),
            NodePreflight::Pending
        );
    }

    #[test]
    fn a_missing_seccomp_profile_is_reported_as_a_seccomp_failure() {
        let p = pod_with(
            json!({"waiting": {"reason": "CreateContainerError", "message": "failed to generate security options: cannot load seccomp profile \"/var/lib/kubelet/seccomp/podmotion/compass-runner.json\": no such file"}}),
            json!({}),
        );
        let NodePreflight::Failed(f) = from_pod(&p) else {
            panic!("want failure")
        };
        assert_eq!(f.checks, vec!["seccompProfile"]);
        assert!(
            f.message.contains("missing.json") || f.message.contains("compass-runner.json"),
            "{}",
            f.message
        );
        let other = pod_with(
            json!({"waiting": {"reason": "CreateContainerError", "message": "image pull"}}),
            json!({}),
        );
        assert_eq!(from_pod(&other), NodePreflight::Pending);
    }

    #[test]
    fn a_runtime_without_user_namespaces_is_reported_under_host_users() {
        // containerd/runc refusing the container (measured wording varies by runtime:
        // matched on the field it names).
        let p = pod_with(
            json!({"waiting": {"reason": "RunContainerError", "message": "failed to create containerd task: OCI runtime create failed: runc create failed: user namespaces are not enabled in this kernel"}}),
            json!({}),
        );
        let NodePreflight::Failed(f) = from_pod(&p) else {
            panic!("want failure")
        };
        assert_eq!(f.checks, vec!["hostUsers"]);
        assert!(f.message.starts_with("hostUsers: "), "{}", f.message);
        let started = pod_with(
            json!({"terminated": {"exitCode": 128, "reason": "StartError", "message": "error mounting \"/dev/kvm\": device not allowed"}}),
            json!({}),
        );
        let NodePreflight::Failed(f) = from_pod(&started) else {
            panic!("want failure")
        };
        assert_eq!(f.checks, vec!["kvm"]);
    }

    #[test]
    fn a_check_named_after_a_field_lands_in_status_with_its_detail() {
        // What the preflight writes when the runtime ran the pod with a masked /proc
        // (measured on pm-real-2 with procMount: Default).
        let line = r#"{"preflight":"v1","ok":false,"checks":[{"name":"kvm","ok":true,"detail":"ok"},{"name":"procMount","ok":false,"detail":"mount -t proc proc /proc in a new user+PID namespace: EPERM: Operation not permitted (a masked /proc blocks it: is procMount: Unmasked honoured, with hostUsers: false?)"}]}"#;
        let p = pod_with(
            json!({"terminated": {"exitCode": 1, "message": line}}),
            json!({}),
        );
        let NodePreflight::Failed(f) = from_pod(&p) else {
            panic!("want failure")
        };
        assert_eq!(f.checks, vec!["procMount"]);
        assert!(
            f.message.starts_with("procMount: mount -t proc"),
            "{}",
            f.message
        );
    }

    #[test]
    fn garbage_from_a_failed_preflight_is_a_verdict_failure_not_a_crash() {
        let p = pod_with(
            json!({"terminated": {"exitCode": 2, "reason": "Error", "message": "segfault\n"}}),
            json!({}),
        );
        let NodePreflight::Failed(f) = from_pod(&p) else {
            panic!("want failure")
        };
        assert_eq!(f.checks, vec!["verdict"]);
        assert!(parse_verdict(r#"{"preflight":"v9","ok":true}"#).is_err());
    }
}
