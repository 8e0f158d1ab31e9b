//! What the real-node migration tests that kill parts of a migration on the way see of
//! it besides the processes ([`super::procs`]): which copies of the state run in a
//! sample, what a status says to a human, the counter read through a Service on a new
//! connection per read, the first place a sequence of counters goes back (two copies
//! served), and what a client sees (its gaps and failed requests).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use podmotion_api::migration::PodMigrationStatus;

use super::procs::{Proc, running_copies, workload_processes};

/// Whether `text` says the source was resumed ("not resumed" does not).
pub fn says_resumed(text: &str) -> bool {
    text.replace("not resumed", "").contains("resumed")
}

/// Every text of a status a human reads: the failure message and the conditions'.
pub fn status_texts(st: &PodMigrationStatus) -> Vec<String> {
    let mut out: Vec<String> = st.failure_message.iter().cloned().collect();
    out.extend(st.conditions.iter().map(|c| c.message.clone()));
    out
}

/// The first place where `values` goes backwards, if any: (index, value, next value).
pub fn jump_back(values: &[u64]) -> Option<(usize, u64, u64)> {
    values
        .windows(2)
        .enumerate()
        .find(|(_, w)| w[1] < w[0])
        .map(|(i, w)| (i, w[0], w[1]))
}

/// Reads the counter through a Service on a thread, one new connection per read (a
/// frozen source answers late or never: failures counted, not fatal), so a second copy
/// serving an older counter shows as a jump back. Every read is timed from the poller's
/// start, so what a client sees of a migration — the longest time without an answer
/// and the failed reads — comes out of [`ServicePoller::finish_view`].
pub struct ServicePoller {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<u64>>>,
    failures: Arc<Mutex<usize>>,
    log: Arc<Mutex<Reads>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Every read of a client, timed from its start: when each answer came, and when and
/// why each failure happened.
#[derive(Clone, Debug, Default)]
struct Reads {
    answers: Vec<Duration>,
    failures: Vec<(Duration, String)>,
    /// When the client stopped (a gap still open then counts up to it).
    end: Duration,
}

impl ServicePoller {
    /// Starts reading `addr` (ClusterIP:port) every 100 ms.
    pub fn start(addr: String) -> ServicePoller {
        ServicePoller::every(addr, Duration::from_millis(100))
    }

    /// Starts reading `addr` (ClusterIP:port): a new connection ([`CONNECT_TIMEOUT`]),
    /// `get`, the answer, then `pause` before the next.
    pub fn every(addr: String, pause: Duration) -> ServicePoller {
        ServicePoller::every_from(addr, pause, Instant::now())
    }

    /// As [`ServicePoller::every`], its times counted from `t0`.
    pub fn every_from(addr: String, pause: Duration, t0: Instant) -> ServicePoller {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(vec![]));
        let failures = Arc::new(Mutex::new(0));
        let log = Arc::new(Mutex::new(Reads::default()));
        let (s, v, f, l) = (stop.clone(), seen.clone(), failures.clone(), log.clone());
        let thread = std::thread::spawn(move || {
            let sa = addr.parse().expect("ClusterIP:port");
            while !s.load(Ordering::SeqCst) {
                match read_once(&sa) {
                    Ok(n) => {
                        v.lock().unwrap().push(n);
                        l.lock().unwrap().answers.push(t0.elapsed());
                    }
                    Err(e) => {
                        *f.lock().unwrap() += 1;
                        l.lock()
                            .unwrap()
                            .failures
                            .push((t0.elapsed(), e.to_string()));
                    }
                }
                std::thread::sleep(pause);
            }
            l.lock().unwrap().end = t0.elapsed();
        });
        ServicePoller {
            stop,
            seen,
            failures,
            log,
            thread: Some(thread),
        }
    }

    /// The last counter read so far.
    pub fn last(&self) -> Option<u64> {
        self.seen.lock().unwrap().last().copied()
    }

    /// Stops reading; returns every counter read, in order, and how many reads failed.
    pub fn finish(mut self) -> (Vec<u64>, usize) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().expect("reader thread");
        }
        let seen = self.seen.lock().unwrap().clone();
        let failures = *self.failures.lock().unwrap();
        (seen, failures)
    }

    /// Whether an answer comes within `within` (waits that long).
    pub fn answering(&self, within: Duration) -> bool {
        answered_within(&self.log, within)
    }

    /// Answers so far.
    pub fn answers(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// Stops reading; what this client saw from `from` on (its times count from its
    /// start; its counters must never go back: two copies served).
    pub fn finish_view(self, from: Duration) -> ClientView {
        let log = self.log.clone();
        let (values, _) = self.finish();
        let reads = log.lock().unwrap().clone();
        ClientView::of(values, &reads, vec![], from)
    }
}

impl ServicePoller {
    /// Waits (30 s at most) until a read saw `at_least`, reads on for [`SETTLED`], stops,
    /// and asserts that the counters read never went back (two copies served), reached
    /// `at_least` (the copy that serves now, `what`), and that no read failed after
    /// one had: once back, the workload answers every request.
    pub fn finish_reaching(self, at_least: u64, what: &str) {
        if let Err(e) = self.finish_reads(at_least, true) {
            panic!("{e} ({what})");
        }
    }

    /// Waits (30 s at most) until a read saw `at_least`, stops reading, prints what was
    /// read, and says what went wrong: the counters went back (two copies served
    /// through the Service) or never reached `at_least`. Failed reads are counted, not
    /// judged: the chaos test's readers run on through faults.
    pub fn finish_checked(self, at_least: u64) -> Result<(), String> {
        self.finish_reads(at_least, false)
    }

    fn finish_reads(self, at_least: u64, served_on: bool) -> Result<(), String> {
        for _ in 0..300 {
            if self.last().is_some_and(|v| v >= at_least) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if served_on {
            std::thread::sleep(SETTLED);
        }
        let log = self.log.clone();
        let (values, failures) = self.finish();
        eprintln!(
            "the Service gave {} counters ({failures} reads failed), {:?} .. {:?}",
            values.len(),
            values.first(),
            values.last()
        );
        if let Some((i, a, b)) = jump_back(&values) {
            return Err(format!(
                "two copies served through the Service: read {i} saw {a}, read {} saw {b}",
                i + 1
            ));
        }
        let Some(reached) = values.iter().position(|v| *v >= at_least) else {
            return Err(format!(
                "the Service never reached {at_least}: {:?}",
                values.last()
            ));
        };
        match failed_after(&log.lock().unwrap(), reached) {
            Some((at, why)) if served_on => Err(format!(
                "a read failed at {at:?}, after one had reached {at_least}: {why}"
            )),
            _ => Ok(()),
        }
    }
}

/// How long a [`ServicePoller`] reads on once it reached the copy that serves now.
pub const SETTLED: Duration = Duration::from_secs(2);

/// The first failed read after answer `answer` (its index), if any: when and why.
fn failed_after(reads: &Reads, answer: usize) -> Option<(Duration, String)> {
    let at = *reads.answers.get(answer)?;
    reads.failures.iter().find(|(t, _)| *t > at).cloned()
}

/// One sample of a migration's copies: the workload processes of the source pod
/// `source_uid` and of the target pod named `target_pod` (if it exists), that pod's
/// UID, and which of the processes run as copies of the state (`source` is the
/// original source process).
pub async fn sample(
    pods: &kube::Api<k8s_openapi::api::core::v1::Pod>,
    source: &Proc,
    target_pod: Option<&str>,
) -> (Vec<Proc>, Vec<Proc>, Option<String>) {
    let target_uid = match target_pod {
        Some(t) => pods
            .get_opt(t)
            .await
            .unwrap()
            .and_then(|p| kube::ResourceExt::uid(&p)),
        None => None,
    };
    let mut uids = vec![source.pod_uid.clone()];
    uids.extend(target_uid.clone());
    let procs = workload_processes(&uids);
    let copies = running_copies(&procs, source, target_uid.as_deref());
    (procs, copies, target_uid)
}

impl Drop for ServicePoller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// A client's connect timeout (the client: fresh connections, 3 s).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The longest a failed request holds a client: its connect or its read timing out.
pub const FAILED_REQUEST_WAIT: Duration =
    if CONNECT_TIMEOUT.as_millis() > ANSWER_TIMEOUT.as_millis() {
        CONNECT_TIMEOUT
    } else {
        ANSWER_TIMEOUT
    };

/// How long a client waits for an answer on a connection it has (past any freeze the
/// clients' migrations see: a late answer is an answer, not a failure).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(3);

/// One `get` on a new connection to `sa`.
fn read_once(sa: &std::net::SocketAddr) -> std::io::Result<u64> {
    let c = TcpStream::connect_timeout(sa, CONNECT_TIMEOUT)?;
    c.set_read_timeout(Some(ANSWER_TIMEOUT))?;
    let mut w = c.try_clone()?;
    writeln!(w, "get")?;
    let mut line = String::new();
    if BufReader::new(c).read_line(&mut line)? == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "closed before the answer",
        ));
    }
    line.trim()
        .parse()
        .map_err(|e| std::io::Error::other(format!("{line:?}: {e}")))
}

/// What one client saw from a point of its run on (the start of the window, `from`):
/// all its counters, the longest time it went without an answer (the gap: between two
/// answers, or from `from` to its first), the reads that failed and, for a client
/// holding a connection, how each connection ended.
#[derive(Clone, Debug, Default)]
pub struct ClientView {
    pub values: Vec<u64>,
    pub answers: usize,
    pub gap: Duration,
    /// When the longest gap began, from the client's start (not its window's).
    pub gap_from: Duration,
    /// When and why each read failed, from the client's start.
    pub failures: Vec<(Duration, String)>,
    /// When and how each held connection ended, from the client's start.
    pub ends: Vec<(Duration, String)>,
}

impl ClientView {
    fn of(
        values: Vec<u64>,
        reads: &Reads,
        ends: Vec<(Duration, String)>,
        from: Duration,
    ) -> ClientView {
        let answers: Vec<Duration> = reads
            .answers
            .iter()
            .copied()
            .filter(|t| *t >= from)
            .collect();
        let (gap, gap_from) = longest_gap(&answers, from, reads.end);
        let in_window = |(t, why): &(Duration, String)| (*t >= from).then(|| (*t, why.clone()));
        ClientView {
            values,
            answers: answers.len(),
            gap,
            gap_from,
            failures: reads.failures.iter().filter_map(in_window).collect(),
            ends: ends.iter().filter_map(in_window).collect(),
        }
    }

    /// The gap in milliseconds.
    pub fn gap_ms(&self) -> u64 {
        self.gap.as_millis() as u64
    }

    /// One line for a human: answers, gap, failures (with the first reasons), ends.
    pub fn summary(&self) -> String {
        let mut why: Vec<&str> = self.failures.iter().map(|(_, e)| e.as_str()).collect();
        why.dedup();
        why.truncate(3);
        format!(
            "{} answers, gap {} ms from {} ms, {} failed{}, {} connection(s) ended{}",
            self.answers,
            self.gap_ms(),
            self.gap_from.as_millis(),
            self.failures.len(),
            if why.is_empty() {
                String::new()
            } else {
                format!(" ({})", why.join("; "))
            },
            self.ends.len(),
            if self.ends.is_empty() {
                String::new()
            } else {
                format!(" ({:?})", self.ends)
            }
        )
    }

    /// Whether the client saw no failed read and a gap of at most `most` (the longest
    /// gap a [`GapRule`] allows, with how it was reckoned), and never two copies (its
    /// counters never went back); if not, why.
    pub fn within(&self, most: (Duration, String)) -> Result<(), String> {
        self.within_failing(most, 0)
    }

    /// As [`ClientView::within`], with at most `failures` failed reads.
    pub fn within_failing(
        &self,
        (most, how): (Duration, String),
        failures: usize,
    ) -> Result<(), String> {
        if let Some((i, a, b)) = jump_back(&self.values) {
            return Err(format!(
                "two copies served: read {i} saw {a}, read {} saw {b}",
                i + 1
            ));
        }
        if self.failures.len() > failures {
            return Err(format!(
                "{} failed read(s): {:?}",
                self.failures.len(),
                self.failures
            ));
        }
        // A failed request holds the client until its timeout: each failure the bound
        // allows may add that wait to the gap (seen: the quiesce window's one failed
        // read, 3 s of waiting inside a gap of downtime + 3.07 s).
        let waited = FAILED_REQUEST_WAIT * self.failures.len() as u32;
        if self.gap > most + waited {
            return Err(format!(
                "a gap of {} ms, past {how}{}",
                self.gap_ms(),
                if waited.is_zero() {
                    String::new()
                } else {
                    format!(
                        " + {} ms for the {} failed request(s)' timeout",
                        waited.as_millis(),
                        self.failures.len()
                    )
                }
            ));
        }
        Ok(())
    }
}

/// The longest time without an answer, with when it began: between two answers in
/// `answers` (times from the client's start, in order, none before `from`), from
/// `from` to the first, or from the last to the client's `end`. No answer at all:
/// `Duration::MAX`.
pub fn longest_gap(answers: &[Duration], from: Duration, end: Duration) -> (Duration, Duration) {
    let (Some(first), Some(last)) = (answers.first(), answers.last()) else {
        return (Duration::MAX, from);
    };
    answers
        .windows(2)
        .map(|w| (w[1].saturating_sub(w[0]), w[0]))
        .chain([(end.saturating_sub(*last), *last)])
        .fold((first.saturating_sub(from), from), |best, g| {
            if g.0 > best.0 { g } else { best }
        })
}

/// A client holding one connection through `addr` (a Service) on a thread: `get` on it
/// every `pause`; when the connection ends (a commit without the address hand-over ends
/// it: the address cannot move), the end is recorded and a new connection is opened
/// through `addr` again. Every value is recorded, so a second copy serving an older
/// counter shows as a jump back.
pub struct HeldClient {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<u64>>>,
    log: Arc<Mutex<Reads>>,
    ends: Arc<Mutex<Vec<(Duration, String)>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HeldClient {
    /// Connects to `addr` now (it must answer once before this returns, so that what
    /// follows is measured on an established connection) and reads on a thread.
    pub fn start(addr: String, pause: Duration) -> HeldClient {
        HeldClient::start_from(addr, pause, Instant::now())
    }

    /// As [`HeldClient::start`], its times counted from `t0`.
    pub fn start_from(addr: String, pause: Duration, t0: Instant) -> HeldClient {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(vec![]));
        let log = Arc::new(Mutex::new(Reads::default()));
        let ends = Arc::new(Mutex::new(vec![]));
        let (s, v, l, e) = (stop.clone(), seen.clone(), log.clone(), ends.clone());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let sa: std::net::SocketAddr = addr.parse().expect("ClusterIP:port");
            let mut ready = Some(ready_tx);
            while !s.load(Ordering::SeqCst) {
                let conn = match TcpStream::connect_timeout(&sa, CONNECT_TIMEOUT) {
                    Ok(c) => c,
                    Err(err) => {
                        l.lock()
                            .unwrap()
                            .failures
                            .push((t0.elapsed(), err.to_string()));
                        std::thread::sleep(pause);
                        continue;
                    }
                };
                let held = Held {
                    stop: &s,
                    seen: &v,
                    log: &l,
                    pause,
                    t0,
                };
                if let Some(end) = held.ask(conn, &mut ready) {
                    e.lock().unwrap().push((t0.elapsed(), end));
                }
            }
            l.lock().unwrap().end = t0.elapsed();
        });
        ready_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the held connection answered once");
        HeldClient {
            stop,
            seen,
            log,
            ends,
            thread: Some(thread),
        }
    }

    /// Values read so far.
    pub fn answers(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// Whether an answer comes within `within` (waits that long).
    pub fn answering(&self, within: Duration) -> bool {
        answered_within(&self.log, within)
    }

    /// Stops the client; what it saw. A held connection that went on has no end.
    pub fn finish(self) -> ClientView {
        self.finish_from(Duration::ZERO)
    }

    /// Stops the client; what it saw from `from` on (times from its start).
    pub fn finish_from(mut self, from: Duration) -> ClientView {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().expect("held client thread");
        }
        let values = self.seen.lock().unwrap().clone();
        let reads = self.log.lock().unwrap().clone();
        let ends = self.ends.lock().unwrap().clone();
        ClientView::of(values, &reads, ends, from)
    }
}

impl Drop for HeldClient {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The held client's thread, on one connection: what it stops on, where it records,
/// how often it asks, and what its times count from.
struct Held<'a> {
    stop: &'a AtomicBool,
    seen: &'a Mutex<Vec<u64>>,
    log: &'a Mutex<Reads>,
    pause: Duration,
    t0: Instant,
}

impl Held<'_> {
    /// Asks `get` on `conn` every `pause`, recording each value (the first also tells
    /// `ready`), until stopped (`None`) or the connection ends (why).
    fn ask(
        &self,
        conn: TcpStream,
        ready: &mut Option<std::sync::mpsc::Sender<()>>,
    ) -> Option<String> {
        let (s, v, l, pause, t0) = (self.stop, self.seen, self.log, self.pause, self.t0);
        let _ = conn.set_read_timeout(Some(ANSWER_TIMEOUT));
        let mut w = conn.try_clone().expect("clone");
        let mut r = BufReader::new(conn);
        let mut line = String::new();
        loop {
            if s.load(Ordering::SeqCst) {
                break None;
            }
            line.clear();
            if let Err(err) = writeln!(w, "get") {
                break Some(format!("write: {err}"));
            }
            match r.read_line(&mut line) {
                Ok(0) => break Some("EOF".to_string()),
                Ok(_) => match line.trim().parse::<u64>() {
                    Ok(n) => {
                        v.lock().unwrap().push(n);
                        l.lock().unwrap().answers.push(t0.elapsed());
                        if let Some(tx) = ready.take() {
                            let _ = tx.send(());
                        }
                    }
                    Err(_) => break Some(format!("not a counter: {line:?}")),
                },
                Err(err) => break Some(format!("read: {err}")),
            }
            std::thread::sleep(pause);
        }
    }
}

/// Whether a new answer comes into `log` within `within` (waits that long).
fn answered_within(log: &Arc<Mutex<Reads>>, within: Duration) -> bool {
    let before = log.lock().unwrap().answers.len();
    std::thread::sleep(within);
    log.lock().unwrap().answers.len() > before
}

/// The two clients of a migration, through its Service: one on fresh connections every
/// 10 ms, one holding a connection (a `get` every 10 ms).
pub struct Clients {
    pub fresh: ServicePoller,
    pub held: HeldClient,
    /// What both clients' times count from.
    pub t0: Instant,
    /// Where the window of what they saw starts (from `t0`; [`Clients::serving`]).
    pub from: Duration,
    /// The migration's phases, endpoints and pods on the same clock, once watched.
    pub timeline: Option<super::timeline::Timeline>,
}

impl Clients {
    /// Starts both on `svc` (ClusterIP:port).
    pub fn start(svc: &str) -> Clients {
        let pause = Duration::from_millis(10);
        let t0 = Instant::now();
        Clients {
            held: HeldClient::start_from(svc.to_string(), pause, t0),
            fresh: ServicePoller::every_from(svc.to_string(), pause, t0),
            t0,
            from: Duration::ZERO,
            timeline: None,
        }
    }

    /// Waits (30 s at most) until both clients answer, and opens their window there:
    /// what they see counts from just before the migration is created, not from their
    /// first connection (a client's first connection to a just-created Service once
    /// took a second before any migration began: docs/benchmarks.md, run 8). Panics
    /// when they get no answer: the Service does not serve before the migration.
    pub async fn serving(mut self) -> Clients {
        let start = Instant::now();
        loop {
            let (f, h) = (self.fresh.answers(), self.held.answers());
            tokio::time::sleep(Duration::from_millis(100)).await;
            if self.fresh.answers() > f && self.held.answers() > h {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the Service's clients got no answer for 30 s before the migration \
                 ({} fresh and {} held answers in all)",
                self.fresh.answers(),
                self.held.answers()
            );
        }
        self.from = self.t0.elapsed();
        self
    }

    /// Also records the timeline of the PodMigration `migration` and the Service
    /// `service` in namespace `ns` on the clients' clock (printed by [`assert_clients`]).
    pub fn watching(
        mut self,
        client: kube::Client,
        ns: &str,
        service: &str,
        migration: &str,
    ) -> Clients {
        self.timeline = Some(super::timeline::Timeline::watch(
            client, ns, service, migration, self.t0,
        ));
        self
    }

    /// Lets them run past the end of a migration until both answer again (20 s at
    /// most; a gap still open then counts up to the stop), then `settle` more, and
    /// stops them; (fresh, held), each from the window's start on.
    pub fn finish_after(self, settle: Duration) -> (ClientView, ClientView) {
        let t = Instant::now();
        let within = Duration::from_millis(200);
        while t.elapsed() < Duration::from_secs(20)
            && !(self.fresh.answering(within) && self.held.answering(within))
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(settle);
        (
            self.fresh.finish_view(self.from),
            self.held.finish_from(self.from),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::real::bounds::GapRule;

    #[test]
    fn only_a_resume_that_is_not_denied_counts() {
        assert!(says_resumed("probe failed; the source pod was resumed"));
        assert!(!says_resumed(
            "the fenced source was killed on its node; the source was not resumed"
        ));
        assert!(!says_resumed("pod runs on node-b (downtime 180ms)"));
    }

    #[test]
    fn the_longest_gap_is_between_answers_or_before_the_first() {
        let ms = Duration::from_millis;
        let zero = Duration::ZERO;
        assert_eq!(
            longest_gap(&[ms(5), ms(20), ms(900), ms(910)], zero, ms(920)),
            (ms(880), ms(20))
        );
        assert_eq!(
            longest_gap(&[ms(700), ms(710)], zero, ms(720)),
            (ms(700), ms(0))
        );
        // The first gap counts from the window's start.
        assert_eq!(
            longest_gap(&[ms(700), ms(710)], ms(650), ms(720)),
            (ms(50), ms(650))
        );
        // A gap still open when the client stops counts to its end.
        assert_eq!(
            longest_gap(&[ms(5), ms(15)], zero, ms(2015)),
            (ms(2000), ms(15))
        );
        assert_eq!(longest_gap(&[], zero, ms(10)).0, Duration::MAX);
    }

    #[test]
    fn a_view_counts_its_gap_failures_and_ends_from_its_window_on() {
        let ms = Duration::from_millis;
        let reads = Reads {
            // A slow first connection (1 s), then answers every 10 ms, one 400 ms gap.
            answers: vec![ms(1000), ms(1010), ms(1020), ms(1420), ms(1430)],
            failures: vec![(ms(500), "connect: timed out".into())],
            end: ms(1440),
        };
        let ends = vec![(ms(300), "EOF".into()), (ms(1100), "EOF".into())];
        let all = ClientView::of(vec![1, 2, 3, 4, 5], &reads, ends.clone(), Duration::ZERO);
        assert_eq!(
            (all.gap, all.failures.len(), all.ends.len()),
            (ms(1000), 1, 2)
        );
        let window = ClientView::of(vec![1, 2, 3, 4, 5], &reads, ends, ms(1005));
        assert_eq!((window.gap, window.gap_from), (ms(400), ms(1020)));
        assert_eq!((window.answers, window.failures.len()), (4, 0));
        assert_eq!(window.ends, vec![(ms(1100), "EOF".to_string())]);
    }

    #[test]
    fn a_view_is_within_a_bound_only_without_failures_jumps_or_a_longer_gap() {
        let ms = Duration::from_millis;
        let view = ClientView {
            values: vec![1, 2, 3],
            answers: 3,
            gap: ms(900),
            ..Default::default()
        };
        let past = |d, slack| GapRule::PastDowntime(slack).most(d);
        assert!(view.within(past(ms(500), ms(400))).is_ok());
        assert!(view.within(past(ms(500), ms(399))).is_err());
        let failed = ClientView {
            failures: vec![(ms(10), "timed out".into())],
            ..view.clone()
        };
        assert!(failed.within(past(ms(500), ms(700))).is_err());
        let back = ClientView {
            values: vec![1, 3, 2],
            ..view
        };
        assert!(back.within(past(ms(500), ms(700))).is_err());
    }

    #[test]
    fn only_a_failure_after_the_answer_that_reached_counts() {
        let ms = Duration::from_millis;
        let reads = Reads {
            answers: vec![ms(100), ms(4000), ms(4100)],
            failures: vec![(ms(3100), "timed out".into())],
            end: ms(4200),
        };
        assert_eq!(failed_after(&reads, 1), None);
        assert_eq!(
            failed_after(&reads, 0),
            Some((ms(3100), "timed out".into()))
        );
        assert_eq!(failed_after(&reads, 7), None);
    }

    #[test]
    fn jump_back_finds_the_first_decrease_only() {
        assert_eq!(jump_back(&[1, 2, 2, 5]), None);
        assert_eq!(jump_back(&[1, 3, 2, 5, 1]), Some((1, 3, 2)));
        assert_eq!(jump_back(&[]), None);
    }
}
