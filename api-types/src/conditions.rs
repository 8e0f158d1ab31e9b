//! Conditions as kstatus and `kubectl wait --for=condition=Ready` read them.
//!
//! Every status carries `observedGeneration` and the three kstatus conditions; this
//! module is the one place that writes them, so `lastTransitionTime` moves only when a
//! condition's status really changes and `observedGeneration` is stamped on each.

pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use crate::names::condition_types::{READY, RECONCILING, STALLED};

/// Where a resource stands, in kstatus's three terms. Exactly one of `Ready`,
/// `Reconciling`, `Stalled` is `True` afterwards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// Desired state reached.
    Ready { reason: String, message: String },
    /// Working towards the desired state; no user action needed.
    Reconciling { reason: String, message: String },
    /// Cannot make progress without a change from the user (or the cluster).
    Stalled { reason: String, message: String },
}

impl Health {
    pub fn ready(reason: &str, message: impl Into<String>) -> Self {
        Health::Ready {
            reason: reason.into(),
            message: message.into(),
        }
    }
    pub fn reconciling(reason: &str, message: impl Into<String>) -> Self {
        Health::Reconciling {
            reason: reason.into(),
            message: message.into(),
        }
    }
    pub fn stalled(reason: &str, message: impl Into<String>) -> Self {
        Health::Stalled {
            reason: reason.into(),
            message: message.into(),
        }
    }
    pub fn reason(&self) -> &str {
        match self {
            Health::Ready { reason, .. }
            | Health::Reconciling { reason, .. }
            | Health::Stalled { reason, .. } => reason,
        }
    }
    pub fn message(&self) -> &str {
        match self {
            Health::Ready { message, .. }
            | Health::Reconciling { message, .. }
            | Health::Stalled { message, .. } => message,
        }
    }
}

/// Sets (inserts or updates) one condition. `lastTransitionTime` is kept when the
/// status is unchanged, so repeated reconciles do not churn the object.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    observed_generation: Option<i64>,
    now: Timestamp,
) {
    let status = if status { "True" } else { "False" };
    if let Some(existing) = conditions.iter_mut().find(|c| c.type_ == type_) {
        if existing.status != status {
            existing.last_transition_time = Time(now);
        }
        existing.status = status.into();
        existing.reason = reason.into();
        existing.message = message.into();
        existing.observed_generation = observed_generation;
    } else {
        conditions.push(Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: message.into(),
            observed_generation,
            last_transition_time: Time(now),
        });
    }
}

/// Writes `Ready`, `Reconciling` and `Stalled` from one [`Health`].
pub fn set_health(
    conditions: &mut Vec<Condition>,
    health: &Health,
    observed_generation: Option<i64>,
    now: Timestamp,
) {
    let (reason, message) = (health.reason(), health.message());
    let is = |want: &str| match health {
        Health::Ready { .. } => want == READY,
        Health::Reconciling { .. } => want == RECONCILING,
        Health::Stalled { .. } => want == STALLED,
    };
    for t in [READY, RECONCILING, STALLED] {
        set_condition(
            conditions,
            t,
            is(t),
            reason,
            message,
            observed_generation,
            now,
        );
    }
}

/// The condition of `type_`, if present.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition of `type_` is present and `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;
    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn unchanged_status_keeps_transition_time() {
        let mut c = vec![];
        set_condition(&mut c, READY, true, "A", "a", Some(1), t(10));
        set_condition(&mut c, READY, true, "B", "b", Some(2), t(20));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].last_transition_time.0, t(10));
        assert_eq!(c[0].reason, "B");
        assert_eq!(c[0].observed_generation, Some(2));
    }

    #[test]
    fn changed_status_moves_transition_time() {
        let mut c = vec![];
        set_condition(&mut c, READY, true, "A", "a", Some(1), t(10));
        set_condition(&mut c, READY, false, "A", "a", Some(1), t(20));
        assert_eq!(c[0].last_transition_time.0, t(20));
        assert_eq!(c[0].status, "False");
    }

    #[test]
    fn health_sets_exactly_one_of_the_three_true() {
        for h in [
            Health::ready("R", "m"),
            Health::reconciling("R", "m"),
            Health::stalled("R", "m"),
        ] {
            let mut c = vec![];
            set_health(&mut c, &h, Some(3), t(1));
            assert_eq!(c.len(), 3);
            assert_eq!(c.iter().filter(|c| c.status == "True").count(), 1, "{h:?}");
            assert!(c.iter().all(|c| c.observed_generation == Some(3)));
        }
        let mut c = vec![];
        set_health(
            &mut c,
            &Health::stalled("NoAdmissibleTarget", "m"),
            None,
            t(1),
        );
        assert!(is_true(&c, STALLED));
        assert!(!is_true(&c, READY));
    }
}
