//! The hand-over's `ip` work: placing, announcing and withdrawing an adopted address in
//! the holder's namespace, and holding the node's neighbour entries.

use super::records::{link_name_ok, width};
use crate::netlock::{addr_lines, ipv6_optional, parse_links};
use crate::os::{Ip, Link};
use std::net::IpAddr;

/// Where `adopt_address` puts an address: already there (nothing to do), or onto a link.
pub(crate) enum Plan {
    Present,
    Onto(Link),
}

/// In the holder's namespace: is `a` there already, and if not, which link takes it —
/// the link of the family's default route, or else the only link but `lo`.
pub(crate) fn plan(ip: &mut dyn Ip, a: IpAddr) -> std::io::Result<Plan> {
    let present = addr_lines(&ip.ip(&["-o", "addr", "show"])?)
        .iter()
        .any(|l| l.address().parse::<IpAddr>().ok() == Some(a));
    if present {
        return Ok(Plan::Present);
    }
    let routes = if a.is_ipv4() {
        ip.ip(&["-4", "route", "show"])?
    } else {
        ipv6_optional(ip.ip(&["-6", "route", "show"]))?
    };
    let default_dev = routes.lines().find_map(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        (w.first() == Some(&"default"))
            .then(|| dev_of(&w))
            .flatten()
    });
    let links = parse_links(&ip.ip(&["-o", "link", "show"])?);
    let others: Vec<&Link> = links.iter().filter(|l| l.name != "lo").collect();
    let chosen = match &default_dev {
        Some(d) => links.iter().find(|l| &l.name == d),
        None if others.len() == 1 => Some(others[0]),
        None => None,
    };
    chosen.cloned().map(Plan::Onto).ok_or_else(|| {
        let names: Vec<&str> = others.iter().map(|l| l.name.as_str()).collect();
        std::io::Error::other(match default_dev {
            Some(d) => format!("the default route's link {d} is not listed"),
            None => format!(
                "no default route for {a}'s family and {} links but lo ({}): which one carries {a} is not known",
                names.len(),
                names.join(", ")
            ),
        })
    })
}

/// The link a route names (`... dev eth0 ...`).
pub(crate) fn dev_of(words: &[&str]) -> Option<String> {
    let i = words.iter().position(|w| *w == "dev")?;
    words.get(i + 1).map(|s| (*s).to_owned())
}

/// Adds `a` to `link` as a host address, unannounced (see the module docs: the
/// announcement waits for the restored tree, [`Broker::mark_restored`]).
pub(crate) fn add(ip: &mut dyn Ip, link: &Link, a: IpAddr) -> std::io::Result<()> {
    match a {
        IpAddr::V4(_) => ip.ip(&["-4", "addr", "add", &format!("{a}/32"), "dev", &link.name])?,
        // nodad: the address was in use a moment ago (on the source); no duplicate
        // detection delay, and usable at once as the advertisement's source.
        IpAddr::V6(_) => ip.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{a}/128"),
            "dev",
            &link.name,
            "nodad",
        ])?,
    };
    Ok(())
}

/// Announces each of `adopted` (address, link name) from its link, in the holder's
/// namespace (best effort, as the unlock's announcements: a failure is logged).
pub(crate) fn announce_adopted(
    ip: &mut dyn Ip,
    adopted: &[(IpAddr, String)],
) -> std::io::Result<()> {
    let links = parse_links(&ip.ip(&["-o", "link", "show"])?);
    // Only what the link still holds: a release whose withdrawal was done but whose
    // journal write failed leaves its record in memory (found by the fuzzer), and
    // announcing an address the pod no longer has would draw its traffic to it.
    let held = addr_lines(&ip.ip(&["-o", "addr", "show"])?);
    for (a, name) in adopted {
        let on_link = held.iter().any(|l| {
            l.link == *name
                && l.cidr
                    .split('/')
                    .next()
                    .and_then(|x| x.parse::<IpAddr>().ok())
                    == Some(*a)
        });
        if !on_link {
            tracing::warn!(link = %name, address = %a, "adopted address not announced: not on its link any more");
            continue;
        }
        match links.iter().find(|l| l.name == *name && l.mac.is_some()) {
            None => {
                tracing::warn!(link = %name, address = %a, "adopted address not announced: no such link with a MAC");
            }
            Some(link) => {
                if let Err(e) = ip.announce(link, *a) {
                    tracing::warn!(error = %e, link = %name, address = %a, "adopted address not announced");
                }
            }
        }
    }
    Ok(())
}

/// A node neighbour entry `lock_network` holds (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    pub address: IpAddr,
    /// The node's device the entry is on.
    pub dev: String,
}

/// The `-4` / `-6` flag of `a`'s family.
pub(crate) fn family(a: IpAddr) -> &'static str {
    if a.is_ipv4() { "-4" } else { "-6" }
}

/// In the node's namespace: sets the entry of each of `addrs` `INCOMPLETE` on the
/// device the node routes it through; what it held.
pub(crate) fn hold(ip: &mut dyn Ip, addrs: &[IpAddr]) -> Vec<Held> {
    let mut held = Vec::new();
    for a in addrs {
        let a_s = a.to_string();
        let dev = match ip.ip(&[family(*a), "route", "get", &a_s]) {
            Ok(out) => dev_of(&out.split_whitespace().collect::<Vec<_>>()),
            Err(e) => {
                tracing::warn!(error = %e, address = %a, "lock: no node route to the address, not held");
                continue;
            }
        };
        let Some(dev) = dev.filter(|d| link_name_ok(d)) else {
            continue;
        };
        match ip.ip(&[
            family(*a),
            "neigh",
            "replace",
            &a_s,
            "dev",
            &dev,
            "nud",
            "incomplete",
        ]) {
            Ok(_) => held.push(Held { address: *a, dev }),
            Err(e) => {
                tracing::warn!(error = %e, address = %a, %dev, "lock: the node's neighbour entry not held");
            }
        }
    }
    held
}

/// In the node's namespace: deletes each of `held` that is still `INCOMPLETE` (no
/// announcement reached it); a resolved one is left as it is.
pub(crate) fn release(ip: &mut dyn Ip, held: &[Held]) -> std::io::Result<()> {
    for h in held {
        let a = h.address.to_string();
        let out = ip.ip(&[family(h.address), "neigh", "show", &a, "dev", &h.dev])?;
        if out.contains("INCOMPLETE") {
            ip.ip(&[family(h.address), "neigh", "del", &a, "dev", &h.dev])?;
        }
    }
    Ok(())
}

/// Removes `a` where it is a host address (`/32`, `/128`) of any link: what
/// `adopt_address` added, wherever the link went since. Absent is done.
pub(crate) fn withdraw(ip: &mut dyn Ip, a: IpAddr) -> std::io::Result<()> {
    let host = format!("{a}/{}", width(a));
    for l in addr_lines(&ip.ip(&["-o", "addr", "show"])?) {
        let len = l
            .cidr
            .rsplit_once('/')
            .and_then(|(_, n)| n.parse::<u8>().ok());
        if l.address().parse::<IpAddr>().ok() == Some(a) && len == Some(width(a)) {
            let family = if a.is_ipv4() { "-4" } else { "-6" };
            ip.ip(&[family, "addr", "del", &host, "dev", &l.link])?;
        }
    }
    Ok(())
}
