//! Recycled receive buffers: large messages reuse earlier allocations instead of paying for
//! fresh pages (and their page faults) on every collective.

use crate::comm::work::lock;
use std::sync::Mutex;

const KEEP: usize = 32;

static POOL: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// A buffer of exactly `len` bytes (contents unspecified).
pub fn take(len: usize) -> Vec<u8> {
    if len >= 4096 {
        let mut pool = lock(&POOL);
        if let Some(i) = pool
            .iter()
            .position(|b| b.capacity() >= len && b.capacity() <= 2 * len)
        {
            let mut buf = pool.swap_remove(i);
            // SAFETY-free resize: shrinking or growing within capacity; new bytes are zeroed.
            buf.resize(len, 0);
            return buf;
        }
    }
    vec![0u8; len]
}

/// Returns a buffer for reuse.
pub fn give(buf: Vec<u8>) {
    if buf.capacity() >= 4096 {
        let mut pool = lock(&POOL);
        if pool.len() < KEEP {
            pool.push(buf);
        }
    }
}
