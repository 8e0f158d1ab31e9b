//! The one error of a reconcile, built from the stage errors (leadership lost, an API
//! call, an agent call, an inconsistency, or "not yet"), with a bounded category for
//! metrics and logs; and the two questions every controller asks of an API error.

use std::time::Duration;

use crate::leader::NotLeader;
use crate::migration::agent::AgentCallError;
use crate::writer::WriteError;

/// The error of one reconcile, whatever stage failed.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
    #[error("{verb} {what}: {source}")]
    Api {
        verb: &'static str,
        what: String,
        source: kube::Error,
    },
    #[error(transparent)]
    Agent(#[from] AgentCallError),
    #[error("{0}")]
    Inconsistent(String),
    /// Not a failure: the object cannot be decided on yet (caches not synced, cleanup
    /// under way). Looked at again after `retry`; a finalizer stays meanwhile.
    #[error("waiting: {why}")]
    Wait { why: &'static str, retry: Duration },
}

impl ReconcileError {
    /// Bounded CamelCase category: metric label and log field, never free text.
    pub fn category(&self) -> &'static str {
        match self {
            ReconcileError::NotLeader(_) => "NotLeader",
            ReconcileError::Api { .. } => "ApiError",
            ReconcileError::Agent(_) => "AgentError",
            ReconcileError::Inconsistent(_) => "Inconsistent",
            ReconcileError::Wait { .. } => "Waiting",
        }
    }

    pub fn wait(why: &'static str, retry: Duration) -> ReconcileError {
        ReconcileError::Wait { why, retry }
    }
}

impl From<WriteError> for ReconcileError {
    fn from(e: WriteError) -> Self {
        match e {
            WriteError::NotLeader(e) => ReconcileError::NotLeader(e),
            WriteError::Api {
                verb,
                kind,
                name,
                source,
            } => ReconcileError::Api {
                verb,
                what: format!("{kind} {name}"),
                source,
            },
        }
    }
}

/// Maps a client error of `verb` on `what` into a [`ReconcileError`].
pub fn api_err(
    verb: &'static str,
    what: impl Into<String>,
) -> impl FnOnce(kube::Error) -> ReconcileError {
    let what = what.into();
    move |source| ReconcileError::Api { verb, what, source }
}

/// Whether `e` is the API server's answer with HTTP status `code`.
pub fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// Whether a create failed because the object exists: 409 with reason `AlreadyExists`.
/// Any other 409 (a `Conflict`) says nothing about the object, so a create that gets
/// one must be retried, never taken as done.
pub fn is_already_exists(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409 && s.reason == "AlreadyExists")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_already_exists_counts_as_an_existing_object() {
        let err = |code: u16, reason: &str| {
            let mut st = kube::core::Status::failure("x", reason);
            st.code = code;
            kube::Error::Api(Box::new(st))
        };
        assert!(is_already_exists(&err(409, "AlreadyExists")));
        assert!(!is_already_exists(&err(409, "Conflict")));
        assert!(!is_already_exists(&err(429, "TooManyRequests")));
    }
}
