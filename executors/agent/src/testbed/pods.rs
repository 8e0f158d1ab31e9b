//! The testbed's pods and what runs in them: workloads and holders, as processes or
//! as containers (the testbed's container runtime, its container table), and the
//! `Prepare` that names them.

use super::{POD_PORT, Testbed, ask, sh};
use podmotion_broker::procfs;
use podmotion_wire::ids::ProcRef;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The testbed's container runtime, run as `bash container.sh <rootfs> <argv...>`
/// inside new mount and PID namespaces (`unshare -m -p -f --propagation private`):
/// descriptors inherited from the test's environment closed (the host's files are not
/// the container's), a fresh `/proc` of the new PID namespace and a tmpfs `/dev` with
/// `null` in the root filesystem, which becomes the root (`pivot_root`, the old root
/// detached), then `argv` as the namespace's init, in a session of its own (CRIU dumps
/// a session leader's tree), its streams on the container's `/dev/null`.
const CONTAINER_SH: &str = r#"R=$1; shift
for f in /proc/self/fd/*; do
  fd=${f##*/}; [ "$fd" -gt 2 ] && eval "exec $fd>&-"
done 2>/dev/null
mount -t proc proc "$R/proc" &&
mount -t tmpfs -o mode=755,size=1m tmpfs "$R/dev" &&
mknod -m 666 "$R/dev/null" c 1 3 &&
cd "$R" && pivot_root . tmp && umount -l /tmp || exit 1
exec setsid "$@" </dev/null >/dev/null 2>&1
"#;

impl Testbed {
    /// Starts `sh -c script` with no inherited stdio (kept as a child of the testbed,
    /// reaped at its teardown) and returns its PID.
    fn spawn_quiet(&mut self, script: &str, what: &str) -> i32 {
        let child = Command::new("sh")
            .args(["-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let outer = child.id() as i32;
        self.children.push(child);
        outer
    }

    pub fn container_table(&self) -> PathBuf {
        self.dir.join("containers")
    }

    pub fn register_container(&self, id: &str, pid: i32) {
        self.table_line(&format!("{id} {pid}"));
    }

    fn table_line(&self, line: &str) {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.container_table())
            .expect("container table");
        writeln!(f, "{line}").expect("container table");
    }

    pub fn container(&self, name: &str, pid: i32) -> String {
        let id = format!("testbed://{}-{name}", self.p);
        self.register_container(&id, pid);
        id
    }

    pub fn prepare_request(
        &self,
        uid: &str,
        node: usize,
        container_id: &str,
        tcp: podmotion_wire::agent::TcpPreservation,
    ) -> podmotion_wire::agent::PrepareRequest {
        use podmotion_wire::agent::{PrepareRequest, Role};
        PrepareRequest {
            migration_uid: uid.into(),
            role: [Role::Source, Role::Target][node] as i32,
            transfer_key: vec![42; 32],
            tcp: tcp as i32,
            container_ids: vec![container_id.into()],
            peer_node: self.tls.nodes[1 - node].clone(),
            freeze_budget_ms: 0,
            post_copy: false,
            containers: vec![],
            hold_services: vec![],
        }
    }

    pub fn start_workload(&mut self, ballast_mib: usize, dirty_kib_s: usize) -> ProcRef {
        let script = format!(
            "echo $$ > {cg}/cgroup.procs && exec nsenter --net=/run/netns/{ns} unshare -p -f setsid {bin} serve {POD_PORT} {ballast_mib} {dirty_kib_s}",
            cg = self.cgroup.join("src").display(),
            ns = self.ns("src"),
            bin = self.testload_bin.display()
        );
        // No inherited files: CRIU restores open files by path and size, so a log
        // that grew between dump and restore would (rightly) fail the restore.
        let outer = self.spawn_quiet(&script, "workload");
        for _ in 0..1200 {
            if let Some(root) = procfs::tree(outer).into_iter().find(|p| {
                std::fs::read_to_string(format!("/proc/{p}/status"))
                    .map(|s| {
                        s.lines()
                            .any(|l| l.starts_with("NSpid:") && l.ends_with("\t1"))
                    })
                    .unwrap_or(false)
            }) && let Ok(mut c) = self.connect_timeout(Duration::from_millis(200))
            {
                // Measure the workload, not its warm-up: wait for the ballast.
                while ask(&mut c, "ballast").expect("ballast") != "filled" {
                    std::thread::sleep(Duration::from_millis(50));
                }
                return ProcRef {
                    pid: root,
                    start_time: procfs::start_time(root).expect("start"),
                };
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("workload did not come up");
    }

    pub fn start_holder(&mut self) -> ProcRef {
        let script = format!(
            "echo $$ > {cg}/cgroup.procs && exec nsenter --net=/run/netns/{ns} sleep 100000",
            cg = self.cgroup.join("tgt").display(),
            ns = self.ns("tgt")
        );
        let child = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .spawn()
            .expect("holder");
        let pid = child.id() as i32;
        self.children.push(child);
        for _ in 0..200 {
            if procfs::cgroup_of(pid)
                .map(|c| c.ends_with("/tgt"))
                .unwrap_or(false)
                && std::fs::read_link(format!("/proc/{pid}/exe"))
                    .map(|e| e.ends_with("sleep"))
                    .unwrap_or(false)
            {
                return ProcRef {
                    pid,
                    start_time: procfs::start_time(pid).expect("start"),
                };
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("holder did not come up");
    }

    pub fn rootfs(&mut self) -> PathBuf {
        if let Some(r) = &self.rootfs {
            return r.clone();
        }
        let r = PathBuf::from(format!("/run/podmotion-testbed/{}.rootfs", self.p));
        std::fs::create_dir_all(&r).expect("rootfs dir");
        sh(&format!("mount --bind / {}", r.display()));
        self.rootfs = Some(r.clone());
        sh(&format!("mount -o remount,bind,ro {}", r.display()));
        r
    }

    pub fn start_container(&mut self, pod: &str, argv: &[String]) -> ProcRef {
        let rootfs = self.rootfs();
        let runtime = self.dir.join("container.sh");
        std::fs::write(&runtime, CONTAINER_SH).expect("container.sh");
        let quoted: Vec<String> = argv.iter().map(|a| format!("'{a}'")).collect();
        let script = format!(
            "echo $$ > {cg}/cgroup.procs && exec nsenter --net=/run/netns/{ns} unshare -m -p -f --propagation private bash {runtime} {rootfs} {argv}",
            cg = self.cgroup.join(pod).display(),
            ns = self.ns(pod),
            runtime = runtime.display(),
            rootfs = rootfs.display(),
            argv = quoted.join(" "),
        );
        let outer = self.spawn_quiet(&script, "container");
        let want: Vec<u8> = argv
            .iter()
            .flat_map(|a| [a.as_bytes(), b"\0"].concat())
            .collect();
        for _ in 0..1000 {
            let init = procfs::tree(outer).into_iter().find(|p| {
                procfs::ns_pids(*p).is_some_and(|n| n.len() > 1 && n.last() == Some(&1))
                    && std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c == want)
            });
            if let Some(pid) = init {
                return ProcRef {
                    pid,
                    start_time: procfs::start_time(pid).expect("start"),
                };
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("container {argv:?} did not come up in pod {pod}");
    }

    pub fn start_workload_container(
        &mut self,
        pod: &str,
        ballast_mib: usize,
        dirty_kib_s: usize,
    ) -> ProcRef {
        let argv = [
            self.testload_bin.display().to_string(),
            "serve".into(),
            POD_PORT.to_string(),
            ballast_mib.to_string(),
            dirty_kib_s.to_string(),
        ];
        let root = self.start_container(pod, &argv);
        for _ in 0..1200 {
            if let Ok(mut c) = self.connect_timeout(Duration::from_millis(200)) {
                while ask(&mut c, "ballast").expect("ballast") != "filled" {
                    std::thread::sleep(Duration::from_millis(50));
                }
                return root;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("workload container did not come up");
    }

    pub fn start_holder_container(&mut self, pod: &str) -> ProcRef {
        let hold = self.dir.join("hold");
        if !hold.exists() {
            let st = Command::new(&self.agent_bin)
                .arg(crate::holder::INSTALL)
                .arg(&hold)
                .status()
                .expect("install-holder");
            assert!(st.success(), "install-holder failed");
        }
        self.start_container(
            pod,
            &[hold.display().to_string(), crate::holder::HOLD.into()],
        )
    }

    pub fn container_with_rootfs(&mut self, name: &str, pid: i32) -> String {
        let rootfs = self.rootfs();
        let id = format!("testbed://{}-{name}", self.p);
        self.table_line(&format!("{id} {pid} {}", rootfs.display()));
        id
    }
}
