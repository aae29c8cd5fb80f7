// RMSNorm over the last dim with a frozen weight, forward and backward (rms_norm.rs), one
// block per row, rounding where transformers (and the composed form) round: the
// normalised row in the compute dtype, then its product with the weight.
//   forward:  r = 1 / √(mean(x²) + eps),  x̂ = round(x · r),  y = round(w ⊙ x̂)
//   backward: g = round(dy ⊙ w),  dx = r · g − x · r³ · (Σ g ⊙ x) / n
//   with the residual add (inference): s = round(x + a), then the forward on s
#include "common.cuh"

template <typename T>
__device__ float row_scale(const T *x, int n, float eps, float *sh) {
    float ss = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float v = to_f(x[j]);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    return 1.0f / sqrtf(ss / n + eps);
}

template <typename T>
__device__ void rms_fwd(const T *x, const T *w, T *y, int n, float eps) {
    __shared__ float sh[32];
    const long row = blockIdx.x;
    const T *xr = x + row * n;
    const float r = row_scale(xr, n, eps, sh);
    T *yr = y + row * n;
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        yr[j] = from_f<T>(round_to<T>(to_f(xr[j]) * r) * to_f(w[j]));
}

template <typename T>
__device__ void rms_bwd(const T *x, const T *w, const T *dy, T *dx, int n, float eps) {
    __shared__ float sh[32];
    const long row = blockIdx.x;
    const T *xr = x + row * n;
    const T *dyr = dy + row * n;
    const float r = row_scale(xr, n, eps, sh);
    float dot = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        dot += round_to<T>(to_f(dyr[j]) * to_f(w[j])) * to_f(xr[j]);
    dot = block_sum(dot, sh);
    const float c = r * r * r * dot / n;
    T *dxr = dx + row * n;
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        dxr[j] = from_f<T>(r * round_to<T>(to_f(dyr[j]) * to_f(w[j])) - to_f(xr[j]) * c);
}

// The residual add and the next norm in one pass (inference): s = round(x + a), written
// out, then the forward above on s.
template <typename T>
__device__ void add_rms_fwd(const T *x, const T *a, const T *w, T *sum, T *y, int n, float eps) {
    __shared__ float sh[32];
    const long row = blockIdx.x;
    const T *xr = x + row * n;
    const T *ar = a + row * n;
    T *sr = sum + row * n;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float v = round_to<T>(to_f(xr[j]) + to_f(ar[j]));
        sr[j] = from_f<T>(v);
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(block_sum(ss, sh) / n + eps);
    T *yr = y + row * n;
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        yr[j] = from_f<T>(round_to<T>(to_f(sr[j]) * r) * to_f(w[j]));
}

#define ENTRIES(T, N)                                                                          \
    extern "C" __global__ void rms_norm_fwd_##N(const T *x, const T *w, T *y, int n, float eps) { \
        rms_fwd<T>(x, w, y, n, eps);                                                           \
    }                                                                                          \
    extern "C" __global__ void rms_norm_bwd_##N(const T *x, const T *w, const T *dy, T *dx,     \
                                                int n, float eps) {                             \
        rms_bwd<T>(x, w, dy, dx, n, eps);                                                      \
    }                                                                                          \
    extern "C" __global__ void add_rms_norm_fwd_##N(const T *x, const T *a, const T *w, T *sum, \
                                                    T *y, int n, float eps) {                  \
        add_rms_fwd<T>(x, a, w, sum, y, n, eps);                                               \
    }
FOR_EACH_DTYPE(ENTRIES)
