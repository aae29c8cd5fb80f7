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

#define ENTRIES(T, N)                                                                          \
    extern "C" __global__ void swiglu_fwd_##N(const T *g, const T *u, T *y, long n) {          \
        swiglu_fwd<T>(g, u, y, n);                                                             \
    }                                                                                          \
    extern "C" __global__ void swiglu_bwd_##N(const T *g, const T *u, const T *dy, T *dg,       \
                                              T *du, long n) {                                  \
        swiglu_bwd<T>(g, u, dy, dg, du, n);                                                    \
    }
FOR_EACH_DTYPE(ENTRIES)
