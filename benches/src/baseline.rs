//! The machine's ceilings, measured by the usual tools: `fio` for the disk
//! under the data directory (O_DIRECT sequential writes: overwriting a file
//! written whole, or extending a fresh one; and 4 KiB writes each followed by
//! fdatasync) and `iperf3` for one TCP stream on loopback. Both are parsed
//! from their JSON output. A tool that is missing is skipped with a note on
//! how to install it. Also the SHA-1 rate of one core, which bounds what one
//! shard can append (it hashes every appended byte twice).
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use crate::child::ChildGuard;
use crate::report::{FioFigures, Iperf3Figures, Sha1Figures};
use crate::BenchArgs;
use anyhow::Context as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Extra time fio and iperf3 get beyond their run time (fio lays out its
/// file first) before they are killed.
const TOOL_GRACE: Duration = Duration::from_secs(120);
/// How long the iperf3 client keeps retrying while the server starts.
const IPERF3_SERVER_START_TIMEOUT: Duration = Duration::from_secs(5);
const IPERF3_RETRY_INTERVAL: Duration = Duration::from_millis(100);

const INSTALL_HINT: &str = "install with: apt-get install -y fio iperf3";

/// Whether `tool` can be run; `Err` holds why not, with the install hint.
fn available(tool: &str) -> Result<String, String> {
    match Command::new(tool)
        .arg("--version")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
    {
        Ok(out) => Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(format!("{tool} is not installed; {INSTALL_HINT}"))
        }
        Err(e) => Err(format!("cannot run {tool}: {e}")),
    }
}

/// Runs `cmd` with stdout captured, killing it by PID after `timeout`.
fn output_with_timeout(mut cmd: Command, timeout: Duration) -> anyhow::Result<(bool, String)> {
    let out_path = tempfile::NamedTempFile::new().context("temporary file for tool output")?;
    let out_file = out_path.reopen()?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out_file)
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    let mut guard = ChildGuard(child);
    let status = guard.wait_timeout(timeout)?;
    let out = std::fs::read_to_string(out_path.path())?;
    let mut err = String::new();
    if let Some(mut e) = guard.0.stderr.take() {
        use std::io::Read as _;
        let _ = e.read_to_string(&mut err);
    }
    match status {
        None => anyhow::bail!("{:?} did not finish within {timeout:?}", cmd.get_program()),
        Some(s) if !s.success() && !out.contains('{') => {
            anyhow::bail!("{:?} failed ({s}): {}", cmd.get_program(), err.trim())
        }
        Some(s) => Ok((s.success(), out)),
    }
}

/// The JSON document in a tool's output (fio may print notes before it).
fn json_of(out: &str) -> anyhow::Result<serde_json::Value> {
    let start = out.find('{').context("no JSON in the output")?;
    serde_json::from_str(&out[start..]).context("parsing the JSON output")
}

/// How a fio job's writes meet the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FioMode {
    /// The file is written whole first; every measured write overwrites
    /// written blocks (what a recycled spool does).
    Overwrite,
    /// A fresh file with nothing allocated; every write allocates blocks
    /// (what a file grown by its writes costs).
    Extend,
    /// A fresh file allocated whole by `fallocate` and written once: each
    /// write turns unwritten blocks into written ones (what a new spool,
    /// grown by `fallocate` ahead of its writes, does).
    Fresh,
}

impl FioMode {
    pub fn name(self) -> &'static str {
        match self {
            FioMode::Overwrite => "overwrite",
            FioMode::Extend => "extend",
            FioMode::Fresh => "fresh preallocated",
        }
    }
}

/// One fio job: what to write and how.
pub struct FioJob {
    /// Key of the figure in `skipped` and in messages.
    pub key: &'static str,
    pub block_kib: u64,
    pub iodepth: u32,
    /// Overwrite: the file written over and over. Extend: the most the job
    /// writes (it ends early when the file is full).
    pub file_mib: u64,
    pub mode: FioMode,
    /// fdatasync after every write; the figures are then the syncs'.
    pub fdatasync: bool,
}

/// The `--baseline` matrix: 16 KiB and 1 MiB blocks, one and 32 deep,
/// overwrite and extend.
pub fn matrix(file_mib: u64) -> Vec<FioJob> {
    let mut jobs = Vec::new();
    for (mode, keys) in [
        (
            FioMode::Overwrite,
            [
                "fio-16k-qd1-overwrite",
                "fio-16k-qd32-overwrite",
                "fio-1m-qd1-overwrite",
                "fio-1m-qd32-overwrite",
            ],
        ),
        (
            FioMode::Extend,
            [
                "fio-16k-qd1-extend",
                "fio-16k-qd32-extend",
                "fio-1m-qd1-extend",
                "fio-1m-qd32-extend",
            ],
        ),
    ] {
        for (i, (block_kib, iodepth)) in [(16, 1), (16, 32), (1024, 1), (1024, 32)]
            .into_iter()
            .enumerate()
        {
            jobs.push(FioJob {
                key: keys[i],
                block_kib,
                iodepth,
                file_mib,
                mode,
                fdatasync: false,
            });
        }
    }
    jobs
}

/// fio: O_DIRECT sequential writes to a file in `dir`, as `job` says.
pub fn fio(
    args: &BenchArgs,
    dir: &Path,
    job: &FioJob,
    skipped: &mut std::collections::BTreeMap<&'static str, String>,
) -> anyhow::Result<Option<FioFigures>> {
    let key = job.key;
    let version = match available("fio") {
        Ok(v) => v,
        Err(why) => {
            eprintln!("baseline: skipping {key}: {why}");
            skipped.insert(key, why);
            return Ok(None);
        }
    };
    let file = dir.join(format!("{key}.dat"));
    let run_ms = (args.duration_secs * 1000.0).ceil() as u64;
    let ramp_ms = (args.warmup_secs * 1000.0).ceil() as u64;
    let ioengine = "io_uring";
    let _ = std::fs::remove_file(&file);
    let mut cmd = Command::new("fio");
    cmd.arg(format!("--name={key}"))
        .arg(format!("--filename={}", file.display()))
        .arg(format!("--size={}M", job.file_mib))
        .arg(format!("--bs={}k", job.block_kib))
        .arg("--rw=write")
        .arg("--direct=1")
        .arg(format!("--ioengine={ioengine}"))
        .arg(format!("--iodepth={}", job.iodepth))
        .arg(format!("--runtime={run_ms}ms"))
        .arg(format!("--ramp_time={ramp_ms}ms"))
        .arg("--output-format=json");
    match job.mode {
        // Lay the file out (write it whole) before the measured phase, so
        // every measured write overwrites allocated, written blocks.
        FioMode::Overwrite => {
            cmd.arg("--overwrite=1").arg("--time_based");
        }
        // Nothing allocated ahead, and no wrapping around to blocks this
        // job already wrote: it ends at the run time or at the file's end.
        FioMode::Extend => {
            cmd.arg("--overwrite=0").arg("--fallocate=none");
        }
        FioMode::Fresh => {
            cmd.arg("--overwrite=0").arg("--fallocate=native");
        }
    }
    if job.fdatasync {
        cmd.arg("--fdatasync=1");
    }
    let timeout = args.duration() + args.warmup() + TOOL_GRACE;
    let result = output_with_timeout(cmd, timeout);
    let _ = std::fs::remove_file(&file);
    let (_, out) = match result {
        Ok(r) => r,
        Err(e) => {
            let why = format!("{e:#}");
            eprintln!("baseline: {key} failed: {why}");
            skipped.insert(key, why);
            return Ok(None);
        }
    };
    let doc = json_of(&out).context("fio")?;
    let result = &doc["jobs"][0];
    if result["error"].as_i64().unwrap_or(0) != 0 {
        let why = format!("fio job error {}", result["error"]);
        skipped.insert(key, why);
        return Ok(None);
    }
    let w = &result["write"];
    // With fdatasync the latencies that matter are the syncs'.
    let lat = if job.fdatasync {
        &result["sync"]["lat_ns"]
    } else {
        &w["clat_ns"]
    };
    let pct = |p: &str| lat["percentile"][p].as_f64().map(|ns| ns / 1000.0);
    Ok(Some(FioFigures {
        key: key.to_string(),
        version: doc["fio version"].as_str().unwrap_or(&version).to_string(),
        ioengine: ioengine.into(),
        block_kib: job.block_kib,
        iodepth: job.iodepth,
        file_mib: job.file_mib,
        mode: job.mode,
        fdatasync: job.fdatasync,
        seconds: w["runtime"].as_f64().unwrap_or(0.0) / 1000.0,
        mb_per_s: w["bw_bytes"].as_f64().context("fio: no write.bw_bytes")? / 1e6,
        iops: w["iops"].as_f64().unwrap_or(0.0),
        clat_p50_us: pct("50.000000"),
        clat_p99_us: pct("99.000000"),
        clat_p999_us: pct("99.900000"),
        clat_max_us: lat["max"].as_f64().map(|ns| ns / 1000.0),
    }))
}

/// A port on 127.0.0.1 that was free a moment ago.
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// iperf3: one TCP stream on loopback, server started here and stopped by PID.
pub fn iperf3(
    args: &BenchArgs,
    skipped: &mut std::collections::BTreeMap<&'static str, String>,
) -> anyhow::Result<Option<Iperf3Figures>> {
    let version = match available("iperf3") {
        Ok(v) => v,
        Err(why) => {
            eprintln!("baseline: skipping iperf3: {why}");
            skipped.insert("iperf3", why);
            return Ok(None);
        }
    };
    let port = free_port()?;
    // `-1`: the server also ends on its own after one test, should this
    // process die before it stops it.
    let server = Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting iperf3 -s")?;
    let mut server = ChildGuard(server);
    // iperf3 takes whole seconds.
    let secs = args.duration_secs.ceil().max(1.0) as u64;
    let omit = args.warmup_secs.ceil() as u64;
    let started = Instant::now();
    let doc = loop {
        if let Some(status) = server.0.try_wait()? {
            let why = format!("iperf3 server exited early ({status})");
            skipped.insert("iperf3", why);
            return Ok(None);
        }
        let mut cmd = Command::new("iperf3");
        cmd.args(["-c", "127.0.0.1", "-p", &port.to_string(), "-J"])
            .args(["-t", &secs.to_string(), "-O", &omit.to_string()]);
        let timeout = Duration::from_secs(secs + omit) + TOOL_GRACE;
        let (ok, out) = output_with_timeout(cmd, timeout)?;
        let doc = json_of(&out).context("iperf3")?;
        if ok && doc.get("error").is_none() {
            break doc;
        }
        let error = doc["error"].as_str().unwrap_or("failed").to_string();
        if started.elapsed() >= IPERF3_SERVER_START_TIMEOUT || !error.contains("connect") {
            skipped.insert("iperf3", format!("iperf3 client: {error}"));
            return Ok(None);
        }
        std::thread::sleep(IPERF3_RETRY_INTERVAL);
    };
    drop(server);
    let end = &doc["end"]["sum_received"];
    Ok(Some(Iperf3Figures {
        version: doc["start"]["version"]
            .as_str()
            .unwrap_or(&version)
            .to_string(),
        seconds: end["seconds"].as_f64().unwrap_or(0.0),
        mb_per_s: end["bits_per_second"]
            .as_f64()
            .context("iperf3: no end.sum_received.bits_per_second")?
            / 8.0
            / 1e6,
        cores: cpu_cores(&doc["end"]["cpu_utilization_percent"]),
    }))
}

/// Cores an iperf3 run used, sender and receiver together, from its
/// `cpu_utilization_percent` object.
fn cpu_cores(cpu: &serde_json::Value) -> Option<f64> {
    let host = cpu["host_total"].as_f64()?;
    let remote = cpu["remote_total"].as_f64()?;
    Some((host + remote) / 100.0)
}

/// Buffer hashed by the SHA-1 measurement: one `append-1m` append.
const SHA1_BUFFER_BYTES: usize = 1 << 20;

/// SHA-1 (the `sha1` crate the broker uses) over 1 MiB buffers on this
/// thread for `--duration`.
pub fn sha1(args: &BenchArgs) -> Sha1Figures {
    use sha1::{Digest as _, Sha1};
    let buf: Vec<u8> = (0..SHA1_BUFFER_BYTES).map(|i| (i * 31) as u8).collect();
    let start = Instant::now();
    let end = start + args.duration();
    let mut hashed = 0u64;
    let mut last = [0u8; 20];
    while Instant::now() < end {
        let digest: [u8; 20] = Sha1::digest(&buf).into();
        last[0] ^= digest[0];
        hashed += SHA1_BUFFER_BYTES as u64;
    }
    std::hint::black_box(last);
    let secs = start.elapsed().as_secs_f64();
    // The shard's own pass: every byte into a fragment's state and an
    // append's, which starts 13 bytes later (blocks not in step).
    let both_start = Instant::now();
    let both_end = both_start + args.duration();
    let mut fragment = rotary_storage::sha::Sha1::new();
    fragment.update(&buf[..13]);
    let mut both = 0u64;
    while Instant::now() < both_end {
        let mut append = rotary_storage::sha::Sha1::new();
        rotary_storage::sha::update_both(&mut fragment, &mut append, &buf);
        last[1] ^= append.finalize()[0];
        both += SHA1_BUFFER_BYTES as u64;
    }
    std::hint::black_box(last);
    Sha1Figures {
        buffer_bytes: SHA1_BUFFER_BYTES,
        seconds: secs,
        mb_per_s: hashed as f64 / secs / 1e6,
        both_mb_per_s: both as f64 / both_start.elapsed().as_secs_f64() / 1e6,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn the_matrix_covers_sizes_depths_and_modes_once_each() {
        let jobs = matrix(1024);
        let cells: HashSet<_> = jobs
            .iter()
            .map(|j| (j.block_kib, j.iodepth, j.mode))
            .collect();
        let mut want = HashSet::new();
        for mode in [FioMode::Overwrite, FioMode::Extend] {
            for block_kib in [16, 1024] {
                for iodepth in [1, 32] {
                    want.insert((block_kib, iodepth, mode));
                }
            }
        }
        assert_eq!(cells, want);
        assert_eq!(jobs.len(), want.len());
        let keys: HashSet<_> = jobs.iter().map(|j| j.key).collect();
        assert_eq!(keys.len(), jobs.len(), "keys are unique");
        for j in &jobs {
            assert!(j.key.contains(j.mode.name()), "{}", j.key);
            assert!(!j.fdatasync);
        }
    }

    #[test]
    fn iperf3_cpu_is_read_as_cores_of_both_ends() {
        // The shape of iperf3 3.12's `end.cpu_utilization_percent`.
        let cpu = serde_json::json!({
            "host_total": 99.1, "host_user": 1.1, "host_system": 98.0,
            "remote_total": 39.0, "remote_user": 2.7, "remote_system": 36.3,
        });
        let cores = cpu_cores(&cpu).expect("both totals");
        assert!((cores - 1.381).abs() < 1e-9, "{cores}");
        assert_eq!(cpu_cores(&serde_json::json!({ "host_total": 50.0 })), None);
        assert_eq!(cpu_cores(&serde_json::Value::Null), None);
    }
}
