//! The TCP backend (tokio).
//!
//! Each rank listens on one socket. A rank opens its own outbound connection to a peer
//! on the first send to it and uses it for every later send, so messages to one peer
//! are ordered and no simultaneous-connect race can arise; inbound connections only
//! carry messages in. Every connection starts with the job-key handshake
//! ([`crate::auth`]); accepting and authenticating runs on tokio. Authenticated inbound
//! connections are read by the [`inbound`] progress engine, which validates frames
//! ([`crate::frame`]) and delivers messages into the mailbox; a bad frame or a failed
//! handshake closes that connection only, with a logged error. Sends go through the
//! per-peer queues of [`outbound`]. A thread waiting in a blocking call moves both
//! directions itself ([`Transport::progress`]), so data keeps flowing without waking
//! other threads; the progress thread and writer tasks take over when it sleeps or
//! goes back to computing.
//!
//! One-sided reads ([`crate::window`]): a get request travels like a message; the
//! target's reader looks the range up in its window table and hands the reply (a
//! reference into the window, no copy) to the window server task, which sends it back
//! on the target's own connection to the reader. The application thread that owns the
//! window takes no part.

use crate::auth::{self, HandshakeError, Identity};
use crate::config::TransportConfig;
use crate::error::TransportError;
use crate::frame::{FrameHeader, FrameKind};
use crate::ids::{Context, Rank, Tag};
use crate::landing::Part;
use crate::transport::{BoxFuture, Capabilities, EndpointAddr, Transport, TransportSetup};
use crate::window::{self, GetRequest, GetTable, WindowError, WindowId, WindowTable, REQUEST_LEN};
use bytes::Bytes;
use inbound::{OneSided, Reader, Served};
use outbound::Outbound;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::task::AbortHandle;

mod inbound;
mod outbound;

const NAME: &str = "tcp";

struct Inner {
    me: Identity,
    cfg: TransportConfig,
    local: SocketAddr,
    peers: RwLock<Vec<Option<SocketAddr>>>,
    /// Outbound connections by peer; shared with their writer tasks, which remove their
    /// own once it is unusable (see [`Inner::outbound`]).
    out: Arc<Mutex<HashMap<Rank, Arc<Outbound>>>>,
    connecting: Mutex<HashMap<Rank, Arc<tokio::sync::Mutex<()>>>>,
    reader: Arc<Reader>,
    windows: Arc<WindowTable>,
    gets: Arc<GetTable>,
    tasks: Mutex<Vec<AbortHandle>>,
    closed: AtomicBool,
    /// Bytes queued on the outbound connections (see [`Outbound::new`]).
    pending: Arc<AtomicUsize>,
    /// The endpoint's mailbox (the reader delivers into it), which knows which peers
    /// ended.
    mailbox: Arc<crate::Mailbox>,
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
        let windows = Arc::new(WindowTable::new());
        let gets = Arc::new(GetTable::new());
        let (serve, requests) = tokio::sync::mpsc::unbounded_channel();
        let one_sided = OneSided { windows: windows.clone(), gets: gets.clone(), serve };
        let mailbox = setup.mailbox;
        let reader = Reader::start(setup.identity.rank, setup.config.get_max_payload(), mailbox.clone(), one_sided)
            .map_err(|source| TransportError::Bind { transport: NAME, addr: host.to_string(), source })?;
        let inner = Arc::new(Inner {
            me: setup.identity,
            cfg: setup.config,
            local,
            peers: RwLock::new(Vec::new()),
            out: Arc::new(Mutex::new(HashMap::new())),
            connecting: Mutex::new(HashMap::new()),
            reader,
            windows,
            gets,
            tasks: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
            pending: Arc::new(AtomicUsize::new(0)),
            mailbox,
        });
        let task = tokio::spawn(accept_loop(inner.clone(), listener));
        lock(&inner.tasks).push(task.abort_handle());
        let task = tokio::spawn(serve_gets(inner.clone(), requests));
        lock(&inner.tasks).push(task.abort_handle());
        Ok(Self { inner })
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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
    let me = inner.me.rank;
    // Any endpoint of the job may connect, including ones that joined in a resize and
    // are not in this process's table yet: holding the job key (checked by the
    // handshake) is what makes a peer a member.
    let member = |r: Rank| r.0 <= Rank::MAX_ID && r != me;
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

/// The window server: answers the get requests the reader hands over, each in its own
/// task so a slow requester holds up no other. Runs on tokio, never on the thread of
/// the application that owns the window. The answers are this task's: they end with
/// it, when the transport is dropped. (Before, an answer under way went on after the
/// drop, holding its connection open with nothing more to send, and its requester
/// waited out its timeout instead of seeing the connection end, as when the process
/// dies.)
async fn serve_gets(inner: Arc<Inner>, mut requests: UnboundedReceiver<Served>) {
    let mut replies = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            Some(served) = requests.recv() => {
                let inner = inner.clone();
                replies.spawn(async move { inner.reply(served).await });
            }
            Some(_) = replies.join_next(), if !replies.is_empty() => {}
            else => return,
        }
    }
}

impl Inner {
    async fn reply(self: &Arc<Self>, s: Served) {
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        let (kind, payload) = match s.reply {
            Ok(bytes) => (FrameKind::GetReply, bytes),
            Err(why) => (FrameKind::GetRefusal, Bytes::from(window::encode_refusal(&why))),
        };
        let header = FrameHeader::get(kind, self.me.rank, s.id, payload.len() as u64).encode();
        let sent = match self.outbound(s.peer).await {
            Ok(out) => out.send(header, payload).await,
            Err(e) => Err(e),
        };
        if let Err(e) = sent {
            tracing::warn!("{}: cannot answer a get by {}: {e}", self.me.rank, s.peer);
        }
    }

    async fn get(self: &Arc<Self>, dst: Rank, id: WindowId, offset: u64, len: u64) -> Result<Bytes, TransportError> {
        let req = GetRequest { window: id, offset, len };
        if let Some(local) = self.get_checked(dst, req)? {
            return Ok(local);
        }
        let (rid, rx) = self.gets.start(dst, len);
        self.fail_if_ended(dst, rid)?;
        window::await_get(&self.gets, rid, rx, self.request(dst, rid, req)).await
    }

    /// Withdraws get `rid` if `dst` has ended: its reply would come on the connection
    /// from `dst`, whose end failed only the gets started before it (a get started
    /// after, its request written into a socket nobody reads, waited forever: a
    /// one-sided move from a process that died as it began hung now and then).
    fn fail_if_ended(&self, dst: Rank, rid: u64) -> Result<(), TransportError> {
        if !self.mailbox.has_ended(dst) {
            return Ok(());
        }
        self.gets.cancel(rid);
        Err(self.mailbox.ended_error(dst))
    }

    /// A get straight into `into`: the reader thread reads a large reply into it.
    async fn get_into(
        self: &Arc<Self>,
        dst: Rank,
        id: WindowId,
        offset: u64,
        mut into: Part,
    ) -> Result<Part, TransportError> {
        let req = GetRequest { window: id, offset, len: into.len() as u64 };
        if let Some(local) = self.get_checked(dst, req)? {
            // The window table returned exactly the range asked for.
            into.as_mut_slice().copy_from_slice(&local);
            return Ok(into);
        }
        let (rid, rx) = self.gets.start_into(dst, into);
        self.fail_if_ended(dst, rid)?;
        window::await_landed(&self.gets, rid, rx, self.request(dst, rid, req)).await
    }

    /// Checks a get; answers one of this endpoint's own windows (`Some`).
    fn get_checked(&self, dst: Rank, req: GetRequest) -> Result<Option<Bytes>, TransportError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        let refused = |e: WindowError| TransportError::Window { peer: dst, what: e.to_string() };
        if dst == self.me.rank {
            return self.windows.read(req).map(Some).map_err(refused);
        }
        let cap = self.cfg.get_max_payload();
        if req.len > cap {
            return Err(refused(WindowError::TooLarge { len: req.len, cap }));
        }
        Ok(None)
    }

    /// Sends get request `rid` to `dst`.
    async fn request(self: &Arc<Self>, dst: Rank, rid: u64, req: GetRequest) -> Result<(), TransportError> {
        let header = FrameHeader::get(FrameKind::GetRequest, self.me.rank, rid, REQUEST_LEN as u64).encode();
        self.outbound(dst).await?.send(header, Bytes::copy_from_slice(&req.encode())).await
    }

    /// The connection to `dst`, opened (and authenticated) on first use.
    ///
    /// A task of its own opens it, and the caller waits for that task: a caller dropped
    /// meanwhile (the sends of a collective whose receive a failure notice interrupted)
    /// leaves the connection to be made. Before, the half-made connection was dropped
    /// with the caller, and the peer, which had seen it authenticate and end without a
    /// goodbye, took this process for lost: a survivor of a change abandoned for a
    /// failure then failed its recovery, "gone" to the others.
    async fn outbound(self: &Arc<Self>, dst: Rank) -> Result<Arc<Outbound>, TransportError> {
        if let Some(o) = lock(&self.out).get(&dst) {
            return Ok(o.clone());
        }
        let this = self.clone();
        match tokio::spawn(async move { this.open(dst).await }).await {
            Ok(opened) => opened,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(TransportError::Closed),
        }
    }

    /// [`Inner::outbound`]'s task: one dial per peer at a time.
    async fn open(&self, dst: Rank) -> Result<Arc<Outbound>, TransportError> {
        let gate = lock(&self.connecting).entry(dst).or_default().clone();
        let _held = gate.lock().await;
        if let Some(o) = lock(&self.out).get(&dst) {
            return Ok(o.clone());
        }
        let o = self.connect(dst).await?;
        // In the map before its writer starts: a writer that ends at once (a peer that
        // closed straight after the handshake) must find it there to remove it.
        lock(&self.out).insert(dst, o.clone());
        let (out, mine) = (self.out.clone(), o.clone());
        let task = tokio::spawn(async move {
            mine.clone().writer().await;
            // The connection failed or its peer closed it (a process that left the job
            // at a change, say): forgotten, so that its socket closes instead of lingering
            // in CLOSE-WAIT for the rest of the job, one per peer that ever left. A later
            // send to that peer dials anew.
            let mut out = lock(&out);
            if out.get(&dst).is_some_and(|o| Arc::ptr_eq(o, &mine)) {
                out.remove(&dst);
            }
        });
        let mut tasks = lock(&self.tasks);
        tasks.retain(|t| !t.is_finished());
        tasks.push(task.abort_handle());
        drop(tasks);
        Ok(o)
    }

    /// Opens and authenticates a connection to `dst`; a failed dial to a peer known
    /// to have ended fails as lost ([`crate::Mailbox::dial_error`]).
    async fn connect(&self, dst: Rank) -> Result<Arc<Outbound>, TransportError> {
        self.dial(dst).await.map_err(|e| self.mailbox.dial_error(dst, e))
    }

    async fn dial(&self, dst: Rank) -> Result<Arc<Outbound>, TransportError> {
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
        let std_stream = stream.into_std().map_err(|e| TransportError::io(dst, e))?;
        Outbound::new(dst, std_stream, self.pending.clone()).map_err(|e| TransportError::io(dst, e))
    }

    async fn send(self: &Arc<Self>, dst: Rank, ctx: Context, tag: Tag, payload: Bytes) -> Result<(), TransportError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        let cap = self.cfg.get_max_payload();
        if payload.len() as u64 > cap {
            return Err(TransportError::MessageTooLarge { peer: dst, len: payload.len(), cap });
        }
        let out = self.outbound(dst).await?;
        let header = FrameHeader::data(self.me.rank, ctx, tag, payload.len() as u64).encode();
        let res = out.send(header, payload).await;
        if res.is_err() && out.failed() {
            // The next send to this peer opens a fresh connection. Only this one is
            // removed: another may already have replaced it (two connections to a peer
            // at once could reorder its messages).
            let mut map = lock(&self.out);
            if map.get(&dst).is_some_and(|o| Arc::ptr_eq(o, &out)) {
                map.remove(&dst);
            }
        }
        res
    }

    /// Flushes queued output and reads input on the calling thread.
    fn progress(&self) -> bool {
        let mut moved = self.reader.progress(&|| self.flush().1);
        moved |= self.flush().0;
        moved
    }

    /// Writes queued output on the calling thread: whether any moved, and whether some
    /// is still queued.
    fn flush(&self) -> (bool, bool) {
        let mut moved = false;
        if self.pending.load(Ordering::Acquire) > 0 {
            for o in lock(&self.out).values() {
                moved |= o.flush();
            }
        }
        (moved, self.pending.load(Ordering::Acquire) > 0)
    }

    fn wake_writers(&self) {
        if self.pending.load(Ordering::Acquire) > 0 {
            for o in lock(&self.out).values() {
                o.wake_writer();
            }
        }
    }

    async fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let outs: Vec<Arc<Outbound>> = lock(&self.out).drain().map(|(_, o)| o).collect();
        let bye = FrameHeader::bye(self.me.rank).encode();
        let limit = self.cfg.get_handshake_timeout();
        for o in &outs {
            o.finish(bye, limit).await;
        }
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
        self.reader.shutdown();
        self.gets.fail_all();
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { polled: true, releases_windows: true, ..Capabilities::BASIC }
    }

    fn local_addr(&self) -> EndpointAddr {
        EndpointAddr(self.inner.local.to_string())
    }

    fn set_peers(&self, peers: &[EndpointAddr]) -> Result<(), TransportError> {
        let mut parsed = Vec::with_capacity(peers.len());
        for (i, a) in peers.iter().enumerate() {
            let peer = Rank(u32::try_from(i).map_err(|_| TransportError::UnknownPeer(Rank(u32::MAX)))?);
            if a.0.is_empty() {
                // An endpoint that has left the job.
                parsed.push(None);
                continue;
            }
            let sa = a.0.parse::<SocketAddr>().map_err(|_| TransportError::BadAddress {
                transport: NAME,
                peer,
                addr: a.0.clone(),
            })?;
            parsed.push(Some(sa));
        }
        *self.inner.peers.write().unwrap_or_else(std::sync::PoisonError::into_inner) = parsed;
        Ok(())
    }

    fn send(&self, dst: Rank, ctx: Context, tag: Tag, payload: Bytes) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(self.inner.send(dst, ctx, tag, payload))
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.inner.close())
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async {
            let ended = |r: &Rank| self.inner.mailbox.has_ended(*r);
            let outs: Vec<Arc<Outbound>> =
                lock(&self.inner.out).iter().filter(|(r, _)| !ended(r)).map(|(_, o)| o.clone()).collect();
            for o in outs {
                o.drained().await;
            }
            Ok(())
        })
    }

    fn expose(&self, region: Bytes) -> Result<WindowId, TransportError> {
        Ok(self.inner.windows.expose(region))
    }

    fn withdraw(&self, id: WindowId) -> Result<Bytes, TransportError> {
        self.inner
            .windows
            .withdraw(id)
            .map_err(|e| TransportError::Window { peer: self.inner.me.rank, what: e.to_string() })
    }

    fn get(&self, dst: Rank, id: WindowId, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, TransportError>> {
        Box::pin(self.inner.get(dst, id, offset, len))
    }

    fn get_into(
        &self,
        dst: Rank,
        id: WindowId,
        offset: u64,
        into: Part,
    ) -> BoxFuture<'_, Result<Part, TransportError>> {
        Box::pin(self.inner.get_into(dst, id, offset, into))
    }

    fn progress(&self) -> bool {
        self.inner.progress()
    }

    fn poll_begin(&self) {
        self.inner.reader.poll_begin();
    }

    fn poll_end(&self, parking: bool) {
        self.inner.reader.poll_end(parking, &|| self.inner.flush().1);
        if parking {
            self.inner.wake_writers();
        }
    }

    fn call_end(&self) {
        self.inner.wake_writers();
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
