//! The per-migration transfer key, derived rather than stored.
//!
//! Each migration's checkpoint images are sealed under a 32-byte key the two agents
//! receive in `Prepare`. The operator derives it as HMAC-SHA256(master, label ‖ UID)
//! from a master key it is given as a file (the chart mounts it from a Secret in the
//! operator's namespace). Deriving means the operator never reads a Secret back — it
//! holds no `get` on Secrets outside its own namespace — and gets the same key after
//! a restart. The per-migration Secret it still writes (owned by the PodMigration,
//! immutable) is the record that a key was issued; nothing reads it.

use sha2::{Digest, Sha256};

/// Length of a transfer key and of the master key.
pub const KEY_LEN: usize = 32;

/// Domain separation: a key derived here is never a key for anything else.
const LABEL: &[u8] = b"podmotion.io/transfer-key/v1\0";

/// A transfer key. Its `Debug` never prints the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct TransferKey(pub [u8; KEY_LEN]);

impl std::fmt::Debug for TransferKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TransferKey(<redacted>)")
    }
}

/// The master key transfer keys are derived from.
#[derive(Clone)]
pub struct MasterKey([u8; KEY_LEN]);

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MasterKey(<redacted>)")
    }
}

impl MasterKey {
    /// From file contents: at least 32 bytes (raw, or any text such as base64 — the
    /// bytes are hashed to 32).
    pub fn from_material(material: &[u8]) -> Result<MasterKey, String> {
        let trimmed = material.trim_ascii();
        if trimmed.len() < KEY_LEN {
            return Err(format!(
                "the migration master key needs at least {KEY_LEN} bytes, got {}",
                trimmed.len()
            ));
        }
        Ok(MasterKey(Sha256::digest(trimmed).into()))
    }

    /// From 32 random bytes (local runs without a key file).
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> MasterKey {
        MasterKey(bytes)
    }

    /// The transfer key of the migration with `uid`.
    pub fn transfer_key(&self, uid: &str) -> TransferKey {
        let mut msg = LABEL.to_vec();
        msg.extend_from_slice(uid.as_bytes());
        TransferKey(hmac_sha256(&self.0, &msg))
    }
}

/// HMAC-SHA256 (RFC 2104) for keys no longer than the block size.
fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let pad = |b: u8| k.map(|x| x ^ b);
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn hmac_matches_rfc_4231_test_cases_1_and_6() {
        assert_eq!(
            hex(&hmac_sha256(&[0x0b; 20], b"Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        assert_eq!(
            hex(&hmac_sha256(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn a_migration_gets_the_same_key_after_a_restart_and_no_other_migration_does() {
        let m = MasterKey::from_material(&[b'k'; 40]).unwrap();
        let again = MasterKey::from_material(&[b'k'; 40]).unwrap();
        assert_eq!(m.transfer_key("uid-1"), again.transfer_key("uid-1"));
        assert_ne!(m.transfer_key("uid-1"), m.transfer_key("uid-2"));
        let other = MasterKey::from_material(&[b'j'; 40]).unwrap();
        assert_ne!(m.transfer_key("uid-1"), other.transfer_key("uid-1"));
    }

    #[test]
    fn a_short_master_key_is_refused_and_keys_never_print() {
        let e = MasterKey::from_material(b"  too short \n").unwrap_err();
        assert!(e.contains("at least 32 bytes"), "{e}");
        let m = MasterKey::from_bytes([1; 32]);
        assert_eq!(format!("{m:?}"), "MasterKey(<redacted>)");
        assert_eq!(
            format!("{:?}", m.transfer_key("u")),
            "TransferKey(<redacted>)"
        );
    }
}
