//! Reduction operators and the element types they apply to.

use bytemuck::Pod;

/// A reduction operator of `reduce` and `allreduce`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum (wrapping for integers).
    Sum,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
}

/// An element type reductions apply to.
pub trait Reducible: Pod + Send + Sync {
    /// Combines two values.
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
}

macro_rules! int_reducible {
    ($($t:ty),*) => {$(
        impl Reducible for $t {
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum => a.wrapping_add(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
        }
    )*};
}

macro_rules! float_reducible {
    ($($t:ty),*) => {$(
        impl Reducible for $t {
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum => a + b,
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
        }
    )*};
}

int_reducible!(i8, i16, i32, i64, u8, u16, u32, u64, isize, usize);
float_reducible!(f32, f64);

/// `acc[i] = op(acc[i], other[i])` where `other` holds elements as raw (possibly
/// unaligned) bytes of the same count; `lower_first` puts `other` on the left so every
/// rank combines operands in the same order.
pub(crate) fn combine_bytes<T: Reducible>(op: ReduceOp, acc: &mut [T], other: &[u8], other_first: bool) {
    let sz = std::mem::size_of::<T>();
    for (a, chunk) in acc.iter_mut().zip(other.chunks_exact(sz)) {
        let b: T = bytemuck::pod_read_unaligned(chunk);
        *a = if other_first { T::combine(op, b, *a) } else { T::combine(op, *a, b) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combines_elementwise() {
        let mut acc = [1i32, 5, -3];
        let other: Vec<u8> = [2i32, 2, 2].iter().flat_map(|v| v.to_ne_bytes()).collect();
        combine_bytes(ReduceOp::Sum, &mut acc, &other, false);
        assert_eq!(acc, [3, 7, -1]);
        combine_bytes(ReduceOp::Min, &mut acc, &other, true);
        assert_eq!(acc, [2, 2, -1]);
        let mut f = [1.5f64];
        combine_bytes(ReduceOp::Max, &mut f, &4.0f64.to_ne_bytes(), false);
        assert_eq!(f, [4.0]);
        assert_eq!(u8::combine(ReduceOp::Sum, 255, 1), 0);
    }
}
