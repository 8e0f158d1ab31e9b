//! What the broker reads from /proc to decide whether a pid is what a request says it
//! is: live, the same process as when it was pinned (start time), in which cgroup and
//! network namespace, and which processes form its tree.

use podmotion_wire::broker::{BrokerError, ErrorKind};
use podmotion_wire::ids::ProcRef;
use std::collections::BTreeSet;
use std::path::PathBuf;

fn no_such(pid: i32) -> BrokerError {
    BrokerError::new(ErrorKind::NoSuchProcess, format!("pid {pid} is not alive"))
}

/// Start time (clock ticks since boot), field 22 of /proc/<pid>/stat. The comm field
/// may contain spaces and parentheses, so fields are counted after the last ')'.
pub fn start_time(pid: i32) -> Result<u64, BrokerError> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|_| no_such(pid))?;
    parse_start_time(&stat).ok_or_else(|| BrokerError::new(ErrorKind::Kernel, "unparsable stat"))
}

pub fn parse_start_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After ')': state is field 3; starttime is field 22 → index 19 here.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The process named by `p`, or a typed error if it died or its pid was reused.
pub fn check_live(p: ProcRef) -> Result<(), BrokerError> {
    if p.pid <= 1 {
        return Err(no_such(p.pid));
    }
    let st = start_time(p.pid)?;
    if st != p.start_time {
        return Err(BrokerError::new(
            ErrorKind::PidReused,
            format!("pid {} has start time {st}, not {}", p.pid, p.start_time),
        ));
    }
    // A zombie has no namespaces or fds to act on.
    let status =
        std::fs::read_to_string(format!("/proc/{}/status", p.pid)).map_err(|_| no_such(p.pid))?;
    if status
        .lines()
        .any(|l| l.starts_with("State:") && l.contains('Z'))
    {
        return Err(no_such(p.pid));
    }
    Ok(())
}

/// The cgroup path of a process, by which the broker knows whose it is (a pod's, which
/// container's): its cgroup v2 path ("0::/a/b" → "/a/b") on unified and hybrid hosts;
/// on a legacy cgroup v1 host, where the v2 hierarchy is unused (the process sits at
/// its root, `0::/`, or the line is absent), its path in the v1 hierarchies (see
/// [`cgroup_path`]).
pub fn cgroup_of(pid: i32) -> Result<String, BrokerError> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).map_err(|_| no_such(pid))?;
    cgroup_path(&s).ok_or_else(|| {
        BrokerError::new(
            ErrorKind::Kernel,
            format!("pid {pid} has no cgroup v2 membership and no cgroup v1 one"),
        )
    })
}

/// The path [`cgroup_of`] reads from the text of `/proc/<pid>/cgroup`: the v2 path
/// unless it is the root and v1 memberships exist; then the `name=systemd`
/// hierarchy's path (systemd tracks every process there, and the runtimes place a
/// container there as in the controllers), else the `memory` hierarchy's, else the
/// first listed (the kubelet and the runtimes use one path in every hierarchy).
pub fn cgroup_path(text: &str) -> Option<String> {
    let v2 = text.lines().find_map(|l| l.strip_prefix("0::"));
    if let Some(p) = v2
        && p != "/"
    {
        return Some(p.to_owned());
    }
    let v1 = parse_cgroup_v1(text);
    let of = |c: &str| {
        v1.iter()
            .find(|(ctrls, _)| ctrls.split(',').any(|x| x == c))
    };
    of("name=systemd")
        .or_else(|| of("memory"))
        .or_else(|| v1.first())
        .map(|(_, p)| p.clone())
        .or_else(|| v2.map(str::to_owned))
}

/// Where cgroup2 is mounted (/sys/fs/cgroup on unified hosts, /sys/fs/cgroup/unified on hybrid).
pub fn cgroup2_mount() -> Result<PathBuf, BrokerError> {
    let mi = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| BrokerError::new(ErrorKind::Kernel, e.to_string()))?;
    cgroup2_mount_in(&mi)
        .ok_or_else(|| BrokerError::new(ErrorKind::Kernel, "cgroup2 is not mounted"))
}

/// The first cgroup2 mount point in `mountinfo`.
pub fn cgroup2_mount_in(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ").unwrap_or((l, ""));
        (post.split_whitespace().next() == Some("cgroup2"))
            .then(|| pre.split_whitespace().nth(4).map(PathBuf::from))
            .flatten()
    })
}

/// `pid`'s cgroup v1 memberships: `(controllers, path)` per hierarchy (`cpu,cpuacct`,
/// `name=systemd`, …). Empty on a cgroup v2-only host.
pub fn cgroup_v1_of(pid: i32) -> Result<Vec<(String, String)>, BrokerError> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).map_err(|_| no_such(pid))?;
    Ok(parse_cgroup_v1(&s))
}

pub fn parse_cgroup_v1(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, ':');
            let (id, ctrls, path) = (f.next()?, f.next()?, f.next()?);
            (id != "0" && !ctrls.is_empty()).then(|| (ctrls.to_owned(), path.to_owned()))
        })
        .collect()
}

/// Where the cgroup v1 hierarchy of `controllers` (as in /proc/<pid>/cgroup) is mounted
/// in `mountinfo`: the cgroup mount whose options name exactly those controllers.
pub fn cgroup_v1_mount(mountinfo: &str, controllers: &str) -> Option<PathBuf> {
    let want: BTreeSet<&str> = controllers.split(',').collect();
    mountinfo.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ")?;
        let mut post = post.split_whitespace();
        if post.next()? != "cgroup" {
            return None;
        }
        // The hierarchy's controllers: its super options minus the generic ones.
        let opts: BTreeSet<&str> = post
            .nth(1)?
            .split(',')
            .filter(|o| {
                !matches!(
                    *o,
                    "rw" | "ro" | "xattr" | "noprefix" | "clone_children" | "cpuset_v2_mode"
                ) && (!o.contains('=') || o.starts_with("name="))
            })
            .collect();
        let mut pre = pre.split_whitespace().skip(3);
        let (root, mp) = (pre.next()?, pre.next()?);
        (opts == want && root == "/").then(|| PathBuf::from(mp))
    })
}

pub fn netns_inode(pid: i32) -> Result<String, BrokerError> {
    std::fs::read_link(format!("/proc/{pid}/ns/net"))
        .map(|p| p.to_string_lossy().into_owned())
        .map_err(|_| no_such(pid))
}

/// The node's own network namespace (`net:[inode]`): init's, or where init cannot be
/// inspected (a non-dumpable PID 1 without `CAP_SYS_PTRACE`), the initial network
/// namespace's fixed inode (`PROC_NET_INIT_INO`, Linux 6.x).
pub fn node_netns() -> String {
    netns_inode(1).unwrap_or_else(|_| format!("net:[{}]", 0xEFFF_FFF9u32))
}

/// A process whose network namespace is the node's ([`node_netns`]) and can be
/// entered by this one: init if it can, else the first such process in /proc (where
/// init is not dumpable — a sandboxed machine's init, as on this project's own
/// machines — the node's kubelet, containerd or a shim).
pub fn node_netns_pid() -> std::io::Result<i32> {
    let node = node_netns();
    let enterable = |pid: i32| {
        netns_inode(pid).is_ok_and(|n| n == node)
            && std::fs::File::open(format!("/proc/{pid}/ns/net")).is_ok()
    };
    if enterable(1) {
        return Ok(1);
    }
    for e in std::fs::read_dir("/proc")?.flatten() {
        if let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>()
            && pid > 1
            && enterable(pid)
        {
            return Ok(pid);
        }
    }
    Err(std::io::Error::other(format!(
        "no process in the node's network namespace ({node}) can be entered"
    )))
}

pub fn tracer_pid(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The process tree rooted at `root` (thread-group ids), root first. Built from the
/// parent pid of every process (`/proc/<pid>/task/*/children` needs
/// CONFIG_PROC_CHILDREN, which not every kernel has).
pub fn tree(root: i32) -> Vec<i32> {
    let mut kids: std::collections::HashMap<i32, Vec<i32>> = std::collections::HashMap::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            if let Some(ppid) = parse_ppid(&stat) {
                kids.entry(ppid).or_default().push(pid);
            }
        }
    }
    let mut out = vec![root];
    let mut seen = BTreeSet::from([root]);
    let mut i = 0;
    while i < out.len() {
        let pid = out[i];
        i += 1;
        for c in kids.get(&pid).into_iter().flatten() {
            if seen.insert(*c) {
                out.push(*c);
            }
        }
    }
    out
}

/// The PIDs of `pid` in each PID namespace from the reader's down (`NSpid`).
pub fn ns_pids(pid: i32) -> Option<Vec<i32>> {
    parse_ns_pids(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

pub fn parse_ns_pids(status: &str) -> Option<Vec<i32>> {
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    line.split_whitespace().map(|p| p.parse().ok()).collect()
}

/// The reader's PID of the child of `parent` whose PID in `parent`'s own PID namespace
/// is `ns_pid` (CRIU run inside a container's PID namespace reports PIDs as seen there).
pub fn child_by_ns_pid(parent: i32, ns_pid: i32) -> Option<i32> {
    let depth = ns_pids(parent)?.len();
    let dir = std::fs::read_dir("/proc").ok()?;
    dir.flatten().find_map(|e| {
        let pid = e.file_name().to_string_lossy().parse::<i32>().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        (parse_ppid(&stat)? == parent && ns_pids(pid)?.get(depth - 1) == Some(&ns_pid))
            .then_some(pid)
    })
}

pub fn parse_ppid(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Inodes of the TCP sockets (v4 and v6) in the network namespace of `pid`.
pub fn tcp_inodes(pid: i32) -> BTreeSet<u64> {
    let mut set = BTreeSet::new();
    for f in ["tcp", "tcp6"] {
        let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/net/{f}")) else {
            continue;
        };
        for l in s.lines().skip(1) {
            if let Some(ino) = l.split_whitespace().nth(9).and_then(|v| v.parse().ok()) {
                set.insert(ino);
            }
        }
    }
    set
}

/// (fd number, socket inode) of each TCP socket `pid` holds.
pub fn tcp_fds(pid: i32) -> Vec<(i32, u64)> {
    let tcp = tcp_inodes(pid);
    let mut out = Vec::new();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return out;
    };
    for e in fds.flatten() {
        let Ok(fd) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(link) = std::fs::read_link(e.path()) else {
            continue;
        };
        let link = link.to_string_lossy();
        if let Some(ino) = link
            .strip_prefix("socket:[")
            .and_then(|r| r.strip_suffix(']'))
            .and_then(|v| v.parse::<u64>().ok())
            && tcp.contains(&ino)
        {
            out.push((fd, ino));
        }
    }
    out
}

/// TCP socket states as `/proc/net/tcp` prints them (`st`, hex): those that keep no
/// connection going. Every other state (established, closing, waiting for the peer's
/// FIN…) holds a connection that still uses its local address.
pub const TCP_LISTEN: u8 = 0x0A;
pub const TCP_TIME_WAIT: u8 = 0x06;
pub const TCP_CLOSE: u8 = 0x07;

/// The local address and state of every TCP socket (IPv4 and IPv6) in the network
/// namespace of `pid` (`/proc/<pid>/net/tcp` and `tcp6` show that namespace's). A
/// namespace without IPv6 has no `tcp6`: nothing of it, not an error.
pub fn tcp_states(pid: i32) -> std::io::Result<Vec<(std::net::IpAddr, u8)>> {
    let mut out = parse_net_tcp(&std::fs::read_to_string(format!("/proc/{pid}/net/tcp"))?);
    match std::fs::read_to_string(format!("/proc/{pid}/net/tcp6")) {
        Ok(s) => out.extend(parse_net_tcp(&s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    Ok(out)
}

/// The (local address, state) of each socket line of `/proc/net/tcp` or `tcp6`
/// (`  0: 0100007F:1F90 00000000:0000 0A ...`). The kernel prints an IPv4 address as
/// the 32-bit word it holds in network byte order, read in the machine's own order
/// (`%08X`: `0100007F` is 127.0.0.1 on a little-endian machine), and an IPv6 address as
/// four such words; so each word's bytes in the machine's order are the address's bytes
/// in network order. An IPv4-mapped IPv6 address (a dual-stack socket's IPv4
/// connection) is given as the IPv4 address it maps. Lines that do not parse are
/// skipped.
pub fn parse_net_tcp(text: &str) -> Vec<(std::net::IpAddr, u8)> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let word = |h: &str| u32::from_str_radix(h, 16).ok().map(u32::to_ne_bytes);
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            f.next()?.strip_suffix(':')?;
            let (addr, _port) = f.next()?.split_once(':')?;
            f.next()?;
            let st = u8::from_str_radix(f.next()?, 16).ok()?;
            let ip = match addr.len() {
                8 => IpAddr::V4(Ipv4Addr::from(word(addr)?)),
                32 => {
                    let mut b = [0u8; 16];
                    for (i, chunk) in b.chunks_exact_mut(4).enumerate() {
                        chunk.copy_from_slice(&word(addr.get(8 * i..8 * i + 8)?)?);
                    }
                    let v6 = Ipv6Addr::from(b);
                    v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
                }
                _ => return None,
            };
            Some((ip, st))
        })
        .collect()
}

/// How many TCP sockets of `/proc/net/tcp` or `tcp6` text carry a connection in
/// flight: a connection the kernel accepted that the workload has not (a listener's
/// accept queue, `rx_queue` there), a handshake under way (`SYN_RECV`), or a connection
/// with bytes not yet read by the workload or not yet acknowledged by its peer. An
/// idle connection (a client holding it between requests) is not in flight. Lines
/// that do not parse are skipped.
pub fn in_flight(text: &str) -> usize {
    const SYN_RECV: u8 = 0x03;
    text.lines()
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (Some(st), Some(queues)) = (f.get(3), f.get(4)) else {
                return false;
            };
            let (Ok(st), Some((tx, rx))) = (u8::from_str_radix(st, 16), queues.split_once(':'))
            else {
                return false;
            };
            let (Ok(tx), Ok(rx)) = (u64::from_str_radix(tx, 16), u64::from_str_radix(rx, 16))
            else {
                return false;
            };
            match st {
                // A listener's tx_queue is its backlog's size, not data.
                TCP_LISTEN => rx > 0,
                SYN_RECV => true,
                TCP_TIME_WAIT | TCP_CLOSE => false,
                _ => tx > 0 || rx > 0,
            }
        })
        .count()
}

/// [`in_flight`] of the network namespace of `pid` (IPv4 and IPv6).
pub fn in_flight_of(pid: i32) -> std::io::Result<usize> {
    let mut n = in_flight(&std::fs::read_to_string(format!("/proc/{pid}/net/tcp"))?);
    match std::fs::read_to_string(format!("/proc/{pid}/net/tcp6")) {
        Ok(s) => n += in_flight(&s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_in_flight_are_counted_and_idle_ones_are_not() {
        let head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n";
        let line = |st: &str, q: &str| {
            format!(
                "   0: 0100007F:1F90 0200007F:D2F0 {st} {q} 00:00000000 00000000     0        0 1 1 0 20 4 30 10 -1\n"
            )
        };
        // A listener with an empty accept queue (tx_queue is its backlog: 4096), an
        // idle held connection, a closing one, a TIME_WAIT: nothing in flight.
        let idle = [
            line("0A", "00001000:00000000"),
            line("01", "00000000:00000000"),
            line("06", "00000000:00000000"),
        ]
        .concat();
        assert_eq!(in_flight(&format!("{head}{idle}")), 0);
        // A connection accepted by the kernel only, a handshake, a request unread, an
        // answer unacknowledged: four.
        let busy = [
            line("0A", "00001000:00000001"),
            line("03", "00000000:00000000"),
            line("01", "00000000:00000004"),
            line("01", "00000017:00000000"),
        ]
        .concat();
        assert_eq!(in_flight(&format!("{head}{idle}{busy}")), 4);
        assert_eq!(in_flight("garbage\n0: x y z\n"), 0);
    }

    #[test]
    fn ns_pids_are_read_from_status() {
        let st = "Name:\tapp\nTgid:\t4242\nNSpid:\t4242\t21\t1\nPPid:\t7\n";
        assert_eq!(parse_ns_pids(st), Some(vec![4242, 21, 1]));
        assert_eq!(parse_ns_pids("Name:\tx\n"), None);
        // The reader's own process: one level, itself.
        let me = std::process::id() as i32;
        assert_eq!(ns_pids(me), Some(vec![me]));
    }

    #[test]
    fn a_child_is_found_by_its_pid_in_the_parents_namespace() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let me = std::process::id() as i32;
        let c = child.id() as i32;
        // Same namespace here: the child's PID there is its PID.
        assert_eq!(child_by_ns_pid(me, c), Some(c));
        assert_eq!(child_by_ns_pid(me, c + 1_000_000), None);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn a_process_is_known_by_its_v2_path_or_on_a_legacy_v1_host_by_its_v1_one() {
        let scope = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1_2.slice/cri-containerd-ab.scope";
        // Unified: the only line.
        assert_eq!(
            cgroup_path(&format!("0::{scope}\n")).as_deref(),
            Some(scope)
        );
        // Hybrid: the v2 path, whatever the v1 ones say.
        let hybrid = format!("9:name=systemd:/x\n4:memory:/y\n0::{scope}\n");
        assert_eq!(cgroup_path(&hybrid).as_deref(), Some(scope));
        // Legacy v1 (the v2 hierarchy unused or absent): name=systemd, else memory,
        // else the first hierarchy listed.
        let leaf = "/kubepods/besteffort/pod1-2/ab";
        for text in [
            format!("9:name=systemd:{leaf}\n4:memory:/other\n0::/\n"),
            format!("4:memory:/other\n9:name=systemd:{leaf}\n"),
            format!("3:cpu,cpuacct:/other\n4:memory:{leaf}\n0::/\n"),
            format!("3:cpu,cpuacct:{leaf}\n5:pids:/other\n0::/\n"),
        ] {
            assert_eq!(cgroup_path(&text).as_deref(), Some(leaf), "{text}");
        }
        // A process at every root: "/", which is under no pods root.
        assert_eq!(cgroup_path("1:cpu:/\n0::/\n").as_deref(), Some("/"));
        assert_eq!(cgroup_path("0::/\n").as_deref(), Some("/"));
        assert_eq!(cgroup_path(""), None);
    }

    #[test]
    fn cgroup_v1_memberships_are_found_at_their_hierarchys_mount() {
        let cg = "9:name=systemd:/pm-real-1/kubepods/p/c\n1:cpu,cpuacct:/pm-real-1/kubepods/p/c\n0::/pm-real-1/kubepods/p/c\n";
        let v1 = parse_cgroup_v1(cg);
        assert_eq!(
            v1,
            [
                (
                    "name=systemd".to_owned(),
                    "/pm-real-1/kubepods/p/c".to_owned()
                ),
                (
                    "cpu,cpuacct".to_owned(),
                    "/pm-real-1/kubepods/p/c".to_owned()
                ),
            ]
        );
        let mi = "\
30 25 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:9 - cgroup cgroup rw,cpu,cpuacct
31 25 0:30 / /sys/fs/cgroup/cpuset rw,nosuid shared:10 - cgroup cgroup rw,cpuset
32 25 0:37 / /sys/fs/cgroup/systemd rw,nosuid shared:14 - cgroup cgroup rw,xattr,name=systemd
40 25 0:29 /pm-real-0/kubepods /mnt/elsewhere rw - cgroup cgroup rw,cpu,cpuacct
";
        assert_eq!(
            cgroup_v1_mount(mi, "cpu,cpuacct"),
            Some(PathBuf::from("/sys/fs/cgroup/cpu,cpuacct"))
        );
        assert_eq!(
            cgroup_v1_mount(mi, "name=systemd"),
            Some(PathBuf::from("/sys/fs/cgroup/systemd"))
        );
        assert_eq!(
            cgroup_v1_mount(mi, "cpu"),
            None,
            "cpu alone is not cpu,cpuacct"
        );
        assert_eq!(cgroup_v1_mount(mi, "memory"), None);
    }

    #[test]
    fn start_time_survives_hostile_comm() {
        let stat = "42 (a) b) (c) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 10";
        assert_eq!(parse_start_time(stat), Some(98765));
    }

    #[test]
    fn own_process_is_live_and_a_wrong_start_time_is_reuse() {
        let me = std::process::id() as i32;
        let st = start_time(me).unwrap();
        assert!(
            check_live(ProcRef {
                pid: me,
                start_time: st
            })
            .is_ok()
        );
        assert_eq!(
            check_live(ProcRef {
                pid: me,
                start_time: st + 1
            })
            .unwrap_err()
            .kind,
            ErrorKind::PidReused
        );
    }
    /// `/proc/net/tcp` text for sockets, each word written the way the kernel does.
    fn net_tcp_line(i: usize, local: std::net::IpAddr, port: u16, st: u8) -> String {
        let words: Vec<[u8; 4]> = match local {
            std::net::IpAddr::V4(a) => vec![a.octets()],
            std::net::IpAddr::V6(a) => a
                .octets()
                .chunks_exact(4)
                .map(|c| c.try_into().unwrap())
                .collect(),
        };
        let hex: String = words
            .iter()
            .map(|w| format!("{:08X}", u32::from_ne_bytes(*w)))
            .collect();
        format!(
            "{i:4}: {hex}:{port:04X} 00000000:0000 {st:02X} 00000000:00000000 00:00000000 00000000     0        0 {} 1 0000000000000000 100 0 0 10 0",
            1000 + i
        )
    }

    #[test]
    fn tcp_sockets_are_read_with_their_local_address_and_state() {
        use std::net::IpAddr;
        let header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode";
        let socks: Vec<(IpAddr, u8)> = vec![
            ("198.18.2.20".parse().unwrap(), 0x01),
            ("127.0.0.1".parse().unwrap(), TCP_LISTEN),
            ("2001:db8:1:2:3:4:5:6".parse().unwrap(), 0x08),
            ("fe80::1234:5678".parse().unwrap(), TCP_TIME_WAIT),
        ];
        let mut text = format!("{header}\n");
        for (i, (a, st)) in socks.iter().enumerate() {
            text += &net_tcp_line(i, *a, 8080, *st);
            text += "\n";
        }
        // A dual-stack socket's IPv4 connection, in tcp6, is its IPv4 address.
        text += &net_tcp_line(9, "::ffff:198.18.2.20".parse().unwrap(), 80, 0x01);
        text += "\ngarbage line\n";
        let mut want = socks.clone();
        want.push(("198.18.2.20".parse().unwrap(), 0x01));
        assert_eq!(parse_net_tcp(&text), want);
    }

    /// What this machine's kernel prints (little-endian x86): byte order as read.
    #[cfg(target_endian = "little")]
    #[test]
    fn tcp_addresses_are_read_in_the_kernels_byte_order() {
        let v4 = "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0";
        assert_eq!(
            parse_net_tcp(v4),
            [("127.0.0.1".parse().unwrap(), TCP_LISTEN)]
        );
        let v6 = "   0: B80D0120000000000000000001000000:1F90 00000000000000000000000000000000:0000 01 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0";
        assert_eq!(parse_net_tcp(v6), [("2001:db8::1".parse().unwrap(), 0x01)]);
    }

    #[test]
    fn the_tcp_sockets_of_our_own_namespace_are_read() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let me = std::process::id() as i32;
        let states = tcp_states(me).unwrap();
        assert!(
            states.contains(&("127.0.0.1".parse().unwrap(), TCP_LISTEN)),
            "{states:?}"
        );
        drop(l);
    }
}
