//! A decode step's draw for the whole batch in one launch (`sample.cu`): temperature,
//! top-k, top-p and min-p, the inverse CDF at each row's uniform and the drawn token's
//! log-prob, one block a row of f32 logits. The composed form it must equal is
//! `sampler/device_draw.rs`'s, a few dozen tensor ops (a few hundred with top-k or top-p,
//! whose thresholds it finds by 40 bisection passes over the batch's logits); the kernel
//! finds them exactly by radix selection over the values' bits, in four passes each.
//! Inference only: no backward.

use super::{Module, PushKernelArg, alloc, cuda, launch, ptx, tensor, view};
use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::{DType, Result, Tensor, bail};
use std::sync::OnceLock;

const KERNELS: Module = Module {
    name: "rlhost_sample",
    ptx: ptx!("sample"),
};

/// Threads of a block (`THREADS` in sample.cu: its scan holds one value a thread).
const THREADS: u32 = 1024;

/// The sampling settings the kernel reads.
#[derive(Clone, Copy, Debug)]
pub struct Rules {
    /// 0 or below: greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: usize,
    /// 1: off.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
}

/// Whether the kernel draws from `logits` (f32 `[B, V]` on a GPU), unless
/// `RLHOST_DRAW=composed` asks for the composed form (the benchmark runs both).
pub fn applies(logits: &Tensor) -> bool {
    static COMPOSED: OnceLock<bool> = OnceLock::new();
    let forced = *COMPOSED.get_or_init(|| {
        std::env::var("RLHOST_DRAW").is_ok_and(|v| v.eq_ignore_ascii_case("composed"))
    });
    !forced && super::applies(logits) && logits.dtype() == DType::F32 && logits.rank() == 2
}

/// For each row of `logits: [B, V]` (f32) with its uniform `u[row]` in `[0, 1)`: `[B, 3]`
/// f32, the drawn token, its log-prob at the temperature over the whole vocabulary, and 1
/// where the draw landed on a kept token (0 where rounding pushed it off them).
pub fn draw(logits: &Tensor, u: &[f32], rules: Rules) -> Result<Tensor> {
    let (b, v) = logits.dims2()?;
    if u.len() != b || b == 0 || v == 0 || v >= 1 << 24 {
        bail!(
            "fused draw: {b} rows of {v} logits and {} uniforms",
            u.len()
        );
    }
    let logits = logits.contiguous()?;
    let u = Tensor::from_slice(u, b, logits.device())?;
    let greedy = rules.temperature <= 0.0;
    // 1/T in f64 and then f32, as the composed form's scaling of the logits takes it.
    let inv_t = if greedy {
        1.0f32
    } else {
        (1.0 / rules.temperature as f64) as f32
    };
    let (l_guard, l_l) = logits.storage_and_layout();
    let (u_guard, u_l) = u.storage_and_layout();
    let ls = cuda(&l_guard, "fused draw")?;
    let dev = super::device(ls);
    let lv = view::<f32>(ls, l_l, "fused draw")?;
    let uv = view::<f32>(cuda(&u_guard, "fused draw")?, u_l, "fused draw")?;
    let out = alloc::<f32>(dev, b * 3)?;
    let (stream, func) = KERNELS.load(dev, "sample_rows", DType::F32)?;
    let mut args = stream.launch_builder(&func);
    let (v32, greedy32, k32) = (v as i32, greedy as i32, rules.top_k.min(v) as i32);
    args.arg(&lv)
        .arg(&uv)
        .arg(&out)
        .arg(&v32)
        .arg(&inv_t)
        .arg(&greedy32);
    args.arg(&k32).arg(&rules.top_p).arg(&rules.min_p);
    let cfg = LaunchConfig {
        grid_dim: (b as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(&mut args, cfg)?;
    Ok(tensor(out, dev, (b, 3)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures;
    use crate::sampler::device_draw::draw_rows;
    use crate::sampler::draw::SamplingParams;

    /// The kernel against the composed draw on the GPU, for the same logits (a
    /// 151,936-token vocabulary, peaked and flat rows) and uniforms: greedy, T = 1, and
    /// top-k, top-p and min-p alone and together. The log-prob of every drawn token is the
    /// composed one's where the tokens agree, and they agree but for a running sum landing
    /// within rounding of a token's edge. Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn fused_draw_matches_the_composed_draw() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        let (b, v) = (64, 151_936);
        // Rows from flat (scale 1) to peaked (scale 12).
        let scales: Vec<f32> = (0..b).map(|i| 1.0 + 11.0 * i as f32 / b as f32).collect();
        let logits = (fixtures::uniform(&[b, v], 7)
            .broadcast_mul(
                &Tensor::new(scales.as_slice(), &candle_core::Device::Cpu)
                    .unwrap()
                    .unsqueeze(1)
                    .unwrap(),
            )
            .unwrap())
        .to_device(&dev)
        .unwrap();
        // Spread over (0, 1), never 0 (whose target is the row's first token, kept or not).
        let u: Vec<f32> = (0..b)
            .map(|i| (((i * 37 + 11) % 101) as f32 + 0.5) / 101.0)
            .collect();
        let cases = [
            (0.0, 0, 1.0, 0.0),
            (1.0, 0, 1.0, 0.0),
            (0.7, 50, 1.0, 0.0),
            (1.0, 0, 0.9, 0.0),
            (1.0, 0, 1.0, 0.05),
            (0.9, 40, 0.8, 0.02),
        ];
        for (temperature, top_k, top_p, min_p) in cases {
            let params = SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                ..SamplingParams::default()
            };
            let rules = Rules {
                temperature,
                top_k,
                top_p,
                min_p,
            };
            let fused = draw(&logits, &u, rules).unwrap().to_vec2::<f32>().unwrap();
            let composed = crate::model::cpu::composed(|| draw_rows(&logits, &u, &params)).unwrap();
            let mut same = 0;
            for (f, c) in fused.iter().zip(&composed) {
                let c = c.expect("the composed draw landed on a kept token");
                assert_eq!(
                    f[2], 1.0,
                    "{rules:?}: the kernel's draw is off the kept tokens"
                );
                if f[0] as u32 == c.token {
                    same += 1;
                    assert!(
                        (f[1] - c.logp).abs() <= 1e-4,
                        "{rules:?}: {} vs {}",
                        f[1],
                        c.logp
                    );
                }
            }
            eprintln!("fused draw {rules:?}: {same} of {b} tokens as the composed draw's");
            assert!(same >= b - 1, "{rules:?}: {same} of {b}");
        }
    }
}
