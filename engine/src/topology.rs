//! Cluster membership and journal routes.
//!
//! A [`Topology`] hands shards immutable [`ClusterView`] snapshots. A
//! cluster on etcd sets them from its assignments (see `crate::cluster`);
//! a broker without one is a cluster of itself. A cluster file is a thin
//! way to try a cluster without etcd: it lists the brokers and the
//! journals' specs, each broker re-reads its copy when it changes, and
//! routes are computed, not stored: every broker with the same file
//! computes the same route for a journal. Nothing in that mode notices a
//! dead broker or moves its journals; see OPERATIONS for its limits.

use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

/// Id of the broker of a single-node deployment.
pub const LOCAL_BROKER: &str = "local";

/// One broker of the cluster.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Member {
    pub id: String,
    #[serde(default)]
    pub zone: String,
    /// Shard 0's address; shard n listens on port + n.
    pub endpoint: SocketAddr,
    /// The broker's shard count, when it differs from this broker's.
    #[serde(default)]
    pub shards: Option<u32>,
}

impl Member {
    /// The endpoint of the member's shard that owns `journal`; `default`
    /// is the shard count assumed when the file does not state one.
    pub fn shard_endpoint(&self, journal: &str, default: u32) -> SocketAddr {
        let shards = self.shards.unwrap_or(default).max(1);
        let mut a = self.endpoint;
        a.set_port(
            a.port()
                .wrapping_add(rotary_net::shard_of(journal, shards) as u16),
        );
        a
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    brokers: Vec<Member>,
    /// The journals' specs, as `journals apply` takes them.
    #[serde(default)]
    journals: Vec<rotary_net::spec::JournalSpec>,
}

/// What a cluster file says: the view it gives this broker, and the
/// journals' specs.
#[derive(Clone, Debug)]
pub struct FromFile {
    pub view: ClusterView,
    pub specs: Vec<rotary_net::spec::JournalSpec>,
}

/// One consistent picture of the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterView {
    /// This broker's id.
    pub me: String,
    pub brokers: Vec<Member>,
    /// In a cluster on etcd, the assignments the routes are read from and
    /// the etcd revision they were read at; `None` for a single node and a
    /// cluster file, whose routes are computed from `brokers`.
    pub assigned: Option<Arc<Assigned>>,
}

/// Journal routes as etcd's assignments give them, at one revision.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Assigned {
    /// The etcd revision the assignments were read at.
    pub revision: i64,
    /// Per journal, the member id at each slot (slot 0 is the primary);
    /// `None` where the slot is empty.
    pub routes: std::collections::BTreeMap<String, Vec<Option<String>>>,
}

/// The brokers holding a journal: the primary first. Each member's shard
/// is the one its own shard count assigns the journal to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub members: Vec<Member>,
    /// Replication the journal asks for; more than `members.len()` means
    /// the cluster has too few brokers.
    pub replication: usize,
}

impl Route {
    pub fn primary(&self) -> Option<&Member> {
        self.members.first()
    }

    pub fn is_primary(&self, id: &str) -> bool {
        self.primary().is_some_and(|m| m.id == id)
    }

    pub fn contains(&self, id: &str) -> bool {
        self.members.iter().any(|m| m.id == id)
    }

    pub fn is_complete(&self) -> bool {
        self.members.len() >= self.replication
    }

    /// Why an incomplete route takes no appends
    /// (`INSUFFICIENT_JOURNAL_BROKERS`).
    pub fn incomplete_message(&self) -> String {
        format!(
            "the journal's replication is {} but the cluster has {} broker(s) for it",
            self.replication,
            self.members.len()
        )
    }

    /// Member ids in route order: what two brokers compare to agree.
    pub fn ids(&self) -> Vec<String> {
        self.members.iter().map(|m| m.id.clone()).collect()
    }
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in *p {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x100000001b3);
        }
        // Separator, so ("ab","c") and ("a","bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x100000001b3);
    }
    // Final avalanche (splitmix64), so nearby names spread over brokers.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58476d1ce4e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d049bb133111eb);
    h ^ (h >> 31)
}

impl ClusterView {
    /// A cluster of one: this broker, serving every journal alone.
    pub fn single(endpoint: SocketAddr) -> ClusterView {
        ClusterView {
            me: LOCAL_BROKER.into(),
            brokers: vec![Member {
                id: LOCAL_BROKER.into(),
                zone: String::new(),
                endpoint,
                shards: None,
            }],
            assigned: None,
        }
    }

    /// The etcd revision this view's routes were read at; 0 outside etcd.
    pub fn revision(&self) -> u64 {
        self.assigned
            .as_ref()
            .map_or(0, |a| u64::try_from(a.revision).unwrap_or(0))
    }

    /// Whether this is a single-node deployment (no cluster file).
    pub fn is_single(&self) -> bool {
        self.brokers.len() == 1 && self.brokers[0].id == LOCAL_BROKER
    }

    pub fn member(&self, id: &str) -> Option<&Member> {
        self.brokers.iter().find(|m| m.id == id)
    }

    pub fn me(&self) -> Option<&Member> {
        self.member(&self.me)
    }

    /// This view with this broker left out.
    pub fn without_me(&self) -> ClusterView {
        ClusterView {
            me: self.me.clone(),
            brokers: self
                .brokers
                .iter()
                .filter(|m| m.id != self.me)
                .cloned()
                .collect(),
            assigned: self.assigned.clone(),
        }
    }

    /// The route of `journal` at `replication`: brokers ranked by a
    /// rendezvous hash of (journal, broker id), taking one broker per zone
    /// before a second from any zone. A single-node broker holds every
    /// journal alone whatever its replication.
    pub fn route(&self, journal: &str, replication: u32) -> Route {
        if let Some(assigned) = &self.assigned {
            return self.assigned_route(assigned, journal, replication);
        }
        if self.is_single() {
            return Route {
                members: self.brokers.clone(),
                replication: 1,
            };
        }
        let mut ranked: Vec<(u64, &Member)> = self
            .brokers
            .iter()
            .map(|m| (fnv1a(&[journal.as_bytes(), m.id.as_bytes()]), m))
            .collect();
        ranked.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.id.cmp(&b.1.id)));
        let want = replication as usize;
        let mut members: Vec<Member> = Vec::new();
        let mut zones = std::collections::HashSet::new();
        for (_, m) in &ranked {
            if members.len() < want && zones.insert(m.zone.as_str()) {
                members.push((*m).clone());
            }
        }
        for (_, m) in &ranked {
            if members.len() < want && !members.iter().any(|x| x.id == m.id) {
                members.push((*m).clone());
            }
        }
        // Keep the hash order among the chosen, so the primary is the
        // top-ranked broker.
        members.sort_by_key(|m| ranked.iter().position(|(_, r)| r.id == m.id));
        Route {
            members,
            replication: want,
        }
    }

    /// The route etcd's assignments give: the members at slots 0, 1, …
    /// in slot order. Without a live primary (slot 0 empty, or its member
    /// gone) the route is empty until the allocator promotes a replica:
    /// nobody takes appends, and no replica acts as a primary on its own.
    /// A member is in a route once, at its first slot (the control thread
    /// hands sound slots; a route that named a member twice would count
    /// one copy as two).
    fn assigned_route(&self, assigned: &Assigned, journal: &str, replication: u32) -> Route {
        let slots = assigned.routes.get(journal).map(Vec::as_slice);
        let mut members: Vec<Member> = Vec::new();
        if let Some([Some(primary), ..]) = slots {
            if self.member(primary).is_some() {
                for id in slots.unwrap_or_default().iter().flatten() {
                    if let Some(m) = self.member(id) {
                        if !members.iter().any(|x| x.id == m.id) {
                            members.push(m.clone());
                        }
                    }
                }
            }
        }
        Route {
            members,
            replication: replication as usize,
        }
    }
}

/// Parses a cluster file and checks that `me` is in it.
pub fn load_cluster_file(path: &Path, me: &str) -> Result<FromFile, String> {
    let file = parse_cluster_file(path, me)?;
    if file.view.me().is_none() {
        return Err(format!(
            "cluster file {}: no broker with id {me:?}",
            path.display()
        ));
    }
    Ok(file)
}

/// Parses a cluster file; `me` need not be in it (a broker removed from
/// the cluster is in no route, and proxies every request to the members).
fn parse_cluster_file(path: &Path, me: &str) -> Result<FromFile, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cluster file {}: {e}", path.display()))?;
    let file: ClusterFile =
        serde_yaml::from_str(&text).map_err(|e| format!("cluster file {}: {e}", path.display()))?;
    let at = |e: String| format!("cluster file {}: {e}", path.display());
    check_ids(&file.brokers).map_err(at)?;
    check_ports(&file.brokers).map_err(at)?;
    check_journals(&file.journals).map_err(at)?;
    Ok(FromFile {
        view: ClusterView {
            me: me.to_string(),
            brokers: file.brokers,
            assigned: None,
        },
        specs: file.journals,
    })
}

/// Checks that broker ids are allowed and distinct.
fn check_ids(brokers: &[Member]) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for b in brokers {
        if b.id.is_empty() || b.id == LOCAL_BROKER || b.id.contains(char::is_whitespace) {
            return Err(format!("broker id {:?} is not allowed", b.id));
        }
        if !seen.insert(b.id.as_str()) {
            return Err(format!("broker id {:?} appears twice", b.id));
        }
    }
    Ok(())
}

/// Checks that each journal's spec is valid and named once.
fn check_journals(specs: &[rotary_net::spec::JournalSpec]) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for spec in specs {
        spec.validate()
            .map_err(|e| format!("journal {:?}: {e}", spec.name))?;
        if !seen.insert(spec.name.as_str()) {
            return Err(format!("journal {:?} appears twice", spec.name));
        }
    }
    Ok(())
}

/// Checks that each broker's shards have ports of their own: shard n of
/// a broker listens on its endpoint's port + n. A broker that states no
/// shard count has the reading broker's, at least one: taking it as one
/// finds only overlaps that are real.
fn check_ports(brokers: &[Member]) -> Result<(), String> {
    let mut ranges: Vec<(&Member, u32, u32)> = Vec::with_capacity(brokers.len());
    for b in brokers {
        let shards = b.shards.unwrap_or(1);
        if shards == 0 {
            return Err(format!("broker {:?}: shards must be at least 1", b.id));
        }
        let first = u32::from(b.endpoint.port());
        let last = first + shards - 1;
        if last > u32::from(u16::MAX) {
            return Err(format!(
                "broker {:?}: {shards} shards from port {first} run past port 65535",
                b.id
            ));
        }
        if let Some((other, _, _)) = ranges
            .iter()
            .find(|(o, f, l)| o.endpoint.ip() == b.endpoint.ip() && first <= *l && *f <= last)
        {
            return Err(format!(
                "brokers {:?} ({}) and {:?} ({}) would listen on the same ports",
                other.id, other.endpoint, b.id, b.endpoint
            ));
        }
        ranges.push((b, first, last));
    }
    Ok(())
}

/// How many views before the current one a topology remembers.
pub const HISTORY: usize = 8;

/// The current view and the views before it.
#[derive(Clone, Debug)]
pub struct Views {
    /// The topology version of `current`.
    pub version: u64,
    pub current: Arc<ClusterView>,
    /// Views the current one follows, oldest first, each with the version
    /// it was current at: at most [`HISTORY`]. A primary asks the brokers
    /// a journal was routed to in them, and is routed to no more, for
    /// bytes beyond its own head before it gives out offsets (see
    /// `Shard::takeover_sources`). At a start, with version 0, the current
    /// one without this broker, as if the broker had just joined the
    /// cluster (the usual reason a journal's route gains a broker holding
    /// none of it). Views are kept in memory only.
    pub earlier: Vec<(u64, Arc<ClusterView>)>,
}

impl Views {
    /// The earlier views that a journal whose takeover was settled at
    /// version `since` has not asked about: those current after it, or
    /// every one when `since` is 0 (never).
    pub fn since(&self, since: u64) -> impl Iterator<Item = &ClusterView> {
        self.earlier
            .iter()
            .filter(move |(v, _)| since == 0 || *v > since)
            .map(|(_, view)| &**view)
    }

    /// Every view, oldest first and the current one last, as lists of
    /// brokers: what STATS shows.
    pub fn known(&self) -> Vec<&Vec<Member>> {
        let mut known: Vec<&Vec<Member>> = self.earlier.iter().map(|(_, v)| &v.brokers).collect();
        known.push(&self.current.brokers);
        known
    }
}

/// Where shards get the current view. Cheap to poll: readers compare
/// [`Topology::version`] before taking a new snapshot.
pub struct Topology {
    views: RwLock<Views>,
    version: AtomicU64,
    /// In a cluster on etcd, the way to its control thread.
    control: std::sync::OnceLock<crate::cluster::control::ControlHandle>,
}

impl Topology {
    pub fn new(view: ClusterView) -> Arc<Topology> {
        let mut earlier = Vec::new();
        let joined = view.without_me();
        if joined != view {
            earlier.push((0, Arc::new(joined)));
        }
        Arc::new(Topology {
            views: RwLock::new(Views {
                version: 1,
                current: Arc::new(view),
                earlier,
            }),
            version: AtomicU64::new(1),
            control: std::sync::OnceLock::new(),
        })
    }

    /// Hands the shards the way to the control thread of a cluster on etcd.
    pub fn set_control(&self, control: crate::cluster::control::ControlHandle) {
        assert!(
            self.control.set(control).is_ok(),
            "one control thread per broker"
        );
    }

    /// The control thread, in a cluster on etcd.
    pub fn control(&self) -> Option<&crate::cluster::control::ControlHandle> {
        self.control.get()
    }

    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    pub fn snapshot(&self) -> Arc<ClusterView> {
        self.views().current
    }

    /// The current view and the ones before it, taken together.
    pub fn views(&self) -> Views {
        self.views.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Installs a new view if it differs; returns whether it did. The
    /// view it replaces joins the earlier ones.
    pub fn set(&self, view: ClusterView) -> bool {
        let mut cur = self.views.write().unwrap_or_else(|p| p.into_inner());
        if *cur.current == view {
            return false;
        }
        let old = std::mem::replace(&mut cur.current, Arc::new(view));
        let old_version = cur.version;
        cur.earlier.push((old_version, old));
        if cur.earlier.len() > HISTORY {
            cur.earlier.remove(0);
        }
        cur.version += 1;
        self.version.store(cur.version, Ordering::Release);
        true
    }
}

/// Makes `specs` hold exactly the journals a cluster file lists: those
/// new or changed are set at the store's next revision, those it no longer
/// lists are deleted (their shards then delete the journals' files).
pub fn mirror_specs(specs: &crate::specs::SpecStore, listed: Vec<rotary_net::spec::JournalSpec>) {
    let names: std::collections::HashSet<String> = listed.iter().map(|s| s.name.clone()).collect();
    let changed: Vec<rotary_net::spec::JournalSpec> = listed
        .into_iter()
        .filter(|s| specs.get(&s.name).as_ref() != Some(s))
        .collect();
    if !changed.is_empty() {
        let revision = specs.next_revision();
        match specs.apply_at(changed, revision) {
            Ok(n) => tracing::info!(
                journals = n,
                revision,
                "took journal specs from the cluster file"
            ),
            Err(e) => {
                tracing::error!(error = %e, "could not record the cluster file's journal specs")
            }
        }
    }
    let gone: Vec<crate::specs::Deletion> = specs
        .all()
        .into_iter()
        .filter(|s| !names.contains(&s.name))
        .map(|s| crate::specs::Deletion {
            name: s.name,
            revision: specs.next_revision(),
        })
        .collect();
    if !gone.is_empty() {
        match specs.delete_each(gone) {
            Ok(names) => {
                tracing::info!(journals = ?names, "deleted journals the cluster file no longer lists")
            }
            Err(e) => {
                tracing::error!(error = %e, "could not delete journals the cluster file no longer lists")
            }
        }
    }
}

/// Re-reads the cluster file every second when it changed (its
/// modification time, inode or size), and at once on SIGHUP, and installs
/// its brokers in `topology` and its journals in `specs`. The first look,
/// a second after the start, always reads it: the file may have changed
/// between the start's own read and this watcher's. A file that fails to
/// parse keeps the previous view and specs (and is logged).
pub fn watch_cluster_file(
    topology: Arc<Topology>,
    specs: Arc<crate::specs::SpecStore>,
    path: PathBuf,
    me: String,
) {
    use std::os::unix::fs::MetadataExt;
    let hup = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let _ = signal_hook::flag::register(signal_hook::consts::SIGHUP, hup.clone());
    let mtime = |p: &Path| {
        std::fs::metadata(p)
            .and_then(|m| Ok((m.modified()?, m.ino(), m.len())))
            .ok()
    };
    let mut seen: Option<(SystemTime, u64, u64)> = None;
    std::thread::Builder::new()
        .name("rotary-cluster-watch".into())
        .spawn(move || loop {
            for _ in 0..10 {
                std::thread::sleep(Duration::from_millis(100));
                if hup.load(Ordering::Relaxed) {
                    break;
                }
            }
            let forced = hup.swap(false, Ordering::Relaxed);
            let now = mtime(&path);
            if !forced && now == seen {
                continue;
            }
            seen = now;
            match parse_cluster_file(&path, &me) {
                Ok(file) => take_file(&topology, &specs, file, &path),
                Err(e) => tracing::error!(error = %e, "keeping the previous cluster view"),
            }
        })
        .expect("spawn the cluster file watcher");
}

/// Installs what a cluster file says: its specs first, so that a journal
/// new in both is known by the time its route is.
fn take_file(topology: &Topology, specs: &crate::specs::SpecStore, file: FromFile, path: &Path) {
    mirror_specs(specs, file.specs);
    let listed = file.view.me().is_some();
    let me = file.view.me.clone();
    if topology.set(file.view) {
        tracing::info!(file = %path.display(), "cluster file changed; routes recomputed");
        if !listed {
            tracing::warn!(id = %me, "this broker is no longer in the cluster file: it is in no route and proxies every journal request");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(n: usize, zones: &[&str]) -> ClusterView {
        ClusterView {
            me: "b1".into(),
            brokers: (0..n)
                .map(|i| Member {
                    id: format!("b{}", i + 1),
                    zone: zones[i % zones.len()].into(),
                    endpoint: format!("127.0.0.1:{}", 7000 + 10 * i).parse().unwrap(),
                    shards: None,
                })
                .collect(),
            assigned: None,
        }
    }

    fn ids(v: &ClusterView) -> Vec<String> {
        v.brokers.iter().map(|m| m.id.clone()).collect()
    }

    #[test]
    fn views_replaced_are_kept_with_the_version_they_were_current_at() {
        let t = Topology::new(view(3, &["a"]));
        // At a start: the current view without this broker, at version 0.
        let v = t.views();
        assert_eq!((v.version, t.version()), (1, 1));
        assert_eq!(v.earlier.len(), 1);
        assert_eq!(
            (v.earlier[0].0, ids(&v.earlier[0].1)),
            (0, vec!["b2".into(), "b3".into()])
        );
        assert!(!t.set(view(3, &["a"])), "an equal view is no change");
        assert_eq!(t.version(), 1);
        assert!(t.set(view(4, &["a"])));
        assert!(t.set(view(2, &["a"])));
        let v = t.views();
        assert_eq!((v.version, t.version()), (3, 3));
        assert_eq!(ids(&v.current), ["b1", "b2"]);
        let at: Vec<(u64, usize)> = v
            .earlier
            .iter()
            .map(|(n, e)| (*n, e.brokers.len()))
            .collect();
        assert_eq!(at, [(0, 2), (1, 3), (2, 4)]);
        // A journal settled at version 1 has yet to ask about version 2's
        // view; one never settled, about all of them.
        assert_eq!(v.since(1).map(|e| e.brokers.len()).collect::<Vec<_>>(), [4]);
        assert_eq!(v.since(0).count(), 3);
        assert_eq!(v.since(3).count(), 0);
        // At most HISTORY are kept, the oldest dropped first.
        for n in 0..2 * HISTORY {
            t.set(view(5 + n % 2, &["a"]));
        }
        let v = t.views();
        assert_eq!(v.earlier.len(), HISTORY);
        assert_eq!(v.earlier.last().unwrap().0, v.version - 1);
        // A single node has no one to take journals over from.
        let single = ClusterView::single("127.0.0.1:1".parse().unwrap());
        assert!(single.without_me().route("j", 1).members.is_empty());
    }

    /// A change made between the start's read of the file and the
    /// watcher's start is still seen, and so is a replacement of the file
    /// that keeps its modification time.
    #[test]
    fn the_watcher_sees_every_change_of_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cluster.yaml");
        let line = |i: usize| {
            format!(
                "  - {{id: b{i}, zone: z{i}, endpoint: 127.0.0.1:{}}}\n",
                7000 + i
            )
        };
        let write = |ids: &[usize]| {
            let text: String = std::iter::once("brokers:\n".to_string())
                .chain(ids.iter().map(|&i| line(i)))
                .chain(std::iter::once("journals:\n".to_string()))
                .chain(ids.iter().map(|&i| format!("  - {{name: ww/{i}}}\n")))
                .collect();
            let tmp = dir.path().join("cluster.yaml.new");
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, &p).unwrap();
        };
        let wait_for = |t: &Topology, n: usize| {
            let deadline = crate::clock::now() + Duration::from_secs(10);
            while t.views().current.brokers.len() != n {
                assert!(
                    crate::clock::now() < deadline,
                    "the watcher did not see a file of {n} brokers: {:?}",
                    ids(&t.views().current)
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        write(&[1, 2]);
        let t = Topology::new(load_cluster_file(&p, "b1").unwrap().view);
        let specs_dir = tempfile::tempdir().unwrap();
        let specs =
            Arc::new(crate::specs::SpecStore::open(specs_dir.path().join("specs.json")).unwrap());
        specs
            .apply_at(vec![rotary_net::spec::JournalSpec::new("ww/9")], 1)
            .unwrap();
        write(&[1, 2, 3]);
        watch_cluster_file(t.clone(), specs.clone(), p.clone(), "b1".into());
        wait_for(&t, 3);
        // The file's journals, and only those: the store's own is gone.
        let names = |s: &crate::specs::SpecStore| -> Vec<String> {
            s.all().into_iter().map(|s| s.name).collect()
        };
        assert_eq!(names(&specs), ["ww/1", "ww/2", "ww/3"]);
        let mtime = std::fs::metadata(&p).unwrap().modified().unwrap();
        write(&[1, 2, 3, 4]);
        std::fs::File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        wait_for(&t, 4);
        assert_eq!(names(&specs), ["ww/1", "ww/2", "ww/3", "ww/4"]);
        write(&[1, 3]);
        wait_for(&t, 2);
        assert_eq!(names(&specs), ["ww/1", "ww/3"]);
    }

    #[test]
    fn routes_are_deterministic_distinct_and_spread() {
        let v = view(5, &["a", "b", "c"]);
        let mut primaries = std::collections::HashMap::new();
        for i in 0..300 {
            let name = format!("orders/part-{i:03}");
            let r = v.route(&name, 3);
            assert_eq!(r, v.route(&name, 3));
            assert_eq!(r.members.len(), 3);
            let zones: std::collections::HashSet<_> =
                r.members.iter().map(|m| m.zone.clone()).collect();
            assert_eq!(zones.len(), 3, "one member per zone when zones allow");
            *primaries.entry(r.members[0].id.clone()).or_insert(0) += 1;
            // A smaller replication takes a prefix-consistent primary.
            assert_eq!(v.route(&name, 1).members[0], r.members[0]);
        }
        assert_eq!(primaries.len(), 5, "every broker is some journal's primary");
        assert!(primaries.values().all(|&n| n > 20), "{primaries:?}");
    }

    #[test]
    fn too_few_brokers_is_an_incomplete_route() {
        let v = view(2, &["a", "b"]);
        let r = v.route("j", 3);
        assert_eq!(r.members.len(), 2);
        assert!(!r.is_complete());
        let single = ClusterView::single("127.0.0.1:1".parse().unwrap());
        let r = single.route("j", 3);
        assert!(r.is_complete() && r.is_primary(LOCAL_BROKER));
    }

    #[test]
    fn cluster_files_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cluster.yaml");
        // Writes the file, then loads it as broker `me` would.
        let load = |yaml: &str, me: &str| {
            std::fs::write(&p, yaml).unwrap();
            load_cluster_file(&p, me)
        };
        let two = "brokers:\n  - {id: b1, zone: a, endpoint: 127.0.0.1:7401}\n  - {id: b2, zone: b, endpoint: 127.0.0.1:7411}\n";
        let v = load(two, "b2").unwrap().view;
        assert_eq!(v.brokers.len(), 2);
        assert_eq!(v.me().unwrap().endpoint.port(), 7411);
        assert!(load_cluster_file(&p, "b9")
            .unwrap_err()
            .contains("no broker"));
        // Re-read while running, a file without this broker leaves it in no route.
        let gone = parse_cluster_file(&p, "b9").unwrap().view;
        assert!(gone.me().is_none());
        assert!(!gone.route("j", 2).contains("b9"));
        let twice = "brokers:\n  - {id: b1, endpoint: 127.0.0.1:7401}\n  - {id: b1, endpoint: 127.0.0.1:7411}\n";
        assert!(load(twice, "b1").unwrap_err().contains("twice"));
        // Each broker's shards need ports of their own.
        for (brokers, why) in [
            (
                "  - {id: b1, endpoint: 127.0.0.1:7401}\n  - {id: b2, endpoint: 127.0.0.1:7401}\n",
                "same ports",
            ),
            (
                "  - {id: b1, endpoint: 127.0.0.1:7401, shards: 4}\n  - {id: b2, endpoint: 127.0.0.1:7404}\n",
                "same ports",
            ),
            (
                "  - {id: b1, endpoint: 127.0.0.1:7401}\n  - {id: b2, endpoint: 127.0.0.1:7398, shards: 4}\n",
                "same ports",
            ),
            ("  - {id: b1, endpoint: 127.0.0.1:7401, shards: 0}\n", "at least 1"),
            ("  - {id: b1, endpoint: 127.0.0.1:65534, shards: 3}\n", "past port 65535"),
        ] {
            let e = load(&format!("brokers:\n{brokers}"), "b1").unwrap_err();
            assert!(e.contains(why), "{brokers}: {e}");
        }
        // Next to each other, or on other addresses, they are fine.
        let apart = "brokers:\n  - {id: b1, endpoint: 127.0.0.1:7401, shards: 4}\n  - {id: b2, endpoint: 127.0.0.1:7405}\n  - {id: b3, endpoint: 127.0.0.2:7401}\n";
        assert_eq!(load(apart, "b1").unwrap().view.brokers.len(), 3);
        assert!(load(
            "brokers:\n  - {id: b1, endpoint: 127.0.0.1:7401, port: 3}\n",
            "b1"
        )
        .is_err());
        // Journals: valid specs, each named once.
        let brokers = "brokers:\n  - {id: b1, endpoint: 127.0.0.1:7401}\n";
        for (journals, why) in [
            ("  - {name: aa/bb}\n  - {name: aa/bb}\n", "appears twice"),
            ("  - {name: aa/bb, replication: 0}\n", "aa/bb"),
            ("  - {name: \"aa bb\"}\n", "aa bb"),
            ("  - {name: aa/bb, colour: red}\n", "colour"),
        ] {
            let e = load(&format!("{brokers}journals:\n{journals}"), "b1").unwrap_err();
            assert!(e.contains(why), "{journals}: {e}");
        }
        std::fs::write(
            &p,
            format!(
                "{brokers}journals:\n  - {{name: aa/bb, replication: 2}}\n  - {{name: aa/cc}}\n"
            ),
        )
        .unwrap();
        let file = load_cluster_file(&p, "b1").unwrap();
        let named: Vec<(&str, u32)> = file
            .specs
            .iter()
            .map(|s| (s.name.as_str(), s.replication))
            .collect();
        assert_eq!(named, [("aa/bb", 2), ("aa/cc", 1)]);
    }
}
