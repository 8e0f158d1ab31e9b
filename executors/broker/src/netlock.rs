//! A pod's network lock: its links set down and its routes and IPv6 addresses saved
//! (`lock`), and put back (`unlock`), read and written through `ip` in its namespace.

use crate::{Ip, Kernel, Link, Lock, kerr};
use podmotion_wire::broker::BrokerError;

/// An IPv6 read: empty when the kernel has no IPv6 ("not supported"), otherwise as is.
pub(crate) fn ipv6_optional(r: std::io::Result<String>) -> std::io::Result<String> {
    match r {
        Err(e) if e.to_string().contains("not supported") => Ok(String::new()),
        r => r,
    }
}

/// Isolates the pod's network namespace: every non-loopback link down (incoming
/// segments and SYNs are dropped silently and retransmitted by the peers, nothing is
/// reset, and the frozen source cannot emit anything), routes saved for `unlock`.
pub(crate) fn lock<K: Kernel>(k: &K, pid: i32) -> Result<Lock, BrokerError> {
    k.in_netns(pid, |ip| {
        let lines = |out: String| -> Vec<String> {
            out.lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_owned)
                .collect()
        };
        let routes = lines(ip.ip(&["-4", "route", "show"])?);
        // A namespace without IPv6 (disabled in the kernel) has nothing to save; any
        // other failure fails the lock before anything is taken down (an IPv6 route
        // that was not saved could not be restored).
        let routes6 = lines(ipv6_optional(ip.ip(&["-6", "route", "show"]))?);
        let links: Vec<String> = ip
            .ip(&["-o", "link", "show", "up"])?
            .lines()
            .filter_map(|l| {
                let name = l.split(':').nth(1)?.trim();
                let name = name.split('@').next()?;
                (name != "lo").then(|| name.to_owned())
            })
            .collect();
        let addrs6 = global_ipv6_addrs(
            &ipv6_optional(ip.ip(&["-6", "-o", "addr", "show", "scope", "global"]))?,
            &links,
        );
        let mut lock = Lock {
            links: Vec::new(),
            routes,
            routes6,
            addrs6,
        };
        for l in links {
            if let Err(e) = ip.ip(&["link", "set", "dev", &l, "down"]) {
                // Half locked: give back what was taken down before reporting the
                // failure — nobody else would (no lock is recorded).
                let _ = restore(ip, &lock);
                return Err(e);
            }
            lock.links.push(l);
        }
        Ok(lock)
    })
    .map_err(kerr)
}

pub(crate) fn unlock<K: Kernel>(k: &K, pid: i32, l: &Lock) -> Result<(), BrokerError> {
    let l = l.clone();
    k.in_netns(pid, move |ip| {
        restore(ip, &l)?;
        announce(ip, &l.links);
        Ok(())
    })
    .map_err(kerr)
}

/// Tells the pod's neighbours that its addresses are back: for each address of each link
/// the lock took down, a gratuitous ARP (IPv4) or an unsolicited Neighbour Advertisement
/// (global IPv6). While the links were down, a neighbour that sent to the pod (the node,
/// for a client's retransmission or a probe) failed to resolve it; a connection it
/// opens just after the unlock can join that failing resolution and get EHOSTUNREACH
/// ("No route to host") for up to its probe time (3 s by default). The announcement
/// settles its entry at once. Best effort: a failure is logged, never a failed unlock
/// (the neighbours then resolve the pod on their own).
pub(crate) fn announce(ip: &mut dyn Ip, locked: &[String]) {
    let links = match ip.ip(&["-o", "link", "show"]) {
        Ok(out) => parse_links(&out),
        Err(e) => {
            tracing::warn!(error = %e, "unlock: links not listed, addresses not announced");
            return;
        }
    };
    let addrs = match ip.ip(&["-o", "addr", "show"]) {
        Ok(out) => addr_lines(&out),
        Err(e) => {
            tracing::warn!(error = %e, "unlock: addresses not listed, not announced");
            return;
        }
    };
    // Every IPv4 address, and the IPv6 addresses of global scope (a link-local address
    // is new after the link comes back, and still tentative).
    let announced = addrs
        .into_iter()
        .filter(|a| !a.v6 || a.global)
        .filter_map(|a| {
            Some((
                a.link.clone(),
                a.address().parse::<std::net::IpAddr>().ok()?,
            ))
        });
    for (name, addr) in announced {
        let Some(link) = links
            .iter()
            .find(|k| k.name == name && k.mac.is_some() && locked.contains(&k.name))
        else {
            continue;
        };
        if let Err(e) = ip.announce(link, addr) {
            tracing::warn!(error = %e, link = %name, %addr, "unlock: address not announced");
        }
    }
}

/// `ip -o link show` output (`2: eth0@if7: <...> mtu 1500 ... \    link/ether
/// 36:9a:9a:24:f0:ec brd ff:ff:ff:ff:ff:ff link-netnsid 0`) as links.
pub(crate) fn parse_links(out: &str) -> Vec<Link> {
    out.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let index = w.next()?.strip_suffix(':')?.parse().ok()?;
            let name = w
                .next()?
                .trim_end_matches(':')
                .split('@')
                .next()?
                .to_owned();
            let mut rest = w.skip_while(|t| *t != "link/ether");
            let mac = rest.next().and_then(|_| parse_mac(rest.next()?));
            Some(Link { name, index, mac })
        })
        .collect()
}

pub(crate) fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// One line of `ip -o addr show` (`2: eth0    inet 198.18.1.21/24 brd ... scope global
/// eth0\\ ...`, `4: eth0@if9    inet6 2001:db8::5/64 scope global \\ ...`).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct AddrLine {
    pub(crate) link: String,
    pub(crate) v6: bool,
    /// `<addr>/<len>`, as printed.
    pub(crate) cidr: String,
    /// `scope global`.
    pub(crate) global: bool,
}

impl AddrLine {
    /// The address without its prefix length.
    pub(crate) fn address(&self) -> &str {
        self.cidr.split('/').next().unwrap_or(&self.cidr)
    }
}

/// The address lines of `ip -o addr show` output (the one reading of it: the
/// namespace's addresses, the IPv6 addresses a lock saves, the addresses an unlock
/// announces).
pub(crate) fn addr_lines(out: &str) -> Vec<AddrLine> {
    out.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let link = w.nth(1)?.split('@').next()?.to_owned();
            let v6 = match w.next()? {
                "inet" => false,
                "inet6" => true,
                _ => return None,
            };
            let cidr = w.next()?.to_owned();
            let global = w.skip_while(|t| *t != "scope").nth(1) == Some("global");
            Some(AddrLine {
                link,
                v6,
                cidr,
                global,
            })
        })
        .collect()
}

/// Links up, IPv6 addresses back, routes restored: the inverse of [`lock`], inside the
/// pod's network namespace.
pub(crate) fn restore(ip: &mut dyn Ip, l: &Lock) -> std::io::Result<()> {
    {
        for link in &l.links {
            ip.ip(&["link", "set", "dev", link, "up"])?;
        }
        for a in &l.addrs6 {
            // nodad: the address was in use a moment ago; no duplicate detection delay.
            let mut args = vec!["-6", "addr", "replace"];
            args.extend(a.split_whitespace());
            args.push("nodad");
            ip.ip(&args)?;
        }
        // Routes come back in dependency order: a gateway route needs the route to
        // its gateway first, so retry the failures while each pass makes progress.
        let mut left: Vec<(&str, &String)> = (l.routes.iter().map(|r| ("-4", r)))
            .chain(l.routes6.iter().map(|r| ("-6", r)))
            .collect();
        let mut last_err = None;
        while !left.is_empty() {
            let before = left.len();
            left.retain(|(family, r)| {
                let mut args = vec![*family, "route", "replace"];
                args.extend(r.split_whitespace().filter(|w| *w != "linkdown"));
                match ip.ip(&args) {
                    Ok(_) => false,
                    Err(e) => {
                        last_err = Some(e);
                        true
                    }
                }
            });
            if left.len() == before {
                return Err(last_err
                    .take()
                    .unwrap_or_else(|| std::io::Error::other("route restore")));
            }
        }
        Ok(())
    }
}

/// The global IPv6 addresses of `links` in `ip -6 -o addr show scope global` output
/// (`2: eth0    inet6 2001:db8::5/64 scope global \ ...`), as `<addr>/<len> dev <link>`.
pub(crate) fn global_ipv6_addrs(out: &str, links: &[String]) -> Vec<String> {
    addr_lines(out)
        .into_iter()
        .filter(|a| a.v6 && links.contains(&a.link))
        .map(|a| format!("{} dev {}", a.cidr, a.link))
        .collect()
}
