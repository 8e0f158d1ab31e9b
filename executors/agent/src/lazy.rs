//! PostCopy's lazy pages: CRIU's lazy migration (userfaultfd), with its page-server
//! connection carried by the agents instead of a TCP port CRIU would open.
//!
//! * Source: a lazy dump (`lazy_pages`, [`Criu::call_notified`](crate::criu::Criu)) writes
//!   every image but the tree's anonymous memory, notifies `post-dump`, and then serves
//!   those pages from the frozen tree on its page-server socket until the peer closes
//!   the session. Its socket is its standard input, named to it by a configuration
//!   file ([`ps_socket_config`]): CRIU's RPC ignores the page-server socket it is given
//!   in lazy mode and would listen on a TCP port on every address of the node instead —
//!   the tree's memory to whoever connects first.
//! * Target: `criu lazy-pages` ([`daemon_command`]), its page-server socket its
//!   standard input, waits in the image directory for the restore (`lazy_pages`) to
//!   hand it the restored tree's userfaultfds, then fills each page on its first
//!   touch and every other page in the background, asking the source for them.
//! * Between the two, the agents copy bytes. The source agent passes on only whole
//!   requests that ask for pages or end the session ([`Requests`]): nothing the
//!   target sends can make the source's CRIU write, open or overwrite anything. It
//!   can end a session that never started cleanly ([`Requests::close_now`]).
//!
//! A session that ends any other way fails CRIU's dump, and CRIU then *resumes* the
//! tree it served (its rollback) — after the target resumed its copy, a second copy.
//! Whoever drives a lazy dump must stop the tree first (it is frozen behind the network
//! lock until then) or end the session with [`Requests::close_now`].
//!
//! CRIU's page server reads pages through a pipe it sizes to `PIPE_MAX_SIZE` pages
//! (3,354,624 bytes with 4 KiB pages); past `fs.pipe-max-size` (1 MiB by default) that
//! needs CAP_SYS_RESOURCE, and without it every request past the first 64 KiB of a
//! buffer fails the session ([`pipe_room`]).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Length of one page-server request, CRIU 4.2's `struct page_server_iov`: cmd (u32,
/// then 4 bytes of padding), nr_pages, vaddr, dst_id (u64), native byte order.
/// Older CRIUs had a u32 `nr_pages` and 24 bytes: the agent speaks to the CRIU its
/// image ships.
pub const REQUEST_LEN: usize = 32;
const PS_IOV_GET: u32 = 7;
const PS_IOV_CLOSE: u32 = 0x1023;
const PS_IOV_FORCE_CLOSE: u32 = 0x1024;
/// The low 16 bits are the command, the high ones its flags.
const PS_CMD_MASK: u32 = 0xffff;

/// The pipe CRIU's lazy page server needs, in bytes: `PIPE_MAX_SIZE` pages of 4 KiB,
/// `PIPE_MAX_SIZE` = 8 pages' worth of 40-byte pipe buffers (criu/include/page-pipe.h).
pub const CRIU_PIPE_BYTES: u64 = (8 * 4096 / 40) * 4096;
/// CAP_SYS_RESOURCE, which lets a pipe grow past `fs.pipe-max-size`.
const CAP_SYS_RESOURCE: u32 = 24;

/// CAP_SYS_PTRACE, which lets a process open a userfaultfd that also handles the
/// kernel's own faults while `vm.unprivileged_userfaultfd` is 0.
const CAP_SYS_PTRACE: u32 = 19;

/// Whether this process holds capability `cap` (its effective set).
fn holds(cap: u32) -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|eff| eff & (1 << cap) != 0)
}

/// Whether CRIU run by this process can serve lazy pages: its pipes can grow to
/// [`CRIU_PIPE_BYTES`]. The error says what to change on the node.
pub fn pipe_room() -> Result<(), String> {
    if holds(CAP_SYS_RESOURCE) {
        return Ok(());
    }
    let max = std::fs::read_to_string("/proc/sys/fs/pipe-max-size")
        .map_err(|e| format!("reading fs.pipe-max-size: {e}"))?;
    let max: u64 = max
        .trim()
        .parse()
        .map_err(|e| format!("fs.pipe-max-size {max:?}: {e}"))?;
    if max >= CRIU_PIPE_BYTES {
        return Ok(());
    }
    Err(format!(
        "PostCopy is not possible on this node: CRIU's lazy page server needs pipes of \
         {CRIU_PIPE_BYTES} bytes, but fs.pipe-max-size is {max} and the agent has no \
         CAP_SYS_RESOURCE; set the sysctl fs.pipe-max-size to at least {CRIU_PIPE_BYTES} \
         on the node (it is not namespaced), or migrate with PreCopy or Cold"
    ))
}

/// Whether CRIU run by this process can restore lazily: `criu lazy-pages` and the
/// restored process open a userfaultfd that must also handle faults in the kernel's
/// own accesses (CRIU asks for no `UFFD_USER_MODE_ONLY`), which the kernel grants
/// only with CAP_SYS_PTRACE while `vm.unprivileged_userfaultfd` is 0. The error says
/// what to change (the kernel's rule; measured: without either, `criu lazy-pages`
/// logs "Lazy pages are not permitted" and exits 1).
pub fn uffd_room() -> Result<(), String> {
    if holds(CAP_SYS_PTRACE) {
        return Ok(());
    }
    let unprivileged = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd")
        .map(|v| v.trim() == "1")
        .unwrap_or(false);
    if unprivileged {
        return Ok(());
    }
    Err(
        "PostCopy is not possible on this target node: CRIU's lazy restore needs a \
         userfaultfd, which the kernel grants this agent only with CAP_SYS_PTRACE (the \
         chart adds it with migrationAgent.postCopy.enabled=true) or with the node's \
         sysctl vm.unprivileged_userfaultfd=1; or migrate with PreCopy or Cold"
            .to_string(),
    )
}

/// Writes the CRIU configuration file that names its standard input as the
/// page-server socket (`ps-socket 0`) into `dir`; its path is the lazy dump's
/// `config_file`.
pub fn ps_socket_config(dir: &Path) -> std::io::Result<PathBuf> {
    let path = dir.join("lazy-ps.conf");
    let mut f = std::fs::File::create(&path)?;
    f.write_all(b"ps-socket 0\n")?;
    Ok(path)
}

/// The TCP ports `pid` listens on (IPv4 and IPv6), read from its network namespace's
/// `/proc/<pid>/net/tcp{,6}` and its own descriptors: a socket in state LISTEN whose
/// inode is one of `pid`'s open sockets. Used after a lazy dump wrote its images: its
/// CRIU must serve pages on the socket the agent gave it, never on a TCP port (the
/// configuration file is what makes it so; a CRIU that ignored it would serve the
/// frozen tree's memory to whoever connects).
pub fn tcp_listen_ports(pid: u32) -> std::io::Result<Vec<u16>> {
    let mut inodes = std::collections::BTreeSet::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(target) = std::fs::read_link(fd?.path()) else {
            continue; // closed meanwhile
        };
        let t = target.to_string_lossy();
        if let Some(inode) = t
            .strip_prefix("socket:[")
            .and_then(|r| r.strip_suffix(']'))
            .and_then(|n| n.parse::<u64>().ok())
        {
            inodes.insert(inode);
        }
    }
    let mut ports = vec![];
    for table in ["tcp", "tcp6"] {
        let text = match std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue, // no IPv6
            Err(e) => return Err(e),
        };
        ports.extend(
            listening(&text)
                .into_iter()
                .filter(|(_, inode)| inodes.contains(inode))
                .map(|(port, _)| port),
        );
    }
    Ok(ports)
}

/// The (local port, inode) of every LISTEN socket in a `/proc/net/tcp{,6}` table.
fn listening(table: &str) -> Vec<(u16, u64)> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if f.len() < 10 || f[3] != "0A" {
                return None;
            }
            let port = u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok()?;
            Some((port, f[9].parse().ok()?))
        })
        .collect()
}

/// The children of this process whose command is `criu` (a lazy dump's `criu swrk`).
pub fn criu_children() -> Vec<u32> {
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            // pid (comm) state ppid …: comm may hold spaces, so split at the last ')'.
            let Some((head, tail)) = stat.rsplit_once(')') else {
                return false;
            };
            let comm = head.split_once('(').map(|(_, c)| c);
            let ppid = tail.split_whitespace().nth(1).and_then(|p| p.parse().ok());
            comm == Some("criu") && ppid == Some(me)
        })
        .collect()
}

/// `criu lazy-pages` for the images in `dir`, its page-server socket its standard
/// input (the caller sets it), its log `dir/<log>`.
pub fn daemon_command(criu: &Path, dir: &Path, log: &str) -> Command {
    let mut c = Command::new(criu);
    c.arg("lazy-pages")
        .arg("--page-server")
        .args(["--ps-socket", "0"])
        .arg("-D")
        .arg(dir)
        .args(["-o", log, "-v4"]);
    c
}

/// A refused request from the target (the session is over: nothing more is passed on).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refused {
    #[error(
        "page-server request {cmd:#x} refused: a target may only ask for pages or end the session"
    )]
    Command { cmd: u32 },
    #[error("bytes after the end of the lazy-pages session")]
    AfterClose,
}

/// The requests a target's lazy-pages daemon sends to the source's page server, cut
/// into whole requests and checked one by one.
#[derive(Debug, Default)]
pub struct Requests {
    partial: Vec<u8>,
    closed: bool,
    refused: bool,
    /// Pages asked for so far.
    pub pages_asked: u64,
}

impl Requests {
    /// Takes bytes from the target; returns the whole requests they complete, to pass
    /// on as they are. Refuses anything but a request for pages or the session's end,
    /// and anything after that end (and, once refused, everything).
    pub fn take(&mut self, mut bytes: &[u8]) -> Result<Vec<u8>, Refused> {
        if self.refused {
            return Err(Refused::AfterClose);
        }
        let mut out = Vec::with_capacity(bytes.len() + REQUEST_LEN);
        while !bytes.is_empty() {
            if self.closed {
                self.refused = true;
                return Err(Refused::AfterClose);
            }
            let want = REQUEST_LEN - self.partial.len();
            let n = want.min(bytes.len());
            self.partial.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.partial.len() < REQUEST_LEN {
                break;
            }
            let cmd = u32::from_ne_bytes(self.partial[..4].try_into().expect("4 bytes"));
            match cmd & PS_CMD_MASK {
                PS_IOV_GET => {
                    let pages = u64::from_ne_bytes(self.partial[8..16].try_into().expect("8"));
                    self.pages_asked = self.pages_asked.saturating_add(pages);
                }
                PS_IOV_CLOSE | PS_IOV_FORCE_CLOSE => self.closed = true,
                _ => {
                    self.refused = true;
                    return Err(Refused::Command { cmd });
                }
            }
            out.extend_from_slice(&self.partial);
            self.partial.clear();
        }
        Ok(out)
    }

    /// The target ended the session (its last request passed on).
    pub fn closed(&self) -> bool {
        self.closed
    }

    /// A request that ends the session where the requests passed on so far end (a
    /// partial one is dropped): CRIU's dump then ends as a success and leaves the tree
    /// as its options say (stopped). `None` once the session was ended or refused.
    pub fn close_now(&mut self) -> Option<[u8; REQUEST_LEN]> {
        if self.closed || self.refused {
            return None;
        }
        self.closed = true;
        self.partial.clear();
        let mut r = [0u8; REQUEST_LEN];
        r[..4].copy_from_slice(&PS_IOV_CLOSE.to_ne_bytes());
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(cmd: u32, pages: u64, vaddr: u64, id: u64) -> Vec<u8> {
        let mut r = Vec::with_capacity(REQUEST_LEN);
        r.extend_from_slice(&cmd.to_ne_bytes());
        r.extend_from_slice(&[0; 4]);
        r.extend_from_slice(&pages.to_ne_bytes());
        r.extend_from_slice(&vaddr.to_ne_bytes());
        r.extend_from_slice(&id.to_ne_bytes());
        r
    }

    #[test]
    fn requests_for_pages_pass_whole_however_the_bytes_are_cut() {
        let mut stream = request(PS_IOV_GET, 3, 0x7f00_0000_0000, 0x101);
        stream.extend(request(PS_IOV_GET, 1, 0x7f00_0000_3000, 0x101));
        stream.extend(request(PS_IOV_FORCE_CLOSE, 0, 0, 0));
        for cut in [1, 5, 31, 32, 33, 63, 95] {
            let mut r = Requests::default();
            let mut passed = Vec::new();
            for piece in stream.chunks(cut) {
                let out = r.take(piece).unwrap();
                assert_eq!(out.len() % REQUEST_LEN, 0, "only whole requests pass");
                passed.extend(out);
            }
            assert_eq!(passed, stream, "cut every {cut} bytes");
            assert_eq!(r.pages_asked, 4);
            assert!(r.closed());
        }
    }

    #[test]
    fn a_request_to_write_open_or_anything_else_ends_the_session() {
        for cmd in [1u32, 2, 3, 4, 5, 6, 0, 8, 0x1022, 0x1025, u32::MAX] {
            let mut r = Requests::default();
            assert!(r.take(&request(PS_IOV_GET, 1, 0x1000, 0x101)).is_ok());
            let bad = request(cmd, 1, 0x1000, 0x101);
            assert_eq!(r.take(&bad), Err(Refused::Command { cmd }), "{cmd:#x}");
            assert_eq!(
                r.take(&request(PS_IOV_GET, 1, 0x1000, 0x101)),
                Err(Refused::AfterClose),
                "nothing passes once refused"
            );
            assert_eq!(r.close_now(), None);
        }
    }

    #[test]
    fn listen_sockets_are_found_by_state_and_inode() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000000000000000 100 0 0 10 0
   1: 0100007F:3A98 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 4343 1 0000000000000000 20 4 30 10 -1
";
        assert_eq!(listening(table), vec![(8080, 4242)]);
    }

    #[test]
    fn a_process_listening_on_tcp_is_seen_and_one_that_is_not_is_not() {
        let me = std::process::id();
        let before = tcp_listen_ports(me).unwrap();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(!before.contains(&port));
        assert!(tcp_listen_ports(me).unwrap().contains(&port), "{port}");
        // A connected (not listening) socket is no listener.
        let c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let local = c.local_addr().unwrap().port();
        drop(l);
        assert!(!tcp_listen_ports(me).unwrap().contains(&local));
    }

    #[test]
    fn a_flagged_get_is_a_get() {
        let mut r = Requests::default();
        let flagged = request(PS_IOV_GET | (1 << 16), 2, 0x2000, 0x101);
        assert_eq!(r.take(&flagged).unwrap(), flagged);
    }

    #[test]
    fn nothing_passes_after_the_end_and_the_end_is_made_once() {
        let mut r = Requests::default();
        r.take(&request(PS_IOV_CLOSE, 0, 0, 0)).unwrap();
        assert_eq!(r.take(&[0]), Err(Refused::AfterClose));
        assert_eq!(r.close_now(), None);

        let mut r = Requests::default();
        let get = request(PS_IOV_GET, 1, 0x1000, 0x101);
        r.take(&get[..10]).unwrap();
        let close = r.close_now().expect("an end");
        assert_eq!(
            u32::from_ne_bytes(close[..4].try_into().unwrap()),
            PS_IOV_CLOSE
        );
        assert_eq!(r.close_now(), None, "the end is made once");
        assert_eq!(r.take(&get[10..]), Err(Refused::AfterClose));
    }
}
