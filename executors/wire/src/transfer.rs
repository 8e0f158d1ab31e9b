//! Sealing of checkpoint images in transit. The agents already talk mutual TLS, but a
//! cluster-wide agent certificate would let any agent read or inject any migration's
//! images; the per-migration key (from the migration's Secret, known only to the two
//! agents of this migration) closes that. Each chunk is AES-256-GCM sealed (ring, with
//! the CPU's AES and carry-less multiply instructions) with associated data = uid,
//! path, offset, so chunks cannot be moved to another migration or file or dropped at
//! the end (the final chunk authenticates the count).
//!
//! One migration key seals many streams (every pre-copy round is a Send, and an
//! interrupted Send is retried from the start), so no stream ever seals under the
//! migration key itself: every Send draws a fresh random 128-bit stream id (carried in
//! the stream's first chunk) and seals under its own subkey
//! `HKDF-SHA256(ikm = migration key, salt = stream id, info = label ‖ uid)`, with the
//! 96-bit nonce `0³² ‖ seq` (the 64-bit chunk number, strictly increasing within the
//! stream). No (key, nonce) pair repeats within a stream (the counter never repeats);
//! across streams the subkeys differ unless two random 128-bit ids collide (or
//! HKDF-SHA256 collides). A subkey seals one stream of [`CHUNK`]-byte chunks (about a
//! thousand per GiB of image), far inside AES-GCM's limits for one key.

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hkdf;

pub const KEY_LEN: usize = 32;
/// Bytes of the random stream id, the salt of the stream's subkey.
pub const STREAM_ID_LEN: usize = 16;
/// Plaintext bytes per chunk.
pub const CHUNK: usize = 1 << 20;
/// Bytes the seal adds to a chunk (the GCM tag).
pub const TAG_LEN: usize = 16;
/// HKDF info label of the stream subkeys: a new sealing scheme gets a new label.
const LABEL: &[u8] = b"podmotion transfer v2 aes-256-gcm\0";

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

/// Every (key, nonce) a [`Sealer`] sealed under — the stream's AES key and the GCM
/// nonce, exactly what the cipher got — for tests that prove none repeats.
pub type NonceLog = std::sync::Arc<std::sync::Mutex<Vec<(Vec<u8>, Vec<u8>)>>>;

/// Seals or opens the chunks of one stream.
pub struct Sealer {
    aead: LessSafeKey,
    uid: String,
    stream: [u8; STREAM_ID_LEN],
    /// The stream's subkey, for the record of a [`NonceLog`].
    sub: [u8; KEY_LEN],
    log: Option<NonceLog>,
}

fn nonce_bytes(seq: u64) -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    n[NONCE_LEN - 8..].copy_from_slice(&seq.to_be_bytes());
    n
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

/// The subkey of one stream: HKDF-SHA256 of the migration key, salted with the
/// stream id, bound to the migration UID.
fn stream_key(key: &[u8], uid: &str, stream: &[u8; STREAM_ID_LEN]) -> [u8; KEY_LEN] {
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, stream).extract(key);
    let mut out = [0u8; KEY_LEN];
    prk.expand(&[LABEL, uid.as_bytes()], hkdf::HKDF_SHA256)
        .and_then(|okm| okm.fill(&mut out))
        .expect("HKDF-SHA256 yields 32 bytes");
    out
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
        let sub = stream_key(key, uid, &stream);
        let aead = LessSafeKey::new(
            UnboundKey::new(&AES_256_GCM, &sub).expect("a 32-byte key is an AES-256 key"),
        );
        Ok(Self {
            aead,
            uid: uid.to_owned(),
            stream,
            sub,
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

    /// Seals `buf` (the plaintext) in place and appends the tag.
    pub fn seal_in_place(&self, seq: u64, path: &str, offset: u64, end: bool, buf: &mut Vec<u8>) {
        if let Some(l) = &self.log {
            l.lock()
                .expect("nonce log")
                .push((self.sub.to_vec(), nonce_bytes(seq).to_vec()));
        }
        self.aead
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce_bytes(seq)),
                Aad::from(aad(&self.uid, path, offset, end)),
                buf,
            )
            .expect("AES-GCM sealing of a chunk cannot fail");
    }

    pub fn seal(&self, seq: u64, path: &str, offset: u64, end: bool, plain: &[u8]) -> Vec<u8> {
        let mut buf = Vec::with_capacity(plain.len() + TAG_LEN);
        buf.extend_from_slice(plain);
        self.seal_in_place(seq, path, offset, end, &mut buf);
        buf
    }

    /// Opens a sealed chunk in place: on success `sealed` becomes the plaintext.
    pub fn open_in_place(
        &self,
        seq: u64,
        path: &str,
        offset: u64,
        end: bool,
        sealed: &mut Vec<u8>,
    ) -> Result<(), TransferError> {
        let n = self
            .aead
            .open_in_place(
                Nonce::assume_unique_for_key(nonce_bytes(seq)),
                Aad::from(aad(&self.uid, path, offset, end)),
                sealed,
            )
            .map_err(|_| TransferError::Tampered)?
            .len();
        sealed.truncate(n);
        Ok(())
    }

    pub fn open(
        &self,
        seq: u64,
        path: &str,
        offset: u64,
        end: bool,
        sealed: &[u8],
    ) -> Result<Vec<u8>, TransferError> {
        let mut buf = sealed.to_vec();
        self.open_in_place(seq, path, offset, end, &mut buf)?;
        Ok(buf)
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
    fn every_stream_seals_under_its_own_subkey_never_the_migration_key() {
        let key = [7u8; 32];
        let a = Sealer::new(&key, "m1", &[1; 16]).unwrap();
        let again = Sealer::new(&key, "m1", &[1; 16]).unwrap();
        let b = Sealer::new(&key, "m1", &[2; 16]).unwrap();
        let other_uid = Sealer::new(&key, "m2", &[1; 16]).unwrap();
        // The receiver derives the sender's subkey from the stream id it is sent.
        assert_eq!(a.sub, again.sub);
        assert_ne!(a.sub, b.sub, "a new stream id, a new subkey");
        assert_ne!(a.sub, other_uid.sub, "the subkey is bound to the migration");
        assert_ne!(
            a.sub, key,
            "nothing is sealed under the migration key itself"
        );
        // The same plaintext at the same position seals differently in two streams.
        assert_ne!(
            a.seal(0, "final/pages-1.img", 0, false, &[0; 64]),
            b.seal(0, "final/pages-1.img", 0, false, &[0; 64])
        );
        // The nonce is the chunk number: distinct for distinct chunks.
        assert_ne!(nonce_bytes(1), nonce_bytes(1 << 32));
        assert_eq!(nonce_bytes(5)[..4], [0; 4]);
    }

    #[test]
    fn sealing_in_place_appends_the_tag_and_opening_in_place_removes_it() {
        let s = Sealer::new(&[3u8; 32], "m1", &[9; 16]).unwrap();
        let mut buf = b"pages".to_vec();
        s.seal_in_place(1, "final/pages-1.img", 0, false, &mut buf);
        assert_eq!(buf.len(), 5 + TAG_LEN);
        assert_eq!(buf, s.seal(1, "final/pages-1.img", 0, false, b"pages"));
        let mut bad = buf.clone();
        bad[0] ^= 1;
        assert_eq!(
            s.open_in_place(1, "final/pages-1.img", 0, false, &mut bad),
            Err(TransferError::Tampered)
        );
        s.open_in_place(1, "final/pages-1.img", 0, false, &mut buf)
            .unwrap();
        assert_eq!(buf, b"pages");
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
