// Heads placed for attention and rotated (rope.rs): `[B, T, n, d]` in, `[B, n, T, d]` out,
// each head rotated by its position's `cos`, `sin: [B, T, d/2]` in transformers'
// `rotate_half` form, rounding where it rounds (each product, then the sum); the
// backward rotates back and places the gradient as the input lay. One thread per pair
// (i, i + d/2) of one head at one position. The forward's input rows (one a position)
// are `stride` elements apart: `n · d` when contiguous, wider when the heads are columns
// of a larger product (q and k in q/k/v taken as one, joint.rs).
//   forward:  o₁ = x₁ c − x₂ s,  o₂ = x₂ c + x₁ s
//   backward: dx₁ = do₁ c + do₂ s,  dx₂ = do₂ c − do₁ s
#include "common.cuh"

template <typename T>
__device__ void rope_fwd(const T *x, const T *cos, const T *sin, T *out, int b, int t, int n, int d,
                         long stride) {
    const int h = d / 2;
    const long total = (long)b * t * n * h;
    for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < total; idx += (long)gridDim.x * blockDim.x) {
        const int i = idx % h;
        long rest = idx / h;
        const int head = rest % n;
        rest /= n;
        const long bt = rest;  // b · t + position
        const long pos = bt % t, bb = bt / t;
        const T *in = x + bt * stride + (long)head * d;
        const float x1 = to_f(in[i]), x2 = to_f(in[i + h]);
        const float c = to_f(cos[bt * h + i]), s = to_f(sin[bt * h + i]);
        T *o = out + ((bb * n + head) * t + pos) * d;
        o[i] = from_f<T>(round_to<T>(x1 * c) + round_to<T>(-x2 * s));
        o[i + h] = from_f<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
    }
}

template <typename T>
__device__ void rope_bwd(const T *dout, const T *cos, const T *sin, T *dx, int b, int t, int n, int d) {
    const int h = d / 2;
    const long total = (long)b * t * n * h;
    for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < total; idx += (long)gridDim.x * blockDim.x) {
        const int i = idx % h;
        long rest = idx / h;
        const int head = rest % n;
        rest /= n;
        const long bt = rest;
        const long pos = bt % t, bb = bt / t;
        const T *g = dout + ((bb * n + head) * t + pos) * d;
        const float g1 = to_f(g[i]), g2 = to_f(g[i + h]);
        const float c = to_f(cos[bt * h + i]), s = to_f(sin[bt * h + i]);
        T *o = dx + (bt * n + head) * d;
        o[i] = from_f<T>(round_to<T>(g1 * c) + round_to<T>(g2 * s));
        o[i + h] = from_f<T>(round_to<T>(g2 * c) - round_to<T>(g1 * s));
    }
}

#define ENTRIES(T, N)                                                                          \
    extern "C" __global__ void rope_heads_fwd_##N(const T *x, const T *cos, const T *sin,       \
                                                  T *out, int b, int t, int n, int d,           \
                                                  long stride) {                                \
        rope_fwd<T>(x, cos, sin, out, b, t, n, d, stride);                                     \
    }                                                                                          \
    extern "C" __global__ void rope_heads_bwd_##N(const T *dout, const T *cos, const T *sin,    \
                                                  T *dx, int b, int t, int n, int d) {          \
        rope_bwd<T>(dout, cos, sin, dx, b, t, n, d);                                           \
    }
FOR_EACH_DTYPE(ENTRIES)
