//! The endpoint and memory registrations of the safe layer.

use super::{check, check_len, close, Av, Cq, Domain, Ep, OfiError, MAX_NAME};
use crate::fabric::sys;
use std::ffi::c_void;
use std::ptr;
use std::sync::Arc;

/// The outcome of posting an operation: posted, or the queue is full (retry later).
#[derive(Debug, PartialEq, Eq)]
pub(in crate::fabric) enum Posted {
    /// The operation will complete through the CQ.
    Yes,
    /// `FI_EAGAIN`: retry after progress.
    Again,
}

fn posted(call: &'static str, ret: isize) -> Result<Posted, OfiError> {
    if ret == -(super::EAGAIN as isize) {
        return Ok(Posted::Again);
    }
    check_len(call, ret).map(|()| Posted::Yes)
}

impl Ep {
    /// Opens an RDM endpoint on `info`'s first entry, binds it to `av` and `cq` (for
    /// both directions) and enables it.
    pub(in crate::fabric) fn open(
        domain: &Arc<Domain>,
        info: &super::Info,
        av: &Arc<Av>,
        cq: &Arc<Cq>,
    ) -> Result<Arc<Self>, OfiError> {
        let mut e = ptr::null_mut();
        // SAFETY: valid domain and info; e receives the new object.
        check("fi_endpoint", unsafe { sys::fi_endpoint(domain.ptr, info.ptr, &mut e, ptr::null_mut()) })?;
        let ep = Arc::new(Self(e, av.clone(), cq.clone()));
        // SAFETY: valid endpoint, AV and CQ fids (the endpoint keeps both alive).
        unsafe {
            check("fi_ep_bind(av)", sys::fi_ep_bind(ep.0, &raw mut (*av.ptr).fid, 0))?;
            let both = u64::from(sys::FI_TRANSMIT | sys::FI_RECV);
            check("fi_ep_bind(cq)", sys::fi_ep_bind(ep.0, &raw mut (*cq.ptr).fid, both))?;
            check("fi_enable", sys::fi_enable(ep.0))?;
        }
        Ok(ep)
    }

    /// The endpoint's name: the bytes peers insert into their address vectors.
    pub(in crate::fabric) fn name(&self) -> Result<Vec<u8>, OfiError> {
        let mut buf = vec![0u8; MAX_NAME];
        let mut len = buf.len();
        // SAFETY: buf has len writable bytes; len receives the name's length.
        check("fi_getname", unsafe { sys::fi_getname(&raw mut (*self.0).fid, buf.as_mut_ptr().cast(), &mut len) })?;
        if len > MAX_NAME {
            return Err(OfiError { call: "fi_getname", code: sys::FI_ETOOSMALL as i32 });
        }
        buf.truncate(len);
        Ok(buf)
    }

    /// The address vector.
    pub(in crate::fabric) fn av(&self) -> &Av {
        &self.1
    }

    /// The completion queue.
    pub(in crate::fabric) fn cq(&self) -> &Cq {
        &self.2
    }

    /// Posts a tagged send of `len` bytes at `buf` to `dest`.
    ///
    /// # Safety
    /// `buf..buf+len` stays valid and unchanged, and `ctx` (an `fi_context2`) valid,
    /// until the operation's completion is read; `desc` is the buffer's registration
    /// descriptor or null.
    pub(super) unsafe fn tsend(
        &self,
        buf: *const u8,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        tag: u64,
        ctx: *mut c_void,
    ) -> Result<Posted, OfiError> {
        // SAFETY: forwarded to the caller.
        posted("fi_tsend", unsafe { sys::fi_tsend(self.0, buf.cast(), len, desc, dest, tag, ctx) })
    }

    /// Sends a small tagged message that the provider copies before returning
    /// (`fi_tinject`): no completion is generated and `buf` is free again at once.
    /// `buf` must be at most the provider's inject size.
    pub(in crate::fabric) fn tinject(&self, buf: &[u8], dest: u64, tag: u64) -> Result<Posted, OfiError> {
        // SAFETY: fi_tinject reads buf (valid for its length) before it returns and
        // keeps no reference to it; it takes no context and writes no completion.
        posted("fi_tinject", unsafe { sys::fi_tinject(self.0, buf.as_ptr().cast(), buf.len(), dest, tag) })
    }

    /// Posts a tagged receive of exactly `tag` from any source.
    ///
    /// # Safety
    /// `buf..buf+len` stays valid and unaliased, and `ctx` valid, until the operation's
    /// completion is read or the endpoint is closed.
    pub(super) unsafe fn trecv(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        tag: u64,
        ctx: *mut c_void,
    ) -> Result<Posted, OfiError> {
        let any = super::ADDR_NOTAVAIL;
        // SAFETY: forwarded to the caller; FI_ADDR_UNSPEC (all ones) takes any source.
        posted("fi_trecv", unsafe { sys::fi_trecv(self.0, buf.cast(), len, desc, any, tag, 0, ctx) })
    }

    /// Asks the provider to cancel the operation posted with context `ctx`: if it was
    /// still pending, its completion comes as an error (`FI_ECANCELED`). Best effort: a
    /// provider that cannot cancel it (or finds it done) says so, and that is ignored.
    pub(in crate::fabric) fn cancel(&self, ctx: *mut c_void) {
        // SAFETY: a valid endpoint fid; the provider only compares `ctx` against its
        // pending operations and does not dereference a context it does not know.
        let _ = unsafe { sys::fi_cancel(&raw mut (*self.0).fid, ctx) };
    }

    /// Posts an RMA read of `len` bytes from `src`'s registered memory at `addr` (key
    /// `key`) into `buf`.
    ///
    /// # Safety
    /// As [`Ep::trecv`].
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn read(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        src: u64,
        addr: u64,
        key: u64,
        ctx: *mut c_void,
    ) -> Result<Posted, OfiError> {
        // SAFETY: forwarded to the caller.
        posted("fi_read", unsafe { sys::fi_read(self.0, buf.cast(), len, desc, src, addr, key, ctx) })
    }
}

impl Drop for Ep {
    fn drop(&mut self) {
        // SAFETY: valid fid.
        close(unsafe { &raw mut (*self.0).fid }, "endpoint");
    }
}
