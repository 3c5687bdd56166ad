//! Cluster membership and journal routes.
//!
//! A [`Topology`] hands shards immutable [`ClusterView`] snapshots. This
//! module's source is a static cluster file, re-read when it changes; a
//! broker without one is a cluster of itself. Routes are computed, not
//! stored: every broker with the same view computes the same route for a
//! journal, so no coordination is needed to agree on them.

use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    fn assigned_route(&self, assigned: &Assigned, journal: &str, replication: u32) -> Route {
        let slots = assigned.routes.get(journal).map(Vec::as_slice);
        let members: Vec<Member> = match slots {
            Some([Some(primary), ..]) if self.member(primary).is_some() => slots
                .unwrap_or_default()
                .iter()
                .flatten()
                .filter_map(|id| self.member(id).cloned())
                .collect(),
            _ => Vec::new(),
        };
        Route {
            members,
            replication: replication as usize,
        }
    }
}

/// Parses a cluster file and checks that `me` is in it.
pub fn load_cluster_file(path: &Path, me: &str) -> Result<ClusterView, String> {
    let view = parse_cluster_file(path, me)?;
    if view.me().is_none() {
        return Err(format!(
            "cluster file {}: no broker with id {me:?}",
            path.display()
        ));
    }
    Ok(view)
}

/// Parses a cluster file; `me` need not be in it (a broker removed from
/// the cluster is in no route, and proxies every request to the members).
fn parse_cluster_file(path: &Path, me: &str) -> Result<ClusterView, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cluster file {}: {e}", path.display()))?;
    let file: ClusterFile =
        serde_yaml::from_str(&text).map_err(|e| format!("cluster file {}: {e}", path.display()))?;
    let mut seen = std::collections::HashSet::new();
    for b in &file.brokers {
        if b.id.is_empty() || b.id == LOCAL_BROKER || b.id.contains(char::is_whitespace) {
            return Err(format!(
                "cluster file {}: broker id {:?} is not allowed",
                path.display(),
                b.id
            ));
        }
        if !seen.insert(b.id.clone()) {
            return Err(format!(
                "cluster file {}: broker id {:?} appears twice",
                path.display(),
                b.id
            ));
        }
    }
    check_ports(&file.brokers).map_err(|e| format!("cluster file {}: {e}", path.display()))?;
    Ok(ClusterView {
        me: me.to_string(),
        brokers: file.brokers,
        assigned: None,
    })
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
    /// `Shard::takeover_sources`). At a start, with version 0, they are the
    /// views this broker remembers from before it stopped (see
    /// [`Topology::remember_in`]) and the current one without this broker,
    /// as if the broker had just joined the cluster (the usual reason a
    /// journal's route gains a broker holding none of it). Views learned
    /// from peers as the broker starts ([`Topology::learn`]) come first,
    /// with the version at which they were learned.
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
    /// brokers: what `cluster-views.json` holds and STATS shows.
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
    /// Where the views are written when they change.
    memory: Option<PathBuf>,
    /// Whether every peer has been asked once for the views it knows since
    /// this broker started (see [`Topology::learn`]); takeovers wait for it.
    peers_asked: AtomicBool,
    /// In a cluster on etcd, the way to its control thread.
    control: std::sync::OnceLock<crate::cluster::control::ControlHandle>,
}

impl Topology {
    pub fn new(view: ClusterView) -> Arc<Topology> {
        Arc::new(Topology::starting(view, Vec::new(), None))
    }

    /// A topology that remembers its views in `path` (a file in the data
    /// directory), and starts from what it remembered there. A file that
    /// is missing or unreadable is no history: it is logged and replaced.
    pub fn remember_in(view: ClusterView, path: PathBuf) -> Arc<Topology> {
        let remembered = match std::fs::read(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            read => read.map_err(|e| e.to_string()).and_then(|bytes| {
                serde_json::from_slice::<Vec<Vec<Member>>>(&bytes).map_err(|e| e.to_string())
            }),
        };
        let remembered = remembered.unwrap_or_else(|e| {
            tracing::warn!(file = %path.display(), error = %e, "the cluster views remembered are unreadable; starting without them");
            Vec::new()
        });
        let remembered = remembered
            .into_iter()
            .map(|brokers| ClusterView {
                me: view.me.clone(),
                brokers,
                assigned: None,
            })
            .collect();
        let t = Topology::starting(view, remembered, Some(path));
        t.write_memory();
        Arc::new(t)
    }

    fn starting(
        view: ClusterView,
        remembered: Vec<ClusterView>,
        memory: Option<PathBuf>,
    ) -> Topology {
        let mut earlier: Vec<(u64, Arc<ClusterView>)> = Vec::new();
        for v in remembered.into_iter().chain([view.without_me()]) {
            if v != view && !earlier.iter().any(|(_, e)| **e == v) {
                earlier.push((0, Arc::new(v)));
            }
        }
        let keep_from = earlier.len().saturating_sub(HISTORY);
        earlier.drain(..keep_from);
        Topology {
            peers_asked: AtomicBool::new(view.is_single()),
            views: RwLock::new(Views {
                version: 1,
                current: Arc::new(view),
                earlier,
            }),
            version: AtomicU64::new(1),
            memory,
            control: std::sync::OnceLock::new(),
        }
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
        {
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
        }
        self.write_memory();
        true
    }

    /// Takes views a peer has known (its earlier ones and its current one,
    /// as its STATS list them) as earlier views of this broker: a broker
    /// that starts after a change, or for the first time, learns of the
    /// brokers that journals left in it, which it never saw itself. Views
    /// already known are skipped; the others go before this broker's own
    /// (the first to be forgotten past [`HISTORY`]), at a new version, so
    /// that journals taken over already ask about them too. Returns how
    /// many were new.
    pub fn learn(&self, views: Vec<Vec<Member>>) -> usize {
        let learned = {
            let mut cur = self.views.write().unwrap_or_else(|p| p.into_inner());
            let mut new: Vec<(u64, Arc<ClusterView>)> = Vec::new();
            for brokers in views {
                let view = ClusterView {
                    me: cur.current.me.clone(),
                    brokers,
                    assigned: None,
                };
                let known = view == *cur.current
                    || cur.earlier.iter().any(|(_, e)| **e == view)
                    || new.iter().any(|(_, e)| **e == view);
                if !known {
                    new.push((cur.version + 1, Arc::new(view)));
                }
            }
            let learned = new.len();
            if learned > 0 {
                new.append(&mut cur.earlier);
                let keep_from = new.len().saturating_sub(HISTORY);
                new.drain(..keep_from);
                cur.earlier = new;
                cur.version += 1;
                self.version.store(cur.version, Ordering::Release);
            }
            learned
        };
        if learned > 0 {
            self.write_memory();
        }
        learned
    }

    /// Records that every peer has been asked once for its views (whether
    /// it answered or not).
    pub fn mark_peers_asked(&self) {
        self.peers_asked.store(true, Ordering::Release);
    }

    pub fn peers_asked(&self) -> bool {
        self.peers_asked.load(Ordering::Acquire)
    }

    /// Writes the views this broker has known (with those it assumed at
    /// its start), oldest first and the current one last, so that a
    /// restart after a change made while it was down still asks the
    /// brokers a journal left.
    fn write_memory(&self) {
        let Some(path) = &self.memory else {
            return;
        };
        let result = serde_json::to_vec(&self.views().known())
            .map_err(std::io::Error::other)
            .and_then(|bytes| {
                let tmp = path.with_extension("tmp");
                std::fs::write(&tmp, bytes)?;
                std::fs::File::open(&tmp)?.sync_all()?;
                std::fs::rename(&tmp, path)
            });
        if let Err(e) = result {
            tracing::warn!(file = %path.display(), error = %e, "could not write the cluster views down; a restart may not know brokers that journals left");
        }
    }
}

/// Re-reads the cluster file every second when it changed (its
/// modification time, inode or size), and at once on SIGHUP. The first
/// look, a second after the start, always reads it: the file may have
/// changed between the start's own read and this watcher's. A file that
/// fails to parse keeps the previous view (and is logged).
pub fn watch_cluster_file(topology: Arc<Topology>, path: PathBuf, me: String) {
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
                Ok(view) => {
                    let listed = view.me().is_some();
                    if topology.set(view) {
                        tracing::info!(file = %path.display(), "cluster file changed; routes recomputed");
                        if !listed {
                            tracing::warn!(id = %me, "this broker is no longer in the cluster file: it is in no route and proxies every journal request");
                        }
                    }
                }
                Err(e) => tracing::error!(error = %e, "keeping the previous cluster view"),
            }
        })
        .expect("spawn the cluster file watcher");
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

    #[test]
    fn views_are_remembered_across_a_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("views.json");
        let t = Topology::remember_in(view(3, &["a"]), path.clone());
        t.set(view(4, &["a"]));
        drop(t);
        // Started again with b4 gone from the file: the views it knew come
        // first, then the current one without it, all as before version 1.
        let t = Topology::remember_in(view(3, &["a"]), path.clone());
        let v = t.views();
        assert_eq!(ids(&v.current), ["b1", "b2", "b3"]);
        let earlier: Vec<(u64, Vec<String>)> =
            v.earlier.iter().map(|(n, e)| (*n, ids(e))).collect();
        assert_eq!(
            earlier,
            [
                (0, vec!["b2".into(), "b3".into()]),
                (0, vec!["b1".into(), "b2".into(), "b3".into(), "b4".into()]),
            ],
            "the view at the first start equals the current one: left out"
        );
        // Each view remembered keeps this broker's own id.
        assert!(v.earlier.iter().all(|(_, e)| e.me == "b1"));
        // An unreadable file is no history, and is written afresh.
        std::fs::write(&path, b"{not json").unwrap();
        let t = Topology::remember_in(view(2, &["a"]), path.clone());
        assert_eq!(t.views().earlier.len(), 1);
        let kept: Vec<Vec<Member>> =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(
            kept.len(),
            2,
            "the assumed view before, and the current one"
        );
    }

    #[test]
    fn views_learned_from_a_peer_are_asked_about_by_every_journal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("views.json");
        // A first start: only the current view without this broker.
        let t = Topology::remember_in(view(3, &["a"]), path.clone());
        t.set(view(2, &["a"]));
        let before = t.version();
        // A peer knew b4 (and the views this broker knows already).
        let peer = [view(4, &["a"]), view(3, &["a"]), view(2, &["a"])];
        let peer = || peer.iter().map(|v| v.brokers.clone()).collect::<Vec<_>>();
        assert_eq!(t.learn(peer()), 1, "only the view with b4 is new");
        assert_eq!(t.learn(peer()), 0, "learned once");
        let v = t.views();
        assert_eq!(
            v.version,
            before + 1,
            "a new version: settled journals ask again"
        );
        assert_eq!(ids(&v.current), ["b1", "b2"], "the current view stays");
        assert_eq!(
            ids(&v.earlier[0].1),
            ["b1", "b2", "b3", "b4"],
            "learned ones come first"
        );
        assert_eq!(v.earlier[0].0, v.version);
        assert_eq!(v.earlier[0].1.me, "b1");
        // A journal settled before the learning asks about it; one settled
        // after, does not.
        let asked: Vec<usize> = v.since(before).map(|e| e.brokers.len()).collect();
        assert_eq!(asked, [4]);
        assert_eq!(v.since(v.version).count(), 0);
        // Remembered across a start.
        drop(t);
        let t = Topology::remember_in(view(2, &["a"]), path.clone());
        assert!(t.views().earlier.iter().any(|(_, e)| e.brokers.len() == 4));
        // Past HISTORY, the learned views are the first forgotten.
        let many: Vec<Vec<Member>> = (5..5 + 2 * HISTORY)
            .map(|n| view(n, &["a"]).brokers)
            .collect();
        t.learn(many);
        let v = t.views();
        assert_eq!(v.earlier.len(), HISTORY);
        assert_eq!(
            v.earlier
                .iter()
                .map(|(_, e)| e.brokers.len())
                .collect::<Vec<_>>()[HISTORY - 4..],
            [4, 2, 3, 1],
            "this broker's own views are kept over the learned ones"
        );
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
        let t = Topology::new(load_cluster_file(&p, "b1").unwrap());
        write(&[1, 2, 3]);
        watch_cluster_file(t.clone(), p.clone(), "b1".into());
        wait_for(&t, 3);
        let mtime = std::fs::metadata(&p).unwrap().modified().unwrap();
        write(&[1, 2, 3, 4]);
        std::fs::File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        wait_for(&t, 4);
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
        std::fs::write(
            &p,
            "brokers:\n  - {id: b1, zone: a, endpoint: 127.0.0.1:7401}\n  - {id: b2, zone: b, endpoint: 127.0.0.1:7411}\n",
        )
        .unwrap();
        let v = load_cluster_file(&p, "b2").unwrap();
        assert_eq!(v.brokers.len(), 2);
        assert_eq!(v.me().unwrap().endpoint.port(), 7411);
        assert!(load_cluster_file(&p, "b9")
            .unwrap_err()
            .contains("no broker"));
        // Re-read while running, a file without this broker leaves it in no route.
        let gone = parse_cluster_file(&p, "b9").unwrap();
        assert!(gone.me().is_none());
        assert!(!gone.route("j", 2).contains("b9"));
        std::fs::write(
            &p,
            "brokers:\n  - {id: b1, endpoint: 127.0.0.1:7401}\n  - {id: b1, endpoint: 127.0.0.1:7411}\n",
        )
        .unwrap();
        assert!(load_cluster_file(&p, "b1").unwrap_err().contains("twice"));
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
            std::fs::write(&p, format!("brokers:\n{brokers}")).unwrap();
            let e = load_cluster_file(&p, "b1").unwrap_err();
            assert!(e.contains(why), "{brokers}: {e}");
        }
        // Next to each other, or on other addresses, they are fine.
        std::fs::write(
            &p,
            "brokers:\n  - {id: b1, endpoint: 127.0.0.1:7401, shards: 4}\n  - {id: b2, endpoint: 127.0.0.1:7405}\n  - {id: b3, endpoint: 127.0.0.2:7401}\n",
        )
        .unwrap();
        assert_eq!(load_cluster_file(&p, "b1").unwrap().brokers.len(), 3);
        std::fs::write(
            &p,
            "brokers:\n  - {id: b1, endpoint: 127.0.0.1:7401, port: 3}\n",
        )
        .unwrap();
        assert!(load_cluster_file(&p, "b1").is_err());
    }
}
