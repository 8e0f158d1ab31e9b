//! The freezes a migration reports (issue 42), on this machine's kernel, as root, with
//! the real CRIU: without soft-dirty tracking a pre-copy round is a full dump that stops
//! the tree while CRIU collects its pages, and each round's stall, like the final
//! dump's, must be CRIU's own figure (`stats-dump`), not the agent's clock. Run with
//! `cargo test -p podmotion-agent --test freezes`; `PODMOTION_ROOT_TESTS=0` skips it,
//! otherwise a missing CRIU fails it.

use podmotion_agent::testbed::{Testbed, ask};
use podmotion_wire::agent::*;
use std::time::{Duration, Instant};

fn counter(s: &mut std::net::TcpStream) -> u64 {
    ask(s, "get").expect("get").parse().expect("number")
}

/// `f` is CRIU's figure of a freeze that lasted no longer than the call around it:
/// present (not zero) and within `wall`, and the pages it wrote are counted.
fn assert_criu_freeze(f: &FreezeRecord, round: u32, final_dump: bool, wall: Duration) {
    assert_eq!((f.round, f.final_dump), (round, final_dump), "{f:?}");
    assert_eq!(
        f.clock(),
        FreezeClock::Criu,
        "CRIU's statistics were read: {f:?}"
    );
    assert!(f.frozen_us > 0, "CRIU reported a frozen time: {f:?}");
    assert!(
        f.frozen_us + f.freezing_us < wall.as_micros() as u64,
        "frozen within the call ({wall:?}): {f:?}"
    );
    assert!(f.pages_written > 0 && f.bytes_written > 0, "{f:?}");
}

#[test]
fn every_round_and_the_final_dump_report_criu_s_own_frozen_time() {
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = Testbed::new(
        "frz",
        env!("CARGO_BIN_EXE_podmotion-agent").as_ref(),
        env!("CARGO_BIN_EXE_podmotion-testload").as_ref(),
    );
    tb.start_agent(0);
    tb.start_agent(1);
    let src = tb.start_workload(32, 64);
    let holder = tb.start_holder();
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let uid = "4d6e2a10-7c3b-4f1e-8a5d-9b0c1e2f3a41";
    let id_src = tb.container(&format!("{uid}-0"), src.pid);
    let id_tgt = tb.container(&format!("{uid}-1"), holder.pid);
    let prep_src = tb.prepare_request(uid, 0, &id_src, TcpPreservation::BestEffort);
    let prep_tgt = tb.prepare_request(uid, 1, &id_tgt, TcpPreservation::BestEffort);
    let (rounds, dumped) = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.prepare(prep_src).await.unwrap();
        b.prepare(prep_tgt).await.unwrap();
        let mut rounds = Vec::new();
        for _ in 0..2 {
            let t = Instant::now();
            let st = a.pre_dump(uid).await.unwrap();
            rounds.push((st, t.elapsed()));
        }
        let t = Instant::now();
        let d = a.dump(uid).await.unwrap();
        let dumped = (d, t.elapsed());
        a.send(uid, &Testbed::endpoint(1), "agent-b").await.unwrap();
        assert_eq!(a.abort(uid).await.unwrap().phase(), Phase::Aborted);
        assert_eq!(b.abort(uid).await.unwrap().phase(), Phase::Aborted);
        a.cleanup(uid).await.unwrap();
        b.cleanup(uid).await.unwrap();
        (rounds, dumped)
    });

    for (st, wall) in rounds.iter().chain([&dumped]) {
        eprintln!("call {wall:?}: {:?}", st.freezes.last());
    }
    let (first, wall1) = &rounds[0];
    assert_eq!(first.freezes.len(), 1, "{:?}", first.freezes);
    assert_criu_freeze(&first.freezes[0], 1, false, *wall1);
    assert!(
        first.freezes[0].bytes_written >= 32 << 20,
        "a full warm dump writes the ballast: {:?}",
        first.freezes[0]
    );
    let (second, wall2) = &rounds[1];
    assert_eq!(second.freezes.len(), 2, "{:?}", second.freezes);
    assert_eq!(
        second.freezes[0], first.freezes[0],
        "a round's record stays"
    );
    assert_criu_freeze(&second.freezes[1], 2, false, *wall2);
    let (d, wall_d) = &dumped;
    assert_eq!(d.freezes.len(), 3, "{:?}", d.freezes);
    assert_eq!(&d.freezes[..2], &second.freezes[..]);
    assert_criu_freeze(&d.freezes[2], 3, true, *wall_d);

    let after = counter(&mut conn);
    assert!(after > before, "the source runs again: {before} → {after}");
    assert!(tb.checkpoint_files(0).is_empty() && tb.checkpoint_files(1).is_empty());
}
