//! Messages delivered in the pieces they arrived in.
//!
//! A backend whose progress thread reads every message of the process (quic: quinn
//! hands a stream over in datagram-sized chunks) would join a large payload's pieces
//! into one buffer there, a copy on the one thread all traffic goes through. It
//! delivers the pieces as they are instead ([`Mailbox::deliver_pieces`]). A receive of
//! bytes joins them, and a receive into memory the receiver lent
//! ([`Mailbox::post_here_into`]) copies them straight there, on the receiver's thread
//! and outside the mailbox's lock. A receive into a part ([`Mailbox::post_into`])
//! that the message finds waiting has them copied into the part where it is matched,
//! as a whole payload would be: under the lock, by the delivering thread. Matching is
//! unchanged: a message in pieces is matched as a whole one.

use super::{Envelope, Mailbox, Pattern};
use bytes::Bytes;

/// A message in the mailbox: its envelope, whose payload is the first of its pieces,
/// the pieces after it (none for a message delivered whole), and its place in the
/// order of arrival.
#[derive(Debug)]
pub(super) struct Message {
    pub(super) env: Envelope,
    rest: Vec<Bytes>,
    /// Its number in the order of arrival (from 1; the mailbox numbers it as it
    /// arrives), or 0 for a message given back from outside, whose number is lost.
    pub(super) seq: u64,
}

impl Message {
    /// A message delivered whole, not numbered yet.
    pub(super) fn whole(env: Envelope) -> Self {
        Self { env, rest: Vec::new(), seq: 0 }
    }

    /// Whether `pattern` matches the message.
    pub(super) fn matched_by(&self, pattern: &Pattern) -> bool {
        pattern.matches(self.env.src, self.env.ctx, self.env.tag)
    }

    /// The payload's length, over all pieces.
    pub(super) fn len(&self) -> usize {
        self.env.payload.len() + self.rest.iter().map(Bytes::len).sum::<usize>()
    }

    /// Whether the payload is in more than one piece.
    pub(super) fn in_pieces(&self) -> bool {
        !self.rest.is_empty()
    }

    /// The envelope, its payload in one buffer (the pieces copied into it, if any).
    pub(super) fn join(self) -> Envelope {
        if self.rest.is_empty() {
            return self.env;
        }
        let mut whole = Vec::with_capacity(self.len());
        whole.extend_from_slice(&self.env.payload);
        for piece in &self.rest {
            whole.extend_from_slice(piece);
        }
        Envelope { payload: Bytes::from(whole), ..self.env }
    }

    /// Copies the payload into `dest`, which is exactly as long.
    pub(super) fn copy_to(&self, dest: &mut [u8]) {
        debug_assert_eq!(dest.len(), self.len());
        let mut at = 0;
        for piece in std::iter::once(&self.env.payload).chain(&self.rest) {
            dest[at..at + piece.len()].copy_from_slice(piece);
            at += piece.len();
        }
    }

    /// The envelope with an empty payload: for a message copied into the receiver's
    /// memory.
    pub(super) fn landed(self) -> Envelope {
        Envelope { payload: Bytes::new(), ..self.env }
    }
}

impl Mailbox {
    /// Delivers an arriving message whose payload came in pieces: `env`'s payload is the
    /// first, `rest` the others, in order. The receiver joins them on its own thread,
    /// or copies them into memory it lent; see the module docs.
    pub fn deliver_pieces(&self, env: Envelope, rest: Vec<Bytes>) {
        self.deliver_message(Message { env, rest, seq: 0 });
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{env, pat};
    use super::super::{Posting, PostingInto};
    use super::*;
    use crate::error::TransportError;
    use crate::ids::{Rank, Tag};
    use crate::landing::Landing;
    use std::task::{Context as TaskContext, Poll, Waker};

    /// Delivers "abc" + "de" + "" + "fgh" from rank 1 with `tag`.
    fn deliver(m: &Mailbox, tag: u32) {
        let rest = vec![Bytes::from_static(b"de"), Bytes::new(), Bytes::from_static(b"fgh")];
        m.deliver_pieces(env(1, tag, b"abc"), rest);
    }

    #[test]
    fn pieces_are_joined_for_a_receive_of_bytes() {
        let m = Mailbox::new();
        deliver(&m, 1);
        let Posting::Ready(e) = m.post(pat(Some(1), Some(1))).unwrap() else { panic!("not queued") };
        assert_eq!(e.payload, &b"abcdefgh"[..]);
        // Posted first, then delivered: joined when the receiver collects it.
        let Posting::Posted(id) = m.post(pat(Some(1), Some(2))).unwrap() else { panic!("matched") };
        deliver(&m, 2);
        let mut cx = TaskContext::from_waker(Waker::noop());
        let Poll::Ready(Ok(e)) = m.poll_posted(id, &mut cx) else { panic!("no answer") };
        assert_eq!((e.src, e.tag, &e.payload[..]), (Rank(1), Tag(2), &b"abcdefgh"[..]));
    }

    #[test]
    fn pieces_land_in_lent_memory_of_their_length() {
        let m = Mailbox::new();
        let mut cx = TaskContext::from_waker(Waker::noop());
        // Queued before the receive.
        deliver(&m, 1);
        let mut dest = [0u8; 8];
        // SAFETY: the answer is not a wait; nothing is leaked.
        match unsafe { m.post_here_into(pat(Some(1), Some(1)), Waker::noop(), &mut dest) }.unwrap() {
            Ok((e, landed)) => assert!(landed && e.payload.is_empty() && e.tag == Tag(1)),
            Err(_) => panic!("not queued"),
        }
        assert_eq!(&dest, b"abcdefgh");
        // Delivered while the receive waits.
        let mut dest = [0u8; 8];
        // SAFETY: the wait is dropped below, not leaked.
        match unsafe { m.post_here_into(pat(Some(1), Some(2)), Waker::noop(), &mut dest) }.unwrap() {
            Ok(_) => panic!("matched at once"),
            Err(mut wait) => {
                assert!(wait.poll(&mut cx).is_pending());
                deliver(&m, 2);
                let Poll::Ready(Ok(e)) = wait.poll(&mut cx) else { panic!("no answer") };
                assert!(wait.landed() && e.payload.is_empty());
            }
        }
        assert_eq!(&dest, b"abcdefgh");
        // Delivered by another thread (a progress thread) while the receive waits.
        let mut dest = [0u8; 8];
        // SAFETY: as above.
        match unsafe { m.post_here_into(pat(Some(1), Some(4)), Waker::noop(), &mut dest) }.unwrap() {
            Ok(_) => panic!("matched at once"),
            Err(mut wait) => {
                std::thread::scope(|s| s.spawn(|| deliver(&m, 4)).join().unwrap());
                assert!(!wait.arrived());
                let Poll::Ready(Ok(e)) = wait.poll(&mut cx) else { panic!("no answer") };
                assert!(wait.landed() && e.payload.is_empty());
            }
        }
        assert_eq!(&dest, b"abcdefgh");
        // Memory of another length: refused, and the message stays for a receive of bytes.
        deliver(&m, 3);
        let mut short = [0u8; 4];
        // SAFETY: as for the first receive.
        let refused = unsafe { m.post_here_into(pat(Some(1), Some(3)), Waker::noop(), &mut short) };
        assert!(matches!(refused, Err(TransportError::SizeMismatch { expected: 4, got: 8, .. })));
        let Ok(Ok(e)) = m.post_here(pat(Some(1), Some(3)), Waker::noop()) else { panic!("not kept") };
        assert_eq!(&e.payload[..], b"abcdefgh");
    }

    #[test]
    fn pieces_are_copied_into_a_part() {
        let m = Mailbox::new();
        let l = Landing::new(vec![0; 2], 16).unwrap();
        deliver(&m, 1);
        let PostingInto::Ready(Ok(a)) = m.post_into(pat(Some(1), Some(1)), l.part(0..8).unwrap()).unwrap() else {
            panic!("not queued")
        };
        assert_eq!(a.part.as_slice(), b"abcdefgh");
        let PostingInto::Posted(_, mut rx) = m.post_into(pat(Some(1), Some(2)), l.part(8..16).unwrap()).unwrap() else {
            panic!("matched at once")
        };
        deliver(&m, 2);
        assert_eq!(rx.try_recv().unwrap().unwrap().part.as_slice(), b"abcdefgh");
    }

    #[test]
    fn an_abandoned_receive_gives_its_pieces_back_in_place() {
        let m = Mailbox::new();
        let Posting::Posted(id) = m.post(pat(Some(1), Some(1))).unwrap() else { panic!("matched") };
        deliver(&m, 1);
        m.deliver(env(1, 1, b"later"));
        m.abandon(id);
        let Posting::Ready(e) = m.post(pat(Some(1), Some(1))).unwrap() else { panic!("lost") };
        assert_eq!(e.payload, &b"abcdefgh"[..]);
        let Posting::Ready(e) = m.post(pat(Some(1), Some(1))).unwrap() else { panic!("lost") };
        assert_eq!(e.payload, &b"later"[..]);
        // A receive abandoned before its message came leaves nothing behind.
        let Posting::Posted(id) = m.post(pat(Some(1), Some(1))).unwrap() else { panic!("matched") };
        m.abandon(id);
        deliver(&m, 1);
        assert_eq!(m.queued(), 1);
    }

    #[test]
    fn an_abandoned_wait_gives_its_pieces_back_in_place() {
        let m = Mailbox::new();
        let mut cx = TaskContext::from_waker(Waker::noop());
        let Ok(Err(mut wait)) = m.post_here(pat(Some(1), Some(1)), Waker::noop()) else { panic!("matched") };
        assert!(wait.poll(&mut cx).is_pending());
        deliver(&m, 1);
        m.deliver(env(1, 1, b"later"));
        drop(wait);
        let Posting::Ready(e) = m.post(pat(Some(1), Some(1))).unwrap() else { panic!("lost") };
        assert_eq!(e.payload, &b"abcdefgh"[..]);
        let Posting::Ready(e) = m.post(pat(Some(1), Some(1))).unwrap() else { panic!("lost") };
        assert_eq!(e.payload, &b"later"[..]);
    }
}
