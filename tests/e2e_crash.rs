//! End-to-end: dying clients leave no trace; a broker killed with SIGKILL
//! loses nothing it acknowledged and shows no partial append.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::*;
use rand::{Rng, SeedableRng};
use rotary_net::client::Client;
use rotary_net::client::APPEND_CHUNK_LEN;
use rotary_net::wire::{flag, AppendRequest, Op};
use std::io::Write;
use std::process::Stdio;
use std::time::Duration;

fn req(journal: &str) -> AppendRequest {
    AppendRequest {
        journal: journal.to_string(),
        ..Default::default()
    }
}

/// After an interrupted append: the head has not moved, and the next append
/// lands exactly at it and reads back.
async fn assert_no_trace(client: &Client, j: &str, before: &[u8], marker: &[u8]) -> Vec<u8> {
    assert_eq!(write_head(client, j).await, before.len() as u64);
    let r = client.append(&req(j), marker.to_vec()).await.unwrap();
    assert_eq!(
        (r.begin, r.end),
        (before.len() as u64, (before.len() + marker.len()) as u64)
    );
    let mut want = before.to_vec();
    want.extend_from_slice(marker);
    assert_eq!(read_all(client, j).await, want);
    want
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_cli_client_mid_append_leaves_no_trace() {
    let broker = Broker::start();
    let client = broker.client().await;
    let j = "e2e/crash/cli-client";
    create_journal(&client, j, |_| {}).await;
    let before = client
        .append(&req(j), b"committed before".to_vec())
        .await
        .unwrap();
    assert_eq!(before.end, 16);

    let mut child = broker
        .cli(&["append", j])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&vec![b'p'; 200_000]).unwrap();
    stdin.flush().unwrap();
    // Give the CLI time to stream the bytes to the broker (it sends what it
    // has after a few quiet milliseconds).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "the CLI waits for the rest of stdin"
    );
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    drop(stdin);

    assert_no_trace(&client, j, b"committed before", b"after the kill").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_raw_appends_leave_no_trace() {
    let broker = Broker::start();
    let client = broker.client().await;
    let j = "e2e/crash/raw-socket";
    create_journal(&client, j, |_| {}).await;
    let mut all = assert_no_trace(&client, j, b"", b"first").await;
    let endpoint = client.route(j).await.unwrap().endpoint;
    let meta = req(j).encode();

    // 1. An APPEND frame cut off in its payload.
    let whole = frame(Op::APPEND, 0, 1, &meta, &vec![b'x'; 10_000]);
    let mut s = raw_connect(&endpoint);
    s.write_all(&whole[..whole.len() - 4_000]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    drop(s);
    all = assert_no_trace(&client, j, &all, b"-second").await;

    // 2. A whole APPEND with MORE, then a cut-off APPEND_CHUNK.
    let mut s = raw_connect(&endpoint);
    s.write_all(&frame(Op::APPEND, flag::MORE, 1, &meta, &[b'y'; 5_000]))
        .unwrap();
    let chunk = frame(Op::APPEND_CHUNK, 0, 1, &[], &[b'z'; 5_000]);
    s.write_all(&chunk[..100]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    drop(s);
    all = assert_no_trace(&client, j, &all, b"-third").await;

    // 3. Whole frames with MORE, then the connection closes between frames.
    let mut s = raw_connect(&endpoint);
    s.write_all(&frame(Op::APPEND, flag::MORE, 1, &meta, &[b'y'; 5_000]))
        .unwrap();
    s.write_all(&frame(Op::APPEND_CHUNK, flag::MORE, 1, &[], &[b'z'; 5_000]))
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    drop(s);
    all = assert_no_trace(&client, j, &all, b"-fourth").await;

    // 4. An explicit ABORT answers CANCELLED and commits nothing.
    let mut s = raw_connect(&endpoint);
    s.write_all(&frame(Op::APPEND, flag::MORE, 2, &meta, b"aborted"))
        .unwrap();
    s.write_all(&frame(Op::APPEND_CHUNK, flag::ABORT, 2, &[], &[]))
        .unwrap();
    let f = read_raw_frame(&mut s).unwrap().expect("APPEND_REPLY");
    assert_eq!(
        (f.op, f.request_id, f.status),
        (Op::APPEND_REPLY, 2, rotary_net::Status::CANCELLED as u16)
    );
    drop(s);
    assert_no_trace(&client, j, &all, b"-fifth").await;
}

const CRASH_WRITERS: u32 = 6;
const CRASH_SIZE_MAX: usize = 64 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_broker_loses_no_acknowledged_append() {
    let mut broker = Broker::start();
    let j = "e2e/crash/broker";
    {
        let client = broker.client().await;
        create_journal(&client, j, |s| s.fragment.length = 1 << 20).await;
    }

    // Writers on two connections append self-describing records until the
    // broker dies; each remembers what was acknowledged.
    let clients = [broker.client().await, broker.client().await];
    let mut tasks = Vec::new();
    for writer in 0..CRASH_WRITERS {
        let client = clients[writer as usize % 2].clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(0xc4a5 ^ u64::from(writer));
            let mut acked = Vec::new();
            let mut seq = 0u32;
            loop {
                // Now and then an append big enough to go in several
                // frames, so the kill can land in the middle of one.
                let len = if rng.gen_ratio(1, 150) {
                    rng.gen_range(APPEND_CHUNK_LEN..3 * APPEND_CHUNK_LEN)
                } else {
                    log_uniform_size(&mut rng, RECORD_HEADER_LEN, CRASH_SIZE_MAX)
                };
                match client.append(&req(j), record(writer, seq, len)).await {
                    Ok(r) => {
                        assert_eq!(r.end - r.begin, len as u64);
                        acked.push((
                            Found {
                                begin: r.begin,
                                end: r.end,
                                writer,
                                seq,
                            },
                            r.sha1,
                        ));
                    }
                    // The broker died: this append's outcome is unknown.
                    Err(e) => {
                        assert!(e.status().is_none(), "append failed with a status: {e}");
                        break;
                    }
                }
                seq += 1;
            }
            acked
        }));
    }
    // Let them run, then SIGKILL the broker mid-stream.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    broker.kill9();
    let mut acked = Vec::new();
    for t in tasks {
        acked.extend(t.await.unwrap());
    }
    drop(clients);
    assert!(
        acked.len() > 50,
        "only {} appends acknowledged before the kill",
        acked.len()
    );

    broker.restart();
    let client = broker.client().await;
    let bytes = read_all(&client, j).await;
    let head = bytes.len() as u64;

    // Every visible byte belongs to a whole record...
    let found = parse_records(&bytes, 0).unwrap_or_else(|e| panic!("after restart: {e}"));
    let found: std::collections::HashMap<u64, Found> =
        found.into_iter().map(|f| (f.begin, f)).collect();
    // ...and every acknowledged append is there, byte for byte.
    for (a, sha) in &acked {
        assert!(a.end <= head, "acknowledged {a:?} lost: head is {head}");
        assert_eq!(
            found.get(&a.begin),
            Some(a),
            "acknowledged append missing or different at {}",
            a.begin
        );
        assert_eq!(&sha1(&bytes[a.begin as usize..a.end as usize]), sha);
    }
    eprintln!(
        "{} acknowledged appends, {} records, {} bytes survived",
        acked.len(),
        found.len(),
        head
    );

    // The journal goes on from its head.
    let r = client.append(&req(j), record(99, 0, 100)).await.unwrap();
    assert_eq!((r.begin, r.end), (head, head + 100));
    let (tail, _) = read_range(&client, j, head, None).await.unwrap();
    assert_eq!(tail, record(99, 0, 100));
}

/// A content source that follows a script: bytes, pauses, a failure, or
/// nothing ever again.
enum Step {
    Data(Vec<u8>),
    Wait(Duration),
    Fail,
    Stall,
}

struct Scripted {
    steps: std::collections::VecDeque<Step>,
    sleep: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl Scripted {
    fn new(steps: Vec<Step>) -> Self {
        Scripted {
            steps: steps.into(),
            sleep: None,
        }
    }
}

impl tokio::io::AsyncRead for Scripted {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        loop {
            match self.steps.front_mut() {
                None => return Poll::Ready(Ok(())),
                Some(Step::Data(d)) => {
                    let n = d.len().min(buf.remaining());
                    buf.put_slice(&d[..n]);
                    d.drain(..n);
                    if d.is_empty() {
                        self.steps.pop_front();
                    }
                    return Poll::Ready(Ok(()));
                }
                Some(Step::Wait(d)) => {
                    let d = *d;
                    let sleep = self
                        .sleep
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep(d)));
                    match sleep.as_mut().poll(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(()) => {
                            self.sleep = None;
                            self.steps.pop_front();
                        }
                    }
                }
                Some(Step::Fail) => {
                    return Poll::Ready(Err(std::io::Error::other("the disk is on fire")))
                }
                Some(Step::Stall) => return Poll::Pending,
            }
        }
    }
}

use std::future::Future;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_client_appends_roll_back_at_once() {
    let broker = Broker::start();
    let client = broker.client().await;
    let j = "e2e/crash/abandoned";
    create_journal(&client, j, |_| {}).await;
    let mut all = assert_no_trace(&client, j, b"", b"start").await;

    // The content reader fails after some bytes went out: the client sends
    // ABORT and reports the reader's error.
    let reader = Scripted::new(vec![
        Step::Data(vec![b'a'; 50_000]),
        Step::Wait(Duration::from_millis(100)),
        Step::Data(vec![b'b'; 10]),
        Step::Wait(Duration::from_millis(100)),
        Step::Fail,
    ]);
    let err = client.append_stream(&req(j), reader).await.unwrap_err();
    assert!(
        matches!(err, rotary_net::client::ClientError::Content(_)),
        "{err}"
    );
    // The journal is free at once (not after the broker's idle timeout).
    all = tokio::time::timeout(
        Duration::from_secs(5),
        assert_no_trace(&client, j, &all, b"-after-error"),
    )
    .await
    .expect("the aborted append no longer holds the journal");

    // The caller gives up on an append whose reader stalls: dropping the
    // future sends ABORT.
    let reader = Scripted::new(vec![Step::Data(vec![b'c'; 70_000]), Step::Stall]);
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        client.append_stream(&req(j), reader),
    )
    .await;
    assert!(gave_up.is_err(), "the stalled append cannot finish");
    all = tokio::time::timeout(
        Duration::from_secs(5),
        assert_no_trace(&client, j, &all, b"-after-drop"),
    )
    .await
    .expect("the dropped append no longer holds the journal");

    // A read abandoned half-way is cancelled; the connection goes on.
    let big = vec![b'r'; 4 << 20];
    client.append(&req(j), big.clone()).await.unwrap();
    all.extend_from_slice(&big);
    let r = rotary_net::wire::ReadRequest {
        journal: j.into(),
        offset: Some(0),
        end_offset: None,
        route_revision: 0,
    };
    let mut stream = client.read(&r, false, false).await.unwrap();
    assert!(matches!(
        stream.next().await.unwrap().unwrap(),
        rotary_net::client::ReadEvent::Data { offset: 0, .. }
    ));
    drop(stream);
    client.ping().await.unwrap();
    assert_eq!(read_all(&client, j).await, all);
}

/// Spec changes survive `kill -9` whole or not at all, whether they went to
/// the change log or into a new specs.json: changes of 400 specs each fold
/// the log into a new snapshot every few rounds, and the broker is killed
/// with one in flight. After each restart every journal carries the last
/// acknowledged round, or the one in flight, the same for all 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spec_changes_survive_kill9_whole_across_snapshots() {
    const JOURNALS: usize = 400;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut broker = Broker::start_with_cores(1);
    let names: Vec<String> = (0..JOURNALS)
        .map(|i| format!("e2e/spec-kill/j-{i:03}"))
        .collect();
    let specs = |round: u32| -> Vec<rotary_net::spec::JournalSpec> {
        let labels =
            rotary_net::spec::LabelSet::from_pairs([("round", round.to_string().as_str())])
                .unwrap();
        names
            .iter()
            .map(|n| {
                let mut s = rotary_net::spec::JournalSpec::new(n);
                s.labels = labels.clone();
                s
            })
            .collect()
    };
    let mut round = 0u32;
    for kill in 0..3 {
        let client = broker.client().await;
        let mut acked = None;
        for _ in 0..rng.gen_range(12..24) {
            round += 1;
            client.apply(&specs(round)).await.unwrap();
            acked = Some(round);
        }
        // One more in flight, and the broker killed under it.
        round += 1;
        let in_flight = {
            let client = client.clone();
            let specs = specs(round);
            tokio::spawn(async move { client.apply(&specs).await })
        };
        tokio::time::sleep(Duration::from_micros(rng.gen_range(0..3_000))).await;
        broker.kill9();
        let answered = in_flight.await.unwrap().is_ok();
        drop(client);
        broker.start_again();
        let client = broker.client().await;
        let listed = client.list("").await.unwrap();
        assert_eq!(listed.len(), JOURNALS, "kill {kill}");
        let rounds: std::collections::BTreeSet<String> =
            listed.iter().map(|j| j.spec.labels.to_text()).collect();
        assert_eq!(
            rounds.len(),
            1,
            "kill {kill}: a change was taken in part: {rounds:?}"
        );
        let got = rounds.into_iter().next().unwrap();
        let last = format!("round={}", acked.unwrap());
        let next = format!("round={round}");
        if answered {
            assert_eq!(got, next, "kill {kill}: an acknowledged change was lost");
        } else {
            assert!(
                got == last || got == next,
                "kill {kill}: {got}, acknowledged {last}"
            );
        }
    }
    // The log was folded into new snapshots on the way.
    let generation = std::fs::read_dir(&broker.data)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter_map(|n| {
            let g = n.strip_prefix("specs.")?.strip_suffix(".log")?;
            g.parse::<u64>().ok()
        })
        .max()
        .expect("a change log");
    assert!(
        generation >= 3,
        "only specs.{generation}.log after {round} changes"
    );
}

/// Specs, deletes and data survive `kill -9`; a journal re-created after a
/// delete starts empty, before and after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn specs_and_deletes_survive_kill9() {
    let mut broker = Broker::start();
    let (a, b) = ("e2e/restart/kept", "e2e/restart/deleted");
    {
        let client = broker.client().await;
        create_journal(&client, a, |s| {
            s.labels = rotary_net::spec::LabelSet::from_pairs([("keep", "yes")]).unwrap()
        })
        .await;
        create_journal(&client, b, |_| {}).await;
        client
            .append(&req(a), b"kept bytes".to_vec())
            .await
            .unwrap();
        client
            .append(&req(b), b"deleted bytes".to_vec())
            .await
            .unwrap();
        client.delete(b).await.unwrap();
        assert_eq!(
            status_of(client.append(&req(b), b"x".to_vec()).await),
            rotary_net::Status::JOURNAL_NOT_FOUND
        );
    }
    broker.restart();
    let client = broker.client().await;
    let listed = client.list("").await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].spec.name, a);
    assert_eq!(listed[0].spec.labels.to_text(), "keep=yes");
    assert_eq!(read_all(&client, a).await, b"kept bytes".to_vec());

    // Re-created, the deleted journal is empty: its old bytes are gone.
    create_journal(&client, b, |_| {}).await;
    assert_eq!(write_head(&client, b).await, 0);
    let r = client.append(&req(b), b"fresh".to_vec()).await.unwrap();
    assert_eq!((r.begin, r.end), (0, 5));
    broker.restart();
    let client = broker.client().await;
    assert_eq!(read_all(&client, b).await, b"fresh".to_vec());
    assert_eq!(read_all(&client, a).await, b"kept bytes".to_vec());
}

/// Starts `rotary serve` on the stopped `broker`'s data directory and
/// expects it to refuse to start; returns what it printed.
fn start_refused(broker: &Broker) -> String {
    let port = free_port_range(broker.cores);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_rotary"))
        .arg("serve")
        .arg("--data")
        .arg(&broker.data)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--cores")
        .arg(broker.cores.to_string())
        .arg("--disk-reserve")
        .arg("0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + READY_TIMEOUT;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline || raw_ping(&format!("127.0.0.1:{port}")) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "rotary serve started on a damaged data directory:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "rotary serve exited with success");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    text
}

/// Every file under `dir` (but the lock) with its bytes.
fn files_of(dir: &std::path::Path) -> std::collections::BTreeMap<std::path::PathBuf, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                dirs.push(e.path());
            } else if e.file_name() != "LOCK" {
                out.insert(e.path(), std::fs::read(e.path()).unwrap());
            }
        }
    }
    out
}

/// A broker of one shard with a journal holding three acknowledged
/// appends, killed with SIGKILL. Returns the journal's bytes.
async fn three_appends_then_kill9(broker: &mut Broker, j: &str) -> Vec<u8> {
    let client = broker.client().await;
    create_journal(&client, j, |_| {}).await;
    let mut all = Vec::new();
    for (i, len) in [5usize, 40_000, 300].into_iter().enumerate() {
        let bytes = vec![b'a' + i as u8; len];
        let r = client.append(&req(j), bytes.clone()).await.unwrap();
        assert_eq!(r.begin, all.len() as u64);
        all.extend_from_slice(&bytes);
    }
    drop(client);
    broker.kill9();
    all
}

/// A shard whose commit log is gone holds spools that nothing says are
/// committed: the broker refuses to start rather than drop them and give
/// out their offsets again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_log_stops_the_start() {
    let mut broker = Broker::start_with_cores(1);
    let j = "e2e/damage/no-commit-log";
    let all = three_appends_then_kill9(&mut broker, j).await;
    let log = broker.data.join("shard-0/commit.log");
    refused_until_restored(&mut broker, &log, None, "commit.log is missing", j, &all).await;
}

/// Damages `file` (removes it, or writes `damaged` over it), checks that
/// the broker refuses to start saying `why` and changes no file, then
/// puts the file back and checks that every byte of `all` reads back.
async fn refused_until_restored(
    broker: &mut Broker,
    file: &std::path::Path,
    damaged: Option<Vec<u8>>,
    why: &str,
    j: &str,
    all: &[u8],
) {
    let kept = std::fs::read(file).unwrap();
    match damaged {
        Some(bytes) => std::fs::write(file, bytes).unwrap(),
        None => std::fs::remove_file(file).unwrap(),
    }
    let before = files_of(&broker.data);
    let out = start_refused(broker);
    assert!(out.contains("corrupt data") && out.contains(why), "{out}");
    assert!(
        files_of(&broker.data) == before,
        "the refused start changed files"
    );
    // Nothing was lost: with the file back, every append is there.
    std::fs::write(file, kept).unwrap();
    broker.start_again();
    let client = broker.client().await;
    assert!(read_all(&client, j).await == all);
}

/// A damaged byte in the middle of the commit log is no torn tail: the
/// broker refuses to start and leaves the log as it is, instead of cutting
/// off every record after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_commit_log_stops_the_start_and_is_kept_whole() {
    let mut broker = Broker::start_with_cores(1);
    let j = "e2e/damage/flipped-byte";
    let all = three_appends_then_kill9(&mut broker, j).await;
    let log = broker.data.join("shard-0/commit.log");
    let mut bad = std::fs::read(&log).unwrap();
    bad[20] ^= 0xff;
    refused_until_restored(&mut broker, &log, Some(bad), "no torn last write", j, &all).await;
}

/// A spool file that the commit log does not name is no reason to drop the
/// one it names: recovery reopens the named one and leaves the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stray_spool_does_not_replace_the_committed_one() {
    let mut broker = Broker::start_with_cores(1);
    let j = "e2e/damage/stray-spool";
    let mut all = three_appends_then_kill9(&mut broker, j).await;
    let dir = broker.data.join("shard-0/journals").join(j).join("@");
    let stray = dir.join("00000000000000ff.spool");
    std::fs::write(&stray, b"").unwrap();
    broker.start_again();
    let client = broker.client().await;
    assert!(read_all(&client, j).await == all);
    let r = client.append(&req(j), b"after".to_vec()).await.unwrap();
    assert_eq!((r.begin, r.end), (all.len() as u64, all.len() as u64 + 5));
    all.extend_from_slice(b"after");
    assert!(stray.exists(), "the stray spool was removed");
    drop(client);
    broker.restart();
    let client = broker.client().await;
    assert!(read_all(&client, j).await == all);
}

/// Without specs.json the broker would know no journal, and one applied
/// again would start over beside its old files: it refuses to start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_specs_stop_the_start() {
    let mut broker = Broker::start_with_cores(1);
    let j = "e2e/damage/no-specs";
    let all = three_appends_then_kill9(&mut broker, j).await;
    let specs = broker.data.join("specs.json");
    refused_until_restored(&mut broker, &specs, None, "specs.json is missing", j, &all).await;
}

/// A journal created over a directory that already holds its fragments
/// goes on after them: new bytes get offsets of their own, and a restart
/// serves both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_created_over_old_files_goes_on_after_them() {
    let j = "e2e/damage/old-files";
    let old = b"old bytes".to_vec();
    let mut a = Broker::start_with_cores(1);
    {
        let client = a.client().await;
        create_journal(&client, j, |_| {}).await;
        client.append(&req(j), old.clone()).await.unwrap();
        client.seal(j).await.unwrap().expect("a fragment");
    }
    a.kill9();
    let from = a.data.join("shard-0/journals").join(j).join("@");

    let mut b = Broker::start_with_cores(1);
    let to = b.data.join("shard-0/journals").join(j).join("@");
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(&from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    let client = b.client().await;
    create_journal(&client, j, |_| {}).await;
    let r = client.append(&req(j), b"new".to_vec()).await.unwrap();
    assert_eq!((r.begin, r.end), (old.len() as u64, old.len() as u64 + 3));
    let want = [&old[..], b"new"].concat();
    assert!(read_all(&client, j).await == want);
    drop(client);
    b.restart();
    let client = b.client().await;
    assert!(read_all(&client, j).await == want);
}

/// Bytes the broker hashed at its last start to check its spools.
async fn recovery_hashed(client: &Client) -> u64 {
    let stats = client.stats().await.unwrap();
    stats["recovery_hashed_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no recovery_hashed_bytes in {stats}"))
}

/// After a crash of the broker alone, a start hashes only each spool's last
/// batch; after a reboot (here: the shard's `recovered-in` stamp gone) it
/// hashes every spool whole, and finds a byte changed anywhere in one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_reads_whole_spools_only_after_a_reboot() {
    const MIB: usize = 1 << 20;
    let mut broker = Broker::start_with_cores(1);
    let j = "e2e/recovery/hashed";
    let client = broker.client().await;
    create_journal(&client, j, |s| s.fragment.length = 1 << 30).await;
    let mut all = Vec::new();
    for i in 0..12u8 {
        let bytes = vec![i; MIB];
        let r = client.append(&req(j), bytes.clone()).await.unwrap();
        assert_eq!(r.begin, all.len() as u64);
        all.extend_from_slice(&bytes);
    }
    drop(client);
    broker.kill9();

    // The same boot: at most the last append's batch, not 12 MiB.
    broker.start_again();
    let client = broker.client().await;
    let hashed = recovery_hashed(&client).await;
    assert!(hashed <= (MIB + 64) as u64, "hashed {hashed} bytes");
    assert!(read_all(&client, j).await == all);
    let r = client.append(&req(j), b"tail".to_vec()).await.unwrap();
    assert_eq!(r.begin, all.len() as u64);
    all.extend_from_slice(b"tail");
    drop(client);
    broker.kill9();

    // As after a reboot: the spool is hashed whole.
    let shard = broker.data.join("shard-0");
    let stamp = shard.join("recovered-in");
    assert!(
        stamp.exists(),
        "no recovered-in stamp in {}",
        shard.display()
    );
    std::fs::remove_file(&stamp).unwrap();
    broker.start_again();
    let client = broker.client().await;
    assert_eq!(recovery_hashed(&client).await, all.len() as u64);
    assert!(read_all(&client, j).await == all);
    drop(client);
    broker.kill9();

    // A byte changed in the middle of the spool, then a reboot: the start
    // is refused, and with the byte back every append reads back.
    std::fs::remove_file(&stamp).unwrap();
    let spool = shard
        .join("journals")
        .join(j)
        .join("@/0000000000000000.spool");
    let mut bad = std::fs::read(&spool).unwrap();
    bad[5 * MIB + 7] ^= 0x40;
    refused_until_restored(&mut broker, &spool, Some(bad), "matches neither", j, &all).await;
}

/// A broker that stops answering (here: stopped with SIGSTOP, as a hung
/// process or a machine gone from the network would look) fails the
/// client's waiting requests with a timeout, while a live broker keeps
/// an idle tail open for as long as it waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gives_up_on_a_broker_that_stopped_answering() {
    use rotary_net::client::{ClientError, ClientOptions, ReadEvent};
    use rotary_net::wire::ReadRequest;
    let broker = Broker::start();
    // Long enough that a PONG delayed by a loaded machine still counts.
    let silence = Duration::from_secs(1);
    let options = ClientOptions {
        silence,
        ..ClientOptions::default()
    };
    let client = Client::connect_with(&broker.endpoint(), options)
        .await
        .unwrap();
    let j = "e2e/silence/tail";
    create_journal(&client, j, |_| {}).await;
    let first = client.append(&req(j), b"first".to_vec()).await.unwrap();

    // A tail at the head waits five times the silence without an error:
    // the broker answers the client's PINGs.
    let at_head = ReadRequest {
        journal: j.into(),
        offset: Some(first.end),
        end_offset: None,
        route_revision: 0,
    };
    let mut tail = client.read(&at_head, true, false).await.unwrap();
    let quiet = tokio::time::timeout(silence * 5, tail.next()).await;
    assert!(quiet.is_err(), "the tail waits quietly: {quiet:?}");
    client.append(&req(j), b"second".to_vec()).await.unwrap();
    match tail.next().await.unwrap().unwrap() {
        ReadEvent::Data { offset, content } => {
            assert_eq!((offset, &content[..]), (first.end, &b"second"[..]))
        }
        other => panic!("{other:?}"),
    }

    // Stopped, the broker answers nothing: the tail and an append sent
    // after the stop both fail with a timeout within about twice the
    // silence.
    let pid = broker.pid().unwrap();
    stop_process(pid);
    let started = std::time::Instant::now();
    let never = req(j);
    let append = client.append(&never, b"never".to_vec());
    let (ev, appended) = tokio::time::timeout(Duration::from_secs(20), async {
        tokio::join!(tail.next(), append)
    })
    .await
    .expect("the client gives up on a stopped broker within 20 s");
    let waited = started.elapsed();
    continue_process(pid);
    let timed_out = |e: &ClientError| matches!(e, ClientError::Io { source, .. } if source.kind() == std::io::ErrorKind::TimedOut);
    match ev {
        Some(Err(e)) => assert!(timed_out(&e), "tail: {e}"),
        other => panic!("tail: {other:?}"),
    }
    let e = appended.unwrap_err();
    assert!(timed_out(&e) && e.is_retryable(), "append: {e}");
    // Two silences from the last byte heard, which may be a PONG up to a
    // silence before the stop.
    assert!(waited >= silence * 3 / 4, "gave up after {waited:?}");

    // Running again, the broker has what was acknowledged. The append the
    // client gave up on was sent to a stopped broker; whether it committed
    // is unknown to the client (the error says retryable, outcome
    // unknown), so the read takes either.
    let got = read_all(&client, j).await;
    assert!(
        got == b"firstsecond" || got == b"firstsecondnever",
        "{:?}",
        String::from_utf8_lossy(&got)
    );
}

/// The local fragment files under a data directory, by begin offset.
fn raw_fragments(dir: &std::path::Path) -> std::collections::BTreeMap<u64, std::path::PathBuf> {
    files_of(dir)
        .into_keys()
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?.to_string();
            let begin = name.strip_suffix(".raw")?.split('-').next()?;
            Some((u64::from_str_radix(begin, 16).ok()?, p))
        })
        .collect()
}

/// A fragment file found on disk at start is checked against its name
/// before it serves a read: one whose bytes were changed is never served
/// (the read fails with IO_ERROR), while its neighbours read as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_local_fragment_found_at_start_is_never_served() {
    let mut broker = Broker::start_with_cores(1);
    let j = "crash/damaged-fragment";
    let client = broker.client().await;
    create_journal(&client, j, |_| {}).await;
    let mut all = Vec::new();
    for (i, len) in [70_000usize, 5_000].into_iter().enumerate() {
        let bytes: Vec<u8> = (0..len).map(|k| (k * 7 + i * 13) as u8).collect();
        let r = client.append(&req(j), bytes.clone()).await.unwrap();
        assert_eq!(r.begin, all.len() as u64);
        all.extend_from_slice(&bytes);
        client
            .seal(j)
            .await
            .unwrap()
            .expect("a non-empty spool seals");
    }
    drop(client);
    broker.kill9();

    let frags = raw_fragments(&broker.data);
    assert_eq!(
        frags.keys().copied().collect::<Vec<_>>(),
        vec![0, 70_000],
        "{frags:?}"
    );
    let first = &frags[&0];
    let mut bytes = std::fs::read(first).unwrap();
    bytes[12_345] ^= 0x40;
    std::fs::write(first, &bytes).unwrap();

    broker.start_again();
    let client = broker.client().await;
    let req_at = |offset: u64, end: Option<u64>| rotary_net::wire::ReadRequest {
        journal: j.to_string(),
        offset: Some(offset),
        end_offset: end,
        route_revision: 0,
    };
    // The damaged fragment: refused, and again on a second read.
    for _ in 0..2 {
        let (status, done) = read_status(&client, &req_at(0, Some(70_000)), false).await;
        assert_eq!(status, rotary_net::Status::IO_ERROR, "{done:?}");
        let done = done.expect("READ_DONE");
        assert_eq!(done.offset, 0, "{done:?}");
    }
    // Its neighbour was checked and reads whole.
    let (got, done) = read_range(&client, j, 70_000, None).await.expect("read");
    assert_eq!(done.status, rotary_net::Status::OK, "{done:?}");
    assert_eq!(sha1(&got), sha1(&all[70_000..]));
    let stats = client.stats().await.unwrap();
    assert_eq!(stats["fragments_checked"], 2, "{stats}");
    assert_eq!(stats["fragments_check_failed"], 1, "{stats}");
    assert!(
        broker
            .log()
            .contains("does not hold the bytes its name says"),
        "{}",
        broker.log()
    );
    // The bytes written in place, the fragment reads again (after a start:
    // a fragment found corrupt is not read again by this broker).
    bytes[12_345] ^= 0x40;
    std::fs::write(first, &bytes).unwrap();
    broker.restart();
    let client = broker.client().await;
    assert_eq!(sha1(&read_all(&client, j).await), sha1(&all));
}
