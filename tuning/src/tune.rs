//! `rotary tune`: calibrates the device under a data directory and writes a
//! profile the broker reads at start.
//!
//! On a scratch file in the data directory (opened with O_DIRECT, removed at
//! the end) it measures, in this order:
//! 1. sequential O_DIRECT writes through io_uring for every block size in
//!    [`BLOCK_SIZES_BYTES`] at every queue depth in [`DEPTHS`], first as
//!    *overwrites* of a region that was preallocated and written once (how
//!    spools are written), then as *extending* writes past the end of the
//!    file;
//! 2. fdatasync latency, each call after one 4 KiB O_DIRECT overwrite;
//! 3. 4 KiB O_DIRECT read latency at random offsets of the region.
//!
//! From the write matrix it derives [`Recommendations`] (pure functions of
//! the measurements, see [`recommend`]): how many bytes to write per batch,
//! how deep a ring to give a shard, how far ahead to preallocate spools.
//! Each phase runs for a fixed time ([`TuneOptions`]), so the whole run takes
//! 20–25 s (`quick`: about 5 s) including one pass writing the region, on
//! any device fast enough that a queue of 32 × 4 MiB drains within a phase.
//!
//! The profile is `<data>/tune-profile.json` ([`PROFILE_FILE`]); `README.md`
//! documents its fields. It runs once, on the calling thread, never on a
//! shard.
#![allow(clippy::disallowed_methods)] // The tuning tool measures real devices in real time.

use crate::direct::{AlignedBuf, Writer, ALIGN};
use crate::doctor::{bytes_text, dev_major_minor, fs_name};
use crate::sys;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The profile's file name inside the data directory.
pub const PROFILE_FILE: &str = "tune-profile.json";
/// Version of the profile's format; [`load`] refuses any other.
pub const PROFILE_VERSION: u32 = 1;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Block sizes of the write matrix, smallest first.
pub const BLOCK_SIZES_BYTES: [u64; 5] = [16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB];
/// Queue depths of the write matrix, smallest first.
pub const DEPTHS: [u32; 3] = [1, 4, 32];
const BLOCK_BYTES_MAX: u64 = BLOCK_SIZES_BYTES[BLOCK_SIZES_BYTES.len() - 1];
const DEPTH_MAX: u32 = DEPTHS[DEPTHS.len() - 1];

/// The smallest region: the deepest queue of the largest blocks fits in it
/// without two writes in flight at one offset.
pub const REGION_BYTES_MIN: u64 = DEPTH_MAX as u64 * BLOCK_BYTES_MAX;
/// Extending writes stop after this many regions' worth of bytes per cell,
/// which bounds the space they take (the file is cut back to the region
/// between cells).
const EXTEND_REGIONS: u64 = 4;
/// Free space kept on top of the scratch file (region plus extend area).
const SPACE_MARGIN_BYTES: u64 = 64 * MIB;

/// Size of the writes before each fdatasync and of each read.
const SMALL_IO_BYTES: u64 = 4 * KIB;
/// Block size and depth of the pass that writes the region once.
const PREFILL_BLOCK_BYTES: u64 = MIB;
const PREFILL_DEPTH: u32 = 4;

/// A bandwidth within this share of the best counts as reaching it.
pub const SATURATION_PERCENT: u64 = 90;
pub const WRITE_BATCH_BYTES_MIN: u64 = 256 * KIB;
pub const WRITE_BATCH_BYTES_MAX: u64 = 16 * MIB;
pub const RING_ENTRIES_MIN: u32 = 64;
pub const RING_ENTRIES_MAX: u32 = 4096;
/// Spools are preallocated this far ahead, in time at the best bandwidth.
pub const SPOOL_GROW_AHEAD_MS: u64 = 50;
pub const SPOOL_GROW_BYTES_MIN: u64 = 16 * MIB;
pub const SPOOL_GROW_BYTES_MAX: u64 = GIB;

const _: () = {
    assert!(BLOCK_BYTES_MAX.is_multiple_of(ALIGN as u64));
    assert!(BLOCK_SIZES_BYTES[0].is_multiple_of(ALIGN as u64));
    assert!(SMALL_IO_BYTES.is_multiple_of(ALIGN as u64));
    assert!(REGION_BYTES_MIN.is_multiple_of(BLOCK_BYTES_MAX));
    assert!(PREFILL_BLOCK_BYTES <= BLOCK_BYTES_MAX);
    assert!(PREFILL_DEPTH <= DEPTH_MAX);
    assert!(RING_ENTRIES_MIN.is_power_of_two() && RING_ENTRIES_MAX.is_power_of_two());
    assert!(SPOOL_GROW_BYTES_MIN.is_multiple_of(MIB) && SPOOL_GROW_BYTES_MAX.is_multiple_of(MIB));
};

/// How long each phase runs and how much disk it may use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TuneOptions {
    /// Time spent on each (mode, block size, depth) cell of the write matrix.
    pub cell_time: Duration,
    /// Time spent on the fdatasync test and on the read test, each.
    pub latency_time: Duration,
    /// Size of the overwrite region, written once before the tests;
    /// extending writes add at most four times as much. Raised to [`REGION_BYTES_MIN`] and
    /// rounded down to a multiple of the largest block.
    pub region_bytes: u64,
    /// Print each measurement to stdout as soon as it is taken.
    pub progress: bool,
}

impl TuneOptions {
    /// 20–25 s: 30 cells × 600 ms, 2 × 1.5 s of latency tests, a 256 MiB
    /// region.
    pub fn standard() -> Self {
        TuneOptions {
            cell_time: Duration::from_millis(600),
            latency_time: Duration::from_millis(1500),
            region_bytes: 256 * MIB,
            progress: false,
        }
    }

    /// About 5 s (`--quick`): 30 cells × 100 ms, 2 × 500 ms of latency tests,
    /// a 128 MiB region. Coarser: few samples for large blocks at depth 32.
    pub fn quick() -> Self {
        TuneOptions {
            cell_time: Duration::from_millis(100),
            latency_time: Duration::from_millis(500),
            region_bytes: REGION_BYTES_MIN,
            progress: false,
        }
    }
}

impl Default for TuneOptions {
    fn default() -> Self {
        Self::standard()
    }
}

/// What a calibration found, and what it recommends. Saved as
/// `<data>/tune-profile.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// [`PROFILE_VERSION`] when written.
    pub version: u32,
    /// When the calibration ran, seconds since the Unix epoch.
    pub measured_unix_s: u64,
    pub host: Host,
    pub settings: Settings,
    /// The write matrix: overwrite cells, then extend cells, each by block
    /// size then depth.
    pub writes: Vec<WriteCell>,
    /// fdatasync after a 4 KiB O_DIRECT overwrite (the fdatasync alone).
    pub fdatasync_4k: Latency,
    /// 4 KiB O_DIRECT reads at random offsets, one at a time.
    pub read_4k: Latency,
    pub recommended: Recommendations,
}

/// Where the calibration ran.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Host {
    /// Kernel release, e.g. `6.1.0-18-amd64`.
    pub kernel: String,
    /// Filesystem of the data directory, e.g. `xfs`.
    pub filesystem: String,
    /// `major:minor` of the data directory's device (`st_dev`).
    pub device: String,
    /// The whole block device under it, e.g. `nvme0n1`, when there is one.
    pub block_device: Option<String>,
}

/// How the calibration ran.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settings {
    pub cell_ms: u64,
    pub latency_ms: u64,
    pub region_bytes: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WriteMode {
    /// Writes into a region that was preallocated and written once.
    Overwrite,
    /// Writes past the end of the file.
    Extend,
}

impl fmt::Display for WriteMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            WriteMode::Overwrite => "overwrite",
            WriteMode::Extend => "extend",
        })
    }
}

/// One cell of the write matrix: sequential writes of `block_bytes` with
/// `depth` in flight.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteCell {
    pub mode: WriteMode,
    pub block_bytes: u64,
    pub depth: u32,
    /// Writes completed.
    pub ios: u64,
    /// Bytes completed over the time from the first submission to the last
    /// completion.
    pub bytes_per_s: u64,
    /// Latency from submission to reaped completion.
    pub p50_ns: u64,
    pub p99_ns: u64,
}

/// A latency distribution; nearest-rank percentiles.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Latency {
    pub samples: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

/// What the broker sizes from the profile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recommendations {
    /// Largest batch of spool bytes written in one submission: the smallest
    /// block size whose depth-1 overwrite bandwidth is within 90 % of the
    /// best depth-1 overwrite bandwidth, clamped to [256 KiB, 16 MiB].
    pub write_batch_bytes: u64,
    /// Submission queue entries per shard ring: twice the depth at which
    /// overwrite bandwidth reaches 90 % of its best, as a power of two,
    /// clamped to [64, 4096].
    pub ring_entries: u32,
    /// How far ahead of the write head spools are preallocated: 50 ms at the
    /// best overwrite bandwidth, rounded up to 1 MiB, clamped to
    /// [16 MiB, 1 GiB].
    pub spool_grow_bytes: u64,
    /// Best overwrite bandwidth over best extend bandwidth, two decimals;
    /// informational (0 when extends were not measured).
    pub extend_penalty: f64,
}

impl Recommendations {
    /// Checks a loaded profile: every size within its clamp.
    fn validate(&self) -> Result<(), (&'static str, u64)> {
        let r = self;
        if !(WRITE_BATCH_BYTES_MIN..=WRITE_BATCH_BYTES_MAX).contains(&r.write_batch_bytes)
            || !r.write_batch_bytes.is_multiple_of(ALIGN as u64)
        {
            return Err(("write_batch_bytes", r.write_batch_bytes));
        }
        if !(RING_ENTRIES_MIN..=RING_ENTRIES_MAX).contains(&r.ring_entries)
            || !r.ring_entries.is_power_of_two()
        {
            return Err(("ring_entries", u64::from(r.ring_entries)));
        }
        if !(SPOOL_GROW_BYTES_MIN..=SPOOL_GROW_BYTES_MAX).contains(&r.spool_grow_bytes)
            || !r.spool_grow_bytes.is_multiple_of(MIB)
        {
            return Err(("spool_grow_bytes", r.spool_grow_bytes));
        }
        Ok(())
    }
}

/// Why a calibration, or reading or writing a profile, failed.
#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    #[error("{}: {op}: {source}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(
        "{}: {} free, calibration needs {}",
        path.display(),
        bytes_text(*avail_bytes),
        bytes_text(*need_bytes)
    )]
    NoSpace {
        path: PathBuf,
        avail_bytes: u64,
        need_bytes: u64,
    },
    #[error("{}: not a tune profile: {source}", path.display())]
    Malformed {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "{}: profile version {found}, this build reads version {expected}; run `rotary tune` again",
        path.display()
    )]
    Version {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error(
        "{}: recommended {field} = {value} is out of range; run `rotary tune` again",
        path.display()
    )]
    OutOfRange {
        path: PathBuf,
        field: &'static str,
        value: u64,
    },
}

fn io_err<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(io::Error) -> TuneError + 'a {
    move |source| TuneError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

// ------------------------------------------------------------- the profile

/// `<data_dir>/tune-profile.json`.
pub fn profile_path(data_dir: &Path) -> PathBuf {
    data_dir.join(PROFILE_FILE)
}

/// Reads `<data_dir>/tune-profile.json`: `Ok(None)` when there is none (the
/// broker then runs on its defaults), an error when it cannot be read, is not
/// a profile of this version, or recommends sizes outside their clamps.
/// Logs nothing; the caller says what it does about it.
pub fn load(data_dir: &Path) -> Result<Option<Profile>, TuneError> {
    let path = profile_path(data_dir);
    let text = match fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path, "read")(e)),
    };
    #[derive(Deserialize)]
    struct Versioned {
        version: u32,
    }
    let malformed = |source| TuneError::Malformed {
        path: path.clone(),
        source,
    };
    // The version first, so that a profile from another version is named as
    // such rather than as a parse error.
    let Versioned { version } = serde_json::from_slice(&text).map_err(malformed)?;
    if version != PROFILE_VERSION {
        return Err(TuneError::Version {
            path: path.clone(),
            found: version,
            expected: PROFILE_VERSION,
        });
    }
    let profile: Profile = serde_json::from_slice(&text).map_err(malformed)?;
    if let Err((field, value)) = profile.recommended.validate() {
        return Err(TuneError::OutOfRange { path, field, value });
    }
    Ok(Some(profile))
}

impl Profile {
    /// Writes `<data_dir>/tune-profile.json` atomically (a temporary file,
    /// fsync, rename, fsync of the directory) and returns its path.
    pub fn save(&self, data_dir: &Path) -> Result<PathBuf, TuneError> {
        let path = profile_path(data_dir);
        let tmp = data_dir.join(format!(".{PROFILE_FILE}.tmp"));
        let mut text = serde_json::to_vec_pretty(self).expect("a profile serializes");
        text.push(b'\n');
        let mut file = fs::File::create(&tmp).map_err(io_err(&tmp, "create"))?;
        file.write_all(&text).map_err(io_err(&tmp, "write"))?;
        file.sync_all().map_err(io_err(&tmp, "fsync"))?;
        drop(file);
        fs::rename(&tmp, &path).map_err(io_err(&path, "rename"))?;
        fs::File::open(data_dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err(data_dir, "fsync"))?;
        Ok(path)
    }

    /// Whether `data_dir` is on the device this profile was measured on.
    pub fn matches_device(&self, data_dir: &Path) -> bool {
        device_id(data_dir).is_ok_and(|d| d == self.host.device)
    }
}

/// `major:minor` of the device holding `path`.
pub fn device_id(path: &Path) -> io::Result<String> {
    let (major, minor) = dev_major_minor(fs::metadata(path)?.dev());
    Ok(format!("{major}:{minor}"))
}

// ------------------------------------------------------------ the analysis

fn best_bytes_per_s(writes: &[WriteCell], mode: WriteMode, depth: Option<u32>) -> u64 {
    writes
        .iter()
        .filter(|c| c.mode == mode && depth.is_none_or(|d| c.depth == d))
        .map(|c| c.bytes_per_s)
        .max()
        .unwrap_or(0)
}

/// `bytes_per_s` is within [`SATURATION_PERCENT`] of a positive `best`.
fn reaches(bytes_per_s: u64, best: u64) -> bool {
    best > 0 && u128::from(bytes_per_s) * 100 >= u128::from(best) * u128::from(SATURATION_PERCENT)
}

/// The smallest depth-1 overwrite block size within 90 % of the best
/// depth-1 overwrite bandwidth, clamped.
pub fn write_batch_bytes(writes: &[WriteCell]) -> u64 {
    let best = best_bytes_per_s(writes, WriteMode::Overwrite, Some(1));
    writes
        .iter()
        .filter(|c| c.mode == WriteMode::Overwrite && c.depth == 1 && reaches(c.bytes_per_s, best))
        .map(|c| c.block_bytes)
        .min()
        .unwrap_or(WRITE_BATCH_BYTES_MIN)
        .clamp(WRITE_BATCH_BYTES_MIN, WRITE_BATCH_BYTES_MAX)
}

/// The smallest depth at which the best overwrite bandwidth (over block
/// sizes) is within 90 % of the best at any depth; 1 without measurements.
pub fn saturation_depth(writes: &[WriteCell]) -> u32 {
    let best = best_bytes_per_s(writes, WriteMode::Overwrite, None);
    let mut depths: Vec<u32> = writes
        .iter()
        .filter(|c| c.mode == WriteMode::Overwrite)
        .map(|c| c.depth)
        .collect();
    depths.sort_unstable();
    depths.dedup();
    depths
        .into_iter()
        .find(|&d| {
            reaches(
                best_bytes_per_s(writes, WriteMode::Overwrite, Some(d)),
                best,
            )
        })
        .unwrap_or(1)
}

/// Twice `depth`, as a power of two, clamped.
pub fn ring_entries(depth: u32) -> u32 {
    depth
        .saturating_mul(2)
        .checked_next_power_of_two()
        .unwrap_or(RING_ENTRIES_MAX)
        .clamp(RING_ENTRIES_MIN, RING_ENTRIES_MAX)
}

/// [`SPOOL_GROW_AHEAD_MS`] at `bytes_per_s`, rounded up to 1 MiB, clamped.
pub fn spool_grow_bytes(bytes_per_s: u64) -> u64 {
    let ahead = u128::from(bytes_per_s) * u128::from(SPOOL_GROW_AHEAD_MS) / 1000;
    let mib = ahead.div_ceil(u128::from(MIB));
    let bytes = u64::try_from(mib * u128::from(MIB)).unwrap_or(u64::MAX);
    bytes.clamp(SPOOL_GROW_BYTES_MIN, SPOOL_GROW_BYTES_MAX)
}

/// Best overwrite over best extend bandwidth, to two decimals; 0 when
/// either is missing.
pub fn extend_penalty(writes: &[WriteCell]) -> f64 {
    let overwrite = best_bytes_per_s(writes, WriteMode::Overwrite, None);
    let extend = best_bytes_per_s(writes, WriteMode::Extend, None);
    if overwrite == 0 || extend == 0 {
        return 0.0;
    }
    (overwrite as f64 / extend as f64 * 100.0).round() / 100.0
}

/// Every recommendation from a write matrix.
pub fn recommend(writes: &[WriteCell]) -> Recommendations {
    Recommendations {
        write_batch_bytes: write_batch_bytes(writes),
        ring_entries: ring_entries(saturation_depth(writes)),
        spool_grow_bytes: spool_grow_bytes(best_bytes_per_s(writes, WriteMode::Overwrite, None)),
        extend_penalty: extend_penalty(writes),
    }
}

/// Nearest-rank percentile (`per_mille` of 1000) of sorted samples.
fn percentile(sorted: &[u64], per_mille: usize) -> u64 {
    assert!(!sorted.is_empty() && per_mille <= 1000);
    let rank = (sorted.len() * per_mille).div_ceil(1000).max(1);
    sorted[rank - 1]
}

fn latency_of(mut samples_ns: Vec<u64>) -> Latency {
    samples_ns.sort_unstable();
    Latency {
        samples: samples_ns.len() as u64,
        p50_ns: percentile(&samples_ns, 500),
        p99_ns: percentile(&samples_ns, 990),
        max_ns: percentile(&samples_ns, 1000),
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

// ------------------------------------------------------------ the report

fn rate_text(bytes_per_s: u64) -> String {
    format!("{:.1} MiB/s", bytes_per_s as f64 / MIB as f64)
}

fn duration_text(ns: u64) -> String {
    match ns {
        0..1_000 => format!("{ns} ns"),
        1_000..1_000_000 => format!("{:.1} µs", ns as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.2} ms", ns as f64 / 1e6),
        _ => format!("{:.2} s", ns as f64 / 1e9),
    }
}

fn host_line(host: &Host) -> String {
    let device = match &host.block_device {
        Some(name) => format!("{name} ({})", host.device),
        None => host.device.clone(),
    };
    format!(
        "device {device}, {}, kernel {}",
        host.filesystem, host.kernel
    )
}

fn cell_line(c: &WriteCell) -> String {
    format!(
        "  {:<9} {:>7} qd {:>2}: {:>12}  p50 {:>9}  p99 {:>9}  ({} writes)",
        c.mode,
        bytes_text(c.block_bytes),
        c.depth,
        rate_text(c.bytes_per_s),
        duration_text(c.p50_ns),
        duration_text(c.p99_ns),
        c.ios
    )
}

fn latency_line(what: &str, l: &Latency, unit: &str) -> String {
    format!(
        "{what}: p50 {}  p99 {}  max {}  ({} {unit})",
        duration_text(l.p50_ns),
        duration_text(l.p99_ns),
        duration_text(l.max_ns),
        l.samples
    )
}

const WRITES_HEADER: &str = "sequential O_DIRECT writes through io_uring:";
const FDATASYNC_TEXT: &str = "fdatasync after a 4 KiB O_DIRECT write";
const READ_TEXT: &str = "4 KiB O_DIRECT random read";

fn recommendation_lines(writes: &[WriteCell], r: &Recommendations) -> String {
    let best_d1 = best_bytes_per_s(writes, WriteMode::Overwrite, Some(1));
    let best = best_bytes_per_s(writes, WriteMode::Overwrite, None);
    let best_extend = best_bytes_per_s(writes, WriteMode::Extend, None);
    format!(
        "recommended:\n\
         \x20 write_batch_bytes {:>9}  smallest depth-1 overwrite block within {SATURATION_PERCENT} % of {}\n\
         \x20 ring_entries      {:>9}  2 × depth {}, where overwrite bandwidth reaches {SATURATION_PERCENT} % of {}\n\
         \x20 spool_grow_bytes  {:>9}  {SPOOL_GROW_AHEAD_MS} ms at {}\n\
         \x20 extend_penalty    {:>9}  overwrite {} / extend {} (informational)\n",
        bytes_text(r.write_batch_bytes),
        rate_text(best_d1),
        r.ring_entries,
        saturation_depth(writes),
        rate_text(best),
        bytes_text(r.spool_grow_bytes),
        rate_text(best),
        format!("{:.2}×", r.extend_penalty),
        rate_text(best),
        rate_text(best_extend),
    )
}

impl fmt::Display for Profile {
    /// The measurements with their units, then the recommendations.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", host_line(&self.host))?;
        writeln!(f, "{WRITES_HEADER}")?;
        for c in &self.writes {
            writeln!(f, "{}", cell_line(c))?;
        }
        writeln!(
            f,
            "{}",
            latency_line(FDATASYNC_TEXT, &self.fdatasync_4k, "calls")
        )?;
        writeln!(f, "{}", latency_line(READ_TEXT, &self.read_4k, "reads"))?;
        write!(
            f,
            "{}",
            recommendation_lines(&self.writes, &self.recommended)
        )
    }
}

// ----------------------------------------------------------- measurement

/// The scratch file; removed when dropped, whatever happened.
struct Scratch {
    file: fs::File,
    path: PathBuf,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

fn host_of(data_dir: &Path) -> Host {
    let kernel = crate::doctor::kernel_release();
    let filesystem = match sys::statfs(data_dir) {
        Ok(st) => match fs_name(st.magic) {
            Some(name) => name.to_string(),
            None => format!("magic {:#x}", st.magic),
        },
        Err(_) => "unknown".into(),
    };
    let device = device_id(data_dir).unwrap_or_else(|_| "unknown".into());
    let block_device = fs::canonicalize(format!("/sys/dev/block/{device}"))
        .ok()
        .map(|mut p| {
            if p.join("partition").exists() {
                p.pop();
            }
            p
        })
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    Host {
        kernel,
        filesystem,
        device,
        block_device,
    }
}

/// Fills `buf` with bytes that neither compress nor repeat within it
/// (xorshift64), so that compressing devices see realistic data.
fn fill_pattern(buf: &mut [u8]) {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// Fails early when the data directory's file system has no room for the
/// scratch region and the regions an extending write grows into.
fn check_space(data_dir: &Path, region: u64) -> Result<(), TuneError> {
    fs::create_dir_all(data_dir).map_err(io_err(data_dir, "create directory"))?;
    let st = sys::statfs(data_dir).map_err(io_err(data_dir, "statfs"))?;
    let avail_bytes = st.blocks_avail.saturating_mul(st.block_size);
    let need_bytes = (1 + EXTEND_REGIONS) * region + SPACE_MARGIN_BYTES;
    if avail_bytes < need_bytes {
        return Err(TuneError::NoSpace {
            path: data_dir.to_path_buf(),
            avail_bytes,
            need_bytes,
        });
    }
    Ok(())
}

/// The overwrite region: allocated, then written once, so that the tests
/// overwrite written blocks as spools do.
fn prefill(
    writer: &mut Writer,
    file: &fs::File,
    path: &Path,
    region: u64,
) -> Result<(), TuneError> {
    match sys::fallocate(file, 0, region) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
            file.set_len(region).map_err(io_err(path, "truncate"))?
        }
        Err(e) => return Err(io_err(path, "fallocate")(e)),
    }
    let mut offsets = (0..region / PREFILL_BLOCK_BYTES).map(|i| i * PREFILL_BLOCK_BYTES);
    writer
        .run(
            file,
            PREFILL_BLOCK_BYTES as usize,
            PREFILL_DEPTH,
            &mut || offsets.next(),
            &mut |_| {},
        )
        .map_err(io_err(path, "O_DIRECT write"))?;
    file.sync_all().map_err(io_err(path, "fsync"))
}

/// Every write cell: both modes, each block size at each depth. Leaves the
/// file at the region's length.
fn measure_write_grid(
    writer: &mut Writer,
    scratch: &Scratch,
    region: u64,
    cell_time: Duration,
    say: &dyn Fn(&str),
) -> Result<Vec<WriteCell>, TuneError> {
    let (file, path) = (&scratch.file, scratch.path.as_path());
    let mut writes = Vec::new();
    for mode in [WriteMode::Overwrite, WriteMode::Extend] {
        for block_bytes in BLOCK_SIZES_BYTES {
            for depth in DEPTHS {
                if mode == WriteMode::Extend {
                    file.set_len(region).map_err(io_err(path, "truncate"))?;
                }
                let cell =
                    measure_writes(writer, file, mode, block_bytes, depth, region, cell_time)
                        .map_err(io_err(path, "O_DIRECT write"))?;
                say(&cell_line(&cell));
                writes.push(cell);
            }
        }
    }
    file.set_len(region).map_err(io_err(path, "truncate"))?;
    Ok(writes)
}

/// Calibrates the device under `data_dir` (created if missing) and returns
/// the profile; does not save it (see [`Profile::save`]).
pub fn run(data_dir: &Path, opts: &TuneOptions) -> Result<Profile, TuneError> {
    let region = opts.region_bytes.max(REGION_BYTES_MIN) / BLOCK_BYTES_MAX * BLOCK_BYTES_MAX;
    check_space(data_dir, region)?;
    let host = host_of(data_dir);
    let say = |line: &str| {
        if opts.progress {
            println!("{line}");
        }
    };
    say(&host_line(&host));

    let path = data_dir.join(format!(".rotary-tune-{}.scratch", std::process::id()));
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .map_err(io_err(&path, "create with O_DIRECT (see `rotary doctor`)"))?;
    let scratch = Scratch { file, path };
    let path = scratch.path.as_path();
    let file = &scratch.file;

    let mut writer = Writer::new(AlignedBuf::new(BLOCK_BYTES_MAX as usize), DEPTH_MAX)
        .map_err(io_err(path, "io_uring setup (see `rotary doctor`)"))?;
    fill_pattern(writer.buf_mut());

    say(&format!(
        "scratch file {}: {} preallocated and written once",
        path.display(),
        bytes_text(region)
    ));
    prefill(&mut writer, file, path, region)?;
    say(WRITES_HEADER);
    let writes = measure_write_grid(&mut writer, &scratch, region, opts.cell_time, &say)?;

    let block = &mut writer.buf_mut()[..SMALL_IO_BYTES as usize];
    let fdatasync_4k = measure_fdatasync(file, block, region, opts.latency_time)
        .map_err(io_err(path, "write and fdatasync"))?;
    say(&latency_line(FDATASYNC_TEXT, &fdatasync_4k, "calls"));
    let read_4k = measure_reads(file, block, region, opts.latency_time)
        .map_err(io_err(path, "O_DIRECT read"))?;
    say(&latency_line(READ_TEXT, &read_4k, "reads"));
    drop(writer);
    drop(scratch);

    let recommended = recommend(&writes);
    say(&recommendation_lines(&writes, &recommended));
    Ok(Profile {
        version: PROFILE_VERSION,
        measured_unix_s: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        host,
        settings: Settings {
            cell_ms: u64::try_from(opts.cell_time.as_millis()).unwrap_or(u64::MAX),
            latency_ms: u64::try_from(opts.latency_time.as_millis()).unwrap_or(u64::MAX),
            region_bytes: region,
        },
        writes,
        fdatasync_4k,
        read_4k,
        recommended,
    })
}

/// One cell: sequential writes for `cell_time`. Overwrites cycle through
/// `[0, region)`; extends start at `region` (the file's end) and stop early
/// after [`EXTEND_REGIONS`] regions' worth of bytes.
fn measure_writes(
    writer: &mut Writer,
    file: &fs::File,
    mode: WriteMode,
    block_bytes: u64,
    depth: u32,
    region: u64,
    cell_time: Duration,
) -> io::Result<WriteCell> {
    let blocks = region / block_bytes;
    assert!(
        blocks >= u64::from(depth),
        "two writes in flight at one offset"
    );
    let start = Instant::now();
    let deadline = start + cell_time;
    let mut issued = 0u64;
    let mut next = || {
        if Instant::now() >= deadline {
            return None;
        }
        let offset = match mode {
            WriteMode::Overwrite => (issued % blocks) * block_bytes,
            WriteMode::Extend if issued >= blocks * EXTEND_REGIONS => return None,
            WriteMode::Extend => region + issued * block_bytes,
        };
        issued += 1;
        Some(offset)
    };
    let mut samples_ns = Vec::new();
    let mut last = start;
    writer.run(file, block_bytes as usize, depth, &mut next, &mut |c| {
        samples_ns.push(nanos(c.completed - c.submitted));
        last = last.max(c.completed);
    })?;
    let ios = samples_ns.len() as u64;
    if ios == 0 {
        return Err(io::Error::other("no write completed"));
    }
    let elapsed_ns = nanos(last - start).max(1);
    let bytes_per_s = u128::from(ios * block_bytes) * 1_000_000_000 / u128::from(elapsed_ns);
    let latency = latency_of(samples_ns);
    Ok(WriteCell {
        mode,
        block_bytes,
        depth,
        ios,
        bytes_per_s: u64::try_from(bytes_per_s).unwrap_or(u64::MAX),
        p50_ns: latency.p50_ns,
        p99_ns: latency.p99_ns,
    })
}

/// fdatasync latency: one 4 KiB O_DIRECT overwrite, then a timed fdatasync,
/// walking the region block by block, for `time`.
fn measure_fdatasync(
    file: &fs::File,
    block: &[u8],
    region: u64,
    time: Duration,
) -> io::Result<Latency> {
    let deadline = Instant::now() + time;
    let mut samples_ns = Vec::new();
    let mut offset = 0;
    while samples_ns.is_empty() || Instant::now() < deadline {
        file.write_all_at(block, offset)?;
        let t = Instant::now();
        file.sync_data()?;
        samples_ns.push(nanos(t.elapsed()));
        offset = (offset + SMALL_IO_BYTES) % region;
    }
    Ok(latency_of(samples_ns))
}

/// 4 KiB O_DIRECT reads, one at a time, at random aligned offsets of the
/// region, for `time`.
fn measure_reads(
    file: &fs::File,
    block: &mut [u8],
    region: u64,
    time: Duration,
) -> io::Result<Latency> {
    let deadline = Instant::now() + time;
    let mut samples_ns = Vec::new();
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    while samples_ns.is_empty() || Instant::now() < deadline {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let offset = (x % (region / SMALL_IO_BYTES)) * SMALL_IO_BYTES;
        let t = Instant::now();
        file.read_exact_at(block, offset)?;
        samples_ns.push(nanos(t.elapsed()));
    }
    Ok(latency_of(samples_ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(mode: WriteMode, block_bytes: u64, depth: u32, mib_per_s: u64) -> WriteCell {
        WriteCell {
            mode,
            block_bytes,
            depth,
            ios: 100,
            bytes_per_s: mib_per_s * MIB,
            p50_ns: 1_000,
            p99_ns: 2_000,
        }
    }

    /// A device that saturates at depth 4 with large blocks: 2000 MiB/s
    /// overwriting, 500 MiB/s extending.
    fn synthetic() -> Vec<WriteCell> {
        let mut cells = Vec::new();
        // MiB/s by block size (rows) and depth 1, 4, 32 (columns).
        let overwrite = [
            [200, 700, 1500],
            [500, 1500, 1900],
            [1200, 1950, 2000],
            [1700, 2000, 2000],
            [1750, 1990, 1995],
        ];
        for (i, &block) in BLOCK_SIZES_BYTES.iter().enumerate() {
            for (j, &depth) in DEPTHS.iter().enumerate() {
                cells.push(cell(WriteMode::Overwrite, block, depth, overwrite[i][j]));
            }
        }
        for &block in &BLOCK_SIZES_BYTES {
            for &depth in &DEPTHS {
                cells.push(cell(WriteMode::Extend, block, depth, 500));
            }
        }
        cells
    }

    #[test]
    fn recommendations_from_a_synthetic_device() {
        let writes = synthetic();
        // Depth 1: best 1750; 90 % is 1575; 1 MiB (1700) is the smallest.
        assert_eq!(write_batch_bytes(&writes), MIB);
        // Best 2000; 90 % is 1800; depth 1 stays at 1750, depth 4 reaches
        // 2000.
        assert_eq!(saturation_depth(&writes), 4);
        let r = recommend(&writes);
        assert_eq!(
            r,
            Recommendations {
                write_batch_bytes: MIB,
                // 2 × 4 = 8, raised to the floor.
                ring_entries: 64,
                // 50 ms at 2000 MiB/s = 100 MiB.
                spool_grow_bytes: 100 * MIB,
                extend_penalty: 4.0,
            }
        );
    }

    #[test]
    fn write_batch_is_clamped_to_256_kib_and_exact_at_the_threshold() {
        // Every block size equally fast: the smallest, 16 KiB, raised to
        // the floor.
        let flat: Vec<WriteCell> = BLOCK_SIZES_BYTES
            .iter()
            .map(|&b| cell(WriteMode::Overwrite, b, 1, 1000))
            .collect();
        assert_eq!(write_batch_bytes(&flat), 256 * KIB);
        // Exactly 90 % counts; just below does not.
        let edge = [
            cell(WriteMode::Overwrite, 256 * KIB, 1, 899),
            cell(WriteMode::Overwrite, MIB, 1, 900),
            cell(WriteMode::Overwrite, 4 * MIB, 1, 1000),
        ];
        assert_eq!(write_batch_bytes(&edge), MIB);
        // Depth-4 cells and extends do not count for the batch.
        let mut mixed = edge.to_vec();
        mixed.push(cell(WriteMode::Overwrite, 16 * KIB, 4, 5000));
        mixed.push(cell(WriteMode::Extend, 16 * KIB, 1, 5000));
        assert_eq!(write_batch_bytes(&mixed), MIB);
        // Nothing measured: the floor.
        assert_eq!(write_batch_bytes(&[]), WRITE_BATCH_BYTES_MIN);
    }

    #[test]
    fn ring_entries_cover_twice_the_saturating_depth() {
        assert_eq!(ring_entries(1), 64);
        assert_eq!(ring_entries(32), 64);
        assert_eq!(ring_entries(33), 128);
        assert_eq!(ring_entries(100), 256);
        assert_eq!(ring_entries(2048), 4096);
        assert_eq!(ring_entries(3000), 4096);
        assert_eq!(ring_entries(u32::MAX), 4096);
        // A device that only saturates at depth 32, or at 256.
        let deep = [
            cell(WriteMode::Overwrite, MIB, 1, 100),
            cell(WriteMode::Overwrite, MIB, 4, 400),
            cell(WriteMode::Overwrite, MIB, 32, 3000),
            cell(WriteMode::Overwrite, MIB, 256, 3100),
        ];
        assert_eq!(saturation_depth(&deep[..3]), 32);
        assert_eq!(saturation_depth(&deep), 32);
        let deeper = [deep[0].clone(), cell(WriteMode::Overwrite, MIB, 256, 9000)];
        assert_eq!(saturation_depth(&deeper), 256);
        assert_eq!(ring_entries(saturation_depth(&deeper)), 512);
        assert_eq!(saturation_depth(&[]), 1);
    }

    #[test]
    fn spool_grow_covers_50_ms_rounded_up_and_clamped() {
        assert_eq!(spool_grow_bytes(0), 16 * MIB);
        // 50 ms at 100 MiB/s is 5 MiB: the floor.
        assert_eq!(spool_grow_bytes(100 * MIB), 16 * MIB);
        // 50 ms at 1000 MiB/s is 50 MiB exactly.
        assert_eq!(spool_grow_bytes(1000 * MIB), 50 * MIB);
        // One byte per second more rounds up to the next MiB.
        assert_eq!(spool_grow_bytes(1000 * MIB + 20), 51 * MIB);
        // 3 GB/s: 150 000 000 bytes ≈ 143.05 MiB → 144 MiB.
        assert_eq!(spool_grow_bytes(3_000_000_000), 144 * MIB);
        // 50 ms at 40 GiB/s is 2 GiB: the ceiling.
        assert_eq!(spool_grow_bytes(40 * GIB), GIB);
        assert_eq!(spool_grow_bytes(u64::MAX), GIB);
    }

    #[test]
    fn extend_penalty_is_a_ratio_of_bests() {
        let writes = [
            cell(WriteMode::Overwrite, MIB, 1, 300),
            cell(WriteMode::Overwrite, MIB, 4, 1000),
            cell(WriteMode::Extend, MIB, 1, 200),
            cell(WriteMode::Extend, MIB, 4, 300),
        ];
        assert_eq!(extend_penalty(&writes), 3.33);
        assert_eq!(extend_penalty(&writes[..2]), 0.0);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 500), 50);
        assert_eq!(percentile(&v, 990), 99);
        assert_eq!(percentile(&v, 1000), 100);
        assert_eq!(percentile(&[7], 990), 7);
        let l = latency_of(vec![5, 1, 3]);
        assert_eq!((l.samples, l.p50_ns, l.p99_ns, l.max_ns), (3, 3, 5, 5));
    }

    fn synthetic_profile() -> Profile {
        let writes = synthetic();
        Profile {
            version: PROFILE_VERSION,
            measured_unix_s: 1_700_000_000,
            host: Host {
                kernel: "6.1.0-18-amd64".into(),
                filesystem: "xfs".into(),
                device: "259:1".into(),
                block_device: Some("nvme0n1".into()),
            },
            settings: Settings {
                cell_ms: 600,
                latency_ms: 1500,
                region_bytes: 256 * MIB,
            },
            fdatasync_4k: Latency {
                samples: 1000,
                p50_ns: 20_000,
                p99_ns: 90_000,
                max_ns: 1_200_000,
            },
            read_4k: Latency {
                samples: 9000,
                p50_ns: 80_000,
                p99_ns: 150_000,
                max_ns: 400_000,
            },
            recommended: recommend(&writes),
            writes,
        }
    }

    #[test]
    fn profile_round_trips_through_the_data_dir() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load(dir.path()).unwrap().is_none());
        let mut profile = synthetic_profile();
        profile.recommended.extend_penalty = 1.85;
        let path = profile.save(dir.path()).unwrap();
        assert_eq!(path, dir.path().join("tune-profile.json"));
        assert_eq!(load(dir.path()).unwrap(), Some(profile.clone()));
        // Saving again replaces it and leaves no temporary file.
        profile.measured_unix_s += 1;
        profile.save(dir.path()).unwrap();
        assert_eq!(load(dir.path()).unwrap(), Some(profile));
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["tune-profile.json"]);
    }

    #[test]
    fn profile_field_names_are_stable() {
        let json = serde_json::to_value(synthetic_profile()).unwrap();
        assert_eq!(json["version"], 1);
        assert_eq!(json["host"]["block_device"], "nvme0n1");
        assert_eq!(json["writes"][0]["mode"], "overwrite");
        assert_eq!(json["writes"][15]["mode"], "extend");
        assert_eq!(json["writes"][0]["block_bytes"], 16 * KIB);
        assert_eq!(json["fdatasync_4k"]["p99_ns"], 90_000);
        assert_eq!(json["recommended"]["write_batch_bytes"], MIB);
        assert_eq!(json["recommended"]["ring_entries"], 64);
        assert_eq!(json["recommended"]["spool_grow_bytes"], 100 * MIB);
        assert_eq!(json["recommended"]["extend_penalty"], 4.0);
    }

    #[test]
    fn bad_profiles_are_errors_not_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = profile_path(dir.path());

        fs::write(&path, b"{ not json").unwrap();
        let e = load(dir.path()).unwrap_err();
        assert!(matches!(e, TuneError::Malformed { .. }), "{e}");

        let mut json = serde_json::to_value(synthetic_profile()).unwrap();
        json["version"] = 2.into();
        fs::write(&path, json.to_string()).unwrap();
        let e = load(dir.path()).unwrap_err();
        assert!(
            matches!(
                e,
                TuneError::Version {
                    found: 2,
                    expected: 1,
                    ..
                }
            ),
            "{e}"
        );

        let mut json = serde_json::to_value(synthetic_profile()).unwrap();
        json["recommended"]
            .as_object_mut()
            .unwrap()
            .remove("ring_entries");
        fs::write(&path, json.to_string()).unwrap();
        let e = load(dir.path()).unwrap_err();
        assert!(e.to_string().contains("ring_entries"), "{e}");

        for (field, value) in [
            ("ring_entries", 100u64),
            ("ring_entries", 0),
            ("write_batch_bytes", 4096),
            ("spool_grow_bytes", 17 * MIB + 1),
        ] {
            let mut json = serde_json::to_value(synthetic_profile()).unwrap();
            json["recommended"][field] = value.into();
            fs::write(&path, json.to_string()).unwrap();
            let e = load(dir.path()).unwrap_err();
            assert!(
                matches!(e, TuneError::OutOfRange { field: f, value: v, .. } if f == field && v == value),
                "{field} = {value}: {e}"
            );
        }
    }

    #[test]
    fn report_has_units() {
        let text = synthetic_profile().to_string();
        println!("{text}");
        assert!(text.starts_with("device nvme0n1 (259:1), xfs, kernel 6.1.0-18-amd64\n"));
        assert!(text.contains("  overwrite  16 KiB qd  1:  200.0 MiB/s  p50    1.0 µs  p99    2.0 µs  (100 writes)\n"), "{text}");
        assert!(text.contains("fdatasync after a 4 KiB O_DIRECT write: p50 20.0 µs  p99 90.0 µs  max 1.20 ms  (1000 calls)\n"), "{text}");
        assert!(text.contains("  write_batch_bytes     1 MiB"), "{text}");
        assert!(
            text.contains("  ring_entries             64  2 × depth 4,"),
            "{text}"
        );
        assert!(
            text.contains("  spool_grow_bytes    100 MiB  50 ms at 2000.0 MiB/s"),
            "{text}"
        );
        assert!(
            text.contains(
                "  extend_penalty        4.00×  overwrite 2000.0 MiB/s / extend 500.0 MiB/s"
            ),
            "{text}"
        );
        assert_eq!(duration_text(999), "999 ns");
        assert_eq!(duration_text(1_500_000_000), "1.50 s");
    }

    #[test]
    fn quick_calibration_of_a_temp_dir() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let opts = TuneOptions {
            progress: true,
            ..TuneOptions::quick()
        };
        let profile = run(&data, &opts).unwrap();
        println!("{profile}");
        // The scratch file is gone; nothing else was written.
        assert_eq!(fs::read_dir(&data).unwrap().count(), 0);

        assert_eq!(profile.version, PROFILE_VERSION);
        assert!(profile.matches_device(&data));
        assert_eq!(profile.settings.region_bytes, REGION_BYTES_MIN);
        let cells: Vec<(WriteMode, u64, u32)> = profile
            .writes
            .iter()
            .map(|c| (c.mode, c.block_bytes, c.depth))
            .collect();
        let mut expected = Vec::new();
        for mode in [WriteMode::Overwrite, WriteMode::Extend] {
            for b in BLOCK_SIZES_BYTES {
                for d in DEPTHS {
                    expected.push((mode, b, d));
                }
            }
        }
        assert_eq!(cells, expected);
        for c in &profile.writes {
            assert!(c.ios > 0 && c.bytes_per_s > 0, "{c:?}");
            assert!(c.p50_ns > 0 && c.p50_ns <= c.p99_ns, "{c:?}");
        }
        for l in [&profile.fdatasync_4k, &profile.read_4k] {
            assert!(l.samples > 0 && l.p50_ns > 0, "{l:?}");
            assert!(l.p50_ns <= l.p99_ns && l.p99_ns <= l.max_ns, "{l:?}");
        }
        let r = &profile.recommended;
        assert!(
            BLOCK_SIZES_BYTES.contains(&r.write_batch_bytes)
                || r.write_batch_bytes == WRITE_BATCH_BYTES_MIN
        );
        assert!((WRITE_BATCH_BYTES_MIN..=WRITE_BATCH_BYTES_MAX).contains(&r.write_batch_bytes));
        assert!(r.ring_entries.is_power_of_two());
        assert!((RING_ENTRIES_MIN..=RING_ENTRIES_MAX).contains(&r.ring_entries));
        assert_eq!(r.spool_grow_bytes % MIB, 0);
        assert!((SPOOL_GROW_BYTES_MIN..=SPOOL_GROW_BYTES_MAX).contains(&r.spool_grow_bytes));
        assert!(r.extend_penalty > 0.0);
        assert_eq!(*r, recommend(&profile.writes));

        // What `rotary tune` writes, the broker reads back.
        profile.save(&data).unwrap();
        assert_eq!(load(&data).unwrap(), Some(profile));
    }
}
