//! The raw CRIU side: a fresh pod's container dumped, copied and restored through the
//! same `criu swrk` RPC and options as the agent's, in the node's mount namespace, and
//! everything it started removed on every exit path.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use podmotion_agent::containers::Containers;
use podmotion_agent::criu::{self, Criu, InheritFd, Opts, Req};
use podmotion_agent::mounts::{self, HostView};

use super::figures::{Raw, ms};
use crate::real::testload::{POD_TIMEOUT, addr, ask, node_of};
use crate::{pod_running_ready, random_suffix, run_dir, wait_list};

/// This run's scratch: the image directories (tmpfs) and the CRIU wrappers.
pub(super) struct Work {
    /// `/dev/shm/pm-bench-real-<id>`: the images, on tmpfs.
    shm: PathBuf,
    /// `/tmp/pm-bench-real-<id>`: the wrapper scripts (executable).
    bin: PathBuf,
    id: String,
}

impl Work {
    pub(super) fn new() -> anyhow::Result<Work> {
        let id = random_suffix();
        let w = Work {
            shm: PathBuf::from(format!("/dev/shm/pm-bench-real-{id}")),
            bin: PathBuf::from(format!("/tmp/pm-bench-real-{id}")),
            id,
        };
        for d in [&w.shm, &w.bin] {
            std::fs::create_dir_all(d)?;
            std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        }
        Ok(w)
    }

    /// A `criu` that runs in `node`'s mount namespace (where the runtime spec's paths
    /// and the container's root filesystem are), with `redirects` (shell) applied.
    pub(super) fn criu(&self, node: &str, name: &str, redirects: &str) -> anyhow::Result<Criu> {
        let path = self.bin.join(name);
        let ns = run_dir().join("ns").join(node);
        let script = format!(
            "#!/bin/bash\nexec nsenter --mount={} -- {} \"$@\" {redirects}\n",
            ns.display(),
            podmotion_agent::testbed::criu_path().display()
        );
        std::fs::write(&path, script)?;
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        Ok(Criu { binary: path })
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.shm);
        let _ = std::fs::remove_dir_all(&self.bin);
    }
}

/// What one raw round leaves, removed on every exit path: the restored copy and the
/// stopped source (killed), the network namespace, the image directories.
struct RawCleanup {
    netns: String,
    dir: PathBuf,
    pids: Vec<i32>,
}

impl RawCleanup {
    /// A fresh image directory (with its `src`) on the run's tmpfs, and a fresh network
    /// namespace for the restored copy.
    fn new(work: &Work, n: &str) -> anyhow::Result<RawCleanup> {
        let cleanup = RawCleanup {
            netns: format!("pmbench-{}-{n}", work.id),
            dir: work.shm.join(n),
            pids: vec![],
        };
        std::fs::create_dir_all(cleanup.dir.join("src"))?;
        let st = Command::new("ip")
            .args(["netns", "add", &cleanup.netns])
            .status()?;
        ensure!(st.success(), "ip netns add {}", cleanup.netns);
        Ok(cleanup)
    }
}

impl Drop for RawCleanup {
    fn drop(&mut self) {
        for pid in &self.pids {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The one Running, Ready pod of `app` whose ballast is written.
pub(super) async fn ready_pod(pods: &Api<Pod>, app: &str) -> anyhow::Result<Pod> {
    let p = wait_list(
        pods,
        &format!("app={app}"),
        POD_TIMEOUT,
        "one Ready pod",
        |ps| {
            ps.len() == 1
                && pod_running_ready(&ps[0])
                && ps[0].metadata.deletion_timestamp.is_none()
        },
    )
    .await?[0]
        .clone();
    let a = addr(&p);
    for _ in 0..1500 {
        if ask(&a, "ballast").is_ok_and(|x| x == "filled") {
            return Ok(p);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("{}: the ballast was never filled", p.name_any())
}

fn netns_ino(pid: i32) -> anyhow::Result<String> {
    Ok(std::fs::read_link(format!("/proc/{pid}/ns/net"))?
        .to_string_lossy()
        .chars()
        .filter(char::is_ascii_digit)
        .collect())
}

fn criu_call(criu: Criu, req: Req, log: PathBuf) -> anyhow::Result<criu::Resp> {
    Ok(criu.call(req, Some(&log))?)
}

/// A raw round on a fresh pod of `app`, which is deleted afterwards whatever happened
/// (its container was dumped and killed, or may have been).
pub(super) async fn raw_round(
    pods: &Api<Pod>,
    app: &str,
    work: &Work,
    nodes: &[String],
) -> anyhow::Result<Raw> {
    let pod = ready_pod(pods, app).await?;
    let res = raw_checkpoint_restore(&pod, work, nodes).await;
    delete_now(pods, &pod.name_any()).await?;
    res
}

/// Deletes the pod `name` without a grace period.
pub(super) async fn delete_now(pods: &Api<Pod>, name: &str) -> anyhow::Result<()> {
    pods.delete(
        name,
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        },
    )
    .await?;
    Ok(())
}

async fn raw_checkpoint_restore(pod: &Pod, work: &Work, nodes: &[String]) -> anyhow::Result<Raw> {
    let c = container_of(pod, nodes).await?;
    let before: u64 = ask(&addr(pod), "get")?.parse()?;

    let n = random_suffix();
    let mut cleanup = RawCleanup::new(work, &n)?;
    let (src, dst) = (cleanup.dir.join("src"), cleanup.dir.join("dst"));
    // Restore: fd 90 the fresh netns, 91–93 stand for the shim's stdio pipes (numbers
    // far above the RPC socket's, which the wrapper passes on).
    let dump_criu = work.criu(&c.node, &format!("criu-dump-{n}"), "")?;
    let restore_criu = work.criu(
        &c.node,
        &format!("criu-restore-{n}"),
        &format!(
            "90</run/netns/{} 91</dev/null 92>/dev/null 93>/dev/null",
            cleanup.netns
        ),
    )?;
    let dump = dump_opts(&c, &src);
    let restore = restore_opts(&c, &dst)?;

    // Frozen from here.
    let (r, dump_ms) = timed_criu(dump_criu, criu::REQ_DUMP, dump, src.join("dump.log")).await?;
    // Stopped, not dead: killed when the round ends.
    cleanup.pids.push(c.pid);
    r.context("raw criu dump")?;
    let t1 = Instant::now();
    let st = Command::new("cp").arg("-r").arg(&src).arg(&dst).status()?;
    let copy_ms = ms(t1.elapsed());
    ensure!(st.success(), "cp -r");
    let (r, restore_ms) = timed_criu(
        restore_criu,
        criu::REQ_RESTORE,
        restore,
        dst.join("restore.log"),
    )
    .await?;
    let resp = r.context("raw criu restore")?;
    let restored = resp.restore.map(|r| r.pid).unwrap_or(0);
    ensure!(restored > 0, "criu reported no restored pid");
    cleanup.pids.insert(0, restored);
    let bytes = podmotion_agent::images::size(&dst);

    let after = restored_counter(&cleanup.netns)?;
    ensure!(
        after >= before,
        "the restored copy's counter went back: {before} then {after}"
    );
    drop(cleanup);
    Ok(Raw {
        node: c.node,
        dump_ms,
        copy_ms,
        restore_ms,
        bytes,
    })
}

/// A pod's container as the agent finds it: its node, process, network namespace
/// and stdio pipes, its external mounts, and its mounts with the root filesystem at
/// its path in the node's mount namespace.
struct Source {
    node: String,
    pid: i32,
    ino: String,
    stdio: Vec<mounts::StdioPipe>,
    externals: Vec<String>,
    holder: mounts::Holder,
}

/// The container of `pod` (on one of `nodes`), resolved through the node's
/// containerd as the agent resolves it.
async fn container_of(pod: &Pod, nodes: &[String]) -> anyhow::Result<Source> {
    let node = node_of(pod);
    ensure!(nodes.contains(&node), "{} on {node}", pod.name_any());
    let cid = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.container_id.clone())
        .context("container ID")?;
    let id = cid.rsplit("://").next().unwrap_or(&cid).to_owned();
    // The node's containerd, as the agent finds it (from the host: the node's run dir).
    let node_run = run_dir().join("nodes").join(&node).join("run");
    let resolved = Containers::Cri {
        run_dir: node_run.clone(),
        host: HostView {
            host_root: "/".into(),
        },
    }
    .resolve(std::slice::from_ref(&cid))
    .await
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let pid = resolved.pid;
    let fs = resolved.fs.context("no runtime spec")?;
    // The root filesystem at its path in the node's mount namespace.
    let rootfs = Path::new("/run").join(fs.rootfs.strip_prefix(&node_run).with_context(|| {
        format!(
            "rootfs {} outside {}",
            fs.rootfs.display(),
            node_run.display()
        )
    })?);
    ensure!(
        rootfs.ends_with(Path::new(&id).join("rootfs")),
        "rootfs {}",
        rootfs.display()
    );
    let mountinfo =
        mounts::parse_mountinfo(&std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))?);
    let externals = mounts::dump_externals(&fs.spec, &mountinfo);
    let stdio = mounts::stdio_pipes(pid);
    let ino = netns_ino(pid)?;
    Ok(Source {
        node,
        pid,
        ino,
        stdio,
        externals,
        holder: mounts::Holder {
            spec: fs.spec,
            mountinfo,
            rootfs,
        },
    })
}

/// The agent's final-dump options: its external netns and mounts, established TCP,
/// left stopped.
fn dump_opts(c: &Source, src: &Path) -> Opts {
    let mut dump = Opts::new(src, "dump.log");
    dump.pid = Some(c.pid);
    dump.external = vec![format!("net[{}]:podnet", c.ino)];
    dump.external
        .extend(mounts::dump_external_args(&c.externals));
    dump.tcp_established = Some(true);
    dump.tcp_skip_in_flight = Some(true);
    dump.leave_stopped = Some(true);
    dump
}

/// The restore's options: the fresh netns as fd 90, the stdio pipes from 91, each
/// external mount bound to the same source mount, the container's own root filesystem
/// as root, `tcp-close`.
fn restore_opts(c: &Source, dst: &Path) -> anyhow::Result<Opts> {
    let mut restore = Opts::new(dst, "restore.log");
    restore.inherit_fd = vec![InheritFd {
        key: "podnet".into(),
        fd: 90,
    }];
    for p in &c.stdio {
        if !restore.inherit_fd.iter().any(|f| f.key == p.key) {
            restore.inherit_fd.push(InheritFd {
                key: p.key.clone(),
                fd: 91 + p.fd,
            });
        }
    }
    restore.external = mounts::restore_external_args(
        &c.externals,
        &c.holder,
        &HostView {
            host_root: "/".into(),
        },
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    restore.root = Some(c.holder.rootfs.to_string_lossy().into_owned());
    restore.tcp_close = Some(true);
    Ok(restore)
}

/// One CRIU request of `kind` (logged to `log`), off the async threads; its answer and
/// how many ms it took.
async fn timed_criu(
    criu: Criu,
    kind: i32,
    opts: Opts,
    log: PathBuf,
) -> anyhow::Result<(anyhow::Result<criu::Resp>, f64)> {
    let t = Instant::now();
    let r = tokio::task::spawn_blocking(move || {
        criu_call(
            criu,
            Req {
                r#type: kind,
                opts: Some(opts),
            },
            log,
        )
    })
    .await?;
    Ok((r, ms(t.elapsed())))
}

/// The counter the restored copy serves on (inside its network namespace `netns`).
fn restored_counter(netns: &str) -> anyhow::Result<u64> {
    let answer = Command::new("ip")
        .args(["netns", "exec", netns, "bash", "-c"])
        .arg(
            "ip link set lo up && exec 3<>/dev/tcp/127.0.0.1/8080 && echo get >&3 \
             && read -t 10 l <&3 && echo $l",
        )
        .output()?;
    String::from_utf8_lossy(&answer.stdout)
        .trim()
        .parse()
        .with_context(|| {
            format!(
                "the restored copy's counter: {}",
                String::from_utf8_lossy(&answer.stderr)
            )
        })
}
