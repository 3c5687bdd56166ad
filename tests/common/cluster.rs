//! Several `rotary serve --cluster` processes on loopback sharing one
//! cluster file, which lists the brokers and the journals' specs. Each
//! broker keeps its ports and its data directory for the whole test, so a
//! broker killed with SIGKILL comes back as the same member (same id, same
//! endpoint) with whatever its disk kept. The cluster file can be rewritten
//! while the brokers run; they pick changes up by its mtime.
//!
//! Only one cluster runs at a time in a test binary: three or more brokers
//! plus the writers already more than fill the machine, and replication
//! tests kill processes at chosen moments, which starved CPUs blur.
//!
//! Every process is killed by PID when its handle drops (also on panic, when
//! the logs of every run of every broker are printed first; set
//! `ROTARY_TEST_LOGS=1` to print them after a passing test as well).

use super::{kill_with_parent, raw_ping, GRACEFUL_EXIT_TIMEOUT, READY_TIMEOUT};
use rotary_net::client::Client;
use rotary_net::spec::JournalSpec;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Zones of the brokers, in order: `b1` in `a`, `b2` in `b`, …
pub const ZONES: [&str; 6] = ["a", "b", "c", "d", "e", "f"];
/// How often a (re)start is tried when the broker exits at once, e.g.
/// because its port is still held by a connection of its previous run.
pub const SPAWN_ATTEMPTS_MAX: u32 = 10;
/// Lines of each broker log printed when a test fails.
pub const LOG_LINES_ON_PANIC: usize = 400;
/// How long the whole cluster may take to agree on a journal after APPLY.
pub const APPLY_SETTLE_TIMEOUT: Duration = Duration::from_secs(20);

pub static ONE_CLUSTER_AT_A_TIME: Mutex<()> = Mutex::new(());

/// One member of a [`Cluster`]: a fixed id, zone, ports and data directory;
/// the process comes and goes.
pub struct ClusterBroker {
    pub id: String,
    pub zone: String,
    pub cores: usize,
    pub base_port: u16,
    /// Holds the data directory and the logs of every run.
    dir: tempfile::TempDir,
    pub data: PathBuf,
    child: Option<Child>,
    starts: u32,
    cluster_file: PathBuf,
    /// More `rotary serve` arguments, for the next start.
    pub serve_args: Vec<String>,
    /// A cluster on etcd to join instead of the cluster file: the etcd
    /// endpoint and the lease TTL (`3s`).
    pub etcd: Option<(String, String)>,
}

impl ClusterBroker {
    /// Broker `b<i+1>` of zone `ZONES[i]`, with ports and a data directory
    /// of its own, not started.
    pub fn new(i: usize, cores: usize, cluster_file: PathBuf) -> ClusterBroker {
        let bdir = tempfile::Builder::new()
            .prefix(&format!("rotary-b{}-", i + 1))
            .tempdir()
            .expect("temp dir");
        ClusterBroker {
            id: format!("b{}", i + 1),
            zone: ZONES[i].to_string(),
            cores,
            base_port: super::free_port_range(cores),
            data: bdir.path().join("data"),
            dir: bdir,
            child: None,
            starts: 0,
            cluster_file,
            serve_args: Vec::new(),
            etcd: None,
        }
    }

    /// Shard 0's endpoint, as the cluster file names it.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.base_port)
    }

    pub fn shard_endpoint(&self, shard: usize) -> String {
        format!("127.0.0.1:{}", usize::from(self.base_port) + shard)
    }

    fn log_path(&self, start: u32) -> PathBuf {
        self.dir.path().join(format!("{}-run-{start}.log", self.id))
    }

    /// The current (or last) run's stdout and stderr.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path(self.starts)).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Starts the process and waits until every shard answers PING. A run
    /// that exits before it is ready (its port briefly busy after a kill)
    /// is retried a few times; the last failure fails the test.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "{} already running", self.id);
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.spawn_once() {
                Ok(()) => return,
                Err(why) if attempt < SPAWN_ATTEMPTS_MAX => {
                    eprintln!(
                        "{}: start attempt {attempt} failed ({why}); retrying",
                        self.id
                    );
                    std::thread::sleep(Duration::from_millis(300));
                }
                Err(why) => panic!(
                    "{}: not started after {attempt} attempts: {why}; log:\n{}",
                    self.id,
                    self.log()
                ),
            }
        }
    }

    fn spawn_once(&mut self) -> Result<(), String> {
        self.starts += 1;
        let log = std::fs::File::create(self.log_path(self.starts)).expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rotary"));
        cmd.arg("serve");
        match &self.etcd {
            Some((endpoint, ttl)) => cmd
                .args(["--etcd", endpoint, "--zone", &self.zone, "--lease-ttl", ttl])
                .arg("--listen")
                .arg(self.endpoint()),
            None => cmd.arg("--cluster").arg(&self.cluster_file),
        };
        cmd.arg("--id")
            .arg(&self.id)
            .arg("--data")
            .arg(&self.data)
            .arg("--cores")
            .arg(self.cores.to_string())
            .arg("--disk-reserve")
            .arg("0")
            .args(&self.serve_args)
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log);
        kill_with_parent(&mut cmd);
        let child = cmd.spawn().expect("spawn rotary serve");
        self.child = Some(child);
        let deadline = Instant::now() + READY_TIMEOUT;
        for shard in 0..self.cores {
            let endpoint = self.shard_endpoint(shard);
            loop {
                if raw_ping(&endpoint) {
                    break;
                }
                let exited = self
                    .child
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten());
                if let Some(status) = exited {
                    self.child = None;
                    return Err(format!("exited with {status} before it was ready"));
                }
                if Instant::now() > deadline {
                    self.kill9();
                    return Err(format!("not ready on {endpoint} after {READY_TIMEOUT:?}"));
                }
                std::thread::sleep(Duration::from_millis(25));
            }
        }
        Ok(())
    }

    /// `kill -9` the process and reap it. The data directory stays.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then waits (up to [`GRACEFUL_EXIT_TIMEOUT`] and a margin)
    /// for the process to exit; fails the test unless it exits with 0.
    pub fn stop_graceful(&mut self) {
        let mut child = self.child.take().expect("broker running");
        #[allow(unsafe_code)]
        // SAFETY: kill(2) on the PID of a child this harness spawned and has
        // not reaped, so the PID cannot have been reused.
        let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(rc, 0, "SIGTERM to {}", self.id);
        let limit = GRACEFUL_EXIT_TIMEOUT + Duration::from_secs(15);
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = child.try_wait().expect("wait for broker") {
                assert!(
                    status.success(),
                    "{} exited with {status} after SIGTERM; log:\n{}",
                    self.id,
                    self.log()
                );
                return;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{} still running {limit:?} after SIGTERM; log:\n{}",
                    self.id,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Whether the process has exited on its own (reaps it if so).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok().flatten()?;
        self.child = None;
        Some(status)
    }

    /// Whether the data directory holds a directory of `journal`'s files.
    pub fn holds_files_of(&self, journal: &str) -> bool {
        super::holds_files_of(&self.data, journal)
    }

    /// A client that follows routes, bootstrapped at this broker.
    pub async fn client(&self) -> Client {
        Client::connect(&self.endpoint())
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.id))
    }

    /// A client whose journal requests all go to this broker.
    pub async fn pinned(&self) -> Client {
        Client::connect_pinned(&self.endpoint())
            .await
            .unwrap_or_else(|e| panic!("connect (pinned) to {}: {e}", self.id))
    }

    /// A `rotary` CLI command aimed at this broker.
    pub fn cli(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rotary"));
        cmd.args(args).arg("--broker").arg(self.endpoint());
        cmd.env_remove("ROTARY_BROKER");
        // Refusals are what these tests look at: no retries.
        cmd.env("ROTARY_RETRY_FOR", "0");
        cmd
    }

    pub fn print_logs(&self) {
        for start in 1..=self.starts {
            let text = std::fs::read_to_string(self.log_path(start)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let skip = lines.len().saturating_sub(LOG_LINES_ON_PANIC);
            eprintln!(
                "--- {} (zone {}, {}) run {start}: last {} of {} log lines ---",
                self.id,
                self.zone,
                self.endpoint(),
                lines.len() - skip,
                lines.len()
            );
            for l in &lines[skip..] {
                eprintln!("{l}");
            }
        }
    }
}

impl Drop for ClusterBroker {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Brokers `b1`…`bn` in zones `a`, `b`, … and the cluster file they share.
pub struct Cluster {
    pub brokers: Vec<ClusterBroker>,
    /// Holds the cluster file.
    dir: tempfile::TempDir,
    pub file: PathBuf,
    /// Indexes of the brokers the cluster file lists now.
    listed: Vec<usize>,
    /// The journals the cluster files list.
    journals: Mutex<Vec<JournalSpec>>,
    /// The brokers that read a file of their own, and the brokers each
    /// one's file lists.
    own_files: Vec<(usize, Vec<usize>)>,
    _one_at_a_time: MutexGuard<'static, ()>,
}

impl Cluster {
    /// `n` brokers with `cores` shards each, all listed and running.
    pub fn start(n: usize, cores: usize) -> Cluster {
        let all: Vec<usize> = (0..n).collect();
        Cluster::start_listed(n, cores, &all)
    }

    /// `n` brokers (ports and data directories chosen for all), of which
    /// only those in `listed` are in the cluster file and started.
    pub fn start_listed(n: usize, cores: usize, listed: &[usize]) -> Cluster {
        assert!(n <= ZONES.len());
        let guard = ONE_CLUSTER_AT_A_TIME
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::Builder::new()
            .prefix("rotary-cluster-")
            .tempdir()
            .expect("temp dir");
        let file = dir.path().join("cluster.yaml");
        let brokers = (0..n)
            .map(|i| ClusterBroker::new(i, cores, file.clone()))
            .collect();
        let mut c = Cluster {
            brokers,
            dir,
            file,
            listed: Vec::new(),
            journals: Mutex::new(Vec::new()),
            own_files: Vec::new(),
            _one_at_a_time: guard,
        };
        c.write_file(listed);
        for &i in listed {
            c.brokers[i].start();
        }
        c
    }

    /// Rewrites the cluster file to list exactly `listed` (indexes), in that
    /// order, atomically (write and rename, so a broker never reads half a
    /// file).
    pub fn write_file(&mut self, listed: &[usize]) {
        replace_file(&self.file, &self.file_text(listed));
        self.listed = listed.to_vec();
    }

    /// Gives broker `i` a cluster file of its own, listing `listed`, which
    /// it reads from its next start on: changes of the shared file no
    /// longer reach it, so its view can differ from its peers'. Called
    /// again, rewrites that file (atomically, as [`Cluster::write_file`]).
    pub fn write_own_file(&mut self, i: usize, listed: &[usize]) {
        let path = self
            .dir
            .path()
            .join(format!("cluster-{}.yaml", self.brokers[i].id));
        replace_file(&path, &self.file_text(listed));
        self.brokers[i].cluster_file = path;
        self.own_files.retain(|(b, _)| *b != i);
        self.own_files.push((i, listed.to_vec()));
    }

    /// The YAML listing the brokers `listed` and the journals.
    pub fn file_text(&self, listed: &[usize]) -> String {
        let mut text = String::from("brokers:\n");
        for &i in listed {
            let b = &self.brokers[i];
            text.push_str(&format!(
                "  - {{id: {}, zone: {}, endpoint: {}}}\n",
                b.id,
                b.zone,
                b.endpoint()
            ));
        }
        let journals = self.journals.lock().unwrap_or_else(|p| p.into_inner());
        if !journals.is_empty() {
            let yaml = serde_yaml::to_string(&*journals).expect("specs to YAML");
            text.push_str("journals:\n");
            for line in yaml.lines() {
                text.push_str(&format!("  {line}\n"));
            }
        }
        text
    }

    /// Rewrites the shared cluster file, and every broker's own, with the
    /// brokers each lists now and the current journals.
    fn rewrite_files(&self) {
        replace_file(&self.file, &self.file_text(&self.listed));
        for (i, listed) in &self.own_files {
            replace_file(&self.brokers[*i].cluster_file, &self.file_text(listed));
        }
    }

    /// The brokers the cluster file lists that are running.
    fn running_listed(&self) -> impl Iterator<Item = &ClusterBroker> {
        self.listed
            .iter()
            .map(|&i| &self.brokers[i])
            .filter(|b| b.is_running())
    }

    /// Removes the journal `name` from the cluster files, then waits until
    /// no running listed broker lists it.
    pub async fn delete(&self, name: &str) {
        self.journals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|s| s.name != name);
        self.rewrite_files();
        let deadline = Instant::now() + APPLY_SETTLE_TIMEOUT;
        for b in self.running_listed() {
            let client = b.client().await;
            while client
                .list("")
                .await
                .expect("LIST")
                .iter()
                .any(|j| j.spec.name == name)
            {
                assert!(Instant::now() < deadline, "{} still lists {name}", b.id);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    pub fn listed(&self) -> &[usize] {
        &self.listed
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The index of the broker with this id.
    pub fn index(&self, id: &str) -> usize {
        self.brokers
            .iter()
            .position(|b| b.id == id)
            .unwrap_or_else(|| panic!("no broker {id:?} in the cluster"))
    }

    pub fn by_id(&self, id: &str) -> &ClusterBroker {
        &self.brokers[self.index(id)]
    }

    pub fn by_id_mut(&mut self, id: &str) -> &mut ClusterBroker {
        let i = self.index(id);
        &mut self.brokers[i]
    }

    /// Puts `specs` in the cluster files (replacing journals of the same
    /// names), then waits until every running listed broker lists each
    /// journal, with a route of `replication` members where the cluster
    /// file lists that many brokers.
    pub async fn apply(&self, specs: &[JournalSpec]) {
        {
            let mut journals = self.journals.lock().unwrap_or_else(|p| p.into_inner());
            journals.retain(|j| !specs.iter().any(|s| s.name == j.name));
            journals.extend(specs.iter().cloned());
            journals.sort_by(|a, b| a.name.cmp(&b.name));
        }
        self.rewrite_files();
        let deadline = Instant::now() + APPLY_SETTLE_TIMEOUT;
        for b in self.running_listed() {
            let client = b.client().await;
            loop {
                let list = client
                    .list("")
                    .await
                    .unwrap_or_else(|e| panic!("list on {}: {e}", b.id));
                // A journal the cluster can hold is listed with its whole
                // route; one it cannot (too few brokers) just listed.
                let settled = |s: &JournalSpec| {
                    list.iter().any(|j| {
                        j.spec == *s
                            && (s.replication as usize > self.listed.len()
                                || j.route.members.len() == s.replication as usize)
                    })
                };
                let missing: Vec<&str> = specs
                    .iter()
                    .filter(|s| !settled(s))
                    .map(|s| s.name.as_str())
                    .collect();
                if missing.is_empty() {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{} does not list {missing:?} with their routes after {APPLY_SETTLE_TIMEOUT:?}: {list:#?}",
                    b.id
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

impl Cluster {
    /// The outcome of a test body run under `tokio::time::timeout(limit)`:
    /// its value, or a failure that says which broker threads were busy
    /// (CPU time and state of each), then the logs.
    pub fn finished<T>(
        &self,
        outcome: Result<T, tokio::time::error::Elapsed>,
        limit: Duration,
    ) -> T {
        match outcome {
            Ok(v) => v,
            Err(_) => {
                let first = self.threads_report();
                std::thread::sleep(Duration::from_secs(1));
                let second = self.threads_report();
                panic!(
                    "the test did not finish within {limit:?}. Broker threads (state, \
                     user+system CPU ticks), one second apart:\n{first}\n{second}"
                )
            }
        }
    }

    /// For every running broker: its threads' names, states and CPU ticks.
    pub fn threads_report(&self) -> String {
        let mut out = String::new();
        for b in &self.brokers {
            let Some(pid) = b.pid() else {
                out.push_str(&format!("{}: not running\n", b.id));
                continue;
            };
            out.push_str(&format!("{} (pid {pid}):", b.id));
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
                .map(|d| d.filter_map(|e| e.ok()).collect::<Vec<_>>())
                .unwrap_or_default();
            for t in tasks {
                let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                // `pid (name) state ...`: the name may hold spaces.
                let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                    continue;
                };
                let name = &stat[open + 1..close];
                let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
                if rest.len() > 12 {
                    let ticks =
                        rest[11].parse::<u64>().unwrap_or(0) + rest[12].parse::<u64>().unwrap_or(0);
                    out.push_str(&format!(" [{name} {} {ticks}]", rest[0]));
                }
            }
            out.push('\n');
        }
        out
    }
}

/// Writes `text` beside `path`, then renames it over `path`.
fn replace_file(path: &Path, text: &str) {
    let tmp = path.with_extension("yaml.new");
    std::fs::write(&tmp, text).expect("write cluster file");
    std::fs::rename(&tmp, path).expect("rename cluster file");
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for b in &mut self.brokers {
            b.kill9();
        }
        // `ROTARY_TEST_LOGS=1` prints them after a passing test too.
        if std::thread::panicking() || std::env::var_os("ROTARY_TEST_LOGS").is_some() {
            eprintln!(
                "--- cluster file {} ---\n{}",
                self.file.display(),
                std::fs::read_to_string(&self.file).unwrap_or_default()
            );
            for b in &self.brokers {
                b.print_logs();
            }
        }
    }
}
