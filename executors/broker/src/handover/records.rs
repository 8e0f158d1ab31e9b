//! What the hand-over is configured with and journals: the CIDRs, the addresses never
//! adopted, and the adoption records.

use crate::err;
use podmotion_wire::broker::{BrokerError, ErrorKind};
use podmotion_wire::ids::ProcRef;
use std::net::IpAddr;

/// The most addresses one migration may adopt (a pod has one per family, a few at most
/// with several interfaces): more is refused with `AddressNotAllowed`.
pub const MAX_ADOPTED: usize = 8;

/// An IPv4 or IPv6 network, `address/prefix-length` (`198.18.0.0/15`,
/// `2001:db8::/32`): the address hand-over's allow-list (`--address-handover-cidrs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    network: IpAddr,
    len: u8,
}

pub(crate) fn bits(a: IpAddr) -> u128 {
    match a {
        IpAddr::V4(v) => u128::from(u32::from(v)),
        IpAddr::V6(v) => u128::from(v),
    }
}

pub(crate) fn width(a: IpAddr) -> u8 {
    if a.is_ipv4() { 32 } else { 128 }
}

impl Cidr {
    /// The mask of this prefix length over the family's width (as a u128, low bits).
    fn mask(&self) -> u128 {
        let w = u32::from(width(self.network));
        let all = if w == 32 {
            u128::from(u32::MAX)
        } else {
            u128::MAX
        };
        // `len` 0: nothing fixed (every address of the family).
        all & all.checked_shl(w - u32::from(self.len)).unwrap_or(0)
    }

    /// Whether `a` (of the same family) lies in this network.
    pub fn contains(&self, a: IpAddr) -> bool {
        self.network.is_ipv4() == a.is_ipv4() && (bits(a) ^ bits(self.network)) & self.mask() == 0
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;

    /// `address/length`, the address without host bits (`198.18.1.0/15` is refused: a
    /// typo or a misunderstanding, not a network).
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, l) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not a CIDR (address/prefix-length)"))?;
        let network: IpAddr = a
            .parse()
            .map_err(|_| format!("{s:?}: {a:?} is not an IP address"))?;
        let max = width(network);
        let len = Some(l)
            .filter(|l| !l.is_empty() && l.len() <= 3 && l.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|l| l.parse::<u8>().ok())
            .filter(|n| *n <= max)
            .ok_or_else(|| format!("{s:?}: prefix length {l:?} is not 0 to {max}"))?;
        let c = Cidr { network, len };
        if bits(network) & !c.mask() != 0 {
            return Err(format!(
                "{s:?}: the address has bits set past the prefix length"
            ));
        }
        Ok(c)
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.network, self.len)
    }
}

/// A comma-separated list of CIDRs (`--address-handover-cidrs`); empty pieces are
/// skipped, so an empty list (the hand-over off) is the empty string. An invalid entry
/// fails the whole list, naming it.
pub fn parse_cidrs(list: &str) -> Result<Vec<Cidr>, String> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect()
}

/// Why `a` is never a pod's address to adopt, whatever the CIDRs allow: the addresses
/// every namespace has of its own or that name no one host.
pub fn never_a_pods(a: IpAddr) -> Option<&'static str> {
    match a {
        IpAddr::V4(v) if v.is_loopback() => Some("a loopback address"),
        IpAddr::V4(v) if v.is_unspecified() => Some("the unspecified address"),
        IpAddr::V4(v) if v.is_multicast() => Some("a multicast address"),
        IpAddr::V4(v) if v.is_link_local() => Some("a link-local address"),
        IpAddr::V4(v) if v.is_broadcast() => Some("the broadcast address"),
        IpAddr::V6(v) if v.is_loopback() => Some("a loopback address"),
        IpAddr::V6(v) if v.is_unspecified() => Some("the unspecified address"),
        IpAddr::V6(v) if v.is_multicast() => Some("a multicast address"),
        IpAddr::V6(v) if v.segments()[0] & 0xffc0 == 0xfe80 => Some("a link-local address"),
        IpAddr::V6(v) if v.to_ipv4_mapped().is_some() => {
            Some("an IPv4-mapped address (adopt the IPv4 address itself)")
        }
        _ => None,
    }
}

/// Whether `a` may be adopted under `cidrs` (non-empty: the hand-over is on).
pub fn check_address(cidrs: &[Cidr], a: IpAddr) -> Result<(), BrokerError> {
    if let Some(why) = never_a_pods(a) {
        return Err(err(
            ErrorKind::AddressNotAllowed,
            format!("{a} is {why}: never adopted"),
        ));
    }
    if !cidrs.iter().any(|c| c.contains(a)) {
        let list: Vec<String> = cidrs.iter().map(Cidr::to_string).collect();
        return Err(err(
            ErrorKind::AddressNotAllowed,
            format!("{a} is outside the hand-over CIDRs ({})", list.join(", ")),
        ));
    }
    Ok(())
}

/// One adopted address, as journalled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adoption {
    /// The target pod's holder the address was added for (its network namespace).
    pub holder: ProcRef,
    pub address: IpAddr,
    /// The link it was added to.
    pub link: String,
    /// When the sweep withdraws it whatever uses it (unix time, seconds).
    pub deadline: u64,
    /// The restored tree was moved into the holder's cgroup (`move_cgroup`): the address
    /// outlives the registration while a moved connection uses it.
    pub restored: bool,
}

impl Adoption {
    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "pid": self.holder.pid, "start_time": self.holder.start_time,
            "address": self.address.to_string(), "link": self.link,
            "deadline": self.deadline, "restored": self.restored,
        })
    }

    fn from_json(v: &serde_json::Value) -> Option<Adoption> {
        let holder = ProcRef {
            pid: i32::try_from(v.get("pid")?.as_i64()?).ok()?,
            start_time: v.get("start_time")?.as_u64()?,
        };
        let link = v.get("link")?.as_str()?.to_owned();
        (holder.pid > 1 && link_name_ok(&link)).then_some(())?;
        Some(Adoption {
            holder,
            address: v.get("address")?.as_str()?.parse().ok()?,
            link,
            deadline: v.get("deadline")?.as_u64()?,
            restored: v.get("restored")?.as_bool()?,
        })
    }
}

/// A link name as the kernel allows it (1 to 15 bytes, no `/`, whitespace or NUL): what
/// a journal record may name (it comes back as an `ip` argument).
pub(crate) fn link_name_ok(l: &str) -> bool {
    (1..=15).contains(&l.len())
        && l != "."
        && l != ".."
        && !l
            .bytes()
            .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace() || b == 0)
}

/// The journal body of one migration's adoptions.
pub fn journal_body(records: &[Adoption]) -> Vec<u8> {
    let list: Vec<serde_json::Value> = records.iter().map(Adoption::to_json).collect();
    serde_json::json!({ "adoptions": list })
        .to_string()
        .into_bytes()
}

/// A journal body's adoptions; `None` if anything in it does not parse.
pub fn parse_journal_body(body: &[u8]) -> Option<Vec<Adoption>> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.get("adoptions")?
        .as_array()?
        .iter()
        .map(Adoption::from_json)
        .collect()
}
