//! The testbed's nodes: their brokers (in-process), their agents (real
//! `podmotion-agent` processes) and the operator's side that drives them.

use super::net::{fresh_namespaces, link_nodes, link_pods_to_client, pod_cgroups};
use super::tls::make_tls;
use super::{AGENT_NAMES, NODE_IPS, Testbed, Tls2, criu_path, sh};
use podmotion_broker::{Broker, Config as BrokerConfig};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

/// Node `i`'s broker, serving on `<dir>/node<i>/broker.sock` from a thread of its
/// own, with its checkpoint root on a tmpfs.
fn start_broker(dir: &Path, p: &str, i: usize) -> Arc<Broker> {
    let run = dir.join(format!("node{i}"));
    std::fs::create_dir_all(run.join("checkpoints")).expect("dir");
    sh(&format!(
        "mount -t tmpfs -o mode=0700,size=2g tmpfs {}",
        run.join("checkpoints").display()
    ));
    let b = Broker::new(BrokerConfig {
        run_dir: run.clone(),
        pods_cgroup_root: format!("/{p}"),
        allowed_uid: 0,
        // The testbed's agents run in their node's network namespace, this
        // broker in the test's: not the chart's one-pod shape.
        same_netns_peers: false,
        // The testbed's pods are the cgroups `src` and `tgt`, which carry no
        // container ID (its "containers" are rows of the container table): not the
        // kubelet's cgroup layout.
        container_cgroups: false,
        // The address hand-over is off: the testbed's pods are not on one L2 segment
        // (the client routes the pod address to the source's link), so an announced
        // address would not move; its tests play a CNI that moves the address instead.
        handover_cidrs: Vec::new(),
        address_linger: std::time::Duration::from_secs(3600),
        sweep_interval: std::time::Duration::from_secs(2),
        hold_neighbours: false,
        forward_new_connections: false,
    });
    let l = b.bind(&run.join("broker.sock")).expect("broker socket");
    let b2 = Arc::clone(&b);
    std::thread::spawn(move || b2.serve_listener(l));
    b
}

impl Testbed {
    pub fn new(name: &str, agent_bin: &Path, testload_bin: &Path) -> Self {
        Self::build(
            name,
            agent_bin,
            testload_bin,
            AGENT_NAMES.map(str::to_owned),
            [vec![], vec![]],
        )
    }

    pub fn with_nodes(name: &str, agent_bin: &Path, testload_bin: &Path, nodes: [&str; 2]) -> Self {
        Self::build(
            name,
            agent_bin,
            testload_bin,
            nodes.map(str::to_owned),
            nodes.map(|n| vec![format!("podmotion-agent.{n}")]),
        )
    }

    fn build(
        name: &str,
        agent_bin: &Path,
        testload_bin: &Path,
        nodes: [String; 2],
        extra_sans: [Vec<String>; 2],
    ) -> Self {
        let p = format!("pm{}{}", name, std::process::id() % 100_000);
        let dir = PathBuf::from(format!("/run/podmotion-testbed/{p}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        fresh_namespaces(&p);
        link_nodes(&p);
        link_pods_to_client(&p);
        let cgroup = pod_cgroups(&p);
        let brokers = [0, 1].map(|i| start_broker(&dir, &p, i));
        let tls = make_tls(&dir, nodes, &extra_sans);
        Self {
            p,
            dir,
            cgroup,
            brokers,
            tls,
            agent_bin: agent_bin.into(),
            testload_bin: testload_bin.into(),
            agents: [None, None],
            agent_args: vec![],
            criu: criu_path(),
            children: vec![],
            rootfs: None,
            pods: vec![],
        }
    }

    pub fn checkpoints(&self, node: usize) -> PathBuf {
        self.dir.join(format!("node{node}/checkpoints"))
    }

    pub fn checkpoint_files(&self, node: usize) -> Vec<PathBuf> {
        fn walk(d: &Path, out: &mut Vec<PathBuf>) {
            for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
                if e.path().is_dir() {
                    walk(&e.path(), out)
                }
                out.push(e.path());
            }
        }
        let mut v = vec![];
        walk(&self.checkpoints(node), &mut v);
        v
    }

    pub fn start_agent(&mut self, node: usize) {
        self.start_agent_at(node, None)
    }

    pub fn start_agent_at(&mut self, node: usize, listen: Option<&str>) {
        let name = AGENT_NAMES[node];
        let log = std::fs::File::create(self.dir.join(format!("{name}.log"))).expect("log");
        let (mut cmd, listen) = match listen {
            None => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{}", self.ns(["na", "nb"][node])))
                    .arg(&self.agent_bin);
                (c, format!("{}:7443", NODE_IPS[node]))
            }
            Some(l) => (Command::new(&self.agent_bin), l.to_string()),
        };
        // Two agents may share a network namespace (both on loopback): the metrics
        // port is the kernel's choice unless the test names one.
        if !self
            .agent_args
            .iter()
            .any(|a| a.starts_with("--metrics-listen"))
        {
            cmd.args(["--metrics-listen", "127.0.0.1:0"]);
        }
        let child = cmd
            .args(["--listen", &listen])
            .arg("--container-table")
            .arg(self.container_table())
            .arg("--tls-ca")
            .arg(self.dir.join("ca.crt"))
            .arg("--tls-cert")
            .arg(self.dir.join(format!("{name}.crt")))
            .arg("--tls-key")
            .arg(self.dir.join(format!("{name}.key")))
            .arg("--criu")
            .arg(&self.criu)
            .arg("--broker-socket")
            .arg(self.dir.join(format!("node{node}/broker.sock")))
            .arg("--checkpoints-root")
            .arg(self.checkpoints(node))
            .args(&self.agent_args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("agent");
        self.agents[node] = Some(child);
    }

    pub fn agent_log(&self, node: usize) -> String {
        std::fs::read_to_string(self.dir.join(format!("{}.log", AGENT_NAMES[node])))
            .unwrap_or_default()
    }

    pub fn agent_peak_rss_kib(&self, node: usize) -> Option<u64> {
        let pid = self.agents[node].as_ref()?.id();
        let st = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        st.lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    pub fn agent_cpu_ms(&self, node: usize) -> Option<u64> {
        let pid = self.agents[node].as_ref()?.id();
        let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command name (which may hold spaces): utime, stime are
        // fields 14 and 15, i.e. 12 and 13 after the closing parenthesis.
        let rest = st.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        // USER_HZ: 100 on every Linux architecture this runs on.
        Some(ticks * 10)
    }

    pub fn kill_agent(&mut self, node: usize) {
        if let Some(mut c) = self.agents[node].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn terminate_agent(&mut self, node: usize) -> Option<std::process::ExitStatus> {
        let mut c = self.agents[node].take()?;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        for _ in 0..200 {
            if let Ok(Some(st)) = c.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        c.wait().ok()
    }

    pub fn endpoint(node: usize) -> String {
        format!("https://{}:7443", NODE_IPS[node])
    }

    pub fn operator<F, Fut, T>(&self, f: F) -> T
    where
        F: FnOnce(Tls2) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T>,
        T: Send + 'static,
    {
        let tls = Tls2 {
            operator: self.tls.operator.clone(),
        };
        self.in_netns("na", move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("rt")
                .block_on(f(tls))
        })
    }
}
