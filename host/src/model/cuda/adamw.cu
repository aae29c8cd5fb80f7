// AdamW's update of one f32 parameter in two elementwise passes (adamw.rs), in place:
// the moments, kept interleaved as `mv[2i] = m_i`, `mv[2i + 1] = v_i`, then the parameter.
// The composed form (rl::optim::AdamW) takes about a dozen kernels and as many fresh
// buffers a parameter; a LoRA model has hundreds of parameters.
#include "common.cuh"

// m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g², with 1 − β passed in (computed in f64
// as the composed form does: 1 − 0.999f in f32 is 1.3e-5 away from 0.001).
extern "C" __global__ void adamw_moments_f32(float *mv, const float *g, long n, float beta1,
                                             float rest1, float beta2, float rest2) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const float gi = g[i];
        mv[2 * i] = beta1 * mv[2 * i] + rest1 * gi;
        mv[2 * i + 1] = beta2 * mv[2 * i + 1] + rest2 * (gi * gi);
    }
}

// p ← p·(1 − lr·wd) − lr · (m / bc1) / (√(v / bc2) + ε), with bc1 = 1 − β1ᵗ, bc2 = 1 − β2ᵗ
// passed as their reciprocals: candle divides a tensor by a number as a product with its
// reciprocal, and so does this.
extern "C" __global__ void adamw_apply_f32(float *p, const float *mv, long n, float lr,
                                           float decay, float inv_bc1, float inv_bc2, float eps) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const float step = (mv[2 * i] * inv_bc1) / (sqrtf(mv[2 * i + 1] * inv_bc2) + eps);
        p[i] = p[i] * decay - step * lr;
    }
}
