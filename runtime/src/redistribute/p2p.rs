//! The point-to-point executor ([`super::Method::P2p`]): sources send each overlap in
//! segments, each once its target granted it; see the parent module's docs.
//!
//! Where pages are recycled ([`crate::anon`]), a target that was a source also moves
//! its old block's pages into its new block once its own sends are done: its own
//! overlap's with their bytes, and the rest under the last segments of sources that
//! leave or come before it, which it grants only then, after all its other segments.
//! A source sends a target its segments in order, each on a grant, and serves
//! each target on its own: a target that grants the tail of a source's segments after
//! all the others holds nothing else of the source back, and the source's segments
//! still land in order. A target that holds back segments waits only for its own
//! targets' grants, which hold back only sources before them: it waits on targets after
//! it, or on none, and no two wait for each other.

use super::rma::{recycle_into, spare_pages};
use super::*;

/// The segments a target receives from each source, in the order the source sends
/// them.
pub(super) type Incoming = Vec<(usize, Vec<Range<usize>>)>;

/// The own overlap's part of the new block, its range there, and its range in the old
/// block.
pub(super) type Own = (Part, Range<usize>, Range<usize>);

impl Move<'_> {
    pub(super) async fn p2p(&self, old: Bytes, pages: Option<Arc<Aligned>>, new: Option<&mut Aligned>) -> Result<()> {
        let me = self.t.rank();
        let mut own = Vec::new();
        let mut outgoing = Vec::new();
        for (k, range) in self.sends() {
            if k == me {
                own.push(range);
            } else {
                outgoing.push((k, segments(range, SEGMENT).collect::<Vec<_>>()));
            }
        }
        let in_place = new.as_deref().and_then(|block| self.in_place(pages, block));
        // The own overlap is copied from the old block, unless its pages move in.
        let copy_from = in_place.is_none().then(|| old.clone());
        let serve = self.p2p_serve(outgoing, old);
        let (Some(plan), Some(block)) = (self.drain(), new) else {
            return serve.await;
        };
        // Each segment is received straight into its place in the new block: before a
        // source is granted its next segment, a receive into that segment's part is
        // posted (a source sends its segments in order, and receives from it match in
        // the order they were posted).
        let landing = std::mem::take(block).into_landing();
        let lend = |seg: Range<usize>| landing.part(seg).ok_or_else(|| plan_error("overlapping segments"));
        let mut now: Incoming = Vec::new();
        let mut own_part = None;
        for (src, range) in self.receives(&plan) {
            if self.lost.contains(&(src as u32)) {
                // Held by a process that failed: nothing to receive, and the new block
                // (`Aligned::placed`) is zero there already, its pages untouched.
                continue;
            } else if src == me {
                let from = own.pop().ok_or_else(|| plan_error("own overlap"))?;
                own_part = Some((lend(range.clone())?, range, from));
            } else {
                now.push((src, segments(range, SEGMENT).collect()));
            }
        }
        let later = match &in_place {
            Some((old_block, phase)) => self.hold_back(&mut now, old_block, *phase, own_part.as_ref()),
            None => Vec::new(),
        };
        // Once the old block is sent, its pages move in and the segments held back can
        // be granted. Without recycling, the own overlap is copied once the first grants
        // are out (polled first, the receive sends them), while the first segments
        // travel.
        let (own_moved, own_copied) = if copy_from.is_none() { (own_part, None) } else { (None, own_part) };
        let (ready, gate) = oneshot::channel();
        // A source's held segments are contiguous in the new block.
        let held: Vec<Range<usize>> =
            later.iter().filter_map(|(_, segs)| Some(segs.first()?.start..segs.last()?.end)).collect();
        let sent = async {
            serve.await?;
            let moved = self.recycle_sent(in_place, own_moved, &landing, &held).await?;
            let _ = ready.send(());
            Ok::<_, Error>(moved)
        };
        let recycled = try_join(sent, self.p2p_receive(&landing, now, later, gate));
        let copy = async {
            if let (Some(old), Some((mut part, _, from))) = (&copy_from, own_copied) {
                crate::block::fill(part.as_mut_slice(), &old[from]);
            }
            Ok::<(), Error>(())
        };
        let ((moved, ()), ()) = try_join(recycled, copy).await?;
        drop(copy_from);
        *block = Aligned::from_landing(landing).ok_or_else(|| plan_error("a receive still holds the block"))?;
        block.moved_in(&moved);
        Ok(())
    }

    /// A source's side of [`Move::p2p`]: sends each target its segments of `old`, each
    /// once the target granted it (grants travel on the item's second tag). Drops its
    /// share of the old block once all are sent.
    async fn p2p_serve(&self, outgoing: Incoming, old: Bytes) -> Result<()> {
        let t = self.t;
        try_join_all(outgoing.iter().map(|(k, segs)| {
            let old = &old;
            async move {
                for seg in segs {
                    t.recv_tagged(Some(*k), TagMatch::Tag(self.done_tag)).await?;
                    t.send_tagged(*k, self.tag, old.slice(seg.clone())).await?;
                }
                Ok::<(), Error>(())
            }
        }))
        .await?;
        Ok(())
    }

    /// A target's grants: first of the segments `now`, round-robin over the sources so
    /// that all of them keep sending, then of those held back (`later`, round-robin
    /// too), the first of which waits for `gate` (the recycled pages under them); each
    /// segment lands in its part of `landing`. At most [`WINDOW`] are in flight (one
    /// when paced), and they keep landing while the gate is awaited. `later` holds the
    /// tail of a source's segments, so each source is granted its segments in order.
    async fn p2p_receive(
        &self,
        landing: &Arc<Landing>,
        now: Incoming,
        later: Incoming,
        gate: oneshot::Receiver<()>,
    ) -> Result<()> {
        let t = self.t;
        let counts = |inc: &Incoming| inc.iter().map(|(src, segs)| (*src, segs.len())).collect::<Vec<_>>();
        let (first, held) = (round_robin(&counts(&now)), round_robin(&counts(&later)));
        let first_held = (!held.is_empty()).then_some(first.len());
        let mut next: Vec<_> = now
            .into_iter()
            .map(|(src, mut segs)| {
                segs.extend(later.iter().filter(|(s, _)| *s == src).flat_map(|(_, tail)| tail.iter().cloned()));
                (src, segs.into_iter())
            })
            .collect();
        let mut pacer = Pacer::new(self.share);
        let window = pacer.window(WINDOW);
        let mut grant = |src: usize| {
            let seg = next.iter_mut().find(|(s, _)| *s == src).and_then(|(_, segs)| segs.next());
            let seg = seg.ok_or_else(|| plan_error("grant without a segment"))?;
            let mut part = landing.part(seg).ok_or_else(|| plan_error("overlapping segments"))?;
            self.prepare(&mut part);
            let landed = t.post_in_place(src, self.tag, part)?;
            Ok::<_, Error>(async move {
                t.send_tagged(src, self.done_tag, Bytes::new()).await?;
                landed.await
            })
        };
        let mut inflight = FuturesUnordered::new();
        let mut gate = std::pin::pin!(gate);
        for (i, src) in first.into_iter().chain(held).enumerate() {
            if Some(i) == first_held {
                loop {
                    tokio::select! {
                        opened = &mut gate => {
                            opened.map_err(|_| plan_error("the recycled pages never came"))?;
                            break;
                        }
                        Some(landed) = inflight.next() => {
                            drop(landed?);
                            pacer.segment_done().await;
                        }
                    }
                }
            }
            while inflight.len() >= window {
                if let Some(landed) = inflight.next().await {
                    drop(landed?);
                    pacer.segment_done().await;
                }
            }
            inflight.push(grant(src)?);
        }
        while let Some(landed) = inflight.next().await {
            drop(landed?);
            pacer.segment_done().await;
        }
        Ok(())
    }

    /// Takes off `now` the segments to receive into the old block's recycled pages: the
    /// last ones of each source that leaves or comes before this member, while the
    /// whole pages of the old block that its own overlap (`own`) does not cover last.
    /// `phase` is where the new block's mapping starts its bytes.
    pub(super) fn hold_back(
        &self,
        now: &mut Incoming,
        old: &Arc<Aligned>,
        phase: usize,
        own: Option<&Own>,
    ) -> Incoming {
        let Some(pages) = old.pages() else { return Vec::new() };
        let mut spare: usize =
            spare_pages(pages, own.map(|(_, _, from)| from)).iter().map(ExactSizeIterator::len).sum();
        let me = self.t.rank();
        let mut later = Vec::new();
        for (src, segs) in now.iter_mut().filter(|(src, _)| !self.member_of_new.contains(src) || *src < me) {
            // A suffix of the source's segments: those from `keep` on.
            let mut keep = segs.len();
            while keep > 0 && spare > 0 {
                keep -= 1;
                spare = spare.saturating_sub(crate::anon::inner(phase, &segs[keep]).len());
            }
            // Leading segments without a whole page gain nothing by waiting.
            while keep < segs.len() && crate::anon::inner(phase, &segs[keep]).is_empty() {
                keep += 1;
            }
            if keep < segs.len() {
                later.push((*src, segs.split_off(keep)));
            }
        }
        later
    }

    /// Once this member's sends are done: moves the old block's pages into the new one
    /// (`landing`, whose mapping starts its bytes at the phase given with the old
    /// block): the own overlap's (`own`) with their bytes, then the rest under the
    /// ranges of the segments held back (`held`, one per source). A send is done once
    /// the transport has queued it, so the transport may still hold parts of the old
    /// block until the peers read them, which they do whatever this member does: it
    /// waits for that, up to [`SENT_WAIT`]; if the transport still holds the block then,
    /// the own overlap is copied and the segments get fresh pages. Returns the ranges of
    /// the new block's mapping that hold moved pages. Used by the collective too.
    pub(super) async fn recycle_sent(
        &self,
        in_place: Option<(Arc<Aligned>, usize)>,
        own: Option<Own>,
        landing: &Arc<Landing>,
        held: &[Range<usize>],
    ) -> Result<Vec<Range<usize>>> {
        let Some((shared, phase)) = in_place.filter(|_| own.is_some() || !held.is_empty()) else {
            return Ok(Vec::new());
        };
        if own.as_ref().is_some_and(|(part, range, from)| range.len() != from.len() || part.len() != range.len()) {
            return Err(plan_error("own overlap of different sizes"));
        }
        let mut old = match reclaim(shared, SENT_WAIT).await {
            Ok(old) => old,
            Err(shared) => {
                tracing::debug!("fresh pages: the transport still holds the old block");
                if let Some((mut part, _, from)) = own {
                    crate::block::fill(part.as_mut_slice(), &shared.bytes()[from]);
                }
                return Ok(Vec::new());
            }
        };
        let mut spare = old.pages().map_or_else(Vec::new, |p| spare_pages(p, own.as_ref().map(|(_, _, from)| from)));
        let mut moved = Vec::new();
        if let Some((mut part, range, from)) = own {
            let (mappings, refused) = move_own(&mut old, &mut part, (&range, phase), from.start)?;
            moved.extend(mappings);
            if refused {
                spare.clear();
            }
        }
        let Some(pages) = old.pages_mut() else { return Ok(moved) };
        for range in held {
            let inner = crate::anon::inner(phase, range);
            if inner.is_empty() {
                continue;
            }
            let mut part = landing
                .part(inner.start - phase..inner.end - phase)
                .ok_or_else(|| plan_error("overlapping segments"))?;
            let pieces = recycle_into(part.as_mut_slice(), pages, &mut spare)?;
            moved.extend(pieces.into_iter().map(|r| inner.start + r.start..inner.start + r.end));
        }
        Ok(moved)
    }
}
