// Shared by the fused ops' kernels: conversions between the storage types (f32, bf16,
// f16) and f32, rounding through a storage type (to round exactly where the composed
// form rounds), and block-wide reductions. Every kernel computes in f32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

// `x` rounded to T and read back: where candle's composed form stores an intermediate in
// the compute dtype, the kernel rounds there too, so that the two agree to the last bit
// more often than not.
template <typename T> __device__ __forceinline__ float round_to(float x) {
    return to_f(from_f<T>(x));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The sum of `v` over the block, returned to every thread. `sh` holds 32 floats; the
// leading barrier lets a block call this twice in a row with the same `sh`.
__device__ __forceinline__ float block_sum(float v, float *sh) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? sh[lane] : 0.0f);
}

__device__ __forceinline__ float block_max(float v, float *sh) {
    v = warp_max(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? sh[lane] : -INFINITY);
}

// One `extern "C"` entry per storage type, named `<op>_f32`, `<op>_bf16`, `<op>_f16`.
#define FOR_EACH_DTYPE(M) M(float, f32) M(__nv_bfloat16, bf16) M(__half, f16)
