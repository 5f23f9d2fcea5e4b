//! The agent's channels: to whoever started it (fd 3, or stdin and stdout through a
//! remote shell), and to the controller (the same, its Unix socket, or TCP from
//! another host).

use super::*;

/// The agent's channel to the controller (or to its spawner), shared by whoever
/// reports on it: the supervisor and, on another host than the controller's, the
/// forwarders of its ranks' output. Once given up (see [`last_word`](Self::last_word)), nothing
/// waits on it any more: a write to a controller that vanished could block for good.
#[derive(Clone)]
pub struct Uplink {
    w: Arc<tokio::sync::Mutex<ChannelWrite>>,
    lost: Arc<AtomicBool>,
}

impl Uplink {
    pub(super) fn new(w: ChannelWrite) -> Self {
        Self { w: Arc::new(tokio::sync::Mutex::new(w)), lost: Arc::new(AtomicBool::new(false)) }
    }

    /// Sends one message (fails at once on a lost channel).
    pub(super) async fn send(&self, m: &FromAgent) -> Result<(), bootstrap::ControlError> {
        if self.lost.load(Ordering::Acquire) {
            return Err(std::io::Error::from(std::io::ErrorKind::NotConnected).into());
        }
        nonblocking::write_msg(&mut *self.w.lock().await, m).await
    }

    /// Sends a piece of a rank's output (dropped if the controller is gone).
    pub async fn output(&self, s: Stream, bytes: Vec<u8>) {
        let _ = self.send(&FromAgent::Output(s, bytes)).await;
    }

    /// Tries to send `m` for at most `limit`, then gives the channel up: later sends
    /// fail at once, and output is dropped.
    pub(super) async fn last_word(&self, m: &FromAgent, limit: Duration) {
        let _ = tokio::time::timeout(limit, self.send(m)).await;
        self.lost.store(true, Ordering::Release);
    }
}

/// When the agent last heard from the controller, kept by the task that reads its
/// channel (so a supervisor busy elsewhere does not mistake its own delay for silence).
#[derive(Clone)]
pub(super) struct Heard {
    base: tokio::time::Instant,
    ms: Arc<std::sync::atomic::AtomicU64>,
}

impl Heard {
    pub(super) fn new() -> Self {
        Self { base: tokio::time::Instant::now(), ms: Arc::new(std::sync::atomic::AtomicU64::new(0)) }
    }

    /// Something came now.
    pub(super) fn now(&self) {
        let ms = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.ms.store(ms, Ordering::Release);
    }

    /// When something last came.
    pub(super) fn last(&self) -> tokio::time::Instant {
        self.base + Duration::from_millis(self.ms.load(Ordering::Acquire))
    }
}

/// Reads the controller's messages into a channel, noting in `heard` when each came.
pub(super) fn controller_reader(mut r: ChannelRead, heard: Heard) -> mpsc::UnboundedReceiver<Result<ToAgent, String>> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let m = nonblocking::read_msg::<ToAgent>(&mut r).await.map_err(|e| e.to_string());
            heard.now();
            let failed = m.is_err();
            if tx.send(m).is_err() || failed {
                return;
            }
        }
    });
    rx
}

/// The channel to whoever started this agent: fd 3 (see [`spawn_with_channel`]), or
/// stdin and stdout for an agent started through a remote shell. Those two are taken
/// over (moved to new descriptors) so that nothing else writes to the channel: fd 0
/// becomes `/dev/null` and fd 1 a copy of stderr.
pub(super) fn parent_channel(stdio: bool) -> anyhow::Result<(ChannelRead, ChannelWrite)> {
    if !stdio {
        let fd: i32 =
            std::env::var(CONTROL_FD_ENV).context("the agent is started by `ductile run`, not by hand")?.parse()?;
        let std_stream = bootstrap::take_control(fd).map_err(anyhow::Error::msg)?;
        std_stream.set_nonblocking(true)?;
        let (r, w) = UnixStream::from_std(std_stream)?.into_split();
        return Ok((Box::new(r), Box::new(w)));
    }
    // The channel's end is made non-blocking, and with it whatever shares its open file:
    // stderr must not (writes to it would then fail when the pipe is full).
    let stat = |fd: i32| {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstat fills `st` for an open descriptor, or fails and leaves it unread.
        (unsafe { libc::fstat(fd, st.as_mut_ptr()) } == 0).then(|| {
            // SAFETY: fstat succeeded, so `st` is initialised.
            let st = unsafe { st.assume_init() };
            (st.st_dev, st.st_ino)
        })
    };
    if stat(1).is_some() && stat(1) == stat(2) {
        bail!("stdout and stderr are one file: the remote shell must keep them apart (no terminal, no 2>&1)");
    }
    let take = |fd: i32, replacement: i32| -> std::io::Result<OwnedFd> {
        use std::os::fd::FromRawFd;
        // SAFETY: dup, fcntl and dup2 on this process's standard descriptors; the new
        // descriptor is owned by the OwnedFd alone.
        unsafe {
            let new = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3);
            if new < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let owned = OwnedFd::from_raw_fd(new);
            let flags = libc::fcntl(new, libc::F_GETFL);
            if flags < 0 || libc::fcntl(new, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::dup2(replacement, fd) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(owned)
        }
    };
    let null = std::fs::File::open("/dev/null")?;
    let r = take(0, null.as_raw_fd())?;
    let w = take(1, 2)?;
    // Pipes or sockets, as the remote shell made them: both poll the same way.
    let r = tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(r)?;
    let w = tokio::net::unix::pipe::Sender::from_owned_fd_unchecked(w)?;
    Ok((Box::new(r), Box::new(w)))
}

/// The address this node's ranks bind to: loopback for a job on one host; on the
/// controller's host, the address it chose for the job ([`Network::here`]); on another
/// host, the local address of this agent's connection to the controller (`via`: a path
/// proven to work), or of a probe connection made for it, or failing that (the
/// launcher's host takes no TCP connection) of the route to the launcher.
///
/// # Errors
/// The controller cannot be reached from this host.
pub(super) async fn bind_host(h: &AgentHandoff, via: Option<IpAddr>) -> anyhow::Result<Option<IpAddr>> {
    let Some(net) = h.network.as_ref() else { return Ok(None) };
    if !h.remote {
        return Ok(Some(net.here));
    }
    if let Some(via) = via {
        return Ok(Some(via));
    }
    let probe = async {
        let mut s = dial_controller(h).await?;
        let via = s.local_addr()?.ip();
        nonblocking::write_msg(&mut s, &Hello::Probe).await?;
        anyhow::Ok(via)
    };
    match tokio::time::timeout(PROBE_LIMIT, probe).await {
        Ok(Ok(via)) => Ok(Some(via)),
        // A job that does not grow needs no connection to the launcher (its host may
        // take ssh only): the route to it must do.
        failed => {
            let why = match failed {
                Ok(Err(e)) => format!("{e:#}"),
                _ => format!("no answer within {PROBE_LIMIT:?}"),
            };
            let route = net.controller.iter().find_map(|a| crate::netaddr::route_source(*a).ok());
            let ip = route.context("no route to the launcher's host")?;
            tracing::warn!(
                "{}: cannot reach the launcher over TCP ({why}); ranks bind to {ip}, on the route to it",
                h.node
            );
            Ok(Some(ip))
        }
    }
}

/// Longest an agent started with the job tries to reach the launcher over TCP to learn
/// its address on a working path.
const PROBE_LIMIT: Duration = Duration::from_secs(10);

/// Connects a joining agent to the controller and says who it is: over its Unix
/// socket on the controller's host, else over TCP (see [`dial_controller`]). Returns
/// the connection and, over TCP, its local address.
pub(super) async fn connect(
    h: &AgentHandoff,
    j: &Joining,
) -> anyhow::Result<(ChannelRead, ChannelWrite, Option<IpAddr>)> {
    let limit = Duration::from_millis(h.join_timeout_ms.max(1));
    let hello = Hello::Agent { node: h.node, token: j.token.clone(), pid: std::process::id() };
    if h.network.is_none() || !h.remote {
        let s = tokio::time::timeout(limit, UnixStream::connect(&h.socket)).await.context("timed out")??;
        let (r, mut w) = s.into_split();
        nonblocking::write_msg(&mut w, &hello).await?;
        return Ok((Box::new(r), Box::new(w), None));
    }
    let mut s = dial_controller(h).await?;
    let via = s.local_addr()?.ip();
    nonblocking::write_msg(&mut s, &hello).await?;
    let (r, w) = s.into_split();
    Ok((Box::new(r), Box::new(w), Some(via)))
}

/// A TCP connection to the controller, both sides proven to hold the job key: all of
/// its addresses are tried at once (an address of another network, or one that only
/// exists on the controller's host, such as a container bridge's, may never answer),
/// and the first that authenticates is kept. Rounds that fail (the controller refuses
/// connections while it greets many) are retried after a short pause, within the join
/// timeout.
///
/// # Errors
/// None answered in time; the error says what happened at each address.
pub(super) async fn dial_controller(h: &AgentHandoff) -> anyhow::Result<tokio::net::TcpStream> {
    let net = h.network.as_ref().context("the job does not span hosts")?;
    if net.controller.is_empty() {
        bail!("the controller has no address");
    }
    let limit = Duration::from_millis(h.join_timeout_ms.max(1));
    let deadline = tokio::time::Instant::now() + limit;
    let me = auth::Identity { job: h.job, key: h.key.clone(), rank: Rank(h.node.0) };
    // Agents that start together should not retry together.
    let pause = Duration::from_millis(100 + u64::from(std::process::id() % 200));
    loop {
        let round = tokio::time::Instant::now() + DIAL_ROUND.min(deadline - tokio::time::Instant::now());
        let mut attempts: futures_util::stream::FuturesUnordered<_> =
            net.controller.iter().map(|&addr| dial_one(addr, &me, round)).collect();
        let mut failures = Vec::new();
        while let Some(r) = futures_util::StreamExt::next(&mut attempts).await {
            match r {
                Ok(s) => return Ok(s),
                Err(e) => failures.push(e),
            }
        }
        if tokio::time::Instant::now() + pause >= deadline {
            bail!("cannot reach the controller within {limit:?}: {}", failures.join("; "));
        }
        tokio::time::sleep(pause).await;
    }
}

/// Longest one round of [`dial_controller`] waits for its addresses.
const DIAL_ROUND: Duration = Duration::from_secs(5);

/// One authenticated connection to the controller at `addr`, by `deadline`.
async fn dial_one(
    addr: std::net::SocketAddr,
    me: &auth::Identity,
    deadline: tokio::time::Instant,
) -> Result<tokio::net::TcpStream, String> {
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        crate::netaddr::keep_alive(&s)?;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        auth::dial(&mut s, me, crate::controller::socket::CONTROLLER_RANK, left).await?;
        anyhow::Ok(s)
    };
    match tokio::time::timeout_at(deadline, attempt).await {
        Ok(r) => r.map_err(|e| format!("{addr}: {e:#}")),
        Err(_) => Err(format!("{addr}: no answer in time")),
    }
}
