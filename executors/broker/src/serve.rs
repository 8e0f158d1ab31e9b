//! The socket side of the broker: owning the run directory, binding the socket,
//! one thread per connection, the peer check, and one answer per frame.

use crate::frame::read_request_frame;
use crate::{Broker, Kernel, err, kerr};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use podmotion_wire::broker::*;
use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl<K: Kernel> Broker<K> {
    /// Takes the run directory (waiting up to `owner_wait` for a broker that still
    /// holds it to end), recovers what a previous broker left there, starts the sweep
    /// of adopted addresses, binds the socket (0600) and serves forever, one thread per
    /// connection.
    pub fn serve(
        self: &Arc<Self>,
        socket: &std::path::Path,
        owner_wait: std::time::Duration,
    ) -> std::io::Result<()> {
        let _owner = self.own_run_dir(owner_wait)?;
        self.recover();
        self.spawn_sweeper();
        let listener = self.bind(socket)?;
        self.serve_listener(listener)
    }

    /// The broker's end (SIGTERM, SIGINT). It serves on for up to `grace`, so that its
    /// agent, stopping in the same pod, can still resume or kill the sources it froze
    /// through it, and ends as soon as no registration is left and no recovery
    /// ([`Broker::recover`]) is under way. Then it does for each
    /// registration still held what a lost lease does (an unfenced frozen source rolled
    /// back, a fenced one killed, a forward of new connections deleted) and returns how
    /// many there were. What it did to the node does not outlive it: before, it died at
    /// once and left that to the next broker on the node (none after an uninstall).
    pub fn stop(&self, grace: std::time::Duration) -> usize {
        let deadline = std::time::Instant::now() + grace;
        while (self.registrations() > 0 || self.recovering())
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let conns: std::collections::BTreeSet<u64> = self.map().values().map(|e| e.conn).collect();
        let left = self.registrations();
        for conn in conns {
            self.lease_lost(conn);
        }
        left
    }

    /// An exclusive `flock` on `<run-dir>/netns/.lock`, held while the broker lives.
    /// Everything under that directory is this broker's: at start it rolls back the
    /// journalled locks and unbinds every netns mount point there, which would wreck
    /// the migrations of another broker using the same directory (two releases with
    /// one `migrationAgent.netnsDir` on a node). A second broker waits up to `wait` for
    /// the first to end — the broker of a replaced agent pod, still finishing its
    /// recovery or its stop grace, must not send the new one into a crash loop's
    /// back-off while a source it would roll back stays frozen — and is refused after.
    fn own_run_dir(
        &self,
        wait: std::time::Duration,
    ) -> std::io::Result<nix::fcntl::Flock<std::fs::File>> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let dir = self.cfg.run_dir.join("netns");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
        let path = dir.join(".lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)?;
        let deadline = std::time::Instant::now() + wait;
        let (mut file, mut waited) = (file, false);
        loop {
            match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
                Ok(owner) => return Ok(owner),
                Err((f, nix::errno::Errno::EWOULDBLOCK))
                    if std::time::Instant::now() < deadline =>
                {
                    if !std::mem::replace(&mut waited, true) {
                        tracing::warn!(
                            path = %path.display(),
                            wait_seconds = wait.as_secs(),
                            "another broker holds this run directory: waiting for it to end"
                        );
                    }
                    file = f;
                    std::thread::sleep(std::time::Duration::from_millis(200));
                }
                Err((_, e)) => {
                    return Err(std::io::Error::other(format!(
                        "{}: {e}: another broker serves this run directory on this node (two PodMotion releases with one migrationAgent.netnsDir?); give each release its own",
                        path.display()
                    )));
                }
            }
        }
    }

    pub fn bind(&self, socket: &std::path::Path) -> std::io::Result<UnixListener> {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::remove_file(socket);
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // Created under a 0077 umask-equivalent: chmod before anyone can connect
        // matters less than it seems (connect needs write permission, checked per
        // connect), but we also check the peer uid.
        let l = UnixListener::bind(socket)?;
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))?;
        Ok(l)
    }

    pub fn serve_listener(self: &Arc<Self>, listener: UnixListener) -> std::io::Result<()> {
        for conn in listener.incoming() {
            let conn = conn?;
            let me = Arc::clone(self);
            std::thread::spawn(move || me.connection(conn));
        }
        Ok(())
    }

    fn connection(self: Arc<Self>, mut s: UnixStream) {
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.peer_allowed(&s) {
            tracing::warn!(error = %e, "refused peer");
            let _ = s.write_all(&encode_frame(&Response::Err(e)));
            return;
        }
        let _ = s.set_read_timeout(None);
        loop {
            let body = match read_request_frame(&mut s) {
                Ok(Some(body)) => body,
                Ok(None) => break,
                Err(e) => {
                    // The rest of the stream cannot be framed any more: answer and close.
                    let _ = s.write_all(&encode_frame(&Response::Err(e)));
                    break;
                }
            };
            if s.write_all(&encode_frame(&self.answer(id, &body))).is_err() {
                break;
            }
        }
        self.lease_lost(id);
    }

    /// The peer runs as the agent's uid and, where required, in the broker's pod.
    fn peer_allowed(&self, s: &UnixStream) -> Result<(), BrokerError> {
        match getsockopt(s, PeerCredentials) {
            Ok(c) if c.uid() == self.cfg.allowed_uid && self.cfg.same_netns_peers => {
                same_pod(&self.kernel, c.pid())
            }
            Ok(c) if c.uid() == self.cfg.allowed_uid => Ok(()),
            Ok(c) => Err(err(
                ErrorKind::PeerNotAllowed,
                format!("peer uid {} is not the agent's uid", c.uid()),
            )),
            Err(e) => Err(kerr(e)),
        }
    }

    /// The response to one frame's body (decoded, validated, handled).
    fn answer(&self, conn: u64, body: &[u8]) -> Response {
        let resp = match decode_request(body).and_then(|req| {
            tracing::info!(op = req.name(), uid = %req.uid(), conn, "request");
            self.handle(conn, req)
        }) {
            Ok(reply) => Response::Ok(reply),
            Err(e) => Response::Err(e),
        };
        if let Response::Err(e) = &resp {
            tracing::warn!(kind = ?e.kind, message = %e.message, "rejected");
        }
        resp
    }
}

/// The peer must share the broker's network namespace: in the chart that is the pod's
/// (the agent and the broker are its two containers), so a process elsewhere on the node
/// running as the same uid — another pod's, or a host process — is refused even though
/// its uid matches.
fn same_pod<K: Kernel>(k: &K, peer: i32) -> Result<(), BrokerError> {
    let mine = k.netns_inode(k.self_pid())?;
    match k.netns_inode(peer) {
        Ok(theirs) if theirs == mine => Ok(()),
        Ok(theirs) => Err(err(
            ErrorKind::PeerNotAllowed,
            format!("peer pid {peer} is in {theirs}, not the broker's pod ({mine})"),
        )),
        Err(_) => Err(err(
            ErrorKind::PeerNotAllowed,
            format!("peer pid {peer} cannot be inspected"),
        )),
    }
}
