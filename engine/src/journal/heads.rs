//! A journal's heads and registers: what is staged, committed here, and
//! visible to readers.

use rotary_net::spec::LabelSet;

/// The journal's write heads and the registers as of each.
///
/// The heads keep `head <= local_head <= staged_head`. The fields are
/// private: they change only through the setters below, which assert that
/// order, in release builds too, and are read through the getters. Written
/// by the flusher (`shard/stage.rs` stages, `shard/flusher.rs` commits,
/// publishes and answers), by a replica's SYNC (`shard/replica.rs`), a
/// primary's takeover (`shard/primary.rs`), reset-head
/// (`shard/history.rs`) and recovery (`shard/recover.rs`, `shard/mod.rs`);
/// reads, admission and every reply read them.
#[derive(Default)]
pub struct Heads {
    /// Write head visible to readers: committed here and on every replica.
    head: u64,
    registers: LabelSet,
    /// Answered to appenders. Beyond `head` only while a batch answered
    /// from the commit log (see `Shard::answer_early`) waits for its spool
    /// write; readers of those bytes wait for it too. Only grows, through
    /// [`Self::answered_to`], never past `staged_head` when it does.
    answered: u64,
    /// Committed here (in the commit log); replicas may not have acked yet.
    local_head: u64,
    local_registers: LabelSet,
    /// Head and registers as of the last staged append.
    staged_head: u64,
    staged_registers: LabelSet,
}

impl Heads {
    /// Write head visible to readers: committed here and on every replica.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// The reply to an append refused or failed now: the head and the
    /// registers as they stand, so that the client can tell where to go on.
    pub fn refusal(&self) -> rotary_net::wire::AppendReply {
        rotary_net::wire::AppendReply {
            write_head: self.head(),
            registers: self.registers().clone(),
            ..Default::default()
        }
    }

    /// The registers as of [`Self::head`].
    pub fn registers(&self) -> &LabelSet {
        &self.registers
    }

    /// Answered to appenders (see the field).
    pub fn answered(&self) -> u64 {
        self.answered
    }

    /// Committed here (in the commit log); replicas may not have acked yet.
    pub fn local_head(&self) -> u64 {
        self.local_head
    }

    /// The registers as of [`Self::local_head`].
    pub fn local_registers(&self) -> &LabelSet {
        &self.local_registers
    }

    /// Head as of the last staged append.
    pub fn staged_head(&self) -> u64 {
        self.staged_head
    }

    /// The registers as of [`Self::staged_head`].
    pub fn staged_registers(&self) -> &LabelSet {
        &self.staged_registers
    }

    /// What is visible to readers was committed here, and what is committed
    /// here was staged. A programmer's error if not: asserted wherever a
    /// head changes.
    fn assert_order(&self, journal: &str) {
        assert!(
            self.head <= self.local_head && self.local_head <= self.staged_head,
            "journal {}: heads out of order: head {} local_head {} staged_head {}",
            journal,
            self.head,
            self.local_head,
            self.staged_head
        );
    }

    /// Sets every head to `offset` (see `Journal::set_heads`).
    pub(super) fn set_heads(&mut self, offset: u64, journal: &str) {
        self.head = offset;
        self.local_head = offset;
        self.staged_head = offset;
        self.assert_order(journal);
    }

    /// The staged appends now end at `end` (see `Journal::set_staged_head`).
    pub(super) fn set_staged_head(&mut self, end: u64, journal: &str) {
        self.staged_head = end;
        self.assert_order(journal);
    }

    /// Committed here up to `end` (see `Journal::commit_local_to`).
    pub(super) fn commit_local_to(&mut self, end: u64, journal: &str) {
        assert!(
            end >= self.local_head,
            "journal {journal}: commit to {end} behind local_head {}",
            self.local_head
        );
        self.local_head = end;
        self.assert_order(journal);
    }

    /// Visible up to `end` (see `Journal::publish_to`).
    pub(super) fn publish_to(&mut self, end: u64, journal: &str) {
        self.head = self.head.max(end);
        self.assert_order(journal);
    }

    /// Taken over up to `to` (see `Journal::take_over_to`).
    pub(super) fn take_over_to(&mut self, to: u64, journal: &str) {
        self.head = self.head.max(to);
        self.local_head = self.local_head.max(to);
        self.staged_head = self.local_head;
        self.assert_order(journal);
    }

    /// What is committed and staged here beyond `head` is taken back to
    /// it (see `Journal::take_back_to_head`). Nothing of it was answered.
    pub(super) fn take_back_to_head(&mut self, journal: &str) {
        assert!(
            self.answered <= self.head,
            "journal {journal}: taking back to {} what was answered up to {}",
            self.head,
            self.answered
        );
        self.local_head = self.head;
        self.staged_head = self.head;
        self.local_registers = self.registers.clone();
        self.staged_registers = self.registers.clone();
        self.assert_order(journal);
    }

    /// Answered up to `end` (see `Journal::answered_to`).
    pub(super) fn answered_to(&mut self, end: u64, journal: &str) {
        assert!(
            end <= self.staged_head,
            "journal {journal}: answered to {end} beyond staged_head {}",
            self.staged_head
        );
        self.answered = self.answered.max(end);
    }

    /// Every register set is `registers`: a journal recovered, or synced
    /// to (or taking over) the furthest history.
    pub fn set_registers(&mut self, registers: LabelSet) {
        self.local_registers = registers.clone();
        self.staged_registers = registers.clone();
        self.registers = registers;
    }

    /// The registers as of the last staged append.
    pub fn set_staged_registers(&mut self, registers: LabelSet) {
        self.staged_registers = registers;
    }

    /// The registers as of the last append committed here.
    pub fn set_local_registers(&mut self, registers: LabelSet) {
        self.local_registers = registers;
    }

    /// The registers as of the last append visible to readers.
    pub fn publish_registers(&mut self, registers: LabelSet) {
        self.registers = registers;
    }

    /// What was staged beyond the local commit is undone: the staged head
    /// and registers go back to those committed here.
    pub(super) fn unstage(&mut self, journal: &str) {
        self.set_staged_head(self.local_head, journal);
        self.staged_registers = self.local_registers.clone();
    }
}
