//! Seeded simulation of a replicated journal: three in-process brokers of
//! one core each (`Broker::start` with a static cluster file, each on a
//! data directory of its own), one journal of `replication: 3`, driven
//! through its primary over the socket by a seeded workload, while one
//! replica's disk fails chosen operations.
//!
//! A seed fixes the journal (fragment length, `replicated` or `fsync`),
//! the steps (appends of 1 B to 128 KiB, some with an expected offset,
//! right or wrong; a few SEALs), which replica's disk fails, and how: a
//! rate per disk operation of transient errors (EINTR, ENOSPC), and for
//! half the seeds a final EIO at a scheduled call, which parks the
//! replica's copy until it restarts (shard/disk.rs).
//!
//! A model holds the journal as a list of appends, each acknowledged (OK,
//! at the offset its reply named) or "maybe": answered
//! `REPLICATION_FAILED`, which docs/PROTOCOL.md §6.4 says may have
//! committed. After every step: an OK append begins at one of the heads
//! the model allows (its acknowledged bytes plus any subset of the maybes
//! since) and carries its bytes' SHA-1; offsets are never reused (it
//! begins at or after the end of the last acknowledged append); write
//! heads in replies only grow; every reply's write head is one the model
//! allows, and the journal's head is then at least that (a reply names
//! the head readers see; a maybe beyond it that a replica acknowledged
//! may still come back from that replica). A replica whose
//! disk failed for good restarts after the step, as on a replaced disk,
//! and catches up. At the end the faults stop, one more append is made
//! until it is acknowledged, and each broker's own copy is read until all
//! three reach its end (polled, within a generous deadline: this is not a
//! test of speed). Each copy must hold the acknowledged bytes at their
//! offsets and, between them, each maybe append whole or not at all, the
//! same on every member (a replica that missed a maybe the primary
//! holds copies it: `replicas_that_miss_an_append_copy_it`).
//! Then all three restart on their directories and the check runs again,
//! on the same copies.
//!
//! The clock is the real one: the journal seals by length and by SEAL,
//! never by `flush_interval`; time decides only whether a slow replica's
//! ack times out (`replica_ack_timeout`), which makes one more maybe.
//! Which disk call is the n-th can differ between runs of a seed (the
//! engine batches by timing), so a replay meets the same plan, though not
//! always the same faulted call. `ROTARY_SIM_SEED=n` replays one seed and
//! prints every step and answer; `ROTARY_SIM_SEEDS=n` runs seeds 0..n.
#![warn(clippy::too_many_lines)] // Functions under 100 lines, as in the engine.

mod common;

use common::sim::{
    assert_plans_repeat, check, content, env_u64, fault_hash, op_index, over_seeds, sha1_hex,
    splitmix, sum_fields, Expect, OP_NAMES,
};
use common::Conn;
use rand::{rngs::StdRng, Rng, SeedableRng};
use rotary_engine::{Broker, ServeConfig};
use rotary_net::spec::{Durability, JournalSpec};
use rotary_net::status::Status;
use rotary_net::wire::{self, AppendReply, AppendRequest, Op};
use rotary_proto::clock;
use rotary_storage::faults::{DiskOp, Faults};
use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Steps per seed.
const STEPS: usize = 80;
/// Seeds run by `cargo test`.
const CI_SEEDS: u64 = 24;
const APPEND_BYTES_MAX: usize = 128 << 10;
const BROKERS: usize = 3;
const JOURNAL: &str = "sim/replicated";
const ZONES: [&str; BROKERS] = ["a", "b", "c"];
/// How long an answer may take before the step fails.
const REPLY_WAIT: Duration = Duration::from_secs(60);
/// How long the members may take to agree on the journal after a start,
/// and to converge at the end: generous, as the machine is shared.
const SETTLE_WAIT: Duration = Duration::from_secs(120);
/// Possible heads the model tracks at most: each maybe append doubles
/// them, and the workload never makes this many in a row.
const HEADS_MAX: usize = 1 << 12;

// ---------------------------------------------------------------------------
// The plan.

#[derive(Clone, Debug, PartialEq, Eq)]
enum Step {
    Append {
        len: usize,
        fill: u64,
        expect: Expect,
    },
    Seal,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct FaultPlan {
    seed: u64,
    /// Which replica (1 or 2 in the route) has the failing disk.
    replica: usize,
    /// Chance in a million that a call of each operation fails, with
    /// EINTR or ENOSPC. Seals and commit-log writes never fail here: a
    /// failed seal is retried for ever, and a failed restatement brings
    /// a refused append back (both shown by shard_sim's ignored tests).
    ppm: [u32; 6],
    /// A call (operation, n-th) that fails whatever the rate, and its
    /// errno: EIO, a final failure, in the seeds' plans.
    scheduled: Option<(usize, u64, i32)>,
}

impl FaultPlan {
    fn decide(&self, op: usize, n: u64) -> Option<i32> {
        if let Some((_, _, errno)) = self.scheduled.filter(|s| (s.0, s.1) == (op, n)) {
            return Some(errno);
        }
        if self.ppm[op] == 0 {
            return None;
        }
        let h = fault_hash(self.seed, op, n);
        let errno = if h >> 63 == 0 {
            libc::EINTR
        } else {
            libc::ENOSPC
        };
        ((h % 1_000_000) < u64::from(self.ppm[op])).then_some(errno)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Plan {
    seed: u64,
    length: u64,
    fsync: bool,
    steps: Vec<Step>,
    faults: FaultPlan,
}

impl Plan {
    fn new(seed: u64) -> Plan {
        let mut rng = StdRng::seed_from_u64(seed);
        let length = [64 << 10, 256 << 10, 1 << 20][rng.gen_range(0..3usize)];
        let fsync = rng.gen_bool(0.5);
        let steps = (0..STEPS).map(|_| random_step(&mut rng)).collect();
        let mut ppm = [0u32; 6];
        // A replicated journal's spool write is not failed: the broker
        // stops its process at once on one (flusher.rs), which an
        // in-process simulation cannot outlive.
        let ops: &[usize] = if fsync { &[0, 1, 2, 5] } else { &[1, 2, 5] };
        for &op in ops {
            if rng.gen_bool(0.7) {
                ppm[op] = rng.gen_range(0..60_000);
            }
        }
        let scheduled = rng.gen_bool(0.5).then(|| {
            (
                ops[rng.gen_range(0..ops.len())],
                rng.gen_range(5..60),
                libc::EIO,
            )
        });
        let faults = FaultPlan {
            seed,
            replica: rng.gen_range(1..BROKERS),
            ppm,
            scheduled,
        };
        Plan {
            seed,
            length,
            fsync,
            steps,
            faults,
        }
    }

    fn spec(&self) -> JournalSpec {
        let mut spec = JournalSpec::new(JOURNAL);
        spec.replication = BROKERS as u32;
        spec.fragment.length = self.length;
        spec.fragment.flush_interval = Duration::ZERO;
        if self.fsync {
            spec.durability = Durability::Fsync;
        }
        spec
    }
}

fn random_step(rng: &mut StdRng) -> Step {
    if rng.gen_range(0..100) < 6 {
        return Step::Seal;
    }
    let len = match rng.gen_range(0..100) {
        0..=44 => rng.gen_range(1..=512),
        45..=79 => rng.gen_range(513..=16 << 10),
        _ => rng.gen_range((16 << 10) + 1..=APPEND_BYTES_MAX),
    };
    let expect = match rng.gen_range(0..100) {
        0..=59 => Expect::Any,
        60..=89 => Expect::Head,
        _ => Expect::Off([-1, 1, 4096][rng.gen_range(0..3usize)]),
    };
    Step::Append {
        len,
        fill: rng.gen(),
        expect,
    }
}

// ---------------------------------------------------------------------------
// The failing disk of one replica.

struct Injector {
    plan: FaultPlan,
    armed: AtomicBool,
    trace: bool,
    calls: [AtomicU64; 6],
    fired: AtomicU64,
    eio_fired: AtomicBool,
}

impl Injector {
    fn new(plan: FaultPlan, trace: bool) -> Injector {
        Injector {
            plan,
            armed: AtomicBool::new(false),
            trace,
            calls: Default::default(),
            fired: AtomicU64::new(0),
            eio_fired: AtomicBool::new(false),
        }
    }
}

impl Faults for Injector {
    fn check(&self, op: DiskOp, path: &Path) -> Option<i32> {
        if !self.armed.load(Ordering::SeqCst) {
            return None;
        }
        let op = op_index(op);
        let n = self.calls[op].fetch_add(1, Ordering::SeqCst);
        let errno = self.plan.decide(op, n)?;
        self.fired.fetch_add(1, Ordering::SeqCst);
        if errno == libc::EIO {
            self.eio_fired.store(true, Ordering::SeqCst);
        }
        if self.trace {
            eprintln!(
                "  fault: {} call {n} fails with errno {errno} ({})",
                OP_NAMES[op],
                path.display()
            );
        }
        Some(errno)
    }
}

// ---------------------------------------------------------------------------
// The wire client is common/wire.rs; a member's copy is read with it here.

impl Conn {
    /// The broker's own copy of the journal from `offset` as far as
    /// non-blocking reads go (until one is refused), or where it has a
    /// gap.
    fn read_copy(&mut self, offset: u64) -> Result<Copy, String> {
        let mut copy = Copy::default();
        loop {
            let from = offset + copy.bytes.len() as u64;
            let frames = self.read(JOURNAL, from);
            let before = copy.bytes.len();
            for (at, payload) in frames.data {
                let due = offset + copy.bytes.len() as u64;
                if at < due {
                    return Err(format!("READ_DATA at {at} where {due} was due"));
                }
                if at > due {
                    // Reads skip what the broker does not hold.
                    copy.holes.push((due, at));
                    copy.bytes.resize(at as usize, 0);
                }
                copy.bytes.extend_from_slice(&payload);
            }
            if frames.done.status != Some(Status::OK) || copy.bytes.len() == before {
                return Ok(copy);
            }
        }
    }
}

/// A member's copy of the journal as its reads give it: the spans it
/// skipped (`holes`) are zeros in `bytes`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Copy {
    bytes: Vec<u8>,
    holes: Vec<(u64, u64)>,
}

impl Copy {
    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// Whether `[at, at + len)` holds `want`, no hole in it.
    fn holds(&self, at: usize, want: &[u8]) -> bool {
        let end = (at + want.len()) as u64;
        self.bytes.get(at..at + want.len()) == Some(want)
            && !self.holes.iter().any(|&(b, e)| b < end && (at as u64) < e)
    }

    fn is_hole(&self, at: usize, len: usize) -> bool {
        self.holes.contains(&(at as u64, (at + len) as u64))
    }
}

/// What became of a maybe append on a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Present,
    Absent,
    /// The member's reads skip its span: it missed the append, which
    /// other members hold (see `replicas_that_miss_an_append_copy_it`).
    Hole,
}

// ---------------------------------------------------------------------------
// The model.

/// One append the broker answered OK (`begin` known) or
/// `REPLICATION_FAILED` (`begin` unknown: it may have committed).
#[derive(Clone, Debug)]
struct Entry {
    fill: u64,
    len: usize,
    begin: Option<u64>,
}

#[derive(Default)]
struct Model {
    entries: Vec<Entry>,
    /// The heads the journal may have now: the end of the last
    /// acknowledged append plus any subset of the maybes since.
    heads: BTreeSet<u64>,
    /// The end of the last acknowledged append.
    acked_end: u64,
    /// The largest write head any reply named.
    head_seen: u64,
    /// The write head of the last reply that named one.
    last_head: u64,
    /// The lengths of the maybes answered with write head `pending_at`:
    /// one of them may still commit there (see `heads_after_reply`).
    pending: Vec<u64>,
    pending_at: u64,
}

impl Model {
    fn new() -> Model {
        Model {
            heads: BTreeSet::from([0]),
            ..Model::default()
        }
    }

    fn acked(&mut self, fill: u64, len: usize, begin: u64) {
        self.entries.push(Entry {
            fill,
            len,
            begin: Some(begin),
        });
        self.acked_end = begin + len as u64;
        self.heads = BTreeSet::from([self.acked_end]);
    }

    /// A reply named write head `head`, the head readers see: what the
    /// journal may hold from now on. An OK leaves `head` alone. A failure
    /// decides every maybe before `head`; one beyond it may still commit
    /// (the primary took it back, but a replica that acknowledged it keeps
    /// it and the next SYNC copies it from there, PROTOCOL.md §14.7), yet
    /// only one of those answered at this same head: a maybe staged after
    /// another was staged after a SYNC, which would have brought the other
    /// back and moved the head past it. (A maybe refused at its SYNC was
    /// never staged; counting it too only allows more.)
    /// `maybe`: the reply answered the last maybe appended (any other
    /// refusal committed nothing).
    fn heads_after_reply(&mut self, head: u64, ok: bool, maybe: bool) {
        if ok {
            self.pending.clear();
            self.heads = BTreeSet::from([head]);
            return;
        }
        if self.pending_at != head {
            self.pending.clear();
            self.pending_at = head;
        }
        if maybe {
            let len = self.entries.last().map_or(0, |e| e.len as u64);
            self.pending.push(len);
        }
        self.heads = std::iter::once(head)
            .chain(self.pending.iter().map(|l| head + l))
            .collect();
    }

    fn maybe(&mut self, fill: u64, len: usize) {
        self.entries.push(Entry {
            fill,
            len,
            begin: None,
        });
        let grown: Vec<u64> = self.heads.iter().map(|h| h + len as u64).collect();
        self.heads.extend(grown);
        assert!(
            self.heads.len() <= HEADS_MAX,
            "too many maybe appends in a row"
        );
    }

    /// Matches a member's copy against the entries: every acknowledged
    /// append at its offset, each maybe whole or absent (or, with
    /// `holes`, skipped by reads). Returns the maybes' fates, or why the
    /// copy is wrong.
    fn explain(&self, copy: &Copy, holes: bool) -> Result<Vec<Fate>, String> {
        let mut fates = Vec::new();
        if self.explain_from(copy, holes, 0, 0, &mut fates) {
            return Ok(fates);
        }
        let mut at = 0u64;
        for e in &self.entries {
            let Some(begin) = e.begin else { continue };
            let end = begin + e.len as u64;
            if !copy.holds(begin as usize, &content(e.fill, e.len)) {
                return Err(format!(
                    "the append acknowledged at [{begin}, {end}) is not there (the copy holds \
                     {} bytes, skipping {:?}; the acknowledged append before it ended at {at})",
                    copy.len(),
                    copy.holes
                ));
            }
            at = end;
        }
        Err(format!(
            "every acknowledged append is there, but no choice of maybe appends fills the gaps \
             between them, or the copy's {} bytes after {at} (skipping {:?})",
            copy.len(),
            copy.holes
        ))
    }

    /// Whether the copy from `at` is entries `i..`, each maybe present,
    /// absent or (with `holes`) skipped; `fates` collects the choices.
    /// Tries "present" first: a maybe's random bytes can match what
    /// follows it by chance, which the next acknowledged offset refutes.
    fn explain_from(
        &self,
        copy: &Copy,
        holes: bool,
        i: usize,
        at: usize,
        fates: &mut Vec<Fate>,
    ) -> bool {
        let Some(e) = self.entries.get(i) else {
            return at as u64 == copy.len();
        };
        let here = copy.holds(at, &content(e.fill, e.len));
        if let Some(begin) = e.begin {
            return here
                && begin == at as u64
                && self.explain_from(copy, holes, i + 1, at + e.len, fates);
        }
        let skipped = holes && copy.is_hole(at, e.len);
        for (fate, ok, next) in [
            (Fate::Present, here, at + e.len),
            (Fate::Hole, skipped, at + e.len),
            (Fate::Absent, true, at),
        ] {
            if !ok {
                continue;
            }
            fates.push(fate);
            if self.explain_from(copy, holes, i + 1, next, fates) {
                return true;
            }
            fates.pop();
        }
        false
    }
}

// ---------------------------------------------------------------------------
// The simulation.

#[derive(Clone, Debug, Default)]
struct Stats {
    ok: u64,
    bytes: u64,
    maybes: u64,
    refused: u64,
    seals: u64,
    faults: u64,
    parked: u64,
    maybes_present: u64,
    /// Maybe appends replicas' reads skip, at the end.
    holes: u64,
    /// The longest run of appends answered `REPLICATION_FAILED` with the
    /// same message (write heads aside), and that message.
    stuck_max: u64,
    stuck_message: String,
    /// The run going on, and its message.
    stuck: u64,
    stuck_now: String,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        sum_fields!(self, o; ok, bytes, maybes, refused, seals, faults, parked, maybes_present, holes);
        if o.stuck_max > self.stuck_max {
            self.stuck_max = o.stuck_max;
            self.stuck_message.clone_from(&o.stuck_message);
        }
    }
}

struct Member {
    id: String,
    dir: tempfile::TempDir,
    endpoint: SocketAddr,
    injector: Arc<Injector>,
    broker: Option<Broker>,
}

struct Sim<'p> {
    plan: &'p Plan,
    /// Holds the cluster file.
    dir: tempfile::TempDir,
    members: Vec<Member>,
    /// Index in `members` of the journal's primary, then of the faulty
    /// replica.
    primary: usize,
    faulty: usize,
    c: Option<Conn>,
    model: Model,
    st: Stats,
    trace: bool,
    /// Let replicas' reads skip maybe appends the primary holds.
    holes_allowed: bool,
    /// Restart a replica whose disk failed for good.
    replace_disks: bool,
    /// The message of the last append's reply.
    last_message: String,
    step: usize,
}

impl Drop for Sim<'_> {
    fn drop(&mut self) {
        self.c = None;
        for m in &mut self.members {
            m.injector.armed.store(false, Ordering::SeqCst);
            if let Some(b) = m.broker.take() {
                b.shutdown();
            }
        }
    }
}

/// A port that was free a moment ago.
fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

impl<'p> Sim<'p> {
    fn new(plan: &'p Plan, trace: bool) -> Sim<'p> {
        let members = (0..BROKERS)
            .map(|i| Member {
                id: format!("b{}", i + 1),
                dir: tempfile::tempdir().unwrap(),
                endpoint: free_port(),
                injector: Arc::new(Injector::new(plan.faults.clone(), trace)),
                broker: None,
            })
            .collect();
        let mut sim = Sim {
            plan,
            dir: tempfile::tempdir().unwrap(),
            members,
            primary: 0,
            faulty: 0,
            c: None,
            model: Model::new(),
            st: Stats::default(),
            trace,
            holes_allowed: true,
            replace_disks: true,
            last_message: String::new(),
            step: 0,
        };
        sim.write_cluster_file();
        for i in 0..BROKERS {
            sim.start(i);
        }
        let route = sim.settle();
        sim.primary = sim.index(&route[0]);
        sim.faulty = sim.index(&route[plan.faults.replica]);
        if trace {
            eprintln!(
                "route {route:?}; the disk of {} fails",
                sim.members[sim.faulty].id
            );
        }
        sim.connect();
        sim
    }

    /// The cluster file, in YAML's JSON form.
    fn write_cluster_file(&self) {
        let brokers: Vec<serde_json::Value> = self
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| {
                serde_json::json!({
                    "id": m.id,
                    "zone": ZONES[i],
                    "endpoint": m.endpoint.to_string(),
                })
            })
            .collect();
        let text = serde_json::json!({ "brokers": brokers, "journals": [self.plan.spec()] });
        std::fs::write(self.cluster_file(), text.to_string()).unwrap();
    }

    fn cluster_file(&self) -> std::path::PathBuf {
        self.dir.path().join("cluster.yaml")
    }

    fn index(&self, id: &str) -> usize {
        self.members.iter().position(|m| m.id == id).unwrap()
    }

    /// Starts member `i` on its data directory (its port may still be
    /// held a moment after the previous run stopped).
    fn start(&mut self, i: usize) {
        let m = &self.members[i];
        assert!(m.broker.is_none());
        let mut attempt = 0;
        let broker = loop {
            let mut cfg = ServeConfig::new(m.dir.path().join("data"), m.endpoint);
            cfg.cores = 1;
            cfg.disk_reserve_bytes = 0;
            cfg.upload_threads = 1;
            cfg.cluster = Some((self.cluster_file(), m.id.clone()));
            // Small steps: spools grow (and may fail to) often.
            cfg.spool_sizing.buffer_bytes = 1 << 20;
            cfg.spool_sizing.grow_bytes = 1 << 20;
            cfg.faults = Some(m.injector.clone());
            match Broker::start(cfg) {
                Ok(b) => break b,
                Err(e) if attempt < 20 => {
                    attempt += 1;
                    eprintln!("{}: start attempt {attempt} failed ({e}); retrying", m.id);
                    std::thread::sleep(Duration::from_millis(250));
                }
                Err(e) => panic!("{} did not start: {e}", m.id),
            }
        };
        self.members[i].broker = Some(broker);
    }

    fn stop(&mut self, i: usize) {
        self.members[i]
            .injector
            .armed
            .store(false, Ordering::SeqCst);
        if i == self.primary {
            self.c = None;
        }
        self.members[i].broker.take().expect("it runs").shutdown();
    }

    fn connect(&mut self) {
        self.c = Some(Conn::with_wait(
            self.members[self.primary].endpoint,
            REPLY_WAIT,
        ));
    }

    /// Waits until every member lists the journal with its whole route,
    /// the same on all; returns the route's members, primary first.
    fn settle(&self) -> Vec<String> {
        let deadline = clock::now() + SETTLE_WAIT;
        let mut routes = Vec::new();
        for m in &self.members {
            let mut c = Conn::with_wait(m.endpoint, REPLY_WAIT);
            loop {
                let r = c.admin(Op::LIST, &[], b"{}");
                assert_eq!(r.status, Some(Status::OK), "LIST on {}", m.id);
                let list: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
                let members: Vec<String> = list
                    .as_array()
                    .and_then(|l| l.iter().find(|j| j["spec"]["name"] == JOURNAL))
                    .and_then(|j| j["route"]["members"].as_array())
                    .map(|ms| ms.iter().map(|x| x.as_str().unwrap().to_string()).collect())
                    .unwrap_or_default();
                if members.len() == BROKERS {
                    routes.push(members);
                    break;
                }
                assert!(
                    clock::now() < deadline,
                    "{} has no whole route for {JOURNAL}: {list}",
                    m.id
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        assert!(
            routes.windows(2).all(|w| w[0] == w[1]),
            "members disagree on the route: {routes:?}"
        );
        routes.swap_remove(0)
    }

    fn run(&mut self) {
        self.members[self.faulty]
            .injector
            .armed
            .store(true, Ordering::SeqCst);
        for (i, step) in self.plan.steps.iter().enumerate() {
            self.step = i;
            if self.trace {
                eprintln!("step {i}: {step:?}");
            }
            match *step {
                Step::Append {
                    len,
                    fill,
                    ref expect,
                } => {
                    let expect = match expect {
                        Expect::Any => None,
                        Expect::Head => Some(self.model.last_head),
                        Expect::Off(d) => Some(self.model.last_head.saturating_add_signed(*d)),
                    };
                    self.append(fill, len, expect);
                }
                Step::Seal => self.seal(),
            }
            self.replace_failed_disk();
        }
        self.step = self.plan.steps.len();
        self.finish();
    }
}

impl Sim<'_> {
    fn c(&mut self) -> &mut Conn {
        self.c.as_mut().expect("the primary runs")
    }

    /// Appends `len` bytes of `fill` through the primary and checks the
    /// answer against the model; returns its status.
    fn append(&mut self, fill: u64, len: usize, expect: Option<u64>) -> Option<Status> {
        let bytes = content(fill, len);
        let req = AppendRequest {
            journal: JOURNAL.into(),
            expect_offset: expect,
            ..Default::default()
        };
        self.c().request(Op::APPEND, &req.encode(), &bytes);
        let r = self.c().recv();
        check!(self, r.op == Op::APPEND_REPLY, "APPEND answered {:?}", r.op);
        let reply = (!r.meta.is_empty()).then(|| AppendReply::decode(&r.meta).unwrap());
        self.last_message = String::from_utf8_lossy(&r.payload).into_owned();
        if self.trace {
            eprintln!(
                "  -> {} {:?} {}",
                r.status_name(),
                reply.as_ref().map(|a| (a.begin, a.end, a.write_head)),
                String::from_utf8_lossy(&r.payload)
            );
        }
        match r.status {
            Some(Status::OK) => {
                let a = reply.clone().expect("an OK append's reply has meta");
                self.check_ok(&a, &bytes, expect);
                self.model.acked(fill, len, a.begin);
                self.st.stuck = 0;
                self.st.ok += 1;
                self.st.bytes += len as u64;
            }
            Some(Status::REPLICATION_FAILED) => {
                self.model.maybe(fill, len);
                self.st.maybes += 1;
                self.note_stuck(r.status_name() + ": " + &self.last_message.clone());
            }
            _ => {
                check!(
                    self,
                    r.status == Some(Status::WRONG_APPEND_OFFSET) || self.faults_fired(),
                    "APPEND answered {} ({}) on a sound disk",
                    r.status_name(),
                    String::from_utf8_lossy(&r.payload)
                );
                self.st.refused += 1;
            }
        }
        if let Some(a) = &reply {
            self.check_head(a.write_head, &r.status_name());
        }
        r.status
    }

    /// Counts appends refused in a row for the same reason.
    fn note_stuck(&mut self, message: String) {
        self.st.stuck = if message == self.st.stuck_now {
            self.st.stuck + 1
        } else {
            1
        };
        self.st.stuck_now.clone_from(&message);
        if self.st.stuck > self.st.stuck_max {
            self.st.stuck_max = self.st.stuck;
            self.st.stuck_message = message;
        }
    }

    fn faults_fired(&self) -> bool {
        self.members[self.faulty]
            .injector
            .fired
            .load(Ordering::SeqCst)
            > 0
    }

    /// An OK append: at a head the model allows, after every offset
    /// acknowledged before, whole, with its bytes' SHA-1.
    fn check_ok(&self, a: &AppendReply, bytes: &[u8], expect: Option<u64>) {
        let m = &self.model;
        check!(
            self,
            m.heads.contains(&a.begin) && a.begin >= m.acked_end,
            "an append acknowledged at {}; the model's heads are {:?}",
            a.begin,
            m.heads
        );
        check!(
            self,
            a.end == a.begin + bytes.len() as u64 && a.write_head == a.end,
            "an append of {} bytes acknowledged as [{}, {}), write head {}",
            bytes.len(),
            a.begin,
            a.end,
            a.write_head
        );
        check!(
            self,
            expect.is_none_or(|e| e == a.begin),
            "an append expecting offset {expect:?} acknowledged at {}",
            a.begin
        );
        check!(
            self,
            hex::encode(a.sha1) == sha1_hex(bytes),
            "an append acknowledged with another SHA-1"
        );
    }

    /// A reply's write head: one the model allows, never behind one named
    /// before.
    fn check_head(&mut self, head: u64, status: &str) {
        check!(
            self,
            head >= self.model.head_seen,
            "{status} named write head {head}, behind {} named before",
            self.model.head_seen
        );
        check!(
            self,
            self.model.heads.contains(&head),
            "{status} named write head {head}; the model's heads are {:?}",
            self.model.heads
        );
        self.model
            .heads_after_reply(head, status == "OK", status == "REPLICATION_FAILED");
        self.model.head_seen = head;
        self.model.last_head = head;
    }

    fn seal(&mut self) {
        self.st.seals += 1;
        let r = self.c().admin(Op::SEAL, &wire::encode_name(JOURNAL), &[]);
        if self.trace {
            eprintln!(
                "  -> {} {}",
                r.status_name(),
                String::from_utf8_lossy(&r.payload)
            );
        }
        check!(
            self,
            r.status == Some(Status::OK) || self.faults_fired(),
            "SEAL answered {} on a sound disk",
            r.status_name()
        );
    }
}

impl Sim<'_> {
    /// Stops the faults, restarts a replica whose copy they parked (as
    /// on a replaced disk), appends until an append is acknowledged, and
    /// checks every member's copy; then restarts all three and checks
    /// again.
    fn finish(&mut self) {
        let inj = self.members[self.faulty].injector.clone();
        inj.armed.store(false, Ordering::SeqCst);
        self.st.faults += inj.fired.load(Ordering::SeqCst);
        self.replace_failed_disk();
        self.last_append();
        let copies = self.converge();
        for i in 0..BROKERS {
            self.stop(i);
        }
        for i in 0..BROKERS {
            self.start(i);
        }
        let route = self.settle();
        check!(
            self,
            route[0] == self.members[self.primary].id,
            "after a restart the route is {route:?}"
        );
        self.connect();
        let again = self.converge();
        check!(
            self,
            copies == again,
            "after a restart of all three, the copies differ from before"
        );
    }

    /// Restarts the faulty replica once its disk failed for good, as an
    /// operator who replaced the disk would, with the transient faults
    /// still armed: it rejoins the route and catches up. (A parked
    /// replica left running refuses its primary's SYNCs `DISK_FAILED`, so
    /// every append fails at once: see
    /// `a_parked_replica_refuses_appends_at_once`.)
    fn replace_failed_disk(&mut self) {
        let inj = self.members[self.faulty].injector.clone();
        if !self.replace_disks || !inj.eio_fired.swap(false, Ordering::SeqCst) {
            return;
        }
        self.st.parked += 1;
        if self.trace {
            eprintln!(
                "restarting {}, whose disk failed for good",
                self.members[self.faulty].id
            );
        }
        let armed = inj.armed.load(Ordering::SeqCst);
        self.stop(self.faulty);
        self.start(self.faulty);
        self.settle();
        inj.armed.store(armed, Ordering::SeqCst);
    }

    /// Appends until the primary acknowledges an append: replicas that
    /// missed appends catch up before it commits.
    fn last_append(&mut self) {
        let deadline = clock::now() + SETTLE_WAIT;
        for attempt in 0.. {
            if self.trace {
                eprintln!("last append, attempt {attempt}");
            }
            let fill = splitmix(self.plan.seed ^ (attempt + 1));
            if self.append(fill, 100, None) == Some(Status::OK) {
                return;
            }
            check!(
                self,
                clock::now() < deadline,
                "no append acknowledged within {SETTLE_WAIT:?} of the faults' end"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Reads each member's own copy until all reach the last
    /// acknowledged append's end; checks each against the model, and the
    /// maybes' fate the same on all (bar holes, where allowed, on
    /// replicas). Returns the copies.
    fn converge(&mut self) -> Vec<Copy> {
        let end = self.model.acked_end;
        let deadline = clock::now() + SETTLE_WAIT;
        let mut copies = Vec::new();
        for m in &self.members {
            let mut c = Conn::with_wait(m.endpoint, REPLY_WAIT);
            let copy = loop {
                let copy = c.read_copy(0).unwrap_or_else(|why| {
                    panic!(
                        "model check failed at the end of seed {}: {}'s copy: {why}",
                        self.plan.seed, m.id
                    )
                });
                if copy.len() >= end || clock::now() >= deadline {
                    break copy;
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            check!(
                self,
                copy.len() == end,
                "{} holds {} bytes; the last acknowledged append ends at {end}",
                m.id,
                copy.len()
            );
            copies.push(copy);
        }
        let primary = self.model.explain(&copies[self.primary], false);
        let primary = primary.unwrap_or_else(|why| {
            panic!(
                "model check failed at the end of seed {}: the primary's copy: {why}",
                self.plan.seed
            )
        });
        for (i, copy) in copies.iter().enumerate() {
            let id = &self.members[i].id;
            let fates = self
                .model
                .explain(copy, self.holes_allowed)
                .unwrap_or_else(|why| {
                    panic!(
                        "model check failed at the end of seed {}: {id}'s copy: {why}",
                        self.plan.seed
                    )
                });
            let agree = fates
                .iter()
                .zip(&primary)
                .all(|(f, p)| f == p || (*f == Fate::Hole && *p == Fate::Present));
            check!(
                self,
                agree,
                "{id}'s copy ({} bytes, SHA-1 {}, maybes {fates:?}, skipping {:?}) differs from the \
                 primary's ({} bytes, SHA-1 {}, maybes {primary:?})",
                copy.len(),
                sha1_hex(&copy.bytes),
                copy.holes,
                copies[self.primary].len(),
                sha1_hex(&copies[self.primary].bytes)
            );
            self.st.holes += fates.iter().filter(|f| **f == Fate::Hole).count() as u64;
        }
        self.st.maybes_present = primary.iter().filter(|f| **f == Fate::Present).count() as u64;
        copies
    }
}

// ---------------------------------------------------------------------------
// Runs and tests.

fn run(seed: u64, trace: bool) -> Stats {
    run_plan(&Plan::new(seed), trace, false)
}

/// Runs a plan; `holes` lets replicas' reads skip maybe appends.
fn run_plan(plan: &Plan, trace: bool, holes: bool) -> Stats {
    if trace {
        eprintln!("seed {}: {plan:?}", plan.seed);
    }
    let mut sim = Sim::new(plan, trace);
    sim.holes_allowed = holes;
    sim.run();
    std::mem::take(&mut sim.st)
}

/// Runs a seed; a failure names the seed and how to replay it.
fn run_seed(seed: u64) -> Stats {
    common::sim::run_seed("cluster_sim", seed, || run(seed, false))
}

#[test]
fn seeded_replicated_journals_keep_every_acknowledged_byte() {
    if let Some(seed) = env_u64("ROTARY_SIM_SEED") {
        let st = run(seed, true);
        eprintln!("seed {seed}: {st:#?}");
        return;
    }
    let (total, seeds) = over_seeds("cluster_sim", CI_SEEDS, run_seed, Stats::add);
    // The workload did what it is for.
    let t = &total;
    assert!(t.ok > 20 * seeds && t.bytes > 1 << 20, "{t:?}");
    assert!(t.faults > 0 && t.seals > 0, "{t:?}");
}

#[test]
fn a_seeds_plan_is_the_same_on_every_run() {
    assert_plans_repeat(Plan::new, |p, op, n| p.faults.decide(op, n));
    assert_ne!(Plan::new(1), Plan::new(2));
    let plans: Vec<Plan> = (0..50).map(Plan::new).collect();
    assert!(plans.iter().any(|p| p.faults.scheduled.is_some()));
    assert!(plans.iter().any(|p| p.faults.scheduled.is_none()));
    assert!(plans.iter().any(|p| p.fsync) && plans.iter().any(|p| !p.fsync));
}

#[test]
fn the_model_tells_maybe_appends_apart() {
    let mut m = Model::new();
    m.acked(1, 10, 0);
    m.maybe(2, 5);
    m.maybe(3, 1);
    m.acked(4, 7, 11);
    let (a, b, c, d) = (content(1, 10), content(2, 5), content(3, 1), content(4, 7));
    let copy = |parts: &[&[u8]]| Copy {
        bytes: parts.concat(),
        holes: Vec::new(),
    };
    use Fate::*;
    assert_eq!(
        m.explain(&copy(&[&a, &c, &d]), false),
        Ok(vec![Absent, Present])
    );
    assert!(
        m.explain(&copy(&[&a, &b, &d]), false).is_err(),
        "an acknowledged append moved"
    );
    assert!(
        m.explain(&copy(&[&a, &b[..4], &c, &d]), false).is_err(),
        "part of a maybe"
    );
    assert!(
        m.explain(&copy(&[&a, &c, &d, b"x"]), false).is_err(),
        "bytes past the end"
    );
    assert!(
        m.explain(&copy(&[&a, &c]), false).is_err(),
        "an acknowledged append lost"
    );
    // A replica's read that skips the 1-byte maybe.
    let mut skipped = copy(&[&a, &[0], &d]);
    skipped.holes.push((10, 11));
    assert!(
        m.explain(&skipped, false).is_err(),
        "a hole where none is allowed"
    );
    assert_eq!(m.explain(&skipped, true), Ok(vec![Absent, Hole]));
    skipped.holes = vec![(12, 13)];
    assert!(
        m.explain(&skipped, true).is_err(),
        "a hole in an acknowledged append"
    );
}

/// A plan of `appends` (lengths) on an `fsync` journal, with one disk
/// call of the faulty replica failing.
fn focused_plan(appends: &[usize], fault: (usize, u64, i32)) -> Plan {
    let mut plan = Plan::new(0);
    plan.fsync = true;
    plan.length = 1 << 20;
    plan.steps = appends
        .iter()
        .enumerate()
        .map(|(i, &len)| Step::Append {
            len,
            fill: i as u64 + 1,
            expect: Expect::Any,
        })
        .collect();
    plan.faults.ppm = [0; 6];
    plan.faults.scheduled = Some(fault);
    plan
}

/// A replica whose spool write of a journal's first append fails
/// (transiently: EINTR) misses that append, which the primary committed
/// and answered `REPLICATION_FAILED`. At the primary's next SYNC the
/// replica, holding nothing of the journal yet, copies what it missed
/// from the primary (`fill_from_primary`, shard/replica.rs). It once
/// took itself for a member just added and started at the primary's head
/// without copying: its reads skipped those bytes for good (no store
/// held them) while the other members served them. Seed 24 of the
/// simulation met it.
#[test]
fn replicas_that_miss_an_append_copy_it() {
    let plan = focused_plan(&[222, 36, 1000], (0, 0, libc::EINTR));
    run_plan(&plan, std::env::var_os("ROTARY_SIM_TRACE").is_some(), false);
}

/// As above, but the replica's copy of what it missed fails (a directory
/// stands where the copy's file goes). The replica refuses that SYNC
/// (`IO_ERROR`, naming the copy) and the primary's append fails
/// `REPLICATION_FAILED`; it once took the primary's head all the same and
/// its reads skipped the missed bytes for good. Once the copy can be
/// made, a later SYNC makes it, and every member holds the same bytes.
#[test]
fn a_replica_whose_copy_fails_refuses_the_sync() {
    let plan = focused_plan(&[], (0, 0, libc::EINTR));
    let mut sim = Sim::new(&plan, std::env::var_os("ROTARY_SIM_TRACE").is_some());
    sim.holes_allowed = false;
    let faulty = &sim.members[sim.faulty];
    faulty.injector.armed.store(true, Ordering::SeqCst);
    let journal_dir = faulty
        .dir
        .path()
        .join("data/shard-0/journals")
        .join(JOURNAL);
    assert_eq!(sim.append(1, 222, None), Some(Status::REPLICATION_FAILED));
    let blocker = journal_dir.join("@/0000000000000000.copying");
    std::fs::create_dir_all(&blocker).unwrap();
    assert_eq!(sim.append(2, 36, None), Some(Status::REPLICATION_FAILED));
    assert!(
        sim.last_message.contains("which this replica missed"),
        "{}",
        sim.last_message
    );
    std::fs::remove_dir(&blocker).unwrap();
    let mut tries = 0;
    while sim.append(3 + tries, 1000, None) != Some(Status::OK) {
        tries += 1;
        assert!(tries < 50, "no append committed: {}", sim.last_message);
        std::thread::sleep(Duration::from_millis(100));
    }
    sim.finish();
}

/// A replica whose disk failed for good under the journal (EIO) parks
/// its copy and refuses the append at hand `DISK_FAILED`. The next
/// append's SYNC is refused `DISK_FAILED` at once, so the primary answers
/// `REPLICATION_FAILED` naming the failed disk without waiting out its
/// replica ack timeout (10 s), as it did when the SYNC went unanswered.
#[test]
fn a_parked_replica_refuses_appends_at_once() {
    let plan = focused_plan(&[100, 100], (0, 0, libc::EIO));
    let mut sim = Sim::new(&plan, false);
    sim.replace_disks = false;
    sim.members[sim.faulty]
        .injector
        .armed
        .store(true, Ordering::SeqCst);
    assert_eq!(sim.append(1, 100, None), Some(Status::REPLICATION_FAILED));
    assert!(
        sim.last_message.contains("DISK_FAILED"),
        "{}",
        sim.last_message
    );
    let status = sim.append(2, 100, None);
    assert!(
        sim.last_message.contains("DISK_FAILED"),
        "{status:?}: {}",
        sim.last_message
    );
}

/// A replica whose disk failed for good restarts (as on a replaced disk)
/// while its primary runs. The primary's next append finds its pipeline
/// broken at the SYNC, connects again (`Shard::sync_member`), and
/// commits. It once answered that append `REPLICATION_FAILED`
/// "connection to replica … is broken", and every append after it for
/// its SYNC retry delay with that failure (28 in a row in seed 5 of the
/// simulation, until a SEAL of the journal).
#[test]
fn a_primary_reconnects_to_a_restarted_replica() {
    const APPENDS_MAX: u64 = 10;
    for round in 0..6 {
        let plan = focused_plan(&[100], (1, 0, libc::EIO));
        let mut sim = Sim::new(&plan, std::env::var_os("ROTARY_SIM_TRACE").is_some());
        for n in 0..5 {
            assert_eq!(sim.append(100 + n, 30_000, None), Some(Status::OK));
        }
        sim.members[sim.faulty]
            .injector
            .armed
            .store(true, Ordering::SeqCst);
        assert_eq!(
            sim.append(1, 30_000, None),
            Some(Status::REPLICATION_FAILED)
        );
        sim.replace_failed_disk();
        let mut broken = 0;
        for n in 0..2 * APPENDS_MAX {
            if sim.append(n + 2, 100, None) == Some(Status::OK) || broken == APPENDS_MAX {
                break;
            }
            // Other failures (the replica not listening yet) may pass.
            if sim.last_message.contains("is broken") {
                broken += 1;
            } else {
                broken = 0;
            }
        }
        assert!(
            broken < APPENDS_MAX,
            "round {round}: {broken} appends in a row failed on the broken pipeline"
        );
    }
}

/// A replica whose spool fdatasync fails once, transiently (ENOSPC),
/// while it seals at its primary's SYNC tries the seal again at once. It
/// once answered that SYNC `IO_ERROR` "sealing the replica's spool
/// failed", and the primary then answered every append for its SYNC retry
/// delay with that failure (39 in a row in seed 3). A transient error
/// should cost no append, not the journal's availability.
#[test]
fn a_replica_seals_again_after_a_transient_error() {
    let st = run(3, false);
    assert!(
        st.stuck_max < 10,
        "{} appends in a row answered {}",
        st.stuck_max,
        st.stuck_message
    );
}
