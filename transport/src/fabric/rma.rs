//! Registered memory peers read: exposed windows and rendezvous payloads, and the
//! owner's side of window queries.
//!
//! A region is registered with `FI_REMOTE_READ` and described to readers by a
//! [`Region`]: the address of its first byte as the provider wants it (the virtual
//! address under `FI_MR_VIRT_ADDR`, else 0), and its key: the one we requested (unique
//! per endpoint), the provider's (`FI_MR_PROV_KEY`), or raw bytes the reader maps
//! (`FI_MR_RAW`). The `Bytes` stay referenced for as long as the registration lives, and
//! the registration is closed before the reference is dropped.
//!
//! Closing a registration does not stop every provider from reading the memory (shm
//! reads through CMA without checking keys), so readers never keep a descriptor: every
//! get takes a *lease* (the owner's answer to its query) and releases it once its read
//! completed. A withdrawn window refuses new queries at once ("not exposed"); its
//! registration and bytes are kept until its last lease is released or its holder
//! ends, so no read can reach freed memory. Rendezvous payloads are likewise kept until
//! the reader's `Fin` (or its end).

use super::ofi::{lock, Remote};
use super::state::Inner;
use super::wire::{put_region, read_region, Msg, Region, MAX_KEY, MAX_REGION};
use crate::error::TransportError;
use crate::ids::Rank;
use crate::window::{encode_refusal, WindowError, WindowId, REFUSAL_LEN};
use bytes::Bytes;
use std::collections::HashMap;

pub(super) use super::transfer::Transfers;

/// An exposed window's registration, which holds a reference to its bytes (the
/// `WindowTable` holds another, for local gets).
pub(super) struct Exposed {
    remote: Remote,
    /// Leases granted and not yet released.
    leases: usize,
}

/// The windows' registrations and leases.
#[derive(Default)]
pub(super) struct Leases {
    pub(super) exposed: HashMap<WindowId, Exposed>,
    /// Withdrawn windows with leases outstanding.
    pub(super) retired: HashMap<WindowId, Exposed>,
    /// Granted leases: (holder, its request id) → window.
    pub(super) granted: HashMap<(Rank, u64), WindowId>,
}

impl Leases {
    /// Releases one lease; a withdrawn window whose last lease it was is dropped.
    fn release(&mut self, key: (Rank, u64)) -> bool {
        let Some(w) = self.granted.remove(&key) else { return false };
        if let Some(e) = self.exposed.get_mut(&w) {
            e.leases = e.leases.saturating_sub(1);
        } else if let Some(r) = self.retired.get_mut(&w) {
            r.leases = r.leases.saturating_sub(1);
            if r.leases == 0 {
                self.retired.remove(&w);
            }
        }
        true
    }

    /// Releases every lease `peer` holds (it ended).
    pub(super) fn release_peer(&mut self, peer: Rank) {
        let keys: Vec<(Rank, u64)> = self.granted.keys().filter(|(r, _)| *r == peer).copied().collect();
        for k in keys {
            self.release(k);
        }
    }

    /// Drops everything (teardown).
    pub(super) fn clear(&mut self) {
        self.exposed.clear();
        self.retired.clear();
        self.granted.clear();
    }
}

/// A rendezvous payload a peer is reading, registered.
pub(super) struct Outgoing {
    /// The registration a reader reads (none for a bulk payload, whose chunks the
    /// operations in flight hold).
    _remote: Option<Remote>,
    /// The reader.
    pub(super) peer: Rank,
    /// A bulk payload's chunks whose sends have not completed yet.
    pub(super) chunks: usize,
}

/// Bytes of a descriptor as it passes through the `GetTable`: the window's size and
/// its region.
pub(super) const DESC_LEN: usize = 8 + MAX_REGION;

/// Encodes (size, region) at a fixed length, for the `GetTable`'s length check.
pub(super) fn encode_desc(size: u64, r: &Region) -> Bytes {
    let mut b = Vec::with_capacity(DESC_LEN);
    b.extend_from_slice(&size.to_le_bytes());
    put_region(&mut b, r);
    b.resize(DESC_LEN, 0);
    Bytes::from(b)
}

/// Decodes [`encode_desc`]; `None` if malformed.
pub(super) fn decode_desc(b: &[u8]) -> Option<(u64, Region)> {
    if b.len() != DESC_LEN {
        return None;
    }
    let size = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
    Some((size, read_region(&b[8..])?))
}

impl Inner {
    /// Registers `bytes` for remote reads.
    fn register_remote(&self, bytes: Bytes) -> Result<Remote, TransportError> {
        let remote = self.registrar.remote(bytes).map_err(|e| self.ofi_err(self.me.rank, e))?;
        if remote.key().key.len() > MAX_KEY {
            let e = format!("a {}-byte MR key is too long", remote.key().key.len());
            return Err(self.ofi_err(self.me.rank, e));
        }
        Ok(remote)
    }

    /// Exposes a window: a local registration.
    pub(super) fn expose(&self, region: Bytes) -> Result<WindowId, TransportError> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        let remote = self.register_remote(region.clone())?;
        let mut leases = lock(&self.leases);
        let id = self.windows.expose(region);
        leases.exposed.insert(id, Exposed { remote, leases: 0 });
        Ok(id)
    }

    /// Withdraws a window: new queries are refused at once; the registration and bytes
    /// are released now, or when its last lease is.
    pub(super) fn withdraw(&self, id: WindowId) -> Result<Bytes, TransportError> {
        let refused = |e: WindowError| TransportError::Window { peer: self.me.rank, what: e.to_string() };
        let mut leases = lock(&self.leases);
        let exposed = leases.exposed.remove(&id).ok_or(WindowError::Unknown(id)).map_err(refused)?;
        let bytes = self.windows.withdraw(id).map_err(refused)?;
        if exposed.leases > 0 {
            leases.retired.insert(id, exposed);
        }
        Ok(bytes)
    }

    /// Answers a window query from a proven peer: a descriptor and a lease, or a refusal.
    pub(super) fn answer_query(&self, rank: Rank, req: u64, window: WindowId) {
        let mut leases = lock(&self.leases);
        let granted = leases.exposed.get_mut(&window).map(|e| {
            e.leases += 1;
            Msg::Desc { req, size: e.remote.len() as u64, region: e.remote.key().clone() }
        });
        if granted.is_some() {
            leases.granted.insert((rank, req), window);
        }
        drop(leases);
        let reply = match granted {
            Some(desc) => desc,
            None => {
                tracing::warn!("{}: refused a get by {rank}: {}", self.me.rank, WindowError::Unknown(window));
                let mut why = [0u8; REFUSAL_LEN];
                let enc = encode_refusal(&WindowError::Unknown(window));
                let n = enc.len().min(REFUSAL_LEN);
                why[..n].copy_from_slice(&enc[..n]);
                Msg::Refusal { req, why }
            }
        };
        self.reply(rank, &reply);
    }

    /// Registers a rendezvous payload for `dst` to read; returns its id and region.
    pub(super) fn offer(&self, dst: Rank, payload: &Bytes) -> Result<(u64, Region), TransportError> {
        let remote = self.register_remote(payload.clone())?;
        let region = remote.key().clone();
        let id = self.next_id();
        lock(&self.outgoing).insert(id, Outgoing { _remote: Some(remote), peer: dst, chunks: 0 });
        Ok((id, region))
    }

    /// Sends bulk payload `id` to `dst` at `to`, in chunks of at most `self.chunk` bytes
    /// as the provider's tagged messages (see [`super::wire::bulk_tag`]); it counts as
    /// outgoing until every chunk's send completed. A chunk whose post fails is an
    /// error: the caller ends the peer (its receiver would wait for that chunk).
    pub(super) fn send_bulk(
        &self,
        dst: Rank,
        to: super::session::To,
        id: u64,
        payload: &Bytes,
    ) -> Result<(), TransportError> {
        let chunks = payload.len().div_ceil(self.chunk);
        if chunks == 0 {
            return Ok(());
        }
        lock(&self.outgoing).insert(id, Outgoing { _remote: None, peer: dst, chunks });
        let deadline = std::time::Instant::now() + self.cfg.get_connect_timeout();
        for k in 0..chunks {
            let range = k * self.chunk..payload.len().min((k + 1) * self.chunk);
            let tag = super::wire::bulk_tag(to.token, id, k as u64);
            let (ctx, post) = self.ops.add_bulk_send(dst, to.fi_addr, tag, id, payload.slice(range));
            if let Err((op, e)) = self.ops.post(&self.ep, ctx, post, deadline) {
                drop(op);
                return Err(self.ofi_err(dst, format!("cannot send a bulk payload: {e}")));
            }
        }
        Ok(())
    }

    /// The send of one chunk of bulk payload `id` to `rank` completed.
    pub(super) fn bulk_chunk_sent(&self, rank: Rank, id: u64) {
        let mut out = lock(&self.outgoing);
        if let Some(o) = out.get_mut(&id).filter(|o| o.peer == rank && o.chunks > 0) {
            o.chunks -= 1;
            if o.chunks == 0 {
                out.remove(&id);
            }
        }
    }

    /// A reader is done with its lease of request `req`.
    pub(super) fn released(&self, rank: Rank, req: u64) {
        if !lock(&self.leases).release((rank, req)) {
            tracing::warn!("{}: {rank} released lease {req}, which it does not hold", self.me.rank);
        }
    }

    /// A reader finished with rendezvous payload `id`.
    pub(super) fn outgoing_done(&self, rank: Rank, id: u64) {
        let mut out = lock(&self.outgoing);
        if out.get(&id).is_some_and(|o| o.peer == rank && o.chunks == 0) {
            out.remove(&id);
        } else {
            tracing::warn!("{}: {rank} finished reading {id}, which it was not offered", self.me.rank);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_at_a_fixed_length() {
        let owner = crate::fabric::ofi::Owner { pid: 77, ns: 5 };
        let r = Region { addr: 0xdead_beef, raw_base: 3, key: vec![9; 8], owner };
        let b = encode_desc(4096, &r);
        assert_eq!(b.len(), DESC_LEN);
        assert_eq!(decode_desc(&b), Some((4096, r)));
        assert_eq!(decode_desc(&b[1..]), None);
        let mut bad = b.to_vec();
        // The key's length, past the size, addresses and owner.
        bad[8 + 8 + 8 + 4 + 8] = 200;
        assert_eq!(decode_desc(&bad), None);
    }
}
