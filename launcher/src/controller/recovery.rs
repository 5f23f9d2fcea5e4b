//! Failures as shrinks (`ductile run --on-failure shrink`): one membership model, in
//! which a failed process is a shrink the job did not ask for.
//!
//! A process fails when it exits with an error or is killed, or when its node is lost
//! (its agent's connection ends while it still has processes). With `--on-failure
//! abort` (the default) that ends the job. With `shrink`, the controller tells every
//! other process ([`ToRank::Failure`]): their waits are interrupted, and each, at its
//! next checkpoint, says it is ready ([`ductile::bootstrap::FromRank::Recover`]).
//! Further failures meanwhile join the same recovery. Once every survivor is ready,
//! each gets the same change (the survivors in their old order, the failed processes
//! named), and the change completes as any shrink does: the new rank 0 reports the
//! switch, and the reconfiguration is recorded with `trigger: failure`. A node lost
//! with its agent leaves the pool: no growth goes there again.
//!
//! A failure while a change switches. Survivors keep their old blocks until the change
//! commits (a blocking move shares them with the transport as they are and recycles
//! none of their pages), so each survivor's data of the old epoch is whole wherever
//! the failure came. A survivor whose move is done when the change's last collective
//! loses a process does not take the change on its own: it says it is ready, `moved`,
//! holding both layouts, and waits for the controller's word. The change's last
//! collective completes nowhere before every process has moved its data, so:
//! - a survivor ready at the old epoch whose move was not done (it waited on the
//!   failed process and is told it is gone after [`GONE_GRACE`]) means nobody took the
//!   change: it is abandoned ([`Ctl::abandon_change`]), the job's membership is the
//!   old one again, and every survivor recovers from there, its old blocks back, each
//!   told at once to stop waiting in the switch;
//! - if every survivor is ready at the new epoch or `moved`, the change may have
//!   switched somewhere. If one of the old membership took it (its collective
//!   completed), the recovery follows the change. If none did, the controller takes
//!   whichever loses less data ([`Ctl::abandon_loses_less`]): the failed processes'
//!   old blocks if the change is abandoned, or their new blocks if it is followed; the
//!   survivors waiting are told to take it ([`ToRank::Settled`]) or recover from the
//!   old epoch. Leavers that are still waiting in the change's last collective, which
//!   the others left, are told to stop, and take it too.
//!
//! Survivors not ready [`GONE_GRACE`] after a failure are told again, as of the epoch
//! before ([`Ctl::unstick`]): that ends their waits in the switch (one may wait in the
//! last collective on a process that has taken the new group meanwhile). A process new
//! in a change that is abandoned is ended with it, even if it took the change. A
//! survivor whose data was not kept whole (a move in the background) ends the job.
//!
//! A process leaving in a shrink that ends badly before the shrink switched was leaving
//! anyway, and is no failure, unless another could not finish its move without it:
//! then nobody took the shrink, which is abandoned, and the job recovers without it from
//! the membership before (see [`Ctl::left_behind`]).
//!
//! The job also ends when it cannot recover: no survivor left, a failure while a
//! change's data moves in the background, a process that could not finish a shrink's
//! switch because one that left in it ended badly when the shrink could not be
//! abandoned, or survivors that do not reach a checkpoint within the wait timeout.

use super::{Ctl, Ending, OnFailure};
use crate::proto::ToAgent;
use ductile::bootstrap::{CheckpointMode, Failure, ToRank};
use ductile_transport::{NodeId, Rank};
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// How long after processes leaving in a shrink end badly, before the shrink has
/// switched, the others are told they are gone. A process that heard from them sees
/// their connection end by itself, after the last bytes they sent; the notice is for
/// those that never heard from them, which would wait for them until the switch's
/// timeout. Meanwhile what they sent before they ended arrives, so that the notice
/// fails no receive that was to get it.
const GONE_GRACE: Duration = Duration::from_secs(2);

/// How long after processes leaving in a shrink end badly, before it has switched, the
/// processes whose move is done are told to take it, unless every process of the change
/// has said so before. Meanwhile a process whose move is not done (the leavers' data was
/// for it) says so, at the latest once it is told they are gone ([`GONE_GRACE`]), and
/// the change is abandoned instead (see [`Ctl::left_behind`]).
const SETTLE_AFTER: Duration = Duration::from_secs(4);

/// Processes that left badly in a shrink that had not switched (`--on-failure shrink`).
pub struct LeftBadly {
    /// How the job ends if it cannot go on without them.
    ending: Ending,
    /// The epoch the shrink switches to.
    epoch: u64,
    /// The processes, and why they ended.
    ids: Vec<Rank>,
    why: Vec<String>,
    /// Nodes lost with their agents, with processes among them.
    lost: Vec<NodeId>,
    /// [`SETTLE_AFTER`] has passed: a process whose move is done takes the change at once.
    settled: bool,
}

/// A survivor's word that it is ready to recover ([`ductile::bootstrap::FromRank::Recover`]).
#[derive(Clone, Copy, Debug)]
pub struct Ready {
    pub id: Rank,
    /// Its epoch.
    pub epoch: u64,
    /// Its checkpoint count.
    pub count: u64,
    /// Whether its data is still its epoch's, whole.
    pub intact: bool,
    /// Its move in the change switching is done and it waits to take the change or
    /// leave it: it is ready at either epoch.
    pub moved: bool,
}

/// Whether a recovery asked the leavers of the change switching where they are.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Asked {
    No,
    /// Their answers are awaited.
    Waiting,
    /// [`GONE_GRACE`] has passed since.
    Expired,
}

/// A recovery waiting for its survivors.
pub struct Recovering {
    /// The epoch the survivors recover from: the failures', or the one before it once
    /// the change switching to it was abandoned.
    epoch: u64,
    /// The change switching when the failures came was abandoned.
    abandoned: bool,
    /// Survivors that said they are ready at `epoch`.
    ready: HashSet<Rank>,
    /// Those among them whose move in the change switching is done, waiting to take it
    /// ([`ToRank::Settled`]) or leave it.
    moved: HashSet<Rank>,
    /// A process of the membership before that change took it: it cannot be abandoned.
    committed: bool,
    /// Whether the change's leavers not heard from were asked where they are (see
    /// [`Ctl::ask_leavers`]).
    asked: Asked,
    /// The failed processes, in the order they failed.
    failed: Vec<Rank>,
    /// Why, one entry per failure.
    why: Vec<String>,
    /// How the job ends if it cannot recover: as the first failure would have ended it.
    first: Ending,
    /// Nodes lost with their agents.
    lost_nodes: Vec<NodeId>,
    /// Survivors that have not yet said they are ready.
    waiting: HashSet<Rank>,
    /// The highest checkpoint count the survivors reported.
    count: u64,
    /// When the job ends unless every survivor is ready.
    pub deadline: Instant,
    /// When the first failure was seen.
    t_start: Instant,
}

impl Ctl {
    /// Processes `ids` failed (`why`; with their node `lost`, if the node was lost).
    /// With `--on-failure shrink` the job recovers without them, and this returns true.
    /// Otherwise the job ends: as `ending` says, or as the first failure of a recovery
    /// under way would have ended it.
    pub(super) async fn on_failure(&mut self, ids: &[Rank], why: String, lost: Option<NodeId>, ending: Ending) -> bool {
        match self.cannot_recover(ids) {
            Some(reason) => {
                if self.spec.on_failure == OnFailure::Shrink && self.ending.is_none() {
                    crate::say_errln!("ductile: {why}; the job cannot recover: {reason}");
                }
                self.give_up(ending);
                false
            }
            None => {
                self.recover_from(ids, why, lost, ending).await;
                true
            }
        }
    }

    /// A process leaving in the shrink under way ended badly (`--on-failure shrink`): it
    /// was leaving anyway. Its data was handed over before it could leave, or a process
    /// that needed it fails its switch, which ends the job (see [`Ctl::left_behind`]).
    pub(super) async fn leaving_ends(&mut self, id: Rank, who: String, node: NodeId, exit: crate::proto::Exit) {
        crate::say_errln!("ductile: {who}, leaving in a shrink, {exit}; it was leaving anyway (--on-failure shrink)");
        let ending = Ending::Rank(format!("{who}, while leaving in a shrink,"), node, exit);
        self.left_badly(vec![id], (format!("{who}, leaving in a shrink, {exit}"), None), ending).await;
    }

    /// Processes `ids`, leaving in the shrink under way, ended badly (`why`, with their
    /// node if it was `lost`; `ending` if the job ends for it). If the shrink has not
    /// switched yet, the others are told after [`GONE_GRACE`], so that none waits for
    /// them (see `reconfig::Ctl::tell_gone`); the processes that already failed their
    /// switch for them (they said they were ready to recover before the controller knew
    /// of any failure) are dealt with now.
    pub(super) async fn left_badly(&mut self, ids: Vec<Rank>, (why, lost): (String, Option<NodeId>), ending: Ending) {
        let epoch = self.state.epoch;
        match self.left_badly.as_mut().filter(|l| l.epoch == epoch) {
            Some(l) => {
                for &r in &ids {
                    if !l.ids.contains(&r) {
                        l.ids.push(r);
                    }
                }
                l.why.push(why.clone());
                l.lost.extend(lost);
            }
            None => {
                let why = vec![why.clone()];
                let lost = lost.into_iter().collect();
                self.left_badly = Some(LeftBadly { ending, epoch, ids: ids.clone(), why, lost, settled: false });
                let events = self.events.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(SETTLE_AFTER).await;
                    let _ = events.send(super::Event::Settle { epoch });
                });
            }
        }
        self.announce_gone(ids, why);
        let stale: Vec<Ready> = self.early_ready.iter().filter(|e| e.epoch < epoch).copied().collect();
        // One whose move is not done decides for all (see `left_behind`).
        let (mut first, rest): (Vec<Ready>, Vec<Ready>) = stale.into_iter().partition(|e| !e.moved);
        first.extend(rest);
        for e in first {
            if self.left_behind(e).await && (self.ending.is_some() || self.recovering.is_some()) {
                return;
            }
        }
        self.settle_held(epoch, false).await;
    }

    /// Tells the processes of the shrink under way, after [`GONE_GRACE`], that `ids` are
    /// gone (`why`), if it has not switched by then (see `reconfig::Ctl::tell_gone`).
    fn announce_gone(&self, ids: Vec<Rank>, why: String) {
        if let Some(seq) = self.flight.as_ref().filter(|f| f.switching()).map(super::InFlight::seq) {
            let events = self.events.clone();
            tokio::spawn(async move {
                tokio::time::sleep(GONE_GRACE).await;
                let _ = events.send(super::Event::Gone { seq, ids, why });
            });
        }
    }

    /// Process `e.id` says it is ready to recover at `e.epoch` while the controller
    /// knows of no failure. If processes left badly in a shrink to a later epoch, `id`
    /// failed its switch to that epoch, or an earlier one, for them. True if so; false if
    /// `id` waits for a failure the controller has not heard of yet.
    ///
    /// - Its move was not done, its data of the epoch before is whole, and the shrink may
    ///   be abandoned (it is a change in the foreground; see [`Ctl::may_abandon`]): the
    ///   change's last collective completed nowhere, and nobody took it. The processes
    ///   that left badly are failures then: the change is abandoned, and the job
    ///   recovers without them from the membership before it ([`Ctl::recover_from_leavers`]).
    ///   Their old blocks are lost; those of the others, leavers too, are whole.
    /// - Its move was done (`moved`: the change's last collective lost the leavers): it
    ///   takes the change ([`ToRank::Settled`]), as they were leaving anyway, once no
    ///   process that is still moving can say so: when every process of the change still
    ///   running has said its move was done, or [`SETTLE_AFTER`] after they left (see
    ///   [`Ctl::settle_held`]). Meanwhile it waits.
    /// - Otherwise no recovery can follow, as from any failure while processes switch.
    ///   A process that stays then ends the job, as the one that left would have ended
    ///   it without `--on-failure shrink`; one that was leaving too is ended now
    ///   (nothing waits for it to finish, and a process that stays and waited on it
    ///   then fails in turn).
    ///
    /// Before, every such process waited for a recovery that never came, and the
    /// processes blocked on it with it, until their timeout (`ductile run --timeout`, or
    /// the wait timeout of a switch): a process killed as it left, in one shrink out of a
    /// few, hung the job. Later, the job ended: every shrink whose leaver died before its
    /// data was handed over.
    async fn left_behind(&mut self, e: Ready) -> bool {
        let Some(l) = self.left_badly.as_ref().filter(|l| e.epoch < l.epoch) else { return false };
        let (to, settled) = (l.epoch, l.settled);
        let id = e.id;
        self.early_ready.retain(|x| x.id != id);
        if !e.moved && e.intact && e.epoch + 1 == to && self.recovering.is_none() && self.may_abandon() {
            self.early_ready.push(e);
            self.recover_from_leavers().await;
            return true;
        }
        if e.moved && e.epoch + 1 == to {
            if settled || !self.may_abandon() {
                tracing::debug!("{id}'s move to epoch {to} was done when processes left badly: it takes the change");
                if let Some(&a) = self.host.get(&id) {
                    self.send(a, &ToAgent::ToRank(id, ToRank::Settled { epoch: to })).await;
                }
            } else {
                tracing::debug!("{id}'s move to epoch {to} was done when processes left badly: it waits");
                self.early_ready.push(e);
                self.settle_held(to, false).await;
            }
            return true;
        }
        if self.is_releasing(id) {
            // Its end is ours, no failure: the others that wait on it are told as of
            // one that left badly.
            if self.end_leaving(id).await {
                self.announce_gone(vec![id], format!("{}, leaving in a shrink, could not finish it", self.who(id)));
            }
            return true;
        }
        crate::say_errln!(
            "ductile: {} could not switch to epoch {to} without the processes that left; the job cannot recover",
            self.who(id)
        );
        if let Some(l) = self.left_badly.take() {
            self.give_up(l.ending);
        }
        true
    }

    /// The processes whose move in the shrink to `epoch` was done when processes leaving
    /// in it ended badly take it ([`ToRank::Settled`]): when [`SETTLE_AFTER`] has passed
    /// (`due`), or every process of the change still running is among them, so none can
    /// say its move was not done.
    pub(super) async fn settle_held(&mut self, epoch: u64, due: bool) {
        let Some(l) = self.left_badly.as_mut().filter(|l| l.epoch == epoch) else { return };
        let held = |e: &Ready| e.moved && e.epoch + 1 == epoch;
        let running = |x: &Rank| self.agents.iter().any(|a| a.live.contains(x));
        let all = self.flight.as_ref().is_some_and(|f| {
            let members = f.members_before().iter().chain(self.state.ranks.iter());
            members.filter(|x| running(x)).all(|x| self.early_ready.iter().any(|e| e.id == *x && held(e)))
        });
        if !due && !all {
            return;
        }
        l.settled = true;
        let (now, later): (Vec<Ready>, Vec<Ready>) = self.early_ready.drain(..).partition(held);
        self.early_ready = later;
        for e in now {
            tracing::debug!("{}'s move to epoch {epoch} was done when processes left badly: it takes the change", e.id);
            if let Some(&a) = self.host.get(&e.id) {
                self.send(a, &ToAgent::ToRank(e.id, ToRank::Settled { epoch })).await;
            }
        }
    }

    /// Processes that left badly in the shrink switching are failures after all: a
    /// process whose move was not done said so, so nobody took the shrink, and it is
    /// abandoned (see [`Ctl::left_behind`]). The job recovers without them from the
    /// membership before it.
    async fn recover_from_leavers(&mut self) {
        let Some(l) = self.left_badly.take() else { return };
        let why = l.why.join("; ");
        tracing::info!("{why}: the shrink under way cannot finish; it is abandoned");
        self.begin_recovery(&l.ids, l.ending);
        let Some(r) = self.recovering.as_mut() else { return };
        for &x in &l.ids {
            if !r.failed.contains(&x) {
                r.failed.push(x);
            }
        }
        r.why.push(why);
        r.lost_nodes.extend(l.lost);
        let early = std::mem::take(&mut self.early_ready);
        self.take_early(early).await;
    }

    /// Why the job cannot recover from the failure of `ids`, if it cannot.
    fn cannot_recover(&self, ids: &[Rank]) -> Option<String> {
        if self.spec.on_failure != OnFailure::Shrink {
            return Some("--on-failure abort".into());
        }
        if self.ending.is_some() || self.failed.is_some() {
            return Some("the job is ending already".into());
        }
        if !self.fenced {
            return Some("the job had not started yet".into());
        }
        // A switch in the foreground is recovered from at its epoch (see the module's
        // doc); one whose data moves in the background is not (its ranks refuse).
        if self.flight.as_ref().is_some_and(|f| f.switching() && f.in_background()) {
            return Some("another change was under way in the background".into());
        }
        if !ids.iter().any(|r| self.state.ranks.contains(r)) {
            return Some("the processes were not in the job's group".into());
        }
        // A survivor ready at the epoch before a switching change's, its data intact, is
        // what an abandoned change recovers with.
        let abandons = |e: &&Ready| e.intact && e.epoch + 1 == self.state.epoch && self.may_abandon();
        let stale = self.early_ready.iter().find(|e| e.epoch < self.state.epoch && !abandons(e));
        if let Some(e) = stale {
            let (who, epoch) = (self.who(e.id), e.epoch);
            return Some(format!("{who} was still at epoch {epoch} (the job is at {})", self.state.epoch));
        }
        let failed = self.recovering.as_ref().map_or(&[][..], |r| &r.failed[..]);
        if self.survivors(failed, ids).is_empty() {
            return Some("no process is left to go on".into());
        }
        None
    }

    /// The processes that can recover: in the group, running, not finalized, and not
    /// among `failed` or `also`.
    fn survivors(&self, failed: &[Rank], also: &[Rank]) -> Vec<Rank> {
        let running = |r: &Rank| self.agents.iter().any(|a| a.live.contains(r));
        self.state
            .ranks
            .iter()
            .copied()
            .filter(|r| !failed.contains(r) && !also.contains(r) && running(r) && !self.finalized.contains(r))
            .collect()
    }

    /// Ends the job as the first failure of the recovery under way would have (or as
    /// `ending` says, without one).
    fn give_up(&mut self, ending: Ending) {
        let first = self.recovering.take().map(|r| r.first);
        self.ending.get_or_insert(first.unwrap_or(ending));
    }

    /// The failure the job had not recovered from when it ended, if any.
    pub(super) fn unrecovered(&mut self) -> Option<Ending> {
        self.recovering.take().map(|r| r.first)
    }

    /// Starts a recovery from the failure of `members` (`ending`: how the job ends if
    /// it cannot recover), unless one is under way.
    fn begin_recovery(&mut self, members: &[Rank], ending: Ending) {
        if self.recovering.is_some() {
            return;
        }
        let events = self.events.clone();
        let epoch = self.state.epoch;
        tokio::spawn(async move {
            tokio::time::sleep(GONE_GRACE).await;
            let _ = events.send(super::Event::Unstick { epoch });
        });
        let waiting = self.survivors(members, &[]).into_iter().collect();
        self.recovering = Some(Recovering {
            epoch: self.state.epoch,
            abandoned: false,
            ready: HashSet::new(),
            moved: HashSet::new(),
            committed: false,
            asked: Asked::No,
            failed: Vec::new(),
            why: Vec::new(),
            first: ending,
            lost_nodes: Vec::new(),
            waiting,
            count: 0,
            deadline: Instant::now() + self.wait_timeout,
            t_start: Instant::now(),
        });
    }

    async fn recover_from(&mut self, ids: &[Rank], why: String, lost: Option<NodeId>, ending: Ending) {
        let members: Vec<Rank> = ids.iter().copied().filter(|r| self.state.ranks.contains(r)).collect();
        self.begin_recovery(&members, ending);
        let Some(r) = self.recovering.as_mut() else { return };
        // Survivors whose transports saw the failure before this controller did (those
        // ready at the epoch before, if any, are taken once the failure is known).
        let early = std::mem::take(&mut self.early_ready);
        let took = |e: &Ready| !e.moved && self.flight.as_ref().is_some_and(|f| f.switching() && f.was_member(e.id));
        let (current, before): (Vec<Ready>, Vec<Ready>) = early.into_iter().partition(|e| e.epoch == r.epoch);
        for e in &current {
            // One of the old membership at the new epoch took the change.
            r.committed |= took(e) && e.epoch == self.state.epoch;
            r.waiting.remove(&e.id);
            r.ready.insert(e.id);
            r.count = r.count.max(e.count);
        }
        for m in &members {
            if !r.failed.contains(m) {
                r.failed.push(*m);
            }
            r.waiting.remove(m);
        }
        r.why.push(why.clone());
        r.lost_nodes.extend(lost);
        let epoch = r.epoch;
        let failed = r.failed.clone();
        let survivors = self.survivors(&failed, &[]);
        let nodes: HashSet<NodeId> = self
            .state
            .ranks
            .iter()
            .zip(&self.state.nodes)
            .filter(|(s, _)| survivors.contains(s))
            .map(|x| *x.1)
            .collect();
        let (n, k) = (survivors.len(), nodes.len());
        let (ps, ns) = (if n == 1 { "" } else { "es" }, if k == 1 { "" } else { "s" });
        crate::say_errln!(
            "ductile: {why}; the job goes on without it: {n} process{ps} on {k} node{ns} (--on-failure shrink)"
        );
        let why_first = why.clone();
        // Processes of a change still switching that wait on the failed ones are not
        // interrupted by the notice (it spares the change's waits): they are told the
        // failed processes are gone, and then fail their switch.
        self.announce_gone(members.clone(), why.clone());
        let notice = ToRank::Failure(Failure { epoch, failed: members, why });
        for s in survivors {
            if let Some(&a) = self.host.get(&s) {
                self.send(a, &ToAgent::ToRank(s, notice.clone())).await;
            }
        }
        if self.flight.as_ref().is_some_and(super::reconfig::InFlight::spawning) {
            // A growth still starting: the old processes have not heard of it. It is
            // abandoned, and the recovery follows once its node worlds are ended.
            self.fail_growth(format!("{why_first} meanwhile")).await;
        }
        self.take_early(before).await;
    }

    /// The reports of survivors ready at the epoch before the recovery's, which came
    /// before it began (others are dropped): one whose move was not done abandons the
    /// change switching, if it may be, and the others then count as the rest will. Those
    /// whose move was not done go first, so that none whose move was done, counted
    /// first, completes the recovery in the change's membership.
    async fn take_early(&mut self, early: Vec<Ready>) {
        let Some(epoch) = self.recovering.as_ref().map(|r| r.epoch) else { return };
        let (mut first, rest): (Vec<Ready>, Vec<Ready>) =
            early.into_iter().filter(|e| e.epoch + 1 == epoch).partition(|e| !e.moved);
        first.extend(rest);
        for e in first {
            if self.recovering.is_some() {
                Box::pin(self.on_recover(e)).await;
            }
        }
        self.recovered_all().await;
    }

    /// A survivor is ready to recover (`e`: at its epoch and checkpoint count).
    pub(super) async fn on_recover(&mut self, e: Ready) {
        let Ready { id, epoch, count, intact, moved } = e;
        // Ready at the epoch before, its move not done, while no process of the old
        // membership took the change (processes new in it may have: they end with it).
        let behind = |r: &Recovering| epoch + 1 == r.epoch && !r.committed;
        if !moved && intact && self.recovering.as_ref().is_some_and(behind) && self.may_abandon() {
            // Its move is not done, so the change's last collective completed nowhere:
            // nobody can have committed to it, and the survivors' data is whole.
            let because = format!("before {} had finished its move", self.who(id));
            self.abandon_change(&because).await;
        }
        let switched_away = self.flight.as_ref().is_some_and(|f| !f.switching() && f.is_leaving(id));
        if !moved && switched_away {
            // It leaves in a change that switched without it noticing: it is ended with
            // the others that do not leave in time.
            tracing::debug!("{id}, leaving in a change that has switched, is ready to recover; ignored");
            return;
        }
        if self.recovering.as_ref().is_some_and(|r| r.abandoned) && !self.state.ranks.contains(&id) {
            // A process new in the change abandoned, which took it: its agent ends it.
            tracing::debug!("{id}, new in an abandoned change, is ready to recover; ignored");
            return;
        }
        // One whose move is done holds both layouts: it is ready at either epoch. If the
        // change has switched already, it takes it at once.
        let switching = self.flight.as_ref().is_some_and(super::InFlight::switching);
        let epoch = match self.recovering.as_mut() {
            Some(r) if moved && r.epoch == epoch + 1 && !switching => {
                if let Some(&a) = self.host.get(&id) {
                    self.send(a, &ToAgent::ToRank(id, ToRank::Settled { epoch: epoch + 1 })).await;
                }
                epoch + 1
            }
            Some(r) if moved && (r.epoch == epoch + 1 || r.epoch == epoch) => {
                r.moved.insert(id);
                r.epoch
            }
            _ => epoch,
        };
        match self.recovering.as_mut() {
            Some(r) if r.epoch == epoch && r.abandoned && !intact => {
                let why = format!("{} had not kept its data whole in the switch to epoch {}", self.who(id), epoch + 1);
                crate::say_errln!("ductile: the job cannot recover: {why}");
                self.give_up(Ending::Reconfig(why));
            }
            Some(r) if r.epoch == epoch => {
                if !moved && self.flight.as_ref().is_some_and(|f| f.switching() && f.was_member(id)) {
                    r.committed |= epoch == self.state.epoch;
                }
                r.waiting.remove(&id);
                r.ready.insert(id);
                r.count = r.count.max(count);
                self.recovered_all().await;
            }
            Some(r) => {
                // It failed in an earlier epoch (still switching when the others had):
                // it cannot take part.
                let theirs = r.epoch;
                let why = format!(
                    "{} was ready to recover at epoch {epoch}, the others at {theirs} (it could not finish the \
                     switch to {theirs})",
                    self.who(id)
                );
                crate::say_errln!("ductile: the job cannot recover: {why}");
                self.give_up(Ending::Reconfig(why));
            }
            None => {
                if self.left_behind(e).await {
                    return;
                }
                // Its transport saw a peer fail before the peer's agent said so: kept for
                // the recovery to come (a false alarm leaves it waiting, within its
                // timeout; meanwhile no change starts).
                tracing::debug!("{id} is ready to recover at epoch {epoch} before a failure is known there");
                self.early_ready.retain(|x| x.id != id);
                self.early_ready.push(e);
            }
        }
    }

    /// [`GONE_GRACE`] after the failures of `epoch`, the survivors still not ready to
    /// recover from them are told again, as of the epoch before: that notice interrupts
    /// the receives of a switch to `epoch` too, which the first one spared. A survivor
    /// still there may wait on one that left the change's last collective since (it lost
    /// a process, and each process whose move was done stopped there: see
    /// `Session::complete_change`), or on one stuck in turn; interrupted, each is ready
    /// with its move done (`moved`), or at the epoch before with it not done.
    pub(super) async fn unstick(&mut self, epoch: u64) {
        let Some(r) = self.recovering.as_ref().filter(|r| r.epoch == epoch && !r.waiting.is_empty()) else {
            return;
        };
        let (failed, why) = (r.failed.clone(), r.why.join("; "));
        let stuck: Vec<Rank> = r.waiting.iter().copied().collect();
        tracing::info!(
            "survivors {stuck:?} are not ready to recover yet: their waits in a switch to epoch {epoch} end"
        );
        let notice = ToRank::Failure(Failure { epoch: epoch.saturating_sub(1), failed, why });
        for s in stuck {
            if let Some(&a) = self.host.get(&s) {
                self.send(a, &ToAgent::ToRank(s, notice.clone())).await;
            }
        }
    }

    /// Whether every survivor finished its move in the change switching but none took
    /// it (each holds its old blocks and its new ones), and going back to the membership
    /// before it loses less data: the old blocks of the failed processes that were in it,
    /// rather than the new blocks of those that would be in the new one. Blocks are of
    /// equal size in each layout, so the shares are counted: in a growth 2 -> 4, a new
    /// process failing loses nothing if the growth is abandoned, a quarter if it is not;
    /// an old one fails: half, against a quarter (and against three quarters if the new
    /// processes, which could not finish without it, failed too).
    ///
    /// A leaver not heard from may have taken the change and gone, its old blocks with
    /// it: then the change is followed, unless `unheard_moved` (what it would lose if
    /// those leavers are heard from, moved).
    fn abandon_loses_less(&self, unheard_moved: bool) -> bool {
        let (Some(r), Some(f)) = (self.recovering.as_ref(), self.flight.as_ref()) else { return false };
        if r.committed || !self.may_abandon() {
            return false;
        }
        let running = |x: &Rank| self.agents.iter().any(|a| a.live.contains(x));
        let failed = |x: &&Rank| r.failed.contains(x) || !running(x);
        if !unheard_moved && f.leavers().iter().any(|l| !failed(&l) && !r.moved.contains(l)) {
            return false;
        }
        let (old, new) = (f.members_before(), &self.state.ranks);
        let (lost_old, lost_new) = (old.iter().filter(failed).count(), new.iter().filter(failed).count());
        lost_old * new.len() < lost_new * old.len()
    }

    /// Every survivor finished its move in the change switching, and abandoning it would
    /// lose less data, but leavers of the change that still run have not been heard
    /// from: each may wait in the change's last collective, or have taken it, and then
    /// its old blocks are gone. They are asked once: the notice of the failure, as of the
    /// epoch before, ends their waits in the switch, and each says it is ready, its move
    /// done (or not: the change is abandoned then). Until each has, or [`GONE_GRACE`] has
    /// passed (those that took the change then count as failed, if they have ended, or
    /// the change is followed), the recovery waits. True if it waits.
    ///
    /// Before, the change was followed at once: a stayer of a shrink 4 -> 2 failing in
    /// its move lost half the data, where abandoning lost a quarter.
    async fn ask_leavers(&mut self) -> bool {
        let (Some(r), Some(f)) = (self.recovering.as_ref(), self.flight.as_ref()) else { return false };
        let running = |x: &Rank| self.agents.iter().any(|a| a.live.contains(x));
        let unheard: Vec<Rank> =
            f.leavers().into_iter().filter(|l| !r.failed.contains(l) && running(l) && !r.moved.contains(l)).collect();
        if unheard.is_empty() || r.asked == Asked::Expired || !self.abandon_loses_less(true) {
            return false;
        }
        if r.asked == Asked::Waiting {
            return true;
        }
        let notice = ToRank::Failure(Failure {
            epoch: r.epoch.saturating_sub(1),
            failed: r.failed.clone(),
            why: r.why.join("; "),
        });
        let epoch = r.epoch;
        tracing::info!("leavers {unheard:?} of the change to epoch {epoch} are asked where they are");
        for l in unheard {
            if let Some(&a) = self.host.get(&l) {
                self.send(a, &ToAgent::ToRank(l, notice.clone())).await;
            }
        }
        if let Some(r) = self.recovering.as_mut() {
            r.asked = Asked::Waiting;
        }
        let events = self.events.clone();
        tokio::spawn(async move {
            tokio::time::sleep(GONE_GRACE).await;
            let _ = events.send(super::Event::Asked { epoch });
        });
        true
    }

    /// [`GONE_GRACE`] after the recovery at `epoch` asked leavers where they are: it
    /// decides without those not heard from.
    pub(super) async fn asked_expired(&mut self, epoch: u64) {
        let Some(r) = self.recovering.as_mut().filter(|r| r.epoch == epoch && r.asked == Asked::Waiting) else {
            return;
        };
        r.asked = Asked::Expired;
        self.recovered_all().await;
    }

    /// Whether the change under way may be abandoned for a recovery at the epoch before
    /// it: one switching in the foreground that is not itself a recovery.
    fn may_abandon(&self) -> bool {
        self.flight.as_ref().is_some_and(|f| f.switching() && !f.in_background() && !f.is_recovery())
    }

    /// Abandons the change switching, which nobody took (`because` says how that is
    /// known): the job's membership is the one before it again (under
    /// the change's epoch and number, which are taken: the recovery gets the next, so
    /// none of the change's messages meets it), its new node worlds end (their
    /// processes' exits are no failures), and every survivor recovers from the old
    /// epoch. Those still in the switch are told at once (a failure notice of the old
    /// epoch interrupts the switch's waits): none can finish it now.
    async fn abandon_change(&mut self, because: &str) {
        let Some(f) = self.flight.take() else { return };
        let seq = f.seq();
        for &a in f.new_agents() {
            self.agents[a].abandoned = true;
            if self.agents[a].tx.is_none() {
                self.agents[a].done = true;
            }
        }
        for &a in f.new_agents() {
            if !self.agents[a].done {
                self.send(a, &ToAgent::Abort).await;
            }
        }
        let burned = std::mem::replace(&mut self.state, f.prev.clone());
        self.state.epoch = burned.epoch;
        self.state.changes = burned.changes;
        if burned.addrs.len() > self.state.addrs.len() {
            // The new processes' ids stay taken, blank: they left the job.
            self.state.addrs.resize(burned.addrs.len(), ductile_transport::EndpointAddr(String::new()));
        }
        let old_epoch = f.prev.epoch;
        let Some(r) = self.recovering.as_mut() else { return };
        let why = r.why.join("; ");
        let what = format!("resize {seq} was abandoned in its switch to epoch {}: {why}, {because}", burned.epoch);
        crate::say_errln!("ductile: {what}; the job recovers as it was before it (epoch {old_epoch})");
        if f.is_growth() {
            self.failed_growths.push(format!("resize {seq}: failed during its switch: {why}"));
        }
        f.fail(&format!("{what}; the job goes on as it was, without the failed processes"));
        r.epoch = old_epoch;
        r.abandoned = true;
        let failed = r.failed.clone();
        let survivors = self.survivors(&failed, &[]);
        if let Some(r) = self.recovering.as_mut() {
            // Those whose move was done are ready at the old epoch as they were at the new.
            r.waiting = survivors.iter().copied().filter(|s| !r.moved.contains(s)).collect();
            r.ready.retain(|s| r.moved.contains(s));
        }
        // Its rank 0's next checkpoint is moot: it recovers instead.
        self.deferred = None;
        // The new processes are ended: whatever waits on them, a dial over quic among
        // others, fails as on a process that is gone.
        let new: Vec<Rank> = burned.ranks.iter().copied().filter(|x| !self.state.ranks.contains(x)).collect();
        let gone =
            ToRank::Gone(Failure { epoch: old_epoch, failed: new.clone(), why: format!("resize {seq} was abandoned") });
        let notice = ToRank::Failure(Failure { epoch: old_epoch, failed, why });
        for s in survivors {
            if let Some(&a) = self.host.get(&s) {
                if !new.is_empty() {
                    self.send(a, &ToAgent::ToRank(s, gone.clone())).await;
                }
                self.send(a, &ToAgent::ToRank(s, notice.clone())).await;
            }
        }
    }

    /// Process `id` finalized: it takes part in no recovery. One that a recovery under
    /// way waits for ends the job.
    pub(super) fn on_finalized(&mut self, id: Rank) {
        self.finalized.insert(id);
        if self.recovering.as_ref().is_some_and(|r| r.waiting.contains(&id)) {
            crate::say_errln!("ductile: {} finalized instead of recovering; the job cannot recover", self.who(id));
            let first = self.unrecovered();
            self.ending.get_or_insert_with(|| first.unwrap_or(Ending::Reconfig("a recovery failed".into())));
        }
    }

    /// Once every survivor is ready, and no change is under way: sends them the change
    /// that leaves the failed processes out.
    pub(super) async fn recovered_all(&mut self) {
        let epoch = self.state.epoch;
        let all_at_it = self.recovering.as_ref().is_some_and(|r| r.waiting.is_empty() && r.epoch == epoch);
        if all_at_it && self.flight.as_ref().is_some_and(super::InFlight::switching) {
            // Every survivor took the change's membership or finished its move (see the
            // module's doc): unless it is abandoned now, it switched, even if its report
            // never comes (its new rank 0 failed) or is still on its way. The change
            // completes, then the recovery.
            if self.ask_leavers().await {
                return;
            }
            if self.abandon_loses_less(false) {
                // Nobody took the change: it is abandoned, as it loses less data so.
                self.abandon_change("no process had taken it yet, and the job loses less data without it").await;
                return Box::pin(self.recovered_all()).await;
            }
            tracing::info!("every survivor is at epoch {epoch}: the change under way has switched");
            // Those waiting to take it take it now, the leavers among them leave.
            let moved: Vec<Rank> = self.recovering.as_mut().map(|r| r.moved.drain().collect()).unwrap_or_default();
            for &m in &moved {
                if let Some(&a) = self.host.get(&m) {
                    self.send(a, &ToAgent::ToRank(m, ToRank::Settled { epoch })).await;
                }
            }
            // Leavers not heard from yet may wait in the change's last collective, which
            // the others left: their waits in the switch end, and they take it too.
            let leaving: Vec<Rank> = self.flight.as_ref().map(super::InFlight::leavers).unwrap_or_default();
            if let Some(r) = self.recovering.as_ref() {
                let notice = ToRank::Failure(Failure {
                    epoch: epoch.saturating_sub(1),
                    failed: r.failed.clone(),
                    why: r.why.join("; "),
                });
                for l in leaving.into_iter().filter(|l| !moved.contains(l)) {
                    if let Some(&a) = self.host.get(&l) {
                        self.send(a, &ToAgent::ToRank(l, notice.clone())).await;
                    }
                }
            }
            return Box::pin(self.on_switched(epoch, ductile::bootstrap::SwitchTimes::default())).await;
        }
        if self.flight.is_some() {
            // A shrink releasing its processes, or a growth being abandoned: the
            // recovery follows when it is done.
            return;
        }
        let Some(mut r) = self.recovering.take_if(|r| r.waiting.is_empty()) else { return };
        // Processes of the group that ended or finalized meanwhile take no part either.
        let survivors = self.survivors(&r.failed, &[]);
        if survivors.is_empty() {
            crate::say_errln!("ductile: the job cannot recover: no process is left to go on");
            return self.give_up(r.first);
        }
        let gone: Vec<Rank> = self.state.ranks.iter().copied().filter(|x| !survivors.contains(x)).collect();
        for g in gone {
            if !r.failed.contains(&g) {
                r.failed.push(g);
            }
        }
        let (mut change, next) = self.state.after_failure(&r.failed, &r.lost_nodes);
        change.checkpoint = r.count;
        let root = change.after.ranks[0];
        let Some(&agent) = self.host.get(&root) else {
            self.ending = Some(Ending::Reconfig(format!("recovery: no agent hosts {root}")));
            return;
        };
        let mut f = self.in_flight("failure", (agent, root), (CheckpointMode::Blocking, r.count), r.t_start);
        f.failed =
            (0..self.state.ranks.len() as u32).filter(|&o| r.failed.contains(&self.state.ranks[o as usize])).collect();
        f.released_nodes = self.state.join_order.iter().filter(|n| !next.join_order.contains(n)).map(|n| n.0).collect();
        self.state = next;
        self.flight = Some(f);
        self.switch(change).await;
    }

    /// What `ductile status` says of a recovery under way.
    pub(super) fn recovery_status(&self) -> Option<String> {
        let r = self.recovering.as_ref()?;
        let failed: Vec<String> = r.failed.iter().map(|id| format!("endpoint {}", id.0)).collect();
        Some(format!(
            "recovering from the failure of {} ({} survivors not ready yet)",
            failed.join(", "),
            r.waiting.len()
        ))
    }

    /// Ends the job if survivors did not get ready in time (a change that holds the
    /// recovery back has deadlines of its own).
    pub(super) fn recovery_deadline(&mut self) {
        let due = |r: &&Recovering| Instant::now() >= r.deadline && !r.waiting.is_empty();
        let Some(r) = self.recovering.as_ref().filter(due) else { return };
        let mut late: Vec<String> = r.waiting.iter().map(|id| self.who(*id)).collect();
        late.sort();
        self.ending = Some(Ending::Reconfig(format!(
            "recovering from {}: {} did not reach a checkpoint within {:?}",
            r.why.join("; "),
            late.join(", "),
            self.wait_timeout
        )));
    }
}
