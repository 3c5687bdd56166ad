//! Seeded simulation of the spool state machine against a model: random
//! sequences of stage, write, commit, rewind, rollback, recover and seal,
//! checking after every step that the file holds exactly the committed
//! bytes and that SHA-1 states agree. A failing seed replays exactly.

use rand::{rngs::StdRng, Rng, SeedableRng};
use rotary_storage::fragment::parse_fragment_name;
use rotary_storage::spool::{read_range, Check, CommitPoint, Spool};
use rotary_storage::wal::Midstate;
use sha1::{Digest, Sha1};

struct Model {
    begin: u64,
    /// Committed bytes of the open spool.
    committed: Vec<u8>,
    /// Staged but uncommitted bytes (some may be written).
    pending: Vec<u8>,
}

async fn check_file(spool: &Spool, m: &Model) {
    let (buf, range) = read_range(spool.file(), 0, m.committed.len())
        .await
        .unwrap();
    assert_eq!(&buf.as_slice()[range], &m.committed[..], "file content");
    let sum: [u8; 20] = Sha1::digest(&m.committed).into();
    assert_eq!(spool.committed_sha1(), sum, "committed sha1");
    assert_eq!(spool.committed(), m.begin + m.committed.len() as u64);
}

async fn write(spool: &mut Spool) {
    spool.write_staged().await.unwrap();
}

/// Writes and commits everything staged. Returns the commit point and the
/// midstate its commit record would carry (where its bytes began).
async fn commit_all(
    spool: &mut Spool,
    m: &mut Model,
    marks: &mut Vec<(CommitPoint, usize)>,
) -> (CommitPoint, Midstate) {
    write(spool).await;
    let mid = spool.committed_midstate();
    let point = spool.commit_point();
    spool.commit(point.clone());
    m.committed.append(&mut m.pending);
    marks.clear();
    (point, mid)
}

/// A check of the commit ending at `end`, hashed from the spool's start or,
/// with `mid`, from that midstate on.
fn check(end: u64, sha1: [u8; 20], begin: u64, mid: Option<Midstate>) -> Check {
    Check {
        end,
        sha1,
        from: mid.map(|m| {
            (
                m.at,
                m.resume(begin, end).expect("a midstate of this spool"),
            )
        }),
    }
}

/// Checks hashed from the spool's start only.
fn whole(candidates: &[(u64, [u8; 20])], begin: u64) -> Vec<Check> {
    candidates
        .iter()
        .map(|&(end, sha1)| check(end, sha1, begin, None))
        .collect()
}

async fn run(seed: u64, dir: &std::path::Path) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut spool = Spool::create(dir, 0).await.unwrap();
    let mut m = Model {
        begin: 0,
        committed: Vec::new(),
        pending: Vec::new(),
    };
    let mut last_commit: CommitPoint = spool.commit_point();
    // The midstate the commit log's record of the last commit carries:
    // where the bytes it committed began.
    let mut last_mid = spool.committed_midstate();
    // Staged points above the last commit, with the model's pending length
    // there (a replica drops appends staged after one it keeps).
    let mut marks: Vec<(CommitPoint, usize)> = Vec::new();
    let mut fragments = Vec::new();
    for _ in 0..60 {
        match rng.gen_range(0..100) {
            0..=39 => {
                // Stage bytes, writing whenever the buffer fills.
                let n = if rng.gen_bool(0.1) {
                    rng.gen_range(1..6_000_000)
                } else if rng.gen_bool(0.2) {
                    // Up to a block boundary: a rewind there needs no
                    // tail block read back.
                    let past = (spool.staged() - m.begin) as usize % 4096;
                    (4096 - past) % 4096 + 4096 * rng.gen_range(0..3)
                } else {
                    rng.gen_range(0..9000)
                };
                let bytes: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
                spool.ensure_allocated(n as u64, 0).unwrap();
                let mut at = 0;
                while at < bytes.len() {
                    at += spool.stage(&bytes[at..]);
                    if at < bytes.len() {
                        write(&mut spool).await;
                    }
                }
                m.pending.extend_from_slice(&bytes);
                if rng.gen_bool(0.5) {
                    marks.push((spool.commit_point(), m.pending.len()));
                }
            }
            40..=44 => {
                // A write in flight while more is staged, and maybe
                // rewound below the write's end, as a shard stages its next
                // batch while the last one is written. The write may fail.
                let Some(w) = spool.take_write() else {
                    check_file(&spool, &m).await;
                    continue;
                };
                assert!(spool.write_in_flight());
                let file = spool.file().clone();
                let n = rng.gen_range(0..9000);
                let bytes: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
                spool.ensure_allocated(n as u64, 0).unwrap();
                let took = spool.stage(&bytes);
                m.pending.extend_from_slice(&bytes[..took]);
                if rng.gen_bool(0.5) {
                    marks.push((spool.commit_point(), m.pending.len()));
                }
                if !marks.is_empty() && rng.gen_bool(0.4) {
                    let i = rng.gen_range(0..marks.len());
                    let (point, len) = marks[i].clone();
                    marks.truncate(i + 1);
                    spool.rewind(point);
                    m.pending.truncate(len);
                    if spool.can_stage() && rng.gen_bool(0.5) {
                        // Staging goes on from a rewind that kept the
                        // tail block (or landed on a block boundary).
                        let more: Vec<u8> =
                            (0..rng.gen_range(0..5000)).map(|_| rng.gen()).collect();
                        spool.ensure_allocated(more.len() as u64, 0).unwrap();
                        let took = spool.stage(&more);
                        m.pending.extend_from_slice(&more[..took]);
                    }
                }
                let (res, w) = w.run(&file).await;
                res.unwrap();
                let ok = rng.gen_bool(0.85);
                spool.write_done(w, ok);
                assert!(!spool.write_in_flight());
                if !ok {
                    // A failed write discards everything uncommitted.
                    assert_eq!(spool.staged(), spool.committed());
                    m.pending.clear();
                    marks.clear();
                }
                spool.load_tail().await.unwrap();
                if rng.gen_bool(0.5) {
                    (last_commit, last_mid) = commit_all(&mut spool, &mut m, &mut marks).await;
                }
            }
            45..=69 => {
                // Write and commit everything staged.
                (last_commit, last_mid) = commit_all(&mut spool, &mut m, &mut marks).await;
            }
            75..=79 if !marks.is_empty() => {
                // Rewind to a staged point above the commit, written or not.
                let i = rng.gen_range(0..marks.len());
                if rng.gen_bool(0.5) {
                    write(&mut spool).await;
                }
                let (point, len) = marks[i].clone();
                marks.truncate(i + 1);
                spool.rewind(point);
                spool.load_tail().await.unwrap();
                m.pending.truncate(len);
                // What stays staged commits exactly.
                if rng.gen_bool(0.5) {
                    (last_commit, last_mid) = commit_all(&mut spool, &mut m, &mut marks).await;
                }
            }
            70..=79 => {
                // Rewind to the last commit (an aborted append).
                if rng.gen_bool(0.5) {
                    write(&mut spool).await;
                }
                spool.rewind(last_commit.clone());
                spool.load_tail().await.unwrap();
                m.pending.clear();
                marks.clear();
            }
            80..=87 => {
                // Crash. The commit log's last record may name the staged
                // bytes (its write completed, the spool's maybe not):
                // recovery takes it only if the bytes on disk hash to it,
                // and otherwise falls back to the record before it. After
                // a reboot it hashes the spool from its start; after a
                // crash of the process, only each record's last batch.
                if rng.gen_bool(0.5) {
                    write(&mut spool).await;
                }
                let all_on_disk = spool.written() == spool.staged();
                let path = spool.path().to_path_buf();
                let staged_end = spool.staged();
                let mut both = m.committed.clone();
                both.extend_from_slice(&m.pending);
                let staged_sum: [u8; 20] = Sha1::digest(&both).into();
                let end = spool.committed();
                let want = spool.committed_sha1();
                let staged_mid = spool.committed_midstate();
                drop(spool);
                let same_boot = rng.gen_bool(0.5);
                let candidates = [
                    check(
                        staged_end,
                        staged_sum,
                        m.begin,
                        same_boot.then_some(staged_mid),
                    ),
                    check(end, want, m.begin, same_boot.then_some(last_mid)),
                ];
                let (found, hashed) =
                    Spool::recover_checked(path, m.begin, &candidates, Default::default())
                        .await
                        .unwrap();
                let (s, i) = found.expect("the committed state always matches");
                assert_eq!(i, usize::from(!all_on_disk), "chosen candidate");
                let most = if same_boot {
                    (staged_end - staged_mid.at) + (end - last_mid.at)
                } else {
                    staged_end - m.begin
                };
                assert!(hashed <= most, "hashed {hashed} bytes, at most {most}");
                if i == 0 {
                    m.committed = both;
                }
                spool = s;
                last_commit = spool.commit_point();
                last_mid = spool.committed_midstate();
                m.pending.clear();
                marks.clear();
            }
            _ => {
                // Seal (only with nothing uncommitted) and start anew.
                spool.rewind(last_commit.clone());
                spool.load_tail().await.unwrap();
                m.pending.clear();
                let end = spool.committed();
                let frag = spool.seal(rng.gen_bool(0.3)).await.unwrap();
                match frag {
                    None => assert!(m.committed.is_empty()),
                    Some(f) => {
                        let name = f.path.file_name().unwrap().to_str().unwrap().to_string();
                        let (b, e, sum, ext) = parse_fragment_name(&name).unwrap();
                        assert_eq!((b, e, ext), (m.begin, end, ".raw"));
                        let bytes = std::fs::read(&f.path).unwrap();
                        assert_eq!(bytes, m.committed, "sealed fragment bytes");
                        assert_eq!(<[u8; 20]>::from(Sha1::digest(&bytes)), sum);
                        fragments.push(f);
                    }
                }
                m.begin = end;
                m.committed.clear();
                marks.clear();
                spool = Spool::create(dir, end).await.unwrap();
                last_commit = spool.commit_point();
                last_mid = spool.committed_midstate();
            }
        }
        check_file(&spool, &m).await;
    }
    // A commit log that disagrees with the file is detected on recovery.
    write(&mut spool).await;
    if !m.committed.is_empty() {
        let path = spool.path().to_path_buf();
        let end = spool.committed();
        let want = spool.committed_sha1();
        drop(spool);
        let (_, sum) = Spool::recover(path.clone(), m.begin, end - 1)
            .await
            .unwrap();
        assert_ne!(sum, want, "a shorter committed end hashes differently");
        // Past the written bytes but inside the preallocation: zeros hash
        // differently, which is what recovery checks against the log.
        let len = std::fs::metadata(&path).unwrap().len();
        let slack = (m.begin + len).saturating_sub(end).min(4096);
        if slack > 0 {
            let (_, sum) = Spool::recover(path.clone(), m.begin, end + slack)
                .await
                .unwrap();
            assert_ne!(sum, want);
        }
        let long = Spool::recover(path.clone(), m.begin, end + (1 << 30)).await;
        assert!(long.is_err(), "a committed end past the file is corrupt");
        // Candidates that do not match, or lie past the file, are skipped.
        let mut wrong = want;
        wrong[0] ^= 1;
        let candidates = whole(
            &[(end + (1 << 30), want), (end, wrong), (end - 1, want)],
            m.begin,
        );
        let (none, _) =
            Spool::recover_checked(path.clone(), m.begin, &candidates, Default::default())
                .await
                .unwrap();
        assert!(none.is_none(), "no candidate matches");
        let candidates = whole(
            &[(end + (1 << 30), want), (end, wrong), (end, want)],
            m.begin,
        );
        let (s, i) = Spool::recover_checked(path.clone(), m.begin, &candidates, Default::default())
            .await
            .unwrap()
            .0
            .expect("the last candidate matches");
        assert_eq!((i, s.committed(), s.committed_sha1()), (2, end, want));
        drop(s);
        // From a midstate, only the bytes after it are hashed; a byte
        // changed after it is found, one before it is not looked at.
        let mut sha = rotary_storage::sha::Sha1::new();
        sha.update(&m.committed[..(m.committed.len() - 1) / 64 * 64]);
        let mid = Midstate::of(m.begin, &sha);
        let candidates = [check(end, want, m.begin, Some(mid))];
        let (found, hashed) =
            Spool::recover_checked(path.clone(), m.begin, &candidates, Default::default())
                .await
                .unwrap();
        assert_eq!(found.map(|(s, i)| (i, s.committed())), Some((0, end)));
        assert_eq!(hashed, end - mid.at);
        let (_, sum) = Spool::recover(path.clone(), m.begin, end).await.unwrap();
        assert_eq!(sum, want);
        let flip = |at: u64| {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap();
            let mut b = [0u8];
            f.read_exact_at(&mut b, at - m.begin).unwrap();
            f.write_all_at(&[b[0] ^ 1], at - m.begin).unwrap();
        };
        flip(end - 1);
        let (found, _) =
            Spool::recover_checked(path.clone(), m.begin, &candidates, Default::default())
                .await
                .unwrap();
        assert!(found.is_none(), "a changed byte after the midstate");
        flip(end - 1);
        if mid.at > m.begin {
            flip(mid.at - 1);
            let (found, _) =
                Spool::recover_checked(path.clone(), m.begin, &candidates, Default::default())
                    .await
                    .unwrap();
            assert!(found.is_some(), "bytes before the midstate are not read");
            let (found, _) = Spool::recover_checked(
                path,
                m.begin,
                &whole(&[(end, want)], m.begin),
                Default::default(),
            )
            .await
            .unwrap();
            assert!(found.is_none(), "hashed whole, the changed byte is found");
        }
    }
}

#[test]
fn seeded_spool_simulation() {
    let rt = compio::runtime::Runtime::new().unwrap();
    let seeds: u64 = std::env::var("SPOOL_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    for seed in 0..seeds {
        let dir = tempfile::tempdir().unwrap();
        rt.block_on(run(seed, dir.path()));
    }
}

#[test]
fn simulation_is_deterministic() {
    // Same seed, same operation sequence: the resulting files are identical.
    let rt = compio::runtime::Runtime::new().unwrap();
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    rt.block_on(run(7, a.path()));
    rt.block_on(run(7, b.path()));
    let list = |d: &std::path::Path| {
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().into_string().unwrap(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(list(a.path()), list(b.path()));
}
