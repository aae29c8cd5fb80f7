//! How the CPU threads share this machine's cores: start-up settings, and parallelism
//! sized to the work.
//!
//! Three costs measured on the 2-core VM with `rlhost rollout` on the built-in multiply
//! model (hidden 128, 1,600 trajectories; issue 33), where the arithmetic is small enough
//! that overhead is all there is:
//! - **A thread count read from `/proc/cpuinfo` on every product.** candle's
//!   `get_num_threads`, which its CPU matmul calls each time, parses `/proc/cpuinfo`
//!   (`num_cpus::get_physical`) unless `RAYON_NUM_THREADS` is set: 416,000 `openat`s in a
//!   20 s run, a quarter of all CPU time in the kernel's `show_cpuinfo`. [`share_cores_quietly`]
//!   asks once and sets the variable (the same count for rayon's pool): 1,340 → 7,100
//!   sampled tokens/s.
//! - **Two threads woken for every small op.** Each product, norm and softmax of a
//!   128-wide model handed work to rayon's pool from the decoding thread: a futex wake, a
//!   futex wait for the answer, and the idle worker's `sched_yield` spin after it, for
//!   ~0.1 ms of arithmetic. System time was still 57% of CPU time. [`sized`] runs a
//!   forward whose products are this small on the calling thread alone.
//! - **candle's barrier pool spinning.** Its elementwise kernels run on their own pool,
//!   whose worker spins 25,000 `pause`s (about half a millisecond here) after every op
//!   before it parks; on two cores the spinning worker takes a core from the next
//!   product: perf put it at 2.3% of a 0.5B-shaped LoRA step's CPU time with the main
//!   thread's spin-wait for it another 0.6%, against 0.9% of useful work. Our ops are
//!   large enough that parking sooner costs nothing measurable.

use std::cell::OnceCell;
use std::sync::OnceLock;

/// candle's `CANDLE_BARRIER_POOL_SPIN_LIMIT` unless the user set one.
const SPIN_LIMIT: &str = "1000";

/// The multiply-adds of one product below which splitting it across threads costs more
/// than it saves. A wake-up and the wait for the other thread's half cost 20–50 µs on
/// the 2-core VM; a product of 4 M multiply-adds takes ~0.4 ms on one core there. Measured
/// on the built-in model's decode (64 × 128 × 128 = 1 M per projection): one thread
/// gave 7,100 → 12,000 sampled tokens/s and system time 57% → 2% of CPU time. The
/// 0.5B-shaped decode (rows × 896 × 896 ≥ 0.8 M per row, bandwidth-bound on one core)
/// stays above it from one row on only for the larger projections, so it is judged by
/// the whole layer, not by one product: see [`sized`].
const MIN_PARALLEL_MACS: u64 = 4 << 20;

/// Applies the settings above; call once at start-up, before other threads exist and
/// before the first tensor op. Values the user set win.
pub fn share_cores_quietly() {
    const SPIN: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
    const THREADS: &str = "RAYON_NUM_THREADS";
    if std::env::var_os(SPIN).is_none() {
        // SAFETY: called at start-up while the process is single-threaded (see above), so
        // no other thread reads the environment concurrently.
        unsafe { std::env::set_var(SPIN, SPIN_LIMIT) };
    }
    if std::env::var_os(THREADS).is_none() {
        // candle's own count (physical cores, or the affinity mask), asked once.
        let n = candle_core::utils::get_num_threads().max(1);
        // SAFETY: as above.
        unsafe { std::env::set_var(THREADS, n.to_string()) };
    }
}

thread_local! {
    /// A one-thread rayon pool made of this very thread, once it has run small work: work
    /// inside its `install` that asks rayon for parallelism (our kernels, candle's products
    /// and norms) runs here, with no other thread woken. rayon keeps the thread in that
    /// pool for good, so large work on it goes to [`wide`] instead.
    static ALONE: OnceCell<Option<rayon::ThreadPool>> = const { OnceCell::new() };
}

/// The pool large work runs on: as many threads as rayon's global pool would have (the
/// `RAYON_NUM_THREADS` set above). It is the only pool that computes in parallel; rayon's
/// implicit global pool starts only if something outside [`sized`] asks it for work.
fn wide() -> Option<&'static rayon::ThreadPool> {
    static WIDE: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    WIDE.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("rlhost-compute-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Runs `f`, whose largest product is `macs` multiply-adds, on the calling thread alone
/// when that is too small to be worth splitting (see [`MIN_PARALLEL_MACS`]), and on the
/// compute pool otherwise. Results are the same either way up to the order of float sums
/// within a product. Nested calls run where they are.
pub fn sized<R: Send>(macs: u64, f: impl FnOnce() -> R + Send) -> R {
    let wide = wide();
    if wide.is_some_and(|w| w.current_thread_index().is_some()) {
        return f();
    }
    let alone = ALONE.with(|cell| cell.get().is_some_and(Option::is_some));
    if macs >= MIN_PARALLEL_MACS {
        return match wide {
            Some(w) => w.install(f),
            None => f(),
        };
    }
    if !alone && rayon::current_thread_index().is_some() {
        // A worker of some other pool (rayon's global one): it cannot join a new pool.
        return f();
    }
    ALONE.with(|cell| {
        let pool = cell.get_or_init(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .use_current_thread()
                .build()
                .ok()
        });
        match pool {
            Some(pool) => pool.install(f),
            None => f(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    /// Small work runs on the caller's thread: rayon sees one thread and this thread is
    /// its worker; large work sees the global pool.
    #[test]
    fn small_work_stays_on_the_calling_thread() {
        let me = std::thread::current().id();
        let (threads, ids) = sized(1, || {
            let ids: Vec<_> = (0..64)
                .into_par_iter()
                .map(|_| std::thread::current().id())
                .collect();
            (rayon::current_num_threads(), ids)
        });
        assert_eq!(threads, 1);
        assert!(ids.iter().all(|&id| id == me));
        // Large work on the same thread (now a one-thread pool's) still gets every core.
        let large = sized(MIN_PARALLEL_MACS, || {
            (
                rayon::current_num_threads(),
                std::thread::current().id(),
                sized(1, rayon::current_num_threads),
            )
        });
        assert_eq!(large.0, wide().unwrap().current_num_threads());
        assert_ne!(large.1, me);
        // Small work nested inside large work runs where it is.
        assert_eq!(large.2, large.0);
        // Back on this thread, small work is still alone.
        assert_eq!(sized(1, rayon::current_num_threads), 1);
    }
}
