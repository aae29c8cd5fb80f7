//! The hand-tuned CPU kernels: blocked f32 GEMM and a streaming GEMV, the fused training
//! ops with their own backward (RMSNorm, SwiGLU, RoPE placement, attention), the chunked
//! log-prob head, the fused LoRA projection and LoRA MLP, the AVX2 row kernels, and the
//! allocator and thread settings they rely on. [`super::compute`] picks them where
//! [`applies`] says they may run (f32 on a CPU with AVX2 and FMA); the decoder reaches
//! them only through it.

pub mod alloc;
// AVX2/FMA kernels for the training step; elsewhere the composed forms do the work.
#[cfg(target_arch = "x86_64")]
pub mod attention;
#[cfg(target_arch = "x86_64")]
pub mod frozen;
pub mod fused;
#[cfg(target_arch = "x86_64")]
pub mod gemm;
pub mod gemv;
#[cfg(target_arch = "x86_64")]
pub mod head;
#[cfg(target_arch = "x86_64")]
pub mod lora_op;
#[cfg(target_arch = "x86_64")]
pub mod mlp_op;
pub mod simd;
pub mod storage;
pub mod threads;

use candle_core::{DType, Tensor};
use std::cell::Cell;

thread_local! {
    static COMPOSED: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with the kernels standing aside on this thread: every entry point of
/// [`super::compute`] takes its composed form (tests compare the two with it).
pub fn composed<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            COMPOSED.set(self.0);
        }
    }
    let _restore = Restore(COMPOSED.replace(true));
    f()
}

/// Whether this thread asked for the composed forms ([`composed`]).
pub fn composed_forced() -> bool {
    COMPOSED.get()
}

/// Whether the CPU kernels may run on `x`: f32 on the CPU with AVX2 and FMA, unless this
/// thread asked for the composed forms ([`composed`]).
pub fn applies(x: &Tensor) -> bool {
    !COMPOSED.get() && x.device().is_cpu() && x.dtype() == DType::F32 && gemv::available()
}
