//! Reading a length-prefixed frame off a broker connection (both sides).

use crate::{err, kerr};
use podmotion_wire::broker::*;
use std::io::Read;
use std::os::unix::net::UnixStream;

/// Reads one length-prefixed frame's body; `None` when the peer closed between frames.
/// An error (a read failure, a length over the cap, a frame cut short) leaves the
/// stream unframeable.
pub(crate) fn read_request_frame(s: &mut UnixStream) -> Result<Option<Vec<u8>>, BrokerError> {
    let mut prefix = [0u8; 4];
    if !read_full(s, &mut prefix)? {
        return Ok(None);
    }
    let len = check_len(prefix, MAX_FRAME)?;
    let mut body = vec![0u8; len];
    match read_full(s, &mut body) {
        Ok(true) => Ok(Some(body)),
        _ => Err(err(
            ErrorKind::Truncated,
            "connection closed inside a frame",
        )),
    }
}

/// Reads exactly `buf.len()` bytes; Ok(false) on a clean EOF before the first byte.
pub(crate) fn read_full(s: &mut UnixStream, buf: &mut [u8]) -> Result<bool, BrokerError> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => {
                return Err(err(
                    ErrorKind::Truncated,
                    "connection closed inside a frame",
                ));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(e)),
        }
    }
    Ok(true)
}

/// An I/O error on a broker connection; a deadline passed (a socket timeout) says so.
pub(crate) fn io_err(e: std::io::Error) -> BrokerError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            err(ErrorKind::Kernel, "no answer within the call deadline")
        }
        _ => kerr(e),
    }
}
