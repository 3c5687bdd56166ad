//! Raw-frame test client, in-process broker helpers, and what the seeded
//! simulations share.
#![allow(dead_code)]

pub mod sim;
pub mod wire;

#[allow(unused_imports)] // Not every test binary talks to a broker.
pub use wire::Conn;

use rotary_engine::{Broker, ServeConfig};
use rotary_net::spec::JournalSpec;
use rotary_net::status::Status;
use rotary_net::wire::AppendRequest;
use rotary_net::wire::Op;
use rotary_storage::faults::Faults;
use std::sync::Arc;

pub fn start(dir: &std::path::Path, cores: usize) -> Broker {
    let mut cfg = ServeConfig::new(dir.to_path_buf(), "127.0.0.1:0".parse().unwrap());
    cfg.cores = cores;
    cfg.disk_reserve_bytes = 0;
    Broker::start(cfg).unwrap()
}

/// A broker of one shard on `dir`, its disk operations decided by `faults`.
pub fn start_faulty(dir: &std::path::Path, faults: Arc<dyn Faults>) -> Broker {
    let mut cfg = ServeConfig::new(dir.to_path_buf(), "127.0.0.1:0".parse().unwrap());
    cfg.cores = 1;
    cfg.disk_reserve_bytes = 0;
    cfg.faults = Some(faults);
    Broker::start(cfg).unwrap()
}

/// A broker-wide counter from STATS.
pub fn stat(c: &mut Conn, name: &str) -> u64 {
    c.send(Op::STATS, 0, 3, &[], &[]);
    let r = c.recv();
    assert_eq!(r.known_status(), Status::OK);
    let stats: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
    stats[name].as_u64().unwrap()
}

/// A one-core broker on a fresh directory, serving journal `name`, and a
/// connection to it. Bind the directory first: it must outlive the broker.
pub fn serve_journal(name: &str) -> (tempfile::TempDir, Broker, Conn) {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path(), 1);
    let mut c = Conn::new(broker.endpoints[0]);
    c.apply(&[JournalSpec::new(name)]);
    (dir, broker, c)
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
