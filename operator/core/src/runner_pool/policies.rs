//! The addresses the Runner's NetworkPolicy keeps it from, and the other
//! NetworkPolicies that select the Runner pods.
//!
//! The Runner may reach DNS, the Server and "the internet outside every private range"
//! (agent-pods-in-own-namespace.txt): its catch-all egress rule is `0.0.0.0/0` and `::/0`
//! except [`DENIED_IPV4`] and [`denied_ipv6`], every range that is not the internet.
//! Enforcing the policy on the local cluster's real nodes (hack/lib/netpol.sh) showed
//! why "private" is not enough: that cluster's pods, Services, nodes and API server live
//! in 198.18.0.0/15 (set aside for benchmarking, not private), and the machine's own
//! uplink is 192.0.2.0/24 (documentation), so a list of only the RFC 1918, shared,
//! loopback and link-local ranges let a Runner reach every pod, the kubelets and the
//! API server. The lists are therefore every range of the IANA special-purpose address
//! registries that is not globally reachable, plus multicast and the reserved 240/4;
//! for IPv6 also the NAT64 well-known prefix (64:ff9b::/96) in front of each denied
//! IPv4 range, since a NAT64 gateway would otherwise carry the Runner to them.
//!
//! Allows are additive, so any other policy with an allow rule that selects our pods
//! can reopen what ours denies; the status names them. A policy without rules only
//! denies and is harmless.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube_core::ResourceExt;

/// IPv4 ranges the Runner's catch-all egress rule excludes: not globally reachable.
pub const DENIED_IPV4: [&str; 14] = [
    "0.0.0.0/8",       // "this network"
    "10.0.0.0/8",      // private (RFC 1918)
    "100.64.0.0/10",   // shared address space (carrier-grade NAT; some clusters' pods)
    "127.0.0.0/8",     // loopback
    "169.254.0.0/16",  // link-local: the cloud metadata address 169.254.169.254
    "172.16.0.0/12",   // private
    "192.0.0.0/24",    // IETF protocol assignments
    "192.0.2.0/24",    // documentation (TEST-NET-1)
    "192.168.0.0/16",  // private
    "198.18.0.0/15",   // benchmarking (RFC 2544): the local cluster's pods and Services
    "198.51.100.0/24", // documentation (TEST-NET-2)
    "203.0.113.0/24",  // documentation (TEST-NET-3)
    "224.0.0.0/4",     // multicast
    "240.0.0.0/4",     // reserved, and the limited broadcast address
];

/// IPv6 ranges that are not globally reachable (before the NAT64 ones).
// IPv4-mapped addresses (::ffff:0:0/96) are not listed: they never appear on the wire,
// and the API server rejects them in a NetworkPolicy ("must not have an IPv4-mapped
// IPv6 address"), which the real-node test found.
pub const NON_GLOBAL_IPV6: [&str; 8] = [
    "::/128",         // unspecified
    "::1/128",        // loopback
    "64:ff9b:1::/48", // local-use IPv4/IPv6 translation
    "100::/64",       // discard-only
    "2001:db8::/32",  // documentation
    "fc00::/7",       // unique local (holds the metadata address fd00:ec2::254)
    "fe80::/10",      // link-local
    "ff00::/8",       // multicast
];

/// The NAT64 well-known prefix (RFC 6052).
const NAT64_PREFIX: Ipv6Addr = Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0);

/// IPv6 ranges the Runner's catch-all egress rule excludes: [`NON_GLOBAL_IPV6`], then
/// each of [`DENIED_IPV4`] behind the NAT64 well-known prefix (`10.0.0.0/8` →
/// `64:ff9b::a00:0/104`).
pub fn denied_ipv6() -> Vec<String> {
    let nat64 = DENIED_IPV4.iter().map(|cidr| {
        let (addr, len) = cidr.split_once('/').expect("DENIED_IPV4 holds CIDRs");
        let v4: Ipv4Addr = addr.parse().expect("DENIED_IPV4 holds IPv4 addresses");
        let len: u8 = len.parse().expect("DENIED_IPV4 holds prefix lengths");
        let v6 = Ipv6Addr::from(u128::from(NAT64_PREFIX) | u128::from(u32::from(v4)));
        format!("{v6}/{}", 96 + len)
    });
    NON_GLOBAL_IPV6
        .iter()
        .map(|s| (*s).to_owned())
        .chain(nat64)
        .collect()
}

/// Whether `selector` matches `labels` (matchLabels and matchExpressions; an empty
/// selector matches everything, as in a NetworkPolicy's podSelector).
pub fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let by_label = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let by_expr = selector.match_expressions.iter().flatten().all(|e| {
        let have = labels.get(&e.key);
        let values = e.values.as_deref().unwrap_or_default();
        match e.operator.as_str() {
            "In" => have.is_some_and(|h| values.contains(h)),
            "NotIn" => have.is_none_or(|h| !values.contains(h)),
            "Exists" => have.is_some(),
            "DoesNotExist" => have.is_none(),
            _ => false,
        }
    });
    by_label && by_expr
}

/// Names of the policies other than `own` that select pods with `pod_labels` and
/// allow some traffic.
pub fn foreign_policies(
    own: &str,
    pod_labels: &BTreeMap<String, String>,
    policies: &[NetworkPolicy],
) -> Vec<String> {
    policies
        .iter()
        .filter(|p| p.name_any() != own)
        .filter(|p| {
            let Some(spec) = &p.spec else { return false };
            let selected = spec
                .pod_selector
                .as_ref()
                .is_none_or(|s| selects(s, pod_labels));
            let allows = spec.ingress.as_ref().is_some_and(|r| !r.is_empty())
                || spec.egress.as_ref().is_some_and(|r| !r.is_empty());
            selected && allows
        })
        .map(|p| p.name_any())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn np(name: &str, spec: serde_json::Value) -> NetworkPolicy {
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
    }
    fn runner_labels() -> BTreeMap<String, String> {
        BTreeMap::from([
            ("app.kubernetes.io/name".to_string(), "runner".to_string()),
            ("app.kubernetes.io/instance".to_string(), "rp".to_string()),
        ])
    }

    #[test]
    fn an_allow_all_policy_over_every_pod_is_foreign_and_ours_is_not() {
        let policies = vec![
            np("rp", json!({"podSelector": {}, "egress": [{}]})),
            np(
                "allow-all",
                json!({"podSelector": {}, "egress": [{}], "policyTypes": ["Egress"]}),
            ),
        ];
        assert_eq!(
            foreign_policies("rp", &runner_labels(), &policies),
            vec!["allow-all"]
        );
    }

    #[test]
    fn deny_only_and_non_selecting_policies_are_not_foreign() {
        let policies = vec![
            np(
                "default-deny",
                json!({"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}),
            ),
            np(
                "web",
                json!({"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [{}]}),
            ),
            np(
                "not-runners",
                json!({"podSelector": {"matchExpressions": [{"key": "app.kubernetes.io/name", "operator": "NotIn", "values": ["runner"]}]}, "ingress": [{}]}),
            ),
        ];
        assert!(foreign_policies("rp", &runner_labels(), &policies).is_empty());
    }

    fn v4(cidr: &str) -> (u32, u32) {
        let (a, l) = cidr.split_once('/').unwrap();
        let a: Ipv4Addr = a.parse().unwrap();
        let l: u32 = l.parse().unwrap();
        let mask = if l == 0 { 0 } else { u32::MAX << (32 - l) };
        (u32::from(a) & mask, mask)
    }
    fn v4_denied(ip: &str) -> bool {
        let ip = u32::from(ip.parse::<Ipv4Addr>().unwrap());
        DENIED_IPV4.iter().any(|c| {
            let (net, mask) = v4(c);
            ip & mask == net
        })
    }
    fn v6_denied(ip: &str) -> bool {
        let ip = u128::from(ip.parse::<Ipv6Addr>().unwrap());
        denied_ipv6().iter().any(|c| {
            let (a, l) = c.split_once('/').unwrap();
            let a = u128::from(a.parse::<Ipv6Addr>().unwrap());
            let l: u32 = l.parse().unwrap();
            let mask = if l == 0 { 0 } else { u128::MAX << (128 - l) };
            ip & mask == a & mask
        })
    }

    #[test]
    fn every_denied_range_is_a_canonical_cidr() {
        for c in DENIED_IPV4 {
            let (net, _) = v4(c);
            assert_eq!(
                c.split('/').next().unwrap(),
                Ipv4Addr::from(net).to_string(),
                "{c}"
            );
        }
        for c in denied_ipv6() {
            let (a, l) = c.split_once('/').unwrap();
            let l: u32 = l.parse().unwrap();
            assert!(l <= 128, "{c}");
            let a = u128::from(a.parse::<Ipv6Addr>().unwrap());
            let mask = if l == 0 { 0 } else { u128::MAX << (128 - l) };
            assert_eq!(a & !mask, 0, "{c} has host bits");
        }
    }

    #[test]
    fn metadata_private_cluster_and_local_addresses_are_denied() {
        for ip in [
            "169.254.169.254", // cloud metadata
            "10.255.0.1",
            "172.31.255.254",
            "192.168.1.1",
            "100.64.0.10",
            "127.0.0.1",
            "198.18.0.5",   // a pod of the local cluster
            "198.18.255.1", // its API server (the bridge's gateway)
            "198.19.0.1",   // its kubernetes Service
            "192.0.2.1",    // this machine's uplink gateway
            "224.0.0.251",  // mDNS
            "255.255.255.255",
            "0.0.0.0",
        ] {
            assert!(v4_denied(ip), "{ip} must be denied");
        }
        for ip in [
            "fd00:ec2::254", // AWS metadata over IPv6
            "fe80::1",
            "::1",
            "64:ff9b::a9fe:a9fe", // 169.254.169.254 through NAT64
            "64:ff9b::a00:1",     // 10.0.0.1 through NAT64
            "ff02::fb",
        ] {
            assert!(v6_denied(ip), "{ip} must be denied");
        }
    }

    #[test]
    fn the_internet_stays_reachable() {
        for ip in [
            "1.1.1.1",
            "8.8.8.8",
            "151.101.1.69",
            "198.20.0.1",
            "223.255.255.254",
        ] {
            assert!(!v4_denied(ip), "{ip} is on the internet");
        }
        for ip in [
            "2606:4700::1111",
            "2a00:1450:4001::200e",
            "64:ff9b::808:808",
        ] {
            assert!(!v6_denied(ip), "{ip} is on the internet");
        }
    }

    #[test]
    fn no_denied_range_is_ipv4_mapped_which_the_api_server_rejects() {
        for c in denied_ipv6() {
            let a: Ipv6Addr = c.split_once('/').unwrap().0.parse().unwrap();
            assert!(a.to_ipv4_mapped().is_none(), "{c}");
        }
    }

    #[test]
    fn nat64_ranges_embed_each_denied_ipv4_range() {
        let v6 = denied_ipv6();
        assert_eq!(v6.len(), NON_GLOBAL_IPV6.len() + DENIED_IPV4.len());
        assert!(v6.contains(&"64:ff9b::a00:0/104".to_string()), "{v6:?}");
        assert!(v6.contains(&"64:ff9b::a9fe:0/112".to_string()), "{v6:?}");
    }

    #[test]
    fn match_expressions_are_evaluated() {
        let s: LabelSelector = serde_json::from_value(json!({"matchExpressions": [
            {"key": "app.kubernetes.io/name", "operator": "In", "values": ["runner", "x"]},
            {"key": "gone", "operator": "DoesNotExist"}
        ]}))
        .unwrap();
        assert!(selects(&s, &runner_labels()));
        let mut l = runner_labels();
        l.insert("gone".into(), "1".into());
        assert!(!selects(&s, &l));
    }
}
