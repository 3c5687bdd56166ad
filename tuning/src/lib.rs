//! Host tuning for rotary brokers. This crate owns the knowledge of what a
//! host must provide for a thread-per-core io_uring broker — io_uring and
//! its opcodes, io-wq worker affinity, locked-memory and open-file limits,
//! O_DIRECT on the data filesystem, pinnable cores, huge-page and clock
//! settings, free space — and the `rotary doctor` checks that verify them
//! ([`doctor`]), with the fix for each problem; and the calibration of the
//! data directory's device (`rotary tune`, [`tune`]): O_DIRECT write
//! bandwidth and latency by block size and queue depth, fdatasync and read
//! latency, and the write batch, ring depth and spool preallocation they
//! call for, saved as a profile in the data directory for the broker to read
//! at start.
//!
//! Both run once, on the thread that calls them, before or beside a broker;
//! never on a shard, and they keep no state beyond the profile. Their side
//! effects are creating the data directory, probe and scratch files in it
//! that they remove again, and `tune`'s profile. `tuning/README.md` is the
//! host tuning guide for bare-metal fleets and documents the profile.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]
#![deny(unsafe_code)]

mod direct;
pub mod doctor;
pub mod sys;
pub mod tune;
