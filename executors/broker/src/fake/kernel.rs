//! [`FakeKernel`]: the broker's [`Kernel`] over a shared [`World`], with enough of `ip`
//! ([`Net`]'s commands) to lock and restore a namespace.

use super::world::*;
use crate::os::{Ip, Kernel, Link};
use nix::sys::signal::Signal;
use podmotion_wire::broker::{BrokerError, ErrorKind, SocketAddrs};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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

pub(super) fn no_such(pid: i32) -> BrokerError {
    BrokerError::new(ErrorKind::NoSuchProcess, format!("pid {pid} is not alive"))
}

pub(super) fn kernel_err(m: impl Into<String>) -> BrokerError {
    BrokerError::new(ErrorKind::Kernel, m)
}

pub(super) struct FakeIp<'a> {
    w: &'a mut World,
    ns: u32,
}

pub(super) fn dev_of(words: &[&str]) -> Option<String> {
    words
        .iter()
        .position(|w| *w == "dev")
        .and_then(|i| words.get(i + 1))
        .map(|s| (*s).to_owned())
}

impl FakeIp<'_> {
    /// An injected `ip` failure (`Fault::Ip(n)`): the `n`th command from now fails
    /// (this one when `n` is 0, which ends the fault).
    fn ip_fault_fires(&mut self) -> bool {
        let Some(Fault::Ip(n)) = self.w.fault else {
            return false;
        };
        self.w.fault = n.checked_sub(1).map(Fault::Ip);
        n == 0
    }
}

/// The effect of an address added to (`add`) or removed from `link` of `netns`.
fn addr_effect(add: bool, netns: u32, link: String, addr: IpAddr) -> Effect {
    if add {
        Effect::AddrAdded { netns, link, addr }
    } else {
        Effect::AddrRemoved { netns, link, addr }
    }
}

impl Ip for FakeIp<'_> {
    /// The few `ip` commands the broker runs, over the process's [`Net`]; anything
    /// else fails as unsupported.
    fn ip(&mut self, args: &[&str]) -> std::io::Result<String> {
        let fail = |m: &str| Err(std::io::Error::other(format!("ip {}: {m}", args.join(" "))));
        if self.ip_fault_fires() {
            return fail("injected failure");
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
                    self.w.effects.push(addr_effect(add, netns, link, *addr));
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

    /// The few `nft -f` statements the broker writes, one transaction: `table inet
    /// <t>` (declares it), `delete table inet <t>` (fails if absent), `table inet <t>
    /// {` … `}` (its body, kept as written). Anything else fails the whole script.
    fn nft(&mut self, script: &str) -> std::io::Result<()> {
        if self.w.take_fault(|f| f == Fault::Nft) {
            return Err(std::io::Error::other("nft: injected failure"));
        }
        let n = self.w.nets.get_mut(&self.ns).expect("netns of a process");
        let mut tables = n.nft.clone();
        let mut lines = script.lines();
        while let Some(l) = lines.next() {
            let fail = |m: &str| Err(std::io::Error::other(format!("nft: {l:?}: {m}")));
            match l.split_whitespace().collect::<Vec<_>>()[..] {
                [] => {}
                ["table", "inet", t] => {
                    tables.entry(t.to_owned()).or_default();
                }
                ["delete", "table", "inet", t] => {
                    if tables.remove(t).is_none() {
                        return fail("no such table");
                    }
                }
                ["table", "inet", t, "{"] => {
                    let body: Vec<&str> = lines.by_ref().take_while(|l| *l != "}").collect();
                    tables.insert(t.to_owned(), body.join("\n"));
                }
                _ => return fail("unsupported by the fake"),
            }
        }
        n.nft = tables;
        Ok(())
    }
}

/// Whether `cidr` (`<addr>/<len>`) is the address `addr`, however either is written.
pub(super) fn same_addr(cidr: &str, addr: &str) -> bool {
    let ip = |s: &str| s.parse::<std::net::IpAddr>().ok();
    cidr.split('/')
        .next()
        .and_then(ip)
        .is_some_and(|a| Some(a) == ip(addr))
}

/// One line per entry, as `ip route show` prints routes.
pub(super) fn lines(v: &[String]) -> String {
    v.iter().map(|r| format!("{r}\n")).collect()
}

impl Net {
    /// A link's 1-based index (`ip -o` prints it first).
    pub(super) fn index(&self, l: &str) -> usize {
        self.links.keys().position(|k| k == l).unwrap_or(0) + 1
    }

    /// `ip -o link show up`: the links up, veths as `<name>@if<peer>`.
    pub(super) fn links_up(&self) -> String {
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
    pub(super) fn global_addrs6(&self) -> String {
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
    pub(super) fn links_all(&self, ns: u32) -> String {
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
    pub(super) fn addrs(&self) -> String {
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
    pub(super) fn set_link(&mut self, link: &str, up: bool) -> Result<(), &'static str> {
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
    pub(super) fn host_addr(
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
    pub(super) fn replace_addr6(&mut self, addr: &str, link: &str) -> Result<(), &'static str> {
        if !self.links.contains_key(link) {
            return Err("Cannot find device");
        }
        self.addrs6.insert((addr.to_owned(), link.to_owned()));
        Ok(())
    }

    /// `ip -4|-6 route replace ROUTE…`: over a link that is up, through a gateway only
    /// once the link's connected route is there; replaces the route to the same
    /// destination.
    pub(super) fn replace_route(&mut self, v4: bool, route: &[&str]) -> Result<(), &'static str> {
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

    fn hold_syns(
        &self,
        chain: String,
        held: crate::synhold::Held,
    ) -> std::io::Result<crate::synhold::Hold> {
        let mut w = self.world();
        if w.holds.contains_key(&chain) {
            return Err(std::io::Error::other(format!("chain {chain} exists")));
        }
        w.effects.push(Effect::HoldStarted {
            chain: chain.clone(),
            held: held.clone(),
        });
        w.holds.insert(chain.clone(), held);
        let k = self.clone();
        let c = chain.clone();
        Ok(crate::synhold::Hold::new(chain, move |how| {
            let mut w = k.world();
            w.holds.remove(&c);
            w.effects.push(Effect::HoldEnded { chain: c, how });
            Ok(0)
        }))
    }

    fn remove_hold(&self, chain: &str) -> std::io::Result<()> {
        let mut w = self.world();
        if w.holds.remove(chain).is_some() {
            w.effects.push(Effect::HoldEnded {
                chain: chain.to_string(),
                how: crate::synhold::End::Drop,
            });
        }
        Ok(())
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
