//! Process sets (paper 001): named, immutable sets of ranks.
//!
//! The runtime names `world` (every current rank), `self`, `node/<id>`, and the sets
//! of each resource change (`rc/<n>/added`, `rc/<n>/removed`). Sets combine by union,
//! intersection and difference into new, unnamed-by-the-runtime sets. A set belongs to
//! one membership epoch: after a reconfiguration, sets of the old epoch are no longer
//! valid for building groups.

use std::collections::BTreeSet;
use std::fmt;

/// A named, immutable set of ranks of one membership epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessSet {
    name: String,
    epoch: u64,
    ranks: BTreeSet<u32>,
}

/// Why two sets cannot be combined.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum PsetError {
    /// The sets belong to different epochs.
    #[error("process sets {0} and {1} belong to different membership epochs")]
    EpochMismatch(String, String),
}

impl ProcessSet {
    /// A set of `ranks` named `name` in epoch `epoch`.
    #[must_use]
    pub fn new(name: impl Into<String>, epoch: u64, ranks: impl IntoIterator<Item = u32>) -> Self {
        Self { name: name.into(), epoch, ranks: ranks.into_iter().collect() }
    }

    /// `world`: ranks `0..size`.
    #[must_use]
    pub fn world(epoch: u64, size: u32) -> Self {
        Self::new("world", epoch, 0..size)
    }

    /// `self`: only `rank`.
    #[must_use]
    pub fn own(epoch: u64, rank: u32) -> Self {
        Self::new("self", epoch, [rank])
    }

    /// `node/<id>`: the ranks on node `id`.
    #[must_use]
    pub fn node(epoch: u64, id: u32, ranks: impl IntoIterator<Item = u32>) -> Self {
        Self::new(format!("node/{id}"), epoch, ranks)
    }

    /// The set's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The membership epoch it belongs to.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Its ranks in increasing order.
    pub fn ranks(&self) -> impl Iterator<Item = u32> + '_ {
        self.ranks.iter().copied()
    }

    /// Number of ranks.
    #[must_use]
    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    /// Whether it has no ranks.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }

    /// Whether `rank` is in it.
    #[must_use]
    pub fn contains(&self, rank: u32) -> bool {
        self.ranks.contains(&rank)
    }

    fn combine(&self, other: &Self, op: &str, ranks: BTreeSet<u32>) -> Result<Self, PsetError> {
        if self.epoch != other.epoch {
            return Err(PsetError::EpochMismatch(self.name.clone(), other.name.clone()));
        }
        Ok(Self { name: format!("({}{op}{})", self.name, other.name), epoch: self.epoch, ranks })
    }

    /// Ranks in either set.
    ///
    /// # Errors
    /// The sets are of different epochs.
    pub fn union(&self, other: &Self) -> Result<Self, PsetError> {
        self.combine(other, "|", self.ranks.union(&other.ranks).copied().collect())
    }

    /// Ranks in both sets.
    ///
    /// # Errors
    /// The sets are of different epochs.
    pub fn intersection(&self, other: &Self) -> Result<Self, PsetError> {
        self.combine(other, "&", self.ranks.intersection(&other.ranks).copied().collect())
    }

    /// Ranks in this set but not in `other`.
    ///
    /// # Errors
    /// The sets are of different epochs.
    pub fn difference(&self, other: &Self) -> Result<Self, PsetError> {
        self.combine(other, "-", self.ranks.difference(&other.ranks).copied().collect())
    }
}

impl fmt::Display for ProcessSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (epoch {}, {} ranks)", self.name, self.epoch, self.ranks.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn named_sets_and_operations() {
        let w = ProcessSet::world(0, 8);
        let n1 = ProcessSet::node(0, 1, 4..8);
        let me = ProcessSet::own(0, 5);
        assert_eq!(w.difference(&n1).unwrap().ranks().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert_eq!(n1.intersection(&me).unwrap().ranks().collect::<Vec<_>>(), vec![5]);
        let u = me.union(&ProcessSet::own(0, 1)).unwrap();
        assert_eq!(u.name(), "(self|self)");
        assert!(u.contains(1) && u.contains(5) && u.len() == 2);
        assert_eq!(n1.to_string(), "node/1 (epoch 0, 4 ranks)");
        let later = ProcessSet::world(1, 4);
        assert!(matches!(w.union(&later), Err(PsetError::EpochMismatch(..))));
    }

    proptest! {
        #[test]
        fn set_algebra_matches_brute_force(a in proptest::collection::btree_set(0u32..32, 0..20), b in proptest::collection::btree_set(0u32..32, 0..20)) {
            let (sa, sb) = (ProcessSet::new("a", 3, a.clone()), ProcessSet::new("b", 3, b.clone()));
            let u: BTreeSet<u32> = sa.union(&sb).unwrap().ranks().collect();
            let i: BTreeSet<u32> = sa.intersection(&sb).unwrap().ranks().collect();
            let d: BTreeSet<u32> = sa.difference(&sb).unwrap().ranks().collect();
            for x in 0..32 {
                prop_assert_eq!(u.contains(&x), a.contains(&x) || b.contains(&x));
                prop_assert_eq!(i.contains(&x), a.contains(&x) && b.contains(&x));
                prop_assert_eq!(d.contains(&x), a.contains(&x) && !b.contains(&x));
            }
        }
    }
}
