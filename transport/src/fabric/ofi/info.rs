//! Choosing a provider: `fi_getinfo` with the backend's hints.

use super::{check, OfiError, API_VERSION, MR_MODES};
use crate::fabric::sys;
use std::ffi::{CStr, CString};
use std::ptr;

/// What the backend needs to know of the chosen provider.
#[derive(Debug, Clone)]
pub(in crate::fabric) struct Attrs {
    /// Provider name (`tcp;ofi_rxm`, `shm`, ...).
    pub(in crate::fabric) provider: String,
    /// Domain name (`lo`, `shm`, `mlx5_0`, ...).
    pub(in crate::fabric) domain: String,
    /// The `mr_mode` bits the provider needs, a subset of [`MR_MODES`].
    pub(in crate::fabric) mr_mode: u32,
    /// Bytes of a raw MR key (`FI_MR_RAW`).
    pub(in crate::fabric) mr_key_size: usize,
    /// Largest message or RMA transfer.
    pub(in crate::fabric) max_msg_size: usize,
    /// Largest message the provider copies at once (`fi_tinject`).
    pub(in crate::fabric) inject_size: usize,
    /// The address format (`FI_SOCKADDR_IN`, `FI_ADDR_STR`, ...).
    pub(in crate::fabric) addr_format: u32,
}

impl Attrs {
    /// Whether the provider needs mode bit `bit` (an `FI_MR_*` value).
    pub(in crate::fabric) fn mr(&self, bit: u32) -> bool {
        self.mr_mode & bit != 0
    }
}

/// A list returned by `fi_getinfo`; its first entry is the one used.
pub(in crate::fabric) struct Info {
    pub(super) ptr: *mut sys::fi_info,
}

// SAFETY: the list is owned by this value, only read after fi_getinfo returned it, and
// freed once (Drop); libfabric keeps no reference to it.
unsafe impl Send for Info {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for Info {}

impl Info {
    /// Asks for reliable-datagram endpoints with tagged messages and RMA reads, of
    /// `provider` (else `FI_PROVIDER`, else libfabric's choice), binding to `node` (a
    /// host) when given.
    pub(in crate::fabric) fn get(provider: Option<&str>, node: Option<&str>) -> Result<Self, OfiError> {
        let prov = provider.map(CString::new).transpose().map_err(|_| OfiError { call: "fi_getinfo", code: 22 })?;
        let node = node.map(CString::new).transpose().map_err(|_| OfiError { call: "fi_getinfo", code: 22 })?;
        // SAFETY: fi_allocinfo returns a zeroed fi_info with its attribute structs
        // allocated, or null; fi_freeinfo frees it and the strdup'ed provider name.
        let hints = unsafe { sys::fi_allocinfo() };
        if hints.is_null() {
            return Err(OfiError { call: "fi_allocinfo", code: 12 });
        }
        // SAFETY: hints and its ep/domain/fabric attribute pointers were allocated by
        // fi_allocinfo; the fields written are plain values and a malloc'ed string
        // (fi_freeinfo frees it).
        unsafe {
            (*hints).caps = u64::from(sys::FI_TAGGED | sys::FI_RMA | sys::FI_READ | sys::FI_REMOTE_READ);
            (*hints).mode = sys::FI_CONTEXT | sys::FI_CONTEXT2;
            (*(*hints).ep_attr).type_ = sys::fi_ep_type_FI_EP_RDM;
            (*(*hints).domain_attr).mr_mode = MR_MODES as i32;
            (*(*hints).domain_attr).threading = sys::fi_threading_FI_THREAD_SAFE;
            if let Some(p) = &prov {
                (*(*hints).fabric_attr).prov_name = libc::strdup(p.as_ptr());
            }
        }
        let mut info = ptr::null_mut();
        let flags = if node.is_some() { sys::FI_SOURCE } else { 0 };
        let node_ptr = node.as_ref().map_or(ptr::null(), |n| n.as_ptr());
        // SAFETY: hints is a valid fi_info; node is null or a NUL-terminated string that
        // outlives the call; info receives a list we own.
        let ret = unsafe { sys::fi_getinfo(API_VERSION, node_ptr, ptr::null(), flags, hints, &mut info) };
        // SAFETY: hints came from fi_allocinfo and is freed once.
        unsafe { sys::fi_freeinfo(hints) };
        check("fi_getinfo", ret)?;
        if info.is_null() {
            return Err(OfiError { call: "fi_getinfo", code: sys::FI_ENODATA as i32 });
        }
        Ok(Self { ptr: info })
    }

    /// The first entry's attributes.
    pub(in crate::fabric) fn attrs(&self) -> Attrs {
        let text = |p: *const std::os::raw::c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: non-null strings of an fi_info are NUL-terminated and live as
                // long as the list.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        // SAFETY: fi_getinfo returned a non-null list whose entries have their
        // attribute structs set.
        unsafe {
            let i = &*self.ptr;
            let d = &*i.domain_attr;
            Attrs {
                provider: text((*i.fabric_attr).prov_name),
                domain: text(d.name),
                mr_mode: (d.mr_mode as u32) & MR_MODES,
                mr_key_size: d.mr_key_size,
                max_msg_size: (*i.ep_attr).max_msg_size,
                inject_size: (*i.tx_attr).inject_size,
                addr_format: i.addr_format,
            }
        }
    }
}

impl Drop for Info {
    fn drop(&mut self) {
        // SAFETY: the list came from fi_getinfo and is freed once.
        unsafe { sys::fi_freeinfo(self.ptr) };
    }
}
