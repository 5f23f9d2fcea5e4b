//! The wire frame of stream transports.
//!
//! Every message on a stream connection is a fixed 24-byte header followed by the raw
//! payload. The header is fixed-size rather than a serde encoding so that it can be read
//! with one exact read and checked completely (magic, version, kind, source, length cap)
//! before a single byte is allocated for the payload; bulk data is never passed through
//! serde.
//!
//! | bytes  | field                          |
//! |--------|--------------------------------|
//! | 0..2   | magic `0xD7C7` (little endian) |
//! | 2      | version (1)                    |
//! | 3      | kind (see below)               |
//! | 4..8   | source rank                    |
//! | 8..12  | context                        |
//! | 12..16 | tag                            |
//! | 16..24 | payload length                 |
//!
//! Kinds: 1 data (a tagged message), 2 goodbye (no fields, nothing follows), and the
//! one-sided reads of [`crate::window`]: 3 get request (payload: window, offset,
//! length), 4 get reply (payload: the bytes), 5 get refusal (payload: the reason).
//! The three get kinds carry the request id in the context (high half) and tag (low
//! half) fields. Backends whose one-sided reads have streams of their own (quic) also
//! confirm delivery with them: 6 flush (a count of data frames sent) and 7 flushed (the
//! receiver has read that many), both with the count where a get has its id and no
//! payload.

use crate::error::FrameError;
use crate::ids::{Context, Rank, Tag};

/// Size of the fixed frame header in bytes.
pub const HEADER_LEN: usize = 24;
/// Frame magic.
pub const MAGIC: u16 = 0xD7C7;
/// Wire protocol version.
pub const VERSION: u8 = 1;

/// The kinds of frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// A tagged message with a payload.
    Data,
    /// The sender closes its endpoint; nothing follows.
    Bye,
    /// A get request.
    GetRequest,
    /// The bytes a get asked for.
    GetReply,
    /// A get refused by the window's owner.
    GetRefusal,
    /// Asks whether the receiver has read a count of data frames.
    Flush,
    /// It has.
    Flushed,
}

impl FrameKind {
    fn code(self) -> u8 {
        match self {
            Self::Data => 1,
            Self::Bye => 2,
            Self::GetRequest => 3,
            Self::GetReply => 4,
            Self::GetRefusal => 5,
            Self::Flush => 6,
            Self::Flushed => 7,
        }
    }

    fn from_code(c: u8) -> Result<Self, FrameError> {
        match c {
            1 => Ok(Self::Data),
            2 => Ok(Self::Bye),
            3 => Ok(Self::GetRequest),
            4 => Ok(Self::GetReply),
            5 => Ok(Self::GetRefusal),
            6 => Ok(Self::Flush),
            7 => Ok(Self::Flushed),
            other => Err(FrameError::UnknownKind(other)),
        }
    }
}

/// A decoded, validated frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Frame kind.
    pub kind: FrameKind,
    /// Sending rank.
    pub src: Rank,
    /// Communication context.
    pub ctx: Context,
    /// Message tag.
    pub tag: Tag,
    /// Payload length in bytes.
    pub len: u64,
}

/// What a receiver checks a header against.
#[derive(Clone, Copy, Debug)]
pub struct FrameLimits {
    /// Largest payload accepted.
    pub max_payload: u64,
    /// The rank authenticated on this connection.
    pub peer: Rank,
}

impl FrameHeader {
    /// A data frame header.
    #[must_use]
    pub fn data(src: Rank, ctx: Context, tag: Tag, len: u64) -> Self {
        Self { kind: FrameKind::Data, src, ctx, tag, len }
    }

    /// A goodbye frame header.
    #[must_use]
    pub fn bye(src: Rank) -> Self {
        Self { kind: FrameKind::Bye, src, ctx: Context(0), tag: Tag(0), len: 0 }
    }

    /// A header of one of the get kinds, carrying request `id`.
    #[must_use]
    pub fn get(kind: FrameKind, src: Rank, id: u64, len: u64) -> Self {
        // The id is split over the two 32-bit fields; the casts keep each half.
        #[allow(clippy::cast_possible_truncation)]
        let (hi, lo) = ((id >> 32) as u32, id as u32);
        Self { kind, src, ctx: Context(hi), tag: Tag(lo), len }
    }

    /// The request id of a get-kind header.
    #[must_use]
    pub fn request_id(&self) -> u64 {
        (u64::from(self.ctx.0) << 32) | u64::from(self.tag.0)
    }

    /// The header's wire bytes.
    #[must_use]
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = VERSION;
        b[3] = self.kind.code();
        b[4..8].copy_from_slice(&self.src.0.to_le_bytes());
        b[8..12].copy_from_slice(&self.ctx.0.to_le_bytes());
        b[12..16].copy_from_slice(&self.tag.0.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and validates a header.
    ///
    /// # Errors
    /// Any field that is not acceptable: see [`FrameError`].
    pub fn decode(b: &[u8; HEADER_LEN], limits: FrameLimits) -> Result<Self, FrameError> {
        let magic = u16::from_le_bytes([b[0], b[1]]);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if b[2] != VERSION {
            return Err(FrameError::BadVersion(b[2]));
        }
        let kind = FrameKind::from_code(b[3])?;
        let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let src = Rank(word(4));
        let ctx = Context(word(8));
        let tag = Tag(word(12));
        let mut len8 = [0u8; 8];
        len8.copy_from_slice(&b[16..24]);
        let len = u64::from_le_bytes(len8);
        if src != limits.peer {
            return Err(FrameError::WrongSource { claimed: src, peer: limits.peer });
        }
        if len > limits.max_payload {
            return Err(FrameError::TooLarge { len, cap: limits.max_payload });
        }
        if kind == FrameKind::Bye && (len != 0 || ctx.0 != 0 || tag.0 != 0) {
            return Err(FrameError::Malformed("goodbye frame with fields set"));
        }
        if kind == FrameKind::GetRequest && len != crate::window::REQUEST_LEN as u64 {
            return Err(FrameError::Malformed("get request of the wrong length"));
        }
        if kind == FrameKind::GetRefusal && len != crate::window::REFUSAL_LEN as u64 {
            return Err(FrameError::Malformed("get refusal of the wrong length"));
        }
        if matches!(kind, FrameKind::Flush | FrameKind::Flushed) && len != 0 {
            return Err(FrameError::Malformed("flush frame with a payload"));
        }
        Ok(Self { kind, src, ctx, tag, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn limits(peer: u32) -> FrameLimits {
        FrameLimits { max_payload: 1 << 20, peer: Rank(peer) }
    }

    #[test]
    fn round_trip() {
        let h = FrameHeader::data(Rank(3), Context(7), Tag(42), 1000);
        assert_eq!(FrameHeader::decode(&h.encode(), limits(3)), Ok(h));
        let b = FrameHeader::bye(Rank(3));
        assert_eq!(FrameHeader::decode(&b.encode(), limits(3)), Ok(b));
        let g = FrameHeader::get(FrameKind::GetReply, Rank(3), 0x1234_5678_9abc_def0, 77);
        assert_eq!(FrameHeader::decode(&g.encode(), limits(3)), Ok(g));
        assert_eq!(g.request_id(), 0x1234_5678_9abc_def0);
        let bad = FrameHeader::get(FrameKind::GetRequest, Rank(3), 1, 7);
        assert!(matches!(FrameHeader::decode(&bad.encode(), limits(3)), Err(FrameError::Malformed(_))));
        for kind in [FrameKind::Flush, FrameKind::Flushed] {
            let f = FrameHeader::get(kind, Rank(3), 1 << 40, 0);
            assert_eq!(FrameHeader::decode(&f.encode(), limits(3)), Ok(f));
            let bad = FrameHeader::get(kind, Rank(3), 1, 8);
            assert!(matches!(FrameHeader::decode(&bad.encode(), limits(3)), Err(FrameError::Malformed(_))));
        }
    }

    #[test]
    fn rejects_bad_fields() {
        let h = FrameHeader::data(Rank(3), Context(0), Tag(1), 10);
        let mut e = h.encode();
        e[0] = 0;
        assert!(matches!(FrameHeader::decode(&e, limits(3)), Err(FrameError::BadMagic(_))));
        let mut e = h.encode();
        e[2] = 9;
        assert_eq!(FrameHeader::decode(&e, limits(3)), Err(FrameError::BadVersion(9)));
        let mut e = h.encode();
        e[3] = 77;
        assert_eq!(FrameHeader::decode(&e, limits(3)), Err(FrameError::UnknownKind(77)));
        assert_eq!(
            FrameHeader::decode(&h.encode(), limits(4)),
            Err(FrameError::WrongSource { claimed: Rank(3), peer: Rank(4) })
        );
        let big = FrameHeader::data(Rank(3), Context(0), Tag(1), u64::MAX);
        assert_eq!(
            FrameHeader::decode(&big.encode(), limits(3)),
            Err(FrameError::TooLarge { len: u64::MAX, cap: 1 << 20 })
        );
        let mut bye = FrameHeader::bye(Rank(3)).encode();
        bye[16] = 1;
        assert!(matches!(FrameHeader::decode(&bye, limits(3)), Err(FrameError::Malformed(_))));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::array::uniform24(any::<u8>())) {
            let _ = FrameHeader::decode(&bytes, limits(1));
        }

        #[test]
        fn accepted_headers_round_trip(src in 0u32..8, ctx: u32, tag: u32, len in 0u64..=(1 << 20)) {
            let h = FrameHeader::data(Rank(src), Context(ctx), Tag(tag), len);
            prop_assert_eq!(FrameHeader::decode(&h.encode(), limits(src)), Ok(h));
        }
    }
}
