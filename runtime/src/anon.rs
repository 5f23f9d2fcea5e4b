//! Blocks in private anonymous mappings of their own, whose pages a move recycles
//! instead of faulting in fresh ones.
//!
//! Over a transport that copies (tcp, quic), a shrink is bound by the processor: the
//! sources' copies into the sockets, the targets' copies out of them and the first
//! touch of every page of the new blocks (a fault per 4 KiB page, 80 ms per 256 MiB on
//! this project's VM) share two cores (docs/BENCHMARKS.md). Yet a member that stays
//! holds, once its old block is sent, a whole block of pages it is about to free. In a
//! blocking move (a background move keeps its blocks on the heap), every executor
//! moves the pages of the member's own overlap into its new block with
//! `mremap` (page tables change, no byte is copied, no page is faulted), where they
//! keep their bytes. The one-sided and point-to-point executors, whose targets choose
//! when each overlap lands, also move the old block's other pages under overlaps they
//! then read or receive into them (`redistribute`).
//!
//! For the own overlap to move whole, a block is mapped as [`crate::pages::Mapping`]
//! maps its files: the global array's byte `g` sits at mapping offset `g - origin`,
//! `origin` being the block's first byte rounded down to a page, so the array's page
//! boundaries are the mapping's in every block.
//!
//! `mremap` moves pages within one kernel mapping only, and each move makes the
//! destination's range a mapping of its own. A block keeps the offsets where such
//! mappings meet ([`Anon::seams`]) and moves are split there; a block with more than
//! [`MAX_SEAMS`] of them is neither recycled nor recycled into, which bounds the
//! mappings a process holds over many changes.

use ductile_transport::Capabilities;
use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::pages::page;

/// Whether pages may be recycled (`DUCTILE_PAGE_RECYCLE`, set by `init`).
static RECYCLE: AtomicBool = AtomicBool::new(true);

/// Turns page recycling on or off (`DUCTILE_PAGE_RECYCLE`).
pub(crate) fn set_recycling(on: bool) {
    RECYCLE.store(on, Ordering::Relaxed);
}

/// Whether moves over a transport with `caps` recycle pages: it is on, and the
/// transport lets go of a window's memory once its readers have their bytes
/// (`releases_windows`: tcp, fabric shm with direct copies). Over shm, one-sided moves
/// hand pages over instead, unless `DUCTILE_PAGE_HANDOVER=0` (their blocks live in
/// files, see [`crate::pages`]); the other executors recycle.
pub(crate) fn recycling(caps: &Capabilities) -> bool {
    RECYCLE.load(Ordering::Relaxed) && caps.releases_windows
}

/// A block with more seams than this is neither recycled nor recycled into.
pub(crate) const MAX_SEAMS: usize = 32;

/// A block's bytes in a private anonymous mapping of its own, placed at the global
/// array's page boundaries (see the module docs).
#[derive(Debug)]
pub(crate) struct Anon {
    base: *mut u8,
    map_len: usize,
    /// Where the block's bytes start in the mapping.
    phase: usize,
    len: usize,
    /// Mapping offsets (page aligned, strictly inside) where two kernel mappings may
    /// meet, sorted.
    seams: Vec<usize>,
}

// SAFETY: the mapping is memory this value owns alone (unmapped on drop).
unsafe impl Send for Anon {}
// SAFETY: shared access only reads.
unsafe impl Sync for Anon {}

impl Anon {
    /// `len` zero bytes for the block whose first byte is the array's byte `first`.
    /// The pages are only reserved: each is populated when first written.
    ///
    /// # Errors
    /// The kernel refuses the mapping (no address space, a mapping limit).
    pub(crate) fn new(first: u64, len: usize) -> io::Result<Self> {
        let phase = usize::try_from(first % page() as u64).map_err(io::Error::other)?;
        let map_len = (phase + len).next_multiple_of(page()).max(page());
        // SAFETY: a fresh private mapping placed by the kernel.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { base: base.cast(), map_len, phase, len, seams: Vec::new() })
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

    /// Where the block's byte 0 sits in the mapping.
    pub(crate) fn phase(&self) -> usize {
        self.phase
    }

    /// The whole pages of the mapping, as mapping offsets.
    pub(crate) fn mapping(&self) -> Range<usize> {
        0..self.map_len
    }

    /// Whether the block may be recycled or recycled into ([`MAX_SEAMS`]).
    pub(crate) fn recyclable(&self) -> bool {
        self.seams.len() <= MAX_SEAMS
    }

    /// The mapping offsets where two kernel mappings may meet.
    #[cfg(test)]
    pub(crate) fn seams(&self) -> &[usize] {
        &self.seams
    }

    /// Asks for transparent huge pages on the whole mapping (see `crate::block`).
    pub(crate) fn advise_huge(&mut self) {
        // SAFETY: the mapping is ours, borrowed exclusively; the advice changes how its
        // pages are backed, never its bytes. A kernel without huge pages refuses it.
        let _ = unsafe { libc::madvise(self.base.cast(), self.map_len, libc::MADV_HUGEPAGE) };
    }

    /// Records that the mapping range `at` (page aligned) now holds pages moved in
    /// from elsewhere ([`move_pages`]).
    pub(crate) fn moved_in(&mut self, at: Range<usize>) {
        for s in [at.start, at.end] {
            if s > 0 && s < self.map_len {
                if let Err(i) = self.seams.binary_search(&s) {
                    self.seams.insert(i, s);
                }
            }
        }
    }
}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: the mapping is ours and nothing borrows it any more.
        unsafe { libc::munmap(self.base.cast(), self.map_len) };
    }
}

/// The whole pages of the mapping inside the block's byte range `r`, as mapping
/// offsets (empty if none).
pub(crate) fn inner(phase: usize, r: &Range<usize>) -> Range<usize> {
    let start = (r.start + phase).next_multiple_of(page());
    let end = (r.end + phase) / page() * page();
    if end > start {
        start..end
    } else {
        start..start
    }
}

/// The pages of the mapping that hold any byte of the block's byte range `r`, as
/// mapping offsets.
pub(crate) fn touched(phase: usize, r: &Range<usize>) -> Range<usize> {
    if r.is_empty() {
        return 0..0;
    }
    (r.start + phase) / page() * page()..(r.end + phase).next_multiple_of(page())
}

/// Moves the pages at mapping offsets `from..from + dst.len()` of `src` to `dst`
/// (page aligned, of whole pages), leaving zero pages behind in `src`. The bytes of
/// `dst` are those pages' afterwards. Returns the pieces of `dst` (offsets into it)
/// moved by one call each, every one now a kernel mapping of its own, which the caller
/// records in the block that owns `dst` ([`Anon::moved_in`]).
///
/// # Errors
/// The kernel refused a move (an old kernel without `MREMAP_DONTUNMAP`, an address
/// space or commit limit): the pieces moved before it, and the error. The rest of `dst`
/// keeps its pages, except where the refused call had already unmapped them (a refused
/// `MREMAP_FIXED` may): fresh zero pages are mapped there, a kernel mapping of their
/// own (`Refused::fresh`). If not even those can be mapped, the error is [`Hole`]:
/// `dst` must not be touched again.
pub(crate) fn move_pages(dst: &mut [u8], src: &mut Anon, from: usize) -> Result<Vec<Range<usize>>, Refused> {
    let (addr, len) = (dst.as_mut_ptr() as usize, dst.len());
    let whole = |n: usize| n.is_multiple_of(page());
    if !whole(addr) || !whole(len) || !whole(from) || from + len > src.map_len {
        let e = io::Error::new(io::ErrorKind::InvalidInput, "pages to move are not whole pages of the block");
        return Err(Refused { moved: Vec::new(), fresh: 0..0, error: e });
    }
    let mut moved = Vec::new();
    let mut done = 0;
    while done < len {
        // One kernel mapping at a time: up to the next seam of the source.
        let at = from + done;
        let seam = src.seams.iter().copied().find(|&s| s > at).unwrap_or(src.map_len);
        let n = (seam - at).min(len - done);
        // SAFETY: the source range lies inside `src`'s mapping, which we borrow
        // exclusively; the destination is memory we borrow exclusively. With
        // DONTUNMAP the source stays mapped (its pages read as zero afterwards).
        let r = unsafe {
            libc::mremap(
                src.base.add(at).cast(),
                n,
                n,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP,
                (addr + done) as *mut libc::c_void,
            )
        };
        if r == libc::MAP_FAILED {
            let error = io::Error::last_os_error();
            return match refill((addr + done) as *mut libc::c_void, n) {
                // Refused before the destination was touched: it keeps its pages.
                Ok(false) => Err(Refused { moved, fresh: 0..0, error }),
                Ok(true) => Err(Refused { moved, fresh: done..done + n, error }),
                Err(e) => Err(Refused { moved, fresh: 0..0, error: io::Error::other(Hole(error, e)) }),
            };
        }
        moved.push(done..done + n);
        done += n;
    }
    Ok(moved)
}

/// Maps fresh zero pages wherever `len` bytes at `addr` (page aligned, memory the caller
/// borrows exclusively) are not all mapped. Returns whether it did.
///
/// # Errors
/// The kernel refused the fresh pages too.
fn refill(addr: *mut libc::c_void, len: usize) -> io::Result<bool> {
    let mut resident = vec![0u8; len.div_ceil(page())];
    // SAFETY: `resident` has a byte for every page of the range; mincore only reports,
    // failing with ENOMEM if a page of the range is not mapped.
    if unsafe { libc::mincore(addr, len, resident.as_mut_ptr()) } == 0 {
        return Ok(false);
    }
    // SAFETY: memory the caller borrows exclusively, partly unmapped: fresh private
    // pages take the whole range's place.
    let fresh = unsafe {
        libc::mmap(
            addr,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if fresh == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(true)
}

/// A move of pages the kernel refused partway ([`move_pages`]).
#[derive(Debug)]
pub(crate) struct Refused {
    /// The pieces moved before the refusal (offsets into the destination).
    pub moved: Vec<Range<usize>>,
    /// Where the refused call had unmapped the destination: fresh pages now, in a
    /// mapping of their own.
    pub fresh: Range<usize>,
    pub error: io::Error,
}

impl Refused {
    /// Whether the destination is usable (no [`Hole`]).
    pub(crate) fn whole(&self) -> bool {
        self.error.get_ref().is_none_or(|e| !e.is::<Hole>())
    }

    /// Every piece of the destination that is now a kernel mapping of its own.
    pub(crate) fn mappings(self) -> Vec<Range<usize>> {
        let mut m = self.moved;
        m.extend(Some(self.fresh).filter(|r| !r.is_empty()));
        m
    }
}

/// Neither the pages asked for nor fresh ones could be mapped into a destination: part
/// of it is unmapped.
#[derive(Debug, thiserror::Error)]
#[error("part of a block is left unmapped after a refused page move ({0}), and fresh pages were refused too: {1}")]
pub(crate) struct Hole(io::Error, io::Error);

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(first: u64, len: usize) -> Anon {
        let mut a = Anon::new(first, len).unwrap();
        for (i, b) in a.bytes_mut().iter_mut().enumerate() {
            *b = ((first as usize + i) % 251) as u8;
        }
        a
    }

    #[test]
    fn blocks_sit_at_the_arrays_page_boundaries() {
        let p = page();
        let a = Anon::new(3 * p as u64 + 10, 5 * p).unwrap();
        assert_eq!(a.phase(), 10);
        assert_eq!(a.bytes().len(), 5 * p);
        assert_eq!(a.mapping(), 0..6 * p);
        assert!(a.bytes().iter().all(|&b| b == 0));
        assert_eq!(a.bytes().as_ptr() as usize % 8, 2);
        assert_eq!(inner(10, &(0..5 * p)), p..5 * p);
        assert_eq!(inner(10, &(0..p)), p..p);
        assert_eq!(touched(10, &(0..p)), 0..2 * p);
        assert_eq!(touched(10, &(5..5)), 0..0);
        let empty = Anon::new(7, 0).unwrap();
        assert!(empty.bytes().is_empty());
    }

    #[test]
    fn moved_pages_keep_their_bytes_and_leave_zeros_behind() {
        let p = page();
        // An old block of the array's bytes 2p+100 .. 9p and a new one of p+7 .. 12p:
        // their overlap's whole pages are the array's pages 3 .. 9.
        let mut old = filled(2 * p as u64 + 100, 7 * p - 100);
        let mut new = Anon::new(p as u64 + 7, 11 * p - 7).unwrap();
        let (old_at, new_at) = (p - old.phase(), 2 * p - new.phase());
        let dst = &mut new.bytes_mut()[new_at..new_at + 6 * p];
        assert_eq!(move_pages(dst, &mut old, p).unwrap(), vec![0..6 * p]);
        new.moved_in(2 * p..8 * p);
        assert_eq!(new.seams(), &[2 * p, 8 * p]);
        for (i, &b) in new.bytes()[new_at..new_at + 6 * p].iter().enumerate() {
            assert_eq!(b, ((3 * p + i) % 251) as u8, "byte {i}");
        }
        assert!(old.bytes()[old_at..old_at + 6 * p].iter().all(|&b| b == 0));
        // The rest of both is untouched.
        assert!(old.bytes()[..old_at].iter().enumerate().all(|(i, &b)| b == ((2 * p + 100 + i) % 251) as u8));
        assert!(new.bytes()[..new_at].iter().chain(&new.bytes()[new_at + 6 * p..]).all(|&b| b == 0));
    }

    #[test]
    fn moves_across_seams_go_one_mapping_at_a_time() {
        let p = page();
        let mut a = filled(0, 8 * p);
        let mut b = filled(0, 8 * p);
        // Pages 2 .. 5 of `a` come from `b`: `a` is now three kernel mappings.
        move_pages(&mut a.bytes_mut()[2 * p..5 * p], &mut b, 2 * p).unwrap();
        a.moved_in(2 * p..5 * p);
        assert!(a.recyclable());
        // Pages 1 .. 7 of `a` span both seams: three moves, three mappings in `c`.
        let mut c = Anon::new(0, 8 * p).unwrap();
        let pieces = move_pages(&mut c.bytes_mut()[p..7 * p], &mut a, p).unwrap();
        assert_eq!(pieces, vec![0..p, p..4 * p, 4 * p..6 * p]);
        assert!(c.bytes()[p..7 * p].iter().enumerate().all(|(i, &x)| x == ((p + i) % 251) as u8));
        assert!(a.bytes()[p..7 * p].iter().all(|&x| x == 0));
        assert!(b.bytes()[2 * p..5 * p].iter().all(|&x| x == 0));
    }

    /// Set in the child process of the test below.
    const REFUSAL_CHILD: &str = "DUCTILE_TEST_REFUSED_MOVE";

    #[test]
    fn a_refused_move_is_reported_and_leaves_no_silent_hole() {
        const NAME: &str = "anon::tests::a_refused_move_is_reported_and_leaves_no_silent_hole";
        if std::env::var_os(REFUSAL_CHILD).is_none() {
            // The refusal comes from an address-space limit, which would hold every
            // test of this process: the test runs again alone in a child process.
            let exe = std::env::current_exe().unwrap();
            let out = std::process::Command::new(exe)
                .args(["--exact", NAME, "--test-threads", "1"])
                .env(REFUSAL_CHILD, "1")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && text.contains("1 passed"),
                "{text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            return;
        }
        let p = page();
        let n = 512 * p;
        let mut a = filled(0, n);
        let mut b = filled(0, n + 2 * p);
        // A move that leaves its source mapped (DONTUNMAP) grows the address space by
        // what it moves, which a limit below the present size does not allow.
        let size = std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmSize:")?.trim().strip_suffix(" kB")?.parse::<u64>().ok())
            .unwrap();
        let limit = (size << 10) - (n as u64) / 2;
        let rl = libc::rlimit { rlim_cur: limit, rlim_max: libc::RLIM_INFINITY };
        // SAFETY: lowers this (child) process's own soft limit.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &rl) }, 0);
        let refused = move_pages(&mut b.bytes_mut()[p..p + n], &mut a, 0).unwrap_err();
        assert!(refused.moved.is_empty(), "{:?}", refused.error);
        if !refused.whole() {
            // A kernel that unmaps the destination before it refuses, under a limit that
            // then refuses fresh pages too: the one case the move must report as fatal.
            assert!(refused.error.to_string().contains("left unmapped"), "{:?}", refused.error);
            return;
        }
        // The destination holds its own bytes, or fresh zeros where the refused call
        // had unmapped it, and can be written; the pages around it are untouched.
        let old = |i: usize| (i % 251) as u8;
        let kept = |i: usize| if refused.fresh.contains(&(i - p)) { 0 } else { old(i) };
        assert!(b.bytes()[p..p + n].iter().enumerate().all(|(i, &x)| x == kept(p + i)));
        b.bytes_mut()[p..p + n].fill(9);
        assert!(b.bytes()[..p]
            .iter()
            .enumerate()
            .chain(b.bytes().iter().enumerate().skip(p + n))
            .all(|(i, &x)| x == old(i)));
        assert!(a.bytes().iter().enumerate().all(|(i, &x)| x == old(i)));
    }

    #[test]
    fn a_range_left_unmapped_gets_fresh_pages_and_a_mapped_one_keeps_its_own() {
        let p = page();
        let mut b = filled(0, 6 * p);
        let base = b.bytes_mut().as_mut_ptr();
        // SAFETY: pages 2 and 3 of `b`'s own mapping, refilled below before any use.
        assert_eq!(unsafe { libc::munmap(base.add(2 * p).cast(), 2 * p) }, 0);
        // SAFETY (both): ranges inside `b`'s mapping, which this test holds alone.
        assert!(!refill(unsafe { base.add(4 * p) }.cast(), 2 * p).unwrap());
        assert!(refill(unsafe { base.add(p) }.cast(), 3 * p).unwrap());
        // Pages 1 .. 4 are fresh zeros (the mapped page 1 among them), the rest kept.
        let old = |i: usize| (i % 251) as u8;
        assert!(b.bytes().iter().enumerate().all(|(i, &x)| x == if (p..4 * p).contains(&i) { 0 } else { old(i) }));
        b.bytes_mut().fill(1);
    }

    #[test]
    fn a_move_of_partial_pages_is_refused_and_moves_nothing() {
        let p = page();
        let mut a = filled(0, 4 * p);
        let mut b = Anon::new(0, 4 * p).unwrap();
        let refused = move_pages(&mut b.bytes_mut()[1..p + 1], &mut a, 0).unwrap_err();
        assert_eq!(refused.error.kind(), io::ErrorKind::InvalidInput);
        assert!(refused.whole());
        assert!(refused.mappings().is_empty());
        assert!(move_pages(&mut b.bytes_mut()[..p], &mut a, 4 * p).is_err());
        assert!(a.bytes().iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
    }
}
