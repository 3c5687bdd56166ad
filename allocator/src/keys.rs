//! The allocator's keys in etcd, in Gazette's layout, under a prefix:
//!
//! - `<prefix>/items/<item>`: an item's spec (no lease);
//! - `<prefix>/members/<zone>#<id>`: a member (under its own lease);
//! - `<prefix>/assign/<item>#<zone>#<id>#<slot>`: one assignment of an
//!   item to a member (under that member's lease); slot 0 is the primary.
//!
//! Items are journals (members are brokers) or a consumer application's
//! shards (members are its processes). `#` separates the parts, so no part
//! may contain it. An item name may contain `/`; zones and ids may not be
//! empty except the zone, which may (a member started without `--zone`). Slots are canonical decimals, so
//! that every key has exactly one spelling and parse ∘ format is the identity.

use std::fmt;

/// Where the keys of each kind live under the prefix.
pub const ITEMS: &str = "items/";
pub const MEMBERS: &str = "members/";
pub const ASSIGN: &str = "assign/";

/// Longest slot a key may carry. Slots are small (an item has a few
/// replicas); the bound keeps a corrupt key from looking like a slot.
pub const SLOT_MAX: u32 = 1 << 20;

/// A key or a part of one that does not follow the layout.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("key {key:?} is not under the prefix {prefix:?}")]
    NotUnderPrefix { key: String, prefix: String },
    #[error("key {key:?} is neither an item, a member nor an assignment")]
    UnknownKind { key: String },
    #[error("key {key:?}: {why}")]
    Malformed { key: String, why: &'static str },
    #[error("{what} {value:?}: {why}")]
    BadPart {
        what: &'static str,
        value: String,
        why: &'static str,
    },
}

/// A member's identity: its zone and its id. Ordered by zone, then id, as
/// their keys are.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MemberKey {
    pub zone: String,
    pub id: String,
}

impl MemberKey {
    /// A checked member identity.
    pub fn new(zone: &str, id: &str) -> Result<MemberKey, KeyError> {
        check_zone(zone)?;
        check_id(id)?;
        Ok(MemberKey {
            zone: zone.to_string(),
            id: id.to_string(),
        })
    }
}

/// `zone#id`, the member's part of its keys.
impl fmt::Display for MemberKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.zone, self.id)
    }
}

impl std::str::FromStr for MemberKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<MemberKey, KeyError> {
        let mut parts = s.split('#');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(zone), Some(id), None) => MemberKey::new(zone, id),
            _ => Err(KeyError::BadPart {
                what: "member",
                value: s.to_string(),
                why: "a member is `zone#id`, with exactly one `#`",
            }),
        }
    }
}

impl serde::Serialize for MemberKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for MemberKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<MemberKey, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// One assignment's key: item, member and slot. Ordered by item,
/// member, then slot (numerically).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AssignmentKey {
    pub item: String,
    pub member: MemberKey,
    pub slot: u32,
}

impl AssignmentKey {
    /// A checked assignment key.
    pub fn new(item: &str, member: MemberKey, slot: u32) -> Result<AssignmentKey, KeyError> {
        check_item(item)?;
        check_zone(&member.zone)?;
        check_id(&member.id)?;
        check_slot(slot)?;
        Ok(AssignmentKey {
            item: item.to_string(),
            member,
            slot,
        })
    }

    /// The same assignment at another slot.
    pub fn with_slot(&self, slot: u32) -> AssignmentKey {
        AssignmentKey {
            slot,
            ..self.clone()
        }
    }
}

/// `item#zone#id#slot`, the part after `assign/`.
impl fmt::Display for AssignmentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}#{}", self.item, self.member, self.slot)
    }
}

/// A parsed key of the allocator's key space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Key {
    Item(String),
    Member(MemberKey),
    Assignment(AssignmentKey),
}

/// The prefix without its trailing `/`s: `/rotary/` and `/rotary` are one
/// key space.
pub fn normalize_prefix(prefix: &str) -> &str {
    prefix.trim_end_matches('/')
}

/// `<prefix>/items/<item>`.
pub fn item_key(prefix: &str, item: &str) -> String {
    format!("{}/{ITEMS}{item}", normalize_prefix(prefix))
}

/// `<prefix>/members/<zone>#<id>`.
pub fn member_key(prefix: &str, member: &MemberKey) -> String {
    format!("{}/{MEMBERS}{member}", normalize_prefix(prefix))
}

/// `<prefix>/assign/<item>#<zone>#<id>#<slot>`.
pub fn assignment_key(prefix: &str, a: &AssignmentKey) -> String {
    format!("{}/{ASSIGN}{a}", normalize_prefix(prefix))
}

/// `<prefix>/items/`: the range of every item spec.
pub fn items_prefix(prefix: &str) -> String {
    format!("{}/{ITEMS}", normalize_prefix(prefix))
}

/// `<prefix>/members/`: the range of every member.
pub fn members_prefix(prefix: &str) -> String {
    format!("{}/{MEMBERS}", normalize_prefix(prefix))
}

/// `<prefix>/assign/`: the range of every assignment.
pub fn assignments_prefix(prefix: &str) -> String {
    format!("{}/{ASSIGN}", normalize_prefix(prefix))
}

/// `<prefix>/assign/<item>#`: the range of one item's assignments
/// (no other item's name continues with `#`).
pub fn item_assignments_prefix(prefix: &str, item: &str) -> String {
    format!("{}/{ASSIGN}{item}#", normalize_prefix(prefix))
}

/// Parses a key of the key space under `prefix`.
pub fn parse_key(prefix: &str, key: &str) -> Result<Key, KeyError> {
    let root = normalize_prefix(prefix);
    let rest = key
        .strip_prefix(root)
        .and_then(|r| r.strip_prefix('/'))
        .ok_or_else(|| KeyError::NotUnderPrefix {
            key: key.to_string(),
            prefix: prefix.to_string(),
        })?;
    let wrap = |e: KeyError| match e {
        KeyError::BadPart { why, .. } => KeyError::Malformed {
            key: key.to_string(),
            why,
        },
        other => other,
    };
    if let Some(item) = rest.strip_prefix(ITEMS) {
        check_item(item).map_err(wrap)?;
        Ok(Key::Item(item.to_string()))
    } else if let Some(member) = rest.strip_prefix(MEMBERS) {
        Ok(Key::Member(member.parse().map_err(wrap)?))
    } else if let Some(a) = rest.strip_prefix(ASSIGN) {
        let parts: Vec<&str> = a.split('#').collect();
        let &[item, zone, id, slot] = parts.as_slice() else {
            return Err(KeyError::Malformed {
                key: key.to_string(),
                why: "an assignment is `item#zone#id#slot`, with exactly three `#`",
            });
        };
        let slot = parse_slot(slot).map_err(wrap)?;
        let member = MemberKey::new(zone, id).map_err(wrap)?;
        AssignmentKey::new(item, member, slot)
            .map(Key::Assignment)
            .map_err(wrap)
    } else {
        Err(KeyError::UnknownKind {
            key: key.to_string(),
        })
    }
}

fn bad(what: &'static str, value: &str, why: &'static str) -> KeyError {
    KeyError::BadPart {
        what,
        value: value.to_string(),
        why,
    }
}

/// Refuses `value`, the key part `what`, for `why` when `bad`.
fn refuse_if(
    bad: bool,
    what: &'static str,
    value: &str,
    why: &'static str,
) -> Result<(), KeyError> {
    match bad {
        true => Err(self::bad(what, value, why)),
        false => Ok(()),
    }
}

/// An item name as the key layout needs it: not empty, no `#`. (The
/// spec's own rules are checked where specs are applied.)
pub fn check_item(item: &str) -> Result<(), KeyError> {
    let what = "item";
    refuse_if(item.is_empty(), what, item, "an item name is not empty")?;
    refuse_if(item.contains('#'), what, item, "an item name has no `#`")
}

/// A zone: no `#` (empty is the zone of members started without one).
pub fn check_zone(zone: &str) -> Result<(), KeyError> {
    refuse_if(zone.contains('#'), "zone", zone, "a zone has no `#`")
}

/// A member id: not empty, no `#`.
pub fn check_id(id: &str) -> Result<(), KeyError> {
    let what = "member id";
    refuse_if(id.is_empty(), what, id, "a member id is not empty")?;
    refuse_if(id.contains('#'), what, id, "a member id has no `#`")
}

fn check_slot(slot: u32) -> Result<(), KeyError> {
    if slot > SLOT_MAX {
        Err(bad("slot", &slot.to_string(), "a slot is at most 2^20"))
    } else {
        Ok(())
    }
}

fn parse_slot(s: &str) -> Result<u32, KeyError> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("slot", s, "a slot is a decimal number"));
    }
    if s.len() > 1 && s.starts_with('0') {
        return Err(bad("slot", s, "a slot has no leading zeros"));
    }
    let slot: u32 = s
        .parse()
        .map_err(|_| bad("slot", s, "a slot is at most 2^20"))?;
    check_slot(slot)?;
    Ok(slot)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn m(zone: &str, id: &str) -> MemberKey {
        MemberKey::new(zone, id).unwrap()
    }

    #[test]
    fn keys_follow_gazettes_layout() {
        assert_eq!(item_key("/root", "item-1"), "/root/items/item-1");
        assert_eq!(item_key("/root/", "a/b/c"), "/root/items/a/b/c");
        assert_eq!(
            member_key("/root", &m("zone-a", "A1")),
            "/root/members/zone-a#A1"
        );
        let a = AssignmentKey::new("a/b", m("zone-b", "B"), 2).unwrap();
        assert_eq!(assignment_key("/root", &a), "/root/assign/a/b#zone-b#B#2");
        assert_eq!(item_assignments_prefix("/root", "a/b"), "/root/assign/a/b#");
        assert_eq!(
            parse_key("/root", "/root/assign/a/b#zone-b#B#2").unwrap(),
            Key::Assignment(a)
        );
        assert_eq!(
            parse_key("/root/", "/root/members/#solo").unwrap(),
            Key::Member(m("", "solo"))
        );
        assert_eq!(
            parse_key("/root", "/root/items/x/y").unwrap(),
            Key::Item("x/y".into())
        );
    }

    #[test]
    fn bad_keys_are_refused_with_the_reason() {
        let cases: &[(&str, &str)] = &[
            ("/other/items/x", "not under the prefix"),
            ("/rootitems/x", "not under the prefix"),
            ("/root/elsewhere/x", "neither an item"),
            ("/root/items/", "not empty"),
            ("/root/members/zone-a", "exactly one `#`"),
            ("/root/members/zone-a#A#B", "exactly one `#`"),
            ("/root/members/zone-a#", "member id is not empty"),
            ("/root/assign/j#zone#id", "exactly three `#`"),
            ("/root/assign/j#zone#id#1#2", "exactly three `#`"),
            ("/root/assign/j#zone#id#01", "leading zeros"),
            ("/root/assign/j#zone#id#-1", "decimal number"),
            ("/root/assign/j#zone#id#", "decimal number"),
            ("/root/assign/j#zone#id#99999999999", "at most 2^20"),
            ("/root/assign/#zone#id#0", "item name is not empty"),
            ("/root/assign/j#zone##0", "member id is not empty"),
        ];
        for (key, why) in cases {
            let e = parse_key("/root", key).unwrap_err().to_string();
            assert!(e.contains(why), "{key}: {e}");
            assert!(e.contains(key), "{key}: {e}");
        }
        assert!(MemberKey::new("a#b", "x").is_err());
        assert!(AssignmentKey::new("j#k", m("a", "b"), 0).is_err());
        assert!(AssignmentKey::new("j", m("a", "b"), SLOT_MAX + 1).is_err());
    }

    #[test]
    fn member_keys_serialize_as_zone_hash_id() {
        let k = m("zone-a", "A1");
        let json = serde_json::to_string(&k).unwrap();
        assert_eq!(json, "\"zone-a#A1\"");
        assert_eq!(serde_json::from_str::<MemberKey>(&json).unwrap(), k);
        assert!(serde_json::from_str::<MemberKey>("\"no-hash\"").is_err());
    }

    fn part() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9_.=%+-]{1,12}"
    }

    fn item() -> impl Strategy<Value = String> {
        prop::collection::vec(part(), 1..4).prop_map(|p| p.join("/"))
    }

    proptest! {
        #[test]
        fn item_keys_round_trip(prefix in "(/[a-z]{1,6}){0,2}/?", j in item()) {
            let key = item_key(&prefix, &j);
            prop_assert_eq!(parse_key(&prefix, &key).unwrap(), Key::Item(j));
        }

        #[test]
        fn member_keys_round_trip(zone in "[a-z0-9-]{0,8}", id in part()) {
            let k = MemberKey::new(&zone, &id).unwrap();
            let key = member_key("/rotary", &k);
            prop_assert_eq!(parse_key("/rotary", &key).unwrap(), Key::Member(k.clone()));
            prop_assert_eq!(k.to_string().parse::<MemberKey>().unwrap(), k);
        }

        #[test]
        fn assignment_keys_round_trip(
            j in item(),
            zone in "[a-z0-9-]{0,8}",
            id in part(),
            slot in 0..=SLOT_MAX,
        ) {
            let a = AssignmentKey::new(&j, MemberKey::new(&zone, &id).unwrap(), slot).unwrap();
            let key = assignment_key("/rotary", &a);
            prop_assert!(key.starts_with(&item_assignments_prefix("/rotary", &j)));
            prop_assert_eq!(parse_key("/rotary", &key).unwrap(), Key::Assignment(a));
        }

        /// Whatever the bytes, parsing answers (never panics), and what
        /// parses formats back to the same key.
        #[test]
        fn any_key_parses_or_is_refused(rest in "[a-z#/0-9]{0,24}") {
            let key = format!("/p/{rest}");
            match parse_key("/p", &key) {
                Ok(Key::Item(j)) => prop_assert_eq!(item_key("/p", &j), key),
                Ok(Key::Member(m)) => prop_assert_eq!(member_key("/p", &m), key),
                Ok(Key::Assignment(a)) => prop_assert_eq!(assignment_key("/p", &a), key),
                Err(_) => {}
            }
        }
    }
}
