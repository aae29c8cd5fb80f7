//! Row-major matrix products through cuBLAS where candle's matmul falls short: a product
//! accumulated into an existing output (`beta = 1`, as PyTorch's `addmm`), so that a LoRA
//! projection's base product, bias and adapter land in one buffer with one rounding each
//! and no temporary; an exact f32 scale (`alpha`); and a half-precision product written
//! in f32 (the adapter's gradients, rounded once from f32 accumulators rather than from
//! the half dtype). Compute is f32 throughout (`CUBLAS_COMPUTE_32F`; no TF32).
//!
//! With every matrix row-major and contiguous, `C[m, n] = alpha · op(A) · op(B) + beta · C`
//! is cuBLAS's column-major `Cᵀ = op(B)ᵀ · op(A)ᵀ`: the operands swap places and each is
//! already its own transpose in memory, so no copy is made.

use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::cuda_backend::cudarc::cublas::{result, sys};
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use candle_core::{CudaDevice, CudaStorage, Layout, Result, bail};
use std::ffi::c_void;

/// Whether an operand enters the product as stored or transposed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Op {
    N,
    T,
}

/// A read-only operand: its storage, its (contiguous) layout and how it enters.
pub(crate) struct Operand<'a> {
    pub s: &'a CudaStorage,
    pub l: &'a Layout,
    pub op: Op,
}

fn data_type(s: &CudaStorageSlice) -> Result<sys::cudaDataType> {
    Ok(match s {
        CudaStorageSlice::F32(_) => sys::cudaDataType::CUDA_R_32F,
        CudaStorageSlice::BF16(_) => sys::cudaDataType::CUDA_R_16BF,
        CudaStorageSlice::F16(_) => sys::cudaDataType::CUDA_R_16F,
        _ => bail!("gemm: f32, bf16 or f16 only"),
    })
}

/// The device address of a contiguous operand's first element. The stream-ordering
/// record is dropped at once: every buffer here lives on the device's one stream, where
/// the product is ordered after every earlier write anyway.
fn address(s: &CudaStorage, l: &Layout, stream: &CudaStream) -> Result<u64> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("gemm: operands must be contiguous")
    };
    Ok(match &s.slice {
        CudaStorageSlice::F32(x) => x.slice(a..b).device_ptr(stream).0,
        CudaStorageSlice::BF16(x) => x.slice(a..b).device_ptr(stream).0,
        CudaStorageSlice::F16(x) => x.slice(a..b).device_ptr(stream).0,
        _ => bail!("gemm: f32, bf16 or f16 only"),
    })
}

fn address_mut(s: &mut CudaStorage, stream: &CudaStream) -> Result<u64> {
    Ok(match &mut s.slice {
        CudaStorageSlice::F32(x) => x.device_ptr_mut(stream).0,
        CudaStorageSlice::BF16(x) => x.device_ptr_mut(stream).0,
        CudaStorageSlice::F16(x) => x.device_ptr_mut(stream).0,
        _ => bail!("gemm: f32, bf16 or f16 only"),
    })
}

/// `c[m, n] = alpha · op(a)[m, k] · op(b)[k, n] + beta · c`, row-major; `c` is a whole,
/// contiguous buffer of `m · n` elements (any of the three dtypes; `a` and `b` share one).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    dev: &CudaDevice,
    a: Operand,
    b: Operand,
    c: &mut CudaStorage,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    beta: f32,
) -> Result<()> {
    if a.l.shape().elem_count() != m * k || b.l.shape().elem_count() != k * n {
        bail!(
            "gemm: operands {:?} and {:?} for {m}×{k}·{k}×{n}",
            a.l.dims(),
            b.l.dims()
        );
    }
    let ab_type = data_type(&a.s.slice)?;
    if data_type(&b.s.slice)? != ab_type {
        bail!("gemm: operands of two dtypes");
    }
    let c_type = data_type(&c.slice)?;
    let stream = dev.cuda_stream();
    let blas = dev.cublas_handle();
    let a_ptr = address(a.s, a.l, &stream)?;
    let b_ptr = address(b.s, b.l, &stream)?;
    let c_ptr = address_mut(c, &stream)?;
    let trans = |op: Op| match op {
        Op::N => sys::cublasOperation_t::CUBLAS_OP_N,
        Op::T => sys::cublasOperation_t::CUBLAS_OP_T,
    };
    // Column-major Cᵀ (n × m) = op(B)ᵀ (n × k) · op(A)ᵀ (k × m): B stored as [k, n] is
    // op(B)ᵀ in column-major with leading dimension n; stored as [n, k] (Op::T), its
    // transpose, leading dimension k; likewise A.
    let ldb = if b.op == Op::N { n } else { k };
    let lda = if a.op == Op::N { k } else { m };
    // SAFETY: the addresses are of live buffers of the sizes checked above, on the stream
    // the handle is bound to; alpha and beta are f32 as CUBLAS_COMPUTE_32F reads them.
    unsafe {
        result::gemm_ex(
            *blas.handle(),
            trans(b.op),
            trans(a.op),
            n as i32,
            m as i32,
            k as i32,
            (&alpha) as *const f32 as *const c_void,
            b_ptr as *const c_void,
            ab_type,
            ldb as i32,
            a_ptr as *const c_void,
            ab_type,
            lda as i32,
            (&beta) as *const f32 as *const c_void,
            c_ptr as *mut c_void,
            c_type,
            n as i32,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| candle_core::Error::Msg(format!("cublas gemm: {e:?}")))?;
    Ok(())
}
