//! NodeAgentAttachment on the real nodes, shared by the real-node attachment tests: a
//! chart release watching one workloads' namespace ([`AttachWorld`]), testload
//! workloads and Intercept attachments in it, and what the tests read — the agent Jobs
//! matched one by one against the pods they target (name, pod UID, node, container
//! IDs, resumed, their agent pod Running and Ready), every version of a Job name as a
//! watch saw it ([`JobHistory`]), Events naming a Job, and the attach agent's nftables
//! table in a replica's network namespace.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::watcher::{self, Event};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::names::{annotations, labels};
use podmotion_operator::attachment::naming::job_name;
use serde_json::{Value, json};

use super::procs::workload_processes;
use super::testload::{self, POD_TIMEOUT};
use super::{Images, Uninstall, helm_install, kubectl, nft_tables, output_text, real_nodes};
use crate::{PodSecurity, TestNamespace, from_json, pod_running_ready, random_suffix, wait_list};

/// The chart's `attachment.jobPrefix`.
pub const JOB_PREFIX: &str = "podmotion-agent";
/// An attach Job pod's label naming its Job.
pub const JOB_NAME_LABEL: &str = "batch.kubernetes.io/job-name";
/// An attach Job pod's label holding its Job's UID.
pub const JOB_UID_LABEL: &str = "batch.kubernetes.io/controller-uid";

/// A release of the chart for one test: its operator's namespace, the workloads'
/// namespace it watches, and the real nodes.
pub struct AttachWorld {
    // Fields drop in this order: the release, then the namespaces.
    pub release: Uninstall,
    pub app: TestNamespace,
    pub op: TestNamespace,
    pub images: Images,
}

impl AttachWorld {
    /// Namespaces `e2e-<prefix>-op` (restricted) and `e2e-<prefix>` (`level`: the
    /// testload server runs as uid 0, so at least baseline) and the chart with `extra`
    /// values. `None` where there are no real nodes.
    pub async fn new(prefix: &str, level: PodSecurity, extra: &[&str]) -> Option<AttachWorld> {
        let op = TestNamespace::new(&format!("{prefix}-op"), PodSecurity::Restricted).await?;
        let nodes = real_nodes(&op.client).await?;
        assert!(!nodes.is_empty());
        let app = TestNamespace::new(prefix, level).await?;
        let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
        let release = helm_install(
            &format!("pm{}", random_suffix()),
            &images,
            &op.name,
            &app.name,
            &format!("podmotion-e2e-{prefix}"),
            extra,
        );
        Some(AttachWorld {
            release,
            app,
            op,
            images,
        })
    }

    pub fn agents(&self) -> String {
        format!("{}-agents", self.op.name)
    }

    pub fn jobs(&self) -> Api<Job> {
        Api::namespaced(self.op.client.clone(), &self.agents())
    }

    pub fn agent_pods(&self) -> Api<Pod> {
        Api::namespaced(self.op.client.clone(), &self.agents())
    }

    /// The selector of every agent Job whose target is in the workloads' namespace.
    pub fn job_selector(&self) -> String {
        format!("{}={}", labels::TARGET_NAMESPACE, self.app.name)
    }

    /// A testload Deployment `name` of `replicas` (1 MiB of ballast) on the real nodes,
    /// changed by `alter` (its JSON), created.
    pub async fn deploy(&self, name: &str, replicas: i32, alter: impl FnOnce(&mut Value)) {
        let d = testload::deployment(name, &self.images.testload().unwrap(), 1);
        let mut d = serde_json::to_value(d).unwrap();
        d["spec"]["replicas"] = json!(replicas);
        alter(&mut d);
        self.app
            .api::<Deployment>()
            .create(&PostParams::default(), &from_json(d))
            .await
            .unwrap();
    }

    /// An Intercept attachment `name` of Deployment `workload` (every port), created.
    pub async fn attach(&self, name: &str, workload: &str) {
        self.attach_with(name, workload, json!({})).await
    }

    /// An attachment `name` of Deployment `workload`, Intercept unless `spec` (merged
    /// over it) says otherwise, created.
    pub async fn attach_with(&self, name: &str, workload: &str, spec: Value) {
        let mut s =
            json!({"workloadRef": {"kind": "Deployment", "name": workload}, "mode": "Intercept"});
        for (k, v) in spec.as_object().expect("an object") {
            s[k] = v.clone();
        }
        let a: NodeAgentAttachment = from_json(json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "NodeAgentAttachment",
            "metadata": {"name": name}, "spec": s
        }));
        self.app
            .api::<NodeAgentAttachment>()
            .create(&PostParams::default(), &a)
            .await
            .unwrap();
    }

    /// The `n` pods of app `app`, once all are Running and Ready and none terminating.
    pub async fn settled_pods(&self, app: &str, n: usize) -> Vec<Pod> {
        wait_list(
            &self.app.api::<Pod>(),
            &format!("app={app}"),
            POD_TIMEOUT,
            &format!("{n} Ready pods of {app}"),
            |ps| {
                ps.len() == n
                    && ps
                        .iter()
                        .all(|p| pod_running_ready(p) && p.metadata.deletion_timestamp.is_none())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// Waits until the agent Jobs are exactly one per pod of `pods`, each named after
    /// its pod, pinned to its node, carrying its container IDs and resumed, and each
    /// Job's agent pod is Running and Ready (our attach image really runs); the Jobs.
    pub async fn jobs_follow(&self, pods: &[Pod], what: &str) -> Vec<Job> {
        let last = Mutex::new(String::new());
        let jobs = wait_list(
            &self.jobs(),
            &self.job_selector(),
            POD_TIMEOUT,
            what,
            |js| match jobs_match(js, pods, &self.app.name) {
                Ok(()) => true,
                Err(why) => {
                    *last.lock().unwrap() = why;
                    false
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\nlast mismatch: {}", last.lock().unwrap()));
        // By the Job's UID: a successor has its predecessor's name.
        let uids: BTreeSet<String> = jobs.iter().filter_map(|j| j.uid()).collect();
        wait_list(
            &self.agent_pods(),
            JOB_NAME_LABEL,
            POD_TIMEOUT,
            &format!("{what}: an agent pod Running and Ready per Job"),
            |ps| {
                let ready: BTreeSet<String> = ps
                    .iter()
                    .filter(|p| pod_running_ready(p) && p.metadata.deletion_timestamp.is_none())
                    .filter_map(|p| p.labels().get(JOB_UID_LABEL).cloned())
                    .collect();
                ready == uids
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
        jobs
    }

    /// Waits until no agent Job of this test's namespace is left, nor any agent pod.
    pub async fn no_agents_left(&self, what: &str) {
        wait_list(
            &self.jobs(),
            &self.job_selector(),
            POD_TIMEOUT,
            &format!("{what}: no agent Job left"),
            |js| js.is_empty(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
        wait_list(
            &self.agent_pods(),
            JOB_NAME_LABEL,
            POD_TIMEOUT,
            &format!("{what}: no agent pod left"),
            |ps| ps.is_empty(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    }

    /// The operator Deployment of the release (`<release>-podmotion`) scaled to `n`;
    /// waits until that many operator pods are Running and Ready.
    pub async fn scale_operator(&self, n: usize) {
        let deploy = format!("{}-podmotion", self.release.release);
        let out = kubectl(&[
            "-n",
            &self.op.name,
            "scale",
            "deploy",
            &deploy,
            &format!("--replicas={n}"),
        ]);
        assert!(out.status.success(), "{}", output_text(&out));
        wait_list(
            &self.op.api::<Pod>(),
            "app.kubernetes.io/component=operator",
            POD_TIMEOUT,
            &format!("{n} operator pod(s) Ready"),
            |ps| ps.len() == n && ps.iter().all(pod_running_ready),
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    }
}

pub fn env_of(job: &Job) -> BTreeMap<String, String> {
    job.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|ps| &ps.containers[0])
        .and_then(|c| c.env.clone())
        .into_iter()
        .flatten()
        .map(|e| (e.name, e.value.unwrap_or_default()))
        .collect()
}

pub fn target_of(job: &Job) -> String {
    job.annotations()
        .get(annotations::TARGET_POD)
        .cloned()
        .unwrap_or_default()
}

/// The pod's container IDs by name, as the kubelet reports them (`containerd://…`).
pub fn container_ids(p: &Pod) -> BTreeMap<String, String> {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.clone())
        .into_iter()
        .flatten()
        .filter_map(|c| c.container_id.map(|id| (c.name, id)))
        .collect()
}

/// Whether `name` is `<prefix>-` and 16 lowercase hex digits.
pub fn named_by_hash(name: &str) -> bool {
    name.strip_prefix(&format!("{JOB_PREFIX}-"))
        .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

/// Whether `jobs` are exactly one live, resumed Job per pod of `pods`, named after it,
/// for its UID, on its node, with its container IDs.
pub fn jobs_match(jobs: &[Job], pods: &[Pod], ns: &str) -> Result<(), String> {
    if jobs.iter().any(|j| j.metadata.deletion_timestamp.is_some()) {
        return Err("a Job is terminating".into());
    }
    let want: BTreeSet<String> = pods.iter().map(|p| p.name_any()).collect();
    let have: BTreeSet<String> = jobs.iter().map(target_of).collect();
    if want != have || jobs.len() != pods.len() {
        return Err(format!("Jobs target {have:?}, pods are {want:?}"));
    }
    for p in pods {
        let j = jobs.iter().find(|j| target_of(j) == p.name_any()).unwrap();
        let (jn, pn) = (j.name_any(), p.name_any());
        if jn != job_name(JOB_PREFIX, ns, &pn) || !named_by_hash(&jn) {
            return Err(format!("Job {jn} for pod {pn} is not named by its target"));
        }
        if j.labels().get(labels::TARGET_POD_UID) != p.uid().as_ref() {
            return Err(format!(
                "Job {jn} is for another pod {pn} than {:?}",
                p.uid()
            ));
        }
        let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
        let job_node = j
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref()?.node_name.clone());
        if job_node != node {
            return Err(format!("Job {jn} on {job_node:?}, pod {pn} on {node:?}"));
        }
        let ids: BTreeMap<String, String> =
            serde_json::from_str(&env_of(j)["AGENT_CONTAINER_IDS"]).unwrap_or_default();
        if ids.is_empty() || ids != container_ids(p) {
            return Err(format!(
                "Job {jn} carries {ids:?}, pod has {:?}",
                container_ids(p)
            ));
        }
        if j.spec.as_ref().and_then(|s| s.suspend) != Some(false) {
            return Err(format!("Job {jn} not resumed yet"));
        }
    }
    Ok(())
}

/// Every version of the Jobs named `name`, in the order the watch saw them: (UID,
/// gone). A version is gone once its object is removed (a foreground deletion first
/// marks it, then removes it after its pods).
pub struct JobHistory {
    seen: Arc<Mutex<Vec<(String, bool)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl JobHistory {
    /// Starts the watch and returns once it has listed what exists now.
    pub async fn start(jobs: Api<Job>, name: &str) -> JobHistory {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let out = seen.clone();
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let (synced, ready) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut synced = Some(synced);
            let mut stream = watcher::watcher(jobs, config).boxed();
            let mut listed = vec![];
            while let Ok(Some(ev)) = stream.try_next().await {
                let mut seen = out.lock().unwrap();
                match ev {
                    Event::Init => listed.clear(),
                    Event::InitApply(j) => {
                        let uid = j.uid().unwrap_or_default();
                        listed.push(uid.clone());
                        seen.push((uid, false));
                    }
                    Event::Apply(j) => seen.push((j.uid().unwrap_or_default(), false)),
                    Event::Delete(j) => seen.push((j.uid().unwrap_or_default(), true)),
                    // A re-list that no longer holds a version: it went meanwhile.
                    Event::InitDone => {
                        let gone: BTreeSet<String> = seen
                            .iter()
                            .map(|(u, _)| u.clone())
                            .filter(|u| !listed.contains(u))
                            .collect();
                        seen.extend(gone.into_iter().map(|u| (u, true)));
                        if let Some(s) = synced.take() {
                            let _ = s.send(());
                        }
                    }
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(30), ready)
            .await
            .expect("the Job watch listed in time")
            .expect("the Job watch runs");
        JobHistory { seen, task }
    }

    /// Asserts that `old` was seen, then gone, and that no other version appeared
    /// before it was gone.
    pub fn assert_successor_after(self, old: &str) {
        self.task.abort();
        let seen = self.seen.lock().unwrap().clone();
        let present = seen.iter().position(|(u, gone)| u == old && !*gone);
        let gone = seen.iter().position(|(u, gone)| u == old && *gone);
        let successor = seen.iter().position(|(u, _)| u != old);
        match (present, gone, successor) {
            (Some(_), Some(g), Some(s)) => {
                assert!(g < s, "a successor existed beside {old}: {seen:?}")
            }
            _ => panic!("not {old} present, gone, then a successor: {seen:?}"),
        }
    }
}

/// Waits for an Event `reason` in the workloads' namespace whose message names `word`
/// (a Job, a pod).
pub async fn event_naming(s: &AttachWorld, reason: &str, word: &str) {
    wait_list(
        &s.app.api::<CoreEvent>(),
        "",
        POD_TIMEOUT,
        &format!("an Event {reason} naming {word}"),
        |evs| {
            evs.iter().any(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.message.as_deref().is_some_and(|m| m.contains(word))
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
}

/// Waits (60 s at most) until the network namespace of host PID `pid` holds the attach
/// agent's table (`present`) or no longer does.
pub async fn agent_table(pid: u32, present: bool, what: &str) {
    for _ in 0..120 {
        if nft_tables(pid).contains("podmotion_agent") == present {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!(
        "{what}: pid {pid}'s table podmotion_agent present={}, wanted {present}",
        !present
    );
}

/// The host PID of the testload server of each pod of `pods`.
pub fn server_pids(pods: &[Pod]) -> Vec<u32> {
    let uids: Vec<String> = pods.iter().filter_map(|p| p.uid()).collect();
    let procs = workload_processes(&uids);
    assert_eq!(procs.len(), pods.len(), "one server per pod: {procs:?}");
    procs.iter().map(|p| p.pid).collect()
}
