//! The CPU backend's message header. Every message carries the sender's view of the
//! operation (op, dtype, reduction, shape, sequence number), so a receiver detects a
//! mismatched collective at once and names both ranks instead of hanging or reading garbage.

use crate::comm::{DType, OpKind, ReduceOp};

/// Encoded header size in bytes.
pub const HEADER_LEN: usize = 96;
const MAGIC: u32 = 0x4C4B_4331; // "LKC1"
const MAX_DIMS: usize = 6;

/// Collective traffic and point-to-point traffic live in separate sequence spaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Channel {
    /// Collectives: sequenced per group, so every rank agrees on the order.
    Collective = 0,
    /// Sends and receives: sequenced per pair of ranks.
    PointToPoint = 1,
    /// A receiver's notice that it posted receive `seq` (no payload): what completes the
    /// matching send under [`PointToPoint::Rendezvous`](crate::comm::PointToPoint).
    Posted = 2,
}

/// What one message says about itself.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    /// Which sequence space `seq` counts in.
    pub channel: Channel,
    /// The operation the sender is in; a receiver in another op reports a mismatch.
    pub op: OpKind,
    /// The payload's element type (`None` for a barrier).
    pub dtype: Option<DType>,
    /// The reduction, for reducing collectives only.
    pub reduce: Option<ReduceOp>,
    /// Collective: the group's sequence number. Point-to-point: the per-pair counter.
    pub seq: u64,
    /// Collective: the algorithm's step. Point-to-point: the user's tag.
    pub tag: u64,
    /// The sender's tensor shape (first six dims) and its rank (ndim).
    pub shape: Vec<i64>,
    /// Element count the sender means this message to carry.
    pub elems: u64,
    /// Payload bytes that follow.
    pub payload: u64,
}

impl Header {
    /// Serializes into the fixed-size wire form.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.channel as u8;
        b[5] = self.op.code();
        b[6] = self.dtype.map_or(0xFF, DType::code);
        b[7] = self.reduce.map_or(0xFF, ReduceOp::code);
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.tag.to_le_bytes());
        b[24..32].copy_from_slice(&self.elems.to_le_bytes());
        b[32..40].copy_from_slice(&self.payload.to_le_bytes());
        b[40] = self.shape.len().min(255) as u8;
        for (i, d) in self.shape.iter().take(MAX_DIMS).enumerate() {
            b[48 + 8 * i..56 + 8 * i].copy_from_slice(&d.to_le_bytes());
        }
        b
    }

    /// Parses the wire form; `None` for bytes that are not a Lockstep header.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Option<Header> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        if u32::from_le_bytes([b[0], b[1], b[2], b[3]]) != MAGIC {
            return None;
        }
        let channel = match b[4] {
            0 => Channel::Collective,
            1 => Channel::PointToPoint,
            2 => Channel::Posted,
            _ => return None,
        };
        let ndim = b[40] as usize;
        let shape = (0..ndim.min(MAX_DIMS))
            .map(|i| u64_at(48 + 8 * i) as i64)
            .collect();
        Some(Header {
            channel,
            op: OpKind::from_code(b[5])?,
            dtype: DType::from_code(b[6]),
            reduce: ReduceOp::from_code(b[7]),
            seq: u64_at(8),
            tag: u64_at(16),
            elems: u64_at(24),
            payload: u64_at(32),
            shape,
        })
    }

    /// `op(reduce) dtype[shape]`, as errors print an operation.
    pub fn describe(&self) -> String {
        describe(self.op, self.reduce, self.dtype, &self.shape)
    }
}

/// Formats an operation the way mismatch errors name it.
pub fn describe(
    op: OpKind,
    reduce: Option<ReduceOp>,
    dtype: Option<DType>,
    shape: &[i64],
) -> String {
    let reduce = reduce.map(|r| format!("({r})")).unwrap_or_default();
    let dtype = dtype.map(|d| d.to_string()).unwrap_or_default();
    format!("{op}{reduce} on {dtype}{shape:?}")
}
