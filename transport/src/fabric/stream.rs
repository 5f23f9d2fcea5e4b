//! In-order delivery per sending stream.
//!
//! Completions may be reported in any order (providers promise send-after-send order
//! of matching at best, not of completions, and a rendezvous message completes only
//! when its read does), so every ordered message carries its stream's sequence number
//! and waits here until all earlier ones of the stream are delivered. A stream is one
//! sender endpoint's stream to us, keyed by (sender, stream id).

use super::wire::Head;
use crate::ids::{Context, Rank, Tag};
use bytes::Bytes;
use rustc_hash::FxHashMap;
use smallvec::{smallvec, SmallVec};
use std::collections::BTreeMap;

/// How far ahead of the next expected message a sequence number may run.
const MAX_AHEAD: u64 = 1 << 20;

/// An ordered message, once complete.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Item {
    /// A message for the mailbox.
    Data { ctx: Context, tag: Tag, payload: Bytes },
    /// The sender closed its endpoint.
    Bye,
    /// A message read straight into a claimed receive (already given to it): it only
    /// takes its place in the order.
    Claimed,
}

enum Slot {
    Ready(Item),
    /// A rendezvous message whose read is under way; `claimed`: into a receive that it
    /// was handed already (see [`Streams::may_claim`]).
    Reading {
        claimed: bool,
    },
}

struct Stream {
    rank: Rank,
    next: u64,
    pending: BTreeMap<u64, Slot>,
}

/// The streams of every source; see the module docs.
#[derive(Default)]
pub(super) struct Streams {
    map: FxHashMap<(Rank, u64), Stream>,
}

/// Items ready for delivery, in order, with their source rank.
pub(super) type Ready = SmallVec<[(Rank, Item); 1]>;

impl Streams {
    /// A message arrived: `item` is `None` for a rendezvous message still being read.
    /// Returns what can be delivered now.
    ///
    /// # Errors
    /// A sequence number already used or implausibly far ahead (a broken peer).
    pub(super) fn arrive(&mut self, rank: Rank, head: Head, item: Option<Item>) -> Result<Ready, String> {
        let s = self.map.entry((rank, head.stream)).or_insert(Stream { rank, next: 0, pending: BTreeMap::new() });
        if head.seq < s.next || head.seq - s.next > MAX_AHEAD || s.pending.contains_key(&head.seq) {
            return Err(format!(
                "message {} of stream {:#x} is out of sequence (next {})",
                head.seq, head.stream, s.next
            ));
        }
        match item {
            // The common case, the next message with nothing waiting: no map at all.
            Some(item) if head.seq == s.next && s.pending.is_empty() => {
                s.next += 1;
                Ok(smallvec![(rank, item)])
            }
            item => {
                s.pending.insert(head.seq, item.map_or(Slot::Reading { claimed: false }, Slot::Ready));
                Ok(Self::drain(s))
            }
        }
    }

    /// If message `head` of `rank` is the next of its stream with nothing pending,
    /// counts it as delivered: true, and the caller delivers it. False: it goes through
    /// [`Streams::arrive`] (which also refuses a broken sequence).
    pub(super) fn take_next(&mut self, rank: Rank, head: Head) -> bool {
        match self.map.get_mut(&(rank, head.stream)) {
            Some(s) if s.next == head.seq && s.pending.is_empty() => {
                s.next += 1;
                true
            }
            Some(_) => false,
            None if head.seq == 0 => {
                self.map.insert((rank, head.stream), Stream { rank, next: 1, pending: BTreeMap::new() });
                true
            }
            None => false,
        }
    }

    /// If message `head` of `rank` is the next of its stream with nothing pending, takes
    /// its place as a message being read (later ones wait behind it until it is
    /// [`Streams::fill`]ed): true. False: nothing changed.
    pub(super) fn reserve_next(&mut self, rank: Rank, head: Head) -> bool {
        let s = match self.map.get_mut(&(rank, head.stream)) {
            Some(s) if s.next == head.seq && s.pending.is_empty() => s,
            None if head.seq == 0 => {
                self.map.entry((rank, head.stream)).or_insert(Stream { rank, next: 0, pending: BTreeMap::new() })
            }
            _ => return false,
        };
        s.pending.insert(head.seq, Slot::Reading { claimed: false });
        true
    }

    /// Whether message `head` of `rank` is being read (arrived, not yet filled, and its
    /// stream not forgotten).
    pub(super) fn is_reading(&self, rank: Rank, head: Head) -> bool {
        let slot = self.map.get(&(rank, head.stream)).and_then(|s| s.pending.get(&head.seq));
        matches!(slot, Some(Slot::Reading { .. }))
    }

    /// Whether message `head` of `rank` may be handed to a receive now, before it is
    /// complete, keeping the order: every earlier message of its stream has arrived and
    /// is delivered, or is a rendezvous message handed to a receive already (those took
    /// the older receives, in order). A message behind one that will reach the mailbox
    /// only later (not yet arrived, or read into a buffer of its own) may not.
    pub(super) fn may_claim(&self, rank: Rank, head: Head) -> bool {
        let Some(s) = self.map.get(&(rank, head.stream)) else { return head.seq == 0 };
        head.seq >= s.next
            && head.seq - s.next <= s.pending.len() as u64
            && (s.next..head.seq).all(|q| {
                matches!(s.pending.get(&q), Some(Slot::Reading { claimed: true } | Slot::Ready(Item::Claimed)))
            })
    }

    /// Notes that rendezvous message `head` of `rank` (arrived, under way) was handed to
    /// a receive.
    pub(super) fn mark_claimed(&mut self, rank: Rank, head: Head) {
        if let Some(Slot::Reading { claimed }) =
            self.map.get_mut(&(rank, head.stream)).and_then(|s| s.pending.get_mut(&head.seq))
        {
            *claimed = true;
        }
    }

    /// The read of a rendezvous message completed. Returns what can be delivered now.
    pub(super) fn fill(&mut self, rank: Rank, head: Head, item: Item) -> Ready {
        let Some(s) = self.map.get_mut(&(rank, head.stream)) else { return Ready::new() };
        match s.pending.get_mut(&head.seq) {
            Some(slot @ Slot::Reading { .. }) => *slot = Slot::Ready(item),
            _ => return Ready::new(),
        }
        Self::drain(s)
    }

    fn drain(s: &mut Stream) -> Ready {
        let mut out = Ready::new();
        while let Some(entry) = s.pending.first_entry() {
            if *entry.key() != s.next || matches!(entry.get(), Slot::Reading { .. }) {
                break;
            }
            if let Slot::Ready(item) = entry.remove() {
                out.push((s.rank, item));
            }
            s.next += 1;
        }
        out
    }

    /// Forgets every stream from `rank` (it ended); undelivered messages are dropped.
    /// Returns how many were.
    pub(super) fn forget(&mut self, rank: Rank) -> usize {
        let mut dropped = 0;
        self.map.retain(|(r, _), s| {
            if *r == rank {
                dropped += s.pending.len();
            }
            *r != rank
        });
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: u8) -> Item {
        Item::Data { ctx: Context(0), tag: Tag(1), payload: Bytes::from(vec![n]) }
    }

    fn head(seq: u64) -> Head {
        Head { stream: 7, seq }
    }

    #[test]
    fn out_of_order_arrivals_are_delivered_in_order() {
        let mut s = Streams::default();
        assert!(s.arrive(Rank(2), head(1), Some(data(1))).unwrap().is_empty());
        assert!(s.arrive(Rank(2), head(2), None).unwrap().is_empty());
        let out = s.arrive(Rank(2), head(0), Some(data(0))).unwrap();
        assert_eq!(out.into_vec(), vec![(Rank(2), data(0)), (Rank(2), data(1))]);
        assert!(s.arrive(Rank(2), head(3), Some(Item::Bye)).unwrap().is_empty());
        assert_eq!(s.fill(Rank(2), head(2), data(2)).into_vec(), vec![(Rank(2), data(2)), (Rank(2), Item::Bye)]);
    }

    #[test]
    fn in_order_messages_pass_without_the_queue() {
        let mut s = Streams::default();
        assert!(s.take_next(Rank(2), head(0)));
        assert!(s.take_next(Rank(2), head(1)));
        // Out of order or a replay: not taken, left to `arrive`.
        assert!(!s.take_next(Rank(2), head(3)));
        assert!(!s.take_next(Rank(2), head(1)));
        assert!(!s.take_next(Rank(3), head(1)));
        assert!(s.arrive(Rank(2), head(3), Some(data(3))).unwrap().is_empty());
        // Message 2 is next, but 3 waits: it goes through the queue, which hands out both.
        assert!(!s.take_next(Rank(2), head(2)));
        assert_eq!(s.arrive(Rank(2), head(2), Some(data(2))).unwrap().len(), 2);
        assert!(s.take_next(Rank(2), head(4)));
        assert!(s.arrive(Rank(2), head(4), Some(data(4))).is_err(), "counted as delivered");
    }

    #[test]
    fn a_message_may_be_claimed_only_behind_claimed_ones() {
        let mut s = Streams::default();
        assert!(s.may_claim(Rank(2), head(0)));
        assert!(!s.may_claim(Rank(2), head(1)), "message 0 has not arrived");
        s.arrive(Rank(2), head(0), None).unwrap();
        assert!(!s.may_claim(Rank(2), head(1)), "message 0 is read into a buffer of its own");
        s.mark_claimed(Rank(2), head(0));
        assert!(s.may_claim(Rank(2), head(1)));
        s.arrive(Rank(2), head(1), None).unwrap();
        s.mark_claimed(Rank(2), head(1));
        // Message 1 completes first: it waits, claimed, for message 0.
        assert!(s.fill(Rank(2), head(1), Item::Claimed).is_empty());
        assert!(s.may_claim(Rank(2), head(2)));
        assert!(!s.may_claim(Rank(2), head(3)), "message 2 has not arrived");
        s.arrive(Rank(2), head(2), Some(data(2))).unwrap();
        assert!(!s.may_claim(Rank(2), head(3)), "message 2 reaches the mailbox only later");
        let out = s.fill(Rank(2), head(0), Item::Claimed);
        assert_eq!(out.len(), 3);
        assert!(s.may_claim(Rank(2), head(3)));
    }

    #[test]
    fn replays_and_far_jumps_are_refused() {
        let mut s = Streams::default();
        s.arrive(Rank(2), head(0), Some(data(0))).unwrap();
        assert!(s.arrive(Rank(2), head(0), Some(data(0))).is_err());
        assert!(s.arrive(Rank(2), head(MAX_AHEAD + 5), Some(data(0))).is_err());
        assert!(s.fill(Rank(2), head(9), data(0)).is_empty());
        assert!(s.fill(Rank(3), head(0), data(0)).is_empty());
    }

    #[test]
    fn streams_of_one_source_are_independent_and_forgotten_together() {
        let mut s = Streams::default();
        let other = Head { stream: 8, seq: 0 };
        assert_eq!(s.arrive(Rank(2), other, Some(data(5))).unwrap().len(), 1);
        assert!(s.arrive(Rank(2), head(1), Some(data(1))).unwrap().is_empty());
        assert_eq!(s.forget(Rank(2)), 1);
        assert_eq!(s.arrive(Rank(2), head(0), Some(data(0))).unwrap().len(), 1);
    }
}
