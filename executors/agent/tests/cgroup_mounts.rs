//! The restore's cgroup mount, on the real kernel, as root: a target holder in a
//! systemd-driver container scope on this machine's cgroup2 hierarchy, with a cgroup
//! namespace and a cgroup2 mount of its own at the node's mount point (what a runtime
//! gives a container on a cgroup v2 node). Read from the node's cgroup namespace, its
//! mount names the scope, and the bind the restore asks of CRIU is the holder's own
//! cgroup directory on the node; read from inside another cgroup namespace (as an agent
//! in a private one would), the root climbs (`/../…`) and the restore refuses it
//! instead of binding a wrong directory.

use podmotion_agent::mounts::{self, Holder, HostView};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Cleanup {
    holder: Option<Child>,
    dirs: Vec<PathBuf>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(mut h) = self.holder.take() {
            let _ = h.kill();
            let _ = h.wait();
        }
        for d in self.dirs.iter().rev() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while std::fs::remove_dir(d).is_err() && d.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn cgroup2_mount() -> PathBuf {
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    mounts::parse_mountinfo(&mi)
        .into_iter()
        .find(|m| m.fstype == "cgroup2" && m.root == "/")
        .map(|m| PathBuf::from(m.mount_point))
        .expect("no cgroup2 hierarchy mounted here")
}

#[test]
fn a_systemd_scopes_cgroup2_mount_binds_its_node_directory_and_a_climbing_root_is_refused() {
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let v2 = cgroup2_mount();
    let top = format!("pma-cgm-{}", std::process::id());
    let uid_ = "6fecc63a_68d4_4995_b8ec_5091216a6244";
    let scope = format!(
        "/{top}/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-3d359f10a9c1e6f0.scope"
    );
    let reader_cg = format!("/{top}/kubepods.slice/agent.scope");
    let mut c = Cleanup {
        holder: None,
        dirs: Vec::new(),
    };
    let mut dir = v2.clone();
    for comp in scope.trim_start_matches('/').split('/') {
        dir.push(comp);
        std::fs::create_dir(&dir).unwrap();
        c.dirs.push(dir.clone());
    }
    let reader_dir = v2.join(reader_cg.trim_start_matches('/'));
    std::fs::create_dir(&reader_dir).unwrap();
    c.dirs.insert(2, reader_dir.clone());
    // The holder: into the scope, then a private mount and cgroup namespace with the
    // cgroup2 hierarchy mounted over the node's mount point (on a tmpfs first: the
    // kernel refuses the same hierarchy right over its own mount).
    let key = v2.display().to_string();
    let holder = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "echo $$ > {procs} && exec unshare -C sh -c 'mount -t tmpfs none {key} && mount -t cgroup2 none {key} && exec sleep 600'",
            procs = dir.join("cgroup.procs").display()
        ))
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let pid = holder.id() as i32;
    c.holder = Some(holder);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mountinfo = loop {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim() == "sleep" {
            break std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
        }
        assert!(Instant::now() < deadline, "the holder did not start");
        std::thread::sleep(Duration::from_millis(20));
    };
    let holder = Holder {
        spec: vec![],
        mountinfo: mounts::parse_mountinfo(&mountinfo),
        rootfs: "/".into(),
    };
    let host = HostView {
        host_root: "/".into(),
    };
    let args = mounts::restore_external_args(std::slice::from_ref(&key), &holder, &host).unwrap();
    println!("read from the node's cgroup namespace: {args:?}");
    assert_eq!(args, [format!("mnt[{key}]:{key}{scope}")]);
    // The bind's source is the holder's own cgroup directory on the node.
    let procs =
        std::fs::read_to_string(Path::new(&format!("{key}{scope}")).join("cgroup.procs")).unwrap();
    assert!(
        procs.lines().any(|l| l == pid.to_string()),
        "the holder {pid} is not in {scope}: {procs}"
    );

    // The same mountinfo read by a process in a private cgroup namespace elsewhere in
    // the tree (an agent's container on a cgroup v2 node).
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {procs} && exec unshare -C cat /proc/{pid}/mountinfo",
            procs = reader_dir.join("cgroup.procs").display()
        ))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen = String::from_utf8(out.stdout).unwrap();
    let holder = Holder {
        mountinfo: mounts::parse_mountinfo(&seen),
        ..holder
    };
    let root = &holder
        .mountinfo
        .iter()
        .rev()
        .find(|m| m.mount_point == key)
        .unwrap()
        .root;
    println!("read from a private cgroup namespace: root {root}");
    assert!(root.starts_with("/.."), "{root}");
    let e = mounts::restore_external_args(std::slice::from_ref(&key), &holder, &host).unwrap_err();
    assert!(e.contains("another cgroup namespace"), "{e}");
}
