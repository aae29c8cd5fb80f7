//! A CUDA graph of work the host has queued once already: captured on the device's
//! stream and replayed with one launch, without the host's work between the kernels
//! (shapes, candle's op dispatch, a launch call each). Issue 64 item 4 keeps graphs for
//! the decode step only if they pay; `model_bench graph` measures that with this module
//! (one decode step replayed against the same step run eagerly), and the test below
//! holds a replay to the eager step's logits.
//!
//! What capture needs, and how it is met here:
//! - **No host copies while capturing.** Candle uploads each op's dims and strides, and
//!   each small tensor made from host data, with a copy from pageable memory. Under
//!   [`UploadCache`] those uploads (up to 4 KiB) are kept on the device, keyed by their
//!   bytes: a call run eagerly first fills the cache, and the same call captured reads it.
//!   A capture whose call uploads anything the eager run did not fails with candle's
//!   error naming the miss, and ends the capture.
//! - **Memory taken inside the graph is given back inside it.** Allocations go through
//!   the stream's pool (`cuMemAllocAsync`), so they become the graph's own; every tensor
//!   the captured call makes must be dropped before [`capture`] returns, and results
//!   copied into tensors made before it ([`Tensor::slice_set`]).
//! - **Fixed addresses.** A replay reads and writes the buffers the capture saw: the
//!   inputs must be rewritten in place between replays, never replaced.

use candle_core::cuda_backend::WrapErr;
use candle_core::cuda_backend::cudarc::driver::{CudaGraph, sys};
use candle_core::{Device, Result, bail};

/// Candle's upload cache, on for this thread while this lives (see the module's header).
/// Its guard's type is not exported by candle, so it is held as `Any`; dropping it turns
/// the cache off.
#[must_use]
pub struct UploadCache {
    _guard: Box<dyn std::any::Any>,
}

/// Turns on candle's upload cache on this thread for `device`, a CUDA device.
pub fn upload_cache(device: &Device) -> Result<UploadCache> {
    match device {
        Device::Cuda(d) => Ok(UploadCache {
            _guard: Box::new(d.enable_cuda_graph_htod_cache()),
        }),
        _ => bail!("CUDA graphs need a CUDA device, not {device:?}"),
    }
}

/// A captured graph, replayed on the stream it was captured on.
pub struct StepGraph {
    graph: CudaGraph,
}

/// Captures the work `f` queues on `device`'s stream into a graph (nothing runs while
/// capturing). Call it under [`upload_cache`], after running the same `f` once eagerly.
/// The capture always ends, also when `f` fails; `f`'s error comes first.
pub fn capture(device: &Device, f: impl FnOnce() -> Result<()>) -> Result<StepGraph> {
    let Device::Cuda(d) = device else {
        bail!("CUDA graphs need a CUDA device, not {device:?}")
    };
    let stream = d.cuda_stream();
    // Relaxed: this thread's other driver calls (an event made for a new buffer, a
    // module loaded) are allowed while capturing; the stream's own work is what is kept.
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .w()?;
    let ran = f();
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    ran?;
    match ended.w()? {
        Some(graph) => Ok(StepGraph { graph }),
        None => bail!("the captured work queued nothing on the device"),
    }
}

impl StepGraph {
    /// Queues one replay; returns at once.
    pub fn replay(&self) -> Result<()> {
        self.graph.launch().w()
    }

    /// Readies the graph on the device, so that the first replay is timed as the others.
    pub fn upload(&self) -> Result<()> {
        self.graph.upload().w()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{KvCache, Mode, fixtures};
    use candle_core::{DType, Tensor};

    /// A decode step of the fixture's pooled sequences, captured and replayed twice,
    /// gives the eager step's logits to the bit (the same kernels on the same inputs).
    /// Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn a_replayed_decode_step_gives_the_eager_steps_logits() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        let model = fixtures::load("qwen2");
        let prompts = fixtures::Reference::load("qwen2").rows();
        let mut caches: Vec<KvCache> = prompts.iter().map(|_| model.new_cache()).collect();
        {
            let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
            let toks: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
            model
                .forward_cached(&mut refs, &toks, Mode::INFERENCE, false)
                .unwrap();
            // One eager decode step, so that the caches sit in a pool.
            let ones: Vec<&[u32]> = prompts.iter().map(|_| &[7u32][..]).collect();
            model
                .forward_cached(&mut refs, &ones, Mode::INFERENCE, false)
                .unwrap();
        }
        let n = caches.len();
        let ids = Tensor::from_vec((0..n as u32).map(|i| 11 + i).collect(), n, &dev).unwrap();
        let step = |caches: &mut [KvCache]| {
            let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
            model.forward_cached_ids(&mut refs, &ids, Mode::INFERENCE)
        };
        let forget = |caches: &mut [KvCache]| {
            for c in caches.iter_mut() {
                c.forget_last().unwrap();
            }
        };
        let _cache = upload_cache(&dev).unwrap();
        let eager = step(&mut caches).unwrap().to_dtype(DType::F32).unwrap();
        forget(&mut caches);
        let out = eager.zeros_like().unwrap();
        let graph = capture(&dev, || {
            let logits = step(&mut caches)?;
            out.slice_set(&logits.to_dtype(DType::F32)?, 0, 0)
        })
        .unwrap();
        forget(&mut caches);
        graph.upload().unwrap();
        for _ in 0..2 {
            // Cleared in place between replays: each replay writes the logits anew.
            out.slice_set(&out.zeros_like().unwrap(), 0, 0).unwrap();
            graph.replay().unwrap();
            assert!(
                out.to_vec2::<f32>().unwrap() == eager.to_vec2::<f32>().unwrap(),
                "replayed logits off by up to {}",
                fixtures::max_diff(&out, &eager)
            );
        }
    }
}
