//! The node agent (`ductile agent`, started by the controller): starts its node's ranks,
//! relays the bootstrap fence, forwards output, reports exits, and ends its ranks when
//! told to (or when the controller is gone).

use crate::output::{forward, Stream};
use crate::proto::{AgentHandoff, Exit, FromAgent, RankStarted, ToAgent, AGENT_VERSION};
use crate::spawn::{signal_pid, spawn_with_channel, Output};
use anyhow::{bail, Context as _};
use ductile::bootstrap::{self, nonblocking, FromRank, RankHandoff, ToRank, CONTROL_FD_ENV, HANDOFF_VERSION};
use ductile_transport::Rank;
use std::collections::HashMap;
use std::time::Duration;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Time ranks get between SIGTERM and SIGKILL when a node world is ended.
pub const KILL_GRACE: Duration = Duration::from_secs(2);
/// Time allowed to drain a rank's output after it exited.
const DRAIN: Duration = Duration::from_secs(2);

struct Ranks {
    pids: HashMap<Rank, u32>,
    channels: Vec<UnixStream>,
    forwarders: Vec<JoinHandle<()>>,
    exits: mpsc::UnboundedReceiver<(Rank, Exit)>,
}

/// Runs the agent; returns when its node world has ended.
///
/// # Errors
/// A broken control channel or a handoff it cannot follow.
pub async fn run() -> anyhow::Result<()> {
    let fd: i32 =
        std::env::var(CONTROL_FD_ENV).context("the agent is started by `ductile run`, not by hand")?.parse()?;
    let std_stream = bootstrap::take_control(fd).map_err(anyhow::Error::msg)?;
    std_stream.set_nonblocking(true)?;
    let (mut rx, mut tx) = UnixStream::from_std(std_stream)?.into_split();
    let h = match nonblocking::read_msg::<ToAgent>(&mut rx).await? {
        ToAgent::Handoff(h) if h.version == AGENT_VERSION => h,
        ToAgent::Handoff(h) => bail!("agent handoff version {} (this build speaks {AGENT_VERSION})", h.version),
        other => bail!("expected a handoff, got {other:?}"),
    };
    let mut ranks = match start_ranks(&h).await {
        Ok(r) => r,
        Err(e) => {
            let msg = format!("{}: {e:#}", h.node);
            nonblocking::write_msg(&mut tx, &FromAgent::Failed(msg)).await?;
            return Ok(());
        }
    };
    if let Err(e) = fence(&h, &mut ranks, &mut rx, &mut tx).await {
        end_ranks(&mut ranks).await;
        let _ = nonblocking::write_msg(&mut tx, &FromAgent::Failed(format!("{}: {e:#}", h.node))).await;
        return Ok(());
    }
    supervise(&mut ranks, rx, tx).await
}

async fn start_ranks(h: &AgentHandoff) -> anyhow::Result<Ranks> {
    let (exit_tx, exits) = mpsc::unbounded_channel();
    let mut out = Ranks { pids: HashMap::new(), channels: Vec::new(), forwarders: Vec::new(), exits };
    for &rank in &h.ranks {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        let spawned = spawn_with_channel(h.program.as_ref(), &h.args, &theirs, false, Output::Piped);
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                end_ranks(&mut out).await;
                bail!("cannot start {} for {rank}: {e}", h.program);
            }
        };
        drop(theirs);
        let pid = child.id().unwrap_or(0);
        out.pids.insert(rank, pid);
        let prefix = h.tag_output.then(|| format!("[{}] ", rank.0));
        if let Some(o) = child.stdout.take() {
            out.forwarders.push(tokio::spawn(forward(o, prefix.clone(), Stream::Stdout)));
        }
        if let Some(e) = child.stderr.take() {
            out.forwarders.push(tokio::spawn(forward(e, prefix, Stream::Stderr)));
        }
        let tx = exit_tx.clone();
        tokio::spawn(async move {
            let exit = match child.wait().await {
                Ok(s) => Exit::from_status(s),
                Err(_) => Exit::Code(1),
            };
            let _ = tx.send((rank, exit));
        });
        ours.set_nonblocking(true)?;
        let mut ch = UnixStream::from_std(ours)?;
        let handoff = RankHandoff {
            version: HANDOFF_VERSION,
            job: h.job,
            key: h.key.clone(),
            rank,
            size: h.size,
            node: h.node,
            nodes: h.nodes,
            transport: h.transport.clone(),
            timeout_ms: h.timeout_ms,
        };
        // A rank that is not a ductile program never reads this; the write still
        // succeeds into the socket buffer, and the fence below reports it.
        nonblocking::write_msg(&mut ch, &ToRank::Handoff(handoff)).await?;
        out.channels.push(ch);
    }
    Ok(out)
}

/// Collects every rank's address, reports them, and relays the job's table back.
async fn fence(
    h: &AgentHandoff,
    ranks: &mut Ranks,
    rx: &mut OwnedReadHalf,
    tx: &mut OwnedWriteHalf,
) -> anyhow::Result<()> {
    // The controller sets this a little shorter than its own limit, so that the
    // precise reason (which rank did not join) is what the user sees.
    let t = Duration::from_millis(h.join_timeout_ms.max(1));
    let mut started = Vec::with_capacity(h.ranks.len());
    for (i, &rank) in h.ranks.iter().enumerate() {
        let ready = tokio::select! {
            r = tokio::time::timeout(t, nonblocking::read_msg::<FromRank>(&mut ranks.channels[i])) => r,
            Some((r, exit)) = ranks.exits.recv() => {
                nonblocking::write_msg(tx, &FromAgent::RankExited { rank: r, exit }).await?;
                bail!("{r} {exit} before joining the job");
            }
        };
        match ready {
            Ok(Ok(FromRank::Ready { addr })) => {
                started.push(RankStarted { rank, pid: ranks.pids.get(&rank).copied().unwrap_or(0), addr });
            }
            Ok(Ok(other)) => bail!("{rank} sent {other:?} before joining"),
            Ok(Err(e)) => bail!("{rank} did not join the job (is it a ductile program?): {e}"),
            Err(_) => bail!("{rank} did not join the job within {t:?}"),
        }
    }
    nonblocking::write_msg(tx, &FromAgent::Ready(started)).await?;
    let table = loop {
        tokio::select! {
            m = nonblocking::read_msg::<ToAgent>(rx) => match m? {
                ToAgent::Peers(t) => break t,
                ToAgent::Abort => bail!("aborted by the controller during start-up"),
                ToAgent::Handoff(_) => bail!("second handoff"),
            },
            Some((r, exit)) = ranks.exits.recv() => {
                nonblocking::write_msg(tx, &FromAgent::RankExited { rank: r, exit }).await?;
            }
        }
    };
    for ch in &mut ranks.channels {
        nonblocking::write_msg(ch, &ToRank::Peers(table.clone())).await?;
    }
    Ok(())
}

/// Waits for the ranks to end, reporting each exit; ends them on abort.
async fn supervise(ranks: &mut Ranks, mut rx: OwnedReadHalf, mut tx: OwnedWriteHalf) -> anyhow::Result<()> {
    let mut controller_open = true;
    while !ranks.pids.is_empty() {
        tokio::select! {
            Some((rank, exit)) = ranks.exits.recv() => {
                ranks.pids.remove(&rank);
                let _ = nonblocking::write_msg(&mut tx, &FromAgent::RankExited { rank, exit }).await;
            }
            m = nonblocking::read_msg::<ToAgent>(&mut rx), if controller_open => match m {
                Ok(ToAgent::Abort) | Err(_) => {
                    controller_open = false;
                    end_ranks(ranks).await;
                }
                Ok(other) => tracing::warn!("agent ignores unexpected {other:?}"),
            },
        }
    }
    for f in ranks.forwarders.drain(..) {
        let _ = tokio::time::timeout(DRAIN, f).await;
    }
    let _ = nonblocking::write_msg(&mut tx, &FromAgent::Done).await;
    Ok(())
}

/// Ends every rank still running: SIGTERM, then SIGKILL after [`KILL_GRACE`].
async fn end_ranks(ranks: &mut Ranks) {
    for &pid in ranks.pids.values() {
        signal_pid(pid, libc::SIGTERM);
    }
    let deadline = tokio::time::Instant::now() + KILL_GRACE;
    while !ranks.pids.is_empty() {
        match tokio::time::timeout_at(deadline, ranks.exits.recv()).await {
            Ok(Some((rank, _))) => {
                ranks.pids.remove(&rank);
            }
            Ok(None) => return,
            Err(_) => {
                for &pid in ranks.pids.values() {
                    signal_pid(pid, libc::SIGKILL);
                }
                while !ranks.pids.is_empty() {
                    match tokio::time::timeout(KILL_GRACE, ranks.exits.recv()).await {
                        Ok(Some((rank, _))) => {
                            ranks.pids.remove(&rank);
                        }
                        _ => return,
                    }
                }
            }
        }
    }
}
