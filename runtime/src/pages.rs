//! Handing pages over between processes of one host instead of copying them.
//!
//! Over a transport whose peers share memory (fabric's shm provider,
//! `Capabilities::shares_memory`), the blocks of items that move one-sidedly live in
//! shared-memory files (`memfd_create`) mapped into their process, a [`Mapping`] each.
//! A block's mapping starts at the page that holds its first byte *of the global
//! array*: the array's byte `g` sits at mapping offset `g - origin`, `origin` being `g`
//! of the block's first byte rounded down to a page. Every block of every process then
//! puts the array's page boundaries at its own page boundaries, so the whole pages of
//! any overlap between an old block and a new one are whole pages in both, and a target
//! can map the source's pages over its own (`mmap` with `MAP_FIXED` of the source's
//! file, [`map_over`]) instead of copying them: the pages change owner, not place.
//!
//! A target reaches the source's files through `/proc/<pid>/fd/<n>`, which asks of the
//! target the same rights over the source as the shm provider's direct reads
//! (`process_vm_readv`); a target that lacks them copies instead. After the move, a
//! source punches out of its files every page no one took ([`punch`]): a file lives as
//! long as any of its pages is mapped, and the pages it still held would otherwise stay
//! allocated beside the copies.
//!
//! Mapped pages are `MAP_SHARED`, so a page must have one writer: a page is only ever
//! handed over whole and inside one overlap (the pages a block shares with its
//! neighbours are copied), and only in a blocking move, after which the source never
//! reads its old block again.
//!
//! This module holds the platform calls (memfd, mmap, fallocate, procfs); the executor
//! decides what to map (`redistribute`).

use serde::{Deserialize, Serialize};
use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// Whether pages may be handed over (`DUCTILE_PAGE_HANDOVER`, set by `init`).
static HANDOVER: AtomicBool = AtomicBool::new(true);

/// Turns page handover on or off (`DUCTILE_PAGE_HANDOVER`).
pub(crate) fn set_handover(on: bool) {
    HANDOVER.store(on, Ordering::Relaxed);
}

/// Whether pages may be handed over.
pub(crate) fn handover() -> bool {
    HANDOVER.load(Ordering::Relaxed)
}

/// The page size.
pub(crate) fn page() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    // SAFETY: sysconf has no preconditions.
    *PAGE.get_or_init(|| usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1))
}

fn page64() -> u64 {
    page() as u64
}

/// A run of whole pages of the global array (byte range `at`, page aligned) and the
/// file that holds them, from `file_off`.
#[derive(Clone, Debug)]
pub(crate) struct Run {
    pub at: Range<u64>,
    pub fd: Arc<OwnedFd>,
    pub file_off: u64,
}

/// A block's bytes in a shared-memory file of its own, mapped at the global array's
/// page boundaries (see the module docs); some of its pages may be mapped from other
/// files (pages handed over, [`Mapping::adopt`]).
#[derive(Debug)]
pub(crate) struct Mapping {
    base: *mut u8,
    map_len: usize,
    /// Global byte at mapping offset 0.
    origin: u64,
    /// Where the block's bytes start in the mapping.
    phase: usize,
    len: usize,
    own: Arc<OwnedFd>,
    /// Runs mapped from other files, in no order.
    foreign: Vec<Run>,
}

// SAFETY: the mapping is memory this value owns alone (unmapped on drop); the fds are
// plain descriptors.
unsafe impl Send for Mapping {}
// SAFETY: shared access only reads.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// `len` zero bytes for the block whose first byte is the array's byte `first`.
    ///
    /// # Errors
    /// The kernel refuses the file or the mapping (no memfd support, no memory, the fd
    /// limit).
    pub(crate) fn new(first: u64, len: usize) -> io::Result<Self> {
        let origin = first - first % page64();
        let phase = usize::try_from(first - origin).map_err(io::Error::other)?;
        let map_len = (phase + len).next_multiple_of(page()).max(page());
        // SAFETY: a NUL-terminated name; the returned fd is ours alone.
        let raw = unsafe { libc::memfd_create(c"ductile-block".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor we just opened and own.
        let own = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(map_len).map_err(io::Error::other)?;
        // SAFETY: a valid fd; resizing our own file.
        if unsafe { libc::ftruncate(own.as_raw_fd(), size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh shared mapping of our file, placed by the kernel.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                own.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { base: base.cast(), map_len, origin, phase, len, own: Arc::new(own), foreign: Vec::new() })
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: [phase, phase + len) lies inside the mapping, which lives as long as
        // `self`.
        unsafe { std::slice::from_raw_parts(self.base.add(self.phase), self.len) }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, borrowed exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(self.phase), self.len) }
    }

    /// The files behind the whole mapping, as runs of the global array, in order.
    pub(crate) fn runs(&self) -> Vec<Run> {
        let mut foreign = self.foreign.clone();
        foreign.sort_by_key(|r| r.at.start);
        let end = self.origin + self.map_len as u64;
        let mut runs = Vec::with_capacity(2 * foreign.len() + 1);
        let mut at = self.origin;
        for f in foreign {
            if f.at.start > at {
                runs.push(Run { at: at..f.at.start, fd: self.own.clone(), file_off: at - self.origin });
            }
            at = f.at.end;
            runs.push(f);
        }
        if end > at {
            runs.push(Run { at: at..end, fd: self.own.clone(), file_off: at - self.origin });
        }
        runs
    }

    /// The block's own file and the array's byte at its offset 0: where a page of the
    /// array lies in it.
    pub(crate) fn own_file(&self) -> (Arc<OwnedFd>, u64) {
        (self.own.clone(), self.origin)
    }

    /// Records that `run` was mapped over this block's pages ([`map_over`]).
    pub(crate) fn adopt(&mut self, run: Run) {
        self.foreign.push(run);
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping (and whatever was mapped over parts of it) is ours; no
        // borrow of its bytes outlives `self`.
        unsafe { libc::munmap(self.base.cast(), self.map_len) };
    }
}

/// Maps `fd` from `file_off` over `dst`, whole pages of this process's memory: `dst`'s
/// bytes become the file's, shared with whoever else maps them.
///
/// # Errors
/// `dst` is not whole pages, or the kernel refuses the mapping. Then `dst` holds fresh
/// zero pages (a failed `MAP_FIXED` may have unmapped them), so it stays memory.
pub(crate) fn map_over(dst: &mut [u8], fd: &OwnedFd, file_off: u64) -> io::Result<()> {
    let addr = dst.as_mut_ptr();
    if !(addr as usize).is_multiple_of(page())
        || !dst.len().is_multiple_of(page())
        || !file_off.is_multiple_of(page64())
    {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "pages handed over must be whole pages"));
    }
    if dst.is_empty() {
        return Ok(());
    }
    let off = libc::off_t::try_from(file_off).map_err(io::Error::other)?;
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: `dst` is memory of this process that we borrow exclusively; the new
    // mapping takes exactly its place, so every reference to it stays valid memory.
    let got = unsafe {
        libc::mmap(
            addr.cast(),
            dst.len(),
            rw,
            libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE,
            fd.as_raw_fd(),
            off,
        )
    };
    if got != libc::MAP_FAILED {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    // A failed MAP_FIXED may have unmapped the range: anonymous memory there at least
    // (the caller maps its own file back over it, see `Mapping::own_file`).
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED;
    // SAFETY: as above, with anonymous memory.
    let back = unsafe { libc::mmap(addr.cast(), dst.len(), rw, anon, -1, 0) };
    if back == libc::MAP_FAILED {
        tracing::error!("a failed page handover left {} bytes unmapped at {addr:p}", dst.len());
    }
    Err(err)
}

/// Frees the pages of `runs` that lie outside every range of `keep` (page aligned):
/// the pages no one took over, which the files would otherwise keep.
pub(crate) fn punch(runs: &[Run], keep: &[Range<u64>]) {
    let mut keep = keep.to_vec();
    keep.sort_by_key(|r| r.start);
    for run in runs {
        let mut at = run.at.start;
        for k in keep.iter().filter(|k| k.start < run.at.end && k.end > run.at.start) {
            punch_one(run, at..k.start.max(at));
            at = at.max(k.end);
        }
        punch_one(run, at..run.at.end);
    }
}

fn punch_one(run: &Run, r: Range<u64>) {
    if r.start >= r.end {
        return;
    }
    let (Ok(off), Ok(len)) =
        (libc::off_t::try_from(run.file_off + (r.start - run.at.start)), libc::off_t::try_from(r.end - r.start))
    else {
        return;
    };
    // SAFETY: a valid fd; freeing a range of a shared-memory file whose pages no one
    // uses any more (the caller's). A failure leaves them allocated until the file
    // goes, nothing worse.
    unsafe { libc::fallocate(run.fd.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off, len) };
}

/// Which processes can reach each other's files by pid: the same kernel boot and the
/// same pid namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Host {
    boot: String,
    pid_ns: u64,
}

impl Host {
    fn here() -> Option<Self> {
        static HERE: OnceLock<Option<Host>> = OnceLock::new();
        HERE.get_or_init(|| {
            let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?.trim().to_owned();
            let pid_ns = std::fs::metadata("/proc/self/ns/pid").ok()?.ino();
            Some(Self { boot, pid_ns })
        })
        .clone()
    }
}

/// One run as a source describes it to its targets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct OfferedRun {
    start: u64,
    end: u64,
    fd: i32,
    dev: u64,
    ino: u64,
    file_off: u64,
}

/// A source's pages, as its targets may map them: where its files are and which pages
/// of the array each holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Offer {
    host: Host,
    pid: u32,
    runs: Vec<OfferedRun>,
}

/// Most runs and most distinct files a block's pages may lie in and still be offered.
/// Each move can split a block's runs further (at the new blocks' boundaries) and a
/// target holds every file it maps from open, so a block beyond these is copied
/// instead, into a single file again: descriptors and mappings per process stay
/// bounded however many changes a job goes through.
const MAX_OFFERED_RUNS: usize = 64;
const MAX_OFFERED_FILES: usize = 16;
/// Most files a new block takes pages from: a target of many sources copies from the
/// rest (each file it maps from stays open while the block lives).
pub(crate) const MAX_TAKEN_FILES: usize = 64;

impl Offer {
    /// This process's offer of `runs`; `None` if there is nothing to offer, the pages
    /// lie in too many pieces (see [`MAX_OFFERED_RUNS`]) or the host cannot be told.
    pub(crate) fn of(runs: &[Run]) -> Option<Self> {
        if runs.is_empty() || runs.len() > MAX_OFFERED_RUNS || files_in(runs) > MAX_OFFERED_FILES {
            return None;
        }
        let runs = runs
            .iter()
            .map(|r| {
                let fd = r.fd.as_raw_fd();
                // SAFETY: a zeroed stat is a valid out-parameter; fd is open.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: as above.
                if unsafe { libc::fstat(fd, &mut st) } != 0 {
                    return None;
                }
                Some(OfferedRun {
                    start: r.at.start,
                    end: r.at.end,
                    fd,
                    dev: st.st_dev,
                    ino: st.st_ino,
                    file_off: r.file_off,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Self { host: Host::here()?, pid: std::process::id(), runs })
    }

    /// Opens the offered files that hold pages of `within` (a range of the array) from
    /// this process, each once; returns their runs.
    ///
    /// # Errors
    /// Another host or pid namespace, no right to the source's descriptors (ptrace
    /// rules), a descriptor that is no longer the file offered, or a run that is not
    /// whole pages or reaches past its file's end.
    pub(crate) fn open(&self, within: Range<u64>) -> io::Result<Vec<Run>> {
        if Host::here().as_ref() != Some(&self.host) {
            return Err(io::Error::other("the source runs on another host or pid namespace"));
        }
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("an offered run {what}"));
        let mut opened: Vec<(i32, Arc<OwnedFd>, u64)> = Vec::new();
        let mut runs = Vec::new();
        for r in self.runs.iter().filter(|r| r.start < within.end && r.end > within.start) {
            if !r.start.is_multiple_of(page64()) || !r.end.is_multiple_of(page64()) || r.start > r.end {
                return Err(bad("is not whole pages"));
            }
            if !r.file_off.is_multiple_of(page64()) {
                return Err(bad("starts inside a page of its file"));
            }
            let (fd, size) = match opened.iter().find(|(n, ..)| *n == r.fd) {
                Some((_, fd, size)) => (fd.clone(), *size),
                None => {
                    let path = format!("/proc/{}/fd/{}", self.pid, r.fd);
                    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path)?;
                    let meta = file.metadata()?;
                    if (meta.dev(), meta.ino()) != (r.dev, r.ino) {
                        return Err(io::Error::other(format!("{path} is no longer the file offered")));
                    }
                    let fd = Arc::new(OwnedFd::from(file));
                    opened.push((r.fd, fd.clone(), meta.len()));
                    (fd, meta.len())
                }
            };
            // Pages past the file's end would fault (SIGBUS) when touched, not fail here.
            if r.file_off.checked_add(r.end - r.start).is_none_or(|end| end > size) {
                return Err(bad("reaches past its file's end"));
            }
            runs.push(Run { at: r.start..r.end, fd, file_off: r.file_off });
        }
        Ok(runs)
    }
}

/// Distinct files among `runs`.
pub(crate) fn files_in(runs: &[Run]) -> usize {
    let mut fds: Vec<i32> = runs.iter().map(|r| r.fd.as_raw_fd()).collect();
    fds.sort_unstable();
    fds.dedup();
    fds.len()
}

/// The parts of `runs` over `inner` (whole pages of the array), in order, if they cover
/// every page of it; `None` if they leave a gap.
pub(crate) fn covering(runs: &[Run], inner: Range<u64>) -> Option<Vec<Run>> {
    let mut over: Vec<Run> = runs
        .iter()
        .filter(|r| r.at.start < inner.end && r.at.end > inner.start)
        .map(|r| {
            let at = r.at.start.max(inner.start)..r.at.end.min(inner.end);
            Run { file_off: r.file_off + (at.start - r.at.start), at, fd: r.fd.clone() }
        })
        .collect();
    over.sort_by_key(|r| r.at.start);
    let mut next = inner.start;
    for r in &over {
        if r.at.start != next {
            return None;
        }
        next = r.at.end;
    }
    (next == inner.end).then_some(over)
}

/// The whole pages inside the byte range `r` of the array.
pub(crate) fn inner_pages(r: Range<u64>) -> Range<u64> {
    let start = r.start.next_multiple_of(page64());
    let end = r.end / page64() * page64();
    if end > start {
        start..end
    } else {
        start..start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapping_puts_the_arrays_page_boundaries_on_its_own() {
        let p = page64();
        let m = Mapping::new(3 * p + 100, 5 * 4096 + 7).unwrap();
        assert_eq!(m.bytes().len(), 5 * 4096 + 7);
        assert_eq!((m.bytes().as_ptr() as u64) % p, 100);
        assert!(m.bytes().iter().all(|&b| b == 0));
        let runs = m.runs();
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].at.start, 3 * p);
        assert_eq!(runs[0].at.end % p, 0);
    }

    #[test]
    fn pages_handed_over_keep_their_bytes_and_the_rest_is_copied() {
        let p = page();
        // A source block of the array's bytes [p + 8, 9p), a target of [3p + 16, 7p).
        let mut src = Mapping::new(p as u64 + 8, 8 * p - 8).unwrap();
        for (i, b) in src.bytes_mut().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let offer = Offer::of(&src.runs()).unwrap();
        let runs = offer.open(0..u64::MAX).unwrap();
        let mut dst = Mapping::new(3 * p as u64 + 16, 4 * p - 16).unwrap();
        let inner = inner_pages(3 * p as u64 + 16..7 * p as u64);
        assert_eq!(inner, 4 * p as u64..7 * p as u64);
        let run = &runs[0];
        let at = (inner.start - (3 * p as u64 + 16)) as usize;
        let n = (inner.end - inner.start) as usize;
        map_over(&mut dst.bytes_mut()[at..at + n], &run.fd, run.file_off + inner.start - run.at.start).unwrap();
        dst.adopt(Run { at: inner.clone(), fd: run.fd.clone(), file_off: run.file_off + inner.start - run.at.start });
        // The edge is copied.
        let from = 2 * p + 8;
        let edge = src.bytes()[from..from + at].to_vec();
        dst.bytes_mut()[..at].copy_from_slice(&edge);
        let want: Vec<u8> = (from..from + 4 * p - 16).map(|i| (i % 251) as u8).collect();
        assert_eq!(dst.bytes(), &want[..]);
        // The target's runs: its own file, then the source's pages.
        let d = dst.runs();
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].at, 3 * p as u64..inner.start);
        assert_eq!(d[1].at, inner.clone());
        // The source frees the pages no one took; the target's stay.
        punch(&src.runs(), std::slice::from_ref(&inner));
        drop(src);
        assert_eq!(dst.bytes(), &want[..]);
        dst.bytes_mut()[at] = 0xaa;
        assert_eq!(dst.bytes()[at], 0xaa);
    }

    #[test]
    fn offers_from_elsewhere_or_not_whole_pages_are_refused() {
        let m = Mapping::new(0, 3 * page()).unwrap();
        let mut offer = Offer::of(&m.runs()).unwrap();
        offer.runs[0].start += 1;
        assert!(offer.open(0..u64::MAX).is_err());
        let mut offer = Offer::of(&m.runs()).unwrap();
        offer.host.boot.push('x');
        assert!(offer.open(0..u64::MAX).is_err());
        let mut offer = Offer::of(&m.runs()).unwrap();
        offer.runs[0].ino += 1;
        assert!(offer.open(0..u64::MAX).is_err());
        assert!(Offer::of(&[]).is_none());
        // A run past the file's end, and only the files of the range asked for.
        let mut offer = Offer::of(&m.runs()).unwrap();
        offer.runs[0].end += page64();
        assert!(offer.open(0..u64::MAX).is_err());
        assert!(offer.open(u64::MAX - 1..u64::MAX).unwrap().is_empty());
        // Pages in too many pieces are not offered.
        let p = page64();
        let fd = m.runs()[0].fd.clone();
        let many: Vec<Run> = (0..=MAX_OFFERED_RUNS as u64)
            .map(|i| Run { at: i * p..(i + 1) * p, fd: fd.clone(), file_off: 0 })
            .collect();
        assert!(Offer::of(&many[..MAX_OFFERED_RUNS]).is_some());
        assert!(Offer::of(&many).is_none());
        let mut v = vec![0u8; 3 * page()];
        assert!(map_over(&mut v[1..page() + 1], &fd, 0).is_err());
    }

    #[test]
    fn a_refused_mapping_leaves_memory_that_the_own_file_can_take_back() {
        let p = page();
        let mut m = Mapping::new(0, 4 * p).unwrap();
        m.bytes_mut().fill(3);
        // A pipe cannot be mapped: the range is left as memory, not as a hole.
        let (r, w) = std::io::pipe().unwrap();
        drop(w);
        let pipe = OwnedFd::from(r);
        assert!(map_over(&mut m.bytes_mut()[p..3 * p], &pipe, 0).is_err());
        m.bytes_mut()[p..3 * p].fill(9);
        // The own file mapped back shows its own bytes again.
        let (own, origin) = m.own_file();
        map_over(&mut m.bytes_mut()[p..3 * p], &own, p as u64 - origin).unwrap();
        assert!(m.bytes().iter().all(|&b| b == 3));
    }

    #[test]
    fn runs_cover_a_range_only_without_gaps() {
        let p = page64();
        let fd = Mapping::new(0, 8 * page()).unwrap().runs()[0].fd.clone();
        let run = |a: u64, b: u64, off: u64| Run { at: a * p..b * p, fd: fd.clone(), file_off: off * p };
        // Two runs, given out of order, cut to the range; file offsets follow the cut.
        let over = covering(&[run(4, 8, 10), run(0, 4, 0)], p..6 * p).unwrap();
        assert_eq!(
            over.iter().map(|r| (r.at.clone(), r.file_off)).collect::<Vec<_>>(),
            [(p..4 * p, p), (4 * p..6 * p, 10 * p)]
        );
        assert!(covering(&[run(0, 2, 0), run(3, 8, 0)], p..6 * p).is_none(), "a gap");
        assert!(covering(&[run(0, 5, 0)], p..6 * p).is_none(), "short");
        assert_eq!(covering(&[], p..p).unwrap().len(), 0);
    }

    #[test]
    fn inner_pages_are_the_whole_pages_of_a_range() {
        let p = page64();
        assert_eq!(inner_pages(0..3 * p), 0..3 * p);
        assert_eq!(inner_pages(1..3 * p - 1), p..2 * p);
        assert!(inner_pages(1..p + 5).is_empty());
        assert!(inner_pages(5..6).is_empty());
    }
}
