//! Probe (not a test): `x @ W^T` for decode-sized `x` (1 and 8 rows) on the weight shapes
//! of Qwen2.5-0.5B, through candle's gemm in three layouts and a plain rayon loop, with the
//! achieved weight-read bandwidth. The numbers that motivated `model/gemv.rs`.
//!
//! `RAYON_NUM_THREADS=2 cargo run --release -p rlhost --example gemv_probe`

use candle_core::{DType, Device, Tensor};
use std::time::Instant;
fn main() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for (k, n) in [(896usize, 4864usize), (4864, 896), (896, 151936)] {
        let w = Tensor::randn(0f32, 1., (n, k), &dev)?; // [out, in]
        let wt_c = w.t()?.contiguous()?; // [in, out]
        for m in [1usize, 8] {
            let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
            let bytes = (n * k * 4) as f64;
            let time = |f: &dyn Fn() -> Tensor| {
                f();
                let t = Instant::now();
                for _ in 0..20 {
                    f();
                }
                t.elapsed().as_secs_f64() / 20.0
            };
            let a = time(&|| x.matmul(&w.t().unwrap()).unwrap());
            let b = time(&|| x.matmul(&wt_c).unwrap());
            // hand gemv: each output a dot over a contiguous row of w
            let wv = w.flatten_all()?.to_vec1::<f32>()?;
            let xv = x.flatten_all()?.to_vec1::<f32>()?;
            let (wv, xv) = (&wv, &xv);
            let c = time(&|| {
                use rayon::prelude::*;
                let out: Vec<f32> = (0..n)
                    .into_par_iter()
                    .flat_map_iter(|j| {
                        let row = &wv[j * k..(j + 1) * k];
                        (0..m).map(move |i| {
                            let xr = &xv[i * k..(i + 1) * k];
                            let mut acc = [0f32; 8];
                            for (a, b) in row.chunks_exact(8).zip(xr.chunks_exact(8)) {
                                for t in 0..8 {
                                    acc[t] += a[t] * b[t];
                                }
                            }
                            acc.iter().sum::<f32>()
                        })
                    })
                    .collect();
                Tensor::from_vec(out, (n, m), &Device::Cpu).unwrap()
            });
            let d = time(&|| {
                w.matmul(&x.t().unwrap())
                    .unwrap()
                    .t()
                    .unwrap()
                    .contiguous()
                    .unwrap()
            });
            let xc = x.t()?.contiguous()?;
            let e = time(&|| w.matmul(&xc).unwrap());
            println!(
                "   W @ x^T: {:.2} ms ({:.1} GB/s); with x^T contiguous {:.2} ms ({:.1} GB/s)",
                d * 1e3,
                bytes / d / 1e9,
                e * 1e3,
                bytes / e / 1e9
            );
            println!(
                "k={k} n={n} m={m}: w.t() {:.2} ms ({:.1} GB/s), contiguous [K,N] {:.2} ms ({:.1} GB/s), hand gemv {:.2} ms ({:.1} GB/s)",
                a * 1e3,
                bytes / a / 1e9,
                b * 1e3,
                bytes / b / 1e9,
                c * 1e3,
                bytes / c / 1e9
            );
        }
        let _ = DType::F32;
    }
    Ok(())
}
