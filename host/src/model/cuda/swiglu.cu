// SwiGLU `silu(gate) ⊙ up`, forward and backward (swiglu.rs), elementwise, rounding where
// the composed form rounds (silu's result, then the product; in the backward each
// product of the chain rule).
//   σ = 1 / (1 + e^−g),  s = round(g σ),  y = round(s u)
//   du = round(dy s),  dg = round(round(dy u) · σ (1 + g (1 − σ)))
#include "common.cuh"

template <typename T>
__device__ void swiglu_fwd(const T *g, const T *u, T *y, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const float gv = to_f(g[i]);
        const float s = round_to<T>(gv / (1.0f + expf(-gv)));
        y[i] = from_f<T>(s * to_f(u[i]));
    }
}

template <typename T>
__device__ void swiglu_bwd(const T *g, const T *u, const T *dy, T *dg, T *du, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const float gv = to_f(g[i]), uv = to_f(u[i]), d = to_f(dy[i]);
        const float sig = 1.0f / (1.0f + expf(-gv));
        const float s = round_to<T>(gv * sig);
        du[i] = from_f<T>(d * s);
        dg[i] = from_f<T>(round_to<T>(d * uv) * sig * (1.0f + gv * (1.0f - sig)));
    }
}

// The same forward over the output of gate and up taken as one product, `gu: [rows, 2w]`
// (gate's w columns, then up's) into `y: [rows, w]`: no copy of either half first.
template <typename T>
__device__ void swiglu_joint_fwd(const T *gu, T *y, long rows, long w) {
    const long n = rows * w;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long r = i / w, j = i % w;
        const float gv = to_f(gu[r * 2 * w + j]);
        const float s = round_to<T>(gv / (1.0f + expf(-gv)));
        y[i] = from_f<T>(s * to_f(gu[r * 2 * w + w + j]));
    }
}

#define ENTRIES(T, N)                                                                          \
    extern "C" __global__ void swiglu_fwd_##N(const T *g, const T *u, T *y, long n) {          \
        swiglu_fwd<T>(g, u, y, n);                                                             \
    }                                                                                          \
    extern "C" __global__ void swiglu_bwd_##N(const T *g, const T *u, const T *dy, T *dg,       \
                                              T *du, long n) {                                  \
        swiglu_bwd<T>(g, u, dy, dg, du, n);                                                    \
    }                                                                                          \
    extern "C" __global__ void swiglu_joint_fwd_##N(const T *gu, T *y, long rows, long w) {    \
        swiglu_joint_fwd<T>(gu, y, rows, w);                                                   \
    }
FOR_EACH_DTYPE(ENTRIES)
