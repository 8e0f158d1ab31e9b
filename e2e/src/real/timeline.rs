//! What happened around one migration, on its clients' clock: the PodMigration's phases,
//! the Service's EndpointSlices (each endpoint's address and whether it is
//! ready/serving/terminating) and the namespace's pods (node, address, ready, deleted),
//! as the watches delivered them. Printed beside what the clients saw
//! ([`super::copies::assert_clients`], `bench_client_gap`), so a gap or a failed
//! request can be placed against the freeze, the commit and the endpoint switch.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource, ResourceExt};
use podmotion_api::PodMigration;
use serde::de::DeserializeOwned;

type Log = Arc<Mutex<Vec<(u128, String)>>>;

/// The watches of one migration's timeline; they stop when it is dropped.
pub struct Timeline {
    log: Log,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Timeline {
    /// Watches the PodMigration `migration`, the EndpointSlices of the Service
    /// `service` and the pods of namespace `ns`, from `t0` (the clients' start).
    pub fn watch(client: Client, ns: &str, service: &str, migration: &str, t0: Instant) -> Self {
        let log: Log = Arc::new(Mutex::new(vec![]));
        let slices =
            watcher::Config::default().labels(&format!("kubernetes.io/service-name={service}"));
        let pm = watcher::Config::default().fields(&format!("metadata.name={migration}"));
        let tasks = vec![
            follow::<EndpointSlice>(
                Api::namespaced(client.clone(), ns),
                slices,
                &log,
                t0,
                endpoints,
            ),
            follow::<PodMigration>(Api::namespaced(client.clone(), ns), pm, &log, t0, |m| {
                let s = m.status.as_ref()?;
                Some(format!("{}: phase {:?}", m.name_any(), s.phase))
            }),
            follow::<Pod>(
                Api::namespaced(client, ns),
                watcher::Config::default(),
                &log,
                t0,
                pod,
            ),
        ];
        Timeline { log, tasks }
    }

    /// The lines so far, in the order they arrived: `  <ms> <what>`.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (at, what) in self.log.lock().unwrap().iter() {
            out.push_str(&format!("    {at:>6} {what}\n"));
        }
        out
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Follows `api` (`cfg`), logging `line` of each object whenever that object's line
/// changes (one line per object name).
fn follow<K>(
    api: Api<K>,
    cfg: watcher::Config,
    log: &Log,
    t0: Instant,
    line: fn(&K) -> Option<String>,
) -> tokio::task::JoinHandle<()>
where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let log = log.clone();
    tokio::spawn(async move {
        let mut last = std::collections::HashMap::<String, String>::new();
        let mut st = watcher::watcher(api, cfg).boxed();
        while let Some(ev) = st.next().await {
            let (obj, gone) = match ev {
                Ok(Event::Apply(o) | Event::InitApply(o)) => (o, false),
                Ok(Event::Delete(o)) => (o, true),
                _ => continue,
            };
            let name = obj.name_any();
            let now = if gone {
                Some(format!("{} {name}: gone", K::kind(&())))
            } else {
                line(&obj)
            };
            let Some(now) = now else { continue };
            if last.get(&name) != Some(&now) {
                log.lock()
                    .unwrap()
                    .push((t0.elapsed().as_millis(), now.clone()));
                last.insert(name, now);
            }
        }
    })
}

/// An EndpointSlice as `endpoints <addr>[RST] …` (ready, serving, terminating).
pub fn endpoints(s: &EndpointSlice) -> Option<String> {
    let mut out: Vec<String> = s
        .endpoints
        .iter()
        .flatten()
        .map(|e| {
            let c = e.conditions.clone().unwrap_or_default();
            let flag = |b: Option<bool>, t: &'static str| if b == Some(true) { t } else { "" };
            format!(
                "{}[{}{}{}]",
                e.addresses.first().cloned().unwrap_or_default(),
                flag(c.ready, "R"),
                flag(c.serving, "S"),
                flag(c.terminating, "T")
            )
        })
        .collect();
    out.sort();
    Some(format!("endpoints {}", out.join(" ")))
}

/// A pod as `pod <name> on <node> <ip> <phase>[ ready][ deleting]`.
fn pod(p: &Pod) -> Option<String> {
    let st = p.status.as_ref();
    let ready = st
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    Some(format!(
        "pod {} on {} {} {}{}{}",
        p.name_any(),
        p.spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default(),
        st.and_then(|s| s.pod_ip.clone()).unwrap_or_default(),
        st.and_then(|s| s.phase.clone()).unwrap_or_default(),
        if ready { " ready" } else { "" },
        if p.metadata.deletion_timestamp.is_some() {
            " deleting"
        } else {
            ""
        },
    ))
}
