//! The tests' one client of the wire protocol: raw frames over a blocking
//! socket, and the few requests every test makes (admin, append, read).

use rotary_net::spec::JournalSpec;
use rotary_net::status::Status;
use rotary_net::wire::{self, AppendReply, AppendRequest, Op, ReadRequest, BODY_LEN_MAX};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// How long `recv` waits for a frame unless the connection says otherwise.
pub const REPLY_WAIT: Duration = Duration::from_secs(20);

pub struct Reply {
    pub op: Op,
    pub flags: u8,
    /// `None` for a status this build does not know.
    pub status: Option<Status>,
    pub code: u16,
    pub id: u64,
    pub meta: Vec<u8>,
    pub payload: Vec<u8>,
}

impl Reply {
    pub fn status_name(&self) -> String {
        self.status
            .map_or_else(|| format!("status {}", self.code), |s| s.name().to_string())
    }

    /// The status, which must be one this build knows.
    pub fn known_status(&self) -> Status {
        self.status
            .unwrap_or_else(|| panic!("{:?} answered with unknown status {}", self.op, self.code))
    }
}

/// One non-blocking READ's answer: its READ_DATA frames as (offset,
/// bytes), in the order they came, and its READ_DONE.
pub struct ReadFrames {
    pub data: Vec<(u64, Vec<u8>)>,
    pub done: Reply,
}

impl ReadFrames {
    /// The bytes from `offset`; each frame must begin where the last ended.
    pub fn contiguous(&self, offset: u64) -> Vec<u8> {
        let mut bytes = Vec::new();
        for (at, payload) in &self.data {
            assert_eq!(*at, offset + bytes.len() as u64, "READ_DATA out of order");
            bytes.extend_from_slice(payload);
        }
        bytes
    }
}

pub struct Conn {
    pub s: TcpStream,
    buf: Vec<u8>,
    next_id: u64,
    /// How long `recv` waits for a frame before it fails the test.
    wait: Duration,
}

impl Conn {
    pub fn new(addr: SocketAddr) -> Conn {
        Conn::with_wait(addr, REPLY_WAIT)
    }

    pub fn with_wait(addr: SocketAddr, wait: Duration) -> Conn {
        let s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        Conn {
            s,
            buf: Vec::new(),
            next_id: 1,
            wait,
        }
    }

    /// A request id not used before on this connection.
    pub fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    pub fn send(&mut self, op: Op, flags: u8, id: u64, meta: &[u8], payload: &[u8]) {
        let mut out = Vec::new();
        wire::encode_frame(&mut out, op, flags, Status::OK, id, meta, payload);
        self.s.write_all(&out).unwrap();
    }

    /// Sends a request of no flags under a fresh id; returns the id.
    pub fn request(&mut self, op: Op, meta: &[u8], payload: &[u8]) -> u64 {
        let id = self.id();
        self.send(op, 0, id, meta, payload);
        id
    }

    /// The next frame, or `None` if none came within `wait`.
    pub fn recv_within(&mut self, wait: Duration) -> Option<Reply> {
        self.s.set_read_timeout(Some(wait)).unwrap();
        loop {
            if let Some((f, used)) = wire::decode_frame(&self.buf, BODY_LEN_MAX).unwrap() {
                let r = Reply {
                    op: f.op,
                    flags: f.flags,
                    status: Status::from_code(f.status),
                    code: f.status,
                    id: f.request_id,
                    meta: f.meta.to_vec(),
                    payload: f.payload.to_vec(),
                };
                self.buf.drain(..used);
                return Some(r);
            }
            let mut tmp = [0u8; 65536];
            match self.s.read(&mut tmp) {
                Ok(0) => panic!("the broker closed the connection"),
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return None
                }
                Err(e) => panic!("reading from the broker: {e}"),
            }
        }
    }

    pub fn recv(&mut self) -> Reply {
        let wait = self.wait;
        self.recv_within(wait)
            .unwrap_or_else(|| panic!("no answer from the broker within {wait:?}"))
    }

    /// An admin request's status and JSON payload.
    pub fn admin(&mut self, op: Op, meta: &[u8], payload: &[u8]) -> Reply {
        self.request(op, meta, payload);
        let r = self.recv();
        assert_eq!(r.op, Op::ADMIN_REPLY, "{op:?} answered with {:?}", r.op);
        r
    }

    /// An admin request that must succeed; its reply.
    pub fn admin_ok(&mut self, op: Op, meta: &[u8], payload: &[u8]) -> Reply {
        let r = self.admin(op, meta, payload);
        assert_eq!(
            r.status,
            Some(Status::OK),
            "{op:?}: {}",
            String::from_utf8_lossy(&r.payload)
        );
        r
    }

    pub fn apply(&mut self, specs: &[JournalSpec]) {
        self.admin_ok(Op::APPLY, &[], &serde_json::to_vec(specs).unwrap());
    }

    /// DELETE of one journal; returns the reply's status.
    pub fn delete(&mut self, name: &str) -> Status {
        self.admin(Op::DELETE, &wire::encode_name(name), &[])
            .known_status()
    }

    pub fn append(&mut self, req: &AppendRequest, content: &[u8]) -> (Status, AppendReply) {
        self.request(Op::APPEND, &req.encode(), content);
        let r = self.recv();
        assert_eq!(r.op, Op::APPEND_REPLY);
        (r.known_status(), AppendReply::decode(&r.meta).unwrap())
    }

    /// An append of `content` to `journal` that must commit; its reply.
    pub fn append_ok(&mut self, journal: &str, content: &[u8]) -> AppendReply {
        let (status, reply) = self.append(&super::req(journal), content);
        assert_eq!(status, Status::OK, "append to {journal}");
        reply
    }

    /// Sends a READ of `journal` from `offset` to its end, flagged `flags`,
    /// as request `id`.
    pub fn send_read(&mut self, journal: &str, offset: u64, flags: u8, id: u64) {
        let req = ReadRequest {
            journal: journal.into(),
            offset: Some(offset),
            end_offset: None,
            route_revision: 0,
        };
        self.send(Op::READ, flags, id, &req.encode(), &[]);
    }

    /// One non-blocking READ of `journal` from `offset`.
    pub fn read(&mut self, journal: &str, offset: u64) -> ReadFrames {
        let id = self.id();
        self.send_read(journal, offset, 0, id);
        let mut data = Vec::new();
        loop {
            let r = self.recv();
            match r.op {
                Op::READ_DATA => {
                    let at = u64::from_le_bytes(r.meta[..8].try_into().unwrap());
                    data.push((at, r.payload));
                }
                Op::READ_DONE => return ReadFrames { data, done: r },
                op => panic!("a READ answered with {op:?}"),
            }
        }
    }

    /// Non-blocking read of [offset, head): the bytes and the final status.
    pub fn read_all(&mut self, journal: &str, offset: u64) -> (Vec<u8>, Status) {
        let frames = self.read(journal, offset);
        (frames.contiguous(offset), frames.done.known_status())
    }

    /// A non-blocking read of [offset, head) that must end OK; its bytes.
    pub fn read_ok(&mut self, journal: &str, offset: u64) -> Vec<u8> {
        let (bytes, status) = self.read_all(journal, offset);
        assert_eq!(status, Status::OK, "read of {journal} from {offset}");
        bytes
    }
}
