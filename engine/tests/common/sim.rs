//! Pieces the seeded simulations share: the bytes an append carries, the
//! hash a fault plan draws from, the disk operations a fault may hit, and
//! running one seed so that its failure says how to replay it.

use rotary_storage::faults::DiskOp;
use sha1::{Digest, Sha1};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

/// The offset an append expects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// No expected offset.
    Any,
    /// The write head as the simulation knows it.
    Head,
    /// That head moved by this (non-zero) much: wrong.
    Off(i64),
}

/// The disk operations a fault may hit, as `rotary_storage::faults::DiskOp`
/// names them, by index.
pub const OP_NAMES: [&str; 6] = [
    "SpoolWrite",
    "SpoolSync",
    "SpoolAllocate",
    "Seal",
    "LogWrite",
    "LogSync",
];

/// The index of `op` in `OP_NAMES`.
pub fn op_index(op: DiskOp) -> usize {
    match op {
        DiskOp::SpoolWrite => 0,
        DiskOp::SpoolSync => 1,
        DiskOp::SpoolAllocate => 2,
        DiskOp::Seal => 3,
        DiskOp::LogWrite => 4,
        DiskOp::LogSync => 5,
    }
}

/// The bytes of an append with `fill`: the same on every run.
pub fn content(fill: u64, len: usize) -> Vec<u8> {
    let mut state = fill | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// What a fault plan of `seed` draws for the `n`-th call of operation
/// `op`: a function of the three alone, whatever ran before.
pub fn fault_hash(seed: u64, op: usize, n: u64) -> u64 {
    splitmix(seed ^ splitmix(op as u64 + 1) ^ splitmix(n.wrapping_add(1 << 40)))
}

pub fn sha1_hex(bytes: &[u8]) -> String {
    hex::encode(Sha1::digest(bytes))
}

pub fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

/// Runs one seed of the simulation in test file `sim`; a failure names
/// the seed and how to replay it.
pub fn run_seed<T>(sim: &str, seed: u64, run: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(r) => r,
        Err(e) => {
            eprintln!(
                "{sim}: seed {seed} failed; replay it with ROTARY_SIM_SEED={seed} \
                 cargo test -p rotary-engine --test {sim} -- --nocapture"
            );
            resume_unwind(e)
        }
    }
}

/// Runs seeds `0..ROTARY_SIM_SEEDS` (`ci_seeds` unless set) of the
/// simulation in test file `sim`, one by one through `run`, and prints and
/// returns the sum of their statistics (by `add`) and the seed count.
pub fn over_seeds<S: Default + std::fmt::Debug>(
    sim: &str,
    ci_seeds: u64,
    run: impl Fn(u64) -> S,
    add: impl Fn(&mut S, &S),
) -> (S, u64) {
    let seeds = env_u64("ROTARY_SIM_SEEDS").unwrap_or(ci_seeds);
    let mut total = S::default();
    for seed in 0..seeds {
        add(&mut total, &run(seed));
    }
    eprintln!("{sim} over {seeds} seeds: {total:#?}");
    (total, seeds)
}

/// Asserts that the plans of seeds 0..50 come out the same twice, their
/// fault plans deciding the first 2000 calls of each operation alike: a
/// seed replays its run.
pub fn assert_plans_repeat<P: PartialEq + std::fmt::Debug>(
    plan: impl Fn(u64) -> P,
    decide: impl Fn(&P, usize, u64) -> Option<i32>,
) {
    for seed in 0..50 {
        let (a, b) = (plan(seed), plan(seed));
        assert_eq!(a, b, "seed {seed}");
        for op in 0..OP_NAMES.len() {
            for n in 0..2000 {
                assert_eq!(decide(&a, op, n), decide(&b, op, n), "seed {seed}");
            }
        }
    }
}

/// The message of a caught panic.
pub fn panic_message(e: &(dyn std::any::Any + Send)) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Adds the named counters of `$o` to those of `$into`: the sum of a
/// simulation's statistics over its seeds.
#[allow(unused_macros)]
macro_rules! sum_fields {
    ($into:expr, $o:expr; $($f:ident),* $(,)?) => {
        $($into.$f += $o.$f;)*
    };
}
#[allow(unused_imports)]
pub(crate) use sum_fields;

/// Fails the run with where it was (`$sim.step`, `$sim.plan.seed`), when
/// the broker's answer is not what the model allows.
#[allow(unused_macros)]
macro_rules! check {
    ($sim:expr, $cond:expr, $($arg:tt)*) => {
        if !$cond {
            panic!(
                "model check failed at step {} of seed {}: {}",
                $sim.step,
                $sim.plan.seed,
                format!($($arg)*)
            );
        }
    };
}
#[allow(unused_imports)]
pub(crate) use check;
