//! Copies a span of a journal from a peer broker into local fragments.
//!
//! A primary that restarted without its data (a replaced disk) can find a
//! replica ahead of it, and a broker that a journal was just routed to can
//! find the broker it left ahead of it. It moves its head forward to the
//! peer's rather than give offsets out twice, and first copies the bytes
//! in between from that peer, so that it serves them, uploads them, and
//! holds the whole history like any other primary.

use compio::buf::{BufResult, IntoInner, IoBufMut};
use compio::io::{AsyncRead, AsyncWriteAtExt, AsyncWriteExt};
use compio::net::TcpStream;
use rotary_net::wire::{self, flag, Op, ReadData, ReadDone, ReadRequest};
use rotary_net::Status;
use rotary_storage::fragment::{fragment_file_name, LocalFragment, COPYING_EXT};
use rotary_storage::sha::Sha1;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Longest wait for the next frame of the peer's answer.
pub const FETCH_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a copy goes: the journal's directory, and whether each fragment
/// is made durable (synced, its directory too) before it counts.
pub struct Dest<'a> {
    pub journal: &'a str,
    pub dir: &'a Path,
    pub durable: bool,
}

/// Copies `[from, to)` of the journal from the peer shard at `addr` into
/// fragment files in `dest`, one per contiguous run of bytes the peer holds
/// itself. Bytes the peer knows only from a store are skipped (they stay
/// in the store); so are bytes it does not hold at all. Returns the new
/// fragments in offset order. On error no file of the copy is left behind.
pub async fn copy_span(
    addr: SocketAddr,
    dest: &Dest<'_>,
    from: u64,
    to: u64,
) -> Result<Vec<LocalFragment>, String> {
    let mut pieces = Pieces {
        dest,
        open: None,
        done: Vec::new(),
    };
    let copied = async {
        compio::fs::create_dir_all(dest.dir)
            .await
            .map_err(|e| format!("{}: {e}", dest.dir.display()))?;
        let mut at = from;
        while at < to {
            let next = read_once(addr, dest.journal, at, to, &mut pieces).await?;
            if next <= at {
                // The peer holds nothing at or beyond `at`.
                break;
            }
            at = next;
        }
        pieces.close().await
    }
    .await;
    match copied {
        Ok(()) => Ok(pieces.done),
        Err(e) => {
            pieces.discard().await;
            Err(format!("copying [{from}, {to}) from {addr}: {e}"))
        }
    }
}

/// Copies `[from, to)` from several peers: each `(head, addr)` in turn,
/// the furthest first, fills what the ones before it did not hold, up to
/// its own head. A peer that was itself restarted without its data may
/// hold only the newest bytes while another holds all of them. Returns the
/// fragments in offset order; on error none is left behind.
pub async fn copy_from_each(
    sources: &[(u64, SocketAddr)],
    journal: &str,
    from: u64,
    to: u64,
    dir: &Path,
    durable: bool,
) -> Result<Vec<LocalFragment>, String> {
    let dest = Dest {
        journal,
        dir,
        durable,
    };
    let mut copied: Vec<LocalFragment> = Vec::new();
    let mut missing = vec![(from, to)];
    for &(head, addr) in sources {
        let mut still = Vec::new();
        for (a, b) in std::mem::take(&mut missing) {
            let end = b.min(head);
            if a >= end {
                still.push((a, b));
                continue;
            }
            match copy_span(addr, &dest, a, end).await {
                Ok(got) => {
                    still.extend(uncovered(a, b, &got));
                    copied.extend(got);
                }
                Err(e) => {
                    remove_all(&copied).await;
                    return Err(e);
                }
            }
        }
        missing = still;
        if missing.is_empty() {
            break;
        }
    }
    copied.sort_by_key(|f| f.begin);
    Ok(copied)
}

/// The parts of `[a, b)` that `got` (ascending, disjoint, within it) does
/// not cover.
fn uncovered(a: u64, b: u64, got: &[LocalFragment]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = a;
    for f in got {
        if f.begin > at {
            out.push((at, f.begin));
        }
        at = at.max(f.end);
    }
    if at < b {
        out.push((at, b));
    }
    out
}

/// Removes a copy's fragment files (after a failure: none may stay).
async fn remove_all(fragments: &[LocalFragment]) {
    for f in fragments {
        let _ = compio::fs::remove_file(&f.path).await;
    }
}

/// One non-blocking READ of `[from, to)` with DO_NOT_PROXY and TAKEOVER
/// (a peer the journal left serves what it holds too), its data written
/// into `pieces`. Returns the offset the read ended at: `to`, or the end
/// of a store-held fragment the peer pointed at, or `from` if the peer
/// holds nothing there.
async fn read_once(
    addr: SocketAddr,
    journal: &str,
    from: u64,
    to: u64,
    pieces: &mut Pieces<'_>,
) -> Result<u64, String> {
    let mut s = compio::time::timeout(FETCH_IDLE_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let _ = s.set_nodelay(true);
    let req = ReadRequest {
        journal: journal.to_string(),
        offset: Some(from),
        end_offset: Some(to),
        route_revision: 0,
    };
    let mut out = Vec::new();
    wire::encode_frame(
        &mut out,
        Op::READ,
        flag::DO_NOT_PROXY | flag::TAKEOVER,
        Status::OK,
        1,
        &req.encode(),
        &[],
    );
    let BufResult(res, _) = s.write_all(out).await;
    res.map_err(|e| e.to_string())?;

    let mut buf: Vec<u8> = Vec::with_capacity(2 << 20);
    let mut at = 0;
    loop {
        let decoded = wire::decode_frame(&buf[at..], wire::BODY_LEN_MAX)
            .map_err(|e| format!("bad frame from the peer: {e}"))?;
        let Some((f, used)) = decoded else {
            // Keep the partial frame; read more behind it.
            buf.drain(..at);
            at = 0;
            if buf.capacity() - buf.len() < 64 << 10 {
                buf.reserve(1 << 20);
            }
            let read = compio::time::timeout(FETCH_IDLE_TIMEOUT, s.read(buf.uninit()));
            let BufResult(res, b) = read
                .await
                .map_err(|_| format!("no answer for {FETCH_IDLE_TIMEOUT:?}"))?;
            buf = b.into_inner();
            match res {
                Ok(0) => return Err("the peer closed the connection".into()),
                Ok(_) => continue,
                Err(e) => return Err(e.to_string()),
            }
        };
        at += used;
        let status = Status::from_code(f.status).unwrap_or(Status::IO_ERROR);
        match f.op {
            Op::READ_DATA if status == Status::OK => {
                let offset = wire::decode_fixed::<ReadData>(f.meta, "READ_DATA offset")
                    .map_err(|e| e.to_string())?
                    .offset
                    .get();
                let end = offset + f.payload.len() as u64;
                if offset < from || end > to {
                    return Err(format!(
                        "the peer sent [{offset}, {end}) for [{from}, {to})"
                    ));
                }
                pieces.write(offset, f.payload).await?;
            }
            // History only in a store stays there: the read ends at the
            // fragment's end, and the copy goes on from it.
            Op::READ_FRAGMENT if status == Status::OK => {}
            Op::READ_DONE if status == Status::OK => {
                let next = wire::decode_fixed::<ReadDone>(f.meta, "READ_DONE offsets")
                    .map_err(|e| e.to_string())?
                    .offset
                    .get();
                return Ok(next.min(to));
            }
            op => {
                let msg = String::from_utf8_lossy(f.payload);
                return Err(format!("{op:?} {status}: {msg}"));
            }
        }
    }
}

/// The fragment files of one copy: those written, and the one being
/// written.
struct Pieces<'a> {
    dest: &'a Dest<'a>,
    open: Option<Piece>,
    done: Vec<LocalFragment>,
}

impl Pieces<'_> {
    /// Writes the bytes at `offset`: into the open piece if they follow
    /// it, else into a new one (the open one becomes a fragment).
    async fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        if self.open.as_ref().is_some_and(|p| p.end != offset) {
            self.close().await?;
        }
        if self.open.is_none() {
            self.open = Some(Piece::create(self.dest.dir, offset).await?);
        }
        self.open.as_mut().expect("open piece").write(bytes).await
    }

    /// Makes the open piece, if any, a fragment.
    async fn close(&mut self) -> Result<(), String> {
        if let Some(p) = self.open.take() {
            let (dir, durable) = (self.dest.dir, self.dest.durable);
            self.done.push(p.finish(dir, durable).await?);
        }
        Ok(())
    }

    async fn discard(&mut self) {
        if let Some(p) = self.open.take() {
            let _ = compio::fs::remove_file(&p.path).await;
        }
        remove_all(&self.done).await;
        self.done.clear();
    }
}

/// A fragment file being written: `[begin, end)` so far.
struct Piece {
    file: compio::fs::File,
    path: PathBuf,
    begin: u64,
    end: u64,
    sha: Sha1,
}

impl Piece {
    async fn create(dir: &Path, begin: u64) -> Result<Piece, String> {
        let path = dir.join(format!("{begin:016x}.{COPYING_EXT}"));
        // Readable too: readers are served from the same handle.
        let file = compio::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .await
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Piece {
            file,
            path,
            begin,
            end: begin,
            sha: Sha1::new(),
        })
    }

    async fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.sha.update(bytes);
        let pos = self.end - self.begin;
        let BufResult(res, _) = self.file.write_all_at(bytes.to_vec(), pos).await;
        res.map_err(|e| format!("{}: {e}", self.path.display()))?;
        self.end += bytes.len() as u64;
        Ok(())
    }

    /// Makes the file a fragment under its final name.
    async fn finish(self, dir: &Path, durable: bool) -> Result<LocalFragment, String> {
        let fail = |p: &Path, e: &dyn std::fmt::Display| format!("{}: {e}", p.display());
        if durable {
            self.file
                .sync_data()
                .await
                .map_err(|e| fail(&self.path, &e))?;
        }
        let sha1 = self.sha.finalize();
        let dest = dir.join(fragment_file_name(self.begin, self.end, &sha1));
        compio::fs::rename(&self.path, &dest)
            .await
            .map_err(|e| fail(&dest, &e))?;
        if durable {
            rotary_storage::sync_dir(dir)
                .await
                .map_err(|e| e.to_string())?;
        }
        // Hashed into `sha1` as it was copied. Opened per read, like any
        // older fragment: a long copy makes many fragments, and none keeps
        // a descriptor.
        let span = (self.begin, self.end);
        let now = crate::clock::wall();
        Ok(LocalFragment::file_at(span, sha1, dest, true, now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frag(begin: u64, end: u64) -> LocalFragment {
        let epoch = std::time::SystemTime::UNIX_EPOCH;
        LocalFragment::file_at((begin, end), [0; 20], PathBuf::new(), true, epoch)
    }

    #[test]
    fn what_a_copy_left_uncovered() {
        assert_eq!(uncovered(0, 10, &[]), vec![(0, 10)]);
        assert_eq!(uncovered(0, 10, &[frag(0, 10)]), vec![]);
        assert_eq!(uncovered(0, 10, &[frag(8, 10)]), vec![(0, 8)]);
        assert_eq!(
            uncovered(0, 10, &[frag(2, 4), frag(6, 7)]),
            vec![(0, 2), (4, 6), (7, 10)]
        );
    }
}
