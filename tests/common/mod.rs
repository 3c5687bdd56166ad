//! Shared harness of the end-to-end tests: starts real `rotary serve`
//! processes on loopback with a temporary data directory, kills them by PID
//! when the test ends (also when it panics), and offers helpers that speak
//! the wire protocol directly or through the client library.
#![allow(dead_code)]

pub mod cluster;
pub mod etcd_cluster;
pub mod store;

use rand::{Rng, RngCore, SeedableRng};
use rotary_net::client::{Client, ClientError, ReadDone, ReadEvent, ReadOptions, ReadStream};
use rotary_net::spec::JournalSpec;
use rotary_net::wire::{self, Op, ReadRequest};
use rotary_net::Status;
use sha1::{Digest, Sha1};
use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a broker may take to answer PING on every shard after start.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Shards each test broker runs (the machine has 2 cores).
pub const CORES_DEFAULT: usize = 2;

/// Ports handed out in this process, so parallel tests never pick the same.
static PORTS_TAKEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// Finds `count` consecutive free ports on 127.0.0.1: binds port 0 to let
/// the kernel choose a base, then checks the ports after it are free too.
pub fn free_port_range(count: usize) -> u16 {
    let mut taken = PORTS_TAKEN.lock().unwrap_or_else(|p| p.into_inner());
    let taken = taken.get_or_insert_with(HashSet::new);
    for _ in 0..200 {
        let first = TcpListener::bind("127.0.0.1:0").expect("bind port 0");
        let base = first.local_addr().unwrap().port();
        if usize::from(base) + count > usize::from(u16::MAX) {
            continue;
        }
        let ports: Vec<u16> = (0..count as u16).map(|i| base + i).collect();
        if ports.iter().any(|p| taken.contains(p)) {
            continue;
        }
        let mut held = vec![first];
        let all_free = ports[1..]
            .iter()
            .all(|p| match TcpListener::bind(("127.0.0.1", *p)) {
                Ok(l) => {
                    held.push(l);
                    true
                }
                Err(_) => false,
            });
        if all_free {
            taken.extend(ports);
            return base;
        }
    }
    panic!("no {count} consecutive free ports on 127.0.0.1");
}

/// How long a SIGTERM'ed broker may take to exit: its own bound on waiting
/// for uploads (30 s) plus draining.
pub const GRACEFUL_EXIT_TIMEOUT: Duration = Duration::from_secs(60);

/// Extra command-line arguments and environment of a broker.
#[derive(Clone, Debug, Default)]
pub struct BrokerOpts {
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Variables of the test's own environment the broker does not get.
    pub env_remove: Vec<String>,
}

/// A `rotary serve` child process. Dropping it kills the process.
pub struct Broker {
    child: Option<Child>,
    /// Holds the data directory and logs; removed when the broker drops.
    dir: tempfile::TempDir,
    pub data: PathBuf,
    pub cores: usize,
    pub base_port: u16,
    starts: u32,
    opts: BrokerOpts,
}

impl Broker {
    /// Starts a broker with [`CORES_DEFAULT`] shards on a fresh data dir.
    pub fn start() -> Broker {
        Broker::start_with_cores(CORES_DEFAULT)
    }

    pub fn start_with_cores(cores: usize) -> Broker {
        Broker::start_with(cores, BrokerOpts::default())
    }

    pub fn start_with(cores: usize, opts: BrokerOpts) -> Broker {
        let dir = tempfile::Builder::new()
            .prefix("rotary-e2e-")
            .tempdir()
            .expect("temp dir");
        let data = dir.path().join("data");
        let mut b = Broker {
            child: None,
            dir,
            data,
            cores,
            base_port: 0,
            starts: 0,
            opts,
        };
        b.spawn();
        b
    }

    /// Shard 0's endpoint.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.base_port)
    }

    pub fn shard_endpoint(&self, shard: usize) -> String {
        format!("127.0.0.1:{}", usize::from(self.base_port) + shard)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join(format!("broker-{}.log", self.starts))
    }

    /// The current run's stdout and stderr.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none(), "broker already running");
        self.starts += 1;
        // Fresh ports on every start: the test is about the data directory,
        // not about rebinding a port with connections in TIME_WAIT.
        self.base_port = free_port_range(self.cores);
        let log = std::fs::File::create(self.log_path()).expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rotary"));
        cmd.arg("serve")
            .arg("--data")
            .arg(&self.data)
            .arg("--listen")
            .arg(self.endpoint())
            .arg("--cores")
            .arg(self.cores.to_string())
            .arg("--disk-reserve")
            .arg("0")
            .args(&self.opts.args)
            .envs(self.opts.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log);
        for k in &self.opts.env_remove {
            cmd.env_remove(k);
        }
        kill_with_parent(&mut cmd);
        let child = cmd.spawn().expect("spawn rotary serve");
        self.child = Some(child);
        self.wait_ready();
    }

    /// Waits until every shard answers PING.
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        for shard in 0..self.cores {
            let endpoint = self.shard_endpoint(shard);
            loop {
                if raw_ping(&endpoint) {
                    break;
                }
                if let Some(status) = self
                    .child
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten())
                {
                    panic!(
                        "rotary serve exited with {status} before it was ready; log:\n{}",
                        self.log()
                    );
                }
                if Instant::now() > deadline {
                    panic!(
                        "rotary serve not ready on {endpoint} after {READY_TIMEOUT:?}; log:\n{}",
                        self.log()
                    );
                }
                std::thread::sleep(Duration::from_millis(25));
            }
        }
    }

    /// `kill -9` the broker and reap it.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the broker again on the same data directory (new ports).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// SIGTERM: the broker seals open spools, waits for their uploads and
    /// exits. Panics unless it exits successfully within
    /// [`GRACEFUL_EXIT_TIMEOUT`].
    pub fn stop_graceful(&mut self) {
        let mut child = self.child.take().expect("broker running");
        #[allow(unsafe_code)]
        // SAFETY: kill(2) on the PID of a child this harness spawned and has
        // not reaped, so the PID cannot have been reused.
        let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(rc, 0, "SIGTERM to the broker");
        let deadline = Instant::now() + GRACEFUL_EXIT_TIMEOUT;
        loop {
            if let Some(status) = child.try_wait().expect("wait for broker") {
                assert!(
                    status.success(),
                    "broker exited with {status} after SIGTERM; log:\n{}",
                    self.log()
                );
                return;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "broker still running {GRACEFUL_EXIT_TIMEOUT:?} after SIGTERM; log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Deletes the data directory of a stopped broker: its disk is lost.
    pub fn wipe_data(&mut self) {
        assert!(
            self.child.is_none(),
            "stop the broker before wiping its data"
        );
        std::fs::remove_dir_all(&self.data).expect("remove the data directory");
    }

    /// Starts a stopped broker (new ports).
    pub fn start_again(&mut self) {
        self.spawn();
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

    pub async fn client(&self) -> Client {
        Client::connect(&self.endpoint())
            .await
            .expect("connect to broker")
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- broker log (run {}) ---\n{}", self.starts, self.log());
        }
        self.kill9();
    }
}

/// Makes the kernel SIGKILL the child if the test process dies first (e.g.
/// a test runner timeout), so no broker outlives its test.
#[allow(unsafe_code)]
fn kill_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec and only calls prctl,
    // which is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// Encodes one request frame.
pub fn frame(op: Op, flags: u8, id: u64, meta: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    wire::encode_frame(&mut out, op, flags, Status::OK, id, meta, payload);
    out
}

/// A reply frame read from a raw socket.
#[derive(Debug, Clone)]
pub struct RawFrame {
    pub op: Op,
    pub flags: u8,
    pub status: u16,
    pub request_id: u64,
    pub meta: Vec<u8>,
    pub payload: Vec<u8>,
}

/// Reads one frame; `None` on a clean EOF before any byte of it.
pub fn read_raw_frame(s: &mut TcpStream) -> std::io::Result<Option<RawFrame>> {
    let mut header = [0u8; wire::HEADER_LEN];
    let mut got = 0;
    while got < header.len() {
        let n = s.read(&mut header[got..])?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    let (h, total) = wire::decode_header(&header, u32::MAX)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?
        .expect("a whole header");
    let mut body = vec![0u8; total - wire::HEADER_LEN];
    s.read_exact(&mut body)?;
    let meta_len = h.meta_len.get() as usize;
    Ok(Some(RawFrame {
        op: Op::from_code(h.op).expect("checked op"),
        flags: h.flags,
        status: h.status.get(),
        request_id: h.request_id.get(),
        meta: body[..meta_len].to_vec(),
        payload: body[meta_len..].to_vec(),
    }))
}

/// Connects a raw socket with a read timeout.
pub fn raw_connect(endpoint: &str) -> TcpStream {
    let s = TcpStream::connect(endpoint).expect("raw connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// One PING over a fresh raw connection; true if PONG came back.
pub fn raw_ping(endpoint: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(endpoint) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(&frame(Op::PING, 0, 1, &[], b"ready?")).is_err() {
        return false;
    }
    matches!(read_raw_frame(&mut s), Ok(Some(f)) if f.op == Op::PONG && f.request_id == 1 && f.payload == b"ready?")
}

/// Whether the data directory `data` holds a directory of `journal`'s
/// files (`shard-<n>/journals/<journal>/@`, on any shard).
pub fn holds_files_of(data: &Path, journal: &str) -> bool {
    let mut dirs = vec![data.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        if dir.ends_with(Path::new("journals").join(journal).join("@")) {
            return true;
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            dirs.extend(
                entries
                    .flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.path()),
            );
        }
    }
    false
}

/// Applies one spec (after `edit`) and checks the broker applied it.
pub async fn create_journal(
    client: &Client,
    name: &str,
    edit: impl FnOnce(&mut JournalSpec),
) -> JournalSpec {
    let mut spec = JournalSpec::new(name);
    // Small fragments keep test spools small and exercise rolling.
    spec.fragment.length = 64 << 20;
    spec.fragment.compression_codec = rotary_net::spec::Codec::None;
    edit(&mut spec);
    let applied = client
        .apply(std::slice::from_ref(&spec))
        .await
        .expect("apply");
    assert_eq!(applied, 1);
    spec
}

/// Reads `[from, to)` (to the head if `to` is None) without blocking and
/// returns the bytes and READ_DONE. Asserts data arrives contiguously.
pub async fn read_range(
    client: &Client,
    journal: &str,
    from: u64,
    to: Option<u64>,
) -> Result<(Vec<u8>, ReadDone), ClientError> {
    read_range_with(client, journal, from, to, ReadOptions::default()).await
}

/// [`read_range`] with read options (it must not block). A fragment
/// location (history only in a store) fails the test.
pub async fn read_range_with(
    client: &Client,
    journal: &str,
    from: u64,
    to: Option<u64>,
    options: ReadOptions,
) -> Result<(Vec<u8>, ReadDone), ClientError> {
    assert!(!options.block, "read_range reads without blocking");
    let req = ReadRequest {
        journal: journal.to_string(),
        offset: Some(from),
        end_offset: to,
        route_revision: 0,
    };
    let stream = client.read_with(&req, options).await?;
    read_to_done(stream, &format!("{}: {journal}", client.endpoint()), from).await
}

/// Everything a read stream that began at `from` sends up to its
/// READ_DONE, checking its offsets are contiguous. A fragment location
/// fails the test; `what` names the read in failures.
pub async fn read_to_done(
    mut stream: ReadStream,
    what: &str,
    from: u64,
) -> Result<(Vec<u8>, ReadDone), ClientError> {
    let mut out = Vec::new();
    while let Some(ev) = stream.next().await {
        match ev? {
            ReadEvent::Data { offset, content } => {
                assert_eq!(
                    offset,
                    from + out.len() as u64,
                    "{what}: READ_DATA offsets must be contiguous"
                );
                out.extend_from_slice(&content);
            }
            ev @ ReadEvent::Fragment { .. } => {
                panic!("{what}: the broker sent a fragment location: {ev:?}")
            }
            ReadEvent::Done(done) => return Ok((out, done)),
        }
    }
    panic!("{what}: read stream ended without READ_DONE");
}

/// The whole journal from offset 0, checking READ_DONE is OK at the head (or
/// OFFSET_NOT_YET_AVAILABLE for an empty journal).
pub async fn read_all(client: &Client, journal: &str) -> Vec<u8> {
    let (bytes, done) = read_range(client, journal, 0, None).await.expect("read");
    if bytes.is_empty() {
        assert!(
            matches!(done.status, Status::OK | Status::OFFSET_NOT_YET_AVAILABLE),
            "read of empty journal: {done:?}"
        );
    } else {
        assert_eq!(done.status, Status::OK, "{done:?}");
        assert_eq!(done.offset, bytes.len() as u64);
        assert_eq!(done.write_head, bytes.len() as u64);
    }
    bytes
}

/// The journal's write head, via a metadata-only read.
pub async fn write_head(client: &Client, journal: &str) -> u64 {
    let req = ReadRequest {
        journal: journal.to_string(),
        offset: None,
        end_offset: None,
        route_revision: 0,
    };
    let mut stream = client.read(&req, false, true).await.expect("metadata read");
    match stream
        .next()
        .await
        .expect("READ_DONE")
        .expect("metadata read")
    {
        ReadEvent::Data { .. } | ReadEvent::Fragment { .. } => {
            panic!("metadata-only read sent data")
        }
        ReadEvent::Done(done) => {
            assert!(
                matches!(done.status, Status::OK | Status::OFFSET_NOT_YET_AVAILABLE),
                "{done:?}"
            );
            done.write_head
        }
    }
}

/// The status a failed request carries (panics on success or I/O errors).
pub fn status_of<T: std::fmt::Debug>(r: Result<T, ClientError>) -> Status {
    match r {
        Err(e) => e
            .status()
            .unwrap_or_else(|| panic!("expected a status, got {e}")),
        Ok(v) => panic!("expected a status error, got {v:?}"),
    }
}

/// The final status of a read: READ_DONE's status or the error's status.
pub async fn read_status(
    client: &Client,
    req: &ReadRequest,
    block: bool,
) -> (Status, Option<ReadDone>) {
    let mut stream = match client.read(req, block, false).await {
        Ok(s) => s,
        Err(e) => return (e.status().unwrap_or_else(|| panic!("read: {e}")), None),
    };
    loop {
        match stream.next().await.expect("READ_DONE") {
            Ok(ReadEvent::Data { .. } | ReadEvent::Fragment { .. }) => continue,
            Ok(ReadEvent::Done(d)) => return (d.status, Some(d)),
            Err(e) => return (e.status().unwrap_or_else(|| panic!("read: {e}")), None),
        }
    }
}

pub fn sha1(bytes: &[u8]) -> [u8; 20] {
    Sha1::digest(bytes).into()
}

pub fn hex_sha1(bytes: &[u8]) -> String {
    hex::encode(sha1(bytes))
}

/// Self-describing append content: a 16-byte header (`RTAP`, writer,
/// sequence, length, little-endian u32s) then pseudo-random bytes seeded by
/// (writer, sequence). Content shorter than 16 bytes is the header's prefix.
pub const RECORD_HEADER_LEN: usize = 16;
pub const RECORD_MAGIC: &[u8; 4] = b"RTAP";

pub fn record(writer: u32, seq: u32, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len.max(RECORD_HEADER_LEN));
    out.extend_from_slice(RECORD_MAGIC);
    out.extend_from_slice(&writer.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(len as u32).to_le_bytes());
    if len > RECORD_HEADER_LEN {
        let mut rng = rand::rngs::StdRng::seed_from_u64((u64::from(writer) << 32) | u64::from(seq));
        let mut rest = vec![0u8; len - RECORD_HEADER_LEN];
        rng.fill_bytes(&mut rest);
        out.extend_from_slice(&rest);
    }
    out.truncate(len);
    out
}

/// A record found in a journal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Found {
    pub begin: u64,
    pub end: u64,
    pub writer: u32,
    pub seq: u32,
}

/// Walks `bytes` (journal offsets starting at `base`) as back-to-back whole
/// records, each at least [`RECORD_HEADER_LEN`] long; an error names the
/// first offset that is not the start of a whole, intact record.
pub fn parse_records(bytes: &[u8], base: u64) -> Result<Vec<Found>, String> {
    let mut at = 0usize;
    let mut out = Vec::new();
    while at < bytes.len() {
        let rest = &bytes[at..];
        let offset = base + at as u64;
        if rest.len() < RECORD_HEADER_LEN || &rest[..4] != RECORD_MAGIC {
            return Err(format!("offset {offset}: no record header"));
        }
        let u = |i: usize| u32::from_le_bytes(rest[i..i + 4].try_into().unwrap());
        let (writer, seq, len) = (u(4), u(8), u(12) as usize);
        if len < RECORD_HEADER_LEN || len > rest.len() {
            return Err(format!("offset {offset}: record length {len} does not fit"));
        }
        if rest[..len] != record(writer, seq, len)[..] {
            return Err(format!(
                "offset {offset}: record ({writer}, {seq}) of {len} bytes is corrupt"
            ));
        }
        out.push(Found {
            begin: offset,
            end: offset + len as u64,
            writer,
            seq,
        });
        at += len;
    }
    Ok(out)
}

/// Sizes spread log-uniformly over `[min, max]`, so small and large appends
/// are both common without the total volume of a uniform spread.
pub fn log_uniform_size(rng: &mut impl Rng, min: usize, max: usize) -> usize {
    let (lo, hi) = ((min as f64).ln(), (max as f64).ln());
    let x: f64 = rng.gen_range(lo..=hi);
    (x.exp().round() as usize).clamp(min, max)
}

/// Runs a CLI command with `stdin` as its input; returns (exit code, stdout, stderr).
pub fn run_cli(mut cmd: Command, stdin: &[u8]) -> (i32, Vec<u8>, String) {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn rotary");
    let mut input = child.stdin.take().unwrap();
    let data = stdin.to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = input.write_all(&data);
    });
    let out = child.wait_with_output().expect("wait rotary");
    feeder.join().unwrap();
    (
        out.status.code().unwrap_or(-1),
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Stops process `pid` with SIGSTOP and waits until it is stopped (the
/// signal takes effect a moment after `kill` returns), so that nothing it
/// does afterwards races with the caller.
#[allow(unsafe_code)] // kill(2): std signals only with SIGKILL
pub fn stop_process(pid: u32) {
    // SAFETY: signals a child process the test started.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) }, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    // Every thread of it: each stops when it next takes the signal.
    let states = || -> Vec<Option<char>> {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return vec![None];
        };
        tasks
            .flatten()
            .map(|t| {
                let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                // The state follows the command name, in parentheses.
                stat.rsplit_once(')')
                    .and_then(|(_, r)| r.trim_start().chars().next())
            })
            .collect()
    };
    loop {
        let now = states();
        if now.iter().all(|s| *s == Some('T')) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "process {pid} not stopped: {now:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Lets a process stopped by [`stop_process`] run again.
#[allow(unsafe_code)] // kill(2): std signals only with SIGKILL
pub fn continue_process(pid: u32) {
    // SAFETY: signals a child process the test started.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) }, 0);
}

/// Unmounts (lazily) a file system the test mounted.
pub struct Mounted(pub std::path::PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Mounts a tmpfs of `size` (as `mount -o size=`) at `at`; `None` without
/// the right to (not root).
pub fn mount_tmpfs(at: &std::path::Path, size: &str) -> Option<Mounted> {
    std::fs::create_dir_all(at).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(at)
        .status()
        .is_ok_and(|s| s.success());
    ok.then(|| Mounted(at.to_path_buf()))
}

/// `/metrics` of the broker whose HTTP gateway is at `http`.
#[allow(dead_code)] // Not every test binary reads metrics.
pub fn scrape(http: &str) -> String {
    let mut r = ureq::get(&format!("http://{http}/metrics"))
        .call()
        .expect("GET /metrics");
    r.body_mut().read_to_string().unwrap()
}

/// The sum over shards of a counter's samples in a `/metrics` text.
#[allow(dead_code)] // Not every test binary reads metrics.
pub fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// A direct read from `from` to the head; also returns how many fragments
/// came straight from the store.
pub async fn read_direct(client: &Client, journal: &str, from: u64) -> (Vec<u8>, u64) {
    let r = ReadRequest {
        journal: journal.to_string(),
        offset: Some(from),
        end_offset: None,
        route_revision: 0,
    };
    let mut stream = client.read_direct(&r, false);
    let mut out = Vec::new();
    loop {
        match stream.next().await.expect("Done").expect("direct read") {
            ReadEvent::Data { offset, content } => {
                assert_eq!(offset, from + out.len() as u64, "contiguous");
                out.extend_from_slice(&content);
            }
            ReadEvent::Fragment { .. } => panic!("a direct read yields no locations"),
            ReadEvent::Done(d) => {
                assert!(
                    matches!(d.status, Status::OK | Status::OFFSET_NOT_YET_AVAILABLE),
                    "{d:?}"
                );
                assert_eq!(d.offset, from + out.len() as u64);
                break;
            }
        }
    }
    let fetched = stream
        .stats()
        .fragments_fetched
        .load(std::sync::atomic::Ordering::Relaxed);
    let proxied = stream
        .stats()
        .fragments_proxied
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(proxied, 0, "the store is reachable from the test");
    (out, fetched)
}
