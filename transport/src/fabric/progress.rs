//! Progress: reading the completion queue and acting on what arrives.
//!
//! Both providers tested here (and most) make data progress only inside libfabric calls
//! (`FI_PROGRESS_MANUAL`), so a progress thread polls the completion queue: it spins
//! briefly after activity, then sleeps between polls with a growing backoff (up to a
//! millisecond). It does not block in `fi_cq_sread` (see [`super::ofi::Cq::open`]). An
//! application thread waiting for data calls [`crate::transport::Transport::progress`],
//! which reads the queue itself; while it does, the progress thread stands aside. Every
//! [`TICK`] the thread also does the housekeeping: stale handshakes, pings, lost peers,
//! and the backlog of posts that met a full queue.

use super::ofi::{lock, Op};
use super::ofi::{Completion, ReadMem};
use super::session::To;
use super::state::{Inner, Pollers};
use super::stream::Item;
use super::transfer::Purpose;
use super::wire::{Kind, Msg, DATA_HEADER};
use crate::matching::PeerEnd;
use crate::window::decode_refusal;
use bytes::Bytes;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Receive buffers kept posted.
pub(super) const RECV_POSTED: usize = 32;
const _: () = assert!(RECV_POSTED <= super::ofi::MAX_SLOTS, "one bit per receive slot");
/// How often the progress thread does its housekeeping.
const TICK: Duration = Duration::from_millis(100);
/// How long the progress thread sleeps while an application thread polls; an
/// application thread that stops polling to sleep wakes it at once (`poll_end`).
/// Shorter naps cost latency: with 200 µs, the wake-ups of the two ranks' progress
/// threads added 0.15 µs to every 8-byte message over shm (1.47 against 1.32 µs
/// one-way, ping-pong on 2 cores), and over tcp;ofi_rxm occasionally doubled it.
const STAND_ASIDE: Duration = Duration::from_micros(1000);
/// The longest nap while application threads poll in a tight loop (see [`Aside`]).
const STAND_ASIDE_LONGEST: Duration = Duration::from_millis(16);
/// Beginnings of polling during one nap that make a tight loop: one every 4 µs of a
/// first 1 ms nap.
const TIGHT: usize = 256;
/// Empty polls before the progress thread starts to wait.
const SPIN: u32 = 64;
/// Completions read at once (one by a thread whose receive lends memory for a
/// rendezvous payload: see [`Inner::progress_once`]).
const BATCH: usize = 32;

/// How a rendezvous message's payload comes.
enum Fill<'a> {
    /// Read from the sender's registered region.
    Read(&'a super::wire::Region),
    /// Received as the sender's bulk chunks, tagged from its session `token`.
    Bulk { token: u64, chunk: u64 },
}

/// Senders a thread remembers (see [`Inner::sender`]), one entry per token's residue.
const SENDERS: usize = 4;

/// A token a thread looked up: whose it is, as of a generation of the tokens.
struct Remembered {
    /// The endpoint's [`Inner::id`] (a thread may serve several endpoints).
    endpoint: u64,
    token: u64,
    generation: u64,
    rank: crate::ids::Rank,
    fresh: Arc<std::sync::atomic::AtomicBool>,
}

thread_local! {
    static SENDER_CACHE: std::cell::RefCell<[Option<Remembered>; SENDERS]> =
        const { std::cell::RefCell::new([None, None, None, None]) };
}

impl Inner {
    /// Reads what the completion queue has and acts on it, and retries the backlog.
    /// True if anything completed.
    pub(super) fn progress_once(&self) -> bool {
        let mut entries = [std::mem::MaybeUninit::<Completion>::uninit(); BATCH];
        // A thread whose receive lends memory reads one completion at a time, and its
        // wait stops polling once it has its message: a rendezvous announcement behind
        // that message stays in the queue for the next receive, which may take the
        // payload straight into its memory (see `land_in_place`; as tcp's polling
        // thread leaves the next frame in its socket).
        // Only a receive of a message past the eager size (as `Inner::send` decides) can
        // take a rendezvous payload; one of less (as a small message's) reads whole
        // batches, leaving nothing behind.
        let batch = if self.mailbox.lent_here().saturating_add(DATA_HEADER) > self.eager { 1 } else { BATCH };
        let got = match self.ep.cq().read(&mut entries[..batch]) {
            Ok(done) => {
                for c in done {
                    self.completed(c);
                }
                !done.is_empty()
            }
            Err(e) if e.code == super::sys::FI_EAVAIL as i32 => self.read_errors(),
            Err(e) => {
                tracing::error!("{}: reading the completion queue failed: {e}", self.me.rank);
                false
            }
        };
        // Copies the handlers queued, with no lock held (see `super::direct`). The
        // idle checks here are single loads, inline: this is the 8-byte path's poll.
        let got = (self.direct.any() && self.run_direct()) || got;
        // The slots of handled messages are posted again once the queue is found empty
        // (or half of them wait): a thread that received a message goes back to its
        // application first, and after its reply it reads the queue before it posts
        // (posting a receive costs more than reading an empty queue).
        if self.ops.recv.should_post(!got) {
            self.repost();
        }
        if self.ops.backlogged() {
            for (op, why) in self.ops.retry(&self.ep) {
                self.failed(op, why);
            }
        }
        got
    }

    fn read_errors(&self) -> bool {
        let _serial = lock(&self.err_lock);
        let mut any = false;
        while let Some(e) = self.ep.cq().read_err() {
            any = true;
            if let Some(slot) = self.ops.recv.slot_of(e.context) {
                if e.code != super::sys::FI_ECANCELED as i32 {
                    tracing::warn!("{}: a receive failed: {}", self.me.rank, e.text);
                }
                // Posted again by a later poll (not once the endpoint shuts down).
                self.ops.recv.release(slot);
                continue;
            }
            // A cancelled operation failed too: ours (a bulk chunk's receive from a peer
            // that ended, whose transfer counts it done so), or the provider's (rxm
            // cancels the sends to a peer whose connection failed). Before, it was
            // dropped: a send's waiter took it for this endpoint closed (a survivor of
            // a growth whose new process died in the move failed its checkpoint, 1 job
            // of 12 over tcp;ofi_rxm), and a chunk's transfer never completed.
            match self.ops.take(e.context) {
                Some(op) => self.failed(op, e.text),
                None => tracing::warn!("{}: an operation failed: {}", self.me.rank, e.text),
            }
        }
        any
    }

    /// An operation failed (error completion, or its post did).
    fn failed(&self, op: Op, why: String) {
        match op {
            Op::Send { peer, fi_addr, done, .. } => {
                let who = peer.unwrap_or(self.me.rank);
                if let Some(d) = done {
                    let _ = d.send(Err(self.ofi_err(who, &why)));
                }
                lock(&self.sessions).fail_dials_to(fi_addr, peer, |r| self.ofi_err(r, &why));
                match peer {
                    Some(rank) if !self.shutdown.load(Ordering::Acquire) => {
                        self.peer_ended(rank, PeerEnd::Lost, &format!("a send to it failed: {why}"));
                    }
                    _ => tracing::debug!("{}: a send failed: {why}", self.me.rank),
                }
            }
            Op::Read { transfer, dest } => {
                drop(dest);
                self.chunk_done(transfer, Err(why));
            }
            // Its receiver waits for this chunk.
            Op::Bulk { peer, .. } if !self.shutdown.load(Ordering::Acquire) => {
                self.peer_ended(peer, PeerEnd::Lost, &format!("a bulk send to it failed: {why}"));
            }
            Op::Bulk { .. } => tracing::debug!("{}: a bulk send failed: {why}", self.me.rank),
        }
    }

    /// Posts the receive slots that wait (not once the endpoint is shutting down).
    fn repost(&self) {
        if self.shutdown.load(Ordering::Acquire) {
            return;
        }
        if let Err(e) = self.ops.recv.post_unposted(&self.ep) {
            tracing::error!("{}: cannot post a receive buffer (its slot is given up): {e}", self.me.rank);
        }
    }

    fn completed(&self, c: &Completion) {
        if let Some(slot) = self.ops.recv.slot_of(c.op_context) {
            self.ops.recv.with_message(slot, |bytes| self.received(c.tag, &bytes[..c.len.min(bytes.len())]));
            self.ops.recv.release(slot);
            return;
        }
        let Some(op) = self.ops.take(c.op_context) else {
            tracing::warn!("{}: a completion for an unknown operation", self.me.rank);
            return;
        };
        match op {
            Op::Send { done, .. } => {
                if let Some(d) = done {
                    let _ = d.send(Ok(()));
                }
            }
            Op::Read { transfer, dest } => {
                // The transfer takes its buffer back once no read holds it.
                drop(dest);
                self.chunk_done(transfer, Ok(()));
            }
            Op::Bulk { peer, id, data } => {
                drop(data);
                self.bulk_chunk_sent(peer, id);
            }
        }
    }

    /// A message arrived; nothing it contains is trusted before its token names a peer
    /// that proved the job key (see [`super::session`]).
    fn received(&self, tag: u64, body: &[u8]) {
        let me = self.me.rank;
        if tag != super::wire::TAG {
            tracing::debug!("{me}: dropped a message with a foreign tag {tag:#x}");
            return;
        }
        let Some((token, msg)) = Msg::decode(body) else {
            tracing::warn!("{me}: dropped a malformed message");
            return;
        };
        // Only handshakes need the time; data does not read the clock.
        let now = Instant::now;
        match msg.kind() {
            Kind::Hello => self.hello(&msg, now()),
            Kind::Challenge => {
                let proof = lock(&self.sessions).on_challenge(&msg, now());
                if let Some((fi_addr, proof)) = proof {
                    self.send_ctl(None, To { fi_addr, token: 0 }, &proof);
                }
            }
            Kind::Proof => {
                let outcome = lock(&self.sessions).on_proof(&msg, now());
                match outcome {
                    Some(Ok((rank, fi_addr, accept))) => {
                        self.mailbox.peer_connected(rank);
                        self.send_ctl(Some(rank), To { fi_addr, token: 0 }, &accept);
                    }
                    Some(Err((rank, fi_addr, inserted))) => {
                        tracing::error!("{me}: rejected an endpoint claiming {rank}: it failed to prove the job key");
                        self.unuse_if_inserted(fi_addr, inserted);
                    }
                    None => {}
                }
            }
            Kind::Accept => {
                let rank = lock(&self.sessions).on_accept(&msg);
                if let Some(rank) = rank {
                    self.mailbox.peer_connected(rank);
                }
            }
            kind => match self.sender(token) {
                Some(rank) => self.dispatch(rank, token, msg, body),
                None => tracing::warn!("{me}: dropped a {kind:?} message from an unauthenticated endpoint"),
            },
        }
    }

    /// The sender of a message carrying `token`, if the token is one we accept; as
    /// [`super::session::Sessions::hear`], but a thread answers a token it recently
    /// looked up from what it remembers, without the sessions lock, while the tokens
    /// have not changed since (their generation has not moved). (Fabric shm, 8 B
    /// one-way, one build, alternating jobs: 787 ns, against 844 ns with every lookup
    /// under the lock; medians of 20.)
    fn sender(&self, token: u64) -> Option<crate::ids::Rank> {
        // Tokens are MACs: their low bits spread evenly over the entries.
        let i = (token as usize) % SENDERS;
        let generation = self.generation.load(Ordering::Acquire);
        let hit = SENDER_CACHE.with_borrow(|c| match &c[i] {
            Some(e) if e.endpoint == self.id && e.token == token && e.generation == generation => {
                super::session::mark(&e.fresh);
                Some(e.rank)
            }
            _ => None,
        });
        if hit.is_some() {
            return hit;
        }
        let heard = lock(&self.sessions).hear(token)?;
        let rank = heard.rank;
        let entry = Remembered { endpoint: self.id, token, generation: heard.generation, rank, fresh: heard.fresh };
        SENDER_CACHE.with_borrow_mut(|c| c[i] = Some(entry));
        Some(rank)
    }

    fn hello(&self, msg: &Msg, now: Instant) {
        let Msg::Hello { name, rank, .. } = msg else { return };
        // The dialer is answered at the name it sent: a member of our table is found
        // there; a joiner (or an intruder) is inserted, and removed if it fails.
        let (fi_addr, inserted) = {
            let mut names = lock(&self.names);
            match names.get(name.as_slice()) {
                Some(a) => (*a, false),
                None => match self.ep.av().insert(name) {
                    Ok(a) => {
                        names.insert(name.clone(), a);
                        (a, true)
                    }
                    Err(e) => {
                        tracing::warn!("{}: dropped a hello from {rank} with a bad address: {e}", self.me.rank);
                        return;
                    }
                },
            }
        };
        let challenge = lock(&self.sessions).on_hello(fi_addr, inserted, msg, now);
        match challenge {
            Ok(c) => self.send_ctl(None, To { fi_addr, token: 0 }, &c),
            Err(e) => {
                tracing::error!("{}: rejected a hello from an endpoint claiming {rank}: {e}", self.me.rank);
                self.unuse_if_inserted(fi_addr, inserted);
            }
        }
    }

    /// Removes an address inserted for a failed handshake, unless a rank uses it.
    fn unuse_if_inserted(&self, fi_addr: u64, inserted: bool) {
        if inserted && !lock(&self.sessions).in_use(fi_addr) {
            lock(&self.names).retain(|_, a| *a != fi_addr);
            self.ep.av().remove(fi_addr);
        }
    }

    fn dispatch(&self, rank: crate::ids::Rank, token: u64, msg: Msg, body: &[u8]) {
        let arrive = |head, item| self.arrive(rank, head, Some(item), false);
        match msg {
            Msg::Data { head, ctx, tag } => {
                self.arrive_data(rank, head, ctx, tag, body.get(DATA_HEADER..).unwrap_or_default());
            }
            Msg::Rts { head, ctx, tag, len, id, region } => {
                self.rendezvous(rank, (head, ctx, tag, len, id), Fill::Read(&region));
            }
            Msg::Bulk { head, ctx, tag, len, id, chunk } => {
                self.rendezvous(rank, (head, ctx, tag, len, id), Fill::Bulk { token, chunk });
            }
            Msg::Bye { head } => arrive(head, Item::Bye),
            Msg::Fin { id } => self.outgoing_done(rank, id),
            Msg::Release { req } => self.released(rank, req),
            Msg::Query { req, window } => self.answer_query(rank, req, window),
            Msg::Desc { req, size, region } => {
                let desc = super::rma::encode_desc(size, &region);
                if self.queries.complete(rank, req, Ok(desc)).is_err() {
                    // The get was abandoned: give the lease back.
                    self.reply(rank, &Msg::Release { req });
                }
            }
            Msg::Refusal { req, why } => match decode_refusal(&why) {
                Some(why) => {
                    if let Err(e) = self.queries.complete(rank, req, Err(why)) {
                        tracing::warn!("{}: {e}", self.me.rank);
                    }
                }
                None => tracing::warn!("{}: dropped a malformed refusal from {rank}", self.me.rank),
            },
            Msg::Ping => self.reply(rank, &Msg::Pong),
            Msg::Pong | Msg::Hello { .. } | Msg::Challenge { .. } | Msg::Proof { .. } | Msg::Accept { .. } => {}
        }
    }

    /// A rendezvous or bulk announcement: take its place in the stream and read or
    /// receive the payload.
    fn rendezvous(
        &self,
        rank: crate::ids::Rank,
        (head, ctx, tag, len, id): (super::wire::Head, crate::Context, crate::Tag, u64, u64),
        fill: Fill<'_>,
    ) {
        let cap = self.cfg.get_max_payload();
        let Some(n) = usize::try_from(len).ok().filter(|_| len <= cap) else {
            let why = format!("it announced a message of {len} bytes, over the cap of {cap}");
            return self.peer_ended(rank, PeerEnd::Lost, &why);
        };
        // Its place in the stream is taken already if a copy into a receive's memory on
        // this thread failed; it is then read as any other (a queued copy, which reports
        // the failure, or reads by `fi_read` where the kernel refused).
        let reserved = match &fill {
            Fill::Read(region) if n > 0 && self.direct.copies(&region.owner) => {
                match self.land_in_place(rank, (head, ctx, tag, id), n, region) {
                    Some(true) => return,
                    Some(false) => true,
                    None => false,
                }
            }
            _ => false,
        };
        let claim = {
            let mut streams = lock(&self.streams);
            // A receive waiting for exactly this message gets it read straight into its
            // memory, if nothing before it in its stream will reach the mailbox later
            // (earlier messages still being read into receives of their own are fine:
            // they took the older receives).
            let claim = streams.may_claim(rank, head).then(|| self.mailbox.claim(rank, ctx, tag, len)).flatten();
            if let Err(e) = if reserved { Ok(()) } else { streams.arrive(rank, head, None).map(drop) } {
                drop((streams, claim));
                return self.peer_ended(rank, PeerEnd::Lost, &e);
            }
            if claim.is_some() {
                streams.mark_claimed(rank, head);
            }
            claim
        };
        let bulk = matches!(fill, Fill::Bulk { .. });
        let purpose = Purpose::Message { head, ctx, tag, id, fin: !bulk };
        if n == 0 {
            if !bulk {
                self.reply(rank, &Msg::Fin { id });
            }
            if let Some(c) = claim {
                self.mailbox.complete_claim(c);
                return self.arrive(rank, head, Some(Item::Claimed), true);
            }
            return self.arrive(rank, head, Some(Item::Data { ctx, tag, payload: Bytes::new() }), true);
        }
        let mem = claim.map_or_else(|| ReadMem::new_buffer(n), ReadMem::Claim);
        let read = match fill {
            Fill::Read(region) => {
                // Not under the sessions lock: a read may complete at once.
                let src = lock(&self.sessions).addr_of(rank);
                match src {
                    Some(src) => self.start_transfer(rank, src, region, 0, mem, purpose),
                    None => Err("no address".into()),
                }
            }
            Fill::Bulk { token, chunk } => self.start_bulk(rank, (token, id, chunk), mem, purpose),
        };
        if let Err(e) = read {
            self.peer_ended(rank, PeerEnd::Lost, &format!("cannot read its message: {e}"));
        }
    }

    /// Copies a rendezvous payload from its sender's memory (a direct copy, see
    /// [`super::direct`]) straight into the memory of the receive that waits for it on
    /// this thread, within this call, if that receive takes it (the oldest it matches,
    /// lending exactly `n` bytes: [`crate::Mailbox::land_here`]) and it is the next
    /// message of its stream with nothing before it pending, so that delivering it now
    /// keeps the order (later ones wait behind it meanwhile). No buffer, and no second
    /// copy into the receive's memory. (A blocking `recv_into` lends its memory only
    /// while its thread waits, so the queued copies, which any polling thread makes
    /// across calls, cannot write into it.) The message is delivered under the streams
    /// lock, as every message is: a peer's end, which forgets its streams under that
    /// lock, comes wholly before or after it.
    ///
    /// `Some(true)`: done with (delivered and its sender told, or dropped with its
    /// stream, the peer having ended meanwhile); `Some(false)`: the copy failed after
    /// the message took its place in the stream; `None`: not for a receive here, or
    /// not next in its stream.
    fn land_in_place(
        &self,
        rank: crate::ids::Rank,
        (head, ctx, tag, id): (super::wire::Head, crate::Context, crate::Tag, u64),
        n: usize,
        region: &super::wire::Region,
    ) -> Option<bool> {
        enum Landing<'a> {
            NotNext,
            /// Copied, and delivered by `land_here` under this lock.
            Copied(std::sync::MutexGuard<'a, super::stream::Streams>),
            Failed,
            /// Its stream was forgotten meanwhile (the peer ended), as was the message.
            Forgotten,
        }
        let landing = self.mailbox.land_here(rank, ctx, tag, n, |mem| {
            if !lock(&self.streams).reserve_next(rank, head) {
                return (false, Landing::NotNext);
            }
            let copied = super::ofi::copy_from_process(mem, region.owner.pid, region.addr);
            #[cfg(test)]
            let copied = copied.and_then(|()| self.direct.refusing(true));
            if let Err(e) = copied {
                tracing::debug!(
                    "{}: copying a message from {rank} in place failed ({e}); reading it again",
                    self.me.rank
                );
                return (false, Landing::Failed);
            }
            let streams = lock(&self.streams);
            match streams.is_reading(rank, head) {
                true => (true, Landing::Copied(streams)),
                false => (false, Landing::Forgotten),
            }
        })?;
        match landing {
            Landing::NotNext => None,
            Landing::Failed => {
                self.direct.landed(false);
                Some(false)
            }
            Landing::Forgotten => Some(true),
            Landing::Copied(streams) => {
                self.direct.landed(true);
                self.arrive_locked(streams, rank, head, Some(Item::Claimed), true);
                self.reply(rank, &Msg::Fin { id });
                Some(true)
            }
        }
    }

    /// Housekeeping; see the module docs.
    fn tick(&self) {
        let now = Instant::now();
        let limit = self.cfg.get_connect_timeout() + self.cfg.get_handshake_timeout();
        let t = lock(&self.sessions).tick(now, limit);
        for a in t.unused {
            self.unuse_if_inserted(a, true);
        }
        for (rank, to) in t.ping {
            self.send_ctl(Some(rank), to, &Msg::Ping);
        }
        for rank in t.lost {
            let why = format!("no answer for {:?}", super::session::LOST_AFTER);
            self.peer_ended(rank, PeerEnd::Lost, &why);
        }
    }
}

/// The progress thread's loop; ends when the endpoint shuts down.
pub(super) fn run(inner: Arc<Inner>) {
    let _ = inner.progress_thread.set(std::thread::current());
    let mut idle = 0u32;
    let mut aside = Aside::new(&inner.pollers);
    let mut last_tick = Instant::now();
    while !inner.shutdown.load(Ordering::Acquire) {
        if inner.pollers.any() {
            // An application thread is reading the queue itself: on a machine with as
            // many cores as ranks, a second thread spinning on the same queue only takes
            // its core away (and the queue's lock), so this one waits its turn; but it
            // helps make queued copies (woken when they are queued), which are work,
            // not spinning.
            if !inner.run_direct() {
                std::thread::park_timeout(aside.nap);
                aside.woke(&inner.pollers);
            }
            tick_if_due(&inner, &mut last_tick);
            continue;
        }
        aside.reset(&inner.pollers);
        if inner.progress_once() {
            idle = 0;
        } else {
            idle = idle.saturating_add(1);
            if idle > SPIN {
                let shift = (idle - SPIN).min(5);
                std::thread::park_timeout(Duration::from_micros(32 << shift));
            }
        }
        tick_if_due(&inner, &mut last_tick);
    }
}

/// Does the housekeeping if a [`TICK`] has passed since `last`.
fn tick_if_due(inner: &Inner, last: &mut Instant) {
    if last.elapsed() >= TICK {
        *last = Instant::now();
        inner.tick();
    }
}

/// How long the progress thread naps while application threads poll. A wake-up is
/// not free: on a 2-vCPU guest a thread napping 1 ms at a time took 4 % of the CPU from
/// a thread spinning on it (about 40 µs a wake-up), and in an 8-byte ping-pong over
/// shm, where each rank's application thread polls all the time, the two progress
/// threads' wake-ups cost about 7 % of the latency. So while the application threads
/// keep coming back to poll in a tight loop ([`TIGHT`] beginnings in a nap), the nap
/// doubles, up to [`STAND_ASIDE_LONGEST`]; it is [`STAND_ASIDE`] again once a wake-up
/// finds none polling, or fewer beginnings.
///
/// A thread that stops polling to sleep wakes the progress thread at once
/// (`poll_end`); one that stops to compute right after a tight loop leaves the
/// provider without progress for one nap at most (messages that wait for this
/// endpoint's polls, reads of its memory over a socket-based provider): 16 ms at most
/// instead of 1. A thread that polls all along, as a 4 MiB get over tcp;ofi_rxm does,
/// keeps the short nap: longer naps there changed nothing in the get's time (its
/// context switches are the owner's, serving the reads).
struct Aside {
    nap: Duration,
    begun: usize,
}

impl Aside {
    fn new(pollers: &Pollers) -> Self {
        Self { nap: STAND_ASIDE, begun: pollers.begun() }
    }

    /// After a nap: the next one's length.
    fn woke(&mut self, pollers: &Pollers) {
        let begun = pollers.begun();
        let tight = begun.wrapping_sub(self.begun) >= TIGHT && pollers.any();
        self.begun = begun;
        self.nap = if tight { (self.nap * 2).min(STAND_ASIDE_LONGEST) } else { STAND_ASIDE };
    }

    /// No application thread polls: the next nap aside starts short, and counts the
    /// beginnings from now.
    fn reset(&mut self, pollers: &Pollers) {
        *self = Self::new(pollers);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pollers_count_the_threads_polling_and_every_beginning() {
        let p = Pollers::default();
        assert!(!p.any());
        p.begin();
        p.begin();
        assert!(p.any());
        assert_eq!(p.begun(), 2);
        assert!(!p.end(), "one thread still polls");
        assert!(p.end(), "the last one ends");
        assert!(!p.any());
        assert_eq!(p.begun(), 2, "ending does not count as beginning");
    }

    #[test]
    fn the_nap_aside_grows_only_while_threads_poll_in_a_tight_loop() {
        let p = Pollers::default();
        let mut a = Aside::new(&p);
        let tight = |p: &Pollers| {
            p.begin();
            for _ in 1..TIGHT {
                p.end();
                p.begin();
            }
        };
        // A thread that polls now and then leaves the nap short.
        p.begin();
        a.woke(&p);
        assert_eq!(a.nap, STAND_ASIDE);
        p.end();
        // A tight loop doubles it at every wake-up, up to the longest.
        let mut naps = Vec::new();
        for _ in 0..8 {
            tight(&p);
            a.woke(&p);
            p.end();
            naps.push(a.nap.as_millis());
        }
        assert_eq!(naps, [2, 4, 8, 16, 16, 16, 16, 16]);
        // A wake-up that finds nobody polling, though many began, makes it short again.
        tight(&p);
        p.end();
        a.woke(&p);
        assert_eq!(a.nap, STAND_ASIDE);
        // So does a turn of the progress thread's own polling, which also forgets the
        // beginnings before it.
        tight(&p);
        a.woke(&p);
        p.end();
        assert_eq!(a.nap, 2 * STAND_ASIDE);
        tight(&p);
        p.end();
        a.reset(&p);
        assert_eq!(a.nap, STAND_ASIDE);
        p.begin();
        a.woke(&p);
        assert_eq!(a.nap, STAND_ASIDE, "the beginnings before the reset do not count");
        // A thread that polls all along (no beginning between two wake-ups) keeps it
        // short.
        a.woke(&p);
        assert_eq!(a.nap, STAND_ASIDE);
    }
}
