//! The redistribution executors: how one distributed item travels from its old blocks
//! to its new ones over the transition group (old ranks ∪ new ranks).
//!
//! Every executor carries out the same plan (`ductile_redistrib::{source_plan,
//! drain_plan}`: which elements each old block gives each new block) and produces the
//! same bytes; they differ in how the bytes travel:
//!
//! - [`Method::P2p`]: each source sends each of its non-empty overlaps to its target, in
//!   segments of at most [`SEGMENT`] bytes, each after the target granted it: a target
//!   keeps at most [`WINDOW`] segments in flight towards it (granted round-robin among
//!   its sources), so what it holds besides its new block stays bounded however many
//!   sources it has and however slowly it is scheduled. Before granting a segment, the
//!   target posts a receive into the segment's place in its new block, so backends that
//!   can read the payload there in place. A process talks only to the processes its
//!   blocks overlap with.
//! - [`Method::Collective`]: an alltoallv over the whole transition group, one round per
//!   segment. A member posts every round's receives into the segments' places, then
//!   tells each member that feeds it so; a source sends a target nothing before that,
//!   so every segment lands in place. In each round every member sends its segments;
//!   where peers share memory, or the move is paced, every member with an old block
//!   also sends every other member with one an empty block when it has no segment for
//!   it, so that they go from round to round together ([`Move::sends_empty`]). A
//!   round's segments are populated while the round before travels. Segments shrink
//!   with the number of old ranks so that one round brings a member at most
//!   [`ROUND_BUDGET`] bytes. Segments a target holds back for recycled pages (below)
//!   travel after the rounds, once the target says so.
//! - [`Method::Rma`]: each source exposes its old block as a window (a local
//!   registration) and tells each of its targets the window's id; each target reads
//!   its overlaps straight into its new block (`get_into`: the backend writes the bytes
//!   in place, no buffer and no copy), at most [`GETS_IN_FLIGHT`] gets at a time, copies
//!   its own overlap while the first gets are under way, then tells the source it is
//!   done ("wait drains"); a source withdraws its window once all its targets are done.
//!   A get reads a whole overlap (one window query to its owner); a paced move reads
//!   [`SEGMENT`]s, pausing after each. Over a transport that serves an owner's reads one
//!   at a time (`Capabilities::serial_reads`: fabric's shm provider), an unpaced move's
//!   targets take turns: a source announces its window to one target after the other,
//!   each once the previous one is done, instead of all of them spinning on the owner's
//!   lock together.
//!   Over a transport whose peers share memory (`Capabilities::shares_memory`: fabric
//!   shm), a blocking move hands whole pages over instead of reading them: the blocks
//!   of such items live in shared-memory files, a source's announcement carries the
//!   files behind its pages, and a target maps the whole pages of its overlap over its
//!   own and reads only the pages at the overlap's ends ([`crate::pages`]).
//!   Over a transport that lets go of a window once its readers have the bytes
//!   (`Capabilities::releases_windows`: tcp), a blocking move recycles pages instead:
//!   the blocks of such items are mappings of their own, and a target that was a
//!   source, once its readers are done, moves its old block's pages into its new block
//!   (`mremap`): its own overlap's with their bytes, the rest under overlaps from
//!   members that leave or come before it, which it reads into them then
//!   ([`crate::anon`]). Only those reads wait so, and a target tells its other sources
//!   that it is done as soon as its other reads are: a target then waits only on
//!   targets that come after it, so no two wait for each other.
//!
//! The new block is allocated once at its final size and lent to the transport in
//! disjoint parts ([`ductile_transport::Landing`]) that gets and receives fill in place;
//! the old block is shared with the transport as `Bytes` without a copy. Each part's
//! pages are populated before it is filled ([`crate::block`]), unless the transport
//! populates them in its own copies (`Capabilities::populates`). Where pages are
//! recycled (`Capabilities::releases_windows`: tcp; fabric shm, where one-sided moves
//! hand pages over instead), every executor instead moves the
//! whole pages of a member's own overlap from its old block into its new one, in a
//! blocking move, once the transport has let go of the old block, and the old block's
//! other pages under the last pieces from members that leave or come before it, which
//! land only then: a one-sided target reads them then (`recycled_reads`), a
//! point-to-point target grants them then (`recycle_sent`, `p2p.rs`), and a collective
//! target tells their sources, in its notice, to hold them back until it says so
//! (`collective.rs`). Over tcp, p2p went from 2.94 to 3.37 GB/s in 4→2 with it, 2.94 to
//! 3.10 in 8→2 and 3.38 to 3.60 in 2→4 (medians of 5 alternating jobs); the collective
//! from 2.95 to 3.74 in 4→2, 2.40 to 2.93 in 8→2 and 2.81 to 2.96 in 4→1 (medians of 7).
//!
//! A move in the background is paced ([`Pacer`]): one segment in flight per target, and
//! a pause after each so that the move keeps the processes busy only a share of the
//! time (`DUCTILE_BACKGROUND_SHARE`), leaving the cores to the computation it overlaps.

use crate::anon::Anon;
use crate::block::Aligned;
use crate::error::{Error, Result};
use crate::group::AsyncGroup;
use crate::pages::{files_in, inner_pages, Offer, Run, MAX_TAKEN_FILES};
use bytes::Bytes;
use ductile_redistrib::{block_range, drain_plan, source_plan, DrainPlan};
use ductile_transport::{Landing, Part, Tag, TagMatch, WindowId};
use futures_util::future::{try_join, try_join3, try_join_all, BoxFuture};
use futures_util::stream::{self, FuturesUnordered, StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::str::FromStr;
use std::sync::Arc;
use tokio::sync::oneshot;

mod collective;
mod p2p;
mod rma;

/// Largest piece of an overlap moved by one message or one get.
pub const SEGMENT: usize = 8 << 20;
/// Gets a target keeps in flight in the one-sided executor.
pub const GETS_IN_FLIGHT: usize = 4;
/// Largest get of the one-sided executor when it is not paced. Gets land in the new
/// block in place, so their size costs no memory; larger gets mean fewer window queries
/// to the owners (one per overlap of up to this size), and the backend splits them as
/// it needs. Bounded so that one get does not hold a tcp connection for long, nor post
/// more than a few reads at once over fabric (8 of 8 MiB).
const LARGEST_GET: usize = 64 << 20;
/// Segments a target keeps in flight towards it in the point-to-point executor.
pub const WINDOW: usize = 4;
/// Most bytes one collective round brings a member. Every segment lands in place, in a
/// receive posted before its sender was told to send, so no round costs memory beyond
/// the incoming block; rounds bound how far members in step get ahead of each other
/// (see [`Move::sends_empty`]). Fewer, larger rounds cost less synchronisation: 16 → 32 MiB took the
/// collective over fabric shm from 1.56 to 1.75 GB/s in 8→2 and from 1.73 to 2.13 in
/// 4→1 (alternating jobs, medians of 4); over tcp the same within the noise.
pub const ROUND_BUDGET: usize = 32 << 20;
/// Smallest collective segment.
const MIN_ROUND_SEGMENT: usize = 1 << 20;
/// Longest pause of a paced background move after one segment, so that a segment
/// slowed by something else (a descheduled source) does not stall the move for long.
const MAX_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

/// How registered data travels at a reconfiguration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Method {
    /// An alltoallv over the union of old and new ranks.
    Collective,
    /// Each source sends its overlaps to its targets.
    #[default]
    P2p,
    /// Targets read their overlaps from windows the sources expose.
    Rma,
}

impl Method {
    /// Every method, in the order `--redistribution` lists them.
    pub const ALL: [Method; 3] = [Method::Collective, Method::P2p, Method::Rma];
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Collective => "collective",
            Self::P2p => "p2p",
            Self::Rma => "rma",
        })
    }
}

impl FromStr for Method {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "collective" => Ok(Self::Collective),
            "p2p" => Ok(Self::P2p),
            "rma" => Ok(Self::Rma),
            _ => Err(format!("unknown redistribution method {s:?} (known: collective, p2p, rma)")),
        }
    }
}

/// One item's move, as every member of the transition group sees it.
pub(crate) struct Move<'a> {
    /// The transition group: members `0..old_n` are the old ranks in order.
    pub t: &'a AsyncGroup,
    /// Elements of the global array.
    pub global: u64,
    /// Bytes per element.
    pub elem: u64,
    /// Parts before and after.
    pub old_n: u32,
    /// Parts after.
    pub new_n: u32,
    /// Transition member holding each new rank.
    pub member_of_new: &'a [usize],
    /// This member's new rank, if it stays.
    pub my_new: Option<u32>,
    /// Runtime tag of this item's data (and window announcements).
    pub tag: Tag,
    /// Runtime tag of this item's "done reading" notices.
    pub done_tag: Tag,
    /// For a move in the background, the share of time it may keep busy (see
    /// [`Pacer`]); `None` moves at full speed.
    pub share: Option<f64>,
    /// The files behind the old block's pages, if it lives in files (see
    /// [`crate::pages`]): a one-sided move may hand them over.
    pub old_runs: Vec<Run>,
    /// Old ranks that failed: their blocks are lost, and what the new blocks would have
    /// drawn from them is zero (point-to-point only; see `Registry::recover`).
    pub lost: &'a [u32],
}

/// Spaces out the segments of a background move: after a segment that took `t` (from
/// the previous one), the member waits `t * (1 - share) / share` before asking for the
/// next, so the move keeps its processes busy about `share` of the time and leaves the
/// rest to the computation it overlaps. Waiting delays the move, not the application:
/// on a node whose cores the application already fills, a move at full speed takes its
/// CPU time from the solver one for one (ω ≈ 3 for 2 → 1 on 2 cores).
struct Pacer {
    share: Option<f64>,
    since: std::time::Instant,
}

impl Pacer {
    fn new(share: Option<f64>) -> Self {
        Self { share: share.filter(|s| *s > 0.0 && *s < 1.0), since: std::time::Instant::now() }
    }

    /// Whether the move is paced.
    fn paced(&self) -> bool {
        self.share.is_some()
    }

    /// How many segments may be in flight: one when pacing (segments already granted
    /// would arrive at full speed, however long the pauses between grants), else
    /// `full`.
    fn window(&self, full: usize) -> usize {
        if self.share.is_some() {
            1
        } else {
            full
        }
    }

    /// A segment is done: wait as the share asks.
    async fn segment_done(&mut self) {
        if let Some(s) = self.share {
            let rest = self.since.elapsed().mul_f64((1.0 - s) / s);
            tokio::time::sleep(rest.min(MAX_PAUSE)).await;
        }
        self.since = std::time::Instant::now();
    }
}

impl Move<'_> {
    /// Populates a part that the transport is about to fill, unless the transport's own
    /// copies do it (`Capabilities::populates`: several threads then fault the pages in
    /// at once, where this would do it ahead of them on one) and the move is not paced.
    /// A paced move populates here, ahead of its copies (which then find the pages
    /// there and leave them): with the copies populating, a background 2→4 collective
    /// over fabric shm slowed the solver by ω 1.45-2.31 (8 jobs), against 1.13-1.23
    /// (4 jobs) populated here, and overlapped a third as many iterations. Why the
    /// pacing holds the one and not the other was not established.
    fn prepare(&self, part: &mut Part) {
        if self.populating() {
            crate::block::populate(part.as_mut_slice());
        }
    }

    /// Whether this move populates the memory the transport fills ([`Move::prepare`]).
    fn populating(&self) -> bool {
        !self.t.populates() || Pacer::new(self.share).paced()
    }

    fn my_old(&self) -> Option<u32> {
        u32::try_from(self.t.rank()).ok().filter(|&r| r < self.old_n)
    }

    fn bytes(&self, n: u64) -> usize {
        usize::try_from(n * self.elem).unwrap_or(usize::MAX)
    }

    /// What this member sends: (target member, byte range of the old block).
    fn sends(&self) -> Vec<(usize, Range<usize>)> {
        let Some(o) = self.my_old() else { return Vec::new() };
        let plan = source_plan(self.global, self.old_n, self.new_n, o);
        plan.targets
            .clone()
            .filter(|&d| plan.counts[d as usize] > 0)
            .map(|d| {
                let (at, n) = (plan.displs[d as usize], plan.counts[d as usize]);
                (self.member_of_new[d as usize], self.bytes(at)..self.bytes(at + n))
            })
            .collect()
    }

    fn drain(&self) -> Option<DrainPlan> {
        self.my_new.map(|n| drain_plan(self.global, self.old_n, self.new_n, n))
    }

    /// The sources (old rank = transition member) this member's new block draws from,
    /// with the byte range of the new block each fills.
    fn receives(&self, plan: &DrainPlan) -> Vec<(usize, Range<usize>)> {
        plan.sources
            .clone()
            .filter(|&s| plan.counts[s as usize] > 0)
            .map(|s| {
                let (at, n) = (plan.displs[s as usize], plan.counts[s as usize]);
                (s as usize, self.bytes(at)..self.bytes(at + n))
            })
            .collect()
    }

    /// Runs the move with `method`, filling `new` (the new block, `None` for a member
    /// that leaves) from `old` (the old block, empty for a member that joined). `pages`
    /// is the old block itself (the owner of `old`) if the move may recycle its pages
    /// ([`crate::anon`]).
    pub(crate) async fn run(
        &self,
        method: Method,
        old: Bytes,
        pages: Option<Arc<Aligned>>,
        new: Option<&mut Aligned>,
    ) -> Result<()> {
        match method {
            Method::P2p => self.p2p(old, pages, new).await,
            Method::Collective => self.collective(old, pages, new).await,
            Method::Rma => self.rma(old, pages, new).await,
        }
    }

    /// The old block and the new block's phase, if the old block's pages can move into
    /// the new block (see [`Move::recycle_sent`]), the own overlap's and, for the
    /// executors that hold segments back for them, the others: both blocks are
    /// mappings of their own, in a blocking move.
    fn in_place(&self, pages: Option<Arc<Aligned>>, new: &Aligned) -> Option<(Arc<Aligned>, usize)> {
        let phase = new.pages().map(Anon::phase).filter(|_| self.share.is_none())?;
        pages.filter(|p| p.pages().is_some()).map(|p| (p, phase))
    }
}

/// How long a one-sided target waits for the transport to drop its last reference to
/// the old block (a reply being written when the last reader's notice came) before it
/// gives up recycling the block's pages.
const RECLAIM_WAIT: std::time::Duration = std::time::Duration::from_millis(20);

/// How long a member whose sends are done waits for the transport to let go of its old
/// block (sends still queued for peers that read them) before it copies its own
/// overlap instead of moving its pages. The peers read what is queued whatever this
/// member does, and the change ends only once they have, so waiting costs the change
/// nothing, unless the transport holds the block for longer: then the segments a
/// point-to-point or collective target held back for the block's pages wait that long
/// too.
const SENT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The old block to itself, once no one else holds it (or back after `limit`).
async fn reclaim(mut shared: Arc<Aligned>, limit: std::time::Duration) -> std::result::Result<Aligned, Arc<Aligned>> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match Arc::try_unwrap(shared) {
            Ok(block) => return Ok(block),
            Err(s) if tokio::time::Instant::now() >= deadline => return Err(s),
            Err(s) => {
                shared = s;
                tokio::time::sleep(std::time::Duration::from_micros(200)).await;
            }
        }
    }
}

/// Moves the whole pages of the own overlap (`range` of the new block, whose mapping
/// starts its bytes at `phase`; at `at` in `old`) from the old block into `part`, which
/// holds `range`, and copies the rest. Returns the ranges of the new block's mapping
/// that are kernel mappings of their own now, and whether the kernel refused a move.
///
/// # Errors
/// A refused move left part of the block unmapped (see `crate::anon::Hole`).
fn move_own(
    old: &mut Aligned,
    part: &mut Part,
    (range, phase): (&Range<usize>, usize),
    at: usize,
) -> Result<(Vec<Range<usize>>, bool)> {
    let n = range.len();
    let inner = crate::anon::inner(phase, range);
    let (lo, hi) =
        if inner.is_empty() { (0, 0) } else { (inner.start - phase - range.start, inner.end - phase - range.start) };
    let (mut mappings, mut done, mut refused) = (Vec::new(), 0, false);
    if let Some(pages) = old.pages_mut().filter(|_| hi > lo) {
        let from = at + lo + pages.phase();
        match crate::anon::move_pages(&mut part.as_mut_slice()[lo..hi], pages, from) {
            Ok(moved) => (mappings, done) = (moved, hi - lo),
            Err(e) if !e.whole() => return Err(Error::Reconfigure(e.error.to_string())),
            Err(e) => {
                tracing::debug!("copying an own overlap: the kernel would not move its pages: {}", e.error);
                done = e.moved.last().map_or(0, |r| r.end);
                (mappings, refused) = (e.mappings(), true);
            }
        }
    }
    let (dst, src) = (part.as_mut_slice(), &old.bytes()[at..at + n]);
    crate::block::fill(&mut dst[..lo], &src[..lo]);
    crate::block::fill(&mut dst[lo + done..], &src[lo + done..]);
    Ok((mappings.into_iter().map(|r| inner.start + r.start..inner.start + r.end).collect(), refused))
}

/// Splits a byte range into pieces of at most `len` bytes (one empty piece for an empty
/// range, so it still travels).
fn segments(r: Range<usize>, len: usize) -> impl Iterator<Item = Range<usize>> {
    let n = (r.end - r.start).div_ceil(len).max(1);
    (0..n).map(move |i| (r.start + i * len)..(r.start + (i + 1) * len).min(r.end))
}

/// The sources of `counts` (source, segments) interleaved: one segment of each in turn.
fn round_robin(counts: &[(usize, usize)]) -> Vec<usize> {
    let most = counts.iter().map(|c| c.1).max().unwrap_or(0);
    (0..most).flat_map(|i| counts.iter().filter(move |c| i < c.1).map(|c| c.0)).collect()
}

fn plan_error(what: &str) -> Error {
    Error::Reconfigure(format!("redistribution plan inconsistent: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap()
    }

    #[test]
    fn a_paced_move_pauses_in_proportion_to_its_work_one_segment_at_a_time() {
        let mut p = Pacer::new(Some(0.5));
        assert_eq!(p.window(WINDOW), 1);
        // 20 ms of work at a share of one half: 20 ms of pause.
        p.since = Instant::now() - Duration::from_millis(20);
        let t = Instant::now();
        rt().block_on(p.segment_done());
        assert!(t.elapsed() >= Duration::from_millis(19), "paused {:?}", t.elapsed());
    }

    #[test]
    fn an_unpaced_move_never_pauses() {
        for share in [None, Some(1.0), Some(0.0)] {
            let mut p = Pacer::new(share);
            assert_eq!(p.window(WINDOW), WINDOW);
            p.since = Instant::now() - Duration::from_secs(60);
            let t = Instant::now();
            rt().block_on(p.segment_done());
            assert!(t.elapsed() < Duration::from_secs(10), "{share:?} paused {:?}", t.elapsed());
        }
    }
}
