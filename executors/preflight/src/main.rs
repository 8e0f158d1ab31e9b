//! `podmotion-preflight`: the Runner DaemonSet's init container. Checks the node (see
//! the library docs), prints the one-line verdict to stdout and to the termination
//! message file, and exits 1 when any check fails (so the Runner never starts on a
//! node that cannot run it) or 2 on a usage error.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use podmotion_preflight::{
    PROC_PROBE_ARG, PROC_PROBE_INNER_ARG, Settings, USERNS_PROBE_ARG, proc_probe_inner,
    proc_probe_outer, run_all, userns_probe,
};

const USAGE: &str = "usage: podmotion-preflight [--kvm-device=PATH] [--session-volume=PATH] \
[--require-project-quota=true|false] [--apparmor-sysctl=PATH] [--mountinfo=PATH] [--termination-log=PATH] \
[--log-format=json|text]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
    let probe = match args.first().map(String::as_str) {
        Some(USERNS_PROBE_ARG) => Some(userns_probe()),
        Some(PROC_PROBE_ARG) => Some(proc_probe_outer(&exe)),
        Some(PROC_PROBE_INNER_ARG) => Some(proc_probe_inner()),
        _ => None,
    };
    if let Some(result) = probe {
        return match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("{e}");
                ExitCode::FAILURE
            }
        };
    }
    let mut s = Settings::default();
    let mut termination_log = PathBuf::from("/dev/termination-log");
    // PODMOTION_LOG_FORMAT, then --log-format: the same pair as every other binary.
    let mut log_format = match podmotion_log::LogFormat::from_env() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    for a in &args {
        let Some((k, v)) = a.split_once('=') else {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        };
        match k {
            "--kvm-device" => s.kvm_device = v.into(),
            "--session-volume" => s.session_volume = v.into(),
            "--require-project-quota" => match v.parse() {
                Ok(b) => s.require_project_quota = b,
                Err(_) => {
                    eprintln!("--require-project-quota takes true or false\n{USAGE}");
                    return ExitCode::from(2);
                }
            },
            "--apparmor-sysctl" => s.apparmor_sysctl = v.into(),
            "--mountinfo" => s.mountinfo = v.into(),
            "--termination-log" => termination_log = v.into(),
            "--log-format" => match v.parse() {
                Ok(f) => log_format = f,
                Err(e) => {
                    eprintln!("{e}\n{USAGE}");
                    return ExitCode::from(2);
                }
            },
            _ => {
                eprintln!("unknown flag {k}\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    podmotion_log::init(log_format, "info");
    let verdict = run_all(&s, &exe);
    let line = verdict.to_line();
    // The verdict (itself one JSON object) is the product: stdout and the termination
    // message. The log line on stderr says the same in the shared log format.
    println!("{line}");
    if verdict.ok {
        tracing::info!("preflight passed");
    } else {
        tracing::error!(verdict = %line, "preflight failed");
    }
    // Best effort: outside a pod there may be no termination log.
    if let Err(e) = std::fs::write(&termination_log, format!("{line}\n")) {
        tracing::warn!(path = %termination_log.display(), error = %e, "could not write the termination log");
    }
    if verdict.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
