//! Which PodMotion release reconciles an object. Two releases (two Helm installs, each
//! with its own operator and leader Lease) may watch overlapping namespaces; without a
//! claim both would drive the same PodMigration (two node agents freezing, dumping and
//! joining the same pod's namespaces). So each object carries the release that owns
//! it in the annotation `podmotion.io/controller` (`annotations::CONTROLLER`), put by
//! the first release that sees it, by a write that carries the resourceVersion it read
//! (two releases racing: one wins, the other gets a conflict and, on reading again,
//! sees the winner's claim). A release reconciles only what it holds.
//!
//! A release is the set of replicas that share one leader Lease, so its identity is
//! `<release namespace>/<lease name>` ([`release_identity`]): stable across restarts,
//! upgrades and leader changes, unique per release (two releases in one namespace
//! that shared a Lease name would share one leader, i.e. never run at once), and
//! derived from settings the operator has anyway, so nobody has to set it.
//!
//! The decision is here and pure ([`step`]); the write, the log line and the Event
//! are the runtime's (the controller shell's claim gate).

use std::collections::BTreeMap;

use podmotion_api::names::annotations;

/// The identity a release claims objects under: the namespace of its operator and the
/// name of its leader Lease.
pub fn release_identity(namespace: &str, lease_name: &str) -> String {
    format!("{namespace}/{lease_name}")
}

/// Who holds an object, from its annotations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder<'a> {
    /// No claim (objects from before claims existed, or a claim removed by hand to
    /// hand the object over). An empty or blank value counts as none.
    Unclaimed,
    /// This release.
    Me,
    /// Another release, by its identity.
    Other(&'a str),
}

/// Who holds the object with `annotations`, seen from the release `me`.
pub fn holder<'a>(annotations: &'a BTreeMap<String, String>, me: &str) -> Holder<'a> {
    match annotations.get(annotations::CONTROLLER).map(|v| v.trim()) {
        None | Some("") => Holder::Unclaimed,
        Some(v) if v == me => Holder::Me,
        Some(v) => Holder::Other(v),
    }
}

/// What a release does with an object before anything else.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Ours: reconcile it (cleanup included, when it is being deleted).
    Reconcile,
    /// Nobody's: claim it (a write that carries the resourceVersion read), then
    /// reconcile it.
    Claim,
    /// Another release's: no write, no agent call, no finalizer. Say why, once.
    LeaveAlone { holder: String },
    /// Nobody's, being deleted, and nothing of ours on it to release: nothing to do.
    Nothing,
}

/// The object's metadata as the decision needs it.
#[derive(Clone, Copy, Debug)]
pub struct Seen<'a> {
    pub annotations: &'a BTreeMap<String, String>,
    pub finalizers: &'a [String],
    /// It has a deletionTimestamp.
    pub deleting: bool,
}

/// What the release `me`, whose controller guards its cleanup with `finalizer`, does
/// with the object `seen`.
///
/// An unclaimed object being deleted is claimed only when it still carries our
/// finalizer (an object from before claims existed, whose cleanup someone must run):
/// the claim makes exactly one release run it. An object another release holds is
/// left alone in every case, deletion included: its finalizer is that release's to
/// remove (or the uninstall hook's, which releases only its own release's objects).
pub fn step(seen: Seen<'_>, finalizer: Option<&str>, me: &str) -> Step {
    match holder(seen.annotations, me) {
        Holder::Me => Step::Reconcile,
        Holder::Other(holder) => Step::LeaveAlone {
            holder: holder.to_string(),
        },
        Holder::Unclaimed => {
            let ours_on_it =
                finalizer.is_some_and(|f| seen.finalizers.iter().any(|have| have == f));
            if seen.deleting && !ours_on_it {
                Step::Nothing
            } else {
                Step::Claim
            }
        }
    }
}

/// Whether the release `me` may act on an object with `annotations` when no
/// controller decides first (the uninstall hook, the attachment controller's view of
/// the other attachments of a workload): it holds it, or nobody does.
pub fn may_act(annotations: &BTreeMap<String, String>, me: &str) -> bool {
    !matches!(holder(annotations, me), Holder::Other(_))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: &str = "podmotion-a/podmotion-operator";
    const OTHER: &str = "podmotion-b/podmotion-operator";
    const FIN: &str = "podmotion.io/migration-cleanup";

    fn claimed(by: Option<&str>) -> BTreeMap<String, String> {
        let mut a = BTreeMap::from([("example.com/unrelated".to_string(), ME.to_string())]);
        if let Some(by) = by {
            a.insert(annotations::CONTROLLER.into(), by.into());
        }
        a
    }

    fn decide(by: Option<&str>, finalizers: &[&str], deleting: bool) -> Step {
        let finalizers: Vec<String> = finalizers.iter().map(|f| f.to_string()).collect();
        step(
            Seen {
                annotations: &claimed(by),
                finalizers: &finalizers,
                deleting,
            },
            Some(FIN),
            ME,
        )
    }

    #[test]
    fn the_identity_is_the_release_namespace_and_its_lease() {
        assert_eq!(
            release_identity("podmotion-a", "podmotion-operator"),
            "podmotion-a/podmotion-operator"
        );
        assert_ne!(
            release_identity("podmotion-a", "podmotion-operator"),
            release_identity("podmotion-b", "podmotion-operator")
        );
    }

    #[test]
    fn an_unclaimed_object_is_claimed_first() {
        assert_eq!(decide(None, &[], false), Step::Claim);
        // From before claims existed: our finalizer already on it.
        assert_eq!(decide(None, &[FIN], false), Step::Claim);
    }

    #[test]
    fn a_blank_claim_counts_as_none() {
        assert_eq!(decide(Some(""), &[], false), Step::Claim);
        assert_eq!(decide(Some("  "), &[], false), Step::Claim);
    }

    #[test]
    fn our_object_is_reconciled_and_cleaned_up() {
        assert_eq!(decide(Some(ME), &[FIN], false), Step::Reconcile);
        assert_eq!(decide(Some(ME), &[FIN], true), Step::Reconcile);
        // Padding around the value does not make it someone else's.
        assert_eq!(
            decide(Some(&format!(" {ME} ")), &[], false),
            Step::Reconcile
        );
    }

    #[test]
    fn another_release_s_object_is_left_alone_even_while_it_is_deleted() {
        for (finalizers, deleting) in [(&[][..], false), (&[FIN][..], false), (&[FIN][..], true)] {
            assert_eq!(
                decide(Some(OTHER), finalizers, deleting),
                Step::LeaveAlone {
                    holder: OTHER.into()
                }
            );
        }
    }

    #[test]
    fn a_release_in_another_namespace_with_the_same_lease_name_is_another_release() {
        assert_eq!(
            decide(Some("podmotion-c/podmotion-operator"), &[], false),
            Step::LeaveAlone {
                holder: "podmotion-c/podmotion-operator".into()
            }
        );
    }

    #[test]
    fn an_unclaimed_object_being_deleted_is_claimed_only_to_release_our_finalizer() {
        assert_eq!(decide(None, &[FIN], true), Step::Claim);
        assert_eq!(decide(None, &[], true), Step::Nothing);
        assert_eq!(decide(None, &["example.com/other"], true), Step::Nothing);
        // A controller without a finalizer has nothing to release.
        let a = claimed(None);
        let fins = vec![FIN.to_string()];
        let seen = Seen {
            annotations: &a,
            finalizers: &fins,
            deleting: true,
        };
        assert_eq!(step(seen, None, ME), Step::Nothing);
    }

    #[test]
    fn only_another_release_s_claim_forbids_acting() {
        assert!(may_act(&claimed(None), ME));
        assert!(may_act(&claimed(Some(ME)), ME));
        assert!(may_act(&claimed(Some("")), ME));
        assert!(!may_act(&claimed(Some(OTHER)), ME));
    }
}
