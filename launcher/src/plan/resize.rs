//! From a requested size to a concrete change of the allocation.
//!
//! The pool is a list of nodes with their slots; the job occupies some of them, in the
//! order they joined. A request for `M` nodes or `P` processes becomes:
//!
//! - **growth**: the occupied nodes are filled up to their slots, then free nodes are
//!   added in pool order, each filled to its slots (for `P`, the last one partly), and
//!   the result is handed to the spawn planner as running/target vectors over the pool;
//! - **shrink**: the newest nodes are released whole, then surplus processes of one node
//!   (the shrink planner decides); for `M` nodes the job keeps the processes of its `M`
//!   oldest nodes.
//!
//! Requests for zero, beyond the pool, or outside the job's bounds are refused with the
//! reason.

use crate::plan::shrink::{plan_shrink, NodeRanks, ShrinkPlan};
use crate::policy::{Bounds, Refusal};
use std::fmt;

/// A size to reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Target {
    /// This many nodes.
    Nodes(u32),
    /// This many processes.
    Procs(u32),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Nodes(n) => write!(f, "{n} nodes"),
            Self::Procs(p) => write!(f, "{p} processes"),
        }
    }
}

/// Where the job stands: pool slots and occupied nodes (join order, with world ranks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Slots of every pool node, by pool index.
    pub slots: Vec<u32>,
    /// Occupied nodes, oldest first: pool index and the world ranks running there.
    pub occupied: Vec<NodeRanks>,
}

/// What a request comes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resize {
    /// Nothing to do: the job already has that size.
    Same,
    /// Grow: processes per pool node now and after (spawn planner input).
    Grow {
        /// Running per pool node.
        running: Vec<u32>,
        /// Target per pool node.
        target: Vec<u32>,
    },
    /// Shrink.
    Shrink(ShrinkPlan),
}

impl Allocation {
    /// Processes running.
    #[must_use]
    pub fn procs(&self) -> u32 {
        self.occupied.iter().map(|n| n.ranks.len() as u32).sum()
    }

    /// Nodes occupied.
    #[must_use]
    pub fn nodes(&self) -> u32 {
        self.occupied.len() as u32
    }

    fn running(&self) -> Vec<u32> {
        let mut r = vec![0; self.slots.len()];
        for n in &self.occupied {
            r[n.node] = n.ranks.len() as u32;
        }
        r
    }

    /// Nodes in the order growth takes them: occupied ones (join order), then free
    /// ones in pool order (a node without slots, one lost by the job, is never taken).
    fn growth_order(&self) -> Vec<usize> {
        let occupied: Vec<usize> = self.occupied.iter().map(|n| n.node).collect();
        let free = (0..self.slots.len()).filter(|i| !occupied.contains(i) && self.slots[*i] > 0);
        occupied.iter().copied().chain(free).collect()
    }
}

/// Turns a request into a change of `alloc` within `bounds` (in nodes).
///
/// # Errors
/// Zero, outside the bounds, more processes than the pool has slots, or fewer than one
/// per node.
pub fn plan_resize(alloc: &Allocation, want: Target, bounds: &Bounds) -> Result<Resize, Refusal> {
    let pool: u64 = alloc.slots.iter().map(|&s| u64::from(s)).sum();
    match want {
        Target::Nodes(m) => {
            bounds.check(m)?;
            let usable = alloc.slots.iter().filter(|&&s| s > 0).count() as u32;
            if m > usable {
                return Err(Refusal::AboveMax(m, usable));
            }
            if m == alloc.nodes() {
                return Ok(Resize::Same);
            }
            if m < alloc.nodes() {
                let keep: u32 = alloc.occupied[..m as usize].iter().map(|n| n.ranks.len() as u32).sum();
                return shrink(alloc, keep);
            }
            let running = alloc.running();
            let mut target = running.clone();
            for &node in alloc.growth_order().iter().take(m as usize) {
                target[node] = alloc.slots[node].max(running[node]);
            }
            Ok(Resize::Grow { running, target })
        }
        Target::Procs(p) => {
            if p == 0 {
                return Err(Refusal::Zero);
            }
            if u64::from(p) > pool {
                return Err(Refusal::BeyondPool(p, pool));
            }
            let now = alloc.procs();
            if p == now {
                return Ok(Resize::Same);
            }
            if p < now {
                let plan = shrink(alloc, p)?;
                if let Resize::Shrink(s) = &plan {
                    bounds.check(alloc.nodes() - s.released_nodes.len() as u32)?;
                }
                return Ok(plan);
            }
            let running = alloc.running();
            let mut target = running.clone();
            let mut left = p - now;
            let mut nodes = 0;
            for node in alloc.growth_order() {
                let add = alloc.slots[node].saturating_sub(running[node]).min(left);
                target[node] += add;
                left -= add;
                if target[node] > 0 {
                    nodes += 1;
                }
                if left == 0 {
                    break;
                }
            }
            bounds.check(nodes)?;
            Ok(Resize::Grow { running, target })
        }
    }
}

fn shrink(alloc: &Allocation, keep: u32) -> Result<Resize, Refusal> {
    plan_shrink(&alloc.occupied, keep).map(Resize::Shrink).map_err(|e| Refusal::Impossible(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(slots: &[u32], occ: &[(usize, std::ops::Range<u32>)]) -> Allocation {
        Allocation {
            slots: slots.to_vec(),
            occupied: occ.iter().map(|(n, r)| NodeRanks { node: *n, ranks: r.clone().collect() }).collect(),
        }
    }

    fn bounds(max: u32) -> Bounds {
        Bounds::new(1, max, None).unwrap()
    }

    #[test]
    fn growth_fills_occupied_nodes_then_free_ones() {
        let a = alloc(&[4, 2, 8, 12], &[(0, 0..2)]);
        let r = plan_resize(&a, Target::Nodes(3), &bounds(4)).unwrap();
        assert_eq!(r, Resize::Grow { running: vec![2, 0, 0, 0], target: vec![4, 2, 8, 0] });
        let r = plan_resize(&a, Target::Procs(7), &bounds(4)).unwrap();
        assert_eq!(r, Resize::Grow { running: vec![2, 0, 0, 0], target: vec![4, 2, 1, 0] });
        assert_eq!(plan_resize(&a, Target::Procs(2), &bounds(4)).unwrap(), Resize::Same);
    }

    #[test]
    fn shrink_keeps_the_oldest_nodes() {
        let a = alloc(&[2, 2, 2], &[(0, 0..2), (2, 2..4), (1, 4..6)]);
        match plan_resize(&a, Target::Nodes(1), &bounds(3)).unwrap() {
            Resize::Shrink(s) => {
                assert_eq!(s.released_nodes, vec![1, 2]);
                assert_eq!(s.mapping, vec![Some(0), Some(1), None, None, None, None]);
            }
            other => panic!("expected a shrink, got {other:?}"),
        }
        match plan_resize(&a, Target::Procs(3), &bounds(3)).unwrap() {
            Resize::Shrink(s) => assert_eq!(s.exiting, vec![3, 4, 5]),
            other => panic!("expected a shrink, got {other:?}"),
        }
    }

    #[test]
    fn bad_requests_are_refused_with_the_reason() {
        let a = alloc(&[2, 2], &[(0, 0..2)]);
        let b = Bounds::new(1, 2, None).unwrap();
        assert_eq!(plan_resize(&a, Target::Nodes(0), &b), Err(Refusal::Zero));
        assert_eq!(plan_resize(&a, Target::Procs(0), &b), Err(Refusal::Zero));
        assert_eq!(plan_resize(&a, Target::Nodes(3), &b), Err(Refusal::AboveMax(3, 2)));
        assert_eq!(plan_resize(&a, Target::Procs(5), &b), Err(Refusal::BeyondPool(5, 4)));
        let tight = Bounds::new(2, 2, None).unwrap();
        let two = alloc(&[2, 2], &[(0, 0..2), (1, 2..4)]);
        assert_eq!(plan_resize(&two, Target::Procs(1), &tight), Err(Refusal::BelowMin(1, 2)));
        assert_eq!(plan_resize(&two, Target::Nodes(1), &tight), Err(Refusal::BelowMin(1, 2)));
    }
}
