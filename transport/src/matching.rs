//! Message matching, shared by every backend.
//!
//! Backends deliver each arriving message into the [`Mailbox`]; receivers ask for a
//! (context, source, tag) pattern with wildcards for source and tag. Matching follows
//! MPI's rules: a receive takes the oldest queued message that matches; an arriving
//! message goes to the oldest posted receive that matches. Messages from one source
//! are delivered in the order they were sent, per (source, tag) and overall.
//!
//! A tag wildcard matches only application tags (see [`Tag::is_user`]), so runtime
//! traffic such as collectives is never taken by an application's any-tag receive.

use crate::error::TransportError;
use crate::ids::{Context, Rank, Tag};
use crate::landing::Part;
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::task::{Context as TaskContext, Poll, Waker};
use tokio::sync::oneshot;

mod here;
mod landed;
mod pieces;
pub use here::WaitHere;
pub use landed::{Claim, Landed, PostingInto};
use pieces::Message;

/// A received message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    /// Sender.
    pub src: Rank,
    /// Context it was sent in.
    pub ctx: Context,
    /// Its tag.
    pub tag: Tag,
    /// The payload.
    pub payload: Bytes,
}

/// A source pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SrcMatch {
    /// Any source.
    Any,
    /// This rank only.
    Rank(Rank),
}

/// A tag pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TagMatch {
    /// Any application tag.
    Any,
    /// This tag only.
    Tag(Tag),
}

/// A receive pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pattern {
    /// Context.
    pub ctx: Context,
    /// Source.
    pub src: SrcMatch,
    /// Tag.
    pub tag: TagMatch,
}

impl Pattern {
    /// Whether a message matches.
    #[must_use]
    pub fn matches(&self, src: Rank, ctx: Context, tag: Tag) -> bool {
        ctx == self.ctx
            && match self.src {
                SrcMatch::Any => true,
                SrcMatch::Rank(r) => r == src,
            }
            && match self.tag {
                TagMatch::Any => tag.is_user(),
                TagMatch::Tag(t) => t == tag,
            }
    }
}

/// Why a peer will send no more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerEnd {
    /// It said goodbye.
    Closed,
    /// Its connection broke without a goodbye.
    Lost,
}

impl PeerEnd {
    fn error(self, r: Rank) -> TransportError {
        match self {
            Self::Closed => TransportError::PeerClosed(r),
            Self::Lost => TransportError::PeerLost(r),
        }
    }
}

/// Where a posted receive's message goes.
enum Reply {
    /// Kept in the mailbox for the receiver ([`State::kept`]), which is woken with the
    /// waker it left when it last looked. No channel: a small message's receive then
    /// costs no allocation, and the receiver collects its message under the mailbox's
    /// lock (see [`Mailbox::poll_posted`]).
    Kept(Option<Waker>),
    /// Handed over to the receiver if it is delivered on the receiver's own thread while
    /// that waits (see [`here`]), otherwise kept as [`Reply::Kept`] is. A receive that
    /// lent memory takes only a message of its length (the second field): it answers
    /// another with [`TransportError::SizeMismatch`] and lets it go on, in its place.
    Here(Waker, Option<usize>),
    /// Into the part, then to the receiver (see [`landed`]).
    Into(Part, oneshot::Sender<Result<Landed, TransportError>>),
}

/// Answers of receives, kept until their receivers collect them, by receive id.
type Answers = Vec<(u64, Result<Message, TransportError>)>;

impl Reply {
    /// Hands `msg` to the receive `id` of `mailbox`: handed over to this thread if it
    /// waits for it (see [`here`]), else kept for it in `kept` (its waker is returned, to
    /// wake once the lock is released), or copied into its part. Gives the message back
    /// if the receiver is gone (only a receive into a part can be: a kept answer waits
    /// for its receiver, which withdraws it if it gives up), or if the receive refused it
    /// (with the receive's waker, to wake once the lock is released).
    fn offer(
        self,
        mailbox: &Mailbox,
        id: u64,
        msg: Message,
        kept: &mut Answers,
    ) -> Result<Option<Waker>, (Message, Option<Waker>)> {
        match self {
            Reply::Kept(waker) => {
                kept.push((id, Ok(msg)));
                Ok(waker)
            }
            Reply::Here(waker, Some(lent)) if lent != msg.len() => {
                let (peer, got) = (msg.env.src, msg.len() as u64);
                kept.push((id, Err(TransportError::SizeMismatch { peer, expected: lent as u64, got })));
                Err((msg, Some(waker)))
            }
            Reply::Here(waker, _) => match here::hand_over(mailbox, id, msg) {
                Ok(()) => Ok(None),
                Err(msg) => {
                    kept.push((id, Ok(msg)));
                    Ok(Some(waker))
                }
            },
            Reply::Into(part, tx) => {
                if tx.is_closed() {
                    return Err((msg, None));
                }
                match landed::land(&msg, part) {
                    Ok(l) => tx.send(Ok(l)).map(|()| None).map_err(|_| (msg, None)),
                    Err(e) => {
                        // The message is the receive's, with an error: it was not
                        // the size asked for.
                        let _ = tx.send(Err(e));
                        Ok(None)
                    }
                }
            }
        }
    }

    /// Fails the receive `id` with `e`; returns the waker to wake.
    fn fail(self, id: u64, e: TransportError, kept: &mut Answers) -> Option<Waker> {
        match self {
            Reply::Kept(waker) => {
                kept.push((id, Err(e)));
                waker
            }
            Reply::Here(waker, _) => {
                kept.push((id, Err(e)));
                Some(waker)
            }
            Reply::Into(_, tx) => {
                drop(tx.send(Err(e)));
                None
            }
        }
    }
}

struct Posted {
    id: u64,
    pattern: Pattern,
    reply: Reply,
}

#[derive(Default)]
struct State {
    unexpected: VecDeque<Message>,
    posted: VecDeque<Posted>,
    /// Answers to receives of [`Mailbox::post`], until their receivers collect them.
    kept: Answers,
    ended: HashMap<Rank, PeerEnd>,
    /// Receives claimed by backends and not yet completed, by source (see [`landed`]).
    claims: Vec<(Rank, std::sync::Weak<landed::ClaimReply>)>,
    closed: bool,
    /// Why receives fail at once while set, and the contexts spared (see
    /// [`Mailbox::interrupt`]).
    interrupted: Option<(String, Spared)>,
    /// Ranks fenced off for good (see [`Mailbox::fence`]).
    fenced: Vec<Rank>,
    /// Messages arrived so far (see [`Message::seq`]).
    arrivals: u64,
}

impl State {
    /// The oldest queued message `pattern` matches; `None` if the receive must be
    /// posted; an error if it could never be satisfied.
    fn take_queued(&mut self, pattern: &Pattern) -> Result<Option<Message>, TransportError> {
        if let Some((why, spared)) = &self.interrupted {
            if !spared(pattern.ctx) {
                return Err(TransportError::Interrupted(why.clone()));
            }
        }
        if let Some(pos) = self.unexpected.iter().position(|m| m.matched_by(pattern)) {
            return Ok(self.unexpected.remove(pos));
        }
        if self.closed {
            return Err(TransportError::Closed);
        }
        if let SrcMatch::Rank(r) = pattern.src {
            if self.fenced.contains(&r) {
                return Err(PeerEnd::Lost.error(r));
            }
            if let Some(end) = self.ended.get(&r) {
                return Err(end.error(r));
            }
        }
        Ok(None)
    }

    /// Records that peer `r` ended: its claims in progress and the receives that name
    /// it fail; returns the wakers to wake once the lock is released.
    fn end_peer(&mut self, r: Rank, how: PeerEnd) -> Vec<Waker> {
        self.ended.insert(r, how);
        self.fail_claims(Some(r), || how.error(r));
        let mut waiting = VecDeque::with_capacity(self.posted.len());
        let mut wake = Vec::new();
        for p in self.posted.drain(..) {
            if p.pattern.src == SrcMatch::Rank(r) {
                // The receiver may be gone already; nothing to do then.
                wake.extend(p.reply.fail(p.id, how.error(r), &mut self.kept));
            } else {
                waiting.push_back(p);
            }
        }
        self.posted = waiting;
        wake
    }

    /// The number of the message arriving now.
    fn arrival(&mut self) -> u64 {
        self.arrivals += 1;
        self.arrivals
    }

    /// Whether messages from `src` are dropped on arrival (see [`Mailbox::fence`]).
    fn is_fenced(&self, src: Rank) -> bool {
        !self.fenced.is_empty() && self.fenced.contains(&src)
    }

    /// Posts a receive; returns its id.
    fn push(&mut self, pattern: Pattern, reply: Reply) -> u64 {
        let id = receive_id();
        self.posted.push_back(Posted { id, pattern, reply });
        id
    }
}

/// A receive's id, unique in the process: a thread's wait is known by its mailbox's
/// address and this id (see [`here`]), and a mailbox dropped and another made at the same
/// address must not give a later receive the key of an earlier one.
///
/// A thread takes ids from the process's count in blocks, so that a receive costs no
/// atomic instruction (one per [`ID_BLOCK`] receives of the thread).
fn receive_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    thread_local! {
        /// The next id of this thread's block, and the block's end.
        static BLOCK: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
    }
    BLOCK.with(|b| {
        let (mut next, mut end) = b.get();
        if next == end {
            next = NEXT.fetch_add(ID_BLOCK, std::sync::atomic::Ordering::Relaxed);
            end = next + ID_BLOCK;
        }
        b.set((next + 1, end));
        next
    })
}

/// Receive ids a thread takes at once (see [`receive_id`]).
const ID_BLOCK: u64 = 1024;

/// Which contexts an interruption spares (see [`Mailbox::interrupt`]).
type Spared = Box<dyn Fn(Context) -> bool + Send + Sync>;

/// The outcome of posting a receive.
#[derive(Debug)]
pub enum Posting {
    /// A queued message matched at once.
    Ready(Envelope),
    /// The receive is posted under this id: collect its message with
    /// [`Mailbox::poll_posted`], or abandon it with [`Mailbox::abandon`] if the wait is
    /// given up (which gives its message back in its place, if it had one).
    Posted(u64),
}

/// The matching engine of one endpoint.
#[derive(Default)]
pub struct Mailbox {
    state: Mutex<State>,
}

impl Mailbox {
    /// An empty mailbox.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A poisoned lock means a panic while holding it; the state is still a valid
        // queue, so carry on rather than propagate the panic to every receiver.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Delivers an arriving message.
    pub fn deliver(&self, env: Envelope) {
        self.deliver_message(Message::whole(env));
    }

    fn deliver_message(&self, mut msg: Message) {
        let mut st = self.lock();
        if st.is_fenced(msg.env.src) {
            return;
        }
        msg.seq = st.arrival();
        self.deliver_from(st, 0, msg);
    }

    /// Delivers an arriving message whose payload the caller only lends: a receive this
    /// thread waits for with memory of the payload's length ([`Mailbox::post_here_into`])
    /// gets it copied there; otherwise the payload is copied into a buffer of its own and
    /// delivered as [`Mailbox::deliver`] does.
    pub fn deliver_slice(&self, src: Rank, ctx: Context, tag: Tag, payload: &[u8]) {
        let mut st = self.lock();
        if st.is_fenced(src) {
            return;
        }
        let seq = st.arrival();
        let first = st.posted.iter().position(|p| p.pattern.matches(src, ctx, tag));
        if let Some(i) = first {
            if matches!(st.posted[i].reply, Reply::Here(..))
                && here::land(self, st.posted[i].id, (src, ctx, tag, seq), payload)
            {
                st.posted.remove(i);
                return;
            }
        }
        let mut msg = Message::whole(Envelope { src, ctx, tag, payload: Bytes::copy_from_slice(payload) });
        msg.seq = seq;
        match first {
            Some(i) => self.deliver_from(st, i, msg),
            None => st.unexpected.push_back(msg),
        }
    }

    /// Delivers `msg` to the oldest matching posting at or after `i` (none before it
    /// matches), or queues it.
    fn deliver_from(&self, mut st: std::sync::MutexGuard<'_, State>, mut i: usize, mut msg: Message) {
        // Receives that refused the message, to wake once the lock is released.
        let mut refused = Vec::new();
        while i < st.posted.len() {
            if msg.matched_by(&st.posted[i].pattern) {
                // Index is in range: checked by the loop condition.
                let p = st.posted.remove(i).expect("index in range");
                match p.reply.offer(self, p.id, msg, &mut st.kept) {
                    Ok(waker) => {
                        drop(st);
                        waker.into_iter().chain(refused).for_each(Waker::wake);
                        return;
                    }
                    // A receive into a part whose receiver gave up without cancelling,
                    // or one of another length: offer the message to the next matching
                    // posting (now at `i`).
                    Err((back, waker)) => {
                        msg = back;
                        refused.extend(waker);
                    }
                }
            } else {
                i += 1;
            }
        }
        st.unexpected.push_back(msg);
        drop(st);
        refused.into_iter().for_each(Waker::wake);
    }

    /// Takes the oldest matching queued message, or posts a receive.
    ///
    /// # Errors
    /// The pattern names a single source that has ended and no queued message of it
    /// matches; or the mailbox is closed.
    pub fn post(&self, pattern: Pattern) -> Result<Posting, TransportError> {
        let mut st = self.lock();
        if let Some(msg) = st.take_queued(&pattern)? {
            drop(st);
            return Ok(Posting::Ready(msg.join()));
        }
        Ok(Posting::Posted(st.push(pattern, Reply::Kept(None))))
    }

    /// Posts a receive whose message, even one queued already, is collected with
    /// [`Mailbox::poll_posted`]; returns its id. Unlike [`Mailbox::post`], a queued
    /// message that matches stays in the mailbox (kept for this receive), so that
    /// [`Mailbox::abandon`] gives it back in its place in the order of arrival.
    ///
    /// # Errors
    /// As [`Mailbox::post`].
    pub fn post_kept(&self, pattern: Pattern) -> Result<u64, TransportError> {
        let mut st = self.lock();
        if let Some(msg) = st.take_queued(&pattern)? {
            let id = receive_id();
            st.kept.push((id, Ok(msg)));
            return Ok(id);
        }
        Ok(st.push(pattern, Reply::Kept(None)))
    }

    /// The message of receive `id` (of [`Mailbox::post`]) once it is there, or the
    /// receive's error; until then the receiver is woken through `cx` when it comes.
    /// A receive that is neither waiting nor answered (withdrawn) is an error.
    pub fn poll_posted(&self, id: u64, cx: &mut TaskContext<'_>) -> Poll<Result<Envelope, TransportError>> {
        self.poll_kept(id, cx).map(|r| r.map(Message::join))
    }

    /// As [`Mailbox::poll_posted`], the message as it was delivered.
    fn poll_kept(&self, id: u64, cx: &mut TaskContext<'_>) -> Poll<Result<Message, TransportError>> {
        let mut st = self.lock();
        if let Some(i) = st.kept.iter().position(|(k, _)| *k == id) {
            return Poll::Ready(st.kept.swap_remove(i).1);
        }
        match st.posted.iter_mut().find(|p| p.id == id).map(|p| &mut p.reply) {
            Some(Reply::Kept(waker)) => {
                if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    *waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            Some(Reply::Here(waker, _)) => {
                if !waker.will_wake(cx.waker()) {
                    *waker = cx.waker().clone();
                }
                Poll::Pending
            }
            _ => Poll::Ready(Err(TransportError::Closed)),
        }
    }

    /// Withdraws receive `id` (of [`Mailbox::post`]) whose receiver gave up: still
    /// waiting, it is removed; answered but not collected, its message is returned (to
    /// give back with [`Mailbox::give_back`], so that it keeps its place). See also
    /// [`Mailbox::abandon`].
    pub fn withdraw(&self, id: u64) -> Option<Envelope> {
        let mut st = self.lock();
        if let Some(pos) = st.posted.iter().position(|p| p.id == id) {
            st.posted.remove(pos);
            return None;
        }
        let i = st.kept.iter().position(|(k, _)| *k == id)?;
        let msg = st.kept.swap_remove(i).1.ok();
        drop(st);
        msg.map(Message::join)
    }

    /// Withdraws receive `id` (of [`Mailbox::post`]) whose receiver gave up, as
    /// [`Mailbox::withdraw`] does, and gives its message back if it had one: all under
    /// one lock, so that no other receive takes a later message while this one is out,
    /// and without joining a message that came in pieces.
    pub fn abandon(&self, id: u64) {
        let mut st = self.lock();
        if let Some(pos) = st.posted.iter().position(|p| p.id == id) {
            st.posted.remove(pos);
            return;
        }
        let Some(i) = st.kept.iter().position(|(k, _)| *k == id) else { return };
        if let Ok(msg) = st.kept.swap_remove(i).1 {
            self.put_back(st, msg);
        }
    }

    /// Puts back a message that a receiver took but abandoned before using it, so that it
    /// keeps its place ahead of later messages. An envelope no longer carries its place
    /// in the order of arrival, so it goes to the front of the queue, ahead of every
    /// message queued, even of one that arrived before it or that is given back in its
    /// place later. Receives abandoned inside the mailbox ([`Mailbox::abandon`], a
    /// dropped [`WaitHere`]) and messages that landed in parts
    /// ([`Mailbox::give_back_landed`]) go back in their places. Every message given back
    /// goes first to the oldest receive still waiting that matches it: where two
    /// receives holding messages are dropped newest first while a third waits, the
    /// third gets the newer message and the older one is queued behind it.
    pub fn give_back(&self, env: Envelope) {
        self.give_back_message(Message::whole(env));
    }

    /// As [`Mailbox::give_back`], a message as it was delivered.
    fn give_back_message(&self, msg: Message) {
        self.put_back(self.lock(), msg);
    }

    /// Offers `msg`, taken from the queue earlier, to the oldest matching posted
    /// receive, or queues it again in its place in the order of arrival (at the front
    /// if its number was lost; dropped if its sender has been fenced off meanwhile).
    fn put_back(&self, mut st: std::sync::MutexGuard<'_, State>, mut msg: Message) {
        if st.is_fenced(msg.env.src) {
            return;
        }
        let mut refused = Vec::new();
        while let Some(pos) = st.posted.iter().position(|p| msg.matched_by(&p.pattern)) {
            let p = st.posted.remove(pos).expect("position found");
            match p.reply.offer(self, p.id, msg, &mut st.kept) {
                Ok(waker) => {
                    drop(st);
                    waker.into_iter().chain(refused).for_each(Waker::wake);
                    return;
                }
                // A receive into a part whose receiver gave up, or one of another
                // length: the next one.
                Err((back, waker)) => {
                    msg = back;
                    refused.extend(waker);
                }
            }
        }
        let at = st.unexpected.partition_point(|m| m.seq < msg.seq);
        st.unexpected.insert(at, msg);
        drop(st);
        refused.into_iter().for_each(Waker::wake);
    }

    /// Withdraws a posted receive into a part ([`Mailbox::post_into`]). Returns false
    /// when it was already satisfied (the message is then on its receiver).
    pub fn cancel(&self, id: u64) -> bool {
        let mut st = self.lock();
        if let Some(pos) = st.posted.iter().position(|p| p.id == id) {
            st.posted.remove(pos);
            true
        } else {
            false
        }
    }

    /// Records that a peer will send nothing more; fails the receives waiting on it alone.
    pub fn peer_ended(&self, r: Rank, how: PeerEnd) {
        let wake = self.lock().end_peer(r, how);
        // Woken once the lock is released, as in `deliver`.
        wake.into_iter().for_each(Waker::wake);
    }

    /// Fences `ranks` off for good: processes the job has given up as failed, which may
    /// still run for a while elsewhere (on a host cut off from the launcher) and send.
    /// Their queued messages are dropped, receives that name them fail (now and from
    /// now on, even if they connect again), and what they send later is dropped on
    /// arrival, so that a fenced process can neither fill this mailbox nor be matched.
    /// A message that answered a receive before the fence stays that receive's (it
    /// came before the failure was known); given back, it is dropped.
    pub fn fence(&self, ranks: &[Rank]) {
        let mut wake = Vec::new();
        {
            let mut st = self.lock();
            for r in ranks {
                if !st.fenced.contains(r) {
                    st.fenced.push(*r);
                }
                wake.extend(st.end_peer(*r, PeerEnd::Lost));
            }
            st.unexpected.retain(|m| !ranks.contains(&m.env.src));
        }
        wake.into_iter().for_each(Waker::wake);
    }

    /// Whether peer `r` is known to have ended: it said goodbye, its connection broke,
    /// or it was fenced off.
    #[must_use]
    pub fn has_ended(&self, r: Rank) -> bool {
        let st = self.lock();
        st.ended.contains_key(&r) || st.is_fenced(r)
    }

    /// The error of an operation on peer `r`, which has ended ([`Mailbox::has_ended`]):
    /// closed if it said goodbye, lost otherwise.
    #[must_use]
    pub fn ended_error(&self, r: Rank) -> TransportError {
        match self.lock().ended.get(&r) {
            Some(PeerEnd::Closed) => TransportError::PeerClosed(r),
            _ => TransportError::PeerLost(r),
        }
    }

    /// The first of `ranks` whose connection broke without a goodbye ([`PeerEnd::Lost`]),
    /// if any: a process that failed, as this process's transport saw it.
    #[must_use]
    pub fn lost_among(&self, ranks: &[Rank]) -> Option<Rank> {
        let st = self.lock();
        ranks.iter().copied().find(|r| st.ended.get(r) == Some(&PeerEnd::Lost))
    }

    /// Why a dial to peer `r` failed: the peer is lost if it is known meanwhile to have
    /// ended ([`Mailbox::has_ended`]: the launcher said it is gone, say), whatever the
    /// dial's own timeout or I/O error. A handshake with a killed process times out, and
    /// a timeout is no failure a job can recover from, where the process's end is one.
    #[must_use]
    pub fn dial_error(&self, r: Rank, e: TransportError) -> TransportError {
        match e {
            TransportError::Timeout { .. } | TransportError::Io { .. } if self.has_ended(r) => {
                tracing::debug!("{e}; {r} is known to have ended");
                TransportError::PeerLost(r)
            }
            e => e,
        }
    }

    /// Records that a peer is (again) connected, after a reconnection.
    pub fn peer_connected(&self, r: Rank) {
        self.lock().ended.remove(&r);
    }

    /// Closes the mailbox: every posted receive fails.
    pub fn close(&self) {
        let wake = {
            let mut guard = self.lock();
            let st = &mut *guard;
            st.closed = true;
            st.fail_claims(None, || TransportError::Closed);
            let mut wake = Vec::new();
            for p in st.posted.drain(..) {
                wake.extend(p.reply.fail(p.id, TransportError::Closed, &mut st.kept));
            }
            wake
        };
        wake.into_iter().for_each(Waker::wake);
    }

    /// Interrupts the receives of every context but those `spared` says: those waiting
    /// fail with [`TransportError::Interrupted`]`(why)`, and so does every receive
    /// posted until [`Mailbox::resume`]. How a process learns that the peers `failed`
    /// failed while it waits on them, or on a live peer that waits on them (as ULFM's
    /// revoke). Arriving messages are still queued, and a message from a live peer
    /// already landing in place completes: nothing a live peer sends is lost.
    pub fn interrupt(&self, why: &str, failed: &[Rank], spared: impl Fn(Context) -> bool + Send + Sync + 'static) {
        let wake = {
            let mut guard = self.lock();
            let st = &mut *guard;
            for r in failed {
                st.fail_claims(Some(*r), || TransportError::Interrupted(why.to_string()));
            }
            let mut waiting = VecDeque::with_capacity(st.posted.len());
            let mut wake = Vec::new();
            for p in st.posted.drain(..) {
                if spared(p.pattern.ctx) {
                    waiting.push_back(p);
                } else {
                    wake.extend(p.reply.fail(p.id, TransportError::Interrupted(why.to_string()), &mut st.kept));
                }
            }
            st.posted = waiting;
            st.interrupted = Some((why.to_string(), Box::new(spared)));
            wake
        };
        wake.into_iter().for_each(Waker::wake);
    }

    /// Ends an interruption: receives may be posted again. Queued messages of the
    /// contexts `stale` says (those of the operations interrupted, which nobody will
    /// receive now) are dropped.
    pub fn resume(&self, stale: &dyn Fn(Context) -> bool) {
        let mut st = self.lock();
        st.interrupted = None;
        st.unexpected.retain(|m| !stale(m.env.ctx));
    }

    /// Number of queued unmatched messages (diagnostics).
    #[must_use]
    pub fn queued(&self) -> usize {
        self.lock().unexpected.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn env(src: u32, tag: u32, body: &'static [u8]) -> Envelope {
        Envelope { src: Rank(src), ctx: Context(0), tag: Tag(tag), payload: Bytes::from_static(body) }
    }

    pub(super) fn pat(src: Option<u32>, tag: Option<u32>) -> Pattern {
        Pattern {
            ctx: Context(0),
            src: src.map_or(SrcMatch::Any, |s| SrcMatch::Rank(Rank(s))),
            tag: tag.map_or(TagMatch::Any, |t| TagMatch::Tag(Tag(t))),
        }
    }

    fn ready(p: Posting) -> Envelope {
        match p {
            Posting::Ready(e) => e,
            Posting::Posted(..) => panic!("expected a queued message"),
        }
    }

    pub(super) fn posted(p: Posting) -> u64 {
        match p {
            Posting::Posted(id) => id,
            Posting::Ready(..) => panic!("expected a posted receive"),
        }
    }

    /// The answer to receive `id` if there is one yet.
    pub(super) fn answer(m: &Mailbox, id: u64) -> Option<Result<Envelope, TransportError>> {
        match m.poll_posted(id, &mut TaskContext::from_waker(Waker::noop())) {
            Poll::Ready(r) => Some(r),
            Poll::Pending => None,
        }
    }

    #[test]
    fn queued_messages_match_oldest_first() {
        let m = Mailbox::new();
        m.deliver(env(1, 5, b"a"));
        m.deliver(env(2, 5, b"b"));
        m.deliver(env(1, 6, b"c"));
        m.deliver(env(1, 5, b"d"));
        assert_eq!(ready(m.post(pat(Some(1), Some(5))).unwrap()).payload, &b"a"[..]);
        assert_eq!(ready(m.post(pat(None, Some(6))).unwrap()).payload, &b"c"[..]);
        assert_eq!(ready(m.post(pat(None, None)).unwrap()).payload, &b"b"[..]);
        assert_eq!(ready(m.post(pat(Some(1), None)).unwrap()).payload, &b"d"[..]);
        assert_eq!(m.queued(), 0);
    }

    #[test]
    fn posted_receives_are_served_in_post_order() {
        let m = Mailbox::new();
        let any = posted(m.post(pat(None, None)).unwrap());
        let from2 = posted(m.post(pat(Some(2), None)).unwrap());
        m.deliver(env(2, 1, b"x"));
        assert_eq!(answer(&m, any).unwrap().unwrap().payload, &b"x"[..]);
        assert!(answer(&m, from2).is_none());
        m.deliver(env(2, 1, b"y"));
        assert_eq!(answer(&m, from2).unwrap().unwrap().payload, &b"y"[..]);
        // Collected once: the answer is gone.
        assert!(matches!(answer(&m, from2), Some(Err(TransportError::Closed))));
    }

    #[test]
    fn a_receiver_is_woken_once_its_message_is_kept() {
        struct Count(std::sync::atomic::AtomicUsize);
        impl std::task::Wake for Count {
            fn wake(self: std::sync::Arc<Self>) {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let counter = || std::sync::Arc::new(Count(std::sync::atomic::AtomicUsize::new(0)));
        let woken = |c: &std::sync::Arc<Count>| c.0.load(std::sync::atomic::Ordering::SeqCst);
        let m = Mailbox::new();
        let id = posted(m.post(pat(Some(1), None)).unwrap());
        let (first, second) = (counter(), counter());
        let (w1, w2) = (Waker::from(first.clone()), Waker::from(second.clone()));
        assert!(m.poll_posted(id, &mut TaskContext::from_waker(&w1)).is_pending());
        // Polled again from elsewhere (another task): the latest waker is the one woken.
        assert!(m.poll_posted(id, &mut TaskContext::from_waker(&w2)).is_pending());
        m.deliver(env(1, 1, b"z"));
        assert_eq!((woken(&first), woken(&second)), (0, 1));
        let Poll::Ready(Ok(e)) = m.poll_posted(id, &mut TaskContext::from_waker(&w2)) else { panic!() };
        assert_eq!(e.payload, &b"z"[..]);
        // A receive failed by its peer's end or by closing is woken too, and an answer
        // withdrawn uncollected leaves nothing behind.
        let (from2, any) = (posted(m.post(pat(Some(2), None)).unwrap()), posted(m.post(pat(None, None)).unwrap()));
        let (third, fourth) = (counter(), counter());
        assert!(m.poll_posted(from2, &mut TaskContext::from_waker(&Waker::from(third.clone()))).is_pending());
        assert!(m.poll_posted(any, &mut TaskContext::from_waker(&Waker::from(fourth.clone()))).is_pending());
        m.peer_ended(Rank(2), PeerEnd::Lost);
        assert_eq!((woken(&third), woken(&fourth)), (1, 0));
        m.close();
        assert_eq!(woken(&fourth), 1);
        assert!(m.withdraw(from2).is_none() && m.withdraw(any).is_none());
        assert!(m.lock().kept.is_empty());
    }

    #[test]
    fn contexts_and_reserved_tags_are_separate() {
        let m = Mailbox::new();
        m.deliver(Envelope { ctx: Context(1), ..env(1, 5, b"other ctx") });
        m.deliver(env(1, Tag::RESERVED_BASE + 3, b"internal"));
        assert!(matches!(m.post(pat(None, None)).unwrap(), Posting::Posted(..)));
        let e = ready(m.post(pat(Some(1), Some(Tag::RESERVED_BASE + 3))).unwrap());
        assert_eq!(e.payload, &b"internal"[..]);
    }

    #[test]
    fn cancelled_or_dropped_receivers_do_not_swallow_messages() {
        let m = Mailbox::new();
        let id = posted(m.post(pat(Some(1), None)).unwrap());
        assert!(m.withdraw(id).is_none());
        m.deliver(env(1, 1, b"kept"));
        assert_eq!(ready(m.post(pat(Some(1), None)).unwrap()).payload, &b"kept"[..]);
        // Answered but never collected: withdrawn, the message comes back and keeps its
        // place ahead of a later one.
        let id = posted(m.post(pat(Some(1), None)).unwrap());
        m.deliver(env(1, 1, b"first"));
        m.deliver(env(1, 1, b"second"));
        m.give_back(m.withdraw(id).unwrap());
        assert_eq!(ready(m.post(pat(Some(1), None)).unwrap()).payload, &b"first"[..]);
        assert_eq!(ready(m.post(pat(Some(1), None)).unwrap()).payload, &b"second"[..]);
    }

    #[test]
    fn ended_peers_fail_their_receives_but_not_queued_messages() {
        let m = Mailbox::new();
        let rx = posted(m.post(pat(Some(3), None)).unwrap());
        let any = posted(m.post(pat(None, None)).unwrap());
        m.deliver(env(4, 1, b"early"));
        assert_eq!(answer(&m, any).unwrap().unwrap().payload, &b"early"[..]);
        m.deliver(env(3, 1, b"last words"));
        assert!(answer(&m, rx).unwrap().is_ok());
        m.peer_ended(Rank(3), PeerEnd::Lost);
        let rx = posted(m.post(pat(Some(4), None)).unwrap());
        m.peer_ended(Rank(4), PeerEnd::Closed);
        assert!(matches!(answer(&m, rx).unwrap(), Err(TransportError::PeerClosed(Rank(4)))));

        assert!(matches!(m.post(pat(Some(3), None)), Err(TransportError::PeerLost(Rank(3)))));
        m.peer_connected(Rank(3));
        let rx = posted(m.post(pat(Some(3), None)).unwrap());
        m.close();
        assert!(matches!(answer(&m, rx).unwrap(), Err(TransportError::Closed)));
    }

    #[test]
    fn abandoned_answers_go_back_in_the_order_they_arrived() {
        let m = Mailbox::new();
        let Posting::Posted(a) = m.post(pat(Some(1), Some(1))).unwrap() else { panic!("matched") };
        let Posting::Posted(b) = m.post(pat(Some(1), Some(1))).unwrap() else { panic!("matched") };
        m.deliver(env(1, 5, b"zero"));
        m.deliver(env(1, 1, b"first"));
        m.deliver(env(1, 1, b"second"));
        // Abandoned oldest first, and behind an older message on another tag: a receive
        // of any tag still takes the three in the order they came.
        m.abandon(a);
        m.abandon(b);
        for want in ["zero", "first", "second"] {
            assert_eq!(ready(m.post(pat(Some(1), None)).unwrap()).payload, want.as_bytes());
        }
    }

    #[test]
    fn a_kept_receive_that_matched_at_once_gives_its_message_back_in_its_place() {
        // `a` waits and is answered by "first"; "second" is queued and `b`, posted
        // later, takes it at once. Abandoned in the reverse order (as locals are
        // dropped), both go back in the order they came.
        let m = Mailbox::new();
        let a = m.post_kept(pat(Some(1), Some(1))).unwrap();
        m.deliver(env(1, 1, b"first"));
        m.deliver(env(1, 1, b"second"));
        let b = m.post_kept(pat(Some(1), Some(1))).unwrap();
        m.deliver(env(1, 1, b"third"));
        m.abandon(b);
        m.abandon(a);
        for want in ["first", "second", "third"] {
            assert_eq!(ready(m.post(pat(Some(1), None)).unwrap()).payload, want.as_bytes());
        }
        // Collected, a receive that matched at once has its message.
        m.deliver(env(1, 1, b"fourth"));
        let c = m.post_kept(pat(Some(1), Some(1))).unwrap();
        assert_eq!(answer(&m, c).unwrap().unwrap().payload, &b"fourth"[..]);
        assert_eq!(m.queued(), 0);
    }

    #[test]
    fn fenced_ranks_are_dropped_now_and_later_and_their_receives_fail() {
        let m = Mailbox::new();
        m.deliver(env(1, 1, b"from 1"));
        m.deliver(env(2, 1, b"from 2"));
        let Posting::Posted(waiting) = m.post(pat(Some(1), Some(7))).unwrap() else { panic!("matched") };
        // Answered before the fence, abandoned after it: not put back.
        let Posting::Posted(answered) = m.post(pat(Some(1), Some(8))).unwrap() else { panic!("matched") };
        m.deliver(env(1, 8, b"answered"));
        assert!(!m.has_ended(Rank(1)));
        m.fence(&[Rank(1)]);
        assert!(m.has_ended(Rank(1)) && !m.has_ended(Rank(2)));
        m.abandon(answered);
        assert_eq!(m.queued(), 1, "the fenced rank's message is dropped, the other kept");
        assert!(matches!(answer(&m, waiting), Some(Err(TransportError::PeerLost(Rank(1))))));
        // Later messages from it are dropped on arrival, however they come.
        m.deliver(env(1, 1, b"late"));
        m.deliver_slice(Rank(1), Context(0), Tag(1), b"late");
        m.deliver_pieces(env(1, 1, b"la"), vec![Bytes::from_static(b"te")]);
        assert_eq!(m.queued(), 1);
        // A receive naming it fails at once, even after it connects again.
        m.peer_connected(Rank(1));
        assert!(m.has_ended(Rank(1)), "fenced for good");
        m.peer_ended(Rank(3), PeerEnd::Closed);
        assert!(m.has_ended(Rank(3)));
        m.peer_connected(Rank(3));
        assert!(!m.has_ended(Rank(3)), "connected again");
        // A dial that timed out is a lost peer only if the peer is known to have ended.
        let timeout = || TransportError::Timeout { what: "a dial".into(), after: std::time::Duration::ZERO };
        assert!(matches!(m.dial_error(Rank(1), timeout()), TransportError::PeerLost(Rank(1))));
        assert!(matches!(m.dial_error(Rank(3), timeout()), TransportError::Timeout { .. }));
        let refused = TransportError::Auth { peer: Rank(1), source: crate::error::AuthError::BadProof };
        assert!(matches!(m.dial_error(Rank(1), refused), TransportError::Auth { .. }), "not every error");
        assert!(matches!(m.post(pat(Some(1), Some(1))), Err(TransportError::PeerLost(Rank(1)))));
        // The others are untouched.
        assert_eq!(ready(m.post(pat(None, Some(1))).unwrap()).payload, &b"from 2"[..]);
    }

    #[test]
    fn an_interruption_fails_receives_but_the_spared_until_resumed_and_loses_no_message() {
        let m = Mailbox::new();
        let from1 = posted(m.post(pat(Some(1), None)).unwrap());
        let any = posted(m.post(pat(None, None)).unwrap());
        let spared_ctx = Pattern { ctx: Context(9), ..pat(Some(1), None) };
        let spared = posted(m.post(spared_ctx).unwrap());
        m.interrupt("rank 2 failed", &[Rank(2)], |c| c == Context(9));
        for id in [from1, any] {
            assert!(matches!(answer(&m, id).unwrap(), Err(TransportError::Interrupted(w)) if w == "rank 2 failed"));
        }
        assert!(answer(&m, spared).is_none());
        m.deliver(Envelope { ctx: Context(9), ..env(1, 3, b"spared") });
        assert_eq!(answer(&m, spared).unwrap().unwrap().payload, &b"spared"[..]);
        // Posted while interrupted: fails at once, even with a message queued for it.
        m.deliver(env(1, 7, b"sent meanwhile"));
        m.deliver(Envelope { ctx: Context(4), ..env(1, 8, b"stale") });
        assert!(matches!(m.post(pat(Some(1), Some(7))), Err(TransportError::Interrupted(_))));
        // Resumed: the stale context's messages are dropped, the others kept.
        m.resume(&|c| c == Context(4));
        assert_eq!(ready(m.post(pat(Some(1), Some(7))).unwrap()).payload, &b"sent meanwhile"[..]);
        assert_eq!(m.queued(), 0);
        assert!(matches!(m.post(pat(None, None)).unwrap(), Posting::Posted(..)));
    }
}
