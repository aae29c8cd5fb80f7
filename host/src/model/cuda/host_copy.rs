//! A small device tensor (a decode step's `[B, 3]` draws) copied to the host without
//! waiting for it: into page-locked memory, on the device's stream, so that work queued
//! after the copy (the next decode step's forward) runs on while the host waits for the
//! copy alone. A copy into ordinary memory, as `Tensor::to_vec2` makes, is synchronous:
//! queued after the next forward, it would wait for that forward too.
//!
//! Page-locked buffers are slow to allocate (a driver call that pins pages), so each
//! thread keeps the ones it has used for the next copies.

use super::cuda;
use candle_core::cuda_backend::WrapErr;
use candle_core::cuda_backend::cudarc::driver::PinnedHostSlice;
use candle_core::{DType, Result, Tensor, bail};
use std::cell::RefCell;

thread_local! {
    /// Page-locked buffers free for a copy, any length.
    static FREE: RefCell<Vec<PinnedHostSlice<f32>>> = const { RefCell::new(Vec::new()) };
}

/// A copy on its way to the host.
pub struct CopyInFlight {
    host: Option<PinnedHostSlice<f32>>,
    cols: usize,
    len: usize,
    /// The source, kept until the copy has been read.
    _source: Tensor,
}

/// Queues the copy of `t` (`[rows, cols]`, f32 on a CUDA device) to the host and returns
/// at once.
pub fn start(t: &Tensor) -> Result<CopyInFlight> {
    let t = t.to_dtype(DType::F32)?.contiguous()?;
    let (rows, cols) = t.dims2()?;
    let len = rows * cols;
    let mut host = match FREE.with(|f| {
        let mut free = f.borrow_mut();
        let at = free.iter().position(|h| h.len() >= len)?;
        Some(free.swap_remove(at))
    }) {
        Some(h) => h,
        None => {
            let (guard, _) = t.storage_and_layout();
            let ctx = super::device(cuda(&guard, "host copy")?)
                .cuda_stream()
                .context()
                .clone();
            // Plain page-locked memory (not write-combined, which the host reads slowly).
            // SAFETY: the copy below writes the first `len` elements before `wait` reads
            // them, and nothing reads past them.
            unsafe { ctx.alloc_pinned_with_flags::<f32>(len.max(64), 0) }.w()?
        }
    };
    {
        let (guard, layout) = t.storage_and_layout();
        let s = cuda(&guard, "host copy")?;
        let Some((a, b)) = layout.contiguous_offsets() else {
            bail!("host copy: the source must be contiguous")
        };
        let stream = super::device(s).cuda_stream();
        let src = s.as_cuda_slice::<f32>()?.slice(a..b);
        // Into the first `len` elements (the buffer may be longer); the buffer records
        // an event after the copy, which `wait` waits for.
        stream.memcpy_dtoh(&src, &mut host).w()?;
    }
    Ok(CopyInFlight {
        host: Some(host),
        cols,
        len,
        _source: t,
    })
}

impl CopyInFlight {
    /// Waits for the copy (not for anything queued after it) and returns its rows.
    pub fn wait(mut self) -> Result<Vec<Vec<f32>>> {
        let host = self.host.take().expect("taken once");
        let rows = {
            let data = host.as_slice().w()?;
            data[..self.len]
                .chunks(self.cols.max(1))
                .map(<[f32]>::to_vec)
                .collect()
        };
        FREE.with(|f| f.borrow_mut().push(host));
        Ok(rows)
    }
}
