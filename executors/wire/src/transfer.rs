//! Sealing of checkpoint images in transit. The agents already talk mutual TLS, but a
//! cluster-wide agent certificate would let any agent read or inject any migration's
//! images; the per-migration key (from the migration's Secret, known only to the two
//! agents of this migration) closes that. Each chunk is ChaCha20-Poly1305 sealed with
//! nonce = stream sequence number and associated data = uid, path, offset, so chunks
//! cannot be reordered, replayed across migrations, moved to another file or dropped
//! at the end (the final chunk authenticates the count).

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};

pub const KEY_LEN: usize = 32;
/// Plaintext bytes per chunk.
pub const CHUNK: usize = 1 << 20;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TransferError {
    #[error("transfer key must be {KEY_LEN} bytes")]
    KeyLength,
    #[error("chunk failed authentication (wrong key, reordered or tampered)")]
    Tampered,
    #[error("chunk out of order: expected seq {expected}, got {got}")]
    OutOfOrder { expected: u64, got: u64 },
    #[error("bad image path {0:?}")]
    BadPath(String),
}

pub struct Sealer {
    aead: ChaCha20Poly1305,
    uid: String,
}

fn nonce(seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    Nonce::from(n)
}

fn aad(uid: &str, path: &str, offset: u64, end: bool) -> Vec<u8> {
    let mut a = Vec::with_capacity(uid.len() + path.len() + 12);
    a.extend_from_slice(uid.as_bytes());
    a.push(0);
    a.extend_from_slice(path.as_bytes());
    a.push(0);
    a.extend_from_slice(&offset.to_be_bytes());
    a.push(end as u8);
    a
}

impl Sealer {
    pub fn new(key: &[u8], uid: &str) -> Result<Self, TransferError> {
        if key.len() != KEY_LEN {
            return Err(TransferError::KeyLength);
        }
        Ok(Self {
            aead: ChaCha20Poly1305::new(Key::from_slice(key)),
            uid: uid.to_owned(),
        })
    }

    pub fn seal(&self, seq: u64, path: &str, offset: u64, end: bool, plain: &[u8]) -> Vec<u8> {
        let aad = aad(&self.uid, path, offset, end);
        self.aead
            .encrypt(
                &nonce(seq),
                Payload {
                    msg: plain,
                    aad: &aad,
                },
            )
            .expect("chacha20poly1305 encryption cannot fail for in-memory buffers")
    }

    pub fn open(
        &self,
        seq: u64,
        path: &str,
        offset: u64,
        end: bool,
        sealed: &[u8],
    ) -> Result<Vec<u8>, TransferError> {
        let aad = aad(&self.uid, path, offset, end);
        self.aead
            .decrypt(
                &nonce(seq),
                Payload {
                    msg: sealed,
                    aad: &aad,
                },
            )
            .map_err(|_| TransferError::Tampered)
    }
}

/// Validates a relative image path: one directory level and a file name, each
/// `[A-Za-z0-9._-]{1,128}`, never `.` or `..`.
pub fn check_image_path(p: &str) -> Result<(), TransferError> {
    let parts: Vec<&str> = p.split('/').collect();
    let ok = (1..=2).contains(&parts.len())
        && parts.iter().all(|c| {
            !c.is_empty()
                && c.len() <= 128
                && *c != "."
                && *c != ".."
                && c.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        });
    if ok {
        Ok(())
    } else {
        Err(TransferError::BadPath(p.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_chunk_opens_only_in_place() {
        let s = Sealer::new(&[7u8; 32], "m1").unwrap();
        let c = s.seal(3, "final/pages-1.img", 4096, false, b"secret pages");
        assert_eq!(
            s.open(3, "final/pages-1.img", 4096, false, &c).unwrap(),
            b"secret pages"
        );
        assert_eq!(
            s.open(4, "final/pages-1.img", 4096, false, &c),
            Err(TransferError::Tampered)
        );
        assert_eq!(
            s.open(3, "final/core-1.img", 4096, false, &c),
            Err(TransferError::Tampered)
        );
        assert_eq!(
            s.open(3, "final/pages-1.img", 0, false, &c),
            Err(TransferError::Tampered)
        );
        let other = Sealer::new(&[7u8; 32], "m2").unwrap();
        assert_eq!(
            other.open(3, "final/pages-1.img", 4096, false, &c),
            Err(TransferError::Tampered)
        );
        let wrong_key = Sealer::new(&[8u8; 32], "m1").unwrap();
        assert!(
            wrong_key
                .open(3, "final/pages-1.img", 4096, false, &c)
                .is_err()
        );
    }

    #[test]
    fn image_paths_cannot_escape_the_checkpoint_dir() {
        assert!(check_image_path("pre-1/pages-1.img").is_ok());
        assert!(check_image_path("manifest.json").is_ok());
        for bad in [
            "../x",
            "a/../b",
            "/etc/passwd",
            "a/b/c",
            "",
            "a//b",
            "a/.",
            "a b",
        ] {
            assert!(check_image_path(bad).is_err(), "{bad:?}");
        }
    }
}
