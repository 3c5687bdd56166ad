//! The journal gateway, compatible with Gazette's HTTP gateway:
//!
//! - `GET /<journal>?offset=N&block=true` streams the journal's bytes from
//!   `N` (`-1`, or no offset: 0; `-1` is the write head) — to the write
//!   head, or with `block=true` for as long as the client reads. Answered
//!   206 with `X-Write-Head`, `X-Fragment-Name`, `X-Fragment-Location` (for
//!   a fragment held in a store) and `Content-Range`.
//! - `HEAD /<journal>?offset=N` answers the same headers, without bytes.
//! - `PUT /<journal>` appends the body (chunked or not) as one atomic
//!   append and answers 204 with `X-Commit-Begin`, `X-Commit-End`,
//!   `X-Commit-SHA1-Sum` and `X-Write-Head`.
//!
//! Statuses map as Gazette's do: `JOURNAL_NOT_FOUND` 404,
//! `OFFSET_NOT_YET_AVAILABLE` 416, retryable statuses 503, others 500; a
//! malformed request 400, a body over the limit 413, a body that stalls
//! 408. Every error answer is one line of text naming the status.

use std::sync::Arc;

use bytes::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use rotary_net::client::{ClientError, ReadEvent, ReadOptions};
use rotary_net::wire::{AppendRequest, ReadRequest, OFFSET_MAX};
use rotary_net::Status;

use crate::body::{BodyError, LimitedBody};
use crate::{text, Body, State};

pub const WRITE_HEAD: &str = "X-Write-Head";
pub const FRAGMENT_NAME: &str = "X-Fragment-Name";
pub const FRAGMENT_LOCATION: &str = "X-Fragment-Location";
pub const COMMIT_BEGIN: &str = "X-Commit-Begin";
pub const COMMIT_END: &str = "X-Commit-End";
pub const COMMIT_SHA1_SUM: &str = "X-Commit-SHA1-Sum";

/// Bodies up to this size (by Content-Length) are read whole and sent as
/// one APPEND; larger or chunked ones are streamed into the append.
const WHOLE_BODY_BYTES_MAX: u64 = 1 << 20;
/// Fragment pages a GET looks through for the fragment holding its offset
/// (for `X-Fragment-Name`); past them the header is left out.
const FRAGMENT_PAGES_MAX: usize = 8;
/// Read chunks buffered between the broker and a slow HTTP reader.
const READ_CHUNKS_BUFFERED: usize = 16;

/// The HTTP status of a broker status, as Gazette's gateway maps them.
pub fn http_status(status: Status) -> StatusCode {
    match status {
        Status::OK => StatusCode::OK,
        Status::JOURNAL_NOT_FOUND => StatusCode::NOT_FOUND,
        Status::OFFSET_NOT_YET_AVAILABLE => StatusCode::RANGE_NOT_SATISFIABLE,
        Status::BAD_REQUEST => StatusCode::BAD_REQUEST,
        Status::FRAME_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
        Status::TOO_MANY_REQUESTS => StatusCode::TOO_MANY_REQUESTS,
        s if s.is_retryable() => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The answer to a client error: its status and one line.
fn error_response(e: &ClientError) -> Response<Body> {
    match e {
        ClientError::Status {
            status, message, ..
        } => {
            let mut r = text(http_status(*status), format!("{status}: {message}"));
            if let Some(reply) = e.append_reply() {
                if reply.write_head != 0 {
                    header(&mut r, WRITE_HEAD, reply.write_head);
                }
            }
            r
        }
        ClientError::Io { .. } => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("UNAVAILABLE: the broker did not answer: {e}"),
        ),
        ClientError::Invalid(_) | ClientError::Offset(_) => {
            text(StatusCode::BAD_REQUEST, format!("BAD_REQUEST: {e}"))
        }
        ClientError::Content(io) => match BodyError::from_io(io) {
            Some(b) => body_error(b),
            None => text(StatusCode::BAD_REQUEST, format!("BAD_REQUEST: {e}")),
        },
        ClientError::Protocol { .. } | ClientError::Fragment(_) => {
            text(StatusCode::INTERNAL_SERVER_ERROR, format!("INTERNAL: {e}"))
        }
    }
}

fn body_error(e: &BodyError) -> Response<Body> {
    match e {
        BodyError::TooLarge(_) => text(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("PAYLOAD_TOO_LARGE: {e}; nothing was appended"),
        ),
        BodyError::Idle(_) => text(
            StatusCode::REQUEST_TIMEOUT,
            format!("REQUEST_TIMEOUT: {e}; nothing was appended"),
        ),
        BodyError::Broken(_) => text(
            StatusCode::BAD_REQUEST,
            format!("BAD_REQUEST: {e}; nothing was appended"),
        ),
    }
}

fn header(r: &mut Response<Body>, name: &'static str, value: impl std::fmt::Display) {
    if let Ok(v) = value.to_string().parse() {
        r.headers_mut().insert(name, v);
    }
}

fn bad_request(why: impl std::fmt::Display) -> Response<Body> {
    text(StatusCode::BAD_REQUEST, format!("BAD_REQUEST: {why}"))
}

/// The journal a path names: percent-decoded, checked as journal names are.
pub fn journal_of(path: &str) -> Result<String, String> {
    let raw = path.strip_prefix('/').unwrap_or(path);
    let name = percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| "the journal name is not UTF-8".to_string())?
        .into_owned();
    rotary_net::spec::validate_journal_name(&name).map_err(|e| e.to_string())?;
    Ok(name)
}

/// A GET's or HEAD's query: `offset` (default 0, `-1` the write head) and
/// `block` (default false). Unknown parameters are refused, as Gazette's
/// gateway refuses them.
#[derive(Debug, PartialEq, Eq)]
pub struct ReadQuery {
    pub offset: Option<u64>,
    pub block: bool,
}

pub fn parse_read_query(query: &str) -> Result<ReadQuery, String> {
    let mut q = ReadQuery {
        offset: Some(0),
        block: false,
    };
    for (k, v) in form_urlencoded::parse(query.as_bytes()) {
        match &*k {
            "offset" => {
                q.offset = match v.parse::<i64>() {
                    Ok(-1) => None,
                    Ok(o) if (0..=OFFSET_MAX as i64).contains(&o) => Some(o as u64),
                    _ => {
                        return Err(format!(
                    "offset {v:?} is not an offset (0 to {OFFSET_MAX}, or -1 for the write head)"
                ))
                    }
                }
            }
            "block" => {
                q.block = match &*v {
                    "true" | "1" | "" => true,
                    "false" | "0" => false,
                    _ => return Err(format!("block {v:?} is not true or false")),
                }
            }
            other => return Err(format!("unknown query parameter {other:?}")),
        }
    }
    Ok(q)
}

/// Answers a gateway request.
pub(crate) async fn serve(
    state: &Arc<State>,
    req: Request<hyper::body::Incoming>,
) -> Response<Body> {
    let method = req.method().clone();
    if !matches!(method, Method::GET | Method::HEAD | Method::PUT) {
        let mut r = text(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("METHOD_NOT_ALLOWED: {method} is not GET, HEAD or PUT"),
        );
        r.headers_mut().insert(
            hyper::header::ALLOW,
            "GET, HEAD, PUT".parse().expect("header"),
        );
        return r;
    }
    let journal = match journal_of(req.uri().path()) {
        Ok(j) => j,
        Err(why) => return bad_request(why),
    };
    let Some(backend) = state.backend.get() else {
        return text(
            StatusCode::SERVICE_UNAVAILABLE,
            "UNAVAILABLE: the broker is still recovering its journals",
        );
    };
    let client = &backend.client;
    match method {
        Method::PUT => put(state, client, journal, req).await,
        _ => {
            let query = match parse_read_query(req.uri().query().unwrap_or("")) {
                Ok(q) => q,
                Err(why) => return bad_request(why),
            };
            read(state, client, journal, query, method == Method::HEAD).await
        }
    }
}

async fn put(
    state: &State,
    client: &rotary_net::client::Client,
    journal: String,
    req: Request<hyper::body::Incoming>,
) -> Response<Body> {
    if let Some(q) = req.uri().query().filter(|q| !q.is_empty()) {
        return bad_request(format!("PUT takes no query parameters (got {q:?})"));
    }
    let limit = state.config.body_limit_bytes;
    let length = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = length.filter(|&n| n > limit) {
        if n <= crate::body::DRAIN_BYTES_MAX {
            LimitedBody::new(req.into_body(), n, state.config.timeout)
                .drain()
                .await;
        }
        return body_error(&BodyError::TooLarge(limit));
    }
    let started = rotary_engine::clock::now();
    let mut body = LimitedBody::new(req.into_body(), limit, state.config.timeout);
    let append = AppendRequest {
        journal,
        ..AppendRequest::default()
    };
    let result = match length {
        Some(n) if n <= WHOLE_BODY_BYTES_MAX => match body.collect().await {
            Ok(bytes) => client.append(&append, bytes).await,
            Err(e) => {
                if matches!(e, BodyError::TooLarge(_)) {
                    body.drain().await;
                }
                return body_error(&e);
            }
        },
        _ => client.append_stream(&append, &mut body).await,
    };
    if let Err(ClientError::Content(io)) = &result {
        if matches!(BodyError::from_io(io), Some(BodyError::TooLarge(_))) {
            body.drain().await;
        }
    }
    match result {
        Ok(reply) => {
            state
                .http
                .observe_put(rotary_engine::clock::elapsed(started));
            let mut r = Response::new(Body::empty());
            *r.status_mut() = StatusCode::NO_CONTENT;
            header(&mut r, COMMIT_BEGIN, reply.begin);
            header(&mut r, COMMIT_END, reply.end);
            header(&mut r, WRITE_HEAD, reply.end.max(reply.write_head));
            header(&mut r, COMMIT_SHA1_SUM, hex::encode(reply.sha1));
            r
        }
        Err(e) => error_response(&e),
    }
}

async fn read(
    state: &State,
    client: &rotary_net::client::Client,
    journal: String,
    query: ReadQuery,
    head_only: bool,
) -> Response<Body> {
    // Where the read starts and the write head, first: the status and the
    // headers go out before any byte.
    let request = ReadRequest {
        journal: journal.clone(),
        offset: query.offset,
        end_offset: None,
        route_revision: 0,
    };
    let done = match read_metadata(client, &request).await {
        Ok(done) => done,
        Err(r) => return r,
    };
    // At or past the head the broker answers OFFSET_NOT_YET_AVAILABLE
    // with the offset and the head: decided on below, as a read's start.
    let at_head = done.status == rotary_net::Status::OFFSET_NOT_YET_AVAILABLE;
    if let Err(e) = done
        .check()
        .or_else(|e| if at_head { Ok(()) } else { Err(e) })
    {
        let mut r = error_response(&e);
        if done.write_head != 0 {
            header(&mut r, WRITE_HEAD, done.write_head);
        }
        return r;
    }
    let offset = done.offset;
    if !query.block && offset >= done.write_head {
        let mut r = text(
            StatusCode::RANGE_NOT_SATISFIABLE,
            format!(
                "OFFSET_NOT_YET_AVAILABLE: offset {offset} is at or beyond the write head {}",
                done.write_head
            ),
        );
        header(&mut r, WRITE_HEAD, done.write_head);
        return r;
    }
    let mut r = Response::new(Body::empty());
    *r.status_mut() = StatusCode::PARTIAL_CONTENT;
    header(&mut r, WRITE_HEAD, done.write_head);
    fragment_headers(&mut r, client, &journal, offset).await;
    if head_only {
        return r;
    }
    let stream = ReadRequest {
        journal,
        offset: Some(offset),
        end_offset: None,
        route_revision: 0,
    };
    let reading = match client.read(&stream, query.block, false).await {
        Ok(s) => s,
        Err(e) => return error_response(&e),
    };
    *r.body_mut() = stream_body(state, reading, offset);
    r
}

/// The read's start and the write head, asked without content; an error
/// is the response to give.
async fn read_metadata(
    client: &rotary_net::client::Client,
    request: &ReadRequest,
) -> Result<rotary_net::client::ReadDone, Response<Body>> {
    let meta = ReadOptions {
        block: false,
        metadata_only: true,
        do_not_proxy: false,
    };
    match client.read_with(request, meta).await {
        Ok(mut s) => loop {
            match s.next().await {
                Some(Ok(ReadEvent::Done(d))) => break Ok(d),
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(error_response(&e)),
                None => {
                    return Err(text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "UNAVAILABLE: the read ended without an answer",
                    ))
                }
            }
        },
        Err(e) => Err(error_response(&e)),
    }
}

/// The name, location and range of the fragment holding `offset`, when
/// there is one.
async fn fragment_headers(
    r: &mut Response<Body>,
    client: &rotary_net::client::Client,
    journal: &str,
    offset: u64,
) {
    if let Some(f) = fragment_at(client, journal, offset).await {
        header(
            r,
            FRAGMENT_NAME,
            format!(
                "{:016x}-{:016x}-{}{}",
                f.begin,
                f.end,
                f.sha1,
                f.codec.extension()
            ),
        );
        if let Some(location) = location_of(&f) {
            header(r, FRAGMENT_LOCATION, location);
        }
        header(
            r,
            "Content-Range",
            format!("bytes {offset}-{}/{}", i64::MAX, i64::MAX),
        );
    }
}

/// The response body: the read's bytes from `offset` on, streamed by a
/// task until a gap, the read's end or the HTTP client goes away.
fn stream_body(state: &State, mut reading: rotary_net::client::ReadStream, offset: u64) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(READ_CHUNKS_BUFFERED);
    let counted = state.http.read_bytes.clone();
    tokio::spawn(async move {
        let mut next = offset;
        loop {
            let event = tokio::select! {
                // The HTTP client went away: dropping the read cancels it.
                _ = tx.closed() => break,
                e = reading.next() => e,
            };
            match event {
                Some(Ok(ReadEvent::Data { offset, content })) => {
                    // A gap in history ends the stream: the client reads on
                    // from the offset it has, and learns of the jump.
                    if offset != next {
                        break;
                    }
                    next += content.len() as u64;
                    counted.inc_by(content.len() as u64);
                    if tx.send(content).await.is_err() {
                        break;
                    }
                }
                Some(Ok(ReadEvent::Fragment { .. })) => break,
                Some(Ok(ReadEvent::Done(_))) | Some(Err(_)) | None => break,
            }
        }
    });
    Body::Channel(rx)
}

/// The fragment holding `offset` (the open spool when it is the head).
async fn fragment_at(
    client: &rotary_net::client::Client,
    journal: &str,
    offset: u64,
) -> Option<rotary_net::client::FragmentInfo> {
    let mut from = 0;
    for _ in 0..FRAGMENT_PAGES_MAX {
        let page = client
            .fragments_page(journal, from, rotary_net::wire::FRAGMENTS_PAGE_MAX)
            .await
            .ok()?;
        let hit = page
            .fragments
            .iter()
            .filter(|f| f.begin <= offset && (offset < f.end || (f.open && offset == f.end)))
            // A local copy and a store's: prefer the larger, as the index does.
            .max_by_key(|f| (f.end - f.begin, f.store == "local"))
            .cloned();
        if hit.is_some() {
            return hit;
        }
        match page.next {
            Some(n) if page.fragments.last().is_some_and(|f| f.begin <= offset) => from = n,
            _ => return None,
        }
    }
    None
}

/// Where a store's fragment can be fetched directly: the store URL and its
/// key. Local fragments have none.
fn location_of(f: &rotary_net::client::FragmentInfo) -> Option<String> {
    let key = f.key.as_ref()?;
    if f.store.is_empty() || f.store == "local" {
        return None;
    }
    let sep = if f.store.ends_with('/') { "" } else { "/" };
    Some(format!("{}{sep}{key}", f.store))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_as_gazette_maps_them() {
        assert_eq!(http_status(Status::OK), StatusCode::OK);
        assert_eq!(
            http_status(Status::JOURNAL_NOT_FOUND),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            http_status(Status::OFFSET_NOT_YET_AVAILABLE),
            StatusCode::RANGE_NOT_SATISFIABLE
        );
        for s in [
            Status::INSUFFICIENT_JOURNAL_BROKERS,
            Status::STORAGE_FULL,
            Status::REPLICATION_FAILED,
            Status::SPOOL_BUDGET_EXHAUSTED,
            Status::SHUTTING_DOWN,
        ] {
            assert_eq!(http_status(s), StatusCode::SERVICE_UNAVAILABLE, "{s}");
        }
        for s in [
            Status::WRONG_APPEND_OFFSET,
            Status::REGISTER_MISMATCH,
            Status::NOT_ALLOWED,
            Status::INDEX_HAS_GREATER_OFFSET,
        ] {
            assert_eq!(http_status(s), StatusCode::INTERNAL_SERVER_ERROR, "{s}");
        }
        assert_eq!(http_status(Status::BAD_REQUEST), StatusCode::BAD_REQUEST);
        assert_eq!(
            http_status(Status::TOO_MANY_REQUESTS),
            StatusCode::TOO_MANY_REQUESTS
        );
    }

    #[test]
    fn read_queries() {
        assert_eq!(
            parse_read_query("").unwrap(),
            ReadQuery {
                offset: Some(0),
                block: false
            }
        );
        assert_eq!(
            parse_read_query("offset=12&block=true").unwrap(),
            ReadQuery {
                offset: Some(12),
                block: true
            }
        );
        assert_eq!(parse_read_query("offset=-1").unwrap().offset, None);
        assert!(parse_read_query("offset=-2").is_err());
        assert!(parse_read_query("offset=abc").is_err());
        assert!(parse_read_query("offset=9223372036854775808").is_err());
        assert!(parse_read_query("block=maybe").is_err());
        assert!(parse_read_query("follow=1").unwrap_err().contains("follow"));
    }

    #[test]
    fn journal_names_from_paths() {
        assert_eq!(journal_of("/orders/part-007").unwrap(), "orders/part-007");
        assert_eq!(journal_of("/a%2Fbcd").unwrap(), "a/bcd");
        assert!(journal_of("/").is_err());
        assert!(journal_of("/ab").is_err());
        assert!(journal_of("/%FF%FEabc").is_err());
    }
}
