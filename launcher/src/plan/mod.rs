//! Pure planning of reconfigurations: expansion by tree-parallel spawning
//! ([`spawn`]) and shrinking by whole node worlds ([`shrink`]). No I/O here: the
//! controller and agents carry these plans out.

pub mod shrink;
pub mod spawn;
