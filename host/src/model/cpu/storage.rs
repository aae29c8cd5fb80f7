//! Reading candle's CPU storage: the custom ops' f32 inputs as slices, and a result
//! computed with ordinary tensor ops handed to candle as an op's output.

use candle_core::{CpuStorage, Device, Layout, Result, Shape, Tensor, bail};
use std::sync::Mutex;

/// A forward result computed with ordinary tensor ops before the op is applied, handed to
/// candle as the op's output (candle then records the op for the backward).
pub(crate) fn precomputed(value: &Mutex<Option<Tensor>>, op: &str) -> Result<(CpuStorage, Shape)> {
    let value = value
        .lock()
        .map_err(|_| candle_core::Error::Msg(format!("{op}: poisoned")))?
        .take();
    let Some(value) = value else {
        bail!("{op}: forward ran twice")
    };
    let shape = value.shape().clone();
    let data = value
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok((CpuStorage::F32(data), shape))
}

pub(crate) fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(data) = s else {
        bail!("{op}: f32 only")
    };
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("{op}: input must be contiguous")
    };
    Ok(&data[a..b])
}

/// Runs `f` on a CPU f32 tensor's elements (made contiguous first), without copying them
/// when they already are.
pub(crate) fn with_f32_data<R>(
    t: &candle_core::Tensor,
    f: impl FnOnce(&[f32]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    use candle_core::{CpuStorage, Storage};
    let t = t.contiguous()?;
    let (guard, layout) = t.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(data)), Some((a, b))) =
        (&*guard, layout.contiguous_offsets())
    else {
        candle_core::bail!("expected an f32 tensor on the CPU, got {:?}", t.dtype())
    };
    f(&data[a..b])
}
