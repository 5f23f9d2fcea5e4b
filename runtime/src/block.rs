//! Memory for registered blocks: bytes aligned to a cache line (64 bytes).
//!
//! A block a change brings is written once into memory no one has touched, so every
//! 4 KiB page costs a fault; on this project's VM filling fresh memory runs at about
//! 1.5 GB/s against 9.8 GB/s for warm memory (redistribution bench references).
//! Prefaulting the whole new block with `MAP_POPULATE` before the move gave nothing.
//! Plain allocations it is (large ones are fresh mappings from the allocator), each
//! piece populated just before data is copied into it ([`fill`]): 10-15 % faster
//! shrinks over tcp (8 → 2 collective 1.70 → 1.98 GB/s, single runs of the
//! redistribution bench's job). Transparent huge pages are there on request
//! (`DUCTILE_HUGE_PAGES=1`, [`advise_huge`]): twice as fast when the hypervisor has
//! backed the memory, several times slower when it has not.

use crate::anon::Anon;
use crate::pages::{Mapping, Run};
use ductile_transport::Landing;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Bytes aligned for any element of a registered item (at least [`LINE`] bytes
/// whatever the element, or the element's own alignment in a mapping, where a block
/// starts at its global byte offset within a page): on the heap, in a mapping of their own whose pages a
/// move may recycle ([`crate::anon`]), or in a shared-memory file whose pages a move may
/// hand over to another process ([`crate::pages`]).
#[derive(Debug, Default)]
pub(crate) struct Aligned {
    store: Store,
    len: usize,
}

#[derive(Debug)]
enum Store {
    /// Words from the allocator, the block starting `at` bytes in, at a [`LINE`]
    /// boundary. Words, not lines: the allocator zeroes memory of 8- or 16-byte
    /// alignment lazily (a large block is a fresh mapping), of 64 by writing it all.
    Words(Vec<u64>, usize),
    Anon(Anon),
    Mapped(Mapping),
}

/// Where a registered block lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Place {
    /// On the heap.
    #[default]
    Heap,
    /// In a private mapping of its own, whose pages a move recycles
    /// ([`crate::anon`]).
    Pages,
    /// In a shared-memory file, whose pages a one-sided move hands over
    /// ([`crate::pages`]).
    Files,
}

/// Alignment of blocks on the heap: a cache line, as for `#[repr(align(64))]` element
/// types (and so for `u128` and SIMD vectors).
pub(crate) const LINE: usize = 64;

impl Default for Store {
    fn default() -> Self {
        Self::Words(Vec::new(), 0)
    }
}

/// Blocks of fewer bytes stay on the heap even where pages could be handed over: a few
/// pages are copied faster than mapped.
const MAPPED_MIN: usize = 1 << 20;

/// Blocks of fewer bytes stay on the heap even where their pages could be recycled
/// ([`crate::anon`]): glibc serves them from memory it reuses (`init` sets its mmap
/// threshold to this), often still faulted in, where a mapping of their own is always
/// fresh. A 2 → 4 rma move of 16 MiB over tcp ran at 1.6 GB/s with such mappings
/// against 2.2 on the heap (medians of 5 jobs); larger blocks come from fresh
/// mappings either way.
const PAGES_MIN: usize = 32 << 20;

impl Clone for Aligned {
    /// A copy on the heap.
    fn clone(&self) -> Self {
        Self::from_bytes(self.bytes())
    }
}

impl AsRef<[u8]> for Aligned {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

impl AsMut<[u8]> for Aligned {
    fn as_mut(&mut self) -> &mut [u8] {
        self.bytes_mut()
    }
}

impl Aligned {
    /// `len` zero bytes. With `DUCTILE_HUGE_PAGES=1`, a large block's memory gets
    /// transparent huge pages when the kernel has them free (see [`advise_huge`]).
    pub(crate) fn zeroed(len: usize) -> Self {
        // Zeroed by the allocator: a large block is a fresh mapping whose pages stay
        // untouched until written.
        let words = vec![0u64; (len + LINE).div_ceil(8)];
        let at = (LINE - words.as_ptr() as usize % LINE) % LINE;
        let mut a = Self { store: Store::Words(words, at), len };
        if len >= HUGE_MIN && HUGE_PAGES.load(Ordering::Relaxed) {
            advise_huge(a.bytes_mut());
        }
        a
    }

    /// `len` zero bytes for the block whose first byte is the global array's byte
    /// `first`, in a shared-memory file whose pages can be handed over
    /// ([`crate::pages`]); on the heap if small or if the kernel refuses the file.
    pub(crate) fn mapped(len: usize, first: u64) -> Self {
        if len < MAPPED_MIN {
            return Self::zeroed(len);
        }
        match Mapping::new(first, len) {
            Ok(m) => Self { store: Store::Mapped(m), len },
            Err(e) => {
                tracing::debug!("a block of {len} bytes stays on the heap: {e}");
                Self::zeroed(len)
            }
        }
    }

    /// `len` zero bytes for the block whose first byte is the global array's byte
    /// `first`, placed as `place` asks (on the heap if small or if the kernel refuses).
    pub(crate) fn placed(place: Place, len: usize, first: u64) -> Self {
        match place {
            Place::Heap => Self::zeroed(len),
            Place::Files => Self::mapped(len, first),
            Place::Pages if len < PAGES_MIN => Self::zeroed(len),
            Place::Pages => match Anon::new(first, len) {
                Ok(mut m) => {
                    // The advice goes to the whole mapping, which it then does not split
                    // (moves of its pages stay within one kernel mapping, see `anon`).
                    if len >= HUGE_MIN && HUGE_PAGES.load(Ordering::Relaxed) && huge_pages_free() >= 2 * len / HUGE_PAGE
                    {
                        m.advise_huge();
                    }
                    Self { store: Store::Anon(m), len }
                }
                Err(e) => {
                    tracing::debug!("a block of {len} bytes stays on the heap: {e}");
                    Self::zeroed(len)
                }
            },
        }
    }

    /// A copy of `b` placed as [`Aligned::placed`] does.
    pub(crate) fn placed_from(place: Place, b: &[u8], first: u64) -> Self {
        let mut a = Self::placed(place, b.len(), first);
        fill(a.bytes_mut(), b);
        a
    }

    /// A copy of `b`.
    pub(crate) fn from_bytes(b: &[u8]) -> Self {
        let mut a = Self::zeroed(b.len());
        a.bytes_mut().copy_from_slice(b);
        a
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        match &self.store {
            Store::Words(w, at) => &bytemuck::cast_slice::<u64, u8>(w)[*at..*at + self.len],
            Store::Anon(m) => m.bytes(),
            Store::Mapped(m) => m.bytes(),
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.store {
            Store::Words(w, at) => &mut bytemuck::cast_slice_mut::<u64, u8>(w)[*at..*at + self.len],
            Store::Anon(m) => m.bytes_mut(),
            Store::Mapped(m) => m.bytes_mut(),
        }
    }

    /// Whether the block's pages can be handed over ([`Aligned::mapped`]).
    pub(crate) fn is_mapped(&self) -> bool {
        matches!(self.store, Store::Mapped(_))
    }

    /// The files behind the block's pages (none on the heap).
    pub(crate) fn runs(&self) -> Vec<Run> {
        match &self.store {
            Store::Mapped(m) => m.runs(),
            _ => Vec::new(),
        }
    }

    /// The block's own file and the array's byte at its offset 0, if it lives in files.
    pub(crate) fn own_file(&self) -> Option<(std::sync::Arc<std::os::fd::OwnedFd>, u64)> {
        match &self.store {
            Store::Mapped(m) => Some(m.own_file()),
            _ => None,
        }
    }

    /// Records pages mapped over the block's ([`crate::pages::map_over`]).
    pub(crate) fn adopt(&mut self, runs: Vec<Run>) {
        if let Store::Mapped(m) = &mut self.store {
            for r in runs {
                m.adopt(r);
            }
        }
    }

    /// The block's mapping, if it lives in one whose pages may be recycled
    /// ([`crate::anon`]).
    pub(crate) fn pages(&self) -> Option<&Anon> {
        match &self.store {
            Store::Anon(m) if m.recyclable() => Some(m),
            _ => None,
        }
    }

    /// As [`Aligned::pages`], to move pages out of or record pages moved in.
    pub(crate) fn pages_mut(&mut self) -> Option<&mut Anon> {
        match &mut self.store {
            Store::Anon(m) if m.recyclable() => Some(m),
            _ => None,
        }
    }

    /// Records pages moved into the block's mapping at `ranges` (mapping offsets, see
    /// [`crate::anon::move_pages`]).
    pub(crate) fn moved_in(&mut self, ranges: &[std::ops::Range<usize>]) {
        if let Store::Anon(m) = &mut self.store {
            for r in ranges {
                m.moved_in(r.clone());
            }
        }
    }

    /// The block as a landing for gets to read into in place.
    pub(crate) fn into_landing(self) -> Arc<Landing> {
        Landing::from_owner(self)
    }

    /// The block back from its landing; `None` while a part is still out.
    pub(crate) fn from_landing(landing: Arc<Landing>) -> Option<Self> {
        Landing::into_owner(landing).ok()
    }
}

/// A block shared between a move and the transport that serves it as a window (see
/// [`crate::anon`]): the move takes it back once the transport lets go.
pub(crate) struct Shared(pub std::sync::Arc<Aligned>);

impl AsRef<[u8]> for Shared {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

/// Blocks of at least this many bytes are given huge pages ([`advise_huge`]): glibc
/// serves them from a mapping of their own (`init` sets its mmap threshold to 32 MiB,
/// and no larger one is accepted), which no one has touched and which goes away with the
/// block, advice and all. Smaller blocks may come from the heap, reused memory whose
/// advice would outlive them.
const HUGE_MIN: usize = 32 << 20;
/// A transparent huge page (x86-64, aarch64 with 4 KiB pages).
const HUGE_PAGE: usize = 2 << 20;
/// Whether large blocks get huge pages (`DUCTILE_HUGE_PAGES`, set by `init`; off by
/// default, see [`advise_huge`]).
static HUGE_PAGES: AtomicBool = AtomicBool::new(false);

/// Turns huge pages for large blocks on or off (`DUCTILE_HUGE_PAGES`).
pub(crate) fn set_huge_pages(on: bool) {
    HUGE_PAGES.store(on, Ordering::Relaxed);
}

/// Asks for transparent huge pages (`MADV_HUGEPAGE`) on the 2 MiB-aligned inside of
/// `mem`, memory no one has touched yet, if the kernel has at least twice that many free
/// ([`huge_pages_free`]).
///
/// Filling fresh memory costs a fault per 4 KiB page ([`fill`]): populating 256 MiB
/// took 81 ms on this project's VM, and with huge pages 11 ms, so a 4 → 1 collective
/// over tcp ran at 4.7-5.2 GB/s instead of 2.2-2.4. When none is free, though, the
/// faulting thread compacts memory itself (the usual `defrag=madvise` setting), so huge
/// pages are asked for only when they are there. Off by default: on that VM a huge
/// page the hypervisor has not backed yet took 565 ms to populate 256 MiB, and huge
/// pages came from such memory in about a third of the jobs, which then ran at 0.6-1.2
/// GB/s (docs/BENCHMARKS.md). Worth turning on for bare-metal nodes.
fn advise_huge(mem: &mut [u8]) {
    let addr = mem.as_mut_ptr() as usize;
    let start = addr.next_multiple_of(HUGE_PAGE);
    let end = (addr + mem.len()) / HUGE_PAGE * HUGE_PAGE;
    if end <= start || huge_pages_free() < 2 * (end - start) / HUGE_PAGE {
        return;
    }
    // SAFETY: [start, end) lies inside `mem`, memory of this process that we borrow
    // mutably; the advice changes how its pages are backed, never its bytes.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    // A kernel without transparent huge pages refuses it: plain pages then.
    let _ = rc;
}

/// Free 2 MiB blocks of physical memory, by `/proc/buddyinfo` (0 if unreadable).
fn huge_pages_free() -> usize {
    std::fs::read_to_string("/proc/buddyinfo").map_or(0, |text| free_huge_in(&text))
}

/// Free 2 MiB blocks in a `/proc/buddyinfo` text: per zone, the free blocks of order
/// 9 (2 MiB with 4 KiB pages) and up, each order counting twice the one below.
fn free_huge_in(buddyinfo: &str) -> usize {
    const ORDER: usize = 9;
    buddyinfo
        .lines()
        .filter_map(|l| l.split_once("zone").map(|(_, rest)| rest))
        .flat_map(|rest| {
            // After "zone": the zone's name, then the free blocks of order 0, 1, ...
            rest.split_whitespace().skip(1).enumerate().skip(ORDER).filter_map(|(order, n)| {
                n.parse::<usize>().ok().map(|n| n.saturating_mul(1usize << (order - ORDER).min(20)))
            })
        })
        .fold(0usize, usize::saturating_add)
}

/// Copies `src` into `dst`, memory that may never have been touched (a new block). Its
/// whole pages are first faulted in by the kernel in one call (`MADV_POPULATE_WRITE`,
/// Linux 5.14 and later; older kernels refuse it and the copy takes the faults): on this
/// project's VM a 256 MiB memcpy into fresh pages takes 160 ms taking a fault per page,
/// and 55 + 25 ms populated first.
pub(crate) fn fill(dst: &mut [u8], src: &[u8]) {
    populate(dst);
    dst.copy_from_slice(src);
}

/// Below this a range is copied without populating it first.
const POPULATE_MIN: usize = 256 << 10;

/// Faults in the whole pages of `mem` (at least [`POPULATE_MIN`] bytes) in one call, so
/// that writing them takes no page fault; see [`fill`].
pub(crate) fn populate(mem: &mut [u8]) {
    if mem.len() >= POPULATE_MIN {
        ductile_transport::populate(mem);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resident_bytes() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let kib = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).unwrap();
        kib.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() << 10
    }

    #[test]
    fn zeroed_blocks_touch_no_page_until_written() {
        // 1 GiB on the heap: fresh pages are faulted in as data lands, not all at once
        // here (other tests run meanwhile, hence the wide margin).
        let before = resident_bytes();
        let block = Aligned::zeroed(1 << 30);
        let grown = resident_bytes().saturating_sub(before);
        assert!(grown < 256 << 20, "a zeroed 1 GiB block made {} MiB resident", grown >> 20);
        assert_eq!(block.bytes()[(1 << 30) - 1], 0);
        assert_eq!(block.bytes().as_ptr() as usize % LINE, 0);
    }

    #[test]
    fn blocks_hold_what_is_written() {
        for len in [0, 1, 7, 4096, (2 << 20) + 5] {
            let mut a = Aligned::zeroed(len);
            assert_eq!(a.bytes().len(), len);
            assert!(a.bytes().iter().all(|&b| b == 0));
            assert_eq!(a.bytes().as_ptr() as usize % LINE, 0);
            for (i, b) in a.bytes_mut().iter_mut().enumerate() {
                *b = i as u8;
            }
            let c = a.clone();
            assert!(c.bytes().iter().enumerate().all(|(i, &b)| b == i as u8));
        }
    }

    #[test]
    fn free_huge_pages_are_counted_from_order_nine_up() {
        let text = "Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3 \n\
                    Node 0, zone    DMA32      1      1      4      2      5      4      3      3      4      2    752 \n\
                    Node 0, zone   Normal      3      1      0    900    307    116     51     91     65      1    490 \n";
        // Order 9 counts 1, order 10 counts 2: DMA 1 + 2 * 3, DMA32 2 + 2 * 752, Normal 1 + 2 * 490.
        assert_eq!(free_huge_in(text), 7 + 1506 + 981);
        assert_eq!(free_huge_in(""), 0);
        assert_eq!(free_huge_in("Node 0, zone Normal 1 2 3\ngarbage\nNode 0, zone x 1 1 1 1 1 1 1 1 1 z 1"), 2);
        assert!(huge_pages_free() < usize::MAX);
    }

    #[test]
    fn large_blocks_are_zero_with_or_without_huge_pages() {
        for on in [true, false] {
            set_huge_pages(on);
            let mut a = Aligned::zeroed(HUGE_MIN + 3 * HUGE_PAGE + 12_345);
            assert!(a.bytes().iter().all(|&b| b == 0));
            let len = a.bytes().len();
            fill(&mut a.bytes_mut()[100..len - 100], &vec![7u8; len - 200]);
            assert!(a.bytes()[100..len - 100].iter().all(|&b| b == 7));
            assert!(a.bytes()[..100].iter().chain(&a.bytes()[len - 100..]).all(|&b| b == 0));
        }
        set_huge_pages(false);
    }

    #[test]
    fn filling_fresh_memory_copies_every_byte_and_leaves_the_rest_alone() {
        let len = (3 << 20) + 5;
        let src: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let mut a = Aligned::zeroed(len + 8);
        // Unaligned on both ends, so the populated range is a strict inner part.
        fill(&mut a.bytes_mut()[3..3 + len], &src);
        let b = a.bytes();
        assert_eq!(&b[3..3 + len], &src[..]);
        assert!(b[..3].iter().chain(&b[3 + len..]).all(|&x| x == 0));
        // Small pieces are copied without populating.
        fill(&mut a.bytes_mut()[..2], &[9, 9]);
        assert_eq!(&a.bytes()[..3], &[9, 9, 0]);
    }
}
