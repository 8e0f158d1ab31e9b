//! Who may command an agent, proven against the real agent binaries over real mutual
//! TLS (issue 16, finding 2). Certificates are made here in the identity format of
//! `podmotion_wire::identity`, all signed by the testbed's one CA: being CA-signed is
//! not enough, the caller's identity decides.
//!
//! Root and CRIU as for `tests/migration.rs` (`PODMOTION_ROOT_TESTS=0` skips):
//! `cargo test -p podmotion-agent --test authz -- --test-threads=1`.

use podmotion_agent::testbed::{AGENT_NAMES, Testbed, ask};
use podmotion_wire::agent::*;
use podmotion_wire::client::{AgentClient, ClientError, TlsFiles};
use podmotion_wire::identity::{OPERATOR_CN, agent_cn, agent_uri};
use podmotion_wire::transfer::Sealer;
use std::sync::Mutex;
use std::time::Duration;

static SERIAL: Mutex<()> = Mutex::new(());

fn testbed(name: &str) -> Option<Testbed> {
    if !podmotion_agent::testbed::root_tests_enabled() {
        return None;
    }
    let mut tb = Testbed::new(
        name,
        env!("CARGO_BIN_EXE_podmotion-agent").as_ref(),
        env!("CARGO_BIN_EXE_podmotion-testload").as_ref(),
    );
    tb.start_agent(0);
    tb.start_agent(1);
    Some(tb)
}

/// A CA-signed certificate for a third node's agent (`agent/node-c`).
fn third_agent(tb: &Testbed) -> TlsFiles {
    tb.tls.issue(
        &tb.dir,
        "node-c",
        &["node-c".into()],
        &agent_uri("node-c"),
        &agent_cn("node-c"),
    )
}

/// A CA-signed certificate with no PodMotion identity (the operator's CN, no URI SAN:
/// the chart's legacy operator certificate).
fn no_identity(tb: &Testbed) -> TlsFiles {
    tb.tls
        .issue(&tb.dir, "anonymous", &["anonymous".into()], "", OPERATOR_CN)
}

/// Runs `f` with a client of the agent of `node`, connected with `tls`, from node A's
/// network namespace.
fn as_party<F, Fut, T>(tb: &Testbed, tls: TlsFiles, node: usize, f: F) -> T
where
    F: FnOnce(AgentClient) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
    T: Send + 'static,
{
    tb.in_netns("na", move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("rt")
            .block_on(async move {
                for _ in 0..100 {
                    if let Ok(c) =
                        AgentClient::connect(&Testbed::endpoint(node), AGENT_NAMES[node], &tls)
                            .await
                    {
                        return f(c).await;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                panic!("agent {node} unreachable");
            })
    })
}

fn denied<T: std::fmt::Debug>(what: &str, r: Result<T, ClientError>) -> String {
    match r {
        Err(ClientError::Status(s)) if s.code() == tonic::Code::PermissionDenied => {
            s.message().to_owned()
        }
        other => panic!("{what}: expected PermissionDenied, got {other:?}"),
    }
}

/// Every control call of the agent, made by `c` for migration `uid`; each must be
/// refused with PermissionDenied. Returns the refusals.
async fn every_control_call_is_denied(
    mut c: AgentClient,
    uid: &str,
    prepare: PrepareRequest,
) -> Vec<String> {
    let mut refusals = every_commanding_call_is_denied(&mut c, uid, prepare).await;
    refusals.push(denied("Status", c.status(uid).await));
    refusals
}

/// The denial of each commanding call (every control call but the `Status` read).
async fn every_commanding_call_is_denied(
    c: &mut AgentClient,
    uid: &str,
    prepare: PrepareRequest,
) -> Vec<String> {
    vec![
        denied("Prepare", c.prepare(prepare).await),
        denied("PreDump", c.pre_dump(uid).await),
        denied("Dump", c.dump(uid).await),
        denied(
            "Send",
            c.send(uid, &Testbed::endpoint(1), AGENT_NAMES[1]).await,
        ),
        denied("Fence", c.fence(uid).await),
        denied("Restore", c.restore(uid).await),
        denied("Commit", c.commit(uid).await),
        denied("Abort", c.abort(uid).await),
        denied("Cleanup", c.cleanup(uid).await),
    ]
}

fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("State:") && (l.contains("S (") || l.contains("R (")))
        })
        .unwrap_or(false)
}

fn counter(s: &mut std::net::TcpStream) -> u64 {
    ask(s, "get").expect("get").parse().expect("number")
}

/// Regular files under a node's checkpoint root (directories made at Prepare are not
/// images).
fn image_files(tb: &Testbed, node: usize) -> Vec<std::path::PathBuf> {
    tb.checkpoint_files(node)
        .into_iter()
        .filter(|p| p.is_file() || p.is_symlink())
        .collect()
}

#[test]
fn only_the_operator_commands_an_agent_other_ca_signed_parties_freeze_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut tb) = testbed("azc") else { return };
    let src = tb.start_workload(8, 0);
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let uid = "authz-control";
    let container = tb.container("workload", src.pid);
    let prep = tb.prepare_request(uid, 0, &container, TcpPreservation::BestEffort);
    // The operator prepares the source: allowed.
    let p = prep.clone();
    let st = tb.operator(move |tls| async move { tls.agent(0).await.prepare(p).await.unwrap() });
    assert_eq!(st.phase(), Phase::Prepared);

    // The other node's agent (a valid identity, CA-signed), a third node's agent and a
    // CA-signed certificate without an identity: every control call refused, for the
    // prepared migration and for a new one naming the same container.
    let intruder = tb.prepare_request("authz-intruder", 0, &container, TcpPreservation::BestEffort);
    let mut refusals = vec![];
    for (who, tls) in [
        ("agent-b", tb.tls.agents[1].clone()),
        ("node-c", third_agent(&tb)),
        ("anonymous", no_identity(&tb)),
    ] {
        for (u, p) in [(uid, prep.clone()), ("authz-intruder", intruder.clone())] {
            let r = as_party(&tb, tls.clone(), 0, move |c| {
                every_control_call_is_denied(c, u, p)
            });
            assert_eq!(r.len(), 10, "{who}");
            refusals.extend(r);
        }
    }
    assert!(
        refusals
            .iter()
            .any(|m| m.contains("is the operator's call")),
        "{refusals:?}"
    );
    assert!(
        refusals.iter().any(|m| m.contains("no PodMotion identity")),
        "{refusals:?}"
    );
    // Even the agent's own certificate commands nothing.
    let own = tb.tls.agents[0].clone();
    let p = prep.clone();
    as_party(&tb, own, 0, move |c| {
        every_control_call_is_denied(c, uid, p)
    });

    // Nothing was frozen, dumped or created: the workload counts on, the migration is
    // where the operator left it, the intruder's migration does not exist.
    assert!(running(src.pid), "workload frozen by a refused call");
    assert!(counter(&mut conn) > before);
    let (mine, theirs) = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mine = a.status(uid).await.unwrap();
        let theirs = a.status("authz-intruder").await.unwrap_err().category();
        a.abort(uid).await.unwrap();
        a.cleanup(uid).await.unwrap();
        (mine, theirs)
    });
    assert_eq!(mine.phase(), Phase::Prepared);
    assert_eq!((mine.iteration, mine.image_bytes), (0, 0));
    assert_eq!(theirs, "MigrationUnknown");
    assert!(image_files(&tb, 0).is_empty(), "{:?}", image_files(&tb, 0));
    assert!(!tb.checkpoints(0).join("authz-intruder").exists());
    assert!(running(src.pid));
}

#[test]
fn images_are_taken_only_from_the_agent_the_operator_named() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut tb) = testbed("azr") else { return };
    let src = tb.start_workload(8, 0);
    let holder = tb.start_holder();
    let uid = "authz-receive";
    let prep_src = tb.prepare_request(
        uid,
        0,
        &tb.container("workload", src.pid),
        TcpPreservation::BestEffort,
    );
    let prep_tgt = tb.prepare_request(
        uid,
        1,
        &tb.container("holder", holder.pid),
        TcpPreservation::BestEffort,
    );
    // The target takes images from agent A's node only.
    assert_eq!(prep_tgt.peer_node, tb.tls.nodes[0]);
    let key = prep_tgt.transfer_key.clone();
    tb.operator(move |tls| async move {
        tls.agent(0).await.prepare(prep_src).await.unwrap();
        tls.agent(1).await.prepare(prep_tgt).await.unwrap();
    });

    // A stream sealed with the migration's own key (as if it had leaked): only the
    // caller's identity can stop it.
    let stream = move |uid: &'static str| {
        let sealer = Sealer::new(&key, uid, &[5; 16]).unwrap();
        let data = b"not a checkpoint";
        let chunks = vec![
            ImageChunk {
                migration_uid: uid.into(),
                seq: 0,
                path: "final/pages-1.img".into(),
                offset: 0,
                sealed: sealer.seal(0, "final/pages-1.img", 0, false, data),
                stream_id: sealer.stream_id().to_vec(),
                ..Default::default()
            },
            ImageChunk {
                migration_uid: uid.into(),
                seq: 1,
                sealed: sealer.seal(1, "", 0, true, &1u64.to_be_bytes()),
                end: true,
                ..Default::default()
            },
        ];
        futures::stream::iter(chunks)
    };
    let mut refusals = vec![];
    for (who, tls, u) in [
        ("a third node's agent", third_agent(&tb), uid),
        ("the target's own identity", tb.tls.agents[1].clone(), uid),
        ("the operator", tb.tls.operator.clone(), uid),
        ("no identity", no_identity(&tb), uid),
        // The named peer, for a migration the target does not know.
        (
            "the peer, another migration",
            tb.tls.agents[0].clone(),
            "authz-other",
        ),
    ] {
        let s = stream(u);
        let r = as_party(&tb, tls, 1, move |mut c| async move {
            c.raw()
                .receive_images(s)
                .await
                .map(|r| r.into_inner())
                .map_err(ClientError::from)
        });
        refusals.push(denied(who, r));
    }
    assert!(
        refusals[0].contains("takes images from spiffe://podmotion.io/agent/node-c"),
        "{refusals:?}"
    );
    assert!(refusals[1].contains("to itself"), "{refusals:?}");
    // Nothing written, nothing received.
    assert!(image_files(&tb, 1).is_empty(), "{:?}", image_files(&tb, 1));
    let before =
        tb.operator(move |tls| async move { tls.agent(1).await.status(uid).await.unwrap() });
    assert_eq!(
        (before.phase(), before.bytes_received),
        (Phase::Prepared, 0)
    );

    // The named peer's stream is taken (the same chunks, from agent A's identity).
    let s = stream(uid);
    let summary = as_party(&tb, tb.tls.agents[0].clone(), 1, move |mut c| async move {
        c.raw().receive_images(s).await.map(|r| r.into_inner())
    })
    .expect("the named peer streams");
    assert_eq!((summary.files, summary.bytes), (1, 16));
    tb.operator(move |tls| async move {
        for n in [0, 1] {
            let mut a = tls.agent(n).await;
            a.abort(uid).await.unwrap();
            a.cleanup(uid).await.unwrap();
        }
    });
    assert!(running(src.pid));
}

#[test]
fn the_source_streams_only_to_the_agent_the_operator_named() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut tb) = testbed("azs") else { return };
    let src = tb.start_workload(8, 0);
    let holder = tb.start_holder();
    let uid = "authz-send";
    // The operator named node-c as the target; agent B (prepared as a target that
    // would take A's images) is not it, whatever endpoint the Send names.
    let mut prep_src = tb.prepare_request(
        uid,
        0,
        &tb.container("workload", src.pid),
        TcpPreservation::BestEffort,
    );
    prep_src.peer_node = "node-c".into();
    let prep_tgt = tb.prepare_request(
        uid,
        1,
        &tb.container("holder", holder.pid),
        TcpPreservation::BestEffort,
    );
    let (err, target) = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.prepare(prep_src).await.unwrap();
        b.prepare(prep_tgt).await.unwrap();
        a.pre_dump(uid).await.unwrap();
        let err = a
            .send(uid, &Testbed::endpoint(1), AGENT_NAMES[1])
            .await
            .unwrap_err();
        let target = b.status(uid).await.unwrap();
        a.abort(uid).await.unwrap();
        a.cleanup(uid).await.unwrap();
        b.abort(uid).await.unwrap();
        b.cleanup(uid).await.unwrap();
        (err.to_string(), target)
    });
    assert!(
        err.contains(&format!("expected {}", agent_uri("node-c"))),
        "the source refuses to stream to an agent the operator did not name: {err}"
    );
    assert_eq!(
        (target.phase(), target.bytes_received),
        (Phase::Prepared, 0)
    );
    assert!(image_files(&tb, 1).is_empty(), "{:?}", image_files(&tb, 1));
    assert!(running(src.pid));
}

#[test]
fn a_prepare_must_name_a_known_container_and_another_node_as_the_peer() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut tb) = testbed("azp") else { return };
    let src = tb.start_workload(8, 0);
    let known = tb.container("workload", src.pid);
    let unknown = tb.prepare_request(
        "authz-unknown",
        0,
        "testbed://nowhere-app",
        TcpPreservation::BestEffort,
    );
    let mut no_container = tb.prepare_request("authz-none", 0, &known, TcpPreservation::BestEffort);
    no_container.container_ids.clear();
    // An ID no runtime would give (a path: it could not name a container's cgroup),
    // even one the runtime (the table) maps to the workload's pid.
    let bad_id = format!("testbed://{}/../workload", tb.p);
    tb.register_container(&bad_id, src.pid);
    let malformed = tb.prepare_request("authz-malformed", 0, &bad_id, TcpPreservation::BestEffort);
    let mut no_peer = tb.prepare_request("authz-nopeer", 0, &known, TcpPreservation::BestEffort);
    no_peer.peer_node.clear();
    let mut self_peer = tb.prepare_request("authz-self", 0, &known, TcpPreservation::BestEffort);
    self_peer.peer_node = tb.tls.nodes[0].clone();
    let codes = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut codes = vec![];
        for p in [unknown, no_container, malformed, no_peer, self_peer] {
            let uid = p.migration_uid.clone();
            let e = a.prepare(p).await.unwrap_err();
            let ClientError::Status(s) = &e else {
                panic!("{e}")
            };
            // Nothing half-prepared is left behind.
            let st = a.status(&uid).await.unwrap_err().category();
            codes.push((s.code(), st));
        }
        codes
    });
    use tonic::Code::*;
    assert_eq!(
        codes,
        vec![
            (NotFound, "MigrationUnknown"),
            (InvalidArgument, "MigrationUnknown"),
            (InvalidArgument, "MigrationUnknown"),
            (InvalidArgument, "MigrationUnknown"),
            (InvalidArgument, "MigrationUnknown"),
        ]
    );
    assert!(image_files(&tb, 0).is_empty());
    assert!(
        std::fs::read_dir(tb.checkpoints(0))
            .unwrap()
            .next()
            .is_none()
    );
    assert!(running(src.pid));
}

/// A replica that still believes it leads after another took over commands nothing
/// (issue 16, finding 9's fence): once the agent has seen the operator's leader term 6,
/// every commanding call with term 5 is refused — on the new leader's migration and on
/// one of its own — while `Status` still answers it; a commanding call with no term is
/// refused too once a term was seen (issue 41: termless calls were never fenced), its
/// `Status` answered. The source keeps running, the new leader's migration stays as it
/// left it, the stale one's was never created.
#[test]
fn a_stale_leader_commands_nothing_once_a_newer_term_was_seen() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut tb) = testbed("azt") else { return };
    let src = tb.start_workload(8, 0);
    let container = tb.container("workload", src.pid);
    let uid = "authz-term-new";
    let newer = tb.prepare_request(uid, 0, &container, TcpPreservation::BestEffort);
    let stale = tb.prepare_request("authz-term-old", 0, &container, TcpPreservation::BestEffort);
    let (refusals, stale_reads, mine, theirs, termless) = tb.operator(move |tls| async move {
        let mut new = tls.agent(0).await.with_leader_term(term(6));
        assert_eq!(new.prepare(newer).await.unwrap().phase(), Phase::Prepared);
        let mut old = tls.agent(0).await.with_leader_term(term(5));
        let mut refusals = vec![];
        for (u, p) in [(uid, stale.clone()), ("authz-term-old", stale)] {
            refusals.extend(every_commanding_call_is_denied(&mut old, u, p).await);
        }
        let stale_reads = old.status(uid).await.map(|s| s.phase());
        // No term: reads are answered (and see the same migration), commands refused.
        let mut unfenced = tls.agent(0).await;
        let mine = unfenced.status(uid).await.unwrap();
        let termless = unfenced
            .abort(uid)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string());
        let theirs = new.status("authz-term-old").await.unwrap_err().category();
        new.abort(uid).await.unwrap();
        new.cleanup(uid).await.unwrap();
        (refusals, stale_reads, mine, theirs, termless)
    });
    let termless = termless.expect_err("a termless Abort after term 6 was admitted");
    assert!(termless.contains("no leader term"), "{termless}");
    assert_eq!(refusals.len(), 18);
    for m in &refusals {
        assert!(m.contains("leader term 5") && m.contains("term 6"), "{m}");
    }
    assert_eq!(stale_reads.ok(), Some(Phase::Prepared));
    assert_eq!(mine.phase(), Phase::Prepared);
    assert_eq!(theirs, "MigrationUnknown");
    assert!(!tb.checkpoints(0).join("authz-term-old").exists());
    assert!(running(src.pid), "the source was frozen by a stale leader");
}

/// The creation time of a Lease made after the one whose terms the test used before.
const RECREATED: u64 = 1_764_770_000;

/// Leader `n` of a Lease without a creation time (the count alone).
fn term(n: u64) -> Option<LeaderTerm> {
    Some(LeaderTerm::new(0, n))
}

/// The fence survives the agent (issue 16, finding 9's fence, across a restart): once
/// a commanding call with the operator's leader term 7 was admitted, the agent is
/// killed (SIGKILL: nothing is written on the way out) and a new one started on the same
/// node's state directory refuses term 6 on every commanding call, while terms 7 and 8
/// are admitted. The term is on the node (`<state dir>/leader-term`) by the time the
/// call that raised it returned. Then the Lease is created again: its term 0 with the
/// new creation time is admitted, and term 8 is refused from then on.
#[test]
fn a_restarted_agent_still_refuses_a_stale_leader() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut tb) = testbed("azr") else { return };
    let src = tb.start_workload(8, 0);
    let container = tb.container("workload", src.pid);
    let prepare = |uid| tb.prepare_request(uid, 0, &container, TcpPreservation::BestEffort);
    let (before, stale, current) = (
        prepare("authz-restart-7"),
        prepare("authz-restart-6"),
        prepare("authz-restart-8"),
    );
    let prepared = tb.operator(move |tls| async move {
        let mut new = tls.agent(0).await.with_leader_term(term(7));
        let p = new.prepare(before).await.unwrap().phase();
        new.abort("authz-restart-7").await.unwrap();
        new.cleanup("authz-restart-7").await.unwrap();
        p
    });
    assert_eq!(prepared, Phase::Prepared);
    // The testbed's agents keep their state beside their checkpoint root.
    let record = tb.dir.join("node0/agent/leader-term");
    assert_eq!(std::fs::read_to_string(&record).unwrap(), "7\n");

    tb.kill_agent(0);
    tb.start_agent(0);
    let (refusals, stale_reads, at_7, at_8, at_recreated, replaced) =
        tb.operator(move |tls| async move {
            let mut old = tls.agent(0).await.with_leader_term(term(6));
            let u = "authz-restart-6";
            let refusals = every_commanding_call_is_denied(&mut old, u, stale).await;
            // A read is still answered (the migration is unknown to the new agent).
            let stale_reads = old.status(u).await.unwrap_err().category();
            // The leader of term 7 is admitted: its Abort of a migration the restarted
            // agent never saw is answered as such, not refused.
            let mut same = tls.agent(0).await.with_leader_term(term(7));
            let at_7 = same.abort("authz-restart-7").await.unwrap_err().category();
            // A newer leader is admitted and commands.
            let mut newer = tls.agent(0).await.with_leader_term(term(8));
            let at_8 = newer.prepare(current).await.unwrap().phase();
            newer.abort("authz-restart-8").await.unwrap();
            newer.cleanup("authz-restart-8").await.unwrap();
            // The Lease deleted and created again counts from 0: its creation time, sent
            // beside the count, makes it newer than term 8, which now commands nothing.
            let mut recreated = tls
                .agent(0)
                .await
                .with_leader_term(Some(LeaderTerm::new(RECREATED, 0)));
            let at_recreated = recreated
                .abort("authz-restart-8")
                .await
                .unwrap_err()
                .category();
            let replaced = denied("Abort", newer.abort("authz-restart-8").await);
            (refusals, stale_reads, at_7, at_8, at_recreated, replaced)
        });
    assert_eq!(refusals.len(), 9);
    for m in &refusals {
        assert!(m.contains("leader term 6") && m.contains("term 7"), "{m}");
    }
    assert_eq!(stale_reads, "MigrationUnknown");
    assert_eq!(at_7, "MigrationUnknown");
    assert_eq!(at_8, Phase::Prepared);
    assert_eq!(at_recreated, "MigrationUnknown", "admitted, not refused");
    assert!(
        replaced.contains("leader term 8 is older than term 0 of the Lease created at 1764770000"),
        "{replaced}"
    );
    assert_eq!(
        std::fs::read_to_string(&record).unwrap(),
        format!("{RECREATED} 0\n")
    );
    assert!(!tb.checkpoints(0).join("authz-restart-6").exists());
    assert!(running(src.pid), "the source was frozen by a stale leader");
}
