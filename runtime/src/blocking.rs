//! Running the async core from the application's thread.
//!
//! The blocking API polls futures on the application thread while the runtime's
//! progress thread drives sockets and timers. Waiting first spins briefly (re-checking a
//! wake flag and yielding the CPU) and only then parks: a message that arrives within
//! the spin window is picked up without a sleep/wake round trip through the kernel,
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

/// Polls `fut` to completion on this thread, spinning up to `spin` per wait before
/// parking. Tokio resources used by `fut` are driven by `handle`'s runtime.
pub(crate) fn block_on<F: Future>(handle: &Handle, spin: Duration, fut: F) -> F::Output {
    let _enter = handle.enter();
    let flag = Arc::new(Flag { woken: AtomicBool::new(false), thread: thread::current() });
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);
    let mut fut = pin!(fut);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        wait(&flag, spin);
    }
}

fn wait(flag: &Flag, spin: Duration) {
    let start = Instant::now();
    let mut rounds = 0u32;
    loop {
        if flag.woken.swap(false, Ordering::Acquire) {
            return;
        }
        if start.elapsed() >= spin {
            break;
        }
        rounds += 1;
        if rounds.is_multiple_of(16) {
            thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    while !flag.woken.swap(false, Ordering::Acquire) {
        thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completes_futures_woken_from_other_threads() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        for spin in [Duration::ZERO, Duration::from_micros(50)] {
            let (tx, rx) = tokio::sync::oneshot::channel();
            rt.spawn(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                tx.send(7).unwrap();
            });
            assert_eq!(block_on(rt.handle(), spin, rx).unwrap(), 7);
        }
        let t = block_on(rt.handle(), Duration::ZERO, async {
            tokio::time::timeout(Duration::from_millis(10), std::future::pending::<()>()).await
        });
        assert!(t.is_err());
    }
}
