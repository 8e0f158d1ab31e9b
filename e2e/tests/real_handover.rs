//! The pod address hand-over on the real nodes (issue 15), through the chart with the
//! installer's `migrationAgent.broker.addressHandover.cidrs`: the real nodes' pods share
//! one L2 segment (bridge pmbr0, 198.18.0.0/16), so the source pod's address can move to
//! the target pod with the workload, and a client's established connection goes on.
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); `hack/test.sh` does both.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_e2e::real::agents::no_checkpoint_files_left;
use podmotion_e2e::real::bounds::{HANDOVER_BOUND, assert_clients};
use podmotion_e2e::real::copies::Clients;
use podmotion_e2e::real::procs::workload_processes;
use podmotion_e2e::real::testload::{
    POD_TIMEOUT, World, counter, counter_when_reachable, ended, node_of, pod_ip, restart_count,
    target_pods_of,
};
use podmotion_e2e::{from_json, wait_list};
use serde_json::json;

const APP: &str = "handed";

/// The IPv4 addresses in the network namespace of the process `pid` (`ip -o addr`).
fn addresses_of(pid: u32) -> Vec<String> {
    let out = Command::new("nsenter")
        .args([
            &format!("--net=/proc/{pid}/ns/net"),
            "ip",
            "-o",
            "-4",
            "addr",
            "show",
        ])
        .output()
        .expect("nsenter ip");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            it.position(|w| w == "inet")?;
            Some(it.next()?.split('/').next()?.to_string())
        })
        .collect()
}

/// The one workload process of the pod `uid`.
fn workload_pid(uid: &str) -> u32 {
    let procs = workload_processes(&[uid.to_string()]);
    assert_eq!(procs.len(), 1, "one workload process: {procs:?}");
    procs[0].pid
}

/// A client holding an established connection to `addr`.
struct Held {
    stream: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Held {
    fn connect(addr: &str) -> Held {
        let stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let reader = BufReader::new(stream.try_clone().unwrap());
        Held { stream, reader }
    }

    /// The counter, asked on this connection.
    fn get(&mut self, when: &str) -> u64 {
        writeln!(self.stream, "get").unwrap_or_else(|e| panic!("{when}: write: {e}"));
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .unwrap_or_else(|e| panic!("{when}: the held connection broke: {e}"));
        assert!(n > 0, "{when}: the held connection was closed");
        line.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{when}: {line:?}: {e}"))
    }
}

/// With the hand-over enabled by the installer, a `Strict` migration whose probe fails
/// rolls back with the client's connection to the source going on (the target gave the
/// address back, the source announced it again), and a `Strict` migration that passes
/// moves the address with the pod: the same connection goes on with the target, the
/// status counts it preserved, the counter continues; once the client closes it, the
/// target pod lets go of the moved address.
#[tokio::test]
async fn with_the_hand_over_the_held_connection_follows_the_pod() {
    let Some(w) = World::new(
        "handover",
        APP,
        16,
        &[
            "--set",
            "migrationAgent.broker.addressHandover.cidrs={198.18.0.0/16}",
        ],
    )
    .await
    else {
        return;
    };
    let pods: Api<Pod> = w.app.api();
    let pms: Api<PodMigration> = w.app.api();
    let svc_addr = w.service(APP).await;
    let source = w.source.clone();
    let source_ip = pod_ip(&source);
    let source_addr = format!("{source_ip}:8080");
    let target_node = w.target_node();

    let mut held = Held::connect(&source_addr);
    let before = held.get("before");
    assert!(before > 0, "the counter runs");

    // A probe that cannot pass: the target took the address for the restore and gives it
    // back; the source, resumed, answers on the same connection.
    let failing: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "handover-bad-probe"},
        "spec": {"podName": source.name_any(), "targetNode": target_node, "mode": "Cold",
            "tcpPreservation": "Strict", "freezeBudgetMillis": 20000,
            "probe": {"tcpSocket": {"port": 9}, "failureThreshold": 1, "timeoutSeconds": 1}}
    }));
    pms.create(&PostParams::default(), &failing).await.unwrap();
    let st = ended(&pms, "handover-bad-probe").await;
    assert_eq!(st.failure_reason.as_deref(), Some("ProbeFailed"), "{st:?}");
    let after_rollback = held.get("after the rollback");
    assert!(after_rollback > before, "{after_rollback} <= {before}");
    assert_eq!(
        restart_count(&pods.get(&source.name_any()).await.unwrap()),
        0
    );
    wait_list(
        &pods,
        "",
        POD_TIMEOUT,
        "the rolled-back target pod gone",
        |ps| target_pods_of(ps, &source.name_any()).is_empty(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    // Still the source's connection, after the target pod went.
    let still = held.get("after the target pod went");
    assert!(still >= after_rollback, "{still} < {after_rollback}");

    // The migration: `Strict`, so it succeeds only with the connection kept.
    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "handover-move"},
        "spec": {"podName": source.name_any(), "targetNode": target_node, "mode": "Cold",
            "tcpPreservation": "Strict", "freezeBudgetMillis": 20000,
            "probe": {"tcpSocket": {"port": 8080}}}
    }));
    // Two clients of the Service watch the move (issue 39): fresh connections every
    // 10 ms, and one held connection, which goes on.
    let clients = Clients::start(&svc_addr)
        .watching(w.app.client.clone(), &w.app.name, APP, "handover-move")
        .serving()
        .await;
    pms.create(&PostParams::default(), &pm).await.unwrap();
    let st = ended(&pms, "handover-move").await;
    if st.phase != MigrationPhase::Succeeded {
        w.app.dump();
        panic!("migration failed: {st:?}");
    }
    let target_name = st.target_pod.clone().expect("status.targetPod");
    let target = pods.get(&target_name).await.unwrap();
    assert_eq!(node_of(&target), target_node);
    wait_list(
        &pods,
        &format!("app={APP}"),
        POD_TIMEOUT,
        "only the target pod left",
        |ps| ps.len() == 1 && ps[0].name_any() == target_name,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    assert_clients(
        clients,
        &st,
        HANDOVER_BOUND,
        "Cold, the address hand-over on",
    )
    .await;

    // The same connection goes on, now served by the target: the counter continued.
    let moved = held.get("after the migration");
    assert!(moved > still, "the counter went from {still} to {moved}");
    let net = st.network.clone().expect("status.network");
    assert!(net.connections_preserved >= 1, "{net:?}");
    assert_eq!(net.connections_reset, 0, "{net:?}");
    // The moved address is on the target pod, beside its own; new connections and the
    // Service use the target's own address.
    let pid = workload_pid(&target.uid().unwrap());
    let addrs = addresses_of(pid);
    assert!(addrs.contains(&source_ip), "{addrs:?}");
    assert!(addrs.contains(&pod_ip(&target)), "{addrs:?}");
    // The same process (its counter, ticking every 10 ms, never goes back; two reads
    // within one tick may see one value).
    let own = counter(&format!("{}:8080", pod_ip(&target)));
    assert!(own >= moved, "{own} < {moved}");
    let via_service = counter_when_reachable(&svc_addr, "through the Service");
    assert!(via_service >= own, "{via_service} < {own}");
    no_checkpoint_files_left("after the commit", &w.op.client, &w.agents(), w.nodes.len()).await;

    // The client closes the moved connection: the target lets go of the address (the
    // broker's sweep), keeping its own.
    drop(held);
    let t = Instant::now();
    loop {
        let addrs = addresses_of(pid);
        if !addrs.contains(&source_ip) {
            assert!(addrs.contains(&pod_ip(&target)), "{addrs:?}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(90),
            "the moved address is still on the target 90 s after its connection ended: {addrs:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}
