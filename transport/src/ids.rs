//! Newtypes for the numbers the transport deals in.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A process's endpoint id in a job: its index in the job's address table and the
/// identity it authenticates with. Ids are handed out once per job and never reused, so
/// they stay stable across reconfigurations while group ranks (positions in a group)
/// change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Rank(pub u32);

impl Rank {
    /// The largest endpoint id a job may hand out.
    pub const MAX_ID: u32 = (1 << 24) - 1;

    /// The rank as an index into tables.
    #[must_use]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.0)
    }
}

/// A message tag. Tags with the top bit set are reserved for the runtime
/// (collectives, control); applications use `0..=Tag::MAX_USER`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Tag(pub u32);

impl Tag {
    /// The largest tag an application may use.
    pub const MAX_USER: u32 = 0x7fff_ffff;
    /// The first tag reserved for the runtime.
    pub const RESERVED_BASE: u32 = 0x8000_0000;

    /// Whether the tag belongs to the application's tag space.
    #[must_use]
    pub fn is_user(self) -> bool {
        self.0 <= Self::MAX_USER
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_user() {
            write!(f, "tag {}", self.0)
        } else {
            write!(f, "internal tag {:#x}", self.0)
        }
    }
}

/// A communication context: messages of different contexts (groups, epochs)
/// never match each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Context(pub u32);

impl fmt::Display for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "context {}", self.0)
    }
}

/// A job's identifier: random, shown in hex.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct JobId(pub u64);

impl JobId {
    /// A fresh random job id.
    ///
    /// # Errors
    /// When the operating system's random source fails.
    pub fn random() -> Result<Self, getrandom::Error> {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b)?;
        Ok(Self(u64::from_le_bytes(b)))
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl std::str::FromStr for JobId {
    type Err = std::num::ParseIntError;

    /// Parses the hexadecimal form [`fmt::Display`] prints.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        u64::from_str_radix(s, 16).map(Self)
    }
}

/// A node of the job (a simulated local node or a host).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {}", self.0)
    }
}

/// The job's shared secret: 256 random bits. Its `Debug` never shows the bytes.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobKey([u8; 32]);

impl JobKey {
    /// A fresh random key.
    ///
    /// # Errors
    /// When the operating system's random source fails.
    pub fn random() -> Result<Self, getrandom::Error> {
        let mut b = [0u8; 32];
        getrandom::fill(&mut b)?;
        Ok(Self(b))
    }

    /// A key from known bytes (tests, or a key received through the bootstrap).
    #[must_use]
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The key's bytes.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for JobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobKey(..)")
    }
}
