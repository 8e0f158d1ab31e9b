//! Runner node preflight: checks, from inside a pod with the Runner's exact
//! confinement, that the node provides what the Runner needs and operator
//! provisioning must supply (runner-daemonset-design-record.txt, §Privilege shape):
//!
//! * `kvm` — the KVM device exists, is a character device, opens read-write as this
//!   uid (device plugin's cgroup allowance + node mode 0666) and answers
//!   `KVM_GET_API_VERSION`;
//! * `userns` — an unprivileged user namespace can be created and mounted in (what
//!   passt does; RuntimeDefault seccomp fails it with "Couldn't create user namespace");
//! * `apparmor` — `kernel.apparmor_restrict_unprivileged_userns` is 0 or absent, and the
//!   container is not confined by an AppArmor profile (`appArmorProfile: Unconfined`);
//! * `quota` — the session-volume filesystem is mounted with project quotas;
//!
//! and that the node honoured the pod's shape instead of silently running it with less
//! (each check is named after the field it proves):
//!
//! * `hostUsers` — the container runs in a user namespace of its own (`hostUsers: false`);
//! * `procMount` — a fresh /proc mounts in a new user + PID namespace (what
//!   `virtiofsd --sandbox=namespace` does; fails when /proc is masked);
//! * `seccompProfile` — a seccomp filter is in force (the Localhost profile);
//! * `capabilities` — no effective, permitted or bounding capability (`drop: [ALL]`) and
//!   no_new_privs (`allowPrivilegeEscalation: false`).
//!
//! The verdict is one JSON line (format `v1`, read by the operator's
//! `runner_pool::preflight`): `{"preflight":"v1","ok":…,"checks":[{"name","ok","detail"}]}`.
// Only `kvm` (one ioctl) may use unsafe code.
#![deny(unsafe_code)]

pub mod kvm;

use std::fs::OpenOptions;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::process::Command;

use serde::Serialize;

/// Version tag of the verdict line.
pub const VERDICT_VERSION: &str = "v1";
/// Hidden argument that makes the binary run the user-namespace probe in a fresh,
/// single-threaded child process (unshare(CLONE_NEWUSER) fails in threaded ones, and
/// the parent must keep its own namespaces for the other checks).
pub const USERNS_PROBE_ARG: &str = "--internal-userns-probe";
/// Hidden arguments of the /proc probe: the outer process makes the namespaces, the
/// inner one (the new PID namespace's PID 1) mounts /proc.
pub const PROC_PROBE_ARG: &str = "--internal-proc-probe";
pub const PROC_PROBE_INNER_ARG: &str = "--internal-proc-probe-inner";

/// One check's outcome.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    pub detail: String,
}

impl Check {
    fn pass(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            ok: true,
            detail: detail.into(),
        }
    }
    fn fail(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            ok: false,
            detail: detail.into(),
        }
    }
}

/// The verdict line.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Verdict {
    pub preflight: &'static str,
    pub ok: bool,
    pub checks: Vec<Check>,
}

impl Verdict {
    pub fn new(checks: Vec<Check>) -> Verdict {
        Verdict {
            preflight: VERDICT_VERSION,
            ok: checks.iter().all(|c| c.ok),
            checks,
        }
    }
    /// The JSON line, kept under the kubelet's 4096-byte termination message limit.
    pub fn to_line(&self) -> String {
        let mut v = self.clone();
        loop {
            let line = serde_json::to_string(&v).expect("a verdict serializes");
            if line.len() <= 4000 {
                return line;
            }
            let longest = v
                .checks
                .iter_mut()
                .max_by_key(|c| c.detail.len())
                .expect("non-empty");
            let keep = longest.detail.len() / 2;
            let mut cut = keep;
            while !longest.detail.is_char_boundary(cut) {
                cut -= 1;
            }
            longest.detail.truncate(cut);
            longest.detail.push('…');
        }
    }
}

/// What to check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub kvm_device: String,
    pub session_volume: String,
    pub require_project_quota: bool,
    pub apparmor_sysctl: String,
    pub mountinfo: String,
    /// `/proc/self/status` (seccomp mode, capabilities, no_new_privs).
    pub status: String,
    /// `/proc/self/uid_map`.
    pub uid_map: String,
    /// The AppArmor label of this process (absent without AppArmor).
    pub apparmor_current: String,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            kvm_device: "/dev/kvm".into(),
            session_volume: "/var/lib/compass/sessions".into(),
            require_project_quota: true,
            apparmor_sysctl: "/proc/sys/kernel/apparmor_restrict_unprivileged_userns".into(),
            mountinfo: "/proc/self/mountinfo".into(),
            status: "/proc/self/status".into(),
            uid_map: "/proc/self/uid_map".into(),
            apparmor_current: "/proc/self/attr/apparmor/current".into(),
        }
    }
}

/// `kvm`: present, a character device, and openable read-write by this uid.
pub fn check_kvm(device: &str) -> Check {
    let meta = match std::fs::metadata(device) {
        Ok(m) => m,
        Err(e) => {
            return Check::fail(
                "kvm",
                format!("{device}: {e}; does the node have KVM and the device plugin injected it?"),
            );
        }
    };
    if !meta.file_type().is_char_device() {
        return Check::fail("kvm", format!("{device} is not a character device"));
    }
    match OpenOptions::new().read(true).write(true).open(device) {
        Ok(f) => match kvm::api_version(&f) {
            Ok(v) if v == kvm::KVM_API_VERSION => Check::pass(
                "kvm",
                format!("{device} opens read-write, KVM_GET_API_VERSION {v}"),
            ),
            Ok(v) => Check::fail(
                "kvm",
                format!(
                    "{device}: KVM_GET_API_VERSION {v}, want {}",
                    kvm::KVM_API_VERSION
                ),
            ),
            Err(e) => Check::fail(
                "kvm",
                format!("{device} opens but KVM_GET_API_VERSION fails: {e}"),
            ),
        },
        Err(e) => {
            use std::os::unix::fs::PermissionsExt;
            let mode = meta.permissions().mode() & 0o777;
            Check::fail(
                "kvm",
                format!(
                    "open {device}: {e} (mode {mode:04o}; under hostUsers: false the node must set mode 0666)"
                ),
            )
        }
    }
}

/// `apparmor`: the Ubuntu sysctl that confines unprivileged user namespaces is off.
pub fn check_apparmor(sysctl: &str) -> Check {
    match std::fs::read_to_string(sysctl) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Check::pass(
            "apparmor",
            "kernel.apparmor_restrict_unprivileged_userns not present",
        ),
        Err(e) => Check::fail("apparmor", format!("read {sysctl}: {e}")),
        Ok(v) if v.trim() == "0" => {
            Check::pass("apparmor", "kernel.apparmor_restrict_unprivileged_userns=0")
        }
        Ok(v) => Check::fail(
            "apparmor",
            format!(
                "kernel.apparmor_restrict_unprivileged_userns={}; set it to 0 on the node",
                v.trim()
            ),
        ),
    }
}

/// `apparmor` (the process half): the container is not confined by a profile. `label`
/// is `/proc/self/attr/apparmor/current` (`None`: no AppArmor on this kernel).
pub fn check_apparmor_label(label: Option<&str>) -> Option<Check> {
    let label = label?.trim().trim_end_matches('\0');
    if label.is_empty() || label == "unconfined" {
        return None;
    }
    Some(Check::fail(
        "apparmor",
        format!(
            "the container is confined by AppArmor profile {label:?}: appArmorProfile: Unconfined was not honoured"
        ),
    ))
}

/// A field of `/proc/self/status` (`Seccomp`, `CapEff`, …).
pub fn status_field<'a>(status: &'a str, key: &str) -> Option<&'a str> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(str::trim)
}

/// `hostUsers`: this process runs in a user namespace of its own, i.e. its uid_map is
/// not the initial namespace's identity map `0 0 4294967295`.
pub fn check_host_users(uid_map: &str) -> Check {
    let lines: Vec<Vec<&str>> = uid_map
        .lines()
        .map(|l| l.split_whitespace().collect())
        .filter(|f: &Vec<&str>| f.len() == 3)
        .collect();
    let shown = lines
        .iter()
        .map(|f| f.join(" "))
        .collect::<Vec<_>>()
        .join(", ");
    match lines.as_slice() {
        [] => Check::fail("hostUsers", "no uid_map: cannot tell the user namespace"),
        [f] if f[0] == "0" && f[1] == "0" && f[2] == "4294967295" => Check::fail(
            "hostUsers",
            "the container runs in the host's user namespace (uid_map 0 0 4294967295): hostUsers: false was not honoured",
        ),
        _ => Check::pass("hostUsers", format!("own user namespace, uid_map {shown}")),
    }
}

/// `seccompProfile`: a seccomp filter is in force (`Seccomp: 2`).
pub fn check_seccomp(status: &str) -> Check {
    match status_field(status, "Seccomp") {
        Some("2") => {
            let filters = status_field(status, "Seccomp_filters").unwrap_or("?");
            Check::pass(
                "seccompProfile",
                format!("seccomp filter mode, {filters} filter(s)"),
            )
        }
        Some(m) => Check::fail(
            "seccompProfile",
            format!("seccomp mode {m}, no filter: the Localhost profile was not applied"),
        ),
        None => Check::fail("seccompProfile", "no Seccomp field in /proc/self/status"),
    }
}

/// `capabilities`: no effective, permitted, inheritable, ambient or bounding capability,
/// and no_new_privs set.
pub fn check_capabilities(status: &str) -> Check {
    let mut held = vec![];
    for key in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        match status_field(status, key) {
            Some(v) if u64::from_str_radix(v, 16) == Ok(0) => {}
            Some(v) => held.push(format!("{key}={v}")),
            None if key == "CapAmb" => {}
            None => held.push(format!("{key} missing")),
        }
    }
    let nnp = status_field(status, "NoNewPrivs");
    if nnp != Some("1") {
        held.push(format!("NoNewPrivs={}", nnp.unwrap_or("missing")));
    }
    if held.is_empty() {
        Check::pass("capabilities", "no capability in any set, no_new_privs")
    } else {
        Check::fail(
            "capabilities",
            format!(
                "{}: drop: [ALL] / allowPrivilegeEscalation: false were not honoured",
                held.join(", ")
            ),
        )
    }
}

/// One line of `/proc/self/mountinfo`, the parts we need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: String,
    pub fs_type: String,
    pub source: String,
    pub super_options: Vec<String>,
}

fn unescape(s: &str) -> String {
    // mountinfo escapes space, tab, newline and backslash as \ooo.
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let oct: String = chars.clone().take(3).collect();
            if oct.len() == 3
                && let Ok(b) = u8::from_str_radix(&oct, 8)
            {
                out.push(char::from(b));
                for _ in 0..3 {
                    chars.next();
                }
                continue;
            }
        }
        out.push(c);
    }
    out
}

/// Parses `/proc/self/mountinfo`, skipping lines it cannot read.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mount_point = unescape(left.split(' ').nth(4)?);
            let mut r = right.split(' ');
            let fs_type = r.next()?.to_string();
            let source = r.next()?.to_string();
            let super_options = r
                .next()
                .unwrap_or_default()
                .split(',')
                .map(str::to_string)
                .collect();
            Some(MountEntry {
                mount_point,
                fs_type,
                source,
                super_options,
            })
        })
        .collect()
}

/// The mount holding `path` (the longest mount point that is a prefix of it; the last
/// one mounted wins on ties, as in the kernel's view).
pub fn mount_of<'a>(mounts: &'a [MountEntry], path: &str) -> Option<&'a MountEntry> {
    let under = |mp: &str| mp == "/" || path == mp || path.starts_with(&format!("{mp}/"));
    mounts
        .iter()
        .filter(|m| under(&m.mount_point))
        .max_by_key(|m| m.mount_point.len())
}

/// Mount options that mean project quotas are enforced (ext4 `prjquota`, xfs
/// `prjquota`/`pquota`/`pqnoenforce` is not enforcement and does not count).
const PROJECT_QUOTA_OPTIONS: [&str; 3] = ["prjquota", "pquota", "prjjquota"];

/// `quota`: the session volume's filesystem enforces project quotas.
pub fn check_quota(mountinfo: &str, session_volume: &str, required: bool) -> Check {
    let mounts = parse_mountinfo(mountinfo);
    let path = Path::new(session_volume);
    if !path.is_dir() {
        return Check::fail(
            "quota",
            format!("session volume {session_volume} is not a directory"),
        );
    }
    let Some(m) = mount_of(&mounts, session_volume) else {
        return Check::fail("quota", format!("no mount holds {session_volume}"));
    };
    let has = m
        .super_options
        .iter()
        .any(|o| PROJECT_QUOTA_OPTIONS.contains(&o.as_str()));
    let what = format!(
        "{session_volume} is on {} ({}) with options {}",
        m.mount_point,
        m.fs_type,
        m.super_options.join(",")
    );
    match (has, required) {
        (true, _) => Check::pass("quota", what),
        (false, false) => Check::pass("quota", format!("{what}; project quotas not required")),
        (false, true) => Check::fail(
            "quota",
            format!("{what}: no project quota (mount it with prjquota)"),
        ),
    }
}

/// Runs in the probe child: a new user namespace with a mount namespace, our uid
/// mapped to root in it, and a mount inside it (passt's pattern).
pub fn userns_probe() -> Result<(), String> {
    use nix::mount::{MsFlags, mount};
    use nix::sched::{CloneFlags, unshare};
    let (uid, gid) = (nix::unistd::getuid(), nix::unistd::getgid());
    unshare(CloneFlags::CLONE_NEWUSER | CloneFlags::CLONE_NEWNS)
        .map_err(|e| format!("unshare(CLONE_NEWUSER|CLONE_NEWNS): {e}"))?;
    std::fs::write("/proc/self/setgroups", "deny").map_err(|e| format!("write setgroups: {e}"))?;
    std::fs::write("/proc/self/uid_map", format!("0 {uid} 1"))
        .map_err(|e| format!("write uid_map: {e}"))?;
    std::fs::write("/proc/self/gid_map", format!("0 {gid} 1"))
        .map_err(|e| format!("write gid_map: {e}"))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| format!("mount in the new user namespace: {e}"))?;
    Ok(())
}

/// Runs in the outer probe child: a new user, mount and PID namespace (our uid mapped to
/// root), then `exe` with [`PROC_PROBE_INNER_ARG`] as the PID namespace's PID 1.
pub fn proc_probe_outer(exe: &Path) -> Result<(), String> {
    use nix::mount::{MsFlags, mount};
    use nix::sched::{CloneFlags, unshare};
    let (uid, gid) = (nix::unistd::getuid(), nix::unistd::getgid());
    unshare(CloneFlags::CLONE_NEWUSER | CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWPID)
        .map_err(|e| format!("unshare(CLONE_NEWUSER|CLONE_NEWNS|CLONE_NEWPID): {e}"))?;
    std::fs::write("/proc/self/setgroups", "deny").map_err(|e| format!("write setgroups: {e}"))?;
    std::fs::write("/proc/self/uid_map", format!("0 {uid} 1"))
        .map_err(|e| format!("write uid_map: {e}"))?;
    std::fs::write("/proc/self/gid_map", format!("0 {gid} 1"))
        .map_err(|e| format!("write gid_map: {e}"))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| format!("make / private: {e}"))?;
    let out = Command::new(exe)
        .arg(PROC_PROBE_INNER_ARG)
        .output()
        .map_err(|e| format!("starting PID 1 of the new PID namespace: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// Runs as PID 1 of the probe's PID namespace: mounts a fresh proc over /proc and checks
/// it shows this namespace (`/proc/self` is 1).
pub fn proc_probe_inner() -> Result<(), String> {
    use nix::mount::{MsFlags, mount};
    mount(
        Some("proc"),
        "/proc",
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(|e| format!("mount -t proc proc /proc in a new user+PID namespace: {e}"))?;
    let me = std::fs::read_link("/proc/self").map_err(|e| format!("readlink /proc/self: {e}"))?;
    if me.as_os_str() == "1" {
        Ok(())
    } else {
        Err(format!(
            "the fresh /proc shows pid {} for PID 1 of its namespace",
            me.display()
        ))
    }
}

/// `procMount`: runs [`proc_probe_outer`] in a child process of `exe`.
pub fn check_proc_mount(exe: &Path) -> Check {
    match Command::new(exe).arg(PROC_PROBE_ARG).output() {
        Err(e) => Check::fail(
            "procMount",
            format!("starting the probe {}: {e}", exe.display()),
        ),
        Ok(out) if out.status.success() => Check::pass(
            "procMount",
            "mounted a fresh /proc in a new user and PID namespace",
        ),
        Ok(out) => Check::fail(
            "procMount",
            format!(
                "{} (a masked /proc blocks it: is procMount: Unmasked honoured, with hostUsers: false?)",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ),
    }
}

/// `userns`: runs [`userns_probe`] in a child process of `exe`.
pub fn check_userns(exe: &Path) -> Check {
    match Command::new(exe).arg(USERNS_PROBE_ARG).output() {
        Err(e) => Check::fail(
            "userns",
            format!("starting the probe {}: {e}", exe.display()),
        ),
        Ok(out) if out.status.success() => {
            Check::pass("userns", "created a user namespace and mounted in it")
        }
        Ok(out) => Check::fail(
            "userns",
            format!(
                "{} (is the Localhost seccomp profile staged and allowing it, and are user namespaces enabled?)",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ),
    }
}

/// Every check, in a fixed order.
pub fn run_all(s: &Settings, exe: &Path) -> Verdict {
    let mountinfo = std::fs::read_to_string(&s.mountinfo).unwrap_or_default();
    let status = std::fs::read_to_string(&s.status).unwrap_or_default();
    let uid_map = std::fs::read_to_string(&s.uid_map).unwrap_or_default();
    let label = std::fs::read_to_string(&s.apparmor_current).ok();
    let apparmor = match check_apparmor_label(label.as_deref()) {
        Some(confined) => confined,
        None => check_apparmor(&s.apparmor_sysctl),
    };
    Verdict::new(vec![
        check_kvm(&s.kvm_device),
        check_userns(exe),
        apparmor,
        check_quota(&mountinfo, &s.session_volume, s.require_project_quota),
        check_host_users(&uid_map),
        check_proc_mount(exe),
        check_seccomp(&status),
        check_capabilities(&status),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro
30 22 259:3 / /var/lib/compass rw,relatime shared:9 - xfs /dev/nvme1n1 rw,attr2,inode64,prjquota
31 22 259:3 /sessions /var/lib/compass/sessions rw,relatime shared:9 - xfs /dev/nvme1n1 rw,attr2,inode64,prjquota
40 22 0:50 / /run rw,nosuid shared:5 - tmpfs tmpfs rw,size=100k
41 22 0:51 / /mnt/with\\040space rw - ext4 /dev/sdb rw
";

    #[test]
    fn mountinfo_finds_the_longest_mount_point_holding_a_path() {
        let m = parse_mountinfo(MOUNTINFO);
        assert_eq!(m.len(), 5);
        assert_eq!(
            mount_of(&m, "/var/lib/compass/sessions/a")
                .unwrap()
                .mount_point,
            "/var/lib/compass/sessions"
        );
        assert_eq!(
            mount_of(&m, "/var/lib/compassion").unwrap().mount_point,
            "/"
        );
        assert_eq!(m[4].mount_point, "/mnt/with space");
    }

    #[test]
    fn project_quota_is_seen_in_super_options_only_where_mounted_with_it() {
        let m = parse_mountinfo(MOUNTINFO);
        let s = mount_of(&m, "/var/lib/compass/sessions").unwrap();
        assert!(s.super_options.iter().any(|o| o == "prjquota"));
        let r = mount_of(&m, "/run/x").unwrap();
        assert!(
            !r.super_options
                .iter()
                .any(|o| PROJECT_QUOTA_OPTIONS.contains(&o.as_str()))
        );
    }

    #[test]
    fn quota_check_fails_without_prjquota_when_required_and_passes_when_not() {
        let info = "22 1 259:2 / / rw - ext4 /dev/root rw,relatime\n";
        let dir = std::env::temp_dir();
        let dir = dir.to_str().unwrap();
        assert!(!check_quota(info, dir, true).ok);
        assert!(check_quota(info, dir, false).ok);
        let with = "22 1 259:2 / / rw - ext4 /dev/root rw,relatime,prjquota\n";
        assert!(check_quota(with, dir, true).ok);
        assert!(!check_quota(with, "/definitely/not/here", true).ok);
    }

    #[test]
    fn apparmor_sysctl_one_fails_zero_and_absent_pass() {
        let dir = std::env::temp_dir().join(format!("pf-aa-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("restrict");
        std::fs::write(&f, "1\n").unwrap();
        assert!(!check_apparmor(f.to_str().unwrap()).ok);
        std::fs::write(&f, "0\n").unwrap();
        assert!(check_apparmor(f.to_str().unwrap()).ok);
        assert!(check_apparmor(dir.join("absent").to_str().unwrap()).ok);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    const STATUS_CONFINED: &str = "Name:\tx\nNoNewPrivs:\t1\nSeccomp:\t2\nSeccomp_filters:\t1\nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\nCapBnd:\t0000000000000000\nCapAmb:\t0000000000000000\n";

    #[test]
    fn a_confined_container_passes_seccomp_and_capabilities() {
        assert!(check_seccomp(STATUS_CONFINED).ok);
        assert!(check_capabilities(STATUS_CONFINED).ok);
    }

    #[test]
    fn no_filter_or_a_held_capability_names_the_field_not_honoured() {
        let unfiltered = STATUS_CONFINED.replace("Seccomp:\t2", "Seccomp:\t0");
        let c = check_seccomp(&unfiltered);
        assert!(!c.ok && c.detail.contains("Localhost"), "{c:?}");
        let bnd = STATUS_CONFINED.replace("CapBnd:\t0000000000000000", "CapBnd:\t000001ffffffffff");
        let c = check_capabilities(&bnd);
        assert!(
            !c.ok && c.detail.contains("CapBnd=000001ffffffffff"),
            "{c:?}"
        );
        let nnp = STATUS_CONFINED.replace("NoNewPrivs:\t1", "NoNewPrivs:\t0");
        assert!(!check_capabilities(&nnp).ok);
    }

    #[test]
    fn the_host_user_namespace_fails_host_users_and_a_pod_range_passes() {
        let host = check_host_users("         0          0 4294967295\n");
        assert!(
            !host.ok && host.detail.contains("hostUsers: false"),
            "{host:?}"
        );
        let pod = check_host_users("         0    1638400      65536\n");
        assert!(pod.ok && pod.detail.contains("0 1638400 65536"), "{pod:?}");
        assert!(!check_host_users("").ok);
    }

    #[test]
    fn an_apparmor_profile_fails_and_unconfined_or_absent_is_no_finding() {
        assert_eq!(check_apparmor_label(None), None);
        assert_eq!(check_apparmor_label(Some("unconfined\n")), None);
        let c = check_apparmor_label(Some("cri-containerd.apparmor.d (enforce)\n")).unwrap();
        assert!(!c.ok && c.detail.contains("Unconfined"), "{c:?}");
    }

    #[test]
    fn a_regular_file_is_not_a_kvm_device() {
        let f = std::env::temp_dir().join(format!("pf-kvm-{}", std::process::id()));
        std::fs::write(&f, "").unwrap();
        let c = check_kvm(f.to_str().unwrap());
        assert!(
            !c.ok && c.detail.contains("not a character device"),
            "{c:?}"
        );
        std::fs::remove_file(&f).unwrap();
        assert!(!check_kvm("/nonexistent/kvm").ok);
    }

    #[test]
    fn the_verdict_format_matches_the_golden_line_the_operator_parses() {
        // operator/core/src/runner_pool/preflight.rs parses the same file: a change of the
        // format must change both sides.
        let v = Verdict::new(vec![
            Check::fail(
                "kvm",
                "open /dev/kvm: Permission denied (os error 13) (mode 0600; under hostUsers: false the node must set mode 0666)",
            ),
            Check::pass("userns", "created a user namespace and mounted in it"),
            Check::pass(
                "apparmor",
                "kernel.apparmor_restrict_unprivileged_userns not present",
            ),
            Check::fail(
                "quota",
                "/var/lib/compass/sessions is on / (ext4) with options rw,relatime: no project quota (mount it with prjquota)",
            ),
        ]);
        assert_eq!(
            v.to_line(),
            include_str!("../testdata/verdict-v1.json").trim_end()
        );
    }

    #[test]
    fn verdict_line_is_one_json_line_under_the_termination_message_limit() {
        let v = Verdict::new(vec![
            Check::pass("kvm", "ok"),
            Check::fail("quota", "x".repeat(10_000)),
        ]);
        let line = v.to_line();
        assert!(!line.contains('\n'));
        assert!(line.len() <= 4000, "{}", line.len());
        let back: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(back["preflight"], "v1");
        assert_eq!(back["ok"], false);
        assert_eq!(back["checks"][1]["name"], "quota");
    }
}
