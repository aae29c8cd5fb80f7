//! Sampling a batch of next-token rows where the logits are, with tensor ops: on a GPU the
//! `[B, vocab]` logits stay there and one `[B, 3]` f32 copy comes back per decode step
//! (token, log-prob, and whether the draw landed on a kept token), instead of `B · vocab`
//! floats.
//!
//! The same rules as [`super::draw::sample`]: the returned log-prob is `log softmax(l /
//! T)[token]` over the whole vocabulary, top-k, then top-p (on the top-k set's mass, not
//! renormalised), then min-p, and one uniform `u` per row from the sequence's own
//! generator (drawn by the caller, as the host sampler draws it). The draw is the inverse
//! CDF at `u · total` walking the kept tokens in **vocabulary order**: with no truncation
//! that is the host sampler's order, so the same `u` picks the same token there (up to
//! the order of float summation); with truncation the host walks most-likely-first, so a
//! given `u` may pick another token, from the same distribution.
//!
//! On a GPU one fused kernel takes the whole draw instead
//! ([`crate::model::compute::fused_draw`]): the same rules, the thresholds found exactly
//! by radix selection, this composed form its reference.
//!
//! How, without a sort (candle's GPU sort holds a whole row in shared memory, which a
//! 151,936-token row does not fit): the top-k and top-p cut-offs are thresholds found by
//! bisection on each row (a fixed number of count or mass passes, no host round trip), and
//! the running sum is taken in blocks of [`BLOCK`] tokens, each a product with a triangular
//! matrix: the block holding `u · total` first, then the token within it.

use super::draw::SamplingParams;
use candle_core::{D, DType, Device, Result, Tensor};

/// Tokens per block of the running sum.
const BLOCK: usize = 1024;
/// Bisection steps for a threshold: each halves the interval, so after 40 it is far below
/// an f32 spacing of the values it separates.
const BISECT: usize = 40;

/// One drawn token of a row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Draw {
    pub token: u32,
    pub logp: f32,
}

/// Draws a token for every row of `logits: [B, V]` (f32), row `i` with the uniform
/// `u[i]` in `[0, 1)` (ignored when greedy). `None` for a row where rounding pushed the
/// draw off the kept tokens (as rare as a running sum landing within an ulp of the end):
/// the caller then samples that row on the host.
pub fn draw_rows(logits: &Tensor, u: &[f32], params: &SamplingParams) -> Result<Vec<Option<Draw>>> {
    Ok(draws(draw_table(logits, u, params)?.to_vec2::<f32>()?))
}

/// [`draw_rows`]' draws left where the logits are: `[B, 3]` f32, each row (token, its
/// log-prob, 1 where the draw landed on a kept token, else 0), for [`draws`] to read once
/// it is on the host. Token ids are exact in f32 (below 2²⁴).
pub fn draw_table(logits: &Tensor, u: &[f32], params: &SamplingParams) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    if u.len() != n {
        candle_core::bail!("draw_rows: {n} rows but {} uniforms", u.len());
    }
    let logits = logits.to_dtype(DType::F32)?;
    // One launch for the whole draw where the fused kernel runs (a GPU), the same rules.
    if let Some(out) = crate::model::compute::fused_draw(
        &logits,
        u,
        params.temperature,
        params.top_k,
        params.top_p,
        params.min_p,
    )? {
        return Ok(out);
    }
    let dev = logits.device();
    let greedy = params.temperature <= 0.0;
    let inv_t = if greedy {
        1.0
    } else {
        1.0 / params.temperature as f64
    };
    let s = (&logits * inv_t)?;
    let max = s.max_keepdim(D::Minus1)?;
    let lse = (s
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + &max)?;
    let logp = s.broadcast_sub(&lse)?;
    let (token, kept) = if greedy {
        let best = logits.argmax_keepdim(D::Minus1)?;
        let one = Tensor::ones((n, 1), DType::F32, dev)?;
        (best, one)
    } else {
        let p = logp.exp()?;
        let w = match keep_mask(&s, &p, params)? {
            Some(keep) => (&p * keep)?,
            None => p,
        };
        let target = (Tensor::from_slice(u, (n, 1), dev)? * w.sum_keepdim(D::Minus1)?)?;
        let token = inverse_cdf(&w, &target, v)?;
        let kept = w.gather(&token, 1)?.gt(0.0)?.to_dtype(DType::F32)?;
        (token, kept)
    };
    let picked = logp.gather(&token, 1)?;
    // One table, so that one copy brings back all three columns.
    Tensor::cat(&[&token.to_dtype(DType::F32)?, &picked, &kept], 1)
}

/// The draws of [`draw_table`]'s rows (token, log-prob, kept) on the host: `None` where
/// the draw missed the kept tokens.
pub fn draws(rows: Vec<Vec<f32>>) -> Vec<Option<Draw>> {
    rows.into_iter()
        .map(|r| {
            (r[2] > 0.0).then_some(Draw {
                token: r[0] as u32,
                logp: r[1],
            })
        })
        .collect()
}

/// 1 for the tokens top-k, top-p and min-p keep, 0 for the rest; `None` when none is on.
/// `s` are the scaled logits, `p` the probabilities, both `[B, V]`.
fn keep_mask(s: &Tensor, p: &Tensor, params: &SamplingParams) -> Result<Option<Tensor>> {
    let v = s.dim(D::Minus1)?;
    let mut keep: Option<Tensor> = None;
    if params.top_k > 0 && params.top_k < v {
        // The largest threshold with at least k scaled logits at or above it.
        let k = params.top_k as f64;
        let lo = s.min_keepdim(D::Minus1)?;
        let hi = s.max_keepdim(D::Minus1)?;
        let count = |t: &Tensor| {
            s.broadcast_ge(t)?
                .to_dtype(DType::F32)?
                .sum_keepdim(D::Minus1)
        };
        let lo = bisect(lo, hi, |mid| count(mid)?.ge(k))?;
        keep = Some(s.broadcast_ge(&lo)?.to_dtype(DType::F32)?);
    }
    if params.top_p < 1.0 {
        // The largest probability threshold whose kept mass (within top-k) still reaches
        // top_p: the smallest most-likely-first prefix with that mass.
        let within = match &keep {
            Some(k) => (p * k)?,
            None => p.clone(),
        };
        let mass = |t: &Tensor| -> Result<Tensor> {
            let above = within.broadcast_ge(t)?.to_dtype(DType::F32)?;
            (&within * above)?.sum_keepdim(D::Minus1)
        };
        let lo = within.zeros_like()?.narrow(D::Minus1, 0, 1)?;
        let hi = within.max_keepdim(D::Minus1)?;
        let lo = bisect(lo, hi, |mid| mass(mid)?.ge(params.top_p as f64))?;
        let above = within.broadcast_ge(&lo)?.to_dtype(DType::F32)?;
        keep = Some(match keep {
            Some(k) => (k * above)?,
            None => above,
        });
    }
    if params.min_p > 0.0 {
        let floor = (p.max_keepdim(D::Minus1)? * params.min_p as f64)?;
        let above = p.broadcast_ge(&floor)?.to_dtype(DType::F32)?;
        keep = Some(match keep {
            Some(k) => (k * above)?,
            None => above,
        });
    }
    Ok(keep)
}

/// Bisection per row on `[lo, hi]` (`[B, 1]` each) for the largest value where `holds`
/// (a `[B, 1]` 0/1 mask, true at `lo`, monotone: true below some point, false above)
/// is true; returns that lower end.
fn bisect(
    mut lo: Tensor,
    mut hi: Tensor,
    holds: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    for _ in 0..BISECT {
        let mid = ((&lo + &hi)? * 0.5)?;
        let yes = holds(&mid)?;
        lo = yes.where_cond(&mid, &lo)?;
        hi = yes.where_cond(&hi, &mid)?;
    }
    Ok(lo)
}

/// The first index (per row) where the running sum of `w: [B, V]` reaches `target: [B,
/// 1]`, `[B, 1]` u32, clamped to `V - 1`.
fn inverse_cdf(w: &Tensor, target: &Tensor, v: usize) -> Result<Tensor> {
    let n = w.dim(0)?;
    let dev = w.device();
    let nb = v.div_ceil(BLOCK);
    let blocks = w
        .pad_with_zeros(D::Minus1, 0, nb * BLOCK - v)?
        .reshape((n, nb, BLOCK))?;
    let sums = blocks.sum(D::Minus1)?;
    let ends = sums.matmul(&upper_ones(nb, dev)?)?;
    // The block where the running sum reaches the target: how many end below it.
    let below = |run: &Tensor, len: usize| -> Result<Tensor> {
        run.broadcast_lt(target)?
            .to_dtype(DType::F32)?
            .sum_keepdim(D::Minus1)?
            .clamp(0.0, (len - 1) as f64)?
            .to_dtype(DType::U32)
    };
    let b = below(&ends, nb)?;
    let start = (ends.gather(&b, 1)? - sums.gather(&b, 1)?)?;
    let rows = blocks
        .gather(
            &b.unsqueeze(2)?.broadcast_as((n, 1, BLOCK))?.contiguous()?,
            1,
        )?
        .squeeze(1)?;
    let run = rows
        .matmul(&upper_ones(BLOCK, dev)?)?
        .broadcast_add(&start)?;
    let within = below(&run, BLOCK)?;
    let token = ((b * BLOCK as f64)? + within)?;
    token.clamp(0u32, (v - 1) as u32)
}

/// `[m, m]` with ones on and above the diagonal: `x · U` is the running sum of `x`'s rows.
fn upper_ones(m: usize, dev: &Device) -> Result<Tensor> {
    let i = Tensor::arange(0u32, m as u32, dev)?;
    i.unsqueeze(1)?
        .broadcast_le(&i.unsqueeze(0)?)?
        .to_dtype(DType::F32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::draw::sample;
    use crate::sampler::draw::tests::params;
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};

    /// Rows of a vocabulary longer than two blocks, peaked and flat.
    fn rows(n: usize, v: usize, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n)
            .map(|i| {
                let spread = [0.5f32, 2.0, 6.0][i % 3];
                (0..v)
                    .map(|_| rng.random::<f32>() * spread * 2.0 - spread)
                    .collect()
            })
            .collect()
    }

    fn tensor(rows: &[Vec<f32>]) -> Tensor {
        let v = rows[0].len();
        Tensor::from_vec(rows.concat(), (rows.len(), v), &Device::Cpu).unwrap()
    }

    /// With no truncation the device draw walks the host sampler's order: the same
    /// generator state gives the same token and log-prob; greedy too.
    #[test]
    fn without_truncation_the_same_uniform_gives_the_host_token() {
        let (n, v) = (24, 2 * BLOCK + 357);
        let r = rows(n, v, 1);
        let t = tensor(&r);
        for p in [
            params(1.0, 0, 1.0, 0.0),
            params(0.7, 0, 1.0, 0.0),
            params(0.0, 0, 1.0, 0.0),
        ] {
            let mut same = 0;
            for round in 0..8u64 {
                let seed = |i: usize| round * 1000 + i as u64;
                let u: Vec<f32> = (0..n)
                    .map(|i| StdRng::seed_from_u64(seed(i)).random::<f32>())
                    .collect();
                let got = draw_rows(&t, &u, &p).unwrap();
                for (i, row) in r.iter().enumerate() {
                    let (tok, logp) = sample(row, &p, &mut StdRng::seed_from_u64(seed(i)));
                    let d = got[i].expect("kept");
                    assert!((d.logp - logp).abs() < 1e-4, "{} vs {logp}", d.logp);
                    same += usize::from(d.token == tok);
                }
            }
            // A running sum in another order may land a draw on the neighbour at a
            // boundary; never more than a stray one.
            assert!(same >= 8 * n - 1, "{same} of {}", 8 * n);
        }
    }

    /// With top-k, top-p and min-p the device keeps exactly the host sampler's candidates,
    /// and a uniform picks the token that walking them in vocabulary order picks.
    #[test]
    fn truncated_draws_keep_the_host_candidates() {
        let (n, v) = (6, BLOCK + 100);
        let r = rows(n, v, 2);
        let t = tensor(&r);
        for p in [
            params(1.0, 50, 1.0, 0.0),
            params(1.0, 0, 0.3, 0.0),
            params(0.8, 200, 0.5, 0.0),
            params(1.0, 0, 1.0, 0.2),
            params(1.3, 400, 0.9, 0.05),
        ] {
            let inv_t = 1.0 / p.temperature as f64;
            let s = (&t * inv_t).unwrap();
            let probs = candle_nn::ops::softmax_last_dim(&s).unwrap();
            let keep = keep_mask(&s, &probs, &p).unwrap().unwrap();
            let keep = keep.to_vec2::<f32>().unwrap();
            let probs = probs.to_vec2::<f32>().unwrap();
            let mut rng = StdRng::seed_from_u64(3);
            let mut same = 0;
            for (i, row) in r.iter().enumerate() {
                let prob = |j: usize| probs[i][j];
                let mut want = crate::sampler::draw::candidates(row, &p, &prob);
                let kept: Vec<usize> = (0..v).filter(|&j| keep[i][j] > 0.0).collect();
                want.sort_unstable();
                assert_eq!(kept, want, "row {i}, {p:?}");
                for _ in 0..20 {
                    let u: f32 = rng.random();
                    let total: f32 = want.iter().map(|&j| prob(j)).sum();
                    let mut left = u * total;
                    let mut pick = *want.last().unwrap();
                    for &j in &want {
                        left -= prob(j);
                        if left <= 0.0 {
                            pick = j;
                            break;
                        }
                    }
                    let mut us = vec![0.5f32; n];
                    us[i] = u;
                    let d = draw_rows(&t, &us, &p).unwrap()[i].expect("kept");
                    same += usize::from(d.token as usize == pick);
                }
            }
            assert!(same >= 20 * n - 1, "{p:?}: {same} of {}", 20 * n);
        }
    }
}
