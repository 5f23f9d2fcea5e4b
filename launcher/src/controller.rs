//! The job controller (`ductile run`): places ranks, starts one agent per node, runs the
//! bootstrap fence, watches the job, and ends it as a whole on the first failure, on
//! Ctrl-C/SIGTERM, or at `--timeout`.

use crate::layout::Layout;
use crate::proto::{AgentHandoff, Exit, FromAgent, RankStarted, ToAgent, AGENT_VERSION};
use crate::report::{NodeReport, Report};
use crate::spawn::{signal_group, spawn_with_channel, Output};
use ductile::bootstrap::nonblocking;
use ductile_transport::{EndpointAddr, JobId, JobKey, NodeId, Rank};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::process::Child;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

/// Default timeout of every wait inside ranks, when `--timeout` is not given.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(300);
/// How much longer than `--timeout` the waits inside ranks are bounded.
pub const WAIT_MARGIN: Duration = Duration::from_secs(10);
/// Longest time the start-up fence may take.
pub const MAX_FENCE: Duration = Duration::from_secs(60);
/// Time agents get to end their node worlds before their process groups are killed.
pub const ABORT_GRACE: Duration = Duration::from_secs(5);
/// Exit code when `--timeout` ends the job.
pub const TIMEOUT_EXIT: i32 = 124;

/// What `ductile run` was asked to do.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// Rank placement.
    pub layout: Layout,
    /// Absolute path of the program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Prefix output with `[rank]`.
    pub tag_output: bool,
    /// Wall-clock limit of the job.
    pub timeout: Option<Duration>,
    /// Transport backend.
    pub transport: String,
    /// Where to write the JSON report.
    pub report: Option<PathBuf>,
}

struct Agent {
    node: NodeId,
    child: Child,
    pid: u32,
    tx: OwnedWriteHalf,
    ranks: Vec<RankStarted>,
    done: bool,
}

enum Event {
    Msg(NodeId, FromAgent),
    Lost(NodeId, String),
}

/// Why the job ended early.
enum Ending {
    Rank(Rank, NodeId, Exit),
    Node(NodeId, String),
    Timeout(Duration),
    Signal(i32),
}

impl Ending {
    fn code(&self) -> i32 {
        match self {
            Self::Rank(_, _, e) => e.code(),
            Self::Node(..) => 1,
            Self::Timeout(_) => TIMEOUT_EXIT,
            Self::Signal(s) => 128 + s,
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Rank(r, n, e) => format!("{r} on {n} {e}; ending the job"),
            Self::Node(n, why) => format!("{n} failed: {why}; ending the job"),
            Self::Timeout(t) => format!("the job ran past --timeout {}s; ending it", t.as_secs()),
            Self::Signal(s) => format!("received signal {s}; ending the job"),
        }
    }
}

/// Runs the job; returns the exit code for `ductile run`.
///
/// # Errors
/// Failures of the launcher itself (random source, sockets, spawning an agent).
pub async fn run(spec: JobSpec) -> anyhow::Result<i32> {
    let started = Instant::now();
    let job = JobId::random()?;
    let key = JobKey::random()?;
    // Ranks' waits outlast the job's own limit a little, so that when --timeout ends
    // the job, the controller's message (not a rank's timeout) says why.
    let wait_timeout = spec.timeout.map_or(DEFAULT_WAIT_TIMEOUT, |t| t + WAIT_MARGIN);
    let fence_limit = spec.timeout.unwrap_or(DEFAULT_WAIT_TIMEOUT).min(MAX_FENCE);
    let deadline = spec.timeout.map(|t| tokio::time::Instant::now() + t);
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let (ev_tx, mut events) = mpsc::unbounded_channel();
    let mut agents = Vec::with_capacity(spec.layout.nodes.len());
    let exe = std::env::current_exe()?;
    let nodes = u32::try_from(spec.layout.nodes.len())?;
    for plan in &spec.layout.nodes {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        let child = spawn_with_channel(exe.as_os_str(), &["agent"], &theirs, true, Output::Inherit)?;
        drop(theirs);
        ours.set_nonblocking(true)?;
        let (mut rx, mut tx) = UnixStream::from_std(ours)?.into_split();
        let handoff = AgentHandoff {
            version: AGENT_VERSION,
            job,
            key: key.clone(),
            node: plan.node,
            nodes,
            size: spec.layout.size(),
            ranks: plan.rank_ids().collect(),
            program: spec.program.to_string_lossy().into_owned(),
            args: spec.args.clone(),
            transport: spec.transport.clone(),
            timeout_ms: u64::try_from(wait_timeout.as_millis()).unwrap_or(u64::MAX),
            join_timeout_ms: u64::try_from(fence_limit.as_millis()).unwrap_or(u64::MAX) / 5 * 4,
            tag_output: spec.tag_output,
        };
        nonblocking::write_msg(&mut tx, &ToAgent::Handoff(handoff)).await?;
        let node = plan.node;
        let evs = ev_tx.clone();
        tokio::spawn(async move {
            loop {
                match nonblocking::read_msg::<FromAgent>(&mut rx).await {
                    Ok(m) => {
                        let last = matches!(m, FromAgent::Done | FromAgent::Failed(_));
                        let _ = evs.send(Event::Msg(node, m));
                        if last {
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = evs.send(Event::Lost(node, format!("its agent is gone ({e})")));
                        return;
                    }
                }
            }
        });
        let pid = child.id().unwrap_or(0);
        agents.push(Agent { node, child, pid, tx, ranks: Vec::new(), done: false });
    }
    drop(ev_tx);
    tracing::info!("job {job}: {} ranks on {nodes} nodes", spec.layout.size());

    let fence_deadline = tokio::time::Instant::now() + fence_limit;
    let mut ready = 0;
    let mut ending: Option<Ending> = None;
    let mut table_sent = false;
    loop {
        if !table_sent && ready == agents.len() {
            let mut table = vec![EndpointAddr(String::new()); spec.layout.size() as usize];
            for a in &agents {
                for r in &a.ranks {
                    table[r.rank.index()] = r.addr.clone();
                }
            }
            for a in &mut agents {
                if let Err(e) = nonblocking::write_msg(&mut a.tx, &ToAgent::Peers(table.clone())).await {
                    ending = Some(Ending::Node(a.node, format!("cannot reach its agent ({e})")));
                }
            }
            table_sent = true;
            tracing::debug!("job {job}: fence complete after {:?}", started.elapsed());
        }
        if ending.is_some() || agents.iter().all(|a| a.done) {
            break;
        }
        let limit =
            if table_sent { deadline } else { Some(deadline.map_or(fence_deadline, |d| d.min(fence_deadline))) };
        let sleep = async {
            match limit {
                Some(l) => tokio::time::sleep_until(l).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            ev = events.recv() => match ev {
                Some(Event::Msg(node, m)) => {
                    let a = &mut agents[node.0 as usize];
                    match m {
                        FromAgent::Ready(ranks) => {
                            a.ranks = ranks;
                            ready += 1;
                        }
                        FromAgent::RankExited { rank, exit } => {
                            if exit != Exit::Code(0) {
                                ending = Some(Ending::Rank(rank, node, exit));
                            }
                        }
                        FromAgent::Failed(why) => ending = Some(Ending::Node(node, why)),
                        FromAgent::Done => a.done = true,
                    }
                }
                Some(Event::Lost(node, why)) => ending = Some(Ending::Node(node, why)),
                None => break,
            },
            _ = sigint.recv() => ending = Some(Ending::Signal(libc::SIGINT)),
            _ = sigterm.recv() => ending = Some(Ending::Signal(libc::SIGTERM)),
            () = sleep => ending = Some(match (table_sent, spec.timeout) {
                (true, Some(t)) => Ending::Timeout(t),
                (false, Some(t)) if deadline.is_some_and(|d| d <= tokio::time::Instant::now()) => Ending::Timeout(t),
                _ => Ending::Node(first_not_ready(&agents), format!("did not start within {fence_limit:?}")),
            }),
        }
    }

    let code = match &ending {
        Some(e) => {
            eprintln!("ductile: {}", e.describe());
            abort(&mut agents).await;
            e.code()
        }
        None => {
            reap(&mut agents, ABORT_GRACE).await;
            0
        }
    };
    for a in &agents {
        // Sweep anything a rank left behind in its node's process group.
        signal_group(a.pid, libc::SIGKILL);
    }
    if let Some(path) = &spec.report {
        let report = Report {
            job: job.to_string(),
            program: spec.program.display().to_string(),
            size: spec.layout.size(),
            exit_code: code,
            failure: ending.as_ref().map(Ending::describe),
            wall_ms: started.elapsed().as_secs_f64() * 1e3,
            nodes: agents
                .iter()
                .map(|a| NodeReport {
                    node: a.node.0,
                    agent_pid: a.pid,
                    ranks: a.ranks.iter().map(|r| r.rank.0).collect(),
                    pids: a.ranks.iter().map(|r| r.pid).collect(),
                })
                .collect(),
            reconfigurations: Vec::new(),
        };
        if let Err(e) = report.write(path) {
            eprintln!("ductile: cannot write the report to {}: {e}", path.display());
        }
    }
    Ok(code)
}

fn first_not_ready(agents: &[Agent]) -> NodeId {
    agents.iter().find(|a| a.ranks.is_empty()).map_or(NodeId(0), |a| a.node)
}

/// Tells every agent to end its node world, then kills the groups of the slow ones.
async fn abort(agents: &mut [Agent]) {
    for a in agents.iter_mut() {
        let _ = nonblocking::write_msg(&mut a.tx, &ToAgent::Abort).await;
    }
    reap(agents, ABORT_GRACE).await;
}

/// Waits for every agent to exit within `grace`, then kills the process groups of the
/// ones still running and waits for them.
async fn reap(agents: &mut [Agent], grace: Duration) {
    let deadline = tokio::time::Instant::now() + grace;
    for a in agents.iter_mut() {
        if tokio::time::timeout_at(deadline, a.child.wait()).await.is_err() {
            tracing::warn!("agent of {} did not exit in time; killing its node world", a.node);
            signal_group(a.pid, libc::SIGKILL);
            let _ = tokio::time::timeout(grace, a.child.wait()).await;
        }
    }
}
