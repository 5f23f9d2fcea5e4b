//! Registered application data: what every reconfiguration moves automatically.
//!
//! An application registers **distributed** data (a global array of plain-old-data
//! elements, of which each rank holds its block under the block rule of
//! `ductile-redistrib`) and **replicated** state (a serde value every rank holds, such as
//! the iteration counter). At a change, the old rank 0 hands the registry's manifest and
//! the replicated values to every process of the transition group, and every
//! distributed item is moved from the old blocks to the new ones; a process that joined
//! finds the items under their names.
//!
//! Blocks are stored aligned to a cache line on the heap (and to their element in
//! mappings), so element types of alignment up to 64 (all the integer and float types,
//! `u128`, SIMD vectors and structs of them) can be viewed in place.

use crate::block::{Aligned, Place, Shared};
use crate::error::{Error, Result};
use crate::group::AsyncGroup;
use crate::pages::Run;
use crate::redistribute::{Method, Move};
use bytemuck::Pod;
use bytes::Bytes;
use ductile_redistrib::block_range;
use ductile_transport::Tag;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::sync::Arc;

/// Largest element alignment a distributed item may have: a cache line (heap blocks
/// are aligned so; blocks in mappings start at their global byte offset within a page,
/// a multiple of the element's size and so of its alignment).
pub const MAX_ALIGN: usize = crate::block::LINE;

/// Runtime tags of redistribution messages (one per item index, low 24 bits).
const REGISTRY_TAG: u32 = Tag::RESERVED_BASE | (0x20 << 24);
/// Runtime tags of the one-sided executor's "done reading" notices.
const REGISTRY_DONE_TAG: u32 = Tag::RESERVED_BASE | (0x21 << 24);

/// What the manifest says of one item.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Kind {
    /// `constant`: the application does not change it between changes, so it may move
    /// in the background while the application computes.
    Distributed {
        global: u64,
        elem: u32,
        type_name: String,
        method: Option<Method>,
        constant: bool,
    },
    Replicated {
        value: Vec<u8>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    name: String,
    kind: Kind,
}

/// The registry's description, sent from the old rank 0 to the transition group.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Manifest(Vec<Entry>);

/// The items a process holds.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    entries: Vec<Entry>,
    /// Blocks of the distributed entries, by entry index (empty for replicated ones).
    blocks: Vec<Aligned>,
    /// Old blocks of constant items moving in the background: shared with the moves
    /// (no copy) and still readable by the application, not writable.
    moving: Vec<Option<Bytes>>,
    /// How each distributed entry's data moved at its last change (`None`: not yet).
    moved_by: Vec<Option<Method>>,
    /// The old blocks of a blocking move that keeps them ([`Registry::redistribute`]'s
    /// `keep`), by entry index, with how the entry moved before, until the change is
    /// settled ([`Registry::settle`]) or undone ([`Registry::restore`]).
    kept: Vec<(usize, Bytes, Option<Method>)>,
}

/// New blocks of the constant items a background move produced, by entry index, with
/// the method that moved them.
pub(crate) type Moved = Vec<(usize, Aligned, Method)>;

/// How a distributed item moves and where its blocks live.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct How {
    /// Its own method; `None`: the job's.
    pub method: Option<Method>,
    /// It may move in the background (see [`Kind::Distributed`]).
    pub constant: bool,
    /// Where its blocks live.
    pub place: Place,
}

/// Where a process stands in a change: its old and new part numbers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Parts {
    /// Parts before.
    pub old_n: u32,
    /// Parts after.
    pub new_n: u32,
}

impl Registry {
    fn find(&self, name: &str) -> Result<usize> {
        self.entries
            .iter()
            .position(|e| e.name == name)
            .ok_or_else(|| Error::Invalid(format!("no registered item named {name:?}")))
    }

    /// Refuses to change the set of items while constant items move (their new blocks
    /// are placed by position when the move ends).
    fn settled(&self, what: &str) -> Result<()> {
        if self.moving.iter().any(Option::is_some) {
            return Err(Error::Invalid(format!(
                "cannot {what} while constant items move in the background; wait until the change completes"
            )));
        }
        Ok(())
    }

    fn absent(&self, name: &str) -> Result<()> {
        self.settled(&format!("register {name:?}"))?;
        if self.entries.iter().any(|e| e.name == name) {
            return Err(Error::Invalid(format!("an item named {name:?} is already registered")));
        }
        Ok(())
    }

    pub(crate) fn distribute<T: Pod>(
        &mut self,
        name: &str,
        global: u64,
        part: (u32, u32),
        block: &[T],
        how: How,
    ) -> Result<()> {
        let How { method, constant, place } = how;
        self.absent(name)?;
        let (elem, align) = (std::mem::size_of::<T>(), std::mem::align_of::<T>());
        if elem == 0 || align > MAX_ALIGN {
            return Err(Error::Invalid(format!(
                "{name:?}: element type {} (size {elem}, alignment {align}) cannot be distributed",
                std::any::type_name::<T>()
            )));
        }
        let want = block_range(global, part.1, part.0);
        if block.len() as u64 != want.end - want.start {
            return Err(Error::Invalid(format!(
                "{name:?}: rank {} of {} holds elements {}..{} of {global} ({} elements), but the block given has {}",
                part.0,
                part.1,
                want.start,
                want.end,
                want.end - want.start,
                block.len()
            )));
        }
        self.entries.push(Entry {
            name: name.to_owned(),
            kind: Kind::Distributed {
                global,
                elem: u32::try_from(elem).map_err(|_| Error::Invalid("element too large".into()))?,
                type_name: std::any::type_name::<T>().to_owned(),
                method,
                constant,
            },
        });
        let bytes = bytemuck::cast_slice(block);
        self.blocks.push(Aligned::placed_from(place, bytes, want.start * elem as u64));
        self.moving.push(None);
        self.moved_by.push(None);
        Ok(())
    }

    pub(crate) fn replicate<S: Serialize>(&mut self, name: &str, value: &S) -> Result<()> {
        let value = postcard::to_stdvec(value).map_err(Error::Encode)?;
        match self.entries.iter_mut().find(|e| e.name == name) {
            Some(Entry { kind: Kind::Replicated { value: v }, .. }) => *v = value,
            Some(_) => return Err(Error::Invalid(format!("{name:?} is a distributed item, not replicated state"))),
            None => {
                self.settled(&format!("register {name:?}"))?;
                self.entries.push(Entry { name: name.to_owned(), kind: Kind::Replicated { value } });
                self.blocks.push(Aligned::default());
                self.moving.push(None);
                self.moved_by.push(None);
            }
        }
        Ok(())
    }

    pub(crate) fn replicated<S: DeserializeOwned>(&self, name: &str) -> Result<S> {
        match &self.entries[self.find(name)?].kind {
            Kind::Replicated { value } => {
                postcard::from_bytes(value).map_err(|e| Error::Invalid(format!("{name:?} does not decode: {e}")))
            }
            Kind::Distributed { .. } => Err(Error::Invalid(format!("{name:?} is distributed, not replicated state"))),
        }
    }

    fn typed<T: Pod>(&self, name: &str) -> Result<usize> {
        let i = self.find(name)?;
        match &self.entries[i].kind {
            Kind::Distributed { type_name, .. } if type_name == std::any::type_name::<T>() => Ok(i),
            Kind::Distributed { type_name, .. } => {
                Err(Error::Invalid(format!("{name:?} holds {type_name}, not {}", std::any::type_name::<T>())))
            }
            Kind::Replicated { .. } => Err(Error::Invalid(format!("{name:?} is replicated state, not distributed"))),
        }
    }

    pub(crate) fn block<T: Pod>(&self, name: &str) -> Result<&[T]> {
        let i = self.typed::<T>(name)?;
        let bytes = self.moving[i].as_deref().unwrap_or_else(|| self.blocks[i].bytes());
        if bytes.is_empty() {
            // An empty block has no storage, and its dangling address is aligned to
            // 8 bytes only: an element type aligned to more would not cast.
            return Ok(&[]);
        }
        // Heap blocks start cache-line aligned; blocks in mappings start at the array's byte
        // offset within a page, a multiple of the element's size and so of its alignment.
        bytemuck::try_cast_slice(bytes).map_err(|e| Error::Invalid(format!("{name:?}: {e}")))
    }

    pub(crate) fn block_mut<T: Pod>(&mut self, name: &str) -> Result<&mut [T]> {
        let i = self.typed::<T>(name)?;
        if self.moving[i].is_some() {
            return Err(Error::Invalid(format!(
                "{name:?} is constant and moving in the background; it cannot be written until the change completes"
            )));
        }
        let bytes = self.blocks[i].bytes_mut();
        if bytes.is_empty() {
            return Ok(&mut []);
        }
        bytemuck::try_cast_slice_mut(bytes).map_err(|e| Error::Invalid(format!("{name:?}: {e}")))
    }

    /// How distributed item `name`'s data moved at its last change; `None` before its
    /// first.
    pub(crate) fn moved_by(&self, name: &str) -> Result<Option<Method>> {
        let i = self.find(name)?;
        match &self.entries[i].kind {
            Kind::Distributed { .. } => Ok(self.moved_by[i]),
            Kind::Replicated { .. } => Err(Error::Invalid(format!("{name:?} is replicated state, not distributed"))),
        }
    }

    /// Whether any constant distributed item is registered.
    pub(crate) fn has_constant(&self) -> bool {
        self.entries.iter().any(|e| matches!(e.kind, Kind::Distributed { constant: true, .. }))
    }

    pub(crate) fn global_len(&self, name: &str) -> Result<u64> {
        match &self.entries[self.find(name)?].kind {
            Kind::Distributed { global, .. } => Ok(*global),
            Kind::Replicated { .. } => Err(Error::Invalid(format!("{name:?} is replicated state, not distributed"))),
        }
    }

    pub(crate) fn unregister(&mut self, name: &str) -> Result<()> {
        let i = self.find(name)?;
        self.settled(&format!("unregister {name:?}"))?;
        self.entries.remove(i);
        self.blocks.remove(i);
        self.moving.remove(i);
        self.moved_by.remove(i);
        Ok(())
    }

    pub(crate) fn manifest(&self) -> Manifest {
        Manifest(self.entries.clone())
    }

    /// Takes the old rank 0's manifest: a process that joined adopts it; one that was
    /// there checks that it registered the same items and takes the replicated values.
    pub(crate) fn adopt(&mut self, m: Manifest, joined: bool) -> Result<()> {
        if joined {
            self.blocks = vec![Aligned::default(); m.0.len()];
            self.moving = vec![None; m.0.len()];
            self.moved_by = vec![None; m.0.len()];
            self.entries = m.0;
            return Ok(());
        }
        self.refresh(m)
    }

    /// Takes the replicated values of the old rank 0's manifest, checking that it
    /// describes the same items; blocks are untouched.
    pub(crate) fn refresh(&mut self, m: Manifest) -> Result<()> {
        let shape = |e: &Entry| match &e.kind {
            Kind::Distributed { global, elem, type_name, method, constant } => {
                let by = method.map_or_else(|| "the job's method".to_string(), |m| m.to_string());
                let c = if *constant { "constant, " } else { "" };
                format!("{}: {global} x {type_name} ({elem} B, {c}moved by {by})", e.name)
            }
            Kind::Replicated { .. } => format!("{}: replicated", e.name),
        };
        let mine: Vec<String> = self.entries.iter().map(shape).collect();
        let root: Vec<String> = m.0.iter().map(shape).collect();
        if mine != root {
            return Err(Error::Reconfigure(format!(
                "registered items differ from rank 0's: here [{}], rank 0 [{}]",
                mine.join(", "),
                root.join(", ")
            )));
        }
        self.entries = m.0;
        Ok(())
    }

    /// Moves the distributed items from the old blocks to the new ones over the
    /// transition group `t`, whose members `0..old_n` are the old ranks in order;
    /// `new_pos[k]` is the new rank of transition member `k`, if it stays. Each item
    /// travels by its own method if it was registered with one, else by `method`.
    /// With `variable_only`, constant items (which moved in the background) are
    /// skipped.
    ///
    /// # Collective
    /// Over the transition group.
    ///
    /// `keep`: the old blocks are kept, whole, until [`Registry::settle`] or
    /// [`Registry::restore`], so that a change a failure interrupts can be undone. They
    /// are then shared with the move as they are and none of their pages is handed over
    /// or recycled (as in a background move); what that costs is the copy of a
    /// member's own overlap.
    pub(crate) async fn redistribute(
        &mut self,
        t: &AsyncGroup,
        parts: Parts,
        new_pos: &[Option<u32>],
        (method, variable_only, keep): (Method, bool, bool),
    ) -> Result<()> {
        let plan = Plan::new(parts, new_pos, t.rank(), None);
        for i in 0..self.entries.len() {
            let Some((global, elem, own)) = self.distributed(i) else { continue };
            if variable_only && matches!(self.entries[i].kind, Kind::Distributed { constant: true, .. }) {
                continue;
            }
            let old = if keep {
                let bytes = Bytes::from_owner(std::mem::take(&mut self.blocks[i]));
                self.kept.push((i, bytes.clone(), self.moved_by[i]));
                Old { bytes, runs: Vec::new(), pages: None }
            } else {
                self.take_old(i)
            };
            let by = own.unwrap_or(method);
            self.blocks[i] = plan.run(t, i, global, elem, by, old).await?;
            self.moved_by[i] = Some(by);
        }
        Ok(())
    }

    /// Whether old blocks are kept for a change that may still be undone.
    #[cfg(test)]
    pub(crate) fn keeps(&self) -> bool {
        !self.kept.is_empty()
    }

    /// The change whose old blocks were kept took place: they go.
    pub(crate) fn settle(&mut self) {
        self.kept.clear();
    }

    /// The change whose old blocks were kept is undone: every item it moved, or began
    /// to move, has its old block back (a copy: the move may still share the kept
    /// bytes) and its new block, whole or not, goes.
    pub(crate) fn restore(&mut self) {
        for (i, old, by) in self.kept.drain(..) {
            self.blocks[i] = Aligned::from_bytes(&old);
            self.moved_by[i] = by;
        }
    }

    /// Item `i`'s block, taken for a move: handed to the transport as it is, without a
    /// copy; the files behind its pages, if any, go to the move as well, and the block
    /// itself if its pages may be recycled.
    fn take_old(&mut self, i: usize) -> Old {
        let runs = self.blocks[i].runs();
        let block = std::mem::take(&mut self.blocks[i]);
        if block.pages().is_some() {
            let shared = Arc::new(block);
            Old { bytes: Bytes::from_owner(Shared(shared.clone())), runs, pages: Some(shared) }
        } else {
            Old { bytes: Bytes::from_owner(block), runs, pages: None }
        }
    }

    /// Moves every distributed item after a failure, by point-to-point: `t` is a group
    /// of the old ranks at their old positions, the failed ones (`lost`, old ranks)
    /// among them but never addressed; the survivors are the new ranks, in order. What
    /// the failed processes held is lost: it is zero in the new blocks, and returned as
    /// (item, global element range) pairs.
    pub(crate) async fn recover(
        &mut self,
        t: &AsyncGroup,
        parts: Parts,
        new_pos: &[Option<u32>],
        lost: &[u32],
    ) -> Result<Vec<(String, Range<u64>)>> {
        let mut plan = Plan::new(parts, new_pos, t.rank(), None);
        plan.lost = lost.to_vec();
        let mut gone = Vec::new();
        for i in 0..self.entries.len() {
            let Some((global, elem, _)) = self.distributed(i) else { continue };
            let old = self.take_old(i);
            self.blocks[i] = plan.run(t, i, global, elem, Method::P2p, old).await?;
            self.moved_by[i] = Some(Method::P2p);
            for &o in lost {
                let r = block_range(global, parts.old_n, o);
                if !r.is_empty() {
                    gone.push((self.entries[i].name.clone(), r));
                }
            }
        }
        Ok(gone)
    }

    /// Starts moving the constant items in the background over `t` (a group of the
    /// transition's members with a context of its own), keeping the processes busy about
    /// `share` of the time: their old blocks stay readable until [`Registry::install`]
    /// takes the new ones. Returns what the task needs.
    pub(crate) fn start_background(
        &mut self,
        t: AsyncGroup,
        parts: Parts,
        new_pos: &[Option<u32>],
        method: Method,
        share: f64,
    ) -> impl std::future::Future<Output = Result<Moved>> + Send + 'static {
        let plan = Plan::new(parts, new_pos, t.rank(), Some(share));
        let mut work = Vec::new();
        for i in 0..self.entries.len() {
            let Some((global, elem, own)) = self.distributed(i) else { continue };
            if !matches!(self.entries[i].kind, Kind::Distributed { constant: true, .. }) {
                continue;
            }
            let old = Bytes::from_owner(std::mem::take(&mut self.blocks[i]));
            self.moving[i] = Some(old.clone());
            // A background move hands no page over (see `crate::pages`) and recycles none
            // (see `crate::anon`).
            work.push((i, global, elem, own.unwrap_or(method), Old { bytes: old, runs: Vec::new(), pages: None }));
        }
        async move {
            let mut moved = Vec::with_capacity(work.len());
            for (i, global, elem, method, old) in work {
                moved.push((i, plan.run(&t, i, global, elem, method, old).await?, method));
            }
            Ok(moved)
        }
    }

    /// Installs the new blocks of a finished background move.
    pub(crate) fn install(&mut self, moved: Moved) {
        for (i, block, by) in moved {
            self.blocks[i] = block;
            self.moving[i] = None;
            self.moved_by[i] = Some(by);
        }
    }

    /// Abandons a background move: the constant items keep their old blocks.
    pub(crate) fn abandon_background(&mut self) {
        for i in 0..self.moving.len() {
            if let Some(old) = self.moving[i].take() {
                self.blocks[i] = Aligned::from_bytes(&old);
            }
        }
    }

    fn distributed(&self, i: usize) -> Option<(u64, u64, Option<Method>)> {
        match &self.entries[i].kind {
            Kind::Distributed { global, elem, method, .. } => Some((*global, u64::from(*elem), *method)),
            Kind::Replicated { .. } => None,
        }
    }
}

/// A member's old block as a move takes it.
struct Old {
    /// Its bytes, shared with the transport without a copy.
    bytes: Bytes,
    /// The files behind its pages, if it lives in files (see `crate::pages`).
    runs: Vec<Run>,
    /// The block itself (the owner of `bytes`), if its pages may be recycled (see
    /// `crate::anon`).
    pages: Option<Arc<Aligned>>,
}

/// Where this member stands in a change, for every item's move.
struct Plan {
    parts: Parts,
    /// The share of time a background move may keep busy; `None` for a blocking move.
    share: Option<f64>,
    my_new: Option<u32>,
    /// Transition member of each new rank.
    member_of_new: Vec<usize>,
    /// Old ranks whose blocks are lost (they failed).
    lost: Vec<u32>,
}

impl Plan {
    fn new(parts: Parts, new_pos: &[Option<u32>], me: usize, share: Option<f64>) -> Self {
        let mut member_of_new = vec![0usize; parts.new_n as usize];
        for (k, p) in new_pos.iter().enumerate() {
            if let Some(slot) = p.and_then(|p| member_of_new.get_mut(p as usize)) {
                *slot = k;
            }
        }
        Self { parts, share, my_new: new_pos.get(me).copied().flatten(), member_of_new, lost: Vec::new() }
    }

    /// Moves item `i` from `old` (this member's old block) and returns its new block.
    async fn run(&self, t: &AsyncGroup, i: usize, global: u64, elem: u64, method: Method, old: Old) -> Result<Aligned> {
        let index = i as u32 & 0x00ff_ffff;
        let mv = Move {
            t,
            global,
            elem,
            old_n: self.parts.old_n,
            new_n: self.parts.new_n,
            member_of_new: &self.member_of_new,
            my_new: self.my_new,
            tag: Tag(REGISTRY_TAG | index),
            done_tag: Tag(REGISTRY_DONE_TAG | index),
            share: self.share,
            old_runs: old.runs,
            lost: &self.lost,
        };
        // One-sidedly moved items live where their pages can be handed over, when the
        // transport allows it (see `crate::pages`); items live where their pages can be
        // recycled (see `crate::anon`) when the transport allows that; both at the next
        // move too. Not after a background move, which neither hands over nor recycles:
        // fresh pages of a shared-memory file take twice as long to populate as the
        // heap's (256 MiB: 135 against 70 ms here).
        let place = match method {
            _ if self.share.is_some() => Place::Heap,
            Method::Rma if t.hands_over_pages() => Place::Files,
            _ if t.recycles_pages() => Place::Pages,
            _ => Place::Heap,
        };
        let mut block = self.my_new.map(|n| {
            let r = block_range(global, self.parts.new_n, n);
            let len = usize::try_from((r.end - r.start) * elem).unwrap_or(usize::MAX);
            Aligned::placed(place, len, r.start * elem)
        });
        let moving = mv.run(method, old.bytes, old.pages, block.as_mut());
        if dies_in_move(t.rank()) && global * elem >= DIE_IN_MOVE_BYTES {
            // A thread of its own, so that the abort comes 2 ms in even while the move
            // holds this thread in a long write; and an abort at the move's end if it
            // ended sooner, before this member reports it, so that the change can never
            // complete (a move that ended within one poll used to win the race).
            let rank = t.rank();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(2));
                die_in_move(rank);
            });
            let _ = moving.await;
            die_in_move(rank);
        }
        moving.await?;
        Ok(block.unwrap_or_default())
    }
}

/// Testing knob: the transition member it names aborts 2 ms into its first move of an
/// item of at least [`DIE_IN_MOVE_BYTES`], or at that move's end if sooner (before it
/// reports the move), so that the tests can check that a process dying in the middle
/// of any executor's move fails the job, naming it, instead of hanging.
const DIE_IN_MOVE_ENV: &str = "DUCTILE_TEST_DIE_IN_MOVE";
const DIE_IN_MOVE_BYTES: u64 = 16 << 20;

fn die_in_move(member: usize) -> ! {
    eprintln!("ductile: member {member} aborts in the middle of a move ({DIE_IN_MOVE_ENV})");
    std::process::abort();
}

fn dies_in_move(member: usize) -> bool {
    static DIES: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *DIES.get_or_init(|| std::env::var(DIE_IN_MOVE_ENV).ok()?.parse().ok()) == Some(member)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registering_checks_blocks_types_and_names() {
        let mut r = Registry::default();
        r.distribute::<f64>("u", 10, (1, 3), &[1.0, 2.0, 3.0], How::default()).unwrap();
        assert!(r.distribute::<f64>("v", 10, (1, 3), &[1.0], How::default()).is_err());
        assert!(r.distribute::<f64>("u", 10, (1, 3), &[1.0, 2.0, 3.0], How::default()).is_err());
        assert_eq!(r.block::<f64>("u").unwrap(), &[1.0, 2.0, 3.0]);
        assert!(r.block::<u32>("u").is_err());
        r.block_mut::<f64>("u").unwrap()[0] = 7.0;
        assert_eq!(r.block::<f64>("u").unwrap()[0], 7.0);
        r.replicate("it", &5u64).unwrap();
        r.replicate("it", &6u64).unwrap();
        assert_eq!(r.replicated::<u64>("it").unwrap(), 6);
        assert!(r.replicate("u", &1u8).is_err());
        assert!(r.block::<f64>("it").is_err());
        assert_eq!(r.global_len("u").unwrap(), 10);
        r.unregister("u").unwrap();
        assert!(r.block::<f64>("u").is_err());
    }

    #[test]
    fn elements_aligned_up_to_a_cache_line_are_viewed_in_place_and_beyond_refused() {
        #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
        #[repr(C, align(64))]
        struct Line([f64; 8]);
        #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
        #[repr(C, align(128))]
        struct Wide([u64; 16]);
        let mut r = Registry::default();
        let wide = [u128::MAX - 1, 2, 3];
        r.distribute::<u128>("wide", 6, (1, 2), &wide, How::default()).unwrap();
        assert_eq!(r.block::<u128>("wide").unwrap(), &wide);
        // Large enough to live in mappings (where they may), starting 128 bytes into a
        // page: rank 1 of 2 holds lines 524290.. of 1048580.
        let lines: Vec<Line> = (0..524_290).map(|k| Line([f64::from(k); 8])).collect();
        for place in [Place::Heap, Place::Pages, Place::Files] {
            let name = format!("lines {place:?}");
            r.distribute::<Line>(&name, 1_048_580, (1, 2), &lines, How { place, ..How::default() }).unwrap();
            assert_eq!(r.block::<Line>(&name).unwrap(), &lines, "{place:?}");
            r.block_mut::<Line>(&name).unwrap()[1].0[7] = 9.0;
            assert_eq!(r.block::<Line>(&name).unwrap()[1].0[7], 9.0, "{place:?}");
        }
        let err = r.distribute::<Wide>("too wide", 1, (0, 1), &[Wide([0; 16])], How::default()).unwrap_err();
        assert!(err.to_string().contains("alignment 128"), "{err}");
        // An empty block with no storage (what a move leaves a member that holds
        // nothing afterwards: its address dangles, aligned to 8 bytes only) is viewed
        // as empty, however its element type is aligned.
        for name in ["none here", "none here either"] {
            if name == "none here" {
                r.distribute::<Line>(name, 2, (0, 3), &[], How::default()).unwrap();
            } else {
                r.distribute::<u128>(name, 2, (0, 3), &[], How::default()).unwrap();
            }
            let i = r.find(name).unwrap();
            r.blocks[i] = Aligned::default();
        }
        assert!(r.block::<Line>("none here").unwrap().is_empty());
        assert!(r.block_mut::<Line>("none here").unwrap().is_empty());
        assert!(r.block::<u128>("none here either").unwrap().is_empty());
        assert!(r.block_mut::<u128>("none here either").unwrap().is_empty());
    }

    #[test]
    fn a_source_that_dies_mid_move_fails_its_target_naming_it_by_every_executor() {
        // 3 -> 1 over an in-memory transport, blocking and in the background: member 2
        // closes its endpoint (dies) 5 ms into the move instead of sending; the target's
        // move must fail naming it, well before the group's own timeout, and no member
        // may hang.
        use ductile_transport::mem::MemHub;
        use ductile_transport::{Context, Rank};
        use std::time::{Duration, Instant};
        const N: u64 = 3 << 20;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        // `keep`: a blocking move that keeps the old blocks, which every member gets
        // back, whole, when it fails.
        let modes = [(false, false), (true, false), (false, true)];
        for (method, (background, keep)) in Method::ALL.into_iter().flat_map(|m| modes.map(|x| (m, x))) {
            let members: Vec<Rank> = (0..3).map(Rank).collect();
            let mut eps = MemHub::endpoints(3);
            let dying = eps.pop().unwrap();
            let started = Instant::now();
            let moves: Vec<_> = eps
                .into_iter()
                .enumerate()
                .map(|(r, ep)| {
                    let members = members.clone();
                    rt.spawn(async move {
                        let t = AsyncGroup::new(ep.clone(), Context(7), members, r, Duration::from_secs(60)).unwrap();
                        let mut reg = Registry::default();
                        let block: Vec<u64> = block_range(N, 3, r as u32).collect();
                        let how = How { constant: background, ..How::default() };
                        reg.distribute("x", N, (r as u32, 3), &block, how).unwrap();
                        let (parts, new_pos) = (Parts { old_n: 3, new_n: 1 }, [Some(0), None, None]);
                        let res = if background {
                            reg.start_background(t, parts, &new_pos, method, 1.0).await.map(drop)
                        } else {
                            reg.redistribute(&t, parts, &new_pos, (method, false, keep)).await
                        };
                        if res.is_err() {
                            // As its process would, failing: its peers learn it has gone.
                            ep.transport().close().await;
                        }
                        if keep {
                            assert!(reg.keeps(), "{method}: member {r} kept no block");
                            if res.is_err() {
                                reg.restore();
                                assert_eq!(reg.block::<u64>("x").unwrap(), &block[..], "{method}: member {r}");
                            }
                        }
                        (res, started.elapsed())
                    })
                })
                .collect();
            rt.block_on(async {
                tokio::time::sleep(Duration::from_millis(5)).await;
                dying.transport().close().await;
            });
            let results: Vec<(Result<()>, Duration)> = moves.into_iter().map(|m| rt.block_on(m).unwrap()).collect();
            assert!(
                results[0].0.is_err(),
                "{method} {background} {keep}: the target's move succeeded without member 2's data"
            );
            // The first to notice names it (a member that saw another fail first may
            // name that one, which went too).
            let named = results.iter().any(|(res, _)| res.as_ref().is_err_and(|e| e.to_string().contains("rank 2")));
            assert!(named, "{method} {background}: no member named rank 2: {results:?}");
            for (r, (res, took)) in results.iter().enumerate() {
                // Source 1 may have finished its part, or failed when a peer went; none
                // waited for the group's timeout (60 s), even on a loaded machine.
                assert!(*took < Duration::from_secs(30), "{method} {background}: member {r} took {took:?} ({res:?})");
            }
        }
    }

    #[test]
    fn the_set_of_items_is_fixed_while_constant_items_move() {
        let mut r = Registry::default();
        r.distribute::<u64>("c", 4, (0, 1), &[1, 2, 3, 4], How { constant: true, ..How::default() }).unwrap();
        r.distribute::<u64>("v", 2, (0, 1), &[5, 6], How::default()).unwrap();
        r.replicate("it", &1u32).unwrap();
        r.moving[0] = Some(Bytes::from_owner(std::mem::take(&mut r.blocks[0])));
        assert_eq!(r.block::<u64>("c").unwrap(), &[1, 2, 3, 4]);
        assert!(r.block_mut::<u64>("c").is_err());
        assert!(r.unregister("v").is_err());
        assert!(r.distribute::<u64>("w", 1, (0, 1), &[7], How::default()).is_err());
        assert!(r.replicate("new", &0u8).is_err());
        r.replicate("it", &2u32).unwrap();
        r.block_mut::<u64>("v").unwrap()[0] = 9;
        r.abandon_background();
        assert_eq!(r.block_mut::<u64>("c").unwrap(), &[1, 2, 3, 4]);
        r.unregister("v").unwrap();
    }

    #[test]
    fn adopt_refuses_a_different_registry() {
        let mut root = Registry::default();
        root.distribute::<f64>("u", 4, (0, 1), &[0.0; 4], How::default()).unwrap();
        root.replicate("it", &3u32).unwrap();
        let mut other = Registry::default();
        other.distribute::<f32>("u", 4, (0, 1), &[0.0; 4], How::default()).unwrap();
        other.replicate("it", &0u32).unwrap();
        assert!(matches!(other.adopt(root.manifest(), false), Err(Error::Reconfigure(_))));
        let mut same = Registry::default();
        same.distribute::<f64>("u", 4, (0, 1), &[1.0; 4], How::default()).unwrap();
        same.replicate("it", &0u32).unwrap();
        same.adopt(root.manifest(), false).unwrap();
        assert_eq!(same.replicated::<u32>("it").unwrap(), 3);
        assert_eq!(same.block::<f64>("u").unwrap(), &[1.0; 4]);
        let mut joined = Registry::default();
        joined.adopt(root.manifest(), true).unwrap();
        assert_eq!(joined.replicated::<u32>("it").unwrap(), 3);
    }
}
