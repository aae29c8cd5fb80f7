// The row-wise half of the fused attention (attention.rs): the softmax of one score row
// with its scale and additive mask, its recomputation from saved statistics, and the
// softmax's backward. The products around them (Q Kᵀ, P V and the backward's four) are
// cuBLAS's. One block per score row; a row is `t` keys long.
//
// Rows are numbered as the scores `[B, g, R·T, T]` lie: row `r` belongs to batch
// `r / rows_per_batch` and query position `r % t` (the R query heads of a group are stacked
// as R blocks of T rows), and reads the mask row `mask[b, i, :]` of `[B, T, T]`.
#include "common.cuh"

// p = softmax(scale · s + mask) over the row, in f32, stored as T; stats[2r] = the row's
// max, stats[2r + 1] = 1 / Σ exp(· − max), for the backward's recomputation.
template <typename T>
__device__ void softmax_fwd(const T *s, const float *mask, T *p, float *stats, int t,
                            long rows_per_batch, float scale) {
    __shared__ float sh[32];
    const long row = blockIdx.x;
    const long b = row / rows_per_batch;
    const long i = row % t;
    const T *srow = s + row * t;
    const float *m = mask + (b * t + i) * t;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < t; j += blockDim.x) mx = fmaxf(mx, to_f(srow[j]) * scale + m[j]);
    mx = block_max(mx, sh);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < t; j += blockDim.x) sum += expf(to_f(srow[j]) * scale + m[j] - mx);
    sum = block_sum(sum, sh);
    const float inv = 1.0f / sum;
    T *prow = p + row * t;
    for (int j = threadIdx.x; j < t; j += blockDim.x)
        prow[j] = from_f<T>(expf(to_f(srow[j]) * scale + m[j] - mx) * inv);
    if (threadIdx.x == 0) {
        stats[2 * row] = mx;
        stats[2 * row + 1] = inv;
    }
}

// The same p from the same scores and the saved statistics (no reductions).
template <typename T>
__device__ void softmax_recompute(const T *s, const float *mask, const float *stats, T *p, int t,
                                  long rows_per_batch, float scale) {
    const long row = blockIdx.x;
    const long b = row / rows_per_batch;
    const long i = row % t;
    const T *srow = s + row * t;
    const float *m = mask + (b * t + i) * t;
    const float mx = stats[2 * row], inv = stats[2 * row + 1];
    T *prow = p + row * t;
    for (int j = threadIdx.x; j < t; j += blockDim.x)
        prow[j] = from_f<T>(expf(to_f(srow[j]) * scale + m[j] - mx) * inv);
}

// The softmax's backward, with the scale of the scores folded in:
//   dS_j = scale · p_j (dP_j − Σ_k p_k dP_k)
template <typename T>
__device__ void softmax_bwd(const T *p, const T *dp, T *ds, int t, float scale) {
    __shared__ float sh[32];
    const long row = blockIdx.x;
    const T *prow = p + row * t;
    const T *dprow = dp + row * t;
    float dot = 0.0f;
    for (int j = threadIdx.x; j < t; j += blockDim.x) dot += to_f(prow[j]) * to_f(dprow[j]);
    dot = block_sum(dot, sh);
    T *dsrow = ds + row * t;
    for (int j = threadIdx.x; j < t; j += blockDim.x)
        dsrow[j] = from_f<T>(scale * to_f(prow[j]) * (to_f(dprow[j]) - dot));
}

// The same two passes with the row held in registers, REG elements a thread (rows of up
// to REG · 1024 keys): the scores and mask are read once, not three times.
#define REG 8

template <typename T>
__device__ void softmax_fwd_reg(const T *s, const float *mask, T *p, float *stats, int t,
                                long rows_per_batch, float scale) {
    __shared__ float sh[32];
    const long row = blockIdx.x;
    const long b = row / rows_per_batch;
    const long i = row % t;
    const T *srow = s + row * t;
    const float *m = mask + (b * t + i) * t;
    float v[REG];
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < REG; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        v[k] = j < t ? to_f(srow[j]) * scale + m[j] : -INFINITY;
        mx = fmaxf(mx, v[k]);
    }
    mx = block_max(mx, sh);
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < REG; ++k) {
        v[k] = expf(v[k] - mx);  // 0 past the row's end
        sum += v[k];
    }
    sum = block_sum(sum, sh);
    const float inv = 1.0f / sum;
    T *prow = p + row * t;
#pragma unroll
    for (int k = 0; k < REG; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < t) prow[j] = from_f<T>(v[k] * inv);
    }
    if (threadIdx.x == 0) {
        stats[2 * row] = mx;
        stats[2 * row + 1] = inv;
    }
}

template <typename T>
__device__ void softmax_bwd_reg(const T *p, const T *dp, T *ds, int t, float scale) {
    __shared__ float sh[32];
    const long row = blockIdx.x;
    const T *prow = p + row * t;
    const T *dprow = dp + row * t;
    float pv[REG], dv[REG];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < REG; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        pv[k] = j < t ? to_f(prow[j]) : 0.0f;
        dv[k] = j < t ? to_f(dprow[j]) : 0.0f;
        dot += pv[k] * dv[k];
    }
    dot = block_sum(dot, sh);
    T *dsrow = ds + row * t;
#pragma unroll
    for (int k = 0; k < REG; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < t) dsrow[j] = from_f<T>(scale * pv[k] * (dv[k] - dot));
    }
}

#define ENTRIES(T, N)                                                                          \
    extern "C" __global__ void attn_softmax_fwd_##N(const T *s, const float *mask, T *p,        \
                                                    float *stats, int t, long rows_per_batch,   \
                                                    float scale) {                              \
        softmax_fwd<T>(s, mask, p, stats, t, rows_per_batch, scale);                            \
    }                                                                                          \
    extern "C" __global__ void attn_softmax_recompute_##N(const T *s, const float *mask,        \
                                                          const float *stats, T *p, int t,      \
                                                          long rows_per_batch, float scale) {   \
        softmax_recompute<T>(s, mask, stats, p, t, rows_per_batch, scale);                      \
    }                                                                                          \
    extern "C" __global__ void attn_softmax_bwd_##N(const T *p, const T *dp, T *ds, int t,      \
                                                    float scale) {                              \
        softmax_bwd<T>(p, dp, ds, t, scale);                                                   \
    }                                                                                          \
    extern "C" __global__ void attn_softmax_fwd_reg_##N(const T *s, const float *mask, T *p,    \
                                                        float *stats, int t,                    \
                                                        long rows_per_batch, float scale) {     \
        softmax_fwd_reg<T>(s, mask, p, stats, t, rows_per_batch, scale);                        \
    }                                                                                          \
    extern "C" __global__ void attn_softmax_bwd_reg_##N(const T *p, const T *dp, T *ds, int t,  \
                                                        float scale) {                          \
        softmax_bwd_reg<T>(p, dp, ds, t, scale);                                               \
    }
FOR_EACH_DTYPE(ENTRIES)
