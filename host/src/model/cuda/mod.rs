//! The fused ops on CUDA: attention (FlashAttention-2 on the tensor cores for half
//! precision, [`flash`]; else cuBLAS's products around one softmax pass a row, the backward
//! recomputing the scores instead of keeping them), a decode step's attention for the
//! whole batch ([`decode`], flash-decoding) and its draw ([`sample`]), the LoRA projection in half precision,
//! target log-probs without the full logits, RMSNorm, the rotary placement of heads and
//! SwiGLU, each with its own backward, and AdamW's update in place ([`adamw`], used by
//! `rl::optim`). One op per file,
//! beside its kernels (`<op>.cu`, compiled to PTX by `build.rs`); each must equal its
//! composed form in [`super::compute`], which stays the reference and the CPU path, and
//! each is tested against it on a GPU (`RLHOST_TEST_DEVICE=cuda`). The kernels take
//! tensors and plain numbers, never the decoder's types.
//!
//! Beside them, [`graph`] captures queued work as a CUDA graph and replays it (for
//! measuring whether graphs pay for the decode step).
//!
//! [`applies`] says where they run: a contiguous f32, bf16 or f16 tensor on a CUDA device,
//! unless the thread asked for the composed forms ([`super::cpu::composed`]).

pub mod adamw;
pub mod attention;
pub mod decode;
pub mod flash;
pub(crate) mod gemm;
pub mod graph;
pub mod host_copy;
pub mod logprobs;
pub mod lora;
pub mod rms_norm;
pub mod rope;
pub mod sample;
pub mod swiglu;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor, bail};
use std::sync::Arc;

/// Whether the fused CUDA ops may run on `x`.
pub fn applies(x: &Tensor) -> bool {
    x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && !super::cpu::composed_forced()
}

/// The PTX of one kernel file, as `build.rs` compiled it.
macro_rules! ptx {
    ($name:literal) => {
        include_str!(concat!(env!("OUT_DIR"), "/", $name, ".ptx"))
    };
}
pub(crate) use ptx;

/// A kernel file: its module name (candle caches loaded modules by it) and PTX.
#[derive(Clone, Copy)]
pub(crate) struct Module {
    pub name: &'static str,
    pub ptx: &'static str,
}

impl Module {
    /// The entry `<kernel>_<dtype>` of this module on `dev` (loaded once per device) and
    /// the device's stream to launch it on: `stream.launch_builder(&func)`.
    pub fn load(
        &self,
        dev: &CudaDevice,
        kernel: &str,
        dtype: DType,
    ) -> Result<(Arc<CudaStream>, CudaFunction)> {
        let suffix = match dtype {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            other => bail!("{kernel}: no CUDA kernel for {other:?}"),
        };
        let func =
            dev.get_or_load_custom_func(&format!("{kernel}_{suffix}"), self.name, self.ptx)?;
        Ok((dev.cuda_stream(), (*func).clone()))
    }
}

/// Runs `$body` with `$T` the Rust type of the storage dtype `$dtype` (f32, bf16, f16).
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $T = f32;
                $body
            }
            candle_core::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $T = half::f16;
                $body
            }
            other => candle_core::bail!("no fused CUDA op for {other:?}"),
        }
    };
}
pub(crate) use with_dtype;

/// The CUDA storage behind a storage guard.
pub(crate) fn cuda<'a>(s: &'a Storage, op: &str) -> Result<&'a CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => bail!("{op}: the tensor is not on a CUDA device"),
    }
}

/// The elements of a contiguous storage layout as a device view of `T`.
pub(crate) fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    op: &str,
) -> Result<CudaView<'a, T>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("{op}: input must be contiguous")
    };
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// Fresh device memory for `n` elements, to be written whole by a kernel.
pub(crate) fn alloc<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every caller's kernel writes all `n` elements before anything reads them.
    unsafe { dev.alloc::<T>(n.max(1)) }
}

/// A kernel's output as a storage.
pub(crate) fn storage<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(slice, dev.clone())
}

/// A kernel's output as a tensor with no gradient graph.
pub(crate) fn tensor<T: CudaDType>(
    slice: CudaSlice<T>,
    dev: &CudaDevice,
    shape: impl Into<Shape>,
) -> Tensor {
    Tensor::from_storage(
        Storage::Cuda(storage(slice, dev)),
        shape,
        BackpropOp::none(),
        false,
    )
}

/// One block of `threads` per row.
pub(crate) fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads for a row of `n` elements: a warp per 4 elements at first, 32 to 256.
pub(crate) fn row_threads(n: usize) -> u32 {
    (n.div_ceil(4).div_ceil(32) * 32).clamp(32, 256) as u32
}

/// A grid-stride launch over `n` elements.
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    const THREADS: usize = 256;
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS).clamp(1, 65_535 * 8) as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `f` over `x: [.., in_f]` as contiguous rows `[rows, in_f]`, its `[rows, out_f]` given
/// back in `x`'s leading dims.
pub(crate) fn over_rows(
    x: &Tensor,
    in_f: usize,
    out_f: usize,
    f: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let rows = x.elem_count() / in_f.max(1);
    let out = f(&x.reshape((rows, in_f))?.contiguous()?)?;
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("x has at least one dim") = out_f;
    out.reshape(dims)
}

/// The device of a CUDA storage.
pub(crate) fn device(s: &CudaStorage) -> &CudaDevice {
    s.device()
}

pub(crate) use candle_core::cuda_backend::cudarc::driver::PushKernelArg;

/// Launches `f` and maps its error to candle's.
pub(crate) fn launch(
    builder: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'_>,
    cfg: LaunchConfig,
) -> Result<()> {
    // SAFETY: each caller passes the arguments its kernel's signature names, in order,
    // with device buffers of the sizes the kernel indexes.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}

/// A forward result computed with tensor ops before its op was applied, handed to candle
/// as the op's output (a copy of its storage: candle takes the output by value).
pub(crate) fn precomputed(
    value: &std::sync::Mutex<Option<Tensor>>,
    op: &str,
) -> Result<(CudaStorage, Shape)> {
    let value = value
        .lock()
        .map_err(|_| candle_core::Error::Msg(format!("{op}: poisoned")))?
        .take();
    let Some(value) = value else {
        bail!("{op}: forward ran twice")
    };
    let (guard, layout) = value.storage_and_layout();
    let copy = cuda(&guard, op)?.try_clone(layout)?;
    Ok((copy, value.shape().clone()))
}

/// The backward of a three-input op whose forward ran as tensor ops before the op was
/// applied ([`apply_precomputed3`]): the attention forms.
pub(crate) trait Backward3: Send + Sync {
    /// The op's name in candle's graph and in its errors.
    const NAME: &'static str;

    /// The gradients of the three inputs from the output and its incoming gradient.
    fn backward(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)>;
}

/// `value`, computed from `a`, `b`, `c` with tensor ops, as the output of an op over them
/// whose backward is `backward`'s.
pub(crate) fn apply_precomputed3<B: Backward3 + 'static>(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    value: Tensor,
    backward: B,
) -> Result<Tensor> {
    a.apply_op3(
        b,
        c,
        Precomputed3 {
            value: std::sync::Mutex::new(Some(value)),
            backward,
        },
    )
}

struct Precomputed3<B> {
    /// The forward's result, handed over once.
    value: std::sync::Mutex<Option<Tensor>>,
    backward: B,
}

impl<B: Backward3> candle_core::CustomOp3 for Precomputed3<B> {
    fn name(&self) -> &'static str {
        B::NAME
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        bail!(
            "{}: CUDA only (the CPU takes the composed form or its own kernel)",
            B::NAME
        )
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        precomputed(&self.value, B::NAME)
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.backward.backward(a, b, c, out, grad)
    }
}
