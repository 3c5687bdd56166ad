//! What the workload runner needs of a messaging system.
//!
//! The runner ([`super`]) owns everything a workload measures: the schedule
//! of sends, the timestamps stamped into payloads, the histograms and the
//! result. A driver only moves messages: it creates topics, sends one
//! message to one partition and reports when the system acknowledged it,
//! and hands every received message to a sink. The same runner drives
//! rotary and its peers, so their figures are comparable.
//!
//! Topics are fresh for every run, and a consumer always starts at the
//! beginning of its partitions: a consumer created late (the backlog test)
//! catches up on everything published before it.

use bytes::Bytes;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// A boxed future that can move between threads.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Called once for every message a consumer receives: the partition it came
/// from and the payload exactly as it was sent. Called from the driver's
/// tasks; must not block.
pub type MessageSink = Arc<dyn Fn(usize, &[u8]) + Send + Sync>;

/// One messaging system, connected.
pub trait Driver: Send + Sync {
    /// The result's `driver` field and the row's name, e.g. `rotary`.
    fn name(&self) -> String;

    /// The durability and replication the system runs with, in words, stated
    /// beside its figures (e.g. `fdatasync before ack, replication 1`).
    fn durability(&self) -> String;

    /// Creates `partitions` partitions of the fresh topic `topic`.
    fn create_topic<'a>(
        &'a self,
        topic: &'a str,
        partitions: usize,
    ) -> BoxFuture<'a, anyhow::Result<()>>;

    /// A producer that sends to the partitions of `topic`.
    fn create_producer<'a>(
        &'a self,
        topic: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn Producer>>>;

    /// Starts one consumer of subscription `subscription` of `topic`, reading
    /// `partitions` (indices into the topic's partitions) from their
    /// beginning and handing each message to `sink` in order per partition,
    /// until it is closed.
    fn create_consumer<'a>(
        &'a self,
        topic: &'a str,
        subscription: &'a str,
        partitions: Vec<usize>,
        sink: MessageSink,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn Consumer>>>;
}

/// Sends messages of one topic.
pub trait Producer: Send + Sync {
    /// Sends one message to `partition`; resolves once the system has
    /// acknowledged it (durably, as [`Driver::durability`] says). Many sends
    /// may be in flight at once.
    fn send(&self, partition: usize, payload: Bytes) -> BoxFuture<'static, anyhow::Result<()>>;
}

/// A running consumer.
pub trait Consumer: Send {
    /// Stops receiving and releases the consumer's resources.
    fn close(self: Box<Self>) -> BoxFuture<'static, anyhow::Result<()>>;
}

/// A consumer made of spawned receiving tasks (one per partition, or one in
/// all): closing it, or dropping it, aborts them; closing reports the first
/// error a task had stopped with before that (or its panic).
pub struct TaskConsumer(Vec<tokio::task::JoinHandle<anyhow::Result<()>>>);

impl TaskConsumer {
    pub fn new(tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>) -> TaskConsumer {
        TaskConsumer(tasks)
    }

    pub fn push(&mut self, task: tokio::task::JoinHandle<anyhow::Result<()>>) {
        self.0.push(task);
    }
}

impl Consumer for TaskConsumer {
    fn close(mut self: Box<Self>) -> BoxFuture<'static, anyhow::Result<()>> {
        let tasks = std::mem::take(&mut self.0);
        Box::pin(async move {
            for task in &tasks {
                task.abort();
            }
            let mut first_error = None;
            for task in tasks {
                match task.await {
                    Ok(Err(error)) => {
                        first_error.get_or_insert(error);
                    }
                    Err(error) if error.is_panic() => {
                        first_error
                            .get_or_insert(anyhow::anyhow!("a consumer task panicked: {error}"));
                    }
                    // Ended by the abort, or cleanly before it.
                    Ok(Ok(())) | Err(_) => {}
                }
            }
            first_error.map_or(Ok(()), Err)
        })
    }
}

impl Drop for TaskConsumer {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}
