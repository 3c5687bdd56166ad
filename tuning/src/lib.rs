//! Host tuning for rotary brokers. This crate owns the knowledge of what a
//! host must provide for a thread-per-core io_uring broker — io_uring and
//! its opcodes, io-wq worker affinity, locked-memory and open-file limits,
//! O_DIRECT on the data filesystem, pinnable cores, huge-page and clock
//! settings, free space — and the `rotary doctor` checks that verify them
//! ([`doctor`]), with the fix for each problem. It runs once, on the thread
//! that calls it, before or beside a broker; it never runs on a shard and
//! keeps no state. Its only side effects are creating the data directory and
//! a probe file in it that it removes again. `tuning/README.md` is the host
//! tuning guide for bare-metal fleets.
//!
//! Device and network calibration (`rotary tune`: measuring a device's
//! O_DIRECT write latency and throughput at each queue depth, to size spools
//! and batches) will live beside `doctor` in a `tune` module.

#![deny(unsafe_code)]

pub mod doctor;
mod sys;
