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

/// The longest container ID accepted (containerd, CRI-O and Docker use 64 hex digits).
pub const MAX_CONTAINER_ID_LEN: usize = 128;

/// A container's ID as its runtime names it, without the kubelet's `<runtime>://`
/// prefix: `[A-Za-z0-9_.-]{1,128}`, not `.` or `..`. The broker looks for it among
/// the path components of a process's cgroup, so nothing that could span or climb
/// components is allowed: no `/`, NUL, whitespace or non-ASCII.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct ContainerId(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContainerIdError {
    #[error("container id is empty")]
    Empty,
    #[error("container id is longer than {MAX_CONTAINER_ID_LEN} bytes")]
    TooLong,
    #[error("container id may only contain [A-Za-z0-9_.-] (found byte {0:#04x})")]
    BadChar(u8),
    #[error("container id may not be '.' or '..'")]
    Dots,
}

impl ContainerId {
    pub fn parse(s: &str) -> Result<Self, ContainerIdError> {
        if s.is_empty() {
            return Err(ContainerIdError::Empty);
        }
        if s.len() > MAX_CONTAINER_ID_LEN {
            return Err(ContainerIdError::TooLong);
        }
        if let Some(b) = s
            .bytes()
            .find(|b| !(b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-')))
        {
            return Err(ContainerIdError::BadChar(b));
        }
        if s == "." || s == ".." {
            return Err(ContainerIdError::Dots);
        }
        Ok(Self(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for ContainerId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ContainerId::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for ContainerId {
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
    #[test]
    fn runtime_container_ids_are_accepted() {
        for good in [
            "3d359f10a9c1e6f0b2a4d8c7e5f60718293a4b5c6d7e8f90a1b2c3d4e5f6a7b2f",
            "c1",
            "pmtb123-workload",
            "6f1c1e1a-3b7e-4d0e-9a3c-0d1f2e3a4b5c-app",
            "A_b.c-D",
            "...",
            ".hidden",
        ] {
            assert_eq!(ContainerId::parse(good).unwrap().as_str(), good);
        }
        assert!(ContainerId::parse(&"a".repeat(MAX_CONTAINER_ID_LEN)).is_ok());
    }

    #[test]
    fn hostile_container_ids_are_rejected() {
        for (bad, why) in [
            ("", ContainerIdError::Empty),
            (".", ContainerIdError::Dots),
            ("..", ContainerIdError::Dots),
            ("../x", ContainerIdError::BadChar(b'/')),
            ("a/b", ContainerIdError::BadChar(b'/')),
            ("/", ContainerIdError::BadChar(b'/')),
            ("containerd://abc", ContainerIdError::BadChar(b':')),
            ("a\0b", ContainerIdError::BadChar(0)),
            ("a b", ContainerIdError::BadChar(b' ')),
            ("a\n", ContainerIdError::BadChar(b'\n')),
            ("ü", ContainerIdError::BadChar(0xc3)),
            ("a*", ContainerIdError::BadChar(b'*')),
        ] {
            assert_eq!(ContainerId::parse(bad), Err(why), "{bad:?}");
        }
        assert_eq!(
            ContainerId::parse(&"a".repeat(MAX_CONTAINER_ID_LEN + 1)),
            Err(ContainerIdError::TooLong)
        );
    }

    #[test]
    fn a_malformed_container_id_is_refused_when_deserialized() {
        assert!(serde_json::from_str::<ContainerId>(r#""../x""#).is_err());
        assert_eq!(
            serde_json::from_str::<ContainerId>(r#""abc""#).unwrap(),
            ContainerId::parse("abc").unwrap()
        );
    }
}
