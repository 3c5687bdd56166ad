//! `--scenario allocator`: the allocator's CPU time on a large cluster.
//!
//! 100,000 journals of replication 3 over 4 brokers in two zones, no etcd:
//! the plan is pure logic over a snapshot, so this times exactly what the
//! leader spends deciding. Four plans are timed, each several times (the
//! fastest run is reported, as the one least disturbed by the machine):
//! the initial allocation (every copy to place), a steady cluster (nothing
//! to do: the plan every watch event of an idle cluster runs), a broker's
//! death (a third of the copies to replace, primaries to promote), and a
//! fifth broker joining (a fifth of the copies to move).
//!
//! CPU time is the thread's own time on a CPU, from
//! `/proc/thread-self/schedstat` (nanoseconds), so other processes on the
//! machine do not inflate it; wall time is shown beside it.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use rotary_allocator::{apply, plan, AssignmentKey, Change, Item, MemberKey, Route};
use rotary_engine::cluster::member::{MemberSpec, Snapshot};

type Member = rotary_allocator::Member<MemberSpec>;
use std::time::{Duration, Instant};

const JOURNALS: usize = 100_000;
const REPLICATION: u32 = 3;
const BROKERS: [(&str, &str); 4] = [
    ("zone-a", "a1"),
    ("zone-a", "a2"),
    ("zone-b", "b1"),
    ("zone-b", "b2"),
];
/// Runs of each plan; the fastest is reported.
const RUNS: usize = 3;
/// The target for the initial allocation.
const TARGET: Duration = Duration::from_secs(1);

/// This thread's CPU time so far, if the kernel reports it.
fn thread_cpu() -> Option<Duration> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = s.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

struct Timing {
    cpu: Option<Duration>,
    wall: Duration,
    changes: usize,
}

/// Times `plan` on `snap`, fastest of [`RUNS`].
fn time_plan(snap: &Snapshot) -> (Timing, Vec<Change>) {
    let mut best: Option<Timing> = None;
    let mut out = Vec::new();
    for _ in 0..RUNS {
        let cpu0 = thread_cpu();
        let t0 = Instant::now();
        let changes = plan(snap);
        let wall = t0.elapsed();
        let cpu = thread_cpu().zip(cpu0).map(|(b, a)| b.saturating_sub(a));
        let t = Timing {
            cpu,
            wall,
            changes: changes.len(),
        };
        if best.as_ref().is_none_or(|b| t.wall < b.wall) {
            best = Some(t);
        }
        out = changes;
    }
    (best.expect("RUNS > 0"), out)
}

fn member(rev: i64, limit: u32) -> Member {
    Member {
        spec: MemberSpec {
            endpoint: format!("10.0.0.{rev}:7401"),
            shards: 8,
            journal_limit: limit,
            exiting: false,
        },
        create_revision: rev,
        mod_revision: rev,
        lease: rev,
    }
}

/// Every primary synchronizes its route.
fn synchronize(snap: &mut Snapshot) {
    snap.revision += 1;
    let rev = snap.revision;
    let mut journal = String::new();
    let mut keys: Vec<AssignmentKey> = Vec::new();
    let all: Vec<AssignmentKey> = snap.assignments.keys().cloned().collect();
    let flush = |keys: &mut Vec<AssignmentKey>, snap: &mut Snapshot| {
        let route = Route::of(keys.iter());
        for k in keys.drain(..) {
            let a = snap.assignments.get_mut(&k).expect("listed");
            a.route = Some(route.clone());
            a.mod_revision = rev;
        }
    };
    for k in all {
        if k.item != journal {
            flush(&mut keys, snap);
            journal = k.item.clone();
        }
        keys.push(k);
    }
    flush(&mut keys, snap);
}

/// Plans, applies and synchronizes until the plan is empty.
fn settle(snap: &mut Snapshot) -> anyhow::Result<usize> {
    for round in 0..64 {
        let changes = plan(snap);
        if changes.is_empty() {
            return Ok(round);
        }
        *snap = apply(snap, &changes)?;
        synchronize(snap);
    }
    anyhow::bail!("the allocation did not settle in 64 rounds")
}

fn print(name: &str, t: &Timing) {
    let cpu = t.cpu.map_or("n/a".to_string(), |c| {
        format!("{:.0} ms", c.as_secs_f64() * 1e3)
    });
    println!(
        "allocator {name:<28} cpu {cpu:>8}   wall {:>6.0} ms   changes {:>7}",
        t.wall.as_secs_f64() * 1e3,
        t.changes
    );
}

/// Runs the scenario and prints its figures.
pub fn run() -> anyhow::Result<()> {
    eprintln!(
        "allocator: {JOURNALS} journals of replication {REPLICATION} over {} brokers",
        BROKERS.len()
    );
    let mut snap = Snapshot::new("/bench", 1);
    let limit = JOURNALS as u32;
    for (i, (zone, id)) in BROKERS.iter().enumerate() {
        snap.members
            .insert(MemberKey::new(zone, id)?, member(2 + i as i64, limit));
    }
    for i in 0..JOURNALS {
        snap.items.insert(
            format!("bench/journal-{i:06}"),
            Item {
                replication: REPLICATION,
                mod_revision: 10,
            },
        );
    }
    snap.revision = 10;

    let (t, changes) = time_plan(&snap);
    print("initial allocation", &t);
    snap = apply(&snap, &changes)?;
    synchronize(&mut snap);
    let copies = snap.assignments.len();
    anyhow::ensure!(
        copies == JOURNALS * REPLICATION as usize,
        "the initial allocation placed {copies} copies"
    );
    let rounds = settle(&mut snap)?;
    anyhow::ensure!(
        rounds == 0,
        "the initial allocation needed {rounds} more rounds"
    );
    let target_met = t.cpu.unwrap_or(t.wall) < TARGET;

    let (t, _) = time_plan(&snap);
    print("steady (nothing to do)", &t);
    anyhow::ensure!(
        t.changes == 0,
        "a steady cluster planned {} changes",
        t.changes
    );

    // b2's lease expires: its member key and assignments vanish.
    let dead = MemberKey::new("zone-b", "b2")?;
    snap.members.remove(&dead);
    snap.assignments.retain(|k, _| k.member != dead);
    snap.revision += 1;
    let (t, _) = time_plan(&snap);
    print("a broker dies", &t);
    settle(&mut snap)?;

    snap.members.insert(
        MemberKey::new("zone-b", "b3")?,
        member(snap.revision + 1, limit),
    );
    snap.revision += 1;
    let (t, _) = time_plan(&snap);
    print("a broker joins", &t);
    let rounds = settle(&mut snap)?;
    let mut per_broker: Vec<String> = Vec::new();
    for k in snap.members.keys() {
        let n = snap.assignments.keys().filter(|a| &a.member == k).count();
        per_broker.push(format!("{k}={n}"));
    }
    println!(
        "allocator settled after the join in {rounds} rounds: {}",
        per_broker.join(" ")
    );
    println!(
        "allocator target (initial allocation under {} s of CPU): {}",
        TARGET.as_secs(),
        if target_met { "met" } else { "NOT met" }
    );
    Ok(())
}
