//! What a core wants said about an object: an Event's severity, reason (a condition
//! reason constant, so `kubectl describe` and the status tell the same story), action
//! and message. Pure data: the controller shell publishes the notes a core returns
//! (`crate::controllers::shell`), so no core composes Events on its own.

use std::borrow::Cow;

/// Severity of an Event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Normal,
    Warning,
}

/// An Event to publish about the reconciled object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    pub kind: EventKind,
    /// A condition reason (`podmotion_api::names::reasons`; a health condition's
    /// reason read back from a status is one of them too).
    pub reason: Cow<'static, str>,
    /// What the controller was doing (`Migrate`, `CreateJob`, `Reconcile`, …).
    pub action: &'static str,
    pub message: String,
}

impl Note {
    pub fn normal(reason: &'static str, action: &'static str, message: impl Into<String>) -> Note {
        Note {
            kind: EventKind::Normal,
            reason: reason.into(),
            action,
            message: message.into(),
        }
    }

    pub fn warning(reason: &'static str, action: &'static str, message: impl Into<String>) -> Note {
        Note {
            kind: EventKind::Warning,
            reason: reason.into(),
            action,
            message: message.into(),
        }
    }
}

/// A short list of names for an Event message: the first ten, then how many more.
pub fn some_names(names: &[String]) -> String {
    let mut out = names
        .iter()
        .take(10)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > 10 {
        out.push_str(&format!(" and {} more", names.len() - 10));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_list_of_names_is_cut_after_ten() {
        let names: Vec<String> = (0..12).map(|i| format!("j{i}")).collect();
        let s = some_names(&names);
        assert!(s.starts_with("j0, j1"));
        assert!(s.ends_with("j9 and 2 more"));
        assert_eq!(some_names(&names[..2]), "j0, j1");
    }
}
