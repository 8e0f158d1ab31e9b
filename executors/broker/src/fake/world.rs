//! The simulated node's state: processes, network namespaces, mounts, journal files,
//! clocks and the effects recorded on them; the standard world and its constants.

use nix::sys::signal::Signal;
use podmotion_wire::broker::SocketAddrs;
use podmotion_wire::ids::ContainerId;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sock {
    pub fd: i32,
    pub ino: u64,
    pub repair: bool,
    /// What `list_sockets` reads of it.
    pub addrs: SocketAddrs,
}

impl Sock {
    /// Socket `fd` of `pid` in network namespace `netns` (inode `ino`, not in repair).
    /// Its addresses follow from the descriptor number: `fd % 3 == 0` listens on
    /// `10.0.<netns>.5:<8000+fd>`; `1` is connected from `10.0.<netns>.5:8080` to
    /// `198.51.100.<pid % 250>:<40000+fd>`; `2` from `[2001:db8:<netns>::5]:8443` to
    /// `[2001:db8:ffff::<pid>]:<40000+fd>` (the pod addresses of [`World::standard`]).
    pub fn new(pid: i32, fd: i32, ino: u64, netns: u32) -> Sock {
        let at = |s: String| Some(s.parse().expect("a socket address"));
        let n = netns % 256;
        let (local, remote) = match fd % 3 {
            0 => (format!("10.0.{n}.5:{}", 8000 + fd), None),
            1 => (
                format!("10.0.{n}.5:8080"),
                at(format!("198.51.100.{}:{}", pid % 250, 40000 + fd)),
            ),
            _ => (
                format!("[2001:db8:{n}::5]:8443"),
                at(format!("[2001:db8:ffff::{pid}]:{}", 40000 + fd)),
            ),
        };
        Sock {
            fd,
            ino,
            repair: false,
            addrs: SocketAddrs {
                listening: remote.is_none(),
                local: at(local),
                remote,
            },
        }
    }
}

#[derive(Clone, Debug)]
pub struct Proc {
    pub ppid: i32,
    pub start_time: u64,
    pub cgroup: String,
    pub netns: u32,
    pub tracer: i32,
    pub stopped: bool,
    pub zombie: bool,
    pub sockets: Vec<Sock>,
}

/// One network namespace: links (up or not), routes as `ip route show` prints them,
/// addresses as (cidr, link).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Net {
    pub links: BTreeMap<String, bool>,
    pub routes4: Vec<String>,
    pub routes6: Vec<String>,
    pub addrs4: BTreeSet<(String, String)>,
    pub addrs6: BTreeSet<(String, String)>,
    /// `arp_ignore` of each link that was set (0, the kernel's default, otherwise).
    pub arp_ignore: BTreeMap<String, u8>,
    /// nftables tables (`inet` family) by name, each with its body as written.
    pub nft: BTreeMap<String, String>,
}

impl Net {
    /// Order-insensitive view, for comparing with a baseline.
    pub fn canonical(&self) -> Net {
        let mut n = self.clone();
        n.routes4.sort();
        n.routes6.sort();
        n
    }
}

/// What the broker did to the world (`ReadAddrs`: it read the addresses of socket `fd`
/// of `pid`, for `list_sockets`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    Signal {
        pid: i32,
        sig: Signal,
    },
    ReadAddrs {
        pid: i32,
        fd: i32,
    },
    RepairOff {
        pid: i32,
        fd: i32,
    },
    Moved {
        pid: i32,
        to: String,
    },
    /// `pid` written into the memory cgroup `to` (`charge_restore`).
    Charged {
        pid: i32,
        to: String,
    },
    LinkDown {
        netns: u32,
        link: String,
    },
    /// A gratuitous ARP for `addr` out of `link` of `netns`.
    Announced {
        netns: u32,
        link: String,
        addr: String,
    },
    Mounted {
        path: PathBuf,
        netns: u32,
    },
    /// `addr` (a host address, `/32` or `/128`) added to `link` of `netns`.
    AddrAdded {
        netns: u32,
        link: String,
        addr: IpAddr,
    },
    /// `addr` (a host address) removed from `link` of `netns`.
    AddrRemoved {
        netns: u32,
        link: String,
        addr: IpAddr,
    },
    /// The node told to forget unanswered connections to `addrs`.
    Swept {
        addrs: Vec<IpAddr>,
    },
    /// A hold of new connections started in chain `chain`.
    HoldStarted {
        chain: String,
        held: crate::synhold::Held,
    },
    /// The hold of `chain` ended, its SYNs released or dropped.
    HoldEnded {
        chain: String,
        how: crate::synhold::End,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The n-th next `ip` call fails (0 = the next one).
    Ip(u8),
    Mount,
    Journal,
    Cgroup,
    /// The next gratuitous ARP cannot be sent.
    Announce,
    /// The next `nft` transaction fails (nothing of it applied).
    Nft,
}

#[derive(Debug)]
pub struct World {
    pub procs: BTreeMap<i32, Proc>,
    pub nets: BTreeMap<u32, Net>,
    pub node_netns: u32,
    pub broker_pid: i32,
    pub mounts: BTreeMap<PathBuf, u32>,
    pub files: BTreeMap<PathBuf, Vec<u8>>,
    /// Paths where a symlink was planted (the mount point or a directory).
    pub symlinks: BTreeSet<PathBuf>,
    pub effects: Vec<Effect>,
    /// Every sweep of unanswered connections started, on while its lock holds.
    pub sweeps: Vec<crate::conntrack::SweepFlag>,
    /// The holds of new connections running, by chain.
    pub holds: BTreeMap<String, crate::synhold::Held>,
    pub fault: Option<Fault>,
    pub clock: Duration,
    /// CRIU detaches from every tree the first time the broker waits for it.
    pub detach_on_sleep: bool,
    pub next_pid: i32,
    pub next_ino: u64,
}

pub(super) fn net(n: u32, links: &[&str]) -> Net {
    let mut x = Net::default();
    x.links.insert("lo".into(), true);
    for l in links {
        x.links.insert((*l).into(), true);
    }
    let dev = links[0];
    x.routes4 = vec![
        format!("default via 10.0.{n}.1 dev {dev}"),
        format!("10.0.{n}.0/24 dev {dev} proto kernel scope link src 10.0.{n}.5"),
    ];
    x.routes6 = vec![
        format!("default via 2001:db8:{n}::1 dev {dev} metric 1024 pref medium"),
        format!("2001:db8:{n}::/64 dev {dev} proto kernel metric 256 pref medium"),
    ];
    for (i, l) in links.iter().enumerate() {
        x.addrs4.insert((format!("10.{i}.{n}.5/24"), (*l).into()));
        x.addrs6
            .insert((format!("2001:db8:{n}:{i}::5/64"), (*l).into()));
    }
    if links.len() > 1 {
        x.routes4
            .push(format!("10.9.{n}.0/24 dev {} scope link", links[1]));
    }
    x
}

impl World {
    /// The standard node: the pods cgroup root is `/kubepods`; a process's container is
    /// the last component of its cgroup (cgroupfs driver: `pause`, `app`, `agent`…;
    /// see [`World::container_of`]).
    ///
    /// | pid | what | cgroup | netns |
    /// |---|---|---|---|
    /// | 1 | init | /init.scope | node (1) |
    /// | 2 | the broker | /kubepods/podB/broker | 2 |
    /// | 50 | containerd-shim | /system.slice/containerd | node |
    /// | 60 | kubelet | /system.slice/kubelet | node |
    /// | 70 | a hostNetwork pod's process | /kubepods/podH/app | node |
    /// | 80 | another tenant's pod | /kubepods/podX/app | 30 |
    /// | 100 | source pod's pause | /kubepods/podA/pause | 10 |
    /// | 101 (→102) | source workload tree, TCP sockets | /kubepods/podA/app | 10 |
    /// | 200 | target pod's holder (pause) | /kubepods/podC/pause | 20 |
    /// | 201 (→202) | restored tree (agent's cgroup) | /kubepods/podB/agent | 20 |
    /// | 210 | a process of the agent's pod | /kubepods/podB/agent | 2 |
    pub fn standard() -> World {
        let mut w = World {
            procs: BTreeMap::new(),
            nets: BTreeMap::new(),
            node_netns: 1,
            broker_pid: 2,
            mounts: BTreeMap::new(),
            files: BTreeMap::new(),
            symlinks: BTreeSet::new(),
            effects: Vec::new(),
            sweeps: Vec::new(),
            holds: BTreeMap::new(),
            fault: None,
            clock: Duration::ZERO,
            detach_on_sleep: false,
            next_pid: 300,
            next_ino: 9000,
        };
        w.nets.insert(1, net(1, &["eth0"]));
        w.nets.insert(2, net(2, &["eth0"]));
        w.nets.insert(10, net(10, &["eth0", "pm0"]));
        w.nets.insert(20, net(20, &["eth0"]));
        w.nets.insert(30, net(30, &["eth0"]));
        let table: &[(i32, i32, &str, u32, &[i32])] = &[
            (1, 0, "/init.scope", 1, &[]),
            (2, 50, "/kubepods/podB/broker", 2, &[]),
            (50, 1, "/system.slice/containerd", 1, &[]),
            (60, 1, "/system.slice/kubelet", 1, &[7]),
            (70, 50, "/kubepods/podH/app", 1, &[3]),
            (80, 50, "/kubepods/podX/app", 30, &[3]),
            (100, 50, "/kubepods/podA/pause", 10, &[]),
            (101, 50, "/kubepods/podA/app", 10, &[3, 4]),
            (102, 101, "/kubepods/podA/app", 10, &[5]),
            (200, 50, "/kubepods/podC/pause", 20, &[]),
            (201, 50, "/kubepods/podB/agent", 20, &[6]),
            (202, 201, "/kubepods/podB/agent", 20, &[]),
            (210, 50, "/kubepods/podB/agent", 2, &[]),
        ];
        for (pid, ppid, cg, ns, fds) in table {
            let sockets = fds
                .iter()
                .map(|fd| Sock::new(*pid, *fd, 1000 + (*pid as u64) * 10 + *fd as u64, *ns))
                .collect();
            w.procs.insert(
                *pid,
                Proc {
                    ppid: *ppid,
                    start_time: (*pid as u64) * 10 + 7,
                    cgroup: (*cg).into(),
                    netns: *ns,
                    tracer: 0,
                    stopped: false,
                    zombie: false,
                    sockets,
                },
            );
        }
        w
    }

    /// The container `pid` runs in, as an agent names it: the last component of its
    /// cgroup (`app` for a pid that does not exist).
    pub fn container_of(&self, pid: i32) -> ContainerId {
        self.procs
            .get(&pid)
            .and_then(|p| ContainerId::parse(p.cgroup.rsplit('/').next()?).ok())
            .unwrap_or_else(|| ContainerId::parse("app").expect("valid container id"))
    }

    /// A container `pid` does not run in (`pause`, or `app` for a pause process).
    pub fn other_container(&self, pid: i32) -> ContainerId {
        let other = if self.container_of(pid).as_str() == "pause" {
            "app"
        } else {
            "pause"
        };
        ContainerId::parse(other).expect("valid container id")
    }

    /// The links up in network namespace `netns`, by name.
    pub fn links_up(&self, netns: u32) -> Vec<String> {
        self.nets[&netns]
            .links
            .iter()
            .filter(|(_, up)| **up)
            .map(|(l, _)| l.clone())
            .collect()
    }

    /// The tree rooted at `root` (root first), as the kernel layer reports it.
    pub fn tree(&self, root: i32) -> Vec<i32> {
        tree_in(&self.procs, root)
    }

    /// CRIU dumps the tree: every live process stopped and traced, its sockets in repair.
    pub(super) fn dump(&mut self, pid: i32) {
        for p in self.tree(pid) {
            if let Some(x) = self.procs.get_mut(&p).filter(|x| !x.zombie) {
                x.stopped = true;
                x.tracer = 9999;
                for s in &mut x.sockets {
                    s.repair = true;
                }
            }
        }
    }

    /// CRIU lets go of the tree.
    pub(super) fn detach(&mut self, pid: i32) {
        for p in self.tree(pid) {
            if let Some(x) = self.procs.get_mut(&p) {
                x.tracer = 0;
            }
        }
    }

    /// `pid` exits and is reaped; its children go to init.
    pub(super) fn exit(&mut self, pid: i32) {
        self.procs.remove(&pid);
        for x in self.procs.values_mut() {
            if x.ppid == pid {
                x.ppid = 1;
            }
        }
    }

    /// `pid` is reused by a new process shaped like `like` (same cgroup and netns, a new
    /// start time, no sockets).
    pub(super) fn reuse(&mut self, pid: i32, like: i32) {
        let Some(mut x) = self.procs.get(&like).cloned() else {
            return;
        };
        // The old process's children were reparented when it exited.
        self.exit(pid);
        x.start_time = 100_000 + self.next_ino;
        self.next_ino += 1;
        x.ppid = 50;
        x.zombie = false;
        x.stopped = false;
        x.tracer = 0;
        x.sockets.clear();
        self.procs.insert(pid, x);
    }

    /// A live `parent` forks a child with one TCP socket (up to 40 processes).
    pub(super) fn spawn(&mut self, parent: i32) {
        let Some(mut x) = self.live(parent).cloned() else {
            return;
        };
        if self.procs.len() > 40 {
            return;
        }
        let pid = self.next_pid;
        self.next_pid += 1;
        let ino = self.next_ino;
        self.next_ino += 1;
        x.ppid = parent;
        x.start_time = 100_000 + ino;
        x.sockets = vec![Sock::new(pid, 3, ino, x.netns)];
        self.procs.insert(pid, x);
    }

    pub(super) fn live(&self, pid: i32) -> Option<&Proc> {
        self.procs.get(&pid).filter(|p| !p.zombie)
    }

    /// A live `pid` opens a TCP connection from `local` (port 9000 up) to a client:
    /// what a restored tree holds on an adopted address.
    pub(super) fn connect(&mut self, pid: i32, local: IpAddr) {
        let ino = self.next_ino;
        let Some(p) = self.procs.get_mut(&pid).filter(|p| !p.zombie) else {
            return;
        };
        if p.sockets.len() >= 8 {
            return;
        }
        self.next_ino += 1;
        let fd = 100 + ino as i32 % 1000;
        let port = 9000 + (ino % 1000) as u16;
        p.sockets.push(Sock {
            fd,
            ino,
            repair: false,
            addrs: SocketAddrs {
                local: Some(std::net::SocketAddr::new(local, port)),
                remote: Some("[2001:db8:ffff::9]:50000".parse().expect("an address")),
                listening: false,
            },
        });
    }

    pub(super) fn take_fault(&mut self, f: impl Fn(Fault) -> bool) -> bool {
        if self.fault.is_some_and(&f) {
            self.fault = None;
            return true;
        }
        false
    }
}

/// The pods cgroup root of [`World::standard`].
pub const PODS_ROOT: &str = "/kubepods";
/// The run directory the harness's broker is configured with (nothing is written
/// there: the fake keeps files and mounts in memory).
pub const RUN_DIR: &str = "/fake/run";
/// The migration UIDs ops name, by index.
pub const UIDS: [&str; 3] = ["mig-a", "mig-b", "mig-c"];
/// What the fake's wall clock reads at its start (unix seconds).
pub const UNIX_EPOCH_AT_START: u64 = 1_800_000_000;
/// The hand-over CIDRs of the harness's broker ([`config`]).
pub const HANDOVER_CIDRS: &str = "10.0.0.0/15,2001:db8::/32";
/// How long the harness's broker lets an adopted address linger, at most.
pub const LINGER_SECS: u64 = 600;
/// The addresses `adopt_address`, `release_address` and connections name, by index:
/// the source pod's (netns 10: `eth0`, `pm0`, both families), the target's own (netns
/// 20), nobody's, and addresses the broker must never adopt (outside the CIDRs,
/// loopback, unspecified, multicast, link-local, IPv4-mapped, broadcast).
pub const ADDRESSES: [&str; 16] = [
    "10.0.10.5",
    "10.1.10.5",
    "2001:db8:10::5",
    "2001:db8:10:1::5",
    "10.0.20.5",
    "10.0.99.7",
    "2001:db8:99::7",
    "10.2.10.5",
    "192.0.2.1",
    "127.0.0.1",
    "0.0.0.0",
    "224.0.0.1",
    "169.254.1.1",
    "fe80::1",
    "::ffff:10.0.10.5",
    "255.255.255.255",
];

/// Address `i` of [`ADDRESSES`].
pub fn address(i: u8) -> IpAddr {
    ADDRESSES[usize::from(i) % ADDRESSES.len()]
        .parse()
        .expect("an address")
}

/// Whether the harness's broker may adopt `a`: its own reading of [`HANDOVER_CIDRS`]
/// (10.0.0.0/15, 2001:db8::/32) and of the addresses that are never a pod's, kept
/// apart from the broker's code on purpose.
pub fn may_adopt(a: IpAddr) -> bool {
    match a {
        IpAddr::V4(v) => {
            let o = v.octets();
            o[0] == 10 && o[1] <= 1
        }
        IpAddr::V6(v) => {
            let s = v.segments();
            s[0] == 0x2001 && s[1] == 0x0db8
        }
    }
}

/// The tree rooted at `root` in a process table (root first).
pub(super) fn tree_in(procs: &BTreeMap<i32, Proc>, root: i32) -> Vec<i32> {
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        i += 1;
        for (c, x) in procs {
            if x.ppid == p && !out.contains(c) {
                out.push(*c);
            }
        }
    }
    out
}
