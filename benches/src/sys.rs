//! The few calls into the kernel that std does not offer: thread pinning
//! (through `rotary_tuning::sys`, the workspace's one affinity helper)
//! and timer slack. The only module allowed `unsafe`.
#![allow(unsafe_code)]

use std::io;

/// Pins the calling thread to `cpu`.
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    pin_current_thread_to(&[cpu])
}

/// Pins the calling thread (and the threads it starts later) to `cpus`.
pub fn pin_current_thread_to(cpus: &[usize]) -> io::Result<()> {
    rotary_tuning::sys::set_thread_affinity(cpus)
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
