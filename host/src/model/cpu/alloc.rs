//! Keeping freed tensor memory for reuse instead of returning it to the kernel.
//!
//! A training step allocates and frees gigabytes of short-lived tensors. glibc's default
//! malloc serves large blocks with fresh `mmap`s (and trims the heap back), so every new
//! tensor page-faults and the kernel zeroes it: on this 2-core VM that was 46% of a
//! 0.5B-shaped LoRA step (perf), forward 26 s → 8.4 s once memory is reused (measured with
//! the equivalent `GLIBC_TUNABLES`). Blocks up to the 32 MiB threshold then come from the
//! heap, which is never trimmed; the log-prob op keeps its vocabulary-sized chunks under
//! that size for the same reason ([`crate::model::decoder::logprob_chunk_rows`]).

/// The largest block glibc will serve from its heap rather than `mmap` (its maximum).
pub const HEAP_BLOCK_LIMIT: usize = 32 << 20;

/// Tunes glibc malloc as above; call once at start-up. A no-op elsewhere.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; it is called before the
    // process has threads that allocate concurrently (and is thread-safe regardless).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, HEAP_BLOCK_LIMIT as libc::c_int);
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
    }
}

/// Hands the heap's free pages back to the kernel (glibc's `malloc_trim`). For memory freed
/// once and not needed again, such as the f32 weights a model quantized on load: under
/// [`keep_freed_memory`] they would otherwise stay resident. A no-op elsewhere.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns unused pages of the allocator's arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A zeroed f32 buffer, filled by all threads when large. glibc's `calloc` on reused heap
/// memory is a `memset` on the calling thread, and for the training step's 4–20 MB
/// outputs the other core waited for it (2% of a 0.5B-shaped step, perf).
pub fn zeroed(len: usize) -> Vec<f32> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    if len < 4 * CHUNK {
        return vec![0f32; len];
    }
    let mut v = Vec::with_capacity(len);
    v.spare_capacity_mut()[..len]
        .par_chunks_mut(CHUNK)
        .for_each(|c| c.fill(std::mem::MaybeUninit::new(0.0)));
    // SAFETY: the first `len` elements were just initialised.
    unsafe { v.set_len(len) };
    v
}
