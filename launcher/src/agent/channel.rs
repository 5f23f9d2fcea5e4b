//! The agent's channels: to whoever started it (fd 3, or stdin and stdout through a
//! remote shell), and to the controller (the same, its Unix socket, or TCP from
//! another host).

use super::*;

/// The agent's channel to the controller (or to its spawner), shared by whoever
/// reports on it: the supervisor and, on another host than the controller's, the
/// forwarders of its ranks' output.
#[derive(Clone)]
pub struct Uplink(Arc<tokio::sync::Mutex<ChannelWrite>>);

impl Uplink {
    pub(super) fn new(w: ChannelWrite) -> Self {
        Self(Arc::new(tokio::sync::Mutex::new(w)))
    }

    /// Sends one message.
    pub(super) async fn send(&self, m: &FromAgent) -> Result<(), bootstrap::ControlError> {
        nonblocking::write_msg(&mut *self.0.lock().await, m).await
    }

    /// Sends a piece of a rank's output (lost if the controller is gone).
    pub async fn output(&self, s: Stream, bytes: Vec<u8>) {
        let _ = self.send(&FromAgent::Output(s, bytes)).await;
    }
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
/// proven to work), or of a probe connection made for it.
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
    let mut s = dial_controller(h).await?;
    let via = s.local_addr()?.ip();
    nonblocking::write_msg(&mut s, &Hello::Probe).await?;
    Ok(Some(via))
}

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
/// and the first that authenticates is kept, within the join timeout.
///
/// # Errors
/// None answered; the error names each address and what happened there.
pub(super) async fn dial_controller(h: &AgentHandoff) -> anyhow::Result<tokio::net::TcpStream> {
    let net = h.network.as_ref().context("the job does not span hosts")?;
    let limit = Duration::from_millis(h.join_timeout_ms.max(1));
    let me = auth::Identity { job: h.job, key: h.key.clone(), rank: Rank(h.node.0) };
    let attempts = net.controller.iter().map(|&addr| {
        let me = me.clone();
        Box::pin(async move {
            let attempt = async {
                let mut s = tokio::net::TcpStream::connect(addr).await?;
                s.set_nodelay(true)?;
                auth::dial(&mut s, &me, crate::controller::socket::CONTROLLER_RANK, limit).await?;
                anyhow::Ok(s)
            };
            match tokio::time::timeout(limit, attempt).await {
                Ok(r) => r.map_err(|e| format!("{addr}: {e:#}")),
                Err(_) => Err(format!("{addr}: no answer within {limit:?}")),
            }
        })
    });
    if net.controller.is_empty() {
        bail!("the controller has no address");
    }
    match futures_util::future::select_ok(attempts).await {
        Ok((s, _)) => Ok(s),
        Err(last) => bail!("cannot reach the controller at any of its addresses (the last: {last})"),
    }
}
