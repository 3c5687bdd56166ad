//! The cluster fault suite, short: each fault once, on a cluster on etcd
//! of real processes (four brokers in four zones, lease TTL 3 s; three
//! journals of replication 3 and one of replication 2, each with a
//! `file://` store; two writers per journal sending straight to its primary).
//! After each, checked from outside the brokers: every acknowledged append
//! at its offsets with its SHA-1 as every member serves it (pinned reads,
//! not proxied: from its own disk, or from the store fragment it points
//! at) and in the store's files, no two stored fragments that disagree,
//! no two members that disagree, no torn bytes.
//!
//! The harness is `rotary_benches::faults`, which `rotary bench --scenario
//! faults` runs with each fault several times. Runs go two at a time
//! (`ROTARY_FAULT_CLUSTERS`); the partitions need root and iproute2 (the
//! brokers and etcd run in network namespaces of their own).

use rotary_benches::faults::{self, Fault};
use std::path::Path;

/// Runs `fault` once and fails unless every check passed.
async fn once(fault: Fault) {
    let exe = Path::new(env!("CARGO_BIN_EXE_rotary"));
    let outcome = faults::run(exe, &std::env::temp_dir(), fault, 1)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("{}", outcome.details());
    assert!(outcome.acked > 0, "no append acknowledged");
    assert!(outcome.passed(), "{}", outcome.details());
}

/// The paused primary has appends queued on it (the writers send to it
/// directly); once it runs again, past its lease, it must neither commit
/// nor upload them: no stored fragment may disagree with another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_stopped_past_its_lease_with_appends_queued() {
    once(Fault::StopPrimary).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stopped_past_its_lease() {
    once(Fault::StopReplica).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary() {
    once(Fault::KillPrimary).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica() {
    once(Fault::KillReplica).await;
}

/// The journal has too few brokers until they are back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_and_a_replica_killed_together_then_restarted() {
    once(Fault::KillTwo).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_and_a_replica_stopped_together() {
    once(Fault::StopTwo).await;
}

/// Every lease expires in etcd's eyes while it is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_stopped_past_the_lease_ttl() {
    once(Fault::StopEtcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_killed_and_restarted() {
    once(Fault::KillEtcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart() {
    once(Fault::RollingRestart).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_primary() {
    once(Fault::PartitionPrimary).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_replica() {
    once(Fault::PartitionReplica).await;
}
