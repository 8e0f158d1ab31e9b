//! The testload server processes of a migration, seen from the machine the real nodes
//! run on: those in given pods' cgroups, with their state letter, start time and pending
//! stop (so a stopped source, one just woken to take CRIU's stop and a reused pid tell
//! apart), which of them are copies of the state, and the crash a test makes of a pod.

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
    /// Woken only to stop or to die: a SIGSTOP or SIGKILL pending, or exiting. CRIU
    /// leaves a tree stopped by queueing SIGSTOP and then detaching, so the source shows
    /// `R` for as long as it waits for a core to take the stop — it runs none of its
    /// own code on the way (a signal is taken before the return to user space).
    pub stopping: bool,
}

/// SIGKILL's and SIGSTOP's bits in a /proc signal mask (bit `signo - 1`).
const KILL_OR_STOP: u64 = 1 << (9 - 1) | 1 << (19 - 1);
/// `PF_EXITING` in the flags of /proc/<pid>/stat.
const PF_EXITING: u64 = 0x4;

impl Proc {
    /// Runs: not stopped (a frozen source is SIGSTOPped: `T`; `t` under ptrace, as CRIU
    /// holds it), not a zombie, and not just woken to stop or die ([`Proc::stopping`]).
    pub fn runs(&self) -> bool {
        !matches!(self.state, 'T' | 't' | 'Z' | 'X') && !self.stopping
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
/// handler sees, of the whole pod at once; returns what was killed (pid, argv[0]).
///
/// All of them are SIGSTOPped first, then all SIGKILLed, so that no process outlives
/// another by the milliseconds a `kill` per process took (a survivor could react to the
/// other's death: the broker rolls back a source whose agent's socket closed). A
/// stopped process runs no code; SIGKILL ends it stopped. The kubelet may still
/// restart the killed containers in the pod before its deletion reaches it.
pub fn kill_pod_processes(uid: &str) -> Vec<(u32, String)> {
    let victims: Vec<(u32, String)> = pod_processes(uid)
        .into_iter()
        .filter(|(_, argv0)| !argv0.ends_with("pause"))
        .collect();
    if victims.is_empty() {
        return victims;
    }
    let pids: Vec<String> = victims.iter().map(|(pid, _)| pid.to_string()).collect();
    for signal in ["-STOP", "-KILL"] {
        // One that exited meanwhile (a CRIU finishing) fails its kill: that is fine,
        // the others still get the signal.
        let out = std::process::Command::new("kill")
            .arg(signal)
            .args(&pids)
            .output()
            .expect("kill");
        if !out.status.success() {
            eprintln!(
                "kill {signal} {}: {}",
                pids.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    victims
}

/// The log files of container `container` of pod `pod_uid` on real node `node`, read
/// through its kubelet's mount namespace (`/proc/<kubelet>/root/var/log/pods`), with
/// their text: every restart's file (`0.log`, `1.log`, …). Empty once the kubelet has
/// removed them, which it does soon after a deleted pod stops: [`LogTail`] keeps them.
pub fn node_container_logs(node: &str, pod_uid: &str, container: &str) -> Vec<(String, String)> {
    let mut out = vec![];
    let want = format!("--hostname-override={node}");
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        let is_kubelet = args.first().is_some_and(|a| a.ends_with(b"/kubelet"));
        if !is_kubelet || !args.contains(&want.as_bytes()) {
            continue;
        }
        let pods = e.path().join("root/var/log/pods");
        for d in std::fs::read_dir(&pods).into_iter().flatten().flatten() {
            if !d
                .file_name()
                .to_string_lossy()
                .ends_with(&format!("_{pod_uid}"))
            {
                continue;
            }
            for f in std::fs::read_dir(d.path().join(container))
                .into_iter()
                .flatten()
                .flatten()
            {
                if let Ok(text) = std::fs::read_to_string(f.path()) {
                    out.push((f.file_name().to_string_lossy().into_owned(), text));
                }
            }
        }
    }
    out.sort();
    out
}

/// Keeps what [`node_container_logs`] shows of one container, polled every 100 ms on a
/// thread until [`LogTail::stop`]: the logs of a pod the test crashed and deleted,
/// whose container the kubelet may restart once before it tears the pod down.
pub struct LogTail {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<std::collections::BTreeMap<String, String>>,
}

impl LogTail {
    pub fn start(node: &str, pod_uid: &str, container: &str) -> LogTail {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (node, uid, c, flag) = (
            node.to_owned(),
            pod_uid.to_owned(),
            container.to_owned(),
            stop.clone(),
        );
        let thread = std::thread::spawn(move || {
            let mut kept = std::collections::BTreeMap::new();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                for (name, text) in node_container_logs(&node, &uid, &c) {
                    kept.insert(name, text);
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            kept
        });
        LogTail { stop, thread }
    }

    /// Stops polling; every file seen, by name, with its text as last read (a log
    /// only grows; a file the kubelet removed keeps what was read before).
    pub fn stop(self) -> std::collections::BTreeMap<String, String> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("log tail thread")
    }
}

/// The testload server processes (port 8080) in the cgroups of the pods `pod_uids`.
/// Another listener a test starts (in its own cgroup, on another port) never counts.
pub fn workload_processes(pod_uids: &[String]) -> Vec<Proc> {
    server_processes(pod_uids, PORT)
}

/// The testload server processes serving `port` (`serve <port>`) in the cgroups of the
/// pods `pod_uids`: [`workload_processes`] for a server on another port (a pod on the
/// host network, which shares the machine's ports).
pub fn server_processes(pod_uids: &[String], port: u16) -> Vec<Proc> {
    let port = port.to_string();
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let (Ok(cmd), Ok(cgroup), Ok(stat), Ok(status)) = (
            std::fs::read(format!("/proc/{pid}/cmdline")),
            std::fs::read_to_string(format!("/proc/{pid}/cgroup")),
            std::fs::read_to_string(format!("/proc/{pid}/stat")),
            std::fs::read_to_string(format!("/proc/{pid}/status")),
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
        let Some((state, start, flags)) = state_and_start(&stat) else {
            continue;
        };
        out.push(Proc {
            pid,
            pod_uid: uid.clone(),
            state,
            start,
            stopping: flags & PF_EXITING != 0 || pending(&status) & KILL_OR_STOP != 0,
        });
    }
    out
}

/// The state letter, start time and flags of a /proc/<pid>/stat line ("pid (comm) state
/// ppid ..."; flags is field 9, starttime field 22).
fn state_and_start(stat: &str) -> Option<(char, u64, u64)> {
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first().and_then(|s| s.chars().next())?;
    let flags = fields.get(6).and_then(|s| s.parse().ok())?;
    let start = fields.get(19).and_then(|s| s.parse().ok())?;
    Some((state, start, flags))
}

/// The signals pending for a process, its thread's and its group's (`SigPnd`, `ShdPnd`
/// of /proc/<pid>/status, hexadecimal masks).
fn pending(status: &str) -> u64 {
    let masks = status.lines().filter_map(|l| {
        let m = l
            .strip_prefix("SigPnd:")
            .or_else(|| l.strip_prefix("ShdPnd:"))?;
        u64::from_str_radix(m.trim(), 16).ok()
    });
    masks.fold(0, |all, mask| all | mask)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn proc(pid: u32, pod_uid: &str, state: char, start: u64) -> Proc {
        Proc {
            pid,
            pod_uid: pod_uid.into(),
            state,
            start,
            stopping: false,
        }
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
    fn a_source_woken_only_to_take_its_stop_or_kill_is_not_a_copy() {
        // As /proc shows a task CRIU detached after queueing SIGSTOP (bit 19 - 1).
        let status = "Name:\ttestload\nState:\tR (running)\nSigPnd:\t0000000000000000\n\
                      ShdPnd:\t0000000000040000\nSigBlk:\t0000000000000000\n";
        assert_eq!(pending(status) & KILL_OR_STOP, 1 << 18);
        assert_eq!(pending("SigPnd:\t0000000000000100\n"), 1 << 8);
        // SIGCONT (18) or SIGTERM (15) pending leaves it running.
        assert_eq!(pending("ShdPnd:\t0000000000024000\n") & KILL_OR_STOP, 0);
        // An exiting task (PF_EXITING in its flags).
        let stat = "42 (testload) R 1 42 42 0 -1 4194564 120 0 0 0 1 2 0 0 20 0 1 0 2666923 \
                    0 0";
        assert_ne!(state_and_start(stat).unwrap().2 & PF_EXITING, 0);
        let source = proc(10, "src", 'T', 5);
        let restored = proc(20, "tgt", 'S', 9);
        let detached = Proc {
            state: 'R',
            stopping: true,
            ..source.clone()
        };
        assert!(!detached.runs());
        assert_eq!(
            running_copies(&[detached, restored.clone()], &source, Some("tgt")),
            vec![restored]
        );
    }

    #[test]
    fn the_state_start_and_flags_come_after_the_last_parenthesis() {
        // A command name may hold ") " itself.
        let stat =
            "4242 (a) b) T 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(state_and_start(stat), Some(('T', 987654, 4194560)));
        assert_eq!(4194560 & PF_EXITING, 0);
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
