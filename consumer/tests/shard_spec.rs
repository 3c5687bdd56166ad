//! Shard specs as `rotary shards apply` reads them: Gazette's fields and
//! rules, gazctl's `common:`/`shards:` form, and a clear error for each
//! bad input.

use rotary_allocator::MemberValue;
use rotary_consumer::spec::{
    parse_shard_specs, ConsumerSpec, OnBadMessage, ShardSpec, ShardSpecError, Source,
};
use std::time::Duration;

const GAZCTL_FORM: &str = r#"
common:
  recovery_log_prefix: examples/word-count/recovery-logs
  hint_prefix: /gazette/hints
  hint_backups: 2
  max_txn_duration: 1s
  labels:
    app: word-count
shards:
  - id: shard-000
    sources:
      - journal: examples/word-count/deltas/part-001
        min_offset: 1024
      - journal: examples/word-count/deltas/part-000
  - id: shard-001
    hot_standbys: 1
    max_txn_duration: 250ms
    min_txn_duration: 10ms
    sources:
      - journal: examples/word-count/deltas/part-002
"#;

#[test]
fn gazctls_form_gives_each_shard_the_common_fields_it_does_not_set() {
    let specs = parse_shard_specs(GAZCTL_FORM).unwrap();
    assert_eq!(specs.len(), 2);
    let (a, b) = (&specs[0], &specs[1]);
    assert_eq!(a.id, "shard-000");
    // Sources come back sorted by journal.
    assert_eq!(
        a.sources,
        vec![
            Source {
                journal: "examples/word-count/deltas/part-000".into(),
                min_offset: 0
            },
            Source {
                journal: "examples/word-count/deltas/part-001".into(),
                min_offset: 1024
            },
        ]
    );
    assert_eq!(
        a.recovery_log().as_deref(),
        Some("examples/word-count/recovery-logs/shard-000")
    );
    assert_eq!(a.hint_primary_key(), "/gazette/hints/shard-000.primary");
    assert_eq!(
        a.hint_backup_keys(),
        vec![
            "/gazette/hints/shard-000.backup.0".to_string(),
            "/gazette/hints/shard-000.backup.1".to_string()
        ]
    );
    assert_eq!(a.max_txn_duration, Duration::from_secs(1));
    assert_eq!(a.replication(), 1);
    assert_eq!(
        a.labels.values_of("app").collect::<Vec<_>>(),
        ["word-count"]
    );
    assert_eq!(b.max_txn_duration, Duration::from_millis(250));
    assert_eq!(b.min_txn_duration, Duration::from_millis(10));
    assert_eq!(b.replication(), 2);
    assert_eq!(b.ring_buffer_size, 8192);
    assert_eq!(b.on_bad_message, OnBadMessage::Fail);
}

#[test]
fn a_spec_round_trips_through_json_and_yaml() {
    for spec in parse_shard_specs(GAZCTL_FORM).unwrap() {
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(parse_shard_specs(&json).unwrap(), vec![spec.clone()]);
        let yaml = serde_yaml::to_string(&spec).unwrap();
        assert_eq!(parse_shard_specs(&yaml).unwrap(), vec![spec]);
    }
}

#[test]
fn one_spec_and_a_list_are_taken_too() {
    let one = parse_shard_specs("id: shard-one\nsources: [{journal: in/part-0}]").unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].recovery_log(), None);
    let list = parse_shard_specs("- id: shard-a\n- id: shard-b\n  disable: true").unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(
        list[1].replication(),
        0,
        "a disabled shard is placed nowhere"
    );
}

/// Each bad input, and the words its error must carry.
#[test]
fn bad_specs_are_refused_with_a_reason() {
    let cases: &[(&str, &str)] = &[
        ("id: abc", "4 to 512 bytes"),
        ("id: shard#1", "letters, digits"),
        ("id: shard-1\nsources: [{journal: /abs}]", "sources"),
        (
            "id: shard-1\nsources: [{journal: in/a}, {journal: in/a}]",
            "named twice",
        ),
        ("id: shard-1\nrecovery_log_prefix: logs", "hint_prefix"),
        (
            "id: shard-1\nrecovery_log_prefix: logs\nhint_prefix: hints",
            "absolute",
        ),
        (
            "id: shard-1\nrecovery_log_prefix: logs\nhint_prefix: /hints/",
            "absolute",
        ),
        (
            "id: shard-1\nhint_prefix: /hints",
            "need a recovery_log_prefix",
        ),
        ("id: shard-1\nmax_txn_duration: 0", "above 0"),
        (
            "id: shard-1\nmax_txn_duration: 1s\nmin_txn_duration: 2s",
            "above max_txn_duration",
        ),
        ("id: shard-1\nmax_txn_duration: 5", "needs a unit"),
        (
            "id: shard-1\nlabels: {id: x}",
            "cannot include label \"id\"",
        ),
        (
            "id: shard-1\nlabels: {content-type: [a, b]}",
            "takes one value",
        ),
        ("id: shard-1\ncolour: red", "unknown field"),
        ("id: shard-1\nring_buffer_size: 0", "ring_buffer_size"),
        ("id: shard-1\non_bad_message: ignore", "unknown variant"),
        ("- id: shard-1\n- id: shard-1", "named twice in one apply"),
        ("common: {id: x}\nshards: [{id: shard-1}]", "cannot set id"),
        ("shards: {id: shard-1}", "must be a list"),
        ("shards: []\nextra: 1", "unknown top-level field"),
        ("42", "expected a spec"),
        ("id: [", "shard specs"),
    ];
    for (text, words) in cases {
        let e = parse_shard_specs(text).expect_err(text).to_string();
        assert!(e.contains(words), "{text:?}: {e:?} lacks {words:?}");
    }
}

#[test]
fn the_error_names_the_shard_at_fault() {
    let e =
        parse_shard_specs("- id: shard-good\n- id: shard-bad\n  max_txn_duration: 0").unwrap_err();
    assert!(
        matches!(&e, ShardSpecError::Bad { id, .. } if id == "shard-bad"),
        "{e:?}"
    );
}

#[test]
fn a_consumer_process_tells_the_allocator_its_shard_limit() {
    let spec: ConsumerSpec =
        serde_json::from_str(r#"{"endpoint":"127.0.0.1:9000","shard_limit":4}"#).unwrap();
    assert_eq!(spec.capacity(), 4);
    let leaving = ConsumerSpec {
        exiting: true,
        ..spec
    };
    assert_eq!(leaving.capacity(), 0);
    assert_eq!(leaving.limit(), 4);
    let mut snap = rotary_allocator::Snapshot::<ConsumerSpec>::new("/app", 1);
    let m = snap
        .put_member(
            "/app/members/zone-a#c1",
            br#"{"endpoint":"h:1","shard_limit":2}"#,
            1,
            1,
            7,
        )
        .unwrap();
    assert_eq!(snap.members[&m].spec.shard_limit, 2);
}

#[test]
fn a_new_spec_is_valid_once_it_has_an_id() {
    let mut s = ShardSpec::new("shard-new");
    s.validate().unwrap();
    assert_eq!(s.max_txn_duration, Duration::from_secs(1));
}
