//! Store fragments that a broker's journal indexes judged not to hold
//! their journals' committed history (they overlap another fragment with
//! other bytes, PROTOCOL §7), for PRUNE to delete.
//!
//! Each journal's index lives on the one shard that owns the journal, but
//! PRUNE is answered by whichever shard a client reaches: the owning shard
//! writes its journal's list here whenever its judgement changes, and the
//! shard that prunes reads it. Written and read rarely (at listings and
//! prunes), never on the data path, so a lock will do.

use crate::StoredFragment;
use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

/// The conflicting fragments of each journal, with why each is one.
#[derive(Default, Debug)]
pub struct Conflicts {
    by_journal: Mutex<HashMap<String, Vec<(StoredFragment, String)>>>,
}

impl Conflicts {
    /// Replaces what is known of `journal` (an empty list forgets it).
    pub fn set(&self, journal: &str, fragments: Vec<(StoredFragment, String)>) {
        let mut map = self
            .by_journal
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if fragments.is_empty() {
            map.remove(journal);
        } else {
            map.insert(journal.to_string(), fragments);
        }
    }

    /// The conflicting fragments of `journal`, with why.
    pub fn of(&self, journal: &str) -> Vec<(StoredFragment, String)> {
        let map = self
            .by_journal
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        map.get(journal).cloned().unwrap_or_default()
    }

    /// Forgets one fragment (deleted from its store).
    pub fn remove(&self, f: &StoredFragment) {
        let mut map = self
            .by_journal
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(list) = map.get_mut(&f.journal) {
            list.retain(|(c, _)| !(c.store == f.store && c.key == f.key));
            if list.is_empty() {
                map.remove(&f.journal);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(journal: &str, key: &str) -> StoredFragment {
        StoredFragment {
            journal: journal.into(),
            begin: 0,
            end: 4,
            sha1: [1; 20],
            codec: rotary_proto::spec::Codec::None,
            store: "file:///s/".into(),
            key: key.into(),
            size: 4,
            mod_time: std::time::SystemTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn a_journals_list_is_replaced_and_emptied() {
        let c = Conflicts::default();
        c.set(
            "a",
            vec![
                (f("a", "a/1"), "why 1".into()),
                (f("a", "a/2"), "why 2".into()),
            ],
        );
        c.set("b", vec![(f("b", "b/1"), "why b".into())]);
        assert_eq!(c.of("a").len(), 2);
        c.remove(&f("a", "a/1"));
        assert_eq!(c.of("a"), vec![(f("a", "a/2"), "why 2".to_string())]);
        c.set("b", Vec::new());
        assert!(c.of("b").is_empty());
        c.remove(&f("a", "a/2"));
        assert!(c.by_journal.lock().unwrap().is_empty());
    }
}
