//! How many copies of a workload's state run, seen from the machine the real nodes run
//! on, shared by the real-node migration tests that kill parts of a migration on the way:
//! the testload server processes in given pods' cgroups (with their state letter and
//! start time, so a stopped source and a reused pid tell apart), which of them are
//! copies of the state, what a status says to a human, the counter read through a
//! Service on a new connection per read, and the first place a sequence of counters
//! goes back (two copies served).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use podmotion_api::migration::PodMigrationStatus;

use super::testload::PORT;

/// One testload server process (`serve 8080`) found on the nodes, in a pod's cgroups.
#[derive(Clone, Debug, PartialEq)]
pub struct Proc {
    pub pid: u32,
    pub pod_uid: String,
    /// The state letter of /proc/<pid>/stat.
    pub state: char,
    /// Start time (clock ticks since boot): a pid reused by another process differs.
    pub start: u64,
}

impl Proc {
    /// Runs: not stopped (a frozen source is SIGSTOPped: `T`; `t` under ptrace, as CRIU
    /// holds it), not a zombie.
    pub fn runs(&self) -> bool {
        !matches!(self.state, 'T' | 't' | 'Z' | 'X')
    }

    /// The same process as `other` (the same pid and start time), whatever its state.
    pub fn same(&self, other: &Proc) -> bool {
        self.pid == other.pid && self.start == other.start
    }
}

/// Whether the cgroup file `cgroup` of a process places it in pod `uid` (cgroupfs writes
/// the UID with dashes, the systemd driver with underscores).
pub fn in_pod(cgroup: &str, uid: &str) -> bool {
    cgroup.contains(uid) || cgroup.contains(&uid.replace('-', "_"))
}

/// Host PIDs of the processes in pod `uid`'s cgroups, with their command line's first
/// word (`argv[0]`).
pub fn pod_processes(uid: &str) -> Vec<(u32, String)> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let (Ok(cmd), Ok(cgroup)) = (
            std::fs::read(format!("/proc/{pid}/cmdline")),
            std::fs::read_to_string(format!("/proc/{pid}/cgroup")),
        ) else {
            continue;
        };
        if in_pod(&cgroup, uid) {
            let argv0 = cmd.split(|b| *b == 0).next().unwrap_or_default();
            out.push((pid, String::from_utf8_lossy(argv0).into_owned()));
        }
    }
    out
}

/// SIGKILLs every process of pod `uid` but its sandbox's (`pause`): a crash no signal
/// handler sees; returns what was killed (pid, argv[0]).
pub fn kill_pod_processes(uid: &str) -> Vec<(u32, String)> {
    let victims: Vec<(u32, String)> = pod_processes(uid)
        .into_iter()
        .filter(|(_, argv0)| !argv0.ends_with("pause"))
        .collect();
    for (pid, argv0) in &victims {
        // One that exited meanwhile (a CRIU finishing) fails the kill: that is fine.
        let out = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .output()
            .expect("kill");
        if !out.status.success() {
            eprintln!(
                "kill -KILL {pid} ({argv0}): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    victims
}

/// The testload server processes (port 8080) in the cgroups of the pods `pod_uids`.
/// Another listener a test starts (in its own cgroup, on another port) never counts.
pub fn workload_processes(pod_uids: &[String]) -> Vec<Proc> {
    let port = PORT.to_string();
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let (Ok(cmd), Ok(cgroup), Ok(stat)) = (
            std::fs::read(format!("/proc/{pid}/cmdline")),
            std::fs::read_to_string(format!("/proc/{pid}/cgroup")),
            std::fs::read_to_string(format!("/proc/{pid}/stat")),
        ) else {
            continue;
        };
        let args: Vec<_> = cmd.split(|b| *b == 0).collect();
        if !(args.len() > 2 && args[1] == b"serve" && args[2] == port.as_bytes()) {
            continue;
        }
        let Some(uid) = pod_uids.iter().find(|u| in_pod(&cgroup, u)) else {
            continue;
        };
        let Some((state, start)) = state_and_start(&stat) else {
            continue;
        };
        out.push(Proc {
            pid,
            pod_uid: uid.clone(),
            state,
            start,
        });
    }
    out
}

/// The state letter and start time of a /proc/<pid>/stat line ("pid (comm) state ppid
/// ..."; starttime is field 22).
fn state_and_start(stat: &str) -> Option<(char, u64)> {
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first().and_then(|s| s.chars().next())?;
    let start = fields.get(19).and_then(|s| s.parse().ok())?;
    Some((state, start))
}

/// The copies of the workload's state among `procs` that run: the original source
/// process (`source`: same pid, same start) and the restored processes in the target
/// pod `target_uid`. (A container the kubelet restarts in the source pod after the
/// source's kill runs a fresh workload, not a copy: counted apart.)
pub fn running_copies(procs: &[Proc], source: &Proc, target_uid: Option<&str>) -> Vec<Proc> {
    procs
        .iter()
        .filter(|p| p.runs())
        .filter(|p| p.same(source) || Some(p.pod_uid.as_str()) == target_uid)
        .cloned()
        .collect()
}

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
/// frozen source answers late or never: short timeouts, failures counted, not fatal),
/// so a second copy serving an older counter shows as a jump back.
pub struct ServicePoller {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<u64>>>,
    failures: Arc<Mutex<usize>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ServicePoller {
    /// Starts reading `addr` (ClusterIP:port) every 100 ms.
    pub fn start(addr: String) -> ServicePoller {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(vec![]));
        let failures = Arc::new(Mutex::new(0));
        let (s, v, f) = (stop.clone(), seen.clone(), failures.clone());
        let thread = std::thread::spawn(move || {
            let sa = addr.parse().expect("ClusterIP:port");
            while !s.load(Ordering::SeqCst) {
                match read_once(&sa) {
                    Ok(n) => v.lock().unwrap().push(n),
                    Err(_) => *f.lock().unwrap() += 1,
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        ServicePoller {
            stop,
            seen,
            failures,
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
}

impl ServicePoller {
    /// Waits (30 s at most) until a read saw `at_least`, stops reading, and asserts that
    /// the counters read never went back (two copies served) and reached `at_least`
    /// (the copy that serves now, `what`).
    pub fn finish_reaching(self, at_least: u64, what: &str) {
        if let Err(e) = self.finish_checked(at_least) {
            panic!("{e} ({what})");
        }
    }

    /// Waits (30 s at most) until a read saw `at_least`, stops reading, prints what was
    /// read, and says what went wrong: the counters went back (two copies served
    /// through the Service) or never reached `at_least`.
    pub fn finish_checked(self, at_least: u64) -> Result<(), String> {
        for _ in 0..300 {
            if self.last().is_some_and(|v| v >= at_least) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
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
        if values.last().is_none_or(|v| *v < at_least) {
            return Err(format!(
                "the Service never reached {at_least}: {:?}",
                values.last()
            ));
        }
        Ok(())
    }
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

/// One `get` on a new connection to `sa`.
fn read_once(sa: &std::net::SocketAddr) -> std::io::Result<u64> {
    let c = TcpStream::connect_timeout(sa, Duration::from_secs(2))?;
    c.set_read_timeout(Some(Duration::from_secs(3)))?;
    let mut w = c.try_clone()?;
    writeln!(w, "get")?;
    let mut line = String::new();
    BufReader::new(c).read_line(&mut line)?;
    line.trim()
        .parse()
        .map_err(|e| std::io::Error::other(format!("{line:?}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proc(pid: u32, pod_uid: &str, state: char, start: u64) -> Proc {
        Proc {
            pid,
            pod_uid: pod_uid.into(),
            state,
            start,
        }
    }

    #[test]
    fn only_a_resume_that_is_not_denied_counts() {
        assert!(says_resumed("probe failed; the source pod was resumed"));
        assert!(!says_resumed(
            "the fenced source was killed on its node; the source was not resumed"
        ));
        assert!(!says_resumed("pod runs on node-b (downtime 180ms)"));
    }

    #[test]
    fn a_stopped_source_beside_the_restored_copy_is_one_copy_and_a_thawed_one_two() {
        let source = proc(10, "src", 'T', 5);
        let restored = proc(20, "tgt", 'S', 9);
        let fresh = proc(30, "src", 'S', 12);
        let frozen = [source.clone(), restored.clone(), fresh];
        assert_eq!(
            running_copies(&frozen, &source, Some("tgt")),
            vec![restored.clone()]
        );
        let thawed = Proc {
            state: 'S',
            ..source.clone()
        };
        assert_eq!(
            running_copies(&[thawed.clone(), restored], &source, Some("tgt")).len(),
            2
        );
        // A pid reused by another process is not the source.
        let reused = Proc {
            start: 99,
            ..thawed
        };
        assert_eq!(running_copies(&[reused], &source, Some("tgt")).len(), 0);
    }

    #[test]
    fn jump_back_finds_the_first_decrease_only() {
        assert_eq!(jump_back(&[1, 2, 2, 5]), None);
        assert_eq!(jump_back(&[1, 3, 2, 5, 1]), Some((1, 3, 2)));
        assert_eq!(jump_back(&[]), None);
    }

    #[test]
    fn the_state_and_start_come_after_the_last_parenthesis() {
        // A command name may hold ") " itself.
        let stat =
            "4242 (a) b) T 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(state_and_start(stat), Some(('T', 987654)));
        assert_eq!(state_and_start("4242 (cut"), None);
    }

    #[test]
    fn a_pod_uid_matches_with_dashes_or_underscores() {
        let uid = "0a1b-2c3d";
        assert!(in_pod("0::/kubepods/pod0a1b-2c3d/abc", uid));
        assert!(in_pod(
            "1:cpu:/kubepods.slice/kubepods-pod0a1b_2c3d.slice",
            uid
        ));
        assert!(!in_pod("0::/kubepods/pod9999/abc", uid));
    }
}
