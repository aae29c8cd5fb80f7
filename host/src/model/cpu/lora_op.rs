//! A LoRA projection as one graph node on the CPU: `y = x Wᵀ + s (x Aᵀ) Bᵀ` with the frozen
//! `W: [out, in]`, `A: [r, in]`, `B: [out, r]`, and a backward that computes exactly
//! `dx`, `dA`, `dB`.
//!
//! Composed from candle ops the adapter is five nodes (two matmuls, a scale, the add, the
//! frozen product), and candle's backward gives each node's inputs a fresh zero tensor plus
//! an add, so every `[tokens, out]` gradient was copied several times; its gemm also runs
//! the rank-16 products at a fraction of its speed. Here the adapter's output is added in
//! the register tiles of `x Wᵀ` ([`super::gemm::product_plus`]), and with `low = s x Aᵀ`,
//! `gl = s g B`: `dx = g W + gl A`, `dA = glᵀ x`, `dB = gᵀ low` (each a gemm, the two terms
//! of `dx` in one).
//! `dx` is skipped when `x` needs no gradient (the first layer, under frozen embeddings).
//! The frozen weight may be NF4 (QLoRA): its products then go a dequantized block at a time
//! ([`super::frozen`]).
//!
//! Used for training forwards without LoRA dropout (dropout masks the adapter's input
//! only, which this node does not model); everything else takes the composed path.

use super::frozen::FrozenWeight;
use super::gemm::{MatRef, product};
use super::storage::with_f32_data;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, bail};
use std::sync::Mutex;

/// Whether the fused kernels ([`lora_linear`], [`super::mlp_op`]) can run a projection
/// with the frozen weight `w` on `x`: f32 on a CPU with AVX2 and FMA, the weight dense f32
/// or kept quantized.
pub fn applies(w: &impl FrozenWeight, x: &Tensor) -> bool {
    w.applies(x)
}

/// `x Wᵀ + s (x Aᵀ) Bᵀ` for `x: [..., in]` (out `[..., out]`); differentiable in `x`, `a`,
/// `b`.
pub fn lora_linear<W: FrozenWeight>(
    x: &Tensor,
    w: &W,
    a: &Tensor,
    b: &Tensor,
    scaling: f64,
) -> Result<Tensor> {
    let (out_f, in_f) = w.dims2();
    let (r, in_a) = a.dims2()?;
    if in_a != in_f || b.dims() != [out_f, r] {
        bail!(
            "lora: weight {:?}, A {:?}, B {:?} do not fit",
            (out_f, in_f),
            a.dims(),
            b.dims()
        );
    }
    if x.dims().last() != Some(&in_f) {
        bail!("lora: input {:?} does not end in {in_f} features", x.dims());
    }
    // N-D in and out: reshapes around the op would be graph nodes, and candle's backward
    // gives each a zero tensor plus an add of the whole gradient.
    x.contiguous()?.apply_op3(
        &a.contiguous()?,
        &b.contiguous()?,
        LoraMatmul {
            w: w.clone(),
            scaling: scaling as f32,
            low: Mutex::new(Vec::new()),
        },
    )
}

struct LoraMatmul<W> {
    w: W,
    scaling: f32,
    /// `s x Aᵀ` from the forward, for `dB`.
    low: Mutex<Vec<f32>>,
}

fn slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    super::storage::f32_slice(s, l, "lora")
}

impl<W: FrozenWeight> CustomOp3 for LoraMatmul<W> {
    fn name(&self) -> &'static str {
        "lora-matmul"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        as_: &CpuStorage,
        al: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, r) = bl.shape().dims2()?;
        let k = al.shape().dims2()?.1;
        let m = xl.shape().elem_count() / k;
        let (x, a, b) = (slice(xs, xl)?, slice(as_, al)?, slice(bs, bl)?);
        let xm = MatRef::row_major(x, m, k);
        let mut low = product(xm, MatRef::row_major(a, r, k).t());
        low.iter_mut().for_each(|v| *v *= self.scaling);
        let y = self.w.with_frozen(|w| {
            Ok(w.forward_plus(
                xm,
                MatRef::row_major(&low, m, r),
                MatRef::row_major(b, n, r).t(),
            ))
        })?;
        *self
            .low
            .lock()
            .map_err(|_| candle_core::Error::Msg("lora: poisoned".into()))? = low;
        let mut dims = xl.shape().dims().to_vec();
        *dims.last_mut().expect("x has at least one dim") = n;
        Ok((CpuStorage::F32(y), Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, r) = b.dims2()?;
        let k = a.dims2()?.1;
        let m = x.elem_count() / k;
        let low = std::mem::take(
            &mut *self
                .low
                .lock()
                .map_err(|_| candle_core::Error::Msg("lora: poisoned".into()))?,
        );
        if low.len() != m * r {
            bail!("lora: backward without a forward (or twice)");
        }
        let dev = x.device();
        let want_dx = x.track_op();
        let (dx, da, db) = with_f32_data(g, |gv| {
            with_f32_data(b, |bv| {
                with_f32_data(a, |av| {
                    with_f32_data(x, |xv| {
                        self.w.with_frozen(|w| {
                            let gm = MatRef::row_major(gv, m, n);
                            // gl = s g B: [m, r]
                            let mut gl = product(gm, MatRef::row_major(bv, n, r));
                            gl.iter_mut().for_each(|v| *v *= self.scaling);
                            let glm = MatRef::row_major(&gl, m, r);
                            let dx = want_dx
                                .then(|| w.backward_plus(gm, glm, MatRef::row_major(av, r, k)));
                            let da = product(glm.t(), MatRef::row_major(xv, m, k));
                            let db = product(gm.t(), MatRef::row_major(&low, m, r));
                            Ok((dx, da, db))
                        })
                    })
                })
            })
        })?;
        let dx = dx
            .map(|d| Tensor::from_vec(d, x.shape(), dev))
            .transpose()?;
        Ok((
            dx,
            Some(Tensor::from_vec(da, (r, k), dev)?),
            Some(Tensor::from_vec(db, (n, r), dev)?),
        ))
    }
}
