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
//! Matching is unchanged: the receive is an ordinary posting, matched in its turn under
//! the lock. Only where its answer goes differs.

use super::{Envelope, Mailbox};
use crate::error::TransportError;
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::task::{Context as TaskContext, Poll, Waker};

/// A receive: its mailbox's address and its id there.
type Key = (usize, u64);

/// No receive (no mailbox is at address 0).
const NONE: Key = (0, 0);

thread_local! {
    /// The receive this thread waits for.
    static WAITING: Cell<Key> = const { Cell::new(NONE) };
    /// A message this thread delivered to the receive it waits for, with that receive.
    static ARRIVED: RefCell<Option<(Key, Envelope)>> = const { RefCell::new(None) };
}

/// Takes `env` for receive `id` of `mailbox` (posted by [`Mailbox::post_here`]) if the
/// calling thread is waiting for it; gives it back otherwise.
pub(super) fn hand_over(mailbox: &Mailbox, id: u64, env: Envelope) -> Result<(), Envelope> {
    let key = (addr(mailbox), id);
    if WAITING.get() != key {
        return Err(env);
    }
    ARRIVED.set(Some((key, env)));
    Ok(())
}

fn addr(mailbox: &Mailbox) -> usize {
    std::ptr::from_ref(mailbox) as usize
}

/// The message handed over to receive `key`, if there is one.
fn take_arrived(key: Key) -> Option<Envelope> {
    ARRIVED.with_borrow_mut(|a| match a.take() {
        Some((k, env)) if k == key => Some(env),
        // Only a wait leaked with `mem::forget` leaves another receive's message (its
        // receive is never collected); it is dropped.
        _ => None,
    })
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
    /// The receive an outer wait of this thread waits for (a blocking call nested in
    /// another's future), restored when this one ends.
    outer: Key,
    done: bool,
    _here: PhantomData<*const ()>,
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
        let id = {
            let mut st = self.lock();
            if let Some(env) = st.take_queued(&pattern)? {
                return Ok(Ok(env));
            }
            st.push(pattern, super::Reply::Here(waker.clone()))
        };
        let outer = WAITING.replace((addr(self), id));
        Ok(Err(WaitHere { mailbox: self, id, outer, done: false, _here: PhantomData }))
    }
}

impl WaitHere<'_> {
    /// Whether this thread delivered the message (checked without the mailbox's lock).
    #[must_use]
    pub fn arrived(&self) -> bool {
        ARRIVED.with_borrow(|a| a.as_ref().is_some_and(|(k, _)| *k == self.key()))
    }

    fn key(&self) -> Key {
        (addr(self.mailbox), self.id)
    }

    /// The message or the receive's error once there; until then, `cx`'s waker is woken
    /// when another thread answers. Once it returned ready, the receive is over.
    pub fn poll(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<Envelope, TransportError>> {
        if self.done {
            return Poll::Ready(Err(TransportError::Closed));
        }
        let r = match take_arrived(self.key()) {
            Some(env) => Ok(env),
            None => match self.mailbox.poll_posted(self.id, cx) {
                Poll::Ready(r) => r,
                Poll::Pending => return Poll::Pending,
            },
        };
        self.done = true;
        Poll::Ready(r)
    }
}

impl Drop for WaitHere<'_> {
    fn drop(&mut self) {
        WAITING.set(self.outer);
        if self.done {
            return;
        }
        let env = take_arrived(self.key()).or_else(|| self.mailbox.withdraw(self.id));
        if let Some(env) = env {
            self.mailbox.give_back(env);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{answer, env, pat, posted};
    use super::*;
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
}
