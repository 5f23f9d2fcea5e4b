//! Receives waited for on the thread that delivers their message.
//!
//! A blocking receive polls the transport on its own thread (see the runtime's blocking
//! calls), so the message it waits for is usually delivered by that same thread, inside
//! its poll. Such a receive is posted with [`Mailbox::post_here`], and while its thread
//! waits, a delivery made on that thread hands the message over in a thread-local slot:
//! no answer kept under the mailbox's lock, no waker to wake, and no second pass through
//! the lock to collect it. A message delivered by any other thread (the progress thread,
//! another application thread) is kept and its waker woken, as for any posted receive;
//! so are failures (an ended peer, a closed mailbox).
//!
//! A receive into the caller's own memory ([`Mailbox::post_here_into`]) goes one step
//! further: a backend that delivers a payload it only lends
//! ([`Mailbox::deliver_slice`]) on the receiver's thread has it copied straight into
//! that memory when its length is the memory's, with no buffer made for it; a backend
//! that reads a large payload itself may read it straight there, on that thread
//! ([`Mailbox::land_here`]); and a payload delivered in pieces
//! ([`Mailbox::deliver_pieces`]), on any thread, is copied there by the receiver,
//! without joining the pieces first.
//!
//! Matching is unchanged: the receive is an ordinary posting, matched in its turn under
//! the lock. Only where its answer goes differs.

use super::{Envelope, Mailbox, Message};
use crate::error::TransportError;
use bytes::Bytes;
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::task::{Context as TaskContext, Poll, Waker};

/// A receive: its mailbox's address and its id there.
type Key = (usize, u64);

/// No receive (no mailbox is at address 0).
const NONE: Key = (0, 0);

/// The memory a receive of [`Mailbox::post_here_into`] lends: start and length (null
/// for none).
type Dest = (*mut u8, usize);

const NO_DEST: Dest = (std::ptr::null_mut(), 0);

thread_local! {
    /// The receive this thread waits for, and the memory it lends.
    static WAITING: Cell<(Key, Dest)> = const { Cell::new((NONE, NO_DEST)) };
    /// A message this thread handed over to the receive it waits for, with that
    /// receive.
    static ARRIVED: RefCell<Option<(Key, Message)>> = const { RefCell::new(None) };
    /// The head of a message whose payload this thread copied into the memory of the
    /// receive it waits for, with that receive ([`NONE`]: none). Kept apart from
    /// [`ARRIVED`] and as plain data, so that a small message's path (fabric's 8 bytes
    /// into a `recv_into`) neither builds nor moves a message: callgrind counted some
    /// 170 instructions more per message when it went through `ARRIVED` as a
    /// [`Message`].
    static LANDED: Cell<(Key, Head)> = const { Cell::new((NONE, NO_HEAD)) };
    /// The receive whose message is in [`ARRIVED`] or [`LANDED`] ([`NONE`]: none): what
    /// a spinning wait looks at every round, one load.
    static ANSWERED: Cell<Key> = const { Cell::new(NONE) };
}

/// A message's sender, context, tag and number in the order of arrival.
type Head = (crate::ids::Rank, crate::ids::Context, crate::ids::Tag, u64);

const NO_HEAD: Head = (crate::ids::Rank(0), crate::ids::Context(0), crate::ids::Tag(0), 0);

/// Takes `msg` for receive `id` of `mailbox` (posted by [`Mailbox::post_here`]) if the
/// calling thread is waiting for it; gives it back otherwise.
pub(super) fn hand_over(mailbox: &Mailbox, id: u64, msg: Message) -> Result<(), Message> {
    let key = (addr(mailbox), id);
    if WAITING.get().0 != key {
        return Err(msg);
    }
    ARRIVED.set(Some((key, msg)));
    ANSWERED.set(key);
    Ok(())
}

/// Copies `payload` into the memory of receive `id` of `mailbox` if the calling thread
/// waits for it, it lent memory, and the payload fills it exactly; true if it did (the
/// receive is then answered).
pub(super) fn land(mailbox: &Mailbox, id: u64, head: Head, payload: &[u8]) -> bool {
    let key = (addr(mailbox), id);
    let (waiting, (ptr, len)) = WAITING.get();
    if waiting != key || ptr.is_null() || len != payload.len() {
        return false;
    }
    // A payload read there already ([`Mailbox::land_here`]) is not copied onto itself.
    if payload.as_ptr() != ptr.cast_const() {
        // SAFETY: `ptr`/`len` are the memory lent by the `WaitHere` of receive `key`,
        // which is alive: it is this thread's current wait (a wait puts the outer one
        // back when it ends, and `post_here_into`'s caller promised not to leak it), and
        // it holds the memory's exclusive borrow for its whole life; nothing else on this
        // thread uses the memory meanwhile (the payload is elsewhere), and no other
        // thread sees this thread's `WAITING`.
        unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), ptr, len) };
    }
    LANDED.set((key, head));
    ANSWERED.set(key);
    true
}

/// The refusal of `msg` by a receive that lent memory `dest` of another length, if it
/// is one (a receive that lent none takes any length).
fn refused(msg: &Message, dest: Dest) -> Option<TransportError> {
    let (ptr, len) = dest;
    (!ptr.is_null() && msg.len() != len).then(|| TransportError::SizeMismatch {
        peer: msg.env.src,
        expected: len as u64,
        got: msg.len() as u64,
    })
}

/// The envelope to answer a receive with, and whether its payload was copied into the
/// receive's memory `dest`: a payload that came in pieces and is exactly as long is
/// (the envelope's payload is then empty); any other is joined if it must be.
///
/// # Safety
/// `dest`, unless null, is memory the receive lends and nothing else uses meanwhile.
unsafe fn answer(msg: Message, dest: Dest) -> (Envelope, bool) {
    let (ptr, len) = dest;
    if !msg.in_pieces() || ptr.is_null() || msg.len() != len {
        return (msg.join(), false);
    }
    // SAFETY: as the caller promised.
    msg.copy_to(unsafe { std::slice::from_raw_parts_mut(ptr, len) });
    (msg.landed(), true)
}

fn addr(mailbox: &Mailbox) -> usize {
    std::ptr::from_ref(mailbox) as usize
}

/// The message handed over to receive `key`, if there is one.
fn take_arrived(key: Key) -> Option<Message> {
    let msg = ARRIVED.with_borrow_mut(|a| match a.take() {
        Some((k, msg)) if k == key => Some(msg),
        // Only a wait leaked with `mem::forget` leaves another receive's message (its
        // receive is never collected); it is dropped.
        _ => None,
    });
    answered(key, msg.is_some());
    msg
}

/// The head of the message copied into the memory of receive `key`, if there is one.
fn take_landed(key: Key) -> Option<Head> {
    let (k, head) = LANDED.get();
    if k == NONE {
        return None;
    }
    // Another receive's is a leaked wait's, as in `take_arrived`: forgotten.
    LANDED.set((NONE, NO_HEAD));
    answered(key, k == key);
    (k == key).then_some(head)
}

/// Receive `key`'s message was taken (`taken`), or it had none here.
fn answered(key: Key, taken: bool) {
    if taken || ANSWERED.get() != key {
        ANSWERED.set(NONE);
    }
}

/// Whether receive `key` has its message on this thread, landed or handed over.
fn has_arrived(key: Key) -> bool {
    ANSWERED.get() == key
}

/// A receive posted by [`Mailbox::post_here`], which the calling thread waits for. It
/// stays on that thread (it is not `Send`): its message may be handed over in the
/// thread's own storage.
///
/// Dropping it unanswered withdraws the receive without losing a message: one that
/// arrived meanwhile goes back to the mailbox, ahead of later ones.
#[must_use = "dropping the receive withdraws it"]
pub struct WaitHere<'a> {
    mailbox: &'a Mailbox,
    id: u64,
    /// The memory lent ([`Mailbox::post_here_into`]), or none.
    dest: Dest,
    /// The receive an outer wait of this thread waits for (a blocking call nested in
    /// another's future) and its memory, restored when this one ends.
    outer: (Key, Dest),
    done: bool,
    /// Whether the message [`WaitHere::poll`] returned was copied into the memory.
    landed: bool,
    _here: PhantomData<(*const (), &'a mut [u8])>,
}

impl Mailbox {
    /// Takes the oldest matching queued message, or posts a receive that the calling
    /// thread waits for: a delivery on this thread hands it over at once (see
    /// [`WaitHere::arrived`]); one on another thread wakes `waker`.
    ///
    /// # Errors
    /// As [`Mailbox::post`].
    pub fn post_here(
        &self,
        pattern: super::Pattern,
        waker: &Waker,
    ) -> Result<Result<Envelope, WaitHere<'_>>, TransportError> {
        Ok(self.post_waiting(pattern, waker, NO_DEST)?.map(|(env, _)| env))
    }

    /// As [`Mailbox::post_here`], lending `dest`, for a message of exactly its length: a
    /// payload that this thread delivers with [`Mailbox::deliver_slice`], or that came
    /// in pieces ([`Mailbox::deliver_pieces`]), is copied into it (see
    /// [`WaitHere::landed`]; a queued message answers at once with whether it was); any
    /// other comes as an envelope.
    ///
    /// # Safety
    /// The returned wait must be dropped, not leaked (`mem::forget`): until then this
    /// thread may write into `dest`.
    ///
    /// # Errors
    /// As [`Mailbox::post`]; [`TransportError::SizeMismatch`] if the oldest matching
    /// message is of another length than `dest` (now, or from [`WaitHere::poll`] once
    /// it arrives). That message is not taken: it keeps its place in the order of
    /// arrival, for a receive that takes any length.
    pub unsafe fn post_here_into<'a>(
        &'a self,
        pattern: super::Pattern,
        waker: &Waker,
        dest: &'a mut [u8],
    ) -> Result<Result<(Envelope, bool), WaitHere<'a>>, TransportError> {
        self.post_waiting(pattern, waker, (dest.as_mut_ptr(), dest.len()))
    }

    /// Lets a backend read a large payload straight into the memory of the receive the
    /// calling thread waits for ([`Mailbox::post_here_into`]), within one call: if that
    /// receive lent exactly `len` bytes and is the one a message from `src` in `ctx`
    /// with `tag` would match now (the oldest posted receive it matches), `fill` gets
    /// the memory, and what it returns besides is returned. `fill` says whether it
    /// filled all of it with the payload: the message is then delivered as
    /// [`Mailbox::deliver_slice`] delivers it, so it is matched as it would have been
    /// as a buffer, and lands where it is if the receive still waits for it (else it is
    /// copied into a buffer of its own). If `fill` did not, nothing is delivered (it
    /// keeps what it read elsewhere, to go on with) and the receive waits on. `None`,
    /// without calling `fill`, if no such receive waits on this thread.
    ///
    /// The memory is lent only while the thread waits, so `fill` cannot keep it (it is
    /// borrowed for the call). A backend that reads a payload across calls uses a
    /// [`Mailbox::claim`] instead, granted to receives into a [`crate::landing::Part`].
    pub fn land_here<R>(
        &self,
        src: crate::ids::Rank,
        ctx: crate::ids::Context,
        tag: crate::ids::Tag,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> (bool, R),
    ) -> Option<R> {
        let ((mailbox, id), (ptr, lent)) = WAITING.get();
        if ptr.is_null() || lent != len || mailbox != addr(self) {
            return None;
        }
        {
            let st = self.lock();
            let first = st.posted.iter().find(|p| p.pattern.matches(src, ctx, tag))?;
            if st.is_fenced(src) || first.id != id || !matches!(first.reply, super::Reply::Here(..)) {
                return None;
            }
        }
        // While `fill` holds the memory, the wait lends none: nothing that `fill` may do
        // on this thread (a delivery, another landing) can reach it.
        struct Lent((Key, Dest));
        impl Drop for Lent {
            fn drop(&mut self) {
                WAITING.set(self.0);
            }
        }
        let lent = Lent(WAITING.replace(((mailbox, id), NO_DEST)));
        // SAFETY: the memory lent by this thread's current wait, as in `land`: alive
        // for this whole call, which the wait's thread makes while it waits, and used
        // by nothing else meanwhile (not lent while `fill` has it); `fill` borrows it for
        // its call only.
        let mem = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
        let (filled, out) = fill(mem);
        drop(lent);
        if filled {
            self.deliver_slice(src, ctx, tag, mem);
        }
        Some(out)
    }

    /// How many bytes the receive the calling thread waits for on this mailbox lends
    /// ([`Mailbox::post_here_into`]; 0 for none): one load of a thread-local, for every
    /// poll.
    #[must_use]
    pub fn lent_here(&self) -> usize {
        let ((mailbox, _), (ptr, len)) = WAITING.get();
        if ptr.is_null() || mailbox != addr(self) {
            0
        } else {
            len
        }
    }

    /// Whether the receive the calling thread waits for on this mailbox has its message
    /// already, handed over on this thread (the thread polls in vain from here on: a
    /// backend may stop reading, and leave the next message where it is until a receive
    /// is posted for it, which can take it in place with [`Mailbox::land_here`]).
    #[must_use]
    pub fn answered_here(&self) -> bool {
        let (key, _) = WAITING.get();
        key.0 == addr(self) && has_arrived(key)
    }

    fn post_waiting(
        &self,
        pattern: super::Pattern,
        waker: &Waker,
        dest: Dest,
    ) -> Result<Result<(Envelope, bool), WaitHere<'_>>, TransportError> {
        let id = {
            let mut st = self.lock();
            if let Some(msg) = st.take_queued(&pattern)? {
                if let Some(refusal) = refused(&msg, dest) {
                    self.put_back(st, msg);
                    return Err(refusal);
                }
                drop(st);
                // SAFETY: `dest` is the memory `post_here_into`'s caller lent, borrowed
                // until it has the answer.
                return Ok(Ok(unsafe { answer(msg, dest) }));
            }
            let lent = (!dest.0.is_null()).then_some(dest.1);
            st.push(pattern, super::Reply::Here(waker.clone(), lent))
        };
        let outer = WAITING.replace(((addr(self), id), dest));
        Ok(Err(WaitHere { mailbox: self, id, dest, outer, done: false, landed: false, _here: PhantomData }))
    }
}

impl WaitHere<'_> {
    /// Whether this thread delivered the message (checked without the mailbox's lock).
    #[must_use]
    pub fn arrived(&self) -> bool {
        has_arrived(self.key())
    }

    /// Whether the message the last [`WaitHere::poll`] returned was copied into the
    /// memory the receive lent (its envelope's payload is then empty).
    #[must_use]
    pub fn landed(&self) -> bool {
        self.landed
    }

    fn key(&self) -> Key {
        (addr(self.mailbox), self.id)
    }

    /// The message or the receive's error once there; until then, `cx`'s waker is woken
    /// when another thread answers. Once it returned ready, the receive is over. A
    /// message of another length than the memory lent was refused where it was matched
    /// ([`TransportError::SizeMismatch`]): it went on, in its place, to the next
    /// receive that matches it or to the queue.
    pub fn poll(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<Envelope, TransportError>> {
        if self.done {
            return Poll::Ready(Err(TransportError::Closed));
        }
        let key = self.key();
        if let Some((src, ctx, tag, _)) = take_landed(key) {
            self.done = true;
            self.landed = true;
            return Poll::Ready(Ok(Envelope { src, ctx, tag, payload: Bytes::new() }));
        }
        let msg = match take_arrived(key) {
            Some(msg) => msg,
            None => match self.mailbox.poll_kept(self.id, cx) {
                Poll::Ready(Ok(msg)) => msg,
                Poll::Ready(Err(e)) => {
                    self.done = true;
                    return Poll::Ready(Err(e));
                }
                Poll::Pending => return Poll::Pending,
            },
        };
        self.done = true;
        // A message of another length was refused where it was matched.
        debug_assert!(refused(&msg, self.dest).is_none());
        // SAFETY: the memory this wait lent (if any), still borrowed by it.
        let (env, landed) = unsafe { answer(msg, self.dest) };
        self.landed = landed;
        Poll::Ready(Ok(env))
    }
}

impl Drop for WaitHere<'_> {
    fn drop(&mut self) {
        WAITING.set(self.outer);
        if self.done {
            return;
        }
        let key = self.key();
        if let Some((src, ctx, tag, seq)) = take_landed(key) {
            // SAFETY: the memory this wait lent, still borrowed by it; the landing
            // filled all of it.
            let payload = Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(self.dest.0, self.dest.1) });
            let mut msg = Message::whole(Envelope { src, ctx, tag, payload });
            msg.seq = seq;
            self.mailbox.give_back_message(msg);
            return;
        }
        match take_arrived(key) {
            Some(msg) => self.mailbox.give_back_message(msg),
            None => self.mailbox.abandon(self.id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{answer, env, pat, posted};
    use super::*;
    use crate::ids::{Context, Rank, Tag};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    struct Count(AtomicUsize);
    impl std::task::Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counter() -> (Arc<Count>, Waker) {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        (c.clone(), Waker::from(c))
    }

    fn noop() -> TaskContext<'static> {
        TaskContext::from_waker(Waker::noop())
    }

    #[test]
    fn a_delivery_on_the_waiting_thread_is_handed_over_without_a_wake() {
        let m = Mailbox::new();
        let (count, waker) = counter();
        let Ok(Err(mut w)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected a posted receive") };
        assert!(!w.arrived() && w.poll(&mut noop()).is_pending());
        m.deliver(env(1, 1, b"here"));
        assert!(w.arrived());
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        let Poll::Ready(Ok(e)) = w.poll(&mut noop()) else { panic!("expected the message") };
        assert_eq!(e.payload, &b"here"[..]);
        assert!(!w.arrived() && m.lock().kept.is_empty() && m.lock().posted.is_empty());
    }

    #[test]
    fn an_older_matching_receive_is_served_first() {
        let m = Mailbox::new();
        let (_, waker) = counter();
        let older = posted(m.post(pat(Some(1), Some(4))).unwrap());
        let Ok(Err(mut w)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected a posted receive") };
        m.deliver(env(1, 4, b"first"));
        assert!(!w.arrived());
        m.deliver(env(1, 4, b"second"));
        assert_eq!(answer(&m, older).unwrap().unwrap().payload, &b"first"[..]);
        let Poll::Ready(Ok(e)) = w.poll(&mut noop()) else { panic!("expected the message") };
        assert_eq!(e.payload, &b"second"[..]);
    }

    #[test]
    fn a_delivery_on_another_thread_is_kept_and_wakes() {
        let m = Arc::new(Mailbox::new());
        let (count, waker) = counter();
        let Ok(Err(mut w)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected a posted receive") };
        let other = m.clone();
        std::thread::spawn(move || other.deliver(env(1, 1, b"there"))).join().unwrap();
        assert!(!w.arrived());
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        let Poll::Ready(Ok(e)) = w.poll(&mut noop()) else { panic!("expected the message") };
        assert_eq!(e.payload, &b"there"[..]);
    }

    #[test]
    fn queued_messages_and_failures_come_as_for_any_receive() {
        let m = Mailbox::new();
        m.deliver(env(1, 1, b"queued"));
        let (count, waker) = counter();
        let Ok(Ok(e)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected the queued message") };
        assert_eq!(e.payload, &b"queued"[..]);
        let Ok(Err(mut w)) = m.post_here(pat(Some(2), None), &waker) else { panic!("expected a posted receive") };
        m.peer_ended(crate::ids::Rank(2), super::super::PeerEnd::Lost);
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(matches!(w.poll(&mut noop()), Poll::Ready(Err(TransportError::PeerLost(_)))));
    }

    #[test]
    fn a_withdrawn_wait_gives_its_message_back_in_order() {
        let m = Mailbox::new();
        let (_, waker) = counter();
        // Delivered here, never collected.
        let Ok(Err(w)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected a posted receive") };
        m.deliver(env(1, 1, b"first"));
        m.deliver(env(1, 1, b"second"));
        drop(w);
        // Not waiting any more: a delivery is queued, not handed over.
        m.deliver(env(1, 1, b"third"));
        for want in [&b"first"[..], b"second", b"third"] {
            let Ok(Ok(e)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected a queued message") };
            assert_eq!(e.payload, want);
        }
        // Waiting, then given up with nothing arrived: the receive is gone.
        let Ok(Err(w)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected a posted receive") };
        drop(w);
        m.deliver(env(1, 1, b"later"));
        assert_eq!(m.queued(), 1);
    }

    #[test]
    fn a_leaked_wait_hands_nothing_to_the_next_one() {
        let m = Mailbox::new();
        let (_, waker) = counter();
        let Ok(Err(w)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected a posted receive") };
        std::mem::forget(w);
        m.deliver(env(1, 1, b"never collected"));
        let Ok(Err(mut next)) = m.post_here(pat(Some(2), None), &waker) else { panic!("expected a posted receive") };
        assert!(!next.arrived() && next.poll(&mut noop()).is_pending());
        m.deliver(env(2, 1, b"mine"));
        let Poll::Ready(Ok(e)) = next.poll(&mut noop()) else { panic!("expected the message") };
        assert_eq!(e.payload, &b"mine"[..]);
        drop(next);
        // The same with payloads that land in the receives' memory.
        let (mut lost, mut mine) = ([0u8; 4], [0u8; 4]);
        // SAFETY: `lost` outlives the leaked wait's every use (none after the forget).
        let Ok(Err(w)) = (unsafe { m.post_here_into(pat(Some(3), None), &waker, &mut lost) }) else {
            panic!("expected a posted receive")
        };
        deliver_slice(&m, 3, 1, b"lost");
        assert!(w.arrived());
        std::mem::forget(w);
        // SAFETY: `next` is dropped before `mine` is read.
        let Ok(Err(mut next)) = (unsafe { m.post_here_into(pat(Some(4), None), &waker, &mut mine) }) else {
            panic!("expected a posted receive")
        };
        assert!(!next.arrived() && next.poll(&mut noop()).is_pending() && !next.arrived());
        deliver_slice(&m, 4, 1, b"mine");
        assert!(next.arrived());
        let Poll::Ready(Ok(e)) = next.poll(&mut noop()) else { panic!("expected the message") };
        assert!(next.landed() && e.payload.is_empty() && e.src == Rank(4) && !next.arrived());
        drop(next);
        assert_eq!(&mine, b"mine");
    }

    #[test]
    fn a_nested_wait_restores_the_outer_one() {
        let m = Mailbox::new();
        let (_, waker) = counter();
        let Ok(Err(mut outer)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected a posted receive") };
        {
            let Ok(Err(mut inner)) = m.post_here(pat(Some(2), None), &waker) else {
                panic!("expected a posted receive")
            };
            // The outer receive's message, delivered while the inner one waits, is kept.
            m.deliver(env(1, 1, b"outer"));
            assert!(!inner.arrived());
            m.deliver(env(2, 1, b"inner"));
            let Poll::Ready(Ok(e)) = inner.poll(&mut noop()) else { panic!("expected the message") };
            assert_eq!(e.payload, &b"inner"[..]);
        }
        let Poll::Ready(Ok(e)) = outer.poll(&mut noop()) else { panic!("expected the message") };
        assert_eq!(e.payload, &b"outer"[..]);
        // A plain posting is never handed over.
        let id = posted(m.post(pat(Some(3), None)).unwrap());
        m.deliver(env(3, 1, b"plain"));
        assert_eq!(answer(&m, id).unwrap().unwrap().payload, &b"plain"[..]);
    }

    #[test]
    fn a_message_of_another_length_than_the_lent_memory_keeps_its_place() {
        let m = Mailbox::new();
        let (count, waker) = counter();
        let mut buf = [0u8; 4];
        let next = |m: &Mailbox| {
            let Ok(Ok(e)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected a queued message") };
            e.payload
        };
        // Queued: refused at once, and left behind the older message of another tag.
        m.deliver(env(1, 6, b"older"));
        m.deliver(env(1, 5, b"too long"));
        // SAFETY: the answer is not a wait; nothing is leaked.
        let refused = unsafe { m.post_here_into(pat(Some(1), Some(5)), &waker, &mut buf) };
        assert!(matches!(refused, Err(TransportError::SizeMismatch { expected: 4, got: 8, .. })));
        drop(refused);
        assert_eq!((next(&m), next(&m)), (Bytes::from_static(b"older"), Bytes::from_static(b"too long")));
        // Delivered while the receive waits, on its thread or another: refused where it
        // is matched (the receive is woken to learn it), and queued behind the older
        // message, or taken by the next receive that matches it.
        for (here, then_posted) in [(true, false), (false, false), (true, true)] {
            let woken = count.0.load(Ordering::SeqCst);
            // SAFETY: `w` is dropped before `buf` is used again.
            let Ok(Err(mut w)) = (unsafe { m.post_here_into(pat(Some(1), Some(5)), &waker, &mut buf) }) else {
                panic!("expected a posted receive")
            };
            let later = then_posted.then(|| posted(m.post(pat(Some(1), Some(5))).unwrap()));
            m.deliver(env(1, 6, b"older"));
            if here {
                m.deliver(env(1, 5, b"too long"));
            } else {
                std::thread::scope(|s| s.spawn(|| m.deliver(env(1, 5, b"too long"))).join().unwrap());
            }
            assert!(!w.arrived());
            assert_eq!(count.0.load(Ordering::SeqCst), woken + 1);
            let Poll::Ready(Err(TransportError::SizeMismatch { got: 8, .. })) = w.poll(&mut noop()) else {
                panic!("expected a refusal")
            };
            drop(w);
            match later {
                Some(id) => {
                    assert_eq!(answer(&m, id).unwrap().unwrap().payload, &b"too long"[..]);
                    assert_eq!(next(&m), Bytes::from_static(b"older"));
                }
                None => {
                    assert_eq!((next(&m), next(&m)), (Bytes::from_static(b"older"), Bytes::from_static(b"too long")))
                }
            }
        }
        assert_eq!(m.queued(), 0);
    }

    fn deliver_slice(m: &Mailbox, src: u32, tag: u32, body: &[u8]) {
        m.deliver_slice(crate::ids::Rank(src), crate::ids::Context(0), crate::ids::Tag(tag), body);
    }

    #[test]
    fn a_lent_payload_of_the_right_length_lands_in_the_receivers_memory() {
        let m = Mailbox::new();
        let (count, waker) = counter();
        let mut buf = [0u8; 4];
        // SAFETY: `w` is dropped before `buf` is read.
        let Ok(Err(mut w)) = (unsafe { m.post_here_into(pat(Some(1), None), &waker, &mut buf) }) else {
            panic!("expected a posted receive")
        };
        deliver_slice(&m, 1, 7, b"land");
        assert!(w.arrived());
        let Poll::Ready(Ok(e)) = w.poll(&mut noop()) else { panic!("expected the message") };
        assert!(w.landed() && e.payload.is_empty());
        assert_eq!((e.src, e.tag), (crate::ids::Rank(1), crate::ids::Tag(7)));
        drop(w);
        assert_eq!(&buf, b"land");
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        assert!(m.lock().kept.is_empty() && m.lock().posted.is_empty() && m.queued() == 0);
    }

    #[test]
    fn a_lent_payload_of_another_length_is_refused_and_one_from_elsewhere_comes_as_bytes() {
        let m = Arc::new(Mailbox::new());
        let (count, waker) = counter();
        let mut buf = [0u8; 4];
        // SAFETY: every wait below is dropped before `buf` is read.
        let Ok(Err(mut w)) = (unsafe { m.post_here_into(pat(Some(1), None), &waker, &mut buf) }) else {
            panic!("expected a posted receive")
        };
        deliver_slice(&m, 1, 1, b"longer");
        // Refused where it was matched: the receive is woken to learn it.
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        let Poll::Ready(Err(TransportError::SizeMismatch { got: 6, .. })) = w.poll(&mut noop()) else {
            panic!("expected a refusal")
        };
        drop(w);
        let Ok(Ok(e)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected the refused message") };
        assert_eq!(e.payload, &b"longer"[..]);
        // SAFETY: as above.
        let Ok(Err(mut w)) = (unsafe { m.post_here_into(pat(Some(1), None), &waker, &mut buf) }) else {
            panic!("expected a posted receive")
        };
        let other = m.clone();
        std::thread::spawn(move || deliver_slice(&other, 1, 1, b"away")).join().unwrap();
        assert!(!w.arrived());
        assert_eq!(count.0.load(Ordering::SeqCst), 2);
        let Poll::Ready(Ok(e)) = w.poll(&mut noop()) else { panic!("expected the message") };
        assert!(!w.landed());
        assert_eq!(e.payload, &b"away"[..]);
        drop(w);
        assert_eq!(buf, [0; 4], "nothing was written into the memory");
        // With no receive posted, a lent payload is queued as a copy.
        deliver_slice(&m, 1, 1, b"late");
        let Ok(Ok(e)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected the queued message") };
        assert_eq!(e.payload, &b"late"[..]);
    }

    #[test]
    fn a_lent_payload_goes_to_an_older_receive_first_and_a_withdrawn_one_is_given_back() {
        let m = Mailbox::new();
        let (_, waker) = counter();
        let older = posted(m.post(pat(Some(1), Some(4))).unwrap());
        let mut buf = [0u8; 5];
        // SAFETY: `w` is dropped before `buf` is read.
        let Ok(Err(w)) = (unsafe { m.post_here_into(pat(Some(1), None), &waker, &mut buf) }) else {
            panic!("expected a posted receive")
        };
        deliver_slice(&m, 1, 4, b"first");
        assert!(!w.arrived());
        deliver_slice(&m, 1, 4, b"secnd");
        assert!(w.arrived());
        deliver_slice(&m, 1, 4, b"third");
        assert_eq!(answer(&m, older).unwrap().unwrap().payload, &b"first"[..]);
        // Landed but never collected: the wait gives the message back, ahead of later ones.
        drop(w);
        for want in [&b"secnd"[..], b"third"] {
            let Ok(Ok(e)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected a queued message") };
            assert_eq!(e.payload, want);
        }
    }

    /// Fills `mem` with `body` for [`Mailbox::land_here`]: complete.
    fn fill<'b>(body: &'b [u8]) -> impl FnOnce(&mut [u8]) -> (bool, ()) + 'b {
        move |mem: &mut [u8]| {
            mem.copy_from_slice(body);
            (true, ())
        }
    }

    #[test]
    fn a_payload_lands_in_the_waiting_receives_memory_only_when_that_receive_takes_it() {
        let m = Mailbox::new();
        let (count, waker) = counter();
        let head = (Rank(1), Context(0), Tag(5));
        let land = |m: &Mailbox, body: &'static [u8]| m.land_here(head.0, head.1, head.2, body.len(), fill(body));
        // No receive waits on this thread: nothing is lent.
        assert!(land(&m, b"none").is_none());
        let mut buf = [0u8; 4];
        {
            // SAFETY: `w` is dropped before `buf` is used again.
            let Ok(Err(mut w)) = (unsafe { m.post_here_into(pat(Some(1), Some(5)), &waker, &mut buf) }) else {
                panic!("expected a posted receive")
            };
            // Another length, another tag or source, or another thread: not this receive's.
            assert!(land(&m, b"other").is_none());
            assert!(m.land_here(Rank(1), Context(0), Tag(6), 4, fill(b"tag!")).is_none());
            assert!(m.land_here(Rank(2), Context(0), Tag(5), 4, fill(b"src!")).is_none());
            std::thread::scope(|s| s.spawn(|| assert!(land(&m, b"away").is_none())).join().unwrap());
            assert!(!w.arrived() && !m.answered_here());
            // A fill that stops short delivers nothing; the receive waits on.
            let short = m.land_here(head.0, head.1, head.2, 4, |mem| {
                mem[..2].copy_from_slice(b"ha");
                (false, 2)
            });
            assert_eq!(short, Some(2));
            assert!(!w.arrived() && w.poll(&mut noop()).is_pending());
            // A whole one is this receive's answer, where it already is.
            assert_eq!(land(&m, b"here"), Some(()));
            assert!(w.arrived() && m.answered_here());
            let Poll::Ready(Ok(e)) = w.poll(&mut noop()) else { panic!("expected the message") };
            assert!(w.landed() && e.payload.is_empty());
        }
        assert_eq!(&buf, b"here");
        assert!(!m.answered_here() && m.lock().posted.is_empty() && m.queued() == 0);
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn an_older_receive_or_a_fenced_source_is_not_lent_the_memory() {
        let m = Mailbox::new();
        let (_, waker) = counter();
        let older = posted(m.post(pat(Some(1), None)).unwrap());
        let mut buf = [0u8; 4];
        {
            // SAFETY: `w` is dropped before `buf` is used again.
            let Ok(Err(mut w)) = (unsafe { m.post_here_into(pat(Some(1), Some(5)), &waker, &mut buf) }) else {
                panic!("expected a posted receive")
            };
            // The older receive matches first: the message goes there, as a buffer.
            assert!(m.land_here(Rank(1), Context(0), Tag(5), 4, fill(b"old!")).is_none());
            m.deliver(env(1, 5, b"old!"));
            assert_eq!(answer(&m, older).unwrap().unwrap().payload, &b"old!"[..]);
            // Now it is this receive's turn.
            assert_eq!(m.land_here(Rank(1), Context(0), Tag(5), 4, fill(b"new!")), Some(()));
            let Poll::Ready(Ok(_)) = w.poll(&mut noop()) else { panic!("expected the message") };
            assert!(w.landed());
        }
        assert_eq!(&buf, b"new!");
        // (From any source: a fence fails the receives that name the rank.)
        // SAFETY: `_w` is dropped before `buf` is used again.
        let Ok(Err(_w)) = (unsafe { m.post_here_into(pat(None, Some(5)), &waker, &mut buf) }) else {
            panic!("expected a posted receive")
        };
        m.fence(&[Rank(1)]);
        assert!(m.land_here(Rank(2), Context(0), Tag(5), 4, |_| (false, ())).is_some());
        assert!(m.land_here(Rank(1), Context(0), Tag(5), 4, fill(b"gone")).is_none());
    }

    #[test]
    fn a_payload_read_in_place_for_a_receive_answered_meanwhile_is_kept_whole() {
        let m = Mailbox::new();
        let (_, waker) = counter();
        let mut buf = [0u8; 4];
        {
            // SAFETY: `w` is dropped before `buf` is used again.
            let Ok(Err(mut w)) = (unsafe { m.post_here_into(pat(Some(1), None), &waker, &mut buf) }) else {
                panic!("expected a posted receive")
            };
            // While the payload comes in, other messages from the source (on another
            // connection, say) come: the first answers the receive, on this thread, but
            // not into the memory being filled (nor can another landing reach it).
            let landed = m.land_here(Rank(1), Context(0), Tag(5), 4, |mem| {
                mem.copy_from_slice(b"mine");
                assert!(m.land_here(Rank(1), Context(0), Tag(5), 4, |_| (true, ())).is_none());
                m.deliver_slice(Rank(1), Context(0), Tag(7), b"lent");
                std::thread::scope(|s| s.spawn(|| m.deliver(env(1, 6, b"them"))).join().unwrap());
                assert!(w.arrived() && mem == b"mine");
                (true, ())
            });
            assert_eq!(landed, Some(()));
            // The receive has its answer, as bytes; the payload read in place is queued
            // whole, in its place (it arrived last), not lost.
            let Poll::Ready(Ok(e)) = w.poll(&mut noop()) else { panic!("expected the message") };
            assert!(!w.landed() && e.tag == Tag(7) && e.payload == b"lent"[..]);
        }
        for (tag, body) in [(6, b"them"), (5, b"mine")] {
            let Ok(Ok(e)) = m.post_here(pat(Some(1), None), &waker) else { panic!("expected a queued message") };
            assert_eq!((e.tag, &e.payload[..]), (Tag(tag), &body[..]));
        }
    }
}
