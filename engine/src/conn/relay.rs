//! Relays: requests forwarded to another shard or broker, and their replies passed back.

use super::*;
use rotary_net::wire::FrameHeader;
use zerocopy::byteorder::little_endian::{U16, U32};
use zerocopy::{FromBytes, IntoBytes};

/// Forwarded reads a connection remembers before it forgets those answered.
pub(super) const FORWARDED_READS_PRUNE_AT: usize = 1024;

/// A connection to another shard or broker that a client connection's
/// requests are forwarded or proxied over.
#[derive(Clone)]
pub(super) struct Relay {
    pub(super) out: Rc<Outbox>,
    pub(super) watch: Rc<RelayWatch>,
}

/// What a relay has in flight, and when it last heard from its peer.
pub(super) struct RelayWatch {
    /// Requests forwarded and not yet given their final reply.
    pending: RefCell<HashSet<u64>>,
    /// Of those, the ones proxied to another broker (see
    /// [`Conn::proxy_to`]).
    proxied: RefCell<HashSet<u64>>,
    heard: Cell<Instant>,
    /// Given up on: what arrives from the peer later is dropped.
    abandoned: Cell<bool>,
}

impl RelayWatch {
    fn new() -> Self {
        RelayWatch {
            pending: RefCell::new(HashSet::new()),
            proxied: RefCell::new(HashSet::new()),
            heard: Cell::new(crate::clock::now()),
            abandoned: Cell::new(false),
        }
    }
}

/// A peer's refusal of a request this broker proxied to it, as the client
/// gets it: status `WRONG_ROUTE`, the same meta, the peer's message with
/// what it means for the client.
pub(super) fn refused_by_peer(frame: &[u8], meta_len: usize) -> Vec<u8> {
    let body = &frame[HEADER_LEN..];
    let (meta, message) = body.split_at(meta_len.min(body.len()));
    let message = format!(
        "{} (this broker proxied the request, and the two brokers' views of the cluster \
         differ while a cluster file changes; retry)",
        String::from_utf8_lossy(message)
    );
    let (mut header, _) = FrameHeader::read_from_prefix(frame).expect("a whole frame");
    header.body_len = U32::new((meta.len() + message.len()) as u32);
    header.status = U16::new(Status::WRONG_ROUTE as u16);
    let mut out = header.as_bytes().to_vec();
    out.extend_from_slice(meta);
    out.extend_from_slice(message.as_bytes());
    out
}

/// Request id of a relay's own PINGs: its PONG is not the client's.
pub(super) const RELAY_PROBE_ID: u64 = u64::MAX;

/// Copies whole reply frames from a relay connection to the client, all
/// but the answers to the relay's own PINGs.
pub(super) async fn pump(mut rd: TcpStream, client: Rc<Outbox>, relay: Relay) {
    let mut buf: Vec<u8> = Vec::with_capacity(READ_BUFFER_BYTES);
    loop {
        let mut start = 0;
        while let Ok(Some((h, total))) = wire::decode_header(&buf[start..], u32::MAX) {
            if buf.len() - start < total {
                break;
            }
            let id = h.request_id.get();
            let op = Op::from_code(h.op);
            if op == Some(Op::PONG) && id == RELAY_PROBE_ID {
                start += total;
                continue;
            }
            let frame = &buf[start..start + total];
            if !matches!(op, Some(Op::READ_DATA | Op::READ_FRAGMENT)) {
                relay.watch.pending.borrow_mut().remove(&id);
                let proxied = relay.watch.proxied.borrow_mut().remove(&id);
                let status = Status::from_code(h.status.get());
                if proxied
                    && matches!(
                        status,
                        Some(Status::NOT_JOURNAL_PRIMARY_BROKER | Status::NOT_JOURNAL_BROKER)
                    )
                {
                    client.raw(&refused_by_peer(frame, h.meta_len.get().into()));
                    start += total;
                    continue;
                }
            }
            client.raw(frame);
            start += total;
        }
        buf.drain(..start);
        if buf.capacity() - buf.len() < READ_BUFFER_BYTES / 4 {
            buf.reserve(READ_BUFFER_BYTES);
        }
        if client.is_closed() || relay.watch.abandoned.get() {
            break;
        }
        let BufResult(res, b) = rd.read(buf.uninit()).await;
        buf = b.into_inner();
        if relay.watch.abandoned.get() {
            // Its requests were answered already.
            return;
        }
        relay.watch.heard.set(crate::clock::now());
        match res {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        client.room().await;
    }
    // Requests in flight over the relay will get no answer: closing the
    // client's connection tells it so (it retries elsewhere).
    if !relay.out.is_closed() {
        client.close();
    }
    relay.out.close();
}

/// Watches a relay whose requests wait: after `silence` without a byte
/// from its peer it sends a PING, and after `silence` more with still
/// nothing it answers each of them `IO_ERROR` and closes the relay. The
/// client's connection stays: its other requests are not the peer's.
pub(super) async fn watch(peer: SocketAddr, client: Rc<Outbox>, relay: Relay, silence: Duration) {
    // When the PING went out, if one is unanswered.
    let mut probe: Option<Instant> = None;
    loop {
        compio::time::sleep(silence / 4).await;
        if relay.out.is_closed() || client.is_closed() {
            return;
        }
        if relay.watch.pending.borrow().is_empty() {
            probe = None;
            continue;
        }
        let heard = relay.watch.heard.get();
        if probe.is_some_and(|p| heard >= p) {
            probe = None;
        }
        let quiet = crate::clock::elapsed(heard);
        if quiet < silence {
            continue;
        }
        match probe {
            None => {
                probe = Some(crate::clock::now());
                let mut ping = Vec::new();
                wire::encode_frame(&mut ping, Op::PING, 0, Status::OK, RELAY_PROBE_ID, &[], &[]);
                relay.out.raw(&ping);
                continue;
            }
            Some(p) if crate::clock::elapsed(p) < silence => continue,
            Some(_) => {}
        }
        relay.watch.abandoned.set(true);
        let pending: Vec<u64> = relay.watch.pending.borrow_mut().drain().collect();
        tracing::warn!(%peer, requests = pending.len(), ?quiet, "a peer answered nothing, not even a PING: its requests are answered IO_ERROR");
        let msg = format!(
            "{peer}, which the request was forwarded to, sent nothing for {quiet:.1?}, not even an answer to a PING"
        );
        for id in pending {
            client.error(Op::ERROR, Status::IO_ERROR, id, &[], &msg);
        }
        relay.out.close();
        return;
    }
}

impl Conn {
    /// Remembers where a read went, for its CANCEL. Reads whose relay has
    /// passed on their last reply are forgotten once many have gathered.
    pub(super) fn forward_read(&mut self, id: u64, addr: SocketAddr) {
        if self.forwarded_reads.len() >= self.forwarded_reads_prune_at {
            let relays = &self.relays;
            self.forwarded_reads.retain(|id, addr| {
                relays
                    .get(addr)
                    .is_some_and(|r| r.watch.pending.borrow().contains(id))
            });
            // Many reads still open (tails) are not scanned again at once.
            self.forwarded_reads_prune_at =
                FORWARDED_READS_PRUNE_AT.max(2 * self.forwarded_reads.len());
        }
        self.forwarded_reads.insert(id, addr);
    }

    /// Proxies a client's append or read to another broker, marked so that
    /// the peer serves it itself or refuses it. A refusal (the two brokers'
    /// views of the cluster differ while a cluster file changes) reaches
    /// the client as the retryable `WRONG_ROUTE`: the client did not ask
    /// the wrong broker, and the same request succeeds once the views agree.
    pub(super) async fn proxy_to(&mut self, addr: SocketAddr, raw: &[u8]) {
        self.forward_to(addr, raw).await;
        if let Some(relay) = self.relays.get(&addr) {
            relay
                .watch
                .proxied
                .borrow_mut()
                .insert(header_request_id(raw));
        }
    }

    /// Sends a raw request frame to another shard or broker over this
    /// connection's relay to it; replies flow back to the client as they are
    /// (but see [`Conn::proxy_to`]).
    pub(super) async fn forward_to(&mut self, addr: SocketAddr, raw: &[u8]) {
        if self.relays.get(&addr).is_none_or(|r| r.out.is_closed()) {
            // A peer that does not answer the SYN would hold this
            // connection's requests for the kernel's minutes.
            let connect = compio::time::timeout(RELAY_CONNECT_TIMEOUT, TcpStream::connect(addr));
            let connected = connect.await.unwrap_or_else(|_| {
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no connection within {RELAY_CONNECT_TIMEOUT:?}"),
                ))
            });
            let stream = match connected {
                Ok(s) => s,
                Err(e) => {
                    let id = header_request_id(raw);
                    self.outbox.error(
                        Op::ERROR,
                        Status::IO_ERROR,
                        id,
                        &[],
                        &format!("forwarding to {addr}: {e}"),
                    );
                    return;
                }
            };
            let _ = stream.set_nodelay(true);
            keep_alive(&stream);
            let (rd, wr) = stream.into_split();
            let relay = Relay {
                out: Rc::new(Outbox::new()),
                watch: Rc::new(RelayWatch::new()),
            };
            compio::runtime::spawn(outbox::writer(wr, relay.out.clone())).detach();
            compio::runtime::spawn(pump(rd, self.outbox.clone(), relay.clone())).detach();
            let silence = self.shard.peer_silence;
            compio::runtime::spawn(watch(addr, self.outbox.clone(), relay.clone(), silence))
                .detach();
            self.relays.insert(addr, relay);
        }
        if let Some(relay) = self.relays.get(&addr) {
            if let Ok(Some((h, _))) = wire::decode_header(raw, u32::MAX) {
                if Op::from_code(h.op) != Some(Op::CANCEL) {
                    relay.watch.pending.borrow_mut().insert(h.request_id.get());
                }
            }
            relay.out.raw(raw);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's refusal of a proxied request keeps its op, id and meta, and
    /// becomes the retryable WRONG_ROUTE with the peer's message kept.
    #[test]
    fn refusals_of_proxied_requests_become_wrong_route() {
        let meta = [7u8; 16];
        let mut frame = Vec::new();
        wire::encode_frame(
            &mut frame,
            Op::READ_DONE,
            0,
            Status::NOT_JOURNAL_BROKER,
            42,
            &meta,
            b"broker b2 is not in the journal's route",
        );
        let out = refused_by_peer(&frame, meta.len());
        let (h, total) = wire::decode_header(&out, BODY_LEN_MAX).unwrap().unwrap();
        assert_eq!(total, out.len());
        assert_eq!(Op::from_code(h.op), Some(Op::READ_DONE));
        assert_eq!(Status::from_code(h.status.get()), Some(Status::WRONG_ROUTE));
        assert!(Status::WRONG_ROUTE.is_retryable());
        assert_eq!(h.request_id.get(), 42);
        assert_eq!(usize::from(h.meta_len.get()), meta.len());
        let body = &out[HEADER_LEN..];
        assert_eq!(&body[..16], &meta);
        let message = std::str::from_utf8(&body[16..]).unwrap();
        assert!(
            message.starts_with("broker b2 is not in the journal's route (this broker proxied"),
            "{message}"
        );
    }
}
