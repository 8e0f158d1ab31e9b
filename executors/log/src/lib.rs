//! The one log setup of every PodMotion binary (operator, agent, broker, attach agent,
//! preflight): the same flag `--log-format json|text`, the same environment variable
//! [`ENV`], the same default (JSON lines, one object per event, for log collectors),
//! and the filter from `RUST_LOG`. Kept in its own small crate because the binaries
//! share no other crate, and it needs nothing but `tracing-subscriber` (already in
//! every one of them but preflight).
#![forbid(unsafe_code)]

use std::fmt;
use std::str::FromStr;

#[cfg(feature = "setup")]
use tracing_subscriber::EnvFilter;
#[cfg(feature = "setup")]
use tracing_subscriber::fmt::MakeWriter;

/// The environment variable every binary reads its log format from (the operator's
/// name since the start).
pub const ENV: &str = "PODMOTION_LOG_FORMAT";

/// `--log-format`: JSON lines (the default) or human-readable text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    #[default]
    Json,
    Text,
}

impl FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "json" => Ok(LogFormat::Json),
            "text" => Ok(LogFormat::Text),
            other => Err(format!("log format {other:?}: expected json or text")),
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Json => "json",
            LogFormat::Text => "text",
        })
    }
}

#[cfg(feature = "setup")]
impl LogFormat {
    /// From [`ENV`], for binaries that parse no flags with clap (preflight); unset or
    /// empty is the default.
    pub fn from_env() -> Result<Self, String> {
        match std::env::var(ENV) {
            Ok(v) if !v.is_empty() => v.parse(),
            _ => Ok(LogFormat::default()),
        }
    }
}

#[cfg(feature = "setup")]
/// Installs the global subscriber: `format` on stderr, filtered by `RUST_LOG` or else
/// `default_filter` (e.g. `"info"`, `"info,kube=warn"`); `log` records are forwarded.
pub fn init(format: LogFormat, default_filter: &str) {
    use tracing_subscriber::util::SubscriberInitExt;
    dispatch(format, default_filter, std::io::stderr).init();
}

#[cfg(feature = "setup")]
/// The subscriber [`init`] installs, writing to `writer` (tests give it a buffer).
pub fn dispatch<W>(format: LogFormat, default_filter: &str, writer: W) -> tracing::Dispatch
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        // Flattened: `message` and the event's fields are top-level keys, as log
        // collectors (Loki, Elasticsearch, Cloud Logging) look for them.
        LogFormat::Json => tracing::Dispatch::new(builder.json().flatten_event(true).finish()),
        LogFormat::Text => tracing::Dispatch::new(builder.with_ansi(false).finish()),
    }
}

#[cfg(all(test, feature = "setup"))]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn logged(format: LogFormat) -> String {
        let buf = Buf::default();
        let out = buf.clone();
        let d = dispatch(format, "info", move || buf.clone());
        tracing::dispatcher::with_default(&d, || {
            tracing::info!(node = "pm-node-0", frozen = 2, "agent serving");
            tracing::debug!("filtered out at info");
        });
        String::from_utf8(out.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn json_is_the_default_and_writes_one_object_per_line() {
        assert_eq!(LogFormat::default(), LogFormat::Json);
        let text = logged(LogFormat::default());
        let lines: Vec<_> = text.lines().collect();
        assert_eq!(lines.len(), 1, "{text}");
        let v: serde_json::Value = serde_json::from_str(lines[0]).expect(lines[0]);
        assert_eq!(v["level"], "INFO", "{v}");
        assert_eq!(v["message"], "agent serving", "{v}");
        assert_eq!(v["node"], "pm-node-0", "{v}");
        assert!(v.get("fields").is_none(), "fields are top-level: {v}");
        assert!(v["timestamp"].is_string(), "{v}");
    }

    #[test]
    fn text_is_not_json_and_has_no_colour_codes() {
        let text = logged(LogFormat::Text);
        assert!(text.contains("agent serving"), "{text}");
        assert!(
            serde_json::from_str::<serde_json::Value>(text.trim()).is_err(),
            "{text}"
        );
        assert!(!text.contains('\u{1b}'), "{text:?}");
    }

    #[test]
    fn only_json_and_text_parse() {
        assert_eq!("json".parse(), Ok(LogFormat::Json));
        assert_eq!("text".parse(), Ok(LogFormat::Text));
        assert!("JSON ".parse::<LogFormat>().is_err());
        assert_eq!(LogFormat::Text.to_string().parse(), Ok(LogFormat::Text));
    }
}
