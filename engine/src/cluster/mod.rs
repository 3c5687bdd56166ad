//! The cluster on etcd.
//!
//! etcd is the cluster's one source of truth: journal specs
//! (`items/<journal>`), members (`members/<zone>#<id>`, under each broker's
//! lease) and assignments (`assign/<journal>#<zone>#<id>#<slot>`, under the
//! assigned broker's lease, slot 0 the primary). One thread per broker, the
//! control thread (`rotary-etcd`), owns the broker's session: it keeps the
//! lease alive, watches the prefix, hands the shards a new
//! [`crate::topology::ClusterView`] when members or assignments change and
//! the spec store every change of the items, runs the allocator while this
//! broker leads, and carries out the shards' requests that change etcd
//! (APPLY, DELETE, the routes primaries synchronized). Shards never wait on
//! etcd on the data path: they route by the last view they were handed.

pub mod control;
pub mod fence;
pub mod member;
pub mod session;
pub mod state;

use std::net::SocketAddr;
use std::time::Duration;

/// Journals a broker holds at most unless `--journal-limit` says otherwise.
pub const JOURNAL_LIMIT_DEFAULT: u32 = 1024;

/// How a broker joins a cluster on etcd.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// etcd client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Key prefix of the cluster, without a trailing `/`.
    pub prefix: String,
    /// This broker's member id.
    pub id: String,
    pub zone: String,
    /// Shard 0's address as other brokers and clients reach it.
    pub advertise: SocketAddr,
    pub lease_ttl: Duration,
    pub journal_limit: u32,
}

impl EtcdConfig {
    /// Refuses ids, zones and prefixes that would not survive the key
    /// layout (a `#` in an id or zone splits the key differently).
    pub fn check(&self) -> Result<(), String> {
        if self.endpoints.iter().any(|e| e.is_empty()) || self.endpoints.is_empty() {
            return Err("--etcd: give one or more endpoint URLs".into());
        }
        for (what, v) in [("--id", &self.id), ("--zone", &self.zone)] {
            if v.contains(['#', '/']) || v.chars().any(char::is_whitespace) {
                return Err(format!("{what} {v:?}: no '#', '/' or white space"));
            }
        }
        if self.id.is_empty() || self.id == crate::topology::LOCAL_BROKER {
            return Err(format!("--id {:?} is not allowed", self.id));
        }
        if !self.prefix.starts_with('/') || self.prefix.ends_with('/') {
            return Err(format!(
                "--etcd-prefix {:?}: starts with '/' and does not end with one",
                self.prefix
            ));
        }
        Ok(())
    }

    /// The prefix every key of the cluster starts with, ending in `/`.
    pub fn key_prefix(&self) -> String {
        format!("{}/", self.prefix)
    }
}

/// Milliseconds on the calling thread's clock (`crate::clock`), from the
/// first call in the process.
pub fn now_ms() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(crate::clock::now);
    crate::clock::now()
        .saturating_duration_since(epoch)
        .as_millis() as u64
}

/// A broker's place in the cluster: the control thread, started but not
/// yet announced, and what shards need of it.
pub struct Cluster {
    pub handle: control::ControlHandle,
    /// The view read at the start, for the shards' first routes.
    pub view: crate::topology::ClusterView,
    go: Option<std::sync::mpsc::SyncSender<Go>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What the control thread is handed to become a member: the shards'
/// topology, and where to say whether the member key was written.
type Go = (
    std::sync::Arc<crate::topology::Topology>,
    std::sync::mpsc::SyncSender<Result<(), control::ControlError>>,
);

/// How long a start waits for etcd before it gives up.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

impl Cluster {
    /// Connects to etcd, takes a lease and reads the keyspace (mirroring
    /// its items into `specs`), on the control thread; returns once that is
    /// done, before this broker is a member. [`Cluster::announce`] makes it
    /// one, once its shards listen.
    pub fn connect(
        config: EtcdConfig,
        shards: u32,
        specs: std::sync::Arc<crate::specs::SpecStore>,
    ) -> Result<Cluster, crate::EngineError> {
        let (requests_tx, requests_rx) = async_channel::bounded(control::REQUESTS_QUEUED_MAX);
        let fence = std::sync::Arc::new(fence::Fence::new(config.lease_ttl));
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let (go_tx, go_rx) = std::sync::mpsc::sync_channel(1);
        let thread_fence = fence.clone();
        let thread = std::thread::Builder::new()
            .name("rotary-etcd".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("the control thread's runtime");
                rt.block_on(async move {
                    let session =
                        match session::Session::open(config, shards, specs, thread_fence).await {
                            Ok(s) => s,
                            Err(e) => {
                                let _ = ready_tx.send(Err(e));
                                return;
                            }
                        };
                    let _ = ready_tx.send(Ok(session.keyspace.view(&session.config.id)));
                    let Ok((topology, announced)) = go_rx.recv() else {
                        return;
                    };
                    session
                        .announce_and_run(topology, announced, requests_rx)
                        .await;
                });
            })
            .map_err(|e| crate::EngineError::Thread("etcd control", e))?;
        let view = ready_rx.recv().map_err(|_| control::ControlError::Gone)??;
        Ok(Cluster {
            handle: control::ControlHandle::new(requests_tx, fence),
            view,
            go: Some(go_tx),
            thread: Some(thread),
        })
    }

    /// Makes this broker a member and starts the session's loop; returns
    /// once the member key is written.
    pub fn announce(
        &mut self,
        topology: std::sync::Arc<crate::topology::Topology>,
    ) -> Result<(), crate::EngineError> {
        let go = self.go.take().expect("announced once");
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        go.send((topology, tx))
            .map_err(|_| control::ControlError::Gone)?;
        Ok(rx.recv().map_err(|_| control::ControlError::Gone)??)
    }

    /// Marks this member exiting and waits, up to `timeout`, until the
    /// allocator has moved every journal it held to other brokers. Returns
    /// how many it still holds.
    pub fn drain(&self, timeout: Duration) -> usize {
        let give_up = now_ms() + timeout.as_millis() as u64;
        let h = &self.handle;
        if let Err(e) = futures_executor_block_on(h.drain()) {
            tracing::warn!(error = %e, "could not mark the member exiting");
            return usize::MAX;
        }
        loop {
            match futures_executor_block_on(h.holding()) {
                Ok(0) => return 0,
                Ok(n) if now_ms() >= give_up => return n,
                Err(_) => return usize::MAX,
                Ok(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    /// Ends the session: the loop revokes the lease on its way out.
    pub fn stop(mut self) {
        self.handle.close();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits for a future on the calling (non-async) thread.
fn futures_executor_block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime to wait on")
        .block_on(f)
}

/// The folder of a data directory that local journal data is moved to
/// when a broker of a cluster on etcd starts.
pub const RETIRED_DIR: &str = "retired";

/// Moves the shards' journal data of an earlier run (`shard-<n>/`) aside,
/// into `retired/` (replacing what an earlier start put there), before a
/// broker of a cluster on etcd starts: it joins as a new member holding
/// nothing. Every acknowledged byte of a journal is on its other members
/// (a primary is only ever a member that held every acknowledged byte) or
/// in its store; what only this broker held past that was never
/// acknowledged and must not come back once other brokers appended at
/// those offsets. Returns how many shard directories moved.
pub fn retire_local_journals(dir: &std::path::Path) -> Result<usize, crate::EngineError> {
    let io = |p: &std::path::Path, e| crate::EngineError::Io(p.to_path_buf(), e);
    let retired = dir.join(RETIRED_DIR);
    let mut shards = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
        let entry = entry.map_err(|e| io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("shard-") && entry.path().is_dir() {
            shards.push(name);
        }
    }
    if shards.is_empty() {
        return Ok(0);
    }
    if retired.exists() {
        std::fs::remove_dir_all(&retired).map_err(|e| io(&retired, e))?;
    }
    std::fs::create_dir_all(&retired).map_err(|e| io(&retired, e))?;
    for name in &shards {
        let to = retired.join(name);
        std::fs::rename(dir.join(name), &to).map_err(|e| io(&to, e))?;
    }
    tracing::info!(shards = shards.len(), to = %retired.display(), "moved the journal data of the previous run aside: a broker joins a cluster on etcd holding nothing");
    Ok(shards.len())
}
