// FlashAttention-2's forward and backward for the fused attention (flash.rs): causal,
// grouped-query, half precision (bf16, f16), head sizes 64 and 128, on the tensor cores
// (`mma.sync` m16n8k16, f32 accumulation). Nothing `T × T` is ever written to memory:
// the forward keeps a running max and sum per query row (the online softmax) and leaves
// one number a row, its log-sum-exp; the backward recomputes each tile's probabilities
// from it.
//
// Layout as the composed form's: q, out `[B, g, R·T, d]` (the R query heads of a kv group
// stacked as R blocks of T rows), k, v `[B, g, T, d]`; `ids [B, T]` (f32) is each
// position's sequence id, 0 for padding, several ids in a row that packs sequences (the
// decoder's batch mask rule): query i sees key j when j <= i, ids[j] != 0 and ids[i] is
// ids[j] or 0. A hidden key gets a finite bias of -1e30 (the decoder's MASKED), a key
// after the query -inf. A query with no visible key (left padding) attends to nothing:
// output 0, log-sum-exp +inf (the composed form gives such rows a uniform average nobody
// reads).
//
// Fragment layouts of m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with
// g = lane / 4 and c = lane % 4:
//   A (16 × 16, row-major), 4 registers of 2 elements: (g, 2c..2c+1), (g+8, 2c..),
//     (g, 2c+8..), (g+8, 2c+8..)
//   B (16 × 8, column-major), 2 registers: (k = 2c..2c+1, n = g), (k = 2c+8..2c+9, n = g)
//   C (16 × 8, f32), 4 floats: (g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1)
// so a C tile of scores, rounded to half precision, is already the A operand of the next
// product (P V, Pᵀ dO, dSᵀ Q) without a trip through shared memory.
#include "common.cuh"
#include <stdint.h>

#define BM 64  // query rows of a forward block (4 warps × 16)
#define BN 64  // keys of a tile (forward) or of a backward block (4 warps × 16)
#define PAD 8  // halves added to each shared-memory row (bank spread; rows stay 16-byte aligned)
#define LOG2E 1.4426950408889634f
#define HIDDEN_L2 (-1e30f * LOG2E)  // a hidden key's bias, in log2 units

// The bias of key id `kid` for query id `qid` (the batch mask's rule).
__device__ __forceinline__ float id_bias(float qid, float kid) {
    return kid == 0.0f || (qid != 0.0f && qid != kid) ? HIDDEN_L2 : 0.0f;
}

__device__ __forceinline__ uint16_t bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ uint16_t bits(__half x) { return __half_as_ushort(x); }

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    return uint32_t(bits(from_f<T>(lo))) | (uint32_t(bits(from_f<T>(hi))) << 16);
}

// Two elements of different rows as one register (the lower first).
template <typename T> __device__ __forceinline__ uint32_t join(T lo, T hi) {
    return uint32_t(bits(lo)) | (uint32_t(bits(hi)) << 16);
}

template <typename T> __device__ __forceinline__ uint32_t ld32(const T *p) {
    return *reinterpret_cast<const uint32_t *>(p);
}

// p[0] += x, p[1] += y as one 8-byte atomic (sm_90's vector atomics; `p` 8-byte aligned:
// an even column of an f32 row): half the atomics of the backward's accumulators.
__device__ __forceinline__ void add2(float *p, float x, float y) {
    atomicAdd(reinterpret_cast<float2 *>(p), make_float2(x, y));
}

// c += a · b on the tensor cores.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                    __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                    __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// `rows` rows of `D` elements from global `src` (row `first` on; rows past `t` read as
// zeros) into shared `dst` with rows of D + PAD, 16 bytes a load.
template <typename T, int D>
__device__ __forceinline__ void load_tile(T (*dst)[D + PAD], const T *src, int first, int rows,
                                          int t) {
    constexpr int CHUNKS = D / 8;
    for (int idx = threadIdx.x; idx < rows * CHUNKS; idx += blockDim.x) {
        const int r = idx / CHUNKS, col = (idx % CHUNKS) * 8;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (first + r < t) x = *reinterpret_cast<const uint4 *>(src + (long)(first + r) * D + col);
        *reinterpret_cast<uint4 *>(&dst[r][col]) = x;
    }
}

// One block: BM query rows of one head (heaviest tiles first), 4 warps of 16 rows, every
// key tile up to the diagonal. `scale_log2` = scale · log2(e); lse is stored in log2 units.
template <typename T, int D>
__device__ void flash_fwd(const T *q, const T *k, const T *v, const float *ids, T *out,
                          float *lse, int t, int groups, int reps, float scale_log2) {
    __shared__ __align__(16) T ks[BN][D + PAD];
    __shared__ __align__(16) T vs[BN][D + PAD];
    __shared__ float kids[BN];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x;
    const long head = blockIdx.y;  // (b · groups + group) · reps + rep
    const long bg = head / reps, b = bg / groups;
    const T *qh = q + head * (long)t * D;
    const T *kh = k + bg * (long)t * D;
    const T *vh = v + bg * (long)t * D;
    const float *idh = ids + b * (long)t;
    const int ra = qt * BM + warp * 16 + g, rb = ra + 8;
    const float ida = ra < t ? idh[ra] : 0.0f, idb = rb < t ? idh[rb] : 0.0f;

    uint32_t qa[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int col = kk * 16 + 2 * c;
        qa[kk][0] = ra < t ? ld32(qh + (long)ra * D + col) : 0u;
        qa[kk][1] = rb < t ? ld32(qh + (long)rb * D + col) : 0u;
        qa[kk][2] = ra < t ? ld32(qh + (long)ra * D + col + 8) : 0u;
        qa[kk][3] = rb < t ? ld32(qh + (long)rb * D + col + 8) : 0u;
    }
    float o[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float ma = -INFINITY, mb = -INFINITY, la = 0.0f, lb = 0.0f;

    const int tiles = (min(t, (qt + 1) * BM) + BN - 1) / BN;
    for (int kt = 0; kt < tiles; ++kt) {
        const int k0 = kt * BN;
        __syncthreads();
        load_tile<T, D>(ks, kh, k0, BN, t);
        load_tile<T, D>(vs, vh, k0, BN, t);
        for (int j = threadIdx.x; j < BN; j += blockDim.x) kids[j] = k0 + j < t ? idh[k0 + j] : 0.0f;
        __syncthreads();

        float s[BN / 8][4];
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
                const T *kr = &ks[nt * 8 + g][kk * 16 + 2 * c];
                mma(s[nt], qa[kk], ld32(kr), ld32(kr + 8), T());
            }
        }
        // Scale, mask, and the running max of each of the thread's two rows (the four
        // lanes of a row hold its columns: the max crosses them with two shuffles).
        float na = ma, nb = mb;
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = nt * 8 + 2 * c + (e & 1), key = k0 + j, row = e < 2 ? ra : rb;
                float x = s[nt][e] * scale_log2 + id_bias(e < 2 ? ida : idb, kids[j]);
                if (key >= t || key > row) x = -INFINITY;
                s[nt][e] = x;
                if (e < 2) na = fmaxf(na, x); else nb = fmaxf(nb, x);
            }
        }
        na = fmaxf(na, __shfl_xor_sync(0xffffffffu, na, 1));
        na = fmaxf(na, __shfl_xor_sync(0xffffffffu, na, 2));
        nb = fmaxf(nb, __shfl_xor_sync(0xffffffffu, nb, 1));
        nb = fmaxf(nb, __shfl_xor_sync(0xffffffffu, nb, 2));
        // Key 0 is in the first tile and at or before every row: the max is finite from
        // the first tile on, and exp2(-inf - finite) = 0 rescales the empty start.
        const float aa = exp2f(ma - na), ab = exp2f(mb - nb);
        ma = na;
        mb = nb;
        float sa = 0.0f, sb = 0.0f;
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
            s[nt][0] = exp2f(s[nt][0] - ma);
            s[nt][1] = exp2f(s[nt][1] - ma);
            s[nt][2] = exp2f(s[nt][2] - mb);
            s[nt][3] = exp2f(s[nt][3] - mb);
            sa += s[nt][0] + s[nt][1];
            sb += s[nt][2] + s[nt][3];
        }
        la = la * aa + sa;  // partial over this lane's columns; summed across lanes at the end
        lb = lb * ab + sb;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            o[dt][0] *= aa;
            o[dt][1] *= aa;
            o[dt][2] *= ab;
            o[dt][3] *= ab;
        }
        // O += P V: P's C tiles are the A operand; V's B operand pairs two rows.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                                    pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                    pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const int kr = kk * 16 + 2 * c;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                const int n = dt * 8 + g;
                mma(o[dt], pa, join(vs[kr][n], vs[kr + 1][n]), join(vs[kr + 8][n], vs[kr + 9][n]),
                    T());
            }
        }
    }
    la += __shfl_xor_sync(0xffffffffu, la, 1);
    la += __shfl_xor_sync(0xffffffffu, la, 2);
    lb += __shfl_xor_sync(0xffffffffu, lb, 1);
    lb += __shfl_xor_sync(0xffffffffu, lb, 2);
    // A row whose max is the hidden keys' bias saw no visible key: it attends to nothing.
    const bool ea = ma < -1e29f, eb = mb < -1e29f;
    const float ia = ea ? 0.0f : 1.0f / la, ib = eb ? 0.0f : 1.0f / lb;
    T *oh = out + head * (long)t * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        const int col = dt * 8 + 2 * c;
        if (ra < t)
            *reinterpret_cast<uint32_t *>(oh + (long)ra * D + col) = pack2<T>(o[dt][0] * ia, o[dt][1] * ia);
        if (rb < t)
            *reinterpret_cast<uint32_t *>(oh + (long)rb * D + col) = pack2<T>(o[dt][2] * ib, o[dt][3] * ib);
    }
    if (c == 0) {
        if (ra < t) lse[head * (long)t + ra] = ea ? INFINITY : ma + log2f(la);
        if (rb < t) lse[head * (long)t + rb] = eb ? INFINITY : mb + log2f(lb);
    }
}

// delta[r] = Σ_d dO[r, d] · O[r, d], one warp a row: the rowsum(P ⊙ dP) of the softmax's
// backward, which equals it because O = P V.
template <typename T, int D>
__device__ void flash_delta(const T *out, const T *dout, float *delta, long rows) {
    const long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (int d = lane; d < D; d += 32) acc += to_f(out[row * D + d]) * to_f(dout[row * D + d]);
    acc = warp_sum(acc);
    if (lane == 0) delta[row] = acc;
}

// One block: BN keys of one kv group against the queries of one of its R heads (every
// query at or after the block's first key), 4 warps of 16 keys, BQ queries a step. With P
// recomputed from the log-sum-exp and dS = scale · P ⊙ (dP − delta):
//   dV += Pᵀ dO,  dK += dSᵀ Q   (in registers, each warp its own keys; added to the f32
//                                accumulators once at the end: the R heads share them)
//   dQ += dS K                  (dSᵀ through shared memory; each warp a quarter of d,
//                                added to the f32 accumulator, which every key block shares)
// Shared memory, dynamic (past 48 KB for BQ = 32 and d = 128; flash.rs sizes it): the K
// and V tiles and the step's Q and dO (rows of D + PAD), dSᵀ (BN rows of BQ + PAD), then
// the step's log-sum-exps, deltas and query ids and the block's key ids (f32).

template <typename T, int D, int BQ>
__device__ void flash_bwd(const T *q, const T *k, const T *v, const float *ids, const T *dout,
                          const float *lse, const float *delta, float *dq, float *dk, float *dv,
                          int t, int groups, int reps, float scale, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem[];
    typedef T Row[D + PAD];
    Row *ks = reinterpret_cast<Row *>(smem);
    Row *vs = ks + BN;
    Row *qs = vs + BN;
    Row *dos = qs + BQ;
    typedef T DsRow[BQ + PAD];
    DsRow *dss = reinterpret_cast<DsRow *>(dos + BQ);
    float *lses = reinterpret_cast<float *>(dss + BN);
    float *deltas = lses + BQ, *qids = deltas + BQ, *kids = qids + BQ;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int k0 = (gridDim.x - 1 - blockIdx.x) * BN;
    const long head = blockIdx.y;
    const long bg = head / reps, b = bg / groups;
    const T *qh = q + head * (long)t * D;
    const T *doh = dout + head * (long)t * D;
    const float *lh = lse + head * (long)t, *dh = delta + head * (long)t;
    const float *idh = ids + b * (long)t;
    const int kw = warp * 16;  // the warp's first key in the block

    load_tile<T, D>(ks, k + bg * (long)t * D, k0, BN, t);
    load_tile<T, D>(vs, v + bg * (long)t * D, k0, BN, t);
    for (int j = threadIdx.x; j < BN; j += blockDim.x) kids[j] = k0 + j < t ? idh[k0 + j] : 0.0f;

    float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dka[dt][e] = dva[dt][e] = 0.0f;

    for (int i0 = k0; i0 < t; i0 += BQ) {
        __syncthreads();
        load_tile<T, D>(qs, qh, i0, BQ, t);
        load_tile<T, D>(dos, doh, i0, BQ, t);
        for (int i = threadIdx.x; i < BQ; i += blockDim.x) {
            lses[i] = i0 + i < t ? lh[i0 + i] : INFINITY;
            deltas[i] = i0 + i < t ? dh[i0 + i] : 0.0f;
            qids[i] = i0 + i < t ? idh[i0 + i] : 0.0f;
        }
        __syncthreads();

        // Sᵀ and dPᵀ (the warp's 16 keys × BQ queries): K and V rows as A, Q and dO as B.
        float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const int col = kk * 16 + 2 * c;
            const uint32_t ka[4] = {ld32(&ks[kw + g][col]), ld32(&ks[kw + g + 8][col]),
                                    ld32(&ks[kw + g][col + 8]), ld32(&ks[kw + g + 8][col + 8])};
            const uint32_t va[4] = {ld32(&vs[kw + g][col]), ld32(&vs[kw + g + 8][col]),
                                    ld32(&vs[kw + g][col + 8]), ld32(&vs[kw + g + 8][col + 8])};
#pragma unroll
            for (int nt = 0; nt < BQ / 8; ++nt) {
                const T *qr = &qs[nt * 8 + g][col];
                mma(st[nt], ka, ld32(qr), ld32(qr + 8), T());
                const T *dr = &dos[nt * 8 + g][col];
                mma(dpt[nt], va, ld32(dr), ld32(dr + 8), T());
            }
        }
        // Pᵀ and dSᵀ in place: rows are keys, columns queries.
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int jl = kw + g + (e < 2 ? 0 : 8), key = k0 + jl;
                const int il = nt * 8 + 2 * c + (e & 1), query = i0 + il;
                float p = exp2f(st[nt][e] * scale_log2 + id_bias(qids[il], kids[jl]) - lses[il]);
                if (key >= t || query >= t || key > query) p = 0.0f;
                st[nt][e] = p;
                dpt[nt][e] = scale * p * (dpt[nt][e] - deltas[il]);
            }
        }
        // dV += Pᵀ dO and dK += dSᵀ Q, 16 queries at a time: the C tiles as A operands,
        // dO and Q pairing rows.
#pragma unroll
        for (int kq = 0; kq < BQ / 16; ++kq) {
            const uint32_t pa[4] = {pack2<T>(st[2 * kq][0], st[2 * kq][1]),
                                    pack2<T>(st[2 * kq][2], st[2 * kq][3]),
                                    pack2<T>(st[2 * kq + 1][0], st[2 * kq + 1][1]),
                                    pack2<T>(st[2 * kq + 1][2], st[2 * kq + 1][3])};
            const uint32_t sa[4] = {pack2<T>(dpt[2 * kq][0], dpt[2 * kq][1]),
                                    pack2<T>(dpt[2 * kq][2], dpt[2 * kq][3]),
                                    pack2<T>(dpt[2 * kq + 1][0], dpt[2 * kq + 1][1]),
                                    pack2<T>(dpt[2 * kq + 1][2], dpt[2 * kq + 1][3])};
            const int r = kq * 16 + 2 * c;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                const int n = dt * 8 + g;
                mma(dva[dt], pa, join(dos[r][n], dos[r + 1][n]), join(dos[r + 8][n], dos[r + 9][n]),
                    T());
                mma(dka[dt], sa, join(qs[r][n], qs[r + 1][n]), join(qs[r + 8][n], qs[r + 9][n]), T());
            }
        }
        // dSᵀ to shared memory, then dQ (BQ queries × the warp's quarter of d) = dS K.
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt) {
            const int col = nt * 8 + 2 * c;
            *reinterpret_cast<uint32_t *>(&dss[kw + g][col]) = pack2<T>(dpt[nt][0], dpt[nt][1]);
            *reinterpret_cast<uint32_t *>(&dss[kw + g + 8][col]) = pack2<T>(dpt[nt][2], dpt[nt][3]);
        }
        __syncthreads();
        constexpr int QN = D / 4 / 8;  // the warp's n-tiles of dQ
        float *dqh = dq + head * (long)t * D;
#pragma unroll
        for (int mq = 0; mq < BQ / 16; ++mq) {
            const int m = mq * 16 + g;  // the thread's first query row in the step
            float dqa[QN][4];
#pragma unroll
            for (int nt = 0; nt < QN; ++nt) dqa[nt][0] = dqa[nt][1] = dqa[nt][2] = dqa[nt][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                const int r = kk * 16 + 2 * c;
                const uint32_t a[4] = {join(dss[r][m], dss[r + 1][m]),
                                       join(dss[r][m + 8], dss[r + 1][m + 8]),
                                       join(dss[r + 8][m], dss[r + 9][m]),
                                       join(dss[r + 8][m + 8], dss[r + 9][m + 8])};
#pragma unroll
                for (int nt = 0; nt < QN; ++nt) {
                    const int n = warp * (D / 4) + nt * 8 + g;
                    mma(dqa[nt], a, join(ks[r][n], ks[r + 1][n]), join(ks[r + 8][n], ks[r + 9][n]),
                        T());
                }
            }
#pragma unroll
            for (int nt = 0; nt < QN; ++nt) {
                const int col = warp * (D / 4) + nt * 8 + 2 * c;
                if (i0 + m < t) add2(dqh + (long)(i0 + m) * D + col, dqa[nt][0], dqa[nt][1]);
                if (i0 + m + 8 < t) add2(dqh + (long)(i0 + m + 8) * D + col, dqa[nt][2], dqa[nt][3]);
            }
        }
    }
    float *dkh = dk + bg * (long)t * D, *dvh = dv + bg * (long)t * D;
    const int ja = k0 + kw + g, jb = ja + 8;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        const int col = dt * 8 + 2 * c;
        if (ja < t) {
            add2(dkh + (long)ja * D + col, dka[dt][0], dka[dt][1]);
            add2(dvh + (long)ja * D + col, dva[dt][0], dva[dt][1]);
        }
        if (jb < t) {
            add2(dkh + (long)jb * D + col, dka[dt][2], dka[dt][3]);
            add2(dvh + (long)jb * D + col, dva[dt][2], dva[dt][3]);
        }
    }
}

#define FLASH_ENTRIES(T, S, D)                                                                      \
    extern "C" __global__ void __launch_bounds__(128)                                               \
        flash_fwd_d##D##_##S(const T *q, const T *k, const T *v, const float *ids, T *out,          \
                             float *lse, int t, int groups, int reps, float scale_log2) {           \
        flash_fwd<T, D>(q, k, v, ids, out, lse, t, groups, reps, scale_log2);                       \
    }                                                                                               \
    extern "C" __global__ void flash_delta_d##D##_##S(const T *out, const T *dout, float *delta,    \
                                                      long rows) {                                  \
        flash_delta<T, D>(out, dout, delta, rows);                                                  \
    }                                                                                               \
    FLASH_BWD(T, S, D, 16)                                                                          \
    FLASH_BWD(T, S, D, 32)

// The backward, `flash_bwd_d<D>_q<BQ>_<dtype>`, for BQ queries a step.
#define FLASH_BWD(T, S, D, BQ)                                                                      \
    extern "C" __global__ void __launch_bounds__(128) flash_bwd_d##D##_q##BQ##_##S(                 \
        const T *q, const T *k, const T *v, const float *ids, const T *dout, const float *lse,      \
        const float *delta, float *dq, float *dk, float *dv, int t, int groups, int reps,           \
        float scale, float scale_log2) {                                                            \
        flash_bwd<T, D, BQ>(q, k, v, ids, dout, lse, delta, dq, dk, dv, t, groups, reps, scale,     \
                            scale_log2);                                                            \
    }

FLASH_ENTRIES(__nv_bfloat16, bf16, 64)
FLASH_ENTRIES(__nv_bfloat16, bf16, 128)
FLASH_ENTRIES(__half, f16, 64)
FLASH_ENTRIES(__half, f16, 128)
