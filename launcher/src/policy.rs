//! Resource-change policies: when a running job should grow or shrink.
//!
//! A [`ResourceManager`] is asked at every checkpoint of the job whether its node count
//! should change, and it is told which nodes went back to the pool. Every answer stays
//! inside the job's [`Bounds`] (DMR's min/max/preferred hints). The policies of
//! `--policy` (paper 001's schedulers among them) are pure state machines:
//!
//! - `fixed`: never changes (but see the preferred count below);
//! - `steps:A,B,C`: at the 1st, 2nd, 3rd change point the job goes to A, B, C nodes
//!   (change points passing while a change is under way do not count);
//! - `inc-dec`: one node more at every change point up to the maximum, then one fewer
//!   down to the floor, and so on;
//! - `random[:SEED]`: a normally distributed change (Box-Muller), rounded and clamped.
//!
//! A change point is every `period`-th checkpoint (`--period K`).
//!
//! **Preferred count** (`--preferred-nodes P`, DMR's "sweet spot"): the size the
//! job runs best at, below which the resource manager never takes it, while it may
//! still grant growth up to the maximum. So P is every policy's floor instead of the
//! minimum, and under `fixed` a job started below P grows to P at its first change
//! point (once: a growth that fails is not tried again). Requests from outside
//! (`ductile resize`) and from the application are the user's own choice, bounded by
//! min and max only; `fixed` and `steps:` leave their result alone, while `inc-dec` and
//! `random`, which change the job at every change point, take it back to P or above.

use std::str::FromStr;

/// Limits of the job's node count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Fewest nodes.
    pub min: u32,
    /// Most nodes (at most the pool's size).
    pub max: u32,
    /// Preferred node count, if any.
    pub preferred: Option<u32>,
}

/// Why a size is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// Zero nodes.
    #[error("a job needs at least one node")]
    Zero,
    /// Below the minimum.
    #[error("{0} nodes is below the job's minimum of {1}")]
    BelowMin(u32, u32),
    /// Above the maximum.
    #[error("{0} nodes is above the job's maximum of {1}")]
    AboveMax(u32, u32),
    /// Bounds that contradict each other.
    #[error("bad bounds: {0}")]
    BadBounds(String),
    /// More processes than the pool has slots.
    #[error("{0} processes do not fit in the pool's {1} slots")]
    BeyondPool(u32, u64),
    /// A change the planners cannot make.
    #[error("{0}")]
    Impossible(String),
}

impl Bounds {
    /// Checked bounds.
    ///
    /// # Errors
    /// `min` of 0, `min > max`, or a preferred count outside them.
    pub fn new(min: u32, max: u32, preferred: Option<u32>) -> Result<Self, Refusal> {
        if min == 0 {
            return Err(Refusal::BadBounds("--min-nodes must be at least 1".into()));
        }
        if min > max {
            return Err(Refusal::BadBounds(format!("--min-nodes {min} is above --max-nodes {max}")));
        }
        if let Some(p) = preferred.filter(|p| !(min..=max).contains(p)) {
            return Err(Refusal::BadBounds(format!("preferred {p} nodes is outside {min}..={max}")));
        }
        Ok(Self { min, max, preferred })
    }

    /// Whether `nodes` is an acceptable size.
    ///
    /// # Errors
    /// Zero, below the minimum or above the maximum.
    pub fn check(&self, nodes: u32) -> Result<(), Refusal> {
        match nodes {
            0 => Err(Refusal::Zero),
            n if n < self.min => Err(Refusal::BelowMin(n, self.min)),
            n if n > self.max => Err(Refusal::AboveMax(n, self.max)),
            _ => Ok(()),
        }
    }

    /// The fewest nodes a policy takes the job to: the preferred count if any, else
    /// the minimum.
    #[must_use]
    pub fn floor(&self) -> u32 {
        self.preferred.unwrap_or(self.min)
    }

    fn clamp(&self, n: i64) -> u32 {
        // Clamped into floor..=max, which fits in u32 (the floor is at most max).
        n.clamp(i64::from(self.floor()), i64::from(self.max)) as u32
    }
}

/// Decides resource changes for one job.
pub trait ResourceManager: Send {
    /// At checkpoint `checkpoint` (counted from 1) of a job on `nodes` nodes: the node
    /// count it should have, if it should change.
    fn decide(&mut self, checkpoint: u64, nodes: u32) -> Option<u32>;
    /// Nodes went back to the pool.
    fn released(&mut self, nodes: &[u32]) {
        let _ = nodes;
    }
}

/// A policy named on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicySpec {
    /// Never change (but grow a job started below the preferred count to it).
    Fixed,
    /// Go through these node counts.
    Steps(Vec<u32>),
    /// Up one node at a time to the maximum, then down to the floor (the preferred
    /// count, else the minimum).
    IncDec,
    /// Random changes from this seed.
    Random(u64),
}

impl FromStr for PolicySpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (name, arg) = s.split_once(':').map_or((s, None), |(n, a)| (n, Some(a)));
        match (name, arg) {
            ("fixed", None) => Ok(Self::Fixed),
            ("inc-dec", None) => Ok(Self::IncDec),
            ("random", None) => Ok(Self::Random(DEFAULT_SEED)),
            ("random", Some(seed)) => seed.parse().map(Self::Random).map_err(|_| format!("bad random seed {seed:?}")),
            ("steps", Some(list)) => {
                let steps: Vec<u32> = list
                    .split(',')
                    .map(|v| v.trim().parse::<u32>().ok().filter(|&n| n > 0))
                    .collect::<Option<_>>()
                    .ok_or_else(|| format!("steps:{list}: node counts must be positive integers"))?;
                Ok(Self::Steps(steps))
            }
            _ => Err(format!("unknown policy {s:?} (fixed, steps:A,B,..., inc-dec, random[:SEED])")),
        }
    }
}

/// Seed of `random` without one.
pub const DEFAULT_SEED: u64 = 0x5eed;

/// Builds the policy's state machine; `period` is at least 1.
#[must_use]
pub fn build(spec: &PolicySpec, period: u64, bounds: Bounds) -> Box<dyn ResourceManager> {
    let period = period.max(1);
    match spec {
        PolicySpec::Fixed => Box::new(Fixed { period, preferred: bounds.preferred }),
        PolicySpec::Steps(s) => Box::new(Steps { targets: s.clone(), period, bounds, next: 0 }),
        PolicySpec::IncDec => Box::new(IncDec { period, bounds, up: true }),
        PolicySpec::Random(seed) => Box::new(Random { period, bounds, rng: SplitMix64(*seed) }),
    }
}

/// Never changes the job, except to bring a job started below its preferred count up
/// to it, at the first change point.
struct Fixed {
    period: u64,
    /// The preferred count, until the first change point has passed.
    preferred: Option<u32>,
}

impl ResourceManager for Fixed {
    fn decide(&mut self, checkpoint: u64, nodes: u32) -> Option<u32> {
        change_point(checkpoint, self.period)?;
        self.preferred.take().filter(|&p| nodes < p)
    }
}

fn change_point(checkpoint: u64, period: u64) -> Option<u64> {
    (checkpoint > 0 && checkpoint.is_multiple_of(period)).then(|| checkpoint / period)
}

fn changed(target: u32, nodes: u32) -> Option<u32> {
    (target != nodes).then_some(target)
}

/// Goes through its list, one entry per change point it is asked at. Change points
/// that pass while a change is under way (a background growth) are not asked, so no
/// entry is skipped.
struct Steps {
    targets: Vec<u32>,
    period: u64,
    bounds: Bounds,
    next: usize,
}

impl ResourceManager for Steps {
    fn decide(&mut self, checkpoint: u64, nodes: u32) -> Option<u32> {
        change_point(checkpoint, self.period)?;
        let t = *self.targets.get(self.next)?;
        self.next += 1;
        changed(self.bounds.clamp(i64::from(t)), nodes)
    }
}

struct IncDec {
    period: u64,
    bounds: Bounds,
    up: bool,
}

impl ResourceManager for IncDec {
    fn decide(&mut self, checkpoint: u64, nodes: u32) -> Option<u32> {
        change_point(checkpoint, self.period)?;
        if self.up && nodes >= self.bounds.max {
            self.up = false;
        } else if !self.up && nodes <= self.bounds.floor() {
            self.up = true;
        }
        let step = if self.up { 1 } else { -1 };
        changed(self.bounds.clamp(i64::from(nodes) + step), nodes)
    }
}

struct Random {
    period: u64,
    bounds: Bounds,
    rng: SplitMix64,
}

impl ResourceManager for Random {
    fn decide(&mut self, checkpoint: u64, nodes: u32) -> Option<u32> {
        change_point(checkpoint, self.period)?;
        let sigma = (f64::from(self.bounds.max - self.bounds.floor()) / 4.0).max(1.0);
        let delta = (self.rng.normal() * sigma).round() as i64;
        changed(self.bounds.clamp(i64::from(nodes) + delta), nodes)
    }
}

/// SplitMix64: a tiny, well-known generator. Written here rather than taken from a
/// crate so that a seed gives the same schedule in every build (reproducible runs).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.unit(), self.unit());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bounds(min: u32, max: u32) -> Bounds {
        Bounds::new(min, max, None).unwrap()
    }

    fn run(policy: &mut dyn ResourceManager, mut nodes: u32, checkpoints: u64) -> Vec<u32> {
        let mut seen = Vec::new();
        for c in 1..=checkpoints {
            if let Some(t) = policy.decide(c, nodes) {
                nodes = t;
                seen.push(t);
            }
        }
        seen
    }

    #[test]
    fn parsing() {
        assert_eq!("fixed".parse(), Ok(PolicySpec::Fixed));
        assert_eq!("steps:2,8,4,1".parse(), Ok(PolicySpec::Steps(vec![2, 8, 4, 1])));
        assert_eq!("inc-dec".parse(), Ok(PolicySpec::IncDec));
        assert_eq!("random:7".parse(), Ok(PolicySpec::Random(7)));
        assert_eq!("random".parse(), Ok(PolicySpec::Random(DEFAULT_SEED)));
        assert!("steps:2,0".parse::<PolicySpec>().is_err());
        assert!("steps:".parse::<PolicySpec>().is_err());
        assert!("sometimes".parse::<PolicySpec>().is_err());
        assert!("random:x".parse::<PolicySpec>().is_err());
    }

    #[test]
    fn steps_follow_the_list_at_each_period() {
        let mut p = build(&PolicySpec::Steps(vec![2, 8, 4, 1]), 3, bounds(1, 16));
        assert_eq!(p.decide(1, 1), None);
        assert_eq!(p.decide(3, 1), Some(2));
        assert_eq!(run(&mut *build(&PolicySpec::Steps(vec![2, 8, 4, 1]), 2, bounds(1, 16)), 1, 20), vec![2, 8, 4, 1]);
        // Clamped to the bounds.
        assert_eq!(run(&mut *build(&PolicySpec::Steps(vec![2, 30]), 1, bounds(1, 16)), 1, 5), vec![2, 16]);
    }

    #[test]
    fn inc_dec_walks_up_and_down() {
        let mut p = build(&PolicySpec::IncDec, 1, bounds(1, 4));
        assert_eq!(run(&mut *p, 1, 8), vec![2, 3, 4, 3, 2, 1, 2, 3]);
        assert_eq!(run(&mut *build(&PolicySpec::Fixed, 1, bounds(1, 4)), 2, 10), Vec::<u32>::new());
    }

    #[test]
    fn a_preferred_count_is_every_policys_floor_and_a_smaller_job_grows_to_it() {
        let b = Bounds::new(1, 6, Some(3)).unwrap();
        assert_eq!(b.floor(), 3);
        assert_eq!(bounds(2, 6).floor(), 2);
        // fixed brings a smaller job up to it at the first change point, then stays,
        // even below it (after a request, or a growth that failed).
        assert_eq!(run(&mut *build(&PolicySpec::Fixed, 2, b), 1, 10), vec![3]);
        assert_eq!(run(&mut *build(&PolicySpec::Fixed, 1, b), 5, 10), Vec::<u32>::new());
        let mut fixed = build(&PolicySpec::Fixed, 1, b);
        assert_eq!(fixed.decide(1, 1), Some(3));
        assert_eq!(fixed.decide(2, 1), None, "a growth to it that failed is not tried again");
        // inc-dec walks between it and the maximum.
        assert_eq!(run(&mut *build(&PolicySpec::IncDec, 1, b), 1, 9), vec![3, 4, 5, 6, 5, 4, 3, 4, 5]);
        // steps are raised to it; once the list is done the job stays as it is.
        let mut steps = build(&PolicySpec::Steps(vec![5, 1]), 1, b);
        assert_eq!(run(&mut *steps, 1, 4), vec![5, 3]);
        assert_eq!(steps.decide(5, 2), None, "after a request took the job below it");
        // random never goes below it.
        let seen = run(&mut *build(&PolicySpec::Random(7), 1, b), 3, 60);
        assert!(seen.len() >= 10 && seen.iter().all(|&n| (3..=6).contains(&n)), "{seen:?}");
    }

    #[test]
    fn bounds_and_requests() {
        let b = Bounds::new(2, 8, Some(4)).unwrap();
        assert_eq!(b.check(0), Err(Refusal::Zero));
        assert_eq!(b.check(1), Err(Refusal::BelowMin(1, 2)));
        assert_eq!(b.check(9), Err(Refusal::AboveMax(9, 8)));
        assert_eq!(b.check(5), Ok(()));
        assert!(Bounds::new(0, 4, None).is_err());
        assert!(Bounds::new(5, 4, None).is_err());
        assert!(Bounds::new(1, 4, Some(6)).is_err());
    }

    #[test]
    fn random_changes_sizes() {
        let seen = run(&mut *build(&PolicySpec::Random(7), 1, bounds(1, 8)), 4, 40);
        assert!(seen.len() >= 10, "{seen:?}");
        assert!(seen.iter().any(|&n| n > 4) && seen.iter().any(|&n| n < 4), "{seen:?}");
    }

    proptest! {
        #[test]
        fn random_is_reproducible_and_bounded(seed: u64, min in 1u32..4, span in 0u32..12, period in 1u64..4) {
            let b = bounds(min, min + span);
            let a = run(&mut *build(&PolicySpec::Random(seed), period, b), min, 60);
            let again = run(&mut *build(&PolicySpec::Random(seed), period, b), min, 60);
            prop_assert_eq!(&a, &again);
            prop_assert!(a.iter().all(|&n| (b.min..=b.max).contains(&n)));
            let mut prev = min;
            for &n in &a {
                prop_assert_ne!(n, prev);
                prev = n;
            }
        }
    }
}
