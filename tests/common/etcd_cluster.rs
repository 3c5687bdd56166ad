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
