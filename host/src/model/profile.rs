//! Opt-in timing of the compute seam's entry points, for finding where a device spends
//! its time without a profiler (the GPU machines here have no nsys): with
//! `RLHOST_PROFILE=1` each timed call waits for the device before and after itself and
//! adds its wall time to a per-name total; [`report`] prints the table. Off (the default)
//! a span costs one relaxed load.
//!
//! The waits serialise the device, so the totals say where time goes, not how fast the
//! unprofiled run is; spans nest (a projection's time includes its product), so the
//! table's rows overlap.

use candle_core::Device;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

/// 0: not read yet, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);
static TOTALS: Mutex<BTreeMap<&'static str, (u64, Duration)>> = Mutex::new(BTreeMap::new());

/// Whether `RLHOST_PROFILE` asks for timings (read once).
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("RLHOST_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0");
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        s => s == 2,
    }
}

/// One timed call: started by [`span`], recorded when dropped.
pub struct Span {
    name: &'static str,
    start: Option<(Instant, Device)>,
}

/// Starts timing `name` on `device` (a no-op unless [`enabled`]).
pub fn span(name: &'static str, device: &Device) -> Span {
    if !enabled() {
        return Span { name, start: None };
    }
    // A failed wait only blurs the timing; the computation reports its own errors.
    let _ = device.synchronize();
    Span {
        name,
        start: Some((Instant::now(), device.clone())),
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((start, device)) = self.start.take() {
            let _ = device.synchronize();
            let took = start.elapsed();
            let mut totals = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
            let entry = totals.entry(self.name).or_default();
            entry.0 += 1;
            entry.1 += took;
        }
    }
}

/// The totals so far, one line per name, the largest first (`None` when profiling is off
/// or nothing was timed).
pub fn report() -> Option<String> {
    if !enabled() {
        return None;
    }
    let totals = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
    if totals.is_empty() {
        return None;
    }
    let mut rows: Vec<_> = totals.iter().collect();
    rows.sort_by_key(|row| std::cmp::Reverse(row.1.1));
    let mut out = format!(
        "{:<24} {:>10} {:>12} {:>10}\n",
        "entry point", "calls", "total s", "mean µs"
    );
    for (name, (calls, total)) in rows {
        out.push_str(&format!(
            "{name:<24} {calls:>10} {:>12.3} {:>10.1}\n",
            total.as_secs_f64(),
            total.as_secs_f64() * 1e6 / *calls as f64
        ));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_cost_nothing_and_record_nothing_when_off() {
        // The test process never sets RLHOST_PROFILE.
        if enabled() {
            return;
        }
        drop(span("off", &Device::Cpu));
        assert!(report().is_none());
        assert!(TOTALS.lock().unwrap().is_empty());
    }
}
