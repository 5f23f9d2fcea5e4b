//! The controller's view of the job's membership, and how a planned change turns into
//! the next membership. Pure: ids, addresses and tokens go in, orders and
//! [`Change`]s come out.
//!
//! Every process gets an endpoint id once (`next_id` counts up) and keeps it; ranks are
//! positions in [`JobState::ranks`]. A merge growth keeps the old ranks and appends the
//! new processes group by group (paper 000 Eq. 9); a baseline growth numbers only the
//! new processes; a shrink keeps the survivors in order (the shrink plan's mapping).

use crate::plan::resize::Allocation;
use crate::plan::shrink::{NodeRanks, ShrinkPlan};
use crate::plan::spawn::{Method, SpawnPlan};
use crate::plan::tree::{spawn_tree, SpawnNode};
use crate::proto::{NodeStarted, SpawnOrder, Token};
use ductile::bootstrap::{Change, Membership};
use ductile_transport::{EndpointAddr, NodeId, Rank};
use std::collections::HashMap;

/// The job's membership as the controller keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobState {
    /// Epoch of the current membership.
    pub epoch: u64,
    /// Endpoint id of every rank, in rank order.
    pub ranks: Vec<Rank>,
    /// Node of every rank.
    pub nodes: Vec<NodeId>,
    /// Address of every endpoint id handed out.
    pub addrs: Vec<EndpointAddr>,
    /// Slots of every pool node.
    pub slots: Vec<u32>,
    /// Occupied pool nodes, oldest first.
    pub join_order: Vec<NodeId>,
    /// Resource changes so far (growths that failed before their switch count too, so
    /// that every resize has a number of its own).
    pub changes: u32,
}

/// A growth ready to be carried out: the orders per spawning process.
#[derive(Clone, Debug)]
pub struct GrowOrders {
    /// Top-level orders, each with the endpoint id of its spawner (an old rank).
    pub roots: Vec<(Rank, SpawnOrder)>,
    /// Endpoint ids of each new group, in group order.
    pub group_ids: Vec<Vec<Rank>>,
    /// Node of each new group.
    pub group_nodes: Vec<NodeId>,
}

/// Why a gathered growth does not fit the plan.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum GatherError {
    /// A planned process did not report.
    #[error("{0} of the growth did not report an address")]
    Missing(Rank),
    /// A process reported that was not planned.
    #[error("{0} reported but is not part of the growth")]
    Unexpected(Rank),
}

impl JobState {
    /// The initial membership: ids `0..n` on the given nodes.
    #[must_use]
    pub fn initial(nodes: Vec<NodeId>, addrs: Vec<EndpointAddr>, slots: Vec<u32>) -> Self {
        let mut join_order: Vec<NodeId> = Vec::new();
        for n in &nodes {
            if !join_order.contains(n) {
                join_order.push(*n);
            }
        }
        let ranks = (0..nodes.len() as u32).map(Rank).collect();
        Self { epoch: 0, ranks, nodes, addrs, slots, join_order, changes: 0 }
    }

    /// The membership sent to ranks.
    #[must_use]
    pub fn membership(&self) -> Membership {
        Membership {
            epoch: self.epoch,
            ranks: self.ranks.clone(),
            nodes: self.nodes.clone(),
            addrs: self.addrs.clone(),
        }
    }

    /// Next endpoint id to hand out.
    #[must_use]
    pub fn next_id(&self) -> u32 {
        self.addrs.len() as u32
    }

    /// Occupied nodes (oldest first) with their ranks, for the planners.
    #[must_use]
    pub fn allocation(&self) -> Allocation {
        let occupied = self
            .join_order
            .iter()
            .map(|n| NodeRanks {
                node: n.0 as usize,
                ranks: (0..self.ranks.len() as u32).filter(|&r| self.nodes[r as usize] == *n).collect(),
            })
            .collect();
        Allocation { slots: self.slots.clone(), occupied }
    }

    /// Number of occupied nodes.
    #[must_use]
    pub fn node_count(&self) -> u32 {
        self.join_order.len() as u32
    }

    /// The orders that carry out `plan`, with fresh ids for the new processes and the
    /// token of each new node world (`tokens[g]` for group `g`).
    #[must_use]
    pub fn grow_orders(&self, plan: &SpawnPlan, tokens: &[Token]) -> GrowOrders {
        let mut next = self.next_id();
        let mut group_ids = Vec::with_capacity(plan.actions.len());
        let mut group_nodes = Vec::with_capacity(plan.actions.len());
        for a in &plan.actions {
            group_ids.push((next..next + a.procs).map(Rank).collect::<Vec<_>>());
            group_nodes.push(NodeId(a.node as u32));
            next += a.procs;
        }
        fn order(n: &SpawnNode, ids: &[Vec<Rank>], tokens: &[Token]) -> SpawnOrder {
            let g = n.action.group as usize;
            SpawnOrder {
                spawner: n.action.spawner,
                step: n.action.step,
                node: NodeId(n.action.node as u32),
                ids: ids[g].clone(),
                slots: Vec::new(),
                host: None,
                token: tokens.get(g).cloned().unwrap_or(Token([0; 32])),
                spawns: n.children.iter().map(|c| order(c, ids, tokens)).collect(),
            }
        }
        let roots = spawn_tree(plan)
            .iter()
            .map(|n| (self.ranks[n.action.spawner as usize], order(n, &group_ids, tokens)))
            .collect();
        GrowOrders { roots, group_ids, group_nodes }
    }

    /// The membership after a growth whose new processes reported `started`.
    ///
    /// # Errors
    /// A planned process is missing, or an unplanned one reported.
    pub fn after_growth(
        &self,
        plan: &SpawnPlan,
        orders: &GrowOrders,
        started: &[NodeStarted],
    ) -> Result<(Change, Self), GatherError> {
        let mut addr: HashMap<Rank, EndpointAddr> = HashMap::new();
        for r in started.iter().flat_map(|n| &n.ranks) {
            addr.insert(r.id, r.addr.clone());
        }
        let mut next = self.clone();
        let new_ids: Vec<Rank> = orders.group_ids.iter().flatten().copied().collect();
        for id in &new_ids {
            let a = addr.remove(id).ok_or(GatherError::Missing(*id))?;
            debug_assert_eq!(id.index(), next.addrs.len(), "ids are handed out in order");
            next.addrs.push(a);
        }
        if let Some(extra) = addr.keys().next() {
            return Err(GatherError::Unexpected(*extra));
        }
        let new_nodes: Vec<NodeId> =
            orders.group_ids.iter().zip(&orders.group_nodes).flat_map(|(ids, n)| ids.iter().map(move |_| *n)).collect();
        match plan.method {
            Method::Merge => {
                next.ranks.extend(&new_ids);
                next.nodes.extend(&new_nodes);
            }
            Method::Baseline => {
                next.ranks = new_ids;
                next.nodes = new_nodes.clone();
                next.join_order.clear();
            }
        }
        for n in &orders.group_nodes {
            if !next.join_order.contains(n) {
                next.join_order.push(*n);
            }
        }
        Ok(next.advance(self))
    }

    /// The membership after a shrink.
    #[must_use]
    pub fn after_shrink(&self, plan: &ShrinkPlan) -> (Change, Self) {
        let mut next = self.clone();
        let kept = plan.mapping.iter().filter(|m| m.is_some()).count();
        let mut ranks = vec![Rank(0); kept];
        let mut nodes = vec![NodeId(0); kept];
        for (old, new) in plan.mapping.iter().enumerate() {
            if let Some(n) = new {
                ranks[*n as usize] = self.ranks[old];
                nodes[*n as usize] = self.nodes[old];
            }
        }
        next.ranks = ranks;
        next.nodes = nodes;
        next.join_order.retain(|n| !plan.released_nodes.contains(&(n.0 as usize)));
        next.advance(self)
    }

    /// The membership after processes failed (`--on-failure shrink`): the survivors in
    /// their order, the failed processes' addresses blank, and the nodes lost with
    /// their agents (`lost_nodes`) out of the pool. The change names every failed
    /// process, those that were no rank of this membership too (new in a change that
    /// was abandoned): the survivors fence them all off, and a change whose failed
    /// processes were all new is still a recovery, the ranks unchanged.
    #[must_use]
    pub fn after_failure(&self, failed: &[Rank], lost_nodes: &[NodeId]) -> (Change, Self) {
        let mut next = self.clone();
        let keep: Vec<usize> = (0..self.ranks.len()).filter(|&i| !failed.contains(&self.ranks[i])).collect();
        next.ranks = keep.iter().map(|&i| self.ranks[i]).collect();
        next.nodes = keep.iter().map(|&i| self.nodes[i]).collect();
        let occupied = next.nodes.clone();
        next.join_order.retain(|n| occupied.contains(n));
        for n in lost_nodes {
            if let Some(s) = next.slots.get_mut(n.0 as usize) {
                *s = 0;
            }
        }
        for f in failed {
            if let Some(a) = next.addrs.get_mut(f.index()) {
                *a = EndpointAddr(String::new());
            }
        }
        let (mut change, next) = next.advance(self);
        change.failed = failed.to_vec();
        (change, next)
    }

    fn advance(mut self, before: &Self) -> (Change, Self) {
        self.epoch = before.epoch + 1;
        self.changes = before.changes + 1;
        let change = Change {
            seq: self.changes,
            checkpoint: 0,
            before: before.ranks.clone(),
            after: self.membership(),
            failed: Vec::new(),
        };
        (change, self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::shrink::plan_shrink;
    use crate::plan::spawn::{plan_expansion, Strategy};
    use crate::proto::RankStarted;

    fn addr(i: u32) -> EndpointAddr {
        EndpointAddr(format!("127.0.0.1:{}", 1000 + i))
    }

    fn start(n: usize, slots: u32, pool: usize) -> JobState {
        let nodes: Vec<NodeId> = (0..n).map(|i| NodeId(i as u32 / slots)).collect();
        JobState::initial(nodes, (0..n as u32).map(addr).collect(), vec![slots; pool])
    }

    fn tokens(plan: &SpawnPlan) -> Vec<Token> {
        (0..plan.actions.len()).map(|g| Token([g as u8; 32])).collect()
    }

    fn report(orders: &GrowOrders) -> Vec<NodeStarted> {
        orders
            .group_ids
            .iter()
            .zip(&orders.group_nodes)
            .map(|(ids, n)| NodeStarted {
                node: *n,
                agent_pid: 1,
                ranks: ids.iter().map(|id| RankStarted { id: *id, pid: 2, addr: addr(id.0) }).collect(),
            })
            .collect()
    }

    #[test]
    fn merge_growth_appends_groups_and_baseline_replaces() {
        let s = start(2, 2, 4);
        let a = s.allocation();
        assert_eq!(a.occupied.len(), 1);
        let plan = plan_expansion(Method::Merge, Strategy::Parallel, &[2, 0, 0, 0], &[2, 2, 2, 2]).unwrap();
        let orders = s.grow_orders(&plan, &tokens(&plan));
        // Old ranks 0 and 1 start nodes 1 and 2 in step 1; rank 0 starts node 3 in step 2.
        assert_eq!(orders.roots.len(), 3);
        assert_eq!(orders.group_ids, vec![vec![Rank(2), Rank(3)], vec![Rank(4), Rank(5)], vec![Rank(6), Rank(7)]]);
        let (change, next) = s.after_growth(&plan, &orders, &report(&orders)).unwrap();
        assert_eq!(change.seq, 1);
        assert_eq!(change.before, vec![Rank(0), Rank(1)]);
        assert_eq!(next.ranks, (0..8).map(Rank).collect::<Vec<_>>());
        assert_eq!(next.join_order, vec![NodeId(0), NodeId(1), NodeId(2), NodeId(3)]);
        assert_eq!(next.epoch, 1);
        assert_eq!(next.addrs[7], addr(7));
        // Each order carries its own group's token, wherever it sits in the tree.
        fn check(o: &SpawnOrder, orders: &GrowOrders) {
            let g = orders.group_ids.iter().position(|ids| *ids == o.ids).unwrap();
            assert_eq!(o.token, Token([g as u8; 32]));
            o.spawns.iter().for_each(|c| check(c, orders));
        }
        orders.roots.iter().for_each(|(_, o)| check(o, &orders));

        let plan = plan_expansion(Method::Baseline, Strategy::Parallel, &[2, 0, 0, 0], &[2, 2, 0, 0]).unwrap();
        let orders = s.grow_orders(&plan, &tokens(&plan));
        let (change, next) = s.after_growth(&plan, &orders, &report(&orders)).unwrap();
        assert_eq!(change.after.ranks, (2..6).map(Rank).collect::<Vec<_>>());
        assert_eq!(next.join_order, vec![NodeId(0), NodeId(1)]);
    }

    #[test]
    fn a_missing_or_unplanned_process_is_an_error() {
        let s = start(1, 1, 3);
        let plan = plan_expansion(Method::Merge, Strategy::Single, &[1, 0, 0], &[1, 1, 1]).unwrap();
        let orders = s.grow_orders(&plan, &tokens(&plan));
        let mut got = report(&orders);
        got[1].ranks.clear();
        assert_eq!(s.after_growth(&plan, &orders, &got).unwrap_err(), GatherError::Missing(Rank(2)));
        let mut got = report(&orders);
        got[0].ranks.push(RankStarted { id: Rank(9), pid: 0, addr: addr(9) });
        assert_eq!(s.after_growth(&plan, &orders, &got).unwrap_err(), GatherError::Unexpected(Rank(9)));
    }

    #[test]
    fn a_failure_keeps_the_survivors_in_order_and_takes_lost_nodes_out_of_the_pool() {
        // 6 ranks, 2 per node on nodes 0-2; rank 3 (node 1) fails alone, then node 2 is
        // lost with both its ranks.
        let s = start(6, 2, 4);
        let (change, next) = s.after_failure(&[Rank(3)], &[]);
        assert_eq!(change.before, s.ranks);
        assert_eq!(change.failed, vec![Rank(3)]);
        assert_eq!(next.ranks, [0, 1, 2, 4, 5].map(Rank));
        assert_eq!(next.nodes, [0, 0, 1, 2, 2].map(NodeId));
        assert_eq!((next.epoch, next.changes), (1, 1));
        assert_eq!(next.addrs[3], EndpointAddr(String::new()));
        assert_eq!(next.addrs[4], addr(4));
        assert_eq!(next.slots, vec![2; 4]);
        let (change, next) = next.after_failure(&[Rank(4), Rank(5)], &[NodeId(2)]);
        assert_eq!(change.after.ranks, [0, 1, 2].map(Rank));
        assert_eq!(next.join_order, vec![NodeId(0), NodeId(1)]);
        // Processes that were no ranks (new in an abandoned change) are named all the
        // same; the ranks stay.
        let (change, same) = next.after_failure(&[Rank(7)], &[]);
        assert_eq!((change.failed, change.before.clone()), (vec![Rank(7)], change.after.ranks));
        assert_eq!(same.ranks, next.ranks);
        assert_eq!(next.slots, vec![2, 2, 0, 2]);
        // A growth to three nodes fills node 1 and takes node 3, never the lost node 2;
        // four are too many.
        let a = next.allocation();
        let bounds = crate::policy::Bounds { min: 1, max: 4, preferred: None };
        let grow = crate::plan::resize::plan_resize(&a, crate::plan::resize::Target::Nodes(3), &bounds).unwrap();
        assert!(matches!(grow, crate::plan::resize::Resize::Grow { target, .. } if target == vec![2, 2, 0, 2]));
        assert!(crate::plan::resize::plan_resize(&a, crate::plan::resize::Target::Nodes(4), &bounds).is_err());
    }

    #[test]
    fn shrink_renumbers_survivors_and_frees_nodes() {
        let s = start(6, 2, 3);
        let plan = plan_shrink(&s.allocation().occupied, 3).unwrap();
        let (change, next) = s.after_shrink(&plan);
        assert_eq!(change.before.len(), 6);
        assert_eq!(next.ranks, vec![Rank(0), Rank(1), Rank(2)]);
        assert_eq!(next.join_order, vec![NodeId(0), NodeId(1)]);
        assert_eq!(next.epoch, 1);
        // Addresses stay: released processes still take part in the change.
        assert_eq!(next.addrs.len(), 6);
    }
}
