//! Memory for registered blocks: 8-byte aligned bytes.
//!
//! A block a change brings is written once into memory no one has touched, so every
//! 4 KiB page costs a fault; on this project's VM filling fresh memory runs at about
//! 1.5 GB/s against 9.8 GB/s for warm memory (redistribution bench references).
//! Transparent huge pages (`MADV_HUGEPAGE` on a dedicated mapping) were measured and
//! rejected: with the usual `defrag=madvise` setting the faulting thread compacts
//! memory itself, and a 256 MiB move took 100-570 ms instead of a steady 150-160 ms
//! (docs/BENCHMARKS.md). Prefaulting with `MAP_POPULATE` gave the same 150-160 ms.
//! Plain allocations it is: large ones are fresh mappings from the allocator.

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
}
