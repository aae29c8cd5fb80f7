// Decode attention for a whole batch in two launches a layer (decode.rs): each row of the
// KV pool (one sequence) has one new query token, R query heads per kv head, and attends to
// its first `lens[row]` cached positions. Flash-decoding: the cached length is split into
// `splits` chunks so that a batch of single-token queries still fills the GPU; each block
// takes one (row, kv head, chunk), reads each key and value of its chunk once for all R
// query heads, and keeps an online softmax per head:
//   s_j = round(q · k_j) · scale      (the score rounded to the compute dtype, as cuBLAS's
//                                      product is in the composed form)
//   m = max_j s_j,  l = Σ_j e^(s_j − m),  a = Σ_j e^(s_j − m) v_j
// The combine launch merges the chunks of a (row, kv head) for each query head:
//   M = max_c m_c,  L = Σ_c l_c e^(m_c − M),  o = Σ_c a_c e^(m_c − M) / L
// Everything is f32 after the loads; the output is rounded once to the compute dtype.
#include "common.cuh"

// Query heads a kv head may have (R), and f32 values of a head a lane holds (d / 32).
#define MAX_REPS 8
#define MAX_LANE 4
#define WARPS 4

template <typename T>
__device__ void split_attn(const T *q, const T *k, const T *v, const unsigned int *lens,
                           float *part_acc, float *part_ml, int g, int cap, int d, int reps,
                           int splits, int chunk, float scale) {
    __shared__ float sh_m[WARPS][MAX_REPS];
    __shared__ float sh_l[WARPS][MAX_REPS];
    extern __shared__ float sh_acc[]; // [WARPS][reps][d]
    const int split = blockIdx.x;
    const long bg = blockIdx.y; // row · g + kv head
    const long row = bg / g;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per_lane = d >> 5;
    const int len = (int)lens[row];
    const int start = split * chunk;
    const int end = min(start + chunk, len);

    float qr[MAX_REPS][MAX_LANE];
    float acc[MAX_REPS][MAX_LANE];
    float m[MAX_REPS], l[MAX_REPS];
    const T *qb = q + bg * reps * d;
#pragma unroll
    for (int r = 0; r < MAX_REPS; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_LANE; i++) {
            acc[r][i] = 0.0f;
            qr[r][i] = (r < reps && i < per_lane) ? to_f(qb[r * d + lane * per_lane + i]) : 0.0f;
        }
    }
    const T *kb = k + bg * (long)cap * d;
    const T *vb = v + bg * (long)cap * d;
    for (int j = start + warp; j < end; j += WARPS) {
        float kj[MAX_LANE], vj[MAX_LANE];
#pragma unroll
        for (int i = 0; i < MAX_LANE; i++) {
            kj[i] = i < per_lane ? to_f(kb[(long)j * d + lane * per_lane + i]) : 0.0f;
            vj[i] = i < per_lane ? to_f(vb[(long)j * d + lane * per_lane + i]) : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < MAX_REPS; r++) {
            if (r >= reps) break;
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < MAX_LANE; i++) dot += qr[r][i] * kj[i];
            const float s = round_to<T>(warp_sum(dot)) * scale;
            const float m_new = fmaxf(m[r], s);
            const float corr = expf(m[r] - m_new); // 0 on the first key (m = −∞)
            const float p = expf(s - m_new);
            l[r] = l[r] * corr + p;
#pragma unroll
            for (int i = 0; i < MAX_LANE; i++) acc[r][i] = acc[r][i] * corr + p * vj[i];
            m[r] = m_new;
        }
    }
    // The block's four warps merged: each warp's (m, l, a) into shared memory, then every
    // thread merges the values of its (head, element) pairs.
    // (Loops to the fixed bounds with the guard inside keep the arrays in registers.)
#pragma unroll
    for (int r = 0; r < MAX_REPS; r++) {
        if (r < reps && lane == 0) {
            sh_m[warp][r] = m[r];
            sh_l[warp][r] = l[r];
        }
#pragma unroll
        for (int i = 0; i < MAX_LANE; i++)
            if (r < reps && i < per_lane)
                sh_acc[(warp * reps + r) * d + lane * per_lane + i] = acc[r][i];
    }
    __syncthreads();
    const long part = bg * splits + split;
    for (int e = threadIdx.x; e < reps * d; e += blockDim.x) {
        const int r = e / d;
        float mm = -INFINITY;
        for (int w = 0; w < WARPS; w++) mm = fmaxf(mm, sh_m[w][r]);
        float a = 0.0f, ll = 0.0f;
        if (mm > -INFINITY) {
            for (int w = 0; w < WARPS; w++) {
                const float c = expf(sh_m[w][r] - mm);
                a += sh_acc[w * reps * d + e] * c;
                ll += sh_l[w][r] * c;
            }
        }
        part_acc[part * reps * d + e] = a;
        if (e % d == 0) {
            part_ml[(part * reps + r) * 2] = mm;
            part_ml[(part * reps + r) * 2 + 1] = ll;
        }
    }
}

template <typename T>
__device__ void combine(const float *part_acc, const float *part_ml, T *out, int d, int reps,
                        int splits) {
    const long bg = blockIdx.x;
    for (int e = threadIdx.x; e < reps * d; e += blockDim.x) {
        const int r = e / d;
        float mm = -INFINITY;
        for (int s = 0; s < splits; s++) mm = fmaxf(mm, part_ml[((bg * splits + s) * reps + r) * 2]);
        float a = 0.0f, ll = 0.0f;
        for (int s = 0; s < splits; s++) {
            const long part = bg * splits + s;
            const float ms = part_ml[(part * reps + r) * 2];
            if (ms == -INFINITY) continue; // an empty chunk
            const float c = expf(ms - mm);
            a += part_acc[part * reps * d + e] * c;
            ll += part_ml[(part * reps + r) * 2 + 1] * c;
        }
        out[bg * reps * d + e] = from_f<T>(ll > 0.0f ? a / ll : 0.0f);
    }
}

#define ENTRIES(T, N)                                                                          \
    extern "C" __global__ void decode_attn_split_##N(                                          \
        const T *q, const T *k, const T *v, const unsigned int *lens, float *part_acc,         \
        float *part_ml, int g, int cap, int d, int reps, int splits, int chunk, float scale) { \
        split_attn<T>(q, k, v, lens, part_acc, part_ml, g, cap, d, reps, splits, chunk, scale); \
    }                                                                                          \
    extern "C" __global__ void decode_attn_combine_##N(const float *part_acc,                  \
                                                       const float *part_ml, T *out, int d,    \
                                                       int reps, int splits) {                 \
        combine<T>(part_acc, part_ml, out, d, reps, splits);                                   \
    }
FOR_EACH_DTYPE(ENTRIES)
