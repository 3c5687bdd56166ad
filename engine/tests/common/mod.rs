//! Raw-frame test client, in-process broker helpers, and what the seeded
//! simulations share.
#![allow(dead_code)]

pub mod sim;
pub mod wire;

#[allow(unused_imports)] // Not every test binary talks to a broker.
pub use wire::Conn;

use rotary_engine::{Broker, ServeConfig};
use rotary_net::wire::AppendRequest;

pub fn start(dir: &std::path::Path, cores: usize) -> Broker {
    let mut cfg = ServeConfig::new(dir.to_path_buf(), "127.0.0.1:0".parse().unwrap());
    cfg.cores = cores;
    cfg.disk_reserve_bytes = 0;
    Broker::start(cfg).unwrap()
}

/// A seeded xorshift generator: the same numbers on every run.
pub fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

pub fn req(journal: &str) -> AppendRequest {
    AppendRequest {
        journal: journal.into(),
        ..Default::default()
    }
}
