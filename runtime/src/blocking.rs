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

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

thread_local! {
    /// This thread's wake flag, kept between blocking calls (a call nested inside
    /// another's future finds it taken and makes its own).
    static FLAG: std::cell::Cell<Option<Arc<Flag>>> = const { std::cell::Cell::new(None) };
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
    let flag =
        FLAG.take().unwrap_or_else(|| Arc::new(Flag { woken: AtomicBool::new(false), thread: thread::current() }));
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);
    let mut fut = pin!(fut);
    let mut deadline = None;
    let out = loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            break Some(v);
        }
        // Most calls (a send that leaves at once, a message already there) never wait
        // and never read the clock.
        let deadline = *deadline.get_or_insert_with(|| far_or(Instant::now(), timeout));
        if !wait(&flag, spin, deadline, progress) {
            break None;
        }
    };
    FLAG.set(Some(flag));
    out
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
}

/// Waits for a wake-up; false if the deadline passed first.
fn wait(flag: &Flag, spin: Duration, deadline: Instant, progress: &impl Progress) -> bool {
    // Even without a spin the thread tells the transport it is about to sleep, so that
    // data its own polling was to move (a send's unwritten rest) goes to the backend's
    // progress tasks. (Parking without saying so left such a send unwritten until the
    // timeout.)
    progress.begin();
    let woken = spin > Duration::ZERO && spin_wait(flag, spin, progress);
    progress.end(!woken);
    if woken || flag.woken.swap(false, Ordering::Acquire) {
        return true;
    }
    while !flag.woken.swap(false, Ordering::Acquire) {
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        thread::park_timeout(deadline - now);
    }
    true
}

/// Spins until `spin` passes without data arriving, polling; true if woken.
fn spin_wait(flag: &Flag, spin: Duration, progress: &impl Progress) -> bool {
    let mut start = Instant::now();
    let mut rounds = 0u32;
    loop {
        if flag.woken.swap(false, Ordering::Acquire) {
            return true;
        }
        if rounds.is_multiple_of(8) && start.elapsed() >= spin {
            return false;
        }
        if progress.poll() {
            // What the poll delivered may be what this thread waits for: look before
            // reading the clock and pausing, which would only delay the answer.
            if flag.woken.swap(false, Ordering::Acquire) {
                return true;
            }
            start = Instant::now();
        }
        rounds += 1;
        if rounds.is_multiple_of(16) {
            thread::yield_now();
        } else {
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
}
