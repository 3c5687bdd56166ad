//! Broker-to-broker replication messages (REPLICATE, SYNC, REPLICATE_ACK).
//!
//! A primary shard keeps one connection per peer shard. Each REPLICATE
//! frame's payload is a sequence of [`Record`]s for any journals routed
//! that way; every append on the connection has a sequence number `seq`
//! chosen by the primary. A replica answers each commit (and each SYNC)
//! with one [`Ack`]; one REPLICATE_ACK frame carries every ack the replica
//! has ready, so a batch of appends across journals costs one frame.

use crate::spec::LabelSet;
use crate::status::Status;
use crate::wire::{MetaReader, MetaWriter, WireError};
use serde::{Deserialize, Serialize};
use zerocopy::byteorder::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Kinds of [`Record`].
pub mod kind {
    pub const CONTENT: u8 = 1;
    pub const COMMIT: u8 = 2;
    pub const ROLLBACK: u8 = 3;
}

/// Fixed head of every record.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct RecordHead {
    pub kind: u8,
    pub reserved: [u8; 7],
    pub seq: U64,
}

#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
struct ContentFixed {
    offset: U64,
    len: U32,
    reserved: U32,
}

#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
struct CommitFixed {
    begin: U64,
    end: U64,
    sha1: [u8; 20],
    reserved: [u8; 4],
}

/// One step of a replicated append.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record<'a> {
    /// Bytes of append `seq` to be written at `offset`. The first content
    /// record of an append starts it; its offset is where the append begins.
    Content {
        seq: u64,
        journal: &'a str,
        offset: u64,
        bytes: &'a [u8],
    },
    /// Proposal: append `seq` ends at `end` (it began at `begin`), the
    /// open fragment's SHA-1 through `end` is `fragment_sha1`, and the
    /// journal's registers become `registers`.
    Commit {
        seq: u64,
        journal: &'a str,
        begin: u64,
        end: u64,
        fragment_sha1: [u8; 20],
        registers: LabelSet,
    },
    /// Append `seq` is abandoned: forget its bytes.
    Rollback { seq: u64, journal: &'a str },
}

impl Record<'_> {
    pub fn seq(&self) -> u64 {
        match self {
            Record::Content { seq, .. }
            | Record::Commit { seq, .. }
            | Record::Rollback { seq, .. } => *seq,
        }
    }

    pub fn journal(&self) -> &str {
        match self {
            Record::Content { journal, .. }
            | Record::Commit { journal, .. }
            | Record::Rollback { journal, .. } => journal,
        }
    }

    /// Appends the record's encoding to `out`.
    pub fn encode(&self, out: &mut MetaWriter) {
        let head = |kind: u8, seq: u64| RecordHead {
            kind,
            reserved: [0; 7],
            seq: U64::new(seq),
        };
        match self {
            Record::Content {
                seq,
                journal,
                offset,
                bytes,
            } => {
                out.fixed(&head(kind::CONTENT, *seq))
                    .str16(journal)
                    .fixed(&ContentFixed {
                        offset: U64::new(*offset),
                        len: U32::new(u32::try_from(bytes.len()).expect("content fits u32")),
                        reserved: U32::new(0),
                    })
                    .raw(bytes);
            }
            Record::Commit {
                seq,
                journal,
                begin,
                end,
                fragment_sha1,
                registers,
            } => {
                out.fixed(&head(kind::COMMIT, *seq))
                    .str16(journal)
                    .fixed(&CommitFixed {
                        begin: U64::new(*begin),
                        end: U64::new(*end),
                        sha1: *fragment_sha1,
                        reserved: [0; 4],
                    })
                    .labels(registers);
            }
            Record::Rollback { seq, journal } => {
                out.fixed(&head(kind::ROLLBACK, *seq)).str16(journal);
            }
        }
    }
}

/// Decodes every record of a REPLICATE payload.
pub fn decode_records(payload: &[u8]) -> Result<Vec<Record<'_>>, WireError> {
    let mut r = MetaReader::new(payload);
    let mut out = Vec::new();
    while !r.is_empty() {
        let head: RecordHead = r.fixed("record head")?;
        let seq = head.seq.get();
        let journal = r.str16("record journal")?;
        let rec = match head.kind {
            kind::CONTENT => {
                let f: ContentFixed = r.fixed("content record")?;
                let bytes = r.bytes(f.len.get() as usize, "content bytes")?;
                Record::Content {
                    seq,
                    journal,
                    offset: f.offset.get(),
                    bytes,
                }
            }
            kind::COMMIT => {
                let f: CommitFixed = r.fixed("commit record")?;
                let registers = r.labels("commit registers")?;
                Record::Commit {
                    seq,
                    journal,
                    begin: f.begin.get(),
                    end: f.end.get(),
                    fragment_sha1: f.sha1,
                    registers,
                }
            }
            kind::ROLLBACK => Record::Rollback { seq, journal },
            _ => return Err(WireError::Truncated("record kind")),
        };
        out.push(rec);
    }
    Ok(out)
}

#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
struct AckFixed {
    seq: U64,
    status: U16,
    reserved: U16,
    body_len: U32,
}

/// A replica's answer to one commit or SYNC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ack {
    pub seq: u64,
    pub status: Status,
    /// A message for failures; the JSON [`SyncReply`] for SYNC.
    pub body: Vec<u8>,
}

pub fn encode_acks(acks: &[Ack]) -> Vec<u8> {
    let mut w = MetaWriter::new();
    for a in acks {
        w.fixed(&AckFixed {
            seq: U64::new(a.seq),
            status: U16::new(a.status as u16),
            reserved: U16::new(0),
            body_len: U32::new(a.body.len() as u32),
        })
        .raw(&a.body);
    }
    w.into_payload()
}

pub fn decode_acks(payload: &[u8]) -> Result<Vec<Ack>, WireError> {
    let mut r = MetaReader::new(payload);
    let mut out = Vec::new();
    while !r.is_empty() {
        let f: AckFixed = r.fixed("ack")?;
        let status =
            Status::from_code(f.status.get()).ok_or(WireError::UnknownStatus(f.status.get()))?;
        let body = r.bytes(f.body_len.get() as usize, "ack body")?.to_vec();
        out.push(Ack {
            seq: f.seq.get(),
            status,
            body,
        });
    }
    Ok(out)
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// SYNC's JSON payload: the primary's view of a journal. The replica seals
/// its open spool and starts the next one at `head`, unless it disagrees.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncRequest {
    pub seq: u64,
    pub journal: String,
    /// The journal's spec, so a replica that missed an APPLY learns it.
    pub spec: crate::spec::JournalSpec,
    /// The revision of `spec` (0 from brokers that predate revisions).
    #[serde(default)]
    pub revision: u64,
    /// Route member ids as the primary computes them, primary first.
    pub route: Vec<String>,
    /// In a cluster on etcd, the revision `route` was read at: a replica
    /// that has seen less waits for its watch to catch up before it
    /// compares routes. 0 outside etcd.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub route_revision: u64,
    pub head: u64,
    pub registers: LabelSet,
    /// Offsets where the primary's history was taken back and written
    /// again since (PROTOCOL.md §14.11): a replica holding bytes beyond one
    /// of them that it did not get from this SYNC's primary drops them
    /// from the lowest such offset before it follows.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub taken_back: Vec<u64>,
}

/// A replica's answer to SYNC (OK, WRONG_ROUTE or PROPOSAL_MISMATCH).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncReply {
    /// The replica's write head.
    pub head: u64,
    /// The route as the replica computes it.
    pub route: Vec<String>,
    /// The etcd revision the replica's `route` was read at (0 outside
    /// etcd): a primary told WRONG_ROUTE at a later revision than its own
    /// waits for its watch to reach it before it synchronizes again.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub route_revision: u64,
    /// The replica's registers (a primary rolling forward adopts them).
    #[serde(default)]
    pub registers: LabelSet,
    #[serde(default)]
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let regs = LabelSet::from_pairs([("owner", "w1")]).unwrap();
        let recs = vec![
            Record::Content {
                seq: 7,
                journal: "a/b",
                offset: 4096,
                bytes: b"hello",
            },
            Record::Commit {
                seq: 7,
                journal: "a/b",
                begin: 4096,
                end: 4101,
                fragment_sha1: [3; 20],
                registers: regs,
            },
            Record::Rollback {
                seq: 8,
                journal: "c",
            },
        ];
        let mut w = MetaWriter::new();
        for r in &recs {
            r.encode(&mut w);
        }
        let bytes = w.into_payload();
        assert_eq!(decode_records(&bytes).unwrap(), recs);
        for cut in 1..bytes.len() {
            // Every truncation either fails or decodes a prefix of whole records.
            if let Ok(v) = decode_records(&bytes[..cut]) {
                assert!(v.len() < recs.len());
            }
        }
        let acks = vec![
            Ack {
                seq: 7,
                status: Status::OK,
                body: vec![],
            },
            Ack {
                seq: 9,
                status: Status::PROPOSAL_MISMATCH,
                body: b"sha differs".to_vec(),
            },
        ];
        assert_eq!(decode_acks(&encode_acks(&acks)).unwrap(), acks);
    }
}
