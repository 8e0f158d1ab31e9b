//! Benchmark (not a test): downtime of PodMigrations of a real container between the two
//! real nodes, beside raw CRIU of the same container, side by side in one run (issue 15;
//! the ratios issue 18 sets targets for).
//!
//!     eval "$(hack/cluster.sh env)"       # the cluster with real nodes, images pushed
//!     cargo build -p podmotion-e2e --bin bench_real_migration
//!     PODMOTION_IMAGES_VALUES=… PODMOTION_IMAGES_LIST=… \
//!       target/debug/bench_real_migration [--rounds 3] [--sizes 64,512,2048] [--dirty-kib 1024] [--mig-first] [--timeline]
//!
//! The chart is installed from our images by the real-node tests' fixture
//! ([`podmotion_e2e::real::helm_install`]), with the agents' checkpoint tmpfs
//! (`migrationAgent.checkpointSizeLimit`) and memory limit sized for the largest of
//! `--sizes` (MiB; `agent_memory_mib`: twice the pod for PreCopy, whose final dump
//! is written beside the warm copy without soft-dirty tracking, plus a quarter and
//! 256 MiB; the limit 1 GiB above; never below the chart's 2Gi / 3Gi — 5376Mi / 6400Mi
//! for 2048), and `migrationAgent.postCopy.enabled` for the PostCopy arm. Each PodMigration gets `deadlineSeconds` 900 and
//! `progressTimeoutSeconds` 600 (a 2 GiB one takes about half a minute here); the
//! testload pods have no memory limit. For each size two Deployments of the
//! `testload` fixture run on the real nodes (`serve 8080 <MiB> <dirty KiB/s>`, readiness
//! probe): `mig-<MiB>` is moved by a PodMigration to the other real node in every
//! migration round (then the adopted pod is deleted: an adopted pod cannot be migrated
//! again, so the next round moves the fresh pod its ReplicaSet makes); `raw-<MiB>` gives
//! a fresh pod of the same spec for every raw round. In every round, for each mode
//! (`Mode::ALL`: Cold, PreCopy, PostCopy), one PodMigration and one raw CRIU checkpoint/restore
//! run, alternating which goes first; nothing is timed before the pod's ballast is
//! written.
//!
//! * **PodMotion**: `status.downtimeMillis` as the operator reports it (the source agent's
//!   freeze start — before it locks the pod's network — to the target agent's CRIU
//!   restore returning), `status.progress.bytesSent`, and the agents' own log lines of
//!   that migration (final dump ms and bytes, restore ms). **Warm-round stalls**: the
//!   pre-copy rounds' freezes of `status.freezes` (the final dump's left out: it is in
//!   the downtime), their count and sum, each CRIU's own frozen time (marked
//!   `agent clock` where the agent's clock stood in); **total frozen** =
//!   `status.totalFrozenMillis`, the warm stalls plus the downtime.
//! * **Agent memory**, of the source's and the target's migration agent over each
//!   PodMigration (its creation to its final phase; the agents' pods are found in the
//!   release's agents namespace by node, their `podmotion-agent` process by pod UID in
//!   its cgroup, [`podmotion_e2e::real::agents::agent_pids`]). Two figures, not to be
//!   confused: **agent VmHWM**, the peak resident memory of the agent process itself
//!   (`/proc/<pid>/status`, reset before with `clear_refs` 5; DESIGN.md's "agent peak
//!   RSS"), and the **agent container memory-cgroup peak**: everything charged to the
//!   agent container — the agent, the CRIU it runs and the checkpoint images staged
//!   on its tmpfs — (cgroup v1 `memory.max_usage_in_bytes`, reset by writing 0; v2
//!   `memory.peak` through a file reset when the migration starts). A figure that
//!   cannot be read is printed `n/a`, with the reason once on stderr; the run goes on.
//! * **raw CRIU**, on the raw pod's node, through the same `criu swrk` RPC and the same
//!   dump options as the agent's final dump (its external netns and the container's
//!   runtime bind and cgroup mounts as external mounts, `tcp-established`,
//!   `leave-stopped`, cgroups ignored), CRIU run in that node's mount namespace; the
//!   images go to a directory on `/dev/shm` (tmpfs), are copied with `cp -r` to a second
//!   directory there (the same-host lower bound of a transfer), and are restored from
//!   it with the container's own root filesystem as root, each external mount bound to
//!   the same source mount, into a fresh network namespace (`tcp-close`, as the agents
//!   restore when the pod address cannot move). Downtime = dump + copy + restore. The
//!   restored copy must answer a counter at least as large as the one read before the
//!   dump; then it, the stopped source and the pod are killed, and the network namespace
//!   and the image directories removed.
//!
//! Printed: one row per round and mode (both sides, and both agents' VmHWM and cgroup
//! peak, source / target), then per size and mode the medians, the median ratio and
//! the largest VmHWM and cgroup peak over the rounds, plus PreCopy ÷ Cold and
//! PostCopy ÷ Cold of the downtime and of the total frozen time. A PostCopy round's downtime is the same measure (freeze to the
//! restored copy running); its memory then comes over `LazyPages`, shown as
//! `+ … lazy` beside the bytes sent, and its total time includes that phase.
#![forbid(unsafe_code)]

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    podmotion_e2e::bench_migration::run().await
}
