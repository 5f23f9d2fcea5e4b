//! A reader's gets in flight: what each waits for, and where its bytes go (a new buffer,
//! or a [`Part`] of the reader's memory that the backend writes in place).

use crate::error::TransportError;
use crate::ids::Rank;
use crate::landing::Part;
use bytes::Bytes;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use tokio::sync::oneshot;

use super::WindowError;

/// What a completed get holds.
#[derive(Debug)]
pub enum Got {
    /// The bytes, in a new buffer.
    Bytes(Bytes),
    /// The part the get was started with, holding the bytes.
    Landed(Part),
}

impl Got {
    /// `bytes`, exactly the range a get asked for, in `into` (copied) if given.
    #[must_use]
    pub fn new(into: Option<Part>, bytes: Bytes) -> Self {
        match into {
            Some(mut p) => {
                p.as_mut_slice().copy_from_slice(&bytes);
                Got::Landed(p)
            }
            None => Got::Bytes(bytes),
        }
    }

    /// The bytes of a get without a part (a part's are copied out: not expected).
    #[must_use]
    pub fn into_bytes(self) -> Bytes {
        match self {
            Got::Bytes(b) => b,
            Got::Landed(p) => Bytes::copy_from_slice(p.as_slice()),
        }
    }

    /// The part of a get with one.
    ///
    /// # Errors
    /// The get completed with a new buffer instead, which a get with a part never does.
    pub fn into_part(self) -> Result<Part, TransportError> {
        match self {
            Got::Landed(p) => Ok(p),
            Got::Bytes(_) => Err(TransportError::Closed),
        }
    }
}

/// What a get resolves to.
pub type GetResult = Result<Got, TransportError>;

/// Where a pending get's bytes go.
enum Dest {
    New,
    Into(Part),
    /// The part is with the backend, which reads the reply straight into it.
    Lent,
}

struct Pending {
    peer: Rank,
    len: u64,
    dest: Dest,
    done: oneshot::Sender<GetResult>,
}

impl Pending {
    /// Fails the get. Its part goes back to its landing first: the caller may take the
    /// same range again as soon as it hears of the failure.
    fn fail(self, err: TransportError) {
        drop(self.dest);
        let _ = self.done.send(Err(err));
    }
}

/// A reader's gets in flight, by request id.
#[derive(Default)]
pub struct GetTable {
    next: AtomicU64,
    pending: Mutex<HashMap<u64, Pending>>,
}

impl GetTable {
    /// An empty table.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn insert(&self, peer: Rank, len: u64, dest: Dest) -> (u64, oneshot::Receiver<GetResult>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, Pending { peer, len, dest, done: tx });
        (id, rx)
    }

    /// Registers a get of `len` bytes from `peer` into a new buffer; returns its request
    /// id and the receiver its reply completes.
    pub fn start(&self, peer: Rank, len: u64) -> (u64, oneshot::Receiver<GetResult>) {
        self.insert(peer, len, Dest::New)
    }

    /// Registers a get from `peer` into `part` (of its length).
    pub fn start_into(&self, peer: Rank, part: Part) -> (u64, oneshot::Receiver<GetResult>) {
        self.insert(peer, part.len() as u64, Dest::Into(part))
    }

    /// Completes request `id` with data (checked against the length asked for, and
    /// copied into the get's part if it has one) or a refusal. A reply to an unknown
    /// request, from the wrong peer, or to a get whose part the backend already took, is
    /// reported as an error and changes nothing.
    ///
    /// # Errors
    /// The reply does not belong to a get in flight.
    pub fn complete(&self, from: Rank, id: u64, reply: Result<Bytes, WindowError>) -> Result<(), String> {
        let mut pending = lock(&self.pending);
        let p = match pending.remove(&id) {
            Some(p) if p.peer == from && !matches!(p.dest, Dest::Lent) => p,
            Some(p) => {
                pending.insert(id, p);
                return Err(format!("{from} replied to get request {id}, which does not wait for that reply"));
            }
            None => return Err(format!("{from} replied to get request {id}, which is not in flight to it")),
        };
        drop(pending);
        match reply {
            Ok(data) if data.len() as u64 == p.len => {
                let got = match p.dest {
                    Dest::Into(part) => Got::new(Some(part), data),
                    Dest::New | Dest::Lent => Got::Bytes(data),
                };
                let _ = p.done.send(Ok(got));
            }
            Ok(data) => {
                let what = format!("replied with {} bytes to a get of {}", data.len(), p.len);
                p.fail(TransportError::Window { peer: from, what });
            }
            Err(e) => p.fail(TransportError::Window { peer: from, what: e.to_string() }),
        }
        Ok(())
    }

    /// Lends the part of request `id` to a backend about to read a `len`-byte reply from
    /// `from` straight into it; `None` if that get has no part, or the length differs
    /// (the reply then goes through [`GetTable::complete`], which reports it).
    pub fn take_landing(&self, from: Rank, id: u64, len: u64) -> Option<Part> {
        let mut pending = lock(&self.pending);
        let p = pending.get_mut(&id).filter(|p| p.peer == from && p.len == len)?;
        match std::mem::replace(&mut p.dest, Dest::Lent) {
            Dest::Into(part) => Some(part),
            other => {
                p.dest = other;
                None
            }
        }
    }

    /// Completes request `id`, whose reply the backend read into `part` (lent by
    /// [`GetTable::take_landing`]). If the get was given up meanwhile, the part is
    /// dropped.
    pub fn complete_landed(&self, from: Rank, id: u64, part: Part) {
        let mut pending = lock(&self.pending);
        if pending.get(&id).is_some_and(|p| p.peer == from && matches!(p.dest, Dest::Lent)) {
            if let Some(p) = pending.remove(&id) {
                let _ = p.done.send(Ok(Got::Landed(part)));
            }
        }
    }

    /// Withdraws a get whose caller gave up (timeout or dropped future).
    pub fn cancel(&self, id: u64) {
        lock(&self.pending).remove(&id);
    }

    /// Fails every get in flight to `peer` (its connection is gone).
    pub fn fail_peer(&self, peer: Rank, err: impl Fn() -> TransportError) {
        let mut pending = lock(&self.pending);
        let ids: Vec<u64> = pending.iter().filter(|(_, p)| p.peer == peer).map(|(id, _)| *id).collect();
        for id in ids {
            if let Some(p) = pending.remove(&id) {
                p.fail(err());
            }
        }
    }

    /// Fails every get in flight (the endpoint closes).
    pub fn fail_all(&self) {
        for (_, p) in lock(&self.pending).drain() {
            p.fail(TransportError::Closed);
        }
    }

    /// Number of gets in flight.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        lock(&self.pending).len()
    }
}

/// Sends a get started with [`GetTable::start`] (`request`), then waits for its reply;
/// the get is withdrawn from `table` if the request fails or the wait is dropped.
///
/// # Errors
/// The request could not be sent, or the reply's error.
pub async fn await_get(
    table: &GetTable,
    id: u64,
    rx: oneshot::Receiver<GetResult>,
    request: impl Future<Output = Result<(), TransportError>>,
) -> Result<Bytes, TransportError> {
    Ok(await_result(table, id, rx, request).await?.into_bytes())
}

/// [`await_get`] for a get started with [`GetTable::start_into`]: its part, holding the
/// bytes.
///
/// # Errors
/// As [`await_get`].
pub async fn await_landed(
    table: &GetTable,
    id: u64,
    rx: oneshot::Receiver<GetResult>,
    request: impl Future<Output = Result<(), TransportError>>,
) -> Result<Part, TransportError> {
    // A get started with a part always completes with it (`complete` copies).
    await_result(table, id, rx, request).await?.into_part()
}

async fn await_result(
    table: &GetTable,
    id: u64,
    rx: oneshot::Receiver<GetResult>,
    request: impl Future<Output = Result<(), TransportError>>,
) -> GetResult {
    struct Guard<'a> {
        table: &'a GetTable,
        id: u64,
    }
    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            self.table.cancel(self.id);
        }
    }
    let _guard = Guard { table, id };
    request.await?;
    rx.await.unwrap_or(Err(TransportError::Closed))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Critical sections here leave the map consistent, so a poisoned lock is usable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::landing::Landing;
    use crate::window::WindowId;
    use std::sync::Arc;

    async fn sent() -> Result<(), TransportError> {
        Ok(())
    }

    fn bytes(r: GetResult) -> Bytes {
        match r.unwrap() {
            Got::Bytes(b) => b,
            Got::Landed(_) => panic!("landed"),
        }
    }

    #[tokio::test]
    async fn replies_complete_only_their_own_get() {
        let g = GetTable::new();
        let (id, rx) = g.start(Rank(1), 3);
        assert!(g.complete(Rank(2), id, Ok(Bytes::from_static(b"abc"))).is_err());
        assert!(g.complete(Rank(1), id + 1, Ok(Bytes::from_static(b"abc"))).is_err());
        g.complete(Rank(1), id, Ok(Bytes::from_static(b"abc"))).unwrap();
        assert_eq!(&bytes(rx.await.unwrap())[..], b"abc");
        let (id, rx) = g.start(Rank(1), 3);
        g.complete(Rank(1), id, Ok(Bytes::from_static(b"ab"))).unwrap();
        assert!(matches!(rx.await.unwrap(), Err(TransportError::Window { .. })));
        let (_, rx) = g.start(Rank(4), 3);
        g.fail_peer(Rank(4), || TransportError::PeerLost(Rank(4)));
        assert!(matches!(rx.await.unwrap(), Err(TransportError::PeerLost(Rank(4)))));
        assert_eq!(g.in_flight(), 0);
    }

    #[test]
    fn a_failed_gets_part_is_back_before_its_caller_hears() {
        // The caller takes the same range again as soon as the failure reaches it (as
        // after a refused get); a part dropped only after the failure was sent was
        // sometimes still out then. The failures come from another thread, as a
        // backend's do.
        let g = Arc::new(GetTable::new());
        let l = Landing::new(vec![0; 2], 16).unwrap();
        for round in 0..2000 {
            let (id, rx) = g.start_into(Rank(1), l.part(0..16).unwrap());
            let failer = g.clone();
            let t = std::thread::spawn(move || match round % 3 {
                0 => failer.complete(Rank(1), id, Err(WindowError::Unknown(WindowId(7)))).unwrap(),
                1 => failer.fail_peer(Rank(1), || TransportError::PeerLost(Rank(1))),
                _ => failer.fail_all(),
            });
            assert!(rx.blocking_recv().unwrap().is_err());
            assert!(l.part(0..16).is_some(), "round {round}: the failed get's part is still out");
            t.join().unwrap();
        }
    }

    #[tokio::test]
    async fn replies_land_in_their_part() {
        let g = GetTable::new();
        let l = Landing::new(vec![0; 2], 16).unwrap();
        // A small reply is copied in.
        let (id, rx) = g.start_into(Rank(1), l.part(0..3).unwrap());
        assert!(g.take_landing(Rank(1), id, 4).is_none(), "wrong length");
        g.complete(Rank(1), id, Ok(Bytes::from_static(b"abc"))).unwrap();
        let a = await_landed(&g, id, rx, sent()).await.unwrap();
        assert_eq!(a.as_slice(), b"abc");
        // A large one is read in place by the backend.
        let (id, rx) = g.start_into(Rank(1), l.part(8..16).unwrap());
        assert!(g.take_landing(Rank(2), id, 8).is_none(), "wrong peer");
        let mut p = g.take_landing(Rank(1), id, 8).unwrap();
        assert!(g.take_landing(Rank(1), id, 8).is_none(), "lent once");
        assert!(g.complete(Rank(1), id, Ok(Bytes::from_static(b"01234567"))).is_err(), "already lent");
        p.as_mut_slice().copy_from_slice(b"76543210");
        g.complete_landed(Rank(1), id, p);
        assert_eq!(await_landed(&g, id, rx, sent()).await.unwrap().as_slice(), b"76543210");
        // A get given up while its part is lent: the late part is dropped.
        let (id, rx) = g.start_into(Rank(1), l.part(3..8).unwrap());
        let p = g.take_landing(Rank(1), id, 5).unwrap();
        drop(rx);
        g.cancel(id);
        g.complete_landed(Rank(1), id, p);
        assert_eq!(g.in_flight(), 0);
        // A request that cannot be sent withdraws its get.
        let (id, rx) = g.start_into(Rank(1), l.part(3..8).unwrap());
        let failed = async { Err(TransportError::PeerLost(Rank(1))) };
        assert!(matches!(await_landed(&g, id, rx, failed).await, Err(TransportError::PeerLost(_))));
        assert_eq!(g.in_flight(), 0);
        drop(a);
        assert!(Landing::into_words(l).is_ok(), "every part returned");
    }
}
