//! Element-wise reduction kernels with one fixed order.
//!
//! Every element is combined in increasing rank order, `((x0 ∘ x1) ∘ x2) ∘ …`, whatever the
//! algorithm, message size or chunking. All-reduce and reduce-scatter call the same kernel, so
//! a reduce-scatter shard (FSDP) is bit-identical to the same elements of an all-reduce (DDP).
//! `bf16`/`f16` accumulate in `f32` and round once; `Avg` divides the sum by the rank count at
//! the end.

use crate::comm::{CommError, DType, ReduceOp};
use half::{bf16, f16};

const BLOCK: usize = 1024;

/// Combines `inputs` (one per rank, in rank order, each `out.len()` bytes) into `out`.
///
/// # Safety
/// `out` must be valid for writes and every input valid for reads of `len` bytes. `out` may
/// alias one input exactly (same start); it must not partially overlap any input.
pub unsafe fn reduce(
    out: *mut u8,
    inputs: &[*const u8],
    len: usize,
    dtype: DType,
    op: ReduceOp,
) -> Result<(), CommError> {
    if op == ReduceOp::Avg && !dtype.is_float() {
        return Err(CommError::InvalidArgument(format!(
            "avg needs a floating-point dtype, got {dtype}"
        )));
    }
    let n = inputs.len();
    let elems = len / dtype.size();
    if elems == 0 {
        return Ok(());
    }
    match dtype {
        DType::F32 => run::<f32, f32>(out, inputs, elems, op, |x| x, |a| a, n),
        DType::F64 => run::<f64, f64>(out, inputs, elems, op, |x| x, |a| a, n),
        DType::BF16 => run::<bf16, f32>(out, inputs, elems, op, bf16::to_f32, bf16::from_f32, n),
        DType::F16 => run::<f16, f32>(out, inputs, elems, op, f16::to_f32, f16::from_f32, n),
        DType::I64 => run::<i64, i64>(out, inputs, elems, op, |x| x, |a| a, n),
        DType::I32 => run::<i32, i32>(out, inputs, elems, op, |x| x, |a| a, n),
        DType::U8 => run::<u8, u8>(out, inputs, elems, op, |x| x, |a| a, n),
        DType::Bool => {
            // Bytes are 0/1: or for sum/max, and for min.
            let op = if op == ReduceOp::Min {
                ReduceOp::Min
            } else {
                ReduceOp::Max
            };
            run::<u8, u8>(out, inputs, elems, op, |x| x, |a| a, n)
        }
    }
    Ok(())
}

/// Arithmetic the kernel needs from an accumulator type.
trait Acc: Copy {
    fn add(self, other: Self) -> Self;
    fn max(self, other: Self) -> Self;
    fn min(self, other: Self) -> Self;
    fn div_count(self, n: usize) -> Self;
}

macro_rules! float_acc {
    ($t:ty) => {
        impl Acc for $t {
            fn add(self, o: Self) -> Self {
                self + o
            }
            // NaN propagates, as torch.max does.
            fn max(self, o: Self) -> Self {
                if self.is_nan() || o.is_nan() {
                    <$t>::NAN
                } else if o > self {
                    o
                } else {
                    self
                }
            }
            fn min(self, o: Self) -> Self {
                if self.is_nan() || o.is_nan() {
                    <$t>::NAN
                } else if o < self {
                    o
                } else {
                    self
                }
            }
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
float_acc!(f32);
float_acc!(f64);

macro_rules! int_acc {
    ($t:ty) => {
        impl Acc for $t {
            // Integer sums wrap, as they do in libtorch and NCCL.
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            fn max(self, o: Self) -> Self {
                Ord::max(self, o)
            }
            fn min(self, o: Self) -> Self {
                Ord::min(self, o)
            }
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
int_acc!(i64);
int_acc!(i32);
int_acc!(u8);

#[allow(clippy::too_many_arguments)]
unsafe fn run<T: Copy, A: Acc>(
    out: *mut u8,
    inputs: &[*const u8],
    elems: usize,
    op: ReduceOp,
    widen: impl Fn(T) -> A + Copy,
    narrow: impl Fn(A) -> T + Copy,
    n: usize,
) {
    // One monomorphized loop per operator, so the combine inlines and the loop vectorizes.
    match op {
        ReduceOp::Sum => combine_all(out, inputs, elems, widen, narrow, A::add, None),
        ReduceOp::Avg => combine_all(out, inputs, elems, widen, narrow, A::add, Some(n)),
        ReduceOp::Max => combine_all(out, inputs, elems, widen, narrow, A::max, None),
        ReduceOp::Min => combine_all(out, inputs, elems, widen, narrow, A::min, None),
    }
}

/// `out[i] = combine(…combine(combine(in0[i], in1[i]), in2[i])…)`, block by block so `out`
/// may alias an input: a block of every input is read before that block of `out` is written.
unsafe fn combine_all<T: Copy, A: Acc>(
    out: *mut u8,
    inputs: &[*const u8],
    elems: usize,
    widen: impl Fn(T) -> A + Copy,
    narrow: impl Fn(A) -> T + Copy,
    combine: impl Fn(A, A) -> A + Copy,
    divide_by: Option<usize>,
) {
    let out = out as *mut T;
    let inputs: Vec<*const T> = inputs.iter().map(|p| *p as *const T).collect();
    let Some(first) = inputs.first() else { return };
    let mut acc: Vec<A> = Vec::with_capacity(BLOCK);
    let mut start = 0;
    while start < elems {
        let len = BLOCK.min(elems - start);
        acc.clear();
        // Unaligned reads: received buffers carry no alignment guarantee for T.
        acc.extend((0..len).map(|i| widen(first.add(start + i).read_unaligned())));
        for input in &inputs[1..] {
            let src = input.add(start);
            for (i, a) in acc.iter_mut().enumerate() {
                *a = combine(*a, widen(src.add(i).read_unaligned()));
            }
        }
        match divide_by {
            Some(n) => {
                for (i, a) in acc.iter().enumerate() {
                    out.add(start + i).write_unaligned(narrow(a.div_count(n)));
                }
            }
            None => {
                for (i, a) in acc.iter().enumerate() {
                    out.add(start + i).write_unaligned(narrow(*a));
                }
            }
        }
        start += len;
    }
}
