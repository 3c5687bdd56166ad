//! The cluster a fault run breaks: a real `etcd` and four `rotary serve
//! --etcd` child processes in four zones, each with its data directory and
//! log in the run's directory. Every process is signalled and stopped by
//! its own PID, and killed when the cluster drops.
//!
//! On loopback every process listens on 127.0.0.1. For partitions the
//! brokers and etcd run in network namespaces of their own
//! ([`Net::Namespaces`]), each joined by a veth pair to a bridge in this
//! process's namespace, which carries the clients' traffic and listens on
//! nothing: taking a broker's veth down cuts it off from etcd, its peers
//! and its clients at once, and nothing else.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use crate::child::ChildGuard;
use anyhow::Context as _;
use rotary_net::client::{Client, ClientOptions, JournalInfo};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Brokers of the cluster, one per zone: a journal of replication 3
/// survives the loss of one.
pub const BROKERS: usize = 4;
/// How long a process may take to serve after it starts.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a SIGTERM'ed broker may take to exit: its own bound on
/// waiting for uploads (30 s) plus draining.
const GRACEFUL_EXIT_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a wait looks again.
const POLL: Duration = Duration::from_millis(50);
/// Subnet `10.213.<n>.0/24` of a namespaced cluster: one per cluster.
const NETNS_SUBNET_PREFIX: &str = "10.213";

/// Sends `signal` to process `pid`, a child this cluster started and has
/// not reaped.
#[allow(unsafe_code)]
pub fn signal(pid: u32, signal: libc::c_int) -> anyhow::Result<()> {
    // SAFETY: kill(2) with a PID of our own unreaped child: the PID cannot
    // have been reused by another process.
    let rc = unsafe { libc::kill(pid as libc::pid_t, signal) };
    anyhow::ensure!(
        rc == 0,
        "kill({pid}, {signal}): {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// SIGSTOP, then waits until every thread of `pid` is stopped, so that
/// nothing it does afterwards races with the caller.
pub async fn stop_process(pid: u32) -> anyhow::Result<()> {
    signal(pid, libc::SIGSTOP)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .with_context(|| format!("threads of {pid}"))?;
        let all_stopped = tasks.flatten().all(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
            // The state follows the command name, in parentheses.
            stat.rsplit_once(')')
                .and_then(|(_, r)| r.trim_start().chars().next())
                == Some('T')
        });
        if all_stopped {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "process {pid} did not stop");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// How the processes reach each other.
#[derive(Debug)]
pub enum Net {
    /// Everything on 127.0.0.1.
    Loopback,
    /// Each broker in a namespace of its own on a bridge (see the module
    /// doc); `tag` prefixes every name made, `subnet` is `10.213.<subnet>`.
    Namespaces { tag: String, subnet: u8 },
}

impl Net {
    /// Makes the bridge and one namespace per broker. Needs root and
    /// iproute2; an error says what failed.
    pub fn namespaces() -> anyhow::Result<Net> {
        static MADE: AtomicU32 = AtomicU32::new(0);
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // Short: interface names are at most 15 bytes.
        let tag = format!("rf{:x}", ((pid & 0xffff) << 4) | (n & 0xf));
        let subnet = ((pid.wrapping_mul(7).wrapping_add(n * 13)) % 250 + 1) as u8;
        let net = Net::Namespaces { tag, subnet };
        net.make().inspect_err(|_| net.remove())?;
        Ok(net)
    }

    fn make(&self) -> anyhow::Result<()> {
        let Net::Namespaces { tag, .. } = self else {
            return Ok(());
        };
        let bridge = format!("{tag}br");
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/24", self.bridge_host()),
            "dev",
            &bridge,
        ])?;
        ip(&["link", "set", &bridge, "up"])?;
        for i in 0..BROKERS {
            let ns = self.namespace(i).expect("namespaced");
            self.attach(&bridge, &ns, &i.to_string(), &self.broker_host(i))?;
        }
        let ns = self.etcd_namespace().expect("namespaced");
        self.attach(&bridge, &ns, "e", &self.etcd_host())
    }

    /// Makes namespace `ns`, joined to `bridge` by a veth pair whose ends
    /// are named after `end`, with address `host` inside.
    fn attach(&self, bridge: &str, ns: &str, end: &str, host: &str) -> anyhow::Result<()> {
        let Net::Namespaces { tag, .. } = self else {
            return Ok(());
        };
        let (host_end, ns_end) = (format!("{tag}h{end}"), format!("{tag}n{end}"));
        ip(&["netns", "add", ns])?;
        ip(&[
            "link", "add", &host_end, "type", "veth", "peer", "name", &ns_end,
        ])?;
        ip(&["link", "set", &ns_end, "netns", ns])?;
        ip(&["link", "set", &host_end, "master", bridge, "up"])?;
        let addr = format!("{host}/24");
        ip(&["-n", ns, "addr", "add", &addr, "dev", &ns_end])?;
        ip(&["-n", ns, "link", "set", &ns_end, "up"])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])
    }

    /// Deletes what [`Net::namespaces`] made (whatever of it exists).
    fn remove(&self) {
        let Net::Namespaces { tag, .. } = self else {
            return;
        };
        for i in 0..BROKERS {
            let _ = ip(&["link", "del", &format!("{tag}h{i}")]);
            if let Some(ns) = self.namespace(i) {
                let _ = ip(&["netns", "del", &ns]);
            }
        }
        let _ = ip(&["link", "del", &format!("{tag}he")]);
        if let Some(ns) = self.etcd_namespace() {
            let _ = ip(&["netns", "del", &ns]);
        }
        let _ = ip(&["link", "del", &format!("{tag}br")]);
    }

    /// The namespace broker `i` runs in, if any.
    pub fn namespace(&self, i: usize) -> Option<String> {
        match self {
            Net::Loopback => None,
            Net::Namespaces { tag, .. } => Some(format!("{tag}-b{i}")),
        }
    }

    /// The namespace etcd runs in, if any.
    pub fn etcd_namespace(&self) -> Option<String> {
        match self {
            Net::Loopback => None,
            Net::Namespaces { tag, .. } => Some(format!("{tag}-etcd")),
        }
    }

    pub fn etcd_host(&self) -> String {
        match self {
            Net::Loopback => "127.0.0.1".into(),
            Net::Namespaces { subnet, .. } => format!("{NETNS_SUBNET_PREFIX}.{subnet}.2"),
        }
    }

    /// This process's address on the bridge: the clients' source address.
    fn bridge_host(&self) -> String {
        match self {
            Net::Loopback => "127.0.0.1".into(),
            Net::Namespaces { subnet, .. } => format!("{NETNS_SUBNET_PREFIX}.{subnet}.1"),
        }
    }

    pub fn broker_host(&self, i: usize) -> String {
        match self {
            Net::Loopback => "127.0.0.1".into(),
            Net::Namespaces { subnet, .. } => {
                format!("{NETNS_SUBNET_PREFIX}.{subnet}.{}", 11 + i)
            }
        }
    }

    /// Cuts broker `i` off from everything (`up` false), or joins it again.
    pub fn set_link(&self, i: usize, up: bool) -> anyhow::Result<()> {
        let Net::Namespaces { tag, .. } = self else {
            anyhow::bail!("a partition needs the brokers in network namespaces");
        };
        let state = if up { "up" } else { "down" };
        ip(&["link", "set", &format!("{tag}h{i}"), state])
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.remove();
    }
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running ip (iproute2)")?;
    anyhow::ensure!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// A free TCP port of this namespace's 127.0.0.1 (inside a fresh network
/// namespace every port is free).
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("binding port 0")?;
    Ok(l.local_addr()?.port())
}

/// etcd as a child: the same ports and data on every start.
pub struct Etcd {
    host: String,
    namespace: Option<String>,
    client_port: u16,
    peer_port: u16,
    data: PathBuf,
    log: PathBuf,
    child: Option<ChildGuard>,
}

impl Etcd {
    fn new(host: String, namespace: Option<String>, dir: &Path) -> anyhow::Result<Etcd> {
        Ok(Etcd {
            host,
            namespace,
            client_port: free_port()?,
            peer_port: free_port()?,
            data: dir.join("etcd"),
            log: dir.join("etcd.log"),
            child: None,
        })
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}:{}", self.host, self.client_port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.0.id())
    }

    /// Starts etcd (again, on its ports and data) and waits until its
    /// client port takes connections and answers.
    pub async fn start(&mut self) -> anyhow::Result<()> {
        anyhow::ensure!(self.child.is_none(), "etcd already running");
        let binary = rotary_etcd::testing::etcd_binary().context(
            "no etcd binary: install Debian's etcd-server or set ROTARY_ETCD=/path/to/etcd",
        )?;
        let client_url = self.endpoint();
        let peer_url = format!("http://{}:{}", self.host, self.peer_port);
        let log = log_file(&self.log)?;
        let mut cmd = match &self.namespace {
            // The child's PID is etcd's, as for a broker.
            Some(ns) => {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", ns]).arg(binary);
                cmd
            }
            None => Command::new(binary),
        };
        let child = cmd
            .arg("--name=rotary-faults")
            .arg(format!("--data-dir={}", self.data.display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=rotary-faults={peer_url}"))
            .arg("--initial-cluster-state=new")
            .env_remove("ETCDCTL_API")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning etcd")?;
        self.child = Some(ChildGuard(child));
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let exited = self.child.as_mut().and_then(|c| c.0.try_wait().ok()?);
            if let Some(status) = exited {
                self.child = None;
                anyhow::bail!("etcd exited with {status}; see {}", self.log.display());
            }
            let answered = tokio::time::timeout(Duration::from_secs(2), async {
                let c =
                    rotary_etcd::Client::connect(&[self.endpoint()], Default::default()).await?;
                c.get(b"/".to_vec()).await
            })
            .await;
            if matches!(answered, Ok(Ok(_))) {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "etcd not serving after {READY_TIMEOUT:?}; see {}",
                self.log.display()
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// SIGKILL, as a crash would; its data stays.
    pub fn kill(&mut self) {
        self.child.take();
    }
}

/// One broker: a fixed id, zone, address and data directory; the process
/// comes and goes.
pub struct Broker {
    pub id: String,
    pub zone: String,
    pub endpoint: String,
    pub data: PathBuf,
    pub log: PathBuf,
    namespace: Option<String>,
    child: Option<ChildGuard>,
    /// Stopped (SIGSTOP) or cut off: running, but not a live member.
    pub impaired: bool,
}

impl Broker {
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.0.id())
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}

/// etcd and the brokers.
pub struct Cluster {
    pub exe: PathBuf,
    pub ttl: Duration,
    pub etcd: Etcd,
    pub brokers: Vec<Broker>,
    /// Dropped after the processes: namespaces go once nothing runs in them.
    pub net: Net,
}

impl Cluster {
    /// Starts etcd and [`BROKERS`] brokers, one after another (so `b1`
    /// leads the allocation), each serving before the next starts.
    pub async fn start(exe: &Path, dir: &Path, ttl: Duration, net: Net) -> anyhow::Result<Cluster> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut etcd = Etcd::new(net.etcd_host(), net.etcd_namespace(), dir)?;
        etcd.start().await?;
        let mut brokers = Vec::new();
        for i in 0..BROKERS {
            let port = free_port()?;
            brokers.push(Broker {
                id: format!("b{}", i + 1),
                zone: format!("zone-{}", (b'a' + i as u8) as char),
                endpoint: format!("{}:{port}", net.broker_host(i)),
                data: dir.join(format!("b{}", i + 1)),
                log: dir.join(format!("b{}.log", i + 1)),
                namespace: net.namespace(i),
                child: None,
                impaired: false,
            });
        }
        let mut cluster = Cluster {
            exe: exe.to_path_buf(),
            ttl,
            etcd,
            brokers,
            net,
        };
        for i in 0..BROKERS {
            cluster.start_broker(i).await?;
        }
        Ok(cluster)
    }

    pub fn endpoints(&self) -> String {
        let all: Vec<&str> = self.brokers.iter().map(|b| b.endpoint.as_str()).collect();
        all.join(",")
    }

    pub fn index(&self, id: &str) -> anyhow::Result<usize> {
        self.brokers
            .iter()
            .position(|b| b.id == id)
            .with_context(|| format!("no broker {id:?}"))
    }

    /// Starts broker `i` and waits until it answers PING.
    pub async fn start_broker(&mut self, i: usize) -> anyhow::Result<()> {
        let etcd = self.etcd.endpoint();
        let ttl = format!("{}ms", self.ttl.as_millis());
        let b = &mut self.brokers[i];
        anyhow::ensure!(b.child.is_none(), "{} already running", b.id);
        let log = log_file(&b.log)?;
        let mut cmd = match &b.namespace {
            Some(ns) => {
                // `ip netns exec` enters the namespace and execs the
                // broker: the child's PID is the broker's.
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", ns]).arg(&self.exe);
                cmd
            }
            None => Command::new(&self.exe),
        };
        cmd.args(["serve", "--etcd", &etcd, "--id", &b.id, "--zone", &b.zone])
            .args(["--listen", &b.endpoint, "--lease-ttl", &ttl])
            .arg("--data")
            .arg(&b.data)
            .args(["--cores", "1", "--disk-reserve", "0", "--http", "off"])
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting broker {}", b.id))?;
        b.child = Some(ChildGuard(child));
        b.impaired = false;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let exited = b.child.as_mut().and_then(|c| c.0.try_wait().ok()?);
            if let Some(status) = exited {
                b.child = None;
                anyhow::bail!(
                    "{} exited with {status} before it served; see {}",
                    b.id,
                    b.log.display()
                );
            }
            let pinged = tokio::time::timeout(Duration::from_secs(2), async {
                Client::connect_pinned(&b.endpoint).await?.ping().await
            })
            .await;
            if matches!(pinged, Ok(Ok(()))) {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{} not serving after {READY_TIMEOUT:?}; see {}",
                b.id,
                b.log.display()
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// SIGKILL broker `i` and reap it; its data directory stays.
    pub fn kill_broker(&mut self, i: usize) {
        self.brokers[i].child.take();
        self.brokers[i].impaired = false;
    }

    /// SIGTERM broker `i` and wait for it to exit (it hands its journals
    /// off and uploads its spools first); an error unless it exits with 0.
    pub async fn stop_broker_graceful(&mut self, i: usize) -> anyhow::Result<()> {
        let b = &mut self.brokers[i];
        let mut child = b.child.take().context("broker not running")?;
        signal(child.0.id(), libc::SIGTERM)?;
        let deadline = Instant::now() + GRACEFUL_EXIT_TIMEOUT;
        loop {
            if let Some(status) = child.0.try_wait()? {
                anyhow::ensure!(
                    status.success(),
                    "{} exited with {status} after SIGTERM",
                    b.id
                );
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{} still running {GRACEFUL_EXIT_TIMEOUT:?} after SIGTERM",
                b.id
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// SIGSTOP broker `i`: it keeps its sockets (connections are taken
    /// into their backlog and requests queue) but does nothing.
    pub async fn pause_broker(&mut self, i: usize) -> anyhow::Result<()> {
        let pid = self.brokers[i].pid().context("broker not running")?;
        stop_process(pid).await?;
        self.brokers[i].impaired = true;
        Ok(())
    }

    pub fn resume_broker(&mut self, i: usize) -> anyhow::Result<()> {
        let pid = self.brokers[i].pid().context("broker not running")?;
        signal(pid, libc::SIGCONT)?;
        self.brokers[i].impaired = false;
        Ok(())
    }

    pub fn partition_broker(&mut self, i: usize) -> anyhow::Result<()> {
        self.net.set_link(i, false)?;
        self.brokers[i].impaired = true;
        Ok(())
    }

    pub fn heal_broker(&mut self, i: usize) -> anyhow::Result<()> {
        self.net.set_link(i, true)?;
        self.brokers[i].impaired = false;
        Ok(())
    }

    /// A client bootstrapped at the brokers `at`, retrying appends for
    /// `retry`, giving up on a connection silent for twice `silence` (a
    /// paused broker answers nothing, not even PING).
    pub async fn client_of(
        &self,
        at: &[usize],
        retry: Duration,
        silence: Duration,
    ) -> anyhow::Result<Client> {
        let endpoints: Vec<&str> = at
            .iter()
            .map(|&i| self.brokers[i].endpoint.as_str())
            .collect();
        let options = ClientOptions {
            retry_for: retry,
            silence,
            ..ClientOptions::default()
        };
        Client::connect_with(&endpoints.join(","), options)
            .await
            .with_context(|| format!("connecting to {endpoints:?}"))
    }

    /// The brokers that run and are neither paused nor cut off.
    pub fn healthy(&self) -> Vec<usize> {
        (0..self.brokers.len())
            .filter(|&i| self.brokers[i].is_running() && !self.brokers[i].impaired)
            .collect()
    }

    /// The listing of `journal` as the healthy brokers give it.
    pub async fn route(&self, journal: &str) -> anyhow::Result<JournalInfo> {
        let lister = self
            .client_of(&self.healthy(), Duration::ZERO, Duration::from_secs(1))
            .await?;
        let list = lister.list("").await.context("listing journals")?;
        list.into_iter()
            .find(|j| j.spec.name == journal)
            .with_context(|| format!("{journal} is not listed"))
    }

    /// Waits (up to `timeout`) until `journal` is routed to `replication`
    /// healthy brokers; returns its listing.
    pub async fn settled(
        &self,
        journal: &str,
        replication: usize,
        timeout: Duration,
    ) -> anyhow::Result<JournalInfo> {
        let deadline = Instant::now() + timeout;
        let mut last = None;
        loop {
            if let Ok(j) = self.route(journal).await {
                let healthy = self.healthy();
                let live = j
                    .route
                    .members
                    .iter()
                    .all(|m| self.index(m).is_ok_and(|i| healthy.contains(&i)));
                if j.route.members.len() == replication && live {
                    return Ok(j);
                }
                last = Some(j.route);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{journal} has no route of {replication} healthy brokers after {timeout:?}: {last:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The last `lines` lines of every broker's log and etcd's.
    pub fn log_tails(&self, lines: usize) -> String {
        let mut out = String::new();
        let logs = self
            .brokers
            .iter()
            .map(|b| (b.id.as_str(), &b.log))
            .chain(std::iter::once(("etcd", &self.etcd.log)));
        for (name, path) in logs {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            let all: Vec<&str> = text.lines().collect();
            let tail = &all[all.len().saturating_sub(lines)..];
            out.push_str(&format!("--- {name} ({}) ---\n", path.display()));
            for l in tail {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // A paused process takes SIGKILL too. The namespaces go after
        // (`net` drops last), once nothing runs in them.
        for b in &mut self.brokers {
            b.child.take();
        }
        self.etcd.kill();
    }
}

/// Opens `path` for appending a process's output (every run of it).
fn log_file(path: &Path) -> anyhow::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))
}
