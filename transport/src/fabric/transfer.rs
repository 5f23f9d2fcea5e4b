//! Reads of remote registered memory: rendezvous messages and gets; and the receives
//! of bulk payloads, which fill their memory the same way.
//!
//! A transfer reads `len` bytes into a fresh buffer, a get's part of the reader's memory,
//! or the part of a receive claimed for a rendezvous message (registered under
//! `FI_MR_LOCAL`), in chunks of at most the provider's message size, and completes
//! explicitly when every chunk's completion has been read. A get first obtains the window's descriptor
//! and a lease from its owner (see [`super::rma`]), checks the range against the
//! window's size itself, reads, and releases the lease. A transfer whose waiter gave up
//! or whose peer is gone keeps its buffer until its chunks complete (or the endpoint
//! closes): the provider may still be writing into it.

use super::direct::Job;
use super::ofi::{lock, Post, ReadDest, ReadMem, Registrar};
use super::rma::{decode_desc, DESC_LEN};
use super::state::Inner;
use super::stream::Item;
use super::wire::{Head, Msg, Region};
use crate::error::TransportError;
use crate::ids::{Context, Rank, Tag};
use crate::landing::Part;
use crate::window::{await_get, GetRequest, Got, WindowError, WindowId};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::oneshot;

/// Most chunks a bulk payload may come in (a sender's chunks are its largest read,
/// 8 MiB or the provider's message size).
const MAX_BULK_CHUNKS: usize = 1 << 16;

/// What a finished transfer is for.
pub(super) enum Purpose {
    /// A rendezvous or bulk message: its place in its stream and the sender's payload
    /// id; `fin`: tell the sender when done (a rendezvous payload's reader does).
    Message { head: Head, ctx: Context, tag: Tag, id: u64, fin: bool },
    /// A get: its waiter, and the lease to release when done.
    Get { done: oneshot::Sender<Result<Got, TransportError>>, lease: u64 },
    /// Nobody waits any more.
    Abandoned,
}

struct Transfer {
    /// Shared with the reads in flight into it.
    dest: Arc<ReadDest>,
    /// A mapped raw key to release (`FI_MR_RAW`).
    mapped: Option<u64>,
    left: usize,
    error: Option<String>,
    peer: Rank,
    /// Filled by tagged receives (a bulk payload): cancelled if its peer ends.
    bulk: bool,
    purpose: Purpose,
}

/// The transfers in flight, by id.
#[derive(Default)]
pub(super) struct Transfers(Mutex<HashMap<u64, Transfer>>, AtomicUsize);

impl Transfers {
    /// True if any transfer is in flight (read without the lock: polling threads ask
    /// after every empty poll).
    pub(super) fn any(&self) -> bool {
        self.1.load(Ordering::Relaxed) > 0
    }

    /// Notes the map's size after a change, under its lock.
    fn counted(&self, map: &HashMap<u64, Transfer>) {
        self.1.store(map.len(), Ordering::Relaxed);
    }

    /// Fails the gets reading from `peer`; their buffers stay until the chunks complete.
    pub(super) fn abandon_peer(&self, peer: Rank, err: impl Fn() -> TransportError) {
        for t in lock(&self.0).values_mut().filter(|t| t.peer == peer) {
            if let Purpose::Get { done, .. } = std::mem::replace(&mut t.purpose, Purpose::Abandoned) {
                let _ = done.send(Err(err()));
            }
        }
    }

    /// The peer transfer `id` reads from, if it is still in flight.
    pub(super) fn peer_of(&self, id: u64) -> Option<Rank> {
        lock(&self.0).get(&id).map(|t| t.peer)
    }

    /// The bulk receives from `peer` still in flight.
    pub(super) fn bulk_from(&self, peer: Rank) -> Vec<u64> {
        lock(&self.0).iter().filter(|(_, t)| t.bulk && t.peer == peer).map(|(id, _)| *id).collect()
    }

    /// Fails every get (the endpoint closes).
    pub(super) fn abandon_all(&self) {
        for t in lock(&self.0).values_mut() {
            t.purpose = Purpose::Abandoned;
        }
    }

    /// Closes registrations and mapped keys (teardown, before the endpoint closes).
    pub(super) fn drop_registrations(&self, registrar: &Registrar) {
        for t in lock(&self.0).values_mut() {
            t.dest.unregister();
            if let Some(k) = t.mapped.take() {
                registrar.unmap(k);
            }
        }
    }
}

impl Inner {
    /// Starts reading `mem.len()` (> 0) bytes at `offset` of `region` at `src` (`peer`)
    /// into `mem`.
    pub(super) fn start_transfer(
        &self,
        peer: Rank,
        src: u64,
        region: &Region,
        offset: u64,
        mem: ReadMem,
        purpose: Purpose,
    ) -> Result<(), String> {
        let len = mem.len();
        let base = region.addr.checked_add(offset).filter(|b| b.checked_add(len as u64).is_some());
        let base = base.ok_or("the range overflows the address space")?;
        let dest = self.registrar.read_dest(mem).map_err(|e| e.to_string())?;
        let (key, mapped) = self.registrar.peer_key(region)?;
        let mapped = mapped.then_some(key);
        let chunks = len.div_ceil(self.chunk);
        if self.direct.copies(&region.owner) {
            // One copy per chunk, queued (see `super::direct`): threads that poll make
            // them, several at once if several poll.
            let t = Transfer { dest: dest.clone(), mapped, left: chunks, error: None, peer, bulk: false, purpose };
            let id = self.next_id();
            let mut transfers = lock(&self.transfers.0);
            transfers.insert(id, t);
            self.transfers.counted(&transfers);
            drop(transfers);
            let (pid, chunk) = (region.owner.pid, self.chunk);
            let jobs: Vec<Job> = (0..chunks)
                .map(|k| {
                    let (off, n) = (k * chunk, chunk.min(len - k * chunk));
                    Job { id, dest: dest.clone(), range: (off, n), pid, addr: base + off as u64, src, key }
                })
                .collect();
            // Our share goes first: the last copy must find the transfer's the last one.
            drop(dest);
            self.direct.push(jobs);
            if chunks > 1 {
                if let Some(t) = self.progress_thread.get() {
                    t.unpark();
                }
            }
            return Ok(());
        }
        let t = Transfer { dest: dest.clone(), mapped, left: chunks, error: None, peer, bulk: false, purpose };
        self.post_chunks(t, dest, (len, self.chunk), "a read", |id, dest, (off, n), _| {
            self.ops.add_read(id, dest, (off, n), (src, base + off as u64, key))
        });
        Ok(())
    }

    /// Reads chunk `(offset, len)` of transfer `id` (queued as a direct copy, which the
    /// kernel refused) with one `fi_read` from `addr` at `src` with `key`.
    pub(super) fn read_instead(
        &self,
        id: u64,
        dest: Arc<ReadDest>,
        (offset, len): (usize, usize),
        (src, addr, key): (u64, u64, u64),
    ) {
        let transfers = lock(&self.transfers.0);
        if !transfers.contains_key(&id) {
            return;
        }
        // The chunk still counts as one: its copy becomes this read. Chunks of copies
        // are no larger than a read.
        self.post_locked(transfers, id, dest, (len, len), "a read", |id, dest, (_, n), _| {
            self.ops.add_read(id, dest, (offset, n), (src, addr, key))
        });
    }

    /// Registers transfer `t` into `dest` (`len` bytes in chunks of `chunk`) and posts
    /// one operation per chunk, made by `add(transfer, dest, (offset, length), index)`;
    /// a chunk that cannot be posted (nor those after it) completes with the error.
    fn post_chunks(
        &self,
        t: Transfer,
        dest: Arc<ReadDest>,
        (len, chunk): (usize, usize),
        what: &str,
        add: impl Fn(u64, &Arc<ReadDest>, (usize, usize), usize) -> Option<(usize, Post)>,
    ) {
        let id = self.next_id();
        // The chunks are posted under the transfers lock, and our share of `dest`
        // dropped before it is released: a chunk that completes meanwhile waits for it,
        // and then finds the transfer holding the last share once all chunks are done.
        let mut transfers = lock(&self.transfers.0);
        transfers.insert(id, t);
        self.transfers.counted(&transfers);
        self.post_locked(transfers, id, dest, (len, chunk), what, add);
    }

    /// Posts the chunks of transfer `id` (registered, with as many left), holding the
    /// transfers lock; see [`Inner::post_chunks`].
    fn post_locked(
        &self,
        transfers: MutexGuard<'_, HashMap<u64, Transfer>>,
        id: u64,
        dest: Arc<ReadDest>,
        (len, chunk): (usize, usize),
        what: &str,
        add: impl Fn(u64, &Arc<ReadDest>, (usize, usize), usize) -> Option<(usize, Post)>,
    ) {
        let chunks = len.div_ceil(chunk);
        let deadline = Instant::now() + self.cfg.get_connect_timeout();
        let mut failed = None;
        for k in 0..chunks {
            let off = k * chunk;
            let n = chunk.min(len - off);
            let posted = match add(id, &dest, (off, n), k) {
                Some((ctx, post)) => self.ops.post(&self.ep, ctx, post, deadline).map_err(|(_, e)| e.to_string()),
                None => Err(format!("{what} outside its buffer")),
            };
            if let Err(e) = posted {
                failed = Some((chunks - k, e));
                break;
            }
        }
        drop(dest);
        drop(transfers);
        if let Some((unposted, e)) = failed {
            for _ in 0..unposted {
                self.chunk_done(id, Err(e.clone()));
            }
        }
    }

    /// Receives bulk payload `id` of `peer` (sent with session `token` in chunks of
    /// `chunk` bytes) into `mem`: one exact tagged receive per chunk, posted as reads
    /// are, and completed the same way.
    pub(super) fn start_bulk(
        &self,
        peer: Rank,
        (token, id, chunk): (u64, u64, u64),
        mem: ReadMem,
        purpose: Purpose,
    ) -> Result<(), String> {
        let len = mem.len();
        // The sender's chunk size decides how many receives are posted: a peer cannot
        // make this endpoint post more than MAX_BULK_CHUNKS for one message.
        let chunk = usize::try_from(chunk).ok().filter(|c| *c > 0).ok_or("a bulk chunk of 0 bytes")?;
        let chunks = len.div_ceil(chunk);
        if chunks > MAX_BULK_CHUNKS {
            return Err(format!("a bulk payload of {len} bytes in {chunks} chunks (at most {MAX_BULK_CHUNKS})"));
        }
        let dest = self.registrar.read_dest(mem).map_err(|e| e.to_string())?;
        let t = Transfer { dest: dest.clone(), mapped: None, left: chunks, error: None, peer, bulk: true, purpose };
        self.post_chunks(t, dest, (len, chunk), "a receive", |tid, dest, (off, n), k| {
            self.ops.add_recv(tid, dest, (off, n), super::wire::bulk_tag(token, id, k as u64))
        });
        Ok(())
    }

    /// One chunk of transfer `id` completed.
    pub(super) fn chunk_done(&self, id: u64, result: Result<(), String>) {
        let t = {
            let mut ts = lock(&self.transfers.0);
            let Some(t) = ts.get_mut(&id) else { return };
            if let Err(e) = result {
                t.error.get_or_insert(e);
            }
            t.left = t.left.saturating_sub(1);
            if t.left > 0 {
                return;
            }
            let t = ts.remove(&id);
            self.transfers.counted(&ts);
            match t {
                Some(t) => t,
                None => return,
            }
        };
        let Transfer { dest, mapped, mut error, peer, purpose, .. } = t;
        if let Some(k) = mapped {
            self.registrar.unmap(k);
        }
        // Every read into `dest` is done: the completions of all its chunks were read.
        let (got, claim) = match ReadDest::take(dest) {
            // SAFETY: no error, so every chunk's read completed successfully, and the
            // chunks cover the whole buffer (an unposted chunk counts as an error).
            Some(ReadMem::New(b)) if error.is_none() => (Got::Bytes(Bytes::from(unsafe { ReadMem::filled(b) })), None),
            // Failed: its bytes are never looked at.
            Some(ReadMem::New(_)) => (Got::Bytes(Bytes::new()), None),
            Some(ReadMem::Part(p)) => (Got::Landed(p), None),
            Some(ReadMem::Claim(c)) => (Got::Bytes(Bytes::new()), Some(c)),
            None => {
                error.get_or_insert_with(|| "a read buffer still in use".into());
                (Got::Bytes(Bytes::new()), None)
            }
        };
        match (purpose, error) {
            (Purpose::Message { head, ctx, tag, id, fin }, None) => {
                if fin {
                    self.reply(peer, &Msg::Fin { id });
                }
                let item = match (claim, got) {
                    // The receive gets the message now; the stream only notes its place
                    // (it was next in its stream when claimed).
                    (Some(c), _) => {
                        self.mailbox.complete_claim(c);
                        Item::Claimed
                    }
                    (None, Got::Bytes(payload)) => Item::Data { ctx, tag, payload },
                    // Messages are read into new buffers or claims.
                    (None, Got::Landed(p)) => Item::Data { ctx, tag, payload: Bytes::copy_from_slice(p.as_slice()) },
                };
                self.arrive(peer, head, Some(item), true);
            }
            (Purpose::Message { .. }, Some(e)) => {
                let why = format!("reading a rendezvous message failed: {e}");
                self.peer_ended(peer, crate::matching::PeerEnd::Lost, &why);
            }
            (Purpose::Get { done, lease }, error) => {
                self.reply(peer, &Msg::Release { req: lease });
                let result = match error {
                    None => Ok(got),
                    Some(e) => {
                        // The part goes back to its landing before the caller hears.
                        drop(got);
                        Err(TransportError::Window { peer, what: format!("the read failed: {e}") })
                    }
                };
                let _ = done.send(result);
            }
            (Purpose::Abandoned, _) => {}
        }
    }

    /// Reads a range of `dst`'s window `id` into a new buffer; see the module docs.
    pub(super) async fn get(&self, dst: Rank, id: WindowId, offset: u64, len: u64) -> Result<Bytes, TransportError> {
        Ok(self.get_with(dst, id, offset, len, None).await?.into_bytes())
    }

    /// Reads a range of `dst`'s window `id` straight into `into`.
    pub(super) async fn get_into(
        &self,
        dst: Rank,
        id: WindowId,
        offset: u64,
        into: Part,
    ) -> Result<Part, TransportError> {
        let len = into.len() as u64;
        self.get_with(dst, id, offset, len, Some(into)).await?.into_part()
    }

    /// A get of `len` bytes, into `into` (of that length) if given.
    async fn get_with(
        &self,
        dst: Rank,
        id: WindowId,
        offset: u64,
        len: u64,
        into: Option<Part>,
    ) -> Result<Got, TransportError> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        let refused = |e: WindowError| TransportError::Window { peer: dst, what: e.to_string() };
        if dst == self.me.rank {
            return self
                .windows
                .read(GetRequest { window: id, offset, len })
                .map(|b| Got::new(into, b))
                .map_err(refused);
        }
        let (lease, size, region) = self.query(dst, id).await?;
        let fi_addr = lock(&self.sessions).addr_of(dst).ok_or(TransportError::PeerLost(dst))?;
        let release = || self.reply(dst, &Msg::Release { req: lease });
        if offset.checked_add(len).is_none_or(|end| end > size) {
            release();
            return Err(refused(WindowError::OutOfRange { window: id, offset, len, size }));
        }
        let n = match usize::try_from(len) {
            Ok(0) => {
                release();
                return Ok(Got::new(into, Bytes::new()));
            }
            // A length that fits the window fits the owner's address space, not
            // necessarily ours.
            Err(_) => {
                release();
                return Err(refused(WindowError::TooLarge { len, cap: usize::MAX as u64 }));
            }
            Ok(n) => n,
        };
        let mem = into.map_or_else(|| ReadMem::new_buffer(n), ReadMem::Part);
        let (tx, rx) = oneshot::channel();
        if let Err(e) = self.start_transfer(dst, fi_addr, &region, offset, mem, Purpose::Get { done: tx, lease }) {
            release();
            return Err(TransportError::Window { peer: dst, what: e });
        }
        let _ = self.progress_once();
        rx.await.unwrap_or(Err(TransportError::Closed))
    }

    /// Asks `dst` for window `id`'s descriptor: (lease, size, region).
    async fn query(&self, dst: Rank, id: WindowId) -> Result<(u64, u64, Region), TransportError> {
        // A peer known to have ended is not dialed again (a handshake with a dead
        // process waits for its timeout); and a query started after its end, which
        // failed only those before, fails as they did.
        if self.mailbox.has_ended(dst) {
            return Err(self.mailbox.ended_error(dst));
        }
        self.connect(dst).await?;
        let to = lock(&self.sessions).to(dst).ok_or(TransportError::PeerLost(dst))?;
        let (req, rx) = self.queries.start(dst, DESC_LEN as u64);
        if self.mailbox.has_ended(dst) {
            self.queries.cancel(req);
            return Err(self.mailbox.ended_error(dst));
        }
        let sent = self.post_msg(Some(dst), to, &Msg::Query { req, window: id }, &[], None);
        let raw = await_get(&self.queries, req, rx, std::future::ready(sent)).await?;
        let (size, region) = decode_desc(&raw)
            .ok_or_else(|| TransportError::Window { peer: dst, what: "a malformed window descriptor".into() })?;
        Ok((req, size, region))
    }
}
