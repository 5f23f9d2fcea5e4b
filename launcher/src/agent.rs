//! The node agent (`ductile agent`): starts its node's ranks, relays messages between
//! them and the controller, forwards their output, reports exits, starts further node
//! worlds during a growth, and ends its ranks when told to (or when the controller is
//! gone).
//!
//! An agent of the initial layout is started by the controller and talks to it over its
//! fd-3 channel. An agent started by a resize is started by another agent (its spawner)
//! and gets its handoff over that channel; it connects to the controller's socket (with
//! the token from its handoff) for the rest of its life and reports `Started` to its
//! spawner, whose slot is then free for its next order. It then starts its own orders
//! and its ranks side by side, reports `Ready` once its ranks are bound, and reports its
//! whole subtree (`Grown`) to its spawner, so the new membership is gathered along the
//! spawn tree.
//!
//! A spawn step thus costs the start of an agent, not the start-up of its ranks: that
//! can take long (loading Debian's libfabric takes 0.25 s, see docs/BENCHMARKS.md), and
//! waiting for it before each step paid it once per step of the tree.

use crate::output::{forward, Sink, Stream};
use crate::proto::AGENT_VERSION;
use crate::proto::{
    Adopt, AgentHandoff, ChannelRead, ChannelWrite, Exit, FromAgent, Hello, Joining, NodeStarted, RankStarted,
    SpawnOrder, ToAgent,
};
use crate::spawn::{signal_pid, spawn_with_channel, Input, Output};
use anyhow::{bail, Context as _};
use ductile::bootstrap::{self, nonblocking, FromRank, RankHandoff, ToRank, CONTROL_FD_ENV, HANDOFF_VERSION};
use ductile_transport::{auth, Rank};
use serde::de::DeserializeOwned;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::io::AsyncRead;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;

/// Time ranks get between SIGTERM and SIGKILL when a node world is ended.
pub const KILL_GRACE: Duration = Duration::from_secs(2);
/// How long a rank whose control channel ended before it joined is given to be seen
/// exiting, so that its exit is reported rather than the channel.
const EXIT_AFTER_EOF: Duration = Duration::from_secs(1);
/// Time allowed to drain a rank's output after it exited.
const DRAIN: Duration = Duration::from_secs(2);
/// Testing knob: delays this agent's relay of every switch report by as many
/// milliseconds, as a starved agent may (the report then comes after its rank's exit),
/// so that the tests can check that the change is still recorded.
const SWITCH_RELAY_DELAY_ENV: &str = "DUCTILE_TEST_SWITCH_RELAY_DELAY_MS";

struct Proc {
    pid: u32,
    tx: OwnedWriteHalf,
    /// Set for an adopted process, which is signalled through it: not being our
    /// child, its pid could be reaped by its parent and reused.
    pidfd: Option<Arc<AsyncFd<OwnedFd>>>,
}

impl Proc {
    fn signal(&self, sig: i32) {
        match &self.pidfd {
            // SAFETY: pidfd_send_signal on a pidfd we own, with no siginfo.
            Some(fd) => unsafe {
                libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), sig, std::ptr::null::<()>(), 0);
            },
            None => signal_pid(self.pid, sig),
        }
    }
}

struct NodeWorld {
    procs: HashMap<Rank, Proc>,
    readers: Vec<(Rank, OwnedReadHalf)>,
    forwarders: Vec<JoinHandle<()>>,
    exits: mpsc::UnboundedReceiver<(Rank, Exit)>,
    /// The rank this agent adopted instead of starting (see [`adopt_rank`]).
    adopted: Option<Adopted>,
}

/// An adopted rank: not this agent's child, so its exit status is not ours to read.
/// It counts as exited 0 if it finalized first (its reader saw `Finalized`), else 1.
struct Adopted {
    id: Rank,
    finalized: Arc<AtomicBool>,
    /// Told when its control channel has been read to its end.
    closed: Arc<Notify>,
}

/// Where the result of a growth goes.
#[derive(Clone, Copy, Debug)]
enum Dest {
    /// The spawner of this (joining) agent, with this node world included.
    Spawner,
    /// The controller, for the growth with this sequence number.
    Controller(u32),
}

/// Reads messages from `r` into a channel until it fails; reading in a task of its own
/// keeps message framing intact (a read cancelled halfway would lose bytes).
fn reader<T, R>(mut r: R) -> mpsc::UnboundedReceiver<Result<T, String>>
where
    T: DeserializeOwned + Send + 'static,
    R: AsyncRead + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let m = nonblocking::read_msg::<T>(&mut r).await.map_err(|e| e.to_string());
            let failed = m.is_err();
            if tx.send(m).is_err() || failed {
                return;
            }
        }
    });
    rx
}

/// The agent's channel to the controller (or to its spawner), shared by whoever
/// reports on it: the supervisor and, on another host than the controller's, the
/// forwarders of its ranks' output.
#[derive(Clone)]
pub struct Uplink(Arc<tokio::sync::Mutex<ChannelWrite>>);

impl Uplink {
    fn new(w: ChannelWrite) -> Self {
        Self(Arc::new(tokio::sync::Mutex::new(w)))
    }

    /// Sends one message.
    async fn send(&self, m: &FromAgent) -> Result<(), bootstrap::ControlError> {
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
fn parent_channel(stdio: bool) -> anyhow::Result<(ChannelRead, ChannelWrite)> {
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

/// Runs the agent; returns when its node world has ended. `stdio`: started through a
/// remote shell (see [`parent_channel`]).
///
/// # Errors
/// A broken control channel or a handoff it cannot follow.
pub async fn run(stdio: bool) -> anyhow::Result<()> {
    outlive_user_signals()?;
    let (mut prx, mut ptx) = parent_channel(stdio)?;
    let mut h = match nonblocking::read_msg::<ToAgent>(&mut prx).await? {
        ToAgent::Handoff(h) if h.version == AGENT_VERSION => *h,
        ToAgent::Handoff(h) => bail!("agent handoff version {} (this build speaks {AGENT_VERSION})", h.version),
        other => bail!("expected a handoff, got {other:?}"),
    };
    let (up_rx, up, spawner, via) = match &h.joining {
        None => (prx, Uplink::new(ptx), None, None),
        Some(j) => match connect(&h, j).await {
            Ok((r, w, via)) => (r, Uplink::new(w), Some(Uplink::new(ptx)), via),
            Err(e) => {
                let msg = format!("{}: cannot reach the controller: {e:#}", h.node);
                nonblocking::write_msg(&mut ptx, &FromAgent::Failed(msg)).await?;
                return Ok(());
            }
        },
    };
    h.transport.bind_host = bind_host(&h, via);
    let (grown_tx, mut grown_rx) = mpsc::unbounded_channel();
    let mut growing = 0;
    if let Some(j) = &h.joining {
        if let Some(w) = spawner.as_ref() {
            w.send(&FromAgent::Started).await?;
        }
        // This node's own orders go out now, while its ranks start.
        start_growth(&h, j.spawns.clone(), Dest::Spawner, &grown_tx);
        growing += 1;
    }
    let mut up_msgs = reader(up_rx);
    let report = spawner.clone().unwrap_or_else(|| up.clone());
    let mut world = match start_ranks(&h, &up).await {
        Ok(w) => w,
        Err(e) => {
            let _ = report.send(&FromAgent::Failed(format!("{}: {e:#}", h.node))).await;
            settle(&h, growing, &mut grown_rx).await;
            return Ok(());
        }
    };
    let mut early = Vec::new();
    let started = match await_ready(&h, &mut world, &report, (&mut up_msgs, &mut early)).await {
        Ok(s) => s,
        Err(e) => {
            // Said first: ending the ranks may take a while.
            let _ = report.send(&FromAgent::Failed(format!("{}: {e:#}", h.node))).await;
            end_ranks(&mut world).await;
            settle(&h, growing, &mut grown_rx).await;
            return Ok(());
        }
    };
    if let Err(e) = report.send(&FromAgent::Ready(started.clone())).await {
        // The spawner is gone: the growth has failed.
        end_ranks(&mut world).await;
        settle(&h, growing, &mut grown_rx).await;
        return Err(e.into());
    }
    if !early.is_empty() {
        // Messages that came while the ranks joined go first.
        let (tx, rx) = mpsc::unbounded_channel();
        for m in early {
            let _ = tx.send(Ok(m));
        }
        tokio::spawn(async move {
            while let Some(m) = up_msgs.recv().await {
                if tx.send(m).is_err() {
                    return;
                }
            }
        });
        up_msgs = rx;
    }
    let own = NodeStarted { node: h.node, agent_pid: std::process::id(), ranks: started };
    let mut sup = Supervisor { h, up, spawner, own, grown_tx, growing };
    sup.supervise(&mut world, up_msgs, grown_rx).await
}

/// The address this node's ranks bind to: loopback for a job on one host; else the
/// local address of this agent's connection to the controller, or of the route to it.
fn bind_host(h: &AgentHandoff, via: Option<IpAddr>) -> Option<IpAddr> {
    let net = h.network.as_ref()?;
    via.or_else(|| net.controller.iter().find_map(|a| crate::netaddr::route_source(*a).ok()))
}

/// A batch system may signal every process of a job with SIGUSR1 or SIGUSR2 (a warning
/// before its time limit), whose default action would end the agent and so its node
/// world. The agent catches them and does nothing: its ranks get their own copy, or the
/// one `ductile run` forwards. A handler, unlike an ignored disposition, is not passed
/// on to the ranks the agent starts.
fn outlive_user_signals() -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    for kind in [SignalKind::user_defined1(), SignalKind::user_defined2()] {
        let mut s = signal(kind)?;
        tokio::spawn(async move { while s.recv().await.is_some() {} });
    }
    Ok(())
}

/// A joining node world that cannot go on waits (at most the join timeout) for the growth
/// it started to report, as [`Supervisor`] does: the agents it started check that their
/// parent made their control channel, so it must not be gone before they took over.
/// The growth then fails, which ends the job and with it those agents.
async fn settle(h: &AgentHandoff, growing: usize, grown_rx: &mut mpsc::UnboundedReceiver<Grown>) {
    if growing > 0 {
        let _ = tokio::time::timeout(Duration::from_millis(h.join_timeout_ms.max(1)), grown_rx.recv()).await;
    }
}

/// Connects a joining agent to the controller and says who it is: over its Unix
/// socket on the controller's host, else over TCP (the first of its addresses that
/// answers), authenticated with the job key. Returns the connection and, over TCP, its
/// local address.
async fn connect(h: &AgentHandoff, j: &Joining) -> anyhow::Result<(ChannelRead, ChannelWrite, Option<IpAddr>)> {
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
async fn dial_controller(h: &AgentHandoff, addr: std::net::SocketAddr) -> anyhow::Result<tokio::net::TcpStream> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let me = auth::Identity { job: h.job, key: h.key.clone(), rank: Rank(h.node.0) };
    let limit = Duration::from_millis(h.join_timeout_ms.max(1));
    auth::dial(&mut s, &me, crate::controller::socket::CONTROLLER_RANK, limit).await?;
    Ok(s)
}

async fn start_ranks(h: &AgentHandoff, up: &Uplink) -> anyhow::Result<NodeWorld> {
    let (exit_tx, exits) = mpsc::unbounded_channel();
    let mut out =
        NodeWorld { procs: HashMap::new(), readers: Vec::new(), forwarders: Vec::new(), exits, adopted: None };
    for &id in &h.ids {
        let started = match &h.adopt {
            Some(a) => adopt_rank(h, id, a, &mut out, &exit_tx).await,
            None => start_rank(h, id, &mut out, (&exit_tx, up)).await,
        };
        if let Err(e) = started {
            end_ranks(&mut out).await;
            return Err(e);
        }
    }
    Ok(out)
}

/// Starts rank `id` of the node world `out` and hands it its settings.
async fn start_rank(
    h: &AgentHandoff,
    id: Rank,
    out: &mut NodeWorld,
    (exit_tx, up): (&mpsc::UnboundedSender<(Rank, Exit)>, &Uplink),
) -> anyhow::Result<()> {
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
    // The job's rank 0 at start reads what `ductile run` was given on stdin (see
    // `controller::stdin_for`); every other rank reads nothing.
    let input = if id == Rank(0) && h.joining.is_none() { Input::Inherit } else { Input::Null };
    let network = h.network.as_ref().filter(|_| h.remote);
    let spawned =
        spawn_with_channel(h.program.as_ref(), &h.args, &theirs, false, (input, Output::Piped), true, network);
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => bail!("cannot start {} for {id}: {e}", h.program),
    };
    drop(theirs);
    let pid = child.id().unwrap_or(0);
    let prefix = h.tag_output.then(|| format!("[{}] ", id.0));
    let sink = |s| if h.remote { Sink::Up(s, up.clone()) } else { Sink::Local(s) };
    if let Some(o) = child.stdout.take() {
        out.forwarders.push(tokio::spawn(forward(o, prefix.clone(), sink(Stream::Stdout))));
    }
    if let Some(e) = child.stderr.take() {
        out.forwarders.push(tokio::spawn(forward(e, prefix, sink(Stream::Stderr))));
    }
    let tx = exit_tx.clone();
    tokio::spawn(async move {
        let exit = match child.wait().await {
            Ok(s) => Exit::from_status(s),
            Err(_) => Exit::Code(1),
        };
        // Reaped: what its transport left behind is removed (see `shm_regions`).
        ductile_transport::shm_regions::remove_ended(&[pid]);
        let _ = tx.send((id, exit));
    });
    let channel = ours.set_nonblocking(true).and_then(|()| UnixStream::from_std(ours));
    let (r, mut w) = match channel {
        Ok(s) => s.into_split(),
        Err(e) => {
            // Started, and never to be told what to do: it must not wait for that.
            signal_pid(pid, libc::SIGKILL);
            bail!("the control channel of {id}: {e}");
        }
    };
    let handoff = rank_handoff(h, id);
    // A rank that is not a ductile program never reads this; the write still succeeds
    // into the socket buffer. A rank that has already exited makes it fail. Either way
    // the wait for readiness reports what happened to the rank.
    if let Err(e) = nonblocking::write_msg(&mut w, &ToRank::Handoff(handoff)).await {
        tracing::debug!("{}: handing {id} its settings failed: {e}", h.node);
    }
    out.procs.insert(id, Proc { pid, tx: w, pidfd: None });
    out.readers.push((id, r));
    Ok(())
}

fn rank_handoff(h: &AgentHandoff, id: Rank) -> RankHandoff {
    RankHandoff {
        version: HANDOFF_VERSION,
        job: h.job,
        key: h.key.clone(),
        id,
        node: h.node,
        transport: h.transport.clone(),
        timeout_ms: h.timeout_ms,
        joining: h.joining.is_some(),
        redistribution: h.redistribution,
        background: h.background,
        tag_output: h.tag_output,
    }
}

/// Adopts the running process `a` as rank `id` (a program started alone that grows):
/// connects to its socket, checks that the process there is the one named, hands it
/// its settings, and watches for its end through a pidfd. Its output stays its own.
async fn adopt_rank(
    h: &AgentHandoff,
    id: Rank,
    a: &Adopt,
    out: &mut NodeWorld,
    exit_tx: &mpsc::UnboundedSender<(Rank, Exit)>,
) -> anyhow::Result<()> {
    let limit = Duration::from_millis(h.join_timeout_ms.max(1));
    let s = tokio::time::timeout(limit, UnixStream::connect(&a.socket))
        .await
        .with_context(|| format!("{id}: timed out reaching the process to adopt"))?
        .with_context(|| format!("{id}: cannot reach the process to adopt at {}", a.socket))?;
    let peer = s.peer_cred()?.pid().and_then(|p| u32::try_from(p).ok());
    if peer != Some(a.pid) {
        bail!("{id}: the process at {} is {peer:?}, not the one to adopt ({})", a.socket, a.pid);
    }
    let pidfd = Arc::new(pidfd(a.pid).with_context(|| format!("{id}: cannot watch process {}", a.pid))?);
    let adopted = Adopted { id, finalized: Arc::new(AtomicBool::new(false)), closed: Arc::new(Notify::new()) };
    let (finalized, closed, tx) = (adopted.finalized.clone(), adopted.closed.clone(), exit_tx.clone());
    let watched = pidfd.clone();
    tokio::spawn(async move {
        // Its part ends when it closes its channel (at `finalize`, or as it exits): it
        // may live on, and its launcher waits for the job to end.
        tokio::select! {
            () = closed.notified() => {}
            _ = watched.readable() => {
                // Its last messages (`Finalized`) are read before its end is judged.
                let _ = tokio::time::timeout(DRAIN, closed.notified()).await;
            }
        }
        let exit = if finalized.load(Ordering::Acquire) { Exit::Code(0) } else { Exit::Left };
        let _ = tx.send((id, exit));
    });
    out.adopted = Some(adopted);
    let (r, mut w) = s.into_split();
    nonblocking::write_msg(&mut w, &ToRank::Handoff(rank_handoff(h, id))).await?;
    out.procs.insert(id, Proc { pid: a.pid, tx: w, pidfd: Some(pidfd) });
    out.readers.push((id, r));
    Ok(())
}

/// A pidfd of `pid`, readable once the process has ended.
fn pidfd(pid: u32) -> std::io::Result<AsyncFd<OwnedFd>> {
    use std::os::fd::FromRawFd;
    let pid = libc::pid_t::try_from(pid).map_err(std::io::Error::other)?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, libc::O_NONBLOCK) };
    let fd = i32::try_from(fd).map_err(std::io::Error::other)?;
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: the OwnedFd owns its descriptor, which stays open and unchanged until the
    // AsyncFd (which owns it) is dropped.
    unsafe { AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE) }
        .map_err(|e| std::io::Error::other(e.to_string()))
}

/// Waits for every rank's address (reporting exits on the way), and gives up at once
/// if the job ends meanwhile (an abort or a lost connection on `up`; other messages
/// from there are kept in `early`).
async fn await_ready(
    h: &AgentHandoff,
    world: &mut NodeWorld,
    report: &Uplink,
    (up, early): (&mut mpsc::UnboundedReceiver<Result<ToAgent, String>>, &mut Vec<ToAgent>),
) -> anyhow::Result<Vec<RankStarted>> {
    // The controller sets this a little shorter than its own limit, so that the
    // precise reason (which rank did not join) is what the user sees.
    let t = Duration::from_millis(h.join_timeout_ms.max(1));
    let deadline = tokio::time::Instant::now() + t;
    let mut started = Vec::with_capacity(world.readers.len());
    for (id, r) in &mut world.readers {
        let id = *id;
        // One read for the whole wait: a read dropped half-way would lose a frame.
        let read = tokio::time::timeout_at(deadline, nonblocking::read_msg::<FromRank>(r));
        tokio::pin!(read);
        let ready = loop {
            tokio::select! {
                r = &mut read => break r,
                Some((r, exit)) = world.exits.recv() => {
                    // Reaped: its pid is no longer ours to signal.
                    world.procs.remove(&r);
                    report.send(&FromAgent::RankExited { rank: r, exit }).await?;
                    bail!("{r} {exit} before joining the job");
                }
                m = up.recv() => match m {
                    Some(Ok(ToAgent::Abort)) | Some(Err(_)) | None => bail!("the job ended while its ranks joined"),
                    Some(Ok(other)) => early.push(other),
                },
            }
        };
        match ready {
            Ok(Ok(FromRank::Ready { addr })) => {
                started.push(RankStarted { id, pid: world.procs.get(&id).map_or(0, |p| p.pid), addr });
            }
            Ok(Ok(FromRank::Failed { reason })) => bail!("{id} cannot join the job: {reason}"),
            Ok(Ok(other)) => bail!("{id} sent {other:?} before joining"),
            Ok(Err(e)) => {
                // The control channel ends when the process does: its exit, if it comes
                // soon, says more (its code is the job's) than the broken channel.
                if let Ok(Some((r, exit))) = tokio::time::timeout(EXIT_AFTER_EOF, world.exits.recv()).await {
                    world.procs.remove(&r);
                    report.send(&FromAgent::RankExited { rank: r, exit }).await?;
                    bail!("{r} {exit} before joining the job");
                }
                bail!("{id} did not join the job (is it a ductile program?): {e}")
            }
            Err(_) => bail!("{id} did not join the job within {t:?}"),
        }
    }
    Ok(started)
}

struct Supervisor {
    h: AgentHandoff,
    up: Uplink,
    spawner: Option<Uplink>,
    own: NodeStarted,
    grown_tx: mpsc::UnboundedSender<Grown>,
    /// Growths started here and not yet reported. The agent outlives its ranks until
    /// they are: the agents it started check that their parent made their control
    /// channel, and someone must report whether they came up.
    growing: usize,
}

type Grown = (Dest, Result<Vec<NodeStarted>, String>);

fn start_growth(h: &AgentHandoff, orders: Vec<SpawnOrder>, dest: Dest, tx: &mpsc::UnboundedSender<Grown>) {
    let (h, tx) = (h.clone(), tx.clone());
    tokio::spawn(async move {
        let r = grow(&h, orders).await;
        let _ = tx.send((dest, r));
    });
}

impl Supervisor {
    /// Relays messages and reports exits until every rank has ended and every growth
    /// started here has been reported.
    async fn supervise(
        &mut self,
        world: &mut NodeWorld,
        mut up: mpsc::UnboundedReceiver<Result<ToAgent, String>>,
        mut grown: mpsc::UnboundedReceiver<Grown>,
    ) -> anyhow::Result<()> {
        let (msg_tx, mut msgs) = mpsc::unbounded_channel();
        let delay = std::env::var(SWITCH_RELAY_DELAY_ENV).ok().and_then(|v| v.parse().ok()).map(Duration::from_millis);
        for (id, r) in world.readers.drain(..) {
            let tx = msg_tx.clone();
            let mut rx = reader::<FromRank, _>(r);
            let adopted =
                world.adopted.as_ref().filter(|a| a.id == id).map(|a| (a.finalized.clone(), a.closed.clone()));
            tokio::spawn(async move {
                while let Some(Ok(m)) = rx.recv().await {
                    if let (Some((finalized, _)), FromRank::Finalized) = (&adopted, &m) {
                        finalized.store(true, Ordering::Release);
                    }
                    if let (Some(d), FromRank::Switched { .. }) = (delay, &m) {
                        tokio::time::sleep(d).await;
                    }
                    if tx.send((id, m)).is_err() {
                        break;
                    }
                }
                if let Some((_, closed)) = adopted {
                    closed.notify_one();
                }
            });
        }
        drop(msg_tx);
        let mut controller_open = true;
        while !world.procs.is_empty() || self.growing > 0 {
            tokio::select! {
                Some((rank, exit)) = world.exits.recv() => {
                    world.procs.remove(&rank);
                    let _ = self.up.send(&FromAgent::RankExited { rank, exit }).await;
                }
                Some((id, m)) = msgs.recv() => self.relay(id, m).await,
                Some((dest, r)) = grown.recv() => {
                    self.growing = self.growing.saturating_sub(1);
                    self.grown(dest, r).await;
                }
                m = up.recv(), if controller_open => match m {
                    Some(Ok(msg)) => self.on_controller(world, msg).await,
                    Some(Err(_)) | None => {
                        controller_open = false;
                        end_ranks(world).await;
                    }
                },
            }
            if !controller_open && world.procs.is_empty() && self.growing == 0 {
                break;
            }
        }
        // A rank's last messages (a switch report sent just before it finalized) can
        // still be in its reader when its exit is seen: pass them on before leaving.
        let _ = tokio::time::timeout(DRAIN, async {
            while let Some((id, m)) = msgs.recv().await {
                self.relay(id, m).await;
            }
        })
        .await;
        // All within one DRAIN: a rank's child that keeps its output open holds its
        // forwarder to the end of it, and each one would add that again.
        let deadline = tokio::time::Instant::now() + DRAIN;
        for f in world.forwarders.drain(..) {
            let _ = tokio::time::timeout_at(deadline, f).await;
        }
        let _ = self.up.send(&FromAgent::Done).await;
        Ok(())
    }

    async fn relay(&mut self, id: Rank, m: FromRank) {
        match m {
            FromRank::Finalized => {}
            FromRank::Ready { .. } => tracing::warn!("{id} reported ready twice"),
            other => {
                let _ = self.up.send(&FromAgent::Rank(id, other)).await;
            }
        }
    }

    async fn on_controller(&mut self, world: &mut NodeWorld, msg: ToAgent) {
        match msg {
            ToAgent::Membership(m) => {
                for p in world.procs.values_mut() {
                    let _ = nonblocking::write_msg(&mut p.tx, &ToRank::Membership(m.clone())).await;
                }
            }
            ToAgent::ToRank(id, m) => match world.procs.get_mut(&id) {
                Some(p) => {
                    let _ = nonblocking::write_msg(&mut p.tx, &m).await;
                }
                None => tracing::warn!("{}: no {id} here for {m:?}", self.h.node),
            },
            ToAgent::Grow { seq, orders } => {
                start_growth(&self.h, orders, Dest::Controller(seq), &self.grown_tx);
                self.growing += 1;
            }
            ToAgent::End(ids) => {
                for id in ids {
                    if let Some(p) = world.procs.get(&id) {
                        p.signal(libc::SIGKILL);
                    }
                }
            }
            ToAgent::Abort => end_ranks(world).await,
            ToAgent::Signal(sig) if crate::controller::FORWARDED.contains(&sig) => {
                for p in world.procs.values() {
                    p.signal(sig);
                }
            }
            ToAgent::Signal(sig) => tracing::warn!("{}: signal {sig} is not forwarded to ranks", self.h.node),
            ToAgent::Handoff(_) => tracing::warn!("{}: second handoff ignored", self.h.node),
        }
    }

    async fn grown(&mut self, dest: Dest, r: Result<Vec<NodeStarted>, String>) {
        tracing::debug!(
            "{}: growth done ({:?}): {}",
            self.h.node,
            dest,
            r.as_ref().map_or_else(Clone::clone, |n| format!("{} node worlds", n.len()))
        );
        let msg = match (dest, r) {
            (Dest::Spawner, Ok(mut nodes)) => {
                nodes.insert(0, self.own.clone());
                FromAgent::Grown(nodes)
            }
            (Dest::Spawner, Err(e)) => FromAgent::Failed(e),
            (Dest::Controller(seq), result) => FromAgent::GrowthReport { seq, result },
        };
        let to = match dest {
            Dest::Spawner => self.spawner.take(),
            Dest::Controller(_) => None,
        };
        let _ = to.as_ref().unwrap_or(&self.up).send(&msg).await;
    }
}

/// Starts the node worlds of `orders` (one sequence per spawner, side by side) and
/// returns every node world of their subtrees once all are up.
async fn grow(h: &AgentHandoff, orders: Vec<SpawnOrder>) -> Result<Vec<NodeStarted>, String> {
    let mut seqs: BTreeMap<u32, Vec<SpawnOrder>> = BTreeMap::new();
    for o in orders {
        seqs.entry(o.spawner).or_default().push(o);
    }
    let runs = seqs.into_values().map(|mut seq| {
        seq.sort_by_key(|o| o.step);
        run_sequence(h, seq)
    });
    let all = futures_util::future::try_join_all(runs).await?;
    Ok(all.into_iter().flatten().collect())
}

/// One spawner's orders: each new world is started once the previous one's agent has
/// taken over; their readiness and subtree reports are awaited together at the end.
async fn run_sequence(h: &AgentHandoff, seq: Vec<SpawnOrder>) -> Result<Vec<NodeStarted>, String> {
    let mut subtrees = Vec::with_capacity(seq.len());
    for o in seq {
        subtrees.push(start_child(h, o).await?);
    }
    let join = Duration::from_millis(h.join_timeout_ms.max(1));
    let wait = Duration::from_millis(h.timeout_ms.max(1));
    let reports = subtrees.into_iter().map(|(node, mut rx)| async move {
        let fail = |e: String| format!("{node}: {e}");
        let deadline = tokio::time::Instant::now() + join;
        loop {
            match tokio::time::timeout_at(deadline, nonblocking::read_msg::<FromAgent>(&mut rx)).await {
                Ok(Ok(FromAgent::Ready(_))) => {
                    tracing::debug!("{}: {node} is up", h.node);
                    break;
                }
                Ok(Ok(FromAgent::Failed(e))) => return Err(e),
                // A rank that exits before joining is reported first; the reason follows.
                Ok(Ok(FromAgent::RankExited { .. })) => {}
                Ok(Ok(other)) => return Err(fail(format!("unexpected {other:?} from its agent"))),
                Ok(Err(e)) => return Err(fail(format!("its agent is gone ({e})"))),
                Err(_) => return Err(fail(format!("its ranks were not bound within {join:?}"))),
            }
        }
        tracing::debug!("waiting for the subtree of {node}");
        match tokio::time::timeout(wait, nonblocking::read_msg::<FromAgent>(&mut rx)).await {
            Ok(Ok(FromAgent::Grown(nodes))) => Ok(nodes),
            Ok(Ok(FromAgent::Failed(e))) => Err(e),
            Ok(Ok(other)) => Err(format!("{node}: unexpected {other:?} while growing")),
            Ok(Err(e)) => Err(format!("{node}: its agent is gone while growing ({e})")),
            Err(_) => Err(format!("{node}: its subtree did not come up within {wait:?}")),
        }
    });
    let all = futures_util::future::try_join_all(reports).await?;
    Ok(all.into_iter().flatten().collect())
}

/// Starts one node world's agent (here, or through the remote shell on the order's
/// host) and waits until it has taken over (its ranks start next).
async fn start_child(h: &AgentHandoff, o: SpawnOrder) -> Result<(ductile_transport::NodeId, ChannelRead), String> {
    let node = o.node;
    let remote = match (&h.network, &o.host) {
        (Some(net), Some(host)) if !crate::hosts::is_local(host) => Some((net, host)),
        _ => None,
    };
    let place = match remote {
        Some((net, host)) => format!("{node} (on {host}, started by `{}`)", net.rsh.join(" ")),
        None => node.to_string(),
    };
    let fail = |e: String| format!("{place}: {e}");
    let (mut rx, mut tx): (ChannelRead, ChannelWrite) = match remote {
        // No parent-death signal: this agent may be released before the one it
        // starts. The new agent's lifeline is its connection to the controller.
        Some((net, host)) => {
            let (mut child, r, w) = crate::spawn::spawn_remote(&net.rsh, host, &net.exe, false)
                .map_err(|e| fail(format!("cannot start the remote shell for {host}: {e}")))?;
            tokio::spawn(async move {
                let _ = child.wait().await;
            });
            (r, w)
        }
        None => {
            let exe = std::env::current_exe().map_err(|e| fail(e.to_string()))?;
            let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(|e| fail(e.to_string()))?;
            let io = (Input::Null, Output::Inherit);
            let mut child = spawn_with_channel(exe.as_os_str(), &["agent"], &theirs, true, io, false, None)
                .map_err(|e| fail(format!("cannot start its agent: {e}")))?;
            drop(theirs);
            tokio::spawn(async move {
                let _ = child.wait().await;
            });
            ours.set_nonblocking(true).map_err(|e| fail(e.to_string()))?;
            let (r, w) = UnixStream::from_std(ours).map_err(|e| fail(e.to_string()))?.into_split();
            (Box::new(r), Box::new(w))
        }
    };
    let handoff = AgentHandoff {
        node,
        ids: o.ids,
        joining: Some(Joining { token: o.token, spawns: o.spawns }),
        adopt: None,
        remote: remote.is_some(),
        ..h.clone()
    };
    nonblocking::write_msg(&mut tx, &ToAgent::Handoff(Box::new(handoff))).await.map_err(|e| fail(e.to_string()))?;
    let t = Duration::from_millis(h.join_timeout_ms.max(1));
    match tokio::time::timeout(t, nonblocking::read_msg::<FromAgent>(&mut rx)).await {
        Ok(Ok(FromAgent::Started)) => {
            tracing::debug!("{}: {node} has started", h.node);
            Ok((node, rx))
        }
        Ok(Ok(FromAgent::Failed(e))) => Err(e),
        Ok(Ok(other)) => Err(fail(format!("unexpected {other:?} from its agent"))),
        Ok(Err(e)) => Err(fail(format!("its agent is gone ({e})"))),
        Err(_) => Err(fail(format!("its agent did not take over within {t:?}"))),
    }
}

/// Ends every rank still running: SIGTERM, then SIGKILL after [`KILL_GRACE`].
async fn end_ranks(world: &mut NodeWorld) {
    for p in world.procs.values() {
        p.signal(libc::SIGTERM);
    }
    let deadline = tokio::time::Instant::now() + KILL_GRACE;
    while !world.procs.is_empty() {
        match tokio::time::timeout_at(deadline, world.exits.recv()).await {
            Ok(Some((rank, _))) => {
                world.procs.remove(&rank);
            }
            Ok(None) => return,
            Err(_) => {
                for p in world.procs.values() {
                    p.signal(libc::SIGKILL);
                }
                while !world.procs.is_empty() {
                    match tokio::time::timeout(KILL_GRACE, world.exits.recv()).await {
                        Ok(Some((rank, _))) => {
                            world.procs.remove(&rank);
                        }
                        _ => return,
                    }
                }
            }
        }
    }
}
