//! The shell's claim gate: one release reconciles each object (`podmotion_core::claim`
//! decides; this module writes, logs and counts). It runs before the finalizer, so an
//! object another release holds gets nothing from this one: no claim, no finalizer, no
//! status, no child, no agent call. What it does get is one info line, one Event
//! (`ClaimedElsewhere`) and one count in `podmotion_claims_total{outcome="LeftAlone"}`
//! per object generation and holder (not per round: the holder's own status writes
//! wake this controller too), so a user who sees "nothing happens" can see why.
//!
//! An unclaimed object is claimed by a write that carries the resourceVersion read
//! (`Writer::claim`): of two releases racing, the loser gets a conflict and waits for
//! its cache to show the winner's claim. Nothing takes over another release's claim on
//! its own (a release whose Lease looks expired may be restarting, scaled to zero or
//! partitioned, and would come back to an object someone else drives): a user hands an
//! object over by overwriting or removing the annotation (docs/security.md, "Two
//! releases over the same namespaces").

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use podmotion_api::names::{annotations, reasons};

use super::shell::{ReconcileError, Reconciler, api_of};
use crate::claim::{Seen, Step, step};
use crate::context::Context;
use crate::events::publish;
use crate::metrics::ClaimLabels;

/// Leave-alone notices remembered before the memory starts over (a bound: the objects
/// of another release are never deleted through this controller, so their entries are
/// never removed one by one).
const TOLD_MAX: usize = 10_000;

/// Why a round ended without a claim: another release claimed the object first.
pub const CLAIM_LOST: &str = "another release claimed the object first; reading again";

/// This release's identity and what it has said about objects it leaves alone.
pub struct Claims {
    me: String,
    /// uid → (generation, holder) last told about.
    told: Mutex<HashMap<String, (i64, String)>>,
}

impl Claims {
    pub fn new(me: String) -> Claims {
        Claims {
            me,
            told: Mutex::new(HashMap::new()),
        }
    }

    /// The identity this release claims objects under.
    pub fn me(&self) -> &str {
        &self.me
    }

    /// Whether leaving the object `uid` at `generation` to `holder` is news (and
    /// remembers it): once per generation and holder.
    fn first_time(&self, uid: &str, generation: i64, holder: &str) -> bool {
        let mut told = self.told.lock().expect("claims lock");
        if told
            .get(uid)
            .is_some_and(|(g, h)| *g == generation && h == holder)
        {
            return false;
        }
        if told.len() >= TOLD_MAX {
            told.clear();
        }
        told.insert(uid.to_string(), (generation, holder.to_string()));
        true
    }
}

/// What the shell does after the gate.
pub enum Gate<K> {
    /// Reconcile this object (the claimed one when the gate just claimed it: its
    /// resourceVersion is the one the status write must carry).
    Proceed(Arc<K>),
    /// Leave it: end the round with this action.
    Stop(Action),
}

/// The gate for `obj` in controller `R` (see the module documentation).
pub async fn gate<R: Reconciler>(
    ctx: &Context,
    obj: Arc<R::Object>,
) -> Result<Gate<R::Object>, ReconcileError> {
    let me = ctx.claims.me();
    let seen = Seen {
        annotations: obj.annotations(),
        finalizers: obj.finalizers(),
        deleting: obj.meta().deletion_timestamp.is_some(),
    };
    let count = |outcome: &'static str| {
        ctx.metrics
            .claims
            .get_or_create(&ClaimLabels {
                controller: R::NAME,
                outcome,
            })
            .inc();
    };
    match step(seen, R::FINALIZER, me) {
        Step::Reconcile => Ok(Gate::Proceed(obj)),
        Step::Nothing => Ok(Gate::Stop(Action::await_change())),
        Step::LeaveAlone { holder } => {
            let uid = obj.uid().unwrap_or_default();
            let generation = obj.meta().generation.unwrap_or_default();
            if ctx.claims.first_time(&uid, generation, &holder) {
                count("LeftAlone");
                tracing::info!(
                    controller = R::NAME,
                    name = %obj.name_any(),
                    namespace = obj.namespace().as_deref().unwrap_or_default(),
                    %uid,
                    generation,
                    holder = %holder,
                    release = %me,
                    "claimed by another PodMotion release: left alone (overwrite or remove the {} annotation to hand it over)",
                    annotations::CONTROLLER,
                );
                let note = format!(
                    "Reconciled by PodMotion release {holder}, not by {me}: this release leaves it alone. To hand it over: kubectl annotate --overwrite {kind} {name} {key}=<release namespace>/<lease name> (or remove the annotation: the first release that sees it claims it).",
                    kind = R::Object::kind(&()).to_lowercase(),
                    name = obj.name_any(),
                    key = annotations::CONTROLLER,
                );
                publish(
                    ctx,
                    obj.as_ref(),
                    EventType::Normal,
                    reasons::CLAIMED_ELSEWHERE,
                    "Reconcile",
                    note,
                )
                .await;
            }
            Ok(Gate::Stop(Action::await_change()))
        }
        Step::Claim => {
            let api = api_of(&ctx.client, obj.as_ref());
            match ctx
                .writer
                .claim(&api, obj.as_ref(), annotations::CONTROLLER, me, R::MANAGER)
                .await
            {
                Ok(claimed) => {
                    count("Claimed");
                    tracing::info!(
                        controller = R::NAME,
                        name = %obj.name_any(),
                        namespace = obj.namespace().as_deref().unwrap_or_default(),
                        uid = obj.uid().as_deref().unwrap_or_default(),
                        release = %me,
                        "claimed for this PodMotion release"
                    );
                    Ok(Gate::Proceed(Arc::new(claimed)))
                }
                // Another release claimed it (or anything else changed it) since the
                // read: nothing was written; decide again on a fresher read.
                Err(e) if e.is_conflict() => {
                    count("Lost");
                    Err(ReconcileError::wait(CLAIM_LOST, Duration::from_millis(500)))
                }
                Err(e) if e.is_status(404) => Ok(Gate::Stop(Action::await_change())),
                Err(e) => Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_left_alone_object_is_told_about_once_per_generation_and_holder() {
        let c = Claims::new("a/lease".into());
        assert!(c.first_time("uid-1", 1, "b/lease"));
        assert!(!c.first_time("uid-1", 1, "b/lease"), "same generation");
        assert!(c.first_time("uid-1", 2, "b/lease"), "spec changed");
        assert!(c.first_time("uid-1", 2, "c/lease"), "handed to another");
        assert!(c.first_time("uid-2", 2, "c/lease"), "another object");
    }

    #[test]
    fn the_memory_of_notices_is_bounded() {
        let c = Claims::new("a/lease".into());
        for i in 0..TOLD_MAX + 5 {
            c.first_time(&format!("uid-{i}"), 1, "b/lease");
        }
        assert!(c.told.lock().unwrap().len() <= TOLD_MAX);
    }
}
