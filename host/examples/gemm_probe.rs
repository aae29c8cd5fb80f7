//! Probe (not a test): GFLOPS of candle's CPU matmul and of ours (`model::gemm`) for each
//! product of a 0.5B-shaped LoRA training step (1024 tokens): forward `x W^T` (W read as a
//! strided view), backward `g W`, and the output head.
//! `RAYON_NUM_THREADS=2 cargo run --release -p rlhost --example gemm_probe`
use candle_core::{Device, Tensor};
use rlhost::model::gemm::{MatRef, gemm};
use std::time::Instant;

fn time(f: impl Fn() -> candle_core::Result<Tensor>) -> anyhow::Result<f64> {
    f()?;
    let t = Instant::now();
    for _ in 0..5 {
        f()?;
    }
    Ok(t.elapsed().as_secs_f64() / 5.0)
}

fn vec1(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

/// The fastest of seven runs into one preallocated C: the product alone, and the least
/// disturbed by other work on a shared machine.
fn time_ours(len: usize, f: impl Fn(&mut [f32])) -> f64 {
    let mut c = vec![0f32; len];
    (0..7)
        .map(|_| {
            let t = Instant::now();
            f(&mut c);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

fn main() -> anyhow::Result<()> {
    rlhost::model::alloc::keep_freed_memory();
    rlhost::model::threads::share_cores_quietly();
    let dev = Device::Cpu;
    let m = 1024usize;
    // (out, in) of q, k, o, gate, down, and a 52-row lm_head chunk.
    for (n, k) in [(896usize, 896usize), (128, 896), (4864, 896), (896, 4864)] {
        let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
        let g = Tensor::randn(0f32, 1., (m, n), &dev)?;
        let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
        let flops = 2.0 * (m * k * n) as f64;
        let fwd = time(|| x.matmul(&w.t()?))?;
        let bwd = time(|| g.matmul(&w))?;
        let (xv, gv, wv) = (vec1(&x)?, vec1(&g)?, vec1(&w)?);
        let ours_f = time_ours(m * n, |c| {
            gemm(
                MatRef::row_major(&xv, m, k),
                MatRef::row_major(&wv, n, k).t(),
                c,
                n,
                false,
            )
        });
        let ours_b = time_ours(m * k, |c| {
            gemm(
                MatRef::row_major(&gv, m, n),
                MatRef::row_major(&wv, n, k),
                c,
                k,
                false,
            )
        });
        println!(
            "  ours: fwd {:.0} GFLOPS, bwd {:.0} GFLOPS",
            flops / ours_f / 1e9,
            flops / ours_b / 1e9
        );
        println!(
            "[{m}x{k}] x [{n}x{k}]^T: fwd {:.1} ms {:.0} GFLOPS, bwd {:.1} ms {:.0} GFLOPS",
            fwd * 1e3,
            flops / fwd / 1e9,
            bwd * 1e3,
            flops / bwd / 1e9
        );
    }
    let (n, k) = (151936usize, 896usize);
    let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
    for rows in [52usize, 256, 1024] {
        let x = Tensor::randn(0f32, 1., (rows, k), &dev)?;
        let fwd = time(|| x.matmul(&w.t()?))?;
        let (xv, wv) = (vec1(&x)?, vec1(&w)?);
        let ours = time_ours(rows * n, |c| {
            gemm(
                MatRef::row_major(&xv, rows, k),
                MatRef::row_major(&wv, n, k).t(),
                c,
                n,
                false,
            )
        });
        println!(
            "  ours: {:.0} GFLOPS",
            2.0 * (rows * k * n) as f64 / ours / 1e9
        );
        println!(
            "lm_head {rows} rows: {:.1} ms {:.0} GFLOPS",
            fwd * 1e3,
            2.0 * (rows * k * n) as f64 / fwd / 1e9
        );
    }
    Ok(())
}
