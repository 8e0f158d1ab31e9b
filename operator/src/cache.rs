//! Projection caches: what a controller reads instead of listing from the API server.
//!
//! A [`Projection`] keeps, per object, only the facts a pure core decides on (a
//! `PodView`, a `JobView`), never the object itself: a pod costs its few strings, not
//! its full spec and status (LESSONS: a full pod cache of ~2,000 pods can cost hundreds
//! of MB). It is fed by a watcher stream through [`feed`], which turns every *change of
//! a projection* into reconcile triggers: an update the core cannot see (a status
//! heartbeat, a counter it does not read, managed fields) wakes nothing.
//!
//! Guarantees a reconcile relies on:
//! - **Synced before trusted**: [`Projection::is_ready`] is false until the first full
//!   list is in; a controller must not decide (above all, not delete) on an empty cache
//!   that merely has not listed yet.
//! - **Atomic re-lists**: a re-list (after a watch expired) replaces the contents only
//!   when it is complete, and reports the objects it dropped as removed, so a deletion
//!   missed while disconnected still wakes its owner.
//! - **Read your writes**: the controller records its own creations and deletions at
//!   once ([`Projection::insert_if_absent`], [`Projection::update_if_present`]); the
//!   next reconcile does not act on a cache that has not seen them yet. A record never
//!   overrides what the watch already delivered.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use futures::{Stream, StreamExt, stream};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Resource, ResourceExt};

use crate::context::Context;

/// `(namespace, name)` of a cached object (namespace empty for cluster-scoped kinds).
pub type Key = (String, String);

/// The key of an object.
pub fn key_of<K: Resource>(o: &K) -> Key {
    (o.namespace().unwrap_or_default(), o.name_any())
}

/// One changed projection: `old` and `new` differ; `None` is absent.
#[derive(Clone, Debug, PartialEq)]
pub struct Change<V> {
    pub key: Key,
    pub old: Option<Arc<V>>,
    pub new: Option<Arc<V>>,
}

impl<V> Change<V> {
    /// The projection after the change, else before it (for a removal).
    pub fn latest(&self) -> Option<&V> {
        self.new.as_deref().or(self.old.as_deref())
    }
}

#[derive(Debug)]
struct State<V> {
    live: HashMap<Key, Arc<V>>,
    /// A re-list in progress: applied when complete.
    relist: Option<HashMap<Key, Arc<V>>>,
    ready: bool,
}

impl<V> State<V> {
    /// Removes `key`; the change, if it was there.
    fn remove(&mut self, key: Key) -> Vec<Change<V>> {
        self.live
            .remove(&key)
            .map(|old| Change {
                key,
                old: Some(old),
                new: None,
            })
            .into_iter()
            .collect()
    }
}

impl<V: PartialEq> State<V> {
    /// The relist is complete: it replaces what was live (the cache is ready from now
    /// on); the changes, objects that appeared or changed first, then those gone.
    fn finish_relist(&mut self) -> Vec<Change<V>> {
        let new = self.relist.take().unwrap_or_default();
        let mut changes: Vec<Change<V>> = new
            .iter()
            .filter(|(k, v)| self.live.get(*k) != Some(*v))
            .map(|(k, v)| Change {
                key: k.clone(),
                old: self.live.get(k).cloned(),
                new: Some(v.clone()),
            })
            .collect();
        changes.extend(
            self.live
                .iter()
                .filter(|(k, _)| !new.contains_key(*k))
                .map(|(k, v)| Change {
                    key: k.clone(),
                    old: Some(v.clone()),
                    new: None,
                }),
        );
        self.live = new;
        self.ready = true;
        changes
    }

    /// Puts `v` under `key`; the change, unless it equals what was there.
    fn upsert(&mut self, key: Key, v: V) -> Vec<Change<V>> {
        if self.live.get(&key).is_some_and(|old| **old == v) {
            return vec![];
        }
        let new = Arc::new(v);
        let old = self.live.insert(key.clone(), new.clone());
        vec![Change {
            key,
            old,
            new: Some(new),
        }]
    }
}

/// A cache of projections `V` of the objects of one watch.
#[derive(Debug)]
pub struct Projection<V> {
    state: RwLock<State<V>>,
}

impl<V> Default for Projection<V> {
    fn default() -> Self {
        Projection {
            state: RwLock::new(State {
                live: HashMap::new(),
                relist: None,
                ready: false,
            }),
        }
    }
}

impl<V: PartialEq> Projection<V> {
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State<V>> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State<V>> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the first complete list has been applied.
    pub fn is_ready(&self) -> bool {
        self.read().ready
    }

    pub fn len(&self) -> usize {
        self.read().live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, key: &Key) -> Option<Arc<V>> {
        self.read().live.get(key).cloned()
    }

    pub fn contains(&self, key: &Key) -> bool {
        self.read().live.contains_key(key)
    }

    /// The projections whose key and value satisfy `keep`.
    pub fn select(&self, keep: impl Fn(&Key, &V) -> bool) -> Vec<Arc<V>> {
        self.read()
            .live
            .iter()
            .filter(|(k, v)| keep(k, v))
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Applies one watcher event. `project` gives the projection of an object, `None`
    /// for an object the cache does not keep. Returns what changed.
    pub fn apply<K: Resource>(
        &self,
        event: &Event<K>,
        project: impl Fn(&K) -> Option<V>,
    ) -> Vec<Change<V>> {
        let mut st = self.write();
        match event {
            Event::Init => {
                st.relist = Some(HashMap::new());
                vec![]
            }
            Event::InitApply(o) => {
                if let Some(v) = project(o) {
                    st.relist
                        .get_or_insert_with(HashMap::new)
                        .insert(key_of(o), Arc::new(v));
                }
                vec![]
            }
            Event::InitDone => st.finish_relist(),
            Event::Apply(o) => match project(o) {
                Some(v) => st.upsert(key_of(o), v),
                // No longer an object the cache keeps: as good as deleted.
                None => st.remove(key_of(o)),
            },
            Event::Delete(o) => st.remove(key_of(o)),
        }
    }

    /// Records an object the controller just created, unless the watch has delivered
    /// it (or something newer) already.
    pub fn insert_if_absent(&self, key: Key, v: V) {
        self.write().live.entry(key).or_insert_with(|| Arc::new(v));
    }

    /// Records a change the controller just made to a cached object (a deletion that
    /// has started); no-op when the watch has removed it already.
    pub fn update_if_present(&self, key: &Key, f: impl FnOnce(&V) -> V) {
        let mut st = self.write();
        if let Some(v) = st.live.get_mut(key) {
            *v = Arc::new(f(v));
        }
    }
}

/// The list-then-watch of a cache: small pages, not `any_semantic` (the API server's
/// watch cache serves such a list whole, ignoring the page size). Each page is decoded
/// as full objects before it is projected, and the allocator keeps the largest such
/// moment: 500-pod pages left the operator at 91 MiB with 10,000 pods, 100-pod pages
/// at 48 MiB (`bench_operator_rss`).
pub fn paged() -> watcher::Config {
    watcher::Config::default().page_size(100)
}

/// Feeds `cache` from a watcher stream (`watcher(..)` or `metadata_watcher(..)`) and
/// turns each change into the reconcile triggers `map` gives. Registers `part` on the
/// readiness endpoint and marks it ready with the first complete list. Watch errors
/// are logged and retried with backoff.
pub fn feed<K, V, T, I>(
    ctx: &Arc<Context>,
    part: &'static str,
    events: impl Stream<Item = Result<Event<K>, watcher::Error>> + Send + 'static,
    cache: Arc<Projection<V>>,
    project: fn(&K) -> Option<V>,
    map: impl Fn(&Change<V>) -> I + Send + 'static,
) -> impl Stream<Item = T> + Send + 'static
where
    K: Resource + Send + 'static,
    V: PartialEq + Send + Sync + 'static,
    T: Send + 'static,
    I: IntoIterator<Item = T>,
{
    ctx.readiness.register(part);
    let ctx = ctx.clone();
    events.default_backoff().flat_map(move |ev| {
        let triggers: Vec<T> = match ev {
            Ok(ev) => {
                let was_ready = cache.is_ready();
                let changes = cache.apply(&ev, project);
                if !was_ready && cache.is_ready() {
                    ctx.readiness.set_ready(part);
                }
                changes.iter().flat_map(&map).collect()
            }
            Err(e) => {
                tracing::warn!(cache = part, error = %e, "watch failed; retrying");
                vec![]
            }
        };
        stream::iter(triggers)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;
    use std::collections::BTreeMap;

    fn cm(name: &str, v: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            data: Some(BTreeMap::from([("v".to_string(), v.to_string())])),
            ..Default::default()
        }
    }

    /// The projection: the value of `v`; objects with `v == "skip"` are not kept.
    fn project(c: &ConfigMap) -> Option<String> {
        let v = c.data.as_ref()?.get("v")?.clone();
        (v != "skip").then_some(v)
    }

    fn key(name: &str) -> Key {
        ("ns".into(), name.into())
    }

    fn changed(changes: &[Change<String>]) -> Vec<(String, Option<String>, Option<String>)> {
        let mut out: Vec<_> = changes
            .iter()
            .map(|c| {
                (
                    c.key.1.clone(),
                    c.old.as_deref().cloned(),
                    c.new.as_deref().cloned(),
                )
            })
            .collect();
        out.sort();
        out
    }

    fn listed(p: &Projection<String>, objs: &[ConfigMap]) -> Vec<Change<String>> {
        p.apply(&Event::Init, project);
        for o in objs {
            p.apply(&Event::InitApply(o.clone()), project);
        }
        p.apply(&Event::<ConfigMap>::InitDone, project)
    }

    #[test]
    fn not_ready_until_the_first_list_is_complete() {
        let p = Projection::new();
        assert!(!p.is_ready());
        p.apply(&Event::Init, project);
        p.apply(&Event::InitApply(cm("a", "1")), project);
        assert!(!p.is_ready(), "a partial list is not a synced cache");
        assert!(p.is_empty(), "a partial list is not visible");
        p.apply(&Event::<ConfigMap>::InitDone, project);
        assert!(p.is_ready());
        assert_eq!(p.get(&key("a")).as_deref(), Some(&"1".to_string()));
    }

    #[test]
    fn only_changes_of_the_projection_are_reported() {
        let p = Projection::new();
        let first = listed(&p, &[cm("a", "1")]);
        assert_eq!(changed(&first), vec![("a".into(), None, Some("1".into()))]);
        // The same projection again (a status-only update, say): nothing changed.
        assert!(p.apply(&Event::Apply(cm("a", "1")), project).is_empty());
        assert_eq!(
            changed(&p.apply(&Event::Apply(cm("a", "2")), project)),
            vec![("a".into(), Some("1".into()), Some("2".into()))]
        );
        // An object that stops matching the projection leaves the cache.
        assert_eq!(
            changed(&p.apply(&Event::Apply(cm("a", "skip")), project)),
            vec![("a".into(), Some("2".into()), None)]
        );
        assert!(!p.contains(&key("a")));
        // Deleting what the cache does not hold reports nothing.
        assert!(p.apply(&Event::Delete(cm("a", "2")), project).is_empty());
    }

    #[test]
    fn deletions_are_reported_with_the_last_projection() {
        let p = Projection::new();
        listed(&p, &[cm("a", "1"), cm("b", "1")]);
        let c = p.apply(&Event::Delete(cm("a", "whatever")), project);
        assert_eq!(changed(&c), vec![("a".into(), Some("1".into()), None)]);
        assert_eq!(c[0].latest(), Some(&"1".to_string()));
        assert_eq!(p.len(), 1);
    }

    #[test]
    fn a_relist_is_atomic_and_reports_what_it_dropped() {
        let p = Projection::new();
        listed(&p, &[cm("a", "1"), cm("b", "1"), cm("c", "1")]);
        // While disconnected: a deleted, b changed, d created, c unchanged.
        p.apply(&Event::Init, project);
        p.apply(&Event::InitApply(cm("b", "2")), project);
        assert_eq!(
            p.len(),
            3,
            "the old contents stay until the re-list is complete"
        );
        p.apply(&Event::InitApply(cm("c", "1")), project);
        p.apply(&Event::InitApply(cm("d", "1")), project);
        let c = p.apply(&Event::<ConfigMap>::InitDone, project);
        assert_eq!(
            changed(&c),
            vec![
                ("a".into(), Some("1".into()), None),
                ("b".into(), Some("1".into()), Some("2".into())),
                ("d".into(), None, Some("1".into())),
            ]
        );
        assert!(p.is_ready());
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn own_writes_are_visible_at_once_but_never_override_the_watch() {
        let p = Projection::new();
        listed(&p, &[]);
        p.insert_if_absent(key("a"), "created".into());
        assert_eq!(p.get(&key("a")).as_deref(), Some(&"created".to_string()));
        // The watch's own copy of the same object reports no change.
        assert!(
            p.apply(&Event::Apply(cm("a", "created")), project)
                .is_empty()
        );
        // A newer state from the watch is not overwritten by a late record.
        p.apply(&Event::Apply(cm("a", "newer")), project);
        p.insert_if_absent(key("a"), "created".into());
        assert_eq!(p.get(&key("a")).as_deref(), Some(&"newer".to_string()));
        // A started deletion is recorded on what is cached; a gone object stays gone.
        p.update_if_present(&key("a"), |v| format!("{v}, deleting"));
        assert_eq!(
            p.get(&key("a")).as_deref(),
            Some(&"newer, deleting".to_string())
        );
        p.apply(&Event::Delete(cm("a", "newer")), project);
        p.update_if_present(&key("a"), |v| format!("{v}, deleting"));
        assert!(!p.contains(&key("a")));
    }

    #[test]
    fn select_filters_by_key_and_value() {
        let p = Projection::new();
        listed(&p, &[cm("a", "1"), cm("b", "2"), cm("c", "1")]);
        let mut ones: Vec<String> = p
            .select(|_, v| v == "1")
            .iter()
            .map(|v| v.to_string())
            .collect();
        ones.sort();
        assert_eq!(ones, vec!["1", "1"]);
        assert_eq!(p.select(|k, _| k.1 == "b").len(), 1);
    }
}
