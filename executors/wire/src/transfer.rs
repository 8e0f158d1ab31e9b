//! Sealing of checkpoint images in transit. The agents already talk mutual TLS, but a
//! cluster-wide agent certificate would let any agent read or inject any migration's
//! images; the per-migration key (from the migration's Secret, known only to the two
//! agents of this migration) closes that. Each chunk is XChaCha20-Poly1305 sealed with
//! associated data = uid, path, offset, so chunks cannot be moved to another migration
//! or file or dropped at the end (the final chunk authenticates the count).
//!
//! One migration key seals many streams (every pre-copy round is a Send, and an
//! interrupted Send is retried from the start), so the nonce is never a bare stream
//! counter: it is a fresh random 128-bit stream id (carried in the stream's first
//! chunk) followed by the 64-bit sequence number. XChaCha20 derives the cipher key
//! from the migration key and those first 16 bytes (HChaCha20), so every stream runs
//! under its own subkey with a counter nonce: no (key, nonce) pair repeats within a
//! stream, and across streams only if two random 128-bit ids collide.

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};

pub const KEY_LEN: usize = 32;
/// Bytes of the random stream id, the first part of every nonce of the stream.
pub const STREAM_ID_LEN: usize = 16;
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
    #[error("stream id must be {STREAM_ID_LEN} bytes")]
    StreamId,
    #[error("bad image path {0:?}")]
    BadPath(String),
}

/// Every (key, nonce) a [`Sealer`] sealed under, for tests that prove none repeats.
pub type NonceLog = std::sync::Arc<std::sync::Mutex<Vec<(Vec<u8>, Vec<u8>)>>>;

/// Seals or opens the chunks of one stream.
pub struct Sealer {
    aead: XChaCha20Poly1305,
    uid: String,
    stream: [u8; STREAM_ID_LEN],
    key: Vec<u8>,
    log: Option<NonceLog>,
}

fn nonce(stream: &[u8; STREAM_ID_LEN], seq: u64) -> XNonce {
    let mut n = [0u8; 24];
    n[..STREAM_ID_LEN].copy_from_slice(stream);
    n[STREAM_ID_LEN..].copy_from_slice(&seq.to_be_bytes());
    XNonce::from(n)
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
    /// The sealer of the stream `stream_id`: the sender draws a fresh random id for
    /// every stream (never reuse one), the receiver takes it from the first chunk.
    pub fn new(key: &[u8], uid: &str, stream_id: &[u8]) -> Result<Self, TransferError> {
        if key.len() != KEY_LEN {
            return Err(TransferError::KeyLength);
        }
        let stream: [u8; STREAM_ID_LEN] =
            stream_id.try_into().map_err(|_| TransferError::StreamId)?;
        Ok(Self {
            aead: XChaCha20Poly1305::new(Key::from_slice(key)),
            uid: uid.to_owned(),
            stream,
            key: key.to_vec(),
            log: None,
        })
    }

    pub fn stream_id(&self) -> &[u8] {
        &self.stream
    }

    /// Records every (key, nonce) this sealer seals under into `log`.
    pub fn recording(mut self, log: NonceLog) -> Self {
        self.log = Some(log);
        self
    }

    pub fn seal(&self, seq: u64, path: &str, offset: u64, end: bool, plain: &[u8]) -> Vec<u8> {
        let aad = aad(&self.uid, path, offset, end);
        if let Some(l) = &self.log {
            l.lock()
                .expect("nonce log")
                .push((self.key.clone(), nonce(&self.stream, seq).to_vec()));
        }
        self.aead
            .encrypt(
                &nonce(&self.stream, seq),
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
                &nonce(&self.stream, seq),
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
        let s = Sealer::new(&[7u8; 32], "m1", &[1; 16]).unwrap();
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
        let other = Sealer::new(&[7u8; 32], "m2", &[1; 16]).unwrap();
        assert_eq!(
            other.open(3, "final/pages-1.img", 4096, false, &c),
            Err(TransferError::Tampered)
        );
        let other_stream = Sealer::new(&[7u8; 32], "m1", &[2; 16]).unwrap();
        assert_eq!(
            other_stream.open(3, "final/pages-1.img", 4096, false, &c),
            Err(TransferError::Tampered),
            "a chunk does not open in another stream (a replay from an earlier Send)"
        );
        assert_eq!(
            Sealer::new(&[7u8; 32], "m1", &[1; 12]).err(),
            Some(TransferError::StreamId)
        );
        let wrong_key = Sealer::new(&[8u8; 32], "m1", &[1; 16]).unwrap();
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
