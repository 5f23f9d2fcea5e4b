//! Pure planning of reconfigurations: what a request for a size comes to
//! ([`resize`]), expansion by tree-parallel spawning ([`spawn`], carried out as the tree
//! of [`tree`]) and shrinking by whole node worlds ([`shrink`]). No I/O here: the
//! controller and agents carry these plans out.

pub mod resize;
pub mod shrink;
pub mod spawn;
pub mod tree;
