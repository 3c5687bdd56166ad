//! Host queries the standard library lacks: resource limits, filesystem
//! statistics, CPU affinity and file preallocation. Beside `direct` (aligned
//! buffers and the raw ring), this is the crate's only module that uses
//! `unsafe`; every call passes the kernel either no memory or a pointer to a
//! local value of the exact type it fills in, and reads the value only after
//! success.

#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// A resource limit; `None` is unlimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    pub soft: Option<u64>,
    pub hard: Option<u64>,
}

fn limit_of(raw: libc::rlimit) -> Limit {
    let value = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
    Limit {
        soft: value(raw.rlim_cur),
        hard: value(raw.rlim_max),
    }
}

/// RLIMIT_MEMLOCK of this process, in bytes.
pub fn memlock_limit() -> io::Result<Limit> {
    let mut raw = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `raw` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut raw) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(limit_of(raw))
}

/// RLIMIT_NOFILE of this process, in file descriptors.
pub fn nofile_limit() -> io::Result<Limit> {
    let mut raw = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `raw` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut raw) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(limit_of(raw))
}

/// What statfs(2) says about the filesystem holding a path.
#[derive(Clone, Copy, Debug)]
pub struct FsStats {
    /// Filesystem magic number (`f_type`).
    pub magic: u64,
    /// Fragment size: the unit of `blocks_total` and `blocks_avail`.
    pub block_size: u64,
    pub blocks_total: u64,
    /// Blocks available to unprivileged users.
    pub blocks_avail: u64,
}

pub fn statfs(path: &Path) -> io::Result<FsStats> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    // SAFETY: statfs is plain old data; all-zero is a valid value.
    let mut raw: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is NUL-terminated and `raw` is writable for the call.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut raw) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let block_size = if raw.f_frsize > 0 {
        raw.f_frsize as u64
    } else {
        raw.f_bsize as u64
    };
    Ok(FsStats {
        // f_type is a signed word; magics are 32-bit patterns.
        magic: raw.f_type as u64 & 0xffff_ffff,
        block_size,
        blocks_total: raw.f_blocks as u64,
        blocks_avail: raw.f_bavail as u64,
    })
}

/// Largest CPU number a `cpu_set_t` can name, plus one.
pub const CPU_SET_LEN: usize = libc::CPU_SETSIZE as usize;

/// A `cpu_set_t` holding `cpus` (numbers ≥ [`CPU_SET_LEN`] are left out).
pub fn cpu_set(cpus: &[usize]) -> libc::cpu_set_t {
    // SAFETY: cpu_set_t is a plain bit array; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus.iter().filter(|&&c| c < CPU_SET_LEN) {
        // SAFETY: `cpu` < CPU_SETSIZE, so the bit is inside `set`.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    set
}

/// CPUs this thread may run on (sched_getaffinity).
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    let mut set = cpu_set(&[]);
    // SAFETY: `set` is a writable cpu_set_t and its exact size is passed.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((0..CPU_SET_LEN)
        .filter(|&c| {
            // SAFETY: `c` < CPU_SETSIZE, so the bit is inside `set`.
            unsafe { libc::CPU_ISSET(c, &set) }
        })
        .collect())
}

/// Restricts the calling thread (and the threads it starts later) to
/// `cpus` (sched_setaffinity). The one affinity helper of the workspace:
/// shards, benchmarks and `rotary doctor` pin through it. A CPU beyond
/// CPU_SETSIZE is an `InvalidInput` error, not silently left out.
pub fn set_thread_affinity(cpus: &[usize]) -> io::Result<()> {
    if let Some(cpu) = cpus.iter().find(|&&c| c >= CPU_SET_LEN) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("cpu {cpu} beyond CPU_SETSIZE"),
        ));
    }
    let set = cpu_set(cpus);
    // SAFETY: `set` is a valid cpu_set_t and its exact size is passed; pid 0
    // is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Allocates `[offset, offset + len)` of the file (fallocate(2), mode 0: the
/// file size grows to cover the range). Filesystems without fallocate answer
/// `EOPNOTSUPP`.
pub fn fallocate(file: &impl std::os::fd::AsRawFd, offset: u64, len: u64) -> io::Result<()> {
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "range beyond off_t",
        ));
    };
    // SAFETY: plain system call on a file descriptor the caller keeps open;
    // no memory is passed.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, offset, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affinity_beyond_the_set_is_refused() {
        let e = set_thread_affinity(&[0, CPU_SET_LEN]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("CPU_SETSIZE"), "{e}");
    }
}
