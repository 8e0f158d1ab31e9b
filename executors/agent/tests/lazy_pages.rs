//! CRIU's lazy migration on this machine's kernel, as root, the way PostCopy carries
//! it ([`podmotion_agent::lazy`]): a lazy dump whose page-server socket is its
//! standard input, `criu lazy-pages` on the target with its socket as its standard
//! input, and between them only whole page requests ([`Requests`]). The workload is
//! the testbed's (its own PID and network namespaces); the copy is restored into the
//! target pod's network namespace (CRIU run here, not in the holder's PID namespace:
//! that launcher is the agent binary's). `PODMOTION_ROOT_TESTS=0` skips them; otherwise a missing CRIU fails them.

use podmotion_agent::criu::{self, Criu, InheritFd, Opts, Req};
use podmotion_agent::lazy::{self, Requests};
use podmotion_agent::testbed::{self, Testbed, ask};
use podmotion_wire::ids::ProcRef;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

static SERIAL: Mutex<()> = Mutex::new(());
const NETNS_KEY: &str = "podnet";

fn testbed(name: &str) -> Option<Testbed> {
    if !testbed::root_tests_enabled() {
        return None;
    }
    testbed::ensure_lazy_pipe_room();
    Some(Testbed::new(
        name,
        env!("CARGO_BIN_EXE_podmotion-agent").as_ref(),
        env!("CARGO_BIN_EXE_podmotion-testload").as_ref(),
    ))
}

fn netns_ino(pid: i32) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/net"))
        .unwrap()
        .ino()
}

fn state(pid: i32) -> char {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, r)| r.trim().chars().next())
        })
        .unwrap_or('?')
}

fn stop_signal(pid: i32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
}

/// A lazy dump of `src` into `dir` on a thread: the page-server socket is the one end
/// of a pair, returned with the receiver of the `post-dump` notification and the
/// dump's outcome.
struct LazyDump {
    socket: UnixStream,
    images_written: mpsc::Receiver<()>,
    done: std::thread::JoinHandle<Result<criu::Resp, criu::CriuError>>,
}

fn lazy_dump(src: ProcRef, dir: &Path) -> LazyDump {
    std::fs::create_dir_all(dir).unwrap();
    let (ours, theirs) = UnixStream::pair().unwrap();
    let mut o = Opts::new(dir, "dump.log");
    o.pid = Some(src.pid);
    o.external = vec![format!("net[{}]:{NETNS_KEY}", netns_ino(src.pid))];
    o.tcp_established = Some(true);
    o.leave_stopped = Some(true);
    o.lazy_pages = Some(true);
    o.config_file = Some(
        lazy::ps_socket_config(dir)
            .unwrap()
            .to_string_lossy()
            .into_owned(),
    );
    let (tx, rx) = mpsc::channel();
    let log = dir.join("dump.log");
    let done = std::thread::spawn(move || {
        let mut told = move |script: &str| {
            if script == "post-dump" {
                let _ = tx.send(());
            }
        };
        Criu {
            binary: testbed::criu_path(),
        }
        .call_notified(
            Req {
                r#type: criu::REQ_DUMP,
                opts: Some(o),
            },
            Some(&log),
            Some(OwnedFd::from(theirs)),
            &mut told,
        )
    });
    LazyDump {
        socket: ours,
        images_written: rx,
        done,
    }
}

/// The agents' part: bytes from the target's daemon pass through [`Requests`] to the
/// source's page server, its answers go back as they are. Ends when either side ends.
fn bridge(source: UnixStream, target: UnixStream, requests: Arc<Mutex<Requests>>) {
    let (mut s_r, mut s_w) = (source.try_clone().unwrap(), source);
    let (mut t_r, mut t_w) = (target.try_clone().unwrap(), target);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        while let Ok(n) = s_r.read(&mut buf) {
            if n == 0 || t_w.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = t_w.shutdown(std::net::Shutdown::Write);
    });
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n) = t_r.read(&mut buf) {
            if n == 0 {
                break;
            }
            let Ok(pass) = requests.lock().unwrap().take(&buf[..n]) else {
                break;
            };
            if s_w.write_all(&pass).is_err() {
                break;
            }
        }
        let _ = s_w.shutdown(std::net::Shutdown::Write);
    });
}

/// A child killed and reaped when the test ends, however it ends.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

fn work_dir(tb: &Testbed) -> PathBuf {
    tb.checkpoints(0)
}

#[test]
fn a_lazily_dumped_tree_runs_on_the_target_with_every_page_fetched_through_the_agents() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut tb) = testbed("lzm") else { return };
    let src = tb.start_workload(64, 0);
    let holder = tb.start_holder();
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let digest = ask(&mut conn, "digest").unwrap();
    let before: u64 = ask(&mut conn, "get").unwrap().parse().unwrap();
    drop(conn);

    let src_dir = work_dir(&tb).join("lazy-src");
    let dst_dir = tb.checkpoints(1).join("lazy-dst");
    let dump = lazy_dump(src, &src_dir);
    dump.images_written
        .recv_timeout(Duration::from_secs(60))
        .expect("post-dump: every image but the lazy pages written");
    let written: u64 = std::fs::read_dir(&src_dir)
        .unwrap()
        .flatten()
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(
        written < 16 << 20,
        "the 64 MiB ballast stays with the frozen tree: {written} bytes written"
    );
    assert_eq!(
        state(src.pid),
        't',
        "the source is held by CRIU while it serves pages"
    );
    copy_dir(&src_dir, &dst_dir);

    let (daemon_end, agent_end) = UnixStream::pair().unwrap();
    let requests = Arc::new(Mutex::new(Requests::default()));
    bridge(dump.socket, agent_end, Arc::clone(&requests));
    let mut daemon = Reaped(
        lazy::daemon_command(&testbed::criu_path(), &dst_dir, "lazy.log")
            .stdin(OwnedFd::from(daemon_end))
            .spawn()
            .unwrap(),
    );
    // The restore connects to the daemon's socket in the image directory.
    let sock = dst_dir.join("lazy-pages.socket");
    for _ in 0..500 {
        if sock.exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(sock.exists(), "the lazy-pages daemon listens");

    tb.add_address_to_target();
    let ns_fd = nix::fcntl::open(
        format!("/proc/{}/ns/net", holder.pid).as_str(),
        nix::fcntl::OFlag::O_RDONLY,
        nix::sys::stat::Mode::empty(),
    )
    .unwrap();
    let mut o = Opts::new(&dst_dir, "restore.log");
    o.inherit_fd = vec![InheritFd {
        key: NETNS_KEY.into(),
        fd: ns_fd.as_raw_fd(),
    }];
    o.tcp_close = Some(true);
    o.lazy_pages = Some(true);
    let restored = Criu {
        binary: testbed::criu_path(),
    }
    .call(
        Req {
            r#type: criu::REQ_RESTORE,
            opts: Some(o),
        },
        Some(&dst_dir.join("restore.log")),
    )
    .unwrap_or_else(|e| panic!("lazy restore: {e}"));
    drop(ns_fd);
    let restored_pid = restored.restore.map(|r| r.pid).unwrap_or(0);
    assert!(restored_pid > 0);
    tb.route_to_target();

    // The restored copy runs before its memory arrived: it answers, counts on, and its
    // ballast — every page read, most fetched on that first touch — is the source's.
    let mut conn = tb.connect_timeout(Duration::from_secs(5)).unwrap();
    let after: u64 = ask(&mut conn, "get").unwrap().parse().unwrap();
    assert!(
        after >= before,
        "counter {after} < {before}: the state did not come across"
    );
    assert_eq!(
        ask(&mut conn, "digest").unwrap(),
        digest,
        "every page came across whole"
    );

    let st = daemon.0.wait().unwrap();
    assert!(
        st.success(),
        "lazy-pages daemon: {st:?}\n{}",
        criu::log_tail(&dst_dir.join("lazy.log"))
    );
    let served = dump.done.join().unwrap();
    assert!(
        served.is_ok(),
        "the dump ends once every page was served: {served:?}"
    );
    assert!(
        requests.lock().unwrap().closed(),
        "the target ended the session"
    );
    assert!(
        requests.lock().unwrap().pages_asked >= (64 << 20) / 4096,
        "every ballast page was asked for: {}",
        requests.lock().unwrap().pages_asked
    );
    assert_eq!(
        state(src.pid),
        'T',
        "the served source is left stopped, never resumed"
    );
    let later: u64 = ask(&mut conn, "get").unwrap().parse().unwrap();
    assert!(later > after, "the restored copy keeps running");
    stop_signal(restored_pid, nix::sys::signal::Signal::SIGKILL);
    stop_signal(src.pid, nix::sys::signal::Signal::SIGKILL);
}

#[test]
fn a_session_the_agent_ends_before_the_target_asked_leaves_the_source_stopped_and_whole() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut tb) = testbed("lza") else { return };
    let src = tb.start_workload(16, 0);
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let digest = ask(&mut conn, "digest").unwrap();
    drop(conn);

    let dir = work_dir(&tb).join("lazy-abort");
    let mut dump = lazy_dump(src, &dir);
    dump.images_written
        .recv_timeout(Duration::from_secs(60))
        .expect("post-dump");
    // The rollback before the target's daemon ever asked: the agent ends the session.
    let close = Requests::default().close_now().unwrap();
    dump.socket.write_all(&close).unwrap();
    let mut status = [0u8; 4];
    dump.socket.read_exact(&mut status).unwrap();
    assert_eq!(
        i32::from_ne_bytes(status),
        0,
        "the page server acknowledges the end"
    );
    let r = dump.done.join().unwrap();
    assert!(r.is_ok(), "an ended session is a finished dump: {r:?}");
    assert_eq!(
        state(src.pid),
        'T',
        "left stopped, as a Cold dump leaves it"
    );

    // What an abort does next: resume it; it carries on with its memory untouched.
    stop_signal(src.pid, nix::sys::signal::Signal::SIGCONT);
    let mut conn = tb.connect_timeout(Duration::from_secs(5)).unwrap();
    let before: u64 = ask(&mut conn, "get").unwrap().parse().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let after: u64 = ask(&mut conn, "get").unwrap().parse().unwrap();
    assert!(after > before, "the resumed source counts on");
    assert_eq!(ask(&mut conn, "digest").unwrap(), digest);
}
