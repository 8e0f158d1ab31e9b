//! Client side, used by the agent: one connection = one lease.

use crate::err;
use crate::frame::{io_err, read_full};
use nix::sys::socket::MsgFlags;
use podmotion_wire::broker::*;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

pub struct BrokerClient {
    s: UnixStream,
}

impl BrokerClient {
    pub fn connect(path: &std::path::Path) -> std::io::Result<Self> {
        Ok(Self {
            s: UnixStream::connect(path)?,
        })
    }

    /// Connects, and bounds every call: a broker that does not take a request or
    /// answer it within `deadline` fails the call, and the connection is closed
    /// (a frame cut off leaves nothing to read the next answer from). The
    /// connection is the migration's lease, so its end hands what was registered
    /// on it back to the broker, which undoes it (rolls the source back, or kills
    /// it if fenced) when it gets to it.
    pub fn connect_with_deadline(
        path: &std::path::Path,
        deadline: Duration,
    ) -> std::io::Result<Self> {
        let s = UnixStream::connect(path)?;
        s.set_read_timeout(Some(deadline))?;
        s.set_write_timeout(Some(deadline))?;
        Ok(Self { s })
    }

    pub fn call(&mut self, req: &Request) -> Result<Reply, BrokerError> {
        match self.exchange(req) {
            Ok(Response::Ok(r)) => Ok(r),
            // The broker's answer: the connection is as good as before.
            Ok(Response::Err(e)) => Err(e),
            // The framing is lost (the deadline passed, or the broker went away
            // inside a frame): end the lease rather than read a stale answer later.
            Err(mut e) => {
                let _ = self.s.shutdown(std::net::Shutdown::Both);
                e.message = format!(
                    "{}: {} (this migration's broker connection, its lease, is closed: the broker undoes what it holds)",
                    req.name(),
                    e.message
                );
                Err(e)
            }
        }
    }

    /// One request and its answer; an error only where the connection failed.
    fn exchange(&mut self, req: &Request) -> Result<Response, BrokerError> {
        self.s.write_all(&encode_frame(req)).map_err(io_err)?;
        let mut prefix = [0u8; 4];
        if !read_full(&mut self.s, &mut prefix)? {
            return Err(err(ErrorKind::Truncated, "broker closed the connection"));
        }
        let len = check_len(prefix, MAX_REPLY_FRAME)?;
        let mut body = vec![0u8; len];
        read_full(&mut self.s, &mut body)?;
        decode_response(&body)
    }

    /// Whether the broker has closed this connection (it ended it, or it exited):
    /// every later call fails, and what was registered on it is the broker's to
    /// undo (the lease's end, or the journal when the broker starts again).
    pub fn closed(&self) -> bool {
        let mut b = [0u8; 1];
        matches!(
            nix::sys::socket::recv(
                self.s.as_raw_fd(),
                &mut b,
                MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT
            ),
            Ok(0) | Err(nix::errno::Errno::ECONNRESET)
        )
    }
}
