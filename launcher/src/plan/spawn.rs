//! Expansion planning: which process starts which node world in which step.
//!
//! **Parallel (tree) spawning** (paper 000 §4.1-4.2): in every step each process that
//! already exists starts one new node world, on a distinct node; the processes started
//! in a step spawn too from the next step on. The vector `S` (processes to spawn per
//! node; zero entries are skipped) is consumed in order, one entry per existing
//! process: step i uses the next `T_{i-1}` entries, where `T_{i-1}` is the number of
//! processes after step i-1 (paper 000 Eqs. 4-8). With C slots on every node this is
//! the *hypercube*: from N0 nodes, N0·(C+1)^k nodes after k steps. With slots that
//! differ per node it is the *iterative diffusive* strategy.
//!
//! **Single**: process 0 starts every new node world itself, all in one step.
//!
//! **Methods**: *merge* keeps the source processes and spawns only the difference
//! (`S = A - R`, spawners are the running processes); *baseline* starts a complete new
//! set of processes for the target allocation (`S = A`) with the sources as spawners,
//! after which every source ends.
//!
//! Spawners are numbered in rank order: the sources first, then the processes of each
//! spawned group by group id and local rank, which is also the rank order of the
//! resulting group (paper 000 Eq. 9, see [`SpawnPlan::first_rank`]).

use serde::Serialize;

/// Reuse the sources or start over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Method {
    /// Keep the sources; spawn only the difference.
    Merge,
    /// Spawn the whole target; the sources end afterwards.
    Baseline,
}

/// Who spawns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Strategy {
    /// Every existing process spawns, step by step (hypercube / iterative diffusive).
    Parallel,
    /// One process spawns every new node world.
    Single,
}

/// One node world to start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SpawnAction {
    /// Step, from 1.
    pub step: u32,
    /// The spawning process, by position in the spawner order (see the module docs).
    pub spawner: u32,
    /// Index of the target node in the allocation.
    pub node: usize,
    /// Processes to start there.
    pub procs: u32,
    /// Group id: spawn order over the whole plan.
    pub group: u32,
}

/// The state after one step (index 0: before spawning).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct StepState {
    /// Processes existing after the step (T_i).
    pub procs: u32,
    /// Processes started in the step (G_i).
    pub generated: u32,
    /// Nodes occupied after the step (N_i).
    pub nodes: u32,
    /// Nodes newly occupied in the step.
    pub new_nodes: u32,
}

/// An expansion plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SpawnPlan {
    /// Method.
    pub method: Method,
    /// Strategy.
    pub strategy: Strategy,
    /// Processes before the expansion.
    pub sources: u32,
    /// Every node world to start, in group-id order.
    pub actions: Vec<SpawnAction>,
    /// State per step, starting with the initial state.
    pub steps: Vec<StepState>,
}

/// A request that cannot be planned.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlanError {
    /// The vectors describe different numbers of nodes.
    #[error("allocation vectors differ in length ({0} and {1})")]
    LengthMismatch(usize, usize),
    /// A node would run fewer processes than it does (not an expansion).
    #[error("node {node} runs {running} processes; the target {target} is smaller (use a shrink)")]
    NotAnExpansion {
        /// Node index.
        node: usize,
        /// Processes running there.
        running: u32,
        /// Target.
        target: u32,
    },
    /// No process exists to spawn from.
    #[error("no running process to spawn from")]
    NoSpawners,
    /// Counts beyond u32.
    #[error("process count overflows")]
    Overflow,
}

impl SpawnPlan {
    /// Number of steps.
    #[must_use]
    pub fn step_count(&self) -> u32 {
        self.actions.last().map_or(0, |a| a.step)
    }

    /// Processes in the group after the expansion.
    #[must_use]
    pub fn total(&self) -> u32 {
        let spawned: u32 = self.actions.iter().map(|a| a.procs).sum();
        match self.method {
            Method::Merge => self.sources + spawned,
            Method::Baseline => spawned,
        }
    }

    /// The rank of local rank 0 of group `g` in the new group (paper 000 Eq. 9): merge
    /// keeps the sources' ranks and appends groups in group-id order; baseline numbers
    /// the groups from 0.
    #[must_use]
    pub fn first_rank(&self, g: u32) -> u32 {
        let before: u32 = self.actions.iter().take_while(|a| a.group < g).map(|a| a.procs).sum();
        match self.method {
            Method::Merge => self.sources + before,
            Method::Baseline => before,
        }
    }
}

fn sum(v: &[u32]) -> Result<u32, PlanError> {
    v.iter().try_fold(0u32, |a, &b| a.checked_add(b)).ok_or(PlanError::Overflow)
}

/// Plans an expansion from `running` processes per node to `target` per node (same
/// node order; nodes not yet used have 0 running).
///
/// # Errors
/// Vectors of different length, a node whose target is below what runs there (merge),
/// no running process, or counts past `u32`.
pub fn plan_expansion(
    method: Method,
    strategy: Strategy,
    running: &[u32],
    target: &[u32],
) -> Result<SpawnPlan, PlanError> {
    if running.len() != target.len() {
        return Err(PlanError::LengthMismatch(running.len(), target.len()));
    }
    let sources = sum(running)?;
    sum(target)?;
    if sources == 0 {
        return Err(PlanError::NoSpawners);
    }
    let to_spawn: Vec<u32> = match method {
        Method::Merge => running
            .iter()
            .zip(target)
            .enumerate()
            .map(|(node, (&r, &t))| t.checked_sub(r).ok_or(PlanError::NotAnExpansion { node, running: r, target: t }))
            .collect::<Result<_, _>>()?,
        Method::Baseline => target.to_vec(),
    };
    // Baseline starts over: every node with a target is "new" for the new group.
    let occupied: Vec<u32> = match method {
        Method::Merge => running.to_vec(),
        Method::Baseline => vec![0; running.len()],
    };
    let mut plan = diffusive(sources, &occupied, &to_spawn)?;
    plan.method = method;
    if strategy == Strategy::Single {
        for a in &mut plan.actions {
            a.step = 1;
            a.spawner = 0;
        }
        let last = *plan.steps.last().expect("diffusive always records the initial state");
        let first = plan.steps[0];
        plan.steps =
            vec![first, StepState { generated: last.procs - first.procs, new_nodes: last.nodes - first.nodes, ..last }];
        if plan.actions.is_empty() {
            plan.steps.truncate(1);
        }
    }
    plan.strategy = strategy;
    Ok(plan)
}

/// The iterative diffusive strategy (paper 000 Eqs. 4-8): `spawners` processes exist at
/// the start (T_0), `occupied[j]` processes already run on node j (a node with none
/// counts as newly occupied when spawned to), and
/// `to_spawn[j]` processes are to be started on node j.
///
/// # Errors
/// No spawners while something is to be spawned, or overflow.
pub fn diffusive(spawners: u32, occupied: &[u32], to_spawn: &[u32]) -> Result<SpawnPlan, PlanError> {
    if occupied.len() != to_spawn.len() {
        return Err(PlanError::LengthMismatch(occupied.len(), to_spawn.len()));
    }
    let entries: Vec<(usize, u32)> = to_spawn.iter().copied().enumerate().filter(|&(_, s)| s > 0).collect();
    let mut procs = spawners;
    let mut nodes = occupied.iter().filter(|&&r| r > 0).count() as u32;
    let mut steps = vec![StepState { procs, generated: 0, nodes, new_nodes: 0 }];
    let mut actions = Vec::with_capacity(entries.len());
    let mut next = 0;
    let mut step = 0;
    while next < entries.len() {
        if procs == 0 {
            return Err(PlanError::NoSpawners);
        }
        step += 1;
        let take = (procs as usize).min(entries.len() - next);
        let (mut generated, mut new_nodes) = (0u32, 0u32);
        for (k, &(node, s)) in entries[next..next + take].iter().enumerate() {
            let group = u32::try_from(actions.len()).map_err(|_| PlanError::Overflow)?;
            actions.push(SpawnAction { step, spawner: k as u32, node, procs: s, group });
            generated = generated.checked_add(s).ok_or(PlanError::Overflow)?;
            if occupied[node] == 0 {
                new_nodes += 1;
            }
        }
        next += take;
        procs = procs.checked_add(generated).ok_or(PlanError::Overflow)?;
        nodes += new_nodes;
        steps.push(StepState { procs, generated, nodes, new_nodes });
    }
    Ok(SpawnPlan { method: Method::Merge, strategy: Strategy::Parallel, sources: spawners, actions, steps })
}

/// The hypercube: `n0` nodes of `slots` processes grow to `target_nodes` nodes.
///
/// # Errors
/// No slots or nodes to start from, or overflow.
pub fn hypercube(n0: u32, slots: u32, target_nodes: u32) -> Result<SpawnPlan, PlanError> {
    let total = target_nodes.max(n0) as usize;
    let running: Vec<u32> = (0..total).map(|i| if (i as u32) < n0 { slots } else { 0 }).collect();
    plan_expansion(Method::Merge, Strategy::Parallel, &running, &vec![slots; total])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{prop_assert, prop_assert_eq, prop_assume, proptest, TestCaseError};
    use std::collections::HashSet;

    /// Paper 000, Table 2.
    #[test]
    fn table_2_of_paper_000() {
        let a = [4, 2, 8, 12, 3, 3, 4, 4, 6, 3];
        let r = [2, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let plan = plan_expansion(Method::Merge, Strategy::Parallel, &r, &a).unwrap();
        let got: Vec<(u32, u32, u32, u32)> =
            plan.steps.iter().map(|s| (s.procs, s.generated, s.nodes, s.new_nodes)).collect();
        assert_eq!(got, vec![(2, 0, 1, 0), (6, 4, 2, 1), (40, 34, 8, 6), (49, 9, 10, 2)]);
        // Step 1 uses S entries 0..=1, step 2 entries 2..=7, step 3 entries 8..=9.
        let nodes_of = |s: u32| plan.actions.iter().filter(|a| a.step == s).map(|a| a.node).collect::<Vec<_>>();
        assert_eq!(nodes_of(1), vec![0, 1]);
        assert_eq!(nodes_of(2), vec![2, 3, 4, 5, 6, 7]);
        assert_eq!(nodes_of(3), vec![8, 9]);
        assert_eq!(plan.total(), 49);
    }

    /// Paper 000, Figure 1: 1 process, 1 core per node, to 8 nodes in 3 steps.
    #[test]
    fn hypercube_of_figure_1() {
        let plan = hypercube(1, 1, 8).unwrap();
        assert_eq!(plan.step_count(), 3);
        assert_eq!(plan.actions.len(), 7);
        let per_step: Vec<usize> = (1..=3).map(|s| plan.actions.iter().filter(|a| a.step == s).count()).collect();
        assert_eq!(per_step, vec![1, 2, 4]);
        assert_eq!(plan.first_rank(0), 1);
        assert_eq!(plan.first_rank(6), 7);
    }

    #[test]
    fn single_and_baseline() {
        let plan = plan_expansion(Method::Merge, Strategy::Single, &[1, 0, 0, 0], &[1, 1, 1, 1]).unwrap();
        assert_eq!(plan.step_count(), 1);
        assert!(plan.actions.iter().all(|a| a.spawner == 0));
        assert_eq!(plan.steps.last().unwrap().procs, 4);
        let plan = plan_expansion(Method::Baseline, Strategy::Parallel, &[2, 0, 0], &[2, 2, 2]).unwrap();
        assert_eq!(plan.total(), 6);
        assert_eq!(plan.first_rank(0), 0);
        assert_eq!(plan.first_rank(2), 4);
        assert_eq!(plan.step_count(), 2);
        let none = plan_expansion(Method::Merge, Strategy::Single, &[2, 0], &[2, 0]).unwrap();
        assert!(none.actions.is_empty());
        assert_eq!(none.steps.len(), 1);
    }

    #[test]
    fn bad_requests_are_refused() {
        assert_eq!(
            plan_expansion(Method::Merge, Strategy::Parallel, &[1], &[1, 1]),
            Err(PlanError::LengthMismatch(1, 2))
        );
        assert_eq!(
            plan_expansion(Method::Merge, Strategy::Parallel, &[3, 0], &[2, 1]),
            Err(PlanError::NotAnExpansion { node: 0, running: 3, target: 2 })
        );
        assert_eq!(plan_expansion(Method::Merge, Strategy::Parallel, &[0, 0], &[1, 1]), Err(PlanError::NoSpawners));
        assert_eq!(
            plan_expansion(Method::Merge, Strategy::Parallel, &[1, 0], &[u32::MAX, 1]),
            Err(PlanError::Overflow)
        );
    }

    fn check_invariants(plan: &SpawnPlan, running: &[u32], target: &[u32]) -> Result<(), TestCaseError> {
        // Every node that needs processes is spawned exactly once, with the right count.
        let mut seen = HashSet::new();
        for a in &plan.actions {
            prop_assert!(seen.insert(a.node), "node {} spawned twice", a.node);
            let want = match plan.method {
                Method::Merge => target[a.node] - running[a.node],
                Method::Baseline => target[a.node],
            };
            prop_assert_eq!(a.procs, want);
        }
        for (j, (&r, &t)) in running.iter().zip(target).enumerate() {
            let need = match plan.method {
                Method::Merge => t - r,
                Method::Baseline => t,
            };
            prop_assert_eq!(seen.contains(&j), need > 0);
        }
        // No spawner twice in a step, and every spawner exists by then.
        for s in 1..=plan.step_count() {
            let mut spawners = HashSet::new();
            for a in plan.actions.iter().filter(|a| a.step == s) {
                prop_assert!(spawners.insert(a.spawner));
                if plan.strategy == Strategy::Parallel {
                    prop_assert!(a.spawner < plan.steps[(s - 1) as usize].procs);
                }
            }
        }
        // Group ids are the action order, and ranks are dense.
        for (i, a) in plan.actions.iter().enumerate() {
            prop_assert_eq!(a.group as usize, i);
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn diffusive_plans_are_complete_and_well_formed(
            nodes in proptest::collection::vec((0u32..4, 0u32..6), 1..24),
            baseline: bool,
        ) {
            let running: Vec<u32> = nodes.iter().map(|&(r, _)| r).collect();
            let target: Vec<u32> = nodes.iter().map(|&(r, extra)| r + extra).collect();
            prop_assume!(running.iter().sum::<u32>() > 0);
            let method = if baseline { Method::Baseline } else { Method::Merge };
            let plan = plan_expansion(method, Strategy::Parallel, &running, &target).unwrap();
            check_invariants(&plan, &running, &target)?;
            prop_assert_eq!(plan.total(), target.iter().sum::<u32>());
            // Greedy growth is the fastest possible: in each step but the last, every
            // existing process spawned.
            for s in 1..plan.step_count() {
                let used = plan.actions.iter().filter(|a| a.step == s).count() as u32;
                prop_assert_eq!(used, plan.steps[(s - 1) as usize].procs);
            }
        }

        #[test]
        fn hypercube_follows_the_growth_law(n0 in 1u32..5, slots in 1u32..6, grow in 1u32..40) {
            let target = n0 + grow;
            let plan = hypercube(n0, slots, target).unwrap();
            // Minimal k with n0 * (C+1)^k >= target.
            let mut k = 0;
            let mut reach = u64::from(n0);
            while reach < u64::from(target) {
                reach *= u64::from(slots + 1);
                k += 1;
            }
            prop_assert_eq!(plan.step_count(), k);
            for (i, st) in plan.steps.iter().enumerate().take(plan.steps.len() - 1) {
                let law = u64::from(n0) * u64::from(slots + 1).pow(i as u32);
                prop_assert_eq!(u64::from(st.nodes), law);
            }
            prop_assert_eq!(plan.steps.last().unwrap().nodes, target);
            let running: Vec<u32> = (0..target).map(|i| if i < n0 { slots } else { 0 }).collect();
            check_invariants(&plan, &running, &vec![slots; target as usize])?;
        }
    }
}
