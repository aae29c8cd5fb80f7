//! A projection's frozen base weight `W: [out, in]`, dense or NF4 (QLoRA), lent to the
//! fused LoRA kernels as their [`FrozenWeight`] (`cpu/frozen.rs` multiplies with it, an
//! NF4 weight a dequantized block of rows at a time), so that a 4-bit base trains through
//! the same kernels as an f32 one.

#[cfg(target_arch = "x86_64")]
use super::cpu::{frozen::Frozen, frozen::FrozenWeight, storage::with_f32_data};
use super::nf4::linear::Nf4Linear;
use candle_core::{Device, Result, Tensor};
use std::sync::Arc;

/// A projection's frozen base weight `[out, in]`: a dense tensor, or NF4 (QLoRA), which is
/// dequantized a block at a time and never kept whole.
#[derive(Clone)]
pub enum Weight {
    Dense(Tensor),
    Nf4(Arc<Nf4Linear>),
}

impl Weight {
    /// `(out, in)`.
    pub fn dims2(&self) -> (usize, usize) {
        match self {
            Weight::Dense(w) => {
                let d = w.dims();
                (d[0], d[1])
            }
            Weight::Nf4(q) => q.dims(),
        }
    }

    /// The weight in f32, dequantized when it is NF4 (for a merged export).
    pub fn to_dense(&self, device: &Device) -> Result<Tensor> {
        match self {
            Weight::Dense(w) => Ok(w.clone()),
            Weight::Nf4(q) => q.dense(device),
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl FrozenWeight for Weight {
    fn dims2(&self) -> (usize, usize) {
        Weight::dims2(self)
    }

    fn applies(&self, x: &Tensor) -> bool {
        match self {
            Weight::Dense(w) => super::cpu::gemm::applies(x, w),
            Weight::Nf4(_) => super::cpu::applies(x),
        }
    }

    fn with_frozen<R>(&self, f: impl FnOnce(Frozen) -> Result<R>) -> Result<R> {
        match self {
            Weight::Dense(t) => {
                let (n, k) = t.dims2()?;
                with_f32_data(t, |d| f(Frozen::Dense(d, n, k)))
            }
            Weight::Nf4(q) => f(Frozen::Blocks(q.as_ref())),
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::model::cpu::frozen::block_rows;
    use crate::model::cpu::gemm::MatRef;
    use crate::model::nf4::Nf4;

    fn spread(n: usize, salt: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ salt) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// The blocked NF4 products equal the dense products of the dequantized weight, over
    /// several blocks and a short last one.
    #[test]
    fn nf4_blocks_give_the_dense_products() {
        if !crate::model::cpu::gemv::available() {
            return;
        }
        let (n, k, m, r) = (200, 128, 37, 4);
        let q = Nf4Linear::new(Nf4::quantize(&spread(n * k, 1), n, k, true).unwrap());
        assert!(block_rows(n, k) < n, "the test must cross blocks");
        let w = q.q.dequantize();
        let dense = Frozen::Dense(&w, n, k);
        let (x, low, b, g, gl, a) = (
            spread(m * k, 2),
            spread(m * r, 3),
            spread(n * r, 4),
            spread(m * n, 5),
            spread(m * r, 6),
            spread(r * k, 7),
        );
        let (xm, lowm, bt) = (
            MatRef::row_major(&x, m, k),
            MatRef::row_major(&low, m, r),
            MatRef::row_major(&b, n, r).t(),
        );
        let close = |a: &[f32], b: &[f32]| {
            let worst = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-3, "differs by {worst}");
        };
        close(
            &Frozen::Blocks(&q).forward_plus(xm, lowm, bt),
            &dense.forward_plus(xm, lowm, bt),
        );
        let (gm, glm, am) = (
            MatRef::row_major(&g, m, n),
            MatRef::row_major(&gl, m, r),
            MatRef::row_major(&a, r, k),
        );
        let want = dense.backward_plus(gm, glm, am);
        close(&Frozen::Blocks(&q).backward_plus(gm, glm, am), &want);
        // Accumulating adds to what is there.
        let mut c = vec![1f32; m * k];
        Frozen::Blocks(&q).backward_plus_into(gm, glm, am, &mut c, true);
        let plus_one: Vec<f32> = want.iter().map(|v| v + 1.0).collect();
        close(&c, &plus_one);
    }
}
