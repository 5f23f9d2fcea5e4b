//! Changes whose constant items move in the background: the move's task, the handle
//! the application may test and wait on, and the checkpoints that complete the change.

use super::{Prepared, Session, ABANDONED};
use crate::bootstrap::{Change, CheckpointMode};
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use crate::registry::Moved;
use crate::session::Checkpoint;
use std::future::Future;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;

/// A change under way whose constant items move in the background; the application
/// computes on in the old group until every old rank has seen the move finish.
pub(super) struct Moving {
    change: Change,
    pub(super) prep: Prepared,
    pub(super) task: tokio::task::JoinHandle<Result<Moved>>,
    started: Instant,
    /// When this process first saw the task finished.
    seen_done: Option<Instant>,
    /// Says when the task has finished, or has been given up.
    pub(super) handle: MoveHandle,
}

impl Moving {
    /// Starts `work`, this process's part of `change`'s background move, on `rt`.
    pub(super) fn spawn(
        rt: &Runtime,
        change: Change,
        prep: Prepared,
        work: impl Future<Output = Result<Moved>> + Send + 'static,
    ) -> Self {
        let handle = MoveHandle { ended: Arc::default() };
        // Ends the handle however the task ends: finished, failed, panicked, aborted,
        // or dropped with the runtime.
        let guard = EndOnDrop(handle.clone());
        let task = rt.spawn(async move {
            let _guard = guard;
            work.await
        });
        Self { change, prep, task, started: Instant::now(), seen_done: None, handle }
    }
}

/// This process's part of a change whose constant items move in the background
/// ([`Session::background_move`]): whether it has ended, and a bounded wait for it.
///
/// A part has ended once this process has sent every piece of its old blocks (in a
/// one-sided move: once every target has said that its reads are done, "wait drains")
/// and received every piece of its new ones, or once it failed or was given up. The
/// change itself completes, the new blocks take the old ones' place (the old ones are
/// dropped) and a failure is reported, at the first checkpoint after every old rank's
/// part has ended. Handles are cheap to clone and may be waited on from any thread.
#[derive(Clone, Debug)]
pub struct MoveHandle {
    ended: Arc<(Mutex<bool>, Condvar)>,
}

/// Ends its handle when dropped.
struct EndOnDrop(MoveHandle);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        self.0.end();
    }
}

impl MoveHandle {
    /// Marks the part ended (its task finished, or it was given up).
    pub(super) fn end(&self) {
        let (flag, cv) = &*self.ended;
        *flag.lock().unwrap_or_else(PoisonError::into_inner) = true;
        cv.notify_all();
    }

    /// Whether this process's part of the move has ended.
    ///
    /// # Local
    #[must_use]
    pub fn test(&self) -> bool {
        *self.ended.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until this process's part of the move has ended, for at most `timeout`;
    /// returns [`MoveHandle::test`].
    ///
    /// # Local
    #[must_use]
    pub fn wait(&self, timeout: Duration) -> bool {
        let (flag, cv) = &*self.ended;
        let guard = flag.lock().unwrap_or_else(PoisonError::into_inner);
        let (guard, _) = cv.wait_timeout_while(guard, timeout, |ended| !*ended).unwrap_or_else(PoisonError::into_inner);
        *guard
    }
}

impl Session {
    /// A handle on this process's part of the background move under way, if any (see
    /// [`Session::moving`]).
    ///
    /// # Local
    #[must_use]
    pub fn background_move(&self) -> Option<MoveHandle> {
        self.moving.as_ref().map(|m| m.handle.clone())
    }

    /// At a checkpoint while constant items move: every old rank says whether it has
    /// seen its part finish; once all have, the change completes. A blocking
    /// checkpoint waits for the move first.
    pub(super) fn poll_moving(&mut self, mode: CheckpointMode) -> Result<Checkpoint> {
        let timeout = self.timeout;
        let Some(m) = self.moving.as_mut() else { return Ok(Checkpoint::Unchanged) };
        if mode == CheckpointMode::Blocking && !m.task.is_finished() {
            let task = &m.task;
            // Bounded by the world's timeout; an unfinished move is reported below.
            let _ = self.world.block(async {
                while !task.is_finished() {
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
                Ok(())
            });
        }
        if m.seen_done.is_none() && m.task.is_finished() {
            m.seen_done = Some(Instant::now());
        }
        // [any still moving, any over its time]: every old rank goes on, waits or
        // fails together.
        let late = m.seen_done.is_none() && m.started.elapsed() > timeout;
        let state = [u64::from(m.seen_done.is_none()), u64::from(late)];
        match self.world.allreduce(&state, ReduceOp::Max) {
            Ok(v) if v[1] > 0 => Err(self.drop_moving(Error::Reconfigure(format!(
                "the background move of the change did not finish within {timeout:?}"
            )))),
            Ok(v) if v[0] > 0 => Ok(Checkpoint::Pending),
            Ok(_) => match self.moving.take() {
                Some(m) => self.complete_moving(m),
                None => Ok(Checkpoint::Unchanged),
            },
            Err(e) => Err(self.drop_moving(e)),
        }
    }

    /// Stops a background move: the constant items keep their old blocks.
    pub(super) fn drop_moving(&mut self, e: Error) -> Error {
        if let Some(m) = self.moving.take() {
            m.task.abort();
            m.handle.end();
        }
        self.registry.abandon_background();
        e
    }

    /// Waits for a background move (bounded by the group timeout), installs the new
    /// blocks and completes its change.
    pub(super) fn complete_moving(&mut self, m: Moving) -> Result<Checkpoint> {
        let Moving { change, prep, task, started, seen_done, .. } = m;
        let abort = task.abort_handle();
        let moved = prep
            .transition
            .block(async { task.await.map_err(|e| Error::Reconfigure(format!("the background move stopped: {e}")))? });
        let end = seen_done.unwrap_or_else(Instant::now);
        // Every member learns whether any part of the move failed, so all fail naming
        // it instead of waiting for a process that gave up.
        let flag = if moved.is_err() { prep.tpos as u64 + 1 } else { 0 };
        let failed = prep.transition.allreduce(&[flag], ReduceOp::Max).map(|v| v[0]);
        if failed.as_ref().is_ok_and(|&f| f == ABANDONED) {
            // The old processes finalized before the change could complete: this
            // process was started for it only, and has nothing to do.
            tracing::info!("{}: the application ended before the change it joined; exiting", self.endpoint.rank());
            let t = self.endpoint.transport().clone();
            let _ = prep.transition.block(async {
                t.close().await;
                Ok(())
            });
            std::process::exit(0);
        }
        let moved = match (moved, failed) {
            (Ok(m), Ok(0)) => m,
            (Err(e), _) | (Ok(_), Err(e)) => {
                abort.abort();
                self.registry.abandon_background();
                return Err(e);
            }
            (Ok(_), Ok(k)) => {
                self.registry.abandon_background();
                return Err(Error::Reconfigure(format!(
                    "the background move failed on {}; the change to epoch {} is abandoned",
                    prep.members[k as usize - 1],
                    change.after.epoch
                )));
            }
        };
        self.registry.install(moved);
        self.complete_change(change, prep, Some((started, end)))
    }
}
