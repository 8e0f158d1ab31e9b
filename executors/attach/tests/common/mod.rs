//! Fixtures for the attach executor's root tests: a target "pod" (a process serving
//! HTTP in its own network namespace, reached from a client namespace over a veth
//! pair — only addresses inside namespaces created here), the agent binary started
//! with the agent GID, and small HTTP/stream helpers.
//!
//! These tests need root, nftables, iproute2 and busybox (`hack/install-attach-deps.sh`).
//! They fail when a prerequisite is missing; `PODMOTION_ROOT_TESTS=0` skips them.
#![allow(dead_code)]

use podmotion_attach::netns::NetnsExecutor;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub const AGENT_GID: u32 = 7777;
pub const APP_PORT: u16 = 8080;
pub const AGENT_PORT: u16 = 15001;
pub const TABLE: &str = "podmotion_agent";

/// Root tests run unless explicitly disabled; missing prerequisites fail them.
pub fn root_tests_enabled() -> bool {
    if std::env::var("PODMOTION_ROOT_TESTS").as_deref() == Ok("0") {
        // A developer's local run only: under CI (`CI` set) the switch fails the test.
        assert!(
            !std::env::var("CI").is_ok_and(|v| !matches!(v.as_str(), "" | "0" | "false")),
            "PODMOTION_ROOT_TESTS=0 is set under CI: skip switches are for local runs only"
        );
        eprintln!("PODMOTION_ROOT_TESTS=0: skipping root test");
        return false;
    }
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (CI runs as root); set PODMOTION_ROOT_TESTS=0 to skip"
    );
    for tool in ["ip", "nft", "busybox", "setpriv", "nsenter", "unshare"] {
        assert!(
            which(tool).is_some(),
            "{tool} missing: run hack/install-attach-deps.sh (or PODMOTION_ROOT_TESTS=0 to skip)"
        );
    }
    assert!(
        Path::new("/usr/bin/python3").exists(),
        "/usr/bin/python3 missing: run hack/install-attach-deps.sh (or PODMOTION_ROOT_TESTS=0 to skip)"
    );
    true
}

/// PATH with the sbin directories added: CI's environment may not carry them, and
/// ip, nft, runc and containerd-shim live there.
pub fn full_path() -> String {
    let mut path = std::env::var("PATH").unwrap_or_default();
    for d in ["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        if !path.split(':').any(|p| p == d) {
            path.push(':');
            path.push_str(d);
        }
    }
    path
}

/// A command for a system tool, resolved on [`full_path`] (which the child inherits).
pub fn tool(name: &str) -> Command {
    let mut c = Command::new(name);
    c.env("PATH", full_path());
    c
}

pub fn which(tool: &str) -> Option<PathBuf> {
    full_path()
        .split(':')
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.is_file())
}

pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// `python3 -c RAW_EXECVE <path> <argv...>` execs with the newline-separated
/// entries of $RAW_ENVP as the exact environment block.
const RAW_EXECVE: &str = r#"
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
argv = [a.encode() for a in sys.argv[2:]]
envp = [e.encode() for e in os.environ["RAW_ENVP"].split("\n") if e]
a = (ctypes.c_char_p * (len(argv) + 1))(*argv, None)
e = (ctypes.c_char_p * (len(envp) + 1))(*envp, None)
libc.execve(sys.argv[1].encode(), a, e)
sys.exit("execve failed: errno %d" % ctypes.get_errno())
"#;

/// A target "pod": `busybox httpd` in its own netns, plus a client netns.
pub struct NetnsPod {
    pub pod_ns: String,
    pub client_ns: String,
    pub pod_ip: String,
    pub pod_ip6: String,
    pub client_ip: String,
    pub www: PathBuf,
    pub app: Child,
}

impl NetnsPod {
    /// `env` is the app's whole environment block, in this order, duplicates kept.
    pub fn start(env: &[(&str, &str)]) -> NetnsPod {
        Self::start_as(0, env)
    }

    /// Like [`NetnsPod::start`], with the application running as `uid` (and that
    /// gid): a non-root app whose /proc files the agent can read only with the
    /// Job's capabilities.
    pub fn start_as(uid: u32, env: &[(&str, &str)]) -> NetnsPod {
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let tag = format!("{}{}", std::process::id() % 100000, n);
        let pod_ns = format!("pmt-pod-{tag}");
        let client_ns = format!("pmt-cli-{tag}");
        // 10.213.<k>.0/30 inside namespaces this test creates; k unique per fixture.
        let k = (std::process::id() as u32 * 7 + n) % 250;
        let (cli_ip, pod_ip) = (format!("10.213.{k}.1"), format!("10.213.{k}.2"));
        let (va, vb) = (format!("pmta{tag}"), format!("pmtb{tag}"));
        run(tool("ip").args(["netns", "add", &pod_ns]));
        run(tool("ip").args(["netns", "add", &client_ns]));
        run(tool("ip").args([
            "-n", &client_ns, "link", "add", &va, "type", "veth", "peer", "name", &vb, "netns",
            &pod_ns,
        ]));
        // And a ULA pair, also only inside these namespaces (nodad: usable at once).
        let (cli_ip6, pod_ip6) = (format!("fd00:213:{k}::1"), format!("fd00:213:{k}::2"));
        let ends = [
            (&client_ns, &va, &cli_ip, &cli_ip6),
            (&pod_ns, &vb, &pod_ip, &pod_ip6),
        ];
        for (ns, dev, ip, ip6) in ends {
            let ip4 = format!("{ip}/30");
            let ip6 = format!("{ip6}/64");
            run(tool("ip").args(["-n", ns, "link", "set", "lo", "up"]));
            run(tool("ip").args(["-n", ns, "addr", "add", &ip4, "dev", dev]));
            run(tool("ip").args(["-n", ns, "-6", "addr", "add", &ip6, "dev", dev, "nodad"]));
            run(tool("ip").args(["-n", ns, "link", "set", dev, "up"]));
        }
        let www = std::env::temp_dir().join(format!("pmt-www-{tag}"));
        std::fs::create_dir_all(www.join("sub")).unwrap();
        std::fs::write(www.join("index.html"), "hello-app\n").unwrap();
        std::fs::write(www.join("sub/secret.txt"), format!("file-of-{tag}\n")).unwrap();
        // The app's environment block is exactly `env`, in order, duplicates and all:
        // python's ctypes calls execve(2) with a raw envp (std's Command, env(1) and
        // shells all deduplicate, and std sorts). `ip netns exec` and busybox exec in
        // place and keep the block, so the child PID is the app's PID.
        let mut cmd = Command::new("/usr/bin/python3");
        cmd.arg("-c")
            .arg(RAW_EXECVE)
            .arg(which("ip").unwrap())
            .args(["ip", "netns", "exec", &pod_ns])
            .args(if uid == 0 {
                vec![]
            } else {
                vec![
                    "setpriv".to_owned(),
                    format!("--reuid={uid}"),
                    format!("--regid={uid}"),
                    "--clear-groups".to_owned(),
                ]
            })
            .args(["busybox", "httpd", "-f", "-p"])
            .arg(APP_PORT.to_string())
            .arg("-h")
            .arg(&www)
            .env_clear()
            .env(
                "RAW_ENVP",
                env.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join("\n"),
            );
        let app = cmd.stdin(Stdio::null()).spawn().expect("start app");
        let pod = NetnsPod {
            pod_ns,
            client_ns,
            pod_ip,
            pod_ip6,
            client_ip: cli_ip.clone(),
            www,
            app,
        };
        wait_for(Duration::from_secs(5), || {
            pod.client_get("/").is_ok_and(|b| b.contains("hello-app"))
        })
        .expect("app never answered");
        pod
    }

    pub fn pid(&self) -> u32 {
        self.app.id()
    }

    pub fn ns_path(ns: &str) -> PathBuf {
        Path::new("/run/netns").join(ns)
    }

    pub fn app_addr6(&self) -> SocketAddr {
        format!("[{}]:{APP_PORT}", self.pod_ip6).parse().unwrap()
    }

    pub fn app_addr(&self) -> SocketAddr {
        format!("{}:{APP_PORT}", self.pod_ip).parse().unwrap()
    }

    /// A TCP connection from the client namespace (a sock made there by the
    /// library's own netns worker).
    pub fn client_connect(&self, addr: SocketAddr) -> std::io::Result<TcpStream> {
        let ex = NetnsExecutor::open(&Self::ns_path(&self.client_ns)).expect("client netns");
        ex.run_blocking(move || TcpStream::connect_timeout(&addr, Duration::from_secs(3)))
            .map_err(|e| std::io::Error::other(e.to_string()))
    }

    pub fn client_get(&self, path: &str) -> std::io::Result<String> {
        http_get(self.client_connect(self.app_addr())?, path)
    }

    /// A GET from inside the pod over loopback, made by a process carrying the
    /// agent GID — the ruleset lets that through to the application itself.
    pub fn get_as_agent_gid_from_inside(&self) -> String {
        run(tool("setpriv")
            .args([
                "--regid",
                &AGENT_GID.to_string(),
                "--clear-groups",
                "ip",
                "netns",
                "exec",
                &self.pod_ns,
            ])
            .args([
                "busybox",
                "wget",
                "-qO-",
                &format!("http://127.0.0.1:{APP_PORT}/"),
            ]))
    }

    pub fn nft_tables(&self) -> String {
        run(tool("ip").args(["netns", "exec", &self.pod_ns, "nft", "list", "tables"]))
    }

    pub fn nft_table(&self) -> String {
        nft_table_of(&["ip", "netns", "exec", &self.pod_ns])
    }

    pub fn app_alive(&mut self) -> bool {
        self.app.try_wait().unwrap().is_none()
    }
}

/// `nft list table inet <TABLE>` through a namespace-entering prefix command, with
/// nft's `# progname …` comment (the owning process's name) removed.
pub fn nft_table_of(prefix: &[&str]) -> String {
    let out = run(tool(prefix[0])
        .args(&prefix[1..])
        .args(["nft", "list", "table", "inet", TABLE]));
    out.lines()
        .map(|l| l.split(" # ").next().unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

impl Drop for NetnsPod {
    fn drop(&mut self) {
        let _ = self.app.kill();
        let _ = self.app.wait();
        for ns in [&self.pod_ns, &self.client_ns] {
            let _ = tool("ip").args(["netns", "del", ns]).status();
        }
        let _ = std::fs::remove_dir_all(&self.www);
    }
}

pub fn http_get(mut s: TcpStream, path: &str) -> std::io::Result<String> {
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

pub fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> Result<(), ()> {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if f() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(())
}

/// A free loopback port for a server started later, below the kernel's ephemeral
/// range (32768 and up by default). A port the kernel handed out for `:0` and was
/// given back is soon handed out again — CI's agent bound its metrics on `:0` and got
/// the very port picked here for its control API ("Address already in use"). Ports
/// in 20000–32767 are walked from a point set by this process's ID, one step per call
/// (so the tests of one binary, running in parallel, never pick the same one), each
/// checked free by a bind.
pub fn free_port() -> u16 {
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_768;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id() % SPAN,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::SeqCst) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {FIRST}-{}", FIRST + SPAN - 1)
}

/// The capabilities the agent Job adds (all others dropped); see
/// docs/attach-executor.md for why each is needed.
pub const JOB_CAPABILITIES: [&str; 5] = [
    "sys_admin",
    "sys_ptrace",
    "net_admin",
    "net_raw",
    "dac_read_search",
];

pub fn job_bounding_set() -> String {
    std::iter::once("-all".to_owned())
        .chain(JOB_CAPABILITIES.iter().map(|c| format!("+{c}")))
        .collect::<Vec<_>>()
        .join(",")
}

/// The agent binary, started with the agent GID like the Job's runAsGroup.
pub struct Agent {
    pub child: Child,
    pub control: SocketAddr,
    pub exports_dir: PathBuf,
    pub termination_log: PathBuf,
    pub stderr_path: PathBuf,
    /// Bearer token for the control API, when the agent was given credentials.
    pub token: Option<String>,
}

pub fn agent_cmd(
    gid: Option<u32>,
    target: &[String],
    extra: &[&str],
) -> (Command, SocketAddr, PathBuf, PathBuf, PathBuf) {
    let mut parts = agent_cmd_bare(gid, target);
    parts
        .0
        .args(["--agent-gid", &AGENT_GID.to_string()])
        .args(["--port", &format!("{APP_PORT}:{AGENT_PORT}")])
        .args(extra);
    parts
}

/// The agent command with only the per-test plumbing (control address, exports dir,
/// termination log, short timeouts): the target, GID and ports come from the caller,
/// as flags or as the controller's `AGENT_*` environment.
pub fn agent_cmd_bare(
    gid: Option<u32>,
    target: &[String],
) -> (Command, SocketAddr, PathBuf, PathBuf, PathBuf) {
    let n = SEQ.fetch_add(1, Ordering::SeqCst);
    let control: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let base = std::env::temp_dir().join(format!("pmt-agent-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&base).unwrap();
    let exports_dir = base.join("exports");
    let termination_log = base.join("termination-log");
    let stderr_path = base.join("stderr");
    let mut cmd = match gid {
        // Exactly the Job's privileges: root with the agent GID, and only the
        // capabilities the Job adds (everything else dropped from the bounding set).
        Some(g) => {
            let mut c = tool("setpriv");
            c.args(["--bounding-set", &job_bounding_set()])
                .args(["--regid", &g.to_string(), "--clear-groups"])
                .arg(env!("CARGO_BIN_EXE_podmotion-attach"));
            c
        }
        None => Command::new(env!("CARGO_BIN_EXE_podmotion-attach")),
    };
    cmd.args(target)
        .args(["--listen", &control.to_string()])
        // Several agents share this machine's loopback: no fixed metrics port (an
        // environment value, so a test's `--metrics-listen` wins).
        .env("PODMOTION_METRICS_LISTEN", "127.0.0.1:0")
        .arg("--exports-dir")
        .arg(&exports_dir)
        .arg("--termination-log")
        .arg(&termination_log)
        .args(["--intercept-wait-secs", "5", "--claim-timeout-secs", "20"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap());
    (cmd, control, exports_dir, termination_log, stderr_path)
}

impl Agent {
    pub fn spawn(target: &[String], extra: &[&str]) -> Agent {
        Agent::spawn_from(agent_cmd(Some(AGENT_GID), target, extra), None)
    }

    pub fn spawn_from(
        parts: (Command, SocketAddr, PathBuf, PathBuf, PathBuf),
        token: Option<String>,
    ) -> Agent {
        let (mut cmd, control, exports_dir, termination_log, stderr_path) = parts;
        let child = cmd.spawn().expect("spawn agent");
        Agent {
            child,
            control,
            exports_dir,
            termination_log,
            stderr_path,
            token,
        }
    }

    fn auth(&self) -> String {
        self.token
            .as_ref()
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default()
    }

    /// Spawns and waits for /healthz.
    pub fn start(target: &[String], extra: &[&str]) -> Agent {
        let mut a = Agent::spawn(target, extra);
        a.wait_ready(Duration::from_secs(30));
        a
    }

    pub fn wait_ready(&mut self, timeout: Duration) {
        let control = self.control;
        let ok = wait_for(timeout, || {
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("agent exited early ({st}): {}", self.stderr());
            }
            get(control, "/healthz").is_ok_and(|(s, _)| s == 200)
        });
        assert!(ok.is_ok(), "agent not ready: {}", self.stderr());
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }

    pub fn json(&self, path: &str) -> serde_json::Value {
        let (status, body) = request_with(self.control, "GET", path, &self.auth()).unwrap();
        assert_eq!(status, 200, "GET {path}: {body}");
        serde_json::from_str(&body).unwrap()
    }

    pub fn call(&self, method: &str, path: &str) -> (u16, serde_json::Value) {
        let (s, b) = request_with(self.control, method, path, &self.auth()).unwrap();
        (
            s,
            serde_json::from_str(&b).unwrap_or(serde_json::Value::Null),
        )
    }

    /// Opens an upgraded client stream on the control API.
    pub fn stream(&self, path: &str) -> BufReader<TcpStream> {
        let mut s = TcpStream::connect(self.control).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let auth = self.auth();
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: upgrade\r\nUpgrade: podmotion-stream\r\n\r\n").unwrap();
        let mut r = BufReader::new(s);
        let mut status = String::new();
        r.read_line(&mut status).unwrap();
        assert!(
            status.starts_with("HTTP/1.1 101"),
            "upgrade refused: {status}"
        );
        loop {
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            if line == "\r\n" || line.is_empty() {
                break;
            }
        }
        r
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(base) = self.exports_dir.parent() {
            let _ = std::fs::remove_dir_all(base);
        }
    }
}

pub fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    request_with(addr, "GET", path, "")
}

/// A bodyless request; `headers` are extra header lines, each ending in CRLF.
pub fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\nContent-Length: 0\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let status = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    // Bodies are small and unchunked except for hyper's chunked fallback; strip it.
    Ok((status, dechunk(&body)))
}

fn dechunk(body: &str) -> String {
    if body.starts_with('{') || body.starts_with('[') || body.is_empty() {
        return body.to_owned();
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}
