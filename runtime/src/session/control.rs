//! The control channel once the process has joined: one thread reads it for the rest of
//! the session, so that a [`ToRank::Failure`] reaches the process whatever it is doing.
//!
//! A failure notice interrupts the endpoint's receives at once (`Mailbox::interrupt`):
//! a process blocked on a failed peer, or on a live one that is itself blocked on it,
//! gets `TransportError::Interrupted` instead of waiting out its timeout, and
//! recovers at its next checkpoint ([`super::Session::checkpoint`]). The receives of
//! the change to the failure's epoch are spared (see `super::change_contexts`): a
//! process still finishing that switch completes it, and recovers from there. Every other
//! message (the controller's decisions) is passed on, in order, to the checkpoint that
//! waits for it; so is the notice, which wakes a rank 0 waiting for a decision. A
//! [`ToRank::Gone`] only ends the receives waiting on the processes it names.

use crate::bootstrap::{self, Failure, ToRank};
use crate::error::{Error, Result};
#[cfg(test)]
use ductile_transport::TransportError;
use ductile_transport::{Mailbox, PeerEnd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The reading side of the control channel.
pub(super) struct Watcher {
    messages: mpsc::Receiver<std::result::Result<ToRank, String>>,
    /// The failures notified and not yet recovered from, merged.
    failure: Arc<Mutex<Option<Failure>>>,
}

impl Watcher {
    /// Starts the thread reading `control` (the session writes on its own handle; it
    /// never reads it again). The thread ends when the channel does: at
    /// [`shut`], or when the agent is gone.
    pub(super) fn start(control: &UnixStream, mailbox: Arc<Mailbox>) -> Result<Self> {
        let boot = |e: std::io::Error| Error::Bootstrap(format!("control channel: {e}"));
        let mut reader = control.try_clone().map_err(boot)?;
        // A socket option, shared with the session's handle, which only writes now.
        reader.set_read_timeout(None).map_err(boot)?;
        let (tx, messages) = mpsc::channel();
        let failure: Arc<Mutex<Option<Failure>>> = Arc::default();
        let seen = failure.clone();
        std::thread::Builder::new()
            .name("ductile-control".into())
            .spawn(move || loop {
                match bootstrap::read_msg::<ToRank>(&mut reader) {
                    Ok(ToRank::Failure(f)) => {
                        let why = {
                            let mut known = seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                            let merged = merge(known.take(), f.clone());
                            let why = merged.why.clone();
                            *known = Some(merged);
                            why
                        };
                        let why = format!("{why}; the job recovers at the next checkpoint");
                        // The change to the failure's epoch may still be completing here.
                        let change = super::change_contexts(f.epoch);
                        mailbox.interrupt(&why, &f.failed, move |c| change.contains(&c));
                        if tx.send(Ok(ToRank::Failure(f))).is_err() {
                            return;
                        }
                    }
                    Ok(ToRank::Gone(g)) => {
                        tracing::debug!("{g:?}: its waits on them end");
                        for r in &g.failed {
                            mailbox.peer_ended(*r, PeerEnd::Lost);
                        }
                    }
                    Ok(m) => {
                        if tx.send(Ok(m)).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string()));
                        return;
                    }
                }
            })
            .map_err(boot)?;
        Ok(Self { messages, failure })
    }

    /// The next message from the agent, within `timeout`.
    pub(super) fn next(&self, timeout: Duration) -> std::result::Result<ToRank, String> {
        match self.messages.recv_timeout(timeout) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => Err(format!("nothing came within {timeout:?}")),
            Err(RecvTimeoutError::Disconnected) => Err("the channel is closed".into()),
        }
    }

    /// The next message if one is there.
    pub(super) fn try_next(&self) -> std::result::Result<Option<ToRank>, String> {
        match self.messages.try_recv() {
            Ok(m) => m.map(Some),
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err("the channel is closed".into()),
        }
    }

    /// The failures notified since the last recovery, if any.
    pub(super) fn failure(&self) -> Option<Failure> {
        self.failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Forgets the failures recovered from.
    pub(super) fn recovered(&self) {
        *self.failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

/// Two notices as one: the failed processes of both, each once, and both reasons.
fn merge(known: Option<Failure>, new: Failure) -> Failure {
    let Some(mut k) = known else { return new };
    for r in new.failed {
        if !k.failed.contains(&r) {
            k.failed.push(r);
        }
    }
    if !k.why.contains(&new.why) {
        k.why = format!("{}; {}", k.why, new.why);
    }
    k.epoch = k.epoch.max(new.epoch);
    k
}

/// Ends the channel: the agent sees this process's part end, and the watcher thread
/// its last read.
pub(super) fn shut(control: &UnixStream) {
    // Already shut or broken: nothing more to do.
    let _ = control.shutdown(std::net::Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use ductile_transport::Rank;

    #[test]
    fn notices_merge_without_repeats() {
        let a = Failure { epoch: 2, failed: vec![Rank(3)], why: "rank 3 was killed".into() };
        let b = Failure { epoch: 2, failed: vec![Rank(3), Rank(4)], why: "rank 4 exited with code 1".into() };
        let m = merge(Some(a), b);
        assert_eq!(m.failed, vec![Rank(3), Rank(4)]);
        assert_eq!(m.why, "rank 3 was killed; rank 4 exited with code 1");
    }

    #[test]
    fn a_notice_interrupts_receives_and_is_passed_on_in_order() {
        let (mut ours, theirs) = UnixStream::pair().unwrap();
        let mailbox = Arc::new(Mailbox::new());
        let w = Watcher::start(&theirs, mailbox.clone()).unwrap();
        let spared = mailbox.post(ductile_transport::Pattern {
            ctx: super::super::transition_context(0),
            src: ductile_transport::SrcMatch::Any,
            tag: ductile_transport::TagMatch::Any,
        });
        let f = Failure { epoch: 0, failed: vec![Rank(1)], why: "rank 1 failed".into() };
        bootstrap::write_msg(&mut ours, &ToRank::Failure(f.clone())).unwrap();
        bootstrap::write_msg(&mut ours, &ToRank::Decision(bootstrap::Decision::Continue)).unwrap();
        assert!(matches!(w.next(Duration::from_secs(10)), Ok(ToRank::Failure(g)) if g == f));
        assert!(matches!(w.next(Duration::from_secs(10)), Ok(ToRank::Decision(bootstrap::Decision::Continue))));
        assert_eq!(w.failure(), Some(f));
        let pattern = ductile_transport::Pattern {
            ctx: ductile_transport::Context(0),
            src: ductile_transport::SrcMatch::Any,
            tag: ductile_transport::TagMatch::Any,
        };
        assert!(matches!(mailbox.post(pattern), Err(TransportError::Interrupted(_))));
        // A change's receive is not interrupted.
        let Ok(ductile_transport::Posting::Posted(id)) = spared else { panic!("{spared:?}") };
        assert!(mailbox.withdraw(id).is_none());
        w.recovered();
        assert_eq!(w.failure(), None);
        assert!(w.try_next().unwrap().is_none());
        // The agent's end closing ends the watcher, which says so.
        drop(ours);
        assert!(w.next(Duration::from_secs(10)).is_err());
        shut(&theirs);
    }
}
