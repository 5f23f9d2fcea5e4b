//! Who is who: the job-key handshake over RDM messages, the session tokens that
//! authenticate every later message, the sending streams and the liveness watch. Plain
//! state, no libfabric: inputs are fabric addresses (`u64`), decoded messages and the
//! time; outputs are messages to send.
//!
//! A handshake (dialer D, listener L) is the challenge-response of [`crate::auth`]
//! carried in four messages, each naming the handshake by D's nonce: `Hello` (job, D's
//! rank and nonce, D's endpoint name, so that L can answer a D it does not know) →
//! `Challenge` (L's rank, both nonces, L's MAC) → `Proof` (D's MAC) → `Accept`.
//!
//! Both sides then derive two 64-bit *session tokens* from the key and both nonces,
//! with the same MACs under an order of arguments the handshake never sends; an
//! endpoint without the key cannot compute them. Every later message starts with the
//! token of its direction, which says who sent it: the source addresses libfabric
//! reports are not relied on (1.17's shm misreports the source of messages from
//! endpoints not in the receiver's address vector). D accepts L's token once L's MAC
//! verifies and L accepts D's once D's does; each side sends only once the other
//! accepts its token (D after `Accept`, L after the proof), so no message is dropped.
//!
//! Call order: [`Sessions::dial`] before sending to a rank without a stream; feed
//! handshake messages to the `on_*` methods; [`Sessions::hear`] for every other message
//! (it names the sender, or refuses it); [`Sessions::tick`] periodically.
//!
//! Every change to the accepted tokens moves a generation counter that lives outside
//! the lock ([`Sessions::generation`]): a reader that remembers what a token named, and
//! under which generation, may use that answer without the lock for as long as the
//! counter has not moved (see `Inner::sender` in the progress module).

use crate::auth::{dialer_mac, listener_mac, Identity, Nonce};
use crate::error::{AuthError, TransportError};
use crate::fabric::wire::{Head, Msg};
use crate::ids::Rank;
use rustc_hash::FxHashMap;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// A proven peer is pinged after this much silence.
pub(super) const PING_AFTER: Duration = Duration::from_millis(1000);
/// A proven peer silent this long (pings unanswered) is lost.
pub(super) const LOST_AFTER: Duration = Duration::from_secs(5);
/// Most handshakes with unproven dialers kept at once.
const MAX_LISTENS: usize = 1024;

/// The result of a dial: the stream is ready, or failed.
pub(super) type DialResult = Result<(), TransportError>;

/// What [`Sessions::dial`] says to do.
pub(super) enum Dial {
    /// A stream to the rank exists.
    Ready,
    /// A handshake is under way: wait on the receiver.
    Wait(oneshot::Receiver<DialResult>),
    /// Send this `Hello` to the address, then wait on the receiver.
    Start(u64, Msg, oneshot::Receiver<DialResult>),
}

struct Dialing {
    fi_addr: u64,
    nonce: Nonce,
    /// The token for our messages to the listener, once its MAC verified.
    token: Option<u64>,
    started: Instant,
    waiters: Vec<oneshot::Sender<DialResult>>,
}

struct Listening {
    dialer: Rank,
    /// Where the dialer is reached (its route, or the name it sent, inserted).
    fi_addr: u64,
    nonce: Nonce,
    started: Instant,
    /// The address was inserted for this handshake (remove it if it fails).
    inserted: bool,
}

struct Alive {
    /// When the peer was last heard of, as of the last tick that saw `fresh`.
    last_heard: Instant,
    /// Heard since the last tick. Hearing is recorded without reading the clock (it
    /// happens for every message), and, through a remembered answer, without the lock;
    /// the tick, every 100 ms, dates it.
    fresh: Arc<AtomicBool>,
    pinged: Option<Instant>,
}

/// A sending stream to one peer.
struct Tx {
    fi_addr: u64,
    token: u64,
    stream: u64,
    next: u64,
}

/// Where and how to send to a peer: its address and our token for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct To {
    pub(super) fi_addr: u64,
    pub(super) token: u64,
}

/// The backend's peers; see the module docs.
pub(super) struct Sessions {
    me: Identity,
    routes: HashMap<Rank, u64>,
    /// Tokens we accept, and whose they are.
    // Looked up for every message: FxHash instead of SipHash (with the same in the
    // stream and operation tables, shm one-way latency 1.29 -> 1.24 µs, medians of
    // 4 and 6 runs). Inserted keys are ours; a peer's guessed token is only looked up.
    tokens: FxHashMap<u64, Rank>,
    /// Moves with every change to `tokens`; see the module docs.
    generation: Arc<AtomicU64>,
    alive: FxHashMap<Rank, Alive>,
    tx: FxHashMap<Rank, Tx>,
    dials: HashMap<Rank, Dialing>,
    /// Handshakes with dialers, by the dialer's nonce.
    listens: HashMap<Nonce, Listening>,
}

/// What [`Sessions::hear`] found: who sent a token, and how to remember it.
pub(super) struct Heard {
    pub(super) rank: Rank,
    /// The peer's liveness flag ([`mark`] it for every message).
    pub(super) fresh: Arc<AtomicBool>,
    /// The answer holds while [`Sessions::generation`] reads this.
    pub(super) generation: u64,
}

/// Records that a peer was heard: a load first, so that a flag already set (every
/// message but the first after a tick) costs no write to a shared line.
pub(super) fn mark(fresh: &AtomicBool) {
    if !fresh.load(Ordering::Relaxed) {
        fresh.store(true, Ordering::Relaxed);
    }
}

/// What housekeeping found.
#[derive(Default)]
pub(super) struct Tick {
    /// Proven peers to ping.
    pub(super) ping: Vec<(Rank, To)>,
    /// Peers that stopped answering.
    pub(super) lost: Vec<Rank>,
    /// Addresses inserted for failed handshakes, to remove from the AV.
    pub(super) unused: Vec<u64>,
}

fn random() -> Nonce {
    let mut n = [0u8; 32];
    // A failing OS random source leaves zeros: handshakes would then be replayable,
    // never unsafe in memory; it is logged.
    if let Err(e) = getrandom::fill(&mut n) {
        tracing::error!("the random source failed: {e}");
    }
    n
}

fn first_u64(b: &[u8; 32]) -> u64 {
    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// The session tokens of a handshake: (dialer → listener, listener → dialer). The
/// handshake sends `listener_mac(dn, ln)` and `dialer_mac(ln, dn)`; these swap the
/// nonces, so they are never sent.
fn tokens(me: &Identity, dn: &Nonce, ln: &Nonce, dialer: Rank, listener: Rank) -> (u64, u64) {
    let dl = listener_mac(&me.key, me.job, ln, dn, dialer, listener);
    let ld = dialer_mac(&me.key, me.job, dn, ln, dialer, listener);
    (first_u64(&dl), first_u64(&ld))
}

/// Compares two MACs in time independent of where they differ.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    std::hint::black_box(diff) == 0
}

impl Sessions {
    /// No peers yet.
    pub(super) fn new(me: Identity) -> Self {
        Self {
            me,
            routes: HashMap::new(),
            tokens: FxHashMap::default(),
            generation: Arc::new(AtomicU64::new(0)),
            alive: FxHashMap::default(),
            tx: FxHashMap::default(),
            dials: HashMap::new(),
            listens: HashMap::new(),
        }
    }

    /// Sets where `rank` is reached (`None`: it left). A changed address drops the
    /// stream to the old one. Returns the old address if it changed and no rank uses it
    /// any more (for the caller to remove from the address vector).
    pub(super) fn route(&mut self, rank: Rank, fi_addr: Option<u64>) -> Option<u64> {
        let old = match fi_addr {
            Some(a) => self.routes.insert(rank, a),
            None => self.routes.remove(&rank),
        };
        if old.is_some() && old != fi_addr {
            self.tx.remove(&rank);
            return old.filter(|&a| !self.in_use(a));
        }
        None
    }

    /// Whether `fi_addr` is some rank's route or stream address.
    pub(super) fn in_use(&self, fi_addr: u64) -> bool {
        self.routes.values().chain(self.tx.values().map(|t| &t.fi_addr)).any(|a| *a == fi_addr)
    }

    /// Starts or joins a handshake with `rank`, unless a stream exists.
    pub(super) fn dial(
        &mut self,
        rank: Rank,
        name: &[u8],
        now: impl FnOnce() -> Instant,
    ) -> Result<Dial, TransportError> {
        if self.tx.contains_key(&rank) {
            // Every send asks: the clock is read only for a new dial.
            return Ok(Dial::Ready);
        }
        let now = now();
        let (tx, rx) = oneshot::channel();
        if let Some(d) = self.dials.get_mut(&rank) {
            d.waiters.push(tx);
            return Ok(Dial::Wait(rx));
        }
        let fi_addr = *self.routes.get(&rank).ok_or(TransportError::UnknownPeer(rank))?;
        let nonce = random();
        self.dials.insert(rank, Dialing { fi_addr, nonce, token: None, started: now, waiters: vec![tx] });
        let hello = Msg::Hello { job: self.me.job, rank: self.me.rank, nonce, name: name.to_vec() };
        Ok(Dial::Start(fi_addr, hello, rx))
    }

    /// Where to send to `rank`, and the next head of the stream to it.
    pub(super) fn next_head(&mut self, rank: Rank) -> Option<(To, Head)> {
        let t = self.tx.get_mut(&rank)?;
        let head = Head { stream: t.stream, seq: t.next };
        t.next += 1;
        Some((To { fi_addr: t.fi_addr, token: t.token }, head))
    }

    /// Offers where to send to `rank` and the next head of the stream to it to `send`,
    /// and takes that head only if `send` used it (returned true). False without a
    /// stream.
    pub(super) fn send_next(&mut self, rank: Rank, send: impl FnOnce(To, Head) -> bool) -> bool {
        let Some(t) = self.tx.get_mut(&rank) else { return false };
        let sent = send(To { fi_addr: t.fi_addr, token: t.token }, Head { stream: t.stream, seq: t.next });
        if sent {
            t.next += 1;
        }
        sent
    }

    /// Where to send to `rank`, if a stream exists.
    pub(super) fn to(&self, rank: Rank) -> Option<To> {
        self.tx.get(&rank).map(|t| To { fi_addr: t.fi_addr, token: t.token })
    }

    /// The address of `rank`: its stream's, else its route.
    pub(super) fn addr_of(&self, rank: Rank) -> Option<u64> {
        self.tx.get(&rank).map(|t| t.fi_addr).or_else(|| self.routes.get(&rank).copied())
    }

    /// Gives up a dial that took longer than `after`, so the next one starts afresh;
    /// its other waiters get the timeout too.
    pub(super) fn abandon_dial(&mut self, rank: Rank, after: Duration) {
        if let Some(d) = self.dials.remove(&rank) {
            let what = format!("the authentication handshake with {rank}");
            for w in d.waiters {
                let _ = w.send(Err(TransportError::Timeout { what: what.clone(), after }));
            }
        }
    }

    /// A `Hello`, whose sender is reached at `fi_addr` (`inserted` for it). Returns the
    /// `Challenge` to send there, or why the hello was refused.
    pub(super) fn on_hello(&mut self, fi_addr: u64, inserted: bool, msg: &Msg, now: Instant) -> Result<Msg, AuthError> {
        let Msg::Hello { job, rank, nonce, .. } = msg else { return Err(AuthError::BadMagic) };
        if *job != self.me.job {
            return Err(AuthError::WrongJob(job.0));
        }
        if rank.0 > Rank::MAX_ID || *rank == self.me.rank {
            return Err(AuthError::UnknownRank(*rank));
        }
        if self.listens.len() >= MAX_LISTENS {
            return Err(AuthError::UnknownRank(*rank));
        }
        let mine = random();
        let mac = listener_mac(&self.me.key, self.me.job, nonce, &mine, *rank, self.me.rank);
        let l = Listening { dialer: *rank, fi_addr, nonce: mine, started: now, inserted };
        self.listens.insert(*nonce, l);
        Ok(Msg::Challenge { listener: self.me.rank, dialer_nonce: *nonce, listener_nonce: mine, mac })
    }

    /// A `Challenge`: the `Proof` to send and where, if it answers one of our dials. A
    /// bad one fails the dial.
    pub(super) fn on_challenge(&mut self, msg: &Msg, now: Instant) -> Option<(u64, Msg)> {
        let Msg::Challenge { listener, dialer_nonce, listener_nonce, mac } = msg else { return None };
        let (&rank, d) = self.dials.iter().find(|(_, d)| d.nonce == *dialer_nonce && d.token.is_none())?;
        let fi_addr = d.fi_addr;
        if *listener != rank {
            self.fail_dial(rank, AuthError::WrongPeer { expected: rank, found: *listener });
            return None;
        }
        let (me, job) = (self.me.rank, self.me.job);
        let want = listener_mac(&self.me.key, job, dialer_nonce, listener_nonce, me, rank);
        if !same(&want, mac) {
            self.fail_dial(rank, AuthError::BadProof);
            return None;
        }
        let (mine, theirs) = tokens(&self.me, dialer_nonce, listener_nonce, me, rank);
        let mac = dialer_mac(&self.me.key, job, listener_nonce, dialer_nonce, me, rank);
        self.accept(theirs, rank, now);
        if let Some(d) = self.dials.get_mut(&rank) {
            d.token = Some(mine);
        }
        Some((fi_addr, Msg::Proof { dialer_nonce: *dialer_nonce, mac }))
    }

    /// A `Proof`: on success, the rank now proven, where it is and the `Accept` to
    /// send; `Err(rank, fi_addr, inserted)` if it does not verify (the handshake is
    /// dropped).
    #[allow(clippy::type_complexity)]
    pub(super) fn on_proof(&mut self, msg: &Msg, now: Instant) -> Option<Result<(Rank, u64, Msg), (Rank, u64, bool)>> {
        let Msg::Proof { dialer_nonce, mac } = msg else { return None };
        let l = self.listens.remove(dialer_nonce)?;
        let want = dialer_mac(&self.me.key, self.me.job, &l.nonce, dialer_nonce, l.dialer, self.me.rank);
        if !same(&want, mac) {
            return Some(Err((l.dialer, l.fi_addr, l.inserted)));
        }
        let (theirs, mine) = tokens(&self.me, dialer_nonce, &l.nonce, l.dialer, self.me.rank);
        self.accept(theirs, l.dialer, now);
        self.routes.entry(l.dialer).or_insert(l.fi_addr);
        self.tx.entry(l.dialer).or_insert(Tx {
            fi_addr: l.fi_addr,
            token: mine,
            stream: first_u64(&random()),
            next: 0,
        });
        Some(Ok((l.dialer, l.fi_addr, Msg::Accept { dialer_nonce: *dialer_nonce })))
    }

    /// An `Accept`: the rank whose dial completed.
    pub(super) fn on_accept(&mut self, msg: &Msg) -> Option<Rank> {
        let Msg::Accept { dialer_nonce } = msg else { return None };
        let rank = *self.dials.iter().find(|(_, d)| d.nonce == *dialer_nonce && d.token.is_some())?.0;
        let d = self.dials.remove(&rank)?;
        let token = d.token?;
        self.tx.entry(rank).or_insert(Tx { fi_addr: d.fi_addr, token, stream: first_u64(&random()), next: 0 });
        for w in d.waiters {
            let _ = w.send(Ok(()));
        }
        Some(rank)
    }

    fn accept(&mut self, token: u64, rank: Rank, now: Instant) {
        self.tokens.insert(token, rank);
        self.generation.fetch_add(1, Ordering::Release);
        self.alive.insert(rank, Alive { last_heard: now, fresh: Arc::new(AtomicBool::new(false)), pinged: None });
    }

    fn fail_dial(&mut self, rank: Rank, why: AuthError) {
        if let Some(d) = self.dials.remove(&rank) {
            for w in d.waiters {
                let _ = w.send(Err(TransportError::Auth { peer: rank, source: why.clone() }));
            }
        }
    }

    /// Fails every dial to `fi_addr` with `err` (a send to it failed), or only the dial
    /// to `only` there: a data send names its peer, and an address index freed when a
    /// peer left may since have been given to another one, whose dial is none of its
    /// business.
    pub(super) fn fail_dials_to(&mut self, fi_addr: u64, only: Option<Rank>, err: impl Fn(Rank) -> TransportError) {
        let ranks: Vec<Rank> = self
            .dials
            .iter()
            .filter(|(r, d)| d.fi_addr == fi_addr && only.is_none_or(|o| o == **r))
            .map(|(r, _)| *r)
            .collect();
        for r in ranks {
            if let Some(d) = self.dials.remove(&r) {
                for w in d.waiters {
                    let _ = w.send(Err(err(r)));
                }
            }
        }
    }

    /// The sender [`Sessions::hear`] finds.
    #[cfg(test)]
    pub(super) fn heard(&self, token: u64) -> Option<Rank> {
        self.hear(token).map(|h| h.rank)
    }

    /// Any message other than a handshake's, carrying `token`: its sender, if the token
    /// is one we accept, with what a reader needs to remember the answer: the peer's
    /// liveness flag (set here; a later message sets it through this) and the
    /// generation the answer holds for.
    pub(super) fn hear(&self, token: u64) -> Option<Heard> {
        let rank = *self.tokens.get(&token)?;
        let fresh = Arc::clone(&self.alive.get(&rank)?.fresh);
        mark(&fresh);
        Some(Heard { rank, fresh, generation: self.generation.load(Ordering::Acquire) })
    }

    /// The counter that moves with every change to the accepted tokens.
    pub(super) fn generation(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.generation)
    }

    /// Forgets a peer that ended (goodbye or loss): its tokens, its stream.
    pub(super) fn forget(&mut self, rank: Rank) {
        self.tokens.retain(|_, r| *r != rank);
        self.generation.fetch_add(1, Ordering::Release);
        self.alive.remove(&rank);
        self.tx.remove(&rank);
    }

    /// Housekeeping: expires handshakes older than `timeout`, picks peers to ping and
    /// finds the lost ones (which it forgets).
    pub(super) fn tick(&mut self, now: Instant, timeout: Duration) -> Tick {
        let mut out = Tick::default();
        let old = |t: Instant| now.saturating_duration_since(t) > timeout;
        let stale: Vec<Rank> = self.dials.iter().filter(|(_, d)| old(d.started)).map(|(r, _)| *r).collect();
        for r in stale {
            self.abandon_dial(r, timeout);
        }
        let stale: Vec<Nonce> = self.listens.iter().filter(|(_, l)| old(l.started)).map(|(n, _)| *n).collect();
        for n in stale {
            if let Some(l) = self.listens.remove(&n) {
                if l.inserted && !self.in_use(l.fi_addr) {
                    out.unused.push(l.fi_addr);
                }
            }
        }
        for (&rank, a) in &mut self.alive {
            if a.fresh.swap(false, Ordering::Relaxed) {
                a.last_heard = now;
                a.pinged = None;
            }
            let silent = now.saturating_duration_since(a.last_heard);
            if silent > LOST_AFTER {
                out.lost.push(rank);
            } else if silent > PING_AFTER && a.pinged.is_none_or(|t| now.saturating_duration_since(t) > PING_AFTER) {
                if let Some(t) = self.tx.get(&rank) {
                    a.pinged = Some(now);
                    out.ping.push((rank, To { fi_addr: t.fi_addr, token: t.token }));
                }
            }
        }
        out
    }

    /// Ends every sending stream (the endpoint closes): the goodbyes to send.
    pub(super) fn close(&mut self) -> Vec<(Rank, To, Head)> {
        let ranks: Vec<Rank> = self.tx.keys().copied().collect();
        let byes = ranks.iter().filter_map(|r| self.next_head(*r).map(|(to, h)| (*r, to, h))).collect();
        self.tx.clear();
        for (_, d) in self.dials.drain() {
            for w in d.waiters {
                let _ = w.send(Err(TransportError::Closed));
            }
        }
        byes
    }
}

#[cfg(test)]
mod tests;
