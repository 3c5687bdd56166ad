//! Which errors of a local disk are final: the one classification that
//! storage (spools, seals, the commit log) and the uploader (reading a
//! sealed fragment to upload it) both apply, by the OS error number.
//!
//! A device that failed an I/O, or a file system that went read-only or
//! found itself corrupt, does not heal by being asked again: a broker that
//! retried would retry for ever, and every retry is another error in the
//! kernel log of a disk that needs replacing. Anything else (a full disk, a
//! lack of memory or descriptors, an interrupted call) may pass.

/// The OS errors that mean the local disk failed for good: `EIO` (a dying
/// disk, or writeback that was lost), `ENXIO` and `ENODEV` (the device is
/// gone), `EROFS` (remounted read-only, as file systems do after errors),
/// `EUCLEAN` (the file system is corrupt).
pub const FINAL_ERRNOS: [i32; 5] = [
    libc::EIO,
    libc::ENXIO,
    libc::ENODEV,
    libc::EROFS,
    libc::EUCLEAN,
];

/// Whether the OS error number `errno` means the disk failed for good.
pub fn errno_is_final(errno: i32) -> bool {
    FINAL_ERRNOS.contains(&errno)
}

/// Whether an I/O error of the local disk may go away if the call is made
/// again: not when its OS error is final ([`errno_is_final`]). An error
/// without an OS error number (a short write, say) may pass.
pub fn io_is_retryable(e: &std::io::Error) -> bool {
    e.raw_os_error().is_none_or(|errno| !errno_is_final(errno))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_device_is_final_and_a_busy_one_is_not() {
        for errno in FINAL_ERRNOS {
            assert!(!io_is_retryable(&std::io::Error::from_raw_os_error(errno)));
        }
        for errno in [
            libc::EINTR,
            libc::EAGAIN,
            libc::ENOMEM,
            libc::EMFILE,
            libc::ENOSPC,
            libc::EDQUOT,
        ] {
            assert!(io_is_retryable(&std::io::Error::from_raw_os_error(errno)));
        }
        assert!(io_is_retryable(&std::io::Error::other("short write")));
    }
}
