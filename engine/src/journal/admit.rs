//! Admission: whether the next append queued on a journal starts staging
//! now, waits, or is refused. A pure function of the journal's state, the
//! append and what its shard knows (its role, its upload backlog): the
//! flusher acts on the answer (see `Shard::stage_queue`).

use super::*;
use crate::append::AppendOp;
use rotary_net::status::Status;

/// The shard's role for the journal, by its current route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdmitRole {
    Primary,
    Replica,
    /// Neither: the route moved elsewhere.
    Other,
}

/// What the shard knows beyond the journal.
#[derive(Clone, Copy, Debug)]
pub struct AdmitShard<'a> {
    pub role: AdmitRole,
    /// Replicated batches of the journal in flight to its replicas.
    pub inflight: usize,
    /// Sealed bytes of journals with stores not yet in their store, and
    /// the shard's budget of them.
    pub unuploaded_bytes: u64,
    pub spool_budget_bytes: u64,
    /// The last upload error, named in refusals while the budget is spent.
    pub store_error: Option<&'a str>,
}

/// What to do with the append at the front of the queue.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    /// Aborted or answered already: drop it without a reply.
    Drop,
    /// Refuse it. `diverged`: a replica's copy no longer continues where
    /// this replica stands (it needs a SYNC before it takes more).
    Refuse {
        status: Status,
        message: String,
        diverged: bool,
    },
    /// Roll to a new fragment first, once this batch commits (and what is
    /// in flight is acknowledged). `again`: stage again in this turn.
    Seal { again: bool },
    /// Wait for the journal's first store listing; `hurry` it.
    AwaitListing { hurry: bool },
    /// Start staging it.
    Stage,
}

/// Decides on `op`, the first queued append of `jm`.
pub fn admit(jm: &Journal, op: &AppendOp, shard: &AdmitShard<'_>) -> Admission {
    if op.aborted.get().is_some() || op.finished.get() {
        return Admission::Drop;
    }
    let is_replica_op = op.replica.is_some();
    // A client's append is staged only by the primary, a primary's only
    // by a replica: the route may have changed while it waited (a broker
    // no longer the primary must not add bytes the new primary never
    // hears of).
    if is_replica_op && shard.role != AdmitRole::Replica {
        return refuse(
            Status::WRONG_ROUTE,
            "this broker is not a replica of the journal".into(),
        );
    }
    if !is_replica_op && shard.role != AdmitRole::Primary {
        return refuse(
            Status::NOT_JOURNAL_PRIMARY_BROKER,
            "the journal's route changed; this broker is no longer its primary".into(),
        );
    }
    if !is_replica_op {
        let spooled = jm
            .files
            .spool
            .as_ref()
            .map_or(0, |s| s.staged() - s.begin());
        if spooled >= jm.spec.fragment.length || jm.files.seal_requested {
            return Admission::Seal {
                again: shard.inflight == 0,
            };
        }
        if jm.has_stores() {
            if let Some(a) = admit_stores(jm, shard) {
                return a;
            }
        }
    }
    let req = &op.req;
    if let Some(expect) = req.expect_offset {
        if expect != jm.heads.staged_head() {
            let message = format!(
                "expected offset {expect} but the write head is {}",
                jm.heads.staged_head()
            );
            if is_replica_op {
                return Admission::Refuse {
                    status: Status::PROPOSAL_MISMATCH,
                    message,
                    diverged: true,
                };
            }
            return refuse(Status::WRONG_APPEND_OFFSET, message);
        }
    }
    if !req.check_registers.is_empty() && !req.check_registers.matches(jm.heads.staged_registers())
    {
        let message = format!(
            "registers {{{}}} do not match selector {{{}}}",
            jm.heads.staged_registers(),
            req.check_registers.to_text()
        );
        return refuse(Status::REGISTER_MISMATCH, message);
    }
    Admission::Stage
}

/// The rules of a client's append to a journal with stores: its index is
/// listed, ends within the write head, and uploads keep up.
fn admit_stores(jm: &Journal, shard: &AdmitShard<'_>) -> Option<Admission> {
    if !jm.index.loaded {
        return Some(match &jm.index.error {
            // Wait for the first listing: the store may hold offsets
            // beyond the local head.
            None => Admission::AwaitListing {
                hurry: !jm.index.listing && !jm.index.listing_hurried,
            },
            Some(e) => refuse(
                Status::FRAGMENT_STORE_UNHEALTHY,
                format!("fragment index not yet listed: {e}"),
            ),
        });
    }
    let remote_end = jm.index.remote_end();
    if remote_end > jm.heads.staged_head() {
        let message = format!(
            "the fragment index ends at {remote_end}, beyond the write head {}; run `rotary journals reset-head {}`",
            jm.heads.staged_head(), jm.name
        );
        return Some(refuse(Status::INDEX_HAS_GREATER_OFFSET, message));
    }
    if shard.unuploaded_bytes > shard.spool_budget_bytes {
        let cause = shard.store_error.unwrap_or(
            "no upload has reported a failure yet: uploads are behind appends, or still retrying against a store that does not answer",
        );
        let message = format!(
            "{} bytes of sealed fragments await upload (budget {}): {cause}",
            shard.unuploaded_bytes, shard.spool_budget_bytes
        );
        return Some(refuse(Status::FRAGMENT_STORE_UNHEALTHY, message));
    }
    None
}

fn refuse(status: Status, message: String) -> Admission {
    Admission::Refuse {
        status,
        message,
        diverged: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::append::{AbortReason, ReplicaOp};
    use rotary_net::spec::LabelSelector;
    use rotary_net::wire::AppendRequest;
    use std::collections::VecDeque;

    fn journal(stores: bool) -> Journal {
        let mut spec = JournalSpec::new("a/b");
        if stores {
            spec.fragment.stores = vec!["file:///tmp/store/".into()];
        }
        let mut jm = Journal::new(spec, PathBuf::from("/nonexistent"));
        jm.index.loaded = true;
        jm.set_staged_head(100);
        jm
    }

    fn op(replica: bool) -> AppendOp {
        let outbox = Rc::new(Outbox::new());
        AppendOp {
            request_id: 7,
            outbox: outbox.clone(),
            req: AppendRequest {
                journal: "a/b".into(),
                ..Default::default()
            },
            chunks: RefCell::new(VecDeque::new()),
            complete: Cell::new(false),
            aborted: Cell::new(None),
            finished: Cell::new(false),
            last_activity: Cell::new(crate::clock::now()),
            arrived: crate::clock::now(),
            budget: Rc::new(crate::budget::Budget::default()),
            replica: replica.then(|| ReplicaOp {
                sink: crate::append::AckSink::new(outbox),
                proposal: RefCell::new(None),
                content_done: Cell::new(false),
            }),
        }
    }

    fn primary() -> AdmitShard<'static> {
        AdmitShard {
            role: AdmitRole::Primary,
            inflight: 0,
            unuploaded_bytes: 0,
            spool_budget_bytes: 1 << 30,
            store_error: None,
        }
    }

    fn status(a: Admission) -> (Status, bool) {
        match a {
            Admission::Refuse {
                status, diverged, ..
            } => (status, diverged),
            other => panic!("not a refusal: {other:?}"),
        }
    }

    #[test]
    fn a_plain_append_on_the_primary_stages() {
        assert_eq!(
            admit(&journal(false), &op(false), &primary()),
            Admission::Stage
        );
        let replica = AdmitShard {
            role: AdmitRole::Replica,
            ..primary()
        };
        assert_eq!(
            admit(&journal(false), &op(true), &replica),
            Admission::Stage
        );
    }

    #[test]
    fn aborted_and_answered_appends_are_dropped() {
        let a = op(false);
        a.aborted.set(Some(AbortReason::Closed));
        assert_eq!(admit(&journal(false), &a, &primary()), Admission::Drop);
        let b = op(false);
        b.finished.set(true);
        assert_eq!(admit(&journal(false), &b, &primary()), Admission::Drop);
    }

    #[test]
    fn each_side_stages_only_in_its_own_role() {
        let other = AdmitShard {
            role: AdmitRole::Other,
            ..primary()
        };
        let replica = AdmitShard {
            role: AdmitRole::Replica,
            ..primary()
        };
        let j = journal(false);
        assert_eq!(
            status(admit(&j, &op(false), &replica)),
            (Status::NOT_JOURNAL_PRIMARY_BROKER, false)
        );
        assert_eq!(
            status(admit(&j, &op(false), &other)),
            (Status::NOT_JOURNAL_PRIMARY_BROKER, false)
        );
        assert_eq!(
            status(admit(&j, &op(true), &primary())),
            (Status::WRONG_ROUTE, false)
        );
    }

    #[test]
    fn a_seal_comes_first_once_requested_or_the_fragment_is_full() {
        let mut j = journal(false);
        j.files.seal_requested = true;
        assert_eq!(
            admit(&j, &op(false), &primary()),
            Admission::Seal { again: true }
        );
        let busy = AdmitShard {
            inflight: 2,
            ..primary()
        };
        assert_eq!(
            admit(&j, &op(false), &busy),
            Admission::Seal { again: false }
        );
        // A replica's copy follows its primary, which rolls for it.
        let replica = AdmitShard {
            role: AdmitRole::Replica,
            ..primary()
        };
        assert_eq!(admit(&j, &op(true), &replica), Admission::Stage);
        let mut full = journal(false);
        full.spec.fragment.length = 0;
        assert_eq!(
            admit(&full, &op(false), &primary()),
            Admission::Seal { again: true }
        );
    }

    #[test]
    fn a_journal_with_stores_waits_for_its_first_listing() {
        let mut j = journal(true);
        j.index.loaded = false;
        assert_eq!(
            admit(&j, &op(false), &primary()),
            Admission::AwaitListing { hurry: true }
        );
        j.index.listing = true;
        assert_eq!(
            admit(&j, &op(false), &primary()),
            Admission::AwaitListing { hurry: false }
        );
        j.index.error = Some("store down".into());
        assert_eq!(
            status(admit(&j, &op(false), &primary())),
            (Status::FRAGMENT_STORE_UNHEALTHY, false)
        );
    }

    #[test]
    fn an_index_beyond_the_head_refuses_until_reset() {
        let mut j = journal(true);
        j.index.insert_remote(rotary_uploader::StoredFragment {
            journal: "a/b".into(),
            begin: 100,
            end: 200,
            sha1: [1; 20],
            codec: rotary_net::spec::Codec::None,
            store: "file:///tmp/store/".into(),
            key: "a/b/x".into(),
            size: 100,
            mod_time: SystemTime::UNIX_EPOCH,
        });
        assert_eq!(
            status(admit(&j, &op(false), &primary())),
            (Status::INDEX_HAS_GREATER_OFFSET, false)
        );
    }

    #[test]
    fn a_spent_upload_budget_refuses_with_the_store_error() {
        let spent = AdmitShard {
            unuploaded_bytes: 10,
            spool_budget_bytes: 5,
            store_error: Some("access denied"),
            ..primary()
        };
        match admit(&journal(true), &op(false), &spent) {
            Admission::Refuse {
                status, message, ..
            } => {
                assert_eq!(status, Status::FRAGMENT_STORE_UNHEALTHY);
                assert!(message.ends_with("access denied"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        // Journals without stores do not wait on uploads.
        assert_eq!(admit(&journal(false), &op(false), &spent), Admission::Stage);
    }

    #[test]
    fn an_expected_offset_must_be_the_write_head() {
        let mut a = op(false);
        a.req.expect_offset = Some(99);
        assert_eq!(
            status(admit(&journal(false), &a, &primary())),
            (Status::WRONG_APPEND_OFFSET, false)
        );
        a.req.expect_offset = Some(100);
        assert_eq!(admit(&journal(false), &a, &primary()), Admission::Stage);
        let mut r = op(true);
        r.req.expect_offset = Some(101);
        let replica = AdmitShard {
            role: AdmitRole::Replica,
            ..primary()
        };
        assert_eq!(
            status(admit(&journal(false), &r, &replica)),
            (Status::PROPOSAL_MISMATCH, true)
        );
    }

    #[test]
    fn registers_must_match_the_selector() {
        let mut a = op(false);
        a.req.check_registers = LabelSelector::parse("owner=me").unwrap();
        assert_eq!(
            status(admit(&journal(false), &a, &primary())),
            (Status::REGISTER_MISMATCH, false)
        );
        let mut j = journal(false);
        j.heads.set_staged_registers(
            rotary_net::spec::LabelSet::from_pairs([("owner", "me")]).unwrap(),
        );
        assert_eq!(admit(&j, &a, &primary()), Admission::Stage);
    }
}
