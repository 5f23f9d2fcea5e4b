//! The TCP backend (tokio).
//!
//! Each rank listens on one socket. A rank opens its own outbound connection to a peer
//! on the first send to it and uses it for every later send, so messages to one peer
//! are ordered and no simultaneous-connect race can arise; inbound connections only
//! carry messages in. Every connection starts with the job-key handshake
//! ([`crate::auth`]); accepting and authenticating runs on tokio. Authenticated inbound
//! connections are read by the [`inbound`] progress engine, which validates frames
//! ([`crate::frame`]) and delivers messages into the mailbox; a bad frame or a failed
//! handshake closes that connection only, with a logged error.

use crate::auth::{self, HandshakeError, Identity};
use crate::config::TransportConfig;
use crate::error::TransportError;
use crate::frame::{FrameHeader, HEADER_LEN};
use crate::ids::{Context, Rank, Tag};
use crate::transport::{BoxFuture, Capabilities, EndpointAddr, Transport, TransportSetup};
use bytes::Bytes;
use inbound::Reader;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

mod inbound;

const NAME: &str = "tcp";
/// Payloads up to this size are copied behind the header and written with one call.
const COALESCE_MAX: usize = 16 * 1024;

type Slot = Arc<tokio::sync::Mutex<Option<OwnedWriteHalf>>>;

struct Inner {
    me: Identity,
    cfg: TransportConfig,
    local: SocketAddr,
    size: AtomicU32,
    peers: RwLock<Vec<Option<SocketAddr>>>,
    out: Mutex<HashMap<Rank, Slot>>,
    reader: Arc<Reader>,
    tasks: Mutex<Vec<AbortHandle>>,
    closed: AtomicBool,
}

/// The TCP backend; see the module docs.
pub struct TcpTransport {
    inner: Arc<Inner>,
}

impl TcpTransport {
    /// Binds a listening socket on the configured host and an ephemeral port, and starts
    /// the accept loop on the current tokio runtime.
    ///
    /// # Errors
    /// The socket cannot be bound.
    pub fn bind(setup: TransportSetup) -> Result<Self, TransportError> {
        let host = setup.config.get_bind_host();
        let bind_err = |source| TransportError::Bind { transport: NAME, addr: host.to_string(), source };
        let std_listener = std::net::TcpListener::bind((host, 0)).map_err(bind_err)?;
        std_listener.set_nonblocking(true).map_err(bind_err)?;
        let local = std_listener.local_addr().map_err(bind_err)?;
        let listener = TcpListener::from_std(std_listener).map_err(bind_err)?;
        let reader = Reader::start(setup.identity.rank, setup.config.get_max_payload(), setup.mailbox.clone())
            .map_err(|source| TransportError::Bind { transport: NAME, addr: host.to_string(), source })?;
        let inner = Arc::new(Inner {
            me: setup.identity,
            cfg: setup.config,
            local,
            size: AtomicU32::new(setup.size),
            peers: RwLock::new(Vec::new()),
            out: Mutex::new(HashMap::new()),
            reader,
            tasks: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
        });
        let task = tokio::spawn(accept_loop(inner.clone(), listener));
        lock(&inner.tasks).push(task.abort_handle());
        Ok(Self { inner })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section here leaves the data consistent, so a poisoned lock
    // (a panic elsewhere while holding it) is safe to keep using.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((stream, from)) => {
                let task = tokio::spawn(serve_inbound(inner.clone(), stream, from));
                lock(&inner.tasks).push(task.abort_handle());
            }
            Err(e) => {
                tracing::warn!("tcp accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
    }
}

async fn serve_inbound(inner: Arc<Inner>, mut stream: TcpStream, from: SocketAddr) {
    let _ = stream.set_nodelay(true);
    let size = inner.size.load(Ordering::Acquire);
    let me = inner.me.rank;
    let member = |r: Rank| r.0 < size && r != me;
    let peer = match auth::accept(&mut stream, &inner.me, member, inner.cfg.get_handshake_timeout()).await {
        Ok(p) => p,
        Err(e) => {
            tracing::error!("{me}: rejected connection from {from}: {e}");
            return;
        }
    };
    tracing::debug!("{me}: {peer} connected from {from}");
    let added = stream.into_std().and_then(|s| inner.reader.add(peer, s));
    if let Err(e) = added {
        tracing::error!("{me}: cannot take the connection from {peer}: {e}");
    }
}

impl Inner {
    fn slot(&self, dst: Rank) -> Slot {
        lock(&self.out).entry(dst).or_default().clone()
    }

    async fn connect(&self, dst: Rank) -> Result<OwnedWriteHalf, TransportError> {
        let addr = {
            let peers = self.peers.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            peers.get(dst.index()).copied().flatten().ok_or(TransportError::UnknownPeer(dst))?
        };
        let t = self.cfg.get_connect_timeout();
        let mut stream = match tokio::time::timeout(t, TcpStream::connect(addr)).await {
            Ok(r) => r.map_err(|e| TransportError::io(dst, e))?,
            Err(_) => {
                return Err(TransportError::Timeout { what: format!("a connection to {dst} at {addr}"), after: t })
            }
        };
        stream.set_nodelay(true).map_err(|e| TransportError::io(dst, e))?;
        auth::dial(&mut stream, &self.me, dst, self.cfg.get_handshake_timeout()).await.map_err(|e| match e {
            HandshakeError::Auth(source) => TransportError::Auth { peer: dst, source },
            HandshakeError::Io(e) => TransportError::io(dst, e),
        })?;
        let (_read, write) = stream.into_split();
        Ok(write)
    }

    async fn send(&self, dst: Rank, ctx: Context, tag: Tag, payload: Bytes) -> Result<(), TransportError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        let cap = self.cfg.get_max_payload();
        if payload.len() as u64 > cap {
            return Err(TransportError::MessageTooLarge { peer: dst, len: payload.len(), cap });
        }
        let slot = self.slot(dst);
        let mut guard = slot.lock().await;
        if guard.is_none() {
            *guard = Some(self.connect(dst).await?);
        }
        let Some(w) = guard.as_mut() else { return Err(TransportError::Closed) };
        let header = FrameHeader::data(self.me.rank, ctx, tag, payload.len() as u64).encode();
        let res = if payload.len() <= COALESCE_MAX {
            let mut frame = Vec::with_capacity(HEADER_LEN + payload.len());
            frame.extend_from_slice(&header);
            frame.extend_from_slice(&payload);
            w.write_all(&frame).await
        } else {
            match w.write_all(&header).await {
                Ok(()) => w.write_all(&payload).await,
                Err(e) => Err(e),
            }
        };
        if let Err(e) = res {
            *guard = None;
            return Err(TransportError::io(dst, e));
        }
        Ok(())
    }

    async fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let slots: Vec<(Rank, Slot)> = lock(&self.out).drain().collect();
        for (dst, slot) in slots {
            let mut guard = slot.lock().await;
            if let Some(mut w) = guard.take() {
                let bye = FrameHeader::bye(self.me.rank).encode();
                let t = self.cfg.get_handshake_timeout();
                let done = tokio::time::timeout(t, async {
                    w.write_all(&bye).await?;
                    w.shutdown().await
                });
                match done.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::debug!("goodbye to {dst} failed: {e}"),
                    Err(_) => tracing::debug!("goodbye to {dst} timed out"),
                }
            }
        }
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
        self.reader.shutdown();
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { tagged: true, one_sided: false }
    }

    fn local_addr(&self) -> EndpointAddr {
        EndpointAddr(self.inner.local.to_string())
    }

    fn set_peers(&self, peers: &[EndpointAddr]) -> Result<(), TransportError> {
        let mut parsed = Vec::with_capacity(peers.len());
        for (i, a) in peers.iter().enumerate() {
            let peer = Rank(u32::try_from(i).map_err(|_| TransportError::UnknownPeer(Rank(u32::MAX)))?);
            let sa = a.0.parse::<SocketAddr>().map_err(|_| TransportError::BadAddress {
                transport: NAME,
                peer,
                addr: a.0.clone(),
            })?;
            parsed.push(Some(sa));
        }
        let n = u32::try_from(parsed.len()).unwrap_or(u32::MAX);
        *self.inner.peers.write().unwrap_or_else(std::sync::PoisonError::into_inner) = parsed;
        self.inner.size.store(n, Ordering::Release);
        Ok(())
    }

    fn send(&self, dst: Rank, ctx: Context, tag: Tag, payload: Bytes) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(self.inner.send(dst, ctx, tag, payload))
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.inner.close())
    }

    fn progress(&self) -> bool {
        self.inner.reader.progress()
    }

    fn poll_begin(&self) {
        self.inner.reader.poll_begin();
    }

    fn poll_end(&self, parking: bool) {
        self.inner.reader.poll_end(parking);
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // Local cleanup only: stop the progress tasks and thread. Goodbyes are sent
        // by close().
        for t in lock(&self.inner.tasks).drain(..) {
            t.abort();
        }
        self.inner.reader.shutdown();
    }
}
