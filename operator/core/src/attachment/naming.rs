//! Deterministic agent Job names: `<prefix>-<hash of "namespace/pod">`.
//!
//! The name depends only on the target, so a retried or restarted reconcile resolves to
//! the Job already created for it, two pods never share a Job, and a successor for the
//! same target can only be created once its predecessor is gone (same name).

use crate::meta::sha256_hex;

/// Hex digits of the hash in a Job name (64 bits: no collision among 10,000 targets
/// short of a ~1e-11 chance; the unit test proves it for a concrete set).
const HASH_LEN: usize = 16;
/// Longest Job name: Job names become label values (`batch.kubernetes.io/job-name`).
pub const MAX_NAME: usize = 63;

/// The agent Job's name for pod `namespace/pod`, under `prefix` (shortened and cleaned
/// to a DNS label prefix if needed). Always at most 63 characters.
pub fn job_name(prefix: &str, namespace: &str, pod: &str) -> String {
    let hash = sha256_hex(format!("{namespace}/{pod}").as_bytes(), HASH_LEN);
    let mut p: String = prefix
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(MAX_NAME - HASH_LEN - 1)
        .collect();
    while p.ends_with('-') {
        p.pop();
    }
    while p.starts_with('-') {
        p.remove(0);
    }
    if p.is_empty() {
        format!("a-{hash}")
    } else {
        format!("{p}-{hash}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn name_is_deterministic_and_depends_on_namespace_and_pod() {
        let a = job_name("pm-agent", "shop", "web-0");
        assert_eq!(a, job_name("pm-agent", "shop", "web-0"));
        assert_ne!(a, job_name("pm-agent", "shop", "web-1"));
        assert_ne!(a, job_name("pm-agent", "shop2", "web-0"));
        // "a/b-c" vs "a-b/c" must not be confused: the separator is part of the hash input.
        assert_ne!(job_name("p", "a", "b-c"), job_name("p", "a-b", "c"));
        assert!(a.starts_with("pm-agent-"), "{a}");
    }

    #[test]
    fn ten_thousand_targets_get_ten_thousand_distinct_names() {
        let mut names = BTreeSet::new();
        for ns in 0..100 {
            for pod in 0..100 {
                names.insert(job_name(
                    "podmotion-agent",
                    &format!("ns-{ns}"),
                    &format!("web-{pod}"),
                ));
            }
        }
        assert_eq!(names.len(), 10_000);
    }

    #[test]
    fn long_or_odd_prefixes_still_give_a_valid_dns_label() {
        let long = "x".repeat(200);
        for prefix in [long.as_str(), "-Agent_Prefix-", "", "---"] {
            let n = job_name(prefix, &"n".repeat(63), &"p".repeat(253));
            assert!(n.len() <= MAX_NAME, "{n} is {} long", n.len());
            assert!(
                n.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{n}"
            );
            assert!(!n.starts_with('-') && !n.ends_with('-'), "{n}");
        }
    }
}
