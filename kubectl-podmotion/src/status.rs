//! `kubectl podmotion status`: lists the three PodMotion kinds in one namespace or all,
//! and prints one table. A kind the user may not list is reported under the table (with
//! the verb and resource to ask for) instead of failing the whole command. With
//! `-o json|yaml`, the objects themselves, as one `List` (as `kubectl get -o`).

use kube::api::{Api, ListParams};
use kube::{Client, Resource};
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};
use serde::de::DeserializeOwned;

use crate::cli::Output;
use crate::explain::{Attempt, kube_error};
use crate::table::{Row, attachment_row, migration_row, render, runner_pool_row};

async fn list<K>(
    client: &Client,
    namespace: Option<&str>,
    resource: &'static str,
    row: fn(&K) -> Row,
    found: &mut Found,
) where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    match api.list(&ListParams::default()).await {
        Ok(l) => {
            found.rows.extend(l.items.iter().map(row));
            for k in &l.items {
                // Only fails for a type that cannot be JSON: ours all can.
                if let Ok(v) = crate::output::object(k) {
                    found.objects.push(v);
                }
            }
        }
        Err(e) => found.problems.push(kube_error(
            Attempt {
                verb: "list",
                resource,
                namespace,
                name: None,
            },
            &e,
        )),
    }
}

#[derive(Default)]
struct Found {
    rows: Vec<Row>,
    objects: Vec<serde_json::Value>,
    problems: Vec<String>,
}

/// The table (or a line saying there is nothing), or with `output` the objects as a
/// `List`; and the kinds that could not be listed.
pub async fn run(
    client: Client,
    namespace: Option<&str>,
    output: Option<Output>,
) -> anyhow::Result<(String, Vec<String>)> {
    let mut found = Found::default();
    list::<PodMigration>(
        &client,
        namespace,
        "podmigrations.podmotion.io",
        migration_row,
        &mut found,
    )
    .await;
    list::<NodeAgentAttachment>(
        &client,
        namespace,
        "nodeagentattachments.podmotion.io",
        attachment_row,
        &mut found,
    )
    .await;
    list::<RunnerPool>(
        &client,
        namespace,
        "runnerpools.podmotion.io",
        runner_pool_row,
        &mut found,
    )
    .await;
    let Found {
        rows,
        objects,
        problems,
    } = found;
    if let Some(format) = output {
        return Ok((
            crate::output::render(&crate::output::list(objects), format)?,
            problems,
        ));
    }
    let text = if rows.is_empty() {
        match namespace {
            Some(ns) => format!("No PodMotion resources in namespace {ns}.\n"),
            None => "No PodMotion resources in any namespace.\n".to_string(),
        }
    } else {
        render(&rows)
    };
    Ok((text, problems))
}
