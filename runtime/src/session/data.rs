//! The registry's side of a [`Session`]: registering data, reading its blocks, and how
//! it moved.

use super::Session;
use crate::block::Place;
use crate::error::Result;
use crate::redistribute::Method;
use crate::registry::How;
use bytemuck::Pod;
use serde::de::DeserializeOwned;
use serde::Serialize;

impl Session {
    /// Registers distributed data: a global array of `global_len` elements of which
    /// this rank holds `block`, its part under the block rule. Every change moves it.
    ///
    /// # Local
    /// Every rank registers the same items in the same order (checked at the next
    /// change).
    ///
    /// # Errors
    /// The name is taken, the block is not this rank's size, the element type's
    /// alignment is above 64 (a cache line), or this process was released at a
    /// checkpoint (it holds no part).
    pub fn distribute<T: Pod>(&mut self, name: &str, global_len: u64, block: &[T]) -> Result<()> {
        self.register(name, global_len, block, None, false)
    }

    /// Registers distributed data that always moves by `method`, whatever the job's
    /// `--redistribution`; otherwise as [`Session::distribute`].
    ///
    /// # Local
    /// Every rank registers the same items, with the same methods, in the same order.
    ///
    /// # Errors
    /// As [`Session::distribute`].
    pub fn distribute_by<T: Pod>(&mut self, name: &str, global_len: u64, block: &[T], method: Method) -> Result<()> {
        self.register(name, global_len, block, Some(method), false)
    }

    /// Registers distributed data that the application does not change (a matrix,
    /// coefficients, a mesh): as [`Session::distribute`], and with `ductile run
    /// --background` it moves while the application computes on at background
    /// checkpoints. Writing its block while it moves is an error.
    ///
    /// # Local
    /// As [`Session::distribute`].
    ///
    /// # Errors
    /// As [`Session::distribute`].
    pub fn distribute_constant<T: Pod>(&mut self, name: &str, global_len: u64, block: &[T]) -> Result<()> {
        self.register(name, global_len, block, None, true)
    }

    /// [`Session::distribute_constant`] with its own method.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`Session::distribute`].
    pub fn distribute_constant_by<T: Pod>(
        &mut self,
        name: &str,
        global_len: u64,
        block: &[T],
        method: Method,
    ) -> Result<()> {
        self.register(name, global_len, block, Some(method), true)
    }

    /// Registers distributed data moved by `method` (the job's if `None`), constant or
    /// not: this rank's part of the current world.
    fn register<T: Pod>(
        &mut self,
        name: &str,
        global_len: u64,
        block: &[T],
        method: Option<Method>,
        constant: bool,
    ) -> Result<()> {
        self.not_released()?;
        let part = (self.world.rank() as u32, self.world.size() as u32);
        let how = How { method, constant, place: self.place_of(method) };
        self.registry.distribute(name, global_len, part, block, how)
    }

    /// Where the blocks of an item moved by `method` (the job's if `None`) live: where
    /// one-sided moves can hand their pages over (see [`crate::pages`]), or where moves
    /// can recycle them (see [`crate::anon`]), else on the heap.
    fn place_of(&self, method: Option<Method>) -> Place {
        let caps = self.endpoint.transport().capabilities();
        let rma = method.unwrap_or(self.method) == Method::Rma;
        if rma && caps.shares_memory && crate::pages::handover() {
            Place::Files
        } else if crate::anon::recycling(&caps) {
            Place::Pages
        } else {
            Place::Heap
        }
    }

    /// Whether constant items are moving in the background (the change completes at a
    /// later checkpoint).
    ///
    /// # Local
    #[must_use]
    pub fn moving(&self) -> bool {
        self.moving.is_some()
    }

    /// How registered data moves at a change unless an item says otherwise (the job's
    /// `--redistribution`).
    ///
    /// # Local
    #[must_use]
    pub fn redistribution(&self) -> Method {
        self.method
    }

    /// How a distributed item's data moved at its last change: by the method it was
    /// registered with, else the job's; `None` before its first change (or, for a
    /// process that joined, before the one that brought it its block). A constant
    /// item moving in the background counts once its change completes.
    ///
    /// # Local
    ///
    /// # Errors
    /// No such item, or it is replicated state.
    pub fn moved_by(&self, name: &str) -> Result<Option<Method>> {
        self.registry.moved_by(name)
    }

    /// This rank's block of a distributed item.
    ///
    /// # Local
    ///
    /// # Errors
    /// No such item, it holds another type, this process was released at a checkpoint
    /// (it holds no block), or a checkpoint failed (its block may be half-way through a
    /// change).
    pub fn block<T: Pod>(&self, name: &str) -> Result<&[T]> {
        self.in_group()?;
        self.registry.block(name)
    }

    /// This rank's block of a distributed item, writable.
    ///
    /// # Local
    ///
    /// # Errors
    /// As [`Session::block`].
    pub fn block_mut<T: Pod>(&mut self, name: &str) -> Result<&mut [T]> {
        self.in_group()?;
        self.registry.block_mut(name)
    }

    /// The global range of elements this rank holds of a distributed item.
    ///
    /// # Local
    ///
    /// # Errors
    /// No such item, or this process was released at a checkpoint (it holds none).
    pub fn block_range(&self, name: &str) -> Result<std::ops::Range<u64>> {
        self.in_group()?;
        let n = self.registry.global_len(name)?;
        Ok(ductile_redistrib::block_range(n, self.world.size() as u32, self.world.rank() as u32))
    }

    /// Registers or updates replicated state (the same on every rank, e.g. the iteration
    /// counter); a process that joins receives rank 0's value.
    ///
    /// # Local
    ///
    /// # Errors
    /// The value does not encode, the name is a distributed item, or this process was
    /// released at a checkpoint (no process would receive it).
    pub fn replicate<S: Serialize>(&mut self, name: &str, value: &S) -> Result<()> {
        self.not_released()?;
        self.registry.replicate(name, value)
    }

    /// Replicated state by name.
    ///
    /// # Local
    ///
    /// # Errors
    /// No such item, or it does not decode as `S`.
    pub fn replicated<S: DeserializeOwned>(&self, name: &str) -> Result<S> {
        self.registry.replicated(name)
    }

    /// Removes a registered item.
    ///
    /// # Local
    ///
    /// # Errors
    /// No such item.
    pub fn unregister(&mut self, name: &str) -> Result<()> {
        self.registry.unregister(name)
    }
}
