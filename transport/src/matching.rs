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
use tokio::sync::oneshot;

mod landed;
pub use landed::{Claim, Landed, PostingInto};

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
    /// To the receiver, as it arrived.
    Env(oneshot::Sender<Result<Envelope, TransportError>>),
    /// Into the part, then to the receiver (see [`landed`]).
    Into(Part, oneshot::Sender<Result<Landed, TransportError>>),
}

impl Reply {
    /// Hands `env` to the receiver; gives it back if the receiver is gone.
    fn offer(self, env: Envelope) -> Option<Envelope> {
        match self {
            Reply::Env(tx) => match tx.send(Ok(env)) {
                Ok(()) | Err(Err(_)) => None,
                Err(Ok(back)) => Some(back),
            },
            Reply::Into(part, tx) => {
                if tx.is_closed() {
                    return Some(env);
                }
                match landed::land(&env, part) {
                    Ok(l) => tx.send(Ok(l)).err().map(|_| env),
                    Err(e) => {
                        // The message is the receive's, with an error: it was not
                        // the size asked for.
                        let _ = tx.send(Err(e));
                        None
                    }
                }
            }
        }
    }

    fn fail(self, e: TransportError) {
        match self {
            Reply::Env(tx) => drop(tx.send(Err(e))),
            Reply::Into(_, tx) => drop(tx.send(Err(e))),
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
    unexpected: VecDeque<Envelope>,
    posted: VecDeque<Posted>,
    ended: HashMap<Rank, PeerEnd>,
    /// Receives claimed by backends and not yet completed, by source (see [`landed`]).
    claims: Vec<(Rank, std::sync::Weak<landed::ClaimReply>)>,
    next_id: u64,
    closed: bool,
}

impl State {
    /// The oldest queued message `pattern` matches; `None` if the receive must be
    /// posted; an error if it could never be satisfied.
    fn take_queued(&mut self, pattern: &Pattern) -> Result<Option<Envelope>, TransportError> {
        if let Some(pos) = self.unexpected.iter().position(|e| pattern.matches(e.src, e.ctx, e.tag)) {
            return Ok(self.unexpected.remove(pos));
        }
        if self.closed {
            return Err(TransportError::Closed);
        }
        if let SrcMatch::Rank(r) = pattern.src {
            if let Some(end) = self.ended.get(&r) {
                return Err(end.error(r));
            }
        }
        Ok(None)
    }

    /// Posts a receive; returns its id.
    fn push(&mut self, pattern: Pattern, reply: Reply) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.posted.push_back(Posted { id, pattern, reply });
        id
    }
}

/// The outcome of posting a receive.
#[derive(Debug)]
pub enum Posting {
    /// A queued message matched at once.
    Ready(Envelope),
    /// The receive is posted; the message arrives on the receiver. Cancel it with
    /// [`Mailbox::cancel`] and the id if the wait is abandoned.
    Posted(u64, oneshot::Receiver<Result<Envelope, TransportError>>),
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
    pub fn deliver(&self, mut env: Envelope) {
        let mut st = self.lock();
        let mut i = 0;
        while i < st.posted.len() {
            if st.posted[i].pattern.matches(env.src, env.ctx, env.tag) {
                // Index is in range: checked by the loop condition.
                let p = st.posted.remove(i).expect("index in range");
                match p.reply.offer(env) {
                    None => return,
                    // The receiver gave up without cancelling: offer the message to
                    // the next matching posting (the one now at `i`).
                    Some(back) => env = back,
                }
            } else {
                i += 1;
            }
        }
        st.unexpected.push_back(env);
    }

    /// Takes the oldest matching queued message, or posts a receive.
    ///
    /// # Errors
    /// The pattern names a single source that has ended and no queued message of it
    /// matches; or the mailbox is closed.
    pub fn post(&self, pattern: Pattern) -> Result<Posting, TransportError> {
        let mut st = self.lock();
        if let Some(env) = st.take_queued(&pattern)? {
            return Ok(Posting::Ready(env));
        }
        let (tx, rx) = oneshot::channel();
        Ok(Posting::Posted(st.push(pattern, Reply::Env(tx)), rx))
    }

    /// Puts back a message that a receiver took but abandoned before using it, so that it
    /// keeps its place ahead of later messages.
    pub fn give_back(&self, env: Envelope) {
        let mut st = self.lock();
        if let Some(pos) = st.posted.iter().position(|p| p.pattern.matches(env.src, env.ctx, env.tag)) {
            let p = st.posted.remove(pos).expect("position found");
            if let Some(back) = p.reply.offer(env) {
                drop(st);
                self.give_back(back);
            }
            return;
        }
        st.unexpected.push_front(env);
    }

    /// Withdraws a posted receive. Returns false when it was already satisfied (the
    /// message is then on its receiver).
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
        let mut st = self.lock();
        st.ended.insert(r, how);
        st.fail_claims(Some(r), || how.error(r));
        let mut kept = VecDeque::with_capacity(st.posted.len());
        for p in st.posted.drain(..) {
            if p.pattern.src == SrcMatch::Rank(r) {
                // The receiver may be gone already; nothing to do then.
                p.reply.fail(how.error(r));
            } else {
                kept.push_back(p);
            }
        }
        st.posted = kept;
    }

    /// Records that a peer is (again) connected, after a reconnection.
    pub fn peer_connected(&self, r: Rank) {
        self.lock().ended.remove(&r);
    }

    /// Closes the mailbox: every posted receive fails.
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        st.fail_claims(None, || TransportError::Closed);
        for p in st.posted.drain(..) {
            p.reply.fail(TransportError::Closed);
        }
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

    fn env(src: u32, tag: u32, body: &'static [u8]) -> Envelope {
        Envelope { src: Rank(src), ctx: Context(0), tag: Tag(tag), payload: Bytes::from_static(body) }
    }

    fn pat(src: Option<u32>, tag: Option<u32>) -> Pattern {
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
        let Posting::Posted(_, mut any) = m.post(pat(None, None)).unwrap() else { panic!() };
        let Posting::Posted(_, mut from2) = m.post(pat(Some(2), None)).unwrap() else { panic!() };
        m.deliver(env(2, 1, b"x"));
        assert_eq!(any.try_recv().unwrap().unwrap().payload, &b"x"[..]);
        assert!(from2.try_recv().is_err());
        m.deliver(env(2, 1, b"y"));
        assert_eq!(from2.try_recv().unwrap().unwrap().payload, &b"y"[..]);
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
        let Posting::Posted(id, _rx) = m.post(pat(Some(1), None)).unwrap() else { panic!() };
        assert!(m.cancel(id));
        let Posting::Posted(_, rx) = m.post(pat(Some(1), None)).unwrap() else { panic!() };
        drop(rx);
        m.deliver(env(1, 1, b"kept"));
        assert_eq!(ready(m.post(pat(Some(1), None)).unwrap()).payload, &b"kept"[..]);
    }

    #[test]
    fn ended_peers_fail_their_receives_but_not_queued_messages() {
        let m = Mailbox::new();
        let Posting::Posted(_, mut rx) = m.post(pat(Some(3), None)).unwrap() else { panic!() };
        let Posting::Posted(_, mut any) = m.post(pat(None, None)).unwrap() else { panic!() };
        m.deliver(env(4, 1, b"early"));
        assert_eq!(any.try_recv().unwrap().unwrap().payload, &b"early"[..]);
        m.deliver(env(3, 1, b"last words"));
        assert!(rx.try_recv().is_ok());
        m.peer_ended(Rank(3), PeerEnd::Lost);
        let Posting::Posted(_, mut rx) = m.post(pat(Some(4), None)).unwrap() else { panic!() };
        m.peer_ended(Rank(4), PeerEnd::Closed);
        assert!(matches!(rx.try_recv().unwrap(), Err(TransportError::PeerClosed(Rank(4)))));
        assert!(matches!(m.post(pat(Some(3), None)), Err(TransportError::PeerLost(Rank(3)))));
        m.peer_connected(Rank(3));
        assert!(m.post(pat(Some(3), None)).is_ok());
    }
}
