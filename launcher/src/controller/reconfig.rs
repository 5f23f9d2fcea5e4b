//! Reconfigurations, driven by the ranks' checkpoints.
//!
//! Rank 0 reports each checkpoint; the controller decides (a queued `ductile resize`,
//! the application's own request, or the policy), plans with the pure planners, and
//! carries the change out in phases, each with a deadline:
//!
//! 1. **spawn** (growth): `Grow` orders go to the agents hosting the spawning ranks;
//!    the new node worlds start along the spawn tree and report back up it; each new
//!    agent also connects to the control socket with its token. A growth that fails
//!    here (a new process or agent fails, or does not come up in time) is abandoned:
//!    no old process has heard of it, so rank 0 is told to continue and the job goes
//!    on at its old size ([`Ctl::fail_growth`]);
//! 2. **switch**: the [`Change`] goes to rank 0 (which passes it to the old group) and to
//!    every new process; the ranks move the registered data and the new rank 0 reports
//!    `Switched` with the phase times measured inside the ranks;
//! 3. **release** (shrink): released processes leave, then their agents; stragglers are
//!    ended after [`RELEASE_GRACE`].
//!
//! A checkpoint that arrives while a change is under way is answered when it is done.

use super::{AgentConn, Ctl, Ending, FAILED_CHECKPOINT_GRACE};
use crate::membership::{GrowOrders, JobState};
use crate::plan::resize::{plan_resize, Resize, Target};
use crate::plan::shrink::ShrinkPlan;
use crate::plan::spawn::{plan_expansion, Method, SpawnPlan, Strategy};
use crate::proto::{ChannelRead, ChannelWrite, NodeStarted, ResizeReply, SpawnOrder, ToAgent, Token};
use crate::report::{Phases, Reconfiguration};
use ductile::bootstrap::{Change, CheckpointMode, Decision, FromRank, SwitchTimes, ToRank};
use ductile_transport::{EndpointAddr, NodeId, Rank};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Time released processes get to leave after the switch before they are ended.
pub const RELEASE_GRACE: Duration = Duration::from_secs(5);

/// A resize asked for on the control socket, waiting for a checkpoint.
pub struct Queued {
    target: Target,
    reply: mpsc::UnboundedSender<ResizeReply>,
}

impl Queued {
    pub fn refuse(self, why: &str) {
        let _ = self.reply.send(ResizeReply::Refused(why.to_string()));
    }
}

/// A checkpoint to answer once the change under way is done.
pub struct Deferred {
    agent: usize,
    id: Rank,
    count: u64,
    mode: CheckpointMode,
    want: Option<u32>,
}

enum Phase {
    /// `pending`: the agents given orders that have not reported yet.
    Spawning {
        pending: HashSet<usize>,
        started: Vec<NodeStarted>,
        plan: SpawnPlan,
        orders: GrowOrders,
    },
    Switching,
    Releasing {
        ended: bool,
    },
}

/// The change under way.
pub struct InFlight {
    seq: u32,
    phase: Phase,
    pub deadline: Instant,
    trigger: &'static str,
    reply: Option<mpsc::UnboundedSender<ResizeReply>>,
    /// Agent and endpoint of the rank 0 that asked.
    root: (usize, Rank),
    mode: CheckpointMode,
    grow: Option<(Method, Strategy, u32)>,
    before: (u32, u32),
    after: (u32, u32),
    added_nodes: Vec<u32>,
    pub(super) released_nodes: Vec<u32>,
    /// Old ranks that failed (a recovery, `--on-failure shrink`).
    pub(super) failed: Vec<u32>,
    /// Processes that must leave.
    leaving: HashSet<Rank>,
    /// The processes before the change (set when it is sent out).
    old: Vec<Rank>,
    /// Processes this controller ended because they did not leave in time.
    ended: HashSet<Rank>,
    root_takeover: bool,
    /// The checkpoint count of the decision.
    count: u64,
    t_checkpoint: Instant,
    t_decided: Instant,
    t_gathered: Option<Instant>,
    t_switched: Option<Instant>,
    times: SwitchTimes,
    /// New agents by token.
    tokens: HashMap<usize, Token>,
    /// Every agent this growth started (indices into the controller's agents).
    new_agents: Vec<usize>,
    /// The old processes all finished before the growth could switch: once every new
    /// node world is up (or has failed) they are ended and the job ends normally.
    abandoned: bool,
    /// Why the growth failed before its switch, if it did: the job goes on without it.
    failure: Option<String>,
    /// The membership before the change: the job's again if the change is abandoned
    /// during its switch (see `recovery::Ctl::abandon_change`).
    pub(super) prev: JobState,
    /// A new agent was lost before its switch. Its spawner's report says why more
    /// precisely (a rank that exited, say), so the growth fails on this only when every
    /// report is in.
    lost: Option<String>,
}

impl InFlight {
    /// The change's number.
    pub(super) fn seq(&self) -> u32 {
        self.seq
    }

    /// Whether the change has gone out to the processes and they are switching.
    pub(super) fn switching(&self) -> bool {
        matches!(self.phase, Phase::Switching)
    }

    /// Whether the change is a growth.
    pub(super) fn is_growth(&self) -> bool {
        self.grow.is_some()
    }

    /// Whether the change is a recovery from failures.
    pub(super) fn is_recovery(&self) -> bool {
        self.trigger == "failure"
    }

    /// The agents of the new node worlds of a growth.
    pub(super) fn new_agents(&self) -> &[usize] {
        &self.new_agents
    }

    /// Whether the change was asked for at a background checkpoint (its constant items
    /// move while the application computes on).
    pub(super) fn in_background(&self) -> bool {
        self.mode == CheckpointMode::Background
    }

    /// Whether the change is a growth still starting its processes, which the old ones
    /// have not heard of.
    pub(super) fn spawning(&self) -> bool {
        matches!(self.phase, Phase::Spawning { .. })
    }

    /// The membership before the change.
    pub(super) fn members_before(&self) -> &[Rank] {
        &self.old
    }

    /// Whether `r` was in the membership before the change.
    pub(super) fn was_member(&self, r: Rank) -> bool {
        self.old.contains(&r)
    }

    /// The processes that leave in the change.
    pub(super) fn leavers(&self) -> Vec<Rank> {
        self.leaving.iter().copied().collect()
    }

    /// Whether `r` is one of the processes this change releases.
    pub(super) fn is_leaving(&self, r: Rank) -> bool {
        self.leaving.contains(&r)
    }

    /// The job failed while this change was under way.
    pub fn fail(self, why: &str) {
        if let Some(r) = self.reply {
            let _ = r.send(ResizeReply::Failed(why.to_string()));
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Ctl {
    pub(super) fn is_releasing(&self, id: Rank) -> bool {
        self.flight.as_ref().is_some_and(|f| f.leaving.contains(&id))
    }

    /// Ends process `id`, which leaves in the change under way, if it still runs (its
    /// exit is then no failure); true if so.
    pub(super) async fn end_leaving(&mut self, id: Rank) -> bool {
        let Some(a) = self.agents.iter().position(|a| a.live.contains(&id)) else { return false };
        let Some(f) = self.flight.as_mut().filter(|f| f.leaving.contains(&id)) else { return false };
        f.ended.insert(id);
        tracing::info!("resize {}: ending {id}, which leaves, as it cannot finish its switch", f.seq);
        self.send(a, &ToAgent::End(vec![id])).await;
        true
    }

    /// Tells every process of change `seq` that still runs that `ids`, which left in it
    /// badly (`why`) or failed, are gone, if the change has still not switched (see
    /// [`ToRank::Gone`]); once it has, those still leaving in it (one may wait in the
    /// change's last collective on a failed process, which the others no longer do).
    pub(super) async fn tell_gone(&mut self, seq: u32, ids: Vec<Rank>, why: String) {
        let Some(f) = self.flight.as_ref().filter(|f| f.seq == seq) else { return };
        let mut told: Vec<Rank> = if f.switching() {
            let mut all = f.old.clone();
            all.extend(self.state.ranks.iter().filter(|r| !f.old.contains(r)));
            all
        } else {
            f.leaving.iter().copied().filter(|r| !f.ended.contains(r)).collect()
        };
        told.retain(|r| !ids.contains(r));
        tracing::info!("resize {seq}: telling the processes of the change that {why}");
        let notice = ToRank::Gone(ductile::bootstrap::Failure { epoch: self.state.epoch, failed: ids, why });
        for id in told {
            if let Some(a) = self.agents.iter().position(|a| a.live.contains(&id)) {
                self.send(a, &ToAgent::ToRank(id, notice.clone())).await;
            }
        }
    }

    pub(super) fn ended_by_us(&self, id: Rank) -> bool {
        self.flight.as_ref().is_some_and(|f| f.ended.contains(&id))
    }

    pub(super) async fn on_rank(&mut self, a: usize, id: Rank, msg: FromRank) {
        match msg {
            FromRank::Checkpoint { .. } if self.recovering.is_some() => {
                // Its rank 0 sent it before it learnt of the failure: it recovers instead.
                tracing::debug!("checkpoint from {id} during a recovery ignored");
            }
            FromRank::Recover { epoch, count, intact, moved } => {
                let ready = super::recovery::Ready { id, epoch, count, intact, moved };
                self.on_recover(ready).await;
            }
            FromRank::Finalized => self.on_finalized(id),
            FromRank::Checkpoint { epoch, count, mode, want_procs } => {
                if id != self.state.ranks[0] || epoch != self.state.epoch && self.flight.is_none() {
                    tracing::warn!("checkpoint from {id} at epoch {epoch} ignored (rank 0 is {})", self.state.ranks[0]);
                    return;
                }
                let d = Deferred { agent: a, id, count, mode, want: want_procs };
                if self.flight.is_some() {
                    self.deferred = Some(d);
                } else {
                    self.decide(d).await;
                }
            }
            FromRank::Switched { epoch, times } => self.on_switched(epoch, times).await,
            FromRank::CheckpointFailed { count, rank, reason } => {
                if self.failed.is_some() || self.ending.is_some() {
                    return;
                }
                if self.agents[a].abandoned {
                    // A process of a growth abandoned: its agent ends it.
                    tracing::debug!("{id}, of a growth abandoned, failed joining: {reason}");
                    return;
                }
                if count == 0 && (self.recovering.is_some() || self.spec.on_failure == super::OnFailure::Shrink) {
                    // A process joining a change (a failure may have interrupted it, which
                    // the controller may not have heard of yet): it exits next, and its
                    // exit is a failure that a recovery takes in (or not).
                    tracing::info!("{id} failed joining: {reason}; its exit is a failure (--on-failure shrink)");
                    return;
                }
                // The controller's ranks are already the new membership's; the process
                // failed in the old one (or, joining, is only in the new one).
                let who = match (count, rank == id.0) {
                    (0, _) => self.who(id),
                    (_, true) => format!("rank {rank}"),
                    (_, false) => format!("rank {rank} (endpoint {})", id.0),
                };
                let at = if count == 0 { "joining".to_string() } else { format!("at checkpoint {count}") };
                let why = format!("{who} failed {at}: {reason}");
                tracing::warn!("{why}; the job ends in {FAILED_CHECKPOINT_GRACE:?} unless it ends first");
                self.failed = Some((tokio::time::Instant::now() + FAILED_CHECKPOINT_GRACE, why));
            }
            other => tracing::warn!("unexpected {other:?} from {id}"),
        }
    }

    async fn answer(&mut self, d: &Deferred, decision: Decision) {
        // The first checkpoint without a change after processes left tells the ranks
        // to let go of what their transports hold for them (fabric shm: the departed
        // peers' mapped regions), rather than at the next change.
        let decision = match decision {
            Decision::Continue if std::mem::take(&mut self.tidy) => Decision::Tidy(self.state.addrs.clone()),
            other => other,
        };
        self.send(d.agent, &ToAgent::ToRank(d.id, ToRank::Decision(decision))).await;
    }

    /// Decides what checkpoint `d` brings, and starts it.
    async fn decide(&mut self, d: Deferred) {
        if self.early_ready.iter().any(|e| e.epoch == self.state.epoch) {
            // A process saw a peer fail that the controller has not heard of yet: no
            // change starts now, which would keep the job from recovering.
            return self.answer(&d, Decision::Continue).await;
        }
        let t_checkpoint = Instant::now();
        let (target, trigger, reply) = if let Some(q) = self.queued.take() {
            (Some(q.target), "resize", Some(q.reply))
        } else if let Some(p) = d.want {
            (Some(Target::Procs(p)), "application", None)
        } else {
            (self.policy.decide(d.count, self.state.node_count()).map(Target::Nodes), "policy", None)
        };
        let Some(target) = target else {
            return self.answer(&d, Decision::Continue).await;
        };
        let refuse = |why: String, reply: Option<mpsc::UnboundedSender<ResizeReply>>| match reply {
            Some(r) => {
                let _ = r.send(ResizeReply::Refused(why));
            }
            None => tracing::warn!("resize to {target} ({trigger}) refused: {why}"),
        };
        let plan = match plan_resize(&self.state.allocation(), target, &self.spec.bounds) {
            Err(e) => {
                refuse(e.to_string(), reply);
                return self.answer(&d, Decision::Continue).await;
            }
            Ok(Resize::Same) => {
                if let Some(r) = reply {
                    let _ = r.send(ResizeReply::Done(format!("the job already has {target}")));
                }
                return self.answer(&d, Decision::Continue).await;
            }
            Ok(Resize::Shrink(s)) => Plan::Shrink(s),
            Ok(Resize::Grow { running, target: t }) => {
                match plan_expansion(self.spec.method, self.spec.strategy, &running, &t) {
                    Ok(p) => Plan::Grow(p),
                    Err(e) => {
                        refuse(e.to_string(), reply);
                        return self.answer(&d, Decision::Continue).await;
                    }
                }
            }
        };
        let mut f = self.in_flight(trigger, (d.agent, d.id), (d.mode, d.count), t_checkpoint);
        f.reply = reply;
        match plan {
            Plan::Shrink(s) => {
                let (change, next) = self.state.after_shrink(&s);
                f.released_nodes = s.released_nodes.iter().map(|&n| n as u32).collect();
                self.state = next;
                self.flight = Some(f);
                self.switch(change).await;
            }
            Plan::Grow(p) => self.start_growth(f, p).await,
        }
    }

    /// A change about to start, from the current membership: decided now, at the
    /// checkpoint `count` reported at `t_checkpoint` by rank 0 (`root`: its agent and
    /// endpoint).
    pub(super) fn in_flight(
        &self,
        trigger: &'static str,
        root: (usize, Rank),
        (mode, count): (CheckpointMode, u64),
        t_checkpoint: Instant,
    ) -> InFlight {
        let before = (self.state.ranks.len() as u32, self.state.node_count());
        InFlight {
            seq: self.state.changes + 1,
            phase: Phase::Switching,
            deadline: Instant::now() + self.wait_timeout,
            trigger,
            reply: None,
            root,
            mode,
            grow: None,
            before,
            after: before,
            added_nodes: Vec::new(),
            released_nodes: Vec::new(),
            failed: Vec::new(),
            leaving: HashSet::new(),
            old: Vec::new(),
            ended: HashSet::new(),
            root_takeover: false,
            count,
            t_checkpoint,
            t_decided: Instant::now(),
            t_gathered: None,
            t_switched: None,
            times: SwitchTimes::default(),
            tokens: HashMap::new(),
            new_agents: Vec::new(),
            abandoned: false,
            failure: None,
            lost: None,
            prev: self.state.clone(),
        }
    }

    /// Sends the growth's orders to the agents of the spawning ranks.
    async fn start_growth(&mut self, mut f: InFlight, plan: SpawnPlan) {
        let mut tokens = Vec::with_capacity(plan.actions.len());
        for _ in &plan.actions {
            match Token::random() {
                Ok(t) => tokens.push(t),
                Err(e) => {
                    self.ending = Some(Ending::Reconfig(format!("random source failed: {e}")));
                    return;
                }
            }
        }
        let mut orders = self.state.grow_orders(&plan, &tokens);
        let new: Vec<(Rank, NodeId)> = (orders.group_ids.iter().zip(&orders.group_nodes))
            .flat_map(|(ids, n)| ids.iter().map(move |r| (*r, *n)))
            .collect();
        let slots: HashMap<Rank, u32> = new.iter().map(|(r, _)| *r).zip(self.bind_slots(&new)).collect();
        for (_, o) in &mut orders.roots {
            self.place(o, &slots);
        }
        // One agent entry per new node world; it connects later with its token.
        let epoch = self.state.epoch + 1;
        for (g, node) in orders.group_nodes.iter().enumerate() {
            let idx = self.agents.len();
            for id in &orders.group_ids[g] {
                self.host.insert(*id, idx);
            }
            f.tokens.insert(idx, tokens[g].clone());
            f.new_agents.push(idx);
            self.agents.push(AgentConn {
                node: *node,
                pid: 0,
                child: None,
                remote: false,
                reader: None,
                host_pid: None,
                tx: None,
                started: Vec::new(),
                live: HashSet::new(),
                done: false,
                joined_epoch: epoch,
                released_epoch: None,
                token: Some(tokens[g].clone()),
                abandoned: false,
            });
        }
        let mut per_agent: HashMap<usize, Vec<SpawnOrder>> = HashMap::new();
        for (spawner, o) in &orders.roots {
            if let Some(&a) = self.host.get(spawner) {
                per_agent.entry(a).or_default().push(o.clone());
            }
        }
        f.grow = Some((plan.method, plan.strategy, plan.step_count()));
        f.added_nodes = orders.group_nodes.iter().map(|n| n.0).collect();
        f.deadline = Instant::now() + self.fence_limit;
        let pending: HashSet<usize> = per_agent.keys().copied().collect();
        let (mode, root, seq) = (f.mode, f.root, f.seq);
        tracing::debug!("growth: orders to {} agents", pending.len());
        f.phase = Phase::Spawning { pending, started: Vec::new(), plan, orders };
        self.flight = Some(f);
        for (a, o) in per_agent {
            self.send(a, &ToAgent::Grow { seq, orders: o }).await;
        }
        if mode == CheckpointMode::Background {
            self.send(root.0, &ToAgent::ToRank(root.1, ToRank::Decision(Decision::Pending))).await;
        }
    }

    pub(super) fn on_hello(
        &mut self,
        node: NodeId,
        token: &Token,
        (pid, remote): (u32, bool),
        rx: ChannelRead,
        tx: ChannelWrite,
    ) {
        let found = self.flight.as_ref().and_then(|f| {
            f.tokens.iter().find(|(&a, t)| t.matches(token) && self.agents[a].node == node).map(|(&a, _)| a)
        });
        let failed = self.flight.as_ref().is_some_and(|f| f.failure.is_some());
        let Some(a) = found.filter(|_| !failed) else {
            if found.is_some() || self.dropped_tokens.iter().any(|t| t.matches(token)) {
                // Its growth failed or was dropped: refused, the agent ends its node
                // world and exits.
                tracing::debug!("control socket: agent of {node} (pid {pid}) came up after its growth ended; refused");
            } else {
                tracing::warn!("control socket: agent of {node} (pid {pid}) presented an unknown token; refused");
            }
            return;
        };
        if let Some(f) = self.flight.as_mut() {
            f.tokens.remove(&a);
        }
        let ag = &mut self.agents[a];
        ag.pid = pid;
        ag.remote = remote;
        ag.tx = Some(tx);
        ag.token = None;
        let reader = super::watch(&self.events, a, rx);
        self.agents[a].reader = Some(reader);
    }

    /// A spawning agent's report on the node worlds of growth `seq`.
    pub(super) async fn on_growth_report(&mut self, a: usize, seq: u32, result: Result<Vec<NodeStarted>, String>) {
        let Some(f) = self.flight.as_ref().filter(|f| f.seq == seq && matches!(f.phase, Phase::Spawning { .. })) else {
            // A growth given up at its deadline, reported late: nothing of it is left.
            let what = result.as_ref().map_or_else(Clone::clone, |n| format!("{} node worlds up", n.len()));
            tracing::debug!("a report of resize {seq}, which has ended, ignored ({what})");
            return;
        };
        match result {
            Ok(nodes) => self.on_grown(a, nodes).await,
            Err(why) if f.abandoned => {
                tracing::warn!("{why} (the growth was abandoned: the application had finished)");
                self.drop_abandoned().await;
            }
            Err(why) => self.growth_report_failed(a, why).await,
        }
    }

    async fn on_grown(&mut self, a: usize, nodes: Vec<NodeStarted>) {
        let Some(Phase::Spawning { pending, started, .. }) = self.flight.as_mut().map(|f| &mut f.phase) else {
            return;
        };
        started.extend(nodes);
        pending.remove(&a);
        self.after_exit().await;
    }

    /// Whether every process of the current membership has exited.
    fn old_world_ended(&self) -> bool {
        self.agents.iter().all(|a| self.state.ranks.iter().all(|r| !a.live.contains(r)))
    }

    /// Ends an abandoned growth: its new node worlds are told to end, and the job ends
    /// when their agents are done.
    pub(super) async fn drop_abandoned(&mut self) {
        self.drop_growth().await;
    }

    /// Ends the growth under way, abandoned or failed: its new node worlds are told to
    /// end (those whose agents never connected end on their own, their spawners having
    /// reported); a failed growth is recorded and the deferred checkpoint answered.
    async fn drop_growth(&mut self) {
        let Some(f) = self.flight.take() else { return };
        let seq = f.seq;
        self.dropped_tokens.extend(f.tokens.values().cloned());
        if let Phase::Spawning { started, .. } = &f.phase {
            // Recorded for the report, so the ended processes can be accounted for.
            for n in started {
                if let Some(ag) = self.agents.iter_mut().find(|a| a.pid == n.agent_pid && a.node == n.node) {
                    ag.started = n.ranks.clone();
                }
            }
        }
        for &a in &f.new_agents {
            let ag = &mut self.agents[a];
            ag.abandoned = true;
            if ag.tx.is_none() {
                // Never connected: its spawner reported the failure; nothing to wait for.
                ag.done = true;
            }
        }
        for &a in &f.new_agents {
            if !self.agents[a].done {
                self.send(a, &ToAgent::Abort).await;
            }
        }
        match f.failure.clone() {
            Some(why) => {
                self.failed_growths.push(format!("resize {seq}: {why}"));
                // Its number is taken: the next change has the next one. So are its
                // endpoint ids: they stay blank ("left the job"), and the next growth's
                // processes get new ones, never confused with these.
                self.state.changes = seq;
                if let Phase::Spawning { orders, .. } = &f.phase {
                    let end = orders.group_ids.iter().flatten().map(|r| r.index() + 1).max().unwrap_or(0);
                    if end > self.state.addrs.len() {
                        self.state.addrs.resize(end, EndpointAddr(String::new()));
                    }
                }
                f.fail(&format!("resize {seq} failed before the switch: {why}; the job goes on as it was"));
                if self.recovering.is_some() {
                    // Dropped for a failure: the recovery goes first.
                    self.deferred = None;
                    return self.recovered_all().await;
                }
                if let Some(d) = self.deferred.take() {
                    self.decide(d).await;
                }
            }
            None => f.fail(&format!("the application finished before resize {seq} could switch")),
        }
    }

    /// Whether agent `a` hosts a node world of the growth under way, before its switch.
    pub(super) fn in_growing_world(&self, a: usize) -> bool {
        self.flight.as_ref().is_some_and(|f| matches!(f.phase, Phase::Spawning { .. }) && f.new_agents.contains(&a))
    }

    /// The agent of a new node world was lost before the switch.
    pub(super) async fn growth_agent_lost(&mut self, why: String) {
        if let Some(f) = self.flight.as_mut() {
            f.lost.get_or_insert(why);
        }
        self.gathered().await;
    }

    /// A spawner reported that its part of the growth failed.
    async fn growth_report_failed(&mut self, a: usize, why: String) {
        if let Some(Phase::Spawning { pending, .. }) = self.flight.as_mut().map(|f| &mut f.phase) {
            pending.remove(&a);
        }
        self.fail_growth(why).await;
    }

    /// Agent `a`, of the job before the growth under way, is lost (`why`): if it had
    /// orders to start node worlds, no report comes from it, and the growth, which fails
    /// for the loss, does not wait for one. Before, it waited out its phase's deadline
    /// (60 s), and the recovery from the loss with it.
    pub(super) fn spawner_lost(&mut self, a: usize, why: &str) {
        let Some(f) = self.flight.as_mut() else { return };
        if let Phase::Spawning { pending, .. } = &mut f.phase {
            if pending.remove(&a) {
                f.lost.get_or_insert_with(|| format!("{why} meanwhile"));
            }
        }
    }

    /// The growth under way failed before its switch (a new node world or process
    /// failed, or did not come up in time). The old processes have not heard of it, so
    /// it is abandoned and the job goes on as it was: rank 0 is told to continue at
    /// once and the new node worlds are ended. The growth stays in flight, deferring the
    /// next checkpoint, until every spawner has reported (or the phase's deadline), so
    /// that no late report is taken for a later growth's.
    pub(super) async fn fail_growth(&mut self, why: String) {
        self.mark_failed(why).await;
        self.gathered().await;
    }

    /// The first half of [`Ctl::fail_growth`]: the failure recorded and acted on.
    async fn mark_failed(&mut self, why: String) {
        let Some(f) = self.flight.as_mut() else { return };
        if !matches!(f.phase, Phase::Spawning { .. }) || f.abandoned {
            return;
        }
        if f.failure.is_none() {
            let (n, nodes) = (self.state.ranks.len(), self.state.node_count());
            let (ps, ns) = (if n == 1 { "" } else { "es" }, if nodes == 1 { "" } else { "s" });
            // During a recovery, the size the job goes on at is the recovery's to say.
            let size = if self.recovering.is_some() {
                String::new()
            } else {
                format!(" ({n} process{ps} on {nodes} node{ns})")
            };
            crate::say_errln!(
                "ductile: resize {} failed before the switch: {why}; the job goes on without it{size}",
                f.seq
            );
            f.failure = Some(why);
            let (root, new_agents) = (f.root, f.new_agents.clone());
            for a in new_agents {
                self.agents[a].abandoned = true;
                if self.agents[a].tx.is_some() && !self.agents[a].done {
                    self.send(a, &ToAgent::Abort).await;
                }
            }
            self.send(root.0, &ToAgent::ToRank(root.1, ToRank::Decision(Decision::Continue))).await;
        }
    }

    /// Finishes the gather of a growth once every report and every new agent is in.
    async fn gathered(&mut self) {
        let Some(f) = self.flight.as_mut() else { return };
        let Phase::Spawning { pending, .. } = &f.phase else { return };
        if !pending.is_empty() {
            return;
        }
        if f.failure.is_some() {
            // Agents yet to connect will be refused.
            return self.drop_growth().await;
        }
        if let Some(why) = f.lost.take() {
            self.mark_failed(why).await;
            return self.drop_growth().await;
        }
        if !f.tokens.is_empty() {
            return;
        }
        if f.abandoned {
            return self.drop_abandoned().await;
        }
        let Phase::Spawning { started, plan, orders, .. } = std::mem::replace(&mut f.phase, Phase::Switching) else {
            return;
        };
        f.t_gathered = Some(Instant::now());
        let (change, next) = match self.state.after_growth(&plan, &orders, &started) {
            Ok(x) => x,
            Err(e) => {
                self.ending = Some(Ending::Reconfig(format!("resize {}: {e}", f.seq)));
                return;
            }
        };
        for n in &started {
            if let Some(ag) = self.agents.iter_mut().find(|a| a.pid == n.agent_pid && a.node == n.node) {
                ag.live = n.ranks.iter().map(|r| r.id).collect();
                ag.started = n.ranks.clone();
            }
        }
        self.state = next;
        self.switch(change).await;
    }

    /// Sends the change to rank 0 and to every new process.
    pub(super) async fn switch(&mut self, mut change: Change) {
        let Some(f) = self.flight.as_mut() else { return };
        change.checkpoint = f.count;
        let old: HashSet<Rank> = change.before.iter().copied().collect();
        let new: HashSet<Rank> = change.after.ranks.iter().copied().collect();
        f.leaving = old.difference(&new).copied().collect();
        f.old.clone_from(&change.before);
        f.after = (change.after.ranks.len() as u32, self.state.node_count());
        f.root_takeover = change.after.ranks[0] != change.before[0];
        f.deadline = Instant::now() + self.wait_timeout;
        f.phase = Phase::Switching;
        let root = f.root;
        let decision = ToRank::Decision(Decision::Change(change.clone()));
        // A recovery goes to every survivor: their old group has failed members, so
        // rank 0 cannot pass it on.
        let recovery = !change.failed.is_empty();
        for id in change.after.ranks.iter().filter(|r| !old.contains(r) || recovery && **r != root.1) {
            if let Some(&a) = self.host.get(id) {
                self.send(a, &ToAgent::ToRank(*id, decision.clone())).await;
            }
        }
        self.send(root.0, &ToAgent::ToRank(root.1, decision)).await;
    }

    pub(super) async fn on_switched(&mut self, epoch: u64, times: SwitchTimes) {
        let Some(f) = self.flight.as_mut() else {
            tracing::warn!("switch report outside a change ignored");
            return;
        };
        if epoch != self.state.epoch || !matches!(f.phase, Phase::Switching) {
            tracing::warn!("switch report for epoch {epoch} ignored");
            return;
        }
        f.t_switched = Some(Instant::now());
        f.times = times;
        f.phase = Phase::Releasing { ended: false };
        f.deadline = Instant::now() + RELEASE_GRACE;
        self.after_exit().await;
    }

    /// Checks whether the change under way can move on (after an exit, a report, ...).
    pub(super) async fn after_exit(&mut self) {
        let Some(f) = self.flight.as_ref() else { return };
        match &f.phase {
            Phase::Spawning { .. } => {
                if !f.abandoned && self.old_world_ended() {
                    let seq = f.seq;
                    tracing::info!(
                        "the application finished while resize {seq} was starting node worlds; they will be ended"
                    );
                    if let Some(f) = self.flight.as_mut() {
                        f.abandoned = true;
                    }
                }
                self.gathered().await;
            }
            Phase::Switching => {
                // The old processes that stay exit only when the application ends,
                // and their rank 0 reports the switch before it exits: if they are all
                // gone and their agents have relayed everything they sent, the
                // application finished as the change was sent out, and nothing can
                // switch now. (Processes that leave in this change, all of them with
                // `--method baseline`, exit anyway.) An agent may report a rank's exit
                // before that rank's last messages, which it passes on as it drains
                // (a switch report just before the rank finalized; the rank's messages
                // and its exit reach the agent on different channels): only an agent
                // that is done has relayed them all. Counting a stayer as ended at its
                // exit dropped a finished shrink now and then, unrecorded.
                let mut stay = f.old.iter().filter(|r| !f.leaving.contains(r)).peekable();
                let stayers_ended = stay.peek().is_some()
                    && stay.all(|r| {
                        self.agents.iter().all(|a| !a.live.contains(r))
                            && self.host.get(r).is_none_or(|&a| self.agents[a].done)
                    });
                if stayers_ended {
                    tracing::info!(
                        "the application finished while resize {} was switching; its new node worlds will be ended",
                        f.seq
                    );
                    self.drop_abandoned().await;
                }
            }
            Phase::Releasing { .. } => {
                let live: usize = self.agents.iter().map(|a| a.live.intersection(&f.leaving).count()).sum();
                let agents_left = self
                    .agents
                    .iter()
                    .any(|a| !a.done && !a.started.is_empty() && a.started.iter().all(|r| f.leaving.contains(&r.id)));
                if live == 0 && !agents_left {
                    self.complete().await;
                }
            }
        }
    }

    /// Records the finished change and answers a deferred checkpoint.
    async fn complete(&mut self) {
        let Some(f) = self.flight.take() else { return };
        let now = Instant::now();
        let epoch = self.state.epoch;
        // The processes that left are gone: the next membership says so (a blank
        // address), and the ranks' transports let go of what they held for them.
        for r in &f.leaving {
            if let Some(a) = self.state.addrs.get_mut(r.index()) {
                *a = EndpointAddr(String::new());
            }
        }
        self.tidy |= !f.leaving.is_empty();
        for a in &mut self.agents {
            if a.done && a.released_epoch.is_none() && a.started.iter().all(|r| f.leaving.contains(&r.id)) {
                a.released_epoch = Some(epoch);
            }
        }
        let switched = f.t_switched.unwrap_or(now);
        let r = Reconfiguration {
            seq: f.seq,
            epoch,
            kind: if f.after.0 > f.before.0 { "grow" } else { "shrink" },
            trigger: f.trigger,
            method: f.grow.map(|(m, ..)| if m == Method::Merge { "merge" } else { "baseline" }),
            strategy: f.grow.map(|(_, s, _)| if s == Strategy::Parallel { "parallel" } else { "single" }),
            spawn_steps: f.grow.map_or(0, |g| g.2),
            procs_before: f.before.0,
            procs_after: f.after.0,
            nodes_before: f.before.1,
            nodes_after: f.after.1,
            added_nodes: f.added_nodes.clone(),
            released_nodes: f.released_nodes.clone(),
            failed: f.failed.clone(),
            root_takeover: f.root_takeover,
            phases_ms: Phases {
                decide: ms(f.t_decided - f.t_checkpoint),
                spawn: f.t_gathered.map_or(0.0, |g| ms(g - f.t_decided)),
                connect: f.times.connect_us as f64 / 1e3,
                redistribute: f.times.redistribute_us as f64 / 1e3,
                background: f.times.background_us as f64 / 1e3,
                release: ms(now - switched),
                total: ms(now - f.t_checkpoint),
            },
        };
        if !r.released_nodes.is_empty() {
            self.policy.released(&r.released_nodes);
        }
        tracing::info!("{}", r.summary());
        if let Some(reply) = &f.reply {
            let _ = reply.send(ResizeReply::Done(r.summary()));
        }
        self.done.push(r);
        if self.recovering.is_some() {
            // Processes failed as the change ended: the recovery goes first, and rank 0's
            // checkpoint is moot (it recovers instead).
            self.deferred = None;
            return self.recovered_all().await;
        }
        if let Some(d) = self.deferred.take() {
            self.decide(d).await;
        }
    }

    /// A phase ran past its deadline.
    pub(super) async fn flight_deadline(&mut self) {
        let Some(f) = self.flight.as_mut() else { return };
        if Instant::now() < f.deadline {
            return;
        }
        let seq = f.seq;
        if f.abandoned {
            return self.drop_abandoned().await;
        }
        match &mut f.phase {
            Phase::Spawning { .. } => {
                let missing: Vec<String> = f.tokens.keys().map(|&a| self.agents[a].node.to_string()).collect();
                let what = if missing.is_empty() {
                    "the new node worlds did not all report".to_string()
                } else {
                    format!("no agent connected for {}", missing.join(", "))
                };
                let limit = self.fence_limit;
                self.mark_failed(format!("node worlds did not come up within {limit:?} ({what})")).await;
                // Reports still missing now are ignored when they come (by their number).
                self.drop_growth().await;
            }
            Phase::Switching => {
                self.ending = Some(Ending::Reconfig(format!(
                    "resize {seq}: the ranks did not switch to the new group within {:?}",
                    self.wait_timeout
                )));
            }
            Phase::Releasing { ended: false } => {
                let mut per_agent: HashMap<usize, Vec<Rank>> = HashMap::new();
                for (i, a) in self.agents.iter().enumerate() {
                    for id in a.live.intersection(&f.leaving) {
                        per_agent.entry(i).or_default().push(*id);
                        f.ended.insert(*id);
                    }
                }
                tracing::warn!("resize {seq}: ending released processes that did not leave within {RELEASE_GRACE:?}");
                f.phase = Phase::Releasing { ended: true };
                f.deadline = Instant::now() + RELEASE_GRACE;
                for (a, ids) in per_agent {
                    self.send(a, &ToAgent::End(ids)).await;
                }
            }
            Phase::Releasing { ended: true } => {
                self.ending = Some(Ending::Reconfig(format!("resize {seq}: released processes did not exit")));
            }
        }
    }

    /// A request from `ductile resize`: refused now if it cannot be met, else queued
    /// for the next checkpoint.
    pub(super) async fn on_resize_request(&mut self, target: Target, reply: mpsc::UnboundedSender<ResizeReply>) {
        let q = Queued { target, reply };
        if self.queued.is_some() {
            return q.refuse("another resize is already queued; try again once it is done");
        }
        if let Err(e) = plan_resize(&self.state.allocation(), target, &self.spec.bounds) {
            return q.refuse(&format!("{e} (the job is unchanged)"));
        }
        let note = if self.flight.is_some() { " (after the change under way)" } else { "" };
        tracing::info!("resize to {target} queued{note}");
        let _ = q.reply.send(ResizeReply::Queued);
        self.queued = Some(q);
    }
}

enum Plan {
    Grow(SpawnPlan),
    Shrink(ShrinkPlan),
}
