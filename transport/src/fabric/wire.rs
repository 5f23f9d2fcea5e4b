//! The backend's messages: the 64-bit libfabric tag and the bodies, encoded little
//! endian and decoded with every length checked (nothing a peer sends can panic).
//!
//! Tag: every message carries the one tag [`TAG`] (`0xD7C7` magic in bits 48..64,
//! version 1 in bits 40..48, zeros below) and receives match exactly it: matching
//! lives above the backend, so the tag only marks our traffic. Distinct tags matched
//! through an ignore mask would be natural, but libfabric 1.17's shm provider then
//! loses track of unexpected messages (a wildcard receive skips queued messages whose
//! tags differ, so they are never delivered); one exact tag avoids that. The body's
//! first byte is the [`Kind`]; every kind but the handshake's four then carries the
//! sender's 64-bit session token (see [`super::session`]).
//!
//! Ordered kinds (data, rendezvous, goodbye) start with a stream header: the sender's
//! random stream id for this destination and a sequence number from 0; the receiver
//! delivers each stream in sequence order whatever order completions come in.
//!
//! The one exception to the one tag: the payload of a [`Msg::Bulk`] announcement
//! travels as the provider's own tagged messages, one per chunk, each with a tag of its
//! own ([`bulk_tag`]) that the receiver posts an exact receive for. These tags differ
//! from [`TAG`] (so no receive slot takes them) and derive from the sender's secret
//! session token, so no other endpoint can guess them.

use crate::auth::{self, Nonce, HELLO_LEN};
use crate::ids::{Context, JobId, Rank, Tag};
use crate::window::{WindowId, REFUSAL_LEN};

/// The libfabric tag of every message of this protocol version.
pub(super) const TAG: u64 = 0xD7C7_0100_0000_0000;
/// The top bits of every bulk tag (`01`; [`TAG`]'s are `11`, so no bulk tag is it).
const BULK_PREFIX: u64 = 1 << 62;
/// The bits of a bulk tag below its prefix.
const BULK_HASH: u64 = (1 << 62) - 1;

/// The libfabric tag of chunk `chunk` of bulk payload `id` sent with session `token`:
/// the [`BULK_PREFIX`] over 62 bits of a hash of the three (splitmix64's finaliser, so
/// that neighbouring ids and chunks spread over all the bits). Receives match tags
/// from any source, so two bulk chunks posted at once at one receiver (from any
/// senders) must not share a tag: with 62 bits, a receiver with a thousand chunks
/// posted at any time meets a repeat about once in 5·10^15 chunks.
pub(super) fn bulk_tag(token: u64, id: u64, chunk: u64) -> u64 {
    let mut z = token ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ chunk.rotate_left(29);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    BULK_PREFIX | (z & BULK_HASH)
}

/// Most key bytes a region descriptor carries.
pub(super) const MAX_KEY: usize = 64;
/// Most bytes an encoded region takes (addresses, owner, key length and key).
pub(super) const MAX_REGION: usize = 8 + 8 + 4 + 8 + 1 + MAX_KEY;
/// Bytes before a data message's payload (kind, token, stream head, context, tag).
pub(super) const DATA_HEADER: usize = 33;

/// Message kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Hello = 1,
    Challenge = 2,
    Proof = 3,
    Accept = 4,
    Data = 5,
    Rts = 6,
    Bye = 7,
    Fin = 8,
    Query = 9,
    Desc = 10,
    Refusal = 11,
    Ping = 12,
    Pong = 13,
    Release = 14,
    Bulk = 15,
}

const KINDS: [Kind; 15] = [
    Kind::Hello,
    Kind::Challenge,
    Kind::Proof,
    Kind::Accept,
    Kind::Data,
    Kind::Rts,
    Kind::Bye,
    Kind::Fin,
    Kind::Query,
    Kind::Desc,
    Kind::Refusal,
    Kind::Ping,
    Kind::Pong,
    Kind::Release,
    Kind::Bulk,
];

impl Kind {
    fn of_code(code: u8) -> Option<Self> {
        KINDS.iter().copied().find(|k| *k as u8 == code)
    }

    /// Whether messages of this kind are part of a handshake (and carry no token).
    pub(super) fn is_handshake(self) -> bool {
        matches!(self, Self::Hello | Self::Challenge | Self::Proof | Self::Accept)
    }
}

/// Where a peer reads a registered region (see [`super::ofi::RemoteKey`]).
pub(super) use super::ofi::RemoteKey as Region;

/// The head of an ordered message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Head {
    pub(super) stream: u64,
    pub(super) seq: u64,
}

/// A decoded message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Msg {
    Hello {
        job: JobId,
        rank: Rank,
        nonce: Nonce,
        name: Vec<u8>,
    },
    Challenge {
        listener: Rank,
        dialer_nonce: Nonce,
        listener_nonce: Nonce,
        mac: [u8; 32],
    },
    Proof {
        dialer_nonce: Nonce,
        mac: [u8; 32],
    },
    Accept {
        dialer_nonce: Nonce,
    },
    /// An eager message; its payload follows the header in the same buffer.
    Data {
        head: Head,
        ctx: Context,
        tag: Tag,
    },
    Rts {
        head: Head,
        ctx: Context,
        tag: Tag,
        len: u64,
        id: u64,
        region: Region,
    },
    /// A rendezvous message whose payload follows as the provider's own tagged
    /// messages of at most `chunk` bytes each (see [`bulk_tag`]), which the receiver
    /// posts receives for; no `Fin` answers it.
    Bulk {
        head: Head,
        ctx: Context,
        tag: Tag,
        len: u64,
        id: u64,
        chunk: u64,
    },
    Bye {
        head: Head,
    },
    Fin {
        id: u64,
    },
    Query {
        req: u64,
        window: WindowId,
    },
    /// A window's descriptor, and a lease on it until the reader sends `Release`.
    Desc {
        req: u64,
        size: u64,
        region: Region,
    },
    /// The reader of a get is done with the lease of request `req`.
    Release {
        req: u64,
    },
    Refusal {
        req: u64,
        why: [u8; REFUSAL_LEN],
    },
    Ping,
    Pong,
}

impl Msg {
    /// The message's kind.
    pub(super) fn kind(&self) -> Kind {
        match self {
            Self::Hello { .. } => Kind::Hello,
            Self::Challenge { .. } => Kind::Challenge,
            Self::Proof { .. } => Kind::Proof,
            Self::Accept { .. } => Kind::Accept,
            Self::Data { .. } => Kind::Data,
            Self::Rts { .. } => Kind::Rts,
            Self::Bye { .. } => Kind::Bye,
            Self::Fin { .. } => Kind::Fin,
            Self::Query { .. } => Kind::Query,
            Self::Desc { .. } => Kind::Desc,
            Self::Refusal { .. } => Kind::Refusal,
            Self::Ping => Kind::Ping,
            Self::Pong => Kind::Pong,
            Self::Release { .. } => Kind::Release,
            Self::Bulk { .. } => Kind::Bulk,
        }
    }

    /// Encodes the body with the sender's session `token` (ignored for handshake
    /// kinds), followed by `payload` (data messages only).
    pub(super) fn encode(&self, token: u64, payload: &[u8]) -> Vec<u8> {
        let mut b = Vec::with_capacity(DATA_HEADER + payload.len() + 64);
        self.encode_into(token, payload, &mut b);
        b
    }

    /// [`Self::encode`] into `b`, which is cleared first.
    pub(super) fn encode_into(&self, token: u64, payload: &[u8], b: &mut Vec<u8>) {
        b.clear();
        if let Self::Data { head, ctx, tag } = self {
            // Every small message is one of these: its header in one piece, not seven
            // appends that each check the capacity (the same bytes as the general path).
            let mut h = [0u8; DATA_HEADER];
            h[0] = Kind::Data as u8;
            h[1..9].copy_from_slice(&token.to_le_bytes());
            h[9..17].copy_from_slice(&head.stream.to_le_bytes());
            h[17..25].copy_from_slice(&head.seq.to_le_bytes());
            h[25..29].copy_from_slice(&ctx.0.to_le_bytes());
            h[29..33].copy_from_slice(&tag.0.to_le_bytes());
            b.reserve(DATA_HEADER + payload.len());
            b.extend_from_slice(&h);
            b.extend_from_slice(payload);
            return;
        }
        b.push(self.kind() as u8);
        if !self.kind().is_handshake() {
            b.extend_from_slice(&token.to_le_bytes());
        }
        match self {
            Self::Hello { job, rank, nonce, name } => {
                b.extend_from_slice(&auth::encode_hello(*job, *rank, nonce));
                b.extend_from_slice(&(name.len() as u16).to_le_bytes());
                b.extend_from_slice(name);
            }
            Self::Challenge { listener, dialer_nonce, listener_nonce, mac } => {
                b.extend_from_slice(&listener.0.to_le_bytes());
                b.extend_from_slice(dialer_nonce);
                b.extend_from_slice(listener_nonce);
                b.extend_from_slice(mac);
            }
            Self::Proof { dialer_nonce, mac } => {
                b.extend_from_slice(dialer_nonce);
                b.extend_from_slice(mac);
            }
            Self::Accept { dialer_nonce } => b.extend_from_slice(dialer_nonce),
            // Encoded above.
            Self::Data { .. } => {}
            Self::Rts { head, ctx, tag, len, id, region } => {
                put_announcement(b, (*head, *ctx, *tag, *len, *id));
                put_region(b, region);
            }
            Self::Bulk { head, ctx, tag, len, id, chunk } => {
                put_announcement(b, (*head, *ctx, *tag, *len, *id));
                b.extend_from_slice(&chunk.to_le_bytes());
            }
            Self::Bye { head } => put_head(b, *head),
            Self::Fin { id: n } | Self::Release { req: n } => b.extend_from_slice(&n.to_le_bytes()),
            Self::Query { req, window } => {
                b.extend_from_slice(&req.to_le_bytes());
                b.extend_from_slice(&window.0.to_le_bytes());
            }
            Self::Desc { req, size, region } => {
                b.extend_from_slice(&req.to_le_bytes());
                b.extend_from_slice(&size.to_le_bytes());
                put_region(b, region);
            }
            Self::Refusal { req, why } => {
                b.extend_from_slice(&req.to_le_bytes());
                b.extend_from_slice(why);
            }
            Self::Ping | Self::Pong => {}
        }
    }

    /// Decodes a body: the token (0 for handshake kinds) and the message. For data,
    /// the payload is `b[DATA_HEADER..]`.
    pub(super) fn decode(b: &[u8]) -> Option<(u64, Self)> {
        let mut r = Reader(b);
        let kind = Kind::of_code(*r.take(1)?.first()?)?;
        let token = if kind.is_handshake() { 0 } else { r.u64()? };
        let msg = match kind {
            Kind::Hello => {
                let hello: &[u8; HELLO_LEN] = r.take(HELLO_LEN)?.try_into().ok()?;
                let (job, rank, nonce) = auth::decode_hello(hello).ok()?;
                let n = usize::from(r.u16()?);
                let name = r.take(n)?.to_vec();
                Self::Hello { job, rank, nonce, name }
            }
            Kind::Challenge => Self::Challenge {
                listener: Rank(r.u32()?),
                dialer_nonce: r.array()?,
                listener_nonce: r.array()?,
                mac: r.array()?,
            },
            Kind::Proof => Self::Proof { dialer_nonce: r.array()?, mac: r.array()? },
            Kind::Accept => Self::Accept { dialer_nonce: r.array()? },
            Kind::Data => {
                let m = Self::Data { head: r.head()?, ctx: Context(r.u32()?), tag: Tag(r.u32()?) };
                return Some((token, m));
            }
            Kind::Rts => {
                let (head, ctx, tag, len, id) = r.announcement()?;
                Self::Rts { head, ctx, tag, len, id, region: r.region()? }
            }
            Kind::Bulk => {
                let (head, ctx, tag, len, id) = r.announcement()?;
                Self::Bulk { head, ctx, tag, len, id, chunk: r.u64()? }
            }
            Kind::Bye => Self::Bye { head: r.head()? },
            Kind::Fin => Self::Fin { id: r.u64()? },
            Kind::Query => Self::Query { req: r.u64()?, window: WindowId(r.u32()?) },
            Kind::Desc => Self::Desc { req: r.u64()?, size: r.u64()?, region: r.region()? },
            Kind::Refusal => Self::Refusal { req: r.u64()?, why: r.array()? },
            Kind::Ping => Self::Ping,
            Kind::Pong => Self::Pong,
            Kind::Release => Self::Release { req: r.u64()? },
        };
        r.0.is_empty().then_some((token, msg))
    }
}

fn put_head(b: &mut Vec<u8>, h: Head) {
    b.extend_from_slice(&h.stream.to_le_bytes());
    b.extend_from_slice(&h.seq.to_le_bytes());
}

/// What a rendezvous or bulk announcement starts with: its place in the stream, the
/// message's context and tag, its length and the sender's payload id.
type Announcement = (Head, Context, Tag, u64, u64);

fn put_announcement(b: &mut Vec<u8>, (head, ctx, tag, len, id): Announcement) {
    put_head(b, head);
    b.extend_from_slice(&ctx.0.to_le_bytes());
    b.extend_from_slice(&tag.0.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b.extend_from_slice(&id.to_le_bytes());
}

/// Appends a region: its addresses, owner, then its key after the key's length.
pub(super) fn put_region(b: &mut Vec<u8>, r: &Region) {
    b.extend_from_slice(&r.addr.to_le_bytes());
    b.extend_from_slice(&r.raw_base.to_le_bytes());
    b.extend_from_slice(&r.owner.pid.to_le_bytes());
    b.extend_from_slice(&r.owner.ns.to_le_bytes());
    let n = r.key.len().min(MAX_KEY);
    b.push(n as u8);
    b.extend_from_slice(&r.key[..n]);
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(a)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }

    fn head(&mut self) -> Option<Head> {
        Some(Head { stream: self.u64()?, seq: self.u64()? })
    }

    fn announcement(&mut self) -> Option<Announcement> {
        Some((self.head()?, Context(self.u32()?), Tag(self.u32()?), self.u64()?, self.u64()?))
    }

    fn region(&mut self) -> Option<Region> {
        let addr = self.u64()?;
        let raw_base = self.u64()?;
        let owner = super::ofi::Owner { pid: self.u32()?, ns: self.u64()? };
        let n = usize::from(*self.take(1)?.first()?);
        if n > MAX_KEY {
            return None;
        }
        Some(Region { addr, raw_base, key: self.take(n)?.to_vec(), owner })
    }
}

/// Reads a region encoded by [`put_region`] at the start of `b` (bytes after it are
/// ignored); `None` if malformed.
pub(super) fn read_region(b: &[u8]) -> Option<Region> {
    Reader(b).region()
}

#[cfg(test)]
mod tests;
