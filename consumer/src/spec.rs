//! Shard specs and consumer process specs: what an operator applies with
//! `rotary shards apply`, and what each consumer process writes as its
//! member key. Field names and rules are Gazette's (`ShardSpec`,
//! `ConsumerSpec`), so specs move between the two unchanged.
//!
//! Plain data and checks; no I/O. Runs on whichever thread parses.

use rotary_allocator::MemberValue;
use rotary_proto::spec::{
    format_duration, parse_duration, validate_journal_name, Label, LabelSet, SINGLE_VALUE_LABELS,
};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Shortest and longest shard ids, in bytes (Gazette's bounds).
pub const SHARD_ID_LEN_MIN: usize = 4;
pub const SHARD_ID_LEN_MAX: usize = 512;
/// The label every shard has in a selector: its id. A spec may not carry it.
pub const META_LABEL_ID: &str = "id";
/// Transactions close at most this long after they open unless a spec says
/// otherwise.
pub const MAX_TXN_DURATION_DEFAULT: Duration = Duration::from_secs(1);
/// Messages read ahead of the transaction, per shard, unless a spec says
/// otherwise.
pub const RING_BUFFER_SIZE_DEFAULT: u32 = 8192;

/// Why a shard spec or a consumer spec was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardSpecError {
    #[error("shard {id:?}: {why}")]
    Bad { id: String, why: String },
    /// The input as a whole: not YAML or JSON, or not a spec, a list of
    /// specs, or `common:` with `shards:`.
    #[error("shard specs: {why}")]
    Document { why: String },
}

/// One journal a shard reads.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Source {
    pub journal: String,
    /// Offset the shard starts reading at when its checkpoint has none for
    /// the journal (a source added later, or a new shard).
    #[serde(default, skip_serializing_if = "is_default")]
    pub min_offset: u64,
}

/// What a shard does with a source message its application cannot decode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBadMessage {
    /// The shard stops as FAILED, naming the journal and offset: nothing is
    /// skipped that an operator did not decide to skip.
    #[default]
    Fail,
    /// The message is skipped and counted (a metric and a log line per
    /// message); the shard goes on.
    Skip,
}

/// A shard: the long-lived unit of a consumer application's work.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardSpec {
    pub id: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<Source>,
    /// The shard's recovery log is the journal `<prefix>/<id>`; empty for a
    /// shard without a recorded store.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub recovery_log_prefix: String,
    /// etcd keys of the log's hints: `<prefix>/<id>.primary` and
    /// `<prefix>/<id>.backup.<n>`. An absolute, clean path.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub hint_prefix: String,
    /// Verified hints kept besides the primary's.
    #[serde(default, skip_serializing_if = "is_default")]
    pub hint_backups: u32,
    #[serde(default = "max_txn_default", with = "duration_text")]
    pub max_txn_duration: Duration,
    #[serde(default, with = "duration_text", skip_serializing_if = "is_default")]
    pub min_txn_duration: Duration,
    /// No process runs the shard while set.
    #[serde(default, skip_serializing_if = "is_default")]
    pub disable: bool,
    /// Standbys that tail the recovery log, in other zones where possible.
    #[serde(default, skip_serializing_if = "is_default")]
    pub hot_standbys: u32,
    #[serde(default, skip_serializing_if = "LabelSet::is_empty")]
    pub labels: LabelSet,
    /// Transactions do not wait for the ACKs of the last one to be
    /// acknowledged before they commit.
    #[serde(default, skip_serializing_if = "is_default")]
    pub disable_wait_for_ack: bool,
    #[serde(default = "ring_buffer_default")]
    pub ring_buffer_size: u32,
    #[serde(default, skip_serializing_if = "is_default")]
    pub on_bad_message: OnBadMessage,
}

fn is_default<T: Default + PartialEq>(t: &T) -> bool {
    *t == T::default()
}

fn max_txn_default() -> Duration {
    MAX_TXN_DURATION_DEFAULT
}

fn ring_buffer_default() -> u32 {
    RING_BUFFER_SIZE_DEFAULT
}

impl ShardSpec {
    /// A spec with every default and no sources.
    pub fn new(id: impl Into<String>) -> ShardSpec {
        ShardSpec {
            id: id.into(),
            sources: Vec::new(),
            recovery_log_prefix: String::new(),
            hint_prefix: String::new(),
            hint_backups: 0,
            max_txn_duration: MAX_TXN_DURATION_DEFAULT,
            min_txn_duration: Duration::ZERO,
            disable: false,
            hot_standbys: 0,
            labels: LabelSet::new(),
            disable_wait_for_ack: false,
            ring_buffer_size: RING_BUFFER_SIZE_DEFAULT,
            on_bad_message: OnBadMessage::Fail,
        }
    }

    /// Copies the allocator places: a primary and its standbys; none while
    /// the shard is disabled.
    pub fn replication(&self) -> u32 {
        if self.disable {
            0
        } else {
            1 + self.hot_standbys
        }
    }

    /// The recovery log's journal, if the shard has one.
    pub fn recovery_log(&self) -> Option<String> {
        (!self.recovery_log_prefix.is_empty())
            .then(|| format!("{}/{}", self.recovery_log_prefix, self.id))
    }

    /// The etcd key of the primary's hints.
    pub fn hint_primary_key(&self) -> String {
        format!("{}/{}.primary", self.hint_prefix, self.id)
    }

    /// The etcd keys of the verified backup hints, newest first.
    pub fn hint_backup_keys(&self) -> Vec<String> {
        let keys =
            (0..self.hint_backups).map(|i| format!("{}/{}.backup.{i}", self.hint_prefix, self.id));
        keys.collect()
    }

    /// Checks every field by Gazette's rules, and sorts the sources by
    /// journal (a journal named twice is refused).
    pub fn validate(&mut self) -> Result<(), ShardSpecError> {
        validate_shard_id(&self.id)?;
        let id = self.id.clone();
        let bad = |why: String| {
            Err(ShardSpecError::Bad {
                id: id.clone(),
                why,
            })
        };
        if let Some(log) = self.recovery_log() {
            if let Err(e) = validate_journal_name(&log) {
                return bad(format!(
                    "recovery_log_prefix: the log {log:?} is no journal name: {e}"
                ));
            }
            if !is_absolute_clean_file_path(&self.hint_prefix) {
                return bad(format!(
                    "hint_prefix {:?} must be an absolute, clean path that does not end in '/'",
                    self.hint_prefix
                ));
            }
        } else if !self.hint_prefix.is_empty() || self.hint_backups != 0 {
            return bad("hint_prefix and hint_backups need a recovery_log_prefix".into());
        }
        if self.max_txn_duration.is_zero() {
            return bad("max_txn_duration must be above 0".into());
        }
        if self.min_txn_duration > self.max_txn_duration {
            return bad(format!(
                "min_txn_duration {} is above max_txn_duration {}",
                format_duration(self.min_txn_duration),
                format_duration(self.max_txn_duration)
            ));
        }
        if self.ring_buffer_size == 0 {
            return bad("ring_buffer_size must be above 0".into());
        }
        self.validate_labels().or_else(bad)?;
        self.validate_sources().or_else(bad)
    }

    fn validate_labels(&self) -> Result<(), String> {
        if self.labels.values_of(META_LABEL_ID).next().is_some() {
            return Err(format!("labels cannot include label {META_LABEL_ID:?}: selectors match it against the shard's id"));
        }
        let labels: Vec<&Label> = self.labels.iter().collect();
        for pair in labels.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if a.name == b.name && SINGLE_VALUE_LABELS.contains(&a.name.as_str()) {
                return Err(format!(
                    "label {:?} takes one value, not {:?} and {:?}",
                    a.name, a.value, b.value
                ));
            }
        }
        Ok(())
    }

    fn validate_sources(&mut self) -> Result<(), String> {
        for s in &self.sources {
            validate_journal_name(&s.journal).map_err(|e| format!("sources: {e}"))?;
            if i64::try_from(s.min_offset).is_err() {
                return Err(format!(
                    "sources: {}: min_offset {} is beyond any journal",
                    s.journal, s.min_offset
                ));
            }
        }
        self.sources.sort();
        for pair in self.sources.windows(2) {
            if pair[0].journal == pair[1].journal {
                return Err(format!(
                    "sources: journal {:?} is named twice",
                    pair[0].journal
                ));
            }
        }
        Ok(())
    }
}

/// Checks a shard id: 4–512 bytes of letters, digits and `-_+/.=%`, as
/// Gazette's tokens (so never `#`, which the allocator's keys use).
pub fn validate_shard_id(id: &str) -> Result<(), ShardSpecError> {
    let bad = |why: &str| {
        Err(ShardSpecError::Bad {
            id: id.chars().take(80).collect(),
            why: why.into(),
        })
    };
    if id.len() < SHARD_ID_LEN_MIN || id.len() > SHARD_ID_LEN_MAX {
        return bad("an id is 4 to 512 bytes long");
    }
    let token =
        |c: char| c.is_alphanumeric() || matches!(c, '-' | '_' | '+' | '/' | '.' | '=' | '%');
    if !id.chars().all(token) {
        return bad("an id holds only letters, digits and - _ + / . = %");
    }
    Ok(())
}

/// `/a/b`: absolute, no empty, `.` or `..` part, no trailing `/`.
fn is_absolute_clean_file_path(p: &str) -> bool {
    let Some(rest) = p.strip_prefix('/') else {
        return false;
    };
    !rest.is_empty()
        && rest
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..")
}

/// Parses `shards apply` input, YAML or JSON: one spec, a list of specs, or
/// gazctl's form, `common:` (fields every shard takes unless it sets them)
/// with `shards:` (the list). Every spec is checked, and an id named twice
/// is refused.
pub fn parse_shard_specs(text: &str) -> Result<Vec<ShardSpec>, ShardSpecError> {
    let doc: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| document(e.to_string()))?;
    let (common, entries) = match doc {
        serde_yaml::Value::Sequence(entries) => (None, entries),
        serde_yaml::Value::Mapping(m) if m.contains_key("shards") => split_common(m)?,
        v @ serde_yaml::Value::Mapping(_) => (None, vec![v]),
        _ => {
            return Err(document(
                "expected a spec, a list of specs, or common: and shards:".into(),
            ))
        }
    };
    let mut specs = Vec::with_capacity(entries.len());
    for (i, entry) in entries.into_iter().enumerate() {
        specs.push(parse_one(entry, common.as_ref(), i)?);
    }
    let mut ids: Vec<&str> = specs.iter().map(|s| s.id.as_str()).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(ShardSpecError::Bad {
            id: w[0].to_string(),
            why: "the shard is named twice in one apply".into(),
        });
    }
    Ok(specs)
}

fn document(why: String) -> ShardSpecError {
    ShardSpecError::Document { why }
}

type Mapping = serde_yaml::Mapping;

/// gazctl's form: the `common:` mapping and the `shards:` list.
fn split_common(
    mut m: Mapping,
) -> Result<(Option<Mapping>, Vec<serde_yaml::Value>), ShardSpecError> {
    let shards = m.remove("shards").expect("checked");
    let common = match m.remove("common") {
        None => None,
        Some(serde_yaml::Value::Mapping(c)) => Some(c),
        Some(_) => return Err(document("common: must be a mapping of spec fields".into())),
    };
    if let Some((k, _)) = m.iter().next() {
        return Err(document(format!(
            "unknown top-level field {k:?}: expected common: and shards:"
        )));
    }
    match shards {
        serde_yaml::Value::Sequence(entries) => Ok((common, entries)),
        _ => Err(document("shards: must be a list of specs".into())),
    }
}

/// One entry, with `common`'s fields where the entry sets none.
fn parse_one(
    entry: serde_yaml::Value,
    common: Option<&Mapping>,
    i: usize,
) -> Result<ShardSpec, ShardSpecError> {
    let serde_yaml::Value::Mapping(mut m) = entry else {
        return Err(document(format!("entry {i} is not a mapping")));
    };
    let id = m
        .get("id")
        .and_then(|v| v.as_str())
        .map_or_else(|| format!("entry {i}"), str::to_string);
    if let Some(common) = common {
        for (k, v) in common {
            if k.as_str() == Some("id") {
                return Err(document("common: cannot set id".into()));
            }
            if !m.contains_key(k) {
                m.insert(k.clone(), v.clone());
            }
        }
    }
    let mut spec: ShardSpec =
        serde_yaml::from_value(serde_yaml::Value::Mapping(m)).map_err(|e| ShardSpecError::Bad {
            id,
            why: e.to_string(),
        })?;
    spec.validate()?;
    Ok(spec)
}

/// A consumer process's own spec, the value of its member key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsumerSpec {
    /// Where clients reach the process (`HOST:PORT`).
    pub endpoint: String,
    /// Most shards the process runs (primaries and standbys together).
    pub shard_limit: u32,
    /// Set when the process is leaving: its shards move away, standbys
    /// first promoted.
    #[serde(default)]
    pub exiting: bool,
}

impl MemberValue for ConsumerSpec {
    fn limit(&self) -> u32 {
        self.shard_limit
    }

    fn exiting(&self) -> bool {
        self.exiting
    }
}

/// Durations as text (`1s`, `250ms`, `1m30s`) or the bare number 0.
mod duration_text {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_duration(*d))
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Text {
        Str(String),
        Int(i64),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        match Text::deserialize(d)? {
            Text::Str(s) => super::parse_duration(&s).map_err(serde::de::Error::custom),
            Text::Int(0) => Ok(Duration::ZERO),
            Text::Int(n) => Err(serde::de::Error::custom(format!(
                "duration {n}: needs a unit, e.g. {n}s"
            ))),
        }
    }
}
