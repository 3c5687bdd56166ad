//! How busy the machine was with work other than this benchmark, per
//! scenario: a run that shared its cores with a compiler says so.
//!
//! From `/proc/stat` (user, nice and system time of every CPU) minus this
//! process's own time and that of its reaped children (`/proc/self/stat`).
//! What remains is other processes plus kernel threads (some of which, such
//! as direct-I/O completion workers, serve this benchmark).
//!
//! Also the *steal* time of `/proc/stat`: in a virtual machine, time in which
//! a vCPU had work but the host ran something else. A thread woken on such a
//! vCPU waits for the host, however idle the guest looks.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use std::collections::BTreeMap;
use std::time::Instant;

/// Clock ticks per second of `/proc` times (USER_HZ; 100 on Linux).
const TICKS_PER_SEC: f64 = 100.0;

/// A point to measure from.
pub struct Sample {
    at: Instant,
    machine_ticks: Option<u64>,
    own_ticks: Option<u64>,
    steal_ticks: Option<u64>,
}

/// The summary `cpu` line of `/proc/stat`: user, nice, system, idle,
/// iowait, irq, softirq, steal, … in ticks, summed over every CPU.
fn cpu_line() -> Option<Vec<u64>> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let mut f = line.split_whitespace();
    if f.next()? != "cpu" {
        return None;
    }
    f.map(|x| x.parse().ok()).collect()
}

/// User, nice and system ticks of every CPU.
fn machine_ticks(line: Option<&[u64]>) -> Option<u64> {
    Some(line?.get(..3)?.iter().sum())
}

/// Steal ticks of every CPU (the eighth field; absent on old kernels).
fn steal_ticks(line: Option<&[u64]>) -> Option<u64> {
    line?.get(7).copied()
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
        let line = cpu_line();
        Sample {
            at: Instant::now(),
            machine_ticks: machine_ticks(line.as_deref()),
            own_ticks: own_ticks(),
            steal_ticks: steal_ticks(line.as_deref()),
        }
    }

    /// Percent of all CPUs' time since `self` that the host took from this
    /// virtual machine (0 on bare metal).
    pub fn steal_percent(&self) -> Option<f64> {
        self.percent_of_cpus(|start, end| end.steal_ticks?.checked_sub(start.steal_ticks?))
    }

    /// Percent of all CPUs spent outside this process since `self`.
    pub fn foreign_percent(&self) -> Option<f64> {
        self.percent_of_cpus(|start, end| {
            let machine = end.machine_ticks?.checked_sub(start.machine_ticks?)?;
            let own = end.own_ticks?.checked_sub(start.own_ticks?)?;
            Some(machine.saturating_sub(own))
        })
    }

    /// `ticks(self, now)` as a percent of all CPUs' time since `self`.
    fn percent_of_cpus(&self, ticks: impl Fn(&Sample, &Sample) -> Option<u64>) -> Option<f64> {
        let end = Sample::now();
        let cpus = std::thread::available_parallelism().ok()?.get() as f64;
        let secs = end.at.duration_since(self.at).as_secs_f64();
        if secs <= 0.0 {
            return None;
        }
        let spent = ticks(self, &end)? as f64 / TICKS_PER_SEC;
        Some((spent / (secs * cpus) * 100.0).clamp(0.0, 100.0))
    }
}

/// CPU time of this process's threads, summed by thread name (as the
/// kernel keeps it: at most 15 bytes).
pub struct Threads {
    at: Instant,
    ticks: BTreeMap<String, u64>,
}

impl Threads {
    pub fn now() -> Threads {
        let mut ticks = BTreeMap::new();
        if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
            for task in dir.flatten() {
                let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
                    continue;
                };
                if let Some((name, t)) = thread_ticks(&stat) {
                    *ticks.entry(name).or_insert(0) += t;
                }
            }
        }
        Threads {
            at: Instant::now(),
            ticks,
        }
    }

    /// Percent of one core each thread name used since `self` (threads
    /// that ended meanwhile are not counted).
    pub fn percent_since(&self) -> BTreeMap<String, f64> {
        let end = Threads::now();
        let secs = end.at.duration_since(self.at).as_secs_f64();
        let mut out = BTreeMap::new();
        if secs <= 0.0 {
            return out;
        }
        for (name, t) in end.ticks {
            let used = t.saturating_sub(self.ticks.get(&name).copied().unwrap_or(0));
            out.insert(name, used as f64 / TICKS_PER_SEC / secs * 100.0);
        }
        out
    }
}

/// A thread's name and its user + system ticks, from its `stat`.
fn thread_ticks(stat: &str) -> Option<(String, u64)> {
    let name = &stat[stat.find('(')? + 1..stat.rfind(')')?];
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15, i.e. 11 and 12 after ')'.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some((name.to_string(), utime + stime))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_stat_line_gives_its_name_and_time() {
        let stat = "123 (rotary shard) 0) S 1 2 3 4 5 6 7 8 9 10 250 31 0 0 20 0";
        assert_eq!(thread_ticks(stat), Some(("rotary shard) 0".into(), 281)));
        assert_eq!(thread_ticks("123 (x) S 1"), None);
    }

    #[test]
    fn the_cpu_line_gives_busy_and_stolen_ticks() {
        // user nice system idle iowait irq softirq steal guest guest_nice
        let line = [100, 2, 30, 900, 5, 0, 7, 40, 0, 0];
        assert_eq!(machine_ticks(Some(&line)), Some(132));
        assert_eq!(steal_ticks(Some(&line)), Some(40));
        // A kernel too old to report steal.
        assert_eq!(steal_ticks(Some(&line[..7])), None);
        assert_eq!(machine_ticks(None), None);
        // This machine's own line parses.
        let here = cpu_line().expect("/proc/stat");
        assert!(machine_ticks(Some(&here)).is_some());
    }
}
