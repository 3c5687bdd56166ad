//! Message UUIDs in Gazette's layout: RFC 4122 version 1, whose clock
//! sequence carries a 4-bit counter extending the timestamp and 10 flag
//! bits, and whose node is the producer id.
//!
//! ```text
//! bytes 0..4   time_low  (clock bits 4..36),  big-endian
//! bytes 4..6   time_mid  (clock bits 36..52), big-endian
//! bytes 6..8   version 1 (0x1000) | time_hi (clock bits 52..64), big-endian
//! bytes 8..10  variant 0b10 | 4-bit counter (clock bits 0..4) | 10 flag bits
//! bytes 10..16 producer id (random, multicast bit 0x01 of byte 10 set)
//! ```
//!
//! A [`Clock`] is the 60-bit timestamp (100 ns units since 1582-10-15)
//! shifted left by 4, plus the counter: each tick adds one, so a producer
//! may mint 16 UUIDs per 100 ns before running ahead of the wall clock, and
//! a tick at counter 15 carries into the timestamp.

use super::MessageError;
use std::fmt;
use std::io::Read as _;

/// 100 ns intervals between 1582-10-15 (RFC 4122's epoch) and 1970-01-01.
pub const G1582_NS100: u64 = 122_192_928_000_000_000;
/// Flags occupy the low 10 bits of the clock sequence.
pub const FLAGS_MAX: u16 = 0x3ff;

/// Transaction flags of a message UUID.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Flags(pub u16);

impl Flags {
    /// Not part of a transaction: committed as soon as it is read.
    pub const OUTSIDE_TXN: Flags = Flags(0x0);
    /// Begins or continues a transaction: committed by a later
    /// acknowledgement with a larger clock.
    pub const CONTINUE_TXN: Flags = Flags(0x1);
    /// Acknowledges (commits) the producer's continuing messages with a
    /// clock up to its own; an acknowledgement at the producer's last
    /// acknowledged clock rolls them back.
    pub const ACK_TXN: Flags = Flags(0x2);

    pub fn name(self) -> &'static str {
        match self {
            Flags::OUTSIDE_TXN => "OUTSIDE_TXN",
            Flags::CONTINUE_TXN => "CONTINUE_TXN",
            Flags::ACK_TXN => "ACK_TXN",
            _ => "OTHER",
        }
    }
}

/// The node part of a message UUID: who produced it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProducerId(pub [u8; 6]);

impl ProducerId {
    /// A random producer id, with the multicast bit set (RFC 4122: marks the
    /// node as not a real MAC address).
    pub fn random() -> ProducerId {
        let mut id = [0u8; 6];
        let filled = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut id));
        if filled.is_err() {
            // No urandom (not Linux?): the std hasher's per-process random
            // keys mixed with the time still make collisions unlikely.
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(
                rotary_proto::clock::wall()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            id.copy_from_slice(&h.finish().to_be_bytes()[..6]);
        }
        id[0] |= 0x01;
        ProducerId(id)
    }

    /// 12 lowercase hex digits.
    pub fn to_hex(self) -> String {
        hex::encode(self.0)
    }

    pub fn from_hex(text: &str) -> Result<ProducerId, MessageError> {
        let mut id = [0u8; 6];
        hex::decode_to_slice(text, &mut id).map_err(|_| MessageError::BadProducer {
            text: text.chars().take(40).collect(),
        })?;
        Ok(ProducerId(id))
    }
}

impl fmt::Debug for ProducerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ProducerId({})", self.to_hex())
    }
}

impl fmt::Display for ProducerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A producer's clock: 60-bit timestamp << 4 | 4-bit counter. Zero is
/// "no clock" (such messages are committed at once and never deduplicated).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Clock(pub u64);

impl Clock {
    /// The clock of a wall time given in nanoseconds since the Unix epoch,
    /// counter zero.
    pub fn from_unix_nanos(nanos: u64) -> Clock {
        Clock((nanos / 100 + G1582_NS100) << 4)
    }

    /// The wall clock now.
    pub fn wall() -> Clock {
        let nanos = rotary_proto::clock::wall()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Clock::from_unix_nanos(nanos)
    }

    /// Moves the clock to `now` if that is later; it never moves back.
    pub fn update(&mut self, now: Clock) {
        if now > *self {
            *self = now;
        }
    }

    /// Adds one (the counter; at 15 it carries into the timestamp) and
    /// returns the new clock.
    pub fn tick(&mut self) -> Clock {
        self.0 = self.0.checked_add(1).expect("clock beyond 2^64");
        *self
    }

    /// Nanoseconds since the Unix epoch of the clock's timestamp (0 before it).
    pub fn unix_nanos(self) -> u64 {
        (self.0 >> 4)
            .saturating_sub(G1582_NS100)
            .saturating_mul(100)
    }
}

/// The UUID's bytes as one big-endian integer.
fn v_of(u: &Uuid) -> u128 {
    u128::from_be_bytes(u.0)
}

/// A message UUID (16 bytes, RFC 4122 byte order).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Uuid(pub [u8; 16]);

impl Uuid {
    /// The UUID of a producer's message at `clock` with `flags`.
    ///
    /// # Panics
    ///
    /// If `flags` does not fit in 10 bits (a programmer error).
    pub fn build(producer: ProducerId, clock: Clock, flags: Flags) -> Uuid {
        assert!(flags.0 <= FLAGS_MAX, "flags {:#x} exceed 10 bits", flags.0);
        let c = clock.0;
        let mut u = [0u8; 16];
        u[0..4].copy_from_slice(&((c >> 4) as u32).to_be_bytes());
        u[4..6].copy_from_slice(&((c >> 36) as u16).to_be_bytes());
        u[6..8].copy_from_slice(&(((c >> 52) as u16 & 0x0fff) | 0x1000).to_be_bytes());
        let seq = ((c as u16) << 10) & 0x3c00 | flags.0 | 0x8000;
        u[8..10].copy_from_slice(&seq.to_be_bytes());
        u[10..16].copy_from_slice(&producer.0);
        Uuid(u)
    }

    // The accessors read the UUID as one big-endian u128: taken byte by
    // byte, the compiler splits the array into pieces, and every later
    // move of a value holding it (an envelope) copies it piecewise, with
    // loads stalled on the narrower stores before them.

    pub fn producer(&self) -> ProducerId {
        let v = v_of(self) as u64;
        let mut id = [0u8; 6];
        id.copy_from_slice(&v.to_be_bytes()[2..]);
        ProducerId(id)
    }

    pub fn clock(&self) -> Clock {
        let v = v_of(self);
        let time_low = (v >> 96) as u64 & 0xffff_ffff;
        let time_mid = (v >> 80) as u64 & 0xffff;
        let time_hi = (v >> 64) as u64 & 0x0fff;
        let counter = (v >> 58) as u64 & 0xf;
        Clock(time_low << 4 | time_mid << 36 | time_hi << 52 | counter)
    }

    pub fn flags(&self) -> Flags {
        Flags((v_of(self) >> 48) as u16 & FLAGS_MAX)
    }

    /// The version nibble (1 for UUIDs built here).
    pub fn version(&self) -> u8 {
        self.0[6] >> 4
    }

    /// Parses the canonical text form, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`
    /// (either case).
    pub fn parse(text: &str) -> Result<Uuid, MessageError> {
        let bad = || MessageError::BadUuid {
            text: text.chars().take(40).collect(),
        };
        let b = text.as_bytes();
        if b.len() != 36 || b[8] != b'-' || b[13] != b'-' || b[18] != b'-' || b[23] != b'-' {
            return Err(bad());
        }
        let mut u = [0u8; 16];
        let mut i = 0;
        let mut hexes = b.iter().filter(|&&c| c != b'-');
        while i < 16 {
            let (Some(&hi), Some(&lo)) = (hexes.next(), hexes.next()) else {
                return Err(bad());
            };
            let (Some(hi), Some(lo)) = (hex_value(hi), hex_value(lo)) else {
                return Err(bad());
            };
            u[i] = hi << 4 | lo;
            i += 1;
        }
        Ok(Uuid(u))
    }
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

impl fmt::Display for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = hex::encode(self.0);
        write!(
            f,
            "{}-{}-{}-{}-{}",
            &h[0..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..32]
        )
    }
}

impl fmt::Debug for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Uuid({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: ProducerId = ProducerId([0x01, 0x02, 0x03, 0x04, 0x05, 0x06]);

    #[test]
    fn layout_matches_gazette_bit_for_bit() {
        // Clock: timestamp 0x0123_4567_89ab_cde, counter 0xf.
        let clock = Clock(0x0123_4567_89ab_cdef);
        let u = Uuid::build(P, clock, Flags(682));
        // time_low = clock >> 4 (low 32 bits) = 0x789abcde.
        assert_eq!(&u.0[0..4], &[0x78, 0x9a, 0xbc, 0xde]);
        // time_mid = clock >> 36 (16 bits) = 0x3456.
        assert_eq!(&u.0[4..6], &[0x34, 0x56]);
        // version 1 | clock >> 52 (12 bits) = 0x1012.
        assert_eq!(&u.0[6..8], &[0x10, 0x12]);
        // variant 0b10 | counter 0xf << 10 | flags 682 (0x2aa) = 0xbeaa.
        assert_eq!(&u.0[8..10], &[0xbe, 0xaa]);
        assert_eq!(&u.0[10..16], &P.0);
        assert_eq!(u.to_string(), "789abcde-3456-1012-beaa-010203040506");
        assert_eq!(u.version(), 1);
        assert_eq!(u.clock(), clock);
        assert_eq!(u.flags(), Flags(682));
        assert_eq!(u.producer(), P);
    }

    #[test]
    fn flags_of_gazette() {
        assert_eq!(Flags::OUTSIDE_TXN.0, 0x0);
        assert_eq!(Flags::CONTINUE_TXN.0, 0x1);
        assert_eq!(Flags::ACK_TXN.0, 0x2);
    }

    #[test]
    fn counter_wrap_carries_into_timestamp() {
        let mut c = Clock::from_unix_nanos(1_700_000_000_000_000_000);
        assert_eq!(c.0 & 0xf, 0);
        let base = c.0 >> 4;
        for i in 1..=15u64 {
            let t = c.tick();
            assert_eq!(t.0 & 0xf, i);
            let u = Uuid::build(P, t, Flags::CONTINUE_TXN);
            assert_eq!(u.clock(), t);
            assert_eq!(u.flags(), Flags::CONTINUE_TXN);
        }
        // The 16th tick wraps the counter and carries into the timestamp.
        let t = c.tick();
        assert_eq!(t.0 & 0xf, 0);
        assert_eq!(t.0 >> 4, base + 1);
        let u = Uuid::build(P, t, Flags(682));
        assert_eq!((u.clock(), u.flags(), u.producer()), (t, Flags(682), P));
        // A wall time behind the clock does not move it back.
        c.update(Clock::from_unix_nanos(1_600_000_000_000_000_000));
        assert_eq!(c, t);
    }

    #[test]
    fn random_producers_are_multicast() {
        for _ in 0..16 {
            assert_eq!(ProducerId::random().0[0] & 0x01, 0x01);
        }
        assert_ne!(ProducerId::random(), ProducerId::random());
    }

    #[test]
    fn bad_text_is_refused() {
        for text in [
            "",
            "789abcde-3456-1012-beaa-01020304050",
            "789abcde-3456-1012-beaa-01020304050g",
            "789abcde+3456-1012-beaa-010203040506",
            "789abcde3456-1012-beaa-0102030405060",
        ] {
            assert!(Uuid::parse(text).is_err(), "{text}");
        }
        let u = Uuid::parse("789ABCDE-3456-1012-BEAA-010203040506").unwrap();
        assert_eq!(u.to_string(), "789abcde-3456-1012-beaa-010203040506");
    }

    proptest! {
        #[test]
        fn round_trip(p in any::<[u8; 6]>(), clock in 0u64..(1 << 63), flags in 0u16..=FLAGS_MAX) {
            let u = Uuid::build(ProducerId(p), Clock(clock), Flags(flags));
            prop_assert_eq!(u.producer(), ProducerId(p));
            prop_assert_eq!(u.clock(), Clock(clock));
            prop_assert_eq!(u.flags(), Flags(flags));
            prop_assert_eq!(u.version(), 1);
            prop_assert_eq!(u.0[8] & 0xc0, 0x80);
            prop_assert_eq!(Uuid::parse(&u.to_string()).unwrap(), u);
        }
    }
}
