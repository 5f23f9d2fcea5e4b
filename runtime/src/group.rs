//! Groups: an ordered set of ranks with a private communication context.
//!
//! [`AsyncGroup`] is the async core; [`Group`] is the blocking API for SPMD code, each
//! call running its async counterpart on the calling thread (see [`crate::blocking`]),
//! except a small send that the transport takes at once, which needs no executor.
//! Group ranks are `usize` positions `0..size` in the group, which differ from the
//! job's endpoint ranks once groups are built from process sets.

use crate::error::{Error, Result};
use crate::pod;
use bytemuck::Pod;
use bytes::Bytes;
use ductile_transport::transport::describe;
use ductile_transport::{
    Context, Endpoint, Envelope, NodeId, Part, Pattern, PendingRecv, Rank, Received, SrcMatch, Tag, TagMatch,
    TransportError, WindowId,
};
use rustc_hash::FxHashMap;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::runtime::Handle;

/// What a receive got: who sent it, with which tag, how many bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status {
    /// Sender's rank in the group.
    pub source: usize,
    /// The message's tag.
    pub tag: u32,
    /// Payload length in bytes.
    pub len: usize,
}

struct Core {
    endpoint: Endpoint,
    ctx: Context,
    rank: usize,
    members: Vec<Rank>,
    /// Group position of each member (FxHash: looked up on every message received).
    index: FxHashMap<Rank, usize>,
    timeout: Duration,
    /// Node of each endpoint the group may name in an error (empty: none known).
    nodes: Arc<FxHashMap<Rank, NodeId>>,
    /// The membership of the job the group belongs to, if it is the world's or one of
    /// its process sets'.
    fence: Option<(Memberships, u64)>,
}

/// A session's count of the memberships it has had. The world's group, and the groups
/// built from its process sets, belong to the membership current when they were made:
/// once a checkpoint has switched the job to another (or released this process), they
/// refuse every operation that addresses members ([`Error::StaleGroup`]), where they
/// would otherwise go on among the old members, or wait for processes that left.
#[derive(Clone, Debug, Default)]
pub(crate) struct Memberships(Arc<AtomicU64>);

impl Memberships {
    /// The current membership's number.
    pub(crate) fn current(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// A new membership begins (the groups of the others are stale from now on); its
    /// number.
    pub(crate) fn advance(&self) -> u64 {
        self.0.fetch_add(1, Ordering::AcqRel) + 1
    }
}

thread_local! {
    /// What the current blocking call of this thread last waited for, to name it if the
    /// call times out (per thread: concurrent blocking calls do not mix their patterns).
    static WAITING_FOR: std::cell::Cell<Option<Pattern>> = const { std::cell::Cell::new(None) };
}

/// The async core of a group. Cheap to clone.
///
/// Each receive is bounded by the group's timeout with a tokio timer. The blocking
/// [`Group`] uses an untimed view of the same core and bounds the whole call instead
/// (see the `blocking` module): registering a timer per receive would wake the progress
/// thread on every message.
#[derive(Clone)]
pub struct AsyncGroup {
    core: Arc<Core>,
    timed: bool,
}

impl AsyncGroup {
    /// A group over `members` (group rank → endpoint rank) in context `ctx`, seen by the
    /// member at position `rank`. Every wait is bounded by `timeout`.
    ///
    /// # Errors
    /// `rank` is out of range, the endpoint is not the member at `rank`, or a member
    /// appears twice.
    pub fn new(endpoint: Endpoint, ctx: Context, members: Vec<Rank>, rank: usize, timeout: Duration) -> Result<Self> {
        if members.get(rank) != Some(&endpoint.rank()) {
            return Err(Error::Invalid(format!("group position {rank} is not this endpoint ({})", endpoint.rank())));
        }
        let index: FxHashMap<Rank, usize> = members.iter().enumerate().map(|(i, r)| (*r, i)).collect();
        if index.len() != members.len() {
            return Err(Error::Invalid("a rank appears twice in the group".into()));
        }
        let nodes = Arc::default();
        let core = Core { endpoint, ctx, rank, members, index, timeout, nodes, fence: None };
        Ok(Self { core: Arc::new(core), timed: true })
    }

    /// The same new group, belonging to membership `number` of `memberships`.
    pub(crate) fn fenced(mut self, memberships: &Memberships, number: u64) -> Self {
        match Arc::get_mut(&mut self.core) {
            Some(core) => core.fence = Some((memberships.clone(), number)),
            None => debug_assert!(false, "fenced() is for a group nobody shares yet"),
        }
        self
    }

    /// Fails if the group belongs to a membership of the job that a checkpoint ended.
    #[inline]
    pub(crate) fn live(&self) -> Result<()> {
        match &self.core.fence {
            Some((m, number)) if m.current() != *number => Err(Error::StaleGroup),
            _ => Ok(()),
        }
    }

    /// The same new group, knowing the node of each endpoint, so that its errors say
    /// where a peer is.
    pub(crate) fn placed(mut self, nodes: Arc<FxHashMap<Rank, NodeId>>) -> Self {
        match Arc::get_mut(&mut self.core) {
            Some(core) => core.nodes = nodes,
            None => debug_assert!(false, "placed() is for a group nobody shares yet"),
        }
        self
    }

    /// Where endpoint `ep` is, for an error naming it: `on node 1`, or `rank 5 is rank 2
    /// of this group, on node 1` when its endpoint id is not its rank here.
    fn whereabouts(&self, ep: Rank) -> Option<String> {
        let node = self.core.nodes.get(&ep);
        match (self.core.index.get(&ep), node) {
            (Some(&g), Some(n)) if g == ep.0 as usize => Some(format!("on {n}")),
            (Some(&g), Some(n)) => Some(format!("{ep} is rank {g} of this group, on {n}")),
            (Some(&g), None) if g != ep.0 as usize => Some(format!("{ep} is rank {g} of this group")),
            (None, Some(n)) => Some(format!("{ep} is not in this group; it is on {n}")),
            _ => None,
        }
    }

    /// `e`, saying where the peer it names is, if the group knows.
    fn located(&self, e: Error) -> Error {
        match e {
            Error::Transport(error) => match error.peer().and_then(|p| self.whereabouts(p)) {
                Some(whereabouts) => Error::Peer { error, whereabouts },
                None => Error::Transport(error),
            },
            e => e,
        }
    }

    /// The error of an operation with `peer` (a get), saying where `peer` is, also when
    /// it is a timeout (which names no peer of its own).
    fn at(&self, e: TransportError, peer: Rank) -> Error {
        match (e, self.whereabouts(peer)) {
            (TransportError::Timeout { what, after }, Some(w)) => {
                TransportError::Timeout { what: format!("{what}; {w}"), after }.into()
            }
            (e, _) => self.located(e.into()),
        }
    }

    /// The error of a wait for `p`, saying where its source is.
    fn failed(&self, e: TransportError, p: &Pattern) -> Error {
        match e {
            TransportError::Timeout { after, .. } => TransportError::Timeout { what: self.waited_for(p), after }.into(),
            e => self.located(e.into()),
        }
    }

    /// What a wait for `p` waited for, saying where its source is.
    fn waited_for(&self, p: &Pattern) -> String {
        let what = describe(p);
        match p.src {
            SrcMatch::Rank(ep) => match self.whereabouts(ep) {
                Some(w) => format!("{what}; {w}"),
                None => what,
            },
            SrcMatch::Any => what,
        }
    }

    /// This process's rank in the group.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.core.rank
    }

    /// Number of members.
    #[must_use]
    pub fn size(&self) -> usize {
        self.core.members.len()
    }

    /// The timeout of every wait in this group.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        self.core.timeout
    }

    /// The same group (same context, members and position) with every receive bounded
    /// by `timeout` instead.
    pub(crate) fn with_timeout(&self, timeout: Duration) -> Self {
        let c = &self.core;
        let core = Core {
            endpoint: c.endpoint.clone(),
            ctx: c.ctx,
            rank: c.rank,
            members: c.members.clone(),
            index: c.index.clone(),
            timeout,
            nodes: c.nodes.clone(),
            fence: c.fence.clone(),
        };
        Self { core: Arc::new(core), timed: true }
    }

    /// The endpoint of group rank `r`; every operation that addresses a member asks.
    fn member(&self, r: usize) -> Result<Rank> {
        self.live()?;
        self.core.members.get(r).copied().ok_or_else(|| Error::InvalidRank { rank: r, size: self.size() })
    }

    /// Sends raw bytes with any tag, including runtime tags.
    pub(crate) async fn send_tagged(&self, dst: usize, tag: Tag, payload: Bytes) -> Result<()> {
        let to = self.member(dst)?;
        self.core.endpoint.send(to, self.core.ctx, tag, payload).await.map_err(|e| self.located(e.into()))
    }

    /// Whether one-sided reads of one owner are served one at a time by the transport
    /// (see `Capabilities::serial_reads`).
    pub(crate) fn serial_reads(&self) -> bool {
        self.core.endpoint.transport().capabilities().serial_reads
    }

    /// Whether the transport populates the memory it fills for gets and in-place
    /// receives itself (see `Capabilities::populates`).
    pub(crate) fn populates(&self) -> bool {
        self.core.endpoint.transport().capabilities().populates
    }

    /// Whether the transport's peers share the host's memory
    /// (`Capabilities::shares_memory`).
    pub(crate) fn shares_memory(&self) -> bool {
        self.core.endpoint.transport().capabilities().shares_memory
    }

    /// Whether one-sided moves hand whole pages over instead of copying them: the
    /// transport's peers share the host's memory (`Capabilities::shares_memory`) and
    /// `DUCTILE_PAGE_HANDOVER` is not 0 (see [`crate::pages`]).
    pub(crate) fn hands_over_pages(&self) -> bool {
        self.core.endpoint.transport().capabilities().shares_memory && crate::pages::handover()
    }

    /// Whether moves recycle the pages of old blocks into new ones (see
    /// `crate::anon::recycling`).
    pub(crate) fn recycles_pages(&self) -> bool {
        crate::anon::recycling(&self.core.endpoint.transport().capabilities())
    }

    /// Sends `payload` within this call if the transport takes it at once (a small
    /// message to a connected peer): true if sent; false if nothing was sent and
    /// [`AsyncGroup::send_bytes`] must send it.
    fn send_now(&self, dst: usize, tag: u32, payload: &[u8]) -> Result<bool> {
        let tag = Self::user_tag(tag)?;
        Ok(self.core.endpoint.send_now(self.member(dst)?, self.core.ctx, tag, payload))
    }

    /// The pattern of a receive from `src` (`None`: any member) with `tag`.
    fn pattern(&self, src: Option<usize>, tag: TagMatch) -> Result<Pattern> {
        let src = match src {
            Some(s) => SrcMatch::Rank(self.member(s)?),
            None => {
                self.live()?;
                SrcMatch::Any
            }
        };
        Ok(Pattern { ctx: self.core.ctx, src, tag })
    }

    /// A received message's payload and status.
    fn status(&self, env: Envelope) -> Result<(Bytes, Status)> {
        let source = self.source(env.src)?;
        let len = env.payload.len();
        Ok((env.payload, Status { source, tag: env.tag.0, len }))
    }

    /// The group rank of the sender of a received message.
    fn source(&self, src: Rank) -> Result<usize> {
        self.core.index.get(&src).copied().ok_or_else(|| Error::Invalid(format!("message from non-member {src}")))
    }

    /// Receives raw bytes by pattern, including runtime tags.
    pub(crate) async fn recv_tagged(&self, src: Option<usize>, tag: TagMatch) -> Result<(Bytes, Status)> {
        let pattern = self.pattern(src, tag)?;
        let env = if self.timed {
            self.core.endpoint.recv(pattern, self.core.timeout).await.map_err(|e| self.failed(e, &pattern))?
        } else {
            WAITING_FOR.set(Some(pattern));
            self.core.endpoint.post(pattern).map_err(|e| self.located(e.into()))?.await?
        };
        self.status(env)
    }

    /// Receives an application message on this thread, without a future (see
    /// [`crate::blocking::recv_here`]): the blocking receive's path. With `into`, a
    /// payload of its length may land there directly: the answer is then `None`, else
    /// the message.
    fn recv_here(
        &self,
        src: Option<usize>,
        tag: Option<u32>,
        spin: Duration,
        into: Option<&mut [u8]>,
    ) -> Result<(Option<Envelope>, Status)> {
        let tag = match tag {
            Some(t) => TagMatch::Tag(Self::user_tag(t)?),
            None => TagMatch::Any,
        };
        let pattern = self.pattern(src, tag)?;
        let core = &self.core;
        let lent = into.as_ref().map_or(0, |b| b.len());
        match crate::blocking::recv_here(&core.endpoint, pattern, spin, core.timeout, into) {
            Some(Ok((env, landed))) => {
                let source = match src {
                    // From the source asked for: no need to look its group rank up.
                    Some(s) => s,
                    None => self.source(env.src)?,
                };
                let len = if landed { lent } else { env.payload.len() };
                let st = Status { source, tag: env.tag.0, len };
                Ok(((!landed).then_some(env), st))
            }
            // A message of another length than `into`, left in its place: the caller
            // says what it expected.
            Some(Err(e @ TransportError::SizeMismatch { .. })) => Err(e.into()),
            Some(Err(e)) => Err(self.located(e.into())),
            None => Err(TransportError::Timeout { what: self.waited_for(&pattern), after: core.timeout }.into()),
        }
    }

    /// Posts a receive from `src` with `tag` (including runtime tags) now; the future
    /// completes with the message.
    pub(crate) fn post_tagged(
        &self,
        src: usize,
        tag: Tag,
    ) -> Result<impl std::future::Future<Output = Result<(Bytes, Status)>> + '_> {
        let pattern = Pattern { ctx: self.core.ctx, src: SrcMatch::Rank(self.member(src)?), tag: TagMatch::Tag(tag) };
        let pending = self.core.endpoint.post(pattern).map_err(|e| self.located(e.into()))?;
        Ok(async move {
            let env = self.await_posted(pattern, pending).await?;
            let len = env.payload.len();
            Ok((env.payload, Status { source: src, tag: tag.0, len }))
        })
    }

    /// Waits for a posted receive, within the group's timeout unless inside a blocking
    /// call (which bounds the whole call).
    async fn await_posted<T: Received>(&self, pattern: Pattern, pending: PendingRecv<'_, T>) -> Result<T> {
        if self.timed {
            let after = self.core.timeout;
            let waited = |_| TransportError::Timeout { what: self.waited_for(&pattern), after };
            Ok(tokio::time::timeout(after, pending).await.map_err(waited)?.map_err(|e| self.located(e.into()))?)
        } else {
            WAITING_FOR.set(Some(pattern));
            Ok(pending.await?)
        }
    }

    /// Posts a receive from `src` with `tag` (including runtime tags) into `into` now;
    /// the future gives the part back holding the message, which must be exactly its
    /// length. Backends that can read the payload straight into the part.
    pub(crate) fn post_in_place(
        &self,
        src: usize,
        tag: Tag,
        into: Part,
    ) -> Result<impl std::future::Future<Output = Result<(Part, Status)>> + '_> {
        let pattern = Pattern { ctx: self.core.ctx, src: SrcMatch::Rank(self.member(src)?), tag: TagMatch::Tag(tag) };
        let pending = self.core.endpoint.post_into(pattern, into).map_err(|e| self.located(e.into()))?;
        Ok(async move {
            let landed = self.await_posted(pattern, pending).await?;
            let len = landed.part.len();
            Ok((landed.part, Status { source: src, tag: tag.0, len }))
        })
    }

    /// Receives a message from `src` with `tag` straight into `into`, a part of this
    /// process's memory, and gives the part back holding it: a receive without a new
    /// buffer and its copy on backends that read in place (tcp, quic, and fabric's large
    /// messages). The message must be exactly the part's length.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`AsyncGroup::recv_bytes`], or a message of another length (it is consumed).
    pub async fn recv_in_place(&self, src: usize, tag: u32, into: Part) -> Result<(Part, Status)> {
        self.post_in_place(src, Self::user_tag(tag)?, into)?.await
    }

    /// Exposes `region` for one-sided reads by the group's members (and any other
    /// endpoint of the job). Tell readers the returned id in a message.
    ///
    /// # Local
    /// A registration on this endpoint; nothing is sent.
    ///
    /// # Errors
    /// The transport has no one-sided reads.
    pub fn expose(&self, region: Bytes) -> Result<WindowId> {
        Ok(self.core.endpoint.expose(region)?)
    }

    /// Withdraws a window exposed by this process; returns its region.
    ///
    /// # Local
    ///
    /// # Errors
    /// The window is not exposed here.
    pub fn withdraw(&self, id: WindowId) -> Result<Bytes> {
        Ok(self.core.endpoint.withdraw(id)?)
    }

    /// Reads `len` bytes at `offset` of window `id` exposed by group rank `src`. The
    /// owner's application thread takes no part; completion is this call returning.
    ///
    /// # Local
    ///
    /// # Errors
    /// Bad rank, a refusal by the owner (unknown window, range outside it), the owner's
    /// loss, or a timeout naming the owner and the window.
    pub async fn get(&self, src: usize, id: WindowId, offset: u64, len: u64) -> Result<Bytes> {
        let from = self.member(src)?;
        let ep = &self.core.endpoint;
        if self.timed {
            return ep.get(from, id, offset, len, self.core.timeout).await.map_err(|e| self.at(e, from));
        }
        // Inside a blocking call, which bounds the whole call (and locates its errors).
        Ok(ep.transport().get(from, id, offset, len).await?)
    }

    /// Reads `into.len()` bytes at `offset` of window `id` exposed by group rank `src`
    /// straight into `into`, a part of this process's memory, and gives it back holding
    /// them: [`AsyncGroup::get`] without the new buffer and its copy.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`AsyncGroup::get`]. The part is then dropped once the backend lets go of it
    /// (a read already under way finishes first); until then its landing cannot be
    /// taken back.
    pub async fn get_into(&self, src: usize, id: WindowId, offset: u64, into: Part) -> Result<Part> {
        let from = self.member(src)?;
        let ep = &self.core.endpoint;
        if self.timed {
            return ep.get_into(from, id, offset, into, self.core.timeout).await.map_err(|e| self.at(e, from));
        }
        // Inside a blocking call, which bounds the whole call (and locates its errors).
        Ok(ep.transport().get_into(from, id, offset, into).await?)
    }

    fn user_tag(tag: u32) -> Result<Tag> {
        let t = Tag(tag);
        if t.is_user() {
            Ok(t)
        } else {
            Err(Error::ReservedTag(tag))
        }
    }

    /// Sends a payload to group rank `dst`.
    ///
    /// # Local
    /// Completes when the payload is handed to the transport.
    ///
    /// # Errors
    /// Bad rank or tag, or a transport error naming the peer.
    pub async fn send_bytes(&self, dst: usize, tag: u32, payload: Bytes) -> Result<()> {
        self.send_tagged(dst, Self::user_tag(tag)?, payload).await
    }

    /// Receives a payload from `src` (`None`: any source) with `tag` (`None`: any tag).
    ///
    /// # Local
    ///
    /// # Errors
    /// Bad rank or tag, a timeout naming the source, or the source has ended.
    pub async fn recv_bytes(&self, src: Option<usize>, tag: Option<u32>) -> Result<(Bytes, Status)> {
        let tag = match tag {
            Some(t) => TagMatch::Tag(Self::user_tag(t)?),
            None => TagMatch::Any,
        };
        self.recv_tagged(src, tag).await
    }

    /// Sends a slice of plain-old-data elements (copied once).
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`AsyncGroup::send_bytes`].
    pub async fn send<T: Pod>(&self, dst: usize, tag: u32, data: &[T]) -> Result<()> {
        self.send_bytes(dst, tag, pod::slice_to_bytes(data)).await
    }

    /// Receives plain-old-data elements.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`AsyncGroup::recv_bytes`], or a payload that is not whole elements.
    pub async fn recv<T: Pod>(&self, src: Option<usize>, tag: Option<u32>) -> Result<(Vec<T>, Status)> {
        let (b, st) = self.recv_bytes(src, tag).await?;
        Ok((pod::bytes_to_vec(&b, st.source)?, st))
    }

    /// Sends a serde value.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`AsyncGroup::send_bytes`], or the value does not encode.
    pub async fn send_value<S: Serialize + ?Sized>(&self, dst: usize, tag: u32, value: &S) -> Result<()> {
        let b = postcard::to_stdvec(value).map_err(Error::Encode)?;
        self.send_bytes(dst, tag, Bytes::from(b)).await
    }

    /// Receives a serde value.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`AsyncGroup::recv_bytes`], or the payload does not decode as `S`.
    pub async fn recv_value<S: DeserializeOwned>(&self, src: Option<usize>, tag: Option<u32>) -> Result<(S, Status)> {
        let (b, st) = self.recv_bytes(src, tag).await?;
        Ok((decode(&b, st)?, st))
    }
}

/// A group with a blocking API, for SPMD code. Cheap to clone.
#[derive(Clone)]
pub struct Group {
    timed: AsyncGroup,
    inner: AsyncGroup,
    handle: Handle,
    spin: Duration,
}

impl Group {
    pub(crate) fn new(timed: AsyncGroup, handle: Handle, spin: Duration) -> Self {
        let inner = AsyncGroup { core: timed.core.clone(), timed: false };
        Self { timed, inner, handle, spin }
    }

    /// The same group (same context, members and position) with every wait bounded by
    /// `timeout` instead.
    pub(crate) fn with_timeout(&self, timeout: Duration) -> Self {
        Self::new(self.timed.with_timeout(timeout), self.handle.clone(), self.spin)
    }

    /// Runs an async operation of this group to completion on the calling thread,
    /// bounded by the group's timeout; a timeout names what the call waited for.
    pub(crate) fn block<T, F: std::future::Future<Output = Result<T>>>(&self, f: F) -> Result<T> {
        let core = &self.inner.core;
        let ep = &core.endpoint;
        // A call that waits for no receive (a send) must not be named after an earlier
        // call's.
        let outer = WAITING_FOR.take();
        // Pinned here: what the closure and the executor move is then a pointer, not the
        // future (a receive's is 352 bytes; callgrind counts one copy of it fewer per
        // call).
        let f = std::pin::pin!(f);
        let r = ep.blocking_call(|| crate::blocking::block_on(&self.handle, self.spin, core.timeout, ep, f));
        let waited = WAITING_FOR.replace(outer);
        match r {
            Some(r) => r.map_err(|e| self.inner.located(e)),
            None => {
                let what =
                    waited.map_or_else(|| "its sends or gets to complete".to_string(), |p| self.inner.waited_for(&p));
                Err(TransportError::Timeout { what, after: core.timeout }.into())
            }
        }
    }

    /// The async core, for code that runs on an executor (each receive bounded by the
    /// group's timeout).
    #[must_use]
    pub fn as_async(&self) -> &AsyncGroup {
        &self.timed
    }

    /// The untimed view used inside blocking calls.
    pub(crate) fn core_async(&self) -> &AsyncGroup {
        &self.inner
    }

    /// This process's rank in the group.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// Number of members.
    #[must_use]
    pub fn size(&self) -> usize {
        self.inner.size()
    }

    /// Sends a slice of plain-old-data elements to group rank `dst` with `tag`.
    ///
    /// ```no_run
    /// # fn main() -> ductile::Result<()> {
    /// let session = ductile::init()?;
    /// session.world().send(0, 1, &[1u8, 2, 3])?;
    /// # Ok(()) }
    /// ```
    ///
    /// Elements of size zero carry no data: sending or receiving them does not compile.
    ///
    /// ```compile_fail
    /// # fn main() -> ductile::Result<()> {
    /// let session = ductile::init()?;
    /// session.world().send(0, 1, &[(), (), ()])?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Local
    ///
    /// # Errors
    /// Bad rank or tag, or a transport error naming the peer.
    pub fn send<T: Pod>(&self, dst: usize, tag: u32, data: &[T]) -> Result<()> {
        pod::sized::<T>();
        // A message that leaves at once is sent from `data` itself, without a copy.
        if self.inner.send_now(dst, tag, bytemuck::cast_slice(data))? {
            return Ok(());
        }
        self.block(self.inner.send(dst, tag, data))
    }

    /// Sends an owned vector without copying it.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`Group::send`].
    pub fn send_vec<T: Pod + Send + Sync>(&self, dst: usize, tag: u32, data: Vec<T>) -> Result<()> {
        self.block(self.inner.send_bytes(dst, tag, pod::vec_to_bytes(data)))
    }

    /// Sends a payload without copying it.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`Group::send`].
    pub fn send_bytes(&self, dst: usize, tag: u32, payload: Bytes) -> Result<()> {
        if self.inner.send_now(dst, tag, &payload)? {
            return Ok(());
        }
        self.block(self.inner.send_bytes(dst, tag, payload))
    }

    /// Exposes `region` for one-sided reads; see [`AsyncGroup::expose`].
    ///
    /// # Local
    ///
    /// # Errors
    /// The transport has no one-sided reads.
    pub fn expose(&self, region: Bytes) -> Result<WindowId> {
        self.inner.expose(region)
    }

    /// Withdraws a window; see [`AsyncGroup::withdraw`].
    ///
    /// # Local
    ///
    /// # Errors
    /// The window is not exposed here.
    pub fn withdraw(&self, id: WindowId) -> Result<Bytes> {
        self.inner.withdraw(id)
    }

    /// Reads `len` bytes at `offset` of window `id` of group rank `src`; see
    /// [`AsyncGroup::get`].
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`AsyncGroup::get`].
    pub fn get(&self, src: usize, id: WindowId, offset: u64, len: u64) -> Result<Bytes> {
        self.block(self.inner.get(src, id, offset, len))
    }

    /// Receives a message from `src` with `tag` straight into `into`; see
    /// [`AsyncGroup::recv_in_place`].
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`AsyncGroup::recv_in_place`].
    pub fn recv_in_place(&self, src: usize, tag: u32, into: Part) -> Result<(Part, Status)> {
        self.block(self.inner.recv_in_place(src, tag, into))
    }

    /// Reads a range of window `id` of group rank `src` straight into `into`; see
    /// [`AsyncGroup::get_into`].
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`AsyncGroup::get`].
    pub fn get_into(&self, src: usize, id: WindowId, offset: u64, into: Part) -> Result<Part> {
        self.block(self.inner.get_into(src, id, offset, into))
    }

    /// Sends a serde value.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`Group::send`], or the value does not encode.
    pub fn send_value<S: Serialize + ?Sized>(&self, dst: usize, tag: u32, value: &S) -> Result<()> {
        self.block(self.inner.send_value(dst, tag, value))
    }

    /// Receives plain-old-data elements from `src` (`None`: any) with `tag` (`None`: any).
    ///
    /// # Local
    ///
    /// # Errors
    /// Bad rank or tag, a timeout naming the source, an ended source, or a payload that
    /// is not whole elements.
    pub fn recv<T: Pod>(&self, src: Option<usize>, tag: Option<u32>) -> Result<(Vec<T>, Status)> {
        let (b, st) = self.recv_bytes(src, tag)?;
        Ok((pod::bytes_to_vec(&b, st.source)?, st))
    }

    /// Receives into `out`, which must match the message's element count.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`Group::recv`], or the first message that matches has another length
    /// ([`Error::LengthMismatch`], or [`Error::Misaligned`] if it is no whole number of
    /// elements). That message is not lost: it keeps its place in the order of arrival,
    /// for a receive that takes any length ([`Group::recv`], [`Group::recv_bytes`]).
    pub fn recv_into<T: Pod>(&self, src: Option<usize>, tag: Option<u32>, out: &mut [T]) -> Result<Status> {
        pod::sized::<T>();
        // The transport takes only a message of `out`'s size, and leaves one of another
        // in its place in the order of arrival. It may copy the payload straight into
        // `out` (no buffer of its own), or else hand it over as bytes, copied here.
        let (env, st) = match self.inner.recv_here(src, tag, self.spin, Some(bytemuck::cast_slice_mut::<T, u8>(out))) {
            Err(Error::Transport(TransportError::SizeMismatch { peer, got, .. })) => {
                let src = self.inner.source(peer)?;
                return Err(pod::length_error::<T>(
                    usize::try_from(got).unwrap_or(usize::MAX),
                    out.len(),
                    src,
                    "recv_into",
                ));
            }
            r => r?,
        };
        if let Some(env) = env {
            // Of `out`'s size (checked by the transport): cannot fail.
            pod::bytes_into(&env.payload, out, st.source, "recv_into")?;
        }
        Ok(st)
    }

    /// Receives a payload as bytes, without copying.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`Group::recv`].
    pub fn recv_bytes(&self, src: Option<usize>, tag: Option<u32>) -> Result<(Bytes, Status)> {
        let (env, st) = self.inner.recv_here(src, tag, self.spin, None)?;
        Ok((env.map(|e| e.payload).unwrap_or_default(), st))
    }

    /// Receives a serde value.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`Group::recv`], or the payload does not decode.
    pub fn recv_value<S: DeserializeOwned>(&self, src: Option<usize>, tag: Option<u32>) -> Result<(S, Status)> {
        let (b, st) = self.recv_bytes(src, tag)?;
        Ok((decode(&b, st)?, st))
    }
}

/// A received serde value.
fn decode<S: DeserializeOwned>(b: &[u8], st: Status) -> Result<S> {
    postcard::from_bytes(b).map_err(|source| Error::Decode { src: st.source, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ductile_transport::mem::MemHub;
    use std::time::Duration;

    /// Two blocking groups over in-memory endpoints, with `timeout`.
    fn pair(rt: &tokio::runtime::Runtime, timeout: Duration) -> (Group, Group) {
        let members = vec![Rank(0), Rank(1)];
        let mut eps = MemHub::endpoints(2).into_iter();
        let mut groups = [0, 1].map(|r| {
            let ep = eps.next().unwrap();
            let g = AsyncGroup::new(ep, Context(0), members.clone(), r, timeout).unwrap();
            Some(Group::new(g, rt.handle().clone(), Duration::from_micros(20)))
        });
        (groups[0].take().unwrap(), groups[1].take().unwrap())
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap()
    }

    #[test]
    fn errors_say_which_rank_of_the_group_a_peer_is_and_on_which_node() {
        let rt = runtime();
        // Group rank 0 is endpoint 1, on node 7; group rank 1 is endpoint 0, on node 4.
        let members = vec![Rank(1), Rank(0)];
        let nodes: Arc<FxHashMap<Rank, NodeId>> =
            Arc::new([(Rank(1), NodeId(7)), (Rank(0), NodeId(4))].into_iter().collect());
        let mut eps: Vec<_> = MemHub::endpoints(2).into_iter().map(Some).collect();
        let group = |ep, pos| {
            let g = AsyncGroup::new(ep, Context(0), members.clone(), pos, Duration::from_millis(30)).unwrap();
            Group::new(g.placed(nodes.clone()), rt.handle().clone(), Duration::from_micros(20))
        };
        let (a, b) = (group(eps[1].take().unwrap(), 0), group(eps[0].take().unwrap(), 1));
        let want = "rank 0 is rank 1 of this group, on node 4";
        let e = a.recv_bytes(Some(1), Some(7)).unwrap_err().to_string();
        assert!(e.contains("a message from rank 0 (tag 7") && e.contains(want), "{e}");
        let e = rt.block_on(a.as_async().recv_bytes(Some(1), Some(7))).unwrap_err().to_string();
        assert!(e.contains("a message from rank 0 (tag 7") && e.contains(want), "async: {e}");
        // A member whose endpoint id is its rank in the group: only its node is added.
        let mut others = MemHub::endpoints(2).into_iter();
        let same =
            AsyncGroup::new(others.next().unwrap(), Context(0), vec![Rank(0), Rank(1)], 0, Duration::from_millis(30));
        let same = same.unwrap().placed(nodes.clone());
        assert_eq!(same.whereabouts(Rank(1)).as_deref(), Some("on node 7"));
        assert_eq!(same.whereabouts(Rank(9)), None, "an endpoint it knows nothing of");
        rt.block_on(b.inner.core.endpoint.transport().close());
        let e = a.send_bytes(1, 3, Bytes::from_static(b"x")).unwrap_err();
        assert!(matches!(e, Error::Peer { error: TransportError::PeerClosed(Rank(0)), .. }), "{e:?}");
        assert_eq!(e.to_string(), format!("rank 0 has closed its endpoint ({want})"));
        assert!(std::error::Error::source(&e).is_some(), "the transport's error stays the source");
    }

    #[test]
    fn blocking_receives_lose_nothing_and_are_woken_from_other_threads() {
        let rt = runtime();
        let (a, b) = pair(&rt, Duration::from_millis(30));
        // A receive that timed out is withdrawn: the message sent afterwards waits for
        // the next receive, in order with the one after it.
        assert!(a.recv_bytes(Some(1), Some(7)).is_err());
        b.send_bytes(0, 7, Bytes::from_static(b"late")).unwrap();
        b.send_bytes(0, 7, Bytes::from_static(b"later")).unwrap();
        assert_eq!(a.recv_bytes(Some(1), Some(7)).unwrap().0, Bytes::from_static(b"late"));
        assert_eq!(a.recv::<u8>(Some(1), Some(7)).unwrap().0, b"later");
        // Delivered by the sender's thread while this one waits (in-memory endpoints
        // deliver on send), repeatedly: each wait is woken.
        let (a, b) = pair(&rt, Duration::from_secs(10));
        let sender = std::thread::spawn(move || {
            for i in 0..50u32 {
                std::thread::sleep(Duration::from_micros(200));
                b.send_value(0, 9, &i).unwrap();
            }
        });
        for i in 0..50u32 {
            assert_eq!(a.recv_value::<u32>(Some(1), Some(9)).unwrap(), (i, Status { source: 1, tag: 9, len: 1 }));
        }
        sender.join().unwrap();
    }

    #[test]
    fn a_timeout_names_what_its_own_call_waited_for() {
        let rt = runtime();
        let (a, b) = pair(&rt, Duration::from_millis(50));
        let e = a.recv_bytes(Some(1), Some(7)).unwrap_err().to_string();
        assert!(e.contains("a message from rank 1 (tag 7"), "{e}");
        // A receive that completed is not named by a later call that waits for none.
        b.send_bytes(0, 8, Bytes::from_static(b"x")).unwrap();
        assert_eq!(a.recv_bytes(Some(1), Some(8)).unwrap().0, Bytes::from_static(b"x"));
        let e = a.block(std::future::pending::<Result<()>>()).unwrap_err().to_string();
        assert!(e.contains("its sends or gets to complete") && !e.contains("a message"), "{e}");
    }
}
