//! The example manifests under `examples/` against the real API server: the generated
//! CRDs are installed, every valid example is accepted and every invalid one is rejected
//! with the message its `# expect:` line names, by server-side dry-run (see
//! `podmotion_api::samples` for the file format).
//!
//! Needs `hack/cluster.sh up`; fails without a cluster unless PODMOTION_E2E=0.

use kube::Resource;
use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use kube::core::{ApiResource, Request};
use podmotion_api::samples::{Sample, examples_dir, load_dir};
use podmotion_e2e::operator::install_crds;
use podmotion_e2e::{PodSecurity, TIMEOUT, TestNamespace, wait_for};
use serde_json::Value;

const MANAGER: &str = "podmotion-e2e";

fn resource_for<'a>(resources: &'a [ApiResource], obj: &Value, file: &str) -> &'a ApiResource {
    let api_version = obj
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let kind = obj.get("kind").and_then(Value::as_str).unwrap_or_default();
    resources
        .iter()
        .find(|r| r.api_version == api_version && r.kind == kind)
        .unwrap_or_else(|| panic!("{file}: no installed CRD serves {api_version} {kind}"))
}

/// The object as sent: placed in the test namespace.
fn object(ns: &TestNamespace, v: &Value) -> DynamicObject {
    let mut obj: DynamicObject =
        serde_json::from_value(v.clone()).expect("example is an object with metadata");
    obj.metadata.namespace = Some(ns.name.clone());
    obj
}

/// POST (create) or PUT (update) like `kubectl --dry-run=server` does: with
/// `fieldValidation=Strict`, so unknown fields are errors rather than warnings.
async fn send(
    ns: &TestNamespace,
    ar: &ApiResource,
    obj: &DynamicObject,
    update: bool,
    dry_run: bool,
) -> Result<DynamicObject, kube::Error> {
    let req = Request::new(DynamicObject::url_path(ar, Some(&ns.name)));
    let pp = PostParams {
        dry_run,
        field_manager: Some(MANAGER.into()),
    };
    let body = serde_json::to_vec(obj).unwrap();
    let mut http_req = if update {
        req.replace(obj.metadata.name.as_deref().unwrap_or_default(), &pp, body)
    } else {
        req.create(&pp, body)
    }
    .map_err(kube::Error::BuildRequest)?;
    let uri = http_req.uri().to_string();
    let sep = if uri.contains('?') { '&' } else { '?' };
    *http_req.uri_mut() = format!("{uri}{sep}fieldValidation=Strict").parse().unwrap();
    ns.client.request::<DynamicObject>(http_req).await
}

/// Sends a sample; an update sample's first document is created for real first and
/// deleted afterwards.
async fn submit(
    ns: &TestNamespace,
    resources: &[ApiResource],
    s: &Sample,
) -> Result<(), kube::Error> {
    let ar = resource_for(resources, &s.object, &s.name());
    let mut obj = object(ns, &s.object);
    let Some(old) = &s.old else {
        return send(ns, ar, &obj, false, true).await.map(|_| ());
    };
    let old_ar = resource_for(resources, old, &s.name());
    let created = send(ns, old_ar, &object(ns, old), false, false)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{}: the first document (existing object) was rejected: {e}",
                s.name()
            )
        });
    obj.metadata.resource_version = created.metadata.resource_version.clone();
    let result = send(ns, ar, &obj, true, true).await.map(|_| ());
    let name = created.metadata.name.clone().unwrap();
    Api::<DynamicObject>::namespaced_with(ns.client.clone(), &ns.name, old_ar)
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("{}: deleting {name}: {e}", s.name()));
    wait_for(
        &Api::<DynamicObject>::namespaced_with(ns.client.clone(), &ns.name, old_ar),
        &name,
        TIMEOUT,
        "deletion",
        |o| o.is_none(),
    )
    .await
    .unwrap();
    result
}

#[tokio::test]
async fn examples_are_accepted_or_rejected_by_the_api_server() {
    let Some(ns) = TestNamespace::new("examples", PodSecurity::Restricted).await else {
        return;
    };
    let resources = install_crds(&ns.client).await;

    let valid = load_dir(&examples_dir().join("valid")).unwrap();
    let invalid = load_dir(&examples_dir().join("invalid")).unwrap();
    assert!(
        !valid.is_empty(),
        "no valid examples in {}",
        examples_dir().display()
    );
    assert!(
        !invalid.is_empty(),
        "no invalid examples in {}",
        examples_dir().display()
    );

    let mut failures = Vec::new();
    for s in &valid {
        if let Err(e) = submit(&ns, &resources, s).await {
            failures.push(format!("valid/{}: rejected: {e}", s.name()));
        }
    }
    for s in &invalid {
        let Some(expect) = s.expect.as_deref() else {
            failures.push(format!("invalid/{}: no `# expect:` line", s.name()));
            continue;
        };
        match submit(&ns, &resources, s).await {
            Ok(()) => failures.push(format!(
                "invalid/{}: accepted, want rejection containing {expect:?}",
                s.name()
            )),
            Err(kube::Error::Api(st)) if st.message.contains(expect) => {}
            Err(e) => failures.push(format!(
                "invalid/{}: want rejection containing {expect:?}, got: {e}",
                s.name()
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} examples misjudged by the API server:\n{}",
        failures.len(),
        valid.len() + invalid.len(),
        failures.join("\n")
    );
}
