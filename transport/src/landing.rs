//! Memory that gets read into in place ([`crate::Transport::get_into`]).
//!
//! A [`Landing`] owns one buffer (8-byte aligned words, like the runtime's registered
//! blocks, or any owner of stable bytes, [`Landing::from_owner`]). It lends disjoint ranges of it as [`Part`]s, each an owned,
//! exclusive handle that a backend may hold on another thread (the TCP reader, a
//! libfabric read in flight) for as long as it writes; the buffer lives as long as any
//! part does, so a get abandoned mid-read never writes into freed memory. The buffer is
//! taken back with [`Landing::into_words`] (or [`Landing::into_owner`]) once every part
//! is gone.
//!
//! Why not `&mut [u8]`: a backend's write may outlive the future that started it (a
//! timed-out get whose reply is still arriving), so the destination must be owned.
//! Why not one `BytesMut` per get: that is the extra copy this type exists to avoid.

use std::any::{Any, TypeId};
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

/// Faults in the whole pages of `mem` in one call, without changing a byte, so that
/// writing them takes no page fault. On an old kernel (no `MADV_POPULATE_WRITE`) it does
/// nothing and the writes take the faults.
pub fn populate(mem: &mut [u8]) {
    // SAFETY: `mem` is memory of this process, borrowed mutably here.
    unsafe { populate_raw(mem.as_mut_ptr(), mem.len()) }
}

/// [`populate`] on `len` bytes from `ptr`.
///
/// # Safety
/// The bytes must be mapped, writable memory of this process for the whole call.
unsafe fn populate_raw(ptr: *mut u8, len: usize) {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
    let addr = ptr as usize;
    let start = addr.next_multiple_of(page);
    let end = (addr + len) / page * page;
    if end > start {
        // SAFETY: [start, end) lies inside the caller's memory, mapped and writable;
        // populating faults its pages in and leaves the bytes unchanged.
        let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_POPULATE_WRITE) };
        // On failure (an old kernel) the writes take the faults instead.
        let _ = rc;
    }
}

/// A buffer lent out in disjoint [`Part`]s; see the module docs.
pub struct Landing {
    /// The first byte (taken before the buffer was shared; the memory of the boxed
    /// owner never moves).
    base: *mut u8,
    len: usize,
    /// The owner, leaked from its box (so that no move of the box asserts uniqueness
    /// over bytes the parts write); `None` once taken back.
    owner: Option<NonNull<dyn Any + Send>>,
    /// The owner's type, for [`Landing::into_owner`] to check without a reference.
    owner_type: TypeId,
    /// The ranges lent out and not yet returned.
    lent: Mutex<Vec<Range<usize>>>,
}

// SAFETY: while shared, the bytes are only reached through parts, whose ranges are
// disjoint (checked by `part`) and each held by one owner; `owner` itself is touched only
// by `into_owner` and `drop`, which need the last reference (no part left). The owner is
// `Send`.
unsafe impl Send for Landing {}
// SAFETY: as above.
unsafe impl Sync for Landing {}

impl Landing {
    /// A landing of the first `len` bytes of `words`; `None` if `words` is shorter.
    #[must_use]
    pub fn new(words: Vec<u64>, len: usize) -> Option<Arc<Self>> {
        if len > words.len().saturating_mul(8) {
            return None;
        }
        let mut l = Self::leak(Words(words));
        l.len = len;
        Some(Arc::new(l))
    }

    /// A landing of all the bytes `owner` holds (e.g. a mapping of the runtime's), taken
    /// back with [`Landing::into_owner`].
    #[must_use]
    pub fn from_owner<T: AsMut<[u8]> + Send + 'static>(owner: T) -> Arc<Self> {
        Arc::new(Self::leak(owner))
    }

    /// Boxes and leaks `owner`, then takes its bytes where they stay, even if they lie
    /// inside `T`.
    fn leak<T: AsMut<[u8]> + Send + 'static>(owner: T) -> Self {
        let raw = Box::into_raw(Box::new(owner));
        // SAFETY: `raw` comes from a live box that nothing else references yet.
        let bytes = unsafe { (*raw).as_mut() };
        let (base, len) = (bytes.as_mut_ptr(), bytes.len());
        let owner: *mut (dyn Any + Send) = raw;
        Self { base, len, owner: NonNull::new(owner), owner_type: TypeId::of::<T>(), lent: Mutex::new(Vec::new()) }
    }

    /// Its length in bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Lends `range` as an exclusive part; `None` if the range is not inside the buffer
    /// or overlaps a part still out (empty ranges overlap nothing).
    #[must_use]
    pub fn part(self: &Arc<Self>, range: Range<usize>) -> Option<Part> {
        if range.start > range.end || range.end > self.len {
            return None;
        }
        let mut lent = self.lent.lock().unwrap_or_else(PoisonError::into_inner);
        // An empty range holds no byte, so it overlaps nothing (lent or asked for).
        let overlaps = |r: &Range<usize>| !r.is_empty() && r.start < range.end && range.start < r.end;
        if !range.is_empty() && lent.iter().any(overlaps) {
            return None;
        }
        lent.push(range.clone());
        Some(Part { landing: self.clone(), range })
    }

    /// Faults in the whole pages of `range` for writing, without changing a byte,
    /// whether or not a part of it is lent out: a receiver can populate memory while a
    /// backend fills it (the kernel serialises the faults, and a page already there is
    /// left alone). Filling fresh memory costs a fault per page; populating it first in
    /// one call is cheaper. `false` if the range is not inside the buffer.
    pub fn populate(&self, range: Range<usize>) -> bool {
        if range.start > range.end || range.end > self.len {
            return false;
        }
        // SAFETY: the range lies inside the buffer, which lives as long as `self`;
        // populating reads and writes no byte of it.
        unsafe { populate_raw(self.base.add(range.start), range.len()) };
        true
    }

    /// The buffer back, once no part is out; else the landing itself.
    ///
    /// # Errors
    /// A part (or another reference) is still held.
    pub fn into_words(this: Arc<Self>) -> Result<Vec<u64>, Arc<Self>> {
        Self::into_owner::<Words>(this).map(|w| w.0)
    }

    /// The owner back ([`Landing::new`]'s words come back with [`Landing::into_words`]), once no part is out and if it
    /// is a `T`; else the landing itself.
    ///
    /// # Errors
    /// A part (or another reference) is still held, or the owner is not a `T`.
    pub fn into_owner<T: 'static>(this: Arc<Self>) -> Result<T, Arc<Self>> {
        if this.owner_type != TypeId::of::<T>() {
            return Err(this);
        }
        let mut l = Arc::try_unwrap(this)?;
        let Some(owner) = l.owner.take() else { return Err(Arc::new(l)) };
        // SAFETY: the pointer comes from `Box::into_raw` of a `T` (its type id was
        // checked), and it was taken out of the landing, so it is rebuilt only once; no
        // part is out (this was the last reference).
        Ok(*unsafe { Box::from_raw(owner.as_ptr().cast::<T>()) })
    }
}

/// The words of [`Landing::new`].
struct Words(Vec<u64>);

impl AsMut<[u8]> for Words {
    fn as_mut(&mut self) -> &mut [u8] {
        let n = self.0.len() * 8;
        // SAFETY: the words' memory viewed as bytes: the same allocation, every byte
        // pattern valid both ways, alignment 1 <= 8.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u8>(), n) }
    }
}

impl Drop for Landing {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.take() {
            // SAFETY: from `Box::into_raw`, not taken back by `into_owner`; the last
            // reference is going, so no part is out.
            drop(unsafe { Box::from_raw(owner.as_ptr()) });
        }
    }
}

/// An exclusive, owned range of a [`Landing`]: a backend writes a get's bytes into it.
pub struct Part {
    landing: Arc<Landing>,
    range: Range<usize>,
}

impl Part {
    /// Its length in bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether it has no bytes.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Where it lies in its landing.
    #[must_use]
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Its bytes.
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the range lies inside the landing's buffer (checked when lent), which
        // lives as long as `self.landing`; no other part overlaps it, and this one is
        // borrowed shared here.
        unsafe { std::slice::from_raw_parts(self.landing.base.add(self.range.start), self.range.len()) }
    }

    /// Its bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and this part is borrowed exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.landing.base.add(self.range.start), self.range.len()) }
    }
}

impl std::fmt::Debug for Landing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let lent = self.lent.lock().unwrap_or_else(PoisonError::into_inner).len();
        write!(f, "Landing({} bytes, {lent} parts out)", self.len)
    }
}

impl std::fmt::Debug for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Part({:?} of {} bytes)", self.range, self.landing.len)
    }
}

impl Drop for Part {
    fn drop(&mut self) {
        let mut lent = self.landing.lent.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = lent.iter().position(|r| *r == self.range) {
            lent.swap_remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_disjoint_and_inside() {
        let l = Landing::new(vec![0; 4], 30).unwrap();
        assert!(Landing::new(vec![0; 4], 33).is_none());
        let mut a = l.part(0..10).unwrap();
        assert!(l.part(5..12).is_none(), "overlaps a");
        assert!(l.part(25..31).is_none(), "outside");
        let mut b = l.part(10..30).unwrap();
        let e1 = l.part(3..3).unwrap();
        let e2 = l.part(3..3).unwrap();
        let e3 = l.part(30..30).unwrap();
        a.as_mut_slice().fill(1);
        b.as_mut_slice().fill(2);
        assert_eq!(b.as_slice(), &[2; 20]);
        drop((e1, e2));
        drop(a);
        // A lent empty part does not keep a range around it from being lent.
        let e4 = l.part(5..5).unwrap();
        let a2 = l.part(2..8).unwrap();
        drop((e3, e4));
        let l = match Landing::into_words(l) {
            Ok(_) => panic!("parts are still out"),
            Err(l) => l,
        };
        drop((a2, b));
        let words = Landing::into_words(l).unwrap();
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert_eq!(&bytes[..10], &[1; 10]);
        assert_eq!(&bytes[10..30], &[2; 20]);
        assert_eq!(&bytes[30..], &[0, 0]);
    }

    #[test]
    fn any_owner_of_bytes_lands_and_comes_back_by_its_type() {
        struct Inline([u8; 24]);
        impl AsMut<[u8]> for Inline {
            fn as_mut(&mut self) -> &mut [u8] {
                &mut self.0
            }
        }
        let l = Landing::from_owner(Inline([0; 24]));
        assert_eq!(l.len(), 24);
        let mut p = l.part(4..12).unwrap();
        p.as_mut_slice().fill(5);
        drop(p);
        let l = Landing::into_words(l).expect_err("not words");
        let back: Inline = Landing::into_owner(l).unwrap();
        assert_eq!(&back.0[..4], &[0; 4]);
        assert_eq!(&back.0[4..12], &[5; 8]);
        let words = Landing::new(vec![1; 2], 16).unwrap();
        assert!(Landing::into_owner::<Inline>(words).is_err());
    }

    #[test]
    fn a_part_keeps_its_buffer_alive() {
        let l = Landing::new(vec![7; 2], 16).unwrap();
        let p = l.part(8..16).unwrap();
        drop(l);
        assert_eq!(p.as_slice(), &7u64.to_ne_bytes());
    }

    #[test]
    fn populating_changes_no_byte_even_of_a_part_lent_out() {
        // Fresh pages (a large vector is a mapping of its own) and pages written to.
        let words = 3 << 18; // 6 MiB
        let l = Landing::new(vec![0; words], words * 8).unwrap();
        let mut p = l.part(4096..(2 << 20) + 5).unwrap();
        p.as_mut_slice().fill(9);
        assert!(l.populate(0..words * 8));
        assert!(l.populate(17..4099));
        assert!(!l.populate(0..words * 8 + 1), "outside");
        p.as_mut_slice()[..3].copy_from_slice(&[1, 2, 3]);
        drop(p);
        let bytes: Vec<u8> = Landing::into_words(l).unwrap().iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert!(bytes[..4096].iter().all(|&b| b == 0));
        assert_eq!(&bytes[4096..4099], &[1, 2, 3]);
        assert!(bytes[4099..(2 << 20) + 5].iter().all(|&b| b == 9));
        assert!(bytes[(2 << 20) + 5..].iter().all(|&b| b == 0));
    }
}
