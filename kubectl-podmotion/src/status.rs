//! `kubectl podmotion status`: lists the three PodMotion kinds in one namespace or all,
//! and prints one table. A kind the user may not list is reported under the table (with
//! the verb and resource to ask for) instead of failing the whole command.

use kube::api::{Api, ListParams};
use kube::{Client, Resource};
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};
use serde::de::DeserializeOwned;

use crate::explain::{Attempt, kube_error};
use crate::table::{Row, attachment_row, migration_row, render, runner_pool_row};

async fn list<K>(
    client: &Client,
    namespace: Option<&str>,
    resource: &'static str,
    row: fn(&K) -> Row,
    rows: &mut Vec<Row>,
    problems: &mut Vec<String>,
) where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    match api.list(&ListParams::default()).await {
        Ok(l) => rows.extend(l.items.iter().map(row)),
        Err(e) => problems.push(kube_error(
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

/// The table (or a line saying there is nothing) and the kinds that could not be listed.
pub async fn run(client: Client, namespace: Option<&str>) -> (String, Vec<String>) {
    let mut rows = vec![];
    let mut problems = vec![];
    list::<PodMigration>(
        &client,
        namespace,
        "podmigrations.podmotion.io",
        migration_row,
        &mut rows,
        &mut problems,
    )
    .await;
    list::<NodeAgentAttachment>(
        &client,
        namespace,
        "nodeagentattachments.podmotion.io",
        attachment_row,
        &mut rows,
        &mut problems,
    )
    .await;
    list::<RunnerPool>(
        &client,
        namespace,
        "runnerpools.podmotion.io",
        runner_pool_row,
        &mut rows,
        &mut problems,
    )
    .await;
    let text = if rows.is_empty() {
        match namespace {
            Some(ns) => format!("No PodMotion resources in namespace {ns}.\n"),
            None => "No PodMotion resources in any namespace.\n".to_string(),
        }
    } else {
        render(&rows)
    };
    (text, problems)
}
