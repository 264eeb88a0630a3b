//! Element types and reduction operators shared by every backend.

use crate::comm::CommError;
use tch::Kind;

/// Element types a collective accepts. Mirrors the `tch::Kind`s training code uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// `Kind::Float`, 32-bit IEEE float: the usual parameter and gradient type.
    F32,
    /// `Kind::Double`, 64-bit IEEE float.
    F64,
    /// `Kind::BFloat16`: the CPU backend accumulates in f32 and rounds once.
    BF16,
    /// `Kind::Half`, IEEE binary16: the CPU backend accumulates in f32 and rounds once.
    F16,
    /// `Kind::Int64`: indices, token ids and counters.
    I64,
    /// `Kind::Int`, 32-bit signed integer.
    I32,
    /// `Kind::Uint8`, one byte per element.
    U8,
    /// `Kind::Bool`, one byte per element; reductions are logical (see [`ReduceOp`]).
    Bool,
}

impl DType {
    /// The collective dtype for a tensor kind, or an error naming the unsupported kind.
    pub fn from_kind(kind: Kind) -> Result<Self, CommError> {
        Ok(match kind {
            Kind::Float => DType::F32,
            Kind::Double => DType::F64,
            Kind::BFloat16 => DType::BF16,
            Kind::Half => DType::F16,
            Kind::Int64 => DType::I64,
            Kind::Int => DType::I32,
            Kind::Uint8 => DType::U8,
            Kind::Bool => DType::Bool,
            other => {
                return Err(CommError::InvalidArgument(format!(
                    "dtype {other:?} is not supported by collectives"
                )))
            }
        })
    }

    /// The tensor kind holding this dtype.
    pub fn kind(self) -> Kind {
        match self {
            DType::F32 => Kind::Float,
            DType::F64 => Kind::Double,
            DType::BF16 => Kind::BFloat16,
            DType::F16 => Kind::Half,
            DType::I64 => Kind::Int64,
            DType::I32 => Kind::Int,
            DType::U8 => Kind::Uint8,
            DType::Bool => Kind::Bool,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 | DType::Bool => 1,
        }
    }

    /// Whether the dtype is a floating-point type (the only ones `Avg` accepts).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }

    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        [
            DType::F32,
            DType::F64,
            DType::BF16,
            DType::F16,
            DType::I64,
            DType::I32,
            DType::U8,
            DType::Bool,
        ]
        .get(code as usize)
        .copied()
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::U8 => "u8",
            DType::Bool => "bool",
        };
        f.write_str(name)
    }
}

/// How a reduction combines the ranks' values.
///
/// `Avg` is the rank-order sum divided by the group size once at the end (floating dtypes
/// only). For `Bool`, `Sum` and `Max` are logical or and `Min` is logical and, as in PyTorch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    /// Element-wise sum (the CPU backend adds in increasing rank order, so runs are bitwise
    /// reproducible).
    Sum,
    /// The rank-order sum divided once by the group size (floating dtypes only).
    Avg,
    /// Element-wise maximum (logical or for `Bool`).
    Max,
    /// Element-wise minimum (logical and for `Bool`).
    Min,
}

impl ReduceOp {
    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min]
            .get(code as usize)
            .copied()
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        };
        f.write_str(name)
    }
}

/// The collectives and point-to-point operations, as named in errors and flight records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum OpKind {
    /// Every rank ends with the reduction of every rank's tensor.
    AllReduce,
    /// Every rank ends with every rank's tensor, concatenated in rank order.
    AllGather,
    /// Reduce, then each rank keeps its own shard of the result.
    ReduceScatter,
    /// One root rank's tensor copied to every rank.
    Broadcast,
    /// Each rank sends a distinct chunk to every other rank.
    AllToAll,
    /// No data: returns once every rank has entered.
    Barrier,
    /// Point-to-point send to one peer.
    Send,
    /// Point-to-point receive from one peer.
    Recv,
}

impl OpKind {
    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        use OpKind::*;
        [
            AllReduce,
            AllGather,
            ReduceScatter,
            Broadcast,
            AllToAll,
            Barrier,
            Send,
            Recv,
        ]
        .get(code as usize)
        .copied()
    }
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Broadcast => "broadcast",
            OpKind::AllToAll => "all_to_all",
            OpKind::Barrier => "barrier",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
        };
        f.write_str(name)
    }
}
