//! A small safe layer over libfabric: the objects the backend opens, each closed when
//! dropped, children before parents (every object holds its parent in an `Arc`); the
//! memory the provider touches, owned with its registration ([`mem`]); the table of
//! operations in flight, which owns their memory until their completions are read
//! ([`ops`]); and the receive buffers, in fixed slots posted again and again
//! ([`slots`]). This module and [`super::sys`] hold all of the backend's `unsafe`.
//!
//! Every object is opened on a domain with `FI_THREAD_SAFE` threading, so libfabric
//! serialises concurrent calls on it itself; that is what makes the wrappers `Send` and
//! `Sync`. The data transfer calls (`Ep::tsend`, `Ep::trecv`, `Ep::read`) take raw
//! buffers: they are `unsafe fn`s, called only by the operation table and the receive
//! slots.

use super::sys;
use std::ffi::{c_void, CStr};
use std::fmt;
use std::ptr;
use std::sync::Arc;

mod ep;
mod info;
mod mem;
mod ops;
mod slots;

pub(super) use ep::Posted;
pub(super) use info::{Attrs, Info};
pub(super) use mem::{copy_from_process, Owner, ReadDest, ReadMem, Registrar, Remote, RemoteKey};
pub(super) use ops::{lock, Op, Ops, Post, SendDone};
pub(super) use slots::{RecvSlots, MAX_SLOTS};

/// The libfabric API version the backend is written against: `FI_VERSION(1, 17)`.
const API_VERSION: u32 = (1 << 16) | 17;
/// `FI_ADDR_NOTAVAIL`: no address (a source not in the address vector).
pub(super) const ADDR_NOTAVAIL: u64 = u64::MAX;
/// Bytes `fi_getname` may return; longer names are refused.
pub(super) const MAX_NAME: usize = 256;
/// `FI_EAGAIN`, as a positive code.
pub(super) const EAGAIN: i32 = sys::FI_EAGAIN as i32;

/// The memory registration modes the backend can honour (see the module docs of
/// [`super`]): `FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY |
/// FI_MR_ENDPOINT | FI_MR_RAW`.
pub(super) const MR_MODES: u32 = sys::FI_MR_LOCAL
    | sys::FI_MR_VIRT_ADDR
    | sys::FI_MR_ALLOCATED
    | sys::FI_MR_PROV_KEY
    | sys::FI_MR_ENDPOINT
    | sys::FI_MR_RAW;

/// A failed libfabric call: the call and `fi_strerror`'s text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct OfiError {
    /// The call that failed.
    pub(super) call: &'static str,
    /// The positive fabric errno.
    pub(super) code: i32,
}

impl fmt::Display for OfiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {} ({})", self.call, strerror(self.code), self.code)
    }
}

impl std::error::Error for OfiError {}

/// `fi_strerror` of a (positive or negative) fabric errno.
pub(super) fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror returns a pointer to a static NUL-terminated string for any
    // value (unknown codes fall back to strerror's text).
    let p = unsafe { sys::fi_strerror(code.saturating_abs()) };
    if p.is_null() {
        return format!("error {code}");
    }
    // SAFETY: non-null, NUL-terminated and static (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn check(call: &'static str, ret: i32) -> Result<(), OfiError> {
    if ret < 0 {
        Err(OfiError { call, code: -ret })
    } else {
        Ok(())
    }
}

fn check_len(call: &'static str, ret: isize) -> Result<(), OfiError> {
    check(call, i32::try_from(ret).unwrap_or(i32::MIN + 1))
}

fn close(fid: *mut sys::fid, what: &str) {
    // SAFETY: every caller passes the fid of an object it opened and closes once.
    let ret = unsafe { sys::fi_close(fid) };
    if ret < 0 {
        tracing::warn!("closing the libfabric {what} failed: {}", strerror(ret));
    }
}

/// A fabric.
pub(super) struct Fabric(*mut sys::fid_fabric);
/// A domain (an opened NIC), holding its fabric.
pub(super) struct Domain {
    ptr: *mut sys::fid_domain,
    _fabric: Arc<Fabric>,
}
/// An address vector.
pub(super) struct Av {
    ptr: *mut sys::fid_av,
    _domain: Arc<Domain>,
}
/// A completion queue in the tagged format.
pub(super) struct Cq {
    ptr: *mut sys::fid_cq,
    _domain: Arc<Domain>,
}
/// An enabled RDM endpoint bound to its address vector and completion queue.
pub(super) struct Ep(*mut sys::fid_ep, Arc<Av>, Arc<Cq>);

macro_rules! thread_safe {
    ($($t:ty),*) => {$(
        // SAFETY: opened on an FI_THREAD_SAFE domain: libfabric serialises concurrent
        // calls on the object, and the pointer is only closed in Drop.
        unsafe impl Send for $t {}
        // SAFETY: as above.
        unsafe impl Sync for $t {}
    )*};
}
thread_safe!(Fabric, Domain, Av, Cq, Ep);

impl Fabric {
    /// Opens the fabric of `info`'s first entry.
    pub(super) fn open(info: &Info) -> Result<Arc<Self>, OfiError> {
        let mut f = ptr::null_mut();
        // SAFETY: fabric_attr of a list entry is valid; f receives the new object.
        check("fi_fabric", unsafe { sys::fi_fabric((*info.ptr).fabric_attr, &mut f, ptr::null_mut()) })?;
        Ok(Arc::new(Self(f)))
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // SAFETY: the fabric is a valid fid; taking the address of its fid field.
        close(unsafe { &raw mut (*self.0).fid }, "fabric");
    }
}

impl Domain {
    /// Opens the domain of `info`'s first entry.
    pub(super) fn open(fabric: &Arc<Fabric>, info: &Info) -> Result<Arc<Self>, OfiError> {
        let mut d = ptr::null_mut();
        // SAFETY: valid fabric and info; d receives the new object.
        check("fi_domain", unsafe { sys::fi_domain(fabric.0, info.ptr, &mut d, ptr::null_mut()) })?;
        Ok(Arc::new(Self { ptr: d, _fabric: fabric.clone() }))
    }

    /// Maps a peer's raw MR key (`FI_MR_RAW`) to a key usable in transfers; release it
    /// with [`Domain::unmap_key`].
    pub(super) fn map_raw(&self, base: u64, raw: &[u8]) -> Result<u64, OfiError> {
        let mut raw = raw.to_vec();
        let mut key = 0;
        // SAFETY: raw is a buffer of raw.len() bytes that outlives the call.
        check("fi_mr_map_raw", unsafe {
            sys::fi_mr_map_raw(self.ptr, base, raw.as_mut_ptr(), raw.len(), &mut key, 0)
        })?;
        Ok(key)
    }

    /// Releases a key from [`Domain::map_raw`].
    pub(super) fn unmap_key(&self, key: u64) {
        // SAFETY: valid domain; an unknown key is reported as an error, not UB.
        let _ = unsafe { sys::fi_mr_unmap_key(self.ptr, key) };
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        // SAFETY: valid fid.
        close(unsafe { &raw mut (*self.ptr).fid }, "domain");
    }
}

impl Av {
    /// Opens an address vector of the provider's preferred type.
    pub(super) fn open(domain: &Arc<Domain>) -> Result<Arc<Self>, OfiError> {
        let mut attr = sys::fi_av_attr { type_: sys::fi_av_type_FI_AV_UNSPEC, ..Default::default() };
        let mut av = ptr::null_mut();
        // SAFETY: valid domain and attributes; av receives the new object.
        check("fi_av_open", unsafe { sys::fi_av_open(domain.ptr, &mut attr, &mut av, ptr::null_mut()) })?;
        Ok(Arc::new(Self { ptr: av, _domain: domain.clone() }))
    }

    /// Inserts one endpoint name; returns its fabric address.
    pub(super) fn insert(&self, name: &[u8]) -> Result<u64, OfiError> {
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(OfiError { call: "fi_av_insert", code: 22 });
        }
        // Providers read an address of their own format's length; pad short junk.
        let mut buf = [0u8; MAX_NAME];
        buf[..name.len()].copy_from_slice(name);
        let mut fi_addr = ADDR_NOTAVAIL;
        // SAFETY: buf holds MAX_NAME readable bytes, at least any provider's address
        // length; fi_addr receives one address.
        let n = unsafe { sys::fi_av_insert(self.ptr, buf.as_ptr().cast(), 1, &mut fi_addr, 0, ptr::null_mut()) };
        if n != 1 || fi_addr == ADDR_NOTAVAIL {
            return Err(OfiError { call: "fi_av_insert", code: if n < 0 { -n } else { 22 } });
        }
        Ok(fi_addr)
    }

    /// Removes an address inserted by [`Av::insert`].
    pub(super) fn remove(&self, mut fi_addr: u64) {
        // SAFETY: valid AV; one address read from fi_addr.
        let _ = unsafe { sys::fi_av_remove(self.ptr, &mut fi_addr, 1, 0) };
    }
}

impl Drop for Av {
    fn drop(&mut self) {
        // SAFETY: valid fid.
        close(unsafe { &raw mut (*self.ptr).fid }, "address vector");
    }
}

/// One completion read from a [`Cq`].
pub(super) type Completion = sys::fi_cq_tagged_entry;

/// An error completion: the operation's context and the error's text.
pub(super) struct ErrCompletion {
    /// The failed operation's context (may be null).
    pub(super) context: *mut c_void,
    /// The positive fabric errno.
    pub(super) code: i32,
    /// `fi_strerror` plus the provider's details.
    pub(super) text: String,
}

impl Cq {
    /// Opens a tagged-format completion queue without a wait object: the backend polls
    /// (`fi_cq_sread` on 1.17's rxm and shm spins in `sched_yield` and was seen not to
    /// return within its timeout, so blocking reads buy nothing).
    pub(super) fn open(domain: &Arc<Domain>) -> Result<Arc<Self>, OfiError> {
        let mut attr = sys::fi_cq_attr {
            format: sys::fi_cq_format_FI_CQ_FORMAT_TAGGED,
            wait_obj: sys::fi_wait_obj_FI_WAIT_NONE,
            ..Default::default()
        };
        let mut cq = ptr::null_mut();
        // SAFETY: valid domain and attributes; cq receives the new object.
        check("fi_cq_open", unsafe { sys::fi_cq_open(domain.ptr, &mut attr, &mut cq, ptr::null_mut()) })?;
        Ok(Arc::new(Self { ptr: cq, _domain: domain.clone() }))
    }

    /// Reads up to `out.len()` completions without blocking, returning those read
    /// (none: an empty slice). `Err(FI_EAVAIL)`: an error completion is next (see
    /// [`Cq::read_err`]).
    pub(super) fn read<'a>(
        &self,
        out: &'a mut [std::mem::MaybeUninit<Completion>],
    ) -> Result<&'a [Completion], OfiError> {
        // SAFETY: out has room for out.len() entries of the CQ's (tagged) format; the
        // call writes the first `ret` of them.
        let ret = unsafe { sys::fi_cq_read(self.ptr, out.as_mut_ptr().cast(), out.len()) };
        if ret == -(EAGAIN as isize) {
            return Ok(&[]);
        }
        check_len("fi_cq_read", ret)?;
        let n = usize::try_from(ret).unwrap_or(0).min(out.len());
        // SAFETY: the first n entries were written by the provider (a plain C struct,
        // valid for any bytes it wrote).
        Ok(unsafe { std::slice::from_raw_parts(out.as_ptr().cast::<Completion>(), n) })
    }

    /// Reads the next error completion, if any. Callers serialise error reads (the
    /// provider's error data lives until the next read).
    pub(super) fn read_err(&self) -> Option<ErrCompletion> {
        let mut e = sys::fi_cq_err_entry::default();
        // SAFETY: e is a valid entry with err_data_size 0 (the provider lends its own
        // buffer, valid until the next read on this CQ, which the caller serialises).
        let ret = unsafe { sys::fi_cq_readerr(self.ptr, &mut e, 0) };
        if ret < 1 {
            return None;
        }
        let mut buf = [0 as std::os::raw::c_char; 256];
        // SAFETY: buf has 256 bytes; the provider writes a NUL-terminated string into it
        // or returns a static one.
        let detail = unsafe { sys::fi_cq_strerror(self.ptr, e.prov_errno, e.err_data, buf.as_mut_ptr(), buf.len()) };
        let detail = if detail.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated (see above).
            unsafe { CStr::from_ptr(detail) }.to_string_lossy().into_owned()
        };
        let text = format!("{} ({detail})", strerror(e.err));
        Some(ErrCompletion { context: e.op_context, code: e.err, text })
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: valid fid.
        close(unsafe { &raw mut (*self.ptr).fid }, "completion queue");
    }
}
