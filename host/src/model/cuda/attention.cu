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
    }
FOR_EACH_DTYPE(ENTRIES)
