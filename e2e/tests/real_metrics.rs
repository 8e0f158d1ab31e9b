//! Every component the chart runs on the real nodes serves its metrics, and together
//! they export every metric name the chart's alerts and dashboard use: the chart is
//! installed from our images (hack/install.sh's values), the operator's `/metrics`,
//! each migration agent's (one per real node) and the attach agent of a live
//! NodeAgentAttachment on a real replica (after real connections through its redirect)
//! are scraped as Prometheus would scrape them: each found through the chart's own
//! ServiceMonitor or PodMonitor (their selectors and named ports, read back from the
//! API server; `podmotion_e2e::real::monitors`), exactly one target per component, at
//! its pod address — no port named by the test. The `podmotion_…` names of the
//! rendered PrometheusRule and dashboard are looked up in what was scraped. A renamed
//! metric, an agent that serves nothing or a dashboard query on a metric nobody exports
//! fails here. Logs: the chart is installed with `operator.logFormat=text` (the
//! operator's own format, overriding the chart-wide `logFormat`, default json): the
//! migration agents and brokers log JSON lines, the operator text, and the attach Job —
//! which the operator renders — text too, which it can only have from the operator.
//! The agents are installed at `migrationAgent.agent.logLevel=debug`: idle throughout,
//! each logs the kubelet's TCP probes of its TLS port at debug only and repeats no line
//! at info, nor does its broker.
//!
//! Needs the cluster with real nodes and the images (`hack/images.sh`).

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use podmotion_api::NodeAgentAttachment;
use podmotion_e2e::real::monitors::{MonitoringCrds, Target, scrape, targets};
use podmotion_e2e::real::testload::{self, POD_TIMEOUT};
use podmotion_e2e::real::{Images, helm, helm_install, kubectl, output_text, real_nodes};
use podmotion_e2e::{
    PodSecurity, TestNamespace, from_json, pod_running_ready, random_suffix, wait_list,
};
use serde_json::{Value, json};

/// The one target of a `kind` monitor that reaches `pod`: every component is scraped
/// through exactly one.
fn the_target<'a>(all: &'a [Target], kind: &str, pod: &str) -> &'a Target {
    let found: Vec<&Target> = all
        .iter()
        .filter(|t| t.pod == pod && t.monitor.starts_with(&format!("{kind}/")))
        .collect();
    assert_eq!(
        found.len(),
        1,
        "{pod}: one {kind} target, found {found:?} among {all:?}"
    );
    println!(
        "{pod}: scraped through {} at {}{}",
        found[0].monitor, found[0].address, found[0].path
    );
    found[0]
}

/// The sample names of a text exposition (`name{labels} value` and `name value` lines).
fn sample_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// Every `podmotion_…` name in `text`.
fn podmotion_names(text: &str) -> BTreeSet<String> {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("podmotion_") {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at..];
        let end = tail.find(|c: char| !word(c)).unwrap_or(tail.len());
        if !before.is_some_and(word) {
            out.insert(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    out
}

/// The pods of `selector` in any namespace: (namespace, name, node).
fn pods(selector: &str) -> Vec<(String, String, String)> {
    let out = kubectl(&["get", "pods", "-A", "-l", selector, "-o", "json"]);
    assert!(out.status.success(), "{}", output_text(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
            (
                s(&p["metadata"]["namespace"]),
                s(&p["metadata"]["name"]),
                s(&p["spec"]["nodeName"]),
            )
        })
        .collect()
}

/// The first log line of a container.
fn first_log_line(namespace: &str, pod: &str, container: &str) -> String {
    let out = kubectl(&["logs", "-n", namespace, pod, "-c", container]);
    assert!(out.status.success(), "{}", output_text(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .next()
        .unwrap_or_else(|| panic!("{pod}/{container} logged nothing"))
        .to_string()
}

/// The first log line of a container parses as a JSON object with a level and a
/// message.
fn logs_are_json(namespace: &str, pod: &str, container: &str) {
    let first = first_log_line(namespace, pod, container);
    let v: Value = serde_json::from_str(&first)
        .unwrap_or_else(|e| panic!("{pod}/{container}: not JSON ({e}): {first}"));
    assert!(v["level"].is_string(), "{pod}/{container}: {v}");
    assert!(v["message"].is_string(), "{pod}/{container}: {v}");
}

/// The first log line of a container is tracing's text format (`<time>  INFO
/// <target>: <message>`), not JSON.
fn logs_are_text(namespace: &str, pod: &str, container: &str) {
    let first = first_log_line(namespace, pod, container);
    assert!(
        serde_json::from_str::<Value>(&first).is_err(),
        "{pod}/{container}: JSON, not text: {first}"
    );
    assert!(
        [" INFO ", " WARN ", " ERROR "]
            .iter()
            .any(|l| first.contains(l)),
        "{pod}/{container}: no level in {first}"
    );
}

/// The JSON lines a container logged so far.
fn json_lines(namespace: &str, pod: &str, container: &str) -> Vec<Value> {
    let out = kubectl(&["logs", "-n", namespace, pod, "-c", container]);
    assert!(out.status.success(), "{}", output_text(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{pod}/{container}: not JSON ({e}): {l}"))
        })
        .collect()
}

/// The messages a container logged at info or above more than once, with their count.
fn repeated_info(lines: &[Value]) -> Vec<(String, usize)> {
    let mut seen = std::collections::BTreeMap::<String, usize>::new();
    for v in lines {
        if ["INFO", "WARN", "ERROR"].contains(&v["level"].as_str().unwrap_or("")) {
            *seen.entry(v["message"].to_string()).or_default() += 1;
        }
    }
    seen.into_iter().filter(|(_, n)| *n > 1).collect()
}

/// An idle migration agent (installed at `debug`) repeats no line at info: the
/// kubelet's TCP readiness probe of its TLS port, every 10 s, shows only at debug —
/// waited for until two have been logged, so the check is never vacuous — and nothing
/// else comes back periodically. Its broker (at the default `info`) neither.
fn idle_agent_repeats_no_info_line(namespace: &str, pod: &str) {
    let probe = |v: &Value| v["message"] == "connection closed before any TLS byte";
    let mut lines = Vec::new();
    for _ in 0..40 {
        lines = json_lines(namespace, pod, "agent");
        if lines.iter().filter(|v| probe(v)).count() >= 2 {
            break;
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    let probes: Vec<&Value> = lines.iter().filter(|v| probe(v)).collect();
    println!(
        "{pod}: {} lines, {} TCP probes logged (at {:?})",
        lines.len(),
        probes.len(),
        probes
            .iter()
            .filter_map(|v| v["level"].as_str())
            .collect::<BTreeSet<_>>()
    );
    assert!(
        probes.len() >= 2,
        "{pod}: the chart's migrationAgent.agent.logLevel=debug did not reach the agent, \
         or the kubelet's probes are not seen"
    );
    assert!(probes.iter().all(|v| v["level"] == "DEBUG"), "{probes:?}");
    let refused: Vec<&Value> = lines
        .iter()
        .filter(|v| v["level"] != "DEBUG" && v["level"] != "TRACE")
        .filter(|v| {
            v["message"]
                .as_str()
                .unwrap_or("")
                .contains("TLS handshake")
        })
        .collect();
    assert!(refused.is_empty(), "{pod}: {refused:?}");
    let repeated = repeated_info(&lines);
    assert!(
        repeated.is_empty(),
        "{pod}/agent repeats at info: {repeated:?}"
    );
    let broker = json_lines(namespace, pod, "netns-broker");
    assert!(
        broker.iter().all(|v| v["level"] != "DEBUG"),
        "the broker's level is its own (info)"
    );
    let repeated = repeated_info(&broker);
    assert!(
        repeated.is_empty(),
        "{pod}/netns-broker repeats at info: {repeated:?}"
    );
}

/// The first pod of `selector` Running and Ready, waiting for one.
async fn first_ready(api: &Api<Pod>, selector: &str, what: &str) -> Pod {
    wait_list(api, selector, POD_TIMEOUT, what, |ps| {
        ps.iter().any(pod_running_ready)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))
    .into_iter()
    .find(pod_running_ready)
    .unwrap()
}

/// The value of the sample `series` (`name{labels}` exactly as served) in `text`.
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{series} not served:\n{text}"))
}

#[tokio::test]
async fn every_component_serves_the_metrics_its_alerts_and_dashboard_use() {
    let Some(op) = TestNamespace::new("metrics-op", PodSecurity::Restricted).await else {
        return;
    };
    let Some(nodes) = real_nodes(&op.client).await else {
        return;
    };
    let app = TestNamespace::new("metrics-app", PodSecurity::Baseline)
        .await
        .unwrap();
    let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
    let release = format!("pm{}", random_suffix());
    // The operator's own format differs from the chart-wide one (json): the pods the
    // operator renders must follow the operator's.
    // The monitoring CRDs (stand-ins) before the release: dropped after its uninstall.
    let _crds = MonitoringCrds::ensure();
    let _uninstall = helm_install(
        &release,
        &images,
        &op.name,
        &app.name,
        "podmotion-e2e-metrics",
        // The agents at debug (the chart's per-component level): their TCP probes
        // show, at debug only.
        &[
            "--set",
            "operator.logFormat=text",
            "--set",
            "migrationAgent.agent.logLevel=debug",
            // Every component is scraped as Prometheus would: through these.
            "--set",
            "metrics.serviceMonitor.enabled=true,metrics.podMonitor.enabled=true",
        ],
    );
    let instance = format!("app.kubernetes.io/instance={release}");

    let mut scraped = BTreeSet::new();
    let operators = pods(&format!("{instance},app.kubernetes.io/component=operator"));
    assert!(!operators.is_empty(), "no operator pod");
    let op_targets = targets(&op.name);
    for (ns, pod, _) in &operators {
        let body = scrape(the_target(&op_targets, "ServiceMonitor", pod));
        assert!(
            body.contains("# TYPE podmotion_reconciles counter"),
            "{body}"
        );
        scraped.extend(sample_names(&body));
        logs_are_text(ns, pod, "operator");
    }
    let agents = pods(&format!(
        "{instance},app.kubernetes.io/component=migration-agent"
    ));
    let on: BTreeSet<&str> = agents.iter().map(|(_, _, n)| n.as_str()).collect();
    for n in &nodes {
        assert!(on.contains(n.as_str()), "no agent on {n}: {agents:?}");
    }
    let agent_targets = targets(&agents[0].0);
    for (ns, pod, node) in &agents {
        let body = scrape(the_target(&agent_targets, "PodMonitor", pod));
        let names = sample_names(&body);
        for want in [
            "podmotion_agent_frozen_sources",
            "podmotion_agent_frozen_sources_over_budget",
            "podmotion_agent_migration_idle_seconds_max",
            "podmotion_agent_broker_ops_total",
        ] {
            assert!(
                names.contains(want),
                "{want} not served by {pod} on {node}:\n{body}"
            );
        }
        scraped.extend(names);
        logs_are_json(ns, pod, "agent");
        logs_are_json(ns, pod, "netns-broker");
    }

    // The attach agent of a live attachment on a real replica, after connections to the
    // replica went through its redirect (passed through to the application).
    let agents_ns = agents[0].0.clone();
    app.api::<Deployment>()
        .create(
            &PostParams::default(),
            &testload::deployment("web", &images.testload().unwrap(), 0),
        )
        .await
        .unwrap();
    let app_pods: Api<Pod> = app.api();
    let target = first_ready(&app_pods, "app=web", "a Ready web replica").await;
    let naa: NodeAgentAttachment = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "NodeAgentAttachment",
        "metadata": {"name": "web"},
        "spec": {"workloadRef": {"kind": "Deployment", "name": "web"}, "mode": "Intercept"}
    }));
    app.api::<NodeAgentAttachment>()
        .create(&PostParams::default(), &naa)
        .await
        .unwrap();
    let agent_pods: Api<Pod> = Api::namespaced(op.client.clone(), &agents_ns);
    let attach = first_ready(
        &agent_pods,
        "app.kubernetes.io/component=node-agent",
        "the attach Job's pod Running and Ready",
    )
    .await;
    let attach_name = attach.name_any();
    for i in 0..3 {
        let line = format!("echo m{i}");
        assert_eq!(
            testload::ask(&testload::addr(&target), &line).unwrap(),
            format!("m{i}"),
            "through the attach agent's redirect"
        );
    }
    let body = scrape(the_target(&targets(&agents_ns), "PodMonitor", &attach_name));
    assert_eq!(
        value(&body, "podmotion_attach_ruleset_installed"),
        1.0,
        "{body}"
    );
    assert_eq!(value(&body, "podmotion_attach_redirected_ports"), 1.0);
    // Our three connections (the kubelet's TCP readiness probes add more).
    let accepted = r#"podmotion_attach_connections_accepted_total{mode="passthrough"}"#;
    assert!(value(&body, accepted) >= 3.0, "{body}");
    // "echo mN\n" in, "mN\n" back, three times: counted on the connection itself.
    let bytes = |d: &str| {
        value(
            &body,
            &format!(
                r#"podmotion_attach_connection_bytes_total{{mode="passthrough",direction="{d}"}}"#
            ),
        )
    };
    assert!(bytes("from_peer") >= 24.0, "{body}");
    assert!(bytes("to_peer") >= 9.0, "{body}");
    assert_eq!(
        value(
            &body,
            r#"podmotion_attach_connections_ended_total{mode="passthrough",outcome="dial_failed"}"#
        ),
        0.0
    );
    scraped.extend(sample_names(&body));
    // The operator's format, in the pod spec and in what the agent logs.
    let env = &attach.spec.as_ref().unwrap().containers[0].env;
    assert!(
        env.iter()
            .flatten()
            .any(|e| e.name == "PODMOTION_LOG_FORMAT" && e.value.as_deref() == Some("text")),
        "{env:?}"
    );
    logs_are_text(&agents_ns, &attach_name, "agent");
    let out = kubectl(&[
        "delete",
        "naa",
        "web",
        "-n",
        &app.name,
        "--wait=true",
        "--timeout=120s",
    ]);
    assert!(
        out.status.success(),
        "delete attachment: {}",
        output_text(&out)
    );

    // The names the alerts and the dashboard use, as the chart renders them with
    // every monitoring object on.
    let mut args = vec!["template".to_string(), release.clone()];
    args.extend(podmotion_e2e::real::chart_args(
        &images, &op.name, &app.name, "x",
    ));
    args.extend(
        [
            "--set",
            "metrics.prometheusRule.enabled=true,metrics.dashboard.enabled=true,\
             metrics.serviceMonitor.enabled=true,metrics.podMonitor.enabled=true",
        ]
        .map(String::from),
    );
    let out = helm(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.status.success(), "{}", output_text(&out));
    let rendered = String::from_utf8_lossy(&out.stdout);
    let mut used = BTreeSet::new();
    for doc in rendered.split("\n---") {
        if doc.contains("\nkind: PrometheusRule") || doc.contains("podmotion.json:") {
            used.extend(podmotion_names(doc));
        }
    }
    assert!(used.len() >= 20, "only {used:?}");
    let missing: Vec<_> = used.difference(&scraped).collect();
    assert!(
        missing.is_empty(),
        "used by an alert or the dashboard, served by no component: {missing:?}\nscraped: {scraped:?}"
    );

    // The migration agents took part in nothing: idle since the install.
    for (ns, pod, _) in &agents {
        idle_agent_repeats_no_info_line(ns, pod);
    }
}
