//! Probe (not a test): GFLOPS of candle's CPU matmul and of ours (`model::gemm`) for each
//! product of a 0.5B-shaped LoRA training step (1024 tokens): forward `x W^T` (W read as a
//! strided view), backward `g W`, and the output head.
//! First the machine's FMA peak on the same threads, which the rates are a fraction of.
//! `RAYON_NUM_THREADS=2 cargo run --release -p rlhost --example gemm_probe`
use candle_core::{Device, Tensor};
use rlhost::model::kernels::gemm::{MatRef, gemm};
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

/// FMA throughput of one thread, in FLOP/s: twelve independent accumulator chains (more than
/// latency × FMA ports on current x86 cores) on AVX-512 or AVX2, nothing loaded from memory.
#[cfg(target_arch = "x86_64")]
fn fma_flops_one_thread(avx512: bool) -> f64 {
    use std::arch::x86_64::*;
    use std::hint::black_box;
    const ITERS: usize = 50_000_000;
    #[target_feature(enable = "avx512f")]
    unsafe fn run512() -> f32 {
        // Opaque values, so the compiler cannot fold the chains.
        let (b, c) = (
            _mm512_set1_ps(black_box(1.0 - 1e-7)),
            _mm512_set1_ps(black_box(1e-7)),
        );
        let mut acc = [_mm512_set1_ps(black_box(1.0)); 12];
        for _ in 0..ITERS {
            for a in acc.iter_mut() {
                *a = _mm512_fmadd_ps(*a, b, c);
            }
        }
        acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
    }
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run256() -> f32 {
        let (b, c) = (
            _mm256_set1_ps(black_box(1.0 - 1e-7)),
            _mm256_set1_ps(black_box(1e-7)),
        );
        let mut acc = [_mm256_set1_ps(black_box(1.0)); 12];
        for _ in 0..ITERS {
            for a in acc.iter_mut() {
                *a = _mm256_fmadd_ps(*a, b, c);
            }
        }
        let mut out = [0f32; 8];
        let sum = acc
            .iter()
            .fold(_mm256_setzero_ps(), |s, &a| _mm256_add_ps(s, a));
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
        out.iter().sum()
    }
    let t = Instant::now();
    // SAFETY: the caller checked the features of the kernel it asks for.
    let sink = unsafe { if avx512 { run512() } else { run256() } };
    black_box(sink);
    let lanes = if avx512 { 16 } else { 8 };
    (2 * 12 * lanes * ITERS) as f64 / t.elapsed().as_secs_f64()
}

/// The FMA peak of rayon's thread count of threads at once, in FLOP/s, and the width used.
fn fma_peak() -> (f64, &'static str) {
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = std::is_x86_feature_detected!("avx512f");
        let threads = rayon::current_num_threads();
        let flops: f64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|_| s.spawn(move || fma_flops_one_thread(avx512)))
                .collect();
            hs.into_iter().map(|h| h.join().expect("peak thread")).sum()
        });
        (flops, if avx512 { "AVX-512" } else { "AVX2" })
    }
    #[cfg(not(target_arch = "x86_64"))]
    (f64::NAN, "none")
}

fn main() -> anyhow::Result<()> {
    rlhost::model::compute::set_up_process();
    let (peak, width) = fma_peak();
    println!(
        "FMA peak ({width}, {} threads): {:.0} GFLOPS",
        rayon::current_num_threads(),
        peak / 1e9
    );
    let pct = |flops: f64| format!("{:.0} GFLOPS ({:.0}%)", flops / 1e9, 100.0 * flops / peak);
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
            "[{m}x{k}] x [{n}x{k}]^T: candle fwd {}, bwd {}",
            pct(flops / fwd),
            pct(flops / bwd)
        );
        println!(
            "  ours: fwd {}, bwd {}",
            pct(flops / ours_f),
            pct(flops / ours_b)
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
        let flops = 2.0 * (rows * k * n) as f64;
        println!("lm_head {rows} rows: candle {}", pct(flops / fwd));
        println!("  ours: {}", pct(flops / ours));
    }
    Ok(())
}
