//! Plain-text tables for the CLI.

use rotary_net::client::{FragmentInfo, JournalInfo};
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
        ],
        &rows,
    )
}

pub fn fragments_table(fragments: &[FragmentInfo]) -> String {
    let rows: Vec<Vec<String>> = fragments
        .iter()
        .map(|f| {
            vec![
                f.begin.to_string(),
                f.end.to_string(),
                (f.end - f.begin.min(f.end)).to_string(),
                f.sha1.clone(),
                if f.open {
                    "open".into()
                } else {
                    "sealed".into()
                },
                f.store.clone(),
                f.path.clone(),
            ]
        })
        .collect();
    table(
        &["BEGIN", "END", "LENGTH", "SHA1", "STATE", "STORE", "PATH"],
        &rows,
    )
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
}
