//! Registered application data: what every reconfiguration moves automatically.
//!
//! An application registers **distributed** data (a global array of plain-old-data
//! elements, of which each rank holds its block under the block rule of
//! `ductile-redistrib`) and **replicated** state (a serde value every rank holds, such as
//! the iteration counter). At a change, the old rank 0 hands the registry's manifest and
//! the replicated values to every process of the transition group, and every
//! distributed item is moved from the old blocks to the new ones; a process that joined
//! finds the items under their names.
//!
//! Blocks are stored 8-byte aligned, so element types of alignment up to 8 (all the
//! integer and float types and structs of them) can be viewed in place.

use crate::error::{Error, Result};
use crate::group::AsyncGroup;
use crate::redistribute::{Method, Move};
use bytemuck::Pod;
use bytes::Bytes;
use ductile_redistrib::block_range;
use ductile_transport::Tag;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Largest element alignment a distributed item may have.
pub const MAX_ALIGN: usize = 8;

/// Runtime tags of redistribution messages (one per item index, low 24 bits).
const REGISTRY_TAG: u32 = Tag::RESERVED_BASE | (0x20 << 24);
/// Runtime tags of the one-sided executor's "done reading" notices.
const REGISTRY_DONE_TAG: u32 = Tag::RESERVED_BASE | (0x21 << 24);

/// Bytes with 8-byte alignment.
#[derive(Clone, Debug, Default)]
struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl AsRef<[u8]> for Aligned {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

impl Aligned {
    fn zeroed(len: usize) -> Self {
        Self { words: vec![0u64; len.div_ceil(8)], len }
    }

    fn from_bytes(b: &[u8]) -> Self {
        let mut words = vec![0u64; b.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..b.len()].copy_from_slice(b);
        Self { words, len: b.len() }
    }

    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..self.len]
    }
}

/// What the manifest says of one item.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Kind {
    Distributed { global: u64, elem: u32, type_name: String, method: Option<Method> },
    Replicated { value: Vec<u8> },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    name: String,
    kind: Kind,
}

/// The registry's description, sent from the old rank 0 to the transition group.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Manifest(Vec<Entry>);

/// The items a process holds.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    entries: Vec<Entry>,
    /// Blocks of the distributed entries, by entry index (empty for replicated ones).
    blocks: Vec<Aligned>,
}

/// Where a process stands in a change: its old and new part numbers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Parts {
    /// Parts before.
    pub old_n: u32,
    /// Parts after.
    pub new_n: u32,
}

impl Registry {
    fn find(&self, name: &str) -> Result<usize> {
        self.entries
            .iter()
            .position(|e| e.name == name)
            .ok_or_else(|| Error::Invalid(format!("no registered item named {name:?}")))
    }

    fn absent(&self, name: &str) -> Result<()> {
        if self.entries.iter().any(|e| e.name == name) {
            return Err(Error::Invalid(format!("an item named {name:?} is already registered")));
        }
        Ok(())
    }

    pub(crate) fn distribute<T: Pod>(
        &mut self,
        name: &str,
        global: u64,
        part: (u32, u32),
        block: &[T],
        method: Option<Method>,
    ) -> Result<()> {
        self.absent(name)?;
        let (elem, align) = (std::mem::size_of::<T>(), std::mem::align_of::<T>());
        if elem == 0 || align > MAX_ALIGN {
            return Err(Error::Invalid(format!(
                "{name:?}: element type {} (size {elem}, alignment {align}) cannot be distributed",
                std::any::type_name::<T>()
            )));
        }
        let want = block_range(global, part.1, part.0);
        if block.len() as u64 != want.end - want.start {
            return Err(Error::Invalid(format!(
                "{name:?}: rank {} of {} holds elements {}..{} of {global} ({} elements), but the block given has {}",
                part.0,
                part.1,
                want.start,
                want.end,
                want.end - want.start,
                block.len()
            )));
        }
        self.entries.push(Entry {
            name: name.to_owned(),
            kind: Kind::Distributed {
                global,
                elem: u32::try_from(elem).map_err(|_| Error::Invalid("element too large".into()))?,
                type_name: std::any::type_name::<T>().to_owned(),
                method,
            },
        });
        self.blocks.push(Aligned::from_bytes(bytemuck::cast_slice(block)));
        Ok(())
    }

    pub(crate) fn replicate<S: Serialize>(&mut self, name: &str, value: &S) -> Result<()> {
        let value = postcard::to_stdvec(value).map_err(Error::Encode)?;
        match self.entries.iter_mut().find(|e| e.name == name) {
            Some(Entry { kind: Kind::Replicated { value: v }, .. }) => *v = value,
            Some(_) => return Err(Error::Invalid(format!("{name:?} is a distributed item, not replicated state"))),
            None => {
                self.entries.push(Entry { name: name.to_owned(), kind: Kind::Replicated { value } });
                self.blocks.push(Aligned::default());
            }
        }
        Ok(())
    }

    pub(crate) fn replicated<S: DeserializeOwned>(&self, name: &str) -> Result<S> {
        match &self.entries[self.find(name)?].kind {
            Kind::Replicated { value } => {
                postcard::from_bytes(value).map_err(|e| Error::Invalid(format!("{name:?} does not decode: {e}")))
            }
            Kind::Distributed { .. } => Err(Error::Invalid(format!("{name:?} is distributed, not replicated state"))),
        }
    }

    fn typed<T: Pod>(&self, name: &str) -> Result<usize> {
        let i = self.find(name)?;
        match &self.entries[i].kind {
            Kind::Distributed { type_name, .. } if type_name == std::any::type_name::<T>() => Ok(i),
            Kind::Distributed { type_name, .. } => {
                Err(Error::Invalid(format!("{name:?} holds {type_name}, not {}", std::any::type_name::<T>())))
            }
            Kind::Replicated { .. } => Err(Error::Invalid(format!("{name:?} is replicated state, not distributed"))),
        }
    }

    pub(crate) fn block<T: Pod>(&self, name: &str) -> Result<&[T]> {
        let i = self.typed::<T>(name)?;
        Ok(bytemuck::cast_slice(self.blocks[i].bytes()))
    }

    pub(crate) fn block_mut<T: Pod>(&mut self, name: &str) -> Result<&mut [T]> {
        let i = self.typed::<T>(name)?;
        Ok(bytemuck::cast_slice_mut(self.blocks[i].bytes_mut()))
    }

    pub(crate) fn global_len(&self, name: &str) -> Result<u64> {
        match &self.entries[self.find(name)?].kind {
            Kind::Distributed { global, .. } => Ok(*global),
            Kind::Replicated { .. } => Err(Error::Invalid(format!("{name:?} is replicated state, not distributed"))),
        }
    }

    pub(crate) fn unregister(&mut self, name: &str) -> Result<()> {
        let i = self.find(name)?;
        self.entries.remove(i);
        self.blocks.remove(i);
        Ok(())
    }

    pub(crate) fn manifest(&self) -> Manifest {
        Manifest(self.entries.clone())
    }

    /// Takes the old rank 0's manifest: a process that joined adopts it; one that was
    /// there checks that it registered the same items and takes the replicated values.
    pub(crate) fn adopt(&mut self, m: Manifest, joined: bool) -> Result<()> {
        if joined {
            self.blocks = vec![Aligned::default(); m.0.len()];
            self.entries = m.0;
            return Ok(());
        }
        let shape = |e: &Entry| match &e.kind {
            Kind::Distributed { global, elem, type_name, method } => {
                let by = method.map_or_else(|| "the job's method".to_string(), |m| m.to_string());
                format!("{}: {global} x {type_name} ({elem} B, moved by {by})", e.name)
            }
            Kind::Replicated { .. } => format!("{}: replicated", e.name),
        };
        let mine: Vec<String> = self.entries.iter().map(shape).collect();
        let root: Vec<String> = m.0.iter().map(shape).collect();
        if mine != root {
            return Err(Error::Reconfigure(format!(
                "registered items differ from rank 0's: here [{}], rank 0 [{}]",
                mine.join(", "),
                root.join(", ")
            )));
        }
        self.entries = m.0;
        Ok(())
    }

    /// Moves every distributed item from the old blocks to the new ones over the
    /// transition group `t`, whose members `0..old_n` are the old ranks in order;
    /// `new_pos[k]` is the new rank of transition member `k`, if it stays. Each item
    /// travels by its own method if it was registered with one, else by `method`.
    ///
    /// # Collective
    /// Over the transition group.
    pub(crate) async fn redistribute(
        &mut self,
        t: &AsyncGroup,
        parts: Parts,
        new_pos: &[Option<u32>],
        method: Method,
    ) -> Result<()> {
        let me = t.rank();
        let my_new = new_pos.get(me).copied().flatten();
        // Transition member of each new rank.
        let mut member_of_new = vec![0usize; parts.new_n as usize];
        for (k, p) in new_pos.iter().enumerate() {
            if let Some(slot) = p.and_then(|p| member_of_new.get_mut(p as usize)) {
                *slot = k;
            }
        }
        for i in 0..self.entries.len() {
            let (global, elem, own_method) = match &self.entries[i].kind {
                Kind::Distributed { global, elem, method, .. } => (*global, u64::from(*elem), *method),
                Kind::Replicated { .. } => continue,
            };
            let index = i as u32 & 0x00ff_ffff;
            let mv = Move {
                t,
                global,
                elem,
                old_n: parts.old_n,
                new_n: parts.new_n,
                member_of_new: &member_of_new,
                my_new,
                tag: Tag(REGISTRY_TAG | index),
                done_tag: Tag(REGISTRY_DONE_TAG | index),
            };
            // The old block is handed to the transport as it is, without a copy.
            let old = Bytes::from_owner(std::mem::take(&mut self.blocks[i]));
            let mut block = my_new.map(|n| {
                let r = block_range(global, parts.new_n, n);
                Aligned::zeroed(usize::try_from((r.end - r.start) * elem).unwrap_or(usize::MAX))
            });
            mv.run(own_method.unwrap_or(method), old, block.as_mut().map(Aligned::bytes_mut)).await?;
            self.blocks[i] = block.unwrap_or_default();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registering_checks_blocks_types_and_names() {
        let mut r = Registry::default();
        r.distribute::<f64>("u", 10, (1, 3), &[1.0, 2.0, 3.0], None).unwrap();
        assert!(r.distribute::<f64>("v", 10, (1, 3), &[1.0], None).is_err());
        assert!(r.distribute::<f64>("u", 10, (1, 3), &[1.0, 2.0, 3.0], None).is_err());
        assert_eq!(r.block::<f64>("u").unwrap(), &[1.0, 2.0, 3.0]);
        assert!(r.block::<u32>("u").is_err());
        r.block_mut::<f64>("u").unwrap()[0] = 7.0;
        assert_eq!(r.block::<f64>("u").unwrap()[0], 7.0);
        r.replicate("it", &5u64).unwrap();
        r.replicate("it", &6u64).unwrap();
        assert_eq!(r.replicated::<u64>("it").unwrap(), 6);
        assert!(r.replicate("u", &1u8).is_err());
        assert!(r.block::<f64>("it").is_err());
        assert_eq!(r.global_len("u").unwrap(), 10);
        r.unregister("u").unwrap();
        assert!(r.block::<f64>("u").is_err());
    }

    #[test]
    fn adopt_refuses_a_different_registry() {
        let mut root = Registry::default();
        root.distribute::<f64>("u", 4, (0, 1), &[0.0; 4], None).unwrap();
        root.replicate("it", &3u32).unwrap();
        let mut other = Registry::default();
        other.distribute::<f32>("u", 4, (0, 1), &[0.0; 4], None).unwrap();
        other.replicate("it", &0u32).unwrap();
        assert!(matches!(other.adopt(root.manifest(), false), Err(Error::Reconfigure(_))));
        let mut same = Registry::default();
        same.distribute::<f64>("u", 4, (0, 1), &[1.0; 4], None).unwrap();
        same.replicate("it", &0u32).unwrap();
        same.adopt(root.manifest(), false).unwrap();
        assert_eq!(same.replicated::<u32>("it").unwrap(), 3);
        assert_eq!(same.block::<f64>("u").unwrap(), &[1.0; 4]);
        let mut joined = Registry::default();
        joined.adopt(root.manifest(), true).unwrap();
        assert_eq!(joined.replicated::<u32>("it").unwrap(), 3);
    }
}
