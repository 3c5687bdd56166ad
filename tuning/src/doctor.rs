//! `rotary doctor`: checks that this host can run a broker well, and says how
//! to fix what it finds.
//!
//! Each check yields one [`Finding`]: `ok`, `warn` (the broker runs, but
//! slower or less predictably than it should) or `FAIL` (the broker cannot
//! run as configured). Every `warn` and `FAIL` carries the command that fixes
//! it. The checks only read host state, except that the data directory is
//! created if missing and a probe file is written in it and removed.
//! `tuning/README.md` explains each setting.

use crate::sys;
use rotary_storage::aligned::AlignedBuf;
use std::fmt::{self, Write as _};
use std::fs;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// How serious a finding is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

impl Level {
    /// The report's spelling: `ok`, `warn`, `FAIL` (loud on purpose).
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        }
    }
}

/// The outcome of one check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub level: Level,
    /// Short stable name of the check, e.g. `io_uring`.
    pub check: &'static str,
    /// What was found, in one line.
    pub finding: String,
    /// Commands that fix a `warn` or `FAIL`, one per line, most direct first.
    pub fixes: Vec<String>,
}

impl Finding {
    fn ok(check: &'static str, finding: impl Into<String>) -> Self {
        Finding {
            level: Level::Ok,
            check,
            finding: finding.into(),
            fixes: Vec::new(),
        }
    }

    fn warn(check: &'static str, finding: impl Into<String>, fixes: &[&str]) -> Self {
        Self::bad(Level::Warn, check, finding, fixes)
    }

    fn fail(check: &'static str, finding: impl Into<String>, fixes: &[&str]) -> Self {
        Self::bad(Level::Fail, check, finding, fixes)
    }

    fn bad(level: Level, check: &'static str, finding: impl Into<String>, fixes: &[&str]) -> Self {
        assert!(!fixes.is_empty(), "a {check} problem without a fix");
        Finding {
            level,
            check,
            finding: finding.into(),
            fixes: fixes.iter().map(|f| f.to_string()).collect(),
        }
    }
}

impl fmt::Display for Finding {
    /// `<level>  <check>: <finding>`, the level padded to four columns, then
    /// one indented `fix: <command>` line per fix.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<4}  {}: {}",
            self.level.as_str(),
            self.check,
            self.finding
        )?;
        for fix in &self.fixes {
            writeln!(f, "      fix: {fix}")?;
        }
        Ok(())
    }
}

/// The whole report, one finding after another.
pub fn format_report(findings: &[Finding]) -> String {
    let mut out = String::new();
    for finding in findings {
        write!(out, "{finding}").expect("writing to a String");
    }
    out
}

/// 0 when nothing failed, 1 otherwise.
pub fn exit_code(findings: &[Finding]) -> i32 {
    i32::from(findings.iter().any(|f| f.level == Level::Fail))
}

/// Runs every check for a broker whose data lives in `data_dir`, prints the
/// report to stdout and returns the process exit code.
pub fn run(data_dir: &Path) -> i32 {
    let findings = check_all(data_dir);
    print!("{}", format_report(&findings));
    exit_code(&findings)
}

/// Runs every check, in report order.
pub fn check_all(data_dir: &Path) -> Vec<Finding> {
    let (dir_finding, probe_dir) = check_data_dir(data_dir);
    vec![
        check_io_uring(),
        check_iowq_affinity(),
        check_memlock(),
        check_nofile(),
        check_cpus(),
        check_cpu_governor(),
        check_thp(),
        check_clocksource(),
        check_time_slices(),
        dir_finding,
        check_o_direct(&probe_dir),
        check_io_scheduler(&probe_dir),
        check_disk_irqs(&probe_dir),
        check_disk_space(&probe_dir),
    ]
}

// ---------------------------------------------------------------- io_uring

/// Opcodes the engine cannot run without.
const OPCODES_REQUIRED: &[(&str, u8)] = &[
    ("read", io_uring::opcode::Read::CODE),
    ("write", io_uring::opcode::Write::CODE),
    ("fsync", io_uring::opcode::Fsync::CODE),
    ("send", io_uring::opcode::Send::CODE),
    ("recv", io_uring::opcode::Recv::CODE),
];

/// Opcodes the runtime uses where the kernel has them.
const OPCODES_WANTED: &[(&str, u8)] = &[
    ("accept", io_uring::opcode::Accept::CODE),
    ("connect", io_uring::opcode::Connect::CODE),
    ("timeout", io_uring::opcode::Timeout::CODE),
    ("async_cancel", io_uring::opcode::AsyncCancel::CODE),
    ("fallocate", io_uring::opcode::Fallocate::CODE),
    ("openat", io_uring::opcode::OpenAt::CODE),
    ("close", io_uring::opcode::Close::CODE),
];

pub(crate) fn kernel_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// `(major, minor)` of a kernel release string such as `6.1.0-18-amd64`.
pub fn parse_kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

fn check_io_uring() -> Finding {
    const CHECK: &str = "io_uring";
    let release = kernel_release();
    let ring = match io_uring::IoUring::new(8) {
        Ok(ring) => ring,
        Err(e) => return io_uring_setup_failed(&release, &e),
    };
    let params = ring.params();
    let features = [
        ("nodrop", params.is_feature_nodrop()),
        ("submit_stable", params.is_feature_submit_stable()),
        ("fast_poll", params.is_feature_fast_poll()),
        ("ext_arg", params.is_feature_ext_arg()),
        ("native_workers", params.is_feature_native_workers()),
        ("defer_taskrun", defer_taskrun_accepted()),
    ];
    let have: Vec<&str> = features.iter().filter(|f| f.1).map(|f| f.0).collect();
    let lacking: Vec<&str> = features.iter().filter(|f| !f.1).map(|f| f.0).collect();

    let mut probe = io_uring::Probe::new();
    if let Err(e) = ring.submitter().register_probe(&mut probe) {
        return Finding::fail(
            CHECK,
            format!("kernel {release}: ring created but the opcode probe failed ({e}); io_uring before Linux 5.6 is too old"),
            &["upgrade the kernel to Linux 6.1 or later (e.g. apt install linux-image-amd64 && reboot)"],
        );
    }
    let missing = |ops: &[(&'static str, u8)]| -> Vec<&'static str> {
        ops.iter()
            .filter(|(_, code)| !probe.is_supported(*code))
            .map(|(name, _)| *name)
            .collect()
    };
    let missing_required = missing(OPCODES_REQUIRED);
    let missing_wanted = missing(OPCODES_WANTED);
    if !missing_required.is_empty() {
        return Finding::fail(
            CHECK,
            format!("kernel {release} lacks io_uring opcodes {}", missing_required.join(", ")),
            &["upgrade the kernel to Linux 6.1 or later (e.g. apt install linux-image-amd64 && reboot)"],
        );
    }
    let summary = format!(
        "kernel {release}; opcodes read, write, fsync, send, recv supported; features {}",
        have.join(", ")
    );
    if !missing_wanted.is_empty() || !lacking.is_empty() {
        let mut gaps = Vec::new();
        if !missing_wanted.is_empty() {
            gaps.push(format!("opcodes {} missing", missing_wanted.join(", ")));
        }
        if !lacking.is_empty() {
            gaps.push(format!("features {} missing", lacking.join(", ")));
        }
        return Finding::warn(
            CHECK,
            format!("{summary}; {} (slower fallbacks are used)", gaps.join("; ")),
            &["upgrade the kernel to Linux 6.1 or later (e.g. apt install linux-image-amd64 && reboot)"],
        );
    }
    Finding::ok(CHECK, summary)
}

/// Whether the kernel builds a ring as a shard asks for it: one submitting
/// thread, task work deferred to its waits (Linux 6.1).
pub fn defer_taskrun_accepted() -> bool {
    io_uring::IoUring::<io_uring::squeue::Entry>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_coop_taskrun()
        .setup_taskrun_flag()
        .build(8)
        .is_ok()
}

fn io_uring_setup_failed(release: &str, e: &io::Error) -> Finding {
    const CHECK: &str = "io_uring";
    let disabled = fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok());
    match (e.raw_os_error(), disabled) {
        (Some(libc::EPERM), Some(d)) if d > 0 => Finding::fail(
            CHECK,
            format!("io_uring_setup: {e}; kernel.io_uring_disabled = {d}"),
            &[
                "sudo sysctl -w kernel.io_uring_disabled=0",
                "echo kernel.io_uring_disabled=0 | sudo tee /etc/sysctl.d/90-rotary.conf   # persist",
            ],
        ),
        (Some(libc::EPERM), _) => Finding::fail(
            CHECK,
            format!("io_uring_setup: {e}; a seccomp filter (container runtime) forbids io_uring"),
            &["docker run --security-opt seccomp=unconfined …   # or a profile allowing io_uring_setup, io_uring_enter, io_uring_register"],
        ),
        (Some(libc::ENOSYS), _) => Finding::fail(
            CHECK,
            format!("io_uring_setup: {e}; kernel {release} has no io_uring"),
            &["upgrade the kernel to Linux 6.1 or later built with CONFIG_IO_URING=y (e.g. apt install linux-image-amd64 && reboot)"],
        ),
        (Some(libc::ENOMEM), _) => Finding::fail(
            CHECK,
            format!("io_uring_setup: {e}; the locked-memory limit is too small for a ring"),
            &["ulimit -l unlimited   # in the shell that starts rotary; see the memlock check"],
        ),
        _ => Finding::fail(
            CHECK,
            format!("io_uring_setup: {e} (kernel {release})"),
            &["upgrade the kernel to Linux 6.1 or later and check dmesg for io_uring errors: sudo dmesg | grep -i uring"],
        ),
    }
}

fn check_iowq_affinity() -> Finding {
    const CHECK: &str = "iowq_affinity";
    let ring = match io_uring::IoUring::new(8) {
        Ok(ring) => ring,
        Err(e) => {
            return Finding::fail(
                CHECK,
                format!("untestable: no io_uring ({e})"),
                &["fix the io_uring check first"],
            )
        }
    };
    let cpus = match sys::allowed_cpus() {
        Ok(cpus) if !cpus.is_empty() => cpus,
        Ok(_) => vec![0],
        Err(e) => {
            return Finding::warn(
                CHECK,
                format!("untestable: sched_getaffinity: {e}"),
                &["run rotary doctor outside restrictive sandboxes (seccomp) to test"],
            )
        }
    };
    // Registering the CPUs we may already run on changes nothing for anyone.
    match ring.submitter().register_iowq_aff(&sys::cpu_set(&cpus)) {
        Ok(()) => Finding::ok(
            CHECK,
            "IORING_REGISTER_IOWQ_AFF works: io-wq workers (fdatasync, buffered I/O) are kept off shard cores",
        ),
        Err(e) => Finding::warn(
            CHECK,
            format!(
                "IORING_REGISTER_IOWQ_AFF failed ({e}; needs Linux 5.14): io-wq workers inherit the shard's pinning and compete with it"
            ),
            &["upgrade the kernel to Linux 5.14 or later (6.1 LTS recommended)"],
        ),
    }
}

// ---------------------------------------------------------------- limits

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Locked memory below which registered buffers and (before Linux 5.12) the
/// rings themselves run short.
pub const MEMLOCK_BYTES_MIN: u64 = 64 * MIB;
/// File descriptors a broker wants: sockets + spool files on every shard.
pub const NOFILE_MIN: u64 = 65_536;
/// Below this a broker cannot hold a modest number of connections and spools.
pub const NOFILE_FAIL_BELOW: u64 = 4_096;

fn limit_text(v: Option<u64>, unit_bytes: bool) -> String {
    match v {
        None => "unlimited".into(),
        Some(v) if unit_bytes => bytes_text(v),
        Some(v) => v.to_string(),
    }
}

/// Bytes in the largest binary unit that keeps the number ≥ 1.
pub fn bytes_text(v: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", GIB),
        ("MiB", MIB),
        ("KiB", 1 << 10),
    ];
    for (unit, size) in UNITS {
        if v >= size {
            let whole = v / size;
            let tenth = (v % size) * 10 / size;
            return if tenth == 0 {
                format!("{whole} {unit}")
            } else {
                format!("{whole}.{tenth} {unit}")
            };
        }
    }
    format!("{v} B")
}

fn check_memlock() -> Finding {
    const CHECK: &str = "memlock";
    let limit = match sys::memlock_limit() {
        Ok(l) => l,
        Err(e) => return Finding::warn(CHECK, format!("getrlimit: {e}"), &["ulimit -l unlimited"]),
    };
    let text = format!(
        "RLIMIT_MEMLOCK soft {} / hard {}",
        limit_text(limit.soft, true),
        limit_text(limit.hard, true)
    );
    // Before Linux 5.12 every ring's memory is charged to RLIMIT_MEMLOCK, so
    // a small limit stops shards from starting at all.
    let rings_charged = parse_kernel_version(&kernel_release()).is_some_and(|v| v < (5, 12));
    let level = if rings_charged {
        Level::Fail
    } else {
        Level::Warn
    };
    // `rotary serve` raises its soft limit to the hard one, so the hard
    // limit is what a broker started from here gets.
    let text = format!("{text} (serve raises soft to hard)");
    match limit.hard {
        None => Finding::ok(CHECK, text),
        Some(v) if v >= MEMLOCK_BYTES_MIN => Finding::ok(CHECK, text),
        Some(_) => Finding::bad(
            level,
            CHECK,
            format!(
                "{text}: below {}; registered I/O buffers (and rings, before Linux 5.12) need locked memory",
                bytes_text(MEMLOCK_BYTES_MIN)
            ),
            &[
                "ulimit -l unlimited   # in the shell that starts rotary (needs a hard limit that allows it)",
                "printf '* - memlock unlimited\\n' | sudo tee /etc/security/limits.d/90-rotary.conf   # persist, next login",
                "sudo systemctl edit rotary   # under systemd: [Service] LimitMEMLOCK=infinity",
            ],
        ),
    }
}

fn check_nofile() -> Finding {
    const CHECK: &str = "nofile";
    let limit = match sys::nofile_limit() {
        Ok(l) => l,
        Err(e) => return Finding::warn(CHECK, format!("getrlimit: {e}"), &["ulimit -n 1048576"]),
    };
    let text = format!(
        "RLIMIT_NOFILE soft {} / hard {}",
        limit_text(limit.soft, false),
        limit_text(limit.hard, false)
    );
    let fixes = [
        "ulimit -n 1048576   # in the shell that starts rotary (needs a hard limit that allows it)",
        "printf '* - nofile 1048576\\n' | sudo tee /etc/security/limits.d/91-rotary-nofile.conf   # persist, next login",
        "sudo systemctl edit rotary   # under systemd: [Service] LimitNOFILE=1048576",
    ];
    // `rotary serve` raises its soft limit to the hard one, so the hard
    // limit is what a broker started from here gets.
    let text = format!("{text} (serve raises soft to hard)");
    match limit.hard {
        None => Finding::ok(CHECK, text),
        Some(v) if v >= NOFILE_MIN => Finding::ok(CHECK, text),
        Some(v) if v < NOFILE_FAIL_BELOW => Finding::fail(
            CHECK,
            format!("{text}: below {NOFILE_FAIL_BELOW}; connections and spool files will run out"),
            &fixes,
        ),
        Some(_) => Finding::warn(
            CHECK,
            format!("{text}: below {NOFILE_MIN}; each shard holds a socket per connection and a file per spool"),
            &fixes,
        ),
    }
}

// ---------------------------------------------------------------- CPUs

/// Parses a kernel CPU list such as `0-3,8,10-11` (empty means none).
pub fn parse_cpu_list(text: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if a > b {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

fn read_cpu_list(path: &str) -> Option<Vec<usize>> {
    parse_cpu_list(&fs::read_to_string(path).ok()?)
}

/// Formats CPUs as a kernel CPU list (`0-3,8`).
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        if !out.is_empty() {
            out.push(',');
        }
        if i == j {
            write!(out, "{}", cpus[i]).expect("writing to a String");
        } else {
            write!(out, "{}-{}", cpus[i], cpus[j]).expect("writing to a String");
        }
        i = j + 1;
    }
    if out.is_empty() {
        out.push_str("none");
    }
    out
}

fn check_cpus() -> Finding {
    const CHECK: &str = "cpus";
    let online = read_cpu_list("/sys/devices/system/cpu/online").unwrap_or_default();
    let allowed =
        match sys::allowed_cpus() {
            Ok(cpus) => cpus,
            Err(e) => return Finding::fail(
                CHECK,
                format!("sched_getaffinity: {e}"),
                &["run rotary outside sandboxes that forbid sched_getaffinity/sched_setaffinity"],
            ),
        };
    // Pin a scratch thread to each allowed CPU in turn; this thread's own
    // affinity is never touched.
    let to_try = allowed.clone();
    let refused = std::thread::spawn(move || {
        to_try
            .iter()
            .filter_map(|&cpu| sys::set_thread_affinity(&[cpu]).err().map(|e| (cpu, e)))
            .collect::<Vec<_>>()
    })
    .join()
    .unwrap_or_else(|_| vec![(usize::MAX, io::Error::other("pinning thread panicked"))]);
    let isolated = read_cpu_list("/sys/devices/system/cpu/isolated").unwrap_or_default();
    let nohz = read_cpu_list("/sys/devices/system/cpu/nohz_full").unwrap_or_default();

    let text = format!(
        "{} online ({}), {} allowed to rotary ({}), isolated {}, nohz_full {}",
        online.len(),
        format_cpu_list(&online),
        allowed.len(),
        format_cpu_list(&allowed),
        format_cpu_list(&isolated),
        format_cpu_list(&nohz),
    );
    if let Some((cpu, e)) = refused.first() {
        return Finding::fail(
            CHECK,
            format!("{text}; pinning to CPU {cpu} failed: {e}"),
            &["allow sched_setaffinity (container: docker run --cap-add SYS_NICE … or an unconfined seccomp profile)"],
        );
    }
    let text = format!("{text}; a thread pinned to each allowed CPU");
    if !online.is_empty() && allowed.len() < online.len() {
        return Finding::warn(
            CHECK,
            format!("{text}; {} online CPUs are outside this process's affinity, so fewer shards can run", online.len() - allowed.len()),
            &[&format!(
                "taskset -c {} rotary serve …   # or widen the container/cgroup cpuset (docker run --cpuset-cpus={})",
                format_cpu_list(&online),
                format_cpu_list(&online)
            )],
        );
    }
    Finding::ok(CHECK, text)
}

fn check_cpu_governor() -> Finding {
    const CHECK: &str = "cpu_governor";
    let Ok(governor) = fs::read_to_string("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
    else {
        return Finding::ok(
            CHECK,
            "no cpufreq control (virtual machine or fixed frequency)",
        );
    };
    let governor = governor.trim();
    if governor == "performance" {
        Finding::ok(CHECK, "performance")
    } else {
        Finding::warn(
            CHECK,
            format!("{governor}: cores clock down between bursts, adding wake-up latency to appends"),
            &["sudo cpupower frequency-set -g performance   # or: echo performance | sudo tee /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor"],
        )
    }
}

// ---------------------------------------------------------------- sysfs knobs

/// The selected word of a sysfs choice such as `always [madvise] never`.
pub fn parse_bracketed_choice(text: &str) -> Option<&str> {
    let start = text.find('[')?;
    let end = start + text[start..].find(']')?;
    let choice = text[start + 1..end].trim();
    (!choice.is_empty()).then_some(choice)
}

/// Judges a transparent-huge-page mode.
pub fn judge_thp(mode: &str) -> Level {
    match mode {
        "madvise" | "never" => Level::Ok,
        _ => Level::Warn,
    }
}

fn check_thp() -> Finding {
    const CHECK: &str = "thp";
    const PATH: &str = "/sys/kernel/mm/transparent_hugepage/enabled";
    let Ok(text) = fs::read_to_string(PATH) else {
        return Finding::ok(
            CHECK,
            "transparent huge pages not configured in this kernel",
        );
    };
    let Some(mode) = parse_bracketed_choice(&text) else {
        return Finding::warn(
            CHECK,
            format!("cannot parse {PATH}: {:?}", text.trim()),
            &["echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled"],
        );
    };
    match judge_thp(mode) {
        Level::Ok => Finding::ok(CHECK, format!("enabled = {mode}")),
        _ => Finding::warn(
            CHECK,
            format!("enabled = {mode}: khugepaged compaction stalls shard threads unpredictably"),
            &[
                "echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled",
                "add transparent_hugepage=madvise to the kernel command line (GRUB_CMDLINE_LINUX in /etc/default/grub; sudo update-grub)   # persist",
            ],
        ),
    }
}

/// Judges a clock source: TSC-class sources are read in user space (vDSO);
/// the others cost a system call per timestamp.
pub fn judge_clocksource(source: &str) -> Level {
    match source.trim() {
        "tsc" | "kvm-clock" | "arch_sys_counter" | "hyperv_clocksource_tsc_page" => Level::Ok,
        _ => Level::Warn,
    }
}

fn check_clocksource() -> Finding {
    const CHECK: &str = "clocksource";
    const DIR: &str = "/sys/devices/system/clocksource/clocksource0";
    let Ok(current) = fs::read_to_string(format!("{DIR}/current_clocksource")) else {
        return Finding::warn(
            CHECK,
            format!("cannot read {DIR}/current_clocksource"),
            &["mount -t sysfs sysfs /sys"],
        );
    };
    let current = current.trim();
    let available = fs::read_to_string(format!("{DIR}/available_clocksource")).unwrap_or_default();
    match judge_clocksource(current) {
        Level::Ok => Finding::ok(CHECK, format!("{current} (available: {})", available.trim())),
        _ if available.split_whitespace().any(|s| s == "tsc") => Finding::warn(
            CHECK,
            format!("{current}: every timestamp is a system call; tsc is available"),
            &[
                "echo tsc | sudo tee /sys/devices/system/clocksource/clocksource0/current_clocksource",
                "add clocksource=tsc tsc=reliable to the kernel command line   # persist",
            ],
        ),
        _ => Finding::warn(
            CHECK,
            format!("{current}: every timestamp may be a system call; available: {}", available.trim()),
            &["check dmesg for why the TSC was marked unstable: sudo dmesg | grep -i -e tsc -e clocksource"],
        ),
    }
}

/// Judges a kernel for per-thread time slices: EEVDF takes a normal
/// thread's `sched_runtime` as its slice from Linux 6.12; earlier kernels
/// accept it and ignore it.
pub fn judge_time_slices(release: &str) -> Level {
    match parse_kernel_version(release) {
        Some(v) if v >= (6, 12) => Level::Ok,
        _ => Level::Warn,
    }
}

fn check_time_slices() -> Finding {
    const CHECK: &str = "time_slices";
    let release = kernel_release();
    match judge_time_slices(&release) {
        Level::Ok => Finding::ok(
            CHECK,
            format!("kernel {release}: shards' short slices (--shard-slice) let them preempt what runs on their cores when they wake"),
        ),
        _ => Finding::warn(
            CHECK,
            format!("kernel {release}: before Linux 6.12 --shard-slice has no effect; a shard that wakes on a busy core may wait out the running thread's slice"),
            &[
                "upgrade the kernel to Linux 6.12 or later",
                "or keep other work off the shards' cores (serve --cpus)",
            ],
        ),
    }
}

// ---------------------------------------------------------------- data dir

/// Makes sure `data_dir` exists; returns the finding and the directory the
/// filesystem probes should use (the data dir, or its nearest existing
/// ancestor when it cannot be created).
fn check_data_dir(data_dir: &Path) -> (Finding, PathBuf) {
    const CHECK: &str = "data_dir";
    let existed = data_dir.is_dir();
    match fs::create_dir_all(data_dir) {
        Ok(()) => {
            let how = if existed { "exists" } else { "created" };
            (
                Finding::ok(CHECK, format!("{} ({how})", data_dir.display())),
                data_dir.to_path_buf(),
            )
        }
        Err(e) => {
            let parent = nearest_existing_ancestor(data_dir);
            let fix = format!(
                "sudo mkdir -p {dir} && sudo chown \"$(id -u):$(id -g)\" {dir}",
                dir = shell_quote(&data_dir.display().to_string())
            );
            (
                Finding::fail(
                    CHECK,
                    format!(
                        "cannot create {}: {e}; probing {} instead",
                        data_dir.display(),
                        parent.display()
                    ),
                    &[&fix],
                ),
                parent,
            )
        }
    }
}

/// The closest ancestor of `path` that is an existing directory (at worst
/// `/` or `.`).
pub fn nearest_existing_ancestor(path: &Path) -> PathBuf {
    let mut p = path;
    loop {
        if p.is_dir() {
            return p.to_path_buf();
        }
        match p.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => p = parent,
            _ => {
                return if path.is_absolute() {
                    "/".into()
                } else {
                    ".".into()
                }
            }
        }
    }
}

fn shell_quote(s: &str) -> String {
    if s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-+=%@:".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Filesystem name for a statfs magic number.
pub fn fs_name(magic: u64) -> Option<&'static str> {
    Some(match magic {
        0xEF53 => "ext2/3/4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x0102_1994 => "tmpfs",
        0x794C_7630 => "overlayfs",
        0x6969 => "nfs",
        0x2FC1_2FC1 => "zfs",
        0xF2F5_2010 => "f2fs",
        0x6573_5546 => "fuse",
        0x0000_4d44 => "vfat",
        0x5346_544E => "ntfs",
        0x0102_1997 => "9p",
        0x00C3_6400 => "ceph",
        0xFF53_4D42 => "cifs",
        0x7366_7378 => "squashfs",
        0x8584_58F6 => "ramfs",
        _ => return None,
    })
}

fn fs_text(dir: &Path) -> String {
    match sys::statfs(dir) {
        Ok(st) => match fs_name(st.magic) {
            Some(name) => name.to_string(),
            None => format!("filesystem magic {:#x}", st.magic),
        },
        Err(e) => format!("statfs failed: {e}"),
    }
}

/// Block size of O_DIRECT probe I/O: the largest logical block size in use.
pub const PROBE_BLOCK_LEN: usize = rotary_storage::aligned::BLOCK;

/// Writes one aligned 4 KiB block with O_DIRECT into a fresh file in `dir`,
/// reads it back the same way, compares, and removes the file.
pub fn probe_o_direct(dir: &Path) -> io::Result<()> {
    let path = dir.join(format!(".rotary-doctor-{}.probe", std::process::id()));
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path);
    let file = match file {
        Ok(f) => f,
        Err(e) => return Err(io::Error::new(e.kind(), format!("open with O_DIRECT: {e}"))),
    };
    let result = (|| {
        let mut out = AlignedBuf::new(PROBE_BLOCK_LEN);
        for (i, b) in out.full_mut().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        file.write_all_at(out.full_mut(), 0)
            .map_err(|e| io::Error::new(e.kind(), format!("4 KiB O_DIRECT write: {e}")))?;
        let mut back = AlignedBuf::new(PROBE_BLOCK_LEN);
        file.read_exact_at(back.full_mut(), 0)
            .map_err(|e| io::Error::new(e.kind(), format!("4 KiB O_DIRECT read: {e}")))?;
        if back.full_mut() != out.full_mut() {
            return Err(io::Error::other(
                "O_DIRECT read returned other bytes than were written",
            ));
        }
        Ok(())
    })();
    drop(file);
    let removed = fs::remove_file(&path);
    result?;
    removed
}

fn check_o_direct(dir: &Path) -> Finding {
    const CHECK: &str = "o_direct";
    let fs_type = fs_text(dir);
    match probe_o_direct(dir) {
        Ok(()) => Finding::ok(CHECK, format!("{} on {fs_type}: 4 KiB aligned write and read-back match", dir.display())),
        Err(e) => Finding::fail(
            CHECK,
            format!("{} on {fs_type}: {e}; spools need O_DIRECT", dir.display()),
            &["put the data dir on an ext4 or xfs filesystem on a local NVMe device: sudo mkfs.xfs /dev/nvmeXnY && sudo mount /dev/nvmeXnY <data dir>"],
        ),
    }
}

/// `(major, minor)` of a Linux `dev_t` (glibc's encoding).
pub fn dev_major_minor(dev: u64) -> (u64, u64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major, minor)
}

/// The whole block device (not the partition) that holds `dir`: its name
/// and its sysfs directory. `Err` is a finding to report as it is.
fn block_device(check: &'static str, dir: &Path) -> Result<(String, PathBuf), Finding> {
    let dev = match fs::metadata(dir) {
        Ok(m) => m.dev(),
        Err(e) => {
            return Err(Finding::warn(
                check,
                format!("stat {}: {e}", dir.display()),
                &["fix the data_dir check first"],
            ))
        }
    };
    let (major, minor) = dev_major_minor(dev);
    let Ok(mut sys_dev) = fs::canonicalize(format!("/sys/dev/block/{major}:{minor}")) else {
        return Err(Finding::ok(
            check,
            format!(
                "{} is not on a block device ({major}:{minor}); nothing to tune",
                dir.display()
            ),
        ));
    };
    if sys_dev.join("partition").exists() {
        sys_dev.pop();
    }
    let name = sys_dev
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok((name, sys_dev))
}

fn check_io_scheduler(dir: &Path) -> Finding {
    const CHECK: &str = "io_scheduler";
    let (name, sys_dev) = match block_device(CHECK, dir) {
        Ok(found) => found,
        Err(finding) => return finding,
    };
    let Ok(text) = fs::read_to_string(sys_dev.join("queue/scheduler")) else {
        return Finding::ok(
            CHECK,
            format!("{name}: no I/O scheduler (device-mapper or virtual device)"),
        );
    };
    let text = text.trim();
    // Usually `[none] mq-deadline`; a device with one choice may print it bare.
    let choice =
        parse_bracketed_choice(text).or((!text.is_empty() && !text.contains(' ')).then_some(text));
    let rotational =
        fs::read_to_string(sys_dev.join("queue/rotational")).is_ok_and(|r| r.trim() == "1");
    match choice {
        Some("none") => Finding::ok(CHECK, format!("{name}: none")),
        Some(choice) if rotational => Finding::ok(
            CHECK,
            format!("{name}: {choice} (rotational disk: a scheduler helps it; rotary expects NVMe for spools)"),
        ),
        choice => {
            let choice = choice.unwrap_or(text);
            let fix = format!("echo none | sudo tee /sys/block/{name}/queue/scheduler");
            let persist = format!(
                "echo 'ACTION==\"add|change\", KERNEL==\"{name}\", ATTR{{queue/scheduler}}=\"none\"' | sudo tee /etc/udev/rules.d/60-rotary-scheduler.rules   # persist"
            );
            Finding::warn(
                CHECK,
                format!("{name}: {choice}; NVMe and virtual disks queue in the device, a software scheduler only adds latency"),
                &[&fix, &persist],
            )
        }
    }
}

// ------------------------------------------------------- disk interrupts

/// Fewer interrupts than this since boot say nothing about where they go.
const IRQ_COUNT_MIN: u64 = 1000;

/// Per-CPU interrupt counts of the IRQs `irqs`, summed, from the text of
/// `/proc/interrupts` (header line of `CPUn` columns, then one line per IRQ).
pub fn irq_counts_per_cpu(interrupts: &str, irqs: &[u32]) -> Vec<u64> {
    let mut lines = interrupts.lines();
    let cpus = lines.next().map_or(0, |h| h.split_whitespace().count());
    let mut per_cpu = vec![0u64; cpus];
    for line in lines {
        let Some((irq, rest)) = line.split_once(':') else {
            continue;
        };
        let Ok(irq) = irq.trim().parse::<u32>() else {
            continue;
        };
        if !irqs.contains(&irq) {
            continue;
        }
        for (cpu, count) in rest.split_whitespace().take(cpus).enumerate() {
            per_cpu[cpu] += count.parse::<u64>().unwrap_or(0);
        }
    }
    per_cpu
}

/// The CPUs that took at least 1% of the interrupts counted, or `None` when
/// there were too few to tell.
pub fn irq_cpus(per_cpu: &[u64]) -> Option<Vec<usize>> {
    let total: u64 = per_cpu.iter().sum();
    if total < IRQ_COUNT_MIN {
        return None;
    }
    Some(
        per_cpu
            .iter()
            .enumerate()
            .filter(|(_, &n)| n * 100 >= total)
            .map(|(cpu, _)| cpu)
            .collect(),
    )
}

/// The MSI interrupts of the device behind a block device's sysfs directory
/// (its PCI function's `msi_irqs`, found by walking up from `device`).
fn device_irqs(sys_dev: &Path) -> Vec<u32> {
    let Ok(mut at) = fs::canonicalize(sys_dev.join("device")) else {
        return Vec::new();
    };
    loop {
        if let Ok(entries) = fs::read_dir(at.join("msi_irqs")) {
            let mut irqs: Vec<u32> = entries
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect();
            irqs.sort_unstable();
            return irqs;
        }
        if !at.pop() || at == Path::new("/sys/devices") {
            return Vec::new();
        }
    }
}

/// Where the data device's completion interrupts land. Every spool write
/// completes through the kernel on the CPU that took its interrupt (ext4
/// finishes O_DIRECT writes in a per-CPU kernel worker), and only then
/// wakes the shard that issued it. A shard on another CPU pays a cross-CPU
/// wake-up per write, and waits whenever that CPU is busy.
fn check_disk_irqs(dir: &Path) -> Finding {
    const CHECK: &str = "disk_irqs";
    let (name, sys_dev) = match block_device(CHECK, dir) {
        Ok(found) => found,
        Err(finding) => return finding,
    };
    let irqs = device_irqs(&sys_dev);
    if irqs.is_empty() {
        return Finding::ok(
            CHECK,
            format!("{name}: no MSI interrupts found; not checked"),
        );
    }
    let interrupts = fs::read_to_string("/proc/interrupts").unwrap_or_default();
    let per_cpu = irq_counts_per_cpu(&interrupts, &irqs);
    let Some(cpus) = irq_cpus(&per_cpu) else {
        return Finding::ok(
            CHECK,
            format!("{name}: too few interrupts since boot to tell where they land"),
        );
    };
    let online = read_cpu_list("/sys/devices/system/cpu/online").unwrap_or_default();
    let text = format!(
        "{name}: completion interrupts land on CPU {} of {} online",
        format_cpu_list(&cpus),
        format_cpu_list(&online)
    );
    if online.len() <= 1 || cpus.len() >= online.len() {
        return Finding::ok(CHECK, text);
    }
    let list = format_cpu_list(&cpus);
    Finding::warn(
        CHECK,
        format!(
            "{text}; a shard on any other CPU waits for a cross-CPU wake-up on every spool write"
        ),
        &[
            &format!("rotary serve --cpus {list} …   # a broker with fewer shards than CPUs: put them where the interrupts are"),
            &format!("give {name} one queue per CPU (NVMe has them; virtio-blk: num-queues on the host), so each CPU completes its own writes"),
        ],
    )
}

/// Free space below which a broker refuses appends soon.
pub const DISK_BYTES_FAIL_BELOW: u64 = GIB;
/// Free space below which a broker has little room for spools and read cache.
pub const DISK_BYTES_WARN_BELOW: u64 = 10 * GIB;

/// Judges free space: `FAIL` under 1 GiB, `warn` under 10 GiB or 10 %.
pub fn judge_disk_space(avail: u64, total: u64) -> Level {
    if avail < DISK_BYTES_FAIL_BELOW {
        Level::Fail
    } else if avail < DISK_BYTES_WARN_BELOW || (total > 0 && avail.saturating_mul(10) < total) {
        Level::Warn
    } else {
        Level::Ok
    }
}

fn check_disk_space(dir: &Path) -> Finding {
    const CHECK: &str = "disk_space";
    let st = match sys::statfs(dir) {
        Ok(st) => st,
        Err(e) => {
            return Finding::fail(
                CHECK,
                format!("statfs {}: {e}", dir.display()),
                &["fix the data_dir check first"],
            )
        }
    };
    let avail = st.blocks_avail.saturating_mul(st.block_size);
    let total = st.blocks_total.saturating_mul(st.block_size);
    let text = format!(
        "{} free of {} on {}",
        bytes_text(avail),
        bytes_text(total),
        dir.display()
    );
    let fix = format!(
        "du -xsh {}/* | sort -h | tail   # find what to remove, or move the data dir to a larger filesystem",
        shell_quote(&dir.display().to_string())
    );
    match judge_disk_space(avail, total) {
        Level::Ok => Finding::ok(CHECK, text),
        Level::Warn => Finding::warn(
            CHECK,
            format!("{text}: little room for spools and sealed fragments"),
            &[&fix],
        ),
        Level::Fail => Finding::fail(
            CHECK,
            format!("{text}: appends will be refused with STORAGE_FULL"),
            &[&fix],
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thp_modes() {
        assert_eq!(
            parse_bracketed_choice("always [madvise] never\n"),
            Some("madvise")
        );
        assert_eq!(
            parse_bracketed_choice("[always] madvise never"),
            Some("always")
        );
        assert_eq!(
            parse_bracketed_choice("always madvise [never]"),
            Some("never")
        );
        assert_eq!(parse_bracketed_choice("always madvise never"), None);
        assert_eq!(parse_bracketed_choice("[]"), None);
        assert_eq!(
            parse_bracketed_choice("[mq-deadline] kyber none"),
            Some("mq-deadline")
        );
        assert_eq!(judge_thp("always"), Level::Warn);
        assert_eq!(judge_thp("madvise"), Level::Ok);
        assert_eq!(judge_thp("never"), Level::Ok);
    }

    #[test]
    fn clock_sources() {
        assert_eq!(judge_clocksource("tsc\n"), Level::Ok);
        assert_eq!(judge_clocksource("kvm-clock"), Level::Ok);
        assert_eq!(judge_clocksource("arch_sys_counter"), Level::Ok);
        assert_eq!(judge_clocksource("hpet"), Level::Warn);
        assert_eq!(judge_clocksource("acpi_pm"), Level::Warn);
        assert_eq!(judge_clocksource("xen"), Level::Warn);
    }

    #[test]
    fn time_slice_kernels() {
        assert_eq!(judge_time_slices("6.18.44"), Level::Ok);
        assert_eq!(judge_time_slices("6.12.0-1-amd64"), Level::Ok);
        assert_eq!(judge_time_slices("7.0.1"), Level::Ok);
        assert_eq!(judge_time_slices("6.11.9"), Level::Warn);
        assert_eq!(judge_time_slices("6.1.0-18-amd64"), Level::Warn);
        assert_eq!(judge_time_slices("unknown"), Level::Warn);
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("\n"), Some(vec![]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpu_list(&[]), "none");
        assert_eq!(format_cpu_list(&[5]), "5");
    }

    #[test]
    fn disk_interrupts_per_cpu() {
        let text = "           CPU0       CPU1\n\
            35:          0          1 PCI-MSIX-0000:00:02.0   0-edge      virtio1-config\n\
            36:         12   47242253 PCI-MSIX-0000:00:02.0   1-edge      virtio1-req.0\n\
            37:        900          0 PCI-MSIX-0000:00:03.0   0-edge      virtio2-config\n\
           NMI:          0          0   Non-maskable interrupts\n";
        let counts = irq_counts_per_cpu(text, &[35, 36]);
        assert_eq!(counts, vec![12, 47242254]);
        assert_eq!(irq_cpus(&counts), Some(vec![1]));
        // Spread: both CPUs take a share.
        assert_eq!(irq_cpus(&[5000, 4000]), Some(vec![0, 1]));
        // Too few to judge.
        assert_eq!(irq_cpus(&irq_counts_per_cpu(text, &[37])), None);
        assert_eq!(irq_counts_per_cpu(text, &[99]), vec![0, 0]);
    }

    #[test]
    fn kernel_versions() {
        assert_eq!(parse_kernel_version("6.1.0-18-amd64"), Some((6, 1)));
        assert_eq!(
            parse_kernel_version("5.14.21-150500.55.19-default\n"),
            Some((5, 14))
        );
        assert_eq!(parse_kernel_version("garbage"), None);
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(bytes_text(512), "512 B");
        assert_eq!(bytes_text(8 << 20), "8 MiB");
        assert_eq!(bytes_text(3 * GIB / 2), "1.5 GiB");
        assert_eq!(judge_disk_space(GIB - 1, 100 * GIB), Level::Fail);
        assert_eq!(judge_disk_space(5 * GIB, 100 * GIB), Level::Warn);
        assert_eq!(judge_disk_space(50 * GIB, 1000 * GIB), Level::Warn);
        assert_eq!(judge_disk_space(50 * GIB, 100 * GIB), Level::Ok);
    }

    #[test]
    fn device_numbers() {
        // makedev(259, 1) — an NVMe partition — and makedev(8, 17).
        assert_eq!(dev_major_minor((259 << 8) | 1), (259, 1));
        assert_eq!(dev_major_minor((8 << 8) | 17), (8, 17));
        // Large minors spill into the high bits.
        let dev = ((0x1234u64 & !0xff) << 12) | (0x1234 & 0xff) | (253 << 8);
        assert_eq!(dev_major_minor(dev), (253, 0x1234));
    }

    #[test]
    fn report_format() {
        let findings = vec![
            Finding::ok("io_uring", "kernel 6.1.0"),
            Finding::warn(
                "thp",
                "enabled = always",
                &["echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled"],
            ),
            Finding::fail("o_direct", "EINVAL", &["first fix", "second fix"]),
        ];
        let report = format_report(&findings);
        assert_eq!(
            report,
            "ok    io_uring: kernel 6.1.0\n\
             warn  thp: enabled = always\n\
             \x20     fix: echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled\n\
             FAIL  o_direct: EINVAL\n\
             \x20     fix: first fix\n\
             \x20     fix: second fix\n"
        );
        assert_eq!(exit_code(&findings), 1);
        assert_eq!(exit_code(&findings[..2]), 0);
        assert_eq!(exit_code(&[]), 0);
    }

    #[test]
    #[should_panic(expected = "without a fix")]
    fn problems_carry_fixes() {
        let _ = Finding::warn("thp", "always", &[]);
    }

    #[test]
    fn o_direct_probe_passes_on_a_temp_dir() {
        let dir = tempfile::tempdir().unwrap();
        probe_o_direct(dir.path()).unwrap();
        // The probe leaves nothing behind.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
        let finding = check_o_direct(dir.path());
        assert_eq!(finding.level, Level::Ok, "{finding}");
    }

    #[test]
    fn missing_data_dir_is_created() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("a/b/data");
        let (finding, probe) = check_data_dir(&data);
        assert_eq!(finding.level, Level::Ok, "{finding}");
        assert!(finding.finding.ends_with("(created)"), "{finding}");
        assert_eq!(probe, data);
        assert!(data.is_dir());
        let (again, _) = check_data_dir(&data);
        assert!(again.finding.ends_with("(exists)"), "{again}");
    }

    #[test]
    fn uncreatable_data_dir_probes_the_nearest_parent() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("plain-file");
        fs::write(&file, b"x").unwrap();
        // A path under a regular file can never be created.
        let data = file.join("data");
        let (finding, probe) = check_data_dir(&data);
        assert_eq!(finding.level, Level::Fail, "{finding}");
        assert!(finding.fixes[0].starts_with("sudo mkdir -p "), "{finding}");
        assert_eq!(probe, dir.path());
        assert_eq!(
            nearest_existing_ancestor(Path::new("/no/such/dir/at/all")),
            Path::new("/")
        );
    }

    #[test]
    fn shell_quoting() {
        assert_eq!(shell_quote("/var/lib/rotary"), "/var/lib/rotary");
        assert_eq!(shell_quote("/tmp/a b"), "'/tmp/a b'");
        assert_eq!(shell_quote("/tmp/it's"), "'/tmp/it'\\''s'");
    }

    #[test]
    fn every_check_reports_on_this_host() {
        let dir = tempfile::tempdir().unwrap();
        let findings = check_all(&dir.path().join("data"));
        println!("{}", format_report(&findings));
        let names: Vec<&str> = findings.iter().map(|f| f.check).collect();
        assert_eq!(
            names,
            [
                "io_uring",
                "iowq_affinity",
                "memlock",
                "nofile",
                "cpus",
                "cpu_governor",
                "thp",
                "clocksource",
                "time_slices",
                "data_dir",
                "o_direct",
                "io_scheduler",
                "disk_irqs",
                "disk_space",
            ]
        );
        for f in &findings {
            assert!(!f.finding.is_empty());
            assert_eq!(f.fixes.is_empty(), f.level == Level::Ok, "{f}");
        }
        let data_dir = &findings[8];
        assert_eq!(data_dir.level, Level::Ok, "{data_dir}");
    }
}
