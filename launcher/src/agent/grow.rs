//! Growths: the node worlds this agent starts, here or through the remote shell, and
//! the reports gathered along the spawn tree.

use super::*;

/// Starts the node worlds of `orders` (one sequence per spawner, side by side) and
/// returns every node world of their subtrees once all are up.
pub(super) async fn grow(h: &AgentHandoff, orders: Vec<SpawnOrder>) -> Result<Vec<NodeStarted>, String> {
    let delay = std::env::var(SPAWN_DELAY_ENV).ok().and_then(|v| v.parse().ok()).filter(|_| cfg!(debug_assertions));
    if let Some(ms) = delay {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
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

/// Testing knob, honoured by debug builds only: delays every growth an agent starts by
/// as many milliseconds, as slow node starts do, so that the tests can fail a process
/// while a growth is still starting.
const SPAWN_DELAY_ENV: &str = "DUCTILE_TEST_SPAWN_DELAY_MS";

/// One spawner's orders: each new world is started once the previous one's agent has
/// taken over; their readiness and subtree reports are awaited together at the end.
pub(super) async fn run_sequence(h: &AgentHandoff, seq: Vec<SpawnOrder>) -> Result<Vec<NodeStarted>, String> {
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
pub(super) async fn start_child(
    h: &AgentHandoff,
    o: SpawnOrder,
) -> Result<(ductile_transport::NodeId, ChannelRead), String> {
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
    // No parent-death signal: this agent may be released before the one it starts. The
    // new agent's lifeline is its connection to the controller.
    let (mut child, mut rx, mut tx): (_, ChannelRead, ChannelWrite) = match remote {
        Some((net, host)) => crate::spawn::spawn_remote(net, host, false)
            .map_err(|e| fail(format!("cannot start the remote shell: {e}")))?,
        None => {
            let exe = crate::spawn::own_exe().map_err(|e| fail(e.to_string()))?;
            let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(|e| fail(e.to_string()))?;
            let io = (Input::Null, Output::Inherit);
            let setup = Setup { new_group: true, ..Setup::default() };
            let child = spawn_with_channel(exe.as_os_str(), &["agent"], &theirs, setup, io, None)
                .map_err(|e| fail(format!("cannot start its agent: {e}")))?;
            drop(theirs);
            let channel = ours.set_nonblocking(true).and_then(|()| UnixStream::from_std(ours));
            let (r, w) = channel.map_err(|e| fail(e.to_string()))?.into_split();
            (child, Box::new(r), Box::new(w))
        }
    };
    let handoff = AgentHandoff {
        node,
        ids: o.ids,
        slots: o.slots,
        joining: Some(Joining { token: o.token, spawns: o.spawns }),
        adopt: None,
        // A node world on another host than the controller's is remote (connects over
        // TCP, sends its output as messages), even when started here.
        remote: remote.is_some() || h.remote,
        ..h.clone()
    };
    let pid = child.id();
    if let Some(pid) = pid {
        started_here().lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(pid);
    }
    let msg = ToAgent::Handoff(Box::new(handoff));
    let t = Duration::from_millis(h.join_timeout_ms.max(1));
    let started = async {
        match remote {
            Some(_) => {
                crate::spawn::hand_off_remote(&mut rx, &mut tx, &msg, t).await.map_err(fail)?;
            }
            None => nonblocking::write_msg(&mut tx, &msg).await.map_err(|e| fail(e.to_string()))?,
        }
        match tokio::time::timeout(t, nonblocking::read_msg::<FromAgent>(&mut rx)).await {
            Ok(Ok(FromAgent::Started)) => Ok(()),
            Ok(Ok(FromAgent::Failed(e))) => Err(e),
            Ok(Ok(other)) => Err(fail(format!("unexpected {other:?} from its agent"))),
            Ok(Err(e)) => Err(fail(format!("its agent is gone ({e})"))),
            Err(_) => Err(fail(format!("its agent did not take over within {t:?}"))),
        }
    }
    .await;
    if started.is_err() {
        // Nothing it started may outlive the failure: the agent, or the remote shell.
        if let Some(pid) = pid {
            crate::spawn::signal_group(pid, libc::SIGKILL);
        }
    }
    tokio::spawn(async move {
        let _ = child.wait().await;
        if let Some(pid) = pid {
            started_here().lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&pid);
        }
    });
    started.map(|()| {
        tracing::debug!("{}: {node} has started", h.node);
        (node, rx)
    })
}

/// The processes this agent started for growths (agents, or remote shells) and that
/// still run: they live on when this agent ends.
fn started_here() -> &'static std::sync::Mutex<std::collections::HashSet<u32>> {
    static STARTED: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<u32>>> = std::sync::OnceLock::new();
    STARTED.get_or_init(Default::default)
}

/// Whether this agent's sweep of what its ranks left must spare child `pid`: one it
/// started for a growth, or a node world's agent reparented here (this agent is a
/// subreaper) when the agent that started it ended first.
pub(super) fn spared(pid: u32) -> bool {
    if started_here().lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains(&pid) {
        return true;
    }
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"));
    let args = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let agent = args.split(|&b| b == 0).nth(1) == Some(b"agent".as_slice());
    agent && exe.ok().zip(std::env::current_exe().ok()).is_some_and(|(a, b)| a == b)
}
