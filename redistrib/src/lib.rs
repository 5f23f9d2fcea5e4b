//! # ductile-redistrib
//!
//! Data distributions and redistribution planning for ductile: the block distribution
//! rule that every part of ductile agrees on, and the overlap plans ([`plan`]) that
//! say which elements move from which source part to which target part.
//!
//! **Block rule.** `N` items over `n` parts: part `r` owns `[floor(r*N/n), floor((r+1)*N/n))`.
//! Blocks differ in size by at most one item, the larger ones come last, and for
//! `N < n` some parts are empty.

pub mod plan;

pub use plan::{drain_plan, source_plan, DrainPlan, SourcePlan};

use std::ops::Range;

/// The index range part `r` of `parts` owns under the block rule.
///
/// # Panics
/// If `parts` is zero or `r >= parts` (a caller bug, not input).
#[must_use]
pub fn block_range(items: u64, parts: u32, r: u32) -> Range<u64> {
    assert!(parts > 0 && r < parts, "block_range: part {r} of {parts}");
    let at = |k: u32| ((u128::from(k) * u128::from(items)) / u128::from(parts)) as u64;
    at(r)..at(r + 1)
}

/// The part that owns item `i` under the block rule, or `None` if `i >= items`.
#[must_use]
pub fn block_owner(items: u64, parts: u32, i: u64) -> Option<u32> {
    if i >= items || parts == 0 {
        return None;
    }
    // floor(r*N/n) <= i  <=>  r <= (i*n + n - 1) / N roughly; compute a guess and fix it.
    let guess = ((u128::from(i) * u128::from(parts)) / u128::from(items)) as u32;
    let mut r = guess.min(parts - 1);
    while block_range(items, parts, r).start > i {
        r -= 1;
    }
    while block_range(items, parts, r).end <= i {
        r += 1;
    }
    Some(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn small_cases() {
        assert_eq!(block_range(10, 3, 0), 0..3);
        assert_eq!(block_range(10, 3, 1), 3..6);
        assert_eq!(block_range(10, 3, 2), 6..10);
        assert_eq!(block_range(2, 4, 0), 0..0);
        assert_eq!(block_range(2, 4, 1), 0..1);
        assert_eq!(block_owner(10, 3, 9), Some(2));
        assert_eq!(block_owner(10, 3, 10), None);
    }

    proptest! {
        #[test]
        fn blocks_tile_the_range(items in 0u64..10_000, parts in 1u32..64) {
            let mut next = 0;
            for r in 0..parts {
                let b = block_range(items, parts, r);
                prop_assert_eq!(b.start, next);
                prop_assert!(b.end - b.start <= items / u64::from(parts) + 1);
                next = b.end;
                for i in b.clone() {
                    prop_assert_eq!(block_owner(items, parts, i), Some(r));
                }
            }
            prop_assert_eq!(next, items);
        }
    }
}
