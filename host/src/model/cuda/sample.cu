// A decode step's draw for the whole batch in one launch (sample.rs), one block a row of
// f32 logits, the rules of the composed draw (sampler/device_draw.rs) it must equal:
//   s = logits / T,  lse = log Σ e^s,  logp = s − lse,  p = e^logp
//   top-k: keep s ≥ the k-th largest s (ties kept)
//   top-p: within the top-k set (p elsewhere 0), keep p ≥ the smallest p of the shortest
//          most-likely-first prefix whose mass reaches top_p (all of the set if it never
//          does; the mass is not renormalised)
//   min-p: keep p ≥ min_p · max p
//   w = p on the kept tokens, 0 elsewhere; the token is the first index (vocabulary order)
//   where the running sum of w reaches u · Σ w, clamped to the last; kept = w[token] > 0
//   greedy (T ≤ 0): the first index of the largest logit, kept = 1, logp over s = logits
// Out: [B, 3] f32 (token, logp, kept).
//
// The thresholds are found exactly by radix selection over the values' bits (four passes
// of 8 bits, the most significant first) instead of the composed form's bisection: counts
// for top-k, masses for top-p, the masses summed as 2⁻⁴⁸ fixed point in integers so that
// the order of the atomic additions cannot change the result (the same seed draws the same
// token, whatever else is in the batch).
#include "common.cuh"

#define THREADS 1024
#define BINS 256

// f32 → u32 that orders as the floats do.
__device__ __forceinline__ unsigned int order_key(float x) {
    const unsigned int b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The mass of a probability in 2⁻⁴⁸ units.
__device__ __forceinline__ unsigned long long fixed(float p) {
    return (unsigned long long)((double)p * 281474976710656.0);
}

// (value, index) of the larger value, the smaller index on ties.
__device__ __forceinline__ void arg_max_pair(float &v, int &i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

__device__ int block_argmax(float v, int i) {
    __shared__ float sv[32];
    __shared__ int si[32];
    for (int o = 16; o > 0; o >>= 1)
        arg_max_pair(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? sv[lane] : -INFINITY;
        i = lane < (int)(blockDim.x >> 5) ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1)
            arg_max_pair(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
        if (lane == 0) si[0] = i;
    }
    __syncthreads();
    return si[0];
}

__device__ int block_min_int(int v, int *sh) {
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? sh[lane] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The key of the k-th largest s of the row (its order_key).
__device__ unsigned int kth_largest(const float *row, int v, float inv_t, int k) {
    __shared__ unsigned int hist[BINS];
    __shared__ unsigned int chosen, left;
    unsigned int prefix = 0, mask = 0;
    if (threadIdx.x == 0) left = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < BINS; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < v; i += blockDim.x) {
            const unsigned int key = order_key(row[i] * inv_t);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned int acc = 0, digit = 0;
            for (int b = BINS - 1; b >= 0; b--) {
                if (acc + hist[b] >= left) {
                    digit = b;
                    break;
                }
                acc += hist[b];
            }
            left -= acc;
            chosen = digit;
        }
        __syncthreads();
        prefix |= chosen << shift;
        mask |= 255u << shift;
    }
    return prefix;
}

// The value key t (bits of a non-negative probability) of the top-p cut: the largest t with
// mass(within ≥ t) ≥ top_p, where within is p on the top-k set and 0 elsewhere; 0 when the
// whole set's mass falls short.
__device__ unsigned int top_p_cut(const float *row, int v, float inv_t, float lse, bool has_k,
                                  unsigned int k_key, float top_p) {
    __shared__ unsigned long long mass[BINS];
    __shared__ unsigned int chosen;
    __shared__ unsigned long long above;
    __shared__ bool reached;
    const unsigned long long want = fixed(top_p);
    unsigned int prefix = 0, mask = 0;
    if (threadIdx.x == 0) {
        above = 0;
        reached = true;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < BINS; b += blockDim.x) mass[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < v; i += blockDim.x) {
            const float s = row[i] * inv_t;
            if (has_k && order_key(s) < k_key) continue;
            const float p = expf(s - lse);
            const unsigned int key = __float_as_uint(p);
            if ((key & mask) == prefix) atomicAdd(&mass[(key >> shift) & 255u], fixed(p));
        }
        __syncthreads();
        if (threadIdx.x == 0 && reached) {
            unsigned long long acc = 0;
            int digit = -1;
            for (int b = BINS - 1; b >= 0; b--) {
                if (above + acc + mass[b] >= want) {
                    digit = b;
                    break;
                }
                acc += mass[b];
            }
            if (digit < 0) {
                reached = false; // the set's mass never reaches top_p: keep all of it
                chosen = 0;
            } else {
                above += acc;
                chosen = digit;
            }
        }
        __syncthreads();
        if (!reached) return 0;
        prefix |= chosen << shift;
        mask |= 255u << shift;
    }
    return prefix;
}

__device__ void sample_row(const float *logits, const float *u, float *out, int v, float inv_t,
                           int greedy, int top_k, float top_p, float min_p) {
    __shared__ float sh[32];
    __shared__ int shi[32];
    const long r = blockIdx.x;
    const float *row = logits + r * v;
    // The row's max and log-sum-exp of s.
    float mx = -INFINITY;
    int arg = 0x7fffffff;
    for (int i = threadIdx.x; i < v; i += blockDim.x) arg_max_pair(mx, arg, row[i] * inv_t, i);
    arg = block_argmax(mx, arg);
    const float max_s = row[arg] * inv_t;
    float se = 0.0f;
    for (int i = threadIdx.x; i < v; i += blockDim.x) se += expf(row[i] * inv_t - max_s);
    const float lse = logf(block_sum(se, sh)) + max_s;
    if (greedy) {
        if (threadIdx.x == 0) {
            out[r * 3] = (float)arg;
            out[r * 3 + 1] = row[arg] * inv_t - lse;
            out[r * 3 + 2] = 1.0f;
        }
        return;
    }
    const bool has_k = top_k > 0 && top_k < v;
    const unsigned int k_key = has_k ? kth_largest(row, v, inv_t, top_k) : 0u;
    const bool has_p = top_p < 1.0f;
    const unsigned int p_key = has_p ? top_p_cut(row, v, inv_t, lse, has_k, k_key, top_p) : 0u;
    const float p_floor = min_p > 0.0f ? expf(max_s - lse) * min_p : 0.0f;
    // w_i, 0 off the kept tokens.
    auto weight = [&](int i) -> float {
        const float s = row[i] * inv_t;
        if (has_k && order_key(s) < k_key) return 0.0f;
        const float p = expf(s - lse);
        if (has_p && __float_as_uint(p) < p_key) return 0.0f;
        if (min_p > 0.0f && p < p_floor) return 0.0f;
        return p;
    };
    // Each thread's contiguous chunk of the row: its sum, the block's exclusive scan of
    // those (deterministic), then the first index whose running sum reaches the target.
    const int chunk = (v + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * chunk, hi = min(lo + chunk, v);
    float mine = 0.0f;
    for (int i = lo; i < hi; i++) mine += weight(i);
    __shared__ float scan[THREADS];
    scan[threadIdx.x] = mine;
    __syncthreads();
    for (int o = 1; o < (int)blockDim.x; o <<= 1) {
        const float add = threadIdx.x >= (unsigned)o ? scan[threadIdx.x - o] : 0.0f;
        __syncthreads();
        scan[threadIdx.x] += add;
        __syncthreads();
    }
    const float total = scan[blockDim.x - 1];
    const float target = u[r] * total;
    // Only a thread whose chunk ends at or past the target walks it, from the sum before it.
    float run = threadIdx.x == 0 ? 0.0f : scan[threadIdx.x - 1];
    int found = 0x7fffffff;
    if (lo < hi && scan[threadIdx.x] >= target) {
        for (int i = lo; i < hi; i++) {
            run += weight(i);
            if (run >= target) {
                found = i;
                break;
            }
        }
    }
    const int token = min(block_min_int(found, shi), v - 1);
    if (threadIdx.x == 0) {
        out[r * 3] = (float)token;
        out[r * 3 + 1] = row[token] * inv_t - lse;
        out[r * 3 + 2] = weight(token) > 0.0f ? 1.0f : 0.0f;
    }
}

extern "C" __global__ void sample_rows_f32(const float *logits, const float *u, float *out, int v,
                                           float inv_t, int greedy, int top_k, float top_p,
                                           float min_p) {
    sample_row(logits, u, out, v, inv_t, greedy, top_k, top_p, min_p);
}
