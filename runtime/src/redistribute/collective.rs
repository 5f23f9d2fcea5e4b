//! The collective executor ([`super::Method::Collective`]): an alltoallv over the
//! transition group in rounds; see the parent module's docs.
//!
//! Where pages are recycled ([`crate::anon`]), a target that was a source, and
//! receives more than it sends, holds back the last segments of sources that leave or
//! come before it, as many as its old
//! block's spare whole pages cover ([`Move::hold_back`], as in `p2p.rs`), and its notice
//! tells each source how many. After the rounds, a member first sends the segments its
//! own targets held back, each target's once it says so; then, its sends done, it moves
//! its old block's pages into its new block (the own overlap's with their bytes, the
//! rest under the held segments), posts their receives and tells their sources to
//! send. Held segments come from sources that leave or come before their target: a
//! member that stays waits only on targets after it, and members that leave wait but
//! no one waits on them, so no two wait for each other.

use super::p2p::{Incoming, Own};
use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The collective's segments from or to each member of the transition group.
type PerMember = Vec<Vec<Range<usize>>>;

impl Move<'_> {
    /// Whether member `from` sends member `to` a block in a round even without a
    /// segment for it, so that they go from round to round together. Members with old
    /// blocks keep in step where peers share memory: unpaced, the members that leave
    /// all copy into one target at once (without rounds, fabric shm 4→1 ran at 2.67
    /// GB/s against 3.07), and in a paced move, where member 0 paces them all. Over a
    /// socket the receiver's flow control paces each sender, and keeping in step only
    /// waits on the slowest member (over tcp without rounds, medians of 7 alternating
    /// jobs, GB/s: 8→2 2.46 against 2.33, 2→8 3.14 against 2.91, 4→2 and 4→1 the same).
    /// A member that joined has nothing to send; waiting for its empty blocks every
    /// round would only hold the others back (against empty blocks from every member
    /// every round: over fabric shm 2→8 3.40 against 3.07 and 2→4 3.55 against 3.17).
    fn sends_empty(&self, from: usize, to: usize) -> bool {
        let old = |m: usize| m < self.old_n as usize;
        let lockstep = self.share.is_some() || self.t.shares_memory();
        lockstep && old(from) && old(to)
    }

    /// Posts this member's receives of collective round `round`: each segment into its
    /// place in the new block (`landing`), and the empty blocks it expects
    /// ([`Move::sends_empty`]). `inc` are the segments from each member.
    fn post_round<'a>(
        &'a self,
        round: usize,
        landing: Option<&Arc<Landing>>,
        inc: &[Vec<Range<usize>>],
    ) -> Result<Vec<BoxFuture<'a, Result<()>>>> {
        let (t, me) = (self.t, self.t.rank());
        let mut recvs: Vec<BoxFuture<'a, Result<()>>> = Vec::with_capacity(inc.len());
        for src in (0..inc.len()).filter(|&s| s != me) {
            match (landing, inc[src].get(round)) {
                (Some(l), Some(seg)) => {
                    let part = l.part(seg.clone()).ok_or_else(|| plan_error("overlapping segments"))?;
                    let landed = t.post_in_place(src, self.tag, part)?;
                    recvs.push(Box::pin(async move { landed.await.map(drop) }));
                }
                (_, None) if !self.sends_empty(src, me) => {}
                _ => recvs.push(self.expect_empty(src)?),
            }
        }
        Ok(recvs)
    }

    /// Posts a receive of an empty block from member `src`.
    fn expect_empty(&self, src: usize) -> Result<BoxFuture<'_, Result<()>>> {
        let empty = self.t.post_tagged(src, self.tag)?;
        Ok(Box::pin(async move {
            let (b, _) = empty.await?;
            if b.is_empty() {
                Ok(())
            } else {
                Err(plan_error(&format!("{} unexpected bytes from member {src}", b.len())))
            }
        }))
    }

    /// The collective's number of rounds, and the segments this member sends to and
    /// receives from each member, in round order.
    fn round_segments(&self) -> (usize, PerMember, PerMember) {
        let size = self.t.size();
        // A member receives from at most every old rank in a round.
        let seg_len = (ROUND_BUDGET / self.old_n.max(1) as usize).clamp(MIN_ROUND_SEGMENT, SEGMENT);
        let mut out: PerMember = vec![Vec::new(); size];
        for (k, range) in self.sends() {
            out[k] = segments(range, seg_len).collect();
        }
        let mut inc: PerMember = vec![Vec::new(); size];
        if let Some(plan) = self.drain() {
            for (src, range) in self.receives(&plan) {
                inc[src] = segments(range, seg_len).collect();
            }
        }
        // Every member runs the same number of rounds, known without asking: enough for
        // the largest overlap there can be, which is no larger than the largest block.
        let largest = |n: u32| self.global.div_ceil(u64::from(n.max(1)));
        let rounds = segments(0..self.bytes(largest(self.old_n).min(largest(self.new_n))), seg_len).count();
        (rounds, out, inc)
    }

    pub(super) async fn collective(
        &self,
        old: Bytes,
        pages: Option<Arc<Aligned>>,
        mut new: Option<&mut Aligned>,
    ) -> Result<()> {
        let (t, size, me) = (self.t, self.t.size(), self.t.rank());
        let (rounds, out, mut inc) = self.round_segments();
        let feeds: Vec<bool> = inc.iter().enumerate().map(|(s, segs)| s != me && !segs.is_empty()).collect();
        let in_place = new.as_deref().and_then(|block| self.in_place(pages, block));
        // Incoming segments land straight in the new block.
        let landing = new.as_deref_mut().map(|block| std::mem::take(block).into_landing());
        // Where the old block's pages move into the new one, the own overlap's move in
        // at the end, and the rest under the last segments from some sources (`held`).
        let (own, held) = self.hold_back_rounds(landing.as_ref(), in_place.as_ref(), &mut inc, &out)?;
        // A member tells each member that feeds it once its rounds' receives are posted,
        // and how many of its last segments to hold back; a member sends a target its
        // first segment only once told: a segment that came earlier would land in a
        // buffer of its own and be copied again. The notices are queued before anything
        // else, so they come first from each member, and are posted first. (8→2 over
        // tcp: 36597 page faults for rank 1's 33746 new pages before, 33827 after.)
        let mut ready: Vec<Option<BoxFuture<'_, Result<usize>>>> = (0..size)
            .map(|d| (d != me && !out[d].is_empty()).then(|| self.expect_notice(d, out[d].len())).transpose())
            .collect::<Result<_>>()?;
        let held_by: Vec<AtomicUsize> = (0..size).map(|_| AtomicUsize::new(0)).collect();
        let sendable = |d: usize, round: usize| round + held_by[d].load(Ordering::Relaxed) < out[d].len();
        // Every round's receives are posted before anything is sent, in round order: a
        // member's blocks arrive in round order, so each lands in its own receive.
        let posted = (0..rounds).map(|r| self.post_round(r, landing.as_ref(), &inc)).collect::<Result<Vec<_>>>()?;
        // Each round's segments are populated ([`Move::populating`]) while the round before
        // travels, round 0's before the notices: populating the whole block first kept
        // the senders waiting (8→2 over tcp: 45-58 ms). A paced move does populate it
        // first (round by round, a background 2→4 over tcp had ω 1.43 against 1.17).
        let paced = Pacer::new(self.share).paced();
        let populate = |round: usize| {
            if let (Some(l), true) = (&landing, self.populating()) {
                for seg in (0..size).filter(|&s| s != me).filter_map(|s| inc[s].get(round)) {
                    l.populate(seg.clone());
                }
            }
        };
        (0..if paced { rounds } else { 1 }).for_each(populate);
        try_join_all(
            (0..size).filter(|&src| feeds[src]).map(|src| t.send_tagged(src, self.tag, notice(held[src].len()))),
        )
        .await?;
        // Rounds hold every member back to the slowest, so one member paces them all.
        // (If every member paced, each would count the others' pauses as its own work
        // and pause longer, round after round.)
        let mut pacer = Pacer::new(self.share.filter(|_| me == 0));
        for (round, recvs) in posted.into_iter().enumerate() {
            if round > 0 {
                pacer.segment_done().await;
            }
            let block = |d: usize| out[d].get(round).map_or_else(Bytes::new, |r| old.slice(r.clone()));
            let sends = (1..size)
                .map(|k| (me + k) % size)
                .filter(|&d| (round == 0 && !out[d].is_empty()) || sendable(d, round) || self.sends_empty(me, d))
                .map(|d| {
                    let ready = if round == 0 { ready[d].take() } else { None };
                    let (held_by, block) = (&held_by, &block);
                    async move {
                        if let Some(ready) = ready {
                            held_by[d].store(ready.await?, Ordering::Relaxed);
                        }
                        match (sendable(d, round), self.sends_empty(me, d)) {
                            (true, _) => t.send_tagged(d, self.tag, block(d)).await,
                            (false, true) => t.send_tagged(d, self.tag, Bytes::new()).await,
                            (false, false) => Ok(()),
                        }
                    }
                })
                .collect::<Vec<_>>();
            // The own segment is copied while the others travel (or moved in at the end).
            let own = async {
                if !paced {
                    populate(round + 1);
                }
                if let (Some(l), Some(seg), None) = (&landing, inc[me].get(round), &in_place) {
                    let mut part = l.part(seg.clone()).ok_or_else(|| plan_error("overlapping segments"))?;
                    crate::block::fill(part.as_mut_slice(), &block(me));
                }
                Ok(())
            };
            try_join3(try_join_all(sends), try_join_all(recvs), own).await?;
        }
        self.send_held(&old, &out, &held_by).await?;
        drop(old);
        let moved = match &landing {
            Some(l) => self.receive_held(in_place, own, l, &held).await?,
            None => Vec::new(),
        };
        if let (Some(block), Some(l)) = (new, landing) {
            *block = Aligned::from_landing(l).ok_or_else(|| plan_error("a receive still holds the block"))?;
            block.moved_in(&moved);
        }
        Ok(())
    }

    /// Where the old block's pages move into the new block (`in_place`): the own
    /// overlap's part of the new block (`landing`), and the last segments of sources
    /// that leave or come before this member, taken off `inc`, to receive into the old
    /// block's other pages once its sends are done (as [`Move::hold_back`] does for the
    /// point-to-point executor). `out` are the segments this member sends.
    fn hold_back_rounds(
        &self,
        landing: Option<&Arc<Landing>>,
        in_place: Option<&(Arc<Aligned>, usize)>,
        inc: &mut PerMember,
        out: &PerMember,
    ) -> Result<(Option<Own>, PerMember)> {
        let mut held: PerMember = vec![Vec::new(); inc.len()];
        let (Some(landing), Some((old, phase))) = (landing, in_place) else { return Ok((None, held)) };
        let me = self.t.rank();
        let own = own_part(landing, &inc[me], &out[me])?;
        // Held segments land only once this member's sends are done: worth it where it
        // receives more than it sends, so that its other receives go on meanwhile.
        // Where it sends more, as old members do in a growth, they come last and alone
        // (over tcp, medians of 6 alternating jobs, GB/s: 2→8 3.02 holding back against
        // 3.24 not; 8→2 2.77 against 2.64).
        let others = |segs: &PerMember| -> usize {
            segs.iter().enumerate().filter(|(s, _)| *s != me).flat_map(|(_, v)| v).map(ExactSizeIterator::len).sum()
        };
        if others(out) > others(inc) {
            return Ok((own, held));
        }
        let mut now: Incoming = inc
            .iter_mut()
            .enumerate()
            .filter(|(s, segs)| *s != me && !segs.is_empty())
            .map(|(s, segs)| (s, std::mem::take(segs)))
            .collect();
        let later = self.hold_back(&mut now, old, *phase, own.as_ref());
        for (s, segs) in now {
            inc[s] = segs;
        }
        for (s, segs) in later {
            held[s] = segs;
        }
        Ok((own, held))
    }

    /// Posts the receive of member `d`'s notice: how many of this member's last segments
    /// for it (`sent` in all) `d` holds back.
    fn expect_notice(&self, d: usize, sent: usize) -> Result<BoxFuture<'_, Result<usize>>> {
        let notice = self.t.post_tagged(d, self.tag)?;
        Ok(Box::pin(async move {
            let (b, _) = notice.await?;
            let held = match <[u8; 8]>::try_from(&b[..]) {
                _ if b.is_empty() => 0,
                Ok(n) => u64::from_le_bytes(n),
                Err(_) => return Err(plan_error(&format!("a notice of {} bytes from member {d}", b.len()))),
            };
            usize::try_from(held).ok().filter(|&h| h <= sent).ok_or_else(|| {
                plan_error(&format!("member {d} holds back {held} segments of the {sent} this member sends it"))
            })
        }))
    }

    /// After the rounds: sends each target the segments it held back (`held_by`: how
    /// many of the last of `out`), each target's once it says their pages are there.
    async fn send_held(&self, old: &Bytes, out: &PerMember, held_by: &[AtomicUsize]) -> Result<()> {
        let t = self.t;
        let tail = (0..out.len()).filter(|&d| held_by[d].load(Ordering::Relaxed) > 0).map(|d| {
            let from = out[d].len().saturating_sub(held_by[d].load(Ordering::Relaxed));
            let go = self.expect_empty(d);
            async move {
                go?.await?;
                for seg in &out[d][from..] {
                    t.send_tagged(d, self.tag, old.slice(seg.clone())).await?;
                }
                Ok::<(), Error>(())
            }
        });
        try_join_all(tail).await?;
        Ok(())
    }

    /// After the rounds and [`Move::send_held`]: moves the old block's pages into the
    /// new one ([`Move::recycle_sent`]: the own overlap's, and the rest under the
    /// segments held back), then receives those segments, telling each of their
    /// sources to send them. Returns the ranges of the new block's mapping that hold
    /// moved pages.
    async fn receive_held(
        &self,
        in_place: Option<(Arc<Aligned>, usize)>,
        own: Option<Own>,
        landing: &Arc<Landing>,
        held: &PerMember,
    ) -> Result<Vec<Range<usize>>> {
        // A source's held segments are contiguous in the new block.
        let spans: Vec<Range<usize>> =
            held.iter().filter_map(|segs| Some(segs.first()?.start..segs.last()?.end)).collect();
        let moved = self.recycle_sent(in_place, own, landing, &spans).await?;
        let mut landed = Vec::new();
        for (src, segs) in held.iter().enumerate().filter(|(_, segs)| !segs.is_empty()) {
            for seg in segs {
                // Pages not moved in (beyond the spare ones, or when recycling failed)
                // are fresh.
                let mut part = landing.part(seg.clone()).ok_or_else(|| plan_error("overlapping segments"))?;
                self.prepare(&mut part);
                landed.push(self.t.post_in_place(src, self.tag, part)?);
            }
            self.t.send_tagged(src, self.tag, Bytes::new()).await?;
        }
        try_join_all(landed).await?;
        Ok(moved)
    }
}

/// A notice that receives are posted, and how many of the last segments to hold back.
fn notice(held: usize) -> Bytes {
    if held == 0 {
        Bytes::new()
    } else {
        Bytes::copy_from_slice(&(held as u64).to_le_bytes())
    }
}

/// The own overlap's part of the new block (`landing`), its range there and its range
/// in the old block, from the segments this member receives from and sends to itself.
fn own_part(landing: &Arc<Landing>, inc: &[Range<usize>], out: &[Range<usize>]) -> Result<Option<Own>> {
    let span = |segs: &[Range<usize>]| segs.first().zip(segs.last()).map(|(a, b)| a.start..b.end);
    match (span(inc), span(out)) {
        (Some(range), Some(from)) => {
            let part = landing.part(range.clone()).ok_or_else(|| plan_error("overlapping segments"))?;
            Ok(Some((part, range, from)))
        }
        (None, None) => Ok(None),
        _ => Err(plan_error("own overlap on one side only")),
    }
}
