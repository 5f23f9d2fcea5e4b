//! Placing ranks on nodes: a pure function of the command line.
//!
//! Rules (N ranks, M nodes, C slots per node):
//! - nothing given: one node, one rank;
//! - `-n N` alone: M = ceil(N / [`DEFAULT_SLOTS`]) nodes, ranks spread evenly;
//! - `-n N --nodes M`: ranks spread evenly over M nodes (each node gets at least one);
//! - `-n N --slots C`: M = ceil(N / C) nodes filled in order;
//! - `--nodes M` and/or `--slots C` without `-n`: N = M × C (a missing one is 1).
//!
//! "Evenly" is the block rule of `ductile-redistrib`: node i gets ranks
//! `[floor(i*N/M), floor((i+1)*N/M))`. Ranks are numbered node by node.

use ductile_transport::{NodeId, Rank};
use std::ops::Range;

/// Slots per node when only `-n` is given.
pub const DEFAULT_SLOTS: u32 = 4;
/// Most ranks (and so nodes) one job may have.
pub const MAX_RANKS: u32 = 4096;

/// One node's share of the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePlan {
    /// The node.
    pub node: NodeId,
    /// Process slots the node offers.
    pub slots: u32,
    /// The ranks it runs.
    pub ranks: Range<u32>,
}

impl NodePlan {
    /// The ranks as `Rank`s.
    pub fn rank_ids(&self) -> impl Iterator<Item = Rank> + '_ {
        self.ranks.clone().map(Rank)
    }
}

/// A job's placement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Nodes in order.
    pub nodes: Vec<NodePlan>,
}

impl Layout {
    /// Number of ranks.
    #[must_use]
    pub fn size(&self) -> u32 {
        self.nodes.last().map_or(0, |n| n.ranks.end)
    }
}

/// A placement request that cannot be met.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayoutError {
    /// A count of zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// More nodes than ranks.
    #[error("{nodes} nodes need at least {nodes} ranks, but -n is {n}")]
    FewerRanksThanNodes {
        /// Ranks asked for.
        n: u32,
        /// Nodes asked for.
        nodes: u32,
    },
    /// More ranks than the nodes have slots.
    #[error("-n {n} does not fit on {nodes} nodes of {slots} slots")]
    TooManyRanks {
        /// Ranks asked for.
        n: u32,
        /// Nodes.
        nodes: u32,
        /// Slots per node.
        slots: u32,
    },
    /// Past the launcher's limit.
    #[error("{0} ranks or nodes: more than the launcher's limit of {MAX_RANKS}")]
    OverLimit(u64),
}

fn nonzero(v: Option<u32>, what: &'static str) -> Result<Option<u32>, LayoutError> {
    match v {
        Some(0) => Err(LayoutError::Zero(what)),
        other => Ok(other),
    }
}

/// Places ranks on nodes; see the module docs for the rules.
///
/// # Errors
/// Zero counts, more nodes than ranks, more ranks than slots, or past [`MAX_RANKS`].
pub fn plan(n: Option<u32>, nodes: Option<u32>, slots: Option<u32>) -> Result<Layout, LayoutError> {
    let n = nonzero(n, "-n")?;
    let nodes = nonzero(nodes, "--nodes")?;
    let slots = nonzero(slots, "--slots")?;
    let (n, m, even) = match (n, nodes, slots) {
        (None, m, c) => {
            let total = u64::from(m.unwrap_or(1)) * u64::from(c.unwrap_or(1));
            let total = u32::try_from(total).ok().filter(|&t| t <= MAX_RANKS).ok_or(LayoutError::OverLimit(total))?;
            (total, m.unwrap_or(1), true)
        }
        (Some(n), Some(m), _) => (n, m, true),
        (Some(n), None, Some(c)) => (n, n.div_ceil(c), false),
        (Some(n), None, None) => (n, n.div_ceil(DEFAULT_SLOTS), true),
    };
    if n > MAX_RANKS {
        return Err(LayoutError::OverLimit(u64::from(n)));
    }
    if n < m {
        return Err(LayoutError::FewerRanksThanNodes { n, nodes: m });
    }
    let per_node = |i: u32| -> Range<u32> {
        if even {
            let r = ductile_redistrib::block_range(u64::from(n), m, i);
            // Bounded by n, which fits in u32.
            (r.start as u32)..(r.end as u32)
        } else {
            let c = slots.unwrap_or(DEFAULT_SLOTS);
            (i * c).min(n)..((i + 1) * c).min(n)
        }
    };
    let widest = (0..m).map(|i| per_node(i).len() as u32).max().unwrap_or(1);
    let c = slots.unwrap_or(widest);
    if u64::from(n) > u64::from(m) * u64::from(c) {
        return Err(LayoutError::TooManyRanks { n, nodes: m, slots: c });
    }
    Ok(Layout { nodes: (0..m).map(|i| NodePlan { node: NodeId(i), slots: c, ranks: per_node(i) }).collect() })
}

/// Slot count of pool node `i` under a `--slots` list: the list's entry, or its last
/// entry for nodes past its end.
#[must_use]
pub fn slots_of(slots: &[u32], i: usize) -> u32 {
    slots.get(i).or(slots.last()).copied().unwrap_or(1)
}

/// Places ranks on nodes whose slots differ (`--slots 4,2,8`): nodes are filled in
/// order, each keeping at least one rank for the nodes after it. Without `-n`, every
/// slot of the `--nodes` nodes (default 1) is used; without `--nodes`, as few nodes
/// as hold `-n` ranks.
///
/// # Errors
/// Zero counts, more nodes than ranks, more ranks than slots, or past [`MAX_RANKS`].
pub fn plan_slots(n: Option<u32>, nodes: Option<u32>, slots: &[u32]) -> Result<Layout, LayoutError> {
    if slots.len() <= 1 {
        return plan(n, nodes, slots.first().copied());
    }
    let n = nonzero(n, "-n")?;
    let nodes = nonzero(nodes, "--nodes")?;
    if slots.contains(&0) {
        return Err(LayoutError::Zero("--slots"));
    }
    // Every count is checked against the limit before any walk over nodes: a node
    // holds at least one rank, so the walks below stay within MAX_RANKS steps.
    for c in [n, nodes].into_iter().flatten() {
        if c > MAX_RANKS {
            return Err(LayoutError::OverLimit(u64::from(c)));
        }
    }
    let cap = |m: u32| -> u64 { (0..m as usize).map(|i| u64::from(slots_of(slots, i))).sum() };
    let m = match (n, nodes) {
        (_, Some(m)) => m,
        (None, None) => 1,
        // As few nodes as hold n ranks: a running sum of the slots.
        (Some(n), None) => {
            let mut held = 0u64;
            (1..=n)
                .find(|&m| {
                    held += u64::from(slots_of(slots, m as usize - 1));
                    held >= u64::from(n)
                })
                .unwrap_or(n)
        }
    };
    let n = match n {
        Some(n) => n,
        None => u32::try_from(cap(m)).ok().filter(|&t| t <= MAX_RANKS).ok_or(LayoutError::OverLimit(cap(m)))?,
    };
    if n < m {
        return Err(LayoutError::FewerRanksThanNodes { n, nodes: m });
    }
    if u64::from(n) > cap(m) {
        let widest = (0..m as usize).map(|i| slots_of(slots, i)).max().unwrap_or(1);
        return Err(LayoutError::TooManyRanks { n, nodes: m, slots: widest });
    }
    let mut out = Vec::with_capacity(m as usize);
    let mut next = 0;
    for i in 0..m {
        let c = slots_of(slots, i as usize);
        let take = c.min(n - next - (m - i - 1));
        out.push(NodePlan { node: NodeId(i), slots: c, ranks: next..next + take });
        next += take;
    }
    Ok(Layout { nodes: out })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn counts(l: &Layout) -> Vec<u32> {
        l.nodes.iter().map(|n| n.ranks.len() as u32).collect()
    }

    #[test]
    fn the_documented_rules() {
        assert_eq!(counts(&plan(None, None, None).unwrap()), [1]);
        assert_eq!(counts(&plan(Some(8), None, None).unwrap()), [4, 4]);
        assert_eq!(counts(&plan(Some(6), None, None).unwrap()), [3, 3]);
        assert_eq!(counts(&plan(Some(3), None, None).unwrap()), [3]);
        assert_eq!(counts(&plan(Some(8), Some(3), None).unwrap()), [2, 3, 3]);
        assert_eq!(counts(&plan(Some(7), None, Some(3)).unwrap()), [3, 3, 1]);
        assert_eq!(counts(&plan(None, Some(4), None).unwrap()), [1, 1, 1, 1]);
        assert_eq!(counts(&plan(None, None, Some(3)).unwrap()), [3]);
        assert_eq!(counts(&plan(None, Some(2), Some(3)).unwrap()), [3, 3]);
        let l = plan(Some(5), Some(2), Some(4)).unwrap();
        assert_eq!(l.nodes[1].ranks, 2..5);
        assert_eq!(l.nodes[1].slots, 4);
    }

    #[test]
    fn impossible_requests_are_refused() {
        assert_eq!(plan(Some(0), None, None), Err(LayoutError::Zero("-n")));
        assert_eq!(plan(None, Some(0), None), Err(LayoutError::Zero("--nodes")));
        assert_eq!(plan(Some(2), None, Some(0)), Err(LayoutError::Zero("--slots")));
        assert_eq!(plan(Some(2), Some(3), None), Err(LayoutError::FewerRanksThanNodes { n: 2, nodes: 3 }));
        assert_eq!(plan(Some(9), Some(2), Some(4)), Err(LayoutError::TooManyRanks { n: 9, nodes: 2, slots: 4 }));
        assert!(matches!(plan(Some(MAX_RANKS + 1), None, None), Err(LayoutError::OverLimit(_))));
        assert!(matches!(plan(None, Some(u32::MAX), Some(u32::MAX)), Err(LayoutError::OverLimit(_))));
        // Huge counts with a list of slots are refused before any walk over nodes
        // (which took minutes for -n u32::MAX).
        for (n, nodes) in [(Some(u32::MAX), None), (Some(MAX_RANKS + 1), None), (Some(2), Some(u32::MAX))] {
            assert!(matches!(plan_slots(n, nodes, &[1, 1]), Err(LayoutError::OverLimit(_))), "{n:?} {nodes:?}");
        }
        assert_eq!(counts(&plan_slots(Some(MAX_RANKS), None, &[1, 1]).unwrap()).len(), MAX_RANKS as usize);
    }

    #[test]
    fn heterogeneous_slots_fill_in_order() {
        assert_eq!(counts(&plan_slots(None, Some(3), &[4, 2, 8]).unwrap()), [4, 2, 8]);
        assert_eq!(counts(&plan_slots(Some(7), None, &[4, 2, 8]).unwrap()), [4, 2, 1]);
        assert_eq!(counts(&plan_slots(Some(3), Some(3), &[4, 2]).unwrap()), [1, 1, 1]);
        assert_eq!(counts(&plan_slots(None, Some(4), &[1, 3]).unwrap()), [1, 3, 3, 3]);
        assert_eq!(plan_slots(Some(9), Some(2), &[4, 2]), Err(LayoutError::TooManyRanks { n: 9, nodes: 2, slots: 4 }));
        assert_eq!(plan_slots(None, None, &[4, 0]), Err(LayoutError::Zero("--slots")));
        assert_eq!(slots_of(&[4, 2], 5), 2);
    }

    proptest! {
        #[test]
        fn every_rank_placed_once_in_order(n in proptest::option::of(1u32..200), m in proptest::option::of(1u32..20), c in proptest::option::of(1u32..10)) {
            if let Ok(l) = plan(n, m, c) {
                let mut next = 0;
                for node in &l.nodes {
                    prop_assert_eq!(node.ranks.start, next);
                    prop_assert!(!node.ranks.is_empty());
                    prop_assert!(node.ranks.len() as u32 <= node.slots);
                    next = node.ranks.end;
                }
                prop_assert_eq!(Some(next), n.or(Some(l.size())));
            }
        }
    }
}
