//! A broker as the allocator sees it: the value of its member key, and the
//! allocator's snapshot over brokers.

use rotary_allocator::MemberValue;

/// A broker's own spec, the value of its member key.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemberSpec {
    /// Where clients reach the broker's shard 0 (`HOST:PORT`).
    pub endpoint: String,
    /// The broker's shard count.
    pub shards: u32,
    /// Most journals the broker holds (primaries and replicas together).
    pub journal_limit: u32,
    /// Set when the broker is leaving: it is given nothing new and its
    /// journals move away, replacements first.
    #[serde(default)]
    pub exiting: bool,
}

impl MemberValue for MemberSpec {
    fn limit(&self) -> u32 {
        self.journal_limit
    }

    fn exiting(&self) -> bool {
        self.exiting
    }
}

/// The allocator's key space of a broker cluster: journals on brokers.
pub type Snapshot = rotary_allocator::Snapshot<MemberSpec>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_brokers_member_value_decodes_as_brokers_write_it() {
        let mut s = Snapshot::new("/rotary/", 10);
        let spec = br#"{"endpoint":"10.0.0.1:7401","shards":4,"journal_limit":100}"#;
        let m = s
            .put_member("/rotary/members/zone-a#b1", spec, 5, 7, 42)
            .unwrap();
        assert_eq!(s.members[&m].spec.journal_limit, 100);
        assert_eq!(s.members[&m].spec.shards, 4);
        assert_eq!(s.members[&m].spec.capacity(), 100);
        let exiting = br#"{"endpoint":"e:1","shards":1,"journal_limit":9,"exiting":true}"#;
        let m = s
            .put_member("/rotary/members/zone-a#b2", exiting, 6, 8, 43)
            .unwrap();
        assert_eq!(s.members[&m].spec.capacity(), 0);
        let unknown = br#"{"endpoint":"e:1","shards":1,"journal_limit":9,"colour":"red"}"#;
        assert!(s
            .put_member("/rotary/members/zone-a#b3", unknown, 6, 8, 43)
            .is_err());
    }
}
