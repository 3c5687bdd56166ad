//! Plain-text tables for the CLI.

use rotary_net::client::{FragmentInfo, JournalInfo, PrunedFragment};
use rotary_net::spec::Durability;

/// Left-aligned columns separated by two spaces, one header row.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, (cell, w)) in cells.zip(&widths).enumerate() {
            if i > 0 {
                l.push_str("  ");
            }
            l.push_str(cell);
            for _ in cell.chars().count()..*w {
                l.push(' ');
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

pub fn journals_table(list: &[JournalInfo]) -> String {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|j| {
            vec![
                j.spec.name.clone(),
                j.spec.replication.to_string(),
                match j.spec.durability {
                    Durability::Replicated => "replicated".into(),
                    Durability::Fsync => "fsync".into(),
                },
                j.spec.labels.to_text(),
                j.route.shard.to_string(),
                j.route.endpoint.clone(),
                match j.route.etcd_revision {
                    // In a cluster on etcd: the revision the route was read at.
                    Some(rev) => format!("{} @{rev}", route_text(&j.route.members)),
                    None => route_text(&j.route.members),
                },
            ]
        })
        .collect();
    table(
        &[
            "NAME",
            "REPLICATION",
            "DURABILITY",
            "LABELS",
            "SHARD",
            "ENDPOINT",
            "ROUTE",
        ],
        &rows,
    )
}

/// `brokers list` as a table.
pub fn brokers_table(members: &[rotary_net::client::MemberInfo]) -> String {
    let rows: Vec<Vec<String>> = members
        .iter()
        .map(|m| {
            vec![
                m.id.clone(),
                m.zone.clone(),
                m.endpoint.clone(),
                match m.journal_limit {
                    0 => "-".into(),
                    n => n.to_string(),
                },
                m.journals.to_string(),
                m.primaries.to_string(),
                if m.exiting { "yes" } else { "no" }.into(),
            ]
        })
        .collect();
    table(
        &[
            "ID",
            "ZONE",
            "ENDPOINT",
            "LIMIT",
            "JOURNALS",
            "PRIMARIES",
            "EXITING",
        ],
        &rows,
    )
}

/// One line of `journals list --watch`: name, spec revision, route (and
/// the etcd revision it was read at), tab-separated.
pub fn watch_line(j: &JournalInfo) -> String {
    let at = j
        .route
        .etcd_revision
        .map_or(String::new(), |r| format!(" @{r}"));
    format!(
        "{}\trevision {}\t{}{at}",
        j.spec.name,
        j.revision,
        route_text(&j.route.members)
    )
}

/// A route as `b1*,b2,b3`: the primary first and starred.
fn route_text(members: &[String]) -> String {
    members
        .iter()
        .enumerate()
        .map(|(i, m)| if i == 0 { format!("{m}*") } else { m.clone() })
        .collect::<Vec<_>>()
        .join(",")
}

/// What a fragment row is: the live spool, a local fragment (whether it
/// reached its store, or `local` for a journal without stores, whose
/// fragments stay on the broker's disk), or an object in a store (one that
/// disagrees with another: `conflicting`, not the journal's history, or
/// `disputed`, not known to be).
fn fragment_state(f: &FragmentInfo) -> &'static str {
    if f.open {
        "open"
    } else if f.damaged.is_some() {
        "damaged"
    } else if f.conflicting.is_some() {
        "conflicting"
    } else if f.disputed.is_some() {
        "disputed"
    } else if f.store != "local" && !f.store.is_empty() {
        "stored"
    } else {
        match f.uploaded {
            Some(true) => "uploaded",
            Some(false) => "uploading",
            None => "local",
        }
    }
}

/// `42s`, `7m`, `3h`, `12d`: the largest whole unit.
pub fn age_text(secs: u64) -> String {
    match secs {
        0..=119 => format!("{secs}s"),
        120..=7199 => format!("{}m", secs / 60),
        7200..=172_799 => format!("{}h", secs / 3600),
        _ => format!("{}d", secs / 86_400),
    }
}

/// One row per fragment, oldest offsets first. `now` is Unix seconds.
pub fn fragments_table(fragments: &[FragmentInfo], now: u64) -> String {
    let rows: Vec<Vec<String>> = fragments
        .iter()
        .map(|f| {
            let codec = serde_json::to_value(f.codec)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            let age = if f.mod_time == 0 {
                "-".to_string()
            } else {
                age_text(now.saturating_sub(f.mod_time))
            };
            vec![
                f.begin.to_string(),
                f.end.to_string(),
                f.end.saturating_sub(f.begin).to_string(),
                f.sha1.clone(),
                codec,
                f.size.to_string(),
                fragment_state(f).to_string(),
                age,
                f.store.clone(),
            ]
        })
        .collect();
    table(
        &[
            "BEGIN", "END", "LENGTH", "SHA1", "CODEC", "SIZE", "STATE", "AGE", "STORE",
        ],
        &rows,
    )
}

/// One line per pruned fragment.
pub fn pruned_lines(pruned: &[PrunedFragment], dry_run: bool) -> String {
    let verb = if dry_run { "would prune" } else { "pruned" };
    let mut out = String::new();
    for p in pruned {
        out.push_str(&format!(
            "{verb} {} [{}, {}) sha1={} age={} store={} key={}{}\n",
            p.journal,
            p.begin,
            p.end,
            p.sha1,
            age_text(p.age_secs),
            p.store,
            p.key,
            if p.conflicting.is_some() {
                " conflicting"
            } else {
                ""
            }
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align() {
        let t = table(
            &["A", "LONGER"],
            &[
                vec!["xyz".into(), "1".into()],
                vec!["q".into(), "22".into()],
            ],
        );
        assert_eq!(t, "A    LONGER\nxyz  1\nq    22\n");
    }

    /// A fragment in each state `rotary fragments` shows, in the order of
    /// its rows below.
    fn fragments_in_each_state() -> Vec<FragmentInfo> {
        let local = FragmentInfo {
            begin: 0,
            end: 4096,
            sha1: "ab".repeat(20),
            codec: rotary_net::spec::Codec::Zstd,
            size: 100,
            store: "local".into(),
            path: "/d/x".into(),
            mod_time: 1000,
            open: false,
            key: None,
            uploaded: Some(true),
            damaged: None,
            conflicting: None,
            disputed: None,
        };
        let stored = FragmentInfo {
            store: "s3://b/p/".into(),
            key: Some("j/x.zst".into()),
            uploaded: None,
            mod_time: 0,
            ..local.clone()
        };
        let waiting = FragmentInfo {
            uploaded: Some(false),
            ..local.clone()
        };
        let no_stores = FragmentInfo {
            uploaded: None,
            ..local.clone()
        };
        let open = FragmentInfo {
            open: true,
            uploaded: None,
            ..local.clone()
        };
        let damaged = FragmentInfo {
            uploaded: Some(false),
            damaged: Some("bytes hash to …".into()),
            ..local.clone()
        };
        let conflicting = FragmentInfo {
            conflicting: Some("holds other bytes than …".into()),
            ..stored.clone()
        };
        let disputed = FragmentInfo {
            disputed: Some("store fragments … and … hold different bytes".into()),
            ..stored.clone()
        };
        vec![
            local,
            stored,
            waiting,
            no_stores,
            open,
            damaged,
            conflicting,
            disputed,
        ]
    }

    #[test]
    fn fragment_rows() {
        let t = fragments_table(&fragments_in_each_state(), 1000 + 3 * 3600);
        let rows: Vec<Vec<&str>> = t.lines().map(|l| l.split_whitespace().collect()).collect();
        assert_eq!(
            rows[0],
            ["BEGIN", "END", "LENGTH", "SHA1", "CODEC", "SIZE", "STATE", "AGE", "STORE"]
        );
        let sha = "ab".repeat(20);
        assert_eq!(
            rows[1],
            ["0", "4096", "4096", &sha, "zstd", "100", "uploaded", "3h", "local"]
        );
        assert_eq!(
            rows[2],
            [
                "0",
                "4096",
                "4096",
                &sha,
                "zstd",
                "100",
                "stored",
                "-",
                "s3://b/p/"
            ]
        );
        let states: Vec<&str> = rows[3..].iter().map(|r| r[6]).collect();
        assert_eq!(
            states,
            [
                "uploading",
                "local",
                "open",
                "damaged",
                "conflicting",
                "disputed"
            ]
        );
        assert_eq!(age_text(59), "59s");
        assert_eq!(age_text(3600), "60m");
        assert_eq!(age_text(90_000), "25h");
        assert_eq!(age_text(200_000), "2d");
    }
}
