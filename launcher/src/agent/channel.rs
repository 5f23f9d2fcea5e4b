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

/// The address this node's ranks bind to: loopback for a job on one host; else the
/// local address of this agent's connection to the controller, or of the route to it.
pub(super) fn bind_host(h: &AgentHandoff, via: Option<IpAddr>) -> Option<IpAddr> {
    let net = h.network.as_ref()?;
    via.or_else(|| net.controller.iter().find_map(|a| crate::netaddr::route_source(*a).ok()))
}

/// Connects a joining agent to the controller and says who it is: over its Unix
/// socket on the controller's host, else over TCP (the first of its addresses that
/// answers), authenticated with the job key. Returns the connection and, over TCP, its
/// local address.
pub(super) async fn connect(
    h: &AgentHandoff,
    j: &Joining,
) -> anyhow::Result<(ChannelRead, ChannelWrite, Option<IpAddr>)> {
    let limit = Duration::from_millis(h.join_timeout_ms.max(1));
    let hello = Hello::Agent { node: h.node, token: j.token.clone(), pid: std::process::id() };
    let Some(net) = h.network.as_ref().filter(|_| h.remote) else {
        let s = tokio::time::timeout(limit, UnixStream::connect(&h.socket)).await.context("timed out")??;
        let (r, mut w) = s.into_split();
        nonblocking::write_msg(&mut w, &hello).await?;
        return Ok((Box::new(r), Box::new(w), None));
    };
    let mut last = anyhow::anyhow!("the controller has no address");
    for &addr in &net.controller {
        match tokio::time::timeout(limit, dial_controller(h, addr)).await {
            Ok(Ok(mut s)) => {
                let via = s.local_addr()?.ip();
                nonblocking::write_msg(&mut s, &hello).await?;
                let (r, w) = s.into_split();
                return Ok((Box::new(r), Box::new(w), Some(via)));
            }
            Ok(Err(e)) => last = e.context(format!("at {addr}")),
            Err(_) => last = anyhow::anyhow!("at {addr}: timed out after {limit:?}"),
        }
    }
    Err(last)
}

/// A TCP connection to the controller at `addr`, both sides proven to hold the job key.
pub(super) async fn dial_controller(
    h: &AgentHandoff,
    addr: std::net::SocketAddr,
) -> anyhow::Result<tokio::net::TcpStream> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let me = auth::Identity { job: h.job, key: h.key.clone(), rank: Rank(h.node.0) };
    let limit = Duration::from_millis(h.join_timeout_ms.max(1));
    auth::dial(&mut s, &me, crate::controller::socket::CONTROLLER_RANK, limit).await?;
    Ok(s)
}
