//! The testbed's networks: the namespaces, the links between nodes and pods, the pod
//! address as a CNI with sticky pod IPs moves it, and the pods' cgroups.

use super::{NODE_IPS, POD_IP, POD_PORT, TARGET_OWN_IP, Testbed, ip};
use podmotion_broker::procfs;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The network namespace `n` of the testbed `p` (see [`Testbed::ns`]).
pub(super) fn ns_of(p: &str, n: &str) -> String {
    format!("{p}-{n}")
}

/// The testbed's network namespaces, each new (a leftover of the same name deleted
/// first) with its loopback up: the two nodes, the source and target pods, the client.
pub(super) fn fresh_namespaces(p: &str) {
    for n in ["na", "nb", "src", "tgt", "cli"] {
        let _ = Command::new("ip")
            .args(["netns", "del", &ns_of(p, n)])
            .stderr(Stdio::null())
            .status();
        ip(&format!("netns add {}", ns_of(p, n)));
        ip(&format!("-n {} link set lo up", ns_of(p, n)));
    }
}

/// The two nodes' link: a veth pair between them, with [`NODE_IPS`].
pub(super) fn link_nodes(p: &str) {
    let ns = |n: &str| ns_of(p, n);
    ip(&format!(
        "link add eth0 netns {} type veth peer name eth0 netns {}",
        ns("na"),
        ns("nb")
    ));
    for (i, n) in ["na", "nb"].iter().enumerate() {
        ip(&format!(
            "-n {} addr add {}/24 dev eth0",
            ns(n),
            NODE_IPS[i]
        ));
        ip(&format!("-n {} link set eth0 up", ns(n)));
    }
}

/// The source and target pods' links to the client namespace, which routes
/// [`POD_IP`] to the source; the source holds the pod IP.
pub(super) fn link_pods_to_client(p: &str) {
    let ns = |n: &str| ns_of(p, n);
    ip(&format!(
        "link add to-src netns {} type veth peer name eth0 netns {}",
        ns("cli"),
        ns("src")
    ));
    ip(&format!(
        "link add to-tgt netns {} type veth peer name eth0 netns {}",
        ns("cli"),
        ns("tgt")
    ));
    for l in ["to-src", "to-tgt"] {
        ip(&format!("-n {} addr add 10.213.1.1/32 dev {l}", ns("cli")));
        ip(&format!("-n {} link set {l} up", ns("cli")));
    }
    ip(&format!("-n {} addr add {POD_IP}/32 dev eth0", ns("src")));
    for n in ["src", "tgt"] {
        ip(&format!("-n {} link set eth0 up", ns(n)));
        ip(&format!("-n {} route add 10.213.1.1 dev eth0", ns(n)));
        ip(&format!(
            "-n {} route add default via 10.213.1.1 dev eth0",
            ns(n)
        ));
    }
    ip(&format!(
        "-n {} route add {POD_IP}/32 dev to-src",
        ns("cli")
    ));
}

/// The testbed's pods cgroup (`<cgroup2>/<p>`) with the source and target pods'.
pub(super) fn pod_cgroups(p: &str) -> PathBuf {
    let cgroup = procfs::cgroup2_mount().expect("cgroup2").join(p);
    for c in ["src", "tgt"] {
        std::fs::create_dir_all(cgroup.join(c)).expect("cgroup");
    }
    cgroup
}

impl Testbed {
    pub fn ns(&self, n: &str) -> String {
        ns_of(&self.p, n)
    }

    pub fn add_pod(&mut self, name: &str) {
        assert!(
            name.len() <= 12,
            "pod name {name:?}: its veth name would be too long"
        );
        let (ns, cli) = (self.ns(name), self.ns("cli"));
        let _ = Command::new("ip")
            .args(["netns", "del", &ns])
            .stderr(Stdio::null())
            .status();
        ip(&format!("netns add {ns}"));
        self.pods.push(name.to_owned());
        ip(&format!("-n {ns} link set lo up"));
        ip(&format!(
            "link add to-{name} netns {cli} type veth peer name eth0 netns {ns}"
        ));
        ip(&format!("-n {cli} addr add 10.213.1.1/32 dev to-{name}"));
        ip(&format!("-n {cli} link set to-{name} up"));
        ip(&format!("-n {ns} link set eth0 up"));
        ip(&format!("-n {ns} route add 10.213.1.1 dev eth0"));
        ip(&format!(
            "-n {ns} route add default via 10.213.1.1 dev eth0"
        ));
        std::fs::create_dir_all(self.cgroup.join(name)).expect("cgroup");
    }

    pub fn route_pod_address_to(&self, name: &str) {
        self.pod_address_in(name);
        ip(&format!(
            "-n {} route replace {POD_IP}/32 dev to-{name}",
            self.ns("cli")
        ));
    }

    pub fn pod_address_in(&self, name: &str) {
        ip(&format!(
            "-n {} addr replace {POD_IP}/32 dev eth0",
            self.ns(name)
        ));
    }

    pub fn pod_address_gone_from(&self, name: &str) {
        ip(&format!(
            "-n {} addr del {POD_IP}/32 dev eth0",
            self.ns(name)
        ));
    }

    pub fn add_address_to_target(&self) {
        ip(&format!(
            "-n {} addr add {POD_IP}/32 dev eth0",
            self.ns("tgt")
        ));
    }

    pub fn give_target_its_own_address(&self) {
        ip(&format!(
            "-n {} addr add {TARGET_OWN_IP}/32 dev eth0",
            self.ns("tgt")
        ));
        ip(&format!(
            "-n {} route add {TARGET_OWN_IP}/32 dev to-tgt",
            self.ns("cli")
        ));
    }

    pub fn connect_to(&self, ip: &'static str) -> std::io::Result<TcpStream> {
        self.in_netns("cli", move || {
            let s = TcpStream::connect_timeout(
                &format!("{ip}:{POD_PORT}").parse().expect("addr"),
                Duration::from_secs(5),
            )?;
            s.set_read_timeout(Some(Duration::from_secs(20)))?;
            Ok(s)
        })
    }

    pub fn route_to_target(&self) {
        ip(&format!(
            "-n {} route replace {POD_IP}/32 dev to-tgt",
            self.ns("cli")
        ));
    }

    pub fn in_netns<T: Send + 'static>(
        &self,
        ns: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        let file = std::fs::File::open(format!("/run/netns/{}", self.ns(ns))).expect("netns");
        std::thread::spawn(move || {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("netns thread")
    }

    pub fn connect_timeout(&self, t: Duration) -> std::io::Result<TcpStream> {
        self.in_netns("cli", move || {
            let s = TcpStream::connect_timeout(
                &format!("{POD_IP}:{POD_PORT}").parse().expect("addr"),
                t,
            )?;
            s.set_read_timeout(Some(Duration::from_secs(20)))?;
            Ok(s)
        })
    }
}
