//! Direct reads over `shm`: a reader on the same node copies a peer's registered region
//! out of the peer's memory itself, with `process_vm_readv`, instead of posting
//! `fi_read`.
//!
//! libfabric 1.17's shm provider serves an `fi_read` by the same kernel copy (CMA), but
//! under a spin lock on the *owner's* region: the readers of one owner take turns and
//! spin meanwhile, on a node where every spinning reader takes a core from the one
//! copying. (`benches/peers/fanout.c`: one source to three targets, 64 MiB each, 1.45
//! GB/s aggregate by `fi_read` on fresh pages.) The copy needs nothing of the provider:
//! an owner that offers it names its process in its regions ([`Owner`]: pid and pid
//! namespace), and a reader in the same pid namespace copies by itself; leases and
//! `Fin` keep the memory alive exactly as they do for `fi_read`.
//!
//! A copy is not made where the reader learns of it: rendezvous announcements arrive
//! inside the completion handler, holding a receive slot and sometimes locks that
//! delivery takes again. It is queued, one copy per chunk of at most a read's size, and
//! made by the next poll of the completion queue after its batch of completions
//! ([`Inner::run_direct`]), by whichever thread polls: an application thread waiting
//! for it (a queued copy counts as a transfer in flight, so waiting threads keep
//! polling), or the progress thread, which helps while the application polls. Each copy
//! populates its fresh destination pages first (`populate` in `ofi/mem.rs`), so the
//! threads making copies also fault pages in side by side.
//!
//! One kind of copy is made at once, where its announcement is read: a payload that a
//! blocking receive waiting on the reading thread takes whole goes straight into that
//! receive's memory (`Inner::land_in_place`), which is lent only within that thread's
//! call, so a queued copy could not write into it; the handler holds nothing but its
//! receive slot while it copies. If that copy fails, the payload is read again the
//! usual way, by queued copies.
//!
//! Where the kernel refuses queued copies (`EPERM`, e.g. Yama's `ptrace_scope`;
//! `ENOSYS`), the endpoint stops making them and reads with `fi_read` from then on, this
//! copy first. A copy from an owner that has gone (`ESRCH`) or outside its memory
//! (`EFAULT`) fails as a read would.
//!
//! Only over shm: a pid namespace's inode names it on one machine only (the initial
//! namespace has the same inode everywhere), so a pid is trusted to name the owner only
//! where the provider itself implies that owner and reader share a node.
//!
//! What a region's owner field lets a peer do: make a reader copy from another process
//! of the reader's user (same pid namespace) into the reader's own memory, as part of
//! a message or get the peer could have filled with anything; it never exposes the
//! reader's memory. Peers are authenticated before their announcements are read, and
//! the provider's own CMA trusts the pid a peer publishes in the same way.
//!
//! `DUCTILE_FABRIC_DIRECT=never` turns the copies off (the tests run part of the
//! conformance suite so, to keep `fi_read` over shm covered).

use super::ofi::{lock, Owner, ReadDest};
use super::state::Inner;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A queued copy: one chunk of transfer `id` (`range`: offset and length in `dest`),
/// from `addr` in the owner's memory; and how to read it with `fi_read` instead (source
/// address and key).
pub(super) struct Job {
    pub(super) id: u64,
    pub(super) dest: Arc<ReadDest>,
    pub(super) range: (usize, usize),
    pub(super) pid: u32,
    pub(super) addr: u64,
    pub(super) src: u64,
    pub(super) key: u64,
}

/// This endpoint's direct copies; see the module docs.
pub(super) struct Direct {
    /// Our own process, named in our regions; all zero if copies are off.
    me: Owner,
    on: AtomicBool,
    jobs: Mutex<VecDeque<Job>>,
    /// The queue's length, read without the lock: every poll asks.
    queued: AtomicUsize,
    /// Copies made (for the tests).
    copied: AtomicU64,
    /// Messages copied straight into a receive's memory, and copies of that kind that
    /// failed (for the tests; see `Inner::land_in_place`).
    landed: AtomicU64,
    land_failed: AtomicU64,
    /// The tests' stand-in for a kernel that refuses copies.
    #[cfg(test)]
    refuse: AtomicBool,
    /// The tests' stand-in for a copy into a receive's memory that fails.
    #[cfg(test)]
    fail_in_place: AtomicBool,
}

/// Whether direct copies are offered over the provider `provider`, as asked by
/// `DUCTILE_FABRIC_DIRECT` (`never` turns them off) and `virt`: the regions' addresses
/// are virtual addresses (`FI_MR_VIRT_ADDR`), which is what the copy needs.
pub(super) fn offered(provider: &str, virt: bool, env: Option<&str>) -> bool {
    provider == "shm" && virt && env != Some("never")
}

/// Whether a copy that failed with `errno` is better made by `fi_read`: the kernel
/// forbids such copies here, rather than the owner being gone or the range bad.
fn refused(errno: Option<i32>) -> bool {
    matches!(errno, Some(libc::EPERM | libc::ENOSYS | libc::EACCES))
}

impl Direct {
    /// Copies offered by `me` (`None`: off).
    pub(super) fn new(me: Option<Owner>) -> Self {
        let me = me.unwrap_or_default();
        Self {
            on: AtomicBool::new(me.offered()),
            me,
            jobs: Mutex::new(VecDeque::new()),
            queued: AtomicUsize::new(0),
            copied: AtomicU64::new(0),
            landed: AtomicU64::new(0),
            land_failed: AtomicU64::new(0),
            #[cfg(test)]
            refuse: AtomicBool::new(false),
            #[cfg(test)]
            fail_in_place: AtomicBool::new(false),
        }
    }

    /// What our regions say of their owner.
    pub(super) fn me(&self) -> Owner {
        self.me
    }

    /// Whether a region of `owner` is copied directly.
    pub(super) fn copies(&self, owner: &Owner) -> bool {
        owner.offered() && owner.ns == self.me.ns && self.on.load(Ordering::Relaxed)
    }

    /// Whether copies are made (the owner side: our readers copy unless they refuse).
    pub(super) fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub(super) fn push(&self, jobs: impl IntoIterator<Item = Job>) {
        let mut q = lock(&self.jobs);
        q.extend(jobs);
        self.queued.store(q.len(), Ordering::Release);
    }

    /// Whether copies may be queued (one load; see [`Direct::pop`]).
    #[inline]
    pub(super) fn any(&self) -> bool {
        self.queued.load(Ordering::Acquire) != 0
    }

    /// The next copy to make. The queue is looked at only if it was seen non-empty
    /// without the lock (a poll of an idle endpoint costs one load: this is on the
    /// 8-byte path; a copy queued meanwhile is seen by the next poll).
    fn pop(&self) -> Option<Job> {
        if self.queued.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut q = lock(&self.jobs);
        let job = q.pop_front();
        self.queued.store(q.len(), Ordering::Release);
        job
    }

    /// Counts a message copied straight into a receive's memory (`ok`), or a failed copy
    /// of that kind.
    pub(super) fn landed(&self, ok: bool) {
        let count = if ok { &self.landed } else { &self.land_failed };
        count.fetch_add(1, Ordering::Relaxed);
    }

    /// The tests' stand-in for a kernel that refuses copies (`EPERM`), or, `in_place`,
    /// for a copy into a receive's memory that fails (`EFAULT`), while asked to.
    #[cfg(test)]
    pub(super) fn refusing(&self, in_place: bool) -> std::io::Result<()> {
        let (flag, errno) = if in_place { (&self.fail_in_place, libc::EFAULT) } else { (&self.refuse, libc::EPERM) };
        match flag.load(Ordering::Relaxed) {
            true => Err(std::io::Error::from_raw_os_error(errno)),
            false => Ok(()),
        }
    }

    /// Drops the queued copies (teardown: their transfers are abandoned).
    pub(super) fn clear(&self) {
        let mut q = lock(&self.jobs);
        q.clear();
        self.queued.store(0, Ordering::Release);
    }
}

impl Inner {
    /// Makes the queued copies; true if there were any.
    pub(super) fn run_direct(&self) -> bool {
        let mut any = false;
        while let Some(job) = self.direct.pop() {
            any = true;
            self.copy(job);
        }
        any
    }

    fn copy(&self, job: Job) {
        let Job { id, dest, range, pid, addr, src, key } = job;
        let copied = dest.copy_from_process(range, pid, addr);
        #[cfg(test)]
        let copied = copied.and_then(|()| self.direct.refusing(false));
        match copied {
            Ok(()) => {
                drop(dest);
                self.direct.copied.fetch_add(1, Ordering::Relaxed);
                self.chunk_done(id, Ok(()));
            }
            Err(e) if refused(e.raw_os_error()) => {
                if self.direct.on.swap(false, Ordering::Relaxed) {
                    tracing::warn!(
                        "{}: copies from peers' memory are refused ({e}); reading with fi_read instead",
                        self.me.rank
                    );
                }
                self.read_instead(id, dest, range, (src, addr, key));
            }
            Err(e) => {
                drop(dest);
                let why = format!("copying from process {pid}: {e}");
                if e.raw_os_error() == Some(libc::ESRCH) {
                    // Its process is gone, so the peer is, whether or not anyone said so
                    // yet: what waits on it fails as on a lost peer (which a job that
                    // recovers from failures recovers from), not as a refused read.
                    let peer = self.transfers.peer_of(id);
                    if let Some(peer) = peer.filter(|&p| !self.mailbox.has_ended(p)) {
                        self.peer_ended(peer, crate::matching::PeerEnd::Lost, &why);
                    }
                }
                self.chunk_done(id, Err(why));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_offered_over_shm_with_virtual_addresses_unless_turned_off() {
        assert!(offered("shm", true, None));
        assert!(offered("shm", true, Some("always")));
        assert!(!offered("shm", true, Some("never")));
        assert!(!offered("shm", false, None));
        assert!(!offered("tcp;ofi_rxm", true, None));
    }

    #[test]
    fn only_a_forbidding_kernel_sends_a_copy_back_to_fi_read() {
        assert!(refused(Some(libc::EPERM)));
        assert!(refused(Some(libc::ENOSYS)));
        assert!(!refused(Some(libc::ESRCH)), "the owner is gone: the read fails");
        assert!(!refused(Some(libc::EFAULT)), "outside the owner's memory: the read fails");
        assert!(!refused(None));
    }

    #[test]
    fn a_region_is_copied_only_from_an_owner_in_our_pid_namespace() {
        let me = Owner::this_process().expect("/proc/self/ns/pid");
        let d = Direct::new(Some(me));
        assert!(d.copies(&Owner { pid: 1234, ns: me.ns }));
        assert!(!d.copies(&Owner { pid: 1234, ns: me.ns ^ 1 }), "another namespace");
        assert!(!d.copies(&Owner::default()), "not offered");
        let off = Direct::new(None);
        assert!(!off.copies(&Owner { pid: 1234, ns: me.ns }));
        assert!(!off.on());
    }

    /// Two shm endpoints of one job in this process; none (said loudly) if copies are
    /// turned off for the run.
    fn shm_pair() -> Option<Vec<(Arc<super::super::FabricTransport>, crate::Endpoint)>> {
        use crate::auth::Identity;
        if std::env::var("DUCTILE_FABRIC_DIRECT").as_deref() == Ok("never") {
            eprintln!("SKIPPED: DUCTILE_FABRIC_DIRECT=never turns direct copies off");
            return None;
        }
        use crate::{JobId, JobKey, Mailbox, Rank, Transport, TransportConfig, TransportSetup};
        let eps: Vec<_> = (0..2)
            .map(|r| {
                let mailbox = Arc::new(Mailbox::new());
                let identity = Identity { job: JobId(5), key: JobKey::from_bytes([3; 32]), rank: Rank(r) };
                let config = TransportConfig::default().fabric_provider("shm");
                let setup = TransportSetup { identity, size: 2, config, mailbox: mailbox.clone() };
                let t = Arc::new(super::super::FabricTransport::bind(setup).expect("an shm endpoint"));
                (t.clone(), crate::Endpoint::new(t, mailbox, Rank(r)))
            })
            .collect();
        let table: Vec<_> = eps.iter().map(|(t, _)| t.local_addr()).collect();
        for (t, _) in &eps {
            t.set_peers(&table).unwrap();
        }
        Some(eps)
    }

    #[tokio::test]
    async fn shm_gets_and_rendezvous_messages_are_copied_directly() {
        use crate::matching::{Pattern, SrcMatch, TagMatch};
        use crate::{Context, Rank, Tag, Transport};
        let Some(eps) = shm_pair() else { return };
        let (t0, e0) = &eps[0];
        let (t1, e1) = &eps[1];
        assert!(!t0.capabilities().serial_reads, "readers copy by themselves: no turns");
        assert!(t0.capabilities().populates, "the copies populate their memory");
        // Three chunks and a bit.
        let chunk = t0.inner.chunk;
        let data = bytes::Bytes::from((0..3 * chunk as u32 + 5).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
        let w = t1.expose(data.clone()).unwrap();
        let copies = || t0.inner.direct.copied.load(Ordering::Relaxed);
        let t = std::time::Duration::from_secs(20);
        let got = e0.get(Rank(1), w, 12345, 2 << 20, t).await.unwrap();
        assert!(got[..] == data[12345..12345 + (2 << 20)], "the get's bytes differ");
        assert_eq!(copies(), 1, "the get was one direct copy");
        let got = e0.get(Rank(1), w, 1, data.len() as u64 - 1, t).await.unwrap();
        assert!(got[..] == data[1..], "the large get's bytes differ");
        assert_eq!(copies(), 5, "a copy per chunk");
        e1.send(Rank(0), Context(0), Tag(4), data.clone()).await.unwrap();
        let from = Pattern { ctx: Context(0), src: SrcMatch::Rank(Rank(1)), tag: TagMatch::Tag(Tag(4)) };
        let m = e0.recv(from, t).await.unwrap();
        assert!(m.payload == data, "the message's bytes differ");
        assert_eq!(copies(), 9, "the message was a copy per chunk");
        t1.withdraw(w).unwrap();
        for (t, _) in &eps {
            t.close().await;
        }
    }

    #[tokio::test]
    async fn a_refused_copy_is_read_with_fi_read_and_so_are_the_later_ones() {
        use crate::{Rank, Transport};
        let Some(eps) = shm_pair() else { return };
        let (t0, e0) = &eps[0];
        let (t1, _) = &eps[1];
        let data = bytes::Bytes::from((0..1 << 20).map(|i: u32| (i % 241) as u8).collect::<Vec<u8>>());
        let w = t1.expose(data.clone()).unwrap();
        let direct = &t0.inner.direct;
        assert!(direct.on());
        // As the kernel refusing the first copy; the endpoint gives copies up at once.
        direct.refuse.store(true, Ordering::Relaxed);
        for k in 0..3u64 {
            let got = e0.get(Rank(1), w, k, 1000 + k, std::time::Duration::from_secs(20)).await.unwrap();
            assert!(got[..] == data[k as usize..][..1000 + k as usize], "get {k} differs");
        }
        assert_eq!(direct.copied.load(Ordering::Relaxed), 0);
        assert!(!direct.on(), "no copies after a refusal");
        t1.withdraw(w).unwrap();
        for (t, _) in &eps {
            t.close().await;
        }
    }

    type Answer = Result<(crate::matching::Envelope, bool), crate::TransportError>;

    /// A blocking `recv_into` of `len` bytes from rank 1 with tag 4, on a thread of its
    /// own that polls `ep` as a blocking call does, posted (and the progress thread
    /// standing aside) before `ready` says so: the answer, whether the payload landed in
    /// the receive's memory, and that memory.
    fn receive_polling(
        ep: crate::Endpoint,
        len: usize,
        ready: std::sync::mpsc::Sender<()>,
    ) -> std::thread::JoinHandle<(Answer, Vec<u8>)> {
        use crate::matching::{Pattern, SrcMatch, TagMatch};
        use crate::{Context, Rank, Tag};
        use std::task::Poll;
        std::thread::spawn(move || {
            let mut buf = vec![0u8; len];
            let from = Pattern { ctx: Context(0), src: SrcMatch::Rank(Rank(1)), tag: TagMatch::Tag(Tag(4)) };
            let got = {
                // SAFETY: the wait is dropped (at the end of this block) before `buf` is used.
                let posted = unsafe { ep.mailbox().post_here_into(from, std::task::Waker::noop(), &mut buf) };
                let Ok(Err(mut w)) = posted else { panic!("expected a posted receive") };
                ep.poll_begin();
                // The progress thread notices within its nap that this one polls.
                let start = std::time::Instant::now();
                while start.elapsed() < std::time::Duration::from_millis(5) {
                    ep.progress();
                }
                ready.send(()).unwrap();
                let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                let start = std::time::Instant::now();
                loop {
                    ep.progress();
                    if let Poll::Ready(r) = w.poll(&mut cx) {
                        ep.poll_end(false);
                        break r.map(|e| (e, w.landed()));
                    }
                    assert!(start.elapsed() < std::time::Duration::from_secs(20), "no answer");
                }
            };
            (got, buf)
        })
    }

    /// A blocking `recv_into` of `data` on rank 0 (see [`receive_polling`]), sent by
    /// rank 1 once the receive polls, with a small message right behind it in its
    /// stream, which must come after it: whether the payload landed in the receive's
    /// memory.
    async fn receive_with_one_behind(e0: &crate::Endpoint, e1: &crate::Endpoint, data: &bytes::Bytes) -> bool {
        use crate::matching::{Pattern, SrcMatch, TagMatch};
        use crate::{Context, Rank, Tag};
        let small = bytes::Bytes::from_static(b"right behind it");
        let (ready, go) = std::sync::mpsc::channel();
        let receiver = receive_polling(e0.clone(), data.len(), ready);
        tokio::task::block_in_place(|| go.recv()).unwrap();
        e1.send(Rank(0), Context(0), Tag(4), data.clone()).await.unwrap();
        e1.send(Rank(0), Context(0), Tag(4), small.clone()).await.unwrap();
        let (got, buf) = receiver.join().unwrap();
        let (env, in_place) = got.unwrap();
        assert!(if in_place { buf[..] == data[..] } else { env.payload == *data }, "the payload differs");
        let from = Pattern { ctx: Context(0), src: SrcMatch::Rank(Rank(1)), tag: TagMatch::Tag(Tag(4)) };
        assert_eq!(e0.recv(from, std::time::Duration::from_secs(20)).await.unwrap().payload, small);
        assert_eq!(e0.mailbox().queued(), 0);
        in_place
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_blocking_receive_copies_a_rendezvous_payload_straight_into_its_memory() {
        use crate::Transport;
        let Some(eps) = shm_pair() else { return };
        let (t0, e0) = &eps[0];
        let (_, e1) = &eps[1];
        let direct = &t0.inner.direct;
        let data = bytes::Bytes::from((0..3 * t0.inner.chunk as u32 + 5).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
        let counts = || {
            let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
            (c(&direct.copied), c(&direct.landed), c(&direct.land_failed))
        };
        // The waiting thread copies the payload in place when it is the thread that
        // reads the announcement; the progress thread may still be about when the
        // receive is posted, so one of a few attempts must land, as one copy.
        let mut landed = false;
        for _ in 0..5 {
            let before = counts();
            let in_place = receive_with_one_behind(e0, e1, &data).await;
            landed = in_place && counts() == (before.0, before.1 + 1, before.2);
            if landed {
                break;
            }
        }
        assert!(landed, "no payload was copied into the receive's memory in 5 attempts");
        // A copy into the receive's memory that fails (after the message took its place
        // in its stream) is made again the usual way, by queued copies: the receive gets
        // the payload intact, and the message behind it after it.
        direct.fail_in_place.store(true, Ordering::Relaxed);
        let mut fell_back = false;
        for _ in 0..5 {
            let before = counts();
            receive_with_one_behind(e0, e1, &data).await;
            let after = counts();
            fell_back = after.2 > before.2 && after.0 > before.0 && after.1 == before.1;
            if fell_back {
                break;
            }
        }
        assert!(fell_back, "no failed copy into the receive's memory was read again in 5 attempts");
        for (t, _) in &eps {
            t.close().await;
        }
    }
}
