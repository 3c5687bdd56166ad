//! Brokers of a cluster on etcd: a real `etcd` started on free loopback
//! ports, and `rotary serve --etcd` processes `b1`…`bn` in zones `a`, `b`, …
//! joining it. Each broker keeps its ports and data directory for the whole
//! test, so one killed and started again comes back at the same endpoint.
//! Every process is killed by PID when the fixture drops (logs printed
//! first on a panic, or with `ROTARY_TEST_LOGS=1`).

use super::cluster::{ClusterBroker, ONE_CLUSTER_AT_A_TIME};
use rotary_net::client::{Client, ClientOptions, JournalInfo};
use std::process::Command;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

/// How long a journal may take to be assigned a whole route.
pub const ASSIGN_TIMEOUT: Duration = Duration::from_secs(30);

pub struct EtcdCluster {
    pub etcd: rotary_etcd::testing::Etcd,
    pub brokers: Vec<ClusterBroker>,
    _one_at_a_time: MutexGuard<'static, ()>,
}

impl EtcdCluster {
    /// etcd, and `n` brokers of `cores` shards and lease TTL `ttl` (`3s`),
    /// started one after another (so `b1` leads the allocation).
    pub fn start(n: usize, cores: usize, ttl: &str) -> EtcdCluster {
        let guard = ONE_CLUSTER_AT_A_TIME
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let etcd = rotary_etcd::testing::Etcd::start().unwrap_or_else(|e| panic!("{e}"));
        let endpoint = etcd.endpoint();
        let mut brokers: Vec<ClusterBroker> = (0..n)
            .map(|i| {
                let mut b = ClusterBroker::new(i, cores, "unused".into());
                b.etcd = Some((endpoint.clone(), ttl.to_string()));
                b
            })
            .collect();
        for b in &mut brokers {
            b.start();
        }
        EtcdCluster {
            etcd,
            brokers,
            _one_at_a_time: guard,
        }
    }

    /// Every broker's endpoint, comma-separated: what `--broker` takes.
    pub fn endpoints(&self) -> String {
        let all: Vec<String> = self.brokers.iter().map(|b| b.endpoint()).collect();
        all.join(",")
    }

    pub fn index(&self, id: &str) -> usize {
        self.brokers
            .iter()
            .position(|b| b.id == id)
            .unwrap_or_else(|| panic!("no broker {id:?}"))
    }

    /// A `rotary` command aimed at every broker (the first that answers).
    pub fn cli(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rotary"));
        cmd.args(args).arg("--broker").arg(self.endpoints());
        cmd.env_remove("ROTARY_BROKER");
        cmd
    }

    /// A client bootstrapped at every broker, retrying appends for `retry`.
    pub async fn client(&self, retry: Duration) -> Client {
        let options = ClientOptions {
            retry_for: retry,
            ..ClientOptions::default()
        };
        Client::connect_with(&self.endpoints(), options)
            .await
            .unwrap_or_else(|e| panic!("connect to the cluster: {e}"))
    }

    /// Waits until `journal` is listed with a route of `members` brokers,
    /// all running; returns its listing.
    pub async fn assigned(&self, journal: &str, members: usize) -> JournalInfo {
        let deadline = Instant::now() + ASSIGN_TIMEOUT;
        let client = self.client(Duration::ZERO).await;
        loop {
            let list = client.list("").await.unwrap_or_default();
            if let Some(j) = list.iter().find(|j| j.spec.name == journal) {
                let live = j
                    .route
                    .members
                    .iter()
                    .all(|m| self.brokers.iter().any(|b| b.id == *m && b.is_running()));
                if j.route.members.len() == members && live {
                    return j.clone();
                }
            }
            assert!(
                Instant::now() < deadline,
                "{journal} has no route of {members} live brokers after {ASSIGN_TIMEOUT:?}: {list:#?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for b in &mut self.brokers {
            b.kill9();
        }
        if std::thread::panicking() || std::env::var_os("ROTARY_TEST_LOGS").is_some() {
            eprintln!("--- etcd ---\n{}", self.etcd.log_tail());
            for b in &self.brokers {
                b.print_logs();
            }
        }
    }
}

/// One journal's assignment keys as etcd holds them: (member id, slot),
/// in key order.
pub type AssignmentKeys = std::collections::BTreeMap<String, Vec<(String, u32)>>;

impl EtcdCluster {
    /// Every assignment key, and every member key's id and lease, read
    /// from etcd directly (the brokers' default prefix `/rotary`); `None`
    /// while etcd does not answer.
    pub async fn etcd_keys(&self) -> Option<(AssignmentKeys, Vec<(String, i64)>)> {
        let options = rotary_etcd::ClientOptions {
            request_timeout: Duration::from_secs(2),
            ..rotary_etcd::ClientOptions::default()
        };
        let etcd = rotary_etcd::Client::connect(&[self.etcd.endpoint()], options)
            .await
            .ok()?;
        let assigned = etcd.range_prefix("/rotary/assign/").await.ok()?;
        let members = etcd.range_prefix("/rotary/members/").await.ok()?;
        let mut out = AssignmentKeys::new();
        for kv in assigned.kvs {
            let key = String::from_utf8_lossy(&kv.key).into_owned();
            let rest = key
                .strip_prefix("/rotary/assign/")
                .expect("under the prefix");
            let parts: Vec<&str> = rest.split('#').collect();
            let [journal, _zone, id, slot] = parts.as_slice() else {
                panic!("assignment key {key:?} is not journal#zone#id#slot");
            };
            out.entry(journal.to_string())
                .or_default()
                .push((id.to_string(), slot.parse().expect("a slot")));
        }
        let ids = members
            .kvs
            .iter()
            .map(|kv| {
                let key = String::from_utf8_lossy(&kv.key).into_owned();
                let id = key.rsplit('#').next().expect("zone#id").to_string();
                (id, kv.lease)
            })
            .collect();
        Some((out, ids))
    }

    /// Waits until etcd holds every broker as a member and, for each
    /// `(journal, replication)`, exactly `replication` assignments of
    /// distinct live members with one primary; checks on every read, from
    /// the first on, that no journal has two primaries or one member at
    /// two slots. Returns how long it took.
    pub async fn wait_whole(&self, journals: &[(&str, usize)], timeout: Duration) -> Duration {
        let began = Instant::now();
        let live: Vec<&str> = self
            .brokers
            .iter()
            .filter(|b| b.is_running())
            .map(|b| b.id.as_str())
            .collect();
        loop {
            let read = self.etcd_keys().await;
            if let Some((assigned, members)) = &read {
                assert_sound(assigned);
                let whole = live.iter().all(|id| members.iter().any(|(m, _)| m == id))
                    && journals.iter().all(|(j, r)| {
                        let keys = assigned.get(*j).map(Vec::as_slice).unwrap_or_default();
                        keys.len() == *r
                            && keys.iter().filter(|(_, slot)| *slot == 0).count() == 1
                            && keys.iter().all(|(id, _)| live.contains(&id.as_str()))
                    });
                if whole {
                    return began.elapsed();
                }
            }
            assert!(
                began.elapsed() < timeout,
                "the cluster is not whole after {timeout:?}: {read:#?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl EtcdCluster {
    /// Waits until every running broker is a member under a lease other
    /// than those of `before` (it lost its lease and rejoined), checking
    /// on every read that the assignments are sound.
    pub async fn wait_rejoined(&self, before: &[(String, i64)], timeout: Duration) -> Duration {
        let began = Instant::now();
        loop {
            let read = self.etcd_keys().await;
            if let Some((assigned, members)) = &read {
                assert_sound(assigned);
                let rejoined = self.brokers.iter().filter(|b| b.is_running()).all(|b| {
                    members
                        .iter()
                        .any(|(id, lease)| *id == b.id && !before.iter().any(|(_, l)| l == lease))
                });
                if rejoined {
                    return began.elapsed();
                }
            }
            assert!(
                began.elapsed() < timeout,
                "the brokers have not rejoined after {timeout:?}: {read:#?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Asserts that no journal has two primaries (slot-0 keys) or one member
/// at two slots.
pub fn assert_sound(assigned: &AssignmentKeys) {
    for (journal, keys) in assigned {
        let primaries = keys.iter().filter(|(_, slot)| *slot == 0).count();
        assert!(
            primaries <= 1,
            "{journal} has {primaries} primaries: {keys:?}"
        );
        let mut ids: Vec<&str> = keys.iter().map(|(id, _)| id.as_str()).collect();
        ids.sort_unstable();
        let n = ids.len();
        ids.dedup();
        assert_eq!(ids.len(), n, "{journal} names a member twice: {keys:?}");
    }
}
