//! How busy the machine was with work other than this benchmark, per
//! scenario: a run that shared its cores with a compiler says so.
//!
//! From `/proc/stat` (user, nice and system time of every CPU) minus this
//! process's own time and that of its reaped children (`/proc/self/stat`).
//! What remains is other processes plus kernel threads (some of which, such
//! as direct-I/O completion workers, serve this benchmark).

use std::time::Instant;

/// Clock ticks per second of `/proc` times (USER_HZ; 100 on Linux).
const TICKS_PER_SEC: f64 = 100.0;

/// A point to measure from.
pub struct Sample {
    at: Instant,
    machine_ticks: Option<u64>,
    own_ticks: Option<u64>,
}

fn machine_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let mut f = line.split_whitespace();
    if f.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = f.take(3).map(|x| x.parse().ok()).collect::<Option<_>>()?;
    Some(v.iter().sum())
}

fn own_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime, stime, cutime, cstime are fields 14-17, i.e. 11-14 after ')'.
    let mut sum = 0u64;
    for i in 11..=14 {
        sum += f.get(i)?.parse::<i64>().ok()?.max(0) as u64;
    }
    Some(sum)
}

impl Sample {
    pub fn now() -> Sample {
        Sample {
            at: Instant::now(),
            machine_ticks: machine_ticks(),
            own_ticks: own_ticks(),
        }
    }

    /// Percent of all CPUs spent outside this process since `self`.
    pub fn foreign_percent(&self) -> Option<f64> {
        let end = Sample::now();
        let cpus = std::thread::available_parallelism().ok()?.get() as f64;
        let secs = end.at.duration_since(self.at).as_secs_f64();
        if secs <= 0.0 {
            return None;
        }
        let machine = end.machine_ticks?.checked_sub(self.machine_ticks?)?;
        let own = end.own_ticks?.checked_sub(self.own_ticks?)?;
        let foreign = machine.saturating_sub(own) as f64 / TICKS_PER_SEC;
        Some((foreign / (secs * cpus) * 100.0).clamp(0.0, 100.0))
    }
}
