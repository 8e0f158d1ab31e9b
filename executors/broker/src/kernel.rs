//! The broker's direct kernel calls: the only module with `unsafe`. Everything that
//! has a safe binding (setns, mount, getsockname, kill) goes through `nix`; the raw calls
//! here are those nix 0.30 does not wrap: pidfd_open/pidfd_getfd, the TCP_REPAIR
//! socket option, and the raw sends of an unlock's announcements (a gratuitous ARP, an
//! unsolicited Neighbour Advertisement).

use nix::sched::CloneFlags;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Duplicates descriptor `fd` of process `pid` into the broker (pidfd_getfd(2)).
pub fn steal_fd(pid: i32, fd: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes two integers and returns a new descriptor or -1; no
    // memory is passed.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pidfd_open returned a fresh descriptor that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    // SAFETY: integer arguments only; the result is a new descriptor or -1.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pidfd_getfd returned a fresh descriptor (with O_CLOEXEC) owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(got as i32) })
}

const TCP_REPAIR: libc::c_int = 19;

/// Whether a TCP socket is in repair mode.
pub fn tcp_repair(sock: &OwnedFd) -> std::io::Result<bool> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are valid for writes of the sizes given; `sock` is open.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            TCP_REPAIR,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v != 0)
}

/// Takes a socket out of repair mode (TCP_REPAIR_OFF = 0).
pub fn tcp_repair_off(sock: &OwnedFd) -> std::io::Result<()> {
    let v: libc::c_int = 0;
    // SAFETY: `v` is a valid c_int for reads of its size; `sock` is open.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            TCP_REPAIR,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `program args` with `script` on its standard input (`nft -f -`, an
/// `iptables-nft-restore`); its failure carries its standard error.
pub fn run_script(program: &str, args: &[&str], script: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(script.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Runs `f` on a fresh thread that has joined the network namespace of `pid`; child
/// processes it spawns (iproute2) inherit that namespace. The broker's own threads
/// never change namespace.
pub fn in_netns<T: Send + 'static>(
    pid: i32,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::spawn(move || {
        nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
        f()
    })
    .join()
    .map_err(|_| std::io::Error::other("netns worker panicked"))?
}

const ETH_P_ARP: u16 = 0x0806;

/// A new socket (close-on-exec), owned.
fn socket(domain: libc::c_int, ty: libc::c_int, protocol: libc::c_int) -> std::io::Result<OwnedFd> {
    // SAFETY: integer arguments only; the result is a new descriptor or -1.
    let fd = unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, protocol) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: socket returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends `buf` as one datagram to `to` (a `sockaddr_*` of the socket's family).
fn send_to<A>(sock: &OwnedFd, buf: &[u8], to: &A) -> std::io::Result<()> {
    // SAFETY: `buf` and `to` are valid for reads of the lengths given; `sock` is open.
    let r = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            0,
            (to as *const A).cast(),
            std::mem::size_of::<A>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Sends one gratuitous ARP request for `addr` out of link `ifindex` (hardware address
/// `mac`), from the network namespace of the calling thread: "`addr` is at `mac`". A
/// neighbour that holds an entry for `addr` (the node, a bridge's host side) updates it
/// at once instead of waiting for its own probes.
pub fn announce_ipv4(ifindex: i32, mac: [u8; 6], addr: std::net::Ipv4Addr) -> std::io::Result<()> {
    let sock = socket(
        libc::AF_PACKET,
        libc::SOCK_DGRAM,
        i32::from(ETH_P_ARP.to_be()),
    )?;
    let ip = addr.octets();
    // An ARP request (RFC 826) whose sender and target address are both `addr`.
    let mut arp = [0u8; 28];
    arp[0..2].copy_from_slice(&1u16.to_be_bytes()); // Ethernet
    arp[2..4].copy_from_slice(&0x0800u16.to_be_bytes()); // IPv4
    arp[4] = 6;
    arp[5] = 4;
    arp[6..8].copy_from_slice(&1u16.to_be_bytes()); // request
    arp[8..14].copy_from_slice(&mac);
    arp[14..18].copy_from_slice(&ip);
    arp[24..28].copy_from_slice(&ip);
    // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
    let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    to.sll_family = libc::AF_PACKET as u16;
    to.sll_protocol = ETH_P_ARP.to_be();
    to.sll_ifindex = ifindex;
    to.sll_halen = 6;
    to.sll_addr[..6].copy_from_slice(&[0xff; 6]);
    send_to(&sock, &arp, &to)
}

/// Sends one unsolicited Neighbour Advertisement (RFC 4861 §7.2.6: to all nodes,
/// Override set, Solicited clear, with the target link-layer address) for `addr` out of
/// link `ifindex` (hardware address `mac`), from `addr` itself, in the network namespace
/// of the calling thread: the IPv6 counterpart of [`announce_ipv4`]. `addr` must be
/// usable as a source (not tentative: the unlock re-adds addresses with `nodad`).
pub fn announce_ipv6(ifindex: i32, mac: [u8; 6], addr: std::net::Ipv6Addr) -> std::io::Result<()> {
    let check = |r: libc::c_int| {
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    let sock = socket(libc::AF_INET6, libc::SOCK_RAW, libc::IPPROTO_ICMPV6)?;
    let set = |opt: libc::c_int, v: libc::c_int| {
        // SAFETY: `v` is a valid c_int for reads of its size; `sock` is open.
        check(unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::IPPROTO_IPV6,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        })
    };
    // Receivers drop neighbour discovery that crossed a router (hop limit below 255).
    set(libc::IPV6_MULTICAST_HOPS, 255)?;
    set(libc::IPV6_MULTICAST_IF, ifindex)?;
    // SAFETY: sockaddr_in6 is plain data; all-zero is a valid value.
    let mut from: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    from.sin6_family = libc::AF_INET6 as u16;
    from.sin6_addr.s6_addr = addr.octets();
    // SAFETY: `from` is valid for reads of its size; `sock` is open.
    check(unsafe {
        libc::bind(
            sock.as_raw_fd(),
            (&from as *const libc::sockaddr_in6).cast(),
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        )
    })?;
    // Type 136, code 0, checksum (the kernel fills it in for ICMPv6 raw sockets),
    // flags R=0 S=0 O=1, the target, then the target link-layer address option.
    let mut na = [0u8; 32];
    na[0] = 136;
    na[4] = 0x20;
    na[8..24].copy_from_slice(&addr.octets());
    na[24] = 2;
    na[25] = 1;
    na[26..32].copy_from_slice(&mac);
    let mut to = from;
    to.sin6_addr.s6_addr = std::net::Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1).octets();
    to.sin6_scope_id = ifindex as u32;
    send_to(&sock, &na, &to)
}
