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

mod channel;
mod grow;

use crate::bind::BindTo;
use crate::output::{forward, Sink, Stream};
use crate::proto::HEARTBEAT_LOSS;
use crate::proto::{
    Adopt, AgentHandoff, ChannelRead, ChannelWrite, Exit, FromAgent, Hello, Joining, NodeStarted, RankStarted,
    SpawnOrder, ToAgent,
};
use crate::proto::{AGENT_VERSION, STDIO_MAGIC};
use crate::spawn::{signal_pid, spawn_with_channel, Input, Output, Setup};
use anyhow::{bail, Context as _};
pub use channel::Uplink;
use channel::{bind_host, connect, parent_channel, Heard};
use ductile::bootstrap::{self, nonblocking, FromRank, RankHandoff, ToRank, CONTROL_FD_ENV, HANDOFF_VERSION};
use ductile_transport::{auth, Rank};
use grow::grow;
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

/// How long an agent that lost the controller tries to tell it why.
const LAST_WORD: Duration = Duration::from_secs(1);
/// How long an agent waits for its handoff (its starter writes it at once).
const HANDOFF_WAIT: Duration = Duration::from_secs(60);
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

/// Testing knob: this agent reports a rank's exit to the controller only after as many
/// milliseconds, as a starved agent may, so that the tests can check what the other
/// ranks do when their transports see the failure long before the launcher's notice.
const EXIT_REPORT_DELAY_ENV: &str = "DUCTILE_TEST_EXIT_REPORT_DELAY_MS";

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

/// Runs the agent; returns when its node world has ended. `stdio`: started through a
/// remote shell (see [`parent_channel`]).
///
/// # Errors
/// A broken control channel or a handoff it cannot follow.
pub async fn run(stdio: bool) -> anyhow::Result<()> {
    // Started from the running image (`spawn::own_exe`), the kernel names the process
    // `exe`: named as the launcher again, for `ps -C ductile`, `pgrep` and `top`. This
    // runs on the main thread (`block_on`), whose name is the process's.
    // SAFETY: PR_SET_NAME reads a NUL-terminated string (of at most 16 bytes) that
    // outlives the call.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"ductile".as_ptr()) };
    outlive_user_signals()?;
    let (mut prx, mut ptx) = parent_channel(stdio)?;
    if stdio {
        // Its pid on this host follows, for `ductile status` and the report.
        let mut first = STDIO_MAGIC.to_vec();
        first.extend_from_slice(&std::process::id().to_le_bytes());
        tokio::io::AsyncWriteExt::write_all(&mut ptx, &first).await?;
        tokio::io::AsyncWriteExt::flush(&mut ptx).await?;
    }
    let first = tokio::time::timeout(HANDOFF_WAIT, nonblocking::read_msg::<ToAgent>(&mut prx))
        .await
        .with_context(|| format!("no handoff came within {HANDOFF_WAIT:?}"))?;
    let mut h = match first? {
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
    if h.remote {
        // What the ranks leave behind comes here to be ended (see `Supervisor`).
        crate::spawn::become_subreaper();
    }
    h.transport.bind_host = match bind_host(&h, via).await {
        Ok(b) => b,
        Err(e) => {
            let msg = format!("{}: {e:#}", h.node);
            let _ = spawner.as_ref().unwrap_or(&up).send(&FromAgent::Failed(msg)).await;
            return Ok(());
        }
    };
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
    let heard = Heard::new();
    let mut up_msgs = channel::controller_reader(up_rx, heard.clone());
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
    let mut sup = Supervisor { h, up, heard, spawner, own, grown_tx, growing };
    sup.supervise(&mut world, up_msgs, grown_rx).await
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

async fn start_ranks(h: &AgentHandoff, up: &Uplink) -> anyhow::Result<NodeWorld> {
    let cpus = bindings(h)?;
    let (exit_tx, exits) = mpsc::unbounded_channel();
    let mut out =
        NodeWorld { procs: HashMap::new(), readers: Vec::new(), forwarders: Vec::new(), exits, adopted: None };
    for (&id, cpus) in h.ids.iter().zip(&cpus) {
        let started = match &h.adopt {
            Some(a) => adopt_rank(h, id, a, &mut out, &exit_tx).await,
            None => start_rank(h, (id, cpus.as_deref()), &mut out, (&exit_tx, up)).await,
        };
        if let Err(e) = started {
            end_ranks(&mut out).await;
            return Err(e);
        }
    }
    Ok(out)
}

/// The CPUs each of `h`'s ranks is bound to (`--bind-to`), in the order of `h.ids`
/// (`None` each when they are not bound), from this agent's own CPUs (see
/// [`crate::bind`]). Says once when ranks of the job on this host share units.
fn bindings(h: &AgentHandoff) -> anyhow::Result<Vec<Option<Vec<u32>>>> {
    if h.bind_to == BindTo::None || h.adopt.is_some() {
        return Ok(vec![None; h.ids.len()]);
    }
    if h.slots.len() != h.ids.len() {
        bail!("{}: {} binding slots for {} ranks", h.node, h.slots.len(), h.ids.len());
    }
    let units = crate::bind::host_units(h.bind_to).context("cannot read the CPUs ranks may be bound to")?;
    let top = h.slots.iter().max().map_or(0, |&s| s as usize);
    if top >= units.len() {
        crate::say_errln!(
            "ductile: warning: {}: more ranks on this host than {}s to bind them to ({}): some share one",
            h.node,
            h.bind_to.unit(),
            units.len()
        );
    }
    let unit = |&s: &u32| crate::bind::unit_of(&units, s).map(<[u32]>::to_vec);
    let cpus: Vec<_> = h.slots.iter().map(unit).collect();
    if cpus.iter().any(Option::is_none) {
        bail!("{}: no CPU to bind ranks to", h.node);
    }
    Ok(cpus)
}

/// Starts rank `id` of the node world `out`, bound to `cpus` if set, and hands it its
/// settings.
async fn start_rank(
    h: &AgentHandoff,
    (id, cpus): (Rank, Option<&[u32]>),
    out: &mut NodeWorld,
    (exit_tx, up): (&mpsc::UnboundedSender<(Rank, Exit)>, &Uplink),
) -> anyhow::Result<()> {
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
    // The job's rank 0 at start reads what `ductile run` was given on stdin (see
    // `controller::stdin_for`); every other rank reads nothing.
    let input = if id == Rank(0) && h.joining.is_none() { Input::Inherit } else { Input::Null };
    let network = h.network.as_ref().filter(|_| h.remote);
    let set = cpus.map(crate::bind::cpu_set).transpose().with_context(|| format!("{id}: CPUs {cpus:?}"))?;
    let setup = Setup { new_group: false, parent_death: true, cpus: set };
    let spawned = spawn_with_channel(h.program.as_ref(), &h.args, &theirs, setup, (input, Output::Piped), network);
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => bail!("cannot start {} for {id}: {e}", h.program),
    };
    drop(theirs);
    let pid = child.id().unwrap_or(0);
    if h.report_bindings {
        let bound = match cpus {
            Some(c) => format!("bound to CPUs {} (one {})", crate::bind::format_cpu_list(c), h.bind_to.unit()),
            None => "not bound".to_owned(),
        };
        crate::say_errln!("ductile: {id} ({}, pid {pid}): {bound}", h.node);
    }
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
        recover: h.recover,
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
            // `t` is the agent's part of --join-timeout (the controller keeps a margin).
            Err(_) => bail!("{id} did not join the job within {t:?} (the agent's part of --join-timeout)"),
        }
    }
    Ok(started)
}

/// Reads every rank's messages into one channel (with the testing delay of
/// [`SWITCH_RELAY_DELAY_ENV`] on switch reports); an adopted rank's reader also notes
/// that it finalized, and when its channel closes.
fn watch_ranks(world: &mut NodeWorld) -> mpsc::UnboundedReceiver<(Rank, FromRank)> {
    let (msg_tx, msgs) = mpsc::unbounded_channel();
    let delay = std::env::var(SWITCH_RELAY_DELAY_ENV).ok().and_then(|v| v.parse().ok()).map(Duration::from_millis);
    for (id, r) in world.readers.drain(..) {
        let tx = msg_tx.clone();
        let mut rx = reader::<FromRank, _>(r);
        let adopted = world.adopted.as_ref().filter(|a| a.id == id).map(|a| (a.finalized.clone(), a.closed.clone()));
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
    msgs
}

struct Supervisor {
    h: AgentHandoff,
    up: Uplink,
    /// When the controller last said something.
    heard: Heard,
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
        let mut msgs = watch_ranks(world);
        let mut controller_open = true;
        // On another host than the controller's, silence means the controller (or the
        // network to it) is gone: the node world ends rather than run on, orphaned.
        let loss = self.h.network.as_ref().map_or(HEARTBEAT_LOSS, |n| Duration::from_millis(n.heartbeat_loss_ms));
        while !world.procs.is_empty() || self.growing > 0 {
            let silent = self.heard.last() + loss;
            tokio::select! {
                // What came meanwhile goes first: a busy loop is not a silent controller.
                biased;
                m = up.recv(), if controller_open => match m {
                    Some(Ok(msg)) => self.on_controller(world, msg).await,
                    Some(Err(why)) => {
                        controller_open = false;
                        let why = format!("its channel from the controller broke ({why}), so its agent ended it");
                        self.up.last_word(&FromAgent::Failed(why), LAST_WORD).await;
                        end_ranks(world).await;
                    }
                    None => {
                        controller_open = false;
                        end_ranks(world).await;
                    }
                },
                Some((rank, exit)) = world.exits.recv() => {
                    world.procs.remove(&rank);
                    if let Some(d) = std::env::var(EXIT_REPORT_DELAY_ENV).ok().and_then(|v| v.parse().ok()) {
                        tokio::time::sleep(Duration::from_millis(d)).await;
                    }
                    let _ = self.up.send(&FromAgent::RankExited { rank, exit }).await;
                }
                Some((id, m)) = msgs.recv() => self.relay(id, m).await,
                Some((dest, r)) = grown.recv() => {
                    self.growing = self.growing.saturating_sub(1);
                    self.grown(dest, r).await;
                }
                () = tokio::time::sleep_until(silent), if self.h.remote && controller_open => {
                    if self.heard.last() + loss <= tokio::time::Instant::now() {
                        controller_open = false;
                        self.lost_controller(world, loss).await;
                    }
                }
            }
            if !controller_open && world.procs.is_empty() && self.growing == 0 {
                break;
            }
        }
        self.wind_up(world, msgs).await;
        Ok(())
    }

    /// The controller fell silent: the ranks end first (nothing may wait on a channel
    /// to a controller that vanished), then the agent says why, briefly, if it can.
    async fn lost_controller(&mut self, world: &mut NodeWorld, loss: Duration) {
        let why = format!("no word from the controller for {loss:?}, so its agent ended it");
        tracing::warn!("{}: {why}", self.h.node);
        let up = self.up.clone();
        let said = tokio::spawn(async move { up.last_word(&FromAgent::Failed(why), LAST_WORD).await });
        end_ranks(world).await;
        let _ = said.await;
    }

    /// After the last rank: relays what they still said, waits for their output, ends
    /// what they left running (on another host), and says `Done`.
    async fn wind_up(&mut self, world: &mut NodeWorld, mut msgs: mpsc::UnboundedReceiver<(Rank, FromRank)>) {
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
        if self.h.remote {
            // No controller on this host sweeps what the ranks left (a child that
            // outlived its rank was reparented here): this agent does, before it says
            // it is done. Node worlds (agents) are spared: its own growths', and those
            // reparented here when the agent that started them ended.
            let ended = crate::spawn::end_adopted_except(&grow::spared).await;
            if ended > 0 {
                tracing::warn!("{}: ended {ended} processes the ranks left running", self.h.node);
            }
        }
        let _ = self.up.send(&FromAgent::Done).await;
    }

    async fn relay(&mut self, id: Rank, m: FromRank) {
        match m {
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
            ToAgent::Heartbeat => {}
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
