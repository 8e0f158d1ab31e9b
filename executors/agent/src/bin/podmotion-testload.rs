//! Test workload for the migration tests and benchmarks (not shipped in images): a TCP
//! server whose state lives only in memory.
//!
//! `podmotion-testload serve <port> [ballast MiB] [dirty KiB/s]`
//! `podmotion-testload get <host:port>` (client: prints the server's counter and exits 0)
//! `podmotion-testload forward <port> <upstream port>` (a sidecar: see [`forward_command`])
//! * a counter incremented every 10 ms by a thread (proves execution continues);
//! * every connection is line based: `get` → current counter, `echo <x>` → `<x>`,
//!   `total` → how many requests this connection served (per-connection state),
//!   `ballast` → `filled` once the ballast is written, `digest` → a digest of the
//!   ballast's bytes as they are now (hex; proves memory came across whole);
//! * optional ballast memory, filled with non-zero data, and rewritten at a bounded
//!   dirty rate (for pre-copy).
#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

static BALLAST_FILLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static BALLAST: std::sync::Mutex<Vec<u8>> = std::sync::Mutex::new(Vec::new());

/// FNV-1a over the ballast, 8 bytes at a time.
fn ballast_digest() -> String {
    let b = BALLAST.lock().unwrap_or_else(|e| e.into_inner());
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for w in b.chunks(8) {
        let mut x = [0u8; 8];
        x[..w.len()].copy_from_slice(w);
        h ^= u64::from_le_bytes(x);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn serve_conn(s: TcpStream, counter: Arc<AtomicU64>) {
    let mut w = s.try_clone().expect("clone");
    let mut served = 0u64;
    for line in BufReader::new(s).lines() {
        let Ok(line) = line else { break };
        served += 1;
        let reply = match line.split_once(' ') {
            Some(("echo", x)) => x.to_owned(),
            _ if line == "get" => counter.load(Ordering::SeqCst).to_string(),
            _ if line == "total" => served.to_string(),
            _ if line == "digest" => ballast_digest(),
            _ if line == "ballast" => if BALLAST_FILLED.load(Ordering::SeqCst) {
                "filled"
            } else {
                "filling"
            }
            .to_owned(),
            _ => "?".to_owned(),
        };
        if writeln!(w, "{reply}").is_err() {
            break;
        }
    }
}

/// The client side, for pods that check another pod or a Service from inside the
/// cluster (the image has no shell and no other tool).
fn get(addr: &str) -> std::io::Result<String> {
    use std::net::ToSocketAddrs;
    let target = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other(format!("{addr}: no address")))?;
    let s = TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut w = s.try_clone()?;
    writeln!(w, "get")?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    Ok(line.trim().to_owned())
}

/// Exits at once on SIGTERM, as a server that shuts down when asked does (as PID 1 of
/// its container it would otherwise ignore it and wait for the kubelet's SIGKILL at
/// the end of the grace period). SIGTERM is blocked in every thread (those spawned
/// after this inherit the mask) and taken by one waiting for it; a frozen copy's
/// pending SIGTERM stays pending, as the kill it waits for.
fn exit_on_sigterm() {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.thread_block().expect("block SIGTERM");
    std::thread::spawn(move || {
        loop {
            // Interrupted (a checkpoint's seize): wait again.
            if set.wait() == Ok(Signal::SIGTERM) {
                std::process::exit(0);
            }
        }
    });
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("get") => get_command(args.get(2)),
        Some("serve") => serve_command(&args),
        Some("forward") => forward_command(&args),
        _ => {
            eprintln!(
                "usage: podmotion-testload serve <port> [ballast MiB] [dirty KiB/s] | get <host:port> | forward <port> <upstream port>"
            );
            std::process::exit(2);
        }
    }
}

/// `get <host:port>`: prints the server's counter; exits 1 when it cannot.
fn get_command(addr: Option<&String>) {
    let Some(addr) = addr else {
        eprintln!("usage: podmotion-testload get <host:port>");
        std::process::exit(2);
    };
    match get(addr) {
        Ok(v) => println!("{v}"),
        Err(e) => {
            eprintln!("podmotion-testload get {addr}: {e}");
            std::process::exit(1);
        }
    }
}

/// `serve <port> [ballast MiB] [dirty KiB/s]` (`args` as the process got them).
fn serve_command(args: &[String]) {
    exit_on_sigterm();
    let port: u16 = args.get(2).and_then(|p| p.parse().ok()).unwrap_or(8080);
    let mib: usize = args.get(3).and_then(|p| p.parse().ok()).unwrap_or(0);
    let dirty_kib: usize = args.get(4).and_then(|p| p.parse().ok()).unwrap_or(0);
    if mib == 0 {
        BALLAST_FILLED.store(true, Ordering::SeqCst);
    }
    let counter = start_counter();
    if mib > 0 {
        std::thread::spawn(move || keep_ballast(mib, dirty_kib));
    }
    let l = TcpListener::bind(("0.0.0.0", port)).expect("bind");
    println!("ready");
    for s in l.incoming().flatten() {
        let c = Arc::clone(&counter);
        std::thread::spawn(move || serve_conn(s, c));
    }
}

/// `forward <port> <upstream port>`: a sidecar of a `serve` in the same pod. Each line
/// a client sends is forwarded to `127.0.0.1:<upstream port>` (over localhost, the pod's
/// shared network namespace) on a connection of its own, and the answer relayed back;
/// `forwarded` answers how many lines this sidecar forwarded so far (its own state,
/// in memory only: what proves the sidecar's memory moved with the pod).
fn forward_command(args: &[String]) {
    let port: u16 = args.get(2).and_then(|p| p.parse().ok()).unwrap_or(8081);
    let upstream: u16 = args.get(3).and_then(|p| p.parse().ok()).unwrap_or(8080);
    let forwarded = Arc::new(AtomicU64::new(0));
    let l = TcpListener::bind(("0.0.0.0", port)).expect("bind");
    println!("ready");
    for s in l.incoming().flatten() {
        let f = Arc::clone(&forwarded);
        std::thread::spawn(move || forward_conn(s, upstream, f));
    }
}

fn forward_conn(s: TcpStream, upstream: u16, forwarded: Arc<AtomicU64>) {
    let mut w = s.try_clone().expect("clone");
    for line in BufReader::new(s).lines() {
        let Ok(line) = line else { break };
        let reply = if line == "forwarded" {
            forwarded.load(Ordering::SeqCst).to_string()
        } else {
            match ask_upstream(upstream, &line) {
                Ok(r) => {
                    forwarded.fetch_add(1, Ordering::SeqCst);
                    r
                }
                Err(e) => format!("upstream: {e}"),
            }
        };
        if writeln!(w, "{reply}").is_err() {
            break;
        }
    }
}

fn ask_upstream(port: u16, line: &str) -> std::io::Result<String> {
    let s = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut w = s.try_clone()?;
    writeln!(w, "{line}")?;
    let mut reply = String::new();
    BufReader::new(s).read_line(&mut reply)?;
    Ok(reply.trim().to_owned())
}

/// The counter, incremented every 10 ms by a thread of its own.
fn start_counter() -> Arc<AtomicU64> {
    let counter = Arc::new(AtomicU64::new(0));
    let c = Arc::clone(&counter);
    std::thread::spawn(move || {
        loop {
            c.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    counter
}

/// Fills `mib` MiB of ballast with non-zero data, then rewrites `dirty_kib` of it per
/// second, one page at a time, round robin, forever.
fn keep_ballast(mib: usize, dirty_kib: usize) {
    let mut ballast = BALLAST.lock().unwrap_or_else(|e| e.into_inner());
    *ballast = vec![0u8; mib << 20];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for chunk in ballast.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let pages = ballast.len() / 4096;
    drop(ballast);
    BALLAST_FILLED.store(true, Ordering::SeqCst);
    // Rewrite `dirty_kib` per second, one page at a time, round robin.
    let per_tick = (dirty_kib / 4).div_ceil(10);
    let mut next = 0usize;
    loop {
        if per_tick > 0 {
            let mut ballast = BALLAST.lock().unwrap_or_else(|e| e.into_inner());
            for _ in 0..per_tick {
                ballast[(next % pages) * 4096] = ballast[(next % pages) * 4096].wrapping_add(1);
                next += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
