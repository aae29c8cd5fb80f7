//! The clocks a plugin reads: virtual, one per instance, so that its time is as
//! reproducible as its random numbers.
//!
//! WASI's own clocks read the machine's: a plugin that prints `time.time()` or measures a
//! loop would answer differently in every run, and a session forked by replaying its
//! calls (issue 67) would see other times than the one it was forked from. Here both
//! clocks read one counter that starts at 0 when the instance is made and moves on by
//! [`STEP`] at every reading, wall or monotonic. The wall clock adds [`WALL_ORIGIN`]. So two
//! instances that make the same calls read the same times, and time still always moves
//! forward, which is all that code measuring itself relies on.
//!
//! What it does not follow is real time: a plugin sleeping one second sleeps for real, but
//! its next reading is one step on, not one second. A deadline loop (`while now() < t:`)
//! ends after a fixed count of readings instead of a fixed time; at 1 µs a reading, a
//! one-second budget is a million readings, more than any call's deadline lets a plugin
//! make. The time per call is still capped by the wall-clock deadline the host keeps
//! (`timeout_ms`), which these clocks do not touch.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use wasmtime_wasi::{HostMonotonicClock, HostWallClock};

/// How far the clocks move at each reading.
pub const STEP: Duration = Duration::from_micros(1);

/// What the wall clock reads at an instance's start: 2026-01-01 00:00:00 UTC, in seconds
/// since the Unix epoch.
pub const WALL_ORIGIN: Duration = Duration::from_secs(1_767_225_600);

/// One instance's time: nanoseconds since it was made, advanced by every reading.
#[derive(Clone, Default)]
pub struct VirtualTime(Arc<AtomicU64>);

impl VirtualTime {
    /// Moves time on one step and returns the new reading.
    fn tick(&self) -> u64 {
        let step = STEP.as_nanos() as u64;
        self.0.fetch_add(step, Ordering::Relaxed) + step
    }

    /// Nanoseconds read so far (what a copy of the instance must start from).
    pub fn elapsed(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// The wall clock over this time.
    pub fn wall(&self) -> WallClock {
        WallClock(self.clone())
    }

    /// The monotonic clock over this time.
    pub fn monotonic(&self) -> MonotonicClock {
        MonotonicClock(self.clone())
    }
}

/// `wasi:clocks/wall-clock` over a [`VirtualTime`].
pub struct WallClock(VirtualTime);

impl HostWallClock for WallClock {
    fn resolution(&self) -> Duration {
        STEP
    }

    fn now(&self) -> Duration {
        WALL_ORIGIN + Duration::from_nanos(self.0.tick())
    }
}

/// `wasi:clocks/monotonic-clock` over a [`VirtualTime`].
pub struct MonotonicClock(VirtualTime);

impl HostMonotonicClock for MonotonicClock {
    fn resolution(&self) -> u64 {
        STEP.as_nanos() as u64
    }

    fn now(&self) -> u64 {
        self.0.tick()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_clocks_move_one_step_a_reading_on_one_counter() {
        let time = VirtualTime::default();
        let (wall, mono) = (time.wall(), time.monotonic());
        assert_eq!(mono.now(), 1_000);
        assert_eq!(wall.now(), WALL_ORIGIN + Duration::from_nanos(2_000));
        assert_eq!(mono.now(), 3_000);
        assert_eq!(time.elapsed(), 3_000);
        // Resolutions are not readings.
        assert_eq!(mono.resolution(), 1_000);
        assert_eq!(wall.resolution(), STEP);
        assert_eq!(time.elapsed(), 3_000);
    }

    #[test]
    fn two_instances_read_the_same_times() {
        let (a, b) = (VirtualTime::default(), VirtualTime::default());
        let read = |t: &VirtualTime| (0..5).map(|_| t.monotonic().now()).collect::<Vec<_>>();
        assert_eq!(read(&a), read(&b));
    }

    #[test]
    fn the_wall_origin_is_2026() {
        // 56 years of 365 days and 14 leap days (1972 to 2024) after 1970-01-01.
        assert_eq!(WALL_ORIGIN.as_secs(), (56 * 365 + 14) * 86_400);
    }
}
