//! The journal of locked sources (one file per migration under the run directory)
//! and the recovery at start from what a previous broker process left behind.

use crate::{Broker, Kernel, Lock, kill_fenced, roll_back, under_pods_root};
use podmotion_wire::broker::BrokerError;
use podmotion_wire::ids::{MigrationUid, ProcRef};
use std::path::PathBuf;
use std::sync::atomic::Ordering;

impl<K: Kernel> Broker<K> {
    /// The journal lives beside the netns mount points: the one directory the broker
    /// always has writable and that outlives the broker's container (a host path in the
    /// chart). `.journal` is never a migration UID, so the netns sweep skips it.
    fn journal_dir(&self) -> PathBuf {
        self.cfg.run_dir.join("netns").join(".journal")
    }

    fn journal_path(&self, uid: &str) -> PathBuf {
        self.journal_dir().join(uid)
    }

    /// Records a locked source on disk (run directory, 0600) before the lock is
    /// reported done, so that a broker that dies while a source is frozen rolls it back
    /// when it starts again ([`Broker::recover`]).
    /// `fenced`: the restore fence, so that a restarted broker kills the source
    /// instead of rolling it back.
    pub(crate) fn journal_write(
        &self,
        uid: &MigrationUid,
        p: ProcRef,
        l: &Lock,
        fenced: bool,
    ) -> Result<(), BrokerError> {
        let body = serde_json::json!({
            "pid": p.pid, "start_time": p.start_time, "links": l.links, "routes": l.routes,
            "routes6": l.routes6, "addrs6": l.addrs6, "fenced": fenced,
        });
        self.kernel.journal_write(
            &self.journal_dir(),
            uid.as_str(),
            body.to_string().as_bytes(),
        )
    }

    pub(crate) fn journal_remove(&self, uid: &MigrationUid) {
        self.kernel.remove_file(&self.journal_path(uid.as_str()));
    }

    /// Undoes what a previous broker process left behind on this node: every source it
    /// had locked (recorded in the journal) whose process is still the same live process
    /// is rolled back — sockets out of repair, links and routes restored, SIGCONT — or,
    /// if it was fenced, killed; and every netns bind mount it had made is removed. Its
    /// agents' connections (the leases) ended with it, so this is what `lease_lost`
    /// would have done. The addresses it adopted are loaded from their journal and
    /// swept: those not restored are withdrawn (their leases ended), the restored ones
    /// stay while a moved connection uses them. Returns the migration UIDs rolled back
    /// or killed.
    pub fn recover(&self) -> Vec<String> {
        self.recovering.store(true, Ordering::SeqCst);
        let rolled = self.recover_all();
        self.recovering.store(false, Ordering::SeqCst);
        rolled
    }

    /// Whether [`Broker::recover`] is under way.
    pub fn recovering(&self) -> bool {
        self.recovering.load(Ordering::SeqCst)
    }

    fn recover_all(&self) -> Vec<String> {
        // First: a source rolled back below answers its clients again, and none of
        // its new connections may still go to the target.
        self.recover_forwards();
        self.recover_holds();
        let mut rolled = Vec::new();
        let dir = self.journal_dir();
        for (name, path) in self.kernel.read_dir(&dir) {
            if self.recover_record(&name, &path) {
                rolled.push(name);
            }
            // Only now, after the rollback or kill: a broker that dies before this (a
            // pod deleted while its restarted broker waits for CRIU to let go of the
            // source) leaves the record to the next one, which does it again (both
            // are idempotent).
            self.kernel.remove_file(&path);
        }
        let netns = self.cfg.run_dir.join("netns");
        for (name, _) in self.kernel.read_dir(&netns) {
            if let Ok(uid) = MigrationUid::parse(&name) {
                let _ = self.unbind(&uid);
            }
        }
        self.load_adoptions();
        self.sweep();
        rolled
    }
}

impl<K: Kernel> Broker<K> {
    /// Rolls back (or, fenced, kills) the source of one journal record, if it names a
    /// live pod process; whether it did.
    fn recover_record(&self, name: &str, path: &std::path::Path) -> bool {
        let record = self
            .kernel
            .read_file(path)
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
        let Some((p, l, fenced)) = record.as_ref().and_then(parse_journal) else {
            tracing::warn!(file = %path.display(), "unreadable journal record removed");
            return false;
        };
        if MigrationUid::parse(name).is_err() {
            return false;
        }
        // Only ever a pod's process, as at registration.
        let in_pod = self
            .kernel
            .cgroup_of(p.pid)
            .is_ok_and(|cg| under_pods_root(&cg, &self.cfg.pods_cgroup_root));
        if !in_pod {
            tracing::warn!(uid = %name, pid = p.pid, "journal names no pod process: ignored");
            return false;
        }
        if fenced {
            tracing::warn!(uid = %name, pid = p.pid, "a previous broker left this source fenced: killing it (its restored copy may run)");
            kill_fenced(&self.kernel, p);
        } else {
            tracing::warn!(uid = %name, pid = p.pid, "a previous broker left this source locked: rolling back");
            roll_back(&self.kernel, p, &l);
        }
        true
    }
}

/// A journal record: the locked process, its lock, and whether it is fenced.
fn parse_journal(v: &serde_json::Value) -> Option<(ProcRef, Lock, bool)> {
    let strings = |k: &str| -> Option<Vec<String>> {
        v.get(k)?
            .as_array()?
            .iter()
            .map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    let p = ProcRef {
        pid: i32::try_from(v.get("pid")?.as_i64()?).ok()?,
        start_time: v.get("start_time")?.as_u64()?,
    };
    (p.pid > 1).then_some(())?;
    Some((
        p,
        Lock {
            links: strings("links")?,
            routes: strings("routes")?,
            // Absent in a journal written before IPv6 was saved.
            routes6: strings("routes6").unwrap_or_default(),
            addrs6: strings("addrs6").unwrap_or_default(),
        },
        // Absent in a journal written before the restore fence.
        v.get("fenced").and_then(|f| f.as_bool()).unwrap_or(false),
    ))
}
