//! Recovery: with `ductile run --on-failure shrink`, a failed process is a shrink the
//! job did not ask for.
//!
//! The controller learns of the failure from the failed process's agent (its exit) or
//! from the loss of the agent itself (its node), and tells every other process
//! ([`crate::bootstrap::ToRank::Failure`]). Their waits are interrupted (see `control`),
//! the application's calls return errors, and each process, at its next checkpoint,
//! says it is ready to recover ([`FromRank::Recover`]). Once all have, the controller
//! sends each the same [`Change`]: the old ranks, the failed ones among them, and the
//! survivors as the new ranks in their old order. The survivors then move the registered
//! data as at any shrink, by point-to-point, except that nothing comes from a failed
//! process: what it held is lost, zero in the new blocks, and reported
//! ([`Recovery::lost`]) so that the application can rebuild it (from its own
//! checkpoint, or by starting that part of the computation again). Replicated items
//! come from the first survivor, so nothing of them is lost.
//!
//! A process interrupted in a change says whether its data is still that of its
//! epoch, whole (`intact` in [`FromRank::Recover`]): with `--on-failure shrink` a
//! blocking move keeps the old blocks until the change commits, so it is, wherever the
//! failure came. A process whose move was done when the change's last collective lost
//! a process has not committed either: it holds both layouts (`moved`). If some
//! survivor had not finished its move, no process can have committed (that collective
//! completes nowhere before every move is done), and the controller abandons the change:
//! the recovery starts from the membership before it, to the epoch after the abandoned
//! change's, every survivor with its old blocks back; queued messages of that change are
//! dropped, and its contexts are never used again. Its failed processes may then all be
//! new ones, named in the recovery but no old rank: nothing is lost. If every survivor
//! had finished its move, the controller either abandons the change all the same, if
//! nobody took it and that loses less data, or has those waiting take it
//! ([`ToRank::Settled`]), and the recovery starts from there.

use super::{background_context, control_err, micros, node_count, placement, transition_context};
use super::{Checkpoint, Resize, Session};
use crate::bootstrap::{self, Change, Decision, FromRank, SwitchTimes, ToRank};
use crate::error::{Error, Result};
use crate::group::{AsyncGroup, Group};
use crate::reduce::ReduceOp;
use crate::registry::Parts;
use ductile_transport::Rank;
use std::ops::Range;
use std::time::Instant;

/// What a [`Checkpoint::Recovered`] brings: the shrink, who failed, and what was lost.
#[derive(Clone)]
#[non_exhaustive]
pub struct Recovery {
    /// The shrink. Its `transition` group holds the old ranks at their old positions,
    /// the failed ones among them: only the survivors may be addressed.
    pub resize: Resize,
    /// The old ranks that failed.
    pub failed: Vec<usize>,
    /// Why, as the launcher saw it (`rank 2 on node 1 was killed by signal 9`).
    pub why: String,
    /// The global element ranges of distributed items that the failed processes held,
    /// by item name: zero in the new blocks.
    pub lost: Vec<(String, Range<u64>)>,
}

impl Session {
    /// Tells the controller that this process is ready to recover, waits for the change
    /// that leaves the failed processes out, and applies it.
    pub(super) fn recover(&mut self) -> Result<Checkpoint> {
        if self.moving.is_some() {
            return Err(Error::Reconfigure(
                "processes failed while registered data moved in the background; the job cannot recover".into(),
            ));
        }
        let (epoch, count, timeout) = (self.membership.epoch, self.count, self.timeout);
        let intact = self.moved_for.is_none() || self.keeping;
        let moved = self.staged.is_some();
        let Some(c) = self.control.as_mut() else {
            return Err(Error::Reconfigure("a process failed; only a launched job can recover".into()));
        };
        bootstrap::write_msg(c, &FromRank::Recover { epoch, count, intact, moved }).map_err(control_err)?;
        let deadline = Instant::now() + timeout;
        let change = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(w) = self.watcher.as_ref() else {
                return Err(Error::Reconfigure("a process failed; only a launched job can recover".into()));
            };
            let m = w.next(left).map_err(|e| Error::Reconfigure(format!("no recovery from the controller: {e}")))?;
            match m {
                ToRank::Decision(Decision::Change(c)) if !c.failed.is_empty() => break c,
                ToRank::Settled { epoch } if self.staged.as_ref().is_some_and(|s| s.c.after.epoch == epoch) => {
                    // The change switched: this process takes it, and then recovers from
                    // there, or leaves (nothing of it is needed in the recovery).
                    let Some(st) = self.staged.take() else { continue };
                    tracing::debug!("{}: the change to epoch {epoch} switched; taking it", self.endpoint.rank());
                    // Without a failure notice, the change's last collective lost only
                    // processes leaving in it, after their data came: nothing to recover
                    // from, and the change completes as any does (its new rank 0 says so).
                    let leavers_only = self.watcher.as_ref().is_some_and(|w| w.failure().is_none());
                    let cp = self.commit_change(st, leavers_only.then(|| vec![0; 3]))?;
                    if leavers_only || matches!(cp, Checkpoint::Released(_)) {
                        self.pending = false;
                        return Ok(cp);
                    }
                }
                // Answers sent before the failure was known, further failures, and the
                // word that a change this process did not finish moving for switched (a
                // leaver whose move was interrupted late: it is ended).
                ToRank::Decision(_) | ToRank::Failure(_) | ToRank::Settled { .. } => {}
                other => {
                    return Err(Error::Reconfigure(format!("expected the recovery from the controller, got {other:?}")))
                }
            }
        };
        if let Some(st) = self.staged.take_if(|st| change.before == st.c.after.ranks) {
            // The recovery follows the change, whose switch was not announced here.
            if let released @ Checkpoint::Released(_) = self.commit_change(st, None)? {
                return Ok(released);
            }
        }
        if self.keeping && change.before == self.membership.ranks {
            // The change this process was moving to, or had moved to, was abandoned: its
            // data is that of the old epoch again.
            tracing::debug!("{}: the change under way was abandoned; old blocks restored", self.endpoint.rank());
            self.staged = None;
            self.registry.restore();
            self.keeping = false;
        }
        let Some(w) = self.watcher.as_ref() else {
            return Err(Error::Reconfigure("a process failed; only a launched job can recover".into()));
        };
        let why = w.failure().map(|f| f.why).unwrap_or_default();
        w.recovered();
        // What the interrupted operations of this epoch left queued is for no one now,
        // nor what a change abandoned meanwhile left (the recovery then skips its epoch).
        // Also the world of a change taken here just now, which processes that took it
        // earlier may have used.
        let worlds = [super::world_context(epoch), super::world_context(self.membership.epoch)];
        let abandoned = epoch + 1..change.after.epoch;
        let stale = |c| worlds.contains(&c) || abandoned.clone().any(|e| super::change_contexts(e).contains(&c));
        self.endpoint.mailbox().resume(&stale);
        self.pending = false;
        self.apply_recovery(change, why)
    }

    /// Switches to the survivors of `c`, moving the registered data among them.
    fn apply_recovery(&mut self, c: Change, why: String) -> Result<Checkpoint> {
        let t0 = Instant::now();
        let me = self.endpoint.rank();
        let epoch = c.after.epoch;
        let survivors: Vec<Rank> = c.before.iter().copied().filter(|r| !c.failed.contains(r)).collect();
        if c.before != self.membership.ranks
            || epoch <= self.membership.epoch
            || c.after.ranks != survivors
            || c.after.nodes.len() != survivors.len()
        {
            return Err(Error::Reconfigure(format!(
                "the recovery to epoch {epoch} does not follow this process's membership (epoch {})",
                self.membership.epoch
            )));
        }
        let old_rank = c.before.iter().position(|r| *r == me);
        let (Some(old_rank), Some(new_rank)) = (old_rank, survivors.iter().position(|r| *r == me)) else {
            return Err(Error::Reconfigure(format!(
                "{me} is not among the survivors of the recovery to epoch {epoch}"
            )));
        };
        self.endpoint.transport().set_peers(&c.after.addrs)?;
        // A failed process may still run for a while (on a host cut off from the
        // launcher): nothing it sends is taken from now on.
        self.endpoint.mailbox().fence(&c.failed);
        let (place, handle) = (placement([&self.membership, &c.after]), self.handle()?);
        let group = |ctx, members: Vec<Rank>, pos| -> Result<Group> {
            let g = AsyncGroup::new(self.endpoint.clone(), ctx, members, pos, self.timeout)?.placed(place.clone());
            Ok(Group::new(g, handle.clone(), self.spin))
        };
        // The survivors agree on the registry; the data moves over the old positions.
        let alive = group(transition_context(epoch), survivors.clone(), new_rank)?;
        let transition = group(background_context(epoch), c.before.clone(), old_rank)?;
        if let Some(k) = self.agree_on_registry(&alive, false)? {
            return Err(Error::Reconfigure(format!(
                "the registered items of {} differ from the first survivor's; the recovery is abandoned",
                survivors.get(k).map_or_else(|| format!("survivor {k}"), ToString::to_string)
            )));
        }
        // Survivors may have failed in different checkpoints: the controller's count goes on.
        self.count = c.checkpoint;
        let connect = t0.elapsed();
        let new_pos: Vec<Option<u32>> =
            c.before.iter().map(|r| survivors.iter().position(|x| x == r).map(|p| p as u32)).collect();
        let failed: Vec<u32> = (0..c.before.len() as u32).filter(|&o| new_pos[o as usize].is_none()).collect();
        let parts = Parts { old_n: c.before.len() as u32, new_n: survivors.len() as u32 };
        let t1 = Instant::now();
        self.moved_for = Some(epoch);
        let registry = &mut self.registry;
        let lost = transition.block(registry.recover(transition.core_async(), parts, &new_pos, &failed))?;
        super::flush_move(&transition, &self.endpoint, epoch);
        let redistribute = t1.elapsed();
        let times = match alive.allreduce(&[micros(connect), micros(redistribute)], ReduceOp::Max) {
            Ok(times) => times,
            // Its data is whole in the new layout: it takes the new group, and recovers
            // from the new failure at its next checkpoint (as in `complete_change`).
            Err(e) if e.is_failure() => {
                tracing::debug!("{me}: the recovery to epoch {epoch} lost a process after its move ({e}); taking it");
                vec![0; 2]
            }
            Err(e) => return Err(e),
        };
        let resize = Resize {
            seq: c.seq,
            epoch,
            old_size: c.before.len(),
            new_size: survivors.len(),
            old_rank: Some(old_rank),
            new_rank: Some(new_rank),
            mapping: new_pos.iter().map(|p| p.map(|p| p as usize)).collect(),
            added: Vec::new(),
            transition,
            overlap: None,
        };
        self.last_change = Some((c.seq, Vec::new(), failed.clone()));
        let rt = self.rt.as_ref().ok_or_else(|| Error::Invalid("session is closed".into()))?;
        self.world = Self::world_of(rt, self.spin, &self.endpoint, &c.after, self.timeout, &self.memberships)?;
        self.info.nodes = node_count(&c.after);
        self.membership = c.after;
        self.moved_for = None;
        if new_rank == 0 {
            if let Some(ctl) = self.control.as_mut() {
                let times = SwitchTimes { connect_us: times[0], redistribute_us: times[1], background_us: 0 };
                bootstrap::write_msg(ctl, &FromRank::Switched { epoch, times }).map_err(control_err)?;
            }
        }
        tracing::info!("{me} recovered as rank {new_rank} of {} at epoch {epoch} ({why})", survivors.len());
        let failed = failed.into_iter().map(|o| o as usize).collect();
        Ok(Checkpoint::Recovered(Recovery { resize, failed, why, lost }))
    }
}
