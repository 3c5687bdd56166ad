//! Object names of fragments — Gazette's, so that its tools and ours read
//! each other's stores.
//!
//! A fragment of journal `j` covering `[begin, end)` with SHA-1 `s` of its
//! uncompressed bytes is the object `<j>/<begin:016x>-<end:016x>-<s:40 hex><ext>`
//! (`ext` by codec: `.raw`, `.gz`, `.zst`, `.sz`, and none at all for
//! gzip-offload). Gazette allows an optional *postfix* directory between
//! journal and file name (`<j>/<postfix>/<name>`); rotary writes none but
//! reads both.
//!
//! **Reading is Gazette's, writing is canonical.** Every name Gazette's
//! `ParseFragmentFromRelativePath` takes for a fragment it could have
//! written is read: the extension is matched ignoring case, with Gazette's
//! aliases (`.gzip`, `.zstandard`, `.snappy`, and `.gzod` beside no
//! extension for gzip-offload; the table is `spec::CODEC_NAMES`), and hex
//! digits may be upper case. Offsets are always 16 digits and the SHA-1 40,
//! as every Gazette writes them. rotary writes only the lower-case
//! canonical form, so a name it writes parses back to the same fragment.
//!
//! **Postfix rule.** A listing of journal `j` takes file names directly
//! under `j/`, and under `j/<seg>/` only when `<seg>` contains `=`
//! (Gazette's postfixes are `key=value`, e.g. `pivot=1`). Anything else one
//! level down — and everything deeper — belongs to child journals: journal
//! `a/b` never picks up the fragments of `a/b/c`. Journal name components
//! may contain `=` too, so a child journal whose *last* component contains
//! `=` (e.g. `a/b/x=1` beside `a/b`) is ambiguous: its fragments would also
//! be listed as `a/b`'s. Don't name journals that way when their parent
//! path is itself a journal.

use crate::spec::Codec;

const OFFSET_HEX_LEN: usize = 16;
const SHA1_HEX_LEN: usize = 40;
/// `<begin>-<end>-<sha1>` without the extension.
const STEM_LEN: usize = OFFSET_HEX_LEN + 1 + OFFSET_HEX_LEN + 1 + SHA1_HEX_LEN;

/// The parts of a fragment's file name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FragmentName {
    pub begin: u64,
    pub end: u64,
    pub sha1: [u8; 20],
    pub codec: Codec,
}

impl FragmentName {
    /// `<begin:016x>-<end:016x>-<sha1 hex><ext>`.
    pub fn file_name(&self) -> String {
        format!(
            "{:016x}-{:016x}-{}{}",
            self.begin,
            self.end,
            hex::encode(self.sha1),
            self.codec.extension()
        )
    }

    /// The key of the fragment within a store (relative to the store's
    /// prefix), as rotary writes it: no postfix.
    pub fn key(&self, journal: &str) -> String {
        format!("{journal}/{}", self.file_name())
    }

    /// Parses a file name (no directories). Offsets are hex of exactly 16
    /// digits, the SHA-1 of exactly 40; `begin <= end`; the extension is
    /// any of the codec's (module docs), none included.
    pub fn parse(name: &str) -> Option<FragmentName> {
        if name.len() < STEM_LEN || !name.is_char_boundary(STEM_LEN) {
            return None;
        }
        let (stem, ext) = name.split_at(STEM_LEN);
        let b = stem.as_bytes();
        if b[OFFSET_HEX_LEN] != b'-' || b[2 * OFFSET_HEX_LEN + 1] != b'-' {
            return None;
        }
        let hex_u64 = |s: &str| {
            if s.bytes().all(|c| c.is_ascii_hexdigit()) {
                u64::from_str_radix(s, 16).ok()
            } else {
                None
            }
        };
        let begin = hex_u64(&stem[..OFFSET_HEX_LEN])?;
        let end = hex_u64(&stem[OFFSET_HEX_LEN + 1..2 * OFFSET_HEX_LEN + 1])?;
        let mut sha1 = [0u8; 20];
        hex::decode_to_slice(&stem[2 * OFFSET_HEX_LEN + 2..], &mut sha1).ok()?;
        let codec = Codec::from_extension(ext)?;
        // Offsets beyond i64::MAX are not a journal's: no request carries
        // them, and a head there could not grow.
        if begin > end || end > i64::MAX as u64 {
            return None;
        }
        Some(FragmentName {
            begin,
            end,
            sha1,
            codec,
        })
    }
}

/// Where an object sits relative to journal `<journal>/`: `rel` is its key
/// with `<journal>/` stripped. Gives the fragment name if the object is one
/// of this journal's fragments under the postfix rule (module docs).
pub fn journal_fragment(rel: &str) -> Option<FragmentName> {
    match rel.split_once('/') {
        None => FragmentName::parse(rel),
        Some((postfix, name)) if postfix.contains('=') && !name.contains('/') => {
            FragmentName::parse(name)
        }
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn codec_strategy() -> impl Strategy<Value = Codec> {
        proptest::sample::select(Codec::ALL.to_vec())
    }

    proptest! {
        #[test]
        fn names_round_trip(a in 0..=i64::MAX as u64, b in 0..=i64::MAX as u64, sha1: [u8; 20], codec in codec_strategy()) {
            let n = FragmentName { begin: a.min(b), end: a.max(b), sha1, codec };
            let name = n.file_name();
            prop_assert_eq!(name.len(), STEM_LEN + codec.extension().len());
            prop_assert_eq!(FragmentName::parse(&name), Some(n));
            prop_assert_eq!(journal_fragment(&name), Some(n));
            let postfixed = format!("pivot=1/{name}");
            prop_assert_eq!(journal_fragment(&postfixed), Some(n));
        }

        #[test]
        fn parse_never_panics(s in "\\PC{0,80}") {
            let _ = FragmentName::parse(&s);
            let _ = journal_fragment(&s);
        }
    }

    #[test]
    fn gazette_names() {
        let name = "0000000000000000-00000000000003e8-da39a3ee5e6b4b0d3255bfef95601890afd80709.gz";
        let n = FragmentName::parse(name).unwrap();
        assert_eq!((n.begin, n.end, n.codec), (0, 1000, Codec::Gzip));
        assert_eq!(
            hex::encode(n.sha1),
            "da39a3ee5e6b4b0d3255bfef95601890afd80709"
        );
        assert_eq!(n.file_name(), name);
        assert_eq!(n.key("a/b"), format!("a/b/{name}"));
        // Ends beyond i64::MAX are no journal's fragments.
        let sha = "da39a3ee5e6b4b0d3255bfef95601890afd80709";
        assert!(
            FragmentName::parse(&format!("0000000000000004-ffffffffffffffff-{sha}.raw")).is_none()
        );
        assert!(
            FragmentName::parse(&format!("0000000000000004-8000000000000000-{sha}.raw")).is_none()
        );
        let top =
            FragmentName::parse(&format!("0000000000000004-7fffffffffffffff-{sha}.raw")).unwrap();
        assert_eq!(top.end, i64::MAX as u64);
        // Upper-case hex is Gazette-legal on read.
        assert!(FragmentName::parse(&name.to_uppercase().replace(".GZ", ".gz")).is_some());
    }

    #[test]
    fn refused_names() {
        let sha = "da39a3ee5e6b4b0d3255bfef95601890afd80709";
        for bad in [
            format!("0000000000000000-00000000000003e8-{sha}.lz4"),
            format!("0000000000000000-00000000000003e8-{sha}.zstd"),
            format!("0000000000000000-00000000000003e8-{sha}.raw.gz"),
            format!("0000000000000000-00000000000003e8-{sha}."),
            format!("0000000000000000-00000000000003e8-{sha}#1"),
            format!("0000000000000000-00000000000003e8-{sha}.gzod#7"),
            format!("0000000000000000-00000000000003e8-{}", &sha[1..]),
            format!("000000000000000-00000000000003e8-{sha}0"),
            format!("00000000000003e8-0000000000000000-{sha}.raw"),
            format!("+000000000000000-00000000000003e8-{sha}.raw"),
            format!("0000000000000000_00000000000003e8-{sha}.raw"),
            format!("0000000000000000-00000000000003e8-{}.raw", &sha[1..]),
            "short.raw".to_string(),
        ] {
            assert_eq!(FragmentName::parse(&bad), None, "{bad}");
        }
    }

    /// Every name Gazette reads for a fragment: each extension and alias,
    /// in any case, none at all, upper-case hex, under a postfix too.
    #[test]
    fn gazette_store_names() {
        let stem = "00000000499602d2-7fffffffffffffff-0102030405060708090a0b0c0d0e0f1011121314";
        let cases = [
            (".raw", Codec::None),
            (".RAW", Codec::None),
            (".gz", Codec::Gzip),
            (".GZ", Codec::Gzip),
            (".gzip", Codec::Gzip),
            (".GZIP", Codec::Gzip),
            (".zst", Codec::Zstd),
            (".Zst", Codec::Zstd),
            (".zstandard", Codec::Zstd),
            (".ZSTANDARD", Codec::Zstd),
            (".sz", Codec::Snappy),
            (".SZ", Codec::Snappy),
            (".snappy", Codec::Snappy),
            (".SNAPPY", Codec::Snappy),
            ("", Codec::GzipOffload),
            (".gzod", Codec::GzipOffload),
            (".GZOD", Codec::GzipOffload),
        ];
        let want_sha1: [u8; 20] = std::array::from_fn(|i| i as u8 + 1);
        for (ext, codec) in cases {
            let name = format!("{stem}{ext}");
            let n = FragmentName::parse(&name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(
                (n.begin, n.end, n.sha1, n.codec),
                (1234567890, i64::MAX as u64, want_sha1, codec),
                "{name}"
            );
            assert_eq!(journal_fragment(&name), Some(n));
            assert_eq!(journal_fragment(&format!("a=1/{name}")), Some(n));
            let upper_hex = format!("{}{ext}", stem.to_uppercase());
            assert_eq!(FragmentName::parse(&upper_hex), Some(n), "{upper_hex}");
            // What rotary writes for it: lower case, the codec's extension.
            assert_eq!(n.file_name(), format!("{stem}{}", codec.extension()));
        }
        // Gazette's name of a gzip-offload fragment has no extension.
        let n = FragmentName::parse(stem).unwrap();
        assert_eq!(n.file_name(), stem);
        assert_eq!(n.key("a/journal"), format!("a/journal/{stem}"));
    }

    #[test]
    fn postfix_rule() {
        let name = "0000000000000000-0000000000000010-da39a3ee5e6b4b0d3255bfef95601890afd80709.raw";
        assert!(journal_fragment(name).is_some());
        assert!(journal_fragment(&format!("pivot=1/{name}")).is_some());
        // A child journal `<journal>/c`, and anything deeper.
        assert!(journal_fragment(&format!("c/{name}")).is_none());
        assert!(journal_fragment(&format!("c/d/{name}")).is_none());
        assert!(journal_fragment(&format!("pivot=1/d/{name}")).is_none());
        assert!(journal_fragment(&format!("c/pivot=1/{name}")).is_none());
    }
}
