//! The `Transport` trait, the registry of backends, and the `Endpoint` that the runtime
//! uses (a backend plus the shared matching engine).

use crate::auth::Identity;
use crate::config::TransportConfig;
use crate::error::TransportError;
use crate::ids::{Context, Rank, Tag};
use crate::landing::Part;
use crate::matching::{Envelope, Landed, Mailbox, Pattern, PostingInto};
use crate::window::WindowId;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;
use tokio::sync::oneshot;

/// A boxed future, as returned by the object-safe [`Transport`] methods.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A backend's address for one endpoint, in the backend's own text form.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EndpointAddr(pub String);

impl fmt::Display for EndpointAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a backend offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Tagged two-sided messages.
    pub tagged: bool,
    /// One-sided reads from remote windows.
    pub one_sided: bool,
    /// An application thread that calls [`Transport::progress`] while it waits moves the
    /// backend's data itself (tcp, fabric). Otherwise the backend's own tasks do all of
    /// it, and a waiting thread that spins only takes their processor.
    pub polled: bool,
    /// One-sided reads of one owner's memory are served one at a time: fabric's shm
    /// provider holds the owner's region lock for the whole copy of each read, and
    /// readers that come together spin on it, taking the processor from the one that
    /// copies. Readers of such a backend do better taking turns.
    pub serial_reads: bool,
    /// The backend faults in the pages of the memory it fills for gets and in-place
    /// receives itself, in the threads that copy into it, several at once: a caller
    /// that populates fresh memory first only does serially what the copies would do
    /// in parallel (fabric over shm, whose readers copy peers' memory themselves).
    pub populates: bool,
    /// Peers reach each other through the memory of one host (fabric's shm provider):
    /// the runtime may hand whole pages of one-sidedly moved blocks over between
    /// processes instead of copying them.
    pub shares_memory: bool,
    /// Once a get's reader has its bytes, the backend holds no reference to the
    /// window's memory (tcp: a reply is copied into the socket as it is written; fabric
    /// shm where readers copy the owner's memory themselves: the registration, which
    /// pins nothing, is closed with the window), so a withdrawn window's pages may be moved
    /// elsewhere (the runtime recycles them into new blocks). Not quic (sent stream
    /// data is kept until acknowledged) nor fabric over other providers (registrations
    /// pin pages, and their caches may outlive a window). Sends are another matter: a
    /// send completes once queued, so its bytes are held until the peer reads them; the
    /// runtime waits for its last reference to go.
    pub releases_windows: bool,
}

impl Capabilities {
    /// Tagged messages and one-sided reads, nothing more: what every backend starts
    /// from.
    pub const BASIC: Self = Self {
        tagged: true,
        one_sided: true,
        polled: false,
        serial_reads: false,
        populates: false,
        shares_memory: false,
        releases_windows: false,
    };
}

/// A message transport backend.
///
/// Backends move bytes and deliver each arriving message into the [`Mailbox`] they were
/// bound with; matching lives above them, so every backend matches the same way.
/// Connections are opened lazily, on the first send to a peer, and authenticated with
/// the job key.
pub trait Transport: Send + Sync + 'static {
    /// The backend's name (`tcp`, `mem`, ...).
    fn name(&self) -> &'static str;
    /// What it offers.
    fn capabilities(&self) -> Capabilities;
    /// The address peers reach this endpoint at.
    fn local_addr(&self) -> EndpointAddr;
    /// Installs the job's address table, indexed by rank.
    ///
    /// # Errors
    /// An address that does not parse for this backend.
    fn set_peers(&self, peers: &[EndpointAddr]) -> Result<(), TransportError>;
    /// Sends a tagged message. Messages to one destination arrive in the order sent.
    fn send(&self, dst: Rank, ctx: Context, tag: Tag, payload: Bytes) -> BoxFuture<'_, Result<(), TransportError>>;
    /// Sends a tagged message at once if the backend can without waiting (a peer it is
    /// connected to, a message small enough to leave in one call): true if sent, false
    /// if the caller must use [`Transport::send`]. The latency path skips the send's
    /// future this way; the default never sends at once. It may be called outside any
    /// blocking call (no [`Transport::call_end`] follows), so a message it takes must be
    /// wholly with the backend, nothing left for the calling thread's polling to move.
    fn send_at_once(&self, dst: Rank, ctx: Context, tag: Tag, payload: &[u8]) -> bool {
        let _ = (dst, ctx, tag, payload);
        false
    }
    /// Says goodbye to every connected peer and stops serving connections.
    fn close(&self) -> BoxFuture<'_, ()>;
    /// Completes once every message sent before the call has left this process for
    /// good, to each peer that is still there: written to the kernel (tcp), read by
    /// the peer (quic), read by the peer out of this process's memory (fabric's
    /// rendezvous payloads). A send's own completion says less, that the caller is done
    /// with the payload: its bytes may still be in this process, and go with it if it
    /// dies. A process that must not take undelivered data with it (one that has
    /// finished moving its part of a redistribution) flushes. Peers that ended are not
    /// waited for. The default suits a backend that keeps nothing back.
    fn flush(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async { Ok(()) })
    }
    /// Makes progress on the calling thread without blocking: delivers whatever has
    /// arrived, and says whether any data came in. Waiting application threads call it
    /// while they spin; backends whose progress needs no help keep this default.
    fn progress(&self) -> bool {
        false
    }
    /// An application thread starts polling with [`Transport::progress`] in a loop;
    /// backends may stop their own progress tasks from competing for the data.
    fn poll_begin(&self) {}
    /// The polling thread stops, `parking` if it is about to sleep (otherwise it goes
    /// back to the application): backends resume their own progress and pick up
    /// anything that arrived meanwhile.
    fn poll_end(&self, parking: bool) {
        let _ = parking;
    }
    /// A blocking call on this thread ended: data it left for its own polling to move
    /// is handed to the backend's progress tasks.
    fn call_end(&self) {}

    /// Exposes `region` for one-sided reads by peers under a fresh id.
    ///
    /// # Local
    /// A registration on this endpoint only; nothing is sent.
    ///
    /// # Errors
    /// The backend has no one-sided reads, or cannot register the memory.
    fn expose(&self, region: Bytes) -> Result<WindowId, TransportError> {
        let _ = region;
        Err(TransportError::Unsupported { transport: self.name(), what: "one-sided windows" })
    }

    /// Withdraws a window: later gets of it are refused. Returns the region.
    ///
    /// # Local
    ///
    /// # Errors
    /// The window is not exposed here.
    fn withdraw(&self, id: WindowId) -> Result<Bytes, TransportError> {
        let _ = id;
        Err(TransportError::Unsupported { transport: self.name(), what: "one-sided windows" })
    }

    /// Reads `len` bytes at `offset` of `dst`'s window `id` into a new local buffer.
    /// The future completes once the bytes are here (or the owner refused the range);
    /// the owner's application thread takes no part. A get of this endpoint's own
    /// window is served locally. Dropping the future abandons the get.
    fn get(&self, dst: Rank, id: WindowId, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, TransportError>> {
        let _ = (dst, id, offset, len);
        let name = self.name();
        Box::pin(async move { Err(TransportError::Unsupported { transport: name, what: "one-sided windows" }) })
    }

    /// Reads `into.len()` bytes at `offset` of `dst`'s window `id` into `into`, and gives
    /// the part back holding them: like [`Transport::get`], without a new buffer. A
    /// backend that can, writes the bytes in place as they arrive; the default copies a
    /// [`Transport::get`]'s buffer. Dropping the future abandons the get (a backend
    /// still writing keeps the part until it is done).
    fn get_into(
        &self,
        dst: Rank,
        id: WindowId,
        offset: u64,
        mut into: Part,
    ) -> BoxFuture<'_, Result<Part, TransportError>> {
        Box::pin(async move {
            let got = self.get(dst, id, offset, into.len() as u64).await?;
            if got.len() != into.len() {
                let what = format!("replied with {} bytes to a get of {}", got.len(), into.len());
                return Err(TransportError::Window { peer: dst, what });
            }
            into.as_mut_slice().copy_from_slice(&got);
            Ok(into)
        })
    }
}

thread_local! {
    static POLLS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as one that polls the transport until its current blocking
/// call ends (set by the runtime's blocking executor around each call).
pub fn set_thread_polls(on: bool) {
    POLLS.with(|p| p.set(on));
}

/// Whether the calling thread polls the transport until its current call ends.
#[must_use]
pub fn thread_polls() -> bool {
    POLLS.with(std::cell::Cell::get)
}

/// What a backend needs to bind.
#[derive(Clone)]
pub struct TransportSetup {
    /// Our identity (job, key, rank).
    pub identity: Identity,
    /// Number of ranks in the job when binding (members are ranks below it).
    pub size: u32,
    /// Settings.
    pub config: TransportConfig,
    /// Where arriving messages go.
    pub mailbox: Arc<Mailbox>,
}

/// The names of the backends this build can bind.
#[must_use]
pub fn backends() -> &'static [&'static str] {
    &[
        "tcp",
        #[cfg(feature = "quic")]
        "quic",
        #[cfg(feature = "fabric")]
        "fabric",
    ]
}

/// Binds a backend by name. Needs a running tokio runtime (it spawns the backend's
/// progress tasks there). The single registration point of backends.
///
/// # Errors
/// An unknown backend name, or the backend's own bind error.
pub fn bind(name: &str, setup: TransportSetup) -> Result<Arc<dyn Transport>, TransportError> {
    match name {
        "tcp" => Ok(Arc::new(crate::tcp::TcpTransport::bind(setup)?)),
        #[cfg(feature = "quic")]
        "quic" => Ok(Arc::new(crate::quic::QuicTransport::bind(setup)?)),
        #[cfg(feature = "fabric")]
        "fabric" => Ok(Arc::new(crate::fabric::FabricTransport::bind(setup)?)),
        "mem" => Err(TransportError::Unsupported { transport: "mem", what: "binding by name (use MemHub)" }),
        #[cfg(not(feature = "quic"))]
        "quic" => Err(TransportError::Unsupported { transport: "quic", what: "this build (cargo feature `quic`)" }),
        #[cfg(not(feature = "fabric"))]
        "fabric" => {
            Err(TransportError::Unsupported { transport: "fabric", what: "this build (cargo feature `fabric`)" })
        }
        _ => Err(TransportError::Unsupported { transport: "ductile", what: "this transport name" }),
    }
}

/// One rank's endpoint: a backend plus its matching engine.
#[derive(Clone)]
pub struct Endpoint {
    transport: Arc<dyn Transport>,
    mailbox: Arc<Mailbox>,
    rank: Rank,
}

impl Endpoint {
    /// Wraps a bound backend and the mailbox it delivers into.
    #[must_use]
    pub fn new(transport: Arc<dyn Transport>, mailbox: Arc<Mailbox>, rank: Rank) -> Self {
        Self { transport, mailbox, rank }
    }

    /// Our rank.
    #[must_use]
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The backend.
    #[must_use]
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// The matching engine.
    #[must_use]
    pub fn mailbox(&self) -> &Arc<Mailbox> {
        &self.mailbox
    }

    /// Makes progress on the calling thread; see [`Transport::progress`].
    pub fn progress(&self) -> bool {
        self.transport.progress()
    }

    /// See [`Transport::poll_begin`].
    pub fn poll_begin(&self) {
        self.transport.poll_begin();
    }

    /// Runs `f` as a blocking call of this thread: the thread polls until `f` returns
    /// (see [`thread_polls`]); afterwards queued work goes to the progress tasks.
    pub fn blocking_call<R>(&self, f: impl FnOnce() -> R) -> R {
        let outer = thread_polls();
        set_thread_polls(true);
        let r = f();
        set_thread_polls(outer);
        if !outer {
            self.transport.call_end();
        }
        r
    }

    /// See [`Transport::poll_end`].
    pub fn poll_end(&self, parking: bool) {
        self.transport.poll_end(parking);
    }

    /// Sends a message; a message to ourselves is delivered locally.
    ///
    /// # Errors
    /// The backend's send error.
    pub async fn send(&self, dst: Rank, ctx: Context, tag: Tag, payload: Bytes) -> Result<(), TransportError> {
        if dst == self.rank {
            self.mailbox.deliver(Envelope { src: dst, ctx, tag, payload });
            return Ok(());
        }
        if self.send_now(dst, ctx, tag, &payload) {
            return Ok(());
        }
        self.transport.send(dst, ctx, tag, payload).await
    }

    /// Waits, within `timeout`, until every message sent so far has left this process;
    /// see [`Transport::flush`].
    ///
    /// # Errors
    /// A timeout, or the backend's error.
    pub async fn flush(&self, timeout: Duration) -> Result<(), TransportError> {
        match tokio::time::timeout(timeout, self.transport.flush()).await {
            Ok(r) => r,
            Err(_) => Err(TransportError::Timeout { what: "its sends to leave this process".into(), after: timeout }),
        }
    }

    /// Sends a message to a peer within this call if the backend takes it at once (see
    /// [`Transport::send_at_once`]): true if sent. False: nothing was sent, and
    /// [`Endpoint::send`] sends it (and reports any error). A blocking send tries this
    /// first, which spares the small-message path a future and an executor.
    #[must_use]
    pub fn send_now(&self, dst: Rank, ctx: Context, tag: Tag, payload: &[u8]) -> bool {
        dst != self.rank && self.transport.send_at_once(dst, ctx, tag, payload)
    }

    /// Starts a receive: a future that resolves to the oldest matching message.
    /// Dropping the future withdraws the receive without losing a message.
    ///
    /// # Errors
    /// The source has ended or the endpoint is closed.
    pub fn post(&self, pattern: Pattern) -> Result<PendingRecv<'_>, TransportError> {
        // Kept in the mailbox even when it matched at once, so that a dropped future
        // gives its message back in its place in the order of arrival.
        let id = self.mailbox.post_kept(pattern)?;
        Ok(PendingRecv { state: PendingState::Kept(id), mailbox: &self.mailbox })
    }

    /// Posts a receive into `part` (of this endpoint's memory) now; the message's payload
    /// lands in it, read there in place by backends that can (see
    /// [`crate::matching::Claim`]). It must have exactly the part's length.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`Endpoint::post`]; the future fails with [`TransportError::SizeMismatch`] for
    /// a message of another size.
    pub fn post_into(&self, pattern: Pattern, part: Part) -> Result<PendingRecv<'_, Landed>, TransportError> {
        let state = match self.mailbox.post_into(pattern, part)? {
            PostingInto::Ready(r) => PendingState::Ready(Some(r)),
            PostingInto::Posted(id, rx) => PendingState::Waiting { id, rx },
        };
        Ok(PendingRecv { state, mailbox: &self.mailbox })
    }

    /// Receives the oldest matching message within `timeout`.
    ///
    /// # Errors
    /// A timeout naming the source and tag, an ended source, or a closed endpoint.
    pub async fn recv(&self, pattern: Pattern, timeout: Duration) -> Result<Envelope, TransportError> {
        let pending = self.post(pattern)?;
        match tokio::time::timeout(timeout, pending).await {
            Ok(r) => r,
            Err(_) => Err(TransportError::Timeout { what: describe(&pattern), after: timeout }),
        }
    }

    /// Receives the oldest matching message into `part` within `timeout`; see
    /// [`Endpoint::post_into`].
    ///
    /// # Errors
    /// As [`Endpoint::recv`], or a message of another size.
    pub async fn recv_into(&self, pattern: Pattern, part: Part, timeout: Duration) -> Result<Landed, TransportError> {
        let pending = self.post_into(pattern, part)?;
        match tokio::time::timeout(timeout, pending).await {
            Ok(r) => r,
            Err(_) => Err(TransportError::Timeout { what: describe(&pattern), after: timeout }),
        }
    }
}

impl Endpoint {
    /// Exposes `region` for gets by peers; see [`Transport::expose`].
    ///
    /// # Local
    ///
    /// # Errors
    /// The backend has no windows or cannot register the memory.
    pub fn expose(&self, region: Bytes) -> Result<WindowId, TransportError> {
        self.transport.expose(region)
    }

    /// Withdraws a window; see [`Transport::withdraw`].
    ///
    /// # Local
    ///
    /// # Errors
    /// The window is not exposed here.
    pub fn withdraw(&self, id: WindowId) -> Result<Bytes, TransportError> {
        self.transport.withdraw(id)
    }

    /// Reads `len` bytes at `offset` of `dst`'s window `id`, within `timeout`.
    ///
    /// # Errors
    /// A refusal by the owner (unknown window, range outside it), the owner's loss,
    /// or a timeout naming the owner and the window.
    pub async fn get(
        &self,
        dst: Rank,
        id: WindowId,
        offset: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<Bytes, TransportError> {
        match tokio::time::timeout(timeout, self.transport.get(dst, id, offset, len)).await {
            Ok(r) => r,
            Err(_) => Err(get_timeout(dst, id, offset, len, timeout)),
        }
    }

    /// Reads `into.len()` bytes at `offset` of `dst`'s window `id` into `into`, within
    /// `timeout`; see [`Transport::get_into`].
    ///
    /// # Errors
    /// As [`Endpoint::get`].
    pub async fn get_into(
        &self,
        dst: Rank,
        id: WindowId,
        offset: u64,
        into: Part,
        timeout: Duration,
    ) -> Result<Part, TransportError> {
        let len = into.len() as u64;
        match tokio::time::timeout(timeout, self.transport.get_into(dst, id, offset, into)).await {
            Ok(r) => r,
            Err(_) => Err(get_timeout(dst, id, offset, len, timeout)),
        }
    }
}

fn get_timeout(dst: Rank, id: WindowId, offset: u64, len: u64, after: Duration) -> TransportError {
    TransportError::Timeout { what: format!("a get of {len} bytes at {offset} of {id} of {dst}"), after }
}

/// Text naming what a receive waited for.
#[must_use]
pub fn describe(p: &Pattern) -> String {
    use crate::matching::{SrcMatch, TagMatch};
    let src = match p.src {
        SrcMatch::Any => "any rank".to_string(),
        SrcMatch::Rank(r) => r.to_string(),
    };
    let tag = match p.tag {
        TagMatch::Any => "any tag".to_string(),
        TagMatch::Tag(t) => t.to_string(),
    };
    format!("a message from {src} ({tag}, {})", p.ctx)
}

/// What a posted receive resolves to, and how it keeps its place if its receiver gives
/// up after it arrived.
pub trait Received: Sized + Unpin {
    /// Gives the message back to `mailbox`, ahead of later ones.
    fn give_back(self, mailbox: &Mailbox);
    /// The answer to receive `id`, kept by `mailbox` (see [`Mailbox::poll_posted`]).
    fn poll_kept(mailbox: &Mailbox, id: u64, cx: &mut TaskContext<'_>) -> Poll<Result<Self, TransportError>>;
}

impl Received for Envelope {
    fn give_back(self, mailbox: &Mailbox) {
        mailbox.give_back(self);
    }

    fn poll_kept(mailbox: &Mailbox, id: u64, cx: &mut TaskContext<'_>) -> Poll<Result<Self, TransportError>> {
        mailbox.poll_posted(id, cx)
    }
}

impl Received for Landed {
    fn give_back(self, mailbox: &Mailbox) {
        mailbox.give_back_landed(self);
    }

    fn poll_kept(_: &Mailbox, _: u64, _: &mut TaskContext<'_>) -> Poll<Result<Self, TransportError>> {
        // Receives into a part answer through their channel; none is ever kept.
        Poll::Ready(Err(TransportError::Closed))
    }
}

enum PendingState<T> {
    Ready(Option<Result<T, TransportError>>),
    /// A receive of [`Mailbox::post`]: its answer is kept in the mailbox.
    Kept(u64),
    /// A receive into a part, answered through a channel.
    Waiting {
        id: u64,
        rx: oneshot::Receiver<Result<T, TransportError>>,
    },
    Done,
}

/// A posted receive; see [`Endpoint::post`] and [`Endpoint::post_into`].
pub struct PendingRecv<'a, T: Received = Envelope> {
    state: PendingState<T>,
    mailbox: &'a Mailbox,
}

impl<T: Received> Future for PendingRecv<'_, T> {
    type Output = Result<T, TransportError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let out = match &mut this.state {
            PendingState::Ready(r) => r.take().unwrap_or(Err(TransportError::Closed)),
            PendingState::Kept(id) => match T::poll_kept(this.mailbox, *id, cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => r,
            },
            PendingState::Waiting { rx, .. } => match Pin::new(rx).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(r)) => r,
                Poll::Ready(Err(_)) => Err(TransportError::Closed),
            },
            PendingState::Done => Err(TransportError::Closed),
        };
        self.state = PendingState::Done;
        Poll::Ready(out)
    }
}

impl<T: Received> Drop for PendingRecv<'_, T> {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.state, PendingState::Done) {
            PendingState::Kept(id) => self.mailbox.abandon(id),
            PendingState::Waiting { id, mut rx } => {
                if !self.mailbox.cancel(id) {
                    if let Ok(Ok(v)) = rx.try_recv() {
                        v.give_back(self.mailbox);
                    }
                }
            }
            PendingState::Ready(Some(Ok(v))) => v.give_back(self.mailbox),
            PendingState::Ready(_) | PendingState::Done => {}
        }
    }
}
