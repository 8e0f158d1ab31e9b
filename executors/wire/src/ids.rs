//! Identifiers that cross a trust boundary, validated where they are parsed.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The longest migration UID accepted (a Kubernetes UID is 36 characters).
pub const MAX_UID_LEN: usize = 63;

/// A migration UID: `[a-z0-9-]{1,63}`, not starting or ending with `-`. It is used to
/// compute paths (`/run/podmotion/checkpoints/<uid>`), so nothing else is allowed:
/// no `/`, `.`, whitespace, NUL or shell metacharacters.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct MigrationUid(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UidError {
    #[error("migration uid is empty")]
    Empty,
    #[error("migration uid is longer than {MAX_UID_LEN} bytes")]
    TooLong,
    #[error("migration uid may only contain [a-z0-9-] (found byte {0:#04x})")]
    BadChar(u8),
    #[error("migration uid may not start or end with '-'")]
    EdgeHyphen,
}

impl MigrationUid {
    pub fn parse(s: &str) -> Result<Self, UidError> {
        if s.is_empty() {
            return Err(UidError::Empty);
        }
        if s.len() > MAX_UID_LEN {
            return Err(UidError::TooLong);
        }
        if let Some(b) = s
            .bytes()
            .find(|b| !(b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-'))
        {
            return Err(UidError::BadChar(b));
        }
        if s.starts_with('-') || s.ends_with('-') {
            return Err(UidError::EdgeHyphen);
        }
        Ok(Self(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for MigrationUid {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        MigrationUid::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for MigrationUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A process named by pid *and* start time (field 22 of `/proc/<pid>/stat`, in clock
/// ticks since boot), so a recycled pid never matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcRef {
    pub pid: i32,
    pub start_time: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_uids_are_accepted() {
        assert!(MigrationUid::parse("6f1c1e1a-3b7e-4d0e-9a3c-0d1f2e3a4b5c").is_ok());
        assert!(MigrationUid::parse("a").is_ok());
    }

    #[test]
    fn hostile_uids_are_rejected() {
        for bad in [
            "", "../etc", "a/b", "a.b", "A", "a b", "a;rm", "a\0", "-a", "a-", "$(x)", "a\n",
        ] {
            assert!(MigrationUid::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(MigrationUid::parse(&"a".repeat(64)), Err(UidError::TooLong));
    }
}
