//! Runner node preflight: checks, from inside a pod with the Runner's exact
//! confinement, that the node provides what the Runner needs and operator
//! provisioning must supply (runner-daemonset-design-record.txt, §Privilege shape):
//!
//! * `kvm` — the KVM device exists, is a character device, and opens read-write as
//!   this uid (device plugin's cgroup allowance + node mode 0666);
//! * `userns` — an unprivileged user namespace can be created and mounted in (what
//!   passt does; RuntimeDefault seccomp fails it with "Couldn't create user namespace");
//! * `apparmor` — `kernel.apparmor_restrict_unprivileged_userns` is 0 or absent;
//! * `quota` — the session-volume filesystem is mounted with project quotas.
//!
//! The verdict is one JSON line (format `v1`, read by the operator's
//! `runner_pool::preflight`): `{"preflight":"v1","ok":…,"checks":[{"name","ok","detail"}]}`.
#![forbid(unsafe_code)]

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
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            kvm_device: "/dev/kvm".into(),
            session_volume: "/var/lib/compass/sessions".into(),
            require_project_quota: true,
            apparmor_sysctl: "/proc/sys/kernel/apparmor_restrict_unprivileged_userns".into(),
            mountinfo: "/proc/self/mountinfo".into(),
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
        Ok(_) => Check::pass("kvm", format!("{device} opens read-write")),
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
    Verdict::new(vec![
        check_kvm(&s.kvm_device),
        check_userns(exe),
        check_apparmor(&s.apparmor_sysctl),
        check_quota(&mountinfo, &s.session_volume, s.require_project_quota),
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
        // operator/src/runner_pool/preflight.rs parses the same file: a change of the
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
