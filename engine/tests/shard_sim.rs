//! Seeded simulation of a shard: an in-process broker of one core, driven
//! over its socket by a seeded workload, with a manual clock and (where
//! the seed says so) a disk that fails chosen operations.
//!
//! A seed fixes everything the simulation chooses: three journals (small
//! fragments so that spools seal often; one in `fsync` mode; one with a
//! `max_append_rate`), a list of steps (appends of 0 B to 256 KiB, in one
//! frame or streamed in chunks, some cancelled by their client or cut off
//! by a closed connection, some with an expected offset, right or wrong,
//! some checking or changing registers; SEALs; reads from seeded offsets;
//! moves of the clock across `flush_interval` boundaries; deletions and
//! re-creations of a journal; a restart at a seeded midpoint) and a fault
//! plan: which calls of each disk operation fail, with which errno (EIO,
//! ENOSPC, or the transient EINTR and EAGAIN), as a pure function of the
//! seed, the operation and its count.
//!
//! A model holds each journal's committed bytes and registers. After every
//! step the broker's answers are checked against it, as docs/PROTOCOL.md
//! promises them (§6.2, §6.4): an append answered OK committed whole at
//! the model's head, with the SHA-1 of its bytes and the model's
//! registers; an append answered with any other status committed nothing
//! (its reply names the model's head, and a read there finds nothing);
//! offsets are never reused and write heads only grow; reads return the
//! model's bytes; a sealed fragment holds the model's bytes. While no
//! fault has touched a journal, its statuses must be exactly those the
//! model predicts (OK, `WRONG_APPEND_OFFSET`, `REGISTER_MISMATCH`,
//! `BAD_REQUEST`, `CANCELLED`); once one has, any status may answer, but
//! the promises above still hold. At the seeded midpoint and at the end
//! the broker stops and a new one starts on the same directory without
//! faults (at the midpoint of half the seeds, on a copy of the directory
//! taken while the broker still ran, as a crash would leave it): it serves
//! every acknowledged byte at its offset (the SHA-1 of each whole journal
//! is the model's), its registers, and local fragments that tile the
//! journal with the model's SHA-1s.
//!
//! The clock is manual (`ServeConfig::clock`): seals at `flush_interval`
//! boundaries and the append rate limit decide from it. The rate limit's
//! timer still sleeps real time before it asks the clock again, so an
//! append to the rate-limited journal is answered once the simulation
//! moves the clock by the append's share of the rate, which it does right
//! after sending it.
//!
//! What the simulation chooses is the same on every run of a seed
//! (`a_seeds_plan_is_the_same_on_every_run`). Which disk operation is the
//! n-th of its kind can differ between runs where the engine's batching
//! depends on timing (a rate-limited append may stage in one or two
//! pieces), so a replay meets the same plan, though not always the same
//! faulted call. `ROTARY_SIM_SEED=n` replays one seed and prints every
//! step, answer and injected fault (add `ROTARY_SIM_NO_FAULTS=1` to run
//! its workload on a sound disk, `ROTARY_SIM_RACE=1` to let cut-off
//! appends race the next one, see `cut_off_appends_racing_the_next_append`);
//! `ROTARY_SIM_SEEDS=n` runs seeds 0..n. A failing seed prints how to
//! replay it.
#![warn(clippy::too_many_lines)] // Functions under 100 lines, as in the engine.

mod common;

use common::sim::{
    check, content, env_u64, fault_hash, op_index, over_seeds, panic_message, sha1_hex, splitmix,
    sum_fields, Expect, OP_NAMES,
};
use common::Conn;
use rand::{rngs::StdRng, Rng, SeedableRng};
use rotary_engine::clock::Clock;
use rotary_engine::{Broker, ServeConfig};
use rotary_net::spec::{Durability, JournalSpec, LabelSelector, LabelSet};
use rotary_net::status::Status;
use rotary_net::wire::{self, flag, AppendReply, AppendRequest, Op};
use rotary_storage::faults::{DiskOp, Faults};
use sha1::{Digest, Sha1};
use std::collections::{BTreeMap, BTreeSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Steps per seed, besides the restarts.
const STEPS: usize = 140;
/// Seeds run by `cargo test`.
const CI_SEEDS: u64 = 40;
const APPEND_BYTES_MAX: usize = 256 << 10;
/// `max_append_rate` of the rate-limited journal, bytes per second.
const RATE: u64 = 128 << 10;
/// Its appends stay within one second's burst, so one move of the clock
/// by their share of the rate lets all of their bytes in.
const RATED_APPEND_BYTES_MAX: usize = 64 << 10;
const FLUSH_INTERVAL: Duration = Duration::from_secs(60);
/// How long an answer may take before the step fails: a broker that
/// never answers is as wrong as one that answers wrongly.
const REPLY_WAIT: Duration = Duration::from_secs(30);
/// Register names and values the workload uses.
const REGISTER_NAMES: [&str; 2] = ["writer", "epoch"];
const REGISTER_VALUES: [&str; 3] = ["a", "b", "c"];

// ---------------------------------------------------------------------------
// The plan: everything a seed chooses, made before the broker starts.

/// One journal of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
struct JournalPlan {
    /// Names of journals never prefix one another, so a fault's path
    /// names at most one of them.
    name: &'static str,
    length: u64,
    fsync: bool,
    flush: bool,
    rate: u64,
}

impl JournalPlan {
    fn spec(&self) -> JournalSpec {
        let mut spec = JournalSpec::new(self.name);
        spec.fragment.length = self.length;
        spec.fragment.flush_interval = if self.flush {
            FLUSH_INTERVAL
        } else {
            Duration::ZERO
        };
        if self.fsync {
            spec.durability = Durability::Fsync;
        }
        spec.max_append_rate = self.rate;
        spec
    }

    fn append_bytes_max(&self) -> usize {
        if self.rate > 0 {
            RATED_APPEND_BYTES_MAX
        } else {
            APPEND_BYTES_MAX
        }
    }
}

/// A register check: the journal's registers hold `name=value`, or not.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Check {
    name: &'static str,
    value: &'static str,
    holds: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// The last frame asks to commit.
    Commit,
    /// The last frame is an APPEND_CHUNK with ABORT.
    Abort,
    /// The connection closes before the last frame.
    Hangup,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Append {
    journal: usize,
    len: usize,
    /// Seeds the append's bytes.
    fill: u64,
    /// Ends of the frames' content, ascending, the last `len`; one frame
    /// (`[len]`) unless streamed.
    cuts: Vec<usize>,
    expect: Expect,
    check: Option<Check>,
    /// Sets the name to this one value.
    union: Option<(&'static str, &'static str)>,
    /// Removes the name if this is its one value (an empty value removes
    /// nothing, as registers here never hold one).
    subtract: Option<(&'static str, &'static str)>,
    end: End,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Step {
    Append(Append),
    Seal(usize),
    /// A read from `permille` of the way to the head.
    Read {
        journal: usize,
        permille: u64,
    },
    Tick(Duration),
    Recreate(usize),
    /// Stop, check on a broker without faults, and go on with faults.
    /// A `crash` leaves the broker running and goes on from a copy of its
    /// directory, as a process killed at that moment would leave it.
    Restart {
        crash: bool,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Plan {
    seed: u64,
    journals: Vec<JournalPlan>,
    steps: Vec<Step>,
    faults: FaultPlan,
}

impl Plan {
    fn new(seed: u64) -> Plan {
        let mut rng = StdRng::seed_from_u64(seed);
        let lengths = [4096, 16 << 10, 64 << 10, 256 << 10];
        let mut length = || lengths[rng.gen_range(0..lengths.len())];
        let (a, b, c) = (length(), length(), length());
        let journals = vec![
            JournalPlan {
                name: "sim/a-plain",
                length: a,
                fsync: false,
                flush: rng.gen_bool(0.5),
                rate: 0,
            },
            JournalPlan {
                name: "sim/b-fsync",
                length: b,
                fsync: true,
                flush: rng.gen_bool(0.5),
                rate: 0,
            },
            JournalPlan {
                name: "sim/c-rated",
                length: c,
                fsync: false,
                flush: true,
                rate: RATE,
            },
        ];
        let mut steps: Vec<Step> = (0..STEPS)
            .map(|_| random_step(&mut rng, &journals))
            .collect();
        let at = rng.gen_range(STEPS / 3..2 * STEPS / 3);
        steps.insert(
            at,
            Step::Restart {
                crash: rng.gen_bool(0.5),
            },
        );
        let faults = FaultPlan::random(seed, &mut rng);
        Plan {
            seed,
            journals,
            steps,
            faults,
        }
    }
}

fn random_step(rng: &mut StdRng, journals: &[JournalPlan]) -> Step {
    let journal = rng.gen_range(0..journals.len());
    match rng.gen_range(0..100) {
        0..=66 => Step::Append(random_append(rng, journal, &journals[journal])),
        67..=74 => Step::Seal(journal),
        75..=86 => Step::Read {
            journal,
            permille: match rng.gen_range(0..4) {
                0 => 0,
                1 => 1000,
                _ => rng.gen_range(0..1000),
            },
        },
        87..=95 => Step::Tick(Duration::from_secs(
            [1, 7, 31, 61][rng.gen_range(0..4usize)],
        )),
        _ => Step::Recreate(journal),
    }
}

fn random_append(rng: &mut StdRng, journal: usize, plan: &JournalPlan) -> Append {
    let max = plan.append_bytes_max();
    let len = match rng.gen_range(0..100) {
        0..=4 => 0,
        5..=49 => rng.gen_range(1..=512),
        50..=79 => rng.gen_range(513..=16 << 10),
        _ => rng.gen_range((16 << 10) + 1..=max),
    }
    .min(max);
    let mut cuts = vec![len];
    if len > 1 && rng.gen_bool(0.3) {
        cuts.extend((0..rng.gen_range(1..4)).map(|_| rng.gen_range(1..len)));
        cuts.sort_unstable();
        cuts.dedup();
    }
    let expect = match rng.gen_range(0..100) {
        0..=64 => Expect::Any,
        65..=87 => Expect::Head,
        _ => Expect::Off([-1, 1, -4096, 4096, 1 << 20][rng.gen_range(0..5usize)]),
    };
    let register = |rng: &mut StdRng| {
        (
            REGISTER_NAMES[rng.gen_range(0..REGISTER_NAMES.len())],
            REGISTER_VALUES[rng.gen_range(0..REGISTER_VALUES.len())],
        )
    };
    let check = rng.gen_bool(0.25).then(|| {
        let (name, value) = register(rng);
        Check {
            name,
            value,
            holds: rng.gen_bool(0.5),
        }
    });
    // Empty appends seldom change registers: those that do are refused.
    let changes = if len > 0 { 0.3 } else { 0.1 };
    let union = rng.gen_bool(changes).then(|| register(rng));
    let subtract = rng.gen_bool(changes / 3.0).then(|| {
        let (name, value) = register(rng);
        (name, if rng.gen_bool(0.3) { "" } else { value })
    });
    let end = match rng.gen_range(0..100) {
        0..=5 => End::Abort,
        6..=9 => End::Hangup,
        _ => End::Commit,
    };
    Append {
        journal,
        len,
        fill: rng.gen(),
        cuts,
        expect,
        check,
        union,
        subtract,
        end,
    }
}

// ---------------------------------------------------------------------------
// The fault plan.

#[derive(Clone, Debug, PartialEq, Eq)]
struct FaultPlan {
    seed: u64,
    /// Chance in a million that a call of each operation fails.
    ppm: [u32; 6],
    /// Errnos a failing call draws from.
    errnos: Vec<i32>,
    /// Calls that fail whatever the chance: (operation, n-th call, errno).
    scheduled: Vec<(usize, u64, i32)>,
}

impl FaultPlan {
    fn none(seed: u64) -> FaultPlan {
        FaultPlan {
            seed,
            ppm: [0; 6],
            errnos: Vec::new(),
            scheduled: Vec::new(),
        }
    }

    /// A fifth of the seeds have a sound disk; the others draw rates per
    /// operation, transient errnos only or EIO among them, and a few
    /// calls that fail on schedule.
    fn random(seed: u64, rng: &mut StdRng) -> FaultPlan {
        if rng.gen_bool(0.2) {
            return FaultPlan::none(seed);
        }
        let mut errnos = vec![libc::EINTR, libc::EAGAIN, libc::ENOSPC];
        if rng.gen_bool(0.5) {
            errnos.push(libc::EIO);
        }
        let mut ppm = [0u32; 6];
        for p in &mut ppm {
            if rng.gen_bool(0.7) {
                *p = rng.gen_range(0..30_000);
            }
        }
        let scheduled = (0..rng.gen_range(0..4))
            .map(|_| {
                (
                    rng.gen_range(0..OP_NAMES.len()),
                    rng.gen_range(0..200),
                    errnos[rng.gen_range(0..errnos.len())],
                )
            })
            .collect();
        FaultPlan {
            seed,
            ppm,
            errnos,
            scheduled,
        }
    }

    /// Whether the `n`-th call of operation `op` fails, and with which
    /// errno: a function of the plan alone.
    fn decide(&self, op: usize, n: u64) -> Option<i32> {
        if let Some(&(_, _, errno)) = self.scheduled.iter().find(|s| (s.0, s.1) == (op, n)) {
            return Some(errno);
        }
        if self.ppm[op] == 0 || self.errnos.is_empty() {
            return None;
        }
        let h = fault_hash(self.seed, op, n);
        ((h % 1_000_000) < u64::from(self.ppm[op]))
            .then(|| self.errnos[(h >> 32) as usize % self.errnos.len()])
    }
}

/// A fault that fired.
#[derive(Clone, Debug)]
struct Fired {
    op: usize,
    path: PathBuf,
}

/// The fault plan at work on the shard's thread: counts each operation's
/// calls while armed and fails those the plan names.
///
/// Spool writes fail only for `fsync` journals. A `replicated` journal's
/// small batch is answered once the commit log holds it, before its spool
/// write; should that write fail, the broker stops its process at once
/// (`std::process::abort`, flusher.rs) so that recovery restores the bytes
/// from the log, and an in-process simulation cannot outlive that.
struct Injector {
    plan: FaultPlan,
    /// Path pieces of the journals whose spool writes may fail.
    spool_writes_fail_under: Vec<String>,
    armed: AtomicBool,
    /// Print each fault as it fires.
    trace: AtomicBool,
    calls: [AtomicU64; 6],
    fired: Mutex<Vec<Fired>>,
}

impl Injector {
    fn new(plan: FaultPlan, journals: &[JournalPlan]) -> Injector {
        Injector {
            plan,
            spool_writes_fail_under: journals
                .iter()
                .filter(|j| j.fsync)
                .map(|j| format!("journals/{}/@", j.name))
                .collect(),
            armed: AtomicBool::new(false),
            trace: AtomicBool::new(false),
            calls: Default::default(),
            fired: Mutex::new(Vec::new()),
        }
    }

    fn arm(&self, on: bool) {
        self.armed.store(on, Ordering::SeqCst);
    }

    fn check_op(&self, op: usize, path: &Path) -> Option<i32> {
        if !self.armed.load(Ordering::SeqCst) {
            return None;
        }
        if op == 0 {
            let path = path.to_string_lossy();
            if !self
                .spool_writes_fail_under
                .iter()
                .any(|p| path.contains(p))
            {
                return None;
            }
        }
        let n = self.calls[op].fetch_add(1, Ordering::SeqCst);
        let errno = self.plan.decide(op, n)?;
        if self.trace.load(Ordering::SeqCst) {
            eprintln!(
                "  fault: {} call {n} fails with errno {errno} ({})",
                OP_NAMES[op],
                path.display()
            );
        }
        self.fired.lock().unwrap().push(Fired {
            op,
            path: path.to_path_buf(),
        });
        Some(errno)
    }

    fn take_fired(&self) -> Vec<Fired> {
        std::mem::take(&mut *self.fired.lock().unwrap())
    }
}

impl Faults for Injector {
    fn check(&self, op: DiskOp, path: &Path) -> Option<i32> {
        self.check_op(op_index(op), path)
    }
}

// ---------------------------------------------------------------------------
// The wire client is common/wire.rs; what only this simulation sends and
// reads is here.

impl Conn {
    /// Sends an append in the frames `cuts` make of `content`, ending as
    /// `end` says (not `Hangup`): the APPEND, then APPEND_CHUNKs.
    fn send_append(&mut self, req: &AppendRequest, content: &[u8], cuts: &[usize], end: End) {
        let id = self.id();
        let last = cuts.len() - 1;
        let more = |i: usize| {
            if i < last || end == End::Abort {
                flag::MORE
            } else {
                0
            }
        };
        let mut from = 0;
        for (i, &to) in cuts.iter().enumerate() {
            let (op, meta) = if i == 0 {
                (Op::APPEND, req.encode())
            } else {
                (Op::APPEND_CHUNK, Vec::new())
            };
            self.send(op, more(i), id, &meta, &content[from..to]);
            from = to;
        }
        if end == End::Abort {
            self.send(Op::APPEND_CHUNK, flag::ABORT, id, &[], &[]);
        }
    }

    /// A non-blocking read from `offset`.
    fn read_outcome(&mut self, journal: &str, offset: u64) -> ReadOutcome {
        let frames = self.read(journal, offset);
        let (done, _) = wire::decode_read_done(&frames.done.meta).unwrap();
        ReadOutcome {
            bytes: frames.contiguous(offset),
            status: frames.done.status_name(),
            next: done.offset.get(),
            write_head: done.write_head.get(),
        }
    }
}

struct ReadOutcome {
    bytes: Vec<u8>,
    status: String,
    next: u64,
    write_head: u64,
}

// ---------------------------------------------------------------------------
// The model.

/// What a journal holds as far as its answers went.
#[derive(Default)]
struct Model {
    bytes: Vec<u8>,
    registers: BTreeSet<(String, String)>,
    /// The largest write head any answer named since the journal was
    /// (re)created.
    head_seen: u64,
    /// The end of the newest fragment SEAL answered.
    sealed_to: u64,
    /// A fault fired on this journal's files, or the shard's, since the
    /// broker started: its statuses are no longer predicted.
    tainted: bool,
}

impl Model {
    fn head(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn holds(&self, name: &str, value: &str) -> bool {
        self.registers
            .contains(&(name.to_string(), value.to_string()))
    }

    /// The registers after `a` commits its bytes.
    fn registers_after(&self, a: &Append) -> BTreeSet<(String, String)> {
        let mut r = self.registers.clone();
        if a.len == 0 {
            return r;
        }
        // Subtract, then union (docs/PROTOCOL.md §6.2).
        if let Some((n, v)) = a.subtract {
            let values: Vec<&str> = r
                .iter()
                .filter(|(rn, _)| rn == n)
                .map(|(_, rv)| rv.as_str())
                .collect();
            if values == [v] {
                r.retain(|(rn, _)| rn != n);
            }
        }
        if let Some((n, v)) = a.union {
            r.retain(|(rn, _)| rn != n);
            r.insert((n.into(), v.into()));
        }
        r
    }

    /// Statuses `a` is refused with by the model, none if it commits;
    /// `expect` is the offset it was sent with.
    fn refusals(&self, a: &Append, expect: Option<u64>) -> Vec<Status> {
        let mut out = Vec::new();
        if a.len == 0 && (a.union.is_some() || a.subtract.is_some()) {
            out.push(Status::BAD_REQUEST);
        }
        if expect.is_some_and(|e| e != self.head()) {
            out.push(Status::WRONG_APPEND_OFFSET);
        }
        if let Some(c) = &a.check {
            if self.holds(c.name, c.value) != c.holds {
                out.push(Status::REGISTER_MISMATCH);
            }
        }
        out
    }
}

fn label_set(pairs: &[(&str, &str)]) -> LabelSet {
    LabelSet::from_pairs(pairs.iter().copied()).unwrap()
}

fn registers_of(set: &LabelSet) -> BTreeSet<(String, String)> {
    set.iter()
        .map(|l| (l.name.clone(), l.value.clone()))
        .collect()
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

// ---------------------------------------------------------------------------
// The simulation.

/// How a run goes, besides its seed.
#[derive(Clone, Copy, Debug, Default)]
struct Options {
    /// Print every step, answer and fault.
    trace: bool,
    bug: Option<Bug>,
    /// Close a cut-off append's connection without waiting for the broker
    /// to have read the append: the next append, sent on another
    /// connection, may overtake it.
    racing_hangups: bool,
    /// Run the seed's workload on a sound disk.
    no_faults: bool,
    /// Run it on a disk whose every call of this operation fails, with
    /// this errno.
    always: Option<(usize, i32)>,
}

/// A deliberate mistake in the model, to show the checks catch one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bug {
    /// The model takes the bytes of an append answered with an error as
    /// committed, as a client that ignores errors would.
    KeepFailedAppends,
}

/// Everything a run counts; summed over seeds.
#[derive(Clone, Debug, Default)]
struct Stats {
    appends: u64,
    appended_bytes: u64,
    /// Statuses of appends, by name.
    statuses: BTreeMap<String, u64>,
    /// Appends refused while their journal was tainted by a fault.
    failed_by_faults: u64,
    streamed: u64,
    hangups: u64,
    seals: u64,
    sealed_fragments: u64,
    failed_seals: u64,
    reads: u64,
    read_bytes: u64,
    ticks: u64,
    recreated: u64,
    restarts: u64,
    /// Restarts from a copy taken while the broker ran.
    crashes: u64,
    /// Faults injected, by operation.
    faults: BTreeMap<&'static str, u64>,
    /// Local fragments checked after restarts.
    fragments_checked: u64,
    /// Times the clock moved again for a rate-limited append.
    rate_nudges: u64,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        sum_fields!(
            self, o;
            appends,
            appended_bytes,
            failed_by_faults,
            streamed,
            hangups,
            seals,
            sealed_fragments,
            failed_seals,
            reads,
            read_bytes,
            ticks,
            recreated,
            restarts,
            crashes,
            fragments_checked,
            rate_nudges
        );
        for (k, v) in &o.statuses {
            *self.statuses.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &o.faults {
            *self.faults.entry(k).or_default() += v;
        }
    }

    fn status(&self, name: &str) -> u64 {
        self.statuses.get(name).copied().unwrap_or(0)
    }
}

struct Sim<'p> {
    plan: &'p Plan,
    dir: tempfile::TempDir,
    clock: Clock,
    injector: Arc<Injector>,
    broker: Option<Broker>,
    c: Option<Conn>,
    models: Vec<Model>,
    st: Stats,
    trace: bool,
    opts: Options,
    step: usize,
}

impl Drop for Sim<'_> {
    fn drop(&mut self) {
        // A failed run still stops its broker, without faults.
        self.injector.arm(false);
        self.c = None;
        if let Some(b) = self.broker.take() {
            b.shutdown();
        }
    }
}

impl<'p> Sim<'p> {
    fn new(plan: &'p Plan, opts: Options) -> Sim<'p> {
        let mut sim = Sim {
            plan,
            dir: tempfile::tempdir().unwrap(),
            clock: Clock::manual(),
            injector: Arc::new(Injector::new(plan.faults.clone(), &plan.journals)),
            broker: None,
            c: None,
            models: plan.journals.iter().map(|_| Model::default()).collect(),
            st: Stats::default(),
            trace: opts.trace,
            opts,
            step: 0,
        };
        sim.injector.trace.store(opts.trace, Ordering::SeqCst);
        sim.start(true);
        let specs: Vec<JournalSpec> = plan.journals.iter().map(JournalPlan::spec).collect();
        sim.apply(&specs);
        sim
    }

    fn c(&mut self) -> &mut Conn {
        self.c.as_mut().expect("a broker runs")
    }

    /// Starts a broker on the data directory; with `faults`, the plan's
    /// faults are armed once it has recovered.
    fn start(&mut self, faults: bool) {
        assert!(self.broker.is_none());
        let mut cfg =
            ServeConfig::new(self.dir.path().join("data"), "127.0.0.1:0".parse().unwrap());
        cfg.cores = 1;
        cfg.disk_reserve_bytes = 0;
        cfg.upload_threads = 1;
        cfg.clock = self.clock.clone();
        // Small steps: spools grow (and may fail to) often.
        cfg.spool_sizing.buffer_bytes = 1 << 20;
        cfg.spool_sizing.grow_bytes = 1 << 20;
        install_faults(&mut cfg, &self.injector);
        let broker = Broker::start(cfg).unwrap_or_else(|e| panic!("the broker did not start: {e}"));
        self.c = Some(Conn::with_wait(broker.endpoints[0], REPLY_WAIT));
        self.broker = Some(broker);
        self.injector.arm(faults);
        for m in &mut self.models {
            m.tainted = false;
        }
    }

    fn stop(&mut self) {
        // Faults stop before the broker does: the checks that follow are
        // of what it acknowledged, not of how it stops on a failing disk.
        self.injector.arm(false);
        self.note_faults();
        self.c = None;
        self.broker.take().expect("a broker runs").shutdown();
    }

    fn apply(&mut self, specs: &[JournalSpec]) {
        let body = serde_json::to_vec(specs).unwrap();
        let r = self.c().admin(Op::APPLY, &[], &body);
        check!(
            self,
            r.status == Some(Status::OK),
            "APPLY answered {}: {}",
            r.status_name(),
            String::from_utf8_lossy(&r.payload)
        );
    }

    fn name(&self, journal: usize) -> &'static str {
        self.plan.journals[journal].name
    }

    /// Takes the faults that fired since the last call: each taints the
    /// journal whose files it hit, or every journal if it hit the
    /// shard's commit log.
    fn note_faults(&mut self) -> usize {
        let fired = self.injector.take_fired();
        for f in &fired {
            *self.st.faults.entry(OP_NAMES[f.op]).or_default() += 1;
            let path = f.path.to_string_lossy();
            let hit = self
                .plan
                .journals
                .iter()
                .position(|j| path.contains(&format!("journals/{}/@", j.name)));
            match hit {
                Some(j) => self.models[j].tainted = true,
                None => self.models.iter_mut().for_each(|m| m.tainted = true),
            }
        }
        fired.len()
    }

    fn run(&mut self) {
        for (i, step) in self.plan.steps.iter().enumerate() {
            self.step = i;
            if self.trace {
                eprintln!("step {i}: {}", self.describe(step));
            }
            match step {
                Step::Append(a) => self.append(a),
                Step::Seal(j) => self.seal(*j),
                Step::Read { journal, permille } => {
                    let head = self.models[*journal].head();
                    self.read_at(*journal, head * permille / 1000);
                }
                Step::Tick(d) => {
                    self.st.ticks += 1;
                    self.clock.advance(*d);
                }
                Step::Recreate(j) => self.recreate(*j),
                Step::Restart { crash } => {
                    self.restart_and_verify(*crash);
                    self.start(true);
                }
            }
            self.note_faults();
        }
        self.step = self.plan.steps.len();
        self.restart_and_verify(false);
    }

    fn describe(&self, step: &Step) -> String {
        match step {
            Step::Append(a) => format!(
                "append {} B to {} at head {} in {} frame(s), {:?}, expect {:?}, check {:?}, \
                 union {:?}, subtract {:?}",
                a.len,
                self.name(a.journal),
                self.models[a.journal].head(),
                a.cuts.len(),
                a.end,
                a.expect,
                a.check,
                a.union,
                a.subtract
            ),
            Step::Seal(j) => format!("SEAL {}", self.name(*j)),
            Step::Read { journal, permille } => {
                format!("read {} from {permille}‰ of its head", self.name(*journal))
            }
            Step::Tick(d) => format!("the clock moves {d:?}"),
            Step::Recreate(j) => format!("DELETE and APPLY {} again", self.name(*j)),
            Step::Restart { crash: false } => "restart".into(),
            Step::Restart { crash: true } => "crash and restart".into(),
        }
    }
}

/// An append's answer, as far as the checks need it.
struct Answer {
    status: Option<Status>,
    name: String,
    reply: Option<AppendReply>,
    message: String,
}

impl Sim<'_> {
    fn request(&self, a: &Append) -> (AppendRequest, Option<u64>) {
        let head = self.models[a.journal].head();
        let expect = match a.expect {
            Expect::Any => None,
            Expect::Head => Some(head),
            Expect::Off(d) => Some(
                head.checked_add_signed(d)
                    .unwrap_or(head + d.unsigned_abs()),
            ),
        };
        let check_registers = match &a.check {
            None => LabelSelector::default(),
            Some(c) if c.holds => LabelSelector::parse(&format!("{}={}", c.name, c.value)).unwrap(),
            Some(c) => LabelSelector::parse(&format!("{}!={}", c.name, c.value)).unwrap(),
        };
        let req = AppendRequest {
            journal: self.name(a.journal).into(),
            expect_offset: expect,
            check_registers,
            union_registers: a.union.map(|u| label_set(&[u])).unwrap_or_default(),
            subtract_registers: a.subtract.map(|s| label_set(&[s])).unwrap_or_default(),
            route_revision: 0,
        };
        (req, expect)
    }

    fn append(&mut self, a: &Append) {
        let (req, expect) = self.request(a);
        let bytes = content(a.fill, a.len);
        self.st.appends += 1;
        self.st.streamed += (a.cuts.len() > 1) as u64;
        let rate = self.plan.journals[a.journal].rate;
        if a.end == End::Hangup {
            self.hang_up(&req, &bytes, &a.cuts);
            // An append cut off while it waits for the rate is rolled back
            // once the rate lets its bytes in, as time passes.
            self.pass_rate_share(rate, a.len);
            if !self.opts.racing_hangups {
                // The next request to the journal waits behind the cut-off
                // append, which commits nothing.
                self.probe_head(a.journal, "after a cut-off append");
            }
            return;
        }
        self.c().send_append(&req, &bytes, &a.cuts, a.end);
        let answer = self.await_append(rate, a.len);
        self.note_faults();
        *self.st.statuses.entry(answer.name.clone()).or_default() += 1;
        if self.trace {
            eprintln!(
                "  -> {} {:?} {}",
                answer.name,
                answer
                    .reply
                    .as_ref()
                    .map(|r| (r.begin, r.end, r.write_head)),
                answer.message
            );
        }
        if answer.status == Some(Status::OK) {
            self.committed(a, expect, &bytes, &answer);
        } else {
            self.refused(a, expect, &bytes, &answer);
        }
    }

    /// Waits for an append's answer. A rate-limited journal takes the
    /// append's bytes as the clock moves: by their share of the rate at
    /// once, then a second at a time should that not do.
    fn await_append(&mut self, rate: u64, len: usize) -> Answer {
        let mut r = None;
        if rate > 0 {
            self.pass_rate_share(rate, len);
            for _ in 0..30 {
                r = self.c().recv_within(Duration::from_secs(1));
                if r.is_some() {
                    break;
                }
                self.st.rate_nudges += 1;
                self.clock.advance(Duration::from_secs(1));
            }
        }
        let r = r.unwrap_or_else(|| self.c().recv());
        assert_eq!(r.op, Op::APPEND_REPLY, "an APPEND answered with {:?}", r.op);
        let reply = (!r.meta.is_empty()).then(|| AppendReply::decode(&r.meta).unwrap());
        Answer {
            status: r.status,
            name: r.status_name(),
            reply,
            message: String::from_utf8_lossy(&r.payload).into_owned(),
        }
    }

    /// Moves the clock by the time `len` bytes take at `rate`.
    fn pass_rate_share(&mut self, rate: u64, len: usize) {
        if rate > 0 {
            let share_ms = (len as u64 * 1000).div_ceil(rate) + 1;
            self.clock.advance(Duration::from_millis(share_ms));
        }
    }

    /// Sends an append but its last frame on a connection of its own, and
    /// closes it: the broker rolls the append back.
    fn hang_up(&mut self, req: &AppendRequest, bytes: &[u8], cuts: &[usize]) {
        self.st.hangups += 1;
        let addr = self.broker.as_ref().expect("a broker runs").endpoints[0];
        let mut other = Conn::with_wait(addr, REPLY_WAIT);
        let id = other.id();
        let keep = cuts.len().max(2) - 1;
        let mut from = 0;
        for (i, &to) in cuts.iter().take(keep).enumerate() {
            let (op, meta) = if i == 0 {
                (Op::APPEND, req.encode())
            } else {
                (Op::APPEND_CHUNK, Vec::new())
            };
            other.send(op, flag::MORE, id, &meta, &bytes[from..to.min(bytes.len())]);
            from = to;
        }
        if !self.opts.racing_hangups {
            // The broker has read the append before its connection closes
            // (frames of a connection are taken in order): the next step's
            // append queues behind it.
            let id = other.id();
            other.send(Op::PING, 0, id, &[], &[]);
            loop {
                let r = other.recv();
                if r.op == Op::PONG {
                    break;
                }
                // Refused before its last frame (§6.3).
                check!(
                    self,
                    r.op == Op::APPEND_REPLY && r.status != Some(Status::OK),
                    "a cut-off append answered {:?} {}",
                    r.op,
                    r.status_name()
                );
            }
        }
        drop(other);
    }

    /// Checks an append answered OK and adds it to the model.
    fn committed(&mut self, a: &Append, expect: Option<u64>, bytes: &[u8], ans: &Answer) {
        let name = self.name(a.journal);
        let m = &self.models[a.journal];
        let head = m.head();
        let refusals = m.refusals(a, expect);
        check!(
            self,
            a.end == End::Commit,
            "{name}: a cancelled append answered OK"
        );
        check!(
            self,
            refusals.is_empty(),
            "{name}: an append the model refuses ({refusals:?}) answered OK"
        );
        let r = ans.reply.as_ref().expect("an OK append reply has meta");
        let want = (head, head + bytes.len() as u64, head + bytes.len() as u64);
        check!(
            self,
            (r.begin, r.end, r.write_head) == want,
            "{name}: OK at [{}, {}) with head {}, the model's is [{}, {}) with head {}",
            r.begin,
            r.end,
            r.write_head,
            want.0,
            want.1,
            want.2
        );
        let sha: [u8; 20] = Sha1::digest(bytes).into();
        let want_sha = if bytes.is_empty() { [0; 20] } else { sha };
        check!(
            self,
            r.sha1 == want_sha || r.sha1 == sha,
            "{name}: the reply's SHA-1 {} is not the append's {}",
            hex::encode(r.sha1),
            hex::encode(sha)
        );
        let registers = m.registers_after(a);
        check!(
            self,
            registers_of(&r.registers) == registers,
            "{name}: registers {} after the append, the model's are {registers:?}",
            r.registers
        );
        let m = &mut self.models[a.journal];
        m.bytes.extend_from_slice(bytes);
        m.registers = registers;
        self.st.appended_bytes += bytes.len() as u64;
        self.saw_head(a.journal, r.write_head);
    }

    /// Checks an append answered with an error: the status is one the
    /// model predicts (unless a fault touched the journal) and nothing of
    /// the append was committed.
    fn refused(&mut self, a: &Append, expect: Option<u64>, bytes: &[u8], ans: &Answer) {
        let name = self.name(a.journal);
        let m = &self.models[a.journal];
        let head = m.head();
        let mut allowed = m.refusals(a, expect);
        if a.end == End::Abort {
            allowed.push(Status::CANCELLED);
        }
        let predicted = ans.status.is_some_and(|s| allowed.contains(&s));
        check!(
            self,
            m.tainted || predicted,
            "{name}: answered {} ({}), the model allows only {allowed:?}",
            ans.name,
            ans.message
        );
        check!(
            self,
            ans.status != Some(Status::REPLICATION_FAILED),
            "{name}: REPLICATION_FAILED from a journal without replicas"
        );
        if let Some(r) = &ans.reply {
            check!(
                self,
                r.begin == r.end && r.write_head == head,
                "{name}: a failed append's reply names [{}, {}) and head {}, the model's head is {head}",
                r.begin,
                r.end,
                r.write_head
            );
            // PROTOCOL §6.4 promises the registers with these two; other
            // refusals carry "what the broker knew".
            let names_registers = matches!(
                ans.status,
                Some(Status::WRONG_APPEND_OFFSET | Status::REGISTER_MISMATCH)
            );
            check!(
                self,
                !names_registers || registers_of(&r.registers) == m.registers,
                "{name}: {} names registers {}, the model's are {:?}",
                ans.name,
                r.registers,
                m.registers
            );
            self.saw_head(a.journal, r.write_head);
        }
        if !predicted {
            self.st.failed_by_faults += 1;
        }
        if self.opts.bug == Some(Bug::KeepFailedAppends) {
            self.models[a.journal].bytes.extend_from_slice(bytes);
        }
        // Nothing of it is there for a reader either.
        let head = self.models[a.journal].head();
        self.read_at(a.journal, head);
    }

    /// Write heads only grow.
    fn saw_head(&mut self, journal: usize, head: u64) {
        let seen = self.models[journal].head_seen;
        check!(
            self,
            head >= seen,
            "{}: write head {head} after {seen}",
            self.name(journal)
        );
        self.models[journal].head_seen = head;
    }
}

impl Sim<'_> {
    /// Reads from `offset` (at most the model's head): the model's bytes
    /// from there to its head, and nothing after.
    fn read_at(&mut self, journal: usize, offset: u64) {
        let name = self.name(journal);
        let out = self.c().read_outcome(name, offset);
        self.st.reads += 1;
        self.st.read_bytes += out.bytes.len() as u64;
        let m = &self.models[journal];
        let head = m.head();
        assert!(offset <= head);
        let want = &m.bytes[offset as usize..];
        if self.trace {
            eprintln!(
                "  read {name} from {offset}: {} B, {}, next {}, head {}",
                out.bytes.len(),
                out.status,
                out.next,
                out.write_head
            );
        }
        let want_status = if offset == head {
            "OFFSET_NOT_YET_AVAILABLE"
        } else {
            "OK"
        };
        check!(
            self,
            out.status == want_status && out.next == head && out.write_head == head,
            "{name}: a read from {offset} ended {} at {} with head {} after {} B; the model's \
             head is {head}",
            out.status,
            out.next,
            out.write_head,
            out.bytes.len()
        );
        if let Some(i) = first_difference(&out.bytes, want) {
            check!(
                self,
                false,
                "{name}: read {} B from {offset}, the model holds {} B; they differ at offset {}",
                out.bytes.len(),
                want.len(),
                offset + i as u64
            );
        }
        self.saw_head(journal, out.write_head);
    }

    /// SEAL: a fragment that ends at the model's head, with the model's
    /// bytes, after the last one SEAL answered.
    fn seal(&mut self, journal: usize) {
        let name = self.name(journal);
        self.st.seals += 1;
        let r = self.c().admin(Op::SEAL, &wire::encode_name(name), &[]);
        self.note_faults();
        if self.trace {
            eprintln!(
                "  -> {} {}",
                r.status_name(),
                String::from_utf8_lossy(&r.payload)
            );
        }
        let m = &self.models[journal];
        if r.status != Some(Status::OK) {
            check!(
                self,
                m.tainted,
                "{name}: SEAL answered {} ({})",
                r.status_name(),
                String::from_utf8_lossy(&r.payload)
            );
            self.st.failed_seals += 1;
            return;
        }
        let body: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
        let sealed = &body["sealed"];
        if sealed.is_null() {
            return;
        }
        let (begin, end) = (
            sealed["begin"].as_u64().unwrap(),
            sealed["end"].as_u64().unwrap(),
        );
        check!(
            self,
            m.sealed_to <= begin && begin < end && end == m.head(),
            "{name}: sealed [{begin}, {end}) after a seal to {}, the model's head is {}",
            m.sealed_to,
            m.head()
        );
        let want = sha1_hex(&m.bytes[begin as usize..end as usize]);
        check!(
            self,
            sealed["sha1"].as_str() == Some(want.as_str()),
            "{name}: sealed [{begin}, {end}) with SHA-1 {}, the model's bytes have {want}",
            sealed["sha1"]
        );
        self.models[journal].sealed_to = end;
        self.st.sealed_fragments += 1;
    }

    /// DELETE and APPLY again: the journal starts over, empty. Unless the
    /// shard's commit log failed for good, which could not record the
    /// deletion: then DELETE is refused and the journal stays as it is.
    fn recreate(&mut self, journal: usize) {
        let name = self.name(journal);
        let r = self.c().admin(Op::DELETE, &wire::encode_name(name), &[]);
        let msg = String::from_utf8_lossy(&r.payload).into_owned();
        // The DELETE's commit-log record may be what a fault hit.
        self.note_faults();
        let refused = [Status::DISK_FAILED, Status::IO_ERROR, Status::STORAGE_FULL];
        if r.status.is_some_and(|s| refused.contains(&s)) {
            check!(
                self,
                self.models[journal].tainted && msg.contains("commit log"),
                "{name}: DELETE answered {} ({msg}) with no commit-log fault",
                r.status_name()
            );
            self.read_at(journal, self.models[journal].head());
            return;
        }
        check!(
            self,
            r.status == Some(Status::OK),
            "{name}: DELETE answered {} ({msg})",
            r.status_name()
        );
        self.apply(&[self.plan.journals[journal].spec()]);
        self.st.recreated += 1;
        let tainted = self.models[journal].tainted;
        self.models[journal] = Model {
            tainted,
            ..Model::default()
        };
        self.read_at(journal, 0);
    }

    /// A copy of the running broker's directory, as a crash at this
    /// moment leaves it.
    fn crash_image(&mut self) -> tempfile::TempDir {
        self.st.crashes += 1;
        let copy = tempfile::tempdir().unwrap();
        let mut attempts = 0;
        // A file renamed or removed under the copy makes it no image of
        // one moment: copy again.
        while !copy_dir(&self.dir.path().join("data"), &copy.path().join("data")) {
            attempts += 1;
            assert!(attempts < 20, "files kept vanishing under the copy");
            std::fs::remove_dir_all(copy.path().join("data")).unwrap();
        }
        std::fs::remove_file(copy.path().join("data").join("LOCK")).unwrap();
        copy
    }

    /// Stops the broker and starts one without faults on the same
    /// directory (after a `crash`, on a copy of it taken before the stop):
    /// it serves what the model holds.
    fn restart_and_verify(&mut self, crash: bool) {
        let image = crash.then(|| self.crash_image());
        self.stop();
        if let Some(image) = image {
            self.dir = image;
        }
        self.start(false);
        self.st.restarts += 1;
        for j in 0..self.plan.journals.len() {
            self.verify(j);
        }
        self.stop();
    }

    /// An empty append, which learns the head and the registers: at the
    /// model's, unless a fault refused it.
    fn probe_head(&mut self, journal: usize, when: &str) {
        let name = self.name(journal);
        let rate = self.plan.journals[journal].rate;
        let (req, _) = self.request(&Append {
            journal,
            len: 0,
            fill: 0,
            cuts: vec![0],
            expect: Expect::Any,
            check: None,
            union: None,
            subtract: None,
            end: End::Commit,
        });
        self.c().send_append(&req, &[], &[0], End::Commit);
        let ans = self.await_append(rate, 0);
        self.note_faults();
        let m = &self.models[journal];
        let head = m.head();
        let Some(r) = ans.reply.as_ref() else {
            check!(
                self,
                m.tainted,
                "{name} {when}: an empty append answered {}",
                ans.name
            );
            return;
        };
        let ok = ans.status == Some(Status::OK);
        // A refusal's reply names no range (`begin = end`), only the head.
        let at = if ok { (head, head) } else { (r.begin, r.begin) };
        check!(
            self,
            (ok || m.tainted) && (r.begin, r.end, r.write_head) == (at.0, at.1, head),
            "{name} {when}: an empty append answered {} at [{}, {}) with head {}, the model's \
             head is {head}",
            ans.name,
            r.begin,
            r.end,
            r.write_head
        );
        check!(
            self,
            !ok || registers_of(&r.registers) == m.registers,
            "{name} {when}: registers {}, the model's are {:?}",
            r.registers,
            m.registers
        );
    }

    fn verify(&mut self, journal: usize) {
        let name = self.name(journal);
        self.probe_head(journal, "after a restart");
        let out = self.c().read_outcome(name, 0);
        let m = &self.models[journal];
        let (got, want) = (sha1_hex(&out.bytes), sha1_hex(&m.bytes));
        check!(
            self,
            got == want,
            "{name} after a restart: {} B with SHA-1 {got}, the model holds {} B with SHA-1 \
             {want}; first difference at {:?}",
            out.bytes.len(),
            m.bytes.len(),
            first_difference(&out.bytes, &m.bytes)
        );
        self.verify_fragments(journal);
    }
}

impl Sim<'_> {
    /// FRAGMENTS: the journal's local fragments (and its open spool) tile
    /// `[0, head)`, each with the SHA-1 of the model's bytes.
    fn verify_fragments(&mut self, journal: usize) {
        let name = self.name(journal);
        let mut all = Vec::new();
        let mut from = 0;
        loop {
            let payload = serde_json::to_vec(&serde_json::json!({ "from": from })).unwrap();
            let r = self
                .c()
                .admin(Op::FRAGMENTS, &wire::encode_name(name), &payload);
            check!(
                self,
                r.status == Some(Status::OK),
                "{name}: FRAGMENTS answered {}",
                r.status_name()
            );
            let page: Vec<serde_json::Value> = serde_json::from_slice(&r.payload).unwrap();
            let Some(last) = page.last() else { break };
            from = last["begin"].as_u64().unwrap() + 1;
            all.extend(page);
            if r.flags & flag::NEXT_PAGE == 0 {
                break;
            }
        }
        let m = &self.models[journal];
        let mut at = 0;
        for f in &all {
            let (begin, end) = (f["begin"].as_u64().unwrap(), f["end"].as_u64().unwrap());
            check!(
                self,
                begin == at && begin < end && end <= m.head() && f["store"] == "local",
                "{name} after a restart: fragment {f} where [{at}, ..) was due; the model's head \
                 is {}",
                m.head()
            );
            let want = sha1_hex(&m.bytes[begin as usize..end as usize]);
            check!(
                self,
                f["sha1"].as_str() == Some(want.as_str()),
                "{name} after a restart: fragment [{begin}, {end}) has SHA-1 {}, the model's \
                 bytes {want}",
                f["sha1"]
            );
            at = end;
        }
        check!(
            self,
            at == m.head(),
            "{name} after a restart: fragments end at {at}, the model's head is {}",
            m.head()
        );
        self.st.fragments_checked += all.len() as u64;
    }
}

/// Hands the injector to the broker's shards.
fn install_faults(cfg: &mut ServeConfig, injector: &Arc<Injector>) {
    cfg.faults = Some(injector.clone());
}

// ---------------------------------------------------------------------------
// Runs and tests.

fn run(seed: u64, opts: Options) -> Stats {
    let mut plan = Plan::new(seed);
    if opts.no_faults {
        plan.faults = FaultPlan::none(seed);
    }
    if let Some((op, errno)) = opts.always {
        plan.faults = FaultPlan::none(seed);
        plan.faults.ppm[op] = 1_000_000;
        plan.faults.errnos = vec![errno];
    }
    if opts.trace {
        eprintln!(
            "seed {seed}: journals {:#?}\nfaults {:?}",
            plan.journals, plan.faults
        );
    }
    let mut sim = Sim::new(&plan, opts);
    sim.run();
    std::mem::take(&mut sim.st)
}

/// Runs a seed; a failure names the seed and how to replay it.
fn run_seed(seed: u64, opts: Options) -> Stats {
    common::sim::run_seed("shard_sim", seed, || run(seed, opts))
}

/// Copies a directory tree; false if a file vanished while it was copied.
fn copy_dir(from: &Path, to: &Path) -> bool {
    std::fs::create_dir_all(to).unwrap();
    let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    let entries = match std::fs::read_dir(from) {
        Ok(entries) => entries,
        Err(e) if gone(&e) => return false,
        Err(e) => panic!("listing {}: {e}", from.display()),
    };
    let mut whole = true;
    for e in entries {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        let is_dir = match e.file_type() {
            Ok(t) => t.is_dir(),
            Err(err) if gone(&err) => {
                whole = false;
                continue;
            }
            Err(err) => panic!("reading {}: {err}", e.path().display()),
        };
        if is_dir {
            whole &= copy_dir(&e.path(), &dest);
        } else {
            match std::fs::copy(e.path(), &dest) {
                Ok(_) => {}
                Err(err) if gone(&err) => whole = false,
                Err(err) => panic!("copying {}: {err}", e.path().display()),
            }
        }
    }
    whole
}

#[test]
fn seeded_shards_keep_every_acknowledged_byte() {
    if let Some(seed) = env_u64("ROTARY_SIM_SEED") {
        let opts = Options {
            trace: true,
            racing_hangups: std::env::var_os("ROTARY_SIM_RACE").is_some(),
            no_faults: std::env::var_os("ROTARY_SIM_NO_FAULTS").is_some(),
            ..Options::default()
        };
        let st = run(seed, opts);
        eprintln!("seed {seed}: {st:#?}");
        return;
    }
    let run = |seed| run_seed(seed, Options::default());
    let (total, seeds) = over_seeds("shard_sim", CI_SEEDS, run, Stats::add);
    // The workload did what it is for.
    let t = &total;
    assert!(t.status("OK") > 100 && t.appended_bytes > 1 << 20, "{t:?}");
    assert!(t.status("WRONG_APPEND_OFFSET") > 0, "{t:?}");
    assert!(t.status("REGISTER_MISMATCH") > 0, "{t:?}");
    assert!(t.status("CANCELLED") > 0 && t.hangups > 0, "{t:?}");
    assert!(t.sealed_fragments > 0 && t.fragments_checked > 10, "{t:?}");
    assert!(t.recreated > 0 && t.ticks > 0 && t.streamed > 0, "{t:?}");
    // The disk failed, appends with it, and nothing acknowledged was lost.
    assert!(t.faults.len() >= OP_NAMES.len() - 1, "{t:?}");
    assert!(t.failed_by_faults > 0 && t.restarts == 2 * seeds, "{t:?}");
    assert!(t.crashes > 0 && t.crashes < seeds, "{t:?}");
}

#[test]
fn a_seeds_plan_is_the_same_on_every_run() {
    for seed in 0..50 {
        let (a, b) = (Plan::new(seed), Plan::new(seed));
        assert_eq!(a, b, "seed {seed}");
        for op in 0..OP_NAMES.len() {
            for n in 0..2000 {
                assert_eq!(
                    a.faults.decide(op, n),
                    b.faults.decide(op, n),
                    "seed {seed}"
                );
            }
        }
        // The injector fails the calls the plan names, in call order.
        let (x, y) = (
            Injector::new(a.faults.clone(), &a.journals),
            Injector::new(b.faults, &b.journals),
        );
        x.arm(true);
        y.arm(true);
        for i in 0..3000u64 {
            let op = (splitmix(i) % 6) as usize;
            let path = Path::new("d/shard-0/journals/sim/b-fsync/@/spool");
            assert_eq!(x.check_op(op, path), y.check_op(op, path));
        }
    }
    // Seeds differ, and across seeds every kind of choice is made.
    assert_ne!(Plan::new(1), Plan::new(2));
    let plans: Vec<Plan> = (0..50).map(Plan::new).collect();
    let any = |f: &dyn Fn(&Step) -> bool| plans.iter().any(|p| p.steps.iter().any(f));
    assert!(any(
        &|s| matches!(s, Step::Append(a) if a.end == End::Abort)
    ));
    assert!(any(
        &|s| matches!(s, Step::Append(a) if a.end == End::Hangup)
    ));
    assert!(any(&|s| matches!(s, Step::Append(a) if a.len > 128 << 10)));
    assert!(any(
        &|s| matches!(s, Step::Append(a) if a.len == 0 && a.union.is_some())
    ));
    assert!(any(
        &|s| matches!(s, Step::Append(a) if matches!(a.expect, Expect::Off(_)))
    ));
    assert!(any(&|s| matches!(s, Step::Recreate(_))));
    let errnos: BTreeSet<i32> = plans
        .iter()
        .flat_map(|p| p.faults.errnos.iter().copied())
        .collect();
    assert_eq!(
        errnos,
        BTreeSet::from([libc::EINTR, libc::EAGAIN, libc::ENOSPC, libc::EIO])
    );
    assert!(plans.iter().any(|p| p.faults == FaultPlan::none(p.seed)));
}

#[test]
fn a_model_that_keeps_failed_appends_is_caught() {
    // A model that takes a refused append's bytes as committed must be
    // told apart from the broker at once: the checks see every answer.
    let res = catch_unwind(AssertUnwindSafe(|| {
        let opts = Options {
            bug: Some(Bug::KeepFailedAppends),
            ..Options::default()
        };
        run(0, opts)
    }));
    let e = res.expect_err("the wrong model went unnoticed");
    let msg = panic_message(&*e);
    assert!(msg.contains("model check failed"), "{msg}");
}

/// Clients that cut off a streamed append on one connection while their
/// next request, on another, overtakes it. The cut-off append may become
/// the journal's open append right behind another that is staged but not
/// yet committed; rolling it back must leave that one staged (see
/// `cut_off_append_behind_a_staged_one`), or the shard's thread panics
/// with its heads out of order. And a SEAL sent right after an append cut
/// off on another connection (seed 21, step 81 behind step 80) must be
/// answered, though the cut-off append is all that is queued on a journal
/// with no spool (see `drop_dead_front`, engine/src/shard/stage.rs).
#[test]
fn cut_off_appends_racing_the_next_append() {
    let opts = Options {
        racing_hangups: true,
        ..Options::default()
    };
    for _ in 0..10 {
        for seed in 0..40 {
            run_seed(seed, opts);
        }
    }
}

/// A disk on which every seal fails, transiently (EINTR) or for good
/// (EIO): appends and SEALs must still be answered, with an error if need
/// be. A transient failure is tried again after a growing delay, and
/// meanwhile SEALs and appends that need the seal first are refused
/// `IO_ERROR` (`Shard::seal_failed`, flusher.rs); EIO parks the journal.
#[test]
fn appends_behind_failing_seals_are_answered() {
    for errno in [libc::EINTR, libc::EIO] {
        let opts = Options {
            always: Some((3, errno)),
            ..Options::default()
        };
        run_seed(0, opts);
    }
}

/// The race of `cut_off_appends_racing_the_next_append`, made likely: an
/// append is written and fdatasync'ed while the next one arrives whole and
/// is staged behind it, and a third, cut off by its closed connection,
/// becomes the open append behind that. Its rollback must leave the staged
/// one staged.
#[test]
fn cut_off_append_behind_a_staged_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ServeConfig::new(dir.path().join("data"), "127.0.0.1:0".parse().unwrap());
    cfg.cores = 1;
    cfg.disk_reserve_bytes = 0;
    let broker = Broker::start(cfg).unwrap();
    let name = "sim/staged-race";
    let mut spec = JournalSpec::new(name);
    spec.durability = Durability::Fsync;
    let mut c = Conn::with_wait(broker.endpoints[0], REPLY_WAIT);
    let r = c.admin(Op::APPLY, &[], &serde_json::to_vec(&[spec]).unwrap());
    assert_eq!(r.status, Some(Status::OK));
    let req = AppendRequest {
        journal: name.into(),
        ..Default::default()
    };
    let big = content(1, 1 << 20);
    let mut head = 0u64;
    for round in 0..200 {
        c.send_append(&req, &big, &[big.len()], End::Commit);
        c.send_append(&req, b"staged", &[6], End::Commit);
        let mut cut = Conn::with_wait(broker.endpoints[0], REPLY_WAIT);
        cut.send(Op::APPEND, flag::MORE, 1, &req.encode(), b"cut off");
        drop(cut);
        // A large append's reply may come after the next one's: its
        // SHA-1 is computed off the shard's thread.
        let mut got: Vec<(u64, u64)> = (0..2)
            .map(|_| {
                let r = c
                    .recv_within(Duration::from_secs(10))
                    .unwrap_or_else(|| panic!("round {round}: no answer"));
                assert_eq!(r.status, Some(Status::OK), "round {round}");
                let reply = AppendReply::decode(&r.meta).unwrap();
                (reply.begin, reply.end)
            })
            .collect();
        got.sort_unstable();
        let end = head + big.len() as u64;
        assert_eq!(got, [(head, end), (end, end + 6)], "round {round}");
        head = end + 6;
    }
    broker.shutdown();
}

/// An append to an `fsync` journal whose spool fdatasync fails is refused
/// (`STORAGE_FULL` here), though its commit-log record was written: the
/// log is to restate what the journal holds. Should that write fail too,
/// the restatement must not be lost, or the refused append comes back at
/// the next restart, where readers see it and a client that retried it
/// has it twice.
#[test]
fn a_refused_append_stays_refused_when_its_restatement_fails() {
    refused_append_stays_refused(1, false);
}

/// As above, with a commit log that refuses every write from then on, up
/// to and through the stop: the restatement is never written, and the
/// restart must still not find the refused append in the spool.
#[test]
fn a_refused_append_stays_refused_when_the_log_never_restates_it() {
    refused_append_stays_refused(1000, true);
}

/// The append's fdatasync fails, then `log_write_failures` log writes;
/// with `stop_armed`, the broker stops while they still fail.
fn refused_append_stays_refused(log_write_failures: u64, stop_armed: bool) {
    let journal = JournalPlan {
        name: "sim/restated",
        length: 1 << 20,
        fsync: true,
        flush: false,
        rate: 0,
    };
    let mut faults = FaultPlan::none(0);
    // The append's log record is written (call 0), its spool fdatasync
    // fails, and so does the next log write: the restatement.
    faults.scheduled = vec![(1, 0, libc::ENOSPC)];
    faults
        .scheduled
        .extend((1..=log_write_failures).map(|n| (4, n, libc::ENOSPC)));
    let injector = Arc::new(Injector::new(faults, std::slice::from_ref(&journal)));
    let dir = tempfile::tempdir().unwrap();
    let start = |faults: bool| {
        let mut cfg = ServeConfig::new(dir.path().join("data"), "127.0.0.1:0".parse().unwrap());
        cfg.cores = 1;
        cfg.disk_reserve_bytes = 0;
        if faults {
            install_faults(&mut cfg, &injector);
        }
        let broker = Broker::start(cfg).unwrap();
        let c = Conn::with_wait(broker.endpoints[0], REPLY_WAIT);
        (broker, c)
    };
    let (broker, mut c) = start(true);
    let r = c.admin(
        Op::APPLY,
        &[],
        &serde_json::to_vec(&[journal.spec()]).unwrap(),
    );
    assert_eq!(r.status, Some(Status::OK));
    let req = AppendRequest {
        journal: journal.name.into(),
        ..Default::default()
    };
    let append = |c: &mut Conn, bytes: &[u8]| {
        c.send_append(&req, bytes, &[bytes.len()], End::Commit);
        let r = c.recv();
        let reply = AppendReply::decode(&r.meta).unwrap();
        (r.status, reply.write_head)
    };
    assert_eq!(append(&mut c, b"first"), (Some(Status::OK), 5));
    injector.arm(true);
    let (status, head) = append(&mut c, &content(7, 100 << 10));
    if !stop_armed {
        injector.arm(false);
    }
    assert_ne!(status, Some(Status::OK));
    assert_eq!(head, 5, "{status:?}: nothing of it committed");
    drop(c);
    broker.shutdown();
    injector.arm(false);
    let fired = injector.take_fired();
    assert!(
        fired.len() >= 2,
        "the fdatasync and a log write failed: {fired:?}"
    );
    if log_write_failures == 1 {
        assert_eq!(fired.len(), 2, "both faults fired: {fired:?}");
    }
    assert!(fired.iter().any(|f| f.op == 1) && fired.iter().any(|f| f.op == 4));
    let (broker, mut c) = start(false);
    assert_eq!(
        append(&mut c, b""),
        (Some(Status::OK), 5),
        "after a restart the refused append is back"
    );
    drop(c);
    broker.shutdown();
}
