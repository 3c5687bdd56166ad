//! Admission: whether a journal's appends stage now, wait, or are refused:
//! the append at the front of its queue before it starts, and each chunk
//! of the open append as it arrives. A pure function ([`admit`]) of the
//! journal's state, what is asked about ([`Next`]), what its shard knows
//! (its role, the batches in flight, its upload backlog) and the time; the
//! flusher acts on the answer (see `Shard::stage_queue`) and charges the
//! rate for what it staged.

use super::*;
use crate::append::AppendOp;
use rotary_net::status::Status;

/// Batches of one journal proposed to replicas and not yet acknowledged.
pub const INFLIGHT_BATCHES_MAX: usize = 16;

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
    /// A primary whose route names replicas: its appends wait for a SYNC
    /// of them and for their acks.
    pub replicated: bool,
    /// Replicated batches of the journal in flight to its replicas.
    pub inflight: usize,
    /// Sealed bytes of journals with stores not yet in their store, and
    /// the shard's budget of them.
    pub unuploaded_bytes: u64,
    pub spool_budget_bytes: u64,
    /// The last upload error, named in refusals while the budget is spent.
    pub store_error: Option<&'a str>,
}

/// What admission is asked about.
#[derive(Clone, Copy)]
pub enum Next<'a> {
    /// The journal itself, before anything of it stages in a turn:
    /// whether it stages at all (a primary's gates, which hold back an
    /// open append as they hold back a new one).
    Journal,
    /// `op`, the first queued append, before it starts staging.
    Append(&'a AppendOp),
    /// The next `len` bytes that arrived of `op`, the open append.
    Chunk { op: &'a AppendOp, len: u64 },
}

/// What to do with what was asked about.
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
    /// Wait until the journal's peers ready it: the acker, once replicas
    /// acknowledged batches in flight, or the end of a SYNC. `again`: a
    /// SYNC is due and none of that is under way to ready it, so stage
    /// again in this turn (whose `prepare` starts the SYNC).
    AwaitPeers { again: bool },
    /// Wait until `until`, when the journal's rate lets a byte go again.
    AwaitRate { until: Instant },
    /// Move the write head forward to `to`, the end of the fragment index,
    /// then stage again in this turn: an append asked for exactly that
    /// offset.
    ResetHead { to: u64 },
    /// Go on: start staging the append (or, for [`Next::Journal`], the
    /// journal's appends).
    Stage,
    /// Stage this many of the chunk's bytes (at least one) now.
    StageUpTo(u64),
}

/// Decides on `next` of `jm` at `now`.
pub fn admit(jm: &Journal, next: Next<'_>, shard: &AdmitShard<'_>, now: Instant) -> Admission {
    if let Some(wait) = admit_primary(jm, shard) {
        return wait;
    }
    match next {
        Next::Journal => Admission::Stage,
        Next::Append(op) => admit_append(jm, op, shard, now),
        Next::Chunk { op, len } => admit_chunk(jm, op, len, now),
    }
}

/// The gates of a primary, before any of its journal's bytes stage, new
/// append or open: its replicas (or, taking the journal over, the brokers
/// of its earlier routes) must be synchronized and keep up.
fn admit_primary(jm: &Journal, shard: &AdmitShard<'_>) -> Option<Admission> {
    let primary = &jm.primary;
    if primary.unconfirmed.is_some() {
        // Batches a replica did not acknowledge are taken back first,
        // whatever the journal's role now: nothing stages on their bytes.
        // The acker readies the journal once none is in flight; then the
        // next turn's prepare takes them back.
        return Some(Admission::AwaitPeers {
            again: shard.inflight == 0,
        });
    }
    if shard.role != AdmitRole::Primary {
        return None;
    }
    if shard.replicated && primary.repl.is_none() {
        // A SYNC is due (say, the spool was just sealed): the next turn's
        // prepare starts it. One under way readies the journal when it
        // ends, and so does the acker for batches in flight.
        return Some(Admission::AwaitPeers {
            again: !primary.syncing && shard.inflight == 0 && !jm.queue.waiting.is_empty(),
        });
    }
    if primary.syncing {
        // A primary without replicas syncs only to take the journal
        // over: the brokers of its earlier routes may hold bytes beyond
        // its head, and nothing is staged at offsets they may have given
        // out. The SYNC readies the journal when it ends.
        return Some(Admission::AwaitPeers { again: false });
    }
    if shard.replicated && shard.inflight >= INFLIGHT_BATCHES_MAX {
        // Replicas catch up first (the acker readies the journal).
        return Some(Admission::AwaitPeers { again: false });
    }
    None
}

/// The rules of the open append's next `len` bytes: a client's go at the
/// journal's `max_append_rate`; the rest wait in their chunk (and the
/// connection's budget holds the client back) while its connection goes
/// on serving. A replica's were admitted by its primary.
fn admit_chunk(jm: &Journal, op: &AppendOp, len: u64, now: Instant) -> Admission {
    assert!(len > 0, "an empty chunk is not staged");
    if op.replica.is_some() {
        return Admission::StageUpTo(len);
    }
    match jm.queue.rate.available(now) {
        Ok(n) => Admission::StageUpTo(len.min(n)),
        Err(wait) => Admission::AwaitRate { until: now + wait },
    }
}

/// The rules of `op`, the first queued append, before it starts staging.
fn admit_append(jm: &Journal, op: &AppendOp, shard: &AdmitShard<'_>, now: Instant) -> Admission {
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
        let full = spooled >= jm.spec.fragment.length;
        let backoff = jm.files.seal_backoff(now);
        if let Some(retry) = backoff.filter(|_| full) {
            // The spool is to roll first, and its seal failed a moment
            // ago: waiting for the retry would hold the append (and the
            // journal's queue) for as long as the failure lasts.
            return refuse(
                Status::IO_ERROR,
                format!(
                    "the journal's spool is full and sealing it failed ({}); the seal is tried again shortly",
                    retry.error
                ),
            );
        }
        // A seal asked for while one backs off waits for the retry; the
        // spool still has room meanwhile.
        if full || (jm.files.seal_requested && backoff.is_none()) {
            return Admission::Seal {
                again: shard.inflight == 0,
            };
        }
        if jm.has_stores() {
            if let Some(a) = admit_stores(jm, op.req.expect_offset, shard) {
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

/// The rules of a client's append to a journal with stores (`expect`: the
/// offset it asks for, if any): its index is listed, ends within the write
/// head (or the append asks for exactly the index's end, which moves the
/// head there), and uploads keep up.
fn admit_stores(jm: &Journal, expect: Option<u64>, shard: &AdmitShard<'_>) -> Option<Admission> {
    if !jm.index.loaded {
        return Some(match &jm.index.error {
            // Wait for the first listing: the store may hold offsets
            // beyond the local head.
            None => Admission::AwaitListing {
                hurry: !jm.index.listings.running && !jm.index.listings.hurried,
            },
            Some(e) => refuse(
                Status::FRAGMENT_STORE_UNHEALTHY,
                format!("fragment index not yet listed: {e}"),
            ),
        });
    }
    let remote_end = jm.index.remote_end();
    if remote_end > jm.heads.staged_head() {
        return Some(beyond_head(jm, remote_end, expect));
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

/// An append to a journal whose fragment index ends at `remote_end`,
/// beyond its write head (history this broker's copy lacks: consistency
/// was lost, or the broker started on an empty disk). As in Gazette, an
/// append without an offset is refused, one asking for another offset
/// than `remote_end` too, and one asking for exactly `remote_end` moves the
/// head there first.
fn beyond_head(jm: &Journal, remote_end: u64, expect: Option<u64>) -> Admission {
    let head = jm.heads.staged_head();
    match expect {
        None => refuse(
            Status::INDEX_HAS_GREATER_OFFSET,
            format!(
                "the fragment index ends at {remote_end}, beyond the write head {head}; run `rotary journals reset-head {}`, or append with offset {remote_end}",
                jm.name
            ),
        ),
        Some(o) if o != remote_end => refuse(
            Status::WRONG_APPEND_OFFSET,
            format!(
                "expected offset {o} but the journal ends at {remote_end} (its fragment index, beyond the write head {head})"
            ),
        ),
        Some(_) if jm.index.reset_asked == Some(remote_end) => refuse(
            Status::INDEX_HAS_GREATER_OFFSET,
            format!(
                "the write head {head} could not be moved to the fragment index's end {remote_end}; see the broker's log"
            ),
        ),
        Some(_) => Admission::ResetHead { to: remote_end },
    }
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
    use crate::append::{AbortReason, PrimaryRepl};
    use crate::clock::{install, Clock};
    use rotary_net::spec::LabelSelector;
    use rotary_net::wire::AppendRequest;

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
        let req = AppendRequest {
            journal: "a/b".into(),
            ..Default::default()
        };
        let budget = Rc::new(crate::budget::Budget::default());
        let op = AppendOp::new(7, outbox.clone(), req, false, budget);
        match replica {
            true => op.for_replica(crate::append::AckSink::new(outbox)),
            false => op,
        }
    }

    fn primary() -> AdmitShard<'static> {
        AdmitShard {
            role: AdmitRole::Primary,
            replicated: false,
            inflight: 0,
            unuploaded_bytes: 0,
            spool_budget_bytes: 1 << 30,
            store_error: None,
        }
    }

    /// Admission of `op` as the first queued append of `jm`.
    fn start(jm: &Journal, op: &AppendOp, shard: &AdmitShard<'_>) -> Admission {
        admit(jm, Next::Append(op), shard, crate::clock::now())
    }

    /// What `every_ask` answers for an append of 10 bytes admitted whole.
    fn stages_all_10() -> [Admission; 3] {
        [Admission::Stage, Admission::Stage, Admission::StageUpTo(10)]
    }

    /// A client's append to a primary of the default shard.
    fn client(jm: &Journal) -> Admission {
        start(jm, &op(false), &primary())
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
            start(&journal(false), &op(false), &primary()),
            Admission::Stage
        );
        let replica = AdmitShard {
            role: AdmitRole::Replica,
            ..primary()
        };
        assert_eq!(
            start(&journal(false), &op(true), &replica),
            Admission::Stage
        );
    }

    #[test]
    fn aborted_and_answered_appends_are_dropped() {
        let a = op(false);
        a.aborted.set(Some(AbortReason::Closed));
        assert_eq!(start(&journal(false), &a, &primary()), Admission::Drop);
        let b = op(false);
        b.finished.set(true);
        assert_eq!(start(&journal(false), &b, &primary()), Admission::Drop);
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
            status(start(&j, &op(false), &replica)),
            (Status::NOT_JOURNAL_PRIMARY_BROKER, false)
        );
        assert_eq!(
            status(start(&j, &op(false), &other)),
            (Status::NOT_JOURNAL_PRIMARY_BROKER, false)
        );
        assert_eq!(
            status(start(&j, &op(true), &primary())),
            (Status::WRONG_ROUTE, false)
        );
    }

    #[test]
    fn a_seal_comes_first_once_requested_or_the_fragment_is_full() {
        let mut j = journal(false);
        j.files.seal_requested = true;
        assert_eq!(client(&j), Admission::Seal { again: true });
        let busy = AdmitShard {
            inflight: 2,
            ..primary()
        };
        assert_eq!(
            start(&j, &op(false), &busy),
            Admission::Seal { again: false }
        );
        // A replica's copy follows its primary, which rolls for it.
        let replica = AdmitShard {
            role: AdmitRole::Replica,
            ..primary()
        };
        assert_eq!(start(&j, &op(true), &replica), Admission::Stage);
        let mut full = journal(false);
        full.spec.fragment.length = 0;
        assert_eq!(client(&full), Admission::Seal { again: true });
    }

    #[test]
    fn a_journal_with_stores_waits_for_its_first_listing() {
        let mut j = journal(true);
        j.index.loaded = false;
        assert_eq!(client(&j), Admission::AwaitListing { hurry: true });
        j.index.listings.running = true;
        assert_eq!(client(&j), Admission::AwaitListing { hurry: false });
        j.index.error = Some("store down".into());
        assert_eq!(
            status(client(&j)),
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
            status(client(&j)),
            (Status::INDEX_HAS_GREATER_OFFSET, false)
        );
        // An explicit offset other than the index's end is the wrong one
        // (the head, too); exactly the end moves the head there, once.
        let at = |j: &Journal, offset: u64| {
            let mut a = op(false);
            a.req.expect_offset = Some(offset);
            start(j, &a, &primary())
        };
        assert_eq!(status(at(&j, 100)), (Status::WRONG_APPEND_OFFSET, false));
        assert_eq!(status(at(&j, 199)), (Status::WRONG_APPEND_OFFSET, false));
        assert_eq!(at(&j, 200), Admission::ResetHead { to: 200 });
        j.index.reset_asked = Some(200);
        assert_eq!(
            status(at(&j, 200)),
            (Status::INDEX_HAS_GREATER_OFFSET, false),
            "a head that did not move is not asked to again"
        );
        j.set_staged_head(200);
        assert_eq!(at(&j, 200), Admission::Stage);
        assert_eq!(client(&j), Admission::Stage);
    }

    #[test]
    fn a_spent_upload_budget_refuses_with_the_store_error() {
        let spent = AdmitShard {
            unuploaded_bytes: 10,
            spool_budget_bytes: 5,
            store_error: Some("access denied"),
            ..primary()
        };
        match start(&journal(true), &op(false), &spent) {
            Admission::Refuse {
                status, message, ..
            } => {
                assert_eq!(status, Status::FRAGMENT_STORE_UNHEALTHY);
                assert!(message.ends_with("access denied"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        // Journals without stores do not wait on uploads.
        assert_eq!(start(&journal(false), &op(false), &spent), Admission::Stage);
    }

    #[test]
    fn an_expected_offset_must_be_the_write_head() {
        let mut a = op(false);
        a.req.expect_offset = Some(99);
        assert_eq!(
            status(start(&journal(false), &a, &primary())),
            (Status::WRONG_APPEND_OFFSET, false)
        );
        a.req.expect_offset = Some(100);
        assert_eq!(start(&journal(false), &a, &primary()), Admission::Stage);
        let mut r = op(true);
        r.req.expect_offset = Some(101);
        let replica = AdmitShard {
            role: AdmitRole::Replica,
            ..primary()
        };
        assert_eq!(
            status(start(&journal(false), &r, &replica)),
            (Status::PROPOSAL_MISMATCH, true)
        );
    }

    #[test]
    fn registers_must_match_the_selector() {
        let mut a = op(false);
        a.req.check_registers = LabelSelector::parse("owner=me").unwrap();
        assert_eq!(
            status(start(&journal(false), &a, &primary())),
            (Status::REGISTER_MISMATCH, false)
        );
        let mut j = journal(false);
        j.heads.set_staged_registers(
            rotary_net::spec::LabelSet::from_pairs([("owner", "me")]).unwrap(),
        );
        assert_eq!(start(&j, &a, &primary()), Admission::Stage);
    }

    /// A primary with replicas, synchronized with them.
    fn replicated() -> (Journal, AdmitShard<'static>) {
        let mut j = journal(false);
        j.primary.repl = Some(PrimaryRepl {
            members: vec!["a".into(), "b".into()],
            pipelines: Vec::new(),
            version: 1,
        });
        let shard = AdmitShard {
            replicated: true,
            ..primary()
        };
        (j, shard)
    }

    /// The answers to the journal itself, a new append and a chunk of
    /// `len` bytes of an open one, all at `now`.
    fn every_ask(
        j: &Journal,
        op: &AppendOp,
        len: u64,
        shard: &AdmitShard<'_>,
        now: Instant,
    ) -> [Admission; 3] {
        [
            admit(j, Next::Journal, shard, now),
            admit(j, Next::Append(op), shard, now),
            admit(j, Next::Chunk { op, len }, shard, now),
        ]
    }

    #[test]
    fn the_in_flight_limit_holds_new_and_open_appends_alike() {
        let now = crate::clock::now();
        let (j, shard) = replicated();
        let a = op(false);
        let at_limit = AdmitShard {
            inflight: INFLIGHT_BATCHES_MAX,
            ..shard
        };
        // The acker readies the journal once replicas catch up.
        let wait = || Admission::AwaitPeers { again: false };
        assert_eq!(
            every_ask(&j, &a, 10, &at_limit, now),
            [wait(), wait(), wait()]
        );
        let under = AdmitShard {
            inflight: INFLIGHT_BATCHES_MAX - 1,
            ..shard
        };
        assert_eq!(every_ask(&j, &a, 10, &under, now), stages_all_10());
        // Without replicas nothing is in flight to wait for.
        let alone = AdmitShard {
            replicated: false,
            ..at_limit
        };
        assert_eq!(every_ask(&j, &a, 10, &alone, now), stages_all_10());
    }

    #[test]
    fn a_sync_due_holds_the_journal_until_it_is_made() {
        let now = crate::clock::now();
        let (mut j, shard) = replicated();
        j.primary.repl = None;
        let a = op(false);
        // Nothing queued: nothing to stage again for.
        assert_eq!(
            admit(&j, Next::Journal, &shard, now),
            Admission::AwaitPeers { again: false }
        );
        // Queued, with nothing under way to ready the journal: the next
        // turn's prepare starts the SYNC.
        j.queue.waiting.push_back(Rc::new(op(false)));
        let due = || Admission::AwaitPeers { again: true };
        assert_eq!(every_ask(&j, &a, 10, &shard, now), [due(), due(), due()]);
        // A SYNC under way, or batches in flight, ready it themselves.
        let held = || Admission::AwaitPeers { again: false };
        let busy = AdmitShard {
            inflight: 1,
            ..shard
        };
        assert_eq!(every_ask(&j, &a, 10, &busy, now), [held(), held(), held()]);
        j.primary.syncing = true;
        assert_eq!(every_ask(&j, &a, 10, &shard, now), [held(), held(), held()]);
        // A replica's copy is not held by its own primary state.
        let replica = AdmitShard {
            role: AdmitRole::Replica,
            replicated: false,
            ..shard
        };
        let r = op(true);
        assert_eq!(every_ask(&j, &r, 10, &replica, now), stages_all_10());
    }

    #[test]
    fn a_primary_taking_the_journal_over_stages_nothing_while_it_syncs() {
        let now = crate::clock::now();
        let mut j = journal(false);
        let a = op(false);
        j.primary.syncing = true;
        let held = || Admission::AwaitPeers { again: false };
        assert_eq!(
            every_ask(&j, &a, 10, &primary(), now),
            [held(), held(), held()]
        );
        j.primary.syncing = false;
        assert_eq!(every_ask(&j, &a, 10, &primary(), now), stages_all_10());
    }

    /// A manual clock, installed, and a journal whose appends go at
    /// `rate` bytes a second.
    fn rated(rate: u64) -> (Clock, crate::clock::Installed, Journal) {
        let clock = Clock::manual();
        let installed = install(clock.clone());
        let mut j = journal(false);
        j.queue.rate.set_rate(rate);
        (clock, installed, j)
    }

    /// Admission of the next `len` bytes of `op`, the open append, now.
    fn ask_chunk(
        j: &Journal,
        op: &AppendOp,
        len: u64,
        shard: &AdmitShard<'_>,
        clock: &Clock,
    ) -> Admission {
        admit(j, Next::Chunk { op, len }, shard, clock.now())
    }

    #[test]
    fn a_rate_limited_chunk_stages_what_the_bucket_allows_or_waits() {
        let (clock, _installed, mut j) = rated(1000);
        let a = op(false);
        let chunk = |j: &Journal, len| ask_chunk(j, &a, len, &primary(), &clock);
        assert_eq!(chunk(&j, 600), Admission::StageUpTo(600));
        // Looking takes nothing: the flusher charges what it staged.
        assert_eq!(chunk(&j, 600), Admission::StageUpTo(600));
        j.queue.rate.take(600, clock.now());
        assert_eq!(chunk(&j, 600), Admission::StageUpTo(400));
        j.queue.rate.take(400, clock.now());
        // Spent: the next byte may go a thousandth of a second later.
        let Admission::AwaitRate { until } = chunk(&j, 600) else {
            panic!("{:?}", chunk(&j, 600));
        };
        let wait = until - clock.now();
        assert!(
            wait >= Duration::from_nanos(999_999) && wait <= Duration::from_nanos(1_000_001),
            "{wait:?}"
        );
        // Half way there, it still waits until then.
        clock.advance(Duration::from_micros(500));
        let Admission::AwaitRate { until: later } = chunk(&j, 600) else {
            panic!("{:?}", chunk(&j, 600));
        };
        assert!(
            later.max(until) - later.min(until) <= Duration::from_nanos(1),
            "{later:?} {until:?}"
        );
        clock.advance(Duration::from_micros(500));
        assert_eq!(chunk(&j, 600), Admission::StageUpTo(1));
    }

    #[test]
    fn a_replicas_chunk_is_never_rate_limited() {
        let (clock, _installed, mut j) = rated(1000);
        j.queue.rate.take(1000, clock.now());
        let replica = AdmitShard {
            role: AdmitRole::Replica,
            ..primary()
        };
        assert_eq!(
            ask_chunk(&j, &op(true), 5000, &replica, &clock),
            Admission::StageUpTo(5000)
        );
        // Its primary's client is.
        assert!(matches!(
            ask_chunk(&j, &op(false), 5000, &primary(), &clock),
            Admission::AwaitRate { .. }
        ));
    }

    #[test]
    fn the_bucket_refills_as_the_clock_advances() {
        let (clock, _installed, mut j) = rated(1000);
        let a = op(false);
        let chunk = |j: &Journal, len| ask_chunk(j, &a, len, &primary(), &clock);
        j.queue.rate.take(1000, clock.now());
        // The clock standing still, however often asked, nothing refills.
        assert!(matches!(chunk(&j, 600), Admission::AwaitRate { .. }));
        assert!(matches!(chunk(&j, 600), Admission::AwaitRate { .. }));
        clock.advance(Duration::from_millis(250));
        assert_eq!(chunk(&j, 600), Admission::StageUpTo(250));
        j.queue.rate.take(250, clock.now());
        // An idle minute refills no more than one second's worth.
        clock.advance(Duration::from_secs(60));
        assert_eq!(chunk(&j, 5000), Admission::StageUpTo(1000));
        // Unlimited, any chunk goes whole.
        j.queue.rate.set_rate(0);
        assert_eq!(chunk(&j, u64::MAX / 2), Admission::StageUpTo(u64::MAX / 2));
    }
}
