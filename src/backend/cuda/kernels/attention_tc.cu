// Causal grouped-query attention on the tensor cores (mma.sync m16n8k16, bf16 in, f32
// accumulate), for bf16 storage. Same layouts and results as attention.cu (the CUDA-core
// version, which is the reference it is tested against), and the same deterministic split of
// the backward: one kernel for dK/dV per key tile, one for dQ per query tile, no atomics.
//
// A block is two warps; each warp owns 16 rows (queries, or keys in the dK/dV kernel) and the
// block walks tiles of 32 keys (or queries). Score tiles go through shared memory in f32,
// where each lane handles half a row: row lane/2, columns (lane%2)·16 .. +16.
//
// The forward takes two passes over the keys: the first finds each row's log-sum-exp, the
// second accumulates exp(s − lse)·v with P rounded to bf16 for the tensor cores. Scores are
// recomputed rather than rescaled, which gives P exactly as the CPU defines it.
//
// The pip CUDA wheels ship no <mma.h>, so the 16×16 fragments below are written against the
// PTX ISA's documented m16n8k16 layouts. With g = lane/4 and q = lane%4:
//   A (16×16, row-major): reg0 = A[g][2q..2q+1], reg1 = A[g+8][2q..], reg2 = A[g][2q+8..],
//     reg3 = A[g+8][2q+8..] (two bf16 per register, the lower column in the low half);
//   B (16×8): reg0 = B[2q..2q+1][g], reg1 = B[2q+8..2q+9][g];
//   C (16×8, f32): c0 = C[g][2q], c1 = C[g][2q+1], c2 = C[g+8][2q], c3 = C[g+8][2q+1].
// A 16×16 B or C is two such 16×8 halves (columns 0–7, then 8–15).
#include "common.cuh"

#define ROWS 32    // rows per block: 2 warps × 16
#define TILE 32    // keys (or queries) per inner tile
#define PAD_H 8    // bf16 row padding, 16 bytes, against bank conflicts
#define PAD_F 4    // f32 row padding, 16 bytes

struct FragA { u32 r[4]; };   // 16×16 bf16, row-major operand
struct FragB { u32 r[4]; };   // 16×16 bf16, second operand: halves (r0, r1) and (r2, r3)
struct FragC { float c[8]; }; // 16×16 f32: halves c[0..3] and c[4..7]

__device__ __forceinline__ u32 lane_g() { return (threadIdx.x % 32) / 4; }
__device__ __forceinline__ u32 lane_q() { return threadIdx.x % 4; }

__device__ __forceinline__ u32 pack(bf16 lo, bf16 hi) {
    return (u32)__bfloat16_as_ushort(lo) | ((u32)__bfloat16_as_ushort(hi) << 16);
}

__device__ __forceinline__ void fill_zero(FragC& f) {
#pragma unroll
    for (int i = 0; i < 8; i++) f.c[i] = 0.0f;
}

// A = p[0..16)[0..16) of a row-major bf16 tile with row stride ld.
__device__ __forceinline__ void load_a(FragA& f, const bf16* p, int ld) {
    const int g = lane_g(), q = lane_q();
    f.r[0] = *(const u32*)(p + g * ld + 2 * q);
    f.r[1] = *(const u32*)(p + (g + 8) * ld + 2 * q);
    f.r[2] = *(const u32*)(p + g * ld + 2 * q + 8);
    f.r[3] = *(const u32*)(p + (g + 8) * ld + 2 * q + 8);
}

// B = Xᵀ, B[k][n] = x[n][k], for x row-major [16 n][16 k].
__device__ __forceinline__ void load_bt(FragB& f, const bf16* x, int ld) {
    const int g = lane_g(), q = lane_q();
#pragma unroll
    for (int h = 0; h < 2; h++) {
        f.r[2 * h] = *(const u32*)(x + (h * 8 + g) * ld + 2 * q);
        f.r[2 * h + 1] = *(const u32*)(x + (h * 8 + g) * ld + 2 * q + 8);
    }
}

// B = X, B[k][n] = x[k][n], for x row-major [16 k][16 n].
__device__ __forceinline__ void load_b(FragB& f, const bf16* x, int ld) {
    const int g = lane_g(), q = lane_q();
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int n = h * 8 + g;
        f.r[2 * h] = pack(x[(2 * q) * ld + n], x[(2 * q + 1) * ld + n]);
        f.r[2 * h + 1] = pack(x[(2 * q + 8) * ld + n], x[(2 * q + 9) * ld + n]);
    }
}

// c += a · b over one 16×16×16 step: two m16n8k16 MMAs.
__device__ __forceinline__ void mma(FragC& c, const FragA& a, const FragB& b) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c.c[4 * h]), "+f"(c.c[4 * h + 1]), "+f"(c.c[4 * h + 2]), "+f"(c.c[4 * h + 3])
            : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[2 * h]),
              "r"(b.r[2 * h + 1]));
    }
}

// out[0..16)[0..16) = c, row-major f32 with row stride ld.
__device__ __forceinline__ void store_c(float* out, int ld, const FragC& f) {
    const int g = lane_g(), q = lane_q();
#pragma unroll
    for (int h = 0; h < 2; h++) {
        out[g * ld + h * 8 + 2 * q] = f.c[4 * h];
        out[g * ld + h * 8 + 2 * q + 1] = f.c[4 * h + 1];
        out[(g + 8) * ld + h * 8 + 2 * q] = f.c[4 * h + 2];
        out[(g + 8) * ld + h * 8 + 2 * q + 1] = f.c[4 * h + 3];
    }
}

// Rows [first, first + ROWS) of one head (column offset `col`) of a [B·T, stride] bf16 tensor
// into dst[ROWS][ld]; rows past T are zero. Pairs of elements move as 32-bit words.
template <int D>
__device__ __forceinline__ void tc_load(bf16* dst, int ld, const bf16* src, int b, int first,
                                        int Tn, long long stride, long long col) {
    for (int idx = threadIdx.x; idx < ROWS * D / 2; idx += blockDim.x) {
        const int j = idx / (D / 2), c = (idx % (D / 2)) * 2;
        const int row = first + j;
        u32 v = 0;
        if (row < Tn) v = *(const u32*)(src + ((long long)b * Tn + row) * stride + col + c);
        *(u32*)(dst + j * ld + c) = v;
    }
}

// out[16][TILE] (f32, row stride ldo) = a[16][D] · b[TILE][D]ᵀ, for one warp.
template <int D>
__device__ __forceinline__ void tc_scores(float* out, int ldo, const bf16* a, int lda,
                                          const bf16* b, int ldb) {
#pragma unroll
    for (int n = 0; n < TILE; n += 16) {
        FragC acc;
        fill_zero(acc);
#pragma unroll
        for (int k = 0; k < D; k += 16) {
            FragA fa;
            FragB fb;
            load_a(fa, a + k, lda);
            load_bt(fb, b + n * ldb + k, ldb);
            mma(acc, fa, fb);
        }
        store_c(out + n, ldo, acc);
    }
}

// acc[n] += p[16][TILE] · x[TILE][D] for the D/16 column blocks n of the output.
template <int D>
__device__ __forceinline__ void tc_accumulate(FragC (&acc)[D / 16], const bf16* p, int ldp,
                                              const bf16* x, int ldx) {
#pragma unroll
    for (int k = 0; k < TILE; k += 16) {
        FragA fa;
        load_a(fa, p + k, ldp);
#pragma unroll
        for (int n = 0; n < D / 16; n++) {
            FragB fb;
            load_b(fb, x + k * ldx + n * 16, ldx);
            mma(acc[n], fa, fb);
        }
    }
}

// Writes the two warps' accumulators (rows first .. first + 31) as bf16 into columns
// [col, col + D) of a [B·T, stride] tensor, through `stage` (ROWS × (D + PAD_F) floats of
// shared memory that no one else uses now). Rows past T are skipped.
template <int D>
__device__ __forceinline__ void tc_store(bf16* dst, const FragC (&acc)[D / 16], float* stage,
                                         int b, int first, int Tn, long long stride,
                                         long long col) {
    constexpr int LDO = D + PAD_F;
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int n = 0; n < D / 16; n++)
        store_c(stage + warp * 16 * LDO + n * 16, LDO, acc[n]);
    __syncthreads();
    for (int idx = threadIdx.x; idx < ROWS * D; idx += blockDim.x) {
        const int r = idx / D, c = idx % D;
        const int row = first + r;
        if (row < Tn) dst[((long long)b * Tn + row) * stride + col + c] = __float2bfloat16_rn(stage[r * LDO + c]);
    }
}

// Shared memory of the forward, carved by hand so the output stage can reuse the K/V tiles.
template <int D> struct ForwardSmem {
    static constexpr int LDH = D + PAD_H, LDS = TILE + PAD_F, LDP = TILE + PAD_H;
    static constexpr int Q = 0;
    static constexpr int K = Q + ROWS * LDH * 2;
    static constexpr int V = K + TILE * LDH * 2;
    static constexpr int S = V + TILE * LDH * 2;
    static constexpr int P = S + ROWS * LDS * 4;
    static constexpr int BYTES = P + ROWS * LDP * 2;
    // The output stage (ROWS × (D + PAD_F) f32) fits in the K and V tiles.
    static_assert(ROWS * (D + PAD_F) * 4 <= S - K, "output stage does not fit");
};

// Grid: (ceil(T / 32), Hq, B); block 64.
template <int D>
__global__ void __launch_bounds__(64)
    attention_forward_tc(bf16* out, float* lse, const bf16* qkv, int Tn, int Hq, int Hkv,
                         float scale) {
    typedef ForwardSmem<D> L;
    __shared__ __align__(128) unsigned char smem[L::BYTES];
    bf16* qs = (bf16*)(smem + L::Q);
    bf16* ks = (bf16*)(smem + L::K);
    bf16* vs = (bf16*)(smem + L::V);
    float* ss = (float*)(smem + L::S);
    bf16* ps = (bf16*)(smem + L::P);
    const int q_tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (Hq / Hkv);
    const long long W = (long long)(Hq + 2 * Hkv) * D;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int q0 = q_tile * ROWS;
    const int row = warp * 16 + lane / 2, j0 = (lane % 2) * 16;
    const int qi = q0 + row;
    const bool valid = qi < Tn;
    float* ss_w = ss + warp * 16 * L::LDS;
    const int k_end = min(Tn, q0 + ROWS);  // causal: no key after the block's last query

    tc_load<D>(qs, L::LDH, qkv, b, q0, Tn, W, (long long)h * D);
    // Pass 1: each row's max and sum of exponentials, hence its log-sum-exp.
    float m = NEG_INF, l = 0.0f;
    for (int k0 = 0; k0 < k_end; k0 += TILE) {
        __syncthreads();  // the previous K tile is no longer read (and Q is loaded)
        tc_load<D>(ks, L::LDH, qkv, b, k0, Tn, W, (long long)(Hq + kvh) * D);
        __syncthreads();
        tc_scores<D>(ss_w, L::LDS, qs + warp * 16 * L::LDH, L::LDH, ks, L::LDH);
        __syncwarp();
        float s[16];
        float tile_max = NEG_INF;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int kj = k0 + j0 + j;
            s[j] = (valid && kj <= qi) ? ss[row * L::LDS + j0 + j] * scale : NEG_INF;
            tile_max = fmaxf(tile_max, s[j]);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        const float m_new = fmaxf(m, tile_max);
        const float m_use = m_new == NEG_INF ? 0.0f : m_new;  // no key seen yet: all exps 0
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; j++) sum += expf(s[j] - m_use);
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * expf(m - m_use) + sum;
        m = m_new;
    }
    const float row_lse = m + logf(l);
    if (lane % 2 == 0 && valid) lse[((long long)b * Hq + h) * Tn + qi] = row_lse;

    // Pass 2: O = Σ_j exp(s_j − lse) v_j.
    FragC o[D / 16];
#pragma unroll
    for (int n = 0; n < D / 16; n++) fill_zero(o[n]);
    for (int k0 = 0; k0 < k_end; k0 += TILE) {
        __syncthreads();
        tc_load<D>(ks, L::LDH, qkv, b, k0, Tn, W, (long long)(Hq + kvh) * D);
        tc_load<D>(vs, L::LDH, qkv, b, k0, Tn, W, (long long)(Hq + Hkv + kvh) * D);
        __syncthreads();
        tc_scores<D>(ss_w, L::LDS, qs + warp * 16 * L::LDH, L::LDH, ks, L::LDH);
        __syncwarp();
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int kj = k0 + j0 + j;
            const float p = (valid && kj <= qi) ? expf(ss[row * L::LDS + j0 + j] * scale - row_lse) : 0.0f;
            ps[row * L::LDP + j0 + j] = __float2bfloat16_rn(p);
        }
        __syncwarp();
        tc_accumulate<D>(o, ps + warp * 16 * L::LDP, L::LDP, vs, L::LDH);
    }
    __syncthreads();  // every warp is done with the K/V tiles, which become the stage
    tc_store<D>(out, o, (float*)(smem + L::K), b, q0, Tn, (long long)Hq * D, (long long)h * D);
}

// Shared memory of the backward kernels: four bf16 tiles (A, B, C, E), an f32 score tile, a
// bf16 tile of P or dS, and per-row statistics.
template <int D> struct BackwardSmem {
    static constexpr int LDH = D + PAD_H, LDS = TILE + PAD_F, LDP = TILE + PAD_H;
    static constexpr int A = 0;
    static constexpr int B = A + ROWS * LDH * 2;
    static constexpr int C = B + ROWS * LDH * 2;
    static constexpr int E = C + TILE * LDH * 2;
    static constexpr int S = E + TILE * LDH * 2;
    static constexpr int P = S + ROWS * LDS * 4;
    static constexpr int DS = P + ROWS * LDP * 2;
    static constexpr int STATS = DS + ROWS * LDP * 2;
    static constexpr int BYTES = STATS + 2 * TILE * 4;
    static_assert(ROWS * (D + PAD_F) * 4 <= C - A, "output stage does not fit");
};

// dK and dV of 32 keys of one kv head (the warp's 16 keys are the rows): over the group's
// query heads and the query tiles at or after the key tile,
//   Sᵀ = K·Qᵀ, Pᵀ = exp(Sᵀ·scale − lse), dPᵀ = V·dOᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ − delta) · scale,
//   dV += Pᵀ·dO, dK += dSᵀ·Q.
// Grid: (ceil(T / 32), Hkv, B); block 64.
template <int D>
__global__ void __launch_bounds__(64)
    attention_backward_dkdv_tc(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                               const float* delta, int Tn, int Hq, int Hkv, float scale) {
    typedef BackwardSmem<D> L;
    __shared__ __align__(128) unsigned char smem[L::BYTES];
    bf16* ks = (bf16*)(smem + L::A);
    bf16* vs = (bf16*)(smem + L::B);
    bf16* qs = (bf16*)(smem + L::C);
    bf16* dos = (bf16*)(smem + L::E);
    float* ss = (float*)(smem + L::S);
    bf16* ps = (bf16*)(smem + L::P);
    bf16* dss = (bf16*)(smem + L::DS);
    float* lses = (float*)(smem + L::STATS);
    float* deltas = lses + TILE;
    const int k_tile = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int group = Hq / Hkv;
    const long long W = (long long)(Hq + 2 * Hkv) * D;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int k0 = k_tile * ROWS;
    const int row = warp * 16 + lane / 2, j0 = (lane % 2) * 16;
    const int kj = k0 + row;
    float* ss_w = ss + warp * 16 * L::LDS;

    tc_load<D>(ks, L::LDH, qkv, b, k0, Tn, W, (long long)(Hq + kvh) * D);
    tc_load<D>(vs, L::LDH, qkv, b, k0, Tn, W, (long long)(Hq + Hkv + kvh) * D);
    FragC dk[D / 16], dv[D / 16];
#pragma unroll
    for (int n = 0; n < D / 16; n++) {
        fill_zero(dk[n]);
        fill_zero(dv[n]);
    }
    for (int g = 0; g < group; g++) {
        const int h = kvh * group + g;
        for (int q0 = k0; q0 < Tn; q0 += TILE) {
            __syncthreads();  // the previous Q/dO tiles are no longer read (and K/V are loaded)
            tc_load<D>(qs, L::LDH, qkv, b, q0, Tn, W, (long long)h * D);
            tc_load<D>(dos, L::LDH, dout, b, q0, Tn, (long long)Hq * D, (long long)h * D);
            load_row_stats(lses, deltas, lse, delta, ((long long)b * Hq + h) * Tn, q0, TILE, Tn);
            __syncthreads();
            tc_scores<D>(ss_w, L::LDS, ks + warp * 16 * L::LDH, L::LDH, qs, L::LDH);
            __syncwarp();
            float p[16];
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const int qi = q0 + j0 + j;
                const bool live = kj < Tn && qi < Tn && qi >= kj;
                p[j] = live ? expf(ss[row * L::LDS + j0 + j] * scale - lses[j0 + j]) : 0.0f;
                ps[row * L::LDP + j0 + j] = __float2bfloat16_rn(p[j]);
            }
            __syncwarp();  // the scores are read; dPᵀ overwrites them
            tc_scores<D>(ss_w, L::LDS, vs + warp * 16 * L::LDH, L::LDH, dos, L::LDH);
            __syncwarp();
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const float ds = p[j] * (ss[row * L::LDS + j0 + j] - deltas[j0 + j]) * scale;
                dss[row * L::LDP + j0 + j] = __float2bfloat16_rn(ds);
            }
            __syncwarp();
            tc_accumulate<D>(dv, ps + warp * 16 * L::LDP, L::LDP, dos, L::LDH);
            tc_accumulate<D>(dk, dss + warp * 16 * L::LDP, L::LDP, qs, L::LDH);
        }
    }
    __syncthreads();  // the K/V tiles become the stage
    tc_store<D>(dqkv, dk, (float*)(smem + L::A), b, k0, Tn, W, (long long)(Hq + kvh) * D);
    __syncthreads();
    tc_store<D>(dqkv, dv, (float*)(smem + L::A), b, k0, Tn, W, (long long)(Hq + Hkv + kvh) * D);
}

// dQ of 32 queries of one head (the warp's 16 queries are the rows), over the key tiles up to
// the diagonal: S = Q·Kᵀ, P = exp(S·scale − lse), dP = dO·Vᵀ, dS = P ⊙ (dP − delta) · scale,
// dQ += dS·K. Grid: (ceil(T / 32), Hq, B); block 64.
template <int D>
__global__ void __launch_bounds__(64)
    attention_backward_dq_tc(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                             const float* delta, int Tn, int Hq, int Hkv, float scale) {
    typedef BackwardSmem<D> L;
    __shared__ __align__(128) unsigned char smem[L::BYTES];
    bf16* qs = (bf16*)(smem + L::A);
    bf16* dos = (bf16*)(smem + L::B);
    bf16* ks = (bf16*)(smem + L::C);
    bf16* vs = (bf16*)(smem + L::E);
    float* ss = (float*)(smem + L::S);
    bf16* dss = (bf16*)(smem + L::DS);
    const int q_tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (Hq / Hkv);
    const long long W = (long long)(Hq + 2 * Hkv) * D;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int q0 = q_tile * ROWS;
    const int row = warp * 16 + lane / 2, j0 = (lane % 2) * 16;
    const int qi = q0 + row;
    const bool valid = qi < Tn;
    const long long stat_at = ((long long)b * Hq + h) * Tn + qi;
    const float row_lse = valid ? lse[stat_at] : 0.0f;
    const float row_delta = valid ? delta[stat_at] : 0.0f;
    float* ss_w = ss + warp * 16 * L::LDS;

    tc_load<D>(qs, L::LDH, qkv, b, q0, Tn, W, (long long)h * D);
    tc_load<D>(dos, L::LDH, dout, b, q0, Tn, (long long)Hq * D, (long long)h * D);
    FragC dq[D / 16];
#pragma unroll
    for (int n = 0; n < D / 16; n++) fill_zero(dq[n]);
    const int k_end = min(Tn, q0 + ROWS);
    for (int k0 = 0; k0 < k_end; k0 += TILE) {
        __syncthreads();
        tc_load<D>(ks, L::LDH, qkv, b, k0, Tn, W, (long long)(Hq + kvh) * D);
        tc_load<D>(vs, L::LDH, qkv, b, k0, Tn, W, (long long)(Hq + Hkv + kvh) * D);
        __syncthreads();
        tc_scores<D>(ss_w, L::LDS, qs + warp * 16 * L::LDH, L::LDH, ks, L::LDH);
        __syncwarp();
        float p[16];
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int kj = k0 + j0 + j;
            p[j] = (valid && kj <= qi) ? expf(ss[row * L::LDS + j0 + j] * scale - row_lse) : 0.0f;
        }
        __syncwarp();
        tc_scores<D>(ss_w, L::LDS, dos + warp * 16 * L::LDH, L::LDH, vs, L::LDH);
        __syncwarp();
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const float ds = p[j] * (ss[row * L::LDS + j0 + j] - row_delta) * scale;
            dss[row * L::LDP + j0 + j] = __float2bfloat16_rn(ds);
        }
        __syncwarp();
        tc_accumulate<D>(dq, dss + warp * 16 * L::LDP, L::LDP, ks, L::LDH);
    }
    __syncthreads();
    tc_store<D>(dqkv, dq, (float*)(smem + L::A), b, q0, Tn, W, (long long)h * D);
}
