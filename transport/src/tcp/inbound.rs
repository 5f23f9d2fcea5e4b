//! The inbound side of the TCP backend: authenticated connections and the progress
//! engine that reads them.
//!
//! Reading is done by whoever needs it, never by two at once (a lock per connection):
//! - an application thread that waits for a message polls the connections itself
//!   ([`Reader::progress`]; past two of them, asking a level-triggered `epoll` set of
//!   its own which are readable), as MPI libraries do, so a message arriving while it
//!   spins costs no thread wake-up;
//! - otherwise the progress thread, blocked in `epoll` (mio), reads whatever arrives.
//!
//! While an application thread polls, the progress thread stands aside on a condition
//! variable instead of waiting in `epoll`, so arriving data wakes nobody. Sockets are
//! registered edge-triggered; whoever reads, reads until `WouldBlock`, and the progress
//! thread takes the connection lock blockingly, so no data is ever left unread. (A
//! polling application thread stops at a short read, which leaves nothing either; and
//! once its own receive has its message, which may leave data for its next receive to
//! take in place: the edge that data raised is still pending for the progress thread,
//! which reads it once no thread polls. See [`Reader::drain`].)
//!
//! A large payload that a blocking receive of the polling thread waits for, into its
//! own memory, is read straight there ([`Reader::land_here`]); one that an asynchronous
//! receive into a part waits for is read into the part by whoever reads
//! ([`Mailbox::claim`]); any other into a buffer of its own.

use super::lock;
use crate::error::{FrameError, TransportError};
use crate::frame::{FrameHeader, FrameKind, FrameLimits, HEADER_LEN};
use crate::ids::Rank;
use crate::landing::Part;
use crate::matching::{Claim, Envelope, Mailbox, PeerEnd};
use crate::sys::Got;
use crate::window::{self, GetRequest, GetTable, WindowError, WindowTable};
use bytes::{Buf, BufMut, BytesMut};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use std::collections::HashMap;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Size of a connection's receive buffer for small frames; larger payloads are read
/// straight into their own buffer.
pub(super) const READ_BUF: usize = 64 * 1024;
/// How often the progress thread re-checks for shutdown.
const TICK: Duration = Duration::from_millis(100);
/// Up to this many connections, a polling thread reads each in turn instead of asking
/// which are readable first (a `recv` that finds nothing costs about as much as the
/// question, on this project's VM 140 against 150 ns).
const READ_EACH: usize = 2;
/// How soon the progress thread resumes after application threads stopped polling
/// without going to sleep (they went back to computing).
const GATE_TICK: Duration = Duration::from_millis(1);
/// How long a thread reading a payload into its receive's memory waits for more of it
/// before it lets the rest come into a buffer of the frame's own (see
/// [`Reader::land_here`]).
const LAND_STALL: Duration = Duration::from_millis(10);
/// How often such a thread writes its endpoint's queued output while it waits.
const LAND_FLUSH: Duration = Duration::from_micros(50);
/// How long such a thread tries its read again at once, after the last bytes came,
/// before it waits in the kernel for more. (4 MiB messages streamed into one receive
/// buffer, on a 2-vCPU AMD EPYC guest, alternating jobs, GiB/s: 3.80-4.32 waiting at
/// once, 6.88-8.24 after 50 µs, 6.00-9.84 after 200 µs, 6.41-7.85 after 1 ms.)
const LAND_SPIN: Duration = Duration::from_micros(100);
/// After how long such a thread lets the rest go at the first wait for more.
const LAND_FOR: Duration = Duration::from_millis(100);

/// One authenticated inbound connection.
struct Inbound {
    peer: Rank,
    stream: TcpStream,
    ended: AtomicBool,
    state: Mutex<ReadState>,
}

struct ReadState {
    /// Bytes read but not yet delivered.
    buf: BytesMut,
    /// A large frame whose payload is read straight into its own buffer.
    big: Option<(FrameHeader, Big)>,
    /// Bytes read so far (to tell a polling thread that data is flowing).
    received: u64,
}

/// Where a large frame's payload is read.
enum Big {
    /// Its own buffer.
    Buf(BytesMut),
    /// The receiver's memory, filled up to `.1`.
    Mem(Mem, usize),
}

/// Receiver's memory a payload is read into in place.
enum Mem {
    /// A get's part.
    Get(Part),
    /// A receive's part, claimed from the mailbox.
    Recv(Claim),
}

impl Mem {
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Mem::Get(p) => p.as_mut_slice(),
            Mem::Recv(c) => c.bytes_mut(),
        }
    }
}

impl Big {
    fn filled(&self) -> usize {
        match self {
            Big::Buf(b) => b.len(),
            Big::Mem(_, n) => *n,
        }
    }

    /// Appends `bytes` (no more than the frame's length: checked by the caller).
    fn extend(&mut self, bytes: &[u8]) {
        match self {
            Big::Buf(b) => b.extend_from_slice(bytes),
            Big::Mem(m, n) => {
                m.bytes_mut()[*n..*n + bytes.len()].copy_from_slice(bytes);
                *n += bytes.len();
            }
        }
    }

    /// Reads at most `want` more bytes from `fd`.
    fn recv(&mut self, fd: std::os::fd::RawFd, want: usize) -> std::io::Result<Got> {
        match self {
            Big::Buf(b) => crate::sys::recv_nonblocking(fd, &mut b.limit(want)),
            Big::Mem(m, n) => {
                let mut rest = &mut m.bytes_mut()[*n..];
                let got = crate::sys::recv_nonblocking(fd, &mut (&mut rest).limit(want))?;
                *n += got.n;
                Ok(got)
            }
        }
    }
}

/// A get request read off a connection, with what the window table answered; the
/// backend's window server task sends the reply.
pub(super) struct Served {
    /// Who asked.
    pub(super) peer: Rank,
    /// The request id to answer.
    pub(super) id: u64,
    /// The bytes (a reference into the window) or the refusal.
    pub(super) reply: Result<bytes::Bytes, WindowError>,
}

/// Where the reader hands what is not a tagged message.
pub(super) struct OneSided {
    /// Our exposed windows, read when a request arrives.
    pub(super) windows: Arc<WindowTable>,
    /// Our gets in flight, completed by replies.
    pub(super) gets: Arc<GetTable>,
    /// The window server task.
    pub(super) serve: tokio::sync::mpsc::UnboundedSender<Served>,
}

/// The inbound connections of one endpoint and their progress thread.
pub(super) struct Reader {
    me: Rank,
    max_payload: u64,
    mailbox: Arc<Mailbox>,
    one_sided: OneSided,
    conns: Mutex<HashMap<Token, Arc<Inbound>>>,
    next_token: AtomicUsize,
    registry: mio::Registry,
    /// The connections again, level-triggered, for polling application threads.
    ready: crate::sys::ReadySet,
    /// Asking `ready` failed once (logged once).
    ready_failed: AtomicBool,
    polling: AtomicUsize,
    /// When polling last stopped without the thread going to sleep, in ns since `epoch`.
    last_poll_end: AtomicU64,
    /// A polling thread went to sleep: the progress thread must resume now.
    wake_now: AtomicBool,
    epoch: Instant,
    gate: Mutex<()>,
    resume: Condvar,
    shutdown: AtomicBool,
}

impl Reader {
    /// Creates the reader and starts its progress thread.
    pub(super) fn start(
        me: Rank,
        max_payload: u64,
        mailbox: Arc<Mailbox>,
        one_sided: OneSided,
    ) -> std::io::Result<Arc<Self>> {
        let poll = Poll::new()?;
        let registry = poll.registry().try_clone()?;
        let reader = Arc::new(Self {
            me,
            max_payload,
            mailbox,
            one_sided,
            conns: Mutex::new(HashMap::new()),
            next_token: AtomicUsize::new(0),
            registry,
            ready: crate::sys::ReadySet::new()?,
            ready_failed: AtomicBool::new(false),
            polling: AtomicUsize::new(0),
            last_poll_end: AtomicU64::new(0),
            wake_now: AtomicBool::new(false),
            epoch: Instant::now(),
            gate: Mutex::new(()),
            resume: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let r = reader.clone();
        std::thread::Builder::new().name("ductile-tcp-progress".into()).spawn(move || r.run(poll))?;
        Ok(reader)
    }

    /// Adds an authenticated connection (non-blocking socket).
    pub(super) fn add(&self, peer: Rank, stream: TcpStream) -> std::io::Result<()> {
        stream.set_nonblocking(true)?;
        let token = Token(self.next_token.fetch_add(1, Ordering::Relaxed));
        let conn = Arc::new(Inbound {
            peer,
            stream,
            ended: AtomicBool::new(false),
            state: Mutex::new(ReadState { buf: BytesMut::with_capacity(READ_BUF), big: None, received: 0 }),
        });
        // Registered in both sets before it is known: a connection that only one set
        // reports could wait unread (on failure, the caller drops it).
        let fd = conn.stream.as_raw_fd();
        self.registry.register(&mut SourceFd(&fd), token, Interest::READABLE)?;
        if let Err(e) = self.ready.add(fd, token.0 as u64) {
            let _ = self.registry.deregister(&mut SourceFd(&fd));
            return Err(e);
        }
        self.mailbox.peer_connected(peer);
        lock(&self.conns).insert(token, conn.clone());
        // An event reported before the insertion found no connection: read what came.
        let mut st = lock(&conn.state);
        self.drain(&conn, &mut st, None);
        Ok(())
    }

    /// Stops the progress thread (within [`TICK`]).
    pub(super) fn shutdown(&self) {
        self.shutdown.store(true, Ordering::Release);
        let _g = lock(&self.gate);
        self.resume.notify_all();
    }

    /// Reads the connections that have something to read and that no one else is
    /// reading; never blocks. True if any bytes arrived.
    ///
    /// With up to [`READ_EACH`] connections, each is read in turn: a `recv` that finds
    /// data reads it too. With more, which ones to read is asked first, in one call
    /// whatever their number ([`crate::sys::ReadySet`]): reading each in turn cost a
    /// `recv` per connection and poll, and with 30 idle peers the 8-byte one-way latency
    /// between two ranks of a 32-rank tcp job was 17.0 µs instead of 6.2 (medians of 3,
    /// docs/BENCHMARKS.md). Should the question fail, every connection is read.
    ///
    /// `flush` writes this endpoint's queued output and says whether some is still
    /// queued: a thread that waits for a payload to land in its receive's memory
    /// ([`Reader::land_here`]) keeps its own sends flowing meanwhile, since the peer may
    /// wait for them before it sends the rest.
    pub(super) fn progress(&self, flush: &dyn Fn() -> bool) -> bool {
        // The connections to read, taken out of the map: a reading thread may wait for a
        // payload's rest, and the map's lock must not be held meanwhile.
        let mut picked: [Option<Arc<Inbound>>; 16] = Default::default();
        let mut every = Vec::new();
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
        {
            let conns = lock(&self.conns);
            let mut pick = |it: &mut dyn Iterator<Item = &Arc<Inbound>>| {
                picked.iter_mut().zip(it).for_each(|(slot, c)| *slot = Some(c.clone()));
            };
            if conns.len() <= READ_EACH {
                pick(&mut conns.values());
            } else {
                match self.ready.ready(&mut events) {
                    Ok(keys) => pick(&mut keys.filter_map(|k| conns.get(&Token(usize::try_from(k).ok()?)))),
                    Err(e) => {
                        if !self.ready_failed.swap(true, Ordering::Relaxed) {
                            tracing::warn!("{}: tcp: asking which connections are readable failed: {e}", self.me);
                        }
                        every = conns.values().cloned().collect();
                    }
                }
            }
        }
        let mut ended = false;
        let mut read = false;
        for conn in picked.iter().flatten().chain(&every) {
            // Busy: another thread reads it. Poisoned: read on, as `lock` does.
            let st = match conn.state.try_lock() {
                Ok(st) => Some(st),
                Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            };
            if let Some(mut st) = st {
                let before = st.received;
                ended |= self.drain(conn, &mut st, Some(flush));
                read |= st.received != before;
            }
        }
        if ended {
            // Closing the socket (the last reference) also removes it from both epoll
            // sets; it leaves the level-triggered one now, which would report it again.
            lock(&self.conns).retain(|_, c| {
                let keep = !c.ended.load(Ordering::Acquire);
                if !keep {
                    self.ready.remove(c.stream.as_raw_fd());
                }
                keep
            });
        }
        read
    }

    /// An application thread starts polling: the progress thread stands aside.
    pub(super) fn poll_begin(&self) {
        self.polling.fetch_add(1, Ordering::AcqRel);
    }

    /// The polling thread stops, and whatever arrived meanwhile is read now. If it is
    /// about to sleep (`parking`), the progress thread resumes at once; otherwise only
    /// once no thread has polled for [`GATE_TICK`], so a ping-pong of blocking calls
    /// never wakes it. `flush` is as for [`Reader::progress`].
    pub(super) fn poll_end(&self, parking: bool, flush: &dyn Fn() -> bool) {
        let last = self.polling.fetch_sub(1, Ordering::AcqRel) == 1;
        if last && parking {
            self.wake_now.store(true, Ordering::Release);
            let _g = lock(&self.gate);
            self.resume.notify_all();
        } else if last {
            self.last_poll_end.store(self.since_epoch(), Ordering::Release);
        }
        let _ = self.progress(flush);
    }

    fn since_epoch(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Whether the progress thread should stay aside: a thread polls, or one stopped
    /// polling less than [`GATE_TICK`] ago and is likely to poll again soon.
    fn stand_aside(&self) -> bool {
        if self.shutdown.load(Ordering::Acquire) || self.wake_now.swap(false, Ordering::AcqRel) {
            return false;
        }
        if self.polling.load(Ordering::Acquire) > 0 {
            return true;
        }
        let idle = self.since_epoch().saturating_sub(self.last_poll_end.load(Ordering::Acquire));
        idle < GATE_TICK.as_nanos() as u64
    }

    fn run(&self, mut poll: Poll) {
        let mut events = Events::with_capacity(64);
        while !self.shutdown.load(Ordering::Acquire) {
            {
                let mut g = lock(&self.gate);
                while self.stand_aside() {
                    g = self.resume.wait_timeout(g, GATE_TICK).unwrap_or_else(std::sync::PoisonError::into_inner).0;
                }
            }
            if let Err(e) = poll.poll(&mut events, Some(TICK)) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!("{}: tcp progress: poll failed: {e}", self.me);
                    std::thread::sleep(TICK);
                }
                continue;
            }
            for ev in &events {
                let conn = lock(&self.conns).get(&ev.token()).cloned();
                if let Some(conn) = conn {
                    let mut st = lock(&conn.state);
                    if self.drain(&conn, &mut st, None) {
                        drop(st);
                        let _ = self.registry.deregister(&mut SourceFd(&conn.stream.as_raw_fd()));
                        self.ready.remove(conn.stream.as_raw_fd());
                        lock(&self.conns).remove(&ev.token());
                    }
                }
            }
        }
    }

    /// Delivers every complete frame in `st`; `Ok(true)` on a goodbye.
    ///
    /// A polling application thread (`poller`, its output's flush) reads a large message
    /// that a receive of its own waits for straight into the receive's memory
    /// ([`Reader::land_here`]).
    fn parse(
        &self,
        conn: &Inbound,
        st: &mut ReadState,
        poller: Option<&dyn Fn() -> bool>,
    ) -> Result<bool, TransportError> {
        let peer = conn.peer;
        let limits = FrameLimits { max_payload: self.max_payload, peer };
        loop {
            if let Some((h, big)) = &st.big {
                if (big.filled() as u64) < h.len {
                    return Ok(false);
                }
                match st.big.take() {
                    Some((h, Big::Buf(big))) => self.dispatch(peer, h, big.freeze())?,
                    Some((h, Big::Mem(Mem::Get(part), _))) => {
                        self.one_sided.gets.complete_landed(peer, h.request_id(), part);
                    }
                    Some((_, Big::Mem(Mem::Recv(claim), _))) => self.mailbox.complete_claim(claim),
                    None => {}
                }
                continue;
            }
            if st.buf.len() < HEADER_LEN {
                return Ok(false);
            }
            let mut raw = [0u8; HEADER_LEN];
            raw.copy_from_slice(&st.buf[..HEADER_LEN]);
            let h = FrameHeader::decode(&raw, limits).map_err(|source| TransportError::Frame { peer, source })?;
            if h.kind == FrameKind::Bye {
                return Ok(true);
            }
            // The length passed the cap check; a cap beyond the address space is refused.
            let len = usize::try_from(h.len).map_err(|_| TransportError::Frame {
                peer,
                source: FrameError::TooLarge { len: h.len, cap: limits.max_payload },
            })?;
            if len <= READ_BUF {
                if st.buf.len() < HEADER_LEN + len {
                    return Ok(false);
                }
                st.buf.advance(HEADER_LEN);
                let payload = st.buf.split_to(len).freeze();
                self.dispatch(peer, h, payload)?;
            } else {
                st.buf.advance(HEADER_LEN);
                if let (FrameKind::Data, Some(flush)) = (h.kind, poller) {
                    if let Some(landed) = self.land_here(conn, st, h, len, flush) {
                        landed?;
                        continue;
                    }
                }
                // The payload goes straight into the receiver's memory if a get or a
                // receive waits for it there.
                let mem = match h.kind {
                    FrameKind::GetReply => self.one_sided.gets.take_landing(peer, h.request_id(), h.len).map(Mem::Get),
                    FrameKind::Data => self.mailbox.claim(peer, h.ctx, h.tag, h.len).map(Mem::Recv),
                    _ => None,
                };
                let mut big = mem.map_or_else(|| Big::Buf(BytesMut::with_capacity(len)), |m| Big::Mem(m, 0));
                let take = st.buf.len().min(len);
                big.extend(&st.buf[..take]);
                st.buf.advance(take);
                st.big = Some((h, big));
            }
        }
    }

    /// Reads the payload of a large data frame (header `h`, already consumed; `len`
    /// bytes) straight into the memory of the receive that the calling thread waits for,
    /// if that receive would take it ([`Mailbox::land_here`]); `None` otherwise.
    ///
    /// A blocking `recv_into` lends its memory only while its thread waits, so the
    /// payload is read within this call: the bytes of it already read first, then the
    /// socket, waiting for it to become readable (and writing this endpoint's queued
    /// output with `flush` meanwhile: the peer may need it before it sends more). This
    /// saves a copy of the whole payload: read into a buffer of its own, it would be
    /// copied into the receive's memory afterwards. While the payload flows, the thread
    /// reads on; once it stalls for [`LAND_STALL`], or stalls at all after [`LAND_FOR`]
    /// (the thread must get back to its receive's deadline, and other connections wait
    /// to be read), the rest goes on in a buffer of its own (`st.big`), with what came
    /// so far copied there, delivered as any large frame. `Some(Err(..))` if the
    /// connection failed: the receive fails as the peer's end is recorded.
    fn land_here(
        &self,
        conn: &Inbound,
        st: &mut ReadState,
        h: FrameHeader,
        len: usize,
        flush: &dyn Fn() -> bool,
    ) -> Option<Result<(), TransportError>> {
        let fd = conn.stream.as_raw_fd();
        self.mailbox.land_here(conn.peer, h.ctx, h.tag, len, |mem| {
            let mut n = st.buf.len().min(len);
            mem[..n].copy_from_slice(&st.buf[..n]);
            st.buf.advance(n);
            let start = Instant::now();
            let mut last = start;
            let mut spins = 0u32;
            let failed = loop {
                if n == len {
                    return (true, Ok(()));
                }
                match crate::sys::recv_nonblocking(fd, &mut &mut mem[n..]) {
                    Ok(Got { n: 0, .. }) => {
                        break TransportError::io(conn.peer, std::io::ErrorKind::UnexpectedEof.into())
                    }
                    Ok(Got { n: got, .. }) => {
                        n += got;
                        st.received += got as u64;
                        last = Instant::now();
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        let now = Instant::now();
                        let left = LAND_STALL.saturating_sub(now - last).min(LAND_FOR.saturating_sub(now - start));
                        if left.is_zero() {
                            let mut rest = BytesMut::with_capacity(len);
                            rest.extend_from_slice(&mem[..n]);
                            st.big = Some((h, Big::Buf(rest)));
                            return (false, Ok(()));
                        }
                        let queued = flush();
                        // More comes within microseconds while the peer writes: the read is
                        // tried again at once (yielding now and then to a peer that shares
                        // the core) before the thread waits in the kernel, where being
                        // woken again can take longer than the next bytes (see
                        // `LAND_SPIN`).
                        if now - last < LAND_SPIN {
                            spins = spins.wrapping_add(1);
                            if spins.is_multiple_of(16) {
                                std::thread::yield_now();
                            }
                            continue;
                        }
                        // With output still queued, a short wait and the flush again (the
                        // peer may be reading it to make room for more); otherwise a wait
                        // until more comes.
                        let wait = if queued { LAND_FLUSH.min(left) } else { left };
                        crate::sys::wait_readable(fd, wait);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => break TransportError::io(conn.peer, e),
                }
            };
            (false, Err(failed))
        })
    }

    /// Hands one complete frame to where it goes.
    fn dispatch(&self, peer: Rank, h: FrameHeader, payload: bytes::Bytes) -> Result<(), TransportError> {
        let malformed = |what| TransportError::Frame { peer, source: FrameError::Malformed(what) };
        let os = &self.one_sided;
        match h.kind {
            FrameKind::Data => self.mailbox.deliver(Envelope { src: peer, ctx: h.ctx, tag: h.tag, payload }),
            FrameKind::GetRequest => {
                let req = GetRequest::decode(&payload).ok_or_else(|| malformed("get request"))?;
                let reply = os.windows.read_capped(req, self.max_payload);
                if let Err(e) = &reply {
                    tracing::warn!("{}: refused a get by {peer}: {e}", self.me);
                }
                // The server task ends only when the backend shuts down.
                let _ = os.serve.send(Served { peer, id: h.request_id(), reply });
            }
            FrameKind::GetReply => {
                if let Err(e) = os.gets.complete(peer, h.request_id(), Ok(payload)) {
                    tracing::warn!("{}: {e}", self.me);
                }
            }
            FrameKind::GetRefusal => {
                let why = window::decode_refusal(&payload).ok_or_else(|| malformed("get refusal"))?;
                if let Err(e) = os.gets.complete(peer, h.request_id(), Err(why)) {
                    tracing::warn!("{}: {e}", self.me);
                }
            }
            FrameKind::Bye => return Err(malformed("goodbye inside a frame")),
            FrameKind::Flush | FrameKind::Flushed => return Err(malformed("a flush frame over tcp")),
        }
        Ok(())
    }

    /// Reads until `WouldBlock`, delivering complete frames. True once the connection
    /// has ended (goodbye, error, or bad frame).
    ///
    /// A polling application thread (`poller`: its output's flush, see
    /// [`Reader::parse`]) stops at a short read instead: the socket was empty then, and
    /// what arrives later raises a new edge for the progress thread. The progress thread
    /// itself reads on to `WouldBlock`, since the edge it
    /// was woken by may also stand for the peer's close arriving just behind the data.
    fn drain(&self, conn: &Inbound, st: &mut ReadState, poller: Option<&dyn Fn() -> bool>) -> bool {
        if conn.ended.load(Ordering::Acquire) {
            return true;
        }
        let fd = conn.stream.as_raw_fd();
        let mut drained = false;
        loop {
            match self.parse(conn, st, poller) {
                Ok(false) => {}
                Ok(true) => return self.end(conn, st, Ok(())),
                Err(e) => return self.end(conn, st, Err(e)),
            }
            // A short read emptied the socket: no `recv` that would only find nothing
            // (a whole system call on the polling thread's way back to its receiver).
            // Nor does a thread whose receive has its message read on: what follows
            // stays in the socket for the receive it posts next, which may then take it
            // straight into its memory (or for the progress thread, which resumes when
            // this one stops polling).
            if poller.is_some() && (drained || self.mailbox.answered_here()) {
                return false;
            }
            let read = match &mut st.big {
                Some((h, big)) => {
                    let want = usize::try_from(h.len).unwrap_or(usize::MAX) - big.filled();
                    big.recv(fd, want)
                }
                None => {
                    if st.buf.capacity() - st.buf.len() < READ_BUF / 2 {
                        st.buf.reserve(READ_BUF);
                    }
                    crate::sys::recv_nonblocking(fd, &mut st.buf)
                }
            };
            match read {
                Ok(Got { n: 0, .. }) => {
                    let eof = TransportError::io(conn.peer, std::io::ErrorKind::UnexpectedEof.into());
                    return self.end(conn, st, Err(eof));
                }
                Ok(Got { n, full }) => {
                    st.received += n as u64;
                    drained = !full;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return self.end(conn, st, Err(TransportError::io(conn.peer, e))),
            }
        }
    }

    /// Marks a connection ended and tells the mailbox; returns true.
    fn end(&self, conn: &Inbound, st: &mut ReadState, how: Result<(), TransportError>) -> bool {
        if conn.ended.swap(true, Ordering::AcqRel) {
            return true;
        }
        st.buf.clear();
        st.big = None;
        let gets = &self.one_sided.gets;
        // The mailbox hears first: a get started from now on sees the peer has ended
        // (see `Inner::get`), and those started before are failed here.
        match how {
            Ok(()) => {
                self.mailbox.peer_ended(conn.peer, PeerEnd::Closed);
                gets.fail_peer(conn.peer, || TransportError::PeerClosed(conn.peer));
            }
            Err(e) => {
                self.mailbox.peer_ended(conn.peer, PeerEnd::Lost);
                gets.fail_peer(conn.peer, || TransportError::PeerLost(conn.peer));
                if !self.shutdown.load(Ordering::Acquire) {
                    // A peer that dies is named by what waits on it, and by the launcher;
                    // a peer that breaks the protocol only here.
                    if matches!(e, TransportError::Frame { .. }) {
                        tracing::error!("{}: connection from {} dropped: {e}", self.me, conn.peer);
                    } else {
                        tracing::info!("{}: connection from {} dropped: {e}", self.me, conn.peer);
                    }
                }
            }
        }
        true
    }
}
