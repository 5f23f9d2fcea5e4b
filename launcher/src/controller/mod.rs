//! The job controller (`ductile run`): places ranks, starts one agent per node, runs the
//! bootstrap fence, serves the job's control socket, carries out reconfigurations at
//! the ranks' checkpoints ([`reconfig`]), watches the job, and ends it as a whole on the
//! first failure, on Ctrl-C/SIGTERM, or at `--timeout`.

mod reconfig;
mod recovery;
pub mod remote;
pub mod socket;
mod status;

use crate::layout::Layout;
use crate::membership::JobState;
use crate::plan::spawn::{Method, Strategy};
use crate::policy::{self, Bounds, PolicySpec, ResourceManager};
use crate::proto::{
    AgentHandoff, ChannelRead, ChannelWrite, Exit, FromAgent, Network, RankStarted, ToAgent, Token, AGENT_VERSION,
};
use crate::report;
use crate::spawn::{signal_group, Input};
use ductile::bootstrap::nonblocking;
use ductile_transport::{EndpointAddr, JobId, JobKey, NodeId, Rank};
use reconfig::{Deferred, InFlight, Queued};
use socket::Arrival;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::process::Child;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

/// Default timeout of every wait inside ranks, when `--timeout` is not given.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(300);
/// How much longer than `--timeout` the waits inside ranks are bounded.
pub const WAIT_MARGIN: Duration = Duration::from_secs(10);
/// How much shorter than the controller's join limit (`--join-timeout`) an agent waits
/// for its ranks to join, so that the precise reason (which rank did not join) is what
/// the user sees: a fifth of it, at most this.
const AGENT_JOIN_MARGIN: Duration = Duration::from_secs(5);

/// An agent's limit for its ranks to join, within the controller's `fence`.
fn agent_join_limit(fence: Duration) -> Duration {
    fence - (fence / 5).min(AGENT_JOIN_MARGIN)
}
/// Longest a message to an agent may take to be written: an agent reads its channel
/// at all times, so one that does not is lost.
const AGENT_WRITE_LIMIT: Duration = Duration::from_secs(10);
/// Time agents get to end their node worlds before their process groups are killed.
pub const ABORT_GRACE: Duration = Duration::from_secs(5);
/// Time the ranks get to end on their own after one reports a failed checkpoint: the
/// job's exit status is then the first failing rank's (a rank whose death caused the
/// failure, say), and applications print their errors. After it the job is ended.
pub const FAILED_CHECKPOINT_GRACE: Duration = Duration::from_secs(3);
/// Exit code when `--timeout` ends the job.
pub const TIMEOUT_EXIT: i32 = 124;
/// Longest wait at the end of a job for the output of ranks on other hosts to be written.
const PRINT_FLUSH: Duration = Duration::from_secs(5);
/// Longest wait at the end of a job for the answers to resize requests to be written.
const ANSWER_FLUSH: Duration = Duration::from_secs(1);
/// Tests only: the job key, as 64 hex digits, so that a test can look for it where it
/// must never be (command lines, environments, logs, reports). Only debug builds (which
/// the tests run) honour it, with a warning; nothing the launcher starts inherits it
/// (see `spawn`).
pub const TEST_KEY_ENV: &str = "DUCTILE_TEST_JOB_KEY";

/// The job's key: random, or in a debug build [`TEST_KEY_ENV`]'s.
fn job_key() -> anyhow::Result<JobKey> {
    let Some(text) = std::env::var_os(TEST_KEY_ENV) else { return Ok(JobKey::random()?) };
    if !cfg!(debug_assertions) {
        tracing::warn!("{TEST_KEY_ENV} is ignored: only debug builds, which the tests run, honour it");
        return Ok(JobKey::random()?);
    }
    let text = text.to_string_lossy();
    let hex = text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit());
    let mut key = [0u8; 32];
    for (k, b) in key.iter_mut().enumerate().filter(|_| hex) {
        // Two ASCII hex digits, checked above: always a byte.
        *b = u8::from_str_radix(&text[2 * k..2 * k + 2], 16).unwrap_or_default();
    }
    anyhow::ensure!(hex, "{TEST_KEY_ENV} must be 64 hex digits");
    tracing::warn!("the job key comes from {TEST_KEY_ENV}: for tests only");
    Ok(JobKey::from_bytes(key))
}

/// What `ductile run` was asked to do.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// Rank placement at start.
    pub layout: Layout,
    /// Slots of every node of the pool (its length is the pool's size).
    pub slots: Vec<u32>,
    /// Node-count bounds.
    pub bounds: Bounds,
    /// Resource-change policy.
    pub policy: PolicySpec,
    /// Checkpoints between change points of the policy.
    pub period: u64,
    /// Growth method.
    pub method: Method,
    /// Spawn strategy.
    pub strategy: Strategy,
    /// Absolute path of the program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Prefix output with `[rank]`.
    pub tag_output: bool,
    /// Wall-clock limit of the job.
    pub timeout: Option<Duration>,
    /// How long ranks may take to join (at start-up and in a growth).
    pub join_timeout: Duration,
    /// Transport backend and its settings.
    pub transport: ductile::bootstrap::TransportSpec,
    /// Where to write the JSON report.
    pub report: Option<PathBuf>,
    /// How registered data moves at a change.
    pub redistribution: ductile::Method,
    /// Constant items move in the background.
    pub background: bool,
    /// What a failed process does to the job.
    pub on_failure: OnFailure,
    /// A running process to adopt as rank 0 (a program started alone that grows).
    pub adopt: Option<crate::proto::Adopt>,
    /// Do not print the job's id and control socket at start.
    pub quiet: bool,
    /// Hosts, one per node of the pool; unset: simulated nodes on this host.
    pub hosts: Option<HostPool>,
    /// What each rank is bound to.
    pub bind_to: crate::bind::BindTo,
    /// Say where each rank was bound.
    pub report_bindings: bool,
}

/// What a failed process does to the job (`--on-failure`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OnFailure {
    /// The job ends, with the failed process's exit status.
    #[default]
    Abort,
    /// The job shrinks to the processes left: a shrink it did not ask for.
    Shrink,
}

/// The hosts of a job that spans hosts.
#[derive(Clone, Debug)]
pub struct HostPool {
    /// Host names, one per node of the pool, in node order.
    pub names: Vec<String>,
    /// The remote shell: the words before the host name.
    pub rsh: Vec<String>,
}

impl HostPool {
    /// Whether any host is another than this one (an agent there is started through
    /// the remote shell).
    #[must_use]
    pub fn spans_hosts(&self) -> bool {
        self.names.iter().any(|h| !crate::hosts::is_local(h))
    }
}

/// One node world, from the controller's side.
struct AgentConn {
    node: NodeId,
    pid: u32,
    /// Set for agents the controller started itself (for an agent on another host,
    /// the remote shell that started it).
    child: Option<Child>,
    /// The node world is on another host: its ranks' pids are that host's, and so is
    /// `pid` unless the controller started the agent (then `child`, the remote shell).
    /// Only the remote shell is ever signalled or reaped here.
    remote: bool,
    /// Reads its channel; ends when the channel closes (how the exit of an agent on
    /// another host is seen).
    reader: Option<tokio::task::JoinHandle<()>>,
    /// The agent's pid on its host, when `pid` is the remote shell's.
    host_pid: Option<u32>,
    tx: Option<ChannelWrite>,
    /// Ranks it started.
    started: Vec<RankStarted>,
    /// Ranks still running.
    live: HashSet<Rank>,
    done: bool,
    joined_epoch: u64,
    released_epoch: Option<u64>,
    /// The token an agent started by a resize must present.
    token: Option<Token>,
    /// Started by a growth that was abandoned (the application finished first); its
    /// processes are being ended, so their exits are not failures.
    abandoned: bool,
}

enum Event {
    Msg(usize, FromAgent),
    Lost(usize, String),
    /// The remote shell of an agent on another host is started.
    ShellStarted(usize, Child),
    /// An agent started through the remote shell has its handoff, and its channel
    /// begins as it should (or why not).
    HandedOff(usize, Result<(ChannelRead, ChannelWrite, u32), String>),
    Arrival(Arrival),
    /// Processes `ids`, leaving in change `seq`, ended badly (`why`) before it switched,
    /// a grace ago: the others are told, if the change has still not switched.
    Gone {
        seq: u32,
        ids: Vec<Rank>,
        why: String,
    },
    /// The recovery from failures at `epoch` began a grace ago: the survivors not yet
    /// ready stop waiting in a switch to that epoch (see `recovery::Ctl::unstick`).
    Unstick {
        epoch: u64,
    },
    /// Processes leaving in the shrink to `epoch` ended badly before it switched, a
    /// while ago: those whose move is done take it (see `recovery::Ctl::settle_held`).
    Settle {
        epoch: u64,
    },
    /// The recovery at `epoch` asked the leavers of the change switching where they are,
    /// a grace ago (see `recovery::Ctl::ask_leavers`).
    Asked {
        epoch: u64,
    },
}

/// Why the job ended early.
#[derive(Clone)]
enum Ending {
    Rank(String, NodeId, Exit),
    Node(NodeId, String),
    Reconfig(String),
    Timeout(Duration),
    Signal(i32),
}

impl Ending {
    fn code(&self) -> i32 {
        match self {
            Self::Rank(_, _, e) => e.code(),
            Self::Node(..) | Self::Reconfig(_) => 1,
            Self::Timeout(_) => TIMEOUT_EXIT,
            Self::Signal(s) => 128 + s,
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Rank(r, n, e) => format!("{r} on {n} {e}; ending the job"),
            Self::Node(n, why) => format!("{n} failed: {why}; ending the job"),
            Self::Reconfig(why) => format!("{why}; ending the job"),
            Self::Timeout(t) => format!("the job ran past --timeout {}s; ending it", t.as_secs()),
            Self::Signal(s) => format!("received signal {s}; ending the job"),
        }
    }
}

/// The controller's state.
pub(crate) struct Ctl {
    spec: JobSpec,
    job: JobId,
    key: JobKey,
    socket: PathBuf,
    /// Set when the job spans hosts.
    network: Option<Network>,
    /// Turns for remote shells to connect (see [`remote::REMOTE_FANOUT`]).
    fanout: std::sync::Arc<tokio::sync::Semaphore>,
    /// Set as the job ends: remote shells still waiting for their turn start no more.
    closing: std::sync::Arc<std::sync::atomic::AtomicBool>,
    agents: Vec<AgentConn>,
    /// Agent hosting each endpoint id.
    host: HashMap<Rank, usize>,
    /// The binding slot of each endpoint id on its host (`--bind-to`; see [`crate::bind`]).
    bound: HashMap<Rank, u32>,
    state: JobState,
    policy: Box<dyn ResourceManager>,
    flight: Option<InFlight>,
    /// A recovery from failed processes, waiting for the survivors.
    recovering: Option<recovery::Recovering>,
    /// Survivors that said they were ready to recover before the controller learnt of
    /// the failure (their transport saw the failed peer first).
    early_ready: Vec<recovery::Ready>,
    /// Processes that left badly in a shrink (`--on-failure shrink`; see
    /// `recovery::Ctl::left_behind`).
    left_badly: Option<recovery::LeftBadly>,
    /// Processes that finalized (they take part in no recovery).
    finalized: HashSet<Rank>,
    /// The job's first membership went out: processes can recover from failures.
    fenced: bool,
    deferred: Option<Deferred>,
    queued: Option<Queued>,
    done: Vec<report::Reconfiguration>,
    events: mpsc::UnboundedSender<Event>,
    ending: Option<Ending>,
    /// A rank's failed checkpoint: when the job ends unless it ends first, and why.
    failed: Option<(tokio::time::Instant, String)>,
    /// Growths that failed before their switch, and why (the job went on without them).
    failed_growths: Vec<String>,
    /// Tokens of new agents whose growth ended before they connected.
    dropped_tokens: Vec<Token>,
    /// Processes left at the last change: the next checkpoint without a change says
    /// so (`Decision::Tidy`).
    tidy: bool,
    wait_timeout: Duration,
    fence_limit: Duration,
}

/// Reads an agent's messages into the event channel; the task ends when the connection
/// does (after `Done`, when the agent has exited).
fn watch(events: &mpsc::UnboundedSender<Event>, idx: usize, mut rx: ChannelRead) -> tokio::task::JoinHandle<()> {
    let evs = events.clone();
    tokio::spawn(async move {
        loop {
            match nonblocking::read_msg::<FromAgent>(&mut rx).await {
                Ok(m) => {
                    if let FromAgent::Output(s, bytes) = m {
                        // Written by the printer: waiting for room holds up this agent
                        // only.
                        crate::output::print(s, bytes).await;
                        continue;
                    }
                    if matches!(m, FromAgent::Done) {
                        let _ = evs.send(Event::Msg(idx, m));
                        let mut rest = [0u8; 64];
                        while matches!(tokio::io::AsyncReadExt::read(&mut rx, &mut rest).await, Ok(n) if n > 0) {}
                        return;
                    }
                    let _ = evs.send(Event::Msg(idx, m));
                }
                Err(e) => {
                    let _ = evs.send(Event::Lost(idx, format!("its agent is gone ({e})")));
                    return;
                }
            }
        }
    })
}

/// The signals that end a job: Ctrl-C, SIGTERM, and SIGHUP (its terminal closed).
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
    usr2: tokio::signal::unix::Signal,
}

/// Signals `ductile run` passes on to every rank (as `mpirun` and `srun` do), so that a
/// batch system's warning before the time limit reaches the application instead of
/// ending the launcher.
pub const FORWARDED: [i32; 2] = [libc::SIGUSR1, libc::SIGUSR2];

impl Signals {
    fn new() -> std::io::Result<Self> {
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
            usr1: signal(SignalKind::user_defined1())?,
            usr2: signal(SignalKind::user_defined2())?,
        })
    }
}

/// What node `node`'s agent reads: `ductile run`'s stdin for node 0, which passes it on
/// to rank 0, as `mpirun` gives rank 0 its stdin; nothing for the others. A terminal is
/// not passed on: rank 0 runs in its node world's process group, which is not the
/// terminal's foreground group, so reading it would stop the rank (SIGTTIN). Nor is it
/// when the job adopts a running program as rank 0, which has a stdin of its own.
fn stdin_for(node: NodeId, adopting: bool) -> Input {
    // SAFETY: isatty only inspects file descriptor 0.
    let terminal = unsafe { libc::isatty(0) } == 1;
    if node == NodeId(0) && !adopting && !terminal {
        Input::Inherit
    } else {
        Input::Null
    }
}

/// Reaps `pid` if it is an orphan that was reparented here; gives up after `grace` (or
/// at once when it is someone else's child, whose parent reaps it).
async fn reap_orphan(pid: u32, grace: Duration) {
    let Ok(p) = i32::try_from(pid) else { return };
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        // SAFETY: waitpid on one pid with WNOHANG; the status pointer may be null.
        let rc = unsafe { libc::waitpid(p, std::ptr::null_mut(), libc::WNOHANG) };
        if rc != 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs the job; returns the exit code for `ductile run`.
///
/// # Errors
/// Failures of the launcher itself (random source, sockets, spawning an agent).
pub async fn run(spec: JobSpec) -> anyhow::Result<i32> {
    let started = Instant::now();
    // Signals that end the job are caught from the start: one that came while the
    // agents start ends the job once they have (the default action would leave them
    // running, and the control socket behind).
    let mut signals = Signals::new()?;
    // Agents started by other agents outlive their spawner when it is released, and
    // must still be reaped here.
    crate::spawn::become_subreaper();
    crate::spawn::raise_open_files_limit();
    let job = JobId::random()?;
    let key = job_key()?;
    // Ranks' waits outlast the job's own limit a little, so that when --timeout ends
    // the job, the controller's message (not a rank's timeout) says why.
    // And ranks that joined early wait for the late ones as long as they may take.
    let fence_limit = spec.join_timeout;
    let wait_timeout = spec.timeout.map_or(DEFAULT_WAIT_TIMEOUT, |t| t + WAIT_MARGIN).max(fence_limit + WAIT_MARGIN);
    let (ev_tx, mut events) = mpsc::unbounded_channel();
    let (arr_tx, mut arrivals) = mpsc::unbounded_channel();
    let network = match spec.hosts.as_ref().filter(|p| p.spans_hosts()) {
        Some(pool) => {
            let nodes = u32::try_from(pool.names.len())?;
            let addrs = remote::serve(job, key.clone(), nodes, arr_tx.clone()).await?;
            Some(remote::network(&pool.rsh, &pool.names, addrs).await?)
        }
        None => None,
    };
    let (socket, answering) = socket::serve(job, arr_tx)?;
    let fwd = ev_tx.clone();
    tokio::spawn(async move {
        while let Some(a) = arrivals.recv().await {
            if fwd.send(Event::Arrival(a)).is_err() {
                return;
            }
        }
    });
    if !spec.quiet {
        crate::say_errln!("ductile: job {job}, control socket {}", socket.display());
    }
    let nodes: Vec<NodeId> = spec.layout.nodes.iter().flat_map(|n| n.ranks.clone().map(move |_| n.node)).collect();
    let state = JobState::initial(nodes, Vec::new(), spec.slots.clone());
    let policy = policy::build(&spec.policy, spec.period, spec.bounds);
    let mut ctl = Ctl {
        spec,
        job,
        key,
        socket,
        network,
        fanout: std::sync::Arc::new(tokio::sync::Semaphore::new(remote::REMOTE_FANOUT)),
        closing: std::sync::Arc::default(),
        agents: Vec::new(),
        host: HashMap::new(),
        bound: HashMap::new(),
        state,
        policy,
        flight: None,
        recovering: None,
        early_ready: Vec::new(),
        left_badly: None,
        finalized: HashSet::new(),
        fenced: false,
        deferred: None,
        queued: None,
        done: Vec::new(),
        events: ev_tx,
        ending: None,
        failed: None,
        failed_growths: Vec::new(),
        dropped_tokens: Vec::new(),
        tidy: false,
        wait_timeout,
        fence_limit,
    };
    let result = ctl.start().await;
    if let Err(e) = result {
        ctl.ending = Some(Ending::Reconfig(format!("cannot start the job: {e:#}")));
    }
    if let Err(e) = ctl.main_loop(&mut events, &mut signals).await {
        // Still ended as a whole below: its agents told to abort, its socket and regions
        // removed.
        ctl.ending.get_or_insert(Ending::Reconfig(format!("the controller failed: {e:#}")));
    }
    // Agents on other hosts that got their handoff as the job ended are told to abort
    // too, rather than left to the grace of `reap`.
    ctl.closing.store(true, std::sync::atomic::Ordering::Release);
    ctl.late_agents(&mut events);
    let code = ctl.finish().await;
    crate::output::printed(PRINT_FLUSH).await;
    // Answers to resize requests (a change completed as the job ended) are written
    // before the process ends.
    answering.flushed(ANSWER_FLUSH).await;
    let _ = std::fs::remove_file(&ctl.socket);
    // Every rank has ended; an agent killed before its ranks could not clean up after
    // them (see `shm_regions`).
    let here = ctl.agents.iter().filter(|a| !a.remote);
    let pids: Vec<u32> = here.flat_map(|a| a.started.iter().map(|r| r.pid)).collect();
    ductile_transport::shm_regions::remove_ended(&pids);
    if let Some(path) = &ctl.spec.report {
        if let Err(e) = ctl.report(code, started).write(path) {
            crate::say_errln!("ductile: cannot write the report to {}: {e}", path.display());
        }
    }
    Ok(code)
}

impl Ctl {
    fn handoff(&self, node: NodeId, ids: Vec<Rank>) -> AgentHandoff {
        AgentHandoff {
            version: AGENT_VERSION,
            job: self.job,
            key: self.key.clone(),
            node,
            ids,
            bind_to: self.spec.bind_to,
            slots: Vec::new(),
            report_bindings: self.spec.report_bindings,
            program: self.spec.program.to_string_lossy().into_owned(),
            args: self.spec.args.clone(),
            transport: self.spec.transport.clone(),
            redistribution: self.spec.redistribution,
            background: self.spec.background,
            timeout_ms: u64::try_from(self.wait_timeout.as_millis()).unwrap_or(u64::MAX),
            join_timeout_ms: u64::try_from(agent_join_limit(self.fence_limit).as_millis()).unwrap_or(u64::MAX),
            tag_output: self.spec.tag_output,
            recover: self.spec.on_failure == OnFailure::Shrink,
            socket: self.socket.to_string_lossy().into_owned(),
            joining: None,
            adopt: None,
            network: self.network.clone(),
            remote: false,
        }
    }

    /// Binding slots for `new` processes, each on its node, which then hold them: on
    /// each host the lowest ones that no process of the job there holds. Empty when
    /// ranks are not bound.
    fn bind_slots(&mut self, new: &[(Rank, NodeId)]) -> Vec<u32> {
        if self.spec.bind_to == crate::bind::BindTo::None {
            return Vec::new();
        }
        // Only the job's processes hold slots: those that left or failed freed theirs.
        let live: HashSet<Rank> = self.state.ranks.iter().copied().collect();
        self.bound.retain(|r, _| live.contains(r));
        // Simulated nodes all share this host: their host name is None.
        let held = self.state.ranks.iter().zip(&self.state.nodes);
        let held: Vec<_> = held.filter_map(|(r, n)| self.bound.get(r).map(|&s| (self.host_name(*n), s))).collect();
        let slots = crate::bind::assign(held, new.iter().map(|(_, n)| self.host_name(*n)));
        self.bound.extend(new.iter().map(|(r, _)| *r).zip(slots.iter().copied()));
        slots
    }

    /// Starts the agents of the initial layout.
    async fn start(&mut self) -> anyhow::Result<()> {
        for plan in self.spec.layout.nodes.clone() {
            let mut h = self.handoff(plan.node, plan.rank_ids().collect());
            h.slots = self.bind_slots(&plan.rank_ids().map(|r| (r, plan.node)).collect::<Vec<_>>());
            h.adopt = self.spec.adopt.clone();
            let idx = self.agents.len();
            let host = self.remote_host(plan.node).map(str::to_owned);
            h.remote = host.is_some();
            let msg = ToAgent::Handoff(Box::new(h));
            let (mut child, mut reader, mut conn) = (None, None, None);
            if host.is_none() {
                let (c, rx, mut tx) = self.start_local_agent(plan.node)?;
                nonblocking::write_msg(&mut tx, &msg).await?;
                (child, reader, conn) = (Some(c), Some(watch(&self.events, idx, rx)), Some(tx));
            }
            for id in plan.rank_ids() {
                self.host.insert(id, idx);
            }
            self.agents.push(AgentConn {
                node: plan.node,
                pid: child.as_ref().and_then(Child::id).unwrap_or(0),
                child,
                remote: host.is_some(),
                reader,
                host_pid: None,
                tx: conn,
                started: Vec::new(),
                live: HashSet::new(),
                done: false,
                joined_epoch: 0,
                released_epoch: None,
                token: None,
                abandoned: false,
            });
            if let Some(host) = host {
                self.start_remote_agent(idx, &host, msg);
            }
        }
        tracing::info!("job {}: {} ranks on {} nodes", self.job, self.state.ranks.len(), self.agents.len());
        Ok(())
    }

    /// Passes signal `sig` on to every rank, through the agents of the node worlds that
    /// are in the job. Processes a growth is still starting do not get it: they are not
    /// in the job yet, and could not have set a handler for it.
    async fn forward(&mut self, sig: i32) {
        tracing::info!("forwarding signal {sig} to every rank");
        for a in 0..self.agents.len() {
            let ag = &self.agents[a];
            let member = !ag.done && ag.released_epoch.is_none() && !ag.abandoned && !self.in_growing_world(a);
            if ag.tx.is_some() && member {
                self.send(a, &ToAgent::Signal(sig)).await;
            }
        }
    }

    /// Sends to agent `a`. Failing to reach an agent that is not connected ends the job;
    /// a failed write to a connected one is left to what its connection says last.
    async fn send(&mut self, a: usize, msg: &ToAgent) {
        let ag = &mut self.agents[a];
        let (res, connected) = match ag.tx.as_mut() {
            Some(tx) => match tokio::time::timeout(AGENT_WRITE_LIMIT, nonblocking::write_msg(tx, msg)).await {
                Ok(r) => (r.map_err(|e| e.to_string()), true),
                Err(_) => {
                    // Half a message may have gone: the channel is unusable, and an
                    // agent that reads nothing for so long is lost (on another host,
                    // its host or the network to it may be gone).
                    ag.tx = None;
                    (Err(format!("a message to it made no progress for {AGENT_WRITE_LIMIT:?}")), false)
                }
            },
            None => (Err("it is not connected".to_string()), false),
        };
        if let Err(e) = res {
            if ag.abandoned {
                // Its growth was abandoned and it is ending anyway (it may be gone).
                tracing::debug!("node {}: the agent of an abandoned growth is gone ({e})", ag.node);
            } else if connected || ag.done {
                // The agent is gone or going, and what it sent before is still to be
                // read: its connection ends with `Done` (its ranks all finished: the
                // application may have ended as this was sent) or is lost, which ends
                // the job if it still had ranks (`Event::Lost`). A write that failed
                // first used to end a job whose application had just finished.
                tracing::debug!("node {}: cannot reach its agent ({e}); its connection's end decides", ag.node);
            } else if self.ending.is_none() {
                self.ending = Some(Ending::Node(ag.node, format!("cannot reach its agent ({e})")));
            }
        }
    }

    /// Describes endpoint `id` for messages: its current rank, if it has one.
    fn who(&self, id: Rank) -> String {
        match self.state.ranks.iter().position(|r| *r == id) {
            Some(r) if r as u32 == id.0 => format!("rank {r}"),
            Some(r) => format!("rank {r} (endpoint {})", id.0),
            None => format!("process {} (released)", id.0),
        }
    }

    async fn main_loop(
        &mut self,
        events: &mut mpsc::UnboundedReceiver<Event>,
        sig: &mut Signals,
    ) -> anyhow::Result<()> {
        let job_deadline = self.spec.timeout.map(|t| tokio::time::Instant::now() + t);
        let fence_deadline = tokio::time::Instant::now() + self.fence_limit;
        let initial = self.agents.len();
        let mut fenced = false;
        // Three heartbeats at least within the silence agents on other hosts accept.
        let loss = self.network.as_ref().map_or(u64::MAX, |n| n.heartbeat_loss_ms / 3);
        let mut beat = tokio::time::interval(crate::proto::HEARTBEAT.min(Duration::from_millis(loss.max(1))));
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            if !fenced && self.agents.iter().take(initial).all(|a| !a.started.is_empty()) {
                self.fence().await;
                fenced = true;
            }
            if self.ending.is_some() || self.agents.iter().all(|a| a.done) {
                break;
            }
            let mut limit = job_deadline;
            let mut phase = if fenced { None } else { Some(fence_deadline) };
            if let Some(f) = &self.flight {
                phase = Some(tokio::time::Instant::from_std(f.deadline));
            }
            if let Some(r) = &self.recovering {
                let d = tokio::time::Instant::from_std(r.deadline);
                phase = Some(phase.map_or(d, |p| p.min(d)));
            }
            if let Some(p) = phase.into_iter().chain(self.failed.as_ref().map(|f| f.0)).min() {
                limit = Some(limit.map_or(p, |l| l.min(p)));
            }
            let sleep = async {
                match limit {
                    Some(l) => tokio::time::sleep_until(l).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ev = events.recv() => match ev {
                    Some(ev) => self.on_event(ev).await,
                    None => break,
                },
                _ = sig.int.recv() => self.ending = Some(Ending::Signal(libc::SIGINT)),
                _ = sig.term.recv() => self.ending = Some(Ending::Signal(libc::SIGTERM)),
                _ = sig.hup.recv() => self.ending = Some(Ending::Signal(libc::SIGHUP)),
                _ = sig.usr1.recv() => self.forward(libc::SIGUSR1).await,
                _ = sig.usr2.recv() => self.forward(libc::SIGUSR2).await,
                _ = beat.tick(), if self.network.is_some() => self.heartbeat().await,
                () = sleep => {
                    let now = tokio::time::Instant::now();
                    if let (Some(d), Some(t)) = (job_deadline, self.spec.timeout) {
                        if d <= now {
                            self.ending = Some(Ending::Timeout(t));
                            continue;
                        }
                    }
                    if self.failed.as_ref().is_some_and(|f| f.0 <= now) {
                        self.ending = self.failed.take().map(|(_, why)| Ending::Reconfig(why));
                    } else if !fenced {
                        let n = self.agents.iter().find(|a| a.started.is_empty()).map_or(NodeId(0), |a| a.node);
                        self.ending = Some(Ending::Node(n, format!("did not start within {:?}", self.fence_limit)));
                    } else {
                        self.flight_deadline().await;
                        self.recovery_deadline();
                    }
                }
            }
        }
        Ok(())
    }

    /// Sends the job's first membership to every agent.
    async fn fence(&mut self) {
        let mut addrs = vec![EndpointAddr(String::new()); self.state.ranks.len()];
        for a in &self.agents {
            for r in &a.started {
                if let Some(slot) = addrs.get_mut(r.id.index()) {
                    *slot = r.addr.clone();
                }
            }
        }
        self.state.addrs = addrs;
        let m = ToAgent::Membership(self.state.membership());
        for a in 0..self.agents.len() {
            self.send(a, &m).await;
        }
        self.fenced = true;
        tracing::debug!("job {}: fence complete", self.job);
    }

    async fn on_event(&mut self, ev: Event) {
        match ev {
            Event::Msg(a, m) => self.on_agent(a, m).await,
            Event::Lost(a, why) => {
                // With `--on-failure shrink`, a node world whose processes all leave in
                // the shrink under way is released, however it ends (see `leaving_ends`).
                let leaving = self.spec.on_failure == OnFailure::Shrink
                    && self.agents[a].live.iter().all(|r| self.is_releasing(*r));
                let ag = &mut self.agents[a];
                if ag.done {
                    return;
                }
                if ag.abandoned || leaving && !ag.started.is_empty() {
                    // Its ranks are gone and so is it: a released node world.
                    let unfinished: Vec<Rank> =
                        if ag.abandoned { Vec::new() } else { ag.live.iter().copied().collect() };
                    ag.done = true;
                    ag.tx = None;
                    ag.live.clear();
                    if !unfinished.is_empty() {
                        let node = self.agents[a].node;
                        let why = format!("{node}, whose processes left in a shrink, was lost ({why})");
                        crate::say_errln!("ductile: {why}; they were leaving anyway (--on-failure shrink)");
                        let lost = (why.clone(), Some(node));
                        self.left_badly(unfinished, lost, Ending::Reconfig(why)).await;
                    }
                    self.after_exit().await;
                    return;
                }
                if self.in_growing_world(a) {
                    self.agents[a].done = true;
                    self.agents[a].tx = None;
                    let node = self.agents[a].node;
                    return self.growth_agent_lost(format!("{node}: {why}")).await;
                }
                let node = self.agents[a].node;
                let why = match (self.remote_host(node), &self.network) {
                    (Some(_), Some(net)) => format!("{why}; it was started by `{}`", net.rsh.join(" ")),
                    _ => why,
                };
                let live: Vec<Rank> = self.agents[a].live.iter().copied().collect();
                let lost = format!("{node} was lost ({why})");
                self.spawner_lost(a, &lost);
                if self.on_failure(&live, lost, Some(node), Ending::Node(node, why)).await {
                    // Its processes are taken as gone with it. Locally they are: they end
                    // with their agent. On another host, an agent cut off from the
                    // launcher ends them once it has heard nothing for the heartbeat
                    // limit; until then they may run on, but nothing of the job waits
                    // for them, and the survivors no longer address them.
                    let ag = &mut self.agents[a];
                    (ag.done, ag.tx) = (true, None);
                    ag.live.clear();
                }
            }
            Event::ShellStarted(a, child) => {
                let ag = &mut self.agents[a];
                ag.pid = child.id().unwrap_or(0);
                ag.child = Some(child);
            }
            Event::HandedOff(a, Ok((rx, tx, pid))) => {
                let reader = watch(&self.events, a, rx);
                let ag = &mut self.agents[a];
                ag.tx = Some(tx);
                ag.reader = Some(reader);
                ag.host_pid = Some(pid);
            }
            Event::HandedOff(a, Err(why)) => {
                if self.ending.is_none() {
                    self.ending = Some(Ending::Node(self.agents[a].node, why));
                }
            }
            Event::Arrival(Arrival::Agent { node, token, pid, rx, tx, remote }) => {
                self.on_hello(node, &token, (pid, remote), rx, tx);
                // The growth reports and the new agents' hellos travel on different
                // connections: the last hello may come after the last report.
                self.after_exit().await;
            }
            Event::Arrival(Arrival::Resize { target, reply }) => self.on_resize_request(target, reply).await,
            Event::Arrival(Arrival::Status { reply }) => {
                let _ = reply.send(self.status());
            }
            Event::Gone { seq, ids, why } => self.tell_gone(seq, ids, why).await,
            Event::Unstick { epoch } => self.unstick(epoch).await,
            Event::Settle { epoch } => self.settle_held(epoch, true).await,
            Event::Asked { epoch } => self.asked_expired(epoch).await,
        }
    }

    async fn on_agent(&mut self, a: usize, m: FromAgent) {
        match m {
            // Only a spawner is told that its new agent has taken over.
            FromAgent::Started => tracing::warn!("{}: an unexpected Started from its agent", self.agents[a].node),
            FromAgent::Ready(ranks) => {
                let ag = &mut self.agents[a];
                ag.live = ranks.iter().map(|r| r.id).collect();
                ag.started = ranks;
            }
            FromAgent::Grown(_) => tracing::warn!("{}: a growth report meant for a spawner", self.agents[a].node),
            FromAgent::Rank(id, msg) => self.on_rank(a, id, msg).await,
            FromAgent::RankExited { rank, exit } => {
                self.agents[a].live.remove(&rank);
                if self.in_growing_world(a) && !self.agents[a].abandoned {
                    // A new process cannot end before its switch, whatever its code.
                    let node = self.agents[a].node;
                    self.fail_growth(format!("new process {} on {node} {exit}", rank.0)).await;
                    return self.after_exit().await;
                }
                let released = self.is_releasing(rank);
                let abandoned = self.agents[a].abandoned;
                // During a recovery, a survivor that ends, however, can no longer take part.
                let awaited = self.recovering.is_some() && self.state.ranks.contains(&rank);
                if (exit != Exit::Code(0) || awaited) && !abandoned && !self.ended_by_us(rank) && self.ending.is_none()
                {
                    let (who, node) = (self.who(rank), self.agents[a].node);
                    if released && self.spec.on_failure == OnFailure::Shrink {
                        self.leaving_ends(rank, who, node, exit).await;
                    } else if released {
                        self.ending = Some(Ending::Rank(format!("{who}, while leaving in a shrink,"), node, exit));
                    } else {
                        let why = format!("{who} on {node} {exit}");
                        self.on_failure(&[rank], why, None, Ending::Rank(who, node, exit)).await;
                    }
                }
                self.after_exit().await;
            }
            // An agent that started with the job could not start its node world (a
            // new agent reports to its spawner instead).
            FromAgent::Failed(why) => {
                if self.ending.is_none() {
                    self.ending = Some(Ending::Node(self.agents[a].node, why));
                }
            }
            FromAgent::GrowthReport { seq, result } => self.on_growth_report(a, seq, result).await,
            // `watch` passes output to the printer itself.
            FromAgent::Output(..) => tracing::debug!("output reached the event loop"),
            FromAgent::Done => {
                let ag = &mut self.agents[a];
                ag.done = true;
                if !ag.live.is_empty() && !ag.abandoned && self.ending.is_none() {
                    // An agent never ends before its ranks unless told to: it lost its
                    // way (it says why first, as `Failed`).
                    let why = format!("its agent ended while {} of its processes still ran", ag.live.len());
                    self.ending = Some(Ending::Node(ag.node, why));
                }
                // Its connection closes: one per node world that ever left, otherwise,
                // kept to the end of the job.
                ag.tx = None;
                if ag.child.is_none() && !ag.remote {
                    tokio::spawn(reap_orphan(ag.pid, ABORT_GRACE));
                }
                self.after_exit().await;
            }
        }
    }

    /// Ends the job: aborts every agent on failure, or waits for them to exit.
    async fn finish(&mut self) -> i32 {
        // The ranks' last lines come before what the launcher says.
        crate::output::printed(PRINT_FLUSH).await;
        if self.ending.is_none() {
            // Every rank ended within the grace, none with an error of its own: the
            // failed checkpoint is still the job's failure; so is a failure the job had
            // not recovered from.
            self.ending = self.failed.take().map(|(_, why)| Ending::Reconfig(why)).or_else(|| self.unrecovered());
        }
        let code = match &self.ending {
            Some(e) => {
                crate::say_errln!("ductile: {}", self.explain(e));
                if let Some(f) = self.flight.take() {
                    f.fail(&self.explain(e));
                }
                for a in 0..self.agents.len() {
                    let ag = &mut self.agents[a];
                    match ag.tx.as_mut() {
                        Some(tx) if !ag.done => {
                            let _ =
                                tokio::time::timeout(AGENT_WRITE_LIMIT, nonblocking::write_msg(tx, &ToAgent::Abort))
                                    .await;
                        }
                        // The remote shell of an agent still being handed its settings
                        // can take no abort: it is ended, and its agent with it.
                        None if ag.remote && ag.child.is_some() && !ag.done => signal_group(ag.pid, libc::SIGTERM),
                        _ => {}
                    }
                }
                e.code()
            }
            None => 0,
        };
        if let Some(q) = self.queued.take() {
            q.refuse("the job ended before its next checkpoint");
        }
        if let Some(f) = self.flight.take() {
            f.fail("the job ended before the change was done");
        }
        self.reap(ABORT_GRACE).await;
        for a in self.agents.iter().filter(|a| !a.remote) {
            // Sweep anything a rank left behind in its node's process group.
            signal_group(a.pid, libc::SIGKILL);
        }
        // And what left the groups (by `setsid`); every agent has been reaped, so
        // whatever is still a child of ours is such a process.
        let adopted = crate::spawn::end_adopted().await;
        if adopted > 0 {
            tracing::warn!(
                "ended {adopted} processes the job's ranks left running outside their node worlds (child jobs' \
                 launchers, or processes in sessions of their own)"
            );
        }
        if !self.done.is_empty() {
            crate::say_err!("ductile: reconfigurations of job {}:\n{}", self.job, report::table(&self.done));
        }
        code
    }

    /// Waits for every agent to exit within `grace`, then kills the process groups of
    /// the ones still running and waits for them.
    async fn reap(&mut self, grace: Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        for a in &mut self.agents {
            let Some(child) = a.child.as_mut() else {
                if let Some(reader) = a.reader.take().filter(|_| a.remote) {
                    // Its channel closes as it exits.
                    let _ = tokio::time::timeout_at(deadline, reader).await;
                } else if a.pid != 0 && !a.remote {
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    reap_orphan(a.pid, left).await;
                    signal_group(a.pid, libc::SIGKILL);
                    reap_orphan(a.pid, Duration::from_millis(200)).await;
                }
                continue;
            };
            if tokio::time::timeout_at(deadline, child.wait()).await.is_err() {
                tracing::warn!("agent of {} did not exit in time; killing its node world", a.node);
                signal_group(a.pid, libc::SIGKILL);
                let _ = tokio::time::timeout(grace, child.wait()).await;
            }
        }
    }
}
