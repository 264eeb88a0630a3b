//! Delay injection for determinism tests: with a maximum delay set, every message send waits
//! a random time first, shuffling the timing of every collective. Results must not change.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

static MAX_DELAY_MICROS: AtomicU64 = AtomicU64::new(0);

/// Makes every later send in this process wait a random time up to `max` (zero: off).
pub fn set_max_delay(max: Duration) {
    MAX_DELAY_MICROS.store(max.as_micros() as u64, Ordering::Relaxed);
}

pub(crate) fn maybe_delay() {
    let max = MAX_DELAY_MICROS.load(Ordering::Relaxed);
    if max > 0 {
        let micros = rand::random_range(0..=max);
        std::thread::sleep(Duration::from_micros(micros));
    }
}
