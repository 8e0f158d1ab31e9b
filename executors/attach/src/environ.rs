//! The target container's environment, read from `/proc/<pid>/environ` of its pinned
//! process ([`crate::pinned`]).
//!
//! This is the fully resolved, post-start environment of the container's init
//! process. Entries keep their order and duplicates (a process may legitimately carry
//! `A=1` twice; what the application sees is what we report). The sidecar's
//! AppEnvironment treatment follows: drop excluded names, then prefix the rest.

use crate::pinned::Pinned;
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EnvEntry {
    pub name: String,
    pub value: String,
}

/// Splits a NUL-separated environ block. An entry without `=` is kept with an empty
/// value (the kernel does not enforce the `NAME=value` shape); bytes that are not
/// UTF-8 are replaced rather than dropping the entry.
pub fn parse_environ(raw: &[u8]) -> Vec<EnvEntry> {
    raw.split(|b| *b == 0)
        .filter(|e| !e.is_empty())
        .map(|e| {
            let s = String::from_utf8_lossy(e);
            match s.split_once('=') {
                Some((n, v)) => EnvEntry {
                    name: n.to_owned(),
                    value: v.to_owned(),
                },
                None => EnvEntry {
                    name: s.into_owned(),
                    value: String::new(),
                },
            }
        })
        .collect()
}

/// Prefixing and filtering applied after reading.
#[derive(Debug, Clone, Default)]
pub struct EnvFilter {
    /// Prepended to every name that survives the exclusion.
    pub prefix: String,
    /// Names to drop; an entry ending in `*` drops every name with that prefix.
    pub exclude: Vec<String>,
}

impl EnvFilter {
    fn excluded(&self, name: &str) -> bool {
        self.exclude.iter().any(|pat| match pat.strip_suffix('*') {
            Some(p) => name.starts_with(p),
            None => name == pat,
        })
    }

    pub fn apply(&self, entries: Vec<EnvEntry>) -> Vec<EnvEntry> {
        entries
            .into_iter()
            .filter(|e| !self.excluded(&e.name))
            .map(|e| EnvEntry {
                name: format!("{}{}", self.prefix, e.name),
                value: e.value,
            })
            .collect()
    }
}

pub fn read_environ(target: &Pinned) -> std::io::Result<Vec<EnvEntry>> {
    Ok(parse_environ(&target.read("environ")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[EnvEntry]) -> Vec<String> {
        v.iter()
            .map(|e| format!("{}={}", e.name, e.value))
            .collect()
    }

    #[test]
    fn environ_keeps_order_and_duplicates() {
        let got = parse_environ(b"B=2\0A=1\0B=3\0EMPTY=\0WEIRD\0URL=a=b\0");
        assert_eq!(
            names(&got),
            vec!["B=2", "A=1", "B=3", "EMPTY=", "WEIRD=", "URL=a=b"]
        );
    }

    #[test]
    fn filter_drops_excluded_then_prefixes() {
        let f = EnvFilter {
            prefix: "TEL_".into(),
            exclude: vec!["HOME".into(), "KUBERNETES_*".into()],
        };
        let got = f.apply(parse_environ(
            b"HOME=/\0KUBERNETES_SERVICE_HOST=x\0A=1\0KUBERNETESX=k\0A=2\0",
        ));
        assert_eq!(names(&got), vec!["TEL_A=1", "TEL_KUBERNETESX=k", "TEL_A=2"]);
    }
}
