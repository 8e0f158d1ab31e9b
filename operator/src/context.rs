//! What every controller is handed: the client (for reads), the writer (every write,
//! Events included, behind the leader's fence), settings, metrics, leadership (its
//! term fences agent calls), the release's claims, readiness and the shutdown signal.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use kube::Client;
use kube::runtime::events::Reporter;
use tokio::sync::watch;

use crate::config::OperatorConfig;
use crate::leader::Leadership;
use crate::metrics::Metrics;
use crate::writer::Writer;

/// Shared state of the running operator.
pub struct Context {
    pub client: Client,
    pub config: OperatorConfig,
    pub metrics: Arc<Metrics>,
    /// Every API write goes through it; it holds the leader's fence.
    pub writer: Writer,
    pub leader: Leadership,
    /// This release's identity (`<namespace>/<lease name>`) and its claim notices.
    pub claims: Claims,
    pub readiness: Readiness,
    shutdown: watch::Receiver<bool>,
}

impl Context {
    pub fn new(
        client: Client,
        config: OperatorConfig,
        leader: Leadership,
        metrics: Arc<Metrics>,
        shutdown: watch::Receiver<bool>,
    ) -> Self {
        let reporter = Reporter {
            controller: "podmotion-operator".into(),
            instance: Some(config.identity.clone()),
        };
        let me = crate::claim::release_identity(&config.namespace, &config.leader.lease_name);
        Context {
            claims: Claims::new(me),
            writer: Writer::fenced(client.clone(), leader.clone(), reporter),
            client,
            config,
            metrics,
            leader,
            readiness: Readiness::default(),
            shutdown,
        }
    }

    /// Whether the operator has been asked to stop.
    pub fn stopping(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// Resolves when the operator is asked to stop (SIGTERM, SIGINT). Pass it to
    /// `Controller::graceful_shutdown_on`.
    pub fn shutdown(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.shutdown.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    }
}

/// Leave-alone notices remembered before the memory starts over (a bound: another
/// release's objects are never reconciled here, so their deletion never removes their
/// entry).
const TOLD_MAX: usize = 10_000;

/// This release's identity and what it has said about the objects it leaves alone
/// (the claim gate, `controllers::shell::claim_gate`).
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
    pub(crate) fn first_time(&self, uid: &str, generation: i64, holder: &str) -> bool {
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

/// `/readyz`: ready once every registered controller has synced its caches.
#[derive(Default)]
pub struct Readiness {
    parts: Mutex<BTreeMap<&'static str, bool>>,
    stopping: std::sync::atomic::AtomicBool,
}

/// The part [`Readiness::pending`] names once the operator is stopping.
pub const STOPPING: &str = "stopping";

impl Readiness {
    /// Registers a part that is not ready yet.
    pub fn register(&self, name: &'static str) {
        self.parts
            .lock()
            .expect("readiness lock")
            .entry(name)
            .or_insert(false);
    }
    /// Marks a registered part ready.
    pub fn set_ready(&self, name: &'static str) {
        tracing::info!(part = name, "caches synced");
        self.parts
            .lock()
            .expect("readiness lock")
            .insert(name, true);
    }
    /// Whether the part `name` is registered and ready.
    pub fn is_ready(&self, name: &str) -> bool {
        self.parts
            .lock()
            .expect("readiness lock")
            .get(name)
            .copied()
            .unwrap_or(false)
    }
    /// Not ready from now on, whatever the parts say: the operator is stopping, and
    /// its endpoints (the eviction webhook's) should be dropped before it exits.
    pub fn set_stopping(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
    /// Names of the parts not ready yet (and [`STOPPING`] once stopping); empty means
    /// ready.
    pub fn pending(&self) -> Vec<&'static str> {
        let parts = self.parts.lock().expect("readiness lock");
        let mut pending: Vec<&'static str> = parts
            .iter()
            .filter(|(_, ready)| !**ready)
            .map(|(n, _)| *n)
            .collect();
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            pending.push(STOPPING);
        }
        pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_waits_for_every_registered_part() {
        let r = Readiness::default();
        r.register("a");
        r.register("b");
        r.set_ready("a");
        assert_eq!(r.pending(), vec!["b"]);
        r.set_ready("b");
        assert!(r.pending().is_empty());
        r.set_stopping();
        assert_eq!(r.pending(), vec![STOPPING]);
    }

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
