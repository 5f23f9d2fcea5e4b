//! Memory for registered blocks: 8-byte aligned bytes.
//!
//! A block a change brings is written once into memory no one has touched, so every
//! 4 KiB page costs a fault; on this project's VM filling fresh memory runs at about
//! 1.5 GB/s against 9.8 GB/s for warm memory (redistribution bench references).
//! Transparent huge pages (`MADV_HUGEPAGE` on a dedicated mapping) were measured and
//! rejected: with the usual `defrag=madvise` setting the faulting thread compacts
//! memory itself, and a 256 MiB move took 100-570 ms instead of a steady 150-160 ms
//! (docs/BENCHMARKS.md). Prefaulting the whole new block with `MAP_POPULATE` before
//! the move gave the same 150-160 ms. Plain allocations it is (large ones are fresh
//! mappings from the allocator), each piece populated just before data is copied into it
//! ([`fill`]): 10-15 % faster shrinks over tcp (8 → 2 collective 1.70 → 1.98 GB/s,
//! single runs of the redistribution bench's job).

use ductile_transport::Landing;
use std::sync::Arc;

/// Bytes with 8-byte alignment.
#[derive(Clone, Debug, Default)]
pub(crate) struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl AsRef<[u8]> for Aligned {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

impl Aligned {
    /// `len` zero bytes.
    pub(crate) fn zeroed(len: usize) -> Self {
        Self { words: vec![0u64; len.div_ceil(8)], len }
    }

    /// A copy of `b`.
    pub(crate) fn from_bytes(b: &[u8]) -> Self {
        let mut a = Self::zeroed(b.len());
        a.bytes_mut().copy_from_slice(b);
        a
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len]
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..self.len]
    }

    /// The block as a landing for gets to read into in place.
    pub(crate) fn into_landing(self) -> Option<Arc<Landing>> {
        Landing::new(self.words, self.len)
    }

    /// The block back from its landing; `None` while a part is still out.
    pub(crate) fn from_landing(landing: Arc<Landing>) -> Option<Self> {
        let len = landing.len();
        Landing::into_words(landing).ok().map(|words| Self { words, len })
    }
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
    if mem.len() < POPULATE_MIN {
        return;
    }
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
    let addr = mem.as_mut_ptr() as usize;
    let start = addr.next_multiple_of(page);
    let end = (addr + mem.len()) / page * page;
    if end > start {
        // SAFETY: [start, end) lies inside `mem`, writable memory of this process that we
        // borrow mutably; populating faults its pages in and leaves the bytes unchanged.
        let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_POPULATE_WRITE) };
        // On failure (an old kernel) the copy takes the faults instead.
        let _ = rc;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_hold_what_is_written() {
        for len in [0, 1, 7, 4096, (2 << 20) + 5] {
            let mut a = Aligned::zeroed(len);
            assert_eq!(a.bytes().len(), len);
            assert!(a.bytes().iter().all(|&b| b == 0));
            assert_eq!(a.bytes().as_ptr() as usize % 8, 0);
            for (i, b) in a.bytes_mut().iter_mut().enumerate() {
                *b = i as u8;
            }
            let c = a.clone();
            assert!(c.bytes().iter().enumerate().all(|(i, &b)| b == i as u8));
        }
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
