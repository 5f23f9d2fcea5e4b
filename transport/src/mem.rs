//! An in-memory backend: every rank in one process, messages handed over directly.
//! For deterministic tests of the layers above the transport.

use crate::error::TransportError;
use crate::ids::{Context, Rank, Tag};
use crate::matching::{Envelope, Mailbox, PeerEnd};
use crate::transport::{BoxFuture, Capabilities, Endpoint, EndpointAddr, Transport};
use crate::window::{GetRequest, WindowId, WindowTable};
use bytes::Bytes;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The shared medium of an in-memory job.
pub struct MemHub {
    mailboxes: Vec<Arc<Mailbox>>,
    closed: Vec<AtomicBool>,
    windows: Vec<WindowTable>,
}

impl MemHub {
    /// A hub for `size` ranks; returns one endpoint per rank.
    #[must_use]
    pub fn endpoints(size: u32) -> Vec<Endpoint> {
        let hub = Arc::new(Self {
            mailboxes: (0..size).map(|_| Arc::new(Mailbox::new())).collect(),
            closed: (0..size).map(|_| AtomicBool::new(false)).collect(),
            windows: (0..size).map(|_| WindowTable::new()).collect(),
        });
        (0..size)
            .map(|r| {
                let t = Arc::new(MemTransport { hub: hub.clone(), rank: Rank(r) });
                Endpoint::new(t, hub.mailboxes[r as usize].clone(), Rank(r))
            })
            .collect()
    }
}

/// One rank's side of a [`MemHub`].
pub struct MemTransport {
    hub: Arc<MemHub>,
    rank: Rank,
}

impl Transport for MemTransport {
    fn name(&self) -> &'static str {
        "mem"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::BASIC
    }

    fn local_addr(&self) -> EndpointAddr {
        EndpointAddr(format!("mem:{}", self.rank.0))
    }

    fn set_peers(&self, _peers: &[EndpointAddr]) -> Result<(), TransportError> {
        Ok(())
    }

    fn send(&self, dst: Rank, ctx: Context, tag: Tag, payload: Bytes) -> BoxFuture<'_, Result<(), TransportError>> {
        let src = self.rank;
        let res = match self.hub.mailboxes.get(dst.index()) {
            None => Err(TransportError::UnknownPeer(dst)),
            Some(_) if self.hub.closed[src.index()].load(Ordering::Acquire) => Err(TransportError::Closed),
            Some(_) if self.hub.closed[dst.index()].load(Ordering::Acquire) => Err(TransportError::PeerClosed(dst)),
            Some(mb) => {
                mb.deliver(Envelope { src, ctx, tag, payload });
                Ok(())
            }
        };
        Box::pin(async move { res })
    }

    fn expose(&self, region: Bytes) -> Result<WindowId, TransportError> {
        Ok(self.hub.windows[self.rank.index()].expose(region))
    }

    fn withdraw(&self, id: WindowId) -> Result<Bytes, TransportError> {
        self.hub.windows[self.rank.index()]
            .withdraw(id)
            .map_err(|e| TransportError::Window { peer: self.rank, what: e.to_string() })
    }

    fn get(&self, dst: Rank, id: WindowId, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, TransportError>> {
        let res = match self.hub.windows.get(dst.index()) {
            None => Err(TransportError::UnknownPeer(dst)),
            Some(_) if self.hub.closed[dst.index()].load(Ordering::Acquire) => Err(TransportError::PeerClosed(dst)),
            Some(t) => t
                .read(GetRequest { window: id, offset, len })
                .map_err(|e| TransportError::Window { peer: dst, what: e.to_string() }),
        };
        Box::pin(async move { res })
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        self.hub.closed[self.rank.index()].store(true, Ordering::Release);
        for (i, mb) in self.hub.mailboxes.iter().enumerate() {
            if i != self.rank.index() {
                mb.peer_ended(self.rank, PeerEnd::Closed);
            }
        }
        Box::pin(async {})
    }
}
