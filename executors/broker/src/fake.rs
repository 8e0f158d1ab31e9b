//! A simulated node for driving [`crate::Broker`] without touching a real process:
//! [`FakeKernel`] implements [`Kernel`] over a small world — a table of processes
//! (pid, parent, start time, cgroup, network namespace, tracer, stopped, TCP sockets),
//! network namespaces with links, IPv4/IPv6 routes and addresses (enough of `ip` to
//! lock and restore them), bind mounts, journal files and a virtual clock — and
//! records every effect the broker has on it. [`Harness`] runs a sequence of [`Op`]s
//! (requests from two agent connections, and the world's own events: CRIU stopping
//! and releasing a tree, processes exiting and pids being reused, connections opened
//! on an address, faults, lease loss, a broker restart, time passing and the sweep of
//! adopted addresses) against one broker and checks the invariants after every step;
//! the fuzz target `fuzz/fuzz_targets/dispatch.rs` and the unit tests drive it.

use crate::handover::{Adoption, parse_cidrs, parse_journal_body};
use crate::os::{Ip, Kernel, Link};
use crate::{Broker, Config, under_pods_root};
use nix::sys::signal::Signal;
use podmotion_wire::broker::{BrokerError, BrokerRole, ErrorKind, Reply, Request, SocketAddrs};
use podmotion_wire::ids::{ContainerId, MigrationUid, ProcRef};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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
    pub fault: Option<Fault>,
    pub clock: Duration,
    /// CRIU detaches from every tree the first time the broker waits for it.
    pub detach_on_sleep: bool,
    pub next_pid: i32,
    pub next_ino: u64,
}

fn net(n: u32, links: &[&str]) -> Net {
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
    fn dump(&mut self, pid: i32) {
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
    fn detach(&mut self, pid: i32) {
        for p in self.tree(pid) {
            if let Some(x) = self.procs.get_mut(&p) {
                x.tracer = 0;
            }
        }
    }

    /// `pid` exits and is reaped; its children go to init.
    fn exit(&mut self, pid: i32) {
        self.procs.remove(&pid);
        for x in self.procs.values_mut() {
            if x.ppid == pid {
                x.ppid = 1;
            }
        }
    }

    /// `pid` is reused by a new process shaped like `like` (same cgroup and netns, a new
    /// start time, no sockets).
    fn reuse(&mut self, pid: i32, like: i32) {
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
    fn spawn(&mut self, parent: i32) {
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

    fn live(&self, pid: i32) -> Option<&Proc> {
        self.procs.get(&pid).filter(|p| !p.zombie)
    }

    /// A live `pid` opens a TCP connection from `local` (port 9000 up) to a client:
    /// what a restored tree holds on an adopted address.
    fn connect(&mut self, pid: i32, local: IpAddr) {
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

    fn take_fault(&mut self, f: impl Fn(Fault) -> bool) -> bool {
        if self.fault.is_some_and(&f) {
            self.fault = None;
            return true;
        }
        false
    }
}

/// The [`Kernel`] over a shared [`World`] (clone it to give a restarted broker the
/// same node).
#[derive(Clone)]
pub struct FakeKernel {
    world: Arc<Mutex<World>>,
    epoch: Instant,
    /// `in_netns` calls held on purpose ([`FakeKernel::pause_in_netns`]), by pid: how
    /// the call reports its arrival, and what it waits on.
    pauses: Arc<Mutex<BTreeMap<i32, Held>>>,
}

/// A held call's side of a [`Pause`]: how it reports its arrival, what it waits on.
type Held = (Sender<()>, Receiver<()>);

/// A slow kernel call ([`FakeKernel::pause_in_netns`]): held until released or dropped.
pub struct Pause {
    arrived: Receiver<()>,
    release: Sender<()>,
}

impl Pause {
    /// Whether the held call arrived within `timeout` (it is waiting now if so).
    pub fn arrived(&self, timeout: Duration) -> bool {
        self.arrived.recv_timeout(timeout).is_ok()
    }

    /// Lets the held call go on (dropping the pause does too).
    pub fn release(self) {
        let _ = self.release.send(());
    }
}

impl FakeKernel {
    pub fn new(world: World) -> Self {
        Self {
            world: Arc::new(Mutex::new(world)),
            epoch: Instant::now(),
            pauses: Arc::default(),
        }
    }

    /// Holds the next `in_netns` call for `pid` (the `ip` work in that process's
    /// network namespace: a lock, an unlock, an address read) before it touches the
    /// world, until the returned [`Pause`] is released: a slow kernel, for tests.
    pub fn pause_in_netns(&self, pid: i32) -> Pause {
        let (arrive, arrived) = channel();
        let (release, wait) = channel();
        self.pauses
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(pid, (arrive, wait));
        Pause { arrived, release }
    }

    pub fn world(&self) -> MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn no_such(pid: i32) -> BrokerError {
    BrokerError::new(ErrorKind::NoSuchProcess, format!("pid {pid} is not alive"))
}

fn kernel_err(m: impl Into<String>) -> BrokerError {
    BrokerError::new(ErrorKind::Kernel, m)
}

struct FakeIp<'a> {
    w: &'a mut World,
    ns: u32,
}

fn dev_of(words: &[&str]) -> Option<String> {
    words
        .iter()
        .position(|w| *w == "dev")
        .and_then(|i| words.get(i + 1))
        .map(|s| (*s).to_owned())
}

impl Ip for FakeIp<'_> {
    /// The few `ip` commands the broker runs, over the process's [`Net`]; anything
    /// else fails as unsupported.
    fn ip(&mut self, args: &[&str]) -> std::io::Result<String> {
        let fail = |m: &str| Err(std::io::Error::other(format!("ip {}: {m}", args.join(" "))));
        if let Some(Fault::Ip(n)) = self.w.fault {
            if n == 0 {
                self.w.fault = None;
                return fail("injected failure");
            }
            self.w.fault = Some(Fault::Ip(n - 1));
        }
        let ns = self.ns;
        let n = self.w.nets.get_mut(&ns).expect("netns of a process");
        let done = |r: Result<(), &str>| r.map(|()| String::new()).or_else(fail);
        match args {
            ["-4", "route", "show"] => Ok(lines(&n.routes4)),
            ["-6", "route", "show"] => Ok(lines(&n.routes6)),
            ["-o", "link", "show", "up"] => Ok(n.links_up()),
            ["-6", "-o", "addr", "show", "scope", "global"] => Ok(n.global_addrs6()),
            ["-o", "addr", "show"] => Ok(n.addrs()),
            ["-o", "link", "show"] => Ok(n.links_all(ns)),
            ["link", "set", "dev", link, state @ ("up" | "down")] => {
                let r = n.set_link(link, *state == "up");
                if r.is_ok() && *state == "down" && *link != "lo" {
                    self.w.effects.push(Effect::LinkDown {
                        netns: ns,
                        link: (*link).to_owned(),
                    });
                }
                done(r)
            }
            ["-6", "addr", "replace", addr, "dev", link, "nodad"] => {
                done(n.replace_addr6(addr, link))
            }
            ["-4", "addr", op @ ("add" | "del"), cidr, "dev", link]
            | ["-6", "addr", op @ ("add" | "del"), cidr, "dev", link]
            | ["-6", "addr", op @ "add", cidr, "dev", link, "nodad"] => {
                let v4 = args[0] == "-4";
                let add = *op == "add";
                let r = n.host_addr(v4, add, cidr, link);
                if let Ok(addr) = &r {
                    let (netns, link) = (ns, (*link).to_owned());
                    self.w.effects.push(if add {
                        Effect::AddrAdded {
                            netns,
                            link,
                            addr: *addr,
                        }
                    } else {
                        Effect::AddrRemoved {
                            netns,
                            link,
                            addr: *addr,
                        }
                    });
                }
                done(r.map(|_| ()))
            }
            [family @ ("-4" | "-6"), "route", "replace", route @ ..] => {
                done(n.replace_route(*family == "-4", route))
            }
            _ => fail("unsupported by the fake"),
        }
    }

    /// Recorded; refused for a link that is down or has no such index (as the kernel
    /// would drop or refuse the frame).
    fn announce(&mut self, link: &Link, addr: std::net::IpAddr) -> std::io::Result<()> {
        if self.w.take_fault(|f| f == Fault::Announce) {
            return Err(std::io::Error::other("announce: injected failure"));
        }
        let ns = self.ns;
        let n = &self.w.nets[&ns];
        if n.links.get(&link.name) != Some(&true) || n.index(&link.name) as i32 != link.index {
            return Err(std::io::Error::other(format!(
                "announce on {}: no such link up",
                link.name
            )));
        }
        if addr.is_ipv4() && n.arp_ignore.get(&link.name).is_some_and(|v| *v >= 8) {
            // The neighbours would learn the address and then get no answer to their
            // next ARP request: an announcement comes after the link answers again.
            return Err(std::io::Error::other(format!(
                "announce of {addr} on {}, which answers no ARP request",
                link.name
            )));
        }
        self.w.effects.push(Effect::Announced {
            netns: ns,
            link: link.name.clone(),
            addr: addr.to_string(),
        });
        Ok(())
    }

    fn arp_ignore(&mut self, link: &str, value: u8) -> std::io::Result<u8> {
        let n = self.w.nets.get_mut(&self.ns).expect("netns of a process");
        if !n.links.contains_key(link) {
            return Err(std::io::Error::other(format!("no such link {link}")));
        }
        let was = n.arp_ignore.insert(link.to_owned(), value).unwrap_or(0);
        if value == 0 {
            n.arp_ignore.remove(link);
        }
        Ok(was)
    }
}

/// Whether `cidr` (`<addr>/<len>`) is the address `addr`, however either is written.
fn same_addr(cidr: &str, addr: &str) -> bool {
    let ip = |s: &str| s.parse::<std::net::IpAddr>().ok();
    cidr.split('/')
        .next()
        .and_then(ip)
        .is_some_and(|a| Some(a) == ip(addr))
}

/// One line per entry, as `ip route show` prints routes.
fn lines(v: &[String]) -> String {
    v.iter().map(|r| format!("{r}\n")).collect()
}

impl Net {
    /// A link's 1-based index (`ip -o` prints it first).
    fn index(&self, l: &str) -> usize {
        self.links.keys().position(|k| k == l).unwrap_or(0) + 1
    }

    /// `ip -o link show up`: the links up, veths as `<name>@if<peer>`.
    fn links_up(&self) -> String {
        self.links
            .iter()
            .filter(|(_, up)| **up)
            .map(|(l, _)| {
                let i = self.index(l);
                let name = if l == "lo" {
                    "lo".to_owned()
                } else {
                    format!("{l}@if{}", i + 40)
                };
                format!("{i}: {name}: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 state UP\n")
            })
            .collect()
    }

    /// `ip -6 -o addr show scope global`: the global IPv6 addresses of links up.
    fn global_addrs6(&self) -> String {
        self.addrs6
            .iter()
            .filter(|(_, l)| self.links.get(l) == Some(&true))
            .map(|(a, l)| {
                format!(
                    "{}: {l}    inet6 {a} scope global \\       valid_lft forever\n",
                    self.index(l)
                )
            })
            .collect()
    }

    /// `ip -o link show`: every link, `lo` as loopback, the others as Ethernet links
    /// with the MAC `02:00:00:<netns>:00:<index>`.
    fn links_all(&self, ns: u32) -> String {
        self.links
            .iter()
            .map(|(l, up)| {
                let i = self.index(l);
                let flags = if *up { "UP,LOWER_UP" } else { "" };
                if l == "lo" {
                    format!(
                        "{i}: lo: <LOOPBACK,{flags}> mtu 65536 \\    link/loopback 00:00:00:00:00:00 brd 00:00:00:00:00:00\n"
                    )
                } else {
                    format!(
                        "{i}: {l}@if{}: <BROADCAST,MULTICAST,{flags}> mtu 1500 \\    link/ether 02:00:00:{:02x}:00:{i:02x} brd ff:ff:ff:ff:ff:ff\n",
                        i + 40,
                        ns % 256
                    )
                }
            })
            .collect()
    }

    /// `ip -o addr show`: every IPv4 and IPv6 address.
    fn addrs(&self) -> String {
        let mut out = String::new();
        for (a, l) in &self.addrs4 {
            out += &format!("{}: {l}    inet {a} scope global {l}\n", self.index(l));
        }
        for (a, l) in &self.addrs6 {
            out += &format!("{}: {l}    inet6 {a} scope global\n", self.index(l));
        }
        out
    }

    /// `ip link set dev LINK up|down`: a link going down (not `lo`) takes its routes
    /// and IPv6 addresses with it, as the kernel does.
    fn set_link(&mut self, link: &str, up: bool) -> Result<(), &'static str> {
        let Some(state) = self.links.get_mut(link) else {
            return Err("Cannot find device");
        };
        *state = up;
        if !up && link != "lo" {
            let via = |r: &String| {
                dev_of(&r.split_whitespace().collect::<Vec<_>>()).as_deref() != Some(link)
            };
            self.routes4.retain(via);
            self.routes6.retain(via);
            self.addrs6.retain(|(_, l)| l != link);
        }
        Ok(())
    }

    /// `ip -4|-6 addr add|del ADDR/32|128 dev LINK`: a host address (the hand-over's)
    /// added (refused if the address is there already) or removed (refused if it is not
    /// there). The address, on success.
    fn host_addr(
        &mut self,
        v4: bool,
        add: bool,
        cidr: &str,
        link: &str,
    ) -> Result<IpAddr, &'static str> {
        let (a, len) = cidr.split_once('/').ok_or("no prefix length")?;
        let addr: IpAddr = a.parse().map_err(|_| "invalid address")?;
        if addr.is_ipv4() != v4 || len != if v4 { "32" } else { "128" } {
            return Err("not a host address of the family");
        }
        if !self.links.contains_key(link) {
            return Err("Cannot find device");
        }
        let set = if v4 {
            &mut self.addrs4
        } else {
            &mut self.addrs6
        };
        let entry = (cidr.to_owned(), link.to_owned());
        if add {
            if set.iter().any(|(c, _)| same_addr(c, a)) {
                return Err("RTNETLINK answers: File exists");
            }
            set.insert(entry);
        } else if !set.remove(&entry) {
            return Err("RTNETLINK answers: Cannot assign requested address");
        }
        Ok(addr)
    }

    /// `ip -6 addr replace ADDR dev LINK nodad`.
    fn replace_addr6(&mut self, addr: &str, link: &str) -> Result<(), &'static str> {
        if !self.links.contains_key(link) {
            return Err("Cannot find device");
        }
        self.addrs6.insert((addr.to_owned(), link.to_owned()));
        Ok(())
    }

    /// `ip -4|-6 route replace ROUTE…`: over a link that is up, through a gateway only
    /// once the link's connected route is there; replaces the route to the same
    /// destination.
    fn replace_route(&mut self, v4: bool, route: &[&str]) -> Result<(), &'static str> {
        let Some(dev) = dev_of(route) else {
            return Err("no dev");
        };
        if self.links.get(&dev) != Some(&true) {
            return Err("Nexthop device is not up");
        }
        let table = if v4 {
            &mut self.routes4
        } else {
            &mut self.routes6
        };
        // A gateway needs a route to it first (the link's connected route).
        if route.contains(&"via")
            && !table
                .iter()
                .any(|r| !r.contains(" via ") && r.contains(&format!("dev {dev}")))
        {
            return Err("Nexthop has invalid gateway");
        }
        let line = route.join(" ");
        table.retain(|r| r.split_whitespace().next() != route.first().copied());
        table.push(line);
        Ok(())
    }
}

impl Kernel for FakeKernel {
    fn self_pid(&self) -> i32 {
        self.world().broker_pid
    }

    fn start_time(&self, pid: i32) -> Result<u64, BrokerError> {
        self.world()
            .procs
            .get(&pid)
            .map(|p| p.start_time)
            .ok_or_else(|| no_such(pid))
    }

    fn is_zombie(&self, pid: i32) -> Result<bool, BrokerError> {
        self.world()
            .procs
            .get(&pid)
            .map(|p| p.zombie)
            .ok_or_else(|| no_such(pid))
    }

    fn cgroup_of(&self, pid: i32) -> Result<String, BrokerError> {
        self.world()
            .procs
            .get(&pid)
            .map(|p| p.cgroup.clone())
            .ok_or_else(|| no_such(pid))
    }

    fn netns_inode(&self, pid: i32) -> Result<String, BrokerError> {
        self.world()
            .live(pid)
            .map(|p| format!("net:[{}]", p.netns))
            .ok_or_else(|| no_such(pid))
    }

    fn node_netns(&self) -> String {
        format!("net:[{}]", self.world().node_netns)
    }

    fn tracer_pid(&self, pid: i32) -> Option<i32> {
        self.world().procs.get(&pid).map(|p| p.tracer)
    }

    fn tree(&self, root: i32) -> Vec<i32> {
        self.world().tree(root)
    }

    fn tcp_fds(&self, pid: i32) -> Vec<(i32, u64)> {
        self.world()
            .live(pid)
            .map(|p| p.sockets.iter().map(|s| (s.fd, s.ino)).collect())
            .unwrap_or_default()
    }

    fn socket_addrs(&self, pid: i32, fd: i32) -> std::io::Result<SocketAddrs> {
        let mut w = self.world();
        let Some(addrs) = w
            .live(pid)
            .and_then(|p| p.sockets.iter().find(|s| s.fd == fd))
            .map(|s| s.addrs.clone())
        else {
            return Err(std::io::Error::from_raw_os_error(nix::libc::EBADF));
        };
        w.effects.push(Effect::ReadAddrs { pid, fd });
        Ok(addrs)
    }

    fn repair_off(&self, pid: i32, fd: i32) -> Result<(), BrokerError> {
        let mut w = self.world();
        let Some(p) = w.procs.get_mut(&pid).filter(|p| !p.zombie) else {
            return Ok(());
        };
        if let Some(s) = p.sockets.iter_mut().find(|s| s.fd == fd && s.repair) {
            s.repair = false;
            w.effects.push(Effect::RepairOff { pid, fd });
        }
        Ok(())
    }

    fn signal(&self, pid: i32, sig: Signal) -> nix::Result<()> {
        let mut w = self.world();
        w.effects.push(Effect::Signal { pid, sig });
        let Some(p) = w.procs.get_mut(&pid) else {
            return Err(nix::errno::Errno::ESRCH);
        };
        match sig {
            Signal::SIGKILL => {
                p.zombie = true;
                p.stopped = false;
                p.tracer = 0;
                p.sockets.clear();
            }
            Signal::SIGCONT => p.stopped = false,
            Signal::SIGSTOP => p.stopped = true,
            _ => {}
        }
        Ok(())
    }

    fn in_netns<T: Send + 'static>(
        &self,
        pid: i32,
        f: impl FnOnce(&mut dyn Ip) -> std::io::Result<T> + Send + 'static,
    ) -> std::io::Result<T> {
        let pause = self
            .pauses
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&pid);
        if let Some((arrive, wait)) = pause {
            let _ = arrive.send(());
            // Released, or the pause dropped: go on.
            let _ = wait.recv();
        }
        let mut w = self.world();
        let Some(ns) = w.live(pid).map(|p| p.netns) else {
            return Err(std::io::Error::from_raw_os_error(nix::libc::ENOENT));
        };
        f(&mut FakeIp { w: &mut w, ns })
    }

    fn move_into_cgroups_of(
        &self,
        _holder: i32,
        cgroup_v2: &str,
        tree: &[i32],
    ) -> Result<(), BrokerError> {
        let mut w = self.world();
        if w.take_fault(|f| f == Fault::Cgroup) {
            return Err(kernel_err("cgroup.procs: injected failure"));
        }
        for pid in tree {
            let Some(p) = w.procs.get_mut(pid) else {
                return Err(kernel_err(format!("cgroup.procs: pid {pid}: ESRCH")));
            };
            p.cgroup = cgroup_v2.to_owned();
            w.effects.push(Effect::Moved {
                pid: *pid,
                to: cgroup_v2.to_owned(),
            });
        }
        Ok(())
    }

    fn charge_memory_to(&self, _holder: i32, cgroup_v2: &str, pid: i32) -> Result<(), BrokerError> {
        let mut w = self.world();
        if w.take_fault(|f| f == Fault::Cgroup) {
            return Err(kernel_err("memory cgroup.procs: injected failure"));
        }
        if !w.procs.contains_key(&pid) {
            return Err(kernel_err(format!("cgroup.procs: pid {pid}: ESRCH")));
        }
        w.effects.push(Effect::Charged {
            pid,
            to: cgroup_v2.to_owned(),
        });
        Ok(())
    }

    fn bind_netns(&self, pid: i32, path: &Path) -> Result<(), BrokerError> {
        let mut w = self.world();
        let dir = path.parent().expect("has a parent");
        for p in [dir, path] {
            if w.symlinks.contains(p) {
                return Err(BrokerError::new(
                    ErrorKind::UnsafePath,
                    format!("{} is a symlink: refused, nothing followed", p.display()),
                ));
            }
        }
        if w.take_fault(|f| f == Fault::Mount) {
            return Err(kernel_err("mount: injected failure"));
        }
        let Some(ns) = w.live(pid).map(|p| p.netns) else {
            return Err(kernel_err("mount: ENOENT"));
        };
        w.mounts.insert(path.to_owned(), ns);
        w.effects.push(Effect::Mounted {
            path: path.to_owned(),
            netns: ns,
        });
        Ok(())
    }

    fn unbind(&self, path: &Path) -> Result<(), BrokerError> {
        self.world().mounts.remove(path);
        Ok(())
    }

    fn journal_write(&self, dir: &Path, name: &str, body: &[u8]) -> Result<(), BrokerError> {
        let mut w = self.world();
        if w.symlinks.contains(dir) {
            return Err(BrokerError::new(
                ErrorKind::UnsafePath,
                format!("{} is a symlink: refused, nothing followed", dir.display()),
            ));
        }
        if w.take_fault(|f| f == Fault::Journal) {
            return Err(kernel_err("journal: injected failure"));
        }
        w.files.insert(dir.join(name), body.to_vec());
        Ok(())
    }

    fn remove_file(&self, path: &Path) {
        self.world().files.remove(path);
    }

    fn read_dir(&self, dir: &Path) -> Vec<(String, PathBuf)> {
        let w = self.world();
        w.files
            .keys()
            .chain(w.mounts.keys())
            .filter(|p| p.parent() == Some(dir))
            .map(|p| {
                (
                    p.file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                    p.clone(),
                )
            })
            .collect()
    }

    fn read_file(&self, path: &Path) -> Option<Vec<u8>> {
        self.world().files.get(path).cloned()
    }

    /// The sockets of every live process in `pid`'s namespace: a listener is LISTEN,
    /// any other socket ESTABLISHED.
    fn sweep_unanswered(
        &self,
        addrs: Vec<IpAddr>,
        flag: crate::conntrack::SweepFlag,
        _every: Duration,
    ) {
        let mut w = self.world();
        w.effects.push(Effect::Swept { addrs });
        w.sweeps.push(flag);
    }

    fn tcp_states(&self, pid: i32) -> std::io::Result<Vec<(IpAddr, u8)>> {
        let w = self.world();
        let Some(ns) = w.live(pid).map(|p| p.netns) else {
            return Err(std::io::Error::from_raw_os_error(nix::libc::ENOENT));
        };
        Ok(w.procs
            .values()
            .filter(|p| !p.zombie && p.netns == ns)
            .flat_map(|p| &p.sockets)
            .filter_map(|s| {
                let st = if s.addrs.listening { 0x0A } else { 0x01 };
                Some((s.addrs.local?.ip(), st))
            })
            .collect())
    }

    fn now(&self) -> Instant {
        self.epoch + self.world().clock
    }

    fn unix_now(&self) -> u64 {
        UNIX_EPOCH_AT_START + self.world().clock.as_secs()
    }

    fn sleep(&self, d: Duration) {
        let mut w = self.world();
        w.clock += d;
        if w.detach_on_sleep {
            for p in w.procs.values_mut() {
                p.tracer = 0;
            }
        }
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

/// One step: a request from agent connection 1 or 2, or something that happens on the
/// node.
#[derive(Clone, Debug)]
pub enum Op {
    Req {
        conn: u64,
        req: Request,
    },
    /// The connection closes (the agent died): its lease ends.
    LeaseLost {
        conn: u64,
    },
    /// CRIU dumps the tree with `leave_stopped`: stopped, traced, sockets in repair.
    Dump {
        pid: i32,
    },
    /// CRIU detaches from the tree.
    Detach {
        pid: i32,
    },
    /// The process exits and is reaped.
    Exit {
        pid: i32,
    },
    /// A new process gets `pid` (a new start time), in `like`'s cgroup and netns.
    Reuse {
        pid: i32,
        like: i32,
    },
    /// A new child of `parent` with one TCP socket.
    Spawn {
        parent: i32,
    },
    Fault(Fault),
    /// A symlink is planted at the netns path of UIDS[uid], or at the journal dir, or
    /// at the hand-over journal's.
    Symlink {
        uid: usize,
        journal: bool,
        handover: bool,
    },
    /// The broker process dies and starts again over the same node (`recover`).
    Restart,
    DetachOnSleep(bool),
    /// `secs` seconds pass on the node's clocks, then the broker's sweep of adopted
    /// addresses runs.
    Sweep {
        secs: u64,
    },
    /// A live `pid` opens a TCP connection from `address` (a moved connection, when
    /// the address is adopted in its namespace).
    Connect {
        pid: i32,
        address: IpAddr,
    },
}

#[derive(Clone, Debug)]
struct Reg {
    conn: u64,
    role: BrokerRole,
    process: ProcRef,
    container: ContainerId,
    netns: u32,
    cgroup: String,
    bound: bool,
    locked: bool,
    /// A lock_network failed: the broker may still hold the lock (its undo failed).
    maybe_locked: bool,
    killed: bool,
    /// `fence` succeeded (and no `unfence` since): never resumed, killed on a lost
    /// lease or (while locked: the journal holds it) a restart.
    fenced: bool,
}

/// One broker over a [`FakeKernel`] on [`World::standard`], a model of what the
/// agents were told, and the invariants checked after every step.
pub struct Harness {
    k: FakeKernel,
    broker: Arc<Broker<FakeKernel>>,
    model: BTreeMap<String, Reg>,
    baseline: BTreeMap<u32, Net>,
    /// Pod netns left locked on purpose (a killed source: commit) or by the known gap
    /// (the pinned process died while locked).
    killed_netns: BTreeSet<u32>,
    cfg: Config,
    /// The adoptions the broker must hold, by (uid, address).
    adopted: BTreeMap<(String, IpAddr), Adopted>,
    /// Adopted addresses left in a namespace whose holder died (a real namespace goes
    /// with its last process and the runtime's mount; the fake's stays): (netns, address).
    abandoned: BTreeSet<(u32, IpAddr)>,
    /// Namespaces where a source was locked, and where an address was adopted: a
    /// namespace that is both (a target and a source pinned in one pod's namespace,
    /// never a migration) is exempt from the network checks, a known gap: a lock
    /// takes the IPv6 adoptions down with its links, and the unlock puts them back.
    ever_locked: BTreeSet<u32>,
    ever_adopted: BTreeSet<u32>,
}

/// One adoption as the harness expects the broker to hold it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Adopted {
    netns: u32,
    holder: ProcRef,
    restored: bool,
    deadline: u64,
}

impl Default for Harness {
    fn default() -> Self {
        Self::new()
    }
}

/// The harness's broker configuration: the simulated node's run directory and pods
/// root, the address hand-over on for [`HANDOVER_CIDRS`], lingering [`LINGER_SECS`].
pub fn config() -> Config {
    Config {
        run_dir: PathBuf::from(RUN_DIR),
        pods_cgroup_root: PODS_ROOT.into(),
        allowed_uid: 0,
        same_netns_peers: true,
        container_cgroups: true,
        handover_cidrs: parse_cidrs(HANDOVER_CIDRS).expect("valid CIDRs"),
        address_linger: Duration::from_secs(LINGER_SECS),
        sweep_interval: Duration::from_secs(2),
        hold_neighbours: true,
    }
}

fn reply_fits(req: &Request, r: &Reply) -> bool {
    matches!(
        (req, r),
        (Request::Register { .. }, Reply::Registered { .. })
            | (Request::BindNetns { .. }, Reply::NetnsPath { .. })
            | (Request::NetnsAddrs { .. }, Reply::Addrs { .. })
            | (Request::ListSockets { .. }, Reply::Sockets { .. })
            | (Request::MoveCgroup { .. }, Reply::Moved { .. })
            | (Request::ChargeRestore { .. }, Reply::Moved { .. })
            | (
                Request::UnbindNetns { .. }
                    | Request::LockNetwork { .. }
                    | Request::UnlockNetwork { .. }
                    | Request::ReleaseTcpRepair { .. }
                    | Request::Resume { .. }
                    | Request::Kill { .. }
                    | Request::Fence { .. }
                    | Request::Unfence { .. }
                    | Request::AdoptAddress { .. }
                    | Request::ReleaseAddress { .. }
                    | Request::Forget { .. },
                Reply::Done
            )
    )
}

impl Harness {
    pub fn new() -> Self {
        Self::with_config(config())
    }

    /// A harness whose broker runs with `cfg` (the hand-over off, say).
    pub fn with_config(cfg: Config) -> Self {
        let w = World::standard();
        let baseline = w.nets.iter().map(|(n, x)| (*n, x.canonical())).collect();
        let k = FakeKernel::new(w);
        let broker = Broker::with_kernel(cfg.clone(), k.clone());
        Self {
            k,
            broker,
            model: BTreeMap::new(),
            baseline,
            killed_netns: BTreeSet::new(),
            cfg,
            adopted: BTreeMap::new(),
            abandoned: BTreeSet::new(),
            ever_locked: BTreeSet::new(),
            ever_adopted: BTreeSet::new(),
        }
    }

    pub fn kernel(&self) -> &FakeKernel {
        &self.k
    }

    pub fn broker(&self) -> &Broker<FakeKernel> {
        &self.broker
    }

    /// The pids ops can name: every pid in the table (zombies too) and one that never
    /// existed.
    fn pick(&self, b: u8) -> i32 {
        let w = self.k.world();
        let mut pids: Vec<i32> = w.procs.keys().copied().collect();
        pids.push(4242);
        pids[(b & 0x3f) as usize % pids.len()]
    }

    /// A pinned reference to `pid`: its real start time, or a wrong one.
    fn pin(&self, pid: i32, wrong: bool) -> ProcRef {
        let st = self.k.world().procs.get(&pid).map_or(5, |p| p.start_time);
        ProcRef {
            pid,
            start_time: st + u64::from(wrong),
        }
    }

    /// Three bytes → one op over the current world (the fuzzer's encoding; the seed
    /// corpus is written in it): `[kind, a, b]`. A `register` names the pinned
    /// process's own container unless `b & 0x80`, then another one.
    pub fn op_from_bytes(&self, kind: u8, a: u8, b: u8) -> Op {
        let uid = MigrationUid::parse(UIDS[(a % 3) as usize]).expect("valid uid");
        let conn = 1 + u64::from(a >> 7);
        let req = |req| Op::Req { conn, req };
        match kind % 29 {
            0 => {
                let pid = self.pick(b);
                let container = if b & 0x80 != 0 {
                    self.k.world().other_container(pid)
                } else {
                    self.k.world().container_of(pid)
                };
                req(Request::Register {
                    uid,
                    role: if a & 4 != 0 {
                        BrokerRole::Target
                    } else {
                        BrokerRole::Source
                    },
                    process: self.pin(pid, b & 0x40 != 0),
                    container,
                })
            }
            1 => req(Request::BindNetns { uid }),
            2 => req(Request::UnbindNetns { uid }),
            3 => req(Request::NetnsAddrs { uid }),
            4 => req(Request::LockNetwork { uid }),
            5 => req(Request::UnlockNetwork { uid }),
            6 => req(Request::ListSockets { uid }),
            7 => req(Request::ReleaseTcpRepair { uid }),
            8 => req(Request::MoveCgroup {
                uid,
                process: self.pin(self.pick(b), b & 0x40 != 0),
            }),
            9 => req(Request::Resume { uid }),
            10 => req(Request::Kill { uid }),
            11 => req(Request::Forget { uid }),
            12 => Op::LeaseLost {
                conn: 1 + u64::from(a & 1),
            },
            13 => Op::Dump { pid: self.pick(b) },
            14 => Op::Detach { pid: self.pick(b) },
            15 => Op::Exit { pid: self.pick(b) },
            16 => Op::Reuse {
                pid: self.pick(b),
                like: self.pick(a),
            },
            17 => Op::Spawn {
                parent: self.pick(b),
            },
            18 => Op::Fault(match a % 5 {
                0 => Fault::Ip(b % 6),
                1 => Fault::Mount,
                2 => Fault::Journal,
                3 => Fault::Announce,
                _ => Fault::Cgroup,
            }),
            19 => Op::Symlink {
                uid: (a % 3) as usize,
                journal: b & 1 != 0,
                handover: b & 3 == 2,
            },
            20 => Op::Restart,
            21 => Op::DetachOnSleep(a & 1 != 0),
            22 => req(Request::Fence { uid }),
            23 => req(Request::Unfence { uid }),
            24 => req(Request::AdoptAddress {
                uid,
                address: address(b),
            }),
            25 => req(Request::ReleaseAddress {
                uid,
                address: address(b),
            }),
            26 => Op::Sweep {
                secs: [0, 1, 60, LINGER_SECS + 1][usize::from(b % 4)],
            },
            28 => req(Request::ChargeRestore {
                uid,
                process: self.pin(self.pick(b), b & 0x40 != 0),
            }),
            _ => Op::Connect {
                pid: self.pick(b),
                address: address(a),
            },
        }
    }

    /// Runs every 3-byte op of `data` (at most `max_ops`), checking the invariants
    /// after each; the first violation is returned.
    pub fn run_bytes(&mut self, data: &[u8], max_ops: usize) -> Result<(), String> {
        for c in data.chunks_exact(3).take(max_ops) {
            let op = self.op_from_bytes(c[0], c[1], c[2]);
            self.step(op)?;
        }
        Ok(())
    }

    fn netns_path(uid: &str) -> PathBuf {
        Path::new(RUN_DIR).join("netns").join(uid)
    }

    /// Runs one op; the request's outcome (None for node events), or the invariant it
    /// broke.
    pub fn step(&mut self, op: Op) -> Result<Option<Result<Reply, ErrorKind>>, String> {
        let (pre, pre_nets, fault_pending) = {
            let mut w = self.k.world();
            w.effects.clear();
            (w.procs.clone(), w.nets.clone(), w.fault.is_some())
        };
        let pre_model = self.model.clone();
        let pre_adopted: BTreeSet<(u32, IpAddr)> = self
            .adopted
            .iter()
            .map(|((_, a), x)| (x.netns, *a))
            .collect();
        let mut outcome = None;
        let mut allowed = match op.clone() {
            Op::Req { conn, req } => {
                let allowed = self.allowed_by(conn, &req);
                outcome = Some(
                    self.request(conn, req, fault_pending, &pre, &pre_nets)
                        .map_err(|e| format!("after {op:?}: {e}"))?,
                );
                allowed
            }
            Op::LeaseLost { conn } => self
                .lose_lease(conn, &pre_model)
                .map_err(|e| format!("after {op:?}: {e}"))?,
            Op::Restart => self
                .restart(&pre_model)
                .map_err(|e| format!("after {op:?}: {e}"))?,
            Op::Sweep { secs } => self
                .sweep(secs, fault_pending)
                .map_err(|e| format!("after {op:?}: {e}"))?,
            other => {
                self.world_event(other);
                Allowed::default()
            }
        };
        // The known gap of a netns both locked as a source and holding adoptions: its
        // unlock announces the adoptions it brought back, which this very step (a
        // restart's sweep) may withdraw again.
        allowed.announced_adoptions = pre_adopted
            .into_iter()
            .filter(|(n, _)| self.ever_locked.contains(n) && self.ever_adopted.contains(n))
            .collect();
        self.exempt_networks_of_dead_locked_sources(&pre_model, &pre);
        self.check(&pre, &allowed)
            .map_err(|e| format!("after {op:?}: {e}"))?;
        Ok(outcome)
    }

    /// What a request may do: signal or take sockets from the tree of this agent's
    /// source, lock its network, mount or move into its target's.
    fn allowed_by(&self, conn: u64, req: &Request) -> Allowed {
        let uid = req.uid().as_str().to_owned();
        let mine = self.model.get(&uid).filter(|r| r.conn == conn).cloned();
        let src = mine.clone().filter(|r| r.role == BrokerRole::Source);
        let tgt = mine.clone().filter(|r| r.role == BrokerRole::Target);
        let mut a = Allowed::default();
        match req {
            Request::Resume { .. } => {
                // Never a fenced source.
                a.roots
                    .extend(src.filter(|r| !r.fenced).map(|r| (r.process, r.netns)));
                a.sigs = &[Signal::SIGCONT];
            }
            Request::Kill { .. } => {
                a.roots.extend(src.map(|r| (r.process, r.netns)));
                a.sigs = &[Signal::SIGKILL];
            }
            Request::ListSockets { .. } | Request::ReleaseTcpRepair { .. } => {
                a.roots.extend(src.map(|r| (r.process, r.netns)));
            }
            Request::LockNetwork { .. } => {
                a.may_lock = src.map(|r| r.netns);
                // The addresses it has before the lock (which drops IPv6 ones).
                a.may_sweep = a.may_lock.map(|ns| {
                    self.k.world().nets.get(&ns).map_or_else(Vec::new, |n| {
                        n.addrs4
                            .iter()
                            .chain(&n.addrs6)
                            .map(|(x, _)| x.clone())
                            .collect()
                    })
                });
            }
            Request::BindNetns { .. } => {
                a.may_mount = tgt.map(|r| (Self::netns_path(&uid), r.netns))
            }
            Request::MoveCgroup { process, .. } => {
                a.may_move = tgt.map(|r| (*process, r.netns, r.cgroup, r.process.pid))
            }
            Request::ChargeRestore { process, .. } => {
                let w = self.k.world();
                let broker_netns = w.procs.get(&w.broker_pid).map_or(0, |p| p.netns);
                a.may_charge = tgt.map(|r| (*process, r.cgroup, w.broker_pid, broker_netns))
            }
            Request::AdoptAddress { address, .. } => {
                a.adopt_into = tgt.map(|r| (r.netns, *address))
            }
            Request::ReleaseAddress { address, .. } => {
                a.may_withdraw = self
                    .adopted
                    .get(&(uid.clone(), *address))
                    .filter(|x| tgt.as_ref().is_some_and(|r| r.process == x.holder))
                    .map(|x| (x.netns, *address))
                    .into_iter()
                    .collect();
            }
            Request::Forget { .. } if mine.is_some() => {
                a.may_withdraw = self
                    .adopted
                    .iter()
                    .filter(|((u, _), x)| *u == uid && !x.restored)
                    .map(|((_, addr), x)| (x.netns, *addr))
                    .collect();
            }
            _ => {}
        }
        a
    }

    /// Sends `req` to the broker and checks the answer (a reply that fits the request,
    /// a socket list that is exactly the registered tree's sockets, no kernel error
    /// without a fault); the agents' model follows the answer.
    fn request(
        &mut self,
        conn: u64,
        req: Request,
        fault_pending: bool,
        pre: &BTreeMap<i32, Proc>,
        pre_nets: &BTreeMap<u32, Net>,
    ) -> Result<Result<Reply, ErrorKind>, String> {
        let uid = req.uid().as_str().to_owned();
        let mine = self.model.get(&uid).filter(|r| r.conn == conn).cloned();
        match (&req, &mine) {
            (Request::LockNetwork { .. }, Some(r)) if r.role == BrokerRole::Source => {
                self.ever_locked.insert(r.netns);
            }
            (Request::AdoptAddress { .. }, Some(r)) if r.role == BrokerRole::Target => {
                self.ever_adopted.insert(r.netns);
            }
            _ => {}
        }
        let res = match self.broker.handle(conn, req.clone()) {
            Ok(reply) => {
                if !reply_fits(&req, &reply) {
                    return Err(format!("{req:?} answered with {reply:?}"));
                }
                if let Reply::Sockets { sockets } = &reply {
                    let root = self.model.get(req.uid().as_str()).map(|r| r.process.pid);
                    let want = root.map(|r| sockets_in(pre, r)).unwrap_or_default();
                    if *sockets != want {
                        return Err(format!(
                            "{req:?} listed {sockets:?}, the tree holds {want:?}"
                        ));
                    }
                }
                Ok(reply)
            }
            Err(e) => {
                // An adoption into a namespace where the broker cannot tell the link
                // (no default route of the family, several links) is the kernel
                // layer's refusal, without a fault.
                let no_link = match (&req, &mine) {
                    (Request::AdoptAddress { address, .. }, Some(r)) => {
                        no_link_for(&pre_nets[&r.netns], *address)
                    }
                    _ => false,
                };
                if e.kind == ErrorKind::Kernel && !fault_pending && !no_link {
                    return Err(format!("{req:?}: kernel error with no fault: {e}"));
                }
                self.check_refusal(&req, mine.as_ref(), &e)?;
                Err(e.kind)
            }
        };
        self.update_model(conn, &req, &res, pre)?;
        self.update_adoptions(&req, mine.as_ref(), &res, fault_pending, pre_nets)?;
        Ok(res)
    }

    /// An `adopt_address` refusal must have its reason: `HandoverOff` only with no
    /// CIDRs, `AddressNotAllowed` for an address it may adopt only when the migration
    /// has [`crate::handover::MAX_ADOPTED`] already, another migration holds it, or it
    /// holds it for another holder.
    fn check_refusal(
        &self,
        req: &Request,
        mine: Option<&Reg>,
        e: &BrokerError,
    ) -> Result<(), String> {
        let Request::AdoptAddress { uid, address } = req else {
            return Ok(());
        };
        let on = !self.cfg.handover_cidrs.is_empty();
        match e.kind {
            ErrorKind::HandoverOff if on => Err(format!("{req:?}: {e} with the hand-over on")),
            ErrorKind::AddressNotAllowed if on && may_adopt(*address) => {
                let u = uid.as_str();
                let mine_n = self.adopted.keys().filter(|(x, _)| x == u).count();
                let elsewhere = self.adopted.iter().any(|((x, a), r)| {
                    a == address && (x != u || mine.is_none_or(|m| m.process != r.holder))
                });
                if mine_n >= crate::handover::MAX_ADOPTED || elsewhere {
                    Ok(())
                } else {
                    Err(format!("{req:?}: {e}, an address it may adopt"))
                }
            }
            _ => Ok(()),
        }
    }

    /// The adoptions the broker must hold after `req` answered `res`.
    fn update_adoptions(
        &mut self,
        req: &Request,
        mine: Option<&Reg>,
        res: &Result<Reply, ErrorKind>,
        fault_pending: bool,
        pre_nets: &BTreeMap<u32, Net>,
    ) -> Result<(), String> {
        let uid = req.uid().as_str().to_owned();
        if res.is_err() {
            // A failure changes nothing, unless a fault stopped it half-way (or the
            // journal cannot be written): then the journal says what is left, never
            // more than there was.
            if fault_pending || self.handover_blocked() {
                self.sync_from_journal(&uid)?;
            }
            return Ok(());
        }
        let Some(r) = mine else {
            return Ok(());
        };
        match req {
            Request::AdoptAddress { address, .. } => {
                if !may_adopt(*address) {
                    return Err(format!("{req:?} done: an address it must refuse"));
                }
                let there = |nets: &BTreeMap<u32, Net>| net_has(&nets[&r.netns], *address);
                if !there(&self.k.world().nets) {
                    return Err(format!(
                        "{req:?} done, the address is not in netns {}",
                        r.netns
                    ));
                }
                match self.adopted.get(&(uid.clone(), *address)) {
                    Some(x) if x.holder != r.process => {
                        return Err(format!("{req:?} done for another holder: {x:?}"));
                    }
                    Some(_) => {}
                    // There before (the pod's own): nothing recorded.
                    None if there(pre_nets) => {}
                    None => {
                        let deadline = self.k.unix_now() + self.cfg.address_linger.as_secs();
                        self.adopted.insert(
                            (uid, *address),
                            Adopted {
                                netns: r.netns,
                                holder: r.process,
                                restored: false,
                                deadline,
                            },
                        );
                    }
                }
            }
            Request::ReleaseAddress { address, .. } => {
                let key = (uid, *address);
                if self
                    .adopted
                    .get(&key)
                    .is_some_and(|x| x.holder == r.process)
                {
                    self.adopted.remove(&key);
                    if net_has(&self.k.world().nets[&r.netns], *address) {
                        return Err(format!("{req:?} done, the address is still there"));
                    }
                }
            }
            Request::MoveCgroup { .. } => {
                for ((u, _), x) in self.adopted.iter_mut() {
                    if *u == uid && x.holder == r.process {
                        x.restored = true;
                    }
                }
            }
            Request::Forget { .. } => self.end_adoptions(&uid),
            _ => {}
        }
        Ok(())
    }

    /// A registration of `uid` ended: its adoptions not restored are gone (withdrawn,
    /// or left in the namespace of a holder that died).
    fn end_adoptions(&mut self, uid: &str) {
        let live = self.k.world().procs.clone();
        let ended: Vec<(String, IpAddr)> = self
            .adopted
            .iter()
            .filter(|((u, _), x)| u == uid && !x.restored)
            .map(|(k, _)| k.clone())
            .collect();
        for k in ended {
            let x = self.adopted.remove(&k).expect("listed");
            if !live_as(&live, x.holder) {
                self.abandoned.insert((x.netns, k.1));
            }
        }
    }

    /// Whether a symlink was planted at the hand-over journal's directory: every write
    /// of a non-empty record is refused from then on, so what the broker withdraws it
    /// cannot always take out of its records.
    fn handover_blocked(&self) -> bool {
        self.k
            .world()
            .symlinks
            .contains(&Path::new(RUN_DIR).join("netns").join(".handover"))
    }

    /// After a failure a fault cut short: the adoptions of `uid` are what the journal
    /// holds, which must be some of those there were, unchanged.
    fn sync_from_journal(&mut self, uid: &str) -> Result<(), String> {
        let journal = self.handover_journal(&self.k.world())?;
        let now = journal.get(uid).cloned().unwrap_or_default();
        let procs = self.k.world().procs.clone();
        let before: Vec<(String, IpAddr)> = self
            .adopted
            .keys()
            .filter(|(u, _)| u == uid)
            .cloned()
            .collect();
        for r in &now {
            let key = (uid.to_owned(), r.address);
            match self.adopted.get(&key) {
                Some(x)
                    if x.holder == r.holder
                        && x.restored == r.restored
                        && x.deadline == r.deadline => {}
                other => {
                    return Err(format!(
                        "after a failure the hand-over journal holds {r:?}, which was {other:?}"
                    ));
                }
            }
        }
        for key in before {
            if !now.iter().any(|r| r.address == key.1) {
                let x = self.adopted.remove(&key).expect("listed");
                if !live_as(&procs, x.holder) {
                    self.abandoned.insert((x.netns, key.1));
                }
            }
        }
        Ok(())
    }

    /// Time passes (`secs`), then the broker's sweep runs: what it must withdraw is
    /// predicted from the adoptions, the clock, the registrations and the connections
    /// of each holder's namespace.
    fn sweep(&mut self, secs: u64, fault_pending: bool) -> Result<Allowed, String> {
        self.k.world().clock += Duration::from_secs(secs);
        let a = Allowed {
            may_withdraw: self
                .adopted
                .iter()
                .map(|((_, ad), x)| (x.netns, *ad))
                .collect(),
            ..Allowed::default()
        };
        let keys: Vec<(String, IpAddr)> = self.adopted.keys().cloned().collect();
        self.broker.sweep();
        if fault_pending || self.handover_blocked() {
            for u in keys.iter().map(|(u, _)| u.clone()).collect::<BTreeSet<_>>() {
                self.sync_from_journal(&u)?;
            }
            return Ok(a);
        }
        self.predict_sweep();
        Ok(a)
    }

    /// What one sweep leaves of the adoptions (see [`Broker::sweep`]).
    fn predict_sweep(&mut self) {
        let w = self.k.world();
        let now = UNIX_EPOCH_AT_START + w.clock.as_secs();
        let procs = w.procs.clone();
        drop(w);
        let model = &self.model;
        let mut abandoned = Vec::new();
        self.adopted.retain(|(u, a), x| {
            if !live_as(&procs, x.holder) {
                abandoned.push((x.netns, *a));
                return false;
            }
            let registered = model
                .get(u)
                .is_some_and(|r| r.role == BrokerRole::Target && r.process == x.holder);
            let used = procs.values().any(|p| {
                !p.zombie
                    && p.netns == x.netns
                    && p.sockets
                        .iter()
                        .any(|s| !s.addrs.listening && s.addrs.local.is_some_and(|l| l.ip() == *a))
            });
            !(now >= x.deadline || (!x.restored && !registered) || (x.restored && !used))
        });
        self.abandoned.extend(abandoned);
    }

    /// The hand-over journal, by migration (every record must parse, name a valid UID
    /// and hold at most [`crate::handover::MAX_ADOPTED`] addresses, each once).
    fn handover_journal(&self, w: &World) -> Result<BTreeMap<String, Vec<Adoption>>, String> {
        let dir = Path::new(RUN_DIR).join("netns").join(".handover");
        let mut out = BTreeMap::new();
        for (p, body) in w.files.iter().filter(|(p, _)| p.parent() == Some(&dir)) {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if MigrationUid::parse(&name).is_err() {
                return Err(format!("hand-over record at {p:?}"));
            }
            let list = parse_journal_body(body)
                .ok_or_else(|| format!("unreadable hand-over record {p:?}"))?;
            let addrs: BTreeSet<IpAddr> = list.iter().map(|r| r.address).collect();
            if list.is_empty()
                || list.len() > crate::handover::MAX_ADOPTED
                || addrs.len() != list.len()
            {
                return Err(format!("hand-over record {p:?}: {list:?}"));
            }
            out.insert(name, list);
        }
        Ok(out)
    }

    /// Connection `conn` ends: its locked (or maybe locked) sources are rolled back,
    /// its fenced ones killed.
    fn lose_lease(
        &mut self,
        conn: u64,
        pre_model: &BTreeMap<String, Reg>,
    ) -> Result<Allowed, String> {
        self.k.world().fault = None;
        let mut a = Allowed {
            sigs: &[Signal::SIGCONT],
            ..Allowed::default()
        };
        for r in pre_model.values().filter(|r| r.conn == conn) {
            if r.role != BrokerRole::Source || r.killed {
                continue;
            }
            if r.fenced {
                a.kill_roots.push((r.process, r.netns));
                a.killed.push(r.process);
                self.killed_netns.insert(r.netns);
                continue;
            }
            if r.locked || r.maybe_locked {
                a.roots.push((r.process, r.netns));
            }
            if r.locked {
                a.rolled_back.push(r.process);
            }
        }
        self.broker.lease_lost(conn);
        let mut ended = Vec::new();
        self.model.retain(|u, r| {
            if r.conn == conn {
                ended.push(u.clone());
            }
            r.conn != conn
        });
        for u in &ended {
            a.may_withdraw.extend(
                self.adopted
                    .iter()
                    .filter(|((x, _), ad)| x == u && !ad.restored)
                    .map(|((_, addr), ad)| (ad.netns, *addr)),
            );
            if self.handover_blocked() {
                // Withdrawn, but perhaps still recorded: the journal says.
                self.sync_from_journal(u)?;
            } else {
                self.end_adoptions(u);
            }
        }
        Ok(a)
    }

    /// A new broker over the same node recovers what the old one had locked.
    fn restart(&mut self, pre_model: &BTreeMap<String, Reg>) -> Result<Allowed, String> {
        self.k.world().fault = None;
        let mut a = Allowed {
            sigs: &[Signal::SIGCONT],
            ..Allowed::default()
        };
        for r in pre_model.values() {
            // The journal holds a fenced lock: killed, never thawed. (A fenced source
            // unlocked since is in no journal: it stays as it is, stopped.)
            if r.role == BrokerRole::Source && r.locked && !r.killed && r.fenced {
                a.kill_roots.push((r.process, r.netns));
                a.killed.push(r.process);
                self.killed_netns.insert(r.netns);
            } else if r.role == BrokerRole::Source && r.locked && !r.killed {
                a.roots.push((r.process, r.netns));
                a.rolled_back.push(r.process);
            }
            // Known gap: a lock whose journal write and undo both failed lives
            // only in the dead broker's memory.
            if r.maybe_locked && !r.locked {
                self.killed_netns.insert(r.netns);
            }
        }
        a.may_withdraw = self
            .adopted
            .iter()
            .map(|((_, ad), x)| (x.netns, *ad))
            .collect();
        self.broker = Broker::with_kernel(self.cfg.clone(), self.k.clone());
        self.broker.recover();
        // Its registrations ended with the old broker; then one sweep (which drops
        // the records of holders that died, as the loading does).
        self.model.clear();
        if self.handover_blocked() {
            let uids: BTreeSet<String> = self.adopted.keys().map(|(u, _)| u.clone()).collect();
            for u in uids {
                self.sync_from_journal(&u)?;
            }
        } else {
            self.predict_sweep();
        }
        Ok(a)
    }

    /// A source whose pinned process died while locked cannot be entered any more
    /// (the broker reaches the netns through that pid): when its registration ends,
    /// its network stays locked. A known gap, exempted here and reported in
    /// docs/reliability.md, so that the fuzzer looks for everything else.
    fn exempt_networks_of_dead_locked_sources(
        &mut self,
        pre_model: &BTreeMap<String, Reg>,
        pre: &BTreeMap<i32, Proc>,
    ) {
        for (u, r) in pre_model {
            let alive = pre
                .get(&r.process.pid)
                .is_some_and(|x| !x.zombie && x.start_time == r.process.start_time);
            if !self.model.contains_key(u) && r.locked && !r.killed && !alive {
                self.killed_netns.insert(r.netns);
            }
        }
    }

    fn world_event(&mut self, op: Op) {
        let mut w = self.k.world();
        match op {
            Op::Dump { pid } => w.dump(pid),
            Op::Detach { pid } => w.detach(pid),
            Op::Exit { pid } if pid != w.broker_pid && pid != 1 => w.exit(pid),
            Op::Reuse { pid, like } if pid != w.broker_pid && pid != 1 => w.reuse(pid, like),
            Op::Spawn { parent } => w.spawn(parent),
            Op::Fault(f) => w.fault = Some(f),
            Op::Symlink {
                uid,
                journal,
                handover,
            } => {
                let p = if journal {
                    Path::new(RUN_DIR).join("netns").join(".journal")
                } else if handover {
                    Path::new(RUN_DIR).join("netns").join(".handover")
                } else {
                    Self::netns_path(UIDS[uid])
                };
                w.symlinks.insert(p);
            }
            Op::DetachOnSleep(on) => w.detach_on_sleep = on,
            Op::Connect { pid, address } => w.connect(pid, address),
            _ => {}
        }
    }

    /// A registration the broker accepted: it must be one it may accept (a live pod
    /// process with its pinned start time, of the container named, not the broker's
    /// cgroup, not in the node's netns), not a second pin of the same process, and a
    /// repeat (of the same container too) only by the same agent.
    fn registered(
        &mut self,
        conn: u64,
        uid: String,
        pin: (BrokerRole, ProcRef, &ContainerId),
        cgroup: &str,
        pre: &BTreeMap<i32, Proc>,
    ) -> Result<(), String> {
        let (role, process, container) = pin;
        let Some(p) = pre.get(&process.pid) else {
            return Err(format!(
                "registered pid {} that does not exist",
                process.pid
            ));
        };
        let broker_cg = pre
            .get(&self.k.world().broker_pid)
            .map(|b| b.cgroup.clone());
        // A repeated register of the same pin by the same agent is idempotent:
        // the pin was checked when it was made.
        let new = !self.model.contains_key(&uid);
        // The fake world's containers are its cgroups' last components.
        let its_container = p.cgroup.rsplit('/').next() == Some(container.as_str());
        if p.zombie
            || p.start_time != process.start_time
            || (new && !under_pods_root(&p.cgroup, PODS_ROOT))
            || (new && !its_container)
            || (new && Some(&p.cgroup) == broker_cg.as_ref())
            || (new && p.netns == self.k.world().node_netns)
        {
            return Err(format!("registered a process it must refuse: {p:?}"));
        }
        if let Some(r) = self.model.get(&uid) {
            if r.conn != conn || r.process != process || r.role != role || r.container != *container
            {
                return Err(format!("{uid} registered twice"));
            }
            return Ok(());
        }
        if self.model.values().any(|r| r.process.pid == process.pid) {
            return Err(format!("pid {} pinned by two migrations", process.pid));
        }
        self.model.insert(
            uid,
            Reg {
                conn,
                role,
                process,
                container: container.clone(),
                netns: p.netns,
                cgroup: cgroup.to_owned(),
                bound: false,
                locked: false,
                maybe_locked: false,
                killed: false,
                fenced: false,
            },
        );
        Ok(())
    }

    fn update_model(
        &mut self,
        conn: u64,
        req: &Request,
        res: &Result<Reply, ErrorKind>,
        pre: &BTreeMap<i32, Proc>,
    ) -> Result<(), String> {
        let uid = req.uid().as_str().to_owned();
        let Ok(reply) = res else {
            if let (Request::LockNetwork { .. }, Some(r)) = (req, self.model.get_mut(&uid)) {
                r.maybe_locked = true;
            }
            return Ok(());
        };
        match req {
            Request::Register {
                role,
                process,
                container,
                ..
            } => {
                let Reply::Registered { cgroup } = reply else {
                    unreachable!("checked by reply_fits")
                };
                self.registered(conn, uid, (*role, *process, container), cgroup, pre)?;
            }
            Request::Forget { .. } => {
                self.model.remove(&uid);
            }
            _ => {
                let Some(r) = self.model.get_mut(&uid) else {
                    return Err(format!("{req:?} succeeded on an unregistered migration"));
                };
                match req {
                    Request::BindNetns { .. } => r.bound = true,
                    Request::UnbindNetns { .. } => r.bound = false,
                    Request::LockNetwork { .. } => r.locked = true,
                    Request::UnlockNetwork { .. } => r.locked = false,
                    Request::Kill { .. } => {
                        r.killed = true;
                        self.killed_netns.insert(r.netns);
                    }
                    Request::Fence { .. } => {
                        if !r.locked && !r.maybe_locked {
                            return Err(format!("{req:?} done on a source never locked"));
                        }
                        // Done proves the broker holds the lock (and journals it).
                        r.locked = true;
                        r.fenced = true;
                    }
                    Request::Unfence { .. } => r.fenced = false,
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// The invariants after a step: every effect allowed, the registrations the agents
    /// were told of, rolled-back trees thawed, mounts, journal and networks as the
    /// registrations say.
    fn check(&self, pre: &BTreeMap<i32, Proc>, allowed: &Allowed) -> Result<(), String> {
        let w = self.k.world();
        for e in &w.effects {
            if !allowed.permits(e, pre, &w.nets, w.node_netns) {
                return Err(format!("effect not allowed: {e:?}"));
            }
        }
        if self.broker.registrations() != self.model.len() {
            return Err(format!(
                "broker holds {} registrations, the agents were told {}",
                self.broker.registrations(),
                self.model.len()
            ));
        }
        check_thawed(&w, pre, &allowed.rolled_back)?;
        check_killed(&w, pre, &allowed.killed)?;
        self.check_mounts_and_journal(&w)?;
        self.check_adoptions(&w)?;
        self.check_networks(&w)
    }

    /// Adoptions: the hand-over journal holds exactly the adoptions the harness expects
    /// (address, holder, restored, deadline), and the broker's memory exactly the
    /// journal.
    fn check_adoptions(&self, w: &World) -> Result<(), String> {
        let journal = self.handover_journal(w)?;
        let have: BTreeMap<(String, IpAddr), Adopted> = journal
            .iter()
            .flat_map(|(u, list)| {
                list.iter().map(|r| {
                    let netns = self
                        .adopted
                        .get(&(u.clone(), r.address))
                        .map_or(0, |x| x.netns);
                    (
                        (u.clone(), r.address),
                        Adopted {
                            netns,
                            holder: r.holder,
                            restored: r.restored,
                            deadline: r.deadline,
                        },
                    )
                })
            })
            .collect();
        if have != self.adopted {
            return Err(format!(
                "hand-over journal {have:?}, expected {:?}",
                self.adopted
            ));
        }
        let memory = self.broker.adoptions();
        // With the journal's directory a planted symlink, a record the broker dropped
        // (a holder gone, nothing to withdraw) may stay in the journal.
        let subset = memory.iter().all(|(u, l)| {
            journal
                .get(u)
                .is_some_and(|j| l.iter().all(|r| j.contains(r)))
        });
        if memory != journal && !(self.handover_blocked() && subset) {
            return Err(format!(
                "the broker holds the adoptions {memory:?}, its journal {journal:?}"
            ));
        }
        Ok(())
    }

    /// Mounts: exactly those of the bound target registrations. Journal: exactly the
    /// locked, not killed sources.
    fn check_mounts_and_journal(&self, w: &World) -> Result<(), String> {
        let want: BTreeSet<PathBuf> = self
            .model
            .iter()
            .filter(|(_, r)| r.bound)
            .map(|(u, _)| Self::netns_path(u))
            .collect();
        let have: BTreeSet<PathBuf> = w.mounts.keys().cloned().collect();
        if want != have {
            return Err(format!("mounts {have:?}, expected {want:?}"));
        }
        let jdir = Path::new(RUN_DIR).join("netns").join(".journal");
        let want: BTreeSet<PathBuf> = self
            .model
            .iter()
            .filter(|(_, r)| r.locked && !r.killed)
            .map(|(u, _)| jdir.join(u))
            .collect();
        let have: BTreeSet<PathBuf> = w
            .files
            .keys()
            .filter(|p| p.parent() == Some(&jdir))
            .cloned()
            .collect();
        if want != have {
            return Err(format!("journal {have:?}, expected {want:?}"));
        }
        Ok(())
    }

    /// Networks: the node's is never touched; a pod's is as it was once no
    /// registration holds it (unless its source was killed: commit), but for the
    /// addresses adopted in it; and in no namespace is there an address the pod did
    /// not have that is not an adoption the broker holds (or one whose holder died).
    fn check_networks(&self, w: &World) -> Result<(), String> {
        let node = w.node_netns;
        for (n, net) in &w.nets {
            if *n != node && self.ever_locked.contains(n) && self.ever_adopted.contains(n) {
                continue;
            }
            let adopted: BTreeSet<IpAddr> = self
                .adopted
                .iter()
                .filter(|(_, x)| x.netns == *n)
                .map(|((_, a), _)| *a)
                .chain(
                    self.abandoned
                        .iter()
                        .filter(|(x, _)| x == n)
                        .map(|(_, a)| *a),
                )
                .collect();
            let base = &self.baseline[n];
            let mut stripped = net.canonical();
            for set in [&mut stripped.addrs4, &mut stripped.addrs6] {
                for (cidr, link) in set.clone() {
                    let extra = !base.addrs4.contains(&(cidr.clone(), link.clone()))
                        && !base.addrs6.contains(&(cidr.clone(), link.clone()));
                    if !extra {
                        continue;
                    }
                    let a = cidr
                        .split('/')
                        .next()
                        .and_then(|a| a.parse::<IpAddr>().ok());
                    if !a.is_some_and(|a| adopted.contains(&a)) {
                        return Err(format!(
                            "netns {n} holds {cidr} on {link}, an address nobody adopted"
                        ));
                    }
                    set.remove(&(cidr, link));
                }
            }
            // A link silenced for an adoption stays so exactly when the adoption's
            // address may stay (its holder died before the broker could undo either).
            if !adopted.is_empty() {
                stripped.arp_ignore = base.arp_ignore.clone();
            }
            let held = self.model.values().any(|r| r.netns == *n);
            let exempt = *n != node && (held || self.killed_netns.contains(n));
            if !exempt && stripped != *base {
                return Err(format!(
                    "netns {n} left changed: {:?}, was {:?}",
                    net.canonical(),
                    self.baseline[n]
                ));
            }
        }
        Ok(())
    }
}

/// What one step may do to the world, checked against the effects it recorded.
#[derive(Default)]
struct Allowed {
    /// Roots (with their netns) whose trees may be signalled or have sockets touched.
    roots: Vec<(ProcRef, u32)>,
    /// The signals allowed on those trees.
    sigs: &'static [Signal],
    /// The netns whose links may go down.
    may_lock: Option<u32>,
    /// The addresses of the source's network namespace (before the step) that a lock
    /// may have the node forget unanswered connections to.
    may_sweep: Option<Vec<String>>,
    /// The one netns bind mount allowed: path and netns.
    may_mount: Option<(PathBuf, u32)>,
    /// The restored root that may move, its netns, the cgroup it may move to, and the
    /// registered holder (which must not move).
    may_move: Option<(ProcRef, u32, String, i32)>,
    /// The process whose memory may be charged to a holder's cgroup, that cgroup, and
    /// the broker's pid and netns (the process must be of the broker's pod, not it).
    may_charge: Option<(ProcRef, String, i32, u32)>,
    /// Sources rolled back in this step: nothing of their trees may stay frozen.
    rolled_back: Vec<ProcRef>,
    /// Fenced roots (with their netns) whose trees may only be SIGKILLed.
    kill_roots: Vec<(ProcRef, u32)>,
    /// Fenced sources whose lease ended in this step: nothing of their trees may live.
    killed: Vec<ProcRef>,
    /// The one address that may be adopted, and the netns it may go into.
    adopt_into: Option<(u32, IpAddr)>,
    /// The adopted addresses that may be withdrawn (netns, address).
    may_withdraw: BTreeSet<(u32, IpAddr)>,
    /// Adopted addresses that may be announced though gone at the step's end (netns,
    /// address): see [`Harness::step`].
    announced_adoptions: BTreeSet<(u32, IpAddr)>,
}

impl Allowed {
    fn permits(
        &self,
        e: &Effect,
        pre: &BTreeMap<i32, Proc>,
        nets: &BTreeMap<u32, Net>,
        node: u32,
    ) -> bool {
        let in_a_tree = |pid: i32| {
            self.roots
                .iter()
                .any(|(r, _)| valid_root(pre, node, r) && tree_in(pre, r.pid).contains(&pid))
        };
        let in_a_fenced_tree = |pid: i32| {
            self.kill_roots
                .iter()
                .any(|(r, _)| valid_root(pre, node, r) && tree_in(pre, r.pid).contains(&pid))
        };
        match e {
            Effect::Signal {
                pid,
                sig: Signal::SIGKILL,
            } if in_a_fenced_tree(*pid) => true,
            Effect::Signal { pid, sig } => self.sigs.contains(sig) && in_a_tree(*pid),
            Effect::ReadAddrs { pid, .. } | Effect::RepairOff { pid, .. } => in_a_tree(*pid),
            Effect::LinkDown { netns, .. } => self.may_lock == Some(*netns) && *netns != node,
            // Only a pod's own address, on its own link, never from the node.
            Effect::Announced { netns, link, addr } => {
                let gone_adoption = addr
                    .parse()
                    .is_ok_and(|a| self.announced_adoptions.contains(&(*netns, a)));
                *netns != node
                    && (gone_adoption
                        || nets.get(netns).is_some_and(|n| {
                            n.addrs4
                                .iter()
                                .chain(&n.addrs6)
                                .any(|(a, l)| l == link && same_addr(a, addr))
                        }))
            }
            // Only the addresses of the source a lock names, from the node.
            Effect::Swept { addrs } => self.may_sweep.as_ref().is_some_and(|had| {
                addrs
                    .iter()
                    .all(|a| had.iter().any(|x| same_addr(x, &a.to_string())))
            }),
            Effect::Mounted { path, netns } => {
                self.may_mount.as_ref() == Some(&(path.clone(), *netns)) && *netns != node
            }
            // Only into the namespace of this agent's target holder, only the address
            // asked for, only one the hand-over allows.
            Effect::AddrAdded { netns, addr, .. } => {
                *netns != node && self.adopt_into == Some((*netns, *addr)) && may_adopt(*addr)
            }
            // Only an address the broker adopted, from where it adopted it.
            Effect::AddrRemoved { netns, addr, .. } => {
                *netns != node && self.may_withdraw.contains(&(*netns, *addr))
            }
            Effect::Charged { pid, to } => {
                self.may_charge
                    .as_ref()
                    .is_some_and(|(p, cg, broker, broker_netns)| {
                        pre.get(pid).is_some_and(|x| {
                            !x.zombie && x.start_time == p.start_time && x.netns == *broker_netns
                        }) && p.pid == *pid
                            && *pid != *broker
                            && to == cg
                            && under_pods_root(to, PODS_ROOT)
                    })
            }
            Effect::Moved { pid, to } => {
                self.may_move
                    .as_ref()
                    .is_some_and(|(root, ns, cg, holder)| {
                        let root_ok = pre.get(&root.pid).is_some_and(|x| {
                            !x.zombie
                                && x.start_time == root.start_time
                                && x.netns == *ns
                                && x.netns != node
                        });
                        root_ok
                            && root.pid != *holder
                            && tree_in(pre, root.pid).contains(pid)
                            && to == cg
                            && under_pods_root(to, PODS_ROOT)
                    })
            }
        }
    }
}

/// Whether process `p` is alive with its pinned start time.
fn live_as(procs: &BTreeMap<i32, Proc>, p: ProcRef) -> bool {
    procs
        .get(&p.pid)
        .is_some_and(|x| !x.zombie && x.start_time == p.start_time)
}

/// Whether `net` has address `a` (any link, any prefix length).
fn net_has(net: &Net, a: IpAddr) -> bool {
    net.addrs4
        .iter()
        .chain(&net.addrs6)
        .any(|(c, _)| same_addr(c, &a.to_string()))
}

/// Whether the broker cannot tell which link of `net` takes `a`: not there already, no
/// default route of its family, and not exactly one link but `lo`.
fn no_link_for(net: &Net, a: IpAddr) -> bool {
    let routes = if a.is_ipv4() {
        &net.routes4
    } else {
        &net.routes6
    };
    !net_has(net, a)
        && !routes.iter().any(|r| r.starts_with("default "))
        && net.links.keys().filter(|l| *l != "lo").count() != 1
}

/// A root the broker may act on: live with its pinned start time, in a pod cgroup, not
/// in the node's network namespace.
fn valid_root(pre: &BTreeMap<i32, Proc>, node: u32, p: &ProcRef) -> bool {
    pre.get(&p.pid).is_some_and(|x| {
        !x.zombie
            && x.start_time == p.start_time
            && under_pods_root(&x.cgroup, PODS_ROOT)
            && x.netns != node
    })
}

/// The tree rooted at `root` in a process table (root first).
fn tree_in(procs: &BTreeMap<i32, Proc>, root: i32) -> Vec<i32> {
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

/// The addresses of the TCP sockets of the live processes of the tree rooted at `root`,
/// each socket once (by inode), in tree order: what `list_sockets` must answer.
fn sockets_in(procs: &BTreeMap<i32, Proc>, root: i32) -> Vec<SocketAddrs> {
    let mut seen = BTreeSet::new();
    tree_in(procs, root)
        .iter()
        .filter_map(|pid| procs.get(pid).filter(|p| !p.zombie))
        .flat_map(|p| &p.sockets)
        .filter(|s| seen.insert(s.ino))
        .map(|s| s.addrs.clone())
        .collect()
}

/// After a fenced source's lease ended, nothing of its tree runs or stays stopped: it
/// was killed, never thawed.
fn check_killed(w: &World, pre: &BTreeMap<i32, Proc>, killed: &[ProcRef]) -> Result<(), String> {
    for p in killed.iter().filter(|p| valid_root(pre, w.node_netns, p)) {
        for pid in tree_in(pre, p.pid) {
            if let Some(x) = w.procs.get(&pid).filter(|x| !x.zombie) {
                return Err(format!(
                    "pid {pid} of a fenced source still alive after its lease ended: {x:?}"
                ));
            }
        }
    }
    Ok(())
}

/// After a rollback, nothing of the rolled-back trees stays stopped or in repair.
fn check_thawed(
    w: &World,
    pre: &BTreeMap<i32, Proc>,
    rolled_back: &[ProcRef],
) -> Result<(), String> {
    for p in rolled_back
        .iter()
        .filter(|p| valid_root(pre, w.node_netns, p))
    {
        for pid in w.tree(p.pid) {
            if let Some(x) = w.procs.get(&pid).filter(|x| !x.zombie)
                && (x.stopped || x.sockets.iter().any(|s| s.repair))
            {
                return Err(format!("pid {pid} still frozen after the rollback: {x:?}"));
            }
        }
    }
    Ok(())
}
