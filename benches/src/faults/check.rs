//! The checks after a fault run, made from outside the brokers: each
//! member's own copy of each journal (pinned reads that are not proxied:
//! a member answers with the bytes it holds itself, and for history it
//! holds only in a store, with that fragment's location, which the checks
//! open), and the fragment store's files, listed and decoded here. They
//! return violations as sentences; none means the run kept every promise.
//!
//! * Every acknowledged append is served by every member — from its own
//!   disk, or from the store fragment it points at (a replica drops its
//!   copies once the store holds them) — and is in the store, at the
//!   offsets its acknowledgement gave, with the SHA-1 it gave. A member
//!   that skips an acknowledged append, or points past it, fails.
//! * No torn bytes: every copy and every stored fragment is a run of
//!   whole, intact records.
//! * The members agree wherever two hold the same offsets, and so do any
//!   two stored fragments.
//! * Every stored fragment's bytes have the SHA-1 and length its name says.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use super::cluster::Cluster;
use super::load::{hex, parse_records, sha1, Ack};
use rotary_net::client::{Client, ReadEvent, ReadOptions};
use rotary_net::wire::ReadRequest;
use rotary_net::Status;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// Reads of one copy: each ends at a fragment only the store holds, and
/// the next goes on after it.
const READS_PER_COPY_MAX: usize = 10_000;
/// Violations reported per kind and journal; more are counted.
const VIOLATIONS_LISTED_MAX: usize = 5;

/// A journal as one member holds it: spans of bytes in offset order.
#[derive(Debug, Default)]
pub struct Spans(pub Vec<(u64, Vec<u8>)>);

impl Spans {
    fn push(&mut self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        let end = self.end();
        match self.0.last_mut() {
            Some((_, last)) if offset == end => last.extend_from_slice(bytes),
            _ if offset < end => return Err(format!("data at {offset} before {end}")),
            _ => self.0.push((offset, bytes.to_vec())),
        }
        Ok(())
    }

    fn end(&self) -> u64 {
        self.0.last().map_or(0, |(o, b)| o + b.len() as u64)
    }

    /// The ranges held, for messages.
    fn ranges(&self) -> String {
        let all: Vec<String> = self
            .0
            .iter()
            .map(|(o, b)| format!("[{o}, {})", *o + b.len() as u64))
            .collect();
        all.join(" ")
    }

    /// The bytes at `[begin, end)`, if one span holds all of them.
    fn get(&self, begin: u64, end: u64) -> Option<&[u8]> {
        self.0.iter().find_map(|(o, b)| {
            let e = o + b.len() as u64;
            (*o <= begin && end <= e).then(|| &b[(begin - o) as usize..(end - o) as usize])
        })
    }
}

/// Collects violations, listing the first few of each kind.
#[derive(Debug, Default)]
pub struct Violations {
    pub listed: Vec<String>,
    /// Per kind: how many were found.
    pub counts: BTreeMap<String, usize>,
}

impl Violations {
    pub fn add(&mut self, kind: &str, what: String) {
        let n = self.counts.entry(kind.to_string()).or_default();
        *n += 1;
        if *n <= VIOLATIONS_LISTED_MAX {
            self.listed.push(what);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    pub fn total(&self) -> usize {
        self.counts.values().sum()
    }
}

/// One journal of the run, as the checks need it.
pub struct Journal<'a> {
    pub name: &'a str,
    pub replication: usize,
    pub acks: Vec<&'a Ack>,
}

/// Checks every journal on every member and in the store under
/// `store_root`. The cluster must be whole again: its journals are given
/// `settle` to be routed to healthy brokers, and the store as long to hold
/// every acknowledged append (spools seal at `flush_interval`).
pub async fn check(
    cluster: &Cluster,
    journals: &[Journal<'_>],
    store_root: &Path,
    settle: Duration,
) -> Violations {
    let mut v = Violations::default();
    for j in journals {
        check_members(cluster, j, settle, &mut v).await;
        check_store(j, &store_root.join(j.name), settle, &mut v).await;
    }
    v
}

async fn check_members(cluster: &Cluster, j: &Journal<'_>, settle: Duration, v: &mut Violations) {
    let info = match cluster.settled(j.name, j.replication, settle).await {
        Ok(info) => info,
        Err(e) => return v.add("unsettled", format!("{}: {e:#}", j.name)),
    };
    let acked_end = j.acks.iter().map(|a| a.end).max().unwrap_or(0);
    let mut copies = Vec::new();
    for id in &info.route.members {
        let Ok(i) = cluster.index(id) else {
            v.add("members", format!("{}: unknown member {id}", j.name));
            continue;
        };
        match member_copy(&cluster.brokers[i].endpoint, j.name, acked_end).await {
            Ok(c) => copies.push((id.clone(), c)),
            Err(e) => v.add("unreadable", format!("{}: {id}'s copy: {e}", j.name)),
        }
    }
    for (id, copy) in &copies {
        let what = format!(
            "{} on {id} (holding {}; pointing at the store for {})",
            j.name,
            copy.local.ranges(),
            copy.stored.ranges()
        );
        check_spans(&what, &copy.local, v);
        for a in &j.acks {
            check_ack(&what, a, copy.served(a.begin, a.end), v);
        }
    }
    for (n, (a_id, a)) in copies.iter().enumerate() {
        for (b_id, b) in &copies[n + 1..] {
            if let Some(at) = disagreement(&a.local.0, &b.local.0) {
                v.add(
                    "members disagree",
                    format!(
                        "{}: {a_id} and {b_id} hold different bytes at {at:?}",
                        j.name
                    ),
                );
            }
        }
    }
}

/// Each span of a copy is whole records.
fn check_spans(what: &str, spans: &Spans, v: &mut Violations) {
    for (offset, bytes) in &spans.0 {
        if let Err(e) = parse_records(bytes, *offset) {
            v.add("torn", format!("{what}: {e}"));
        }
    }
}

/// The bytes found for acknowledged append `a` are its bytes.
fn check_ack(what: &str, a: &Ack, found: Option<&[u8]>, v: &mut Violations) {
    let (w, s, b, e) = (a.writer, a.seq, a.begin, a.end);
    match found {
        None => v.add(
            "acked missing",
            format!("{what}: acknowledged append ({w}, {s}) at [{b}, {e}) is not held"),
        ),
        Some(bytes) if sha1(bytes) != a.sha1 => v.add(
            "acked differs",
            format!(
                "{what}: [{b}, {e}) has SHA-1 {}, the ack of ({w}, {s}) gave {}",
                hex(&sha1(bytes)),
                hex(&a.sha1)
            ),
        ),
        Some(bytes) => match parse_records(bytes, b) {
            Ok(f) if f.len() == 1 && (f[0].writer, f[0].seq) == (w, s) => {}
            other => v.add(
                "acked differs",
                format!("{what}: [{b}, {e}) is not append ({w}, {s}): {other:?}"),
            ),
        },
    }
}

/// The first range where two sets of spans hold different bytes.
fn disagreement(a: &[(u64, Vec<u8>)], b: &[(u64, Vec<u8>)]) -> Option<(u64, u64)> {
    for (ao, ab) in a {
        for (bo, bb) in b {
            let begin = (*ao).max(*bo);
            let end = (ao + ab.len() as u64).min(bo + bb.len() as u64);
            if begin < end {
                let mine = &ab[(begin - ao) as usize..(end - ao) as usize];
                let theirs = &bb[(begin - bo) as usize..(end - bo) as usize];
                if mine != theirs {
                    return Some((begin, end));
                }
            }
        }
    }
    None
}

/// What one member serves of a journal: the bytes it holds itself, and
/// those it points at in a store, each read from that store's file.
#[derive(Debug, Default)]
pub struct MemberCopy {
    pub local: Spans,
    pub stored: Spans,
}

impl MemberCopy {
    /// The bytes at `[begin, end)` as the member serves them.
    fn served(&self, begin: u64, end: u64) -> Option<&[u8]> {
        self.local
            .get(begin, end)
            .or_else(|| self.stored.get(begin, end))
    }
}

/// What broker `endpoint` serves of `journal` from offset 0 up to at
/// least `to`, read pinned and not proxied: its own bytes as READ_DATA,
/// and for history only a store holds, the fragment's location, opened
/// here (the run's stores are `file://`).
async fn member_copy(endpoint: &str, journal: &str, to: u64) -> Result<MemberCopy, String> {
    let client = Client::connect_pinned(endpoint)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let fragments = client
        .fragments(journal)
        .await
        .map_err(|e| format!("fragments: {e}"))?;
    let head = fragments.iter().map(|f| f.end).max().unwrap_or(to).max(to);
    let mut copy = MemberCopy::default();
    let mut at = 0;
    for _ in 0..READS_PER_COPY_MAX {
        if at >= head {
            break;
        }
        let Some(next) = read_copy(&client, journal, at, head, &mut copy).await? else {
            // The member holds no more (its head is behind): what it
            // lacks shows as acknowledged appends not served.
            break;
        };
        if next <= at {
            return Err(format!("read at {at} ended at {next}"));
        }
        at = next;
    }
    Ok(copy)
}

/// One pinned, unproxied read of `[at, head)` into `copy`. Returns where
/// it ended, or `None` if the member refused it (it holds no more).
async fn read_copy(
    client: &Client,
    journal: &str,
    at: u64,
    head: u64,
    copy: &mut MemberCopy,
) -> Result<Option<u64>, String> {
    let req = ReadRequest {
        journal: journal.into(),
        offset: Some(at),
        end_offset: Some(head),
        route_revision: 0,
    };
    let options = ReadOptions {
        block: false,
        metadata_only: false,
        do_not_proxy: true,
    };
    let mut stream = client
        .read_with(&req, options)
        .await
        .map_err(|e| format!("read at {at}: {e}"))?;
    loop {
        match stream.next().await {
            Some(Ok(ReadEvent::Data { offset, content })) => copy.local.push(offset, &content)?,
            Some(Ok(ReadEvent::Fragment {
                begin,
                end,
                offset,
                location,
                ..
            })) => {
                let bytes = stored_bytes(&location, begin, end)?;
                let from = (offset - begin) as usize;
                copy.stored.push(offset, &bytes[from..])?;
            }
            Some(Ok(ReadEvent::Done(done))) if done.status == Status::OK => {
                return Ok(Some(done.offset))
            }
            Some(Ok(ReadEvent::Done(_))) => return Ok(None),
            Some(Err(e)) => return Err(format!("read at {at}: {e}")),
            None => return Err(format!("read at {at} ended without READ_DONE")),
        }
    }
}

/// The bytes of the store fragment `[begin, end)` at `location`, a
/// `file://` URL; they must be as long as the fragment.
fn stored_bytes(location: &str, begin: u64, end: u64) -> Result<Vec<u8>, String> {
    let path = location
        .strip_prefix("file://")
        .ok_or_else(|| format!("the member pointed at {location}, not a file:// store"))?;
    let bytes = std::fs::read(path).map_err(|e| format!("{location}: {e}"))?;
    if bytes.len() as u64 != end - begin {
        return Err(format!(
            "{location} holds {} bytes for [{begin}, {end})",
            bytes.len()
        ));
    }
    Ok(bytes)
}

/// A stored fragment, decoded and checked against its name.
struct Stored {
    name: String,
    begin: u64,
    bytes: Vec<u8>,
}

async fn check_store(j: &Journal<'_>, dir: &Path, settle: Duration, v: &mut Violations) {
    let acked_end = j.acks.iter().map(|a| a.end).max().unwrap_or(0);
    // Spools seal at their flush interval and are uploaded then.
    let deadline = Instant::now() + settle;
    while covered_to(&names(dir)) < acked_end && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut stored = Vec::new();
    for name in names(dir) {
        let Some((begin, end, digest, ext)) = parse_name(&name) else {
            v.add(
                "store names",
                format!("{}: {name:?} is not <begin>-<end>-<sha1>.<ext>", j.name),
            );
            continue;
        };
        let Ok(bytes) = std::fs::read(dir.join(&name)) else {
            v.add("store names", format!("{}: {name} cannot be read", j.name));
            continue;
        };
        if ext != ".raw" {
            v.add(
                "store names",
                format!("{}: {name}: the run's journals are not compressed", j.name),
            );
            continue;
        }
        if bytes.len() as u64 != end - begin || hex(&sha1(&bytes)) != digest {
            v.add(
                "store sha1",
                format!(
                    "{}: {name} holds {} bytes of SHA-1 {}",
                    j.name,
                    bytes.len(),
                    hex(&sha1(&bytes))
                ),
            );
            continue;
        }
        if let Err(e) = parse_records(&bytes, begin) {
            v.add("torn", format!("{} in the store, {name}: {e}", j.name));
        }
        stored.push(Stored { name, begin, bytes });
    }
    for (n, a) in stored.iter().enumerate() {
        for b in &stored[n + 1..] {
            let one = [(a.begin, a.bytes.clone())];
            let other = [(b.begin, b.bytes.clone())];
            if let Some(at) = disagreement(&one, &other) {
                v.add(
                    "store fragments disagree",
                    format!("{}: {} and {} differ at {at:?}", j.name, a.name, b.name),
                );
            }
        }
    }
    let what = format!("{} in the store", j.name);
    for a in &j.acks {
        let found = stored.iter().find_map(|f| {
            let e = f.begin + f.bytes.len() as u64;
            (f.begin <= a.begin && a.end <= e)
                .then(|| &f.bytes[(a.begin - f.begin) as usize..(a.end - f.begin) as usize])
        });
        check_ack(&what, a, found, v);
    }
}

/// Fragment files in `dir` (not staging files `<name>#<n>`, not
/// directories of longer journals).
fn names(dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            !n.rsplit_once('#')
                .is_some_and(|(_, k)| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect();
    out.sort();
    out
}

/// `<begin:016x>-<end:016x>-<sha1:40 hex><ext>` → (begin, end, sha1, ext).
fn parse_name(name: &str) -> Option<(u64, u64, String, String)> {
    let dot = name.find('.')?;
    let (stem, ext) = name.split_at(dot);
    let parts: Vec<&str> = stem.split('-').collect();
    let lower_hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if parts.len() != 3
        || !lower_hex(parts[0], 16)
        || !lower_hex(parts[1], 16)
        || !lower_hex(parts[2], 40)
    {
        return None;
    }
    let begin = u64::from_str_radix(parts[0], 16).ok()?;
    let end = u64::from_str_radix(parts[1], 16).ok()?;
    (begin < end).then(|| (begin, end, parts[2].to_string(), ext.to_string()))
}

/// How far from 0 the named fragments cover without a gap.
fn covered_to(names: &[String]) -> u64 {
    let mut spans: Vec<(u64, u64)> = names
        .iter()
        .filter_map(|n| parse_name(n))
        .map(|(b, e, _, _)| (b, e))
        .collect();
    spans.sort_unstable();
    let mut covered = 0;
    for (b, e) in spans {
        if b > covered {
            break;
        }
        covered = covered.max(e);
    }
    covered
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragment_names_parse_exactly() {
        let sha = "0123456789abcdef0123456789abcdef01234567";
        let name = format!("{:016x}-{:016x}-{sha}.raw", 16, 4096);
        assert_eq!(
            parse_name(&name),
            Some((16, 4096, sha.to_string(), ".raw".to_string()))
        );
        assert_eq!(
            parse_name(&format!("{:016x}-{:016x}-{sha}.raw", 5, 5)),
            None
        );
        assert_eq!(parse_name(&format!("{:x}-{:016x}-{sha}.raw", 0, 5)), None);
        assert_eq!(
            parse_name(&format!("{:016x}-{:016x}-{}.raw", 0, 5, sha.to_uppercase())),
            None
        );
    }

    #[test]
    fn coverage_stops_at_the_first_gap() {
        let sha = "0".repeat(40);
        let n = |b: u64, e: u64| format!("{b:016x}-{e:016x}-{sha}.raw");
        assert_eq!(covered_to(&[n(0, 10), n(5, 20), n(30, 40)]), 20);
        assert_eq!(covered_to(&[n(10, 20)]), 0);
    }

    #[test]
    fn a_member_serves_from_its_disk_or_the_store_and_nothing_between() {
        let mut copy = MemberCopy::default();
        copy.local.push(0, b"abcd").unwrap();
        copy.stored.push(4, b"efgh").unwrap();
        copy.local.push(10, b"kl").unwrap();
        assert_eq!(copy.served(1, 3), Some(&b"bc"[..]));
        assert_eq!(copy.served(5, 8), Some(&b"fgh"[..]));
        assert_eq!(copy.served(10, 12), Some(&b"kl"[..]));
        // Across the seam of its disk and the store, and across a gap.
        assert_eq!(copy.served(3, 5), None);
        assert_eq!(copy.served(8, 10), None);
        assert!(copy.local.push(11, b"x").is_err(), "overlapping data");
    }

    #[test]
    fn a_stored_fragment_is_read_whole_from_a_file_store_only() {
        let dir = std::env::temp_dir().join(format!("rotary-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.raw");
        std::fs::write(&path, b"0123").unwrap();
        let url = format!("file://{}", path.display());
        assert_eq!(stored_bytes(&url, 8, 12).unwrap(), b"0123");
        assert!(stored_bytes(&url, 8, 13).unwrap_err().contains("4 bytes"));
        assert!(stored_bytes("s3://b/f.raw", 8, 12).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn disagreement_is_found_only_where_both_hold_bytes() {
        let a = [(0u64, b"abcdef".to_vec())];
        assert_eq!(disagreement(&a, &[(2, b"cd".to_vec())]), None);
        assert_eq!(disagreement(&a, &[(6, b"zz".to_vec())]), None);
        assert_eq!(disagreement(&a, &[(4, b"eX".to_vec())]), Some((4, 6)));
    }
}
