//! Memory the provider may touch, each kind owned together with its registration so
//! that the memory outlives it: the registration is a field declared (so dropped)
//! before the memory. `Vec` and `Bytes` contents do not move when their owner does, nor
//! do the bytes of a landing's part (see [`crate::landing`]).
//!
//! - [`LocalBuf`]: a send or receive buffer, registered if the provider needs local
//!   registration (`FI_MR_LOCAL`).
//! - [`ReadDest`]: the destination of RMA reads, shared (`Arc`) by the reads in flight
//!   into it; its bytes are taken out only once no read holds it.
//! - [`Remote`]: bytes registered for peers to read, with what a peer needs to address
//!   them.

use super::{check, close, Attrs, Domain, Ep, OfiError};
use crate::fabric::sys;
use crate::landing::Part;
use crate::matching::Claim;
use bytes::Bytes;
use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// Below this, a copy's destination is not populated first (see [`populate`]).
const POPULATE_MIN: usize = 256 << 10;

/// Fills `local` with as many bytes at `addr` in the memory of process `pid` (same pid
/// namespace), with `process_vm_readv`: the kernel copies from the owner's pages to
/// ours without either process's help.
///
/// # Errors
/// The system call's: `EPERM` where the kernel or its policy forbids such reads,
/// `ESRCH` if the process is gone, `EFAULT` for a range outside its memory.
pub(in crate::fabric) fn copy_from_process(local: &mut [u8], pid: u32, addr: u64) -> std::io::Result<()> {
    // SAFETY: the slice is memory of this process that only this call writes.
    unsafe { read_process(local.as_mut_ptr(), local.len(), pid, addr) }
}

/// As [`copy_from_process`], into the `len` bytes at `local`, which it populates first
/// (see [`populate`]).
///
/// # Safety
/// `local..local + len` is memory of this process that nothing else reads or writes
/// during the call.
unsafe fn read_process(local: *mut u8, len: usize, pid: u32, addr: u64) -> std::io::Result<()> {
    let fault = || std::io::Error::from_raw_os_error(libc::EFAULT);
    // SAFETY: forwarded from the caller.
    unsafe { populate(local, len) };
    let pid = libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    let mut done = 0usize;
    while done < len {
        let n = len - done;
        let from = addr.checked_add(done as u64).and_then(|a| usize::try_from(a).ok()).ok_or_else(fault)?;
        let here = libc::iovec { iov_base: local.wrapping_add(done).cast(), iov_len: n };
        let remote = libc::iovec { iov_base: from as *mut c_void, iov_len: n };
        // SAFETY: `here` is the caller's memory, written by nothing else meanwhile; the
        // kernel checks `remote` against the other process's mappings.
        let got = unsafe { libc::process_vm_readv(pid, &here, 1, &remote, 1, 0) };
        match usize::try_from(got) {
            Ok(0) => return Err(fault()),
            Ok(k) => done += k,
            Err(_) => return Err(std::io::Error::last_os_error()),
        }
    }
    Ok(())
}

/// Faults in the whole pages of the `len` bytes at `at` (at least [`POPULATE_MIN`] of
/// them) in one call (`MADV_POPULATE_WRITE`, Linux 5.14; where it is refused the copy
/// takes the faults), if they are fresh: a copy into fresh memory then takes no fault
/// per page, and the threads making copies populate in parallel. (Redistribution over
/// shm, 4→1 by gets, GB/s, medians of 3: populated by the application before each get
/// 2.46, by the copies 3.37.) Memory whose first page is already there is taken as warm
/// and left alone: populating present pages still walks them, and made 4 MiB gets into
/// reused buffers 60 % slower (433 against 268 µs, medians of 5).
///
/// # Safety
/// The bytes are memory of this process that only the caller writes meanwhile.
unsafe fn populate(at: *mut u8, len: usize) {
    if len < POPULATE_MIN {
        return;
    }
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
    let at = at as usize;
    let (start, end) = (at.next_multiple_of(page), (at + len) / page * page);
    if end <= start {
        return;
    }
    let mut resident = 0u8;
    // SAFETY: one whole page inside the caller's memory, mapped memory of this process;
    // `resident` receives the one byte mincore writes for it.
    let rc = unsafe { libc::mincore(start as *mut c_void, page, &mut resident) };
    if rc == 0 && resident & 1 == 0 {
        // SAFETY: [start, end) lies inside the caller's memory, which only the caller
        // writes; populating leaves its bytes unchanged.
        let _ = unsafe { libc::madvise(start as *mut c_void, end - start, libc::MADV_POPULATE_WRITE) };
    }
}

/// A registered memory region (it does not own the memory; its holder does).
struct Mr {
    ptr: *mut sys::fid_mr,
    _domain: Arc<Domain>,
    /// The endpoint an `FI_MR_ENDPOINT` region is bound to.
    _ep: Option<Arc<Ep>>,
}

// SAFETY: opened on an FI_THREAD_SAFE domain; the pointer is only closed in Drop.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: valid fid, closed once (before the endpoint it may be bound to).
        close(unsafe { &raw mut (*self.ptr).fid }, "memory region");
    }
}

/// What a peer needs to read a region: the address of its first byte as the provider
/// wants it (the virtual address under `FI_MR_VIRT_ADDR`, else 0), the key (raw bytes
/// under `FI_MR_RAW`, else the 64-bit key little endian), the raw base address
/// (`FI_MR_RAW` only), and the process holding it if a reader on the same node may copy
/// it directly (see [`Owner`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::fabric) struct RemoteKey {
    pub(in crate::fabric) addr: u64,
    pub(in crate::fabric) key: Vec<u8>,
    pub(in crate::fabric) raw_base: u64,
    pub(in crate::fabric) owner: Owner,
}

/// The process whose memory a region is, for readers that copy it with
/// `process_vm_readv` (see `fabric::direct`): its pid, and the inode of its pid
/// namespace, without which a pid names no process for certain. All zero: not offered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(in crate::fabric) struct Owner {
    pub(in crate::fabric) pid: u32,
    pub(in crate::fabric) ns: u64,
}

impl Owner {
    /// This process, if its pid namespace can be named.
    pub(in crate::fabric) fn this_process() -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let ns = std::fs::metadata("/proc/self/ns/pid").ok()?.ino();
        Some(Self { pid: std::process::id(), ns })
    }

    /// Whether a region of `self` is offered for direct copies.
    pub(in crate::fabric) fn offered(&self) -> bool {
        self.pid != 0 && self.ns != 0
    }
}

/// Registers memory as the provider's `mr_mode` asks, with unique requested keys.
pub(in crate::fabric) struct Registrar {
    domain: Arc<Domain>,
    /// Regions are bound to this endpoint (`FI_MR_ENDPOINT`).
    ep: Option<Arc<Ep>>,
    local: bool,
    virt: bool,
    raw: bool,
    key_size: usize,
    next_key: AtomicU64,
    /// Set in the regions registered for peers (all zero: no direct copies).
    owner: Owner,
}

impl Registrar {
    /// A registrar for `ep`'s domain and mode bits, naming `owner` in its regions.
    pub(in crate::fabric) fn new(domain: &Arc<Domain>, ep: &Arc<Ep>, attrs: &Attrs, owner: Owner) -> Self {
        Self {
            domain: domain.clone(),
            ep: attrs.mr(sys::FI_MR_ENDPOINT).then(|| ep.clone()),
            local: attrs.mr(sys::FI_MR_LOCAL),
            virt: attrs.mr(sys::FI_MR_VIRT_ADDR),
            raw: attrs.mr(sys::FI_MR_RAW),
            key_size: attrs.mr_key_size,
            next_key: AtomicU64::new(1),
            owner,
        }
    }

    /// Registers `len` bytes at `buf`.
    ///
    /// # Safety
    /// The memory stays valid until the `Mr` is dropped.
    unsafe fn register(&self, buf: *const u8, len: usize, access: u32) -> Result<Mr, OfiError> {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let mut mr = ptr::null_mut();
        let (d, access) = (self.domain.ptr, u64::from(access));
        // SAFETY: the caller keeps the memory valid; mr receives the new object.
        check("fi_mr_reg", unsafe { sys::fi_mr_reg(d, buf.cast(), len, access, 0, key, 0, &mut mr, ptr::null_mut()) })?;
        let mut this = Mr { ptr: mr, _domain: self.domain.clone(), _ep: None };
        if let Some(ep) = &self.ep {
            // SAFETY: valid MR and endpoint fids; the Mr keeps the endpoint alive.
            unsafe {
                check("fi_mr_bind", sys::fi_mr_bind(mr, &raw mut (*ep.0).fid, 0))?;
                check("fi_mr_enable", sys::fi_mr_enable(mr))?;
            }
            this._ep = Some(ep.clone());
        }
        Ok(this)
    }

    /// A send or receive buffer (`access` `FI_SEND` or `FI_RECV`), registered only if
    /// the provider needs local registration.
    pub(in crate::fabric) fn local(&self, mem: Vec<u8>, access: u32) -> Result<LocalBuf, OfiError> {
        let mr = if self.local && !mem.is_empty() {
            // SAFETY: the LocalBuf owns `mem` and drops the Mr first; a Vec's contents do
            // not move when the Vec does.
            Some(unsafe { self.register(mem.as_ptr(), mem.len(), access) }?)
        } else {
            None
        };
        Ok(LocalBuf { mr, mem })
    }

    /// A destination for reads: `mem`, registered if the provider needs it.
    pub(in crate::fabric) fn read_dest(&self, mut mem: ReadMem) -> Result<Arc<ReadDest>, OfiError> {
        let (base, len) = (mem.base(), mem.len());
        let mr = if self.local && len > 0 {
            // SAFETY: the ReadDest owns `mem` (whose bytes never move: a Vec's heap
            // memory, or a part of a landing) and drops the Mr first (see `take`).
            Some(unsafe { self.register(base, len, sys::FI_READ) }?)
        } else {
            None
        };
        Ok(Arc::new(ReadDest { mr: Mutex::new(mr), base, len, mem: UnsafeCell::new(mem) }))
    }

    /// Registers `bytes` for peers to read (an empty region is not registered).
    pub(in crate::fabric) fn remote(&self, bytes: Bytes) -> Result<Remote, OfiError> {
        if bytes.is_empty() {
            let key = RemoteKey { addr: 0, key: Vec::new(), raw_base: 0, owner: Owner::default() };
            return Ok(Remote { _mr: None, key, bytes });
        }
        // SAFETY: the Remote owns `bytes` (which never move) and drops the Mr first.
        let mr = unsafe { self.register(bytes.as_ptr(), bytes.len(), sys::FI_REMOTE_READ) }?;
        let addr = if self.virt { bytes.as_ptr() as u64 } else { 0 };
        let key = if self.raw {
            let mut key = vec![0u8; self.key_size.max(8)];
            let (mut size, mut base) = (key.len(), 0);
            // SAFETY: key has `size` writable bytes; base and size receive the results.
            let ret = unsafe { sys::fi_mr_raw_attr(mr.ptr, &mut base, key.as_mut_ptr(), &mut size, 0) };
            check("fi_mr_raw_attr", ret)?;
            key.truncate(size);
            RemoteKey { addr, key, raw_base: base, owner: self.owner }
        } else {
            // SAFETY: valid MR.
            let key = unsafe { sys::fi_mr_key(mr.ptr) };
            RemoteKey { addr, key: key.to_le_bytes().to_vec(), raw_base: 0, owner: self.owner }
        };
        Ok(Remote { _mr: Some(mr), key, bytes })
    }

    /// The key to use in reads of a peer's region described by `key` (mapped under
    /// `FI_MR_RAW`: release it with [`Registrar::unmap`]), and whether it was mapped.
    pub(in crate::fabric) fn peer_key(&self, key: &RemoteKey) -> Result<(u64, bool), String> {
        if self.raw {
            return self.domain.map_raw(key.raw_base, &key.key).map(|k| (k, true)).map_err(|e| e.to_string());
        }
        let k: [u8; 8] = key.key.as_slice().try_into().map_err(|_| "a malformed MR key".to_string())?;
        Ok((u64::from_le_bytes(k), false))
    }

    /// Releases a key mapped by [`Registrar::peer_key`].
    pub(in crate::fabric) fn unmap(&self, key: u64) {
        self.domain.unmap_key(key);
    }
}

/// A send or receive buffer with its registration, if any.
pub(in crate::fabric) struct LocalBuf {
    mr: Option<Mr>,
    mem: Vec<u8>,
}

impl LocalBuf {
    /// `mem` without a registration (unit tests of what holds buffers).
    #[cfg(test)]
    pub(in crate::fabric) fn unregistered(mem: Vec<u8>) -> Self {
        Self { mr: None, mem }
    }

    /// The bytes.
    pub(in crate::fabric) fn bytes(&self) -> &[u8] {
        &self.mem
    }

    /// Closes the registration, keeping the memory (teardown).
    pub(in crate::fabric) fn unregister(&mut self) {
        self.mr = None;
    }

    pub(super) fn raw(&self) -> (*const u8, usize, *mut c_void) {
        (self.mem.as_ptr(), self.mem.len(), desc(self.mr.as_ref()))
    }

    /// As [`LocalBuf::raw`], for memory the provider writes (a receive).
    pub(super) fn raw_mut(&mut self) -> (*mut u8, usize, *mut c_void) {
        (self.mem.as_mut_ptr(), self.mem.len(), desc(self.mr.as_ref()))
    }
}

fn desc(mr: Option<&Mr>) -> *mut c_void {
    // SAFETY: a valid MR.
    mr.map_or(ptr::null_mut(), |m| unsafe { sys::fi_mr_desc(m.ptr) })
}

/// The memory reads write into.
pub(in crate::fabric) enum ReadMem {
    /// A new buffer (a rendezvous message, a get into a new buffer), left uninitialised:
    /// zeroing it first cost a pass over the memory as long as a fast read itself (4 MiB
    /// gets over shm). It is read only once every read into it succeeded
    /// ([`ReadMem::filled`]).
    New(Box<[MaybeUninit<u8>]>),
    /// A get's destination in the reader's memory.
    Part(Part),
    /// A receive's memory, claimed for a rendezvous message.
    Claim(Claim),
}

impl ReadMem {
    /// A new buffer of `len` bytes.
    pub(in crate::fabric) fn new_buffer(len: usize) -> Self {
        Self::New(Box::new_uninit_slice(len))
    }

    /// Its length in bytes.
    pub(in crate::fabric) fn len(&self) -> usize {
        match self {
            Self::New(v) => v.len(),
            Self::Part(p) => p.len(),
            Self::Claim(c) => c.len(),
        }
    }

    /// Where its bytes start, for registration and the provider.
    fn base(&mut self) -> *mut u8 {
        match self {
            Self::New(v) => v.as_mut_ptr().cast::<u8>(),
            Self::Part(p) => p.as_mut_slice().as_mut_ptr(),
            Self::Claim(c) => c.bytes_mut().as_mut_ptr(),
        }
    }

    /// A new buffer's bytes.
    ///
    /// # Safety
    /// Every byte was written: reads covering the whole buffer all completed without
    /// error.
    pub(in crate::fabric) unsafe fn filled(b: Box<[MaybeUninit<u8>]>) -> Box<[u8]> {
        // SAFETY: the caller guarantees that every byte is initialised.
        unsafe { b.assume_init() }
    }
}

/// The destination of RMA reads; see the module docs.
pub(in crate::fabric) struct ReadDest {
    mr: Mutex<Option<Mr>>,
    /// The first byte of `mem` (taken before `mem` was shared; never moves).
    base: *mut u8,
    len: usize,
    mem: UnsafeCell<ReadMem>,
}

// SAFETY: while the destination is shared, `mem` is only written by the provider,
// through `base`, in the disjoint ranges of the reads in flight; it is moved out only by
// `take`, which needs the last reference (no read in flight holds one).
unsafe impl Sync for ReadDest {}
// SAFETY: as above; the Mr is Send.
unsafe impl Send for ReadDest {}

impl ReadDest {
    /// Closes the registration (teardown).
    pub(in crate::fabric) fn unregister(&self) {
        *self.mr.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// The bytes read, once no read holds the destination any more.
    pub(in crate::fabric) fn take(this: Arc<Self>) -> Option<ReadMem> {
        let d = Arc::try_unwrap(this).ok()?;
        drop(d.mr);
        Some(d.mem.into_inner())
    }

    /// Copies bytes `offset..offset + len` of the destination from `addr` in the memory
    /// of process `pid` (same pid namespace), with `process_vm_readv`: the kernel copies
    /// from the owner's pages to ours without either process's help. Call only for a
    /// range that no other read is writing (a copy is its chunk's one read).
    ///
    /// # Errors
    /// The system call's: `EPERM` where the kernel or its policy forbids such reads,
    /// `ESRCH` if the process is gone, `EFAULT` for a range outside its memory (or
    /// outside the destination).
    pub(in crate::fabric) fn copy_from_process(
        &self,
        (offset, len): (usize, usize),
        pid: u32,
        addr: u64,
    ) -> std::io::Result<()> {
        let fault = || std::io::Error::from_raw_os_error(libc::EFAULT);
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(fault());
        }
        // SAFETY: the range lies within the destination (checked above), and nothing
        // else writes it while this copy is its only read (see the `Sync` impl).
        unsafe { read_process(self.base.wrapping_add(offset), len, pid, addr) }
    }

    /// The address of byte `offset` of `len` (within bounds) and the descriptor.
    pub(super) fn raw(&self, offset: usize, len: usize) -> Option<(*mut u8, *mut c_void)> {
        if offset.checked_add(len)? > self.len {
            return None;
        }
        let d = desc(self.mr.lock().unwrap_or_else(PoisonError::into_inner).as_ref());
        Some((self.base.wrapping_add(offset), d))
    }
}

/// Bytes registered for peers to read. Field order: the registration is closed before
/// the bytes are released.
pub(in crate::fabric) struct Remote {
    _mr: Option<Mr>,
    key: RemoteKey,
    bytes: Bytes,
}

impl Remote {
    /// What a peer needs to read it.
    pub(in crate::fabric) fn key(&self) -> &RemoteKey {
        &self.key
    }

    /// Its size in bytes.
    pub(in crate::fabric) fn len(&self) -> usize {
        self.bytes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An unregistered destination of `len` new bytes.
    fn dest(len: usize) -> ReadDest {
        let mut mem = ReadMem::new_buffer(len);
        ReadDest { mr: Mutex::new(None), base: mem.base(), len, mem: UnsafeCell::new(mem) }
    }

    fn bytes_of(d: ReadDest) -> Vec<u8> {
        match d.mem.into_inner() {
            // SAFETY: the copy that filled it succeeded.
            ReadMem::New(b) => unsafe { ReadMem::filled(b) }.into_vec(),
            _ => unreachable!("a new buffer"),
        }
    }

    #[test]
    fn a_destination_is_copied_from_a_process_whole() {
        // This process stands in for the owner: the kernel copies the same way.
        let owner = Owner::this_process().expect("/proc/self/ns/pid");
        let src: Vec<u8> = (0..3 << 20).map(|i: u32| (i * 7 + i / 4096) as u8).collect();
        let n = src.len() - 5;
        let d = dest(n);
        // In two pieces, as a transfer's chunks are.
        let half = n / 2 + 3;
        d.copy_from_process((half, n - half), owner.pid, src.as_ptr() as u64 + 5 + half as u64).unwrap();
        d.copy_from_process((0, half), owner.pid, src.as_ptr() as u64 + 5).unwrap();
        assert!(bytes_of(d) == src[5..], "the copy differs from its source");
    }

    #[test]
    fn a_copy_outside_the_owners_memory_fails_instead_of_landing_short() {
        let owner = Owner::this_process().unwrap();
        let d = dest(4096);
        let src = vec![1u8; 4096];
        let e = d.copy_from_process((0, 4096), owner.pid, 8).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EFAULT), "{e}");
        let e = d.copy_from_process((0, 4096), owner.pid, u64::MAX - 100).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EFAULT), "{e}");
        let e = d.copy_from_process((1, 4096), owner.pid, src.as_ptr() as u64).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EFAULT), "past the destination: {e}");
        // A pid no process has (above the kernel's limit of 2^22).
        let e = d.copy_from_process((0, 4096), (1 << 22) + 1, src.as_ptr() as u64).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESRCH), "{e}");
    }
}
