//! Receives into a [`Part`] of the receiver's memory.
//!
//! A receive posted with a part ([`Mailbox::post_into`]) matches like any other. A
//! message it takes from the queue, or that a backend delivers whole, is copied into the
//! part. A backend that reads a large payload itself can do better: on the message's
//! header it asks for a [`Claim`] ([`Mailbox::claim`]), and reads the payload straight
//! into the claimed part, without a buffer and a copy. A claim is granted only for a
//! receive that names the message's source and waits for exactly its length, and only
//! if it is the receive the message would match anyway: the oldest posted receive that
//! matches (no queued message can match it, or it would have taken that). Matching
//! order is thus unchanged; the message is matched when its header arrives instead of
//! when its last byte does.

use super::{Envelope, Mailbox, Message, Pattern, Reply, SrcMatch, State};
use crate::error::TransportError;
use crate::ids::{Context, Rank, Tag};
use crate::landing::Part;
use bytes::Bytes;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::oneshot;

/// A message received into the part its receive was posted with.
#[derive(Debug)]
pub struct Landed {
    /// Sender.
    pub src: Rank,
    /// Context it was sent in.
    pub ctx: Context,
    /// Its tag.
    pub tag: Tag,
    /// The part, holding the payload.
    pub part: Part,
    /// Its number in the mailbox's order of arrival (see `Message::seq`), so that a
    /// receiver that gives it up gives it back in its place.
    seq: u64,
}

impl Landed {
    /// The message as an envelope (a copy of the payload), for a receiver that gave up
    /// on it and must not lose it.
    #[must_use]
    pub fn into_envelope(self) -> Envelope {
        self.into_message().env
    }

    /// The message as it was queued, numbered as it arrived.
    fn into_message(self) -> Message {
        let env = Envelope {
            src: self.src,
            ctx: self.ctx,
            tag: self.tag,
            payload: Bytes::copy_from_slice(self.part.as_slice()),
        };
        let mut msg = Message::whole(env);
        msg.seq = self.seq;
        msg
    }
}

/// Copies `msg`'s payload into `part`; an error if the sizes differ.
pub(super) fn land(msg: &Message, mut part: Part) -> Result<Landed, TransportError> {
    let env = &msg.env;
    if msg.len() != part.len() {
        return Err(TransportError::SizeMismatch { peer: env.src, expected: part.len() as u64, got: msg.len() as u64 });
    }
    msg.copy_to(part.as_mut_slice());
    Ok(Landed { src: env.src, ctx: env.ctx, tag: env.tag, part, seq: msg.seq })
}

/// The outcome of posting a receive into a part.
#[derive(Debug)]
pub enum PostingInto {
    /// A queued message matched at once (copied into the part, or refused for its size).
    Ready(Result<Landed, TransportError>),
    /// The receive is posted; cancel it with [`Mailbox::cancel`] and the id if the wait
    /// is abandoned.
    Posted(u64, oneshot::Receiver<Result<Landed, TransportError>>),
}

/// The receiver's end of a claim, shared by the claim and the mailbox's list of claims
/// in progress: whichever comes first answers the receive (the backend completing the
/// claim, the mailbox failing it when its source ends or the mailbox closes).
pub(super) struct ClaimReply(Mutex<Option<oneshot::Sender<Result<Landed, TransportError>>>>);

impl ClaimReply {
    fn take(&self) -> Option<oneshot::Sender<Result<Landed, TransportError>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

impl State {
    /// Fails the claims in progress from `src` (every claim if `None`).
    pub(super) fn fail_claims(&mut self, src: Option<Rank>, err: impl Fn() -> TransportError) {
        self.claims.retain(|(r, reply)| {
            let Some(reply) = reply.upgrade() else { return false };
            if src.is_some_and(|s| s != *r) {
                return true;
            }
            if let Some(tx) = reply.take() {
                let _ = tx.send(Err(err()));
            }
            false
        });
    }
}

/// A posted receive a backend reads one message's payload into; see the module docs.
/// Dropped without [`Mailbox::complete_claim`] (the connection broke mid-payload), it
/// fails its receive with [`TransportError::PeerLost`]; the receive also fails as soon
/// as the mailbox learns that the source ended, or closes, while the part stays with
/// the backend until it lets go of the claim.
pub struct Claim {
    src: Rank,
    ctx: Context,
    tag: Tag,
    part: Option<Part>,
    reply: Arc<ClaimReply>,
    /// Its number in the order of arrival: a claimed message arrives when it is claimed.
    seq: u64,
}

impl Claim {
    /// Where the payload goes (of the length the claim was granted for).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.part.as_mut().map_or(&mut [], Part::as_mut_slice)
    }

    /// The payload's length.
    #[must_use]
    pub fn len(&self) -> usize {
        self.part.as_ref().map_or(0, Part::len)
    }

    /// Whether the payload is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Claim(from {}, {}, {})", self.src, self.ctx, self.tag)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(tx) = self.reply.take() {
            let _ = tx.send(Err(TransportError::PeerLost(self.src)));
        }
    }
}

impl Mailbox {
    /// Takes the oldest matching queued message into `part`, or posts a receive into it.
    ///
    /// # Errors
    /// As [`Mailbox::post`].
    pub fn post_into(&self, pattern: Pattern, part: Part) -> Result<PostingInto, TransportError> {
        let mut st = self.lock();
        if let Some(msg) = st.take_queued(&pattern)? {
            drop(st);
            return Ok(PostingInto::Ready(land(&msg, part)));
        }
        let (tx, rx) = oneshot::channel();
        Ok(PostingInto::Posted(st.push(pattern, Reply::Into(part, tx)), rx))
    }

    /// For a backend that has read the header of a message of `len` bytes from `src`:
    /// the posted receive it matches, if that receive waits for exactly this message in
    /// a part (see the module docs); `None`, and the message is delivered as usual.
    pub fn claim(&self, src: Rank, ctx: Context, tag: Tag, len: u64) -> Option<Claim> {
        let mut st = self.lock();
        if st.is_fenced(src) {
            return None;
        }
        let i = st.posted.iter().position(|p| p.pattern.matches(src, ctx, tag))?;
        let p = &st.posted[i];
        let fits = |part: &Part, tx: &oneshot::Sender<_>| part.len() as u64 == len && !tx.is_closed();
        if p.pattern.src != SrcMatch::Rank(src) || !matches!(&p.reply, Reply::Into(part, tx) if fits(part, tx)) {
            return None;
        }
        match st.posted.remove(i).map(|p| p.reply) {
            Some(Reply::Into(part, tx)) => {
                let reply = Arc::new(ClaimReply(Mutex::new(Some(tx))));
                st.claims.retain(|(_, r)| r.strong_count() > 0);
                st.claims.push((src, Arc::downgrade(&reply)));
                let seq = st.arrival();
                Some(Claim { src, ctx, tag, part: Some(part), reply, seq })
            }
            // Checked just above.
            _ => None,
        }
    }

    /// Completes a claim whose part now holds the payload. If its receiver gave up
    /// meanwhile, the message is given back (copied) and keeps its place.
    pub fn complete_claim(&self, mut claim: Claim) {
        let (Some(part), Some(tx)) = (claim.part.take(), claim.reply.take()) else { return };
        let landed = Landed { src: claim.src, ctx: claim.ctx, tag: claim.tag, part, seq: claim.seq };
        if let Err(Ok(back)) = tx.send(Ok(landed)) {
            self.give_back_landed(back);
        }
    }

    /// Gives back a message that landed in a part whose receiver gave up on it (a
    /// copy), in its place in the order of arrival.
    pub fn give_back_landed(&self, landed: Landed) {
        self.give_back_message(landed.into_message());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::landing::Landing;
    use crate::matching::{PeerEnd, TagMatch};

    fn from(src: u32) -> Pattern {
        Pattern { ctx: Context(0), src: SrcMatch::Rank(Rank(src)), tag: TagMatch::Tag(Tag(1)) }
    }

    fn env(src: u32, body: &'static [u8]) -> Envelope {
        Envelope { src: Rank(src), ctx: Context(0), tag: Tag(1), payload: Bytes::from_static(body) }
    }

    fn posted(p: PostingInto) -> oneshot::Receiver<Result<Landed, TransportError>> {
        match p {
            PostingInto::Posted(_, rx) => rx,
            PostingInto::Ready(_) => panic!("nothing was queued"),
        }
    }

    #[test]
    fn queued_and_delivered_messages_are_copied_in() {
        let m = Mailbox::new();
        let l = Landing::new(vec![0; 2], 16).unwrap();
        m.deliver(env(1, b"abc"));
        let PostingInto::Ready(Ok(a)) = m.post_into(from(1), l.part(0..3).unwrap()).unwrap() else { panic!() };
        assert_eq!(a.part.as_slice(), b"abc");
        let mut rx = posted(m.post_into(from(1), l.part(3..5).unwrap()).unwrap());
        m.deliver(env(1, b"xyz"));
        let err = rx.try_recv().unwrap().unwrap_err();
        assert!(err.to_string().contains("3 bytes"), "{err}");
        let mut rx = posted(m.post_into(from(1), l.part(3..5).unwrap()).unwrap());
        m.deliver(env(1, b"ok"));
        assert_eq!(rx.try_recv().unwrap().unwrap().part.as_slice(), b"ok");
    }

    #[test]
    fn claims_keep_the_matching_order() {
        let m = Mailbox::new();
        let l = Landing::new(vec![0; 2], 16).unwrap();
        // The oldest matching receive is an ordinary one: no claim.
        let super::super::Posting::Posted(plain) = m.post(from(1)).unwrap() else { panic!() };
        let mut rx = posted(m.post_into(from(1), l.part(0..4).unwrap()).unwrap());
        assert!(m.claim(Rank(1), Context(0), Tag(1), 4).is_none());
        m.deliver(env(1, b"1st"));
        assert_eq!(super::super::tests::answer(&m, plain).unwrap().unwrap().payload, &b"1st"[..]);
        // Now it is the receive into the part, but only for its exact length and source.
        assert!(m.claim(Rank(1), Context(0), Tag(1), 5).is_none());
        assert!(m.claim(Rank(2), Context(0), Tag(1), 4).is_none());
        let mut c = m.claim(Rank(1), Context(0), Tag(1), 4).unwrap();
        assert!(m.claim(Rank(1), Context(0), Tag(1), 4).is_none(), "claimed once");
        c.bytes_mut().copy_from_slice(b"2nd!");
        m.complete_claim(c);
        assert_eq!(rx.try_recv().unwrap().unwrap().part.as_slice(), b"2nd!");
        // A wildcard receive is never claimed.
        let any = Pattern { src: SrcMatch::Any, ..from(1) };
        let _rx = posted(m.post_into(any, l.part(8..12).unwrap()).unwrap());
        assert!(m.claim(Rank(1), Context(0), Tag(1), 4).is_none());
    }

    #[test]
    fn a_claim_fails_at_once_when_its_source_ends_or_the_mailbox_closes() {
        let m = Mailbox::new();
        let l = Landing::new(vec![0; 2], 16).unwrap();
        let mut rx2 = posted(m.post_into(from(2), l.part(0..4).unwrap()).unwrap());
        let mut rx1 = posted(m.post_into(from(1), l.part(4..8).unwrap()).unwrap());
        let c2 = m.claim(Rank(2), Context(0), Tag(1), 4).unwrap();
        let mut c1 = m.claim(Rank(1), Context(0), Tag(1), 4).unwrap();
        m.peer_ended(Rank(1), PeerEnd::Lost);
        assert!(matches!(rx1.try_recv().unwrap(), Err(TransportError::PeerLost(Rank(1)))));
        assert!(rx2.try_recv().is_err(), "another source's claim is not failed");
        // The backend still holds the part; completing the failed claim changes nothing.
        c1.bytes_mut().copy_from_slice(b"late");
        m.complete_claim(c1);
        assert_eq!(m.queued(), 0);
        m.close();
        assert!(matches!(rx2.try_recv().unwrap(), Err(TransportError::Closed)));
        drop(c2);
    }

    #[test]
    fn a_claim_broken_or_abandoned_loses_nothing() {
        let m = Mailbox::new();
        let l = Landing::new(vec![0; 2], 16).unwrap();
        let mut rx = posted(m.post_into(from(1), l.part(0..4).unwrap()).unwrap());
        let c = m.claim(Rank(1), Context(0), Tag(1), 4).unwrap();
        drop(c);
        assert!(matches!(rx.try_recv().unwrap(), Err(TransportError::PeerLost(Rank(1)))));
        // The receiver gives up while the payload is being read: the message is queued.
        let rx = posted(m.post_into(from(1), l.part(0..4).unwrap()).unwrap());
        let mut c = m.claim(Rank(1), Context(0), Tag(1), 4).unwrap();
        drop(rx);
        c.bytes_mut().copy_from_slice(b"kept");
        m.complete_claim(c);
        assert_eq!(m.queued(), 1);
        let super::super::Posting::Ready(e) = m.post(from(1)).unwrap() else { panic!() };
        assert_eq!(e.payload, &b"kept"[..]);
    }

    #[test]
    fn landed_messages_given_back_keep_their_place_in_the_order_of_arrival() {
        let m = Mailbox::new();
        let l = Landing::new(vec![0; 4], 32).unwrap();
        let next = |m: &Mailbox| {
            let super::super::Posting::Ready(e) = m.post(from(1)).unwrap() else { panic!("nothing queued") };
            e.payload
        };
        // Landed from the queue, from a delivery and by a claim, each ahead of a later
        // message; given back in any order (at the front of the queue, the claim's and
        // then the oldest would come out first), they come out in the order they came.
        m.deliver(env(1, b"one"));
        let PostingInto::Ready(Ok(queued)) = m.post_into(from(1), l.part(0..3).unwrap()).unwrap() else { panic!() };
        let mut rx = posted(m.post_into(from(1), l.part(3..6).unwrap()).unwrap());
        m.deliver(env(1, b"two"));
        let delivered = rx.try_recv().unwrap().unwrap();
        let claimed_rx = posted(m.post_into(from(1), l.part(8..13).unwrap()).unwrap());
        let mut c = m.claim(Rank(1), Context(0), Tag(1), 5).unwrap();
        m.deliver(env(1, b"four"));
        drop(claimed_rx);
        c.bytes_mut().copy_from_slice(b"three");
        m.complete_claim(c);
        m.give_back_landed(queued);
        m.give_back_landed(delivered);
        for want in ["one", "two", "three", "four"] {
            assert_eq!(next(&m), want.as_bytes());
        }
    }
}
