//! The MLP block with LoRA on all three projections as one graph node on the CPU:
//! `y = down(silu(gate(x)) ⊙ up(x))`, each projection `x Wᵀ + s (x Aᵀ) Bᵀ` as in
//! [`super::lora_op`], with a backward that computes exactly `dx` and the six adapter
//! gradients.
//!
//! Why one node: candle's backward gives every input of every node a fresh zero tensor
//! and then adds the incoming gradient to it. As four nodes (gate, up, SwiGLU, down) the
//! block's `[tokens, intermediate]` gradients (20 MB each for 1,024 tokens of a 0.5B
//! model) were each zero-filled and copied by an add three times over, and `x`'s
//! gradient was summed from two; here `dh`, `dgate` and `dup` are written once each and
//! `dx = dgate W_g + dup W_u` (plus the adapters' terms) is one accumulated product.
//!
//! The frozen weights may be NF4 (QLoRA): their products then go a dequantized block at a
//! time ([`super::frozen`]).
//!
//! The adapters come in as one flat tensor (`[A_g, B_g, A_u, B_u, A_d, B_d]`, see
//! [`lora_mlp`]), so that the node has two inputs; candle's backward of that
//! concatenation hands each adapter its slice of the gradient.

use super::alloc::zeroed;
use super::frozen::{Frozen, FrozenWeight, with_frozen3};
use super::fused::{swiglu_grads_in_place, swiglu_into};
use super::gemm::{MatRef, product};
use super::storage::with_f32_data;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, bail};
use std::sync::Mutex;

/// One projection of the block: its frozen weight, and its adapter's `A: [r, in]`,
/// `B: [out, r]` and scaling.
pub struct Projection<'a, W> {
    pub w: &'a W,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub scaling: f64,
}

/// Whether [`lora_mlp`] can take the frozen weights `w` (gate, up, down) beside `x`: the
/// gemm ops usable for `x` and each. (The caller checks that every projection has an
/// adapter and no bias.)
pub fn applies<W: FrozenWeight>(x: &Tensor, w: [&W; 3]) -> bool {
    w.iter().all(|w| w.applies(x))
}

/// `down(silu(gate(x)) ⊙ up(x))` with every adapter applied, for `x: [..., hidden]`;
/// differentiable in `x` and the adapters (the live ones or a snapshot's: PPO's critic, a
/// recomputed layer's, as the caller picks). Callers check [`applies`] and that no
/// adapter needs dropout.
pub fn lora_mlp<W: FrozenWeight>(
    x: &Tensor,
    [gate, up, down]: [Projection<W>; 3],
) -> Result<Tensor> {
    let (inter, hidden) = gate.w.dims2();
    if up.w.dims2() != (inter, hidden) || down.w.dims2() != (hidden, inter) {
        bail!(
            "mlp: gate {:?}, up {:?}, down {:?} do not fit",
            gate.w.dims2(),
            up.w.dims2(),
            down.w.dims2()
        );
    }
    if x.dims().last() != Some(&hidden) {
        bail!(
            "mlp: input {:?} does not end in {hidden} features",
            x.dims()
        );
    }
    let mut parts = Vec::with_capacity(6);
    let mut ranks = [0usize; 3];
    let mut scaling = [0f32; 3];
    for (i, p) in [&gate, &up, &down].into_iter().enumerate() {
        let (out_f, in_f) = p.w.dims2();
        let (r, in_a) = p.a.dims2()?;
        if in_a != in_f || p.b.dims() != [out_f, r] {
            bail!("mlp: adapter {i} is A {:?}, B {:?}", p.a.dims(), p.b.dims());
        }
        ranks[i] = r;
        scaling[i] = p.scaling as f32;
        parts.push(p.a.flatten_all()?);
        parts.push(p.b.flatten_all()?);
    }
    let adapters = Tensor::cat(&parts, 0)?;
    x.contiguous()?.apply_op2(
        &adapters,
        LoraMlp {
            w: [gate.w.clone(), up.w.clone(), down.w.clone()],
            ranks,
            scaling,
            saved: Mutex::new(None),
        },
    )
}

struct LoraMlp<W> {
    /// Frozen `W_g [I, H]`, `W_u [I, H]`, `W_d [H, I]`.
    w: [W; 3],
    ranks: [usize; 3],
    scaling: [f32; 3],
    saved: Mutex<Option<Saved>>,
}

/// What the backward needs from the forward, all row-major with one row per token. The
/// down projection's input `h = silu(gate) ⊙ up` is not kept (a third `[tokens,
/// intermediate]` buffer per layer, 20 MB for 1,024 tokens of a 0.5B model): the backward
/// makes it again from these, in one cheap pass.
struct Saved {
    gate: Vec<f32>,
    up: Vec<f32>,
    /// `s x Aᵀ` of gate, up and down.
    low: [Vec<f32>; 3],
}

/// Offsets of `A_g, B_g, A_u, B_u, A_d, B_d` in the flat adapter tensor, and its length.
fn offsets(ranks: [usize; 3], hidden: usize, inter: usize) -> ([usize; 6], usize) {
    let sizes = [
        ranks[0] * hidden,
        inter * ranks[0],
        ranks[1] * hidden,
        inter * ranks[1],
        ranks[2] * inter,
        hidden * ranks[2],
    ];
    let mut at = [0usize; 6];
    let mut total = 0;
    for (o, s) in at.iter_mut().zip(sizes) {
        *o = total;
        total += s;
    }
    (at, total)
}

impl<W: FrozenWeight> LoraMlp<W> {
    fn dims(&self) -> Result<(usize, usize)> {
        Ok(self.w[0].dims2())
    }

    fn poisoned() -> candle_core::Error {
        candle_core::Error::Msg("mlp: poisoned".into())
    }
}

impl<W: FrozenWeight> CustomOp2 for LoraMlp<W> {
    fn name(&self) -> &'static str {
        "lora-mlp"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ps: &CpuStorage,
        pl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (inter, hidden) = self.dims()?;
        let x = super::storage::f32_slice(xs, xl, self.name())?;
        let p = super::storage::f32_slice(ps, pl, self.name())?;
        let (at, total) = offsets(self.ranks, hidden, inter);
        if p.len() != total {
            bail!("mlp: {} adapter values, expected {total}", p.len());
        }
        let m = x.len() / hidden;
        let xm = MatRef::row_major(x, m, hidden);
        // One projection with its adapter: `(s x Aᵀ, x Wᵀ + s x Aᵀ Bᵀ)`.
        let project = |i: usize, xm: MatRef, w: Frozen| {
            let (r, (n, k)) = (self.ranks[i], w.dims());
            let a = MatRef::row_major(&p[at[2 * i]..at[2 * i] + r * k], r, k);
            let b = MatRef::row_major(&p[at[2 * i + 1]..at[2 * i + 1] + n * r], n, r);
            let mut low = product(xm, a.t());
            low.iter_mut().for_each(|v| *v *= self.scaling[i]);
            let y = w.forward_plus(xm, MatRef::row_major(&low, m, r), b.t());
            (low, y)
        };
        let w = &self.w;
        let (low_g, gate) = w[0].with_frozen(|w| Ok(project(0, xm, w)))?;
        let (low_u, up) = w[1].with_frozen(|w| Ok(project(1, xm, w)))?;
        let mut h = zeroed(gate.len());
        swiglu_into(&gate, &up, &mut h);
        let hm = MatRef::row_major(&h, m, inter);
        let (low_d, y) = w[2].with_frozen(|w| Ok(project(2, hm, w)))?;
        drop(h);
        *self.saved.lock().map_err(|_| Self::poisoned())? = Some(Saved {
            gate,
            up,
            low: [low_g, low_u, low_d],
        });
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        adapters: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (inter, hidden) = self.dims()?;
        let m = x.elem_count() / hidden;
        let Some(Saved {
            mut gate,
            mut up,
            low,
        }) = self.saved.lock().map_err(|_| Self::poisoned())?.take()
        else {
            bail!("mlp: backward without a forward (or twice)")
        };
        let (at, total) = offsets(self.ranks, hidden, inter);
        let mut dp = vec![0f32; total];
        let want_dx = x.track_op();
        let dx = with_f32_data(g, |gv| {
            with_f32_data(x, |xv| {
                with_f32_data(adapters, |p| {
                    with_frozen3([&self.w[0], &self.w[1], &self.w[2]], |[wg, wu, wd]| {
                        let xm = MatRef::row_major(xv, m, hidden);
                        // One projection's adapter gradients into `dp` and its
                        // `(gl, A)` for the input gradient: with `gl = s g B`,
                        // `dA = glᵀ x`, `dB = gᵀ low`.
                        let mut adapter = |i: usize, gm: MatRef, xm: MatRef| {
                            let (r, n, k) = (self.ranks[i], gm.cols, xm.cols);
                            let b = &p[at[2 * i + 1]..at[2 * i + 1] + n * r];
                            let mut gl = product(gm, MatRef::row_major(b, n, r));
                            gl.iter_mut().for_each(|v| *v *= self.scaling[i]);
                            let glm = MatRef::row_major(&gl, m, r);
                            let da = product(glm.t(), xm);
                            let low = MatRef::row_major(&low[i], m, r);
                            let db = product(gm.t(), low);
                            dp[at[2 * i]..at[2 * i] + r * k].copy_from_slice(&da);
                            dp[at[2 * i + 1]..at[2 * i + 1] + n * r].copy_from_slice(&db);
                            gl
                        };
                        let a_of = |i: usize, k: usize| {
                            let r = self.ranks[i];
                            MatRef::row_major(&p[at[2 * i]..at[2 * i] + r * k], r, k)
                        };
                        // Down: dh = g W_d + gl_d A_d.
                        let gm = MatRef::row_major(gv, m, hidden);
                        let mut h = zeroed(gate.len());
                        swiglu_into(&gate, &up, &mut h);
                        let gl_d = adapter(2, gm, MatRef::row_major(&h, m, inter));
                        drop(h);
                        let dh = wd.backward_plus(
                            gm,
                            MatRef::row_major(&gl_d, m, self.ranks[2]),
                            a_of(2, inter),
                        );
                        // SwiGLU, its gradients written over its saved inputs.
                        swiglu_grads_in_place(&mut gate, &mut up, &dh);
                        drop(dh);
                        let (dgate, dup) = (gate, up);
                        // Gate and up, their input gradients summed in one buffer.
                        let dgm = MatRef::row_major(&dgate, m, inter);
                        let dum = MatRef::row_major(&dup, m, inter);
                        let gl_g = adapter(0, dgm, xm);
                        let gl_u = adapter(1, dum, xm);
                        Ok(want_dx.then(|| {
                            let mut dx = wg.backward_plus(
                                dgm,
                                MatRef::row_major(&gl_g, m, self.ranks[0]),
                                a_of(0, hidden),
                            );
                            wu.backward_plus_into(
                                dum,
                                MatRef::row_major(&gl_u, m, self.ranks[1]),
                                a_of(1, hidden),
                                &mut dx,
                                true,
                            );
                            dx
                        }))
                    })
                })
            })
        })?;
        let dev = x.device();
        let dx = dx
            .map(|d| Tensor::from_vec(d, x.shape(), dev))
            .transpose()?;
        Ok((dx, Some(Tensor::from_vec(dp, total, dev)?)))
    }
}
