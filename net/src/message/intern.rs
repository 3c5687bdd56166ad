//! Small indices for the journals and (journal, producer) pairs a
//! [`Sequencer`](super::Sequencer) tracks, so that a message costs at most
//! one hash lookup and no copy of its journal's name.
//!
//! Indices are dense, start at 0, and are never reused or removed: a
//! sequencer tracks every journal and producer it has seen for as long as
//! it lives (its checkpoint names them all).

use super::uuid::ProducerId;
use std::collections::HashMap;
use std::sync::Arc;

/// A fast hasher, seeded per process: keys come from journal bytes, and
/// a seed an attacker cannot guess keeps collisions from being forced.
type Hasher = foldhash::fast::RandomState;

/// Journal names to indices.
#[derive(Debug, Default)]
pub(crate) struct JournalIndex {
    names: Vec<Arc<str>>,
    by_name: HashMap<Arc<str>, u32, Hasher>,
    /// The name last looked up by its allocation, and its index. Envelopes
    /// of one journal read share their journal's `Arc`, so most lookups
    /// compare one pointer. Holding the `Arc` keeps its address from being
    /// reused by another name.
    last: Option<(Arc<str>, u32)>,
}

impl JournalIndex {
    /// The index of `name`, interned if new.
    pub(crate) fn index(&mut self, name: &Arc<str>) -> u32 {
        if let Some((last, i)) = &self.last {
            if Arc::ptr_eq(last, name) {
                return *i;
            }
        }
        let i = self.intern(name);
        self.last = Some((name.clone(), i));
        i
    }

    /// The index of `name`, interned if new (without touching the cache of
    /// [`JournalIndex::index`]).
    pub(crate) fn intern(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.by_name.get(name) {
            return i;
        }
        let i = u32::try_from(self.names.len()).expect("fewer than 2^32 journals");
        let name: Arc<str> = name.into();
        self.names.push(name.clone());
        self.by_name.insert(name, i);
        i
    }

    /// The index of `name`, if it was interned.
    pub(crate) fn get(&self, name: &str) -> Option<u32> {
        self.by_name.get(name).copied()
    }

    pub(crate) fn name(&self, index: u32) -> &Arc<str> {
        &self.names[index as usize]
    }

    pub(crate) fn len(&self) -> usize {
        self.names.len()
    }
}

/// (journal index, producer) pairs to indices.
#[derive(Debug, Default)]
pub(crate) struct ProducerIndex {
    keys: Vec<(u32, ProducerId)>,
    by_key: HashMap<(u32, ProducerId), u32, Hasher>,
    /// The pair last looked up and its index: a producer's messages tend
    /// to come in runs (a transaction's messages in one read).
    last: Option<((u32, ProducerId), u32)>,
}

impl ProducerIndex {
    /// The index of `(journal, producer)`, and whether it is new.
    pub(crate) fn index(&mut self, journal: u32, producer: ProducerId) -> (u32, bool) {
        let key = (journal, producer);
        if let Some((last, i)) = self.last {
            if last == key {
                return (i, false);
            }
        }
        let next = u32::try_from(self.keys.len()).expect("fewer than 2^32 producers");
        let i = *self.by_key.entry(key).or_insert(next);
        let new = i == next;
        if new {
            self.keys.push(key);
        }
        self.last = Some((key, i));
        (i, new)
    }

    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    /// The (journal index, producer) of an index.
    pub(crate) fn key(&self, index: u32) -> (u32, ProducerId) {
        self.keys[index as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn journals_intern_by_name_whatever_the_allocation() {
        let mut j = JournalIndex::default();
        let a1: Arc<str> = "a/j".into();
        let a2: Arc<str> = "a/j".into();
        let b: Arc<str> = "b/j".into();
        assert_eq!(j.index(&a1), 0);
        assert_eq!(j.index(&a1), 0, "the cached allocation");
        assert_eq!(j.index(&b), 1);
        assert_eq!(j.index(&a2), 0, "another allocation of the same name");
        assert_eq!(j.intern("c/j"), 2);
        assert_eq!(j.intern("b/j"), 1);
        assert_eq!(
            (j.get("a/j"), j.get("c/j"), j.get("d/j")),
            (Some(0), Some(2), None)
        );
        assert_eq!(
            (&**j.name(0), &**j.name(1), &**j.name(2)),
            ("a/j", "b/j", "c/j")
        );
        assert_eq!(j.len(), 3);
    }

    #[test]
    fn a_journal_name_dropped_and_reallocated_still_finds_its_index() {
        let mut j = JournalIndex::default();
        for round in 0..100 {
            // Each round's names are fresh allocations; an address reused
            // by the allocator must never pass for the cached name.
            let name: Arc<str> = format!("j/{}", round % 3).into();
            assert_eq!(j.index(&name), round % 3);
        }
        assert_eq!(j.len(), 3);
    }

    #[test]
    fn producers_are_per_journal() {
        let p = ProducerId([1, 0, 0, 0, 0, 0xa]);
        let q = ProducerId([1, 0, 0, 0, 0, 0xb]);
        let mut x = ProducerIndex::default();
        assert_eq!(x.index(0, p), (0, true));
        assert_eq!(x.index(0, p), (0, false), "cached");
        assert_eq!(
            x.index(1, p),
            (1, true),
            "the same producer in another journal"
        );
        assert_eq!(x.index(0, q), (2, true));
        assert_eq!(x.index(0, p), (0, false), "looked up, not cached");
        assert_eq!(x.index(1, p), (1, false));
        assert_eq!((x.key(0), x.key(1), x.key(2)), ((0, p), (1, p), (0, q)));
    }
}
