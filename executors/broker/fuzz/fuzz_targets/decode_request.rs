//! Any byte string fed to the broker's framing and decoder, read the way the broker
//! reads a frame (4-byte big-endian length, then that many bytes of body), must yield a
//! typed error or a request whose UID re-validates and that re-encodes to itself; never
//! a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use podmotion_wire::broker::{MAX_FRAME, check_len, decode_request, encode_frame};
use podmotion_wire::ids::MigrationUid;

fuzz_target!(|data: &[u8]| {
    let Some((prefix, rest)) = data.split_first_chunk::<4>() else {
        return;
    };
    let Ok(len) = check_len(*prefix, MAX_FRAME) else {
        return;
    };
    let body = &rest[..len.min(rest.len())];
    if let Ok(req) = decode_request(body) {
        assert!(MigrationUid::parse(req.uid().as_str()).is_ok());
        // What we accept re-encodes to something we accept again, identically.
        let f = encode_frame(&req);
        assert_eq!(decode_request(&f[4..]).expect("re-decodes"), req);
    }
});
