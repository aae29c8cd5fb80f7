//! Probe (not a test): GFLOPS of candle's CPU matmul for a training-sized product
//! (1024 x 896 x 4864, Qwen2.5-0.5B's MLP), to compare with PyTorch on the same machine.
//! `RAYON_NUM_THREADS=2 cargo run --release -p rlhost --example gemm_probe`
use candle_core::{Device, Tensor};
use std::time::Instant;
fn main() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (m, k, n) = (1024usize, 896usize, 4864usize);
    let a = Tensor::randn(0f32, 1., (m, k), &dev)?;
    let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
    let wt = w.t()?.contiguous()?;
    for (name, rhs) in [("w.t() view", w.t()?), ("contiguous [k, n]", wt)] {
        a.matmul(&rhs)?;
        let t = Instant::now();
        for _ in 0..5 {
            a.matmul(&rhs)?;
        }
        let dt = t.elapsed().as_secs_f64() / 5.0;
        println!(
            "{name}: {:.1} ms, {:.1} GFLOPS",
            dt * 1e3,
            2.0 * (m * k * n) as f64 / dt / 1e9
        );
        // The same product with an elementwise op (candle's barrier pool) before each.
        let t = Instant::now();
        for _ in 0..5 {
            let b = (&a * 1.5)?;
            b.matmul(&rhs)?;
        }
        let dt = t.elapsed().as_secs_f64() / 5.0;
        println!("  after an elementwise op each time: {:.1} ms", dt * 1e3);
    }
    Ok(())
}
