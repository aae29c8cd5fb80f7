// Target log-probs and entropies from a chunk of logits, and their backward
// (logprobs.rs), one block per row of `v` logits, everything in f32. With z a row, t its
// target, lse = log Σ exp z, p = exp(z − lse):
//   logp = z_t − lse,   H = −Σ p log p = lse − Σ p z
//   dz_j = g_l ([j = t] − p_j) − g_h p_j (z_j − lse + H)
// where (g_l, g_h) are the incoming gradients of (logp, H).
#include "common.cuh"

template <typename T>
__device__ void lp_fwd(const T *z, const unsigned *targets, float *out, float *lse_out, int v) {
    __shared__ float sh[32];
    const long row = blockIdx.x;
    const T *zr = z + row * v;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, to_f(zr[j]));
    mx = block_max(mx, sh);
    float se = 0.0f, sz = 0.0f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        const float zj = to_f(zr[j]);
        const float e = expf(zj - mx);
        se += e;
        sz += e * zj;
    }
    se = block_sum(se, sh);
    sz = block_sum(sz, sh);
    if (threadIdx.x == 0) {
        const float lse = mx + logf(se);
        const unsigned t = targets[row];
        out[2 * row] = (t < (unsigned)v ? to_f(zr[t]) : NAN) - lse;
        out[2 * row + 1] = lse - sz / se;
        lse_out[row] = lse;
    }
}

template <typename T>
__device__ void lp_bwd(const T *z, const unsigned *targets, const float *out, const float *lse,
                       const float *grad, T *dz, int v) {
    const long row = blockIdx.x;
    const T *zr = z + row * v;
    T *dr = dz + row * v;
    const float l = lse[row], h = out[2 * row + 1];
    const float gl = grad[2 * row], gh = grad[2 * row + 1];
    const unsigned t = targets[row];
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        const float zj = to_f(zr[j]);
        const float p = expf(zj - l);
        dr[j] = from_f<T>(((unsigned)j == t ? gl : 0.0f) - gl * p - gh * p * (zj - l + h));
    }
}

#define ENTRIES(T, N)                                                                          \
    extern "C" __global__ void logprobs_fwd_##N(const T *z, const unsigned *targets, float *out, \
                                                float *lse, int v) {                            \
        lp_fwd<T>(z, targets, out, lse, v);                                                    \
    }                                                                                          \
    extern "C" __global__ void logprobs_bwd_##N(const T *z, const unsigned *targets,            \
                                                const float *out, const float *lse,             \
                                                const float *grad, T *dz, int v) {              \
        lp_bwd<T>(z, targets, out, lse, grad, dz, v);                                          \
    }
FOR_EACH_DTYPE(ENTRIES)
