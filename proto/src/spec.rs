//! Journal names, label sets, selectors and journal specs.
//!
//! These are shared by the broker, the client and the CLI. Name rules follow
//! Gazette's so that names move between the two systems unchanged.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;

/// Why a name, label, selector or spec was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("journal name {name:?}: {why}")]
    BadName { name: String, why: &'static str },
    #[error("label {name:?}: {why}")]
    BadLabel { name: String, why: &'static str },
    #[error("selector {text:?}: {why}")]
    BadSelector { text: String, why: &'static str },
    #[error("duration {text:?}: expected e.g. 90s, 1m, 6h, 1h30m")]
    BadDuration { text: String },
    #[error("duration {text:?}: finer than a millisecond; durations are whole milliseconds")]
    DurationPrecision { text: String },
    #[error("spec of {name:?}: {why}")]
    BadSpec { name: String, why: String },
    /// The input as a whole: not YAML or JSON, or neither a spec nor a list.
    #[error("specs: {why}")]
    BadDocument { why: String },
}

/// Shortest and longest journal names, in bytes.
pub const JOURNAL_NAME_LEN_MIN: usize = 4;
pub const JOURNAL_NAME_LEN_MAX: usize = 512;
/// Longest `/`-separated part of a journal name, in bytes: each part names a
/// directory of the broker's data dir, and Linux file systems allow 255.
pub const JOURNAL_NAME_PART_LEN_MAX: usize = 255;
/// Longest label name and value, in bytes.
pub const LABEL_NAME_LEN_MAX: usize = 64;
pub const LABEL_VALUE_LEN_MAX: usize = 1024;

/// The meta-label every journal has in a selector: its name. A spec may not
/// carry it as a label (as in Gazette).
pub const META_LABEL_NAME: &str = "name";
/// The meta-label a journal has in a selector for each prefix of its name
/// that ends in `/`: `prefix=orders/` selects `orders/part-000`. A spec may
/// not carry it as a label, and a selector's values of it must end in `/`.
pub const META_LABEL_PREFIX: &str = "prefix";

/// Labels of Gazette's (its `labels.SingleValueLabels`) that a spec may give
/// one value at most.
pub const SINGLE_VALUE_LABELS: [&str; 6] = [
    "content-type",
    "app.gazette.dev/instance",
    "app.gazette.dev/managed-by",
    "app.gazette.dev/message-subtype",
    "app.gazette.dev/message-type",
    "app.gazette.dev/region",
];

fn is_name_char(c: char) -> bool {
    c.is_alphanumeric() || matches!(c, '-' | '_' | '+' | '/' | '.' | '=' | '%')
}

/// Checks a journal name: 4–512 bytes of letters, digits and `-_+/.=%`,
/// forming a clean relative path (no leading or trailing `/`, no empty,
/// `.` or `..` components, none longer than 255 bytes).
pub fn validate_journal_name(name: &str) -> Result<(), SpecError> {
    let bad = |why| {
        Err(SpecError::BadName {
            name: name.chars().take(80).collect(),
            why,
        })
    };
    if name.len() < JOURNAL_NAME_LEN_MIN || name.len() > JOURNAL_NAME_LEN_MAX {
        return bad("must be 4 to 512 bytes long");
    }
    if !name.chars().all(is_name_char) {
        return bad("may hold only letters, digits and - _ + / . = %");
    }
    if name.starts_with('/') || name.ends_with('/') {
        return bad("must be a relative path without a trailing '/'");
    }
    for part in name.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return bad("must be a clean path (no empty, '.' or '..' components)");
        }
        if part.len() > JOURNAL_NAME_PART_LEN_MAX {
            return bad("each '/'-separated part must be at most 255 bytes long");
        }
    }
    Ok(())
}

fn validate_label_name(name: &str) -> Result<(), SpecError> {
    let ok = !name.is_empty()
        && name.len() <= LABEL_NAME_LEN_MAX
        && name
            .chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | '+' | '/' | '.'));
    if ok {
        Ok(())
    } else {
        Err(SpecError::BadLabel {
            name: name.chars().take(80).collect(),
            why: "name must be 1-64 letters, digits or - _ + / .",
        })
    }
}

fn validate_label_value(name: &str, value: &str) -> Result<(), SpecError> {
    let ok = value.len() <= LABEL_VALUE_LEN_MAX
        && value.chars().all(|c| {
            c.is_alphanumeric() || matches!(c, '-' | '_' | '+' | '/' | '.' | '=' | '%' | ':' | '@')
        });
    if ok {
        Ok(())
    } else {
        Err(SpecError::BadLabel {
            name: name.chars().take(80).collect(),
            why: "value must be at most 1024 letters, digits or - _ + / . = % : @",
        })
    }
}

/// One label: a name and a value (the value may be empty).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Label {
    pub name: String,
    pub value: String,
}

/// A set of labels, kept sorted by (name, value) without duplicates.
/// A name may carry several values. Used for journal labels and registers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct LabelSet {
    labels: Vec<Label>,
}

impl LabelSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds a validated set from pairs.
    pub fn from_pairs<I, N, V>(pairs: I) -> Result<Self, SpecError>
    where
        I: IntoIterator<Item = (N, V)>,
        N: Into<String>,
        V: Into<String>,
    {
        let mut set = LabelSet::new();
        for (n, v) in pairs {
            set.add(n.into(), v.into())?;
        }
        Ok(set)
    }

    /// Adds a label; adding one that is present changes nothing.
    pub fn add(&mut self, name: String, value: String) -> Result<(), SpecError> {
        validate_label_name(&name)?;
        validate_label_value(&name, &value)?;
        let label = Label { name, value };
        if let Err(at) = self.labels.binary_search(&label) {
            self.labels.insert(at, label);
        }
        Ok(())
    }

    /// Appends a label that sorts after every label present (the wire
    /// carries label sets sorted, so decoding is linear). Refuses anything
    /// out of order or duplicated.
    pub fn push_sorted(&mut self, name: String, value: String) -> Result<(), SpecError> {
        validate_label_name(&name)?;
        validate_label_value(&name, &value)?;
        let label = Label { name, value };
        if self.labels.last().is_some_and(|last| *last >= label) {
            return Err(SpecError::BadLabel {
                name: label.name,
                why: "label sets must be sorted by (name, value) without duplicates",
            });
        }
        self.labels.push(label);
        Ok(())
    }

    /// Bytes of this set in its wire encoding (`u16` count, then `str16`
    /// name and value per label).
    pub fn encoded_len(&self) -> usize {
        2 + self
            .labels
            .iter()
            .map(|l| 4 + l.name.len() + l.value.len())
            .sum::<usize>()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Label> {
        self.labels.iter()
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Values of `name`, in order.
    pub fn values_of<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.labels
            .iter()
            .filter(move |l| l.name == name)
            .map(|l| l.value.as_str())
    }

    pub fn contains(&self, name: &str, value: &str) -> bool {
        self.labels
            .iter()
            .any(|l| l.name == name && l.value == value)
    }

    /// The labels of `name`: a range of indices, empty where `name` would sit
    /// if the set has no value of it.
    fn name_range(&self, name: &str) -> std::ops::Range<usize> {
        let begin = self.labels.partition_point(|l| l.name.as_str() < name);
        let len = self.labels[begin..].partition_point(|l| l.name == name);
        begin..begin + len
    }

    /// Sets each name of `other` to exactly the values it has in `other`,
    /// replacing every value the name had here; names `other` lacks keep
    /// theirs. This is Gazette's `UnionLabelSets(other, self)`, with
    /// `other`'s values preferred, the union an append's `union_registers`
    /// makes: `{author: old}` ∪ `{author: new}` is `{author: new}`, so a
    /// check for `author=old` fails from then on.
    pub fn union(&mut self, other: &LabelSet) {
        if other.is_empty() {
            return;
        }
        self.labels.retain(|l| other.name_range(&l.name).is_empty());
        // The names left and those of `other` are disjoint: no duplicates.
        self.labels.extend_from_slice(&other.labels);
        self.labels.sort_unstable();
        debug_assert!(self.labels.windows(2).all(|w| w[0] < w[1]));
    }

    /// Removes each name whose values here are exactly its values in
    /// `other` (all of them, no more, no fewer); every other name keeps all
    /// its values. This is Gazette's `SubtractLabelSet(self, other)`:
    /// `{author: a}` − `{author: a}` is `{}`, but `{author: [a, b]}` −
    /// `{author: a}` and `{author: a}` − `{author: ""}` change nothing. An
    /// empty value removes only a name whose one value is empty.
    pub fn subtract(&mut self, other: &LabelSet) {
        if other.is_empty() {
            return;
        }
        let mut out = Vec::with_capacity(self.labels.len());
        let mut at = 0;
        while at < self.labels.len() {
            let mine = self.name_range(&self.labels[at].name);
            debug_assert_eq!(mine.start, at);
            let theirs = other.name_range(&self.labels[at].name);
            let same = mine.len() == theirs.len()
                && self.labels[mine.clone()]
                    .iter()
                    .zip(&other.labels[theirs])
                    .all(|(m, t)| m.value == t.value);
            if !same {
                out.extend_from_slice(&self.labels[mine.clone()]);
            }
            at = mine.end;
        }
        self.labels = out;
    }

    /// The registers after an append that commits at least one byte with
    /// these changes: `subtract` first, then `union` (Gazette's append FSM
    /// does the same). So `subtract {author: a}` with `union {author: a}`
    /// keeps `author=a`, where the other order would drop it.
    pub fn apply_append_changes(&mut self, union: &LabelSet, subtract: &LabelSet) {
        self.subtract(subtract);
        self.union(union);
    }

    /// `name=value,name=value` (the form selectors and the CLI use).
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        for (i, l) in self.labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&l.name);
            if !l.value.is_empty() {
                out.push('=');
                out.push_str(&l.value);
            }
        }
        out
    }
}

impl fmt::Display for LabelSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_text())
    }
}

/// Serialized as a map of name to value, or name to a list of values.
impl Serialize for LabelSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut names: Vec<&str> = self.labels.iter().map(|l| l.name.as_str()).collect();
        names.dedup();
        let mut map = s.serialize_map(Some(names.len()))?;
        for name in names {
            let values: Vec<&str> = self.values_of(name).collect();
            if values.len() == 1 {
                map.serialize_entry(name, values[0])?;
            } else {
                map.serialize_entry(name, &values)?;
            }
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for LabelSet {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let map: std::collections::BTreeMap<String, LabelValues> =
            std::collections::BTreeMap::deserialize(d)?;
        let mut set = LabelSet::new();
        for (name, LabelValues(values)) in map {
            for value in values {
                set.add(name.clone(), value)
                    .map_err(serde::de::Error::custom)?;
            }
        }
        Ok(set)
    }
}

/// The value of one label name in YAML or JSON: a string or a list of
/// strings. Anything else (`a: 5`, `a: true`) is refused with a message that
/// says to quote it, not stringified: `1.0` and `1` would otherwise differ
/// from what was written.
struct LabelValues(Vec<String>);

impl<'de> Deserialize<'de> for LabelValues {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(LabelValuesVisitor { in_list: false })
            .map(LabelValues)
    }
}

/// Visits one label value, or (outside a list) a list of them.
#[derive(Clone, Copy)]
struct LabelValuesVisitor {
    in_list: bool,
}

impl LabelValuesVisitor {
    fn unquoted<E: serde::de::Error>(what: impl std::fmt::Display) -> Result<Vec<String>, E> {
        Err(E::custom(format!(
            "label value {what}: label values are strings; quote it"
        )))
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for LabelValuesVisitor {
    type Value = Vec<String>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Vec<String>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for LabelValuesVisitor {
    type Value = Vec<String>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self.in_list {
            false => f.write_str("a label value (a string) or a list of them"),
            true => f.write_str("a label value (a string)"),
        }
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Vec<String>, E> {
        Ok(vec![v.to_owned()])
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Vec<String>, E> {
        Self::unquoted(v)
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Vec<String>, E> {
        Self::unquoted(v)
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Vec<String>, E> {
        Self::unquoted(v)
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Vec<String>, E> {
        Self::unquoted(v)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Vec<String>, E> {
        Err(E::custom(
            "label value missing: write \"\" for an empty value",
        ))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<String>, A::Error> {
        if self.in_list {
            return Err(serde::de::Error::custom(
                "a list of label values holds strings, not lists",
            ));
        }
        let mut values = Vec::new();
        while let Some(v) = seq.next_element_seed(LabelValuesVisitor { in_list: true })? {
            values.extend(v);
        }
        Ok(values)
    }
}

/// Selects label sets: every `include` requirement must hold and no
/// `exclude` requirement may. A requirement with an empty value matches any
/// value of its name.
///
/// Text form (CLI `-l`): comma-separated `name=value` (or `name==value`),
/// `name!=value`, `name in (v1, v2)` (one of the values), `name notin (v1,
/// v2)` (or `not in`: none of them), `name` (has the name), `!name` (lacks
/// the name); the forms Gazette's selectors take.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelSelector {
    pub include: LabelSet,
    pub exclude: LabelSet,
}

impl LabelSelector {
    pub fn is_empty(&self) -> bool {
        self.include.is_empty() && self.exclude.is_empty()
    }

    pub fn parse(text: &str) -> Result<Self, SpecError> {
        let mut sel = LabelSelector::default();
        let bad = |why| SpecError::BadSelector {
            text: text.to_string(),
            why,
        };
        if text.trim().is_empty() {
            return Ok(sel);
        }
        for part in selector_terms(text).map_err(bad)? {
            let part = part.trim();
            if part.is_empty() {
                // `a=b,,c` or a trailing comma: likely a term left out.
                return Err(bad("an empty term between commas"));
            }
            if let Some(set) = set_term(part).map_err(bad)? {
                let into = match set.negated {
                    false => &mut sel.include,
                    true => &mut sel.exclude,
                };
                for v in set.values {
                    into.add(set.name.into(), v.into())?;
                }
            } else if let Some((n, v)) = part.split_once("!=") {
                if v.trim().is_empty() {
                    return Err(bad("'name!=' needs a value; use '!name'"));
                }
                sel.exclude.add(n.trim().into(), v.trim().into())?;
            } else if let Some((n, v)) = part.split_once('=') {
                let v = v.strip_prefix('=').unwrap_or(v);
                if v.trim().is_empty() {
                    return Err(bad("'name=' needs a value; use 'name'"));
                }
                sel.include.add(n.trim().into(), v.trim().into())?;
            } else if let Some(n) = part.strip_prefix('!') {
                sel.exclude.add(n.trim().into(), String::new())?;
            } else {
                sel.include.add(part.into(), String::new())?;
            }
        }
        Ok(sel)
    }

    /// Parses a selector of journals (LIST, PRUNE, `--metrics-journals`):
    /// as [`parse`](Self::parse), and each value of the meta-label `prefix`
    /// must end in `/` (Gazette refuses the others too).
    pub fn parse_journals(text: &str) -> Result<Self, SpecError> {
        let sel = Self::parse(text)?;
        for l in sel.include.iter().chain(sel.exclude.iter()) {
            if l.name == META_LABEL_PREFIX && !l.value.ends_with('/') {
                return Err(SpecError::BadSelector {
                    text: text.to_string(),
                    why: "a value of 'prefix' must end in '/', e.g. prefix=orders/",
                });
            }
        }
        Ok(sel)
    }

    /// Whether `set` satisfies the selector. Include requirements sharing a
    /// name are alternatives (`a=1,a=2` matches either value).
    pub fn matches(&self, set: &LabelSet) -> bool {
        self.matches_by(|name, value| match value {
            "" => set.values_of(name).next().is_some(),
            value => set.contains(name, value),
        })
    }

    /// Whether the journal `journal`, labelled `labels`, satisfies the
    /// selector, which may also name the meta-labels: `name` (the journal's
    /// name) and `prefix` (each prefix of the name that ends in `/`).
    pub fn matches_journal(&self, journal: &str, labels: &LabelSet) -> bool {
        self.matches_by(|name, value| match name {
            META_LABEL_NAME => value.is_empty() || value == journal,
            META_LABEL_PREFIX => value.ends_with('/') && journal.starts_with(value),
            _ if value.is_empty() => labels.values_of(name).next().is_some(),
            _ => labels.contains(name, value),
        })
    }

    /// The selector over a set that `has(name, value)` says holds the label
    /// (`value` empty: holds the name with any value).
    fn matches_by(&self, has: impl Fn(&str, &str) -> bool) -> bool {
        let mut names: Vec<&str> = self.include.iter().map(|l| l.name.as_str()).collect();
        names.dedup();
        for name in names {
            if !self.include.values_of(name).any(|want| has(name, want)) {
                return false;
            }
        }
        !self.exclude.iter().any(|l| has(&l.name, &l.value))
    }

    pub fn to_text(&self) -> String {
        let mut parts = Vec::new();
        for l in self.include.iter() {
            parts.push(if l.value.is_empty() {
                l.name.clone()
            } else {
                format!("{}={}", l.name, l.value)
            });
        }
        for l in self.exclude.iter() {
            parts.push(if l.value.is_empty() {
                format!("!{}", l.name)
            } else {
                format!("{}!={}", l.name, l.value)
            });
        }
        parts.join(",")
    }
}

/// The terms of a selector's text: split at the commas outside a value
/// list's parentheses.
fn selector_terms(text: &str) -> Result<Vec<&str>, &'static str> {
    let mut terms = Vec::new();
    let (mut open, mut start) = (false, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' if open => return Err("a '(' inside a list of values"),
            '(' => open = true,
            ')' if !open => return Err("a ')' without its '('"),
            ')' => open = false,
            ',' if !open => {
                terms.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if open {
        return Err("a '(' without its ')'");
    }
    terms.push(&text[start..]);
    Ok(terms)
}

/// A selector term over a list of values: `name in (…)`, or with
/// `negated`, `name notin (…)` / `name not in (…)`.
struct SetTerm<'a> {
    name: &'a str,
    negated: bool,
    values: Vec<&'a str>,
}

/// Reads `part` as a [`SetTerm`]; `None` if it has no list of values.
fn set_term(part: &str) -> Result<Option<SetTerm<'_>>, &'static str> {
    let Some((head, rest)) = part.split_once('(') else {
        return Ok(None);
    };
    let Some(list) = rest.trim_end().strip_suffix(')') else {
        return Err("nothing may follow a list of values but a comma");
    };
    let words: Vec<&str> = head.split_whitespace().collect();
    let (name, negated) = match words[..] {
        [name, "in"] => (name, false),
        [name, "notin"] | [name, "not", "in"] => (name, true),
        _ => return Err("a list of values follows 'name in' or 'name notin'"),
    };
    let values: Vec<&str> = list.split(',').map(str::trim).collect();
    if values.iter().any(|v| v.is_empty()) {
        return Err("an empty value in a list of values");
    }
    Ok(Some(SetTerm {
        name,
        negated,
        values,
    }))
}

/// Parses Go-style durations: `90s`, `1m`, `6h`, `1h30m`, `250ms`, `720h`.
pub fn parse_duration(text: &str) -> Result<Duration, SpecError> {
    let bad = || SpecError::BadDuration {
        text: text.to_string(),
    };
    let t = text.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    let mut total_ns: u128 = 0;
    let mut rest = t;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let n: u128 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit_ns: u128 = match &rest[..unit_len] {
            "ns" => 1,
            "us" | "µs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "d" => 86_400_000_000_000,
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        total_ns = total_ns
            .checked_add(n.checked_mul(unit_ns).ok_or_else(bad)?)
            .ok_or_else(bad)?;
    }
    if !total_ns.is_multiple_of(1_000_000) {
        // Stored and shown in milliseconds: `1us` would read back as `0s`,
        // which for `retention` means "forever".
        return Err(SpecError::DurationPrecision {
            text: text.to_string(),
        });
    }
    let secs = u64::try_from(total_ns / 1_000_000_000).map_err(|_| bad())?;
    Ok(Duration::new(secs, (total_ns % 1_000_000_000) as u32))
}

/// Formats a duration the way `parse_duration` reads it, largest units first.
pub fn format_duration(d: Duration) -> String {
    if d.is_zero() {
        return "0s".into();
    }
    if d.subsec_nanos() != 0 {
        if d.subsec_nanos().is_multiple_of(1_000_000) && d.as_secs() == 0 {
            return format!("{}ms", d.subsec_millis());
        }
        return format!("{}ms", d.as_millis());
    }
    let mut s = d.as_secs();
    let mut out = String::new();
    for (unit, len) in [("h", 3600), ("m", 60), ("s", 1)] {
        if s >= len {
            out.push_str(&format!("{}{}", s / len, unit));
            s %= len;
        }
    }
    out
}

mod duration_text {
    use serde::{Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_duration(*d))
    }

    /// Text, or the bare number 0 (YAML's `retention: 0`).
    struct Visitor;

    impl serde::de::Visitor<'_> for Visitor {
        type Value = Duration;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a duration such as 90s, 1m, 6h, 1h30m or 0")
        }

        fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Duration, E> {
            super::parse_duration(text).map_err(E::custom)
        }

        fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Duration, E> {
            match n {
                0 => Ok(Duration::ZERO),
                n => Err(E::custom(format!(
                    "duration {n}: needs a unit, e.g. {n}s or {n}m"
                ))),
            }
        }

        fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Duration, E> {
            match u64::try_from(n) {
                Ok(n) => self.visit_u64(n),
                Err(_) => Err(E::custom(format!("duration {n}: must not be negative"))),
            }
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        d.deserialize_any(Visitor)
    }
}

/// How far an append is carried before it is acknowledged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// Written to every replica's device with O_DIRECT and recorded in its
    /// commit log before the ack: survives the crash of any broker process.
    #[default]
    Replicated,
    /// As `replicated`, plus a group-committed fdatasync of spool and commit
    /// log on every replica before the ack: survives power loss.
    Fsync,
}

/// Compression applied to fragments in the store.
///
/// Spec names, Gazette's names and object-name extensions are one table,
/// [`CODEC_NAMES`]. A spec takes either name in any case and prints rotary's
/// (lower-case) one; an object name's extension is matched ignoring case,
/// aliases included, as Gazette's `CompressionCodecFromExtension` does.
///
/// The discriminants are the codes READ_FRAGMENT carries (`wire::codec_code`,
/// PROTOCOL.md §5.11): never renumber them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Codec {
    None = 0,
    Gzip = 1,
    #[default]
    Zstd = 2,
    /// Snappy's framing format (not raw snappy blocks).
    Snappy = 3,
    /// Gazette's GZIP_OFFLOAD_DECOMPRESSION: an object of gzip bytes that
    /// an S3 store holds with `Content-Encoding: gzip`, so that an HTTP
    /// reader may have the store decompress it. Its bytes as stored are
    /// gzip; rotary reads them as stored and decompresses them itself.
    GzipOffload = 4,
}

/// The names of one [`Codec`].
#[derive(Debug)]
pub struct CodecNames {
    pub codec: Codec,
    /// rotary's spec name, and what specs and FRAGMENTS print.
    pub name: &'static str,
    /// Gazette's name (protocol.proto's `CompressionCodec`).
    pub gazette: &'static str,
    /// The extension of the objects written (Gazette's `ToExtension`).
    pub extension: &'static str,
    /// Other extensions read as this codec.
    pub aliases: &'static [&'static str],
}

/// Every codec's names, in the order of their codes.
pub const CODEC_NAMES: [CodecNames; 5] = [
    CodecNames {
        codec: Codec::None,
        name: "none",
        gazette: "NONE",
        extension: ".raw",
        aliases: &[],
    },
    CodecNames {
        codec: Codec::Gzip,
        name: "gzip",
        gazette: "GZIP",
        extension: ".gz",
        aliases: &[".gzip"],
    },
    CodecNames {
        codec: Codec::Zstd,
        name: "zstd",
        gazette: "ZSTANDARD",
        extension: ".zst",
        aliases: &[".zstandard"],
    },
    CodecNames {
        codec: Codec::Snappy,
        name: "snappy",
        gazette: "SNAPPY",
        extension: ".sz",
        aliases: &[".snappy"],
    },
    // Gazette writes these objects without an extension (and reads
    // `.gzod` as well, the extension it names for them).
    CodecNames {
        codec: Codec::GzipOffload,
        name: "gzip_offload_decompression",
        gazette: "GZIP_OFFLOAD_DECOMPRESSION",
        extension: "",
        aliases: &[".gzod"],
    },
];

const _: () = {
    let mut i = 0;
    while i < CODEC_NAMES.len() {
        assert!(
            CODEC_NAMES[i].codec as usize == i && Codec::ALL[i] as usize == i,
            "CODEC_NAMES and Codec::ALL are in the order of the codes"
        );
        i += 1;
    }
};

impl Codec {
    /// Every codec, in the order of their codes.
    pub const ALL: [Codec; 5] = [
        Codec::None,
        Codec::Gzip,
        Codec::Zstd,
        Codec::Snappy,
        Codec::GzipOffload,
    ];

    fn names(self) -> &'static CodecNames {
        &CODEC_NAMES[self as usize]
    }

    /// rotary's spec name.
    pub fn name(self) -> &'static str {
        self.names().name
    }

    /// Gazette's name.
    pub fn gazette_name(self) -> &'static str {
        self.names().gazette
    }

    /// The extension of objects written with this codec (Gazette's).
    pub fn extension(self) -> &'static str {
        self.names().extension
    }

    /// The codec of an object-name extension (`""` for none, else with
    /// its dot), ignoring case, aliases included.
    pub fn from_extension(ext: &str) -> Option<Codec> {
        CODEC_NAMES
            .iter()
            .find(|n| {
                n.extension.eq_ignore_ascii_case(ext)
                    || n.aliases.iter().any(|a| a.eq_ignore_ascii_case(ext))
            })
            .map(|n| n.codec)
    }

    /// The codec a spec names: rotary's name or Gazette's, in any case.
    pub fn from_name(name: &str) -> Option<Codec> {
        CODEC_NAMES
            .iter()
            .find(|n| n.name.eq_ignore_ascii_case(name) || n.gazette.eq_ignore_ascii_case(name))
            .map(|n| n.codec)
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for Codec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Codec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Codec, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Codec;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a compression codec name")
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Codec, E> {
                Codec::from_name(text).ok_or_else(|| E::custom(unknown_codec(text)))
            }
        }
        d.deserialize_str(Visitor)
    }
}

/// Why `text` names no codec, listing the names that do.
fn unknown_codec(text: &str) -> String {
    let list = |f: fn(&CodecNames) -> &'static str| {
        CODEC_NAMES.iter().map(f).collect::<Vec<_>>().join(", ")
    };
    format!(
        "unknown compression codec {text:?}: expected one of {} or Gazette's {} (any case)",
        list(|n| n.name),
        list(|n| n.gazette)
    )
}

/// Access flags of a journal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JournalFlags {
    #[default]
    ReadWrite,
    ReadOnly,
    WriteOnly,
}

/// Smallest and largest `fragment.length`, in bytes.
pub const FRAGMENT_LENGTH_MIN: u64 = 4096;
pub const FRAGMENT_LENGTH_MAX: u64 = 1 << 40;

/// How a journal's bytes become fragments.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FragmentSpec {
    /// A spool seals before an append once it holds at least this many bytes.
    pub length: u64,
    /// How uploads compress fragments; any codec is read whatever this says.
    pub compression_codec: Codec,
    /// Fragment stores, first is where uploads go: `file:///abs/`, `s3://bucket/prefix/?…`.
    pub stores: Vec<String>,
    /// How often the store listing is refreshed.
    #[serde(with = "duration_text")]
    pub refresh_interval: Duration,
    /// Fragments older than this are pruned; zero keeps forever.
    #[serde(with = "duration_text")]
    pub retention: Duration,
    /// Spools seal at UTC multiples of this interval; zero disables.
    #[serde(with = "duration_text")]
    pub flush_interval: Duration,
}

impl Default for FragmentSpec {
    fn default() -> Self {
        FragmentSpec {
            length: 512 << 20,
            compression_codec: Codec::Zstd,
            stores: Vec::new(),
            refresh_interval: Duration::from_secs(60),
            retention: Duration::ZERO,
            flush_interval: Duration::from_secs(6 * 3600),
        }
    }
}

fn default_replication() -> u32 {
    1
}

fn is_default<T: Default + PartialEq>(t: &T) -> bool {
    *t == T::default()
}

/// A journal's specification: everything an operator sets about it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JournalSpec {
    pub name: String,
    #[serde(default = "default_replication")]
    pub replication: u32,
    #[serde(default)]
    pub labels: LabelSet,
    #[serde(default)]
    pub durability: Durability,
    #[serde(default)]
    pub fragment: FragmentSpec,
    #[serde(default, skip_serializing_if = "is_default")]
    pub flags: JournalFlags,
    /// Bytes per second admitted to this journal; zero is unlimited.
    #[serde(default, skip_serializing_if = "is_default")]
    pub max_append_rate: u64,
}

impl JournalSpec {
    pub fn new(name: impl Into<String>) -> Self {
        JournalSpec {
            name: name.into(),
            replication: 1,
            labels: LabelSet::new(),
            durability: Durability::default(),
            fragment: FragmentSpec::default(),
            flags: JournalFlags::default(),
            max_append_rate: 0,
        }
    }

    /// Checks every field. Each label was already checked when parsed; here
    /// the labels as a set, by Gazette's rules: no meta-label (`name`,
    /// `prefix`), no name with both an empty and another value, and one
    /// value at most of each of [`SINGLE_VALUE_LABELS`].
    pub fn validate(&self) -> Result<(), SpecError> {
        validate_journal_name(&self.name)?;
        let bad = |why: String| {
            Err(SpecError::BadSpec {
                name: self.name.clone(),
                why,
            })
        };
        for meta in [META_LABEL_NAME, META_LABEL_PREFIX] {
            if self.labels.values_of(meta).next().is_some() {
                return bad(format!(
                    "labels cannot include label {meta:?}: selectors match it against the journal's name"
                ));
            }
        }
        let labels: Vec<&Label> = self.labels.iter().collect();
        for pair in labels.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if a.name != b.name {
                continue;
            }
            // Sorted by value: an empty value comes first.
            if a.value.is_empty() {
                return bad(format!(
                    "label {:?} has an empty value and the value {:?}",
                    a.name, b.value
                ));
            }
            if SINGLE_VALUE_LABELS.contains(&a.name.as_str()) {
                return bad(format!(
                    "label {:?} takes one value, not {:?} and {:?}",
                    a.name, a.value, b.value
                ));
            }
        }
        if self.replication == 0 || self.replication > 16 {
            return bad(format!(
                "replication must be 1 to 16, not {}",
                self.replication
            ));
        }
        let f = &self.fragment;
        if f.length < FRAGMENT_LENGTH_MIN || f.length > FRAGMENT_LENGTH_MAX {
            return bad(format!(
                "fragment.length must be {FRAGMENT_LENGTH_MIN} to {FRAGMENT_LENGTH_MAX} bytes, not {}",
                f.length
            ));
        }
        for store in &f.stores {
            if !(store.starts_with("file:///") || store.starts_with("s3://")) {
                return bad(format!(
                    "fragment store {store:?} must be file:///abs/path/ or s3://bucket/prefix/"
                ));
            }
            let path = store.split('?').next().unwrap_or("");
            if !path.ends_with('/') {
                return bad(format!("fragment store {store:?} must end with '/'"));
            }
        }
        // Gazette's rule too: the codec leaves decompression to a store that
        // honours Content-Encoding, which a directory does not, and
        // Gazette's readers would take the gzip bytes for the journal's.
        if f.compression_codec == Codec::GzipOffload
            && f.stores.first().is_some_and(|s| s.starts_with("file://"))
        {
            return bad(format!(
                "fragment.compression_codec {} cannot write to a file:// store ({}): it needs \
                 an s3:// first store",
                Codec::GzipOffload,
                f.stores[0]
            ));
        }
        if !f.flush_interval.is_zero() && f.flush_interval < Duration::from_secs(1) {
            return bad("fragment.flush_interval must be 0 or at least 1s".into());
        }
        if f.refresh_interval < Duration::from_secs(1) {
            return bad("fragment.refresh_interval must be at least 1s".into());
        }
        Ok(())
    }
}

/// Parses `journals apply` input: one spec or a list of specs, YAML or JSON.
/// An error names the journal (or the list entry) and the field at fault.
pub fn parse_specs(text: &str) -> Result<Vec<JournalSpec>, SpecError> {
    let doc: serde_yaml::Value =
        serde_yaml::from_str(text).map_err(|e| SpecError::BadDocument { why: e.to_string() })?;
    let parse_one = |v: serde_yaml::Value, entry: Option<usize>| {
        let name = v
            .get("name")
            .and_then(|n| n.as_str())
            .map(str::to_string)
            .or_else(|| entry.map(|i| format!("entry {i}")))
            .unwrap_or_else(|| "the spec".into());
        serde_yaml::from_value::<JournalSpec>(v).map_err(|e| SpecError::BadSpec {
            name,
            why: e.to_string(),
        })
    };
    let specs = match doc {
        serde_yaml::Value::Sequence(items) => items
            .into_iter()
            .enumerate()
            .map(|(i, v)| parse_one(v, Some(i)))
            .collect::<Result<Vec<_>, _>>()?,
        v @ serde_yaml::Value::Mapping(_) => vec![parse_one(v, None)?],
        _ => {
            return Err(SpecError::BadDocument {
                why: "expected one spec (a mapping) or a list of specs".into(),
            })
        }
    };
    validate_specs(&specs)?;
    Ok(specs)
}

/// Checks a set of specs applied together: each one, and that no journal is
/// named twice (which of two entries should win is not for the broker to
/// guess).
pub fn validate_specs(specs: &[JournalSpec]) -> Result<(), SpecError> {
    let mut seen = std::collections::HashSet::with_capacity(specs.len());
    for s in specs {
        s.validate()?;
        if !seen.insert(s.name.as_str()) {
            return Err(SpecError::BadSpec {
                name: s.name.clone(),
                why: "the journal is named twice in one apply".into(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn journal_names_follow_gazette_rules() {
        let part_255 = format!("{}/{}", "p".repeat(255), "q".repeat(255));
        for ok in [
            "orders/part-000",
            "a/b/c=d%20",
            "abcd",
            "x.y+z_w",
            part_255.as_str(),
        ] {
            validate_journal_name(ok).unwrap();
        }
        let long = "a".repeat(513);
        let part_256 = format!("a/{}/b", "p".repeat(256));
        for bad in [
            "abc",
            "/abs/path",
            "trail/",
            "a//b",
            "a/./b",
            "a/../b",
            "sp ace",
            "semi;colon",
            long.as_str(),
            part_256.as_str(),
            "../up",
        ] {
            assert!(validate_journal_name(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn one_apply_names_each_journal_once() {
        let specs =
            parse_specs("- {name: dup/cccc, flags: read-only}\n- {name: dup/dddd}\n").unwrap();
        assert_eq!(specs.len(), 2);
        let err = parse_specs("- {name: dup/cccc, flags: read-only}\n- {name: dup/cccc}\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("dup/cccc") && err.contains("named twice"),
            "{err}"
        );
    }

    fn set(pairs: &[(&str, &str)]) -> LabelSet {
        LabelSet::from_pairs(pairs.iter().copied()).unwrap()
    }

    #[test]
    fn union_replaces_the_values_of_each_name_it_carries() {
        // Gazette's TestUnion (label_extensions_test.go): where both sets
        // have a name, the values of the set passed first win; here that
        // is the argument, an append's `union_registers`.
        let mut registers = set(&[
            ("aaa", "val-4"),
            ("aaa", "val-5"),
            ("bbb", "val-6"),
            ("ddd", "val-7"),
        ]);
        registers.union(&set(&[
            ("bbb", "val-1"),
            ("bbb", "val-2"),
            ("ccc", "val-3"),
        ]));
        assert_eq!(
            registers,
            set(&[
                ("aaa", "val-4"),
                ("aaa", "val-5"),
                ("bbb", "val-1"),
                ("bbb", "val-2"),
                ("ccc", "val-3"),
                ("ddd", "val-7"),
            ])
        );
        // A deposed writer's check fails once the new writer's union
        // commits: the old value is gone, not kept beside the new one.
        let mut registers = set(&[("author", "old1"), ("epoch", "7")]);
        registers.union(&set(&[("author", "new2")]));
        assert_eq!(registers.to_text(), "author=new2,epoch=7");
        let old = LabelSelector::parse("author=old1").unwrap();
        assert!(!old.matches(&registers));
        assert!(LabelSelector::parse("author=new2")
            .unwrap()
            .matches(&registers));
        // An empty value replaces too, and an empty union changes nothing.
        registers.union(&set(&[("author", "")]));
        assert_eq!(registers.to_text(), "author,epoch=7");
        registers.union(&LabelSet::new());
        assert_eq!(registers.to_text(), "author,epoch=7");
    }

    #[test]
    fn subtract_removes_a_name_only_when_all_its_values_match() {
        // Gazette's TestSubtraction (label_extensions_test.go).
        let mut registers = set(&[
            ("aaa", "val"),   // Matched.
            ("bbb", "val-1"), // Differs on value.
            ("ccc", "val-1"),
            ("ccc", "val-2"), // Value only here.
            ("ddd", "val-1"), // Matched.
            ("ddd", "val-2"), // Matched.
            ("eee", "val"),   // Only here.
            ("ggg", "val"),   // Matched.
        ]);
        registers.subtract(&set(&[
            ("aaa", "val"),
            ("bbb", "val-2"),
            ("ccc", "val-1"),
            ("ddd", "val-1"),
            ("ddd", "val-2"),
            ("fff", "val"), // Only in the subtracted set.
            ("ggg", "val"),
        ]));
        assert_eq!(
            registers,
            set(&[
                ("bbb", "val-1"),
                ("ccc", "val-1"),
                ("ccc", "val-2"),
                ("eee", "val"),
            ])
        );
        // An empty value is a value like any other: it removes nothing but
        // a name whose one value is empty.
        let mut registers = set(&[("author", "a"), ("flag", "")]);
        registers.subtract(&set(&[("author", "")]));
        assert_eq!(registers.to_text(), "author=a,flag");
        registers.subtract(&set(&[("flag", "")]));
        assert_eq!(registers.to_text(), "author=a");
        // More values than the name has: nothing removed either.
        registers.subtract(&set(&[("author", "a"), ("author", "b")]));
        assert_eq!(registers.to_text(), "author=a");
    }

    #[test]
    fn an_append_subtracts_before_it_unions() {
        // Subtract-then-union of one value keeps it; union-then-subtract
        // would have dropped it.
        let mut registers = set(&[("author", "a")]);
        registers.apply_append_changes(&set(&[("author", "a")]), &set(&[("author", "a")]));
        assert_eq!(registers.to_text(), "author=a");
        // A hand-over in one append.
        registers.apply_append_changes(&set(&[("author", "b")]), &set(&[("author", "a")]));
        assert_eq!(registers.to_text(), "author=b");

        // Gazette's TestAppendRegisters (broker/append_api_test.go): each
        // append checks the registers, then subtracts, then unions.
        let mut registers = LabelSet::new();
        type Pairs<'a> = &'a [(&'a str, &'a str)];
        // (check, subtract, union, registers after)
        let steps: [(&str, Pairs, Pairs, &str); 4] = [
            ("", &[], &[("AA", "11"), ("BB", "22")], "AA=11,BB=22"),
            (
                "AA in (11), BB",
                &[("AA", "11"), ("BB", "XYZ")],
                &[("CC", "33")],
                "BB=22,CC=33",
            ),
            ("!AA, CC", &[("CC", "33")], &[("AA", "44")], "AA=44,BB=22"),
            // REGISTER_MISMATCH: nothing changes.
            ("AA = 55", &[], &[("ZZZ", "")], "AA=44,BB=22"),
        ];
        for (check, subtract, union, want) in steps {
            if LabelSelector::parse(check).unwrap().matches(&registers) {
                registers.apply_append_changes(&set(union), &set(subtract));
            } else {
                assert_eq!(check, "AA = 55");
            }
            assert_eq!(registers.to_text(), want, "after {check:?}");
        }
    }

    #[test]
    fn selectors_match_as_gazette_s() {
        // Gazette's TestSelectorMatchingCases (label_extensions_test.go),
        // but for its `inc-1:prefix` term, which rotary's selectors lack.
        let sel = LabelSelector::parse(
            "inc-2, inc-3 in (val-1, val-2), !exc-1, exc-2 notin (val-3, val-4)",
        )
        .unwrap();
        let cases: [(&[(&str, &str)], bool); 10] = [
            (&[], false),
            (
                &[("foo", "bar"), ("inc-2", "any"), ("inc-3", "val-1")],
                true,
            ),
            (
                &[("foo", "bar"), ("inc-2", "foo"), ("inc-3", "val-1")],
                true,
            ),
            (
                &[("foo", "bar"), ("inc-2", "any"), ("inc-3", "val-2")],
                true,
            ),
            (&[("foo", "bar"), ("inc-3", "val-1")], false),
            (
                &[("foo", "bar"), ("inc-2", "any"), ("inc-3", "val-other")],
                false,
            ),
            (
                &[("exc-1", "any"), ("inc-2", "any"), ("inc-3", "val-1")],
                false,
            ),
            (
                &[("exc-2", "val-4"), ("inc-2", "any"), ("inc-3", "val-1")],
                false,
            ),
            (
                &[("exc-2", "val-ok"), ("inc-2", "any"), ("inc-3", "val-1")],
                true,
            ),
            // An empty include value asks for the name with any value,
            // the empty one too.
            (&[("inc-2", ""), ("inc-3", "val-1")], true),
        ];
        for (labels, want) in cases {
            assert_eq!(sel.matches(&set(labels)), want, "{labels:?}");
        }
        // Exclude only.
        let sel = LabelSelector::parse("!exc-1, exc-2 notin (val-3, val-4)").unwrap();
        assert!(sel.matches(&LabelSet::new()));
        assert!(sel.matches(&set(&[("foo", "bar")])));
        assert!(sel.matches(&set(&[("exc-2", "val-ok"), ("foo", "bar")])));
        assert!(!sel.matches(&set(&[("exc-2", "val-3"), ("foo", "bar")])));
        assert!(!sel.matches(&set(&[("exc-1", "any"), ("foo", "bar")])));
    }

    #[test]
    fn selectors_match() {
        let set = LabelSet::from_pairs([("app", "orders"), ("region", "eu")]).unwrap();
        let m = |t: &str| LabelSelector::parse(t).unwrap().matches(&set);
        assert!(m("app=orders"));
        assert!(m("app=orders,region"));
        assert!(m("app=x,app=orders"));
        assert!(!m("app=other"));
        assert!(!m("region!=eu"));
        assert!(m("!missing"));
        assert!(!m("!app"));
        assert!(m(""));
        assert!(m(" "));
        assert!(m(" app = orders , region "));
        assert!(LabelSelector::parse("a=").is_err());
        // Lists of values, as Gazette writes them.
        assert!(m("app in (other, orders)"));
        assert!(m("app in(orders),region"));
        assert!(!m("app in (other,x)"));
        assert!(!m("region notin (eu, us)"));
        assert!(!m("region not in (eu)"));
        assert!(m("region notin (us,asia), app == orders"));
        assert!(m("missing notin (a)"));
        assert_eq!(
            LabelSelector::parse("a in (x, y),b notin (z),c==d").unwrap(),
            LabelSelector::parse("a=x,a=y,b!=z,c=d").unwrap()
        );
        for (bad, why) in [
            ("a in ()", "an empty value"),
            ("a in (x,,y)", "an empty value"),
            ("a in (x", "without its ')'"),
            ("a in x)", "without its '('"),
            ("a in (x (y))", "inside a list"),
            ("a in (x) b", "nothing may follow"),
            ("a (x)", "follows 'name in'"),
            ("a between (x)", "follows 'name in'"),
            ("a==", "needs a value"),
        ] {
            let err = LabelSelector::parse(bad).unwrap_err().to_string();
            assert!(err.contains(why), "{bad}: {err}");
        }
        for empty_term in ["a=b,,c", "a,", ",a", ",", "a, ,b"] {
            let err = LabelSelector::parse(empty_term).unwrap_err().to_string();
            assert!(err.contains("an empty term"), "{empty_term}: {err}");
        }
    }

    #[test]
    fn journal_selectors_know_name_and_prefix() {
        let labels = set(&[("app", "orders")]);
        let m = |t: &str, journal: &str| {
            LabelSelector::parse_journals(t)
                .unwrap()
                .matches_journal(journal, &labels)
        };
        assert!(m("name=orders/part-000", "orders/part-000"));
        assert!(!m("name=orders/part-000", "orders/part-001"));
        assert!(m("name in (x/y/z, orders/part-001)", "orders/part-001"));
        assert!(m("name", "orders/part-000"));
        assert!(!m("!name", "orders/part-000"));
        assert!(m("prefix=orders/", "orders/part-000"));
        assert!(m("prefix=orders/", "orders/eu/part-000"));
        assert!(!m("prefix=orders/", "ordersx/part-000"));
        assert!(!m("prefix=orders/part-000/", "orders/part-000"));
        assert!(m("prefix=orders/,app=orders", "orders/part-000"));
        assert!(!m("prefix=orders/,app=other", "orders/part-000"));
        assert!(m("prefix in (a/, orders/)", "orders/part-000"));
        assert!(!m("prefix!=orders/", "orders/part-000"));
        assert!(m("prefix notin (a/, b/)", "orders/part-000"));
        assert!(!m("name!=orders/part-000", "orders/part-000"));
        // Gazette's List cases (broker/list_apply_api_test.go).
        let journals = ["journal/1/A", "journal/1/C", "journal/2/B"];
        let pick = |t: &str| -> Vec<&str> {
            let sel = LabelSelector::parse_journals(t).unwrap();
            journals
                .into_iter()
                .filter(|j| sel.matches_journal(j, &LabelSet::new()))
                .collect()
        };
        assert_eq!(pick("name=journal/2/B"), ["journal/2/B"]);
        assert_eq!(pick("prefix=journal/1/"), ["journal/1/A", "journal/1/C"]);
        // Without the journal's name, `name` and `prefix` are labels like
        // any other (register checks).
        assert!(!LabelSelector::parse("name=x").unwrap().matches(&labels));
        for bad in ["prefix=orders", "prefix", "!prefix", "prefix in (a/, b)"] {
            let err = LabelSelector::parse_journals(bad).unwrap_err().to_string();
            assert!(err.contains("must end in '/'"), "{bad}: {err}");
        }
    }

    #[test]
    fn spec_labels_follow_gazette_s_set_rules() {
        for meta in ["name", "prefix"] {
            let e = parse_specs(&format!("name: a/b/c\nlabels: {{{meta}: x/}}"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("cannot include label \"{meta}\"")),
                "{e}"
            );
        }
        let e = parse_specs("name: a/b/c\nlabels: {tag: ['', x]}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("has an empty value and the value \"x\""), "{e}");
        let e = parse_specs("name: a/b/c\nlabels: {content-type: [text/csv, text/plain]}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"content-type\" takes one value"), "{e}");
        // Several values of other names, or one of a single-value label.
        parse_specs("name: a/b/c\nlabels: {tag: [x, y], content-type: text/csv, e: ''}").unwrap();
    }

    #[test]
    fn durations_are_whole_milliseconds() {
        assert_eq!(parse_duration("2000us").unwrap(), Duration::from_millis(2));
        assert_eq!(parse_duration("1s").unwrap(), Duration::from_secs(1));
        for fine in ["1us", "1ns", "1s1ns", "1500us"] {
            let err = parse_duration(fine).unwrap_err().to_string();
            assert!(err.contains("whole milliseconds"), "{fine}: {err}");
        }
        #[derive(Deserialize, Debug)]
        struct D {
            #[serde(with = "duration_text")]
            d: Duration,
        }
        let d: D = serde_json::from_str(r#"{"d": 0}"#).unwrap();
        assert_eq!(d.d, Duration::ZERO);
        let err = serde_json::from_str::<D>(r#"{"d": 5}"#).unwrap_err();
        assert!(err.to_string().contains("needs a unit"), "{err}");
        let d: D = serde_json::from_str(r#"{"d": "90s"}"#).unwrap();
        assert_eq!(d.d, Duration::from_secs(90));
    }

    #[test]
    fn label_values_are_strings_or_lists_of_strings() {
        let one = parse_specs("name: a/b/c\nlabels: {app: orders, zone: [x, y], e: ''}").unwrap();
        let labels = &one[0].labels;
        assert_eq!(labels.values_of("app").collect::<Vec<_>>(), ["orders"]);
        assert_eq!(labels.values_of("zone").collect::<Vec<_>>(), ["x", "y"]);
        assert_eq!(labels.values_of("e").collect::<Vec<_>>(), [""]);
        for (yaml, says) in [
            (
                "{a: 5}",
                "label value 5: label values are strings; quote it",
            ),
            (
                "{a: -2}",
                "label value -2: label values are strings; quote it",
            ),
            (
                "{a: 1.5}",
                "label value 1.5: label values are strings; quote it",
            ),
            (
                "{a: true}",
                "label value true: label values are strings; quote it",
            ),
            (
                "{a: [x, 7]}",
                "label value 7: label values are strings; quote it",
            ),
            ("{a: }", "label value missing"),
            ("{a: [[x]]}", "holds strings, not lists"),
            ("{a: {b: c}}", "a label value (a string) or a list of them"),
        ] {
            let e = parse_specs(&format!("name: a/b/c\nlabels: {yaml}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("\"a/b/c\"") && e.contains(says), "{yaml}: {e}");
        }
    }

    /// Specs are read with YAML 1.2 scalars: the YAML 1.1 words for
    /// booleans are strings, so a label value `yes` is the string `yes`,
    /// and only `true` and `false` are booleans (which a label value
    /// refuses, as above).
    #[test]
    fn yaml_1_1_boolean_words_are_strings() {
        let words = ["yes", "no", "on", "off", "y", "n", "Yes", "OFF"];
        for w in words {
            let specs = parse_specs(&format!("name: a/b/c\nlabels: {{a: {w}}}")).unwrap();
            assert_eq!(specs[0].labels.values_of("a").collect::<Vec<_>>(), [w]);
        }
        for w in ["true", "false", "True", "FALSE"] {
            let e = parse_specs(&format!("name: a/b/c\nlabels: {{a: {w}}}")).unwrap_err();
            assert!(e.to_string().contains("quote it"), "{w}: {e}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(
            parse_duration("720h").unwrap(),
            Duration::from_secs(720 * 3600)
        );
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_duration("h").is_err());
        assert!(parse_duration("5x").is_err());
        assert_eq!(format_duration(Duration::from_secs(5400)), "1h30m");
        assert_eq!(format_duration(Duration::from_secs(60)), "1m");
    }

    #[test]
    fn codec_names_are_rotarys_and_gazettes_in_any_case() {
        let cases = [
            (Codec::None, ["none", "NONE", "None"]),
            (Codec::Gzip, ["gzip", "GZIP", "Gzip"]),
            (Codec::Zstd, ["zstd", "ZSTANDARD", "zstandard"]),
            (Codec::Snappy, ["snappy", "SNAPPY", "Snappy"]),
            (
                Codec::GzipOffload,
                [
                    "gzip_offload_decompression",
                    "GZIP_OFFLOAD_DECOMPRESSION",
                    "Gzip_Offload_Decompression",
                ],
            ),
        ];
        for (codec, names) in cases {
            for name in names {
                assert_eq!(Codec::from_name(name), Some(codec), "{name}");
                let yaml = format!("name: a/b/c\nfragment: {{compression_codec: {name}}}");
                let specs = parse_specs(&yaml).unwrap();
                assert_eq!(specs[0].fragment.compression_codec, codec, "{name}");
                // Printed back as rotary's name, which reads back the same.
                let json = serde_json::to_value(&specs[0]).unwrap();
                assert_eq!(json["fragment"]["compression_codec"], codec.name());
                let yaml = serde_yaml::to_string(&specs).unwrap();
                assert!(
                    yaml.contains(&format!("compression_codec: {}\n", codec.name())),
                    "{yaml}"
                );
                assert_eq!(parse_specs(&yaml).unwrap(), specs);
            }
        }
        assert_eq!(Codec::Zstd.gazette_name(), "ZSTANDARD");
        assert_eq!(Codec::GzipOffload.to_string(), "gzip_offload_decompression");
        for bad in ["lz4", "zst", "gz", "", "INVALID", "gzip-offload"] {
            assert_eq!(Codec::from_name(bad), None, "{bad}");
        }
        let e = parse_specs("name: a/b/c\nfragment: {compression_codec: lz4}")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"lz4\"") && e.contains("zstd") && e.contains("ZSTANDARD"),
            "{e}"
        );
        let e = parse_specs("name: a/b/c\nfragment: {compression_codec: 2}").unwrap_err();
        assert!(e.to_string().contains("compression codec"), "{e}");
    }

    #[test]
    fn codec_extensions_are_gazettes_ignoring_case() {
        let cases: [(&str, Option<Codec>); 17] = [
            (".raw", Some(Codec::None)),
            (".RAW", Some(Codec::None)),
            (".gz", Some(Codec::Gzip)),
            (".gzip", Some(Codec::Gzip)),
            (".GZip", Some(Codec::Gzip)),
            (".zst", Some(Codec::Zstd)),
            (".zstandard", Some(Codec::Zstd)),
            (".ZST", Some(Codec::Zstd)),
            (".sz", Some(Codec::Snappy)),
            (".snappy", Some(Codec::Snappy)),
            (".SNAPPY", Some(Codec::Snappy)),
            ("", Some(Codec::GzipOffload)),
            (".gzod", Some(Codec::GzipOffload)),
            (".GZOD", Some(Codec::GzipOffload)),
            (".lz4", None),
            (".zstd", None),
            ("gz", None),
        ];
        for (ext, codec) in cases {
            assert_eq!(Codec::from_extension(ext), codec, "{ext:?}");
        }
        // What is written reads back as the same codec.
        for codec in Codec::ALL {
            assert_eq!(Codec::from_extension(codec.extension()), Some(codec));
        }
        assert_eq!(Codec::GzipOffload.extension(), "");
    }

    #[test]
    fn gzip_offload_needs_an_s3_first_store() {
        let spec = |stores: &str| {
            parse_specs(&format!(
                "name: a/b/c\nfragment: {{compression_codec: GZIP_OFFLOAD_DECOMPRESSION, stores: [{stores}]}}"
            ))
        };
        let e = spec("file:///var/store/").unwrap_err().to_string();
        assert!(
            e.contains("gzip_offload_decompression") && e.contains("file:///var/store/"),
            "{e}"
        );
        // An S3 store first takes it; a file store behind it is only read.
        spec("s3://bucket/p/").unwrap();
        spec("s3://bucket/p/, file:///var/store/").unwrap();
        // Without stores fragments stay local: nothing is written with it.
        spec("").unwrap();
    }

    #[test]
    fn spec_yaml_shape() {
        let text = r#"
- name: orders/part-000
  replication: 1
  labels: {app: orders}
  durability: fsync
  fragment:
    length: 536870912
    compression_codec: zstd
    stores: [file:///var/lib/rotary/store/]
    refresh_interval: 1m
    retention: 720h
    flush_interval: 6h
"#;
        let specs = parse_specs(text).unwrap();
        assert_eq!(specs.len(), 1);
        let s = &specs[0];
        assert_eq!(s.durability, Durability::Fsync);
        assert_eq!(s.fragment.retention, Duration::from_secs(720 * 3600));
        let back = serde_yaml::to_string(&specs).unwrap();
        assert_eq!(parse_specs(&back).unwrap(), specs);
        let e = parse_specs("name: x/y/z\nbogus: 1")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"x/y/z\"") && e.contains("unknown field `bogus`"),
            "{e}"
        );
        let e = parse_specs("- name: a/b/c\n- name: d/e/f\n  fragment: {flush_interval: 5x}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"d/e/f\"") && e.contains("5x"), "{e}");
        let e = parse_specs("- {replication: 2}").unwrap_err().to_string();
        assert!(e.contains("entry 0") && e.contains("name"), "{e}");
        // Input that is no spec at all is named as the input, not as a
        // spec with an empty name.
        let e = parse_specs("just text").unwrap_err().to_string();
        assert_eq!(e, "specs: expected one spec (a mapping) or a list of specs");
        let e = parse_specs("not yaml: [").unwrap_err().to_string();
        assert!(e.starts_with("specs: ") && e.contains("line"), "{e}");
        let e = parse_specs("replication: 2").unwrap_err().to_string();
        assert!(e.starts_with("spec of \"the spec\": "), "{e}");
        assert!(parse_specs("name: ab").is_err());
    }
}
