//! The receive buffers, posted again and again from fixed slots.
//!
//! Every message arrives in one of a fixed set of posted receive buffers. Each slot
//! has its own operation context at a fixed address, so a receive's completion is
//! recognised by where its context lies, without the operation table's shared lock and
//! hash. A slot whose message was handled sets its bit in a mask; whoever polls next
//! takes the whole mask at once and posts those slots again, without a shared list
//! and its lock. (Callgrind, one rank of the 8-byte ping-pong over shm: about 450
//! instructions fewer per round trip than with receives in the table; a stream of
//! 8-byte messages went from 780 to 727 ns per message, medians of 12 alternating
//! jobs; the ping-pong's latency did not move.)
//!
//! A slot is in one of three states, and only its owner touches its buffer (each
//! buffer's mutex is thus never contended):
//! - posted: the provider owns it until its completion is read;
//! - completed: the thread that read the completion reads the message, then sets the
//!   slot's bit;
//! - unposted (bit set): the thread whose swap of the mask takes the bit posts it.
//!
//! A slot whose post fails for good (not `FI_EAGAIN`) is given up: it stays out of the
//! mask, and the endpoint goes on with one buffer fewer.

use super::mem::LocalBuf;
use super::{lock, Ep, OfiError, Posted};
use crate::fabric::sys;
use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The most slots a set holds: one bit each in the mask.
pub(in crate::fabric) const MAX_SLOTS: usize = 64;

/// A slot's operation context: scratch space the provider may write while the receive
/// is posted (the `FI_CONTEXT`/`FI_CONTEXT2` modes); never read by the backend.
#[derive(Default)]
struct SlotContext(UnsafeCell<sys::fi_context2>);

// SAFETY: the backend never reads or writes the context itself; it only hands its
// address to the provider, which writes it while the receive is posted.
unsafe impl Sync for SlotContext {}
// SAFETY: as above; the raw pointers inside are the provider's scratch data.
unsafe impl Send for SlotContext {}

/// Receive buffers of `tag`ged messages from any source, in fixed slots; see the module
/// docs.
#[derive(Default)]
pub(in crate::fabric) struct RecvSlots {
    /// Boxed once: the contexts' addresses identify the slots and must not move.
    ctxs: Box<[SlotContext]>,
    bufs: Box<[Mutex<LocalBuf>]>,
    /// Slots waiting to be posted, one bit each.
    unposted: AtomicU64,
    /// Slots given up (their post failed for good), one bit each.
    given_up: AtomicU64,
    tag: u64,
}

impl RecvSlots {
    /// Slots for `bufs` (at most [`MAX_SLOTS`]; more are dropped), none posted yet: all
    /// wait for [`RecvSlots::post_unposted`].
    pub(in crate::fabric) fn new(bufs: Vec<LocalBuf>, tag: u64) -> Self {
        let bufs: Box<[Mutex<LocalBuf>]> = bufs.into_iter().take(MAX_SLOTS).map(Mutex::new).collect();
        let ctxs = (0..bufs.len()).map(|_| SlotContext::default()).collect();
        let all = if bufs.len() == MAX_SLOTS { u64::MAX } else { (1u64 << bufs.len()) - 1 };
        Self { ctxs, bufs, unposted: AtomicU64::new(all), given_up: AtomicU64::new(0), tag }
    }

    /// The slot whose context is `ctx`, if it is one of ours.
    pub(in crate::fabric) fn slot_of(&self, ctx: *mut c_void) -> Option<usize> {
        let size = size_of::<SlotContext>();
        let off = (ctx as usize).checked_sub(self.ctxs.as_ptr() as usize)?;
        let i = off / size;
        (off % size == 0 && i < self.ctxs.len()).then_some(i)
    }

    /// Hands the message in slot `i` (whose completion the caller read) to `f`.
    pub(in crate::fabric) fn with_message<R>(&self, i: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        f(lock(&self.bufs[i]).bytes())
    }

    /// Slot `i` is done with (its message handled, or its receive failed): it waits to
    /// be posted again.
    pub(in crate::fabric) fn release(&self, i: usize) {
        self.unposted.fetch_or(1 << i, Ordering::Release);
    }

    /// Whether to post the waiting slots now: whenever the completion queue was found
    /// empty (`idle`), and otherwise only once half the slots still in use wait.
    pub(in crate::fabric) fn should_post(&self, idle: bool) -> bool {
        let waiting = self.unposted.load(Ordering::Acquire).count_ones() as usize;
        waiting > 0
            && (idle || {
                let live = self.bufs.len() - self.given_up.load(Ordering::Acquire).count_ones() as usize;
                2 * waiting >= live
            })
    }

    /// Posts the slots that wait on `ep`; a slot the provider cannot take now
    /// (`FI_EAGAIN`) waits for the next call. A slot whose post fails is given up (see
    /// the module docs); the first such error is returned, after the other slots were
    /// posted.
    pub(in crate::fabric) fn post_unposted(&self, ep: &Ep) -> Result<(), OfiError> {
        self.post_each(|buf, len, desc, ctx| {
            // SAFETY: `post_each` hands out a slot only once this thread's swap of the
            // mask took its bit, so the slot is not posted (see the module docs) and no
            // other thread posts or reads it until its completion; its buffer is heap
            // memory that does not move, and its context has a fixed address. Both live
            // in the set, which is dropped only after the endpoint is closed (`Ops` is
            // kept after its endpoint, see `Inner`'s field order and `Drop`).
            unsafe { ep.trecv(buf, len, desc, self.tag, ctx) }
        })
    }

    /// Takes the mask and calls `post` with each slot it held (buffer, length,
    /// descriptor, context); see [`RecvSlots::post_unposted`].
    fn post_each(
        &self,
        mut post: impl FnMut(*mut u8, usize, *mut c_void, *mut c_void) -> Result<Posted, OfiError>,
    ) -> Result<(), OfiError> {
        let mut bits = self.unposted.swap(0, Ordering::Acquire);
        let mut again = 0u64;
        let mut first_err = None;
        while bits != 0 {
            let i = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            let (buf, len, desc) = lock(&self.bufs[i]).raw_mut();
            match post(buf, len, desc, self.ctxs[i].0.get().cast::<c_void>()) {
                Ok(Posted::Yes) => {}
                Ok(Posted::Again) => again |= 1 << i,
                Err(e) => {
                    self.given_up.fetch_or(1 << i, Ordering::Release);
                    first_err.get_or_insert(e);
                }
            }
        }
        if again != 0 {
            self.unposted.fetch_or(again, Ordering::Release);
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Closes the buffers' registrations (teardown, before the endpoint is closed); the
    /// memory stays until the set is dropped.
    pub(in crate::fabric) fn drop_registrations(&self) {
        for b in &self.bufs {
            lock(b).unregister();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(n: usize) -> RecvSlots {
        RecvSlots::new((0..n).map(|i| LocalBuf::unregistered(vec![i as u8; 4])).collect(), 7)
    }

    #[test]
    fn contexts_name_their_slots_and_nothing_else() {
        let s = slots(3);
        for i in 0..3 {
            let ctx = s.ctxs[i].0.get().cast::<c_void>();
            assert_eq!(s.slot_of(ctx), Some(i));
            assert_eq!(s.with_message(i, |b| b[0]), i as u8);
            // Inside a context, or past the last one: not a slot.
            assert_eq!(s.slot_of(ctx.cast::<u8>().wrapping_add(1).cast()), None);
        }
        let past = s.ctxs[2].0.get().cast::<u8>().wrapping_add(size_of::<SlotContext>());
        assert_eq!(s.slot_of(past.cast()), None);
        assert_eq!(s.slot_of(std::ptr::null_mut()), None);
        let other = SlotContext::default();
        assert_eq!(s.slot_of(other.0.get().cast()), None);
    }

    /// Posts with `outcome(slot)`; returns the slots offered, in order.
    fn post(s: &RecvSlots, outcome: impl Fn(usize) -> Result<Posted, OfiError>) -> (Vec<usize>, Result<(), OfiError>) {
        let mut offered = Vec::new();
        let res = s.post_each(|buf, len, _, ctx| {
            let i = s.slot_of(ctx).expect("a slot's own context");
            assert_eq!(len, 4);
            // SAFETY (test): the slot is not posted; its 4-byte buffer is ours to read.
            assert_eq!(unsafe { *buf }, i as u8, "the slot's own buffer");
            offered.push(i);
            outcome(i)
        });
        (offered, res)
    }

    #[test]
    fn each_waiting_slot_is_posted_once_and_busy_ones_wait_for_the_next_poll() {
        let s = slots(5);
        let (offered, res) = post(&s, |i| match i {
            1 | 3 => Ok(Posted::Again),
            4 => Err(OfiError { call: "fi_trecv", code: sys::FI_EINVAL as i32 }),
            _ => Ok(Posted::Yes),
        });
        assert_eq!(offered, [0, 1, 2, 3, 4]);
        assert_eq!(res.unwrap_err().call, "fi_trecv");
        // The busy ones wait; the failed one is given up; the posted ones are not offered
        // again until released.
        assert_eq!(s.unposted.load(Ordering::Relaxed), 0b01010);
        let (offered, res) = post(&s, |_| Ok(Posted::Yes));
        assert_eq!((offered, res.is_ok()), (vec![1, 3], true));
        assert_eq!(post(&s, |_| Ok(Posted::Yes)).0, Vec::<usize>::new());
        s.release(2);
        assert_eq!(post(&s, |_| Ok(Posted::Yes)).0, [2]);
        // While completions keep coming, slots are posted again once half of the four
        // still in use wait (the given-up one does not count).
        s.release(0);
        assert!(!s.should_post(false) && s.should_post(true));
        s.release(1);
        assert!(s.should_post(false));
    }

    #[test]
    fn all_slots_start_unposted_and_released_ones_wait_again() {
        let s = slots(MAX_SLOTS + 3);
        assert_eq!(s.bufs.len(), MAX_SLOTS, "more than a mask's bits are dropped");
        assert_eq!(s.unposted.load(Ordering::Relaxed), u64::MAX);
        let s = slots(5);
        assert_eq!(s.unposted.load(Ordering::Relaxed), 0b11111);
        s.unposted.store(0, Ordering::Relaxed);
        assert!(!s.should_post(true));
        s.release(3);
        s.release(0);
        assert!(s.should_post(true) && !s.should_post(false));
        assert_eq!(s.unposted.load(Ordering::Relaxed), 0b1001);
        assert_eq!(RecvSlots::default().bufs.len(), 0);
        assert!(!RecvSlots::default().should_post(true));
    }
}
