//! The few calls into the kernel that std does not offer: thread pinning
//! and timer slack. The only module allowed `unsafe`.
#![allow(unsafe_code)]

use std::io;

/// Pins the calling thread to `cpu`.
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    pin_current_thread_to(&[cpu])
}

/// Pins the calling thread (and the threads it starts later) to `cpus`.
pub fn pin_current_thread_to(cpus: &[usize]) -> io::Result<()> {
    // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("cpu {cpu} beyond CPU_SETSIZE"),
            ));
        }
        // SAFETY: `cpu` was checked to be below CPU_SETSIZE, the set's size.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of
    // the size passed, read only during the call.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Asks the kernel to wake this thread from sleeps within 1 µs of the
/// deadline instead of the default 50 µs "timer slack".
pub fn precise_sleeps() -> io::Result<()> {
    const TIMER_SLACK_NS: libc::c_ulong = 1_000;
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument and changes only
    // the calling thread's timer slack; no memory is passed.
    let rc = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, TIMER_SLACK_NS) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
