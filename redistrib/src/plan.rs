//! Overlap plans: which elements move from which source part to which target part when
//! a block-distributed array of `N` elements goes from `NS` parts to `NT` parts.
//!
//! [`drain_plan`] is paper 003's Algorithm 1 (the target, or *drain*, side): for each
//! source, how many elements the drain reads (`counts`) and where they land in the
//! drain's block (`displs`), plus the range of sources it touches and the offset into
//! the first one. [`source_plan`] is the mirror image on the source side. Both are
//! pure and cost O(parts touched), found by binary search.
//!
//! One correction to the paper's loop: it stops at the first source without an overlap
//! after an overlapping one. With `N < NS` some source blocks are empty and can sit
//! *inside* a drain's range; the loop here skips empty blocks and stops only at a
//! source that starts at or after the drain's end, so no element is lost.

use crate::{block_owner, block_range};
use std::ops::Range;

/// What one drain reads (Algorithm 1 of paper 003).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainPlan {
    /// Elements read from each source, indexed by source part.
    pub counts: Vec<u64>,
    /// Where each source's elements start in the drain's block; `NS + 1` entries,
    /// the last being the block's length.
    pub displs: Vec<u64>,
    /// Sources with a non-empty overlap lie in this range (empty if none).
    pub sources: Range<u32>,
    /// Offset into the first such source's block where reading starts.
    pub first_index: u64,
}

/// What one source sends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourcePlan {
    /// Elements sent to each target, indexed by target part.
    pub counts: Vec<u64>,
    /// Where each target's elements start in the source's block; `NT + 1` entries.
    pub displs: Vec<u64>,
    /// Targets with a non-empty overlap lie in this range (empty if none).
    pub targets: Range<u32>,
}

/// Elements of `a` also in `b`.
fn overlap_len(a: &Range<u64>, b: &Range<u64>) -> u64 {
    a.end.min(b.end).saturating_sub(a.start.max(b.start))
}

/// Counts of `mine` against every part of `other_parts`, with their prefix sums and the
/// touched range: the shared core of both sides.
fn against(items: u64, other_parts: u32, mine: &Range<u64>) -> (Vec<u64>, Vec<u64>, Range<u32>) {
    let mut counts = vec![0; other_parts as usize];
    let mut touched = 0..0;
    if !mine.is_empty() {
        // The part owning the first element; parts before it end at or before it.
        let first = block_owner(items, other_parts, mine.start).unwrap_or(other_parts);
        let mut last = first;
        for p in first..other_parts {
            let theirs = block_range(items, other_parts, p);
            if theirs.start >= mine.end && !theirs.is_empty() {
                break;
            }
            counts[p as usize] = overlap_len(mine, &theirs);
            if counts[p as usize] > 0 {
                last = p + 1;
            }
        }
        touched = first..last;
    }
    let mut displs = Vec::with_capacity(counts.len() + 1);
    let mut at = 0;
    displs.push(0);
    for c in &counts {
        at += c;
        displs.push(at);
    }
    (counts, displs, touched)
}

/// Algorithm 1 of paper 003 for drain `drain` of `targets`, with `sources` source parts.
///
/// # Panics
/// If `sources` or `targets` is zero or `drain >= targets` (caller bugs, not input).
#[must_use]
pub fn drain_plan(items: u64, sources: u32, targets: u32, drain: u32) -> DrainPlan {
    assert!(sources > 0, "drain_plan: no sources");
    let mine = block_range(items, targets, drain);
    let (counts, displs, touched) = against(items, sources, &mine);
    let first_index =
        if touched.is_empty() { 0 } else { mine.start - block_range(items, sources, touched.start).start };
    DrainPlan { counts, displs, sources: touched, first_index }
}

/// The source side: what source `source` of `sources` sends to each of `targets`.
///
/// # Panics
/// If `sources` or `targets` is zero or `source >= sources`.
#[must_use]
pub fn source_plan(items: u64, sources: u32, targets: u32, source: u32) -> SourcePlan {
    assert!(targets > 0, "source_plan: no targets");
    let mine = block_range(items, sources, source);
    let (counts, displs, touched) = against(items, targets, &mine);
    SourcePlan { counts, displs, targets: touched }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Brute force: every element, who holds it before and after.
    fn brute(items: u64, ns: u32, nt: u32) -> Vec<Vec<u64>> {
        let mut m = vec![vec![0u64; nt as usize]; ns as usize];
        for g in 0..items {
            let s = block_owner(items, ns, g).unwrap();
            let t = block_owner(items, nt, g).unwrap();
            m[s as usize][t as usize] += 1;
        }
        m
    }

    /// Brute force: where each other part's elements start in part `me` of `parts`'s
    /// block (`None`: it gets none of them).
    fn starts(items: u64, parts: u32, me: u32, others: u32) -> Vec<Option<u64>> {
        let mine = block_range(items, parts, me);
        let mut at = vec![None; others as usize];
        for g in mine.clone() {
            let o = block_owner(items, others, g).unwrap() as usize;
            at[o] = at[o].or(Some(g - mine.start));
        }
        at
    }

    /// `displs` puts every other part with elements where brute force does, and the
    /// touched range is tight: it starts and ends at parts with elements.
    fn check_places(counts: &[u64], displs: &[u64], touched: &Range<u32>, at: &[Option<u64>], case: &str) {
        assert_eq!(displs.len(), counts.len() + 1, "{case}");
        for (o, start) in at.iter().enumerate() {
            if let Some(start) = start {
                assert_eq!(displs[o], *start, "{case}: part {o}");
            }
        }
        if !touched.is_empty() {
            assert!(counts[touched.start as usize] > 0 && counts[touched.end as usize - 1] > 0, "{case}");
        }
    }

    fn check(items: u64, ns: u32, nt: u32) {
        let m = brute(items, ns, nt);
        for d in 0..nt {
            let p = drain_plan(items, ns, nt, d);
            let want: Vec<u64> = (0..ns as usize).map(|s| m[s][d as usize]).collect();
            assert_eq!(p.counts, want, "N={items} NS={ns} NT={nt} drain {d}");
            assert_eq!(*p.displs.last().unwrap(), block_range(items, nt, d).end - block_range(items, nt, d).start);
            for s in 0..ns {
                let inside = p.sources.contains(&s);
                assert!(inside || p.counts[s as usize] == 0, "N={items} NS={ns} NT={nt} drain {d} source {s}");
            }
            let case = format!("N={items} NS={ns} NT={nt} drain {d}");
            check_places(&p.counts, &p.displs, &p.sources, &starts(items, nt, d, ns), &case);
            if let Some(&c) = p.counts.get(p.sources.start as usize).filter(|_| !p.sources.is_empty()) {
                assert!(c > 0);
                let first = block_range(items, ns, p.sources.start);
                assert_eq!(first.start + p.first_index, block_range(items, nt, d).start);
            }
        }
        for s in 0..ns {
            let p = source_plan(items, ns, nt, s);
            let case = format!("N={items} NS={ns} NT={nt} source {s}");
            assert_eq!(p.counts, m[s as usize], "{case}");
            assert_eq!(*p.displs.last().unwrap(), block_range(items, ns, s).end - block_range(items, ns, s).start);
            for t in 0..nt {
                assert!(p.targets.contains(&t) || p.counts[t as usize] == 0, "{case} target {t}");
            }
            check_places(&p.counts, &p.displs, &p.targets, &starts(items, ns, s, nt), &case);
        }
    }

    #[test]
    fn every_ns_nt_up_to_32_against_brute_force() {
        for ns in 1..=32 {
            for nt in 1..=32 {
                for items in [0, 1, 5, 31, 33, 97] {
                    check(items, ns, nt);
                }
            }
        }
    }

    #[test]
    fn empty_source_blocks_inside_a_drain_are_skipped_not_a_stop() {
        // N=2 over 4 sources: blocks [], [0], [], [1]. One drain holds both elements.
        let p = drain_plan(2, 4, 1, 0);
        assert_eq!(p.counts, vec![0, 1, 0, 1]);
        assert_eq!(p.sources, 1..4);
        assert_eq!(p.displs, vec![0, 0, 1, 1, 2]);
    }

    proptest! {
        #[test]
        fn random_sizes_match_brute_force(items in 0u64..3000, ns in 1u32..=32, nt in 1u32..=32) {
            check(items, ns, nt);
        }
    }
}
