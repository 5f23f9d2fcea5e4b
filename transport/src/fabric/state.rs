//! The backend's shared state, its sends, and what happens when a peer ends.

use super::ofi::{lock, Attrs, Ep, Op, Ops, Posted, Registrar, SendDone};
use super::rma::{Leases, Outgoing, Transfers};
use super::session::{Dial, Sessions, To};
use super::stream::{Item, Streams};
use super::wire::{Head, Msg, DATA_HEADER};
use super::NAME;
use crate::auth::Identity;
use crate::config::TransportConfig;
use crate::error::TransportError;
use crate::ids::{Context, Rank, Tag};
use crate::matching::{Envelope, Mailbox, PeerEnd};
use crate::window::{GetTable, WindowTable};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::oneshot;

/// The state of one endpoint, shared by the application's calls and the progress
/// thread. Field order is teardown order (see `Drop`): the endpoint closes before the
/// buffers that operations in flight point into are freed.
pub(super) struct Inner {
    pub(super) me: Identity,
    pub(super) cfg: TransportConfig,
    pub(super) mailbox: Arc<Mailbox>,
    pub(super) attrs: Attrs,
    /// Our endpoint name (what `local_addr` shows and `Hello` carries).
    pub(super) name: Vec<u8>,
    /// Largest encoded message sent eagerly (the size of posted receive buffers).
    pub(super) eager: usize,
    /// Largest single RMA read, or chunk of a bulk payload.
    pub(super) chunk: usize,
    /// How long a waiting thread's poll that found nothing pauses while data is in
    /// flight (zero: none); see [`super::SOCKET_IDLE_PAUSE`].
    pub(super) idle_pause: std::time::Duration,
    /// When a message past the eager size goes as a bulk payload (the provider's own
    /// tagged messages) rather than a rendezvous read; see [`super::Bulk`].
    pub(super) bulk: super::Bulk,
    pub(super) ep: Arc<Ep>,
    /// Registers memory as the provider needs (holds the domain and maybe the endpoint).
    pub(super) registrar: Registrar,
    /// Operations in flight, and the posted receive buffers.
    pub(super) ops: Ops,
    pub(super) transfers: Transfers,
    /// Direct copies of peers' regions over shm, queued (see [`super::direct`]).
    pub(super) direct: super::direct::Direct,
    pub(super) sessions: Mutex<Sessions>,
    /// The sessions' token generation (see [`Sessions::generation`]).
    pub(super) generation: Arc<AtomicU64>,
    /// Unique in the process: names this endpoint in per-thread memory.
    pub(super) id: u64,
    /// Names inserted into the address vector, and their addresses.
    pub(super) names: Mutex<HashMap<Vec<u8>, u64>>,
    pub(super) streams: Mutex<Streams>,
    pub(super) windows: WindowTable,
    pub(super) leases: Mutex<Leases>,
    pub(super) outgoing: Mutex<HashMap<u64, Outgoing>>,
    pub(super) queries: GetTable,
    /// Ids of transfers and rendezvous payloads.
    pub(super) next_id: AtomicU64,
    /// Serialises error-completion reads (their error data lives until the next one).
    pub(super) err_lock: Mutex<()>,
    pub(super) closed: AtomicBool,
    pub(super) shutdown: AtomicBool,
    /// Application threads polling the completion queue themselves (between
    /// `poll_begin` and `poll_end`); the progress thread stands aside meanwhile.
    pub(super) pollers: Pollers,
    /// The progress thread, woken when the last polling thread goes to sleep.
    pub(super) progress_thread: std::sync::OnceLock<std::thread::Thread>,
}

/// The application threads polling the completion queue now, and how many times any
/// began to: one word, so that beginning costs one atomic add, as counting alone did.
/// The progress thread reads the count of beginnings to tell a thread that polls in a
/// tight loop (it comes back to poll every few microseconds) from one that polled once
/// and went to compute (see `super::progress::run`).
#[derive(Default)]
pub(super) struct Pollers(AtomicUsize);

impl Pollers {
    /// Bits of the word that count the threads polling now.
    const BITS: u32 = 16;
    const NOW: usize = (1 << Self::BITS) - 1;

    /// A thread begins to poll.
    pub(super) fn begin(&self) {
        self.0.fetch_add(1 + (1 << Self::BITS), Ordering::AcqRel);
    }

    /// A thread stops polling; true if it was the last.
    pub(super) fn end(&self) -> bool {
        self.0.fetch_sub(1, Ordering::AcqRel) & Self::NOW == 1
    }

    /// Whether any thread polls now.
    pub(super) fn any(&self) -> bool {
        self.0.load(Ordering::Acquire) & Self::NOW != 0
    }

    /// How many times threads began to poll (wrapping).
    pub(super) fn begun(&self) -> usize {
        self.0.load(Ordering::Relaxed) >> Self::BITS
    }
}

impl Inner {
    pub(super) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(super) fn ofi_err(&self, peer: Rank, e: impl std::fmt::Display) -> TransportError {
        TransportError::io(peer, std::io::Error::other(format!("{NAME}: {e}")))
    }

    /// Posts a message to `to` (credited to `peer` if known); `done` hears of its local
    /// completion.
    pub(super) fn post_msg(
        &self,
        peer: Option<Rank>,
        to: To,
        msg: &Msg,
        payload: &[u8],
        done: Option<SendDone>,
    ) -> Result<(), TransportError> {
        let who = peer.unwrap_or(self.me.rank);
        let buf = self.registrar.local(msg.encode(to.token, payload), super::sys::FI_SEND);
        let buf = buf.map_err(|e| self.ofi_err(who, e))?;
        let (ctx, post) = self.ops.add_send(peer, to.fi_addr, super::wire::TAG, buf, done);
        let deadline = Instant::now() + self.cfg.get_connect_timeout();
        self.ops.post(&self.ep, ctx, post, deadline).map_err(|(op, e)| {
            if let Some(Op::Send { done: Some(d), .. }) = op {
                let _ = d.send(Err(self.ofi_err(who, &e)));
            }
            self.ofi_err(who, e)
        })
    }

    /// Injects a small message (data or a rendezvous announcement) when nothing waits in the backlog: no completion
    /// to wait for, which is most of a small message's cost. False if it must be posted
    /// (too large for the provider's inject size, a backlog, or a full queue).
    fn inject_data(&self, dst: Rank, to: To, msg: &Msg, payload: &[u8]) -> Result<bool, TransportError> {
        if self.ops.backlogged() || DATA_HEADER + payload.len() > self.attrs.inject_size {
            return Ok(false);
        }
        SCRATCH.with_borrow_mut(|wire| {
            msg.encode_into(to.token, payload, wire);
            if wire.len() > self.attrs.inject_size {
                return Ok(false);
            }
            match self.ep.tinject(wire, to.fi_addr, super::wire::TAG) {
                Ok(Posted::Yes) => Ok(true),
                Ok(Posted::Again) => Ok(false),
                Err(e) => Err(self.ofi_err(dst, e)),
            }
        })
    }

    /// Sends a control message, logging a failure (the sender does not wait for it).
    pub(super) fn send_ctl(&self, peer: Option<Rank>, to: To, msg: &Msg) {
        if let Err(e) = self.post_msg(peer, to, msg, &[], None) {
            tracing::warn!("{}: cannot send a {:?} message: {e}", self.me.rank, msg.kind());
        }
    }

    /// Sends a control message to a proven peer with a stream, if it still has one.
    pub(super) fn reply(&self, rank: Rank, msg: &Msg) {
        let to = lock(&self.sessions).to(rank);
        match to {
            Some(to) => self.send_ctl(Some(rank), to, msg),
            None => tracing::debug!("{}: no stream to {rank} for a {:?} message", self.me.rank, msg.kind()),
        }
    }

    /// Makes sure a stream to `dst` exists, running the handshake if needed: the
    /// `Hello` must leave within the connect timeout (the provider may have to connect
    /// first), the rest take at most the handshake timeout. A failed dial to a peer
    /// known to have ended fails as lost ([`crate::Mailbox::dial_error`]).
    pub(super) async fn connect(&self, dst: Rank) -> Result<(), TransportError> {
        self.dial(dst).await.map_err(|e| self.mailbox.dial_error(dst, e))
    }

    async fn dial(&self, dst: Rank) -> Result<(), TransportError> {
        let step = lock(&self.sessions).dial(dst, &self.name, Instant::now)?;
        let (connect, handshake) = (self.cfg.get_connect_timeout(), self.cfg.get_handshake_timeout());
        let rx = match step {
            Dial::Ready => return Ok(()),
            Dial::Wait(rx) => rx,
            Dial::Start(fi_addr, hello, rx) => {
                let (tx, sent) = oneshot::channel();
                self.post_msg(Some(dst), To { fi_addr, token: 0 }, &hello, &[], Some(tx))?;
                let _ = self.progress_once();
                match tokio::time::timeout(connect, sent).await {
                    Ok(Ok(Ok(()))) => {}
                    Ok(Ok(Err(e))) => return Err(e),
                    Ok(Err(_)) => return Err(TransportError::Closed),
                    Err(_) => {
                        lock(&self.sessions).abandon_dial(dst, connect);
                        let what = format!("a connection to {dst}");
                        return Err(TransportError::Timeout { what, after: connect });
                    }
                }
                rx
            }
        };
        match tokio::time::timeout(connect + handshake, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(TransportError::Closed),
            Err(_) => {
                lock(&self.sessions).abandon_dial(dst, handshake);
                Err(TransportError::Timeout {
                    what: format!("the authentication handshake with {dst}"),
                    after: handshake,
                })
            }
        }
    }

    /// Sends a tagged message: eagerly if it fits a receive buffer, else by rendezvous
    /// (the payload is registered and the receiver reads it). Completes when the
    /// message (or its announcement) has left.
    pub(super) async fn send(&self, dst: Rank, ctx: Context, tag: Tag, payload: Bytes) -> Result<(), TransportError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        let cap = self.cfg.get_max_payload();
        if payload.len() as u64 > cap {
            return Err(TransportError::MessageTooLarge { peer: dst, len: payload.len(), cap });
        }
        self.connect(dst).await?;
        let eager = DATA_HEADER + payload.len() <= self.eager;
        let bulk = !eager
            && match self.bulk {
                super::Bulk::Never => false,
                super::Bulk::FanOut => self.fanning_out(dst),
                super::Bulk::Always => true,
            };
        let bulk = bulk.then(|| self.next_id());
        // Registering may fail: do it before a sequence number is taken, as a number
        // taken must be sent for the receiver's stream to go on.
        let rendezvous = if eager || bulk.is_some() { None } else { Some(self.offer(dst, &payload)?) };
        let mut wait = None;
        let posted = {
            let mut sessions = lock(&self.sessions);
            let Some((to, head)) = sessions.next_head(dst) else {
                drop(sessions);
                if let Some((id, _)) = rendezvous {
                    lock(&self.outgoing).remove(&id);
                }
                return Err(TransportError::PeerLost(dst));
            };
            let len = payload.len() as u64;
            let msg = match (&rendezvous, bulk) {
                (Some((id, region)), _) => Msg::Rts { head, ctx, tag, len, id: *id, region: region.clone() },
                (None, Some(id)) => Msg::Bulk { head, ctx, tag, len, id, chunk: self.chunk as u64 },
                (None, None) => Msg::Data { head, ctx, tag },
            };
            // The stream's order is the order of posts, so the post happens under the
            // sessions lock that handed out the sequence number.
            match self.inject_data(dst, to, &msg, if eager { &payload } else { &[] }) {
                Ok(true) => Ok(()),
                Ok(false) => {
                    let (tx, rx) = oneshot::channel();
                    wait = Some(rx);
                    self.post_msg(Some(dst), to, &msg, if eager { &payload } else { &[] }, Some(tx))
                }
                Err(e) => Err(e),
            }
            .map(|()| to)
        };
        // A bulk payload's chunks follow their announcement, outside the sessions lock
        // (each has its own tag: their order does not matter).
        let posted = match (posted, bulk) {
            (Ok(to), Some(id)) => self.send_bulk(dst, to, id, &payload),
            (p, _) => p.map(drop),
        };
        if let Err(e) = posted {
            // The stream now has a hole: the peer cannot be talked to in order any more.
            self.peer_ended(dst, PeerEnd::Lost, &e.to_string());
            return Err(e);
        }
        let Some(rx) = wait else { return Ok(()) };
        let _ = self.progress_once();
        rx.await.unwrap_or(Err(TransportError::Closed))
    }

    /// Whether a large message to `dst` would make this endpoint's memory read by more
    /// than one peer at once: another peer still reads (or receives) a payload of ours.
    /// Over shm a bulk payload then goes better than a rendezvous read, whose copy holds
    /// this endpoint's region lock and makes the other readers spin; with one reader
    /// (one-to-one, or many senders to one receiver) the read goes better. Alternating
    /// jobs, 256 MiB over fabric shm, p2p executor, medians of 4: growths 1→4 1.22 →
    /// 2.39, 2→8 1.27 → 1.98 GB/s with every large message as bulk; but shrinks 4→1
    /// 2.40 → 1.99, 8→2 2.20 → 1.96.
    fn fanning_out(&self, dst: Rank) -> bool {
        lock(&self.outgoing).values().any(|o| o.peer != dst)
    }

    /// Sends a small message to a peer with a stream at once, if the provider takes it
    /// without waiting (inject): true if sent. Otherwise nothing was taken, not even a
    /// sequence number, and the caller sends with [`Inner::send`], which also reports
    /// any error.
    pub(super) fn send_at_once(&self, dst: Rank, ctx: Context, tag: Tag, payload: &[u8]) -> bool {
        // The same limits as `send`: a message past the eager size goes by rendezvous (the
        // receivers' buffers hold no more), and one past the inject size cannot leave at
        // once; neither takes the lock.
        let len = DATA_HEADER + payload.len();
        if self.closed.load(Ordering::Acquire)
            || payload.len() as u64 > self.cfg.get_max_payload()
            || len > self.eager
            || len > self.attrs.inject_size
        {
            return false;
        }
        // The post happens under the sessions lock that hands out the sequence number,
        // as in `send`.
        lock(&self.sessions).send_next(dst, |to, head| {
            matches!(self.inject_data(dst, to, &Msg::Data { head, ctx, tag }, payload), Ok(true))
        })
    }

    /// Delivers the in-order items of an arrival from `rank` (`item`: see
    /// [`Streams::arrive`]; `filled`: a rendezvous read completed instead). Delivery
    /// happens under the streams lock, so that two threads reading completions cannot
    /// reorder a stream; a goodbye ends its peer once the lock is released.
    pub(super) fn arrive(&self, rank: Rank, head: Head, item: Option<Item>, filled: bool) {
        self.arrive_locked(lock(&self.streams), rank, head, item, filled);
    }

    /// A data message arrived whole, its payload lent by its receive buffer: delivered
    /// at once if it is the next of its stream with nothing waiting before it (the
    /// common case: no queue, no item to move), into the memory of a receive waiting
    /// for it on this thread if it lent some (see [`Mailbox::deliver_slice`]);
    /// otherwise as [`Inner::arrive`] does.
    pub(super) fn arrive_data(&self, rank: Rank, head: Head, ctx: Context, tag: Tag, payload: &[u8]) {
        let mut streams = lock(&self.streams);
        if streams.take_next(rank, head) {
            // Under the streams lock, as in `arrive`.
            self.mailbox.deliver_slice(rank, ctx, tag, payload);
            return;
        }
        let payload = Bytes::copy_from_slice(payload);
        self.arrive_locked(streams, rank, head, Some(Item::Data { ctx, tag, payload }), false);
    }

    pub(super) fn arrive_locked(
        &self,
        mut streams: std::sync::MutexGuard<'_, Streams>,
        rank: Rank,
        head: Head,
        item: Option<Item>,
        filled: bool,
    ) {
        let ready = if filled {
            Ok(item.map(|i| streams.fill(rank, head, i)).unwrap_or_default())
        } else {
            streams.arrive(rank, head, item)
        };
        let ready = match ready {
            Ok(r) => r,
            Err(e) => {
                drop(streams);
                return self.peer_ended(rank, PeerEnd::Lost, &e);
            }
        };
        let mut ended = None;
        for (rank, item) in ready {
            match item {
                Item::Data { ctx, tag, payload } => self.mailbox.deliver(Envelope { src: rank, ctx, tag, payload }),
                Item::Bye => ended = Some(rank),
                Item::Claimed => {}
            }
        }
        drop(streams);
        if let Some(rank) = ended {
            self.peer_ended(rank, PeerEnd::Closed, "it said goodbye");
        }
    }

    /// A peer said goodbye or was lost: forget it, fail what waits on it.
    pub(super) fn peer_ended(&self, rank: Rank, how: PeerEnd, why: &str) {
        let err = move || match how {
            PeerEnd::Closed => TransportError::PeerClosed(rank),
            PeerEnd::Lost => TransportError::PeerLost(rank),
        };
        let addr = {
            let mut sessions = lock(&self.sessions);
            let addr = sessions.addr_of(rank);
            sessions.forget(rank);
            addr
        };
        if let Some(a) = addr {
            self.forget_address(a, &err);
        }
        let dropped = lock(&self.streams).forget(rank);
        if how == PeerEnd::Lost && !self.shutdown.load(Ordering::Acquire) {
            tracing::error!("{}: {rank} is lost ({why}); {dropped} undelivered messages dropped", self.me.rank);
        } else {
            tracing::debug!("{}: {rank} ended: {why}", self.me.rank);
        }
        self.mailbox.peer_ended(rank, how);
        self.queries.fail_peer(rank, err);
        self.transfers.abandon_peer(rank, err);
        // Bulk chunks it will not send: their receives are cancelled, so that their
        // memory (maybe a receive's own) is given back once their completions come.
        self.ops.cancel_transfers(&self.ep, &self.transfers.bulk_from(rank));
        lock(&self.outgoing).retain(|_, o| o.peer != rank);
        lock(&self.leases).release_peer(rank);
    }

    /// Fails what waits on `fi_addr` without having reached the provider (its peer ended,
    /// or left the job and the address is about to leave the address vector): the dials
    /// to it, and the posts to it still queued behind a full queue, which a retry would
    /// otherwise post to a removed address (over shm, to a peer region no longer mapped:
    /// a crash inside libfabric, seen when a change abandoned for a failure had filled
    /// a dead peer's queue).
    pub(super) fn forget_address(&self, fi_addr: u64, err: &dyn Fn() -> TransportError) {
        lock(&self.sessions).fail_dials_to(fi_addr, None, |_| err());
        for op in self.ops.drop_queued_to(fi_addr) {
            if let Op::Send { done: Some(d), .. } = op {
                let _ = d.send(Err(err()));
            }
        }
    }

    /// See [`crate::Transport::flush`]: waits until no payload of ours is left for a
    /// peer to read (rendezvous payloads, bulk payloads' chunks). A send of a message
    /// otherwise completes when the provider has completed it. Payloads for peers known
    /// to have ended are not waited for. Progress is the progress thread's, or the
    /// polling caller's.
    pub(super) async fn flush(&self) -> Result<(), TransportError> {
        loop {
            if self.closed.load(Ordering::Acquire) {
                return Err(TransportError::Closed);
            }
            if !lock(&self.outgoing).values().any(|o| !self.mailbox.has_ended(o.peer)) {
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    /// Says goodbye to every peer we have a stream to, waits (bounded) for the goodbyes
    /// to leave and for peers to finish reading our rendezvous payloads, then stops.
    pub(super) async fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let byes = lock(&self.sessions).close();
        let mut waits = Vec::new();
        for (rank, to, head) in byes {
            let (tx, rx) = oneshot::channel();
            if self.post_msg(Some(rank), to, &Msg::Bye { head }, &[], Some(tx)).is_ok() {
                waits.push(rx);
            }
        }
        let deadline = tokio::time::Instant::now() + self.cfg.get_handshake_timeout();
        for rx in waits {
            let _ = tokio::time::timeout_at(deadline, rx).await;
        }
        while !lock(&self.outgoing).is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        self.shutdown.store(true, Ordering::Release);
        self.queries.fail_all();
        self.transfers.abandon_all();
        self.direct.clear();
    }
}

thread_local! {
    /// Where a thread encodes the small messages it injects (the provider copies them).
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Endpoints kept open until the process exits, with their posted buffers and the
/// payloads peers may still read; see `Drop`.
static KEPT_OPEN: Mutex<Vec<KeptOpen>> = Mutex::new(Vec::new());

/// An endpoint kept open, what it may write into, and what peers may read of it.
type KeptOpen = (Arc<Ep>, Ops, HashMap<u64, Outgoing>);

impl Drop for Inner {
    fn drop(&mut self) {
        // Registrations go first (FI_MR_ENDPOINT regions hold the endpoint), then the
        // endpoint (by field order), and only then the buffers it may write into.
        self.direct.clear();
        self.ops.drop_registrations();
        self.transfers.drop_registrations(&self.registrar);
        lock(&self.leases).clear();
        let outgoing = std::mem::take(&mut *lock(&self.outgoing));
        if self.attrs.provider == "shm" {
            // libfabric 1.17's shm reaches a peer endpoint of the same process through
            // that endpoint's own mapping of its region, which closing it unmaps: a
            // send from a surviving endpoint of this process would then fault. So an
            // shm endpoint stays open (idle) until the process exits; its region's name
            // is removed now (the mappings stay valid), as closing would have done.
            // Its rendezvous payloads stay too: a peer of this process reading one
            // would otherwise copy freed memory (a peer process reading a dead
            // process's memory gets an error).
            lock(&KEPT_OPEN).push((self.ep.clone(), std::mem::take(&mut self.ops), outgoing));
            if let Some(file) = shm_region_file(&self.name) {
                let _ = std::fs::remove_file(file);
            }
        }
    }
}

/// The file of an shm endpoint's region, from its name (`fi_shm://<file>` and a NUL).
fn shm_region_file(name: &[u8]) -> Option<std::path::PathBuf> {
    let name = std::str::from_utf8(name).ok()?.trim_end_matches('\0');
    let file = name.strip_prefix("fi_shm://")?;
    let plain = !file.is_empty() && !file.contains('/') && file != "." && file != "..";
    plain.then(|| std::path::Path::new("/dev/shm").join(file))
}

#[cfg(test)]
mod tests {
    use super::shm_region_file;

    #[test]
    fn shm_region_files_come_only_from_plain_shm_names() {
        let file = shm_region_file(b"fi_shm://1285:0:3\0").unwrap();
        assert_eq!(file, std::path::Path::new("/dev/shm/1285:0:3"));
        for bad in [&b"fi_shm://../etc\0"[..], b"fi_shm://a/b", b"fi_shm://", b"fi_sockaddr_in://1", b"\xff"] {
            assert_eq!(shm_region_file(bad), None, "{bad:?}");
        }
    }
}
