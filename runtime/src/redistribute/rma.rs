//! The one-sided executor ([`super::Method::Rma`]): targets read their overlaps from
//! the sources' windows, hand pages over where peers share memory ([`crate::pages`])
//! and recycle the old block's pages where the transport lets go of it
//! ([`crate::anon`]); see the parent module's docs.

use super::*;

impl Move<'_> {
    pub(super) async fn rma(&self, old: Bytes, pages: Option<Arc<Aligned>>, new: Option<&mut Aligned>) -> Result<()> {
        let (t, me) = (self.t, self.t.rank());
        let remote: Vec<(usize, Range<usize>)> = self.sends().into_iter().filter(|(k, _)| *k != me).collect();
        let window = if remote.is_empty() { None } else { Some(t.expose(old.clone())?) };
        // Over a transport that serves one read of an owner at a time anyway, the
        // targets of a source take turns (unpaced: a paced move reads one segment at a
        // time already). Both sides know: the share and the transport are the job's.
        let in_turn = !Pacer::new(self.share).paced() && t.serial_reads();
        // Whole pages are handed over in a blocking move whose source's block lives in
        // files (see `crate::pages`). Not in turns: readers that cannot copy a peer's
        // memory themselves (no ptrace rights) cannot open its files either.
        let hand_over = !Pacer::new(self.share).paced() && !in_turn;
        let offer = if hand_over { Offer::of(&self.old_runs) } else { None };
        let announcement = announcement(window, offer.as_ref())?;
        // The old block's pages are recycled into the new block in the same blocking
        // moves, when both blocks are mappings of their own (see `crate::anon`).
        let recycle =
            pages.filter(|p| hand_over && p.pages().is_some() && new.as_ref().is_some_and(|b| b.pages().is_some()));
        let (served, served_rx) = oneshot::channel();
        let serve = async {
            let took = self.rma_serve(&remote, &announcement, in_turn).await?;
            if let Some(w) = window {
                t.withdraw(w)?;
            }
            let _ = served.send(());
            Ok(took)
        };
        let read = self.rma_read(old, recycle.map(|p| (p, served_rx)), new, in_turn, hand_over, offer.is_some());
        let (took, own_took) = try_join(serve, read).await?;
        self.punch_untaken(&took, own_took);
        Ok(())
    }

    /// A source's side of [`Move::rma`]: announces its window (and pages) to each
    /// target, then waits until each has read; in turns, one target after the other.
    /// Returns the targets whose notice says they took their pages over.
    async fn rma_serve(
        &self,
        remote: &[(usize, Range<usize>)],
        announcement: &Bytes,
        in_turn: bool,
    ) -> Result<Vec<usize>> {
        let t = self.t;
        let mut took = Vec::new();
        if in_turn {
            for (k, _) in remote {
                t.send_tagged(*k, self.tag, announcement.clone()).await?;
                t.recv_tagged(Some(*k), TagMatch::Tag(self.done_tag)).await?;
            }
            return Ok::<_, Error>(took);
        }
        let announce = remote.iter().map(|(k, _)| t.send_tagged(*k, self.tag, announcement.clone()));
        try_join_all(announce).await?;
        let drained = remote.iter().map(|(k, _)| t.recv_tagged(Some(*k), TagMatch::Tag(self.done_tag)));
        for ((k, _), (b, _)) in remote.iter().zip(try_join_all(drained).await?) {
            if b.first() == Some(&TOOK_PAGES) {
                took.push(*k);
            }
        }
        Ok(took)
    }

    /// A target's side of [`Move::rma`]: reads (or takes the pages of) every overlap of
    /// its new block, copies its own overlap from `old`, and tells each source it is
    /// done. With `recycle` (the old block, and the signal that its readers are done),
    /// the old block's pages are moved into the new block once its readers are done:
    /// its own overlap's with their bytes, the others under overlaps from members that
    /// leave or come before it, which are read into them then
    /// ([`Move::recycled_reads`]). Returns whether it took its own overlap's pages.
    async fn rma_read(
        &self,
        old: Bytes,
        recycle: Option<(Arc<Aligned>, oneshot::Receiver<()>)>,
        new: Option<&mut Aligned>,
        in_turn: bool,
        hand_over: bool,
        own_offered: bool,
    ) -> Result<bool> {
        let (t, me) = (self.t, self.t.rank());
        let (Some(plan), Some(block)) = (self.drain(), new) else { return Ok(false) };
        let mut pacer = Pacer::new(self.share);
        let phase = block.pages().map(Anon::phase).filter(|_| recycle.is_some());
        let (mapped, own_file) = (hand_over && block.is_mapped(), block.own_file());
        // Gets write straight into the new block, each segment into its own part.
        let landing = std::mem::take(block).into_landing();
        let overlaps = self.overlaps(&plan);
        let own = overlaps.iter().find(|(src, ..)| *src == me).map(|(_, r, at)| (r.clone(), *at));
        let mut reads = Reads {
            landing: &landing,
            // Unpaced, a get reads a source's whole overlap (up to LARGEST_GET): one
            // query to its owner, the backend splits the read as it needs.
            seg_len: if pacer.paced() { SEGMENT } else { LARGEST_GET },
            mapped,
            own_file,
            phase,
            spare: recycle.as_ref().and_then(|(old, _)| old.pages()).map_or(0, |p| spare_bytes(p, own.as_ref())),
            now: Vec::new(),
            deferred: Vec::new(),
            early: Vec::new(),
            adopted: Vec::new(),
        };
        let mut fetches = Vec::new();
        for (src, range, at) in overlaps.into_iter().filter(|(src, ..)| *src != me) {
            if in_turn {
                // Each source is read as soon as its turn comes, whatever the others
                // do (a target that waited for its sources in order could wait for
                // one serving a target that waits for it).
                fetches.push(self.fetch_in_turn(src, reads.in_turn(&range, at)?));
            } else {
                self.announced(&mut reads, src, range, at).await?;
            }
        }
        let (own_parts, own_took, own_later) = self.plan_own(&mut reads, own, own_offered)?;
        let Reads { now, deferred, early, adopted, .. } = reads;
        let late: Vec<(usize, bool)> = deferred.iter().map(|d| (d.src, false)).collect();
        let gets = now.into_iter().map(|(src, id, offset, mut part)| async move {
            self.prepare(&mut part);
            t.get_into(src, id, offset, part).await
        });
        let window = pacer.window(GETS_IN_FLIGHT);
        let remote = async {
            try_join_all(fetches).await?;
            let mut done = stream::iter(gets).buffer_unordered(window);
            while let Some(part) = done.try_next().await? {
                drop(part);
                pacer.segment_done().await;
            }
            self.notify_done(&early).await
        };
        let recycled = async {
            match (recycle, phase) {
                (Some(recycle), Some(phase)) => self.recycled_reads(recycle, phase, own_later, deferred).await,
                _ => Ok(Vec::new()),
            }
        };
        // The own overlap is copied once the first gets are on their way (polled
        // first, they send their requests), while the backend brings their bytes.
        let copy = async {
            for (mut part, from) in own_parts {
                let n = part.len();
                crate::block::fill(part.as_mut_slice(), &old[from..from + n]);
            }
            drop(old);
            Ok(())
        };
        let ((), moved, ()) = try_join3(remote, recycled, copy).await?;
        // Sources with deferred reads are told last: all reads from them are done.
        self.notify_done(&late).await?;
        *block = Aligned::from_landing(landing).ok_or_else(|| plan_error("a get still holds the block"))?;
        block.adopt(adopted);
        block.moved_in(&moved);
        Ok(own_took)
    }

    /// Plans the own overlap (`own`: its range in the new block, where it starts in the
    /// old one). With recycling, it moves with the old block's pages later: its part is
    /// returned for that. Else its whole pages are mapped from this process's own files,
    /// if they are few enough to be offered (see `crate::pages::Offer::of`), and the
    /// rest is returned to copy, with whether pages were taken.
    fn plan_own(
        &self,
        reads: &mut Reads<'_>,
        own: Option<(Range<usize>, usize)>,
        own_offered: bool,
    ) -> Result<(Copies, bool, Option<OwnPart>)> {
        let Some((range, at)) = own else { return Ok((Vec::new(), false, None)) };
        if reads.phase.is_some() {
            return Ok((Vec::new(), false, Some((reads.lend(range.clone())?, range, at))));
        }
        let runs = Some(&self.old_runs[..]).filter(|_| reads.mapped && own_offered);
        let (parts, took) = self.own_overlap(reads.landing, range, at, runs, reads.own_file.as_ref())?;
        let own_took = !took.is_empty();
        reads.adopted.extend(took);
        Ok((parts, own_took, None))
    }

    /// The overlaps of this target's new block: source, byte range of the new block,
    /// and where it starts in the source's block.
    fn overlaps(&self, plan: &DrainPlan) -> Vec<(usize, Range<usize>, usize)> {
        let first = block_range(self.global, self.new_n, self.my_new.unwrap_or(0)).start;
        self.receives(plan)
            .into_iter()
            .map(|(src, range)| {
                let src_first = block_range(self.global, self.old_n, src as u32).start;
                (src, range, self.bytes(first + plan.displs[src] - src_first))
            })
            .collect()
    }

    /// Plans the reads of the overlap `range` (at `at` in the source's block) once
    /// source `src` has announced its window: the whole pages it offers are taken over
    /// where the block lives in files, whole pages go to the deferred reads while
    /// recycled pages last, the rest is read now.
    async fn announced(&self, reads: &mut Reads<'_>, src: usize, range: Range<usize>, at: usize) -> Result<()> {
        let (b, _) = self.t.recv_tagged(Some(src), TagMatch::Tag(self.tag)).await?;
        let (id, offer) = parse_announcement(&b, src)?;
        let runs = offer.filter(|_| reads.mapped).and_then(|o| self.offered_runs(src, &o, &range, &reads.adopted));
        let (mut rest, took) =
            self.take_pages(reads.landing, range.clone(), runs.as_deref(), reads.own_file.as_ref())?;
        // Only overlaps from members that leave or come before this one wait for
        // recycled pages, and a target tells every other source it is done as soon as
        // its own reads are: so a target waits (for its readers) only on targets that
        // come after it, or on none, and no two wait for each other.
        let defer = !self.member_of_new.contains(&src) || src < self.t.rank();
        let mut deferred = false;
        if let (Some(phase), true) = (reads.phase, defer) {
            let (fresh, later) = carve(range.clone(), phase, &mut reads.spare);
            rest = fresh;
            if let Some(piece) = later {
                let offset = (at + piece.start - range.start) as u64;
                let map_at = piece.start + phase;
                reads.deferred.push(Deferred { src, window: id, offset, part: reads.lend(piece)?, map_at });
                deferred = true;
            }
        }
        // A source with a deferred read is told once that is done too.
        if !deferred {
            reads.early.push((src, !took.is_empty()));
        }
        reads.adopted.extend(took);
        for piece in rest {
            for seg in segments(piece.clone(), reads.seg_len) {
                let offset = (at + seg.start - range.start) as u64;
                reads.now.push((src, id, offset, reads.lend(seg)?));
            }
        }
        Ok(())
    }

    /// The recycling half of a target's reads ([`Move::rma_read`]): once this member's
    /// readers are done (`served`) and every reference to its old block is gone, moves
    /// the old block's pages into the new one (whose mapping starts its bytes at
    /// `phase`): those of the own overlap (`own`: its part, its range in the new block,
    /// where it starts in the old one) with their bytes, the rest under the `deferred`
    /// reads, which are then read into them. Without the old block to itself (the
    /// transport still holds a reference after [`RECLAIM_WAIT`]) or where the kernel
    /// refuses a move, bytes are copied and reads go to fresh pages. Returns the ranges
    /// of the new block's mapping that hold moved pages.
    async fn recycled_reads(
        &self,
        (old_block, served): (Arc<Aligned>, oneshot::Receiver<()>),
        phase: usize,
        own: Option<OwnPart>,
        mut deferred: Vec<Deferred>,
    ) -> Result<Vec<Range<usize>>> {
        served.await.map_err(|_| plan_error("the old block's readers were not waited for"))?;
        let mut moved = Vec::new();
        match reclaim(old_block, RECLAIM_WAIT).await {
            Ok(mut old) => {
                let own_at = own.as_ref().map(|(_, range, at)| *at..at + range.len());
                let mut spare = old.pages().map_or_else(Vec::new, |p| spare_pages(p, own_at.as_ref()));
                if let Some((mut part, range, at)) = own {
                    let (mappings, refused) = move_own(&mut old, &mut part, (&range, phase), at)?;
                    moved.extend(mappings);
                    if refused {
                        spare.clear();
                    }
                }
                if let Some(pages) = old.pages_mut() {
                    for d in &mut deferred {
                        let pieces = recycle_into(d.part.as_mut_slice(), pages, &mut spare)?;
                        moved.extend(pieces.into_iter().map(|r| d.map_at + r.start..d.map_at + r.end));
                    }
                }
            }
            Err(shared) => {
                tracing::debug!("copying an own overlap: the transport still holds the old block");
                if let Some((mut part, _, at)) = own {
                    let n = part.len();
                    crate::block::fill(part.as_mut_slice(), &shared.bytes()[at..at + n]);
                }
            }
        }
        let t = self.t;
        let gets = deferred.into_iter().map(|mut d| async move {
            self.prepare(&mut d.part);
            t.get_into(d.src, d.window, d.offset, d.part).await
        });
        drop(try_join_all(gets).await?);
        Ok(moved)
    }

    /// The runs of source `src`'s `offer` over the overlap `range` of the new block,
    /// opened; `None` (the overlap is copied) if its files cannot be opened here or the
    /// block would take pages from more than [`MAX_TAKEN_FILES`] files with those
    /// already `taken`.
    fn offered_runs(&self, src: usize, offer: &Offer, range: &Range<usize>, taken: &[Run]) -> Option<Vec<Run>> {
        let first = block_range(self.global, self.new_n, self.my_new.unwrap_or(0)).start * self.elem;
        let runs = offer
            .open(first + range.start as u64..first + range.end as u64)
            .map_err(|e| tracing::debug!("copying the pages of member {src}: {e}"))
            .ok()?;
        (files_in(taken) + files_in(&runs) <= MAX_TAKEN_FILES).then_some(runs)
    }

    /// Tells each source it was read from that this target is done, and whether it took
    /// its pages over.
    async fn notify_done(&self, sources: &[(usize, bool)]) -> Result<()> {
        let drained = sources.iter().map(|&(k, took)| {
            let notice = if took { Bytes::from_static(&[TOOK_PAGES]) } else { Bytes::new() };
            self.t.send_tagged(k, self.done_tag, notice)
        });
        try_join_all(drained).await?;
        Ok(())
    }

    /// In turns: once source `src` announces its window (its turn), reads `parts`
    /// (offset in the source's block, part) and tells it so; the parts' pages are
    /// populated while the turn is awaited.
    async fn fetch_in_turn(&self, src: usize, mut parts: Vec<(u64, Part)>) -> Result<()> {
        let t = self.t;
        for (_, part) in &mut parts {
            self.prepare(part);
        }
        let (b, _) = t.recv_tagged(Some(src), TagMatch::Tag(self.tag)).await?;
        let (id, _) = parse_announcement(&b, src)?;
        let gets = parts.into_iter().map(|(offset, part)| t.get_into(src, id, offset, part));
        drop(try_join_all(gets).await?);
        t.send_tagged(src, self.done_tag, Bytes::new()).await
    }

    /// The own overlap `range` of the new block (at `at` in the old one): its whole
    /// pages taken from this process's old files `runs`, if given (see
    /// [`Move::take_pages`]). Returns the parts left to copy, each with where it starts
    /// in the old block, and the runs taken.
    fn own_overlap(
        &self,
        landing: &Arc<Landing>,
        range: Range<usize>,
        at: usize,
        runs: Option<&[Run]>,
        own_file: Option<&(Arc<OwnedFd>, u64)>,
    ) -> Result<(Copies, Vec<Run>)> {
        let (rest, took) = self.take_pages(landing, range.clone(), runs, own_file)?;
        let parts = rest
            .into_iter()
            .map(|piece| {
                let part = landing.part(piece.clone()).ok_or_else(|| plan_error("overlapping segments"))?;
                Ok((part, at + piece.start - range.start))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((parts, took))
    }

    /// Frees the pages of the old block that no target took (see [`crate::pages`]): the
    /// files live on as long as any of their pages is mapped (this move's targets', or
    /// others' from earlier moves).
    fn punch_untaken(&self, took: &[usize], own_took: bool) {
        if self.old_runs.is_empty() {
            return;
        }
        let me = self.t.rank();
        let old_first = self.my_old().map_or(0, |o| block_range(self.global, self.old_n, o).start * self.elem);
        let keep: Vec<Range<u64>> = self
            .sends()
            .into_iter()
            .filter(|(k, _)| took.contains(k) || (*k == me && own_took))
            .map(|(_, r)| inner_pages(old_first + r.start as u64..old_first + r.end as u64))
            .collect();
        crate::pages::punch(&self.old_runs, &keep);
    }

    /// Maps the whole pages of the overlap `range` (bytes of the new block, held by
    /// `landing`, a block in files, `own` its own file) from the source's files `runs`,
    /// if they hold them all. Returns the byte ranges left to copy and the runs mapped
    /// (none if the pages were not taken: no runs, runs that miss a page, or a mapping
    /// the kernel refused, after which the block's own file is mapped back).
    fn take_pages(
        &self,
        landing: &Arc<Landing>,
        range: Range<usize>,
        runs: Option<&[Run]>,
        own: Option<&(Arc<OwnedFd>, u64)>,
    ) -> Result<(Vec<Range<usize>>, Vec<Run>)> {
        let first = block_range(self.global, self.new_n, self.my_new.unwrap_or(0)).start * self.elem;
        let inner = inner_pages(first + range.start as u64..first + range.end as u64);
        let Some(runs) = runs.filter(|_| !inner.is_empty()) else { return Ok((vec![range], Vec::new())) };
        let (Some(over), Some((own_fd, origin))) = (crate::pages::covering(runs, inner.clone()), own) else {
            return Ok((vec![range], Vec::new()));
        };
        let local = |g: u64| usize::try_from(g - first).unwrap_or(usize::MAX);
        let mut part =
            landing.part(local(inner.start)..local(inner.end)).ok_or_else(|| plan_error("overlapping segments"))?;
        let within = |r: &Run| local(r.at.start) - local(inner.start)..local(r.at.end) - local(inner.start);
        for (i, r) in over.iter().enumerate() {
            if let Err(e) = crate::pages::map_over(&mut part.as_mut_slice()[within(r)], &r.fd, r.file_off) {
                // The block's own pages back over what was mapped (and over the run that
                // failed, which may have been unmapped), then the overlap is copied.
                tracing::debug!("copying pages the kernel would not map: {e}");
                for r in &over[..=i] {
                    crate::pages::map_over(&mut part.as_mut_slice()[within(r)], own_fd, r.at.start - origin).map_err(
                        |e| {
                            Error::Reconfigure(format!(
                                "cannot map a block's own pages back after a failed handover: {e}"
                            ))
                        },
                    )?;
                }
                return Ok((vec![range], Vec::new()));
            }
        }
        drop(part);
        let rest = [range.start..local(inner.start), local(inner.end)..range.end];
        Ok((rest.into_iter().filter(|r| !r.is_empty()).collect(), over))
    }
}

/// The own overlap's part of the new block, its range there, and where it starts in
/// the old block.
type OwnPart = (Part, Range<usize>, usize);

/// Parts of a new block to copy, each with where it starts in the old block.
type Copies = Vec<(Part, usize)>;

/// A target's "done reading" notice that says it took the source's pages over.
const TOOK_PAGES: u8 = 1;

/// A target's reads, as [`Move::rma_read`] plans them.
struct Reads<'l> {
    /// The new block, lent out in parts.
    landing: &'l Arc<Landing>,
    /// Largest read.
    seg_len: usize,
    /// The new block lives in files, whose pages offered ones may replace.
    mapped: bool,
    /// The new block's own file and the array's byte at its offset 0, if in files.
    own_file: Option<(Arc<OwnedFd>, u64)>,
    /// Where the new block's mapping starts its bytes, if old pages are recycled into it.
    phase: Option<usize>,
    /// Bytes of whole old pages left for deferred reads.
    spare: usize,
    /// Reads to make at once: source, window, offset in the source's block, part.
    now: Vec<(usize, WindowId, u64, Part)>,
    /// Reads that wait for recycled pages.
    deferred: Vec<Deferred>,
    /// Sources to tell once the reads made at once are done, with whether their pages
    /// were taken over.
    early: Vec<(usize, bool)>,
    /// Pages taken over from sources' files.
    adopted: Vec<Run>,
}

impl Reads<'_> {
    fn lend(&self, seg: Range<usize>) -> Result<Part> {
        self.landing.part(seg).ok_or_else(|| plan_error("overlapping segments"))
    }

    /// The parts of the overlap `range` (at `at` in the source's block) for a read in
    /// turn ([`Move::fetch_in_turn`]), each with its offset in the source's block.
    fn in_turn(&self, range: &Range<usize>, at: usize) -> Result<Vec<(u64, Part)>> {
        segments(range.clone(), self.seg_len)
            .map(|seg| Ok(((at + seg.start - range.start) as u64, self.lend(seg)?)))
            .collect()
    }
}

/// Bytes of whole pages of an old block that its own overlap (`own`: range in the new
/// block, start in the old one) does not touch.
fn spare_bytes(old: &Anon, own: Option<&(Range<usize>, usize)>) -> usize {
    let own_at = own.map(|(range, at)| *at..at + range.len());
    spare_pages(old, own_at.as_ref()).iter().map(ExactSizeIterator::len).sum()
}

/// A read that waits for recycled pages ([`Move::recycled_reads`]).
struct Deferred {
    src: usize,
    window: WindowId,
    /// Where it starts in the source's block.
    offset: u64,
    /// Where it lands: whole pages of the new block.
    part: Part,
    /// The part's first byte as an offset into the new block's mapping.
    map_at: usize,
}

/// The pages of an old block's mapping that its own overlap (bytes `own` of the old
/// block) does not touch: those it can give to other overlaps, as mapping offsets.
pub(super) fn spare_pages(old: &Anon, own: Option<&Range<usize>>) -> Vec<Range<usize>> {
    let all = old.mapping();
    let Some(own) = own else { return vec![all] };
    let t = crate::anon::touched(old.phase(), own);
    [all.start..t.start, t.end..all.end].into_iter().filter(|r| !r.is_empty()).collect()
}

/// Splits an overlap (`range` of a new block whose mapping starts its bytes at `phase`)
/// into the pieces read into fresh pages and the whole pages, up to `spare` bytes of
/// them (taken from it), read into recycled ones.
fn carve(range: Range<usize>, phase: usize, spare: &mut usize) -> (Vec<Range<usize>>, Option<Range<usize>>) {
    let inner = crate::anon::inner(phase, &range);
    let k = (*spare).min(inner.len());
    if k == 0 {
        return (vec![range], None);
    }
    *spare -= k;
    let later = inner.end - k - phase..inner.end - phase;
    let fresh = [range.start..later.start, later.end..range.end].into_iter().filter(|r| !r.is_empty()).collect();
    (fresh, Some(later))
}

/// Moves pages of `old` from the front of `spare` (mapping offsets, taken from it)
/// under `dst` (whole pages), as many as there are. Returns the pieces of `dst`
/// (offsets into it) that are kernel mappings of their own now; the rest of `dst`
/// keeps its fresh pages. After a refused move, `spare` is emptied.
///
/// # Errors
/// A refused move left part of `dst` unmapped (see `crate::anon::Hole`).
pub(super) fn recycle_into(dst: &mut [u8], old: &mut Anon, spare: &mut Vec<Range<usize>>) -> Result<Vec<Range<usize>>> {
    let mut mappings = Vec::new();
    let mut done = 0;
    while done < dst.len() {
        let Some(front) = spare.first_mut() else { break };
        let k = front.len().min(dst.len() - done);
        match crate::anon::move_pages(&mut dst[done..done + k], old, front.start) {
            Ok(moved) => mappings.extend(moved.into_iter().map(|r| done + r.start..done + r.end)),
            Err(e) if !e.whole() => return Err(Error::Reconfigure(e.error.to_string())),
            Err(e) => {
                tracing::debug!("fresh pages for a read: the kernel would not move old ones: {}", e.error);
                mappings.extend(e.mappings().into_iter().map(|r| done + r.start..done + r.end));
                spare.clear();
                break;
            }
        }
        front.start += k;
        if front.start == front.end {
            spare.remove(0);
        }
        done += k;
    }
    Ok(mappings)
}

/// A source's announcement to a target: its window's id, then what it offers of its
/// pages, if anything.
fn announcement(w: Option<WindowId>, offer: Option<&Offer>) -> Result<Bytes> {
    let mut b = w.map_or(u32::MAX, |w| w.0).to_le_bytes().to_vec();
    if let Some(o) = offer {
        b.extend(postcard::to_stdvec(o).map_err(Error::Encode)?);
    }
    Ok(Bytes::from(b))
}

fn parse_announcement(b: &[u8], src: usize) -> Result<(WindowId, Option<Offer>)> {
    let (Some(raw), rest) = (b.first_chunk::<4>(), b.get(4..).unwrap_or_default()) else {
        return Err(Error::LengthMismatch { what: "window announcement", expected: 4, got: b.len(), src });
    };
    let offer = if rest.is_empty() {
        None
    } else {
        Some(postcard::from_bytes(rest).map_err(|source| Error::Decode { src, source })?)
    };
    Ok((WindowId(u32::from_le_bytes(*raw)), offer))
}
