//! Windows: memory regions an endpoint exposes for one-sided reads by its peers.
//!
//! Exposing a region is a *local* registration: no message is sent, and peers learn the
//! window's id from the application (usually inside a message they receive anyway). A
//! peer reads a byte range of it with a *get*, which completes explicitly: the get's
//! future resolves once the bytes are in the reader's buffer. A region is immutable
//! `Bytes`, so a get can never observe a torn write, and the exposing endpoint keeps a
//! reference until the window is withdrawn.
//!
//! This module holds what every backend shares: the table of exposed windows
//! ([`WindowTable`]), the bounds check ([`WindowTable::read`]), the table of a reader's
//! gets in flight ([`GetTable`]), and the wire encoding of a get request and of its
//! failure. Backends carry requests and replies their own way.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

mod gets;
pub use gets::{await_get, await_landed, GetTable, Got};

/// A window's id, chosen by the endpoint that exposes it; unique on that endpoint for
/// its lifetime (ids are never reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct WindowId(pub u32);

impl fmt::Display for WindowId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "window {}", self.0)
    }
}

/// Why a get was refused by the endpoint that owns the window.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WindowError {
    /// No such window is exposed (never, or withdrawn).
    #[error("{0} is not exposed")]
    Unknown(WindowId),
    /// The range reaches outside the window.
    #[error("bytes {offset}..{end} are outside {window} of {size} bytes", end = offset.saturating_add(*len))]
    OutOfRange {
        /// The window.
        window: WindowId,
        /// First byte asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// The window's size.
        size: u64,
    },
    /// The reply does not fit one message of this transport.
    #[error("a get of {len} bytes exceeds the transport's message cap of {cap} bytes")]
    TooLarge {
        /// Bytes asked for.
        len: u64,
        /// The cap.
        cap: u64,
    },
}

/// Length of an encoded get request.
pub const REQUEST_LEN: usize = 4 + 8 + 8;

/// A get request: window, offset, length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GetRequest {
    /// The window.
    pub window: WindowId,
    /// First byte.
    pub offset: u64,
    /// Bytes wanted.
    pub len: u64,
}

impl GetRequest {
    /// Wire bytes (little endian).
    #[must_use]
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&self.window.0.to_le_bytes());
        b[4..12].copy_from_slice(&self.offset.to_le_bytes());
        b[12..20].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a request; `None` if `b` has the wrong length.
    #[must_use]
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != REQUEST_LEN {
            return None;
        }
        let mut w = [0u8; 4];
        w.copy_from_slice(&b[0..4]);
        let mut o = [0u8; 8];
        o.copy_from_slice(&b[4..12]);
        let mut l = [0u8; 8];
        l.copy_from_slice(&b[12..20]);
        Some(Self {
            window: WindowId(u32::from_le_bytes(w)),
            offset: u64::from_le_bytes(o),
            len: u64::from_le_bytes(l),
        })
    }
}

/// Length of an encoded refusal.
pub const REFUSAL_LEN: usize = 1 + 4 * 8;

/// Encodes a refusal for the wire: a code and the numbers it names.
#[must_use]
pub fn encode_refusal(e: &WindowError) -> Vec<u8> {
    let (code, nums): (u8, [u64; 4]) = match *e {
        WindowError::Unknown(w) => (1, [u64::from(w.0), 0, 0, 0]),
        WindowError::OutOfRange { window, offset, len, size } => (2, [u64::from(window.0), offset, len, size]),
        WindowError::TooLarge { len, cap } => (3, [len, cap, 0, 0]),
    };
    let mut b = Vec::with_capacity(REFUSAL_LEN);
    b.push(code);
    for n in nums {
        b.extend_from_slice(&n.to_le_bytes());
    }
    b
}

/// Decodes a refusal; `None` if it is malformed.
#[must_use]
pub fn decode_refusal(b: &[u8]) -> Option<WindowError> {
    if b.len() != REFUSAL_LEN {
        return None;
    }
    let n = |i: usize| {
        let mut x = [0u8; 8];
        x.copy_from_slice(&b[1 + 8 * i..9 + 8 * i]);
        u64::from_le_bytes(x)
    };
    let window = || u32::try_from(n(0)).ok().map(WindowId);
    match b[0] {
        1 => Some(WindowError::Unknown(window()?)),
        2 => Some(WindowError::OutOfRange { window: window()?, offset: n(1), len: n(2), size: n(3) }),
        3 => Some(WindowError::TooLarge { len: n(0), cap: n(1) }),
        _ => None,
    }
}

/// The windows one endpoint exposes.
#[derive(Default)]
pub struct WindowTable {
    next: AtomicU32,
    windows: Mutex<HashMap<WindowId, Bytes>>,
}

impl WindowTable {
    /// An empty table.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Exposes `region` under a fresh id.
    pub fn expose(&self, region: Bytes) -> WindowId {
        let id = WindowId(self.next.fetch_add(1, Ordering::Relaxed));
        lock(&self.windows).insert(id, region);
        id
    }

    /// Withdraws a window; the region is released once gets already served drop it.
    ///
    /// # Errors
    /// The window is not exposed.
    pub fn withdraw(&self, id: WindowId) -> Result<Bytes, WindowError> {
        lock(&self.windows).remove(&id).ok_or(WindowError::Unknown(id))
    }

    /// The bytes a get asks for (a reference into the region, no copy).
    ///
    /// # Errors
    /// An unknown window or a range outside it.
    pub fn read(&self, req: GetRequest) -> Result<Bytes, WindowError> {
        let region = lock(&self.windows).get(&req.window).cloned().ok_or(WindowError::Unknown(req.window))?;
        let size = region.len() as u64;
        let fits = req.offset.checked_add(req.len).is_some_and(|end| end <= size);
        if !fits {
            return Err(WindowError::OutOfRange { window: req.window, offset: req.offset, len: req.len, size });
        }
        // Both bounds are within `size`, which is a usize.
        let start = usize::try_from(req.offset).unwrap_or(usize::MAX);
        let len = usize::try_from(req.len).unwrap_or(usize::MAX);
        Ok(region.slice(start..start + len))
    }

    /// As [`WindowTable::read`], refusing a reply larger than `cap` bytes (the
    /// transport's message cap).
    ///
    /// # Errors
    /// As [`WindowTable::read`], or the range is larger than `cap`.
    pub fn read_capped(&self, req: GetRequest, cap: u64) -> Result<Bytes, WindowError> {
        let b = self.read(req)?;
        let len = b.len() as u64;
        if len > cap {
            return Err(WindowError::TooLarge { len, cap });
        }
        Ok(b)
    }

    /// Number of exposed windows.
    #[must_use]
    pub fn len(&self) -> usize {
        lock(&self.windows).len()
    }

    /// Whether no window is exposed.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Critical sections here leave the maps consistent, so a poisoned lock is usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reads_check_bounds() {
        let t = WindowTable::new();
        let w = t.expose(Bytes::from_static(b"0123456789"));
        let req = |offset, len| GetRequest { window: w, offset, len };
        assert_eq!(&t.read(req(2, 3)).unwrap()[..], b"234");
        assert_eq!(t.read(req(10, 0)).unwrap().len(), 0);
        assert_eq!(t.read(req(8, 3)), Err(WindowError::OutOfRange { window: w, offset: 8, len: 3, size: 10 }));
        assert!(matches!(t.read(req(u64::MAX, 2)), Err(WindowError::OutOfRange { .. })));
        let other = GetRequest { window: WindowId(99), offset: 0, len: 1 };
        assert_eq!(t.read(other), Err(WindowError::Unknown(WindowId(99))));
        assert!(t.withdraw(w).is_ok());
        assert_eq!(t.read(req(0, 1)), Err(WindowError::Unknown(w)));
        assert_eq!(t.withdraw(w), Err(WindowError::Unknown(w)));
    }

    #[test]
    fn ids_are_not_reused() {
        let t = WindowTable::new();
        let a = t.expose(Bytes::new());
        t.withdraw(a).unwrap();
        assert_ne!(t.expose(Bytes::new()), a);
    }

    proptest! {
        #[test]
        fn request_round_trips(w: u32, offset: u64, len: u64) {
            let r = GetRequest { window: WindowId(w), offset, len };
            prop_assert_eq!(GetRequest::decode(&r.encode()), Some(r));
        }

        #[test]
        fn refusal_round_trips(w: u32, offset: u64, len: u64, size: u64, pick in 0u8..3) {
            let e = match pick {
                0 => WindowError::Unknown(WindowId(w)),
                1 => WindowError::OutOfRange { window: WindowId(w), offset, len, size },
                _ => WindowError::TooLarge { len, cap: size },
            };
            prop_assert_eq!(decode_refusal(&encode_refusal(&e)), Some(e));
        }

        #[test]
        fn decoding_never_panics(b in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = GetRequest::decode(&b);
            let _ = decode_refusal(&b);
        }
    }
}
