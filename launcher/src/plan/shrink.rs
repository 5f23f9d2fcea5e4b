//! Shrink planning: which processes leave and how the survivors are renumbered.
//!
//! Whole node worlds go first (paper 000 §4.6-4.7, termination shrinkage): nodes are
//! released from the most recently added backwards, so a job that grew and shrinks
//! returns to its original nodes. If the target needs part of a node, that node's
//! highest ranks exit individually. Survivors keep their relative order and are
//! renumbered densely; if rank 0 leaves, the lowest surviving rank becomes rank 0.

use serde::Serialize;

/// The ranks one node runs, in allocation order (oldest node first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRanks {
    /// Node index in the allocation.
    pub node: usize,
    /// Its ranks (current numbering).
    pub ranks: Vec<u32>,
}

/// A shrink.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ShrinkPlan {
    /// Nodes whose whole world ends.
    pub released_nodes: Vec<usize>,
    /// Ranks that exit (those of released nodes included).
    pub exiting: Vec<u32>,
    /// New rank of every old rank (`None`: it exits), indexed by old rank.
    pub mapping: Vec<Option<u32>>,
    /// The old rank that becomes rank 0.
    pub new_root: u32,
}

/// A shrink that cannot be planned.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShrinkError {
    /// Zero processes requested.
    #[error("a job keeps at least one process")]
    Zero,
    /// Not fewer processes than now.
    #[error("the job runs {current} processes; {target} is not fewer")]
    NotAShrink {
        /// Processes now.
        current: u32,
        /// Target.
        target: u32,
    },
    /// The node list does not number ranks 0..n once each.
    #[error("the node list does not hold ranks 0..{0} exactly once")]
    BadRanks(u32),
}

/// Plans a shrink of the job laid out as `nodes` to `target` processes.
///
/// # Errors
/// A target of 0 or not below the current size, or a malformed node list.
pub fn plan_shrink(nodes: &[NodeRanks], target: u32) -> Result<ShrinkPlan, ShrinkError> {
    let current = nodes.iter().map(|n| n.ranks.len() as u32).sum::<u32>();
    let mut seen = vec![false; current as usize];
    for r in nodes.iter().flat_map(|n| &n.ranks) {
        match seen.get_mut(*r as usize) {
            Some(s) if !*s => *s = true,
            _ => return Err(ShrinkError::BadRanks(current)),
        }
    }
    if target == 0 {
        return Err(ShrinkError::Zero);
    }
    if target >= current {
        return Err(ShrinkError::NotAShrink { current, target });
    }
    let mut surplus = current - target;
    let mut released_nodes = Vec::new();
    let mut exiting = Vec::new();
    for n in nodes.iter().rev() {
        if surplus == 0 {
            break;
        }
        let here = n.ranks.len() as u32;
        if here <= surplus {
            released_nodes.push(n.node);
            exiting.extend(&n.ranks);
            surplus -= here;
        } else {
            let mut ranks = n.ranks.clone();
            ranks.sort_unstable();
            exiting.extend(&ranks[ranks.len() - surplus as usize..]);
            surplus = 0;
        }
    }
    exiting.sort_unstable();
    let mut mapping = vec![None; current as usize];
    let mut next = 0;
    for (old, slot) in mapping.iter_mut().enumerate() {
        if exiting.binary_search(&(old as u32)).is_err() {
            *slot = Some(next);
            next += 1;
        }
    }
    let new_root = mapping.iter().position(|m| *m == Some(0)).map_or(0, |p| p as u32);
    Ok(ShrinkPlan { released_nodes, exiting, mapping, new_root })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout(per_node: &[u32]) -> Vec<NodeRanks> {
        let mut next = 0;
        per_node
            .iter()
            .enumerate()
            .map(|(node, &k)| {
                let ranks = (next..next + k).collect();
                next += k;
                NodeRanks { node, ranks }
            })
            .collect()
    }

    #[test]
    fn whole_nodes_go_first_then_surplus_ranks() {
        let p = plan_shrink(&layout(&[4, 4, 4]), 6).unwrap();
        assert_eq!(p.released_nodes, vec![2]);
        assert_eq!(p.exiting, vec![6, 7, 8, 9, 10, 11]);
        assert_eq!(p.mapping[5], Some(5));
        let p = plan_shrink(&layout(&[1; 16]), 1).unwrap();
        assert_eq!(p.released_nodes, (1..16).rev().collect::<Vec<_>>());
        assert_eq!(p.new_root, 0);
    }

    #[test]
    fn a_new_root_when_rank_0_leaves() {
        // Rank 0 lives on the newest node (e.g. after a baseline restart placed it there).
        let nodes = vec![NodeRanks { node: 0, ranks: vec![1, 2] }, NodeRanks { node: 1, ranks: vec![0, 3] }];
        let p = plan_shrink(&nodes, 2).unwrap();
        assert_eq!(p.released_nodes, vec![1]);
        assert_eq!(p.new_root, 1);
        assert_eq!(p.mapping, vec![None, Some(0), Some(1), None]);
    }

    #[test]
    fn bad_requests_are_refused() {
        assert_eq!(plan_shrink(&layout(&[2]), 0), Err(ShrinkError::Zero));
        assert_eq!(plan_shrink(&layout(&[2]), 2), Err(ShrinkError::NotAShrink { current: 2, target: 2 }));
        let dup = vec![NodeRanks { node: 0, ranks: vec![0, 0] }];
        assert_eq!(plan_shrink(&dup, 1), Err(ShrinkError::BadRanks(2)));
    }

    proptest! {
        #[test]
        fn survivors_are_dense_and_ordered(per_node in proptest::collection::vec(1u32..5, 1..12), keep in 1u32..40) {
            let nodes = layout(&per_node);
            let current: u32 = per_node.iter().sum();
            prop_assume!(keep < current);
            let p = plan_shrink(&nodes, keep).unwrap();
            prop_assert_eq!(current - p.exiting.len() as u32, keep);
            let survivors: Vec<u32> = p.mapping.iter().flatten().copied().collect();
            prop_assert_eq!(survivors, (0..keep).collect::<Vec<_>>());
            // At most one node is cut partially; released nodes lose all their ranks.
            let partial = nodes.iter().filter(|n| {
                let gone = n.ranks.iter().filter(|r| p.exiting.contains(r)).count();
                gone > 0 && gone < n.ranks.len()
            }).count();
            prop_assert!(partial <= 1);
            for node in &p.released_nodes {
                prop_assert!(nodes[*node].ranks.iter().all(|r| p.exiting.contains(r)));
            }
        }
    }
}
