//! Operations in flight and how they are posted.
//!
//! Receive buffers live in fixed slots ([`RecvSlots`], part of [`Ops`]). Every other
//! posted operation (send, RMA read, a bulk payload's chunk sent or received) is owned
//! by the [`Ops`]
//! table from before it is posted until its completion is read, keyed by the address of
//! its boxed `fi_context2` (the context libfabric hands back; providers with the
//! `FI_CONTEXT`/`FI_CONTEXT2` modes write into it). Each operation owns the memory the
//! provider touches for it ([`LocalBuf`], or a share of a [`ReadDest`]). A completion
//! whose context is not in the table is ignored, never dereferenced.
//!
//! A post that meets a full queue (`FI_EAGAIN`) waits in a backlog, retried in order by
//! whoever makes progress, and failed once its deadline passes. The order kept is each
//! peer's: a post waits behind the earlier ones to or from the same address only.
//! (Before, one backlog in order for all: over `tcp;ofi_rxm` a send to a peer that had
//! died met `FI_EAGAIN` until its deadline, and every later post waited behind it, the
//! answers to other peers' pings among them, so that live peers took this endpoint for
//! lost.)

use super::mem::{LocalBuf, ReadDest};
use super::{Ep, OfiError, Posted, RecvSlots};
use crate::error::TransportError;
use crate::fabric::sys;
use crate::ids::Rank;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::oneshot;

/// What a send's completion tells its sender.
pub(in crate::fabric) type SendDone = oneshot::Sender<Result<(), TransportError>>;

/// An operation owned by the table.
pub(in crate::fabric) enum Op {
    /// A send of an encoded message to `peer` (if known) at `fi_addr`, with its waiting
    /// sender.
    Send { peer: Option<Rank>, fi_addr: u64, buf: LocalBuf, done: Option<SendDone> },
    /// One chunk of transfer `transfer`, into `dest`: an RMA read, or a tagged receive
    /// of a bulk payload's chunk.
    Read { transfer: u64, dest: Arc<ReadDest> },
    /// One chunk of bulk payload `id` sent to `peer` (see [`super::super::wire::bulk_tag`]);
    /// `data` is kept until the provider is done with it.
    Bulk { peer: Rank, id: u64, data: bytes::Bytes },
}

/// The per-operation context libfabric hands back with a completion (scratch space
/// for providers with the `FI_CONTEXT`/`FI_CONTEXT2` modes).
#[derive(Default)]
struct OpContext(#[allow(dead_code)] sys::fi_context2);

// SAFETY: the pointers inside are the provider's scratch space for an operation in
// flight; the backend never reads them, it only keeps the memory alive and in place.
unsafe impl Send for OpContext {}
// SAFETY: as above.
unsafe impl Sync for OpContext {}

struct Slot {
    /// Kept alive (and at a fixed address) for the provider while the op is in flight.
    ctx: Box<OpContext>,
    op: Op,
}

/// How to post an operation of the table. Only the table makes these, from memory the
/// operation owns.
#[derive(Clone, Copy)]
pub(in crate::fabric) struct Post(Kind);

#[derive(Clone, Copy)]
enum Kind {
    Send { buf: usize, len: usize, desc: usize, dest: u64, tag: u64 },
    Read { buf: usize, len: usize, desc: usize, src: u64, addr: u64, key: u64 },
    Recv { buf: usize, len: usize, desc: usize, tag: u64 },
}

impl Post {
    /// The address the operation goes to or comes from (a receive: none), whose posts
    /// keep their order in the backlog.
    fn peer(&self) -> Option<u64> {
        match self.0 {
            Kind::Send { dest, .. } => Some(dest),
            Kind::Read { src, .. } => Some(src),
            Kind::Recv { .. } => None,
        }
    }
}

struct Waiting {
    ctx: usize,
    post: Post,
    deadline: Instant,
}

/// Contexts kept for reuse: a small message takes one per send that waits for a
/// completion, and a zeroed allocation and its free cost about a tenth of an 8-byte
/// message's time over shm.
const SPARE: usize = 64;

/// The operations in flight, and contexts free for reuse.
#[derive(Default)]
struct Table {
    slots: FxHashMap<usize, Slot>,
    /// Boxed: a context must not move while the provider holds it, and moves with its
    /// box from here to a slot and back.
    #[allow(clippy::vec_box)]
    spare: Vec<Box<OpContext>>,
}

/// The table of operations in flight, the backlog, and the receive slots; see the
/// module docs.
#[derive(Default)]
pub(in crate::fabric) struct Ops {
    /// The posted receive buffers.
    pub(in crate::fabric) recv: RecvSlots,
    table: Mutex<Table>,
    backlog: Mutex<VecDeque<Waiting>>,
    /// Whether the backlog may hold posts: set under its lock when one is queued,
    /// cleared under it when it empties, so polls skip the lock (and the clock) when
    /// nothing waits.
    queued: AtomicBool,
}

pub(in crate::fabric) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section of the backend leaves its data consistent, so a poisoned
    // lock (a panic elsewhere while holding it) is safe to keep using.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Ops {
    /// A table whose receives use `recv`.
    pub(in crate::fabric) fn new(recv: RecvSlots) -> Self {
        Self { recv, ..Self::default() }
    }

    fn insert(&self, op: Op) -> usize {
        let mut table = lock(&self.table);
        // A reused context needs no clearing: the provider treats it as scratch space
        // that it writes before it reads.
        let ctx = table.spare.pop().unwrap_or_default();
        let key = &raw const *ctx as usize;
        table.slots.insert(key, Slot { ctx, op });
        key
    }

    /// Adds a send of `buf` (an encoded message) with `tag` to `fi_addr`.
    pub(in crate::fabric) fn add_send(
        &self,
        peer: Option<Rank>,
        fi_addr: u64,
        tag: u64,
        buf: LocalBuf,
        done: Option<SendDone>,
    ) -> (usize, Post) {
        let (p, len, desc) = buf.raw();
        let post = Post(Kind::Send { buf: p as usize, len, desc: desc as usize, dest: fi_addr, tag });
        (self.insert(Op::Send { peer, fi_addr, buf, done }), post)
    }

    /// Adds a read of `len` bytes into `dest` at `offset`, from `remote` = (source,
    /// address, key); `None` if the range is outside `dest`.
    pub(in crate::fabric) fn add_read(
        &self,
        transfer: u64,
        dest: &Arc<ReadDest>,
        (offset, len): (usize, usize),
        (src, addr, key): (u64, u64, u64),
    ) -> Option<(usize, Post)> {
        let (p, desc) = dest.raw(offset, len)?;
        let post = Post(Kind::Read { buf: p as usize, len, desc: desc as usize, src, addr, key });
        Some((self.insert(Op::Read { transfer, dest: dest.clone() }), post))
    }

    /// Adds a tagged receive of `len` bytes into `dest` at `offset`, matching exactly
    /// `tag`, as a chunk of transfer `transfer`; `None` if the range is outside `dest`.
    pub(in crate::fabric) fn add_recv(
        &self,
        transfer: u64,
        dest: &Arc<ReadDest>,
        (offset, len): (usize, usize),
        tag: u64,
    ) -> Option<(usize, Post)> {
        let (p, desc) = dest.raw(offset, len)?;
        let post = Post(Kind::Recv { buf: p as usize, len, desc: desc as usize, tag });
        Some((self.insert(Op::Read { transfer, dest: dest.clone() }), post))
    }

    /// Adds a tagged send of `data` (a chunk of bulk payload `id`, unregistered: only
    /// for providers without `FI_MR_LOCAL`) with `tag` to `peer` at `fi_addr`.
    pub(in crate::fabric) fn add_bulk_send(
        &self,
        peer: Rank,
        fi_addr: u64,
        tag: u64,
        id: u64,
        data: bytes::Bytes,
    ) -> (usize, Post) {
        let post = Post(Kind::Send { buf: data.as_ptr() as usize, len: data.len(), desc: 0, dest: fi_addr, tag });
        (self.insert(Op::Bulk { peer, id, data }), post)
    }

    /// Cancels the posted chunks of the transfers in `transfers` (their peer is gone):
    /// their completions come as errors. Chunks still in the backlog are left to it.
    pub(in crate::fabric) fn cancel_transfers(&self, ep: &Ep, transfers: &[u64]) {
        if transfers.is_empty() {
            return;
        }
        let table = lock(&self.table);
        for (key, slot) in &table.slots {
            if matches!(&slot.op, Op::Read { transfer, .. } if transfers.contains(transfer)) {
                ep.cancel(*key as *mut c_void);
            }
        }
    }

    /// Takes the operation whose completion carries `ctx`.
    pub(in crate::fabric) fn take(&self, ctx: *mut c_void) -> Option<Op> {
        let mut table = lock(&self.table);
        let slot = table.slots.remove(&(ctx as usize))?;
        if table.spare.len() < SPARE {
            table.spare.push(slot.ctx);
        }
        Some(slot.op)
    }

    /// Posts `post` (of the operation at `ctx`), or queues it behind earlier ones of its
    /// peer until `deadline`. A hard failure removes the operation and returns it with
    /// the error.
    pub(in crate::fabric) fn post(
        &self,
        ep: &Ep,
        ctx: usize,
        post: Post,
        deadline: Instant,
    ) -> Result<(), (Option<Op>, OfiError)> {
        // The caller has just added the operation and not posted it: it is in the table
        // (only a completion, a failed post or a backlog purge takes it out).
        let mut backlog = lock(&self.backlog);
        if backlog.iter().all(|w| w.post.peer() != post.peer()) {
            match self.post_unchecked(ep, ctx, post) {
                Ok(Posted::Yes) => return Ok(()),
                Ok(Posted::Again) => {}
                Err(e) => return Err((self.take(ctx as *mut c_void), e)),
            }
        }
        backlog.push_back(Waiting { ctx, post, deadline });
        self.queued.store(true, Ordering::Release);
        Ok(())
    }

    /// Posts a queued operation, if it is still in the table.
    fn try_post(&self, ep: &Ep, ctx: usize, post: Post) -> Result<Posted, OfiError> {
        if !lock(&self.table).slots.contains_key(&ctx) {
            return Err(OfiError { call: "posting", code: sys::FI_ECANCELED as i32 });
        }
        self.post_unchecked(ep, ctx, post)
    }

    /// Posts an operation known to be in the table and not yet posted.
    fn post_unchecked(&self, ep: &Ep, ctx: usize, Post(post): Post) -> Result<Posted, OfiError> {
        let c = ctx as *mut c_void;
        // SAFETY: a Post is only made by `add_*` from an operation put in the table, and
        // this is called only while that operation is still there and not posted (just
        // added by `post`'s caller, or checked by `try_post`), so not completed: the
        // memory is owned by that operation (its LocalBuf, its bulk chunk's Bytes, or
        // its share of the ReadDest, whose range `add_read`/`add_recv` checked), heap memory that does not move, and `ctx` is
        // the entry's boxed fi_context2. Entries leave the table only when their
        // completion is read, their post fails, or (never posted) their backlog entry is
        // removed with them (deadline passed, peer gone): an operation never leaves the
        // table while its backlog entry remains, which matters because a context that
        // leaves is reused for the next operation (`try_post` would otherwise find that
        // one under the stale key). The table is freed only after the endpoint is closed.
        unsafe {
            match post {
                Kind::Send { buf, len, desc, dest, tag } => {
                    ep.tsend(buf as *const u8, len, desc as *mut c_void, dest, tag, c)
                }
                Kind::Read { buf, len, desc, src, addr, key } => {
                    ep.read(buf as *mut u8, len, desc as *mut c_void, src, addr, key, c)
                }
                Kind::Recv { buf, len, desc, tag } => ep.trecv(buf as *mut u8, len, desc as *mut c_void, tag, c),
            }
        }
    }

    /// Whether posts wait in the backlog (a post now could overtake them).
    pub(in crate::fabric) fn backlogged(&self) -> bool {
        self.queued.load(Ordering::Acquire)
    }

    /// Retries the backlog, each peer's posts in order; fails posts past their deadline.
    /// Returns the operations that failed, with why.
    pub(in crate::fabric) fn retry(&self, ep: &Ep) -> Vec<(Op, String)> {
        let mut failed = Vec::new();
        if !self.queued.load(Ordering::Acquire) {
            return failed;
        }
        let now = Instant::now();
        let mut backlog = lock(&self.backlog);
        // Peers whose first waiting post met a full queue again: theirs wait on.
        let mut blocked: Vec<Option<u64>> = Vec::new();
        let mut i = 0;
        while let Some(w) = backlog.get(i) {
            let (ctx, post, deadline) = (w.ctx, w.post, w.deadline);
            if blocked.contains(&post.peer()) {
                i += 1;
                continue;
            }
            let outcome = match self.try_post(ep, ctx, post) {
                Ok(Posted::Yes) => None,
                Ok(Posted::Again) if now < deadline => {
                    blocked.push(post.peer());
                    i += 1;
                    continue;
                }
                Ok(Posted::Again) => Some("the provider's queue stayed full".to_string()),
                Err(e) => Some(e.to_string()),
            };
            backlog.remove(i);
            if let Some(why) = outcome {
                if let Some(op) = self.take(ctx as *mut c_void) {
                    failed.push((op, why));
                }
            }
        }
        if backlog.is_empty() {
            self.queued.store(false, Ordering::Release);
        }
        failed
    }

    /// Takes the queued (not yet posted) operations to or from `fi_addr` (its peer is
    /// gone).
    pub(in crate::fabric) fn drop_queued_to(&self, fi_addr: u64) -> Vec<Op> {
        let mut backlog = lock(&self.backlog);
        let mut out = Vec::new();
        backlog.retain(|w| match w.post.0 {
            Kind::Send { dest: a, .. } | Kind::Read { src: a, .. } if a == fi_addr => {
                out.extend(self.take(w.ctx as *mut c_void));
                false
            }
            _ => true,
        });
        out
    }

    /// Closes every registration held by operations and receive slots (teardown, before
    /// the endpoint is closed); the memory stays until the table is dropped.
    pub(in crate::fabric) fn drop_registrations(&self) {
        self.recv.drop_registrations();
        for s in lock(&self.table).slots.values_mut() {
            match &mut s.op {
                Op::Send { buf, .. } => buf.unregister(),
                Op::Read { dest, .. } => dest.unregister(),
                Op::Bulk { .. } => {}
            }
        }
    }
}
