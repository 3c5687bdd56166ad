//! End-to-end: the HTTP listener of a real `rotary serve` — the gateway's
//! round trips and statuses, its limits against bad and slow clients,
//! `/metrics` checked by `promtool` and scraped by a real Prometheus, and
//! `/readyz` before and after the broker's start.
//!
//! HTTP is spoken over plain TCP sockets here, so that every byte on the
//! wire (chunked bodies, garbage, a client that stalls) is the test's.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::*;
use rotary_net::client::Client;
use rotary_net::wire::AppendRequest;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A broker with its HTTP listener on a free port, and its extra args.
fn broker_with_http(extra: &[&str]) -> (Broker, String) {
    let port = free_port_range(1);
    let http = format!("127.0.0.1:{port}");
    let mut args = vec!["--http".to_string(), http.clone()];
    args.extend(extra.iter().map(|s| s.to_string()));
    let broker = Broker::start_with(
        CORES_DEFAULT,
        BrokerOpts {
            args,
            ..Default::default()
        },
    );
    wait_http_ready(&http);
    (broker, http)
}

/// Waits until `/readyz` answers 200.
fn wait_http_ready(http: &str) {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Ok(r) = try_request(http, "GET", "/readyz", &[], None) {
            if r.status == 200 {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{http}/readyz never said ready");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[derive(Debug)]
struct Answer {
    status: u16,
    headers: HashMap<String, String>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }
}

/// Reads a response's status line and headers.
fn read_head(r: &mut impl BufRead) -> std::io::Result<(u16, HashMap<String, String>)> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "closed before a status line",
        ));
    }
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = HashMap::new();
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').expect("header line");
        headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
    }
    Ok((status, headers))
}

/// Reads one chunk of a chunked body; `None` at its end.
fn read_chunk(r: &mut impl BufRead) -> std::io::Result<Option<Vec<u8>>> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let n = usize::from_str_radix(line.trim(), 16).expect("chunk size");
    let mut chunk = vec![0u8; n + 2];
    r.read_exact(&mut chunk)?;
    chunk.truncate(n);
    Ok((n > 0).then_some(chunk))
}

/// Sends a request's body: `length` whole, or `chunks` chunked.
fn send_body(s: &mut TcpStream, chunks: &[&[u8]], length: Option<&[u8]>) -> std::io::Result<()> {
    if let Some(body) = length {
        s.write_all(body)?;
    } else if !chunks.is_empty() {
        for c in chunks {
            s.write_all(format!("{:x}\r\n", c.len()).as_bytes())?;
            s.write_all(c)?;
            s.write_all(b"\r\n")?;
        }
        s.write_all(b"0\r\n\r\n")?;
    }
    Ok(())
}

/// One request on a connection of its own (`Connection: close`). `chunks`
/// sends the body chunked, one chunk each.
fn try_request(
    http: &str,
    method: &str,
    path: &str,
    chunks: &[&[u8]],
    length: Option<&[u8]>,
) -> std::io::Result<Answer> {
    let mut s = TcpStream::connect(http)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {http}\r\nConnection: close\r\n");
    if let Some(body) = length {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    } else if !chunks.is_empty() {
        head.push_str("Transfer-Encoding: chunked\r\n");
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    // A server that refuses the body may answer and close before it is
    // all sent: the answer is read all the same.
    let sent = send_body(&mut s, chunks, length);
    if let Err(e) = &sent {
        if !matches!(
            e.kind(),
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
        ) {
            sent?;
        }
    }
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r)?;
    let mut body = Vec::new();
    if method != "HEAD" && status != 204 {
        if headers.get("transfer-encoding").map(String::as_str) == Some("chunked") {
            while let Some(c) = read_chunk(&mut r)? {
                body.extend(c);
            }
        } else if let Some(n) = headers.get("content-length") {
            body = vec![0u8; n.parse().unwrap()];
            r.read_exact(&mut body)?;
        } else {
            r.read_to_end(&mut body)?;
        }
    }
    Ok(Answer {
        status,
        headers,
        body,
    })
}

fn request(http: &str, method: &str, path: &str) -> Answer {
    try_request(http, method, path, &[], None).unwrap()
}

fn put(http: &str, path: &str, body: &[u8]) -> Answer {
    try_request(http, "PUT", path, &[], Some(body)).unwrap()
}

fn put_chunked(http: &str, path: &str, chunks: &[&[u8]]) -> Answer {
    try_request(http, "PUT", path, chunks, None).unwrap()
}

fn body_line(a: &Answer) -> String {
    let text = String::from_utf8_lossy(&a.body).to_string();
    assert!(text.ends_with('\n'), "one line: {text:?}");
    assert_eq!(text.lines().count(), 1, "one line: {text:?}");
    text
}

async fn journal(client: &Client, name: &str) {
    create_journal(client, name, |_| {}).await;
}

/// PUT appends the body as one append; GET returns the same bytes with
/// Gazette's headers; HEAD the headers only; chunked bodies work.
#[test]
fn put_then_get_returns_the_bytes_with_gazettes_headers() {
    let rt = runtime();
    let (broker, http) = broker_with_http(&[]);
    let client = rt.block_on(broker.client());
    let name = "e2e/http/round-trip";
    rt.block_on(journal(&client, name));
    let path = format!("/{name}");

    let first = b"hello, journal\n".to_vec();
    let a = put(&http, &path, &first);
    assert_eq!(a.status, 204, "{a:?}");
    assert_eq!(a.header("X-Commit-Begin"), Some("0"));
    assert_eq!(a.header("X-Commit-End"), Some("15"));
    assert_eq!(a.header("X-Write-Head"), Some("15"));
    assert_eq!(a.header("X-Commit-SHA1-Sum"), Some(&*hex_sha1(&first)));

    // Chunked, in pieces: one append of their concatenation.
    let pieces: [&[u8]; 3] = [b"second ", b"append, ", b"chunked\n"];
    let second: Vec<u8> = pieces.concat();
    let a = put_chunked(&http, &path, &pieces);
    assert_eq!(a.status, 204, "{a:?}");
    assert_eq!(a.header("X-Commit-Begin"), Some("15"));
    let end = 15 + second.len() as u64;
    assert_eq!(a.header("X-Commit-End"), Some(&*end.to_string()));
    assert_eq!(a.header("X-Commit-SHA1-Sum"), Some(&*hex_sha1(&second)));

    // A body larger than one native frame is streamed into one append.
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let a = put(&http, &path, &big);
    assert_eq!(a.status, 204, "{a:?}");
    assert_eq!(a.header("X-Commit-Begin"), Some(&*end.to_string()));
    assert_eq!(a.header("X-Commit-SHA1-Sum"), Some(&*hex_sha1(&big)));
    let head = end + big.len() as u64;

    let all = [first.clone(), second.clone(), big.clone()].concat();
    let g = request(&http, "GET", &format!("{path}?offset=0"));
    assert_eq!(g.status, 206, "{g:?}");
    assert_eq!(g.body, all);
    assert_eq!(g.header("X-Write-Head"), Some(&*head.to_string()));
    let fragment = g.header("X-Fragment-Name").expect("X-Fragment-Name");
    assert!(
        fragment.starts_with("0000000000000000-") && fragment.ends_with(".raw"),
        "{fragment}"
    );
    assert_eq!(
        g.header("Content-Range"),
        Some("bytes 0-9223372036854775807/9223372036854775807")
    );
    // The native client reads what the gateway wrote.
    assert_eq!(rt.block_on(read_all(&client, name)), all);

    // From an offset; and HEAD: the same headers, no bytes.
    let g = request(&http, "GET", &format!("{path}?offset=15"));
    assert_eq!(g.status, 206);
    assert_eq!(g.body, all[15..]);
    let h = request(&http, "HEAD", &format!("{path}?offset=15"));
    assert_eq!(h.status, 206, "{h:?}");
    assert_eq!(h.header("X-Write-Head"), Some(&*head.to_string()));
    assert!(h.header("X-Fragment-Name").is_some());
    assert!(h.body.is_empty());
    // The gateway's appends are counted like any other.
    let stats = rt.block_on(client.stats()).unwrap();
    assert_eq!(stats["appends"], 3);
}

/// A blocking GET at the write head streams what a later PUT appends.
#[test]
fn a_blocking_get_is_woken_by_a_later_put() {
    let rt = runtime();
    let (broker, http) = broker_with_http(&[]);
    let client = rt.block_on(broker.client());
    let name = "e2e/http/tail";
    rt.block_on(journal(&client, name));
    let path = format!("/{name}");
    assert_eq!(put(&http, &path, b"before;").status, 204);

    let mut s = TcpStream::connect(&http).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET {path}?offset=-1&block=true HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r).unwrap();
    assert_eq!(status, 206);
    assert_eq!(headers.get("x-write-head").map(String::as_str), Some("7"));

    let writer = {
        let http = http.clone();
        let path = path.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            put(&http, &path, b"woken!")
        })
    };
    let mut got = Vec::new();
    while got.len() < 6 {
        got.extend(read_chunk(&mut r).unwrap().expect("the stream goes on"));
    }
    assert_eq!(got, b"woken!");
    assert_eq!(writer.join().unwrap().status, 204);
}

/// Each status of the mapping, and bad requests: a status and one line.
#[test]
fn statuses_map_as_gazettes_gateway_maps_them() {
    let rt = runtime();
    let (broker, http) = broker_with_http(&[]);
    let client = rt.block_on(broker.client());
    let name = "e2e/http/statuses";
    rt.block_on(journal(&client, name));
    let ro = "e2e/http/read-only";
    rt.block_on(create_journal(&client, ro, |s| {
        s.flags = rotary_net::spec::JournalFlags::ReadOnly
    }));
    assert_eq!(put(&http, &format!("/{name}"), b"12345").status, 204);

    let cases: Vec<(Answer, u16, &str)> = vec![
        // JOURNAL_NOT_FOUND: 404, on reads and appends.
        (
            request(&http, "GET", "/e2e/http/none"),
            404,
            "JOURNAL_NOT_FOUND",
        ),
        (put(&http, "/e2e/http/none", b"x"), 404, "JOURNAL_NOT_FOUND"),
        (request(&http, "HEAD", "/e2e/http/none"), 404, ""),
        // OFFSET_NOT_YET_AVAILABLE: 416, at and beyond the head.
        (
            request(&http, "GET", &format!("/{name}?offset=5")),
            416,
            "OFFSET_NOT_YET_AVAILABLE",
        ),
        (
            request(&http, "GET", &format!("/{name}?offset=-1")),
            416,
            "OFFSET_NOT_YET_AVAILABLE",
        ),
        // A status that is neither: 500.
        (put(&http, &format!("/{ro}"), b"x"), 500, "NOT_ALLOWED"),
        // Malformed requests: 400.
        (
            request(&http, "GET", &format!("/{name}?offset=abc")),
            400,
            "BAD_REQUEST",
        ),
        (
            request(&http, "GET", &format!("/{name}?follow=1")),
            400,
            "BAD_REQUEST",
        ),
        (
            request(&http, "GET", &format!("/{name}?offset=-7")),
            400,
            "BAD_REQUEST",
        ),
        (request(&http, "GET", "/ab"), 400, "BAD_REQUEST"),
        (request(&http, "GET", "/"), 400, "BAD_REQUEST"),
        (
            put(&http, &format!("/{name}?offset=3"), b"x"),
            400,
            "BAD_REQUEST",
        ),
        (
            request(&http, "DELETE", &format!("/{name}")),
            405,
            "METHOD_NOT_ALLOWED",
        ),
        (request(&http, "POST", "/metrics"), 405, ""),
    ];
    for (a, status, line) in cases {
        assert_eq!(a.status, status, "{a:?}");
        if !line.is_empty() {
            let text = body_line(&a);
            assert!(text.starts_with(line), "{status}: {text:?}");
        }
    }
    // None of them appended anything.
    assert_eq!(rt.block_on(write_head(&client, name)), 5);
}

/// A retryable status (STORAGE_FULL) is 503.
#[test]
fn a_retryable_status_is_503() {
    let rt = runtime();
    let (mut broker, http) = broker_with_http(&[]);
    broker.kill9();
    let Some(_mount) = mount_tmpfs(&broker.data, "8m") else {
        panic!("mounting a tmpfs needs root: run the HTTP tests as root");
    };
    broker.start_again();
    wait_http_ready(&http);
    let client = rt.block_on(broker.client());
    let name = "e2e/http/full";
    rt.block_on(journal(&client, name));
    let filler = broker.data.join("filler");
    {
        let mut f = std::fs::File::create(&filler).unwrap();
        let chunk = vec![7u8; 64 << 10];
        while f.write_all(&chunk).is_ok() {}
        while f.write_all(&[7u8; 512]).is_ok() {}
    }
    let mut refused = None;
    for _ in 0..64 {
        let a = put(&http, &format!("/{name}"), &vec![1u8; 256 << 10]);
        if a.status != 204 {
            refused = Some(a);
            break;
        }
    }
    let a = refused.expect("a full disk refuses appends");
    assert_eq!(a.status, 503, "{a:?}");
    assert!(body_line(&a).starts_with("STORAGE_FULL"), "{a:?}");
    std::fs::remove_file(&filler).unwrap();
}

/// A body over the limit is 413, whether its length is declared or it is
/// chunked, and nothing of it is appended.
#[test]
fn a_body_over_the_limit_is_413() {
    let rt = runtime();
    let (broker, http) = broker_with_http(&["--http-body-limit", "1K"]);
    let client = rt.block_on(broker.client());
    let name = "e2e/http/limit";
    rt.block_on(journal(&client, name));
    let path = format!("/{name}");
    assert_eq!(put(&http, &path, &[b'a'; 1024]).status, 204);
    let a = put(&http, &path, &[b'b'; 1025]);
    assert_eq!(a.status, 413, "{a:?}");
    assert!(body_line(&a).starts_with("PAYLOAD_TOO_LARGE"));
    let chunk = [b'c'; 600];
    let a = put_chunked(&http, &path, &[&chunk, &chunk]);
    assert_eq!(a.status, 413, "{a:?}");
    assert!(body_line(&a).starts_with("PAYLOAD_TOO_LARGE"));
    assert_eq!(rt.block_on(write_head(&client, name)), 1024);
    assert_eq!(rt.block_on(read_all(&client, name)), vec![b'a'; 1024]);
}

/// Garbage, a client that never finishes its headers, one that stalls in
/// its body: each gets an error status or a close, while appends through
/// the native client on the same broker go on being acknowledged.
#[test]
fn garbage_and_slow_clients_do_not_hold_appends() {
    let rt = runtime();
    let (broker, http) = broker_with_http(&["--http-timeout", "1s"]);
    let client = rt.block_on(broker.client());
    let name = "e2e/http/hostile";
    rt.block_on(journal(&client, name));

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let appender = {
        let client = client.clone();
        let stop = stop.clone();
        let handle = rt.handle().clone();
        std::thread::spawn(move || {
            let mut acked = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let req = AppendRequest {
                    journal: name.to_string(),
                    ..Default::default()
                };
                handle
                    .block_on(client.append(&req, b"0123456789".to_vec()))
                    .expect("append acknowledged");
                acked += 1;
            }
            acked
        })
    };

    // Slow-loris: headers that never end. Several of them at once.
    let mut loris: Vec<TcpStream> = (0..20)
        .map(|_| {
            let mut s = TcpStream::connect(&http).unwrap();
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                .unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            s
        })
        .collect();
    // A PUT whose body stalls after a few bytes.
    let mut stalled = TcpStream::connect(&http).unwrap();
    stalled
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stalled,
        "PUT /{name} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789"
    )
    .unwrap();
    // Garbage.
    for garbage in [
        &b"HELLO THERE\r\n\r\n"[..],
        b"\x00\x01\x02\x03\xff\xfe\r\n\r\n",
        b"GET /healthz HTTP/9.9\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nContent-Length: banana\r\n\r\n",
    ] {
        let mut s = TcpStream::connect(&http).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(garbage).unwrap();
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        let text = String::from_utf8_lossy(&answer);
        assert!(
            answer.is_empty() || text.starts_with("HTTP/1.1 4"),
            "{garbage:?} got {text:?}"
        );
    }
    // Each slow-loris connection is answered 408 or closed.
    for s in &mut loris {
        let mut answer = Vec::new();
        let r = s.read_to_end(&mut answer);
        let text = String::from_utf8_lossy(&answer);
        assert!(
            r.is_ok() && (answer.is_empty() || text.starts_with("HTTP/1.1 408")),
            "slow-loris got {r:?} {text:?}"
        );
    }
    let mut answer = Vec::new();
    let _ = stalled.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    assert!(
        text.starts_with("HTTP/1.1 408"),
        "stalled body got {text:?}"
    );
    assert!(text.contains("REQUEST_TIMEOUT"), "{text:?}");
    // The server still serves.
    assert_eq!(request(&http, "GET", "/healthz").status, 200);

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let acked = appender.join().expect("every append acknowledged");
    assert!(acked > 0);
    // Exactly the native appends are in the journal: the stalled PUT's
    // ten bytes were not appended.
    assert_eq!(rt.block_on(write_head(&client, name)), acked * 10);
}

/// Runs `promtool check metrics` on `text`; panics with what to install if
/// promtool is missing.
fn promtool_check(text: &[u8]) -> (bool, String) {
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => panic!(
            "promtool not found ({e}): install Debian's `prometheus` package (apt-get install prometheus)"
        ),
    };
    child.stdin.take().unwrap().write_all(text).unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// Sample values by series (`name{labels}`), from the text format.
fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// The sum of `name`'s series whose labels include `label` (`k="v"`).
fn sum_with(samples: &HashMap<String, f64>, name: &str, label: &str) -> f64 {
    samples
        .iter()
        .filter(|(k, _)| k.starts_with(&format!("{name}{{")) && k.contains(label))
        .map(|(_, v)| v)
        .sum()
}

/// Scrapes `/metrics` (classic text format) and parses its samples.
fn scrape(http: &str) -> (String, HashMap<String, f64>) {
    let m = request(http, "GET", "/metrics");
    assert_eq!(m.status, 200);
    let text = String::from_utf8(m.body).unwrap();
    let s = samples(&text);
    (text, s)
}

/// Scrapes until `value` of the samples is `want`, for up to 30 s (gauges
/// measured once a second, a read woken by its closed connection).
fn wait_metric(http: &str, what: &str, value: impl Fn(&HashMap<String, f64>) -> f64, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, s) = scrape(http);
        let got = value(&s);
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "{what} is {got}, not {want}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn sum_of(samples: &HashMap<String, f64>, name: &str) -> f64 {
    samples
        .iter()
        .filter(|(k, _)| *k == name || k.starts_with(&format!("{name}{{")))
        .map(|(_, v)| v)
        .sum()
}

/// `/metrics` passes promtool, has a series for everything STATS reports,
/// per shard, and agrees with STATS.
#[test]
fn metrics_pass_promtool_and_cover_stats() {
    let rt = runtime();
    let (broker, http) = broker_with_http(&["--metrics-journals", "app=http-e2e"]);
    let client = rt.block_on(broker.client());
    let names = ["e2e/http/m-one", "e2e/http/m-two", "e2e/http/m-three"];
    for n in names {
        rt.block_on(create_journal(&client, n, |s| {
            if n != "e2e/http/m-three" {
                s.labels.add("app".into(), "http-e2e".into()).unwrap();
            }
        }));
        for _ in 0..3 {
            assert_eq!(put(&http, &format!("/{n}"), b"abcd").status, 204);
        }
    }
    let m = request(&http, "GET", "/metrics");
    assert_eq!(m.status, 200);
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    let (ok, out) = promtool_check(&m.body);
    assert!(ok, "promtool check metrics: {out}");
    let text = String::from_utf8(m.body).unwrap();
    let s = samples(&text);
    let stats = rt.block_on(client.stats()).unwrap();
    // Every STATS number has its series.
    for (key, value) in stats.as_object().unwrap() {
        if !value.is_number() {
            continue;
        }
        let series = match key.as_str() {
            "upload_micros_total" => "rotary_upload_seconds_total".to_string(),
            "upload_queue_depth"
            | "shards"
            | "specs"
            | "append_queued_bytes"
            | "tail_cache_bytes"
            | "tailing_readers"
            | "spool_bytes"
            | "replica_lag_bytes"
            | "journals_unlisted" => format!("rotary_{key}"),
            _ => format!("rotary_{key}_total"),
        };
        assert!(
            s.keys()
                .any(|k| *k == series || k.starts_with(&format!("{series}{{"))),
            "STATS {key} has no series {series}"
        );
    }
    assert!(text.contains(&format!(
        "rotary_specs_digest_info{{digest=\"{}\"}} 1",
        stats["specs_digest"].as_str().unwrap()
    )));
    // Per shard, summing to STATS's value.
    assert_eq!(sum_of(&s, "rotary_appends_total"), 9.0);
    assert_eq!(stats["appends"], 9);
    for shard in 0..CORES_DEFAULT {
        assert!(s.contains_key(&format!("rotary_appends_total{{shard=\"{shard}\"}}")));
    }
    assert_eq!(sum_of(&s, "rotary_append_bytes_total"), 36.0);
    // By durability: every journal here is `replicated` (the default).
    assert_eq!(sum_of(&s, "rotary_appends_replicated_total"), 9.0);
    assert_eq!(sum_of(&s, "rotary_append_bytes_replicated_total"), 36.0);
    assert_eq!(sum_of(&s, "rotary_appends_fsync_total"), 0.0);
    assert_eq!(sum_of(&s, "rotary_append_bytes_fsync_total"), 0.0);
    assert_eq!(
        s[r#"rotary_http_requests_total{method="PUT",code="204"}"#],
        9.0
    );
    assert_eq!(s["rotary_http_put_seconds_count"], 9.0);
    // Each append's latency, by its journal's durability (the default).
    assert_eq!(
        sum_with(
            &s,
            "rotary_append_latency_seconds_count",
            "durability=\"replicated\""
        ),
        9.0
    );
    assert_eq!(
        sum_with(
            &s,
            "rotary_append_latency_seconds_count",
            "durability=\"fsync\""
        ),
        0.0
    );
    assert_eq!(s["rotary_ready"], 1.0);
    assert!(s["rotary_disk_free_bytes"] > 0.0);
    // Only the selected journals have series of their own.
    assert_eq!(
        s[r#"rotary_journal_write_head_bytes{journal="e2e/http/m-one"}"#],
        12.0
    );
    assert_eq!(
        s[r#"rotary_journal_write_head_bytes{journal="e2e/http/m-two"}"#],
        12.0
    );
    assert!(!text.contains("e2e/http/m-three"));

    // A scraper that asks for OpenMetrics gets it.
    let mut sock = TcpStream::connect(&http).unwrap();
    write!(
        sock,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text;version=1.0.0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    sock.read_to_string(&mut raw).unwrap();
    assert!(raw.contains("application/openmetrics-text"), "{raw}");
    assert!(raw.contains("# TYPE rotary_appends counter"));
    assert!(raw.contains("# EOF"));
}

/// The append latency histogram counts every append once, by its
/// journal's durability; a blocking GET at the write head is a tailing
/// reader until its client goes; spool bytes count what the journals hold
/// on disk. The exposition with those series passes promtool.
#[test]
fn append_latency_tailing_readers_and_spool_bytes_move() {
    let rt = runtime();
    let (broker, http) = broker_with_http(&[]);
    let client = rt.block_on(broker.client());
    let (replicated, fsync) = ("e2e/http/lat-replicated", "e2e/http/lat-fsync");
    rt.block_on(journal(&client, replicated));
    rt.block_on(create_journal(&client, fsync, |s| {
        s.durability = rotary_net::spec::Durability::Fsync;
    }));
    let count = "rotary_append_latency_seconds_count";
    let (_, s) = scrape(&http);
    assert_eq!(sum_with(&s, count, "durability=\"replicated\""), 0.0);
    assert_eq!(sum_with(&s, count, "durability=\"fsync\""), 0.0);

    for _ in 0..4 {
        assert_eq!(
            put(&http, &format!("/{replicated}"), b"0123456789").status,
            204
        );
    }
    for _ in 0..2 {
        assert_eq!(put(&http, &format!("/{fsync}"), b"0123456789").status, 204);
    }
    let (text, s) = scrape(&http);
    let (ok, out) = promtool_check(text.as_bytes());
    assert!(ok, "promtool check metrics: {out}");
    assert!(text.contains("# TYPE rotary_append_latency_seconds histogram"));
    for (durability, n) in [("replicated", 4.0), ("fsync", 2.0)] {
        let label = format!("durability=\"{durability}\"");
        assert_eq!(sum_with(&s, count, &label), n, "{durability}");
        let appends = format!("rotary_appends_{durability}_total");
        assert_eq!(sum_of(&s, &appends), n, "{appends}");
        let bytes = format!("rotary_append_bytes_{durability}_total");
        assert_eq!(sum_of(&s, &bytes), n * 10.0, "{bytes}");
        let inf: f64 = s
            .iter()
            .filter(|(k, _)| {
                k.starts_with("rotary_append_latency_seconds_bucket{le=\"+Inf\"")
                    && k.contains(&label)
            })
            .map(|(_, v)| v)
            .sum();
        assert_eq!(inf, n, "{durability}");
        assert!(sum_with(&s, "rotary_append_latency_seconds_sum", &label) > 0.0);
    }
    // What the journals hold on disk, measured at the shards' next tick.
    wait_metric(
        &http,
        "spool bytes",
        |s| sum_of(s, "rotary_spool_bytes"),
        60.0,
    );

    // A blocking read at the write head is a tailing reader while it waits.
    let mut sock = TcpStream::connect(&http).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        sock,
        "GET /{replicated}?offset=-1&block=true HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    .unwrap();
    let mut r = BufReader::new(sock);
    let (status, _) = read_head(&mut r).unwrap();
    assert_eq!(status, 206);
    let tailing = |s: &HashMap<String, f64>| sum_of(s, "rotary_tailing_readers");
    wait_metric(&http, "tailing readers", tailing, 1.0);
    drop(r);
    wait_metric(&http, "tailing readers", tailing, 0.0);
}

/// Appends to a journal with stores, retrying while its stores are not
/// yet listed (a retryable refusal).
async fn append_listed(client: &Client, journal: &str, bytes: &[u8]) {
    let req = AppendRequest {
        journal: journal.to_string(),
        ..Default::default()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match client.append(&req, bytes.to_vec()).await {
            Ok(_) => return,
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("append to {journal}: {e}"),
        }
    }
}

/// Uploads and listings of an S3 store (a real one, moto) are timed by
/// store; a restarted broker whose journal's store cannot be reached is not
/// ready, and counts the failed listings, until the store answers and is
/// listed.
#[test]
fn store_latencies_and_readiness_wait_for_the_first_listing() {
    let rt = runtime();
    let mut store = common::store::TestStore::s3("http-e2e/");
    let port = free_port_range(1);
    let http = format!("127.0.0.1:{port}");
    let mut broker = Broker::start_with(
        CORES_DEFAULT,
        BrokerOpts {
            args: vec!["--http".into(), http.clone()],
            env: store.broker_env(),
            ..Default::default()
        },
    );
    wait_http_ready(&http);
    let client = rt.block_on(broker.client());
    let name = "e2e/http/stored";
    rt.block_on(create_journal(&client, name, |s| {
        s.fragment.stores = vec![store.url()];
        s.fragment.refresh_interval = Duration::from_secs(1);
    }));
    rt.block_on(append_listed(&client, name, b"to the store"));
    rt.block_on(client.seal(name)).unwrap();
    let label = format!("store=\"s3://{}/\"", common::store::BUCKET);
    wait_metric(
        &http,
        "uploads timed",
        |s| sum_with(s, "rotary_store_upload_seconds_count", &label),
        1.0,
    );
    let (text, s) = scrape(&http);
    let (ok, out) = promtool_check(text.as_bytes());
    assert!(ok, "promtool check metrics: {out}");
    assert!(sum_with(&s, "rotary_store_listing_seconds_count", &label) >= 1.0);
    assert!(sum_with(&s, "rotary_store_upload_seconds_sum", &label) > 0.0);
    assert_eq!(
        sum_with(&s, "rotary_store_upload_errors_total", &label),
        0.0
    );
    assert_eq!(
        sum_with(&s, "rotary_store_listing_errors_total", &label),
        0.0
    );
    assert_eq!(sum_of(&s, "rotary_journals_unlisted"), 0.0);

    // The store goes away: the upload of the next fragment fails, counted.
    rt.block_on(append_listed(&client, name, b"not yet stored"));
    store.moto().stop();
    rt.block_on(client.seal(name)).unwrap();
    wait_metric(
        &http,
        "upload errors",
        |s| (sum_with(s, "rotary_store_upload_errors_total", &label) >= 1.0) as u8 as f64,
        1.0,
    );
    let (_, s) = scrape(&http);
    assert_eq!(
        sum_with(&s, "rotary_store_upload_seconds_count", &label),
        1.0
    );

    // The broker restarts: it serves, but is not ready while the journal's
    // store cannot be listed.
    broker.restart();
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        // Not ready throughout: first for the gateway's connection, then
        // for the listing.
        let a = request(&http, "GET", "/readyz");
        assert_eq!(a.status, 503, "{a:?}");
        if body_line(&a).contains("not yet listed") {
            break;
        }
        assert!(Instant::now() < deadline, "{a:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_metric(
        &http,
        "listings failed",
        |s| (sum_with(s, "rotary_store_listing_errors_total", &label) >= 2.0) as u8 as f64,
        1.0,
    );
    let (_, s) = scrape(&http);
    assert_eq!(sum_of(&s, "rotary_journals_unlisted"), 1.0);
    assert_eq!(s["rotary_ready"], 0.0);
    assert_eq!(request(&http, "GET", "/readyz").status, 503);

    // Once the store answers, the next listing makes the broker ready.
    store.moto().start_again();
    wait_http_ready(&http);
    let (_, s) = scrape(&http);
    assert_eq!(sum_of(&s, "rotary_journals_unlisted"), 0.0);
    assert_eq!(s["rotary_ready"], 1.0);
}

/// A stopped child process, killed by PID when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A real Prometheus server scrapes the broker every second and sees the
/// append counter move after appends.
#[test]
fn prometheus_scrapes_the_append_counter() {
    let rt = runtime();
    let (broker, http) = broker_with_http(&[]);
    let client = rt.block_on(broker.client());
    let name = "e2e/http/scraped";
    rt.block_on(journal(&client, name));

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: rotary\n    static_configs:\n      - targets: ['{http}']\n"
        ),
    )
    .unwrap();
    let web = format!("127.0.0.1:{}", free_port_range(1));
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let spawned = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address={web}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn();
    let _prometheus = match spawned {
        Ok(c) => Child(c),
        Err(e) => panic!(
            "prometheus not found ({e}): install Debian's `prometheus` package (apt-get install prometheus)"
        ),
    };
    let query = |q: &str| -> Option<f64> {
        let path = format!("/api/v1/query?query={}", percent_encode(q));
        let a = try_request(&web, "GET", &path, &[], None).ok()?;
        if a.status != 200 {
            return None;
        }
        let v: serde_json::Value = serde_json::from_slice(&a.body).ok()?;
        v["data"]["result"][0]["value"][1].as_str()?.parse().ok()
    };
    let wait_for = |q: &str, want: f64| {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            if query(q) == Some(want) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "Prometheus never saw {q} = {want} (last {:?}); its log:\n{}",
                query(q),
                std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    wait_for("sum(rotary_appends_total)", 0.0);
    for _ in 0..5 {
        assert_eq!(put(&http, &format!("/{name}"), b"scrape me").status, 204);
    }
    wait_for("sum(rotary_appends_total)", 5.0);
    wait_for("sum(rotary_append_bytes_total)", 45.0);
    wait_for("up{job=\"rotary\"}", 1.0);
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `/readyz` answers 503 while the broker starts (here: waiting for its
/// port) and 200 once its shards recovered and listen; `/healthz` answers
/// throughout, and the gateway says it is not ready yet.
#[test]
fn readyz_is_ready_once_the_broker_has_started() {
    let http = format!("127.0.0.1:{}", free_port_range(1));
    let base = free_port_range(2);
    // Shard 1's port is held: the broker waits for it to come free.
    let held = std::net::TcpListener::bind(("127.0.0.1", base + 1)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = std::fs::File::create(dir.path().join("log")).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_rotary"))
        .args([
            "serve",
            "--cores",
            "2",
            "--disk-reserve",
            "0",
            "--http",
            &http,
        ])
        .arg("--data")
        .arg(dir.path().join("data"))
        .arg("--listen")
        .arg(format!("127.0.0.1:{base}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let _child = Child(child);
    let deadline = Instant::now() + READY_TIMEOUT;
    let not_ready = loop {
        if let Ok(a) = try_request(&http, "GET", "/readyz", &[], None) {
            break a;
        }
        assert!(Instant::now() < deadline, "no HTTP listener");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(not_ready.status, 503, "{not_ready:?}");
    assert!(body_line(&not_ready).starts_with("not ready"));
    assert_eq!(request(&http, "GET", "/healthz").status, 200);
    let a = put(&http, "/e2e/http/early", b"x");
    assert_eq!(a.status, 503, "{a:?}");
    let m = request(&http, "GET", "/metrics");
    assert!(String::from_utf8_lossy(&m.body).contains("rotary_ready 0"));
    drop(held);
    wait_http_ready(&http);
    let m = request(&http, "GET", "/metrics");
    assert!(String::from_utf8_lossy(&m.body).contains("rotary_ready 1"));
}

/// `--log-format json`: every log line is one JSON object with a level, a
/// target and the event's fields.
#[test]
fn json_logs_are_one_object_a_line() {
    let rt = runtime();
    let (broker, http) = broker_with_http(&["--log-format", "json"]);
    let client = rt.block_on(broker.client());
    rt.block_on(journal(&client, "e2e/http/logged"));
    assert_eq!(put(&http, "/e2e/http/logged", b"x").status, 204);
    let log = broker.log();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty());
    for line in &lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        assert!(v["level"].is_string(), "{line}");
        assert!(v["target"].is_string(), "{line}");
        assert!(v["fields"]["message"].is_string(), "{line}");
    }
    assert!(
        lines.iter().any(|l| l.contains("HTTP listener up")),
        "{log}"
    );
}
