//! Local fragments: sealed spools kept on disk, named like store objects.

use compio::fs::File;
use rotary_proto::fragment_name::FragmentName;
use rotary_proto::spec::Codec;
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// A sealed span `[begin, end)` of a journal on local disk.
pub struct LocalFragment {
    pub begin: u64,
    pub end: u64,
    pub sha1: [u8; 20],
    pub path: PathBuf,
    /// An open handle, if one is at hand (the sealed spool's).
    pub file: Option<Rc<File>>,
    /// The fragment is in its journal's store (confirmed by an upload or a
    /// listing); the local file is then only a read cache.
    pub uploaded: bool,
    /// An upload of it is queued or running.
    pub uploading: bool,
    /// Why the file is known not to hold the fragment's bytes (its upload
    /// read it back and found another SHA-1 or length). It is then never
    /// read again: reads of its span go to a store copy or fail.
    pub corrupt: Option<String>,
    /// Its bytes are known to be the ones its name says: it was sealed or
    /// copied by this process, which hashed every byte as it wrote it, or
    /// [`check_file`] read it whole since. A file found on disk at start is
    /// not, until it is checked: a flipped bit or a file edited by hand
    /// would otherwise be served as the journal's bytes.
    pub verified: bool,
    /// When it was sealed (for a fragment found on disk at start, its
    /// file's modification time). Held here so that cache eviction and
    /// listings need no system call per fragment.
    pub sealed_at: std::time::SystemTime,
    /// Not to be uploaded: sealed by a broker the journal's route left
    /// while it was a replica, from bytes its primary may not have
    /// confirmed. It stays local (a new primary may still copy it) until
    /// a primary's SYNC makes this broker follow the journal again.
    pub held: bool,
}

impl LocalFragment {
    /// A fragment file with no handle open (it is opened per read), not in
    /// a store nor on its way there, not known to be damaged. `verified`:
    /// this process hashed its bytes.
    pub fn file_at(
        (begin, end): (u64, u64),
        sha1: [u8; 20],
        path: PathBuf,
        verified: bool,
        sealed_at: std::time::SystemTime,
    ) -> LocalFragment {
        LocalFragment {
            begin,
            end,
            sha1,
            path,
            file: None,
            uploaded: false,
            uploading: false,
            corrupt: None,
            verified,
            sealed_at,
            held: false,
        }
    }
}

/// `<begin:016x>-<end:016x>-<sha1:40 hex>.raw`: Gazette's fragment name
/// for an uncompressed fragment (local files are never compressed).
pub fn fragment_file_name(begin: u64, end: u64, sha1: &[u8; 20]) -> String {
    FragmentName {
        begin,
        end,
        sha1: *sha1,
        codec: Codec::None,
    }
    .file_name()
}

/// Parses a fragment object or file name into begin, end, SHA-1 and
/// extension, by the one set of rules `rotary_proto::fragment_name` keeps
/// for local files and store objects alike. Anything else is `None`.
pub fn parse_fragment_name(name: &str) -> Option<(u64, u64, [u8; 20], &'static str)> {
    let n = FragmentName::parse(name)?;
    Some((n.begin, n.end, n.sha1, n.codec.extension()))
}

/// Extension of a fragment file still being copied from a peer
/// (`<begin:016x>.copying`). A copy that did not finish is made again, so
/// recovery removes such files.
pub const COPYING_EXT: &str = "copying";

/// What a journal's local directory holds.
#[derive(Default)]
pub struct LocalListing {
    pub fragments: Vec<LocalFragment>,
    /// Spool files by begin offset, ascending.
    pub spools: Vec<(u64, PathBuf)>,
    /// Files of copies that did not finish (see [`COPYING_EXT`]).
    pub partial: Vec<PathBuf>,
}

/// Lists a journal's directory. A missing directory is empty.
pub fn list_dir(dir: &Path) -> std::io::Result<LocalListing> {
    let mut out = LocalListing::default();
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for entry in rd {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(stem) = name.strip_suffix(".spool") {
            if let Ok(begin) = u64::from_str_radix(stem, 16) {
                out.spools.push((begin, entry.path()));
            }
        } else if name
            .strip_suffix(COPYING_EXT)
            .is_some_and(|stem| stem.ends_with('.'))
        {
            out.partial.push(entry.path());
        } else if let Some((begin, end, sha1, ".raw")) = parse_fragment_name(name) {
            let modified = entry.metadata().and_then(|m| m.modified());
            let sealed_at = modified.unwrap_or(std::time::SystemTime::UNIX_EPOCH);
            let (path, verified) = (entry.path(), false);
            let f = LocalFragment::file_at((begin, end), sha1, path, verified, sealed_at);
            out.fragments.push(f);
        }
    }
    out.fragments.sort_by_key(|f| (f.begin, f.end));
    out.spools.sort_by_key(|s| s.0);
    Ok(out)
}

/// Why a fragment's file does not hold the bytes its name says.
#[derive(Debug)]
pub enum CheckFailed {
    /// The file could not be read; reading it again may work.
    Io(std::io::Error),
    /// The file was read whole and holds other bytes (or another length).
    Mismatch(String),
}

/// Bytes read at a time by [`check_file`].
const CHECK_CHUNK_BYTES: usize = 1 << 20;

/// Reads the fragment file at `path` whole, on the calling thread, and
/// checks that it holds exactly `end - begin` bytes whose SHA-1 is `sha1`.
/// Blocking: a shard hands this to a thread of its own.
pub fn check_file(path: &Path, begin: u64, end: u64, sha1: &[u8; 20]) -> Result<(), CheckFailed> {
    use std::io::Read;
    assert!(begin <= end, "fragment [{begin}, {end}) runs backwards");
    let want = end - begin;
    let mut file = std::fs::File::open(path).map_err(CheckFailed::Io)?;
    let mut sha = crate::sha::Sha1::new();
    let mut buf = vec![0u8; CHECK_CHUNK_BYTES];
    let mut len: u64 = 0;
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(CheckFailed::Io(e)),
        };
        len += n as u64;
        if len > want {
            return Err(CheckFailed::Mismatch(format!(
                "holds more than the {want} bytes its name says"
            )));
        }
        sha.update(&buf[..n]);
    }
    if len != want {
        return Err(CheckFailed::Mismatch(format!(
            "holds {len} bytes where its name says {want}"
        )));
    }
    let got = sha.finalize();
    if &got != sha1 {
        return Err(CheckFailed::Mismatch(format!(
            "its bytes have SHA-1 {} where its name says {}",
            hex::encode(got),
            hex::encode(sha1)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let sha = [0xab; 20];
        let n = fragment_file_name(0x10, 0x2000, &sha);
        assert_eq!(
            n,
            format!("0000000000000010-0000000000002000-{}.raw", "ab".repeat(20))
        );
        assert_eq!(parse_fragment_name(&n), Some((0x10, 0x2000, sha, ".raw")));
        let z = n.replace(".raw", ".zst");
        assert_eq!(parse_fragment_name(&z).unwrap().3, ".zst");
        assert_eq!(parse_fragment_name("0000000000000010.spool"), None);
        assert_eq!(parse_fragment_name("x-y-z.raw"), None);
        let backwards = fragment_file_name(0x20, 0x10, &sha);
        assert_eq!(parse_fragment_name(&backwards), None);
    }

    #[test]
    fn listing_sorts_out_fragments_spools_and_unfinished_copies() {
        let dir = tempfile::tempdir().unwrap();
        let sha = [7; 20];
        let frag = fragment_file_name(0, 100, &sha);
        for name in [
            frag.as_str(),
            "0000000000000064.spool",
            "0000000000000064.copying",
            "notes.copying.txt",
            "xcopying",
        ] {
            std::fs::write(dir.path().join(name), b"x").unwrap();
        }
        let l = list_dir(dir.path()).unwrap();
        assert_eq!(l.fragments.len(), 1);
        assert_eq!((l.fragments[0].begin, l.fragments[0].end), (0, 100));
        assert_eq!(
            l.spools,
            vec![(100, dir.path().join("0000000000000064.spool"))]
        );
        assert_eq!(l.partial, vec![dir.path().join("0000000000000064.copying")]);
    }

    #[test]
    fn check_file_finds_a_flipped_byte_and_a_wrong_length() {
        use sha1::Digest;
        let dir = tempfile::tempdir().unwrap();
        // Longer than one read, so the hash spans chunks.
        let bytes: Vec<u8> = (0..CHECK_CHUNK_BYTES + 4097)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let sha: [u8; 20] = sha1::Sha1::digest(&bytes).into();
        let end = 1000 + bytes.len() as u64;
        let path = dir.path().join(fragment_file_name(1000, end, &sha));
        std::fs::write(&path, &bytes).unwrap();
        check_file(&path, 1000, end, &sha).unwrap();

        let mut flipped = bytes.clone();
        flipped[CHECK_CHUNK_BYTES + 10] ^= 0x01;
        std::fs::write(&path, &flipped).unwrap();
        match check_file(&path, 1000, end, &sha) {
            Err(CheckFailed::Mismatch(why)) => assert!(why.contains(&hex::encode(sha)), "{why}"),
            other => panic!("flipped byte: {other:?}"),
        }

        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        match check_file(&path, 1000, end, &sha) {
            Err(CheckFailed::Mismatch(why)) => {
                assert!(why.contains(&format!("{} bytes", bytes.len() - 1)), "{why}")
            }
            other => panic!("short file: {other:?}"),
        }
        let mut long = bytes.clone();
        long.push(0);
        std::fs::write(&path, &long).unwrap();
        assert!(matches!(
            check_file(&path, 1000, end, &sha),
            Err(CheckFailed::Mismatch(_))
        ));

        std::fs::remove_file(&path).unwrap();
        match check_file(&path, 1000, end, &sha) {
            Err(CheckFailed::Io(e)) => assert_eq!(e.kind(), std::io::ErrorKind::NotFound),
            other => panic!("missing file: {other:?}"),
        }
    }
}
