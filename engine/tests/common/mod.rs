//! Raw-frame test client and in-process broker helpers.
#![allow(dead_code)]

use rotary_engine::{Broker, ServeConfig};
use rotary_net::spec::JournalSpec;
use rotary_net::status::Status;
use rotary_net::wire::{self, AppendReply, AppendRequest, Op, ReadRequest, BODY_LEN_MAX};
use std::io::{Read, Write};
use std::net::TcpStream;

pub struct Conn {
    pub s: TcpStream,
    buf: Vec<u8>,
}

pub struct Reply {
    pub op: Op,
    pub status: Status,
    pub id: u64,
    pub meta: Vec<u8>,
    pub payload: Vec<u8>,
}

impl Conn {
    pub fn new(addr: std::net::SocketAddr) -> Conn {
        let s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        Conn { s, buf: Vec::new() }
    }

    pub fn send(&mut self, op: Op, flags: u8, id: u64, meta: &[u8], payload: &[u8]) {
        let mut out = Vec::new();
        wire::encode_frame(&mut out, op, flags, Status::OK, id, meta, payload);
        self.s.write_all(&out).unwrap();
    }

    pub fn recv(&mut self) -> Reply {
        loop {
            if let Some((f, used)) = wire::decode_frame(&self.buf, BODY_LEN_MAX).unwrap() {
                let r = Reply {
                    op: f.op,
                    status: Status::from_code(f.status).unwrap(),
                    id: f.request_id,
                    meta: f.meta.to_vec(),
                    payload: f.payload.to_vec(),
                };
                self.buf.drain(..used);
                return r;
            }
            let mut tmp = [0u8; 65536];
            let n = self.s.read(&mut tmp).unwrap();
            assert!(n > 0, "connection closed");
            self.buf.extend_from_slice(&tmp[..n]);
        }
    }

    pub fn apply(&mut self, specs: &[JournalSpec]) {
        self.send(Op::APPLY, 0, 1, &[], &serde_json::to_vec(specs).unwrap());
        let r = self.recv();
        assert_eq!(
            r.status,
            Status::OK,
            "{}",
            String::from_utf8_lossy(&r.payload)
        );
    }

    /// DELETE of one journal; returns the reply's status.
    pub fn delete(&mut self, name: &str) -> Status {
        self.send(Op::DELETE, 0, 1, &rotary_net::wire::encode_name(name), &[]);
        self.recv().status
    }

    pub fn append(&mut self, req: &AppendRequest, content: &[u8]) -> (Status, AppendReply) {
        self.send(Op::APPEND, 0, 7, &req.encode(), content);
        let r = self.recv();
        assert_eq!(r.op, Op::APPEND_REPLY);
        (r.status, AppendReply::decode(&r.meta).unwrap())
    }

    /// Non-blocking read of [offset, head): the bytes and the final status.
    pub fn read_all(&mut self, journal: &str, offset: u64) -> (Vec<u8>, Status) {
        let req = ReadRequest {
            journal: journal.into(),
            offset: Some(offset),
            end_offset: None,
            route_revision: 0,
        };
        self.send(Op::READ, 0, 9, &req.encode(), &[]);
        let mut out = Vec::new();
        loop {
            let r = self.recv();
            match r.op {
                Op::READ_DATA => {
                    let at = u64::from_le_bytes(r.meta[..8].try_into().unwrap());
                    assert_eq!(at, offset + out.len() as u64);
                    out.extend_from_slice(&r.payload);
                }
                Op::READ_DONE => return (out, r.status),
                op => panic!("unexpected {op:?}"),
            }
        }
    }
}

pub fn start(dir: &std::path::Path, cores: usize) -> Broker {
    let mut cfg = ServeConfig::new(dir.to_path_buf(), "127.0.0.1:0".parse().unwrap());
    cfg.cores = cores;
    cfg.disk_reserve_bytes = 0;
    Broker::start(cfg).unwrap()
}

/// A seeded xorshift generator: the same numbers on every run.
pub fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

pub fn req(journal: &str) -> AppendRequest {
    AppendRequest {
        journal: journal.into(),
        ..Default::default()
    }
}
