//! Every label, annotation, finalizer, field manager, condition type and reason
//! PodMotion writes. Components refer to these constants; a string literal with
//! one of these values anywhere else is a bug.

/// Recommended labels carried by every object PodMotion owns.
pub mod labels {
    /// `app.kubernetes.io/managed-by`, always [`MANAGED_BY_VALUE`].
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    pub const MANAGED_BY_VALUE: &str = "podmotion";
    /// `app.kubernetes.io/name` of a child: what it is (`runner`, `node-agent`, …).
    pub const NAME: &str = "app.kubernetes.io/name";
    /// `app.kubernetes.io/instance`: the owning resource's name.
    pub const INSTANCE: &str = "app.kubernetes.io/instance";
    /// `app.kubernetes.io/component`.
    pub const COMPONENT: &str = "app.kubernetes.io/component";
    /// Kind of the PodMotion resource that owns a child (`PodMigration`, …).
    pub const OWNER_KIND: &str = "podmotion.io/owner-kind";
    /// `<namespace>.<name>` of the owning resource (a label value cannot hold `/`).
    pub const OWNER: &str = "podmotion.io/owner";
    /// UID of the owning resource, so a recreated owner of the same name never adopts
    /// an older generation's children.
    pub const OWNER_UID: &str = "podmotion.io/owner-uid";
    /// On attachment Jobs: `<namespace>.<pod>` of the target pod.
    pub const TARGET_POD: &str = "podmotion.io/target-pod";
    /// On attachment Jobs: UID of the target pod.
    pub const TARGET_POD_UID: &str = "podmotion.io/target-pod-uid";
    /// On attachment Jobs: namespace of the target pod.
    pub const TARGET_NAMESPACE: &str = "podmotion.io/target-namespace";
    /// On attachment Jobs: `<kind>.<name>` of the target's workload (shortened with a
    /// hash when longer than a label value may be).
    pub const WORKLOAD: &str = "podmotion.io/workload";
    /// On PodMigration target pods and agents: the migration they belong to.
    pub const MIGRATION: &str = "podmotion.io/migration";
    /// Default node label selecting Runner nodes (the chart and samples use it).
    pub const RUNNER_NODE: &str = "podmotion.io/runner-node";
    /// On a PodMigration the eviction webhook created: the UID of the pod it moves
    /// (`app.kubernetes.io/component` is then [`EVICTION_COMPONENT`]).
    pub const EVICTED_POD_UID: &str = "podmotion.io/evicted-pod-uid";
    /// `app.kubernetes.io/component` of PodMigrations started by an eviction.
    pub const EVICTION_COMPONENT: &str = "eviction";
}

/// Annotations PodMotion reads or writes.
pub mod annotations {
    /// Set on a pod while a PodMigration owns it (source or target): one migration per pod.
    pub const MIGRATION: &str = "podmotion.io/migration";
    /// Lowers the deletion cost of the source pod at commit so its ReplicaSet removes it,
    /// never the restored copy.
    pub const POD_DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";
    /// On a migration's target pod: the source pod's labels (JSON object), put on the
    /// target pod at commit so the workload's controller adopts it.
    pub const SOURCE_LABELS: &str = "podmotion.io/source-labels";
    /// On a migration's target pod: `<kind>/<name>/<uid>` of the source pod's controller,
    /// which is expected to adopt the target pod at commit.
    pub const EXPECTED_OWNER: &str = "podmotion.io/expected-owner";
    /// On a migration's target pod: `<name>/<uid>` of the source pod.
    pub const SOURCE_POD: &str = "podmotion.io/source-pod";
    /// The Prometheus scrape annotations put on Runner pods.
    pub const PROMETHEUS_SCRAPE: &str = "prometheus.io/scrape";
    pub const PROMETHEUS_PORT: &str = "prometheus.io/port";
    pub const PROMETHEUS_PATH: &str = "prometheus.io/path";
    /// Hash of the rendered child spec, to detect drift without a deep diff.
    pub const SPEC_HASH: &str = "podmotion.io/spec-hash";
    /// On attachment Jobs: name of the target pod.
    pub const TARGET_POD: &str = "podmotion.io/target-pod";
    /// On attachment Jobs: `Kind/name` of the target's workload.
    pub const WORKLOAD: &str = "podmotion.io/workload";
    /// On attachment Jobs: the port numbers the agent redirects (JSON list).
    pub const AGENT_PORTS: &str = "podmotion.io/agent-ports";
    /// On attachment Jobs: the target's container IDs the Job was made for (JSON map).
    pub const CONTAINER_IDS: &str = "podmotion.io/container-ids";
    /// Put by the kubelet on the mirror of a static pod (PodMigration refuses those).
    pub const CONFIG_MIRROR: &str = "kubernetes.io/config.mirror";
    /// Default annotation that marks a pod as carrying an injected traffic-agent sidecar.
    pub const INJECTED_AGENT: &str = "telepresence.io/agent-injected";
    /// On a pod (set on its template): what an eviction of it does —
    /// [`super::eviction_strategies`]. Unset: the installer's namespace default, else a
    /// plain eviction.
    pub const EVICTION_STRATEGY: &str = "podmotion.io/eviction-strategy";
    /// On a PodMigration, NodeAgentAttachment or RunnerPool: the release that reconciles
    /// it, `<release namespace>/<leader lease name>` (`podmotion_core::claim`). Put by
    /// the first release that sees the object; every other release leaves the object
    /// alone. Removed or overwritten by hand to hand the object over.
    pub const CONTROLLER: &str = "podmotion.io/controller";
}

/// Values of [`annotations::EVICTION_STRATEGY`].
pub mod eviction_strategies {
    /// The eviction waits for a live migration; a pod that cannot move blocks it.
    pub const LIVE_MIGRATE: &str = "LiveMigrate";
    /// Live-migrate when the pod can move, evict it as usual when it cannot.
    pub const LIVE_MIGRATE_IF_POSSIBLE: &str = "LiveMigrateIfPossible";
    /// A plain eviction (opts a pod out of its namespace's default).
    pub const EVICT: &str = "Evict";
    /// Every accepted value, in the order error messages list them.
    pub const ALL: [&str; 3] = [LIVE_MIGRATE, LIVE_MIGRATE_IF_POSSIBLE, EVICT];
}

/// Finalizers, domain-qualified with a path (Kubernetes 1.29+ warns otherwise).
pub mod finalizers {
    pub const MIGRATION_CLEANUP: &str = "podmotion.io/migration-cleanup";
    pub const ATTACHMENT_CLEANUP: &str = "podmotion.io/attachment-cleanup";
    pub const RUNNER_POOL_CLEANUP: &str = "podmotion.io/runner-pool-cleanup";
}

/// Server-side apply field managers, one per controller.
pub mod managers {
    pub const MIGRATION: &str = "podmotion.io/migration-controller";
    pub const ATTACHMENT: &str = "podmotion.io/attachment-controller";
    pub const RUNNER_POOL: &str = "podmotion.io/runner-pool-controller";
    /// The eviction webhook (it creates PodMigrations; it never applies).
    pub const EVICTION: &str = "podmotion.io/eviction-webhook";
}

/// Condition types. `Ready`, `Reconciling` and `Stalled` are kstatus's; the rest are
/// kind-specific.
pub mod condition_types {
    pub const READY: &str = "Ready";
    pub const RECONCILING: &str = "Reconciling";
    pub const STALLED: &str = "Stalled";
    /// PodMigration: the pre-flight checks passed (or why not).
    pub const MIGRATABLE: &str = "Migratable";
    /// RunnerPool.
    pub const AVAILABLE: &str = "Available";
    pub const PROGRESSING: &str = "Progressing";
    pub const DEGRADED: &str = "Degraded";
    pub const SHAPE_CONFORMANT: &str = "ShapeConformant";
    pub const POD_SECURITY_ADMITTED: &str = "PodSecurityAdmitted";
}

/// Condition reasons. Each is CamelCase and doubles as the reason of the Event
/// recorded when the condition changes.
pub mod reasons {
    // Shared.
    pub const RECONCILED: &str = "Reconciled";
    pub const PROGRESSING: &str = "Progressing";
    pub const INVALID_SPEC: &str = "InvalidSpec";
    pub const API_ERROR: &str = "ApiError";
    pub const DELETING: &str = "Deleting";
    /// Event on an object another PodMotion release has claimed
    /// (`annotations::CONTROLLER`): this release leaves it alone.
    pub const CLAIMED_ELSEWHERE: &str = "ClaimedElsewhere";

    // Agent certificates (CertificateSigningRequests of `podmotion.io/agent-serving`):
    // Event reasons on the request.
    /// The agent pod of the node it names got its certificate.
    pub const AGENT_CERTIFICATE_ISSUED: &str = "AgentCertificateIssued";
    /// The request was Denied (or Failed, when someone else approved it); the message
    /// says why.
    pub const AGENT_CERTIFICATE_REFUSED: &str = "AgentCertificateRefused";

    // PodMigration.
    pub const PENDING: &str = "Pending";
    pub const SOURCE_POD_NOT_FOUND: &str = "SourcePodNotFound";
    pub const SOURCE_POD_NOT_RUNNING: &str = "SourcePodNotRunning";
    pub const POD_UID_MISMATCH: &str = "PodUIDMismatch";
    pub const ALREADY_MIGRATING: &str = "AlreadyMigrating";
    pub const NO_AGENT_ON_NODE: &str = "NoAgentOnNode";
    pub const NO_TARGET_NODE: &str = "NoTargetNode";
    pub const TARGET_IS_SOURCE: &str = "TargetIsSource";
    pub const TARGET_DOES_NOT_FIT: &str = "TargetDoesNotFit";
    pub const MIGRATABLE: &str = "Migratable";
    pub const CHECKPOINTING: &str = "Checkpointing";
    pub const TRANSFERRING: &str = "Transferring";
    pub const RESTORING: &str = "Restoring";
    pub const COMMITTING: &str = "Committing";
    pub const SUCCEEDED: &str = "Succeeded";
    pub const DRY_RUN_PASSED: &str = "DryRunPassed";
    pub const FREEZE_BUDGET_EXCEEDED: &str = "FreezeBudgetExceeded";
    pub const PROBE_FAILED: &str = "ProbeFailed";
    pub const AGENT_ERROR: &str = "AgentError";
    pub const PROGRESS_TIMEOUT: &str = "ProgressTimeout";
    pub const DEADLINE_EXCEEDED: &str = "DeadlineExceeded";
    pub const ABORTED: &str = "Aborted";
    pub const SOURCE_POD_GONE: &str = "SourcePodGone";
    pub const TARGET_POD_UNSCHEDULABLE: &str = "TargetPodUnschedulable";
    pub const ROLLED_BACK: &str = "RolledBack";
    /// PostCopy: the restored copy lost its page source before every page was in.
    pub const POST_COPY_FAILED: &str = "PostCopyFailed";
    /// Waiting for a free slot (concurrency limit per cluster or per source node).
    pub const QUEUED: &str = "Queued";
    /// The pod's controller cannot adopt a pod of another name (StatefulSet, DaemonSet, Job…).
    pub const UNSUPPORTED_OWNER: &str = "UnsupportedOwner";
    /// The pod is in `kube-system` or in the operator's own namespace.
    pub const PROTECTED_NAMESPACE: &str = "ProtectedNamespace";
    /// A static pod (its mirror on the API server): the kubelet owns it.
    pub const STATIC_POD: &str = "StaticPod";
    /// The pod shares the node's network, PID or IPC namespace.
    pub const HOST_NAMESPACES: &str = "HostNamespaces";
    /// A pod of several containers (native sidecars count) that cannot move as one:
    /// PostCopy, more than 16 containers, or a container that is not running.
    pub const MULTIPLE_CONTAINERS: &str = "MultipleContainers";
    /// A container requests a device or other extended resource (`nvidia.com/gpu`…).
    pub const EXTENDED_RESOURCES: &str = "ExtendedResources";
    /// A container runs as a non-root user and the migration's mode cannot dump it on
    /// the agents' capabilities (PostCopy: its lazy dump runs CRIU as root, which needs
    /// CAP_SYS_RESOURCE and CAP_SYS_PTRACE for another user's process).
    pub const NON_ROOT_WORKLOAD: &str = "NonRootWorkload";
    /// Data on the source node (emptyDir, hostPath, ephemeral volumes) or a claim
    /// that cannot be mounted on another node.
    pub const LOCAL_DATA: &str = "LocalData";

    // Evictions (the `pods/eviction` webhook): Event reasons on the evicted pod.
    /// The eviction was answered 429 while the pod live-migrates.
    pub const EVICTION_MIGRATING: &str = "EvictionMigrating";
    /// A `LiveMigrate` pod cannot move: its eviction is refused with the reason.
    pub const EVICTION_BLOCKED: &str = "EvictionBlocked";
    /// A `LiveMigrateIfPossible` pod cannot move: it is evicted as usual.
    pub const EVICTED_WITHOUT_MIGRATION: &str = "EvictedWithoutMigration";
    /// The pod's `podmotion.io/eviction-strategy` annotation has an unknown value.
    pub const INVALID_EVICTION_STRATEGY: &str = "InvalidEvictionStrategy";
    /// The PodMigration the eviction started failed or was aborted.
    pub const EVICTION_MIGRATION_FAILED: &str = "EvictionMigrationFailed";

    // NodeAgentAttachment.
    pub const NO_ADMISSIBLE_TARGET: &str = "NoAdmissibleTarget";
    pub const WORKLOAD_NOT_FOUND: &str = "WorkloadNotFound";
    pub const SIDECAR_CONFLICT: &str = "SidecarConflict";
    pub const JOBS_PENDING: &str = "JobsPending";
    pub const ALL_TARGETS_ATTACHED: &str = "AllTargetsAttached";
    pub const JOB_CREATED: &str = "JobCreated";
    pub const JOB_REPLACED: &str = "JobReplaced";
    pub const JOB_REAPED: &str = "JobReaped";
    pub const PORT_CONFLICT: &str = "PortConflict";
    pub const AGENT_CONFLICT: &str = "AgentConflict";
    pub const LEASE_EXPIRED: &str = "LeaseExpired";
    pub const WAITING_FOR_READY_PODS: &str = "WaitingForReadyPods";

    // RunnerPool.
    pub const ROLLING_OUT: &str = "RollingOut";
    pub const PREFLIGHT_FAILED: &str = "PreflightFailed";
    pub const SHAPE_DRIFT: &str = "ShapeDrift";
    pub const SHAPE_MATCHES: &str = "ShapeMatches";
    pub const POD_SECURITY_REJECTS: &str = "PodSecurityRejects";
    pub const POD_SECURITY_ALLOWS: &str = "PodSecurityAllows";
    pub const NO_ELIGIBLE_NODES: &str = "NoEligibleNodes";
    pub const MINIMUM_NODES_AVAILABLE: &str = "MinimumNodesAvailable";
    /// The Server's Service is missing or selects no pods: no egress rule to it.
    pub const SERVER_UNRESOLVED: &str = "ServerUnresolved";
    /// Another NetworkPolicy also selects the Runner pods (allows are additive).
    pub const FOREIGN_NETWORK_POLICY: &str = "ForeignNetworkPolicy";
    /// The PriorityClass to create exists and belongs to someone else.
    pub const PRIORITY_CLASS_CONFLICT: &str = "PriorityClassConflict";
    /// The pool's PriorityClass is above the installer's ceiling, reserved (`system-*`)
    /// or missing: the pool gets no DaemonSet.
    pub const PRIORITY_CLASS_REFUSED: &str = "PriorityClassRefused";
    /// A Runner pod cannot be scheduled on its node (it does not fit, usually).
    pub const RUNNER_UNSCHEDULABLE: &str = "RunnerUnschedulable";
    /// The pool's node label names `kubernetes.io/os` or `kubernetes.io/arch` with
    /// another value than the platform PodMotion's preflight image is built for.
    pub const PLATFORM_CONFLICT: &str = "PlatformConflict";
}

/// The holder of a migration target pod, named by both the operator (which renders the
/// target pod) and the node agent (which installs the holder and restores into it).
pub mod holder {
    /// Where a migration target pod's containers mount the holder's directory (an
    /// `emptyDir`): the holder binary and, after restore, its restart file.
    pub const HOLDER_DIR: &str = "/.podmotion";
    /// The holder binary in [`HOLDER_DIR`].
    pub const HOLDER_BIN: &str = "/.podmotion/hold";
}

/// The identities of the migration wire's parties (URI SANs in PodMotion's trust
/// domain, and informative CNs), named by both the operator's PKI (which issues the
/// certificates) and the wire (which reads them: `podmotion_wire::identity`).
pub mod identity {
    /// PodMotion's SPIFFE trust domain, as the prefix of every identity URI.
    pub const TRUST_DOMAIN: &str = "spiffe://podmotion.io/";
    /// The operator's identity.
    pub const OPERATOR_URI: &str = "spiffe://podmotion.io/operator";
    /// The operator certificate's CN (informative).
    pub const OPERATOR_CN: &str = "podmotion-operator";
    /// CN of the legacy certificate shared by every agent (no URI SAN).
    pub const LEGACY_AGENT_CN: &str = "podmotion-agent";

    /// The identity URI of the agent on `node`.
    pub fn agent_uri(node: &str) -> String {
        format!("{TRUST_DOMAIN}agent/{node}")
    }

    /// The CN of the agent certificate of `node` (informative).
    pub fn agent_cn(node: &str) -> String {
        format!("podmotion-agent:{node}")
    }

    /// Whether `s` is a Kubernetes node name (a DNS-1123 subdomain).
    pub fn valid_node_name(s: &str) -> bool {
        !s.is_empty()
            && s.len() <= 253
            && s.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            })
    }
}
