//! The QUIC backend (quinn, rustls with ring, and aws-lc-rs for the packet ciphers).
//!
//! Each rank binds one UDP socket as a quinn endpoint that both listens and dials.
//!
//! - **Pinning** (`tls`): at bind the endpoint generates a self-signed certificate; its
//!   address text is `IP:PORT#<SHA-256 of the DER certificate, 64 hex digits>`.
//!   Addresses reach peers through the launcher's authenticated bootstrap, so a dialer
//!   accepts only the certificate whose fingerprint is pinned for the rank it dials
//!   (and still checks the TLS 1.3 handshake signature). TLS 1.3 only, no client
//!   certificates.
//! - **Handshake**: on the first bidirectional stream of every connection the dialer
//!   runs the job-key handshake ([`crate::auth`]), so the listener learns the dialer's
//!   rank and that it holds the job key. A connection that fails either check is closed
//!   and logged, and nothing it sent is delivered.
//! - **Messages** (`outbound`, `inbound`): a rank opens its own connection to a
//!   peer on the first send to it (or get from it) and keeps using it; inbound
//!   connections carry the dialer's traffic in. Frames ([`crate::frame`]) travel in
//!   order on the send half of the handshake stream, written by one writer task per
//!   connection from `Bytes` without a copy; quinn's flow control holds a send back
//!   until the peer has room. The listener validates each header before reading its
//!   payload and delivers into the mailbox; a bad frame closes that connection only.
//! - **Gets** ([`crate::window`]): each get opens a fresh bidirectional stream on the
//!   reader's connection to the window's owner and sends a get-request frame on it; the
//!   owner's tokio task for that connection answers with a reply frame (a slice of the
//!   window, no copy) or a refusal frame, so the owner's application thread takes no
//!   part and gets need no request ids.
//! - **Flushes** ([`crate::Transport::flush`]): a send completes once quinn has its
//!   bytes, which a process that dies takes with it. A flush counts the frames its
//!   connection's writer task has written and asks the peer, on a fresh bidirectional
//!   stream, to answer once its reader has delivered that many; every connection at
//!   once.
//! - **Datagrams** (`tls::transport_config`): sized for the kernel's route to each peer.
//!   On loopback-like routes (MTU ≥ 16 KiB) one datagram of up to 64 KB per system
//!   call, elsewhere segmentation offload with segments of at most 6.5 KB; MTU
//!   discovery confirms each size, and the socket asks for 4 MiB buffers so that a
//!   message's burst of large datagrams is not dropped.
//! - **Ends**: `close()` writes a goodbye frame on every outbound stream, waits (within
//!   the handshake timeout) until peers have acknowledged it, and closes every
//!   connection with the goodbye code; peers then fail waiting receives with
//!   `PeerClosed`. A connection that ends any other way (including an endpoint dropped
//!   without `close()`, or silence past the idle timeout of a few seconds, kept alive by
//!   keep-alives) makes the peer `PeerLost`.

use crate::auth::Identity;
use crate::config::TransportConfig;
use crate::error::TransportError;
use crate::frame::FrameHeader;
use crate::ids::{Context, Rank, Tag};
use crate::matching::Mailbox;
// The poison-tolerant lock helper is shared with the TCP backend.
use crate::landing::Part;
use crate::tcp::lock;
use crate::transport::{BoxFuture, Capabilities, EndpointAddr, Transport, TransportSetup};
use crate::window::{GetRequest, Got, WindowError, WindowId, WindowTable};
use bytes::Bytes;
use outbound::Outbound;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use tls::{Certificate, PeerAddr};
use tokio::task::AbortHandle;
use tokio::time::{timeout, timeout_at, Instant};
use wire::close;

mod inbound;
mod outbound;
mod tls;
mod wire;

const NAME: &str = "quic";

/// The UDP socket buffers asked for, each way. A 4 MiB message is 64 datagrams of 64 KB
/// on loopback, and Linux's default 208 KiB holds three: a burst then loses datagrams and
/// the congestion controller backs off. Over loopback, 4 MiB gets ran at 0.46-2.33 GiB/s
/// without and 2.45-2.57 with 4 MiB (single runs). A stream could then have 16 MiB in
/// flight (`tls::STREAM_WINDOW`, 64 MiB since), and with 4 MiB buffers a stream of
/// 200 × 4 MiB still lost about 1 % of its datagrams (12-23 congestion events per job);
/// with 16 MiB, none in 4 jobs (nor with 32 MiB in 4), at the same throughput (the
/// receiver's CPU is the limit). The buffer only fills while the receiver lags behind.
const SOCKET_BUFFER: usize = 16 << 20;

/// How often a flush looks whether its peer is known to have ended meanwhile.
const ENDED_POLL: std::time::Duration = std::time::Duration::from_millis(5);

/// The connection to one peer, behind a lock held while it is being opened.
type Slot = Arc<tokio::sync::Mutex<Option<Arc<Outbound>>>>;

struct Inner {
    me: Identity,
    cfg: TransportConfig,
    mailbox: Arc<Mailbox>,
    endpoint: quinn::Endpoint,
    local: PeerAddr,
    /// The accepting side's settings, given a transport config for each incoming route.
    server: quinn::ServerConfig,
    peers: RwLock<Vec<Option<PeerAddr>>>,
    /// Connections by peer. A connection that ends is let go by its watcher task, so
    /// that its state goes (a process that left the job at a change, say), see
    /// `Outbound::start`.
    out: Arc<Mutex<HashMap<Rank, Slot>>>,
    /// Peers whose connection ended with their goodbye: not dialed again.
    departed: Arc<Mutex<HashSet<Rank>>>,
    windows: WindowTable,
    tasks: Mutex<Vec<AbortHandle>>,
    closed: AtomicBool,
}

/// The QUIC backend; see the module docs.
pub struct QuicTransport {
    inner: Arc<Inner>,
}

impl QuicTransport {
    /// Generates the endpoint's certificate, binds a UDP socket on the configured host
    /// and an ephemeral port, and starts accepting connections on the current tokio
    /// runtime.
    ///
    /// # Errors
    /// No tokio runtime, the socket cannot be bound, or the TLS setup fails.
    pub fn bind(setup: TransportSetup) -> Result<Self, TransportError> {
        let host = setup.config.get_bind_host();
        let bind_err = |source| TransportError::Bind { transport: NAME, addr: host.to_string(), source };
        let setup_err = |what: String| bind_err(std::io::Error::other(what));
        let runtime = quinn::default_runtime().ok_or_else(|| setup_err("no tokio runtime is running".into()))?;
        let cert = Certificate::generate().map_err(|e| setup_err(format!("certificate: {e}")))?;
        let server = tls::server_config(&cert, tls::transport_config(None).map_err(setup_err)?).map_err(setup_err)?;
        let socket = std::net::UdpSocket::bind((host, 0)).map_err(bind_err)?;
        crate::sys::set_socket_buffers(std::os::fd::AsRawFd::as_raw_fd(&socket), SOCKET_BUFFER);
        // Receive datagrams as large as any route can carry; see tls::transport_config
        // for who sends them. quinn sizes its receive buffer from this: 64 KB × 64 GRO
        // segments × a batch of 32, about 134 MB of address space per endpoint instead
        // of 3 MB, zero pages of which only the few MiB in use become resident.
        let mut config = quinn::EndpointConfig::default();
        config.max_udp_payload_size(tls::LARGEST_DATAGRAM).map_err(|e| setup_err(e.to_string()))?;
        let endpoint = quinn::Endpoint::new(config, Some(server.clone()), socket, runtime).map_err(bind_err)?;
        let local = PeerAddr { addr: endpoint.local_addr().map_err(bind_err)?, fingerprint: cert.fingerprint() };
        let inner = Arc::new(Inner {
            me: setup.identity,
            cfg: setup.config,
            mailbox: setup.mailbox,
            endpoint,
            local,
            server,
            peers: RwLock::new(Vec::new()),
            out: Arc::new(Mutex::new(HashMap::new())),
            departed: Arc::new(Mutex::new(HashSet::new())),
            windows: WindowTable::new(),
            tasks: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
        });
        let task = tokio::spawn(inbound::accept_loop(inner.clone()));
        inner.track(task.abort_handle());
        Ok(Self { inner })
    }
}

impl Inner {
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Keeps a task's handle so that closing or dropping the endpoint stops it.
    fn track(&self, task: AbortHandle) {
        let mut tasks = lock(&self.tasks);
        if self.is_closed() {
            task.abort();
            return;
        }
        tasks.retain(|t| !t.is_finished());
        tasks.push(task);
    }

    fn abort_tasks(&self) {
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
    }

    async fn send(&self, dst: Rank, ctx: Context, tag: Tag, payload: Bytes) -> Result<(), TransportError> {
        if self.is_closed() {
            return Err(TransportError::Closed);
        }
        let cap = self.cfg.get_max_payload();
        if payload.len() as u64 > cap {
            return Err(TransportError::MessageTooLarge { peer: dst, len: payload.len(), cap });
        }
        let out = self.outbound(dst).await?;
        let header = FrameHeader::data(self.me.rank, ctx, tag, payload.len() as u64).encode();
        out.send(header, payload).await
    }

    /// A get of `len` bytes, into `into` (of that length) if given.
    async fn get(
        &self,
        dst: Rank,
        id: WindowId,
        offset: u64,
        len: u64,
        into: Option<Part>,
    ) -> Result<Got, TransportError> {
        if self.is_closed() {
            return Err(TransportError::Closed);
        }
        let req = GetRequest { window: id, offset, len };
        let refused = |e: WindowError| TransportError::Window { peer: dst, what: e.to_string() };
        if dst == self.me.rank {
            return self.windows.read(req).map(|b| Got::new(into, b)).map_err(refused);
        }
        let cap = self.cfg.get_max_payload();
        if len > cap {
            return Err(refused(WindowError::TooLarge { len, cap }));
        }
        self.remote_get(dst, req, into).await
    }

    async fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let limit = self.cfg.get_handshake_timeout();
        let deadline = Instant::now() + limit;
        let bye = FrameHeader::bye(self.me.rank).encode();
        // A peer known to have ended gets no goodbye: one that was killed would never
        // acknowledge it, and the wait for it, up to `limit`, held a process that left
        // after a failure past the launcher's grace for leaving (5 s).
        let slots: Vec<Slot> =
            lock(&self.out).iter().filter(|(r, _)| !self.mailbox.has_ended(**r)).map(|(_, s)| s.clone()).collect();
        let mut goodbyes = tokio::task::JoinSet::new();
        for slot in slots {
            goodbyes.spawn(async move {
                if let Ok(out) = timeout_at(deadline, slot.lock()).await {
                    if let Some(o) = out.as_ref() {
                        o.goodbye(bye, deadline).await;
                    }
                }
            });
        }
        while goodbyes.join_next().await.is_some() {}
        self.endpoint.close(close::BYE.into(), b"goodbye");
        if timeout(limit, self.endpoint.wait_idle()).await.is_err() {
            tracing::debug!("{}: QUIC connections still draining after {limit:?}", self.me.rank);
        }
        self.abort_tasks();
    }
}

impl Inner {
    /// See [`Transport::flush`]: the peer of every connection confirms, all at once. A
    /// peer known to have ended (or whose connection did) is not waited for.
    async fn flush(&self) -> Result<(), TransportError> {
        let slots: Vec<(Rank, Slot)> = lock(&self.out)
            .iter()
            .filter(|(r, _)| !self.mailbox.has_ended(**r))
            .map(|(r, s)| (*r, s.clone()))
            .collect();
        let mut flushes = tokio::task::JoinSet::new();
        for (peer, slot) in slots {
            let (mailbox, me) = (self.mailbox.clone(), self.me.rank);
            flushes.spawn(async move {
                let confirmed = async {
                    // A dial in progress holds the slot: its sends have not completed.
                    let Some(out) = slot.lock().await.clone() else { return Ok(()) };
                    let res = match out.ended() {
                        None => out.flush(me).await,
                        Some(e) => Err(e),
                    };
                    match res {
                        // What it was sent ended with it.
                        Err(e) if out.ended().is_some() || mailbox.has_ended(peer) => {
                            tracing::debug!("{me}: no flush to {peer}: {e}");
                            Ok(())
                        }
                        res => res,
                    }
                };
                // The launcher's notice of a failure reaches the mailbox, not the
                // connection, which would wait for its idle timeout.
                let ended = async {
                    while !mailbox.has_ended(peer) {
                        tokio::time::sleep(ENDED_POLL).await;
                    }
                };
                tokio::select! {
                    res = confirmed => res,
                    () = ended => Ok(()),
                }
            });
        }
        let mut first = Ok(());
        while let Some(res) = flushes.join_next().await {
            if let (Ok(Err(e)), true) = (res, first.is_ok()) {
                first = Err(e);
            }
        }
        first
    }
}

impl Transport for QuicTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::BASIC
    }

    fn local_addr(&self) -> EndpointAddr {
        EndpointAddr(self.inner.local.to_string())
    }

    fn set_peers(&self, peers: &[EndpointAddr]) -> Result<(), TransportError> {
        let parse = |(i, a): (usize, &EndpointAddr)| {
            if a.0.is_empty() {
                // An endpoint that has left the job.
                return Ok(None);
            }
            PeerAddr::parse(&a.0).map(Some).ok_or_else(|| TransportError::BadAddress {
                transport: NAME,
                peer: Rank(u32::try_from(i).unwrap_or(u32::MAX)),
                addr: a.0.clone(),
            })
        };
        let parsed = peers.iter().enumerate().map(parse).collect::<Result<Vec<_>, _>>()?;
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
        Box::pin(self.inner.flush())
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
        Box::pin(async move { Ok(self.inner.get(dst, id, offset, len, None).await?.into_bytes()) })
    }

    fn get_into(
        &self,
        dst: Rank,
        id: WindowId,
        offset: u64,
        into: Part,
    ) -> BoxFuture<'_, Result<Part, TransportError>> {
        Box::pin(async move {
            let len = into.len() as u64;
            self.inner.get(dst, id, offset, len, Some(into)).await?.into_part()
        })
    }
}

impl Drop for QuicTransport {
    fn drop(&mut self) {
        // Local cleanup only: stop the tasks and let quinn drop every connection. No
        // goodbye is said, so peers see this endpoint as lost; close() says goodbye.
        self.inner.closed.store(true, Ordering::Release);
        self.inner.abort_tasks();
        self.inner.endpoint.close(close::DROPPED.into(), b"endpoint dropped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{JobId, JobKey};
    use crate::matching::{Pattern, SrcMatch, TagMatch};
    use crate::transport::Endpoint;
    use std::time::Duration;

    fn endpoint(rank: u32) -> (QuicTransport, Arc<Mailbox>) {
        let mailbox = Arc::new(Mailbox::new());
        let setup = TransportSetup {
            identity: Identity { job: JobId(5), key: JobKey::from_bytes([9; 32]), rank: Rank(rank) },
            size: 2,
            config: TransportConfig::default(),
            mailbox: mailbox.clone(),
        };
        (QuicTransport::bind(setup).unwrap(), mailbox)
    }

    /// Endpoints 0 (the bare transport) and 1 that know each other's addresses.
    fn connected_pair() -> (QuicTransport, Endpoint) {
        let (a, _) = endpoint(0);
        let (b, inbox) = endpoint(1);
        let table = [a.local_addr(), b.local_addr()];
        a.set_peers(&table).unwrap();
        b.set_peers(&table).unwrap();
        (a, Endpoint::new(Arc::new(b), inbox, Rank(1)))
    }

    const FROM_0: Pattern = Pattern { ctx: Context(0), src: SrcMatch::Rank(Rank(0)), tag: TagMatch::Tag(Tag(1)) };

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bad_frame_closes_only_that_connection() {
        let t = Duration::from_secs(10);
        let (a, b) = connected_pair();
        a.send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"before")).await.unwrap();
        assert_eq!(b.recv(FROM_0, t).await.unwrap().payload, &b"before"[..]);
        let out = a.inner.outbound(Rank(1)).await.unwrap();
        let mut bad = FrameHeader::data(Rank(0), Context(0), Tag(1), 3).encode();
        bad[0] ^= 0xff;
        out.send(bad, Bytes::from_static(b"bad")).await.unwrap();
        let err = b.recv(FROM_0, t).await.unwrap_err();
        assert!(matches!(err, TransportError::PeerLost(Rank(0))), "{err}");
        let started = Instant::now();
        while out.ended().is_none() {
            assert!(started.elapsed() < t, "the connection was not closed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The next send opens a fresh connection, and its message arrives. The receiver
        // may not have registered the new connection yet when it starts waiting.
        a.send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"after")).await.unwrap();
        let got = loop {
            match b.recv(FROM_0, t).await {
                Err(TransportError::PeerLost(_)) if started.elapsed() < t => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                other => break other.unwrap(),
            }
        };
        assert_eq!(got.payload, &b"after"[..]);
        a.close().await;
        b.transport().close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_its_peer_closed_is_let_go() {
        // A process that leaves the job at a change says goodbye; its peers must not
        // keep the closed connection's state for the rest of the job.
        let t = Duration::from_secs(10);
        let (a, b) = connected_pair();
        a.send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"hello")).await.unwrap();
        assert_eq!(b.recv(FROM_0, t).await.unwrap().payload, &b"hello"[..]);
        b.transport().close().await;
        let slot = lock(&a.inner.out).get(&Rank(1)).cloned().expect("a connection to 1");
        let started = Instant::now();
        while slot.lock().await.is_some() {
            assert!(started.elapsed() < t, "the closed connection is still held");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // And the peer is known to have left: not dialed again.
        let err = a.send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"late")).await.unwrap_err();
        assert!(matches!(err, TransportError::PeerClosed(Rank(1))), "{err}");
        a.close().await;
    }
}
