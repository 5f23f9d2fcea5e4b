//! The spawn plan as a tree: who starts which node world, in what order.
//!
//! Each action of a [`SpawnPlan`] is carried out by the agent that hosts its spawner
//! process. Spawners `0..sources` are the old ranks; the others are processes of node
//! worlds started earlier in the same plan, so every action hangs below the action that
//! started its spawner. Roots are the actions of old ranks. An agent runs the actions of
//! each of its spawner processes one after another, in step order, and the actions of
//! different spawners side by side.

use crate::plan::spawn::{SpawnAction, SpawnPlan};

/// One node world to start, with what it starts in turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpawnNode {
    /// The action.
    pub action: SpawnAction,
    /// Actions whose spawner is one of this world's processes.
    pub children: Vec<SpawnNode>,
}

/// Position of the first process of each group in the spawner order.
fn group_starts(plan: &SpawnPlan) -> Vec<u32> {
    let mut at = plan.sources;
    plan.actions
        .iter()
        .map(|a| {
            let start = at;
            at += a.procs;
            start
        })
        .collect()
}

/// The group whose processes include spawner position `s` (`None`: an old rank).
fn owner(starts: &[u32], plan: &SpawnPlan, s: u32) -> Option<usize> {
    if s < plan.sources {
        return None;
    }
    // Groups are numbered in spawner order, so the owner is the last start <= s.
    let g = starts.partition_point(|&st| st <= s).checked_sub(1)?;
    (s < starts[g] + plan.actions[g].procs).then_some(g)
}

/// The tree of `plan`: the root actions (spawner is an old rank), each with its
/// descendants. Children are ordered by step, then spawner.
#[must_use]
pub fn spawn_tree(plan: &SpawnPlan) -> Vec<SpawnNode> {
    let starts = group_starts(plan);
    let mut kids: Vec<Vec<usize>> = vec![Vec::new(); plan.actions.len()];
    let mut roots = Vec::new();
    for (i, a) in plan.actions.iter().enumerate() {
        match owner(&starts, plan, a.spawner) {
            Some(g) => kids[g].push(i),
            None => roots.push(i),
        }
    }
    fn build(i: usize, plan: &SpawnPlan, kids: &[Vec<usize>]) -> SpawnNode {
        let mut children: Vec<SpawnNode> = kids[i].iter().map(|&k| build(k, plan, kids)).collect();
        children.sort_by_key(|c| (c.action.step, c.action.spawner));
        SpawnNode { action: plan.actions[i], children }
    }
    // Groups only spawn in steps after their own, so the recursion ends.
    let mut out: Vec<SpawnNode> = roots.into_iter().map(|r| build(r, plan, &kids)).collect();
    out.sort_by_key(|c| (c.action.step, c.action.spawner));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::spawn::{plan_expansion, Method, Strategy};
    use proptest::prelude::*;

    fn walk<'a>(nodes: &'a [SpawnNode], out: &mut Vec<&'a SpawnNode>) {
        for n in nodes {
            out.push(n);
            walk(&n.children, out);
        }
    }

    #[test]
    fn hypercube_tree_from_one_process() {
        let plan = plan_expansion(Method::Merge, Strategy::Parallel, &[1, 0, 0, 0, 0, 0, 0, 0], &[1; 8]).unwrap();
        let tree = spawn_tree(&plan);
        // Rank 0 starts one world per step (3), the first of them two more, and so on.
        assert_eq!(tree.iter().map(|n| n.action.step).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(tree[0].children.iter().map(|n| n.action.step).collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(tree[0].children[0].children.len(), 1);
        assert_eq!(tree[1].children.len(), 1);
        assert!(tree[2].children.is_empty());
    }

    proptest! {
        #[test]
        fn every_action_once_and_children_come_later(
            nodes in proptest::collection::vec((0u32..3, 0u32..5), 1..20),
            baseline: bool,
        ) {
            let running: Vec<u32> = nodes.iter().map(|&(r, _)| r).collect();
            let target: Vec<u32> = nodes.iter().map(|&(r, s)| r + s).collect();
            let method = if baseline { Method::Baseline } else { Method::Merge };
            let Ok(plan) = plan_expansion(method, Strategy::Parallel, &running, &target) else { return Ok(()) };
            let tree = spawn_tree(&plan);
            let mut all = Vec::new();
            walk(&tree, &mut all);
            let mut groups: Vec<u32> = all.iter().map(|n| n.action.group).collect();
            groups.sort_unstable();
            prop_assert_eq!(groups, (0..plan.actions.len() as u32).collect::<Vec<_>>());
            for n in &all {
                for c in &n.children {
                    prop_assert!(c.action.step > n.action.step);
                }
            }
            for r in &tree {
                prop_assert!(r.action.spawner < plan.sources);
            }
        }
    }
}
