//! Any byte string fed to the broker's framing and decoder must yield a typed error or
//! a request whose UID re-validates; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use podmotion_wire::broker::{check_len, decode_request, encode_frame};
use podmotion_wire::ids::MigrationUid;

fuzz_target!(|data: &[u8]| {
    if data.len() >= 4 {
        let _ = check_len([data[0], data[1], data[2], data[3]]);
    }
    if let Ok(req) = decode_request(data) {
        assert!(MigrationUid::parse(req.uid().as_str()).is_ok());
        // What we accept re-encodes to something we accept again, identically.
        let f = encode_frame(&req);
        assert_eq!(decode_request(&f[4..]).expect("re-decodes"), req);
    }
});
