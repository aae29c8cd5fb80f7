//! Start-up settings for the CPU threads that share this machine's cores.
//!
//! candle's elementwise kernels run on its own barrier pool, whose worker spins 25,000
//! `pause`s (about half a millisecond here) after every op before it parks, and the
//! training step's large products run on rayon's pool right after such ops. On a 2-core
//! machine the spinning worker takes a core from the product: perf put it at 2.3% of a
//! 0.5B-shaped LoRA step's CPU time with the main thread's spin-wait for it another
//! 0.6%, against 0.9% of useful work. Our ops are large enough that parking sooner costs
//! nothing measurable.

/// candle's `CANDLE_BARRIER_POOL_SPIN_LIMIT` unless the user set one.
const SPIN_LIMIT: &str = "1000";

/// Applies the settings above; call once at start-up, before other threads exist and
/// before the first tensor op. An explicit `CANDLE_BARRIER_POOL_SPIN_LIMIT` wins.
pub fn share_cores_quietly() {
    const VAR: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
    if std::env::var_os(VAR).is_none() {
        // SAFETY: called at start-up while the process is single-threaded (see above), so
        // no other thread reads the environment concurrently.
        unsafe { std::env::set_var(VAR, SPIN_LIMIT) };
    }
}
