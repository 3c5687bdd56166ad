//! The consumer framework: an application's work split into shards that
//! the cluster places on consumer processes, each shard's state in an
//! embedded store whose file operations are recorded into a recovery log
//! journal, and transactions that commit state, read offsets and
//! published messages together.

pub mod recoverylog;
