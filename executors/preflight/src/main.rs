//! `podmotion-preflight`: the Runner DaemonSet's init container. Checks the node (see
//! the library docs), prints the one-line verdict to stdout and to the termination
//! message file, and exits 1 when any check fails (so the Runner never starts on a
//! node that cannot run it) or 2 on a usage error.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
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
    if let Some(code) = run_probe(&args, &exe) {
        return code;
    }
    let flags = match parse_flags(&args) {
        Ok(flags) => flags,
        Err(usage_error) => {
            eprintln!("{usage_error}");
            return ExitCode::from(2);
        }
    };
    podmotion_log::init(flags.log_format, "info");
    let verdict = run_all(&flags.settings, &exe);
    report(&verdict, &flags.termination_log)
}

/// A probe the checks run in a child of this binary (its first argument names it):
/// its exit code, `None` when this is no probe.
fn run_probe(args: &[String], exe: &Path) -> Option<ExitCode> {
    let result = match args.first().map(String::as_str) {
        Some(USERNS_PROBE_ARG) => userns_probe(),
        Some(PROC_PROBE_ARG) => proc_probe_outer(exe),
        Some(PROC_PROBE_INNER_ARG) => proc_probe_inner(),
        _ => return None,
    };
    Some(match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    })
}

/// What the flags ask for.
struct Flags {
    settings: Settings,
    termination_log: PathBuf,
    log_format: podmotion_log::LogFormat,
}

/// The flags (`--name=value` each) over the defaults; a usage error says what is wrong
/// and ends with the usage line.
fn parse_flags(args: &[String]) -> Result<Flags, String> {
    let mut s = Settings::default();
    let mut termination_log = PathBuf::from("/dev/termination-log");
    // PODMOTION_LOG_FORMAT, then --log-format: the same pair as every other binary.
    let mut log_format =
        podmotion_log::LogFormat::from_env().map_err(|e| format!("{e}\n{USAGE}"))?;
    for a in args {
        let Some((k, v)) = a.split_once('=') else {
            return Err(USAGE.to_string());
        };
        match k {
            "--kvm-device" => s.kvm_device = v.into(),
            "--session-volume" => s.session_volume = v.into(),
            "--require-project-quota" => {
                s.require_project_quota = v
                    .parse()
                    .map_err(|_| format!("--require-project-quota takes true or false\n{USAGE}"))?
            }
            "--apparmor-sysctl" => s.apparmor_sysctl = v.into(),
            "--mountinfo" => s.mountinfo = v.into(),
            "--termination-log" => termination_log = v.into(),
            "--log-format" => log_format = v.parse().map_err(|e| format!("{e}\n{USAGE}"))?,
            _ => return Err(format!("unknown flag {k}\n{USAGE}")),
        }
    }
    Ok(Flags {
        settings: s,
        termination_log,
        log_format,
    })
}

/// Prints the verdict (itself one JSON object: it is the product) to stdout and the
/// termination message; the log line on stderr says the same in the shared log format.
/// Exit 1 when a check failed.
fn report(verdict: &podmotion_preflight::Verdict, termination_log: &Path) -> ExitCode {
    let line = verdict.to_line();
    println!("{line}");
    if verdict.ok {
        tracing::info!("preflight passed");
    } else {
        tracing::error!(verdict = %line, "preflight failed");
    }
    // Best effort: outside a pod there may be no termination log.
    if let Err(e) = std::fs::write(termination_log, format!("{line}\n")) {
        tracing::warn!(path = %termination_log.display(), error = %e, "could not write the termination log");
    }
    if verdict.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
