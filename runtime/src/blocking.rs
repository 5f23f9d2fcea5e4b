//! Running the async core from the application's thread.
//!
//! The blocking API polls futures on the application thread while the runtime's
//! progress thread drives sockets and timers. Waiting first spins briefly (re-checking a
//! wake flag and yielding the CPU) and only then parks: a message that arrives within
//! the spin window is picked up without a sleep/wake round trip through the kernel
//! (the spinning thread also reads the transport's sockets itself),
//! which is what HPC codes expect from a blocking receive. tokio's own `block_on` parks
//! at once, which costs several microseconds per message; that is why this small
//! executor exists.

use ductile_transport::{Endpoint, Envelope, Pattern, TransportError};
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

struct Flag {
    woken: AtomicBool,
    thread: Thread,
}

impl Flag {
    /// Takes a wake-up, if any. A plain load first: this is every round of a spin, and
    /// an atomic swap costs a locked instruction even when there is nothing to take.
    #[inline]
    fn take(&self) -> bool {
        self.woken.load(Ordering::Relaxed) && self.woken.swap(false, Ordering::Acquire)
    }
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// A thread's wake flag and a waker that sets it.
type Waking = (Arc<Flag>, Waker);

thread_local! {
    /// This thread's wake flag and its waker, kept between blocking calls (made once:
    /// a call then clones and drops no waker of its own). A call nested inside
    /// another's future finds them taken and makes its own.
    static FLAG: std::cell::Cell<Option<Waking>> = const { std::cell::Cell::new(None) };
}

/// Polls `fut` to completion on this thread, spinning up to `spin` per wait before
/// parking; while spinning it calls `progress` (the transport's own polling, which
/// delivers arrived messages without waking another thread). Tokio resources used by
/// `fut` are driven by `handle`'s runtime.
/// Returns `None` if `timeout` passes first (counted from the first wait; the future is
/// dropped).
pub(crate) fn block_on<F: Future>(
    handle: &Handle,
    spin: Duration,
    timeout: Duration,
    progress: &impl Progress,
    fut: F,
) -> Option<F::Output> {
    let _enter = handle.enter();
    let (flag, waker) = take_flag();
    let mut cx = Context::from_waker(&waker);
    let mut fut = pin!(fut);
    let mut deadline = Deadline::new(timeout);
    let out = loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            break Some(v);
        }
        if !wait(&flag, spin, &mut deadline, progress, || false) {
            break None;
        }
    };
    FLAG.set(Some((flag, waker)));
    out
}

/// This thread's wake flag and waker (see [`FLAG`]); give them back with `FLAG.set`.
fn take_flag() -> Waking {
    FLAG.take().unwrap_or_else(|| {
        let flag = Arc::new(Flag { woken: AtomicBool::new(false), thread: thread::current() });
        let waker = Waker::from(flag.clone());
        (flag, waker)
    })
}

/// Receives the oldest message `pattern` matches on `ep`, waiting on this thread as
/// [`block_on`] does, but without a future or an executor: the receive is posted with
/// [`Mailbox::post_here`](ductile_transport::Mailbox::post_here), so the message this
/// thread's own polling delivers is handed over without a wake and without a second
/// pass through the mailbox's lock. A blocking receive's whole path from the arrival
/// of its message to its return is then the transport's work and the matching; the
/// future, its waker and the runtime context cost about a third as much again.
///
/// With `into`, the receive lends that memory
/// ([`Mailbox::post_here_into`](ductile_transport::Mailbox::post_here_into)): a payload
/// of its length delivered on this thread, or delivered in pieces, may be copied
/// straight into it, and the answer then says so (`true`, with an empty payload in the
/// envelope).
/// Returns `None` if `timeout` passes first (the receive is withdrawn, losing nothing).
pub(crate) fn recv_here(
    ep: &Endpoint,
    pattern: Pattern,
    spin: Duration,
    timeout: Duration,
    into: Option<&mut [u8]>,
) -> Option<Result<(Envelope, bool), TransportError>> {
    let (flag, waker) = take_flag();
    let posted = match into {
        // SAFETY: the wait is dropped below, on every path, before `into`'s borrow ends.
        Some(dest) => unsafe { ep.mailbox().post_here_into(pattern, &waker, dest) },
        None => ep.mailbox().post_here(pattern, &waker).map(|p| p.map(|env| (env, false))),
    };
    let out = match posted {
        Err(e) => Some(Err(e)),
        Ok(Ok(answer)) => Some(Ok(answer)),
        Ok(Err(mut here)) => ep.blocking_call(|| {
            let mut cx = Context::from_waker(&waker);
            let mut deadline = Deadline::new(timeout);
            loop {
                // Nothing to look at before the first wait: a message that came
                // meanwhile on another thread has set the flag.
                let waited = wait(&flag, spin, &mut deadline, ep, || here.arrived());
                if let Poll::Ready(r) = here.poll(&mut cx) {
                    break Some(r.map(|env| (env, here.landed())));
                }
                // The answer may have come just as the deadline passed: it was taken
                // above rather than put back.
                if !waited {
                    break None;
                }
            }
        }),
    };
    FLAG.set(Some((flag, waker)));
    out
}

/// When a blocking call stops waiting. The clock is read every eighth round of waiting
/// (a poll while spinning, or a wake-up that was not yet the answer), from the eighth
/// on: most calls (a send that leaves at once, a message already there or just
/// arriving) never read it, and a reply's first poll for the next message comes sooner.
struct Deadline {
    timeout: Duration,
    at: Option<Instant>,
    rounds: u32,
}

impl Deadline {
    fn new(timeout: Duration) -> Self {
        Self { timeout, at: None, rounds: 0 }
    }

    /// Counts a round of waiting; every eighth returns the time, to check the spin and
    /// the deadline against.
    fn round(&mut self) -> Option<Instant> {
        self.rounds = self.rounds.wrapping_add(1);
        self.rounds.is_multiple_of(8).then(Instant::now)
    }

    /// The deadline; the first call sets it from `now`.
    fn at(&mut self, now: Instant) -> Instant {
        *self.at.get_or_insert_with(|| far_or(now, self.timeout))
    }

    /// Whether the deadline has passed at `now`.
    fn passed(&mut self, now: Instant) -> bool {
        now >= self.at(now)
    }
}

/// `now + timeout`, or a century away for a timeout too large to add (a huge
/// `DUCTILE_TIMEOUT` means "wait as long as it takes", not a panic).
fn far_or(now: Instant, timeout: Duration) -> Instant {
    now.checked_add(timeout).unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

/// Progress made by a waiting thread: the transport's polling.
pub(crate) trait Progress {
    /// The thread starts polling.
    fn begin(&self) {}
    /// One round of polling; true if data is flowing (the spin window restarts).
    fn poll(&self) -> bool {
        false
    }
    /// The thread stops polling; `parking` if it is about to sleep.
    fn end(&self, parking: bool) {
        let _ = parking;
    }
    /// Whether [`Progress::poll`] reads the transport (the thread moves the data itself).
    fn polled(&self) -> bool {
        false
    }
}

impl Progress for () {}

impl Progress for ductile_transport::Endpoint {
    fn begin(&self) {
        self.poll_begin();
    }

    fn poll(&self) -> bool {
        self.progress()
    }

    fn end(&self, parking: bool) {
        self.poll_end(parking);
    }

    fn polled(&self) -> bool {
        self.transport().capabilities().polled
    }
}

/// Waits for a wake-up, or for `arrived` (a message this thread's polling handed over);
/// false if the deadline passed first.
fn wait(
    flag: &Flag,
    spin: Duration,
    deadline: &mut Deadline,
    progress: &impl Progress,
    arrived: impl Fn() -> bool,
) -> bool {
    // A waker that fires again and again without the answer still lets the call time
    // out.
    if deadline.round().is_some_and(|now| deadline.passed(now)) {
        return false;
    }
    // Even without a spin the thread tells the transport it is about to sleep, so that
    // data its own polling was to move (a send's unwritten rest) goes to the backend's
    // progress tasks. (Parking without saying so left such a send unwritten until the
    // timeout.)
    progress.begin();
    let woken = spin > Duration::ZERO && spin_wait(flag, spin, deadline, progress, &arrived);
    progress.end(!woken);
    // Ending may poll once more (tcp reads what arrived meanwhile).
    if woken || arrived() || flag.woken.swap(false, Ordering::Acquire) {
        return true;
    }
    while !flag.woken.swap(false, Ordering::Acquire) {
        let now = Instant::now();
        let at = deadline.at(now);
        if now >= at {
            return false;
        }
        thread::park_timeout(at - now);
    }
    true
}

/// Spins until `spin` passes without data arriving, polling; true if woken or `arrived`,
/// false once the spin or the deadline has passed (checked at the rounds where
/// [`Deadline::round`] reads the clock; the first spin of a call thus runs a few polls
/// longer than `spin`).
fn spin_wait(
    flag: &Flag,
    spin: Duration,
    deadline: &mut Deadline,
    progress: &impl Progress,
    arrived: &impl Fn() -> bool,
) -> bool {
    let mut start = None;
    let mut rounds = 0u32;
    // A round that reads the transport takes long enough by itself; a pause there only
    // delays seeing what arrives (fabric shm, 8 B one-way, alternating jobs: 321-341 ns
    // without it against 340-391 ns with it, and 1028-1128 against 1081-1142 in the
    // machine's slow state).
    let polled = progress.polled();
    loop {
        if flag.take() || arrived() {
            return true;
        }
        if let Some(now) = deadline.round() {
            // Data flowing for other receivers restarts the spin, not the deadline.
            if now.duration_since(*start.get_or_insert(now)) >= spin || deadline.passed(now) {
                return false;
            }
        }
        if progress.poll() {
            // What the poll delivered may be what this thread waits for: look before
            // reading the clock and pausing, which would only delay the answer.
            if arrived() || flag.take() {
                return true;
            }
            start = None;
        }
        rounds = rounds.wrapping_add(1);
        if rounds.is_multiple_of(16) {
            thread::yield_now();
        } else if !polled {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completes_futures_woken_from_other_threads() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let far = Duration::from_secs(10);
        for spin in [Duration::ZERO, Duration::from_micros(50)] {
            let (tx, rx) = tokio::sync::oneshot::channel();
            rt.spawn(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                tx.send(7).unwrap();
            });
            assert_eq!(block_on(rt.handle(), spin, far, &(), rx).unwrap().unwrap(), 7);
        }
        let soon = Duration::from_millis(10);
        assert!(block_on(rt.handle(), Duration::ZERO, soon, &(), std::future::pending::<()>()).is_none());
        // A call nested in another's future gets its own wake flag, and both complete.
        let outer = async {
            let inner = block_on(rt.handle(), Duration::ZERO, far, &(), async { 5 });
            tokio::time::sleep(Duration::from_millis(2)).await;
            inner
        };
        assert_eq!(block_on(rt.handle(), Duration::ZERO, far, &(), outer), Some(Some(5)));
        // A timeout too large to add to the clock waits, it does not panic.
        let (tx, rx) = tokio::sync::oneshot::channel();
        rt.spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            tx.send(1).unwrap();
        });
        assert_eq!(block_on(rt.handle(), Duration::ZERO, Duration::MAX, &(), rx).unwrap().unwrap(), 1);
        assert!(far_or(Instant::now(), Duration::MAX) > Instant::now() + Duration::from_secs(1 << 30));
    }

    /// A transport whose every poll moves data (for other receivers).
    struct Busy;
    impl Progress for Busy {
        fn poll(&self) -> bool {
            true
        }
    }

    #[test]
    fn waits_time_out_while_data_flows_for_others_or_wakes_repeat() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let soon = Duration::from_millis(30);
            // Every poll restarts the spin window; the deadline still ends the wait.
            let flowing = block_on(rt.handle(), Duration::from_millis(5), soon, &Busy, std::future::pending::<()>());
            // A future that wakes itself and is never ready.
            let woken = std::future::poll_fn(|cx| {
                cx.waker().wake_by_ref();
                Poll::<()>::Pending
            });
            let repeating = block_on(rt.handle(), Duration::from_micros(50), soon, &(), woken);
            let _ = tx.send((flowing, repeating));
        });
        let r = rx.recv_timeout(Duration::from_secs(20)).expect("the waits ended");
        assert_eq!(r, (None, None));
    }
}
