//! The Runner pod's platform: the pool's node label and the platform of PodMotion's
//! preflight image (the operator's `--node-arch`) in one nodeSelector, the pool's label
//! winning a clash, which the status names instead of leaving pods failing unexplained.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::jiff::Timestamp;
use podmotion_api::RunnerPool;
use podmotion_api::conditions::{find, is_true};
use podmotion_api::names::{condition_types as ct, labels, reasons};
use serde_json::json;

use super::fixtures::{inputs, pool};
use super::render::{eligible, node_selector};
use super::{Applied, Facts, Inputs, render, status, status_inputs};
use crate::platform::{ARCH_LABEL, OS_LABEL, Platform};

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn selector_of(p: &RunnerPool, inputs: &Inputs) -> BTreeMap<String, String> {
    render(p, inputs)
        .daemonset
        .spec
        .template
        .spec
        .unwrap()
        .node_selector
        .unwrap()
}

/// The pool's status after a round that applied its DaemonSet, the DaemonSet
/// scheduling `desired` pods.
fn status_after(p: &RunnerPool, inputs: &Inputs, desired: i32) -> podmotion_api::RunnerPoolStatus {
    let d = render(p, inputs);
    let mut ds: DaemonSet = d.daemonset.clone();
    ds.metadata.generation = Some(1);
    ds.status = Some(
        serde_json::from_value(json!({
            "observedGeneration": 1, "desiredNumberScheduled": desired, "numberReady": desired,
            "updatedNumberScheduled": desired, "currentNumberScheduled": desired,
            "numberMisscheduled": 0,
        }))
        .unwrap(),
    );
    let facts = Facts {
        namespace_labels: map(&[("pod-security.kubernetes.io/enforce", "privileged")]),
        ..Facts::default()
    };
    let applied = Applied {
        daemonset: ds,
        drift: vec![],
        conflicts: vec![],
        credential_secret: None,
    };
    let observed = status_inputs(p, &d, inputs, &facts, applied);
    status::compute(p, &observed, Timestamp::from_second(1_800_000_000).unwrap())
}

#[test]
fn the_runner_pod_selects_the_pools_nodes_of_the_preflight_images_platform() {
    let sel = selector_of(&pool("rp").build(), &inputs());
    assert_eq!(
        sel,
        map(&[
            (labels::RUNNER_NODE, "true"),
            (OS_LABEL, "linux"),
            (ARCH_LABEL, "amd64")
        ])
    );
    let arm = Inputs {
        platform: Platform::linux("arm64"),
        ..inputs()
    };
    assert_eq!(selector_of(&pool("rp").build(), &arm)[ARCH_LABEL], "arm64");
    // Multi-architecture images: Linux only.
    let any = Inputs {
        platform: Platform::linux(""),
        ..inputs()
    };
    assert_eq!(
        selector_of(&pool("rp").build(), &any),
        map(&[(labels::RUNNER_NODE, "true"), (OS_LABEL, "linux")])
    );
    // A pool that names its own preflight image runs nothing of PodMotion's: its
    // nodes' architecture is its own to choose, the OS is still Linux.
    let mut own = pool("rp").build();
    own.spec.preflight.image = Some("registry.example/preflight@sha256:aa".into());
    assert_eq!(
        selector_of(&own, &inputs()),
        map(&[(labels::RUNNER_NODE, "true"), (OS_LABEL, "linux")])
    );
}

#[test]
fn eligible_nodes_match_every_key_of_the_selector() {
    let p = pool("rp").build();
    let amd = Platform::default();
    let node = |arch: &str| {
        map(&[
            (labels::RUNNER_NODE, "true"),
            (OS_LABEL, "linux"),
            (ARCH_LABEL, arch),
        ])
    };
    assert!(eligible(&p, &amd, &node("amd64")));
    assert!(!eligible(&p, &amd, &node("arm64")));
    assert!(eligible(&p, &Platform::linux(""), &node("arm64")));
    assert!(!eligible(&p, &amd, &map(&[(labels::RUNNER_NODE, "true")])));
    assert!(!eligible(
        &p,
        &amd,
        &map(&[(OS_LABEL, "linux"), (ARCH_LABEL, "amd64")])
    ));
}

#[test]
fn a_pool_label_naming_another_architecture_wins_and_stalls_the_pool_with_the_reason() {
    let p = pool("rp").node_label(ARCH_LABEL, "arm64").build();
    let (sel, clashes) = node_selector(&p, &Platform::default());
    assert_eq!(sel, map(&[(OS_LABEL, "linux"), (ARCH_LABEL, "arm64")]));
    assert_eq!(clashes.len(), 1);
    // Its pods go to the arm64 nodes (never zero pods without a word): the status
    // says why their preflight cannot run there.
    let s = status_after(&p, &inputs(), 2);
    let stalled = find(&s.conditions, ct::STALLED).unwrap();
    assert_eq!(
        (stalled.status.as_str(), stalled.reason.as_str()),
        ("True", reasons::PLATFORM_CONFLICT),
        "{:#?}",
        s.conditions
    );
    for want in [
        "kubernetes.io/arch=arm64",
        "kubernetes.io/arch=amd64",
        "spec.preflight.image",
    ] {
        assert!(
            stalled.message.contains(want),
            "{want}: {}",
            stalled.message
        );
    }
    let degraded = find(&s.conditions, ct::DEGRADED).unwrap();
    assert_eq!(degraded.reason, reasons::PLATFORM_CONFLICT);
    assert!(!is_true(&s.conditions, ct::READY));
    // A non-Linux label clashes whatever the architecture.
    let win = pool("rp").node_label(OS_LABEL, "windows").build();
    let s = status_after(&win, &inputs(), 1);
    assert_eq!(
        find(&s.conditions, ct::STALLED).unwrap().reason,
        reasons::PLATFORM_CONFLICT
    );
    // The same pool with its own preflight image (or the same architecture) is fine.
    let mut own = p.clone();
    own.spec.preflight.image = Some("registry.example/preflight@sha256:aa".into());
    let s = status_after(&own, &inputs(), 2);
    assert!(is_true(&s.conditions, ct::READY), "{:#?}", s.conditions);
    let same = pool("rp").node_label(ARCH_LABEL, "amd64").build();
    let s = status_after(&same, &inputs(), 2);
    assert!(is_true(&s.conditions, ct::READY), "{:#?}", s.conditions);
}

#[test]
fn no_eligible_node_names_the_platform_as_well_as_the_pools_label() {
    let s = status_after(&pool("rp").build(), &inputs(), 0);
    let stalled = find(&s.conditions, ct::STALLED).unwrap();
    assert_eq!(stalled.reason, reasons::NO_ELIGIBLE_NODES);
    for want in [
        "podmotion.io/runner-node=true",
        "kubernetes.io/arch=amd64",
        "kubernetes.io/os=linux",
    ] {
        assert!(
            stalled.message.contains(want),
            "{want}: {}",
            stalled.message
        );
    }
}
