//! Plain-old-data slices as message payloads.

use crate::error::{Error, Result};
use bytemuck::Pod;
use bytes::Bytes;

/// Refuses zero-sized element types (`()`, empty structs), at compile time: they carry
/// no bytes, so a payload could not say how many elements it held, and bytemuck's casts
/// of them panic. The functions of this module that handle elements call it, and so do
/// the group's calls that cast elements themselves.
pub(crate) const fn sized<T>() {
    const {
        assert!(
            std::mem::size_of::<T>() != 0,
            "ductile sends and receives elements of nonzero size only (this one carries no data)"
        );
    }
}

/// A `Vec<T>` viewed as bytes, so an owned vector becomes a payload without a copy.
struct PodVec<T>(Vec<T>);

impl<T: Pod> AsRef<[u8]> for PodVec<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// An owned vector as a payload, without copying.
pub(crate) fn vec_to_bytes<T: Pod + Send + Sync>(v: Vec<T>) -> Bytes {
    sized::<T>();
    if v.is_empty() {
        return Bytes::new();
    }
    Bytes::from_owner(PodVec(v))
}

/// A slice as a payload (one copy).
pub(crate) fn slice_to_bytes<T: Pod>(s: &[T]) -> Bytes {
    sized::<T>();
    Bytes::copy_from_slice(bytemuck::cast_slice(s))
}

/// Number of `T` elements in a payload from group rank `src`.
pub(crate) fn count_of<T: Pod>(b: &[u8], src: usize) -> Result<usize> {
    count_in::<T>(b.len(), src)
}

/// How many `T` fill `len` bytes from group rank `src`.
fn count_in<T: Pod>(len: usize, src: usize) -> Result<usize> {
    sized::<T>();
    let elem = std::mem::size_of::<T>();
    if !len.is_multiple_of(elem) {
        return Err(Error::Misaligned { len, elem, src });
    }
    Ok(len / elem)
}

/// The error for a message of `len` bytes from group rank `src` where `expected`
/// elements were wanted: not whole elements, or another count.
pub(crate) fn length_error<T: Pod>(len: usize, expected: usize, src: usize, what: &'static str) -> Error {
    match count_in::<T>(len, src) {
        Ok(got) => Error::LengthMismatch { what, expected, got, src },
        Err(e) => e,
    }
}

/// A payload as a vector of `T` (one copy: payload bytes carry no alignment).
pub(crate) fn bytes_to_vec<T: Pod>(b: &[u8], src: usize) -> Result<Vec<T>> {
    let n = count_of::<T>(b, src)?;
    let mut v = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(b);
    Ok(v)
}

/// Copies a payload into `out`, which must have exactly the payload's element count.
pub(crate) fn bytes_into<T: Pod>(b: &[u8], out: &mut [T], src: usize, what: &'static str) -> Result<()> {
    if b.len() != std::mem::size_of_val(out) {
        return Err(length_error::<T>(b.len(), out.len(), src, what));
    }
    bytemuck::cast_slice_mut::<T, u8>(out).copy_from_slice(b);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_checks_lengths() {
        let b = vec_to_bytes(vec![1.0f64, 2.0, 3.0]);
        assert_eq!(b.len(), 24);
        assert_eq!(bytes_to_vec::<f64>(&b, 0).unwrap(), vec![1.0, 2.0, 3.0]);
        assert!(matches!(bytes_to_vec::<f64>(&b[..20], 4), Err(Error::Misaligned { len: 20, elem: 8, src: 4 })));
        let mut out = [0u32; 6];
        bytes_into(&slice_to_bytes(&[7u32; 6]), &mut out, 0, "recv").unwrap();
        assert_eq!(out, [7; 6]);
        assert!(matches!(
            bytes_into(&b[..20], &mut out, 1, "recv"),
            Err(Error::LengthMismatch { expected: 6, got: 5, src: 1, .. })
        ));
        // Unaligned source bytes are fine.
        let raw = Bytes::from(vec![0u8; 17]).slice(1..);
        assert_eq!(bytes_to_vec::<u64>(&raw, 0).unwrap(), vec![0, 0]);
    }
}
