//! The session-capacity sizing model: guest RAM is pod RAM, so a Runner pod's
//! memory request (= limit) is the aggregate of every guest it may run plus what the
//! VMM, virtiofsd, passt and host page tables need per session, plus the Runner.
//! Sources and numbers: `docs/runner-pool.md`.

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use podmotion_api::runner_pool::RunnerPoolSpec;

/// Resources of one Runner pod. Requests equal limits (Guaranteed QoS), so the pod is
/// the last one node-pressure eviction picks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodSize {
    /// Memory request and limit, in MiB.
    pub memory_mib: i64,
    /// CPU request and limit, in millicores.
    pub milli_cpu: i64,
    /// Sessions the pod is sized for.
    pub sessions: i64,
}

impl PodSize {
    /// Memory as a Kubernetes quantity (`<n>Mi`).
    pub fn memory_quantity(&self) -> String {
        format!("{}Mi", self.memory_mib)
    }
    /// CPU as a Kubernetes quantity (`<n>m`).
    pub fn cpu_quantity(&self) -> String {
        format!("{}m", self.milli_cpu)
    }
}

/// Host page tables for one guest of `guest_mib`, rounded up to whole MiB.
pub fn page_tables_mib(guest_mib: i64, mib_per_gib: i64) -> i64 {
    // Inputs are non-negative (CRD bounds), so this is a ceiling division.
    (guest_mib * mib_per_gib + 1023) / 1024
}

/// Memory one session costs the pod: guest + VMM/virtiofsd/passt + page tables.
pub fn per_session_memory_mib(spec: &RunnerPoolSpec) -> i64 {
    let guest = spec.session.memory_mib;
    guest
        + spec.overhead.per_session_memory_mib
        + page_tables_mib(guest, spec.overhead.page_table_mib_per_guest_gib)
}

/// The pod size for `spec`'s session capacity. The CRD bounds every input, so the
/// products stay far inside `i64`.
pub fn pod_size(spec: &RunnerPoolSpec) -> PodSize {
    let sessions = i64::from(spec.sessions_per_node);
    PodSize {
        memory_mib: sessions * per_session_memory_mib(spec) + spec.overhead.runner_memory_mib,
        milli_cpu: sessions * (spec.session.milli_cpu + spec.overhead.per_session_milli_cpu)
            + spec.overhead.runner_milli_cpu,
        sessions,
    }
}

/// Seconds the kubelet waits between SIGTERM and SIGKILL: the reap budget of every
/// session the node can hold, plus a fixed margin for the Runner's own shutdown.
pub fn termination_grace_seconds(spec: &RunnerPoolSpec) -> i64 {
    i64::from(spec.reap_budget_seconds) * i64::from(spec.sessions_per_node)
        + TERMINATION_MARGIN_SECONDS
}

/// Margin on top of the session reap budgets.
pub const TERMINATION_MARGIN_SECONDS: i64 = 30;

/// The number of pods `maxUnavailable` allows down out of `desired` (a percentage
/// rounds up, as the DaemonSet controller does).
pub fn max_unavailable_count(v: &IntOrString, desired: i32) -> i32 {
    match v {
        IntOrString::Int(n) => *n,
        IntOrString::String(s) => {
            let pct: i64 = s.trim_end_matches('%').parse().unwrap_or(0);
            i32::try_from((pct * i64::from(desired) + 99) / 100).unwrap_or(i32::MAX)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner_pool::fixtures::pool;

    #[test]
    fn memory_is_sessions_times_guest_plus_overheads_plus_runner() {
        let p = pool("rp")
            .sessions(4)
            .guest(4096, 2000)
            .overhead(192, 100, 6, 128, 100)
            .build();
        // page tables: 4096 MiB × 6 MiB/GiB = 24 MiB per guest.
        let s = pod_size(&p.spec);
        assert_eq!(s.memory_mib, 4 * (4096 + 192 + 24) + 128);
        assert_eq!(s.milli_cpu, 4 * (2000 + 100) + 100);
        assert_eq!(s.memory_quantity(), "17376Mi");
        assert_eq!(s.cpu_quantity(), "8500m");
    }

    #[test]
    fn page_tables_grow_with_guest_ram_and_round_up() {
        // ~550 MiB at 96 GiB is the figure the default of 6 MiB/GiB covers.
        assert_eq!(page_tables_mib(96 * 1024, 6), 576);
        assert_eq!(page_tables_mib(100, 6), 1);
        assert_eq!(page_tables_mib(2048, 0), 0);
    }

    #[test]
    fn sizing_scales_with_capacity_not_with_the_runner_alone() {
        let one = pod_size(&pool("rp").sessions(1).build().spec);
        let eight = pod_size(&pool("rp").sessions(8).build().spec);
        let per = per_session_memory_mib(&pool("rp").build().spec);
        assert_eq!(eight.memory_mib - one.memory_mib, 7 * per);
        assert!(
            per > pool("rp").build().spec.session.memory_mib,
            "per-session cost must exceed the guest alone"
        );
    }

    #[test]
    fn grace_period_is_reap_budget_times_capacity_plus_margin() {
        let p = pool("rp").sessions(6).reap_budget(45).build();
        assert_eq!(termination_grace_seconds(&p.spec), 6 * 45 + 30);
    }
}
